//! Element types and devices.

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float (used for gradient checks).
    F64,
    /// bfloat16 (accumulates in f32).
    BF16,
    /// IEEE half (accumulates in f32).
    F16,
    /// 64-bit signed integer (token ids, targets).
    I64,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Whether the type is a floating-point type (can carry gradients).
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }

    /// Short name, as in error messages: `f32`, `bf16`, ...
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a tensor's storage lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory; kernels run on rayon threads.
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
    /// No storage at all: shape and dtype only (deferred initialisation).
    Meta,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Meta => f.write_str("meta"),
        }
    }
}
