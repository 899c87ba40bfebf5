//! Naive f64 attention with a materialized softmax, the oracle for tests.

use super::{SdpaMask, SdpaShape};

/// Softmax probabilities of query row `i` of (b, h) and the row's lse
/// (`-inf` and all-zero probabilities when every key is masked).
fn probs(
    s: &SdpaShape,
    q: &[f64],
    k: &[f64],
    mask: Option<&SdpaMask<f64>>,
    b: usize,
    h: usize,
    i: usize,
) -> (Vec<f64>, f64) {
    let (d, kv) = (s.head_dim, b * s.kv_heads + h / (s.q_heads / s.kv_heads));
    let qi = &q[((b * s.q_heads + h) * s.q_len + i) * d..][..d];
    let sc: Vec<f64> = (0..s.kv_len)
        .map(|j| {
            if s.causal && j > i {
                return f64::NEG_INFINITY;
            }
            let kj = &k[(kv * s.kv_len + j) * d..][..d];
            let m = mask.map_or(0.0, |m| {
                m.data[b * m.batch_stride + h * m.head_stride + i * m.row_stride + j]
            });
            s.scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() + m
        })
        .collect();
    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if mx == f64::NEG_INFINITY {
        return (vec![0.0; s.kv_len], mx);
    }
    let lse = mx + sc.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
    (sc.iter().map(|x| (x - lse).exp()).collect(), lse)
}

/// Returns `(out, lse)`.
pub fn sdpa_forward(
    s: &SdpaShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: Option<&SdpaMask<f64>>,
) -> (Vec<f64>, Vec<f64>) {
    let dv = s.v_dim;
    let mut out = vec![0.0; s.batch * s.q_heads * s.q_len * dv];
    let mut lse = vec![0.0; s.batch * s.q_heads * s.q_len];
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let kv = b * s.kv_heads + h / (s.q_heads / s.kv_heads);
            for i in 0..s.q_len {
                let r = (b * s.q_heads + h) * s.q_len + i;
                let (p, l) = probs(s, q, k, mask, b, h, i);
                lse[r] = l;
                for j in 0..s.kv_len {
                    for c in 0..dv {
                        out[r * dv + c] += p[j] * v[(kv * s.kv_len + j) * dv + c];
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Returns `(dq, dk, dv)` for the upstream gradient `dout`.
pub fn sdpa_backward(
    s: &SdpaShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: Option<&SdpaMask<f64>>,
    dout: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (d, dvd) = (s.head_dim, s.v_dim);
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let kv = b * s.kv_heads + h / (s.q_heads / s.kv_heads);
            for i in 0..s.q_len {
                let r = (b * s.q_heads + h) * s.q_len + i;
                let (p, _) = probs(s, q, k, mask, b, h, i);
                let g = &dout[r * dvd..][..dvd];
                let dp: Vec<f64> = (0..s.kv_len)
                    .map(|j| (0..dvd).map(|c| g[c] * v[(kv * s.kv_len + j) * dvd + c]).sum())
                    .collect();
                let dsum: f64 = (0..s.kv_len).map(|j| p[j] * dp[j]).sum();
                for j in 0..s.kv_len {
                    let ds = p[j] * (dp[j] - dsum) * s.scale;
                    let kr = (kv * s.kv_len + j) * d;
                    for c in 0..d {
                        dq[r * d + c] += ds * k[kr + c];
                        dk[kr + c] += ds * q[r * d + c];
                    }
                    for c in 0..dvd {
                        dv[(kv * s.kv_len + j) * dvd + c] += p[j] * g[c];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}
