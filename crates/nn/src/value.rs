//! What flows between modules: plain tensors, distributed tensors, or opaque values
//! (RoPE tables, masks) that parallel styles pass through untouched.

use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use tpar_dtensor::{DTensor, Placement};
use tpar_mesh::DeviceMesh;
use tpar_tensor::Tensor;

use crate::ops::not_a_tensor;
use crate::{NnError, Result};

/// One input or output of a module.
#[derive(Clone)]
pub enum Value {
    /// A plain (local) tensor.
    Tensor(Tensor),
    /// A distributed tensor.
    DTensor(DTensor),
    /// Anything else (e.g. the RoPE tables); never converted by styles.
    Opaque(Arc<dyn Any + Send + Sync>),
    /// No value (an optional input left out).
    None,
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Tensor(t) => write!(f, "{t:?}"),
            Value::DTensor(d) => write!(f, "{d:?}"),
            Value::Opaque(_) => f.write_str("Opaque"),
            Value::None => f.write_str("None"),
        }
    }
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Self {
        Value::Tensor(t)
    }
}

impl From<DTensor> for Value {
    fn from(d: DTensor) -> Self {
        Value::DTensor(d)
    }
}

impl Value {
    /// The plain tensor; a `DTensor` is an error naming `who` (use `use_local_output` or
    /// [`Value::into_local`]).
    pub fn into_tensor(self, who: &str) -> Result<Tensor> {
        match self {
            Value::Tensor(t) => Ok(t),
            other => Err(NnError::BadInput {
                module: who.to_string(),
                what: format!("expected a plain tensor, got {other:?}"),
            }),
        }
    }

    /// The plain tensor of an optional input: `None` for [`Value::None`]; a DTensor or an
    /// opaque value is an error naming `who`.
    pub fn into_optional_tensor(self, who: &str) -> Result<Option<Tensor>> {
        match self {
            Value::None => Ok(None),
            other => other.into_tensor(who).map(Some),
        }
    }

    /// The plain tensor, or a DTensor's local shard.
    pub fn into_local(self, who: &str) -> Result<Tensor> {
        match self {
            Value::Tensor(t) => Ok(t),
            Value::DTensor(d) => Ok(d.to_local()),
            other => Err(NnError::BadInput {
                module: who.to_string(),
                what: format!("expected a tensor, got {other:?}"),
            }),
        }
    }

