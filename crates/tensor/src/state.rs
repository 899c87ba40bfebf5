//! State dicts: what a model, an optimizer, a schedule, a sampler or a trainer's own
//! counters save and load, keyed by name (`layers.0.mlp.up_proj.weight`,
//! `state.layers.0.mlp.up_proj.weight.exp_avg`, `step`).
//!
//! A tensor entry is either a [`Tensor`] every rank holds whole, or a
//! [`ShardedTensor`]: the global shape and dtype plus the chunks (boxes at offsets into
//! the global tensor) this rank holds, which is how a sharded parameter or its
//! optimizer state describes itself whatever mesh, plan or data-parallel mode made it.
//! The distributed checkpoint writes chunks and reads back whichever chunks overlap
//! what each rank needs now.
//!
//! ```
//! use tpar_tensor::state::{ShardedTensor, StateValue, Stateful, StateDict, StateDictError};
//! use tpar_tensor::Tensor;
//!
//! // A trainer's own counters, saved and restored with the model.
//! struct Progress { step: i64 }
//! impl Stateful for Progress {
//!     fn state_dict(&self) -> Result<StateDict, StateDictError> {
//!         Ok(StateDict::from([("step".to_string(), StateValue::Int(self.step))]))
//!     }
//!     fn load_state_dict(&mut self, mut state: StateDict) -> Result<(), StateDictError> {
//!         self.step = tpar_tensor::state::take_int(&mut state, "step")?;
//!         tpar_tensor::state::expect_empty(state)
//!     }
//! }
//! let mut p = Progress { step: 0 };
//! p.load_state_dict(Progress { step: 7 }.state_dict().unwrap()).unwrap();
//! assert_eq!(p.step, 7);
//!
//! // Rows 2..4 of a [4, 3] tensor held by this rank.
//! let rows = Tensor::from_vec(vec![0f32; 6], [2, 3]).unwrap();
//! let s = ShardedTensor::new(vec![4, 3], rows.dtype(), vec![(vec![2, 0], rows)]).unwrap();
//! assert_eq!(s.chunks()[0].sizes(), vec![2, 3]);
//! ```

use std::collections::BTreeMap;

use crate::{DType, Tensor, TensorError};

/// A state dict: values by name, in name order.
pub type StateDict = BTreeMap<String, StateValue>;

/// One entry of a [`StateDict`].
#[derive(Clone, Debug)]
pub enum StateValue {
    /// A tensor every rank holds whole (unsharded, or replicated on every rank).
    Tensor(Tensor),
    /// A tensor of which this rank holds some chunks.
    Sharded(ShardedTensor),
    /// An integer (a step count, an epoch).
    Int(i64),
    /// A float (a learning rate, a hyper-parameter).
    Float(f64),
    /// Text (a schedule's name, a configuration tag).
    Text(String),
}

impl StateValue {
    /// What kind of value this is, for error messages: `tensor`, `sharded tensor`,
    /// `int`, `float`, `text`.
    pub fn kind(&self) -> &'static str {
        match self {
            StateValue::Tensor(_) => "tensor",
            StateValue::Sharded(_) => "sharded tensor",
            StateValue::Int(_) => "int",
            StateValue::Float(_) => "float",
            StateValue::Text(_) => "text",
        }
    }

    /// The global shape and dtype of a tensor entry (`None` for scalars).
    pub fn tensor_meta(&self) -> Option<(Vec<usize>, DType)> {
        match self {
            StateValue::Tensor(t) => Some((t.dims().to_vec(), t.dtype())),
            StateValue::Sharded(s) => Some((s.shape().to_vec(), s.dtype())),
            _ => None,
        }
    }
}

/// One box of a tensor held by this rank: `tensor` holds the elements at
/// `offsets[d]..offsets[d] + tensor.dims()[d]` of the global tensor on every dim `d`.
#[derive(Clone, Debug)]
pub struct Chunk {
    /// Where the box starts in the global tensor, per dim.
    pub offsets: Vec<usize>,
    /// The box's values (its shape is the box's size).
    pub tensor: Tensor,
}

