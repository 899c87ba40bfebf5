//! SDPA CUDA kernels (flash attention forward and backward), run in the CPU
//! emulator, against the f64 reference of the CPU op.

use crate::common;

use common::sdpa::{
    bwd_buffers_at, check_lse, max_rel, run_dense, shape, Inputs, MaskKind, MaskPlan, Ran,
};
use common::{emu, f64s, mptr, ptr};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::sdpa::{
    sdpa_backward, sdpa_backward_workspace_bytes, sdpa_forward, SdpaBwdBuffers, SdpaDevMask,
    SdpaFwdBuffers, SdpaPath,
};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::{Float, KernelError};

/// Batch `b` keeps `kv_len - 3b - 2` keys; head `bh` masks row `(5bh + 2) % q_len`.
const MASKS: MaskPlan = MaskPlan { pad_step: 3, pad_base: 2, row_step: 5 };

struct Case {
    s: SdpaShape,
    mask: MaskKind,
}

/// Tolerances (relative to the largest magnitude): (out, lse, gradients).
fn tols(dtype: CudaDType) -> (f64, f64, f64) {
    match dtype {
        CudaDType::F32 => (1e-5, 1e-5, 1e-5),
        CudaDType::BF16 => (1e-2, 1e-3, 1e-2),
        CudaDType::F16 => (2e-3, 1e-3, 2e-3),
    }
}

/// Runs forward and backward of `c` on the emulator and checks them against
/// the f64 reference on the same (rounded) inputs.
fn run<T: Float>(dtype: CudaDType, c: &Case, path: SdpaPath) {
    let s = &c.s;
    let x = Inputs::<T>::new(s, c.mask, MASKS);
    let (out_ref, lse_ref) = x.reference_forward(s);
    let (dq_ref, dk_ref, dv_ref) = x.reference_backward(s);

    let Ran { out: o, lse, g, .. } = run_dense(dtype, s, &x, path).unwrap();
    let (t_out, t_lse, t_grad) = tols(dtype);
    let what = format!("{dtype:?} {path:?} {s:?} mask {:?}", c.mask);
    let e = max_rel(&format!("out {what}"), &f64s(&o), &out_ref);
    eprintln!("out {what}: {e:.2e}");
    assert!(e <= t_out, "out {what}: rel err {e:e} > {t_out:e}");
    check_lse(&what, &lse, &lse_ref, t_lse);
    for (name, got, want) in
        [("dq", &g.dq, &dq_ref), ("dk", &g.dk, &dk_ref), ("dv", &g.dv, &dv_ref)]
    {
        let e = max_rel(&format!("{name} {what}"), &f64s(got), want);
        eprintln!("{name}: {e:.2e}");
        assert!(e <= t_grad, "{name} {what}: rel err {e:e} > {t_grad:e}");
    }
}

/// Causal + GQA + full additive mask, 37 queries x 45 keys (not tile multiples).
fn case_gqa_causal_full(head_dim: usize) -> Case {
    Case { s: shape(2, 4, 2, 37, 45, head_dim, head_dim, true), mask: MaskKind::Full }
}

/// Non-causal, key-padding mask, more queries than one tile.
fn case_padding(head_dim: usize) -> Case {
    Case { s: shape(2, 2, 1, 70, 45, head_dim, head_dim, false), mask: MaskKind::KeyPadding }
}

/// Causal, no mask, more queries than keys, MHA.
fn case_causal_plain(head_dim: usize) -> Case {
    Case { s: shape(1, 2, 2, 45, 37, head_dim, head_dim, true), mask: MaskKind::None }
}

#[test]
fn f32_simt() {
    run::<f32>(CudaDType::F32, &case_gqa_causal_full(64), SdpaPath::Auto);
    run::<f32>(CudaDType::F32, &case_padding(64), SdpaPath::Auto);
    run::<f32>(CudaDType::F32, &case_causal_plain(64), SdpaPath::Simt);
}

#[test]
fn bf16_tensor_core_d64() {
    run::<bf16>(CudaDType::BF16, &case_gqa_causal_full(64), SdpaPath::TensorCore);
    run::<bf16>(CudaDType::BF16, &case_padding(64), SdpaPath::TensorCore);
    run::<bf16>(CudaDType::BF16, &case_causal_plain(64), SdpaPath::Auto);
}

#[test]
fn bf16_tensor_core_d128() {
    let c = Case { s: shape(1, 2, 1, 80, 70, 128, 128, true), mask: MaskKind::Full };
    run::<bf16>(CudaDType::BF16, &c, SdpaPath::TensorCore);
}

#[test]
fn tensor_core_wide_forward() {
    // 128 query rows per forward block: two blocks, several key tiles.
    let c = Case { s: shape(1, 2, 1, 150, 140, 64, 64, true), mask: MaskKind::Full };
    run::<bf16>(CudaDType::BF16, &c, SdpaPath::TensorCoreWide);
    // head dim 128: q fragments read from shared memory at each step.
    let c = Case { s: shape(1, 2, 2, 130, 75, 128, 96, false), mask: MaskKind::KeyPadding };
    run::<f16>(CudaDType::F16, &c, SdpaPath::TensorCoreWide);
}

