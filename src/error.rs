//! [`Error`]: every layer's typed error under one type, so `?` works across layers.

use thiserror::Error;

/// Any error a tpar layer returns. Each layer keeps its own typed error (with the op,
/// shapes, mesh axis and rank in its message); this enum wraps them unchanged, so a
/// trainer's function returning [`Result`] can use `?` on calls into any layer, and
/// can still match the layer's error for details.
///
/// ```
/// use tpar::prelude::*;
/// fn two_layers() -> tpar::Result<Vec<f32>> {
///     let t = Tensor::from_vec(vec![1.0f32, 2.0], [2])?; // TensorError
///     let p: Vec<Placement> = tpar::placements::parse_placements("S(0)R")?; // PlacementError
///     assert_eq!(p.len(), 2);
///     Ok(t.to_vec::<f32>()?)
/// }
/// assert_eq!(two_layers()?, vec![1.0, 2.0]);
/// let err = Tensor::from_vec(vec![1.0f32], [2]).map_err(tpar::Error::from).unwrap_err();
/// assert!(matches!(err, tpar::Error::Tensor(_)));
/// # Ok::<(), tpar::Error>(())
/// ```
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// From the tensor layer (shapes, dtypes, devices, autograd).
    #[error(transparent)]
    Tensor(#[from] tpar_tensor::TensorError),
    /// From a kernel (CPU or CUDA).
    #[error(transparent)]
    Kernel(#[from] tpar_kernels::KernelError),
    /// From a collective (a peer that failed or timed out, mismatched calls).
    #[error(transparent)]
    Collective(#[from] tpar_collectives::CollectiveError),
    /// From the rendezvous store or the launch environment.
    #[error(transparent)]
    Rendezvous(#[from] tpar_launch::RendezvousError),
    /// From the launcher (its command line, starting and stopping ranks).
    #[error(transparent)]
    Launch(#[from] tpar_launch::LaunchError),
    /// From a device mesh.
    #[error(transparent)]
    Mesh(#[from] tpar_mesh::MeshError),
    /// From placement arithmetic or the redistribution planner.
    #[error(transparent)]
    Placement(#[from] tpar_placements::PlacementError),
    /// From a DTensor op or redistribution.
    #[error(transparent)]
    DTensor(#[from] tpar_dtensor::DTensorError),
    /// From the data pipeline (files, tokenizers, sampler, batches).
    #[error(transparent)]
    Data(#[from] tpar_data::DataError),
    /// From a pipeline: its stages, schedule, split or a step (a failed stage is named).
    #[error(transparent)]
    Pipeline(#[from] tpar_pipeline::PipelineError),
    /// A checkpoint could not be saved or loaded.
    #[error(transparent)]
    Checkpoint(#[from] tpar_checkpoint::CheckpointError),
    /// A Hugging Face checkpoint could not be read or written.
    #[error(transparent)]
    Hf(#[from] tpar_models::hf::HfError),
    /// A predicted peak memory that does not fit, or a configuration the memory model
    /// cannot predict.
    #[error(transparent)]
    Memory(#[from] tpar_models::memory::MemoryError),
    /// A state dict does not fit what loads it.
    #[error(transparent)]
    State(#[from] tpar_tensor::state::StateDictError),
    /// From a module, a model or an optimizer.
    #[error(transparent)]
    Nn(#[from] tpar_nn::NnError),
    /// From a parallel plan, FSDP, DDP or ZeRO.
    #[error(transparent)]
    Plan(#[from] tpar_parallel_styles::PlanError),
}

/// `Result` with [`enum@Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
