//! Trains a one-block Llama on a fixed token pattern with plain SGD on the CPU and
//! prints the loss falling. Run: `cargo run --release --example train_tiny`.

#[path = "common/tiny_llama.rs"]
mod tiny_llama;

use std::time::Instant;

use tiny_llama::{pattern_batch, TinyConfig, TinyLlama};
use tpar::prelude::*;

fn main() -> Result<(), TensorError> {
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(60);
    let cfg = TinyConfig {
        vocab: 64,
        dim: 64,
        heads: 4,
        kv_heads: 2,
        hidden: 128,
        seq: 32,
        dtype: DType::F32,
    };
    let model = TinyLlama::new(cfg, 0)?;
    let batch = pattern_batch(8, cfg.seq, cfg.vocab)?;
    let t0 = Instant::now();
    let mut first = None;
    let mut last = 0.0;
    for step in 0..steps {
        let loss = model.loss(&batch)?;
        loss.backward()?;
        model.sgd_step(0.5)?;
        last = loss.item()?;
        first.get_or_insert(last);
        if step % 10 == 0 || step + 1 == steps {
            println!("step {step:4}  loss {last:.4}");
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let tokens = (steps * 8 * cfg.seq) as f64;
    println!(
        "summary: steps={steps} first_loss={:.4} final_loss={last:.4} tokens_per_s={:.0} seconds={secs:.2}",
        first.unwrap_or(last),
        tokens / secs
    );
    Ok(())
}
