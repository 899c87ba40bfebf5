//! ZeRO-1 (`ZeroRedundancyOptimizer`): three AdamW steps with clipping, and three plain
//! SGD steps, equal single-rank training at dp = 2, 4 and TP x ZeRO 2x2; each rank holds
//! about 1/dp of DDP's optimizer state; one step issues one reduce_scatter and one
//! all_gather per dtype, in that dtype; uneven and empty ranges (SGD with momentum over
//! tiny parameters); bad setups are typed errors.

use std::time::Duration;

use tpar_collectives::{spawn_scoped, CollectiveKind, ReduceOp, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::LlamaForPretraining;
use tpar_nn::{named_parameters, reset_parameters, NnError, Param};
use tpar_optim::ZeroRedundancyOptimizer;
use tpar_optim::{AdamWConfig, Optimizer, Sgd, SgdConfig};
use tpar_tensor::{tol::Tol, DType, Device, Tensor};

mod common;
use common::{
    check_params, config, no_check, plan_err, rank_grad, reference, reference_with, shard_model,
    train, train_with, Mode, Optim, ADAMW,
};

#[test]
fn zero1_three_steps_equal_single_rank_training() {
    let want = reference(3);
    let tol = Tol::for_dtype(DType::F32).scaled(20.0);
    for (dp, tp) in [(2, 1), (4, 1), (2, 2)] {
        for (rank, t) in train(dp, tp, Mode::Zero1, 3, false, no_check).iter().enumerate() {
            assert_eq!(t.params.len(), want.params.len());
            for (n, v) in &t.params {
                let what = format!("ZeRO-1 dp={dp} tp={tp} rank {rank} {n} after 3 steps");
                tol.check(&what, v, &want.params[n]).unwrap();
            }
        }
    }
}

/// Three plain SGD steps (no clipping) under ZeRO-1 equal single-rank SGD, update for
/// update, at dp = 2, 4 and TP x ZeRO 2x2. SGD moves each parameter by `lr` times the
/// reduce-scattered gradient, so one summed over dp instead of averaged shows here;
/// AdamW's normalisation (and clipping) in the test above would divide it out.
#[test]
fn zero1_three_sgd_steps_equal_single_rank_sgd() {
    let init = reference_with(Optim::Sgd, 0).params;
    let want = reference_with(Optim::Sgd, 3).params;
    let tol = Tol::for_dtype(DType::F32).scaled(20.0);
    for (dp, tp) in [(2, 1), (4, 1), (2, 2)] {
        let got = train_with(dp, tp, Mode::Zero1, Optim::Sgd, 3, false, no_check);
        for (rank, t) in got.iter().enumerate() {
            let what = format!("ZeRO-1 SGD dp={dp} tp={tp} rank {rank} after 3 steps");
            check_params(&what, &t.params, &want, &init, tol, 1e-3);
        }
    }
}

/// ZeRO-1 reduces and gathers each dtype's bucket in that dtype: with f32 and bf16
/// parameters, one step issues the f32 gradient-mask all_reduce (max), then per bucket one
/// reduce_scatter (avg) of all its elements and one all_gather of this rank's range, each
/// in the bucket's dtype with bytes to match; every parameter, in its own dtype, ends at
/// `init - lr * mean gradient` (exact: the values are multiples of 1/8).
#[test]
fn zero1_reduces_and_gathers_each_dtype_bucket_in_its_dtype() {
    let specs: [(&[usize], DType); 4] =
        [(&[5, 3], DType::F32), (&[7], DType::BF16), (&[4], DType::F32), (&[2, 3], DType::BF16)];
    let init = |i: usize, numel: usize| -> Vec<f64> {
        (0..numel).map(|e| ((e * 5 + 2 * i) % 9) as f64 * 0.5 - 2.0).collect()
    };
    let cfg = SgdConfig { lr: 1.0, ..Default::default() };
    let out = spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<_, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
        let ws: Vec<Tensor> = specs
            .iter()
            .enumerate()
            .map(|(i, (dims, dt))| {
                let n = dims.iter().product();
                Ok(Tensor::from_f64(&init(i, n), *dims, *dt)?.requires_grad_(true))
            })
            .collect::<Result<_, NnError>>()?;
        let named = ws.iter().enumerate().map(|(i, w)| (format!("w{i}"), Param::Tensor(w.clone())));
        let mut opt = ZeroRedundancyOptimizer::sgd(named.collect(), &mesh, cfg)?;
        for (i, w) in ws.iter().enumerate() {
            let g = rank_grad(i, ctx.rank(), w.numel());
            w.set_grad(Some(Tensor::from_f64(&g, w.dims(), w.dtype())?));
        }
        let dbg = mesh.group(0)?.comm_debug();
        dbg.enable();
        opt.step()?;
        dbg.disable();
        let vals: Vec<(DType, Vec<f64>)> =
            ws.iter().map(|w| Ok((w.dtype(), w.to_vec_f64()?))).collect::<Result<_, NnError>>()?;
        Ok((dbg.take(), vals))
    })
    .unwrap();
    for (rank, (recs, vals)) in out.into_iter().enumerate() {
        let all: Vec<String> = recs.iter().map(|r| r.to_string()).collect();
        assert_eq!(recs.len(), 5, "rank {rank}: {all:#?}");
        let mask = &recs[0];
        assert_eq!(
            (mask.kind, mask.op, mask.dtype, mask.bytes),
            (CollectiveKind::AllReduce, Some(ReduceOp::Max), Some(DType::F32), 4 * 4),
            "rank {rank}: {mask}"
        );
        for dt in [DType::F32, DType::BF16] {
            let numel: usize = specs
                .iter()
                .filter(|(_, d)| *d == dt)
                .map(|(dims, _)| dims.iter().product::<usize>())
                .sum();
            let of = |kind| -> Vec<_> {
                recs.iter().filter(|r| r.kind == kind && r.dtype == Some(dt)).collect()
            };
            let rs = of(CollectiveKind::ReduceScatter);
            assert_eq!(rs.len(), 1, "rank {rank}: one {dt} reduce_scatter in {all:#?}");
            assert_eq!(
                (rs[0].op, rs[0].bytes),
                (Some(ReduceOp::Avg), numel * dt.size_in_bytes()),
                "rank {rank}: {}",
                rs[0]
            );
            let ag = of(CollectiveKind::AllGather);
            assert_eq!(ag.len(), 1, "rank {rank}: one {dt} all_gather in {all:#?}");
            let len = tpar_collectives::chunk_range(numel, 2, rank).1;
            assert_eq!(
                (ag[0].shape.clone(), ag[0].bytes),
                (vec![len], len * dt.size_in_bytes()),
                "rank {rank}: {}",
                ag[0]
            );
        }
        for (i, (dt, v)) in vals.into_iter().enumerate() {
            assert_eq!(dt, specs[i].1, "rank {rank} w{i}: dtype");
            let want: Vec<f64> = init(i, v.len())
                .iter()
                .zip(rank_grad(i, 0, v.len()))
                .map(|(w, g)| w - 1.5 * g)
                .collect();
            assert_eq!(v, want, "rank {rank} w{i} ({dt}): one SGD step on the mean gradient");
        }
    }
}

