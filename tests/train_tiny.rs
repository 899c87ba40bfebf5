//! A tiny Llama-like block (embedding, RMSNorm, GQA attention with RoPE, SwiGLU MLP,
//! lm head, cross-entropy) trained with plain SGD on a fixed sequence: the loss must
//! fall by at least half.

#[path = "../examples/common/tiny_llama.rs"]
mod tiny_llama;

use tiny_llama::{pattern_batch, TinyConfig, TinyLlama};
use tpar::prelude::*;

fn train(dtype: DType, steps: usize, lr: f64) -> (f64, f64) {
    let cfg = TinyConfig { vocab: 32, dim: 32, heads: 4, kv_heads: 2, hidden: 64, seq: 16, dtype };
    let model = TinyLlama::new(cfg, 1).unwrap();
    let batch = pattern_batch(4, cfg.seq, cfg.vocab).unwrap();
    let mut first = f64::NAN;
    let mut last = f64::NAN;
    for step in 0..steps {
        let loss = model.loss(&batch).unwrap();
        loss.backward().unwrap();
        model.sgd_step(lr).unwrap();
        last = loss.item().unwrap();
        if step == 0 {
            first = last;
        }
        assert!(last.is_finite(), "step {step}: loss {last}");
    }
    (first, last)
}

#[test]
fn tiny_llama_loss_halves_with_sgd_f32() {
    let (first, last) = train(DType::F32, 40, 0.5);
    assert!(last < first / 2.0, "loss {first} -> {last}");
}

#[test]
fn tiny_llama_loss_halves_with_sgd_bf16() {
    let (first, last) = train(DType::BF16, 40, 0.5);
    assert!(last < first / 2.0, "loss {first} -> {last}");
}
