//! The `local` backend: ranks are threads of one process sharing a [`World`](crate::World).
//!
//! Each distinct member list (sorted global ranks) owns one [`Exchange`], created on first
//! use by any member, so every handle on the same rank list talks through the same
//! exchange and different groups never cross-talk. A collective is a numbered slot in the
//! exchange (each member numbers its calls on the exchange 0, 1, 2, ...):
//!
//! 1. every member *posts* a handle to its input tensor (no copy) and a descriptor of its
//!    call (collective, parameters, dtype, shape); the last to post checks that all
//!    descriptors agree and publishes the verdict;
//! 2. each member builds its own output straight from the peers' posted buffers, reading
//!    only the pieces it needs (a large `all_reduce` on 3+ members is a reduce-scatter
//!    into per-member staged chunks followed by a gather of those chunks; otherwise each
//!    member reduces the whole tensor; terms are always combined in member order, so
//!    every member gets bit-identical results). A member whose tensor is a CUDA tensor
//!    does the same on its device, device to device (the `device` module): no host copy,
//!    results on its device, bit-equal to the host path's. A large host `all_reduce_`
//!    that every member calls in place instead reduces each member's chunk of all
//!    members' tensors and writes it back into each, and a large host `all_reduce_into`
//!    that every member calls writes it into each member's `out` (the `inplace` module);
//! 3. members whose input others still read wait until everyone is done, so a caller may
//!    overwrite its input as soon as the call returns; the last member frees the slot.
//!
//! Every wait is a `Condvar::wait_timeout` loop that also wakes when the world is marked
//! failed or a member thread has exited, so peers of a dead rank return promptly.

mod blame;
pub(crate) mod desc;
mod device;
mod inplace;
pub(crate) mod kernels;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tpar_tensor::{CpuStorage, DType, Device, Element, Tensor};

pub(crate) use desc::Call;
use desc::{Desc, Place};
use kernels::{reduce_runs, store_fence, with_slices, Narrow, Reducible, STREAM_MIN_BYTES};

use crate::p2p::{check_arrival, Expect, Mail};
use crate::{chunk_range, CollectiveError, CommDebug, ReduceOp, Result, WaitLink};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// State shared by all rank threads of a world.
pub(crate) struct WorldShared {
    pub size: usize,
    pub timeout: Duration,
    failed: AtomicBool,
    failure: Mutex<Option<(usize, String)>>,
    /// The rank whose report marked the world failed (the blamed rank may differ).
    reporter: Mutex<Option<usize>>,
    waits: blame::Waits,
    exited: Vec<AtomicBool>,
    pending: Vec<AtomicUsize>,
    groups: Mutex<HashMap<Vec<usize>, Arc<Exchange>>>,
    pub debug: Vec<CommDebug>,
}

impl WorldShared {
    pub fn new(size: usize, timeout: Duration) -> WorldShared {
        WorldShared {
            size,
            timeout,
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            reporter: Mutex::new(None),
            waits: blame::Waits::new(size),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            pending: (0..size).map(|_| AtomicUsize::new(0)).collect(),
            groups: Mutex::new(HashMap::new()),
            debug: (0..size).map(|_| CommDebug::new()).collect(),
        }
    }

    /// Marks the world failed by `rank` (the first call wins). Returns whether it was first.
    pub fn fail(&self, rank: usize, why: String) -> bool {
        self.fail_blaming(rank, rank, why)
    }

    /// Marks the world failed on `reporter`'s report, blaming the rank that held up the
    /// wait `reporter` last failed in (a timeout, a peer gone), or else `reporter`.
    pub fn fail_reported(&self, reporter: usize, why: String) -> bool {
        let culprit = self.waits.culprit(reporter);
        self.fail_blaming(reporter, culprit, why)
    }

    /// The rank whose report marked the world failed.
    pub fn reporter(&self) -> Option<usize> {
        *lock(&self.reporter)
    }

    fn fail_blaming(&self, reporter: usize, rank: usize, why: String) -> bool {
        let first = {
            let mut f = lock(&self.failure);
            let first = f.is_none();
            if first {
                *f = Some((rank, why));
                *lock(&self.reporter) = Some(reporter);
            }
            first
        };
        self.failed.store(true, Ordering::SeqCst);
        self.wake_all();
        first
    }

