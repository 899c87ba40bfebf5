//! Finite-difference gradient checks in f64 for every op with a backward, on random
//! shapes chosen by proptest.
#![allow(clippy::cloned_ref_to_slice_refs)] // `&[x.clone()]` reads best in the many calls below

use proptest::prelude::*;
use tpar_tensor::autograd::grad;
use tpar_tensor::{no_grad, DType, Result, Rng, RopeLayout, Tensor};

fn randn(shape: &[usize], rng: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), DType::F64, rng).unwrap().requires_grad_(true)
}

fn positive(shape: &[usize], rng: &mut Rng) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| 0.5 + rng.uniform() * 2.0).collect();
    Tensor::from_f64(&v, shape.to_vec(), DType::F64).unwrap().requires_grad_(true)
}

/// Compares autograd's gradient of `sum(f(inputs) * r)` for a fixed random `r` with
/// central differences, for every input that requires a gradient.
fn gradcheck(name: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], seed: u64) {
    let y = f(inputs).unwrap();
    let r = Tensor::randn(y.shape().clone(), DType::F64, &mut Rng::new(seed ^ 77)).unwrap();
    let loss = y.mul(&r).unwrap().sum_all().unwrap();
    let one = Tensor::scalar(1.0, DType::F64);
    let analytic = grad(&[loss], &[one], inputs).unwrap();
    let eval = |ins: &[Tensor]| -> f64 {
        no_grad(|| f(ins).unwrap().mul(&r).unwrap().sum_all().unwrap().item().unwrap())
    };
    let h = 1e-6;
    for (i, x) in inputs.iter().enumerate() {
        if !x.requires_grad() {
            continue;
        }
        let base = x.to_vec_f64().unwrap();
        let an = match &analytic[i] {
            Some(g) => g.to_vec_f64().unwrap(),
            None => vec![0.0; base.len()],
        };
        for j in 0..base.len() {
            let probe = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let mut ins: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
                ins[i] = Tensor::from_f64(&v, x.shape().clone(), DType::F64).unwrap();
                eval(&ins)
            };
            let fd = (probe(h) - probe(-h)) / (2.0 * h);
            let tol = 1e-5 * (1.0 + fd.abs());
            assert!(
                (fd - an[j]).abs() <= tol,
                "{name}: input {i} element {j}: finite difference {fd} vs autograd {}",
                an[j]
            );
        }
    }
}

