//! Hugging Face Llama checkpoints in and out: a model directory's `config.json` as a
//! [`LlamaConfig`] ([`HfConfig`]), its weights (one `model.safetensors`, or shards
//! through `model.safetensors.index.json`) loaded into a plain or sharded
//! [`crate::LlamaForPretraining`] or pipeline stage ([`HfCheckpoint::load_into`], each
//! rank reading only the byte ranges of the chunks it holds), and a trained model
//! written back as a directory `transformers.LlamaForCausalLM.from_pretrained` loads
//! ([`export_hf`]).
//!
//! Names map one to one: tpar's `base_model.X` is Hugging Face's `model.X`, and
//! `lm_head.weight` is the same in both. Hugging Face's Llama applies RoPE with
//! `rotate_half` (the two halves of each head's dim paired), which is tpar's layout,
//! so the q and k projections load unpermuted. With `tie_word_embeddings`, tpar's
//! `lm_head` is loaded from `model.embed_tokens.weight` (tpar keeps the two as separate
//! parameters); an export writes `tie_word_embeddings: true` and no `lm_head.weight`
//! exactly when the two are equal bit for bit.
//!
//! ```no_run
//! use tpar_models::hf::HfCheckpoint;
//! use tpar_models::LlamaForPretraining;
//! use tpar_tensor::Device;
//! let ckpt = HfCheckpoint::open(std::path::Path::new("path/to/Llama-dir"))?;
//! let mut model = LlamaForPretraining::new(&ckpt.config.llama, Device::Cpu)?;
//! ckpt.load_into(&mut model)?;
//! # Ok::<(), tpar_models::hf::HfError>(())
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value as Json};
use tpar_checkpoint::hf::{write_sharded_safetensors, SafetensorsDir};
use tpar_checkpoint::{full_state_dict, CheckpointError};
use tpar_collectives::ProcessGroup;
use tpar_nn::{Module, NnError};
use tpar_tensor::state::{ShardedTensor, StateDict, StateValue};
use tpar_tensor::{DType, Device, Tensor, TensorError};

use crate::{LlamaConfig, RopeScaling};

