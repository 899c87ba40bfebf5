//! Per-rank peak memory of a Llama training step, predicted before anything is
//! allocated: [`predict_memory`] takes the model, the mesh degrees, the data-parallel
//! mode, the tensor-parallel plan, the batch, the sequence, the pipeline schedule and
//! the activation-checkpointing policy, and returns a [`MemoryEstimate`] per rank
//! (parameters, gradients, optimizer state, activations, the largest transient and the
//! peak). [`MemoryEstimate::fits`] answers "does it fit in N bytes" with a typed error
//! that names the configuration and every number when it does not.
//!
//! # What the model counts
//!
//! The figures follow what this implementation keeps, not a generic formula. Below `b`
//! is the rows a rank computes at once (its batch, or a micro-batch under a pipeline),
//! `s` the sequence, `h` the hidden size, `q = heads * head_dim`, `kv = kv_heads *
//! head_dim`, `i` the MLP width, `v` the vocabulary and `t` the tensor-parallel degree;
//! `[x]` is `b * s * x` elements in the compute dtype. A size that does not divide
//! evenly by its degree is counted at its average share.
//!
//! - **Parameters**: every parameter's local shard in the parameter dtype: divided by
//!   `t` for the sharded projections, embedding and head (the norms' weights are
//!   replicated over tp), and by `dp` as well under FSDP (`fully_shard` shards dim 0);
//!   under FSDP mixed precision each shard's working copy in the compute dtype too.
//! - **Gradients**: one per parameter, laid out like the parameter (FSDP reduce-scatters
//!   into the shard; DDP and ZeRO-1 keep a full replica's gradient).
//! - **Optimizer state**: AdamW's two moments per trainable element, in f32 (f64 for f64
//!   parameters); ZeRO-1 and FSDP divide them by `dp`.
//! - **Activations** kept for the backward, per decoder layer without checkpointing:
//!   the RMSNorm inputs `[h]` twice (divided by `t` under the sequence-parallel plan,
//!   whose norms see a sequence shard), the normed inputs the q/k/v and gate/up
//!   projections save `[h]` twice (gathered to the whole sequence under tp), q `[q/t]`,
//!   k and v `[2 kv/t]` (after RoPE for q and k, saved by attention), attention's output
//!   `[q/t]` and its `[b, s, q]` copy that `o_proj` saves `[q/t]`, and the gate, up and
//!   SwiGLU outputs `[3 i/t]`; the row statistics (RMSNorm's and attention's
//!   log-sum-exps) are a few values per row. Residual sums and RoPE keep nothing
//!   (an add's backward reads no operand; RoPE keeps only its tables). Then the final
//!   norm's input `[h/t]` (sp) or `[h]`, the head's input `[h]` and the logits `[v/t]`,
//!   which the loss keeps. The autograd graph frees a closure's saved tensors when the
//!   graph is dropped, not during the backward: activations live until the loss is
//!   dropped (a trainer holds it through the optimizer step).
//! - **Full checkpointing** keeps a checkpointed layer's input `[h/t]` (sp) or `[h]`
//!   only; during its backward the recomputed layer's activations exist once.
//!   **Selective** keeps the layer input and the outputs of the kept ops (by default
//!   attention and every second matmul: q, v, gate and down): of the matmuls
//!   (`[q + 2 kv]/t` for q/k/v, `[h]` for o_proj, `[2 i/t]` for gate and up, `[h]` for
//!   down, gathered or partial outputs at their local size) and attention (`[q/t]`); its
//!   recompute adds the rest once (the normed inputs, RoPE'd q and k, the output copy,
//!   the residual, the SwiGLU output).
//! - **Largest transient**: the biggest of (a) a layer's backward workspace: the MLP's
//!   input gradients `[3 i/t]` and the hidden-state gradient `[h]`, plus under
//!   checkpointing the recomputed layer; (b) the loss's backward: the logits' gradient
//!   `[v/t]` (the logits themselves are counted as activations); (c) under FSDP, a unit's
//!   gathered parameters, the next unit's prefetched ones and the unit's unsharded
//!   gradients before the reduce-scatter: three decoder layers' worth of local
//!   parameters in the compute dtype; DDP adds its gradient buckets of one layer.
//!   To these the host adds the GEMM kernels' packing buffers, kept per rank thread
//!   ([`HOST_GEMM_WORKSPACE`]).
//! - **Pipelines**: stage `r` of `pp` holds its layers' activations for the
//!   micro-batches in flight: all `m` under GPipe, `min(pp - r, m)` under 1F1B,
//!   `min(pp, m)` under zero-bubble; gradients exist from the first micro-batch's
//!   backward on, so the peak has every gradient and the in-flight activations. An
//!   activation sent to the next stage is a copy counted on the sender until the receiver
//!   drops it (one `[h]` of a micro-batch per micro-batch the next stage holds). A
//!   later micro-batch's backward makes a whole set of the stage's gradients before they
//!   are added into the accumulated ones: a transient of one more set of gradients,
//!   while the micro-batches still in flight are held.
//! - **Interleaved 1F1B** (`stages_per_rank` stages per pp rank, stage `s` on rank
//!   `s % pp`, the layers split over all `pp * stages_per_rank` stages): the rank's own
//!   action list (`tpar_pipeline::Schedule`) is walked in order. Each (stage,
//!   micro-batch) holds that stage's activations from its forward to the end of its
//!   backward; every boundary copy the rank sent (an activation to the next stage, an
//!   input gradient to the previous one) is held until its receiver's backward of that
//!   micro-batch ends, at the times of the schedule simulated with unit costs (forward 1,
//!   backward 2). A backward adds the largest of the transients above, or a whole set of
//!   its stage's gradients once that stage has accumulated ones; the peak is the highest
//!   point of the walk, with every gradient and the optimizer state beside it.
//!
//! The peak is parameters + gradients + optimizer state + activations + the largest
//! transient: at the end of the backward of the first layer, everything else is still
//! held (the graph keeps the activations, gradients are complete, the optimizer's state
//! was made by the previous step).
//!
//! - **Context parallelism**: every activation holds `s / cp` positions of its rows
//!   (attention under cp saves the same local q, k, v, output and log-sum-exps as plain
//!   attention); the ring adds the key and value blocks in flight (`[4 kv/t]` of the
//!   local rows, a transient); parameters are replicated over cp, or sharded over
//!   `dp x cp` under FSDP. The all-gather method ([`CpMethod::AllGather`]) gathers every
//!   rank's keys and values again in attention's backward and makes their gradients
//!   before the reduce-scatter: a layer's backward holds, beyond what the ring holds, the
//!   other `cp - 1` ranks' keys, values and their gradients (`[4 (cp - 1) kv/t]`). Its
//!   forward's gathered keys and values (`[2 cp kv/t]`) are freed when attention returns
//!   and stay below the backward's peak.
//!
//! What it does not model: padding masks (a `[b, 1, 1, s]` mask per micro-batch, and
//! under context parallelism every rank's `[b, s / cp]` key mask gathered once per
//! layer: small next to the activations), the communication buffers of collectives in
//! flight, and the timing of the rank threads (an interleaved rank's boundary copies
//! follow the unit-cost simulation, not the measured order).
//!
//! ```
//! use tpar_models::memory::{predict_memory, DataParallelMode, MemoryConfig};
//! use tpar_models::LlamaConfig;
//! let cfg = LlamaConfig {
//!     vocab_size: 512, hidden_size: 256, intermediate_size: 688, num_hidden_layers: 4,
//!     num_attention_heads: 8, num_key_value_heads: 4, max_position_embeddings: 256,
//!     ..Default::default()
//! };
//! let mut run = MemoryConfig::new(cfg, 2, 256);
//! run.dp = 2;
//! run.tp = 2;
//! run.data_parallel = DataParallelMode::Fsdp { param_dtype: None };
//! let est = predict_memory(&run)?;
//! assert!(est.peak > est.parameters + est.optimizer_state);
//! assert!(est.fits(1 << 30).is_ok());
//! let refused = est.fits(1 << 20).unwrap_err().to_string();
//! assert!(refused.contains("does not fit"), "{refused}");
//! # Ok::<(), tpar_models::memory::MemoryError>(())
//! ```

