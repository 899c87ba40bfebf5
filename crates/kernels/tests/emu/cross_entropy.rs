//! `cuda/cross_entropy.cu` on the CPU emulator against the CPU kernels of
//! `tpar_kernels::cross_entropy`, unsharded and vocab-parallel.

use crate::common;

use common::{assert_close, dtype, emu, f64s, mptr, ptr, tol, Rng};
use half::{bf16, f16};
use tpar_kernels::cross_entropy as cpu;
use tpar_kernels::cuda::raw::cross_entropy::{self as k, NO_ERROR};
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::{Float, KernelError};

const IGNORE: i64 = -100;

// Test data of this file, on the shared generator.
impl Rng {
    /// Targets in `[0, vocab)`, with `ignored` rows set to IGNORE.
    fn targets(&mut self, rows: usize, vocab: usize, ignored: &[usize]) -> Vec<i64> {
        (0..rows)
            .map(
                |r| if ignored.contains(&r) { IGNORE } else { (self.next() % vocab as u64) as i64 },
            )
            .collect()
    }
}

/// Columns `[start, end)` of a row-major `[rows, cols]` matrix.
fn columns<T: Copy>(x: &[T], cols: usize, start: usize, end: usize) -> Vec<T> {
    x.chunks(cols).flat_map(|r| r[start..end].iter().copied()).collect()
}

/// GPU forward vs CPU forward; returns the CPU lse.
fn check_forward<T: Float<Acc = f32>>(seed: u64, rows: usize, vocab: usize, ignored: &[usize]) {
    let mut rng = Rng(seed);
    let logits: Vec<T> = rng.vec(rows * vocab, 4.0);
    let targets = rng.targets(rows, vocab, ignored);
    let (mut want_loss, mut want_lse) = (vec![0f32; rows], vec![0f32; rows]);
    let want_count = cpu::cross_entropy_forward(
        &logits,
        rows,
        vocab,
        &targets,
        IGNORE,
        &mut want_loss,
        &mut want_lse,
    )
    .unwrap();
    let (mut loss, mut lse, mut count, mut err) =
        (vec![9f32; rows], vec![9f32; rows], [0i32], [NO_ERROR]);
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::cross_entropy_forward(
            emu(),
            dtype::<T>(),
            ptr(&logits),
            rows,
            vocab,
            ptr(&targets),
            IGNORE,
            mptr(&mut loss),
            mptr(&mut lse),
            mptr(&mut count),
            mptr(&mut err),
        )
        .unwrap();
    }
    let what = format!("forward {} [{rows}, {vocab}]", T::NAME);
    assert_eq!(err[0], NO_ERROR, "{what}: error slot");
    assert_eq!(count[0] as usize, want_count, "{what}: count");
    assert_close(&format!("{what} loss"), &f64s(&loss), &f64s(&want_loss), tol::<T>());
    assert_close(&format!("{what} lse"), &f64s(&lse), &f64s(&want_lse), tol::<T>());
    for &r in ignored {
        assert_eq!(loss[r], 0.0, "{what}: ignored row {r}");
    }
}

#[test]
fn forward_matches_cpu() {
    // Block per row (wide rows) and warp per row (narrow rows, several blocks).
    check_forward::<f32>(1, 7, 1000, &[2, 5]);
    check_forward::<bf16>(2, 7, 1000, &[2, 5]);
    check_forward::<f16>(3, 7, 1000, &[0]);
    check_forward::<f32>(4, 3, 5003, &[]);
    check_forward::<f32>(5, 13, 100, &[12]);
    check_forward::<bf16>(6, 19, 37, &[3, 4]);
}

