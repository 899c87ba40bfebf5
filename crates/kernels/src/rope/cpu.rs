//! Rayon RoPE kernel: one `(o, t)` row of `inner * head_dim` elements per item.

use rayon::prelude::*;

use super::RopeShape;
use crate::{Float, Out};

/// Forward (`transpose = false`) or its transpose (`true`), with
/// `x = (x1, x2)`, `c = (c1, c2)`, `s = (s1, s2)`:
/// forward `y1 = x1 c1 - x2 s1`, `y2 = x2 c2 + x1 s2`;
/// transpose `y1 = x1 c1 + x2 s2`, `y2 = x2 c2 - x1 s1`.
pub(super) fn apply<T: Float, O: Out<T>>(
    s: &RopeShape,
    x: &[T],
    cos: &[T],
    sin: &[T],
    y: &mut [O],
    transpose: bool,
) {
    let (hd, seq) = (s.head_dim, s.seq);
    let row = s.inner * hd;
    if row == 0 || y.is_empty() {
        return;
    }
    let half = hd / 2;
    let c: Vec<T::Acc> = cos.iter().map(|v| v.to_acc()).collect();
    let sn: Vec<T::Acc> = sin.iter().map(|v| v.to_acc()).collect();
    y.par_chunks_mut(row).zip(x.par_chunks(row)).enumerate().for_each(|(ot, (y, x))| {
        let t = ot % seq;
        let (c1, c2) = c[t * hd..(t + 1) * hd].split_at(half);
        let (s1, s2) = sn[t * hd..(t + 1) * hd].split_at(half);
        for (y, x) in y.chunks_mut(hd).zip(x.chunks(hd)) {
            let (y1, y2) = y.split_at_mut(half);
            let (x1, x2) = x.split_at(half);
            for j in 0..half {
                let (a, b) = (x1[j].to_acc(), x2[j].to_acc());
                if transpose {
                    y1[j].put(T::from_acc(a * c1[j] + b * s2[j]));
                    y2[j].put(T::from_acc(b * c2[j] - a * s1[j]));
                } else {
                    y1[j].put(T::from_acc(a * c1[j] - b * s1[j]));
                    y2[j].put(T::from_acc(b * c2[j] + a * s2[j]));
                }
            }
        }
    });
}