/// The config file of a Hugging Face model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer file of a Hugging Face model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The architecture tpar reads and writes.
pub const ARCHITECTURE: &str = "LlamaForCausalLM";
/// `save_pretrained`'s default `max_shard_size` (5 GB), the default of [`export_hf`]'s
/// callers.
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// Errors of reading and writing Hugging Face checkpoints; each names the file and,
/// for a tensor, its key.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read or written.
    #[error("{file}: {what}")]
    Io {
        /// The file.
        file: String,
        /// What failed.
        what: String,
    },
    /// `config.json` is not JSON of a config (a key of the wrong type).
    #[error("{file}: not a Llama config: {what}")]
    Json {
        /// The file.
        file: String,
        /// What serde_json said.
        what: String,
    },
    /// The config's architecture is not Llama.
    #[error("{file}: architectures is {found}; tpar reads LlamaForCausalLM checkpoints only")]
    Architecture {
        /// The file.
        file: String,
        /// What the file says (its `architectures`, or its `model_type` without them).
        found: String,
    },
    /// A config key whose value tpar's Llama does not implement.
    #[error("{file}: {key} = {value} is not supported: {why}")]
    Unsupported {
        /// The file.
        file: String,
        /// The key.
        key: String,
        /// Its value, as JSON.
        value: String,
        /// What tpar supports.
        why: String,
    },
    /// The config's sizes do not make a Llama (a zero size, heads that do not divide).
    #[error("{file}: {source}")]
    Config {
        /// The file.
        file: String,
        /// What [`LlamaConfig::validate`] found.
        source: NnError,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{file}: missing tensor {key:?}")]
    MissingTensor {
        /// The Hugging Face tensor name.
        key: String,
        /// The index or single file that lists the checkpoint's tensors.
        file: String,
    },
    /// A tensor that no parameter of a Llama of this config has.
    #[error("{file}: unexpected tensor {key:?}: no parameter of the Llama config.json describes")]
    UnexpectedTensor {
        /// The Hugging Face tensor name.
        key: String,
        /// The file that holds it.
        file: String,
    },
    /// A tensor whose shape disagrees with the config.
    #[error("{file}: tensor {key:?} has shape {got:?}; config.json gives {expected:?}")]
    Shape {
        /// The Hugging Face tensor name.
        key: String,
        /// The file that holds it.
        file: String,
        /// The shape the config gives.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tensor of a dtype tpar does not have.
    #[error("{file}: tensor {key:?} has dtype {dtype}, which tpar does not have")]
    DType {
        /// The Hugging Face tensor name.
        key: String,
        /// The file that holds it.
        file: String,
        /// The file's dtype.
        dtype: String,
    },
    /// A model parameter with no Hugging Face name (not a Llama parameter).
    #[error("parameter {param:?} has no Hugging Face Llama name")]
    Unmapped {
        /// tpar's FQN.
        param: String,
    },
    /// Group rank 0, which writes the export, failed (what other ranks return).
    #[error("the Hugging Face export to {dir} failed on group rank 0: {what}")]
    ExportFailed {
        /// The export directory.
        dir: String,
        /// Rank 0's error.
        what: String,
    },
    /// Reading or gathering the checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Loading the state into the model failed.
    #[error(transparent)]
    Nn(#[from] NnError),
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A collective failed.
    #[error(transparent)]
    Collective(#[from] tpar_collectives::CollectiveError),
}

/// `Result` with [`HfError`].
pub type Result<T> = std::result::Result<T, HfError>;

/// A Llama's Hugging Face `config.json`: the [`LlamaConfig`] and what tpar's config does
/// not hold.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The model's sizes (its `dtype` is f32 unless the caller sets another).
    pub llama: LlamaConfig,
    /// Whether `lm_head` shares `model.embed_tokens.weight`.
    pub tie_word_embeddings: bool,
    /// The checkpoint's `dtype` (`torch_dtype` in older files), e.g. `"bfloat16"`.
    pub torch_dtype: Option<String>,
    /// `bos_token_id`, as written.
    pub bos_token_id: Option<Json>,
    /// `eos_token_id`, as written (a number or a list).
    pub eos_token_id: Option<Json>,
}

/// The keys tpar reads; every other key is ignored. Absent keys take Hugging Face's
/// `LlamaConfig` defaults.
#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Json>,
    rope_parameters: Option<Json>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<Json>,
    eos_token_id: Option<Json>,
}

impl HfConfig {
    /// `llama` with untied embeddings.
    pub fn new(llama: LlamaConfig) -> HfConfig {
        HfConfig {
            llama,
            tie_word_embeddings: false,
            torch_dtype: None,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// Reads a `config.json`.
    ///
    /// # Errors
    /// As [`HfConfig::from_json`]; [`HfError::Io`] for the file.
    pub fn from_file(path: &Path) -> Result<HfConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| HfError::Io { file: path.display().to_string(), what: e.to_string() })?;
        HfConfig::from_json(&text, &path.display().to_string())
    }

    /// A config from the text of a `config.json` (`file` names it in errors).
    /// `architectures` must hold `LlamaForCausalLM` (without `architectures`,
    /// `model_type` must be `llama`); RoPE must be plain or scaled by `rope_type` `linear`
    /// or `llama3` (in `rope_scaling` or `rope_parameters`; read as
    /// [`LlamaConfig::rope_scaling`]); `hidden_act` must be
    /// `silu`, `attention_bias` and `mlp_bias` false, and `head_dim` (when present)
    /// `hidden_size / num_attention_heads`. Absent keys take Hugging Face's defaults.
    ///
    /// # Errors
    /// [`HfError::Json`], [`HfError::Architecture`], [`HfError::Unsupported`] naming the
    /// key, [`HfError::Config`] for sizes that do not make a Llama.
    pub fn from_json(text: &str, file: &str) -> Result<HfConfig> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| HfError::Json { file: file.into(), what: e.to_string() })?;
        match (&raw.architectures, &raw.model_type) {
            (Some(a), _) if a.iter().any(|a| a == ARCHITECTURE) => {}
            (Some(a), _) => {
                return Err(HfError::Architecture { file: file.into(), found: format!("{a:?}") })
            }
            (None, Some(t)) if t == "llama" => {}
            (None, t) => {
                return Err(HfError::Architecture {
                    file: file.into(),
                    found: format!("absent (model_type {t:?})"),
                })
            }
        }
        let unsupported =
            |key: &str, value: &dyn std::fmt::Debug, why: &str| HfError::Unsupported {
                file: file.into(),
                key: key.into(),
                value: format!("{value:?}"),
                why: why.into(),
            };
        let mut rope_theta = raw.rope_theta.unwrap_or(10000.0);
        let mut rope_scaling = None;
        for (key, v) in
            [("rope_scaling", &raw.rope_scaling), ("rope_parameters", &raw.rope_parameters)]
        {
            let Some(v) = v else { continue };
            if v.is_null() {
                continue;
            }
            let Some(obj) = v.as_object() else {
                return Err(unsupported(key, v, "expected an object or null"));
            };
            let number = |name: &str| -> Result<f64> {
                let x = obj.get(name).ok_or_else(|| {
                    unsupported(&format!("{key}.{name}"), &"absent", "needed by its rope_type")
                })?;
                x.as_f64().ok_or_else(|| unsupported(&format!("{key}.{name}"), x, "a number"))
            };
            let kind = obj.get("rope_type").or_else(|| obj.get("type"));
            match kind.map(|k| k.as_str()) {
                None | Some(Some("default")) => {}
                Some(Some("linear")) => {
                    rope_scaling = Some(RopeScaling::Linear { factor: number("factor")? });
                }
                Some(Some("llama3")) => {
                    let original = number("original_max_position_embeddings")?;
                    if !(original >= 1.0 && original.fract() == 0.0) {
                        return Err(unsupported(
                            &format!("{key}.original_max_position_embeddings"),
                            &original,
                            "a positive whole number",
                        ));
                    }
                    rope_scaling = Some(RopeScaling::Llama3 {
                        factor: number("factor")?,
                        low_freq_factor: number("low_freq_factor")?,
                        high_freq_factor: number("high_freq_factor")?,
                        original_max_position_embeddings: original as usize,
                    });
                }
                _ => {
                    return Err(HfError::Unsupported {
                        file: file.into(),
                        key: key.into(),
                        value: v.to_string(),
                        why: "tpar's RoPE takes rope_type \"default\", \"linear\" or \"llama3\" \
                              (no dynamic, yarn or longrope scaling)"
                            .into(),
                    });
                }
            }
            if let Some(t) = obj.get("rope_theta") {
                rope_theta = t
                    .as_f64()
                    .ok_or_else(|| unsupported(&format!("{key}.rope_theta"), t, "a number"))?;
            }
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(unsupported("hidden_act", act, "tpar's Llama MLP is SwiGLU (silu)"));
            }
        }
        for (key, v) in [("attention_bias", raw.attention_bias), ("mlp_bias", raw.mlp_bias)] {
            if v == Some(true) {
                return Err(unsupported(key, &true, "tpar's Llama projections have no bias"));
            }
        }
        let heads = raw.num_attention_heads.unwrap_or(32);
        let llama = LlamaConfig {
            vocab_size: raw.vocab_size.unwrap_or(32000),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(2048),
            hidden_size: raw.hidden_size.unwrap_or(4096),
            intermediate_size: raw.intermediate_size.unwrap_or(11008),
            num_hidden_layers: raw.num_hidden_layers.unwrap_or(32),
            num_attention_heads: heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(heads),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            dtype: DType::F32,
        };
        llama.validate().map_err(|source| HfError::Config { file: file.into(), source })?;
        if let Some(hd) = raw.head_dim {
            if hd != llama.head_dim() {
                return Err(unsupported(
                    "head_dim",
                    &hd,
                    &format!(
                        "tpar's Llama has head_dim = hidden_size / num_attention_heads = {}",
                        llama.head_dim()
                    ),
                ));
            }
        }
        Ok(HfConfig {
            llama,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            torch_dtype: raw.dtype.or(raw.torch_dtype),
            bos_token_id: raw.bos_token_id,
            eos_token_id: raw.eos_token_id,
        })
    }

    /// The `config.json` text `transformers` reads back as this config
    /// (`LlamaForCausalLM`, its RoPE scaling, SwiGLU, no biases).
    pub fn to_json(&self) -> String {
        let c = &self.llama;
        let dtype = self.torch_dtype.clone().unwrap_or_else(|| torch_dtype_name(c.dtype).into());
        let mut v = json!({
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "head_dim": c.head_dim(),
            "hidden_act": "silu",
            "hidden_size": c.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings,
            "mlp_bias": false,
            "num_attention_heads": c.num_attention_heads,
            "num_hidden_layers": c.num_hidden_layers,
            "num_key_value_heads": c.num_key_value_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": rope_scaling_json(c.rope_scaling.as_ref()),
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype,
            "use_cache": true,
            "vocab_size": c.vocab_size,
        });
        let obj = v.as_object_mut().expect("an object");
        for (k, t) in [("bos_token_id", &self.bos_token_id), ("eos_token_id", &self.eos_token_id)] {
            if let Some(t) = t {
                obj.insert(k.into(), t.clone());
            }
        }
        serde_json::to_string_pretty(&v).expect("JSON values serialize") + "\n"
    }

    /// Writes [`HfConfig::to_json`] to `path`.
    ///
    /// # Errors
    /// [`HfError::Io`] naming the file.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json())
            .map_err(|e| HfError::Io { file: path.display().to_string(), what: e.to_string() })
    }
}

