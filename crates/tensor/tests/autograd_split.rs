//! The split backward (`backward_input` + `WeightGrad::run`) against the full
//! backward (`grad` for the input, `backward_with` for the parameters), in f64.
#![allow(clippy::cloned_ref_to_slice_refs)] // `&[x.clone()]` reads best in the calls below

use std::sync::{Arc, Mutex};

use tpar_tensor::autograd::{
    apply, backward_input, grad, grad_retain_graph, is_grad_enabled, needs_input_grad, Function,
    GradModeGuard, WeightGrad,
};
use tpar_tensor::{DType, Result, Rng, Tensor, TensorError};

fn randn(shape: &[usize], rng: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), DType::F64, rng).unwrap()
}

/// A fresh leaf requiring grad with `t`'s data, shape and dtype.
fn leaf_like(t: &Tensor) -> Tensor {
    Tensor::from_f64(&t.to_vec_f64().unwrap(), t.dims().to_vec(), t.dtype())
        .unwrap()
        .requires_grad_(true)
}

/// Asserts `a` and `b` agree to 1e-12 relative (f64) or 1e-6 (f32).
fn assert_close(what: &str, a: Option<&Tensor>, b: Option<&Tensor>) {
    let (a, b) = match (a, b) {
        (None, None) => return,
        (Some(a), Some(b)) => (a, b),
        (a, b) => panic!("{what}: one side has no gradient ({} vs {})", a.is_some(), b.is_some()),
    };
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtypes");
    let tol = if a.dtype() == DType::F64 { 1e-12 } else { 1e-6 };
    let (va, vb) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let scale = vb.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (x, y)) in va.iter().zip(&vb).enumerate() {
        assert!((x - y).abs() <= tol * scale, "{what}[{i}]: {x} vs {y}");
    }
}

/// Builds the graph twice on leaves with the same data: once for the full
/// backward, once for the split one, and compares the input gradient and every
/// parameter's `.grad()`. `params[i]` is `(shape, dtype)`.
fn check(
    name: &str,
    x_dims: &[usize],
    params: &[(&[usize], DType)],
    build: impl Fn(&Tensor, &[Tensor]) -> Result<Vec<Tensor>>,
) {
    let mut rng = Rng::new(11);
    let x0 = randn(x_dims, &mut rng);
    let p0: Vec<Tensor> =
        params.iter().map(|(d, dt)| Tensor::randn(d.to_vec(), *dt, &mut rng).unwrap()).collect();

    // Full backward.
    let x_ref = leaf_like(&x0);
    let p_ref: Vec<Tensor> = p0.iter().map(leaf_like).collect();
    let roots_ref = build(&x_ref, &p_ref).unwrap();
    let grads: Vec<Tensor> = roots_ref.iter().map(|r| randn(r.dims(), &mut rng)).collect();
    // (the graph kept for the backward passes below, as PyTorch's retain_graph=True)
    let gx_ref = grad_retain_graph(&roots_ref, &grads, &[x_ref.clone()]).unwrap();
    // Roots may share nodes: each pass keeps the graph for the next.
    for (r, g) in roots_ref.iter().zip(&grads) {
        r.backward_retain_graph(Some(g)).unwrap();
    }

    // Split backward.
    let x = leaf_like(&x0);
    let p: Vec<Tensor> = p0.iter().map(leaf_like).collect();
    let roots = build(&x, &p).unwrap();
    let (gx, weights) = backward_input(&roots, &grads, &[x.clone()]).unwrap();
    assert_eq!(gx.len(), 1);
    assert_close(&format!("{name}: input"), gx[0].as_ref(), gx_ref[0].as_ref());
    for (i, t) in p.iter().enumerate() {
        assert!(t.grad().is_none(), "{name}: param {i} got a gradient in the input pass");
    }
    weights.run().unwrap();
    for (i, (a, b)) in p.iter().zip(&p_ref).enumerate() {
        assert_close(&format!("{name}: param {i}"), a.grad().as_ref(), b.grad().as_ref());
    }
    assert!(x.grad().is_none(), "{name}: the input's .grad() is not touched");
}

