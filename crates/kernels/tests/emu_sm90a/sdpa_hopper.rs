//! The Hopper attention forward (`cuda/sdpa_hopper.cu`: TMA, mbarriers,
//! wgmma from shared memory and from registers, warp specialization), run in
//! the CPU emulator as an `sm_90a` device, against the f64 reference of the
//! CPU op on the same rounded inputs and against the tested `mma.sync`
//! tensor-core kernel: bf16 and f16, head dims 64 and 128, causal or not,
//! GQA, key-padding and full additive masks (with fully masked rows), ragged
//! lengths over several q tiles and key tiles; the backward pass on
//! `SdpaPath::Hopper` from its out and lse; the checked ops following
//! `TPAR_SDPA=hopper`, and the refusals.

use crate::common;
use crate::recording;

use common::sdpa::{
    check_lse, max_rel, same_dim_shape as shape, Inputs, MaskKind, MaskPlan, Workspace,
};
use common::{cvt, emu, f64s, mptr, ptr};
use std::cell::RefCell;

use half::{bf16, f16};
use recording::Recording;
use tpar_kernels::cuda::raw::sdpa::{
    sdpa_backward, sdpa_backward_workspace_bytes, sdpa_forward, SdpaBwdBuffers, SdpaFwdBuffers,
    SdpaPath,
};
use tpar_kernels::cuda::raw::sdpa_hopper::{self, EMU_ARCH_ENV};
use tpar_kernels::cuda::raw::sdpa_hopper_bwd;
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::{Float, KernelError};

/// Makes the emulator an `sm_90a` device for this process.
fn sm90a() {
    // Every test of this binary sets the same value before launching.
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
}

/// Batch `b` keeps `kv_len - 37b - 5` keys (past a key tile's edge for `b >= 1`);
/// head `bh` masks row `(37bh + 2) % q_len`.
const MASKS: MaskPlan = MaskPlan { pad_step: 37, pad_base: 5, row_step: 37 };

/// The inputs of one case (common::sdpa's, masks placed by [`MASKS`]).
fn inputs<T: Float>(s: &SdpaShape, kind: MaskKind) -> Inputs<T> {
    Inputs::new(s, kind, MASKS)
}

/// One forward on the emulator: (out, lse).
fn forward<T: Float>(
    dtype: CudaDType,
    s: &SdpaShape,
    x: &Inputs<T>,
    path: SdpaPath,
) -> Result<(Vec<f64>, Vec<f32>), KernelError> {
    let nq = s.batch * s.q_heads * s.q_len;
    let mut o = vec![T::from_f64(7.0); nq * s.v_dim];
    let mut lse = vec![7.0f32; nq];
    let b = x.fwd_buffers(&mut o, &mut lse);
    // SAFETY: host buffers stand in for device memory (the emulator runs the
    // kernel on this thread before returning), each holding every element the
    // call's sizes reach.
    unsafe { sdpa_forward(emu(), dtype, s, &b, path)? };
    Ok((f64s(&o), lse))
}

/// The Hopper forward of `s` against the f64 reference and against the
/// tensor-core kernel.
fn check<T: Float>(dtype: CudaDType, s: SdpaShape, kind: MaskKind) {
    sm90a();
    let x = inputs::<T>(&s, kind);
    let (out_ref, lse_ref) = x.reference_forward(&s);
    let what = format!("{dtype:?} {s:?} mask {kind:?}");
    let (out, lse) = forward(dtype, &s, &x, SdpaPath::Hopper).unwrap();
    let tol = if dtype == CudaDType::BF16 { 1e-2 } else { 2e-3 };
    let e = max_rel(&format!("hopper out {what}"), &out, &out_ref);
    eprintln!("hopper out {what}: {e:.2e} against f64");
    assert!(e <= tol, "hopper out {what}: rel err {e:e} > {tol:e}");
    check_lse(&format!("hopper {what}"), &lse, &lse_ref, 1e-3);

    let (out_tc, lse_tc) = forward(dtype, &s, &x, SdpaPath::TensorCore).unwrap();
    let e = max_rel(&format!("hopper vs tc out {what}"), &out, &out_tc);
    eprintln!("hopper out {what}: {e:.2e} against the tensor-core kernel");
    assert!(e <= tol, "hopper vs tensor-core out {what}: rel err {e:e} > {tol:e}");
    let lse_tc: Vec<f64> = lse_tc.iter().map(|&v| v as f64).collect();
    check_lse(&format!("hopper vs tc {what}"), &lse, &lse_tc, 1e-3);
}