use std::fmt;

use std::collections::HashMap;

use tpar_dtensor::CpMethod;
use tpar_nn::checkpoint::AcPolicy;
use tpar_pipeline::{Costs, Phase, Schedule, ScheduleKind};
use tpar_tensor::checkpoint::SaveOp;
use tpar_tensor::DType;

use crate::LlamaConfig;

/// The GEMM kernels' packing buffers a host rank thread keeps between calls (measured
/// with the tracking allocator on the Llama steps of `tests/memory_model.rs`).
pub const HOST_GEMM_WORKSPACE: u64 = 2 << 20;

/// What the predictor refuses, and a configuration that does not fit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The configuration cannot be modelled (a size of 0, an unsupported axis or
    /// schedule, a layer count the pipeline cannot split, an overflow).
    #[error("memory model: {what}")]
    Config {
        /// What is wrong, with the values.
        what: String,
    },
    /// The predicted peak exceeds the budget.
    #[error(
        "{config}: predicted peak {peak} per rank does not fit in {budget} (parameters \
         {params}, gradients {grads}, optimizer state {optim}, activations {acts}, largest \
         transient {transient}: {transient_what})",
        peak = mib(estimate.peak),
        budget = mib(*budget),
        params = mib(estimate.parameters),
        grads = mib(estimate.gradients),
        optim = mib(estimate.optimizer_state),
        acts = mib(estimate.activations),
        transient = mib(estimate.transient),
        transient_what = estimate.transient_what
    )]
    DoesNotFit {
        /// The configuration, in words.
        config: String,
        /// The prediction.
        estimate: Box<MemoryEstimate>,
        /// The budget in bytes.
        budget: u64,
    },
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB ({bytes} B)", bytes as f64 / (1u64 << 20) as f64)
}

