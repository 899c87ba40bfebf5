//! Optimizers, gradient clipping and LR schedules against hand-written references of
//! PyTorch's formulas, unsharded and on DTensor shards over the local backend.

use std::f64::consts::PI;

use tpar_collectives::{spawn_scoped, CollectiveKind, SpawnConfig};
use tpar_dtensor::{distribute_tensor, DTensor, DeviceMesh, Placement, ReduceOp};
use tpar_mesh::DeviceType;
use tpar_nn::{NnError, Param};
use tpar_optim::{
    clip_grad_norm_, AdamW, AdamWConfig, ClipOptions, CosineAnnealingLR, LinearLR, LrSchedule,
    LrScheduler, Optimizer, SequentialLR, Sgd, SgdConfig,
};
use tpar_tensor::{tol::Tol, DType, Tensor};

use Placement::{Replicate, Shard};

/// `clip_grad_norm_` with the default options, the norm read back.
fn clip(params: &[Param], max_norm: f64) -> Result<f64, tpar_nn::NnError> {
    Ok(clip_grad_norm_(params, max_norm, &ClipOptions::default())?.item()?)
}

// ---------------------------------------------------------------------------------------
// Helpers and references
// ---------------------------------------------------------------------------------------

/// Deterministic, irregular values.
fn vals(n: usize, seed: u64) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let x = (i as f64 + 1.0) * 0.7548776662466927 + seed as f64 * 0.5698402909980532;
            (x.fract() - 0.5) * 2.0 + 0.1 * ((i + seed as usize) % 3) as f64
        })
        .collect()
}

fn leaf(v: &[f64], dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_f64(v, dims, dtype).unwrap().requires_grad_(true)
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

/// torch.optim.AdamW's update, in f64.
struct AdamRef {
    m: Vec<f64>,
    v: Vec<f64>,
    step: i32,
}

impl AdamRef {
    fn new(n: usize) -> Self {
        AdamRef { m: vec![0.0; n], v: vec![0.0; n], step: 0 }
    }
    fn step(&mut self, p: &mut [f64], g: &[f64], c: &AdamWConfig) {
        let (b1, b2) = c.betas;
        self.step += 1;
        let bc1 = 1.0 - b1.powi(self.step);
        let bc2 = 1.0 - b2.powi(self.step);
        for i in 0..p.len() {
            p[i] *= 1.0 - c.lr * c.weight_decay;
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * g[i];
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * g[i] * g[i];
            let denom = self.v[i].sqrt() / bc2.sqrt() + c.eps;
            p[i] -= c.lr / bc1 * self.m[i] / denom;
        }
    }
}

/// torch.optim.SGD's update, in f64.
fn sgd_ref(p: &mut [f64], g: &[f64], buf: &mut Option<Vec<f64>>, c: &SgdConfig) {
    let mut d: Vec<f64> = g.iter().zip(p.iter()).map(|(g, p)| g + c.weight_decay * p).collect();
    if c.momentum != 0.0 {
        let b = match buf {
            None => d.clone(),
            Some(b) => {
                b.iter().zip(&d).map(|(b, d)| c.momentum * b + (1.0 - c.dampening) * d).collect()
            }
        };
        d = if c.nesterov {
            d.iter().zip(&b).map(|(d, b)| d + c.momentum * b).collect()
        } else {
            b.clone()
        };
        *buf = Some(b);
    }
    for (p, d) in p.iter_mut().zip(d) {
        *p -= c.lr * d;
    }
}

const ADAM: AdamWConfig =
    AdamWConfig { lr: 1e-2, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 };

// ---------------------------------------------------------------------------------------
// AdamW and SGD, unsharded
// ---------------------------------------------------------------------------------------

/// One bf16 ulp at `x`'s magnitude: bf16 keeps 8 significant bits.
fn bf16_ulp(x: f64) -> f64 {
    if x == 0.0 {
        return f64::MIN_POSITIVE;
    }
    2f64.powi(x.abs().log2().floor() as i32 - 7)
}

/// The reference rounds the parameter to bf16 after each step, as the bf16 parameter
/// is stored, so the bf16 comparison can be one ulp: below one step's update (about
/// `lr` = 1e-2 per element on the first step) for every |w| < 1.28 here, so a skipped or
/// repeated step fails, where a fixed 1e-2 would let it pass. Parameters are compared
/// after every step. The moments (f32 for f32/bf16 parameters, f64 for f64 ones) come
/// from exactly representable gradients through two multiply-adds, so they hold to a
/// hundredth of their dtype's tolerance, bf16 parameters included.
#[test]
fn adamw_matches_torch_formula_for_three_steps() {
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        let n = 11;
        let w = leaf(&vals(n, 1), &[n], dtype);
        let mut opt = AdamW::new(vec![Param::Tensor(w.clone())], ADAM).unwrap();
        let mut want = w.to_vec_f64().unwrap();
        let mut r = AdamRef::new(n);
        assert_eq!(opt.state_bytes(), 0, "state is lazy");
        for s in 0..3 {
            let g = vals(n, 10 + s);
            w.set_grad(Some(Tensor::from_f64(&g, [n], dtype).unwrap()));
            let g_used = w.grad().unwrap().to_vec_f64().unwrap();
            opt.step().unwrap();
            r.step(&mut want, &g_used, &ADAM);
            opt.zero_grad();
            assert!(w.grad().is_none(), "zero_grad sets to none");
            let got = w.to_vec_f64().unwrap();
            let what = format!("AdamW {dtype} step {}", s + 1);
            match dtype {
                DType::BF16 => {
                    want = Tensor::from_f64(&want, [n], dtype).unwrap().to_vec_f64().unwrap();
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let ulp = bf16_ulp(g.abs().max(w.abs()));
                        assert!(ulp < ADAM.lr, "{what}[{i}]: {w} too large to see a step");
                        assert!((g - w).abs() <= ulp, "{what}[{i}]: got {g}, want {w}");
                    }
                }
                DType::F64 => assert_close(&got, &want, 1e-12, &what),
                _ => assert_close(&got, &want, 1e-6, &what),
            }
        }
        let st = opt.state(0).unwrap().unwrap();
        assert_eq!(st.step, 3);
        let state_elem = if dtype == DType::F64 { 8 } else { 4 };
        assert_eq!(opt.state_bytes(), 2 * n * state_elem, "{dtype}: m and v in f32/f64");
        assert_eq!(st.exp_avg.dtype(), if dtype == DType::F64 { DType::F64 } else { DType::F32 });
        let tol = Tol::for_dtype(st.exp_avg.dtype()).scaled(1e-2);
        tol.check(&format!("{dtype} exp_avg"), &st.exp_avg.to_vec_f64().unwrap(), &r.m).unwrap();
        tol.check(&format!("{dtype} exp_avg_sq"), &st.exp_avg_sq.to_vec_f64().unwrap(), &r.v)
            .unwrap();
    }
}

