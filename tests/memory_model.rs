//! The memory model against the tracking allocator: for one Llama (hidden 256, 4
//! layers, seq 256, f32, AdamW) trained two steps as the trainers do (the loss held
//! through the optimizer step), the predicted per-rank peak is within 15 % of the
//! measured one at one rank, 2x2 FSDP x TP and tp 2 alone, without checkpointing and
//! under full checkpointing (sequence-parallel plan, which gathers q, k and v back to
//! every head), pp 2 with 1F1B, alone and with FSDP over dp 2 per stage, and interleaved
//! 1F1B (2 stages per rank, 4 micro-batches) with FSDP over dp 2 (each FSDP rank's lower
//! peak of two runs, within 8 %: a rank's peak moves by about a layer's gradient shard
//! with the dp ranks' relative timing, and by a MiB from machine to machine), cp 2,
//! cp 2 x tp 2 (ring attention, Megatron plan), cp 2 with the all-gather method (alone
//! and under full activation checkpointing), full and selective activation
//! checkpointing, with fused projections or the fused residual at one rank, both under
//! 2x1 FSDP, and both asked for at 2x2 FSDP x TP (where the plan runs the layers
//! unfused), and at four configurations whose largest transient is attention's backward
//! (a sequence of 1024, hidden 128, an MLP of 128: 2 heads, 8 heads over 2 kv heads,
//! cp 2 over the ring, and 2 heads under selective checkpointing, whose recompute holds
//! the layer again beside what the checkpoint kept), where the backward's rise over the
//! forward's end is held to the model's too (the gradients and workspace of its highest
//! point, less what the backward freed by then); a predictor that
//! forgets the optimizer state or the activations misses by more in at least one of
//! them. Where nothing else stays from the forward (one rank, or tp alone, without cp),
//! what the second step's forward leaves allocated is the predicted activations within
//! 2 %. The host attention backward's gradients and scratch are checked against the
//! allocator alone. Three more pairs of configurations, sized so that what the change
//! adds is a large share of the peak, hold the differences too: interleaved 1F1B (pp 2,
//! 2 stages per rank, 4 micro-batches) against 1F1B on the same batch, all-gather
//! against ring context parallelism at a long sequence, and fused against separate
//! projections under selective checkpointing (and, without measuring, the fusions move
//! the prediction only where they run). Alone in its test binary, the measuring
//! tests one at a time (a lock): the allocator counts per rank slot, so rank threads of
//! another test running at the same time would be counted too.

use std::sync::Mutex;
use std::time::Duration;

use tpar::collectives::RankThreads;
use tpar::dtensor::CpMethod;
use tpar::models::memory::{
    ac_candidates, alternatives, check_fits, host_sdpa_backward_scratch, least_recompute,
    lowest_peak, predict_memory, predict_memory_stage, recompute_share, Alternative, AttentionCall,
    Change, DataParallelMode, MemoryConfig, MemoryError, MemoryEstimate, TpPlan,
    HOST_GEMM_WORKSPACE,
};
use tpar::models::LlamaFusion;
use tpar::nn::checkpoint::SaveOp;
use tpar::prelude::*;
use tpar::tensor::checkpoint::WeightPass;
use tpar::tensor::memory;

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

/// Held by each measuring test: rank threads of two tests at once share rank slots.
static SERIAL: Mutex<()> = Mutex::new(());

const BATCH: usize = 2;
const SEQ: usize = 256;

/// q, k and v (and gate and up) computed by one GEMM each.
const FUSED_PROJECTIONS: LlamaFusion = LlamaFusion { projections: true, residual: false };

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 512,
        max_position_embeddings: SEQ,
        hidden_size: 256,
        intermediate_size: 688,
        num_hidden_layers: 4,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        dtype: DType::F32,
        ..Default::default()
    }
}

/// Token ids `[rows, SEQ]` and next-token targets, from a fixed pattern.
fn batch(rows: usize, vocab: usize) -> (Tensor, Tensor) {
    batch_of(rows, SEQ, vocab)
}

/// Token ids `[rows, seq]` and next-token targets, from a fixed pattern.
fn batch_of(rows: usize, seq: usize, vocab: usize) -> (Tensor, Tensor) {
    let n = rows * seq;
    let ids: Vec<i64> = (0..n).map(|i| ((i * 7 + i / seq * 3) % vocab) as i64).collect();
    let tgt: Vec<i64> = (0..n).map(|i| ((i * 5 + 1) % vocab) as i64).collect();
    (Tensor::from_vec(ids, [rows, seq]).unwrap(), Tensor::from_vec(tgt, [rows, seq]).unwrap())
}

/// One measured run: the model, `rows` sequences of `seq` tokens per dp rank (the whole
/// batch under cp), the mesh and what the layers do. With `cp > 1` the ranks form a
/// cp x tp mesh (context-parallel attention by `method`; the Megatron plan when
/// `tp > 1`, whose loss is vocab-sharded and scaled by the rank's token share),
/// otherwise a dp x tp one (the sequence-parallel plan when `tp > 1`, `fully_shard` per
/// layer when `dp > 1`).
#[derive(Clone)]
struct Run {
    cfg: LlamaConfig,
    rows: usize,
    seq: usize,
    dp: usize,
    tp: usize,
    cp: usize,
    method: CpMethod,
    ac: AcPolicy,
    fusion: LlamaFusion,
    /// Threads of each rank's kernel pool (`None`: `RankThreads::per_rank` of the world,
    /// as the memory model assumes).
    threads: Option<usize>,
}

impl Run {
    /// One rank, no checkpointing, no fusion: `rows` sequences of `seq` tokens of `cfg`.
    fn new(cfg: LlamaConfig, rows: usize, seq: usize) -> Run {
        Run {
            cfg,
            rows,
            seq,
            dp: 1,
            tp: 1,
            cp: 1,
            method: CpMethod::Ring,
            ac: AcPolicy::None,
            fusion: LlamaFusion::default(),
            threads: None,
        }
    }

    /// [`Run::new`] of [`config`], [`BATCH`] sequences of [`SEQ`] tokens.
    fn base() -> Run {
        Run::new(config(), BATCH, SEQ)
    }

    /// What the memory model is given for this run.
    fn memory_config(&self) -> MemoryConfig {
        MemoryConfig {
            dp: self.dp,
            tp: self.tp,
            cp: self.cp,
            cp_method: self.method,
            data_parallel: if self.dp > 1 {
                DataParallelMode::Fsdp { param_dtype: None }
            } else {
                DataParallelMode::None
            },
            plan: if self.cp > 1 { TpPlan::Megatron } else { TpPlan::SequenceParallel },
            ac: self.ac.clone(),
            fusion: self.fusion,
            host_threads: self.threads,
            ..MemoryConfig::new(self.cfg, self.rows, self.seq)
        }
    }

    /// The predicted memory of each rank, in rank order.
    fn predict(&self) -> Vec<MemoryEstimate> {
        let c = self.memory_config();
        (0..self.dp * self.tp * self.cp).map(|_| predict_memory_stage(&c, 0).unwrap()).collect()
    }

    /// Each rank's peak over building the model and two training steps, above what the
    /// rank held before it started.
    fn peaks(&self) -> Vec<i64> {
        self.measure().iter().map(|m| m.peak).collect()
    }

    /// What each rank allocated over building the model and two training steps.
    fn measure(&self) -> Vec<Measured> {
        let world = self.dp * self.tp * self.cp;
        let threads = self.threads.map_or(RankThreads::per_rank(world), RankThreads::PerRank);
        spawn_scoped(
            SpawnConfig::new(world).timeout(Duration::from_secs(120)).threads(threads),
            |ctx| if self.cp > 1 { self.rank_cp(ctx) } else { self.rank_2d(ctx) },
        )
        .unwrap()
    }

