//! Pipeline schedules side by side: GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1)
//! on the same model, ranks as threads.
//!
//! Model (default): the `llama_pp` example's Llama (hidden 64, 4 query / 2 kv heads, MLP
//! 176, seq 64, byte-tokenizer vocabulary of 259, f32) with 8 decoder layers, on pp = 4
//! rank threads: 4 stages of 2 layers (interleaved: 8 stages of 1 layer, 2 per rank), 8
//! micro-batches of 2 sequences (a batch of 16), synthetic token ids, cross-entropy loss.
//! The four pipelines live side by side on the same rank threads and take their steps in
//! turns (the order rotating each round), so a slow spell of the shared machine falls on
//! all of them: 2 warm-up rounds, then N timed rounds, each step after a barrier on the
//! world group so every rank starts it together. A step is forward + backward of every
//! micro-batch (gradients cleared before it, no optimizer step). Reported per schedule:
//!
//! - `s/step`: the median of rank 0's wall time per timed step, and its ratio to GPipe's
//!   in the same run;
//! - the peak bytes above the step's start on each rank (tracking allocator: allocations
//!   of the rank's own thread; the rayon workers' scratch is not attributed to a rank),
//!   the maximum over the timed steps;
//! - the measured bubble fraction of the last step (`gather_timeline()?.bubble_fraction()`:
//!   idle time between actions over pp x makespan) and the median over the timed steps;
//!   the schedule's simulated bubble with F = I = W = 1 (`Schedule::bubble`); and the
//!   classic `(p - 1) / (m + p - 1)` (`classic_bubble`).
//!
//! `--sleep-ms K` replaces the Llama by stages of one `[8, 8]` matmul whose forward,
//! input-gradient and weight-gradient parts each sleep (a full backward sleeps twice), so
//! a rank's work is time that does not compete for the cores and the measured timeline
//! shows the schedule's own shape. Each rank does the same work under every schedule: a
//! part sleeps K ms on a rank's single stage, K / 2 ms on each of interleaved's two.
//!
//! Run: `cargo bench --bench pipeline`. Options after `--`: `--quick` (or
//! `TPAR_BENCH_QUICK=1`: 3 timed rounds), `--steps N` (timed rounds, default 10),
//! `--microbatches M` (default 8), `--pp P` (default 4), `--sleep-ms K`, `--timeline`
//! (print each schedule's measured last step on every rank). One `summary:` line per
//! schedule repeats its row as `key=value` pairs.

use std::time::{Duration, Instant};

use tpar::pipeline::classic_bubble;
use tpar::prelude::*;
use tpar::tensor::autograd::{apply, needs_input_grad, Function};
use tpar::tensor::memory;

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

const WARMUP: usize = 2;
const MIB: f64 = (1 << 20) as f64;

struct Opts {
    steps: usize,
    microbatches: usize,
    pp: usize,
    sleep_ms: Option<f64>,
    timeline: bool,
}

fn opts() -> Opts {
    let argv: Vec<String> = std::env::args().collect();
    let value = |flag: &str| argv.iter().position(|a| a == flag).and_then(|i| argv.get(i + 1));
    let quick = argv.iter().any(|a| a == "--quick")
        || std::env::var("TPAR_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let num = |flag: &str, default: usize| {
        value(flag).and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or(default)
    };
    Opts {
        steps: num("--steps", if quick { 3 } else { 10 }),
        microbatches: num("--microbatches", 8),
        pp: num("--pp", 4),
        sleep_ms: value("--sleep-ms").and_then(|v| v.parse::<f64>().ok()).filter(|&k| k > 0.0),
        timeline: argv.iter().any(|a| a == "--timeline"),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[s.len() / 2]
}

// ---------------------------------------------------------------------------------
// The sleeping stage.

/// `y = x W` whose forward, input-gradient and weight-gradient parts each sleep `sleep`.
struct SleepMatmul {
    sleep: Duration,
    saved: Option<(Tensor, Tensor)>,
}

impl Function for SleepMatmul {
    fn name(&self) -> &'static str {
        "sleep_matmul"
    }
    fn forward(&mut self, x: &[Tensor]) -> tpar::tensor::Result<Tensor> {
        std::thread::sleep(self.sleep);
        self.saved = Some((x[0].clone(), x[1].clone()));
        x[0].matmul(&x[1])
    }
    fn backward(&self, g: &Tensor) -> tpar::tensor::Result<Vec<Option<Tensor>>> {
        let (x, w) = self.saved.as_ref().expect("forward ran");
        let gx = if needs_input_grad(0) {
            std::thread::sleep(self.sleep);
            Some(g.matmul_t(w, false, true)?)
        } else {
            None
        };
        let gw = if needs_input_grad(1) {
            std::thread::sleep(self.sleep);
            Some(x.matmul_t(g, true, false)?)
        } else {
            None
        };
        Ok(vec![gx, gw])
    }
}

