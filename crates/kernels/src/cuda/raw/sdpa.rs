//! Scaled dot-product attention, flash-attention style (`cuda/sdpa.cu`).
//!
//! Same meaning as the CPU op [`crate::sdpa`]: q `[batch, q_heads, q_len,
//! head_dim]`, k `[batch, kv_heads, kv_len, head_dim]`, v `[batch, kv_heads,
//! kv_len, v_dim]`, out `[batch, q_heads, q_len, v_dim]`, and the saved
//! log-sum-exp `lse` `[batch, q_heads, q_len]` in f32 (natural log) for every
//! dtype. Grouped-query attention (q head `h` reads kv head
//! `h / (q_heads / kv_heads)`), top-left aligned causal masking, an optional
//! additive mask of the attention dtype broadcast by strides ([`SdpaDevMask`],
//! e.g. a key-padding mask with head and row strides 0); fully masked rows
//! give zeros, `lse = -inf` and no gradient.
//!
//! q, k, v and out (and dq, dk, dv, dout in the backward pass) may lie at any
//! element strides ([`SdpaLayout`], [`SdpaStrides`]) whose last dim is
//! contiguous: the kernels of `cuda/sdpa.cu` read and write them in place,
//! e.g. the heads of `[batch, len, heads, dim]` tensors or of one packed
//! `[batch, len, (q_heads + 2 kv_heads) * dim]` q/k/v projection output,
//! with the same results bit for bit as on dense copies.
//!
//! The forward pass walks key tiles with an online softmax and never stores
//! the score matrix. The backward pass recomputes the probabilities from
//! `lse`: a small kernel computes `delta = rowsum(dout * out)`, one block per
//! (key block, kv head, batch) accumulates `dk`/`dv` over the q heads of its
//! group (one writer per element) and adds `dq` into an f32 workspace with
//! atomics, and a last kernel scales and converts `dq`.
//!
//! Two kernel families ([`SdpaPath`]): tensor-core kernels for bf16/f16
//! (`mma.sync` + `ldmatrix`, head dims up to 128 that are multiples of 8,
//! 16-byte aligned tensors, strides that are multiples of 8 elements and row
//! strides below 2^24), and SIMT kernels for every dtype, any head dims up to
//! [`MAX_HEAD_DIM`] and any strides. [`SdpaPath::Auto`] takes the tensor
//! cores when they apply. On devices that run `sm_90a` kernels,
//! [`SdpaPath::Hopper`] selects the wgmma / TMA kernels of
//! [`super::sdpa_hopper`] (forward) and [`super::sdpa_hopper_bwd`]
//! (backward), which take strides that are multiples of 16 bytes (their
//! tensor maps); `Auto` does not pick them.

use bytemuck::{Pod, Zeroable};

use super::{bad, numel, strided_span};
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::sdpa::{mask_last_read, SdpaShape};
use crate::Result;

/// Largest `head_dim` / `v_dim` the kernels take.
pub const MAX_HEAD_DIM: usize = 256;
/// Largest head dim the tensor-core kernels take (larger ones run on SIMT).
pub const MAX_TENSOR_CORE_HEAD_DIM: usize = 128;

/// Query / key rows per tile of every kernel.
const BLOCK: usize = 64;
/// Largest grid extent in y and z (heads and batch).
const MAX_GRID_YZ: usize = 65_535;
/// Largest sequence length (tile arithmetic in `i32`).
const MAX_LEN: usize = i32::MAX as usize - 2 * BLOCK;

/// Arguments of `tpar_sdpa_fwd_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct SdpaFwdArgs {
    /// Queries `[batch, q_heads, q_len, head_dim]`.
    pub q: DevPtr,
    /// Keys `[batch, kv_heads, kv_len, head_dim]`.
    pub k: DevPtr,
    /// Values `[batch, kv_heads, kv_len, v_dim]`.
    pub v: DevPtr,
    /// Additive mask (attention dtype), or 0 for none.
    pub mask: DevPtr,
    /// Output `[batch, q_heads, q_len, v_dim]` (written).
    pub out: DevPtr,
    /// Log-sum-exp, f32 `[batch, q_heads, q_len]` (written).
    pub lse: DevPtr,
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
    /// Query/key head dim.
    pub head_dim: i32,
    /// Value head dim.
    pub v_dim: i32,
    /// 1 for top-left aligned causal masking.
    pub causal: i32,
    /// Multiplier of `q·k`.
    pub scale: f32,
    /// Padding (keeps the struct free of implicit padding).
    pub pad: i32,
    /// Element strides of q, k, v and out.
    pub st: SdpaArgStrides,
}

/// Element strides of one operand `[batch, heads, len, dim]` as the kernels
/// take them (`cuda/tpar.cuh`'s `SdpaOpStrides`): element `(b, h, i, j)` at
/// `b*batch + h*head + i*row + j` (`SdpaLayout::resolve`'s strides).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct SdpaOpStrides {
    /// Elements between batches.
    pub batch: i64,
    /// Elements between heads.
    pub head: i64,
    /// Elements between rows.
    pub row: i64,
}

