//! Distributed checkpoints, as `torch.distributed.checkpoint` has them: every rank
//! writes only its own chunks, one metadata file records where each chunk of each
//! tensor is, and loading reads back exactly the chunks that overlap what each rank
//! holds now, whatever mesh, tensor-parallel plan or data-parallel mode (FSDP, DDP,
//! ZeRO-1, none) saved them.
//!
//! * [`save`] / [`load`]: one [`StateDict`] to and from a checkpoint directory
//!   (`dcp.save` / `dcp.load`). A save is atomic: it writes into a temporary directory
//!   that is renamed only after every rank has written and the metadata is on disk, so
//!   a crash at any point leaves the previous checkpoint loadable. Every chunk carries
//!   a CRC-32 that loading checks.
//! * [`async_save`]: the state is copied at once and written by a background thread
//!   while training goes on; [`AsyncSave::wait`] commits it.
//! * [`CheckpointManager`]: a checkpoint every N steps in `DIR/step-NNNNNNNN`, resume
//!   from the latest, keep the last K, asynchronous saves.
//! * [`get_state_dict`] / [`set_state_dict`] with [`StateDictOptions`]
//!   (`full_state_dict`, `cpu_offload`, `strict`, `broadcast_from_rank0`), and
//!   [`export_safetensors`] / [`import_safetensors`] for one safetensors file other
//!   tools read and write.
//! * [`hf`]: safetensors checkpoints in the Hugging Face layout (one file, or shards
//!   with their index), read by the byte ranges of each rank's chunks and written
//!   sharded.
//!
//! Anything with state takes part through [`Stateful`]: modules (through
//! [`ModuleState`]), the optimizers and the scheduler of `tpar-optim`, the sampler of
//! `tpar-data`, and a trainer's own counters.
//!
//! ```
//! use tpar_checkpoint::{load, save, LoadOptions, SaveOptions};
//! use tpar_collectives::spawn;
//! use tpar_tensor::state::{StateDict, StateValue};
//! use tpar_tensor::Tensor;
//!
//! let dir = std::env::temp_dir().join(format!("tpar-doc-{}", std::process::id()));
//! let d = dir.clone();
//! spawn(2, move |ctx| -> tpar_checkpoint::Result<()> {
//!     let g = ctx.world_group();
//!     let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3])?;
//!     let mut sd = StateDict::from([
//!         ("w".to_string(), StateValue::Tensor(w)),
//!         ("step".to_string(), StateValue::Int(5)),
//!     ]);
//!     save(&sd, &d, &g, &SaveOptions::default())?;
//!     sd.insert("w".into(), StateValue::Tensor(Tensor::zeros([3], tpar_tensor::DType::F32, tpar_tensor::Device::Cpu)?));
//!     load(&mut sd, &d, &g, &LoadOptions::default())?;
//!     let StateValue::Tensor(w) = &sd["w"] else { unreachable!() };
//!     assert_eq!(w.to_vec::<f32>()?, [1.0, 2.0, 3.0]);
//!     Ok(())
//! })
//! .unwrap();
//! # std::fs::remove_dir_all(&dir).ok();
//! ```
#![warn(missing_docs)]

mod config;
mod dcp;
mod exchange;
pub mod format;
mod full;
pub mod hf;
mod lock;
mod manager;

use std::path::Path;

pub use config::{ConfigValue, RunConfig};
pub use dcp::{async_save, load, read_metadata, save, AsyncSave, LoadOptions, SaveOptions};
pub use full::{
    export_safetensors, full_state_dict, get_state_dict, import_safetensors, set_state_dict,
    StateDictOptions,
};
pub use manager::{CheckpointConfig, CheckpointManager};
pub use tpar_nn::state::ModuleState;
pub use tpar_tensor::state::{ShardedTensor, StateDict, StateDictError, StateValue, Stateful};

/// Errors of saving and loading checkpoints; each names the file, key or rank.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CheckpointError {
    /// A file system operation failed.
    #[error("{path}: {what}")]
    Io {
        /// The file or directory.
        path: String,
        /// What failed.
        what: String,
    },
    /// A checkpoint's data does not match its checksum or is cut short.
    #[error("corrupt checkpoint: {file}, key {key:?}: {what}")]
    Corrupt {
        /// The file.
        file: String,
        /// The state dict key whose chunk it is.
        key: String,
        /// What is wrong.
        what: String,
    },
    /// A metadata or safetensors file that is not what this build reads.
    #[error("{path}: {what}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        what: String,
    },
    /// A checkpoint that was committed but can no longer be read as written: its
    /// metadata is missing, unreadable or changed (checksum), or it does not match the
    /// directory it is in. Never taken for "no checkpoint".
    #[error("damaged checkpoint: {path}: {what}")]
    Damaged {
        /// The file or directory.
        path: String,
        /// What is wrong.
        what: String,
    },
    /// The checkpoint directory is owned by another run (see
    /// [`CheckpointManager::new`]).
    #[error("checkpoint directory {dir} is in use by another run ({owner}); if that run is gone, delete {lock} and start again")]
    Locked {
        /// The checkpoint directory.
        dir: String,
        /// The owner as its lock file records it (host, pid, job, since when).
        owner: String,
        /// The lock file.
        lock: String,
    },
    /// A save of a checkpoint that is already committed (a [`CheckpointManager`] never
    /// replaces one).
    #[error("refusing to replace the committed checkpoint {path}: each step is saved once (move it aside to save this step again)")]
    Exists {
        /// The checkpoint directory.
        path: String,
    },
    /// No checkpoint where one was asked for.
    #[error("no checkpoint at {path}")]
    NotFound {
        /// The directory.
        path: String,
    },
    /// The state does not fit the checkpoint or the target (missing, unexpected,
    /// mis-shaped or mis-typed keys).
    #[error(transparent)]
    State(#[from] StateDictError),
    /// The saved chunks do not fit together (different shapes for one key on two ranks,
    /// a tensor not covered).
    #[error("inconsistent state across ranks: {what}")]
    Inconsistent {
        /// What disagrees.
        what: String,
    },
    /// Other ranks failed; the checkpoint was not committed (or not loaded).
    #[error("checkpoint {op} failed on rank(s) {ranks:?}: {what}")]
    RankFailed {
        /// `save` or `load`.
        op: &'static str,
        /// The global ranks that failed.
        ranks: Vec<usize>,
        /// The first failing rank's error.
        what: String,
    },
    /// A collective between the ranks failed (a peer died or timed out).
    #[error(transparent)]
    Collective(#[from] tpar_collectives::CollectiveError),
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] tpar_tensor::TensorError),
    /// A module op failed.
    #[error(transparent)]
    Nn(#[from] tpar_nn::NnError),
}

impl CheckpointError {
    pub(crate) fn io(path: &Path, e: std::io::Error) -> CheckpointError {
        CheckpointError::Io { path: path.display().to_string(), what: e.to_string() }
    }
}

/// `Result` with [`CheckpointError`].
pub type Result<T> = std::result::Result<T, CheckpointError>;
