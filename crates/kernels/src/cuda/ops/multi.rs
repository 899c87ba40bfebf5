//! Multi-tensor kernels (`cuda/multi.cu`) over device buffers: one launch per
//! [`MULTI_MAX`](crate::cuda::raw::multi::MULTI_MAX) tensors of one dtype for
//! the sums of squares of each, or each times one device scalar in place;
//! [`crate::cuda::raw::multi`] documents the kernels.

use super::Check;
use crate::cuda::raw::multi as raw;
pub use crate::cuda::raw::multi::sum_squares_each_workspace_len;
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// `out[t] = sum of xs[t][i]^2` (f32 `out` of `xs.len()`) for `xs` (a view and
/// its elements of `dtype`), with an f32 `workspace` of
/// [`sum_squares_each_workspace_len`] elements.
pub fn sum_squares_each(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    xs: &[(DeviceSlice<'_>, usize)],
    out: DeviceSliceMut<'_>,
    workspace: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "cuda_sum_squares_each";
    let c = Check::new(OP, dev);
    let ptrs = xs
        .iter()
        .map(|(v, n)| Ok((c.read("x", v, *n, dtype.size())?, *n)))
        .collect::<Result<Vec<_>>>()?;
    let op_ = c.write("out", &out, xs.len(), 4)?;
    let lens: Vec<usize> = xs.iter().map(|(_, n)| *n).collect();
    let wl = sum_squares_each_workspace_len(&lens);
    let wp = c.write("workspace", &workspace, wl, 4)?;
    // SAFETY: every view holds the elements it is read or written as (checked
    // above) in `dev`'s memory; the written views are exclusive borrows.
    unsafe { raw::sum_squares_each(dev, dtype, &ptrs, op_, wp, wl) }
}

/// `ys[t] *= c` in place (`dtype`, `ys[t].1` elements each) with `c` the f32 in
/// `coef` rounded to `dtype`, the product rounded once (the raw kernel with each
/// output its own input). The views are exclusive borrows, so no two overlap.
pub fn scale_each_in_place(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    ys: &mut [(DeviceSliceMut<'_>, usize)],
    coef: DeviceSlice<'_>,
) -> Result<()> {
    const OP: &str = "cuda_scale_each_in_place";
    let c = Check::new(OP, dev);
    let es = dtype.size();
    let ptrs = ys
        .iter()
        .map(|(y, n)| {
            let p = c.write("y", y, *n, es)?;
            Ok((p, p, *n))
        })
        .collect::<Result<Vec<_>>>()?;
    let cp = c.read("coef", &coef, 1, 4)?;
    // SAFETY: as in `sum_squares_each`; each element is read and then written by
    // the same thread, so an output may be its own input.
    unsafe { raw::scale_each(dev, dtype, &ptrs, cp) }
}
