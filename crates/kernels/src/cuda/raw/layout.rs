//! Launch wrappers for `cuda/layout.cu`: the layout copies of contiguous
//! row-major tensors (plain copy, narrow, cat, transpose, permute, expand).
//!
//! The kernels move bits, so they take an element width in bytes (2 for
//! bf16/f16, 4 for f32, 8 for i64/f64) instead of a dtype. Sizes, strides and
//! offsets are in elements. [`strided_copy`] is the general entry point (the
//! GPU counterpart of [`crate::elementwise::strided_copy`]): it merges
//! dimensions and sends each case to the fastest kernel (a pitched 2-D copy,
//! a tiled transpose, or the general strided gather).

use bytemuck::{Pod, Zeroable};

use super::{bad, check_aligned, check_ptrs, numel};
use crate::cuda::{launch, DevPtr, LaunchConfig, Launcher};
use crate::Result;

/// Most dims a strided copy or broadcast binary op takes after merging.
pub const MAX_RANK: usize = 6;

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;
/// Grid cap of the grid-stride kernels (a few waves of 256-thread blocks on
/// an H200's 132 SMs); larger problems loop inside the kernel.
const MAX_BLOCKS: u32 = 2048;

/// Arguments of `tpar_copy2d_w{1,2,4,8,16}`: `dst[r*dst_ld + c] = src[r*src_ld + c]`
/// for `r < rows`, `c < cols`, all in units of the kernel's width.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Copy2dArgs {
    /// Source address.
    pub src: DevPtr,
    /// Destination address.
    pub dst: DevPtr,
    /// Rows to copy.
    pub rows: i64,
    /// Units per row.
    pub cols: i64,
    /// Source row pitch in units.
    pub src_ld: i64,
    /// Destination row pitch in units.
    pub dst_ld: i64,
}

/// Arguments of `tpar_transpose_w{2,4,8}`: `y[b, c, r] = x[b, r, c]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TransposeArgs {
    /// Input `[batch, rows, cols]`.
    pub x: DevPtr,
    /// Output `[batch, cols, rows]`.
    pub y: DevPtr,
    /// Number of matrices.
    pub batch: i64,
    /// Rows of each input matrix.
    pub rows: i64,
    /// Columns of each input matrix.
    pub cols: i64,
}

/// Arguments of `tpar_strided_copy_w{2,4,8}`: contiguous `dst` of `shape`,
/// `dst[i] = src[base + sum(idx[d] * stride[d])]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct StridedCopyArgs {
    /// Source address (element 0; `base` is added in elements).
    pub src: DevPtr,
    /// Destination address.
    pub dst: DevPtr,
    /// Offset of the first element read, in elements.
    pub base: i64,
    /// Elements written.
    pub n: i64,
    /// Output shape (first `rank` entries).
    pub shape: [i64; MAX_RANK],
    /// Source stride per output dim, in elements (0 broadcasts).
    pub stride: [i64; MAX_RANK],
    /// Number of dims used.
    pub rank: i32,
    /// 1: the kernel may move 16-byte vectors (see layout.cu).
    pub vec: i32,
    /// 1: every index fits in 32 bits.
    pub idx32: i32,
    /// Padding (0).
    pub pad: i32,
}

/// Grid of `threads`-thread blocks for `items` grid-stride work items.
pub(crate) fn grid_for(items: usize, threads: u32) -> LaunchConfig {
    LaunchConfig::for_items(items, threads, MAX_BLOCKS)
}

/// Largest offset `base + sum((shape[d] - 1) * stride[d])` reached, if it
/// fits in `usize`.
pub(crate) fn max_offset(base: usize, shape: &[usize], strides: &[usize]) -> Option<usize> {
    shape.iter().zip(strides).try_fold(base, |acc, (&n, &s)| {
        n.checked_sub(1).map_or(Some(acc), |m| m.checked_mul(s).and_then(|v| acc.checked_add(v)))
    })
}

