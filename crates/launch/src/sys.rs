//! The operating system's side of stopping ranks: process groups, signals to them, and
//! signal names. On Unix each rank leads its own process group, so a signal to the
//! group also reaches what the rank started; on Linux each rank also dies with the
//! launcher (a parent-death signal); elsewhere killing the child is all there is.

#[cfg(unix)]
pub(crate) use unix::*;

#[cfg(not(unix))]
pub(crate) use other::*;

#[cfg(unix)]
mod unix {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Child, Command, ExitStatus};

    pub(crate) const SIGKILL: i32 = libc::SIGKILL;
    pub(crate) const SIGTERM: i32 = libc::SIGTERM;

    /// Makes the child lead a new process group (its pid is the group id).
    pub(crate) fn own_process_group(cmd: &mut Command) {
        cmd.process_group(0);
    }

    /// Makes the child die with the launcher (as torchrun's children die with their
    /// agent): on Linux the kernel sends it `SIGKILL` when the thread that started it
    /// exits, so a `kill -9` of the launcher leaves no rank running. A child whose
    /// launcher died before the request took effect exits before its program starts.
    /// Elsewhere this does nothing (the launcher's signal handlers still stop the ranks).
    pub(crate) fn die_with_launcher(cmd: &mut Command) {
        #[cfg(target_os = "linux")]
        {
            let launcher = std::process::id();
            // SAFETY: the closure runs in the child between fork and exec, where only
            // async-signal-safe calls are allowed: prctl(2) and getppid(2) are system
            // calls that allocate nothing and take no locks; the error is built from a
            // plain errno value, without allocating.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The launcher died between fork and prctl: the signal will not come.
                    if u32::try_from(libc::getppid()).ok() != Some(launcher) {
                        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                    }
                    Ok(())
                });
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = cmd;
    }

    /// The signal that killed the process, if one did.
    pub(crate) fn signal_of(status: ExitStatus) -> Option<i32> {
        status.signal()
    }

    /// The signal's name (`SIGKILL`), when it has a standard one.
    pub(crate) fn signal_name(sig: i32) -> Option<&'static str> {
        signal_hook::low_level::signal_name(sig)
    }

    /// Signals the process group the child leads (see [`own_process_group`]); falls back
    /// to killing the child alone when that fails and the signal is `SIGKILL`.
    pub(crate) fn signal_group(child: &mut Child, sig: i32) {
        let Ok(pgid) = libc::pid_t::try_from(child.id()) else { return };
        // SAFETY: killpg(3) takes two integers and reads or writes no memory of ours. It
        // reaches the group the child leads, whose id cannot be recycled while any of its
        // members (or the unreaped child) exists.
        let rc = unsafe { libc::killpg(pgid, sig) };
        if rc != 0 && sig == SIGKILL {
            let _ = child.kill();
        }
    }
}

#[cfg(not(unix))]
mod other {
    use std::process::{Child, Command, ExitStatus};

    pub(crate) const SIGKILL: i32 = 9;
    pub(crate) const SIGTERM: i32 = 15;

    pub(crate) fn own_process_group(_cmd: &mut Command) {}

    pub(crate) fn die_with_launcher(_cmd: &mut Command) {}

    pub(crate) fn signal_of(_status: ExitStatus) -> Option<i32> {
        None
    }

    pub(crate) fn signal_name(_sig: i32) -> Option<&'static str> {
        None
    }

    /// No process groups or signals here: killing is all there is.
    pub(crate) fn signal_group(child: &mut Child, _sig: i32) {
        let _ = child.kill();
    }
}