    pub fn failure(&self) -> Option<(usize, String)> {
        lock(&self.failure).clone()
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Records that `rank`'s thread has returned: peers waiting on it stop waiting.
    pub fn mark_exited(&self, rank: usize) {
        if let Some(e) = self.exited.get(rank) {
            e.store(true, Ordering::SeqCst);
            self.wake_all();
        }
    }

    /// A rank is gone when its thread returned and it has no async operation in flight.
    fn gone(&self, rank: usize) -> bool {
        self.exited.get(rank).is_some_and(|e| e.load(Ordering::SeqCst))
            && self.pending.get(rank).is_none_or(|p| p.load(Ordering::SeqCst) == 0)
    }

    pub fn async_started(&self, rank: usize) {
        if let Some(p) = self.pending.get(rank) {
            p.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub fn async_finished(&self, rank: usize) {
        if let Some(p) = self.pending.get(rank) {
            if p.fetch_sub(1, Ordering::SeqCst) == 1 && self.gone(rank) {
                self.wake_all();
            }
        }
    }

    /// Wakes every waiter of every exchange (they re-check failure and exits).
    fn wake_all(&self) {
        let exchanges: Vec<Arc<Exchange>> = lock(&self.groups).values().cloned().collect();
        for ex in exchanges {
            // Taking the lock orders this wake after any waiter's check of the flags.
            let _g = ex.lock();
            ex.cv.notify_all();
        }
    }

    /// The exchange of a (sorted, validated) member list, created on first use.
    pub fn exchange(&self, members: &[usize]) -> Arc<Exchange> {
        let mut groups = lock(&self.groups);
        groups.entry(members.to_vec()).or_insert_with(|| Arc::new(Exchange::new(members))).clone()
    }
}

/// The meeting point of one member list.
pub(crate) struct Exchange {
    members: Arc<[usize]>,
    state: Mutex<ExState>,
    cv: Condvar,
    next_seq: Vec<AtomicU64>,
}

#[derive(Default)]
struct ExState {
    slots: HashMap<u64, Slot>,
    /// Point-to-point queues keyed by (source, destination) member index.
    mail: HashMap<(usize, usize), VecDeque<Mail>>,
}

struct Post {
    desc: Desc,
    tensor: Option<Tensor>,
    problem: Option<CollectiveError>,
    /// Where the member wants its result.
    wants: Wants,
}

/// A posted [`Dest`], without the memory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wants {
    New,
    /// The member gave the memory of its own `out` (an `*_into` call).
    Into,
    /// The result in its input tensor (`all_reduce_`).
    InPlace,
}

struct Slot {
    posts: Vec<Option<Post>>,
    n_posted: usize,
    verdict: Option<Result<()>>,
    staged: Vec<Option<Arc<CpuStorage>>>,
    n_staged: usize,
    lent: Vec<Option<Arc<inplace::Lent>>>,
    n_lent: usize,
    done: Vec<bool>,
    n_done: usize,
    abort: Option<CollectiveError>,
}

impl Slot {
    fn new(n: usize) -> Slot {
        Slot {
            posts: (0..n).map(|_| None).collect(),
            n_posted: 0,
            verdict: None,
            staged: vec![None; n],
            n_staged: 0,
            lent: (0..n).map(|_| None).collect(),
            n_lent: 0,
            done: vec![false; n],
            n_done: 0,
            abort: None,
        }
    }
}

/// When a collective must be over, and the timeout that set it (for messages).
#[derive(Clone, Copy)]
struct Clock {
    deadline: Option<Instant>,
    timeout: Duration,
}

impl Clock {
    const NONE: Clock = Clock { deadline: None, timeout: Duration::MAX };

    fn start(timeout: Duration) -> Clock {
        Clock { deadline: Instant::now().checked_add(timeout), timeout }
    }
}

#[derive(Clone, Copy)]
enum Phase {
    Posted,
    Staged,
    Lent,
    Done,
}

impl Exchange {
    fn new(members: &[usize]) -> Exchange {
        Exchange {
            members: members.into(),
            state: Mutex::new(ExState::default()),
            cv: Condvar::new(),
            next_seq: members.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ExState> {
        lock(&self.state)
    }
}

/// Where a member wants the result of its collective.
pub(crate) enum Dest {
    /// A new tensor.
    New,
    /// The memory of the caller's `out` (an `*_into` call), refilled with the result.
    Into(CpuStorage),
    /// The input tensor itself (`all_reduce_`). Large host all_reduces whose members all
    /// ask for this run in place and return `None`; otherwise the result is returned, for
    /// the caller to move into the tensor.
    InPlace,
}

/// The local backend's handle on one group, for one member.
#[derive(Clone)]
pub(crate) struct LocalComm {
    world: Arc<WorldShared>,
    ex: Arc<Exchange>,
    /// This member's index in the group.
    me: usize,
    /// The chunk this member staged in its last `all_reduce` of [`SPARE_MIN_BYTES`] or
    /// more: reused by the next one once no peer holds it, so the staging memory is not
    /// faulted in every call.
    spare: Arc<Mutex<Option<Arc<CpuStorage>>>>,
}

/// From this size on a fresh buffer is a new mapping (past glibc's largest mmap
/// threshold) whose pages fault in one by one: worth keeping a staged chunk for reuse.
const SPARE_MIN_BYTES: usize = 32 << 20;

fn internal(op: &'static str, what: &str) -> CollectiveError {
    CollectiveError::InvalidArgument { op, why: format!("internal error: {what}") }
}

impl LocalComm {
    pub fn new(world: Arc<WorldShared>, ex: Arc<Exchange>, me: usize) -> LocalComm {
        LocalComm { world, ex, me, spare: Arc::default() }
    }

    pub fn world(&self) -> &Arc<WorldShared> {
        &self.world
    }

    fn group(&self) -> Vec<usize> {
        self.ex.members.to_vec()
    }

    fn global(&self, member: usize) -> usize {
        self.ex.members.get(member).copied().unwrap_or(member)
    }

    /// The next sequence number of this member's calls on the exchange.
    pub fn next_seq(&self) -> u64 {
        self.ex.next_seq.get(self.me).map_or(0, |s| s.fetch_add(1, Ordering::SeqCst))
    }

    /// Waits until `phase` is complete in slot `seq`, the slot is aborted, the world
    /// fails, a missing member is gone, or the deadline passes.
    fn wait<'a>(
        &'a self,
        st: MutexGuard<'a, ExState>,
        seq: u64,
        op: &'static str,
        clock: Clock,
        phase: Phase,
    ) -> (MutexGuard<'a, ExState>, Result<()>) {
        let me = self.global(self.me);
        let mut token = None;
        let (st, r) = self.wait_blocking(st, seq, op, clock, phase, &mut token);
        // A failed wait stays on record (for the blame of a peer waiting on this rank, and
        // of this rank's own failure), unless the world's failure already names a rank.
        let failed = match &r {
            Err(e) if !self.world.is_failed() => self.failed_link(op, e),
            _ => None,
        };
        self.world.waits.unblock(me, token, failed);
        (st, r)
    }

    /// The record of this member's wait in `op` that failed with `e`, naming whom it
    /// waited for (`None` when `e` blames nobody).
    fn failed_link(&self, op: &'static str, e: &CollectiveError) -> Option<WaitLink> {
        let waiting_for = match e {
            CollectiveError::Timeout { waiting_for, .. } if !waiting_for.is_empty() => {
                waiting_for.clone()
            }
            e => vec![e.culprit()?],
        };
        Some(WaitLink { rank: self.global(self.me), op, group: self.group(), waiting_for })
    }

    fn wait_blocking<'a>(
        &'a self,
        mut st: MutexGuard<'a, ExState>,
        seq: u64,
        op: &'static str,
        clock: Clock,
        phase: Phase,
        token: &mut Option<u64>,
    ) -> (MutexGuard<'a, ExState>, Result<()>) {
        loop {
            let Some(slot) = st.slots.get_mut(&seq) else {
                // Only the last member to finish frees a slot.
                let r = match phase {
                    Phase::Done => Ok(()),
                    _ => Err(internal(op, "collective slot freed early")),
                };
                return (st, r);
            };
            let ready = match phase {
                Phase::Posted => slot.verdict.is_some(),
                Phase::Staged => slot.n_staged == slot.staged.len(),
                Phase::Lent => slot.n_lent == slot.lent.len(),
                Phase::Done => slot.n_done == slot.done.len(),
            };
            if ready {
                return (st, Ok(()));
            }
            if let Some(e) = &slot.abort {
                let e = e.clone();
                return (st, Err(e));
            }
            let missing: Vec<usize> = match phase {
                Phase::Posted => {
                    (0..slot.posts.len()).filter(|&i| slot.posts[i].is_none()).collect()
                }
                Phase::Staged => {
                    (0..slot.staged.len()).filter(|&i| slot.staged[i].is_none()).collect()
                }
                Phase::Lent => (0..slot.lent.len()).filter(|&i| slot.lent[i].is_none()).collect(),
                Phase::Done => (0..slot.done.len()).filter(|&i| !slot.done[i]).collect(),
            };
            let mut missing: Vec<usize> = missing.into_iter().map(|m| self.global(m)).collect();
            if self.world.is_failed() {
                let (rank, why) = self.world.failure().unwrap_or((usize::MAX, String::new()));
                let e = CollectiveError::PeerFailed { op, group: self.group(), rank, why };
                return (st, Err(e));
            }
            if let Some(&g) = missing.iter().find(|&&g| self.world.gone(g)) {
                let e = CollectiveError::PeerFailed {
                    op,
                    group: self.group(),
                    rank: g,
                    why: format!("its rank function returned without joining {op} call #{seq}"),
                };
                slot.abort.get_or_insert_with(|| e.clone());
                self.ex.cv.notify_all();
                return (st, Err(e));
            }
            let now = Instant::now();
            let left = match clock.deadline {
                Some(d) if now >= d => {
                    let chain = self.world.waits.chain(&mut missing);
                    let e = CollectiveError::Timeout {
                        op,
                        group: self.group(),
                        waiting_for: missing,
                        after: clock.timeout,
                        chain,
                    };
                    slot.abort.get_or_insert_with(|| e.clone());
                    self.ex.cv.notify_all();
                    return (st, Err(e));
                }
                Some(d) => Some(d - now),
                None => None,
            };
            let link = WaitLink {
                rank: self.global(self.me),
                op,
                group: self.group(),
                waiting_for: missing,
            };
            self.world.waits.block(token, link);
            st = match left {
                Some(left) => {
                    self.ex.cv.wait_timeout(st, left).unwrap_or_else(PoisonError::into_inner).0
                }
                None => self.ex.cv.wait(st).unwrap_or_else(PoisonError::into_inner),
            };
        }
    }

    /// Marks this member done with slot `seq` (freeing it if last); with `wait_all`, waits
    /// until every member is done (their reads of this member's input are over).
    fn leave(
        &self,
        mut st: MutexGuard<'_, ExState>,
        seq: u64,
        op: &'static str,
        clock: Clock,
        wait_all: bool,
    ) -> Result<()> {
        let Some(slot) = st.slots.get_mut(&seq) else { return Ok(()) };
        if let Some(d) = slot.done.get_mut(self.me) {
            if !*d {
                *d = true;
                slot.n_done += 1;
            }
        }
        if slot.n_done == slot.done.len() {
            st.slots.remove(&seq);
            self.ex.cv.notify_all();
            return Ok(());
        }
        self.ex.cv.notify_all();
        if !wait_all {
            return Ok(());
        }
        let (_st, r) = self.wait(st, seq, op, clock, Phase::Done);
        r
    }

    /// Leaves slot `seq` after a failure of this member, telling the others.
    fn abandon(&self, seq: u64, op: &'static str, e: &CollectiveError) {
        let mut st = self.ex.lock();
        if let Some(slot) = st.slots.get_mut(&seq) {
            slot.abort.get_or_insert_with(|| CollectiveError::PeerFailed {
                op,
                group: self.ex.members.to_vec(),
                rank: self.ex.members.get(self.me).copied().unwrap_or(self.me),
                why: e.to_string(),
            });
        }
        let _ = self.leave(st, seq, op, Clock::NONE, false);
    }

    /// Runs collective number `seq` of this member. `problem` is an argument error found
    /// locally: it is posted so that peers fail at once instead of waiting. `dest` says
    /// where this member wants the result ([`Dest`]).
    pub fn run(
        &self,
        seq: u64,
        call: Call,
        tensor: Option<Tensor>,
        problem: Option<CollectiveError>,
        timeout: Duration,
        dest: Dest,
    ) -> Result<Option<Tensor>> {
        let op = call.name();
        let n = self.ex.members.len();
        let (mut reuse, wants) = match dest {
            Dest::New => (None, Wants::New),
            Dest::Into(s) => (Some(s), Wants::Into),
            Dest::InPlace => (None, Wants::InPlace),
        };
        let me = self.me;
        let clock = Clock::start(timeout);
        let desc = Desc::new(call.clone(), tensor.as_ref());
        // A CUDA member builds its output on its device, device to device; its own
        // input must be complete on the device before peers read it. With one stream
        // for every CUDA tensor of the process (one GPU), stream order sees to that,
        // and to the peers' reads being over before they reuse their buffers: no
        // synchronisation then, before or after.
        let on_device = match tensor.as_ref().map(Tensor::device) {
            Some(Device::Cuda(o)) => Some(o),
            _ => None,
        };
        let sync = on_device.is_some() && !tpar_tensor::gpu::single_stream();
        let problem = match on_device {
            Some(o) if sync => problem.or_else(|| {
                tpar_tensor::gpu::synchronize(o).err().map(|e| CollectiveError::InvalidArgument {
                    op,
                    why: format!("cuda:{o} failed before the collective: {e}"),
                })
            }),
            _ => problem,
        };

        // Phase 1: post.
        let mut st = self.ex.lock();
        let slot = st.slots.entry(seq).or_insert_with(|| Slot::new(n));
        if let Some(e) = slot.abort.clone() {
            let _ = self.leave(st, seq, op, clock, false);
            return Err(e);
        }
        if slot.posts.get(me).is_none_or(|p| p.is_some()) {
            return Err(internal(op, "member posted twice to one collective"));
        }
        let own_problem = problem.clone();
        slot.posts[me] = Some(Post { desc, tensor, problem, wants });
        slot.n_posted += 1;
        if slot.n_posted == n {
            slot.verdict = Some(self.verdict(&slot.posts));
            self.ex.cv.notify_all();
        }
        let (st, r) = self.wait(st, seq, op, clock, Phase::Posted);
        if let Err(e) = r {
            let _ = self.leave(st, seq, op, clock, false);
            return Err(own_problem.unwrap_or(e));
        }
        let Some(slot) = st.slots.get(&seq) else {
            return Err(internal(op, "collective slot vanished"));
        };
        let verdict = slot.verdict.clone().unwrap_or(Ok(()));
        if let Err(e) = verdict {
            let _ = self.leave(st, seq, op, clock, false);
            return Err(own_problem.unwrap_or(e));
        }
        let mut tensors = Vec::with_capacity(n);
        let mut descs = Vec::with_capacity(n);
        let all_want = |w: Wants| slot.posts.iter().flatten().all(|p| p.wants == w);
        let (all_in_place, all_into) = (all_want(Wants::InPlace), all_want(Wants::Into));
        for p in slot.posts.iter().flatten() {
            if let Some(t) = &p.tensor {
                tensors.push(t.clone());
            }
            descs.push(p.desc.clone());
        }
        drop(st);

        // Phase 2: compute this member's output from the peers' buffers.
        let meta = match call {
            Call::Broadcast { src } => descs.get(src).is_some_and(|d| d.place == Place::Meta),
            _ => descs.iter().any(|d| d.place == Place::Meta),
        };
        let lend_outs = matches!(call, Call::AllReduce { .. })
            && !meta
            && tensors.len() == n
            && inplace::runs_into(&tensors, all_into);
        if let (Call::AllReduce { op: rop }, Some(out)) = (&call, reuse.take_if(|_| lend_outs)) {
            return self.all_reduce_lent_into(seq, &tensors, *rop, clock, out);
        }
        let result = match &call {
            Call::Barrier => Ok(None),
            Call::AllReduce { op: rop }
                if !meta
                    && tensors.len() == n
                    && inplace::runs_in_place(&tensors, all_in_place) =>
            {
                return self.all_reduce_in_place(seq, &tensors, *rop, clock);
            }
            // Staged chunks live on the host: only when every member is a host member
            // (all decide alike, as every member must stage).
            Call::AllReduce { op: rop }
                if !meta
                    && descs.iter().all(|d| d.place == Place::Cpu)
                    && staged_all_reduce(n, &descs[me].dims) =>
            {
                return self.all_reduce(seq, &tensors, &descs, *rop, clock, reuse);
            }
            _ if meta || tensors.len() != n => self.output_meta(&call, &descs),
            _ if on_device.is_some() => {
                let o = on_device.unwrap_or_default();
                device::compute(&call, &tensors, &descs, me, o).and_then(|out| {
                    // Reads of the peers' buffers are over before they may reuse them.
                    if sync {
                        tpar_tensor::gpu::synchronize(o).map_err(|e| {
                            CollectiveError::InvalidArgument { op, why: format!("cuda:{o}: {e}") }
                        })?;
                    }
                    Ok(out)
                })
            }
            Call::AllReduce { op: rop } => {
                // Direct: reduce the whole tensor from every input (one chunk of one).
                reduce_scatter(&tensors, &descs[me].dims, 0, *rop, 0, 1, reuse).map(Some)
            }
            Call::AllGather { dim } => all_gather(&tensors, &descs, *dim, reuse).map(Some),
            Call::ReduceScatter { dim, op: rop } => {
                reduce_scatter(&tensors, &descs[me].dims, *dim, *rop, me, n, reuse).map(Some)
            }
            Call::AllToAll { split_dim, concat_dim, .. } => {
                all_to_all(&tensors, &descs, *split_dim, *concat_dim, me, n).map(Some)
            }
            Call::Broadcast { src } => match tensors.get(*src) {
                Some(t) => copy_whole(t).map(Some),
                None => Err(internal(op, "broadcast source out of range")),
            },
        };
        match result {
            Ok(out) => {
                // Peers read our input until they are done: wait for them before returning
                // (only the source's input is read by a broadcast; nothing by a barrier).
                let readers = match call {
                    Call::Barrier => false,
                    Call::Broadcast { src } => src == me && n > 1,
                    _ => n > 1 && !meta,
                };
                self.leave(self.ex.lock(), seq, op, clock, readers)?;
                Ok(out)
            }
            Err(e) => {
                self.abandon(seq, op, &e);
                Err(e)
            }
        }
    }

    fn verdict(&self, posts: &[Option<Post>]) -> Result<()> {
        let members = &self.ex.members;
        for (i, p) in posts.iter().enumerate() {
            if let Some(Post { problem: Some(e), desc, .. }) = p {
                return Err(CollectiveError::InvalidArgument {
                    op: desc.call.name(),
                    why: format!(
                        "rank {} passed invalid arguments: {e}",
                        members.get(i).copied().unwrap_or(i)
                    ),
                });
            }
        }
        let descs: Vec<&Desc> = posts.iter().flatten().map(|p| &p.desc).collect();
        if descs.len() != posts.len() {
            return Err(internal("collective", "verdict before every member posted"));
        }
        desc::validate(members, &descs)
    }

    /// Output of a collective on meta tensors: the right shape and dtype, no data.
    fn output_meta(&self, call: &Call, descs: &[Desc]) -> Result<Option<Tensor>> {
        let n = descs.len();
        let me = self.me;
        let (dims, dtype) = match call {
            Call::Barrier => return Ok(None),
            Call::Broadcast { src } => match descs.get(*src) {
                Some(d) => (d.dims.clone(), d.dtype),
                None => return Err(internal(call.name(), "broadcast source out of range")),
            },
            Call::AllReduce { .. } => (descs[me].dims.clone(), descs[me].dtype),
            Call::ReduceScatter { dim, .. } => {
                let mut d = descs[me].dims.clone();
                d[*dim] = chunk_range(d[*dim], n, me).1;
                (d, descs[me].dtype)
            }
            Call::AllGather { dim } => {
                let mut d = descs[me].dims.clone();
                d[*dim] = descs.iter().map(|x| x.dims[*dim]).sum();
                (d, descs[me].dtype)
            }
            Call::AllToAll { split_dim, concat_dim, .. } => {
                let pieces = a2a_pieces(descs, *split_dim, me, n)?;
                let mut d = pieces[0].0.clone();
                d[*concat_dim] = pieces.iter().map(|p| p.0[*concat_dim]).sum();
                (d, descs[me].dtype)
            }
        };
        Ok(Some(Tensor::empty(dims, dtype, Device::Meta)?))
    }

    /// `all_reduce` for `n > 1`: reduce this member's flat chunk from every input, stage
    /// it, then gather every member's staged chunk.
    fn all_reduce(
        &self,
        seq: u64,
        tensors: &[Tensor],
        descs: &[Desc],
        rop: ReduceOp,
        clock: Clock,
        reuse: Option<CpuStorage>,
    ) -> Result<Option<Tensor>> {
        let op = "all_reduce";
        let n = tensors.len();
        let dims = descs[self.me].dims.clone();
        let numel: usize = dims.iter().product();
        let (start, len) = chunk_range(numel, n, self.me);
        let dtype = descs[self.me].dtype;
        let spare = lock(&self.spare).take().and_then(|s| Arc::try_unwrap(s).ok());
        let staged = match reduce_flat_chunk(tensors, start, len, rop, spare) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                self.abandon(seq, op, &e);
                return Err(e);
            }
        };
        if len * dtype.size_in_bytes() >= SPARE_MIN_BYTES {
            *lock(&self.spare) = Some(staged.clone());
        }
        let mut st = self.ex.lock();
        if let Some(slot) = st.slots.get_mut(&seq) {
            if let Some(s) = slot.staged.get_mut(self.me) {
                if s.is_none() {
                    *s = Some(staged);
                    slot.n_staged += 1;
                }
            }
            self.ex.cv.notify_all();
        }
        let (st, r) = self.wait(st, seq, op, clock, Phase::Staged);
        let chunks: Vec<Arc<CpuStorage>> = match (&r, st.slots.get(&seq)) {
            (Ok(()), Some(slot)) => slot.staged.iter().flatten().cloned().collect(),
            _ => Vec::new(),
        };
        // Nobody reads our input any more (everyone staged), so leave without waiting.
        let _ = self.leave(st, seq, op, clock, false);
        r?;
        if chunks.len() != n {
            return Err(internal(op, "missing staged chunk"));
        }
        let out = concat_storages(&chunks, numel, dtype, reuse)?;
        Ok(Some(Tensor::from_storage(out, dims)?))
    }

