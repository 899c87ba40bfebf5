//! Whole-tensor state dicts (`get_state_dict` / `set_state_dict` with
//! `StateDictOptions`, as `torch.distributed.checkpoint.state_dict` has them) and one
//! safetensors file other tools read and write.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tpar_collectives::ProcessGroup;
use tpar_nn::Module;
use tpar_tensor::state::{Chunk, StateDict, StateValue, Stateful};
use tpar_tensor::{DType, Device, Tensor};

use crate::dcp::{copy_box, scalar_of, value_of};
use crate::format::{
    dtype_of, from_st_dtype, st_dtype, tensor_bytes, tensor_from_bytes, RawView, Scalar,
};
use crate::{CheckpointError, Result};

/// How [`get_state_dict`] and [`set_state_dict`] lay out state (PyTorch's
/// `StateDictOptions`).
#[derive(Clone, Debug)]
pub struct StateDictOptions {
    /// Whole tensors instead of this rank's chunks (gathered over the group).
    pub full_state_dict: bool,
    /// Tensors on the host. With `full_state_dict`, only group rank 0 gets the state;
    /// the others get an empty state dict (saves memory on every other rank).
    pub cpu_offload: bool,
    /// Missing and unexpected keys are errors when loading (default `true`).
    pub strict: bool,
    /// [`set_state_dict`]: only group rank 0 passes the (whole) state; it is broadcast
    /// and each rank keeps its own chunks.
    pub broadcast_from_rank0: bool,
}

impl Default for StateDictOptions {
    fn default() -> Self {
        StateDictOptions {
            full_state_dict: false,
            cpu_offload: false,
            strict: true,
            broadcast_from_rank0: false,
        }
    }
}

#[derive(Serialize, Deserialize)]
struct ChunkDesc {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
}

/// `state` with every sharded entry gathered into a whole tensor (collective over
/// `group`, which must hold every rank owning a chunk; every rank passes the same keys).
/// With `rank0_only`, ranks other than group rank 0 get an empty state dict.
///
/// # Errors
/// [`CheckpointError::Inconsistent`] when the ranks' chunks do not cover a tensor;
/// collective errors.
pub fn full_state_dict(
    state: &StateDict,
    group: &ProcessGroup,
    rank0_only: bool,
) -> Result<StateDict> {
    /// What one rank knows of a key.
    #[derive(Serialize, Deserialize)]
    enum KeyMeta {
        /// A whole tensor on this rank.
        Whole(String, Vec<usize>),
        /// Chunks of a tensor.
        Sharded(String, Vec<usize>),
        /// A scalar.
        Scalar(Scalar),
    }
    let keep = !rank0_only || group.rank() == 0;
    let fmt_err = |e: serde_json::Error| CheckpointError::Format {
        path: "state dict keys".into(),
        what: e.to_string(),
    };
    // The union of every rank's keys (ranks may hold different ones: ZeRO-1's state of
    // a parameter lives only on the ranks whose ranges cover it).
    let mine: Vec<(String, KeyMeta)> = state
        .iter()
        .map(|(k, v)| {
            let m = match v {
                StateValue::Tensor(t) => KeyMeta::Whole(t.dtype().name().into(), t.dims().to_vec()),
                StateValue::Sharded(s) => {
                    KeyMeta::Sharded(s.dtype().name().into(), s.shape().to_vec())
                }
                other => KeyMeta::Scalar(scalar_of(other).expect("a scalar")),
            };
            (k.clone(), m)
        })
        .collect();
    let mut union: BTreeMap<String, (usize, KeyMeta)> = BTreeMap::new();
    for (r, bytes) in
        group.all_gather_bytes(&serde_json::to_vec(&mine).map_err(fmt_err)?)?.iter().enumerate()
    {
        let theirs: Vec<(String, KeyMeta)> = serde_json::from_slice(bytes).map_err(fmt_err)?;
        for (k, m) in theirs {
            match union.get(&k) {
                // A whole tensor anywhere is taken from the lowest rank holding it.
                Some((_, KeyMeta::Sharded(..))) if matches!(m, KeyMeta::Whole(..)) => {
                    union.insert(k, (r, m));
                }
                Some(_) => {}
                None => {
                    union.insert(k, (r, m));
                }
            }
        }
    }
    let mut out = StateDict::new();
    for (key, (owner, meta)) in union {
        let (dtype, shape, whole) = match meta {
            KeyMeta::Scalar(s) => {
                if keep {
                    out.insert(key, value_of(s));
                }
                continue;
            }
            KeyMeta::Whole(d, s) => (d, s, true),
            KeyMeta::Sharded(d, s) => (d, s, false),
        };
        let dtype = dtype_of(&dtype).ok_or_else(|| CheckpointError::Format {
            path: key.clone(),
            what: format!("dtype {dtype:?}"),
        })?;
        if whole {
            let t = match state.get(&key) {
                Some(StateValue::Tensor(t)) if group.rank() == owner => t.to_device(Device::Cpu)?,
                _ => Tensor::zeros(shape, dtype, Device::Cpu)?,
            };
            let t = if group.size() > 1 { group.broadcast(&t, owner)? } else { t };
            if keep {
                out.insert(key, StateValue::Tensor(t));
            }
            continue;
        }
        let chunks: &[Chunk] = match state.get(&key) {
            Some(StateValue::Sharded(s)) => s.chunks(),
            _ => &[],
        };
        if let Some(t) = gather_chunks(&key, &shape, dtype, chunks, group, keep)? {
            out.insert(key, StateValue::Tensor(t));
        }
    }
    Ok(out)
}

