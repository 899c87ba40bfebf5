//! CPU matmul on the `gemm` crate.

use std::any::TypeId;
use std::convert::Infallible;
use std::mem::MaybeUninit;

use gemm::Parallelism;
use rayon::prelude::*;

use super::GemmShape;
use crate::{Acc, Float, Result};

/// Products with more multiply-adds than this run on every thread of the pool.
const PAR_THRESHOLD: usize = 64 * 64 * 64;

/// Fewest rows per thread for splitting a product by rows.
const SPLIT_MIN_ROWS: usize = 32;

/// Row chunks are rounded up to a multiple of this. The gemm crate computes a
/// row-major product transposed, so these rows are its micro-kernel's columns (6 per
/// f32 AVX-512 tile, the tile's 16-lane height running along the output's columns):
/// a chunk may end in a partial tile.
const ROW_ALIGN: usize = 32;

/// Views `&[T]` as `&[U]` when `T` and `U` are the same type.
fn cast<T: 'static, U: 'static>(s: &[T]) -> Option<&[U]> {
    if TypeId::of::<T>() == TypeId::of::<U>() {
        // SAFETY: T and U are the same type, so the layout and validity are identical.
        Some(unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<U>(), s.len()) })
    } else {
        None
    }
}

/// Views `&mut [T]` as `&mut [U]` when `T` and `U` are the same type.
fn cast_mut<T: 'static, U: 'static>(s: &mut [T]) -> Option<&mut [U]> {
    if TypeId::of::<T>() == TypeId::of::<U>() {
        // SAFETY: T and U are the same type, so the layout and validity are identical.
        Some(unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<U>(), s.len()) })
    } else {
        None
    }
}

/// Runs the product for element types the gemm crate supports (f32, f64).
/// Returns `false` for any other type.
fn native_any<E: Copy + Send + Sync + 'static>(
    s: &GemmShape,
    a: &[E],
    b: &[E],
    out: &mut [MaybeUninit<E>],
    accumulate: bool,
    serial: bool,
) -> bool {
    if let (Some(a), Some(b), Some(o)) =
        (cast::<E, f32>(a), cast(b), cast_mut::<_, MaybeUninit<f32>>(&mut *out))
    {
        native(s, a, b, o, accumulate, serial, 0.0f32, 1.0f32);
        true
    } else if let (Some(a), Some(b), Some(o)) =
        (cast::<E, f64>(a), cast(b), cast_mut::<_, MaybeUninit<f64>>(out))
    {
        native(s, a, b, o, accumulate, serial, 0.0f64, 1.0f64);
        true
    } else {
        false
    }
}

/// Calls `gemm::gemm` per batch (on this thread only when `serial`). `E` must
/// be `f32` or `f64`; extents were validated. Unless `accumulate`, `out` may be
/// uninitialized: every element is written and none is read.
fn native<E: Copy + Send + Sync + 'static>(
    s: &GemmShape,
    a: &[E],
    b: &[E],
    out: &mut [MaybeUninit<E>],
    accumulate: bool,
    serial: bool,
    zero: E,
    one: E,
) {
    let (m, n, k) = (s.m, s.n, s.k);
    let per_out = m * n;
    if per_out == 0 || s.batch == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            out.fill(MaybeUninit::new(zero));
        }
        return;
    }
    let (a_rs, a_cs) = if s.trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if s.trans_b { (1, k) } else { (n, 1) };
    let big = !serial && m.saturating_mul(n).saturating_mul(k) > PAR_THRESHOLD;
    // Rows `row0..row0 + o.len() / n` of batch `bi` into `o`.
    let rows_of = |bi: usize, row0: usize, o: &mut [MaybeUninit<E>], par: Parallelism| {
        let rows = o.len() / n;
        let a = &a[bi * s.a_batch_stride + row0 * a_rs..];
        let b = &b[bi * s.b_batch_stride..];
        debug_assert!(rows > 0 && rows * n == o.len() && row0 + rows <= m);
        debug_assert!(a.len() > (rows - 1) * a_rs + (k - 1) * a_cs);
        debug_assert!(b.len() > (k - 1) * b_rs + (n - 1) * b_cs);
        // SAFETY: `matmul` (or `small_matmul`'s assert) checked that A (resp. B) holds
        // (batch-1)*stride + m*k (resp. k*n) elements; `a` starts at row `row0` of batch
        // `bi` and `row0 + rows <= m`, so every index (i*a_rs + p*a_cs, i < rows) is in
        // bounds of `a`, likewise for `b`; `o` is exactly rows*n with row stride n.
        // E is f32 or f64 (see `native_any`), which gemm supports. With `accumulate`
        // false gemm writes every element of `o` without reading it (read_dst = false),
        // so `o` may be uninitialized; with it, the caller passed initialized data.
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                o.as_mut_ptr().cast::<E>(),
                1,
                n as isize,
                accumulate,
                a.as_ptr(),
                a_cs as isize,
                a_rs as isize,
                b.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                one,
                one,
                false,
                false,
                false,
                par,
            )
        }
    };
    // A large product is split by rows into one task per pool thread, each a serial
    // gemm call: no synchronisation inside the product (the gemm crate's own threads
    // meet once per depth block). Over the Llama step's products this takes 6-8 % less
    // time (`cargo bench --bench gemm -- --llama-step`, docs/PERF.md), and the result
    // does not depend on the thread count. Products with too few rows use the gemm
    // crate's split.
    let threads = if big { rayon::current_num_threads() } else { 1 };
    let one_batch = |bi: usize, o: &mut [MaybeUninit<E>]| {
        if threads > 1 && m >= threads * SPLIT_MIN_ROWS {
            let chunk = m.div_ceil(threads).next_multiple_of(ROW_ALIGN) * n;
            o.par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, oc)| rows_of(bi, i * (chunk / n), oc, Parallelism::None));
        } else {
            rows_of(bi, 0, o, if big { Parallelism::Rayon(0) } else { Parallelism::None });
        }
    };
    if s.batch > 1 && !big && !serial {
        out.par_chunks_mut(per_out)
            .enumerate()
            .for_each(|(bi, o)| rows_of(bi, 0, o, Parallelism::None));
    } else {
        for (bi, o) in out.chunks_mut(per_out).enumerate() {
            one_batch(bi, o);
        }
    }
}

