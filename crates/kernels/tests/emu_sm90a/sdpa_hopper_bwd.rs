//! The Hopper attention backward (`cuda/sdpa_hopper_bwd.cu`: TMA, mbarriers,
//! wgmma, a producer warp and two consumer warpgroups), run in the CPU
//! emulator as `sm_90a`: dq, dk and dv against the f64 reference of the CPU
//! op and against the tensor-core backward of `sdpa.cu`, for bf16 and f16,
//! head dims 64 and 128, causal or not, GQA, masks, ragged lengths (several
//! and partial query and key tiles) and fully masked rows; the dQ staging
//! stores' layout (a test kernel calling the kernel's own address function,
//! `hopper/sdpa_dq_units.cu`); and the calls it refuses.

use crate::common;

use common::sdpa::{
    bwd_buffers_at, forward_outputs, max_rel, same_dim_shape as shape, Grads, Inputs, MaskKind,
    MaskPlan, Workspace,
};
use common::{cvt, data, emu, f64s, mptr, ptr};
use tpar_kernels::cuda::raw::sdpa::{
    sdpa_backward, sdpa_backward_workspace_bytes, sdpa_forward, SdpaBwdBuffers, SdpaPath,
};
use tpar_kernels::cuda::raw::sdpa_hopper_bwd::{self as hopper, EMU_ARCH_ENV};
use tpar_kernels::cuda::{CudaDType, DevPtr, LaunchConfig, Launcher};
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::Float;

use CudaDType::{BF16, F16};

/// Batch `b` keeps `kv_len - 37b - 5` keys; head `bh` masks row `(5bh + 2) % q_len`.
const MASKS: MaskPlan = MaskPlan { pad_step: 37, pad_base: 5, row_step: 5 };

/// Gradient tolerance (relative to the largest magnitude), as for the
/// tensor-core backward: P and dS are rounded to the attention dtype.
fn tol(dtype: CudaDType) -> f64 {
    match dtype {
        BF16 => 1e-2,
        _ => 2e-3,
    }
}

/// Runs the forward (tensor cores), the tensor-core backward and the Hopper
/// backward of one case on the emulator, and checks both backwards against
/// the f64 reference and the Hopper one against the tensor-core one.
fn run<T: Float>(dtype: CudaDType, s: SdpaShape, mask: MaskKind) {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    let emu = emu();
    let x = Inputs::<T>::new(&s, mask, MASKS);
    let (dq_ref, dk_ref, dv_ref) = x.reference_backward(&s);

    let (mut o, mut lse) = forward_outputs::<T>(&s);
    let mut ws = Workspace::new(&s);
    // SAFETY: host buffers stand in for device memory (the emulator runs
    // each kernel on this thread before returning), each holding every
    // element the call's sizes reach.
    unsafe {
        let fb = x.fwd_buffers(&mut o, &mut lse);
        sdpa_forward(emu, dtype, &s, &fb, SdpaPath::TensorCore).unwrap();
    }
    let mut grads = |hopper_path: bool| {
        let mut g = Grads::new(&x);
        let bb = x.bwd_buffers(&o, &lse, &mut g, &mut ws);
        if hopper_path {
            assert_eq!(hopper::unsupported(emu, dtype, &s, &bb), None);
        }
        // SAFETY: as for the forward.
        unsafe {
            if hopper_path {
                hopper::sdpa_backward(emu, dtype, &s, &bb).unwrap();
            } else {
                sdpa_backward(emu, dtype, &s, &bb, SdpaPath::TensorCore).unwrap();
            }
        }
        g
    };
    let tc = grads(false);
    let hp = grads(true);
    let t = tol(dtype);
    let what = format!("{dtype:?} {s:?} mask {mask:?}");
    assert!(ws.guard_intact(), "{what}: a backward wrote past the end of its workspace");
    for (name, got, base, want) in [
        ("dq", &hp.dq, &tc.dq, &dq_ref),
        ("dk", &hp.dk, &tc.dk, &dk_ref),
        ("dv", &hp.dv, &tc.dv, &dv_ref),
    ] {
        let e_ref = max_rel(&format!("{name} {what}"), &f64s(got), want);
        let e_tc = max_rel(&format!("{name} {what}"), &f64s(got), &f64s(base));
        let e_base = max_rel(&format!("{name} (tensor cores) {what}"), &f64s(base), want);
        eprintln!(
            "{name} {what}: hopper vs f64 {e_ref:.2e}, vs tensor cores {e_tc:.2e} (tensor \
             cores vs f64 {e_base:.2e})"
        );
        assert!(e_ref <= t, "{name} {what}: rel err vs f64 {e_ref:e} > {t:e}");
        assert!(e_tc <= t, "{name} {what}: rel diff vs tensor cores {e_tc:e} > {t:e}");
    }
}

