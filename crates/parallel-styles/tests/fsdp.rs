//! FSDP alone (dp = 2, 4) and TP x FSDP (2x2), and DDP: gradients of every parameter
//! (gathered to full) equal the unsharded model's on the full global batch; gathered
//! parameters are released after each unit's forward; AdamW and plain SGD training equal
//! single-rank training; collectives run in the configured (mixed-precision) dtypes.

use std::collections::BTreeMap;
use std::time::Duration;

use tpar_collectives::{spawn_scoped, CollectiveKind, CommRecord, ReduceOp, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::llama_plans::{
    megatron_layer_plan, parallelize_llama, sequence_parallel_layer_plan,
};
use tpar_models::LlamaForPretraining;
use tpar_nn::{call, named_parameters, reset_parameters, Args, NnError, Param, Value};
use tpar_parallel_styles::{
    explain_collectives, fsdp_param, fsdp_units, fully_shard, loss_parallel, unshard, DataParallel,
    FsdpConfig, MixedPrecision,
};
use tpar_tensor::{tol::Tol, DType, Device, Tensor};

mod common;
use common::{
    check_params, config, global_batch, loss_of, no_check, rank_grad, reference, reference_grads,
    reference_with, shard_model, shard_model_with, train, train_with, Mode, Optim,
};

/// Runs one forward+backward on a (dp, tp) mesh; returns every rank's full gradients.
fn run(dp: usize, tp: usize, mode: &str) -> Vec<BTreeMap<String, Vec<f64>>> {
    let mode = mode.to_string();
    spawn_scoped(
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
            unshard(&model)?;
            let loss = loss_of(&model, &ids, &tgt)?;
            if mode == "fsdp" {
                // Every layer's gathered parameters were released after its forward.
                for layer in &model.base_model.layers.items {
                    for (_, p) in named_parameters(layer) {
                        if let Some(f) = fsdp_param(&p)? {
                            assert!(
                                f.unsharded().is_released(),
                                "a layer parameter stayed gathered after forward"
                            );
                        }
                    }
                }
            }
            // DDP averages the gradients during the backward pass.
            loss_parallel::backward(&loss, &mesh["tp"])?;
            drop(ddp);
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
    let want = reference_grads();
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

/// DDP reduces each dtype's gradients in that dtype: with f32 and bf16 parameters,
/// `sync_gradients` issues one all_reduce (avg) per dtype whose bytes are that dtype's
/// gradient elements times its size, and leaves every gradient in its parameter's dtype
/// equal to the mean over dp (exactly: the terms are small multiples of 1/4).
#[test]
fn ddp_all_reduces_each_dtype_in_that_dtype() {
    use tpar_nn::{Linear, ModuleList};
    let out = spawn_scoped(
        SpawnConfig::new(2).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
            let mut model = ModuleList::new(vec![
                Linear::new(5, 3, true, DType::F32, Device::Cpu)?,
                Linear::new(4, 7, false, DType::BF16, Device::Cpu)?,
                Linear::new(3, 2, true, DType::F32, Device::Cpu)?,
            ]);
            reset_parameters(&mut model, Device::Cpu, 5)?;
            let ddp = DataParallel::new(&mut model, &mesh).map_err(common::plan_err)?;
            let params = tpar_nn::parameters(&model);
            for (i, p) in params.iter().enumerate() {
                let t = p.trainable();
                let g = rank_grad(i, ctx.rank(), t.numel());
                t.set_grad(Some(Tensor::from_f64(&g, t.dims(), t.dtype())?));
            }
            let dbg = mesh.group(0)?.comm_debug();
            dbg.enable();
            ddp.sync_gradients(&model).map_err(common::plan_err)?;
            dbg.disable();
            let grads: Vec<(DType, DType, Vec<f64>)> = params
                .iter()
                .map(|p| {
                    let (t, g) = (p.trainable(), p.trainable().grad().expect("a gradient"));
                    Ok((t.dtype(), g.dtype(), g.to_vec_f64()?))
                })
                .collect::<Result<_, NnError>>()?;
            Ok((dbg.take(), grads))
        },
    )
    .unwrap();
    // Elements per dtype: f32 5*3 + 3 + 3*2 + 2, bf16 4*7.
    let mut want = vec![(DType::BF16, 28 * 2), (DType::F32, 26 * 4)];
    want.sort_by_key(|(d, _)| d.name());
    for (rank, (recs, grads)) in out.into_iter().enumerate() {
        let mut got: Vec<(DType, usize)> = recs
            .iter()
            .map(|r| {
                assert_eq!(
                    (r.kind, r.op),
                    (CollectiveKind::AllReduce, Some(ReduceOp::Avg)),
                    "rank {rank}: {r}"
                );
                (r.dtype.expect("a dtype"), r.bytes)
            })
            .collect();
        got.sort_by_key(|(d, _)| d.name());
        assert_eq!(got, want, "rank {rank}: all_reduce dtypes and bytes");
        for (i, (pd, gd, g)) in grads.into_iter().enumerate() {
            assert_eq!(gd, pd, "rank {rank} parameter {i}: gradient dtype");
            let mean: Vec<f64> = rank_grad(i, 0, g.len()).iter().map(|v| v * 1.5).collect();
            assert_eq!(g, mean, "rank {rank} parameter {i} ({pd}): the mean over dp");
        }
    }
}

/// Three AdamW steps (with global grad-norm clipping) under each parallel layout leave
/// every parameter equal to single-rank training on the full global batch.
#[test]
fn three_optimizer_steps_equal_single_rank_training() {
    let want = reference(3).params;
    let tol = Tol::for_dtype(DType::F32).scaled(20.0);
    let fsdp = Mode::Fsdp(FsdpConfig::default());
    for (dp, tp, mode) in [(2, 1, fsdp), (4, 1, fsdp), (2, 2, fsdp), (2, 1, Mode::Ddp)] {
        for (rank, t) in train(dp, tp, mode, 3, false, no_check).iter().enumerate() {
            for (n, v) in &t.params {
                tol.check(
                    &format!("{mode:?} dp={dp} tp={tp} rank {rank} {n} after 3 steps"),
                    v,
                    &want[n],
                )
                .unwrap();
            }
        }
    }
}

/// Three plain SGD steps (no clipping) under each data-parallel layout equal single-rank
/// SGD on the full global batch, update for update. SGD moves each parameter by `lr`
/// times its gradient, so a gradient mis-scaled over dp (a sum instead of the mean)
/// shows here, where AdamW's normalisation and clipping would divide it out.
#[test]
fn three_sgd_steps_equal_single_rank_sgd() {
    let init = reference_with(Optim::Sgd, 0).params;
    let want = reference_with(Optim::Sgd, 3).params;
    let tol = Tol::for_dtype(DType::F32).scaled(20.0);
    let fsdp = Mode::Fsdp(FsdpConfig::default());
    for (dp, tp, mode) in
        [(2, 1, fsdp), (4, 1, fsdp), (2, 2, fsdp), (2, 1, Mode::Ddp), (2, 2, Mode::Ddp)]
    {
        for (rank, t) in train_with(dp, tp, mode, Optim::Sgd, 3, false, no_check).iter().enumerate()
        {
            let what = format!("{mode:?} dp={dp} tp={tp} rank {rank} after 3 SGD steps");
            let worst = check_params(&what, &t.params, &want, &init, tol, 1e-3);
            println!("{what}: worst relative update error {worst:.2e}");
        }
    }
}

const BF16_MP: FsdpConfig = FsdpConfig {
    reshard_after_forward: true,
    mixed_precision: Some(MixedPrecision { param_dtype: DType::BF16, reduce_dtype: DType::F32 }),
};

/// Every parameter is FSDP-managed with bf16 gathered parameters, f32 master shards and
/// an f32 gradient on the shard.
fn assert_bf16_compute_f32_master(model: &LlamaForPretraining) -> Result<(), NnError> {
    let fail = |what: String| Err(NnError::Config { what });
    for (name, p) in named_parameters(model) {
        let Some(f) = fsdp_param(&p)? else {
            return fail(format!("{name} is not FSDP-managed"));
        };
        let (u, s) = (f.unsharded().dtype(), f.sharded().dtype());
        if u != DType::BF16 || s != DType::F32 {
            return fail(format!("{name}: unsharded {u}, sharded {s} (want bf16, f32)"));
        }
        match f.sharded().grad() {
            Some(g) if g.dtype() == DType::F32 => {}
            Some(g) => return fail(format!("{name}: gradient in {}, want f32", g.dtype())),
            None => return fail(format!("{name}: no gradient")),
        }
    }
    Ok(())
}

/// With `MixedPrecision { bf16, f32 }` the forward computes in bf16 (logits, and the RoPE
/// tables and padding mask, built in the f32 config dtype, are cast to it), while master
/// shards and their gradients stay f32.
#[test]
fn fsdp_mixed_precision_computes_in_bf16_with_f32_master_shards() {
    spawn_scoped(
        SpawnConfig::new(2).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            shard_model_with(&mut model, &mesh, &BF16_MP)?;
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let (ids, tgt) = global_batch();
            let (ids, tgt) = (ids.narrow(0, 2 * ctx.rank(), 2)?, tgt.narrow(0, 2 * ctx.rank(), 2)?);
            let mask = Tensor::from_vec(vec![1i64, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1], [2, 6])?;
            let logits = call(&model, Args::new(vec![Value::Tensor(ids), Value::Tensor(mask)]))?
                .into_tensor("logits")?;
            assert_eq!(logits.dtype(), DType::BF16, "logits under bf16 mixed precision");
            let loss = logits.reshape([12, 40])?.cross_entropy(&tgt.reshape([12])?, -100)?;
            assert!(loss.item()?.is_finite());
            loss.backward()?;
            assert_bf16_compute_f32_master(&model)
        },
    )
    .unwrap();
}

/// One rank's collectives of one FSDP forward and backward; each unit's name and the
/// elements of its flat all-gather input (its parameters' dp shards, each padded to
/// `ceil(rows / dp)` rows); each master shard's gradient dtype.
type Recorded = (Vec<CommRecord>, Vec<(String, usize)>, Vec<DType>);

/// [`Recorded`] on each rank for `cfg` at dp = 2.
fn record_fsdp_step(cfg: FsdpConfig) -> Vec<Recorded> {
    spawn_scoped(
        SpawnConfig::new(2).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            shard_model_with(&mut model, &mesh, &cfg)?;
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let (ids, tgt) = global_batch();
            let (ids, tgt) = (ids.narrow(0, 2 * ctx.rank(), 2)?, tgt.narrow(0, 2 * ctx.rank(), 2)?);
            let dbg = mesh.group(0)?.comm_debug();
            dbg.enable();
            unshard(&model)?;
            loss_of(&model, &ids, &tgt)?.into_tensor("loss")?.backward()?;
            dbg.disable();
            let mut grad_dtypes = Vec::new();
            for (name, p) in named_parameters(&model) {
                let Some(f) = fsdp_param(&p)? else {
                    return Err(NnError::Config { what: format!("{name} is not FSDP-managed") });
                };
                grad_dtypes.push(f.sharded().grad().expect("a reduced gradient").dtype());
            }
            let units = fsdp_units(&model)
                .into_iter()
                .map(|(fqn, g)| {
                    let padded: usize = g
                        .params()
                        .iter()
                        .map(|p| {
                            let s = p.local_shape();
                            s[0].div_ceil(2) * s[1..].iter().product::<usize>()
                        })
                        .sum();
                    (fqn, padded)
                })
                .collect();
            Ok((dbg.take(), units, grad_dtypes))
        },
    )
    .unwrap()
}

