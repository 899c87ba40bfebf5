//! AdamW (`torch.optim.AdamW`): decoupled weight decay, bias-corrected moments.

use std::sync::Arc;

use tpar_nn::Unshard;

use super::*;

// ---------------------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------------------

/// Hyper-parameters of [`AdamW`]; the defaults are `torch.optim.AdamW`'s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the first and second moments (default (0.9, 0.999)).
    pub betas: (f64, f64),
    /// Term added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 1e-2).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 1e-2 }
    }
}

impl AdamWConfig {
    pub(crate) fn check(&self) -> Result<()> {
        let (b1, b2) = self.betas;
        if !non_negative(self.lr) {
            return Err(config_err(format!("AdamW: invalid learning rate {}", self.lr)));
        }
        if !non_negative(self.eps) {
            return Err(config_err(format!("AdamW: invalid eps {}", self.eps)));
        }
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return Err(config_err(format!("AdamW: betas ({b1}, {b2}) must lie in [0, 1)")));
        }
        if !non_negative(self.weight_decay) {
            return Err(config_err(format!("AdamW: invalid weight_decay {}", self.weight_decay)));
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
struct AdamWSlot {
    step: u64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// One parameter's AdamW state, laid out like its local shard ([`Param::trainable`]), in
/// the state precision (f32, or f64 for f64 parameters).
#[derive(Clone, Debug)]
pub struct AdamWState {
    /// Steps taken (the first step is 1).
    pub step: u64,
    /// First moment.
    pub exp_avg: Tensor,
    /// Second moment.
    pub exp_avg_sq: Tensor,
}

/// `torch.optim.AdamW` (not amsgrad, not maximize) over one parameter group:
///
/// ```text
/// step += 1
/// p    *= 1 - lr * weight_decay
/// m     = beta1 * m + (1 - beta1) * g
/// v     = beta2 * v + (1 - beta2) * g^2
/// p    -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
/// ```
///
/// Every rank steps its own local shard with its reduced local gradient, so state is
/// sharded exactly like the parameter; parameters without a gradient are skipped (their
/// step count does not advance). State is allocated lazily on a parameter's first step,
/// in f32 for f32/bf16/f16 parameters and f64 for f64 ones. There is no separate master
/// copy: the weights are updated in the parameter's own dtype (for f32 master weights
/// with bf16 compute use FSDP's mixed precision, which keeps f32 shards). Under FSDP
/// mixed precision the step also writes each shard's compute-dtype working copy in the
/// same pass ([`tpar_nn::Unshard::working_copy`]), which the next gathers send instead of
/// casting the shard again.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<(String, Param)>,
    config: AdamWConfig,
    state: Vec<Option<AdamWSlot>>,
    capturable: Capturable,
}

/// The capturable mode's state: the device coefficients and what the captured step
/// covers.
#[derive(Debug, Default)]
struct Capturable {
    on: bool,
    /// The step's coefficients on the parameters' device (8 f32).
    coef: Option<Tensor>,
    /// The parameters the captured step updates.
    captured: Vec<usize>,
}

impl AdamW {
    /// AdamW over `params` (named `"0"`, `"1"`, ... in errors and state).
    pub fn new(params: Vec<Param>, config: AdamWConfig) -> Result<AdamW> {
        AdamW::with_names(numbered(params), config)
    }

    /// AdamW over named parameters (e.g. from [`tpar_nn::named_parameters`]).
    pub fn with_names(params: Vec<(String, Param)>, config: AdamWConfig) -> Result<AdamW> {
        config.check()?;
        check_not_retired("AdamW", &params)?;
        let state = vec![None; params.len()];
        Ok(AdamW { params, config, state, capturable: Capturable::default() })
    }

    /// The hyper-parameters (with the current learning rate).
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The parameters, with their names.
    pub fn params(&self) -> &[(String, Param)] {
        &self.params
    }

    /// The state of parameter `index` (a copy), `None` before its first step.
    pub fn state(&self, index: usize) -> Result<Option<AdamWState>> {
        let (Some(Some(s)), Some((_, p))) = (self.state.get(index), self.params.get(index)) else {
            return Ok(None);
        };
        let dims = p.trainable().dims().to_vec();
        Ok(Some(AdamWState {
            step: s.step,
            exp_avg: state_copy(&s.exp_avg, &dims)?,
            exp_avg_sq: state_copy(&s.exp_avg_sq, &dims)?,
        }))
    }

    /// Replaces the hyper-parameters (e.g. from a checkpoint).
    pub fn set_config(&mut self, config: AdamWConfig) {
        self.config = config;
    }

    /// Drops the state of parameter `index`, as before its first step.
    pub fn clear_state(&mut self, index: usize) {
        if let Some(s) = self.state.get_mut(index) {
            *s = None;
        }
    }

    /// Replaces the state of parameter `index` (e.g. from a checkpoint); the tensors must
    /// have the parameter's local shape.
    pub fn set_state(&mut self, index: usize, state: AdamWState) -> Result<()> {
        let Some((name, p)) = self.params.get(index) else {
            return Err(config_err(format!(
                "AdamW::set_state: index {index} out of range for {} parameters",
                self.params.len()
            )));
        };
        let leaf = p.trainable();
        for (what, t) in [("exp_avg", &state.exp_avg), ("exp_avg_sq", &state.exp_avg_sq)] {
            if t.dims() != leaf.dims() {
                return Err(bad_param(
                    "AdamW",
                    name,
                    format!("{what} of shape {:?} for a local shard {:?}", t.dims(), leaf.dims()),
                ));
            }
        }
        self.state[index] = Some(AdamWSlot {
            step: state.step,
            exp_avg: state_from(&state.exp_avg, &leaf)?,
            exp_avg_sq: state_from(&state.exp_avg_sq, &leaf)?,
        });
        Ok(())
    }

    /// Capturable steps (PyTorch's `AdamW(capturable=True)`), for parameters on one CUDA
    /// device: the kernels read the step's coefficients (learning rate, bias corrections,
    /// folded on the host as always) from a small buffer on the device, so a CUDA graph
    /// that captured [`Optimizer::step`] stays right when replayed at later steps with
    /// another learning rate.
    ///
    /// An eager step writes the coefficients there (one host-to-device copy) and
    /// launches the kernels; a step issued while the device captures a graph launches
    /// them only, and leaves the step counts alone: before each replay of that graph,
    /// [`AdamW::prepare_replay`] advances them and writes the coefficients. Writing them
    /// from the host, rather than computing the bias corrections on the device from a
    /// device step counter as PyTorch does, keeps the steps bit for bit the
    /// non-capturable ones (the same f64 folding) and takes the learning rate schedule
    /// from the host as before. Every parameter's state must exist before a capture (take
    /// one eager step first), and all parameters must be at the same step count.
    pub fn set_capturable(&mut self, on: bool) {
        self.capturable.on = on;
        if !on {
            self.capturable = Capturable::default();
        }
    }

    /// Before a replay of a graph that captured [`Optimizer::step`] in capturable mode:
    /// the step counts of the parameters the captured step updates advance by one, and
    /// that step's coefficients (at the current learning rate) are written to the device.
    pub fn prepare_replay(&mut self) -> Result<()> {
        let idx = self.capturable.captured.clone();
        let Some(&first) = idx.first() else {
            return Err(config_err("AdamW: no captured step to replay"));
        };
        let step = self.state[first].as_ref().map_or(0, |s| s.step) + 1;
        for &i in &idx {
            let s = self.state[i].as_mut().ok_or_else(|| {
                config_err(format!("AdamW: parameter {} lost its state", self.params[i].0))
            })?;
            s.step = step;
        }
        self.write_coefficients(step)
    }

    /// The step's hyper-parameters at step `step`.
    fn hyper(&self, step: u64) -> AdamWParams {
        AdamWParams {
            lr: self.config.lr,
            beta1: self.config.betas.0,
            beta2: self.config.betas.1,
            eps: self.config.eps,
            weight_decay: self.config.weight_decay,
            step,
        }
    }

    /// Writes step `step`'s coefficients into the device buffer (which must exist).
    fn write_coefficients(&self, step: u64) -> Result<()> {
        let Some(coef) = &self.capturable.coef else {
            return Err(config_err("AdamW: no device coefficients (no capturable step yet)"));
        };
        let host =
            Tensor::from_vec(tpar_tensor::adamw_coefficients(&self.hyper(step)).to_vec(), [8])?;
        tpar_tensor::gpu::write_from_host(coef, &host)?;
        Ok(())
    }

    /// A capturable step of `items` (see [`AdamW::set_capturable`]).
    fn step_capturable(&mut self, items: Vec<StepItem>) -> Result<()> {
        let Some(first) = items.first() else { return Ok(()) };
        let device = first.leaf.device();
        let Device::Cuda(ordinal) = device else {
            return Err(config_err(format!(
                "AdamW (capturable): parameter {} is on {device}; capturable steps run on a \
                 CUDA device",
                self.params[first.index].0
            )));
        };
        let step = first.step;
        for d in &items {
            if d.leaf.device() != device || d.step != step {
                return Err(config_err(format!(
                    "AdamW (capturable): parameter {} is at step {} on {}, parameter {} at \
                     step {step} on {device}; a capturable step needs one device and one \
                     step count",
                    self.params[d.index].0,
                    d.step - 1,
                    d.leaf.device(),
                    self.params[first.index].0
                )));
            }
        }
        let capturing = tpar_tensor::gpu::is_capturing(ordinal);
        if !capturing {
            if self.capturable.coef.is_none() {
                self.capturable.coef = Some(Tensor::zeros([8], DType::F32, device)?);
            }
            self.write_coefficients(step)?;
        }
        let Some(coef) = self.capturable.coef.clone() else {
            return Err(config_err(
                "AdamW (capturable): a step captured before any eager capturable step (take \
                 one first: it creates the state and the device coefficients)",
            ));
        };
        let list = |f: fn(&StepItem) -> &Tensor| items.iter().map(f).collect::<Vec<_>>();
        let copies: Vec<Option<&Tensor>> = items.iter().map(|d| d.copy.as_ref()).collect();
        Tensor::adamw_step_each_capturable_(
            &list(|d| &d.leaf),
            &list(|d| &d.grad),
            &list(|d| &d.exp_avg),
            &list(|d| &d.exp_avg_sq),
            &copies,
            &coef,
        )?;
        for d in &items {
            if !capturing {
                if let Some(s) = &mut self.state[d.index] {
                    s.step = d.step;
                }
            }
            if let Some(u) = &d.unshard {
                u.stepped(d.copy.is_some())?;
            }
        }
        if capturing {
            self.capturable.captured = items.iter().map(|d| d.index).collect();
        }
        Ok(())
    }

    /// One parameter's part of a step: its state (created at zero before its first
    /// step) and the tensors the update reads and writes.
    fn prepare(
        index: usize,
        name: &str,
        p: &Param,
        leaf: Tensor,
        g: &Tensor,
        slot: &mut Option<AdamWSlot>,
    ) -> Result<StepItem> {
        let s = match slot {
            Some(s) => s,
            None => slot.insert(AdamWSlot {
                step: 0,
                exp_avg: zeros_state(&leaf)?,
                exp_avg_sq: zeros_state(&leaf)?,
            }),
        };
        let unshard = p.unsharder()?;
        let copy = match &unshard {
            Some(u) => u.working_copy()?,
            None => None,
        };
        Ok(StepItem {
            index,
            unshard,
            copy,
            step: s.step + 1,
            grad: grad_on(&leaf, g)?,
            exp_avg: state_for("AdamW", name, &mut s.exp_avg, &leaf)?,
            exp_avg_sq: state_for("AdamW", name, &mut s.exp_avg_sq, &leaf)?,
            leaf,
        })
    }

    /// The parameters' updates, in place, through [`Tensor::adamw_step_each_with_copies_`]:
    /// one call per step number (on a CUDA device one launch for up to 32 parameters of a
    /// dtype, PyTorch's foreach AdamW; on the host the CPU kernel per parameter), writing
    /// the working copies of sharded parameters that have one in the same pass.
    fn step_all(&mut self, mut items: Vec<StepItem>) -> Result<()> {
        items.sort_by_key(|d| d.step);
        for same in items.chunk_by(|a, b| a.step == b.step) {
            let h = AdamWParams {
                lr: self.config.lr,
                beta1: self.config.betas.0,
                beta2: self.config.betas.1,
                eps: self.config.eps,
                weight_decay: self.config.weight_decay,
                step: same[0].step,
            };
            let list = |f: fn(&StepItem) -> &Tensor| same.iter().map(f).collect::<Vec<_>>();
            let copies: Vec<Option<&Tensor>> = same.iter().map(|d| d.copy.as_ref()).collect();
            Tensor::adamw_step_each_with_copies_(
                &list(|d| &d.leaf),
                &list(|d| &d.grad),
                &list(|d| &d.exp_avg),
                &list(|d| &d.exp_avg_sq),
                &copies,
                &h,
            )?;
            for d in same {
                if let Some(s) = &mut self.state[d.index] {
                    s.step = d.step;
                }
                if let Some(u) = &d.unshard {
                    u.stepped(d.copy.is_some())?;
                }
            }
        }
        Ok(())
    }
}

/// One parameter's AdamW update: its index, the step number taken, and the tensors the
/// update reads and writes.
struct StepItem {
    index: usize,
    /// The sharded parameter's state, and the working copy the step writes (if any).
    unshard: Option<Arc<dyn Unshard>>,
    copy: Option<Tensor>,
    step: u64,
    leaf: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        // Parameters the model no longer holds (an optimizer built before sharding).
        check_not_retired("AdamW", &self.params)?;
        let mut items = Vec::new();
        for (i, ((name, p), slot)) in self.params.iter().zip(&mut self.state).enumerate() {
            let leaf = p.trainable();
            let Some(g) = grad_for_step("AdamW", name, p, &leaf)? else { continue };
            if self.capturable.on && slot.is_none() {
                if let Device::Cuda(o) = leaf.device() {
                    if tpar_tensor::gpu::is_capturing(o) {
                        return Err(config_err(format!(
                            "AdamW (capturable): parameter {name} has no state yet; take one \
                             eager step before capturing (its state would be zeroed by every \
                             replay)"
                        )));
                    }
                }
            }
            items.push(AdamW::prepare(i, name, p, leaf, &g, slot)?);
        }
        if self.capturable.on {
            return self.step_capturable(items);
        }
        self.step_all(items)
    }

    fn set_capturable(&mut self, on: bool) -> Result<()> {
        AdamW::set_capturable(self, on);
        Ok(())
    }

    fn prepare_replay(&mut self) -> Result<()> {
        AdamW::prepare_replay(self)
    }

    fn zero_grad(&self) {
        for (_, p) in &self.params {
            p.zero_grad();
        }
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state_bytes(&self) -> usize {
        self.state.iter().flatten().map(|s| bytes(&s.exp_avg) + bytes(&s.exp_avg_sq)).sum()
    }
    fn grads_for_clip(&mut self) -> Result<Vec<ClipGrad>> {
        param_grads(self.params.iter().map(|(_, p)| p))
    }
}
