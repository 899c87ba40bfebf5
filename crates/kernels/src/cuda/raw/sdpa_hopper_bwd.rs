//! Launch wrappers for `cuda/sdpa_hopper_bwd.cu`, the Hopper (sm_90a)
//! attention backward pass.
//!
//! The same operation and buffers as [`super::sdpa::sdpa_backward`] (see
//! [`super::sdpa`] for the layouts, GQA, causal and mask semantics), with the
//! same workspace contract: `delta` (f32 per query row) at the start of the
//! workspace, the f32 `dq` accumulator after it (256-byte aligned),
//! [`super::sdpa::sdpa_backward_workspace_bytes`] in all. The accumulator is
//! not row-major here: per (batch, q head) and per tile of
//! [`QUERIES_PER_TILE`] queries it holds one block of 64 x head_dim floats
//! in the order the consumers' wgmma registers produce them
//! (FlashAttention-3's layout: the consumers stage a tile's dQ with 16-byte
//! stores to consecutive addresses per warp, free of bank conflicts, and one
//! bulk reduction adds the whole block), `ceil(q_len / 64) * 64` rows per
//! head in all; the workspace function sizes every call for it.
//!
//! It runs sdpa.cu's `tpar_sdpa_bwd_pre_strided_*` (delta, the whole accumulator
//! zeroed), then this file's `tpar_sdpa_bwd_hopper<HD>_<dtype>` (one block
//! of 384 threads per 128 keys, kv head and batch: a producer warp bringing
//! K / V once and Q / dO tiles through a 2-stage ring by bulk tensor copies,
//! two consumer warpgroups computing with wgmma, a writer adding each tile's
//! dQ from shared memory into the accumulator with one bulk reduction; the
//! kernel's source describes it), then `tpar_sdpa_bwd_hopper_dq_<dtype>`
//! (dq scaled and converted from the tile layout, rows past `q_len`
//! skipped).
//!
//! The operands may lie at the element strides of [`SdpaBwdBuffers::layout`]
//! (q's for q and dq, k's for k and dk, v's for v and dv, out's for out and
//! dout): q, dout, k and v are read through 4-D tensor maps (head_dim, len,
//! heads, batch) with their strides, dk and dv are stored and dq converted
//! through theirs, so a `[batch, len, heads * head_dim]` or packed qkv
//! buffer and its gradient buffer need no transposing copies; `lse`, the
//! mask and the workspace keep their layouts.
//!
//! It takes bf16 and f16 with `head_dim == v_dim` of 64 or 128, 16-byte
//! aligned q, k, v, dout, dk and dv with strides that are multiples of 16
//! bytes below 2^40 bytes, on a launcher that runs `sm_90a`
//! kernels ([`target_of`]: a GPU handle compiling for `sm_90a`, or the CPU
//! emulator with [`EMU_ARCH_ENV`]` = sm_90a`). [`unsupported`] says why a call is not taken.
//! The kernels have not run on a GPU yet: no speed is measured.

use bytemuck::{Pod, Zeroable};

use super::super::tensor_map::TensorMap;
use super::super::{launch, CudaDType, LaunchConfig, Launcher};
use super::sdpa::{
    arg_strides, backward_args, check_backward_buffers, layout_extents, mask_args, SdpaArgStrides,
    SdpaBwdArgs, SdpaBwdBuffers, SdpaBwdStridedArgs, SdpaPath,
};
use super::sdpa_hopper::{operand_map, strides_unsupported, target_of};
use super::{bad, numel};
use crate::sdpa::SdpaShape;
use crate::Result;

pub use super::gemm_hopper::EMU_ARCH_ENV;

const OP: &str = "cuda sdpa_backward (hopper)";

/// Keys per block of the main kernel.
pub const KEYS_PER_BLOCK: usize = 128;
/// Queries per tile of the main kernel's ring.
pub const QUERIES_PER_TILE: usize = 64;
/// Threads per block of the main kernel (a producer and two consumer warpgroups).
pub const THREADS: u32 = 384;
/// Largest grid extent in y and z (kv heads and batch).
const MAX_GRID_YZ: usize = 65_535;

/// Dynamic shared memory of the main kernel for head dim `hd` (64 or 128):
/// alignment slack, K and V, two stages of Q and dO, two dS^T buffers, two
/// f32 dQ staging tiles, two stages of lse and delta, ten mbarriers
/// (133 200 bytes at head dim 64, 231 504 at 128, of the 232 448 an SM90 block may have).
pub const fn shared_bytes(hd: usize) -> u32 {
    let kv = KEYS_PER_BLOCK * hd * 2;
    let qt = QUERIES_PER_TILE * hd * 2;
    (1024
        + 2 * kv
        + 4 * qt
        + 2 * KEYS_PER_BLOCK * QUERIES_PER_TILE * 2
        + 2 * QUERIES_PER_TILE * hd * 4
        + 4 * QUERIES_PER_TILE * 4
        + 10 * 8) as u32
}

