//! The thread that owns one group's NCCL communicator: it creates the stream and the
//! communicator, then runs the jobs the group's handles send it, one at a time, in order.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::nccl::{Comm, Id};
use tpar_tensor::Tensor;

use super::device::{driver_error_text, nccl_error_text, NcclDevice};
use super::exec::{self, Deadline};
use super::probe::guarded;
use crate::local::desc::Call;
use crate::p2p::{Expect, Mail};
use crate::{CollectiveError, Result, Store};

/// What a caller waits for: the collective's output (`None` for a barrier).
pub(crate) type Reply = Result<Option<Tensor>>;

/// One request to a group's worker.
pub(crate) enum Job {
    /// A numbered collective; `problem` is the caller's own argument error.
    Collective {
        seq: u64,
        call: Call,
        tensor: Option<Tensor>,
        problem: Option<Box<CollectiveError>>,
        timeout: Duration,
        reply: Sender<Reply>,
    },
    /// A send (nobody waits for it; a failure fails the group): header and payload, or
    /// the payload alone when `shaped` (`send_shaped`).
    Send { tensor: Tensor, dst: usize, shaped: bool, timeout: Duration },
    /// A receive: of a header and its payload, or (`recv_shaped`, `expect` given) of the
    /// payload alone, of the expected shape.
    Recv { src: usize, expect: Option<Expect>, timeout: Duration, reply: Sender<Reply> },
}

impl Job {
    pub fn op(&self) -> &'static str {
        match self {
            Job::Collective { call, .. } => call.name(),
            Job::Send { shaped: false, .. } => "send",
            Job::Send { shaped: true, .. } => "send_shaped",
            Job::Recv { expect: None, .. } => "recv",
            Job::Recv { expect: Some(_), .. } => "recv_shaped",
        }
    }

    fn timeout(&self) -> Duration {
        match self {
            Job::Collective { timeout, .. }
            | Job::Send { timeout, .. }
            | Job::Recv { timeout, .. } => *timeout,
        }
    }
}

/// What the worker is doing, for callers that wonder whether it is stuck.
#[derive(Clone, Copy)]
struct Busy {
    op: &'static str,
    since: Instant,
    timeout: Duration,
}

/// State shared by a group's handles and its worker.
pub(crate) struct Shared {
    /// The group's members, as global ranks.
    pub group: Arc<[usize]>,
    /// This process's global rank.
    pub rank: usize,
    failure: Mutex<Option<CollectiveError>>,
    busy: Mutex<Option<Busy>>,
}

/// How long past its own deadline a worker may stay in one job (blocked inside an NCCL or
/// CUDA call that cannot be polled) before its callers give up on it.
pub const STUCK_GRACE: Duration = Duration::from_secs(10);

impl Shared {
    pub fn new(group: Arc<[usize]>, rank: usize) -> Shared {
        Shared { group, rank, failure: Mutex::new(None), busy: Mutex::new(None) }
    }

