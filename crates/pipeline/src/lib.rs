//! Pipeline parallelism: a model cut into stages across the ranks of a `pp` mesh axis,
//! a batch cut into micro-batches, and schedules (GPipe, 1F1B, interleaved 1F1B,
//! zero-bubble) that say which rank runs which micro-batch's forward and backward when,
//! as `torch.distributed.pipelining` does.
//!
//! A schedule is a value ([`Schedule`]): per rank, the ordered actions, checked for
//! deadlock by simulation, with a printable timeline and its bubble fraction.
//! [`PipelineSchedule`] runs it with this rank's [`PipelineStage`]s, moving activations
//! and gradients with `send` / `recv` over the `pp` mesh axis; the zero-bubble schedule
//! splits each backward into the input-gradient part and the deferred weight-gradient
//! part (`tpar_tensor::autograd::backward_input`). The Llama's stages are
//! `tpar_models::LlamaStage`.
//!
//! Two stages of one linear layer each, on two ranks (threads), 1F1B over 4
//! micro-batches:
//!
//! ```
//! use tpar_collectives::spawn;
//! use tpar_mesh::{DeviceMesh, DeviceType};
//! use tpar_nn::{reset_parameters, Linear, Value};
//! use tpar_pipeline::{PipelineSchedule, PipelineStage, ScheduleKind};
//! use tpar_tensor::{DType, Device, Tensor};
//!
//! let losses = spawn(2, |ctx| -> Result<Vec<f64>, tpar_pipeline::PipelineError> {
//!     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["pp"])?;
//!     let stage_index = mesh.local_rank();
//!     let mut layer = Linear::new(4, 4, true, DType::F32, Device::Meta)?;
//!     reset_parameters(&mut layer, Device::Cpu, stage_index as u64)?;
//!     let stage = PipelineStage::new(layer, stage_index, 2, &mesh, Device::Cpu)?;
//!     let mse = |out: &Value, target: &Tensor| -> tpar_nn::Result<Value> {
//!         let d = out.clone().into_tensor("loss")?.sub(target)?;
//!         Ok(Value::Tensor(d.square()?.mean_all()?))
//!     };
//!     let mut schedule = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![stage], 4, mse)?;
//!     println!("{}", schedule.schedule()); // rank 0: 0F0 0F1 0B0 0F2 ...
//!     let x = Tensor::ones([8, 4], DType::F32, Device::Cpu)?;
//!     // Stage 0 reads the input, the last stage the target; both call step.
//!     let losses = schedule.step(Some(&x), Some(&x))?;
//!     // Every parameter now holds the whole batch's gradient.
//!     assert!(schedule.parameters().iter().all(|p| p.trainable().grad().is_some()));
//!     Ok(losses)
//! })?;
//! assert!(losses[0].is_empty()); // the first stage's rank has no losses
//! assert_eq!(losses[1].len(), 4); // one per micro-batch on the last stage's
//! # Ok::<(), tpar_pipeline::PipelineError>(())
//! ```
#![warn(missing_docs)]

mod error;
mod runner;
pub mod schedule;
mod split;
mod stage;

pub use error::{PipelineError, Result};
pub use runner::{LossFn, PipelineSchedule};
pub use schedule::{
    classic_bubble, Action, Costs, Message, MessageKind, Phase, Schedule, ScheduleKind, Span,
    Timeline,
};
pub use split::split_blocks;
pub use stage::PipelineStage;