/// The strides of every operand (`cuda/tpar.cuh`'s `SdpaArgStrides`): the
/// backward pass uses q's for q and dq, k's for k and dk, v's for v and dv,
/// out's for out and dout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct SdpaArgStrides {
    /// Strides of q (and dq).
    pub q: SdpaOpStrides,
    /// Strides of k (and dk).
    pub k: SdpaOpStrides,
    /// Strides of v (and dv).
    pub v: SdpaOpStrides,
    /// Strides of out (and dout).
    pub out: SdpaOpStrides,
}

/// Arguments of `tpar_sdpa_bwd_*` (mirrors `SdpaBwdArgs` of `cuda/tpar.cuh`,
/// shared with the Hopper backward); `cuda/sdpa.cu`'s backward kernels take
/// it inside [`SdpaBwdStridedArgs`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct SdpaBwdArgs {
    /// Queries `[batch, q_heads, q_len, head_dim]`.
    pub q: DevPtr,
    /// Keys `[batch, kv_heads, kv_len, head_dim]`.
    pub k: DevPtr,
    /// Values `[batch, kv_heads, kv_len, v_dim]`.
    pub v: DevPtr,
    /// Additive mask (attention dtype), or 0 for none.
    pub mask: DevPtr,
    /// Forward output `[batch, q_heads, q_len, v_dim]`.
    pub out: DevPtr,
    /// Gradient of the output, like `out`.
    pub dout: DevPtr,
    /// Forward log-sum-exp, f32 `[batch, q_heads, q_len]`.
    pub lse: DevPtr,
    /// f32 workspace `[batch * q_heads * q_len]`: `rowsum(dout * out)`.
    pub delta: DevPtr,
    /// f32 workspace: unscaled `dq`, `[batch * q_heads * q_len, head_dim]`
    /// (the Hopper backward: its tile layout, [`super::sdpa_hopper_bwd`]).
    pub dq_acc: DevPtr,
    /// Gradient of q (written).
    pub dq: DevPtr,
    /// Gradient of k (written).
    pub dk: DevPtr,
    /// Gradient of v (written).
    pub dv: DevPtr,
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
    /// Query/key head dim.
    pub head_dim: i32,
    /// Value head dim.
    pub v_dim: i32,
    /// 1 for top-left aligned causal masking.
    pub causal: i32,
    /// Multiplier of `q·k`.
    pub scale: f32,
    /// Padding (keeps the struct free of implicit padding).
    pub pad: i32,
}

/// Arguments of `cuda/sdpa.cu`'s backward kernels (`tpar_sdpa_bwd_simt*`,
/// `_tc*`, `_pre_strided_*`, `_dq_*`): the shared backward arguments and the
/// operands' strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct SdpaBwdStridedArgs {
    /// Buffers and sizes.
    pub a: SdpaBwdArgs,
    /// Element strides of q/dq, k/dk, v/dv and out/dout.
    pub st: SdpaArgStrides,
}

/// An additive attention mask in device memory, elements of the attention
/// dtype: the element for `(b, h, i, j)` (h a q head) is at
/// `data + (b*batch_stride + h*head_stride + i*row_stride + j)` elements, as
/// in [`crate::sdpa::SdpaMask`]. A stride of 0 broadcasts; `-inf` masks a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SdpaDevMask {
    /// Device address of the first element.
    pub data: DevPtr,
    /// Elements the buffer holds (every read is checked to fall inside).
    pub len: usize,
    /// Elements between batches (0 = broadcast).
    pub batch_stride: usize,
    /// Elements between q heads (0 = broadcast).
    pub head_stride: usize,
    /// Elements between query rows (0 = broadcast).
    pub row_stride: usize,
}

/// Element strides of one attention operand `[batch, heads, len, dim]`
/// whose last dim is contiguous: element `(b, h, i, j)` is at
/// `b*batch + h*head + i*row + j`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SdpaStrides {
    /// Elements between batches.
    pub batch: usize,
    /// Elements between heads.
    pub head: usize,
    /// Elements between rows (positions).
    pub row: usize,
}

impl SdpaStrides {
    /// The dense `[batch, heads, len, dim]` layout.
    pub fn contiguous(heads: usize, len: usize, dim: usize) -> Self {
        Self { batch: heads * len * dim, head: len * dim, row: dim }
    }

    /// Heads side by side in the rows of a `[batch, len, row_width]` buffer
    /// (head `h` at columns `h*dim..(h+1)*dim` of each row), as a `[b, s, h,
    /// d]` tensor or a packed q/k/v projection output gives them.
    pub fn bshd(len: usize, row_width: usize, dim: usize) -> Self {
        Self { batch: len * row_width, head: dim, row: row_width }
    }
}

/// Where each attention operand lies; `None` is the dense `[batch, heads,
/// len, dim]` layout. The backward pass uses q's strides for q and dq, k's
/// for k and dk, v's for v and dv, and out's for out and dout; `lse`, the
/// mask and the workspace keep their own layouts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SdpaLayout {
    /// Strides of q (and dq).
    pub q: Option<SdpaStrides>,
    /// Strides of k (and dk).
    pub k: Option<SdpaStrides>,
    /// Strides of v (and dv).
    pub v: Option<SdpaStrides>,
    /// Strides of out (and dout).
    pub out: Option<SdpaStrides>,
}

