//! Per-rank peak memory of a Llama training step, predicted before anything is
//! allocated: [`predict_memory`] takes the model, the mesh degrees, the data-parallel
//! mode, the tensor-parallel plan, the batch, the sequence, the pipeline schedule and
//! the activation-checkpointing policy, and returns a [`MemoryEstimate`] per rank
//! (parameters, gradients, optimizer state, activations, the largest transient and the
//! peak). [`MemoryEstimate::fits`] answers "does it fit in N bytes" with a typed error
//! that names the configuration and every number when it does not; [`check_fits`] also
//! names what would fit on the same ranks with the same global batch ([`alternatives`]:
//! stronger checkpointing, a data-parallel mode that shards more, another mesh split,
//! more micro-batches, the Megatron plan, the ring). [`least_recompute`] picks the
//! activation-checkpointing policy that fits a budget with the least recompute.
//!
//! # What the model counts
//!
//! The figures follow what this implementation keeps, not a generic formula. Below `b`
//! is the rows a rank computes at once (its batch, or a micro-batch under a pipeline),
//! `s` the sequence, `h` the hidden size, `q = heads * head_dim`, `kv = kv_heads *
//! head_dim`, `i` the MLP width, `v` the vocabulary and `t` the tensor-parallel degree;
//! `[x]` is `b * s * x` elements in the compute dtype. A size that does not divide
//! evenly by its degree is counted at its average share. Attention computes on `a_q`
//! and `a_kv` per token: under the megatron plan the projections' local heads as they
//! are (`q/t` and `kv/t`; without tp `q` and `kv`), under the sequence-parallel plan q,
//! k and v gathered back to every head on each rank (`Replicate`: `q` and `kv`).
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
//!   the RMSNorm inputs `[h]` twice (divided by `t` under tp: both plans run the norms
//!   on sequence shards), the normed inputs the q/k/v and gate/up projections save `[h]`
//!   twice (gathered to the whole sequence under tp), q `[a_q]`, k and v `[2 a_kv]`
//!   (after RoPE for q and k, saved by attention), attention's output `[a_q]` and the
//!   `[b, s, q]` copy that `o_proj` saves `[q/t]` (under the sequence-parallel plan its
//!   local slice of the whole copy, which is freed), and the gate, up and SwiGLU outputs
//!   `[3 i/t]`; the row statistics (RMSNorm's and attention's log-sum-exps, of
//!   `a_q / head_dim` heads) are a few values per row. Residual sums and RoPE keep
//!   nothing (an add's backward reads no operand; RoPE keeps only its tables). Then the
//!   final norm's input `[h/t]`, the head's input `[h]` and the logits `[v/t]`,
//!   which the loss keeps. A backward pass frees a node's saved tensors once it has run
//!   the node (as PyTorch does): the head's and the final norm's inputs go before the
//!   layers' backward, each layer's activations during its own (the logits stay: a
//!   trainer holds them through the optimizer step).
//!   Under mixed precision (FSDP's `param_dtype` other than the parameters' dtype) each
//!   layer's attention casts the RoPE tables to the compute dtype and its backward keeps
//!   the copy: `2 (s / cp) head_dim` elements per layer, whatever `b`.
//! - **Full checkpointing** keeps a checkpointed layer's input `[h/t]` only; during its
//!   backward the recomputed layer's activations exist once.
//!   **Selective** keeps the layer input and the outputs of the kept ops (by default
//!   attention and every second matmul: q, v and gate; down's, the 7th, is never kept,
//!   since only the residual add reads it and no recompute computes it again): of the
//!   matmuls (`[q + 2 kv]/t` for q/k/v, `[h]` for o_proj, `[2 i/t]` for gate and up,
//!   gathered or partial outputs at their local size) and attention (`[a_q]`).
//!   Its recompute, during the layer's backward, holds once what the layer without
//!   checkpointing keeps (its recomputed output standing for the input, which the
//!   checkpoint shares) less what it is handed back from the kept outputs instead of
//!   computing: attention's output `[a_q]` and, when their matmuls are kept, gate's and
//!   up's `[i/t]` each. The kept q and v outputs are not what the backward saves
//!   (RoPE and the transpose write new q and v), so the
//!   recompute makes its own beside them: by default `[2 r + 2 h + a_q + q/t + 2 a_kv +
//!   2 i/t]` with the row statistics, `r` the residual stream (`h/t` under tp, else `h`).
//!   **Mixed** (`selective+full:K`) counts each layer as the policy sets it
//!   (`AcPolicy::keeps`): full on every K-th, selective on the others.
//! - **Fused projections** (`MemoryConfig::fusion`, `LlamaFusion::projections`; at `tp
//!   == 1`, where the plan lets them run) keep what the separate projections keep
//!   without checkpointing: `Tensor::linear_many` writes q, k and v (and gate and up)
//!   as copies split from one wide output, which is freed when the split returns, and
//!   each piece's backward is its own projection's. Under selective checkpointing a
//!   layer then has 4 matmuls (q/k/v, o, gate/up, down) instead of 7, so every second
//!   one keeps the wide q/k/v output `[q + 2 kv]` and gate/up's `[2 i]` (where the
//!   separate ones keep q, v and gate), and the recompute makes gate and up again
//!   as the split's copies (`[i]` more); on a CUDA device gate and up are not split
//!   (`Tensor::swiglu` keeps the wide output), so a kept gate/up output is handed back.
//!   The fused residual (`LlamaFusion::residual`)
//!   changes no term on the host (it is the product then the add); on a CUDA device a
//!   selective checkpoint that keeps o_proj's GEMM keeps the residual sum the recompute
//!   then reuses (`[h]` less).
//!   Not counted: the concatenated weights and the wide output during a fused
//!   projection's forward (a layer's parameters and one layer's q/k/v or gate/up, freed
//!   before the next op, below the backward's peak).
//! - **Largest transient**: the biggest of (a) a layer's backward workspace at one of two
//!   points, plus, where that layer is checkpointed, its recompute (the backward walks
//!   the layers from the last down, so under `every` > 1 a recompute comes after the
//!   later layers' activations are freed): SwiGLU's backward, which
//!   holds the gradients of gate and up beside its output's and the hidden-state
//!   gradient, `[2 i/t + h]` beyond what the layer keeps once down_proj's node has freed
//!   its input (down_proj's weight gradient made); and attention's backward (below; the
//!   two do not overlap), by which the MLP's and o_proj's nodes have run and freed what
//!   they saved, `[r + h + 3 i/t]` and o_proj's input (a recompute frees `[r + h + i/t]`
//!   and that input of what it made; kept gate and up outputs stay with the checkpoint),
//!   and made the MLP's, o_proj's and the second norm's weight gradients; (b) the head's
//!   backward: the logits' gradient `[v/t]` and the head input's `[h]` (the logits
//!   themselves are counted as activations), under FSDP with the root's gathered
//!   parameters (next item); DDP adds its gradient buckets of one layer.
//!   To these the host adds the GEMM kernels' packing buffers, kept by each thread of
//!   the rank's kernel pool ([`HOST_GEMM_WORKSPACE`] each, [`MemoryConfig::host_threads`]).
//!   In half precision a host product widens its second operand to f32 whole and its
//!   first a block of rows at a time: the head's weight gradient widens the head input
//!   (`[h]` in f32 beside the logits' gradient), and a third point of a layer's backward,
//!   down_proj's weight gradient, holds the hidden-state gradient `[h]`, the SwiGLU
//!   output's `[i/t]`, and f32 copies of the SwiGLU output and of the hidden-state
//!   gradient (`[i/t + h]`; on the trainers' bf16 step the largest).
//! - **FSDP** (`fully_shard` per decoder layer, the base model and the root, as the
//!   trainers apply it; `tpar_fsdp`'s unit docs): the root unit's own parameters, the
//!   head `[v/t, h]` (under a pipeline the stage root's embedding, final norm and head),
//!   stay gathered in the compute dtype from its forward to its backward
//!   ([`MemoryEstimate::root_gathered`]: the forward leaves them beside the activations,
//!   and the loss's backward holds them). Its unit reduce-scatters the head's gradient
//!   and releases them before the layers' backward. A layer's backward does not take
//!   the larger of its workspace and FSDP's buffers: both are alive. Beside the
//!   workspace it holds the layer's gathered parameters, the next layer's prefetched
//!   ones (over more than one FSDP rank; over one a gather is a local copy made when
//!   needed), the base model's embedding and final norm, gathered from the first
//!   layer's backward to the embedding's (the backward's last; under a pipeline the
//!   stage root's when it holds the embedding), and the layer's unsharded gradients
//!   made by then in the compute dtype (the MLP's weights' at the MLP's backward, with
//!   o_proj's and the second norm's at attention's): its unit reduce-scatters them once
//!   all are made and releases its parameters. The gradient shards then are only those
//!   already reduced (a reduce-scatter's output until the backward's end, then the
//!   shards' `.grad()`): the head's and those of the layers whose backward ended. Over
//!   more than one FSDP rank a reduce-scatter runs beside the next layer's backward and
//!   holds its input (the layer's unsharded gradients, flat) until it completes, so
//!   every layer's backward but the first to run holds one more layer's gradients (at
//!   pp 2 x dp 2 and at 2x1 FSDP, the peaks measured about that much above a model
//!   without it). The model takes the most of the last layer's backward (the first to
//!   run, with a prefetch), the second one's (one layer's shards more, the previous
//!   layer's reduce-scatter input, and the next prefetch) and layer 0's (every other
//!   layer's shards, that input, no prefetch), within one stage's layers (FSDP
//!   prefetches within a stage); the shards not made by then are released.
//! - **Pipelines**: stage `r` of `pp` holds its layers' activations for the
//!   micro-batches in flight: all `m` under GPipe, `min(pp - r, m)` under 1F1B,
//!   `min(pp, m)` under zero-bubble. Under zero-bubble with activation checkpointing the
//!   split backward's input pass recomputes each checkpointed layer and keeps the
//!   recomputed graph's weight half until the weight pass, so stage `r > 0` also holds
//!   its layers' weight halves (taken as a fully recomputed layer's activations, whatever
//!   the policy kept) for the `min(r, m - 1)` micro-batches whose weight pass waits, and
//!   for the layers the micro-batch in its input pass has passed; a selective layer's
//!   kept outputs are freed once the input pass has recomputed it (stage 0 has
//!   no input to differentiate: its weight pass is the whole backward). Checkpointing
//!   there saves less than under 1F1B (at pp 3, one layer per stage, none on the last
//!   stage). When the weight pass recomputes instead ([`MemoryConfig::ac_weight_pass`],
//!   `WeightPass::Recompute`), a checkpointed layer holds nothing of its recomputed graph
//!   between the passes and keeps its kept outputs until the weight pass: the waiting
//!   micro-batches hold the gradient of each such layer's output (its input's shape)
//!   instead. Gradients exist from the first micro-batch's
//!   backward on, so a later micro-batch's backward holds every gradient beside the
//!   in-flight activations. An
//!   activation sent to the next stage is a copy counted on the sender until the receiver
//!   drops it (one `[h]` of a micro-batch per micro-batch the next stage holds), and the
//!   stage's own output stays beside it, the root its backward starts from: one more `[h]`
//!   per micro-batch in flight on every stage but the last (before this was counted,
//!   stage 0 of `llama_pp --pp 3 --layers 3 --seq 8192 --microbatches 6 --batch 6`
//!   measured 7 % above its prediction without checkpointing and 12 % with full, now
//!   1 % and 1.4 %). A
//!   later micro-batch's backward makes a whole set of the stage's gradients before they
//!   are added into the accumulated ones (the pass hands them to the leaves at its end,
//!   when its own activations are freed): a transient of one more set of gradients,
//!   while the micro-batches still in flight are held. Under FSDP (`fully_shard` of each
//!   layer, then of the stage, over dp) a later micro-batch's layer backward holds what
//!   the first one's holds (the units' gathered parameters, the layer's unsharded
//!   gradients, the reduce-scatter outputs of the units done, above) beside every
//!   gradient shard the earlier micro-batches accumulated, which the first one's does
//!   not have yet: the larger of that and one more set of shards counts (GPipe, 1F1B and
//!   zero-bubble). On 1F1B's last stage, whose micro-batches run one at a time, this is
//!   the peak (at pp 2 x dp 2, 2 micro-batches, a model without it is 10 % under the
//!   measured peak, with it and the reduce-scatter input above 0 to 1 %). The
//!   interleaved walk below does not add it: at pp 2 x dp 2, 2 stages of one layer per
//!   rank, 4 micro-batches, the walk (with that input) is within 4 % of each rank's
//!   measured peak, and this term (as the whole rank's layer backward) added to its
//!   later backwards would put it over.
//! - **Interleaved 1F1B** (`stages_per_rank` stages per pp rank, stage `s` on rank
//!   `s % pp`, the layers split over all `pp * stages_per_rank` stages): the rank's own
//!   action list (`tpar_pipeline::Schedule`) is walked in order. Each (stage,
//!   micro-batch) holds that stage's activations from its forward to the end of its
//!   backward; every boundary copy the rank sent (an activation to the next stage, an
//!   input gradient to the previous one) is held until its receiver's backward of that
//!   micro-batch ends, at the times of the schedule simulated with unit costs (forward 1,
//!   backward 2). A backward starts with the largest workspace above beside everything
//!   held, and ends with its stage's activations of that micro-batch freed and its
//!   gradients made (a new set beside the accumulated ones once the stage has them); the
//!   walk holds the gradients of the stages whose first backward has ended, and the peak
//!   is its highest point, with the optimizer state beside it.
//!
//! - **Attention's backward** holds the hidden-state gradient `[h]`, attention's output
//!   gradient `[a_q]` (the transpose's copy), the gradients it makes, `dq` `[a_q]`, `dk`
//!   and `dv` `[2 a_kv]`, and the kernel's scratch. On the host that is
//!   [`host_sdpa_backward_scratch`] of the rank's attention call (`b` rows, attention's
//!   query and key heads, `heads/t` and `kv_heads/t` or every head under the
//!   sequence-parallel plan, `s` queries and keys, causal), whose tasks run on
//!   the rank's [`MemoryConfig::host_threads`] at once: a row statistic per query row,
//!   and per running task its query heads' widened queries, output gradients and `dq`
//!   accumulators (`3 (heads / kv_heads) s head_dim` accumulators) with its tiles; when
//!   there are fewer than 8 (batch, kv head) groups the keys are split in runs whose
//!   `dq` partial sums are all kept until the end (up to `(runs + 1) / 2` times `dq` in
//!   the accumulator type, causal). On a CUDA device, where attention is one node (next
//!   item), it is [`device_attention_backward_bytes`] instead, beside the `[h]` and the
//!   output gradient `[a_q]` (which the node reads in place).
//!   With a small MLP (`i` near `h`) at long sequences this is the largest transient.
//!   Under context parallelism the backward runs per block (this rank's queries against
//!   each rank's keys, as [`CpLayout`] places them: the rank's own block with the causal
//!   mask, the others' whole or not at all under the load-balanced layout). With `Q` the
//!   rank's `[a_q]` and `K` its `[a_kv]`, a block holding the fractions `fq` of the
//!   rank's query rows and `fk` of the source's key rows holds, beside `[h + a_q]`: what
//!   the method keeps through the backward (`base`: the ring's `dq`, `dk`, `dv` and the
//!   copies of k and v it sent, `Q + 4 K`; all-gather's `dq`, the gathered keys and
//!   values, this hop's slices of them and the earlier hops' `dk` and `dv`,
//!   `Q + 2 cp K + 2 K + 2 hop K`), the block's gradients `fq Q + 2 fk K`, and the larger
//!   of the kernel phase (row copies of a partial block's q, out and dout, `3 fq Q`, or
//!   k and v, `2 fk K`, the kernel's scratch at the block's shape and the block's
//!   log-sum-exps in f64 and the accumulator type) and the phase that adds the block's
//!   gradients in (a new `dq`, `2 Q` while it is pieced from rows, then zero `dk` and
//!   `dv` and their sums, `Q + 4 K`, `+ K` for a partial key block); all-gather's
//!   reduce-scatter holds every hop's `dk` and `dv`, their concatenation and the sum
//!   (`Q + (5 cp + 1) K`). The cp rank and hop with the most set the term (of more than
//!   64 cp ranks, the first two, the middle one and the last two are walked).
//! - **On a CUDA device** (`MemoryConfig::host` false) without context parallelism (the
//!   tensor-parallel plans hand attention plain tensors: the local heads, or every head
//!   gathered), in f32, bf16 or f16 and a head dim of at most 256, attention is one
//!   autograd node (`Tensor::attention_bshd`, `Tensor::attention_packed_rotated` for
//!   fused projections) instead of the host's composition. It keeps the rotated q and k
//!   and its v input (the v projection's output), or the packed q/k/v output (q and k
//!   rotated), and its output
//!   `[a_q]`, which `o_proj` saves as it is: one `[q]` per layer less than the
//!   composition, which also keeps the transposed copy (under the sequence-parallel plan
//!   `o_proj` saves its local slice `[q/t]`, as on the host). Under selective
//!   checkpointing the kept attention brings the rotated q and k `[a_q + a_kv]` with it
//!   (separate projections), and its recompute is handed those, attention's output and
//!   a kept v (or q/k/v) GEMM output back instead of making them (not the v GEMM's
//!   output where the plan gathers v: the node keeps the gathered copy). Its backward
//!   holds beside the hidden-state gradient and the output gradient
//!   [`device_attention_backward_bytes`] of attention's heads: the inputs' gradients
//!   `[q + 2 kv]`, `dq` and `dk` `[q + kv]` in buffers of their own until RoPE's
//!   backward rotates them into those, and the flash backward's workspace
//!   ([`device_sdpa_backward_scratch`]: a row statistic and an f32 `dq` accumulator).
//!   Fused projections run `Tensor::linear_concat_rope` (q and k rotated by the GEMM)
//!   and `Tensor::attention_packed_rotated`: the node keeps the rotated packed output,
//!   and its backward holds only the packed gradient `[q + 2 kv]` and the workspace;
//!   then the projection's backward holds, beside the hidden-state gradient, that
//!   gradient and its rotation back, `2 [q + 2 kv]`, and the larger of the two phases
//!   counts. The host GEMM workspace is not added.
//!   Under context parallelism the composition's terms are used on the device too, with
//!   the device kernel's scratch. `tests/memory_model_device.rs` holds this (cp 2
//!   included) against the emulated CUDA device, whose `DeviceBuffer`s are counted as a
//!   GPU's are (what `max_memory_allocated` reports, without the driver's, cuBLASLt's
//!   and a caching pool's memory); no GPU has run it.
//!
//! The peak is the highest of the points a step passes: the forward's end, the head's
//! backward, and each layer's SwiGLU and attention backward from the last layer down. At
//! each the rank holds the parameters, the optimizer state (made by the previous step),
//! the activations not freed yet, the gradients made so far and that point's workspace.
//! [`MemoryEstimate`] reports the five terms whole, and what of the activations and
//! gradients is not held at the highest point ([`MemoryEstimate::released`]); the peak is
//! the five less that. With activations larger than a layer's gradients the highest
//! point is early in the backward, where few gradients exist yet (on the single-rank row
//! of `tests/memory_model.rs`, 10.9 MiB of its 12.1 MiB of gradients are not made yet,
//! and the head's inputs, 1.0 MiB, are freed).
//!
//! - **Context parallelism**: every activation holds `s / cp` positions of its rows
//!   (attention under cp saves the same local q, k, v, output and log-sum-exps as plain
//!   attention), and each forward keeps the RoPE tables cut at the rank's positions
//!   (cos and sin, `2 (s / cp) head_dim` elements in the parameters' dtype, once per
//!   stage and micro-batch); the ring adds the key and value blocks in flight
//!   (`[4 a_kv]` of the local rows, a transient); parameters are replicated over cp, or
//!   sharded over `dp x cp` under FSDP. Attention's backward is modelled per block (above); the
//!   all-gather method ([`CpMethod::AllGather`]) gathers every rank's keys and values
//!   again in attention's backward and keeps every block's `dk` and `dv` until the
//!   reduce-scatter, which is what it holds beyond the ring. Its forward's gathered keys
//!   and values (`[2 cp a_kv]`) are freed when attention returns and stay below the
//!   backward's peak.
//!
//! A selective checkpoint under a tensor-parallel plan keeps what it keeps at one rank:
//! the DTensor `linear` infers its output's shape by running the product on meta tensors
//! inside the checkpointed region, and those products are not ops to keep and take no
//! place in the policy's every-second-matmul count (they did until 2026-12-06, and a
//! layer then kept 8 outputs, 7 of them meta products, none of the real matmuls').
//!
//! What it does not model: the RoPE tables the model keeps once built (cos and sin,
//! `2 s head_dim` elements in the parameters' dtype, on the rank's device), padding
//! masks (a `[b, 1, 1, s]` mask per micro-batch, and under context parallelism every
//! rank's `[b, s / cp]` key mask gathered once per layer: small next to the
//! activations), the communication buffers of collectives in flight (other than FSDP's
//! gathered parameters, reduce-scatter outputs and the one reduce-scatter input above),
//! FSDP's reduce dtype (the shards' gradients and that input are counted in the
//! parameters' dtype), and the timing of
//! the rank threads (an interleaved rank's boundary copies follow the unit-cost
//! simulation, not the measured order).
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

