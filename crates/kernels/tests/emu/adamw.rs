//! `cuda/adamw.cu` on the CPU emulator against `tpar_kernels::adamw`, over
//! several steps, and the multi-tensor step against each tensor's own; the steps
//! that also write a bf16 / f16 working copy against the plain step and a separate
//! cast of its result, bit for bit.

use crate::common;

use common::{assert_close, dtype, emu, f64s, mptr, multi_lengths, ptr, tol, Buf, Rng};
use half::{bf16, f16};
use tpar_kernels::adamw::{adamw_step, adamw_step_with_copy, AdamWParams};
use tpar_kernels::cuda::raw::adamw::{self as k, AdamwBuffers};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::elementwise::cast;
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

/// One tensor's buffers, twice: stepped alone and in the multi-tensor launch.
struct Pair<T, G> {
    alone: (Buf<T>, Buf<f32>, Buf<f32>),
    each: (Buf<T>, Buf<f32>, Buf<f32>),
    grad: Buf<G>,
}

/// Three steps of [`k::adamw_step_each`] over [`multi_lengths`] tensors against
/// [`k::adamw_step`] on each alone: the same bits, aligned or not.
fn each_steps_as_alone<T: Float<Acc = f32>, G: Float>(seed: u64) {
    let lens = multi_lengths();
    let mut r = Rng(seed);
    let mut pairs: Vec<Pair<T, G>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p: Vec<T> = r.vec(n, 1.0);
            // Every third parameter sits one element past a 16-byte boundary, every
            // fifth tensor's first moment too: those take the element path.
            let (sp, sm) = ((i % 3 == 1) as usize, (i % 5 == 2) as usize);
            let bufs = || (Buf::new(&p, sp), Buf::zeros(n, sm), Buf::zeros(n, 0));
            Pair { alone: bufs(), each: bufs(), grad: Buf::zeros(n, 0) }
        })
        .collect();
    let name = format!("adamw_step_each {} with {} grads", T::NAME, G::NAME);
    for step in 1..=3 {
        for (pair, &n) in pairs.iter_mut().zip(&lens) {
            pair.grad = Buf::new(&r.vec::<G>(n, 0.5), (n % 2 == 1) as usize);
            let (p, m, v) = &mut pair.alone;
            // SAFETY: host buffers stand in for device memory (the emulator runs the
            // kernel on this thread before returning), each of `n` elements.
            unsafe {
                let (pp, gp, mp, vp) = (p.ptr(), pair.grad.ptr(), m.ptr(), v.ptr());
                k::adamw_step(emu(), dtype::<T>(), dtype::<G>(), pp, gp, mp, vp, n, &hyper(step))
                    .unwrap();
            }
        }
        let bufs: Vec<AdamwBuffers> = pairs
            .iter_mut()
            .zip(&lens)
            .map(|(pair, &n)| AdamwBuffers {
                param: pair.each.0.ptr(),
                grad: pair.grad.ptr(),
                exp_avg: pair.each.1.ptr(),
                exp_avg_sq: pair.each.2.ptr(),
                n,
            })
            .collect();
        // SAFETY: as above; no two tensors share a buffer.
        unsafe { k::adamw_step_each(emu(), dtype::<T>(), dtype::<G>(), &bufs, &hyper(step)) }
            .unwrap();
        for (i, pair) in pairs.iter().enumerate() {
            let what = format!("{name}: tensor {i} ({} elements) step {step}", lens[i]);
            assert_eq!(f64s(&pair.each.0.get()), f64s(&pair.alone.0.get()), "{what}: param");
            assert_eq!(pair.each.1.get(), pair.alone.1.get(), "{what}: exp_avg");
            assert_eq!(pair.each.2.get(), pair.alone.2.get(), "{what}: exp_avg_sq");
        }
    }
}

#[test]
fn each_tensor_steps_as_alone_in_the_multi_tensor_launch() {
    each_steps_as_alone::<f32, f32>(21);
    each_steps_as_alone::<bf16, bf16>(22);
    each_steps_as_alone::<f16, f16>(23);
    each_steps_as_alone::<bf16, f32>(24);
    each_steps_as_alone::<f16, f32>(25);
}

#[test]
fn bad_multi_tensor_arguments_are_errors() {
    let mut p = vec![bf16::ZERO; 8];
    let g = vec![f16::ZERO; 8];
    let (mut m, mut v) = (vec![0f32; 8], vec![0f32; 8]);
    let b = AdamwBuffers {
        param: mptr(&mut p),
        grad: ptr(&g),
        exp_avg: mptr(&mut m),
        exp_avg_sq: mptr(&mut v),
        n: 8,
    };
    let (bf, hf) = (CudaDType::BF16, CudaDType::F16);
    // SAFETY: the argument checks reject each call before anything is launched (asserted
    // below).
    for r in unsafe {
        [
            k::adamw_step_each(emu(), bf, hf, &[b], &hyper(1)),
            k::adamw_step_each(emu(), bf, bf, &[b], &hyper(0)),
            k::adamw_step_each(emu(), bf, bf, &[b, AdamwBuffers { exp_avg: 0, ..b }], &hyper(1)),
        ]
    } {
        assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    }
    assert_eq!(p, vec![bf16::ZERO; 8], "a refused call changed the parameters");
}

