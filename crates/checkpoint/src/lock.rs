//! One run at a time per checkpoint directory: `DIR/.lock`, held with an exclusive
//! `flock` for as long as a [`crate::CheckpointManager`] lives, and recording its owner.
//!
//! The operating system drops the lock when the owning process exits, however it exits
//! (a crash, `kill -9`, a lost node's lease), so a stale lock never needs clearing by
//! hand: the next run takes it over. The file's text (host, pid, job id, since when)
//! only names the owner in the error a second run gets.
//!
//! A `flock` belongs to the open file, and a child process shares its parent's open
//! files from its fork until its exec closes them. So while this process starts a
//! process (on any thread), a lock it has just released can still be held for a moment
//! by the child's copy. This process's held directories are therefore kept in a
//! registry: a second manager of one of them in this process is refused at once, and a
//! lock whose recorded owner is this process but which no manager of it holds is waited
//! for ([`INHERITED_WAIT`]) instead of being reported as another run's.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::{CheckpointError, Result};

/// The lock file's name inside a checkpoint directory.
pub const LOCK: &str = ".lock";

/// How long [`DirLock::acquire`] waits for a lock that this process released but a
/// process it started still shares (from its fork to its exec: microseconds, longer on a
/// loaded machine) before reporting it held.
const INHERITED_WAIT: Duration = Duration::from_secs(5);

/// The checkpoint directories (canonical paths) this process's managers hold.
static HELD: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

/// The registry, also after a thread panicked holding it (a set of paths stays valid).
fn held() -> std::sync::MutexGuard<'static, BTreeSet<PathBuf>> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This machine's name, as a lock file records it.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown host".into())
}

/// Who holds a checkpoint directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Owner {
    host: String,
    pid: u32,
    /// The launcher's job id (`TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`), if any.
    job: Option<String>,
    /// Seconds since the Unix epoch when the lock was taken.
    since: u64,
}

impl Owner {
    fn me() -> Owner {
        let host = host_name();
        let job = ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty() && v != "none"));
        let since = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Owner { host, pid: std::process::id(), job, since }
    }

    /// Whether this process recorded itself as the owner.
    fn is_this_process(&self) -> bool {
        self.pid == std::process::id() && self.host == host_name()
    }

    fn describe(&self) -> String {
        format!(
            "host {}, pid {}, job {}, since {} s after the Unix epoch",
            self.host,
            self.pid,
            self.job.as_deref().unwrap_or("none"),
            self.since
        )
    }
}

/// A held lock of a checkpoint directory; dropping it releases the directory.
#[derive(Debug)]
pub(crate) struct DirLock {
    /// Open for as long as the lock is held: closing it releases the `flock`.
    file: File,
    /// The directory's key in the registry of held directories.
    key: PathBuf,
}

impl DirLock {
    /// Takes `dir`'s lock (`dir` exists), or says who holds it.
    ///
    /// # Errors
    /// [`CheckpointError::Locked`] naming the owner when another run (another process,
    /// or another manager in this one) holds it; [`CheckpointError::Io`] when the lock
    /// file cannot be opened or written.
    pub(crate) fn acquire(dir: &Path) -> Result<DirLock> {
        Self::acquire_within(dir, INHERITED_WAIT)
    }

