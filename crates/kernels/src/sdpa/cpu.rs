//! Rayon flash-attention kernels: key tiles with an online softmax forward,
//! one pass over (key tile, query tile) pairs backward that recomputes the
//! probabilities from `lse` once and feeds `dq`, `dk` and `dv` from them. Tile
//! products (`Q Kᵀ`, `P V`, ...) run on single-threaded gemm calls in the
//! accumulator type (those with outputs of 32 or 64 columns on an AVX-512 register
//! tile of our own, `gemm/narrow.rs`: the head-dim products, and against each key
//! tile's transpose `Q Kᵀ`, forward and backward, and `dO Vᵀ`); parallelism comes from
//! the task split. A causal tile on the diagonal is computed in row pieces that see
//! fewer keys ([`causal_pieces`]).

use num_traits::{Float as _, One, Zero};
use rayon::prelude::*;

use super::{SdpaMask, SdpaShape, SdpaTiles};
use crate::gemm::{narrow_matmul_ldb, narrow_takes, small_matmul};
use crate::{Acc, Float, Out};

/// Backward tasks wanted at least: when `batch * kv_heads` is smaller, each
/// head's keys are split into several tasks, each with its own `dq` partial
/// sum (the split depends on the shape only, so results do not depend on the
/// thread count).
const MIN_BACKWARD_TASKS: usize = 8;

/// One task: `(group, first row, rows, rows of a, rows of b)`.
type Block<'a, X, Y> = (usize, usize, usize, &'a mut [X], &'a mut [Y]);

/// Splits `a: [groups, len, aw]` and `b: [groups, len, bw]` into blocks of at
/// most `block` rows that never straddle a group.
fn blocks<'a, X, Y>(
    mut a: &'a mut [X],
    aw: usize,
    mut b: &'a mut [Y],
    bw: usize,
    groups: usize,
    len: usize,
    block: usize,
) -> Vec<Block<'a, X, Y>> {
    let mut v = Vec::with_capacity(groups * len.div_ceil(block));
    for g in 0..groups {
        let mut i0 = 0;
        while i0 < len {
            let n = block.min(len - i0);
            let (x, rest) = std::mem::take(&mut a).split_at_mut(n * aw);
            a = rest;
            let (y, rest) = std::mem::take(&mut b).split_at_mut(n * bw);
            b = rest;
            v.push((g, i0, n, x, y));
            i0 += n;
        }
    }
    v
}

/// Widens `src` into `dst`, multiplying by `mul`.
fn load<T: Float>(dst: &mut Vec<T::Acc>, src: &[T], mul: T::Acc) {
    dst.clear();
    dst.extend(src.iter().map(|x| x.to_acc() * mul));
}

/// `src` in the accumulator type: itself when it already is (f32, f64), else widened
/// into `buf`.
fn view<'a, T: Float>(buf: &'a mut Vec<T::Acc>, src: &'a [T]) -> &'a [T::Acc] {
    match T::as_acc(src) {
        Some(s) => s,
        None => {
            load(buf, src, One::one());
            buf
        }
    }
}

/// `dst[c * ld + r] = src[r * cols + c]`: the `cols x rows` transpose of row-major
/// `src` (`rows x cols`), its rows `ld` (at least `rows`) apart in `dst`.
fn transpose_into<A: Copy>(src: &[A], rows: usize, cols: usize, ld: usize, dst: &mut [A]) {
    if cols == 0 {
        return; // nothing to move (and no rows to cut `src` into)
    }
    for (r, row) in src[..rows * cols].chunks_exact(cols).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            dst[c * ld + r] = x;
        }
    }
}

