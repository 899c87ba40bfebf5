//! f32 products with narrow outputs, `out[m, n] (+)= op(A) · B` for `n` of 32 or 64
//! columns, on an AVX-512 register tile of our own.
//!
//! Attention's tile products have such outputs: `P V`, `dS K`, `Pᵀ dO` and `dSᵀ Q` have
//! head-dim columns. The gemm crate computes a row-major product transposed, so these
//! run on its narrower micro-kernels (32 rows of its tile for a head dim of 32), with
//! packed operands. Here a block of output rows stays in registers (two or four
//! 16-lane vectors per row, 24 accumulators), each row of `B` is loaded once per block,
//! and each element of `A` is broadcast from memory straight into the multiply-adds; `A`
//! may be given transposed at no cost. `B` may not: a transposing copy per call measured
//! slower than the gemm crate. The attention backward instead transposes each key tile
//! once for all its query tiles, which puts `Q Kᵀ` and `dO Vᵀ` here when the key tile is
//! 32 or 64 keys wide, and the forward transposes every key tile once per call; rows of
//! `B` may lie further apart than `n` (`matmul_ldb`), so a product may take the first
//! columns of such a transposed tile.

/// The longest contraction [`matmul`] takes: `B` (at most 128 KiB) then stays in the
/// L2 cache while every row block streams through it. Attention's tiles contract over
/// at most 256 keys or queries.
const MAX_K: usize = 512;