fn config_err(what: impl Into<String>) -> MemoryError {
    MemoryError::Config { what: what.into() }
}

/// How the dp mesh axis is used.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DataParallelMode {
    /// No data parallelism over dp (dp must be 1).
    None,
    /// Replicated parameters, gradients all-reduced.
    Ddp,
    /// Replicated parameters, AdamW state sharded over dp.
    Zero1,
    /// `fully_shard` per decoder layer, the base model and the root; `param_dtype` is the
    /// mixed-precision compute dtype (`None`: the parameters' dtype).
    Fsdp {
        /// The dtype parameters are gathered and computed in.
        param_dtype: Option<DType>,
    },
}

/// The tensor-parallel layer plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpPlan {
    /// Sequence parallel: norms and residuals on a sequence shard, the sequence gathered
    /// before attention and the MLP.
    SequenceParallel,
    /// Megatron: norms and residuals replicated.
    Megatron,
}

/// One training step's configuration, per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryConfig {
    /// The model (its `dtype` is the parameters' dtype).
    pub model: LlamaConfig,
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Context-parallel degree.
    pub cp: usize,
    /// How context-parallel attention exchanges keys and values (`cp > 1`).
    pub cp_method: CpMethod,
    /// Pipeline ranks.
    pub pp: usize,
    /// Stages per pp rank: several under [`ScheduleKind::Interleaved1F1B`] (stage `s` on
    /// pp rank `s % pp`), 1 for the other schedules.
    pub stages_per_rank: usize,
    /// How dp is used.
    pub data_parallel: DataParallelMode,
    /// The tensor-parallel plan (used when `tp > 1`).
    pub plan: TpPlan,
    /// Sequences per dp rank per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per step under a pipeline (`pp > 1`).
    pub microbatches: usize,
    /// The pipeline schedule (`pp > 1`).
    pub schedule: ScheduleKind,
    /// The activation-checkpointing policy on the decoder layers.
    pub ac: AcPolicy,
    /// Whether the ranks compute on the host (adds [`HOST_GEMM_WORKSPACE`]).
    pub host: bool,
}

impl MemoryConfig {
    /// One rank, no parallelism, no checkpointing, on the host: `batch` sequences of
    /// `seq` tokens per step.
    pub fn new(model: LlamaConfig, batch: usize, seq: usize) -> MemoryConfig {
        MemoryConfig {
            model,
            dp: 1,
            tp: 1,
            cp: 1,
            cp_method: CpMethod::Ring,
            pp: 1,
            stages_per_rank: 1,
            data_parallel: DataParallelMode::None,
            plan: TpPlan::SequenceParallel,
            batch,
            seq,
            microbatches: 1,
            schedule: ScheduleKind::OneFOneB,
            ac: AcPolicy::None,
            host: true,
        }
    }
}

