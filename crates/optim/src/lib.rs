//! Optimizers, gradient clipping and learning-rate schedules, as `torch.optim` has them.
//!
//! * [`AdamW`] and [`Sgd`] step every parameter **locally**: each rank updates its own
//!   [`Param::trainable`] leaf (a plain tensor, a DTensor's shard or an FSDP shard) with
//!   [`Param::grad_local`]'s gradient, so a sharded parameter keeps sharded optimizer
//!   state (one state element per local element, allocated on the first step).
//! * [`clip_grad_norm_`] computes the true global p-norm (2, inf, any p) over all shards,
//!   mesh dims and pipeline stages and scales the gradients as
//!   `torch.nn.utils.clip_grad_norm_`, for a parameter list or an optimizer's gradients
//!   (the one form that also serves ZeRO-1's ranges), with PyTorch's options
//!   ([`ClipOptions`]).
//! * [`ZeroRedundancyOptimizer`] (ZeRO-1) is an [`Optimizer`] like the others, so a
//!   trainer holds a `Box<dyn Optimizer>` whatever its data-parallel mode.
//! * One AdamW and one SGD for every device: their state is tensors (shaped like the
//!   local shard, in f32, or f64 for f64 parameters, on the parameter's device) and their
//!   update is a tensor op ([`Tensor::adamw_step_each_`], [`Tensor::sgd_step_`]) that the
//!   tensor layer runs with the CPU kernels on the host and the fused CUDA kernels on a
//!   CUDA device (AdamW: up to 32 parameters of a dtype per launch, as PyTorch's foreach
//!   AdamW). With the 2-norm, gradient norms and the clipping of CUDA gradients stay on
//!   the device too, one launch per 32 gradients of a dtype
//!   ([`Tensor::sum_squares_each`], [`Tensor::scale_each`]).
//! * Build an optimizer after `parallelize_module`, `fully_shard` and `reset_parameters`:
//!   they put new parameters in the model's place ([`Param::replace`]), and an optimizer
//!   still holding the old ones would step tensors the model no longer uses. Its first
//!   step (and its constructor) then fails with [`NnError::RetiredParam`] naming the
//!   parameter; the check reads one flag per parameter ([`tpar_nn::check_not_retired`]).
//! * [`LinearLR`], [`CosineAnnealingLR`] and [`SequentialLR`] are pure functions of the
//!   step ([`LrSchedule::lr_at`]); [`LrScheduler`] drives one against an optimizer.
//!
//! ```
//! use tpar_optim::{clip_grad_norm_, AdamW, AdamWConfig, ClipOptions, LrScheduler, Optimizer, SequentialLR};
//! use tpar_nn::Param;
//! use tpar_tensor::{DType, Tensor};
//! let w = Tensor::from_vec(vec![1.0f32, -2.0], [2])?.requires_grad_(true);
//! let params = vec![Param::Tensor(w.clone())];
//! let mut opt = AdamW::new(params.clone(), AdamWConfig { lr: 1e-2, ..Default::default() })?;
//! let mut sched = LrScheduler::new(SequentialLR::warmup_cosine(2, 10, 0.1, 0.0)?, &mut opt);
//! for _ in 0..3 {
//!     w.square()?.sum_all()?.backward()?;
//!     let norm = clip_grad_norm_(&params, 1.0, &ClipOptions::default())?; // a 0-dim tensor
//!     assert!(norm.item()? >= 0.0);
//!     opt.step()?;
//!     opt.zero_grad();
//!     sched.step(&mut opt);
//! }
//! assert!(w.to_vec::<f32>()?[0] < 1.0);
//! # Ok::<(), tpar_nn::NnError>(())
//! ```

#![warn(missing_docs)]

use std::f64::consts::PI;
use std::fmt;

use tpar_tensor::{no_grad, AdamWParams, DType, Device, Tensor};

use tpar_nn::{check_not_retired, NnError, Param, Result, Stateful};

mod clip;
mod state;
mod zero;
pub use clip::{clip_grad_norm_, param_grads, sum_over_groups, ClipGrad, ClipOptions, GradSource};
pub use zero::ZeroRedundancyOptimizer;

// ---------------------------------------------------------------------------------------
// The optimizer trait and shared state storage
// ---------------------------------------------------------------------------------------