/// Merges the dims of a contiguous output of `shape` read through each of
/// `strides`: drops size-1 dims and joins neighbours that every stride set
/// walks contiguously. Returns the merged shape and the merged stride sets;
/// a scalar comes back as shape `[1]` with stride 1.
pub(crate) fn collapse(shape: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut out_shape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::with_capacity(shape.len()); strides.len()];
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        let mergeable = out_shape.last().is_some()
            && strides
                .iter()
                .zip(&out_strides)
                .all(|(s, o)| o.last().copied() == s[d].checked_mul(shape[d]));
        if mergeable {
            let last = out_shape.len() - 1;
            out_shape[last] *= shape[d];
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                o[last] = s[d];
            }
        } else {
            out_shape.push(shape[d]);
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                o.push(s[d]);
            }
        }
    }
    if out_shape.is_empty() {
        out_shape.push(1);
        out_strides.iter_mut().for_each(|o| o.push(1));
    }
    (out_shape, out_strides)
}

/// Contiguous row-major strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc = acc.saturating_mul(shape[d]);
    }
    strides
}

fn width_suffix(op: &'static str, elem_bytes: usize) -> Result<&'static str> {
    match elem_bytes {
        2 => Ok("w2"),
        4 => Ok("w4"),
        8 => Ok("w8"),
        _ => Err(bad(op, format!("element width {elem_bytes} bytes (2, 4 or 8 supported)"))),
    }
}

fn byte_len(op: &'static str, what: &str, elems: usize, elem_bytes: usize) -> Result<usize> {
    elems
        .checked_mul(elem_bytes)
        .filter(|&b| b <= i64::MAX as usize)
        .ok_or_else(|| bad(op, format!("{what} = {elems} elements overflows")))
}

/// Most blocks one `tpar_copy2d_batch_w*` launch copies.
pub const COPY_BATCH: usize = 32;

/// Arguments of `tpar_copy2d_batch_w{1,2,4,8,16}`: the first `n` blocks, each
/// as [`Copy2dArgs`], one grid row (`blockIdx.y`) per block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Copy2dBatchArgs {
    /// The blocks (units of the kernel's width).
    pub blocks: [Copy2dArgs; COPY_BATCH],
    /// How many of `blocks` are used.
    pub n: i64,
}

/// One block of a 2-D copy, in elements: `dst[r*dst_ld + c] = src[r*src_ld + c]`
/// for `r < rows`, `c < cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block2d {
    /// Source address.
    pub src: DevPtr,
    /// Source row pitch.
    pub src_ld: usize,
    /// Destination address.
    pub dst: DevPtr,
    /// Destination row pitch.
    pub dst_ld: usize,
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
}

/// A checked non-empty block in bytes: `[src, dst, rows, cols, src_ld, dst_ld]`.
type ByteBlock = [u64; 6];

/// Checks `b` (addresses, alignment, pitches, sizes) and returns it in bytes,
/// `None` when it copies nothing.
fn byte_block(op: &'static str, elem_bytes: usize, b: &Block2d) -> Result<Option<ByteBlock>> {
    if b.rows == 0 || b.cols == 0 {
        return Ok(None);
    }
    check_ptrs(op, &[("src", b.src), ("dst", b.dst)])?;
    check_aligned(op, elem_bytes, &[("src", b.src), ("dst", b.dst)])?;
    // A single row has no pitch: use the row length so it does not limit the unit.
    let (src_ld, dst_ld) = if b.rows == 1 { (b.cols, b.cols) } else { (b.src_ld, b.dst_ld) };
    if dst_ld < b.cols {
        return Err(bad(
            op,
            format!("destination pitch {dst_ld} is below the row length {}", b.cols),
        ));
    }
    let cb = byte_len(op, "cols", b.cols, elem_bytes)?;
    let sb = byte_len(op, "src_ld", src_ld, elem_bytes)?;
    let db = byte_len(op, "dst_ld", dst_ld, elem_bytes)?;
    numel(op, &[b.rows, db.max(sb)])?;
    Ok(Some([b.src, b.dst, b.rows as u64, cb as u64, sb as u64, db as u64]))
}

