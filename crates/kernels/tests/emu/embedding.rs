//! `cuda/embedding.cu` on the CPU emulator against the CPU kernels of
//! `tpar_kernels::embedding`.

use crate::common;

use common::{assert_close, dtype, emu, f64s, mptr, ptr, tol, Rng};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::embedding::{self as k, EmbeddingCsr, NO_ERROR};
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::embedding as cpu;
use tpar_kernels::{Float, KernelError};

// Test data of this file, on the shared generator.
impl Rng {
    /// `n` ids uniform in `[lo, hi)`.
    fn ids(&mut self, n: usize, lo: i64, hi: i64) -> Vec<i64> {
        (0..n).map(|_| lo + (self.next() % (hi - lo) as u64) as i64).collect()
    }
}

const START: i64 = 300;
const VOCAB: usize = 40;

/// GPU forward vs CPU forward on a slice `[START, START + VOCAB)`.
fn check_forward<T: Float>(seed: u64, n: usize, dim: usize, masked: bool) {
    let mut rng = Rng(seed);
    let weight: Vec<T> = rng.vec(VOCAB * dim, 1.0);
    let ids = if masked {
        rng.ids(n, START - 30, START + VOCAB as i64 + 30)
    } else {
        rng.ids(n, START, START + VOCAB as i64)
    };
    let mut want = vec![T::default(); n * dim];
    cpu::embedding_forward(&weight, VOCAB, dim, &ids, START, masked, &mut want).unwrap();
    let mut got = vec![T::from_f64(9.0); n * dim];
    let mut err = [NO_ERROR];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::embedding_forward(
            emu(),
            dtype::<T>(),
            ptr(&weight),
            VOCAB,
            dim,
            ptr(&ids),
            n,
            START,
            masked,
            mptr(&mut got),
            mptr(&mut err),
        )
        .unwrap();
    }
    let what = format!("forward {} n {n} dim {dim} masked {masked}", T::NAME);
    assert_eq!(err[0], NO_ERROR, "{what}: error slot");
    assert_eq!(f64s(&got), f64s(&want), "{what}");
}

#[test]
fn forward_matches_cpu() {
    for masked in [true, false] {
        check_forward::<f32>(1, 37, 24, masked); // 16-byte rows
        check_forward::<f32>(2, 37, 21, masked); // element rows
        check_forward::<bf16>(3, 37, 24, masked); // 3 vectors per row
        check_forward::<bf16>(4, 29, 20, masked); // not a multiple of 8
        check_forward::<f16>(5, 11, 520, masked); // wide rows: groups of 128
    }
}

#[test]
fn invalid_ids_set_the_error_slot_and_give_zero_rows() {
    let dim = 8;
    let weight: Vec<f32> = Rng(6).vec(VOCAB * dim, 1.0);
    let ids: Vec<i64> = vec![START, START + 3, START + VOCAB as i64, START + 1, START - 1, 5];
    let mut out = vec![1f32; ids.len() * dim];
    let want_err = cpu::embedding_forward(&weight, VOCAB, dim, &ids, START, false, &mut out);
    let Err(KernelError::IndexOutOfRange { position, .. }) = want_err else {
        panic!("CPU forward: {want_err:?}")
    };
    let mut err = [NO_ERROR];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::embedding_forward(
            emu(),
            CudaDType::F32,
            ptr(&weight),
            VOCAB,
            dim,
            ptr(&ids),
            ids.len(),
            START,
            false,
            mptr(&mut out),
            mptr(&mut err),
        )
        .unwrap();
    }
    assert_eq!(err[0] as usize, position, "first invalid position");
    for p in [2, 4, 5] {
        assert!(out[p * dim..(p + 1) * dim].iter().all(|&v| v == 0.0), "row {p} is zeros");
    }
    assert_eq!(out[dim..2 * dim], weight[3 * dim..4 * dim]);
    // The atomic backward flags the same position; masked ids are not errors.
    let dout: Vec<f32> = Rng(7).vec(ids.len() * dim, 1.0);
    let mut dw = vec![0f32; VOCAB * dim];
    for (masked, want) in [(false, position as i32), (true, NO_ERROR)] {
        err[0] = NO_ERROR;
        let p = mptr(&mut dw);
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe {
            k::embedding_backward_atomic(
                emu(),
                CudaDType::F32,
                ptr(&ids),
                ids.len(),
                START,
                masked,
                ptr(&dout),
                VOCAB,
                dim,
                p,
                p,
                mptr(&mut err),
            )
            .unwrap();
        }
        assert_eq!(err[0], want, "atomic backward, masked {masked}");
    }
    // The host CSR reports the CPU kernel's error.
    let csr_err = EmbeddingCsr::build(&ids, START, VOCAB, false).unwrap_err();
    let KernelError::IndexOutOfRange { index, position: at, size, .. } = csr_err else {
        panic!("CSR: {csr_err:?}")
    };
    assert_eq!((index, at, size), (ids[position], position, VOCAB));
}

