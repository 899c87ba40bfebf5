//! Launch wrappers for `cuda/sdpa_hopper.cu`, the Hopper (sm_90a) attention
//! forward pass.
//!
//! Same meaning and buffers as [`super::sdpa::sdpa_forward`] (q `[batch,
//! q_heads, q_len, head_dim]`, k / v `[batch, kv_heads, kv_len, head_dim]`,
//! out like q, f32 `lse` `[batch, q_heads, q_len]` in natural log, GQA,
//! top-left causal masking, an optional additive mask broadcast by strides,
//! fully masked rows give zeros and `lse = -inf`), FlashAttention-3 style: a
//! producer warpgroup brings the q tile and 128-key k and v tiles by bulk
//! tensor copies into an mbarrier ring (3 stages at head dim 64, 2 at 128), and two consumer warpgroups
//! (64 q rows each) compute `q kᵀ` with `wgmma` from shared memory, the online
//! softmax in registers and `P v` with `wgmma` taking P from registers; each
//! stages its normalised output in its rows of the q tile (128-byte swizzle)
//! and writes it with bulk tensor stores. One block of [`THREADS`] threads
//! per (128-row q tile, q head, batch); the kernel's source describes the
//! pipeline.
//!
//! q, k, v and out may lie at any element strides ([`SdpaFwdBuffers::layout`]:
//! dense, heads side by side in the rows of a `[batch, len, heads *
//! head_dim]` buffer, or q, k and v packed in one projection output) that a
//! tensor map can express: the copies go through 4-D maps (head_dim, len,
//! heads, batch) with the operand's row, head and batch strides, so the
//! kernel reads q, k and v and writes out in place, with the same boxes,
//! swizzle and number of copies as for dense operands; rows past a length
//! read as zeros and are not written, per head and batch. `lse` stays dense.
//!
//! Where it runs: devices that run `sm_90a` kernels (a GPU handle compiling
//! for `sm_90a`, or the CPU emulator with
//! [`EMU_ARCH_ENV`]` = sm_90a`), for the calls [`unsupported`] accepts: bf16
//! or f16, `head_dim == v_dim` in {64, 128}, q, k, v and out 16-byte aligned
//! (the tensor maps' base) with strides that are multiples of 16 bytes below
//! 2^40 bytes, `kv_len > 0`, and `q_len` within the kernel's `i32` row
//! coordinates. [`super::sdpa::SdpaPath::Hopper`] selects it. It has not run
//! on a GPU yet.
//!
//! Kernel names: `tpar_sdpa_hopper_fwd<head_dim>_<dtype>`.

use bytemuck::{Pod, Zeroable};

use super::super::tensor_map::{TensorMap, TensorMapDType, TensorMapSwizzle, TiledDesc};
use super::super::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use super::bad;
pub use super::gemm_hopper::{HopperTarget, EMU_ARCH_ENV};
use super::sdpa::{validate_forward, SdpaFwdBuffers, SdpaStrides};
use crate::sdpa::SdpaShape;
use crate::Result;

const OP: &str = "cuda sdpa_forward (hopper)";

/// Threads per block: a producer and two consumer warpgroups.
pub const THREADS: u32 = 384;

/// Query rows per block and keys per tile.
pub const TILE: (usize, usize) = (128, 128);

/// Stages of the k / v ring at `head_dim`: 3 at 64, 2 at 128.
const fn stages(head_dim: usize) -> u32 {
    if head_dim == 64 {
        3
    } else {
        2
    }
}

/// Dynamic shared memory per block for `head_dim`: the q tile, the ring's
/// stages of a k and a v tile (128 rows of `head_dim` 16-bit elements each),
/// the mbarriers (q, full and empty for k and v per stage, two turns, two
/// for the output's staging, which reuses the q tile) and 1024 bytes to
/// align the 128-byte swizzle's pattern (115,848 bytes at head dim 64,
/// 164,968 at 128).
pub const fn shared_bytes(head_dim: usize) -> u32 {
    let tile = 128 * head_dim as u32 * 2;
    let st = stages(head_dim);
    (1 + 2 * st) * tile + (5 + 4 * st) * 8 + 1024
}

