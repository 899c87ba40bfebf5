//! `clip_grad_norm_`'s options against hand references: every norm type (p = 1, 2, 3,
//! 0.5, 0, inf, -inf) on plain tensors and on DTensor shards (Shard, Replicate,
//! Partial) over 3 ranks, `error_if_nonfinite`, and the pipeline group (each stage's
//! gradients combined over `pp`).

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_dtensor::{distribute_tensor, DeviceMesh, Placement, ReduceOp};
use tpar_mesh::DeviceType;
use tpar_nn::{NnError, Param};
use tpar_optim::{clip_grad_norm_, AdamW, AdamWConfig, ClipOptions};
use tpar_tensor::{DType, Device, Tensor};

use Placement::{Replicate, Shard};

const NORM_TYPES: [f64; 7] = [1.0, 2.0, 3.0, 0.5, 0.0, f64::INFINITY, f64::NEG_INFINITY];

/// Deterministic, irregular values (one exact zero among them, for p = 0 and -inf).
fn vals(n: usize, seed: u64) -> Vec<f64> {
    (0..n)
        .map(|i| {
            if (i + seed as usize) % 7 == 3 {
                return 0.0;
            }
            let x = (i as f64 + 1.0) * 0.7548776662466927 + seed as f64 * 0.5698402909980532;
            (x.fract() - 0.5) * 2.0
        })
        .collect()
}

/// `torch.linalg.vector_norm(all, p)` by hand.
fn reference_norm(all: &[f64], p: f64) -> f64 {
    let a = all.iter().map(|x| x.abs());
    if p == f64::INFINITY {
        a.fold(0.0, f64::max)
    } else if p == f64::NEG_INFINITY {
        a.fold(f64::INFINITY, f64::min)
    } else if p == 0.0 {
        a.filter(|x| *x != 0.0).count() as f64
    } else {
        a.map(|x| x.powf(p)).sum::<f64>().powf(1.0 / p)
    }
}

fn close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() <= 1e-12 * (1.0 + want.abs()), "{what}: got {got}, want {want}");
}

fn plain(v: &[f64]) -> (Tensor, Param) {
    let w = Tensor::zeros([v.len()], DType::F64, Device::Cpu).unwrap().requires_grad_(true);
    w.set_grad(Some(Tensor::from_f64(v, [v.len()], DType::F64).unwrap()));
    (w.clone(), Param::Tensor(w))
}

#[test]
fn every_norm_type_of_plain_gradients_matches_the_hand_reference_and_clips() {
    let (a, b) = (vals(11, 1), vals(5, 2));
    let all: Vec<f64> = a.iter().chain(&b).copied().collect();
    for p in NORM_TYPES {
        let want = reference_norm(&all, p);
        let max_norm = want / 2.0;
        let ((wa, pa), (wb, pb)) = (plain(&a), plain(&b));
        let opts = ClipOptions { norm_type: p, ..Default::default() };
        let total = clip_grad_norm_(&[pa, pb], max_norm, &opts).unwrap();
        assert_eq!(total.dims(), &[] as &[usize], "a 0-dim tensor");
        close(total.item().unwrap(), want, &format!("norm_type {p}"));
        let coef = max_norm / (want + 1e-6);
        for (w, v) in [(wa, &a), (wb, &b)] {
            let got = w.grad().unwrap().to_vec_f64().unwrap();
            for (g, x) in got.iter().zip(v.iter()) {
                close(*g, x * coef, &format!("norm_type {p}: clipped gradient"));
            }
        }
    }
    // Below max_norm: nothing changes. An optimizer clips the same gradients.
    let (w, p) = plain(&a);
    let mut opt = AdamW::new(vec![p], AdamWConfig::default()).unwrap();
    let opts = ClipOptions::default().norm_type(f64::INFINITY);
    let n = clip_grad_norm_(&mut opt, 1e9, &opts).unwrap().item().unwrap();
    close(n, reference_norm(&a, f64::INFINITY), "through the optimizer");
    assert_eq!(w.grad().unwrap().to_vec_f64().unwrap(), a);
}

#[test]
fn bad_options_are_config_errors() {
    let (_, p) = plain(&vals(3, 1));
    let bad = |max_norm: f64, norm_type: f64| {
        let opts = ClipOptions::default().norm_type(norm_type);
        clip_grad_norm_(std::slice::from_ref(&p), max_norm, &opts)
    };
    assert!(matches!(bad(-1.0, 2.0), Err(NnError::Config { .. })));
    assert!(matches!(bad(f64::NAN, 2.0), Err(NnError::Config { .. })));
    assert!(matches!(bad(1.0, f64::NAN), Err(NnError::Config { .. })));
    // No gradient at all: a zero norm.
    let w = Tensor::zeros([2], DType::F64, Device::Cpu).unwrap().requires_grad_(true);
    let n = clip_grad_norm_(&[Param::Tensor(w)], 1.0, &ClipOptions::default()).unwrap();
    assert_eq!(n.item().unwrap(), 0.0);
}