/// A stage of one [`SleepMatmul`].
struct Sleepy {
    core: tpar::nn::ModuleCore,
    w: Param,
    sleep: Duration,
}

impl Sleepy {
    fn new(d: usize, sleep: Duration, seed: u64) -> tpar::Result<Sleepy> {
        let mut rng = Rng::new(seed);
        let w = Tensor::randn([d, d], DType::F32, &mut rng)?.mul_scalar(0.3)?;
        Ok(Sleepy { core: Default::default(), w: Param::Tensor(w.requires_grad_(true)), sleep })
    }
}

impl Module for Sleepy {
    fn type_name(&self) -> &'static str {
        "Sleepy"
    }
    fn forward(&self, args: Args) -> tpar::nn::Result<Value> {
        let x = args.get(0).into_tensor("Sleepy")?;
        let w = self.w.trainable();
        Ok(Value::Tensor(apply(SleepMatmul { sleep: self.sleep, saved: None }, &[&x, &w])?))
    }
    fn params(&self) -> Vec<(&'static str, &Param)> {
        vec![("weight", &self.w)]
    }
    tpar::nn::module_boilerplate!();
}

const SLEEPY_DIM: usize = 8;

// ---------------------------------------------------------------------------------
// The Llama model.

const LAYERS: usize = 8;
const SEQ: usize = 64;
const ROWS_PER_MB: usize = 2;

fn llama_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: ByteTokenizer::VOCAB_SIZE,
        max_position_embeddings: SEQ,
        hidden_size: 64,
        intermediate_size: 176,
        num_hidden_layers: LAYERS,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        dtype: DType::F32,
    }
}

/// Token ids `[rows, seq]` and targets, from a fixed pattern.
fn tokens(rows: usize, seq: usize, vocab: usize) -> tpar::Result<(Tensor, Tensor)> {
    let ids: Vec<i64> = (0..rows * seq).map(|i| ((i * 7 + i / seq * 3) % vocab) as i64).collect();
    let tgt: Vec<i64> = (1..=rows * seq).map(|i| ((i * 7 + i / seq * 3) % vocab) as i64).collect();
    Ok((Tensor::from_vec(ids, [rows, seq])?, Tensor::from_vec(tgt, [rows, seq])?))
}

// ---------------------------------------------------------------------------------
// The runs.

/// What one rank measured for one schedule.
#[derive(Default)]
struct RankOut {
    step_s: Vec<f64>,
    peak_bytes: i64,
    bubbles: Vec<f64>,
    bubble_last: f64,
    bubble_sim: f64,
    rendered: String,
}

struct Row {
    kind: ScheduleKind,
    stages: usize,
    s_per_step: f64,
    peaks_mib: Vec<f64>,
    bubble_last: f64,
    bubble_median: f64,
    bubble_sim: f64,
    bubble_classic: f64,
}

