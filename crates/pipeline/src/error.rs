//! The pipeline layer's error type.

/// What can go wrong building or running a pipeline.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A schedule cannot be built with these sizes, or a given action list is invalid.
    #[error("pipeline schedule {schedule}: {what}")]
    Schedule {
        /// The schedule's name (`gpipe`, `1f1b`, `interleaved`, `zb`, or `custom`).
        schedule: String,
        /// What is wrong.
        what: String,
    },
    /// Every rank of a schedule waits on another: the action lists cannot run.
    #[error("pipeline schedule {schedule} deadlocks: {what}")]
    Deadlock {
        /// The schedule's name.
        schedule: String,
        /// Which ranks wait on which actions.
        what: String,
    },
}

/// The pipeline layer's result type.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;
