//! Dropout (`cuda/dropout.cu`) over device buffers; [`crate::cuda::raw::dropout`]
//! documents the kernel.

use super::Check;
use crate::cuda::raw::dropout as raw;
pub use crate::cuda::raw::dropout::MAX_RANK;
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::dropout::{DropoutMask, ShardRuns};
use crate::Result;

/// `y = x * mask` for the shard `runs` of the mask's tensor, bit for bit the
/// CPU [`crate::dropout::dropout`]: `x` and `y` hold the shard's elements of
/// `dtype`.
///
/// # Errors
/// As [`raw::dropout`], and the views' checks (device, size, alignment).
pub fn dropout(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    mask: &DropoutMask,
    runs: &ShardRuns,
    x: DeviceSlice<'_>,
    y: DeviceSliceMut<'_>,
) -> Result<()> {
    let c = Check::new("dropout", dev);
    let n = runs.elements()?;
    let (xp, yp) = (c.read("x", &x, n, dtype.size())?, c.write("y", &y, n, dtype.size())?);
    // SAFETY: both views are live buffers of `dev` holding the shard's
    // elements (checked above); `y` is an exclusive borrow, disjoint from `x`.
    unsafe { raw::dropout(dev, dtype, mask, runs, xp, yp) }
}