    /// Queues a copy of `t` for member `dst` (FIFO per pair), sent by `send_shaped` when
    /// `shaped`, else by `send`. Never blocks.
    pub fn send(&self, dst: usize, t: Tensor, shaped: bool) {
        let mut st = self.ex.lock();
        st.mail.entry((self.me, dst)).or_default().push_back(Mail { tensor: t, shaped });
        self.ex.cv.notify_all();
    }

    /// Takes the oldest tensor member `src` sent by `send`, waiting up to `timeout`.
    pub fn recv(&self, src: usize, timeout: Duration) -> Result<Tensor> {
        let op = "recv";
        let mail = self.take(op, src, timeout)?;
        check_arrival(op, &self.ex.members, src, self.me, &mail, None)?;
        Ok(mail.tensor)
    }

    /// Takes the oldest tensor member `src` sent by `send_shaped`, waiting up to
    /// `timeout`; it must be what `expect` describes (else a `Mismatch`, and the message
    /// is consumed all the same).
    pub fn recv_shaped(&self, src: usize, expect: &Expect, timeout: Duration) -> Result<Tensor> {
        let op = "recv_shaped";
        let mail = self.take(op, src, timeout)?;
        check_arrival(op, &self.ex.members, src, self.me, &mail, Some(expect))?;
        Ok(mail.tensor)
    }

