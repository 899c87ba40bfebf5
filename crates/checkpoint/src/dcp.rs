//! Sharded save and resharding load of one state dict.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use tpar_collectives::ProcessGroup;
use tpar_tensor::state::{Chunk, ShardedTensor, StateDict, StateDictError, StateValue};
use tpar_tensor::{DType, Tensor};

use crate::exchange::{agree, agree_on};
use crate::format::{
    crc32, data_offsets, dtype_of, read_at, st_dtype, tensor_bytes, tensor_from_bytes, ChunkMeta,
    Metadata, RawView, Scalar, TensorMeta, FORMAT, METADATA, VERSION,
};
use crate::{CheckpointError, Result};

/// Options of [`save`] and [`async_save`].
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// The nice value the writer thread of an [`async_save`] takes (Linux; 0 keeps the
    /// caller's), so writing a checkpoint in the background yields the cores to
    /// training. Default 10; [`save`], which waits for the writer, ignores it.
    pub writer_nice: i32,
    /// Makes this global rank's writer fail, to test that a failed save leaves the
    /// previous checkpoint loadable and names the rank everywhere.
    #[doc(hidden)]
    pub inject_write_failure: Option<usize>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions { writer_nice: 10, inject_write_failure: None }
    }
}

/// Lowers the calling thread's scheduling priority by `nice` (Linux, where the nice
/// value is a per-thread attribute; raising niceness needs no privilege). Best effort:
/// a refusal leaves the priority as it was.
fn lower_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    if nice > 0 {
        // SAFETY: setpriority only reads its three integer arguments; `who = 0` names the
        // calling thread, whose own priority is all it changes.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, 0, nice);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// Options of [`load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Both directions are errors (default): a key of the target missing from the
    /// checkpoint, and a key of the checkpoint that no rank's target has (so a model
    /// built smaller than the one saved is refused, not silently cut). With `false` a
    /// missing entry keeps its current value and the checkpoint's other keys are
    /// ignored (loading part of a checkpoint).
    pub strict: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { strict: true }
    }
}

/// One rank's description of what it holds, sent to every rank before writing.
#[derive(Serialize, Deserialize)]
struct LocalPlan {
    tensors: Vec<PlanTensor>,
    values: Vec<(String, Scalar)>,
    /// Rank 0's failure to prepare the temporary directory.
    setup_error: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct PlanTensor {
    key: String,
    dtype: String,
    shape: Vec<usize>,
    /// `(offsets, sizes)` of each chunk this rank holds.
    chunks: Vec<Region>,
}

/// A chunk this rank writes, already copied out of the live state.
struct Pending {
    key: String,
    offsets: Vec<usize>,
    view: RawView,
}

/// A box: `(offsets, sizes)`.
type Region = (Vec<usize>, Vec<usize>);

/// What the metadata records of the chunks one rank wrote: key and chunk.
type Written = Vec<(String, ChunkMeta)>;

fn tensors_of(state: &StateDict) -> Vec<(&String, ShardedTensor)> {
    state
        .iter()
        .filter_map(|(k, v)| match v {
            StateValue::Tensor(t) => Some((k, ShardedTensor::whole(t))),
            StateValue::Sharded(s) => Some((k, s.clone())),
            _ => None,
        })
        .collect()
}

pub(crate) fn scalar_of(v: &StateValue) -> Option<Scalar> {
    match v {
        StateValue::Int(i) => Some(Scalar::Int(*i)),
        StateValue::Float(f) => Some(Scalar::float(*f)),
        StateValue::Text(s) => Some(Scalar::Text(s.clone())),
        _ => None,
    }
}

/// A scalar of the metadata as a state dict value.
pub(crate) fn value_of(s: Scalar) -> StateValue {
    match s {
        Scalar::Int(i) => StateValue::Int(i),
        Scalar::Float(f) => StateValue::Float(f),
        Scalar::FloatBits(b) => StateValue::Float(f64::from_bits(b)),
        Scalar::Text(t) => StateValue::Text(t),
    }
}

/// The hidden sibling `.NAME.suffix` of the checkpoint directory `dir`.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dir.with_file_name(format!(".{name}.{suffix}"))
}