impl SdpaLayout {
    /// Every operand dense (the default).
    pub fn is_dense(&self) -> bool {
        [self.q, self.k, self.v, self.out].iter().all(Option::is_none)
    }

    /// q's, k's, v's and out's name, strides in this layout, and `(heads,
    /// len, dim)` under `s`.
    fn operands(&self, s: &SdpaShape) -> [(&'static str, Option<SdpaStrides>, [usize; 3]); 4] {
        [
            ("q", self.q, [s.q_heads, s.q_len, s.head_dim]),
            ("k", self.k, [s.kv_heads, s.kv_len, s.head_dim]),
            ("v", self.v, [s.kv_heads, s.kv_len, s.v_dim]),
            ("out", self.out, [s.q_heads, s.q_len, s.v_dim]),
        ]
    }

    /// The strides of q, k, v and out for shape `s` as the kernels use them:
    /// this layout's, the dense ones where it has none, and the dense stride
    /// of every dim with one index (such a stride never moves an address, so
    /// the layout checks ignore it; the dense one suits every kernel).
    pub(crate) fn resolve(&self, s: &SdpaShape) -> [SdpaStrides; 4] {
        self.operands(s).map(|(_, st, [heads, len, dim])| {
            let dense = SdpaStrides::contiguous(heads, len, dim);
            let st = st.unwrap_or(dense);
            let pick = |n: usize, given: usize, dense: usize| if n > 1 { given } else { dense };
            SdpaStrides {
                batch: pick(s.batch, st.batch, dense.batch),
                head: pick(heads, st.head, dense.head),
                row: pick(len, st.row, dense.row),
            }
        })
    }
}

/// Device buffers of [`sdpa_forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SdpaFwdBuffers {
    /// Queries `[batch, q_heads, q_len, head_dim]`.
    pub q: DevPtr,
    /// Keys `[batch, kv_heads, kv_len, head_dim]`.
    pub k: DevPtr,
    /// Values `[batch, kv_heads, kv_len, v_dim]`.
    pub v: DevPtr,
    /// Optional additive mask.
    pub mask: Option<SdpaDevMask>,
    /// Output `[batch, q_heads, q_len, v_dim]` (written).
    pub out: DevPtr,
    /// Log-sum-exp, f32 `[batch, q_heads, q_len]` (written).
    pub lse: DevPtr,
    /// Where q, k, v and out lie (dense by default).
    pub layout: SdpaLayout,
}

/// Device buffers of [`sdpa_backward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SdpaBwdBuffers {
    /// Queries, as in the forward pass.
    pub q: DevPtr,
    /// Keys, as in the forward pass.
    pub k: DevPtr,
    /// Values, as in the forward pass.
    pub v: DevPtr,
    /// The forward pass's mask.
    pub mask: Option<SdpaDevMask>,
    /// Forward output.
    pub out: DevPtr,
    /// Forward log-sum-exp (f32).
    pub lse: DevPtr,
    /// Gradient of the output.
    pub dout: DevPtr,
    /// Gradient of q (written, shaped like q).
    pub dq: DevPtr,
    /// Gradient of k (written, shaped like k; sums the q heads of each group).
    pub dk: DevPtr,
    /// Gradient of v (written, shaped like v; sums the q heads of each group).
    pub dv: DevPtr,
    /// Scratch memory, 16-byte aligned, of at least
    /// [`sdpa_backward_workspace_bytes`] bytes.
    pub workspace: DevPtr,
    /// Bytes available at `workspace`.
    pub workspace_bytes: usize,
    /// Where q/dq, k/dk, v/dv and out/dout lie (dense by default).
    pub layout: SdpaLayout,
}

/// Which kernel family runs an attention call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SdpaPath {
    /// Tensor cores when the dtype, head dims and alignment allow, else SIMT.
    #[default]
    Auto,
    /// The SIMT kernels (every dtype, head dims up to [`MAX_HEAD_DIM`]).
    Simt,
    /// The tensor-core kernels; an error when they do not apply. The forward
    /// pass takes 64 query rows per block.
    TensorCore,
    /// As [`SdpaPath::TensorCore`], with 128 query rows per forward block:
    /// each warp owns two 16-row tiles, so every k/v fragment read from shared
    /// memory feeds two mma. `Auto` picks it when there are enough blocks to
    /// fill the GPU.
    TensorCoreWide,
    /// The Hopper (`sm_90a`) kernels. Forward: [`super::sdpa_hopper`], an
    /// error naming why when the device does not run it or it does not take
    /// the call ([`super::sdpa_hopper::unsupported`]). Backward:
    /// [`super::sdpa_hopper_bwd`] where it takes the call
    /// ([`super::sdpa_hopper_bwd::unsupported`]), else the tensor-core
    /// kernels (as [`SdpaPath::TensorCore`]; the same `lse` convention). Both
    /// take [`SdpaLayout`] strides that are multiples of 16 bytes. `Auto`
    /// never picks it: these kernels have not run on a GPU yet.
    Hopper,
}