const F64: DType = DType::F64;

#[test]
fn chain_of_three_linear_layers() {
    let d: &[usize] = &[4, 4];
    let b: &[usize] = &[4];
    let ps =
        [(d, F64), (b, F64), (d, F64), (b, F64), (&[3usize, 4][..], F64), (&[3usize][..], F64)];
    check("chain", &[5, 4], &ps, |x, p| {
        let h1 = x.linear(&p[0], Some(&p[1]))?.silu()?;
        let h2 = h1.linear(&p[2], Some(&p[3]))?.mul(&h1)?;
        Ok(vec![h2.silu()?.linear(&p[4], Some(&p[5]))?])
    });
}

#[test]
fn residual_block() {
    let ps = [(&[6usize, 4][..], F64), (&[4usize, 6][..], F64), (&[4usize][..], F64)];
    check("residual", &[3, 4], &ps, |x, p| {
        let f = x.linear(&p[0], None)?.silu()?.linear(&p[1], Some(&p[2]))?;
        Ok(vec![x.add(&f)?])
    });
}

#[test]
fn weight_used_by_two_matmuls_on_the_path() {
    let ps = [(&[4usize, 4][..], F64), (&[4usize][..], F64)];
    check("shared weight", &[3, 4], &ps, |x, p| {
        let h = x.linear(&p[0], Some(&p[1]))?.silu()?;
        Ok(vec![h.linear(&p[0], Some(&p[1]))?.matmul(&p[0])?])
    });
}

#[test]
fn weight_used_directly_and_through_an_off_path_subgraph() {
    let ps = [(&[4usize, 4][..], F64), (&[4usize][..], F64)];
    check("off-path subgraph", &[3, 4], &ps, |x, p| {
        let w2 = p[0].mul_scalar(2.0)?.add_scalar(0.5)?;
        // An off-path product of two parameters, used as a scale on the path.
        let s = p[1].mul(&p[1])?.silu()?;
        let h = x.linear(&p[0], None)?.silu()?.mul(&s)?;
        Ok(vec![h.linear(&w2, None)?.linear(&p[0], Some(&s))?])
    });
}

#[test]
fn weight_through_a_dtype_cast() {
    // An f32 master weight cast to f64 for the product, and used in f32 elsewhere.
    let ps = [(&[4usize, 4][..], DType::F32), (&[4usize, 4][..], F64)];
    check("to_dtype", &[3, 4], &ps, |x, p| {
        let w = p[0].to_dtype(F64)?;
        let h = x.linear(&w, None)?.silu()?.linear(&p[1], None)?;
        let extra = p[0].mul(&p[0])?.sum_all()?.to_dtype(F64)?;
        Ok(vec![h.matmul(&w.mul_scalar(0.5)?)?, extra])
    });
}

#[test]
fn root_does_not_depend_on_the_input() {
    let ps = [(&[4usize, 4][..], F64)];
    check("no input", &[3, 4], &ps, |_x, p| Ok(vec![p[0].mul(&p[0])?.matmul(&p[0])?]));
}

#[test]
fn multiple_roots() {
    let ps = [(&[4usize, 4][..], F64), (&[2usize, 4][..], F64), (&[4usize][..], F64)];
    check("multiple roots", &[3, 4], &ps, |x, p| {
        let y1 = x.linear(&p[0], None)?;
        let y2 = y1.silu()?.linear(&p[1], None)?;
        // A root that is an intermediate of another root, and one off the path.
        let y3 = p[2].mul_scalar(3.0)?.mul(&p[2])?;
        Ok(vec![y2, y1, y3])
    });
}