/// What a training loop needs from an optimizer: one interface for [`AdamW`], [`Sgd`]
/// and [`ZeroRedundancyOptimizer`], so a trainer holds a `Box<dyn Optimizer>` whatever
/// the data-parallel mode, clips through it ([`clip_grad_norm_`]`(opt.as_mut(), ..)`)
/// and checkpoints it (every optimizer is [`Stateful`], as torch's have `state_dict`).
pub trait Optimizer: Stateful {
    /// One update of every parameter that has a gradient (collective when parameters are
    /// distributed and their gradients are not reduced yet: every rank calls it).
    fn step(&mut self) -> Result<()>;
    /// Drops every parameter's gradient (`zero_grad(set_to_none=True)`).
    fn zero_grad(&self);
    /// The current learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate (what a scheduler calls).
    fn set_lr(&mut self, lr: f64);
    /// Bytes of optimizer state held on this rank.
    fn state_bytes(&self) -> usize;
    /// The gradients the next [`Optimizer::step`] uses, reduced, for
    /// [`clip_grad_norm_`] (collective: every rank calls it): the parameters' reduced
    /// gradients for a local optimizer, the ranks' ranges for ZeRO-1.
    fn grads_for_clip(&mut self) -> Result<Vec<ClipGrad>>;
}