/// Views initialized elements as possibly-uninitialized ones (always sound).
fn as_uninit<T>(s: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: MaybeUninit<T> has T's layout, and every value of T is a valid MaybeUninit<T>;
    // callers only ever write initialized values through the view.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<MaybeUninit<T>>(), s.len()) }
}

pub(super) fn matmul<T: Float>(
    s: &GemmShape,
    a: &[T],
    b: &[T],
    out: &mut [T],
    accumulate: bool,
) -> Result<()> {
    if native_any(s, a, b, as_uninit(out), accumulate, false) {
        return Ok(());
    }
    half_matmul(s, a, b, out, accumulate)
}

/// Output rows per task of the half-precision product.
const HALF_ROWS: usize = 64;

/// Half precision: B is widened to f32 once (every row block reuses it); A, the
/// output and, with `accumulate`, the old output are widened and rounded one block
/// of [`HALF_ROWS`] rows at a time, in cache, by the task that multiplies that block
/// (f32 accumulation, one rounding). No full-size f32 copy of A or the output exists.
fn half_matmul<T: Float>(
    s: &GemmShape,
    a: &[T],
    b: &[T],
    out: &mut [T],
    accumulate: bool,
) -> Result<()> {
    let (m, n, k) = (s.m, s.n, s.k);
    if m == 0 || n == 0 || s.batch == 0 {
        return Ok(());
    }
    let b32: Vec<T::Acc> = b.par_iter().map(|v| v.to_acc()).collect();
    let zero = <T::Acc as num_traits::Zero>::zero();
    let tasks = out.par_chunks_mut(m * n).enumerate().flat_map(|(bi, o)| {
        o.par_chunks_mut(HALF_ROWS * n).enumerate().map(move |(rb, oc)| (bi, rb * HALF_ROWS, oc))
    });
    tasks.for_each_init(
        || (Vec::new(), Vec::new()),
        |(a32, o32): &mut (Vec<T::Acc>, Vec<T::Acc>), (bi, i0, oc)| {
            let rows = oc.len() / n;
            let ab = &a[bi * s.a_batch_stride..];
            a32.clear();
            if s.trans_a {
                // Stored [k, m]: the block is columns i0..i0+rows, kept as [k, rows].
                for p in 0..k {
                    a32.extend(ab[p * m + i0..p * m + i0 + rows].iter().map(|v| v.to_acc()));
                }
            } else {
                a32.extend(ab[i0 * k..(i0 + rows) * k].iter().map(|v| v.to_acc()));
            }
            o32.clear();
            if accumulate {
                o32.extend(oc.iter().map(|v| v.to_acc()));
            } else {
                o32.resize(rows * n, zero);
            }
            let bb = &b32[bi * s.b_batch_stride..];
            small_matmul((rows, n, k), a32, s.trans_a, bb, s.trans_b, o32, accumulate);
            for (o, &x) in oc.iter_mut().zip(o32.iter()) {
                *o = T::from_acc(x);
            }
        },
    );
    Ok(())
}

