//! Stopping on a lost CUDA context: after a kernel traps or faults (the
//! mbarrier watchdog of a deadlocked Hopper kernel, an illegal address),
//! every later call on the device fails with the same sticky error
//! ([`KernelError::ContextLost`]), so the first check or benchmark that gets
//! one ends the checks and the benchmarks; what ran is still reported and
//! written, and the exit status is [`EXIT_CONTEXT_LOST`].

use std::error::Error;

use tpar_kernels::KernelError;

/// The exit status when the CUDA context was lost.
pub(crate) const EXIT_CONTEXT_LOST: i32 = 3;

/// Whether `e`, or an error it wraps, is a lost CUDA context.
pub(crate) fn is_context_lost(e: &(dyn Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<KernelError>().is_some_and(KernelError::is_context_lost) {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Which check or benchmark lost the context, once one has.
#[derive(Debug, Default)]
pub(crate) struct Stop {
    by: Option<String>,
}

impl Stop {
    /// The check or benchmark that lost the context (`None`: it is intact).
    pub(crate) fn lost_by(&self) -> Option<&str> {
        self.by.as_deref()
    }

    /// Whether the checks and benchmarks must stop.
    pub(crate) fn stopped(&self) -> bool {
        self.by.is_some()
    }

    /// Looks at the error `e` of `what` (a check or a benchmark): the first
    /// lost context is recorded, with one line naming `what`. Returns
    /// [`Stop::stopped`].
    pub(crate) fn see(&mut self, what: &str, e: &(dyn Error + 'static)) -> bool {
        if self.by.is_none() && is_context_lost(e) {
            println!(
                "gpu_check: {what} lost the CUDA context; the remaining checks and benchmarks \
                 are skipped (every call would fail): {e}"
            );
            self.by = Some(what.to_string());
        }
        self.stopped()
    }
}

/// The exit status: [`EXIT_CONTEXT_LOST`] once the context was lost (what
/// did not run cannot have passed), else 1 when a check failed (or, with
/// `--sabotage`, passed), else 0.
pub(crate) fn exit_status(stop: &Stop, bad: bool) -> i32 {
    if stop.stopped() {
        EXIT_CONTEXT_LOST
    } else {
        i32::from(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost() -> KernelError {
        KernelError::ContextLost {
            op: "cuda:0".into(),
            what: "cuStreamSynchronize failed (CUDA_ERROR_LAUNCH_FAILED)".into(),
        }
    }

    /// An error that wraps another, as a higher layer's error does.
    #[derive(Debug)]
    struct Wrapped(KernelError);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "tensor op failed")
        }
    }
    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn the_first_lost_context_stops_and_is_named() {
        let mut s = Stop::default();
        let other: Box<dyn Error> =
            Box::new(KernelError::Cuda { op: "cuda:0".into(), what: "out of memory".into() });
        assert!(!s.see("gemm nn bf16", other.as_ref()));
        assert_eq!((s.lost_by(), exit_status(&s, false), exit_status(&s, true)), (None, 0, 1));
        let plain: Box<dyn Error> = "a mismatch".into();
        assert!(!s.see("gemm nt bf16", plain.as_ref()));

        let e: Box<dyn Error> = Box::new(lost());
        assert!(s.see("gemm.hopper bf16 256x256x256", e.as_ref()));
        let later: Box<dyn Error> = Box::new(Wrapped(lost()));
        assert!(s.see("sdpa.hopper bf16", later.as_ref()));
        assert_eq!(s.lost_by(), Some("gemm.hopper bf16 256x256x256"), "the first one is named");
        assert_eq!((exit_status(&s, false), exit_status(&s, true)), (3, 3));
    }

    #[test]
    fn a_wrapped_lost_context_is_seen() {
        assert!(is_context_lost(&Wrapped(lost())));
        assert!(is_context_lost(&lost()));
        assert!(!is_context_lost(&Wrapped(KernelError::Cuda { op: "x".into(), what: "y".into() })));
    }
}