fn tmp_dir(dir: &Path) -> PathBuf {
    sibling(dir, "tmp")
}

fn shard_file(rank: usize) -> String {
    format!("shard-{rank:05}.safetensors")
}

/// Rank 0's preparation: a fresh, empty temporary directory.
fn prepare(dir: &Path) -> std::result::Result<(), String> {
    let tmp = tmp_dir(dir);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))
}

/// The global plan: for every `(key, box)` the lowest rank holding it writes it; every
/// tensor's chunks must agree on shape and dtype and cover it exactly.
struct GlobalPlan {
    tensors: BTreeMap<String, (String, Vec<usize>)>,
    /// `(key, offsets, sizes)` -> the group rank that writes it.
    owner: HashMap<(String, Vec<usize>, Vec<usize>), usize>,
    values: BTreeMap<String, Scalar>,
}

fn global_plan(plans: &[LocalPlan]) -> Result<GlobalPlan> {
    let mut tensors: BTreeMap<String, (String, Vec<usize>)> = BTreeMap::new();
    let mut owner = HashMap::new();
    let mut boxes: BTreeMap<String, Vec<Region>> = BTreeMap::new();
    let mut values = BTreeMap::new();
    for (rank, plan) in plans.iter().enumerate() {
        for t in &plan.tensors {
            let meta = (t.dtype.clone(), t.shape.clone());
            match tensors.get(&t.key) {
                Some(m) if *m != meta => {
                    return Err(CheckpointError::Inconsistent {
                        what: format!(
                            "{}: {} {:?} on one rank, {} {:?} on rank {rank}",
                            t.key, m.0, m.1, meta.0, meta.1
                        ),
                    })
                }
                Some(_) => {}
                None => {
                    tensors.insert(t.key.clone(), meta);
                }
            }
            for (o, z) in &t.chunks {
                if z.contains(&0) {
                    continue;
                }
                let k = (t.key.clone(), o.clone(), z.clone());
                if let std::collections::hash_map::Entry::Vacant(e) = owner.entry(k) {
                    e.insert(rank);
                    boxes.entry(t.key.clone()).or_default().push((o.clone(), z.clone()));
                }
            }
        }
        for (k, v) in &plan.values {
            values.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    for (key, (_, shape)) in &tensors {
        let bs = boxes.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let volume: usize = bs.iter().map(|(_, z)| z.iter().product::<usize>()).sum();
        let total: usize = shape.iter().product();
        let overlap = bs
            .iter()
            .enumerate()
            .any(|(i, a)| bs[i + 1..].iter().any(|b| intersect(a, b).is_some()));
        if volume != total || overlap {
            return Err(CheckpointError::Inconsistent {
                what: format!(
                    "{key}: the ranks' chunks cover {volume} of {total} elements{}",
                    if overlap { " with overlaps" } else { "" }
                ),
            });
        }
    }
    Ok(GlobalPlan { tensors, owner, values })
}

/// The intersection of two boxes, as `(offsets, sizes)`.
fn intersect(
    a: &(Vec<usize>, Vec<usize>),
    b: &(Vec<usize>, Vec<usize>),
) -> Option<(Vec<usize>, Vec<usize>)> {
    let mut o = Vec::with_capacity(a.0.len());
    let mut z = Vec::with_capacity(a.0.len());
    for d in 0..a.0.len() {
        let lo = a.0[d].max(b.0[d]);
        let hi = (a.0[d] + a.1[d]).min(b.0[d] + b.1[d]);
        if hi <= lo {
            return None;
        }
        o.push(lo);
        z.push(hi - lo);
    }
    Some((o, z))
}

/// Saves `state` as the checkpoint `dir` (`torch.distributed.checkpoint.save`):
/// collective over `group`, every member passes its own state dict with the same keys.
///
/// Each rank writes the chunks it holds that no lower rank holds too (replicas are
/// written once) into `shard-RANK.safetensors`; group rank 0 writes `metadata.json`.
/// All of it goes into `.NAME.tmp` beside `dir`, renamed to `dir` only after every rank
/// has written, so an interrupted save leaves any previous checkpoint at `dir` intact
/// (an existing `dir` is replaced). Scalars are taken from the lowest rank that has
/// them.
///
/// # Errors
/// [`CheckpointError::Inconsistent`] when the ranks' chunks disagree or do not cover a
/// tensor; [`CheckpointError::RankFailed`] on every rank, naming the ranks whose writes
/// failed, when any did (nothing is committed then); collective errors when a peer dies.
pub fn save(state: &StateDict, dir: &Path, group: &ProcessGroup, opts: &SaveOptions) -> Result<()> {
    // The caller waits for the writer: it keeps the caller's priority.
    let opts = SaveOptions { writer_nice: 0, ..opts.clone() };
    async_save(state, dir, group, &opts)?.wait()
}

/// A save whose files are being written by a background thread; see [`async_save`].
pub struct AsyncSave {
    dir: PathBuf,
    group: ProcessGroup,
    values: BTreeMap<String, Scalar>,
    tensors: BTreeMap<String, (String, Vec<usize>)>,
    /// The training step recorded in the metadata ([`CheckpointManager`](crate::CheckpointManager)'s saves).
    step: Option<u64>,
    writer: Option<JoinHandle<std::result::Result<Written, String>>>,
}

impl std::fmt::Debug for AsyncSave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AsyncSave({})", self.dir.display())
    }
}

