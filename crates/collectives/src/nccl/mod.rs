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
//!   member called (see `wire.rs`), so members that disagree (another collective, dtype,
//!   shape, or a skipped call) all fail with [`CollectiveError::Mismatch`] instead of
//!   hanging NCCL, an invalid argument on one member fails all of them, and uneven shard
//!   sizes, a broadcast's source shape and a `recv`'s payload shape are known to all. A
//!   barrier is exactly this exchange: no member completes it before all have joined.
//!   `send_shaped`/`recv_shaped` are the exception: their shape is agreed beforehand, so
//!   the payload travels alone (one `ncclSend`/`ncclRecv` of the expected count) and a
//!   disagreement is not detected (see
//!   [`ProcessGroup::send_shaped`](crate::ProcessGroup::send_shaped)).
//! - **Interim host path.** Tensors have no CUDA storage yet: each call copies host to
//!   device, runs NCCL on the group's stream and copies back (see `device.rs`); the device
//!   boundary `NcclDevice::run_on_device` is where CUDA tensors will enter without copies.
//! - **Uneven shards** are padded to the largest shard for `all_gather`/`reduce_scatter`
//!   and trimmed after; `all_to_all` is grouped `ncclSend`/`ncclRecv` of exact pieces
//!   (see `plan.rs`). All dtypes go natively: f32, f64, bf16, f16 (cudarc's `f16`
//!   feature) and i64; `Avg` is `ncclAvg`. NCCL reduces bf16/f16 in their own precision
//!   along its ring or tree, where the local backend accumulates in f32: results agree
//!   within the dtype's tolerance, not bit for bit.
//! - **Sub-groups** get their own communicator from their own unique id: the group's rank
//!   0 calls `ncclGetUniqueId` and publishes it under `tpar/nccl_id/<ranks>/<n>` in the
//!   [`Store`]; the others read it (no `ncclCommSplit`, which cudarc only binds for
//!   some CUDA versions). Handles on the same rank list share one communicator.
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
mod exec;
mod plan;
mod probe;
mod wire;
mod worker;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::nccl::Id;
use tpar_tensor::Tensor;

pub(crate) use device::{driver_error_text, nccl_error_text};
pub use probe::{nccl_library_link, probe, LibStatus, NcclLibLink, NcclProbe, NCCL_LIBRARY_ENV};
pub use worker::STUCK_GRACE;

use crate::local::desc::Call;
use crate::p2p::Expect;
use crate::{CollectiveError, CommDebug, ProcessGroup, Result, Store, StoreError};
use probe::guarded;
use worker::{Job, Reply, Setup, Shared};

/// One process's NCCL world: its rank, device, store and groups.
pub(crate) struct NcclWorld {
    rank: usize,
    size: usize,
    store: Arc<dyn Store>,
    ctx: Arc<CudaContext>,
    debug: CommDebug,
    /// Live communicators by member list, and how many were created per list.
    groups: Mutex<GroupCache>,
    /// Held while a communicator is set up, so that threads of one process creating the
    /// same group get one communicator, as their peers expect.
    creating: Mutex<()>,
}

/// Live communicators by sorted member list, and how many were created for each list.
type GroupCache = HashMap<Vec<usize>, (Weak<Handle>, u64)>;

/// Builds the world group: checks the arguments, probes the libraries, creates the
/// world communicator on CUDA device `device` through `store`.
pub(crate) fn world(
    store: Arc<dyn Store>,
    rank: usize,
    world_size: usize,
    device: usize,
    timeout: Duration,
) -> Result<ProcessGroup> {
    if world_size == 0 || rank >= world_size {
        return Err(CollectiveError::InvalidArgument {
            op: "nccl_world",
            why: format!("rank {rank} is not below world size {world_size}"),
        });
    }
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
    let w = Arc::new(NcclWorld {
        rank,
        size: world_size,
        store,
        ctx,
        debug: CommDebug::new(),
        groups: Mutex::new(HashMap::new()),
        creating: Mutex::new(()),
    });
    let comm = NcclWorld::group(&w, all, timeout)?;
    Ok(ProcessGroup::nccl(comm, timeout))
}