/// Whether `leaf` is updated by the fused CUDA kernels (a CUDA tensor of f32, bf16 or
/// f16): where clipping computes its norm on the device.
pub(crate) fn on_device(leaf: &Tensor) -> bool {
    matches!(leaf.device(), Device::Cuda(_))
        && matches!(leaf.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// Bytes of a state tensor.
fn bytes(t: &Tensor) -> usize {
    t.numel() * t.dtype().size_in_bytes()
}

/// Zeroed state for `leaf`: shaped like it, in its state dtype
/// ([`Tensor::optimizer_state_dtype`]: f32, or f64 for f64 parameters), on its device.
fn zeros_state(leaf: &Tensor) -> Result<Tensor> {
    Ok(Tensor::zeros(leaf.dims(), leaf.optimizer_state_dtype(), leaf.device())?)
}

/// A state tensor of `leaf` from `t`'s values (a copy the optimizer owns).
fn state_from(t: &Tensor, leaf: &Tensor) -> Result<Tensor> {
    let s = zeros_state(leaf)?;
    let src = no_grad(|| t.reshape(leaf.dims())?.to_dtype(s.dtype()))?;
    s.copy_(&src)?;
    Ok(s)
}

/// A copy of a state tensor shaped `dims`.
fn state_copy(t: &Tensor, dims: &[usize]) -> Result<Tensor> {
    Ok(no_grad(|| t.reshape(dims)?.deep_clone())?)
}

/// `x >= 0` (false for NaN).
/// Finite and at least 0 (rejects NaN and infinities: an infinite learning rate is no
/// more usable than a NaN one).
fn non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

pub(crate) fn config_err(what: impl Into<String>) -> NnError {
    NnError::Config { what: what.into() }
}

fn bad_param(opt: &str, name: &str, what: impl fmt::Display) -> NnError {
    NnError::BadInput { module: format!("{opt} (parameter {name})"), what: what.to_string() }
}

/// Names `"0"`, `"1"`, ... for unnamed parameters (as a torch optimizer's state dict).
fn numbered(params: Vec<Param>) -> Vec<(String, Param)> {
    params.into_iter().enumerate().map(|(i, p)| (i.to_string(), p)).collect()
}

/// The reduced gradient of a parameter, checked against its leaf and converted to the
/// leaf's dtype (f32 gradients stay f32 when `f32_ok`: the device kernels take them);
/// `None` when it has none. Collective the first time for distributed parameters (see
/// [`Param::reduce_grads_in_place`]).
fn grad_for_step(opt: &str, name: &str, p: &Param, leaf: &Tensor) -> Result<Option<Tensor>> {
    let Some(g) = p.reduce_grads_in_place()? else { return Ok(None) };
    if g.dims() != leaf.dims() {
        return Err(bad_param(
            opt,
            name,
            format!("gradient of shape {:?} for a parameter of shape {:?}", g.dims(), leaf.dims()),
        ));
    }
    let keep = g.dtype() == leaf.dtype() || g.dtype() == DType::F32;
    let g = if keep { g } else { no_grad(|| g.to_dtype(leaf.dtype()))? };
    // The update reads the gradient while it writes the parameter: never one storage.
    let g = if g.same_storage(leaf) { no_grad(|| g.deep_clone())? } else { g };
    Ok(Some(g))
}

/// The gradient on the parameter's device (where the update reads it).
fn grad_on(leaf: &Tensor, g: &Tensor) -> Result<Tensor> {
    Ok(if g.device() == leaf.device() { g.clone() } else { g.to_device(leaf.device())? })
}

/// The state tensor `buf` of parameter `name`, checked against its leaf and moved to the
/// leaf's device once if the parameter moved.
fn state_for(opt: &str, name: &str, buf: &mut Tensor, leaf: &Tensor) -> Result<Tensor> {
    let n = leaf.numel();
    if buf.numel() != n {
        return Err(bad_param(
            opt,
            name,
            format!("state of {} elements for a local shard of {n} elements", buf.numel()),
        ));
    }
    if buf.dtype() != leaf.optimizer_state_dtype() {
        return Err(bad_param(
            opt,
            name,
            "the parameter's dtype changed since its state was created",
        ));
    }
    if buf.device() != leaf.device() {
        *buf = buf.to_device(leaf.device())?;
    }
    Ok(buf.clone())
}

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
    fn check(&self) -> Result<()> {
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
/// with bf16 compute use FSDP's mixed precision, which keeps f32 shards).
#[derive(Debug)]
pub struct AdamW {
    params: Vec<(String, Param)>,
    config: AdamWConfig,
    state: Vec<Option<AdamWSlot>>,
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
        Ok(AdamW { params, config, state })
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

    /// One parameter's part of a step: its state (created at zero before its first
    /// step) and the tensors the update reads and writes.
    fn prepare(
        index: usize,
        name: &str,
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
        Ok(StepItem {
            index,
            step: s.step + 1,
            grad: grad_on(&leaf, g)?,
            exp_avg: state_for("AdamW", name, &mut s.exp_avg, &leaf)?,
            exp_avg_sq: state_for("AdamW", name, &mut s.exp_avg_sq, &leaf)?,
            leaf,
        })
    }

    /// The parameters' updates, in place, through [`Tensor::adamw_step_each_`]: one call
    /// per step number (on a CUDA device one launch for up to 32 parameters of a dtype,
    /// PyTorch's foreach AdamW; on the host the CPU kernel per parameter).
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
            Tensor::adamw_step_each_(
                &list(|d| &d.leaf),
                &list(|d| &d.grad),
                &list(|d| &d.exp_avg),
                &list(|d| &d.exp_avg_sq),
                &h,
            )?;
            for d in same {
                if let Some(s) = &mut self.state[d.index] {
                    s.step = d.step;
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
            items.push(AdamW::prepare(i, name, leaf, &g, slot)?);
        }
        self.step_all(items)
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

// ---------------------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------------------

/// Hyper-parameters of [`Sgd`]; the defaults are `torch.optim.SGD`'s (lr 1e-3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 keeps no state).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient (coupled, as torch's SGD).
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

impl SgdConfig {
    fn check(&self) -> Result<()> {
        if !non_negative(self.lr) {
            return Err(config_err(format!("SGD: invalid learning rate {}", self.lr)));
        }
        if !non_negative(self.momentum) {
            return Err(config_err(format!("SGD: invalid momentum {}", self.momentum)));
        }
        if !non_negative(self.weight_decay) {
            return Err(config_err(format!("SGD: invalid weight_decay {}", self.weight_decay)));
        }
        if !self.dampening.is_finite() {
            return Err(config_err(format!("SGD: invalid dampening {}", self.dampening)));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(config_err(
                "SGD: Nesterov momentum requires a momentum and zero dampening",
            ));
        }
        Ok(())
    }
}

/// `torch.optim.SGD` (not maximize) over one parameter group:
///
/// ```text
/// g = grad + weight_decay * p
/// b = g                                   (first step)
/// b = momentum * b + (1 - dampening) * g  (later steps)
/// g = nesterov ? g + momentum * b : b     (when momentum != 0)
/// p -= lr * g
/// ```
///
/// Local, like [`AdamW`]: the momentum buffer is sharded like the parameter, allocated
/// on the first step (only when momentum is non-zero), in f32 for f32/bf16/f16 parameters
/// and f64 for f64 ones; the update is computed in that precision.
#[derive(Debug)]
pub struct Sgd {
    params: Vec<(String, Param)>,
    config: SgdConfig,
    momentum_buffer: Vec<Option<Tensor>>,
}

impl Sgd {
    /// SGD over `params`.
    pub fn new(params: Vec<Param>, config: SgdConfig) -> Result<Sgd> {
        Sgd::with_names(numbered(params), config)
    }

    /// SGD over named parameters.
    pub fn with_names(params: Vec<(String, Param)>, config: SgdConfig) -> Result<Sgd> {
        config.check()?;
        check_not_retired("SGD", &params)?;
        let momentum_buffer = vec![None; params.len()];
        Ok(Sgd { params, config, momentum_buffer })
    }

    /// The hyper-parameters (with the current learning rate).
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The parameters, with their names.
    pub fn params(&self) -> &[(String, Param)] {
        &self.params
    }

    /// The momentum buffer of parameter `index` (a copy laid out like its local shard),
    /// `None` before its first step or without momentum.
    pub fn momentum_buffer(&self, index: usize) -> Result<Option<Tensor>> {
        let (Some(Some(b)), Some((_, p))) =
            (self.momentum_buffer.get(index), self.params.get(index))
        else {
            return Ok(None);
        };
        Ok(Some(state_copy(b, p.trainable().dims())?))
    }

    /// Replaces the hyper-parameters (e.g. from a checkpoint).
    pub fn set_config(&mut self, config: SgdConfig) {
        self.config = config;
    }

    /// Replaces the momentum buffer of parameter `index` (`None`: no buffer, as before
    /// the first step); a buffer must have the parameter's local shape.
    pub fn set_momentum_buffer(&mut self, index: usize, buffer: Option<Tensor>) -> Result<()> {
        let Some((name, p)) = self.params.get(index) else {
            return Err(config_err(format!(
                "SGD::set_momentum_buffer: index {index} out of range for {} parameters",
                self.params.len()
            )));
        };
        let leaf = p.trainable();
        self.momentum_buffer[index] = match buffer {
            None => None,
            Some(b) if b.dims() != leaf.dims() => {
                return Err(bad_param(
                    "SGD",
                    name,
                    format!(
                        "momentum_buffer of shape {:?} for a local shard {:?}",
                        b.dims(),
                        leaf.dims()
                    ),
                ))
            }
            Some(b) => Some(state_from(&b, &leaf)?),
        };
        Ok(())
    }

    /// One parameter's step, in place, through [`Tensor::sgd_step_`]; the momentum buffer
    /// (with momentum only) lives on the parameter's device.
    fn step_one(
        name: &str,
        leaf: &Tensor,
        g: &Tensor,
        buf: &mut Option<Tensor>,
        c: &SgdConfig,
    ) -> Result<()> {
        let g = &grad_on(leaf, g)?;
        let first = buf.is_none();
        let b = if c.momentum != 0.0 {
            let s = match buf {
                Some(s) => s,
                None => buf.insert(zeros_state(leaf)?),
            };
            Some(state_for("SGD", name, s, leaf)?)
        } else {
            None
        };
        leaf.sgd_step_(
            g,
            b.as_ref(),
            first,
            c.lr,
            c.weight_decay,
            c.momentum,
            c.dampening,
            c.nesterov,
        )?;
        Ok(())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        check_not_retired("SGD", &self.params)?;
        for ((name, p), buf) in self.params.iter().zip(&mut self.momentum_buffer) {
            let leaf = p.trainable();
            let Some(g) = grad_for_step("SGD", name, p, &leaf)? else { continue };
            Sgd::step_one(name, &leaf, &g, buf, &self.config)?;
        }
        Ok(())
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
        self.momentum_buffer.iter().flatten().map(bytes).sum()
    }
    fn grads_for_clip(&mut self) -> Result<Vec<ClipGrad>> {
        param_grads(self.params.iter().map(|(_, p)| p))
    }
}

// ---------------------------------------------------------------------------------------
// Learning-rate schedules
// ---------------------------------------------------------------------------------------

/// A learning-rate schedule: the learning rate at a step, as a pure function of the step
/// and the optimizer's initial learning rate (PyTorch's closed forms).
pub trait LrSchedule: fmt::Debug + Send + Sync {
    /// The learning rate after `step` scheduler steps (step 0 is the value set at
    /// construction), for an optimizer whose initial learning rate is `base_lr`.
    fn lr_at(&self, step: usize, base_lr: f64) -> f64;
}

impl<S: LrSchedule + ?Sized> LrSchedule for Box<S> {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        (**self).lr_at(step, base_lr)
    }
}

/// `torch.optim.lr_scheduler.LinearLR`: the factor moves linearly from `start_factor` to
/// `end_factor` over `total_iters` steps, then stays:
/// `base_lr * (start + (end - start) * min(step, total_iters) / total_iters)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearLR {
    /// Factor at step 0 (torch's default 1/3).
    pub start_factor: f64,
    /// Factor from `total_iters` on (default 1).
    pub end_factor: f64,
    /// Steps of the ramp (default 5; 0 means `end_factor` from the start).
    pub total_iters: usize,
}

impl LinearLR {
    /// A checked `LinearLR` (torch's bounds: `0 < start_factor <= 1`,
    /// `0 <= end_factor <= 1`).
    pub fn new(start_factor: f64, end_factor: f64, total_iters: usize) -> Result<LinearLR> {
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(config_err(format!(
                "LinearLR: start_factor {start_factor} must be in (0, 1]"
            )));
        }
        if !(0.0..=1.0).contains(&end_factor) {
            return Err(config_err(format!("LinearLR: end_factor {end_factor} must be in [0, 1]")));
        }
        Ok(LinearLR { start_factor, end_factor, total_iters })
    }
}

impl LrSchedule for LinearLR {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        if self.total_iters == 0 {
            return base_lr * self.end_factor;
        }
        let t = step.min(self.total_iters) as f64 / self.total_iters as f64;
        base_lr * (self.start_factor + (self.end_factor - self.start_factor) * t)
    }
}

/// `torch.optim.lr_scheduler.CosineAnnealingLR`:
/// `eta_min + (base_lr - eta_min) * (1 + cos(pi * step / t_max)) / 2` (periodic past
/// `t_max`, as torch's; `t_max` 0 is taken as 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineAnnealingLR {
    /// Steps of the half cosine.
    pub t_max: usize,
    /// The minimum learning rate.
    pub eta_min: f64,
}

