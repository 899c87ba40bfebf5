//! Pipeline-parallel Llama training: the model cut into stages over the `pp` mesh dim,
//! each batch into micro-batches run by a schedule (GPipe, 1F1B, interleaved 1F1B or
//! zero-bubble), composed with FSDP (or DDP) on `dp`, context parallelism on `cp` and
//! tensor + sequence parallelism on `tp`, on the embedded CPU backend (ranks as threads)
//! or one CPU process per rank over TCP (`--backend tcp`).
//!
//! Run: `cargo run --release --example llama_pp` (3 stages, 4 micro-batches, 1F1B);
//! `-- --schedule zb --pp 2 --dp 2 --tp 2` for a 3-D mesh of 8 ranks; `-- --help` lists
//! the flags. The rank of the last stage (dp 0, tp 0) reports progress; `--timeline`
//! prints the last step's measured timeline next to the schedule's own simulation.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, ValueEnum};

use tpar::data::StepMetrics;
use tpar::dtensor::CpLayout;
use tpar::models::context_parallel::{apply_context_parallel_stage, cp_token_share};
use tpar::models::LlamaFusion;
use tpar::pipeline::{Costs, Timeline};
use tpar::prelude::*;
use tpar::tensor::checkpoint::WeightPass;
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

/// Every checkpointed part of the run, by name: the run's configuration first, so a
/// resume that does not match stops before anything else loads.
fn items<'a>(
    config: &'a mut RunConfig,
    pipe: &'a mut PipelineSchedule,
    opt: &'a mut AdamW,
    sched: &'a mut LrScheduler<SequentialLR>,
    data: &'a mut run::TrainData,
    progress: &'a mut run::Progress,
) -> [(&'static str, &'a mut dyn Stateful); 6] {
    [
        ("config", config),
        ("model", pipe),
        ("optim", opt),
        ("lr_scheduler", sched),
        data.item(),
        ("trainer", progress),
    ]
}

use run::MAX_GRAD_NORM;