/// A short, store-friendly name for a member list.
fn list_key(ranks: &[usize]) -> String {
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

impl NcclWorld {
    /// The communicator of a sorted member list holding this rank: the live one, or a new
    /// one set up with every member (which must all call this).
    fn group(w: &Arc<NcclWorld>, ranks: Vec<usize>, timeout: Duration) -> Result<NcclComm> {
        let op = "new_group";
        let me = ranks.binary_search(&w.rank).map_err(|_| CollectiveError::InvalidArgument {
            op,
            why: format!("rank {} is not in {ranks:?}", w.rank),
        })?;
        let _creating = w.creating.lock().unwrap_or_else(PoisonError::into_inner);
        let gen = {
            let mut groups = w.groups.lock().unwrap_or_else(PoisonError::into_inner);
            let entry = groups.entry(ranks.clone()).or_insert((Weak::new(), 0));
            if let Some(h) = entry.0.upgrade() {
                return Ok(NcclComm { h });
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
        };

        // Everyone says it arrived; member 0 publishes the unique id; all wait for all.
        let arrived = |r: usize| format!("tpar/nccl_arrived/{key}/{r}");
        w.store.set(&arrived(w.rank), b"1").map_err(store_err)?;
        let id_key = format!("tpar/nccl_id/{key}");
        let id = if me == 0 {
            let id = match guarded(Id::new) {
                Ok(Ok(id)) => id,
                Ok(Err(e)) => {
                    return Err(backend(format!("ncclGetUniqueId: {}", nccl_error_text(&e))))
                }
                Err(p) => return Err(backend(format!("ncclGetUniqueId panicked: {p}"))),
            };
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            w.store.set(&id_key, &bytes).map_err(store_err)?;
            id
        } else {
            let bytes = match w.store.get_timeout(&id_key, timeout) {
                Ok(b) => b,
                Err(StoreError::Timeout(_)) => return Err(timed_out(vec![ranks[0]])),
                Err(e) => return Err(store_err(e)),
            };
            let raw: [u8; 128] = bytes.as_slice().try_into().map_err(|_| {
                backend(format!("the unique id under {id_key} has {} bytes, not 128", bytes.len()))
            })?;
            Id::uninit(raw.map(|b| b as std::ffi::c_char))
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
        let shared = Arc::new(Shared::new(group.clone(), w.rank));
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let setup = Setup {
            ctx: w.ctx.clone(),
            id,
            me,
            shared: shared.clone(),
            store: w.store.clone(),
            key: key.clone(),
        };
        std::thread::Builder::new()
            .name(format!("tpar-nccl-{}-{key}", w.rank))
            .spawn(move || worker::main(setup, rx, ready_tx))
            .map_err(|e| backend(format!("cannot start the group's worker thread: {e}")))?;
        match ready_rx.recv_timeout(timeout.saturating_add(STUCK_GRACE)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(RecvTimeoutError::Timeout) => return Err(timed_out(Vec::new())),
            Err(RecvTimeoutError::Disconnected) => {
                return Err(backend("the group's worker thread exited during setup".into()))
            }
        }
        let h = Arc::new(Handle { tx, shared, world: w.clone(), me, seq: AtomicU64::new(0) });
        let mut groups = w.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = groups.get_mut(&ranks) {
            entry.0 = Arc::downgrade(&h);
        }
        Ok(NcclComm { h })
    }
}

struct Handle {
    tx: mpsc::Sender<Job>,
    shared: Arc<Shared>,
    world: Arc<NcclWorld>,
    me: usize,
    seq: AtomicU64,
}

/// The NCCL backend's handle on one group (cheap to clone; clones share the communicator).
#[derive(Clone)]
pub(crate) struct NcclComm {
    h: Arc<Handle>,
}

impl NcclComm {
    /// The members' global ranks.
    pub fn ranks(&self) -> Arc<[usize]> {
        self.h.shared.group.clone()
    }

    /// This member's group rank.
    pub fn rank(&self) -> usize {
        self.h.me
    }

    /// This process's global rank.
    pub fn global_rank(&self) -> usize {
        self.h.world.rank
    }

    /// The world size.
    pub fn world_size(&self) -> usize {
        self.h.world.size
    }

    /// This process's recorder.
    pub fn debug(&self) -> CommDebug {
        self.h.world.debug.clone()
    }

    /// The next sequence number of this process's calls on the group.
    pub fn next_seq(&self) -> u64 {
        self.h.seq.fetch_add(1, Ordering::SeqCst)
    }

    fn op_failed(&self, op: &'static str, why: &str) -> CollectiveError {
        CollectiveError::Backend {
            backend: "nccl",
            op,
            group: self.h.shared.group.to_vec(),
            rank: self.h.world.rank,
            message: why.into(),
        }
    }

    fn submit(&self, job: Job) -> Result<()> {
        let op = job.op();
        if let Some(e) = self.h.shared.failure() {
            return Err(e);
        }
        self.h.tx.send(job).map_err(|_| self.op_failed(op, "the group's worker thread has exited"))
    }

    /// Queues collective `seq` and returns what will carry its result.
    pub fn start(
        &self,
        seq: u64,
        call: Call,
        tensor: Option<Tensor>,
        problem: Option<CollectiveError>,
        timeout: Duration,
    ) -> Pending {
        let op = call.name();
        let (reply, rx) = mpsc::channel();
        let problem = problem.map(Box::new);
        let job = Job::Collective { seq, call, tensor, problem, timeout, reply };
        let early = self.submit(job).err().map(Err);
        Pending { rx, shared: self.h.shared.clone(), op, done: Mutex::new(early) }
    }

    /// Runs collective `seq` and waits for it.
    pub fn run(
        &self,
        seq: u64,
        call: Call,
        tensor: Option<Tensor>,
        problem: Option<CollectiveError>,
        timeout: Duration,
    ) -> Reply {
        self.start(seq, call, tensor, problem, timeout).wait()
    }

    /// Queues a send of `t` (already a private copy) to group rank `dst`; returns at once.
    /// An error is an earlier failure of the group.
    pub fn send(&self, dst: usize, t: Tensor, timeout: Duration) -> Result<()> {
        if t.rank() > wire::MAX_DIMS {
            return Err(CollectiveError::InvalidArgument {
                op: "send",
                why: format!("the NCCL backend carries tensors of at most {} dims", wire::MAX_DIMS),
            });
        }
        self.submit(Job::Send { tensor: t, dst, shaped: false, timeout })
    }

    /// Queues a send of `t`'s data alone (no header; `t` is already a private copy) to
    /// group rank `dst`; returns at once. An error is an earlier failure of the group.
    pub fn send_shaped(&self, dst: usize, t: Tensor, timeout: Duration) -> Result<()> {
        self.submit(Job::Send { tensor: t, dst, shaped: true, timeout })
    }

    /// Receives the next tensor group rank `src` sent.
    pub fn recv(&self, src: usize, timeout: Duration) -> Result<Tensor> {
        self.receive(src, None, timeout)
    }

    /// Receives the next payload group rank `src` sent with `send_shaped`, as a host (or,
    /// for a meta expectation, meta) tensor of the expected shape and dtype.
    pub fn recv_shaped(&self, src: usize, expect: Expect, timeout: Duration) -> Result<Tensor> {
        self.receive(src, Some(expect), timeout)
    }

    fn receive(&self, src: usize, expect: Option<Expect>, timeout: Duration) -> Result<Tensor> {
        let (reply, rx) = mpsc::channel();
        let job = Job::Recv { src, expect, timeout, reply };
        let op = job.op();
        self.submit(job)?;
        let p = Pending { rx, shared: self.h.shared.clone(), op, done: Mutex::new(None) };
        p.wait()?.ok_or_else(|| self.op_failed(op, "internal error: no tensor received"))
    }

    /// The group of `ranks` (global, any order, including this rank), created with every
    /// member; it inherits `timeout`.
    pub fn new_group(&self, ranks: &[usize], timeout: Duration) -> Result<ProcessGroup> {
        let sorted = crate::world::sorted_members(self.h.world.size, self.h.world.rank, ranks)?;
        let comm = NcclWorld::group(&self.h.world, sorted, timeout)?;
        Ok(ProcessGroup::nccl(comm, timeout))
    }
}

/// A collective queued on a group's worker: what [`Work`](crate::Work) waits on.
pub(crate) struct Pending {
    rx: Receiver<Reply>,
    shared: Arc<Shared>,
    op: &'static str,
    done: Mutex<Option<Reply>>,
}

impl Pending {
    /// Waits for the reply. Gives up (with `Timeout`) only when the worker has been stuck
    /// in one job longer than that job's timeout plus [`STUCK_GRACE`].
    pub fn wait(self) -> Reply {
        if let Some(r) = self.done.into_inner().unwrap_or_else(PoisonError::into_inner) {
            return r;
        }
        loop {
            match self.rx.recv_timeout(Duration::from_millis(200)) {
                Ok(r) => return r,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.shared.failure().unwrap_or_else(|| CollectiveError::Backend {
                        backend: "nccl",
                        op: self.op,
                        group: self.shared.group.to_vec(),
                        rank: self.shared.rank,
                        message: "the group's worker thread exited".into(),
                    }))
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(e) = self.shared.stuck() {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Whether the reply has arrived.
    pub fn is_completed(&self) -> bool {
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        if done.is_some() {
            return true;
        }
        match self.rx.try_recv() {
            Ok(r) => {
                *done = Some(r);
                true
            }
            Err(TryRecvError::Empty) => false,
            Err(TryRecvError::Disconnected) => true,
        }
    }
}