/// The argument struct of every `tpar_sdpa_hopper_fwd*` kernel
/// (`SdpaHopperFwdArgs` in `sdpa_hopper.cu`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct SdpaHopperFwdArgs {
    /// q: dims (head_dim, q_len, q_heads, batch) with q's strides, box 64 x
    /// 128 x 1 x 1, 128-byte swizzle (`operand_map`).
    pub map_q: TensorMap,
    /// k: dims (head_dim, kv_len, kv_heads, batch) with k's strides, box 64 x
    /// 128 x 1 x 1, 128-byte swizzle.
    pub map_k: TensorMap,
    /// v: like `map_k` with v's strides.
    pub map_v: TensorMap,
    /// out: dims (head_dim, q_len, q_heads, batch) with out's strides, box 64
    /// x 64 x 1 x 1 (a consumer warpgroup's rows), 128-byte swizzle.
    pub map_o: TensorMap,
    /// Element (0, 0, 0, 0) of the output (written through `map_o`).
    pub out: DevPtr,
    /// Log-sum-exp, f32 `[batch, q_heads, q_len]` (written).
    pub lse: DevPtr,
    /// Additive mask (attention dtype), or 0 for none.
    pub mask: DevPtr,
    /// Mask elements between batches (0 broadcasts).
    pub mask_bs: i64,
    /// Mask elements between q heads (0 broadcasts).
    pub mask_hs: i64,
    /// Mask elements between query rows (0 broadcasts).
    pub mask_rs: i64,
    /// Batch size.
    pub batch: i32,
    /// Query heads.
    pub q_heads: i32,
    /// Key/value heads (divides `q_heads`).
    pub kv_heads: i32,
    /// Query sequence length.
    pub q_len: i32,
    /// Key/value sequence length.
    pub kv_len: i32,
    /// 1 for top-left aligned causal masking.
    pub causal: i32,
    /// Multiplier of `q·k`.
    pub scale: f32,
    /// Padding (0) to a multiple of 64 bytes.
    pub pad: [i32; 13],
}

/// The Hopper target of a launcher: one whose kernels are compiled for an
/// architecture with wgmma ([`Launcher::compile_arch`]: a GPU handle compiling
/// for `sm_90a`, or the CPU emulator when [`EMU_ARCH_ENV`] says `sm_90a`),
/// with the emulator's tensor-map encoding when it is the emulator; `None`
/// for everything else.
pub fn target_of(l: &dyn Launcher) -> Option<HopperTarget> {
    if !l.compile_arch()?.has_wgmma() {
        return None;
    }
    let emulated = l.describe().contains("CPU emulator");
    Some(HopperTarget { sms: 1, emulated })
}

/// Why the Hopper forward kernel does not take this call on `l` (`None`: it
/// does): the device does not run `sm_90a` kernels, the dtype, the head
/// dims, the buffers' alignment, strides a tensor map cannot express
/// (`strides_unsupported`), an empty key sequence, or a q_len past the
/// kernel's coordinates. Sizes the generic checks refuse are reported by
/// [`sdpa_forward`] itself.
pub fn unsupported(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaFwdBuffers,
) -> Option<String> {
    if target_of(l).is_none() {
        return Some(not_sm90a(l));
    }
    unsupported_call(dtype, s, b)
}

/// Why `l` does not run the kernel: it does not run `sm_90a` kernels.
fn not_sm90a(l: &dyn Launcher) -> String {
    format!(
        "{} does not run sm_90a kernels (the emulator does with {EMU_ARCH_ENV}=sm_90a)",
        l.describe()
    )
}

/// [`unsupported`] without the device.
fn unsupported_call(dtype: CudaDType, s: &SdpaShape, b: &SdpaFwdBuffers) -> Option<String> {
    if dtype.size() != 2 {
        return Some(format!("{dtype:?} (the Hopper attention takes bf16 or f16)"));
    }
    if s.head_dim != s.v_dim || !matches!(s.head_dim, 64 | 128) {
        return Some(format!(
            "head_dim {} / v_dim {} (the Hopper attention takes equal head dims of 64 or 128)",
            s.head_dim, s.v_dim
        ));
    }
    if s.kv_len == 0 {
        return Some("kv_len 0 (a tensor map needs a non-empty key sequence)".into());
    }
    for (name, p) in [("q", b.q), ("k", b.k), ("v", b.v), ("out", b.out)] {
        if !p.is_multiple_of(16) {
            return Some(format!(
                "{name} address {p:#x} is not 16-byte aligned (a tensor map's base)"
            ));
        }
    }
    let [q, k, v, out] = b.layout.resolve(s);
    for (name, st) in [("q", q), ("k", k), ("v", v), ("out", out)] {
        if let Some(why) = strides_unsupported(name, dtype, &st) {
            return Some(why);
        }
    }
    if s.q_len > i32::MAX as usize - TILE.0 {
        return Some(format!("q_len {} exceeds the kernel's i32 row coordinates", s.q_len));
    }
    None
}