#[test]
fn full_tiles_without_mask() {
    // Several whole 64 x 64 tiles and no additive mask: the tensor-core kernels
    // skip the element masks in these (causal: below the diagonal), forward
    // and backward, at both head dims and both forward tilings.
    let none = |s| Case { s, mask: MaskKind::None };
    run::<bf16>(
        CudaDType::BF16,
        &none(shape(1, 2, 1, 200, 190, 64, 64, true)),
        SdpaPath::TensorCore,
    );
    run::<bf16>(
        CudaDType::BF16,
        &none(shape(1, 2, 2, 150, 192, 64, 64, false)),
        SdpaPath::TensorCoreWide,
    );
    run::<f16>(
        CudaDType::F16,
        &none(shape(1, 2, 1, 140, 140, 128, 128, true)),
        SdpaPath::TensorCore,
    );
    run::<bf16>(
        CudaDType::BF16,
        &none(shape(1, 1, 1, 160, 128, 128, 120, true)),
        SdpaPath::TensorCoreWide,
    );
}

#[test]
fn bf16_simt() {
    run::<bf16>(CudaDType::BF16, &case_gqa_causal_full(64), SdpaPath::Simt);
    run::<bf16>(CudaDType::BF16, &case_padding(64), SdpaPath::Simt);
}

#[test]
fn f16_tensor_core_and_simt() {
    run::<f16>(CudaDType::F16, &case_gqa_causal_full(64), SdpaPath::TensorCore);
    run::<f16>(CudaDType::F16, &case_causal_plain(64), SdpaPath::Simt);
}

#[test]
fn f32_simt_d128() {
    let c = Case { s: shape(1, 2, 1, 40, 50, 128, 128, false), mask: MaskKind::Full };
    run::<f32>(CudaDType::F32, &c, SdpaPath::Auto);
}

#[test]
fn uneven_head_dims() {
    // head_dim 40 / v_dim 24: tensor cores with the head dims padded to 64.
    let c = Case { s: shape(1, 2, 1, 30, 41, 40, 24, false), mask: MaskKind::KeyPadding };
    run::<bf16>(CudaDType::BF16, &c, SdpaPath::TensorCore);
    // head_dim 20 / v_dim 36: not multiples of 8, SIMT fallback.
    let c = Case { s: shape(1, 2, 2, 30, 41, 20, 36, false), mask: MaskKind::Full };
    run::<bf16>(CudaDType::BF16, &c, SdpaPath::Auto);
    // head dims above 128: SIMT with 8 chunks.
    let c = Case { s: shape(1, 1, 1, 20, 24, 200, 136, true), mask: MaskKind::None };
    run::<f32>(CudaDType::F32, &c, SdpaPath::Auto);
}

#[test]
fn empty_sequences() {
    // No keys: zeros, lse = -inf, zero dq.
    for path in [SdpaPath::Simt, SdpaPath::TensorCore] {
        run::<bf16>(
            CudaDType::BF16,
            &Case { s: shape(1, 2, 1, 5, 0, 64, 64, false), mask: MaskKind::None },
            path,
        );
        // No queries: zero dk, dv.
        run::<bf16>(
            CudaDType::BF16,
            &Case { s: shape(1, 2, 1, 0, 9, 64, 64, true), mask: MaskKind::None },
            path,
        );
    }
}

fn expect_bad(r: tpar_kernels::Result<()>, what: &str) {
    match r {
        Err(KernelError::BadArguments { .. }) => {}
        other => panic!("{what}: expected BadArguments, got {other:?}"),
    }
}

#[test]
fn bad_arguments() {
    let emu = emu();
    let s = shape(1, 2, 1, 8, 8, 16, 16, false);
    let buf = vec![0f32; 2 * 8 * 16];
    let p = ptr(&buf);
    let mut lse = vec![0f32; 16];
    let fwd = |s: &SdpaShape, mask: Option<SdpaDevMask>, lse: DevPtr, dtype, path| {
        let b = SdpaFwdBuffers { q: p, k: p, v: p, mask, out: p, lse, layout: Default::default() };
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { sdpa_forward(emu, dtype, s, &b, path) }
    };
    let lp = mptr(&mut lse);
    // q heads not a multiple of kv heads
    expect_bad(
        fwd(&shape(1, 3, 2, 8, 8, 16, 16, false), None, lp, CudaDType::F32, SdpaPath::Auto),
        "gqa",
    );
    // head dim above the limit
    expect_bad(
        fwd(&shape(1, 1, 1, 1, 1, 300, 16, false), None, lp, CudaDType::F32, SdpaPath::Auto),
        "dim",
    );
    // tensor cores asked for f32
    expect_bad(fwd(&s, None, lp, CudaDType::F32, SdpaPath::TensorCore), "tc f32");
    // tensor cores asked for a head dim that is not a multiple of 8
    expect_bad(
        fwd(&shape(1, 2, 1, 8, 8, 12, 16, false), None, lp, CudaDType::BF16, SdpaPath::TensorCore),
        "tc dim",
    );
    // a mask too short for its strides
    let m = SdpaDevMask { data: p, len: 63, batch_stride: 0, head_stride: 0, row_stride: 8 };
    expect_bad(fwd(&s, Some(m), lp, CudaDType::F32, SdpaPath::Auto), "mask");
    // null and misaligned buffers
    expect_bad(fwd(&s, None, 0, CudaDType::F32, SdpaPath::Auto), "null lse");
    expect_bad(fwd(&s, None, lp + 2, CudaDType::F32, SdpaPath::Auto), "misaligned lse");
    // a workspace too small
    let need = sdpa_backward_workspace_bytes(&s).unwrap();
    let ws = vec![0f32; need / 4 + 4];
    let b = SdpaBwdBuffers {
        lse: lp,
        workspace: ptr(&ws).next_multiple_of(16),
        ..bwd_buffers_at(p, need - 4)
    };
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    expect_bad(unsafe { sdpa_backward(emu, CudaDType::F32, &s, &b, SdpaPath::Auto) }, "workspace");
}