/// FSDP communicates per unit, in the configured dtypes: each unit's dp shards are
/// gathered with one all_gather of one flat `param_dtype` buffer (its bytes are its
/// elements times that dtype's size), once for the forward and once more for the
/// backward of every unit but the root (which keeps its parameters for the backward);
/// each unit's gradients are reduce-scattered (averaged) exactly once, as one flat
/// `reduce_dtype` buffer of dp times the unit's shard elements; nothing else is
/// communicated. The master shards and their gradients stay f32. Each setting differs
/// from the others in one dtype: without mixed precision (f32, f32), bf16 with f32
/// reductions, bf16 reduced in bf16, and f32 compute with bf16 reductions, so reducing in
/// the parameter, compute or master dtype, or in a fixed one, fails one of them.
#[test]
fn fsdp_collectives_run_in_param_and_reduce_dtypes() {
    let mp = |param_dtype, reduce_dtype| Some(MixedPrecision { param_dtype, reduce_dtype });
    for mixed_precision in [
        None,
        mp(DType::BF16, DType::F32),
        mp(DType::BF16, DType::BF16),
        mp(DType::F32, DType::BF16),
    ] {
        let cfg = FsdpConfig { reshard_after_forward: true, mixed_precision };
        let (pd, rd) =
            mixed_precision.map_or((DType::F32, DType::F32), |m| (m.param_dtype, m.reduce_dtype));
        for (rank, (recs, units, grad_dtypes)) in record_fsdp_step(cfg).into_iter().enumerate() {
            let what = format!("param {pd}, reduce {rd}, rank {rank}");
            let all: Vec<String> = recs.iter().map(|r| r.to_string()).collect();
            let numel = |s: &[usize]| s.iter().product::<usize>();
            let mut gathered = Vec::new();
            let mut reduced = Vec::new();
            for r in &recs {
                match r.kind {
                    CollectiveKind::AllGather => {
                        assert_eq!(r.dtype, Some(pd), "{what}: {r}");
                        assert_eq!(r.bytes, numel(&r.shape) * pd.size_in_bytes(), "{what}: {r}");
                        gathered.push(r.shape.clone());
                    }
                    CollectiveKind::ReduceScatter => {
                        assert_eq!((r.dtype, r.op), (Some(rd), Some(ReduceOp::Avg)), "{what}: {r}");
                        assert_eq!(r.bytes, numel(&r.shape) * rd.size_in_bytes(), "{what}: {r}");
                        reduced.push(r.shape.clone());
                    }
                    _ => panic!("{what}: unexpected {r} in {all:#?}"),
                }
            }
            assert_eq!(units.len(), 4, "{what}: units {units:?}");
            let mut want_reduced: Vec<Vec<usize>> =
                units.iter().map(|(_, n)| vec![2 * n]).collect();
            let mut want_gathered: Vec<Vec<usize>> = units.iter().map(|(_, n)| vec![*n]).collect();
            want_gathered
                .extend(units.iter().filter(|(f, _)| !f.is_empty()).map(|(_, n)| vec![*n]));
            for v in [&mut want_reduced, &mut reduced, &mut want_gathered, &mut gathered] {
                v.sort();
            }
            assert_eq!(reduced, want_reduced, "{what}: reduce_scatter shapes in {all:#?}");
            assert_eq!(gathered, want_gathered, "{what}: all_gather shapes in {all:#?}");
            assert!(grad_dtypes.iter().all(|d| *d == DType::F32), "{what}: {grad_dtypes:?}");
        }
    }
}

