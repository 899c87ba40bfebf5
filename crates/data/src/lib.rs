//! The data pipeline of a pretraining run: a [`DistributedSampler`], tokenizers (a
//! byte-level [`ByteTokenizer`], and [`HfTokenizer`] for HuggingFace `tokenizer.json`
//! files, run by Hugging Face's `tokenizers` crate under the default-on `hf-tokenizers`
//! feature),
//! the [`PretrainingDataset`] with its [`collate`] function, and a small corpus shipped
//! in the crate ([`default_corpus`]) so a trainer runs with no download.
//!
//! ```
//! use tpar_data::{default_documents, ByteTokenizer, DistributedSampler, PretrainingDataset};
//! let docs = default_documents();
//! let ds = PretrainingDataset::new(&docs, &ByteTokenizer, 32)?;
//! // dp rank 1 of 2: every tp rank of that dp group builds the same sampler.
//! let mut sampler = DistributedSampler::new(2, 1)?.with_seed(7);
//! sampler.set_epoch(0);
//! let indices = sampler.indices(ds.len());
//! let batch = ds.batch(&indices[..4])?;
//! assert_eq!(batch.input_ids.dims(), &[4, 32]);
//! # Ok::<(), tpar_data::DataError>(())
//! ```

#![warn(missing_docs)]

#[cfg(feature = "hf-tokenizers")]
mod hf;
#[cfg(not(feature = "hf-tokenizers"))]
#[path = "hf_unavailable.rs"]
mod hf;
pub mod metrics;
pub mod parquet;

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tpar_tensor::state::{expect_empty, take_int, StateDict, StateDictError, StateValue};
use tpar_tensor::Tensor;

pub use crate::parquet::{is_parquet, ParquetDocuments, ParquetProblem};
pub use hf::HfTokenizer;
pub use metrics::{MetricsConfig, MetricsError, MetricsLogger, StepMetrics};
/// The Hugging Face `tokenizers` crate [`HfTokenizer`] wraps, re-exported so
/// [`HfTokenizer::inner`] and [`HfTokenizer::from_hf`] meet the same version.
#[cfg(feature = "hf-tokenizers")]
pub use tokenizers;

/// Errors of the data pipeline: bad files, bad settings, and tensor errors while
/// building batches.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DataError {
    /// A file, a tokenizer or a setting that cannot work, with the numbers or the path.
    #[error("{what}")]
    Config {
        /// What is wrong.
        what: String,
    },
    /// The Hugging Face `tokenizers` crate could not read a `tokenizer.json`, or failed
    /// on a text.
    #[error("tokenizer {origin}: {op}: {why}")]
    Tokenizer {
        /// What failed: `read`, `load`, `encode` or `decode`.
        op: &'static str,
        /// The file's path, or where the tokenizer came from when there is no file.
        origin: String,
        /// The reason, as the file system or `tokenizers` gave it.
        why: String,
    },
    /// A part of the pipeline this build left out (a cargo feature that is off).
    #[error("{what} is unavailable: {why}")]
    Unavailable {
        /// What was asked for.
        what: &'static str,
        /// Why it is missing and how to get it.
        why: &'static str,
    },
    /// A parquet file that cannot serve as documents: unreadable, without the column, a
    /// column that is not strings, a null or non-UTF-8 value.
    #[error("parquet file {file}, column \"{column}\": {problem}")]
    Parquet {
        /// The file's path.
        file: String,
        /// The column asked for.
        column: String,
        /// What is wrong.
        problem: ParquetProblem,
    },
    /// A metrics file could not be created or written.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// A tensor op failed while building a batch.
    #[error(transparent)]
    Tensor(#[from] tpar_tensor::TensorError),
}

/// `Result` with [`DataError`].
pub type Result<T, E = DataError> = std::result::Result<T, E>;

fn config_err(what: impl Into<String>) -> DataError {
    DataError::Config { what: what.into() }
}

// ---------------------------------------------------------------------------------------
// Distributed sampler
// ---------------------------------------------------------------------------------------