/// This rank's stages of `kind`'s pipeline (stage `s` on rank `s % pp`).
fn build_stages(
    kind: ScheduleKind,
    o: &Opts,
    cfg: &LlamaConfig,
    mesh: &DeviceMesh,
) -> tpar::Result<Vec<PipelineStage>> {
    let pp = o.pp;
    let per_rank = kind.default_stages_per_rank();
    let num_stages = pp * per_rank;
    let rank = mesh.local_rank();
    (0..per_rank)
        .map(|j| {
            let s = rank + j * pp;
            Ok(match o.sleep_ms {
                Some(k) => {
                    let sleep = Duration::from_secs_f64(k * 1e-3 / per_rank as f64);
                    let module = Sleepy::new(SLEEPY_DIM, sleep, s as u64)?;
                    PipelineStage::new(module, s, num_stages, mesh, Device::Cpu)?
                }
                None => {
                    let mut module = LlamaStage::for_stage(cfg, s, num_stages, None, Device::Meta)?;
                    reset_parameters(&mut module, Device::Cpu, 42)?;
                    PipelineStage::new(module, s, num_stages, mesh, Device::Cpu)?
                }
            })
        })
        .collect()
}

/// Every schedule of `kinds` on the same rank threads, their steps taken in turns (the
/// order rotating each round), so that a slow spell of the machine falls on all of them.
fn run_all(kinds: &[ScheduleKind], o: &Opts) -> tpar::Result<Vec<Row>> {
    let pp = o.pp;
    let m = o.microbatches;
    let cfg = llama_config();
    let rows = m * ROWS_PER_MB;
    let (ids, tgt) = match o.sleep_ms {
        None => tokens(rows, SEQ, cfg.vocab_size)?,
        Some(_) => {
            let x: Vec<f32> =
                (0..rows * SLEEPY_DIM).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
            let x = Tensor::from_vec(x, [rows, SLEEPY_DIM])?;
            (x.clone(), x)
        }
    };
    let out =
        tpar::spawn_scoped(tpar::SpawnConfig::new(pp), |ctx| -> tpar::Result<Vec<RankOut>> {
            let rank = ctx.rank();
            let world = ctx.world_group();
            let mesh = DeviceMesh::new(&world, DeviceType::Cpu, &[pp], &["pp"])?;
            let mut pipes = Vec::with_capacity(kinds.len());
            for &kind in kinds {
                let stages = build_stages(kind, o, &cfg, &mesh)?;
                let pipe = match o.sleep_ms {
                    Some(_) => {
                        PipelineSchedule::new(kind, stages, m, |out: &Value, _t: &Tensor| {
                            Ok(Value::Tensor(
                                out.clone().into_tensor("loss")?.square()?.mean_all()?,
                            ))
                        })?
                    }
                    None => {
                        let vocab = cfg.vocab_size as isize;
                        PipelineSchedule::new(
                            kind,
                            stages,
                            m,
                            move |logits: &Value, t: &Tensor| {
                                logits
                                    .reshape(&[-1, vocab])?
                                    .cross_entropy(&t.reshape([t.numel()])?, -100)
                            },
                        )?
                    }
                };
                let params = pipe.parameters();
                pipes.push((pipe, params));
            }
            let mut outs: Vec<RankOut> = kinds.iter().map(|_| RankOut::default()).collect();
            for round in 0..WARMUP + o.steps {
                let timed = round >= WARMUP;
                for turn in 0..pipes.len() {
                    let i = (round + turn) % pipes.len();
                    let (pipe, params) = &mut pipes[i];
                    params.iter().for_each(Param::zero_grad);
                    world.barrier()?;
                    let before = memory::current(rank);
                    memory::reset_peak(rank);
                    let t = Instant::now();
                    pipe.step(Some(&ids), Some(&tgt))?;
                    let secs = t.elapsed().as_secs_f64();
                    let peak = memory::peak(rank) - before;
                    if timed {
                        let out = &mut outs[i];
                        out.step_s.push(secs);
                        out.peak_bytes = out.peak_bytes.max(peak);
                        out.bubbles.push(pipe.gather_timeline()?.bubble_fraction());
                    }
                }
            }
            for ((pipe, _), out) in pipes.iter().zip(&mut outs) {
                let timeline = pipe.gather_timeline()?;
                out.bubble_last = timeline.bubble_fraction();
                out.bubble_sim = pipe.schedule().bubble();
                if o.timeline && rank == 0 {
                    out.rendered = timeline.render();
                }
            }
            Ok(outs)
        })?;
    let rows = kinds
        .iter()
        .enumerate()
        .map(|(i, &kind)| {
            let r0 = &out[0][i];
            if o.timeline {
                println!("{kind}: measured timeline of the last step\n{}", r0.rendered);
            }
            Row {
                kind,
                stages: pp * kind.default_stages_per_rank(),
                s_per_step: median(&r0.step_s),
                peaks_mib: out.iter().map(|r| r[i].peak_bytes as f64 / MIB).collect(),
                bubble_last: r0.bubble_last,
                bubble_median: median(&r0.bubbles),
                bubble_sim: r0.bubble_sim,
                bubble_classic: classic_bubble(pp, m),
            }
        })
        .collect();
    Ok(rows)
}

