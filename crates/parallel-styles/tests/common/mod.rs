//! Helpers shared by the data-parallel tests (FSDP, DDP, ZeRO-1): a tiny Llama, a
//! global batch, and a short training run (AdamW with clipping, or plain SGD) under each
//! layout that returns every parameter gathered to full, compared against single-rank
//! training.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::llama_plans::{megatron_layer_plan, parallelize_llama};
use tpar_models::{LlamaConfig, LlamaForPretraining};
use tpar_nn::{call, named_parameters, reset_parameters, Args, NnError, Value};
use tpar_optim::ZeroRedundancyOptimizer;
use tpar_optim::{clip_grad_norm_, AdamW, AdamWConfig, ClipOptions, Optimizer, Sgd, SgdConfig};
use tpar_parallel_styles::{
    fully_shard, loss_parallel, sync_module_states, unshard, DataParallel, FsdpConfig,
};
use tpar_tensor::{DType, Device, Tensor};

pub fn config() -> LlamaConfig {
    tpar_testing::tiny_llama_config(40, 16, 2, DType::F32)
}

/// Global batch: 4 sequences of 6 tokens (+1 for targets), no padding (equal token
/// counts per dp rank, so the mean of per-rank means is the global mean).
pub fn global_batch() -> (Tensor, Tensor) {
    let v: Vec<i64> = (0..4 * 7).map(|i| ((i * 7 + i / 3) % 39 + 1) as i64).collect();
    let all = Tensor::from_vec(v, [4, 7]).unwrap();
    (all.narrow(1, 0, 6).unwrap(), all.narrow(1, 1, 6).unwrap())
}

/// The loss of `ids -> tgt`; with `mask`, an all-ones attention mask is passed too (the
/// padding-mask path, with nothing masked, so the loss is unchanged).
pub fn loss_of_masked(
    model: &LlamaForPretraining,
    ids: &Tensor,
    tgt: &Tensor,
    mask: bool,
) -> tpar_nn::Result<Value> {
    let b = ids.dims()[0];
    let mut args = vec![Value::Tensor(ids.clone())];
    if mask {
        args.push(Value::Tensor(Tensor::from_vec(vec![1i64; b * 6], [b, 6])?));
    }
    let logits = call(model, Args::new(args))?;
    let logits = match logits {
        Value::Tensor(t) => Value::Tensor(t.reshape([b * 6, 40])?),
        Value::DTensor(d) => Value::DTensor(d.view(&[(b * 6) as isize, 40])?),
        other => other,
    };
    loss_parallel::cross_entropy(&logits, &tgt.reshape([b * 6])?, -100)
}

pub fn loss_of(model: &LlamaForPretraining, ids: &Tensor, tgt: &Tensor) -> tpar_nn::Result<Value> {
    loss_of_masked(model, ids, tgt, false)
}

/// Every parameter's gradient of the unsharded model (seed 3) on the global batch, by
/// name.
pub fn reference_grads() -> BTreeMap<String, Vec<f64>> {
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 3).unwrap();
    let (ids, tgt) = global_batch();
    loss_of(&model, &ids, &tgt).unwrap().into_tensor("ref").unwrap().backward().unwrap();
    named_parameters(&model)
        .into_iter()
        .map(|(n, p)| (n, p.local().grad().unwrap().to_vec_f64().unwrap()))
        .collect()
}

pub use tpar_testing::plan_err;

/// `fully_shard` per decoder layer, then the base model, then the root (as FSDP2).
pub fn shard_model_with(
    model: &mut LlamaForPretraining,
    dp: &DeviceMesh,
    cfg: &FsdpConfig,
) -> Result<(), NnError> {
    for layer in &mut model.base_model.layers.items {
        fully_shard(layer, dp, cfg)?;
    }
    fully_shard(&mut model.base_model, dp, cfg)?;
    fully_shard(model, dp, cfg)
}

pub fn shard_model(model: &mut LlamaForPretraining, dp: &DeviceMesh) -> Result<(), NnError> {
    shard_model_with(model, dp, &FsdpConfig::default())
}

/// How the dp dimension is handled in [`train`].
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    /// FSDP with this configuration.
    Fsdp(FsdpConfig),
    /// Replicated, gradients all-reduced.
    Ddp,
    /// Replicated, ZeRO-1 AdamW.
    Zero1,
}