    /// Takes the oldest message member `src` sent to this member, waiting up to `timeout`;
    /// fails early when the world fails or `src` is gone.
    fn take(&self, op: &'static str, src: usize, timeout: Duration) -> Result<Mail> {
        let mut token = None;
        let r = self.take_blocking(op, src, timeout, &mut token);
        let failed = match &r {
            Err(e) if !self.world.is_failed() => self.failed_link(op, e),
            _ => None,
        };
        self.world.waits.unblock(self.global(self.me), token, failed);
        r
    }

    fn take_blocking(
        &self,
        op: &'static str,
        src: usize,
        timeout: Duration,
        token: &mut Option<u64>,
    ) -> Result<Mail> {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.ex.lock();
        loop {
            if let Some(m) = st.mail.get_mut(&(src, self.me)).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            let g = self.global(src);
            if self.world.is_failed() {
                let (rank, why) = self.world.failure().unwrap_or((usize::MAX, String::new()));
                return Err(CollectiveError::PeerFailed { op, group: self.group(), rank, why });
            }
            if self.world.gone(g) {
                return Err(CollectiveError::PeerFailed {
                    op,
                    group: self.group(),
                    rank: g,
                    why: "its rank function returned without sending the awaited tensor".into(),
                });
            }
            let link = WaitLink {
                rank: self.global(self.me),
                op,
                group: self.group(),
                waiting_for: vec![g],
            };
            self.world.waits.block(token, link);
            let now = Instant::now();
            st = match deadline {
                Some(d) if now >= d => {
                    let mut waiting_for = vec![g];
                    let chain = self.world.waits.chain(&mut waiting_for);
                    return Err(CollectiveError::Timeout {
                        op,
                        group: self.group(),
                        waiting_for,
                        after: timeout,
                        chain,
                    });
                }
                Some(d) => {
                    self.ex.cv.wait_timeout(st, d - now).unwrap_or_else(PoisonError::into_inner).0
                }
                None => self.ex.cv.wait(st).unwrap_or_else(PoisonError::into_inner),
            };
        }
    }
}

