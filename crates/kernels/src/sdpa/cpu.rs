//! Rayon flash-attention kernels: key tiles with an online softmax forward,
//! probability recomputation from `lse` backward. Tile products
//! (`Q Kᵀ`, `P V`, ...) run on single-threaded gemm calls in the accumulator
//! type; parallelism comes from the task split.

use num_traits::{Float as _, One, Zero};
use rayon::prelude::*;

use super::{SdpaMask, SdpaShape};
use crate::gemm::small_matmul;
use crate::{Acc, Float};

/// Query rows per task / tile.
const BQ: usize = 64;
/// Key rows per tile (and per task in the dk/dv pass).
const BK: usize = 64;

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

    /// Turns raw `q·k` scores of query `i` (of flattened head `bh`) against keys
    /// `j0..j0 + row.len()` into masked scores: adds the mask and sets keys the
    /// query may not see (causal) to `-inf`. Returns the row max.
    fn mask_scores(&self, bh: usize, i: usize, j0: usize, row: &mut [T::Acc]) -> T::Acc {
        let ninf = T::Acc::neg_infinity();
        let vis = if self.s.causal { (i + 1).saturating_sub(j0).min(row.len()) } else { row.len() };
        row[vis..].fill(ninf);
        if let Some(m) = self.mask {
            let (b, h) = (bh / self.s.q_heads, bh % self.s.q_heads);
            let off = b * m.batch_stride + h * m.head_stride + i * m.row_stride + j0;
            for (x, v) in row[..vis].iter_mut().zip(&m.data[off..off + vis]) {
                *x += v.to_acc();
            }
        }
        row[..vis].iter().fold(ninf, |a, &x| a.max(x))
    }

    /// Probabilities `exp(s - lse)` of one query row against a key tile, in
    /// place over the raw scores (all zero for a fully masked row).
    fn probs(&self, bh: usize, i: usize, j0: usize, lse: T::Acc, row: &mut [T::Acc]) {
        if lse == T::Acc::neg_infinity() {
            row.fill(T::Acc::zero());
            return;
        }
        self.mask_scores(bh, i, j0, row);
        for x in row.iter_mut() {
            *x = (*x - lse).exp();
        }
    }
}

pub(super) fn forward<T: Float>(
    s: &SdpaShape,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    out: &mut [T],
    lse: &mut [T::Acc],
) {
    let cx = Ctx { s, mask };
    let (d, dv) = (s.head_dim, s.v_dim);
    let tasks = blocks(out, dv, lse, 1, s.batch * s.q_heads, s.q_len, BQ);
    tasks.into_par_iter().for_each(|(bh, i0, nq, out, lse)| {
        let (zero, ninf) = (T::Acc::zero(), T::Acc::neg_infinity());
        let kv = cx.kv_of(bh);
        let r0 = bh * s.q_len + i0;
        let (mut qa, mut ka, mut va) = (Vec::new(), Vec::new(), Vec::new());
        load(&mut qa, &q[r0 * d..(r0 + nq) * d], Acc::of(s.scale));
        let mut acc = vec![zero; nq * dv];
        let mut m = vec![ninf; nq];
        let mut l = vec![zero; nq];
        let mut sc = vec![zero; nq * BK];
        let kv_end = if s.causal { s.kv_len.min(i0 + nq) } else { s.kv_len };
        for j0 in (0..kv_end).step_by(BK) {
            let nk = BK.min(kv_end - j0);
            let k0 = kv * s.kv_len + j0;
            load(&mut ka, &k[k0 * d..(k0 + nk) * d], One::one());
            load(&mut va, &v[k0 * dv..(k0 + nk) * dv], One::one());
            let sc = &mut sc[..nq * nk];
            small_matmul((nq, nk, d), &qa, false, &ka, true, sc, false);
            for qi in 0..nq {
                let row = &mut sc[qi * nk..(qi + 1) * nk];
                let tmax = cx.mask_scores(bh, i0 + qi, j0, row);
                if tmax == ninf {
                    row.fill(zero); // every key of this tile is masked
                    continue;
                }
                let mnew = m[qi].max(tmax);
                let alpha = (m[qi] - mnew).exp();
                if alpha != T::Acc::one() {
                    l[qi] *= alpha;
                    acc[qi * dv..(qi + 1) * dv].iter_mut().for_each(|a| *a *= alpha);
                }
                for x in row.iter_mut() {
                    *x = (*x - mnew).exp();
                    l[qi] += *x;
                }
                m[qi] = mnew;
            }
            small_matmul((nq, dv, nk), sc, false, &va, false, &mut acc, true);
        }
        for qi in 0..nq {
            let orow = &mut out[qi * dv..(qi + 1) * dv];
            if l[qi] == zero {
                // Fully masked row: zeros and lse = -inf, like PyTorch.
                orow.fill(T::from_acc(zero));
                lse[qi] = ninf;
            } else {
                let inv = l[qi].recip();
                for (o, &a) in orow.iter_mut().zip(&acc[qi * dv..(qi + 1) * dv]) {
                    *o = T::from_acc(a * inv);
                }
                lse[qi] = m[qi] + l[qi].ln();
            }
        }
    });
}

