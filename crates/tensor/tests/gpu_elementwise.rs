//! Elementwise, layout and reduction ops (and softmax, `full`) on the emulated
//! CUDA device against the same computation on the CPU: outputs, gradients
//! through backward, and no host round trip across the device forward and
//! backward.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Result, Rng, Shape, Tensor};

const DEV: Device = Device::Cuda(0);

fn setup() {
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
}

/// Tolerance relative to the largest reference magnitude, per dtype.
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2e-5,
        DType::BF16 => 3e-2,
        DType::F16 => 5e-3,
        _ => 0.0,
    }
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().filter(|v| v.is_finite()).fold(1e-12f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_finite() { (g - w).abs() <= tol * scale } else { g == w };
        assert!(ok, "{what}: element {i}: device {g} vs cpu {w} (tolerance {tol} of {scale})");
    }
}

type Op<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;

/// Runs `f` on CPU leaves, then on device copies of them (with a random
/// output gradient when `grad`), asserting equal outputs and leaf gradients
/// and that the device forward and backward made no host round trip.
fn check(what: &str, inputs: &[Tensor], f: Op<'_>, grad: bool) {
    let leaves: Vec<Tensor> =
        inputs.iter().map(|t| t.detach().requires_grad_(grad && t.dtype().is_float())).collect();
    let y = f(&leaves).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let mut rng = Rng::new(99);
    let gy = (grad && y.dtype().is_float())
        .then(|| Tensor::randn(y.shape().clone(), y.dtype(), &mut rng).unwrap());
    if let Some(gy) = &gy {
        y.mul(gy).unwrap().sum_all().unwrap().backward().unwrap();
    }
    let want: Vec<Option<Vec<f64>>> =
        leaves.iter().map(|l| l.grad().map(|g| g.to_vec_f64().unwrap())).collect();
    leaves.iter().for_each(|l| l.zero_grad());

    let before = gpu::host_round_trips();
    let on_dev: Vec<Tensor> = leaves.iter().map(|l| l.to_device(DEV).unwrap()).collect();
    let yd = f(&on_dev).unwrap_or_else(|e| panic!("{what}: device: {e}"));
    assert_eq!(yd.device(), DEV, "{what}: output left the device");
    if let Some(gy) = &gy {
        let gyd = gy.to_device(DEV).unwrap();
        yd.mul(&gyd).unwrap().sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(gpu::host_round_trips(), before, "{what}: host round trip on the device path");

    assert_eq!(yd.shape(), y.shape(), "{what}: shape");
    assert_eq!(yd.dtype(), y.dtype(), "{what}: dtype");
    let t = inputs.iter().map(|x| tol(x.dtype())).fold(tol(y.dtype()), f64::max);
    assert_close(&yd.to_vec_f64().unwrap(), &y.to_vec_f64().unwrap(), t, what);
    for (i, (l, w)) in leaves.iter().zip(want).enumerate() {
        match (l.grad(), w) {
            (Some(g), Some(w)) => {
                assert_eq!(g.device(), Device::Cpu);
                assert_close(&g.to_vec_f64().unwrap(), &w, t, &format!("{what}: grad {i}"));
            }
            (None, None) => {}
            (g, w) => panic!("{what}: grad {i}: device {:?} vs cpu {:?}", g.is_some(), w.is_some()),
        }
    }
}

fn randn(shape: &[usize], dtype: DType, rng: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), dtype, rng).unwrap()
}