    /// One rank of a dp x tp run.
    fn rank_2d(&self, ctx: RankCtx) -> tpar::Result<Measured> {
        let (cfg, dp, tp, rows) = (self.cfg, self.dp, self.tp, self.rows);
        let rank = ctx.rank();
        let base = memory::current(rank);
        memory::reset_peak(rank);
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
        let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
        model.set_fusion(self.fusion);
        if tp > 1 {
            parallelize_llama(&mut model, &mesh["tp"], &sequence_parallel_layer_plan())?;
        }
        apply_activation_checkpointing(&mut model, &self.ac)?;
        if dp > 1 {
            let fsdp = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &fsdp)?;
            }
            fully_shard(&mut model.base_model, &mesh["dp"], &fsdp)?;
            fully_shard(&mut model, &mesh["dp"], &fsdp)?;
        }
        reset_parameters(&mut model, Device::Cpu, 3)?;
        let mut opt = AdamW::with_names(named_parameters(&model), AdamWConfig::default())?;
        let (ids, tgt) = batch_of(rows * dp, self.seq, cfg.vocab_size);
        let d = mesh["dp"].local_rank();
        let (ids, tgt) = (ids.narrow(0, rows * d, rows)?, tgt.narrow(0, rows * d, rows)?);
        let tgt = tgt.reshape([tgt.numel()])?;
        let _lp = loss_parallel::enable(&mesh["tp"]);
        self.train_measured(&ctx.world_group(), base, &model, &ids, &tgt, None, &mut opt, || Ok(()))
    }

    /// Two training steps of `model` on `ids` and the flat targets `tgt` (the loss scaled by
    /// `share` if any, `before_step` run between the backward and the optimizer step), as the
    /// trainers run them: the logits and the loss held through the optimizer step. Returns
    /// the peak above `base` and the second step's backward rise.
    ///
    /// The ranks of `world` meet before each step and after each forward, so no rank's
    /// figures move with another's progress: the local backend frees what a rank posted to
    /// a collective (and charges it to that rank until then) when the last member is done
    /// with it, so a rank that finished its collectives first still holds its inputs until
    /// the slowest rank finishes.
    #[allow(clippy::too_many_arguments)]
    fn train_measured(
        &self,
        world: &ProcessGroup,
        base: i64,
        model: &LlamaForPretraining,
        ids: &Tensor,
        tgt: &Tensor,
        share: Option<f64>,
        opt: &mut AdamW,
        before_step: impl Fn() -> tpar::Result<()>,
    ) -> tpar::Result<Measured> {
        let vocab = self.cfg.vocab_size as isize;
        let rank = world.rank();
        let mut m = Measured { peak: 0, backward_rise: 0, forward_kept: 0 };
        for _ in 0..2 {
            world.barrier()?;
            let start = memory::current(rank);
            let logits = model.logits(ids, None)?.reshape(&[-1, vocab])?;
            let loss = logits.cross_entropy(tgt, -100)?;
            let loss = match share {
                Some(s) => loss.mul_scalar(s)?,
                None => loss,
            };
            world.barrier()?;
            let end = memory::current(rank);
            m.forward_kept = end - start;
            m.peak = m.peak.max(memory::peak(rank) - base);
            memory::reset_peak(rank);
            loss.backward()?;
            m.backward_rise = memory::peak(rank) - end;
            m.peak = m.peak.max(memory::peak(rank) - base);
            before_step()?;
            opt.step()?;
            opt.zero_grad();
            // The trainers drop the logits and the loss (and so the graph) here.
            drop((logits, loss));
        }
        m.peak = m.peak.max(memory::peak(rank) - base);
        Ok(m)
    }

    /// One rank of a cp x tp run.
    fn rank_cp(&self, ctx: RankCtx) -> tpar::Result<Measured> {
        use tpar::dtensor::CpLayout;
        use tpar::models::context_parallel::{
            all_reduce_gradients, apply_context_parallel, cp_token_share,
        };
        let (cfg, cp, tp) = (self.cfg, self.cp, self.tp);
        let rank = ctx.rank();
        let base = memory::current(rank);
        memory::reset_peak(rank);
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[cp, tp], &["cp", "tp"])?;
        let g = mesh.group_of("cp")?.clone();
        let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
        model.set_fusion(self.fusion);
        if tp > 1 {
            parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())?;
        }
        apply_activation_checkpointing(&mut model, &self.ac)?;
        reset_parameters(&mut model, Device::Cpu, 3)?;
        apply_context_parallel(&mut model, &g, self.method)?;
        let mut opt = AdamW::with_names(named_parameters(&model), AdamWConfig::default())?;
        let layout = CpLayout::new(self.seq, cp)?;
        let (ids, tgt) = batch_of(self.rows, self.seq, cfg.vocab_size);
        let ids = layout.shard(&ids, 1, g.rank())?;
        let tgt = layout.shard(&tgt, 1, g.rank())?;
        let tgt = tgt.reshape([tgt.numel()])?;
        let share = cp_token_share(&tgt, -100, &g)?;
        let _lp = loss_parallel::enable(&mesh["tp"]);
        let world = ctx.world_group();
        self.train_measured(&world, base, &model, &ids, &tgt, Some(share), &mut opt, || {
            Ok(all_reduce_gradients(&model, &g)?)
        })
    }
}

/// What one rank of a measured run allocated, in bytes.
#[derive(Clone, Copy, Debug)]
struct Measured {
    /// The peak over building the model and two training steps, above what the rank held
    /// before it started.
    peak: i64,
    /// How far the second step's backward rose above what the rank held when the forward
    /// ended (the gradients and the backward's largest transient).
    backward_rise: i64,
    /// What the second step's forward left allocated (the activations the graph keeps,
    /// the logits and the loss).
    forward_kept: i64,
}

/// Each rank's peak, in rank order, over building its `v` stages of model `cfg` and two
/// `kind` steps of `m` micro-batches on `rows` sequences of [`SEQ`] per dp rank, on a
/// `["pp", "dp"]` mesh `[2, dp]` (pp rank `r` holds stages `r`, `r + 2`, ...), each stage
/// checkpointed by `ac` (as `llama_pp` applies it, before FSDP). With `dp > 1` each stage
/// is built as `llama_pp` builds it under FSDP: its decoder layers, then the stage,
/// `fully_shard`ed over the dp sub-mesh, and each dp rank takes its `rows` of a batch of
/// `rows * dp`.
fn measure_pp_with(
    cfg: LlamaConfig,
    rows: usize,
    dp: usize,
    (kind, v, m): (ScheduleKind, usize, usize),
    (ac, weight_pass): (&AcPolicy, WeightPass),
) -> Vec<i64> {
    let ac = ac.clone();
    spawn_scoped(
        SpawnConfig::new(2 * dp).timeout(Duration::from_secs(120)),
        move |ctx| -> tpar::Result<i64> {
            let rank = ctx.rank();
            let base = memory::current(rank);
            memory::reset_peak(rank);
            let world = ctx.world_group();
            let mesh = DeviceMesh::new(&world, DeviceType::Cpu, &[2, dp], &["pp", "dp"])?;
            let r = mesh["pp"].local_rank();
            let fsdp = FsdpConfig::default();
            let (mut stages, mut params) = (Vec::new(), Vec::new());
            for j in 0..v {
                let s = r + 2 * j;
                let mut stage = LlamaStage::for_stage(&cfg, s, 2 * v, None, Device::Meta)?;
                apply_activation_checkpointing(&mut stage, &ac)?;
                if dp > 1 {
                    for layer in &mut stage.base_model.layers.items {
                        fully_shard(layer, &mesh["dp"], &fsdp)?;
                    }
                    fully_shard(&mut stage, &mesh["dp"], &fsdp)?;
                }
                reset_parameters(&mut stage, Device::Cpu, 3)?;
                params.extend(named_parameters(&stage));
                stages.push(PipelineStage::new(stage, s, 2 * v, &mesh["pp"], Device::Cpu)?);
            }
            let mut opt = AdamW::with_names(params, AdamWConfig::default())?;
            let vocab = cfg.vocab_size as isize;
            let loss_fn = move |logits: &Value, t: &Tensor| -> tpar::nn::Result<Value> {
                logits.reshape(&[-1, vocab])?.cross_entropy(&t.reshape([t.numel()])?, -100)
            };
            let mut sched = PipelineSchedule::new(kind, stages, m, loss_fn)?;
            sched.set_ac_weight_pass(weight_pass);
            let (ids, tgt) = batch(rows * dp, cfg.vocab_size);
            let d = mesh["dp"].local_rank();
            let (ids, tgt) = (ids.narrow(0, rows * d, rows)?, tgt.narrow(0, rows * d, rows)?);
            for _ in 0..2 {
                // No rank's figures move with another's progress (`Run::train_measured`).
                world.barrier()?;
                sched.step(Some(&ids), Some(&tgt))?;
                opt.step()?;
                opt.zero_grad();
            }
            Ok(memory::peak(rank) - base)
        },
    )
    .unwrap()
}

fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

/// The sequence of the attention rows.
const LONG_SEQ: usize = 1024;

/// A Llama whose attention backward is its layers' largest transient: hidden 128, an MLP
/// of 128, 2 layers, `heads` query heads and `kv_heads` key and value heads, sequences of
/// [`LONG_SEQ`].
fn long_config(heads: usize, kv_heads: usize) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 256,
        max_position_embeddings: LONG_SEQ,
        hidden_size: 128,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        dtype: DType::F32,
        ..Default::default()
    }
}

/// One configuration's predicted peak per rank (rank order) and measured peak per rank.
struct Case {
    name: &'static str,
    predicted: Vec<MemoryEstimate>,
    measured: Vec<i64>,
    /// What each rank's second forward left allocated (empty where not measured).
    kept: Vec<i64>,
    /// Whether `kept` is held to the predicted activations (without cp: what a cp rank
    /// holds then moves with the timing of the copies the other rank sent it).
    check_kept: bool,
    /// The largest relative error allowed on each rank's peak.
    tol: f64,
}

impl Case {
    /// The predictions of `run` and what it measured.
    fn of(name: &'static str, run: &Run, measured: &[Measured]) -> Case {
        Case {
            name,
            predicted: run.predict(),
            measured: measured.iter().map(|m| m.peak).collect(),
            kept: measured.iter().map(|m| m.forward_kept).collect(),
            check_kept: run.cp == 1,
            tol: 0.15,
        }
    }
}