/// `torch.utils.data.DistributedSampler`: splits a dataset's indices among
/// `num_replicas` data-parallel ranks, each taking `rank, rank + num_replicas, ...` of a
/// (possibly shuffled) list padded to a multiple of `num_replicas` by wrapping around
/// (or cut to one, with `drop_last`).
///
/// In a 2-D (dp, tp) run every rank of one tp group must see the same batch, so use
/// `num_replicas = mesh["dp"].size()` and `rank = mesh["dp"].local_rank()`.
///
/// **Equal to torch's, and where it differs.** Without shuffling, every rank's indices
/// equal torch's exactly. With shuffling, the order differs from torch's: the
/// permutation is `rand`'s Fisher–Yates shuffle driven by ChaCha8 seeded with
/// `seed + epoch`, not `torch.randperm` under torch's generator. What stays equal is
/// the structure: each rank's number of indices ([`DistributedSampler::num_samples`]),
/// one permutation per (seed, epoch) shared by every rank (which depends on
/// `seed + epoch` only, as torch's does), rank `r` taking its positions
/// `r, r + num_replicas, ...`, and the padding (the permutation's first entries,
/// wrapping around) or, with `drop_last`, the cut (the permutation's tail). A run
/// resumed from a torch run's epoch therefore sees the same number of batches but
/// different samples in them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler for `rank` of `num_replicas`, with torch's defaults (shuffle on, seed 0,
    /// drop_last off, epoch 0).
    pub fn new(num_replicas: usize, rank: usize) -> Result<DistributedSampler> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(config_err(format!(
                "DistributedSampler: invalid rank {rank}, rank should be in the interval \
                 [0, {}]",
                num_replicas.saturating_sub(1)
            )));
        }
        Ok(DistributedSampler {
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// Turns shuffling on or off.
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Sets the seed (the same on every rank).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drops the tail that does not divide evenly instead of padding.
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which reseeds the shuffle (call it at the start of every epoch).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Whether the order is shuffled every epoch.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// The epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The number of replicas.
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// This replica's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Indices this rank gets per epoch from a dataset of `len` items.
    pub fn num_samples(&self, len: usize) -> usize {
        if self.drop_last && !len.is_multiple_of(self.num_replicas) {
            len / self.num_replicas
        } else {
            len.div_ceil(self.num_replicas)
        }
    }

    /// `num_samples(len) * num_replicas`.
    pub fn total_size(&self, len: usize) -> usize {
        self.num_samples(len) * self.num_replicas
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&self, len: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..len).collect();
        if self.shuffle {
            // ChaCha8 (a stream fixed across platforms and `rand` releases), seeded
            // alike on every rank, so the ranks agree on the permutation.
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(self.epoch));
            all.shuffle(&mut rng);
        }
        let total = self.total_size(len);
        if total > len {
            // Pad by wrapping around (repeating the list as often as needed).
            let pad: Vec<usize> = all.iter().copied().cycle().take(total - len).collect();
            all.extend(pad);
        } else {
            all.truncate(total);
        }
        all.into_iter().skip(self.rank).step_by(self.num_replicas).collect()
    }
}

// ---------------------------------------------------------------------------------------
// Tokenizers
// ---------------------------------------------------------------------------------------

/// What the data pipeline needs from a tokenizer: text to ids and back, and the ids of
/// the three specials a pretraining sequence uses.
///
/// `encode` and `decode` return errors rather than guess: [`HfTokenizer`]'s pass on
/// what the `tokenizers` crate reports ([`DataError::Tokenizer`]); [`ByteTokenizer`]'s
/// never fail.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text` (no specials added).
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// The text of `ids`, skipping special tokens and unknown ids.
    fn decode(&self, ids: &[u32]) -> Result<String>;
    /// Number of ids (one more than the largest id).
    fn vocab_size(&self) -> usize;
    /// Id of the beginning-of-text special, `[BOT]`.
    fn bot_id(&self) -> u32;
    /// Id of the end-of-text special, `[EOT]`.
    fn eot_id(&self) -> u32;
    /// Id of the padding special, `[PAD]` (also the loss's ignore_index).
    fn pad_id(&self) -> u32;
}