/// Causal GQA (group 2), head dim 64: 130 queries x 200 keys (a full and a
/// partial key block, three query tiles per head, the last one partial).
#[test]
fn bf16_d64_causal_gqa_ragged() {
    run::<half::bf16>(BF16, shape(1, 4, 2, 130, 200, 64, true), MaskKind::None);
}

/// Non-causal, key-padding mask, head dim 128, two batches, GQA.
#[test]
fn bf16_d128_key_padding_gqa() {
    run::<half::bf16>(BF16, shape(2, 2, 1, 70, 150, 128, false), MaskKind::KeyPadding);
}

/// A full additive mask with `-inf` entries and a fully masked row per head,
/// head dim 64, causal, more queries than keys.
#[test]
fn f16_d64_full_mask_causal() {
    run::<half::f16>(F16, shape(1, 2, 1, 150, 70, 64, true), MaskKind::Full);
}

/// Causal, head dim 128, more queries than keys across two key blocks.
#[test]
fn f16_d128_causal_more_queries() {
    run::<half::f16>(F16, shape(1, 2, 2, 200, 130, 128, true), MaskKind::None);
}

/// Causal GQA with 4 q heads per kv head, head dim 64: 200 queries x 150
/// keys. The first key block walks 16 query tiles (4 per head, the last of
/// each 8 rows), so both dQ staging buffers are reused 8 times, and a short
/// tile follows full ones in the same buffer (its 56 padding rows land in
/// the padding of the accumulator's tile block, which the convert skips).
#[test]
fn bf16_d64_causal_gqa4_many_tiles() {
    run::<half::bf16>(BF16, shape(1, 4, 1, 200, 150, 64, true), MaskKind::None);
}

/// GQA with 4 q heads per kv head, head dim 128, key padding, two batches:
/// 100 queries (a full and a 36-row tile per head), 8 tiles per block.
#[test]
fn f16_d128_gqa4_key_padding_ragged() {
    run::<half::f16>(F16, shape(2, 8, 2, 100, 70, 128, false), MaskKind::KeyPadding);
}

/// Query lengths one past a tile (65: a 1-row last tile), one short (127)
/// and two past two (130), each with several batches and GQA heads: the
/// accumulator's blocks of consecutive heads and batches sit back to back,
/// so a last tile's padding rows reduced or converted into the wrong block,
/// or left unzeroed, would show in the next head's dq.
#[test]
fn bf16_d64_gqa_q65_three_batches() {
    run::<half::bf16>(BF16, shape(3, 4, 2, 65, 90, 64, false), MaskKind::None);
}

/// See [`bf16_d64_gqa_q65_three_batches`]: causal, 127 queries, head dim 128.
#[test]
fn f16_d128_causal_gqa_q127_two_batches() {
    run::<half::f16>(F16, shape(2, 4, 1, 127, 140, 128, true), MaskKind::None);
}

/// See [`bf16_d64_gqa_q65_three_batches`]: 130 queries, key padding, head
/// dim 128, GQA 3.
#[test]
fn bf16_d128_gqa3_q130_key_padding() {
    run::<half::bf16>(BF16, shape(2, 6, 2, 130, 100, 128, false), MaskKind::KeyPadding);
}

/// Arguments of `hopper_sdpa_dq_units` (hopper/sdpa_dq_units.cu).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct DqUnitsArgs {
    out: DevPtr,
    hd: i32,
    pad: i32,
}