/// The FSDP collectives of one step on a 2 x 2 (dp x tp) Llama (2 layers, 4 heads, 2
/// kv heads) with the sequence-parallel plan and `loss_parallel`, `fully_shard` per
/// decoder layer and on the root, as on rank 0 of PyTorch 2.15: at most 3 all_gathers
/// on the dp group in forward (one per unit), 2 in backward (the layers; the root keeps
/// its parameters) and 3 reduce_scatters (one per unit). The gradients still equal the
/// unsharded model's.
#[test]
fn fsdp_issues_one_gather_and_one_reduce_per_unit_on_a_2x2_llama() {
    let out = spawn_scoped(
        SpawnConfig::new(4).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            parallelize_llama(&mut model, &mesh["tp"], &sequence_parallel_layer_plan())
                .map_err(common::plan_err)?;
            let fsdp = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &fsdp)?;
            }
            fully_shard(&mut model, &mesh["dp"], &fsdp)?;
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let (ids, tgt) = global_batch();
            let r = mesh["dp"].local_rank();
            let (ids, tgt) = (ids.narrow(0, 2 * r, 2)?, tgt.narrow(0, 2 * r, 2)?);
            let dbg = ctx.world_group().comm_debug();
            dbg.enable();
            unshard(&model)?;
            let loss = loss_of(&model, &ids, &tgt)?;
            let forward = dbg.take();
            loss_parallel::backward(&loss, &mesh["tp"])?;
            let backward = dbg.take();
            dbg.disable();
            let table = explain_collectives(&[("forward", &forward), ("backward", &backward)]);
            let dp_ranks = mesh["dp"].group(0)?.ranks().to_vec();
            let mut grads = BTreeMap::new();
            for (n, p) in named_parameters(&model) {
                let g = p.grad()?.expect("gradient");
                grads.insert(n, g.full()?.to_vec_f64()?);
            }
            Ok((forward, backward, dp_ranks, table, grads))
        },
    )
    .unwrap();
    let (forward, backward, dp, table, _) = &out[0];
    println!("rank 0, one step:\n{table}");
    let on_dp = |recs: &[CommRecord], kind| {
        recs.iter().filter(|r| r.kind == kind && &r.group == dp).count()
    };
    let (ag_fwd, ag_bwd) =
        (on_dp(forward, CollectiveKind::AllGather), on_dp(backward, CollectiveKind::AllGather));
    let rs = on_dp(forward, CollectiveKind::ReduceScatter)
        + on_dp(backward, CollectiveKind::ReduceScatter);
    println!(
        "FSDP on dp {dp:?}: all_gather {ag_fwd} forward, {ag_bwd} backward; reduce_scatter {rs}"
    );
    assert!((1..=3).contains(&ag_fwd), "{ag_fwd} all_gathers on dp in forward\n{table}");
    assert!((1..=2).contains(&ag_bwd), "{ag_bwd} all_gathers on dp in backward\n{table}");
    assert!((1..=3).contains(&rs), "{rs} reduce_scatters on dp\n{table}");
    assert!(table.contains("reduce_scatter") && table.contains("forward"), "{table}");
    let want = reference_grads();
    let tol = Tol::for_dtype(DType::F32).scaled(10.0);
    for (rank, (.., grads)) in out.iter().enumerate() {
        assert_eq!(grads.len(), want.len());
        for (n, g) in grads {
            tol.check(&format!("sp 2x2 per-unit FSDP rank {rank} {n}"), g, &want[n]).unwrap();
        }
    }
}