#[test]
fn batched_activations_and_2d_weights() {
    let ps = [
        (&[5usize, 4][..], F64),
        (&[5usize][..], F64),
        (&[5usize, 6][..], F64),
        (&[2usize, 6, 3][..], F64),
        (&[1usize, 3, 2][..], F64),
    ];
    check("batched", &[2, 3, 4], &ps, |x, p| {
        // linear folds the batch into rows with a transposed weight; matmul
        // folds it untransposed; a batched and a broadcast weight follow.
        let h = x.linear(&p[0], Some(&p[1]))?.silu()?.matmul(&p[2])?;
        Ok(vec![h.matmul(&p[3])?.silu()?.matmul(&p[4])?])
    });
}

#[test]
fn cat_of_an_activation_and_a_parameter() {
    let ps = [(&[2usize, 4][..], F64), (&[4usize, 4][..], F64)];
    check("cat", &[3, 4], &ps, |x, p| {
        let h = Tensor::cat(&[x.silu()?, p[0].clone()], 0)?;
        Ok(vec![h.linear(&p[1], None)?])
    });
}

#[test]
fn fused_ops_and_embedding() {
    let ps = [(&[4usize][..], F64), (&[4usize, 4][..], F64), (&[6usize, 4][..], F64)];
    check("fused", &[3, 4], &ps, |x, p| {
        let ids = Tensor::from_vec(vec![0i64, 5, 2], [3])?;
        let e = Tensor::embedding(&ids, &p[2])?;
        let h = x.add(&e)?.rms_norm(&p[0], 1e-6)?.linear(&p[1], None)?;
        let targets = Tensor::from_vec(vec![1i64, 3, 0], [3])?;
        Ok(vec![h.cross_entropy(&targets, -100)?])
    });
}

#[test]
fn input_that_is_not_a_leaf() {
    // The stage input comes out of an op on a parameter and a leaf: the part
    // before it belongs to the weight pass.
    let mut rng = Rng::new(3);
    let (x0, w0, v0) =
        (randn(&[3, 4], &mut rng), randn(&[4, 4], &mut rng), randn(&[4, 4], &mut rng));
    let g = randn(&[3, 4], &mut rng);
    let run = |split: bool| {
        let (x0, w, v) = (leaf_like(&x0), leaf_like(&w0), leaf_like(&v0));
        let x = x0.linear(&w, None).unwrap();
        let y = x.silu().unwrap().linear(&v, None).unwrap();
        let gx = if split {
            let (gx, weights) = backward_input(&[y], &[g.clone()], &[x.clone()]).unwrap();
            assert!(w.grad().is_none() && v.grad().is_none() && x0.grad().is_none());
            weights.run().unwrap();
            gx[0].clone()
        } else {
            let gx = grad_retain_graph(&[y.clone()], &[g.clone()], &[x.clone()]).unwrap();
            y.backward_with(&g).unwrap();
            gx[0].clone()
        };
        (gx, x0.grad(), w.grad(), v.grad())
    };
    let (a, b) = (run(true), run(false));
    assert_close("x", a.0.as_ref(), b.0.as_ref());
    assert_close("x0", a.1.as_ref(), b.1.as_ref());
    assert_close("w", a.2.as_ref(), b.2.as_ref());
    assert_close("v", a.3.as_ref(), b.3.as_ref());
}

#[test]
fn no_inputs_defers_the_whole_backward() {
    let mut rng = Rng::new(4);
    let (x, w) = (randn(&[3, 4], &mut rng), leaf_like(&randn(&[2, 4], &mut rng)));
    let y = x.linear(&w, None).unwrap();
    let g = randn(&[3, 2], &mut rng);
    let (gx, weights) = backward_input(&[y.clone()], &[g.clone()], &[]).unwrap();
    assert!(gx.is_empty() && !weights.is_empty() && w.grad().is_none());
    weights.run().unwrap();
    let w_ref = leaf_like(&w);
    x.linear(&w_ref, None).unwrap().backward_with(&g).unwrap();
    assert_close("w", w.grad().as_ref(), w_ref.grad().as_ref());
    // An input that does not require grad: the same.
    let (gx, weights) = backward_input(&[y], &[g], &[x]).unwrap();
    assert!(gx[0].is_none() && !weights.is_empty());
}

