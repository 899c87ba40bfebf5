//! Reductions over one dim (`cuda/reduce.cu`) over device buffers: sum, max,
//! min, sums of squares and max with its index; [`crate::cuda::raw::reduce`]
//! documents the kernels and the workspace.

use super::{count, Check};
use crate::cuda::raw::reduce as raw;
pub use crate::cuda::raw::reduce::{reduce_chunks, reduce_workspace_len};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::reduce::Reduction;
use crate::Result;

/// The workspace's address and length in f32 elements (`0, 0` for none).
fn workspace_ptr(c: &Check<'_>, w: Option<&DeviceSliceMut<'_>>) -> Result<(u64, usize)> {
    match w {
        Some(w) => Ok((c.write("workspace", w, w.len() / 4, 4)?, w.len() / 4)),
        None => Ok((0, 0)),
    }
}

/// Reduces `x` (`dtype`) viewed as `[outer, len, inner]` over the middle dim
/// into `out` `[outer, inner]` (`dtype`), with an optional f32 `workspace`
/// for a two-pass split ([`reduce_workspace_len`] elements for the default
/// one; less, or none, runs fewer passes' worth of chunks).
pub fn reduce(
    dev: &dyn GpuDevice,
    op: Reduction,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    out: DeviceSliceMut<'_>,
    outer: usize,
    len: usize,
    inner: usize,
    workspace: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    let chunks = {
        let per_chunk = outer.saturating_mul(inner).max(1);
        let wl = workspace.as_ref().map_or(0, |w| w.len() / 4);
        reduce_chunks(outer, len, inner).min(wl / per_chunk).max(1)
    };
    reduce_chunked(dev, op, dtype, x, out, outer, len, inner, chunks, workspace)
}

/// [`reduce`] with the reduced dim split into `chunks` pieces (with more
/// than one, `workspace` must hold `outer * chunks * inner` f32 elements).
pub fn reduce_chunked(
    dev: &dyn GpuDevice,
    op: Reduction,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    out: DeviceSliceMut<'_>,
    outer: usize,
    len: usize,
    inner: usize,
    chunks: usize,
    workspace: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    const OP: &str = "cuda_reduce";
    let c = Check::new(OP, dev);
    let xp = c.read("x", &x, count(OP, &[outer, len, inner])?, dtype.size())?;
    let op_ = c.write("out", &out, count(OP, &[outer, inner])?, dtype.size())?;
    let (wp, wl) = workspace_ptr(&c, workspace.as_ref())?;
    // SAFETY: `x` and `out` hold their `[outer, len, inner]` / `[outer, inner]`
    // elements and the workspace `wl` f32 values (checked above; the launch
    // is refused when the split needs more), all live in `dev`'s memory; the
    // written views are exclusive borrows.
    unsafe { raw::reduce_chunked(dev, op, dtype, xp, op_, outer, len, inner, chunks, wp, wl) }
}

/// `out[r] = sum of x[r, i]^2` (f32 `out` of `rows`) for `x` (`dtype`) viewed
/// as `[rows, len]`, with an optional workspace as [`reduce`]'s
/// ([`reduce_workspace_len`]`(rows, len, 1)`).
pub fn sum_squares(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    rows: usize,
    len: usize,
    out: DeviceSliceMut<'_>,
    workspace: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    let wl = workspace.as_ref().map_or(0, |w| w.len() / 4);
    let chunks = reduce_chunks(rows, len, 1).min(wl / rows.max(1)).max(1);
    sum_squares_chunked(dev, dtype, x, rows, len, out, chunks, workspace)
}

/// [`sum_squares`] split into `chunks` pieces per row.
pub fn sum_squares_chunked(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    rows: usize,
    len: usize,
    out: DeviceSliceMut<'_>,
    chunks: usize,
    workspace: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    const OP: &str = "cuda_sum_squares";
    let c = Check::new(OP, dev);
    let xp = c.read("x", &x, count(OP, &[rows, len])?, dtype.size())?;
    let op_ = c.write("out", &out, rows, 4)?;
    let (wp, wl) = workspace_ptr(&c, workspace.as_ref())?;
    // SAFETY: as in `reduce_chunked`.
    unsafe { raw::sum_squares_chunked(dev, dtype, xp, rows, len, op_, chunks, wp, wl) }
}

/// Max over the middle dim of `[outer, len, inner]` into `out`
/// (`[outer, inner]`, `dtype`) with the i64 index of the first maximum in
/// `index` (`[outer, inner]`).
pub fn max_with_index(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    out: DeviceSliceMut<'_>,
    index: DeviceSliceMut<'_>,
    outer: usize,
    len: usize,
    inner: usize,
) -> Result<()> {
    const OP: &str = "cuda_max_with_index";
    let c = Check::new(OP, dev);
    let m = count(OP, &[outer, inner])?;
    let xp = c.read("x", &x, count(OP, &[outer, len, inner])?, dtype.size())?;
    let (op_, ip) = (c.write("out", &out, m, dtype.size())?, c.write("index", &index, m, 8)?);
    // SAFETY: as in `reduce_chunked`.
    unsafe { raw::max_with_index(dev, dtype, xp, op_, ip, outer, len, inner) }
}