/// The sampler's place in the run: `epoch` and `seed` (restored on load) and, for the
/// record, `num_replicas`, `shuffle` and `drop_last` (a run may resume with another
/// data-parallel degree, so the sampler keeps its own replicas and rank).
impl tpar_tensor::state::Stateful for DistributedSampler {
    fn state_dict(&self) -> std::result::Result<StateDict, StateDictError> {
        Ok(StateDict::from([
            ("epoch".to_string(), StateValue::Int(self.epoch as i64)),
            ("seed".to_string(), StateValue::Int(self.seed as i64)),
            ("num_replicas".to_string(), StateValue::Int(self.num_replicas as i64)),
            ("shuffle".to_string(), StateValue::Int(self.shuffle as i64)),
            ("drop_last".to_string(), StateValue::Int(self.drop_last as i64)),
        ]))
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> std::result::Result<(), StateDictError> {
        let epoch = take_int(&mut state, "epoch")?;
        self.epoch = u64::try_from(epoch).map_err(|_| StateDictError::Invalid {
            key: "epoch".into(),
            what: format!("{epoch} is negative"),
        })?;
        // The seed's bits, as saved.
        self.seed = take_int(&mut state, "seed")? as u64;
        for k in ["num_replicas", "shuffle", "drop_last"] {
            take_int(&mut state, k)?;
        }
        expect_empty(state)
    }
}

/// A byte-level tokenizer: ids 0..=255 are the bytes of the UTF-8 text, then the
/// specials `[BOT]` = 256, `[EOT]` = 257, `[PAD]` = 258 (vocabulary of 259). Any text
/// encodes without an unknown token and decodes back exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Id of `[BOT]`.
    pub const BOT: u32 = 256;
    /// Id of `[EOT]`.
    pub const EOT: u32 = 257;
    /// Id of `[PAD]`.
    pub const PAD: u32 = 258;
    /// Number of ids.
    pub const VOCAB_SIZE: usize = 259;
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn bot_id(&self) -> u32 {
        Self::BOT
    }

    fn eot_id(&self) -> u32 {
        Self::EOT
    }

    fn pad_id(&self) -> u32 {
        Self::PAD
    }
}

/// The tokenizer a trainer's `--tokenizer` flag names: a HuggingFace `tokenizer.json`
/// ([`HfTokenizer::from_file`]), or the [`ByteTokenizer`] without one.
pub fn load_tokenizer(path: Option<&Path>) -> Result<Box<dyn Tokenizer>> {
    Ok(match path {
        Some(p) => Box::new(HfTokenizer::from_file(p)?),
        None => Box::new(ByteTokenizer),
    })
}

// ---------------------------------------------------------------------------------------
// Corpus
// ---------------------------------------------------------------------------------------

static CORPUS: &str = include_str!("../data/corpus.txt");

/// The small English corpus shipped with the crate (`crates/data/data/corpus.txt`, about
/// 300 KB of generated public-domain text): documents separated by blank lines.
pub fn default_corpus() -> &'static str {
    CORPUS
}

/// The documents of [`default_corpus`].
pub fn default_documents() -> Vec<&'static str> {
    split_documents(CORPUS)
}

/// Splits text into documents at blank lines (lines empty or all whitespace); each
/// document is trimmed, and empty ones are dropped.
pub fn split_documents(text: &str) -> Vec<&str> {
    let mut docs = Vec::new();
    let mut start: Option<usize> = None;
    let mut end = 0;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        if line.trim().is_empty() {
            if let Some(s) = start.take() {
                docs.push(text[s..end].trim());
            }
        } else {
            start.get_or_insert(offset);
            end = offset + line.len();
        }
        offset += line.len();
    }
    if let Some(s) = start {
        docs.push(text[s..end].trim());
    }
    docs.retain(|d| !d.is_empty());
    docs
}

/// Documents from a `--data FILE`: a `.jsonl` file takes each line's `"text"` field;
/// parquet (a `.parquet` file or a directory of them) its `text` column; any other file
/// is plain text split at blank lines ([`split_documents`]).
pub fn load_documents(path: &Path) -> Result<Vec<String>> {
    load_documents_with_column(path, "text")
}

