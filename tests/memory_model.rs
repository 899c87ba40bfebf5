//! The memory model against the tracking allocator: for one Llama (hidden 256, 4
//! layers, seq 256, f32, AdamW) trained two steps as the trainers do (the loss held
//! through the optimizer step), the predicted per-rank peak is within 15 % of the
//! measured one at one rank, 2x2 FSDP x TP (sequence-parallel plan), pp 2 with 1F1B,
//! cp 2, cp 2 x tp 2 (ring attention, Megatron plan), cp 2 with the all-gather method
//! (alone and under full activation checkpointing), full and selective activation
//! checkpointing, and at three configurations whose largest transient is attention's
//! backward (a sequence of 1024, hidden 128, an MLP of 128: 2 heads, 8 heads over 2 kv
//! heads, and cp 2 over the ring), where the backward's rise over the forward's end is
//! held to the model's gradients and transient too; a predictor that forgets the
//! optimizer state or the activations misses by more in at least one of them. The host
//! attention backward's gradients and scratch are checked against the allocator alone.
//! Two more configurations, sized so that what they add is a large share of the peak,
//! hold the differences too: interleaved 1F1B (pp 2, 2 stages per rank, 4 micro-batches)
//! against 1F1B on the same batch, and all-gather against ring context parallelism at a
//! long sequence. Alone in its test binary, the measuring tests one at a time (a lock):
//! the allocator counts per rank slot, so rank threads of another test running at the
//! same time would be counted too.

use std::sync::Mutex;
use std::time::Duration;

use tpar::collectives::RankThreads;
use tpar::dtensor::CpMethod;
use tpar::models::memory::{
    host_sdpa_backward_scratch, predict_memory, predict_memory_stage, AttentionCall,
    DataParallelMode, MemoryConfig, MemoryError, TpPlan, HOST_GEMM_WORKSPACE,
};
use tpar::prelude::*;
use tpar::tensor::memory;

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

/// Held by each measuring test: rank threads of two tests at once share rank slots.
static SERIAL: Mutex<()> = Mutex::new(());

const BATCH: usize = 2;
const SEQ: usize = 256;

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

/// Each rank's peak bytes over building the model and two training steps, above what
/// the rank held before it started.
fn measure_2d(dp: usize, tp: usize, ac: &AcPolicy) -> Vec<i64> {
    measure_2d_with(config(), BATCH, SEQ, dp, tp, ac)
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
}

/// Runs one training step's forward, then its backward, recording in `m` the peak so far
/// (above `base`) and the backward's rise above the forward's end.
fn step_measured(
    rank: usize,
    base: i64,
    m: &mut Measured,
    forward: impl FnOnce() -> tpar::Result<Value>,
) -> tpar::Result<Value> {
    let loss = forward()?;
    let end = memory::current(rank);
    m.peak = m.peak.max(memory::peak(rank) - base);
    memory::reset_peak(rank);
    loss.backward()?;
    m.backward_rise = memory::peak(rank) - end;
    m.peak = m.peak.max(memory::peak(rank) - base);
    Ok(loss)
}

/// [`measure_2d`] for model `cfg` and `rows` sequences of `seq` tokens per dp rank.
fn measure_2d_with(
    cfg: LlamaConfig,
    rows: usize,
    seq: usize,
    dp: usize,
    tp: usize,
    ac: &AcPolicy,
) -> Vec<i64> {
    let threads = RankThreads::per_rank(dp * tp);
    measure_2d_steps(cfg, rows, seq, dp, tp, ac, threads).iter().map(|m| m.peak).collect()
}

/// [`measure_2d_with`] on the rank kernel pools `threads`, with each rank's backward rise.
fn measure_2d_steps(
    cfg: LlamaConfig,
    rows: usize,
    seq: usize,
    dp: usize,
    tp: usize,
    ac: &AcPolicy,
    threads: RankThreads,
) -> Vec<Measured> {
    let ac = ac.clone();
    spawn_scoped(
        SpawnConfig::new(dp * tp).timeout(Duration::from_secs(120)).threads(threads),
        move |ctx| -> tpar::Result<Measured> {
            let rank = ctx.rank();
            let base = memory::current(rank);
            memory::reset_peak(rank);
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
            if tp > 1 {
                parallelize_llama(&mut model, &mesh["tp"], &sequence_parallel_layer_plan())?;
            }
            apply_activation_checkpointing(&mut model, &ac)?;
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
            let (ids, tgt) = batch_of(rows * dp, seq, cfg.vocab_size);
            let d = mesh["dp"].local_rank();
            let (ids, tgt) = (ids.narrow(0, rows * d, rows)?, tgt.narrow(0, rows * d, rows)?);
            let _lp = loss_parallel::enable(&mesh["tp"]);
            let mut m = Measured { peak: 0, backward_rise: 0 };
            for _ in 0..2 {
                let mut logits = None;
                let loss = step_measured(rank, base, &mut m, || {
                    let l = model.logits(&ids, None)?.reshape(&[-1, cfg.vocab_size as isize])?;
                    let loss = l.cross_entropy(&tgt.reshape([tgt.numel()])?, -100)?;
                    logits = Some(l);
                    Ok(loss)
                })?;
                opt.step()?;
                opt.zero_grad();
                // The trainers drop the logits and the loss (and so the graph) here.
                drop((logits, loss));
            }
            m.peak = m.peak.max(memory::peak(rank) - base);
            Ok(m)
        },
    )
    .unwrap()
}