/// The whole tensor of `shape` from every member's `chunks` of it (one all_gather of
/// descriptors and bytes; `None` where `keep` is false). Every member runs the same
/// checks on the same gathered bytes, so they fail or succeed together.
fn gather_chunks(
    key: &str,
    shape: &[usize],
    dtype: DType,
    chunks: &[Chunk],
    group: &ProcessGroup,
    keep: bool,
) -> Result<Option<Tensor>> {
    let format_err = |e: serde_json::Error| CheckpointError::Format {
        path: key.to_string(),
        what: e.to_string(),
    };
    let descs: Vec<ChunkDesc> =
        chunks.iter().map(|c| ChunkDesc { offsets: c.offsets.clone(), sizes: c.sizes() }).collect();
    let mut msg = serde_json::to_vec(&descs).map_err(format_err)?;
    let header = (msg.len() as u64).to_le_bytes();
    msg.splice(0..0, header);
    for c in chunks {
        msg.extend(tensor_bytes(&c.tensor)?);
    }
    let all = group.all_gather_bytes(&msg)?;
    if !keep {
        return Ok(None);
    }
    let es = dtype.size_in_bytes();
    let numel: usize = shape.iter().product();
    let mut buf = vec![0u8; numel * es];
    let mut covered = vec![false; numel];
    for m in &all {
        let n = u64::from_le_bytes(m[..8].try_into().expect("8 bytes")) as usize;
        let descs: Vec<ChunkDesc> = serde_json::from_slice(&m[8..8 + n]).map_err(format_err)?;
        let mut pos = 8 + n;
        for d in descs {
            let len = d.sizes.iter().product::<usize>() * es;
            let fits = d.offsets.len() == shape.len()
                && d.sizes.len() == shape.len()
                && d.offsets.iter().zip(&d.sizes).zip(shape).all(|((o, z), n)| o + z <= *n)
                && pos + len <= m.len();
            if !fits {
                return Err(CheckpointError::Inconsistent {
                    what: format!(
                        "{key}: a chunk of size {:?} at {:?} ({len} bytes at {pos} of {}) in shape {shape:?}",
                        d.sizes, d.offsets, m.len()
                    ),
                });
            }
            if d.sizes.is_empty() {
                buf.copy_from_slice(&m[pos..pos + es]);
                covered.iter_mut().for_each(|c| *c = true);
            } else if len > 0 {
                let origin = vec![0; d.sizes.len()];
                let src = &m[pos..pos + len];
                copy_box(
                    src, &d.offsets, &d.sizes, &mut buf, &origin, shape, &d.offsets, &d.sizes, es,
                );
                mark(&mut covered, shape, &d.offsets, &d.sizes);
            }
            pos += len;
        }
    }
    if let Some(i) = covered.iter().position(|c| !c) {
        return Err(CheckpointError::Inconsistent {
            what: format!("{key}: no rank holds element {i} of shape {shape:?}"),
        });
    }
    Ok(Some(tensor_from_bytes(&buf, dtype, shape)?))
}

/// Marks the elements of a box as covered.
fn mark(covered: &mut [bool], shape: &[usize], offsets: &[usize], sizes: &[usize]) {
    let n: usize = sizes.iter().product();
    for i in 0..n {
        let (mut rem, mut flat, mut stride) = (i, 0, 1);
        for d in (0..shape.len()).rev() {
            flat += (offsets[d] + rem % sizes[d]) * stride;
            rem /= sizes[d];
            stride *= shape[d];
        }
        covered[flat] = true;
    }
}

