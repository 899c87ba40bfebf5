//! The fused AdamW step (`cuda/adamw.cu`) over device buffers;
//! [`crate::cuda::raw::adamw`] documents the kernel.

use super::Check;
use crate::adamw::AdamWParams;
use crate::cuda::raw::adamw as raw;
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// One in-place AdamW step on `n` parameters of `dtype` with gradients of
/// `grad_dtype` (`dtype` or [`CudaDType::F32`]), updating the f32 moments
/// `exp_avg` and `exp_avg_sq`. `h.step` must be at least 1.
pub fn adamw_step(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    param: DeviceSliceMut<'_>,
    grad: DeviceSlice<'_>,
    exp_avg: DeviceSliceMut<'_>,
    exp_avg_sq: DeviceSliceMut<'_>,
    n: usize,
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step";
    let c = Check::new(OP, dev);
    let pp = c.write("param", &param, n, dtype.size())?;
    let gp = c.read("grad", &grad, n, grad_dtype.size())?;
    let mp = c.write("exp_avg", &exp_avg, n, 4)?;
    let vp = c.write("exp_avg_sq", &exp_avg_sq, n, 4)?;
    // SAFETY: the four views are live buffers in `dev`'s memory of at least
    // `n` elements (checked above); the updated ones are exclusive borrows,
    // so none overlaps another.
    unsafe { raw::adamw_step(dev, dtype, grad_dtype, pp, gp, mp, vp, n, h) }
}
