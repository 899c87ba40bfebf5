//! The dropout kernel (`cuda/dropout.cu`) on the CPU emulator against the CPU
//! kernel, bit for bit: whole tensors and shards of every kind (partial in the
//! first, middle and last dims, single elements, runs shorter and longer than
//! a ChaCha block), stream offsets that are not a block's first word and that
//! pass 2^64 words, misaligned element addresses, in place, a stream read from a
//! device state when the kernel runs, and the refusals.

use crate::common;

use common::{dtype, emu, f64s, Buf, Rng};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::dropout as gpu;
use tpar_kernels::cuda::Launcher;
use tpar_kernels::dropout::{dropout, DropoutMask, ShardRuns};
use tpar_kernels::Float;

/// `(local, global, offset)` shards.
const SHARDS: &[(&[usize], &[usize], &[usize])] = &[
    (&[], &[], &[]),
    (&[1000], &[1000], &[0]),
    (&[37], &[100], &[21]),
    (&[5, 33], &[5, 33], &[0, 0]),
    (&[3, 33], &[8, 33], &[4, 0]),
    (&[5, 7], &[5, 33], &[0, 13]),
    (&[2, 3, 40], &[4, 9, 40], &[1, 5, 0]),
    (&[3, 1, 5, 2], &[4, 3, 5, 6], &[1, 2, 0, 4]),
    (&[2, 2, 2, 1], &[3, 2, 5, 3], &[1, 0, 2, 2]),
    (&[1, 1, 7], &[2, 2, 9], &[1, 1, 1]),
    (&[2, 0, 3], &[2, 4, 3], &[0, 1, 0]),
];

fn check<T: Float>(seed: u64) {
    let l: &dyn Launcher = emu();
    let dt = dtype::<T>();
    let mut rng = Rng(seed);
    for offset in [0, 5, 16 * 1000 + 3, u64::MAX - 40] {
        for p in [0.1, 0.5] {
            let mask = DropoutMask::new(seed, offset, p).unwrap();
            for &(local, global, at) in SHARDS {
                let runs = ShardRuns::new(local, global, at).unwrap();
                let n = runs.run * runs.runs;
                let x: Vec<T> = rng.vec(n, 2.0);
                let mut want = vec![T::default(); n];
                dropout(&mask, &runs, &x, &mut want).unwrap();
                let what =
                    format!("dropout {local:?} of {global:?} at {at:?}, offset {offset}, p {p}");
                for shift in [0, 1] {
                    let mut bx = Buf::new(&x, shift);
                    let mut by = Buf::<T>::zeros(n, shift);
                    // SAFETY: host buffers stand in for device memory (the emulator runs the
                    // kernel on this thread before returning), each holding the shard's elements.
                    unsafe { gpu::dropout(l, dt, &mask, &runs, bx.ptr(), by.ptr(), None) }.unwrap();
                    assert_eq!(f64s(&by.get()), f64s(&want), "{what} shift {shift}");
                    // in place
                    let px = bx.ptr();
                    // SAFETY: as above; `y` is `x`.
                    unsafe { gpu::dropout(l, dt, &mask, &runs, px, px, None) }.unwrap();
                    assert_eq!(f64s(&bx.get()), f64s(&want), "{what} shift {shift} in place");
                }
            }
        }
    }
}

/// With a device state, the kernel draws the state's stream at the state's offset plus
/// the mask's: a mask built for one seed at a relative offset, run against the state of
/// another seed and base, writes what the CPU kernel writes for that seed at their sum.
#[test]
fn a_device_state_is_read_when_the_kernel_runs() {
    let l: &dyn Launcher = emu();
    let dt = dtype::<f32>();
    let runs = ShardRuns::new(&[3, 33], &[8, 33], &[4, 0]).unwrap();
    let x: Vec<f32> = Rng(5).vec(99, 2.0);
    for (seed, base, rel) in [(9, 0, 21), (9, 1000, 21), (12, u64::MAX - 10, 48)] {
        let mut want = vec![0f32; 99];
        let full = DropoutMask::new(seed, base.wrapping_add(rel), 0.3).unwrap();
        dropout(&full, &runs, &x, &mut want).unwrap();
        let mask = DropoutMask::new(1, rel, 0.3).unwrap();
        let state = gpu::state_words(seed, base);
        let (mut bx, mut by) = (Buf::new(&x, 0), Buf::<f32>::zeros(99, 0));
        let mut bs = Buf::new(&state, 0);
        // SAFETY: host buffers stand in for device memory; the state holds its 5 words.
        unsafe { gpu::dropout(l, dt, &mask, &runs, bx.ptr(), by.ptr(), Some(bs.ptr())) }.unwrap();
        assert_eq!(by.get(), want, "seed {seed} base {base} rel {rel}");
    }
}

#[test]
fn matches_cpu_f32() {
    check::<f32>(1);
}

#[test]
fn matches_cpu_bf16() {
    check::<bf16>(2);
}

#[test]
fn matches_cpu_f16() {
    check::<f16>(3);
}

#[test]
fn shards_the_kernel_cannot_take_are_refused() {
    let l: &dyn Launcher = emu();
    let dt = dtype::<f32>();
    let mask = DropoutMask::new(0, 0, 0.5).unwrap();
    // Seven partial dims outside the runs.
    let local = [1, 1, 1, 1, 1, 1, 1, 2, 2];
    let local: Vec<usize> = local.iter().map(|&v| v + 1).collect();
    let global = vec![9; local.len()];
    let runs = ShardRuns::new(&local, &global, &vec![1; local.len()]).unwrap();
    assert!(runs.outer.len() > gpu::MAX_RANK);
    let n = runs.run * runs.runs;
    let (mut bx, mut by) = (Buf::new(&vec![1.0f32; n], 0), Buf::<f32>::zeros(n, 0));
    // SAFETY: refused before anything is launched; the buffers hold the shard anyway.
    let r = unsafe { gpu::dropout(l, dt, &mask, &runs, bx.ptr(), by.ptr(), None) };
    assert!(r.unwrap_err().to_string().contains("dims outside its runs"));
    // Fields that disagree (an extent of 0 with runs left): refused, nothing divided by 0.
    let runs = ShardRuns::new(&[2, 3, 4], &[4, 3, 8], &[1, 0, 4]).unwrap();
    let broken = ShardRuns { outer: vec![(0, 8)], ..runs };
    // SAFETY: refused before anything is launched.
    let r = unsafe { gpu::dropout(l, dt, &mask, &broken, bx.ptr(), by.ptr(), None) };
    assert!(r.unwrap_err().to_string().contains("do not multiply"));
}