use tpar_collectives::RankThreads;
use tpar_dtensor::{CpLayout, CpMethod};
use tpar_nn::checkpoint::AcPolicy;
use tpar_pipeline::{Costs, Phase, Schedule, ScheduleKind};
use tpar_tensor::checkpoint::{SaveOp, WeightPass};
use tpar_tensor::DType;

use crate::{LlamaConfig, LlamaFusion};

mod ac_auto;
mod fit;
pub use ac_auto::{ac_candidates, least_recompute, recompute_share, AcChoice};
pub use fit::{alternatives, check_fits, lowest_peak, Alternative, Change};

/// The GEMM kernels' packing buffers each thread of a rank's host kernel pool keeps
/// between calls (measured with the tracking allocator on the Llama steps of
/// `tests/memory_model.rs`: 2.1 MiB more held after a step on a pool of one thread, 4.1
/// on two).
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
         transient {transient}: {transient_what}; less {released} freed or not made yet by \
         then){hint}",
        peak = mib(estimate.peak),
        budget = mib(*budget),
        params = mib(estimate.parameters),
        grads = mib(estimate.gradients),
        optim = mib(estimate.optimizer_state),
        acts = mib(estimate.activations),
        transient = mib(estimate.transient),
        transient_what = estimate.transient_what,
        released = mib(estimate.released),
        hint = fit::hint(alternatives, lowest.as_deref())
    )]
    DoesNotFit {
        /// The configuration, in words.
        config: String,
        /// The prediction.
        estimate: Box<MemoryEstimate>,
        /// The budget in bytes.
        budget: u64,
        /// The configurations near it that would fit ([`alternatives`]; empty where the
        /// error came from [`MemoryEstimate::fits`], which has no configuration to
        /// search from).
        alternatives: Vec<Alternative>,
        /// When none would fit, the one of them with the lowest predicted peak
        /// ([`lowest_peak`]).
        lowest: Option<Box<Alternative>>,
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

/// The tensor-parallel layer plan (both run the norms and residuals on a sequence
/// shard and gather the sequence before attention and the MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpPlan {
    /// `sequence_parallel_layer_plan`: q, k and v gathered back to every head
    /// (`Replicate`), so every rank computes attention for all heads.
    SequenceParallel,
    /// `megatron_layer_plan`: q, k and v keep this rank's heads, and attention runs on
    /// them only.
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
    /// What a checkpointed layer holds between a zero-bubble schedule's input and weight
    /// passes (`PipelineSchedule::set_ac_weight_pass`).
    pub ac_weight_pass: WeightPass,
    /// Whether the ranks compute on the host (adds [`HOST_GEMM_WORKSPACE`]); `false`: on
    /// a CUDA device (module docs, "On a CUDA device").
    pub host: bool,
    /// Threads of each rank's host kernel pool, which run the attention backward's tasks
    /// at once (each with its own scratch). `None`: what the local backend gives ranks
    /// that are threads of one process by default, [`RankThreads::per_rank`] of the world
    /// `dp * tp * cp * pp` (this machine's cores split between the ranks); a process per
    /// rank sets its own pool's size.
    pub host_threads: Option<usize>,
    /// The decoder layers' optional fusions (`LlamaForPretraining::set_fusion`; none by
    /// default). They apply only where the plan allows them, which here means `tp == 1`
    /// (a tensor-parallel plan installs styles on the projections and the layers then
    /// run unfused). Fused projections change what a selective checkpoint keeps and
    /// recomputes (module docs, "Fused projections"); the fused residual changes no term
    /// on the host, and on a CUDA device what a selective checkpoint keeping its GEMM
    /// keeps and recomputes.
    pub fusion: LlamaFusion,
}