impl fmt::Display for MemoryConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.model;
        write!(
            f,
            "Llama ({} layers, hidden {}, mlp {}, heads {}/{}, vocab {}, {}) at dp {} x tp {} x cp {} x pp {}",
            c.num_hidden_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.vocab_size,
            c.dtype,
            self.dp,
            self.tp,
            self.cp,
            self.pp
        )?;
        match self.data_parallel {
            DataParallelMode::None => {}
            DataParallelMode::Ddp => write!(f, ", DDP")?,
            DataParallelMode::Zero1 => write!(f, ", ZeRO-1")?,
            DataParallelMode::Fsdp { param_dtype: None } => write!(f, ", FSDP")?,
            DataParallelMode::Fsdp { param_dtype: Some(d) } => write!(f, ", FSDP ({d} compute)")?,
        }
        if self.tp > 1 {
            let plan = match self.plan {
                TpPlan::SequenceParallel => "sp",
                TpPlan::Megatron => "megatron",
            };
            write!(f, ", plan {plan}")?;
        }
        if self.cp > 1 {
            let method = match self.cp_method {
                CpMethod::Ring => "ring",
                CpMethod::AllGather => "all-gather",
            };
            write!(f, ", cp {method}")?;
        }
        write!(f, ", batch {} x seq {}", self.batch, self.seq)?;
        if self.pp > 1 {
            write!(f, ", {} micro-batches {}", self.microbatches, self.schedule)?;
            if self.schedule == ScheduleKind::Interleaved1F1B {
                write!(f, " ({} stages per rank)", self.stages_per_rank)?;
            }
        }
        write!(f, ", ac {}", self.ac)
    }
}

/// The predicted memory of one rank, in bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryEstimate {
    /// The configuration, in words (for messages).
    pub config: String,
    /// The pipeline stage (pp rank) this estimate is for (0 without a pipeline).
    pub stage: usize,
    /// Local parameter shards (and their compute-dtype working copies under FSDP mixed
    /// precision).
    pub parameters: u64,
    /// Gradients of the local parameters.
    pub gradients: u64,
    /// AdamW's moments.
    pub optimizer_state: u64,
    /// Activations the graph keeps at the peak (all micro-batches in flight).
    pub activations: u64,
    /// The largest transient at the peak (with the host's kernel workspace).
    pub transient: u64,
    /// What the largest transient is.
    pub transient_what: String,
    /// The predicted peak: the sum of the above.
    pub peak: u64,
}

impl MemoryEstimate {
    /// `Ok` when the peak fits in `budget_bytes`; otherwise an error naming the
    /// configuration, each term and the budget.
    pub fn fits(&self, budget_bytes: u64) -> Result<(), MemoryError> {
        if self.peak <= budget_bytes {
            return Ok(());
        }
        Err(MemoryError::DoesNotFit {
            config: self.config.clone(),
            estimate: Box::new(self.clone()),
            budget: budget_bytes,
        })
    }
}

impl fmt::Display for MemoryEstimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "predicted peak {:.1} MiB per rank (stage {}): parameters {:.1}, gradients {:.1}, \
             optimizer state {:.1}, activations {:.1}, largest transient {:.1} ({})",
            m(self.peak),
            self.stage,
            m(self.parameters),
            m(self.gradients),
            m(self.optimizer_state),
            m(self.activations),
            m(self.transient),
            self.transient_what
        )
    }
}

/// Elements per token of a decoder layer's tensors, local to a rank.
struct LayerShape {
    /// The residual stream at a norm (divided by tp under sp).
    resid: f64,
    /// A normed input gathered for the projections.
    full: f64,
    q: f64,
    kv: f64,
    mlp: f64,
}

impl LayerShape {
    /// What a layer keeps without checkpointing.
    fn kept(&self) -> f64 {
        // x and x1 at the norms, h1 and h2 at the projections, q, k, v, attention's
        // output and its copy, gate, up and the SwiGLU output.
        2.0 * self.resid + 2.0 * self.full + 3.0 * self.q + 2.0 * self.kv + 3.0 * self.mlp
    }