/// After one backward, each rank's shard leaves hold the dp-mean gradient of their
/// ranges, which equals the single-rank gradient on the full batch there; the clipping
/// norm computed from the ranges equals the single-rank norm (also under TP, whose
/// layouts add an all_reduce over tp and count replicated parameters once).
#[test]
fn zero1_reduced_gradients_and_norm_equal_the_unsharded_model() {
    use tpar_optim::{clip_grad_norm_, ClipOptions};
    let (ids, tgt) = common::global_batch();
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 3).unwrap();
    common::loss_of(&model, &ids, &tgt).unwrap().into_tensor("ref").unwrap().backward().unwrap();
    let grads: Vec<Vec<f64>> = tpar_nn::parameters(&model)
        .iter()
        .map(|p| p.local().grad().unwrap().to_vec_f64().unwrap())
        .collect();
    let params = tpar_nn::parameters(&model);
    let norm = clip_grad_norm_(&params, f64::INFINITY, &ClipOptions::default()).unwrap();
    let norm = norm.item().unwrap();
    let tol = Tol::for_dtype(DType::F32).scaled(10.0);
    for (dp, tp) in [(2, 1), (4, 1), (2, 2)] {
        let grads = &grads;
        let norms = spawn_scoped(SpawnConfig::new(dp * tp), |ctx| -> Result<f64, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            if tp > 1 {
                use tpar_models::llama_plans::{megatron_layer_plan, parallelize_llama};
                parallelize_llama(&mut model, &mesh["tp"], &megatron_layer_plan())
                    .map_err(plan_err)?;
            }
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let mut opt =
                ZeroRedundancyOptimizer::adamw(named_parameters(&model), &mesh["dp"], ADAMW)?;
            let rows = 4 / dp;
            let r = mesh["dp"].local_rank();
            let (ids, tgt) = common::global_batch();
            let (ids, tgt) = (ids.narrow(0, r * rows, rows)?, tgt.narrow(0, r * rows, rows)?);
            let loss = common::loss_of(&model, &ids, &tgt)?;
            tpar_parallel_styles::loss_parallel::backward(&loss, &mesh["tp"])?;
            opt.reduce_gradients()?;
            if tp == 1 {
                let mut covered = 0;
                for (i, want) in grads.iter().enumerate() {
                    let Some((start, len)) = opt.shard_range(i) else { continue };
                    let leaf = opt.shard_leaf(i).expect("a leaf where there is a range");
                    let got = leaf.grad().expect("a reduced gradient").to_vec_f64()?;
                    let what = format!("dp={dp} rank {r} parameter {i} [{start}..]");
                    tol.check(&what, &got, &want[start..start + len])?;
                    covered += len;
                }
                assert!(covered > 0, "rank {r} holds no range");
            }
            // Through the optimizer: the norm of the ranges' gradients.
            Ok(clip_grad_norm_(&mut opt, f64::INFINITY, &ClipOptions::default())?.item()?)
        })
        .unwrap();
        for (rank, n) in norms.iter().enumerate() {
            assert!(tol.close(*n, norm), "dp={dp} tp={tp} rank {rank}: norm {n} vs {norm}");
        }
    }
}

