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

/// From this many bytes of output, the local backend writes large outputs (an
/// `all_reduce_into`'s lent ones, an `all_gather`'s) with streaming stores: the result
/// no longer fits in the caches next to the inputs, so a store that first reads its
/// cache line in only adds traffic.
pub(crate) const STREAM_MIN_BYTES: usize = 16 << 20;

/// Copies `src` to `dst`; with `stream`, through streaming (non-temporal) stores where
/// the CPU has them, which write whole cache lines without reading them first. Callers
/// that stream call [`store_fence`] before others may read the data.
///
/// # Safety
/// `dst` is valid for writes of `src.len()` elements and does not overlap `src`.
pub(crate) unsafe fn store<T: Copy>(dst: *mut T, src: &[T], stream: bool) {
    let bytes = std::mem::size_of_val(src);
    let (d, s) = (dst.cast::<u8>(), src.as_ptr().cast::<u8>());
    #[cfg(target_arch = "x86_64")]
    if stream {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Plain copies up to the first 16-byte boundary of `dst` and after the last.
        let head = d.align_offset(16).min(bytes);
        let body = (bytes - head) / 16 * 16;
        // SAFETY: every range lies within the `bytes` both pointers are valid for;
        // `d + head` is 16-byte aligned, as `_mm_stream_si128` needs; SSE2 is part of
        // every x86_64 CPU.
        unsafe {
            std::ptr::copy_nonoverlapping(s, d, head);
            let mut o = head;
            while o < head + body {
                let v = _mm_loadu_si128(s.add(o).cast::<__m128i>());
                _mm_stream_si128(d.add(o).cast::<__m128i>(), v);
                o += 16;
            }
            std::ptr::copy_nonoverlapping(s.add(o), d.add(o), bytes - o);
        }
        return;
    }
    let _ = stream;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(s, d, bytes) };
}

/// Orders this thread's streaming stores before its later stores (and so before the
/// release of the lock that tells peers the chunk is written).
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions; SSE is part of every x86_64 CPU.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Appends `src` to `out`, through streaming stores when `stream` (the caller then calls
/// [`store_fence`] before the data is read by other threads).
pub(crate) fn push<T: Copy>(out: &mut Vec<T>, src: &[T], stream: bool) {
    if !stream {
        out.extend_from_slice(src);
        return;
    }
    out.reserve(src.len());
    let len = out.len();
    // SAFETY: `reserve` made room for `src.len()` elements past `len`, which `store`
    // initializes before `set_len` exposes them; `src` does not overlap `out`'s spare
    // capacity (it is borrowed while `out` is borrowed mutably).
    unsafe {
        store(out.as_mut_ptr().add(len), src, true);
        out.set_len(len + src.len());
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

    /// Appends elements `from..to` of the view (in its row-major order) to `out`, through
    /// streaming stores when `stream` ([`push`]). Returns `false` (appending nothing
    /// more) if the view does not fit in `src`.
    pub fn append<T: Copy>(
        &self,
        src: &[T],
        from: usize,
        to: usize,
        out: &mut Vec<T>,
        stream: bool,
    ) -> bool {
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
                Some(piece) => push(out, piece, stream),
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
        assert!(v.append(&src, 0, 18, &mut out, false));
        let want: Vec<usize> = (0..2)
            .flat_map(|a| (1..4).flat_map(move |b| (0..3).map(move |c| a * 15 + b * 3 + c)))
            .collect();
        assert_eq!(out, want);
        let mut part = Vec::new();
        assert!(v.append(&src, 4, 13, &mut part, false));
        assert_eq!(part, want[4..13]);
        let runs: Vec<&[usize]> = v.runs(&src).map(|r| r.unwrap()).collect();
        assert_eq!(runs, vec![&src[3..12], &src[18..27]]);
        assert!(!Narrow::of(&[2, 5, 3], 1, 4, 3).append(&src, 0, 18, &mut Vec::new(), false));
        let mut streamed = Vec::new();
        assert!(v.append(&src, 0, 18, &mut streamed, true));
        store_fence();
        assert_eq!(streamed, want);
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

    /// Streaming and plain stores copy the same bytes, at every alignment of the
    /// destination and every length around the 16-byte blocks, touching nothing else.
    #[test]
    fn streaming_store_copies_exactly() {
        let src: Vec<u8> = (0..200u8).collect();
        for stream in [false, true] {
            for off in 0..20 {
                for len in [0, 1, 15, 16, 17, 31, 33, 64, 100, 150] {
                    let mut dst = vec![0xAAu8; 200];
                    // SAFETY: `off + len <= 170 < 200`; `src` and `dst` are distinct.
                    unsafe { store(dst.as_mut_ptr().add(off), &src[..len], stream) };
                    store_fence();
                    assert_eq!(&dst[off..off + len], &src[..len], "off {off} len {len}");
                    assert!(dst[..off].iter().chain(&dst[off + len..]).all(|&b| b == 0xAA));
                }
            }
        }
    }
}
