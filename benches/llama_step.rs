//! One training step of a small Llama in every parallel configuration on this machine,
//! next to tpar's own single-rank step and (when given its numbers) PyTorch's.
//!
//! Model: hidden 256, 4 decoder layers, 8 query / 4 kv heads, MLP 768, vocab 4096, seq
//! 256, f32, random token ids, a global batch of 8 sequences split over dp. A step:
//! forward, cross-entropy (`loss_parallel` when tp > 1), backward, `clip_grad_norm_(1.0)`,
//! AdamW (lr 1e-3, betas (0.9, 0.99), eps 1e-8, weight decay 0.1), `zero_grad`, as in
//! `benches/torch_llama_step.py`, PyTorch's side of the same steps.
//!
//! Configurations (ranks as threads of this process; `--configs a,b,..`, default all):
//! `single`, `tp2-sp` and `tp2-megatron` (the two layer plans of `tpar::models`),
//! `dp2-fsdp` (`fully_shard` per decoder layer, on the base model and on the root),
//! `2x2-sp-fsdp` and `2x2-megatron-fsdp` (a (dp, tp) mesh, both).
//!
//! Each configuration runs `--warmup` steps (default 3) and `--steps` timed steps
//! (default 10), each after a barrier; reported: rank 0's median step time, tokens/s,
//! and the ratio to tpar's single-rank step measured in the same run. With `--torch
//! PATH` (the JSON `torch_llama_step.py --json PATH` writes), also the ratio to
//! PyTorch's step. `--pools shared|per-rank|both` (default `per-rank`, the default of
//! `SpawnConfig`): each rank runs in a rayon pool of its own of `max(1, cores / ranks)`
//! threads, or the rank threads share the global pool (`both` measures the two in one
//! run, alternating per configuration, each ratio against the single rank of the same
//! pools).
//! `--rounds N` (default 1) runs the whole list N times in turn, so that a slow minute
//! of a noisy machine falls on every configuration alike: each round's ratio is taken
//! against the single rank of the same round, and a row reports the medians over the
//! rounds of its step time and of that ratio, the ratio's range, and its fastest step
//! of all rounds against the single rank's fastest.
//!
//! Run: `cargo bench --bench llama_step`, or for the PyTorch comparison:
//! `python3 benches/torch_llama_step.py --json /tmp/torch.json` then
//! `cargo bench --bench llama_step -- --torch /tmp/torch.json`.
//! One `summary:` line per measured configuration repeats its row as `key=value` pairs.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tpar::prelude::*;

const HIDDEN: usize = 256;
const LAYERS: usize = 4;
const SEQ: usize = 256;
const VOCAB: usize = 4096;
const BATCH: usize = 8;

/// (name, dp, tp, layer plan, FSDP).
const CONFIGS: [(&str, usize, usize, Option<&str>, bool); 6] = [
    ("single", 1, 1, None, false),
    ("tp2-sp", 1, 2, Some("sp"), false),
    ("tp2-megatron", 1, 2, Some("megatron"), false),
    ("dp2-fsdp", 2, 1, None, true),
    ("2x2-sp-fsdp", 2, 2, Some("sp"), true),
    ("2x2-megatron-fsdp", 2, 2, Some("megatron"), true),
];

struct Opts {
    configs: Vec<String>,
    warmup: usize,
    steps: usize,
    torch: BTreeMap<String, f64>,
    pools: Vec<bool>,
    rounds: usize,
}