impl MemoryConfig {
    /// Whether the pipeline splits its backward into input and weight passes (a
    /// zero-bubble schedule over more than one stage), where
    /// [`MemoryConfig::ac_weight_pass`] applies.
    pub(crate) fn splits_backward(&self) -> bool {
        self.pp > 1 && self.schedule == ScheduleKind::ZeroBubble
    }

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
            ac_weight_pass: WeightPass::Keep,
            host: true,
            host_threads: None,
            fusion: LlamaFusion::default(),
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
        write!(f, ", ac {}", self.ac)?;
        let recomputing = self.ac_weight_pass == WeightPass::Recompute;
        if self.splits_backward() && self.ac != AcPolicy::None && recomputing {
            write!(f, " (recomputed again in the weight pass)")?;
        }
        if self.fusion.projections {
            write!(f, ", fused projections")?;
        }
        if self.fusion.residual {
            write!(f, ", fused residual")?;
        }
        Ok(())
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
    /// The workspace of the point where the step peaks (with the host's kernel
    /// workspace). Under FSDP, where a layer's backward is the highest, what that
    /// backward holds beyond the other terms: the units gathered then and the layer's
    /// unsharded gradients (module docs, "FSDP").
    pub transient: u64,
    /// What the largest transient is.
    pub transient_what: String,
    /// What of the activations and gradients is not held at the peak: the activations the
    /// backward has freed by then (each node's saved tensors go once it has run) and the
    /// gradients it has not made yet.
    pub released: u64,
    /// Under FSDP, the root unit's own parameters, gathered in the compute dtype, which
    /// it keeps from its forward to its backward when a backward follows (FSDP2's root,
    /// `reshard_after_forward` off): the forward leaves them beside the activations.
    /// Without a pipeline the root's own parameter is the head (`[v/t, h]`); under a
    /// pipeline the stage is the root, with its embedding, final norm and head. 0
    /// without FSDP. The loss's backward holds them (its transient counts them); a
    /// layer's backward runs after the root's unit released them.
    pub root_gathered: u64,
    /// The predicted peak: the sum of the parameters, gradients, optimizer state,
    /// activations and transient, less what is released then.
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
            alternatives: Vec::new(),
            lowest: None,
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
        )?;
        if self.released > 0 {
            write!(f, ", less {:.1} freed or not made yet by then", m(self.released))?;
        }
        Ok(())
    }
}

/// Elements per token of a decoder layer's tensors, local to a rank.
struct LayerShape {
    /// The residual stream at a norm (divided by tp under sp).
    resid: f64,
    /// A normed input gathered for the projections.
    full: f64,
    /// The q projection's output (`[q/t]`), and o_proj's input.
    q: f64,
    /// The k or v projection's output (`[kv/t]`).
    kv: f64,
    mlp: f64,
    /// The query heads attention computes on: this rank's `heads / t`, or every head
    /// where the sequence-parallel plan gathers q, k and v back (`Replicate`).
    heads: usize,
    /// The key and value heads attention computes on (as `heads`).
    kv_heads: usize,
    /// Whether attention computes on q, k and v gathered back to every head (the
    /// sequence-parallel plan), not on the projections' local outputs.
    gathered: bool,
    /// Attention's q (and output), `a_q` of the module docs: `q`, or every head's when
    /// gathered.
    attn_q: f64,
    /// Attention's k or v, `a_kv`: `kv`, or every head's when gathered.
    attn_kv: f64,
    /// Attention runs as the CUDA node of `Tensor::attention_bshd` / `attention_packed_rotated`
    /// (module docs, "On a CUDA device"), not as the host's composition.
    device_node: bool,
    /// The layer runs on a CUDA device, where fused gate and up projections stay one
    /// output that `Tensor::swiglu` keeps (not the split's copies).
    device: bool,
}

