//! 2-D parallel Llama training: FSDP on the `dp` mesh dim, tensor + sequence
//! parallelism on `tp`, on the embedded CPU backend (ranks as threads), or one process
//! per rank over NCCL (GPUs) or TCP (CPU processes).
//!
//! Run: `cargo run --release --example llama_2d` (world 4 as dp=2 x tp=2, 200 steps);
//! `-- --help` lists the flags. On a terminal, rank 0 shows a progress bar (loss, lr,
//! tokens/s, ETA); otherwise it prints a line every `--log-every` steps.
//! With FSDP, `--dtype bf16` is mixed precision (bf16 compute, f32 master shards and
//! gradient reductions); with `--no-fsdp` or `--zero1` it trains bf16 parameters.
//! With FSDP, `--timeline` prints each rank's record of the last step: every unit's
//! forward and backward compute and its all-gathers and reduce-scatters, to see what
//! overlapped, and the collectives the rank issued in that step per phase and group.
//! `--cp N` adds a context-parallel mesh dim (`["dp", "cp", "tp"]`): each sequence is
//! sharded over N ranks in the load-balanced layout and attention passes keys and
//! values around the cp ring (or gathers them: `--cp-method all-gather`); the
//! data-parallel mode runs over dp x cp.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, ValueEnum};

use tpar::data::Batch;
use tpar::data::StepMetrics;
use tpar::dtensor::CpLayout;
use tpar::models::context_parallel::{apply_context_parallel, cp_token_share};
use tpar::models::LlamaFusion;
use tpar::prelude::*;
use tpar::tensor::memory;

#[path = "common/args.rs"]
mod args;
#[path = "common/flags.rs"]
mod flags;
#[path = "common/run.rs"]
mod run;
use flags::NonFinite;

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

use run::MAX_GRAD_NORM;

#[derive(Clone, Debug)]
struct Opts {
    world: usize,
    dp: usize,
    cp: usize,
    tp: usize,
    steps: usize,
    batch: usize,
    layers: usize,
    model: args::ModelArgs,
    lr: f64,
    dtype: DType,
    plan: String,
    dp_mode: DpMode,
    seed: u64,
    data: args::DataArgs,
    device: String,
    backend: String,
    log_every: usize,
    checkpoint_dir: Option<PathBuf>,
    save_every: usize,
    save: args::SaveArgs,
    hf: args::HfArgs,
    ac: args::AcArgs,
    cp_method: args::CpMethodArgs,
    metrics: args::MetricsArgs,
    memory_budget: Option<f64>,
    stop_after: Option<usize>,
    nonfinite: NonFinite,
    timeline: bool,
    cuda_graph: bool,
    fusion: LlamaFusion,
    deterministic: bool,
}

