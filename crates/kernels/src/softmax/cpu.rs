//! Rayon softmax kernels: one row per item.

use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use crate::util::sum_map;
use crate::Float;

pub(super) fn forward<T: Float>(x: &[T], cols: usize, y: &mut [T], log: bool) {
    if cols == 0 {
        return;
    }
    y.par_chunks_mut(cols).zip(x.par_chunks(cols)).for_each_init(Vec::new, |buf, (y, x)| {
        let ninf = T::Acc::neg_infinity();
        let m = x.iter().fold(ninf, |m, v| m.max(v.to_acc()));
        if m == ninf {
            let fill = if log { T::from_acc(ninf) } else { T::from_acc(T::Acc::zero()) };
            y.fill(fill);
            return;
        }
        buf.clear();
        buf.extend(x.iter().map(|v| v.to_acc() - m));
        let sum = sum_map(buf, |d| d.exp());
        if log {
            let ls = sum.ln();
            for (y, &d) in y.iter_mut().zip(buf.iter()) {
                *y = T::from_acc(d - ls);
            }
        } else {
            let inv = sum.recip();
            for (y, &d) in y.iter_mut().zip(buf.iter()) {
                *y = T::from_acc(d.exp() * inv);
            }
        }
    });
}

pub(super) fn backward<T: Float>(y: &[T], dy: &[T], cols: usize, dx: &mut [T], log: bool) {
    if cols == 0 {
        return;
    }
    dx.par_chunks_mut(cols).zip(y.par_chunks(cols)).zip(dy.par_chunks(cols)).for_each(
        |((dx, y), dy)| {
            if log {
                let s = sum_map(dy, |g| g.to_acc());
                for ((dx, y), g) in dx.iter_mut().zip(y).zip(dy) {
                    *dx = T::from_acc(g.to_acc() - y.to_acc().exp() * s);
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