/// The row pieces `(first row, rows, keys)` to compute query rows `i0..i0 + nq`
/// against keys `j0..j0 + nk` in: all rows against all keys, except where causal
/// attention hides keys from the tile's first rows. There the rows are cut in two at
/// the multiple of 32 rows that computes the fewest scores, and each piece takes only
/// the keys its last row sees (a diagonal 64 x 64 tile costs three quarters of it).
/// The keys left out are ones every row of the piece has at probability 0, so nothing
/// changes but the work; pieces whose rows see none of the keys are left out.
fn causal_pieces(
    causal: bool,
    i0: usize,
    nq: usize,
    j0: usize,
    nk: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    // Keys of the tile seen by the rows before `end` (relative to `i0`).
    let seen = |end: usize| if causal { (i0 + end).saturating_sub(j0).min(nk) } else { nk };
    let mut best = (nq, seen(nq) * nq);
    for cut in (32..nq).step_by(32) {
        let area = seen(cut) * cut + seen(nq) * (nq - cut);
        if area < best.1 {
            best = (cut, area);
        }
    }
    let cut = best.0;
    [(0, cut, seen(cut)), (cut, nq - cut, seen(nq))]
        .into_iter()
        .filter(|&(_, rows, keys)| rows > 0 && keys > 0)
}

/// The largest of `row` (NaNs ignored, as `f32::max` does), `init` when it is
/// empty; 16 running maxima, one per lane, so the loop vectorizes.
fn row_max<A: Acc>(row: &[A], init: A) -> A {
    let mut lanes = [init; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let tail = chunks.remainder().iter().fold(init, |a, &x| if x > a { x } else { a });
    lanes.iter().fold(tail, |a, &x| if x > a { x } else { a })
}

/// What the mask does to one key tile of one head.
#[derive(Clone, Copy, PartialEq)]
enum TileMask {
    /// Nothing: no mask, or every value of a key mask is 0 here.
    Open,
    /// Every key is masked out (`-inf` in a key mask): the tile is skipped.
    Closed,
    /// A key mask (the same for every query row) starting at this offset.
    Keys(usize),
    /// A mask that varies with the query row.
    Rows,
}

/// Shared index arithmetic for one call.
struct Ctx<'a, T> {
    s: &'a SdpaShape,
    mask: Option<&'a SdpaMask<'a, T>>,
}

impl<T: Float> Ctx<'_, T> {
    /// The kv head (flattened with the batch) that q head `bh` reads.
    fn kv_of(&self, bh: usize) -> usize {
        let s = self.s;
        (bh / s.q_heads) * s.kv_heads + (bh % s.q_heads) / (s.q_heads / s.kv_heads)
    }

    /// Offset of mask element `(b, h, i, j)` of flattened head `bh`.
    fn mask_offset(&self, m: &SdpaMask<T>, bh: usize, i: usize, j: usize) -> usize {
        let (b, h) = (bh / self.s.q_heads, bh % self.s.q_heads);
        b * m.batch_stride + h * m.head_stride + i * m.row_stride + j
    }

    /// Classifies keys `j0..j0 + nk` of head `bh`. A mask that does not vary with
    /// the query row (a `[b, 1, 1, kv]` key-padding mask) is read once per tile, so
    /// fully padded tiles cost nothing and fully open ones no additions.
    fn tile_mask(&self, bh: usize, j0: usize, nk: usize) -> TileMask {
        let Some(m) = self.mask else { return TileMask::Open };
        if m.row_stride != 0 {
            return TileMask::Rows;
        }
        let off = self.mask_offset(m, bh, 0, j0);
        let keys = &m.data[off..off + nk];
        let zero = T::Acc::zero();
        if keys.iter().all(|v| v.to_acc() == zero) {
            TileMask::Open
        } else if keys.iter().all(|v| v.to_acc() == T::Acc::neg_infinity()) {
            TileMask::Closed
        } else {
            TileMask::Keys(off)
        }
    }

    /// Turns raw `q·k` scores of query `i` (of flattened head `bh`) against keys
    /// `j0..j0 + row.len()` into masked scores: adds the mask to the keys the query
    /// may see (all of them, or the first `vis` when causal) and sets the others,
    /// which would be `-inf` and then `e^-inf`, to 0 at once. Returns `vis`: only the
    /// first `vis` scores need exponentiating.
    fn mask_scores(
        &self,
        bh: usize,
        i: usize,
        j0: usize,
        tm: TileMask,
        row: &mut [T::Acc],
    ) -> usize {
        let vis = if self.s.causal { (i + 1).saturating_sub(j0).min(row.len()) } else { row.len() };
        row[vis..].fill(T::Acc::zero());
        let add = match (tm, self.mask) {
            (TileMask::Keys(off), Some(m)) => Some(&m.data[off..off + vis]),
            (TileMask::Rows, Some(m)) => {
                let off = self.mask_offset(m, bh, i, j0);
                Some(&m.data[off..off + vis])
            }
            _ => None,
        };
        if let Some(add) = add {
            for (x, v) in row[..vis].iter_mut().zip(add) {
                *x += v.to_acc();
            }
        }
        vis
    }
}