/// Starts saving `state` as the checkpoint `dir` and returns while the files are being
/// written (torchtitan's async checkpointing): collective over `group`. The chunks this
/// rank writes are copied before it returns, so training may change the state at once;
/// a background thread writes and checksums them. [`AsyncSave::wait`] (collective)
/// joins the writers and commits; until then the previous checkpoint at `dir`, if any,
/// is what a load sees.
///
/// # Errors
/// As [`save`], for the part done before returning.
pub fn async_save(
    state: &StateDict,
    dir: &Path,
    group: &ProcessGroup,
    opts: &SaveOptions,
) -> Result<AsyncSave> {
    let rank = group.rank();
    let setup_error = if rank == 0 { prepare(dir).err() } else { None };
    let tensors = tensors_of(state);
    let plan = LocalPlan {
        tensors: tensors
            .iter()
            .map(|(k, s)| PlanTensor {
                key: (*k).clone(),
                dtype: s.dtype().name().into(),
                shape: s.shape().to_vec(),
                chunks: s.chunks().iter().map(|c| (c.offsets.clone(), c.sizes())).collect(),
            })
            .collect(),
        values: state.iter().filter_map(|(k, v)| scalar_of(v).map(|s| (k.clone(), s))).collect(),
        setup_error,
    };
    let bytes = serde_json::to_vec(&plan)
        .map_err(|e| CheckpointError::Format { path: String::new(), what: e.to_string() })?;
    let plans: Vec<LocalPlan> = group
        .all_gather_bytes(&bytes)?
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| CheckpointError::Format { path: "save plan".into(), what: e.to_string() })?;
    if let Some(e) = &plans[0].setup_error {
        return Err(CheckpointError::RankFailed {
            op: "save",
            ranks: vec![group.global_rank_of(0).unwrap_or(0)],
            what: e.clone(),
        });
    }
    let global = global_plan(&plans)?;
    // Copy out what this rank writes: training may go on once this returns.
    let mut pending = Vec::new();
    for (key, s) in &tensors {
        for c in s.chunks() {
            if global.owner.get(&((*key).clone(), c.offsets.clone(), c.sizes())) == Some(&rank) {
                pending.push(Pending {
                    key: (*key).clone(),
                    offsets: c.offsets.clone(),
                    view: RawView {
                        dtype: st_dtype(s.dtype()),
                        shape: c.sizes(),
                        data: tensor_bytes(&c.tensor)?,
                    },
                });
            }
        }
    }
    let tmp = tmp_dir(dir);
    let fail = opts.inject_write_failure == Some(group.global_rank());
    let nice = opts.writer_nice;
    let file = shard_file(group.global_rank());
    let writer = std::thread::Builder::new()
        .name(format!("checkpoint-writer-{rank}"))
        .spawn(move || {
            lower_priority(nice);
            write_shards(&tmp, &file, pending, fail)
        })
        .map_err(|e| CheckpointError::Io {
            path: dir.display().to_string(),
            what: format!("starting the writer: {e}"),
        })?;
    Ok(AsyncSave {
        dir: dir.to_path_buf(),
        group: group.clone(),
        values: global.values,
        tensors: global.tensors,
        step: None,
        writer: Some(writer),
    })
}

