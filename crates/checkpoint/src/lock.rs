//! One run at a time per checkpoint directory: `DIR/.lock`, held with an exclusive
//! `flock` for as long as a [`crate::CheckpointManager`] lives, and recording its owner.
//!
//! The operating system drops the lock when the owning process exits, however it exits
//! (a crash, `kill -9`, a lost node's lease), so a stale lock never needs clearing by
//! hand: the next run takes it over. The file's text (host, pid, job id, since when)
//! only names the owner in the error a second run gets.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::{CheckpointError, Result};

/// The lock file's name inside a checkpoint directory.
pub const LOCK: &str = ".lock";

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
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "unknown host".into());
        let job = ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty() && v != "none"));
        let since = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Owner { host, pid: std::process::id(), job, since }
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
    _file: File,
}

impl DirLock {
    /// Takes `dir`'s lock, or says who holds it.
    ///
    /// # Errors
    /// [`CheckpointError::Locked`] naming the owner when another run (another process,
    /// or another manager in this one) holds it; [`CheckpointError::Io`] when the lock
    /// file cannot be opened or written.
    pub(crate) fn acquire(dir: &Path) -> Result<DirLock> {
        let path: PathBuf = dir.join(LOCK);
        let io = |e: std::io::Error| CheckpointError::io(&path, e);
        // Never truncated before the lock is held: a holder's text stays readable.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let owner = serde_json::from_str::<Owner>(&text)
                    .map(|o| o.describe())
                    .unwrap_or_else(|_| "an owner that has not recorded itself yet".into());
                return Err(CheckpointError::Locked {
                    dir: dir.display().to_string(),
                    owner,
                    lock: path.display().to_string(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        let text = serde_json::to_string(&Owner::me()).map_err(|e| CheckpointError::Format {
            path: path.display().to_string(),
            what: e.to_string(),
        })?;
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(text.as_bytes()).map_err(io)?;
        file.write_all(b"\n").map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(DirLock { _file: file })
    }
}
