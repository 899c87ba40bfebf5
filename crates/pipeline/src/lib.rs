//! Pipeline parallelism: a model cut into stages across the ranks of a `pp` mesh axis,
//! a batch cut into micro-batches, and schedules (GPipe, 1F1B, interleaved 1F1B,
//! zero-bubble) that say which rank runs which micro-batch's forward and backward when,
//! as `torch.distributed.pipelining` does.
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