/// Values in `[0.5, 2)` (for log, sqrt, pow and divisors).
fn positive(shape: &[usize], dtype: DType, rng: &mut Rng) -> Tensor {
    Tensor::rand_uniform(shape.to_vec(), 0.5, 2.0, dtype, rng).unwrap()
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[test]
fn binary_ops_broadcast_forward_and_backward() {
    setup();
    let mut rng = Rng::new(1);
    let shapes: [(&[usize], &[usize]); 6] = [
        (&[4, 5, 6], &[4, 5, 6]),
        (&[4, 1, 6], &[5, 6]),
        (&[3, 1], &[1, 7]),
        (&[2, 3, 4, 5], &[5]),
        (&[6], &[]),
        (&[2, 3, 1, 4, 1, 2, 3], &[3, 1, 1, 2, 1]),
    ];
    for dtype in FLOATS {
        for (sa, sb) in shapes {
            let a = randn(sa, dtype, &mut rng);
            let b = randn(sb, dtype, &mut rng);
            let (pa, pb) = (positive(sa, dtype, &mut rng), positive(sb, dtype, &mut rng));
            let w = format!("{dtype} {sa:?} {sb:?}");
            check(&format!("add {w}"), &[a.clone(), b.clone()], &|t| t[0].add(&t[1]), true);
            check(&format!("sub {w}"), &[a.clone(), b.clone()], &|t| t[0].sub(&t[1]), true);
            check(&format!("mul {w}"), &[a.clone(), b.clone()], &|t| t[0].mul(&t[1]), true);
            check(&format!("div {w}"), &[a.clone(), pb.clone()], &|t| t[0].div(&t[1]), true);
            check(&format!("pow {w}"), &[pa.clone(), b.clone()], &|t| t[0].pow(&t[1]), true);
            check(&format!("max {w}"), &[a.clone(), b.clone()], &|t| t[0].maximum(&t[1]), false);
            check(&format!("min {w}"), &[a.clone(), b.clone()], &|t| t[0].minimum(&t[1]), false);
        }
    }
}

#[test]
fn scalar_ops_forward_and_backward() {
    setup();
    let mut rng = Rng::new(2);
    for dtype in FLOATS {
        let x = randn(&[7, 9], dtype, &mut rng);
        let p = positive(&[7, 9], dtype, &mut rng);
        let one = |x: &Tensor| vec![x.clone()];
        check(&format!("add_scalar {dtype}"), &one(&x), &|t| t[0].add_scalar(1.5), true);
        check(&format!("mul_scalar {dtype}"), &one(&x), &|t| t[0].mul_scalar(-0.75), true);
        check(&format!("div_scalar {dtype}"), &one(&x), &|t| t[0].div_scalar(3.0), true);
        check(&format!("rsub_scalar {dtype}"), &one(&x), &|t| t[0].rsub_scalar(2.0), true);
        check(&format!("pow_scalar {dtype}"), &one(&p), &|t| t[0].pow_scalar(2.5), true);
        check(&format!("clamp_min {dtype}"), &one(&x), &|t| t[0].clamp_min(0.1), false);
    }
}

#[test]
fn unary_ops_forward_and_backward() {
    setup();
    let mut rng = Rng::new(3);
    type U = fn(&Tensor) -> Result<Tensor>;
    let any: [(&str, U); 8] = [
        ("neg", Tensor::neg),
        ("exp", Tensor::exp),
        ("silu", Tensor::silu),
        ("sigmoid", Tensor::sigmoid),
        ("square", Tensor::square),
        ("abs", Tensor::abs),
        ("relu", Tensor::relu),
        ("tanh", Tensor::tanh),
    ];
    let pos: [(&str, U); 4] = [
        ("log", Tensor::log),
        ("sqrt", Tensor::sqrt),
        ("rsqrt", Tensor::rsqrt),
        ("recip", Tensor::recip),
    ];
    for dtype in FLOATS {
        let x = randn(&[5, 33], dtype, &mut rng);
        let p = positive(&[5, 33], dtype, &mut rng);
        for (name, f) in any {
            check(&format!("{name} {dtype}"), std::slice::from_ref(&x), &|t| f(&t[0]), true);
        }
        for (name, f) in pos {
            check(&format!("{name} {dtype}"), std::slice::from_ref(&p), &|t| f(&t[0]), true);
        }
    }
}

/// The fused SwiGLU product on the device, forward and both gradients, as on the host,
/// at a vectorizable and a ragged last dim.
#[test]
fn silu_mul_forward_and_backward() {
    setup();
    let mut rng = Rng::new(31);
    for dtype in FLOATS {
        for shape in [[4usize, 3, 16], [2, 5, 13]] {
            let (g, u) = (randn(&shape, dtype, &mut rng), randn(&shape, dtype, &mut rng));
            let what = format!("silu_mul {dtype} {shape:?}");
            check(&what, &[g, u], &|t| t[0].silu_mul(&t[1]), true);
        }
    }
}

#[test]
fn casts_between_float_dtypes_and_from_ids() {
    setup();
    let mut rng = Rng::new(4);
    for from in FLOATS {
        for to in FLOATS {
            let x = randn(&[6, 11], from, &mut rng);
            let what = format!("to_dtype {from} -> {to}");
            // the output gradient is drawn in `to`; compare in the coarser dtype
            check(&what, &[x], &move |t| t[0].to_dtype(to)?.to_dtype(from), true);
        }
    }
    let ids = Tensor::from_vec((-20i64..40).collect::<Vec<_>>(), [6, 10]).unwrap();
    for to in FLOATS {
        check(
            &format!("i64 -> {to}"),
            std::slice::from_ref(&ids),
            &move |t| t[0].to_dtype(to),
            false,
        );
    }
}

#[test]
fn layout_ops_forward_and_backward() {
    setup();
    let mut rng = Rng::new(5);
    for dtype in FLOATS {
        let x = randn(&[3, 4, 5, 2], dtype, &mut rng);
        let x1 = |x: &Tensor| vec![x.clone()];
        check(&format!("transpose {dtype}"), &x1(&x), &|t| t[0].transpose(0, 2), true);
        check(&format!("transpose last {dtype}"), &x1(&x), &|t| t[0].transpose(-1, -2), true);
        check(&format!("permute {dtype}"), &x1(&x), &|t| t[0].permute(&[2, 0, 3, 1]), true);
        check(&format!("narrow {dtype}"), &x1(&x), &|t| t[0].narrow(1, 1, 2), true);
        check(&format!("narrow last {dtype}"), &x1(&x), &|t| t[0].narrow(-2, 3, 2), true);
        check(
            &format!("split {dtype}"),
            &x1(&x),
            &|t| {
                let p = t[0].split(2, 2)?;
                p[0].mul_scalar(2.0)?.add(&p[1])?.sub(&p[2].expand([3, 4, 2, 2])?)
            },
            true,
        );
        check(
            &format!("split_sizes with an empty piece {dtype}"),
            &x1(&x),
            &|t| {
                let p = t[0].split_sizes(&[1, 0, 2, 1], 1)?;
                Tensor::cat(&[p[3].clone(), p[2].clone(), p[1].clone(), p[0].clone()], 1)
            },
            true,
        );
        // 40 pieces: two launches of the batched copy.
        let long = randn(&[3, 40, 2], dtype, &mut rng);
        check(
            &format!("split into 40 {dtype}"),
            &x1(&long),
            &|t| {
                let mut p = t[0].split(1, 1)?;
                p.reverse();
                Tensor::cat(&p, 1)
            },
            true,
        );
        check(
            &format!("chunk {dtype}"),
            &x1(&x),
            &|t| {
                let p = t[0].chunk(2, 1)?;
                Tensor::cat(&[p[1].clone(), p[0].clone()], 3)
            },
            true,
        );
        let (a, b, c) = (
            randn(&[2, 3, 4], dtype, &mut rng),
            randn(&[2, 1, 4], dtype, &mut rng),
            randn(&[2, 5, 4], dtype, &mut rng),
        );
        check(&format!("cat {dtype}"), &[a.clone(), b, c], &|t| Tensor::cat(t, 1), true);
        check(
            &format!("stack {dtype}"),
            &[a.clone(), a.mul_scalar(0.5).unwrap()],
            &|t| Tensor::stack(t, 0),
            true,
        );
        let r = randn(&[1, 5], dtype, &mut rng);
        check(
            &format!("expand {dtype}"),
            std::slice::from_ref(&r),
            &|t| t[0].expand([4, 3, 5]),
            true,
        );
        check(
            &format!("expand mid {dtype}"),
            &[r],
            &|t| t[0].reshape([5, 1])?.expand([5, 6]),
            true,
        );
        check(&format!("deep_clone {dtype}"), &x1(&x), &|t| t[0].deep_clone(), true);
        check(&format!("view {dtype}"), &x1(&x), &|t| t[0].view(&[-1, 10])?.transpose(0, 1), true);
    }
    // i64 and f64 move as bits
    let ids = Tensor::from_vec((0i64..60).collect::<Vec<_>>(), [3, 4, 5]).unwrap();
    let xf = randn(&[3, 4, 5], DType::F64, &mut rng);
    for x in [ids, xf] {
        let d = x.dtype();
        check(
            &format!("transpose {d}"),
            std::slice::from_ref(&x),
            &|t| t[0].transpose(0, 2),
            false,
        );
        check(&format!("narrow {d}"), std::slice::from_ref(&x), &|t| t[0].narrow(2, 1, 3), false);
        check(&format!("cat {d}"), &[x.clone(), x.clone()], &|t| Tensor::cat(t, 1), false);
        check(
            &format!("expand {d}"),
            std::slice::from_ref(&x),
            &|t| t[0].expand([2, 3, 4, 5]),
            false,
        );
        check(&format!("deep_clone {d}"), std::slice::from_ref(&x), &|t| t[0].deep_clone(), false);
    }
}

#[test]
fn deep_clone_on_the_device_owns_its_data() {
    setup();
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3]).unwrap().to_device(DEV).unwrap();
    let c = x.deep_clone().unwrap();
    assert!(!c.same_storage(&x));
    x.copy_(&Tensor::from_vec(vec![0.0f32; 3], [3]).unwrap()).unwrap();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
}