fn to_host(state: StateDict) -> Result<StateDict> {
    state
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                StateValue::Tensor(t) => StateValue::Tensor(t.to_device(Device::Cpu)?),
                StateValue::Sharded(s) => {
                    let chunks = s
                        .chunks()
                        .iter()
                        .map(|c| Ok((c.offsets.clone(), c.tensor.to_device(Device::Cpu)?)))
                        .collect::<Result<Vec<_>>>()?;
                    StateValue::Sharded(
                        tpar_tensor::state::ShardedTensor::new(
                            s.shape().to_vec(),
                            s.dtype(),
                            chunks,
                        )
                        .map_err(|e| e.for_key(&k))?,
                    )
                }
                other => other,
            };
            Ok((k, v))
        })
        .collect()
}

fn apply_options(
    state: StateDict,
    group: &ProcessGroup,
    opts: &StateDictOptions,
) -> Result<StateDict> {
    let state = if opts.full_state_dict {
        full_state_dict(&state, group, opts.cpu_offload)?
    } else {
        state
    };
    if opts.cpu_offload {
        to_host(state)
    } else {
        Ok(state)
    }
}

/// The model's and the optimizer's state dicts (`get_state_dict(model, optimizers,
/// options)`): keyed by FQN, as this rank's chunks or, with
/// [`StateDictOptions::full_state_dict`], as whole tensors. Collective over `group` when
/// gathering.
///
/// # Errors
/// As [`full_state_dict`], and the optimizer's own errors.
pub fn get_state_dict(
    model: &dyn Module,
    optim: Option<&dyn Stateful>,
    group: &ProcessGroup,
    opts: &StateDictOptions,
) -> Result<(StateDict, StateDict)> {
    let m = apply_options(tpar_nn::state_dict(model)?, group, opts)?;
    let o = match optim {
        Some(o) => apply_options(o.state_dict()?, group, opts)?,
        None => StateDict::new(),
    };
    Ok((m, o))
}

/// Rank 0's `state` on every rank: the keys and scalars, then each tensor broadcast.
/// Rank 0's refusal (a sharded entry) reaches every rank as the same error.
fn broadcast_state(state: StateDict, group: &ProcessGroup) -> Result<StateDict> {
    #[derive(Serialize, Deserialize)]
    enum Entry {
        Tensor(String, Vec<usize>),
        Scalar(Scalar),
    }
    let format_err = |e: serde_json::Error| CheckpointError::Format {
        path: "state".into(),
        what: e.to_string(),
    };
    let mine = if group.rank() == 0 {
        let entries: std::result::Result<Vec<(String, Entry)>, String> = state
            .iter()
            .map(|(k, v)| match v {
                StateValue::Tensor(t) => {
                    Ok((k.clone(), Entry::Tensor(t.dtype().name().into(), t.dims().to_vec())))
                }
                StateValue::Sharded(_) => {
                    Err(format!("{k}: broadcast_from_rank0 needs whole tensors (full_state_dict)"))
                }
                other => Ok((k.clone(), Entry::Scalar(scalar_of(other).expect("a scalar")))),
            })
            .collect();
        serde_json::to_vec(&entries).map_err(format_err)?
    } else {
        Vec::new()
    };
    let all = group.all_gather_bytes(&mine)?;
    let entries: std::result::Result<Vec<(String, Entry)>, String> =
        serde_json::from_slice(&all[0]).map_err(format_err)?;
    let entries = entries.map_err(|what| CheckpointError::Inconsistent { what })?;
    let mut out = StateDict::new();
    for (k, e) in entries {
        let v = match e {
            Entry::Tensor(dtype, shape) => {
                let dtype = dtype_of(&dtype).ok_or_else(|| CheckpointError::Format {
                    path: "state".into(),
                    what: format!("{k}: unknown dtype {dtype:?}"),
                })?;
                let t = match state.get(&k) {
                    Some(StateValue::Tensor(t)) if group.rank() == 0 => t.to_device(Device::Cpu)?,
                    _ => Tensor::zeros(shape, dtype, Device::Cpu)?,
                };
                StateValue::Tensor(if group.size() > 1 { group.broadcast(&t, 0)? } else { t })
            }
            Entry::Scalar(s) => value_of(s),
        };
        out.insert(k, v);
    }
    Ok(out)
}

