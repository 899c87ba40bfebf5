//! `Tensor::rope_bshd_to_bhsd` on the emulated CUDA device: bit for bit the
//! transpose then `rope` (outputs and gradients, f32 / bf16 / f16 on the
//! kernel's vector and element paths, f64 through the host), with one kernel
//! fewer each way; the same on the host; errors as `rope`'s.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Rng, RopeLayout, Tensor};

/// An ordinal of its own, so the kernel counts see only this file's work.
const ORDINAL: usize = 3;
const DEV: Device = Device::Cuda(ORDINAL);

fn setup() {
    gpu::register_device(ORDINAL, EmulatedGpu::open(ORDINAL).expect("emulator"));
}

/// The exact values of `t` (every float dtype widens to f64 exactly).
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Output and gradient of `x` (`[b, s, h, d]`, moved to `device` as a leaf) through
/// `f`, seeded with `gy`, and the kernels the device ran meanwhile.
fn run(
    x: &Tensor,
    gy: &Tensor,
    device: Device,
    f: impl Fn(&Tensor) -> Tensor,
) -> (Tensor, Tensor, u64) {
    let kernels = || gpu::work_counts(ORDINAL).map_or(0, |w| w.kernels_run);
    // a fresh leaf per run (on the host `to_device` hands back `x` itself)
    let leaf = x.to_device(device).unwrap().detach().requires_grad_(true);
    let gy = gy.to_device(device).unwrap();
    let before = kernels();
    let y = f(&leaf);
    y.backward_with(&gy).unwrap();
    let ran = kernels() - before;
    (y, leaf.grad().expect("gradient"), ran)
}

#[test]
fn one_pass_equals_transpose_then_rope() {
    setup();
    let mut rng = Rng::new(11);
    // (b, s, h, d): half a multiple of 8 (vector path), odd half (element path), one head
    let shapes = [[2, 5, 3, 16], [1, 3, 2, 6], [2, 4, 1, 16]];
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for dims in shapes {
            let (b, s, h, d) = (dims[0], dims[1], dims[2], dims[3]);
            let x = Tensor::randn(dims, dtype, &mut rng).unwrap();
            let gy = Tensor::randn([b, h, s, d], dtype, &mut rng).unwrap();
            let cos = Tensor::randn([s, d], dtype, &mut rng).unwrap();
            let sin = Tensor::randn([s, d], dtype, &mut rng).unwrap();
            for device in [DEV, Device::Cpu] {
                let (c, sn) = (cos.to_device(device).unwrap(), sin.to_device(device).unwrap());
                let what = format!("{dtype:?} {dims:?} on {device}");
                let (y0, g0, k0) = run(&x, &gy, device, |t| {
                    t.transpose(1, 2).unwrap().rope(&c, &sn, RopeLayout::Bhsd).unwrap()
                });
                let (y1, g1, k1) = run(&x, &gy, device, |t| t.rope_bshd_to_bhsd(&c, &sn).unwrap());
                assert_eq!(y1.dims(), [b, h, s, d], "{what}: output shape");
                assert_eq!(y1.device(), device, "{what}: output device");
                assert_eq!(g1.dims(), dims, "{what}: gradient shape");
                assert!(bits(&y1) == bits(&y0), "{what}: output differs");
                assert!(bits(&g1) == bits(&g0), "{what}: gradient differs");
                if device == DEV && dtype != DType::F64 {
                    // no transpose copy forward (permute) nor backward (its gradient)
                    assert_eq!((k1, k0), (2, 4), "{what}: kernels (one pass, transpose + rope)");
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    // another device: the other test counts the kernels on its own
    const DEV: Device = Device::Cuda(ORDINAL + 1);
    gpu::register_device(ORDINAL + 1, EmulatedGpu::open(ORDINAL + 1).expect("emulator"));
    let mut rng = Rng::new(12);
    let mut d =
        |dims: &[usize]| Tensor::randn(dims, DType::F32, &mut rng).unwrap().to_device(DEV).unwrap();
    let (x, three_d) = (d(&[1, 4, 2, 8]), d(&[4, 2, 8]));
    let (cos, short, odd) = (d(&[4, 8]), d(&[3, 8]), d(&[1, 3, 2, 7]));
    let odd_tab = d(&[3, 7]);
    assert!(three_d.rope_bshd_to_bhsd(&cos, &cos).is_err(), "3-d input");
    assert!(x.rope_bshd_to_bhsd(&short, &short).is_err(), "tables for 3 positions");
    assert!(odd.rope_bshd_to_bhsd(&odd_tab, &odd_tab).is_err(), "odd head dim");
    let host = Tensor::randn([4, 8], DType::F32, &mut rng).unwrap();
    assert!(x.rope_bshd_to_bhsd(&host, &host).is_err(), "tables on the host");
    assert!(x.rope_bshd_to_bhsd(&cos, &cos).is_ok());
}