/// Writes `pending` into `tmp/file` and returns where each chunk went.
fn write_shards(
    tmp: &Path,
    file: &str,
    pending: Vec<Pending>,
    fail: bool,
) -> std::result::Result<Written, String> {
    if fail {
        return Err(format!("{}: injected write failure", tmp.join(file).display()));
    }
    if pending.is_empty() {
        return Ok(Vec::new());
    }
    let path = tmp.join(file);
    let names: Vec<String> = pending
        .iter()
        .map(|p| {
            format!(
                "{}@{}",
                p.key,
                p.offsets.iter().map(|o| o.to_string()).collect::<Vec<_>>().join(",")
            )
        })
        .collect();
    let views: Vec<(&str, &RawView)> =
        names.iter().map(String::as_str).zip(pending.iter().map(|p| &p.view)).collect();
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    fs::File::open(&path)
        .and_then(|f| f.sync_all())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let offsets = data_offsets(&path).map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(pending.len());
    for (p, name) in pending.into_iter().zip(names) {
        let &(byte_offset, byte_len) = offsets
            .get(&name)
            .ok_or_else(|| format!("{}: {name} missing after writing", path.display()))?;
        out.push((
            p.key,
            ChunkMeta {
                offsets: p.offsets,
                sizes: p.view.shape,
                file: file.to_string(),
                name,
                byte_offset,
                byte_len,
                crc32: crc32(&p.view.data),
            },
        ));
    }
    Ok(out)
}

impl AsyncSave {
    /// Records `step` in the metadata (a [`CheckpointManager`](crate::CheckpointManager)'s
    /// save).
    pub(crate) fn set_step(&mut self, step: u64) {
        self.step = Some(step);
    }

    /// Whether this rank's writer has finished (local; no communication).
    pub fn is_written(&self) -> bool {
        self.writer.as_ref().is_none_or(|w| w.is_finished())
    }

