//! Shared helpers: argument validation and small vectorizable reductions.

use crate::{Acc, KernelError, Result};

/// A `BadArguments` error.
pub(crate) fn bad(op: &'static str, what: impl Into<String>) -> KernelError {
    KernelError::BadArguments { op, what: what.into() }
}

/// Checks that buffer `name` has exactly `want` elements.
pub(crate) fn check_len(op: &'static str, name: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(bad(op, format!("{name} has {got} elements, expected {want}")))
    }
}

/// The product of `dims`, or an error naming them if it overflows `usize`.
pub(crate) fn numel(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(op, format!("size {dims:?} overflows usize")))
}

/// Sums `f(x[i])` with eight independent lanes so the compiler can vectorize.
#[inline(always)]
pub(crate) fn sum_map<X: Copy, A: Acc>(x: &[X], f: impl Fn(X) -> A) -> A {
    let mut lanes = [A::zero(); 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            lanes[l] += f(c[l]);
        }
    }
    let mut tail = A::zero();
    for &v in chunks.remainder() {
        tail += f(v);
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
        + tail
}

/// Dot product of two equal-length accumulator slices (eight lanes).
#[inline(always)]
pub(crate) fn dot<A: Acc>(a: &[A], b: &[A]) -> A {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut lanes = [A::zero(); 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut tail = A::zero();
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
        + tail
}
