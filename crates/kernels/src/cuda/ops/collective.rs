//! The reduction of a collective (`cuda/collective.cu`) over the device
//! buffers of several ranks; [`crate::cuda::raw::collective`] documents the
//! kernel and its fold.

use super::pitched;
use crate::cuda::raw::collective as raw;
pub use crate::cuda::raw::collective::{FoldDType, FoldOp};
use crate::cuda::{DevPtr, DeviceBuffer, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// `out = fold(op)` over the `[rows, cols]` block at pitch `ld` of every
/// source, in source order, into the contiguous `out` (`rows * cols`
/// elements of `dtype`). Every source and `out` live in `dev`'s memory.
///
/// ```
/// use std::sync::Arc;
/// use tpar_kernels::cuda::{emu::EmulatedGpu, ops::collective, DeviceBuffer, GpuDevice};
/// use collective::{FoldDType, FoldOp};
/// let dev: Arc<dyn GpuDevice> = EmulatedGpu::open(0)?;
/// let a = DeviceBuffer::from_host(&dev, &[1.0f32, 2.0, 3.0, 4.0])?;
/// let b = DeviceBuffer::from_host(&dev, &[10.0f32, 20.0, 30.0, 40.0])?;
/// let mut y = DeviceBuffer::alloc(&dev, 8)?;
/// // Column 1 of two [2, 2] sources, summed.
/// let srcs = [a.slice(4..16)?, b.slice(4..16)?];
/// collective::reduce(&*dev, FoldDType::F32, FoldOp::Sum, &srcs, 2, 1, 2, y.as_slice_mut())?;
/// let mut host = [0.0f32; 2];
/// y.as_slice().copy_to_host(&mut host)?;
/// assert_eq!(host, [22.0, 44.0]);
/// # Ok::<(), tpar_kernels::KernelError>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn reduce(
    dev: &dyn GpuDevice,
    dtype: FoldDType,
    op: FoldOp,
    srcs: &[DeviceSlice<'_>],
    rows: usize,
    cols: usize,
    ld: usize,
    out: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "coll_reduce";
    let c = super::Check::new(OP, dev);
    let es = dtype.size();
    let reach = pitched(OP, rows, cols, if rows > 1 { ld } else { cols })?;
    let ptrs: Vec<DevPtr> =
        srcs.iter().map(|s| c.read("source", s, reach, es)).collect::<Result<_>>()?;
    let op_ = c.write("out", &out, super::count(OP, &[rows, cols])?, es)?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    // The source table lives on the device; it is freed (in stream order)
    // after the launch.
    let table = DeviceBuffer::from_host(out.device(), &ptrs)?;
    let tp = c.read("source table", &table.as_slice(), ptrs.len(), 8)?;
    // SAFETY: every source holds the block (checked above) and `out` its
    // `rows * cols` elements, all live in `dev`'s memory; `out` is an
    // exclusive borrow, disjoint from the sources; the table holds their
    // `srcs.len()` addresses.
    unsafe { raw::reduce(dev, dtype, op, tp, ptrs.len(), rows, cols, ld, op_) }
}
