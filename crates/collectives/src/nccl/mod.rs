//! The `nccl` backend: process groups over NCCL (through `cudarc::nccl`), one process per
//! GPU, started by torchrun, `srun` or `tpar-run`.
//!
//! [`ProcessGroup::nccl_world`] builds the world group from a [`Store`] shared by the
//! job's processes, this process's rank, the world size and its CUDA device. From the
//! launch environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`),
//! `tpar_launch::init_process_group` connects to the TCP store rank 0 hosts and calls it:
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tpar_collectives::{ProcessGroup, ReduceOp, Store};
//! use tpar_tensor::Tensor;
//!
//! // `store`: the job's store (e.g. from `tpar_launch::EnvInit`), shared by every process.
//! fn run(store: Arc<dyn Store>, rank: usize, world_size: usize, local_rank: usize)
//!     -> Result<(), Box<dyn std::error::Error>> {
//!     let timeout = Duration::from_secs(300);
//!     let world = ProcessGroup::nccl_world(store, rank, world_size, local_rank, timeout)?;
//!     let t = Tensor::from_vec(vec![rank as f32; 4], [4])?;
//!     let sum = world.all_reduce(&t, ReduceOp::Sum)?;
//!     let tp = world.new_group(&[0, 1])?; // every member calls it
//!     world.barrier()?; // before the process hosting the store exits
//!     Ok(())
//! }
//! ```
//!
//! # Availability
//!
//! cudarc is built with dynamic loading, so this module always compiles and nothing is
//! loaded until a group is requested. [`probe`] then looks for the CUDA driver and NCCL
//! with cudarc's own `is_culib_present()` before any call that would panic without them;
//! a missing library makes [`ProcessGroup::nccl_world`](crate::ProcessGroup::nccl_world)
//! return [`CollectiveError::Unavailable`] naming it, and the first real cudarc calls also
//! run under `catch_unwind`. NCCL installed only as `libnccl.so.2` is not found by cudarc's
//! names; see [`nccl_library_link`] for the fix (`tpar-run` applies it to its ranks).
//!
//! # Design
//!
//! - **One owning thread per group.** `nccl::Comm` is not `Send`, so each group's
//!   communicator, CUDA stream and device buffers live on a worker thread that runs the
//!   jobs the group's handles send it over a channel, in order. The
//!   [`ProcessGroup`] handle holds the sender, stays `Clone + Send +
//!   Sync`, and `*_async` calls are a job whose reply the [`Work`](crate::Work) waits for.
//! - **Headers first.** Every collective starts with a fixed-size `all_gather` of what each
//!   member called (see `remote/wire.rs`, shared with the `tcp` backend), so members that
//!   disagree (another collective, dtype, shape, or a skipped call) all fail with [`CollectiveError::Mismatch`] instead of
//!   hanging NCCL, an invalid argument on one member fails all of them, and uneven shard
//!   sizes, a broadcast's source shape and a `recv`'s payload shape are known to all. A
//!   barrier is exactly this exchange: no member completes it before all have joined.
//!   `send_shaped`/`recv_shaped` are the exception: their shape is agreed beforehand, so
//!   the payload travels alone (one `ncclSend`/`ncclRecv` of the expected count) and a
//!   disagreement is not detected (see
//!   [`ProcessGroup::send_shaped`](crate::ProcessGroup::send_shaped)).
//! - **CUDA tensors stay on the device** for `all_reduce`, `all_gather` and
//!   `reduce_scatter` (an even split): NCCL reads and writes their memory on the group's
//!   stream, ordered against tpar's stream by CUDA events, with no header exchange and no
//!   host synchronisation (see `ondevice.rs`; `TPAR_NCCL_CHECK=1` takes the checked host
//!   path instead). The other calls on CUDA tensors (`broadcast`, `all_to_all`, sends) and
//!   host tensors go through the host: each call copies host to device, runs NCCL on the
//!   group's stream and copies back (see `device.rs`).
//! - **Uneven shards** are padded to the largest shard for `all_gather`/`reduce_scatter`
//!   and trimmed after; `all_to_all` is grouped `ncclSend`/`ncclRecv` of exact pieces
//!   (see `remote/plan.rs`). All dtypes go natively: f32, f64, bf16, f16 (cudarc's `f16`
//!   feature) and i64; `Avg` is `ncclAvg`. NCCL reduces bf16/f16 in their own precision
//!   along its ring or tree, where the local backend accumulates in f32: results agree
//!   within the dtype's tolerance, not bit for bit.
//! - **Sub-groups** get their own communicator from their own unique id: the group's rank
//!   0 calls `ncclGetUniqueId` and publishes it under `tpar/nccl_id/<ranks>/<n>` in the
//!   [`Store`]; the others read it (no `ncclCommSplit`, which cudarc only binds for
//!   some CUDA versions). Handles on the same rank list share one communicator.
//!
//! - **Bring-up without a GPU.** [`StandIn::world`] runs all of the above up to the first
//!   call into CUDA or NCCL (arguments, rendezvous, unique-id exchange, one communicator
//!   per member list, so one per `DeviceMesh` axis) and records the communicators it would
//!   have created; `rendezvous_check --nccl-mesh 2x2` runs it across a launcher's
//!   processes.
//!
//! # Failures and their limits
//!
//! - A member that never arrives: the worker polls the stream's completion against the
//!   group's timeout, then fails with [`CollectiveError::Timeout`], aborts the
//!   communicator (`ncclCommAbort`) and fails every later call on the group with the
//!   same error (as PyTorch's NCCL watchdog does). Before failing, each timed-out member
//!   publishes the call number it was stuck in to the store; members that did not publish
//!   the same number within a short grace are named in `waiting_for`.
//! - A worker blocked inside a host-side NCCL call (communicator setup, connection
//!   establishment) cannot be polled: its callers give up after the timeout plus
//!   [`STUCK_GRACE`] and the thread is left behind.
//! - NCCL's own errors keep their code and text in [`CollectiveError::Backend`].
//! - `send` returns at once (the tensor is copied and queued) but, as with NCCL in
//!   PyTorch, the transfer completes only when the peer receives: two ranks that both
//!   send to each other before receiving deadlock, and fail with `Timeout`. Order such
//!   exchanges (even ranks send first) or use `all_to_all`. A failed send fails the group.
//!   The same holds for `send_shaped`. NCCL does not compare the counts of a send and its
//!   receive: a `recv_shaped` expecting more bytes than its `send_shaped` sent times out
//!   (failing the group), one expecting fewer gets wrong data. A member sending to itself
//!   is the exception: the tensor is at hand, and a mismatch fails as on the local backend.
//! - Creating groups while async collectives are in flight can deadlock inside NCCL's
//!   setup (a CUDA allocation waits for the in-flight kernel): create groups first.
//! - With the TCP store, rank 0's process hosts it; it must outlive the others' use of it
//!   (call `barrier()` before exiting).

