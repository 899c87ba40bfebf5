//! Context parallelism on CPU ranks as threads: one training step's forward and backward
//! of a causal Llama at long sequence lengths, at cp 1, 2 and 4 on the same cores.
//!
//! Model: hidden 256, 8 query / 4 key-value heads (head dim 32), MLP 688, 2 decoder
//! layers, vocab 256, f32; one sequence (batch 1) of random token ids; world = cp (tp 1,
//! dp 1), each rank holding its head and mirror tail chunks of the sequence
//! (`CpLayout::new`). A step: the logits of this rank's rows, `cp_cross_entropy`,
//! backward, `all_reduce_gradients` over cp, `zero_grad`. At cp 1 the model runs through
//! `apply_context_parallel` too (one rank, no exchange), so attention is the same
//! blockwise kernel at every cp.
//!
//! Each configuration runs `--warmup` steps (default 1) and `--steps` timed steps (default
//! 2), each after a barrier. Reported per configuration: the step time (the slowest rank
//! of each step; median over the timed steps), each rank's peak memory over a step less
//! what it held at the step's start (parameters and gradients: the step's activations
//! and transients), each rank's time in the blockwise attention ops
//! (`tpar::tensor::block_attention_time`: forward, backward and log-sum-exp merges), and
//! the ratios of step time and memory to cp 1 at the same length. The global loss of
//! every configuration is compared with cp 1's (`loss_vs_cp1`: the f32 difference).
//!
//! Run: `cargo bench --bench context_parallel -- [--seqs 16384,32768] [--cps 1,2,4]
//! [--methods ring,all-gather] [--steps N] [--warmup N] [--layers N]`. Key/value exchange
//! methods: `ring` (default) and `all-gather` (`CpMethod`); cp 1 runs once per length
//! (no exchange). One `summary:` line per configuration repeats its row as `key=value`
//! pairs.

use std::time::{Duration, Instant};

use tpar::dtensor::{CpLayout, CpMethod};
use tpar::models::context_parallel::{
    all_reduce_gradients, apply_context_parallel, cp_cross_entropy,
};
use tpar::prelude::*;
use tpar::tensor::{block_attention_time, memory, reset_block_attention_time};

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

const HIDDEN: usize = 256;
const VOCAB: usize = 256;

struct Opts {
    seqs: Vec<usize>,
    cps: Vec<usize>,
    methods: Vec<CpMethod>,
    warmup: usize,
    steps: usize,
    layers: usize,
}

fn fail(what: String) -> Error {
    Error::from(TensorError::InvalidArgument { op: "context_parallel bench", what })
}

fn list<T>(s: &str, f: impl Fn(&str) -> Option<T>) -> Result<Vec<T>> {
    s.split(',')
        .map(|x| f(x.trim()).ok_or_else(|| fail(format!("cannot read {x:?} in {s:?}"))))
        .collect()
}

fn parse_args() -> Result<Opts> {
    let mut o = Opts {
        seqs: vec![16384, 32768],
        cps: vec![1, 2, 4],
        methods: vec![CpMethod::Ring],
        warmup: 1,
        steps: 2,
        layers: 2,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--bench" {
            continue;
        }
        let mut value = || args.next().ok_or_else(|| fail(format!("{a} needs a value")));
        match a.as_str() {
            "--seqs" => o.seqs = list(&value()?, |x| x.parse().ok())?,
            "--cps" => o.cps = list(&value()?, |x| x.parse().ok().filter(|&c: &usize| c > 0))?,
            "--methods" => {
                o.methods = list(&value()?, |x| match x {
                    "ring" => Some(CpMethod::Ring),
                    "all-gather" | "allgather" => Some(CpMethod::AllGather),
                    _ => None,
                })?
            }
            "--warmup" => o.warmup = value()?.parse().map_err(|_| fail("--warmup N".into()))?,
            "--steps" => {
                o.steps = value()?
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| fail("--steps takes a whole number of at least 1".into()))?
            }
            "--layers" => o.layers = value()?.parse().map_err(|_| fail("--layers N".into()))?,
            other => return Err(fail(format!("unknown argument {other:?}"))),
        }
    }
    Ok(o)
}

fn method_name(m: CpMethod) -> &'static str {
    match m {
        CpMethod::Ring => "ring",
        CpMethod::AllGather => "all-gather",
    }
}

/// One rank's figures of one timed step.
#[derive(Clone, Copy, Default)]
struct RankStep {
    secs: f64,
    peak_bytes: i64,
    attention: f64,
    loss: f64,
}