impl CosineAnnealingLR {
    /// A checked `CosineAnnealingLR` (`t_max >= 1`, `eta_min >= 0`).
    pub fn new(t_max: usize, eta_min: f64) -> Result<CosineAnnealingLR> {
        if t_max == 0 {
            return Err(config_err("CosineAnnealingLR: t_max must be at least 1"));
        }
        if !non_negative(eta_min) {
            return Err(config_err(format!("CosineAnnealingLR: invalid eta_min {eta_min}")));
        }
        Ok(CosineAnnealingLR { t_max, eta_min })
    }
}

impl LrSchedule for CosineAnnealingLR {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        let t_max = self.t_max.max(1) as f64;
        self.eta_min + (base_lr - self.eta_min) * (1.0 + (PI * step as f64 / t_max).cos()) / 2.0
    }
}

/// `torch.optim.lr_scheduler.SequentialLR`: `schedulers[i]` runs from `milestones[i-1]`
/// (0 for the first) with its own step count restarting at 0 there, as torch's
/// `step(0)` at a milestone does.
#[derive(Debug)]
pub struct SequentialLR {
    schedulers: Vec<Box<dyn LrSchedule>>,
    milestones: Vec<usize>,
}

impl SequentialLR {
    /// Chains `schedulers`; `milestones` must be one fewer and non-decreasing.
    pub fn new(
        schedulers: Vec<Box<dyn LrSchedule>>,
        milestones: Vec<usize>,
    ) -> Result<SequentialLR> {
        if schedulers.is_empty() {
            return Err(config_err("SequentialLR: needs at least one scheduler"));
        }
        if milestones.len() + 1 != schedulers.len() {
            return Err(config_err(format!(
                "SequentialLR: {} schedulers need {} milestones, got {}",
                schedulers.len(),
                schedulers.len() - 1,
                milestones.len()
            )));
        }
        if milestones.windows(2).any(|w| w[0] > w[1]) {
            return Err(config_err(format!(
                "SequentialLR: milestones {milestones:?} must be non-decreasing"
            )));
        }
        Ok(SequentialLR { schedulers, milestones })
    }

