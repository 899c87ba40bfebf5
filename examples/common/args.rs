//! The command-line flags `llama_2d` and `llama_pp` share, with one default and one help
//! text each, flattened into each trainer's own `Parser` (`#[command(flatten)]`). The
//! mesh degrees (--dp, --cp, --tp) and the flags whose default, text or meaning differs
//! between the two (--steps, --batch, --layers, --lr, --seed, --checkpoint-dir,
//! --save-every, --stop-after, --nonfinite, --backend, --no-fsdp, --log-every,
//! --timeline, --memory-budget, --fuse-proj, --fuse-residual) stay in each trainer.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use clap::Args;
use tpar::data::{MetricsConfig, MetricsLogger};
use tpar::dtensor::CpMethod;
use tpar::models::hf::{export_hf, HfCheckpoint, HfConfig, DEFAULT_SHARD_BYTES, TOKENIZER_FILE};
use tpar::models::memory::least_recompute;
use tpar::prelude::*;

/// The sequence length and the model's widths.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Query heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// MLP width.
    #[arg(long, default_value_t = 176)]
    pub intermediate: usize,
}

impl ModelArgs {
    /// Each flag's name and value, for [`crate::flags::positive`].
    pub fn sizes(&self) -> [(&'static str, usize); 5] {
        [
            ("--seq", self.seq),
            ("--hidden", self.hidden),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--intermediate", self.intermediate),
        ]
    }

    /// The Llama of these widths with `layers` decoder layers over a vocabulary of
    /// `vocab_size`, positions up to `--seq`, RMSNorm eps 1e-5 and RoPE theta 10000.
    pub fn llama_config(&self, vocab_size: usize, layers: usize, dtype: DType) -> LlamaConfig {
        LlamaConfig {
            vocab_size,
            max_position_embeddings: self.seq,
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            num_hidden_layers: layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            dtype,
        }
    }

    /// The size flags, for [`crate::flags::model_fits`]'s message.
    pub fn size_flags(&self, layers: usize) -> String {
        format!(
            "--layers {layers} (--hidden {}, --intermediate {})",
            self.hidden, self.intermediate
        )
    }
}

/// The training text and its tokenizer.
#[derive(Args, Clone, Debug)]
pub struct DataArgs {
    /// Training text: documents separated by blank lines, JSON lines (.jsonl), or parquet
    /// (a .parquet file, or a directory of them read in sorted order, as Hugging Face
    /// datasets saves them), whose --text-column holds the documents.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// The string column of parquet --data, or the string field of each JSON line, that
    /// holds the documents.
    #[arg(long, default_value = "text", requires = "data")]
    pub text_column: String,
    /// Read the documents in their order instead of shuffling them every epoch (as
    /// `DistributedSampler(shuffle=False)`); parquet --data is always streamed in file
    /// order.
    #[arg(long)]
    pub no_shuffle: bool,
    /// A Hugging Face tokenizer.json (default: bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

impl DataArgs {
    /// The training data these flags name.
    pub fn source(&self) -> crate::run::DataSource<'_> {
        crate::run::DataSource {
            path: self.data.as_deref(),
            text_column: &self.text_column,
            shuffle: !self.no_shuffle,
        }
    }
}

/// Per-step metrics files, written by the reporting rank off the training thread.
#[derive(Args, Clone, Debug)]
pub struct MetricsArgs {
    /// Write each step's loss, learning rate, gradient norm, tokens, tokens/s, step time
    /// and peak memory as one JSON object per line to FILE.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// Write the same figures as TensorBoard scalars to a new event file in DIR
    /// (events.out.tfevents.<time>.<host>).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
}

impl MetricsArgs {
    /// The writer of the files asked for, on the rank that `reports` (`None` elsewhere
    /// and when no file is asked for). A path that cannot be created fails here.
    pub fn start(&self, reports: bool) -> tpar::Result<Option<MetricsLogger>> {
        let config =
            MetricsConfig { jsonl: self.metrics.clone(), tensorboard: self.tensorboard.clone() };
        if !reports || !config.is_enabled() {
            return Ok(None);
        }
        Ok(Some(MetricsLogger::start(&config).map_err(DataError::from)?))
    }