/// The 1-minute load average (other processes on a shared machine show up here).
fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn main() -> tpar::Result<()> {
    let o = opts();
    let load0 = loadavg();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = match o.sleep_ms {
        Some(k) => format!(
            "sleeping stages: forward, input grad and weight grad {k} ms per rank per micro-batch ([{SLEEPY_DIM}, {SLEEPY_DIM}] matmul)"
        ),
        None => format!(
            "Llama hidden 64, {LAYERS} layers, 4/2 heads, MLP 176, seq {SEQ}, vocab {}, f32",
            ByteTokenizer::VOCAB_SIZE
        ),
    };
    println!(
        "pipeline: pp {} rank threads on {cores} cores (1-min load average {load0:.2}), {} micro-batches of {ROWS_PER_MB} sequences, {model}; {WARMUP} warm-up + {} timed steps per schedule, in turns",
        o.pp, o.microbatches, o.steps
    );
    let mut kinds = Vec::new();
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZeroBubble,
    ] {
        match Schedule::build(kind, o.pp, kind.default_stages_per_rank(), o.microbatches) {
            Ok(_) => kinds.push(kind),
            Err(e) => println!("{kind}: skipped ({e})"),
        }
    }
    let rows = run_all(&kinds, &o)?;
    let gpipe = rows.iter().find(|r| r.kind == ScheduleKind::GPipe).map(|r| r.s_per_step);
    let ratio = |r: &Row| gpipe.map_or(f64::NAN, |g| r.s_per_step / g);
    let list = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(", ");
    println!();
    println!(
        "| schedule | stages | s/step (median) | vs GPipe | peak MiB above step start, per rank | bubble (last step) | bubble (median) | simulated | (p-1)/(m+p-1) |"
    );
    println!("|---|---:|---:|---:|---|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.4} | {:.2} | [{}] | {:.3} | {:.3} | {:.3} | {:.3} |",
            r.kind,
            r.stages,
            r.s_per_step,
            ratio(r),
            list(&r.peaks_mib),
            r.bubble_last,
            r.bubble_median,
            r.bubble_sim,
            r.bubble_classic
        );
    }
    println!("1-min load average at the end: {:.2}", loadavg());
    println!();
    let mode = o.sleep_ms.map_or("llama".to_string(), |k| format!("sleep{k}ms"));
    for r in &rows {
        println!(
            "summary: mode={mode} schedule={} pp={} microbatches={} steps={} s_per_step={:.4} vs_gpipe={:.3} peak_mib=[{}] bubble={:.3} bubble_median={:.3} bubble_sim={:.3} bubble_classic={:.3}",
            r.kind,
            o.pp,
            o.microbatches,
            o.steps,
            r.s_per_step,
            ratio(r),
            list(&r.peaks_mib),
            r.bubble_last,
            r.bubble_median,
            r.bubble_sim,
            r.bubble_classic
        );
    }
    Ok(())
}
