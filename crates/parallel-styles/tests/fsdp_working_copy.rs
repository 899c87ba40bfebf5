//! FSDP mixed precision with AdamW writing each shard's bf16 working copy in its step:
//! the gathers then send that copy instead of casting the f32 shard, and training is
//! bit for bit the training that casts at every gather (the copy made out of date after
//! every step, as before the copies existed), over one dp rank (no collective: the
//! gather is the cast shard) and two (the flat all-gather), with and without
//! resharding after the forward.

use std::collections::BTreeMap;
use std::time::Duration;

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::LlamaForPretraining;
use tpar_nn::{named_parameters, reset_parameters, NnError};
use tpar_optim::{clip_grad_norm_, AdamW, ClipOptions, Optimizer, Sgd};
use tpar_parallel_styles::{fsdp_param, unshard, FsdpConfig, MixedPrecision};
use tpar_tensor::{DType, Device};

mod common;
use common::{config, global_batch, loss_of, shard_model_with, ADAMW, SGD};

/// What one rank saw: its loss before each step (bits) and every parameter gathered to
/// full after the last step (bits).
struct Run {
    losses: Vec<u64>,
    params: BTreeMap<String, Vec<u64>>,
}

/// Whether every FSDP parameter of `model` holds a current working copy.
fn copies_current(model: &LlamaForPretraining) -> Result<Vec<(String, bool)>, NnError> {
    let mut out = Vec::new();
    for (name, p) in named_parameters(model) {
        let f = fsdp_param(&p)?
            .ok_or_else(|| NnError::Config { what: format!("{name} is not FSDP-managed") })?;
        out.push((name, f.has_current_working_copy()));
    }
    Ok(out)
}

/// Four AdamW steps (clipped at 0.5) of the tiny Llama under FSDP with bf16 compute and
/// f32 master shards on `dp` ranks. `cast_every_gather` marks every working copy out of
/// date after each step (what [`tpar_nn::Unshard::invalidate`] does after an in-place
/// load), so every gather casts the shard instead. Checks on the way that the copies are
/// current after each step and out of date once the gradients arrive.
fn train(dp: usize, reshard_after_forward: bool, cast_every_gather: bool) -> Vec<Run> {
    let cfg = FsdpConfig {
        reshard_after_forward,
        mixed_precision: Some(MixedPrecision {
            param_dtype: DType::BF16,
            reduce_dtype: DType::F32,
        }),
    };
    spawn_scoped(
        SpawnConfig::new(dp).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp], &["dp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            shard_model_with(&mut model, &mesh, &cfg)?;
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let params = tpar_nn::parameters(&model);
            let mut opt = AdamW::with_names(named_parameters(&model), ADAMW)?;
            let (ids, tgt) = global_batch();
            let rows = 4 / dp;
            let r = ctx.rank();
            let (ids, tgt) = (ids.narrow(0, r * rows, rows)?, tgt.narrow(0, r * rows, rows)?);
            let mut losses = Vec::new();
            for step in 0..4 {
                unshard(&model)?;
                let loss = loss_of(&model, &ids, &tgt)?.into_tensor("loss")?;
                losses.push(loss.item()?.to_bits());
                loss.backward()?;
                for (name, current) in copies_current(&model)? {
                    assert!(!current, "step {step}: {name}'s copy is current after its gradient");
                }
                clip_grad_norm_(&params, 0.5, &ClipOptions::default())?;
                opt.step()?;
                opt.zero_grad();
                for (name, current) in copies_current(&model)? {
                    assert!(current, "step {step}: AdamW did not write {name}'s working copy");
                }
                if cast_every_gather {
                    for p in &params {
                        if let Some(u) = p.unsharder()? {
                            u.invalidate()?;
                        }
                    }
                }
            }
            let mut out = BTreeMap::new();
            for (n, p) in named_parameters(&model) {
                out.insert(n, p.full()?.to_vec_f64()?.iter().map(|v| v.to_bits()).collect());
            }
            // Any other update of the shards (here SGD's) leaves the copies out of date.
            for (_, p) in named_parameters(&model) {
                p.trainable().set_grad(Some(p.trainable().zeros_like()?));
            }
            let mut sgd = Sgd::with_names(named_parameters(&model), SGD)?;
            sgd.step()?;
            for (name, current) in copies_current(&model)? {
                assert!(!current, "{name}'s copy is current after an SGD step");
            }
            Ok(Run { losses, params: out })
        },
    )
    .unwrap_or_else(|e| panic!("dp {dp}: {e}"))
}

#[test]
fn working_copies_train_as_casting_at_every_gather() {
    for (dp, reshard) in [(1, true), (2, true), (2, false)] {
        let (fused, cast) = (train(dp, reshard, false), train(dp, reshard, true));
        for (r, (a, b)) in fused.iter().zip(&cast).enumerate() {
            let what = format!("dp {dp} reshard_after_forward {reshard}: rank {r}");
            let f64s = |v: &[u64]| v.iter().map(|b| f64::from_bits(*b)).collect::<Vec<_>>();
            assert_eq!(f64s(&a.losses), f64s(&b.losses), "{what}: losses");
            assert_eq!(a.params.len(), b.params.len(), "{what}: parameters");
            for ((name, x), y) in a.params.iter().zip(b.params.values()) {
                let at = x.iter().zip(y).position(|(p, q)| p != q);
                if let Some(i) = at {
                    let (p, q) = (f64::from_bits(x[i]), f64::from_bits(y[i]));
                    panic!("{what}: {name}[{i}] is {p} with working copies, {q} casting");
                }
            }
        }
        // The runs trained: the loss moved.
        assert_ne!(fused[0].losses[0], fused[0].losses[3], "dp {dp}: the loss did not move");
    }
}