#[cfg(test)]
static PORTABLE_ONLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the tasks must run their portable build (a test compares the two builds).
#[cfg(all(test, target_arch = "x86_64"))]
fn portable_only() -> bool {
    PORTABLE_ONLY.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(all(not(test), target_arch = "x86_64"))]
fn portable_only() -> bool {
    false
}

/// Runs task function `$plain` on `$args`, or its AVX-512 build `$avx512` where the CPU
/// has AVX-512: the loops of the task bodies outside the products (loads, the softmax
/// bookkeeping, `dS`, transposes, stores) are then compiled 16 lanes wide. The same
/// operations in the same order either way: the results are the same bits.
macro_rules! tuned {
    ($plain:ident, $avx512:ident, $($args:expr),*) => {{
        #[cfg(target_arch = "x86_64")]
        let r = if crate::vmath::isa() == crate::vmath::Isa::Avx512 && !portable_only() {
            // SAFETY: `isa` found AVX-512F, AVX2 and FMA on this CPU.
            unsafe { $avx512($($args),*) }
        } else {
            $plain($($args),*)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let r = $plain($($args),*);
        r
    }};
}

pub(super) fn forward<T: Float, O: Out<T>>(
    s: &SdpaShape,
    tiles: SdpaTiles,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    out: &mut [O],
    lse: &mut [T::Acc],
) {
    let cx = Ctx { s, mask };
    let (bq, bk) = (tiles.q.max(1), tiles.k.max(1));
    let tasks = blocks(out, s.v_dim, lse, 1, s.batch * s.q_heads, s.q_len, bq);
    let kt = transposed_key_tiles(s, bk, k);
    let a = Fwd { cx, bk, q, k, v, kt: &kt };
    tasks.into_par_iter().for_each(|t| tuned!(forward_task, forward_task_avx512, &a, t));
}

/// What every forward task reads.
struct Fwd<'a, T: Float> {
    cx: Ctx<'a, T>,
    bk: usize,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    /// [`transposed_key_tiles`] (empty when the narrow tile kernel does not take them).
    kt: &'a [T::Acc],
}

/// Every kv head's key tiles of `bk` keys, each transposed into a `[head_dim, bk]`
/// block (a last, shorter tile padded): `Q Kᵀ` against a block's first columns then
/// runs on the narrow tile kernel, with the transposes done once per call instead of
/// once per query tile. Empty where that kernel does not take `bk`-column products
/// (not f32, no AVX-512, other tile widths).
fn transposed_key_tiles<T: Float>(s: &SdpaShape, bk: usize, k: &[T]) -> Vec<T::Acc> {
    let d = s.head_dim;
    if !narrow_takes::<T::Acc>(bk, d) || s.kv_len == 0 || d == 0 {
        return Vec::new();
    }
    let tiles = s.kv_len.div_ceil(bk);
    let mut out = vec![T::Acc::zero(); s.batch * s.kv_heads * tiles * d * bk];
    out.par_chunks_mut(tiles * d * bk).enumerate().for_each(|(g, dst)| {
        let mut buf = Vec::new();
        for (t, tile) in dst.chunks_exact_mut(d * bk).enumerate() {
            let j0 = t * bk;
            let nk = bk.min(s.kv_len - j0);
            let src = &k[(g * s.kv_len + j0) * d..(g * s.kv_len + j0 + nk) * d];
            transpose_into(view(&mut buf, src), nk, d, bk, tile);
        }
    });
    out
}

