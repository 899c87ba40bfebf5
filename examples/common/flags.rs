//! Checks of the trainers' command-line flags, shared by `llama_2d` and `llama_pp`: a
//! flag that cannot work is a one-line message and exit code 2, never a panic deep in a
//! rank.
#![allow(dead_code)]

use clap::ValueEnum;

/// What a trainer does with a non-finite loss or gradient norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum NonFinite {
    /// Stop at the first one with an error naming the step and the rank.
    Fail,
    /// Skip that optimizer step (the gradients are zeroed) and log a line.
    Skip,
}

/// `Err` naming the first flag whose value is 0 (`pairs` are `(flag, value)`).
pub fn positive(pairs: &[(&str, usize)]) -> Result<(), String> {
    for (flag, v) in pairs {
        if *v == 0 {
            return Err(format!("{flag} is 0; it must be at least 1"));
        }
    }
    Ok(())
}

/// `Err` unless the learning rate is finite and not negative.
pub fn learning_rate(lr: f64) -> Result<(), String> {
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(format!("--lr {lr}: the learning rate must be finite and not negative"));
    }
    Ok(())
}

/// The model flags checked as [`tpar::models::LlamaConfig::validate`] checks a config
/// (heads dividing the width, an even head dim), with the flag names in the message.
pub fn llama_shape(hidden: usize, heads: usize, kv_heads: usize) -> Result<(), String> {
    if !hidden.is_multiple_of(heads) {
        return Err(format!("--hidden {hidden} is not a multiple of --heads {heads}"));
    }
    if !heads.is_multiple_of(kv_heads) {
        return Err(format!("--heads {heads} is not a multiple of --kv-heads {kv_heads}"));
    }
    if !(hidden / heads).is_multiple_of(2) {
        return Err(format!(
            "--hidden {hidden} / --heads {heads} = head dim {}, which must be even (RoPE)",
            hidden / heads
        ));
    }
    Ok(())
}
