//! State dicts of the optimizers and the scheduler, keyed by parameter FQN as
//! `torch.distributed.checkpoint` flattens them: `state.<fqn>.exp_avg`,
//! `state.<fqn>.exp_avg_sq`, `state.<fqn>.step`, `param_groups.lr`, ...
//!
//! Per-parameter tensors are laid out like the parameter's local tensor on this rank (a
//! chunk of the full parameter's shape), so a checkpoint saved under one mesh, plan
//! and data-parallel mode loads under another. A parameter that has not stepped yet
//! saves zero moments and step 0, which loads back as no state.

use std::collections::HashMap;

use tpar_nn::state::{into_state_err as state_err, like_param, value_for_param};
use tpar_nn::{Param, StateDict, StateDictError, StateValue, Stateful};
use tpar_tensor::state::{
    expect_empty, flat_range_boxes, take, take_float, take_int, ShardedTensor,
};
use tpar_tensor::{DType, Device, Tensor};

use crate::ZeroRedundancyOptimizer;
use crate::{AdamW, AdamWConfig, AdamWState, LrSchedule, LrScheduler, Optimizer, Sgd, SgdConfig};

type SResult<T> = std::result::Result<T, StateDictError>;

/// `t` laid out like `p`'s local tensor, as the state dict holds it.
fn param_value(p: &Param, t: Tensor) -> SResult<StateValue> {
    Ok(match p {
        Param::Tensor(_) => StateValue::Tensor(t),
        _ => StateValue::Sharded(like_param(p, &t).map_err(state_err)?),
    })
}

