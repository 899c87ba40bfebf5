//! Signals sent to the launcher: `SIGINT`, `SIGTERM` and `SIGHUP` are received by a
//! `signal-hook` iterator on a thread of their own, which records the last one and counts
//! them; [`run`](crate::run) polls both.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use crate::LaunchError;

/// The last signal received since [`forward_signals`], 0 when none.
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many signals were received since [`forward_signals`].
static SIGNAL_COUNT: AtomicUsize = AtomicUsize::new(0);

/// The last signal the launcher received, if any.
pub(crate) fn received() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// How many signals the launcher has received.
pub(crate) fn count() -> usize {
    SIGNAL_COUNT.load(Ordering::SeqCst)
}

fn record(sig: i32) {
    SIGNAL.store(sig, Ordering::SeqCst);
    SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Makes `SIGINT`, `SIGTERM` and `SIGHUP` sent to this process stop the ranks of a
/// running [`run`](crate::run) (forwarding the signal to each rank's process group, then
/// `SIGKILL` after the grace period; a second signal kills at once) instead of ending the
/// launcher and orphaning them. For launcher binaries: it replaces the process's default
/// handling of those signals for good. Calling it again does nothing; a no-op off Unix.
pub fn forward_signals() -> Result<(), LaunchError> {
    static INSTALLED: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut installed = INSTALLED.lock().unwrap_or_else(|p| p.into_inner());
    if !*installed {
        install()?;
        *installed = true;
    }
    Ok(())
}

#[cfg(unix)]
fn install() -> Result<(), LaunchError> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    use signal_hook::iterator::Signals;

    let err = |source| LaunchError::Signals { source };
    let mut signals = Signals::new([SIGHUP, SIGINT, SIGTERM]).map_err(err)?;
    std::thread::Builder::new()
        .name("tpar-run-signals".into())
        .spawn(move || signals.forever().for_each(record))
        .map_err(err)?;
    Ok(())
}

#[cfg(not(unix))]
fn install() -> Result<(), LaunchError> {
    let _ = record;
    Ok(())
}
