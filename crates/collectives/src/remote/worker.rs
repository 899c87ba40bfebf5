//! The thread that owns one group's transport (an NCCL communicator, a group's share of
//! TCP connections) and runs the jobs the group's handles send it, one at a time, in
//! order.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tpar_tensor::Tensor;

use super::exec::{self, Deadline, DeviceWork, Transport};
use crate::local::desc::Call;
use crate::p2p::{Expect, Mail};
use crate::spawn::guarded;
use crate::{CollectiveError, Result};

/// What a caller waits for: the collective's output (`None` for a barrier).
pub(crate) type Reply = Result<Option<Tensor>>;

/// One request to a group's worker; `D` is the device work of the worker's transport.
pub(crate) enum Job<D: DeviceWork> {
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
    /// A numbered collective on device memory: enqueued, not waited for; the reply is
    /// its completion (see [`DeviceWork`]).
    Device { seq: u64, job: D, timeout: Duration, reply: Sender<Result<Arc<D::Done>>> },
}

impl<D: DeviceWork> Job<D> {
    pub fn op(&self) -> &'static str {
        match self {
            Job::Collective { call, .. } => call.name(),
            Job::Send { shaped: false, .. } => "send",
            Job::Send { shaped: true, .. } => "send_shaped",
            Job::Recv { expect: None, .. } => "recv",
            Job::Recv { expect: Some(_), .. } => "recv_shaped",
            Job::Device { job, .. } => job.op(),
        }
    }

    fn timeout(&self) -> Duration {
        match self {
            Job::Collective { timeout, .. }
            | Job::Send { timeout, .. }
            | Job::Recv { timeout, .. }
            | Job::Device { timeout, .. } => *timeout,
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
    /// The backend's name, for errors (`"nccl"`, `"tcp"`).
    pub backend: &'static str,
    failure: Mutex<Option<CollectiveError>>,
    busy: Mutex<Option<Busy>>,
}

/// How long past its own deadline a worker may stay in one job (blocked inside an NCCL or
/// CUDA call that cannot be polled) before its callers give up on it.
pub const STUCK_GRACE: Duration = Duration::from_secs(10);

impl Shared {
    pub fn new(group: Arc<[usize]>, rank: usize, backend: &'static str) -> Shared {
        Shared { group, rank, backend, failure: Mutex::new(None), busy: Mutex::new(None) }
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
            chain: Vec::new(),
        };
        self.fail(e.clone());
        self.failure()
    }

    /// A backend error of this group, seen by this rank.
    pub fn backend_err(&self, op: &'static str, message: String) -> CollectiveError {
        CollectiveError::Backend {
            backend: self.backend,
            op,
            group: self.group.to_vec(),
            rank: self.rank,
            message,
        }
    }
}

/// Errors after which a group's members are out of step (a collective was cut short), so
/// every later call on the group fails with the same error.
fn is_fatal(e: &CollectiveError) -> bool {
    matches!(
        e,
        CollectiveError::Timeout { .. }
            | CollectiveError::Backend { .. }
            | CollectiveError::Panicked { .. }
            | CollectiveError::PeerFailed { .. }
    )
}

