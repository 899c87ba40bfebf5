//! Rayon softmax kernels: one row per item.

use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use crate::util::sum_map;
use crate::{Acc, Float};

pub(super) fn forward<T: Float>(x: &[T], cols: usize, y: &mut [T], log: bool) {
    if cols == 0 {
        return;
    }
    let init = || (Vec::new(), Vec::new());
    y.par_chunks_mut(cols).zip(x.par_chunks(cols)).for_each_init(init, |(buf, tmp), (y, x)| {
        let ninf = T::Acc::neg_infinity();
        let m = x.iter().fold(ninf, |m, v| m.max(v.to_acc()));
        if m == ninf {
            let fill = if log { T::from_acc(ninf) } else { T::from_acc(T::Acc::zero()) };
            y.fill(fill);
            return;
        }
        buf.clear();
        buf.extend(x.iter().map(|v| v.to_acc()));
        if log {
            tmp.clear();
            tmp.extend_from_slice(buf);
            let ls = Acc::exp_sub_sum(tmp, m).ln();
            for (y, &v) in y.iter_mut().zip(buf.iter()) {
                *y = T::from_acc((v - m) - ls);
            }
        } else {
            let inv = Acc::exp_sub_sum(buf, m).recip();
            for (y, &e) in y.iter_mut().zip(buf.iter()) {
                *y = T::from_acc(e * inv);
            }
        }
    });
}

pub(super) fn backward<T: Float>(y: &[T], dy: &[T], cols: usize, dx: &mut [T], log: bool) {
    if cols == 0 {
        return;
    }
    dx.par_chunks_mut(cols).zip(y.par_chunks(cols)).zip(dy.par_chunks(cols)).for_each_init(
        Vec::new,
        |buf, ((dx, y), dy)| {
            if log {
                let s = sum_map(dy, |g| g.to_acc());
                buf.clear();
                buf.extend(y.iter().map(|v| v.to_acc()));
                Acc::exp_sub_sum(buf, T::Acc::zero());
                for ((dx, &p), g) in dx.iter_mut().zip(buf.iter()).zip(dy) {
                    *dx = T::from_acc(g.to_acc() - p * s);
                }
            } else {
                let s =
                    dy.iter().zip(y).fold(T::Acc::zero(), |s, (g, y)| s + g.to_acc() * y.to_acc());
                for ((dx, y), g) in dx.iter_mut().zip(y).zip(dy) {
                    let y = y.to_acc();
                    *dx = T::from_acc(y * (g.to_acc() - s));
                }
            }
        },
    );
}