/// Whether [`matmul`] runs this product: f32 on a CPU with AVX-512, `n` of 32 or 64,
/// `k` up to [`MAX_K`], `B` not transposed.
pub(super) fn supports(n: usize, k: usize, trans_b: bool) -> bool {
    (n == 32 || n == 64) && k <= MAX_K && !trans_b && avx512()
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512() -> bool {
    false
}

/// `out (+)= op(a) · b` as [`small_matmul`](super::small_matmul) takes it, for a shape
/// [`supports`] accepts (the caller checked it and the lengths: `a` holds `m * k`
/// elements, `b` `k * n`, `out` `m * n`).
pub(super) fn matmul(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    trans_a: bool,
    b: &[f32],
    out: &mut [f32],
    accumulate: bool,
) {
    matmul_ldb((m, n, k), a, trans_a, b, n, out, accumulate)
}

/// [`matmul`] with the rows of `B` `ldb` elements apart (at least `n`): `B` may be the
/// first `n` columns of a wider row-major matrix.
pub(super) fn matmul_ldb(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    trans_a: bool,
    b: &[f32],
    ldb: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    let b_len = if k == 0 { 0 } else { (k - 1) * ldb + n };
    assert!(
        supports(n, k, false)
            && ldb >= n
            && a.len() >= m * k
            && b.len() >= b_len
            && out.len() == m * n
    );
    // A element (i, p) sits at `i * rs + p * cs`.
    let (rs, cs) = if trans_a { (1, m) } else { (k, 1) };
    let ops = Operands { m, k, a, rs, cs, b, ldb, accumulate };
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `supports` checked AVX-512F; the lengths are asserted above, and every
    // index the kernels form stays below them.
    unsafe {
        match n {
            32 => avx512::rows::<2>(&ops, out),
            _ => avx512::rows::<4>(&ops, out),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ops, out);
}

/// The inputs of one product: `m x k` times `k x n`, `A` element `(i, p)` at
/// `a[i * rs + p * cs]`, `B` row-major with rows `ldb` apart; the output is added to
/// when `accumulate`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Operands<'a> {
    m: usize,
    k: usize,
    a: &'a [f32],
    rs: usize,
    cs: usize,
    b: &'a [f32],
    ldb: usize,
    accumulate: bool,
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Operands;

    /// Output rows per register block: `NV` vectors of 16 lanes per row, 24 accumulators.
    const fn block_rows(nv: usize) -> usize {
        24 / nv
    }

    /// Every row block of the product; `NV * 16` is `n`.
    ///
    /// # Safety
    /// AVX-512F is available; `ops.a` holds every `i * rs + p * cs` for `i < m`,
    /// `p < k`; `ops.b` holds `(k - 1) * ldb + NV * 16` and `out` `m * NV * 16` elements.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows<const NV: usize>(ops: &Operands, out: &mut [f32]) {
        let mr = block_rows(NV);
        let mut i = 0;
        while i < ops.m {
            let r = mr.min(ops.m - i);
            // SAFETY: rows `i..i + r` are in range; the caller's contract otherwise.
            unsafe {
                macro_rules! go {
                    ($($n:literal)*) => {
                        match r {
                            $($n => block::<NV, $n>(ops, i, out),)*
                            _ => unreachable!(),
                        }
                    };
                }
                if NV == 2 {
                    go!(1 2 3 4 5 6 7 8 9 10 11 12)
                } else {
                    go!(1 2 3 4 5 6)
                }
            }
            i += r;
        }
    }

    /// Output rows `i0..i0 + R`.
    ///
    /// # Safety
    /// As [`rows`], with `i0 + R <= m`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn block<const NV: usize, const R: usize>(ops: &Operands, i0: usize, out: &mut [f32]) {
        let Operands { k, rs, cs, ldb, accumulate, .. } = *ops;
        let n = NV * 16;
        let (a, b, o) = (ops.a.as_ptr(), ops.b.as_ptr(), out.as_mut_ptr());
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        // SAFETY: every offset is below the lengths the caller vouched for.
        unsafe {
            let arow = a.add(i0 * rs);
            for p in 0..k {
                let bp = b.add(p * ldb);
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(bp.add(v * 16));
                }
                let ap = arow.add(p * cs);
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*ap.add(r * rs));
                    for (v, c) in row.iter_mut().enumerate() {
                        *c = _mm512_fmadd_ps(x, bv[v], *c);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                let op = o.add((i0 + r) * n);
                for (v, c) in row.iter().enumerate() {
                    let dst = op.add(v * 16);
                    let val = if accumulate { _mm512_add_ps(_mm512_loadu_ps(dst), *c) } else { *c };
                    _mm512_storeu_ps(dst, val);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row-block remainder, short and long contractions, `A` plain and
    /// transposed, overwrite and accumulate: equal to a plain triple loop in f64 up to
    /// f32 rounding.
    #[test]
    fn narrow_products_match_a_plain_loop() {
        if !supports(32, 1, false) {
            return; // no AVX-512: the gemm crate runs these products (tested there).
        }
        let val = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 1999) as f32 / 999.5 - 1.0;
        for n in [32, 64] {
            for m in (1..=26).chain([64, 128]) {
                for k in [1, 5, 32, 64, 129] {
                    for trans_a in [false, true] {
                        for accumulate in [false, true] {
                            let a: Vec<f32> = (0..m * k).map(|i| val(i, 1)).collect();
                            let b: Vec<f32> = (0..k * n).map(|i| val(i, 2)).collect();
                            let init: Vec<f32> = (0..m * n).map(|i| val(i, 3)).collect();
                            let mut out = init.clone();
                            matmul((m, n, k), &a, trans_a, &b, &mut out, accumulate);
                            for i in 0..m {
                                for j in 0..n {
                                    let mut want =
                                        if accumulate { init[i * n + j] as f64 } else { 0.0 };
                                    for p in 0..k {
                                        let x = a[if trans_a { p * m + i } else { i * k + p }];
                                        want += x as f64 * b[p * n + j] as f64;
                                    }
                                    let got = out[i * n + j] as f64;
                                    assert!(
                                        (got - want).abs() <= 1e-5 * (1.0 + k as f64),
                                        "n {n} m {m} k {k} trans_a {trans_a} acc {accumulate} \
                                         ({i}, {j}): {got} vs {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// `B` as the first `n` columns of wider rows (`ldb` past `n`): the same as a plain
    /// loop over those columns.
    #[test]
    fn b_rows_may_be_wider_than_the_output() {
        if !supports(32, 1, false) {
            return;
        }
        let val = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 1999) as f32 / 999.5 - 1.0;
        for (n, ldb) in [(32, 64), (32, 33), (64, 128)] {
            let (m, k) = (13, 40);
            let a: Vec<f32> = (0..m * k).map(|i| val(i, 1)).collect();
            let b: Vec<f32> = (0..(k - 1) * ldb + n).map(|i| val(i, 2)).collect();
            let mut out = vec![0f32; m * n];
            matmul_ldb((m, n, k), &a, false, &b, ldb, &mut out, false);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 =
                        (0..k).map(|p| a[i * k + p] as f64 * b[p * ldb + j] as f64).sum();
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4,
                        "n {n} ldb {ldb} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
