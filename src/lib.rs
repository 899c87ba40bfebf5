//! # tpar
//!
//! Tensor, sequence, data and pipeline parallelism for Rust trainers, in the
//! shape PyTorch users know: `DeviceMesh`, `DTensor` with Shard/Replicate/Partial
//! placements, parallel styles and plans, FSDP. This crate is the facade: it
//! re-exports the layers under `crates/`.
//!
//! ```
//! use tpar::prelude::*;
//! let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3])?.requires_grad_(true);
//! x.square()?.sum_all()?.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//! # Ok::<(), tpar::tensor::TensorError>(())
//! ```
#![warn(missing_docs)]

pub use tpar_collectives as collectives;
pub use tpar_collectives::{spawn, spawn_with, SpawnConfig};
pub use tpar_dtensor as dtensor;
pub use tpar_kernels as kernels;
pub use tpar_mesh as mesh;
pub use tpar_nn as nn;
pub use tpar_parallel_styles as parallel;
pub use tpar_placements as placements;
pub use tpar_tensor as tensor;

/// The names a trainer uses most, in one import.
pub mod prelude {
    pub use tpar_collectives::{spawn, CollectiveError, ProcessGroup, RankCtx, ReduceOp};
    pub use tpar_dtensor::{distribute_tensor, DTensor, DTensorError};
    pub use tpar_mesh::{DeviceMesh, DeviceType, MeshError};
    pub use tpar_nn::{call, Args, Module, NnError, Param, Value};
    pub use tpar_parallel_styles::{
        explain, loss_parallel, parallelize_module, ColwiseParallel, ParallelizePlan, PlanError,
        PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
        SequenceParallel,
    };
    pub use tpar_placements::Placement;
    pub use tpar_tensor::{no_grad, DType, Device, Rng, RopeLayout, Shape, Tensor, TensorError};
}
