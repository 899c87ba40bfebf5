//! Pieces the training examples share: the loop's checkpointed progress, the training
//! data of a rank, and the progress bar.

use indicatif::{ProgressBar, ProgressStyle};
use tpar::checkpoint::{ConfigValue, RunConfig};
use tpar::data::{Batch, ParquetDocuments, PretrainingDataset, Tokenizer};
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
    /// What was read: [`TrainData::samples`] and [`TrainData::digest`].
    pub data: &'a TrainData<'a>,
}

/// The run's configuration as a checkpoint item: a resume must match the recipe, and
/// may change the `recorded` keys (mesh, plan, data-parallel mode, dtype), which the
/// checkpoint reshards across.
pub fn run_config(r: &Recipe, recorded: &[(&str, ConfigValue)]) -> RunConfig {
    let (m, a) = (r.model, &r.optim.adamw);
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
        .require("data.order", r.data.order())
        .require("data.samples", r.data.samples())
        .require("data.digest", format!("{:016x}", r.data.digest()));
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

/// FNV-1a over byte strings, each ended by 0xff: a change of the training data is a
/// change of this digest.
fn digest<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    parts.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, d| {
        d.iter().chain(&[0xff]).fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    })
}

/// The batches of one data-parallel rank, in step order, and their position as a
/// checkpoint item.
///
/// Text, JSON lines and the shipped corpus are held in memory and shuffled every epoch
/// (unless `--no-shuffle`) by a [`DistributedSampler`] (seeded, `drop_last`): the batch
/// of a step follows from the step. Parquet `--data` is streamed one row group at a time by
/// [`ParquetDocuments`], in file order, rank `r` of `dp` reading documents `r`,
/// `r + dp`, ...; an epoch ends at the end of the last file and the next one starts at
/// the first; the stream's position is what a checkpoint saves, so a resumed run reads
/// the batch an uninterrupted one would (also at another dp degree).
pub enum TrainData<'t> {
    Memory {
        dataset: PretrainingDataset,
        sampler: DistributedSampler,
        /// Batches per epoch.
        per_epoch: usize,
        /// FNV-1a over the documents.
        digest: u64,
        /// The sampler's order of the current epoch (`None` before the first batch).
        order: Option<(usize, Vec<usize>)>,
    },
    Parquet {
        stream: ParquetDocuments,
        tokenizer: &'t dyn Tokenizer,
        /// Rows of all files.
        rows: u64,
        /// FNV-1a over the column name and each file's name, size and rows.
        digest: u64,
    },
}

/// Where the training documents come from (the trainers' `--data`, `--text-column` and
/// `--no-shuffle`).
pub struct DataSource<'a> {
    /// The data path; the shipped corpus without one.
    pub path: Option<&'a std::path::Path>,
    /// The string column of parquet data.
    pub text_column: &'a str,
    /// Whether in-memory documents are shuffled every epoch.
    pub shuffle: bool,
}

impl<'t> TrainData<'t> {
    /// [`TrainData::open`] and what it left allocated on memory slot `slot`, in bytes (0
    /// when it freed more than it kept): what the measured host peak counts and the
    /// memory model's prediction (the model's state and its training step) does not.
    pub fn open_held(
        slot: usize,
        data: &DataSource,
        tokenizer: &'t dyn Tokenizer,
        seq: usize,
        dp: (usize, usize),
        batch: usize,
        seed: u64,
    ) -> tpar::Result<(TrainData<'t>, u64)> {
        let before = tpar::tensor::memory::current(slot);
        let t = TrainData::open(data, tokenizer, seq, dp, batch, seed)?;
        Ok((t, (tpar::tensor::memory::current(slot) - before).max(0) as u64))
    }

