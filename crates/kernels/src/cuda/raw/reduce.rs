//! Reductions (`cuda/reduce.cu`): sum, max, min over the middle dim of a
//! tensor viewed as `[outer, len, inner]` (as [`crate::reduce::reduce`]),
//! max with the index of the first max (as [`crate::reduce::max_with_index`])
//! and per-row sums of squares (gradient-norm clipping).
//!
//! Results are deterministic: every kernel combines in a fixed order for a
//! given launch shape, and the launch shape depends only on the sizes and the
//! workspace given. Long reductions run in two passes: the reduced dim is split
//! into chunks whose f32 partials go to a caller-provided workspace
//! ([`reduce_workspace_len`]), then one more kernel folds them.

use bytemuck::{Pod, Zeroable};

use super::{bad, check_ptr, to_i32};
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::reduce::Reduction;
use crate::Result;

/// Arguments of `tpar_reduce_{last,mid,final}_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ReduceArgs {
    /// Input `[outer, len, inner]` (f32 partials for the final pass).
    pub x: DevPtr,
    /// Output `[outer, inner]` in the kernel's dtype (f32 for sums of squares).
    pub out: DevPtr,
    /// f32 partials `[outer, chunks, inner]`, written when `chunks > 1`.
    pub partial: DevPtr,
    /// Outer extent.
    pub outer: i32,
    /// Reduced extent.
    pub len: i32,
    /// Inner extent.
    pub inner: i32,
    /// Pieces the reduced dim is split into (1: write `out` directly).
    pub chunks: i32,
    /// Reduced rows per piece.
    pub chunk_len: i32,
    /// 0 sum, 1 max, 2 min, 3 sum of squares.
    pub op: i32,
}

/// Arguments of `tpar_reduce_argmax_{last,mid}_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ReduceArgmaxArgs {
    /// Input `[outer, len, inner]`.
    pub x: DevPtr,
    /// Max values `[outer, inner]`.
    pub out: DevPtr,
    /// i64 index of the first max `[outer, inner]` (of the first NaN if any).
    pub index: DevPtr,
    /// Outer extent.
    pub outer: i32,
    /// Reduced extent (at least 1).
    pub len: i32,
    /// Inner extent.
    pub inner: i32,
    /// Padding.
    pub pad: i32,
}

/// Threads per block of every reduction kernel.
const BLOCK: u32 = 256;
/// Columns one block of the middle-dim kernels covers.
const COLS: usize = 32;
/// Work items worth splitting for: enough blocks to fill an H200 (132 SMs) a few times.
const TARGET_BLOCKS: usize = 1024;
/// Fewest elements per chunk of a contiguous (`inner == 1`) reduction.
const MIN_LAST_CHUNK: usize = 16384;
/// Fewest reduced rows per chunk of a middle-dim reduction.
const MIN_MID_CHUNK: usize = 64;
/// Most blocks launched; kernels stride over the remaining work items.
const MAX_BLOCKS: usize = 1 << 16;

const OP_SUMSQ: i32 = 3;

fn op_code(op: Reduction) -> i32 {
    match op {
        Reduction::Sum => 0,
        Reduction::Max => 1,
        Reduction::Min => 2,
    }
}

/// The number of elements of `[outer, len, inner]`, checked against the i32
/// limits of the kernels' extents.
fn check_dims(op: &'static str, outer: usize, len: usize, inner: usize) -> Result<usize> {
    to_i32(op, "outer", outer)?;
    to_i32(op, "len", len)?;
    to_i32(op, "inner", inner)?;
    outer
        .checked_mul(len)
        .and_then(|v| v.checked_mul(inner))
        .filter(|&v| v <= isize::MAX as usize)
        .ok_or_else(|| bad(op, format!("[{outer}, {len}, {inner}] overflows")))
}

/// Pieces the reduced dim of `[outer, len, inner]` is split into by default.
pub fn reduce_chunks(outer: usize, len: usize, inner: usize) -> usize {
    if outer == 0 || inner == 0 || len == 0 {
        return 1;
    }
    let (items, min_chunk) = if inner == 1 {
        (outer, MIN_LAST_CHUNK)
    } else {
        (outer.saturating_mul(inner.div_ceil(COLS)), MIN_MID_CHUNK)
    };
    let want = TARGET_BLOCKS.div_ceil(items);
    want.min(len.div_ceil(min_chunk)).max(1)
}

/// f32 elements of workspace [`reduce`] uses for `[outer, len, inner]` (0 when
/// one pass is enough). Also enough for [`sum_squares`] with `inner = 1`.
pub fn reduce_workspace_len(outer: usize, len: usize, inner: usize) -> usize {
    let chunks = reduce_chunks(outer, len, inner);
    if chunks > 1 {
        outer.saturating_mul(chunks).saturating_mul(inner)
    } else {
        0
    }
}