    /// Waits for every rank's writer and commits the checkpoint: collective over the
    /// group that started it.
    ///
    /// # Errors
    /// [`CheckpointError::RankFailed`] on every rank, naming the ranks whose writes
    /// failed (the temporary directory is removed and nothing is committed).
    pub fn wait(mut self) -> Result<()> {
        let written = match self.writer.take().map(|w| w.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err("the checkpoint writer thread panicked".to_string()),
            None => Ok(Vec::new()),
        };
        let local = match &written {
            Ok(w) => serde_json::to_vec(w).map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        };
        let msg = match &local {
            Ok(b) => [b"O".as_slice(), b].concat(),
            Err(e) => format!("E{e}").into_bytes(),
        };
        let all = self.group.all_gather_bytes(&msg)?;
        let failed: Vec<(usize, String)> = all
            .iter()
            .enumerate()
            .filter(|(_, m)| m.first() != Some(&b'O'))
            .map(|(r, m)| {
                (
                    self.group.global_rank_of(r).unwrap_or(r),
                    String::from_utf8_lossy(m.get(1..).unwrap_or(&[])).into_owned(),
                )
            })
            .collect();
        let tmp = tmp_dir(&self.dir);
        if !failed.is_empty() {
            if self.group.rank() == 0 {
                let _ = fs::remove_dir_all(&tmp);
            }
            return Err(CheckpointError::RankFailed {
                op: "save",
                ranks: failed.iter().map(|f| f.0).collect(),
                what: failed[0].1.clone(),
            });
        }
        let commit = if self.group.rank() == 0 {
            let mut chunks: BTreeMap<String, Vec<ChunkMeta>> = BTreeMap::new();
            let mut parsed = Ok(());
            for m in &all {
                match serde_json::from_slice::<Written>(&m[1..]) {
                    Ok(w) => w.into_iter().for_each(|(k, c)| chunks.entry(k).or_default().push(c)),
                    Err(e) => {
                        parsed = Err(CheckpointError::Format {
                            path: "save results".into(),
                            what: e.to_string(),
                        })
                    }
                }
            }
            parsed.and_then(|()| self.commit(&tmp, chunks))
        } else {
            Ok(())
        };
        // Rank 0 tells everyone whether the commit happened.
        let status = commit.as_ref().map(|_| ()).map_err(|e| e.to_string());
        let failures = agree(&self.group, &status)?;
        commit?;
        match failures.first() {
            None => Ok(()),
            Some((r, what)) => {
                Err(CheckpointError::RankFailed { op: "save", ranks: vec![*r], what: what.clone() })
            }
        }
    }

    /// Rank 0: writes the metadata and renames the temporary directory into place.
    fn commit(&self, tmp: &Path, mut chunks: BTreeMap<String, Vec<ChunkMeta>>) -> Result<()> {
        let tensors = self
            .tensors
            .iter()
            .map(|(k, (dtype, shape))| {
                let mut c = chunks.remove(k).unwrap_or_default();
                c.sort_by(|a, b| a.offsets.cmp(&b.offsets));
                (k.clone(), TensorMeta { dtype: dtype.clone(), shape: shape.clone(), chunks: c })
            })
            .collect();
        let meta = Metadata {
            format: FORMAT.into(),
            version: VERSION,
            world_size: self.group.size(),
            tensors,
            values: self.values.clone(),
            step: self.step,
            checksum: None,
        };
        let path = tmp.join(METADATA);
        let json = meta.to_json()?;
        fs::write(&path, json).map_err(|e| CheckpointError::io(&path, e))?;
        fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| CheckpointError::io(&path, e))?;
        let old = sibling(&self.dir, "old");
        if self.dir.exists() {
            let _ = fs::remove_dir_all(&old);
            fs::rename(&self.dir, &old).map_err(|e| CheckpointError::io(&self.dir, e))?;
        }
        fs::rename(tmp, &self.dir).map_err(|e| CheckpointError::io(&self.dir, e))?;
        if let Some(parent) = self.dir.parent() {
            // Make the rename durable.
            let _ = fs::File::open(parent).and_then(|f| f.sync_all());
        }
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| CheckpointError::io(&old, e))?;
        }
        Ok(())
    }
}