/// The deterministic CSR gradient equals the CPU gradient exactly; the atomic
/// one is close.
fn check_backward<T: Float>(seed: u64, n: usize, dim: usize, masked: bool, offset: usize) {
    let mut rng = Rng(seed);
    // Few distinct ids: many repeats.
    let ids =
        if masked { rng.ids(n, START - 5, START + 12) } else { rng.ids(n, START, START + 12) };
    // `offset` elements in front make dout rows start unaligned.
    let dbuf: Vec<T> = rng.vec(offset + n * dim, 1.0);
    let dout = &dbuf[offset..];
    let mut want = vec![T::default(); VOCAB * dim];
    cpu::embedding_backward(&ids, START, masked, dout, VOCAB, dim, &mut want).unwrap();
    let what = format!("backward {} n {n} dim {dim} masked {masked} offset {offset}", T::NAME);

    let csr = EmbeddingCsr::build(&ids, START, VOCAB, masked).unwrap();
    let mut got = vec![T::from_f64(5.0); VOCAB * dim];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::embedding_backward_csr(
            emu(),
            dtype::<T>(),
            ptr(&csr.row_start),
            ptr(&csr.positions),
            csr.positions.len(),
            ptr(dout),
            n,
            VOCAB,
            dim,
            mptr(&mut got),
        )
        .unwrap();
    }
    assert_eq!(f64s(&got), f64s(&want), "{what}: csr");

    let mut got = vec![T::from_f64(5.0); VOCAB * dim];
    let mut acc = vec![3f32; VOCAB * dim];
    let mut err = [NO_ERROR];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::embedding_backward_atomic(
            emu(),
            dtype::<T>(),
            ptr(&ids),
            n,
            START,
            masked,
            ptr(dout),
            VOCAB,
            dim,
            mptr(&mut got),
            mptr(&mut acc),
            mptr(&mut err),
        )
        .unwrap();
    }
    assert_eq!(err[0], NO_ERROR, "{what}: error slot");
    assert_close(&format!("{what}: atomic"), &f64s(&got), &f64s(&want), tol::<T>());
}

#[test]
fn backward_matches_cpu() {
    for masked in [false, true] {
        check_backward::<f32>(11, 53, 24, masked, 0);
        check_backward::<f32>(12, 53, 24, masked, 1);
        check_backward::<bf16>(13, 41, 16, masked, 0);
        check_backward::<bf16>(14, 41, 13, masked, 0);
        check_backward::<f16>(15, 30, 40, masked, 3);
    }
}

#[test]
fn csr_groups_positions_in_order() {
    let ids = [7i64, 3, 7, 9, 3, 7, 100];
    let csr = EmbeddingCsr::build(&ids, 2, 8, true).unwrap();
    // Local rows: 7 -> 5, 3 -> 1, 9 -> 7; 100 is outside.
    assert_eq!(csr.row_start, vec![0, 0, 2, 2, 2, 2, 5, 5, 6]);
    assert_eq!(csr.positions, vec![1, 4, 0, 2, 5, 3]);
}