#[test]
fn index_select_with_host_or_device_ids() {
    setup();
    let mut rng = Rng::new(6);
    let ids = Tensor::from_vec(vec![5i64, 0, 0, 3, 1], [5]).unwrap();
    let tables = [
        randn(&[6, 4, 3], DType::F32, &mut rng),
        randn(&[6, 7], DType::BF16, &mut rng),
        randn(&[6, 2], DType::F64, &mut rng),
        Tensor::from_vec((0i64..18).map(|v| v * 1_000_000_007).collect::<Vec<_>>(), [6, 3])
            .unwrap(),
        Tensor::from_vec((0i64..6).collect::<Vec<_>>(), [6]).unwrap(),
    ];
    for table in tables {
        let want = table.index_select0(&ids).unwrap().to_vec_f64().unwrap();
        let before = gpu::host_round_trips();
        let td = table.to_device(DEV).unwrap();
        let host_ids = td.index_select0(&ids).unwrap();
        let dev_ids = td.index_select0(&ids.to_device(DEV).unwrap()).unwrap();
        assert_eq!(gpu::host_round_trips(), before, "index_select {}", table.dtype());
        assert_eq!(host_ids.device(), DEV);
        assert_eq!(host_ids.to_vec_f64().unwrap(), want);
        assert_eq!(dev_ids.to_vec_f64().unwrap(), want);
    }
    let td = randn(&[6, 4], DType::F32, &mut rng).to_device(DEV).unwrap();
    for bad in [vec![1i64, 6, 2], vec![0, 0, -2]] {
        let ids = Tensor::from_vec(bad.clone(), [3]).unwrap();
        let want =
            format!("index {} at position", bad.iter().find(|&&v| !(0..6).contains(&v)).unwrap());
        for ids in [ids.clone(), ids.to_device(DEV).unwrap()] {
            let e = td.index_select0(&ids).unwrap_err().to_string();
            assert!(e.contains(&want), "{e}");
        }
    }
    let scalar = Tensor::scalar(1.0, DType::F32).to_device(DEV).unwrap();
    assert!(scalar.index_select0(&Tensor::from_vec(Vec::<i64>::new(), [0]).unwrap()).is_err());
}