#[test]
fn adamw_skips_params_without_grad_and_counts_steps_per_param() {
    let a = leaf(&vals(4, 1), &[4], DType::F64);
    let b = leaf(&vals(3, 2), &[3], DType::F64);
    let mut opt =
        AdamW::new(vec![Param::Tensor(a.clone()), Param::Tensor(b.clone())], ADAM).unwrap();
    let b0 = b.to_vec_f64().unwrap();
    a.set_grad(Some(Tensor::from_f64(&vals(4, 3), [4], DType::F64).unwrap()));
    opt.step().unwrap();
    assert_eq!(b.to_vec_f64().unwrap(), b0, "no grad, no update (not even weight decay)");
    assert!(opt.state(1).unwrap().is_none());
    assert_eq!(opt.state_bytes(), 2 * 4 * 8);
    b.set_grad(Some(Tensor::from_f64(&vals(3, 4), [3], DType::F64).unwrap()));
    opt.step().unwrap();
    assert_eq!(opt.state(0).unwrap().unwrap().step, 2);
    assert_eq!(opt.state(1).unwrap().unwrap().step, 1);
}

#[test]
fn sgd_matches_torch_formula_for_three_steps() {
    let configs = [
        SgdConfig { lr: 0.1, ..Default::default() },
        SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 0.01, ..Default::default() },
        SgdConfig { lr: 0.05, momentum: 0.8, dampening: 0.3, ..Default::default() },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.1,
            ..Default::default()
        },
    ];
    for c in configs {
        let n = 9;
        let w = leaf(&vals(n, 5), &[3, 3], DType::F64);
        let mut opt = Sgd::new(vec![Param::Tensor(w.clone())], c).unwrap();
        let mut want = w.to_vec_f64().unwrap();
        let mut buf = None;
        for s in 0..3 {
            let g = vals(n, 20 + s);
            w.set_grad(Some(Tensor::from_f64(&g, [3, 3], DType::F64).unwrap()));
            opt.step().unwrap();
            opt.zero_grad();
            sgd_ref(&mut want, &g, &mut buf, &c);
        }
        assert_close(&w.to_vec_f64().unwrap(), &want, 1e-12, &format!("SGD {c:?}"));
        let bytes = if c.momentum != 0.0 { n * 8 } else { 0 };
        assert_eq!(opt.state_bytes(), bytes);
        if let Some(b) = &buf {
            let got = opt.momentum_buffer(0).unwrap().unwrap().to_vec_f64().unwrap();
            assert_close(&got, b, 1e-12, "momentum buffer");
        }
    }
}

