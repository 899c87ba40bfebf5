//! Activation checkpointing policies alternated in one process: step time and peak
//! activation memory of the CPU Llama of docs/PERF.md under each policy.
//!
//! Model: hidden 256, 8 query / 4 key-value heads, MLP 688, 8 decoder layers, vocab 259
//! (the byte tokenizer's), one sequence of 2048 random token ids, f32, one rank (the
//! sizes of the `llama_2d` command in docs/PERF.md). A step: `zero_grad`, logits,
//! cross-entropy, backward, `clip_grad_norm_(1.0)`, AdamW.
//!
//! First every policy computes the loss and gradients of the same parameters, and they
//! must equal the run without checkpointing bit for bit (the bench stops otherwise).
//! Then `--rounds` rounds (default 4): in each, every policy in turn is applied to the
//! model (`apply_activation_checkpointing`) and runs one untimed step and `--steps`
//! timed steps (default 3). Reported per policy: the median step time over all rounds,
//! the median over rounds of its ratio to `none` of the same round (so a slow minute of
//! a busy machine falls on every policy alike), the range of those ratios, and the
//! step's peak (tracking allocator) with and without the parameters, gradients and
//! AdamW state (the activations and the step's transients), and that against `none`
//! (the bench runs as rank 0 of a world of one, as the trainers do, so the peak includes
//! what the rank's kernel threads hold: their GEMM packing buffers);
//! and the step's CPU time (all threads, from `/proc/self/task/*/schedstat`) with the
//! median over rounds of its ratio to `none`'s, which a busy machine moves less than
//! the wall time. Where the time goes: the step's forward (logits and loss) and, with
//! `tpar::tensor::checkpoint::region_times` on, the regions' recomputes and the backward
//! through the recomputed graphs (medians per step), so a policy's extra time can be
//! set against one extra forward of the checkpointed layers.
//!
//! Policies (`--policies`, default `none,selective,full`) are written as `--ac` takes
//! them (`none`, `full`, `full:2`, `selective`, `selective[matmul,sdpa]`, ...); a
//! `+tail` suffix leaves the last decoder layer unchecked (its backward follows its
//! forward at once, so recomputing it saves no memory), through
//! `apply_activation_checkpointing_to`.
//!
//! Run: `cargo bench --bench activation_checkpointing -- [--policies a,b] [--rounds N]
//! [--steps N]`. One `summary:` line per policy repeats its row as `key=value` pairs.

use std::time::Instant;

use tpar::models::memory::recompute_share;
use tpar::prelude::*;
use tpar::tensor::checkpoint::{region_times, reset_region_times, set_region_timing};
use tpar::tensor::memory;

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

const LAYERS: usize = 8;
const SEQ: usize = 2048;
const VOCAB: usize = 259;

struct Opts {
    policies: Vec<String>,
    rounds: usize,
    steps: usize,
}

fn fail(what: String) -> Error {
    Error::from(TensorError::InvalidArgument { op: "activation_checkpointing bench", what })
}

fn parse_args() -> Result<Opts> {
    let mut o = Opts {
        policies: vec!["none".into(), "selective".into(), "full".into()],
        rounds: 4,
        steps: 3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--bench" {
            continue;
        }
        let mut value = || args.next().ok_or_else(|| fail(format!("{a} needs a value")));
        let count = |v: String| {
            v.parse().ok().filter(|&n: &usize| n > 0).ok_or_else(|| fail(format!("{a} {v}")))
        };
        match a.as_str() {
            // Policies contain commas inside brackets: split on commas outside them.
            "--policies" => o.policies = split_policies(&value()?),
            "--rounds" => o.rounds = count(value()?)?,
            "--steps" => o.steps = count(value()?)?,
            other => return Err(fail(format!("unknown argument {other:?}"))),
        }
    }
    Ok(o)
}

/// `a,b[c,d],e` into `a`, `b[c,d]`, `e`.
fn split_policies(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0usize);
    for ch in s.chars() {
        match ch {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    out.push(cur);
    out.into_iter().map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect()
}

/// A policy as written, and whether the last decoder layer stays unchecked.
fn policy_of(s: &str) -> Result<(AcPolicy, bool)> {
    let (p, tail) = match s.strip_suffix("+tail") {
        Some(p) => (p, true),
        None => (s, false),
    };
    Ok((p.parse::<AcPolicy>().map_err(|e| fail(e.to_string()))?, tail))
}

fn apply(model: &mut LlamaForPretraining, s: &str) -> Result<()> {
    let (p, tail) = policy_of(s)?;
    apply_activation_checkpointing(model, &p)?;
    if tail {
        let last = format!("base_model.layers.{}", LAYERS - 1);
        apply_activation_checkpointing_to(model, &[last.as_str()], &AcPolicy::None)?;
    }
    Ok(())
}

/// CPU seconds all of this process's threads have run (Linux: the sum of
/// `/proc/self/task/*/schedstat`; NaN elsewhere). On a machine other work shares, a
/// step's CPU time moves less than its wall time.
fn cpu_secs() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return f64::NAN };
    let mut ns = 0u64;
    for e in dir.flatten() {
        let stat = std::fs::read_to_string(e.path().join("schedstat")).unwrap_or_default();
        ns += stat.split_whitespace().next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    }
    ns as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