/// One unit of parameters with awkward dim-0 sizes (dp * 3 + {0, 1, 2} rows, a 1-row
/// one, so some ranks hold padding only) and two dtypes, gathered and reduced directly:
/// one all_gather and one reduce_scatter per dtype; the gathered parameters equal the
/// full values; the shards' gradients are the dp-mean of each rank's gradient, sharded
/// (added to what was there); a parameter the loss does not use gets no gradient.
#[test]
fn a_unit_with_uneven_and_mixed_dtype_parameters_gathers_and_reduces_per_dtype() {
    use tpar_fsdp::FsdpParam;
    use tpar_fsdp::FsdpParamGroup;
    for dp in [2, 3, 4] {
        let shapes: Vec<(Vec<usize>, DType)> = vec![
            (vec![dp * 3, 2], DType::F32),
            (vec![dp * 3 + 1], DType::F32),
            (vec![dp * 3 + 2, 3], DType::BF16),
            (vec![1, 4], DType::F32),
            (vec![dp + 1, 2], DType::F32), // unused by the loss
        ];
        let full = |i: usize| -> Vec<f64> {
            let n: usize = shapes[i].0.iter().product();
            (0..n).map(|e| ((e * 5 + i * 3) % 11) as f64 * 0.25 - 1.0).collect()
        };
        let out = spawn_scoped(
            SpawnConfig::new(dp).timeout(Duration::from_secs(60)),
            |ctx| -> Result<_, NnError> {
                let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp], &["dp"])?;
                let pg = mesh.group(0)?.clone();
                let params = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, (s, d))| {
                        let t = Tensor::from_f64(&full(i), s.clone(), *d)?;
                        FsdpParam::new(&t, None, &mesh, *d, *d)
                    })
                    .collect::<Result<Vec<_>, NnError>>()?;
                let group = FsdpParamGroup::new("unit", &pg, params.clone())?;
                // A gradient already on a shard is added to.
                let leaf = params[0].sharded();
                leaf.set_grad(Some(Tensor::ones(leaf.shape().clone(), DType::F32, Device::Cpu)?));
                let dbg = pg.comm_debug();
                dbg.enable();
                group.unshard()?;
                let gathered: Vec<Vec<f64>> =
                    params.iter().map(|p| p.unsharded().to_vec_f64()).collect::<Result<_, _>>()?;
                // loss = sum_i (rank + 1) * i * sum(u_i), parameter 4 left out.
                let mut loss = Tensor::scalar(0.0, DType::F32);
                for (i, p) in params.iter().enumerate().take(4) {
                    let s = p.unsharded().to_dtype(DType::F32)?.sum_all()?;
                    loss = loss.add(&s.mul_scalar(((ctx.rank() + 1) * (i + 1)) as f64)?)?;
                }
                loss.backward()?;
                dbg.disable();
                let released = params.iter().all(|p| p.unsharded().is_released());
                let grads: Vec<Option<Vec<f64>>> = params
                    .iter()
                    .map(|p| p.gather_full(&p.sharded().grad()?).ok()?.to_vec_f64().ok())
                    .collect();
                let _ = group;
                Ok((dbg.take(), gathered, grads, released))
            },
        )
        .unwrap_or_else(|e| panic!("dp {dp}: {e}"));
        // The mean over ranks of (rank + 1) is (dp + 1) / 2.
        let mean = (dp + 1) as f64 / 2.0;
        for (rank, (recs, gathered, grads, released)) in out.into_iter().enumerate() {
            let what = format!("dp {dp} rank {rank}");
            let kinds: Vec<(CollectiveKind, Option<DType>)> =
                recs.iter().map(|r| (r.kind, r.dtype)).collect();
            assert_eq!(
                kinds,
                [
                    (CollectiveKind::AllGather, Some(DType::F32)),
                    (CollectiveKind::AllGather, Some(DType::BF16)),
                    (CollectiveKind::ReduceScatter, Some(DType::F32)),
                    (CollectiveKind::ReduceScatter, Some(DType::BF16)),
                ],
                "{what}: {recs:#?}"
            );
            // Padded shards: f32 3 rows of 2, 4 rows of 1, 1 row of 4, and 2 rows of 2
            // (gathered, not reduced); bf16 4 rows of 3.
            assert_eq!(recs[0].shape, [6 + 4 + 4 + 4], "{what}");
            assert_eq!(recs[1].shape, [12], "{what}");
            assert_eq!(recs[2].shape, [dp * (6 + 4 + 4)], "{what}");
            assert_eq!(recs[3].shape, [dp * 12], "{what}");
            assert!(released, "{what}: the unit stayed gathered after backward");
            for (i, g) in gathered.iter().enumerate() {
                assert_eq!(g, &full(i), "{what}: parameter {i} gathered");
            }
            for (i, g) in grads.iter().enumerate() {
                let n: usize = shapes[i].0.iter().product();
                let base = if i == 0 { 1.0 } else { 0.0 };
                match (i, g) {
                    (4, None) => {}
                    (4, Some(_)) => panic!("{what}: the unused parameter got a gradient"),
                    (_, None) => panic!("{what}: parameter {i} got no gradient"),
                    (_, Some(g)) => {
                        assert_eq!(
                            g,
                            &vec![base + mean * (i + 1) as f64; n],
                            "{what}: parameter {i}"
                        )
                    }
                }
            }
        }
    }
}
/// Three AdamW steps under bf16 mixed precision at dp = 2 (with a padding mask input)
/// stay close to f32 single-rank training, and the loss falls.
///
/// Tolerances: AdamW's update is about `lr * sign(g)` where the moments are young, so an
/// element whose gradient is within bf16 noise of 0 can move the other way; after 3
/// steps at lr 1e-2 that is at most `2 * 3 * lr = 0.06` apart, which is bf16's tolerance
/// scaled by 3, elementwise. Beyond that bound, each parameter's update over the 3 steps
/// (final minus initial value) must match the f32 update to within 12% in L2 (observed
/// at most ~8%; an update missing one of the three steps would be ~33% off).
#[test]
fn fsdp_mixed_precision_trains_close_to_f32() {
    mixed_precision_close_to_f32(2);
}