/// Each rank's peak over building the model and two training steps at cp x tp
/// (context-parallel ring attention; the Megatron plan when `tp > 1`, whose loss is
/// vocab-sharded and scaled by the rank's token share).
fn measure_cp(cp: usize, tp: usize) -> Vec<i64> {
    measure_cp_with(config(), BATCH, SEQ, cp, tp, CpMethod::Ring, &AcPolicy::None)
}

/// [`measure_cp`] for model `cfg`, `batch` sequences of `seq` tokens, the cp `method` and
/// the checkpointing policy `ac`.
fn measure_cp_with(
    cfg: LlamaConfig,
    batch_rows: usize,
    seq: usize,
    cp: usize,
    tp: usize,
    method: CpMethod,
    ac: &AcPolicy,
) -> Vec<i64> {
    let threads = RankThreads::per_rank(cp * tp);
    measure_cp_steps(cfg, batch_rows, seq, cp, tp, method, ac, threads)
        .iter()
        .map(|m| m.peak)
        .collect()
}

/// [`measure_cp_with`] on the rank kernel pools `threads`, with each rank's backward rise.
#[allow(clippy::too_many_arguments)]
fn measure_cp_steps(
    cfg: LlamaConfig,
    batch_rows: usize,
    seq: usize,
    cp: usize,
    tp: usize,
    method: CpMethod,
    ac: &AcPolicy,
    threads: RankThreads,
) -> Vec<Measured> {
    use tpar::dtensor::CpLayout;
    use tpar::models::context_parallel::{
        all_reduce_gradients, apply_context_parallel, cp_token_share,
    };
    let ac = ac.clone();
    spawn_scoped(
        SpawnConfig::new(cp * tp).timeout(Duration::from_secs(120)).threads(threads),
        move |ctx| -> tpar::Result<Measured> {
            let rank = ctx.rank();
            let base = memory::current(rank);
            memory::reset_peak(rank);
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[cp, tp], &["cp", "tp"])?;
            let g = mesh.group_of("cp")?.clone();
            let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
            if tp > 1 {
                parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())?;
            }
            apply_activation_checkpointing(&mut model, &ac)?;
            reset_parameters(&mut model, Device::Cpu, 3)?;
            apply_context_parallel(&mut model, &g, method)?;
            let mut opt = AdamW::with_names(named_parameters(&model), AdamWConfig::default())?;
            let layout = CpLayout::new(seq, cp)?;
            let (ids, tgt) = batch_of(batch_rows, seq, cfg.vocab_size);
            let ids = layout.shard(&ids, 1, g.rank())?;
            let tgt = layout.shard(&tgt, 1, g.rank())?;
            let tgt = tgt.reshape([tgt.numel()])?;
            let share = cp_token_share(&tgt, -100, &g)?;
            let _lp = loss_parallel::enable(&mesh["tp"]);
            let mut m = Measured { peak: 0, backward_rise: 0 };
            for _ in 0..2 {
                let mut logits = None;
                let loss = step_measured(rank, base, &mut m, || {
                    let l = model.logits(&ids, None)?.reshape(&[-1, cfg.vocab_size as isize])?;
                    let loss = l.cross_entropy(&tgt, -100)?.mul_scalar(share)?;
                    logits = Some(l);
                    Ok(loss)
                })?;
                all_reduce_gradients(&model, &g)?;
                opt.step()?;
                opt.zero_grad();
                drop((logits, loss));
            }
            m.peak = m.peak.max(memory::peak(rank) - base);
            Ok(m)
        },
    )
    .unwrap()
}

/// Each pp rank's peak over building its stage and two 1F1B steps of `m` micro-batches.
fn measure_pp(m: usize) -> Vec<i64> {
    measure_pp_with(config(), BATCH, ScheduleKind::OneFOneB, 1, m)
}

