//! A module's state dict: every parameter by FQN, as the chunk of the full parameter
//! this rank holds, whatever made it (a plain tensor, a tensor-parallel DTensor, an FSDP
//! shard, or both), so a checkpoint can reshard it on load.

use tpar_placements::local_shape_and_offset;
pub use tpar_tensor::state::{ShardedTensor, StateDict, StateDictError, StateValue, Stateful};
use tpar_tensor::{no_grad, Tensor};

use crate::module::{join, visit_modules_mut};
use crate::{named_parameters, Module, NnError, Param, Result};

/// Where this rank's [`Param::trainable`] tensor sits in the full parameter: the full
/// parameter's shape and the offsets of the box this rank holds (its size is the
/// trainable tensor's shape). A plain tensor is the whole box; a DTensor's box (an FSDP
/// parameter's too) follows its placements on its mesh.
pub fn param_box(p: &Param) -> Result<(Vec<usize>, Vec<usize>)> {
    let box_of =
        |spec_shape: &[usize], mesh: &tpar_mesh::DeviceMesh, pl: &[tpar_placements::Placement]| {
            local_shape_and_offset(spec_shape, mesh.shape(), mesh.coordinate(), pl)
                .map_err(|e| NnError::Config { what: format!("layout of a parameter: {e}") })
        };
    Ok(match p {
        Param::Tensor(t) => (t.dims().to_vec(), vec![0; t.rank()]),
        Param::DTensor(d) => {
            let (_, off) = box_of(d.shape(), d.mesh(), d.placements())?;
            (d.shape().to_vec(), off)
        }
    })
}

/// `t`, laid out like this rank's trainable tensor of `p` (same shape), as a sharded
/// tensor of the full parameter's shape (the layout an optimizer's per-parameter state
/// shares with its parameter).
pub fn like_param(p: &Param, t: &Tensor) -> Result<ShardedTensor> {
    let (shape, offsets) = param_box(p)?;
    Ok(ShardedTensor::new(shape, t.dtype(), vec![(offsets, t.clone())])?)
}

/// The module's state dict: every parameter by FQN, detached (sharing storage with the
/// live parameter), as a [`StateValue::Tensor`] for a plain parameter and a
/// [`StateValue::Sharded`] chunk of the full parameter for a DTensor or FSDP one.
/// (Buffers computed from the configuration, such as RoPE tables, are not state.)
pub fn state_dict(m: &dyn Module) -> Result<StateDict> {
    let mut out = StateDict::new();
    for (name, p) in named_parameters(m) {
        let local = p.trainable().detach();
        let value = match &p {
            Param::Tensor(_) => StateValue::Tensor(local),
            _ => StateValue::Sharded(like_param(&p, &local)?),
        };
        out.insert(name, value);
    }
    Ok(out)
}

/// This rank's box of `value` for a parameter whose box is `offsets` + `sizes` in a
/// full tensor of `shape`: a slice of a whole tensor, or the chunk at exactly that box.
fn box_of_value(
    key: &str,
    value: StateValue,
    shape: &[usize],
    offsets: &[usize],
    sizes: &[usize],
) -> std::result::Result<Tensor, StateDictError> {
    let (got_shape, _) = value.tensor_meta().ok_or_else(|| StateDictError::Kind {
        key: key.to_string(),
        expected: "tensor",
        got: value.kind(),
    })?;
    if got_shape != shape {
        return Err(StateDictError::Shape {
            key: key.to_string(),
            expected: shape.to_vec(),
            got: got_shape,
        });
    }
    match value {
        StateValue::Tensor(t) => {
            let mut t = t;
            for d in 0..shape.len() {
                if sizes[d] != shape[d] {
                    t = t.narrow(d as isize, offsets[d], sizes[d])?;
                }
            }
            Ok(t)
        }
        StateValue::Sharded(s) => s
            .into_chunks()
            .into_iter()
            .find(|c| c.offsets == offsets && c.tensor.dims() == sizes)
            .map(|c| c.tensor)
            .ok_or_else(|| StateDictError::Chunk {
                key: key.to_string(),
                what: format!(
                    "no chunk at offsets {offsets:?} of size {sizes:?}, which this rank holds \
                     (load through the checkpoint to reshard)"
                ),
            }),
        _ => unreachable!("tensor_meta is Some only for tensors"),
    }
}

