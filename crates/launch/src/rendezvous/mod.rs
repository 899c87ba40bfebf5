//! Multi-process rendezvous: a small TCP key-value store in the manner of
//! PyTorch's `TCPStore`. [`EnvInit`](crate::EnvInit) reads the torchrun environment
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) that says where it
//! lives.
//!
//! Rank 0 hosts the server on `MASTER_ADDR:MASTER_PORT`; every rank (rank 0
//! included) talks to it as a client. Backends use it to exchange what they
//! must agree on before the first collective, e.g. the NCCL unique id (the NCCL backend
//! sees it through the [`Store`] trait of `tpar-collectives`, which [`TcpStore`]
//! implements):
//!
//! ```no_run
//! use std::time::Duration;
//! use tpar_launch::EnvInit;
//!
//! let env = EnvInit::from_env()?;
//! let store = env.store(Duration::from_secs(300))?;
//! if env.rank == 0 {
//!     store.set("nccl_id/world", &[7u8; 128])?;
//! }
//! let id = store.get("nccl_id/world")?; // blocks until rank 0 has set it
//! assert_eq!(id.len(), 128);
//! store.barrier("exit")?; // keep rank 0's server alive until everyone is done
//! # Ok::<(), tpar_launch::RendezvousError>(())
//! ```
//!
//! Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) `MASTER_PORT` is the agent's
//! PyTorch `TCPStore`: [`TorchStoreClient`] speaks its protocol, and rank 0 posts its own
//! store's address there (see [`EnvInit::store`](crate::EnvInit::store)).
//!
//! Every operation is bounded by a timeout and every failure (refused
//! connection, timeout, server gone, malformed message) is a
//! [`RendezvousError`] naming the address and the keys involved.
//!
//! The wire protocol is private to this module (`wire.rs`): each message is a
//! big-endian `u32` length followed by that many bytes (an op code and its
//! length-prefixed fields; replies start with a status byte).

use std::io;
use std::time::Duration;

use tpar_collectives::{Store, StoreError};

mod client;
mod server;
mod torch;
mod wire;

pub use client::TcpStore;
pub use torch::TorchStoreClient;

