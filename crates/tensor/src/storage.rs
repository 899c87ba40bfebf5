//! Host storage: one typed buffer per dtype.

use half::{bf16, f16};

use crate::{DType, Result, Shape, TensorError};

/// Allocations at least this large are first tried with a fallible reservation, so a size
/// the machine cannot hold is a typed error instead of an abort.
pub const PROBE_BYTES: usize = 64 << 20;

/// `bytes` for people: `"4.0 GiB (4294967296 bytes)"`.
pub fn human_bytes(bytes: u128) -> String {
    if bytes == u128::MAX {
        return "more than 2^128 bytes".into();
    }
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{v:.1} {} ({bytes} bytes)", units[u])
    }
}

/// The bytes a `dtype` tensor of `shape` needs, checked: an [`TensorError::OutOfMemory`]
/// when the element count or the byte count overflows `usize`.
pub fn storage_bytes(op: &'static str, shape: &Shape, dtype: DType) -> Result<usize> {
    let bytes = shape.dims().iter().try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d));
    bytes.ok_or_else(|| {
        let wide = shape
            .dims()
            .iter()
            .try_fold(dtype.size_in_bytes() as u128, |acc, &d| acc.checked_mul(d as u128));
        TensorError::OutOfMemory {
            op,
            shape: shape.clone(),
            dtype,
            bytes: wide.unwrap_or(u128::MAX),
            why: "more bytes than the address space holds".into(),
        }
    })
}

/// A vector of `n` copies of `v` for a `dtype` tensor of `shape`, allocated fallibly: an
/// [`TensorError::OutOfMemory`] naming `op`, the shape and the bytes when the size
/// overflows or the allocator refuses, never an abort.
pub fn try_vec<T: Clone>(op: &'static str, shape: &Shape, dtype: DType, v: T) -> Result<Vec<T>> {
    let bytes = storage_bytes(op, shape, dtype)?;
    let n = bytes.checked_div(dtype.size_in_bytes()).unwrap_or(0);
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| TensorError::OutOfMemory {
        op,
        shape: shape.clone(),
        dtype,
        bytes: bytes as u128,
        why: "the allocator refused it".into(),
    })?;
    out.resize(n, v);
    Ok(out)
}

/// Checks that a `dtype` tensor of `shape` can be allocated before a computation builds
/// it with an infallible allocation: its size must not overflow, and sizes of at least
/// [`PROBE_BYTES`] are reserved (and released) once to ask the allocator.
pub fn check_alloc(op: &'static str, shape: &Shape, dtype: DType) -> Result<usize> {
    let bytes = storage_bytes(op, shape, dtype)?;
    if bytes >= PROBE_BYTES {
        let mut probe: Vec<u8> = Vec::new();
        probe.try_reserve_exact(bytes).map_err(|_| TensorError::OutOfMemory {
            op,
            shape: shape.clone(),
            dtype,
            bytes: bytes as u128,
            why: "the allocator refused it".into(),
        })?;
    }
    Ok(bytes)
}

/// A host buffer of one of the supported element types.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
    /// i64 elements.
    I64(Vec<i64>),
}

impl CpuStorage {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
        }
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A `dtype` buffer for `shape` filled with `v` (converted), allocated fallibly: an
    /// [`TensorError::OutOfMemory`] naming `op` instead of an abort.
    pub fn try_full(op: &'static str, shape: &Shape, dtype: DType, v: f64) -> Result<Self> {
        Ok(crate::with_any_type!(dtype, |T| {
            T::wrap(try_vec(op, shape, dtype, <T as Element>::from_f64(v))?)
        }))
    }

    /// A zero-filled buffer (aborts if the allocation fails; see [`CpuStorage::try_full`]).
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::I64 => CpuStorage::I64(vec![0; n]),
        }
    }
}

/// A Rust type that can be a tensor element.
pub trait Element: Copy + Send + Sync + Default + std::fmt::Debug + 'static {
    /// The tensor dtype of this element type.
    const DTYPE: DType;
    /// The typed slice, if the storage holds this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// The typed mutable slice, if the storage holds this type.
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    /// Wraps a vector into storage.
    fn wrap(v: Vec<Self>) -> CpuStorage;
    /// The elements, when `s` holds this type (else `s` back).
    fn unwrap(s: CpuStorage) -> std::result::Result<Vec<Self>, CpuStorage>;
    /// Converts to f64.
    fn to_f64(self) -> f64;
    /// Converts from f64 (rounding, or truncating for integers).
    fn from_f64(v: f64) -> Self;
}