/// The name `torch` gives `d`.
fn torch_dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::I64 => "int64",
    }
}

/// The Hugging Face name of tpar's parameter `fqn` (`base_model.X` is `model.X`,
/// `lm_head.weight` stays), or `None` for a name outside the Llama.
pub fn hf_name(fqn: &str) -> Option<String> {
    if let Some(rest) = fqn.strip_prefix("base_model.") {
        Some(format!("model.{rest}"))
    } else if fqn.starts_with("lm_head.") {
        Some(fqn.to_string())
    } else {
        None
    }
}

/// tpar's FQN of the Hugging Face tensor `name` (the inverse of [`hf_name`]).
pub fn tpar_name(name: &str) -> Option<String> {
    if let Some(rest) = name.strip_prefix("model.") {
        Some(format!("base_model.{rest}"))
    } else if name.starts_with("lm_head.") {
        Some(name.to_string())
    } else {
        None
    }
}

/// Every tensor of a Hugging Face Llama of `cfg` (untied: `lm_head.weight` included),
/// by name with its shape, in the order `save_pretrained` lists the modules.
pub fn hf_tensors(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let hd = cfg.head_dim();
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
        ]);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    out.push(("lm_head.weight".to_string(), vec![v, h]));
    out
}

/// A Hugging Face Llama directory, opened: its config and its weights' headers (no
/// tensor data is read until [`HfCheckpoint::load_into`]).
#[derive(Clone, Debug)]
pub struct HfCheckpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config: HfConfig,
    /// Its safetensors files.
    pub weights: SafetensorsDir,
}