fn small_dim() -> impl Strategy<Value = usize> {
    1usize..4
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn broadcast_binary_ops(seed in any::<u64>(), a in small_dim(), b in small_dim(), c in small_dim(), bcast in 0usize..3) {
        let mut rng = Rng::new(seed);
        let x = randn(&[a, b, c], &mut rng);
        let yshape: Vec<usize> = match bcast { 0 => vec![a, b, c], 1 => vec![b, 1], _ => vec![1, c] };
        let y = randn(&yshape, &mut rng);
        let yp = positive(&yshape, &mut rng);
        gradcheck("add", |t| t[0].add(&t[1]), &[x.clone(), y.clone()], seed);
        gradcheck("sub", |t| t[0].sub(&t[1]), &[x.clone(), y.clone()], seed);
        gradcheck("mul", |t| t[0].mul(&t[1]), &[x.clone(), y.clone()], seed);
        gradcheck("div", |t| t[0].div(&t[1]), &[x.clone(), yp.clone()], seed);
        gradcheck("pow", |t| t[1].pow(&t[0].mul_scalar(0.3)?), &[x, yp], seed);
    }

    #[test]
    fn unary_and_scalar_ops(seed in any::<u64>(), a in small_dim(), b in 1usize..6) {
        let mut rng = Rng::new(seed);
        let x = randn(&[a, b], &mut rng);
        let p = positive(&[a, b], &mut rng);
        gradcheck("neg", |t| t[0].neg(), &[x.clone()], seed);
        gradcheck("exp", |t| t[0].exp(), &[x.clone()], seed);
        gradcheck("silu", |t| t[0].silu(), &[x.clone()], seed);
        let u = randn(&[a, b], &mut rng);
        gradcheck("silu_mul", |t| t[0].silu_mul(&t[1]), &[x.clone(), u], seed);
        gradcheck("sigmoid", |t| t[0].sigmoid(), &[x.clone()], seed);
        gradcheck("tanh", |t| t[0].tanh(), &[x.clone()], seed);
        gradcheck("square", |t| t[0].square(), &[x.clone()], seed);
        gradcheck("log", |t| t[0].log(), &[p.clone()], seed);
        gradcheck("sqrt", |t| t[0].sqrt(), &[p.clone()], seed);
        gradcheck("rsqrt", |t| t[0].rsqrt(), &[p.clone()], seed);
        gradcheck("recip", |t| t[0].recip(), &[p.clone()], seed);
        gradcheck("pow_scalar", |t| t[0].pow_scalar(1.7), &[p], seed);
        gradcheck("scalars", |t| t[0].add_scalar(2.0)?.mul_scalar(-1.5)?.rsub_scalar(0.25)?.div_scalar(3.0), &[x], seed);
    }

    #[test]
    fn reductions(seed in any::<u64>(), a in small_dim(), b in small_dim(), c in small_dim(), keep in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let x = randn(&[a, b, c], &mut rng);
        gradcheck("sum", |t| t[0].sum(1, keep), &[x.clone()], seed);
        gradcheck("sum_dims", |t| t[0].sum_dims(&[0, -1], keep), &[x.clone()], seed);
        gradcheck("mean", |t| t[0].mean(-1, keep), &[x.clone()], seed);
        gradcheck("mean_all", |t| t[0].mean_all(), &[x.clone()], seed);
        gradcheck("max", |t| t[0].max(1, keep), &[x.clone()], seed);
        gradcheck("softmax", |t| t[0].softmax(1), &[x.clone()], seed);
        gradcheck("log_softmax", |t| t[0].log_softmax(-1), &[x], seed);
    }

    #[test]
    fn matmuls(seed in any::<u64>(), m in small_dim(), k in small_dim(), n in small_dim(), batch in small_dim(), ta in any::<bool>(), tb in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let ash = |bt: Option<usize>| { let mut s: Vec<usize> = bt.into_iter().collect(); s.extend(if ta { [k, m] } else { [m, k] }); s };
        let bsh = |bt: Option<usize>| { let mut s: Vec<usize> = bt.into_iter().collect(); s.extend(if tb { [n, k] } else { [k, n] }); s };
        for (ab, bb) in [(None, None), (Some(batch), Some(batch)), (Some(batch), None), (None, Some(batch))] {
            let a = randn(&ash(ab), &mut rng);
            let b = randn(&bsh(bb), &mut rng);
            gradcheck("matmul_t", |t| t[0].matmul_t(&t[1], ta, tb), &[a, b], seed);
        }
        // batch broadcasting [2,1,m,k] x [1,3,k,n]
        let a = randn(&[2, 1, m, k], &mut rng);
        let b = randn(&[1, 3, k, n], &mut rng);
        gradcheck("matmul_broadcast", |t| t[0].matmul(&t[1]), &[a, b], seed);
        let x = randn(&[batch, m, k], &mut rng);
        let w = randn(&[n, k], &mut rng);
        let bias = randn(&[n], &mut rng);
        gradcheck("linear", |t| t[0].linear(&t[1], Some(&t[2])), &[x, w, bias], seed);
    }

    #[test]
    fn layout_ops(seed in any::<u64>(), a in small_dim(), b in 2usize..5, c in small_dim()) {
        let mut rng = Rng::new(seed);
        let x = randn(&[a, b, c], &mut rng);
        let y = randn(&[a, 2, c], &mut rng);
        gradcheck("reshape", |t| t[0].reshape([c, a * b])?.mul(&t[0].view(&[-1, 1])?.reshape([c, a * b])?), &[x.clone()], seed);
        gradcheck("transpose", |t| t[0].transpose(0, 2), &[x.clone()], seed);
        gradcheck("permute", |t| t[0].permute(&[1, 2, 0]), &[x.clone()], seed);
        gradcheck("narrow", |t| t[0].narrow(1, 1, b - 1), &[x.clone()], seed);
        gradcheck("chunk", |t| { let ch = t[0].chunk(2, 1)?; ch[0].sum_all()?.add(&ch[ch.len() - 1].mul_scalar(2.0)?.sum_all()?) }, &[x.clone()], seed);
        gradcheck("split", |t| { let s = t[0].split_sizes(&[1, b - 1], 1)?; Tensor::cat(&[s[1].clone(), s[0].clone()], 1) }, &[x.clone()], seed);
        gradcheck("cat", |t| Tensor::cat(&[t[0].clone(), t[1].clone()], 1), &[x.clone(), y.clone()], seed);
        gradcheck("stack", |t| Tensor::stack(&[t[0].narrow(1, 0, 2)?, t[1].clone()], 0), &[x.clone(), y], seed);
        gradcheck("expand", |t| t[0].unsqueeze(0)?.expand([2, a, b, c]), &[x.clone()], seed);
        gradcheck("squeeze_flatten", |t| t[0].unsqueeze(1)?.squeeze(1)?.flatten(0, 1), &[x.clone()], seed);
        gradcheck("to_dtype", |t| t[0].to_dtype(DType::F64)?.square(), &[x], seed);
    }

    #[test]
    fn norm_rope_embedding(seed in any::<u64>(), b in small_dim(), s in 1usize..5, h in 1usize..3, half in 1usize..4) {
        let mut rng = Rng::new(seed);
        let d = 2 * half;
        let x = randn(&[b, s, d], &mut rng);
        let w = randn(&[d], &mut rng);
        gradcheck("rms_norm", |t| t[0].rms_norm(&t[1], 1e-5), &[x, w], seed);
        let q = randn(&[b, h, s, d], &mut rng);
        let cos = Tensor::randn([s, d], DType::F64, &mut rng).unwrap();
        let sin = Tensor::randn([s, d], DType::F64, &mut rng).unwrap();
        gradcheck("rope_bhsd", |t| t[0].rope(&cos, &sin, RopeLayout::Bhsd), &[q.clone()], seed);
        gradcheck("rope_bhsd_then_bshd", |t| t[0].transpose(1, 2)?.rope(&cos, &sin, RopeLayout::Bshd), &[q], seed);
        let vocab = 5;
        let table = randn(&[vocab, d], &mut rng);
        let ids: Vec<i64> = (0..b * s).map(|_| rng.below(vocab as u64) as i64).collect();
        let ids = Tensor::from_vec(ids, [b, s]).unwrap();
        gradcheck("embedding", |t| Tensor::embedding(&ids, &t[0]), &[table], seed);
    }

    #[test]
    fn attention(seed in any::<u64>(), b in 1usize..3, kvh in 1usize..3, group in 1usize..3, sq in 1usize..5, sk in 1usize..5, d in 1usize..4, causal in any::<bool>(), use_mask in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let q = randn(&[b, kvh * group, sq, d], &mut rng);
        let k = randn(&[b, kvh, sk, d], &mut rng);
        let v = randn(&[b, kvh, sk, d + 1], &mut rng);
        let mask = if use_mask {
            // Key padding: the last key of batch 0 masked out, broadcast over heads and queries.
            let mut m = vec![0.0; b * sk];
            m[sk - 1] = f64::NEG_INFINITY;
            Some(Tensor::from_f64(&m, [b, 1, 1, sk], DType::F64).unwrap())
        } else {
            None
        };
        gradcheck("sdpa", |t| Tensor::scaled_dot_product_attention(&t[0], &t[1], &t[2], mask.as_ref(), causal, None), &[q, k, v], seed);
    }

    #[test]
    fn cross_entropy(seed in any::<u64>(), n in 1usize..6, vocab in 2usize..7, ignore_some in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let logits = randn(&[n, vocab], &mut rng);
        let t: Vec<i64> = (0..n).map(|i| if ignore_some && i % 2 == 1 { -100 } else { rng.below(vocab as u64) as i64 }).collect();
        let t = Tensor::from_vec(t, [n]).unwrap();
        gradcheck("cross_entropy", |x| x[0].cross_entropy(&t, -100), &[logits], seed);
    }
}