/// `(chunks, chunk_len)` with no empty chunk.
fn split(len: usize, chunks: usize) -> (usize, usize) {
    let chunks = chunks.clamp(1, len.max(1));
    let chunk_len = len.div_ceil(chunks).max(1);
    (len.div_ceil(chunk_len).max(1), chunk_len)
}

/// One or two passes of reduction code `code` over `[outer, len, inner]`.
///
/// # Safety
/// As [`reduce`]: `x` holds `outer * len * inner` elements of `dtype`, `out`
/// `outer * inner` of `out_elem` bytes, `workspace` `workspace_len` f32 values.
unsafe fn run(
    launcher: &dyn Launcher,
    op: &'static str,
    code: i32,
    dtype: CudaDType,
    x: DevPtr,
    out: DevPtr,
    out_elem: usize,
    outer: usize,
    len: usize,
    inner: usize,
    chunks: usize,
    workspace: DevPtr,
    workspace_len: usize,
) -> Result<()> {
    let numel = check_dims(op, outer, len, inner)?;
    check_ptr(op, "x", x, numel, dtype.size())?;
    check_ptr(op, "out", out, outer * inner, out_elem)?;
    if outer == 0 || inner == 0 {
        return Ok(());
    }
    let (chunks, chunk_len) = split(len, chunks);
    let partials = if chunks > 1 { outer * chunks * inner } else { 0 };
    if partials > 0 {
        if workspace_len < partials {
            return Err(bad(
                op,
                format!("workspace has {workspace_len} f32 elements, {partials} needed"),
            ));
        }
        check_ptr(op, "workspace", workspace, partials, 4)?;
    }
    let kind = if inner == 1 { "last" } else { "mid" };
    let items = if inner == 1 { outer * chunks } else { outer * inner.div_ceil(COLS) * chunks };
    let blocks = items.clamp(1, MAX_BLOCKS) as u32;
    let args = ReduceArgs {
        x,
        out,
        partial: workspace,
        outer: outer as i32,
        len: len as i32,
        inner: inner as i32,
        chunks: chunks as i32,
        chunk_len: to_i32(op, "chunk length", chunk_len)?,
        op: code,
    };
    let name = format!("tpar_reduce_{kind}_{}", dtype.suffix());
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, &name, LaunchConfig::linear(blocks, BLOCK), &args)? };
    if chunks == 1 {
        return Ok(());
    }
    // Fold the partials [outer, chunks, inner] (already squared for sums of squares).
    let (final_dtype, final_code) =
        if code == OP_SUMSQ { (CudaDType::F32, 0) } else { (dtype, code) };
    let items = if inner == 1 { outer } else { outer * inner.div_ceil(COLS) };
    let args = ReduceArgs {
        x: workspace,
        out,
        partial: 0,
        outer: outer as i32,
        len: chunks as i32,
        inner: inner as i32,
        chunks: 1,
        chunk_len: chunks as i32,
        op: final_code,
    };
    let name = format!("tpar_reduce_final_{}", final_dtype.suffix());
    let blocks = items.clamp(1, MAX_BLOCKS) as u32;
    // SAFETY: the workspace holds the partials the first pass wrote.
    unsafe { launch(launcher, &name, LaunchConfig::linear(blocks, BLOCK), &args) }
}

/// Reduces `x` (`dtype`) viewed as `[outer, len, inner]` over the middle dim
/// into `out` `[outer, inner]` (`dtype`), like [`crate::reduce::reduce`]:
/// f32 accumulation; an empty dim gives 0 / -inf / +inf; max and min
/// propagate NaN.
///
/// `workspace` is an f32 buffer of `workspace_len` elements for the partials
/// of a two-pass reduction; [`reduce_workspace_len`] gives the size for the
/// default split. With less (or none: `0, 0`) the dim is split into fewer
/// chunks (one pass), which is slower for long dims but equally correct.
///
/// # Safety
/// `x`, `out` and `workspace` must be device buffers of the stated sizes;
/// `out` and `workspace` must not overlap `x` or each other.
pub unsafe fn reduce(
    launcher: &dyn Launcher,
    op: Reduction,
    dtype: CudaDType,
    x: DevPtr,
    out: DevPtr,
    outer: usize,
    len: usize,
    inner: usize,
    workspace: DevPtr,
    workspace_len: usize,
) -> Result<()> {
    let per_chunk = outer.saturating_mul(inner).max(1);
    let chunks = reduce_chunks(outer, len, inner).min(workspace_len / per_chunk).max(1);
    // SAFETY: forwarded contract.
    unsafe {
        reduce_chunked(
            launcher,
            op,
            dtype,
            x,
            out,
            outer,
            len,
            inner,
            chunks,
            workspace,
            workspace_len,
        )
    }
}