/// The outcome of one rank's [`train`].
#[derive(Clone, Debug)]
pub struct Trained {
    /// Every parameter, gathered to full, after the last step.
    pub params: BTreeMap<String, Vec<f64>>,
    /// This rank's loss (mean over its rows) before each step.
    pub losses: Vec<f64>,
    /// This rank's optimizer state bytes after the last step.
    pub state_bytes: usize,
}

pub const ADAMW: AdamWConfig =
    AdamWConfig { lr: 1e-2, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 };

/// Plain SGD (no momentum, no weight decay): the update is `lr` times the gradient, so a
/// gradient off by a uniform factor (a sum over dp instead of the mean) moves every
/// parameter by that factor too, which AdamW's normalisation and clipping would hide.
pub const SGD: SgdConfig =
    SgdConfig { lr: 2.0, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };

/// The optimizer of a [`train_with`] run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optim {
    /// [`ADAMW`], after clipping the global gradient norm at 0.5.
    AdamW,
    /// [`SGD`], without clipping.
    Sgd,
}

/// One rank's optimizer in [`train_with`].
enum Stepper {
    Plain(Box<dyn Optimizer>),
    ZeroAdamW(ZeroRedundancyOptimizer<AdamW>),
    ZeroSgd(ZeroRedundancyOptimizer<Sgd>),
}

/// `steps` AdamW steps (with global grad-norm clipping at 0.5) under `mode` on a (dp, tp)
/// mesh, each dp rank on its rows of [`global_batch`]; `dp == 0` trains on one rank on
/// the whole batch (the oracle). `after_backward` runs on every rank after each backward
/// (for assertions on the model's state).
pub fn train(
    dp: usize,
    tp: usize,
    mode: Mode,
    steps: usize,
    mask: bool,
    after_backward: fn(&LlamaForPretraining) -> Result<(), NnError>,
) -> Vec<Trained> {
    train_with(dp, tp, mode, Optim::AdamW, steps, mask, after_backward)
}

/// As [`train`], with the optimizer `optim` (ZeRO-1 wraps it).
pub fn train_with(
    dp: usize,
    tp: usize,
    mode: Mode,
    optim: Optim,
    steps: usize,
    mask: bool,
    after_backward: fn(&LlamaForPretraining) -> Result<(), NnError>,
) -> Vec<Trained> {
    let body = |mesh: Option<DeviceMesh>| -> Result<Trained, NnError> {
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        let mut _ddp = None;
        if let Some(mesh) = &mesh {
            if tp > 1 {
                parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())
                    .map_err(plan_err)?;
            }
            match mode {
                Mode::Fsdp(cfg) => {
                    shard_model_with(&mut model, &mesh["dp"], &cfg)?;
                    reset_parameters(&mut model, Device::Cpu, 3)?;
                }
                Mode::Ddp => {
                    reset_parameters(&mut model, Device::Cpu, 3)?;
                    _ddp = Some(DataParallel::new(&mut model, &mesh["dp"]).map_err(plan_err)?);
                }
                Mode::Zero1 => {
                    reset_parameters(&mut model, Device::Cpu, 3)?;
                    sync_module_states(&mut model, &mesh["dp"]).map_err(plan_err)?;
                }
            }
        } else {
            reset_parameters(&mut model, Device::Cpu, 3)?;
        }
        let params = tpar_nn::parameters(&model);
        let named = named_parameters(&model);
        let mut opt = match (&mesh, mode, optim) {
            (Some(m), Mode::Zero1, Optim::AdamW) => {
                Stepper::ZeroAdamW(ZeroRedundancyOptimizer::adamw(named, &m["dp"], ADAMW)?)
            }
            (Some(m), Mode::Zero1, Optim::Sgd) => {
                Stepper::ZeroSgd(ZeroRedundancyOptimizer::sgd(named, &m["dp"], SGD)?)
            }
            (_, _, Optim::AdamW) => Stepper::Plain(Box::new(AdamW::with_names(named, ADAMW)?)),
            (_, _, Optim::Sgd) => Stepper::Plain(Box::new(Sgd::with_names(named, SGD)?)),
        };
        let (ids, tgt) = global_batch();
        let (ids, tgt) = match &mesh {
            Some(m) => {
                let rows = 4 / dp;
                let r = m["dp"].local_rank();
                (ids.narrow(0, r * rows, rows)?, tgt.narrow(0, r * rows, rows)?)
            }
            None => (ids, tgt),
        };
        let mut losses = Vec::new();
        for _ in 0..steps {
            if matches!(mode, Mode::Fsdp(_)) && mesh.is_some() {
                unshard(&model)?;
            }
            let loss = loss_of_masked(&model, &ids, &tgt, mask)?;
            losses.push(match &loss {
                Value::DTensor(d) => d.to_local().item()?,
                other => other.clone().into_tensor("loss")?.item()?,
            });
            match &mesh {
                Some(m) => loss_parallel::backward(&loss, &m["tp"])?,
                None => loss.into_tensor("ref")?.backward()?,
            }
            after_backward(&model)?;
            match &mut opt {
                Stepper::ZeroAdamW(z) => {
                    clip_grad_norm_(&mut *z, 0.5, &ClipOptions::default())?;
                    z.step()?;
                    z.zero_grad();
                }
                Stepper::ZeroSgd(z) => {
                    z.step()?;
                    z.zero_grad();
                }
                Stepper::Plain(o) => {
                    if optim == Optim::AdamW {
                        clip_grad_norm_(&params, 0.5, &ClipOptions::default())?;
                    }
                    o.step()?;
                    o.zero_grad();
                }
            }
        }
        let mut out = BTreeMap::new();
        for (n, p) in named_parameters(&model) {
            out.insert(n, p.full()?.to_vec_f64()?);
        }
        let state_bytes = match &opt {
            Stepper::ZeroAdamW(z) => z.state_bytes(),
            Stepper::ZeroSgd(z) => z.state_bytes(),
            Stepper::Plain(o) => o.state_bytes(),
        };
        Ok(Trained { params: out, losses, state_bytes })
    };
    if dp == 0 {
        return vec![body(None).unwrap()];
    }
    spawn_scoped(
        SpawnConfig::new(dp * tp).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
            body(Some(mesh))
        },
    )
    .unwrap_or_else(|e| panic!("{mode:?} dp={dp} tp={tp}: {e}"))
}