/// [`load_documents`] reading the string column `column` of parquet data (read a row
/// group at a time by [`ParquetDocuments`], every document kept), or the string field
/// `column` of each JSON line (as Hugging Face `datasets` reads a JSON lines file's
/// columns); plain text is read as there.
pub fn load_documents_with_column(path: &Path, column: &str) -> Result<Vec<String>> {
    if is_parquet(path) {
        return ParquetDocuments::read_all(path, column);
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| config_err(format!("cannot read data file {}: {e}", path.display())))?;
    if path.extension().is_some_and(|e| e == "jsonl") {
        let mut docs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| config_err(format!("{}:{}: not JSON: {e}", path.display(), i + 1)))?;
            match v.get(column).and_then(|t| t.as_str()) {
                Some(t) => docs.push(t.to_string()),
                None => {
                    return Err(config_err(format!(
                        "{}:{}: no string field {column:?}",
                        path.display(),
                        i + 1
                    )))
                }
            }
        }
        return Ok(docs);
    }
    Ok(split_documents(&text).into_iter().map(str::to_string).collect())
}

// ---------------------------------------------------------------------------------------
// Dataset and collation
// ---------------------------------------------------------------------------------------

/// One training sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Tokens `0..seq` of `[BOT] + tokens + [EOT]` padded with `[PAD]` (length `seq`).
    pub input_ids: Vec<i64>,
    /// Tokens `1..=seq` (the next token of each input); padding positions hold `[PAD]`,
    /// which the loss ignores (`ignore_index = pad_id`).
    pub target_ids: Vec<i64>,
    /// 1 where the input is a token, 0 where it is padding.
    pub attention_mask: Vec<i64>,
}

/// A collated batch: `[batch, seq]` i64 tensors.
#[derive(Clone, Debug)]
pub struct Batch {
    /// Input token ids.
    pub input_ids: Tensor,
    /// Target token ids (`[PAD]` where ignored).
    pub target_ids: Tensor,
    /// 1 for tokens, 0 for padding (the form `tpar_models::causal_padding_mask` takes).
    pub attention_mask: Tensor,
}

impl Batch {
    /// The batch on `device` (ids and mask moved; a no-op on the host).
    pub fn to_device(self, device: tpar_tensor::Device) -> Result<Batch> {
        Ok(Batch {
            input_ids: self.input_ids.to_device(device)?,
            target_ids: self.target_ids.to_device(device)?,
            attention_mask: self.attention_mask.to_device(device)?,
        })
    }

    /// Tokens in the batch that are not padding (what tokens/s counts).
    pub fn num_tokens(&self) -> Result<usize> {
        Ok(self.attention_mask.to_vec::<i64>()?.iter().filter(|&&m| m != 0).count())
    }
}

/// A pretraining dataset: each document becomes `[BOT] + tokens + [EOT]`, clipped or
/// padded with `[PAD]` to `seq_length + 1` tokens, from which a [`Sample`] takes inputs
/// (the first `seq_length`) and targets (the last `seq_length`).
#[derive(Clone, Debug)]
pub struct PretrainingDataset {
    /// Each document's tokens with specials, clipped to `seq_length + 1`, unpadded.
    sequences: Vec<Vec<u32>>,
    seq_length: usize,
    pad_id: u32,
}

impl PretrainingDataset {
    /// Tokenizes `texts` (one document each) into sequences of `seq_length + 1`.
    pub fn new<S: AsRef<str>>(
        texts: &[S],
        tokenizer: &dyn Tokenizer,
        seq_length: usize,
    ) -> Result<PretrainingDataset> {
        if seq_length == 0 {
            return Err(config_err("PretrainingDataset: seq_length must be at least 1"));
        }
        let (bot, eot) = (tokenizer.bot_id(), tokenizer.eot_id());
        let sequences = texts
            .iter()
            .map(|t| {
                // No capacity up front: `seq_length` may be far longer than any document.
                let mut ids = Vec::new();
                ids.push(bot);
                ids.extend(tokenizer.encode(t.as_ref())?);
                ids.push(eot);
                ids.truncate(seq_length.saturating_add(1));
                Ok(ids)
            })
            .collect::<Result<_>>()?;
        Ok(PretrainingDataset { sequences, seq_length, pad_id: tokenizer.pad_id() })
    }