#[test]
fn zero1_state_is_about_one_dp_th_of_ddp_state() {
    let ddp = train(2, 1, Mode::Ddp, 1, false, no_check)[0].state_bytes;
    assert!(ddp > 0);
    for dp in [2, 4] {
        let per_rank: Vec<usize> =
            train(dp, 1, Mode::Zero1, 1, false, no_check).iter().map(|t| t.state_bytes).collect();
        // AdamW keeps two f32 moments per element: the ranks' ranges partition the
        // elements, each at most ceil(numel / dp).
        assert_eq!(per_rank.iter().sum::<usize>(), ddp, "dp={dp}: {per_rank:?}");
        let numel = ddp / 8;
        for (r, b) in per_rank.iter().enumerate() {
            assert!(*b <= numel.div_ceil(dp) * 8, "dp={dp} rank {r}: {b} of {ddp} bytes");
        }
        println!("DDP AdamW state {ddp} B; ZeRO-1 at dp={dp}: {per_rank:?}");
    }
}

/// One step with clipping: a gradient-mask all_reduce per reduction, one all_reduce of
/// the squared norm, one reduce_scatter and one all_gather of the (single, f32) bucket.
#[test]
fn zero1_step_issues_one_reduce_scatter_and_one_all_gather() {
    let numel: usize = {
        let mut m = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
        reset_parameters(&mut m, Device::Cpu, 3).unwrap();
        tpar_nn::parameters(&m).iter().map(|p| p.numel()).sum()
    };
    spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<(), NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        reset_parameters(&mut model, Device::Cpu, 3)?;
        let mut opt = ZeroRedundancyOptimizer::adamw(named_parameters(&model), &mesh, ADAMW)?;
        let (ids, tgt) = common::global_batch();
        let (ids, tgt) = (ids.narrow(0, 2 * ctx.rank(), 2)?, tgt.narrow(0, 2 * ctx.rank(), 2)?);
        common::loss_of(&model, &ids, &tgt)?.into_tensor("loss")?.backward()?;
        let dbg = ctx.world_group().comm_debug();
        dbg.enable();
        tpar_optim::clip_grad_norm_(&mut opt, 0.5, &tpar_optim::ClipOptions::default())?;
        opt.step()?;
        dbg.disable();
        let recs = dbg.take();
        let kinds: Vec<String> = recs.iter().map(|r| r.to_string()).collect();
        let count = |k| recs.iter().filter(|r| r.kind == k).count();
        assert_eq!(count(CollectiveKind::ReduceScatter), 1, "{kinds:#?}");
        assert_eq!(count(CollectiveKind::AllGather), 1, "{kinds:#?}");
        assert_eq!(count(CollectiveKind::AllReduce), 3, "{kinds:#?}");
        assert_eq!(recs.len(), 5, "{kinds:#?}");
        let rs = recs.iter().find(|r| r.kind == CollectiveKind::ReduceScatter).unwrap();
        assert_eq!((rs.op, rs.bytes), (Some(ReduceOp::Avg), numel * 4), "{rs}");
        let ag = recs.iter().find(|r| r.kind == CollectiveKind::AllGather).unwrap();
        assert_eq!(ag.shape, vec![tpar_collectives::chunk_range(numel, 2, ctx.rank()).1]);
        // The full gradients were consumed; the ranges' gradients remain until zero_grad.
        assert!(named_parameters(&model).iter().all(|(_, p)| p.local().grad().is_none()));
        opt.zero_grad();
        Ok(())
    })
    .unwrap();
}