/// 2-D parallel Llama training: FSDP on the dp mesh dim, tensor + sequence parallelism on
/// tp, on the embedded CPU backend (ranks as threads), or one process per rank over NCCL
/// (GPUs) or TCP (CPU processes).
#[derive(Parser, Debug)]
#[command(name = "llama_2d", version)]
struct Cli {
    /// World size (default dp x cp x tp; with --backend nccl or tcp, the launcher's WORLD_SIZE).
    #[arg(long)]
    world: Option<usize>,
    /// Data-parallel degree (the dp mesh dim).
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Context-parallel degree (the cp mesh dim, between dp and tp): each sequence is
    /// sharded over cp ranks (head and mirror tail chunks), attention passes keys and
    /// values around the cp ring (or gathers them: --cp-method all-gather), and FSDP (or
    /// DDP, ZeRO-1) runs over dp x cp.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Tensor-parallel degree (the tp mesh dim).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Sequences per dp rank per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[command(flatten)]
    model: args::ModelArgs,
    /// Peak learning rate (warmup, then cosine to a tenth).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Parameter dtype; with FSDP, bf16 is mixed precision (bf16 compute, f32 master
    /// shards and gradient reductions).
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Tensor-parallel layer plan.
    #[arg(long, value_enum, default_value_t = PlanArg::Sp)]
    plan: PlanArg,
    /// Replicate parameters and all-reduce gradients (DDP) instead of FSDP.
    #[arg(long, conflicts_with = "zero1")]
    no_fsdp: bool,
    /// Replicate parameters and shard the optimizer state (ZeRO-1) instead of FSDP.
    #[arg(long)]
    zero1: bool,
    /// Seed of the data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[command(flatten)]
    data: args::DataArgs,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// local (ranks as threads), or one process per rank from torchrun or tpar-run: nccl
    /// (GPUs) or tcp (CPU processes).
    #[arg(long, value_enum, default_value_t = BackendArg::Local)]
    backend: BackendArg,
    /// Log every N steps.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    log_every: u64,
    /// Checkpoint directory: the run resumes from the newest checkpoint there (model,
    /// optimizer, schedule, sampler, step) and saves one every --save-every steps.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (and after the last one).
    #[arg(long, default_value_t = 100, requires = "checkpoint_dir", value_parser = clap::value_parser!(u64).range(1..))]
    save_every: u64,
    #[command(flatten)]
    save: args::SaveArgs,
    #[command(flatten)]
    hf: args::HfArgs,
    #[command(flatten)]
    ac: args::AcArgs,
    #[command(flatten)]
    cp_method: args::CpMethodArgs,
    #[command(flatten)]
    metrics: args::MetricsArgs,
    /// Refuse to start (exit code 2, before the model is built) when the predicted peak
    /// memory per rank (tpar's memory model: parameters, gradients, optimizer state,
    /// activations, the largest transient) exceeds this many GiB, naming the changes on
    /// the same ranks with the same global batch that would fit.
    #[arg(long)]
    memory_budget: Option<f64>,
    /// End the run after step N, as an interruption would (the schedule still spans
    /// --steps); a later run with the same --checkpoint-dir resumes.
    #[arg(long)]
    stop_after: Option<usize>,
    /// On a non-finite loss or gradient norm: fail (stop with an error naming the step
    /// and the rank) or skip (zero the gradients, skip that optimizer step, log a line).
    /// On the host both are checked every step. On a CUDA device the loss and the norm
    /// stay there except on logging steps (step 1, every --log-every steps, the last
    /// step): fail checks them on those steps and before each checkpoint save, so a
    /// non-finite step between two checks is reported at the next one; skip reads the
    /// norm back every step (one host round trip per step) to decide.
    #[arg(long, value_enum, default_value_t = NonFinite::Fail)]
    nonfinite: NonFinite,
    /// With FSDP: print each rank's timeline of the last step (each unit's forward and
    /// backward compute, all-gathers and reduce-scatters, and how long the compute
    /// waited for them) and the collectives it issued in that step (calls and bytes per
    /// phase and group).
    #[arg(long, conflicts_with_all = ["no_fsdp", "zero1"])]
    timeline: bool,
    /// On a CUDA device: after one eager warm-up step, capture one whole training step
    /// (forward, loss, backward, clipping, AdamW) as a CUDA graph, its batch read from
    /// static device tensors, and replay it for the following steps (the learning rate
    /// and bias corrections reach the device before each replay); a batch of another
    /// shape runs eagerly (said once). World 1 only (--world 1 --dp 1 --tp 1, FSDP or
    /// --no-fsdp); the loss and the gradient norm are read back on logging steps only,
    /// so --nonfinite fail reports a non-finite step there, after its update.
    #[arg(long)]
    cuda_graph: bool,
    /// Compute q, k, v (and gate, up) of each decoder layer with one GEMM over the
    /// concatenated weights, where the plan allows it (no tensor-parallel plan on the
    /// projections; otherwise the separate projections run).
    #[arg(long)]
    fuse_proj: bool,
    /// Compute each decoder layer's residual adds in o_proj's and down_proj's GEMMs (on a
    /// CUDA device the GEMM reads the residual; on the host the same bits as without),
    /// where no parallel style sits on those modules.
    #[arg(long)]
    fuse_residual: bool,
    /// Compute in a fixed order what a GPU would otherwise sum in the order its blocks
    /// run (the attention backward's dQ; PyTorch's torch.use_deterministic_algorithms):
    /// the same loss bits on every run, at some speed on a GPU. The host is
    /// deterministic either way.
    #[arg(long)]
    deterministic: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DtypeArg {
    F32,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PlanArg {
    Sp,
    Megatron,
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum BackendArg {
    Local,
    Nccl,
    Tcp,
}

fn parse() -> Result<Opts, String> {
    let c = Cli::parse();
    let backend = match c.backend {
        BackendArg::Local => "local",
        BackendArg::Nccl => "nccl",
        BackendArg::Tcp => "tcp",
    };
    let dp_tp =
        c.dp.checked_mul(c.cp)
            .and_then(|d| d.checked_mul(c.tp))
            .ok_or_else(|| format!("--dp {} x --cp {} x --tp {} overflows", c.dp, c.cp, c.tp))?;
    let world = match (c.world, c.backend) {
        (Some(w), _) => w,
        // One process per rank: the world is the launcher's (torchrun or tpar-run).
        (None, BackendArg::Nccl | BackendArg::Tcp) => {
            std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse().ok()).unwrap_or(dp_tp)
        }
        (None, BackendArg::Local) => dp_tp,
    };
    let mut sizes = vec![
        ("--dp", c.dp),
        ("--cp", c.cp),
        ("--tp", c.tp),
        ("--steps", c.steps),
        ("--batch", c.batch),
    ];
    sizes.extend(c.model.sizes());
    flags::positive(&sizes)?;
    flags::llama_shape(c.model.hidden, c.model.heads, c.model.kv_heads)?;
    flags::learning_rate(c.lr)?;
    if dp_tp != world {
        return Err(if c.cp == 1 {
            format!("dp {} x tp {} must equal world {world}", c.dp, c.tp)
        } else {
            format!("dp {} x cp {} x tp {} must equal world {world}", c.dp, c.cp, c.tp)
        });
    }
    if c.backend == BackendArg::Local {
        flags::local_world(world, &format!("--world {world} (--dp {} x --tp {})", c.dp, c.tp))?;
    }
    if let Some(b) = c.memory_budget.filter(|b| !(b.is_finite() && *b > 0.0)) {
        return Err(format!("--memory-budget {b}: a positive number of GiB"));
    }
    c.ac.check(c.memory_budget)?;
    if c.device != "cpu" && c.device != "cuda" && parse_cuda_ordinal(&c.device).is_none() {
        return Err(format!("--device: cpu, cuda or cuda:N, not {}", c.device));
    }
    if c.cuda_graph {
        cuda_graph_supported(&c, world)?;
    }
    Ok(Opts {
        world,
        dp: c.dp,
        cp: c.cp,
        tp: c.tp,
        steps: c.steps,
        batch: c.batch,
        layers: c.layers,
        model: c.model,
        lr: c.lr,
        dtype: match c.dtype {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::BF16,
        },
        plan: match c.plan {
            PlanArg::Sp => "sp".into(),
            PlanArg::Megatron => "megatron".into(),
        },
        dp_mode: match (c.no_fsdp, c.zero1) {
            (true, _) => DpMode::Ddp,
            (_, true) => DpMode::Zero1,
            _ => DpMode::Fsdp,
        },
        seed: c.seed,
        data: c.data,
        device: c.device,
        backend: backend.into(),
        log_every: c.log_every as usize,
        checkpoint_dir: c.checkpoint_dir,
        save_every: c.save_every as usize,
        save: c.save,
        hf: c.hf,
        ac: c.ac,
        cp_method: c.cp_method,
        metrics: c.metrics,
        memory_budget: c.memory_budget,
        stop_after: c.stop_after,
        nonfinite: c.nonfinite,
        timeline: c.timeline,
        cuda_graph: c.cuda_graph,
        fusion: LlamaFusion { projections: c.fuse_proj, residual: c.fuse_residual },
        deterministic: c.deterministic,
    })
}

/// `--cuda-graph` where it runs: one rank on a CUDA device, AdamW stepped locally, the
/// step's decisions made on the device. Anything else is refused naming what is not
/// supported (rather than a graph that would replay wrong work).
fn cuda_graph_supported(c: &Cli, world: usize) -> Result<(), String> {
    let mut no = Vec::new();
    if c.device == "cpu" {
        no.push("--device cpu (graphs capture CUDA work: --device cuda)".to_string());
    }
    if world != 1 || c.backend != BackendArg::Local {
        no.push(format!(
            "a world of {world} ranks (collectives across ranks are not captured yet: \
             --world 1 --dp 1 --tp 1 with the local backend)"
        ));
    }
    if c.zero1 {
        no.push("--zero1 (its optimizer does not take capturable steps)".into());
    }
    if c.nonfinite == NonFinite::Skip {
        no.push("--nonfinite skip (it decides on the host every step)".into());
    }
    if c.timeline {
        no.push("--timeline (it times host phases of the step)".into());
    }
    if no.is_empty() {
        Ok(())
    } else {
        Err(format!("--cuda-graph does not support {}", no.join("; ")))
    }
}

/// This run for the memory model.
fn memory_config(o: &Opts, cfg: &LlamaConfig, host: bool) -> MemoryConfig {
    let data_parallel = match o.dp_mode {
        DpMode::Fsdp => {
            DataParallelMode::Fsdp { param_dtype: (o.dtype != DType::F32).then_some(o.dtype) }
        }
        DpMode::Ddp => DataParallelMode::Ddp,
        DpMode::Zero1 => DataParallelMode::Zero1,
    };
    MemoryConfig {
        dp: o.dp,
        tp: o.tp,
        cp: o.cp,
        data_parallel,
        plan: if o.plan == "sp" { TpPlan::SequenceParallel } else { TpPlan::Megatron },
        ac: o.ac.fixed(),
        cp_method: o.cp_method.cp_method,
        host,
        fusion: o.fusion,
        ..MemoryConfig::new(*cfg, o.batch, o.model.seq)
    }
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

/// Every checkpointed part of the run, by name, for a checkpoint to save or load: the
/// run's configuration first, so a resume that does not match stops before anything
/// else loads.
fn with_items<R>(
    config: &mut RunConfig,
    model: &mut LlamaForPretraining,
    opt: &mut dyn Optimizer,
    sched: &mut LrScheduler<SequentialLR>,
    data: &mut run::TrainData,
    progress: &mut run::Progress,
    f: impl FnOnce(&mut [(&str, &mut dyn Stateful)]) -> tpar::Result<R>,
) -> tpar::Result<R> {
    let mut model = ModuleState::new(model);
    f(&mut [
        ("config", config),
        ("model", &mut model),
        ("optim", opt),
        ("lr_scheduler", sched),
        data.item(),
        ("trainer", progress),
    ])
}

struct RankReport {
    /// The activation-checkpointing policy trained with (`--ac auto`'s pick).
    ac: AcPolicy,
    /// The memory model's predicted peak for this rank.
    predicted_peak_bytes: u64,
    /// What opening the training data allocated on this rank (documents and token
    /// sequences in memory, or a parquet stream's buffers), held through the run.
    data_bytes: u64,
    first_loss: f64,
    final_loss: f64,
    tokens: usize,
    seconds: f64,
    peak_bytes: i64,
    /// The CUDA device's high-water mark (its pool's bytes in use, as PyTorch's
    /// `max_memory_allocated`); `None` on the host.
    device_peak_bytes: Option<u64>,
    state_bytes: usize,
    /// Device-host round trips per training step on this rank (CUDA devices).
    round_trips_per_step: f64,
    /// Round trips of each step this run took on this rank (its forward, backward,
    /// optimizer step and log read; checkpoint saves left out), with whether the step
    /// logged (read the loss and the gradient norm back).
    step_round_trips: Vec<(bool, u64)>,
    /// The step this run started from (0, or the checkpoint it resumed).
    start_step: usize,
    /// Steps this run took.
    steps_run: usize,
    /// The FSDP timeline of the last step and its collectives, rendered (`--timeline`).
    timeline: Option<String>,
    /// Seconds from the start to the end of each step that read its loss back
    /// (so the device had finished it), with the steps done by then.
    read_times: Vec<(usize, f64)>,
    /// Per step on a device that counts its work (the emulator): whether it logged, how
    /// it ran (eager, warm-up, captured, replayed, fallback), the work it issued and its
    /// wall seconds.
    step_work: Vec<StepWork>,
}

/// One step's work on a device that counts it.
struct StepWork {
    logging: bool,
    mode: &'static str,
    work: tpar::tensor::gpu::WorkCounts,
    wall_s: f64,
}

impl RankReport {
    /// Seconds per step after the warm-up: from the first step at or after the
    /// third that read its loss back to the last step (NaN with no two such steps).
    /// Device work is asynchronous, so only read steps give finished times.
    fn steady_step_s(&self) -> f64 {
        let first = self.read_times.iter().find(|(s, _)| *s >= 3);
        match (first, self.read_times.last()) {
            (Some(&(s0, t0)), Some(&(s1, t1))) if s1 > s0 => (t1 - t0) / (s1 - s0) as f64,
            _ => f64::NAN,
        }
    }
}

/// One rank's training over `world` (the local backend's world group, or the NCCL or TCP
/// world of a process launched by torchrun / tpar-run).
fn train(world: &ProcessGroup, o: &Opts) -> tpar::Result<RankReport> {
    let rank = world.rank();
    let mesh = DeviceMesh::new(world, DeviceType::Cpu, &[o.dp, o.cp, o.tp], &["dp", "cp", "tp"])?;
    // The data-parallel mesh: dp, or dp x cp flattened under context parallelism (the
    // ranks that hold different tokens of a batch), as torchtitan shards FSDP.
    let dp_mesh = if o.cp > 1 { mesh.flatten(&["dp", "cp"], "dp_cp")? } else { mesh["dp"].clone() };
    let seq = o.model.seq;
    let hf = o.hf.open()?;
    let tokenizer = o.hf.tokenizer(o.data.tokenizer.as_deref(), hf.as_ref())?;
    // FSDP keeps f32 master shards and computes in `--dtype` (mixed precision);
    // replicated modes train parameters of `--dtype` itself.
    let dtype = if o.dp_mode == DpMode::Fsdp { DType::F32 } else { o.dtype };
    let flags_cfg = o.model.llama_config(tokenizer.vocab_size(), o.layers, dtype);
    let cfg = o.hf.llama_config(hf.as_ref(), flags_cfg, tokenizer.vocab_size(), seq, rank)?;
    // A model whose training state this process cannot hold fails here, before anything
    // is built (the local backend holds every rank's share).
    let here = if o.backend == "local" { o.world } else { 1 };
    let sizes = o.model.size_flags(o.layers);
    flags::model_fits(&cfg, here, o.world, &sizes).map_err(|what| NnError::Config { what })?;
    // The predicted peak per rank; over --memory-budget the run stops here, before the
    // model is built.
    let mut run = memory_config(o, &cfg, compute_device(o) == Device::Cpu);
    // `--ac auto`: the policy that fits the budget with the least recompute.
    let ac = o.ac.resolve(&mut run, o.memory_budget, "llama_2d", rank == 0)?;
    let predicted = predict_memory(&run)?;
    if rank == 0 {
        println!("memory: {predicted}");
    }
    // On the host, the peaks of the ranks on this machine (this process's rank threads,
    // or the launcher's processes here) must fit it: a sequence or batch it cannot hold
    // stops here, before anything is built.
    if compute_device(o) == Device::Cpu {
        let ranks = if here == 1 { flags::processes_on_this_machine() } else { here };
        flags::peaks_fit(&vec![predicted.peak; ranks]).map_err(|what| NnError::Config { what })?;
    }
    if let Some(gib) = o.memory_budget {
        // Refused with the configurations on the same ranks that would fit.
        check_fits(&run, args::gib_bytes(gib))?;
    }
    // Build on the meta device: no parameter memory until the shards are materialized.
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
    model.set_fusion(o.fusion);
    if o.tp > 1 {
        let plan =
            if o.plan == "sp" { sequence_parallel_layer_plan() } else { megatron_layer_plan() };
        parallelize_llama(&mut model, &mesh["tp"], &plan)?;
    }
    // Activation checkpointing after the plan and before FSDP (as torchtitan).
    apply_activation_checkpointing(&mut model, &ac)?;
    if o.dp_mode == DpMode::Fsdp {
        let fsdp = FsdpConfig {
            reshard_after_forward: true,
            mixed_precision: (o.dtype != DType::F32)
                .then_some(MixedPrecision { param_dtype: o.dtype, reduce_dtype: DType::F32 }),
        };
        for layer in &mut model.base_model.layers.items {
            fully_shard(layer, &dp_mesh, &fsdp)?;
        }
        fully_shard(&mut model.base_model, &dp_mesh, &fsdp)?;
        fully_shard(&mut model, &dp_mesh, &fsdp)?;
    }
    let device = compute_device(o);
    reset_parameters(&mut model, device, o.seed)?;
    if let Some(hf) = &hf {
        hf.load_into(&mut model)?;
    }
    // Replicated modes: every dp replica starts from dp rank 0's parameters; DDP's
    // backward passes average the gradients over dp as they are produced (ZeRO-1's
    // optimizer reduce-scatters them itself).
    let _ddp = match o.dp_mode {
        DpMode::Fsdp => None,
        DpMode::Ddp => Some(DataParallel::new(&mut model, &dp_mesh)?),
        DpMode::Zero1 => {
            sync_module_states(&mut model, &dp_mesh)?;
            None
        }
    };

    // Context parallelism: each cp rank takes its chunks of every sequence.
    let cp_group = mesh.group_of("cp")?.clone();
    let cp_layout = CpLayout::new(seq, o.cp)?;
    if o.cp > 1 {
        apply_context_parallel(&mut model, &cp_group, o.cp_method.cp_method)?;
    }

    let optim = run::Optim::new(o.lr, o.steps);
    let adamw = optim.adamw;
    let cuda_ordinal = match compute_device(o) {
        Device::Cuda(i) => Some(i),
        _ => None,
    };
    // One optimizer interface for every dp mode (ZeRO-1 shards its state over dp).
    let mut opt: Box<dyn Optimizer> = match o.dp_mode {
        DpMode::Zero1 => {
            Box::new(ZeroRedundancyOptimizer::adamw(named_parameters(&model), &dp_mesh, adamw)?)
        }
        DpMode::Fsdp | DpMode::Ddp => Box::new(AdamW::with_names(named_parameters(&model), adamw)?),
    };
    // --cuda-graph: capturable AdamW, and the step runner (one eager warm-up step).
    let mut graphed = match (o.cuda_graph, cuda_ordinal) {
        (true, Some(i)) => {
            opt.set_capturable(true)?;
            Some(tpar::tensor::gpu::GraphedStep::<(Tensor, Tensor)>::new(i, 1))
        }
        _ => None,
    };
    let mut said_fallback = false;
    let mut sched = LrScheduler::new(optim.schedule()?, opt.as_mut());
    if o.save.override_lr {
        sched.override_on_load();
    }

    let dp_rank = mesh["dp"].local_rank();
    // This rank's allocations, for its peak; what the training data holds is in the peak
    // and not in the memory model's prediction (which counts the model's state and its
    // training step), so it is reported beside it.
    let mem_slot = run::memory_slot(rank, o.backend != "local");
    let (mut data, data_bytes) = run::TrainData::open_held(
        mem_slot,
        &o.data.source(),
        tokenizer.as_ref(),
        seq,
        (o.dp, dp_rank),
        o.batch,
        o.seed,
    )?;
    let pad = tokenizer.pad_id() as i64;

    let mut progress = run::Progress { step: 0, first_loss: f64::NAN };
    let mut run_config = run::run_config(
        &run::Recipe {
            model: &cfg,
            optim: &optim,
            override_lr: o.save.override_lr,
            global_batch: o.batch * o.dp,
            seq,
            seed: o.seed,
            data: &data,
        },
        &[
            ("mesh.world", o.world.into()),
            ("mesh.dp", o.dp.into()),
            ("mesh.cp", o.cp.into()),
            ("mesh.tp", o.tp.into()),
            ("plan", o.plan.as_str().into()),
            ("dp_mode", format!("{:?}", o.dp_mode).into()),
            ("dtype", o.dtype.name().into()),
        ],
    );
    let mut ckpt = match &o.checkpoint_dir {
        Some(dir) => {
            let config = CheckpointConfig {
                keep: o.save.keep.map(|k| k as usize),
                async_save: o.save.async_save,
                ..Default::default()
            };
            let mut c = CheckpointManager::new(dir, world, config)?;
            let resumed = with_items(
                &mut run_config,
                &mut model,
                opt.as_mut(),
                &mut sched,
                &mut data,
                &mut progress,
                |items| Ok(c.load_latest(items)?),
            )?;
            if let Some(step) = resumed {
                progress.check_resumed(step)?;
                // The optimizer's own state holds the saved learning rate.
                opt.set_lr(sched.last_lr());
                if rank == 0 {
                    println!("resumed from {} at step {step}", c.step_dir(step).display());
                }
            }
            Some(c)
        }
        None => None,
    };
    let start_step = progress.step;
    let stop = o.stop_after.unwrap_or(o.steps).min(o.steps);

    memory::reset_peak(mem_slot);
    let trips0 = tpar::tensor::gpu::host_round_trips();
    let dp_group = mesh.group_of("dp")?.clone();
    // `with loss_parallel():` for the whole loop: `loss.backward()` is right for the
    // plan's vocab-sharded loss and for a plain one alike.
    let _loss_parallel = loss_parallel::enable(&mesh["tp"]);
    let progress_bar = (rank == 0).then(|| run::progress_bar(o.steps, 0));
    // --metrics / --tensorboard: rank 0 writes them (on a writer thread).
    let metrics = o.metrics.start(rank == 0)?;
    // The device's buffers, for its peak (the local backend's ranks share one device).
    if let (Some(i), Some(_)) = (cuda_ordinal, &metrics) {
        tpar::kernels::cuda::reset_device_peak(i);
    }
    // Each step starts a fresh record, so the last step's is what is left at the end.
    let timeline = (o.timeline && o.dp_mode == DpMode::Fsdp).then(FsdpTimeline::new);
    set_fsdp_timeline(&model, timeline.as_ref());
    // The collectives of a step, per phase (with --timeline).
    let comm = world.comm_debug();
    let mut phases: Vec<(&str, Vec<tpar::collectives::CommRecord>)> = Vec::new();
    let t0 = Instant::now();
    let (mut last, mut tokens) = (f64::NAN, 0usize);
    let mut step = progress.step;
    let mut step_round_trips: Vec<(bool, u64)> = Vec::new();
    let mut read_times: Vec<(usize, f64)> = Vec::new();
    let mut step_work: Vec<StepWork> = Vec::new();
    let on_host = device == Device::Cpu;
    // On a device, the embedding's and the loss's id checks record their status instead
    // of reading it back on every step (the ids were checked on the host); the recorded
    // checks are read where the trainer synchronizes anyway: logging steps, before a
    // checkpoint save and at the end.
    let _defer = (!on_host).then(DeferIndexChecks::on);
    if let Some(bar) = &progress_bar {
        bar.set_position(step as u64);
    }
    while step < stop {
        let step_trips0 = tpar::tensor::gpu::host_round_trips();
        let work0 = cuda_ordinal.and_then(tpar::tensor::gpu::work_counts);
        let step_t0 = Instant::now();
        // Logging steps read the loss and the gradient norm back (one host round trip
        // on a device): step 1, every --log-every steps and the last step; on the host
        // every step reads them (it costs nothing there). All ranks agree on which.
        let logging = step == 0 || (step + 1).is_multiple_of(o.log_every) || step + 1 == stop;
        let saving =
            ckpt.is_some() && ((step + 1).is_multiple_of(o.save_every) || step + 1 == o.steps);
        let read = on_host
            || logging
            || o.nonfinite == NonFinite::Skip
            || (saving && o.nonfinite == NonFinite::Fail);
        let (epoch, batch) = data.batch(step, o.batch, seq)?;
        if !on_host {
            // The device reads no status back on a quiet step (deferred checks, or a
            // replayed graph): the ids are checked here, on the host, before they move.
            check_batch_ids(&batch, cfg.vocab_size, pad, step)?;
        }
        // Counted on the host, before the batch moves (a device count would read it back).
        let batch_tokens = batch.num_tokens()?;
        // Under context parallelism this rank's chunks of every sequence, and its share
        // of the tokens (counted on the host, before the batch moves).
        let (batch, cp_share) = if o.cp > 1 {
            let me = cp_group.rank();
            let target_ids = cp_layout.shard(&batch.target_ids, 1, me)?;
            let share = cp_token_share(&target_ids, pad, &cp_group)?;
            let batch = Batch {
                input_ids: cp_layout.shard(&batch.input_ids, 1, me)?,
                target_ids,
                attention_mask: cp_layout.shard(&batch.attention_mask, 1, me)?,
            };
            (batch, share)
        } else {
            (batch, 1.0)
        };
        let mut mode = "eager";
        let (mut local, norm) = if let Some(gs) = graphed.as_mut() {
            // --cuda-graph: the batch goes into the graph's static inputs; the loss and the
            // norm are its static outputs, read back on logging steps only.
            let inputs =
                [batch.input_ids.clone(), batch.target_ids.clone(), batch.attention_mask.clone()];
            let ((loss_t, norm_t), how) = gs.run(
                &mut opt,
                &inputs,
                |opt, d| -> tpar::Result<(Tensor, Tensor)> {
                    unshard(&model)?;
                    // [b, s, vocab] -> [b * s, vocab]
                    let logits = model
                        .logits(&d[0], Some(&d[2]))?
                        .reshape(&[-1, cfg.vocab_size as isize])?;
                    let loss = logits.cross_entropy(&d[1].reshape([d[1].numel()])?, pad)?;
                    let loss_t = loss.clone().into_local("loss")?;
                    loss.backward()?;
                    let norm_t =
                        clip_grad_norm_(opt.as_mut(), MAX_GRAD_NORM, &ClipOptions::default())?;
                    opt.step()?;
                    Ok((loss_t, norm_t))
                },
                |opt| Ok(opt.prepare_replay()?),
            )?;
            mode = match how {
                tpar::tensor::gpu::StepMode::Warmup => "warmup",
                tpar::tensor::gpu::StepMode::Captured => "captured",
                tpar::tensor::gpu::StepMode::Replayed => "replayed",
                tpar::tensor::gpu::StepMode::Fallback => "fallback",
            };
            if how == tpar::tensor::gpu::StepMode::Fallback && !said_fallback && rank == 0 {
                said_fallback = true;
                let captured: Vec<String> =
                    gs.captured_inputs().iter().map(|(s, d)| format!("{s} {}", d.name())).collect();
                println!(
                    "cuda graph: step {} has a batch of shape {} (captured: {}): it runs \
                     eagerly, as every step whose batch differs from the captured one",
                    step + 1,
                    inputs[0].shape(),
                    captured.join(", ")
                );
            }
            if read {
                // Warm-up and fallback steps run eagerly and may have recorded checks.
                tpar::tensor::gpu::check_deferred_index_checks()?;
                let (l, n) = read_loss_and_norm(&loss_t, &norm_t)?;
                if o.nonfinite == NonFinite::Fail && !(l.is_finite() && n.is_finite()) {
                    return Err(NnError::NonFinite {
                        what: format!(
                            "step {} on rank {rank}: the loss or the gradient norm (loss {l}, \
                             norm {n}; the step's update was taken)",
                            step + 1
                        ),
                        value: if l.is_finite() { n } else { l },
                    }
                    .into());
                }
                (l, n)
            } else {
                (f64::NAN, f64::NAN)
            }
        } else {
            let batch = batch.to_device(device)?;
            if let Some(t) = &timeline {
                t.clear();
                comm.clear();
                comm.enable();
                phases.clear();
            }
            unshard(&model)?;
            // Plain or vocab-sharded logits alike: [b, s, vocab] -> [b * s, vocab].
            let logits = model
                .logits(&batch.input_ids, Some(&batch.attention_mask))?
                .reshape(&[-1, cfg.vocab_size as isize])?;
            let targets = batch.target_ids.reshape([batch.target_ids.numel()])?;
            let loss = logits.cross_entropy(&targets, pad)?;
            // Under cp: this rank's share of its dp rank's mean (its tokens over the cp
            // group's), times cp since the gradient reduction averages over dp x cp.
            let loss = if o.cp > 1 { loss.mul_scalar(cp_share * o.cp as f64)? } else { loss };
            // The loss is Replicate: the local tensor is its value.
            let loss_t = loss.clone().into_local("loss")?;
            // On the host: read now, and fail before the backward.
            let mut local = if on_host { loss_t.item()? } else { f64::NAN };
            let fail_on_loss = |local: f64| -> tpar::Result<()> {
                if o.nonfinite == NonFinite::Fail && !local.is_finite() {
                    // Peers waiting in the next collective fail naming this rank.
                    return Err(NnError::NonFinite {
                        what: format!("step {} on rank {rank}: the loss", step + 1),
                        value: local,
                    }
                    .into());
                }
                Ok(())
            };
            if on_host {
                fail_on_loss(local)?;
            }
            if timeline.is_some() {
                phases.push(("forward", comm.take()));
            }
            loss.backward()?;
            if timeline.is_some() {
                phases.push(("backward", comm.take()));
            }
            // The norm is global (all-reduced): every rank takes the same branch. Clipping
            // through the optimizer serves every dp mode (ZeRO-1's gradients live in the
            // ranks' ranges after its reduce-scatter); the norm stays on the device.
            let norm_t = clip_grad_norm_(opt.as_mut(), MAX_GRAD_NORM, &ClipOptions::default())?;
            if read && !on_host {
                tpar::tensor::gpu::check_deferred_index_checks()?;
            }
            let norm = if !read {
                // Not read back: the step goes on (see --nonfinite).
                f64::NAN
            } else if on_host {
                norm_t.item()?
            } else {
                let (l, n) = read_loss_and_norm(&loss_t, &norm_t)?;
                local = l;
                fail_on_loss(local)?;
                n
            };
            if !read || norm.is_finite() {
                opt.step()?;
            } else if o.nonfinite == NonFinite::Fail {
                return Err(NnError::NonFinite {
                    what: format!(
                        "step {} on rank {rank}: the gradient norm (loss {local})",
                        step + 1
                    ),
                    value: norm,
                }
                .into());
            } else if rank == 0 {
                println!(
                "step {}: non-finite gradient norm {norm} (loss {local}): optimizer step skipped",
                step + 1
            );
            }
            (local, norm)
        };
        let lr = sched.step(opt.as_mut());
        opt.zero_grad();
        // Under cp, this dp rank's loss is the sum of its cp ranks' shares.
        if read && o.cp > 1 {
            let share = Tensor::scalar(local / o.cp as f64, DType::F64);
            local = cp_group.all_reduce(&share, ReduceOp::Sum)?.item()?;
        }
        // The loss averaged over dp ranks, for the log (a host scalar: no round trip).
        let l = if read {
            let local = Tensor::scalar(local, DType::F64);
            dp_group.all_reduce(&local, ReduceOp::Avg)?.item()?
        } else {
            f64::NAN
        };
        if timeline.is_some() {
            phases.push(("optimizer", comm.take()));
            comm.disable();
        }
        if step == 0 {
            progress.first_loss = l;
        }
        if read {
            last = l;
        }
        tokens += batch_tokens * o.dp;
        step += 1;
        progress.step = step;
        if let Some(m) = &metrics {
            let step_time_s = step_t0.elapsed().as_secs_f64();
            m.log(StepMetrics {
                step: step as u64,
                loss: l,
                lr,
                grad_norm: norm,
                tokens: (batch_tokens * o.dp) as u64,
                tokens_per_s: (batch_tokens * o.dp) as f64 / step_time_s,
                step_time_s,
                peak_host_bytes: memory::peak(mem_slot).max(0) as u64,
                peak_device_bytes: cuda_ordinal.map(tpar::kernels::cuda::device_peak_bytes),
                ..Default::default()
            });
        }
        if read {
            read_times.push((step - start_step, t0.elapsed().as_secs_f64()));
        }
        step_round_trips.push((logging, tpar::tensor::gpu::host_round_trips() - step_trips0));
        if let (Some(w0), Some(w1)) = (work0, cuda_ordinal.and_then(tpar::tensor::gpu::work_counts))
        {
            let wall_s = step_t0.elapsed().as_secs_f64();
            step_work.push(StepWork { logging, mode, work: w1 - w0, wall_s });
        }
        if let Some(c) = &mut ckpt {
            c.poll()?;
            if step.is_multiple_of(o.save_every) || step == o.steps {
                tpar::tensor::gpu::check_deferred_index_checks()?;
                with_items(
                    &mut run_config,
                    &mut model,
                    opt.as_mut(),
                    &mut sched,
                    &mut data,
                    &mut progress,
                    |items| Ok(c.save(step as u64, items)?),
                )?;
            }
        }
        if let Some(bar) = &progress_bar {
            let secs = t0.elapsed().as_secs_f64();
            let msg = format!("loss {l:.4} lr {lr:.2e} {:.0} tok/s", tokens as f64 / secs);
            if bar.is_hidden() {
                // Not a terminal: plain lines a log or a script can read.
                if step.is_multiple_of(o.log_every) || step == o.steps {
                    println!("epoch {epoch:>2} step {step:>4}/{} {msg}", o.steps);
                }
            } else {
                if read {
                    bar.set_message(format!("epoch {epoch} {msg}"));
                }
                bar.set_position(step as u64);
            }
        }
    }
    // No recorded index check goes unread (a no-op on the host).
    tpar::tensor::gpu::check_deferred_index_checks()?;
    if let Some(bar) = progress_bar {
        bar.finish();
    }
    args::MetricsArgs::finish(metrics);
    if let Some(c) = &mut ckpt {
        c.wait()?;
    }
    if let Some(path) = &o.save.export {
        tpar::checkpoint::export_safetensors(&tpar::nn::state_dict(&model)?, path, world)?;
        if rank == 0 {
            println!("exported the model to {}", path.display());
        }
    }
    o.hf.export(&tpar::nn::state_dict(&model)?, &cfg, hf.as_ref(), world)?;
    let state_bytes = opt.state_bytes();
    Ok(RankReport {
        ac,
        predicted_peak_bytes: predicted.peak,
        data_bytes,
        state_bytes,
        first_loss: progress.first_loss,
        final_loss: last,
        start_step,
        steps_run: step - start_step,
        tokens,
        seconds: t0.elapsed().as_secs_f64(),
        peak_bytes: memory::peak(mem_slot),
        device_peak_bytes: cuda_ordinal.map(tpar::kernels::cuda::device_peak_bytes),
        round_trips_per_step: (tpar::tensor::gpu::host_round_trips() - trips0) as f64
            / (step - start_step).max(1) as f64,
        step_round_trips,
        step_work,
        timeline: timeline.map(|t| {
            let p: Vec<(&str, &[tpar::collectives::CommRecord])> =
                phases.iter().map(|(n, r)| (*n, r.as_slice())).collect();
            format!("{}collectives of the last step:\n{}", t.render(72), explain_collectives(&p))
        }),
        read_times,
    })
}

/// Checks a batch's input ids and targets on the host (`pad` allowed in both) before
/// they go to a device, whose quiet steps read no index status back: an id outside
/// the vocabulary is an error naming the step, the tensor and the position.
fn check_batch_ids(batch: &Batch, vocab_size: usize, pad: i64, step: usize) -> tpar::Result<()> {
    for (what, t) in [("input id", &batch.input_ids), ("target", &batch.target_ids)] {
        let bad = t.with_data::<i64, _>(|v| {
            v.iter()
                .copied()
                .enumerate()
                .find(|&(_, i)| i != pad && (i < 0 || i as u64 >= vocab_size as u64))
        })?;
        if let Some((position, id)) = bad {
            return Err(NnError::Config {
                what: format!(
                    "step {}: {what} {id} at position {position} is outside the vocabulary of \
                     {vocab_size}",
                    step + 1,
                ),
            }
            .into());
        }
    }
    Ok(())
}

/// Defers this thread's device index checks while it lives (see
/// `tpar::tensor::gpu::defer_index_checks`), restoring the previous setting on drop.
struct DeferIndexChecks(bool);

impl DeferIndexChecks {
    fn on() -> Self {
        DeferIndexChecks(tpar::tensor::gpu::defer_index_checks(true))
    }
}

impl Drop for DeferIndexChecks {
    fn drop(&mut self) {
        tpar::tensor::gpu::defer_index_checks(self.0);
    }
}

/// A logging step's loss and gradient norm, read back together: one host round trip when
/// both are on one device (as f32, exact for an f32 or bf16 loss); each read on its own
/// otherwise (ZeRO-1's norm is already on the host).
fn read_loss_and_norm(loss: &Tensor, norm: &Tensor) -> tpar::Result<(f64, f64)> {
    if loss.device() != norm.device() {
        return Ok((loss.item()?, norm.item()?));
    }
    let both = [loss.reshape([1])?.to_dtype(DType::F32)?, norm.reshape([1])?.to_dtype(DType::F32)?];
    let v = Tensor::cat(&both, 0)?.to_vec::<f32>()?;
    Ok((f64::from(v[0]), f64::from(v[1])))
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("llama_2d: {e}");
            std::process::exit(2);
        }
    };
    tpar::tensor::use_deterministic_algorithms(o.deterministic);
    println!(
        "llama_2d: world {} = dp {}{} x tp {}, {} layers, hidden {}, heads {}/{}, seq {}, batch {} per dp rank, {} steps, {}, plan {}{}",
        o.world, o.dp, if o.cp > 1 { format!(" x cp {}", o.cp) } else { String::new() }, o.tp, o.layers, o.model.hidden, o.model.heads, o.model.kv_heads, o.model.seq, o.batch, o.steps, o.dtype, o.plan,
        match o.dp_mode {
            DpMode::Fsdp => ", FSDP",
            DpMode::Ddp => ", DDP",
            DpMode::Zero1 => ", ZeRO-1",
        }
    );
    let run = if o.backend != "local" {
        // One process per rank, started by torchrun or `tpar-run --nproc-per-node N`.
        memory::set_rank(Some(0));
        tpar::launch::init_process_group_with(&o.backend, std::time::Duration::from_secs(120))
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
        // Started by a launcher as one of several processes, each would train the whole
        // job on its own threads: refuse instead.
        // Owned: a rank stuck outside any collective cannot keep the process from exiting.
        let shared = std::sync::Arc::new(o.clone());
        tpar::launch::check_not_launched().map_err(tpar::Error::from).and_then(|()| {
            tpar::spawn_owned(SpawnConfig::new(o.world), move |ctx| {
                train(&ctx.world_group(), &shared)
            })
        })
    };
    let reports = match run {
        Ok(r) => r,
        Err(e) => {
            eprintln!("llama_2d: {e}");
            // A configuration the memory budget refuses: 2, as a bad flag.
            std::process::exit(if matches!(e, tpar::Error::Memory(_)) { 2 } else { 1 });
        }
    };
    let r0 = &reports[0];
    for (rank, r) in reports.iter().enumerate() {
        if let Some(t) = &r.timeline {
            println!("FSDP timeline of the last step, rank {rank}:\n{t}");
        }
    }
    let peaks: Vec<String> =
        reports.iter().map(|r| format!("{:.1}", r.peak_bytes as f64 / (1 << 20) as f64)).collect();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    // On CUDA the host figure is the host's allocations only; the device pool's
    // high-water mark follows it.
    let device_peaks: Option<Vec<String>> =
        reports.iter().map(|r| r.device_peak_bytes.map(|b| format!("{:.1}", mib(b)))).collect();
    match &device_peaks {
        Some(d) => println!(
            "peak memory per rank (MiB): host [{}], device [{}]",
            peaks.join(", "),
            d.join(", ")
        ),
        None => println!("peak memory per rank (MiB): [{}]", peaks.join(", ")),
    }
    let data_mib_max = run::report_data(&reports.iter().map(|r| r.data_bytes).collect::<Vec<_>>());
    let device_peak_max = match reports.iter().filter_map(|r| r.device_peak_bytes).max() {
        Some(b) => format!("{:.1}", mib(b)),
        None => "none".into(),
    };
    let states: Vec<String> =
        reports.iter().map(|r| format!("{:.1}", r.state_bytes as f64 / 1024.0)).collect();
    println!("optimizer state per rank (KiB): [{}]", states.join(", "));
    // Host calls that issued device work (launches, copies, graph replays) on rank 0's
    // last quiet step after the warm-up and the capture, where the device counts them.
    let launches_per_step = r0
        .step_work
        .iter()
        .rev()
        .find(|w| !w.logging && w.mode != "warmup" && w.mode != "captured")
        .map_or("none".to_string(), |w| w.work.host_calls.to_string());
    println!(
        "summary: world={} dp={} tp={} steps={} first_loss={:.4} final_loss={:.4} tokens_per_s={:.0} seconds={:.2} peak_mib_max={:.1} start_step={} end_step={} final_loss_bits={:016x} steady_step_s={:.4} ac={} cp={} predicted_peak_mib={:.1} device_peak_mib_max={} cp_method={} cuda_graph={} launches_per_step={} fuse_proj={} fuse_residual={} data_mib_max={:.1} deterministic={}",
        o.world,
        o.dp,
        o.tp,
        o.steps,
        r0.first_loss,
        r0.final_loss,
        r0.tokens as f64 / r0.seconds,
        r0.seconds,
        reports.iter().map(|r| r.peak_bytes).max().unwrap_or(0) as f64 / (1 << 20) as f64,
        r0.start_step,
        r0.start_step + r0.steps_run,
        r0.final_loss.to_bits(),
        r0.steady_step_s(),
        r0.ac,
        o.cp,
        reports.iter().map(|r| r.predicted_peak_bytes).max().unwrap_or(0) as f64 / (1 << 20) as f64,
        device_peak_max,
        o.cp_method.name(),
        u8::from(o.cuda_graph),
        launches_per_step,
        u8::from(o.fusion.projections),
        u8::from(o.fusion.residual),
        data_mib_max,
        u8::from(o.deterministic),
    );
    if o.device != "cpu" {
        // Ops without a device kernel and host-staged collectives, rank 0, per step.
        // And per step (checkpoint saves left out), logging steps and the others apart.
        let list = |logging: bool| -> String {
            let v: Vec<String> = r0
                .step_round_trips
                .iter()
                .filter(|(l, _)| *l == logging)
                .map(|(_, n)| n.to_string())
                .collect();
            v.join(",")
        };
        println!(
            "device: {} host round trips per step on rank 0 round_trips_logging={} round_trips_quiet={}",
            r0.round_trips_per_step,
            list(true),
            list(false)
        );
        // Where the device counts its work (the emulator), rank 0's steps: how each ran,
        // the host calls that issued work, the kernels and copies run (device-to-host reads
        // among them), and the wall time split into time inside the device's work and the
        // host's own time around it
        // (the emulator runs kernels on the host thread: the gaps a GPU would idle in).
        if !r0.step_work.is_empty() {
            let col = |f: &dyn Fn(&StepWork) -> String| -> String {
                r0.step_work.iter().map(f).collect::<Vec<_>>().join(",")
            };
            println!(
                "work: modes={} logging={} host_calls={} kernels={} copies={} dtoh_reads={} device_ms={} host_ms={}",
                col(&|w| w.mode.to_string()),
                col(&|w| u8::from(w.logging).to_string()),
                col(&|w| w.work.host_calls.to_string()),
                col(&|w| w.work.kernels_run.to_string()),
                col(&|w| w.work.copies_run.to_string()),
                col(&|w| w.work.dtoh_reads.to_string()),
                col(&|w| format!("{:.3}", w.work.device_ns as f64 / 1e6)),
                col(&|w| format!("{:.3}", (w.wall_s * 1e3 - w.work.device_ns as f64 / 1e6).max(0.0))),
            );
        }
        // With TPAR_CUDA_PROFILE=1: where the device time went, per kernel (stderr).
        if let Some(table) = tpar::kernels::cuda::profile::report() {
            eprint!("{table}");
        }
    }
    // A run that stopped early (or found its work done) need not show the fall.
    let finished = r0.start_step + r0.steps_run == o.steps && r0.steps_run > 0;
    let fell = r0.final_loss.is_finite() && r0.final_loss < r0.first_loss;
    if finished && !fell {
        // As llama_pp: fewer than 20 steps are too few to judge (a `--steps 1` run is valid).
        if r0.steps_run >= 20 {
            eprintln!("llama_2d: loss did not fall ({} -> {})", r0.first_loss, r0.final_loss);
            std::process::exit(1);
        }
        eprintln!(
            "llama_2d: warning: the loss did not fall, over a run too short to judge ({} steps)",
            r0.steps_run
        );
    }
}
