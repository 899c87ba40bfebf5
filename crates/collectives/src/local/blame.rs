//! Who holds a collective up: what each rank's threads are blocked on (a waits-for graph).
//!
//! A rank that times out waiting for a peer that is itself blocked in another collective
//! (a pipeline stage waiting for the stage before it, a mesh row waiting for a column) must
//! not blame that peer: it follows the peer's wait, and the wait that one is in, to the rank
//! that is running outside any collective, the one that held everyone up. Each wait of the
//! `local` backend records here what it waits for while it blocks, and a wait that ended in
//! an error keeps its record (until the rank blocks again or a wait of its succeeds), so a
//! peer that timed out a moment earlier still points past itself.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::WaitLink;

/// The waits-for records of every rank of a world.
pub(crate) struct Waits {
    ranks: Vec<Mutex<RankWaits>>,
}

#[derive(Default)]
struct RankWaits {
    next: u64,
    /// The waits this rank's threads are blocked in (its own and its async calls').
    open: Vec<(u64, WaitLink)>,
    /// The wait that last ended in an error, until the rank blocks again.
    ended: Option<WaitLink>,
}

impl Waits {
    pub fn new(size: usize) -> Waits {
        Waits { ranks: (0..size).map(|_| Mutex::default()).collect() }
    }

    fn lock(&self, rank: usize) -> Option<MutexGuard<'_, RankWaits>> {
        self.ranks.get(rank).map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Records that `link.rank` blocks in `link` (first call: `token` is `None` and gets
    /// one), or updates the ranks it still waits for.
    pub fn block(&self, token: &mut Option<u64>, link: WaitLink) {
        let Some(mut w) = self.lock(link.rank) else { return };
        match *token {
            Some(t) => {
                if let Some((_, l)) = w.open.iter_mut().find(|(id, _)| *id == t) {
                    if l.waiting_for != link.waiting_for {
                        l.waiting_for = link.waiting_for;
                    }
                }
            }
            None => {
                let t = w.next;
                w.next += 1;
                w.ended = None;
                w.open.push((t, link));
                *token = Some(t);
            }
        }
    }

    /// Ends wait `token` of `rank`: a success clears the rank's last failed wait; a failure
    /// (timeout, a peer gone) keeps `failed` as it.
    pub fn unblock(&self, rank: usize, token: Option<u64>, failed: Option<WaitLink>) {
        if token.is_none() && failed.is_none() {
            return;
        }
        let Some(mut w) = self.lock(rank) else { return };
        if let Some(t) = token {
            w.open.retain(|(id, _)| *id != t);
        }
        w.ended = failed;
    }

    /// What `rank` waits for now, or what it waited for when its last wait failed.
    fn link_of(&self, rank: usize) -> Option<WaitLink> {
        let w = self.lock(rank)?;
        w.open.first().map(|(_, l)| l.clone()).or_else(|| w.ended.clone())
    }

    fn is_waiting(&self, rank: usize) -> bool {
        self.lock(rank).is_some_and(|w| !w.open.is_empty() || w.ended.is_some())
    }

    /// Puts the ranks running outside any collective first (stable).
    pub fn running_first(&self, ranks: &mut [usize]) {
        ranks.sort_by_cached_key(|&r| self.is_waiting(r));
    }

    /// The chain of waits behind `missing` (reordered running first): empty when its first
    /// rank runs outside any collective; else that rank's wait, the wait of the first rank
    /// that one waits for, and so on, until a running rank or a rank already in the chain.
    pub fn chain(&self, missing: &mut [usize]) -> Vec<WaitLink> {
        self.running_first(missing);
        let mut chain: Vec<WaitLink> = Vec::new();
        let mut next = missing.first().copied();
        while let Some(r) = next {
            if chain.iter().any(|l| l.rank == r) || chain.len() > self.ranks.len() {
                break;
            }
            let Some(mut link) = self.link_of(r) else { break };
            self.running_first(&mut link.waiting_for);
            next = link.waiting_for.first().copied();
            chain.push(link);
        }
        chain
    }

    /// The rank to blame for `rank`'s failure: `rank` itself, unless its last wait failed
    /// (it timed out, or a peer left): then the rank that held that wait up.
    pub fn culprit(&self, rank: usize) -> usize {
        let Some(ended) = self.lock(rank).and_then(|w| w.ended.clone()) else { return rank };
        let mut missing = ended.waiting_for;
        let chain = self.chain(&mut missing);
        chain.last().map_or(&missing, |l| &l.waiting_for).first().copied().unwrap_or(rank)
    }
}