#[test]
fn predicted_peak_is_within_15_percent_of_the_measured_one() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memory::is_tracking());
    let base = Run::base();
    let case = |name: &'static str, run: &Run| Case::of(name, run, &run.measure());
    let fused = LlamaFusion { residual: true, ..FUSED_PROJECTIONS };
    let fsdp_tp = Run { dp: 2, tp: 2, ..base.clone() };
    let cp2 = Run { cp: 2, ..base.clone() };
    let cp2_ag = Run { method: CpMethod::AllGather, ..cp2.clone() };
    let mut cases = vec![
        case("single rank", &base),
        case("2x2 FSDP x TP (sp)", &fsdp_tp),
        case("tp 2 (sp)", &Run { tp: 2, ..base.clone() }),
        case("tp 2 (sp), full AC", &Run { tp: 2, ac: AcPolicy::full(), ..base.clone() }),
        case("tp 2 (sp), selective AC", &Run { tp: 2, ac: AcPolicy::selective(), ..base.clone() }),
        case("cp 2 (ring)", &cp2),
        case("cp 2 x tp 2 (ring, megatron)", &Run { tp: 2, ..cp2.clone() }),
        case("cp 2 (all-gather)", &cp2_ag),
        case("cp 2 (all-gather), full AC", &Run { ac: AcPolicy::full(), ..cp2_ag }),
        case("full AC", &Run { ac: AcPolicy::full(), ..base.clone() }),
        case("selective AC", &Run { ac: AcPolicy::selective(), ..base.clone() }),
        case("fused projections", &Run { fusion: FUSED_PROJECTIONS, ..base.clone() }),
        case(
            "fused residual",
            &Run { fusion: LlamaFusion { projections: false, residual: true }, ..base.clone() },
        ),
        case(
            "2x1 FSDP, fused projections and residual",
            &Run { dp: 2, fusion: fused, ..base.clone() },
        ),
        case(
            "2x2 FSDP x TP (sp), fusion asked (tp runs unfused)",
            &Run { fusion: fused, ..fsdp_tp.clone() },
        ),
    ];
    // Checkpointing only the third of the four layers: its recompute holds its
    // activations during its own backward, after the last layer's have gone, not at the
    // backward's start. Held within 5 %: a model that adds the recompute at every layer's
    // backward predicts 7 % over and fails. And every layer selective, every second full.
    for (name, ac) in [
        ("full:3 (layer 3 of 4)", "full:3"),
        ("selective:3", "selective:3"),
        ("selective+full:2", "selective+full:2"),
    ] {
        let mut every = case(name, &Run { ac: ac.parse().unwrap(), ..base.clone() });
        every.tol = 0.05;
        cases.push(every);
    }
    // pp 2, 1F1B, 2 micro-batches; alone, and over 2 FSDP ranks per stage as llama_pp
    // shards it (ranks in ["pp", "dp"] order: rank `r` runs pp rank `r / dp`'s stages),
    // with 1F1B and with interleaved 1F1B (2 stages per rank, one layer each, 4
    // micro-batches of one sequence). Under FSDP a rank's peak moves from run to run by
    // about a layer's gradient shard (1.4 MiB here) with the dp ranks' relative timing
    // (which decides when the asynchronous all-gathers and reduce-scatters allocate their
    // outputs and free their inputs): each rank's lower peak of two runs is held within
    // 8 %. Since the backward frees each node's saved tensors as it goes (module docs of
    // `tpar_models::memory`), the FSDP pipeline rows are predicted 4 % under to 2 % over
    // (one run, 2026-12-07). A model without FSDP's gathered layer parameters misses them
    // by 15 to 17 %, one without the later micro-batch's FSDP backward on 1F1B's last
    // stage by 10 to 12 %, and an interleaved walk without FSDP's layer backward (its
    // gathered units, unsharded gradients and reduce-scatter outputs) by 12 to 17 %: each
    // fails. A model that ignores what the backward frees (every activation and gradient
    // held at once) predicts up to 21 % over (cp 2) and 9 % over on the interleaved row's
    // second pp rank: it fails too.
    //
    // Zero-bubble with checkpointing: the split backward's input pass recomputes each
    // layer and keeps the recomputed graph's weight half until the weight pass, so pp
    // rank 1 holds its layers' weight halves for the micro-batch whose weight pass waits
    // and, in the next one's input pass, for the layer it has passed (a selective layer's
    // kept outputs freed by then): a model that counts only what the regions keep
    // predicts rank 1 18 % under with full checkpointing (that row fails) and 13 % under
    // with selective. When the weight pass recomputes the layer instead
    // (`WeightPass::Recompute`), rank 1 holds only each waiting layer's output gradient
    // beside what its forward kept: a model that still counts the weight halves predicts
    // it 25 % (full) and 18 % (selective) over: both fail.
    let zb = ScheduleKind::ZeroBubble;
    let (keep, again) = (WeightPass::Keep, WeightPass::Recompute);
    for (name, dp, kind, v, m, tol, (ac, wp)) in [
        (
            "pp 2, 1F1B, 2 micro-batches",
            1,
            ScheduleKind::OneFOneB,
            1,
            2,
            0.15,
            (AcPolicy::None, keep),
        ),
        (
            "pp 2 x dp 2 FSDP, 1F1B, 2 micro-batches",
            2,
            ScheduleKind::OneFOneB,
            1,
            2,
            0.08,
            (AcPolicy::None, keep),
        ),
        (
            "pp 2 x dp 2 FSDP, interleaved 1F1B (2 stages per rank), 4 micro-batches",
            2,
            ScheduleKind::Interleaved1F1B,
            2,
            4,
            0.08,
            (AcPolicy::None, keep),
        ),
        (
            "pp 2, zero-bubble, full AC, 2 micro-batches",
            1,
            zb,
            1,
            2,
            0.15,
            (AcPolicy::full(), keep),
        ),
        (
            "pp 2, zero-bubble, selective AC, 2 micro-batches",
            1,
            zb,
            1,
            2,
            0.15,
            (AcPolicy::selective(), keep),
        ),
        (
            "pp 2, zero-bubble, full AC recomputed in the weight pass, 2 micro-batches",
            1,
            zb,
            1,
            2,
            0.15,
            (AcPolicy::full(), again),
        ),
        (
            "pp 2, zero-bubble, selective AC recomputed in the weight pass, 2 micro-batches",
            1,
            zb,
            1,
            2,
            0.15,
            (AcPolicy::selective(), again),
        ),
    ] {
        // One sequence per micro-batch on each dp rank.
        let rows = m.max(BATCH);
        let pp = MemoryConfig {
            pp: 2,
            microbatches: m,
            schedule: kind,
            stages_per_rank: v,
            ac_weight_pass: wp,
            ..Run { dp, ac: ac.clone(), ..Run::new(config(), rows, SEQ) }.memory_config()
        };
        let stages: Vec<_> = (0..2).map(|s| predict_memory_stage(&pp, s).unwrap()).collect();
        // The highest stage is what predict_memory reports.
        assert_eq!(predict_memory(&pp).unwrap().peak, stages.iter().map(|p| p.peak).max().unwrap());
        let measure = || measure_pp_with(config(), rows, dp, (kind, v, m), (&ac, wp));
        let mut measured = measure();
        if dp > 1 {
            measured = measured.iter().zip(measure()).map(|(a, b)| b.min(*a)).collect();
        }
        cases.push(Case {
            name,
            predicted: (0..2 * dp).map(|r| stages[r / dp].clone()).collect(),
            measured,
            kept: Vec::new(),
            check_kept: false,
            tol,
        });
    }
    // Long sequences and a small MLP: attention's backward is a layer's largest
    // transient. Each also checks the second step's backward rise (below), and which
    // point of the backward the model takes for the peak: attention's under cp and
    // selective checkpointing; without either, the head's (the logits' and the head
    // input's gradients), since by attention's backward the layer's MLP and o_proj
    // nodes have run and freed what they saved. One kernel thread per rank runs the
    // attention backward's tasks in a fixed order, so the peak is the same from run to
    // run (on more threads it varies with the order).
    let long = |heads: usize, kv_heads: usize, rows: usize| Run {
        threads: Some(1),
        ..Run::new(long_config(heads, kv_heads), rows, LONG_SEQ)
    };
    let attention_rows: Vec<(&str, Run, &str)> = vec![
        ("seq 1024, hidden 128, mlp 128, 2 heads", long(2, 2, BATCH), "logits"),
        ("seq 1024, hidden 128, mlp 128, 8 heads / 2 kv heads, batch 1", long(8, 2, 1), "logits"),
        (
            "seq 1024, hidden 128, mlp 128, 4 heads, cp 2 (ring)",
            Run { cp: 2, ..long(4, 4, BATCH) },
            "attention",
        ),
        (
            "seq 1024, hidden 128, mlp 128, 2 heads, selective AC",
            Run { ac: AcPolicy::selective(), ..long(2, 2, BATCH) },
            "attention",
        ),
    ];
    let attention_rows: Vec<_> = attention_rows
        .into_iter()
        .map(|(name, run, point)| (name, run.predict(), run.measure(), run, point))
        .collect();
    for (name, _, measured, run, _) in &attention_rows {
        cases.push(Case::of(name, run, measured));
    }

    println!("| configuration | rank | predicted MiB | measured MiB | error |");
    let mut worst = 0.0f64;
    // The largest error of a predictor that forgets the optimizer state, and of one that
    // forgets the activations, over every configuration.
    let (mut no_optim, mut no_acts) = (0.0f64, 0.0f64);
    for c in &cases {
        for (r, (p, &m)) in c.predicted.iter().zip(&c.measured).enumerate() {
            let rel = |pred: u64| (pred as f64 - m as f64) / m as f64;
            let e = rel(p.peak);
            println!(
                "| {} | {r} | {:.1} | {:.1} | {:+.1} % |",
                c.name,
                mib(p.peak as f64),
                mib(m as f64),
                100.0 * e
            );
            println!("    {p}");
            if let Some(k) = c.kept.get(r) {
                println!(
                    "    activations {:.2} MiB, root's gathered parameters {:.2} MiB, the \
                     second forward left {:.2} MiB",
                    mib(p.activations as f64),
                    mib(p.root_gathered as f64),
                    mib(*k as f64)
                );
            }
            worst = worst.max(e.abs());
            no_optim = no_optim.max(rel(p.peak - p.optimizer_state).abs());
            no_acts = no_acts.max(rel(p.peak - p.activations).abs());
        }
    }
    println!(
        "largest error {:.1} %; forgetting the optimizer state {:.1} %, the activations {:.1} %",
        100.0 * worst,
        100.0 * no_optim,
        100.0 * no_acts
    );
    for c in &cases {
        for (r, (p, &m)) in c.predicted.iter().zip(&c.measured).enumerate() {
            let e = (p.peak as f64 - m as f64) / m as f64;
            assert!(
                e.abs() <= c.tol,
                "{} rank {r}: predicted {:.1} MiB, measured {:.1} MiB ({:+.1} %)",
                c.name,
                mib(p.peak as f64),
                mib(m as f64),
                100.0 * e
            );
        }
        // What the second step's forward leaves is the predicted activations (with the
        // logits and the loss) within 2 %, where nothing else stays from the forward.
        for (r, (p, &k)) in c.predicted.iter().zip(&c.kept).enumerate().filter(|_| c.check_kept) {
            let left = p.activations + p.root_gathered;
            let e = (left as f64 - k as f64) / k as f64;
            assert!(
                e.abs() <= 0.02,
                "{} rank {r}: predicted activations and root's gathered parameters {:.2} MiB, \
                 the second forward left {:.2} MiB ({:+.1} %)",
                c.name,
                mib(left as f64),
                mib(k as f64),
                100.0 * e
            );
        }
    }
    // The backward of the attention rows rises by the gradients made and the workspace
    // of its highest point, less what it freed by then (the GEMM workspace is held from
    // the forward on): within 15 % on the rank that rises most (what the model predicts;
    // a cp rank's rise moves by up to 1 MiB from run to run with the timing of the copies
    // the other rank sent it).
    println!(
        "| configuration | predicted backward rise MiB | measured MiB (highest rank) | error |"
    );
    for (name, predicted, measured, run, point) in &attention_rows {
        let rise = |p: &MemoryEstimate| p.gradients + p.transient - p.released;
        let p = predicted.iter().max_by_key(|p| rise(p)).unwrap();
        assert!(p.transient_what.contains(point), "{name}: {p}");
        // (one workspace per kernel thread; these rows run one)
        let workspace = HOST_GEMM_WORKSPACE * run.threads.unwrap_or(1) as u64;
        let want = (rise(p) - workspace) as f64;
        let got = measured.iter().map(|m| m.backward_rise).max().unwrap() as f64;
        let e = (want - got) / got;
        println!("| {name} | {:.2} | {:.2} | {:+.1} % |", mib(want), mib(got), 100.0 * e);
        assert!(
            e.abs() <= 0.15,
            "{name}: predicted a backward rise of {:.2} MiB, measured {:.2} MiB ({:+.1} %)",
            mib(want),
            mib(got),
            100.0 * e
        );
    }
    // The test can fail: a predictor without either term misses by more than 15 %.
    assert!(no_optim > 0.15, "forgetting the optimizer state is only {no_optim} off");
    assert!(no_acts > 0.15, "forgetting the activations is only {no_acts} off");
}