/// Validated sizes of one call, in the kernels' integer types.
pub(crate) struct Dims {
    pub(crate) batch: i32,
    pub(crate) q_heads: i32,
    pub(crate) kv_heads: i32,
    pub(crate) q_len: i32,
    pub(crate) kv_len: i32,
    head_dim: i32,
    v_dim: i32,
    /// `batch * q_heads * q_len`.
    rows: usize,
    /// Elements of q, k, v and out.
    q: usize,
    k: usize,
    v: usize,
    out: usize,
    /// Mask pointer and strides (0s without a mask).
    pub(crate) mask: (DevPtr, i64, i64, i64),
}

fn to_i32(op: &'static str, what: &str, v: usize, max: usize) -> Result<i32> {
    if v > max {
        return Err(bad(op, format!("{what} = {v} exceeds the supported {max}")));
    }
    Ok(v as i32)
}

fn validate(
    op: &'static str,
    dtype: CudaDType,
    s: &SdpaShape,
    mask: Option<&SdpaDevMask>,
) -> Result<Dims> {
    if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
        return Err(bad(op, format!("{s:?}: q_heads must be a multiple of kv_heads > 0")));
    }
    if s.head_dim > MAX_HEAD_DIM || s.v_dim > MAX_HEAD_DIM {
        return Err(bad(
            op,
            format!(
                "head_dim {} / v_dim {}: head dims above {MAX_HEAD_DIM} are not supported",
                s.head_dim, s.v_dim
            ),
        ));
    }
    let d = Dims {
        batch: to_i32(op, "batch", s.batch, MAX_GRID_YZ)?,
        q_heads: to_i32(op, "q_heads", s.q_heads, MAX_GRID_YZ)?,
        kv_heads: to_i32(op, "kv_heads", s.kv_heads, MAX_GRID_YZ)?,
        q_len: to_i32(op, "q_len", s.q_len, MAX_LEN)?,
        kv_len: to_i32(op, "kv_len", s.kv_len, MAX_LEN)?,
        head_dim: s.head_dim as i32,
        v_dim: s.v_dim as i32,
        rows: numel(op, &[s.batch, s.q_heads, s.q_len])?,
        q: numel(op, &[s.batch, s.q_heads, s.q_len, s.head_dim])?,
        k: numel(op, &[s.batch, s.kv_heads, s.kv_len, s.head_dim])?,
        v: numel(op, &[s.batch, s.kv_heads, s.kv_len, s.v_dim])?,
        out: numel(op, &[s.batch, s.q_heads, s.q_len, s.v_dim])?,
        mask: (0, 0, 0, 0),
    };
    let mask = mask_args(op, dtype, s, mask)?;
    Ok(Dims { mask, ..d })
}

/// The mask's pointer and the strides the kernels use (0s without a mask,
/// and 0 where a dim has one index), after checking that every read falls
/// inside the mask and that it is present and aligned to its element.
pub(crate) fn mask_args(
    op: &'static str,
    dtype: CudaDType,
    s: &SdpaShape,
    mask: Option<&SdpaDevMask>,
) -> Result<(DevPtr, i64, i64, i64)> {
    let Some(m) = mask else { return Ok((0, 0, 0, 0)) };
    if s.batch == 0 || s.q_heads == 0 || s.q_len == 0 || s.kv_len == 0 {
        // nothing is read
        return Ok((m.data, 0, 0, 0));
    }
    let strides = [m.batch_stride, m.head_stride, m.row_stride];
    if !matches!(mask_last_read(s, strides), Some(last) if last < m.len) {
        return Err(bad(
            op,
            format!(
                "{s:?}: mask with strides (batch {}, head {}, row {}) reads past its {} elements",
                m.batch_stride, m.head_stride, m.row_stride, m.len
            ),
        ));
    }
    check_ptr(op, "mask", m.data, m.len, dtype.size())?;
    // A stride the kernels use (its dim has more than one index) is at most
    // the last offset read, so it fits in i64; the others are never used.
    let st = |n: usize, v: usize| if n > 1 { v as i64 } else { 0 };
    Ok((
        m.data,
        st(s.batch, m.batch_stride),
        st(s.q_heads, m.head_stride),
        st(s.q_len, m.row_stride),
    ))
}

/// Elements each operand spans, `[q, k, v, out]`: one past the last element
/// a call reads or writes, under `layout` (the dense sizes where it has no
/// strides). Errors name the operand whose strides are unusable: a row
/// stride below its dim, an extent that overflows, or strides under which two
/// elements share an address (every operand is checked, as the backward pass
/// writes dq, dk and dv with q's, k's and v's strides).
pub(crate) fn layout_extents(
    op: &'static str,
    s: &SdpaShape,
    layout: &SdpaLayout,
) -> Result<[usize; 4]> {
    let mut out = [0; 4];
    for (slot, (name, strides, [heads, len, dim])) in out.iter_mut().zip(layout.operands(s)) {
        let dense = numel(op, &[s.batch, heads, len, dim])?;
        let Some(st) = strides else {
            *slot = dense;
            continue;
        };
        if dense == 0 {
            continue;
        }
        let what = |why: String| {
            bad(
                op,
                format!(
                    "{name} strides (batch {}, head {}, row {}): {why}",
                    st.batch, st.head, st.row
                ),
            )
        };
        if st.row < dim {
            return Err(what(format!("the row stride is below the dim {dim}")));
        }
        let dims = [(st.row, len), (st.head, heads), (st.batch, s.batch)];
        *slot = strided_span(dim, dims, true).map_err(|e| what(e.why().into()))?;
    }
    Ok(out)
}