/// Why a tensor map cannot take operand `name` with element strides `st`
/// (`None`: it can): each stride, in bytes, must be a multiple of 16 and
/// below 2^40 (`cuTensorMapEncodeTiled`'s rule; the rows are then 16-byte
/// aligned, as the swizzled boxes need).
pub(crate) fn strides_unsupported(
    name: &str,
    dtype: CudaDType,
    st: &SdpaStrides,
) -> Option<String> {
    for (which, elems) in [("row", st.row), ("head", st.head), ("batch", st.batch)] {
        let bytes = (elems as u64).saturating_mul(dtype.size() as u64);
        if !bytes.is_multiple_of(16) || bytes >= 1 << 40 {
            return Some(format!(
                "{name}'s {which} stride of {elems} elements ({bytes} bytes): a tensor map \
                 takes multiples of 16 bytes below 2^40"
            ));
        }
    }
    None
}

fn map_dtype(dt: CudaDType) -> TensorMapDType {
    match dt {
        CudaDType::BF16 => TensorMapDType::BF16,
        CudaDType::F16 => TensorMapDType::F16,
        CudaDType::F32 => TensorMapDType::F32,
    }
}

/// A 4-D map over an operand `[batch, heads, len, head_dim]` of 16-bit
/// elements at `ptr` (its element (0, 0, 0, 0)) with element strides `st`:
/// dims (head_dim, len, heads, batch), byte strides (row, head, batch),
/// boxes of 64 x `rows` x 1 x 1, 128-byte swizzle. A copy at (column, row,
/// head, batch) reads zeros for rows past `len` of that head and batch, and
/// a store writes none there, whatever the strides.
pub(crate) fn operand_map(
    emulated: bool,
    dt: CudaDType,
    ptr: DevPtr,
    st: SdpaStrides,
    (head_dim, len, heads, batch): (usize, usize, usize, usize),
    rows: u32,
) -> Result<TensorMap> {
    let es = dt.size() as u64;
    let desc = TiledDesc {
        dtype: map_dtype(dt),
        global: ptr,
        dims: &[head_dim as u64, len as u64, heads as u64, batch as u64],
        strides: &[st.row as u64 * es, st.head as u64 * es, st.batch as u64 * es],
        box_dims: &[64, rows, 1, 1],
        swizzle: TensorMapSwizzle::B128,
    };
    if emulated {
        TensorMap::encode_tiled_emulated(&desc)
    } else {
        TensorMap::encode_tiled_driver(&desc)
    }
}

/// The kernel name, grid and argument struct of a checked call.
fn plan(
    target: HopperTarget,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaFwdBuffers,
) -> Result<(String, LaunchConfig, SdpaHopperFwdArgs)> {
    let d = validate_forward(OP, dtype, s, b)?;
    if let Some(why) = unsupported_call(dtype, s, b) {
        return Err(bad(OP, format!("the Hopper attention does not take this call: {why}")));
    }
    let [q, k, v, out] = b.layout.resolve(s);
    let q_dims = (s.head_dim, s.q_len.max(1), s.q_heads, s.batch);
    let kv_dims = (s.head_dim, s.kv_len, s.kv_heads, s.batch);
    let (tile, emu) = (TILE.0 as u32, target.emulated);
    let map_q = operand_map(emu, dtype, b.q, q, q_dims, tile)?;
    let map_k = operand_map(emu, dtype, b.k, k, kv_dims, tile)?;
    let map_v = operand_map(emu, dtype, b.v, v, kv_dims, tile)?;
    // the output, stored by each consumer warpgroup's 64 rows
    let map_o = operand_map(emu, dtype, b.out, out, q_dims, tile / 2)?;
    let args = SdpaHopperFwdArgs {
        map_q,
        map_k,
        map_v,
        map_o,
        out: b.out,
        lse: b.lse,
        mask: d.mask.0,
        mask_bs: d.mask.1,
        mask_hs: d.mask.2,
        mask_rs: d.mask.3,
        batch: d.batch,
        q_heads: d.q_heads,
        kv_heads: d.kv_heads,
        q_len: d.q_len,
        kv_len: d.kv_len,
        causal: s.causal as i32,
        scale: s.scale as f32,
        pad: [0; 13],
    };
    let name = format!("tpar_sdpa_hopper_fwd{}_{}", s.head_dim, dtype.suffix());
    let grid = [s.q_len.div_ceil(TILE.0) as u32, d.q_heads as u32, d.batch as u32];
    let cfg = LaunchConfig::grid(grid, THREADS).with_shared(shared_bytes(s.head_dim));
    Ok((name, cfg, args))
}

