//! tpar's collectives layer: the communicator every layer above talks through.
//!
//! A [`ProcessGroup`] runs `all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`,
//! `broadcast`, `send`/`recv` (and `send_shaped`/`recv_shaped`, which move data alone
//! between ranks that agreed on its shape) and `barrier` among its members, out of place
//! (besides `all_reduce_`, in place as PyTorch's `dist.all_reduce`, and the `*_into` forms,
//! which write a buffer the caller keeps), on every dtype, with uneven
//! (`torch.chunk`-style, possibly empty) shards as first-class inputs.
//! The `local` backend runs ranks as threads of one process ([`World`], [`spawn`]); the
//! [`nccl`] backend runs one process per GPU over NCCL
//! ([`ProcessGroup::nccl_world`], [`nccl::probe`]); the [`tcp`] backend runs ranks as
//! processes, on one host or several, over TCP with host tensors
//! ([`ProcessGroup::tcp_world`]); all behind the same type. The processes of a job find
//! each other through a [`Store`]; the TCP store that implements it, the launch
//! environment and the `tpar-run` launcher are in `tpar-launch`.
//!
//! CUDA tensors go in and come back on the caller's device. The `local` backend runs
//! their collectives device to device (device and peer copies, and a reduction kernel
//! whose results are bit-equal to the host collectives'), with no host copy; a
//! collective mixing host and CUDA members works, each member getting its result on its
//! own device. The `nccl` backend runs `all_reduce`, `all_gather` and `reduce_scatter`
//! of CUDA tensors on their own memory, ordered by CUDA events (no host
//! synchronisation), and stages its other calls on CUDA tensors through host memory; the
//! `tcp` backend takes host tensors only.
//!
//! Failures are typed and prompt: a member that calls another collective, or passes
//! another dtype or shape, makes every member fail with [`CollectiveError::Mismatch`]
//! naming it; a rank that fails or leaves makes its waiting peers fail with
//! [`CollectiveError::PeerFailed`]; a rank that never arrives makes them fail with
//! [`CollectiveError::Timeout`] after the group's timeout. [`CommDebug`] records which
//! collectives ran.
//!
//! ```
//! use tpar_collectives::{spawn, CollectiveError, ReduceOp};
//! use tpar_tensor::{DType, Tensor};
//! let shards = spawn(4, |ctx| -> Result<Vec<usize>, CollectiveError> {
//!     let pg = ctx.world_group();
//!     // Partial(sum) -> Shard(0): reduce, then keep this rank's torch.chunk of 10 rows.
//!     let partial = Tensor::ones([10, 3], DType::F32, tpar_tensor::Device::Cpu)?;
//!     let shard = pg.reduce_scatter(&partial, 0, ReduceOp::Sum)?;
//!     assert!(shard.to_vec::<f32>()?.iter().all(|&v| v == 4.0));
//!     // Shard(0) -> Replicate: gather the uneven shards back.
//!     let full = pg.all_gather(&shard, 0)?;
//!     assert_eq!(full.dims(), &[10, 3]);
//!     Ok(shard.dims().to_vec())
//! })?;
//! assert_eq!(shards, vec![vec![3, 3], vec![3, 3], vec![3, 3], vec![1, 3]]);
//! # Ok::<(), CollectiveError>(())
//! ```
#![warn(missing_docs)]

mod debug;
mod error;
mod group;
mod local;
pub mod nccl;
mod op;
mod p2p;
mod remote;
mod spawn;
mod store;
pub mod tcp;
mod world;

pub use debug::{CommDebug, CommRecord};
pub use error::{CollectiveError, WaitLink};
pub use group::{ProcessGroup, Work};
pub use op::{chunk_range, CollectiveKind, ReduceOp};
pub use spawn::{
    max_rank_threads, spawn, spawn_owned, spawn_scoped, spawn_with, RankThreads, SpawnConfig,
    RANKS_PER_CORE, RANK_STACK_SIZE,
};
pub use store::{BoxedStoreError, HashStore, Store, StoreError};
pub use world::{RankCtx, World, DEFAULT_TIMEOUT};

/// Result type of the collectives layer.
pub type Result<T> = std::result::Result<T, CollectiveError>;

#[cfg(test)]
mod tests {
    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        send_sync::<crate::ProcessGroup>();
        send_sync::<crate::RankCtx>();
        send_sync::<crate::World>();
        send_sync::<crate::CommDebug>();
        send_sync::<crate::CollectiveError>();
        fn send<T: Send>() {}
        send::<crate::Work>();
    }
}