impl Drop for AsyncSave {
    fn drop(&mut self) {
        // A save dropped without `wait` is abandoned: its files stay in the temporary
        // directory, which the next save clears; the writer is joined so no thread
        // outlives the handle.
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Reads the metadata of the checkpoint at `dir`.
///
/// # Errors
/// [`CheckpointError::NotFound`] when `dir` does not exist; [`CheckpointError::Damaged`]
/// when it exists without a readable metadata file, or with one whose checksum does not
/// match; [`CheckpointError::Format`] for a file of another format or version.
pub fn read_metadata(dir: &Path) -> Result<Metadata> {
    let path = dir.join(METADATA);
    if !dir.exists() {
        return Err(CheckpointError::NotFound { path: dir.display().to_string() });
    }
    if !path.is_file() {
        // A directory where a checkpoint was committed, without its metadata: damaged,
        // never taken for "no checkpoint".
        return Err(CheckpointError::Damaged {
            path: path.display().to_string(),
            what: "missing: the checkpoint directory exists but its metadata does not".into(),
        });
    }
    let bytes = fs::read(&path).map_err(|e| CheckpointError::Damaged {
        path: path.display().to_string(),
        what: format!("cannot be read: {e}"),
    })?;
    Metadata::from_json(&bytes, &path)
}

/// Loads the checkpoint at `dir` into `state` (`torch.distributed.checkpoint.load`):
/// every tensor entry is replaced by a new tensor laid out exactly as the entry was (a
/// whole tensor, or the same chunks), read from the saved chunks that overlap it, each
/// checked against its checksum; scalars are replaced by the saved ones. Then hand the
/// entries to [`Stateful::load_state_dict`](crate::Stateful::load_state_dict).
/// Collective over `group` only to agree on the outcome: every rank gets an error when
/// any rank's load failed, naming it.
///
/// # Errors
/// [`StateDictError::Missing`] (with `strict`) for keys the checkpoint lacks;
/// [`StateDictError::Unexpected`] (with `strict`) for keys of the checkpoint that no
/// rank's target has;
/// [`StateDictError::Shape`], [`StateDictError::DType`], [`StateDictError::Kind`] for
/// entries that do not match what was saved; [`CheckpointError::Corrupt`] naming the
/// file and key of a chunk whose bytes do not match its checksum or are cut short;
/// [`CheckpointError::RankFailed`] when another rank failed.
pub fn load(
    state: &mut StateDict,
    dir: &Path,
    group: &ProcessGroup,
    opts: &LoadOptions,
) -> Result<()> {
    load_scoped(state, dir, group, opts, None, None)
}

/// [`load`], where strict loading refuses only the checkpoint's keys under `scope` (key
/// prefixes such as `model.`) that no rank's target has (`None`: every key); with
/// `step`, metadata that records another step is refused as damaged.
pub(crate) fn load_scoped(
    state: &mut StateDict,
    dir: &Path,
    group: &ProcessGroup,
    opts: &LoadOptions,
    scope: Option<&[String]>,
    step: Option<u64>,
) -> Result<()> {
    let meta = read_metadata(dir).and_then(|m| match (step, m.step) {
        (Some(want), Some(got)) if want != got => Err(CheckpointError::Damaged {
            path: dir.join(METADATA).display().to_string(),
            what: format!("records step {got}, but its directory is named for step {want}"),
        }),
        _ => Ok(m),
    });
    // The checkpoint's keys this rank's target lacks; the keys no rank's target has
    // are unexpected (ranks may hold different keys, as ZeRO-1's do).
    let lacking: Option<Vec<&String>> = match &meta {
        Ok(m) if opts.strict => Some(
            m.tensors
                .keys()
                .chain(m.values.keys())
                .filter(|k| !state.contains_key(*k))
                .filter(|k| scope.is_none_or(|p| p.iter().any(|p| k.starts_with(p.as_str()))))
                .collect(),
        ),
        _ => None,
    };
    let bytes = serde_json::to_vec(&lacking)
        .map_err(|e| CheckpointError::Format { path: String::new(), what: e.to_string() })?;
    let all = group.all_gather_bytes(&bytes)?;
    let mut unexpected: Option<Vec<String>> = None;
    for b in &all {
        let theirs: Option<Vec<String>> = serde_json::from_slice(b).map_err(|e| {
            CheckpointError::Format { path: "load plan".into(), what: e.to_string() }
        })?;
        let Some(theirs) = theirs else { continue };
        unexpected = Some(match unexpected {
            None => theirs,
            Some(u) => u.into_iter().filter(|k| theirs.contains(k)).collect(),
        });
    }
    let local = meta.and_then(|meta| {
        if let Some(keys) = unexpected.filter(|u| !u.is_empty()) {
            return Err(StateDictError::Unexpected { keys }.into());
        }
        load_local(state, dir, &meta, opts)
    });
    agree_on(group, "load", local)
}

fn load_local(
    state: &mut StateDict,
    dir: &Path,
    meta: &Metadata,
    opts: &LoadOptions,
) -> Result<()> {
    let missing: Vec<String> = state
        .keys()
        .filter(|k| !meta.tensors.contains_key(*k) && !meta.values.contains_key(*k))
        .cloned()
        .collect();
    if opts.strict && !missing.is_empty() {
        return Err(StateDictError::Missing { keys: missing }.into());
    }
    for (key, value) in state.iter_mut() {
        if missing.contains(key) {
            continue;
        }
        *value = load_value(dir, meta, key, value)?;
    }
    Ok(())
}

fn kind(key: &str, expected: &'static str, got: &'static str) -> CheckpointError {
    StateDictError::Kind { key: key.to_string(), expected, got }.into()
}

fn load_value(dir: &Path, meta: &Metadata, key: &str, target: &StateValue) -> Result<StateValue> {
    if let Some(v) = meta.values.get(key) {
        return Ok(match (target, v) {
            (StateValue::Int(_), Scalar::Int(i)) => StateValue::Int(*i),
            (StateValue::Float(_), Scalar::Float(f)) => StateValue::Float(*f),
            (StateValue::Float(_), Scalar::FloatBits(b)) => StateValue::Float(f64::from_bits(*b)),
            (StateValue::Float(_), Scalar::Int(i)) => StateValue::Float(*i as f64),
            (StateValue::Text(_), Scalar::Text(s)) => StateValue::Text(s.clone()),
            (t, s) => {
                let got = match s {
                    Scalar::Int(_) => "int",
                    Scalar::Float(_) | Scalar::FloatBits(_) => "float",
                    Scalar::Text(_) => "text",
                };
                return Err(kind(key, t.kind(), got));
            }
        });
    }
    let tm = &meta.tensors[key];
    let dtype = dtype_of(&tm.dtype).ok_or_else(|| CheckpointError::Format {
        path: dir.join(METADATA).display().to_string(),
        what: format!("{key}: unknown dtype {:?}", tm.dtype),
    })?;
    let Some((shape, want)) = target.tensor_meta() else {
        return Err(kind(key, target.kind(), "tensor"));
    };
    if shape != tm.shape {
        return Err(StateDictError::Shape {
            key: key.to_string(),
            expected: shape,
            got: tm.shape.clone(),
        }
        .into());
    }
    if want != dtype {
        return Err(
            StateDictError::DType { key: key.to_string(), expected: want, got: dtype }.into()
        );
    }
    let mut reader = ChunkReader { dir, key, meta: tm, dtype, cache: HashMap::new() };
    Ok(match target {
        StateValue::Tensor(_) => {
            StateValue::Tensor(reader.read_box(&vec![0; shape.len()], &shape)?)
        }
        StateValue::Sharded(s) => {
            let chunks = s
                .chunks()
                .iter()
                .map(|c: &Chunk| Ok((c.offsets.clone(), reader.read_box(&c.offsets, &c.sizes())?)))
                .collect::<Result<Vec<_>>>()?;
            StateValue::Sharded(
                ShardedTensor::new(shape, dtype, chunks).map_err(|e| e.for_key(key))?,
            )
        }
        _ => unreachable!("tensor_meta is Some only for tensors"),
    })
}

/// Reads boxes of one tensor from its saved chunks, each chunk read and checked once.
struct ChunkReader<'a> {
    dir: &'a Path,
    key: &'a str,
    meta: &'a TensorMeta,
    dtype: DType,
    cache: HashMap<usize, Vec<u8>>,
}

impl ChunkReader<'_> {
    fn chunk_bytes(&mut self, i: usize) -> Result<&[u8]> {
        if !self.cache.contains_key(&i) {
            let c = &self.meta.chunks[i];
            let path = self.dir.join(&c.file);
            let corrupt = |what: String| CheckpointError::Corrupt {
                file: path.display().to_string(),
                key: self.key.to_string(),
                what,
            };
            let n: usize = c.sizes.iter().product();
            if c.byte_len != (n * self.dtype.size_in_bytes()) as u64 {
                return Err(corrupt(format!("{} bytes recorded for {n} elements", c.byte_len)));
            }
            let bytes = read_at(&path, c.byte_offset, c.byte_len).map_err(|e| {
                corrupt(format!("reading {} bytes at {}: {e}", c.byte_len, c.byte_offset))
            })?;
            let sum = crc32(&bytes);
            if sum != c.crc32 {
                return Err(corrupt(format!(
                    "chunk {} at offsets {:?}: checksum {sum:08x}, recorded {:08x}",
                    c.name, c.offsets, c.crc32
                )));
            }
            self.cache.insert(i, bytes);
        }
        Ok(&self.cache[&i])
    }