#[test]
fn error_if_nonfinite_refuses_nan_and_inf_norms_and_leaves_the_gradients() {
    for (bad, p) in [(f64::NAN, 2.0), (f64::INFINITY, 2.0), (f64::NAN, f64::INFINITY)] {
        let mut v = vals(4, 3);
        v[1] = bad;
        let (w, param) = plain(&v);
        let opts = ClipOptions::default().norm_type(p).error_if_nonfinite(true);
        let e = clip_grad_norm_(std::slice::from_ref(&param), 1.0, &opts).unwrap_err();
        assert!(matches!(e, NnError::NonFinite { .. }), "{e}");
        assert!(e.to_string().contains("clip_grad_norm"), "{e}");
        let got = w.grad().unwrap().to_vec_f64().unwrap();
        assert_eq!(got[0].to_bits(), v[0].to_bits(), "left unscaled");
        // Without the option the norm is returned: an infinite one zeroes the finite
        // gradients (as torch's), a NaN one leaves them.
        let opts = ClipOptions::default().norm_type(p);
        let n = clip_grad_norm_(std::slice::from_ref(&param), 1.0, &opts).unwrap();
        let n = n.item().unwrap();
        assert!(!n.is_finite());
        assert_eq!(n.is_nan(), bad.is_nan());
        let got = w.grad().unwrap().to_vec_f64().unwrap();
        let want = if n.is_nan() { v[0] } else { 0.0 };
        assert_eq!(got[0], want);
    }
}

/// Five parameters on a 1-d mesh of 3 ranks: W [7, 3] Shard(0), U [4, 5] Shard(1),
/// b [6] Replicate (each rank's gradient a contribution), q [5] Partial(sum), and a
/// plain tensor c [3]; every norm type equals the hand norm of the full gradients.
#[test]
fn every_norm_type_of_dtensor_shards_equals_the_unsharded_norm() {
    const SHAPES: [&[usize]; 5] = [&[7, 3], &[4, 5], &[6], &[5], &[3]];
    let grads: Vec<Vec<f64>> =
        SHAPES.iter().enumerate().map(|(i, s)| vals(s.iter().product(), 50 + i as u64)).collect();
    let all: Vec<f64> = grads.iter().flatten().copied().collect();
    let k = 3;
    let out = spawn_scoped(SpawnConfig::new(k), |ctx| -> Result<Vec<(f64, f64)>, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[k], &["tp"])?;
        let c = mesh.coordinate()[0];
        let mut out = Vec::new();
        for p in NORM_TYPES {
            let placements = [Shard(0), Shard(1), Replicate, Placement::Partial(ReduceOp::Sum)];
            let mut params = Vec::new();
            let mut full_grads = Vec::new();
            for (i, pl) in placements.into_iter().enumerate() {
                let full = Tensor::zeros(SHAPES[i], DType::F64, Device::Cpu)?;
                let d = distribute_tensor(&full.requires_grad_(true), &mesh, &[pl])?;
                let g_full = Tensor::from_f64(&grads[i], SHAPES[i], DType::F64)?;
                let g_local = match pl {
                    Shard(_) => distribute_tensor(&g_full, &mesh, &[pl])?.to_local(),
                    Replicate => g_full.mul_scalar((c + 1) as f64 / 6.0)?,
                    _ => g_full,
                };
                d.local().set_grad(Some(g_local));
                params.push(Param::DTensor(d));
            }
            let (_, plain_p) = plain(&grads[4]);
            params.push(plain_p);
            let want = reference_norm(&all, p);
            let opts = ClipOptions::default().norm_type(p);
            let n = clip_grad_norm_(&params, want / 4.0, &opts)?.item()?;
            for q in &params {
                full_grads.extend(q.grad()?.unwrap().full()?.to_vec_f64()?);
            }
            // The clipped full gradients' norm: max_norm (up to the 1e-6).
            out.push((n, reference_norm(&full_grads, p)));
        }
        Ok(out)
    })
    .unwrap();
    for (r, norms) in out.iter().enumerate() {
        for (p, (n, clipped)) in NORM_TYPES.iter().zip(norms) {
            let want = reference_norm(&all, *p);
            assert!((n - want).abs() <= 1e-10 * want, "rank {r} norm_type {p}: {n} vs {want}");
            // Scaling keeps the count of non-zero elements (p = 0 is no norm of scale).
            let after = if *p == 0.0 { want } else { want / 4.0 * want / (want + 1e-6) };
            assert!((clipped - after).abs() <= 1e-9 * want, "rank {r} p={p}: {clipped}");
        }
    }
}

/// Three pipeline stages, each holding other parameters: with `pp` the norm is the norm
/// of all stages' gradients together, on every stage, for every norm type.
#[test]
fn the_pp_group_combines_the_stages_norms() {
    let stage_grads: Vec<Vec<f64>> = (0..3).map(|s| vals(4 + 3 * s, 70 + s as u64)).collect();
    let all: Vec<f64> = stage_grads.iter().flatten().copied().collect();
    let out = spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<Vec<(f64, f64)>, NnError> {
        let pp = ctx.world_group();
        let mut out = Vec::new();
        for p in NORM_TYPES {
            let (_, param) = plain(&stage_grads[ctx.rank()]);
            let with_pp = ClipOptions::default().norm_type(p).pp(&pp);
            let n = clip_grad_norm_(std::slice::from_ref(&param), f64::INFINITY, &with_pp)?;
            let (_, param) = plain(&stage_grads[ctx.rank()]);
            let alone = ClipOptions::default().norm_type(p);
            let own = clip_grad_norm_(std::slice::from_ref(&param), f64::INFINITY, &alone)?;
            out.push((n.item()?, own.item()?));
        }
        Ok(out)
    })
    .unwrap();
    for (r, norms) in out.iter().enumerate() {
        for (p, (n, own)) in NORM_TYPES.iter().zip(norms) {
            close(*n, reference_norm(&all, *p), &format!("stage {r} norm_type {p} over pp"));
            close(*own, reference_norm(&stage_grads[r], *p), &format!("stage {r} alone"));
        }
    }
}