#[test]
fn bad_hyper_parameters_are_errors() {
    let p = vec![Param::Tensor(leaf(&[1.0], &[1], DType::F32))];
    let bad = |c: AdamWConfig| matches!(AdamW::new(p.clone(), c), Err(NnError::Config { .. }));
    assert!(bad(AdamWConfig { lr: -1.0, ..ADAM }));
    assert!(bad(AdamWConfig { betas: (1.0, 0.9), ..ADAM }));
    assert!(bad(AdamWConfig { eps: f64::NAN, ..ADAM }));
    let nesterov = SgdConfig { nesterov: true, ..Default::default() };
    assert!(Sgd::new(p.clone(), nesterov).is_err());
    assert!(clip(&p, -1.0).is_err());
    assert!(LinearLR::new(0.0, 1.0, 5).is_err());
    assert!(CosineAnnealingLR::new(0, 0.0).is_err());
    let one: Vec<Box<dyn LrSchedule>> = vec![Box::new(LinearLR::new(0.5, 1.0, 2).unwrap())];
    assert!(SequentialLR::new(one, vec![3]).is_err());
    // An integer parameter is an error, not a panic.
    let ints = Tensor::from_vec(vec![1i64, 2], [2]).unwrap();
    ints.set_grad(Some(Tensor::from_vec(vec![1i64, 2], [2]).unwrap()));
    let mut opt = AdamW::new(vec![Param::Tensor(ints)], ADAM).unwrap();
    assert!(opt.step().is_err());
}

// ---------------------------------------------------------------------------------------
// Sharded optimizer steps
// ---------------------------------------------------------------------------------------

/// The rows `torch.chunk` gives coordinate `c` of `k` along dim 0 of `[rows, cols]`.
fn chunk_rows(full: &[f64], rows: usize, cols: usize, k: usize, c: usize) -> Vec<f64> {
    let chunk = rows.div_ceil(k);
    let (a, b) = ((c * chunk).min(rows), ((c + 1) * chunk).min(rows));
    full[a * cols..b * cols].to_vec()
}

