//! What flows between modules: plain tensors, distributed tensors, or opaque values
//! (RoPE tables, masks) that parallel styles pass through untouched.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use tpar_dtensor::DTensor;
use tpar_tensor::Tensor;

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