fn storage_mismatch(op: &'static str) -> CollectiveError {
    internal(op, "a buffer does not match its descriptor")
}

/// Whether `all_reduce` goes through staged chunks (reduce-scatter, then gather) rather
/// than every member reducing the whole tensor itself.
///
/// Per member, direct costs `n + 1` tensor-sized memory passes, staged about `3 + 1/n`
/// plus one more allocation and synchronisation: staged wins from 3 members on, once the
/// tensor is too big for the peers' inputs to stay in cache.
fn staged_all_reduce(n: usize, dims: &[usize]) -> bool {
    const SMALL: usize = 1 << 14;
    n > 2 && dims.iter().product::<usize>() >= SMALL
}

/// Reduces the flat range `start..start + len` of every tensor into a new storage.
fn reduce_flat_chunk(
    tensors: &[Tensor],
    start: usize,
    len: usize,
    rop: ReduceOp,
    reuse: Option<CpuStorage>,
) -> Result<CpuStorage> {
    let dtype = tensors.first().map_or(DType::F32, |t| t.dtype());
    tpar_tensor::with_any_type!(dtype, |T| {
        reduce_flat_typed::<T>(tensors, start, len, rop, output_vec(reuse, len))
    })
}

fn reduce_flat_typed<T: Reducible>(
    tensors: &[Tensor],
    start: usize,
    len: usize,
    rop: ReduceOp,
    mut out: Vec<T>,
) -> Result<CpuStorage> {
    let out = with_slices::<T, _>(tensors, |srcs| {
        let runs: Option<Vec<&[T]>> = srcs.iter().map(|s| s.get(start..start + len)).collect();
        let runs = runs?;
        reduce_runs(&runs, rop, &mut Vec::new(), &mut out);
        Some(out)
    })?;
    out.map(T::wrap).ok_or_else(|| storage_mismatch("all_reduce"))
}

