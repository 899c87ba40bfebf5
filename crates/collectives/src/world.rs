//! `World` (the ranks of one process, as threads) and `RankCtx` (one rank's view of it).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::local::{LocalComm, WorldShared};
use crate::{CollectiveError, CommDebug, ProcessGroup, Result};

/// The default time a collective waits for its peers.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The shared state of `size` ranks running as threads of this process (the `local`
/// backend). Cheap to clone.
///
/// [`spawn`](crate::spawn) builds one and runs a thread per rank; to drive your own
/// threads, hand each one [`World::rank`]'s context. A world is *failed* once any rank
/// reports a failure ([`World::fail`]): every collective blocked on it then returns
/// [`CollectiveError::PeerFailed`] naming that rank.
#[derive(Clone)]
pub struct World {
    shared: Arc<WorldShared>,
}

impl fmt::Debug for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("World")
            .field("size", &self.size())
            .field("timeout", &self.timeout())
            .field("failure", &self.failure())
            .finish()
    }
}

impl World {
    /// A world of `size` ranks with the [`DEFAULT_TIMEOUT`].
    pub fn new(size: usize) -> Result<World> {
        World::with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// A world of `size` ranks whose groups wait `timeout` for peers by default.
    pub fn with_timeout(size: usize, timeout: Duration) -> Result<World> {
        if size == 0 {
            return Err(CollectiveError::InvalidArgument {
                op: "World::new",
                why: "a world needs at least one rank".into(),
            });
        }
        Ok(World { shared: Arc::new(WorldShared::new(size, timeout)) })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// The default timeout of the world's groups.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Rank `rank`'s context (to run on the thread that plays that rank).
    pub fn rank(&self, rank: usize) -> Result<RankCtx> {
        if rank >= self.size() {
            return Err(CollectiveError::InvalidArgument {
                op: "World::rank",
                why: format!("rank {rank} out of range for a world of {} ranks", self.size()),
            });
        }
        Ok(RankCtx { world: self.clone(), rank })
    }

    /// Rank `rank`'s communication recorder.
    pub fn comm_debug(&self, rank: usize) -> Option<CommDebug> {
        self.shared.debug.get(rank).cloned()
    }

    /// Enables the recorders of every rank.
    pub fn enable_comm_debug(&self) {
        self.shared.debug.iter().for_each(CommDebug::enable);
    }

    /// Marks the world failed by `rank` for `why`, waking every blocked collective.
    /// Only the first failure is kept; returns whether this one was first.
    pub fn fail(&self, rank: usize, why: impl Into<String>) -> bool {
        self.shared.fail(rank, why.into())
    }

    /// Marks the world failed on the report of `rank`, whose rank function failed for
    /// `why`, blaming the rank that held `rank` up when `rank`'s last wait failed (it timed
    /// out waiting for a peer, or a peer left without joining), else `rank` itself.
    pub(crate) fn fail_reported(&self, rank: usize, why: impl Into<String>) -> bool {
        self.shared.fail_reported(rank, why.into())
    }

    /// The rank whose report marked the world failed (the one [`World::failure`] names, or
    /// a rank that was waiting for it).
    pub(crate) fn reporter(&self) -> Option<usize> {
        self.shared.reporter()
    }

    /// The first failure: the rank to blame and why. A rank that failed because a peer
    /// held it up (it timed out waiting for the peer, directly or through ranks that were
    /// themselves waiting) names that peer.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.shared.failure()
    }

    /// Whether some rank failed.
    pub fn is_failed(&self) -> bool {
        self.shared.is_failed()
    }

    /// Records that `rank`'s thread is done: peers waiting for it in a collective it never
    /// joined fail at once with [`CollectiveError::PeerFailed`] instead of timing out.
    /// (Async calls it still has in flight are waited for.)
    pub fn mark_exited(&self, rank: usize) {
        self.shared.mark_exited(rank);
    }
}

/// Builds a local group: validates and sorts `ranks`, finds the shared exchange.
pub(crate) fn local_group(
    shared: &Arc<WorldShared>,
    me: usize,
    ranks: &[usize],
    timeout: Option<Duration>,
) -> Result<ProcessGroup> {
    let sorted = sorted_members(shared.size, me, ranks)?;
    let index = sorted.binary_search(&me).unwrap_or(0);
    Ok(build_group(shared, me, sorted, index, timeout))
}

/// `ranks` sorted, after checking that they are distinct ranks of a world of `size` and
/// include `me` (the rules of `new_group` on every backend).
pub(crate) fn sorted_members(size: usize, me: usize, ranks: &[usize]) -> Result<Vec<usize>> {
    let op = "new_group";
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    let invalid = |why: String| CollectiveError::InvalidArgument { op, why };
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(invalid(format!("ranks {ranks:?} contain duplicates")));
    }
    if let Some(&bad) = sorted.iter().find(|&&r| r >= size) {
        return Err(invalid(format!(
            "rank {bad} out of range for a world of {size} ranks (in {ranks:?})"
        )));
    }
    if sorted.binary_search(&me).is_err() {
        return Err(invalid(format!(
            "rank {me} is not in {ranks:?}: a rank can only create groups it belongs to"
        )));
    }
    Ok(sorted)
}

/// A local group from a sorted, valid member list that holds `me` at `index`.
fn build_group(
    shared: &Arc<WorldShared>,
    me: usize,
    sorted: Vec<usize>,
    index: usize,
    timeout: Option<Duration>,
) -> ProcessGroup {
    let ex = shared.exchange(&sorted);
    let comm = LocalComm::new(shared.clone(), ex, index);
    let debug = shared.debug.get(me).cloned().unwrap_or_default();
    ProcessGroup::local(
        comm,
        sorted.into(),
        index,
        me,
        shared.size,
        timeout.unwrap_or(shared.timeout),
        debug,
    )
}

/// One rank's view of a [`World`]: what a rank function gets from [`spawn`](crate::spawn).
#[derive(Clone)]
pub struct RankCtx {
    world: World,
    rank: usize,
}

impl fmt::Debug for RankCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RankCtx").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl RankCtx {
    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.world.size()
    }

    /// The world.
    pub fn world(&self) -> &World {
        &self.world
    }

    /// The group of all ranks.
    pub fn world_group(&self) -> ProcessGroup {
        let all: Vec<usize> = (0..self.world.size()).collect();
        build_group(&self.world.shared, self.rank, all, self.rank, None)
    }

    /// A group of the given global ranks (any order, no duplicates), which must include
    /// this rank. Every member creates it; handles on the same rank list share one
    /// communicator, and groups with different lists never cross-talk.
    pub fn new_group(&self, ranks: &[usize]) -> Result<ProcessGroup> {
        local_group(&self.world.shared, self.rank, ranks, None)
    }

    /// This rank's communication recorder.
    pub fn comm_debug(&self) -> CommDebug {
        self.world.shared.debug.get(self.rank).cloned().unwrap_or_default()
    }
}
