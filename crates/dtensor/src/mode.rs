//! Implicit communication made visible: a trace of every redistribution an op inserted
//! on its own, and a strict mode in which any such redistribution is an error.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

/// One redistribution an op performed without being asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImplicitRedistribution {
    /// The op that needed it.
    pub op: &'static str,
    /// Which operand.
    pub operand: String,
    /// Placements before (`S(0)R`).
    pub from: String,
    /// Placements after.
    pub to: String,
    /// The operand's global shape.
    pub shape: Vec<usize>,
}

/// Records kept per thread: the trace holds the latest this many, so a training loop
/// that redistributes on every step holds a bounded trace however long it runs.
pub const IMPLICIT_TRACE_LIMIT: usize = 1024;

thread_local! {
    static STRICT: Cell<bool> = const { Cell::new(false) };
    static TRACE: RefCell<VecDeque<ImplicitRedistribution>> = const { RefCell::new(VecDeque::new()) };
}

/// Runs `f` with strict mode on for this thread (rank): an op that would redistribute an
/// operand on its own returns [`crate::DTensorError::ImplicitRedistribution`] instead.
pub fn strict<R>(f: impl FnOnce() -> R) -> R {
    let prev = STRICT.with(|s| s.replace(true));
    let out = f();
    STRICT.with(|s| s.set(prev));
    out
}

/// Whether strict mode is on for this thread.
pub fn is_strict() -> bool {
    STRICT.with(|s| s.get())
}

/// Records an implicit redistribution on this thread's trace, dropping the oldest record
/// past [`IMPLICIT_TRACE_LIMIT`].
pub(crate) fn record(r: ImplicitRedistribution) {
    TRACE.with(|t| {
        let mut t = t.borrow_mut();
        if t.len() == IMPLICIT_TRACE_LIMIT {
            t.pop_front();
        }
        t.push_back(r);
    });
}

/// This thread's implicit redistributions so far, oldest first (the latest
/// [`IMPLICIT_TRACE_LIMIT`] of them).
pub fn implicit_redistributions() -> Vec<ImplicitRedistribution> {
    TRACE.with(|t| t.borrow().iter().cloned().collect())
}

/// Clears this thread's trace, returning what it held (oldest first).
pub fn take_implicit_redistributions() -> Vec<ImplicitRedistribution> {
    TRACE.with(|t| Vec::from(std::mem::take(&mut *t.borrow_mut())))
}