/// [`fsdp_mixed_precision_trains_close_to_f32`] at `dp`.
fn mixed_precision_close_to_f32(dp: usize) {
    const UPDATE_REL_L2: f64 = 0.12;
    let init = reference(0).params;
    let want = reference(3).params;
    let got = train(dp, 1, Mode::Fsdp(BF16_MP), 3, true, assert_bf16_compute_f32_master);
    let tol = Tol::for_dtype(DType::BF16).scaled(3.0);
    for (rank, t) in got.iter().enumerate() {
        assert!(t.losses[2] < t.losses[0], "rank {rank}: loss did not fall: {:?}", t.losses);
        for (n, v) in &t.params {
            let what = format!("bf16 MP dp={dp} rank {rank} {n} after 3 steps");
            tol.check(&what, v, &want[n]).unwrap();
            let (mut err, mut norm) = (0.0, 0.0);
            for ((g, w), i) in v.iter().zip(&want[n]).zip(&init[n]) {
                err += (g - w) * (g - w);
                norm += (w - i) * (w - i);
            }
            let rel = (err / norm).sqrt();
            assert!(rel <= UPDATE_REL_L2, "{what}: update off by {rel:.3} (relative L2)");
        }
    }
}

/// Over a dp group of one, FSDP issues no collective on it (each unsharded parameter is
/// its shard, cast; each gradient goes straight to its shard) and still trains as the
/// unsharded model: the gradients at dp 1 x tp 1 and dp 1 x tp 2, three AdamW steps at
/// both, and bf16 mixed precision (bf16 compute over f32 master shards, close to f32
/// training as at dp 2). The layers' parameters are released after their forward, as
/// at any dp.
#[test]
fn fsdp_over_one_dp_rank_trains_as_the_unsharded_model_without_collectives() {
    check(1, 1, "fsdp");
    check(1, 2, "fsdp");
    let want = reference(3).params;
    let tol = Tol::for_dtype(DType::F32).scaled(20.0);
    for tp in [1, 2] {
        let fsdp = Mode::Fsdp(FsdpConfig::default());
        for (rank, t) in train(1, tp, fsdp, 3, false, no_check).iter().enumerate() {
            for (n, v) in &t.params {
                let what = format!("FSDP dp=1 tp={tp} rank {rank} {n} after 3 steps");
                tol.check(&what, v, &want[n]).unwrap();
            }
        }
    }
    mixed_precision_close_to_f32(1);
    for cfg in [FsdpConfig::default(), BF16_MP] {
        let recs = spawn_scoped(SpawnConfig::new(1), |ctx| -> Result<_, NnError> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[1], &["dp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            shard_model_with(&mut model, &mesh, &cfg)?;
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let (ids, tgt) = global_batch();
            let dbg = mesh.group(0)?.comm_debug();
            dbg.enable();
            unshard(&model)?;
            loss_of(&model, &ids, &tgt)?.into_tensor("loss")?.backward()?;
            dbg.disable();
            for (name, p) in named_parameters(&model) {
                let Some(f) = fsdp_param(&p)? else {
                    return Err(NnError::Config { what: format!("{name} is not FSDP-managed") });
                };
                let g = f.sharded().grad().expect("a gradient on the shard");
                assert_eq!(g.dtype(), DType::F32, "{name}: the master gradient's dtype");
            }
            Ok(dbg.take())
        })
        .unwrap();
        assert!(recs[0].is_empty(), "{cfg:?}: collectives at dp 1: {:?}", recs[0]);
    }
}

