//! Naive f64 softmax, the oracle for tests.

/// Row-wise softmax (`log = false`) or log-softmax (`log = true`); an all
/// `-inf` row gives zeros (resp. `-inf`).
pub fn forward(x: &[f64], cols: usize, log: bool) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for r in x.chunks(cols) {
        let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            y.extend(r.iter().map(|_| if log { f64::NEG_INFINITY } else { 0.0 }));
            continue;
        }
        let lse = m + r.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        y.extend(r.iter().map(|v| if log { v - lse } else { (v - lse).exp() }));
    }
    y
}

/// Row-wise backward from the forward output `y`: softmax `y*(dy - <dy, y>)`,
/// log-softmax `dy - exp(y)*sum(dy)`.
pub fn backward(y: &[f64], dy: &[f64], cols: usize, log: bool) -> Vec<f64> {
    let mut dx = Vec::with_capacity(y.len());
    for (yr, gr) in y.chunks(cols).zip(dy.chunks(cols)) {
        if log {
            let s: f64 = gr.iter().sum();
            dx.extend(yr.iter().zip(gr).map(|(y, g)| g - y.exp() * s));
        } else {
            let s: f64 = yr.iter().zip(gr).map(|(y, g)| y * g).sum();
            dx.extend(yr.iter().zip(gr).map(|(y, g)| y * (g - s)));
        }
    }
    dx
}