/// Bits of the f64 widening of each element (a NaN's too).
fn bits_of<T: Float>(v: &[T]) -> Vec<u64> {
    f64s(v).iter().map(|x| x.to_bits()).collect()
}

/// Gradients with a NaN (its parameter, and so its copy, turn NaN) and parameters
/// that round to infinity in f16 or sit at a bf16 rounding tie.
fn awkward(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut p: Vec<f32> = rng.vec(n, 1.0);
    let specials = [70_000.0, -65_519.0, 1.0 + 1.0 / 256.0];
    for (x, s) in p.iter_mut().zip(specials) {
        *x = s;
    }
    let grads = (0..3)
        .map(|_| {
            let mut g: Vec<f32> = rng.vec(n, 0.5);
            if n > 5 {
                g[5] = f32::NAN;
            }
            g
        })
        .collect();
    (p, grads)
}

/// Three steps of [`k::adamw_step_with_copy`] (f32 parameters, a `W` copy whose
/// buffer starts `copy_shift` elements past a 16-byte boundary) against
/// [`k::adamw_step`] on a twin: the parameters and moments are the same bits, the
/// copy is a separate cast of the parameters bit for bit, and both equal the CPU's
/// [`adamw_step_with_copy`].
fn copy_steps<W: Float<Acc = f32>>(seed: u64, n: usize, copy_shift: usize) {
    let mut rng = Rng(seed);
    let (p, grads) = awkward(&mut rng, n);
    let mut plain = (Buf::new(&p, 0), Buf::<f32>::zeros(n, 0), Buf::<f32>::zeros(n, 0));
    let mut with = (Buf::new(&p, 0), Buf::<f32>::zeros(n, 0), Buf::<f32>::zeros(n, 0));
    let mut copy = Buf::<W>::zeros(n, copy_shift);
    let (mut cp, mut cm, mut cv, mut cc) = (p.clone(), vec![0f32; n], vec![0f32; n], copy.get());
    let (f32d, wd) = (CudaDType::F32, dtype::<W>());
    for (step, g) in (1..=3).zip(&grads) {
        let h = hyper(step);
        let gp = ptr(g);
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
        // this thread before returning), each of `n` elements; none overlaps another.
        unsafe {
            let (pp, mp, vp) = (plain.0.ptr(), plain.1.ptr(), plain.2.ptr());
            k::adamw_step(emu(), f32d, f32d, pp, gp, mp, vp, n, &h).unwrap();
            let (pp, mp, vp, cp) = (with.0.ptr(), with.1.ptr(), with.2.ptr(), copy.ptr());
            k::adamw_step_with_copy(emu(), pp, gp, mp, vp, wd, cp, n, &h).unwrap();
        }
        let cast_one = |x: f32| W::from_f64(x.to_f64());
        adamw_step_with_copy(&mut cp, g, &mut cm, &mut cv, &mut cc, cast_one, &h).unwrap();
        let what = format!("adamw f32 -> {} n {n} copy shift {copy_shift} step {step}", W::NAME);
        assert_eq!(bits_of(&with.0.get()), bits_of(&plain.0.get()), "{what}: param");
        assert_eq!(bits_of(&with.1.get()), bits_of(&plain.1.get()), "{what}: exp_avg");
        assert_eq!(bits_of(&with.2.get()), bits_of(&plain.2.get()), "{what}: exp_avg_sq");
        let mut want = vec![W::from_f64(0.0); n];
        cast(&with.0.get(), &mut want).unwrap();
        assert_eq!(bits_of(&copy.get()), bits_of(&want), "{what}: copy against a cast");
        assert_eq!(bits_of(&with.0.get()), bits_of(&cp), "{what}: param against the CPU");
        assert_eq!(bits_of(&copy.get()), bits_of(&cc), "{what}: copy against the CPU");
    }
}

#[test]
fn step_with_copy_writes_the_cast_of_the_update() {
    copy_steps::<bf16>(31, 1003, 0);
    copy_steps::<bf16>(32, 77, 1);
    copy_steps::<f16>(33, 517, 0);
    copy_steps::<f16>(34, 45, 3);
}

