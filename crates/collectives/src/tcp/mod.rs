//! The `tcp` backend: process groups whose ranks are processes, on one host or several,
//! talking over TCP and reducing on the CPU: the role gloo plays for PyTorch. It runs the
//! process-level paths (launch, rendezvous, a process that dies) on machines without a
//! GPU, with the `local` backend's semantics, dtypes, async handles, timeouts and error
//! naming.
//!
//! [`ProcessGroup::tcp_world`] builds the world group from a [`Store`] shared by the
//! job's processes, this process's rank and the world size; from a launch environment
//! (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`),
//! `tpar_launch::init_process_group_with("tcp", timeout)` connects to the store rank 0
//! hosts and calls it:
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tpar_collectives::{ProcessGroup, ReduceOp, Store};
//! use tpar_tensor::Tensor;
//!
//! // `store`: the job's store (e.g. from `tpar_launch::EnvInit`), shared by every process.
//! fn run(store: Arc<dyn Store>, rank: usize, world_size: usize)
//!     -> Result<(), Box<dyn std::error::Error>> {
//!     let world = ProcessGroup::tcp_world(store, rank, world_size, Duration::from_secs(60))?;
//!     let t = Tensor::from_vec(vec![rank as f32; 4], [4])?;
//!     let sum = world.all_reduce(&t, ReduceOp::Sum)?;
//!     let pair = world.new_group(&[0, 1])?; // every member calls it
//!     world.barrier()?; // before the process hosting the store exits
//!     Ok(())
//! }
//! ```
//!
//! # Design
//!
//! - **One socket per pair of processes**, set up once for the world through the store
//!   (see `mesh.rs`): each process listens on an ephemeral port, publishes `host:port`
//!   under `tpar/tcp/addr/<rank>`, connects to every higher rank and accepts every lower
//!   one, with a handshake carrying the job's token and both global ranks, so that a
//!   connection from another job or the wrong rank is refused. The advertised host is
//!   [`TCP_HOST_ENV`] when set, else the local address of this process's connection to
//!   the store ([`Store::local_ip`]), else loopback.
//! - **Frames, demultiplexed.** Messages travel as frames `(group id, length, channel)`
//!   on the world's sockets; a reader thread per socket files them by group and channel
//!   (collectives apart from point-to-point). Sub-groups ([`ProcessGroup::new_group`])
//!   reuse the world's sockets under their own id (a hash of the member list and how many
//!   groups of that list this process made before), so creating one needs no
//!   communication; every member must still create it, in the same order.
//! - **Few copies.** Sends write the caller's bytes as they are; a reader thread receives
//!   a large frame into a buffer kept from an earlier one (at most two per peer, 512 MiB
//!   in all), which the collective reads in place (reduction terms, pieces of the output)
//!   and hands back. `all_reduce` reduces this member's range straight into its output
//!   and sends it from there. Readers and the writer are different threads, so two
//!   members sending each other large frames at once overlap instead of waiting.
//! - **Shared memory on one host** (see `shm.rs`). Each process publishes its host id
//!   (the kernel's boot id) at connect time; two processes with the same one set up a
//!   ring of shared memory per direction (2 MiB: 8 slots of 256 KiB, in a `/dev/shm`
//!   file created by the sender, mapped by both and unlinked as soon as both have it,
//!   so nothing is left behind however the processes end). Payloads of 64 KiB and more
//!   then stream through the ring a slot at a time instead of through the socket, whose
//!   frames carry only the header and a notice per chunk; the receiving reader thread
//!   copies each chunk out as its notice arrives and frees the slot, so the ring never
//!   holds up a sender for a receiver that has not called yet. Nobody spins: the reader
//!   blocks on the socket, a sender on a full ring sleeps on a futex. Without
//!   `/dev/shm` (or room in it), on other hosts, or with [`TCP_SHM_ENV`]`=0`, a pair
//!   keeps to its socket; [`TCP_SHM_MIN_ENV`] moves the threshold (measured in
//!   docs/PERF.md).
//! - **The executor of the `nccl` backend.** Each group has a worker thread that owns its
//!   transport and runs its jobs in order; every collective starts with the same header
//!   exchange, so members that disagree all fail with [`CollectiveError::Mismatch`]
//!   naming the culprit; uneven shards, meta tensors and the `*_async` handles
//!   ([`Work`](crate::Work)) behave as on the other backends. Reductions use the local
//!   backend's CPU kernels (bf16/f16 accumulate in f32, members reduced in rank order),
//!   so results equal the local backend's, bit for bit.
//! - **Host tensors only**: a CUDA tensor is an [`CollectiveError::InvalidArgument`]
//!   (use the `nccl` backend, or move it to the CPU). Data moves in native byte order;
//!   the handshake refuses a peer with another one.
//!
//! # Failures
//!
//! - A process that dies, or drops its world, closes its sockets: every pending and later
//!   call waiting on it fails at once with [`CollectiveError::PeerFailed`] naming its
//!   global rank (collectives exchange headers with every member first, so every
//!   collective involving it notices). Shared memory changes nothing here: a receiver
//!   waits on the socket for each chunk's notice, and a sender asleep on a full ring is
//!   woken when the peer's socket closes. A collective names the group's first member
//!   whose connection ended: a survivor that fails because of a dead peer and leaves
//!   closes its sockets too, and a member blocked on the survivor may see that first.
//! - A member that is only late makes the others fail with [`CollectiveError::Timeout`]
//!   after the group's timeout, naming the members whose data had not arrived. A peer
//!   that takes no data for that long (its socket full, or no slot of its ring freed)
//!   fails the sender the same way, naming it.
//! - After either, the group's members are out of step: every later call on that group
//!   fails with the same error (other groups are unaffected unless they wait on the same
//!   peer).
//! - `send` returns at once: the frame is queued on the group's worker and written to the
//!   socket, where the peer's reader takes it whether or not it is receiving yet, so two
//!   ranks may both send before they receive (unlike NCCL). A `recv_shaped` whose byte
//!   count disagrees with the `send_shaped` it meets fails with `Mismatch` naming the
//!   sender; a `recv` that meets a `send_shaped` (or the reverse) is out of step and
//!   fails with an internal error.
//! - With the TCP store, rank 0's process hosts it: call `barrier()` before it exits. A
//!   store holds one TCP world (its keys are fixed).

