//! Naive f64 matmul, the oracle for tests.

use super::GemmShape;

/// `out = A·B` (plus `init` when given) for every batch, in f64 with triple loops.
///
/// # Panics
/// If the buffers are too short for `s`.
pub fn matmul(s: &GemmShape, a: &[f64], b: &[f64], init: Option<&[f64]>) -> Vec<f64> {
    let (m, n, k) = (s.m, s.n, s.k);
    let mut out = init.map_or_else(|| vec![0.0; s.batch * m * n], <[f64]>::to_vec);
    for bi in 0..s.batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0;
                for p in 0..k {
                    let ai = if s.trans_a { p * m + i } else { i * k + p };
                    let bj = if s.trans_b { j * k + p } else { p * n + j };
                    acc += a[bi * s.a_batch_stride + ai] * b[bi * s.b_batch_stride + bj];
                }
                out[(bi * m + i) * n + j] += acc;
            }
        }
    }
    out
}