mod device;
pub(crate) mod ondevice;
mod probe;
mod standin;
mod worker;

use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::nccl::Id;

pub(crate) use device::{driver_error_text, nccl_error_text};
pub(crate) use ondevice::DeviceJob;
pub use probe::{nccl_library_link, probe, LibStatus, NcclLibLink, NcclProbe, NCCL_LIBRARY_ENV};
pub use standin::{StandIn, StandInComm};

pub use crate::remote::worker::STUCK_GRACE;
use crate::remote::worker::{Job, Shared};
use crate::remote::{RemoteComm, RemoteWorld, WeakComm};
use crate::{CollectiveError, CommDebug, ProcessGroup, Result, Store, StoreError};
use probe::guarded;
use worker::Setup;

/// What a group's worker needs once the members have met: the unique id, this process's
/// place in the group, and (for the diagnosis of timeouts) the store and the group's key.
pub(crate) struct GroupSetup {
    pub id: [u8; 128],
    pub me: usize,
    pub shared: Arc<Shared>,
    pub store: Arc<dyn Store>,
    pub key: String,
}

/// The calls into CUDA and NCCL that bring communicators up. Everything around them (the
/// argument checks, the rendezvous and unique-id exchange through the store, one
/// communicator per member list and generation) is the same for NCCL and the
/// [`StandIn`], which replaces only these.
pub(crate) trait Bringup: Send + Sync {
    /// `ncclGetUniqueId`: a new communicator's 128-byte id.
    fn unique_id(&self) -> std::result::Result<[u8; 128], String>;

    /// Runs a group's worker on a thread of its own: it creates the communicator from
    /// `setup`, says how that went on `ready`, then serves `jobs` until every handle is gone.
    fn start(
        &self,
        setup: GroupSetup,
        jobs: mpsc::Receiver<Job<DeviceJob>>,
        ready: mpsc::Sender<Result<()>>,
    ) -> std::io::Result<()>;
}

/// The real bring-up: NCCL communicators on this process's CUDA context.
struct CudaNccl {
    ctx: Arc<CudaContext>,
}

