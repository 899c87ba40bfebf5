//! The command-line flags `llama_2d` and `llama_pp` share, with one default and one help
//! text each, flattened into each trainer's own `Parser` (`#[command(flatten)]`). Flags
//! whose default or text differs between the two (--steps, --batch, --layers, --lr,
//! --seed, --checkpoint-dir, --save-every, --stop-after, --nonfinite, --backend) stay in
//! each trainer.
#![allow(dead_code)]

use std::path::PathBuf;

use clap::Args;
use tpar::models::LlamaConfig;
use tpar::tensor::DType;

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
    /// Training text (documents separated by blank lines, or JSON lines with "text").
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json (default: bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
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
