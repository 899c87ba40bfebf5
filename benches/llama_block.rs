//! Forward + backward step time of one Llama block (the `train_tiny` model at a
//! bench size), with the share of time spent in its matmuls measured in the same run.
//! Run: `cargo bench --bench llama_block`.

#[path = "../examples/common/tiny_llama.rs"]
mod tiny_llama;

use std::time::Instant;

use tiny_llama::{pattern_batch, TinyConfig, TinyLlama};
use tpar::prelude::*;

fn main() -> Result<(), TensorError> {
    for dtype in [DType::F32, DType::BF16] {
        let cfg = TinyConfig {
            vocab: 512,
            dim: 256,
            heads: 8,
            kv_heads: 4,
            hidden: 704,
            seq: 256,
            dtype,
        };
        let batch = 4;
        let model = TinyLlama::new(cfg, 0)?;
        let ids = pattern_batch(batch, cfg.seq, cfg.vocab)?;
        let mut times = Vec::new();
        for _ in 0..6 {
            let t = Instant::now();
            let loss = model.loss(&ids)?;
            loss.backward()?;
            for p in model.params() {
                p.zero_grad();
            }
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let step = times[times.len() / 2];
        // Matmul FLOPs of the block: 3 per weight element per token (fwd + 2 bwd GEMMs).
        let tokens = (batch * cfg.seq) as f64;
        let hd = cfg.head_dim();
        let weights = (cfg.dim * (cfg.heads + 2 * cfg.kv_heads) * hd
            + cfg.heads * hd * cfg.dim
            + 3 * cfg.dim * cfg.hidden
            + cfg.vocab * cfg.dim) as f64;
        let attn = 4.0 * (cfg.seq as f64) * (cfg.heads * hd) as f64 / 2.0; // causal QK^T and PV per token
        let flops = 3.0 * 2.0 * tokens * weights + 3.0 * tokens * attn;
        // Baseline in the same run: one matmul of the block's MLP shape.
        let mut rng = Rng::new(9);
        let x = Tensor::randn([batch * cfg.seq, cfg.dim], dtype, &mut rng)?;
        let w = Tensor::randn([cfg.hidden, cfg.dim], dtype, &mut rng)?;
        let mut mm = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            x.linear(&w, None)?;
            mm.push(t.elapsed().as_secs_f64());
        }
        mm.sort_by(f64::total_cmp);
        let mm_gflops = 2.0 * tokens * (cfg.dim * cfg.hidden) as f64 / mm[mm.len() / 2] / 1e9;
        let gflops = flops / step / 1e9;
        println!(
            "llama block {}: batch {batch} seq {} dim {} -> median fwd+bwd {:.1} ms, {:.0} tokens/s, \
             {gflops:.1} GFLOP/s = {:.2} x the same-run MLP matmul ({mm_gflops:.1} GFLOP/s)",
            dtype.name(),
            cfg.seq,
            cfg.dim,
            step * 1e3,
            tokens / step,
            gflops / mm_gflops
        );
    }
    Ok(())
}