    /// What a selectively checkpointed layer keeps: its input and the kept ops' outputs.
    fn kept_selective(&self, ops: &[SaveOp]) -> f64 {
        let matmul = ops.contains(&SaveOp::Matmul);
        // Every second matmul (`matmul/2`, torchtitan's policy): the 1st, 3rd, 5th, 7th.
        let every_other = !matmul && ops.iter().any(|o| o.name() == "matmul/2");
        // The seven matmuls' outputs in order: q, k, v, o, gate, up, down.
        let outs = [self.q, self.kv, self.kv, self.full, self.mlp, self.mlp, self.full];
        let mm: f64 = outs
            .iter()
            .enumerate()
            .filter(|(n, _)| matmul || (every_other && n % 2 == 0))
            .map(|(_, e)| e)
            .sum();
        let sdpa = if ops.contains(&SaveOp::Sdpa) { self.q } else { 0.0 };
        self.resid + mm + sdpa
    }
}

fn stat_bytes(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        8.0
    } else {
        4.0
    }
}

/// The predicted memory of the rank with the highest peak (under a pipeline, the stage
/// whose peak is highest; see [`predict_memory_stage`] for one stage).
pub fn predict_memory(c: &MemoryConfig) -> Result<MemoryEstimate, MemoryError> {
    let mut best: Option<MemoryEstimate> = None;
    for s in 0..c.pp.max(1) {
        let e = predict_memory_stage(c, s)?;
        if best.as_ref().is_none_or(|b| e.peak > b.peak) {
            best = Some(e);
        }
    }
    best.ok_or_else(|| config_err("pp is 0"))
}