/// Three plain SGD steps under bf16 mixed precision at dp = 2 track f32 single-rank SGD:
/// each parameter's update over the run is within 5% (relative L2) of the f32 update.
/// SGD's update is proportional to the dp-averaged gradient, so one reduced with the
/// wrong scale (summed, or averaged twice) is 50-100% off; AdamW would hide it.
#[test]
fn fsdp_mixed_precision_sgd_tracks_f32_sgd() {
    let init = reference_with(Optim::Sgd, 0).params;
    let want = reference_with(Optim::Sgd, 3).params;
    let got =
        train_with(2, 1, Mode::Fsdp(BF16_MP), Optim::Sgd, 3, true, assert_bf16_compute_f32_master);
    for (rank, t) in got.iter().enumerate() {
        let what = format!("bf16 MP dp=2 rank {rank} after 3 SGD steps");
        let worst = check_params(&what, &t.params, &want, &init, Tol::for_dtype(DType::BF16), 0.05);
        println!("{what}: worst relative update error {worst:.3}");
    }
}

/// FSDP parameters present themselves as DTensors laid out as they are held: the dp
/// shard of the TP shard, on the (tp, dp)-ordered 2-d mesh, whose full tensor is the
/// parameter.
#[test]
fn fsdp_parameters_are_dtensors_on_the_2d_mesh() {
    let out = spawn_scoped(
        SpawnConfig::new(4).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())
                .map_err(common::plan_err)?;
            shard_model(&mut model, &mesh["dp"])?;
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let mut layouts = BTreeMap::new();
            for (n, p) in named_parameters(&model) {
                let Param::DTensor(d) = &p else { panic!("{n}: FSDP parameters are DTensors") };
                assert!(
                    d.to_local().same_storage(&p.trainable()),
                    "{n}: the DTensor's local is the dp shard"
                );
                let full = d.full_tensor()?.to_vec_f64()?;
                assert_eq!(full, p.full()?.to_vec_f64()?, "{n}");
                layouts.insert(
                    n,
                    (d.mesh().names().to_vec(), tpar_placements::fmt_placements(d.placements())),
                );
            }
            Ok(layouts)
        },
    )
    .unwrap();
    let l = &out[0];
    let q = &l["base_model.layers.0.self_attn.q_proj.weight"];
    assert_eq!((q.0.clone(), q.1.as_str()), (vec!["tp".to_string(), "dp".to_string()], "S(0)S(0)"));
    assert_eq!(l["base_model.layers.0.self_attn.o_proj.weight"].1, "S(1)S(0)");
    assert_eq!(l["base_model.layers.0.input_layernorm.weight"].1, "RS(0)");
}

