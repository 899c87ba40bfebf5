//! FSDP alone (dp = 2, 4) and TP x FSDP (2x2), and DDP: gradients of every parameter
//! (gathered to full) equal the unsharded model's on the full global batch; gathered
//! parameters are released after each unit's forward.

use std::collections::BTreeMap;
use std::time::Duration;

use tpar_collectives::{spawn_with, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_nn::{
    call, named_parameters, reset_parameters, Args, LlamaConfig, LlamaForPretraining, NnError,
    Param, Value,
};
use tpar_parallel_styles::llama_plans::{megatron_layer_plan, parallelize_llama};
use tpar_parallel_styles::{fully_shard, loss_parallel, unshard, DataParallel, FsdpConfig};
use tpar_tensor::{tol::Tol, DType, Device, Tensor};

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 40,
        max_position_embeddings: 16,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        dtype: DType::F32,
    }
}

/// Global batch: 4 sequences of 6 tokens (+1 for targets), no padding (equal token
/// counts per dp rank, so the mean of per-rank means is the global mean).
fn global_batch() -> (Tensor, Tensor) {
    let v: Vec<i64> = (0..4 * 7).map(|i| ((i * 7 + i / 3) % 39 + 1) as i64).collect();
    let all = Tensor::from_vec(v, [4, 7]).unwrap();
    (all.narrow(1, 0, 6).unwrap(), all.narrow(1, 1, 6).unwrap())
}

fn loss_of(model: &LlamaForPretraining, ids: &Tensor, tgt: &Tensor) -> tpar_nn::Result<Value> {
    let b = ids.dims()[0];
    let logits = call(model, Args::one(ids.clone()))?;
    let logits = match logits {
        Value::Tensor(t) => Value::Tensor(t.reshape([b * 6, 40])?),
        Value::DTensor(d) => Value::DTensor(d.view(&[(b * 6) as isize, 40])?),
        other => other,
    };
    loss_parallel::cross_entropy(&logits, &tgt.reshape([b * 6])?, -100)
}

fn reference() -> BTreeMap<String, Vec<f64>> {
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 3).unwrap();
    let (ids, tgt) = global_batch();
    loss_of(&model, &ids, &tgt).unwrap().into_tensor("ref").unwrap().backward().unwrap();
    named_parameters(&model)
        .into_iter()
        .map(|(n, p)| (n, p.local().grad().unwrap().to_vec_f64().unwrap()))
        .collect()
}

fn shard_model(model: &mut LlamaForPretraining, dp: &DeviceMesh) -> Result<(), NnError> {
    let cfg = FsdpConfig::default();
    let err = |e: tpar_parallel_styles::PlanError| NnError::Config { what: e.to_string() };
    for layer in &mut model.base_model.layers.items {
        fully_shard(layer, dp, &cfg).map_err(err)?;
    }
    fully_shard(&mut model.base_model, dp, &cfg).map_err(err)?;
    fully_shard(model, dp, &cfg).map_err(err)
}

/// Runs one forward+backward on a (dp, tp) mesh; returns every rank's full gradients.
fn run(dp: usize, tp: usize, mode: &str) -> Vec<BTreeMap<String, Vec<f64>>> {
    let mode = mode.to_string();
    spawn_with(
        SpawnConfig::new(dp * tp).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            if tp > 1 {
                parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())
                    .map_err(|e| NnError::Config { what: e.to_string() })?;
            }
            let ddp = if mode == "ddp" {
                reset_parameters(&mut model, Device::Cpu, 3)?;
                Some(
                    DataParallel::new(&mut model, &mesh["dp"])
                        .map_err(|e| NnError::Config { what: e.to_string() })?,
                )
            } else {
                shard_model(&mut model, &mesh["dp"])?;
                reset_parameters(&mut model, Device::Cpu, 3)?;
                None
            };
            // This dp rank's rows of the global batch.
            let (ids, tgt) = global_batch();
            let rows = 4 / dp;
            let r = mesh["dp"].local_rank();
            let (ids, tgt) = (ids.narrow(0, r * rows, rows)?, tgt.narrow(0, r * rows, rows)?);
            unshard(&model).map_err(|e| NnError::Config { what: e.to_string() })?;
            let loss = loss_of(&model, &ids, &tgt)?;
            if mode == "fsdp" {
                // Every layer's gathered parameters were released after its forward.
                for layer in &model.base_model.layers.items {
                    for (_, p) in named_parameters(layer) {
                        if let Param::Fsdp(f) = p {
                            assert!(
                                f.unsharded().is_released(),
                                "a layer parameter stayed gathered after forward"
                            );
                        }
                    }
                }
            }
            loss_parallel::backward(&loss, &mesh["tp"])?;
            if let Some(ddp) = &ddp {
                ddp.sync_gradients(&model).map_err(|e| NnError::Config { what: e.to_string() })?;
            }
            let mut out = BTreeMap::new();
            for (n, p) in named_parameters(&model) {
                let g = p.grad()?.expect("gradient");
                out.insert(n, g.full()?.to_vec_f64()?);
            }
            Ok(out)
        },
    )
    .unwrap_or_else(|e| panic!("dp={dp} tp={tp}: {e}"))
}