fn opts() -> Result<Opts> {
    let argv: Vec<String> = std::env::args().collect();
    let value = |flag: &str| argv.iter().position(|a| a == flag).and_then(|i| argv.get(i + 1));
    let num = |flag: &str, default: usize| -> Result<usize> {
        value(flag).map_or(Ok(default), |v| {
            v.parse().map_err(|_| bad(format!("{flag} takes a number, not {v:?}")))
        })
    };
    let quick =
        argv.iter().any(|a| a == "--quick") || std::env::var_os("TPAR_BENCH_QUICK").is_some();
    let configs: Vec<String> = match value("--configs") {
        Some(list) => list.split(',').map(String::from).collect(),
        None => CONFIGS.iter().map(|c| c.0.to_string()).collect(),
    };
    if let Some(c) = configs.iter().find(|c| !CONFIGS.iter().any(|k| k.0 == c.as_str())) {
        let known: Vec<&str> = CONFIGS.iter().map(|k| k.0).collect();
        return Err(bad(format!("unknown configuration {c:?} (known: {})", known.join(", "))));
    }
    let torch = match value("--torch") {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| bad(format!("cannot read {path}: {e}")))?;
            serde_json::from_str(&text).map_err(|e| bad(format!("{path}: {e}")))?
        }
        None => BTreeMap::new(),
    };
    let pools = match value("--pools").map(String::as_str) {
        Some("shared") => vec![false],
        None | Some("per-rank") => vec![true],
        Some("both") => vec![false, true],
        Some(other) => {
            return Err(bad(format!("--pools takes shared|per-rank|both, not {other:?}")))
        }
    };
    Ok(Opts {
        configs,
        warmup: num("--warmup", 3)?,
        steps: num("--steps", if quick { 3 } else { 10 })?.max(1),
        torch,
        pools,
        rounds: num("--rounds", 1)?.max(1),
    })
}

fn bad(message: String) -> Error {
    Error::from(TensorError::InvalidArgument { op: "llama_step", what: message })
}

/// Deterministic token ids in `[0, VOCAB)`, the same on every rank.
fn tokens(n: usize) -> Vec<i64> {
    let mut rng = Rng::new(1);
    (0..n).map(|_| rng.below(VOCAB as u64) as i64).collect()
}

/// Rank 0's step times of one configuration.
fn run(
    (dp, tp, plan, fsdp): (usize, usize, Option<&str>, bool),
    o: &Opts,
    per_rank_pool: bool,
) -> Result<Vec<f64>> {
    let world = dp * tp;
    let threads = if per_rank_pool { RankThreads::per_rank(world) } else { RankThreads::Shared };
    let config = SpawnConfig::new(world).timeout(Duration::from_secs(600)).threads(threads);
    let (warmup, steps) = (o.warmup, o.steps);
    let times = spawn_scoped(config, |ctx| -> Result<Vec<f64>> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
        let cfg = LlamaConfig {
            vocab_size: VOCAB,
            max_position_embeddings: SEQ,
            hidden_size: HIDDEN,
            intermediate_size: 768,
            num_hidden_layers: LAYERS,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            dtype: DType::F32,
        };
        let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
        if let Some(plan) = plan {
            let plan =
                if plan == "sp" { sequence_parallel_layer_plan() } else { megatron_layer_plan() };
            parallelize_llama(&mut model, &mesh["tp"], &plan)?;
        }
        if fsdp {
            let c = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &c)?;
            }
            fully_shard(&mut model.base_model, &mesh["dp"], &c)?;
            fully_shard(&mut model, &mesh["dp"], &c)?;
        }
        reset_parameters(&mut model, Device::Cpu, 0)?;
        let params = parameters(&model);
        let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::with_names(named_parameters(&model), adamw)?;
        let per = BATCH / dp;
        let dp_rank = mesh["dp"].local_rank();
        let all = tokens(BATCH * (SEQ + 1));
        let mine = &all[dp_rank * per * (SEQ + 1)..(dp_rank + 1) * per * (SEQ + 1)];
        let rows: Vec<&[i64]> = mine.chunks(SEQ + 1).collect();
        let ids: Vec<i64> = rows.iter().flat_map(|r| r[..SEQ].iter().copied()).collect();
        let labels: Vec<i64> = rows.iter().flat_map(|r| r[1..].iter().copied()).collect();
        let ids = Tensor::from_vec(ids, [per, SEQ])?;
        let labels = Tensor::from_vec(labels, [per * SEQ])?;
        let _loss_parallel = loss_parallel::enable(&mesh["tp"]);
        let mut times = Vec::new();
        for i in 0..warmup + steps {
            ctx.world_group().barrier()?;
            let t0 = Instant::now();
            unshard(&model)?;
            let logits = model.logits(&ids, None)?.reshape(&[-1, VOCAB as isize])?;
            let loss = logits.cross_entropy(&labels, -100)?;
            loss.backward()?;
            clip_grad_norm_(&params, 1.0, &ClipOptions::default())?;
            opt.step()?;
            opt.zero_grad();
            if i >= warmup {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    })?;
    Ok(times.into_iter().next().unwrap_or_default())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One row's measurements: per round, the median step time and its ratio to the single
