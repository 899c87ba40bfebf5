//! Checkpoints every N steps of a training run, resume from the latest, keep the last K.

use std::fs;
use std::path::{Path, PathBuf};

use tpar_collectives::{ProcessGroup, ReduceOp};
use tpar_tensor::state::{split_prefix, with_prefix, StateDict, Stateful};
use tpar_tensor::Tensor;

use crate::dcp::{async_save, load_scoped, AsyncSave, LoadOptions, SaveOptions};
use crate::exchange::agree_on;
use crate::lock::DirLock;
use crate::{CheckpointError, Result};

/// How a [`CheckpointManager`] saves.
#[derive(Clone, Debug, Default)]
pub struct CheckpointConfig {
    /// Keep only the newest `K` checkpoints (older ones are deleted after a new one is
    /// committed); `None` keeps all.
    pub keep: Option<usize>,
    /// Write in the background ([`crate::async_save`]); the next save, [`CheckpointManager::poll`]
    /// or [`CheckpointManager::wait`] commits.
    pub async_save: bool,
    /// Passed to every save.
    pub save_options: SaveOptions,
}

/// A training run's checkpoints in one directory: `DIR/step-00000100` and so on, each a
/// complete checkpoint (a save in progress lives in a hidden temporary directory until
/// it is committed, so a crash leaves only complete ones).
///
/// Every method is collective over the group: all ranks call them at the same points.
/// Items are named [`Stateful`] values (`model`, `optim`, `lr_scheduler`, `sampler`,
/// `trainer`, ...), stored under their name as a key prefix.
///
/// A manager owns its directory for as long as it lives (see [`CheckpointManager::new`]):
/// a second run pointed at the same directory is refused instead of mixing its
/// checkpoints with this run's. A committed checkpoint is never replaced: a save of a step
/// that already has one is an error, and a checkpoint that cannot be read as written (its
/// metadata deleted or changed) is an error naming the file, never "no checkpoint".
pub struct CheckpointManager {
    dir: PathBuf,
    group: ProcessGroup,
    config: CheckpointConfig,
    pending: Option<(u64, AsyncSave)>,
    /// Rank 0's background deletion of checkpoints beyond `keep`.
    deleter: Option<std::thread::JoinHandle<()>>,
    /// Rank 0's hold on the directory.
    _lock: Option<DirLock>,
}

impl std::fmt::Debug for CheckpointManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CheckpointManager({})", self.dir.display())
    }
}

/// The step of a committed checkpoint directory's name (`step-00000100` -> 100).
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

impl CheckpointManager {
    /// A manager of the checkpoints in `dir` (created when missing), which it owns until
    /// it is dropped: group rank 0 takes `dir/.lock` (an exclusive `flock` recording its
    /// host, pid and job id), which the operating system releases when the process
    /// exits however it exits, so a crashed run's lock is taken over by the next run.
    /// Rank 0 then clears what interrupted saves and deletions left behind (hidden
    /// `.step-*.tmp` and `.step-*.deleting` directories). Collective.
    ///
    /// # Errors
    /// [`CheckpointError::Locked`] (on rank 0; [`CheckpointError::RankFailed`] naming it
    /// on the others) when another run holds `dir`, naming its owner;
    /// [`CheckpointError::Io`] when `dir` cannot be created.
    pub fn new(
        dir: impl Into<PathBuf>,
        group: &ProcessGroup,
        config: CheckpointConfig,
    ) -> Result<Self> {
        let dir = dir.into();
        let mut lock = None;
        let mut deleter = None;
        let local =
            fs::create_dir_all(&dir).map_err(|e| CheckpointError::io(&dir, e)).and_then(|()| {
                if group.rank() == 0 {
                    lock = Some(DirLock::acquire(&dir)?);
                    deleter = clear_leftovers(&dir)?;
                }
                Ok(())
            });
        agree_on(group, "open", local)?;
        Ok(CheckpointManager {
            dir,
            group: group.clone(),
            config,
            pending: None,
            deleter,
            _lock: lock,
        })
    }

