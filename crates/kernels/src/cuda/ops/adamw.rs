//! The fused AdamW step (`cuda/adamw.cu`) over device buffers, one tensor or
//! many in a launch, optionally writing a bf16 or f16 working copy of each updated
//! parameter in the same pass; [`crate::cuda::raw::adamw`] documents the kernels.

use super::Check;
use crate::adamw::AdamWParams;
use crate::cuda::raw::adamw::{self as raw, AdamwBuffers};
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

/// One tensor's buffers in [`adamw_step_each`]: parameters and gradients of
/// `n` elements, f32 moments.
pub struct AdamwViews<'a> {
    /// Parameters (updated).
    pub param: DeviceSliceMut<'a>,
    /// Gradients.
    pub grad: DeviceSlice<'a>,
    /// f32 first moments (updated).
    pub exp_avg: DeviceSliceMut<'a>,
    /// f32 second moments (updated).
    pub exp_avg_sq: DeviceSliceMut<'a>,
    /// Elements.
    pub n: usize,
}

/// One in-place AdamW step with the same hyper-parameters on each tensor of
/// `tensors` (parameters of `dtype`, gradients of `grad_dtype`: `dtype` or
/// [`CudaDType::F32`]), up to 32 tensors a launch, with
/// [`adamw_step`]'s arithmetic per element. `h.step` must be at least 1.
pub fn adamw_step_each(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    tensors: &[AdamwViews<'_>],
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_each";
    let c = Check::new(OP, dev);
    let bufs = checked_buffers(&c, dtype, grad_dtype, tensors)?;
    // SAFETY: every view is a live buffer in `dev`'s memory of at least its
    // tensor's elements (checked above); the updated ones are exclusive
    // borrows, so none overlaps another.
    unsafe { raw::adamw_step_each(dev, dtype, grad_dtype, &bufs, h) }
}

/// [`adamw_step`] on `n` f32 parameters with f32 gradients that also writes each
/// updated parameter, rounded to `copy_dtype` ([`CudaDType::BF16`] or
/// [`CudaDType::F16`]), into `copy` (`n` elements) in the same pass: the bits a
/// separate cast of the updated parameters gives; the update is [`adamw_step`]'s.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step_with_copy(
    dev: &dyn GpuDevice,
    param: DeviceSliceMut<'_>,
    grad: DeviceSlice<'_>,
    exp_avg: DeviceSliceMut<'_>,
    exp_avg_sq: DeviceSliceMut<'_>,
    copy_dtype: CudaDType,
    copy: DeviceSliceMut<'_>,
    n: usize,
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_with_copy";
    let c = Check::new(OP, dev);
    let pp = c.write("param", &param, n, 4)?;
    let gp = c.read("grad", &grad, n, 4)?;
    let mp = c.write("exp_avg", &exp_avg, n, 4)?;
    let vp = c.write("exp_avg_sq", &exp_avg_sq, n, 4)?;
    let cp = c.write("copy", &copy, n, copy_dtype.size())?;
    // SAFETY: the five views are live buffers in `dev`'s memory of at least `n`
    // elements (checked above); the written ones are exclusive borrows, so none
    // overlaps another.
    unsafe { raw::adamw_step_with_copy(dev, pp, gp, mp, vp, copy_dtype, cp, n, h) }
}