/// SGD with momentum over parameters smaller than the dp size (dp = 4, 9 elements in
/// all: rank ranges 3, 3, 3, 0 cutting through parameters), with a parameter that has no
/// gradient on some ranks, equals single-rank SGD on the mean gradient.
#[test]
fn zero1_sgd_with_uneven_and_empty_ranges() {
    let cfg = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01, ..Default::default() };
    let init: [Vec<f32>; 3] = [vec![1.0, -2.0, 3.0, 0.5, -0.5], vec![0.25, 4.0], vec![-1.0, 2.0]];
    let shapes: [&[usize]; 3] = [&[5], &[2, 1], &[2]];
    let make = || -> Vec<Tensor> {
        init.iter()
            .zip(shapes)
            .map(|(v, s)| Tensor::from_vec(v.clone(), s).unwrap().requires_grad_(true))
            .collect()
    };
    // Rank r's loss: sum_i (r + 1) * (i + 1) * w_i^2 over the first two parameters, and
    // the third parameter only on rank 0; the mean gradient over 4 ranks is what the
    // oracle gets.
    let loss = |ws: &[Tensor], r: usize, dp: usize| -> Result<(), NnError> {
        let mut total = Tensor::scalar(0.0, DType::F32);
        for (i, w) in ws.iter().enumerate() {
            let k = if i == 2 {
                if r == 0 {
                    1.0
                } else {
                    continue;
                }
            } else {
                (r + 1) as f64
            };
            total = total.add(&w.square()?.sum_all()?.mul_scalar(k * (i + 1) as f64)?)?;
        }
        total.mul_scalar(1.0 / dp as f64)?.backward()?;
        Ok(())
    };
    // Oracle: one rank, the sum over ranks of the scaled losses is the mean.
    let want = {
        let ws = make();
        let params: Vec<Param> = ws.iter().cloned().map(Param::Tensor).collect();
        let mut opt = Sgd::new(params, cfg).unwrap();
        for _ in 0..3 {
            for r in 0..4 {
                loss(&ws, r, 4).unwrap();
            }
            opt.step().unwrap();
            opt.zero_grad();
        }
        ws.iter().map(|w| w.to_vec_f64().unwrap()).collect::<Vec<_>>()
    };
    let got = spawn_scoped(SpawnConfig::new(4), |ctx| -> Result<_, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[4], &["dp"])?;
        let ws = make();
        let named = ws.iter().enumerate().map(|(i, w)| (format!("w{i}"), Param::Tensor(w.clone())));
        let mut opt = ZeroRedundancyOptimizer::sgd(named.collect(), &mesh, cfg)?;
        let ranges: Vec<_> = (0..3).map(|i| opt.shard_range(i)).collect();
        for _ in 0..3 {
            // Each rank's gradient is its own term times dp, so the dp-mean is the sum.
            loss(&ws, ctx.rank(), 1)?;
            opt.step()?;
            opt.zero_grad();
        }
        let vals: Vec<Vec<f64>> = ws.iter().map(|w| w.to_vec_f64()).collect::<Result<_, _>>()?;
        Ok((ranges, opt.state_bytes(), vals))
    })
    .unwrap();
    let tol = Tol::for_dtype(DType::F32);
    for (r, (ranges, bytes, vals)) in got.iter().enumerate() {
        for (i, v) in vals.iter().enumerate() {
            tol.check(&format!("rank {r} w{i}"), v, &want[i]).unwrap();
        }
        let expect = [
            vec![Some((0, 3)), None, None],
            vec![Some((3, 2)), Some((0, 1)), None],
            vec![None, Some((1, 1)), Some((0, 2))],
            vec![None, None, None],
        ];
        assert_eq!(ranges, &expect[r], "rank {r}");
        assert_eq!(*bytes, [3, 3, 3, 0][r] * 4, "rank {r}: momentum bytes");
    }
}

