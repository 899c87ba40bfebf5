//! Tensor maps: the descriptors of Hopper's bulk tensor copies (TMA).
//!
//! A [`TensorMap`] is CUDA's `CUtensorMap`: 128 opaque bytes describing a
//! tiled view of a tensor in global memory (element type, up to 5 dims,
//! their byte strides, the box one copy moves, the shared-memory swizzle).
//! A kernel receives it inside its argument struct (64-byte aligned field,
//! the struct declared `TPAR_GRID_CONSTANT(Args)` in `TPAR_KERNEL`, see
//! `crates/kernels/cuda/README.md`) and copies boxes with `tma_load_2d` /
//! `tma_store_2d` of the prelude.
//!
//! [`TensorMap::encode_tiled`] builds one for a device: on a GPU through the
//! driver's `cuTensorMapEncodeTiled` ([`TensorMap::encode_tiled_driver`]), on
//! the CPU emulator in an encoding of its own that `cuda/emu/emu.cpp` reads
//! ([`TensorMap::encode_tiled_emulated`]). Both check the description against
//! the driver's rules first and name what is wrong.
//!
//! ```no_run
//! use tpar_kernels::cuda::tensor_map::{TensorMap, TensorMapDType, TensorMapSwizzle, TiledDesc};
//! let data = vec![0u16; 128 * 256];
//! // a 256 x 128 bf16 row-major matrix, copied in boxes of 64 rows x 64 columns
//! let map = TensorMap::encode_tiled_emulated(&TiledDesc {
//!     dtype: TensorMapDType::BF16,
//!     global: data.as_ptr() as u64,
//!     dims: &[128, 256],
//!     strides: &[128 * 2],
//!     box_dims: &[64, 64],
//!     swizzle: TensorMapSwizzle::B128,
//! })?;
//! # let _ = map;
//! # Ok::<(), tpar_kernels::KernelError>(())
//! ```

use super::{DevPtr, GpuDevice, MemorySpace};
use crate::{KernelError, Result};

/// CUDA's `CUtensorMap`: 128 bytes, 64-byte aligned (a kernel parameter
/// holding one must keep it at a 64-byte aligned offset).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct TensorMap {
    /// The encoded descriptor.
    pub opaque: [u64; 16],
}

/// Element types of a tensor map (`CUtensorMapDataType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorMapDType {
    /// 8-bit unsigned.
    U8,
    /// 16-bit unsigned.
    U16,
    /// 32-bit unsigned.
    U32,
    /// 32-bit signed.
    I32,
    /// 64-bit unsigned.
    U64,
    /// 64-bit signed.
    I64,
    /// IEEE half.
    F16,
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// bfloat16.
    BF16,
}

impl TensorMapDType {
    /// The `CUtensorMapDataType` value.
    pub fn code(self) -> u32 {
        match self {
            TensorMapDType::U8 => 0,
            TensorMapDType::U16 => 1,
            TensorMapDType::U32 => 2,
            TensorMapDType::I32 => 3,
            TensorMapDType::U64 => 4,
            TensorMapDType::I64 => 5,
            TensorMapDType::F16 => 6,
            TensorMapDType::F32 => 7,
            TensorMapDType::F64 => 8,
            TensorMapDType::BF16 => 9,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            TensorMapDType::U8 => 1,
            TensorMapDType::U16 | TensorMapDType::F16 | TensorMapDType::BF16 => 2,
            TensorMapDType::U32 | TensorMapDType::I32 | TensorMapDType::F32 => 4,
            TensorMapDType::U64 | TensorMapDType::I64 | TensorMapDType::F64 => 8,
        }
    }
}

/// How a box is laid out in shared memory (`CUtensorMapSwizzle`): rows of
/// the box (its innermost dimension) as written, or with the 16-byte chunks
/// of each row permuted by XOR with the row's position in the pattern
/// (32, 64 or 128 bytes wide; the pattern repeats every 256, 512 or 1024
/// bytes of shared memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorMapSwizzle {
    /// Rows as written.
    None,
    /// 32-byte swizzle.
    B32,
    /// 64-byte swizzle.
    B64,
    /// 128-byte swizzle.
    B128,
}

impl TensorMapSwizzle {
    /// The `CUtensorMapSwizzle` value.
    pub fn code(self) -> u32 {
        match self {
            TensorMapSwizzle::None => 0,
            TensorMapSwizzle::B32 => 1,
            TensorMapSwizzle::B64 => 2,
            TensorMapSwizzle::B128 => 3,
        }
    }

    /// The swizzle width in bytes (0 for none).
    pub fn bytes(self) -> usize {
        match self {
            TensorMapSwizzle::None => 0,
            TensorMapSwizzle::B32 => 32,
            TensorMapSwizzle::B64 => 64,
            TensorMapSwizzle::B128 => 128,
        }
    }
}