/// The widest unit (16, 8, 4, 2 or 1 bytes) dividing every address, row
/// length and pitch of `blocks`.
fn unit_of(blocks: &[ByteBlock]) -> u64 {
    let all = blocks.iter().fold(0u64, |a, b| a | b[0] | b[1] | b[3] | b[4] | b[5]);
    [16u64, 8, 4, 2, 1].into_iter().find(|u| all.is_multiple_of(*u)).unwrap_or(1)
}

/// A byte block as the kernel's arguments in units of `u` bytes.
fn in_units(b: &ByteBlock, u: u64) -> Copy2dArgs {
    let [src, dst, rows, cb, sb, db] = *b;
    let units = |v: u64| (v / u) as i64;
    Copy2dArgs {
        src,
        dst,
        rows: rows as i64,
        cols: units(cb),
        src_ld: units(sb),
        dst_ld: units(db),
    }
}

/// `dst[r*dst_ld + c] = src[r*src_ld + c]` for `r < rows`, `c < cols`
/// (elements of `elem_bytes` bytes). Moves the widest unit (up to 16 bytes)
/// that divides both addresses, the row length and both pitches.
///
/// # Safety
/// `src` and `dst` must be device addresses valid for the rows read and
/// written; the regions must not overlap.
pub unsafe fn copy2d(
    l: &dyn Launcher,
    elem_bytes: usize,
    rows: usize,
    cols: usize,
    src: DevPtr,
    src_ld: usize,
    dst: DevPtr,
    dst_ld: usize,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { copy2d_batch(l, elem_bytes, &[Block2d { src, src_ld, dst, dst_ld, rows, cols }]) }
}

/// Every block of `blocks` (see [`Block2d`]), [`COPY_BATCH`] blocks per
/// launch (a lone block launches `tpar_copy2d_w*`): what the per-parameter
/// copies of a concatenation or a split cost in one launch instead of many.
/// Each launch moves the widest unit dividing all its blocks' addresses,
/// row lengths and pitches.
///
/// # Safety
/// Each block's `src` and `dst` must be device addresses valid for the rows
/// read and written; no destination may overlap a source. Where destinations
/// overlap each other, which block's value lands is unspecified.
pub unsafe fn copy2d_batch(l: &dyn Launcher, elem_bytes: usize, blocks: &[Block2d]) -> Result<()> {
    const OP: &str = "copy2d";
    width_suffix(OP, elem_bytes)?;
    let mut checked = Vec::with_capacity(blocks.len());
    for b in blocks {
        if let Some(c) = byte_block(OP, elem_bytes, b)? {
            checked.push(c);
        }
    }
    for group in checked.chunks(COPY_BATCH) {
        let u = unit_of(group);
        let items = group.iter().map(|b| (b[2] * b[3] / u) as usize).max().unwrap_or(0);
        let mut cfg = grid_for(items, THREADS);
        if let [one] = group {
            // SAFETY: the caller guarantees the addresses; sizes are checked above.
            unsafe { launch(l, &format!("tpar_copy2d_w{u}"), cfg, &in_units(one, u))? };
            continue;
        }
        let mut args = Copy2dBatchArgs { blocks: [Copy2dArgs::zeroed(); COPY_BATCH], n: 0 };
        for (slot, b) in args.blocks.iter_mut().zip(group) {
            *slot = in_units(b, u);
        }
        args.n = group.len() as i64;
        cfg.grid[1] = group.len() as u32;
        // SAFETY: as above, for every block.
        unsafe { launch(l, &format!("tpar_copy2d_batch_w{u}"), cfg, &args)? };
    }
    Ok(())
}

/// Copies `n` contiguous elements of `elem_bytes` bytes.
///
/// # Safety
/// `src` and `dst` must be valid for `n` elements and must not overlap.
pub unsafe fn copy(
    l: &dyn Launcher,
    elem_bytes: usize,
    src: DevPtr,
    dst: DevPtr,
    n: usize,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { copy2d(l, elem_bytes, 1, n, src, n, dst, n) }
}