/// Each of 2 pp ranks' peak over building its `v` stages (stages `r`, `r + 2`, ...) of
/// model `cfg` and two `kind` steps of `m` micro-batches on `rows` sequences of `SEQ`.
fn measure_pp_with(
    cfg: LlamaConfig,
    rows: usize,
    kind: ScheduleKind,
    v: usize,
    m: usize,
) -> Vec<i64> {
    spawn_scoped(
        SpawnConfig::new(2).timeout(Duration::from_secs(120)),
        move |ctx| -> tpar::Result<i64> {
            let rank = ctx.rank();
            let base = memory::current(rank);
            memory::reset_peak(rank);
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["pp"])?;
            let r = mesh.local_rank();
            let (mut stages, mut params) = (Vec::new(), Vec::new());
            for j in 0..v {
                let s = r + 2 * j;
                let mut stage = LlamaStage::for_stage(&cfg, s, 2 * v, None, Device::Meta)?;
                reset_parameters(&mut stage, Device::Cpu, 3)?;
                params.extend(named_parameters(&stage));
                stages.push(PipelineStage::new(stage, s, 2 * v, &mesh, Device::Cpu)?);
            }
            let mut opt = AdamW::with_names(params, AdamWConfig::default())?;
            let vocab = cfg.vocab_size as isize;
            let loss_fn = move |logits: &Value, t: &Tensor| -> tpar::nn::Result<Value> {
                logits.reshape(&[-1, vocab])?.cross_entropy(&t.reshape([t.numel()])?, -100)
            };
            let mut sched = PipelineSchedule::new(kind, stages, m, loss_fn)?;
            let (ids, tgt) = batch(rows, cfg.vocab_size);
            for _ in 0..2 {
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
    predicted: Vec<tpar::models::memory::MemoryEstimate>,
    measured: Vec<i64>,
}

#[test]
fn predicted_peak_is_within_15_percent_of_the_measured_one() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(memory::is_tracking());
    let cfg = config();
    let base = MemoryConfig::new(cfg, BATCH, SEQ);
    let mut cases = Vec::new();

    let predict_all = |c: &MemoryConfig, ranks: usize| -> Vec<_> {
        (0..ranks).map(|r| predict_memory_stage(c, r * c.pp / ranks).unwrap()).collect()
    };

    cases.push(Case {
        name: "single rank",
        predicted: predict_all(&base, 1),
        measured: measure_2d(1, 1, &AcPolicy::None),
    });
    let fsdp_tp = MemoryConfig {
        dp: 2,
        tp: 2,
        data_parallel: DataParallelMode::Fsdp { param_dtype: None },
        plan: TpPlan::SequenceParallel,
        ..base.clone()
    };
    cases.push(Case {
        name: "2x2 FSDP x TP (sp)",
        predicted: predict_all(&fsdp_tp, 4),
        measured: measure_2d(2, 2, &AcPolicy::None),
    });
    let pp =
        MemoryConfig { pp: 2, microbatches: 2, schedule: ScheduleKind::OneFOneB, ..base.clone() };
    cases.push(Case {
        name: "pp 2, 1F1B, 2 micro-batches",
        predicted: predict_all(&pp, 2),
        measured: measure_pp(2),
    });
    let cp2 = MemoryConfig { cp: 2, ..base.clone() };
    cases.push(Case {
        name: "cp 2 (ring)",
        predicted: predict_all(&cp2, 2),
        measured: measure_cp(2, 1),
    });
    let cp2_tp2 = MemoryConfig { cp: 2, tp: 2, plan: TpPlan::Megatron, ..base.clone() };
    cases.push(Case {
        name: "cp 2 x tp 2 (ring, megatron)",
        predicted: predict_all(&cp2_tp2, 4),
        measured: measure_cp(2, 2),
    });
    let cp2_ag = MemoryConfig { cp: 2, cp_method: CpMethod::AllGather, ..base.clone() };
    cases.push(Case {
        name: "cp 2 (all-gather)",
        predicted: predict_all(&cp2_ag, 2),
        measured: measure_cp_with(cfg, BATCH, SEQ, 2, 1, CpMethod::AllGather, &AcPolicy::None),
    });
    let cp2_ag_full = MemoryConfig { ac: AcPolicy::full(), ..cp2_ag.clone() };
    cases.push(Case {
        name: "cp 2 (all-gather), full AC",
        predicted: predict_all(&cp2_ag_full, 2),
        measured: measure_cp_with(cfg, BATCH, SEQ, 2, 1, CpMethod::AllGather, &AcPolicy::full()),
    });
    let full = MemoryConfig { ac: AcPolicy::full(), ..base.clone() };
    cases.push(Case {
        name: "full AC",
        predicted: predict_all(&full, 1),
        measured: measure_2d(1, 1, &AcPolicy::full()),
    });
    let selective = MemoryConfig { ac: AcPolicy::selective(), ..base.clone() };
    cases.push(Case {
        name: "selective AC",
        predicted: predict_all(&selective, 1),
        measured: measure_2d(1, 1, &AcPolicy::selective()),
    });
    // Long sequences and a small MLP: attention's backward is a layer's largest
    // transient. Each also checks the second step's backward rise (below). One kernel
    // thread per rank runs the attention backward's tasks in a fixed order, so the peak
    // is the same from run to run (on more threads it varies with the order).
    let mut attention_rows = Vec::new();
    let one = RankThreads::PerRank(1);
    let long = long_config(2, 2);
    let run = MemoryConfig { host_threads: Some(1), ..MemoryConfig::new(long, BATCH, LONG_SEQ) };
    attention_rows.push((
        "seq 1024, hidden 128, mlp 128, 2 heads",
        predict_all(&run, 1),
        measure_2d_steps(long, BATCH, LONG_SEQ, 1, 1, &AcPolicy::None, one),
    ));
    let gqa = long_config(8, 2);
    let run = MemoryConfig { host_threads: Some(1), ..MemoryConfig::new(gqa, 1, LONG_SEQ) };
    attention_rows.push((
        "seq 1024, hidden 128, mlp 128, 8 heads / 2 kv heads, batch 1",
        predict_all(&run, 1),
        measure_2d_steps(gqa, 1, LONG_SEQ, 1, 1, &AcPolicy::None, one),
    ));
    let cp_long = long_config(4, 4);
    let run = MemoryConfig {
        cp: 2,
        host_threads: Some(1),
        ..MemoryConfig::new(cp_long, BATCH, LONG_SEQ)
    };
    attention_rows.push((
        "seq 1024, hidden 128, mlp 128, 4 heads, cp 2 (ring)",
        predict_all(&run, 2),
        measure_cp_steps(cp_long, BATCH, LONG_SEQ, 2, 1, CpMethod::Ring, &AcPolicy::None, one),
    ));
    for (name, predicted, measured) in &attention_rows {
        cases.push(Case {
            name,
            predicted: predicted.clone(),
            measured: measured.iter().map(|m| m.peak).collect(),
        });
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
                e.abs() <= 0.15,
                "{} rank {r}: predicted {:.1} MiB, measured {:.1} MiB ({:+.1} %)",
                c.name,
                mib(p.peak as f64),
                mib(m as f64),
                100.0 * e
            );
        }
    }
    // The backward of the attention rows rises by the gradients and attention's backward
    // (the GEMM workspace is held from the forward on): within 15 % on the rank that
    // rises most (what the model predicts; a cp rank's rise moves by up to 1 MiB from run
    // to run with the timing of the copies the other rank sent it), where a model that
    // took the MLP's input gradients for the largest transient misses by a third.
    println!(
        "| configuration | predicted backward rise MiB | measured MiB (highest rank) | error |"
    );
    for (name, predicted, measured) in &attention_rows {
        let p = predicted.iter().max_by_key(|p| p.gradients + p.transient).unwrap();
        assert!(p.transient_what.contains("attention"), "{name}: {p}");
        let want = (p.gradients + p.transient - HOST_GEMM_WORKSPACE) as f64;
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
    // The highest stage is what predict_memory reports.
    assert_eq!(
        predict_memory(&pp).unwrap().peak,
        cases[2].predicted.iter().map(|p| p.peak).max().unwrap()
    );
}