#[test]
fn reductions_forward_and_backward() {
    setup();
    let mut rng = Rng::new(7);
    for dtype in FLOATS {
        let x = randn(&[4, 6, 5], dtype, &mut rng);
        let x1 = || vec![x.clone()];
        check(&format!("sum last {dtype}"), &x1(), &|t| t[0].sum(-1, false), true);
        check(&format!("sum mid keep {dtype}"), &x1(), &|t| t[0].sum(1, true), true);
        check(&format!("sum_dims 0,2 {dtype}"), &x1(), &|t| t[0].sum_dims(&[0, 2], false), true);
        check(&format!("sum_dims 0,1 {dtype}"), &x1(), &|t| t[0].sum_dims(&[1, 0], true), true);
        check(&format!("sum_all {dtype}"), &x1(), &|t| t[0].sum_all(), true);
        check(&format!("mean {dtype}"), &x1(), &|t| t[0].mean(0, false), true);
        check(&format!("mean_dims {dtype}"), &x1(), &|t| t[0].mean_dims(&[-1, -2], true), true);
        check(&format!("mean_all {dtype}"), &x1(), &|t| t[0].mean_all(), true);
        check(&format!("max last {dtype}"), &x1(), &|t| t[0].max(-1, false), true);
        check(&format!("max mid keep {dtype}"), &x1(), &|t| t[0].max(1, true), true);
        check(&format!("max first {dtype}"), &x1(), &|t| t[0].max(0, false), true);
        check(&format!("argmax {dtype}"), &x1(), &|t| t[0].argmax(1, false), false);
        check(&format!("sum of 0-dim {dtype}"), &x1(), &|t| t[0].sum_all()?.sum_all(), true);
    }
    // long reductions take the two-pass (workspace) path
    let long = randn(&[2, 40_000], DType::F32, &mut rng);
    check("sum long rows", std::slice::from_ref(&long), &|t| t[0].sum(-1, false), true);
    check("max long rows", &[long.narrow(1, 0, 2000).unwrap()], &|t| t[0].max(-1, false), true);
    let tall = randn(&[3, 700, 40], DType::F32, &mut rng);
    check("sum tall mid", &[tall], &|t| t[0].sum(1, false), true);
    // broadcast adjoint: sum_to
    let g = randn(&[4, 3, 5], DType::F32, &mut rng);
    check("sum_to", &[g], &|t| t[0].sum_to(&Shape::from(vec![3, 1])), true);
}