    /// [`DirLock::acquire`], waiting at most `wait` for a lock this process released
    /// that a process it started still shares.
    fn acquire_within(dir: &Path, wait: Duration) -> Result<DirLock> {
        let path: PathBuf = dir.join(LOCK);
        let io = |e: std::io::Error| CheckpointError::io(&path, e);
        let key = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        // Never truncated before the lock is held: a holder's text stays readable.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(1);
        loop {
            let in_process = {
                let mut held = held();
                let in_process = held.contains(&key);
                if !in_process {
                    match file.try_lock() {
                        Ok(()) => {
                            held.insert(key.clone());
                            break;
                        }
                        Err(TryLockError::WouldBlock) => {}
                        Err(TryLockError::Error(e)) => return Err(io(e)),
                    }
                }
                in_process
            };
            let mut text = String::new();
            let _ = file.seek(SeekFrom::Start(0)).and_then(|_| file.read_to_string(&mut text));
            let owner = serde_json::from_str::<Owner>(&text).ok();
            // Recorded by this process, yet none of its managers holds it: a process it
            // started shares the released lock until its exec.
            let released_here = !in_process && owner.as_ref().is_some_and(Owner::is_this_process);
            if !released_here || Instant::now() >= deadline {
                let owner = match owner {
                    Some(o) if released_here => format!(
                        "{}: this process, whose managers all released it, but a process it \
                         started still holds the lock file open",
                        o.describe()
                    ),
                    Some(o) => o.describe(),
                    None => "an owner that has not recorded itself yet".into(),
                };
                return Err(CheckpointError::Locked {
                    dir: dir.display().to_string(),
                    owner,
                    lock: path.display().to_string(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
        // From here on, dropping `lock` releases the registry entry and the file.
        let mut lock = DirLock { file, key };
        let text = serde_json::to_string(&Owner::me()).map_err(|e| CheckpointError::Format {
            path: path.display().to_string(),
            what: e.to_string(),
        })?;
        let f = &mut lock.file;
        f.set_len(0).map_err(io)?;
        f.seek(SeekFrom::Start(0)).map_err(io)?;
        f.write_all(text.as_bytes()).map_err(io)?;
        f.write_all(b"\n").map_err(io)?;
        f.sync_all().map_err(io)?;
        Ok(lock)
    }
}

impl Drop for DirLock {
    /// Leaves the registry; the file closes right after, releasing the `flock`.
    fn drop(&mut self) {
        held().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tpar-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A process started while the lock was held shares it until its exec: once this
    /// process released it, the next lock waits for that copy to close instead of
    /// reporting another run; past the wait, the error says the holder is a process this
    /// one started. (The copy is made by duplicating the file, as a fork does.)
    #[test]
    fn a_lock_released_here_but_shared_by_a_child_is_waited_for() {
        let d = fresh_dir("shared");
        let first = DirLock::acquire(&d).unwrap();
        let copy = first.file.try_clone().unwrap();
        drop(first);
        let t0 = Instant::now();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(copy);
        });
        let second = DirLock::acquire(&d).expect("taken once the copy closed");
        assert!(t0.elapsed() >= Duration::from_millis(150), "{:?}", t0.elapsed());
        closer.join().unwrap();
        drop(second);

        let first = DirLock::acquire(&d).unwrap();
        let copy = first.file.try_clone().unwrap();
        drop(first);
        let e = DirLock::acquire_within(&d, Duration::from_millis(100)).unwrap_err().to_string();
        let pid = format!("pid {},", std::process::id());
        assert!(e.contains(&pid) && e.contains("a process it started"), "{e}");
        drop(copy);
        drop(DirLock::acquire(&d).unwrap());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A second lock in this process, and another process's lock, are refused at once
    /// (no wait), naming the owner.
    #[test]
    fn a_held_lock_is_refused_at_once() {
        let d = fresh_dir("held");
        let first = DirLock::acquire(&d).unwrap();
        let t0 = Instant::now();
        let e = DirLock::acquire(&d).unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        let pid = format!("pid {},", std::process::id());
        assert!(e.contains(&pid) && !e.contains("a process it started"), "{e}");
        // The same directory by another spelling is the same lock.
        let again = d.join("..").join(d.file_name().unwrap());
        assert!(DirLock::acquire(&again).unwrap_err().to_string().contains(&pid));
        drop(first);
        let _ = std::fs::remove_dir_all(&d);

        // Another process's lock: a file opened outside the registry, naming pid 1 (in a
        // directory no lock of this process opened, so no process the test beside this
        // one starts can share a copy of one).
        let d = fresh_dir("other");
        let mut other = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(d.join(LOCK))
            .unwrap();
        other.try_lock().unwrap();
        let owner = Owner { host: host_name(), pid: 1, job: None, since: 0 };
        other.write_all(serde_json::to_string(&owner).unwrap().as_bytes()).unwrap();
        let t0 = Instant::now();
        let e = DirLock::acquire(&d).unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        assert!(e.contains("pid 1,") && e.contains("in use by another run"), "{e}");
        drop(other);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Locks taken and released in turn while another thread starts processes: every
    /// one is taken (the children's copies of a released lock are waited for).
    #[test]
    fn starting_processes_does_not_keep_a_released_lock() {
        if std::process::Command::new("true").status().is_err() {
            eprintln!("skipped: no `true` program to start");
            return;
        }
        let d = fresh_dir("children");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let starter = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut n = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = std::process::Command::new("true").status();
                    n += 1;
                }
                n
            })
        };
        let taken = (0..300).filter(|_| DirLock::acquire(&d).is_ok()).count();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let started = starter.join().unwrap();
        assert_eq!(taken, 300, "{started} processes started meanwhile");
        let _ = std::fs::remove_dir_all(&d);
    }
}