/// Predicted and measured peaks of two configurations per rank, their differences, and
/// each peak's error; panics naming `what` when a peak misses by more than 15 % or the
/// predicted difference misses the measured one by more than `diff_tol` of the predicted
/// one (the measured peaks move by up to 1 MiB from run to run with the rank threads'
/// timing).
fn check_difference(
    what: &str,
    (pa, ma): (&[tpar::models::memory::MemoryEstimate], &[i64]),
    (pb, mb): (&[tpar::models::memory::MemoryEstimate], &[i64]),
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
    let m1 = measure_pp_with(cfg, rows, ScheduleKind::OneFOneB, 1, 4);
    let mi = measure_pp_with(cfg, rows, ScheduleKind::Interleaved1F1B, 2, 4);
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
    let ring = MemoryConfig { cp: 2, ..MemoryConfig::new(cfg, BATCH, seq) };
    let gather = MemoryConfig { cp_method: CpMethod::AllGather, ..ring.clone() };
    let (pr, pg) = (predict(&ring), predict(&gather));
    for p in pr.iter().chain(&pg) {
        println!("    {p}");
    }
    let mr = measure_cp_with(cfg, BATCH, seq, 2, 1, CpMethod::Ring, &AcPolicy::None);
    let mg = measure_cp_with(cfg, BATCH, seq, 2, 1, CpMethod::AllGather, &AcPolicy::None);
    check_difference("cp 2, seq 2048, ring -> all-gather", (&pr, &mr), (&pg, &mg), 0.3);
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
                    let out = sdpa()?;
                    let base = memory::current(rank);
                    memory::reset_peak(rank);
                    out.backward_with(&dout)?;
                    Ok(memory::peak(rank) - base)
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