#[test]
fn fully_masked_query_rows_give_zero_output_and_gradient() {
    let mut rng = Rng::new(3);
    let q = randn(&[1, 2, 3, 4], &mut rng);
    let k = randn(&[1, 1, 3, 4], &mut rng);
    let v = randn(&[1, 1, 3, 4], &mut rng);
    // Query row 1 sees no key at all.
    let mut m = vec![0.0; 9];
    m[3..6].iter_mut().for_each(|x| *x = f64::NEG_INFINITY);
    let mask = Tensor::from_f64(&m, [1, 1, 3, 3], DType::F64).unwrap();
    let o = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), false, None).unwrap();
    let ov = o.to_vec_f64().unwrap();
    assert!(ov.iter().all(|x| x.is_finite()));
    for h in 0..2 {
        assert!(ov[(h * 3 + 1) * 4..(h * 3 + 2) * 4].iter().all(|&x| x == 0.0));
    }
    o.sum_all().unwrap().backward().unwrap();
    let gq = q.grad().unwrap().to_vec_f64().unwrap();
    assert!(gq.iter().all(|x| x.is_finite()));
    for h in 0..2 {
        assert!(gq[(h * 3 + 1) * 4..(h * 3 + 2) * 4].iter().all(|&x| x == 0.0));
    }
    gradcheck(
        "sdpa_masked_row",
        |t| Tensor::scaled_dot_product_attention(&t[0], &t[1], &t[2], Some(&mask), false, None),
        &[q, k, v],
        3,
    );
}

