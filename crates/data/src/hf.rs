//! HuggingFace `tokenizer.json` files, run by Hugging Face's own [`tokenizers`] crate
//! (pure Rust: its `fancy-regex` backend, no `onig` C build).
//!
//! Whatever that crate reads, this reads: every model (`BPE`, `WordPiece`, `WordLevel`,
//! `Unigram`), normalizer (`NFC`, `NFKC`, `Precompiled`, `BertNormalizer`, ...),
//! pre-tokenizer (Llama-3's `Split` regex with `\p{L}` classes and `(?!\S)` lookahead,
//! `ByteLevel`, `Metaspace`, ...) and decoder, with added tokens cut out of the raw text
//! first. A file it rejects is an error, never an approximation.
//!
//! Three things differ from calling `tokenizers` directly, all because the
//! [`PretrainingDataset`](crate::PretrainingDataset) frames, clips and pads sequences
//! itself: `encode` adds no special tokens (a post-processor's template, such as
//! Llama-3's `<|begin_of_text|>`, is not applied), the file's `truncation` and `padding`
//! are switched off, and `decode` also skips the three specials the dataset inserts.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use super::Tokenizer;
use crate::{DataError, Result};

/// Where a tokenizer came from, for error messages, when it was not read from a file.
const FROM_STRING: &str = "tokenizer.json from a string";

fn tokenizer_err(op: &'static str, origin: &str, why: impl fmt::Display) -> DataError {
    DataError::Tokenizer { op, origin: origin.to_string(), why: why.to_string() }
}

/// A tokenizer read from a HuggingFace `tokenizer.json`, run by the [`tokenizers`] crate
/// (see the module docs for what differs from calling it directly).
///
/// The three specials are looked up by name among the added tokens and the vocabulary:
/// `[BOT]`, `<|begin_of_text|>`, `<s>`, `<bos>`, `[CLS]`, `<|endoftext|>` for BOT;
/// `[EOT]`, `<|end_of_text|>`, `</s>`, `<eos>`, `[SEP]`, `<|endoftext|>` for EOT;
/// `[PAD]`, `<pad>`, `<|pad|>` for PAD. One that is missing gets a new id past the
/// vocabulary (so [`Tokenizer::vocab_size`] grows by one), named `[BOT]`/`[EOT]`/`[PAD]`;
/// that id is never produced from text, since the file has no such token.
#[derive(Clone)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// The file's path, or [`FROM_STRING`].
    origin: String,
    bot: u32,
    eot: u32,
    pad: u32,
    /// Specials the file lacks, with the ids given to them past its vocabulary.
    extra: Vec<(u32, &'static str)>,
    vocab_size: usize,
}

impl fmt::Debug for HfTokenizer {
    // The inner tokenizer's Debug prints the whole vocabulary.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size)
            .field("bot", &self.bot)
            .field("eot", &self.eot)
            .field("pad", &self.pad)
            .field("extra", &self.extra)
            .finish_non_exhaustive()
    }
}

impl HfTokenizer {
    /// Reads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<HfTokenizer> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| tokenizer_err("read", &origin, e))?;
        Self::parse(&text, origin)
    }

    /// Parses the contents of a `tokenizer.json` file.
    pub fn from_json_str(json: &str) -> Result<HfTokenizer> {
        Self::parse(json, FROM_STRING.to_string())
    }

    /// Wraps a tokenizer built with the [`tokenizers`] API (its truncation and padding
    /// are switched off, as for a file).
    pub fn from_hf(tokenizer: tokenizers::Tokenizer) -> Result<HfTokenizer> {
        Self::wrap(tokenizer, "tokenizers::Tokenizer".to_string())
    }

    fn parse(json: &str, origin: String) -> Result<HfTokenizer> {
        let inner =
            tokenizers::Tokenizer::from_str(json).map_err(|e| tokenizer_err("load", &origin, e))?;
        Self::wrap(inner, origin)
    }

    fn wrap(mut inner: tokenizers::Tokenizer, origin: String) -> Result<HfTokenizer> {
        inner.with_truncation(None).map_err(|e| tokenizer_err("load", &origin, e))?;
        inner.with_padding(None);
        // Ids may have holes: the embedding needs one row per id up to the largest.
        let mut vocab_size =
            inner.get_vocab(true).into_values().max().map_or(0, |m| m as usize + 1);
        let mut extra = Vec::new();
        let mut special = |names: &[&str], fallback: &'static str| -> Result<u32> {
            if let Some(id) = names.iter().find_map(|n| inner.token_to_id(n)) {
                return Ok(id);
            }
            let id = u32::try_from(vocab_size).map_err(|_| {
                tokenizer_err(
                    "load",
                    &origin,
                    format!("no id left for {fallback} past {vocab_size}"),
                )
            })?;
            vocab_size += 1;
            extra.push((id, fallback));
            Ok(id)
        };
        let bot = special(
            &["[BOT]", "<|begin_of_text|>", "<s>", "<bos>", "[CLS]", "<|endoftext|>"],
            "[BOT]",
        )?;
        let eot = special(
            &["[EOT]", "<|end_of_text|>", "</s>", "<eos>", "[SEP]", "<|endoftext|>"],
            "[EOT]",
        )?;
        let pad = special(&["[PAD]", "<pad>", "<|pad|>"], "[PAD]")?;
        Ok(HfTokenizer { inner, origin, bot, eot, pad, extra, vocab_size })
    }

    /// The id of a token string of the file (vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id, including a special the file lacked.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match self.extra.iter().find(|(i, _)| *i == id) {
            Some((_, name)) => Some(name.to_string()),
            None => self.inner.id_to_token(id),
        }
    }

    /// The wrapped [`tokenizers::Tokenizer`], for what the [`Tokenizer`] trait does not
    /// cover (offsets, batches, pairs). Its vocabulary lacks the specials this type added.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding =
            self.inner.encode(text, false).map_err(|e| tokenizer_err("encode", &self.origin, e))?;
        Ok(encoding.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        // The file's specials are skipped by `tokenizers`; the dataset's three here (an
        // id the file does not know, such as one past the vocabulary, is skipped there).
        let kept: Vec<u32> =
            ids.iter().copied().filter(|i| ![self.bot, self.eot, self.pad].contains(i)).collect();
        self.inner.decode(&kept, true).map_err(|e| tokenizer_err("decode", &self.origin, e))
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn bot_id(&self) -> u32 {
        self.bot
    }

    fn eot_id(&self) -> u32 {
        self.eot
    }

    fn pad_id(&self) -> u32 {
        self.pad
    }
}
