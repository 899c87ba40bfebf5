//! Naive f64 RoPE, the oracle for tests.

use super::RopeShape;

/// `y = x * cos + rotate_half(x) * sin`, element by element.
pub fn rope_forward(s: &RopeShape, x: &[f64], cos: &[f64], sin: &[f64]) -> Vec<f64> {
    let (hd, half) = (s.head_dim, s.head_dim / 2);
    let mut y = vec![0.0; x.len()];
    for o in 0..s.outer {
        for t in 0..s.seq {
            for i in 0..s.inner {
                let base = ((o * s.seq + t) * s.inner + i) * hd;
                for j in 0..hd {
                    let rot = if j < half { -x[base + j + half] } else { x[base + j - half] };
                    y[base + j] = x[base + j] * cos[t * hd + j] + rot * sin[t * hd + j];
                }
            }
        }
    }
    y
}

/// `dx = J^T dy` for the forward map, built column by column from unit vectors
/// of one head (slow but independent of the fast kernel's algebra).
pub fn rope_backward(s: &RopeShape, dy: &[f64], cos: &[f64], sin: &[f64]) -> Vec<f64> {
    let hd = s.head_dim;
    let one = RopeShape { outer: 1, seq: 1, inner: 1, head_dim: hd };
    let mut dx = vec![0.0; dy.len()];
    for o in 0..s.outer {
        for t in 0..s.seq {
            let (c, sn) = (&cos[t * hd..(t + 1) * hd], &sin[t * hd..(t + 1) * hd]);
            for i in 0..s.inner {
                let base = ((o * s.seq + t) * s.inner + i) * hd;
                for j in 0..hd {
                    let mut e = vec![0.0; hd];
                    e[j] = 1.0;
                    let col = rope_forward(&one, &e, c, sn);
                    dx[base + j] = (0..hd).map(|k| col[k] * dy[base + k]).sum();
                }
            }
        }
    }
    dx
}

/// `v` laid out `[a, b, c, d]` (row-major), returned as `[a, c, b, d]`: the
/// transpose of dims 1 and 2 that separates the two row orders of
/// [`crate::cuda::raw::rope::RopeOrder`] (`[b, s, h, d]` and `[b, h, s, d]`).
pub fn swap12<T: Copy>(v: &[T], (a, b, c, d): (usize, usize, usize, usize)) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    for i in 0..a {
        for k in 0..c {
            for j in 0..b {
                let at = ((i * b + j) * c + k) * d;
                out.extend_from_slice(&v[at..at + d]);
            }
        }
    }
    out
}