fn check_backward<T: Float<Acc = f32>>(seed: u64, rows: usize, vocab: usize, per_row_scale: bool) {
    let mut rng = Rng(seed);
    let logits: Vec<T> = rng.vec(rows * vocab, 4.0);
    let targets = rng.targets(rows, vocab, &[1]);
    let (mut loss, mut lse) = (vec![0f32; rows], vec![0f32; rows]);
    cpu::cross_entropy_forward(&logits, rows, vocab, &targets, IGNORE, &mut loss, &mut lse)
        .unwrap();
    let scale: Vec<f32> = if per_row_scale {
        (0..rows).map(|r| 0.5 + r as f32 * 0.25).collect()
    } else {
        vec![0.125]
    };
    let mut want = vec![T::default(); rows * vocab];
    cpu::cross_entropy_backward(&logits, rows, vocab, &targets, 0, IGNORE, &lse, &scale, &mut want)
        .unwrap();
    let mut got = vec![T::from_f64(7.0); rows * vocab];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::cross_entropy_backward(
            emu(),
            dtype::<T>(),
            ptr(&logits),
            rows,
            vocab,
            ptr(&targets),
            0,
            IGNORE,
            ptr(&lse),
            ptr(&scale),
            scale.len(),
            mptr(&mut got),
        )
        .unwrap();
    }
    let what = format!("backward {} [{rows}, {vocab}] per-row {per_row_scale}", T::NAME);
    assert_close(&what, &f64s(&got), &f64s(&want), tol::<T>());
    // In place: dlogits overwrites the logits.
    let mut inplace = logits.clone();
    let p = mptr(&mut inplace);
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::cross_entropy_backward(
            emu(),
            dtype::<T>(),
            p,
            rows,
            vocab,
            ptr(&targets),
            0,
            IGNORE,
            ptr(&lse),
            ptr(&scale),
            scale.len(),
            p,
        )
        .unwrap();
    }
    assert_close(&format!("{what} in place"), &f64s(&inplace), &f64s(&want), tol::<T>());
}

#[test]
fn backward_matches_cpu() {
    check_backward::<f32>(11, 7, 1000, true);
    check_backward::<bf16>(12, 7, 1000, false);
    check_backward::<f16>(13, 5, 999, true);
    check_backward::<f32>(14, 11, 61, false);
    check_backward::<bf16>(15, 9, 130, true);
}

