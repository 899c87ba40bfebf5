//! The collectives layer's error type.

use std::fmt;
use std::time::Duration;

use tpar_tensor::TensorError;

/// Everything a collective, a process group or [`spawn`](crate::spawn) can fail with.
///
/// Variants name the op, the group (as global ranks) and the rank(s) at fault, so a
/// message read on any rank points at the culprit.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    /// Some members never arrived (or never finished) within the group's timeout.
    #[error(
        "{op} on group {group:?}: timed out after {after:?} waiting for rank(s) \
         {waiting_for:?}{}",
        chain_text(.chain)
    )]
    Timeout {
        /// The collective (`"all_reduce"`, `"recv"`, ...).
        op: &'static str,
        /// The group's members, as global ranks.
        group: Vec<usize>,
        /// Global ranks that had not arrived (or finished) when time ran out; on the
        /// `local` backend, those running outside any collective come first.
        waiting_for: Vec<usize>,
        /// The timeout that expired.
        after: Duration,
        /// When the first rank waited for was itself waiting in another collective (ranks
        /// as threads, the `local` backend): that wait, then the one it waited on, and so
        /// on; the last link's first rank held them all up (see [`culprit`](Self::culprit)).
        /// Empty otherwise.
        chain: Vec<WaitLink>,
    },
    /// A peer failed (its rank function returned an error or panicked, or it left
    /// without joining a collective the others are waiting in).
    #[error("{op} on group {group:?}: rank {rank} failed: {why}")]
    PeerFailed {
        /// The collective that was interrupted.
        op: &'static str,
        /// The group's members, as global ranks.
        group: Vec<usize>,
        /// The global rank that failed.
        rank: usize,
        /// What happened to it.
        why: String,
    },
    /// Members called different collectives, or passed different dtypes or shapes.
    #[error("{op} on group {group:?}: rank {rank} passed {got}, but the others passed {expected}")]
    Mismatch {
        /// The collective this rank called.
        op: &'static str,
        /// The group's members, as global ranks.
        group: Vec<usize>,
        /// The (first) global rank whose call disagrees with the majority.
        rank: usize,
        /// What most members passed (collective, dtype, shape).
        expected: String,
        /// What the offending rank passed.
        got: String,
    },
    /// An argument no member could use (bad dim, bad rank list, ...).
    #[error("{op}: {why}")]
    InvalidArgument {
        /// The op.
        op: &'static str,
        /// What is wrong, with the numbers.
        why: String,
    },
    /// A backend or device that is not available in this build or on this machine.
    #[error("{what} is unavailable: {why}")]
    Unavailable {
        /// The feature (`"NCCL backend"`, `"CUDA tensors"`, ...).
        what: String,
        /// Why it is not available.
        why: String,
    },
    /// A rank function panicked (reported by [`spawn`](crate::spawn)).
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The global rank.
        rank: usize,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// A rank failed while others were still running outside any collective, and they had
    /// not finished `waited` after the failure (reported by
    /// [`spawn_owned`](crate::spawn_owned), which leaves their threads running, detached).
    #[error(
        "rank {rank} failed: {why}; rank(s) {running:?} still running {waited:?} after it \
         (stuck outside any collective; their threads were left running)"
    )]
    Stuck {
        /// The global rank that failed first.
        rank: usize,
        /// Its error.
        why: String,
        /// The global ranks that had not finished.
        running: Vec<usize>,
        /// How long `spawn_owned` waited for them after the first failure.
        waited: Duration,
    },
    /// A communication backend call failed: an NCCL or CUDA driver error, or the
    /// job's [`Store`](crate::Store) while setting a group up. Keeps the backend's code and text.
    #[error("{backend} {op} on group {group:?}, rank {rank}: {message}")]
    Backend {
        /// The backend (`"nccl"`).
        backend: &'static str,
        /// The collective or setup step (`"all_reduce"`, `"init"`, `"new_group"`, ...).
        op: &'static str,
        /// The group's members, as global ranks.
        group: Vec<usize>,
        /// The global rank that saw the failure.
        rank: usize,
        /// The backend's error code and text (`"ncclUnhandledCudaError (code 1): ..."`).
        message: String,
    },
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

impl CollectiveError {
    /// The global rank this error blames, when it names one (the peer that failed, the
    /// first rank that did not arrive, the rank that passed a mismatching argument).
    pub fn culprit(&self) -> Option<usize> {
        match self {
            CollectiveError::Timeout { waiting_for, chain, .. } => {
                chain.last().map_or(waiting_for, |l| &l.waiting_for).first().copied()
            }
            CollectiveError::PeerFailed { rank, .. }
            | CollectiveError::Mismatch { rank, .. }
            | CollectiveError::Panicked { rank, .. }
            | CollectiveError::Stuck { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}

/// One rank blocked in a collective, waiting for others: a link of the chain of waits a
/// [`CollectiveError::Timeout`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitLink {
    /// The waiting global rank.
    pub rank: usize,
    /// The collective it waited in.
    pub op: &'static str,
    /// That collective's group, as global ranks.
    pub group: Vec<usize>,
    /// The global ranks it waited for (those running outside any collective first).
    pub waiting_for: Vec<usize>,
}

impl fmt::Display for WaitLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} was itself waiting in {} on group {:?} for rank(s) {:?}",
            self.rank, self.op, self.group, self.waiting_for
        )
    }
}

/// The tail of a `Timeout` message: each link of the chain, then the rank that held it up.
fn chain_text(chain: &[WaitLink]) -> String {
    let Some(last) = chain.last() else { return String::new() };
    let mut s = String::new();
    for link in chain {
        s.push_str(&format!("; {link}"));
    }
    match last.waiting_for.first() {
        Some(r) if chain.iter().any(|l| l.rank == *r) => {
            s.push_str(" (a cycle: these ranks wait for each other in different collectives)")
        }
        Some(r) => s.push_str(&format!(" (rank {r} held them up, outside any collective)")),
        None => {}
    }
    s
}

impl From<CollectiveError> for TensorError {
    /// Lets backward functions use `?` on collectives; the error travels through autograd
    /// unchanged (a tensor error stays one) and can be recovered with
    /// [`CollectiveError::from_tensor_error`].
    fn from(e: CollectiveError) -> Self {
        match e {
            CollectiveError::Tensor(t) => t,
            other => TensorError::External(std::sync::Arc::new(other)),
        }
    }
}

impl CollectiveError {
    /// Recovers a collective error carried through autograd as [`TensorError::External`];
    /// any other tensor error becomes [`CollectiveError::Tensor`].
    pub fn from_tensor_error(e: TensorError) -> CollectiveError {
        if let TensorError::External(inner) = &e {
            if let Some(c) = inner.downcast_ref::<CollectiveError>() {
                return c.clone();
            }
        }
        CollectiveError::Tensor(e)
    }
}
