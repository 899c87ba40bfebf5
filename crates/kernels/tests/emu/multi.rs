//! `cuda/multi.cu` on the CPU emulator: each tensor's sum of squares against
//! f64, each tensor's scaling bit for bit against the host's arithmetic, over
//! more tensors than one launch takes, of sizes around the chunk and at
//! unaligned addresses.

use crate::common;

use common::{assert_close, dtype, emu, mptr, multi_lengths as lengths, ptr, Buf, Rng};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::multi as k;
use tpar_kernels::Float;

fn sum_squares<T: Float>(seed: u64) {
    let lens = lengths();
    let mut r = Rng(seed);
    // Every third tensor starts one element past a 16-byte boundary.
    let mut bufs: Vec<Buf<T>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| Buf::new(&r.vec::<T>(n, 2.0), (i % 3 == 1) as usize))
        .collect();
    let want: Vec<f64> =
        bufs.iter().map(|b| b.get().iter().map(|v| v.to_f64().powi(2)).sum()).collect();
    let xs: Vec<_> = bufs.iter_mut().zip(&lens).map(|(b, &n)| (b.ptr(), n)).collect();
    let mut got = vec![f32::NAN; lens.len()];
    let mut ws = vec![0f32; k::sum_squares_each_workspace_len(&lens)];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::sum_squares_each(emu(), dtype::<T>(), &xs, mptr(&mut got), mptr(&mut ws), ws.len())
            .unwrap();
    }
    let got64: Vec<f64> = got.iter().map(|&v| v as f64).collect();
    assert_close(&format!("sum_squares_each {}", T::NAME), &got64, &want, 1e-5);
    // Too small a workspace is an error, not an out-of-bounds launch.
    // SAFETY: as above (the call is refused before launching).
    let e = unsafe {
        k::sum_squares_each(emu(), dtype::<T>(), &xs, mptr(&mut got), mptr(&mut ws), ws.len() - 1)
    };
    assert!(e.is_err(), "a short workspace was accepted");
}

#[test]
fn sum_squares_each_matches_f64_per_tensor() {
    sum_squares::<f32>(11);
    sum_squares::<bf16>(12);
    sum_squares::<f16>(13);
}

fn scale<T: Float>(seed: u64, coef: f32) {
    let lens = lengths();
    let mut r = Rng(seed);
    let mut xs: Vec<Buf<T>> =
        lens.iter().enumerate().map(|(i, &n)| Buf::new(&r.vec::<T>(n, 3.0), i % 2)).collect();
    let mut ys: Vec<Buf<T>> = lens.iter().enumerate().map(|(i, &n)| Buf::zeros(n, i % 3)).collect();
    let pairs: Vec<_> = xs
        .iter_mut()
        .zip(ys.iter_mut())
        .zip(&lens)
        .map(|((x, y), &n)| (x.ptr(), y.ptr(), n))
        .collect();
    let c = [coef];
    // SAFETY: as in `sum_squares`.
    unsafe { k::scale_each(emu(), dtype::<T>(), &pairs, ptr(&c)).unwrap() };
    // The coefficient rounded to T, the product rounded once.
    let cr = T::from_f64(coef as f64).to_f64() as f32;
    for (i, (x, y)) in xs.iter().zip(&ys).enumerate() {
        let want: Vec<T> =
            x.get().iter().map(|v| T::from_f64((v.to_f64() as f32 * cr) as f64)).collect();
        let (got, want): (Vec<f64>, Vec<f64>) = (
            y.get().iter().map(|v| v.to_f64()).collect(),
            want.iter().map(|v| v.to_f64()).collect(),
        );
        assert_eq!(got, want, "scale_each {} tensor {i} ({} elements)", T::NAME, lens[i]);
    }
}

#[test]
fn scale_each_rounds_as_a_multiply_by_the_rounded_scalar() {
    scale::<f32>(21, 0.3712);
    scale::<bf16>(22, 0.3712);
    scale::<f16>(23, 1.0 / 3.0);
}