macro_rules! element {
    ($t:ty, $variant:ident, $to:expr, $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            fn unwrap(s: CpuStorage) -> std::result::Result<Vec<Self>, CpuStorage> {
                match s {
                    CpuStorage::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            fn from_f64(v: f64) -> Self {
                ($from)(v)
            }
        }
    };
}

/// `v` rounded to f32 by round-to-odd: an exact value is kept, any other is cut toward
/// zero and its last bit set. A second rounding (to nearest even) to a format at least
/// two bits narrower, bf16 or f16, is then the correct rounding of `v` itself: `half`'s
/// `from_f64` drops the low 32 bits of an f64 first, which turns about one in 10^4 of
/// f32 values just above a tie into a tie rounded the wrong way.
fn f32_round_to_odd(v: f64) -> f32 {
    let r = v as f32;
    if !r.is_finite() || f64::from(r) == v {
        return r;
    }
    // `r` is the nearest f32; step back toward zero where it rounded away from it.
    let bits = if f64::from(r).abs() > v.abs() { r.to_bits() - 1 } else { r.to_bits() };
    f32::from_bits(bits | 1)
}

element!(f32, F32, |x: f32| x as f64, |v: f64| v as f32);
element!(f64, F64, |x: f64| x, |v: f64| v);
element!(bf16, BF16, |x: bf16| x.to_f64(), |v: f64| bf16::from_f32(f32_round_to_odd(v)));
element!(f16, F16, |x: f16| x.to_f64(), |v: f64| f16::from_f32(f32_round_to_odd(v)));
element!(i64, I64, |x: i64| x as f64, |v: f64| v as i64);

/// A `Vec` of `n` default (zero) elements, in a buffer kept by the host cache when one
/// of this type and size is there (`tpar_memory::cache`): its pages are already mapped.
pub(crate) fn zeros_vec<T: Element>(n: usize) -> Vec<T> {
    match tpar_memory::cache::take::<T>(n) {
        Some(mut v) => {
            v.resize(n, T::default());
            v
        }
        None => vec![T::default(); n],
    }
}

/// An empty `Vec` with room for `n` elements, from the host cache when it keeps a
/// buffer of this type and size; for outputs written in order.
pub(crate) fn empty_vec<T: Element>(n: usize) -> Vec<T> {
    tpar_memory::cache::take::<T>(n).unwrap_or_else(|| Vec::with_capacity(n))
}

/// Hands a host storage's buffer to the host cache (which keeps it when large).
pub(crate) fn recycle(s: CpuStorage) {
    use tpar_memory::cache::give;
    match s {
        CpuStorage::F32(v) => give(v),
        CpuStorage::F64(v) => give(v),
        CpuStorage::BF16(v) => give(v),
        CpuStorage::F16(v) => give(v),
        CpuStorage::I64(v) => give(v),
    }
}

/// Storage of a tensor on any device.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuStorage),
    /// Memory of a CUDA device (a GPU or the emulator).
    Gpu(crate::gpu::GpuStorage),
    /// No data (meta device).
    Meta,
    /// Data released to save memory (FSDP between uses); refilled with
    /// [`crate::Tensor::fill_storage_`].
    Released,
}

/// Runs `$body` with `$T` bound to the Rust type of a float dtype; `I64` is an error for `$op`.
#[macro_export]
#[doc(hidden)]
macro_rules! with_float_type {
    ($dtype:expr, $op:expr, |$T:ident| $body:block) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::I64 => Err($crate::TensorError::DTypeMismatch {
                op: $op,
                expected: "a float dtype".into(),
                got: $crate::DType::I64,
            }),
        }
    };
}

/// Runs `$body` with `$T` bound to the Rust type of any dtype.
#[macro_export]
#[doc(hidden)]
macro_rules! with_any_type {
    ($dtype:expr, |$T:ident| $body:block) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
        }
    };
}