/// The precision an optimizer keeps `p`'s state in (f64 for f64 parameters, else f32).
fn state_dtype(p: &Param) -> DType {
    if p.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Zeros shaped like `p`'s local tensor in its state precision (on the host; loading
/// moves state to the parameter's device).
fn zeros_like_state(p: &Param) -> SResult<Tensor> {
    Ok(Tensor::zeros(p.trainable().dims(), state_dtype(p), Device::Cpu)?)
}

/// The per-parameter tensor `state.<name>.<field>` for `p`, in `p`'s state precision.
fn take_param_tensor(state: &mut StateDict, name: &str, field: &str, p: &Param) -> SResult<Tensor> {
    let key = format!("state.{name}.{field}");
    let t = value_for_param(&key, take(state, &key)?, p).map_err(state_err)?;
    let want = state_dtype(p);
    if t.dtype() != want {
        return Err(StateDictError::DType { key, expected: want, got: t.dtype() });
    }
    Ok(t)
}

/// A loaded hyper-parameter the optimizer refuses.
fn invalid_groups(e: tpar_nn::NnError) -> StateDictError {
    StateDictError::Invalid { key: "param_groups".into(), what: e.to_string() }
}

fn non_negative_int(state: &mut StateDict, key: &str) -> SResult<u64> {
    let v = take_int(state, key)?;
    u64::try_from(v).map_err(|_| StateDictError::Invalid {
        key: key.to_string(),
        what: format!("{v} is negative"),
    })
}

impl Stateful for AdamW {
    fn state_dict(&self) -> SResult<StateDict> {
        let c = self.config();
        let mut sd = StateDict::from([
            ("param_groups.lr".to_string(), StateValue::Float(c.lr)),
            ("param_groups.beta1".to_string(), StateValue::Float(c.betas.0)),
            ("param_groups.beta2".to_string(), StateValue::Float(c.betas.1)),
            ("param_groups.eps".to_string(), StateValue::Float(c.eps)),
            ("param_groups.weight_decay".to_string(), StateValue::Float(c.weight_decay)),
        ]);
        for (i, (name, p)) in self.params().iter().enumerate() {
            let (step, m, v) = match self.state(i).map_err(state_err)? {
                Some(s) => (
                    s.step,
                    s.exp_avg.to_device(Device::Cpu)?,
                    s.exp_avg_sq.to_device(Device::Cpu)?,
                ),
                None => (0, zeros_like_state(p)?, zeros_like_state(p)?),
            };
            sd.insert(format!("state.{name}.step"), StateValue::Int(step as i64));
            sd.insert(format!("state.{name}.exp_avg"), param_value(p, m)?);
            sd.insert(format!("state.{name}.exp_avg_sq"), param_value(p, v)?);
        }
        Ok(sd)
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> SResult<()> {
        let config = AdamWConfig {
            lr: take_float(&mut state, "param_groups.lr")?,
            betas: (
                take_float(&mut state, "param_groups.beta1")?,
                take_float(&mut state, "param_groups.beta2")?,
            ),
            eps: take_float(&mut state, "param_groups.eps")?,
            weight_decay: take_float(&mut state, "param_groups.weight_decay")?,
        };
        config.check().map_err(invalid_groups)?;
        let mut loaded = Vec::with_capacity(self.params().len());
        for (name, p) in self.params() {
            let step = non_negative_int(&mut state, &format!("state.{name}.step"))?;
            let m = take_param_tensor(&mut state, name, "exp_avg", p)?;
            let v = take_param_tensor(&mut state, name, "exp_avg_sq", p)?;
            loaded.push((step > 0).then_some(AdamWState { step, exp_avg: m, exp_avg_sq: v }));
        }
        expect_empty(state)?;
        self.set_config(config);
        for (i, s) in loaded.into_iter().enumerate() {
            match s {
                Some(s) => self.set_state(i, s).map_err(state_err)?,
                None => self.clear_state(i),
            }
        }
        Ok(())
    }
}

impl Stateful for Sgd {
    fn state_dict(&self) -> SResult<StateDict> {
        let c = self.config();
        let mut sd = StateDict::from([
            ("param_groups.lr".to_string(), StateValue::Float(c.lr)),
            ("param_groups.momentum".to_string(), StateValue::Float(c.momentum)),
            ("param_groups.dampening".to_string(), StateValue::Float(c.dampening)),
            ("param_groups.weight_decay".to_string(), StateValue::Float(c.weight_decay)),
            ("param_groups.nesterov".to_string(), StateValue::Int(c.nesterov as i64)),
        ]);
        for (i, (name, p)) in self.params().iter().enumerate() {
            let (has, b) = match self.momentum_buffer(i).map_err(state_err)? {
                Some(b) => (1, b.to_device(Device::Cpu)?),
                None => (0, zeros_like_state(p)?),
            };
            sd.insert(format!("state.{name}.has_momentum_buffer"), StateValue::Int(has));
            sd.insert(format!("state.{name}.momentum_buffer"), param_value(p, b)?);
        }
        Ok(sd)
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> SResult<()> {
        let config = SgdConfig {
            lr: take_float(&mut state, "param_groups.lr")?,
            momentum: take_float(&mut state, "param_groups.momentum")?,
            dampening: take_float(&mut state, "param_groups.dampening")?,
            weight_decay: take_float(&mut state, "param_groups.weight_decay")?,
            nesterov: take_int(&mut state, "param_groups.nesterov")? != 0,
        };
        config.check().map_err(invalid_groups)?;
        let mut loaded = Vec::with_capacity(self.params().len());
        for (name, p) in self.params() {
            let has = take_int(&mut state, &format!("state.{name}.has_momentum_buffer"))? != 0;
            let b = take_param_tensor(&mut state, name, "momentum_buffer", p)?;
            loaded.push(has.then_some(b));
        }
        expect_empty(state)?;
        self.set_config(config);
        for (i, b) in loaded.into_iter().enumerate() {
            self.set_momentum_buffer(i, b).map_err(state_err)?;
        }
        Ok(())
    }
}

/// The scheduler's position (`last_step`, `base_lr`, `last_lr`) and, as `schedule`, the
/// schedule itself as text (its `Debug` form: every parameter, floats exactly). Loading
/// refuses a checkpoint of another schedule, naming both, unless
/// [`LrScheduler::override_on_load`] was called (then only the step is taken).
impl<S: LrSchedule> Stateful for LrScheduler<S> {
    fn state_dict(&self) -> SResult<StateDict> {
        Ok(StateDict::from([
            ("last_step".to_string(), StateValue::Int(self.last_step() as i64)),
            ("base_lr".to_string(), StateValue::Float(self.base_lr())),
            ("last_lr".to_string(), StateValue::Float(self.last_lr())),
            ("schedule".to_string(), StateValue::Text(format!("{:?}", self.schedule()))),
        ]))
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> SResult<()> {
        let last_step = non_negative_int(&mut state, "last_step")? as usize;
        let base_lr = take_float(&mut state, "base_lr")?;
        let last_lr = take_float(&mut state, "last_lr")?;
        let saved = match state.remove("schedule") {
            Some(StateValue::Text(t)) => t,
            Some(v) => {
                return Err(StateDictError::Kind {
                    key: "schedule".into(),
                    expected: "text",
                    got: v.kind(),
                })
            }
            None => return Err(StateDictError::Missing { keys: vec!["schedule".into()] }),
        };
        expect_empty(state)?;
        if self.overrides_on_load() {
            self.restore_step(last_step);
            return Ok(());
        }
        let mine = format!("{:?}", self.schedule());
        if saved != mine {
            return Err(StateDictError::Invalid {
                key: "schedule".into(),
                what: format!(
                    "the checkpoint was saved with {saved}, this run has {mine}: resuming would \
                     follow neither (override_on_load takes this run's schedule on purpose)"
                ),
            });
        }
        self.restore(last_step, base_lr, last_lr);
        Ok(())
    }
}

/// One shard leaf of a ZeRO optimizer: its inner name, the parameter it belongs to and
/// its range of the flattened (local) parameter.
struct Leaf {
    name: String,
    param: usize,
    start: usize,
    len: usize,
}

impl<O: Optimizer> ZeroRedundancyOptimizer<O> {
    fn leaves(&self) -> Vec<Leaf> {
        (0..self.params().len())
            .filter_map(|i| {
                let (start, len) = self.shard_range(i)?;
                let name = format!("{}[{start}..{}]", self.params()[i].0, start + len);
                Some(Leaf { name, param: i, start, len })
            })
            .collect()
    }
}

/// The flat range `start..start + len` of `p`'s local tensor held in `flat`, as chunks
/// of the full parameter.
fn flat_to_sharded(p: &Param, flat: &Tensor, start: usize, len: usize) -> SResult<ShardedTensor> {
    let (shape, offsets) = tpar_nn::state::param_box(p).map_err(state_err)?;
    let dims = p.trainable().dims().to_vec();
    let flat = flat.reshape([len])?;
    let mut chunks = Vec::new();
    let mut pos = 0;
    for (o, z) in flat_range_boxes(&dims, start, len) {
        let n: usize = z.iter().product();
        let piece = flat.narrow(0, pos, n)?.reshape(z.clone())?;
        pos += n;
        let o: Vec<usize> = o.iter().zip(&offsets).map(|(a, b)| a + b).collect();
        chunks.push((o, piece));
    }
    ShardedTensor::new(shape, flat.dtype(), chunks)
}

/// The inverse of [`flat_to_sharded`]: this rank's flat range of `p` from `value` (the
/// same chunks, or a whole tensor / this rank's whole box).
fn sharded_to_flat(
    key: &str,
    value: StateValue,
    p: &Param,
    start: usize,
    len: usize,
) -> SResult<Tensor> {
    let dims = p.trainable().dims().to_vec();
    if let StateValue::Sharded(s) = &value {
        let (_, offsets) = tpar_nn::state::param_box(p).map_err(state_err)?;
        let boxes = flat_range_boxes(&dims, start, len);
        let chunks = s.chunks();
        let same = chunks.len() == boxes.len()
            && chunks.iter().zip(&boxes).all(|(c, (o, z))| {
                c.tensor.dims() == z.as_slice()
                    && c.offsets.iter().zip(o).zip(&offsets).all(|((c, o), b)| *c == o + b)
            });
        if same {
            let parts: Vec<Tensor> = chunks
                .iter()
                .map(|c| c.tensor.reshape([c.tensor.numel()]))
                .collect::<Result<_, _>>()?;
            return Ok(if parts.is_empty() {
                Tensor::zeros([0], s.dtype(), Device::Cpu)?
            } else {
                Tensor::cat(&parts, 0)?
            });
        }
    }
    let local = value_for_param(key, value, p).map_err(state_err)?;
    Ok(local.reshape([local.numel()])?.narrow(0, start, len)?)
}

/// ZeRO-1's state dict: the inner optimizer's hyper-parameters and scalars as they are,
/// and every per-parameter tensor as the chunks of the full parameter this rank's
/// ranges cover (several boxes where a range cuts rows), keyed by the parameter's FQN:
/// the same keys a plain optimizer over the same parameters has, so a checkpoint moves
/// between ZeRO-1, DDP and FSDP.
impl<O: Optimizer + Stateful> Stateful for ZeroRedundancyOptimizer<O> {
    fn state_dict(&self) -> SResult<StateDict> {
        let mut inner = self.inner().state_dict()?;
        let mut out = StateDict::new();
        for leaf in self.leaves() {
            let (fqn, p) = &self.params()[leaf.param];
            let prefix = format!("state.{}.", leaf.name);
            let keys: Vec<String> =
                inner.keys().filter(|k| k.starts_with(&prefix)).cloned().collect();
            for k in keys {
                let field = &k[prefix.len()..];
                let v = match inner.remove(&k).expect("key listed above") {
                    StateValue::Tensor(t) => {
                        StateValue::Sharded(flat_to_sharded(p, &t, leaf.start, leaf.len)?)
                    }
                    other => other,
                };
                out.insert(format!("state.{fqn}.{field}"), v);
            }
        }
        out.extend(inner);
        Ok(out)
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> SResult<()> {
        let mut inner = StateDict::new();
        let mut by_fqn: HashMap<String, Vec<&Leaf>> = HashMap::new();
        let leaves = self.leaves();
        for leaf in &leaves {
            by_fqn.entry(self.params()[leaf.param].0.clone()).or_default().push(leaf);
        }
        for (fqn, leaves) in &by_fqn {
            let prefix = format!("state.{fqn}.");
            let keys: Vec<String> =
                state.keys().filter(|k| k.starts_with(&prefix)).cloned().collect();
            for k in keys {
                let field = k[prefix.len()..].to_string();
                let v = state.remove(&k).expect("key listed above");
                for leaf in leaves {
                    let p = &self.params()[leaf.param].1;
                    let v = match &v {
                        StateValue::Tensor(_) | StateValue::Sharded(_) => StateValue::Tensor(
                            sharded_to_flat(&k, v.clone(), p, leaf.start, leaf.len)?,
                        ),
                        other => other.clone(),
                    };
                    inner.insert(format!("state.{}.{field}", leaf.name), v);
                }
            }
        }
        // Parameters this rank holds no range of: their state belongs to other ranks.
        let foreign: Vec<String> = self
            .params()
            .iter()
            .filter(|(fqn, _)| !by_fqn.contains_key(fqn))
            .map(|(fqn, _)| format!("state.{fqn}."))
            .collect();
        state.retain(|k, _| !foreign.iter().any(|f| k.starts_with(f)));
        inner.extend(state);
        self.inner_mut().load_state_dict(inner)
    }
}