/// Three steps of [`k::adamw_step_each_with_copies`] over [`multi_lengths`] tensors
/// (every fourth without a copy, some copies unaligned) against
/// [`k::adamw_step_with_copy`] / [`k::adamw_step`] on each alone: the same bits.
fn each_copies_as_alone<W: Float<Acc = f32>>(seed: u64) {
    let lens = multi_lengths();
    let mut r = Rng(seed);
    type Set<W> = (Buf<f32>, Buf<f32>, Buf<f32>, Option<Buf<W>>);
    let mut sets: Vec<(Set<W>, Set<W>)> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p: Vec<f32> = r.vec(n, 1.0);
            let shift = (i % 3 == 2) as usize;
            let make = || -> Set<W> {
                let copy = (i % 4 != 3).then(|| Buf::zeros(n, shift));
                (Buf::new(&p, (i % 5 == 1) as usize), Buf::zeros(n, 0), Buf::zeros(n, 0), copy)
            };
            (make(), make())
        })
        .collect();
    let (f32d, wd) = (CudaDType::F32, dtype::<W>());
    for step in 1..=3 {
        let grads: Vec<Vec<f32>> = lens.iter().map(|&n| r.vec(n, 0.5)).collect();
        for ((alone, _), (g, &n)) in sets.iter_mut().zip(grads.iter().zip(&lens)) {
            let (pp, mp, vp) = (alone.0.ptr(), alone.1.ptr(), alone.2.ptr());
            // SAFETY: host buffers stand in for device memory, each of `n` elements.
            unsafe {
                match &mut alone.3 {
                    Some(c) => {
                        let cp = c.ptr();
                        k::adamw_step_with_copy(emu(), pp, ptr(g), mp, vp, wd, cp, n, &hyper(step))
                    }
                    None => k::adamw_step(emu(), f32d, f32d, pp, ptr(g), mp, vp, n, &hyper(step)),
                }
                .unwrap();
            }
        }
        let mut bufs = Vec::new();
        let mut copies: Vec<DevPtr> = Vec::new();
        for ((_, each), (g, &n)) in sets.iter_mut().zip(grads.iter().zip(&lens)) {
            bufs.push(AdamwBuffers {
                param: each.0.ptr(),
                grad: ptr(g),
                exp_avg: each.1.ptr(),
                exp_avg_sq: each.2.ptr(),
                n,
            });
            copies.push(each.3.as_mut().map_or(0, |c| c.ptr()));
        }
        // SAFETY: as above; no two tensors share a buffer.
        unsafe { k::adamw_step_each_with_copies(emu(), wd, &bufs, &copies, &hyper(step)) }.unwrap();
        for (i, (alone, each)) in sets.iter().enumerate() {
            let what = format!("{} copies: tensor {i} ({} elements) step {step}", W::NAME, lens[i]);
            assert_eq!(bits_of(&each.0.get()), bits_of(&alone.0.get()), "{what}: param");
            assert_eq!(bits_of(&each.1.get()), bits_of(&alone.1.get()), "{what}: exp_avg");
            assert_eq!(bits_of(&each.2.get()), bits_of(&alone.2.get()), "{what}: exp_avg_sq");
            if let (Some(a), Some(e)) = (&alone.3, &each.3) {
                assert_eq!(bits_of(&e.get()), bits_of(&a.get()), "{what}: copy");
                let mut want = vec![W::from_f64(0.0); lens[i]];
                cast(&each.0.get(), &mut want).unwrap();
                assert_eq!(bits_of(&e.get()), bits_of(&want), "{what}: copy against a cast");
            }
        }
    }
}

#[test]
fn each_tensor_writes_its_copy_as_alone_in_the_multi_tensor_launch() {
    each_copies_as_alone::<bf16>(41);
    each_copies_as_alone::<f16>(42);
}

#[test]
fn bad_copy_arguments_are_errors() {
    let mut p = vec![0f32; 8];
    let g = vec![0f32; 8];
    let (mut m, mut v) = (vec![0f32; 8], vec![0f32; 8]);
    let mut c = vec![bf16::ZERO; 8];
    let (pp, mp, vp, cp) = (mptr(&mut p), mptr(&mut m), mptr(&mut v), mptr(&mut c));
    let b = AdamwBuffers { param: pp, grad: ptr(&g), exp_avg: mp, exp_avg_sq: vp, n: 8 };
    let (bf, f32d) = (CudaDType::BF16, CudaDType::F32);
    // SAFETY: the argument checks reject each call before anything is launched (asserted
    // below).
    for r in unsafe {
        [
            // An f32 "working copy" of f32 parameters.
            k::adamw_step_with_copy(emu(), pp, ptr(&g), mp, vp, f32d, cp, 8, &hyper(1)),
            // A null copy with elements.
            k::adamw_step_with_copy(emu(), pp, ptr(&g), mp, vp, bf, 0, 8, &hyper(1)),
            k::adamw_step_with_copy(emu(), pp, ptr(&g), mp, vp, bf, cp, 8, &hyper(0)),
            k::adamw_step_each_with_copies(emu(), f32d, &[b], &[cp], &hyper(1)),
            // One copy slot for two tensors.
            k::adamw_step_each_with_copies(emu(), bf, &[b, b], &[cp], &hyper(1)),
            k::adamw_step_each_with_copies(emu(), bf, &[b], &[cp + 1], &hyper(1)),
        ]
    } {
        assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    }
    assert_eq!(p, vec![0f32; 8], "a refused call changed the parameters");
    assert_eq!(c, vec![bf16::ZERO; 8], "a refused call wrote the copy");
}
