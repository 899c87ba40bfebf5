//! tpar's module layer: the `Module` trait, layers (Linear, Embedding, RMSNorm) and the
//! Llama model, with parameters that are plain tensors or DTensors.
#![warn(missing_docs)]

pub mod data;
mod error;
pub mod fsdp_param;
pub mod layers;
pub mod llama;
mod module;
pub mod optim;
mod param;
mod value;

pub use error::{NnError, Result};
pub use layers::{Embedding, Linear, ModuleList, RmsNorm};
pub use llama::{
    causal_padding_mask, LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForPretraining,
    LlamaMLP, LlamaModel, RopeTables, RotaryPositionEncoding,
};
pub use module::{
    call, init_value, named_modules, named_parameters, parameters, reset_parameters, set_training,
    visit_modules_mut, ForwardHook, Init, Module, ModuleCore, ParamSlot,
};
pub use param::{ComputeParam, GradLayout, Param};
pub use value::{Args, Value};
