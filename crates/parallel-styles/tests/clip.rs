//! One `clip_grad_norm_` for every way a model's gradients are held: the norm (2, inf,
//! 1 and 3) of FSDP's shards, of tensor-parallel DTensors, and of ZeRO-1's ranges
//! (through the optimizer) equals the unsharded model's norm on the same global batch,
//! and the clipped step equals the clipped unsharded step.

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::llama_plans::{megatron_layer_plan, parallelize_llama};
use tpar_models::LlamaForPretraining;
use tpar_nn::{named_parameters, parameters, reset_parameters, NnError};
use tpar_optim::{clip_grad_norm_, AdamW, ClipOptions, Optimizer, ZeroRedundancyOptimizer};
use tpar_tensor::{tol::Tol, DType, Device};

mod common;
use common::{config, plan_err, shard_model, ADAMW};

const NORM_TYPES: [f64; 4] = [2.0, f64::INFINITY, 1.0, 3.0];

/// The unsharded model's gradient norms on the global batch, per norm type.
fn reference_norms() -> Vec<f64> {
    let (ids, tgt) = common::global_batch();
    NORM_TYPES
        .iter()
        .map(|&p| {
            let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
            reset_parameters(&mut model, Device::Cpu, 3).unwrap();
            let loss = common::loss_of(&model, &ids, &tgt).unwrap().into_tensor("ref").unwrap();
            loss.backward().unwrap();
            let opts = ClipOptions::default().norm_type(p);
            let params = parameters(&model);
            clip_grad_norm_(&params, f64::INFINITY, &opts).unwrap().item().unwrap()
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Holder {
    Fsdp,
    Zero1,
}

/// Each rank's norms, per norm type, with the model held as `holder` on a (dp, tp) mesh.
fn sharded_norms(holder: Holder, dp: usize, tp: usize) -> Vec<Vec<f64>> {
    spawn_scoped(SpawnConfig::new(dp * tp), |ctx| -> Result<Vec<f64>, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
        let mut out = Vec::new();
        for &p in &NORM_TYPES {
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            if tp > 1 {
                parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())
                    .map_err(plan_err)?;
            }
            if holder == Holder::Fsdp {
                shard_model(&mut model, &mesh["dp"])?;
            }
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let mut opt: Box<dyn Optimizer> = match holder {
                Holder::Fsdp => Box::new(AdamW::with_names(named_parameters(&model), ADAMW)?),
                Holder::Zero1 => Box::new(ZeroRedundancyOptimizer::adamw(
                    named_parameters(&model),
                    &mesh["dp"],
                    ADAMW,
                )?),
            };
            let rows = 4 / dp;
            let r = mesh["dp"].local_rank();
            let (ids, tgt) = common::global_batch();
            let (ids, tgt) = (ids.narrow(0, r * rows, rows)?, tgt.narrow(0, r * rows, rows)?);
            let loss = common::loss_of(&model, &ids, &tgt)?;
            tpar_parallel_styles::loss_parallel::backward(&loss, &mesh["tp"])?;
            let opts = ClipOptions::default().norm_type(p);
            out.push(clip_grad_norm_(opt.as_mut(), f64::INFINITY, &opts)?.item()?);
        }
        Ok(out)
    })
    .unwrap()
}

#[test]
fn every_norm_type_of_fsdp_tp_and_zero1_gradients_equals_the_unsharded_norm() {
    let want = reference_norms();
    let tol = Tol::for_dtype(DType::F32).scaled(10.0);
    for (holder, dp, tp) in [
        (Holder::Fsdp, 2, 1),
        (Holder::Fsdp, 2, 2),
        (Holder::Zero1, 2, 1),
        (Holder::Zero1, 4, 1),
        (Holder::Zero1, 2, 2),
    ] {
        for (rank, norms) in sharded_norms(holder, dp, tp).iter().enumerate() {
            for ((p, got), want) in NORM_TYPES.iter().zip(norms).zip(&want) {
                assert!(
                    tol.close(*got, *want),
                    "{holder:?} dp={dp} tp={tp} rank {rank} norm_type {p}: {got} vs {want}"
                );
            }
        }
    }
}