#[test]
fn softmax_and_log_softmax_forward_and_backward() {
    setup();
    let mut rng = Rng::new(8);
    for dtype in FLOATS {
        for shape in [&[6, 33][..], &[3, 1500], &[2, 5, 7]] {
            let x = randn(shape, dtype, &mut rng);
            let w = format!("{dtype} {shape:?}");
            check(&format!("softmax {w}"), std::slice::from_ref(&x), &|t| t[0].softmax(-1), true);
            check(
                &format!("log_softmax {w}"),
                std::slice::from_ref(&x),
                &|t| t[0].log_softmax(-1),
                true,
            );
            check(
                &format!("softmax dim 0 {w}"),
                std::slice::from_ref(&x),
                &|t| t[0].softmax(0),
                true,
            );
        }
    }
}

#[test]
fn full_fills_on_the_device() {
    setup();
    let cases = [
        (DType::F32, 1.25),
        (DType::F32, f64::NEG_INFINITY),
        (DType::BF16, -3.1),
        (DType::F16, 0.1),
        (DType::I64, 7.0),
        (DType::F64, 1e-300),
    ];
    for (dtype, v) in cases {
        for shape in [vec![3, 5], vec![0], vec![]] {
            let before = gpu::host_round_trips();
            let t = Tensor::full(shape.clone(), v, dtype, DEV).unwrap();
            assert_eq!(gpu::host_round_trips(), before);
            assert_eq!((t.device(), t.dtype(), t.dims()), (DEV, dtype, &shape[..]));
            let want = Tensor::full(shape.clone(), v, dtype, Device::Cpu).unwrap();
            assert_eq!(t.to_vec_f64().unwrap(), want.to_vec_f64().unwrap(), "{dtype} {v}");
        }
    }
}