#[test]
fn zero1_bad_setups_are_typed_errors() {
    spawn_scoped(
        SpawnConfig::new(2).timeout(Duration::from_secs(30)),
        |ctx| -> Result<(), NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 1], &["dp", "tp"])?;
            let cfg = AdamWConfig::default();
            let expect_bad = |r: Result<ZeroRedundancyOptimizer<_>, NnError>, needle: &str| match r
            {
                Err(NnError::Config { what }) => {
                    assert!(what.contains("ZeroRedundancyOptimizer"), "{what}");
                    assert!(what.contains(needle), "{what}")
                }
                Err(other) => panic!("expected Config, got {other}"),
                Ok(_) => panic!("accepted ({needle})"),
            };
            // A 2-d mesh.
            let w = Tensor::from_vec(vec![1.0f32; 4], [4])?.requires_grad_(true);
            expect_bad(
                ZeroRedundancyOptimizer::adamw(vec![("w".into(), Param::Tensor(w))], &mesh, cfg),
                "1-d mesh",
            );
            // Parameters still on the meta device.
            let model = LlamaForPretraining::new(&config(), Device::Meta)?;
            expect_bad(
                ZeroRedundancyOptimizer::adamw(named_parameters(&model), &mesh["dp"], cfg),
                "meta device",
            );
            // FSDP parameters.
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            shard_model(&mut model, &mesh["dp"])?;
            reset_parameters(&mut model, Device::Cpu, 0)?;
            expect_bad(
                ZeroRedundancyOptimizer::adamw(named_parameters(&model), &mesh["dp"], cfg),
                "FSDP",
            );
            // A negative max_norm.
            let w = Tensor::from_vec(vec![1.0f32; 4], [4])?.requires_grad_(true);
            let mut opt = ZeroRedundancyOptimizer::adamw(
                vec![("w".into(), Param::Tensor(w))],
                &mesh["dp"],
                cfg,
            )?;
            let clip = |opt: &mut ZeroRedundancyOptimizer<_>, max_norm| {
                tpar_optim::clip_grad_norm_(opt, max_norm, &tpar_optim::ClipOptions::default())
            };
            assert!(matches!(clip(&mut opt, -1.0), Err(NnError::Config { .. })));
            assert!(matches!(clip(&mut opt, f64::NAN), Err(NnError::Config { .. })));
            Ok(())
        },
    )
    .unwrap();
}
