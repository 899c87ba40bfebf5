//! A small Llama cut into pipeline stages, its data and loss, for the pipeline tests;
//! one step's loss and gradients, for the tests that compare whole-model steps.

use std::collections::BTreeMap;

use tpar::prelude::*;

pub fn config(layers: usize, dtype: DType) -> LlamaConfig {
    tpar_testing::tiny_llama_config(40, 8, layers, dtype)
}

/// Token ids `[rows, seq]` and next-token targets, from a fixed pattern.
pub fn batch(rows: usize, seq: usize, vocab: usize) -> (Tensor, Tensor) {
    let ids: Vec<i64> = (0..rows * seq).map(|i| ((i * 7 + i / seq * 3) % vocab) as i64).collect();
    let tgt: Vec<i64> = (0..rows * seq).map(|i| ((i * 5 + 1) % vocab) as i64).collect();
    (Tensor::from_vec(ids, [rows, seq]).unwrap(), Tensor::from_vec(tgt, [rows, seq]).unwrap())
}

pub fn loss_fn(vocab: usize) -> impl Fn(&Value, &Tensor) -> tpar::nn::Result<Value> + Send + Sync {
    move |logits, t| {
        logits.reshape(&[-1, vocab as isize])?.cross_entropy(&t.reshape([t.numel()])?, -100)
    }
}

/// The loss of `model.logits(ids, mask)` against the next-token targets `tgt` (vocabulary
/// `vocab`), backpropagated.
pub fn loss_backward(
    model: &LlamaForPretraining,
    vocab: usize,
    (ids, tgt): (&Tensor, &Tensor),
    mask: Option<&Tensor>,
) -> tpar::Result<Tensor> {
    let logits = model.logits(ids, mask)?;
    let loss = loss_fn(vocab)(&logits, tgt)?.into_tensor("loss")?;
    loss.backward()?;
    Ok(loss)
}

/// Every parameter's local gradient by FQN, on the host in f64 (a parameter without one
/// panics, naming it).
pub fn grads_by_fqn(model: &dyn Module) -> BTreeMap<String, Vec<f64>> {
    named_parameters(model)
        .into_iter()
        .map(|(n, p)| {
            let g = p.local().grad().unwrap_or_else(|| panic!("{n} has no gradient"));
            (n, g.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap())
        })
        .collect()
}

/// This rank's stages of a `pp`-rank pipeline of `v` stages per rank, built on meta and
/// materialized.
pub fn stages(cfg: &LlamaConfig, mesh: &DeviceMesh, v: usize) -> tpar::Result<Vec<PipelineStage>> {
    let pp = mesh.shape()[0];
    let n = pp * v;
    let r = mesh.local_rank();
    (0..v)
        .map(|j| {
            let s = r + j * pp;
            let mut m = LlamaStage::for_stage(cfg, s, n, None, Device::Meta)?;
            reset_parameters(&mut m, Device::Cpu, 7)?;
            Ok(PipelineStage::new(m, s, n, mesh, Device::Cpu)?)
        })
        .collect()
}