/// One forward task: query rows `i0..i0 + nq` of flattened head `bh`, against every key
/// they see, into their `out` rows and `lse`.
#[inline(always)]
fn forward_task<T: Float, O: Out<T>>(a: &Fwd<T>, (bh, i0, nq, out, lse): Block<O, T::Acc>) {
    let Fwd { ref cx, bk, q, k, v, kt: kt_all } = *a;
    let s = cx.s;
    let (d, dv) = (s.head_dim, s.v_dim);
    let key_tiles = s.kv_len.div_ceil(bk);
    let (zero, ninf) = (T::Acc::zero(), T::Acc::neg_infinity());
    let kv = cx.kv_of(bh);
    let r0 = bh * s.q_len + i0;
    let (mut qa, mut ka, mut va) = (Vec::new(), Vec::new(), Vec::new());
    load(&mut qa, &q[r0 * d..(r0 + nq) * d], Acc::of(s.scale));
    let mut acc = vec![zero; nq * dv];
    let mut m = vec![ninf; nq];
    let mut l = vec![zero; nq];
    let mut sc = vec![zero; nq * bk];
    let kv_end = if s.causal { s.kv_len.min(i0 + nq) } else { s.kv_len };
    for j0 in (0..kv_end).step_by(bk) {
        let nk = bk.min(kv_end - j0);
        let tm = cx.tile_mask(bh, j0, nk);
        if tm == TileMask::Closed {
            continue;
        }
        let k0 = kv * s.kv_len + j0;
        let kt = view(&mut ka, &k[k0 * d..(k0 + nk) * d]);
        let vt = view(&mut va, &v[k0 * dv..(k0 + nk) * dv]);
        for (a0, na, ne) in causal_pieces(s.causal, i0, nq, j0, nk) {
            let sc = &mut sc[..na * ne];
            let qt = &qa[a0 * d..(a0 + na) * d];
            // Against the transposed tile where there is one (its rows `bk` apart).
            let block = (kv * key_tiles + j0 / bk) * d * bk;
            let narrow = !kt_all.is_empty()
                && narrow_matmul_ldb(
                    (na, ne, d),
                    qt,
                    &kt_all[block..block + d * bk],
                    bk,
                    sc,
                    false,
                );
            if !narrow {
                small_matmul((na, ne, d), qt, false, &kt[..ne * d], true, sc, false);
            }
            for qi in 0..na {
                let row = &mut sc[qi * ne..(qi + 1) * ne];
                let vis = cx.mask_scores(bh, i0 + a0 + qi, j0, tm, row);
                let tmax = row_max(&row[..vis], ninf);
                if tmax == ninf {
                    row.fill(zero); // every key of this tile is masked
                    continue;
                }
                let r = a0 + qi;
                let mnew = m[r].max(tmax);
                let alpha = (m[r] - mnew).exp();
                if alpha != T::Acc::one() {
                    l[r] *= alpha;
                    acc[r * dv..(r + 1) * dv].iter_mut().for_each(|a| *a *= alpha);
                }
                l[r] += Acc::exp_sub_sum(&mut row[..vis], mnew);
                m[r] = mnew;
            }
            let acc = &mut acc[a0 * dv..(a0 + na) * dv];
            small_matmul((na, dv, ne), sc, false, &vt[..ne * dv], false, acc, true);
        }
    }
    for qi in 0..nq {
        let orow = &mut out[qi * dv..(qi + 1) * dv];
        if l[qi] == zero {
            // Fully masked row: zeros and lse = -inf, like PyTorch.
            orow.iter_mut().for_each(|o| o.put(T::from_acc(zero)));
            lse[qi] = ninf;
        } else {
            let inv = l[qi].recip();
            for (o, &a) in orow.iter_mut().zip(&acc[qi * dv..(qi + 1) * dv]) {
                o.put(T::from_acc(a * inv));
            }
            lse[qi] = m[qi] + l[qi].ln();
        }
    }
}

/// [`forward_task`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn forward_task_avx512<T: Float, O: Out<T>>(a: &Fwd<T>, t: Block<O, T::Acc>) {
    forward_task(a, t)
}