    /// Closes the files; a write error is reported on stderr (the run's result stands).
    pub fn finish(logger: Option<MetricsLogger>) {
        if let Some(Err(e)) = logger.map(MetricsLogger::finish) {
            eprintln!("warning: {e}");
        }
    }
}

/// How checkpoints are written and resumed (each needs --checkpoint-dir), and the
/// trained model's export.
#[derive(Args, Clone, Debug)]
pub struct SaveArgs {
    /// Write checkpoints in the background while training goes on.
    #[arg(long, requires = "checkpoint_dir")]
    pub async_save: bool,
    /// Keep only the newest K checkpoints.
    #[arg(long, requires = "checkpoint_dir", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: Option<u64>,
    /// Resume with this run's --lr although the checkpoint was saved with another: the
    /// warmup-cosine schedule of the new --lr from the saved step on (optimizer state
    /// kept). Without it, a resume whose --lr (or any other setting of the model, the
    /// optimizer, the schedule or the data) differs from the checkpoint's is refused
    /// with the differences listed.
    #[arg(long, requires = "checkpoint_dir")]
    pub override_lr: bool,
    /// Write the trained model as one safetensors file (FQN keys) at the end.
    #[arg(long)]
    pub export: Option<PathBuf>,
}

/// Activation checkpointing of the decoder layers.
#[derive(Args, Clone, Debug)]
pub struct AcArgs {
    /// Activation checkpointing of the decoder layers: none; full (recompute every
    /// layer's activations in backward); full:K (every K-th layer); selective (keep the
    /// attention output and every second matmul's, recompute the other matmuls, norms,
    /// elementwise ops and RoPE);
    /// selective:K; selective[OPS] keeps the listed ops' outputs (matmul, sdpa, matmul/2:
    /// every second matmul, as torchtitan's selective AC); selective+full:K (every layer
    /// selective, every K-th full); auto (with --memory-budget): of none,
    /// selective[matmul,sdpa]:K, selective:K, full:K and selective+full:K, the policy the
    /// memory model predicts to fit the budget with the least recompute.
    #[arg(long, default_value = "none", value_parser = parse_ac)]
    pub ac: AcFlag,
}

/// What `--ac` asks for: a policy, or the one that fits `--memory-budget` best.
#[derive(Clone, Debug, PartialEq)]
pub enum AcFlag {
    /// This policy.
    Policy(AcPolicy),
    /// [`tpar::models::memory::least_recompute`] for the budget.
    Auto,
}

fn parse_ac(s: &str) -> Result<AcFlag, String> {
    if s.trim() == "auto" {
        return Ok(AcFlag::Auto);
    }
    s.parse().map(AcFlag::Policy).map_err(|e: NnError| e.to_string())
}

const AUTO_NEEDS_BUDGET: &str = "--ac auto needs --memory-budget GIB to choose for";

/// `gib` GiB in bytes.
pub fn gib_bytes(gib: f64) -> u64 {
    (gib * (1u64 << 30) as f64) as u64
}

impl AcArgs {
    /// Refuses `--ac auto` without a `--memory-budget` to choose for.
    pub fn check(&self, memory_budget: Option<f64>) -> Result<(), String> {
        match (&self.ac, memory_budget) {
            (AcFlag::Auto, None) => Err(AUTO_NEEDS_BUDGET.into()),
            _ => Ok(()),
        }
    }

    /// Sets `run.ac` to the policy to train with, and returns it: the flag's own, or under
    /// `auto` the one [`least_recompute`] picks for `run` (the run's configuration, whose
    /// own `ac` is not read) and `memory_budget` GiB, with `run.ac_weight_pass` its pick
    /// under a zero-bubble pipeline. Where `report`, `program` says the
    /// pick on stdout, or on stderr that no policy fits on its own (the error then names
    /// what would, as `--memory-budget` does).
    pub fn resolve(
        &self,
        run: &mut MemoryConfig,
        memory_budget: Option<f64>,
        program: &str,
        report: bool,
    ) -> tpar::Result<AcPolicy> {
        let policy = match (&self.ac, memory_budget) {
            (AcFlag::Policy(p), _) => p.clone(),
            (AcFlag::Auto, Some(gib)) => match least_recompute(run, gib_bytes(gib)) {
                Ok(choice) => {
                    if report {
                        println!("memory: --ac auto picks {choice}");
                    }
                    run.ac_weight_pass = choice.weight_pass;
                    choice.policy
                }
                Err(e) => {
                    if report {
                        eprintln!(
                            "{program}: --ac auto: no checkpointing policy fits --memory-budget \
                             on its own"
                        );
                    }
                    return Err(e.into());
                }
            },
            (AcFlag::Auto, None) => {
                return Err(NnError::Config { what: AUTO_NEEDS_BUDGET.into() }.into())
            }
        };
        run.ac = policy.clone();
        Ok(policy)
    }

    /// The policy written in the run's memory configuration before [`AcArgs::resolve`]
    /// (`none` under `auto`).
    pub fn fixed(&self) -> AcPolicy {
        match &self.ac {
            AcFlag::Policy(p) => p.clone(),
            AcFlag::Auto => AcPolicy::None,
        }
    }
}

/// How context parallelism's attention exchanges keys and values (with --cp > 1).
#[derive(Args, Clone, Copy, Debug)]
pub struct CpMethodArgs {
    /// With --cp: how attention exchanges keys and values between the cp ranks: ring
    /// (each rank's keys and values pass around the ring by send/recv, one hop per rank,
    /// so a rank holds two blocks at a time) or all-gather (one all_gather of every
    /// rank's keys and values, the backward a reduce_scatter of their gradients).
    #[arg(long = "cp-method", default_value = "ring", value_parser = parse_cp_method)]
    pub cp_method: CpMethod,
}

fn parse_cp_method(s: &str) -> Result<CpMethod, String> {
    match s {
        "ring" => Ok(CpMethod::Ring),
        "all-gather" => Ok(CpMethod::AllGather),
        other => Err(format!("--cp-method: ring or all-gather, not {other:?}")),
    }
}

impl CpMethodArgs {
    /// The method as the flag writes it (`ring`, `all-gather`).
    pub fn name(&self) -> &'static str {
        match self.cp_method {
            CpMethod::Ring => "ring",
            CpMethod::AllGather => "all-gather",
        }
    }
}

