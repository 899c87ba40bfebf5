//! Softmax and log-softmax over the last dim, numerically stable (the row max
//! is subtracted before `exp`), accumulating in [`Float::Acc`].
//!
//! A row whose entries are all `-inf` (fully masked) gives zeros from
//! [`softmax_forward`] and `-inf` everywhere from [`log_softmax_forward`]
//! (i.e. probability zero), never NaN.

mod cpu;
pub mod reference;
#[cfg(test)]
mod tests;

use crate::util::{check_len, numel};
use crate::{Float, Result};

fn validate(op: &'static str, rows: usize, cols: usize, bufs: &[(&str, usize)]) -> Result<()> {
    let n = numel(op, &[rows, cols])?;
    bufs.iter().try_for_each(|&(name, len)| check_len(op, name, len, n))
}

/// `y = softmax(x)` row by row; `x`, `y`: `[rows, cols]`.
pub fn softmax_forward<T: Float>(x: &[T], rows: usize, cols: usize, y: &mut [T]) -> Result<()> {
    validate("softmax_forward", rows, cols, &[("x", x.len()), ("y", y.len())])?;
    cpu::forward(x, cols, y, false);
    Ok(())
}

/// `dx = y * (dy - sum(dy * y))` row by row, given the softmax output `y`.
pub fn softmax_backward<T: Float>(
    y: &[T],
    dy: &[T],
    rows: usize,
    cols: usize,
    dx: &mut [T],
) -> Result<()> {
    let bufs = [("y", y.len()), ("dy", dy.len()), ("dx", dx.len())];
    validate("softmax_backward", rows, cols, &bufs)?;
    cpu::backward(y, dy, cols, dx, false);
    Ok(())
}

/// `y = log_softmax(x) = x - max - log(sum(exp(x - max)))` row by row.
pub fn log_softmax_forward<T: Float>(x: &[T], rows: usize, cols: usize, y: &mut [T]) -> Result<()> {
    validate("log_softmax_forward", rows, cols, &[("x", x.len()), ("y", y.len())])?;
    cpu::forward(x, cols, y, true);
    Ok(())
}

/// `dx = dy - exp(y) * sum(dy)` row by row, given the log-softmax output `y`.
pub fn log_softmax_backward<T: Float>(
    y: &[T],
    dy: &[T],
    rows: usize,
    cols: usize,
    dx: &mut [T],
) -> Result<()> {
    let bufs = [("y", y.len()), ("dy", dy.len()), ("dx", dx.len())];
    validate("log_softmax_backward", rows, cols, &bufs)?;
    cpu::backward(y, dy, cols, dx, true);
    Ok(())
}
