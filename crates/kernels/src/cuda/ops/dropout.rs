//! Dropout (`cuda/dropout.cu`) over device buffers; [`crate::cuda::raw::dropout`]
//! documents the kernel.

use super::Check;
use crate::cuda::raw::dropout as raw;
pub use crate::cuda::raw::dropout::{state_words, MAX_RANK, STATE_WORDS};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::dropout::{DropoutMask, ShardRuns};
use crate::Result;

/// `y = x * mask` for the shard `runs` of the mask's tensor, bit for bit the
/// CPU [`crate::dropout::dropout`]: `x` and `y` hold the shard's elements of
/// `dtype`. A `state` (the [`STATE_WORDS`] u64s of [`state_words`]) is read when
/// the kernel runs, as [`raw::dropout`] says: what a captured CUDA graph's
/// replays draw by.
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
    state: Option<DeviceSlice<'_>>,
) -> Result<()> {
    let c = Check::new("dropout", dev);
    let n = runs.elements()?;
    let (xp, yp) = (c.read("x", &x, n, dtype.size())?, c.write("y", &y, n, dtype.size())?);
    let sp = state.map(|s| c.read("state", &s, STATE_WORDS, 8)).transpose()?;
    // SAFETY: both views are live buffers of `dev` holding the shard's
    // elements, and the state its words (checked above); `y` is an exclusive
    // borrow, disjoint from `x` and the state.
    unsafe { raw::dropout(dev, dtype, mask, runs, xp, yp, sp) }
}