#[test]
fn bf16_d64_gqa_causal_full_mask() {
    // 2 q tiles (130 rows) x 2 key tiles (200 keys), GQA 4:2, a fully masked
    // row per head, causal: the second q tile visits both key tiles, the
    // first only the diagonal one.
    check::<bf16>(CudaDType::BF16, shape(1, 4, 2, 130, 200, 64, true), MaskKind::Full);
}

#[test]
fn f16_d64_causal_more_keys_than_rows() {
    // 3 key tiles, 1 q tile: the causal walk stops after the first key tile.
    check::<f16>(CudaDType::F16, shape(1, 2, 1, 100, 300, 64, true), MaskKind::None);
}

#[test]
fn f16_d128_key_padding_two_batches() {
    // Non-causal, padded keys per batch (the second batch's past a tile edge).
    check::<f16>(CudaDType::F16, shape(2, 2, 1, 70, 200, 128, false), MaskKind::KeyPadding);
}

#[test]
fn bf16_d128_causal_more_rows_than_keys() {
    // sq > skv: 2 q tiles, 2 key tiles (the second ragged), no mask.
    check::<bf16>(CudaDType::BF16, shape(1, 2, 2, 200, 150, 128, true), MaskKind::None);
}

#[test]
fn bf16_d64_plain_whole_tiles() {
    // Whole 128-row / 128-key tiles, no mask, not causal: no element masks.
    check::<bf16>(CudaDType::BF16, shape(1, 1, 1, 256, 256, 64, false), MaskKind::None);
}

#[test]
fn long_key_sequences_wrap_the_ring() {
    // 6 key tiles through head dim 64's 3-stage ring, 5 through head dim
    // 128's 2-stage ring: every stage is refilled, the barriers' phases flip.
    check::<bf16>(CudaDType::BF16, shape(1, 1, 1, 40, 700, 64, false), MaskKind::KeyPadding);
    check::<f16>(CudaDType::F16, shape(1, 2, 1, 20, 520, 128, false), MaskKind::None);
    // causal, 3 q tiles: the last visits 3 key tiles (the first two whole)
    check::<bf16>(CudaDType::BF16, shape(1, 1, 1, 300, 300, 64, true), MaskKind::Full);
}

