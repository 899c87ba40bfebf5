//! What a plan does at run time: every redistribution a style's hook performs, with
//! the collectives it issues forward and (as the adjoint) backward, and their bytes.

use std::cell::RefCell;
use std::fmt;

use tpar_placements::Step;

/// One redistribution performed by a style's hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookEvent {
    /// The module's FQN.
    pub fqn: String,
    /// The style.
    pub style: String,
    /// `input 0`, `input mask`, `output`.
    pub what: String,
    /// Placements before (`S(1)`).
    pub from: String,
    /// Placements after.
    pub to: String,
    /// Global shape.
    pub shape: Vec<usize>,
    /// The forward steps (one line each, with bytes).
    pub forward: Vec<String>,
    /// Bytes moved forward.
    pub forward_bytes: u64,
    /// Bytes moved by the adjoint in backward.
    pub backward_bytes: u64,
    /// The forward steps.
    pub forward_steps: Vec<Step>,
    /// The adjoint's steps, run in backward.
    pub backward_steps: Vec<Step>,
}

impl fmt::Display for HookEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<40} {:<18} {:<9} {:>5} -> {:<5} {:?}: fwd {}, bwd {}",
            self.fqn,
            self.style,
            self.what,
            self.from,
            self.to,
            self.shape,
            tpar_placements::fmt_bytes(self.forward_bytes),
            tpar_placements::fmt_bytes(self.backward_bytes)
        )?;
        for s in &self.forward {
            write!(f, "\n    {s}")?;
        }
        Ok(())
    }
}

thread_local! {
    static TRACE: RefCell<Option<Vec<HookEvent>>> = const { RefCell::new(None) };
}

/// Runs `f` recording every hook redistribution on this thread (rank).
pub fn capture<R>(f: impl FnOnce() -> R) -> (R, Vec<HookEvent>) {
    let prev = TRACE.with(|t| t.borrow_mut().replace(Vec::new()));
    let out = f();
    let events = TRACE.with(|t| std::mem::replace(&mut *t.borrow_mut(), prev)).unwrap_or_default();
    (out, events)
}

pub(crate) fn enabled() -> bool {
    TRACE.with(|t| t.borrow().is_some())
}

pub(crate) fn record(e: HookEvent) {
    TRACE.with(|t| {
        if let Some(v) = t.borrow_mut().as_mut() {
            v.push(e);
        }
    });
}
