//! 2-D parallel Llama training: FSDP on the `dp` mesh dim, tensor + sequence
//! parallelism on `tp`, on the embedded CPU backend (ranks as threads).
//!
//! Run: `cargo run --release --example llama_2d` (world 4 as dp=2 x tp=2, 200 steps).
//! Flags: `--world N --dp N --tp N --steps N --batch N (per dp rank) --seq N
//! --layers N --hidden N --heads N --kv-heads N --intermediate N --lr F --dtype f32|bf16
//! --plan sp|megatron --no-fsdp (DDP) --zero1 --seed N --data FILE --tokenizer FILE.json
//! --device cpu|cuda --backend local|nccl --log-every N`.
//! With FSDP, `--dtype bf16` is mixed precision (bf16 compute, f32 master shards and
//! gradient reductions); with `--no-fsdp` or `--zero1` it trains bf16 parameters.

use std::path::PathBuf;
use std::time::Instant;

use tpar::prelude::*;
use tpar::tensor::memory;

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

#[derive(Clone, Debug)]
struct Opts {
    world: usize,
    dp: usize,
    tp: usize,
    steps: usize,
    batch: usize,
    seq: usize,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    lr: f64,
    dtype: DType,
    plan: String,
    dp_mode: DpMode,
    seed: u64,
    data: Option<PathBuf>,
    tokenizer: Option<PathBuf>,
    device: String,
    backend: String,
    log_every: usize,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            world: 4,
            dp: 2,
            tp: 2,
            steps: 200,
            batch: 4,
            seq: 64,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            intermediate: 176,
            lr: 1e-3,
            dtype: DType::F32,
            plan: "sp".into(),
            dp_mode: DpMode::Fsdp,
            seed: 42,
            data: None,
            tokenizer: None,
            device: "cpu".into(),
            backend: "local".into(),
            log_every: 10,
        }
    }
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts::default();
    let mut world_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let num = |s: String, name: &str| {
            s.parse::<usize>().map_err(|_| format!("{name}: not a number: {s}"))
        };
        match flag.as_str() {
            "--world" => {
                o.world = num(val("--world")?, "--world")?;
                world_given = true;
            }
            "--dp" => o.dp = num(val("--dp")?, "--dp")?,
            "--tp" => o.tp = num(val("--tp")?, "--tp")?,
            "--steps" => o.steps = num(val("--steps")?, "--steps")?,
            "--batch" => o.batch = num(val("--batch")?, "--batch")?,
            "--seq" => o.seq = num(val("--seq")?, "--seq")?,
            "--layers" => o.layers = num(val("--layers")?, "--layers")?,
            "--hidden" => o.hidden = num(val("--hidden")?, "--hidden")?,
            "--heads" => o.heads = num(val("--heads")?, "--heads")?,
            "--kv-heads" => o.kv_heads = num(val("--kv-heads")?, "--kv-heads")?,
            "--intermediate" => o.intermediate = num(val("--intermediate")?, "--intermediate")?,
            "--log-every" => o.log_every = num(val("--log-every")?, "--log-every")?.max(1),
            "--seed" => o.seed = num(val("--seed")?, "--seed")? as u64,
            "--lr" => o.lr = val("--lr")?.parse().map_err(|_| "--lr: not a number".to_string())?,
            "--dtype" => {
                o.dtype = match val("--dtype")?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    other => return Err(format!("--dtype: f32 or bf16, not {other}")),
                }
            }
            "--plan" => o.plan = val("--plan")?,
            "--no-fsdp" => o.dp_mode = DpMode::Ddp,
            "--zero1" => o.dp_mode = DpMode::Zero1,
            "--data" => o.data = Some(PathBuf::from(val("--data")?)),
            "--tokenizer" => o.tokenizer = Some(PathBuf::from(val("--tokenizer")?)),
            "--device" => o.device = val("--device")?,
            "--backend" => o.backend = val("--backend")?,
            "-h" | "--help" => {
                println!(
                    "{}",
                    include_str!("llama_2d.rs")
                        .lines()
                        .take(11)
                        .map(|l| l.trim_start_matches("//!"))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown flag {other} (see --help)")),
        }
    }
    if o.backend == "nccl" && !world_given {
        // One process per rank: the world is the launcher's (torchrun or tpar-run).
        o.world =
            std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse().ok()).unwrap_or(o.dp * o.tp);
    } else if !world_given {
        o.world = o.dp * o.tp;
    }
    if o.dp * o.tp != o.world {
        return Err(format!("dp {} x tp {} must equal world {}", o.dp, o.tp, o.world));
    }
    if o.plan != "sp" && o.plan != "megatron" {
        return Err(format!("--plan: sp or megatron, not {}", o.plan));
    }
    if o.device != "cpu" && o.device != "cuda" && parse_cuda_ordinal(&o.device).is_none() {
        return Err(format!("--device: cpu, cuda or cuda:N, not {}", o.device));
    }
    if o.backend != "local" && o.backend != "nccl" {
        return Err(format!("--backend: local or nccl, not {}", o.backend));
    }
    Ok(o)
}