/// The kernels' strides of every operand under `layout`
/// ([`SdpaLayout::resolve`]). Errors name an operand whose strides do not
/// fit `i64`; [`layout_extents`] refuses those first.
pub(crate) fn arg_strides(
    op: &'static str,
    s: &SdpaShape,
    layout: &SdpaLayout,
) -> Result<SdpaArgStrides> {
    let [q, k, v, out] = layout.resolve(s);
    let one = |name: &str, st: SdpaStrides| {
        let get = |v: usize| {
            i64::try_from(v).map_err(|_| bad(op, format!("{name} stride {v} exceeds i64")))
        };
        Ok(SdpaOpStrides { batch: get(st.batch)?, head: get(st.head)?, row: get(st.row)? })
    };
    Ok(SdpaArgStrides { q: one("q", q)?, k: one("k", k)?, v: one("v", v)?, out: one("out", out)? })
}

/// Largest row stride the tensor-core kernels take: their tile offsets
/// (128 rows) are `i32`.
const MAX_TENSOR_CORE_ROW_STRIDE: i64 = (1 << 24) - 1;

/// Why the tensor-core kernels cannot address operands with strides `st`
/// (`names`: what q's, k's, v's and out's strides are called in the
/// message), if they cannot: each stride must keep every row 16-byte aligned
/// (a multiple of 8 elements of a 16-bit dtype), and the row strides must fit
/// their tile offsets.
fn tensor_core_strides_unfit(names: [&str; 4], st: &SdpaArgStrides) -> Option<String> {
    let ops = [st.q, st.k, st.v, st.out];
    names.iter().zip(ops).find_map(|(name, o)| {
        let dims = [("batch", o.batch), ("head", o.head), ("row", o.row)];
        let why = |(dim, v): (&str, i64)| {
            if v % 8 != 0 {
                Some(format!(
                    "{name} {dim} stride {v}: the tensor-core kernels need strides that are \
                     multiples of 8 elements (16-byte aligned rows)"
                ))
            } else if dim == "row" && v > MAX_TENSOR_CORE_ROW_STRIDE {
                Some(format!(
                    "{name} row stride {v}: the tensor-core kernels take row strides up to \
                     {MAX_TENSOR_CORE_ROW_STRIDE} elements"
                ))
            } else {
                None
            }
        };
        dims.into_iter().find_map(why)
    })
}

/// A buffer of `elems` elements must be non-null and aligned to its element;
/// an empty one may sit anywhere.
fn check_ptr(op: &'static str, name: &str, p: DevPtr, elems: usize, align: usize) -> Result<()> {
    if elems == 0 {
        return Ok(());
    }
    super::check_ptr(op, name, p, elems, align)
}

/// The tensor-core head dim (64 or 128) for these sizes, buffers
/// (`(address, elements)`; empty ones may sit anywhere) and strides (named
/// `names` in messages), or why the tensor-core kernels do not apply.
fn tensor_core_dim(
    dtype: CudaDType,
    s: &SdpaShape,
    ptrs: &[(DevPtr, usize)],
    (names, st): ([&str; 4], &SdpaArgStrides),
) -> std::result::Result<usize, String> {
    let dim = s.head_dim.max(s.v_dim);
    let ok = dtype != CudaDType::F32
        && s.head_dim.is_multiple_of(8)
        && s.v_dim.is_multiple_of(8)
        && dim <= MAX_TENSOR_CORE_HEAD_DIM
        && ptrs.iter().all(|&(p, n)| n == 0 || p % 16 == 0);
    if !ok {
        return Err(format!(
            "{s:?} ({dtype:?}): the tensor-core kernels need bf16/f16, head dims that are \
             multiples of 8 up to {MAX_TENSOR_CORE_HEAD_DIM}, and 16-byte aligned tensors"
        ));
    }
    match tensor_core_strides_unfit(names, st) {
        Some(why) => Err(why),
        None => Ok(if dim <= 64 { 64 } else { 128 }),
    }
}

/// A kernel variant chosen for a call.
struct Plan {
    /// Kernel name.
    name: String,
    /// Threads per block.
    threads: u32,
    /// Dynamic shared memory per block.
    smem: u32,
    /// Query rows (forward) or keys (backward) per block.
    rows: usize,
}

/// Forward blocks below which the 128-row tensor-core forward would leave a
/// large GPU partly idle (about two blocks per SM of an H100/H200).
const WIDE_MIN_BLOCKS: usize = 256;