fn check(dp: usize, tp: usize, mode: &str) {
    let want = reference();
    let tol = Tol::for_dtype(DType::F32).scaled(10.0);
    for (rank, grads) in run(dp, tp, mode).iter().enumerate() {
        assert_eq!(grads.len(), want.len());
        for (n, g) in grads {
            tol.check(&format!("{mode} dp={dp} tp={tp} rank {rank} {n}"), g, &want[n]).unwrap();
        }
    }
}

#[test]
fn fsdp_gradients_equal_the_unsharded_model() {
    check(2, 1, "fsdp");
    check(4, 1, "fsdp");
}

#[test]
fn tp_times_fsdp_gradients_equal_the_unsharded_model() {
    check(2, 2, "fsdp");
}

#[test]
fn ddp_gradients_equal_the_unsharded_model() {
    check(2, 1, "ddp");
    check(2, 2, "ddp");
}

/// Three AdamW steps (with global grad-norm clipping) under each parallel layout leave
/// every parameter equal to single-rank training on the full global batch.
fn train3(dp: usize, tp: usize, mode: &str) -> Vec<BTreeMap<String, Vec<f64>>> {
    use tpar_nn::optim::{clip_grad_norm, AdamW, AdamWConfig, Optimizer};
    let mode = mode.to_string();
    let world = dp * tp;
    let body = |mesh: Option<DeviceMesh>| -> Result<BTreeMap<String, Vec<f64>>, NnError> {
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        let mut ddp = None;
        if let Some(mesh) = &mesh {
            if tp > 1 {
                parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())
                    .map_err(|e| NnError::Config { what: e.to_string() })?;
            }
            if mode == "ddp" {
                reset_parameters(&mut model, Device::Cpu, 3)?;
                ddp = Some(
                    DataParallel::new(&mut model, &mesh["dp"])
                        .map_err(|e| NnError::Config { what: e.to_string() })?,
                );
            } else {
                shard_model(&mut model, &mesh["dp"])?;
                reset_parameters(&mut model, Device::Cpu, 3)?;
            }
        } else {
            reset_parameters(&mut model, Device::Cpu, 3)?;
        }
        let params = tpar_nn::parameters(&model);
        let mut opt = AdamW::with_names(
            named_parameters(&model),
            AdamWConfig { lr: 1e-2, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 },
        )?;
        let (ids, tgt) = global_batch();
        let (ids, tgt) = match &mesh {
            Some(m) => {
                let rows = 4 / dp;
                let r = m["dp"].local_rank();
                (ids.narrow(0, r * rows, rows)?, tgt.narrow(0, r * rows, rows)?)
            }
            None => (ids, tgt),
        };
        for _ in 0..3 {
            let loss = loss_of(&model, &ids, &tgt)?;
            match &mesh {
                Some(m) => loss_parallel::backward(&loss, &m["tp"])?,
                None => loss.into_tensor("ref")?.backward()?,
            }
            if let Some(d) = &ddp {
                d.sync_gradients(&model).map_err(|e| NnError::Config { what: e.to_string() })?;
            }
            clip_grad_norm(&params, 0.5)?;
            opt.step()?;
            opt.zero_grad();
        }
        let mut out = BTreeMap::new();
        for (n, p) in named_parameters(&model) {
            out.insert(n, p.full()?.to_vec_f64()?);
        }
        Ok(out)
    };
    if world == 0 {
        return vec![body(None).unwrap()];
    }
    spawn_with(
        SpawnConfig::new(world).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
            body(Some(mesh))
        },
    )
    .unwrap_or_else(|e| panic!("{mode} dp={dp} tp={tp}: {e}"))
}

#[test]
fn three_optimizer_steps_equal_single_rank_training() {
    let want = train3(0, 0, "ref").remove(0);
    let tol = Tol::for_dtype(DType::F32).scaled(20.0);
    for (dp, tp, mode) in [(2, 1, "fsdp"), (4, 1, "fsdp"), (2, 2, "fsdp"), (2, 1, "ddp")] {
        for (rank, params) in train3(dp, tp, mode).iter().enumerate() {
            for (n, v) in params {
                tol.check(
                    &format!("{mode} dp={dp} tp={tp} rank {rank} {n} after 3 steps"),
                    v,
                    &want[n],
                )
                .unwrap();
            }
        }
    }
}