impl LayerShape {
    /// The layer of `c` computing in `compute`. The sequence-parallel plan gathers the
    /// projections' q, k and v back to every head (`Replicate`): attention computes on
    /// all of them on every rank.
    fn of(c: &MemoryConfig, compute: DType) -> LayerShape {
        let m = &c.model;
        let (h, i) = (m.hidden_size as f64, m.intermediate_size as f64);
        let hd = m.head_dim() as f64;
        let q = m.num_attention_heads as f64 * hd;
        let kvw = m.num_key_value_heads as f64 * hd;
        let t = c.tp as f64;
        let sp = c.tp > 1 && c.plan == TpPlan::SequenceParallel;
        let (heads, kv_heads) = if sp {
            (m.num_attention_heads, m.num_key_value_heads)
        } else {
            ((m.num_attention_heads / c.tp).max(1), (m.num_key_value_heads / c.tp).max(1))
        };
        let attn = if sp { 1.0 } else { t };
        LayerShape {
            // Both plans run the norms (and so the residual stream) on sequence shards.
            resid: h / t,
            full: h,
            q: q / t,
            kv: kvw / t,
            mlp: i / t,
            heads,
            kv_heads,
            gathered: sp,
            attn_q: q / attn,
            attn_kv: kvw / attn,
            device_node: device_attention_node(c, compute),
            device: !c.host,
        }
    }

    /// What a layer keeps without checkpointing.
    fn kept(&self) -> f64 {
        // x and x1 at the norms, h1 and h2 at the projections, the rotated q and k, v,
        // attention's output, what o_proj saves (the composition's `[b, s, q]` copy of
        // the output, or its local slice where attention's heads were gathered; the
        // device node's output as it is otherwise), gate, up and the SwiGLU output.
        let o_in = if self.device_node && !self.gathered { 0.0 } else { self.q };
        2.0 * self.resid
            + 2.0 * self.full
            + 2.0 * self.attn_q
            + o_in
            + 2.0 * self.attn_kv
            + 3.0 * self.mlp
    }

    /// Which of the layer's matmuls a selective checkpoint keeping `ops` keeps, with each
    /// one's output width, in the order they run: q, k, v, o, gate, up and down, or with
    /// fused projections q/k/v (one output `q + 2 kv` wide), o, gate/up (`2 i`) and down.
    /// Every second matmul (`matmul/2`, torchtitan's policy) is the 1st, 3rd, 5th, ...
    /// Down's output is never kept: only the residual add reads it before it becomes the
    /// layer's output, which no recompute reads (`tpar_tensor::checkpoint`, "Outputs no
    /// backward reads").
    fn matmuls(&self, ops: &[SaveOp], fused: bool) -> Vec<(bool, f64)> {
        let all = ops.contains(&SaveOp::Matmul);
        let every_other = !all && ops.contains(&SaveOp::EveryOtherMatmul);
        let outs = if fused {
            vec![self.q + 2.0 * self.kv, self.full, 2.0 * self.mlp, self.full]
        } else {
            vec![self.q, self.kv, self.kv, self.full, self.mlp, self.mlp, self.full]
        };
        let down = outs.len() - 1;
        let kept = |n: usize| n != down && (all || (every_other && n.is_multiple_of(2)));
        outs.into_iter().enumerate().map(|(n, e)| (kept(n), e)).collect()
    }

    /// What a selectively checkpointed layer keeps: its input and the kept ops' outputs
    /// (attention's, [`LayerShape::sdpa_kept`], when `ops` has [`SaveOp::Sdpa`]).
    fn kept_selective(&self, ops: &[SaveOp], fused: bool) -> f64 {
        let mm: f64 = self.matmuls(ops, fused).iter().filter(|m| m.0).map(|m| m.1).sum();
        self.resid + mm + self.sdpa_kept(ops, fused)
    }

    /// What a selective checkpoint keeps of attention when `ops` has [`SaveOp::Sdpa`]: its
    /// output `[q]`, and on the device node of separate projections the rotated q and k
    /// it read (a packed input is the q/k/v GEMM's output, which rotated q and k as it
    /// wrote them).
    fn sdpa_kept(&self, ops: &[SaveOp], fused: bool) -> f64 {
        match (ops.contains(&SaveOp::Sdpa), self.device_node && !fused) {
            (false, _) => 0.0,
            (true, false) => self.attn_q,
            (true, true) => 2.0 * self.attn_q + self.attn_kv,
        }
    }

