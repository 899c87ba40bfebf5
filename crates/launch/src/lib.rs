//! tpar's launch layer: how the processes of a multi-process job find each other.
//!
//! - [`TcpStore`]: the rendezvous store, a small TCP key-value store in the manner of
//!   PyTorch's `TCPStore`, hosted by rank 0. It implements the
//!   [`Store`](tpar_collectives::Store) trait through which the NCCL backend of
//!   `tpar-collectives` agrees on its communicators.
//! - [`EnvInit`]: the launch environment torchrun and `tpar-run` (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), `srun`
//!   (`SLURM_PROCID`, ...) or Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, ...) give each
//!   process, and [`init_process_group`] / [`init_process_group_with`], PyTorch's
//!   `init_process_group("nccl")` (or `"gloo"`) from it, on the `nccl` backend or the
//!   `tcp` backend of processes over TCP with host tensors ([`BACKEND_ENV`] picks it for
//!   `init_process_group`). Under torchrun, whose agent already serves a PyTorch
//!   `TCPStore` on `MASTER_PORT`, [`EnvInit::store`] joins that store as a client
//!   ([`TorchStoreClient`]) to find rank 0's own store.
//! - [`check_not_launched`]: for programs whose backend runs ranks as threads, an error
//!   when a launcher started them as one of several processes.
//! - The `tpar-run` launcher: [`run`] starts one process per rank with torchrun's
//!   environment ([`LaunchConfig`]), streams their output with rank prefixes, stops them
//!   all when one fails (on every node), restarts the group up to
//!   [`max_restarts`](LaunchConfig::max_restarts) times, and forwards the launcher's
//!   termination signals to them ([`forward_signals`]); [`cli`] is its command line.
//!
//! ```no_run
//! use std::time::Duration;
//! use tpar_collectives::ReduceOp;
//! use tpar_tensor::Tensor;
//!
//! // Started by `tpar-run --nproc-per-node 2 -- prog` (or torchrun) on a GPU machine.
//! let world = tpar_launch::init_process_group(Duration::from_secs(300))?;
//! let t = Tensor::from_vec(vec![1.0f32; 4], [4])?;
//! let sum = world.all_reduce(&t, ReduceOp::Sum)?;
//! world.barrier()?; // rank 0 hosts the store: nobody leaves before everyone is done
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

pub mod cli;
mod env;
mod launcher;
mod rendezvous;
mod signals;
mod sys;

pub use cli::{parse_args, UsageError};
pub use env::{
    init_process_group, init_process_group_with, threads_from_env, BackendName, EnvInit,
    BACKEND_ENV,
};
pub use launcher::{
    run, ChildExit, LaunchConfig, LaunchError, LaunchOutcome, DEFAULT_MULTI_NODE_PORT,
};
pub use rendezvous::{RendezvousError, TcpStore, TorchStoreClient};
pub use signals::forward_signals;

// The environments of srun and mpirun, and the check for in-process backends.
pub use env::{
    check_not_launched, check_not_launched_in, first_slurm_host, EnvSource, MPI_DEFAULT_PORT,
    SLURM_DEFAULT_PORT_BASE,
};
