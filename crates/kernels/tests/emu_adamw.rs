//! `cuda/adamw.cu` on the CPU emulator against `tpar_kernels::adamw`, over
//! several steps.

mod common;

use common::{assert_close, dtype, emu, f64s, mptr, ptr, tol, Rng};
use half::{bf16, f16};
use tpar_kernels::adamw::{adamw_step, AdamWParams};
use tpar_kernels::cuda::raw::adamw as k;
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::{Float, KernelError};

fn hyper(step: u64) -> AdamWParams {
    AdamWParams { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step }
}

/// Significant bits of a parameter dtype (f32 24, bf16 8, f16 11).
fn bits<T: Float>() -> i32 {
    match T::NAME {
        "bf16" => 8,
        "f16" => 11,
        _ => 24,
    }
}

/// Parameters after a step, GPU against CPU. Both compute in f32 and round once to `T`,
/// so half dtypes agree to one ulp of each element; for the parameters here (|p| < 1.1)
/// that is below one step's update (`lr` = 1e-2 per element on the first step), so a
/// skipped or repeated step fails, which a tolerance of 1e-2 times the largest element
/// would let pass. f32: [`tol`] as before.
fn assert_step_close<T: Float>(what: &str, got: &[f64], want: &[f64]) {
    if T::NAME == "f32" {
        return assert_close(what, got, want, tol::<T>());
    }
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let top = g.abs().max(w.abs()).max(f64::MIN_POSITIVE);
        let ulp = 2f64.powi(top.log2().floor() as i32 + 1 - bits::<T>());
        assert!(ulp < hyper(1).lr, "{what}[{i}]: an ulp at {top} hides a step");
        assert!((g - w).abs() <= ulp, "{what}[{i}]: got {g}, want {w} (one ulp {ulp})");
    }
}

/// Five GPU steps vs five CPU steps with the same gradients. `offset`
/// elements in front of every buffer make them unaligned (element path).
fn check_steps<T: Float<Acc = f32>>(seed: u64, n: usize, offset: usize) {
    let mut rng = Rng(seed);
    let p0: Vec<T> = rng.vec(offset + n, 1.0);
    let (mut cp, mut cm, mut cv) = (p0[offset..].to_vec(), vec![0f32; n], vec![0f32; n]);
    let prefix = f64s(&p0[..offset]);
    let (mut gp, mut gm, mut gv) = (p0, vec![0f32; offset + n], vec![0f32; offset + n]);
    let what = format!("adamw {} n {n} offset {offset}", T::NAME);
    for step in 1..=5 {
        let g: Vec<T> = rng.vec(offset + n, 0.5);
        adamw_step(&mut cp, &g[offset..], &mut cm, &mut cv, &hyper(step)).unwrap();
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe {
            k::adamw_step(
                emu(),
                dtype::<T>(),
                dtype::<T>(),
                mptr(&mut gp[offset..]),
                ptr(&g[offset..]),
                mptr(&mut gm[offset..]),
                mptr(&mut gv[offset..]),
                n,
                &hyper(step),
            )
            .unwrap();
        }
        let w = format!("{what} step {step}");
        assert_step_close::<T>(&format!("{w} param"), &f64s(&gp[offset..]), &f64s(&cp));
        assert_close(&format!("{w} exp_avg"), &f64s(&gm[offset..]), &f64s(&cm), 1e-5);
        assert_close(&format!("{w} exp_avg_sq"), &f64s(&gv[offset..]), &f64s(&cv), 1e-5);
    }
    assert_eq!(f64s(&gp[..offset]), prefix, "{what}: elements before the buffer");
}

#[test]
fn steps_match_cpu_f32() {
    check_steps::<f32>(1, 1003, 0);
    check_steps::<f32>(2, 37, 1);
}

#[test]
fn steps_match_cpu_bf16() {
    check_steps::<bf16>(3, 1003, 0);
    check_steps::<bf16>(4, 29, 3);
}

#[test]
fn steps_match_cpu_f16() {
    check_steps::<f16>(5, 517, 0);
}

/// Half parameters with f32 gradients: the CPU equivalent is an f32 step on
/// the widened parameters, rounded back after each step.
fn check_f32_grads<T: Float<Acc = f32>>(seed: u64, n: usize) {
    let mut rng = Rng(seed);
    let mut gp: Vec<T> = rng.vec(n, 1.0);
    let mut cp = gp.clone();
    let (mut cm, mut cv, mut gm, mut gv) =
        (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    for step in 1..=4 {
        let g: Vec<f32> = rng.vec(n, 0.5);
        let mut wide: Vec<f32> = cp.iter().map(|v| v.to_acc()).collect();
        adamw_step(&mut wide, &g, &mut cm, &mut cv, &hyper(step)).unwrap();
        cp = wide.iter().map(|&v| T::from_acc(v)).collect();
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe {
            k::adamw_step(
                emu(),
                dtype::<T>(),
                CudaDType::F32,
                mptr(&mut gp),
                ptr(&g),
                mptr(&mut gm),
                mptr(&mut gv),
                n,
                &hyper(step),
            )
            .unwrap();
        }
        let w = format!("adamw {} with f32 grads, step {step}", T::NAME);
        assert_step_close::<T>(&format!("{w} param"), &f64s(&gp), &f64s(&cp));
        assert_close(&format!("{w} exp_avg"), &f64s(&gm), &f64s(&cm), 1e-5);
        assert_close(&format!("{w} exp_avg_sq"), &f64s(&gv), &f64s(&cv), 1e-5);
    }
}

#[test]
fn half_params_with_f32_grads() {
    check_f32_grads::<bf16>(6, 301);
    check_f32_grads::<f16>(7, 64);
}

#[test]
fn bad_arguments_are_errors() {
    let mut p = vec![bf16::ZERO; 8];
    let g = vec![f16::ZERO; 8];
    let (mut m, mut v) = (vec![0f32; 8], vec![0f32; 8]);
    let (pp, mp, vp) = (mptr(&mut p), mptr(&mut m), mptr(&mut v));
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::adamw_step(emu(), CudaDType::BF16, CudaDType::F16, pp, ptr(&g), mp, vp, 8, &hyper(1))
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::adamw_step(emu(), CudaDType::BF16, CudaDType::BF16, pp, pp, mp, vp, 8, &hyper(0))
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::adamw_step(emu(), CudaDType::BF16, CudaDType::BF16, pp, pp, 0, vp, 8, &hyper(1))
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
}
