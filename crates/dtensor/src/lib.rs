//! `DTensor`: a tensor distributed over a [`DeviceMesh`] with `Shard` / `Replicate` /
//! `Partial` placements, redistributed between any two layouts by the planner's steps,
//! differentiable end to end.
//!
//! ```
//! use tpar_collectives::spawn;
//! use tpar_dtensor::{distribute_tensor, DTensorError};
//! use tpar_mesh::{DeviceMesh, DeviceType};
//! use tpar_placements::Placement::{Replicate, Shard};
//! use tpar_tensor::{DType, Tensor};
//! let out = spawn(2, |ctx| -> Result<Vec<f32>, DTensorError> {
//!     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
//!     let full = Tensor::arange(6, DType::F32).reshape([3, 2])?;
//!     let d = distribute_tensor(&full, &mesh, &[Shard(0)])?; // rank 0: rows 0..2, rank 1: row 2
//!     let back = d.redistribute(&[Replicate])?.to_local(); // one all_gather
//!     Ok(back.to_vec::<f32>()?)
//! })?;
//! assert_eq!(out[1], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
//! # Ok::<(), DTensorError>(())
//! ```
#![warn(missing_docs)]

pub mod context_parallel;
mod dtensor;
mod error;
pub mod local_layout;
pub mod mode;
pub mod ops;
pub mod redistribute;
mod spec;

pub use context_parallel::{context_parallel_attention, ContextParallel, CpLayout, CpMethod};
pub use dtensor::{distribute_tensor, distribute_tensor_from, DTensor};
pub use error::{DTensorError, Result};
pub use mode::{
    implicit_redistributions, strict, take_implicit_redistributions, ImplicitRedistribution,
    IMPLICIT_TRACE_LIMIT,
};
pub use spec::DTensorSpec;
pub use tpar_mesh::DeviceMesh;
pub use tpar_placements::{Placement, ReduceOp};
