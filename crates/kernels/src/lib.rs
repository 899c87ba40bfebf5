//! The kernels of tpar's tensor core: CPU kernels (rayon) and CUDA kernels.
//!
//! Every CPU kernel works on contiguous row-major slices and is generic over the
//! [`Float`] element types (f32, f64, bf16, f16); half-precision inputs
//! accumulate in f32. GEMM, RMSNorm, RoPE, softmax, attention, cross-entropy
//! and embedding each live in their own folder with their fast CPU kernel and a
//! slow reference implementation the tests compare against.
//! [`cuda`] holds the CUDA side: the kernels' `.cu` sources, compiled at run time by
//! NVRTC (and checked on machines without a GPU by a CPU emulator of the CUDA
//! execution model), their launchers, and cuBLASLt.
#![warn(missing_docs)]

mod element;
mod error;
#[cfg(test)]
mod out_tests;
#[cfg(test)]
mod testutil;
mod util;

pub mod elementwise;
pub mod reduce;

pub mod adamw;
pub mod cross_entropy;
pub mod cuda;
pub mod dropout;
pub mod embedding;
pub mod gemm;
pub mod rmsnorm;
pub mod rope;
pub mod sdpa;
pub mod softmax;
pub mod vmath;

pub use element::{Acc, Float, Out};
pub use error::KernelError;

/// Result type of the kernels.
pub type Result<T> = std::result::Result<T, KernelError>;