impl HfCheckpoint {
    /// Opens `dir`: reads `config.json` ([`HfConfig::from_file`]) and the safetensors
    /// headers, and checks the tensors against the config: every tensor must be one of
    /// the Llama's (an old checkpoint's `rotary_emb.inv_freq` buffers are skipped), of
    /// the shape the config gives, and every one must be there (`lm_head.weight` may be
    /// absent when the embeddings are tied).
    ///
    /// # Errors
    /// As [`HfConfig::from_file`]; [`HfError::UnexpectedTensor`],
    /// [`HfError::MissingTensor`], [`HfError::Shape`] and [`HfError::DType`] naming the
    /// key and the file; [`HfError::Checkpoint`] for a weights file that is not
    /// safetensors or a directory without weights.
    pub fn open(dir: &Path) -> Result<HfCheckpoint> {
        let config = HfConfig::from_file(&dir.join(CONFIG_FILE))?;
        let weights = SafetensorsDir::open(dir)?;
        let expected: BTreeMap<String, Vec<usize>> =
            hf_tensors(&config.llama).into_iter().collect();
        for (name, e) in weights.tensors() {
            let file = e.file.display().to_string();
            if name.ends_with(".rotary_emb.inv_freq") {
                continue;
            }
            let Some(shape) = expected.get(name) else {
                return Err(HfError::UnexpectedTensor { key: name.into(), file });
            };
            if &e.shape != shape {
                return Err(HfError::Shape {
                    key: name.into(),
                    file,
                    expected: shape.clone(),
                    got: e.shape.clone(),
                });
            }
            if e.tpar_dtype().is_none() {
                return Err(HfError::DType {
                    key: name.into(),
                    file,
                    dtype: format!("{:?}", e.dtype),
                });
            }
        }
        for name in expected.keys() {
            let tied_head = name == "lm_head.weight" && config.tie_word_embeddings;
            if weights.get(name).is_none() && !tied_head {
                return Err(HfError::MissingTensor {
                    key: name.clone(),
                    file: weights.source().display().to_string(),
                });
            }
        }
        Ok(HfCheckpoint { dir: dir.to_path_buf(), config, weights })
    }