/// Single-rank training on the full global batch.
pub fn reference(steps: usize) -> Trained {
    reference_with(Optim::AdamW, steps)
}

/// Single-rank training on the full global batch with `optim`.
pub fn reference_with(optim: Optim, steps: usize) -> Trained {
    train_with(0, 0, Mode::Ddp, optim, steps, false, |_| Ok(())).remove(0)
}

pub fn no_check(_: &LlamaForPretraining) -> Result<(), NnError> {
    Ok(())
}

/// Compares every parameter of `got` with `want` (`tol`, elementwise) and checks that the
/// update each parameter made over the run (final minus `init`) matches the reference
/// update to within `max_update_err` in relative L2, so a tolerance wider than an update
/// cannot hide a missing or mis-scaled one. Returns the largest relative update error.
pub fn check_params(
    what: &str,
    got: &BTreeMap<String, Vec<f64>>,
    want: &BTreeMap<String, Vec<f64>>,
    init: &BTreeMap<String, Vec<f64>>,
    tol: tpar_tensor::tol::Tol,
    max_update_err: f64,
) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    let mut worst: f64 = 0.0;
    let (mut moved, mut total) = (0usize, 0usize);
    for (n, v) in got {
        let (w, i) = (&want[n], &init[n]);
        tol.check(&format!("{what} {n}"), v, w).unwrap();
        let (mut err, mut norm) = (0.0, 0.0);
        for ((g, w), i) in v.iter().zip(w).zip(i) {
            err += (g - w) * (g - w);
            norm += (w - i) * (w - i);
        }
        total += 1;
        if norm == 0.0 {
            assert!(err == 0.0, "{what} {n}: moved where the reference did not");
            continue;
        }
        moved += 1;
        let rel = (err / norm).sqrt();
        assert!(rel <= max_update_err, "{what} {n}: update off by {rel:.4} (relative L2)");
        worst = worst.max(rel);
    }
    assert!(moved * 2 > total, "{what}: only {moved} of {total} parameters moved");
    worst
}

/// An exactly representable gradient for parameter `i` on dp rank `rank`: a fixed pattern
/// times `rank + 1`, so the mean over 2 ranks is the pattern times 1.5, exact in bf16.
pub fn rank_grad(i: usize, rank: usize, numel: usize) -> Vec<f64> {
    (0..numel)
        .map(|e| ((e * 3 + i) % 7) as f64 * 0.25 - 0.75)
        .map(|v| v * (rank + 1) as f64)
        .collect()
}