/// Narrow (slice) along a dim: with the source viewed as `[outer, size, inner]`,
/// `dst = src[:, start..start+len, :]`, contiguous `[outer, len, inner]`.
///
/// # Safety
/// `src` must be valid for `outer*size*inner` elements, `dst` for
/// `outer*len*inner`, without overlap.
pub unsafe fn narrow(
    l: &dyn Launcher,
    elem_bytes: usize,
    src: DevPtr,
    outer: usize,
    size: usize,
    inner: usize,
    start: usize,
    len: usize,
    dst: DevPtr,
) -> Result<()> {
    const OP: &str = "narrow";
    if start.checked_add(len).is_none_or(|e| e > size) {
        return Err(bad(OP, format!("range {start}..{start}+{len} outside a dim of size {size}")));
    }
    numel(OP, &[outer, size, inner, elem_bytes])?;
    if outer == 0 || len == 0 || inner == 0 {
        return Ok(());
    }
    check_ptrs(OP, &[("src", src)])?;
    let off = (start * inner * elem_bytes) as u64;
    // SAFETY: the rows read lie inside the source the caller vouches for.
    unsafe {
        copy2d(
            l,
            elem_bytes,
            outer,
            len * inner,
            src.wrapping_add(off),
            size * inner,
            dst,
            len * inner,
        )
    }
}

/// One piece of a cat: with the destination viewed as `[outer, total, inner]`,
/// `dst[:, offset..offset+len, :] = src` (contiguous `[outer, len, inner]`).
///
/// # Safety
/// `src` must be valid for `outer*len*inner` elements, `dst` for
/// `outer*total*inner`, without overlap.
pub unsafe fn cat_into(
    l: &dyn Launcher,
    elem_bytes: usize,
    src: DevPtr,
    outer: usize,
    len: usize,
    inner: usize,
    dst: DevPtr,
    total: usize,
    offset: usize,
) -> Result<()> {
    const OP: &str = "cat";
    if offset.checked_add(len).is_none_or(|e| e > total) {
        return Err(bad(
            OP,
            format!("range {offset}..{offset}+{len} outside a dim of size {total}"),
        ));
    }
    numel(OP, &[outer, total, inner, elem_bytes])?;
    if outer == 0 || len == 0 || inner == 0 {
        return Ok(());
    }
    check_ptrs(OP, &[("dst", dst)])?;
    let off = (offset * inner * elem_bytes) as u64;
    // SAFETY: the rows written lie inside the destination the caller vouches for.
    unsafe {
        copy2d(
            l,
            elem_bytes,
            outer,
            len * inner,
            src,
            len * inner,
            dst.wrapping_add(off),
            total * inner,
        )
    }
}

/// Concatenates contiguous pieces `(address, len)` along a dim: the output
/// is `[outer, sum(len), inner]`.
///
/// # Safety
/// Each piece must be valid for `outer*len*inner` elements and `dst` for the
/// whole output, without overlap.
pub unsafe fn cat(
    l: &dyn Launcher,
    elem_bytes: usize,
    pieces: &[(DevPtr, usize)],
    outer: usize,
    inner: usize,
    dst: DevPtr,
) -> Result<()> {
    const OP: &str = "cat";
    let total = pieces
        .iter()
        .try_fold(0usize, |acc, &(_, len)| acc.checked_add(len))
        .ok_or_else(|| bad(OP, "the piece lengths overflow"))?;
    numel(OP, &[outer, total, inner, elem_bytes])?;
    let mut blocks = Vec::with_capacity(pieces.len());
    let mut offset = 0;
    for &(src, len) in pieces {
        if outer > 0 && len > 0 && inner > 0 {
            check_ptrs(OP, &[("dst", dst)])?;
            blocks.push(Block2d {
                src,
                src_ld: len * inner,
                dst: dst.wrapping_add((offset * inner * elem_bytes) as u64),
                dst_ld: total * inner,
                rows: outer,
                cols: len * inner,
            });
        }
        offset += len;
    }
    // SAFETY: each block writes rows inside the destination the caller vouches for.
    unsafe { copy2d_batch(l, elem_bytes, &blocks) }
}