#[test]
fn refusals_name_the_reason() {
    sm90a();
    let expect_bad =
        |r: Result<(Vec<f64>, Vec<f32>), KernelError>, what: &str, needle: &str| match r {
            Err(KernelError::BadArguments { what: msg, .. }) => {
                assert!(msg.contains(needle), "{what}: {msg:?} does not name {needle:?}")
            }
            other => panic!("{what}: expected BadArguments, got {other:?}"),
        };
    let s = shape(1, 2, 1, 20, 30, 64, false);
    let xf = inputs::<f32>(&s, MaskKind::None);
    expect_bad(forward(CudaDType::F32, &s, &xf, SdpaPath::Hopper), "f32", "F32");
    let s96 = shape(1, 2, 1, 20, 30, 96, false);
    let x96 = inputs::<bf16>(&s96, MaskKind::None);
    expect_bad(forward(CudaDType::BF16, &s96, &x96, SdpaPath::Hopper), "d96", "head_dim 96");
    // the generic checks still apply on the Hopper path
    let bad_heads = SdpaShape { kv_heads: 3, ..s };
    let x = inputs::<bf16>(&s, MaskKind::None);
    expect_bad(
        forward(CudaDType::BF16, &bad_heads, &x, SdpaPath::Hopper),
        "heads",
        "multiple of kv_heads",
    );
    // a launcher that does not run sm_90a kernels is named
    let b = SdpaFwdBuffers {
        q: 4096,
        k: 8192,
        v: 12288,
        mask: None,
        out: 16384,
        lse: 20480,
        layout: Default::default(),
    };
    struct Plain;
    impl tpar_kernels::cuda::Launcher for Plain {
        fn describe(&self) -> String {
            "cuda:0 (sm_90, NVIDIA H100)".into()
        }
        fn compile_arch(&self) -> Option<tpar_kernels::cuda::Arch> {
            tpar_kernels::cuda::Arch::parse("sm_90")
        }
        unsafe fn launch_raw(
            &self,
            _: &str,
            _: &tpar_kernels::cuda::LaunchConfig,
            _: &[u8],
        ) -> tpar_kernels::Result<()> {
            panic!("nothing may launch")
        }
    }
    let why = sdpa_hopper::unsupported(&Plain, CudaDType::BF16, &s, &b).unwrap();
    assert!(why.contains("sm_90a"), "{why}");
    assert!(sdpa_hopper::unsupported(emu(), CudaDType::BF16, &s, &b).is_none());
    // SAFETY: refused before any launch.
    let r = unsafe { sdpa_hopper::sdpa_forward(&Plain, CudaDType::BF16, &s, &b) };
    assert!(r.unwrap_err().to_string().contains("sm_90a"));
}

/// The backward pass of `x.dout` for `s` on `path` from the Hopper
/// forward's out and lse: (dq, dk, dv).
fn backward<T: Float>(
    dtype: CudaDType,
    s: &SdpaShape,
    x: &Inputs<T>,
    fwd: &(Vec<f64>, Vec<f32>),
    path: SdpaPath,
) -> [Vec<f64>; 3] {
    let out: Vec<T> = cvt(&fwd.0);
    let mut dq = vec![T::from_f64(7.0); x.q.len()];
    let mut dk = vec![T::from_f64(7.0); x.k.len()];
    let mut dv = vec![T::from_f64(7.0); x.v.len()];
    let mut ws = Workspace::new(s);
    let b = SdpaBwdBuffers {
        q: ptr(&x.q),
        k: ptr(&x.k),
        v: ptr(&x.v),
        mask: x.dev_mask(),
        out: ptr(&out),
        lse: ptr(&fwd.1),
        dout: ptr(&x.dout),
        dq: mptr(&mut dq),
        dk: mptr(&mut dk),
        dv: mptr(&mut dv),
        workspace: ws.ptr(),
        workspace_bytes: ws.bytes,
        layout: Default::default(),
    };
    let rec = Recording::for_host_memory(None);
    // SAFETY: host buffers stand in for device memory, each holding every
    // element the call's sizes reach; the workspace is 16-byte aligned.
    unsafe { sdpa_backward(&rec, dtype, s, &b, path).unwrap() };
    LAST_BACKWARD.with(|l| *l.borrow_mut() = rec.take_names());
    assert!(ws.guard_intact(), "the {path:?} backward of {s:?} wrote past its workspace");
    [f64s(&dq), f64s(&dk), f64s(&dv)]
}