/// The predicted memory of a rank of pipeline stage `stage` (0 without a pipeline; the pp
/// rank under [`ScheduleKind::Interleaved1F1B`], whose stages are `stage`,
/// `stage + pp`, ...).
pub fn predict_memory_stage(c: &MemoryConfig, stage: usize) -> Result<MemoryEstimate, MemoryError> {
    validate(c, stage)?;
    let m = &c.model;
    let (h, v, i) = (m.hidden_size as f64, m.vocab_size as f64, m.intermediate_size as f64);
    let hd = m.head_dim() as f64;
    let q = m.num_attention_heads as f64 * hd;
    let kvw = m.num_key_value_heads as f64 * hd;
    let t = c.tp as f64;
    let sp = c.tp > 1 && c.plan == TpPlan::SequenceParallel;
    let (fsdp, compute) = match c.data_parallel {
        DataParallelMode::Fsdp { param_dtype } => (true, param_dtype.unwrap_or(m.dtype)),
        _ => (false, m.dtype),
    };
    let pbytes = m.dtype.size_in_bytes() as f64;
    let abytes = compute.size_in_bytes() as f64;
    let obytes = if m.dtype == DType::F64 { 8.0 } else { 4.0 };

    // The stages of this pp rank (`stage`, `stage + pp`, ... under interleaved 1F1B), their
    // layers, and whether the rank holds the embedding (stage 0) and the head (the last).
    let per_rank = if c.pp > 1 { c.stages_per_rank } else { 1 };
    let num_stages = c.pp * per_rank;
    let ranges = tpar_pipeline::split_blocks(m.num_hidden_layers, num_stages, None)
        .map_err(|e| config_err(e.to_string()))?;
    let mine: Vec<usize> = (0..per_rank).map(|j| stage + j * c.pp).collect();
    let layers: usize = mine.iter().map(|&s| ranges[s].len()).sum();
    let last = stage + 1 == c.pp;

    // Parameters, local to a tp rank (norm weights replicated over tp).
    let layer_params = (2.0 * h * (q + kvw) + 3.0 * h * i) / t + 2.0 * h;
    let stage_elems = |s: usize| {
        let mut e = ranges[s].len() as f64 * layer_params;
        if s == 0 {
            e += v * h / t;
        }
        if s + 1 == num_stages {
            e += v * h / t + h;
        }
        e
    };
    let elems: f64 = mine.iter().map(|&s| stage_elems(s)).sum();
    // FSDP shards over dp x cp (parameters are replicated over cp otherwise).
    let dp = c.dp as f64;
    let fsdp_ranks = dp * c.cp as f64;
    let shard = if fsdp { elems / fsdp_ranks } else { elems };
    // FSDP mixed precision keeps each shard's compute-dtype working copy beside it (AdamW
    // writes it in its step for the next gathers).
    let working_copy = if fsdp && compute != m.dtype { shard * abytes } else { 0.0 };
    let parameters = shard * pbytes + working_copy;
    let gradients = shard * pbytes;
    let optimizer_state = match c.data_parallel {
        DataParallelMode::Zero1 => 2.0 * elems / dp * obytes,
        DataParallelMode::Fsdp { .. } => 2.0 * elems / fsdp_ranks * obytes,
        _ => 2.0 * elems * obytes,
    };

    // Activations per token of one decoder layer, and the rows in flight.
    let shape = LayerShape {
        resid: if sp { h / t } else { h },
        full: h,
        q: q / t,
        kv: kvw / t,
        mlp: i / t,
    };
    let mb = if c.pp > 1 { c.microbatches } else { 1 };
    let rows = c.batch as f64 / mb as f64;
    // Each cp rank holds `seq / cp` positions of every row.
    let tokens = rows * c.seq as f64 / c.cp as f64;
    let stat = stat_bytes(compute);
    // Row statistics: two RMSNorm rstd per token and attention's log-sum-exp per head.
    let stats = (2.0 + m.num_attention_heads as f64 / t) * stat;
    let full_layer = tokens * (shape.kept() * abytes + stats);
    let mut recompute = 0.0f64;
    // What one micro-batch keeps on each of this rank's stages. The policy counts the
    // checkpointable layers of the module it is applied to: the stage's.
    let mut stage_mb = Vec::with_capacity(per_rank);
    for &s in &mine {
        let mut kept_mb = 0.0;
        for l in 0..ranges[s].len() {
            let (kept, again) = match &c.ac {
                AcPolicy::Full { every } if (l + 1) % every == 0 => {
                    (tokens * shape.resid * abytes, full_layer)
                }
                AcPolicy::Selective { every, ops } if (l + 1) % every == 0 => {
                    let k = tokens * shape.kept_selective(ops) * abytes;
                    (k, (full_layer - k + tokens * shape.resid * abytes).max(0.0))
                }
                _ => (full_layer, 0.0),
            };
            kept_mb += kept;
            recompute = recompute.max(again);
        }
        if s + 1 == num_stages {
            // The final norm's input, the head's input and the logits.
            kept_mb += tokens * (shape.resid + h + v / t) * abytes + tokens * stat;
        }
        stage_mb.push(kept_mb);
    }
    let per_mb: f64 = stage_mb.iter().sum();

    // The largest transient of a layer's or the loss's backward (what a pipeline adds is
    // weighed below).
    let mut options: Vec<(f64, String)> = Vec::new();
    if layers > 0 {
        let ws = tokens * (3.0 * shape.mlp + h) * abytes;
        let what = if recompute > 0.0 {
            "a layer's backward with its recomputed activations"
        } else {
            "a layer's backward (MLP input gradients)"
        };
        if c.cp > 1 && c.cp_method == CpMethod::AllGather {
            // Over the ring, attention's backward holds the other ranks' keys and values
            // (gathered again) and their gradients before the reduce-scatter.
            let gathered = 4.0 * (c.cp - 1) as f64 * tokens * shape.kv * abytes;
            options.push((
                ws + recompute + gathered,
                format!(
                    "{what}, with the keys and values of {} cp ranks and their gradients",
                    c.cp
                ),
            ));
        } else {
            options.push((ws + recompute, what.into()));
        }
    }
    if last {
        options.push((tokens * v / t * abytes, "the logits' gradient".into()));
    }
    if fsdp && layers > 0 {
        let unit = layer_params * compute.size_in_bytes() as f64;
        options.push((
            3.0 * unit,
            "FSDP: a unit gathered, the next prefetched, its unsharded gradients".into(),
        ));
    }
    if c.cp > 1 && layers > 0 {
        // The ring: the key and value blocks received for the next hop while the current
        // ones are used, forward and backward (where dk and dv travel with them).
        options.push((4.0 * tokens * shape.kv * abytes, "cp: key/value blocks in flight".into()));
    }
    if c.data_parallel == DataParallelMode::Ddp && layers > 0 {
        options.push((layer_params * pbytes, "DDP: a layer's gradient bucket".into()));
    }

    // An activation sent to the next stage is a copy counted on the sender until the
    // receiver drops it after its backward; an input gradient sent back likewise.
    let boundary = tokens * shape.resid * abytes;
    let (activations, pipeline_transient) =
        if c.pp > 1 && c.schedule == ScheduleKind::Interleaved1F1B {
            let grads_of = |j: usize| {
                let e = stage_elems(mine[j]);
                (if fsdp { e / fsdp_ranks } else { e }) * pbytes
            };
            let grads: Vec<f64> = (0..per_rank).map(grads_of).collect();
            let base = options.iter().map(|o| o.0).fold(0.0, f64::max);
            let held = interleaved_peak(c, stage, &stage_mb, &grads, boundary, base)?;
            if held.transient > base {
                options.push((
                    held.transient,
                    "a later micro-batch's gradients, before their accumulation".into(),
                ));
            }
            (held.activations, None)
        } else {
            let in_flight = match (c.pp, c.schedule) {
                (1, _) => 1,
                (_, ScheduleKind::GPipe) => mb,
                (_, ScheduleKind::ZeroBubble) => c.pp.min(mb),
                _ => (c.pp - stage).min(mb),
            };
            let mut activations = per_mb * in_flight as f64;
            if !last {
                // Outputs sent to the next stage: a copy each until it is dropped there.
                let next_holds = match c.schedule {
                    ScheduleKind::GPipe => mb,
                    ScheduleKind::ZeroBubble => c.pp.min(mb),
                    _ => (c.pp - stage - 1).min(mb),
                };
                activations += next_holds as f64 * boundary;
            }
            let later = (c.pp > 1 && mb > 1).then(|| {
                // A later micro-batch's backward makes a whole set of the stage's gradients
                // before adding them into the accumulated ones; it holds every micro-batch in
                // flight when more follow, one fewer in the last backwards.
                let k = if mb > in_flight { in_flight } else { in_flight - 1 };
                gradients - (in_flight - k) as f64 * per_mb
            });
            (activations, later)
        };
    if let Some(extra) = pipeline_transient {
        options.push((extra, "a later micro-batch's gradients, before their accumulation".into()));
    }
    let (mut transient, mut transient_what) =
        options.into_iter().max_by(|a, b| a.0.total_cmp(&b.0)).unwrap_or((0.0, "none".into()));
    if c.host {
        transient += HOST_GEMM_WORKSPACE as f64;
        transient_what.push_str(", plus the host GEMM workspace");
    }

    let round = |x: f64| x.round() as u64;
    let (parameters, gradients, optimizer_state, activations, transient) = (
        round(parameters),
        round(gradients),
        round(optimizer_state),
        round(activations),
        round(transient),
    );
    let peak = parameters
        .checked_add(gradients)
        .and_then(|x| x.checked_add(optimizer_state))
        .and_then(|x| x.checked_add(activations))
        .and_then(|x| x.checked_add(transient))
        .ok_or_else(|| config_err(format!("{c}: the predicted bytes overflow 64 bits")))?;
    Ok(MemoryEstimate {
        config: c.to_string(),
        stage,
        parameters,
        gradients,
        optimizer_state,
        activations,
        transient,
        transient_what,
        peak,
    })
}

