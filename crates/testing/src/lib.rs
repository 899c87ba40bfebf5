//! Test support for the tpar workspace: the tiny Llama configurations and small helpers
//! that several crates' tests share, written once (a dev-dependency only; not published).
//!
//! A test whose model differs keeps its own `LlamaConfig` literal, or overrides fields
//! of one of these: `LlamaConfig { num_hidden_layers: 1, ..tp_llama_config(DType::F32) }`.

use std::fmt::Display;

use tpar_models::LlamaConfig;
use tpar_nn::NnError;
use tpar_tensor::DType;

/// A tiny Llama of width 16 (4 query heads, 2 key/value heads, head dim 4, MLP 24),
/// RMSNorm eps 1e-5 and RoPE theta 10000, with the vocabulary, positions, layers and
/// dtype given.
pub fn tiny_llama_config(
    vocab_size: usize,
    max_position_embeddings: usize,
    num_hidden_layers: usize,
    dtype: DType,
) -> LlamaConfig {
    LlamaConfig {
        vocab_size,
        max_position_embeddings,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        dtype,
    }
}

/// A small Llama for tensor-parallel tests: 12 query heads and 6 key/value heads (both
/// divide by tp 1, 2, 3 and 6) of head dim 2, width 24, MLP 40, vocabulary 48, 32
/// positions, 2 layers, RMSNorm eps 1e-5 and RoPE theta 10000, in `dtype`.
pub fn tp_llama_config(dtype: DType) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 48,
        max_position_embeddings: 32,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 12,
        num_key_value_heads: 6,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        dtype,
    }
}

/// A plan error (or any error) as the module layer's [`NnError::Config`] with its
/// message, for `?` in test bodies that return `tpar_nn::Result`:
/// `parallelize_llama(..).map_err(plan_err)?`.
pub fn plan_err(e: impl Display) -> NnError {
    NnError::Config { what: e.to_string() }
}