    /// What the recompute of a selectively checkpointed layer holds when it ends, beside
    /// what the checkpoint kept: every tensor [`LayerShape::kept`] counts (the layer's
    /// input, shared with the checkpoint, standing for the recomputed output) except those
    /// the recompute is handed back from the kept ones instead of computing them:
    /// what [`LayerShape::sdpa_kept`] keeps, and gate's and up's outputs when their
    /// matmul is kept and unfused, or fused on a device (fused on the host, they are the
    /// split's copies of the wide output). The composition's q, k, v, o and down outputs are not what the backward
    /// saves (RoPE and the transpose write new ones), so keeping them saves nothing here;
    /// the device node saves v (or the packed q/k/v output) as it is, so a kept v (or
    /// q/k/v) GEMM output is handed back too. `residual_kept` is what a kept fused residual
    /// add hands back (the residual sum `x + o_proj(a)` that the post-attention norm
    /// reads).
    fn recomputed_selective(&self, ops: &[SaveOp], fused: bool, residual_kept: f64) -> f64 {
        let mm = self.matmuls(ops, fused);
        // Fused, the kept gate/up output is what SwiGLU saves on a device (on the host
        // the split's copies are).
        let gate_up: f64 = match (fused, self.device) {
            (false, _) => mm[4..6].iter().filter(|m| m.0).map(|m| m.1).sum(),
            (true, true) if mm[2].0 => mm[2].1,
            (true, _) => 0.0,
        };
        // The device node's saved v: the v GEMM's output, or the packed q/k/v one (not
        // where the plan gathers v: the node saves the gathered copy).
        let v = match (self.device_node && !self.gathered, fused) {
            (true, true) if mm[0].0 => mm[0].1,
            (true, false) if mm[2].0 => mm[2].1,
            _ => 0.0,
        };
        let handed = self.sdpa_kept(ops, fused) + gate_up + v + residual_kept;
        (self.kept() - handed).max(0.0)
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
    let shape = LayerShape::of(c, compute);
    let attn = if shape.gathered { 1.0 } else { t };
    let mb = if c.pp > 1 { c.microbatches } else { 1 };
    let rows = c.batch as f64 / mb as f64;
    // Each cp rank holds `seq / cp` positions of every row.
    let tokens = rows * c.seq as f64 / c.cp as f64;
    let stat = stat_bytes(compute);
    // Row statistics: two RMSNorm rstd per token and attention's log-sum-exp per head.
    let stats = (2.0 + m.num_attention_heads as f64 / attn) * stat;
    // Under mixed precision each attention call casts the RoPE tables (built in the
    // parameters' dtype) to the compute dtype, and its backward keeps the copy: cos and
    // sin, `2 (s / cp) head_dim` elements per layer.
    let rope_cast =
        if compute != m.dtype { 2.0 * (c.seq / c.cp) as f64 * hd * abytes } else { 0.0 };
    let full_layer = tokens * (shape.kept() * abytes + stats) + rope_cast;
    // The fusions apply where the plan allows them: not under a tensor-parallel plan,
    // whose styles on the projections make the layers run unfused.
    let fuse_projections = c.fusion.projections && c.tp == 1;
    let fuse_residual = c.fusion.residual && c.tp == 1;
    // What one micro-batch keeps on each of this rank's stages. The policy counts the
    // checkpointable layers of the module it is applied to: the stage's.
    let mut stage_mb = Vec::with_capacity(per_rank);
    // What each layer of the rank's first stage keeps of one micro-batch, in forward order
    // (the backward frees them from the last layer down), and what its recompute holds
    // during its backward (0 where it is not checkpointed).
    let mut layer_kept: Vec<f64> = Vec::new();
    let mut layer_again: Vec<f64> = Vec::new();
    // What a selectively checkpointed layer kept beyond its input (the kept ops' outputs),
    // which a split backward's input pass frees once it has recomputed the layer (0 for
    // the other layers).
    let mut layer_released: Vec<f64> = Vec::new();
    // What a checkpointed layer holds from a split backward's input pass to its weight
    // pass (0 for the other layers): its recomputed graph's weight half, the same graph
    // whatever the policy kept (a kept output is not what a weight's node saves), taken
    // as a fully recomputed layer's activations.
    let mut layer_deferred: Vec<f64> = Vec::new();
    for &s in &mine {
        let mut kept_mb = 0.0;
        for l in 0..ranges[s].len() {
            let input = tokens * shape.resid * abytes;
            let (kept, again) = match c.ac.keeps(l) {
                Some(ops) if ops.is_empty() => (input, full_layer),
                Some(ops) => {
                    let ops = ops.as_slice();
                    // On a CUDA device a fused residual add is one GEMM, kept as the matmul
                    // it contains: o_proj's output is the residual sum the recompute
                    // reuses (down_proj's is never kept).
                    let mm = shape.matmuls(ops, fuse_projections);
                    let o = if fuse_projections { 1 } else { 3 };
                    let residual_kept =
                        if fuse_residual && !c.host && mm[o].0 { shape.resid } else { 0.0 };
                    let kept = shape.kept_selective(ops, fuse_projections);
                    let again = shape.recomputed_selective(ops, fuse_projections, residual_kept);
                    (tokens * kept * abytes, tokens * (again * abytes + stats))
                }
                None => (full_layer, 0.0),
            };
            kept_mb += kept;
            if s == mine[0] {
                layer_kept.push(kept);
                layer_again.push(again);
                let checkpointed = again > 0.0;
                let (released, deferred) = match (checkpointed, c.ac_weight_pass) {
                    (false, _) => (0.0, 0.0),
                    (true, WeightPass::Keep) => (kept - input, full_layer),
                    // Nothing of the recomputed graph: the weight pass recomputes the layer
                    // from its input, and the engine holds the gradient of its output (the
                    // input's shape) until then.
                    (true, WeightPass::Recompute) => (0.0, input),
                };
                layer_released.push(released);
                layer_deferred.push(deferred);
            }
        }
        if s + 1 == num_stages {
            // The final norm's input, the head's input and the logits.
            kept_mb += tokens * (shape.resid + h + v / t) * abytes + tokens * stat;
        } else if !ranges[s].is_empty() {
            // The stage's output, which the schedule holds with its graph (the root its
            // backward starts from) until that backward, beside the copy it sent.
            kept_mb += tokens * shape.resid * abytes;
        }
        if c.cp > 1 && !ranges[s].is_empty() {
            // Context parallelism cuts the RoPE tables at this rank's positions for each
            // forward (cos and sin, in the parameters' dtype), which RoPE's backward keeps.
            kept_mb += 2.0 * (c.seq as f64 / c.cp as f64) * hd * pbytes;
        }
        stage_mb.push(kept_mb);
    }
    let per_mb: f64 = stage_mb.iter().sum();

    // The largest transient of a layer's or the loss's backward (what a pipeline adds is
    // weighed below).
    // FSDP's units beside the layers (module docs, "Largest transient"): the root's own
    // parameters, which it keeps gathered from its forward to its backward; those
    // gathered through every layer's backward (the base model's embedding and final
    // norm, whose unit waits for the embedding's gradient, the backward's last; under a
    // pipeline the stage root's, when it holds the embedding); and those whose gradient
    // shards are made before the layers' backward (the head's; under a pipeline a stage
    // root's without the embedding).
    let outer: f64 =
        mine.iter().map(|&s| stage_elems(s) - ranges[s].len() as f64 * layer_params).sum();
    let (root_own, held, reduced_first) = match (c.pp, mine.contains(&0)) {
        (1, _) => (v * h / t, v * h / t + h, v * h / t),
        (_, true) => (outer, outer, 0.0),
        (_, false) => (outer, 0.0, outer),
    };
    let root_gathered = if fsdp { root_own * abytes } else { 0.0 };
    // Bytes per element of the f32 copy a host half-precision product makes of its second
    // operand (below); 0 where no such copy is made.
    let widen = if c.host && abytes < 4.0 { 4.0 } else { 0.0 };

    // Each candidate for the peak: what it holds beyond the parameters, the optimizer
    // state, the activations and the gradients (`buffers`), and what of those it does not
    // hold (`released`: activations the backward freed and gradients not made yet).
    struct Candidate {
        buffers: f64,
        released: f64,
        /// What of `released` a layer's own nodes freed (the interleaved walk's base).
        own: f64,
        what: String,
    }
    let mut options: Vec<Candidate> = Vec::new();
    let interleaved = c.pp > 1 && c.schedule == ScheduleKind::Interleaved1F1B;
    // Whether the gradients of earlier micro-batches exist during a backward (a pipeline's
    // later micro-batches): then every gradient is held, and the backward's own are a
    // new set beside them.
    let accumulating = c.pp > 1 && mb > 1;
    // The backward frees each node's saved tensors once it has run (as PyTorch does):
    // the head's and the final norm's inputs first, then each layer's activations, from
    // the last layer down. `freed(k)`: what one micro-batch no longer holds once `k` of the
    // stage's layers are done. (The interleaved walk below keeps its own account and
    // reads only each candidate's `buffers` and `own`.)
    let tail = if last { tokens * (shape.resid + h) * abytes + tokens * stat } else { 0.0 };
    let freed = |k: usize| tail + layer_kept.iter().rev().take(k).sum::<f64>();
    // Gradients made before the layers' backward (the head's and the final norm's).
    let first_grads = if last { (v * h / t + h) * pbytes } else { 0.0 };
    let layer_grads = layer_params * pbytes;
    // Gradients not made yet when `k` layers are done and `made` elements of the next one
    // are (without FSDP, whose shards `fsdp_layer_backward` counts).
    let missing = |k: usize, made: f64| {
        (gradients - first_grads - k as f64 * layer_grads - made * pbytes).max(0.0)
    };
    // Under FSDP, what a layer's backward holds beside the parameters, the optimizer state
    // and the activations, gradient shards included, at its most (a pipeline's later
    // micro-batch holds it beside the accumulated shards).
    let mut fsdp_backward: Vec<(usize, f64)> = Vec::new();
    let mut first_missing = gradients - first_grads;
    if layers > 0 {
        // The MLP's backward and attention's do not overlap: the MLP's input gradients
        // are freed before attention's backward starts.
        let attn = attention_backward(c, &shape, c.batch / mb, compute)?;
        // Each point of a layer's backward where it may hold the most: its workspace, the
        // layer's weight gradients made by then, what the layer's own nodes freed by then
        // (beyond the layers done), and what the workspace is.
        //
        // SwiGLU's backward: the gradients of gate and up beside that of its output,
        // the hidden-state gradient; down_proj's node has run and freed its input (the
        // SwiGLU output), and made its weight's gradient.
        let mlp_point =
            (tokens * (2.0 * shape.mlp + h) * abytes, h * shape.mlp, false, "MLP input gradients");
        // On the host a half-precision product widens its second operand to f32 whole
        // and its first a block of rows at a time (the kernels crate's `half_matmul`):
        // down_proj's weight gradient, made beside the hidden-state gradient and the
        // SwiGLU output's, widens that output and blocks of the hidden-state gradient
        // (counted whole: one block at the trainers' widths).
        let down_point = (
            tokens * ((h + shape.mlp) * abytes + (shape.mlp + h) * widen),
            h * shape.mlp,
            false,
            "down_proj's weight gradient, its input widened to f32",
        );
        // Attention's backward: by then the MLP's and o_proj's nodes have run and freed
        // what they saved (the second norm's input, the gate/up input, gate, up and the
        // SwiGLU output, o_proj's input), where the layer keeps them (not checkpointed),
        // and made the MLP's, o_proj's and the second norm's weight gradients.
        // A checkpointed layer's recompute frees the same of what it made again: the
        // norm's input, the gate/up input, the SwiGLU output and o_proj's input (gate
        // and up may be kept outputs handed back, which the checkpoint holds).
        let o_in = if shape.device_node && !shape.gathered { 0.0 } else { shape.q };
        let kept_freed = tokens * (shape.resid + shape.full + 3.0 * shape.mlp + o_in) * abytes;
        let again_freed = tokens * (shape.resid + shape.full + shape.mlp + o_in) * abytes;
        let attention_point = (
            attn,
            3.0 * h * shape.mlp + h * shape.q + h,
            true,
            "attention's output gradient, dq, dk, dv and the kernel's scratch",
        );
        let points: Vec<_> = [mlp_point, attention_point]
            .into_iter()
            .chain((widen > 0.0).then_some(down_point))
            .collect();
        // The layer in backward once `k` of the stage's layers are done: what its recompute
        // holds (the most of any layer's past the first stage's), and what its own nodes
        // freed by the point (`at_attention`).
        let again_at = |k: usize| match layer_again.len().checked_sub(k + 1) {
            Some(i) => layer_again[i],
            None => layer_again.iter().copied().fold(0.0, f64::max),
        };
        let own_at = |again: f64, at_attention: bool| match (at_attention, again > 0.0) {
            (false, _) => 0.0,
            (true, false) => kept_freed,
            (true, true) => again_freed.min(again),
        };
        let recomputed =
            |again: f64| if again > 0.0 { " with its recomputed activations" } else { "" };
        for &(ws, made, at_attention, part) in &points {
            let what = |again: f64| format!("a layer's backward ({part}){}", recomputed(again));
            if fsdp {
                let units = fsdp_layer_backward(&FsdpBackward {
                    // The walk within one stage (FSDP prefetches within a stage's units).
                    layers: ranges[mine[0]].len().max(1),
                    unit: layer_params * abytes,
                    shard_grads: layer_params / fsdp_ranks * pbytes,
                    prefetch: fsdp_ranks > 1.0,
                    reducing: if fsdp_ranks > 1.0 { layer_params * pbytes } else { 0.0 },
                    held: held * abytes,
                    reduced_first: reduced_first / fsdp_ranks * pbytes,
                    made: made * abytes,
                });
                let what = |again: f64| {
                    format!(
                        "{}, with FSDP's gathered units (the layer's, the next one's \
                         prefetched, the embedding's) and the layer's unsharded gradients",
                        what(again)
                    )
                };
                first_missing = first_missing.min(gradients - units[0].1);
                for &(k, shards, buffers) in &units {
                    let again = again_at(k);
                    let own_freed = own_at(again, at_attention);
                    let held_then = shards + buffers + ws + again;
                    fsdp_backward.push((k, held_then - own_freed));
                    options.push(Candidate {
                        buffers: buffers + ws + again,
                        released: freed(k) + own_freed + (gradients - shards),
                        own: own_freed,
                        what: what(again),
                    });
                }
            } else {
                first_missing = first_missing.min(missing(0, made));
                for k in 0..layers {
                    let again = again_at(k);
                    let own_freed = own_at(again, at_attention);
                    options.push(Candidate {
                        buffers: ws + again,
                        released: freed(k) + own_freed + missing(k, made),
                        own: own_freed,
                        what: what(again),
                    });
                }
            }
        }
    }
    // Before any gradient of the step exists: the forward's end and the loss's backward
    // (a pipeline's later micro-batch has the earlier ones' gradients).
    let none_yet = if accumulating { 0.0 } else { gradients };
    options.push(Candidate { buffers: 0.0, released: none_yet, own: 0.0, what: "none".into() });
    if last {
        // The head's backward: the logits' gradient and the head input's (on the host in
        // half precision, with that input widened to f32 for the weight's gradient).
        let logits = tokens * ((v / t + h) * abytes + h * widen);
        let (buffers, what) = if fsdp {
            (logits + root_gathered, "the logits' gradient, with the root's gathered parameters")
        } else {
            (logits, "the logits' gradient")
        };
        options.push(Candidate { buffers, released: none_yet, own: 0.0, what: what.into() });
    }
    // A transient of the layers' backward other than the layer's own, taken at the first
    // layer's.
    let at_first_layer = if accumulating { 0.0 } else { freed(0) + first_missing };
    if c.cp > 1 && layers > 0 {
        // The ring: the key and value blocks received for the next hop while the current
        // ones are used, forward and backward (where dk and dv travel with them).
        options.push(Candidate {
            buffers: 4.0 * tokens * shape.attn_kv * abytes,
            released: at_first_layer,
            own: 0.0,
            what: "cp: key/value blocks in flight".into(),
        });
    }
    if c.data_parallel == DataParallelMode::Ddp && layers > 0 {
        options.push(Candidate {
            buffers: layer_params * pbytes,
            released: at_first_layer,
            own: 0.0,
            what: "DDP: a layer's gradient bucket".into(),
        });
    }

    // An activation sent to the next stage is a copy counted on the sender until the
    // receiver drops it after its backward; an input gradient sent back likewise.
    let boundary = tokens * shape.resid * abytes;
    let (activations, pipeline_transient) = if interleaved {
        let grads_of = |j: usize| {
            let e = stage_elems(mine[j]);
            (if fsdp { e / fsdp_ranks } else { e }) * pbytes
        };
        let grads: Vec<f64> = (0..per_rank).map(grads_of).collect();
        // The walk counts the gradients the stages hold itself: each candidate's
        // workspace alone (FSDP's gathered units and unsharded gradients included).
        let top = options.iter().max_by(|a, b| (a.buffers - a.own).total_cmp(&(b.buffers - b.own)));
        let (base, base_what) =
            top.map_or((0.0, "none".to_string()), |o| (o.buffers - o.own, o.what.clone()));
        let held = interleaved_peak(c, stage, &stage_mb, &grads, boundary, base)?;
        let what = if held.transient == base {
            base_what
        } else {
            "a later micro-batch's gradients, before their accumulation".into()
        };
        options = vec![Candidate {
            buffers: held.transient,
            released: (gradients - held.grads).max(0.0),
            own: 0.0,
            what,
        }];
        (held.activations, Vec::new())
    } else {
        let in_flight = match (c.pp, c.schedule) {
            (1, _) => 1,
            (_, ScheduleKind::GPipe) => mb,
            (_, ScheduleKind::ZeroBubble) => c.pp.min(mb),
            _ => (c.pp - stage).min(mb),
        };
        let mut activations = per_mb * in_flight as f64;
        if c.splits_backward() && stage > 0 {
            // A split backward's input pass recomputes each checkpointed layer and keeps
            // the recomputed graph's weight half until the weight pass: stage r's peak
            // comes with r micro-batches waiting for theirs (ZB-H1 defers them by the
            // stages after it), each holding its layers' weight halves beside their
            // inputs (a selective layer's kept outputs are freed once the input pass has
            // recomputed it), and the micro-batch in its input pass holds those of the
            // layers it has passed beside the recompute of the one it is in. (Stage 0 has
            // no input to differentiate: its weight pass is the whole backward.)
            let deferred: f64 = layer_deferred.iter().sum();
            let released: f64 = layer_released.iter().sum();
            // The layer in its recompute: the one whose recompute holds the most.
            let at = (0..layer_again.len())
                .max_by(|&a, &b| layer_again[a].total_cmp(&layer_again[b]))
                .unwrap_or(0);
            let passed = |v: &[f64]| v.iter().sum::<f64>() - v.get(at).copied().unwrap_or(0.0);
            let waiting = stage.min(mb.saturating_sub(1)) as f64;
            activations +=
                waiting * (deferred - released) + passed(&layer_deferred) - passed(&layer_released);
        }
        if !last {
            // Outputs sent to the next stage: a copy each until it is dropped there.
            let next_holds = match c.schedule {
                ScheduleKind::GPipe => mb,
                ScheduleKind::ZeroBubble => c.pp.min(mb),
                _ => (c.pp - stage - 1).min(mb),
            };
            activations += next_holds as f64 * boundary;
        }
        let mut later = Vec::new();
        if accumulating {
            // A later micro-batch's backward makes a whole set of the stage's gradients
            // before adding them into the accumulated ones (the pass hands them to the
            // leaves at its end, when its own activations are freed); it holds every
            // micro-batch in flight when more follow, one fewer in the last backwards.
            // Under FSDP its layers' backward holds the units' gathered parameters,
            // unsharded gradients and reduce-scatter outputs beside the accumulated
            // gradient shards.
            let k = if mb > in_flight { in_flight } else { in_flight - 1 };
            let fewer = (in_flight - k) as f64 * per_mb;
            if fsdp_backward.is_empty() || fsdp_backward.iter().all(|&(_, f)| f <= gradients) {
                later.push(Candidate {
                    buffers: gradients,
                    released: freed(layers) + fewer,
                    own: 0.0,
                    what: "a later micro-batch's gradients, before their accumulation".into(),
                });
            } else {
                for &(done, f) in &fsdp_backward {
                    later.push(Candidate {
                        buffers: f,
                        released: freed(done) + fewer,
                        own: 0.0,
                        what: "a later micro-batch's layer backward, with FSDP's gathered \
                               units, the layer's unsharded gradients and the reduce-scatter \
                               outputs beside the accumulated gradient shards"
                            .into(),
                    });
                }
            }
        }
        (activations, later)
    };
    options.extend(pipeline_transient);
    let best = options
        .into_iter()
        .max_by(|a, b| (a.buffers - a.released).total_cmp(&(b.buffers - b.released)))
        .unwrap_or(Candidate { buffers: 0.0, released: 0.0, own: 0.0, what: "none".into() });
    let (mut transient, released, mut transient_what) = (best.buffers, best.released, best.what);
    if c.host {
        // Each thread of the rank's kernel pool keeps its own packing buffers.
        let threads = kernel_threads(c);
        transient += (HOST_GEMM_WORKSPACE as usize * threads) as f64;
        transient_what.push_str(match threads {
            1 => ", plus the host GEMM workspace",
            _ => ", plus the host GEMM workspace of each kernel thread",
        });
    }

    let round = |x: f64| x.round() as u64;
    let (parameters, gradients, optimizer_state, activations, transient, root_gathered) = (
        round(parameters),
        round(gradients),
        round(optimizer_state),
        round(activations),
        round(transient),
        round(root_gathered),
    );
    let peak = parameters
        .checked_add(gradients)
        .and_then(|x| x.checked_add(optimizer_state))
        .and_then(|x| x.checked_add(activations))
        .and_then(|x| x.checked_add(transient))
        .ok_or_else(|| config_err(format!("{c}: the predicted bytes overflow 64 bits")))?;
    let released = round(released).min(peak);
    let peak = peak - released;
    Ok(MemoryEstimate {
        config: c.to_string(),
        stage,
        parameters,
        gradients,
        optimizer_state,
        activations,
        transient,
        transient_what,
        released,
        root_gathered,
        peak,
    })
}

/// What a rank holds under FSDP during its decoder layers' backward, beside the
/// parameters, the optimizer state, the activations and the layer's workspace, in bytes.
struct FsdpBackward {
    /// The rank's decoder layers (one FSDP unit each).
    layers: usize,
    /// A layer's parameters gathered, in the compute dtype.
    unit: f64,
    /// A layer's gradient shards.
    shard_grads: f64,
    /// Whether a layer's backward prefetches the next layer's parameters (over more than
    /// one FSDP rank; over one a gather is a local copy, made when needed).
    prefetch: bool,
    /// The input of a layer's reduce-scatter (its unsharded gradients, flat), which the
    /// collective holds until it completes, beside the next layer's backward (over more
    /// than one FSDP rank; over one the reduction is a cast made at once): 0 when none.
    reducing: f64,
    /// Parameters gathered through every layer's backward (the embedding's unit).
    held: f64,
    /// Gradient shards made before the layers' backward (the head's).
    reduced_first: f64,
    /// The layer's unsharded gradients made by the time of its workspace's peak, in the
    /// compute dtype (its unit reduce-scatters them once all are made).
    made: f64,
}

/// What [`FsdpBackward`] holds where it may hold the most: in the backward of the first
/// layer to run (the last layer; with the next one's prefetch), of the second (with the
/// first's gradient shards and the next prefetch), or of the last (layer 0: every other
/// layer's gradient shards, no prefetch); a layer's gradient shards are complete once its
/// backward ends (its reduce-scatter's output until the backward's end, then the
/// shards' `.grad()`). Every backward but the first to run may also hold the previous
/// layer's reduce-scatter input, the collective running beside it. Each point is the
/// layers done before it, the gradient shards then, and the rest it holds.
fn fsdp_layer_backward(f: &FsdpBackward) -> Vec<(usize, f64, f64)> {
    let at = |layer_done: usize, prefetching: bool| {
        let gathered = if prefetching { 2.0 } else { 1.0 } * f.unit;
        let reducing = if layer_done > 0 { f.reducing } else { 0.0 };
        let shards = f.reduced_first + layer_done as f64 * f.shard_grads;
        (layer_done, shards, f.held + gathered + f.made + reducing)
    };
    let mut points = vec![at(0, f.layers > 1 && f.prefetch)];
    if f.layers > 2 {
        // The layers' backwards before the last: the latest of them holds the most
        // shards (`layers - 2`), with the next layer prefetched.
        points.push(at(f.layers - 2, f.prefetch));
    }
    if f.layers > 1 {
        points.push(at(f.layers - 1, false));
    }
    points
}

/// One attention call, local to a rank, as the SDPA backward sees it (`q` `[batch,
/// q_heads, q_len, head_dim]`, `k` and `v` `[batch, kv_heads, kv_len, head_dim]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionCall {
    /// Rows of the batch.
    pub batch: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key and value heads.
    pub kv_heads: usize,
    /// Query rows.
    pub q_len: usize,
    /// Key rows.
    pub kv_len: usize,
    /// Elements per head of q, k and v.
    pub head_dim: usize,
    /// Whether the top-left causal mask applies (query `i` sees keys `j <= i`).
    pub causal: bool,
}