impl Chunk {
    /// The box's size per dim.
    pub fn sizes(&self) -> Vec<usize> {
        self.tensor.dims().to_vec()
    }
}

/// A tensor's global shape and dtype with the chunks of it this rank holds (none, one,
/// or several: a ZeRO range of a flattened parameter is several boxes).
#[derive(Clone, Debug)]
pub struct ShardedTensor {
    shape: Vec<usize>,
    dtype: DType,
    chunks: Vec<Chunk>,
}

impl ShardedTensor {
    /// A sharded tensor of global `shape` and `dtype` from `(offsets, values)` chunks.
    ///
    /// # Errors
    /// [`StateDictError::Chunk`] when a chunk has another rank or dtype than the tensor,
    /// or reaches past its shape.
    pub fn new(
        shape: Vec<usize>,
        dtype: DType,
        chunks: Vec<(Vec<usize>, Tensor)>,
    ) -> Result<ShardedTensor, StateDictError> {
        let mut out = Vec::with_capacity(chunks.len());
        for (offsets, tensor) in chunks {
            let bad = |what: String| StateDictError::Chunk { key: String::new(), what };
            if offsets.len() != shape.len() || tensor.rank() != shape.len() {
                return Err(bad(format!(
                    "chunk of shape {:?} at offsets {offsets:?} in a tensor of shape {shape:?}",
                    tensor.dims()
                )));
            }
            if tensor.dtype() != dtype {
                return Err(bad(format!("chunk of dtype {} in a {dtype} tensor", tensor.dtype())));
            }
            if offsets.iter().zip(tensor.dims()).zip(&shape).any(|((o, s), n)| o + s > *n) {
                return Err(bad(format!(
                    "chunk of shape {:?} at offsets {offsets:?} reaches past shape {shape:?}",
                    tensor.dims()
                )));
            }
            out.push(Chunk { offsets, tensor });
        }
        Ok(ShardedTensor { shape, dtype, chunks: out })
    }

    /// The whole of `t` as one chunk at offset 0.
    pub fn whole(t: &Tensor) -> ShardedTensor {
        ShardedTensor {
            shape: t.dims().to_vec(),
            dtype: t.dtype(),
            chunks: vec![Chunk { offsets: vec![0; t.rank()], tensor: t.clone() }],
        }
    }

    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The chunks this rank holds.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// The chunks, by value.
    pub fn into_chunks(self) -> Vec<Chunk> {
        self.chunks
    }
}

/// The boxes that make up elements `start..start + len` of a row-major tensor of shape
/// `dims`, in order, as `(offsets, sizes)`: their elements, flattened one after the
/// other, are exactly that flat range. At most `2 * dims.len() - 1` boxes.
pub fn flat_range_boxes(dims: &[usize], start: usize, len: usize) -> Vec<(Vec<usize>, Vec<usize>)> {
    let mut out = Vec::new();
    if len == 0 {
        return out;
    }
    if dims.is_empty() {
        return vec![(vec![], vec![])];
    }
    // Elements per step of dim 0.
    let inner: usize = dims[1..].iter().product();
    if inner == 0 {
        return out;
    }
    let (end, mut pos) = (start + len, start);
    let rest = &dims[1..];
    let push_inner = |out: &mut Vec<_>, row: usize, s: usize, l: usize| {
        for (mut o, mut z) in flat_range_boxes(rest, s, l) {
            o.insert(0, row);
            z.insert(0, 1);
            out.push((o, z));
        }
    };
    // A partial first row.
    if pos % inner != 0 {
        let row = pos / inner;
        let l = (inner - pos % inner).min(end - pos);
        push_inner(&mut out, row, pos % inner, l);
        pos += l;
    }
    // Whole rows.
    let rows = (end - pos) / inner;
    if rows > 0 {
        let mut o = vec![0; dims.len()];
        o[0] = pos / inner;
        let mut z = dims.to_vec();
        z[0] = rows;
        out.push((o, z));
        pos += rows * inner;
    }
    // A partial last row.
    if pos < end {
        push_inner(&mut out, pos / inner, 0, end - pos);
    }
    out
}