#[test]
fn bad_arguments_are_errors() {
    let mut dw = vec![bf16::ZERO; 16];
    let dout = vec![bf16::ZERO; 16];
    let ids = vec![0i64; 2];
    let p = mptr(&mut dw);
    // acc == dweight is only allowed for f32.
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::embedding_backward_atomic(
            emu(),
            CudaDType::BF16,
            ptr(&ids),
            2,
            0,
            true,
            ptr(&dout),
            2,
            8,
            p,
            p,
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // More positions than ids.
    let rs = vec![0i32; 3];
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::embedding_backward_csr(
            emu(),
            CudaDType::BF16,
            ptr(&rs),
            ptr(&rs),
            3,
            ptr(&dout),
            2,
            2,
            8,
            p,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // A null table.
    let mut out = vec![bf16::ZERO; 16];
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::embedding_forward(
            emu(),
            CudaDType::BF16,
            0,
            2,
            8,
            ptr(&ids),
            2,
            0,
            false,
            mptr(&mut out),
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
}

/// The device-sorted gradient (`embedding_backward_sorted`) against the CPU
/// kernel, bit for bit: a slice of `vocab` rows at `START`, `n` ids drawn from
/// `[lo, hi)` (outside the slice: skipped), `dim` elements a row.
fn check_sorted<T: Float>(seed: u64, n: usize, vocab: usize, dim: usize, lo: i64, hi: i64) {
    let mut rng = Rng(seed);
    let ids = rng.ids(n, lo, hi);
    let dout: Vec<T> = rng.vec(n * dim, 1.0);
    let mut want = vec![T::default(); vocab * dim];
    cpu::embedding_backward(&ids, START, true, &dout, vocab, dim, &mut want).unwrap();
    let mut got = vec![T::from_f64(5.0); vocab * dim];
    let mut scratch = vec![0xa5u8; k::sorted_scratch_bytes(n, vocab)];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernels on
    // this thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::embedding_backward_sorted(
            emu(),
            dtype::<T>(),
            ptr(&ids),
            n,
            START,
            ptr(&dout),
            vocab,
            dim,
            mptr(&mut got),
            mptr(&mut scratch),
        )
        .unwrap();
    }
    let what = format!("sorted {} n {n} vocab {vocab} dim {dim} ids {lo}..{hi}", T::NAME);
    assert_eq!(f64s(&got), f64s(&want), "{what}");
}

#[test]
fn sorted_backward_matches_cpu_bit_for_bit() {
    let s = START;
    // One radix pass (vocab below 256), two (259: the byte vocabulary) and three
    // (70,000 rows); several tiles of 2048 positions, a last partial tile, one
    // position, none; ids outside the slice on both sides.
    check_sorted::<f32>(21, 5000, 40, 8, s - 7, s + 47);
    check_sorted::<f32>(22, 4097, 259, 16, s, s + 259);
    check_sorted::<bf16>(23, 3000, 259, 24, s - 3, s + 262);
    check_sorted::<f16>(24, 2500, 70_000, 8, s, s + 70_000);
    check_sorted::<bf16>(25, 1, 40, 16, s, s + 40);
    check_sorted::<f32>(26, 0, 40, 16, s, s + 40);
    // Every id the same row: one long row summed in position order.
    check_sorted::<f32>(27, 4500, 40, 8, s + 9, s + 10);
    // Unaligned rows (dim 13): the element-by-element sums.
    check_sorted::<bf16>(28, 2100, 259, 13, s, s + 259);
    // Every id outside the slice: a zero gradient.
    check_sorted::<f32>(29, 300, 40, 8, s + 40, s + 90);
}

#[test]
fn sorted_backward_refuses_a_null_scratch() {
    let (ids, dout) = (vec![START; 4], vec![0f32; 4 * 8]);
    let mut dw = vec![0f32; 40 * 8];
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::embedding_backward_sorted(
            emu(),
            CudaDType::F32,
            ptr(&ids),
            4,
            START,
            ptr(&dout),
            40,
            8,
            mptr(&mut dw),
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
}
