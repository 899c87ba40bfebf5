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
//! # Ok::<(), tpar::Error>(())
//! ```
#![warn(missing_docs)]

pub use tpar_checkpoint as checkpoint;
pub use tpar_collectives as collectives;
pub use tpar_collectives::{
    spawn, spawn_owned, spawn_scoped, spawn_with, RankThreads, SpawnConfig,
};
pub use tpar_data as data;
pub use tpar_dtensor as dtensor;
pub use tpar_fsdp as fsdp;
pub use tpar_kernels as kernels;
pub use tpar_launch as launch;
pub use tpar_mesh as mesh;
pub use tpar_models as models;
pub use tpar_nn as nn;
pub use tpar_optim as optim;
pub use tpar_parallel_styles as parallel;
pub use tpar_pipeline as pipeline;
pub use tpar_placements as placements;
pub use tpar_tensor as tensor;

mod error;
pub use error::{Error, Result};

/// The names a trainer uses, in one import: most of what `examples/llama_2d.rs` needs
/// (mesh, tensors, DTensor and placements, the Llama and its plans, parallel styles,
/// FSDP / DDP / ZeRO-1, loss_parallel, optimizers and schedules, the data pipeline) and
/// the facade's [`Error`] / [`Result`].
pub mod prelude {
    pub use crate::{Error, Result};
    pub use tpar_checkpoint::{
        CheckpointConfig, CheckpointError, CheckpointManager, ModuleState, RunConfig, StateDict,
        StateDictError, StateDictOptions, StateValue, Stateful,
    };
    pub use tpar_collectives::{
        spawn, spawn_owned, spawn_scoped, spawn_with, CollectiveError, ProcessGroup, RankCtx,
        RankThreads, ReduceOp, SpawnConfig,
    };
    pub use tpar_data::{
        default_documents, load_documents, load_tokenizer, ByteTokenizer, DataError,
        DistributedSampler, HfTokenizer, PretrainingDataset, Tokenizer,
    };
    pub use tpar_dtensor::{distribute_tensor, DTensor, DTensorError};
    pub use tpar_mesh::{DeviceMesh, DeviceType, MeshError};
    pub use tpar_models::llama_plans::{
        megatron_layer_plan, parallelize_llama, parallelize_llama_stage,
        sequence_parallel_layer_plan, top_level_plan,
    };
    pub use tpar_models::memory::{
        check_fits, least_recompute, predict_memory, predict_memory_stage, DataParallelMode,
        MemoryConfig, MemoryError, MemoryEstimate, TpPlan,
    };
    pub use tpar_models::{LlamaConfig, LlamaForPretraining, LlamaStage};
    pub use tpar_nn::{
        apply_activation_checkpointing, apply_activation_checkpointing_to, call,
        checkpoint_wrapper, named_parameters, parameters, reset_parameters, AcPolicy, Args,
        CheckpointWrapper, Module, NnError, Param, Value,
    };
    pub use tpar_optim::{
        clip_grad_norm_, AdamW, AdamWConfig, ClipOptions, CosineAnnealingLR, LinearLR, LrScheduler,
        Optimizer, SequentialLR, Sgd, SgdConfig, ZeroRedundancyOptimizer,
    };
    pub use tpar_parallel_styles::{
        explain, explain_collectives, fully_shard, loss_parallel, parallelize_module,
        set_fsdp_timeline, sync_module_states, unshard, ColwiseParallel, DataParallel, FsdpConfig,
        FsdpTimeline, MixedPrecision, ParallelizePlan, PlanError, PrepareModuleInput,
        PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
    };
    pub use tpar_pipeline::{
        PipelineError, PipelineSchedule, PipelineStage, Schedule, ScheduleKind,
    };
    pub use tpar_placements::{Placement, PlacementError};
    pub use tpar_tensor::{no_grad, DType, Device, Rng, RopeLayout, Shape, Tensor, TensorError};
}
