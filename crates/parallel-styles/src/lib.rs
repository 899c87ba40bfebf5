//! Tensor and sequence parallelism the way PyTorch users write it: styles
//! ([`ColwiseParallel`], [`RowwiseParallel`], [`SequenceParallel`],
//! [`PrepareModuleInput`], [`PrepareModuleOutput`]) applied to modules by name with
//! [`parallelize_module`], and [`loss_parallel`]'s cross-entropy on vocab-sharded logits;
//! data parallelism as FSDP ([`fully_shard`]) and DDP ([`DataParallel`]). ZeRO-1
//! optimizer-state sharding is `tpar_optim::ZeroRedundancyOptimizer`; the Llama's
//! plans are in `tpar_models::llama_plans`.
//!
//! A 2-D (dp x tp) Llama in a few lines: a per-layer plan applied with
//! [`parallelize_module`], FSDP units with [`fully_shard`], and the loss under
//! [`loss_parallel::enable`] (four ranks as threads):
//!
//! ```
//! use tpar_collectives::spawn;
//! use tpar_mesh::{DeviceMesh, DeviceType};
//! use tpar_models::{LlamaConfig, LlamaForPretraining};
//! use tpar_nn::reset_parameters;
//! use tpar_parallel_styles::{
//!     fully_shard, loss_parallel, parallelize_module, ColwiseParallel, FsdpConfig,
//!     ParallelizePlan, RowwiseParallel,
//! };
//! use tpar_tensor::{Device, Tensor};
//! type Error = Box<dyn std::error::Error + Send + Sync>;
//!
//! let losses = spawn(4, |ctx| -> Result<f64, Error> {
//!     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
//!     let cfg = LlamaConfig {
//!         vocab_size: 32, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 2,
//!         num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 8,
//!         ..Default::default()
//!     };
//!     let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
//!     // Megatron-style: heads and the MLP's hidden units split over tp.
//!     let layer_plan = ParallelizePlan::new()
//!         .add("self_attn.q_proj", ColwiseParallel::new())
//!         .add("self_attn.k_proj", ColwiseParallel::new())
//!         .add("self_attn.v_proj", ColwiseParallel::new())
//!         .add("self_attn.o_proj", RowwiseParallel::new())
//!         .add("mlp.gate_proj", ColwiseParallel::new())
//!         .add("mlp.up_proj", ColwiseParallel::new())
//!         .add("mlp.down_proj", RowwiseParallel::new());
//!     for layer in &mut model.base_model.layers.items {
//!         parallelize_module(layer, &mesh["tp"], &layer_plan)?;
//!     }
//!     // Vocab-sharded logits for loss_parallel.
//!     let head = ParallelizePlan::new().add("lm_head", ColwiseParallel::new().use_local_output(false));
//!     parallelize_module(&mut model, &mesh["tp"], &head)?;
//!     for layer in &mut model.base_model.layers.items {
//!         fully_shard(layer, &mesh["dp"], &FsdpConfig::default())?;
//!     }
//!     fully_shard(&mut model, &mesh["dp"], &FsdpConfig::default())?;
//!     reset_parameters(&mut model, Device::Cpu, 0)?; // only this rank's shards
//!
//!     let _loss_parallel = loss_parallel::enable(&mesh["tp"]);
//!     let tokens = Tensor::from_vec((0..10i64).collect::<Vec<_>>(), [2, 5])?;
//!     let (ids, labels) = (tokens.narrow(1, 0, 4)?, tokens.narrow(1, 1, 4)?.reshape([8])?);
//!     let logits = model.logits(&ids, None)?; // a DTensor sharded on the vocab
//!     let loss = logits.reshape(&[-1, 32])?.cross_entropy(&labels, -100)?;
//!     loss.backward()?;
//!     Ok(loss.item()?)
//! })?;
//! // Every rank holds the same loss (all ranks ran the same rows here).
//! assert!(losses.iter().all(|l| (l - losses[0]).abs() < 1e-6 && l.is_finite()));
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```
#![warn(missing_docs)]

mod ddp;
mod error;
mod explain;
pub mod loss_parallel {
    //! Cross-entropy on vocab-sharded logits (see [`cross_entropy`]).
    pub use crate::loss::{backward, cross_entropy, enable};
}
mod loss;
mod plan;
mod style;
pub mod trace;

pub use ddp::{sync_module_states, DataParallel, NoSync, DEFAULT_BUCKET_CAP_BYTES};
pub use error::{PlanError, Result};
pub use explain::{explain, explain_collectives, tally_collectives, CommTally};
pub use plan::{apply_plan, check_plan, matches, parallelize_module, ParallelizePlan};
pub use style::{
    ColwiseParallel, InputLayout, OutputLayout, ParallelStyle, PrepareModuleInput,
    PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, StyleLayouts,
};
/// FSDP lives in `tpar-fsdp`; its user-facing names are re-exported here too, beside the
/// other parallel styles a plan composes with.
pub use tpar_fsdp::{
    fsdp_param, fsdp_units, fully_shard, set_fsdp_timeline, unshard, FsdpConfig, FsdpParam,
    FsdpParamGroup, FsdpTimeline, MixedPrecision, TimelineEvent, TimelineKind,
};