/// A tiled view of a tensor in global memory, dims innermost first (as
/// `cuTensorMapEncodeTiled` takes them). Element strides are 1, interleave
/// none, out-of-bounds elements read as zeros.
#[derive(Clone, Copy, Debug)]
pub struct TiledDesc<'a> {
    /// Element type.
    pub dtype: TensorMapDType,
    /// Address of element (0, .., 0); 16-byte aligned.
    pub global: DevPtr,
    /// Size of each dim (1 to 5 dims), innermost (contiguous) first.
    pub dims: &'a [u64],
    /// Byte stride of dims 1.. (one fewer than `dims`): multiples of 16.
    pub strides: &'a [u64],
    /// Elements of each dim one copy moves (1..=256 each); the innermost
    /// box dim times the element size is a multiple of 16 bytes.
    pub box_dims: &'a [u32],
    /// Shared-memory layout of the box.
    pub swizzle: TensorMapSwizzle,
}

const OP: &str = "cuTensorMapEncodeTiled";
const MAGIC: u32 = u32::from_le_bytes(*b"TPTM");

fn bad(what: String) -> KernelError {
    KernelError::BadArguments { op: OP, what }
}

impl TiledDesc<'_> {
    /// Checks the description against the driver's rules.
    pub fn validate(&self) -> Result<()> {
        let rank = self.dims.len();
        if !(1..=5).contains(&rank) {
            return Err(bad(format!("{rank} dims; a tensor map has 1 to 5")));
        }
        if self.strides.len() + 1 != rank || self.box_dims.len() != rank {
            return Err(bad(format!(
                "{rank} dims need {} strides and {rank} box sizes; got {} and {}",
                rank - 1,
                self.strides.len(),
                self.box_dims.len()
            )));
        }
        if !self.global.is_multiple_of(16) {
            return Err(bad(format!("global address {:#x} is not 16-byte aligned", self.global)));
        }
        for (i, &d) in self.dims.iter().enumerate() {
            if d == 0 || d > 1 << 32 {
                return Err(bad(format!("dim {i} of size {d}: sizes are 1 to 2^32")));
            }
        }
        for (i, &s) in self.strides.iter().enumerate() {
            if !s.is_multiple_of(16) || s >= 1 << 40 {
                return Err(bad(format!(
                    "stride of dim {} is {s} bytes: a multiple of 16 below 2^40 is needed",
                    i + 1
                )));
            }
        }
        for (i, &b) in self.box_dims.iter().enumerate() {
            if b == 0 || b > 256 {
                return Err(bad(format!("box size {b} in dim {i}: box sizes are 1 to 256")));
            }
        }
        let esize = self.dtype.size();
        let inner = self.box_dims[0] as usize * esize;
        if !inner.is_multiple_of(16) {
            return Err(bad(format!(
                "the box's innermost extent is {inner} bytes ({} x {esize}): a multiple of 16 \
                 is needed",
                self.box_dims[0]
            )));
        }
        let span = self.swizzle.bytes();
        if span > 0 && inner > span {
            return Err(bad(format!(
                "the box's innermost extent is {inner} bytes, wider than the {span}-byte swizzle"
            )));
        }
        Ok(())
    }
}

impl TensorMap {
    /// A tensor map for `dev`: the driver's encoding on a GPU, the emulated
    /// one on the CPU emulator.
    pub fn encode_tiled(dev: &dyn GpuDevice, desc: &TiledDesc) -> Result<TensorMap> {
        match dev.memory_space() {
            MemorySpace::Host => TensorMap::encode_tiled_emulated(desc),
            _ => TensorMap::encode_tiled_driver(desc),
        }
    }

    /// The encoding the CPU emulator reads (what `cuTensorMapEncodeTiled`
    /// would describe, in a layout of the emulator's own). Besides the
    /// driver's rules, a swizzled box must be exactly as wide as its swizzle
    /// (the layout of narrower swizzled boxes is not modelled).
    pub fn encode_tiled_emulated(desc: &TiledDesc) -> Result<TensorMap> {
        desc.validate()?;
        let esize = desc.dtype.size();
        let span = desc.swizzle.bytes();
        if span > 0 && desc.box_dims[0] as usize * esize != span {
            return Err(bad(format!(
                "the emulator models swizzled boxes exactly as wide as the swizzle: innermost \
                 extent {} bytes with the {span}-byte swizzle",
                desc.box_dims[0] as usize * esize
            )));
        }
        let mut b = [0u8; 128];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = desc.dtype.code() as u8;
        b[5] = desc.dims.len() as u8;
        b[6] = esize as u8;
        b[7] = desc.swizzle.code() as u8;
        b[16..24].copy_from_slice(&desc.global.to_le_bytes());
        for (i, &d) in desc.dims.iter().enumerate() {
            b[24 + 8 * i..32 + 8 * i].copy_from_slice(&d.to_le_bytes());
            b[96 + 2 * i..98 + 2 * i].copy_from_slice(&(desc.box_dims[i] as u16).to_le_bytes());
            b[106 + i] = 1;
        }
        for (i, &s) in desc.strides.iter().enumerate() {
            b[64 + 8 * i..72 + 8 * i].copy_from_slice(&s.to_le_bytes());
        }
        let mut map = TensorMap { opaque: [0; 16] };
        bytemuck::bytes_of_mut(&mut map).copy_from_slice(&b);
        Ok(map)
    }

