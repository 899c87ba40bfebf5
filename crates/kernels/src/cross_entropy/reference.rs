//! Naive f64 cross-entropy, the oracle for tests.

/// Returns `(loss_rows, lse)` for `logits: [rows, vocab]`; ignored rows have loss 0.
pub fn cross_entropy_forward(
    logits: &[f64],
    vocab: usize,
    targets: &[i64],
    ignore_index: i64,
) -> (Vec<f64>, Vec<f64>) {
    let mut loss = Vec::new();
    let mut lse = Vec::new();
    for (row, &t) in logits.chunks(vocab).zip(targets) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        lse.push(l);
        loss.push(if t == ignore_index { 0.0 } else { l - row[t as usize] });
    }
    (loss, lse)
}

/// `(softmax - onehot) * row_scale[r]` (zeros for ignored rows), unsharded.
pub fn cross_entropy_backward(
    logits: &[f64],
    vocab: usize,
    targets: &[i64],
    ignore_index: i64,
    row_scale: &[f64],
) -> Vec<f64> {
    let (_, lse) = cross_entropy_forward(logits, vocab, targets, ignore_index);
    let mut d = Vec::new();
    for (r, row) in logits.chunks(vocab).enumerate() {
        let t = targets[r];
        for (c, x) in row.iter().enumerate() {
            d.push(if t == ignore_index {
                0.0
            } else {
                ((x - lse[r]).exp() - f64::from(c as i64 == t)) * row_scale[r]
            });
        }
    }
    d
}