    /// The training data of `data` for dp rank `dp_rank` of `dp`, in batches of `batch`
    /// sequences of `seq` tokens.
    pub fn open(
        data: &DataSource,
        tokenizer: &'t dyn Tokenizer,
        seq: usize,
        (dp, dp_rank): (usize, usize),
        batch: usize,
        seed: u64,
    ) -> tpar::Result<TrainData<'t>> {
        if batch == 0 {
            return Err(config_err("the batch must be at least 1".into()));
        }
        if let Some(path) = data.path.filter(|p| tpar::data::is_parquet(p)) {
            let stream = ParquetDocuments::open(path, data.text_column)?
                .for_rank(dp, dp_rank)?
                .with_repeat(true);
            let mut parts: Vec<Vec<u8>> = vec![data.text_column.as_bytes().to_vec()];
            for f in stream.files() {
                let name = f.file_name().map_or(String::new(), |n| n.to_string_lossy().into());
                let len = std::fs::metadata(f).map_err(|e| {
                    config_err(format!("cannot read the size of {}: {e}", f.display()))
                })?;
                parts.push(format!("{name} {}", len.len()).into_bytes());
            }
            let rows = stream.num_rows()?;
            parts.push(rows.to_le_bytes().to_vec());
            let digest = digest(parts.iter().map(Vec::as_slice));
            return Ok(TrainData::Parquet { stream, tokenizer, rows, digest });
        }
        let docs: Vec<String> = match data.path {
            Some(p) => tpar::data::load_documents_with_column(p, data.text_column)?,
            None => default_documents().into_iter().map(String::from).collect(),
        };
        let dataset = PretrainingDataset::new(&docs, tokenizer, seq)?;
        let sampler = DistributedSampler::new(dp, dp_rank)?
            .with_shuffle(data.shuffle)
            .with_seed(seed)
            .with_drop_last(true);
        let per_epoch = dataset.len() / dp / batch;
        if per_epoch == 0 {
            let n = dataset.len();
            let are = if n == 1 { "document is" } else { "documents are" };
            return Err(config_err(format!("{n} {are} too few for dp {dp} x batch {batch}")));
        }
        let digest = digest(docs.iter().map(|d| d.as_bytes()));
        Ok(TrainData::Memory { dataset, sampler, per_epoch, digest, order: None })
    }

    /// Samples in the data: documents in memory, or rows of the parquet files.
    pub fn samples(&self) -> u64 {
        match self {
            TrainData::Memory { dataset, .. } => dataset.len() as u64,
            TrainData::Parquet { rows, .. } => *rows,
        }
    }

    /// How the documents are ordered: `shuffled` or `in order` (in memory), `streamed`
    /// (parquet).
    pub fn order(&self) -> &'static str {
        match self {
            TrainData::Memory { sampler, .. } if sampler.shuffle() => "shuffled",
            TrainData::Memory { .. } => "in order",
            TrainData::Parquet { .. } => "streamed",
        }
    }

    /// A digest of the data (the documents, or the parquet files' names, sizes and rows).
    pub fn digest(&self) -> u64 {
        match self {
            TrainData::Memory { digest, .. } | TrainData::Parquet { digest, .. } => *digest,
        }
    }

    /// This rank's batch of training step `step` (steps are taken in order from the
    /// resumed one) and the epoch it belongs to.
    pub fn batch(&mut self, step: usize, batch: usize, seq: usize) -> tpar::Result<(u64, Batch)> {
        match self {
            TrainData::Memory { dataset, sampler, per_epoch, order, .. } => {
                let epoch = step / *per_epoch;
                if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    sampler.set_epoch(epoch as u64);
                    *order = Some((epoch, sampler.indices(dataset.len())));
                }
                let Some((_, idx)) = order else { unreachable!("set above") };
                let at = (step % *per_epoch) * batch;
                Ok((epoch as u64, dataset.batch(&idx[at..at + batch])?))
            }
            TrainData::Parquet { stream, tokenizer, .. } => {
                // The epoch of the batch's first document.
                let epoch = stream.epoch();
                match stream.next_batch(batch, *tokenizer, seq)? {
                    Some(b) => Ok((epoch, b)),
                    None => Err(config_err("the parquet stream ended".into())),
                }
            }
        }
    }

    /// The checkpoint item of the data position: the sampler (in memory) or the
    /// stream's position (parquet).
    pub fn item(&mut self) -> (&'static str, &mut dyn Stateful) {
        match self {
            TrainData::Memory { sampler, .. } => ("sampler", sampler),
            TrainData::Parquet { stream, .. } => ("data", stream),
        }
    }
}

fn config_err(what: String) -> tpar::Error {
    tpar::Error::from(NnError::Config { what })
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

/// Prints what each rank's training data holds ([`TrainData::open_held`]) and returns the
/// largest, in MiB (the summary line's `data_mib_max`).
pub fn report_data(bytes: &[u64]) -> f64 {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let each: Vec<String> = bytes.iter().map(|&b| format!("{:.1}", mib(b))).collect();
    println!(
        "training data per rank (MiB, in the host peak, not in the prediction): [{}]",
        each.join(", ")
    );
    mib(bytes.iter().copied().max().unwrap_or(0))
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