fn parse_cuda_ordinal(s: &str) -> Option<usize> {
    s.strip_prefix("cuda:")?.parse().ok()
}

/// The device this rank computes on: the host, or a CUDA device: `cuda:N` as
/// given, else (`cuda`) the process's LOCAL_RANK under a launcher, else 0 (the
/// local backend's ranks then share one device). `TPAR_CUDA=emulator` serves
/// CUDA devices with the CPU emulator of the CUDA execution model.
fn compute_device(o: &Opts) -> Device {
    if o.device == "cpu" {
        return Device::Cpu;
    }
    let ordinal = parse_cuda_ordinal(&o.device).unwrap_or_else(|| {
        std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
    });
    Device::Cuda(ordinal)
}

/// How the dp mesh dim is used.
#[derive(Clone, Copy, Debug, PartialEq)]
enum DpMode {
    /// `fully_shard` per layer, base model, root.
    Fsdp,
    /// Replicated parameters, gradients all-reduced (`DataParallel`).
    Ddp,
    /// Replicated parameters, optimizer state sharded (`ZeroRedundancyOptimizer`).
    Zero1,
}

/// The optimizer of each dp mode: ZeRO-1 clips through its own method (its gradients
/// live in the ranks' ranges after the reduce-scatter).
enum Opt {
    Plain(AdamW),
    Zero(ZeroRedundancyOptimizer<AdamW>),
}

impl Opt {
    fn clip(&mut self, params: &[Param], max_norm: f64) -> tpar::Result<f64> {
        match self {
            Opt::Plain(_) => Ok(clip_grad_norm(params, max_norm)?),
            Opt::Zero(z) => Ok(z.clip_grad_norm(max_norm)?),
        }
    }

    fn get(&mut self) -> &mut dyn Optimizer {
        match self {
            Opt::Plain(a) => a,
            Opt::Zero(z) => z,
        }
    }
}

struct RankReport {
    first_loss: f64,
    final_loss: f64,
    tokens: usize,
    seconds: f64,
    peak_bytes: i64,
    state_bytes: usize,
    /// Device-host round trips per training step on this rank (CUDA devices).
    round_trips_per_step: f64,
}