#[test]
fn gradients_accumulate_across_backward_calls() {
    let x = Tensor::from_vec(vec![1.0f64, 2.0], [2]).unwrap().requires_grad_(true);
    x.square().unwrap().sum_all().unwrap().backward().unwrap();
    x.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![4.0, 8.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    let y = no_grad(|| x.square().unwrap());
    assert!(!y.requires_grad());
    assert!(x.detach().square().unwrap().grad_fn_name().is_none());
}

#[test]
fn grad_mode_is_per_thread() {
    let x = Tensor::from_vec(vec![1.0f64, 2.0], [2]).unwrap().requires_grad_(true);
    no_grad(|| {
        assert!(!x.square().unwrap().requires_grad());
        // Another thread (another rank) still records while this one is in no_grad.
        let xs = x.clone();
        let recorded =
            std::thread::spawn(move || xs.square().unwrap().requires_grad()).join().unwrap();
        assert!(recorded);
    });
    assert!(x.square().unwrap().requires_grad());
}

#[test]
fn custom_function_backward_is_used() {
    use tpar_tensor::autograd::{apply, Function};
    /// y = x^3 with a hand-written backward.
    struct Cube {
        x: Option<Tensor>,
    }
    impl Function for Cube {
        fn name(&self) -> &'static str {
            "cube"
        }
        fn forward(&mut self, inputs: &[Tensor]) -> Result<Tensor> {
            self.x = Some(inputs[0].clone());
            inputs[0].pow_scalar(3.0)
        }
        fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
            let x = self.x.as_ref().expect("forward ran");
            Ok(vec![Some(g.mul(&x.square()?.mul_scalar(3.0)?)?)])
        }
    }
    let mut rng = Rng::new(5);
    let x = randn(&[2, 3], &mut rng);
    let y = apply(Cube { x: None }, &[&x]).unwrap();
    assert_eq!(y.grad_fn_name(), Some("cube"));
    gradcheck("custom", |t| apply(Cube { x: None }, &[&t[0]]), &[x.clone()], 5);
    // backward_with: a given output gradient.
    y.backward_with(&Tensor::full([2, 3], 2.0, DType::F64, tpar_tensor::Device::Cpu).unwrap())
        .unwrap();
    let want: Vec<f64> = x.to_vec_f64().unwrap().iter().map(|v| 6.0 * v * v).collect();
    tpar_tensor::tol::Tol::for_dtype(DType::F64)
        .check("backward_with", &x.grad().unwrap().to_vec_f64().unwrap(), &want)
        .unwrap();
}

#[test]
fn matmul_backward_with_empty_inner_or_output_dims() {
    // Uneven sharding produces local shapes with k = 0 or n = 0.
    for (k, n) in [(0usize, 3usize), (3, 0), (0, 0)] {
        let x = Tensor::zeros([2, 4, k], DType::F64, tpar_tensor::Device::Cpu)
            .unwrap()
            .requires_grad_(true);
        let w = Tensor::zeros([n, k], DType::F64, tpar_tensor::Device::Cpu)
            .unwrap()
            .requires_grad_(true);
        let y = x.linear(&w, None).unwrap();
        assert_eq!(y.dims(), &[2, 4, n]);
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(x.grad().unwrap().dims(), &[2, 4, k]);
        assert_eq!(w.grad().unwrap().dims(), &[n, k]);
    }
}

/// In f32 the fused SwiGLU product and its gradients have the bits of SiLU followed by a
/// multiply (the model's MLP switched to it without moving f32 numbers); mismatched
/// operands are typed errors.
#[test]
fn silu_mul_has_the_f32_bits_of_silu_then_mul() {
    let mut rng = Rng::new(5);
    // Large enough for the parallel path of the CPU kernels.
    for shape in [vec![3usize, 7], vec![64, 1100]] {
        let f32s = |rng: &mut Rng| randn(&shape, rng).to_dtype(DType::F32).unwrap().detach();
        let g = f32s(&mut rng).requires_grad_(true);
        let u = f32s(&mut rng).requires_grad_(true);
        let dy = f32s(&mut rng);
        let fused = g.silu_mul(&u).unwrap();
        fused.mul(&dy).unwrap().sum_all().unwrap().backward().unwrap();
        let (fg, fu) =
            (g.grad().unwrap().to_vec_f64().unwrap(), u.grad().unwrap().to_vec_f64().unwrap());
        g.zero_grad();
        u.zero_grad();
        let plain = g.silu().unwrap().mul(&u).unwrap();
        plain.mul(&dy).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(fused.to_vec_f64().unwrap(), plain.to_vec_f64().unwrap(), "{shape:?}: forward");
        assert_eq!(fg, g.grad().unwrap().to_vec_f64().unwrap(), "{shape:?}: gate gradient");
        assert_eq!(fu, u.grad().unwrap().to_vec_f64().unwrap(), "{shape:?}: up gradient");
    }
    let g = randn(&[2, 3], &mut rng);
    assert!(g.silu_mul(&randn(&[3], &mut rng)).is_err(), "broadcasting is refused");
    assert!(g.silu_mul(&g.to_dtype(DType::BF16).unwrap()).is_err(), "dtypes differ");
}