/// Every rank's figures of every timed step (`[rank][step]`).
fn run(seq: usize, cp: usize, method: CpMethod, o: &Opts) -> Result<Vec<Vec<RankStep>>> {
    let config =
        SpawnConfig::new(cp).timeout(Duration::from_secs(3600)).threads(RankThreads::per_rank(cp));
    let (warmup, steps, layers) = (o.warmup, o.steps, o.layers);
    let out = spawn_scoped(config, |ctx| -> Result<Vec<RankStep>> {
        let g = ctx.world_group();
        let rank = g.rank();
        let cfg = LlamaConfig {
            vocab_size: VOCAB,
            max_position_embeddings: seq,
            hidden_size: HIDDEN,
            intermediate_size: 688,
            num_hidden_layers: layers,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            dtype: DType::F32,
        };
        let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
        reset_parameters(&mut model, Device::Cpu, 0)?;
        apply_context_parallel(&mut model, &g, method)?;
        let params = parameters(&model);
        let mut rng = Rng::new(1);
        let all: Vec<i64> = (0..seq + 1).map(|_| rng.below(VOCAB as u64) as i64).collect();
        let layout = CpLayout::new(seq, cp)?;
        let ids = Tensor::from_vec(all[..seq].to_vec(), [1, seq])?;
        let labels = Tensor::from_vec(all[1..].to_vec(), [1, seq])?;
        let ids = layout.shard(&ids, 1, rank)?;
        let labels = layout.shard(&labels, 1, rank)?;
        let n = ids.dims()[1];
        let labels = labels.reshape([n])?;
        let mut res = Vec::new();
        for i in 0..warmup + steps {
            g.barrier()?;
            let start_bytes = memory::current(rank);
            memory::reset_peak(rank);
            reset_block_attention_time();
            let t0 = Instant::now();
            let logits = model.logits(&ids, None)?.into_tensor("logits")?;
            let (loss, global) = cp_cross_entropy(&logits.reshape([n, VOCAB])?, &labels, -100, &g)?;
            drop(logits);
            loss.backward()?;
            drop(loss);
            all_reduce_gradients(&model, &g)?;
            let secs = t0.elapsed().as_secs_f64();
            let peak_bytes = memory::peak(rank) - start_bytes;
            let attention = block_attention_time().total().as_secs_f64();
            for p in &params {
                p.zero_grad();
            }
            if i >= warmup {
                res.push(RankStep { secs, peak_bytes, attention, loss: global });
            }
        }
        Ok(res)
    })?;
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

/// A configuration's medians: step seconds (slowest rank), per rank peak bytes and
/// attention seconds, the loss.
struct Row {
    step: f64,
    peak: Vec<f64>,
    attention: Vec<f64>,
    loss: f64,
}

fn summarize(r: &[Vec<RankStep>]) -> Row {
    let steps = r.first().map_or(0, Vec::len);
    let step =
        median((0..steps).map(|s| r.iter().map(|rk| rk[s].secs).fold(0.0, f64::max)).collect());
    let peak =
        r.iter().map(|rk| median(rk.iter().map(|x| x.peak_bytes as f64).collect())).collect();
    let attention = r.iter().map(|rk| median(rk.iter().map(|x| x.attention).collect())).collect();
    let loss = r.first().and_then(|rk| rk.first()).map_or(f64::NAN, |x| x.loss);
    Row { step, peak, attention, loss }
}

fn main() -> Result<()> {
    let o = parse_args()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "context parallelism: hidden {HIDDEN}, {} layers, 8/4 heads, MLP 688, vocab {VOCAB}, \
         f32, batch 1, causal; {cores} cores, ranks as threads (rayon pool per rank); {} \
         warmup + {} timed steps",
        o.layers, o.warmup, o.steps
    );
    println!(
        "| seq | cp | method | step s | x cp 1 | peak MiB per rank (less params+grads) | x cp 1 \
         | attention s per rank |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &seq in &o.seqs {
        let mut base: Option<(f64, f64, f64)> = None;
        for &cp in &o.cps {
            let methods: &[CpMethod] = if cp == 1 { &[CpMethod::Ring] } else { &o.methods };
            for &m in methods {
                let r = summarize(&run(seq, cp, m, &o)?);
                let max_peak = r.peak.iter().copied().fold(0.0, f64::max);
                if cp == 1 && base.is_none() {
                    base = Some((r.step, max_peak, r.loss));
                }
                let (b_step, b_peak, b_loss) = base.unwrap_or((f64::NAN, f64::NAN, f64::NAN));
                let peaks: Vec<String> = r.peak.iter().map(|&p| format!("{:.0}", mib(p))).collect();
                let atts: Vec<String> = r.attention.iter().map(|a| format!("{a:.2}")).collect();
                let name = if cp == 1 { "-" } else { method_name(m) };
                println!(
                    "| {seq} | {cp} | {name} | {:.2} | {:.2} | {} | {:.2} | {} |",
                    r.step,
                    r.step / b_step,
                    peaks.join(", "),
                    max_peak / b_peak,
                    atts.join(", "),
                );
                println!(
                    "summary: seq={seq} cp={cp} method={name} step_s={:.3} step_vs_cp1={:.3} \
                     peak_mib_max={:.1} peak_vs_cp1={:.3} attention_s=[{}] loss={:.6} \
                     loss_vs_cp1={:.2e}",
                    r.step,
                    r.step / b_step,
                    mib(max_peak),
                    max_peak / b_peak,
                    atts.join(","),
                    r.loss,
                    (r.loss - b_loss).abs(),
                );
            }
        }
    }
    Ok(())
}