/// The host backward's tiles (`tpar_kernels::sdpa::SdpaTiles::backward`: 128 query rows,
/// 64 keys) and the fewest tasks it splits into (its `MIN_BACKWARD_TASKS`).
const HOST_SDPA_BWD_QUERIES: usize = 128;
const HOST_SDPA_BWD_KEYS: usize = 64;
const HOST_SDPA_BWD_MIN_TASKS: usize = 8;

/// Bytes the host SDPA backward (`tpar_kernels::sdpa::sdpa_backward`) holds beyond its
/// `dq`, `dk` and `dv` at its peak when `threads` threads run its tasks, for tensors of
/// `dtype` (the kernel accumulates in f32, f64 for f64).
///
/// The kernel splits the work over (batch, kv head) groups `G = batch * kv_heads`, each
/// with its `r = q_heads / kv_heads` query heads; when `G < 8`, each group's keys are cut
/// into `n = min(key tiles, ceil(8 / G))` runs of whole 64-key tiles, a task each. With
/// `d` the head dim, `rows` a task's query rows (those from its first key on when causal,
/// else `q_len`) and `A` the accumulator's bytes:
///
/// - `D = rowsum(dO * O)`: one accumulator per query row, `batch * q_heads * q_len * A`.
/// - A running task widens its group's scaled queries and output gradients and
///   accumulates its `dq` rows: `3 r rows d A`, plus its tiles (two 128 x 64 score tiles
///   and eight 64 x `d` key tiles): `(2 * 128 * 64 + 8 * 64 d) A`. `min(threads, tasks)`
///   run at once.
/// - With `n > 1` runs a task's `dq` rows are a partial sum kept until every task is
///   done (`sum over tasks of r rows d A`); the tasks then run with their queries and
///   output gradients at the runs' average rows, and the final sum adds one group's `dq`
///   accumulator (`r q_len d A`) per thread, whichever is larger.
pub fn host_sdpa_backward_scratch(a: &AttentionCall, dtype: DType, threads: usize) -> u64 {
    let groups = a.batch.saturating_mul(a.kv_heads);
    if groups == 0 || a.q_heads == 0 || a.q_len == 0 || a.kv_len == 0 {
        return 0;
    }
    let acc = stat_bytes(dtype);
    let d = a.head_dim as f64;
    let group = (a.q_heads / a.kv_heads).max(1) as f64;
    let dsum = a.batch as f64 * a.q_heads as f64 * a.q_len as f64;
    let key_tiles = a.kv_len.div_ceil(HOST_SDPA_BWD_KEYS);
    let want = HOST_SDPA_BWD_MIN_TASKS.div_ceil(groups).clamp(1, key_tiles);
    let run = key_tiles.div_ceil(want).saturating_mul(HOST_SDPA_BWD_KEYS);
    let chunks = a.kv_len.div_ceil(run);
    let threads = threads.max(1);
    let running = threads.min(groups.saturating_mul(chunks)) as f64;
    let rows = |c: usize| {
        if a.causal {
            a.q_len.saturating_sub(c.saturating_mul(run)) as f64
        } else {
            a.q_len as f64
        }
    };
    let tiles = (2 * HOST_SDPA_BWD_QUERIES * HOST_SDPA_BWD_KEYS) as f64
        + 8.0 * HOST_SDPA_BWD_KEYS as f64 * d;
    let elems = if chunks == 1 {
        dsum + running * (3.0 * group * rows(0) * d + tiles)
    } else {
        let all_rows: f64 = (0..chunks).map(rows).sum();
        let partials = groups as f64 * group * all_rows * d;
        let tasks = running * (2.0 * group * all_rows / chunks as f64 * d + tiles);
        let sum = threads.min(groups) as f64 * group * a.q_len as f64 * d;
        dsum + partials + tasks.max(sum)
    };
    (elems * acc).round() as u64
}

