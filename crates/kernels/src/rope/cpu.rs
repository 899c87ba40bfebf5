//! Rayon RoPE kernel: blocks of whole `(o, t)` rows of `inner * head_dim` elements,
//! at least [`BLOCK`] elements per task.

use rayon::prelude::*;

use super::RopeShape;
use crate::elementwise::PAR_THRESHOLD;
use crate::{Float, Out};

/// Elements per parallel task (whole rows; a row longer than this is one task).
const BLOCK: usize = 16 * 1024;

/// Forward (`transpose = false`) or its transpose (`true`), with
/// `x = (x1, x2)`, `c = (c1, c2)`, `s = (s1, s2)`:
/// forward `y1 = x1 c1 - x2 s1`, `y2 = x2 c2 + x1 s2`;
/// transpose `y1 = x1 c1 + x2 s2`, `y2 = x2 c2 - x1 s1`.
///
/// Both are `y1 = x1 a1 + x2 b1`, `y2 = x2 a2 + x1 b2` with the tables of position `t`
/// laid out as `[a1, a2, b1, b2]` (each `head_dim / 2` long): `b1 = -s1, b2 = s2`
/// forward, `b1 = s2, b2 = -s1` transposed. Adding a negated product rounds as
/// subtracting it does.
///
/// Built for AVX-512 when `avx512` (which the CPU must have, [`avx512`]), else
/// portable: the same operations in the same order, so the same bits.
pub(super) fn apply<T: Float, O: Out<T>>(
    s: &RopeShape,
    x: &[T],
    cos: &[T],
    sin: &[T],
    y: &mut [O],
    transpose: bool,
    avx512: bool,
) {
    let (hd, seq) = (s.head_dim, s.seq);
    let row = s.inner * hd;
    if row == 0 || y.is_empty() {
        return;
    }
    let half = hd / 2;
    // [a1, a2, b1, b2] of every position: a = cos, b as in the docs above.
    let mut tables: Vec<T::Acc> = Vec::with_capacity(2 * seq * hd);
    for (c, sn) in cos.chunks_exact(hd).zip(sin.chunks_exact(hd)).take(seq) {
        let (s1, s2) = sn.split_at(half);
        // forward (-s1, s2), transposed (s2, -s1)
        let (b1, b2) = if transpose { (s2, s1) } else { (s1, s2) };
        let acc = |v: &T, negate: bool| if negate { -v.to_acc() } else { v.to_acc() };
        tables.extend(c.iter().map(|v| v.to_acc()));
        tables.extend(b1.iter().map(|v| acc(v, !transpose)));
        tables.extend(b2.iter().map(|v| acc(v, transpose)));
    }
    let rows = (BLOCK / row).max(1);
    let block = |(i, (y, x)): (usize, (&mut [O], &[T]))| {
        let t = (i * rows) % seq;
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the caller found AVX-512F, AVX2 and FMA on this CPU.
            return unsafe { rows_avx512(y, x, &tables, t, s) };
        }
        let _ = avx512;
        rows_any(y, x, &tables, t, s)
    };
    let chunk = rows * row;
    if y.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).enumerate().for_each(block);
    } else {
        y.chunks_mut(chunk).zip(x.chunks(chunk)).enumerate().for_each(block);
    }
}

/// Whether this CPU runs the AVX-512 build.
pub(super) fn avx512() -> bool {
    crate::vmath::isa() == crate::vmath::Isa::Avx512
}

/// [`rows_any`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn rows_avx512<T: Float, O: Out<T>>(
    y: &mut [O],
    x: &[T],
    tables: &[T::Acc],
    t: usize,
    s: &RopeShape,
) {
    rows_any(y, x, tables, t, s)
}

/// [`rows_of`] with a constant half head dim where it is a common one.
#[inline(always)]
fn rows_any<T: Float, O: Out<T>>(y: &mut [O], x: &[T], tables: &[T::Acc], t: usize, s: &RopeShape) {
    match s.head_dim / 2 {
        16 => rows_of::<T, O, 16>(y, x, tables, t, s),
        32 => rows_of::<T, O, 32>(y, x, tables, t, s),
        64 => rows_of::<T, O, 64>(y, x, tables, t, s),
        _ => rows_of::<T, O, 0>(y, x, tables, t, s),
    }
}

/// Whole rows of `y` from `x`, the first at position `t`; `H` is half the head dim, or 0
/// for one known only at run time.
#[inline(always)]
fn rows_of<T: Float, O: Out<T>, const H: usize>(
    y: &mut [O],
    x: &[T],
    tables: &[T::Acc],
    mut t: usize,
    s: &RopeShape,
) {
    let (hd, seq) = (if H > 0 { 2 * H } else { s.head_dim }, s.seq);
    let half = hd / 2;
    let row = s.inner * hd;
    for (y, x) in y.chunks_exact_mut(row).zip(x.chunks_exact(row)) {
        let tab = &tables[t * 2 * hd..(t + 1) * 2 * hd];
        let (a, b) = tab.split_at(hd);
        let ((a1, a2), (b1, b2)) = (a.split_at(half), b.split_at(half));
        for (y, x) in y.chunks_exact_mut(hd).zip(x.chunks_exact(hd)) {
            let (y1, y2) = y.split_at_mut(half);
            let (x1, x2) = x.split_at(half);
            half_row(y1, x1, x2, a1, b1);
            half_row(y2, x2, x1, a2, b2);
        }
        t += 1;
        if t == seq {
            t = 0;
        }
    }
}

/// `y = u a + v b`, elementwise, rounded once to `T`.
#[inline(always)]
fn half_row<T: Float, O: Out<T>>(y: &mut [O], u: &[T], v: &[T], a: &[T::Acc], b: &[T::Acc]) {
    for ((y, (u, v)), (a, b)) in y.iter_mut().zip(u.iter().zip(v)).zip(a.iter().zip(b)) {
        y.put(T::from_acc(u.to_acc() * *a + v.to_acc() * *b));
    }
}