pub(super) fn backward<T: Float>(
    s: &SdpaShape,
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
    let zero = T::Acc::zero();
    let scale: T::Acc = Acc::of(s.scale);
    // D_i = rowsum(dout * out).
    let dsum: Vec<T::Acc> = if dv == 0 {
        vec![zero; lse.len()]
    } else {
        dout.par_chunks(dv)
            .zip(out.par_chunks(dv))
            .map(|(g, o)| g.iter().zip(o).fold(zero, |a, (g, o)| a + g.to_acc() * o.to_acc()))
            .collect()
    };
    // Probabilities P [nq, nk] of a (query tile, key tile) pair from the widened
    // (scaled q, dout, k, v) tiles, then
    // dS = P * (dO Vᵀ - D) in `ds`.
    let tile = |bh: usize,
                (i0, nq): (usize, usize),
                (j0, nk): (usize, usize),
                [qa, oa, ka, va]: [&[T::Acc]; 4],
                p: &mut [T::Acc],
                ds: &mut [T::Acc]| {
        small_matmul((nq, nk, d), qa, false, ka, true, p, false);
        for qi in 0..nq {
            cx.probs(bh, i0 + qi, j0, lse[bh * s.q_len + i0 + qi], &mut p[qi * nk..(qi + 1) * nk]);
        }
        small_matmul((nq, nk, dv), oa, false, va, true, ds, false);
        for qi in 0..nq {
            let di = dsum[bh * s.q_len + i0 + qi];
            let (pr, dr) = (&p[qi * nk..(qi + 1) * nk], &mut ds[qi * nk..(qi + 1) * nk]);
            for (x, &pv) in dr.iter_mut().zip(pr) {
                *x = pv * (*x - di);
            }
        }
    };

    // dq over (batch, q head, query block): dQ = scale * dS K.
    if !dq.is_empty() {
        let mut none: [(); 0] = [];
        let tasks = blocks(dq, d, &mut none[..], 0, s.batch * s.q_heads, s.q_len, BQ);
        tasks.into_par_iter().for_each(|(bh, i0, nq, dq, _)| {
            let kv = cx.kv_of(bh);
            let r0 = bh * s.q_len + i0;
            let (mut qa, mut oa, mut ka, mut va) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            load(&mut qa, &q[r0 * d..(r0 + nq) * d], scale);
            load(&mut oa, &dout[r0 * dv..(r0 + nq) * dv], One::one());
            let mut dqa = vec![zero; nq * d];
            let (mut p, mut ds) = (vec![zero; nq * BK], vec![zero; nq * BK]);
            let kv_end = if s.causal { s.kv_len.min(i0 + nq) } else { s.kv_len };
            for j0 in (0..kv_end).step_by(BK) {
                let nk = BK.min(kv_end - j0);
                let k0 = kv * s.kv_len + j0;
                load(&mut ka, &k[k0 * d..(k0 + nk) * d], One::one());
                load(&mut va, &v[k0 * dv..(k0 + nk) * dv], One::one());
                let (p, ds) = (&mut p[..nq * nk], &mut ds[..nq * nk]);
                tile(bh, (i0, nq), (j0, nk), [&qa, &oa, &ka, &va], p, ds);
                small_matmul((nq, d, nk), ds, false, &ka, false, &mut dqa, true);
            }
            for (o, &a) in dq.iter_mut().zip(&dqa) {
                *o = T::from_acc(a * scale);
            }
        });
    }

    // dk, dv over (batch, kv head, key block), summing the group's q heads:
    // dV = Pᵀ dO, dK = scale * dSᵀ Q.
    if dk.is_empty() && dv_out.is_empty() {
        return;
    }
    let group = s.q_heads / s.kv_heads;
    let tasks = blocks(dk, d, dv_out, dv, s.batch * s.kv_heads, s.kv_len, BK);
    tasks.into_par_iter().for_each(|(g, j0, nk, dk, dvb)| {
        let (b, kvh) = (g / s.kv_heads, g % s.kv_heads);
        let k0 = g * s.kv_len + j0;
        let (mut qa, mut oa, mut ka, mut va) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        load(&mut ka, &k[k0 * d..(k0 + nk) * d], One::one());
        load(&mut va, &v[k0 * dv..(k0 + nk) * dv], One::one());
        let mut dka = vec![zero; nk * d];
        let mut dva = vec![zero; nk * dv];
        let (mut p, mut ds) = (vec![zero; BQ * nk], vec![zero; BQ * nk]);
        for bh in b * s.q_heads + kvh * group..b * s.q_heads + (kvh + 1) * group {
            // Causal: only queries i >= j0 see a key of this block.
            let i_start = if s.causal { j0 } else { 0 };
            for i0 in (i_start..s.q_len).step_by(BQ) {
                let nq = BQ.min(s.q_len - i0);
                let r0 = bh * s.q_len + i0;
                load(&mut qa, &q[r0 * d..(r0 + nq) * d], scale);
                load(&mut oa, &dout[r0 * dv..(r0 + nq) * dv], One::one());
                let (p, ds) = (&mut p[..nq * nk], &mut ds[..nq * nk]);
                tile(bh, (i0, nq), (j0, nk), [&qa, &oa, &ka, &va], p, ds);
                small_matmul((nk, dv, nq), p, true, &oa, false, &mut dva, true);
                // qa holds scale * q, so this is scale * dSᵀ Q.
                small_matmul((nk, d, nq), ds, true, &qa, false, &mut dka, true);
            }
        }
        for (o, &a) in dk.iter_mut().zip(&dka) {
            *o = T::from_acc(a);
        }
        for (o, &a) in dvb.iter_mut().zip(&dva) {
            *o = T::from_acc(a);
        }
    });
}
