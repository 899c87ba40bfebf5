//! A one-block Llama written with plain tensor ops (embedding, RMSNorm, GQA
//! attention with RoPE, SwiGLU MLP, lm head, cross-entropy). Shared by the
//! `train_tiny` example, the `llama_block` benchmark and the training test.
#![allow(dead_code)]

use tpar::prelude::*;
use tpar::tensor::Result;

/// Sizes of the tiny model.
#[derive(Clone, Copy, Debug)]
pub struct TinyConfig {
    pub vocab: usize,
    pub dim: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hidden: usize,
    pub seq: usize,
    pub dtype: DType,
}

impl TinyConfig {
    pub fn head_dim(&self) -> usize {
        self.dim / self.heads
    }
}

/// Parameters of the tiny model (all leaves with `requires_grad`).
pub struct TinyLlama {
    pub cfg: TinyConfig,
    pub embed: Tensor,
    pub attn_norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
    pub mlp_norm: Tensor,
    pub w_gate: Tensor,
    pub w_up: Tensor,
    pub w_down: Tensor,
    pub final_norm: Tensor,
    pub lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
}

/// RoPE tables `[seq, head_dim]` (the Llama model's own, HF layout).
pub fn rope_tables(
    seq: usize,
    head_dim: usize,
    theta: f64,
    dtype: DType,
) -> std::result::Result<(Tensor, Tensor), tpar::nn::NnError> {
    let t = tpar::models::RotaryPositionEncoding::new(head_dim, seq, theta, dtype)?.tables(seq)?;
    Ok((t.cos, t.sin))
}

impl TinyLlama {
    pub fn new(cfg: TinyConfig, seed: u64) -> Result<Self> {
        let mut rng = Rng::new(seed);
        let hd = cfg.head_dim();
        let mut lin = |o: usize, i: usize| -> Result<Tensor> {
            let b = 1.0 / (i as f64).sqrt();
            Ok(Tensor::rand_uniform([o, i], -b, b, cfg.dtype, &mut rng)?.requires_grad_(true))
        };
        let (wq, wk, wv, wo) = (
            lin(cfg.heads * hd, cfg.dim)?,
            lin(cfg.kv_heads * hd, cfg.dim)?,
            lin(cfg.kv_heads * hd, cfg.dim)?,
            lin(cfg.dim, cfg.heads * hd)?,
        );
        let (w_gate, w_up, w_down) =
            (lin(cfg.hidden, cfg.dim)?, lin(cfg.hidden, cfg.dim)?, lin(cfg.dim, cfg.hidden)?);
        let lm_head = lin(cfg.vocab, cfg.dim)?;
        let ones = || -> Result<Tensor> {
            Ok(Tensor::ones([cfg.dim], cfg.dtype, Device::Cpu)?.requires_grad_(true))
        };
        let embed = Tensor::randn([cfg.vocab, cfg.dim], cfg.dtype, &mut Rng::new(seed ^ 0xE))?
            .requires_grad_(true);
        let (cos, sin) = rope_tables(cfg.seq, hd, 10000.0, cfg.dtype).map_err(|e| {
            tpar::tensor::TensorError::InvalidArgument { op: "rope_tables", what: e.to_string() }
        })?;
        Ok(TinyLlama {
            cfg,
            embed,
            attn_norm: ones()?,
            wq,
            wk,
            wv,
            wo,
            mlp_norm: ones()?,
            w_gate,
            w_up,
            w_down,
            final_norm: ones()?,
            lm_head,
            cos,
            sin,
        })
    }

    pub fn params(&self) -> Vec<Tensor> {
        vec![
            self.embed.clone(),
            self.attn_norm.clone(),
            self.wq.clone(),
            self.wk.clone(),
            self.wv.clone(),
            self.wo.clone(),
            self.mlp_norm.clone(),
            self.w_gate.clone(),
            self.w_up.clone(),
            self.w_down.clone(),
            self.final_norm.clone(),
            self.lm_head.clone(),
        ]
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, s) = (ids.dims()[0], ids.dims()[1]);
        let hd = c.head_dim();
        let eps = 1e-5;
        let x = Tensor::embedding(ids, &self.embed)?; // [b, s, dim]
        let h = x.rms_norm(&self.attn_norm, eps)?;
        let heads = |w: &Tensor, n: usize| -> Result<Tensor> {
            h.linear(w, None)? // [b, s, n*hd]
                .reshape([b, s, n, hd])?
                .transpose(1, 2) // [b, n, s, hd]
        };
        let (cos, sin) = (self.cos.narrow(0, 0, s)?, self.sin.narrow(0, 0, s)?);
        let q = heads(&self.wq, c.heads)?.rope(&cos, &sin, RopeLayout::Bhsd)?;
        let k = heads(&self.wk, c.kv_heads)?.rope(&cos, &sin, RopeLayout::Bhsd)?;
        let v = heads(&self.wv, c.kv_heads)?;
        let a = Tensor::scaled_dot_product_attention(&q, &k, &v, None, true, None)?; // [b, heads, s, hd]
        let a = a.transpose(1, 2)?.reshape([b, s, c.heads * hd])?.linear(&self.wo, None)?; // [b, s, dim]
        let x = x.add(&a)?;
        let h2 = x.rms_norm(&self.mlp_norm, eps)?;
        let gate = h2.linear(&self.w_gate, None)?.silu()?; // [b, s, hidden]
        let up = h2.linear(&self.w_up, None)?; // [b, s, hidden]
        let x = x.add(&gate.mul(&up)?.linear(&self.w_down, None)?)?; // [b, s, dim]
        x.rms_norm(&self.final_norm, eps)?.linear(&self.lm_head, None) // [b, s, vocab]
    }

    /// Mean next-token cross-entropy of `ids[:, :-1]` predicting `ids[:, 1:]`.
    pub fn loss(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, s1) = (ids.dims()[0], ids.dims()[1]);
        let s = s1 - 1;
        let inp = ids.narrow(1, 0, s)?;
        let tgt = ids.narrow(1, 1, s)?.reshape([b * s])?;
        let logits = self.forward(&inp)?.reshape([b * s, self.cfg.vocab])?;
        logits.cross_entropy(&tgt, -100)
    }

    /// One plain SGD step over all parameters; clears the gradients.
    pub fn sgd_step(&self, lr: f64) -> Result<()> {
        for p in self.params() {
            if let Some(g) = p.grad() {
                p.add_scaled_(&g, -lr)?;
            }
            p.zero_grad();
        }
        Ok(())
    }
}

/// A deterministic token sequence with structure a model can learn: `[batch, seq + 1]`.
pub fn pattern_batch(batch: usize, seq: usize, vocab: usize) -> Result<Tensor> {
    let mut v = Vec::with_capacity(batch * (seq + 1));
    for b in 0..batch {
        for t in 0..=seq {
            v.push(((b * 7 + t * 3 + (t / 4)) % vocab) as i64);
        }
    }
    Tensor::from_vec(v, [batch, seq + 1])
}
