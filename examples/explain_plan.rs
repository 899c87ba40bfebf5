//! Shows what the two tensor-parallel Llama plans do at tp=2 on a tiny model: each
//! parallelized module's style, its parameters' placements, and the collectives one
//! forward + backward runs in the style hooks, with bytes; then both totals (the
//! Megatron plan moves fewer bytes). Run: `cargo run --release --example explain_plan`.

use tpar::models::llama_plans::{
    megatron_layer_plan, parallelize_llama, sequence_parallel_layer_plan,
};
use tpar::models::{LlamaConfig, LlamaForPretraining};
use tpar::nn::reset_parameters;
use tpar::parallel::trace;
use tpar::prelude::*;

const BATCH: usize = 2;
const SEQ: usize = 16;

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 64,
        max_position_embeddings: 64,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        dtype: DType::F32,
    }
}

/// Rank 0's explanation of one training step under `layer_plan`, and the bytes its
/// style hooks moved (forward + backward).
fn explained(layer_plan: &ParallelizePlan) -> Result<(String, u64), NnError> {
    let layer_plan = layer_plan.clone();
    let outs = spawn(2, move |ctx| -> Result<(String, u64), NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        parallelize_llama(&mut model, &mesh, &layer_plan)
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        reset_parameters(&mut model, Device::Cpu, 0)?;
        let n = BATCH * SEQ;
        let ids: Vec<i64> = (0..n).map(|i| (i * 7 % 64) as i64).collect();
        let targets: Vec<i64> = (0..n).map(|i| ((i + 1) * 7 % 64) as i64).collect();
        let ids = Tensor::from_vec(ids, [BATCH, SEQ])?;
        let targets = Tensor::from_vec(targets, [n])?;
        let (loss, events) = trace::capture(|| -> tpar::nn::Result<Value> {
            let logits = match call(&model, Args::one(ids.clone()))? {
                Value::DTensor(d) => Value::DTensor(d.view(&[n as isize, 64])?),
                Value::Tensor(t) => Value::Tensor(t.reshape([n, 64])?),
                other => other,
            };
            loss_parallel::cross_entropy(&logits, &targets, -100)
        });
        loss_parallel::backward(&loss?, &mesh)?;
        let bytes = events.iter().map(|e| e.forward_bytes + e.backward_bytes).sum();
        Ok((explain(&model, &events), bytes))
    })?;
    outs.into_iter().next().ok_or_else(|| NnError::Config { what: "no ranks".into() })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (text1, bytes1) = explained(&sequence_parallel_layer_plan())?;
    let (text2, bytes2) = explained(&megatron_layer_plan())?;
    println!("=== plan 1: sequence parallel, q/k/v gathered to Replicate (tp=2) ===\n{text1}");
    println!("=== plan 2: Megatron sequence parallel, heads sharded (tp=2) ===\n{text2}");
    println!("bytes per rank per step in style hooks: plan 1 {bytes1} B, plan 2 {bytes2} B");
    if bytes2 >= bytes1 {
        return Err(format!(
            "plan 2 ({bytes2} B) should move fewer bytes than plan 1 ({bytes1} B)"
        )
        .into());
    }
    Ok(())
}