/// Start from a Hugging Face Llama directory, and write the trained model as one.
#[derive(Args, Clone, Debug)]
pub struct HfArgs {
    /// A Hugging Face Llama directory (config.json; model.safetensors, or shards and
    /// model.safetensors.index.json; tokenizer.json when present): the model's sizes come
    /// from its config.json (--layers, --hidden, --heads, --kv-heads and --intermediate
    /// are not used), its weights replace the initialization, and its tokenizer.json, when
    /// present and --tokenizer is not given, tokenizes the data.
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Write the trained model at the end as a Hugging Face Llama directory (config.json,
    /// safetensors shards and their index) that transformers' LlamaForCausalLM loads.
    #[arg(long)]
    pub export_hf: Option<PathBuf>,
    /// Largest safetensors file --export-hf writes, in bytes.
    #[arg(long, default_value_t = DEFAULT_SHARD_BYTES, requires = "export_hf",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub export_shard_size: u64,
}

impl HfArgs {
    /// The directory of --init-from, opened (its config and safetensors headers; the
    /// tensors are read later, each rank its own chunks), if given.
    pub fn open(&self) -> tpar::Result<Option<HfCheckpoint>> {
        Ok(self.init_from.as_deref().map(HfCheckpoint::open).transpose()?)
    }

    /// The tokenizer: --tokenizer when given, else the tokenizer.json of --init-from when
    /// it has one, else bytes.
    pub fn tokenizer(
        &self,
        given: Option<&Path>,
        ckpt: Option<&HfCheckpoint>,
    ) -> tpar::Result<Box<dyn Tokenizer>> {
        let from_dir = ckpt.map(|c| c.dir.join(TOKENIZER_FILE)).filter(|p| p.is_file());
        Ok(load_tokenizer(given.or(from_dir.as_deref()))?)
    }

    /// The model's configuration: the checkpoint's config.json in `from_flags`' dtype (its
    /// vocabulary must hold the tokenizer's `vocab` ids and its positions `seq` tokens;
    /// rank 0 prints its sizes), else `from_flags`.
    pub fn llama_config(
        &self,
        ckpt: Option<&HfCheckpoint>,
        from_flags: LlamaConfig,
        vocab: usize,
        seq: usize,
        rank: usize,
    ) -> tpar::Result<LlamaConfig> {
        let Some(c) = ckpt else { return Ok(from_flags) };
        let cfg = LlamaConfig { dtype: from_flags.dtype, ..c.config.llama };
        let dir = c.dir.display();
        if vocab > cfg.vocab_size {
            let what = format!(
                "--init-from {dir}: the tokenizer has {vocab} ids, config.json's vocab_size is {}",
                cfg.vocab_size
            );
            return Err(NnError::Config { what }.into());
        }
        if seq > cfg.max_position_embeddings {
            let what = format!(
                "--seq {seq} exceeds max_position_embeddings {} of --init-from {dir}",
                cfg.max_position_embeddings
            );
            return Err(NnError::Config { what }.into());
        }
        if rank == 0 {
            println!(
                "--init-from {dir}: {} layers, hidden {}, heads {} (kv {}), intermediate {}, vocab {}{}",
                cfg.num_hidden_layers,
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.intermediate_size,
                cfg.vocab_size,
                if c.config.tie_word_embeddings { ", tied embeddings" } else { "" }
            );
        }
        Ok(cfg)
    }

    /// --export-hf: writes the model of `state` (each rank's model state dict; collective
    /// over `group`, which holds every rank) and `cfg` there, keeping the token ids of
    /// --init-from's config.json.
    pub fn export(
        &self,
        state: &StateDict,
        cfg: &LlamaConfig,
        ckpt: Option<&HfCheckpoint>,
        group: &ProcessGroup,
    ) -> tpar::Result<()> {
        let Some(dir) = &self.export_hf else { return Ok(()) };
        let mut hf = ckpt.map_or_else(|| HfConfig::new(*cfg), |c| c.config.clone());
        hf.llama = *cfg;
        export_hf(state, &hf, dir, group, self.export_shard_size)?;
        if group.rank() == 0 {
            println!("exported the model as a Hugging Face Llama to {}", dir.display());
        }
        Ok(())
    }
}