#[test]
fn sharded_adamw_and_sgd_equal_the_unsharded_step_sliced() {
    // W: [5, 3] Shard(0) over tp=2 (rows 3 + 2); b: [4] Replicate, whose local gradients
    // are per-rank contributions summing to the full gradient.
    let (rows, cols, nb) = (5, 3, 4);
    let w0 = vals(rows * cols, 7);
    let b0 = vals(nb, 8);
    let grads_w: Vec<Vec<f64>> = (0..3).map(|s| vals(rows * cols, 30 + s)).collect();
    let grads_b: Vec<Vec<f64>> = (0..3).map(|s| vals(nb, 40 + s)).collect();
    let sgd = SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 0.01, ..Default::default() };

    // Unsharded references.
    let (mut want_w, mut want_b) = (w0.clone(), b0.clone());
    let (mut rw, mut rb) = (AdamRef::new(rows * cols), AdamRef::new(nb));
    let (mut sw, mut sb) = (w0.clone(), b0.clone());
    let (mut bw, mut bb) = (None, None);
    for s in 0..3 {
        rw.step(&mut want_w, &grads_w[s], &ADAM);
        rb.step(&mut want_b, &grads_b[s], &ADAM);
        sgd_ref(&mut sw, &grads_w[s], &mut bw, &sgd);
        sgd_ref(&mut sb, &grads_b[s], &mut bb, &sgd);
    }

    let out = spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<_, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
        let r = ctx.rank();
        let mk = |full: &[f64], dims: &[usize], pl: Placement| -> Result<Param, NnError> {
            let t = Tensor::from_f64(full, dims, DType::F64)?.requires_grad_(true);
            Ok(Param::DTensor(distribute_tensor(&t, &mesh, &[pl])?))
        };
        let run = |adam: bool| -> Result<(Vec<f64>, Vec<f64>, usize), NnError> {
            let w = mk(&w0, &[rows, cols], Shard(0))?;
            let b = mk(&b0, &[nb], Replicate)?;
            let params = vec![w.clone(), b.clone()];
            let mut opt: Box<dyn Optimizer> = if adam {
                Box::new(AdamW::new(params.clone(), ADAM)?)
            } else {
                Box::new(Sgd::new(params.clone(), sgd)?)
            };
            for s in 0..3 {
                let gw = chunk_rows(&grads_w[s], rows, cols, 2, r);
                let lw = w.trainable();
                lw.set_grad(Some(Tensor::from_f64(&gw, lw.dims(), DType::F64)?));
                // Contributions: rank 0 holds 0.25 of the gradient, rank 1 the rest.
                let part = if r == 0 { 0.25 } else { 0.75 };
                let gb: Vec<f64> = grads_b[s].iter().map(|g| g * part).collect();
                b.trainable().set_grad(Some(Tensor::from_f64(&gb, [nb], DType::F64)?));
                opt.step()?;
                opt.zero_grad();
            }
            Ok((w.trainable().to_vec_f64()?, b.trainable().to_vec_f64()?, opt.state_bytes()))
        };
        Ok((run(true)?, run(false)?))
    })
    .unwrap();
    for (r, ((aw, ab, abytes), (sw_got, sb_got, sbytes))) in out.into_iter().enumerate() {
        let local_rows = if r == 0 { 3 } else { 2 };
        assert_close(&aw, &chunk_rows(&want_w, rows, cols, 2, r), 1e-12, "AdamW shard");
        assert_close(&ab, &want_b, 1e-12, "AdamW replicated");
        assert_close(&sw_got, &chunk_rows(&sw, rows, cols, 2, r), 1e-12, "SGD shard");
        assert_close(&sb_got, &sb, 1e-12, "SGD replicated");
        // State is per local element: sharded like the parameter.
        assert_eq!(abytes, 2 * 8 * (local_rows * cols + nb), "rank {r} AdamW state");
        assert_eq!(sbytes, 8 * (local_rows * cols + nb), "rank {r} SGD state");
    }
}

// ---------------------------------------------------------------------------------------
// clip_grad_norm
// ---------------------------------------------------------------------------------------

struct ClipCase {
    /// Full gradients of: W [7, 3] Shard(0), U [4, 5] Shard(1), b [6] Replicate,
    /// q [5] Partial(sum), and a plain tensor c [3].
    grads: Vec<Vec<f64>>,
}

const SHAPES: [&[usize]; 5] = [&[7, 3], &[4, 5], &[6], &[5], &[3]];

impl ClipCase {
    fn new(scale: f64) -> ClipCase {
        let grads = SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| {
                vals(s.iter().product(), 50 + i as u64).iter().map(|v| v * scale).collect()
            })
            .collect();
        ClipCase { grads }
    }
    fn norm(&self) -> f64 {
        self.grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt()
    }
}

