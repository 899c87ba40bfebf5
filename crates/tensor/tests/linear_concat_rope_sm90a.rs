//! `Tensor::linear_concat_rope` then `Tensor::attention_packed_rotated` on the CPU
//! emulator standing in for an `sm_90a` device (`TPAR_EMU_ARCH=sm_90a`,
//! `TPAR_SDPA=hopper`, set for this whole test binary): the Hopper GEMM rotates q and k
//! in its epilogue (no RoPE launch in the forward), the Hopper attention kernels read q,
//! k and v in the packed projection's columns and write dq, dk and dv into its gradient's.
//! In bf16 the output and the gradients of the input and every weight are as close to
//! an f64 reference of the same inputs as those of `linear_concat` then
//! `attention_packed` (rotated inside attention), and the pair runs 4 kernels fewer per
//! forward and backward.

use std::sync::Once;

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Rng, Tensor};

const ORDINAL: usize = 8;
const DEV: Device = Device::Cuda(ORDINAL);

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Before the first launch of this process; every test of this binary runs so.
        std::env::set_var("TPAR_EMU_ARCH", "sm_90a");
        std::env::set_var("TPAR_SDPA", "hopper");
        gpu::register_device(ORDINAL, EmulatedGpu::open(ORDINAL).expect("emulator"));
    });
}

/// Batch, positions, hidden width, q heads, kv heads, head dim (the Hopper kernels take
/// 64 and 128).
const B: usize = 2;
const S: usize = 80;
const HIDDEN: usize = 64;
const HQ: usize = 2;
const HKV: usize = 1;
const HD: usize = 64;

type Block = fn(&Tensor, &[Tensor], &Tensor, &Tensor) -> Tensor;

fn unrotated(x: &Tensor, w: &[Tensor], cos: &Tensor, sin: &Tensor) -> Tensor {
    let qkv = x.linear_concat(w).unwrap();
    Tensor::attention_packed(&qkv, HQ, HKV, cos, sin, None, true).unwrap()
}

fn rotated(x: &Tensor, w: &[Tensor], cos: &Tensor, sin: &Tensor) -> Tensor {
    let qkv = x.linear_concat_rope(w, 2, cos, sin).unwrap();
    Tensor::attention_packed_rotated(&qkv, HQ, HKV, None, true).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap()
}

/// The output and the gradients of x and each weight of `f` on `device` in `dtype`, and
/// the kernels the device ran.
fn run(host: &[Tensor; 7], device: Device, dtype: DType, f: Block) -> (Vec<Vec<f64>>, u64) {
    let kernels = || gpu::work_counts(ORDINAL).map_or(0, |w| w.kernels_run);
    let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(device).unwrap();
    let leaf = |t: &Tensor| on(t).detach().requires_grad_(true);
    let (x, w) = (leaf(&host[0]), [leaf(&host[1]), leaf(&host[2]), leaf(&host[3])]);
    let (cos, sin, dout) = (on(&host[4]), on(&host[5]), on(&host[6]));
    let before = kernels();
    let y = f(&x, &w, &cos, &sin);
    y.backward_with(&dout).unwrap();
    let ran = kernels() - before;
    let mut out = vec![values(&y)];
    out.extend([&x, &w[0], &w[1], &w[2]].map(|l| values(&l.grad().expect("gradient"))));
    (out, ran)
}

/// The largest difference from `want` over the largest magnitude of `want`.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = got.iter().zip(want).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    err / scale.max(f64::MIN_POSITIVE)
}

#[test]
fn the_hopper_kernels_rotate_in_the_gemm_and_write_the_packed_gradient() {
    setup();
    let mut rng = Rng::new(11);
    // bf16-representable inputs, so the f64 reference sees what the device sees
    let mut r = |dims: &[usize], scale: f64| {
        let t = Tensor::randn(dims, DType::F64, &mut rng).unwrap();
        let t = t.mul_scalar(scale).unwrap();
        t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F64).unwrap()
    };
    let host = [
        r(&[B, S, HIDDEN], 1.0),
        r(&[HQ * HD, HIDDEN], 0.125),
        r(&[HKV * HD, HIDDEN], 0.125),
        r(&[HKV * HD, HIDDEN], 0.125),
        r(&[S + 3, HD], 1.0),
        r(&[S + 3, HD], 1.0),
        r(&[B, S, HQ * HD], 1.0),
    ];
    let (want, _) = run(&host, Device::Cpu, DType::F64, unrotated);
    let (old, n_old) = run(&host, DEV, DType::BF16, unrotated);
    let (new, n_new) = run(&host, DEV, DType::BF16, rotated);
    let names = ["output", "x's gradient", "wq's gradient", "wk's gradient", "wv's gradient"];
    for (i, name) in names.iter().enumerate() {
        let (e_old, e_new) = (relative_error(&old[i], &want[i]), relative_error(&new[i], &want[i]));
        eprintln!("{name}: rotated by the projection {e_new:.2e}, inside attention {e_old:.2e}");
        // bf16 rounding of the operands and of the products: a few units of 2^-8
        assert!(e_new <= 2e-2, "{name}: {e_new:.2e} from the f64 reference");
        assert!(e_new <= 2.0 * e_old + 4e-3, "{name}: {e_new:.2e} against {e_old:.2e}");
    }
    // the forward's 2 RoPE launches are in the GEMM; the backward runs 1 rotation back
    // and 1 copy instead of 2 rotations again and 2 back
    assert_eq!(n_old - n_new, 4, "kernels: inside attention {n_old}, by the projection {n_new}");
}