/// The FSDP timeline of a second step (the first recorded the units' order): every unit
/// computes forward and backward once and reduce-scatters once; the root gathers once
/// (it keeps its parameters for the backward), the others twice. The gathers and
/// reduce-scatters overlap compute by construction: each unit's forward gather starts
/// before the unit that ran before it has finished its forward, the layer 0 gather for
/// the backward starts before layer 1's backward ends, and layer 1's reduce-scatter
/// starts before layer 0's backward ends.
#[test]
fn fsdp_timeline_shows_prefetched_gathers_and_overlapped_reductions() {
    use tpar_parallel_styles::{set_fsdp_timeline, FsdpTimeline, TimelineEvent, TimelineKind};
    let out = spawn_scoped(SpawnConfig::new(2).timeout(Duration::from_secs(60)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        shard_model(&mut model, &mesh)?;
        reset_parameters(&mut model, Device::Cpu, 3)?;
        let timeline = FsdpTimeline::new();
        set_fsdp_timeline(&model, Some(&timeline));
        let (ids, tgt) = global_batch();
        let (ids, tgt) = (ids.narrow(0, 2 * ctx.rank(), 2)?, tgt.narrow(0, 2 * ctx.rank(), 2)?);
        for _ in 0..2 {
            timeline.clear();
            unshard(&model)?;
            loss_of(&model, &ids, &tgt)?.into_tensor("loss")?.backward()?;
        }
        Ok::<_, NnError>((timeline.events(), timeline.render(60)))
    })
    .unwrap();
    for (rank, (events, text)) in out.into_iter().enumerate() {
        let what = format!("rank {rank}:\n{text}");
        let of = |unit: &str, kind| -> Vec<&TimelineEvent> {
            let mut v: Vec<_> =
                events.iter().filter(|e| e.unit == unit && e.kind == kind).collect();
            v.sort_by_key(|e| e.start);
            v
        };
        let units = ["(root)", "base_model", "base_model.layers.0", "base_model.layers.1"];
        for u in units {
            assert_eq!(of(u, TimelineKind::Forward).len(), 1, "{u} forward, {what}");
            assert_eq!(of(u, TimelineKind::Backward).len(), 1, "{u} backward, {what}");
            assert_eq!(of(u, TimelineKind::ReduceScatter).len(), 1, "{u} reduce_scatter, {what}");
            let gathers = if u == "(root)" { 1 } else { 2 };
            assert_eq!(of(u, TimelineKind::AllGather).len(), gathers, "{u} all_gather, {what}");
        }
        for w in units.windows(2) {
            let (prev, next) =
                (of(w[0], TimelineKind::Forward)[0], of(w[1], TimelineKind::AllGather)[0]);
            assert!(
                next.start < prev.end,
                "{} gather not prefetched during {}, {what}",
                w[1],
                w[0]
            );
        }
        let (l0, l1) = ("base_model.layers.0", "base_model.layers.1");
        let l0_backward_gather = of(l0, TimelineKind::AllGather)[1];
        assert!(
            l0_backward_gather.start < of(l1, TimelineKind::Backward)[0].end,
            "layer 0's backward gather not prefetched, {what}"
        );
        assert!(
            of(l1, TimelineKind::ReduceScatter)[0].start < of(l0, TimelineKind::Backward)[0].end,
            "layer 1's reduce_scatter did not overlap layer 0's backward, {what}"
        );
        assert!(text.contains("base_model.layers.1 reduce_scatter"), "{what}");
    }
}