/// The float offsets within a dQ tile that the consumers' 16-byte stores
/// go to, `[warpgroup][column group][thread]`, from the kernel's own
/// `dq_frag_unit` (the test kernel is compiled after the part of
/// sdpa_hopper_bwd.cu before its kernels).
fn dq_store_offsets(hd: usize) -> Vec<i32> {
    let e = emu();
    static ADDED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ADDED.get_or_init(|| {
        let bwd = tpar_kernels::cuda::sources()
            .iter()
            .find(|s| s.name == "sdpa_hopper_bwd")
            .expect("sdpa_hopper_bwd.cu is embedded");
        let (head, _kernels) = bwd.text.split_once("\nTPAR_KERNEL(").expect("it has kernels");
        let text = format!("{head}\n{}", include_str!("../hopper/sdpa_dq_units.cu"));
        e.add_source("hopper_sdpa_dq_units_test", &text).expect("the test kernel compiles");
    });
    let mut out = vec![-1i32; 2 * (hd / 16) * 128];
    let args = DqUnitsArgs { out: mptr(&mut out), hd: hd as i32, pad: 0 };
    // SAFETY: `out` holds every element the kernel writes (2 x hd / 16 x 128).
    unsafe {
        tpar_kernels::cuda::launch(e, "hopper_sdpa_dq_units", LaunchConfig::linear(1, 128), &args)
    }
    .unwrap();
    out
}

/// The consumers' dQ stores in the accumulator's tile layout: every thread
/// of both warpgroups stores each of its column groups' 16-byte units to its
/// own place (together they tile the 64 x HD floats exactly), and each warp
/// store is free of bank conflicts: shared memory serves a 16-byte access a
/// quarter-warp (8 lanes) at a time, each in as many wavefronts as the most
/// distinct 4-byte words one of its 32 banks holds, so a warp store takes 4
/// (one per quarter-warp, the least 32 x 16 bytes allow).
#[test]
fn dq_staging_stores_tile_the_block_without_bank_conflicts() {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    for hd in [128usize, 64] {
        let units = dq_store_offsets(hd);
        let mut seen = vec![false; 64 * hd / 4];
        for (k, &u) in units.iter().enumerate() {
            let (cw, j, tw) = (k / (hd / 16 * 128), k / 128 % (hd / 16), k % 128);
            let at = format!("head dim {hd}: warpgroup {cw}, column group {j}, thread {tw}");
            assert!(u >= 0 && u % 4 == 0 && (u as usize) < 64 * hd, "{at}: offset {u}");
            assert!(!std::mem::replace(&mut seen[u as usize / 4], true), "{at}: unit {u} again");
        }
        for (store, lanes) in units.chunks(32).enumerate() {
            let wavefronts: usize = lanes
                .chunks(8)
                .map(|quarter| {
                    // per bank, the distinct words the quarter's 8 x 4 floats touch
                    let mut words = vec![std::collections::BTreeSet::new(); 32];
                    for w in quarter.iter().flat_map(|&u| u..u + 4) {
                        words[w as usize % 32].insert(w);
                    }
                    words.iter().map(|b| b.len()).max().unwrap_or(0)
                })
                .sum();
            assert_eq!(wavefronts, 4, "head dim {hd}, warp store {store}: {lanes:?}");
        }
    }
}

/// A launcher that describes a GPU compiled for another architecture.
struct OtherArch;

impl Launcher for OtherArch {
    fn describe(&self) -> String {
        "cuda:0 (sm_90, NVIDIA H100)".into()
    }

    /// # Safety
    /// Never launches.
    unsafe fn launch_raw(&self, _: &str, _: &LaunchConfig, _: &[u8]) -> tpar_kernels::Result<()> {
        panic!("a refused call launched a kernel")
    }
}

