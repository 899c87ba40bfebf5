//! Optimizer updates as tensor ops, one entry point per update whatever the device:
//! CUDA parameters of f32, bf16 or f16 go to the fused CUDA kernels (`gpu_nn.rs`),
//! every other parameter to the CPU kernels (`tpar_kernels::adamw`, the SGD loop here),
//! through host copies for CUDA tensors of other dtypes. An optimizer keeps its state
//! as tensors and calls these; it never sees the kernels.

use tpar_kernels::adamw::{adamw_step, adamw_step_with_copy, AdamWParams};
use tpar_kernels::{Acc, Float};

use super::invalid;
use crate::storage::Element;
use crate::{no_grad, with_float_type, DType, Device, Result, Tensor, TensorError};

/// Whether the fused CUDA kernels update `p`: a CUDA tensor of f32, bf16 or f16.
fn on_device_kernels(p: &Tensor) -> bool {
    matches!(p.device(), Device::Cuda(_))
        && matches!(p.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// Refuses two of `ts` sharing a storage (an update reads one while it writes another).
fn distinct(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    for (i, a) in ts.iter().enumerate() {
        if ts[i + 1..].iter().any(|b| a.same_storage(b)) {
            return Err(invalid(
                op,
                "the parameter, its gradient and its state must be separate buffers",
            ));
        }
    }
    Ok(())
}

/// `g` in `p`'s dtype (the host kernels read the gradient in the parameter's dtype).
fn grad_as(p: &Tensor, g: &Tensor) -> Result<Tensor> {
    if g.dtype() == p.dtype() {
        Ok(g.clone())
    } else {
        no_grad(|| g.to_dtype(p.dtype()))
    }
}

/// The state dtype `T`'s kernels keep: its accumulator type.
fn check_state<A: Element>(op: &'static str, s: &Tensor) -> Result<()> {
    if s.dtype() != A::DTYPE {
        return Err(TensorError::DTypeMismatch {
            op,
            expected: format!("{} state", A::DTYPE.name()),
            got: s.dtype(),
        });
    }
    Ok(())
}

fn host_adamw<T: Float + Element>(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &AdamWParams,
) -> Result<()>
where
    T::Acc: Element,
{
    const OP: &str = "adamw_step_each_";
    check_state::<T::Acc>(OP, m)?;
    check_state::<T::Acc>(OP, v)?;
    let g = grad_as(p, g)?;
    distinct(OP, &[p, &g, m, v])?;
    g.with_data::<T, _>(|g| {
        p.with_data_mut::<T, _>(|p| {
            m.with_data_mut::<T::Acc, _>(|m| {
                v.with_data_mut::<T::Acc, _>(|v| adamw_step(p, g, m, v, h))
            })
        })
    })????
    .map_err(TensorError::from)?;
    Ok(())
}

/// [`host_adamw`] that also writes the updated parameters, cast to `W` as
/// [`Tensor::to_dtype`] casts on the host, into `c` in the same pass (f32 / bf16 / f16
/// parameters and copies).
fn host_adamw_copy<T: Float<Acc = f32> + Element, W: Element>(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    c: &Tensor,
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "adamw_step_each_with_copies_";
    check_state::<f32>(OP, m)?;
    check_state::<f32>(OP, v)?;
    let g = grad_as(p, g)?;
    distinct(OP, &[p, &g, m, v, c])?;
    g.with_data::<T, _>(|g| {
        p.with_data_mut::<T, _>(|p| {
            m.with_data_mut::<f32, _>(|m| {
                v.with_data_mut::<f32, _>(|v| {
                    // The conversion of the host cast (`Tensor::to_dtype`), element
                    // for element.
                    let cast = |x: T| <W as Element>::from_f64(<T as Element>::to_f64(x));
                    c.with_data_mut::<W, _>(|c| adamw_step_with_copy(p, g, m, v, c, cast, h))
                })
            })
        })
    })?????
    .map_err(TensorError::from)?;
    Ok(())
}

/// [`host_adamw_copy`] for the host parameter `p` and its host copy `c` when both are
/// f32, bf16 or f16; `Ok(false)` (nothing done) otherwise.
fn host_adamw_fused_copy(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    c: &Tensor,
    h: &AdamWParams,
) -> Result<bool> {
    use half::{bf16, f16};
    if p.device() != Device::Cpu || c.device() != Device::Cpu {
        return Ok(false);
    }
    macro_rules! to {
        ($T:ty) => {
            match c.dtype() {
                DType::F32 => host_adamw_copy::<$T, f32>(p, g, m, v, c, h),
                DType::BF16 => host_adamw_copy::<$T, bf16>(p, g, m, v, c, h),
                DType::F16 => host_adamw_copy::<$T, f16>(p, g, m, v, c, h),
                _ => return Ok(false),
            }
        };
    }
    match p.dtype() {
        DType::F32 => to!(f32),
        DType::BF16 => to!(bf16),
        DType::F16 => to!(f16),
        _ => return Ok(false),
    }?;
    Ok(true)
}

/// Checks the working copies of a foreach AdamW call: one slot per parameter, each
/// copy a float tensor of its parameter's shape on its device, in a storage of its own
/// (shared with no parameter, gradient, state or other copy).
fn check_copies(
    op: &'static str,
    lists: [&[&Tensor]; 4],
    copies: &[Option<&Tensor>],
) -> Result<()> {
    let params = lists[0];
    if copies.len() != params.len() {
        return Err(invalid(
            op,
            format!("{} working-copy slots for {} parameters", copies.len(), params.len()),
        ));
    }
    let id = |t: &Tensor| std::sync::Arc::as_ptr(&t.0.storage) as *const () as usize;
    let mut seen: std::collections::HashSet<usize> =
        lists.iter().flat_map(|l| l.iter().map(|t| id(t))).collect();
    for (i, (p, c)) in params.iter().zip(copies).enumerate() {
        let Some(c) = c else { continue };
        if c.shape() != p.shape() || c.device() != p.device() || !c.dtype().is_float() {
            return Err(invalid(
                op,
                format!(
                    "parameter {i} is {} {} on {}; its working copy must be a float tensor of \
                     that shape on that device, not {} {} on {}",
                    p.shape(),
                    p.dtype(),
                    p.device(),
                    c.shape(),
                    c.dtype(),
                    c.device()
                ),
            ));
        }
        if !seen.insert(id(c)) {
            return Err(invalid(
                op,
                format!("parameter {i}'s working copy shares its storage with another argument"),
            ));
        }
    }
    Ok(())
}

/// Hyper-parameters of one SGD step ([`Tensor::sgd_step_`]), as `torch.optim.SGD`
/// names them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdParams {
    /// Learning rate.
    pub lr: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Momentum factor (0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the momentum's gradient term.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// The parameter's first step: the momentum buffer starts as the gradient.
    pub first_step: bool,
}

fn host_sgd<T: Float + Element>(
    p: &Tensor,
    g: &Tensor,
    b: Option<&Tensor>,
    h: &SgdParams,
) -> Result<()>
where
    T::Acc: Element,
{
    const OP: &str = "sgd_step_";
    let SgdParams { lr, weight_decay, momentum, dampening, nesterov, first_step: first } = *h;
    let a = <T::Acc as Acc>::of;
    let (lr_a, wd, mom, damp) = (a(lr), a(weight_decay), a(momentum), a(1.0 - dampening));
    let use_wd = weight_decay != 0.0;
    let g = grad_as(p, g)?;
    let mut all = vec![p, &g];
    all.extend(b);
    distinct(OP, &all)?;
    if let Some(b) = b {
        check_state::<T::Acc>(OP, b)?;
    }
    let run = |p: &mut [T], g: &[T], mut b: Option<&mut [T::Acc]>| {
        for i in 0..p.len() {
            let x = p[i].to_acc();
            let mut d = g[i].to_acc();
            if use_wd {
                d += wd * x;
            }
            if let Some(b) = b.as_deref_mut() {
                b[i] = if first { d } else { mom * b[i] + damp * d };
                d = if nesterov { d + mom * b[i] } else { b[i] };
            }
            p[i] = T::from_acc(x - lr_a * d);
        }
    };
    g.with_data::<T, _>(|g| {
        p.with_data_mut::<T, _>(|p| match b {
            Some(b) => b.with_data_mut::<T::Acc, _>(|b| run(p, g, Some(b))),
            None => {
                run(p, g, None);
                Ok(())
            }
        })
    })???;
    Ok(())
}

impl Tensor {
    /// The dtype an optimizer keeps this parameter's state in (the kernels' accumulator
    /// type): f64 for f64 parameters, f32 for the others.
    pub fn optimizer_state_dtype(&self) -> DType {
        if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// One AdamW step ([`AdamWParams`], `torch.optim.AdamW`'s update) of every parameter
    /// in `params`, in place, with `grads[i]` (the parameter's dtype, or f32) and the
    /// moment buffers `exp_avgs[i]`, `exp_avg_sqs[i]` (in
    /// [`Tensor::optimizer_state_dtype`], shaped like the parameter, on its device),
    /// updated in place. All share the hyper-parameters and the step `h.step`.
    ///
    /// CUDA parameters of f32, bf16 or f16 are updated by the fused CUDA kernel, up to 32
    /// of a dtype per launch (PyTorch's foreach AdamW; see the CUDA rules below); the
    /// others by the CPU kernel `tpar_kernels::adamw::adamw_step`, one parameter at a
    /// time (on host copies for CUDA tensors of other dtypes). Both compute the same
    /// formula element for element. Not recorded by autograd.
    ///
    /// CUDA rules: [`Tensor::adamw_step_`] per parameter; every argument is checked
    /// before any parameter changes, and no updated buffer may share its storage with
    /// any other argument.
    pub fn adamw_step_each_(
        params: &[&Tensor],
        grads: &[&Tensor],
        exp_avgs: &[&Tensor],
        exp_avg_sqs: &[&Tensor],
        h: &AdamWParams,
    ) -> Result<()> {
        let none = vec![None; params.len()];
        Tensor::adamw_step_each_with_copies_(params, grads, exp_avgs, exp_avg_sqs, &none, h)
    }

    /// [`Tensor::adamw_step_each_`] that also writes each parameter's low-precision
    /// working copy `copies[i]` (`None`: none), the updated parameter cast to the
    /// copy's dtype, in the same pass: what mixed-precision training computes with,
    /// without a separate cast after the step. The copy is bit for bit what
    /// `copy.copy_(param)` after the step gives; the update is
    /// [`Tensor::adamw_step_each_`]'s, bit for bit.
    ///
    /// A copy is a float tensor of its parameter's shape on its device, in a storage of
    /// its own. The fused kernels write it: on a CUDA device for f32 parameters with f32
    /// gradients and bf16 or f16 copies (up to 32 parameters a launch), on the host for
    /// f32, bf16 or f16 parameters and copies; any other pair is stepped, then cast.
    /// Every argument is checked before any parameter changes. Not recorded by autograd.
    pub fn adamw_step_each_with_copies_(
        params: &[&Tensor],
        grads: &[&Tensor],
        exp_avgs: &[&Tensor],
        exp_avg_sqs: &[&Tensor],
        copies: &[Option<&Tensor>],
        h: &AdamWParams,
    ) -> Result<()> {
        const OP: &str = "adamw_step_each_";
        let n = same_lengths(OP, params, grads, exp_avgs, exp_avg_sqs)?;
        check_copies(OP, [params, grads, exp_avgs, exp_avg_sqs], copies)?;
        let (dev, host): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|&i| on_device_kernels(params[i]));
        for i in host {
            let (p, g, m, v) = (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]);
            if let Some(c) = copies[i] {
                if host_adamw_fused_copy(p, g, m, v, c, h)? {
                    continue;
                }
            }
            with_float_type!(p.dtype(), OP, |T| { host_adamw::<T>(p, g, m, v, h) })?;
            if let Some(c) = copies[i] {
                no_grad(|| c.copy_(p))?;
            }
        }
        if dev.is_empty() {
            return Ok(());
        }
        fn pick<T: Copy>(ts: &[T], idx: &[usize]) -> Vec<T> {
            idx.iter().map(|&i| ts[i]).collect()
        }
        Tensor::cuda_adamw_step_each_(
            &pick(params, &dev),
            &pick(grads, &dev),
            &pick(exp_avgs, &dev),
            &pick(exp_avg_sqs, &dev),
            &pick(copies, &dev),
            h,
            None,
        )
    }

    /// The capturable form of [`Tensor::adamw_step_each_with_copies_`], for CUDA
    /// parameters only: the kernels read the step's coefficients from `coef` (8 f32
    /// values on the parameters' device, [`adamw_coefficients`] of the step's
    /// hyper-parameters, written there before the kernels run; `h` is not used on the
    /// device) instead of their arguments, so a CUDA graph that captured this step
    /// takes each step's learning rate and bias corrections from `coef` on every
    /// replay. With the coefficients of `h` the results are
    /// [`Tensor::adamw_step_each_with_copies_`]'s bits. A parameter on the host, or
    /// a working copy no fused kernel writes (other than a bf16 or f16 copy of an
    /// f32 parameter with an f32 gradient), is an error here.
    pub fn adamw_step_each_capturable_(
        params: &[&Tensor],
        grads: &[&Tensor],
        exp_avgs: &[&Tensor],
        exp_avg_sqs: &[&Tensor],
        copies: &[Option<&Tensor>],
        coef: &Tensor,
    ) -> Result<()> {
        const OP: &str = "adamw_step_each_capturable_";
        let n = same_lengths(OP, params, grads, exp_avgs, exp_avg_sqs)?;
        check_copies(OP, [params, grads, exp_avgs, exp_avg_sqs], copies)?;
        for i in 0..n {
            if !on_device_kernels(params[i]) {
                return Err(TensorError::InvalidArgument {
                    op: OP,
                    what: format!(
                        "parameter {i} is a {} tensor on {}: the capturable step runs the \
                         CUDA kernels (f32, bf16 or f16 on a CUDA device)",
                        params[i].dtype().name(),
                        params[i].device()
                    ),
                });
            }
            if let Some(c) = copies[i] {
                let fused = params[i].dtype() == DType::F32
                    && grads[i].dtype() == DType::F32
                    && matches!(c.dtype(), DType::BF16 | DType::F16);
                if !fused {
                    return Err(TensorError::InvalidArgument {
                        op: OP,
                        what: format!(
                            "working copy {i} ({} of a {} parameter with a {} gradient): the \
                             capturable step writes bf16 or f16 copies of f32 parameters \
                             with f32 gradients",
                            c.dtype().name(),
                            params[i].dtype().name(),
                            grads[i].dtype().name()
                        ),
                    });
                }
            }
        }
        // Unused with device coefficients beyond the argument checks.
        let h =
            AdamWParams { lr: 0.0, beta1: 0.0, beta2: 0.0, eps: 0.0, weight_decay: 0.0, step: 1 };
        Tensor::cuda_adamw_step_each_(params, grads, exp_avgs, exp_avg_sqs, copies, &h, Some(coef))
    }

    /// One SGD step of this parameter, in place, as `torch.optim.SGD`:
    ///
    /// ```text
    /// d = grad + weight_decay * p
    /// b = d on the first step, else momentum * b + (1 - dampening) * d   (with momentum)
    /// d = d + momentum * b if nesterov, else b                           (with momentum)
    /// p = p - lr * d
    /// ```
    ///
    /// computed in [`Tensor::optimizer_state_dtype`]. `grad` has the parameter's dtype
    /// or is f32; `momentum_buffer` (in the state dtype, the parameter's size and
    /// device) is updated in place (`None` without momentum). CUDA parameters of f32,
    /// bf16 or f16 are updated by CUDA kernels, the others on the host. Not recorded by
    /// autograd.
    pub fn sgd_step_(
        &self,
        grad: &Tensor,
        momentum_buffer: Option<&Tensor>,
        h: &SgdParams,
    ) -> Result<()> {
        if on_device_kernels(self) {
            return self.cuda_sgd_step_(grad, momentum_buffer, h);
        }
        with_float_type!(self.dtype(), "sgd_step_", |T| {
            host_sgd::<T>(self, grad, momentum_buffer, h)
        })
    }
}

/// The number of parameters of a foreach AdamW call, or an error naming `op` when the
/// gradient and state lists are not as long as the parameter list.
pub(crate) fn same_lengths(
    op: &'static str,
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
) -> Result<usize> {
    let n = params.len();
    if grads.len() != n || exp_avgs.len() != n || exp_avg_sqs.len() != n {
        return Err(invalid(
            op,
            format!(
                "{n} parameters with {} gradients, {} exp_avg and {} exp_avg_sq",
                grads.len(),
                exp_avgs.len(),
                exp_avg_sqs.len()
            ),
        ));
    }
    Ok(n)
}

/// The coefficients of one AdamW step as the CUDA kernels take them (8 f32 values:
/// `1 - lr * weight_decay`, `1 - beta1`, `beta2`, `1 - beta2`, `lr / (1 - beta1^step)`,
/// `sqrt(1 - beta2^step)`, `eps`, padding), folded in f64 as the CPU kernel folds them:
/// what [`Tensor::adamw_step_each_capturable_`] reads from the device.
pub fn adamw_coefficients(h: &AdamWParams) -> [f32; 8] {
    bytemuck::cast(tpar_kernels::cuda::raw::adamw::coefficients(h))
}
