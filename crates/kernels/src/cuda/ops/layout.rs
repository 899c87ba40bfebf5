//! Data movement (`cuda/layout.cu`) over device buffers: copies, narrow,
//! cat, transpose and the general strided copy behind permute and expand;
//! [`crate::cuda::raw::layout`] documents the kernels. Elements are 2, 4 or
//! 8 bytes of any type.

use super::{count, pitched, reach, Check};
use crate::cuda::raw::layout as raw;
pub use crate::cuda::raw::layout::{broadcast_strides, MAX_RANK};
use crate::cuda::{DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::util::bad;
use crate::Result;

/// `dst[r*dst_ld + c] = src[r*src_ld + c]` for `r < rows`, `c < cols`.
pub fn copy2d(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    rows: usize,
    cols: usize,
    src: DeviceSlice<'_>,
    src_ld: usize,
    dst: DeviceSliceMut<'_>,
    dst_ld: usize,
) -> Result<()> {
    const OP: &str = "copy2d";
    let c = Check::new(OP, dev);
    let sp = c.read("src", &src, pitched(OP, rows, cols, src_ld)?, elem_bytes)?;
    let dp = c.write("dst", &dst, pitched(OP, rows, cols, dst_ld)?, elem_bytes)?;
    // SAFETY: `src` and `dst` hold every row the copy reads and writes
    // (checked above), live in `dev`'s memory; `dst` is an exclusive borrow,
    // so the regions do not overlap.
    unsafe { raw::copy2d(dev, elem_bytes, rows, cols, sp, src_ld, dp, dst_ld) }
}

/// Copies `n` contiguous elements.
pub fn copy(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    src: DeviceSlice<'_>,
    dst: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    copy2d(dev, elem_bytes, 1, n, src, n, dst, n)
}

/// Narrow along a dim: with `src` viewed as `[outer, size, inner]`,
/// `dst = src[:, start..start+len, :]` (contiguous `[outer, len, inner]`).
pub fn narrow(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    src: DeviceSlice<'_>,
    outer: usize,
    size: usize,
    inner: usize,
    start: usize,
    len: usize,
    dst: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "narrow";
    let c = Check::new(OP, dev);
    let sp = c.read("src", &src, count(OP, &[outer, size, inner])?, elem_bytes)?;
    let dp = c.write("dst", &dst, count(OP, &[outer, len, inner])?, elem_bytes)?;
    // SAFETY: as in `copy2d`; a range past `size` is rejected before the
    // launch, so the rows read lie inside `src`.
    unsafe { raw::narrow(dev, elem_bytes, sp, outer, size, inner, start, len, dp) }
}

/// Concatenates contiguous pieces `(view, len)` along a dim into `dst`,
/// `[outer, sum(len), inner]`.
pub fn cat(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    pieces: &[(DeviceSlice<'_>, usize)],
    outer: usize,
    inner: usize,
    dst: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "cat";
    let c = Check::new(OP, dev);
    let mut ptrs = Vec::with_capacity(pieces.len());
    let mut total = 0usize;
    for (v, len) in pieces {
        ptrs.push((c.read("piece", v, count(OP, &[outer, *len, inner])?, elem_bytes)?, *len));
        total = total.checked_add(*len).ok_or_else(|| bad(OP, "the piece lengths overflow"))?;
    }
    let dp = c.write("dst", &dst, count(OP, &[outer, total, inner])?, elem_bytes)?;
    // SAFETY: each piece holds its `[outer, len, inner]` elements and `dst`
    // the whole output (checked above), all live in `dev`'s memory; `dst` is
    // an exclusive borrow, so no piece overlaps it.
    unsafe { raw::cat(dev, elem_bytes, &ptrs, outer, inner, dp) }
}

/// Splits a dim: with `src` viewed as `[outer, sum(sizes), inner]`, output `i`
/// is the contiguous `[outer, sizes[i], inner]` slice, written to `dsts[i]`;
/// every output in one launch per [`raw::COPY_BATCH`] (a concatenation's
/// inverse, as `torch.split_with_sizes_copy`).
pub fn split(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    src: DeviceSlice<'_>,
    outer: usize,
    sizes: &[usize],
    inner: usize,
    dsts: &mut [DeviceSliceMut<'_>],
) -> Result<()> {
    const OP: &str = "split";
    if sizes.len() != dsts.len() {
        return Err(bad(OP, format!("{} sizes for {} outputs", sizes.len(), dsts.len())));
    }
    let total = sizes
        .iter()
        .try_fold(0usize, |acc, &n| acc.checked_add(n))
        .ok_or_else(|| bad(OP, "the sizes overflow"))?;
    let c = Check::new(OP, dev);
    let sp = c.read("src", &src, count(OP, &[outer, total, inner])?, elem_bytes)?;
    let mut blocks = Vec::with_capacity(sizes.len());
    let mut offset = 0usize;
    for (&n, dst) in sizes.iter().zip(dsts.iter()) {
        let dp = c.write("output", dst, count(OP, &[outer, n, inner])?, elem_bytes)?;
        blocks.push(raw::Block2d {
            src: sp.wrapping_add((offset * inner * elem_bytes) as u64),
            src_ld: total * inner,
            dst: dp,
            dst_ld: n * inner,
            rows: outer,
            cols: n * inner,
        });
        offset += n;
    }
    // SAFETY: each block reads rows inside `src` and writes its own output, each
    // checked above to hold what it reaches; the outputs are exclusive borrows
    // of `dsts`, so none overlaps `src` or another.
    unsafe { raw::copy2d_batch(dev, elem_bytes, &blocks) }
}

/// Transposes the last two dims: `x` `[batch, rows, cols]` to `y`
/// `[batch, cols, rows]`.
pub fn transpose(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    x: DeviceSlice<'_>,
    batch: usize,
    rows: usize,
    cols: usize,
    y: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "transpose";
    let c = Check::new(OP, dev);
    let n = count(OP, &[batch, rows, cols])?;
    let (xp, yp) = (c.read("x", &x, n, elem_bytes)?, c.write("y", &y, n, elem_bytes)?);
    // SAFETY: as in `copy2d`.
    unsafe { raw::transpose(dev, elem_bytes, xp, batch, rows, cols, yp) }
}

/// `dst[i] = src[base + sum(idx[d] * src_strides[d])]` for a contiguous
/// `dst` of `out_shape` (strides in elements, 0 broadcasts).
pub fn strided_copy(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    src: DeviceSlice<'_>,
    base: usize,
    src_strides: &[usize],
    out_shape: &[usize],
    dst: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "strided_copy";
    let c = Check::new(OP, dev);
    let sp = c.read("src", &src, reach(OP, base, out_shape, src_strides)?, elem_bytes)?;
    let dp = c.write("dst", &dst, count(OP, out_shape)?, elem_bytes)?;
    // SAFETY: `src` holds every element the strides reach from `base`, `dst`
    // the output (checked above); otherwise as in `copy2d`.
    unsafe { raw::strided_copy(dev, elem_bytes, sp, base, src_strides, out_shape, dp) }
}

/// Permutes dims: output dim `i` is input dim `perm[i]` of the contiguous
/// `src` of `shape`.
pub fn permute(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    src: DeviceSlice<'_>,
    shape: &[usize],
    perm: &[usize],
    dst: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "permute";
    let c = Check::new(OP, dev);
    let n = count(OP, shape)?;
    let (sp, dp) = (c.read("src", &src, n, elem_bytes)?, c.write("dst", &dst, n, elem_bytes)?);
    // SAFETY: as in `copy2d`; a permutation of a contiguous tensor reads
    // exactly its elements (anything but a permutation is rejected before
    // the launch).
    unsafe { raw::permute(dev, elem_bytes, sp, shape, perm, dp) }
}

/// Broadcasts the contiguous `src` of `src_shape` to `out_shape` (numpy
/// rules), copying.
pub fn expand(
    dev: &dyn GpuDevice,
    elem_bytes: usize,
    src: DeviceSlice<'_>,
    src_shape: &[usize],
    out_shape: &[usize],
    dst: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "expand";
    let strides = broadcast_strides(OP, src_shape, out_shape)?;
    let c = Check::new(OP, dev);
    let sp = c.read("src", &src, reach(OP, 0, out_shape, &strides)?, elem_bytes)?;
    let dp = c.write("dst", &dst, count(OP, out_shape)?, elem_bytes)?;
    // SAFETY: as in `strided_copy`, with the broadcast strides.
    unsafe { raw::strided_copy(dev, elem_bytes, sp, 0, &strides, out_shape, dp) }
}