/// The vocab-parallel composition on three shards of a 1000-class vocab,
/// with the collectives done on the host.
fn vocab_parallel<T: Float<Acc = f32>>(seed: u64) {
    let (rows, vocab) = (7, 1000);
    let shards = [(0usize, 300usize), (300, 700), (700, 1000)];
    let mut rng = Rng(seed);
    let logits: Vec<T> = rng.vec(rows * vocab, 4.0);
    let mut targets = rng.targets(rows, vocab, &[2, 5]);
    // One target in each shard at least.
    targets[0] = 10;
    targets[1] = 450;
    targets[3] = 999;
    let name = T::NAME;
    let mut stats = Vec::new();
    for &(s, e) in &shards {
        let v = e - s;
        let shard = columns(&logits, vocab, s, e);
        let (mut wm, mut ws, mut wt) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
        cpu::ce_local_stats(
            &shard, rows, v, &targets, s as i64, vocab, IGNORE, &mut wm, &mut ws, &mut wt,
        )
        .unwrap();
        let (mut m, mut se, mut tl, mut err) =
            (vec![0f32; rows], vec![0f32; rows], vec![5f32; rows], [NO_ERROR]);
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe {
            k::ce_local_stats(
                emu(),
                dtype::<T>(),
                ptr(&shard),
                rows,
                v,
                ptr(&targets),
                s as i64,
                vocab,
                IGNORE,
                mptr(&mut m),
                mptr(&mut se),
                mptr(&mut tl),
                mptr(&mut err),
            )
            .unwrap();
        }
        let what = format!("stats {name} shard [{s}, {e})");
        assert_eq!(err[0], NO_ERROR, "{what}: error slot");
        assert_close(&format!("{what} max"), &f64s(&m), &f64s(&wm), 0.0);
        assert_close(&format!("{what} sumexp"), &f64s(&se), &f64s(&ws), tol::<T>());
        assert_close(&format!("{what} target_logit"), &f64s(&tl), &f64s(&wt), 0.0);
        stats.push((m, se, tl));
    }

    // all-reduce MAX, rescale, all-reduce SUM.
    let gmax: Vec<f32> =
        (0..rows).map(|r| stats.iter().map(|s| s.0[r]).fold(f32::NEG_INFINITY, f32::max)).collect();
    let mut sum = vec![0f32; rows];
    let mut tl = vec![0f32; rows];
    for (m, se, t) in &stats {
        let mut se2 = se.clone();
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { k::ce_rescale(emu(), ptr(m), mptr(&mut se2), ptr(&gmax), rows).unwrap() };
        let mut want = se.clone();
        cpu::ce_rescale(m, &mut want, &gmax).unwrap();
        assert_close(&format!("rescale {name}"), &f64s(&se2), &f64s(&want), 1e-5);
        for r in 0..rows {
            sum[r] += se2[r];
            tl[r] += t[r];
        }
    }
    let mut lse = vec![0f32; rows];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { k::ce_lse(emu(), ptr(&gmax), ptr(&sum), mptr(&mut lse), rows).unwrap() };
    let (mut loss, mut count) = (vec![3f32; rows], [0i32]);
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::ce_loss(
            emu(),
            ptr(&lse),
            ptr(&tl),
            ptr(&targets),
            IGNORE,
            rows,
            mptr(&mut loss),
            mptr(&mut count),
        )
        .unwrap();
    }
    let (mut want_loss, mut want_lse) = (vec![0f32; rows], vec![0f32; rows]);
    let want_count = cpu::cross_entropy_forward(
        &logits,
        rows,
        vocab,
        &targets,
        IGNORE,
        &mut want_loss,
        &mut want_lse,
    )
    .unwrap();
    assert_eq!(count[0] as usize, want_count, "vocab-parallel {name}: count");
    assert_close(&format!("vocab-parallel {name} lse"), &f64s(&lse), &f64s(&want_lse), tol::<T>());
    assert_close(
        &format!("vocab-parallel {name} loss"),
        &f64s(&loss),
        &f64s(&want_loss),
        tol::<T>(),
    );

    // The same statistics by folding shards with ce_merge.
    let (mut mm, mut ms) = (stats[0].0.clone(), stats[0].1.clone());
    let (mut cm, mut cs) = (mm.clone(), ms.clone());
    for (m, se, _) in &stats[1..] {
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { k::ce_merge(emu(), mptr(&mut mm), mptr(&mut ms), ptr(m), ptr(se), rows).unwrap() };
        cpu::ce_merge(&mut cm, &mut cs, m, se).unwrap();
    }
    assert_close(&format!("merge {name} max"), &f64s(&mm), &f64s(&cm), 0.0);
    assert_close(&format!("merge {name} sumexp"), &f64s(&ms), &f64s(&cs), 1e-5);
    let mut lse2 = vec![0f32; rows];
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { k::ce_lse(emu(), ptr(&mm), ptr(&ms), mptr(&mut lse2), rows).unwrap() };
    let mut want_lse2 = vec![0f32; rows];
    cpu::ce_lse(&cm, &cs, &mut want_lse2).unwrap();
    assert_close(&format!("merge {name} lse"), &f64s(&lse2), &f64s(&want_lse2), 1e-5);

    // Backward on each shard with the global lse; the shards together are the
    // unsharded gradient.
    let scale = [0.2f32];
    let mut full = vec![T::default(); rows * vocab];
    cpu::cross_entropy_backward(
        &logits, rows, vocab, &targets, 0, IGNORE, &want_lse, &scale, &mut full,
    )
    .unwrap();
    for &(s, e) in &shards {
        let v = e - s;
        let shard = columns(&logits, vocab, s, e);
        let mut want = vec![T::default(); rows * v];
        cpu::cross_entropy_backward(
            &shard, rows, v, &targets, s as i64, IGNORE, &want_lse, &scale, &mut want,
        )
        .unwrap();
        assert_eq!(f64s(&want), f64s(&columns(&full, vocab, s, e)), "CPU shard [{s}, {e})");
        let mut got = vec![T::default(); rows * v];
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe {
            k::cross_entropy_backward(
                emu(),
                dtype::<T>(),
                ptr(&shard),
                rows,
                v,
                ptr(&targets),
                s as i64,
                IGNORE,
                ptr(&want_lse),
                ptr(&scale),
                1,
                mptr(&mut got),
            )
            .unwrap();
        }
        let what = format!("backward {name} shard [{s}, {e})");
        assert_close(&what, &f64s(&got), &f64s(&want), tol::<T>());
    }
}