/// One rank's training over `world` (the local backend's world group, or the NCCL
/// world of a process launched by torchrun / tpar-run).
fn train(world: &ProcessGroup, o: &Opts) -> tpar::Result<RankReport> {
    let rank = world.rank();
    let mesh = DeviceMesh::new(world, DeviceType::Cpu, &[o.dp, o.tp], &["dp", "tp"])?;
    let tokenizer = load_tokenizer(o.tokenizer.as_deref())?;
    let cfg = LlamaConfig {
        vocab_size: tokenizer.vocab_size(),
        max_position_embeddings: o.seq,
        hidden_size: o.hidden,
        intermediate_size: o.intermediate,
        num_hidden_layers: o.layers,
        num_attention_heads: o.heads,
        num_key_value_heads: o.kv_heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        // FSDP keeps f32 master shards and computes in `--dtype` (mixed precision);
        // replicated modes train parameters of `--dtype` itself.
        dtype: if o.dp_mode == DpMode::Fsdp { DType::F32 } else { o.dtype },
    };
    // Build on the meta device: no parameter memory until the shards are materialized.
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
    if o.tp > 1 {
        let plan =
            if o.plan == "sp" { sequence_parallel_layer_plan() } else { megatron_layer_plan() };
        parallelize_llama(&mut model, &mesh["tp"], &plan)?;
    }
    if o.dp_mode == DpMode::Fsdp {
        let fsdp = FsdpConfig {
            reshard_after_forward: true,
            mixed_precision: (o.dtype != DType::F32)
                .then_some(MixedPrecision { param_dtype: o.dtype, reduce_dtype: DType::F32 }),
        };
        for layer in &mut model.base_model.layers.items {
            fully_shard(layer, &mesh["dp"], &fsdp)?;
        }
        fully_shard(&mut model.base_model, &mesh["dp"], &fsdp)?;
        fully_shard(&mut model, &mesh["dp"], &fsdp)?;
    }
    let device = compute_device(o);
    reset_parameters(&mut model, device, o.seed)?;
    // Replicated modes: every dp replica starts from dp rank 0's parameters.
    let ddp = match o.dp_mode {
        DpMode::Fsdp => None,
        DpMode::Ddp | DpMode::Zero1 => Some(DataParallel::new(&mut model, &mesh["dp"])?),
    };

    let params = parameters(&model);
    let adamw = AdamWConfig { lr: o.lr, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 };
    let mut opt = match o.dp_mode {
        DpMode::Zero1 => {
            Opt::Zero(ZeroRedundancyOptimizer::adamw(named_parameters(&model), &mesh["dp"], adamw)?)
        }
        DpMode::Fsdp | DpMode::Ddp => {
            Opt::Plain(AdamW::with_names(named_parameters(&model), adamw)?)
        }
    };
    let warmup = (o.steps / 10).max(1);
    let mut sched =
        LrScheduler::new(SequentialLR::warmup_cosine(warmup, o.steps, 0.1, o.lr * 0.1)?, opt.get());

    let docs: Vec<String> = match &o.data {
        Some(p) => load_documents(p)?,
        None => default_documents().into_iter().map(String::from).collect(),
    };
    let dataset = PretrainingDataset::new(&docs, tokenizer.as_ref(), o.seq)?;
    let pad = dataset.pad_id() as i64;
    let dp_rank = mesh["dp"].local_rank();
    let mut sampler = DistributedSampler::new(o.dp, dp_rank)?
        .with_shuffle(true)
        .with_seed(o.seed)
        .with_drop_last(true);
    let per_epoch = dataset.len() / o.dp / o.batch.max(1);
    if per_epoch == 0 {
        return Err(tpar::Error::from(NnError::Config {
            what: format!(
                "{} documents are too few for dp {} x batch {}",
                dataset.len(),
                o.dp,
                o.batch
            ),
        }));
    }

    memory::reset_peak(rank);
    let trips0 = tpar::tensor::gpu::host_round_trips();
    let dp_group = mesh.group_of("dp")?.clone();
    // `with loss_parallel():` for the whole loop: `loss.backward()` is right for the
    // plan's vocab-sharded loss and for a plain one alike.
    let _loss_parallel = loss_parallel::enable(&mesh["tp"]);
    let t0 = Instant::now();
    let (mut first, mut last, mut tokens) = (f64::NAN, f64::NAN, 0usize);
    let mut step = 0;
    let mut epoch = 0;
    'outer: loop {
        sampler.set_epoch(epoch);
        let idx = sampler.indices(dataset.len());
        for chunk in idx.chunks(o.batch).take(per_epoch) {
            if step == o.steps {
                break 'outer;
            }
            let batch = dataset.batch(chunk)?.to_device(device)?;
            unshard(&model)?;
            // Plain or vocab-sharded logits alike: [b, s, vocab] -> [b * s, vocab].
            let logits = model
                .logits(&batch.input_ids, Some(&batch.attention_mask))?
                .reshape(&[-1, cfg.vocab_size as isize])?;
            let loss = logits
                .cross_entropy(&batch.target_ids.reshape([batch.target_ids.numel()])?, pad)?;
            loss.backward()?;
            if let (Some(ddp), DpMode::Ddp) = (&ddp, o.dp_mode) {
                ddp.sync_gradients(&model)?;
            }
            opt.clip(&params, 1.0)?;
            opt.get().step()?;
            let lr = sched.step(opt.get());
            opt.get().zero_grad();
            // The loss averaged over dp ranks, for the log.
            let local = Tensor::scalar(loss.item()?, DType::F64);
            let l = dp_group.all_reduce(&local, ReduceOp::Avg)?.item()?;
            first = if step == 0 { l } else { first };
            last = l;
            tokens += batch.num_tokens()? * o.dp;
            step += 1;
            if rank == 0 && (step % o.log_every == 0 || step == o.steps) {
                let secs = t0.elapsed().as_secs_f64();
                let done = step * 30 / o.steps;
                println!(
                    "epoch {epoch:>2} [{}{}] {step:>4}/{} loss {l:.4} lr {lr:.2e} {:.0} tok/s",
                    "#".repeat(done),
                    ".".repeat(30 - done),
                    o.steps,
                    tokens as f64 / secs
                );
            }
        }
        epoch += 1;
    }
    let state_bytes = opt.get().state_bytes();
    Ok(RankReport {
        state_bytes,
        first_loss: first,
        final_loss: last,
        tokens,
        seconds: t0.elapsed().as_secs_f64(),
        peak_bytes: memory::peak(rank),
        round_trips_per_step: (tpar::tensor::gpu::host_round_trips() - trips0) as f64
            / step.max(1) as f64,
    })
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("llama_2d: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "llama_2d: world {} = dp {} x tp {}, {} layers, hidden {}, heads {}/{}, seq {}, batch {} per dp rank, {} steps, {}, plan {}{}",
        o.world, o.dp, o.tp, o.layers, o.hidden, o.heads, o.kv_heads, o.seq, o.batch, o.steps, o.dtype, o.plan,
        match o.dp_mode {
            DpMode::Fsdp => ", FSDP",
            DpMode::Ddp => ", DDP",
            DpMode::Zero1 => ", ZeRO-1",
        }
    );
    let run = if o.backend == "nccl" {
        // One process per rank, started by torchrun or `tpar-run --nproc-per-node N`.
        memory::set_rank(Some(0));
        tpar::collectives::nccl::init_process_group(std::time::Duration::from_secs(120))
            .map_err(tpar::Error::from)
            .and_then(|world| {
                let report = train(&world, &o)?;
                let rank = world.rank();
                world.barrier()?;
                if rank != 0 {
                    std::process::exit(0);
                }
                Ok(vec![report])
            })
    } else {
        tpar::spawn_with(SpawnConfig::new(o.world), |ctx| train(&ctx.world_group(), &o))
    };
    let reports = match run {
        Ok(r) => r,
        Err(e) => {
            eprintln!("llama_2d: {e}");
            std::process::exit(1);
        }
    };
    let r0 = &reports[0];
    let peaks: Vec<String> =
        reports.iter().map(|r| format!("{:.1}", r.peak_bytes as f64 / (1 << 20) as f64)).collect();
    println!("peak memory per rank (MiB): [{}]", peaks.join(", "));
    let states: Vec<String> =
        reports.iter().map(|r| format!("{:.1}", r.state_bytes as f64 / 1024.0)).collect();
    println!("optimizer state per rank (KiB): [{}]", states.join(", "));
    println!(
        "summary: world={} dp={} tp={} steps={} first_loss={:.4} final_loss={:.4} tokens_per_s={:.0} seconds={:.2} peak_mib_max={:.1}",
        o.world,
        o.dp,
        o.tp,
        o.steps,
        r0.first_loss,
        r0.final_loss,
        r0.tokens as f64 / r0.seconds,
        r0.seconds,
        reports.iter().map(|r| r.peak_bytes).max().unwrap_or(0) as f64 / (1 << 20) as f64
    );
    if o.device != "cpu" {
        // Ops without a device kernel and host-staged collectives, rank 0, per step.
        println!("device: {} host round trips per step on rank 0", r0.round_trips_per_step);
    }
    if !(r0.final_loss.is_finite() && r0.final_loss < r0.first_loss) {
        eprintln!("llama_2d: loss did not fall ({} -> {})", r0.first_loss, r0.final_loss);
        std::process::exit(1);
    }
}