/// Attention forward on the Hopper kernel: `out = softmax(scale * q kᵀ +
/// mask) v` per (batch, q head), and `lse`. An error names why when `l` does
/// not run it or it does not take the call ([`unsupported`]), or the sizes
/// and buffers fail [`super::sdpa::sdpa_forward`]'s checks.
///
/// # Safety
/// As [`super::sdpa::sdpa_forward`]: every buffer valid on the launcher's
/// device for the sizes `s` gives it, the mask for `mask.len` elements.
pub unsafe fn sdpa_forward(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaFwdBuffers,
) -> Result<()> {
    let Some(target) = target_of(l) else {
        return Err(bad(OP, not_sm90a(l)));
    };
    if s.batch == 0 || s.q_heads == 0 || s.q_len == 0 {
        // nothing to compute; the generic checks still apply
        validate_forward(OP, dtype, s, b)?;
        return Ok(());
    }
    let (name, cfg, args) = plan(target, dtype, s, b)?;
    // SAFETY: sizes and pointers checked by `plan`; the caller vouches for
    // the buffers; the struct mirrors the kernel's.
    unsafe { launch(l, &name, cfg, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<SdpaHopperFwdArgs>(), 640);
        assert_eq!(std::mem::align_of::<SdpaHopperFwdArgs>(), 64);
        assert_eq!(shared_bytes(64), 115_848);
        assert_eq!(shared_bytes(128), 164_968);
        const { assert!(shared_bytes(128) <= 227 * 1024) };
    }

    #[test]
    fn refusals_name_the_reason() {
        let s = SdpaShape {
            batch: 1,
            q_heads: 2,
            kv_heads: 1,
            q_len: 10,
            kv_len: 12,
            head_dim: 64,
            v_dim: 64,
            scale: 0.125,
            causal: false,
        };
        let b = SdpaFwdBuffers {
            q: 4096,
            k: 8192,
            v: 12288,
            mask: None,
            out: 16384,
            lse: 20480,
            layout: Default::default(),
        };
        assert_eq!(unsupported_call(CudaDType::BF16, &s, &b), None);
        assert!(unsupported_call(CudaDType::F32, &s, &b).unwrap().contains("F32"));
        let s96 = SdpaShape { head_dim: 96, v_dim: 96, ..s };
        assert!(unsupported_call(CudaDType::F16, &s96, &b).unwrap().contains("head_dim 96"));
        let uneven = SdpaShape { v_dim: 128, ..s };
        assert!(unsupported_call(CudaDType::F16, &uneven, &b).is_some());
        let empty = SdpaShape { kv_len: 0, ..s };
        assert!(unsupported_call(CudaDType::F16, &empty, &b).unwrap().contains("kv_len 0"));
        let odd = SdpaFwdBuffers { k: 8194, ..b };
        assert!(unsupported_call(CudaDType::BF16, &s, &odd).unwrap().contains("k address"));
        // out is a tensor map's base too
        let out8 = SdpaFwdBuffers { out: 16392, ..b };
        let why = unsupported_call(CudaDType::BF16, &s, &out8).unwrap();
        assert!(why.contains("out address 0x4008 is not 16-byte aligned"), "{why}");
        // strides: [b, s, h * d] rows are taken; 8 bytes off, or 2^40 bytes, are not
        let rows = |heads: usize| Some(SdpaStrides::bshd(s.q_len, heads * 64, 64));
        let bshd =
            super::super::sdpa::SdpaLayout { q: rows(2), k: rows(1), v: rows(1), out: rows(2) };
        assert_eq!(
            unsupported_call(CudaDType::BF16, &s, &SdpaFwdBuffers { layout: bshd, ..b }),
            None
        );
        let (q, v) = (bshd.q.unwrap(), bshd.v.unwrap());
        let lay = |q, v| super::super::sdpa::SdpaLayout { q: Some(q), v: Some(v), ..bshd };
        for (layout, needle) in [
            (lay(q, SdpaStrides { row: 68, ..v }), "v's row stride of 68 elements (136 bytes)"),
            (lay(SdpaStrides { head: 1 << 39, ..q }, v), "q's head stride of 549755813888"),
        ] {
            let why = unsupported_call(CudaDType::F16, &s, &SdpaFwdBuffers { layout, ..b });
            assert!(why.as_deref().is_some_and(|w| w.contains(needle)), "{why:?}");
        }
        // strides of dims with one index (batch 1, one kv head) are not looked at
        let one = lay(SdpaStrides { batch: 3, ..q }, SdpaStrides { head: 5, batch: 7, ..v });
        assert_eq!(
            unsupported_call(CudaDType::F16, &s, &SdpaFwdBuffers { layout: one, ..b }),
            None
        );
    }
}
