//! AdamW step matching `torch.optim.AdamW` (non-amsgrad, not maximize):
//!
//! ```text
//! p    *= 1 - lr * weight_decay
//! m     = lerp(m, g, 1 - beta1)            // m + (1 - beta1) * (g - m)
//! v     = v * beta2 + (1 - beta2) * g * g
//! denom = sqrt(v) / sqrt(1 - beta2^step) + eps
//! p    -= lr / (1 - beta1^step) * m / denom
//! ```
//!
//! Optimizer state lives in the accumulator type ([`Float::Acc`]): f32 for
//! f32/bf16/f16 parameters, f64 for f64.
//!
//! [`adamw_step_with_copy`] also writes each updated parameter converted to another
//! dtype (the bf16 or f16 working copy mixed-precision training computes with) in
//! the same pass: the bits a separate cast of the updated parameters gives.

use num_traits::Float as _;
use rayon::prelude::*;

use crate::util::{bad, check_len};
use crate::{Acc, Float, Result};

#[cfg(test)]
mod tests;

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The step number, starting at 1 (bias corrections use it).
    pub step: u64,
}

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 14;

/// One in-place AdamW update of `p` given `grad`, updating the moment buffers
/// `exp_avg` and `exp_avg_sq` (all the same length). `h.step` must be ≥ 1.
pub fn adamw_step<T: Float>(
    p: &mut [T],
    grad: &[T],
    exp_avg: &mut [T::Acc],
    exp_avg_sq: &mut [T::Acc],
    h: &AdamWParams,
) -> Result<()> {
    step::<T, T, fn(T) -> T>(p, grad, exp_avg, exp_avg_sq, None, h, "adamw_step")
}

/// [`adamw_step`] that also writes `cast` of each updated parameter into `copy` (the
/// same length) in the same pass: the low-precision working copy, equal bit for bit
/// to `cast` applied to the updated `p` afterwards (pass the conversion a separate
/// cast would use, e.g. `|x| bf16::from_f32(x)`). The update of `p` and the
/// moments is [`adamw_step`]'s, bit for bit.
pub fn adamw_step_with_copy<T: Float, W: Send>(
    p: &mut [T],
    grad: &[T],
    exp_avg: &mut [T::Acc],
    exp_avg_sq: &mut [T::Acc],
    copy: &mut [W],
    cast: impl Fn(T) -> W + Sync,
    h: &AdamWParams,
) -> Result<()> {
    let copy = Some((copy, cast));
    step(p, grad, exp_avg, exp_avg_sq, copy, h, "adamw_step_with_copy")
}

/// The step of [`adamw_step`], with the working copy of [`adamw_step_with_copy`]
/// when `copy` is given.
fn step<T: Float, W: Send, C: Fn(T) -> W + Sync>(
    p: &mut [T],
    grad: &[T],
    exp_avg: &mut [T::Acc],
    exp_avg_sq: &mut [T::Acc],
    copy: Option<(&mut [W], C)>,
    h: &AdamWParams,
    op: &'static str,
) -> Result<()> {
    let n = p.len();
    check_len(op, "grad", grad.len(), n)?;
    check_len(op, "exp_avg", exp_avg.len(), n)?;
    check_len(op, "exp_avg_sq", exp_avg_sq.len(), n)?;
    if let Some((c, _)) = &copy {
        check_len(op, "copy", c.len(), n)?;
    }
    if h.step == 0 {
        return Err(bad(op, "step must start at 1"));
    }
    let a = |x: f64| <T::Acc as Acc>::of(x);
    let step = i32::try_from(h.step).unwrap_or(i32::MAX);
    let bc1 = 1.0 - h.beta1.powi(step);
    let bc2 = 1.0 - h.beta2.powi(step);
    let decay = a(1.0 - h.lr * h.weight_decay);
    let w1 = a(1.0 - h.beta1);
    let (beta2, w2) = (a(h.beta2), a(1.0 - h.beta2));
    let step_size = a(h.lr / bc1);
    let bc2_sqrt = a(bc2.sqrt());
    let eps = a(h.eps);
    let update = |p: &mut T, g: &T, m: &mut T::Acc, v: &mut T::Acc| {
        let g = g.to_acc();
        let mut x = p.to_acc() * decay;
        *m += w1 * (g - *m);
        *v = *v * beta2 + w2 * g * g;
        let denom = v.sqrt() / bc2_sqrt + eps;
        x -= step_size * *m / denom;
        *p = T::from_acc(x);
    };
    let chunks = p
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(exp_avg.par_chunks_mut(CHUNK))
        .zip(exp_avg_sq.par_chunks_mut(CHUNK));
    match copy {
        None => chunks.for_each(|(((p, g), m), v)| {
            for (((p, g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                update(p, g, m, v);
            }
        }),
        Some((copy, cast)) => {
            chunks.zip(copy.par_chunks_mut(CHUNK)).for_each(|((((p, g), m), v), c)| {
                for ((((p, g), m), v), c) in p.iter_mut().zip(g).zip(m).zip(v).zip(c) {
                    update(p, g, m, v);
                    *c = cast(*p);
                }
            })
        }
    }
    Ok(())
}