    /// Mean cross-entropy of these logits (`[rows, vocab]`) against i64 `targets`
    /// (`[rows]`), skipping `ignore_index`: `F.cross_entropy`. Vocab-sharded DTensor
    /// logits use the loss_parallel algorithm (per-rank max, sum-exp and target logit,
    /// each reduced with one all_reduce of a `[rows]` vector, never the logits) and give a
    /// `Replicate` DTensor loss; plain logits give a plain loss.
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: i64) -> Result<Value> {
        match self {
            Value::Tensor(l) => Ok(Value::Tensor(l.cross_entropy(targets, ignore_index)?)),
            Value::DTensor(l) => {
                let rep = vec![Placement::Replicate; l.mesh().ndim()];
                let t = DTensor::from_local(targets, l.mesh(), &rep, Some(targets.dims()))?;
                Ok(Value::DTensor(l.cross_entropy(&t, ignore_index)?))
            }
            other => Err(not_a_tensor("cross_entropy", other)),
        }
    }

    /// Backpropagates this scalar loss, plain or distributed: `loss.backward()`.
    ///
    /// A DTensor loss seeds its own placements ([`DTensor::backward_full_seed`]: the
    /// gradients of [`DTensor::backward`], with a replicated loss's seed held in full). A plain loss is
    /// plain autograd, except inside a [`replicated_loss_scope`] (what
    /// `loss_parallel::enable` opens): there the loss is taken as the same value on every
    /// rank of the scope's mesh (`Replicate`), so the ranks' gradient contributions add
    /// up to one gradient however many ranks computed it.
    pub fn backward(&self) -> Result<()> {
        if let Value::DTensor(d) = self {
            return Ok(d.backward_full_seed()?);
        }
        let (root, seed) = self.backward_seed()?;
        Ok(root.backward_with(&seed)?)
    }

    /// The local tensor [`backward`](Self::backward) starts from and the gradient it seeds
    /// it with (ones for a plain loss; a DTensor's [`DTensor::backward_seed`]; inside a
    /// [`replicated_loss_scope`], a plain loss's seed as a `Replicate` DTensor over the
    /// scope's mesh). A pipeline schedule runs the backward from these itself.
    pub fn backward_seed(&self) -> Result<(Tensor, Tensor)> {
        let one = |t: &Tensor| -> Result<Tensor> {
            if t.numel() != 1 {
                return Err(tpar_tensor::TensorError::Autograd(format!(
                    "backward() needs a one-element output, got shape {}; use backward_with",
                    t.shape()
                ))
                .into());
            }
            Ok(Tensor::full(t.shape().clone(), 1.0, t.dtype(), t.device())?)
        };
        match self {
            Value::DTensor(d) => Ok((d.local().clone(), d.backward_seed()?)),
            Value::Tensor(t) => match REPLICATED_LOSS_MESH.with(|m| m.borrow().last().cloned()) {
                Some(mesh) => {
                    let rep = vec![Placement::Replicate; mesh.ndim()];
                    let d = DTensor::from_local(t, &mesh, &rep, Some(t.dims()))?;
                    Ok((t.clone(), d.backward_seed()?))
                }
                None => Ok((t.clone(), one(t)?)),
            },
            other => Err(not_a_tensor("backward", other)),
        }
    }

    /// The value of a one-element tensor, plain or distributed (a DTensor is made full
    /// first, which communicates unless it is replicated on every mesh dim).
    pub fn item(&self) -> Result<f64> {
        match self {
            Value::Tensor(t) => Ok(t.item()?),
            Value::DTensor(d) => Ok(d.full_tensor()?.item()?),
            other => Err(not_a_tensor("item", other)),
        }
    }

    /// Downcasts an opaque value.
    pub fn opaque<T: Any + Send + Sync>(&self, who: &str) -> Result<Arc<T>> {
        match self {
            Value::Opaque(a) => a.clone().downcast::<T>().map_err(|_| NnError::BadInput {
                module: who.to_string(),
                what: format!("opaque input is not a {}", std::any::type_name::<T>()),
            }),
            other => Err(NnError::BadInput {
                module: who.to_string(),
                what: format!("expected an opaque value, got {other:?}"),
            }),
        }
    }
}

thread_local! {
    /// The meshes of the open [`replicated_loss_scope`]s on this thread, innermost last.
    static REPLICATED_LOSS_MESH: RefCell<Vec<DeviceMesh>> = const { RefCell::new(Vec::new()) };
}

/// While the returned guard lives, [`Value::backward`] on this thread takes a plain loss
/// as replicated over `mesh` (seeded once per mesh, not once per rank). Scopes nest; the
/// innermost wins. Ranks as threads each open their own.
pub fn replicated_loss_scope(mesh: &DeviceMesh) -> ReplicatedLossScope {
    REPLICATED_LOSS_MESH.with(|m| m.borrow_mut().push(mesh.clone()));
    ReplicatedLossScope { _not_send: std::marker::PhantomData }
}

/// Closes a [`replicated_loss_scope`] when dropped.
#[must_use = "the scope ends when this guard is dropped"]
pub struct ReplicatedLossScope {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for ReplicatedLossScope {
    fn drop(&mut self) {
        REPLICATED_LOSS_MESH.with(|m| {
            m.borrow_mut().pop();
        });
    }
}

/// The inputs of a module call: positional values and named (keyword-like) values.
#[derive(Clone, Debug, Default)]
pub struct Args {
    /// Positional inputs.
    pub pos: Vec<Value>,
    /// Named inputs.
    pub named: BTreeMap<String, Value>,
}

impl Args {
    /// Positional inputs only.
    pub fn new(pos: Vec<Value>) -> Args {
        Args { pos, named: BTreeMap::new() }
    }

    /// One positional input.
    pub fn one(v: impl Into<Value>) -> Args {
        Args::new(vec![v.into()])
    }

    /// Adds a named input.
    pub fn with(mut self, name: &str, v: impl Into<Value>) -> Args {
        self.named.insert(name.to_string(), v.into());
        self
    }

    /// Positional input `i`, or `Value::None`.
    pub fn get(&self, i: usize) -> Value {
        self.pos.get(i).cloned().unwrap_or(Value::None)
    }

    /// Named input, or `Value::None`.
    pub fn get_named(&self, name: &str) -> Value {
        self.named.get(name).cloned().unwrap_or(Value::None)
    }
}