impl Bringup for CudaNccl {
    fn unique_id(&self) -> std::result::Result<[u8; 128], String> {
        match guarded(Id::new) {
            Ok(Ok(id)) => Ok(id.internal().map(|c| c as u8)),
            Ok(Err(e)) => Err(format!("ncclGetUniqueId: {}", nccl_error_text(&e))),
            Err(p) => Err(format!("ncclGetUniqueId panicked: {p}")),
        }
    }

    fn start(
        &self,
        g: GroupSetup,
        jobs: mpsc::Receiver<Job<DeviceJob>>,
        ready: mpsc::Sender<Result<()>>,
    ) -> std::io::Result<()> {
        let name = format!("tpar-nccl-{}-{}", g.shared.rank, g.key);
        let setup = Setup {
            ctx: self.ctx.clone(),
            id: Id::uninit(g.id.map(|b| b as std::ffi::c_char)),
            me: g.me,
            shared: g.shared,
            store: g.store,
            key: g.key,
        };
        std::thread::Builder::new().name(name).spawn(move || worker::main(setup, jobs, ready))?;
        Ok(())
    }
}

/// One process's NCCL world: its rank, device, store and groups.
pub(crate) struct NcclWorld {
    rank: usize,
    size: usize,
    store: Arc<dyn Store>,
    bringup: Arc<dyn Bringup>,
    debug: CommDebug,
    /// Live communicators by member list, and how many were created per list.
    groups: Mutex<GroupCache>,
    /// Held while a communicator is set up, so that threads of one process creating the
    /// same group get one communicator, as their peers expect.
    creating: Mutex<()>,
}

/// Live communicators by sorted member list, and how many were created for each list.
pub(crate) type GroupCache = HashMap<Vec<usize>, (WeakComm<DeviceJob>, u64)>;

/// Builds the world group: checks the arguments, probes the libraries, creates the
/// world communicator on CUDA device `device` through `store`.
pub(crate) fn world(
    store: Arc<dyn Store>,
    rank: usize,
    world_size: usize,
    device: usize,
    timeout: Duration,
) -> Result<ProcessGroup> {
    check_rank(rank, world_size)?;
    let p = probe();
    p.check()?;
    let unavailable =
        |why: String| CollectiveError::Unavailable { what: "NCCL backend".into(), why };
    let devices = p.devices.unwrap_or(0);
    if device >= devices {
        return Err(unavailable(format!(
            "CUDA device {device} (LOCAL_RANK) was asked for but this process sees {devices} \
             CUDA device(s) (check CUDA_VISIBLE_DEVICES and --nproc-per-node)"
        )));
    }
    let all: Vec<usize> = (0..world_size).collect();
    let backend = |op: &'static str, message: String| CollectiveError::Backend {
        backend: "nccl",
        op,
        group: all.clone(),
        rank,
        message,
    };
    let ctx = match guarded(|| CudaContext::new(device)) {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            return Err(backend("init", format!("CUDA device {device}: {}", driver_error_text(&e))))
        }
        Err(p) => return Err(unavailable(format!("creating the CUDA context panicked: {p}"))),
    };
    start_world(store, rank, world_size, Arc::new(CudaNccl { ctx }), timeout)
}

/// The world group, brought up by `bringup` (arguments already checked).
fn start_world(
    store: Arc<dyn Store>,
    rank: usize,
    world_size: usize,
    bringup: Arc<dyn Bringup>,
    timeout: Duration,
) -> Result<ProcessGroup> {
    let w = Arc::new(NcclWorld {
        rank,
        size: world_size,
        store,
        bringup,
        debug: CommDebug::new(),
        groups: Mutex::new(HashMap::new()),
        creating: Mutex::new(()),
    });
    let comm = w.clone().group((0..world_size).collect(), timeout)?;
    Ok(ProcessGroup::nccl(comm, timeout))
}

/// `rank` below `world_size`, or the error [`ProcessGroup::nccl_world`] gives.
fn check_rank(rank: usize, world_size: usize) -> Result<()> {
    if world_size == 0 || rank >= world_size {
        return Err(CollectiveError::InvalidArgument {
            op: "nccl_world",
            why: format!("rank {rank} is not below world size {world_size}"),
        });
    }
    Ok(())
}