/// bf16 on the host: a half-precision product widens its second operand to f32 whole and
/// its first a block of rows at a time, so the backward's weight gradients of down_proj
/// and the head hold f32 copies beside the gradients (the trainers' default widths, 4096
/// tokens, one kernel thread). The second step's backward rise is within 15 % of the
/// prediction in bf16 (-9 %) and in f32 (where nothing widens; -1 %); a model that counts
/// the bf16 transients at half the f32 ones predicts 51 % under and fails.
#[test]
fn half_precision_backward_holds_widened_operands() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memory::is_tracking());
    for dtype in [DType::BF16, DType::F32] {
        let cfg = LlamaConfig {
            vocab_size: 259,
            max_position_embeddings: 2048,
            hidden_size: 64,
            intermediate_size: 176,
            num_hidden_layers: 1,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            dtype,
            ..Default::default()
        };
        let run = Run { threads: Some(1), ..Run::new(cfg, 2, 2048) };
        let p = run.predict().remove(0);
        let got = run.measure()[0].backward_rise as f64;
        let want = (p.gradients + p.transient - p.released - HOST_GEMM_WORKSPACE) as f64;
        let e = (want - got) / got;
        println!(
            "{dtype:?}: predicted backward rise {:.2} MiB, measured {:.2} MiB ({:+.1} %); {p}",
            mib(want),
            mib(got),
            100.0 * e
        );
        assert!(e.abs() <= 0.15, "{dtype:?}: {:+.1} % ({p})", 100.0 * e);
    }
}

/// Predicted and measured peaks of two configurations per rank, their differences, and
/// each peak's error; panics naming `what` when a peak misses by more than 15 % or the
/// predicted difference misses the measured one by more than `diff_tol` of the predicted
/// one (the measured peaks move by up to 1 MiB from run to run with the rank threads'
/// timing).
fn check_difference(
    what: &str,
    (pa, ma): (&[MemoryEstimate], &[i64]),
    (pb, mb): (&[MemoryEstimate], &[i64]),
    diff_tol: f64,
) {
    for (r, (((pa, &ma), pb), &mb)) in pa.iter().zip(ma).zip(pb).zip(mb).enumerate() {
        let (pa, pb) = (pa.peak as f64, pb.peak as f64);
        let (ma, mb) = (ma as f64, mb as f64);
        let (pd, md) = (pb - pa, mb - ma);
        println!(
            "| {what} | {r} | {:.1} -> {:.1} | {:.1} -> {:.1} | difference predicted {:.2} MiB, measured {:.2} MiB |",
            mib(pa),
            mib(pb),
            mib(ma),
            mib(mb),
            mib(pd),
            mib(md)
        );
        for (p, m) in [(pa, ma), (pb, mb)] {
            let e = (p - m) / m;
            assert!(
                e.abs() <= 0.15,
                "{what} rank {r}: predicted {:.1} MiB, measured {:.1} MiB ({:+.1} %)",
                mib(p),
                mib(m),
                100.0 * e
            );
        }
        assert!(
            md > 0.0 && (pd - md).abs() <= diff_tol * pd,
            "{what} rank {r}: the predicted difference {:.2} MiB misses the measured {:.2} MiB by more than {:.0} %",
            mib(pd),
            mib(md),
            100.0 * diff_tol
        );
    }
}

/// A pipeline stage holds its output with its graph until its backward (the root the
/// backward starts from), beside the copy it sent: with full checkpointing at a small
/// width relative to the MLP and many tokens per micro-batch that is a large share of the
/// first stage's peak, and the model counts it: rank 0 within 10 % (6.3 % under, one run,
/// 2026-12-08); without the term it is predicted 17.5 % under and this fails.
#[test]
fn a_stage_holds_its_output_until_its_backward() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = LlamaConfig {
        vocab_size: 259,
        max_position_embeddings: SEQ,
        hidden_size: 256,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        dtype: DType::F32,
        ..Default::default()
    };
    // 32 sequences of 256 in 2 micro-batches: 4096 tokens a micro-batch.
    let (rows, m, ac) = (32, 2, AcPolicy::full());
    let c = MemoryConfig {
        pp: 2,
        microbatches: m,
        schedule: ScheduleKind::OneFOneB,
        ac: ac.clone(),
        ..MemoryConfig::new(cfg, rows, SEQ)
    };
    let predicted = predict_memory_stage(&c, 0).unwrap().peak;
    let kind = (ScheduleKind::OneFOneB, 1, m);
    let measured = measure_pp_with(cfg, rows, 1, kind, (&ac, WeightPass::Keep))[0];
    let e = predicted as f64 / measured as f64 - 1.0;
    println!(
        "rank 0: predicted {:.2} MiB, measured {:.2} MiB ({:+.1} %)",
        mib(predicted as f64),
        mib(measured as f64),
        100.0 * e
    );
    assert!(e.abs() <= 0.10, "rank 0: predicted {predicted} B, measured {measured} B");
}

/// Interleaved 1F1B and all-gather context parallelism, each against the configuration
/// it changes, on models where what it adds is a large share of the peak: the predicted
/// peaks are within 15 % of the measured ones and the measured differences within 30 %
/// of the predicted differences. A model that counts one micro-batch fewer in flight, or
/// forgets the gathered keys and values, misses the difference by far more.
#[test]
fn interleaved_and_all_gather_add_what_the_model_predicts() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memory::is_tracking());
    println!("| configuration | rank | predicted MiB | measured MiB | |");
    // Interleaved 1F1B, pp 2 x 2 stages per rank (one layer each), 4 micro-batches of 4
    // sequences: rank 0 holds 5 stage micro-batches at its peak, 1F1B's stage 0 holds 2 of
    // twice the layers.
    let cfg = LlamaConfig {
        vocab_size: 256,
        max_position_embeddings: SEQ,
        hidden_size: 128,
        intermediate_size: 344,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        dtype: DType::F32,
        ..Default::default()
    };
    let rows = 16;
    let one_f_one_b = MemoryConfig {
        pp: 2,
        microbatches: 4,
        schedule: ScheduleKind::OneFOneB,
        ..MemoryConfig::new(cfg, rows, SEQ)
    };
    let interleaved = MemoryConfig {
        schedule: ScheduleKind::Interleaved1F1B,
        stages_per_rank: 2,
        ..one_f_one_b.clone()
    };
    // Two ranks: the pp ranks, or the cp ranks of stage 0.
    let predict = |c: &MemoryConfig| -> Vec<_> {
        (0..2).map(|r| predict_memory_stage(c, r * c.pp / 2).unwrap()).collect()
    };
    let (p1, pi) = (predict(&one_f_one_b), predict(&interleaved));
    for p in p1.iter().chain(&pi) {
        println!("    {p}");
    }
    let m1 = measure_pp_with(
        cfg,
        rows,
        1,
        (ScheduleKind::OneFOneB, 1, 4),
        (&AcPolicy::None, WeightPass::Keep),
    );
    let mi = measure_pp_with(
        cfg,
        rows,
        1,
        (ScheduleKind::Interleaved1F1B, 2, 4),
        (&AcPolicy::None, WeightPass::Keep),
    );
    check_difference(
        "pp 2, 1F1B -> interleaved (2 per rank), 4 micro-batches",
        (&p1, &m1),
        (&pi, &mi),
        0.3,
    );
    assert_eq!(
        predict_memory(&interleaved).unwrap().peak,
        pi.iter().map(|p| p.peak).max().unwrap()
    );

    // All-gather against ring attention at cp 2: hidden 256, 2 layers, a sequence of 2048,
    // as many key and value heads as query heads.
    let seq = 2048;
    let cfg = LlamaConfig {
        hidden_size: 256,
        intermediate_size: 688,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 8,
        max_position_embeddings: seq,
        ..cfg
    };
    let ring = Run { cp: 2, ..Run::new(cfg, BATCH, seq) };
    let gather = Run { method: CpMethod::AllGather, ..ring.clone() };
    compare_runs("cp 2, seq 2048, ring -> all-gather", &ring, &gather, 0.3);
}