#[test]
fn vocab_parallel_pieces_f32() {
    vocab_parallel::<f32>(21);
}

#[test]
fn vocab_parallel_pieces_bf16() {
    vocab_parallel::<bf16>(22);
}

#[test]
fn invalid_targets_set_the_error_slot() {
    let (rows, vocab) = (6, 50);
    let logits: Vec<f32> = Rng(31).vec(rows * vocab, 1.0);
    let targets = vec![3, IGNORE, 50, 7, -5, 1000];
    let (mut loss, mut lse, mut err) = (vec![0f32; rows], vec![0f32; rows], [NO_ERROR]);
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::cross_entropy_forward(
            emu(),
            CudaDType::F32,
            ptr(&logits),
            rows,
            vocab,
            ptr(&targets),
            IGNORE,
            mptr(&mut loss),
            mptr(&mut lse),
            0,
            mptr(&mut err),
        )
        .unwrap();
    }
    assert_eq!(err[0], 2, "first invalid target row");
    let (mut m, mut se, mut tl, mut err) =
        (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows], [NO_ERROR]);
    let shard = columns(&logits, vocab, 0, 20);
    let good = vec![3, IGNORE, 49, 7, 25, 0];
    for (t, want) in [(&targets, 2), (&good, NO_ERROR)] {
        err[0] = NO_ERROR;
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe {
            k::ce_local_stats(
                emu(),
                CudaDType::F32,
                ptr(&shard),
                rows,
                20,
                ptr(t),
                0,
                vocab,
                IGNORE,
                mptr(&mut m),
                mptr(&mut se),
                mptr(&mut tl),
                mptr(&mut err),
            )
            .unwrap();
        }
        assert_eq!(err[0], want, "stats error slot for {t:?}");
    }
    // Without a slot the launch still runs.
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        k::cross_entropy_forward(
            emu(),
            CudaDType::F32,
            ptr(&logits),
            rows,
            vocab,
            ptr(&targets),
            IGNORE,
            mptr(&mut loss),
            mptr(&mut lse),
            0,
            0,
        )
        .unwrap();
    }
}

#[test]
fn bad_arguments_are_errors() {
    let logits = vec![0f32; 40];
    let targets = vec![0i64; 4];
    let mut out = vec![0f32; 4];
    let o = mptr(&mut out);
    // Shard outside the vocab.
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::ce_local_stats(
            emu(),
            CudaDType::F32,
            ptr(&logits),
            4,
            10,
            ptr(&targets),
            5,
            12,
            IGNORE,
            o,
            o,
            o,
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::ce_local_stats(
            emu(),
            CudaDType::F32,
            ptr(&logits),
            4,
            10,
            ptr(&targets),
            -1,
            12,
            IGNORE,
            o,
            o,
            o,
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // row_scale of the wrong length.
    let mut d = vec![0f32; 40];
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::cross_entropy_backward(
            emu(),
            CudaDType::F32,
            ptr(&logits),
            4,
            10,
            ptr(&targets),
            0,
            IGNORE,
            o,
            o,
            3,
            mptr(&mut d),
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // Too many rows for the kernels' i32 indices.
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::cross_entropy_forward(
            emu(),
            CudaDType::F32,
            ptr(&logits),
            1 << 31,
            1,
            ptr(&targets),
            IGNORE,
            o,
            o,
            0,
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    // A null buffer.
    // SAFETY: the argument checks reject this call before anything is launched (asserted
    // below).
    let r = unsafe {
        k::cross_entropy_forward(
            emu(),
            CudaDType::BF16,
            0,
            4,
            10,
            ptr(&targets),
            IGNORE,
            o,
            o,
            0,
            0,
        )
    };
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
}