/// [`reduce`] with the reduced dim split into `chunks` pieces (at most `len`;
/// 1 is a single pass). With more than one piece `workspace` must hold
/// `outer * chunks * inner` f32 elements (pieces are `ceil(len / chunks)`
/// long, so slightly fewer may be used).
///
/// # Safety
/// As [`reduce`].
pub unsafe fn reduce_chunked(
    launcher: &dyn Launcher,
    op: Reduction,
    dtype: CudaDType,
    x: DevPtr,
    out: DevPtr,
    outer: usize,
    len: usize,
    inner: usize,
    chunks: usize,
    workspace: DevPtr,
    workspace_len: usize,
) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe {
        run(
            launcher,
            "cuda_reduce",
            op_code(op),
            dtype,
            x,
            out,
            dtype.size(),
            outer,
            len,
            inner,
            chunks,
            workspace,
            workspace_len,
        )
    }
}

/// `out[r] = sum of x[r, i]^2` (f32 out) for `x` (`dtype`) viewed as
/// `[rows, len]`: the squared L2 norm of each row, accumulated in f32. With
/// `rows = 1` it is the squared norm of a whole flat buffer (e.g. a gradient
/// for `clip_grad_norm`). Workspace as [`reduce`] with `inner = 1`
/// ([`reduce_workspace_len`]`(rows, len, 1)`).
///
/// # Safety
/// As [`reduce`]; `out` holds `rows` f32 values.
pub unsafe fn sum_squares(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    x: DevPtr,
    rows: usize,
    len: usize,
    out: DevPtr,
    workspace: DevPtr,
    workspace_len: usize,
) -> Result<()> {
    let chunks = reduce_chunks(rows, len, 1).min(workspace_len / rows.max(1)).max(1);
    // SAFETY: forwarded contract.
    unsafe {
        sum_squares_chunked(launcher, dtype, x, rows, len, out, chunks, workspace, workspace_len)
    }
}

/// [`sum_squares`] split into `chunks` pieces per row (see [`reduce_chunked`]).
///
/// # Safety
/// As [`reduce`]; `out` holds `rows` f32 values.
pub unsafe fn sum_squares_chunked(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    x: DevPtr,
    rows: usize,
    len: usize,
    out: DevPtr,
    chunks: usize,
    workspace: DevPtr,
    workspace_len: usize,
) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe {
        run(
            launcher,
            "cuda_sum_squares",
            OP_SUMSQ,
            dtype,
            x,
            out,
            4,
            rows,
            len,
            1,
            chunks,
            workspace,
            workspace_len,
        )
    }
}

/// Max over the middle dim of `[outer, len, inner]` with the i64 index of
/// the first maximum (of the first NaN when there is one), like
/// [`crate::reduce::max_with_index`]. One pass: one block per row when
/// `inner == 1`, per 32 columns otherwise. An empty dim is an error.
///
/// # Safety
/// `x` (`[outer, len, inner]`), `out` (`[outer, inner]`, `dtype`) and `index`
/// (`[outer, inner]`, i64) must be device buffers of those sizes.
pub unsafe fn max_with_index(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    x: DevPtr,
    out: DevPtr,
    index: DevPtr,
    outer: usize,
    len: usize,
    inner: usize,
) -> Result<()> {
    const OP: &str = "cuda_max_with_index";
    let numel = check_dims(OP, outer, len, inner)?;
    if len == 0 {
        return Err(bad(OP, "the reduced dim is empty: there is no index to return"));
    }
    check_ptr(OP, "x", x, numel, dtype.size())?;
    check_ptr(OP, "out", out, outer * inner, dtype.size())?;
    check_ptr(OP, "index", index, outer * inner, 8)?;
    if outer == 0 || inner == 0 {
        return Ok(());
    }
    let (kind, items) =
        if inner == 1 { ("last", outer) } else { ("mid", outer * inner.div_ceil(COLS)) };
    let args = ReduceArgmaxArgs {
        x,
        out,
        index,
        outer: outer as i32,
        len: len as i32,
        inner: inner as i32,
        pad: 0,
    };
    let name = format!("tpar_reduce_argmax_{kind}_{}", dtype.suffix());
    let cfg = LaunchConfig::linear(items.clamp(1, MAX_BLOCKS) as u32, BLOCK);
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, &name, cfg, &args) }
}