/// Arguments of `tpar_sdpa_bwd_hopper<HD>_<dtype>` and
/// `tpar_sdpa_bwd_hopper_dq_<dtype>`: four tensor maps, then the arguments
/// of sdpa.cu's strided backward kernels ([`SdpaBwdStridedArgs`]: the
/// buffers, sizes and every operand's strides).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct SdpaHopperBwdArgs {
    /// 4-D map (head_dim, q_len, q_heads, batch) over q with its strides, box
    /// 64 x 64 x 1 x 1, 128-byte swizzle.
    pub map_q: TensorMap,
    /// 4-D map (head_dim, kv_len, kv_heads, batch) over k, box 64 x 128 x 1 x 1.
    pub map_k: TensorMap,
    /// Like `map_k` over v.
    pub map_v: TensorMap,
    /// Like `map_q` over dout (out's strides).
    pub map_do: TensorMap,
    /// The buffers and sizes.
    pub a: SdpaBwdArgs,
    /// Element strides of q/dq, k/dk, v/dv and out/dout (`arg_strides`):
    /// the main kernel stores dk and dv, the dq kernel dq, through them.
    pub st: SdpaArgStrides,
}

/// Why the Hopper backward does not take this call on `l` (`None`: it does):
/// the device, the dtype, the head dims, a buffer that is not 16-byte
/// aligned or strides a tensor map cannot express (`strides_unsupported`:
/// q, k, v and out, whose strides dq, dk, dv and dout share), or sizes past
/// the grid and the kernels' coordinates. Sizes the kernels refuse outright (q_heads not a multiple of kv_heads,
/// buffers too small) are errors of [`sdpa_backward`] instead.
pub fn unsupported(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaBwdBuffers,
) -> Option<String> {
    if target_of(l).is_none() {
        return Some(format!(
            "{} does not run sm_90a kernels (wgmma, setmaxnreg; the emulator does with \
             {EMU_ARCH_ENV}=sm_90a)",
            l.describe()
        ));
    }
    if dtype == CudaDType::F32 {
        return Some("f32 attention (wgmma here takes bf16 or f16)".into());
    }
    if s.head_dim != s.v_dim || !matches!(s.head_dim, 64 | 128) {
        return Some(format!(
            "head_dim {} / v_dim {}: the kernel takes equal head dims of 64 or 128",
            s.head_dim, s.v_dim
        ));
    }
    // with no query or no key rows nothing is mapped (the call zeroes what it has to)
    let empty = s.batch.saturating_mul(s.q_heads).saturating_mul(s.q_len) == 0
        || s.batch.saturating_mul(s.kv_heads).saturating_mul(s.kv_len) == 0;
    let mapped = [("q", b.q), ("k", b.k), ("v", b.v), ("dout", b.dout), ("dk", b.dk), ("dv", b.dv)];
    if let Some((name, p)) = mapped.iter().find(|(_, p)| !empty && !p.is_multiple_of(16)) {
        return Some(format!("{name} address {p:#x} is not 16-byte aligned (a tensor map's base)"));
    }
    if !empty {
        let [q, k, v, out] = b.layout.resolve(s);
        for (name, st) in [("q", q), ("k", k), ("v", v), ("out", out)] {
            if let Some(why) = strides_unsupported(name, dtype, &st) {
                return Some(why);
            }
        }
    }
    if s.kv_heads > MAX_GRID_YZ || s.batch > MAX_GRID_YZ {
        return Some(format!(
            "{s:?}: kv_heads and batch are grid extents of at most {MAX_GRID_YZ}"
        ));
    }
    if s.q_len > i32::MAX as usize - 2 * KEYS_PER_BLOCK
        || s.kv_len > i32::MAX as usize - 2 * KEYS_PER_BLOCK
    {
        return Some(format!("{s:?}: sequence lengths beyond the kernel's i32 tile arithmetic"));
    }
    None
}