/// Builds the five parameters on a 1-d mesh of `k` ranks, with their local gradients set
/// as a backward would leave them.
fn clip_params(mesh: &DeviceMesh, case: &ClipCase) -> Result<Vec<Param>, NnError> {
    let k = mesh.size();
    let c = mesh.coordinate()[0];
    let placements = [Shard(0), Shard(1), Replicate, Placement::Partial(ReduceOp::Sum)];
    let mut params = Vec::new();
    for (i, pl) in placements.into_iter().enumerate() {
        let full = Tensor::zeros(SHAPES[i], DType::F64, tpar_tensor::Device::Cpu)?;
        let d = distribute_tensor(&full.requires_grad_(true), mesh, &[pl])?;
        // The local gradient layout: a shard on Shard dims, a contribution on Replicate
        // dims (rank c holds (c + 1) / sum of the gradient), the full gradient on Partial.
        let g_full = Tensor::from_f64(&case.grads[i], SHAPES[i], DType::F64)?;
        let g_local = match pl {
            Shard(_) => distribute_tensor(&g_full, mesh, &[pl])?.to_local(),
            Replicate => {
                let w = (c + 1) as f64 / (k * (k + 1) / 2) as f64;
                g_full.mul_scalar(w)?
            }
            _ => g_full,
        };
        d.local().set_grad(Some(g_local));
        params.push(Param::DTensor(d));
    }
    let plain =
        Tensor::zeros(SHAPES[4], DType::F64, tpar_tensor::Device::Cpu)?.requires_grad_(true);
    plain.set_grad(Some(Tensor::from_f64(&case.grads[4], SHAPES[4], DType::F64)?));
    params.push(Param::Tensor(plain));
    Ok(params)
}

#[test]
fn clip_grad_norm_on_shards_equals_the_unsharded_norm_and_scaling() {
    for k in [2, 3] {
        for scale in [1.0, 0.01] {
            let case = ClipCase::new(scale);
            let want = case.norm();
            let max_norm = 1.0;
            let coef = (max_norm / (want + 1e-6)).min(1.0);
            let out = spawn_scoped(SpawnConfig::new(k), |ctx| -> Result<_, NnError> {
                let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[k], &["tp"])?;
                let params = clip_params(&mesh, &case)?;
                let dbg = ctx.comm_debug();
                dbg.enable();
                let norm = clip(&params, max_norm)?;
                let records = dbg.take();
                dbg.disable();
                // After clipping, the reduced gradients are the leaves' grads: reading them
                // again (grad_local, grad, a second clip) never reduces twice.
                let mut full_grads = Vec::new();
                for p in &params {
                    full_grads.push(p.grad()?.unwrap().full()?.to_vec_f64()?);
                }
                let again = clip(&params, max_norm)?;
                Ok((norm, again, records, full_grads))
            })
            .unwrap();
            for (r, (norm, again, records, full_grads)) in out.into_iter().enumerate() {
                assert!((norm - want).abs() <= 1e-12 * want, "k={k} rank {r}: {norm} vs {want}");
                let reduces = records.iter().filter(|c| c.kind == CollectiveKind::AllReduce);
                // One all_reduce for the Replicate param's gradient, one for the norm.
                assert_eq!(reduces.count(), 2, "k={k} rank {r}: {records:?}");
                assert_eq!(records.len(), 2, "k={k} rank {r}: {records:?}");
                let clipped = (want * coef).min(want);
                assert!((again - clipped).abs() <= 1e-9 * want, "second norm {again} vs {clipped}");
                for (i, got) in full_grads.iter().enumerate() {
                    let expect: Vec<f64> = case.grads[i].iter().map(|g| g * coef).collect();
                    assert_close(got, &expect, 1e-12, &format!("k={k} param {i} grad"));
                }
            }
        }
    }
}

