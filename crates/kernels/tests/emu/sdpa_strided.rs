//! The `mma.sync` and SIMT attention kernels (`cuda/sdpa.cu`) on strided
//! operands, run in the CPU emulator: q, k and v read through their element
//! strides as separate `[b, s, h, hd]` buffers, packed side by side in one
//! `[b, s, (hq + 2 hkv) hd]` projection output, or as `[b, h, s, hd]` with
//! gaps after every row, head and batch; out, dout, dq, dk and dv in buffers
//! of the same kind whose other elements hold a guard value that must
//! survive. Every result must equal, bit for bit, the same kernels on dense
//! `[b, h, s, hd]` copies (f32, bf16 and f16; head dims 64, 128 and 40; GQA,
//! causal or not, key-padding and full masks, lengths 70 and 130 with two
//! batches). Strides the tensor-core kernels cannot take make `Auto` run
//! SIMT and an explicit tensor-core path fail by name; unusable layouts are
//! refused naming the operand.

use crate::common;

use common::sdpa::{
    bwd_buffers_at, guards_touched, run_dense, shape, Arrangement, Inputs, MaskKind, MaskPlan,
    Placed, Placement, Ran, Workspace,
};
use common::{emu, mptr, ptr};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::sdpa::{
    sdpa_backward, sdpa_forward, SdpaBwdBuffers, SdpaFwdBuffers, SdpaLayout, SdpaPath, SdpaStrides,
};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::{Float, KernelError};

/// Batch `b` keeps `kv_len - 37b - 5` keys; head `bh` masks row `(37bh + 2) % q_len`.
const MASKS: MaskPlan = MaskPlan { pad_step: 37, pad_base: 5, row_step: 37 };

use Arrangement::{Bshd, Packed, Padded};

/// What every element that no operand covers holds.
fn guard<T: Float>() -> T {
    T::from_f64(-777.0)
}