    /// The box at `offsets` of size `sizes`, assembled from every saved chunk that
    /// overlaps it.
    fn read_box(&mut self, offsets: &[usize], sizes: &[usize]) -> Result<Tensor> {
        if sizes.is_empty() {
            // A 0-d tensor: its one chunk.
            if self.meta.chunks.is_empty() {
                return Err(CheckpointError::Inconsistent {
                    what: format!("{}: no chunk saved", self.key),
                });
            }
            let src = self.chunk_bytes(0)?.to_vec();
            return tensor_from_bytes(&src, self.dtype, sizes);
        }
        let es = self.dtype.size_in_bytes();
        let numel: usize = sizes.iter().product();
        let mut out = vec![0u8; numel * es];
        let want = (offsets.to_vec(), sizes.to_vec());
        let mut covered = 0usize;
        for i in 0..self.meta.chunks.len() {
            let c = &self.meta.chunks[i];
            let Some((io, iz)) = intersect(&want, &(c.offsets.clone(), c.sizes.clone())) else {
                continue;
            };
            let (c_off, c_sizes) = (c.offsets.clone(), c.sizes.clone());
            let src = self.chunk_bytes(i)?;
            copy_box(src, &c_off, &c_sizes, &mut out, offsets, sizes, &io, &iz, es);
            covered += iz.iter().product::<usize>();
        }
        if numel > 0 && covered != numel {
            return Err(CheckpointError::Inconsistent {
                what: format!(
                    "{}: the checkpoint's chunks cover {covered} of the {numel} elements at {offsets:?} + {sizes:?}",
                    self.key
                ),
            });
        }
        tensor_from_bytes(&out, self.dtype, sizes)
    }
}