/// What every backward task reads.
struct Bwd<'a, T: Float> {
    cx: Ctx<'a, T>,
    bq: usize,
    bk: usize,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    lse: &'a [T::Acc],
    dout: &'a [T],
    dsum: &'a [T::Acc],
    scale: T::Acc,
    group: usize,
}

/// One backward task (see [`BackTask`]): its keys' `dk` and `dv`, and its `dq` rows
/// (written when it is the head's only task, else returned as a partial sum with the
/// first row it starts at).
#[inline(always)]
fn backward_task<T: Float>(a: &Bwd<T>, t: BackTask<T>) -> Option<(usize, Vec<T::Acc>)> {
    let Bwd { ref cx, bq, bk, q, k, v, lse, dout, dsum, scale, group } = *a;
    let s = cx.s;
    let (d, dv) = (s.head_dim, s.v_dim);
    let zero = T::Acc::zero();
    // Causal: queries before the first key of the task see none of its keys,
    // so its dq rows start there.
    let q_first = if s.causal { t.j_start.min(s.q_len) } else { 0 };
    let rows = s.q_len - q_first;
    // The group's scaled queries and output gradients, widened once.
    let (mut qa, mut oa) = (Vec::new(), Vec::new());
    let (mut dqa, mut ka, mut va) = (vec![zero; group * rows * d], Vec::new(), Vec::new());
    qa.reserve(group * rows * d);
    oa.reserve(group * rows * dv);
    for t_h in 0..group {
        let r0 = (t.g * group + t_h) * s.q_len + q_first;
        qa.extend(q[r0 * d..(r0 + rows) * d].iter().map(|x| x.to_acc() * scale));
        oa.extend(dout[r0 * dv..(r0 + rows) * dv].iter().map(|x| x.to_acc()));
    }
    let (mut p, mut ds) = (vec![zero; bq * bk], vec![zero; bq * bk]);
    let (mut dka, mut dva) = (vec![zero; bk * d], vec![zero; bk * dv]);
    let (mut kt, mut vt) = (vec![zero; d * bk], vec![zero; dv * bk]);
    let (mut kth, mut vth) = (vec![zero; d * bk], vec![zero; dv * bk]);
    for j0 in (t.j_start..t.j_start + t.nkeys).step_by(bk) {
        let nk = bk.min(t.j_start + t.nkeys - j0);
        let k0 = t.g * s.kv_len + j0;
        let kk = view(&mut ka, &k[k0 * d..(k0 + nk) * d]);
        let vv = view(&mut va, &v[k0 * dv..(k0 + nk) * dv]);
        // `Kᵀ` and `Vᵀ` of the tile, once for all its query tiles: `Q Kᵀ` and
        // `dO Vᵀ` then take `B` untransposed, which runs them on the narrow
        // tile kernel when the key tile is 32 or 64 keys wide.
        let (kt, vt) = (&mut kt[..d * nk], &mut vt[..dv * nk]);
        transpose_into(kk, nk, d, nk, kt);
        transpose_into(vv, nk, dv, nk, vt);
        let (dka, dva) = (&mut dka[..nk * d], &mut dva[..nk * dv]);
        dka.fill(zero);
        dva.fill(zero);
        for t_h in 0..group {
            let bh = t.g * group + t_h;
            let tm = cx.tile_mask(bh, j0, nk);
            if tm == TileMask::Closed {
                continue;
            }
            // Causal: only queries i >= j0 see a key of this tile.
            let i_start = if s.causal { j0 } else { 0 };
            for i0 in (i_start..s.q_len).step_by(bq) {
                let nq = bq.min(s.q_len - i0);
                for (a0, na, ne) in causal_pieces(s.causal, i0, nq, j0, nk) {
                    // A piece that sees only the tile's first `ne` keys takes the
                    // transposes of those keys alone.
                    let (kt, vt) = if ne == nk {
                        (&kt[..], &vt[..])
                    } else {
                        transpose_into(&kk[..ne * d], ne, d, ne, &mut kth[..d * ne]);
                        transpose_into(&vv[..ne * dv], ne, dv, ne, &mut vth[..dv * ne]);
                        (&kth[..d * ne], &vth[..dv * ne])
                    };
                    let (ia, r) = (i0 + a0, t_h * rows + (i0 + a0 - q_first));
                    let qt = &qa[r * d..(r + na) * d];
                    let ot = &oa[r * dv..(r + na) * dv];
                    let (p, ds) = (&mut p[..na * ne], &mut ds[..na * ne]);
                    let row0 = bh * s.q_len + ia;
                    // P = exp(mask(Qs Kᵀ) - lse), one exp per score.
                    small_matmul((na, ne, d), qt, false, kt, false, p, false);
                    let mut any = false;
                    for qi in 0..na {
                        let pr = &mut p[qi * ne..(qi + 1) * ne];
                        let l = lse[row0 + qi];
                        if l == T::Acc::neg_infinity() {
                            pr.fill(zero);
                            continue;
                        }
                        let vis = cx.mask_scores(bh, ia + qi, j0, tm, pr);
                        Acc::exp_sub_sum(&mut pr[..vis], l);
                        any = true;
                    }
                    if !any {
                        continue;
                    }
                    // dS = P * (dO Vᵀ - D).
                    small_matmul((na, ne, dv), ot, false, vt, false, ds, false);
                    for qi in 0..na {
                        let di = dsum[row0 + qi];
                        let (pr, dr) =
                            (&p[qi * ne..(qi + 1) * ne], &mut ds[qi * ne..(qi + 1) * ne]);
                        for (x, &pv) in dr.iter_mut().zip(pr) {
                            *x = pv * (*x - di);
                        }
                    }
                    // dV += Pᵀ dO; dK += dSᵀ (scale Q); dQ += dS K (scaled at the
                    // end).
                    small_matmul((ne, dv, na), p, true, ot, false, &mut dva[..ne * dv], true);
                    small_matmul((ne, d, na), ds, true, qt, false, &mut dka[..ne * d], true);
                    let dqt = &mut dqa[r * d..(r + na) * d];
                    small_matmul((na, d, ne), ds, false, &kk[..ne * d], false, dqt, true);
                }
            }
        }
        let o = (j0 - t.j_start) * d;
        for (o, &a) in t.dk[o..o + nk * d].iter_mut().zip(dka.iter()) {
            *o = T::from_acc(a);
        }
        let o = (j0 - t.j_start) * dv;
        for (o, &a) in t.dv[o..o + nk * dv].iter_mut().zip(dva.iter()) {
            *o = T::from_acc(a);
        }
    }
    match t.dq {
        Some(dq) => {
            // The only task of its head: write dq directly.
            for t_h in 0..group {
                let dst = &mut dq[(t_h * s.q_len + q_first) * d..(t_h + 1) * s.q_len * d];
                let src = &dqa[t_h * rows * d..(t_h + 1) * rows * d];
                for (o, &a) in dst.iter_mut().zip(src) {
                    *o = T::from_acc(a * scale);
                }
                dq[t_h * s.q_len * d..(t_h * s.q_len + q_first) * d].fill(T::from_acc(zero));
            }
            None
        }
        None => Some((q_first, dqa)),
    }
}