    /// The driver's `cuTensorMapEncodeTiled` (cudarc's raw binding): for
    /// kernels on a GPU. Fails with [`KernelError::Cuda`] when the driver is
    /// missing or refuses the description.
    pub fn encode_tiled_driver(desc: &TiledDesc) -> Result<TensorMap> {
        use cudarc::driver::sys;
        desc.validate()?;
        super::device::device_count()?;
        let rank = desc.dims.len();
        let elem_strides = [1u32; 5];
        let dtype = match desc.dtype {
            TensorMapDType::U8 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            TensorMapDType::U16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            TensorMapDType::U32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
            TensorMapDType::I32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_INT32,
            TensorMapDType::U64 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT64,
            TensorMapDType::I64 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_INT64,
            TensorMapDType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            TensorMapDType::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            TensorMapDType::F64 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
            TensorMapDType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        };
        let swizzle = match desc.swizzle {
            TensorMapSwizzle::None => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
            TensorMapSwizzle::B32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
            TensorMapSwizzle::B64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            TensorMapSwizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        };
        let mut raw = sys::CUtensorMap { opaque: [0; 16] };
        let call = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `raw` is a 128-byte aligned CUtensorMap the call writes; the
            // dims, strides, box and element-stride arrays hold `rank`, `rank - 1`,
            // `rank` and `rank` entries (validated above); the global address is
            // only recorded, not dereferenced, by the encoding.
            unsafe {
                sys::cuTensorMapEncodeTiled(
                    &mut raw,
                    dtype,
                    rank as u32,
                    desc.global as *mut std::ffi::c_void,
                    desc.dims.as_ptr(),
                    desc.strides.as_ptr(),
                    desc.box_dims.as_ptr(),
                    elem_strides.as_ptr(),
                    sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                    swizzle,
                    sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                    sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                )
            }
        }))
        .map_err(|_| {
            super::cuda_error(OP, "the driver does not provide cuTensorMapEncodeTiled (CUDA 12+)")
        })?;
        if call != sys::CUresult::CUDA_SUCCESS {
            return Err(super::cuda_error(OP, format!("the driver refused {desc:?}: {call:?}")));
        }
        Ok(TensorMap { opaque: raw.opaque })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc<'a>(dims: &'a [u64], strides: &'a [u64], box_dims: &'a [u32]) -> TiledDesc<'a> {
        TiledDesc {
            dtype: TensorMapDType::BF16,
            global: 4096,
            dims,
            strides,
            box_dims,
            swizzle: TensorMapSwizzle::B128,
        }
    }

    #[test]
    fn bad_descriptions_are_named() {
        let e = |d: TiledDesc| TensorMap::encode_tiled_emulated(&d).unwrap_err().to_string();
        assert!(e(desc(&[64, 8], &[128], &[64])).contains("box sizes"));
        assert!(e(desc(&[64, 8], &[120], &[64, 8])).contains("multiple of 16"));
        assert!(e(desc(&[64, 8], &[128], &[128, 8])).contains("wider than the 128-byte"));
        assert!(e(desc(&[64, 8], &[128], &[32, 8])).contains("exactly as wide"));
        assert!(e(desc(&[64, 8], &[128], &[64, 300])).contains("1 to 256"));
        assert!(e(desc(&[0, 8], &[128], &[64, 8])).contains("dim 0"));
        assert!(
            e(TiledDesc { global: 4100, ..desc(&[64, 8], &[128], &[64, 8]) }).contains("aligned")
        );
        assert!(e(desc(&[1; 6], &[16; 5], &[8; 6])).contains("1 to 5"));
        assert!(TensorMap::encode_tiled_emulated(&desc(&[64, 8], &[128], &[64, 8])).is_ok());
    }

    #[test]
    fn the_emulated_encoding_holds_the_description() {
        let m = TensorMap::encode_tiled_emulated(&desc(&[64, 9], &[160], &[64, 8])).unwrap();
        let b = bytemuck::bytes_of(&m);
        assert_eq!(&b[0..4], b"TPTM");
        assert_eq!((b[4], b[5], b[6], b[7]), (9, 2, 2, 3));
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), 4096);
        assert_eq!(u64::from_le_bytes(b[32..40].try_into().unwrap()), 9);
        assert_eq!(u64::from_le_bytes(b[64..72].try_into().unwrap()), 160);
        assert_eq!(u16::from_le_bytes(b[98..100].try_into().unwrap()), 8);
        assert_eq!(std::mem::align_of::<TensorMap>(), 64);
        assert_eq!(std::mem::size_of::<TensorMap>(), 128);
    }
}
