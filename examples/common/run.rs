//! Pieces the training examples share: the loop's checkpointed progress, the sampler
//! over a dataset, and the progress bar.

use indicatif::{ProgressBar, ProgressStyle};
use tpar::checkpoint::{ConfigValue, RunConfig};
use tpar::prelude::*;
use tpar::tensor::state::{expect_empty, take_float, take_int};

/// The loop's own place in the run, checkpointed with the model: the step reached (the
/// data position follows from it) and the run's first loss (for the summary).
pub struct Progress {
    pub step: usize,
    pub first_loss: f64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> Result<StateDict, StateDictError> {
        Ok(StateDict::from([
            ("step".to_string(), StateValue::Int(self.step as i64)),
            ("first_loss".to_string(), StateValue::Float(self.first_loss)),
        ]))
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> Result<(), StateDictError> {
        let step = take_int(&mut state, "step")?;
        self.step = usize::try_from(step).map_err(|_| StateDictError::Invalid {
            key: "step".into(),
            what: format!("{step} is negative"),
        })?;
        self.first_loss = take_float(&mut state, "first_loss")?;
        expect_empty(state)
    }
}

impl Progress {
    /// Checks the loaded trainer step against the checkpoint's (its directory's) step.
    pub fn check_resumed(&self, checkpoint_step: u64) -> tpar::Result<()> {
        if self.step as u64 != checkpoint_step {
            return Err(tpar::Error::from(StateDictError::Invalid {
                key: "trainer.step".into(),
                what: format!("{}, but the checkpoint is of step {checkpoint_step}", self.step),
            }));
        }
        Ok(())
    }
}

/// The gradient norm clipped to.
pub const MAX_GRAD_NORM: f64 = 1.0;

/// The optimizer and learning-rate schedule both trainers use: AdamW at peak `lr` with
/// betas (0.9, 0.99), eps 1e-8 and weight decay 0.1, gradients clipped to
/// [`MAX_GRAD_NORM`]; a linear warmup over a tenth of the steps (at least one), then
/// cosine to a tenth of `lr` at `steps`.
#[derive(Clone, Copy, Debug)]
pub struct Optim {
    pub adamw: AdamWConfig,
    pub steps: usize,
    pub warmup: usize,
}

impl Optim {
    /// The optimizer of peak learning rate `lr` over a schedule of `steps` steps.
    pub fn new(lr: f64, steps: usize) -> Self {
        Optim {
            adamw: AdamWConfig { lr, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 },
            steps,
            warmup: (steps / 10).max(1),
        }
    }

    /// The warmup-cosine schedule, for an `LrScheduler` over the optimizer.
    pub fn schedule(&self) -> tpar::Result<SequentialLR> {
        let lr = self.adamw.lr;
        Ok(SequentialLR::warmup_cosine(self.warmup, self.steps, 0.1, lr * 0.1)?)
    }
}

/// The training documents: those of `--data` (parquet's from `column`), or the built-in
/// text.
pub fn documents(data: Option<&std::path::Path>, column: &str) -> tpar::Result<Vec<String>> {
    Ok(match data {
        Some(p) => tpar::data::load_documents_with_column(p, column)?,
        None => default_documents().into_iter().map(String::from).collect(),
    })
}

/// What a training run is, as far as a resume must match it: the model, the optimizer's
/// hyper-parameters, the schedule and the data order.
pub struct Recipe<'a> {
    pub model: &'a LlamaConfig,
    /// The optimizer's hyper-parameters and the schedule.
    pub optim: &'a Optim,
    /// `--override-lr`: the learning rate may differ from the checkpoint's.
    pub override_lr: bool,
    /// Sequences per step over all dp ranks (the data order depends on it, not on dp).
    pub global_batch: usize,
    pub seq: usize,
    pub seed: u64,
    pub docs: &'a [String],
    /// Samples of the tokenized dataset (depends on the tokenizer).
    pub samples: usize,
}