/// Picks the kernel of `pass` (`"fwd"` or `"bwd"`) for buffers `ptrs` and
/// strides `st`.
fn plan(
    op: &'static str,
    pass: &str,
    dtype: CudaDType,
    s: &SdpaShape,
    path: SdpaPath,
    ptrs: &[(DevPtr, usize)],
    st: &SdpaArgStrides,
) -> Result<Plan> {
    let names =
        if pass == "fwd" { ["q", "k", "v", "out"] } else { ["q/dq", "k/dk", "v/dv", "out/dout"] };
    let tc = match path {
        SdpaPath::Simt => None,
        SdpaPath::Auto => tensor_core_dim(dtype, s, ptrs, (names, st)).ok(),
        SdpaPath::TensorCore | SdpaPath::TensorCoreWide | SdpaPath::Hopper => {
            Some(tensor_core_dim(dtype, s, ptrs, (names, st)).map_err(|why| bad(op, why))?)
        }
    };
    let sfx = dtype.suffix();
    Ok(match (tc, pass) {
        (Some(hd), "fwd") => {
            let wide = match path {
                SdpaPath::TensorCoreWide => true,
                SdpaPath::TensorCore | SdpaPath::Hopper => false,
                // At head dim 64 the 64-row forward is the faster one (H100, 8 x 16
                // heads x 1024 causal: 119 against 96 TFLOP/s; the 128-row kernel
                // runs at the 255-register cap), so only head dim 128 goes wide.
                _ => {
                    hd > 64
                        && s.q_len > BLOCK
                        && s.batch * s.q_heads * s.q_len.div_ceil(2 * BLOCK) >= WIDE_MIN_BLOCKS
                }
            };
            // The q tile, the k tile, and a v tile unless v reuses the q
            // tile's space (q fragments in registers: 64 rows of head dim 64).
            let rows = if wide { 2 * BLOCK } else { BLOCK };
            let v_tile = if rows * hd <= BLOCK * 64 { 0 } else { BLOCK };
            Plan {
                name: format!("tpar_sdpa_fwd_tc{hd}{}_{sfx}", if wide { "m2" } else { "" }),
                threads: 128,
                smem: ((rows + BLOCK + v_tile) * hd * 2) as u32,
                rows,
            }
        }
        (Some(hd), _) => Plan {
            name: format!("tpar_sdpa_bwd_tc{hd}_{sfx}"),
            threads: 128,
            // k, v, two q and dout tiles, dS^T, lse and delta.
            smem: ((6 * BLOCK * hd + BLOCK * BLOCK) * 2 + 2 * BLOCK * 4) as u32,
            rows: BLOCK,
        },
        (None, _) => {
            // 32-column chunks of the larger head dim, rounded up to 1, 2, 4 or 8.
            let nc = s.head_dim.max(s.v_dim).div_ceil(32).max(1).next_power_of_two();
            let floats = if pass == "fwd" {
                2 * BLOCK * 33 + BLOCK * (BLOCK + 1)
            } else {
                4 * BLOCK * 33 + 2 * 32
            };
            Plan {
                name: format!("tpar_sdpa_{pass}_simt{nc}_{sfx}"),
                threads: 256,
                smem: (floats * 4) as u32,
                rows: BLOCK,
            }
        }
    })
}

/// The checks of a forward call: sizes, mask reach, and each buffer present
/// and aligned to its element.
pub(crate) fn validate_forward(
    op: &'static str,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaFwdBuffers,
) -> Result<Dims> {
    let d = validate(op, dtype, s, b.mask.as_ref())?;
    let es = dtype.size();
    let [q, k, v, out] = layout_extents(op, s, &b.layout)?;
    for (name, p, n) in [("q", b.q, q), ("k", b.k, k), ("v", b.v, v), ("out", b.out, out)] {
        check_ptr(op, name, p, n, es)?;
    }
    check_ptr(op, "lse", b.lse, d.rows, 4)?;
    Ok(d)
}

/// The buffer checks of a backward call with `[q, k, v, out, rows]`
/// elements: q, k, v, out, dout, dq, dk and dv present and aligned to their
/// element (an empty one may sit anywhere), lse for `rows` f32s, and a
/// 16-byte aligned workspace of at least [`sdpa_backward_workspace_bytes`].
pub(crate) fn check_backward_buffers(
    op: &'static str,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaBwdBuffers,
    [q, k, v, out, rows]: [usize; 5],
) -> Result<()> {
    let es = dtype.size();
    for (name, p, n) in [
        ("q", b.q, q),
        ("k", b.k, k),
        ("v", b.v, v),
        ("out", b.out, out),
        ("dout", b.dout, out),
        ("dq", b.dq, q),
        ("dk", b.dk, k),
        ("dv", b.dv, v),
    ] {
        check_ptr(op, name, p, n, es)?;
    }
    check_ptr(op, "lse", b.lse, rows, 4)?;
    let need = sdpa_backward_workspace_bytes(s)?;
    if b.workspace_bytes < need {
        return Err(bad(
            op,
            format!("workspace of {} bytes; {s:?} needs {need}", b.workspace_bytes),
        ));
    }
    check_ptr(op, "workspace", b.workspace, need, 16)
}