/// Attention backward on the Hopper kernel: writes `dq`, `dk` and `dv`
/// (overwritten; `dk`/`dv` sum over the q heads of each group), as
/// [`super::sdpa::sdpa_backward`] does. A call [`unsupported`] names is an
/// error; with no query or no key rows it runs the tensor-core backward
/// (which only zeroes what has to be).
///
/// # Safety
/// Every buffer must be valid on the launcher's device for the sizes `s`
/// gives it (elements of `dtype`; `lse` f32), the mask for `mask.len`
/// elements and the workspace for `workspace_bytes` bytes.
pub unsafe fn sdpa_backward(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaBwdBuffers,
) -> Result<()> {
    if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
        return Err(bad(OP, format!("{s:?}: q_heads must be a multiple of kv_heads > 0")));
    }
    if let Some(why) = unsupported(l, dtype, s, b) {
        return Err(bad(OP, format!("the Hopper backward does not take this call: {why}")));
    }
    let rows = numel(OP, &[s.batch, s.q_heads, s.q_len])?;
    let nq = numel(OP, &[rows, s.head_dim])?;
    let nk = numel(OP, &[s.batch, s.kv_heads, s.kv_len, s.head_dim])?;
    if nq == 0 || nk == 0 {
        // SAFETY: forwarded from the caller.
        return unsafe { super::sdpa::sdpa_backward(l, dtype, s, b, SdpaPath::TensorCore) };
    }
    let [eq, ek, ev, eo] = layout_extents(OP, s, &b.layout)?;
    check_backward_buffers(OP, dtype, s, b, [eq, ek, ev, eo, rows])?;
    let mask = mask_args(OP, dtype, s, b.mask.as_ref())?;
    let i = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| bad(OP, format!("{what} = {v} exceeds i32")))
    };
    let dims = [
        i("batch", s.batch)?,
        i("q_heads", s.q_heads)?,
        i("kv_heads", s.kv_heads)?,
        i("q_len", s.q_len)?,
        i("kv_len", s.kv_len)?,
        i("head_dim", s.head_dim)?,
        i("v_dim", s.v_dim)?,
    ];
    let a = backward_args(s, b, mask, rows, dims);
    let emu = target_of(l).is_some_and(|t| t.emulated);
    let hd = s.head_dim;
    let qh = s.batch * s.q_heads;
    let [q, k, v, out] = b.layout.resolve(s);
    let q_dims = (hd, s.q_len, s.q_heads, s.batch);
    let kv_dims = (hd, s.kv_len, s.kv_heads, s.batch);
    let (qt, kb) = (QUERIES_PER_TILE as u32, KEYS_PER_BLOCK as u32);
    let args = SdpaHopperBwdArgs {
        map_q: operand_map(emu, dtype, b.q, q, q_dims, qt)?,
        map_k: operand_map(emu, dtype, b.k, k, kv_dims, kb)?,
        map_v: operand_map(emu, dtype, b.v, v, kv_dims, kb)?,
        map_do: operand_map(emu, dtype, b.dout, out, q_dims, qt)?,
        a,
        st: arg_strides(OP, s, &b.layout)?,
    };
    let sfx = dtype.suffix();
    let blocks = rows.div_ceil(8).min(4096) as u32;
    // the accumulator's 4-float units: 64 x hd floats per tile of each head
    let units = numel(OP, &[qh, s.q_len.div_ceil(QUERIES_PER_TILE), QUERIES_PER_TILE * hd / 4])?;
    // SAFETY (all three launches): sizes and pointers checked above; the
    // caller vouches for the buffers; `delta` is the start of the checked
    // workspace and `dq_acc` the rest of it (`units` of 16 bytes).
    unsafe {
        // one warp per row: delta (out and dout through their strides); and
        // the whole dq accumulator zeroed
        let pre = SdpaBwdStridedArgs { a, st: args.st };
        let cfg = LaunchConfig::linear(blocks, 256);
        launch(l, &format!("tpar_sdpa_bwd_pre_strided_{sfx}"), cfg, &pre)?;
        let grid = [s.kv_len.div_ceil(KEYS_PER_BLOCK) as u32, s.kv_heads as u32, s.batch as u32];
        let cfg = LaunchConfig::grid(grid, THREADS).with_shared(shared_bytes(hd));
        launch(l, &format!("tpar_sdpa_bwd_hopper{hd}_{sfx}"), cfg, &args)?;
        let cfg = LaunchConfig::for_items(units, 256, 4096);
        launch(l, &format!("tpar_sdpa_bwd_hopper_dq_{sfx}"), cfg, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<SdpaBwdArgs>(), 160);
        assert_eq!(std::mem::size_of::<SdpaArgStrides>(), 96);
        assert_eq!(std::mem::size_of::<SdpaHopperBwdArgs>(), 768);
        assert_eq!(std::mem::align_of::<SdpaHopperBwdArgs>(), 64);
        const { assert!(shared_bytes(128) as usize <= 227 * 1024) };
        assert_eq!((shared_bytes(64), shared_bytes(128)), (133_200, 231_504));
    }
}