/// [`check_difference`] of two measured runs (within `diff_tol` of the predicted
/// difference), their predictions printed.
fn compare_runs(what: &str, a: &Run, b: &Run, diff_tol: f64) {
    let (pa, pb) = (a.predict(), b.predict());
    for p in pa.iter().chain(&pb) {
        println!("    {p}");
    }
    check_difference(what, (&pa, &a.peaks()), (&pb, &b.peaks()), diff_tol);
}

/// Fused projections under selective checkpointing (torchtitan's policy: attention and
/// every second matmul): q, k and v, and gate and up, are one matmul each, so the layer
/// has 4 matmuls where it had 7 and the checkpoint keeps the wide q/k/v and gate/up
/// outputs instead of q, v and gate, and recomputes gate and up as copies. The
/// measured difference is within 15 % of the predicted one (one kernel thread per rank
/// makes it repeatable); a model that ignores the fusion predicts none, one that forgets
/// the recompute's gate and up copies about half of it.
#[test]
fn fused_projections_change_what_selective_checkpointing_keeps() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memory::is_tracking());
    println!("| configuration | rank | predicted MiB | measured MiB | |");
    // One kernel thread per rank: the measured difference is then the same on a loaded
    // machine as on a quiet one (with a pool, how many tasks' scratch overlaps varies).
    let selective = Run { ac: AcPolicy::selective(), threads: Some(1), ..Run::base() };
    let fused = Run { fusion: FUSED_PROJECTIONS, ..selective.clone() };
    compare_runs("selective AC, unfused -> fused projections", &selective, &fused, 0.15);
}

/// Each thread of a rank's kernel pool keeps its own GEMM packing buffers: one rank on a
/// pool of two threads peaks higher than on one by their workspace, as predicted, within
/// 15 % (the base model peaks in an MLP backward, where the threads' attention scratch is
/// not held). A model that counts one workspace per rank predicts no difference.
#[test]
fn each_kernel_thread_keeps_a_gemm_workspace() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memory::is_tracking());
    println!("| configuration | rank | predicted MiB | measured MiB | |");
    let one = Run { threads: Some(1), ..Run::base() };
    let two = Run { threads: Some(2), ..Run::base() };
    compare_runs("one rank, 1 -> 2 kernel threads", &one, &two, 0.15);
}

/// The fusions change the prediction only where they run: fused projections under
/// selective checkpointing at `tp == 1`; not without checkpointing, and not under a
/// tensor-parallel plan (whose styles on the projections make the layers run unfused, as
/// the 2x2 row of the 15 % table measures); the fused residual changes no term on the
/// host. The configuration names the fusions.
#[test]
fn fusion_changes_the_prediction_only_where_it_runs() {
    let peak = |run: &Run| predict_memory(&run.memory_config()).unwrap().peak;
    let both = LlamaFusion { residual: true, ..FUSED_PROJECTIONS };
    let residual = LlamaFusion { projections: false, residual: true };
    let selective = Run { ac: AcPolicy::selective(), ..Run::base() };
    let fused = Run { fusion: FUSED_PROJECTIONS, ..selective.clone() };
    assert!(peak(&fused) > peak(&selective), "{} vs {}", peak(&fused), peak(&selective));
    for (what, run) in [
        ("no checkpointing", Run::base()),
        ("2x2 FSDP x TP, selective", Run { dp: 2, tp: 2, ..selective.clone() }),
        ("cp 2 x tp 2, selective", Run { cp: 2, tp: 2, ..selective.clone() }),
    ] {
        let fused = Run { fusion: both, ..run.clone() };
        assert_eq!(peak(&fused), peak(&run), "{what}: fused projections and residual");
    }
    assert_eq!(peak(&Run { fusion: residual, ..selective.clone() }), peak(&selective));
    let text = predict_memory(&fused.memory_config()).unwrap().config;
    assert!(text.ends_with("fused projections"), "{text}");
}

#[test]
fn fits_refuses_with_the_numbers() {
    let run = MemoryConfig {
        dp: 2,
        tp: 2,
        data_parallel: DataParallelMode::Fsdp { param_dtype: None },
        ..MemoryConfig::new(config(), BATCH, SEQ)
    };
    let est = predict_memory(&run).unwrap();
    assert!(est.fits(est.peak).is_ok());
    let e = est.fits(est.peak - 1).unwrap_err();
    let text = e.to_string();
    for want in [
        "dp 2 x tp 2",
        "FSDP",
        "does not fit",
        &format!("({} B)", est.peak),
        &format!("({} B)", est.peak - 1),
        &format!("({} B)", est.optimizer_state),
        &format!("({} B)", est.activations),
    ] {
        assert!(text.contains(want), "{want:?} missing from: {text}");
    }
    assert!(matches!(e, MemoryError::DoesNotFit { budget, .. } if budget == est.peak - 1));
    // Configurations the model refuses, by name.
    let bad = [
        (MemoryConfig { dp: 0, ..run.clone() }, "dp is 0"),
        (
            MemoryConfig { data_parallel: DataParallelMode::None, ..run.clone() },
            "data-parallel mode",
        ),
        (MemoryConfig { seq: 100_000, ..run.clone() }, "max_position_embeddings"),
        (
            MemoryConfig { pp: 2, microbatches: 3, ..run.clone() },
            "not a multiple of 3 micro-batches",
        ),
        (MemoryConfig { pp: 2, stages_per_rank: 0, ..run.clone() }, "stages_per_rank is 0"),
        (
            MemoryConfig { pp: 2, microbatches: 2, stages_per_rank: 2, ..run.clone() },
            "runs one stage per rank, not 2",
        ),
    ];
    for (c, want) in bad {
        let e = predict_memory(&c).unwrap_err().to_string();
        assert!(e.contains(want), "{want:?} missing from: {e}");
    }
}