/// Transposes the last two dims: `x` `[batch, rows, cols]` to `y`
/// `[batch, cols, rows]`, tiled through shared memory.
///
/// # Safety
/// `x` and `y` must be valid for `batch*rows*cols` elements and must not overlap.
pub unsafe fn transpose(
    l: &dyn Launcher,
    elem_bytes: usize,
    x: DevPtr,
    batch: usize,
    rows: usize,
    cols: usize,
    y: DevPtr,
) -> Result<()> {
    const OP: &str = "transpose";
    let w = width_suffix(OP, elem_bytes)?;
    numel(OP, &[batch, rows, cols, elem_bytes])?;
    if batch == 0 || rows == 0 || cols == 0 {
        return Ok(());
    }
    check_ptrs(OP, &[("x", x), ("y", y)])?;
    check_aligned(OP, elem_bytes, &[("x", x), ("y", y)])?;
    let tiles = batch.saturating_mul(rows.div_ceil(32)).saturating_mul(cols.div_ceil(32));
    let args = TransposeArgs { x, y, batch: batch as i64, rows: rows as i64, cols: cols as i64 };
    let cfg = LaunchConfig::linear(tiles.min(MAX_BLOCKS as usize) as u32, 256);
    // SAFETY: the caller guarantees the addresses; sizes are checked above.
    unsafe { launch(l, &format!("tpar_transpose_{w}"), cfg, &args) }
}

/// `dst[i] = src[base + sum(idx[d] * src_strides[d])]` for a contiguous `dst`
/// of `out_shape` (strides in elements, 0 broadcasts): permute, expand and
/// narrow in one. Merges dims first, then runs a contiguous or pitched copy,
/// a tiled transpose, or the general gather (at most [`MAX_RANK`] merged dims).
///
/// # Safety
/// `src` must be valid for every element the strides reach from `base`,
/// `dst` for `out_shape`'s elements, without overlap.
pub unsafe fn strided_copy(
    l: &dyn Launcher,
    elem_bytes: usize,
    src: DevPtr,
    base: usize,
    src_strides: &[usize],
    out_shape: &[usize],
    dst: DevPtr,
) -> Result<()> {
    const OP: &str = "strided_copy";
    let w = width_suffix(OP, elem_bytes)?;
    if src_strides.len() != out_shape.len() {
        return Err(bad(
            OP,
            format!("{} strides for an output of rank {}", src_strides.len(), out_shape.len()),
        ));
    }
    let n = numel(OP, out_shape)?;
    if n == 0 {
        return Ok(());
    }
    let reach = max_offset(base, out_shape, src_strides)
        .filter(|&m| m.checked_mul(elem_bytes).is_some_and(|b| b <= i64::MAX as usize))
        .ok_or_else(|| bad(OP, format!("strides {src_strides:?} over {out_shape:?} overflow")))?;
    check_ptrs(OP, &[("src", src), ("dst", dst)])?;
    check_aligned(OP, elem_bytes, &[("src", src), ("dst", dst)])?;
    let (shape, strides) = collapse(out_shape, &[src_strides]);
    let st = &strides[0];
    let at = |off: usize| src.wrapping_add((off * elem_bytes) as u64);
    // Every arm below runs the merged problem, which reads and writes exactly
    // the elements of the original one.
    match (shape.len(), st.as_slice()) {
        // contiguous
        (1, [1]) => {
            // SAFETY: the caller vouches for the `n` elements from `base` and for `dst`.
            return unsafe { copy(l, elem_bytes, at(base), dst, n) };
        }
        // contiguous rows at a pitch (narrow; pitch 0 repeats one row)
        (2, [ld, 1]) => {
            let (rows, cols) = (shape[0], shape[1]);
            // SAFETY: the rows read are those the caller's strides reach.
            return unsafe { copy2d(l, elem_bytes, rows, cols, at(base), *ld, dst, cols) };
        }
        // the last two dims of a contiguous source swapped
        (2, [1, r]) if *r == shape[0] => {
            // SAFETY: the source is the contiguous matrix the strides walk.
            return unsafe { transpose(l, elem_bytes, at(base), 1, shape[1], shape[0], dst) };
        }
        (3, [b, 1, r]) if *r == shape[1] && *b == shape[1] * shape[2] => {
            let (batch, rows, cols) = (shape[0], shape[2], shape[1]);
            // SAFETY: the source is the contiguous batch of matrices the strides walk.
            return unsafe { transpose(l, elem_bytes, at(base), batch, rows, cols, dst) };
        }
        _ => {}
    }
    let rank = shape.len();
    if rank > MAX_RANK {
        return Err(bad(
            OP,
            format!("{rank} dims after merging {out_shape:?} (at most {MAX_RANK})"),
        ));
    }
    let per = 16 / elem_bytes;
    let vec = st[rank - 1] == 1
        && shape[rank - 1] % per == 0
        && st[..rank - 1].iter().all(|s| s % per == 0)
        && base.is_multiple_of(per)
        && src.is_multiple_of(16)
        && dst.is_multiple_of(16);
    let mut args = StridedCopyArgs {
        src,
        dst,
        base: base as i64,
        n: n as i64,
        shape: [1; MAX_RANK],
        stride: [0; MAX_RANK],
        rank: rank as i32,
        vec: vec as i32,
        idx32: (n <= i32::MAX as usize && reach <= i32::MAX as usize) as i32,
        pad: 0,
    };
    for d in 0..rank {
        args.shape[d] = shape[d] as i64;
        args.stride[d] = st[d] as i64;
    }
    let items = if vec { n / per } else { n };
    // SAFETY: the caller guarantees the addresses; sizes are checked above.
    unsafe { launch(l, &format!("tpar_strided_copy_{w}"), grid_for(items, THREADS), &args) }
}