#[test]
fn micro_batches_accumulate() {
    let mut rng = Rng::new(5);
    let w0 = randn(&[4, 4], &mut rng);
    let b0 = randn(&[4], &mut rng);
    let xs = [randn(&[3, 4], &mut rng), randn(&[3, 4], &mut rng)];
    let gs = [randn(&[3, 4], &mut rng), randn(&[3, 4], &mut rng)];
    let fwd = |x: &Tensor, w: &Tensor, b: &Tensor| {
        x.linear(w, Some(b)).unwrap().silu().unwrap().linear(w, None).unwrap()
    };
    // I1, I2, W1, W2.
    let (w, b) = (leaf_like(&w0), leaf_like(&b0));
    let mut pending: Vec<WeightGrad> = Vec::new();
    let mut gx = Vec::new();
    for (x, g) in xs.iter().zip(&gs) {
        let x = leaf_like(x);
        let (d, weights) = backward_input(&[fwd(&x, &w, &b)], &[g.clone()], &[x]).unwrap();
        gx.push(d[0].clone());
        pending.push(weights);
    }
    assert!(w.grad().is_none());
    for weights in pending {
        weights.run().unwrap();
    }
    // The full backward of both.
    let (w_ref, b_ref) = (leaf_like(&w0), leaf_like(&b0));
    for ((x, g), d) in xs.iter().zip(&gs).zip(&gx) {
        let x = leaf_like(x);
        let y = fwd(&x, &w_ref, &b_ref);
        y.backward_with(g).unwrap();
        assert_close("input", d.as_ref(), x.grad().as_ref());
    }
    assert_close("w", w.grad().as_ref(), w_ref.grad().as_ref());
    assert_close("b", b.grad().as_ref(), b_ref.grad().as_ref());
}

/// The masks `(needs_input_grad(0), needs_input_grad(1))` of each backward call.
type MaskLog = Arc<Mutex<Vec<(bool, bool)>>>;

/// `y = a * w` (elementwise) that logs the mask and grad mode of each backward
/// call and computes only the halves asked for.
struct Logged {
    log: MaskLog,
    saved: Vec<Tensor>,
    /// Ignore the mask and return both halves.
    greedy: bool,
}

impl Function for Logged {
    fn name(&self) -> &'static str {
        "logged"
    }
    fn forward(&mut self, x: &[Tensor]) -> Result<Tensor> {
        self.saved = x.to_vec();
        x[0].mul(&x[1])
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        assert!(!is_grad_enabled());
        let (na, nw) = (needs_input_grad(0), needs_input_grad(1));
        self.log.lock().unwrap().push((na, nw));
        let (a, w) = (&self.saved[0], &self.saved[1]);
        let ga = if na || self.greedy { Some(g.mul(w)?) } else { None };
        let gw = if nw || self.greedy { Some(g.mul(a)?.sum_to(w.shape())?) } else { None };
        Ok(vec![ga, gw])
    }
}

fn logged_graph(greedy: bool) -> (Tensor, Tensor, Tensor, MaskLog) {
    let mut rng = Rng::new(6);
    let x = leaf_like(&randn(&[3, 4], &mut rng));
    let w = leaf_like(&randn(&[4], &mut rng));
    let log = Arc::new(Mutex::new(Vec::new()));
    let f = Logged { log: log.clone(), saved: Vec::new(), greedy };
    let y = apply(f, &[&x.silu().unwrap(), &w]).unwrap();
    (x, w, y.sum_all().unwrap(), log)
}