/// [`backward_task`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn backward_task_avx512<T: Float>(
    a: &Bwd<T>,
    t: BackTask<T>,
) -> Option<(usize, Vec<T::Acc>)> {
    backward_task(a, t)
}

/// One backward task: the keys `j_start..j_start + nkeys` of kv head `g`
/// (flattened with the batch), with their `dk`/`dv` rows, and the `dq` rows of
/// the group's q heads when this task is the only one of its head.
struct BackTask<'a, T> {
    g: usize,
    j_start: usize,
    nkeys: usize,
    dk: &'a mut [T],
    dv: &'a mut [T],
    dq: Option<&'a mut [T]>,
}

pub(super) fn backward<T: Float>(
    s: &SdpaShape,
    tiles: SdpaTiles,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    out: &[T],
    lse: &[T::Acc],
    dout: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv_out: &mut [T],
) {
    let cx = Ctx { s, mask };
    let (d, dv) = (s.head_dim, s.v_dim);
    let (bq, bk) = (tiles.q.max(1), tiles.k.max(1));
    let zero = T::Acc::zero();
    let scale: T::Acc = Acc::of(s.scale);
    let group = s.q_heads / s.kv_heads;
    let groups = s.batch * s.kv_heads;
    if groups == 0 || s.q_len == 0 || s.kv_len == 0 {
        dq.fill(T::from_acc(zero));
        dk.fill(T::from_acc(zero));
        dv_out.fill(T::from_acc(zero));
        return;
    }
    // D_i = rowsum(dout * out).
    let dsum: Vec<T::Acc> = if dv == 0 {
        vec![zero; lse.len()]
    } else {
        dout.par_chunks(dv)
            .zip(out.par_chunks(dv))
            .map(|(g, o)| g.iter().zip(o).fold(zero, |a, (g, o)| a + g.to_acc() * o.to_acc()))
            .collect()
    };
    // Split each head's keys into `chunks` runs of whole key tiles.
    let key_tiles = s.kv_len.div_ceil(bk);
    let want = MIN_BACKWARD_TASKS.div_ceil(groups).clamp(1, key_tiles);
    let run = key_tiles.div_ceil(want) * bk;
    let chunks = s.kv_len.div_ceil(run);
    let dq_per_group = group * s.q_len * d;
    let mut tasks: Vec<BackTask<T>> = blocks(dk, d, dv_out, dv, groups, s.kv_len, run)
        .into_iter()
        .map(|(g, j_start, nkeys, dk, dv)| BackTask { g, j_start, nkeys, dk, dv, dq: None })
        .collect();
    if chunks == 1 {
        for (t, dq) in tasks.iter_mut().zip(dq.chunks_mut(dq_per_group.max(1))) {
            t.dq = Some(dq);
        }
    }
    let a = Bwd { cx, bq, bk, q, k, v, lse, dout, dsum: &dsum, scale, group };
    let partials: Vec<Option<(usize, Vec<T::Acc>)>> =
        tasks.into_par_iter().map(|t| tuned!(backward_task, backward_task_avx512, &a, t)).collect();
    if chunks == 1 {
        return;
    }
    // Sum each head's partials in key order (fixed by the shape: deterministic).
    dq.par_chunks_mut(dq_per_group.max(1)).enumerate().for_each(|(g, dq)| {
        let mut acc = vec![zero; dq_per_group];
        for (q_first, part) in partials[g * chunks..(g + 1) * chunks].iter().flatten() {
            let rows = s.q_len - q_first;
            for t_h in 0..group {
                let dst = &mut acc[(t_h * s.q_len + q_first) * d..(t_h + 1) * s.q_len * d];
                for (a, &p) in dst.iter_mut().zip(&part[t_h * rows * d..(t_h + 1) * rows * d]) {
                    *a += p;
                }
            }
        }
        for (o, &a) in dq.iter_mut().zip(&acc) {
            *o = T::from_acc(a * scale);
        }
    });
}

