//! tpar's tensor core: a contiguous n-d [`Tensor`] (f32, bf16, f16, f64, i64) on
//! CPU, CUDA or the meta device, with reverse-mode autograd and the op set a
//! Llama needs (matmul, RMSNorm, RoPE, attention, cross-entropy, ...).
//!
//! ```
//! use tpar_tensor::{DType, Rng, Tensor};
//! let mut rng = Rng::new(0);
//! let x = Tensor::randn([4, 8], DType::F32, &mut rng)?;
//! let w = Tensor::randn([3, 8], DType::F32, &mut rng)?.requires_grad_(true);
//! let targets = Tensor::from_vec(vec![0i64, 2, 1, 2], [4])?;
//! let loss = x.linear(&w, None)?.cross_entropy(&targets, -100)?;
//! loss.backward()?;
//! assert_eq!(w.grad().unwrap().dims(), &[3, 8]);
//! # Ok::<(), tpar_tensor::TensorError>(())
//! ```
#![warn(missing_docs)]

pub mod autograd;
pub mod checkpoint;
mod dtype;
mod error;
pub mod gpu;
mod ops;
mod rng;

pub mod shape;
pub mod state;
mod storage;
mod tensor;
pub mod tol;

/// Per-rank memory accounting at the allocator (the `tpar-memory` crate):
/// install [`memory::TrackingAllocator`] as the global allocator to measure
/// peak memory per rank.
pub use tpar_memory as memory;

pub use autograd::no_grad;
pub use dtype::{DType, Device};
pub use error::TensorError;
pub use ops::{
    adamw_coefficients, block_attention_time, reset_block_attention_time, BlockAttentionTime,
    BlockMask, RopeLayout, SgdParams,
};
pub use rng::{get_rng_state, manual_seed, set_rng_state, Rng, RngState, DEFAULT_SEED};
pub use shape::Shape;
pub use storage::{
    check_alloc, human_bytes, storage_bytes, try_vec, CpuStorage, Element, PROBE_BYTES,
};
pub use tensor::{Attachment, Tensor, WeakTensor};
/// Hyper-parameters of one AdamW step ([`Tensor::adamw_step_each_`]).
pub use tpar_kernels::adamw::AdamWParams;

/// Result type of tensor ops.
pub type Result<T> = std::result::Result<T, TensorError>;

/// Makes ops whose results on a GPU depend on the order its blocks run in compute in a
/// fixed order instead, process-wide (PyTorch's `torch.use_deterministic_algorithms`):
/// the attention backward's dQ, which every key block otherwise adds with f32 atomics,
/// is then summed in key-block order whatever order the blocks run in (shown on the CPU
/// emulator with shuffled blocks; not yet run on a GPU), at a cost in speed where kv
/// heads times batch is below the GPU's multiprocessor count
/// ([`tpar_kernels::cuda::set_deterministic`]). The CPU kernels and every other device
/// kernel are deterministic either way (the embedding gradient sorts its positions on
/// the device).
///
/// ```
/// tpar_tensor::use_deterministic_algorithms(true);
/// assert!(tpar_tensor::are_deterministic_algorithms_enabled());
/// tpar_tensor::use_deterministic_algorithms(false);
/// ```
pub fn use_deterministic_algorithms(on: bool) {
    tpar_kernels::cuda::set_deterministic(on);
}

/// Whether [`use_deterministic_algorithms`] is on.
pub fn are_deterministic_algorithms_enabled() -> bool {
    tpar_kernels::cuda::deterministic()
}
