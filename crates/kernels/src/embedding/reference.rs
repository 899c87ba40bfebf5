//! Naive f64 embedding, the oracle for tests.

/// Gathers rows; ids outside `[vocab_start, vocab_start + vocab)` give zero rows.
pub fn embedding_forward(
    weight: &[f64],
    vocab: usize,
    dim: usize,
    ids: &[i64],
    vocab_start: i64,
) -> Vec<f64> {
    let mut out = vec![0.0; ids.len() * dim];
    for (n, &id) in ids.iter().enumerate() {
        let r = id - vocab_start;
        if r >= 0 && (r as usize) < vocab {
            out[n * dim..(n + 1) * dim].copy_from_slice(&weight[r as usize * dim..][..dim]);
        }
    }
    out
}

/// Scatter-adds `dout` rows into a `[vocab, dim]` gradient, skipping ids outside the slice.
pub fn embedding_backward(
    ids: &[i64],
    vocab_start: i64,
    dout: &[f64],
    vocab: usize,
    dim: usize,
) -> Vec<f64> {
    let mut dw = vec![0.0; vocab * dim];
    for (n, &id) in ids.iter().enumerate() {
        let r = id - vocab_start;
        if r >= 0 && (r as usize) < vocab {
            for c in 0..dim {
                dw[r as usize * dim + c] += dout[n * dim + c];
            }
        }
    }
    dw
}