/// rank of the same round and pools; and its fastest step over all rounds.
struct Row {
    secs: Vec<f64>,
    vs_single: Vec<f64>,
    fastest: f64,
}

fn main() -> Result<()> {
    let o = opts()?;
    println!(
        "Llama step (hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, vocab {VOCAB}, global batch {BATCH}, f32): \
         {} warm-up + {} timed steps, median of rank 0, {} round(s)",
        o.warmup, o.steps, o.rounds
    );
    let mut rows: BTreeMap<(usize, bool), Row> = BTreeMap::new();
    for round in 0..o.rounds {
        let mut single: [Option<f64>; 2] = [None, None];
        for (i, name) in o.configs.iter().enumerate() {
            let Some(&(_, dp, tp, plan, fsdp)) = CONFIGS.iter().find(|c| c.0 == name.as_str())
            else {
                continue;
            };
            for &per_rank in &o.pools {
                let times = run((dp, tp, plan, fsdp), &o, per_rank)?;
                let fastest = times.iter().copied().fold(f64::NAN, f64::min);
                let s = median(times);
                if name == "single" {
                    single[usize::from(per_rank)] = Some(s);
                }
                let vs_single = single[usize::from(per_rank)].map_or(f64::NAN, |b| s / b);
                if o.rounds > 1 {
                    let pools = if per_rank { "per-rank" } else { "shared" };
                    println!(
                        "round {}: {name} {pools} {s:.4} s/step, {vs_single:.2} of single",
                        round + 1
                    );
                }
                let row = rows.entry((i, per_rank)).or_insert(Row {
                    secs: Vec::new(),
                    vs_single: Vec::new(),
                    fastest: f64::NAN,
                });
                row.secs.push(s);
                row.vs_single.push(vs_single);
                row.fastest = row.fastest.min(fastest);
            }
        }
    }
    // The fastest single-rank step of each pools setting, over all rounds.
    let mut single_fastest = [f64::NAN; 2];
    for ((i, per_rank), row) in &rows {
        if o.configs[*i] == "single" {
            single_fastest[usize::from(*per_rank)] = row.fastest;
        }
    }
    println!(
        "{:<20} {:>8} {:>10} {:>10} {:>9} {:>11} {:>10} {:>9} {:>10}",
        "configuration",
        "pools",
        "s/step",
        "tokens/s",
        "/ single",
        "range",
        "/ PyTorch",
        "fastest",
        "/ single"
    );
    for ((i, per_rank), row) in rows {
        let name = &o.configs[i];
        let Some(&(_, dp, tp, ..)) = CONFIGS.iter().find(|c| c.0 == name.as_str()) else {
            continue;
        };
        let pools = if per_rank { "per-rank" } else { "shared" };
        let lo = row.vs_single.iter().copied().fold(f64::NAN, f64::min);
        let hi = row.vs_single.iter().copied().fold(f64::NAN, f64::max);
        let (s, vs_single) = (median(row.secs), median(row.vs_single));
        let vs_torch = o.torch.get(name).map_or(f64::NAN, |t| s / t);
        let tokens_per_s = (BATCH * SEQ) as f64 / s;
        let range = format!("{lo:.2}-{hi:.2}");
        let fastest = row.fastest;
        let fastest_vs_single = fastest / single_fastest[usize::from(per_rank)];
        println!(
            "{name:<20} {pools:>8} {s:>10.4} {tokens_per_s:>10.0} {vs_single:>9.2} {range:>11} \
             {vs_torch:>10.2} {fastest:>9.4} {fastest_vs_single:>10.2}"
        );
        println!(
            "summary: config={name} pools={pools} dp={dp} tp={tp} s_per_step={s:.5} \
             tokens_per_s={tokens_per_s:.0} vs_single={vs_single:.3} vs_torch={vs_torch:.3} \
             rounds={} vs_single_min={lo:.3} vs_single_max={hi:.3} fastest_s={fastest:.5} \
             fastest_vs_single={fastest_vs_single:.3}",
            o.rounds
        );
    }
    Ok(())
}