    /// The usual LLM schedule: `LinearLR(start_factor, 1, warmup)` for `warmup` steps,
    /// then `CosineAnnealingLR(total - warmup, eta_min)`.
    pub fn warmup_cosine(
        warmup: usize,
        total: usize,
        start_factor: f64,
        eta_min: f64,
    ) -> Result<SequentialLR> {
        let cosine = CosineAnnealingLR::new(total.saturating_sub(warmup).max(1), eta_min)?;
        SequentialLR::new(
            vec![Box::new(LinearLR::new(start_factor, 1.0, warmup)?), Box::new(cosine)],
            vec![warmup],
        )
    }

    /// The milestones.
    pub fn milestones(&self) -> &[usize] {
        &self.milestones
    }
}

impl LrSchedule for SequentialLR {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        // bisect_right(milestones, step)
        let idx = self.milestones.partition_point(|&m| m <= step);
        let start = if idx == 0 { 0 } else { self.milestones[idx - 1] };
        self.schedulers[idx].lr_at(step - start, base_lr)
    }
}

/// Drives an [`LrSchedule`] against an optimizer, as a torch scheduler object: created
/// after the optimizer (taking its learning rate as `base_lr` and setting step 0's
/// value), then [`LrScheduler::step`] once per optimizer step.
#[derive(Debug)]
pub struct LrScheduler<S: LrSchedule> {
    schedule: S,
    base_lr: f64,
    last_step: usize,
    last_lr: f64,
    /// Loading takes only the step from a checkpoint ([`LrScheduler::override_on_load`]).
    keep_own_schedule: bool,
}