/// The backward kernels' arguments: the buffers of `b` (`delta` at the start
/// of the workspace, the `dq` accumulator after `rows` of it), the mask's
/// pointer and strides from [`mask_args`], and `[batch, q_heads, kv_heads,
/// q_len, kv_len, head_dim, v_dim]` checked to fit in `i32`.
pub(crate) fn backward_args(
    s: &SdpaShape,
    b: &SdpaBwdBuffers,
    (mask, mask_bs, mask_hs, mask_rs): (DevPtr, i64, i64, i64),
    rows: usize,
    [batch, q_heads, kv_heads, q_len, kv_len, head_dim, v_dim]: [i32; 7],
) -> SdpaBwdArgs {
    let delta_off = delta_bytes(rows).unwrap_or(0) as u64;
    SdpaBwdArgs {
        q: b.q,
        k: b.k,
        v: b.v,
        mask,
        out: b.out,
        dout: b.dout,
        lse: b.lse,
        delta: b.workspace,
        dq_acc: b.workspace + delta_off,
        dq: b.dq,
        dk: b.dk,
        dv: b.dv,
        mask_bs,
        mask_hs,
        mask_rs,
        batch,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        v_dim,
        causal: s.causal as i32,
        scale: s.scale as f32,
        pad: 0,
    }
}

/// Rows of `delta` rounded so that the `dq` accumulator starts 256-byte aligned.
fn delta_bytes(rows: usize) -> Option<usize> {
    rows.checked_mul(4)?.checked_next_multiple_of(256)
}

/// Bytes of workspace [`sdpa_backward`] needs for shape `s`, whichever
/// kernel runs it: f32 `delta` per query row, then an f32 `dq` accumulator
/// of `ceil(q_len / 64) * 64` rows of `head_dim` per (batch, q head) (the
/// Hopper backward's tile layout needs them all; the other kernels use the
/// first `batch * q_heads * q_len` rows, row-major).
pub fn sdpa_backward_workspace_bytes(s: &SdpaShape) -> Result<usize> {
    const OP: &str = "cuda sdpa_backward";
    let rows = numel(OP, &[s.batch, s.q_heads, s.q_len])?;
    let tile = super::sdpa_hopper_bwd::QUERIES_PER_TILE;
    let acc = numel(OP, &[s.batch, s.q_heads, s.q_len.div_ceil(tile), tile, s.head_dim, 4])?;
    delta_bytes(rows)
        .and_then(|d| d.checked_add(acc))
        .ok_or_else(|| bad(OP, format!("{s:?}: workspace size overflows")))
}

/// Attention forward: `out = softmax(scale * q kᵀ + mask) v` per (batch, q
/// head), and `lse` = log-sum-exp of each query row's scaled, masked scores.
///
/// # Safety
/// Every buffer must be valid on the launcher's device for the elements
/// `s` and the strides of `layout` reach (elements of `dtype`; `lse` f32),
/// and the mask for `mask.len` elements.
pub unsafe fn sdpa_forward(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaFwdBuffers,
    path: SdpaPath,
) -> Result<()> {
    const OP: &str = "cuda sdpa_forward";
    if path == SdpaPath::Hopper {
        // SAFETY: forwarded from the caller.
        return unsafe { super::sdpa_hopper::sdpa_forward(l, dtype, s, b) };
    }
    let d = validate_forward(OP, dtype, s, b)?;
    if d.rows == 0 {
        return Ok(());
    }
    let st = arg_strides(OP, s, &b.layout)?;
    let ptrs = [(b.q, d.q), (b.k, d.k), (b.v, d.v), (b.out, d.out)];
    let p = plan(OP, "fwd", dtype, s, path, &ptrs, &st)?;
    let args = SdpaFwdArgs {
        q: b.q,
        k: b.k,
        v: b.v,
        mask: d.mask.0,
        out: b.out,
        lse: b.lse,
        mask_bs: d.mask.1,
        mask_hs: d.mask.2,
        mask_rs: d.mask.3,
        batch: d.batch,
        q_heads: d.q_heads,
        kv_heads: d.kv_heads,
        q_len: d.q_len,
        kv_len: d.kv_len,
        head_dim: d.head_dim,
        v_dim: d.v_dim,
        causal: s.causal as i32,
        scale: s.scale as f32,
        pad: 0,
        st,
    };
    let grid = [s.q_len.div_ceil(p.rows) as u32, d.q_heads as u32, d.batch as u32];
    let cfg = LaunchConfig::grid(grid, p.threads).with_shared(p.smem);
    // SAFETY: sizes and pointers checked above; the caller vouches for validity.
    unsafe { launch(l, &p.name, cfg, &args) }
}