/// An empty output buffer for `numel` elements: `reuse`'s memory when it holds `T`
/// (a caller's buffer of a `*_into` call, whose pages are already mapped), else a
/// buffer kept by the host cache (`tpar_tensor::memory::cache`), else new.
fn output_vec<T: Element>(reuse: Option<CpuStorage>, numel: usize) -> Vec<T> {
    match reuse.map(T::unwrap) {
        Some(Ok(mut v)) => {
            v.clear();
            v.reserve(numel);
            v
        }
        _ => tpar_tensor::memory::cache::take(numel).unwrap_or_else(|| Vec::with_capacity(numel)),
    }
}

/// Concatenates staged chunks (all of `dtype`) into one storage of `numel` elements.
fn concat_storages(
    chunks: &[Arc<CpuStorage>],
    numel: usize,
    dtype: DType,
    reuse: Option<CpuStorage>,
) -> Result<CpuStorage> {
    tpar_tensor::with_any_type!(dtype, |T| {
        let mut out: Vec<T> = output_vec(reuse, numel);
        for c in chunks {
            let s = <T as Element>::slice(c).ok_or_else(|| storage_mismatch("all_reduce"))?;
            out.extend_from_slice(s);
        }
        Ok(<T as Element>::wrap(out))
    })
}

/// A copy of the whole tensor.
fn copy_whole(t: &Tensor) -> Result<Tensor> {
    let s = tpar_tensor::with_any_type!(t.dtype(), |T| {
        <T as Element>::wrap(t.with_data::<T, _>(|s| s.to_vec())?)
    });
    Ok(Tensor::from_storage(s, t.dims().to_vec())?)
}