#[test]
fn clip_grad_norm_on_a_2d_mesh_and_a_sub_mesh() {
    // Mesh (dp=2, tp=2). A: [6, 4] with [Shard(0), Shard(1)]; B: [5] with
    // [Replicate, Shard(0)]; C: [3] on the tp sub-mesh, Replicate (its dp copies repeat).
    let a = vals(24, 61);
    let b = vals(5, 62);
    let c = vals(3, 63);
    let want: f64 = [&a, &b, &c].iter().flat_map(|v| v.iter()).map(|x| x * x).sum::<f64>().sqrt();
    let out = spawn_scoped(SpawnConfig::new(4), |ctx| -> Result<_, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
        let tp = mesh.dim("tp")?.clone();
        let mk = |v: &[f64],
                  dims: &[usize],
                  m: &DeviceMesh,
                  pl: &[Placement]|
         -> Result<Param, NnError> {
            let z = Tensor::zeros(dims, DType::F64, tpar_tensor::Device::Cpu)?.requires_grad_(true);
            let d = distribute_tensor(&z, m, pl)?;
            // Gradient contributions: on Replicate dims only coordinate 0 holds it.
            let g = distribute_tensor(&Tensor::from_f64(v, dims, DType::F64)?, m, pl)?.to_local();
            let zero_here =
                pl.iter().zip(m.coordinate()).any(|(p, &c)| matches!(p, Replicate) && c != 0);
            let g = if zero_here { g.mul_scalar(0.0)? } else { g };
            d.local().set_grad(Some(g));
            Ok(Param::DTensor(d))
        };
        let params = vec![
            mk(&a, &[6, 4], &mesh, &[Shard(0), Shard(1)])?,
            mk(&b, &[5], &mesh, &[Replicate, Shard(0)])?,
            mk(&c, &[3], &tp, &[Replicate])?,
        ];
        let dbg = ctx.comm_debug();
        dbg.enable();
        let norm = clip(&params, 1e9)?;
        let records = dbg.take();
        let groups = (mesh.group(0)?.ranks().to_vec(), mesh.group(1)?.ranks().to_vec());
        Ok((norm, records, groups))
    })
    .unwrap();
    for (r, (norm, records, (dp, tp))) in out.into_iter().enumerate() {
        assert!((norm - want).abs() <= 1e-12 * want, "rank {r}: {norm} vs {want}");
        // Gradient reductions: B's over dp, C's over tp. Then the norm: one all_reduce per
        // mesh dim, the tp one carrying two slots (A and B's layout, and C's).
        let has = |g: &Vec<usize>, shape: &[usize]| {
            records.iter().filter(|x| &x.group == g && x.shape == shape).count()
        };
        let b_local = if r % 2 == 0 { 3 } else { 2 };
        assert_eq!(records.len(), 4, "rank {r}: {records:?}");
        assert!(records.iter().all(|x| x.kind == CollectiveKind::AllReduce));
        assert_eq!(has(&dp, &[b_local]), 1, "rank {r}: {records:?}");
        assert_eq!(has(&tp, &[3]), 1, "rank {r}: {records:?}");
        assert_eq!(has(&dp, &[1]), 1, "rank {r}: {records:?}");
        assert_eq!(has(&tp, &[2]), 1, "rank {r}: {records:?}");
    }
}

// ---------------------------------------------------------------------------------------
// LR schedules
// ---------------------------------------------------------------------------------------

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-15 + 1e-12 * b.abs()
}

#[test]
fn linear_lr_matches_pytorch() {
    // LinearLR(start_factor=0.1, end_factor=1.0, total_iters=10), base lr 1e-3:
    // lr = 1e-3 * (0.1 + 0.9 * min(t, 10) / 10).
    let s = LinearLR::new(0.1, 1.0, 10).unwrap();
    for (t, want) in [(0, 1e-4), (1, 1.9e-4), (5, 5.5e-4), (9, 9.1e-4), (10, 1e-3), (25, 1e-3)] {
        assert!(close(s.lr_at(t, 1e-3), want), "step {t}: {} vs {want}", s.lr_at(t, 1e-3));
    }
    // torch's chainable form (what scheduler.step() computes) agrees.
    let mut lr = 1e-3 * 0.1;
    for t in 1..=15usize {
        if t <= 10 {
            lr *= 1.0 + 0.9 / (10.0 * 0.1 + (t as f64 - 1.0) * 0.9);
        }
        assert!(close(s.lr_at(t, 1e-3), lr), "chainable step {t}");
    }
}

#[test]
fn cosine_lr_matches_pytorch() {
    // CosineAnnealingLR(T_max=90, eta_min=1e-5), base lr 1e-3:
    // lr = 1e-5 + (1e-3 - 1e-5) * (1 + cos(pi * t / 90)) / 2.
    let s = CosineAnnealingLR::new(90, 1e-5).unwrap();
    for (t, want) in [
        (0, 1e-3),
        (30, 1e-5 + 0.99e-3 * 0.75), // cos(pi/3) = 0.5
        (45, 5.05e-4),               // cos(pi/2) = 0
        (60, 1e-5 + 0.99e-3 * 0.25),
        (90, 1e-5),
    ] {
        assert!(close(s.lr_at(t, 1e-3), want), "step {t}: {} vs {want}", s.lr_at(t, 1e-3));
    }
    // torch's chainable form agrees.
    let (base, eta, tm) = (1e-3, 1e-5, 90.0);
    let mut lr = base;
    for t in 1..=100usize {
        let tf = t as f64;
        lr = if (t as i64 - 1 - 90) % 180 == 0 {
            lr + (base - eta) * (1.0 - (PI / tm).cos()) / 2.0
        } else {
            (1.0 + (PI * tf / tm).cos()) / (1.0 + (PI * (tf - 1.0) / tm).cos()) * (lr - eta) + eta
        };
        assert!((s.lr_at(t, base) - lr).abs() < 1e-15, "chainable step {t}");
    }
}