/// Pipeline-parallel Llama training (pp x dp x cp x tp ranks, as threads or one CPU
/// process per rank over TCP).
#[derive(Parser, Debug, Clone)]
#[command(name = "llama_pp", version)]
struct Opts {
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = SchedArg::OneFOneB)]
    schedule: SchedArg,
    /// Pipeline-parallel degree (ranks on the pp mesh dim).
    #[arg(long, default_value_t = 3)]
    pp: usize,
    /// Data-parallel degree (FSDP, or DDP with --no-fsdp).
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Context-parallel degree (the cp mesh dim, between dp and tp): each sequence is
    /// sharded over cp ranks (head and mirror tail chunks), every stage's attention passes
    /// keys and values around the cp ring (or gathers them: --cp-method all-gather), and
    /// FSDP or DDP runs over dp x cp.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Tensor-parallel degree (the sequence-parallel plan).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Stages per pp rank for the interleaved schedule.
    #[arg(long, default_value_t = 2)]
    stages_per_rank: usize,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Sequences per dp rank per step (a multiple of --microbatches).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Decoder layers.
    #[arg(long, default_value_t = 6)]
    layers: usize,
    #[command(flatten)]
    model: args::ModelArgs,
    /// Peak learning rate (linear warmup, then cosine to a tenth).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Replicate parameters over dp and all-reduce gradients (DDP) instead of FSDP.
    #[arg(long)]
    no_fsdp: bool,
    /// Seed of the parameters and the data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[command(flatten)]
    data: args::DataArgs,
    /// Log every N steps.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    log_every: u64,
    /// local (ranks as threads) or tcp (one CPU process per rank, from tpar-run or
    /// torchrun).
    #[arg(long, value_enum, default_value_t = BackendArg::Local)]
    backend: BackendArg,
    /// Print the last step's measured timeline and the schedule's simulated one.
    #[arg(long)]
    timeline: bool,
    /// Checkpoint directory: the run resumes from the newest checkpoint there (every
    /// stage's model, the optimizer, schedule, sampler and step) and saves one every
    /// --save-every steps.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (and after the last one).
    #[arg(long, default_value_t = 50, requires = "checkpoint_dir", value_parser = clap::value_parser!(u64).range(1..))]
    save_every: u64,
    #[command(flatten)]
    save: args::SaveArgs,
    #[command(flatten)]
    hf: args::HfArgs,
    #[command(flatten)]
    ac: args::AcArgs,
    /// What an activation-checkpointed layer holds between the zero-bubble schedule's
    /// input pass and weight pass: keep (the recomputed graph's weight half, one recompute;
    /// the default) or recompute (nothing of it; the weight pass recomputes the layer
    /// again). The same gradients either way. `--ac auto` chooses it with the policy.
    #[arg(long, value_parser = parse_weight_pass)]
    ac_weight_pass: Option<WeightPass>,
    #[command(flatten)]
    cp_method: args::CpMethodArgs,
    #[command(flatten)]
    metrics: args::MetricsArgs,
    /// Refuse to start (exit code 2, before the stages are built) when the predicted peak
    /// memory of a rank (tpar's memory model: parameters, gradients, optimizer state,
    /// the activations of the micro-batches in flight, the largest transient) exceeds
    /// this many GiB (under the interleaved schedule, of the rank's stages in the
    /// schedule's order), naming the changes on the same ranks with the same global
    /// batch that would fit.
    #[arg(long)]
    memory_budget: Option<f64>,
    /// End the run after step N, as an interruption would (the LR schedule still spans
    /// --steps); a later run with the same --checkpoint-dir resumes.
    #[arg(long)]
    stop_after: Option<usize>,
    /// On a non-finite loss or gradient norm: fail (stop with an error naming the step
    /// and the rank) or skip (zero the gradients, skip that optimizer step, log a line).
    #[arg(long, value_enum, default_value_t = NonFinite::Fail)]
    nonfinite: NonFinite,
    /// Compute q, k, v (and gate, up) of each decoder layer with one GEMM over the
    /// concatenated weights, where the plan allows it (no tensor-parallel plan on the
    /// projections; otherwise the separate projections run).
    #[arg(long)]
    fuse_proj: bool,
    /// Compute each decoder layer's residual adds in o_proj's and down_proj's GEMMs (on
    /// the host the same bits as without), where no parallel style sits on those modules.
    #[arg(long)]
    fuse_residual: bool,
}

fn parse_weight_pass(s: &str) -> Result<WeightPass, String> {
    WeightPass::parse(s).ok_or_else(|| format!("{s:?}: keep or recompute"))
}

