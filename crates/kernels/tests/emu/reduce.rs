//! `cuda/reduce.cu` on the CPU emulator against the CPU reductions.

use crate::common;

use common::{assert_close, dtype, emu, f64s, mptr, ptr, tol, Rng};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::reduce as k;
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::reduce::{self as cpu, Reduction};
use tpar_kernels::{Float, KernelError};

/// GPU `reduce` (with `chunks`, or the default plan when `None`) vs the CPU kernel.
fn check_reduce<T: Float>(
    op: Reduction,
    x: &[T],
    outer: usize,
    len: usize,
    inner: usize,
    chunks: Option<usize>,
) {
    let mut want = vec![T::default(); outer * inner];
    cpu::reduce(op, x, outer, len, inner, &mut want).unwrap();
    let mut got = vec![T::default(); outer * inner];
    let ws_len = match chunks {
        Some(c) => outer * inner * c,
        None => k::reduce_workspace_len(outer, len, inner),
    };
    let mut ws = vec![0f32; ws_len];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        match chunks {
            Some(c) => k::reduce_chunked(
                emu(),
                op,
                dtype::<T>(),
                ptr(x),
                mptr(&mut got),
                outer,
                len,
                inner,
                c,
                mptr(&mut ws),
                ws.len(),
            ),
            None => k::reduce(
                emu(),
                op,
                dtype::<T>(),
                ptr(x),
                mptr(&mut got),
                outer,
                len,
                inner,
                mptr(&mut ws),
                ws.len(),
            ),
        }
        .unwrap();
    }
    let what = format!("{op:?} {} [{outer},{len},{inner}] chunks {chunks:?}", T::NAME);
    assert_close(&what, &f64s(&got), &f64s(&want), tol::<T>());
}

fn last_and_mid<T: Float>(seed: u64) {
    let mut rng = Rng(seed);
    // Offset by one element so rows start unaligned (exercises the scalar head).
    let buf: Vec<T> = rng.vec(1 + 7 * 1000, 3.0);
    let x = &buf[1..];
    let mid: Vec<T> = rng.vec(3 * 37 * 45, 3.0);
    for op in [Reduction::Sum, Reduction::Max, Reduction::Min] {
        check_reduce(op, x, 7, 1000, 1, Some(1));
        check_reduce(op, x, 7, 1000, 1, Some(5));
        check_reduce(op, &mid, 3, 37, 45, Some(1));
        check_reduce(op, &mid, 3, 37, 45, Some(4));
    }
}

#[test]
fn reduce_last_and_middle_dims_f32() {
    last_and_mid::<f32>(1);
}

#[test]
fn reduce_last_and_middle_dims_bf16() {
    last_and_mid::<bf16>(2);
}

#[test]
fn reduce_last_and_middle_dims_f16() {
    last_and_mid::<f16>(3);
}

#[test]
fn sum_of_all_elements_uses_two_passes() {
    let n = 20_001;
    assert!(k::reduce_workspace_len(1, n, 1) > 0, "a long sum should be split");
    let mut rng = Rng(4);
    let x: Vec<f32> = rng.vec(n, 1.0);
    check_reduce(Reduction::Sum, &x, 1, n, 1, None);
    let xb: Vec<bf16> = rng.vec(n, 1.0);
    check_reduce(Reduction::Sum, &xb, 1, n, 1, None);
    check_reduce(Reduction::Max, &xb, 1, n, 1, None);
    // Without workspace: one pass, same result within rounding.
    let mut want = [0f32];
    cpu::reduce(Reduction::Sum, &x, 1, n, 1, &mut want).unwrap();
    let mut got = [0f32];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::reduce(emu(), Reduction::Sum, CudaDType::F32, ptr(&x), mptr(&mut got), 1, n, 1, 0, 0)
            .unwrap()
    };
    assert_close("sum without workspace", &[got[0] as f64], &[want[0] as f64], 1e-5);
}

#[test]
fn max_and_min_propagate_nan_and_empty_dims_give_identities() {
    let mut x: Vec<f32> = Rng(5).vec(2 * 300, 1.0);
    x[417] = f32::NAN;
    for op in [Reduction::Max, Reduction::Min, Reduction::Sum] {
        check_reduce(op, &x, 2, 300, 1, Some(1));
        check_reduce(op, &x, 2, 300, 1, Some(3));
        check_reduce(op, &x, 2, 10, 30, Some(2));
    }
    for op in [Reduction::Sum, Reduction::Max, Reduction::Min] {
        check_reduce::<f32>(op, &[], 3, 0, 1, None);
        check_reduce::<f32>(op, &[], 3, 0, 5, None);
    }
}

