//! Naive f64 RMSNorm, the oracle for tests.

/// Returns `(y, rstd)` for `x: [rows, dim]`, `weight: [dim]`.
pub fn rmsnorm_forward(x: &[f64], weight: &[f64], dim: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; x.len()];
    let mut rstd = Vec::new();
    for (xr, yr) in x.chunks(dim).zip(y.chunks_mut(dim)) {
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps).sqrt();
        for j in 0..dim {
            yr[j] = xr[j] * r * weight[j];
        }
        rstd.push(r);
    }
    (y, rstd)
}

/// Returns `(dx, dweight)` given `dy`; recomputes `rstd` from `x`.
pub fn rmsnorm_backward(
    x: &[f64],
    weight: &[f64],
    dy: &[f64],
    dim: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; dim];
    for ((xr, gr), dxr) in x.chunks(dim).zip(dy.chunks(dim)).zip(dx.chunks_mut(dim)) {
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps).sqrt();
        let s: f64 = (0..dim).map(|j| gr[j] * weight[j] * xr[j]).sum();
        for j in 0..dim {
            dxr[j] = r * gr[j] * weight[j] - r * r * r * xr[j] * s / dim as f64;
            dw[j] += gr[j] * xr[j] * r;
        }
    }
    (dx, dw)
}