#[test]
fn closures_see_the_mask_of_each_pass() {
    let (x, w, loss, log) = logged_graph(false);
    let one = Tensor::scalar(1.0, F64);
    let (gx, weights) = backward_input(&[loss.clone()], &[one.clone()], &[x.clone()]).unwrap();
    assert_eq!(*log.lock().unwrap(), vec![(true, false)]);
    assert!(w.grad().is_none() && gx[0].is_some());
    weights.run().unwrap();
    assert_eq!(*log.lock().unwrap(), vec![(true, false), (false, true)]);
    let gw = w.grad().unwrap();
    // The split passes freed the graph; the same graph again, with a plain backward,
    // asks for both halves at once.
    let (x2, w2, loss2, log2) = logged_graph(false);
    loss2.backward().unwrap();
    assert_eq!(*log2.lock().unwrap(), vec![(true, true)]);
    assert_close("w", Some(&gw), w2.grad().as_ref());
    assert_close("x", gx[0].as_ref(), x2.grad().as_ref());
    let err = loss.backward().unwrap_err().to_string();
    assert!(err.contains("second time"), "{err}");
    // Outside the engine nothing is masked.
    assert!(needs_input_grad(0) && needs_input_grad(1));
}

#[test]
fn a_closure_that_ignores_the_mask_runs_once() {
    let (x, w, loss, log) = logged_graph(true);
    let one = Tensor::scalar(1.0, F64);
    let (gx, weights) = backward_input(&[loss.clone()], &[one.clone()], &[x.clone()]).unwrap();
    weights.run().unwrap();
    assert_eq!(*log.lock().unwrap(), vec![(true, false)]);
    let (x2, w2, loss2, _) = logged_graph(false);
    loss2.backward().unwrap();
    assert_close("w", w.grad().as_ref(), w2.grad().as_ref());
    assert_close("x", gx[0].as_ref(), x2.grad().as_ref());
}

#[test]
fn matmul_weight_half_waits_for_the_weight_pass() {
    // A pass-through on the weight logs when a gradient reaches it.
    let mut rng = Rng::new(8);
    let x = leaf_like(&randn(&[3, 4], &mut rng));
    let w = leaf_like(&randn(&[2, 4], &mut rng));
    let log = Arc::new(Mutex::new(Vec::new()));
    let seen = log.clone();
    let w_seen = tpar_tensor::autograd::record("watch", &[&w], w.detach(), move |g| {
        seen.lock().unwrap().push(g.dims().to_vec());
        Ok(vec![Some(g.clone())])
    });
    let y = x.linear(&w_seen, None).unwrap();
    let g = randn(&[3, 2], &mut rng);
    let (gx, weights) = backward_input(&[y], &[g], &[x.clone()]).unwrap();
    assert!(gx[0].is_some());
    assert!(log.lock().unwrap().is_empty() && w.grad().is_none());
    assert!(format!("{weights:?}").contains("\"matmul\""), "{weights:?}");
    weights.run().unwrap();
    assert_eq!(*log.lock().unwrap(), vec![vec![2, 4]]);
    assert!(w.grad().is_some());
}

/// A function whose backward runs an engine of its own (`grad` on a private graph)
/// and then reads its own mask again.
struct Nested {
    log: MaskLog,
    saved: Vec<Tensor>,
}

impl Function for Nested {
    fn name(&self) -> &'static str {
        "nested"
    }
    fn forward(&mut self, x: &[Tensor]) -> Result<Tensor> {
        self.saved = x.to_vec();
        x[0].mul(&x[1])
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let before = (needs_input_grad(0), needs_input_grad(1));
        {
            // A private graph with a node of three inputs, differentiated here.
            let _on = GradModeGuard::new(true);
            let a = self.saved[0].detach().requires_grad_(true);
            let w = self.saved[1].detach().reshape([1, 4])?;
            let inner = Tensor::cat(&[a.clone(), w.clone(), w], 0)?.mul_scalar(2.0)?;
            let ones = Tensor::ones(inner.dims().to_vec(), F64, inner.device())?;
            let ga = grad(&[inner], &[ones], &[a])?;
            assert!(ga[0].is_some());
        }
        let after = (needs_input_grad(0), needs_input_grad(1));
        assert_eq!(before, after, "the nested engine left its mask behind");
        self.log.lock().unwrap().push(after);
        let ga = if after.0 { Some(g.mul(&self.saved[1])?) } else { None };
        let gw = if after.1 {
            Some(g.mul(&self.saved[0])?.sum_to(self.saved[1].shape())?)
        } else {
            None
        };
        Ok(vec![ga, gw])
    }
}

