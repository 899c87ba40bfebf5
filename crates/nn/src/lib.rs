//! tpar's module layer: the `Module` trait, layers (Linear, Embedding, RMSNorm, lists of
//! modules), parameters that are plain tensors, DTensors or FSDP shards, the op set on
//! [`Value`] that layers compute with whichever of the two they get, and the
//! `module_boilerplate!` macro for writing a module of your own. Models built from
//! these (the Llama) are in `tpar-models`.
#![warn(missing_docs)]

pub mod checkpoint;
mod error;
pub mod layers;
mod module;
mod ops;
mod param;
pub mod state;
mod value;

pub use checkpoint::{
    apply_activation_checkpointing, apply_activation_checkpointing_to, checkpoint_wrapper,
    checkpointable_modules, AcPolicy, CheckpointWrapper,
};
pub use error::{NnError, Result};
pub use layers::{Dropout, Embedding, Linear, ModuleList, RmsNorm};
pub use module::{
    call, init_value, named_modules, named_parameters, output_unread, parameters, reset_parameters,
    set_training, visit_modules_mut, AttentionHeads, ForwardHook, Init, Module, ModuleCore,
    ParamSlot,
};
pub use param::{check_not_retired, link_unsharder, ComputeParam, GradLayout, Param, Unshard};
pub use state::{
    load_state_dict, state_dict, ModuleState, StateDict, StateDictError, StateValue, Stateful,
};
pub use value::{replicated_loss_scope, Args, ReplicatedLossScope, Value};
