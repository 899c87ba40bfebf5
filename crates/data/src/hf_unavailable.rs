//! [`HfTokenizer`] in a build without the `hf-tokenizers` feature: the type exists so
//! code that names it compiles, and its constructors return
//! [`DataError::Unavailable`]. No value of it can exist.

use std::convert::Infallible;
use std::path::Path;

use super::Tokenizer;
use crate::{DataError, Result};

fn unavailable() -> DataError {
    DataError::Unavailable {
        what: "HfTokenizer (Hugging Face tokenizer.json files)",
        why: "tpar-data was built without its `hf-tokenizers` feature, which brings the \
              `tokenizers` crate; turn the feature on (it is on by default)",
    }
}

/// A tokenizer read from a HuggingFace `tokenizer.json`. This build has no `tokenizers`
/// crate (the `hf-tokenizers` feature is off): the constructors return
/// [`DataError::Unavailable`].
#[derive(Clone, Debug)]
pub struct HfTokenizer {
    never: Infallible,
}

impl HfTokenizer {
    /// Reads a `tokenizer.json` file: [`DataError::Unavailable`] in this build.
    pub fn from_file(_path: &Path) -> Result<HfTokenizer> {
        Err(unavailable())
    }

    /// Parses the contents of a `tokenizer.json` file: [`DataError::Unavailable`] in
    /// this build.
    pub fn from_json_str(_json: &str) -> Result<HfTokenizer> {
        Err(unavailable())
    }

    /// The id of a token string of the file (vocabulary or added token).
    pub fn token_to_id(&self, _token: &str) -> Option<u32> {
        match self.never {}
    }

    /// The token string of an id, including a special the file lacked.
    pub fn id_to_token(&self, _id: u32) -> Option<String> {
        match self.never {}
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, _text: &str) -> Result<Vec<u32>> {
        match self.never {}
    }

    fn decode(&self, _ids: &[u32]) -> Result<String> {
        match self.never {}
    }

    fn vocab_size(&self) -> usize {
        match self.never {}
    }

    fn bot_id(&self) -> u32 {
        match self.never {}
    }

    fn eot_id(&self) -> u32 {
        match self.never {}
    }

    fn pad_id(&self) -> u32 {
        match self.never {}
    }
}
