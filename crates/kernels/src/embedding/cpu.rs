//! Rayon embedding kernels.

use num_traits::Zero;
use rayon::prelude::*;

use crate::{Float, Out};

/// The local row of `id`, if it falls in `[vocab_start, vocab_start + vocab)`.
#[inline]
pub(super) fn local_row(id: i64, vocab_start: i64, vocab: usize) -> Option<usize> {
    let r = id.checked_sub(vocab_start)?;
    (r >= 0 && (r as u64) < vocab as u64).then_some(r as usize)
}

pub(super) fn forward<T: Float, O: Out<T>>(
    weight: &[T],
    vocab: usize,
    dim: usize,
    ids: &[i64],
    vocab_start: i64,
    out: &mut [O],
) {
    if dim == 0 {
        return;
    }
    let zero = T::from_acc(T::Acc::zero());
    out.par_chunks_mut(dim).zip(ids.par_iter()).for_each(|(o, &id)| {
        match local_row(id, vocab_start, vocab) {
            Some(r) => {
                o.iter_mut().zip(&weight[r * dim..(r + 1) * dim]).for_each(|(o, &w)| o.put(w))
            }
            None => o.iter_mut().for_each(|o| o.put(zero)),
        }
    });
}

pub(super) fn backward<T: Float>(
    ids: &[i64],
    vocab_start: i64,
    dout: &[T],
    vocab: usize,
    dim: usize,
    dweight: &mut [T],
) {
    if dim == 0 {
        return;
    }
    // Counting sort of positions by local row: row v's positions are
    // pos[start[v]..start[v + 1]], in increasing order.
    let mut start = vec![0usize; vocab + 1];
    for &id in ids {
        if let Some(r) = local_row(id, vocab_start, vocab) {
            start[r + 1] += 1;
        }
    }
    for v in 0..vocab {
        start[v + 1] += start[v];
    }
    let mut fill = start.clone();
    let mut pos = vec![0usize; start[vocab]];
    for (n, &id) in ids.iter().enumerate() {
        if let Some(r) = local_row(id, vocab_start, vocab) {
            pos[fill[r]] = n;
            fill[r] += 1;
        }
    }
    let zero = T::Acc::zero();
    dweight.par_chunks_mut(dim).enumerate().for_each_init(Vec::new, |acc, (v, row)| {
        let ps = &pos[start[v]..start[v + 1]];
        match ps {
            [] => row.fill(T::from_acc(zero)),
            [p] => row.copy_from_slice(&dout[p * dim..(p + 1) * dim]),
            _ => {
                acc.clear();
                acc.resize(dim, zero);
                for p in ps {
                    for (a, g) in acc.iter_mut().zip(&dout[p * dim..(p + 1) * dim]) {
                        *a += g.to_acc();
                    }
                }
                for (o, &a) in row.iter_mut().zip(acc.iter()) {
                    *o = T::from_acc(a);
                }
            }
        }
    });
}