/// The host attention backward holds its `dq`, `dk` and `dv` and what
/// `host_sdpa_backward_scratch` says: one task per (batch, kv head) group, keys split in
/// runs (causal, with grouped-query heads, one group alone) and a block of fewer queries
/// than keys without the causal mask. On one thread (tasks in a fixed order) within
/// 15 %; on two, which tasks run last varies from run to run (and with it the peak, by up
/// to a third where one group's keys are split in 8 runs), so the measured peak is only
/// held to at most 15 % above the prediction.
#[test]
fn host_attention_backward_holds_its_gradients_and_scratch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memory::is_tracking());
    println!("| b, hq, hkv, sq, sk, d, causal | threads | predicted KiB | measured KiB | error |");
    let shapes = [
        (2, 4, 4, 1024, 1024, 32, true),
        (2, 2, 2, 1024, 1024, 64, true),
        (1, 8, 2, 1024, 1024, 16, true),
        (1, 4, 1, 512, 512, 32, true),
        (1, 8, 2, 256, 512, 16, false),
    ];
    for threads in [1usize, 2] {
        for (b, hq, hkv, sq, sk, d, causal) in shapes {
            let measured = spawn_scoped(
                SpawnConfig::new(1).threads(RankThreads::PerRank(threads)),
                move |ctx| -> tpar::Result<i64> {
                    let rank = ctx.rank();
                    let mut rng = tpar::tensor::Rng::new(7);
                    let mut randn = |dims: [usize; 4], grad: bool| {
                        Tensor::randn(dims, DType::F32, &mut rng).map(|t| t.requires_grad_(grad))
                    };
                    let q = randn([b, hq, sq, d], true)?;
                    let k = randn([b, hkv, sk, d], true)?;
                    let v = randn([b, hkv, sk, d], true)?;
                    let dout = randn([b, hq, sq, d], false)?;
                    // Once before measuring: the pool's threads make what they keep
                    // between calls (their tile kernels' packing buffers).
                    let sdpa = || {
                        let leaf = |t: &Tensor| t.detach().requires_grad_(true);
                        let (q, k, v) = (leaf(&q), leaf(&k), leaf(&v));
                        Tensor::scaled_dot_product_attention(&q, &k, &v, None, causal, None)
                    };
                    sdpa()?.backward_with(&dout)?;
                    // The smaller of two measured calls: a worker that ran none of a
                    // kernel's tasks so far makes its buffers in the call where it first
                    // does (on two threads, which worker takes which task varies), at
                    // most once per kernel and worker.
                    let mut rise = i64::MAX;
                    for _ in 0..2 {
                        let out = sdpa()?;
                        let base = memory::current(rank);
                        memory::reset_peak(rank);
                        out.backward_with(&dout)?;
                        rise = rise.min(memory::peak(rank) - base);
                    }
                    Ok(rise)
                },
            )
            .unwrap()[0];
            let call = AttentionCall {
                batch: b,
                q_heads: hq,
                kv_heads: hkv,
                q_len: sq,
                kv_len: sk,
                head_dim: d,
                causal,
            };
            let grads = 4 * (b * hq * sq * d + 2 * b * hkv * sk * d);
            let predicted =
                (grads as u64 + host_sdpa_backward_scratch(&call, DType::F32, threads)) as f64;
            let e = (predicted - measured as f64) / measured as f64;
            println!(
                "| {b}, {hq}, {hkv}, {sq}, {sk}, {d}, {causal} | {threads} | {:.0} | {:.0} | {:+.1} % |",
                predicted / 1024.0,
                measured as f64 / 1024.0,
                100.0 * e
            );
            let within = if threads == 1 { e.abs() <= 0.15 } else { e >= -0.15 };
            assert!(
                within,
                "{call:?} on {threads} threads: predicted {predicted} B, measured {measured} B"
            );
        }
    }
}

/// Whether alternative `a` of `c` changes no setting further than `b` does: every setting
/// `a` changes, `b` changes too, at least as far (a checkpointing policy that recomputes
/// no more of `c`'s forward, ZeRO-1 before FSDP, fewer micro-batches before more; the
/// same mesh).
fn no_further(c: &MemoryConfig, a: &Alternative, b: &Alternative) -> bool {
    let strength = |ch: &Change| match ch {
        Change::Ac(p) => recompute_share(&MemoryConfig { ac: p.clone(), ..c.clone() }).unwrap(),
        Change::DataParallel(DataParallelMode::Fsdp { .. }) => 2.0,
        Change::DataParallel(DataParallelMode::Zero1) => 1.0,
        Change::Microbatches(m) => *m as f64,
        _ => 0.0,
    };
    let same_kind = |x: &Change, y: &Change| std::mem::discriminant(x) == std::mem::discriminant(y);
    a != b
        && a.changes.iter().all(|x| {
            b.changes.iter().any(|y| {
                same_kind(x, y)
                    && match (x, y) {
                        (Change::Mesh { .. }, _) => x == y,
                        _ => strength(x) <= strength(y),
                    }
            })
        })
}

/// What every alternative must be: on the same ranks, with the same global batch, a mesh
/// the model's heads and the sequence divide, predicted within the budget, and not a
/// further change than another alternative.
fn check_alternatives(c: &MemoryConfig, budget: u64, alts: &[Alternative]) {
    let ranks = |x: &MemoryConfig| x.dp * x.cp * x.tp * x.pp;
    for a in alts {
        let n = &a.config;
        assert!(a.estimate.peak <= budget, "{a} exceeds {budget}");
        assert_eq!(predict_memory(n).unwrap(), a.estimate, "{a}");
        assert_eq!((ranks(n), n.pp), (ranks(c), c.pp), "{a}: the ranks");
        assert_eq!(n.batch * n.dp, c.batch * c.dp, "{a}: the global batch");
        assert!(n.model.num_key_value_heads.is_multiple_of(n.tp), "{a}: tp {}", n.tp);
        assert!(n.seq.is_multiple_of(n.tp * n.cp), "{a}: the sequence over cp x tp");
        assert!(!a.changes.is_empty(), "{a}");
        // Each change has an effect where it is made.
        for ch in &a.changes {
            let effect = match ch {
                Change::DataParallel(_) => n.dp * n.cp > 1,
                Change::Plan(_) => n.tp > 1,
                Change::CpMethod(_) => n.cp > 1,
                Change::WeightPass(_) => n.pp > 1 && n.ac != AcPolicy::None,
                _ => true,
            };
            assert!(effect, "{a}: {ch} changes nothing there");
        }
        for b in alts {
            assert!(!no_further(c, b, a), "{a} is listed beside {b}, which changes less");
        }
    }
    // Fewest changes first.
    assert!(alts.windows(2).all(|w| w[0].changes.len() <= w[1].changes.len()), "{alts:?}");
}