/// The run's configuration as a checkpoint item: a resume must match the recipe, and
/// may change the `recorded` keys (mesh, plan, data-parallel mode, dtype), which the
/// checkpoint reshards across.
pub fn run_config(r: &Recipe, recorded: &[(&str, ConfigValue)]) -> RunConfig {
    let (m, a) = (r.model, &r.optim.adamw);
    // FNV-1a over the documents: a change of the training text is a change of data.
    let digest = r.docs.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, d| {
        d.bytes().chain([0xff]).fold(h, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    });
    let mut c = RunConfig::new()
        .require("model.vocab_size", m.vocab_size)
        .require("model.hidden_size", m.hidden_size)
        .require("model.intermediate_size", m.intermediate_size)
        .require("model.num_hidden_layers", m.num_hidden_layers)
        .require("model.num_attention_heads", m.num_attention_heads)
        .require("model.num_key_value_heads", m.num_key_value_heads)
        .require("model.rms_norm_eps", m.rms_norm_eps)
        .require("model.rope_theta", m.rope_theta)
        .require("model.rope_scaling", rope_scaling_text(m.rope_scaling.as_ref()))
        .require("optim.beta1", a.betas.0)
        .require("optim.beta2", a.betas.1)
        .require("optim.eps", a.eps)
        .require("optim.weight_decay", a.weight_decay)
        .require("optim.max_grad_norm", MAX_GRAD_NORM)
        .require("schedule.steps", r.optim.steps)
        .require("schedule.warmup", r.optim.warmup)
        .require("data.global_batch", r.global_batch)
        .require("data.seq", r.seq)
        .require("data.seed", r.seed)
        .require("data.samples", r.samples)
        .require("data.digest", format!("{digest:016x}"));
    c = if r.override_lr {
        c.record("optim.lr", a.lr)
    } else {
        c.require("optim.lr", a.lr)
            .note("optim.lr", "--override-lr resumes with this run's --lr on purpose")
    };
    for (k, v) in recorded {
        c = c.record(k, v.clone());
    }
    c
}

/// The shuffled sampler of dp rank `dp_rank` over `len` samples, and how many batches
/// of `batch` an epoch has (an error when the data is too small for one).
pub fn sampler(
    len: usize,
    dp: usize,
    dp_rank: usize,
    batch: usize,
    seed: u64,
) -> tpar::Result<(DistributedSampler, usize)> {
    let sampler = DistributedSampler::new(dp, dp_rank)?
        .with_shuffle(true)
        .with_seed(seed)
        .with_drop_last(true);
    let per_epoch = len / dp / batch.max(1);
    if per_epoch == 0 {
        return Err(tpar::Error::from(NnError::Config {
            what: format!("{len} documents are too few for dp {dp} x batch {batch}"),
        }));
    }
    Ok((sampler, per_epoch))
}

/// A progress bar over `steps` (loss, lr, tokens/s, ETA), starting at `start`.
pub fn progress_bar(steps: usize, start: usize) -> ProgressBar {
    let bar = ProgressBar::new(steps as u64);
    let style = "{bar:30} {pos:>4}/{len} {msg} ETA {eta}";
    bar.set_style(ProgressStyle::with_template(style).unwrap_or(ProgressStyle::default_bar()));
    bar.set_position(start as u64);
    bar
}

/// The slot of `tpar::tensor::memory` that a rank's allocations are credited to, for its
/// peak: a rank thread of the local backend is credited to its rank (`spawn` sets it);
/// a rank that is a process of its own (`own_process`: tcp or nccl under a launcher)
/// trains on the main thread, which `main` credits to slot 0, whatever the rank.
pub fn memory_slot(rank: usize, own_process: bool) -> usize {
    if own_process {
        0
    } else {
        rank
    }
}

/// A model's RoPE scaling as the run configuration records it (`none`, or its type and
/// numbers).
fn rope_scaling_text(r: Option<&tpar::models::RopeScaling>) -> String {
    use tpar::models::RopeScaling;
    match r {
        None => "none".into(),
        Some(RopeScaling::Linear { factor }) => format!("linear factor {factor}"),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => format!(
            "llama3 factor {factor} low {low_freq_factor} high {high_freq_factor} \
             original {original_max_position_embeddings}"
        ),
    }
}