#[test]
fn refusals_name_the_reason() {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    let emu = emu();
    let s = shape(1, 2, 1, 16, 16, 64, false);
    let buf: Vec<u64> = vec![0; 4096];
    let p: DevPtr = (ptr(&buf) as DevPtr).next_multiple_of(16);
    let b = bwd_buffers_at(p, 1 << 20);
    assert_eq!(hopper::unsupported(emu, BF16, &s, &b), None);
    let why = |l: &dyn Launcher, dt: CudaDType, s: &SdpaShape, b: &SdpaBwdBuffers| {
        let w = hopper::unsupported(l, dt, s, b).expect("refused");
        // SAFETY: the call is refused before any launch.
        let e = unsafe { hopper::sdpa_backward(l, dt, s, b) }.unwrap_err().to_string();
        assert!(e.contains(&w), "{e} names {w}");
        w
    };
    assert!(why(&OtherArch, BF16, &s, &b).contains("sm_90a"));
    assert!(why(emu, CudaDType::F32, &s, &b).contains("f32"));
    let mut s96 = s;
    (s96.head_dim, s96.v_dim) = (96, 96);
    assert!(why(emu, BF16, &s96, &b).contains("96"));
    let mut sv = s;
    sv.v_dim = 128;
    assert!(why(emu, F16, &sv, &b).contains("v_dim 128"));
    let odd = SdpaBwdBuffers { k: p + 2, ..b };
    assert!(why(emu, BF16, &s, &odd).contains("k address"));
    let wide = SdpaShape { batch: 70_000, ..s };
    assert!(why(emu, BF16, &wide, &b).contains("grid"));
    // head and batch are separate copy coordinates: batch * q_heads past
    // i32 is taken, a batch stride of 2^40 bytes or more is not
    let heads = SdpaShape { batch: 65_535, q_heads: 40_000, kv_heads: 40_000, ..s };
    assert_eq!(hopper::unsupported(emu, BF16, &heads, &b), None);
    let far = SdpaShape { q_len: 1 << 20, kv_len: 1 << 20, ..heads };
    let w = why(emu, BF16, &far, &b);
    assert!(w.contains("q's batch stride") && w.contains("2^40"), "{w}");
    // a workspace too small is an error, not a refusal: 16 bytes, or the
    // row-major accumulator's size (delta, then 2 x 16 rows of 64 f32) where
    // the tile layout needs 64 rows a head
    let need = sdpa_backward_workspace_bytes(&s).unwrap();
    assert_eq!(need, 256 + 2 * 64 * 64 * 4, "{s:?}: delta, then one 64-row tile a head");
    for bytes in [16, 256 + 2 * 16 * 64 * 4, need - 1] {
        let small = SdpaBwdBuffers { workspace_bytes: bytes, ..b };
        // SAFETY: the call fails its checks before any launch.
        let e = unsafe { hopper::sdpa_backward(emu, BF16, &s, &small) }.unwrap_err().to_string();
        assert!(
            e.contains(&format!("workspace of {bytes} bytes")) && e.contains(&need.to_string()),
            "{e}"
        );
    }
    let gqa = SdpaShape { q_heads: 3, kv_heads: 2, ..s };
    // SAFETY: as above.
    let e = unsafe { hopper::sdpa_backward(emu, BF16, &gqa, &b) }.unwrap_err().to_string();
    assert!(e.contains("multiple of kv_heads"), "{e}");
}

/// One partial tile each way: 33 queries, 40 keys (the second consumer
/// warpgroup's keys all past kv_len), GQA, causal and a full mask.
#[test]
fn bf16_d128_single_partial_tiles() {
    run::<half::bf16>(BF16, shape(2, 4, 2, 33, 40, 128, true), MaskKind::Full);
}

/// No queries: dk and dv are zeros; no keys: dq is zero.
#[test]
fn empty_sequences_give_zero_gradients() {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    let emu = emu();
    for (q_len, kv_len) in [(0, 70), (70, 0)] {
        let s = shape(1, 2, 1, q_len, kv_len, 64, false);
        let (nq, nk) = (2 * q_len * 64, kv_len * 64);
        let q: Vec<half::bf16> = cvt(&data(nq, 1, 1.0));
        let k: Vec<half::bf16> = cvt(&data(nk, 2, 1.0));
        let mut dq = vec![half::bf16::from_f64(7.0); nq];
        let mut dk = vec![half::bf16::from_f64(7.0); nk];
        let mut dv = vec![half::bf16::from_f64(7.0); nk];
        let lse = vec![0.0f32; 2 * q_len];
        let ws_bytes = sdpa_backward_workspace_bytes(&s).unwrap().max(16);
        let mut ws = vec![0.0f32; ws_bytes.div_ceil(4) + 4];
        let ws_off = (16 - (ptr(&ws) as usize % 16)) % 16 / 4;
        let b = SdpaBwdBuffers {
            q: ptr(&q),
            k: ptr(&k),
            v: ptr(&k),
            mask: None,
            out: ptr(&q),
            lse: ptr(&lse),
            dout: ptr(&q),
            dq: mptr(&mut dq),
            dk: mptr(&mut dk),
            dv: mptr(&mut dv),
            workspace: mptr(&mut ws[ws_off..]),
            workspace_bytes: ws_bytes,
            layout: Default::default(),
        };
        // SAFETY: host buffers holding every element the sizes reach.
        unsafe { hopper::sdpa_backward(emu, BF16, &s, &b).unwrap() };
        for (name, g) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
            assert!(g.iter().all(|x| x.to_f64() == 0.0), "{name} of {s:?} is not zero");
        }
    }
}
