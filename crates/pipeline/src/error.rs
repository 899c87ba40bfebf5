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
    /// A stage cannot be built, or failed while running an action (names the stage).
    #[error("pipeline stage {stage}: {what}")]
    Stage {
        /// The stage's index.
        stage: usize,
        /// What is wrong.
        what: String,
    },
    /// A batch cannot be cut into the schedule's micro-batches, or a rank left out its
    /// part of a step's inputs.
    #[error("pipeline step: {what}")]
    Microbatch {
        /// What is wrong.
        what: String,
    },
    /// A send, receive or collective failed (a peer that failed is named in it).
    #[error(transparent)]
    Collective(#[from] tpar_collectives::CollectiveError),
    /// A mesh could not give the `pp` group.
    #[error(transparent)]
    Mesh(#[from] tpar_mesh::MeshError),
    /// A module's forward, or the loss, failed.
    #[error(transparent)]
    Nn(#[from] tpar_nn::NnError),
    /// A tensor operation (or the autograd engine) failed.
    #[error(transparent)]
    Tensor(#[from] tpar_tensor::TensorError),
    /// A model cannot be cut into stages as asked.
    #[error("pipeline split: {what}")]
    Split {
        /// What is wrong.
        what: String,
    },
}

/// The pipeline layer's result type.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;
