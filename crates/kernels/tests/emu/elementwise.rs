//! The elementwise CUDA kernels (`cuda/elementwise.cu`) on the CPU emulator,
//! against the CPU kernels: unary ops and their gradients, scalar and binary
//! ops (flat and broadcast), SwiGLU, fill, casts, accumulation, softmax.
//!
//! Sizes are odd so the element-wise tails run, and every op also runs on
//! addresses shifted by one element so the non-vector paths run.

use crate::common;

use common::{assert_close_t as assert_close, dtype, emu, tol, Buf, Rng};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::elementwise as ew;
use tpar_kernels::cuda::{CudaDType, Launcher};
use tpar_kernels::elementwise::{self as cpu, BinaryOp, UnaryOp};
use tpar_kernels::{softmax, Float};

// ---------------------------------------------------------------- helpers

/// Inputs in the op's domain.
fn unary_input<T: Float>(rng: &mut Rng, op: UnaryOp, n: usize) -> Vec<T> {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => rng.vec_in(n, 0.25, 3.0),
        _ => rng.vec_in(n, -4.0, 4.0),
    }
}

// ---------------------------------------------------------------- unary

fn check_unary<T: Float>(seed: u64) {
    let l: &dyn Launcher = emu();
    let mut rng = Rng(seed);
    let n = 1003;
    for op in UnaryOp::ALL {
        let x: Vec<T> = unary_input(&mut rng, op, n);
        let mut want = vec![T::default(); n];
        cpu::unary(op, &x, &mut want).unwrap();
        let dy: Vec<T> = rng.vec_in(n, -1.0, 1.0);
        let mut dwant = vec![T::default(); n];
        cpu::unary_backward(op, &x, &want, &dy, &mut dwant).unwrap();
        for shift in [0, 1] {
            let mut bx = Buf::new(&x, shift);
            let mut by = Buf::<T>::zeros(n, shift);
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { ew::unary(l, dtype::<T>(), op, bx.ptr(), by.ptr(), n) }.unwrap();
            assert_close(&format!("{op:?} shift {shift}"), &by.get(), &want, tol::<T>());

            let mut by = Buf::new(&want, shift);
            let mut bg = Buf::new(&dy, shift);
            let mut bdx = Buf::<T>::zeros(n, shift);
            let (px, py, pg, pdx) = (bx.ptr(), by.ptr(), bg.ptr(), bdx.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { ew::unary_backward(l, dtype::<T>(), op, px, py, pg, pdx, n) }.unwrap();
            assert_close(&format!("{op:?} backward shift {shift}"), &bdx.get(), &dwant, tol::<T>());
        }
    }
}

#[test]
fn unary_ops_match_cpu() {
    check_unary::<f32>(1);
    check_unary::<bf16>(2);
    check_unary::<f16>(3);
}

#[test]
fn unary_in_place() {
    let l: &dyn Launcher = emu();
    let x: Vec<bf16> = Rng(4).vec_in(77, -3.0, 3.0);
    let mut want = vec![bf16::ZERO; 77];
    cpu::unary(UnaryOp::Silu, &x, &mut want).unwrap();
    let mut b = Buf::new(&x, 0);
    let p = b.ptr();
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { ew::unary(l, CudaDType::BF16, UnaryOp::Silu, p, p, 77) }.unwrap();
    assert_close("silu in place", &b.get(), &want, 1e-2);
}

// ---------------------------------------------------------------- scalar and binary

fn check_scalar<T: Float>(seed: u64) {
    let l: &dyn Launcher = emu();
    let mut rng = Rng(seed);
    let n = 517;
    let cases: [(BinaryOp, f64, bool, f64, f64); 10] = [
        (BinaryOp::Add, 1.5, false, -2.0, 2.0),
        (BinaryOp::Sub, 0.75, true, -2.0, 2.0),
        (BinaryOp::Mul, -0.125, false, -2.0, 2.0),
        (BinaryOp::Div, 3.0, false, -2.0, 2.0),
        (BinaryOp::Div, 2.0, true, 0.5, 2.0),
        (BinaryOp::Max, 0.0, false, -2.0, 2.0),
        (BinaryOp::Min, 0.25, false, -2.0, 2.0),
        (BinaryOp::Pow, 3.0, false, -2.0, 2.0),
        (BinaryOp::Pow, -1.5, false, 0.5, 2.0),
        (BinaryOp::Pow, 0.5, false, 0.0, 3.0),
    ];
    for (op, s, first, lo, hi) in cases {
        let x: Vec<T> = rng.vec_in(n, lo, hi);
        let mut want = vec![T::default(); n];
        cpu::scalar(op, &x, s, first, &mut want).unwrap();
        for shift in [0, 1] {
            let mut bx = Buf::new(&x, shift);
            let mut by = Buf::<T>::zeros(n, shift);
            let (px, py) = (bx.ptr(), by.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { ew::scalar(l, dtype::<T>(), op, px, s, first, py, n) }.unwrap();
            let what = format!("{op:?} scalar {s} first={first} shift {shift}");
            assert_close(&what, &by.get(), &want, tol::<T>());
        }
    }
}

#[test]
fn scalar_ops_match_cpu() {
    check_scalar::<f32>(5);
    check_scalar::<bf16>(6);
}

/// Runs the GPU and CPU binary op on the same strided operands.
fn run_binary<T: Float>(
    op: BinaryOp,
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    shape: &[usize],
    shift: usize,
    what: &str,
) {
    let l: &dyn Launcher = emu();
    let n: usize = shape.iter().product();
    let mut want = vec![T::default(); n];
    cpu::binary(op, a, sa, b, sb, shape, &mut want).unwrap();
    let mut ba = Buf::new(a, shift);
    let mut bb = Buf::new(b, 0);
    let mut bo = Buf::<T>::zeros(n, 0);
    let (pa, pb, po) = (ba.ptr(), bb.ptr(), bo.ptr());
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { ew::binary(l, dtype::<T>(), op, pa, sa, pb, sb, shape, po) }.unwrap();
    assert_close(&format!("{what} {op:?} shift {shift}"), &bo.get(), &want, tol::<T>());
}

fn check_binary<T: Float>(seed: u64) {
    let mut rng = Rng(seed);
    for op in BinaryOp::ALL {
        let lo = if op == BinaryOp::Pow { 0.3 } else { -3.0 };
        // same shape (flat kernel)
        let n = 1001;
        let a: Vec<T> = rng.vec_in(n, lo, 3.0);
        let b: Vec<T> = rng.vec_in(n, 0.5, 2.0);
        for shift in [0, 1] {
            run_binary(op, &a, &[1], &b, &[1], &[n], shift, "same shape");
        }
        // a row vector over the rows of a matrix, vector-path size and odd size
        for (rows, cols) in [(9, 48), (7, 37)] {
            let a: Vec<T> = rng.vec_in(rows * cols, lo, 3.0);
            let b: Vec<T> = rng.vec_in(cols, 0.5, 2.0);
            for shift in [0, 1] {
                run_binary(op, &a, &[cols, 1], &b, &[0, 1], &[rows, cols], shift, "row bcast");
                // and the vector on the left
                run_binary(op, &b, &[0, 1], &a, &[cols, 1], &[rows, cols], 0, "row bcast (left)");
            }
            // a column (per-row scalar) over the columns
            let c: Vec<T> = rng.vec_in(rows, 0.5, 2.0);
            run_binary(op, &a, &[cols, 1], &c, &[1, 0], &[rows, cols], 0, "column bcast");
        }
    }
    // a general broadcast: [2, 1, 3] with [4, 1] -> [2, 4, 3]
    let a: Vec<T> = rng.vec_in(6, -1.0, 1.0);
    let b: Vec<T> = rng.vec_in(4, -1.0, 1.0);
    run_binary(BinaryOp::Add, &a, &[3, 0, 1], &b, &[0, 1, 0], &[2, 4, 3], 0, "3-d bcast");
    // a transposed operand: out[i][j] = a[j][i] * b[i][j]
    let a: Vec<T> = rng.vec_in(5 * 11, -1.0, 1.0);
    let b: Vec<T> = rng.vec_in(11 * 5, -1.0, 1.0);
    run_binary(BinaryOp::Mul, &a, &[1, 11], &b, &[5, 1], &[11, 5], 0, "transposed operand");
    // 4-d attention-mask style broadcast [b, 1, s, s] over heads
    let (bs, h, s) = (2, 3, 16);
    let x: Vec<T> = rng.vec_in(bs * h * s * s, -1.0, 1.0);
    let m: Vec<T> = rng.vec_in(bs * s * s, -1.0, 1.0);
    let sx = [h * s * s, s * s, s, 1];
    let sm = [s * s, 0, s, 1];
    run_binary(BinaryOp::Add, &x, &sx, &m, &sm, &[bs, h, s, s], 0, "mask bcast");
}

#[test]
fn binary_ops_match_cpu() {
    check_binary::<f32>(7);
    check_binary::<bf16>(8);
}

#[test]
fn binary_f16_broadcast() {
    let mut rng = Rng(9);
    let a: Vec<f16> = rng.vec_in(6 * 40, -2.0, 2.0);
    let b: Vec<f16> = rng.vec_in(40, -2.0, 2.0);
    run_binary(BinaryOp::Mul, &a, &[40, 1], &b, &[0, 1], &[6, 40], 0, "f16 row bcast");
    run_binary(BinaryOp::Sub, &a, &[1], &a, &[1], &[240], 1, "f16 same shape");
}

// ---------------------------------------------------------------- SwiGLU

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn check_swiglu<T: Float>(seed: u64) {
    let l: &dyn Launcher = emu();
    let dt = dtype::<T>();
    let mut rng = Rng(seed);
    // (rows, cols, ld): separate contiguous tensors (odd and vector sizes),
    // and the two halves of one fused projection
    for (rows, cols, ld) in [(5, 37, 37), (4, 48, 48), (3, 40, 80), (3, 19, 38)] {
        let ab: Vec<T> = rng.vec_in(rows * ld + cols, -4.0, 4.0);
        let (a, b) = if ld == cols {
            (ab[..rows * cols].to_vec(), rng.vec_in::<T>(rows * cols, -2.0, 2.0))
        } else {
            (ab.clone(), ab[cols..].to_vec())
        };
        let dy: Vec<T> = rng.vec_in(rows * cols, -1.0, 1.0);
        let at = |v: &[T], r: usize, c: usize| v[r * ld + c].to_f64();
        let mut y_want = vec![T::default(); rows * cols];
        let mut da_want = vec![T::default(); a.len()];
        let mut db_want = vec![T::default(); b.len()];
        for r in 0..rows {
            for c in 0..cols {
                let (x, u, g) = (at(&a, r, c), at(&b, r, c), dy[r * cols + c].to_f64());
                let s = 1.0 / (1.0 + (-x).exp());
                y_want[r * cols + c] = T::from_f64(silu(x) * u);
                da_want[r * ld + c] = T::from_f64(g * u * s * (1.0 + x * (1.0 - s)));
                db_want[r * ld + c] = T::from_f64(g * silu(x));
            }
        }
        for shift in [0, 1] {
            let mut ba = Buf::new(&a, shift);
            let mut bb = Buf::new(&b, shift);
            let mut by = Buf::<T>::zeros(rows * cols, shift);
            let (pa, pb, py) = (ba.ptr(), bb.ptr(), by.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { ew::swiglu_forward(l, dt, pa, pb, ld, py, rows, cols) }.unwrap();
            let what = format!("swiglu {rows}x{cols} ld {ld} shift {shift}");
            assert_close(&format!("{what} y"), &by.get(), &y_want, tol::<T>());

            let mut bg = Buf::new(&dy, shift);
            let mut bda = Buf::<T>::zeros(a.len(), shift);
            let mut bdb = Buf::<T>::zeros(b.len(), shift);
            let (pg, pda, pdb) = (bg.ptr(), bda.ptr(), bdb.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { ew::swiglu_backward(l, dt, pa, pb, ld, pg, pda, pdb, rows, cols) }.unwrap();
            // only the elements inside the [rows, cols] window are written
            let window = |v: Vec<T>| -> Vec<T> {
                (0..rows).flat_map(|r| v[r * ld..r * ld + cols].to_vec()).collect()
            };
            let (ga, wa) = (window(bda.get()), window(da_want.clone()));
            assert_close(&format!("{what} da"), &ga, &wa, tol::<T>());
            let (gb, wb) = (window(bdb.get()), window(db_want.clone()));
            assert_close(&format!("{what} db"), &gb, &wb, tol::<T>());
        }
    }
}

#[test]
fn swiglu_matches_reference() {
    check_swiglu::<f32>(10);
    check_swiglu::<bf16>(11);
    check_swiglu::<f16>(12);
}

// ---------------------------------------------------------------- fill, cast, accumulate

#[test]
fn fill_writes_every_element() {
    let l: &dyn Launcher = emu();
    for shift in [0, 1] {
        let mut b = Buf::new(&[bf16::ONE; 301], shift);
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { ew::fill(l, CudaDType::BF16, b.ptr(), 300, -2.5) }.unwrap();
        let got = b.get();
        assert!(got[..300].iter().all(|&v| v == bf16::from_f32(-2.5)), "fill shift {shift}");
        assert_eq!(got[300], bf16::ONE, "fill wrote past its end");
        let mut f = Buf::new(&[1.0f32; 45], shift);
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { ew::fill(l, CudaDType::F32, f.ptr(), 45, 0.1) }.unwrap();
        assert!(f.get().iter().all(|&v| v == 0.1f32));
    }
}

fn check_cast<S: Float, D: Float>(rng: &mut Rng) {
    let l: &dyn Launcher = emu();
    let n = 533;
    let mut x: Vec<S> = rng.vec_in(n, -300.0, 300.0);
    x[0] = S::from_f64(f64::INFINITY);
    x[1] = S::from_f64(f64::NEG_INFINITY);
    x[2] = S::from_f64(1e-3);
    let mut want = vec![D::default(); n];
    cpu::cast(&x, &mut want).unwrap();
    for shift in [0, 1] {
        let mut bx = Buf::new(&x, shift);
        let mut by = Buf::<D>::zeros(n, 0);
        let (px, py) = (bx.ptr(), by.ptr());
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { ew::cast(l, dtype::<S>(), px, dtype::<D>(), py, n) }.unwrap();
        let got = by.get();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_f64(), w.to_f64(), "cast {} -> {} [{i}]", S::NAME, D::NAME);
        }
    }
}

#[test]
fn casts_round_like_cpu() {
    let mut rng = Rng(13);
    check_cast::<f32, bf16>(&mut rng);
    check_cast::<f32, f16>(&mut rng);
    check_cast::<bf16, f32>(&mut rng);
    check_cast::<f16, f32>(&mut rng);
    check_cast::<bf16, f16>(&mut rng);
    check_cast::<f16, bf16>(&mut rng);
    check_cast::<f32, f32>(&mut rng);
}

#[test]
fn cast_from_i64() {
    let l: &dyn Launcher = emu();
    let x: Vec<i64> = (0..203).map(|i| (i * 7919) % 100_003 - 50_000).collect();
    for shift in [0, 1] {
        let mut bx = Buf::new(&x, shift);
        let mut bf = Buf::<f32>::zeros(203, 0);
        let mut bb = Buf::<bf16>::zeros(203, 0);
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { ew::cast_i64(l, bx.ptr(), CudaDType::F32, bf.ptr(), 203) }.unwrap();
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { ew::cast_i64(l, bx.ptr(), CudaDType::BF16, bb.ptr(), 203) }.unwrap();
        for i in 0..203 {
            assert_eq!(bf.get()[i], x[i] as f32, "i64 -> f32 [{i}]");
            assert_eq!(bb.get()[i], bf16::from_f64(x[i] as f64), "i64 -> bf16 [{i}]");
        }
    }
}

fn check_accumulate<S: Float, D: Float>(rng: &mut Rng, alpha: f32) {
    let l: &dyn Launcher = emu();
    let n = 389;
    let src: Vec<S> = rng.vec_in(n, -2.0, 2.0);
    let dst: Vec<D> = rng.vec_in(n, -2.0, 2.0);
    let want: Vec<D> = src
        .iter()
        .zip(&dst)
        .map(|(s, d)| D::from_f64((d.to_f64() as f32 + alpha * s.to_f64() as f32) as f64))
        .collect();
    for shift in [0, 1] {
        let mut bs = Buf::new(&src, shift);
        let mut bd = Buf::new(&dst, shift);
        let (ps, pd) = (bs.ptr(), bd.ptr());
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { ew::accumulate(l, dtype::<S>(), ps, dtype::<D>(), pd, n, alpha) }.unwrap();
        let what = format!("accumulate {} into {} shift {shift}", S::NAME, D::NAME);
        assert_close(&what, &bd.get(), &want, tol::<D>());
    }
}

#[test]
fn accumulate_matches_reference() {
    let mut rng = Rng(14);
    check_accumulate::<f32, f32>(&mut rng, 1.0);
    check_accumulate::<bf16, f32>(&mut rng, 1.0);
    check_accumulate::<bf16, bf16>(&mut rng, 0.5);
    check_accumulate::<f16, bf16>(&mut rng, -2.0);
    check_accumulate::<f32, f16>(&mut rng, 1.0);
}

// ---------------------------------------------------------------- softmax

fn check_softmax<T: Float>(seed: u64) {
    let l: &dyn Launcher = emu();
    let dt = dtype::<T>();
    let mut rng = Rng(seed);
    // warp kernels (<= 1024 columns) and block kernels, vector and odd sizes
    for (rows, cols) in [(7, 33), (5, 256), (3, 1000), (2, 1500), (3, 2048), (1, 1)] {
        for log in [false, true] {
            let mut x: Vec<T> = rng.vec_in(rows * cols, -8.0, 8.0);
            if rows > 2 {
                // a fully masked row and a partly masked one
                x[..cols].fill(T::from_f64(f64::NEG_INFINITY));
                x[cols] = T::from_f64(f64::NEG_INFINITY);
            }
            let dy: Vec<T> = rng.vec_in(rows * cols, -1.0, 1.0);
            let n = rows * cols;
            let mut y = vec![T::default(); n];
            let mut dx = vec![T::default(); n];
            if log {
                softmax::log_softmax_forward(&x, rows, cols, &mut y).unwrap();
                softmax::log_softmax_backward(&y, &dy, rows, cols, &mut dx).unwrap();
            } else {
                softmax::softmax_forward(&x, rows, cols, &mut y).unwrap();
                softmax::softmax_backward(&y, &dy, rows, cols, &mut dx).unwrap();
            }
            for shift in [0, 1] {
                let what = format!("softmax log={log} {rows}x{cols} shift {shift}");
                let mut bx = Buf::new(&x, shift);
                let mut by = Buf::<T>::zeros(n, shift);
                let (px, py) = (bx.ptr(), by.ptr());
                // SAFETY: host buffers stand in for device memory (the emulator runs the kernel
                // on this thread before returning), each holding every element the call's sizes
                // reach.
                unsafe { ew::softmax_forward(l, dt, px, py, rows, cols, log) }.unwrap();
                assert_close(&format!("{what} y"), &by.get(), &y, tol::<T>());

                let mut byr = Buf::new(&y, shift);
                let mut bg = Buf::new(&dy, shift);
                let mut bdx = Buf::<T>::zeros(n, shift);
                let (pyr, pg, pdx) = (byr.ptr(), bg.ptr(), bdx.ptr());
                // SAFETY: host buffers stand in for device memory (the emulator runs the kernel
                // on this thread before returning), each holding every element the call's sizes
                // reach.
                unsafe { ew::softmax_backward(l, dt, pyr, pg, pdx, rows, cols, log) }.unwrap();
                let got = bdx.get();
                assert!(got.iter().all(|v| !v.to_f64().is_nan()), "{what}: NaN in dx");
                assert_close(&format!("{what} dx"), &got, &dx, tol::<T>());
            }
        }
    }
}

#[test]
fn softmax_matches_cpu() {
    check_softmax::<f32>(15);
    check_softmax::<bf16>(16);
}

#[test]
fn softmax_f16_in_place() {
    let l: &dyn Launcher = emu();
    let (rows, cols) = (4, 72);
    let x: Vec<f16> = Rng(17).vec_in(rows * cols, -5.0, 5.0);
    let mut want = vec![f16::ZERO; rows * cols];
    softmax::softmax_forward(&x, rows, cols, &mut want).unwrap();
    let mut b = Buf::new(&x, 0);
    let p = b.ptr();
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { ew::softmax_forward(l, CudaDType::F16, p, p, rows, cols, false) }.unwrap();
    assert_close("f16 softmax in place", &b.get(), &want, 2e-3);
}

// ---------------------------------------------------------------- argument errors

#[test]
fn rejects_bad_arguments() {
    let l: &dyn Launcher = emu();
    let mut buf = Buf::new(&[0.0f32; 64], 0);
    let p = buf.ptr();
    let f = CudaDType::F32;
    // SAFETY: every call but the empty one is rejected by the argument checks before
    // anything is launched (asserted per call); the empty one touches no memory.
    unsafe {
        assert!(ew::unary(l, f, UnaryOp::Exp, 0, p, 4).is_err(), "null input");
        assert!(ew::unary(l, f, UnaryOp::Exp, p + 2, p, 4).is_err(), "misaligned element");
        assert!(ew::unary(l, f, UnaryOp::Exp, 0, 0, 0).is_ok(), "empty is a no-op");
        assert!(ew::unary(l, f, UnaryOp::Exp, p, p, usize::MAX).is_err(), "size overflow");
        assert!(ew::binary(l, f, BinaryOp::Add, p, &[1], p, &[1, 1], &[2, 2], p).is_err());
        let huge = [usize::MAX / 2, 4];
        assert!(ew::binary(l, f, BinaryOp::Add, p, &[4, 1], p, &[4, 1], &huge, p).is_err());
        // every dim of a reversed: nothing merges
        let seven = [2usize; 7];
        let (rev, fwd) = ([1usize, 2, 4, 8, 16, 32, 64], [64usize, 32, 16, 8, 4, 2, 1]);
        assert!(ew::binary(l, f, BinaryOp::Add, p, &rev, p, &fwd, &seven, p).is_err(), "rank 7");
        assert!(ew::swiglu_forward(l, f, p, p, 3, p, 2, 4).is_err(), "pitch below cols");
        assert!(ew::softmax_forward(l, f, p, 0, 2, 3, false).is_err(), "null output");
        assert!(ew::softmax_forward(l, f, p, p, usize::MAX, 3, false).is_err(), "overflow");
        assert!(ew::accumulate(l, CudaDType::BF16, p + 1, f, p, 4, 1.0).is_err());
    }
}