/// [`adamw_step_each`] on f32 parameters with f32 gradients that also writes each
/// tensor's updated parameters, rounded to `copy_dtype` ([`CudaDType::BF16`] or
/// [`CudaDType::F16`]), into `copies[i]` (tensor `i`'s working copy of its `n`
/// elements; `None`: no copy) in the same launches: the bits a separate cast of the
/// updated parameters gives; the updates are [`adamw_step`]'s.
pub fn adamw_step_each_with_copies(
    dev: &dyn GpuDevice,
    copy_dtype: CudaDType,
    tensors: &[AdamwViews<'_>],
    copies: &[Option<DeviceSliceMut<'_>>],
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_each_with_copies";
    if copies.len() != tensors.len() {
        let what = format!("{} working copies for {} tensors", copies.len(), tensors.len());
        return Err(crate::util::bad(OP, what));
    }
    let c = Check::new(OP, dev);
    let f32s = |t: &AdamwViews<'_>| {
        Ok(AdamwBuffers {
            param: c.write("param", &t.param, t.n, 4)?,
            grad: c.read("grad", &t.grad, t.n, 4)?,
            exp_avg: c.write("exp_avg", &t.exp_avg, t.n, 4)?,
            exp_avg_sq: c.write("exp_avg_sq", &t.exp_avg_sq, t.n, 4)?,
            n: t.n,
        })
    };
    let bufs = tensors.iter().map(f32s).collect::<Result<Vec<_>>>()?;
    let ptrs = copies
        .iter()
        .zip(tensors)
        .map(|(v, t)| match v {
            Some(v) => c.write("copy", v, t.n, copy_dtype.size()),
            None => Ok(0),
        })
        .collect::<Result<Vec<_>>>()?;
    // SAFETY: every view is a live buffer in `dev`'s memory of at least its tensor's
    // elements (checked above); the written ones are exclusive borrows, so none
    // overlaps another.
    unsafe { raw::adamw_step_each_with_copies(dev, copy_dtype, &bufs, &ptrs, h) }
}

/// The capturable multi-tensor step ([`raw::adamw_step_each_device_coef`]): as
/// [`adamw_step_each`] (or [`adamw_step_each_with_copies`] with `copies`: their
/// dtype and one optional working copy per tensor), the kernels reading the step's
/// coefficients from `coef`, a device buffer holding a
/// [`raw::AdamwCoef`] ([`raw::coefficients`] of the step's hyper-parameters, written
/// before the kernels run), instead of their arguments: a CUDA graph that captured
/// these launches takes each step's coefficients from there on every replay. With
/// the same coefficients the results are the non-capturable kernels' bits.
pub fn adamw_step_each_device_coef(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    tensors: &[AdamwViews<'_>],
    copies: Option<(CudaDType, &[Option<DeviceSliceMut<'_>>])>,
    coef: DeviceSlice<'_>,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_each_device_coef";
    let c = Check::new(OP, dev);
    let bufs = checked_buffers(&c, dtype, grad_dtype, tensors)?;
    let cp = c.read("coefficients", &coef, 1, std::mem::size_of::<raw::AdamwCoef>())?;
    let ptrs = match copies {
        Some((cd, views)) => {
            if views.len() != tensors.len() {
                let what = format!("{} working copies for {} tensors", views.len(), tensors.len());
                return Err(crate::util::bad(OP, what));
            }
            let ptrs = views
                .iter()
                .zip(tensors)
                .map(|(v, t)| match v {
                    Some(v) => c.write("copy", v, t.n, cd.size()),
                    None => Ok(0),
                })
                .collect::<Result<Vec<_>>>()?;
            Some((cd, ptrs))
        }
        None => None,
    };
    let copies = ptrs.as_ref().map(|(cd, p)| (*cd, p.as_slice()));
    // SAFETY: every view is a live buffer in `dev`'s memory of at least its tensor's
    // elements and `coef` one of an AdamwCoef (checked above); the written ones are
    // exclusive borrows, so none overlaps another.
    unsafe { raw::adamw_step_each_device_coef(dev, dtype, grad_dtype, &bufs, copies, cp) }
}

/// Each tensor's four buffers after `c`'s checks: the parameter (`dtype`) and
/// the moments (f32) written, the gradient (`grad_dtype`) read, `n` elements each.
fn checked_buffers(
    c: &Check<'_>,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    tensors: &[AdamwViews<'_>],
) -> Result<Vec<AdamwBuffers>> {
    tensors
        .iter()
        .map(|t| {
            Ok(AdamwBuffers {
                param: c.write("param", &t.param, t.n, dtype.size())?,
                grad: c.read("grad", &t.grad, t.n, grad_dtype.size())?,
                exp_avg: c.write("exp_avg", &t.exp_avg, t.n, 4)?,
                exp_avg_sq: c.write("exp_avg_sq", &t.exp_avg_sq, t.n, 4)?,
                n: t.n,
            })
        })
        .collect()
}
