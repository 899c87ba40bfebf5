//! Rayon cross-entropy kernels: one row per item.

use num_traits::{Float as _, One, Zero};
use rayon::prelude::*;

use crate::{Acc, Float, Out};

/// Columns per online-softmax block.
const BLOCK: usize = 256;

/// The local column of `target`, if this shard owns it.
#[inline]
fn local_col(target: i64, vocab_start: i64, v_local: usize) -> Option<usize> {
    let c = target.checked_sub(vocab_start)?;
    (c >= 0 && (c as u64) < v_local as u64).then_some(c as usize)
}

pub(super) fn local_stats<T: Float>(
    logits: &[T],
    v_local: usize,
    targets: &[i64],
    vocab_start: i64,
    ignore_index: i64,
    max: &mut [T::Acc],
    sumexp: &mut [T::Acc],
    target_logit: &mut [T::Acc],
) {
    let (zero, ninf) = (T::Acc::zero(), T::Acc::neg_infinity());
    if v_local == 0 {
        max.fill(ninf);
        sumexp.fill(zero);
        target_logit.fill(zero);
        return;
    }
    logits
        .par_chunks(v_local)
        .zip(targets.par_iter())
        .zip(max.par_iter_mut())
        .zip(sumexp.par_iter_mut())
        .zip(target_logit.par_iter_mut())
        .for_each_init(Vec::new, |buf, ((((row, &t), mx), se), tl)| {
            // Online over blocks: rescale the running sum when the max grows.
            let (mut m, mut s) = (ninf, zero);
            for blk in row.chunks(BLOCK) {
                let bm = blk.iter().fold(ninf, |a, v| a.max(v.to_acc()));
                if bm == ninf {
                    continue;
                }
                if bm > m {
                    s *= (m - bm).exp();
                    m = bm;
                }
                buf.clear();
                buf.extend(blk.iter().map(|v| v.to_acc()));
                s += Acc::exp_sub_sum(buf, m);
            }
            *mx = m;
            *se = s;
            *tl = match local_col(t, vocab_start, v_local) {
                Some(c) if t != ignore_index => row[c].to_acc(),
                _ => zero,
            };
        });
}

pub(super) fn backward<T: Float, O: Out<T>>(
    logits: &[T],
    v_local: usize,
    targets: &[i64],
    vocab_start: i64,
    ignore_index: i64,
    lse: &[T::Acc],
    row_scale: &[T::Acc],
    dlogits: &mut [O],
) {
    if v_local == 0 {
        return;
    }
    let (zero, ninf) = (T::Acc::zero(), T::Acc::neg_infinity());
    dlogits.par_chunks_mut(v_local).zip(logits.par_chunks(v_local)).enumerate().for_each_init(
        Vec::new,
        |buf, (r, (dl, row))| {
            let t = targets[r];
            if t == ignore_index {
                dl.iter_mut().for_each(|d| d.put(T::from_acc(zero)));
                return;
            }
            let scale = row_scale[if row_scale.len() == 1 { 0 } else { r }];
            let l = lse[r];
            if l == ninf {
                dl.iter_mut().for_each(|d| d.put(T::from_acc(zero)));
            } else {
                for (dl, row) in dl.chunks_mut(BLOCK).zip(row.chunks(BLOCK)) {
                    buf.clear();
                    buf.extend(row.iter().map(|v| v.to_acc()));
                    Acc::exp_sub_sum(buf, l);
                    for (d, &p) in dl.iter_mut().zip(buf.iter()) {
                        d.put(T::from_acc(p * scale));
                    }
                }
            }
            if let Some(c) = local_col(t, vocab_start, v_local) {
                let p = if l == ninf { zero } else { (row[c].to_acc() - l).exp() };
                dl[c].put(T::from_acc((p - T::Acc::one()) * scale));
            }
        },
    );
}