/// Loads model and optimizer state dicts (`set_state_dict`): each may hold whole
/// tensors (every rank keeps its own chunk of them) or this rank's chunks. With
/// [`StateDictOptions::broadcast_from_rank0`], only group rank 0's dicts are read (the
/// others may pass empty ones) and broadcast. `strict` applies to the model.
///
/// # Errors
/// The model's and optimizer's load errors; collective errors when broadcasting.
pub fn set_state_dict(
    model: &mut dyn Module,
    optim: Option<&mut dyn Stateful>,
    model_state: StateDict,
    optim_state: StateDict,
    group: &ProcessGroup,
    opts: &StateDictOptions,
) -> Result<()> {
    let (model_state, optim_state) = if opts.broadcast_from_rank0 {
        (broadcast_state(model_state, group)?, broadcast_state(optim_state, group)?)
    } else {
        (model_state, optim_state)
    };
    tpar_nn::load_state_dict(model, model_state, opts.strict)?;
    if let Some(o) = optim {
        o.load_state_dict(optim_state)?;
    }
    Ok(())
}

/// Writes `state` as one safetensors file at `path` with its keys as tensor names (what
/// Python's `safetensors` and `torch` read): sharded entries are gathered first
/// (collective over `group`), group rank 0 writes the file (to a temporary name, then
/// renamed). Scalars go into the file's `__metadata__` as text.
///
/// # Errors
/// As [`full_state_dict`]; [`CheckpointError::Io`] for the file.
pub fn export_safetensors(state: &StateDict, path: &Path, group: &ProcessGroup) -> Result<()> {
    let full = full_state_dict(state, group, true)?;
    let mut status: std::result::Result<(), String> = Ok(());
    if group.rank() == 0 {
        status = write_file(&full, path).map_err(|e| e.to_string());
    }
    let failed = crate::exchange::agree(group, &status)?;
    match failed.first() {
        None => Ok(()),
        Some((r, what)) => {
            Err(CheckpointError::RankFailed { op: "save", ranks: vec![*r], what: what.clone() })
        }
    }
}

fn write_file(state: &StateDict, path: &Path) -> Result<()> {
    let mut views = Vec::new();
    let mut meta = std::collections::HashMap::new();
    for (k, v) in state {
        match v {
            StateValue::Tensor(t) => views.push((
                k.clone(),
                RawView {
                    dtype: st_dtype(t.dtype()),
                    shape: t.dims().to_vec(),
                    data: tensor_bytes(t)?,
                },
            )),
            StateValue::Int(i) => {
                meta.insert(k.clone(), i.to_string());
            }
            StateValue::Float(f) => {
                meta.insert(k.clone(), format!("{f:?}"));
            }
            StateValue::Text(s) => {
                meta.insert(k.clone(), s.clone());
            }
            StateValue::Sharded(_) => unreachable!("gathered by full_state_dict"),
        }
    }
    let tmp = path.with_extension("safetensors.tmp");
    let refs: Vec<(&str, &RawView)> = views.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let meta = (!meta.is_empty()).then_some(meta);
    safetensors::serialize_to_file(refs, meta, &tmp).map_err(|e| CheckpointError::Io {
        path: tmp.display().to_string(),
        what: e.to_string(),
    })?;
    fs::rename(&tmp, path).map_err(|e| CheckpointError::io(path, e))
}

/// Reads a safetensors file (written by [`export_safetensors`], Python's `safetensors`,
/// or any other tool) as a state dict of whole tensors on the host, keyed by the file's
/// tensor names; load it into a sharded model with [`tpar_nn::load_state_dict`] or
/// [`set_state_dict`] (each rank keeps its own chunk).
///
/// # Errors
/// [`CheckpointError::Io`] for the file; [`CheckpointError::Format`] for a file that is
/// not safetensors or a tensor of a dtype tpar does not have (naming it).
pub fn import_safetensors(path: &Path) -> Result<StateDict> {
    let bytes = fs::read(path).map_err(|e| CheckpointError::io(path, e))?;
    let bad = |what: String| CheckpointError::Format { path: path.display().to_string(), what };
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let dtype = from_st_dtype(view.dtype()).ok_or_else(|| {
            bad(format!("tensor {name:?} has dtype {:?}, which tpar does not have", view.dtype()))
        })?;
        let t = tensor_from_bytes(view.data(), dtype, view.shape())
            .map_err(|e| bad(format!("{name}: {e}")))?;
        out.insert(name, StateValue::Tensor(t));
    }
    Ok(out)
}