/// A configuration over its budget is refused with the configurations on the same ranks
/// that would fit (stronger checkpointing, a data-parallel mode that shards more, another
/// mesh split, more micro-batches, the Megatron plan, the ring, zero-bubble's weight pass
/// recomputing): each predicted within the
/// budget, keeping the ranks
/// and the global batch, none a further change than another; with none, the one with the
/// lowest peak. Predictions only (the next test measures one).
#[test]
fn refused_configurations_name_what_would_fit() {
    let single = Run::base().memory_config();
    let peak = |c: &MemoryConfig| predict_memory(c).unwrap().peak;
    let selective = peak(&MemoryConfig { ac: AcPolicy::selective(), ..single.clone() });
    let full = peak(&MemoryConfig { ac: AcPolicy::full(), ..single.clone() });
    assert!(full < selective && selective < peak(&single));

    // Between selective and none: the checkpointing that fits with the least recompute
    // (`least_recompute`'s pick; here full on every second layer), and not full on every
    // layer (a further change of the same setting).
    let budget = (selective + peak(&single)) / 2;
    let alts = alternatives(&single, budget);
    check_alternatives(&single, budget, &alts);
    let pick = least_recompute(&single, budget).unwrap().policy;
    assert_ne!(pick, AcPolicy::full());
    assert_eq!(alts[0].changes, vec![Change::Ac(pick.clone())], "{alts:?}");
    assert!(!alts.iter().any(|a| a.changes.contains(&Change::Ac(AcPolicy::full()))));
    let e = check_fits(&single, budget).unwrap_err();
    let text = e.to_string();
    assert!(text.contains(&format!("would fit with ac {pick}: predicted peak")), "{text}");
    assert!(
        matches!(&e, MemoryError::DoesNotFit { alternatives, lowest: None, .. } if *alternatives == alts)
    );
    // Between full and selective: every layer selective and every second full (the
    // least recompute that fits), not full everywhere.
    let budget = (full + selective) / 2;
    let alts = alternatives(&single, budget);
    check_alternatives(&single, budget, &alts);
    let mixed = AcPolicy::Mixed { full_every: 2, ops: SaveOp::DEFAULT.to_vec() };
    assert_eq!(least_recompute(&single, budget).unwrap().policy, mixed);
    assert_eq!(alts[0].changes, vec![Change::Ac(mixed)], "{alts:?}");
    assert!(!alts.iter().any(|a| a.changes.contains(&Change::Ac(AcPolicy::full()))));
    // What fits is not refused, and has no alternatives.
    assert_eq!(check_fits(&single, peak(&single)).unwrap().peak, peak(&single));
    assert!(alternatives(&single, peak(&single)).is_empty());

    // dp 4 with DDP: ZeRO-1 fits at its own peak, so FSDP (which shards further) is not
    // listed, alone or with anything else.
    let ddp = MemoryConfig {
        dp: 4,
        data_parallel: DataParallelMode::Ddp,
        ..MemoryConfig::new(config(), BATCH, SEQ)
    };
    let zero1 = peak(&MemoryConfig { data_parallel: DataParallelMode::Zero1, ..ddp.clone() });
    assert!(zero1 < peak(&ddp));
    let alts = alternatives(&ddp, zero1);
    check_alternatives(&ddp, zero1, &alts);
    assert_eq!(alts[0].changes, vec![Change::DataParallel(DataParallelMode::Zero1)]);
    let fsdp = Change::DataParallel(DataParallelMode::Fsdp { param_dtype: None });
    assert!(!alts.iter().any(|a| a.changes.contains(&fsdp)), "{alts:?}");

    // Budgets from 95 % down to 40 % of the peak at 2x2 FSDP x TP (where the plan may
    // change too), at dp 4 with DDP (the mesh), under a pipeline (micro-batches) and at
    // cp 2 with the all-gather (the method).
    let fsdp_tp = MemoryConfig {
        dp: 2,
        tp: 2,
        data_parallel: DataParallelMode::Fsdp { param_dtype: None },
        ..MemoryConfig::new(config(), BATCH, SEQ)
    };
    let pp = MemoryConfig { pp: 2, microbatches: 2, batch: 4, ..single.clone() };
    let cp = MemoryConfig { cp: 2, cp_method: CpMethod::AllGather, ..single.clone() };
    // Zero-bubble with full checkpointing keeping the weight halves (the weight pass).
    let zb =
        MemoryConfig { schedule: ScheduleKind::ZeroBubble, ac: AcPolicy::full(), ..pp.clone() };
    let again = MemoryConfig { ac_weight_pass: WeightPass::Recompute, ..zb.clone() };
    assert!(peak(&again) < peak(&zb));
    let budget = peak(&again);
    let alts = alternatives(&zb, budget);
    check_alternatives(&zb, budget, &alts);
    let recompute = Change::WeightPass(WeightPass::Recompute);
    assert!(alts.iter().any(|a| a.changes == [recompute.clone()]), "{alts:?}");
    let text = check_fits(&zb, budget).unwrap_err().to_string();
    assert!(text.contains("ac weight pass recompute: predicted peak"), "{text}");
    let mut kinds = std::collections::BTreeSet::new();
    for c in [&fsdp_tp, &ddp, &pp, &cp, &zb] {
        for pct in [95, 85, 75, 60, 40] {
            let budget = peak(c) * pct / 100;
            let alts = alternatives(c, budget);
            check_alternatives(c, budget, &alts);
            kinds.extend(alts.iter().flat_map(|a| &a.changes).map(|ch| match ch {
                Change::DataParallel(_) => "data parallel",
                Change::Ac(_) => "ac",
                Change::WeightPass(_) => "weight pass",
                Change::Microbatches(_) => "micro-batches",
                Change::Mesh { .. } => "mesh",
                Change::Plan(_) => "plan",
                Change::CpMethod(_) => "cp method",
            }));
            match check_fits(c, budget) {
                Err(MemoryError::DoesNotFit { alternatives: a, lowest, .. }) => {
                    assert_eq!(a, alts);
                    // With nothing that fits, the lowest peak the search found.
                    match (alts.is_empty(), lowest) {
                        (true, Some(l)) => {
                            assert!(l.estimate.peak > budget && l.estimate.peak < peak(c));
                            assert_eq!(Some(*l), lowest_peak(c));
                        }
                        (false, None) => {}
                        (empty, l) => panic!("{c}: alternatives empty {empty}, lowest {l:?}"),
                    }
                }
                other => panic!("{c} at {pct} %: {other:?}"),
            }
        }
    }
    // Every kind of change was offered somewhere.
    assert_eq!(kinds.len(), 7, "{kinds:?}");

    // Far below anything: no alternative, and the message says which is lowest.
    let text = check_fits(&single, 1 << 20).unwrap_err().to_string();
    assert!(text.contains("fits either, the lowest being ac full: predicted peak"), "{text}");
}

/// The first of 95, 90, ... 70 % of `c`'s predicted peak at which `pick` (a budget's
/// choice: its predicted peak and itself) is predicted at least 3 % under the budget (the
/// model's error on these runs is well under that), so a measurement can tell.
fn budget_with_room<T>(c: &MemoryConfig, pick: impl Fn(u64) -> (u64, T)) -> (u64, T) {
    let none = predict_memory(c).unwrap().peak;
    [95u64, 90, 85, 80, 75, 70]
        .into_iter()
        .map(|pct| none * pct / 100)
        .map(|b| (b, pick(b)))
        .find(|(b, (peak, _))| *peak <= b * 97 / 100)
        .map(|(b, (_, t))| (b, t))
        .expect("a budget with room to measure")
}

/// Measures `run` as it is (without checkpointing) and under `policy`, the choice `what`
/// made for `budget`: the first must exceed the budget, the second fit in it.
fn measured_against(run: &Run, policy: &AcPolicy, budget: u64, what: &str) {
    let refused = run.peaks()[0];
    let picked = Run { ac: policy.clone(), ..run.clone() }.peaks()[0];
    println!(
        "budget {:.1} MiB: none measured {:.1} MiB; {what}, measured {:.1} MiB",
        mib(budget as f64),
        mib(refused as f64),
        mib(picked as f64)
    );
    assert!(refused > budget as i64, "no checkpointing fits after all: {refused} <= {budget}");
    assert!(picked <= budget as i64, "{what}: measured {picked} B > {budget}");
}

/// The measured side of [`refused_configurations_name_what_would_fit`]: at a budget under
/// one rank's predicted peak without checkpointing, the run without is refused and really
/// peaks above the budget, and the first alternative named (a checkpointing policy) really
/// runs within it.
#[test]
fn the_alternative_named_fits_when_measured() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run = Run::base();
    let c = run.memory_config();
    let (budget, first) = budget_with_room(&c, |b| {
        let first = alternatives(&c, b).swap_remove(0);
        (first.estimate.peak, first)
    });
    let [Change::Ac(policy)] = first.changes.as_slice() else { panic!("{first}") };
    assert_eq!(first.config, Run { ac: policy.clone(), ..run.clone() }.memory_config());
    measured_against(&run, policy, budget, &format!("first alternative {first}"));
}

/// `--ac auto`'s choice (`least_recompute`): under a budget the run without checkpointing
/// exceeds when measured, the policy picked fits when measured, and every policy that
/// costs less is predicted not to fit.
#[test]
fn the_policy_least_recompute_picks_fits_when_measured() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run = Run::base();
    let c = run.memory_config();
    let (budget, choice) = budget_with_room(&c, |b| {
        let choice = least_recompute(&c, b).unwrap();
        (choice.estimate.peak, choice)
    });
    assert_ne!(choice.policy, AcPolicy::None);
    for p in ac_candidates(&c) {
        let n = MemoryConfig { ac: p.clone(), ..c.clone() };
        if recompute_share(&n).unwrap() < choice.recompute {
            assert!(predict_memory(&n).unwrap().peak > budget, "{p} costs less and fits");
        }
    }
    measured_against(&run, &choice.policy, budget, &format!("picked {choice}"));
}