/// Attention backward from the forward's `out` and `lse`: writes `dq`, `dk`
/// and `dv` (overwritten; `dk`/`dv` sum over the q heads of each group). No
/// gradient is produced for the mask.
///
/// # Safety
/// Every buffer must be valid on the launcher's device for the elements
/// `s` and the strides of `layout` reach (elements of `dtype`; `lse` f32),
/// the mask for `mask.len` elements and the workspace for `workspace_bytes`
/// bytes.
pub unsafe fn sdpa_backward(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &SdpaShape,
    b: &SdpaBwdBuffers,
    path: SdpaPath,
) -> Result<()> {
    const OP: &str = "cuda sdpa_backward";
    let deterministic = crate::cuda::deterministic();
    if path == SdpaPath::Hopper
        && !deterministic
        && super::sdpa_hopper_bwd::unsupported(l, dtype, s, b).is_none()
    {
        // SAFETY: forwarded from the caller (the same buffer contract).
        return unsafe { super::sdpa_hopper_bwd::sdpa_backward(l, dtype, s, b) };
    }
    let d = validate(OP, dtype, s, b.mask.as_ref())?;
    let [q, k, v, out] = layout_extents(OP, s, &b.layout)?;
    check_backward_buffers(OP, dtype, s, b, [q, k, v, out, d.rows])?;
    let dims = [d.batch, d.q_heads, d.kv_heads, d.q_len, d.kv_len, d.head_dim, d.v_dim];
    let st = arg_strides(OP, s, &b.layout)?;
    let args = SdpaBwdStridedArgs { a: backward_args(s, b, d.mask, d.rows, dims), st };
    let sfx = dtype.suffix();
    let ptrs = [(b.q, d.q), (b.k, d.k), (b.v, d.v), (b.dout, d.out), (b.dk, d.k), (b.dv, d.v)];
    let p = plan(OP, "bwd", dtype, s, path, &ptrs, &st)?;
    // The pre and dq kernels: one warp per query row.
    let per_row = LaunchConfig::linear(d.rows.div_ceil(8).min(4096) as u32, 256);
    if d.rows > 0 {
        // SAFETY: sizes and pointers checked above; the caller vouches for
        // the buffers (`delta` is the start of the workspace).
        unsafe { launch(l, &format!("tpar_sdpa_bwd_pre_strided_{sfx}"), per_row, &args)? };
    }
    if d.k.max(d.v) > 0 {
        // A block per key block; deterministic (`cuda::set_deterministic`), one per
        // (kv head, batch) taking its key blocks in order, so its dQ atomics run in
        // key-block order whatever order the blocks run in.
        let key_blocks = if deterministic { 1 } else { s.kv_len.div_ceil(p.rows) as u32 };
        let grid = [key_blocks, d.kv_heads as u32, d.batch as u32];
        let cfg = LaunchConfig::grid(grid, p.threads).with_shared(p.smem);
        // SAFETY: as above; `dq_acc` is the rest of the checked workspace.
        unsafe { launch(l, &p.name, cfg, &args)? };
    }
    if d.q > 0 {
        // SAFETY: as above.
        unsafe { launch(l, &format!("tpar_sdpa_bwd_dq_{sfx}"), per_row, &args)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> SdpaShape {
        SdpaShape {
            batch: 2,
            q_heads: 4,
            kv_heads: 2,
            q_len: 5,
            kv_len: 5,
            head_dim: 8,
            v_dim: 8,
            scale: 0.25,
            causal: true,
        }
    }

    #[test]
    fn extents_of_dense_and_packed_layouts() {
        let s = shape();
        let dense = layout_extents("t", &s, &SdpaLayout::default()).unwrap();
        assert_eq!(dense, [2 * 4 * 5 * 8, 2 * 2 * 5 * 8, 2 * 2 * 5 * 8, 2 * 4 * 5 * 8]);
        // the explicit dense strides span the same elements
        let c = |h| Some(SdpaStrides::contiguous(h, 5, 8));
        let explicit = SdpaLayout { q: c(4), k: c(2), v: c(2), out: c(4) };
        assert_eq!(layout_extents("t", &s, &explicit).unwrap(), dense);
        // a packed [b, s, (4 + 2 + 2) * 8] projection: each operand starts at its
        // first column and reaches the last row of the last batch
        let w = (4 + 2 + 2) * 8;
        let p = Some(SdpaStrides::bshd(5, w, 8));
        let packed = SdpaLayout { q: p, k: p, v: p, out: Some(SdpaStrides::bshd(5, 32, 8)) };
        let [q, k, v, out] = layout_extents("t", &s, &packed).unwrap();
        assert_eq!(q, 5 * w + 4 * w + 3 * 8 + 8);
        assert_eq!((k, v), (5 * w + 4 * w + 8 + 8, 5 * w + 4 * w + 8 + 8));
        assert_eq!(out, 2 * 5 * 32);
    }

    #[test]
    fn overlapping_or_short_strides_are_refused_by_operand() {
        let s = shape();
        let err = |l: SdpaLayout| layout_extents("t", &s, &l).unwrap_err().to_string();
        // heads 4 elements apart overlap the 8-element rows
        let overlap = SdpaStrides { batch: 4 * 5 * 8, head: 4, row: 32 };
        let e = err(SdpaLayout { out: Some(overlap), ..Default::default() });
        assert!(e.contains("out strides") && e.contains("share an address"), "{e}");
        let short = SdpaStrides { batch: 400, head: 40, row: 6 };
        let e = err(SdpaLayout { k: Some(short), ..Default::default() });
        assert!(e.contains("k strides") && e.contains("below the dim 8"), "{e}");
        let huge = SdpaStrides { batch: usize::MAX - 4, head: 8, row: 32 };
        let e = err(SdpaLayout { v: Some(huge), ..Default::default() });
        assert!(e.contains("v strides") && e.contains("overflows"), "{e}");
        // a dim with one index may have any stride
        let one = SdpaShape { batch: 1, ..s };
        let any = SdpaStrides { batch: 0, head: 40, row: 8 };
        assert!(
            layout_extents("t", &one, &SdpaLayout { q: Some(any), ..Default::default() }).is_ok()
        );
    }
}
