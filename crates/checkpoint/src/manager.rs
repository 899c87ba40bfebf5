//! Checkpoints every N steps of a training run, resume from the latest, keep the last K.

use std::fs;
use std::path::{Path, PathBuf};

use tpar_collectives::{ProcessGroup, ReduceOp};
use tpar_tensor::state::{split_prefix, with_prefix, StateDict, Stateful};
use tpar_tensor::Tensor;

use crate::dcp::{async_save, load, AsyncSave, LoadOptions, SaveOptions};
use crate::exchange::all_gather_bytes;
use crate::format::METADATA;
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
pub struct CheckpointManager {
    dir: PathBuf,
    group: ProcessGroup,
    config: CheckpointConfig,
    pending: Option<(u64, AsyncSave)>,
    /// Rank 0's background deletion of checkpoints beyond `keep`.
    deleter: Option<std::thread::JoinHandle<()>>,
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
    /// A manager of the checkpoints in `dir` (created when missing).
    ///
    /// # Errors
    /// [`CheckpointError::Io`] when `dir` cannot be created.
    pub fn new(
        dir: impl Into<PathBuf>,
        group: &ProcessGroup,
        config: CheckpointConfig,
    ) -> Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| CheckpointError::io(&dir, e))?;
        Ok(CheckpointManager { dir, group: group.clone(), config, pending: None, deleter: None })
    }

    /// The directory of the checkpoint of `step`.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step:08}"))
    }

    /// The steps of the committed checkpoints, oldest first (local: reads the directory).
    pub fn steps(&self) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        let entries = fs::read_dir(&self.dir).map_err(|e| CheckpointError::io(&self.dir, e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(step) = step_of(&name) {
                if e.path().join(METADATA).is_file() {
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
        let all = all_gather_bytes(&self.group, &mine)?;
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
        let mut state = StateDict::new();
        for (name, item) in items.iter() {
            state.extend(with_prefix(name, item.state_dict()?));
        }
        let dir = self.step_dir(step);
        let mut opts = self.config.save_options.clone();
        if !self.config.async_save {
            // The training thread waits for this writer: no lower priority.
            opts.writer_nice = 0;
        }
        let handle = async_save(&state, &dir, &self.group, &opts)?;
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
            fs::rename(&d, &hidden).map_err(|e| CheckpointError::io(&d, e))?;
            retired.push(hidden);
        }
        if retired.is_empty() {
            return Ok(());
        }
        self.join_deleter();
        self.deleter = Some(std::thread::spawn(move || {
            for d in retired {
                // A directory left behind (a failed delete) is hidden and never loaded;
                // the next prune of the same step name does not touch it.
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
    /// and hands each its part ([`Stateful::load_state_dict`]).
    ///
    /// # Errors
    /// As [`crate::load`], and each item's own load errors.
    pub fn load(&mut self, step: u64, items: &mut [(&str, &mut dyn Stateful)]) -> Result<()> {
        let dir = self.step_dir(step);
        load_items(&dir, &self.group, items)
    }

    /// Loads the newest committed checkpoint into `items`; returns its step, or `None`
    /// (loading nothing) when there is none.
    ///
    /// # Errors
    /// As [`CheckpointManager::load`].
    pub fn load_latest(&mut self, items: &mut [(&str, &mut dyn Stateful)]) -> Result<Option<u64>> {
        let Some(step) = self.latest()? else { return Ok(None) };
        self.load(step, items)?;
        Ok(Some(step))
    }
}

/// Loads the checkpoint at `dir` into named items (their state dicts as the targets).
pub(crate) fn load_items(
    dir: &Path,
    group: &ProcessGroup,
    items: &mut [(&str, &mut dyn Stateful)],
) -> Result<()> {
    let mut state = StateDict::new();
    for (name, item) in items.iter() {
        state.extend(with_prefix(name, item.state_dict()?));
    }
    load(&mut state, dir, group, &LoadOptions::default())?;
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