/// `all_gather` along `dim`: every member's tensor, concatenated in member order.
fn all_gather(
    tensors: &[Tensor],
    descs: &[Desc],
    dim: usize,
    reuse: Option<CpuStorage>,
) -> Result<Tensor> {
    let d0 = &descs[0].dims;
    let outer: usize = d0[..dim].iter().product();
    let inner: usize = d0[dim + 1..].iter().product();
    let views: Vec<Narrow> = descs.iter().map(|d| Narrow::whole(&d.dims, dim)).collect();
    let total_dim: usize = descs.iter().map(|d| d.dims[dim]).sum();
    let mut dims = d0.clone();
    dims[dim] = total_dim;
    let numel = outer * total_dim * inner;
    let dtype = descs[0].dtype;
    let s = tpar_tensor::with_any_type!(dtype, |T| {
        let stream = numel * std::mem::size_of::<T>() >= STREAM_MIN_BYTES;
        let out = with_slices::<T, _>(tensors, |srcs| {
            let mut out: Vec<T> = output_vec(reuse, numel);
            let mut ok = true;
            for a in 0..outer {
                for (v, s) in views.iter().zip(srcs) {
                    let row = v.n * inner;
                    ok &= v.append(s, a * row, (a + 1) * row, &mut out, stream);
                }
            }
            if stream {
                store_fence();
            }
            ok.then_some(out)
        })?;
        <T as Element>::wrap(out.ok_or_else(|| storage_mismatch("all_gather"))?)
    });
    Ok(Tensor::from_storage(s, dims)?)
}

