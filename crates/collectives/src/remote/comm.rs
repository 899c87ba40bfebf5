//! The handle a [`ProcessGroup`](crate::ProcessGroup) of a multi-process backend holds:
//! the sender of its group's job queue, the state it shares with the group's worker, and
//! the world it came from (which makes sub-groups).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tpar_tensor::Tensor;

use super::exec::DeviceWork;
use super::wire::MAX_DIMS;
use super::worker::{Job, Reply, Shared};
use crate::local::desc::Call;
use crate::p2p::Expect;
use crate::{CollectiveError, CommDebug, ProcessGroup, Result};

/// One process's world of a multi-process backend: it knows its rank and makes groups;
/// `D` is the device work of its groups' transports.
pub(crate) trait RemoteWorld<D: DeviceWork>: Send + Sync {
    /// This process's global rank.
    fn rank(&self) -> usize;
    /// The number of processes.
    fn size(&self) -> usize;
    /// This process's recorder.
    fn debug(&self) -> CommDebug;
    /// The group of the sorted member list `ranks` (holding this rank): the live one, or
    /// a new one set up with every member, which must all call this.
    fn group(self: Arc<Self>, ranks: Vec<usize>, timeout: Duration) -> Result<RemoteComm<D>>;
    /// Wraps a handle of this world's backend into a process group.
    fn process_group(&self, comm: RemoteComm<D>, timeout: Duration) -> ProcessGroup;
}

struct Handle<D: DeviceWork> {
    tx: mpsc::Sender<Job<D>>,
    shared: Arc<Shared>,
    world: Arc<dyn RemoteWorld<D>>,
    me: usize,
    seq: AtomicU64,
}

/// A multi-process backend's handle on one group (cheap to clone; clones share the
/// group's worker); `D` is the device work of the worker's transport.
pub(crate) struct RemoteComm<D: DeviceWork> {
    h: Arc<Handle<D>>,
}

impl<D: DeviceWork> Clone for RemoteComm<D> {
    fn clone(&self) -> Self {
        RemoteComm { h: self.h.clone() }
    }
}

/// A handle kept by a world's group cache without keeping the group alive.
pub(crate) struct WeakComm<D: DeviceWork>(Option<Weak<Handle<D>>>);

impl<D: DeviceWork> Default for WeakComm<D> {
    fn default() -> Self {
        WeakComm(None)
    }
}

impl<D: DeviceWork> WeakComm<D> {
    /// The group, if some handle still holds it.
    pub fn upgrade(&self) -> Option<RemoteComm<D>> {
        self.0.as_ref().and_then(Weak::upgrade).map(|h| RemoteComm { h })
    }
}

impl<D: DeviceWork> RemoteComm<D> {
    /// The handle of member `me` of the group whose worker reads `tx`.
    pub fn new(
        tx: mpsc::Sender<Job<D>>,
        shared: Arc<Shared>,
        world: Arc<dyn RemoteWorld<D>>,
        me: usize,
    ) -> RemoteComm<D> {
        RemoteComm { h: Arc::new(Handle { tx, shared, world, me, seq: AtomicU64::new(0) }) }
    }

    /// A weak reference for a group cache.
    pub fn downgrade(&self) -> WeakComm<D> {
        WeakComm(Some(Arc::downgrade(&self.h)))
    }

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
        self.h.world.rank()
    }

    /// The world size.
    pub fn world_size(&self) -> usize {
        self.h.world.size()
    }

    /// This process's recorder.
    pub fn debug(&self) -> CommDebug {
        self.h.world.debug()
    }

    /// The next sequence number of this process's calls on the group.
    pub fn next_seq(&self) -> u64 {
        self.h.seq.fetch_add(1, Ordering::SeqCst)
    }

    fn op_failed(&self, op: &'static str, why: &str) -> CollectiveError {
        self.h.shared.backend_err(op, why.into())
    }

    fn submit(&self, job: Job<D>) -> Result<()> {
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

    /// Queues device collective `seq` (see [`DeviceWork`]) and returns its completion
    /// once the worker has enqueued it (without waiting for the collective).
    pub fn run_device(&self, seq: u64, job: D, timeout: Duration) -> Result<Arc<D::Done>> {
        let op = job.op();
        let (reply, rx) = mpsc::channel();
        self.submit(Job::Device { seq, job, timeout, reply })?;
        Pending { rx, shared: self.h.shared.clone(), op, done: Mutex::new(None) }.wait()
    }

    /// Queues a send of `t` (already a private copy) to group rank `dst`; returns at once.
    /// An error is an earlier failure of the group.
    pub fn send(&self, dst: usize, t: Tensor, timeout: Duration) -> Result<()> {
        if t.rank() > MAX_DIMS {
            return Err(CollectiveError::InvalidArgument {
                op: "send",
                why: format!(
                    "the {} backend carries tensors of at most {MAX_DIMS} dims",
                    self.h.shared.backend
                ),
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
        let w = &self.h.world;
        let sorted = crate::world::sorted_members(w.size(), w.rank(), ranks)?;
        let comm = w.clone().group(sorted, timeout)?;
        Ok(w.process_group(comm, timeout))
    }
}

/// A job queued on a group's worker: what [`Work`](crate::Work) waits on (a
/// collective's output), or a device collective's completion event.
pub(crate) struct Pending<T = Option<Tensor>> {
    rx: Receiver<Result<T>>,
    shared: Arc<Shared>,
    op: &'static str,
    done: Mutex<Option<Result<T>>>,
}

impl<T> Pending<T> {
    /// Waits for the reply. Gives up (with `Timeout`) only when the worker has been stuck
    /// in one job longer than that job's timeout plus
    /// [`STUCK_GRACE`](super::worker::STUCK_GRACE).
    pub fn wait(self) -> Result<T> {
        if let Some(r) = self.done.into_inner().unwrap_or_else(PoisonError::into_inner) {
            return r;
        }
        loop {
            match self.rx.recv_timeout(Duration::from_millis(200)) {
                Ok(r) => return r,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.shared.failure().unwrap_or_else(|| {
                        self.shared.backend_err(self.op, "the group's worker thread exited".into())
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