impl<S: LrSchedule> LrScheduler<S> {
    /// Starts `schedule` at step 0 with `opt`'s current learning rate as the base.
    pub fn new<O: Optimizer + ?Sized>(schedule: S, opt: &mut O) -> LrScheduler<S> {
        let base_lr = opt.lr();
        let last_lr = schedule.lr_at(0, base_lr);
        opt.set_lr(last_lr);
        LrScheduler { schedule, base_lr, last_step: 0, last_lr, keep_own_schedule: false }
    }

    /// Advances one step and sets the optimizer's learning rate; returns it.
    pub fn step<O: Optimizer + ?Sized>(&mut self, opt: &mut O) -> f64 {
        self.last_step += 1;
        self.last_lr = self.schedule.lr_at(self.last_step, self.base_lr);
        opt.set_lr(self.last_lr);
        self.last_lr
    }

    /// Restores the position of the schedule (e.g. from a checkpoint); the optimizer's
    /// learning rate is restored with the optimizer's own state.
    pub fn restore(&mut self, last_step: usize, base_lr: f64, last_lr: f64) {
        (self.last_step, self.base_lr, self.last_lr) = (last_step, base_lr, last_lr);
    }

    /// Makes loading a checkpoint take only its step: this scheduler's own schedule and
    /// base learning rate stay, and the learning rate is recomputed at the loaded step.
    /// Without it, loading a checkpoint saved with another schedule is an error (a
    /// resume would otherwise follow a mix of the two); with it, a resumed run changes
    /// its learning rate on purpose. Set the optimizer's learning rate to
    /// [`LrScheduler::last_lr`] after loading (the optimizer's own state holds the
    /// saved one).
    pub fn override_on_load(&mut self) {
        self.keep_own_schedule = true;
    }

    /// Whether loading keeps this scheduler's schedule ([`LrScheduler::override_on_load`]).
    pub fn overrides_on_load(&self) -> bool {
        self.keep_own_schedule
    }

    /// The position after `last_step` steps of this scheduler's own schedule (its own
    /// base learning rate), as [`LrScheduler::override_on_load`] loads it.
    pub(crate) fn restore_step(&mut self, last_step: usize) {
        self.last_step = last_step;
        self.last_lr = self.schedule.lr_at(last_step, self.base_lr);
    }

    /// The learning rate the last step set (`get_last_lr()`).
    pub fn last_lr(&self) -> f64 {
        self.last_lr
    }

    /// Steps taken (`last_epoch`).
    pub fn last_step(&self) -> usize {
        self.last_step
    }

    /// The base learning rate (`initial_lr`).
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// The schedule.
    pub fn schedule(&self) -> &S {
        &self.schedule
    }
}