#[cfg(test)]
mod tuned_tests {
    use super::{backward, forward, PORTABLE_ONLY};
    use crate::sdpa::{SdpaMask, SdpaShape, SdpaTiles};
    use std::sync::atomic::Ordering;

    /// Forward and backward of a causal, key-masked grouped-query attention in f32:
    /// `out`, `lse`, `dq`, `dk`, `dv`.
    fn run(portable: bool) -> Vec<Vec<u32>> {
        let s = SdpaShape {
            batch: 2,
            q_heads: 4,
            kv_heads: 2,
            q_len: 150,
            kv_len: 150,
            head_dim: 32,
            v_dim: 32,
            scale: 0.2,
            causal: true,
        };
        let val = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 1999) as f32 / 999.5 - 1.0;
        let (nq, nk) = (2 * 4 * 150, 2 * 2 * 150);
        let q: Vec<f32> = (0..nq * 32).map(|i| val(i, 1)).collect();
        let k: Vec<f32> = (0..nk * 32).map(|i| val(i, 2)).collect();
        let v: Vec<f32> = (0..nk * 32).map(|i| val(i, 3)).collect();
        let dout: Vec<f32> = (0..nq * 32).map(|i| val(i, 4)).collect();
        let m: Vec<f32> =
            (0..2 * 150).map(|j| if j % 150 > 130 { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = SdpaMask { data: &m[..], batch_stride: 150, head_stride: 0, row_stride: 0 };
        PORTABLE_ONLY.store(portable, Ordering::SeqCst);
        let (mut out, mut lse) = (vec![0f32; nq * 32], vec![0f32; nq]);
        forward(&s, SdpaTiles::forward(&s), &q, &k, &v, Some(&mask), &mut out, &mut lse);
        let (mut dq, mut dk, mut dv) =
            (vec![0f32; nq * 32], vec![0f32; nk * 32], vec![0f32; nk * 32]);
        let t = SdpaTiles::backward(&s);
        backward(&s, t, &q, &k, &v, Some(&mask), &out, &lse, &dout, &mut dq, &mut dk, &mut dv);
        PORTABLE_ONLY.store(false, Ordering::SeqCst);
        [out, lse, dq, dk, dv].iter().map(|x| x.iter().map(|f| f.to_bits()).collect()).collect()
    }

    /// The AVX-512 build of the task bodies gives the portable build's bits.
    #[test]
    fn avx512_tasks_give_the_portable_bits() {
        assert_eq!(run(false), run(true));
    }
}

#[cfg(test)]
mod causal_pieces_tests {
    use super::causal_pieces;

