//! Tensor and sequence parallelism the way PyTorch users write it: styles
//! ([`ColwiseParallel`], [`RowwiseParallel`], [`SequenceParallel`],
//! [`PrepareModuleInput`], [`PrepareModuleOutput`]) applied to modules by name with
//! [`parallelize_module`], and [`loss_parallel`]'s cross-entropy on vocab-sharded logits;
//! data parallelism as FSDP ([`fully_shard`]) and DDP ([`DataParallel`]). ZeRO-1
//! optimizer-state sharding is `tpar_optim::ZeroRedundancyOptimizer`; the Llama's
//! plans are in `tpar_models::llama_plans`.
#![warn(missing_docs)]

mod error;
mod explain;
mod fsdp;
pub mod loss_parallel {
    //! Cross-entropy on vocab-sharded logits (see [`cross_entropy`]).
    pub use crate::loss::{backward, cross_entropy, enable};
}
mod loss;
mod plan;
mod style;
pub mod trace;

pub use error::{PlanError, Result};
pub use explain::explain;
pub use fsdp::{fully_shard, unshard, DataParallel, FsdpConfig, MixedPrecision};
pub use plan::{apply_plan, check_plan, matches, parallelize_module, ParallelizePlan};
pub use style::{
    ColwiseParallel, InputLayout, OutputLayout, ParallelStyle, PrepareModuleInput,
    PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, StyleLayouts,
};