/// Copies the box `io` + `iz` (global coordinates) from a row-major buffer holding the
/// box `so` + `sz` into one holding `dof` + `dz`; `es` bytes per element.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_box(
    src: &[u8],
    so: &[usize],
    sz: &[usize],
    dst: &mut [u8],
    dof: &[usize],
    dz: &[usize],
    io: &[usize],
    iz: &[usize],
    es: usize,
) {
    let nd = iz.len();
    let strides =
        |z: &[usize]| -> Vec<usize> { (0..nd).map(|d| z[d + 1..].iter().product()).collect() };
    let (ss, ds) = (strides(sz), strides(dz));
    let row = iz[nd - 1] * es;
    let rows: usize = iz[..nd - 1].iter().product();
    let mut idx = vec![0usize; nd];
    for _ in 0..rows {
        let (mut s, mut d) = (0, 0);
        for k in 0..nd {
            let g = io[k] + idx[k];
            s += (g - so[k]) * ss[k];
            d += (g - dof[k]) * ds[k];
        }
        dst[d * es..d * es + row].copy_from_slice(&src[s * es..s * es + row]);
        // Next row: the last dim is copied whole, so count over the others.
        for k in (0..nd - 1).rev() {
            idx[k] += 1;
            if idx[k] < iz[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}
