//! `Tensor::swiglu` (SwiGLU of a packed gate/up tensor) against the halves split and
//! `Tensor::silu_mul`, bit for bit, forward and gradient: on the host (f64, f32) and on
//! the emulated CUDA device (f32, bf16, f16), where it reads the halves in place and its
//! backward writes one packed gradient: 4 kernels fewer per forward and backward (no
//! copies of the halves, no gathering of the halves' gradients into the packed one). After `linear_concat` (a
//! fused gate/up projection, as the Llama MLP runs it on a device) the input's and the
//! weights' gradients are those of `linear_many` then `silu_mul` to f32 rounding (one
//! product over both halves instead of two summed). Bad inputs are typed errors.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Rng, Tensor, TensorError};

const DEV: Device = Device::Cuda(9);
/// An ordinal of its own for the kernel counts, which only one test uses.
const COUNTED: usize = 10;

fn setup() {
    for ordinal in [9, COUNTED] {
        gpu::register_device(ordinal, EmulatedGpu::open(ordinal).expect("emulator"));
    }
}

mod common;
use common::bits;

/// The split then `silu_mul`.
fn split(x: &Tensor) -> Tensor {
    let half = x.dims()[x.rank() - 1] / 2;
    let p = x.split_sizes(&[half, half], -1).unwrap();
    p[0].silu_mul(&p[1]).unwrap()
}

fn packed(x: &Tensor) -> Tensor {
    x.swiglu().unwrap()
}

/// Output bits, gradient bits and the kernels run on [`COUNTED`] of `f` on `device`.
fn run(x: &Tensor, dy: &Tensor, device: Device, f: fn(&Tensor) -> Tensor) -> [Vec<u64>; 2] {
    let leaf = x.to_device(device).unwrap().detach().requires_grad_(true);
    let y = f(&leaf);
    assert_eq!(y.device(), device);
    y.backward_with(&dy.to_device(device).unwrap()).unwrap();
    [bits(&y), bits(&leaf.grad().expect("gradient"))]
}

const SHAPES: [&[usize]; 4] = [&[2, 5, 24], &[7, 2], &[1, 3, 130], &[2, 2, 3, 64]];

fn check(device: Device, dtype: DType, seed: u64) {
    let mut rng = Rng::new(seed);
    for dims in SHAPES {
        let x = Tensor::randn(dims, dtype, &mut rng).unwrap();
        let mut out = dims.to_vec();
        *out.last_mut().unwrap() /= 2;
        let dy = Tensor::randn(out.as_slice(), dtype, &mut rng).unwrap();
        let want = run(&x, &dy, device, split);
        let got = run(&x, &dy, device, packed);
        assert!(got[0] == want[0], "{dtype:?} on {device}, {dims:?}: output differs");
        assert!(got[1] == want[1], "{dtype:?} on {device}, {dims:?}: gradient differs");
    }
}

#[test]
fn host_equals_the_split() {
    check(Device::Cpu, DType::F64, 1);
    check(Device::Cpu, DType::F32, 2);
}

#[test]
fn device_equals_the_split() {
    setup();
    check(DEV, DType::F32, 3);
    check(DEV, DType::BF16, 4);
    check(DEV, DType::F16, 5);
    // no device kernels for f64: the split through the host
    check(DEV, DType::F64, 6);
}

#[test]
fn on_the_device_it_runs_4_kernels_fewer() {
    setup();
    let device = Device::Cuda(COUNTED);
    let kernels = || gpu::work_counts(COUNTED).map_or(0, |w| w.kernels_run);
    let mut rng = Rng::new(7);
    let x = Tensor::randn([4, 6, 32], DType::BF16, &mut rng).unwrap();
    let dy = Tensor::randn([4, 6, 16], DType::BF16, &mut rng).unwrap();
    let count = |f: fn(&Tensor) -> Tensor| {
        let before = kernels();
        run(&x, &dy, device, f);
        kernels() - before
    };
    let (n_split, n_packed) = (count(split), count(packed));
    assert_eq!(n_split - n_packed, 4, "kernels: split {n_split}, packed {n_packed}");
}

/// A fused gate/up projection: `linear_concat` then `swiglu` against `linear_many` then
/// `silu_mul`, on the emulated device in f32: the same output bits (one GEMM either
/// way), and gradients within f32 rounding (x's is one product over `2 i` columns
/// instead of two products summed).
#[test]
fn after_linear_concat_it_is_the_fused_mlp_input() {
    setup();
    let mut rng = Rng::new(8);
    let mut r =
        |dims: &[usize]| Tensor::randn(dims, DType::F32, &mut rng).unwrap().to_device(DEV).unwrap();
    let (x, wg, wu, dy) = (r(&[2, 9, 32]), r(&[24, 32]), r(&[24, 32]), r(&[2, 9, 24]));
    let leaves = || [&x, &wg, &wu].map(|t| t.detach().requires_grad_(true));
    let grads = |l: &[Tensor; 3]| l.each_ref().map(|t| t.grad().unwrap().to_vec_f64().unwrap());
    let a = leaves();
    let ya = a[0].linear_concat(&[a[1].clone(), a[2].clone()]).unwrap().swiglu().unwrap();
    ya.backward_with(&dy).unwrap();
    let b = leaves();
    let p = b[0].linear_many(&[b[1].clone(), b[2].clone()]).unwrap();
    let yb = p[0].silu_mul(&p[1]).unwrap();
    yb.backward_with(&dy).unwrap();
    assert_eq!(bits(&ya), bits(&yb), "output");
    for (n, (ga, gb)) in grads(&a).iter().zip(grads(&b).iter()).enumerate() {
        let scale = gb.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = ga.iter().zip(gb).fold(0f64, |m, (p, q)| m.max((p - q).abs()));
        assert!(err <= 1e-5 * scale, "gradient {n}: {err} against the scale {scale}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut rng = Rng::new(9);
    let odd = Tensor::randn([3, 5], DType::F32, &mut rng).unwrap();
    let e = odd.swiglu().unwrap_err();
    assert!(matches!(e, TensorError::InvalidArgument { .. }), "{e:?}");
    assert!(
        e.to_string().contains("gate and up halves") && e.to_string().contains("[3, 5]"),
        "{e}"
    );
    let ints = Tensor::from_vec(vec![1.0, 2.0], [2]).unwrap().to_dtype(DType::I64).unwrap();
    assert!(ints.swiglu().is_err(), "integer input accepted");
}