/// What a model, optimizer, schedule, sampler or a trainer's own state implements to be
/// saved and restored (PyTorch's `Stateful` protocol of `torch.distributed.checkpoint`).
pub trait Stateful {
    /// The state, by name. Tensor values may share storage with the live state: the
    /// checkpoint copies what it keeps.
    fn state_dict(&self) -> Result<StateDict, StateDictError>;
    /// Restores the state from `state`, laid out as [`Stateful::state_dict`] returns it
    /// (the checkpoint has already resharded every tensor to this rank's layout).
    fn load_state_dict(&mut self, state: StateDict) -> Result<(), StateDictError>;
}

/// Errors of building, checking and loading state dicts; each names the key.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StateDictError {
    /// Keys the target expects that the state does not have.
    #[error("missing keys in state dict: {keys:?}")]
    Missing {
        /// The keys, in order.
        keys: Vec<String>,
    },
    /// Keys of the state the target does not know.
    #[error("unexpected keys in state dict: {keys:?}")]
    Unexpected {
        /// The keys, in order.
        keys: Vec<String>,
    },
    /// A tensor of the wrong shape.
    #[error("{key}: shape {got:?} where {expected:?} is expected")]
    Shape {
        /// The key.
        key: String,
        /// The shape expected.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
    },
    /// A tensor of the wrong dtype.
    #[error("{key}: dtype {got} where {expected} is expected")]
    DType {
        /// The key.
        key: String,
        /// The dtype expected.
        expected: DType,
        /// The dtype found.
        got: DType,
    },
    /// A value of the wrong kind (a tensor where an int is expected, ...).
    #[error("{key}: a {got} where a {expected} is expected")]
    Kind {
        /// The key.
        key: String,
        /// The kind expected.
        expected: &'static str,
        /// The kind found.
        got: &'static str,
    },
    /// A chunk that does not fit its tensor or the layout asked for.
    #[error("{key}: {what}")]
    Chunk {
        /// The key (empty when not known yet).
        key: String,
        /// What is wrong, with the numbers.
        what: String,
    },
    /// A value that is well formed but cannot be used (a hyper-parameter out of range).
    #[error("{key}: {what}")]
    Invalid {
        /// The key.
        key: String,
        /// What is wrong.
        what: String,
    },
    /// A resume whose configuration differs from the one the checkpoint was saved with,
    /// in what may not differ (each difference names the key and both values).
    #[error("resume refused: this run's configuration differs from the checkpoint's: {}", differences.join("; "))]
    Mismatch {
        /// `key: saved X, this run Y`, one per difference.
        differences: Vec<String>,
    },
    /// A tensor op failed while reading or writing state.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// An error of a layer above the tensor core (modules, collectives), as text.
    #[error("{0}")]
    Other(String),
}

impl StateDictError {
    /// The same error with `key` filled in where it was not known.
    pub fn for_key(self, key: &str) -> StateDictError {
        match self {
            StateDictError::Chunk { key: k, what } if k.is_empty() => {
                StateDictError::Chunk { key: key.to_string(), what }
            }
            other => other,
        }
    }
}

/// Removes `key` from `state`.
///
/// # Errors
/// [`StateDictError::Missing`] when it is absent.
pub fn take(state: &mut StateDict, key: &str) -> Result<StateValue, StateDictError> {
    state.remove(key).ok_or_else(|| StateDictError::Missing { keys: vec![key.to_string()] })
}

/// Removes the integer `key` from `state`.
///
/// # Errors
/// [`StateDictError::Missing`], or [`StateDictError::Kind`] for another kind of value.
pub fn take_int(state: &mut StateDict, key: &str) -> Result<i64, StateDictError> {
    match take(state, key)? {
        StateValue::Int(v) => Ok(v),
        other => Err(kind_err(key, "int", &other)),
    }
}

/// Removes the float `key` from `state` (an integer value is taken as a float).
///
/// # Errors
/// [`StateDictError::Missing`], or [`StateDictError::Kind`] for another kind of value.
pub fn take_float(state: &mut StateDict, key: &str) -> Result<f64, StateDictError> {
    match take(state, key)? {
        StateValue::Float(v) => Ok(v),
        StateValue::Int(v) => Ok(v as f64),
        other => Err(kind_err(key, "float", &other)),
    }
}