#[test]
fn sequential_warmup_then_cosine_matches_pytorch() {
    // SequentialLR([LinearLR(0.1, 1.0, 10), CosineAnnealingLR(90, 1e-5)], milestones=[10]).
    let s = SequentialLR::warmup_cosine(10, 100, 0.1, 1e-5).unwrap();
    for (t, want) in [
        (0, 1e-4),     // warmup start: 0.1 * base
        (9, 9.1e-4),   // last warmup step
        (10, 1e-3),    // milestone: cosine restarts at its step 0
        (55, 5.05e-4), // mid: cosine step 45 of 90
        (100, 1e-5),   // end: eta_min
    ] {
        assert!(close(s.lr_at(t, 1e-3), want), "step {t}: {} vs {want}", s.lr_at(t, 1e-3));
    }
    // The stateful API drives an optimizer through the same values.
    let p = vec![Param::Tensor(leaf(&[1.0], &[1], DType::F32))];
    let mut opt = AdamW::new(p, AdamWConfig { lr: 1e-3, ..ADAM }).unwrap();
    let mut sched = LrScheduler::new(s, &mut opt);
    assert!(close(opt.lr(), 1e-4));
    for t in 1..=100 {
        let lr = sched.step(&mut opt);
        assert_eq!(lr, opt.lr());
        assert!(close(lr, sched.schedule().lr_at(t, 1e-3)));
    }
    assert_eq!(sched.last_step(), 100);
    assert!(close(sched.last_lr(), 1e-5));
    // Three pieces with two milestones.
    let three = SequentialLR::new(
        vec![
            Box::new(LinearLR::new(0.5, 1.0, 2).unwrap()),
            Box::new(LinearLR { start_factor: 1.0, end_factor: 1.0, total_iters: 1 }),
            Box::new(CosineAnnealingLR::new(4, 0.0).unwrap()),
        ],
        vec![2, 5],
    )
    .unwrap();
    let got: Vec<f64> = (0..8).map(|t| three.lr_at(t, 1.0)).collect();
    let c = |t: f64| (1.0 + (PI * t / 4.0).cos()) / 2.0;
    let want = [0.5, 0.75, 1.0, 1.0, 1.0, c(0.0), c(1.0), c(2.0)];
    for (t, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(close(*g, w), "three-piece step {t}: {g} vs {w}");
    }
}

#[test]
fn lr_schedules_handle_degenerate_struct_literals_without_panicking() {
    let l = LinearLR { start_factor: 0.5, end_factor: 1.0, total_iters: 0 };
    assert_eq!(l.lr_at(0, 2.0), 2.0);
    let c = CosineAnnealingLR { t_max: 0, eta_min: 0.0 };
    assert!(c.lr_at(3, 1.0).is_finite());
}

#[test]
fn dtensor_param_grad_after_clip_is_not_reduced_twice() {
    // A Replicate DTensor parameter trained through a real backward: clip, then the
    // optimizer step uses the same reduced gradient.
    let out = spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<_, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
        let w = Tensor::from_f64(&[1.0, -2.0, 3.0], [3], DType::F64)?.requires_grad_(true);
        let d = distribute_tensor(&w, &mesh, &[Replicate])?;
        let loss = d.to_local().square()?.sum_all()?;
        let loss = DTensor::from_local(&loss, &mesh, &[Replicate], Some(&[][..]))?;
        loss.backward()?;
        let p = Param::DTensor(d);
        let first = p.grad_local()?.unwrap().to_vec_f64()?;
        let norm = clip(std::slice::from_ref(&p), 1e9)?;
        let after = p.grad_local()?.unwrap().to_vec_f64()?;
        Ok((first, norm, after))
    })
    .unwrap();
    for (first, norm, after) in out {
        assert_eq!(first, vec![2.0, -4.0, 6.0]);
        assert_eq!(after, first);
        assert!((norm - 56f64.sqrt()).abs() < 1e-12);
    }
}