/// The part of `value` (a whole tensor, or a sharded tensor holding exactly this rank's
/// box) that `p`'s [`Param::trainable`] tensor holds on this rank: what an optimizer
/// loads its per-parameter state from.
///
/// # Errors
/// [`StateDictError::Kind`], [`StateDictError::Shape`] or [`StateDictError::Chunk`]
/// naming `key` when the value does not fit.
pub fn value_for_param(key: &str, value: StateValue, p: &Param) -> Result<Tensor> {
    let (shape, offsets) = param_box(p)?;
    Ok(box_of_value(key, value, &shape, &offsets, p.trainable().dims())?)
}

/// Loads `state` into the module's parameters (`load_state_dict(state, strict)`): each
/// value may be the whole parameter (this rank copies its box out of it) or a sharded
/// tensor holding exactly this rank's box. Values are copied into the live parameters
/// without recording autograd; FSDP parameters drop any gathered copy.
///
/// # Errors
/// With `strict`, [`StateDictError::Missing`] / [`StateDictError::Unexpected`] naming
/// every missing and unexpected key (nothing is loaded then); always
/// [`StateDictError::Shape`], [`StateDictError::DType`] and [`StateDictError::Kind`]
/// for a value that does not fit its parameter (checked for every key before any is
/// copied).
pub fn load_state_dict(m: &mut dyn Module, mut state: StateDict, strict: bool) -> Result<()> {
    let params = named_parameters(m);
    let missing: Vec<String> =
        params.iter().filter(|(n, _)| !state.contains_key(n)).map(|(n, _)| n.clone()).collect();
    if strict && !missing.is_empty() {
        return Err(StateDictError::Missing { keys: missing }.into());
    }
    if strict {
        let unexpected: Vec<String> =
            state.keys().filter(|k| !params.iter().any(|(n, _)| n == *k)).cloned().collect();
        if !unexpected.is_empty() {
            return Err(StateDictError::Unexpected { keys: unexpected }.into());
        }
    }
    // Check every value first, so a bad key loads nothing.
    let mut plan = Vec::new();
    for (name, p) in &params {
        let Some(value) = state.remove(name) else { continue };
        let (shape, offsets) = param_box(p)?;
        let local = p.trainable();
        let src = box_of_value(name, value, &shape, &offsets, local.dims())?;
        if src.dtype() != local.dtype() {
            return Err(StateDictError::DType {
                key: name.clone(),
                expected: local.dtype(),
                got: src.dtype(),
            }
            .into());
        }
        plan.push((name.clone(), src.to_device(local.device())?));
    }
    let mut plan: std::collections::HashMap<String, Tensor> = plan.into_iter().collect();
    visit_modules_mut(m, "", &mut |prefix, module| {
        for slot in module.param_slots() {
            let Some(src) = plan.remove(&join(prefix, slot.name)) else { continue };
            no_grad(|| slot.param.trainable().copy_(&src))?;
            if let Some(u) = slot.param.unsharder()? {
                u.invalidate()?;
            }
        }
        Ok(())
    })
}

/// A module as a [`Stateful`] item of a checkpoint (PyTorch's checkpointing takes the
/// module itself): its [`state_dict`], loaded back with [`load_state_dict`].
pub struct ModuleState<'a> {
    module: &'a mut dyn Module,
    strict: bool,
}

impl<'a> ModuleState<'a> {
    /// `module`, loaded strictly (every parameter must be in the state, nothing else).
    pub fn new(module: &'a mut dyn Module) -> ModuleState<'a> {
        ModuleState { module, strict: true }
    }

    /// Whether missing and unexpected keys are errors on load (default `true`).
    pub fn strict(mut self, strict: bool) -> ModuleState<'a> {
        self.strict = strict;
        self
    }
}

impl Stateful for ModuleState<'_> {
    fn state_dict(&self) -> std::result::Result<StateDict, StateDictError> {
        state_dict(self.module).map_err(into_state_err)
    }

    fn load_state_dict(&mut self, state: StateDict) -> std::result::Result<(), StateDictError> {
        load_state_dict(self.module, state, self.strict).map_err(into_state_err)
    }
}

/// A module error as a state dict error (state dict and tensor errors keep their type).
pub fn into_state_err(e: NnError) -> StateDictError {
    match e {
        NnError::State(s) => s,
        NnError::Tensor(t) => StateDictError::Tensor(t),
        other => StateDictError::Other(other.to_string()),
    }
}
