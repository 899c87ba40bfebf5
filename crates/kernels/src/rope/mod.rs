//! Rotary position embedding in the rotate-half form (HF Llama):
//! `y = x * cos + rotate_half(x) * sin`, `rotate_half(x) = cat(-x2, x1)` where
//! `x1`/`x2` are the first/second halves of the head dim.
//!
//! `cos` and `sin` are `[seq, head_dim]` (full head dim). The backward pass is
//! the exact transpose of the forward linear map, so it stays correct even if
//! the two halves of `cos`/`sin` differ.

mod cpu;
pub mod reference;
#[cfg(test)]
mod tests;

use tpar_memory::cache::filled;

use crate::util::{bad, check_len, numel};
use crate::{Float, Out, Result};

/// Layout of the rotated tensor: element `(o, t, i, j)` is at
/// `((o*seq + t)*inner + i)*head_dim + j`.
///
/// `[b, h, s, d]` is `outer = b*h, inner = 1`; `[b, s, h, d]` is `outer = b, inner = h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Product of the dims before the sequence dim.
    pub outer: usize,
    /// Sequence length (rows of `cos`/`sin`).
    pub seq: usize,
    /// Product of the dims between the sequence dim and the head dim.
    pub inner: usize,
    /// Head dim (must be even).
    pub head_dim: usize,
}

fn validate(op: &'static str, s: &RopeShape, lens: [(&str, usize); 4]) -> Result<()> {
    if !s.head_dim.is_multiple_of(2) {
        return Err(bad(op, format!("{s:?}: head_dim must be even")));
    }
    let n = numel(op, &[s.outer, s.seq, s.inner, s.head_dim])?;
    let table = numel(op, &[s.seq, s.head_dim])?;
    check_len(op, lens[0].0, lens[0].1, n)?;
    check_len(op, "cos", lens[1].1, table)?;
    check_len(op, "sin", lens[2].1, table)?;
    check_len(op, lens[3].0, lens[3].1, n)
}

/// `y = x * cos + rotate_half(x) * sin` (see the module docs for the layout).
/// Writes every element of `y`.
pub fn rope_forward<T: Float, O: Out<T>>(
    s: &RopeShape,
    x: &[T],
    cos: &[T],
    sin: &[T],
    y: &mut [O],
) -> Result<()> {
    validate(
        "rope_forward",
        s,
        [("x", x.len()), ("cos", cos.len()), ("sin", sin.len()), ("y", y.len())],
    )?;
    cpu::apply(s, x, cos, sin, y, false, cpu::avx512());
    Ok(())
}

/// [`rope_forward`] into a new vector.
pub fn rope_forward_new<T: Float>(s: &RopeShape, x: &[T], cos: &[T], sin: &[T]) -> Result<Vec<T>> {
    // SAFETY: `rope_forward` writes every element of `y` when it returns Ok.
    unsafe { filled(x.len(), |y| rope_forward(s, x, cos, sin, y)) }
}

/// Gradient of [`rope_forward`] with respect to `x`: the transpose of the
/// forward map applied to `dy`. Writes every element of `dx`.
pub fn rope_backward<T: Float, O: Out<T>>(
    s: &RopeShape,
    dy: &[T],
    cos: &[T],
    sin: &[T],
    dx: &mut [O],
) -> Result<()> {
    validate(
        "rope_backward",
        s,
        [("dy", dy.len()), ("cos", cos.len()), ("sin", sin.len()), ("dx", dx.len())],
    )?;
    cpu::apply(s, dy, cos, sin, dx, true, cpu::avx512());
    Ok(())
}

/// [`rope_backward`] into a new vector.
pub fn rope_backward_new<T: Float>(
    s: &RopeShape,
    dy: &[T],
    cos: &[T],
    sin: &[T],
) -> Result<Vec<T>> {
    // SAFETY: `rope_backward` writes every element of `dx` when it returns Ok.
    unsafe { filled(dy.len(), |dx| rope_backward(s, dy, cos, sin, dx)) }
}