/// Bytes the CUDA SDPA backward's workspace takes for `a`: the kernels' own
/// [`tpar_kernels::cuda::raw::sdpa::sdpa_backward_workspace_bytes`] (an f32 per query
/// row, rounded up to 256 bytes, and an f32 `dq` accumulator of whole 64-query tiles
/// per head); `u64::MAX` where that size overflows.
pub fn device_sdpa_backward_scratch(a: &AttentionCall) -> u64 {
    let s = tpar_kernels::sdpa::SdpaShape {
        batch: a.batch,
        q_heads: a.q_heads,
        kv_heads: a.kv_heads,
        q_len: a.q_len,
        kv_len: a.kv_len,
        head_dim: a.head_dim,
        v_dim: a.head_dim,
        scale: 1.0,
        causal: a.causal,
    };
    tpar_kernels::cuda::raw::sdpa::sdpa_backward_workspace_bytes(&s).map_or(u64::MAX, |b| b as u64)
}

/// Whether a decoder layer's attention runs as the CUDA node of `Tensor::attention_bshd`
/// (`Tensor::attention_packed_rotated` with fused projections) rather than as its
/// composition:
/// on a CUDA device, with plain operands (the tensor-parallel plans hand attention plain
/// tensors, local or gathered; context parallelism runs its own attention), in a dtype the
/// flash kernels take (not f64) and a head dim they take.
fn device_attention_node(c: &MemoryConfig, compute: DType) -> bool {
    !c.host
        && c.cp == 1
        && compute != DType::F64
        && c.model.head_dim() <= tpar_kernels::cuda::raw::sdpa::MAX_HEAD_DIM
}

/// The operands of the CUDA attention node whose backward
/// [`device_attention_backward_bytes`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceAttentionInput {
    /// q, k and v of their own (`Tensor::attention_bshd`).
    Separate,
    /// One packed q/k/v projection output, rotated inside attention
    /// (`Tensor::attention_packed`).
    Packed,
    /// One packed q/k/v projection output whose q and k the projection rotated
    /// (`Tensor::attention_packed_rotated`, as fused projections run on a device).
    PackedRotated,
}

/// Bytes the CUDA attention node holds in its backward beyond the output gradient it is
/// given, for `a` (`q_len == kv_len`) in `dtype`: its inputs' gradients (q, k and v, or
/// the packed one); unless the input comes rotated, `dq` and `dk` in dense buffers of
/// their own that RoPE's backward then rotates into them, and for a packed input its q
/// and k rotated again (the node kept the input, not the rotated ones); and the flash
/// backward's workspace ([`device_sdpa_backward_scratch`]); `u64::MAX` where that
/// overflows.
pub fn device_attention_backward_bytes(
    a: &AttentionCall,
    dtype: DType,
    input: DeviceAttentionInput,
) -> u64 {
    // q's gradient, dq and the rotated q; k's and v's gradients, dk and the rotated k;
    // as many of each as the node holds
    let (nq, nkv) = match input {
        DeviceAttentionInput::Separate => (2, 3),
        DeviceAttentionInput::Packed => (3, 4),
        DeviceAttentionInput::PackedRotated => (1, 2),
    };
    let q = a.batch.checked_mul(a.q_len).and_then(|n| n.checked_mul(nq * a.q_heads));
    let kv = a.batch.checked_mul(a.kv_len).and_then(|n| n.checked_mul(nkv * a.kv_heads));
    let elems = q.zip(kv).and_then(|(q, kv)| q.checked_add(kv)?.checked_mul(a.head_dim));
    let bytes = elems.and_then(|e| e.checked_mul(dtype.size_in_bytes()));
    bytes.map_or(u64::MAX, |b| (b as u64).saturating_add(device_sdpa_backward_scratch(a)))
}

/// Threads of each rank's host kernel pool: [`MemoryConfig::host_threads`], or what the
/// local backend gives ranks that are threads of one process.
fn kernel_threads(c: &MemoryConfig) -> usize {
    let world = c.dp.saturating_mul(c.tp).saturating_mul(c.cp).saturating_mul(c.pp);
    c.host_threads.unwrap_or(match RankThreads::per_rank(world) {
        RankThreads::PerRank(n) => n,
        RankThreads::Shared => 1,
    })
}