    /// The Hugging Face tensor tpar's parameter `fqn` loads from.
    fn source_of(&self, fqn: &str) -> Result<String> {
        let name = hf_name(fqn).ok_or_else(|| HfError::Unmapped { param: fqn.into() })?;
        if name == "lm_head.weight"
            && self.config.tie_word_embeddings
            && self.weights.get(&name).is_none()
        {
            return Ok("model.embed_tokens.weight".into());
        }
        Ok(name)
    }

    /// The box of tensor `name` at `offsets` of `sizes`, in `dtype`.
    fn read(&self, name: &str, offsets: &[usize], sizes: &[usize], dtype: DType) -> Result<Tensor> {
        let t = self.weights.read_box(name, offsets, sizes)?;
        Ok(if t.dtype() == dtype { t } else { t.to_dtype(dtype)? })
    }

    /// The checkpoint's values for `model`'s parameters, laid out as its state dict
    /// (this rank's chunks of sharded parameters), reading only those chunks' bytes and
    /// casting to each parameter's dtype.
    ///
    /// # Errors
    /// [`HfError::Unmapped`] for a parameter that is not a Llama's;
    /// [`HfError::MissingTensor`] and [`HfError::Shape`] naming the key and file when
    /// the model does not match the checkpoint (a model built from another config);
    /// read errors.
    pub fn state_dict_for(&self, model: &dyn Module) -> Result<StateDict> {
        let mut out = StateDict::new();
        for (fqn, value) in tpar_nn::state_dict(model)? {
            let name = self.source_of(&fqn)?;
            let entry = self.weights.get(&name).ok_or_else(|| HfError::MissingTensor {
                key: name.clone(),
                file: self.weights.source().display().to_string(),
            })?;
            let (shape, dtype) = match value.tensor_meta() {
                Some(m) => m,
                None => continue,
            };
            if entry.shape != shape {
                return Err(HfError::Shape {
                    key: name,
                    file: entry.file.display().to_string(),
                    expected: shape,
                    got: entry.shape.clone(),
                });
            }
            let v = match value {
                StateValue::Sharded(s) => {
                    let chunks = s
                        .chunks()
                        .iter()
                        .map(|c| {
                            let sizes = c.sizes();
                            Ok((c.offsets.clone(), self.read(&name, &c.offsets, &sizes, dtype)?))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    StateValue::Sharded(
                        ShardedTensor::new(shape, dtype, chunks)
                            .map_err(|e| CheckpointError::from(e.for_key(&fqn)))?,
                    )
                }
                _ => StateValue::Tensor(self.read(&name, &vec![0; shape.len()], &shape, dtype)?),
            };
            out.insert(fqn, v);
        }
        Ok(out)
    }

    /// Loads the checkpoint into `model` (a [`crate::LlamaForPretraining`] or a
    /// [`crate::LlamaStage`], plain, tensor-parallel, FSDP or both, with materialized
    /// parameters): every rank reads only the byte ranges of the chunks it holds
    /// ([`HfCheckpoint::state_dict_for`]) and loads them strictly.
    ///
    /// # Errors
    /// As [`HfCheckpoint::state_dict_for`], and [`HfError::Nn`] from
    /// [`tpar_nn::load_state_dict`].
    pub fn load_into(&self, model: &mut dyn Module) -> Result<()> {
        let state = self.state_dict_for(model)?;
        tpar_nn::load_state_dict(model, state, true)?;
        Ok(())
    }
}

/// Writes a model as a Hugging Face Llama directory: `config.json` (from `config`) and
/// its weights as safetensors in shards of at most `max_shard_bytes` with their index
/// (one `model.safetensors` when everything fits), which
/// `transformers.LlamaForCausalLM.from_pretrained` loads. `state` is each rank's model
/// state dict (tpar FQNs; chunks of sharded parameters; a pipeline rank passes its
/// stages' state): the chunks are gathered over `group` (collective: every rank of
/// `group` calls it, and `group` holds every rank owning a chunk), and group rank 0
/// writes. The embeddings are written tied (`tie_word_embeddings: true`, no
/// `lm_head.weight`) exactly when `lm_head.weight` equals `model.embed_tokens.weight`
/// bit for bit; `torch_dtype` is the parameters' dtype.
///
/// # Errors
/// [`HfError::Unmapped`] for a key that is not a Llama parameter,
/// [`HfError::MissingTensor`] / [`HfError::Shape`] when the state does not make the
/// Llama of `config`, I/O errors naming the file (on rank 0; the other ranks get
/// [`HfError::ExportFailed`]); gathering errors.
pub fn export_hf(
    state: &StateDict,
    config: &HfConfig,
    dir: &Path,
    group: &ProcessGroup,
    max_shard_bytes: u64,
) -> Result<()> {
    let full = full_state_dict(state, group, true)?;
    let status =
        if group.rank() == 0 { write_export(full, config, dir, max_shard_bytes) } else { Ok(()) };
    // Rank 0's error text to every rank, so that whichever rank's error a caller sees
    // names the cause.
    let mine = status.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    let all = group.all_gather_bytes(mine.as_bytes())?;
    status?;
    match all.first().filter(|what| !what.is_empty()) {
        Some(what) => Err(HfError::ExportFailed {
            dir: dir.display().to_string(),
            what: String::from_utf8_lossy(what).into_owned(),
        }),
        None => Ok(()),
    }
}

/// Rank 0's part of [`export_hf`]: names, checks, tie, files.
fn write_export(
    full: StateDict,
    config: &HfConfig,
    dir: &Path,
    max_shard_bytes: u64,
) -> Result<()> {
    let mut by_name: BTreeMap<String, Tensor> = BTreeMap::new();
    for (fqn, v) in full {
        let name = hf_name(&fqn).ok_or_else(|| HfError::Unmapped { param: fqn.clone() })?;
        if let StateValue::Tensor(t) = v {
            by_name.insert(name, t.to_device(Device::Cpu)?);
        }
    }
    let dir_name = dir.display().to_string();
    let mut tensors = Vec::new();
    for (name, shape) in hf_tensors(&config.llama) {
        let t = by_name
            .remove(&name)
            .ok_or_else(|| HfError::MissingTensor { key: name.clone(), file: dir_name.clone() })?;
        if t.dims() != shape {
            return Err(HfError::Shape {
                key: name,
                file: dir_name.clone(),
                expected: shape,
                got: t.dims().to_vec(),
            });
        }
        tensors.push((name, t));
    }
    if let Some(name) = by_name.into_keys().next() {
        return Err(HfError::UnexpectedTensor { key: name, file: dir_name });
    }
    let embed = tensors[0].1.clone();
    let head = &tensors[tensors.len() - 1].1;
    let tied = same_bits(&embed, head)?;
    if tied {
        tensors.pop();
    }
    let mut cfg = config.clone();
    cfg.tie_word_embeddings = tied;
    cfg.torch_dtype = Some(torch_dtype_name(embed.dtype()).into());
    cfg.llama.dtype = embed.dtype();
    write_sharded_safetensors(&tensors, dir, max_shard_bytes)?;
    cfg.write(&dir.join(CONFIG_FILE))
}

/// Whether `a` and `b` hold the same dtype, shape and bits, compared a block of rows at a
/// time (f64 bit patterns are exact for every float dtype tpar has).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dtype() != b.dtype() || a.dims() != b.dims() {
        return Ok(false);
    }
    if a.rank() == 0 {
        return Ok(a.to_vec_f64()?[0].to_bits() == b.to_vec_f64()?[0].to_bits());
    }
    let rows = a.dims()[0];
    let row: usize = a.dims()[1..].iter().product();
    let step = ((1usize << 20) / row.max(1)).max(1);
    let mut r = 0;
    while r < rows {
        let n = step.min(rows - r);
        let (x, y) = (a.narrow(0, r, n)?.to_vec_f64()?, b.narrow(0, r, n)?.to_vec_f64()?);
        if x.iter().zip(&y).any(|(x, y)| x.to_bits() != y.to_bits()) {
            return Ok(false);
        }
        r += n;
    }
    Ok(true)
}

/// `rope_scaling` as transformers writes it (`null` for plain RoPE).
fn rope_scaling_json(r: Option<&RopeScaling>) -> Json {
    match r {
        None => Json::Null,
        Some(RopeScaling::Linear { factor }) => {
            json!({ "rope_type": "linear", "factor": factor })
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
    }
}