/// Permutes dims: output dim `i` is input dim `perm[i]` of the contiguous
/// input of `shape`.
///
/// # Safety
/// `src` and `dst` must be valid for the tensor's elements, without overlap.
pub unsafe fn permute(
    l: &dyn Launcher,
    elem_bytes: usize,
    src: DevPtr,
    shape: &[usize],
    perm: &[usize],
    dst: DevPtr,
) -> Result<()> {
    let r = shape.len();
    let mut seen = vec![false; r];
    if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true)) {
        return Err(bad("permute", format!("{perm:?} is not a permutation of {r} dims")));
    }
    numel("permute", shape)?;
    let st = contiguous_strides(shape);
    let strides: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    let out: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    // SAFETY: forwarded to the caller; the strides stay inside the input.
    unsafe { strided_copy(l, elem_bytes, src, 0, &strides, &out, dst) }
}

/// Broadcasts the contiguous `src` of `src_shape` to `out_shape` (numpy
/// rules: dims aligned at the end, size-1 dims repeat), copying.
///
/// # Safety
/// `src` must be valid for `src_shape`'s elements, `dst` for `out_shape`'s,
/// without overlap.
pub unsafe fn expand(
    l: &dyn Launcher,
    elem_bytes: usize,
    src: DevPtr,
    src_shape: &[usize],
    out_shape: &[usize],
    dst: DevPtr,
) -> Result<()> {
    let strides = broadcast_strides("expand", src_shape, out_shape)?;
    // SAFETY: forwarded to the caller; broadcast strides stay inside the input.
    unsafe { strided_copy(l, elem_bytes, src, 0, &strides, out_shape, dst) }
}

/// Strides that read a contiguous tensor of `shape` broadcast to `out`
/// (0 on broadcast dims), or an error when it does not broadcast.
pub fn broadcast_strides(op: &'static str, shape: &[usize], out: &[usize]) -> Result<Vec<usize>> {
    if shape.len() > out.len() {
        return Err(bad(op, format!("{shape:?} has more dims than {out:?}")));
    }
    let st = contiguous_strides(shape);
    let off = out.len() - shape.len();
    (0..out.len())
        .map(|d| {
            if d < off {
                return Ok(0);
            }
            let s = shape[d - off];
            if s == out[d] {
                Ok(if s == 1 { 0 } else { st[d - off] })
            } else if s == 1 {
                Ok(0)
            } else {
                Err(bad(op, format!("{shape:?} does not broadcast to {out:?}")))
            }
        })
        .collect()
}