/// A short, store-friendly name for a member list.
pub(crate) fn list_key(ranks: &[usize]) -> String {
    let text: Vec<String> = ranks.iter().map(usize::to_string).collect();
    let text = text.join(",");
    if text.len() <= 96 {
        return text;
    }
    // FNV-1a over the list, with its length and ends for readability.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in ranks {
        for b in (r as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{}..{}#{}-{h:016x}", ranks[0], ranks[ranks.len() - 1], ranks.len())
}

impl RemoteWorld<DeviceJob> for NcclWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn debug(&self) -> CommDebug {
        self.debug.clone()
    }

    fn process_group(&self, comm: RemoteComm<DeviceJob>, timeout: Duration) -> ProcessGroup {
        ProcessGroup::nccl(comm, timeout)
    }

    /// The communicator of a sorted member list holding this rank: the live one, or a new
    /// one set up with every member (which must all call this).
    fn group(
        self: Arc<Self>,
        ranks: Vec<usize>,
        timeout: Duration,
    ) -> Result<RemoteComm<DeviceJob>> {
        let w = &self;
        let op = "new_group";
        let me = ranks.binary_search(&w.rank).map_err(|_| CollectiveError::InvalidArgument {
            op,
            why: format!("rank {} is not in {ranks:?}", w.rank),
        })?;
        let _creating = w.creating.lock().unwrap_or_else(PoisonError::into_inner);
        let gen = {
            let mut groups = w.groups.lock().unwrap_or_else(PoisonError::into_inner);
            let entry = groups.entry(ranks.clone()).or_insert((WeakComm::default(), 0));
            if let Some(c) = entry.0.upgrade() {
                return Ok(c);
            }
            entry.1 += 1;
            entry.1 - 1
        };
        let group: Arc<[usize]> = ranks.clone().into();
        let backend = |message: String| CollectiveError::Backend {
            backend: "nccl",
            op,
            group: ranks.clone(),
            rank: w.rank,
            message,
        };
        let key = format!("{}/{gen}", list_key(&ranks));
        let store_err = |e: StoreError| backend(format!("rendezvous: {e}"));
        let timed_out = |waiting_for: Vec<usize>| CollectiveError::Timeout {
            op,
            group: ranks.clone(),
            waiting_for,
            after: timeout,
            chain: Vec::new(),
        };

        // Everyone says it arrived; member 0 publishes the unique id; all wait for all.
        let arrived = |r: usize| format!("tpar/nccl_arrived/{key}/{r}");
        w.store.set(&arrived(w.rank), b"1").map_err(store_err)?;
        let id_key = format!("tpar/nccl_id/{key}");
        let id = if me == 0 {
            let id = w.bringup.unique_id().map_err(backend)?;
            w.store.set(&id_key, &id).map_err(store_err)?;
            id
        } else {
            let bytes = match w.store.get_timeout(&id_key, timeout) {
                Ok(b) => b,
                Err(StoreError::Timeout(_)) => return Err(timed_out(vec![ranks[0]])),
                Err(e) => return Err(store_err(e)),
            };
            bytes.as_slice().try_into().map_err(|_| {
                backend(format!("the unique id under {id_key} has {} bytes, not 128", bytes.len()))
            })?
        };
        let keys: Vec<String> = ranks.iter().map(|&r| arrived(r)).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        match w.store.wait(&keys, timeout) {
            Ok(()) => {}
            Err(StoreError::Timeout(_)) => {
                let missing = ranks
                    .iter()
                    .copied()
                    .filter(|&r| !w.store.check(&[&arrived(r)]).unwrap_or(false))
                    .collect();
                return Err(timed_out(missing));
            }
            Err(e) => return Err(store_err(e)),
        }

        // The worker creates the stream and the communicator, then serves jobs.
        let shared = Arc::new(Shared::new(group.clone(), w.rank, "nccl"));
        let (tx, rx) = mpsc::channel::<Job<DeviceJob>>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let setup =
            GroupSetup { id, me, shared: shared.clone(), store: w.store.clone(), key: key.clone() };
        w.bringup
            .start(setup, rx, ready_tx)
            .map_err(|e| backend(format!("cannot start the group's worker thread: {e}")))?;
        match ready_rx.recv_timeout(timeout.saturating_add(STUCK_GRACE)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(RecvTimeoutError::Timeout) => return Err(timed_out(Vec::new())),
            Err(RecvTimeoutError::Disconnected) => {
                return Err(backend("the group's worker thread exited during setup".into()))
            }
        }
        let world: Arc<dyn RemoteWorld<DeviceJob>> = self.clone();
        let comm = RemoteComm::new(tx, shared, world, me);
        let mut groups = w.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = groups.get_mut(&ranks) {
            entry.0 = comm.downgrade();
        }
        Ok(comm)
    }
}