/// Serves `jobs` on transport `x` (member `me` of the group) until every handle is gone.
///
/// A fatal error (timeout, peer failure, backend error) is passed through `diagnose`
/// (which may name who was missing, given the collective's sequence number), recorded as
/// the group's failure, aborts the transport, and fails every later job.
pub(crate) fn serve<X: Transport>(
    x: &mut X,
    me: usize,
    shared: &Shared,
    jobs: Receiver<Job<X::DeviceJob>>,
    diagnose: impl Fn(CollectiveError, Option<u64>, Duration) -> CollectiveError,
) {
    let rank = shared.rank;
    let panicked = |op: &'static str, p: String| shared.backend_err(op, format!("panicked: {p}"));
    // Tensors this member sent to itself, waiting for its receive.
    let mut self_mail: VecDeque<Mail> = VecDeque::new();
    // A fatal error (recorded as the group's failure, the transport aborted).
    let fatal = |x: &mut X, e: CollectiveError, seq: Option<u64>, timeout: Duration| {
        let e = diagnose(e, seq, timeout);
        shared.fail(e.clone());
        x.abort();
        e
    };
    loop {
        // With device collectives in flight, wake up now and then to check them.
        let job = if x.device_in_flight() {
            match jobs.recv_timeout(DEVICE_POLL) {
                Ok(j) => Some(j),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        } else {
            match jobs.recv() {
                Ok(j) => Some(j),
                Err(_) => break,
            }
        };
        if let Some((e, seq, timeout)) = x.poll_device() {
            if shared.failure().is_none() {
                fatal(x, e, Some(seq), timeout);
            }
        }
        let Some(job) = job else { continue };
        let op = job.op();
        let timeout = job.timeout();
        shared.set_busy(Some(Busy { op, since: Instant::now(), timeout }));
        let deadline = Deadline::after(timeout);
        let (seq, reply, result) = match job {
            Job::Collective { seq, call, tensor, problem, reply, .. } => {
                let r = match shared.failure() {
                    Some(e) => Err(e),
                    None => guarded(|| {
                        exec::collective(x, seq, call, tensor, problem.map(|p| *p), deadline)
                    })
                    .unwrap_or_else(|p| Err(panicked(op, p))),
                };
                (Some(seq), Some(reply), r)
            }
            Job::Send { tensor, dst, shaped, .. } if dst == me => {
                self_mail.push_back(Mail { tensor, shaped });
                (None, None, Ok(None))
            }
            Job::Recv { src, expect, reply, .. } if src == me => {
                let r = match (shared.failure(), self_mail.pop_front()) {
                    (Some(e), _) => Err(e),
                    (None, Some(m)) => guarded(|| exec::to_self(x, &m, expect.as_ref(), deadline))
                        .unwrap_or_else(|p| Err(panicked(op, p)))
                        .map(Some),
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
                            exec::send_shaped(x, &tensor, dst, deadline)
                        } else {
                            exec::send(x, &tensor, dst, deadline)
                        }
                    })
                    .unwrap_or_else(|p| Err(panicked(op, p)))
                    .map(|()| None),
                };
                (None, None, r)
            }
            Job::Device { seq, job, reply, .. } => {
                let r = match shared.failure() {
                    Some(e) => Err(e),
                    None => guarded(|| x.run_device(seq, job, deadline))
                        .unwrap_or_else(|p| Err(panicked(op, p))),
                };
                shared.set_busy(None);
                let r = match r {
                    Err(e) if is_fatal(&e) && shared.failure().is_none() => {
                        Err(fatal(x, e, Some(seq), timeout))
                    }
                    r => r,
                };
                let _ = reply.send(r);
                continue;
            }
            Job::Recv { src, expect, reply, .. } => {
                let r = match shared.failure() {
                    Some(e) => Err(e),
                    None => guarded(|| match &expect {
                        None => exec::recv(x, src, deadline),
                        Some(e) => exec::recv_shaped(x, src, e, deadline),
                    })
                    .unwrap_or_else(|p| Err(panicked(op, p)))
                    .map(Some),
                };
                (None, Some(reply), r)
            }
        };
        shared.set_busy(None);
        let result = match result {
            Err(e) if is_fatal(&e) && shared.failure().is_none() => Err(fatal(x, e, seq, timeout)),
            r => r,
        };
        if let Some(reply) = reply {
            let _ = reply.send(result);
        }
    }
    // Every handle is gone: let the device collectives still in flight finish (or time
    // out) before the transport is dropped, which would abort them under the peers.
    while x.device_in_flight() && shared.failure().is_none() {
        if let Some((e, seq, timeout)) = x.poll_device() {
            fatal(x, e, Some(seq), timeout);
            break;
        }
        std::thread::sleep(DEVICE_POLL);
    }
}

/// How often a worker with device collectives in flight checks them.
const DEVICE_POLL: Duration = Duration::from_micros(200);