mod mesh;
mod shm;
mod transport;

#[cfg(test)]
mod shm_tests;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::remote::worker::{serve, Job, Shared};
use crate::remote::{NoDevice, RemoteComm, RemoteWorld, WeakComm};
use crate::{CollectiveError, CommDebug, ProcessGroup, Result, Store};
use mesh::Mesh;
use shm::ShmConfig;
use transport::TcpTransport;

/// Environment variable naming the host (name or IP address) this process advertises to
/// its peers for their connections. Unset, the `tcp` backend advertises the local
/// address of its connection to the store ([`Store::local_ip`]), else loopback.
pub const TCP_HOST_ENV: &str = "TPAR_TCP_HOST";

/// Environment variable that turns off shared memory between the processes of one host:
/// `0`, `off`, `false` or `no` keep every pair of processes on its socket. Unset (or any
/// other value), processes that find they share a host move large payloads through
/// shared memory.
pub const TCP_SHM_ENV: &str = "TPAR_TCP_SHM";

/// Environment variable setting the smallest payload, in bytes, that travels through
/// shared memory between processes of one host (default 65536); smaller ones take the
/// socket.
pub const TCP_SHM_MIN_ENV: &str = "TPAR_TCP_SHM_MIN_BYTES";

/// One process's TCP world: its rank, its connections, its groups.
pub(crate) struct TcpWorld {
    rank: usize,
    size: usize,
    mesh: Arc<Mesh>,
    debug: CommDebug,
    /// Live groups by member list, and how many were created per list.
    groups: Mutex<GroupCache>,
    /// Kept for the world's lifetime: on rank 0 it may host the store other processes
    /// are still reading addresses from.
    _store: Arc<dyn Store>,
}