/// The loss bits and every gradient's bits of one forward and backward.
fn bits_of(model: &LlamaForPretraining, ids: &Tensor, labels: &Tensor) -> Result<Vec<u64>> {
    for p in parameters(model) {
        p.zero_grad();
    }
    let logits = model.logits(ids, None)?.into_tensor("logits")?;
    let loss = logits.reshape([SEQ, VOCAB])?.cross_entropy(labels, -100)?;
    loss.backward()?;
    let mut bits = vec![loss.item()?.to_bits()];
    for (n, p) in named_parameters(model) {
        let g = p.local().grad().ok_or_else(|| fail(format!("{n} has no gradient")))?;
        bits.extend(g.to_vec_f64()?.into_iter().map(f64::to_bits));
    }
    Ok(bits)
}

fn main() -> Result<()> {
    let o = parse_args()?;
    for p in &o.policies {
        policy_of(p)?;
    }
    // As rank 0 of a world of one, as the trainers run: the rank's kernel pool is its
    // own, and the allocator credits what its threads hold (the GEMM kernels' packing
    // buffers among them) to the rank, as the memory model counts them.
    spawn(1, move |_| run(&o))?;
    Ok(())
}

/// The bench on rank 0: the bit-for-bit check, then the rounds and the tables.
fn run(o: &Opts) -> Result<()> {
    let cfg = LlamaConfig {
        vocab_size: VOCAB,
        max_position_embeddings: SEQ,
        hidden_size: 256,
        intermediate_size: 688,
        num_hidden_layers: LAYERS,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        dtype: DType::F32,
    };
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
    reset_parameters(&mut model, Device::Cpu, 0)?;
    let mut rng = Rng::new(1);
    let all: Vec<i64> = (0..SEQ + 1).map(|_| rng.below(VOCAB as u64) as i64).collect();
    let ids = Tensor::from_vec(all[..SEQ].to_vec(), [1, SEQ])?;
    let labels = Tensor::from_vec(all[1..].to_vec(), [SEQ])?;

    // Every policy's loss and gradients equal the plain model's, bit for bit.
    apply(&mut model, "none")?;
    let want = bits_of(&model, &ids, &labels)?;
    for p in &o.policies {
        apply(&mut model, p)?;
        if bits_of(&model, &ids, &labels)? != want {
            return Err(fail(format!("{p}: the loss or a gradient differs from none's")));
        }
    }
    let loss_bits = want[0];
    drop(want);
    println!(
        "activation checkpointing: hidden 256, {LAYERS} layers, 8/4 heads, MLP 688, vocab \
         {VOCAB}, seq {SEQ}, batch 1, f32, one rank; losses and gradients of every policy \
         equal none's bit for bit (loss bits {:016x}); {} rounds of 1 + {} steps per policy",
        loss_bits, o.rounds, o.steps
    );

    let params = parameters(&model);
    let param_bytes: i64 = params.iter().map(|p| p.local().numel() as i64 * 4).sum();
    let adamw = AdamWConfig { lr: 1e-4, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 };
    let mut opt = AdamW::with_names(named_parameters(&model), adamw)?;
    let n = o.policies.len();
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut cpu_ratios: Vec<Vec<f64>> = vec![Vec::new(); n];
    // Per policy, per timed step: forward s, regions' forward, recompute, backward s.
    let mut parts: Vec<[Vec<f64>; 4]> = vec![Default::default(); n];
    set_region_timing(true);
    let mut peaks = vec![0i64; n];
    let mut state = 0i64;
    let mut loads = Vec::new();
    for round in 0..o.rounds {
        let mut round_secs = vec![f64::NAN; n];
        let mut round_cpu = vec![f64::NAN; n];
        for (i, p) in o.policies.iter().enumerate() {
            apply(&mut model, p)?;
            let mut mine = Vec::new();
            let mut mine_cpu = Vec::new();
            for s in 0..=o.steps {
                opt.zero_grad();
                // Parameters and AdamW state (grads are none here); gradients add as many
                // bytes as the parameters during the step.
                let start = memory::current(0);
                memory::reset_peak(0);
                reset_region_times();
                let (t0, c0) = (Instant::now(), cpu_secs());
                let logits = model.logits(&ids, None)?.into_tensor("logits")?;
                let loss = logits.reshape([SEQ, VOCAB])?.cross_entropy(&labels, -100)?;
                let forward = t0.elapsed().as_secs_f64();
                drop(logits);
                loss.backward()?;
                clip_grad_norm_(&params, 1.0, &ClipOptions::default())?;
                opt.step()?;
                drop(loss);
                let dt = t0.elapsed().as_secs_f64();
                let dc = cpu_secs() - c0;
                if s > 0 {
                    let rt = region_times();
                    let part = [
                        forward,
                        rt.forward.as_secs_f64(),
                        rt.recompute.as_secs_f64(),
                        rt.backward.as_secs_f64(),
                    ];
                    for (v, x) in parts[i].iter_mut().zip(part) {
                        v.push(x);
                    }
                    mine.push(dt);
                    mine_cpu.push(dc);
                    peaks[i] = peaks[i].max(memory::peak(0));
                    state = state.max(start + param_bytes);
                }
            }
            round_secs[i] = median(mine.clone());
            round_cpu[i] = median(mine_cpu.clone());
            secs[i].extend(mine);
            cpu[i].extend(mine_cpu);
        }
        for i in 0..n {
            ratios[i].push(round_secs[i] / round_secs[0]);
            cpu_ratios[i].push(round_cpu[i] / round_cpu[0]);
        }
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let load = load.split_whitespace().next().unwrap_or("?").to_string();
        println!(
            "round {}: {} (load {load})",
            round + 1,
            o.policies
                .iter()
                .zip(&round_secs)
                .map(|(p, s)| format!("{p} {s:.3} s"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        loads.push(load);
    }
    println!(
        "state (parameters, gradients, AdamW): {:.1} MiB; ratios against `{}`",
        mib(state as f64),
        o.policies[0]
    );
    println!(
        "| policy | peak MiB | less state | x | step s (median) | x (median of rounds) | \
         range | CPU s | x (CPU) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let base_act = (peaks[0] - state) as f64;
    for i in 0..n {
        let act = (peaks[i] - state) as f64;
        let r = &ratios[i];
        let (lo, hi) = r.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        let step = median(secs[i].clone());
        let ratio = median(r.clone());
        let (c, cr) = (median(cpu[i].clone()), median(cpu_ratios[i].clone()));
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {step:.3} | {ratio:.3} | {lo:.2}-{hi:.2} | {c:.3} | \
             {cr:.3} |",
            o.policies[i],
            mib(peaks[i] as f64),
            mib(act),
            act / base_act
        );
        println!(
            "summary: policy={} peak_mib={:.1} act_mib={:.1} act_vs_first={:.3} step_s={step:.4} \
             step_vs_first={ratio:.3} ratio_min={lo:.3} ratio_max={hi:.3} cpu_s={c:.4} \
             cpu_vs_first={cr:.3} loads={}",
            o.policies[i],
            mib(peaks[i] as f64),
            mib(act),
            act / base_act,
            loads.join(",")
        );
    }
    println!(
        "where the time goes (medians per step, s): | policy | forward (logits, loss) | \
         regions' forward | recompute | backward through the recompute | recompute / `{}`'s \
         forward | the memory model's recompute share | predicted peak MiB |",
        o.policies[0]
    );
    let first_forward = median(parts[0][0].clone());
    for i in 0..n {
        let [f, rf, rc, rb] = parts[i].clone().map(median);
        // The memory model's cost of the policy and its peak (`+tail` it does not model).
        let (share, predicted) = match policy_of(&o.policies[i])? {
            (p, false) => {
                let c = MemoryConfig { ac: p, ..MemoryConfig::new(cfg, 1, SEQ) };
                let e = predict_memory(&c).map_err(|e| fail(e.to_string()))?;
                let share = recompute_share(&c).map_err(|e| fail(e.to_string()))?;
                (format!("{share:.3}"), format!("{:.1}", mib(e.peak as f64)))
            }
            (_, true) => ("-".to_string(), "-".to_string()),
        };
        let measured = rc / first_forward;
        println!(
            "| {} | {f:.3} | {rf:.3} | {rc:.3} | {rb:.3} | {measured:.3} | {share} | {predicted} |",
            o.policies[i]
        );
        println!(
            "summary_parts: policy={} forward_s={f:.4} region_forward_s={rf:.4} \
             recompute_s={rc:.4} region_backward_s={rb:.4} recompute_vs_forward={measured:.3} \
             predicted_share={share} predicted_peak_mib={predicted}",
            o.policies[i]
        );
    }
    Ok(())
}