    /// The directory of the checkpoint of `step`.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step:08}"))
    }

    /// The steps of the committed checkpoints, oldest first (local: reads the directory).
    /// Every `step-N` directory counts, whether or not it is still readable: loading a
    /// damaged one is an error, never a silent fall-back to an older one or to none.
    pub fn steps(&self) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        let entries = fs::read_dir(&self.dir).map_err(|e| CheckpointError::io(&self.dir, e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(step) = step_of(&name) {
                if e.path().is_dir() {
                    out.push(step);
                }
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// The step of the newest committed checkpoint, as group rank 0 sees it (collective).
    pub fn latest(&self) -> Result<Option<u64>> {
        let mine = if self.group.rank() == 0 {
            self.steps()?.last().map(|s| s.to_le_bytes().to_vec()).unwrap_or_default()
        } else {
            Vec::new()
        };
        let all = self.group.all_gather_bytes(&mine)?;
        Ok(all[0].as_slice().try_into().ok().map(u64::from_le_bytes))
    }

    /// Saves `items` as the checkpoint of `step` (waiting for the previous asynchronous
    /// save first). Synchronous saves are committed when this returns; asynchronous ones
    /// when a later call commits them.
    ///
    /// # Errors
    /// As [`crate::save`]; a failed previous asynchronous save is reported here.
    pub fn save(&mut self, step: u64, items: &mut [(&str, &mut dyn Stateful)]) -> Result<()> {
        self.wait()?;
        let dir = self.step_dir(step);
        // A committed checkpoint is never replaced (it may be the only copy of a run).
        let exists = if self.group.rank() == 0 && dir.exists() {
            Err(CheckpointError::Exists { path: dir.display().to_string() })
        } else {
            Ok(())
        };
        agree_on(&self.group, "save", exists)?;
        let mut state = StateDict::new();
        for (name, item) in items.iter() {
            state.extend(with_prefix(name, item.state_dict()?));
        }
        let mut opts = self.config.save_options.clone();
        if !self.config.async_save {
            // The training thread waits for this writer: no lower priority.
            opts.writer_nice = 0;
        }
        let mut handle = async_save(&state, &dir, &self.group, &opts)?;
        handle.set_step(step);
        drop(state);
        self.pending = Some((step, handle));
        if !self.config.async_save {
            self.wait()?;
        }
        Ok(())
    }

    /// Commits the pending asynchronous save if every rank's writer has finished; a no-op
    /// without one. Returns whether a save was committed. Collective (one small
    /// all_reduce) while a save is pending: call it at the same point of every step.
    ///
    /// # Errors
    /// As [`AsyncSave::wait`].
    pub fn poll(&mut self) -> Result<bool> {
        let Some((_, handle)) = &self.pending else { return Ok(false) };
        let mine =
            Tensor::scalar(if handle.is_written() { 1.0 } else { 0.0 }, tpar_tensor::DType::F32);
        let all = self.group.all_reduce(&mine, ReduceOp::Min)?.item()?;
        if all < 1.0 {
            return Ok(false);
        }
        self.wait()?;
        Ok(true)
    }

    /// Waits for and commits the pending asynchronous save, then deletes checkpoints
    /// beyond [`CheckpointConfig::keep`]; a no-op without one.
    ///
    /// # Errors
    /// As [`AsyncSave::wait`].
    pub fn wait(&mut self) -> Result<()> {
        let Some((_, handle)) = self.pending.take() else { return Ok(()) };
        handle.wait()?;
        if self.group.rank() == 0 {
            self.prune()?;
        }
        Ok(())
    }

    /// Rank 0: retires the oldest committed checkpoints beyond `keep`. Each is renamed
    /// to a hidden name at once (so it is no longer a checkpoint) and deleted by a
    /// background thread, so the training thread does not wait for the file system.
    fn prune(&mut self) -> Result<()> {
        let Some(keep) = self.config.keep else { return Ok(()) };
        let steps = self.steps()?;
        let mut retired = Vec::new();
        for step in &steps[..steps.len().saturating_sub(keep.max(1))] {
            let d = self.step_dir(*step);
            let hidden = self.dir.join(format!(".step-{step:08}.deleting"));
            if hidden.exists() {
                // Left by an interrupted deletion: finish it first.
                fs::remove_dir_all(&hidden).map_err(|e| CheckpointError::io(&hidden, e))?;
            }
            fs::rename(&d, &hidden).map_err(|e| CheckpointError::io(&d, e))?;
            retired.push(hidden);
        }
        if retired.is_empty() {
            return Ok(());
        }
        self.join_deleter();
        self.deleter = Some(std::thread::spawn(move || {
            for d in retired {
                // A directory left behind (a failed or interrupted delete) is hidden and
                // never loaded; the next manager on this directory deletes it.
                let _ = fs::remove_dir_all(&d);
            }
        }));
        Ok(())
    }

    fn join_deleter(&mut self) {
        if let Some(d) = self.deleter.take() {
            let _ = d.join();
        }
    }

    /// Loads the checkpoint of `step` into `items` (resharding to their current layout)
    /// and hands each its part ([`Stateful::load_state_dict`]). Strict both ways over the
    /// items named: every key of theirs must be in the checkpoint, and every key the
    /// checkpoint has under their names must be one of theirs.
    ///
    /// # Errors
    /// As [`crate::load`]; [`CheckpointError::Damaged`] for a checkpoint whose metadata is
    /// missing, changed, or records another step than its directory's name; and each
    /// item's own load errors.
    pub fn load(&mut self, step: u64, items: &mut [(&str, &mut dyn Stateful)]) -> Result<()> {
        let dir = self.step_dir(step);
        load_items(&dir, &self.group, items, Some(step))
    }

    /// Loads the newest committed checkpoint into `items`; returns its step, or `None`
    /// (loading nothing) when there is none. A damaged newest checkpoint is an error
    /// naming it (move it aside to resume from an older one), never `None`.
    ///
    /// # Errors
    /// As [`CheckpointManager::load`].
    pub fn load_latest(&mut self, items: &mut [(&str, &mut dyn Stateful)]) -> Result<Option<u64>> {
        let Some(step) = self.latest()? else { return Ok(None) };
        self.load(step, items)?;
        Ok(Some(step))
    }
}

/// Rank 0 of a new manager: removes the hidden directories that interrupted saves
/// (`.step-N.tmp`, `.step-N.old`) and deletions (`.step-N.deleting`) left in `dir`, on a
/// background thread. A `.step-N.old` whose `step-N` is missing (a crash between the two
/// renames of a commit over an existing checkpoint) is renamed back instead.
fn clear_leftovers(dir: &Path) -> Result<Option<std::thread::JoinHandle<()>>> {
    let entries = fs::read_dir(dir).map_err(|e| CheckpointError::io(dir, e))?;
    let mut doomed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix('.') else { continue };
        let Some((base, suffix)) = rest.rsplit_once('.') else { continue };
        if step_of(base).is_none() || !e.path().is_dir() {
            continue;
        }
        match suffix {
            "old" if !dir.join(base).exists() => {
                fs::rename(e.path(), dir.join(base))
                    .map_err(|err| CheckpointError::io(&e.path(), err))?;
            }
            "old" | "tmp" | "deleting" => doomed.push(e.path()),
            _ => {}
        }
    }
    if doomed.is_empty() {
        return Ok(None);
    }
    Ok(Some(std::thread::spawn(move || {
        for d in doomed {
            let _ = fs::remove_dir_all(&d);
        }
    })))
}

/// Loads the checkpoint at `dir` into named items (their state dicts as the targets),
/// strictly over the items' key prefixes; with `step`, the metadata must record it.
pub(crate) fn load_items(
    dir: &Path,
    group: &ProcessGroup,
    items: &mut [(&str, &mut dyn Stateful)],
    step: Option<u64>,
) -> Result<()> {
    let mut state = StateDict::new();
    for (name, item) in items.iter() {
        state.extend(with_prefix(name, item.state_dict()?));
    }
    let scope: Vec<String> = items.iter().map(|(name, _)| format!("{name}.")).collect();
    load_scoped(&mut state, dir, group, &LoadOptions::default(), Some(&scope), step)?;
    for (name, item) in items.iter_mut() {
        let part = split_prefix(name, &mut state);
        item.load_state_dict(part)?;
    }
    Ok(())
}

impl Drop for CheckpointManager {
    fn drop(&mut self) {
        // An uncommitted asynchronous save cannot be committed here (that takes every
        // rank); its writer is joined by the handle and the previous checkpoint stays
        // the latest.
        self.pending.take();
        self.join_deleter();
    }
}