#[test]
fn sum_squares_matches_f64() {
    fn run<T: Float>(seed: u64, chunks: usize) {
        let (rows, len) = (3, 5001);
        let x: Vec<T> = Rng(seed).vec(rows * len, 2.0);
        let want: Vec<f64> =
            x.chunks(len).map(|r| r.iter().map(|v| v.to_f64().powi(2)).sum()).collect();
        let mut got = vec![0f32; rows];
        let mut ws = vec![0f32; rows * chunks];
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe {
            k::sum_squares_chunked(
                emu(),
                dtype::<T>(),
                ptr(&x),
                rows,
                len,
                mptr(&mut got),
                chunks,
                mptr(&mut ws),
                ws.len(),
            )
            .unwrap();
        }
        let got: Vec<f64> = got.iter().map(|&v| v as f64).collect();
        assert_close(&format!("sum_squares {} chunks {chunks}", T::NAME), &got, &want, 1e-5);
    }
    run::<f32>(6, 1);
    run::<f32>(7, 3);
    run::<bf16>(8, 2);
    run::<f16>(9, 1);
    // The default plan, from one flat buffer.
    let x: Vec<bf16> = Rng(10).vec(30_000, 1.0);
    let want: f64 = x.iter().map(|v| v.to_f64().powi(2)).sum();
    let mut got = [0f32];
    let mut ws = vec![0f32; k::reduce_workspace_len(1, x.len(), 1)];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::sum_squares(
            emu(),
            CudaDType::BF16,
            ptr(&x),
            1,
            x.len(),
            mptr(&mut got),
            mptr(&mut ws),
            ws.len(),
        )
        .unwrap();
    }
    assert_close("sum_squares flat", &[got[0] as f64], &[want], 1e-5);
}

fn check_argmax<T: Float>(x: &[T], outer: usize, len: usize, inner: usize) {
    let (mut want, mut want_i) = (vec![T::default(); outer * inner], vec![0i64; outer * inner]);
    cpu::max_with_index(x, outer, len, inner, &mut want, &mut want_i).unwrap();
    let (mut got, mut got_i) = (vec![T::default(); outer * inner], vec![-1i64; outer * inner]);
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::max_with_index(
            emu(),
            dtype::<T>(),
            ptr(x),
            mptr(&mut got),
            mptr(&mut got_i),
            outer,
            len,
            inner,
        )
        .unwrap();
    }
    let what = format!("max_with_index {} [{outer},{len},{inner}]", T::NAME);
    assert_eq!(got_i, want_i, "{what}: indices");
    assert_close(&what, &f64s(&got), &f64s(&want), 0.0);
}

#[test]
fn max_with_index_first_max_and_first_nan() {
    let mut rng = Rng(11);
    // Coarse values so ties are common (the first index must win).
    let mut x: Vec<f32> = (0..5 * 333).map(|_| (rng.uniform() * 4.0).round() as f32).collect();
    x[2 * 333 + 100] = f32::NAN;
    x[2 * 333 + 200] = f32::NAN;
    for v in &mut x[4 * 333..] {
        *v = f32::NEG_INFINITY;
    }
    check_argmax(&x, 5, 333, 1);
    check_argmax(&x, 5, 9, 37);
    check_argmax(&x, 1, 5 * 333, 1);
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    check_argmax(&xb, 5, 333, 1);
    check_argmax(&xb, 3, 5, 111);
    let xh: Vec<f16> = rng.vec(4 * 77, 1.0);
    check_argmax(&xh, 4, 77, 1);
}

#[test]
fn bad_arguments_are_errors() {
    let x = vec![0f32; 64];
    let mut out = vec![0f32; 4];
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::reduce_chunked(
            emu(),
            Reduction::Sum,
            CudaDType::F32,
            ptr(&x),
            mptr(&mut out),
            4,
            16,
            1,
            4,
            0,
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::reduce(emu(), Reduction::Sum, CudaDType::F32, 0, mptr(&mut out), 4, 16, 1, 0, 0)
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::reduce(
            emu(),
            Reduction::Sum,
            CudaDType::F32,
            ptr(&x),
            mptr(&mut out),
            1,
            1 << 31,
            1,
            0,
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    let mut idx = vec![0i64; 4];
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::max_with_index(emu(), CudaDType::F32, ptr(&x), mptr(&mut out), mptr(&mut idx), 4, 0, 1)
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    let unaligned = ptr(&x) + 2;
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::reduce(emu(), Reduction::Sum, CudaDType::F32, unaligned, mptr(&mut out), 4, 15, 1, 0, 0)
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
}