/// Errors of the rendezvous store and of reading the launch environment.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// The server could not listen on its address.
    #[error("rendezvous store: cannot listen on {addr}: {source}")]
    Bind {
        /// The address the server tried to bind.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// No connection to the server within the timeout (it never started, or
    /// the address is wrong or unreachable).
    #[error(
        "rendezvous store at {addr}: no connection within {timeout:?} ({attempts} attempts); \
         last error: {source}"
    )]
    Connect {
        /// The server address.
        addr: String,
        /// How long the client kept retrying.
        timeout: Duration,
        /// How many connection attempts were made.
        attempts: u32,
        /// The last attempt's error.
        source: io::Error,
    },
    /// Keys did not appear (or the server did not answer) within the timeout.
    #[error(
        "rendezvous store at {addr}: {op} timed out after {timeout:?} waiting for key(s) {keys:?}"
    )]
    Timeout {
        /// The server address.
        addr: String,
        /// The operation (`get`, `wait`, `set`, ...).
        op: &'static str,
        /// The keys still missing (or the keys of the request that got no answer).
        keys: Vec<String>,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// A barrier did not fill up within the timeout.
    #[error(
        "rendezvous store at {addr}: barrier {name:?} timed out after {timeout:?}: \
         {arrived} of {world_size} ranks arrived"
    )]
    BarrierTimeout {
        /// The server address.
        addr: String,
        /// The barrier's name.
        name: String,
        /// How many ranks had arrived when the timeout passed.
        arrived: u64,
        /// How many ranks the barrier waits for.
        world_size: u64,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The server closed the connection (its process ended or dropped the store).
    #[error(
        "rendezvous store at {addr}: server closed the connection during {op} of key(s) {keys:?}"
    )]
    ServerGone {
        /// The server address.
        addr: String,
        /// The operation in flight.
        op: &'static str,
        /// The keys of that operation.
        keys: Vec<String>,
    },
    /// Another I/O error on the connection.
    #[error("rendezvous store at {addr}: i/o error during {op} of key(s) {keys:?}: {source}")]
    Io {
        /// The server address.
        addr: String,
        /// The operation in flight.
        op: &'static str,
        /// The keys of that operation.
        keys: Vec<String>,
        /// The operating system's error.
        source: io::Error,
    },
    /// A message that does not follow the protocol (wrong peer, wrong
    /// version, corrupted bytes).
    #[error("rendezvous store at {addr}: malformed message: {what}")]
    Protocol {
        /// The server address.
        addr: String,
        /// What was wrong.
        what: String,
    },
    /// The server refused a request (e.g. `add` on a key that holds no integer).
    #[error("rendezvous store at {addr}: {op} of key(s) {keys:?} failed on the server: {message}")]
    Server {
        /// The server address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// The keys of that operation.
        keys: Vec<String>,
        /// The server's explanation.
        message: String,
    },
    /// A rank of the job is gone: its connection to the store closed without the goodbye a
    /// dropped store sends (its process died, e.g. was killed). Every rank waiting in the
    /// store, and every later wait, gets this at once instead of its timeout.
    #[error("rendezvous store at {addr}: {op} of key(s) {keys:?} failed: {message}")]
    RankGone {
        /// The server address.
        addr: String,
        /// The rank whose process is gone.
        rank: usize,
        /// The operation that was waiting.
        op: &'static str,
        /// The keys of that operation.
        keys: Vec<String>,
        /// The store's account (`rank 2's connection to the store ... closed without a
        /// goodbye: its process died`).
        message: String,
    },
    /// The ranks of the job disagree on who is who: one was started with another world
    /// size than the store's host, or two processes claim the same rank. The rank that
    /// joined so gets this from [`TcpStore::join`], and every other rank from its next
    /// wait in the store, before any collective.
    #[error("rendezvous store at {addr}: {message}")]
    JobMismatch {
        /// The server address.
        addr: String,
        /// The rank that joined with the mismatch.
        rank: usize,
        /// What differs, with both values (`world sizes differ: rank 2 was started with
        /// WORLD_SIZE=4, but the store's host (rank 0) with WORLD_SIZE=3`).
        message: String,
    },
    /// The connection failed earlier and the store can no longer be used.
    #[error("rendezvous store at {addr}: connection is closed after an earlier error")]
    Closed {
        /// The server address.
        addr: String,
    },
    /// An argument out of range (e.g. a world size of 0).
    #[error("rendezvous store: invalid argument: {what}")]
    Invalid {
        /// What was wrong.
        what: String,
    },
    /// A launch environment variable is not set.
    #[error(
        "environment variable {var} is not set (launch with torchrun, tpar-run, srun \
         (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or Open MPI's mpirun \
         (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK), or set \
         RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
    )]
    MissingEnv {
        /// The variable's name.
        var: &'static str,
    },
    /// The process was started as one rank of a multi-process job (`RANK`/`WORLD_SIZE`,
    /// or Slurm's or Open MPI's equivalents, name more than one process), but it was
    /// asked for a backend that runs every rank as a thread of this one process: each
    /// process would run the whole job. See [`check_not_launched`](crate::check_not_launched).
    #[error(
        "this process was started as one of {world_size} processes ({vars}), but its \
         backend runs every rank as a thread of one process, so each process would run the \
         whole job: pass a process backend (e.g. --backend tcp or nccl) or unset those variables"
    )]
    LaunchedAsProcesses {
        /// The variables that say so, as `NAME=value` pairs.
        vars: String,
        /// The world size they give (`?` in the message when only `RANK` is set).
        world_size: String,
    },
    /// A launch environment variable holds an unusable value.
    #[error("environment variable {var}={value:?} is invalid: {why}")]
    InvalidEnv {
        /// The variable's name.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it cannot be used.
        why: String,
    },
}

/// Result alias of this crate's store and environment code.
pub(crate) type Result<T, E = RendezvousError> = std::result::Result<T, E>;

impl From<RendezvousError> for StoreError {
    /// A timeout (of a `get`, a `wait` or a barrier) is [`StoreError::Timeout`]; a rank
    /// that is gone is [`StoreError::RankGone`]; every other error is
    /// [`StoreError::Failed`]. All keep the error, so `downcast_ref::<RendezvousError>()`
    /// gets it back.
    fn from(e: RendezvousError) -> Self {
        match e {
            RendezvousError::Timeout { .. } | RendezvousError::BarrierTimeout { .. } => {
                StoreError::Timeout(Box::new(e))
            }
            RendezvousError::RankGone { rank, .. } => {
                StoreError::RankGone { rank, source: Box::new(e) }
            }
            other => StoreError::Failed(Box::new(other)),
        }
    }
}

/// The multi-process backends' view of the store (`nccl`, `tcp`).
impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        Ok(TcpStore::set(self, key, value)?)
    }

    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        Ok(TcpStore::get_timeout(self, key, timeout)?)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        Ok(TcpStore::wait(self, keys, timeout)?)
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        Ok(TcpStore::check(self, keys)?)
    }

    fn join(&self, rank: usize, world_size: usize) -> Result<(), StoreError> {
        Ok(TcpStore::join(self, rank, world_size)?)
    }

    fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.connection_local_addr().map(|a| a.ip())
    }
}

#[cfg(test)]
mod tests;