#[test]
fn gradients_accumulate_on_device_leaves() {
    setup();
    let mut rng = Rng::new(9);
    let w0 = randn(&[4, 6], DType::F32, &mut rng);
    let w = w0.to_device(DEV).unwrap().requires_grad_(true);
    let before = gpu::host_round_trips();
    for _ in 0..2 {
        w.mul(&w).unwrap().add(&w).unwrap().sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(gpu::host_round_trips(), before);
    let g = w.grad().unwrap();
    assert_eq!(g.device(), DEV);
    let want: Vec<f64> = w0.to_vec_f64().unwrap().iter().map(|v| 2.0 * (2.0 * v + 1.0)).collect();
    assert_close(&g.to_vec_f64().unwrap(), &want, 1e-6, "accumulated grad");
}

#[test]
fn a_normalization_block_stays_on_the_device() {
    setup();
    let mut rng = Rng::new(10);
    for dtype in [DType::F32, DType::BF16] {
        let x = randn(&[4, 8, 16], dtype, &mut rng);
        let w = randn(&[16], dtype, &mut rng);
        let b = randn(&[16], dtype, &mut rng);
        let block = |t: &[Tensor]| {
            let x = &t[0];
            let xc = x.sub(&x.mean(-1, true)?)?;
            let var = xc.square()?.mean(-1, true)?;
            let y = xc.mul(&var.add_scalar(1e-5)?.rsqrt()?)?.mul(&t[1])?.add(&t[2])?;
            let p = y.transpose(0, 1)?.softmax(-1)?.add_scalar(1e-3)?.log()?;
            let q = p.narrow(2, 2, 9)?.silu()?.to_dtype(DType::F32)?;
            q.sum(1, false)?.max(0, false)
        };
        check(&format!("block {dtype}"), &[x, w, b], &block, true);
    }
}

#[test]
fn f64_and_rank_7_broadcasts_still_fall_back_through_the_host() {
    setup();
    let x = Tensor::from_vec(vec![1.0f64, 2.0], [2]).unwrap().to_device(DEV).unwrap();
    let before = gpu::host_round_trips();
    let y = x.add(&x).unwrap();
    assert_eq!(y.device(), DEV);
    assert!(gpu::host_round_trips() > before);
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![2.0, 4.0]);
    // a broadcast that merges to more dims than the kernels take
    let mut rng = Rng::new(11);
    let a = randn(&[2, 1, 2, 1, 2, 1, 2], DType::F32, &mut rng);
    let b = randn(&[1, 2, 1, 2, 1, 2, 1], DType::F32, &mut rng);
    let want = a.mul(&b).unwrap().to_vec_f64().unwrap();
    let (ad, bd) = (a.to_device(DEV).unwrap(), b.to_device(DEV).unwrap());
    let before = gpu::host_round_trips();
    let got = ad.mul(&bd).unwrap();
    assert!(gpu::host_round_trips() > before);
    assert_close(&got.to_vec_f64().unwrap(), &want, 1e-6, "rank-7 broadcast");
}