thread_local! {
    /// The kernels the last [`backward`] call of this thread launched.
    static LAST_BACKWARD: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Forward and backward on `SdpaPath::Hopper` against the f64 reference: the
/// Hopper backward where it takes the call, the tensor-core backward (from
/// the Hopper forward's lse) where it does not.
fn check_train<T: Float>(dtype: CudaDType, s: SdpaShape, kind: MaskKind, hopper_bwd: bool) {
    sm90a();
    let x = inputs::<T>(&s, kind);
    let grads_ref = x.reference_backward(&s);
    let b = SdpaBwdBuffers {
        q: 4096,
        k: 8192,
        v: 12288,
        mask: None,
        out: 16384,
        lse: 20480,
        dout: 24576,
        dq: 28672,
        dk: 32768,
        dv: 36864,
        workspace: 40960,
        workspace_bytes: 1 << 20,
        layout: Default::default(),
    };
    let takes = sdpa_hopper_bwd::unsupported(emu(), dtype, &s, &b).is_none();
    assert_eq!(takes, hopper_bwd, "the Hopper backward's verdict on {s:?}");
    let fwd = forward(dtype, &s, &x, SdpaPath::Hopper).unwrap();
    let grads = backward(dtype, &s, &x, &fwd, SdpaPath::Hopper);
    // The kernels that ran: the Hopper backward's where it takes the call
    // (after the shared pre kernel, then its own dq convert), else the
    // tensor-core one.
    let ran = LAST_BACKWARD.with(|l| l.borrow().clone());
    let hopper_ran = ran.iter().any(|k| k.starts_with("tpar_sdpa_bwd_hopper"));
    assert_eq!(hopper_ran, hopper_bwd, "backward kernels launched: {ran:?}");
    if hopper_bwd {
        let sfx = dtype.suffix();
        let want = [
            format!("tpar_sdpa_bwd_pre_strided_{sfx}"),
            format!("tpar_sdpa_bwd_hopper{}_{sfx}", s.head_dim),
            format!("tpar_sdpa_bwd_hopper_dq_{sfx}"),
        ];
        assert_eq!(ran, want, "the Hopper backward's kernels");
    }
    let tol = if dtype == CudaDType::BF16 { 1e-2 } else { 2e-3 };
    let what = format!("{dtype:?} {s:?} mask {kind:?}");
    let (dq_ref, dk_ref, dv_ref) = grads_ref;
    for (name, got, want) in
        [("dq", &grads[0], &dq_ref), ("dk", &grads[1], &dk_ref), ("dv", &grads[2], &dv_ref)]
    {
        let e = max_rel(&format!("{name} {what}"), got, want);
        eprintln!("{name} {what}: {e:.2e} against f64");
        assert!(e <= tol, "{name} {what}: rel err {e:e} > {tol:e}");
    }
}

#[test]
fn backward_on_the_hopper_path() {
    // the Hopper backward takes these (bf16 / f16, both head dims, GQA,
    // causal with a full mask, key padding)
    check_train::<bf16>(CudaDType::BF16, shape(1, 2, 1, 70, 140, 64, true), MaskKind::Full, true);
    check_train::<f16>(
        CudaDType::F16,
        shape(1, 2, 2, 40, 70, 128, false),
        MaskKind::KeyPadding,
        true,
    );
}

#[test]
fn the_checked_ops_follow_tpar_sdpa() {
    use tpar_kernels::cuda::emu::EmulatedGpu;
    use tpar_kernels::cuda::ops::sdpa as ops;
    use tpar_kernels::cuda::DeviceBuffer;
    sm90a();
    // SAFETY (edition 2021 API): set before this binary's first checked
    // attention call reads it (no other test here calls the checked ops).
    std::env::set_var(ops::SDPA_BACKEND_ENV, "hopper");
    assert_eq!(ops::sdpa_backend(), ops::SdpaBackend::Hopper);
    assert_eq!(ops::SdpaBackend::parse("mma"), Some(ops::SdpaBackend::Mma));
    assert_eq!(ops::SdpaBackend::parse("flash"), None);
    let dev = EmulatedGpu::open(0).unwrap();
    // forward and backward through the checked ops (SdpaPath::Auto): (out, lse), [dq, dk, dv]
    let run = |s: &SdpaShape| {
        let x = inputs::<bf16>(s, MaskKind::KeyPadding);
        let (m, [bs, hs, rs]) = x.mask.as_ref().unwrap();
        let nq = s.batch * s.q_heads * s.q_len;
        let up = |v: &[bf16]| DeviceBuffer::from_host(&dev, v).unwrap();
        let (q, k, v, mask, gd) = (up(&x.q), up(&x.k), up(&x.v), up(m), up(&x.dout));
        let mut out = DeviceBuffer::zeros(&dev, nq * s.v_dim * 2).unwrap();
        let mut lse = DeviceBuffer::zeros(&dev, nq * 4).unwrap();
        let mut dq = DeviceBuffer::zeros(&dev, x.q.len() * 2).unwrap();
        let mut dk = DeviceBuffer::zeros(&dev, x.k.len() * 2).unwrap();
        let mut dv = DeviceBuffer::zeros(&dev, x.v.len() * 2).unwrap();
        let ws_bytes = sdpa_backward_workspace_bytes(s).unwrap();
        let mut ws = DeviceBuffer::zeros(&dev, ws_bytes).unwrap();
        let mask_view = || ops::SdpaMaskView {
            data: mask.as_slice(),
            batch_stride: *bs,
            head_stride: *hs,
            row_stride: *rs,
        };
        let views = ops::SdpaFwdViews {
            q: q.as_slice(),
            k: k.as_slice(),
            v: v.as_slice(),
            mask: Some(mask_view()),
            out: out.as_slice_mut(),
            lse: lse.as_slice_mut(),
            layout: Default::default(),
        };
        ops::sdpa_forward(dev.as_ref(), CudaDType::BF16, s, views, SdpaPath::Auto).unwrap();
        let views = ops::SdpaBwdViews {
            q: q.as_slice(),
            k: k.as_slice(),
            v: v.as_slice(),
            mask: Some(mask_view()),
            out: out.as_slice(),
            lse: lse.as_slice(),
            dout: gd.as_slice(),
            grads: ops::SdpaGrads::Separate {
                dq: dq.as_slice_mut(),
                dk: dk.as_slice_mut(),
                dv: dv.as_slice_mut(),
            },
            workspace: ws.as_slice_mut(),
            layout: Default::default(),
        };
        ops::sdpa_backward(dev.as_ref(), CudaDType::BF16, s, views, SdpaPath::Auto).unwrap();
        let get = |b: &DeviceBuffer, n: usize| {
            let mut h = vec![bf16::ZERO; n];
            b.as_slice().copy_to_host(&mut h).unwrap();
            f64s(&h)
        };
        let mut l = vec![0f32; nq];
        lse.as_slice().copy_to_host(&mut l).unwrap();
        let o = get(&out, nq * s.v_dim);
        ((o, l), [get(&dq, x.q.len()), get(&dk, x.k.len()), get(&dv, x.v.len())], x)
    };
    // a call the Hopper kernels take runs them: bit for bit the raw Hopper
    // path (the emulator runs blocks in order, so even dq's bulk reductions
    // add in a fixed order)
    let s = shape(2, 2, 1, 70, 150, 64, true);
    let (fwd, grads, x) = run(&s);
    let hopper = forward(CudaDType::BF16, &s, &x, SdpaPath::Hopper).unwrap();
    let mma = forward(CudaDType::BF16, &s, &x, SdpaPath::TensorCore).unwrap();
    assert_eq!(fwd.0, hopper.0, "TPAR_SDPA=hopper did not run the Hopper forward");
    assert_ne!(fwd.0, mma.0, "the two kernels round alike: the check above proves nothing");
    // (the emulated Hopper and tensor-core backwards add the same products in
    // the same order, so equal gradients show the backward ran correctly, not
    // which kernel ran it)
    let grads_h = backward(CudaDType::BF16, &s, &x, &hopper, SdpaPath::Hopper);
    assert_eq!(grads, grads_h, "TPAR_SDPA=hopper backward");
    // one they do not take (head dim 96) runs the mma.sync kernels
    let s96 = shape(1, 2, 1, 30, 40, 96, false);
    let (fwd, grads, x) = run(&s96);
    let mma = forward(CudaDType::BF16, &s96, &x, SdpaPath::Auto).unwrap();
    assert_eq!(fwd.0, mma.0);
    assert_eq!(grads, backward(CudaDType::BF16, &s96, &x, &mma, SdpaPath::Auto));
}
