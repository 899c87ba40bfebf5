//! RMSNorm over the last dim: `y = x * rstd * w`, `rstd = 1/sqrt(mean(x^2) + eps)`.
//!
//! Statistics and gradients are computed in the accumulator type
//! ([`Float::Acc`]); `rstd` is saved per row for the backward pass.

mod cpu;
pub mod reference;
#[cfg(test)]
mod tests;

use tpar_memory::cache::filled;

use crate::util::{check_len, numel};
use crate::{Float, Out, Result};

/// Forward RMSNorm of `rows` rows of length `dim`.
///
/// `x`, `y`: `[rows, dim]`; `weight`: `[dim]`; `rstd` (output): `[rows]`.
/// A row of length 0 has mean square 0, so `rstd = 1/sqrt(eps)`. Writes every
/// element of `y` and `rstd`.
pub fn rmsnorm_forward<T: Float, O: Out<T>>(
    x: &[T],
    weight: &[T],
    rows: usize,
    dim: usize,
    eps: f64,
    y: &mut [O],
    rstd: &mut [T::Acc],
) -> Result<()> {
    const OP: &str = "rmsnorm_forward";
    let n = numel(OP, &[rows, dim])?;
    check_len(OP, "x", x.len(), n)?;
    check_len(OP, "weight", weight.len(), dim)?;
    check_len(OP, "y", y.len(), n)?;
    check_len(OP, "rstd", rstd.len(), rows)?;
    cpu::forward(x, weight, dim, eps, y, rstd);
    Ok(())
}

/// [`rmsnorm_forward`] with `y` in a new vector.
pub fn rmsnorm_forward_new<T: Float>(
    x: &[T],
    weight: &[T],
    rows: usize,
    dim: usize,
    eps: f64,
    rstd: &mut [T::Acc],
) -> Result<Vec<T>> {
    // SAFETY: `rmsnorm_forward` writes every element of `y` when it returns Ok.
    unsafe { filled(x.len(), |y| rmsnorm_forward(x, weight, rows, dim, eps, y, rstd)) }
}

/// Backward RMSNorm: writes `dx` (`[rows, dim]`) and overwrites `dweight`
/// (`[dim]`) with `sum over rows of dy * x * rstd`. Writes every element of `dx`.
///
/// `rstd` is the `[rows]` buffer saved by [`rmsnorm_forward`]. The weight
/// gradient is reduced over fixed row blocks in a fixed order, so the result
/// does not depend on the number of threads.
pub fn rmsnorm_backward<T: Float, O: Out<T>>(
    x: &[T],
    weight: &[T],
    rstd: &[T::Acc],
    dy: &[T],
    rows: usize,
    dim: usize,
    dx: &mut [O],
    dweight: &mut [T::Acc],
) -> Result<()> {
    const OP: &str = "rmsnorm_backward";
    let n = numel(OP, &[rows, dim])?;
    check_len(OP, "x", x.len(), n)?;
    check_len(OP, "weight", weight.len(), dim)?;
    check_len(OP, "rstd", rstd.len(), rows)?;
    check_len(OP, "dy", dy.len(), n)?;
    check_len(OP, "dx", dx.len(), n)?;
    check_len(OP, "dweight", dweight.len(), dim)?;
    cpu::backward(x, weight, rstd, dy, rows, dim, dx, dweight);
    Ok(())
}

/// [`rmsnorm_backward`] with `dx` in a new vector.
pub fn rmsnorm_backward_new<T: Float>(
    x: &[T],
    weight: &[T],
    rstd: &[T::Acc],
    dy: &[T],
    rows: usize,
    dim: usize,
    dweight: &mut [T::Acc],
) -> Result<Vec<T>> {
    // SAFETY: `rmsnorm_backward` writes every element of `dx` when it returns Ok.
    unsafe { filled(x.len(), |dx| rmsnorm_backward(x, weight, rstd, dy, rows, dim, dx, dweight)) }
}