/// `reduce_scatter` along `dim`: member `me` reduces chunk `me` (torch.chunk rule).
fn reduce_scatter(
    tensors: &[Tensor],
    dims: &[usize],
    dim: usize,
    rop: ReduceOp,
    me: usize,
    n: usize,
    reuse: Option<CpuStorage>,
) -> Result<Tensor> {
    let dtype = tensors.first().map_or(DType::F32, |t| t.dtype());
    let (start, len) = match dims.get(dim) {
        Some(&size) => chunk_range(size, n, me),
        None => (0, 1), // a 0-d all_reduce on one member
    };
    let view = if dims.is_empty() {
        Narrow { n: 1, inner: 1, start: 0, len: 1 }
    } else {
        Narrow::of(dims, dim, start, len)
    };
    let mut out_dims = dims.to_vec();
    if let Some(d) = out_dims.get_mut(dim) {
        *d = len;
    }
    let numel: usize = out_dims.iter().product();
    let s = tpar_tensor::with_any_type!(dtype, |T| {
        let out = with_slices::<T, _>(tensors, |srcs| {
            let mut out: Vec<T> = output_vec(reuse, numel);
            let mut acc = Vec::new();
            let mut iters: Vec<_> = srcs.iter().map(|s| view.runs(s)).collect();
            let mut runs: Vec<&[T]> = Vec::with_capacity(srcs.len());
            loop {
                runs.clear();
                for it in iters.iter_mut() {
                    match it.next() {
                        Some(Some(r)) => runs.push(r),
                        Some(None) => return None,
                        None => {}
                    }
                }
                if runs.is_empty() {
                    break;
                }
                if runs.len() != srcs.len() {
                    return None;
                }
                reduce_runs(&runs, rop, &mut acc, &mut out);
            }
            (out.len() == numel).then_some(out)
        })?;
        <T as Element>::wrap(out.ok_or_else(|| storage_mismatch("reduce_scatter"))?)
    });
    Ok(Tensor::from_storage(s, out_dims)?)
}

/// For each source member: the dims of the piece it sends to `me`, and the view of it.
fn a2a_pieces(
    descs: &[Desc],
    split_dim: usize,
    me: usize,
    n: usize,
) -> Result<Vec<(Vec<usize>, Narrow)>> {
    descs
        .iter()
        .map(|d| {
            let size = d.dims[split_dim];
            let (start, len) = match &d.call {
                Call::AllToAll { sizes: Some(s), .. } => {
                    let start: usize = s[..me].iter().sum();
                    (start, s[me])
                }
                _ => chunk_range(size, n, me),
            };
            let mut pd = d.dims.clone();
            pd[split_dim] = len;
            Ok((pd, Narrow::of(&d.dims, split_dim, start, len)))
        })
        .collect()
}

/// `all_to_all`: piece `me` of every member's tensor, concatenated along `concat_dim`.
fn all_to_all(
    tensors: &[Tensor],
    descs: &[Desc],
    split_dim: usize,
    concat_dim: usize,
    me: usize,
    n: usize,
) -> Result<Tensor> {
    let pieces = a2a_pieces(descs, split_dim, me, n)?;
    let p0 = &pieces[0].0;
    let outer: usize = p0[..concat_dim].iter().product();
    let inner: usize = p0[concat_dim + 1..].iter().product();
    let mut dims = p0.clone();
    dims[concat_dim] = pieces.iter().map(|p| p.0[concat_dim]).sum();
    let numel: usize = dims.iter().product();
    let dtype = descs[0].dtype;
    let s = tpar_tensor::with_any_type!(dtype, |T| {
        let out = with_slices::<T, _>(tensors, |srcs| {
            let mut out: Vec<T> = Vec::with_capacity(numel);
            let mut ok = true;
            for a in 0..outer {
                for ((pd, v), s) in pieces.iter().zip(srcs) {
                    let row = pd[concat_dim] * inner;
                    ok &= v.append(s, a * row, (a + 1) * row, &mut out, false);
                }
            }
            (ok && out.len() == numel).then_some(out)
        })?;
        <T as Element>::wrap(out.ok_or_else(|| storage_mismatch("all_to_all"))?)
    });
    Ok(Tensor::from_storage(s, dims)?)
}