/// What an interleaved 1F1B rank holds at its peak.
struct Held {
    /// The activations of the (stage, micro-batch) pairs between their forward and
    /// backward, and the boundary copies not yet dropped by their receiver.
    activations: f64,
    /// The backward's transient then: the layer's or the loss's workspace (`base`), or
    /// a whole set of the stage's gradients when it already has accumulated ones.
    transient: f64,
}

/// Walks pp rank `rank`'s actions of the interleaved 1F1B schedule and returns what it
/// holds when activations plus transient are highest. `stage_mb[j]` is what one
/// micro-batch keeps on the rank's `j`-th stage, `grads[j]` that stage's gradients,
/// `boundary` one micro-batch's activation (or input gradient) sent between stages.
///
/// A (stage, micro-batch) is held from its forward to the end of its backward. A copy
/// sent to another rank lives until the receiver's backward of that micro-batch ends
/// (for an activation) or the previous stage's backward ends (for an input gradient):
/// when that is, the schedule simulated with unit costs says (forward 1, backward 2).
/// A backward runs with `base` or, once the stage has gradients from an earlier
/// micro-batch of the step, a new set of them, whichever is larger.
fn interleaved_peak(
    c: &MemoryConfig,
    rank: usize,
    stage_mb: &[f64],
    grads: &[f64],
    boundary: f64,
    base: f64,
) -> Result<Held, MemoryError> {
    let sched =
        Schedule::build(ScheduleKind::Interleaved1F1B, c.pp, c.stages_per_rank, c.microbatches)
            .map_err(|e| config_err(e.to_string()))?;
    let timeline = sched.simulate(&Costs::unit()).map_err(|e| config_err(e.to_string()))?;
    let num_stages = sched.num_stages();
    // When each backward ends, by (stage, micro-batch), over every rank.
    let mut backward_end: HashMap<(usize, usize), f64> = HashMap::new();
    for span in timeline.ranks.iter().flatten() {
        if span.action.phase != Phase::F {
            backward_end.insert((span.action.stage, span.action.microbatch), span.end);
        }
    }
    let end_of = |s: usize, m: usize| backward_end.get(&(s, m)).copied().unwrap_or(f64::INFINITY);
    let spans = timeline.ranks.get(rank).cloned().unwrap_or_default();
    let j_of = |s: usize| s / c.pp;
    // Forward ends of this rank's (stage, micro-batch) pairs, and its backward ends.
    let mut forward_end: HashMap<(usize, usize), f64> = HashMap::new();
    let mut held = 0.0;
    let mut has_grads = vec![false; stage_mb.len()];
    let mut best = Held { activations: 0.0, transient: 0.0 };
    // Boundary copies this rank sent that are still alive at time `now`.
    let copies = |now: f64, forward_end: &HashMap<(usize, usize), f64>| -> f64 {
        let mut n = 0usize;
        for (&(s, m), &f) in forward_end {
            if s + 1 < num_stages && f <= now && now < end_of(s + 1, m) {
                n += 1;
            }
            let own = end_of(s, m);
            if s > 0 && own <= now && now < end_of(s - 1, m) {
                n += 1;
            }
        }
        n as f64 * boundary
    };
    for span in &spans {
        let (s, m) = (span.action.stage, span.action.microbatch);
        let j = j_of(s);
        match span.action.phase {
            Phase::F => {
                held += stage_mb[j];
                forward_end.insert((s, m), span.end);
                let acts = held + copies(span.end, &forward_end);
                if acts > best.activations + best.transient {
                    best = Held { activations: acts, transient: 0.0 };
                }
            }
            _ => {
                let transient = if has_grads[j] { base.max(grads[j]) } else { base };
                let acts = held + copies(span.start, &forward_end);
                if acts + transient > best.activations + best.transient {
                    best = Held { activations: acts, transient };
                }
                held -= stage_mb[j];
                has_grads[j] = true;
            }
        }
    }
    Ok(best)
}

