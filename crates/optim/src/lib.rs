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
//!   ([`Tensor::sum_squares_each`], [`Tensor::scale_each_`], which scales them in place).
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

use tpar_tensor::{no_grad, AdamWParams, DType, Device, SgdParams, Tensor};

use tpar_nn::{check_not_retired, NnError, Param, Result, Stateful};

mod adamw;
mod clip;
mod schedule;
mod sgd;
mod state;
mod zero;
pub use adamw::{AdamW, AdamWConfig, AdamWState};
pub use clip::{clip_grad_norm_, param_grads, sum_over_groups, ClipGrad, ClipOptions, GradSource};
pub use schedule::{CosineAnnealingLR, LinearLR, LrSchedule, LrScheduler, SequentialLR};
pub use sgd::{Sgd, SgdConfig};
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
    /// Makes the steps capturable into a CUDA graph (PyTorch's `capturable=True`): the
    /// per-step values (learning rate, bias corrections) are read from device memory
    /// instead of being folded into the launches, so a replayed step takes the current
    /// ones (see [`AdamW::set_capturable`]). An error for an optimizer that cannot
    /// (the default).
    fn set_capturable(&mut self, on: bool) -> Result<()> {
        if on {
            return Err(config_err("this optimizer does not take capturable steps"));
        }
        Ok(())
    }
    /// Before each replay of a graph that captured [`Optimizer::step`]: advances the
    /// step counts the captured step would and writes its coefficients to the device
    /// (see [`AdamW::prepare_replay`]). An error without a captured step.
    fn prepare_replay(&mut self) -> Result<()> {
        Err(config_err("this optimizer has no captured step to replay"))
    }
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