    fn pieces(
        causal: bool,
        i0: usize,
        nq: usize,
        j0: usize,
        nk: usize,
    ) -> Vec<(usize, usize, usize)> {
        causal_pieces(causal, i0, nq, j0, nk).collect()
    }

    /// Diagonal tiles are cut where fewest scores are computed, each piece taking the
    /// keys its last row sees; tiles every row sees whole, and non-causal ones, are not
    /// cut; rows that see none of the keys are left out.
    #[test]
    fn diagonal_tiles_are_cut_where_fewest_scores_remain() {
        // The forward's 64 x 64 diagonal tile, a 64 x 128 one, the backward's 128 x 64.
        assert_eq!(pieces(true, 64, 64, 64, 64), vec![(0, 32, 32), (32, 32, 64)]);
        assert_eq!(pieces(true, 64, 64, 0, 128), vec![(0, 32, 96), (32, 32, 128)]);
        assert_eq!(pieces(true, 64, 128, 64, 64), vec![(0, 32, 32), (32, 96, 64)]);
        // Every row sees every key, or attention is not causal: one piece.
        assert_eq!(pieces(true, 128, 64, 0, 128), vec![(0, 64, 128)]);
        assert_eq!(pieces(false, 64, 64, 64, 64), vec![(0, 64, 64)]);
        // Small tiles are not cut; a tile past every row is dropped.
        assert_eq!(pieces(true, 8, 16, 8, 16), vec![(0, 16, 16)]);
        assert_eq!(pieces(true, 0, 16, 16, 16), vec![]);
    }
}

#[cfg(test)]
mod row_max_tests {
    use super::row_max;

    /// Every length around the 16 lanes, with `NaN`, `±inf` and equal values among the
    /// elements: the same value as a fold with `f32::max`.
    #[test]
    fn row_max_is_f32_max_folded() {
        let ninf = f32::NEG_INFINITY;
        for n in 0..50usize {
            for seed in 0..4usize {
                let row: Vec<f32> = (0..n)
                    .map(|i| match (i * 7 + seed * 13) % 11 {
                        0 => f32::NAN,
                        1 => ninf,
                        2 if seed == 3 => f32::INFINITY,
                        k => (k as f32 - 5.0) * (1.0 + seed as f32),
                    })
                    .collect();
                let want = row.iter().fold(ninf, |a, &x| a.max(x));
                let got = row_max(&row, ninf);
                assert_eq!(got.to_bits(), want.to_bits(), "n {n} seed {seed}: {row:?}");
            }
        }
    }
}
