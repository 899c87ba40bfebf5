//! Rayon RMSNorm kernels (one row per task, blocked reduction for dweight).

use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use crate::util::{dot, sum_map};
use crate::{Acc, Float, Out};

pub(super) fn forward<T: Float, O: Out<T>>(
    x: &[T],
    weight: &[T],
    dim: usize,
    eps: f64,
    y: &mut [O],
    rstd: &mut [T::Acc],
) {
    if dim == 0 {
        rstd.fill(<T::Acc as Acc>::of(1.0 / eps.sqrt()));
        return;
    }
    let w: Vec<T::Acc> = weight.iter().map(|v| v.to_acc()).collect();
    let eps = <T::Acc as Acc>::of(eps);
    let inv_dim = <T::Acc as Acc>::of(1.0 / dim as f64);
    y.par_chunks_mut(dim).zip(x.par_chunks(dim)).zip(rstd.par_iter_mut()).for_each(
        |((y, x), r)| {
            let ss = sum_map(x, |v| {
                let a = v.to_acc();
                a * a
            });
            let rs = (ss * inv_dim + eps).sqrt().recip();
            *r = rs;
            for ((y, x), &w) in y.iter_mut().zip(x).zip(&w) {
                y.put(T::from_acc(x.to_acc() * rs * w));
            }
        },
    );
}

pub(super) fn backward<T: Float, O: Out<T>>(
    x: &[T],
    weight: &[T],
    rstd: &[T::Acc],
    dy: &[T],
    rows: usize,
    dim: usize,
    dx: &mut [O],
    dweight: &mut [T::Acc],
) {
    let zero = T::Acc::zero();
    dweight.fill(zero);
    if rows == 0 || dim == 0 {
        return;
    }
    let w: Vec<T::Acc> = weight.iter().map(|v| v.to_acc()).collect();
    let inv_dim = <T::Acc as Acc>::of(1.0 / dim as f64);
    // Fixed block count (independent of the thread count) keeps dweight deterministic.
    let block = rows.div_ceil(64);
    let partials: Vec<Vec<T::Acc>> = dx
        .par_chunks_mut(block * dim)
        .zip(x.par_chunks(block * dim))
        .zip(dy.par_chunks(block * dim))
        .zip(rstd.par_chunks(block))
        .map(|(((dx, x), dy), rstd)| {
            let mut dw = vec![zero; dim];
            let mut xa = vec![zero; dim];
            let mut gw = vec![zero; dim];
            for (((dx, x), dy), &r) in
                dx.chunks_mut(dim).zip(x.chunks(dim)).zip(dy.chunks(dim)).zip(rstd)
            {
                for j in 0..dim {
                    xa[j] = x[j].to_acc();
                    gw[j] = dy[j].to_acc() * w[j];
                }
                // d/dx_j of x_j*r*w_j summed against dy: r*g_j*w_j - r^3 x_j <g*w, x>/dim
                let c = r * r * r * dot(&gw, &xa) * inv_dim;
                for j in 0..dim {
                    dx[j].put(T::from_acc(r * gw[j] - c * xa[j]));
                    dw[j] += dy[j].to_acc() * xa[j] * r;
                }
            }
            dw
        })
        .collect();
    for p in partials {
        for (d, v) in dweight.iter_mut().zip(p) {
            *d += v;
        }
    }
}
