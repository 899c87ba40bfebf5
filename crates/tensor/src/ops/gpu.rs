//! Ops on CUDA tensors that run device kernels (`tpar_kernels::cuda`).
//!
//! Each op here takes inputs already on `cuda:N`, allocates its outputs
//! there, launches, and records a backward that launches too. Dtypes without
//! CUDA kernels (f64) return `None` so the caller falls back to the host.

use std::sync::Arc;

use tpar_kernels::cuda::ops::rmsnorm as k_rmsnorm;
use tpar_kernels::cuda::{CudaDType, DevPtr, GpuDevice};

use crate::autograd::record;
use crate::gpu::GpuStorage;
use crate::storage::Storage;
use crate::{DType, Device, Result, Shape, Tensor};

/// The kernel element type of a tensor dtype, if CUDA kernels exist for it.
pub(crate) fn cuda_dtype(d: DType) -> Option<CudaDType> {
    match d {
        DType::F32 => Some(CudaDType::F32),
        DType::BF16 => Some(CudaDType::BF16),
        DType::F16 => Some(CudaDType::F16),
        _ => None,
    }
}

/// The device and data address of a CUDA tensor.
pub(crate) fn dev_ptr(t: &Tensor, op: &'static str) -> Result<(Arc<dyn GpuDevice>, DevPtr)> {
    t.with_gpu_storage(op, |s| Ok((s.device().clone(), s.ptr())))
}

/// A new CUDA tensor with uninitialized data.
pub(crate) fn alloc(
    dev: &Arc<dyn GpuDevice>,
    shape: impl Into<Shape>,
    dtype: DType,
) -> Result<Tensor> {
    let shape = shape.into();
    let s = GpuStorage::alloc(dev, dtype, shape.numel())?;
    Ok(Tensor::make(shape, dtype, Device::Cuda(dev.ordinal()), Storage::Gpu(s)))
}

/// RMSNorm on the device; `None` when the dtype has no kernel.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    const OP: &str = "rms_norm";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let dim = x.dims().last().copied().unwrap_or(1);
    let rows = x.numel().checked_div(dim).unwrap_or(0);
    let (dev, xp) = dev_ptr(x, OP)?;
    let (_, wp) = dev_ptr(w, OP)?;
    let y = alloc(&dev, x.shape().clone(), x.dtype())?;
    let rstd = alloc(&dev, [rows], DType::F32)?;
    let (_, yp) = dev_ptr(&y, OP)?;
    let (_, rp) = dev_ptr(&rstd, OP)?;
    // SAFETY: every pointer is a live allocation of the size the kernel expects.
    unsafe { k_rmsnorm::rmsnorm_forward(&*dev, cd, xp, wp, yp, rp, rows, dim, eps as f32)? };
    let (xs, ws) = (x.detach(), w.detach());
    Ok(Some(record(OP, &[x, w], y, move |g| {
        let (dev, gp) = dev_ptr(g, OP)?;
        let (_, xp) = dev_ptr(&xs, OP)?;
        let (_, wp) = dev_ptr(&ws, OP)?;
        let (_, rp) = dev_ptr(&rstd, OP)?;
        let dx = alloc(&dev, xs.shape().clone(), xs.dtype())?;
        let dw = alloc(&dev, [dim], DType::F32)?;
        let work = alloc(&dev, [k_rmsnorm::backward_workspace_bytes(rows, dim) / 4], DType::F32)?;
        let (_, dxp) = dev_ptr(&dx, OP)?;
        let (_, dwp) = dev_ptr(&dw, OP)?;
        let (_, wkp) = dev_ptr(&work, OP)?;
        // SAFETY: as in the forward; `work` has the size the kernel asks for.
        unsafe {
            k_rmsnorm::rmsnorm_backward(&*dev, cd, xp, wp, rp, gp, dxp, dwp, wkp, rows, dim)?
        };
        Ok(vec![Some(dx), Some(dw.to_dtype(ws.dtype())?)])
    })))
}