impl Opts {
    /// Flags that cannot work, as one message (before any rank starts).
    fn check(&self) -> Result<(), String> {
        let mut sizes = vec![
            ("--pp", self.pp),
            ("--dp", self.dp),
            ("--cp", self.cp),
            ("--tp", self.tp),
            ("--stages-per-rank", self.stages_per_rank),
            ("--microbatches", self.microbatches),
            ("--steps", self.steps),
            ("--batch", self.batch),
        ];
        sizes.extend(self.model.sizes());
        flags::positive(&sizes)?;
        let m = &self.model;
        flags::llama_shape(m.hidden, m.heads, m.kv_heads)?;
        let world = self.pp.checked_mul(self.dp).and_then(|w| w.checked_mul(self.cp));
        if world.and_then(|w| w.checked_mul(self.tp)).is_none() {
            return Err(format!(
                "--pp {} x --dp {} x --cp {} x --tp {} overflows",
                self.pp, self.dp, self.cp, self.tp
            ));
        }
        flags::learning_rate(self.lr)?;
        if let Some(b) = self.memory_budget.filter(|b| !(b.is_finite() && *b > 0.0)) {
            return Err(format!("--memory-budget {b}: a positive number of GiB"));
        }
        self.ac.check(self.memory_budget)?;
        if let (args::AcFlag::Auto, Some(w)) = (&self.ac.ac, self.ac_weight_pass) {
            return Err(format!(
                "--ac auto chooses the weight pass with the policy: give --ac POLICY to set \
                 --ac-weight-pass {w}"
            ));
        }
        if self.backend == BackendArg::Local {
            let (pp, dp, tp) = (self.pp, self.dp, self.tp);
            let what = if self.cp > 1 {
                format!("--pp {pp} x --dp {dp} x --cp {} x --tp {tp}", self.cp)
            } else {
                format!("--pp {pp} x --dp {dp} x --tp {tp}")
            };
            flags::local_world(pp * dp * self.cp * tp, &what)?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum BackendArg {
    Local,
    Tcp,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum SchedArg {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    Interleaved,
    Zb,
}

impl SchedArg {
    fn kind(self) -> ScheduleKind {
        match self {
            SchedArg::Gpipe => ScheduleKind::GPipe,
            SchedArg::OneFOneB => ScheduleKind::OneFOneB,
            SchedArg::Interleaved => ScheduleKind::Interleaved1F1B,
            SchedArg::Zb => ScheduleKind::ZeroBubble,
        }
    }
}

/// What one rank reports at the end.
struct RankReport {
    /// The activation-checkpointing policy trained with (`--ac auto`'s pick).
    ac: AcPolicy,
    /// What its checkpointed layers held between the split backward's passes.
    ac_weight_pass: WeightPass,
    /// The memory model's predicted peak for this rank's stage (`None`: not modelled).
    predicted_peak_bytes: Option<u64>,
    /// Whether this rank printed the losses (last stage, dp 0, tp 0).
    reporter: bool,
    first_loss: f64,
    final_loss: f64,
    tokens: usize,
    seconds: f64,
    peak_bytes: i64,
    /// What the training data holds on this rank (in `peak_bytes`, not in the prediction).
    data_bytes: u64,
    start_step: usize,
    steps_run: usize,
    /// Measured bubble fraction of the last step (over every pp rank).
    bubble: f64,
    /// The schedule's simulated bubble (equal F, I, W costs).
    bubble_theory: f64,
}

fn train(world: &ProcessGroup, o: &Opts) -> tpar::Result<RankReport> {
    let rank = world.rank();
    let mesh = DeviceMesh::new(
        world,
        DeviceType::Cpu,
        &[o.pp, o.dp, o.cp, o.tp],
        &["pp", "dp", "cp", "tp"],
    )?;
    // The data-parallel mesh: dp, or dp x cp flattened under context parallelism.
    let dp_mesh = if o.cp > 1 { mesh.flatten(&["dp", "cp"], "dp_cp")? } else { mesh["dp"].clone() };
    let cp_group = mesh.group_of("cp")?.clone();
    let (pp_rank, dp_rank) = (mesh["pp"].local_rank(), mesh["dp"].local_rank());
    let kind = o.schedule.kind();
    let per_rank = if kind == ScheduleKind::Interleaved1F1B { o.stages_per_rank } else { 1 };
    let num_stages = o.pp * per_rank;
    let seq = o.model.seq;
    let hf = o.hf.open()?;
    let tokenizer = o.hf.tokenizer(o.data.tokenizer.as_deref(), hf.as_ref())?;
    let flags_cfg = o.model.llama_config(tokenizer.vocab_size(), o.layers, DType::F32);
    let cfg = o.hf.llama_config(hf.as_ref(), flags_cfg, tokenizer.vocab_size(), seq, rank)?;
    // A model whose training state this process cannot hold fails here, before anything
    // is built (the local backend holds every rank's share).
    let here = if o.backend == BackendArg::Local { world.size() } else { 1 };
    let sizes = o.model.size_flags(o.layers);
    flags::model_fits(&cfg, here, world.size(), &sizes).map_err(|what| NnError::Config { what })?;
    // The predicted peak of this rank's stage; over --memory-budget the run stops here,
    // before the stages are built.
    let mut run = memory_config(o, &cfg);
    // `--ac auto`: the policy that fits the budget with the least recompute.
    let ac = o.ac.resolve(&mut run, o.memory_budget, "llama_pp", rank == 0)?;
    let predicted = match predict_memory_stage(&run, pp_rank) {
        Ok(p) => Some(p),
        Err(MemoryError::Config { what }) if o.memory_budget.is_none() => {
            if rank == 0 {
                println!("memory: not predicted ({what})");
            }
            None
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(p) = &predicted {
        // One line per stage, from its first rank.
        if dp_rank == 0 && mesh["tp"].local_rank() == 0 {
            println!("memory: {p}");
        }
        if let Some(gib) = o.memory_budget {
            // Every rank checks the stage with the highest peak, so all stop alike, with
            // the configurations on the same ranks that would fit.
            check_fits(&run, args::gib_bytes(gib))?;
        }
        // The peaks of the ranks on this machine (under the local backend every pp
        // rank's, world / pp ranks each; under a process backend this rank's, once per
        // process the launcher started here) must fit it: a sequence or batch it cannot
        // hold stops here, before anything is built.
        let peaks = if here == 1 {
            vec![p.peak; flags::processes_on_this_machine()]
        } else {
            let mut peaks = Vec::with_capacity(here);
            for s in 0..o.pp {
                let peak = predict_memory_stage(&run, s)?.peak;
                peaks.extend(std::iter::repeat_n(peak, here / o.pp));
            }
            peaks
        };
        flags::peaks_fit(&peaks).map_err(|what| NnError::Config { what })?;
    }

    // This rank's stages (round-robin: r, r + pp, ...), each built on the meta device
    // with only its own layers, then parallelized and materialized.
    let mut stages = Vec::new();
    let mut ddps = Vec::new();
    for j in 0..per_rank {
        let index = pp_rank + j * o.pp;
        let mut stage = LlamaStage::for_stage(&cfg, index, num_stages, None, Device::Meta)?;
        let fusion = LlamaFusion { projections: o.fuse_proj, residual: o.fuse_residual };
        for layer in &mut stage.base_model.layers.items {
            layer.inner_mut().set_fusion(fusion);
        }
        if o.tp > 1 {
            let plan = sequence_parallel_layer_plan();
            parallelize_llama_stage(&mut stage, &mesh["tp"], &plan, &top_level_plan())?;
        }
        // Activation checkpointing after the plan and before FSDP (as torchtitan).
        apply_activation_checkpointing(&mut stage, &ac)?;
        if !o.no_fsdp && o.dp * o.cp > 1 {
            for layer in &mut stage.base_model.layers.items {
                fully_shard(layer, &dp_mesh, &FsdpConfig::default())?;
            }
            fully_shard(&mut stage, &dp_mesh, &FsdpConfig::default())?;
        }
        reset_parameters(&mut stage, Device::Cpu, o.seed)?;
        if let Some(hf) = &hf {
            hf.load_into(&mut stage)?;
        }
        if o.no_fsdp && o.dp * o.cp > 1 {
            ddps.push(DataParallel::new(&mut stage, &dp_mesh)?);
        }
        if o.cp > 1 {
            apply_context_parallel_stage(&mut stage, &cp_group, o.cp_method.cp_method)?;
        }
        stages.push(PipelineStage::new(stage, index, num_stages, &mesh["pp"], Device::Cpu)?);
    }
    // This rank's allocations, for its peak (a tcp process credits its own to slot 0);
    // what the training data holds is in the peak and not in the memory model's
    // prediction (which counts the stage's state and its training step), so it is
    // reported beside it.
    let mem_slot = run::memory_slot(rank, o.backend == BackendArg::Tcp);
    let (mut data, data_bytes) = run::TrainData::open_held(
        mem_slot,
        &o.data.source(),
        tokenizer.as_ref(),
        seq,
        (o.dp, dp_rank),
        o.batch,
        o.seed,
    )?;
    let ignore = tokenizer.pad_id() as i64;
    let vocab = cfg.vocab_size as isize;
    let (cp, loss_cp) = (o.cp, cp_group.clone());
    let loss_fn = move |logits: &Value, t: &Tensor| -> tpar::nn::Result<Value> {
        let loss = logits.reshape(&[-1, vocab])?.cross_entropy(&t.reshape([t.numel()])?, ignore)?;
        if cp == 1 {
            return Ok(loss);
        }
        // Under cp: this rank's share of the micro-batch's mean, times cp since the
        // gradient reduction averages over dp x cp.
        let share = cp_token_share(&t.reshape([t.numel()])?, ignore, &loss_cp)?;
        loss.mul_scalar(share * cp as f64)
    };
    let mut pipe = PipelineSchedule::new(kind, stages, o.microbatches, loss_fn)?;
    pipe.set_ac_weight_pass(run.ac_weight_pass);
    if rank == 0 {
        println!(
            "schedule {} ({} stages on {} pp ranks):\n{}",
            kind,
            num_stages,
            o.pp,
            pipe.schedule()
        );
    }

    let named: Vec<(String, Param)> =
        pipe.stages().iter().flat_map(|s| named_parameters(s.module())).collect();
    let params: Vec<Param> = named.iter().map(|(_, p)| p.clone()).collect();
    let optim = run::Optim::new(o.lr, o.steps);
    let mut opt = AdamW::with_names(named, optim.adamw)?;
    let mut sched = LrScheduler::new(optim.schedule()?, &mut opt);
    if o.save.override_lr {
        sched.override_on_load();
    }

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
            ("mesh.world", world.size().into()),
            ("mesh.pp", o.pp.into()),
            ("mesh.dp", o.dp.into()),
            ("mesh.cp", o.cp.into()),
            ("mesh.tp", o.tp.into()),
            ("pipeline.schedule", o.schedule.kind().to_string().into()),
            ("pipeline.microbatches", o.microbatches.into()),
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
            let resumed = c.load_latest(&mut items(
                &mut run_config,
                &mut pipe,
                &mut opt,
                &mut sched,
                &mut data,
                &mut progress,
            ))?;
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

    // The rank that reports: the last stage's, at dp 0 and tp 0.
    let last_rank = pipe.schedule().rank_of_stage(num_stages - 1);
    let has_last = pp_rank == last_rank;
    let reporter =
        has_last && dp_rank == 0 && mesh["cp"].local_rank() == 0 && mesh["tp"].local_rank() == 0;
    let cp_layout = CpLayout::new(seq, o.cp)?;
    let dp_group = mesh.group_of("dp")?.clone();
    let pp_group = mesh.group_of("pp")?.clone();
    let _loss_parallel = loss_parallel::enable(&mesh["tp"]);
    let bar = reporter.then(|| run::progress_bar(o.steps, start_step));
    // --metrics / --tensorboard: the reporting rank (last stage) writes them.
    let metrics = o.metrics.start(reporter)?;
    memory::reset_peak(mem_slot);
    let t0 = Instant::now();
    let (mut last, mut tokens) = (f64::NAN, 0usize);
    let mut step = progress.step;
    let mut timeline = Timeline::default();
    while step < stop {
        let step_t0 = Instant::now();
        let (epoch, batch) = data.batch(step, o.batch, seq)?;
        // DDP: the micro-batches' gradients accumulate on each rank; the sum is
        // averaged over dp once, after the schedule.
        let no_sync: Vec<_> = ddps.iter().map(DataParallel::no_sync).collect();
        // Under context parallelism this rank's chunks of every sequence.
        let cut = |t: &Tensor| -> tpar::Result<Tensor> {
            Ok(if o.cp > 1 { cp_layout.shard(t, 1, cp_group.rank())? } else { t.clone() })
        };
        let losses = pipe.step_with(
            Some(&cut(&batch.input_ids)?),
            &[cut(&batch.attention_mask)?],
            Some(&cut(&batch.target_ids)?),
        )?;
        drop(no_sync);
        if o.nonfinite == NonFinite::Fail {
            if let Some(i) = losses.iter().position(|l| !l.is_finite()) {
                // Fail fast, here: peers waiting in the next collective fail naming
                // this rank.
                return Err(NnError::NonFinite {
                    what: format!("step {} on rank {rank}: the loss of micro-batch {i}", step + 1),
                    value: losses[i],
                }
                .into());
            }
        }
        for (ddp, s) in ddps.iter().zip(pipe.stages()) {
            ddp.sync_gradients(s.module())?;
        }
        // The norm is over every stage (all-reduced): every rank takes the same branch.
        let clip = ClipOptions::default().pp(&pp_group);
        let norm = clip_grad_norm_(&params, MAX_GRAD_NORM, &clip)?.item()?;
        if norm.is_finite() {
            opt.step()?;
        } else if o.nonfinite == NonFinite::Fail {
            return Err(NnError::NonFinite {
                what: format!("step {} on rank {rank}: the gradient norm", step + 1),
                value: norm,
            }
            .into());
        } else if reporter {
            println!("step {}: non-finite gradient norm {norm}: optimizer step skipped", step + 1);
        }
        let lr = sched.step(&mut opt);
        opt.zero_grad();
        let step_tokens = batch.num_tokens()? * o.dp;
        tokens += step_tokens;
        step += 1;
        progress.step = step;
        if has_last {
            // The step's loss: the mean of the micro-batch losses, averaged over dp.
            let mut mean = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
            if o.cp > 1 {
                // Each cp rank's losses are its shares (times cp): their sum over cp
                // is this dp rank's.
                let share = Tensor::scalar(mean / o.cp as f64, DType::F64);
                mean = cp_group.all_reduce(&share, ReduceOp::Sum)?.item()?;
            }
            let l = dp_group.all_reduce(&Tensor::scalar(mean, DType::F64), ReduceOp::Avg)?;
            last = l.item()?;
        }
        if let Some(m) = &metrics {
            let step_time_s = step_t0.elapsed().as_secs_f64();
            m.log(StepMetrics {
                step: step as u64,
                loss: last,
                lr,
                grad_norm: norm,
                tokens: step_tokens as u64,
                tokens_per_s: step_tokens as f64 / step_time_s,
                step_time_s,
                peak_host_bytes: memory::peak(mem_slot).max(0) as u64,
                ..Default::default()
            });
        }
        if step == 1 {
            // Every rank keeps the first loss (it is checkpointed from any of them).
            let first = Tensor::scalar(if has_last { last } else { 0.0 }, DType::F64);
            progress.first_loss = pp_group.broadcast(&first, last_rank)?.item()?;
        }
        if let Some(c) = &mut ckpt {
            c.poll()?;
            if step.is_multiple_of(o.save_every as usize) || step == o.steps {
                c.save(
                    step as u64,
                    &mut items(
                        &mut run_config,
                        &mut pipe,
                        &mut opt,
                        &mut sched,
                        &mut data,
                        &mut progress,
                    ),
                )?;
            }
        }
        if let Some(bar) = &bar {
            let secs = t0.elapsed().as_secs_f64();
            let msg = format!("loss {last:.4} lr {lr:.2e} {:.0} tok/s", tokens as f64 / secs);
            if bar.is_hidden() {
                if step.is_multiple_of(o.log_every as usize) || step == o.steps {
                    println!("epoch {epoch:>2} step {step:>4}/{} {msg}", o.steps);
                }
            } else {
                bar.set_message(format!("epoch {epoch} {msg}"));
                bar.set_position(step as u64);
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    args::MetricsArgs::finish(metrics);
    if step > start_step {
        timeline = pipe.gather_timeline()?;
    }
    if let Some(c) = &mut ckpt {
        c.wait()?;
    }
    if let Some(path) = &o.save.export {
        tpar::checkpoint::export_safetensors(&pipe.state_dict()?, path, world)?;
        if rank == 0 {
            println!("exported the model to {}", path.display());
        }
    }
    o.hf.export(&pipe.state_dict()?, &cfg, hf.as_ref(), world)?;
    if o.timeline && rank == 0 && step > start_step {
        println!(
            "measured timeline of the last step (rank 0's dp/tp replica):\n{}",
            timeline.render()
        );
        let sim = pipe.schedule().simulate(&Costs::unit())?;
        println!("simulated timeline (F = I = W = 1):\n{}", sim.render());
    }
    Ok(RankReport {
        ac,
        ac_weight_pass: run.ac_weight_pass,
        predicted_peak_bytes: predicted.map(|p| p.peak),
        reporter,
        first_loss: progress.first_loss,
        final_loss: last,
        tokens,
        seconds: t0.elapsed().as_secs_f64(),
        peak_bytes: memory::peak(mem_slot),
        data_bytes,
        start_step,
        steps_run: step - start_step,
        bubble: timeline.bubble_fraction(),
        bubble_theory: pipe.schedule().bubble(),
    })
}

/// The memory model's prediction for pipeline stage `stage` of this run.
/// This run for the memory model.
fn memory_config(o: &Opts, cfg: &LlamaConfig) -> MemoryConfig {
    let data_parallel = match (o.dp > 1, o.no_fsdp) {
        (false, _) => DataParallelMode::None,
        (true, false) => DataParallelMode::Fsdp { param_dtype: None },
        (true, true) => DataParallelMode::Ddp,
    };
    MemoryConfig {
        dp: o.dp,
        cp: o.cp,
        tp: o.tp,
        pp: o.pp,
        data_parallel,
        plan: TpPlan::SequenceParallel,
        microbatches: o.microbatches,
        schedule: o.schedule.kind(),
        stages_per_rank: if o.schedule.kind() == ScheduleKind::Interleaved1F1B {
            o.stages_per_rank
        } else {
            1
        },
        cp_method: o.cp_method.cp_method,
        ac: o.ac.fixed(),
        ac_weight_pass: o.ac_weight_pass.unwrap_or_default(),
        fusion: LlamaFusion { projections: o.fuse_proj, residual: o.fuse_residual },
        ..MemoryConfig::new(*cfg, o.batch, o.model.seq)
    }
}

fn main() {
    let o = Opts::parse();
    if let Err(e) = o.check() {
        eprintln!("llama_pp: {e}");
        std::process::exit(2);
    }
    let world = o.pp * o.dp * o.cp * o.tp;
    println!(
        "llama_pp: world {world} = pp {} x dp {}{} x tp {}, schedule {}, {} micro-batches, {} layers, hidden {}, seq {}, batch {} per dp rank, {} steps{}",
        o.pp, o.dp, if o.cp > 1 { format!(" x cp {}", o.cp) } else { String::new() }, o.tp, o.schedule.kind(), o.microbatches, o.layers, o.model.hidden, o.model.seq, o.batch, o.steps,
        if o.dp > 1 { if o.no_fsdp { ", DDP" } else { ", FSDP" } } else { "" }
    );
    let run = if o.backend == BackendArg::Tcp {
        // One CPU process per rank, started by tpar-run or torchrun; the process holding
        // the reporting rank prints the summary.
        memory::set_rank(Some(0));
        tpar::launch::init_process_group_with("tcp", std::time::Duration::from_secs(120))
            .map_err(tpar::Error::from)
            .and_then(|group| {
                if group.size() != world {
                    return Err(tpar::Error::from(NnError::Config {
                        what: format!(
                            "pp {} x dp {} x cp {} x tp {} is {world} ranks, but the launcher started {}",
                            o.pp,
                            o.dp,
                            o.cp,
                            o.tp,
                            group.size()
                        ),
                    }));
                }
                let report = train(&group, &o)?;
                group.barrier()?;
                if !report.reporter {
                    std::process::exit(0);
                }
                Ok(vec![report])
            })
    } else {
        // Started by a launcher as one of several processes, each would train the whole
        // job on its own threads: refuse instead.
        // Owned: a rank stuck outside any collective cannot keep the process from exiting.
        let shared = o.clone();
        tpar::launch::check_not_launched().map_err(tpar::Error::from).and_then(|()| {
            tpar::spawn_owned(SpawnConfig::new(world), move |ctx| {
                train(&ctx.world_group(), &shared)
            })
        })
    };
    let reports = match run {
        Ok(r) => r,
        Err(e) => {
            eprintln!("llama_pp: {e}");
            // A configuration the memory budget refuses: 2, as a bad flag.
            std::process::exit(if matches!(e, tpar::Error::Memory(_)) { 2 } else { 1 });
        }
    };
    let Some(r) = reports.iter().find(|r| r.reporter) else {
        eprintln!("llama_pp: no rank held the last stage");
        std::process::exit(1);
    };
    let peaks: Vec<String> =
        reports.iter().map(|r| format!("{:.1}", r.peak_bytes as f64 / (1 << 20) as f64)).collect();
    println!("peak memory per rank (MiB): [{}]", peaks.join(", "));
    let data_mib_max = run::report_data(&reports.iter().map(|r| r.data_bytes).collect::<Vec<_>>());
    // device_peak_mib_max (llama_2d's key): none, the stages run on the host.
    println!(
        "summary: world={world} pp={} dp={} tp={} schedule={} microbatches={} steps={} first_loss={:.4} final_loss={:.4} tokens_per_s={:.0} seconds={:.2} peak_mib_max={:.1} bubble={:.3} bubble_theory={:.3} start_step={} end_step={} final_loss_bits={:016x} ac={} predicted_peak_mib={} cp={} device_peak_mib_max=none cp_method={} fuse_proj={} fuse_residual={} data_mib_max={:.1} ac_weight_pass={}",
        o.pp,
        o.dp,
        o.tp,
        o.schedule.kind().name(),
        o.microbatches,
        o.steps,
        r.first_loss,
        r.final_loss,
        r.tokens as f64 / r.seconds,
        r.seconds,
        reports.iter().map(|r| r.peak_bytes).max().unwrap_or(0) as f64 / (1 << 20) as f64,
        r.bubble,
        r.bubble_theory,
        r.start_step,
        r.start_step + r.steps_run,
        r.final_loss.to_bits(),
        r.ac,
        match reports.iter().map(|r| r.predicted_peak_bytes).collect::<Option<Vec<u64>>>() {
            Some(p) => format!("{:.1}", p.into_iter().max().unwrap_or(0) as f64 / (1 << 20) as f64),
            None => "none".into(),
        },
        o.cp,
        o.cp_method.name(),
        u8::from(o.fuse_proj),
        u8::from(o.fuse_residual),
        data_mib_max,
        r.ac_weight_pass,
    );
    let finished = r.start_step + r.steps_run == o.steps && r.steps_run > 0;
    let fell = r.final_loss.is_finite() && r.final_loss < r.first_loss;
    if finished && !fell {
        if r.steps_run >= 20 {
            eprintln!("llama_pp: loss did not fall ({} -> {})", r.first_loss, r.final_loss);
            std::process::exit(1);
        }
        eprintln!(
            "llama_pp: warning: the loss did not fall, over a run too short to judge ({} steps)",
            r.steps_run
        );
    }
}