/// `A·B` into a new vector, without zero-filling it first (the product writes
/// every element). Sizes must have been validated by the caller.
pub(super) fn matmul_new<T: Float>(s: &GemmShape, a: &[T], b: &[T]) -> Result<Vec<T>> {
    let len = s.batch * s.m * s.n;
    let mut done = false;
    let fill = |o: &mut [MaybeUninit<T>]| {
        done = native_any(s, a, b, o, false, false);
        if !done {
            o.fill(MaybeUninit::new(T::default()));
        }
        Ok::<_, Infallible>(())
    };
    // SAFETY: `fill` writes every element: gemm does when not accumulating (see
    // `native`), otherwise the zero fill does. The new vector comes from the host cache
    // (`tpar_memory::cache`) when one fits.
    let v = unsafe { tpar_memory::cache::filled(len, fill) }.unwrap_or_else(|n| match n {});
    if done {
        return Ok(v);
    }
    let mut v = v;
    matmul(s, a, b, &mut v, false)?;
    Ok(v)
}

/// Whether [`narrow_matmul_ldb`] takes products of `n` output columns over `k` for
/// accumulator type `A`.
pub(crate) fn narrow_takes<A: 'static>(n: usize, k: usize) -> bool {
    TypeId::of::<A>() == TypeId::of::<f32>() && super::narrow::supports(n, k, false)
}

/// Single-threaded `out (+)= a · b` on the narrow tile kernel, `a` `[m, k]`, `b` the
/// first `n` columns of `k` rows `ldb` apart: runs it and returns true where that kernel
/// takes the product (f32 with AVX-512, `n` of 32 or 64; see `narrow.rs`), else writes
/// nothing and returns false. Wrong lengths are an internal bug and panic.
pub(crate) fn narrow_matmul_ldb<A: Acc>(
    (m, n, k): (usize, usize, usize),
    a: &[A],
    b: &[A],
    ldb: usize,
    out: &mut [A],
    accumulate: bool,
) -> bool {
    if !super::narrow::supports(n, k, false) {
        return false;
    }
    match (cast::<A, f32>(a), cast(b), cast_mut::<A, f32>(out)) {
        (Some(a), Some(b), Some(o)) => {
            super::narrow::matmul_ldb((m, n, k), a, false, b, ldb, o, accumulate);
            true
        }
        _ => false,
    }
}

/// Single-threaded `out (+)= op(a) · op(b)` on accumulator buffers, for use
/// inside other kernels' parallel tasks. `a` is `[m, k]` (`[k, m]` if
/// `trans_a`), `b` is `[k, n]` (`[n, k]` if `trans_b`), `out` is `[m, n]`;
/// wrong lengths are an internal bug and panic.
pub(crate) fn small_matmul<A: Acc>(
    (m, n, k): (usize, usize, usize),
    a: &[A],
    trans_a: bool,
    b: &[A],
    trans_b: bool,
    out: &mut [A],
    accumulate: bool,
) {
    // Soundness of the unsafe gemm call rests on these lengths: check them always.
    assert!(a.len() >= m * k && b.len() >= k * n && out.len() == m * n, "small_matmul lengths");
    if super::narrow::supports(n, k, trans_b) {
        if let (Some(a), Some(b), Some(o)) = (cast::<A, f32>(a), cast(b), cast_mut::<A, f32>(out)) {
            super::narrow::matmul((m, n, k), a, trans_a, b, o, accumulate);
            return;
        }
    }
    let s = GemmShape {
        trans_a,
        trans_b,
        a_batch_stride: 0,
        b_batch_stride: 0,
        ..GemmShape::new(1, m, n, k)
    };
    if native_any(&s, a, b, as_uninit(out), accumulate, true) {
        return;
    }
    // Accumulator types other than f32/f64: plain loops.
    for i in 0..m {
        for j in 0..n {
            let mut acc = A::zero();
            for p in 0..k {
                let x = a[if trans_a { p * m + i } else { i * k + p }];
                let y = b[if trans_b { j * k + p } else { p * n + j }];
                acc += x * y;
            }
            let o = &mut out[i * n + j];
            *o = if accumulate { *o + acc } else { acc };
        }
    }
}