/// Removes the text `key` from `state`.
///
/// # Errors
/// [`StateDictError::Missing`], or [`StateDictError::Kind`] for another kind of value.
pub fn take_text(state: &mut StateDict, key: &str) -> Result<String, StateDictError> {
    match take(state, key)? {
        StateValue::Text(v) => Ok(v),
        other => Err(kind_err(key, "text", &other)),
    }
}

fn kind_err(key: &str, expected: &'static str, got: &StateValue) -> StateDictError {
    StateDictError::Kind { key: key.to_string(), expected, got: got.kind() }
}

/// `Ok` when every key of `state` has been taken.
///
/// # Errors
/// [`StateDictError::Unexpected`] naming the keys left.
pub fn expect_empty(state: StateDict) -> Result<(), StateDictError> {
    if state.is_empty() {
        Ok(())
    } else {
        Err(StateDictError::Unexpected { keys: state.into_keys().collect() })
    }
}

/// `state` with every key prefixed by `prefix.` (how a checkpoint nests the state dicts
/// of a model, an optimizer and the rest in one namespace).
pub fn with_prefix(prefix: &str, state: StateDict) -> StateDict {
    state.into_iter().map(|(k, v)| (format!("{prefix}.{k}"), v)).collect()
}

/// Takes every entry under `prefix.` out of `state`, with the prefix removed.
pub fn split_prefix(prefix: &str, state: &mut StateDict) -> StateDict {
    let p = format!("{prefix}.");
    let keys: Vec<String> = state.keys().filter(|k| k.starts_with(&p)).cloned().collect();
    keys.into_iter()
        .filter_map(|k| state.remove(&k).map(|v| (k[p.len()..].to_string(), v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(dims: &[usize], boxes: &[(Vec<usize>, Vec<usize>)]) -> Vec<usize> {
        let strides: Vec<usize> = (0..dims.len()).map(|d| dims[d + 1..].iter().product()).collect();
        let mut out = Vec::new();
        for (o, z) in boxes {
            let n: usize = z.iter().product();
            for i in 0..n {
                let mut rem = i;
                let mut idx = 0;
                for d in (0..dims.len()).rev() {
                    idx += (o[d] + rem % z[d]) * strides[d];
                    rem /= z[d];
                }
                out.push(idx);
            }
        }
        out
    }

    #[test]
    fn flat_ranges_decompose_into_ordered_boxes() {
        for dims in [vec![7], vec![3, 4], vec![2, 3, 5], vec![4, 1, 3], vec![2, 0, 3]] {
            let n: usize = dims.iter().product();
            for start in 0..=n {
                for len in 0..=(n - start) {
                    let boxes = flat_range_boxes(&dims, start, len);
                    assert_eq!(flat(&dims, &boxes), (start..start + len).collect::<Vec<_>>());
                    assert!(boxes.len() < 2 * dims.len().max(1), "{dims:?} {start} {len}");
                }
            }
        }
    }

    #[test]
    fn chunks_are_checked_against_the_tensor() {
        let t = Tensor::from_vec(vec![0f32; 4], [2, 2]).unwrap();
        assert!(ShardedTensor::new(vec![3, 2], DType::F32, vec![(vec![2, 0], t.clone())]).is_err());
        assert!(ShardedTensor::new(vec![4, 2], DType::F64, vec![(vec![0, 0], t.clone())]).is_err());
        assert!(ShardedTensor::new(vec![4, 2], DType::F32, vec![(vec![2, 0], t)]).is_ok());
    }

    #[test]
    fn prefixes_nest_and_split() {
        let mut sd = with_prefix("optim", StateDict::from([("lr".into(), StateValue::Float(0.1))]));
        sd.insert("step".into(), StateValue::Int(3));
        let mut optim = split_prefix("optim", &mut sd);
        assert_eq!(take_float(&mut optim, "lr").unwrap(), 0.1);
        assert!(matches!(take_int(&mut sd, "step"), Ok(3)));
        assert!(matches!(take_int(&mut sd, "step"), Err(StateDictError::Missing { .. })));
    }
}
