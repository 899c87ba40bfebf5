//! Models built from `tpar-nn` modules, with the module names of their reference
//! implementations, and their tensor-parallel plans: the Llama
//! ([`LlamaForPretraining`]: RoPE, grouped-query attention, RMSNorm, SwiGLU) and
//! [`llama_plans`] (sequence-parallel and Megatron layer plans, applied to every
//! decoder layer by [`llama_plans::parallelize_llama`]), and [`hf`]: Hugging Face
//! Llama checkpoints (`config.json` and safetensors) in and out.
//!
//! ```
//! use tpar_models::{LlamaConfig, LlamaForPretraining};
//! use tpar_nn::{call, named_parameters, reset_parameters, Args, Value};
//! use tpar_tensor::{DType, Device, Tensor};
//! let cfg = LlamaConfig {
//!     vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
//!     num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 16,
//!     ..Default::default()
//! };
//! let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
//! reset_parameters(&mut model, Device::Cpu, 0)?;
//! let names: Vec<String> = named_parameters(&model).into_iter().map(|(n, _)| n).collect();
//! assert!(names.contains(&"base_model.layers.1.self_attn.q_proj.weight".to_string()));
//! let ids = Tensor::from_vec(vec![1i64, 5, 9, 2, 7, 3], [2, 3])?;
//! let logits = call(&model, Args::new(vec![Value::Tensor(ids)]))?.into_tensor("logits")?;
//! assert_eq!(logits.dims(), &[2, 3, 64]);
//! # Ok::<(), tpar_nn::NnError>(())
//! ```
#![warn(missing_docs)]

pub mod context_parallel;
pub mod hf;
pub mod llama;
mod llama_pipeline;
pub mod llama_plans;
pub mod memory;

pub use llama::{
    causal_padding_mask, key_padding_mask, LlamaAttention, LlamaConfig, LlamaDecoderLayer,
    LlamaForPretraining, LlamaFusion, LlamaMLP, LlamaModel, RopeScaling, RopeTables,
    RotaryPositionEncoding,
};
pub use llama_pipeline::{LlamaStage, LlamaStageModel};