/// The largest transient of one decoder layer's attention backward, in bytes (the
/// module docs, "Attention's backward"); `rows` the batch rows a rank computes at once.
fn attention_backward(
    c: &MemoryConfig,
    shape: &LayerShape,
    rows: usize,
    compute: DType,
) -> Result<f64, MemoryError> {
    let m = &c.model;
    let abytes = compute.size_in_bytes() as f64;
    let acc = stat_bytes(compute);
    let (q_heads, kv_heads) = (shape.heads, shape.kv_heads);
    let threads = kernel_threads(c);
    let call = |q_len: usize, kv_len: usize, causal: bool| AttentionCall {
        batch: rows,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim: m.head_dim(),
        causal,
    };
    let scratch = |a: &AttentionCall| -> f64 {
        if c.host {
            host_sdpa_backward_scratch(a, compute, threads) as f64
        } else {
            device_sdpa_backward_scratch(a) as f64
        }
    };
    // Beside every form below: the hidden state's gradient and attention's output
    // gradient (`[b, hq, s, hd]`, the transpose's copy).
    let per_token = |tokens: f64| tokens * (shape.full + shape.attn_q) * abytes;
    if c.cp == 1 {
        let tokens = rows as f64 * c.seq as f64;
        if shape.device_node {
            let a = call(c.seq, c.seq, true);
            // The device node takes fused projections packed, q and k rotated by the
            // projection (where the plan lets them run: without a tensor-parallel plan),
            // whose backward then rotates the packed gradient back into a new buffer
            // beside it (attention's output gradient freed by then).
            if c.fusion.projections && c.tp == 1 {
                let input = DeviceAttentionInput::PackedRotated;
                let node =
                    per_token(tokens) + device_attention_backward_bytes(&a, compute, input) as f64;
                let packed = tokens * (shape.attn_q + 2.0 * shape.attn_kv) * abytes;
                return Ok(node.max(tokens * shape.full * abytes + 2.0 * packed));
            }
            let input = DeviceAttentionInput::Separate;
            return Ok(
                per_token(tokens) + device_attention_backward_bytes(&a, compute, input) as f64
            );
        }
        let outputs = tokens * (shape.attn_q + 2.0 * shape.attn_kv) * abytes;
        return Ok(per_token(tokens) + outputs + scratch(&call(c.seq, c.seq, true)));
    }
    let layout = CpLayout::new(c.seq, c.cp).map_err(|e| config_err(e.to_string()))?;
    let mut worst = 0.0f64;
    // Every cp rank up to 64 of them; beyond, the first two, the middle and the last two
    // (each walks `cp` hops).
    let ranks: Vec<usize> =
        if c.cp <= 64 { (0..c.cp).collect() } else { vec![0, 1, c.cp / 2, c.cp - 2, c.cp - 1] };
    for me in ranks {
        let local = layout.local_len(me);
        let tokens = rows as f64 * local as f64;
        // This rank's q (and dq) and k or v (and dk or dv), whole.
        let (big_q, big_k) = (tokens * shape.attn_q * abytes, tokens * shape.attn_kv * abytes);
        let mut peak = 0.0f64;
        for hop in 0..c.cp {
            let src = (me + c.cp - hop) % c.cp;
            let blk = cp_block(&layout, me, src);
            // The dq accumulator and what the method holds through the backward: the
            // ring's dk and dv and the copies of k and v it sent; all-gather's gathered
            // k and v, this hop's slices of them and the earlier hops' dk and dv.
            let base = match c.cp_method {
                CpMethod::Ring => big_q + 4.0 * big_k,
                CpMethod::AllGather => {
                    big_q + 2.0 * c.cp as f64 * big_k + 2.0 * big_k + 2.0 * hop as f64 * big_k
                }
            };
            if blk.kind == BlockKind::Empty {
                peak = peak.max(base + 2.0 * big_k);
                continue;
            }
            let qf = blk.q_rows as f64 / local.max(1) as f64;
            let kf = blk.k_rows as f64 / layout.local_len(src).max(1) as f64;
            // The block's dq, dk and dv.
            let grads = qf * big_q + 2.0 * kf * big_k;
            // Row copies of a partial block's q, out and dout, or of its k and v.
            let copies = if qf < 1.0 { 3.0 * qf * big_q } else { 0.0 }
                + if kf < 1.0 { 2.0 * kf * big_k } else { 0.0 };
            let a = call(blk.q_rows, blk.k_rows, blk.kind == BlockKind::Diagonal);
            // The merged log-sum-exps of the block's rows, in f64 and in the kernel's type.
            let lse = rows as f64 * q_heads as f64 * blk.q_rows as f64 * (8.0 + acc);
            let mask = if blk.kind == BlockKind::Explicit {
                blk.q_rows as f64 * blk.k_rows as f64 * (8.0 + abytes)
            } else {
                0.0
            };
            let kernel = base + copies + grads + scratch(&a) + lse + mask;
            // Adding the block's gradients in: a new dq (built from row pieces when the
            // block has part of the rows), then zero dk and dv and their sums.
            let dq_new = if qf < 1.0 { 2.0 * big_q } else { big_q };
            let dkv_new = big_q + 4.0 * big_k + if kf < 1.0 { big_k } else { 0.0 };
            let add = base + grads + dq_new.max(dkv_new);
            peak = peak.max(kernel).max(add);
        }
        if c.cp_method == CpMethod::AllGather {
            // The reduce-scatter: every hop's dk and dv, their concatenation and this
            // rank's sum.
            let n = c.cp as f64;
            peak = peak.max(big_q + 4.0 * n * big_k + (n + 1.0) * big_k);
        }
        worst = worst.max(per_token(tokens) + peak);
    }
    Ok(worst)
}

/// How a context-parallel block is masked (`tpar_tensor`'s `BlockMask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    /// Every key at or before every query.
    Full,
    /// The rank's own rows: the top-left causal mask.
    Diagonal,
    /// No key visible.
    Empty,
    /// Any other pattern: an explicit `[q_rows, k_rows]` mask.
    Explicit,
}

/// The query and key rows of the block of `me`'s queries against `src`'s keys that
/// context-parallel attention computes (`tpar_dtensor::context_parallel`): key chunks
/// after every query are dropped, then query chunks before every kept key.
struct CpBlock {
    q_rows: usize,
    k_rows: usize,
    kind: BlockKind,
}

fn cp_block(layout: &CpLayout, me: usize, src: usize) -> CpBlock {
    let (qr, kr) = (layout.ranges(me), layout.ranges(src));
    let nonempty = |r: &[(usize, usize)]| -> Vec<(usize, usize)> {
        r.iter().copied().filter(|&(_, l)| l > 0).collect()
    };
    let q_max = nonempty(&qr).iter().map(|&(s, l)| s + l - 1).max();
    let keys: Vec<(usize, usize)> =
        nonempty(&kr).into_iter().filter(|&(s, _)| q_max.is_some_and(|m| s <= m)).collect();
    let k_min = keys.iter().map(|r| r.0).min();
    let queries: Vec<(usize, usize)> =
        nonempty(&qr).into_iter().filter(|&(s, l)| k_min.is_some_and(|m| s + l > m)).collect();
    let (q_rows, k_rows) =
        (queries.iter().map(|r| r.1).sum::<usize>(), keys.iter().map(|r| r.1).sum::<usize>());
    let q_min = queries.iter().map(|r| r.0).min();
    let k_max = keys.iter().map(|&(s, l)| s + l - 1).max();
    let kind = match (q_min, k_max) {
        _ if q_rows == 0 || k_rows == 0 => BlockKind::Empty,
        _ if me == src => BlockKind::Diagonal,
        (Some(q0), Some(k1)) if k1 <= q0 => BlockKind::Full,
        _ => BlockKind::Explicit,
    };
    CpBlock { q_rows, k_rows, kind }
}

/// What an interleaved 1F1B rank holds at its peak.
struct Held {
    /// The activations of the (stage, micro-batch) pairs between their forward and
    /// backward, and the boundary copies not yet dropped by their receiver.
    activations: f64,
    /// The backward's transient then: the layer's or the loss's workspace (`base`), or
    /// a whole set of the stage's gradients when it already has accumulated ones.
    transient: f64,
    /// The gradients the rank's stages hold then (those whose first backward of the step
    /// has ended).
    grads: f64,
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
/// A backward starts with `base` beside everything held; a stage has its gradients once
/// its first backward of the step has ended, and a later backward ends with a new set of
/// them beside the accumulated ones, its own activations freed.
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
    let mut best = Held { activations: 0.0, transient: 0.0, grads: 0.0 };
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
    let total = |h: &Held| h.activations + h.transient + h.grads;
    for span in &spans {
        let (s, m) = (span.action.stage, span.action.microbatch);
        let j = j_of(s);
        let grads_held: f64 = (0..grads.len()).filter(|&k| has_grads[k]).map(|k| grads[k]).sum();
        let mut consider = |h: Held| {
            if total(&h) > total(&best) {
                best = h;
            }
        };
        match span.action.phase {
            Phase::F => {
                held += stage_mb[j];
                forward_end.insert((s, m), span.end);
                let acts = held + copies(span.end, &forward_end);
                consider(Held { activations: acts, transient: 0.0, grads: grads_held });
            }
            _ => {
                let acts = held + copies(span.start, &forward_end);
                consider(Held { activations: acts, transient: base, grads: grads_held });
                // The end of the backward: its activations freed, its gradients made (a new
                // set beside the accumulated ones, before they are added).
                let acts_end = acts - stage_mb[j];
                let transient = if has_grads[j] { grads[j] } else { 0.0 };
                let grads_end = if has_grads[j] { grads_held } else { grads_held + grads[j] };
                consider(Held { activations: acts_end, transient, grads: grads_end });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_sdpa_scratch_counts_whole_query_tiles() {
        let call = |q_len| AttentionCall {
            batch: 2,
            q_heads: 4,
            kv_heads: 2,
            q_len,
            kv_len: q_len,
            head_dim: 64,
            causal: true,
        };
        // the scratch less its f32 per query row (256-byte aligned): the dq accumulator,
        // in whole 64-query tiles per (batch, head)
        let acc = |q: usize| {
            device_sdpa_backward_scratch(&call(q)) - (2 * 4 * q * 4).next_multiple_of(256) as u64
        };
        assert_eq!(acc(128), 2 * 4 * 128 * 64 * 4);
        assert_eq!(acc(65), acc(128));
        assert!(acc(64) < acc(65));
    }
}
