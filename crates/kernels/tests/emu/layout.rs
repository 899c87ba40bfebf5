//! The layout CUDA kernels (`cuda/layout.cu`) on the CPU emulator: copies,
//! narrow, cat, transpose, permute and expand, against plain Rust index
//! loops and the CPU [`strided_copy`], for 2-, 4- and 8-byte elements, on
//! aligned and shifted addresses. Copies must be exact.

use crate::common;

use common::{emu, Buf};
use tpar_kernels::cuda::raw::layout as lay;
use tpar_kernels::cuda::{DevPtr, Launcher};
use tpar_kernels::elementwise::strided_copy;

/// Distinct test values of each element width.
trait Elem: Copy + Default + PartialEq + std::fmt::Debug {
    fn of(i: usize) -> Self;
}
impl Elem for u16 {
    fn of(i: usize) -> Self {
        (i as u16).wrapping_mul(40503).wrapping_add(7)
    }
}
impl Elem for u32 {
    fn of(i: usize) -> Self {
        (i as u32).wrapping_mul(2_654_435_761).wrapping_add(3)
    }
}
impl Elem for u64 {
    fn of(i: usize) -> Self {
        (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(11)
    }
}

fn data<T: Elem>(n: usize) -> Vec<T> {
    (0..n).map(T::of).collect()
}

fn es<T>() -> usize {
    std::mem::size_of::<T>()
}

// ---------------------------------------------------------------- copies, narrow, cat

fn check_copies<T: Elem>() {
    let l: &dyn Launcher = emu();
    for shift in [0, 1] {
        // a plain copy of an odd length
        let x: Vec<T> = data(1003);
        let mut bx = Buf::new(&x, shift);
        let mut by = Buf::<T>::zeros(1003, shift);
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { lay::copy(l, es::<T>(), bx.ptr(), by.ptr(), 1003) }.unwrap();
        assert_eq!(by.get(), x, "copy w{} shift {shift}", es::<T>());

        // narrow [outer, size, inner] -> [outer, len, inner]
        for (outer, size, inner, start, len) in [(3, 10, 7, 2, 5), (4, 6, 8, 1, 4), (2, 9, 1, 8, 1)]
        {
            let x: Vec<T> = data(outer * size * inner);
            let mut want = Vec::new();
            for o in 0..outer {
                let row = o * size * inner;
                want.extend_from_slice(&x[row + start * inner..row + (start + len) * inner]);
            }
            let mut bx = Buf::new(&x, shift);
            let mut by = Buf::<T>::zeros(want.len(), 0);
            let (px, py) = (bx.ptr(), by.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { lay::narrow(l, es::<T>(), px, outer, size, inner, start, len, py) }.unwrap();
            let what = format!("narrow w{} {outer}x{size}x{inner} {start}+{len}", es::<T>());
            assert_eq!(by.get(), want, "{what} shift {shift}");
        }

        // cat along the middle dim: three pieces (one launch), and 70 pieces with empty
        // ones among them (three launches of at most 32 blocks)
        let (outer, inner) = (3, 5);
        let many: Vec<usize> = (0..70).map(|k| (k * 7) % 5).collect();
        for lens in [&[2, 7, 4][..], &many] {
            let total: usize = lens.iter().sum();
            let pieces: Vec<Vec<T>> = lens
                .iter()
                .enumerate()
                .map(|(k, &n)| data::<T>(outer * n * inner + 100 * k))
                .collect();
            let mut want = Vec::new();
            for o in 0..outer {
                for (p, &n) in pieces.iter().zip(lens) {
                    want.extend_from_slice(&p[o * n * inner..(o + 1) * n * inner]);
                }
            }
            let mut bufs: Vec<Buf<T>> = pieces.iter().map(|p| Buf::new(p, shift)).collect();
            let args: Vec<(DevPtr, usize)> =
                bufs.iter_mut().zip(lens).map(|(b, &n)| (b.ptr(), n)).collect();
            let mut by = Buf::<T>::zeros(outer * total * inner, 0);
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { lay::cat(l, es::<T>(), &args, outer, inner, by.ptr()) }.unwrap();
            let n = lens.len();
            assert_eq!(by.get(), want, "cat of {n} w{} shift {shift}", es::<T>());
        }
    }
}

#[test]
fn copies_narrow_and_cat() {
    check_copies::<u16>();
    check_copies::<u32>();
    check_copies::<u64>();
}

// ---------------------------------------------------------------- transpose

fn check_transpose<T: Elem>() {
    let l: &dyn Launcher = emu();
    for (batch, rows, cols) in [(3, 37, 45), (1, 64, 32), (2, 1, 9), (1, 33, 1)] {
        let x: Vec<T> = data(batch * rows * cols);
        let mut want = vec![T::default(); x.len()];
        for b in 0..batch {
            for r in 0..rows {
                for c in 0..cols {
                    want[(b * cols + c) * rows + r] = x[(b * rows + r) * cols + c];
                }
            }
        }
        for shift in [0, 1] {
            let mut bx = Buf::new(&x, shift);
            let mut by = Buf::<T>::zeros(x.len(), shift);
            let (px, py) = (bx.ptr(), by.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { lay::transpose(l, es::<T>(), px, batch, rows, cols, py) }.unwrap();
            let what = format!("transpose w{} {batch}x{rows}x{cols} shift {shift}", es::<T>());
            assert_eq!(by.get(), want, "{what}");
        }
    }
}

#[test]
fn transpose_matches_loops() {
    check_transpose::<u16>();
    check_transpose::<u32>();
    check_transpose::<u64>();
}

// ---------------------------------------------------------------- permute, expand, strided

/// The GPU strided copy against the CPU one.
fn check_strided<T: Elem + Send + Sync>(
    x: &[T],
    base: usize,
    strides: &[usize],
    shape: &[usize],
    shift: usize,
    what: &str,
) {
    let l: &dyn Launcher = emu();
    let n: usize = shape.iter().product();
    let mut want = vec![T::default(); n];
    strided_copy(x, base, strides, shape, &mut want).unwrap();
    let mut bx = Buf::new(x, shift);
    let mut by = Buf::<T>::zeros(n, shift);
    let (px, py) = (bx.ptr(), by.ptr());
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { lay::strided_copy(l, es::<T>(), px, base, strides, shape, py) }.unwrap();
    assert_eq!(by.get(), want, "{what} w{} shift {shift}", es::<T>());
}

/// Permutes with the GPU wrapper and checks against an index loop.
fn check_permute<T: Elem>(shape: &[usize], perm: &[usize], shift: usize) {
    let l: &dyn Launcher = emu();
    let n: usize = shape.iter().product();
    let x: Vec<T> = data(n);
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let in_strides: Vec<usize> =
        (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
    let mut want = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        // idx walks the output in row-major order
        let src: usize = idx.iter().zip(perm).map(|(&i, &p)| i * in_strides[p]).sum();
        want.push(x[src]);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < out_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    let mut bx = Buf::new(&x, shift);
    let mut by = Buf::<T>::zeros(n, shift);
    let (px, py) = (bx.ptr(), by.ptr());
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { lay::permute(l, es::<T>(), px, shape, perm, py) }.unwrap();
    assert_eq!(by.get(), want, "permute {shape:?} by {perm:?} w{} shift {shift}", es::<T>());
}

fn check_layouts<T: Elem + Send + Sync>() {
    for shift in [0, 1] {
        // [b, s, h, d] -> [b, h, s, d]: the last dim stays contiguous (vector path)
        check_permute::<T>(&[2, 5, 3, 16], &[0, 2, 1, 3], shift);
        // odd sizes and a moved last dim (general gather)
        check_permute::<T>(&[3, 5, 7], &[2, 0, 1], shift);
        check_permute::<T>(&[2, 3, 4, 5, 3], &[4, 3, 2, 1, 0], shift);
        // last two dims swapped: dispatched to the tiled transpose
        check_permute::<T>(&[3, 7, 40], &[0, 2, 1], shift);
        check_permute::<T>(&[2, 2, 3, 33], &[0, 1, 3, 2], shift);
        // expand [3, 1, 5] -> [2, 3, 4, 5] and a column expand
        let x: Vec<T> = data(15);
        check_strided(&x, 0, &[0, 5, 0, 1], &[2, 3, 4, 5], shift, "expand");
        check_strided(&x[..3], 0, &[1, 0], &[3, 24], shift, "expand columns");
        // narrow through the strided entry point: rows at a pitch, and a
        // slice of the last dim at an odd offset
        let x: Vec<T> = data(6 * 20);
        check_strided(&x, 3 * 20, &[20, 1], &[2, 20], shift, "narrow rows");
        check_strided(&x, 5, &[20, 1], &[6, 7], shift, "narrow columns");
        // a scalar broadcast and a strided gather of every third element
        check_strided(&x, 7, &[0, 0], &[4, 9], shift, "scalar broadcast");
        check_strided(&x, 1, &[3], &[39], shift, "stride 3");
    }
}

#[test]
fn permute_expand_narrow() {
    check_layouts::<u16>();
    check_layouts::<u32>();
    check_layouts::<u64>();
}

#[test]
fn expand_broadcasts_like_numpy() {
    let l: &dyn Launcher = emu();
    let x: Vec<u32> = data(4);
    let mut bx = Buf::new(&x, 0);
    let mut by = Buf::<u32>::zeros(3 * 2 * 4, 0);
    let (px, py) = (bx.ptr(), by.ptr());
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { lay::expand(l, 4, px, &[1, 4], &[3, 2, 4], py) }.unwrap();
    let want: Vec<u32> = (0..24).map(|i| x[i % 4]).collect();
    assert_eq!(by.get(), want);
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // here).
    assert!(unsafe { lay::expand(l, 4, px, &[3], &[3, 2], py) }.is_err(), "3 vs 2");
}

#[test]
fn rejects_bad_arguments() {
    let l: &dyn Launcher = emu();
    let mut buf = Buf::new(&[0u32; 64], 0);
    let p = buf.ptr();
    // SAFETY: every call but the empty one is rejected by the argument checks before
    // anything is launched (asserted per call); the empty one touches no memory.
    unsafe {
        assert!(lay::copy(l, 3, p, p, 4).is_err(), "width 3");
        assert!(lay::copy(l, 4, p, 0, 4).is_err(), "null destination");
        assert!(lay::copy(l, 4, p + 2, p, 4).is_err(), "misaligned source");
        assert!(lay::copy(l, 4, 0, 0, 0).is_ok(), "empty is a no-op");
        assert!(lay::narrow(l, 4, p, 2, 5, 3, 4, 2, p).is_err(), "range past the dim");
        assert!(lay::cat_into(l, 4, p, 2, 3, 1, p, 4, 2).is_err(), "piece past the end");
        assert!(lay::permute(l, 4, p, &[2, 3], &[0, 0], p).is_err(), "not a permutation");
        assert!(lay::strided_copy(l, 4, p, 0, &[1], &[2, 2], p).is_err(), "rank mismatch");
        let huge = [usize::MAX / 2, 4];
        assert!(lay::strided_copy(l, 4, p, 0, &[4, 1], &huge, p).is_err(), "overflow");
        // seven dims that do not merge
        let shape = [2usize; 7];
        let rev = [1usize, 2, 4, 8, 16, 32, 64];
        assert!(lay::strided_copy(l, 4, p, 0, &rev, &shape, p).is_err(), "rank 7");
        assert!(lay::transpose(l, 16, p, 1, 2, 2, p).is_err(), "width 16");
    }
}