    /// Number of sequences (documents).
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    /// Whether there is no sequence.
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// The sequence length of a sample.
    pub fn seq_length(&self) -> usize {
        self.seq_length
    }

    /// The padding id (the loss's ignore_index).
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Sample `index`, `None` past the end.
    pub fn get(&self, index: usize) -> Option<Sample> {
        let ids = self.sequences.get(index)?;
        let pad = i64::from(self.pad_id);
        let mut full: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
        full.resize(self.seq_length + 1, pad);
        let input_ids = full[..self.seq_length].to_vec();
        let target_ids = full[1..].to_vec();
        let attention_mask = input_ids.iter().map(|&i| i64::from(i != pad)).collect();
        Some(Sample { input_ids, target_ids, attention_mask })
    }

    /// The collated batch of samples `indices` (as [`collate`] of [`PretrainingDataset::get`]),
    /// built in place: the `[batch, seq]` tensors are allocated fallibly, so a sequence
    /// length the machine cannot hold is a [`DataError::Tensor`] naming the bytes.
    pub fn batch(&self, indices: &[usize]) -> Result<Batch> {
        if indices.is_empty() {
            return Err(config_err("collate: empty batch"));
        }
        let seq = self.seq_length;
        let shape = tpar_tensor::Shape::new(&[indices.len(), seq]);
        let dtype = tpar_tensor::DType::I64;
        let pad = i64::from(self.pad_id);
        let mut input_ids = tpar_tensor::try_vec("batch input_ids", &shape, dtype, pad)?;
        let mut target_ids = tpar_tensor::try_vec("batch target_ids", &shape, dtype, pad)?;
        let mut attention_mask = tpar_tensor::try_vec("batch attention_mask", &shape, dtype, 0)?;
        for (row, &i) in indices.iter().enumerate() {
            let ids = self.sequences.get(i).ok_or_else(|| {
                config_err(format!(
                    "PretrainingDataset: index {i} out of range for {} samples",
                    self.len()
                ))
            })?;
            let at = row * seq;
            for (j, &id) in ids.iter().enumerate() {
                let id = i64::from(id);
                if j < seq {
                    input_ids[at + j] = id;
                    attention_mask[at + j] = i64::from(id != pad);
                }
                if j > 0 {
                    target_ids[at + j - 1] = id;
                }
            }
        }
        Ok(Batch {
            input_ids: Tensor::from_vec(input_ids, shape.clone())?,
            target_ids: Tensor::from_vec(target_ids, shape.clone())?,
            attention_mask: Tensor::from_vec(attention_mask, shape)?,
        })
    }
}

/// Stacks samples into a [`Batch`] of `[batch, seq]` i64 tensors; the samples must be
/// non-empty and of one length.
pub fn collate(batch: &[Sample]) -> Result<Batch> {
    let Some(first) = batch.first() else {
        return Err(config_err("collate: empty batch"));
    };
    let seq = first.input_ids.len();
    for (i, s) in batch.iter().enumerate() {
        let lens = [s.input_ids.len(), s.target_ids.len(), s.attention_mask.len()];
        if lens.iter().any(|&l| l != seq) {
            return Err(config_err(format!(
                "collate: sample {i} has lengths {lens:?} (inputs, targets, mask), \
                 expected {seq}"
            )));
        }
    }
    let stack = |f: fn(&Sample) -> &Vec<i64>| -> Result<Tensor> {
        let v: Vec<i64> = batch.iter().flat_map(|s| f(s).iter().copied()).collect();
        Ok(Tensor::from_vec(v, [batch.len(), seq])?)
    };
    Ok(Batch {
        input_ids: stack(|s| &s.input_ids)?,
        target_ids: stack(|s| &s.target_ids)?,
        attention_mask: stack(|s| &s.attention_mask)?,
    })
}