#[test]
fn a_nested_engine_run_does_not_leak_its_mask() {
    let mut rng = Rng::new(9);
    let x = leaf_like(&randn(&[3, 4], &mut rng));
    let w = leaf_like(&randn(&[4], &mut rng));
    let log = Arc::new(Mutex::new(Vec::new()));
    let y =
        apply(Nested { log: log.clone(), saved: Vec::new() }, &[&x.silu().unwrap(), &w]).unwrap();
    let g = randn(&[3, 4], &mut rng);
    let (_, weights) = backward_input(&[y], &[g], &[x]).unwrap();
    weights.run().unwrap();
    assert_eq!(*log.lock().unwrap(), vec![(true, false), (false, true)]);
    assert!(w.grad().is_some());
}

#[test]
fn the_weight_pass_runs_on_another_thread() {
    fn assert_send<T: Send>() {}
    assert_send::<WeightGrad>();
    let mut rng = Rng::new(10);
    let x = leaf_like(&randn(&[3, 4], &mut rng));
    let w = leaf_like(&randn(&[2, 4], &mut rng));
    let y = x.linear(&w, None).unwrap();
    let (_, weights) = backward_input(&[y], &[randn(&[3, 2], &mut rng)], &[x]).unwrap();
    std::thread::spawn(move || weights.run()).join().unwrap().unwrap();
    assert!(w.grad().is_some());
}

fn autograd_message(e: TensorError) -> String {
    match e {
        TensorError::Autograd(m) => m,
        other => panic!("expected an autograd error, got {other:?}"),
    }
}

#[test]
fn errors_are_reported() {
    let mut rng = Rng::new(12);
    let x = leaf_like(&randn(&[3, 4], &mut rng));
    let w = leaf_like(&randn(&[2, 4], &mut rng));
    let y = x.linear(&w, None).unwrap();
    let g = randn(&[3, 2], &mut rng);
    let e = backward_input(&[y.clone()], &[], &[x.clone()]).unwrap_err();
    assert!(autograd_message(e).contains("1 roots but 0 root gradients"));
    let e = backward_input(&[y.clone()], &[randn(&[2, 3], &mut rng)], &[x.clone()]).unwrap_err();
    let m = autograd_message(e);
    assert!(m.contains("[2, 3]") && m.contains("[3, 2]"), "{m}");
    let e = backward_input(&[y.detach()], &[g.clone()], &[x.clone()]).unwrap_err();
    assert!(autograd_message(e).contains("does not require grad"));
    // No gradient was written by the failed calls.
    assert!(x.grad().is_none() && w.grad().is_none());
}

/// `y = a * w` whose weight half has the wrong shape.
struct BadWeightGrad(Vec<Tensor>);

impl Function for BadWeightGrad {
    fn name(&self) -> &'static str {
        "bad_weight_grad"
    }
    fn forward(&mut self, x: &[Tensor]) -> Result<Tensor> {
        self.0 = x.to_vec();
        x[0].mul(&x[1])
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let ga = if needs_input_grad(0) { Some(g.mul(&self.0[1])?) } else { None };
        let gw = if needs_input_grad(1) { Some(g.clone()) } else { None };
        Ok(vec![ga, gw])
    }
}

#[test]
fn an_error_in_the_weight_pass_is_returned() {
    let mut rng = Rng::new(13);
    let x = leaf_like(&randn(&[3, 4], &mut rng));
    let w = leaf_like(&randn(&[4], &mut rng));
    let y = apply(BadWeightGrad(Vec::new()), &[&x, &w]).unwrap();
    let (gx, weights) = backward_input(&[y], &[randn(&[3, 4], &mut rng)], &[x]).unwrap();
    assert!(gx[0].is_some());
    let m = autograd_message(weights.run().unwrap_err());
    assert!(m.contains("bad_weight_grad") && m.contains("[3, 4]") && m.contains("[4]"), "{m}");
    assert!(w.grad().is_none());
}