fn validate(c: &MemoryConfig, stage: usize) -> Result<(), MemoryError> {
    c.model.validate().map_err(|e| config_err(e.to_string()))?;
    for (name, v) in [
        ("dp", c.dp),
        ("tp", c.tp),
        ("cp", c.cp),
        ("pp", c.pp),
        ("batch", c.batch),
        ("seq", c.seq),
        ("microbatches", c.microbatches),
    ] {
        if v == 0 {
            return Err(config_err(format!("{name} is 0; it must be at least 1")));
        }
    }
    if c.dp > 1 && c.data_parallel == DataParallelMode::None {
        return Err(config_err(format!(
            "dp {} needs a data-parallel mode (DDP, ZeRO-1 or FSDP)",
            c.dp
        )));
    }
    if c.stages_per_rank == 0 {
        return Err(config_err("stages_per_rank is 0; it must be at least 1"));
    }
    if c.pp > 1 && c.stages_per_rank > 1 && c.schedule != ScheduleKind::Interleaved1F1B {
        return Err(config_err(format!(
            "{c}: the {} schedule runs one stage per rank, not {}",
            c.schedule, c.stages_per_rank
        )));
    }
    if stage >= c.pp {
        return Err(config_err(format!("stage {stage} out of range for pp {}", c.pp)));
    }
    if c.pp > 1 && !c.batch.is_multiple_of(c.microbatches) {
        return Err(config_err(format!(
            "batch {} is not a multiple of {} micro-batches",
            c.batch, c.microbatches
        )));
    }
    if c.seq > c.model.max_position_embeddings {
        return Err(config_err(format!(
            "seq {} exceeds max_position_embeddings {}",
            c.seq, c.model.max_position_embeddings
        )));
    }
    Ok(())
}