/// `got` and `want` hold the same bits; otherwise a message with the first
/// differing element and the count.
fn same_bits<T: Float>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bits = |x: &T| x.to_f64().to_bits();
    let diff: Vec<usize> = (0..got.len()).filter(|&i| bits(&got[i]) != bits(&want[i])).collect();
    if let Some(&i) = diff.first() {
        panic!(
            "{what}: {} of {} elements differ from the dense run, first [{i}]: {:?} != {:?}",
            diff.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

struct Case {
    s: SdpaShape,
    mask: MaskKind,
    arr: Arrangement,
}

fn case(s: SdpaShape, mask: MaskKind, arr: Arrangement) -> Case {
    Case { s, mask, arr }
}

/// GQA (4 q heads over 2 kv heads), two batches, `q_len` x `kv_len`, equal
/// head dims.
fn gqa(q_len: usize, kv_len: usize, dim: usize, causal: bool) -> SdpaShape {
    shape(2, 4, 2, q_len, kv_len, dim, dim, causal)
}

/// The address of `p`'s element `(0, 0, 0, 0)` in the buffer at `base`.
fn at(base: DevPtr, p: &Placed, dtype: CudaDType) -> DevPtr {
    base + (p.off * dtype.size()) as DevPtr
}

/// Forward and backward of `c` with `path` on strided operands, against
/// `dense_path` on dense copies: the same bits everywhere, guards intact,
/// inputs unchanged.
fn run<T: Float>(dtype: CudaDType, c: &Case, path: SdpaPath, dense_path: SdpaPath) {
    let s = &c.s;
    let what = format!("{dtype:?} {path:?} {s:?} mask {:?} {:?}", c.mask, c.arr);
    let x = Inputs::<T>::new(s, c.mask, MASKS);
    let want: Ran<T> = run_dense(dtype, s, &x, dense_path).unwrap();

    let p = Placement::new(s, c.arr);
    let g = guard::<T>();
    let mut qkv = vec![g; p.qkv_len];
    p.q.scatter(&x.q, &mut qkv);
    p.k.scatter(&x.k, &mut qkv);
    p.v.scatter(&x.v, &mut qkv);
    let mut dout = vec![g; p.out_len];
    p.out.scatter(&x.dout, &mut dout);
    let (qkv0, dout0) = (qkv.clone(), dout.clone());
    let mut out = vec![g; p.out_len];
    let mut lse = vec![7.0f32; s.batch * s.q_heads * s.q_len];
    let mut grads = vec![g; p.qkv_len];
    let mut ws = Workspace::new(s);
    let (layout, mask, input) = (p.layout(), x.dev_mask(), ptr(&qkv));
    let fb = SdpaFwdBuffers {
        q: at(input, &p.q, dtype),
        k: at(input, &p.k, dtype),
        v: at(input, &p.v, dtype),
        mask,
        out: at(mptr(&mut out), &p.out, dtype),
        lse: mptr(&mut lse),
        layout,
    };
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the strides reach.
    unsafe { sdpa_forward(emu(), dtype, s, &fb, path) }.unwrap_or_else(|e| panic!("{what}: {e}"));
    let gp = mptr(&mut grads);
    let bb = SdpaBwdBuffers {
        q: fb.q,
        k: fb.k,
        v: fb.v,
        mask,
        out: at(ptr(&out), &p.out, dtype),
        lse: ptr(&lse),
        dout: at(ptr(&dout), &p.out, dtype),
        dq: at(gp, &p.q, dtype),
        dk: at(gp, &p.k, dtype),
        dv: at(gp, &p.v, dtype),
        workspace: ws.ptr(),
        workspace_bytes: ws.bytes,
        layout,
    };
    // SAFETY: as above.
    unsafe { sdpa_backward(emu(), dtype, s, &bb, path) }.unwrap_or_else(|e| panic!("{what}: {e}"));

    same_bits(&format!("out {what}"), &p.out.gather(&out), &want.out);
    let lse_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(lse_bits(&lse), lse_bits(&want.lse), "lse {what}");
    same_bits(&format!("dq {what}"), &p.q.gather(&grads), &want.g.dq);
    same_bits(&format!("dk {what}"), &p.k.gather(&grads), &want.g.dk);
    same_bits(&format!("dv {what}"), &p.v.gather(&grads), &want.g.dv);
    let touched = guards_touched(&out, &[&p.out], g);
    assert!(
        touched.is_empty(),
        "out {what}: guards written at {:?}",
        &touched[..touched.len().min(8)]
    );
    let touched = guards_touched(&grads, &[&p.q, &p.k, &p.v], g);
    assert!(
        touched.is_empty(),
        "grads {what}: guards written at {:?}",
        &touched[..touched.len().min(8)]
    );
    same_bits(&format!("q/k/v input {what}"), &qkv, &qkv0);
    same_bits(&format!("dout input {what}"), &dout, &dout0);
    assert!(ws.guard_intact(), "{what}: a kernel wrote past the workspace");
}

/// [`run`] against the same path on dense copies.
fn same<T: Float>(dtype: CudaDType, c: &Case, path: SdpaPath) {
    run::<T>(dtype, c, path, path);
}

#[test]
fn simt_f32() {
    let f32s = |c: &Case| same::<f32>(CudaDType::F32, c, SdpaPath::Simt);
    f32s(&case(gqa(70, 70, 64, true), MaskKind::KeyPadding, Bshd { pad: 8 }));
    f32s(&case(gqa(130, 130, 128, false), MaskKind::None, Packed { pad: 8 }));
    // odd gaps: f32 rows need only 4-byte alignment
    f32s(&case(gqa(70, 130, 64, false), MaskKind::Full, Padded { pad: 3 }));
    // v_dim 40 below head_dim 64
    f32s(&case(shape(2, 4, 2, 70, 70, 64, 40, true), MaskKind::KeyPadding, Bshd { pad: 1 }));
}

#[test]
fn simt_bf16_f16() {
    let c = case(gqa(130, 130, 64, true), MaskKind::KeyPadding, Packed { pad: 8 });
    same::<bf16>(CudaDType::BF16, &c, SdpaPath::Simt);
    let c = case(gqa(70, 130, 128, false), MaskKind::None, Padded { pad: 8 });
    same::<bf16>(CudaDType::BF16, &c, SdpaPath::Simt);
    // exactly [b, s, h, hd]: no gaps
    let c = case(gqa(70, 70, 128, true), MaskKind::KeyPadding, Bshd { pad: 0 });
    same::<f16>(CudaDType::F16, &c, SdpaPath::Simt);
}

#[test]
fn odd_strides_make_auto_run_simt() {
    // Head dim 40 takes the tensor cores on dense operands, but rows 4 * 40 + 3
    // elements apart are not 16-byte aligned: Auto runs SIMT (the dense SIMT
    // bits; the tensor-core kernels would fail on misaligned copies).
    let c = case(gqa(70, 70, 40, true), MaskKind::KeyPadding, Bshd { pad: 3 });
    run::<bf16>(CudaDType::BF16, &c, SdpaPath::Auto, SdpaPath::Simt);
    let c = case(gqa(70, 70, 40, false), MaskKind::None, Packed { pad: 3 });
    run::<f16>(CudaDType::F16, &c, SdpaPath::Auto, SdpaPath::Simt);
    // aligned strides keep Auto's dense choice (the tensor cores)
    let c = case(gqa(70, 70, 40, false), MaskKind::None, Packed { pad: 8 });
    run::<f16>(CudaDType::F16, &c, SdpaPath::Auto, SdpaPath::TensorCore);
}

#[test]
fn tensor_core_bf16() {
    let tc = |c: &Case| same::<bf16>(CudaDType::BF16, c, SdpaPath::TensorCore);
    tc(&case(gqa(70, 70, 64, true), MaskKind::KeyPadding, Packed { pad: 8 }));
    tc(&case(gqa(130, 130, 128, false), MaskKind::None, Bshd { pad: 8 }));
    tc(&case(gqa(70, 130, 64, false), MaskKind::Full, Padded { pad: 8 }));
}

#[test]
fn tensor_core_f16() {
    let tc = |c: &Case| same::<f16>(CudaDType::F16, c, SdpaPath::TensorCore);
    tc(&case(gqa(130, 130, 64, false), MaskKind::KeyPadding, Bshd { pad: 0 }));
    tc(&case(gqa(70, 70, 128, true), MaskKind::None, Packed { pad: 8 }));
}

// The wide tensor-core kernels' cases, two tests (the causal ones, the others) so
// that the harness runs them side by side: they are the longest of this file.
#[test]
fn tensor_core_wide_causal() {
    let c = case(gqa(130, 130, 64, true), MaskKind::KeyPadding, Packed { pad: 8 });
    same::<bf16>(CudaDType::BF16, &c, SdpaPath::TensorCoreWide);
    let c = case(gqa(70, 70, 128, true), MaskKind::KeyPadding, Bshd { pad: 8 });
    same::<bf16>(CudaDType::BF16, &c, SdpaPath::TensorCoreWide);
}

#[test]
fn tensor_core_wide_not_causal() {
    let c = case(gqa(130, 70, 128, false), MaskKind::None, Padded { pad: 8 });
    same::<f16>(CudaDType::F16, &c, SdpaPath::TensorCoreWide);
    // v_dim 96 below head_dim 128, more queries than keys
    let c = case(shape(2, 4, 2, 130, 70, 128, 96, false), MaskKind::Full, Bshd { pad: 8 });
    same::<bf16>(CudaDType::BF16, &c, SdpaPath::TensorCoreWide);
}

/// The message of a `BadArguments` error; panics on anything else.
fn bad_message(r: tpar_kernels::Result<()>, what: &str) -> String {
    match r {
        Err(e @ KernelError::BadArguments { .. }) => e.to_string(),
        other => panic!("{what}: expected BadArguments, got {other:?}"),
    }
}

#[test]
fn unusable_layouts_are_refused_by_name() {
    let s = shape(1, 2, 2, 8, 8, 64, 64, false);
    let mut buf = vec![0u64; 1 << 14]; // a 16-byte aligned stand-in for every tensor
    let p = mptr(&mut buf);
    // what the launches that run write, apart from what they read (one buffer for
    // both would be a race between the blocks, which the race check reports)
    let mut written = vec![0u64; 4 << 14];
    let w = mptr(&mut written);
    let (o, dq, dk, dv) = (w, w + (1 << 17), w + (2 << 17), w + (3 << 17));
    let mut lse = vec![0f32; 16];
    let lp = mptr(&mut lse);
    let mut ws = Workspace::new(&s);
    let fwd = |layout: SdpaLayout, path| {
        let b = SdpaFwdBuffers { q: p, k: p, v: p, mask: None, out: o, lse: lp, layout };
        // SAFETY: host buffers stand in for device memory; every call here is refused
        // before a launch, or reads inside `buf` and writes inside `written`.
        unsafe { sdpa_forward(emu(), CudaDType::BF16, &s, &b, path) }
    };
    let (wsp, wsb) = (ws.ptr(), ws.bytes);
    let bwd = |layout: SdpaLayout, path| {
        let b = SdpaBwdBuffers {
            lse: lp,
            workspace: wsp,
            layout,
            dq,
            dk,
            dv,
            ..bwd_buffers_at(p, wsb)
        };
        // SAFETY: as above (dq, dk and dv each in their own quarter of `written`).
        unsafe { sdpa_backward(emu(), CudaDType::BF16, &s, &b, path) }
    };
    let st = |batch, head, row| Some(SdpaStrides { batch, head, row });
    // heads 32 elements apart overlap the 64-element rows of out
    let e = bad_message(
        fwd(SdpaLayout { out: st(2048, 32, 128), ..Default::default() }, SdpaPath::Auto),
        "overlap",
    );
    assert!(e.contains("out strides") && e.contains("share an address"), "{e}");
    // dq shares q's strides: an overlapping q is refused by the backward too
    let e = bad_message(
        bwd(SdpaLayout { q: st(2048, 64, 64 * 2 - 8), ..Default::default() }, SdpaPath::Auto),
        "overlap q",
    );
    assert!(e.contains("q strides") && e.contains("share an address"), "{e}");
    // a row shorter than the head dim
    let e = bad_message(
        fwd(SdpaLayout { k: st(2048, 512, 40), ..Default::default() }, SdpaPath::Simt),
        "short row",
    );
    assert!(e.contains("k strides") && e.contains("below the dim 64"), "{e}");

    // q rows 2 * 64 + 4 elements apart (8-byte, not 16-byte aligned): an explicit
    // tensor-core path names the stride
    let q4 = SdpaLayout { q: st(0, 64, 132), ..Default::default() };
    for path in [SdpaPath::TensorCore, SdpaPath::TensorCoreWide] {
        let e = bad_message(fwd(q4, path), "tc stride 4");
        assert!(e.contains("q row stride 132") && e.contains("multiples of 8"), "{path:?}: {e}");
    }
    let e = bad_message(bwd(q4, SdpaPath::TensorCore), "tc bwd stride 4");
    assert!(e.contains("q/dq row stride 132") && e.contains("multiples of 8"), "{e}");
    let v4 = SdpaLayout { v: st(0, 68, 68 * 8), ..Default::default() };
    let e = bad_message(bwd(v4, SdpaPath::TensorCore), "tc bwd head stride 4");
    assert!(e.contains("v/dv head stride 68"), "{e}");
    // the same layouts run on SIMT (rows read in place; nothing to compare here)
    fwd(q4, SdpaPath::Auto).unwrap();
    bwd(v4, SdpaPath::Auto).unwrap();
}

/// `SdpaGrads::Packed` (dq, dk and dv in one buffer, as a packed q/k/v projection's
/// gradient holds them) runs where the three fill disjoint columns of shared rows, and
/// is refused, naming the reason, where two could share an element or the buffer is
/// short.
#[test]
fn packed_gradients_are_checked_for_overlap() {
    use std::sync::Arc;
    use tpar_kernels::cuda::emu::EmulatedGpu;
    use tpar_kernels::cuda::ops::sdpa::{self as ops, SdpaGrads};
    use tpar_kernels::cuda::{DeviceBuffer, GpuDevice};
    let dev: Arc<dyn GpuDevice> = EmulatedGpu::open(0).unwrap();
    // 2 batches of 5 positions, 2 q heads and 1 kv head of 8: rows of 32 elements
    let s = shape(2, 2, 1, 5, 5, 8, 8, true);
    let (row, n) = (32, 2 * 5 * 32);
    let zeros = |len: usize| DeviceBuffer::zeros(&dev, len * 4).unwrap();
    let (qkv, out, dout, lse) = (zeros(n), zeros(2 * 5 * 16), zeros(2 * 5 * 16), zeros(2 * 2 * 5));
    let mut ws = zeros(ops::sdpa_backward_workspace_bytes(&s).unwrap().div_ceil(4));
    let bshd = |w: usize| Some(SdpaStrides::bshd(5, w, 8));
    let packed = SdpaLayout { q: bshd(row), k: bshd(row), v: bshd(row), out: bshd(16) };
    let mut run = |layout: SdpaLayout, at: [usize; 3], len: usize, s: &SdpaShape| {
        let mut g = zeros(len);
        let views = ops::SdpaBwdViews {
            q: qkv.as_slice(),
            k: qkv.as_slice(),
            v: qkv.as_slice(),
            mask: None,
            out: out.as_slice(),
            lse: lse.as_slice(),
            dout: dout.as_slice(),
            grads: SdpaGrads::Packed { dqkv: g.as_slice_mut(), at },
            workspace: ws.as_slice_mut(),
            layout,
        };
        ops::sdpa_backward(&*dev, CudaDType::F32, s, views, SdpaPath::Auto)
    };
    run(packed, [0, 16, 24], n, &s).unwrap();
    let refused = |r: tpar_kernels::Result<()>, words: &[&str]| {
        let e = r.expect_err("refused").to_string();
        for w in words {
            assert!(e.contains(w), "{e:?} does not name {w:?}");
        }
    };
    refused(
        run(packed, [0, 8, 24], n, &s),
        &["dq (columns 0..16)", "dk (columns 8..16)", "overlap"],
    );
    refused(run(packed, [0, 16, 28], n, &s), &["dv at element 28", "row of 32"]);
    let odd_row = SdpaLayout { v: bshd(40), ..packed };
    refused(run(odd_row, [0, 16, 24], 2 * 5 * 40, &s), &["dv row stride 40", "dq's 32"]);
    let batches = SdpaLayout { k: Some(SdpaStrides { batch: 6 * 32, head: 8, row: 32 }), ..packed };
    refused(run(batches, [0, 16, 24], n, &s), &["dk batch stride 192", "whole number of rows"]);
    refused(run(packed, [0, 16, 24], n - 1, &s), &["dv"]);
    let cross = shape(2, 2, 1, 5, 4, 8, 8, false);
    refused(run(packed, [0, 16, 24], n, &cross), &["q_len 5 and kv_len 4 differ"]);
}
