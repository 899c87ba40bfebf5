//! Data movement and reduction on host slices: the only loops that touch tensor data.
//!
//! Every output is built by appending to a `Vec` with the final capacity, in output
//! order, so no buffer is zero-filled first and each byte is written once.

use half::{bf16, f16};
use tpar_tensor::{Element, Tensor, TensorError};

use crate::ReduceOp;

/// An element type with an accumulator for reductions (f32 for bf16/f16).
pub(crate) trait Reducible: Element {
    /// The accumulator type.
    type A: Copy + Default;
    /// Widens to the accumulator.
    fn up(self) -> Self::A;
    /// Rounds back to the storage type.
    fn down(a: Self::A) -> Self;
    /// `a + b`.
    fn add(a: Self::A, b: Self::A) -> Self::A;
    /// `a * b`.
    fn mul(a: Self::A, b: Self::A) -> Self::A;
    /// The larger (NaN wins).
    fn max(a: Self::A, b: Self::A) -> Self::A;
    /// The smaller (NaN wins).
    fn min(a: Self::A, b: Self::A) -> Self::A;
    /// `a / n`.
    fn div(a: Self::A, n: usize) -> Self::A;
}

macro_rules! float_reducible {
    ($t:ty, $a:ty, $up:expr, $down:expr) => {
        impl Reducible for $t {
            type A = $a;
            #[inline(always)]
            fn up(self) -> $a {
                ($up)(self)
            }
            #[inline(always)]
            fn down(a: $a) -> Self {
                ($down)(a)
            }
            #[inline(always)]
            fn add(a: $a, b: $a) -> $a {
                a + b
            }
            #[inline(always)]
            fn mul(a: $a, b: $a) -> $a {
                a * b
            }
            #[inline(always)]
            fn max(a: $a, b: $a) -> $a {
                if b > a || b.is_nan() {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn min(a: $a, b: $a) -> $a {
                if b < a || b.is_nan() {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn div(a: $a, n: usize) -> $a {
                a / n as $a
            }
        }
    };
}

float_reducible!(f32, f32, |x: f32| x, |a: f32| a);
float_reducible!(f64, f64, |x: f64| x, |a: f64| a);
float_reducible!(bf16, f32, |x: bf16| x.to_f32(), bf16::from_f32);
float_reducible!(f16, f32, |x: f16| x.to_f32(), f16::from_f32);

impl Reducible for i64 {
    type A = i64;
    #[inline(always)]
    fn up(self) -> i64 {
        self
    }
    #[inline(always)]
    fn down(a: i64) -> Self {
        a
    }
    #[inline(always)]
    fn add(a: i64, b: i64) -> i64 {
        a.wrapping_add(b)
    }
    #[inline(always)]
    fn mul(a: i64, b: i64) -> i64 {
        a.wrapping_mul(b)
    }
    #[inline(always)]
    fn max(a: i64, b: i64) -> i64 {
        a.max(b)
    }
    #[inline(always)]
    fn min(a: i64, b: i64) -> i64 {
        a.min(b)
    }
    #[inline(always)]
    fn div(a: i64, n: usize) -> i64 {
        // Not reached: `Avg` on integers is rejected before any data moves.
        a / (n.max(1) as i64)
    }
}

/// Elements per accumulation block: small enough to stay in L1 next to the inputs.
pub(crate) const BLOCK: usize = 2048;

/// Reduces equal-length `runs` (one per member, in member order) elementwise and
/// appends the result to `out`. `acc` is scratch space.
pub(crate) fn reduce_runs<T: Reducible>(
    runs: &[&[T]],
    op: ReduceOp,
    acc: &mut Vec<T::A>,
    out: &mut Vec<T>,
) {
    let n = runs.len();
    match op {
        ReduceOp::Sum => fold(runs, acc, out, T::add, |a| a),
        ReduceOp::Avg => fold(runs, acc, out, T::add, |a| T::div(a, n)),
        ReduceOp::Max => fold(runs, acc, out, T::max, |a| a),
        ReduceOp::Min => fold(runs, acc, out, T::min, |a| a),
        ReduceOp::Product => fold(runs, acc, out, T::mul, |a| a),
    }
}

#[inline(always)]
fn fold<T: Reducible>(
    runs: &[&[T]],
    acc: &mut Vec<T::A>,
    out: &mut Vec<T>,
    f: impl Fn(T::A, T::A) -> T::A,
    fin: impl Fn(T::A) -> T::A,
) {
    let Some((first, rest)) = runs.split_first() else { return };
    let len = rest.iter().map(|r| r.len()).fold(first.len(), usize::min);
    let first = &first[..len];
    let Some((second, rest)) = rest.split_first() else {
        out.extend(first.iter().map(|&x| T::down(fin(x.up()))));
        return;
    };
    let second = &second[..len];
    if rest.is_empty() {
        // Two members (the common case): one fused pass, no accumulator buffer.
        out.extend(first.iter().zip(second).map(|(&x, &y)| T::down(fin(f(x.up(), y.up())))));
        return;
    }
    let mut start = 0;
    while start < len {
        let end = (start + BLOCK).min(len);
        acc.clear();
        acc.extend(
            first[start..end].iter().zip(&second[start..end]).map(|(&x, &y)| f(x.up(), y.up())),
        );
        for r in rest {
            for (a, &x) in acc.iter_mut().zip(&r[start..end]) {
                *a = f(*a, x.up());
            }
        }
        out.extend(acc.iter().map(|&a| T::down(fin(a))));
        start = end;
    }
}

/// A tensor's data viewed as `[outer, n, inner]`, narrowed to `start..start + len` on the
/// middle axis: the region a rank sends or receives along one tensor dim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Narrow {
    /// Size of the middle axis in the source.
    pub n: usize,
    /// Product of the dims after it.
    pub inner: usize,
    /// First index kept on the middle axis.
    pub start: usize,
    /// Number of indices kept.
    pub len: usize,
}

impl Narrow {
    /// The view of `dims` narrowed on `dim` (`dim < dims.len()`).
    pub fn of(dims: &[usize], dim: usize, start: usize, len: usize) -> Narrow {
        let inner = dims.get(dim + 1..).map_or(1, |d| d.iter().product());
        Narrow { n: dims.get(dim).copied().unwrap_or(1), inner, start, len }
    }

    /// The whole of `dims`, viewed around `dim`.
    pub fn whole(dims: &[usize], dim: usize) -> Narrow {
        let n = dims.get(dim).copied().unwrap_or(1);
        Narrow::of(dims, dim, 0, n)
    }

    /// Appends elements `from..to` of the view (in its row-major order) to `out`.
    /// Returns `false` (appending nothing more) if the view does not fit in `src`.
    pub fn append<T: Copy>(&self, src: &[T], from: usize, to: usize, out: &mut Vec<T>) -> bool {
        let row = self.len * self.inner;
        if row == 0 {
            return from >= to;
        }
        let mut p = from;
        while p < to {
            let (a, off) = (p / row, p % row);
            let take = (row - off).min(to - p);
            let s = a * self.n * self.inner + self.start * self.inner + off;
            match src.get(s..s + take) {
                Some(piece) => out.extend_from_slice(piece),
                None => return false,
            }
            p += take;
        }
        true
    }

    /// The contiguous runs of `src` the view covers, one per outer index, in order.
    pub fn runs<'a, T>(&self, src: &'a [T]) -> impl Iterator<Item = Option<&'a [T]>> + 'a {
        let (n, inner, start, len) = (self.n, self.inner, self.start, self.len);
        let outer = src.len().checked_div(n * inner).unwrap_or(0);
        (0..outer).map(move |a| {
            let s = (a * n + start) * inner;
            src.get(s..s + len * inner)
        })
    }
}

/// Runs `f` on the typed data of every tensor at once (read locks held for the call).
/// Tensors that share storage are locked once.
pub(crate) fn with_slices<T: Element, R>(
    ts: &[Tensor],
    f: impl FnOnce(&[&[T]]) -> R,
) -> Result<R, TensorError> {
    fn rec<T: Element, R, F: FnOnce(&[&[T]]) -> R>(
        ts: &[Tensor],
        mut prefix: Vec<&[T]>,
        f: F,
    ) -> Result<R, TensorError> {
        let i = prefix.len();
        let Some(t) = ts.get(i) else { return Ok(f(&prefix)) };
        if let Some(j) = (0..i).find(|&j| ts[j].same_storage(t)) {
            let s = prefix[j];
            prefix.push(s);
            return rec(ts, prefix, f);
        }
        t.with_data::<T, _>(|s| {
            let mut p: Vec<&[T]> = prefix;
            p.push(s);
            rec(ts, p, f)
        })?
    }
    rec(ts, Vec::with_capacity(ts.len()), f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_append_matches_index_math() {
        // src: [2, 5, 3], narrow dim 1 to 1..4
        let src: Vec<usize> = (0..30).collect();
        let v = Narrow::of(&[2, 5, 3], 1, 1, 3);
        let mut out = Vec::new();
        assert!(v.append(&src, 0, 18, &mut out));
        let want: Vec<usize> = (0..2)
            .flat_map(|a| (1..4).flat_map(move |b| (0..3).map(move |c| a * 15 + b * 3 + c)))
            .collect();
        assert_eq!(out, want);
        let mut part = Vec::new();
        assert!(v.append(&src, 4, 13, &mut part));
        assert_eq!(part, want[4..13]);
        let runs: Vec<&[usize]> = v.runs(&src).map(|r| r.unwrap()).collect();
        assert_eq!(runs, vec![&src[3..12], &src[18..27]]);
        assert!(!Narrow::of(&[2, 5, 3], 1, 4, 3).append(&src, 0, 18, &mut Vec::new()));
    }

    #[test]
    fn reduce_runs_all_ops() {
        let a = [1.0f32, -2.0, 3.0];
        let b = [4.0f32, 5.0, f32::NAN];
        let mut acc = Vec::new();
        let mut out = Vec::new();
        reduce_runs(&[&a, &b], ReduceOp::Sum, &mut acc, &mut out);
        reduce_runs(&[&a, &b], ReduceOp::Max, &mut acc, &mut out);
        reduce_runs(&[&b, &a], ReduceOp::Min, &mut acc, &mut out);
        assert_eq!(&out[..2], &[5.0, 3.0]);
        assert_eq!(&out[3..5], &[4.0, 5.0]);
        assert!(out[5].is_nan() && out[8].is_nan());
        assert_eq!(&out[6..8], &[1.0, -2.0]);
    }
}
