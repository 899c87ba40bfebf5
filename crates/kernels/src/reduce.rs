//! Reductions over one dimension of a tensor viewed as `[outer, len, inner]`.

use rayon::prelude::*;

use crate::elementwise::PAR_THRESHOLD;
use num_traits::{Float as _, Zero as _};

use crate::{Float, KernelError, Result};

/// A reduction over one dimension of one tensor (`sum`, `amax`, `amin`). Reductions
/// across ranks are the collectives' business and use `ReduceOp` (`tpar-placements`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// Sum (accumulated in the accumulator type).
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

fn check(
    op: &'static str,
    x: usize,
    out: usize,
    outer: usize,
    len: usize,
    inner: usize,
) -> Result<()> {
    if x != outer * len * inner || out != outer * inner {
        return Err(KernelError::BadArguments {
            op,
            what: format!(
                "input {x} / output {out} elements do not fit [outer {outer}, len {len}, inner {inner}]"
            ),
        });
    }
    Ok(())
}

/// Reduces `x` viewed as `[outer, len, inner]` over the middle dim into `out` `[outer, inner]`.
/// Max/Min over an empty dim give -inf/+inf; a sum gives 0.
pub fn reduce<T: Float>(
    op: Reduction,
    x: &[T],
    outer: usize,
    len: usize,
    inner: usize,
    out: &mut [T],
) -> Result<()> {
    check("reduce", x.len(), out.len(), outer, len, inner)?;
    let init = match op {
        Reduction::Sum => T::Acc::zero(),
        Reduction::Max => T::Acc::neg_infinity(),
        Reduction::Min => T::Acc::infinity(),
    };
    let combine = |a: T::Acc, b: T::Acc| match op {
        Reduction::Sum => a + b,
        Reduction::Max => {
            if b > a || b.is_nan() {
                b
            } else {
                a
            }
        }
        Reduction::Min => {
            if b < a || b.is_nan() {
                b
            } else {
                a
            }
        }
    };
    let body = |(o, orow): (usize, &mut [T])| {
        let base = o * len * inner;
        if inner == 1 {
            let r = x[base..base + len].iter().fold(init, |a, &v| combine(a, v.to_acc()));
            orow[0] = T::from_acc(r);
        } else {
            let mut acc = vec![init; inner];
            for l in 0..len {
                let row = &x[base + l * inner..base + (l + 1) * inner];
                acc.iter_mut().zip(row).for_each(|(a, &v)| *a = combine(*a, v.to_acc()));
            }
            orow.iter_mut().zip(acc).for_each(|(o, a)| *o = T::from_acc(a));
        }
    };
    if inner == 0 || outer == 0 {
        return Ok(());
    }
    if x.len() >= PAR_THRESHOLD && outer > 1 {
        out.par_chunks_mut(inner).enumerate().for_each(body);
    } else {
        out.chunks_mut(inner).enumerate().for_each(body);
    }
    Ok(())
}

/// Max over the middle dim of `[outer, len, inner]` with the index of the first maximum.
/// An empty dim is an error (there is no index to return).
pub fn max_with_index<T: Float>(
    x: &[T],
    outer: usize,
    len: usize,
    inner: usize,
    out: &mut [T],
    index: &mut [i64],
) -> Result<()> {
    check("max_with_index", x.len(), out.len(), outer, len, inner)?;
    if index.len() != out.len() || len == 0 {
        return Err(KernelError::BadArguments {
            op: "max_with_index",
            what: format!(
                "index has {} elements for {} outputs over len {len}",
                index.len(),
                out.len()
            ),
        });
    }
    for o in 0..outer {
        for i in 0..inner {
            let mut best = T::Acc::neg_infinity();
            let mut arg = 0usize;
            for l in 0..len {
                let v = x[(o * len + l) * inner + i].to_acc();
                if v > best || (l == 0) || v.is_nan() {
                    best = v;
                    arg = l;
                    if v.is_nan() {
                        break;
                    }
                }
            }
            out[o * inner + i] = T::from_acc(best);
            index[o * inner + i] = arg as i64;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_middle_dim() {
        let x: Vec<f64> = (0..24).map(|v| v as f64).collect(); // [2,3,4]
        let mut out = vec![0.0; 8];
        reduce(Reduction::Sum, &x, 2, 3, 4, &mut out).unwrap();
        assert_eq!(out[0], 0.0 + 4.0 + 8.0);
        assert_eq!(out[5], 13.0 + 17.0 + 21.0);
        reduce(Reduction::Max, &x, 2, 3, 4, &mut out).unwrap();
        assert_eq!(out[0], 8.0);
        let mut idx = vec![0; 8];
        max_with_index(&x, 2, 3, 4, &mut out, &mut idx).unwrap();
        assert!(idx.iter().all(|&i| i == 2));
    }
}