    /// The error that broke the group, if one did.
    pub fn failure(&self) -> Option<CollectiveError> {
        self.failure.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Records the error that broke the group (the first one is kept).
    pub fn fail(&self, e: CollectiveError) {
        self.failure.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(e);
    }

    fn set_busy(&self, b: Option<Busy>) {
        *self.busy.lock().unwrap_or_else(PoisonError::into_inner) = b;
    }

    /// When the worker has been inside one job longer than its timeout plus
    /// [`STUCK_GRACE`]: the `Timeout` to report (also recorded as the group's failure).
    pub fn stuck(&self) -> Option<CollectiveError> {
        let b = (*self.busy.lock().unwrap_or_else(PoisonError::into_inner))?;
        if b.since.elapsed() <= b.timeout.saturating_add(STUCK_GRACE) {
            return None;
        }
        let e = CollectiveError::Timeout {
            op: b.op,
            group: self.group.to_vec(),
            waiting_for: Vec::new(),
            after: b.timeout,
        };
        self.fail(e.clone());
        self.failure()
    }
}

/// What a worker needs to set its communicator up.
pub(crate) struct Setup {
    pub ctx: Arc<CudaContext>,
    pub id: Id,
    pub me: usize,
    pub shared: Arc<Shared>,
    /// For the diagnosis of timeouts: the store and this group's key.
    pub store: Arc<dyn Store>,
    pub key: String,
}

fn is_fatal(e: &CollectiveError) -> bool {
    matches!(
        e,
        CollectiveError::Timeout { .. }
            | CollectiveError::Backend { .. }
            | CollectiveError::Panicked { .. }
            | CollectiveError::PeerFailed { .. }
    )
}

/// The worker's body: sets up, says so on `ready`, then serves `jobs` until every handle
/// is gone.
pub(crate) fn main(setup: Setup, jobs: Receiver<Job>, ready: Sender<Result<()>>) {
    let shared = setup.shared.clone();
    let group = shared.group.clone();
    let rank = group.get(setup.me).copied().unwrap_or(setup.me);
    let backend = |op: &'static str, message: String| CollectiveError::Backend {
        backend: "nccl",
        op,
        group: group.to_vec(),
        rank,
        message,
    };
    let made = guarded(|| -> Result<NcclDevice> {
        let stream = setup
            .ctx
            .new_stream()
            .map_err(|e| backend("init", format!("CUDA: {}", driver_error_text(&e))))?;
        let comm = Comm::from_rank(stream.clone(), setup.me, group.len(), setup.id)
            .map_err(|e| backend("init", format!("ncclCommInitRank: {}", nccl_error_text(&e))))?;
        Ok(NcclDevice::new(comm, stream, group.clone(), setup.me))
    });
    let mut dev = match made {
        Ok(Ok(d)) => d,
        Ok(Err(e)) => {
            let _ = ready.send(Err(e));
            return;
        }
        Err(p) => {
            let _ = ready.send(Err(backend("init", format!("panicked: {p}"))));
            return;
        }
    };
    if ready.send(Ok(())).is_err() {
        // The caller gave up waiting: nobody will use this communicator.
        return;
    }
    // Tensors this member sent to itself, waiting for its receive.
    let mut self_mail: VecDeque<Mail> = VecDeque::new();
    while let Ok(job) = jobs.recv() {
        let op = job.op();
        let timeout = job.timeout();
        shared.set_busy(Some(Busy { op, since: Instant::now(), timeout }));
        let deadline = Deadline::after(timeout);
        let (seq, reply, result) = match job {
            Job::Collective { seq, call, tensor, problem, reply, .. } => {
                let r = match shared.failure() {
                    Some(e) => Err(e),
                    None => guarded(|| {
                        exec::collective(&mut dev, seq, call, tensor, problem.map(|p| *p), deadline)
                    })
                    .unwrap_or_else(|p| Err(backend(op, format!("panicked: {p}")))),
                };
                (Some(seq), Some(reply), r)
            }
            Job::Send { tensor, dst, shaped, .. } if dst == setup.me => {
                self_mail.push_back(Mail { tensor, shaped });
                (None, None, Ok(None))
            }
            Job::Recv { src, expect, reply, .. } if src == setup.me => {
                let r = match (shared.failure(), self_mail.pop_front()) {
                    (Some(e), _) => Err(e),
                    (None, Some(m)) => {
                        guarded(|| exec::to_self(&mut dev, &m, expect.as_ref(), deadline))
                            .unwrap_or_else(|p| Err(backend(op, format!("panicked: {p}"))))
                            .map(Some)
                    }
                    (None, None) => Err(CollectiveError::InvalidArgument {
                        op,
                        why: format!(
                            "rank {rank} receives from itself but sent nothing to itself before: \
                             it would wait forever (one process's sends and receives on a group \
                             run in order on the group's worker)"
                        ),
                    }),
                };
                (None, Some(reply), r)
            }
            Job::Send { tensor, dst, shaped, .. } => {
                let r = match shared.failure() {
                    Some(e) => Err(e),
                    None => guarded(|| {
                        if shaped {
                            exec::send_shaped(&mut dev, &tensor, dst, deadline)
                        } else {
                            exec::send(&mut dev, &tensor, dst, deadline)
                        }
                    })
                    .unwrap_or_else(|p| Err(backend(op, format!("panicked: {p}"))))
                    .map(|()| None),
                };
                (None, None, r)
            }
            Job::Recv { src, expect, reply, .. } => {
                let r = match shared.failure() {
                    Some(e) => Err(e),
                    None => guarded(|| match &expect {
                        None => exec::recv(&mut dev, src, deadline),
                        Some(e) => exec::recv_shaped(&mut dev, src, e, deadline),
                    })
                    .unwrap_or_else(|p| Err(backend(op, format!("panicked: {p}"))))
                    .map(Some),
                };
                (None, Some(reply), r)
            }
        };
        shared.set_busy(None);
        let result = match result {
            Err(e) if is_fatal(&e) && shared.failure().is_none() => {
                let e = diagnose(e, seq, &setup, timeout);
                shared.fail(e.clone());
                dev.abort();
                Err(e)
            }
            r => r,
        };
        if let Some(reply) = reply {
            let _ = reply.send(result);
        }
    }
}

/// Fills in who a timed-out collective was waiting for: each member that times out
/// publishes the sequence number it was stuck in under
/// `tpar/nccl_at/<group key>/<global rank>`; members that publish the same number within a
/// short grace were there, the others were not.
fn diagnose(
    e: CollectiveError,
    seq: Option<u64>,
    setup: &Setup,
    timeout: Duration,
) -> CollectiveError {
    let (CollectiveError::Timeout { op, group, waiting_for, after }, Some(seq)) = (&e, seq) else {
        return e;
    };
    if !waiting_for.is_empty() {
        return e;
    }
    let me = group.get(setup.me).copied().unwrap_or(setup.me);
    let key = |r: usize| format!("tpar/nccl_at/{}/{r}", setup.key);
    if setup.store.set(&key(me), &seq.to_le_bytes()).is_err() {
        return e;
    }
    let grace = timeout.min(Duration::from_secs(3));
    let until = Instant::now() + grace;
    let mut missing = Vec::new();
    for &r in group.iter().filter(|&&r| r != me) {
        let left = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let there = setup
            .store
            .get_timeout(&key(r), left)
            .ok()
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .is_some_and(|v| u64::from_le_bytes(v) == seq);
        if !there {
            missing.push(r);
        }
    }
    CollectiveError::Timeout { op, group: group.clone(), waiting_for: missing, after: *after }
}