/// Live groups by sorted member list, and how many were created for each list.
type GroupCache = HashMap<Vec<usize>, (WeakComm<NoDevice>, u64)>;

/// Builds the world group: checks the arguments, connects to every other process through
/// `store`, and starts the world group's worker.
pub(crate) fn world(
    store: Arc<dyn Store>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<ProcessGroup> {
    world_with(store, rank, world_size, timeout, ShmConfig::from_env())
}

/// [`world`], with shared memory as `shm` says.
pub(crate) fn world_with(
    store: Arc<dyn Store>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    shm: ShmConfig,
) -> Result<ProcessGroup> {
    if world_size == 0 || rank >= world_size {
        return Err(CollectiveError::InvalidArgument {
            op: "tcp_world",
            why: format!("rank {rank} is not below world size {world_size}"),
        });
    }
    let mesh = Mesh::connect(&*store, rank, world_size, timeout, shm)?;
    let w = Arc::new(TcpWorld {
        rank,
        size: world_size,
        mesh: Arc::new(mesh),
        debug: CommDebug::new(),
        groups: Mutex::new(HashMap::new()),
        _store: store,
    });
    let comm = w.group((0..world_size).collect(), timeout)?;
    Ok(ProcessGroup::tcp(comm, timeout))
}

/// The id of the `generation`-th group of member list `ranks` in frame headers (FNV-1a).
fn group_id(ranks: &[usize], generation: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let words = std::iter::once(ranks.len() as u64)
        .chain(ranks.iter().map(|&r| r as u64))
        .chain(std::iter::once(generation));
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl RemoteWorld<NoDevice> for TcpWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn debug(&self) -> CommDebug {
        self.debug.clone()
    }

    fn process_group(&self, comm: RemoteComm<NoDevice>, timeout: Duration) -> ProcessGroup {
        ProcessGroup::tcp(comm, timeout)
    }

    /// The group of a sorted member list holding this rank: the live one, or a new one
    /// (no communication: the world's sockets carry it under its own id).
    fn group(
        self: Arc<Self>,
        ranks: Vec<usize>,
        _timeout: Duration,
    ) -> Result<RemoteComm<NoDevice>> {
        let op = "new_group";
        let me = ranks.binary_search(&self.rank).map_err(|_| CollectiveError::InvalidArgument {
            op,
            why: format!("rank {} is not in {ranks:?}", self.rank),
        })?;
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = groups.entry(ranks.clone()).or_insert((WeakComm::default(), 0));
        if let Some(c) = entry.0.upgrade() {
            return Ok(c);
        }
        let gid = group_id(&ranks, entry.1);
        entry.1 += 1;
        let group: Arc<[usize]> = ranks.into();
        let shared = Arc::new(Shared::new(group.clone(), self.rank, "tcp"));
        let mut x = TcpTransport::new(self.mesh.clone(), gid, group.clone(), me);
        let (tx, rx) = mpsc::channel::<Job<NoDevice>>();
        let worker_shared = shared.clone();
        std::thread::Builder::new()
            .name(format!("tpar-tcp-{}-{gid:016x}", self.rank))
            .spawn(move || serve(&mut x, me, &worker_shared, rx, |e, _, _| e))
            .map_err(|e| CollectiveError::Backend {
                backend: "tcp",
                op,
                group: group.to_vec(),
                rank: self.rank,
                message: format!("cannot start the group's worker thread: {e}"),
            })?;
        let world: Arc<dyn RemoteWorld<NoDevice>> = self.clone();
        let comm = RemoteComm::new(tx, shared, world, me);
        entry.0 = comm.downgrade();
        Ok(comm)
    }
}
