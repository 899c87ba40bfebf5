//! RMSNorm CUDA kernels, run in the CPU emulator, against the CPU kernels.

use crate::common;

use common::{emu, mptr, ptr};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::rmsnorm::{
    backward_workspace_bytes, rmsnorm_backward, rmsnorm_forward,
};
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::rmsnorm::{rmsnorm_backward as cpu_bwd, rmsnorm_forward as cpu_fwd};
use tpar_kernels::{Acc, Float};

/// Test data in [-1, 1) as f32.
fn data(n: usize, seed: u64) -> Vec<f32> {
    common::data(n, seed, 1.0).into_iter().map(|v| v as f32).collect()
}

fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs() / scale))
}

fn check<T: Float>(dtype: CudaDType, rows: usize, dim: usize, tol: f32) {
    check_at::<T>(dtype, rows, dim, tol, false)
}

/// `misalign`: x starts one element past a 16-byte boundary (the kernels then
/// read it an element at a time).
fn check_at<T: Float>(dtype: CudaDType, rows: usize, dim: usize, tol: f32, misalign: bool) {
    let emu = emu();
    let cvt = |v: Vec<f32>| -> Vec<T> { v.into_iter().map(|x| T::from_f64(x as f64)).collect() };
    let x = cvt(data(rows * dim, 1));
    let x_buf: Vec<T> =
        std::iter::repeat_n(T::default(), usize::from(misalign)).chain(x.iter().copied()).collect();
    let x_at = &x_buf[usize::from(misalign)..];
    assert!(!misalign || !ptr(x_at).is_multiple_of(16), "the misaligned case needs a misaligned x");
    let w = cvt(data(dim, 2).iter().map(|v| 1.0 + 0.5 * v).collect());
    let dy = cvt(data(rows * dim, 3));
    let eps = 1e-5;
    // CPU reference
    let mut y_ref = vec![T::default(); rows * dim];
    let mut rstd_ref = vec![<T::Acc as Default>::default(); rows];
    cpu_fwd(&x, &w, rows, dim, eps, &mut y_ref, &mut rstd_ref).unwrap();
    let mut dx_ref = vec![T::default(); rows * dim];
    let mut dw_ref = vec![<T::Acc as Default>::default(); dim];
    cpu_bwd(&x, &w, &rstd_ref, &dy, rows, dim, &mut dx_ref, &mut dw_ref).unwrap();
    // emulated
    let mut y = vec![T::default(); rows * dim];
    let mut rstd = vec![0f32; rows];
    let mut dx = vec![T::default(); rows * dim];
    let mut dw = vec![0f32; dim];
    let mut ws = vec![0f32; backward_workspace_bytes(rows, dim) / 4];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        rmsnorm_forward(
            emu,
            dtype,
            ptr(x_at),
            ptr(&w),
            mptr(&mut y),
            mptr(&mut rstd),
            rows,
            dim,
            eps as f32,
        )
        .unwrap();
        rmsnorm_backward(
            emu,
            dtype,
            ptr(x_at),
            ptr(&w),
            ptr(&rstd),
            ptr(&dy),
            mptr(&mut dx),
            mptr(&mut dw),
            mptr(&mut ws),
            rows,
            dim,
        )
        .unwrap();
    }
    let f = |v: &[T]| v.iter().map(|x| x.to_f64() as f32).collect::<Vec<_>>();
    let fa = |v: &[T::Acc]| v.iter().map(|x| x.f64() as f32).collect::<Vec<_>>();
    let what = format!("{dtype:?} rows {rows} dim {dim}");
    assert!(max_rel(&f(&y), &f(&y_ref)) <= tol, "y {what}: {}", max_rel(&f(&y), &f(&y_ref)));
    assert!(max_rel(&rstd, &fa(&rstd_ref)) <= 1e-5, "rstd {what}");
    assert!(max_rel(&f(&dx), &f(&dx_ref)) <= tol, "dx {what}: {}", max_rel(&f(&dx), &f(&dx_ref)));
    assert!(max_rel(&dw, &fa(&dw_ref)) <= 1e-4, "dw {what}: {}", max_rel(&dw, &fa(&dw_ref)));
}

#[test]
fn rmsnorm_matches_cpu() {
    // Rows of 16-byte vectors and of single elements; more rows than the
    // backward's blocks take in one pass (5000 x 8); the longest rows.
    for (rows, dim) in
        [(1, 1), (3, 37), (5, 128), (300, 64), (2, 1000), (2, 5000), (33, 1024), (5000, 8)]
    {
        check::<f32>(CudaDType::F32, rows, dim, 1e-5);
        check::<bf16>(CudaDType::BF16, rows, dim, 1e-2);
    }
    check::<f32>(CudaDType::F32, 2, 16384, 1e-5);
    check::<bf16>(CudaDType::BF16, 2, 16384, 1e-2);
    check::<bf16>(CudaDType::BF16, 2, 16383, 1e-2);
    check_at::<f32>(CudaDType::F32, 5, 128, 1e-5, true);
    check_at::<bf16>(CudaDType::BF16, 33, 1024, 1e-2, true);
    check::<f16>(CudaDType::F16, 7, 300, 2e-3);
}

#[test]
fn rmsnorm_rejects_bad_sizes() {
    let emu = emu();
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe { rmsnorm_forward(emu, CudaDType::F32, 0, 0, 0, 0, 4, 0, 1e-5) };
    assert!(r.is_err());
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe { rmsnorm_forward(emu, CudaDType::F32, 0, 0, 0, 0, 4, 1 << 20, 1e-5) };
    assert!(r.is_err());
}

#[test]
fn emulator_reports_launch_errors() {
    let emu = emu();
    let args =
        tpar_kernels::cuda::raw::rmsnorm::RmsnormDwArgs { partial: 0, dw: 0, nblk: 0, dim: 0 };
    // above the kernel's launch bounds
    let cfg = tpar_kernels::cuda::LaunchConfig::linear(1, 512);
    // SAFETY: the emulator refuses the launch (block size above the kernel's
    // launch bounds) before running anything (asserted below).
    let e = unsafe { tpar_kernels::cuda::launch(emu, "tpar_rmsnorm_dw_reduce", cfg, &args) };
    assert!(format!("{}", e.unwrap_err()).contains("launch bounds"));
    // unknown kernel
    // SAFETY: there is no such kernel, so nothing runs (asserted below).
    let e = unsafe { tpar_kernels::cuda::launch(emu, "tpar_no_such_kernel", cfg, &args) };
    assert!(e.is_err());
}
