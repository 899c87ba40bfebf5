//! RMSNorm forward and backward (`cuda/rmsnorm.cu`) over device buffers;
//! [`crate::cuda::raw::rmsnorm`] documents the kernels.

use super::{count, Check};
use crate::cuda::raw::rmsnorm as raw;
pub use crate::cuda::raw::rmsnorm::{
    backward_blocks, backward_workspace_bytes, MAX_BACKWARD_BLOCKS, MAX_DIM,
};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// Forward RMSNorm of `rows` rows of length `dim`: `y` (`[rows, dim]`,
/// `dtype`) and the f32 `1/rms` per row `rstd`, from `x` (`[rows, dim]`) and
/// the weight `w` (`[dim]`).
pub fn rmsnorm_forward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    w: DeviceSlice<'_>,
    y: DeviceSliceMut<'_>,
    rstd: DeviceSliceMut<'_>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rmsnorm_forward";
    let c = Check::new(OP, dev);
    let (n, es) = (count(OP, &[rows, dim])?, dtype.size());
    let xp = c.read("x", &x, n, es)?;
    let wp = c.read("w", &w, dim, es)?;
    let yp = c.write("y", &y, n, es)?;
    let rp = c.write("rstd", &rstd, rows, 4)?;
    // SAFETY: every address starts a view of a live buffer in `dev`'s memory
    // that holds what the kernel touches for these sizes (checked above); the
    // outputs are exclusive borrows, so they overlap nothing else.
    unsafe { raw::rmsnorm_forward(dev, dtype, xp, wp, yp, rp, rows, dim, eps) }
}

/// Backward RMSNorm: writes `dx` (`[rows, dim]`) and the f32 weight gradient
/// `dw` (`[dim]`, summed over rows in a fixed order), from the forward's `x`,
/// `w` and `rstd` and the output gradient `dy`, using `workspace`
/// ([`backward_workspace_bytes`] bytes).
pub fn rmsnorm_backward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    w: DeviceSlice<'_>,
    rstd: DeviceSlice<'_>,
    dy: DeviceSlice<'_>,
    dx: DeviceSliceMut<'_>,
    dw: DeviceSliceMut<'_>,
    workspace: DeviceSliceMut<'_>,
    rows: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_backward";
    let c = Check::new(OP, dev);
    let (n, es) = (count(OP, &[rows, dim])?, dtype.size());
    let xp = c.read("x", &x, n, es)?;
    let wp = c.read("w", &w, dim, es)?;
    let rp = c.read("rstd", &rstd, rows, 4)?;
    let gp = c.read("dy", &dy, n, es)?;
    let dxp = c.write("dx", &dx, n, es)?;
    let dwp = c.write("dw", &dw, dim, 4)?;
    let ws = count(OP, &[backward_blocks(rows), dim])?;
    let wsp = c.write("workspace", &workspace, ws, 4)?;
    // SAFETY: as in `rmsnorm_forward`; the workspace holds the partials of
    // every block the backward pass runs.
    unsafe { raw::rmsnorm_backward(dev, dtype, xp, wp, rp, gp, dxp, dwp, wsp, rows, dim) }
}
