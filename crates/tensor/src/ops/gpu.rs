//! Ops on CUDA tensors that run device kernels (`tpar_kernels::cuda::ops`),
//! and the access helpers the device ops share.
//!
//! Each op here takes inputs already on `cuda:N`, allocates its outputs
//! there, launches, and records a backward that launches too. Dtypes without
//! CUDA kernels (f64) return `None` so the caller falls back to the host.
//!
//! A launch reads its inputs through their storages' read locks
//! ([`with_gpu`]) and writes outputs it owns ([`Out`]) until they become
//! tensors; in-place updates take their tensors' write locks
//! ([`with_gpu_mut`]). The kernel wrappers borrow the device buffers from
//! there, so a buffer cannot be freed or written by another thread while a
//! launch uses it.

use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};

use tpar_kernels::cuda::ops::rmsnorm as k_rmsnorm;
use tpar_kernels::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};

use crate::autograd::record;
use crate::gpu::GpuStorage;
use crate::storage::Storage;
use crate::{DType, Device, Result, Shape, Tensor, TensorError};

/// The kernel element type of a tensor dtype, if CUDA kernels exist for it.
pub(crate) fn cuda_dtype(d: DType) -> Option<CudaDType> {
    match d {
        DType::F32 => Some(CudaDType::F32),
        DType::BF16 => Some(CudaDType::BF16),
        DType::F16 => Some(CudaDType::F16),
        _ => None,
    }
}

/// The device of a CUDA tensor.
pub(crate) fn device_of(t: &Tensor, op: &'static str) -> Result<Arc<dyn GpuDevice>> {
    t.with_gpu_storage(op, |s| Ok(s.device().clone()))
}

/// The error for a tensor whose storage is not on a CUDA device.
fn not_gpu(op: &'static str, s: &Storage) -> TensorError {
    match s {
        Storage::Meta => TensorError::MetaTensor { op },
        Storage::Released => TensorError::Released { op },
        _ => TensorError::DeviceMismatch { op, lhs: Device::Cuda(0), rhs: Device::Cpu },
    }
}

/// Runs `f` on the device storages of the CUDA tensors `ts` (in order), each
/// read-locked for the call.
pub(crate) fn with_gpu<R>(
    op: &'static str,
    ts: &[&Tensor],
    f: impl FnOnce(&[&GpuStorage]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<RwLockReadGuard<'_, Storage>> =
        ts.iter().map(|t| t.0.storage.read().unwrap_or_else(|p| p.into_inner())).collect();
    let mut storages = Vec::with_capacity(ts.len());
    for g in &guards {
        match &**g {
            Storage::Gpu(s) => storages.push(s),
            other => return Err(not_gpu(op, other)),
        }
    }
    f(&storages)
}

/// Runs `f` on the device storages of the CUDA tensors `writes`, write-locked
/// (updated in place), and `reads`, read-locked. No two of them may share a
/// storage (an error, before any lock is taken).
pub(crate) fn with_gpu_mut<R>(
    op: &'static str,
    writes: &[&Tensor],
    reads: &[&Tensor],
    f: impl FnOnce(&mut [&mut GpuStorage], &[&GpuStorage]) -> Result<R>,
) -> Result<R> {
    // Storages by address: linear in the arguments (a multi-tensor update passes
    // hundreds).
    let id = |t: &Tensor| Arc::as_ptr(&t.0.storage) as *const () as usize;
    let mut written = std::collections::HashSet::with_capacity(writes.len());
    let shared = !writes.iter().all(|w| written.insert(id(w)))
        || reads.iter().any(|r| written.contains(&id(r)));
    if shared {
        return Err(super::invalid(
            op,
            "a tensor updated in place must not share its storage with another argument",
        ));
    }
    let mut wguards: Vec<RwLockWriteGuard<'_, Storage>> =
        writes.iter().map(|t| t.0.storage.write().unwrap_or_else(|p| p.into_inner())).collect();
    let rguards: Vec<RwLockReadGuard<'_, Storage>> =
        reads.iter().map(|t| t.0.storage.read().unwrap_or_else(|p| p.into_inner())).collect();
    let mut ws = Vec::with_capacity(writes.len());
    for g in wguards.iter_mut() {
        match &mut **g {
            Storage::Gpu(s) => ws.push(s),
            other => return Err(not_gpu(op, other)),
        }
    }
    let mut rs = Vec::with_capacity(reads.len());
    for g in &rguards {
        match &**g {
            Storage::Gpu(s) => rs.push(s),
            other => return Err(not_gpu(op, other)),
        }
    }
    f(&mut ws, &rs)
}

/// A new CUDA tensor's data while kernels write it: device storage for
/// `shape`'s elements, owned here (so writable without a lock) until
/// [`Out::into_tensor`].
pub(crate) struct Out {
    shape: Shape,
    data: GpuStorage,
}

impl Out {
    /// Uninitialized storage for `shape` of `dtype` on `dev`.
    pub(crate) fn new(
        dev: &Arc<dyn GpuDevice>,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> Result<Out> {
        let shape = shape.into();
        let data = GpuStorage::alloc(dev, dtype, shape.numel())?;
        Ok(Out { shape, data })
    }

    /// Zero-filled storage.
    pub(crate) fn zeros(
        dev: &Arc<dyn GpuDevice>,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> Result<Out> {
        let shape = shape.into();
        let data = GpuStorage::zeros(dev, dtype, shape.numel())?;
        Ok(Out { shape, data })
    }

    /// The data, for a kernel to read.
    pub(crate) fn view(&self) -> DeviceSlice<'_> {
        self.data.view()
    }

    /// The data, for a kernel to write.
    pub(crate) fn view_mut(&mut self) -> DeviceSliceMut<'_> {
        self.data.view_mut()
    }

    /// The finished tensor (no autograd).
    pub(crate) fn into_tensor(self) -> Tensor {
        let (dtype, device) = (self.data.dtype, Device::Cuda(self.data.device().ordinal()));
        Tensor::make(self.shape, dtype, device, Storage::Gpu(self.data))
    }
}

/// RMSNorm on the device; `None` when the dtype has no kernel.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    const OP: &str = "rms_norm";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let dim = x.dims().last().copied().unwrap_or(1);
    let rows = x.numel().checked_div(dim).unwrap_or(0);
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, x.shape().clone(), x.dtype())?;
    let mut rstd = Out::new(&dev, [rows], DType::F32)?;
    with_gpu(OP, &[x, w], |s| {
        let (y, r) = (y.view_mut(), rstd.view_mut());
        Ok(k_rmsnorm::rmsnorm_forward(
            &*dev,
            cd,
            s[0].view(),
            s[1].view(),
            y,
            r,
            rows,
            dim,
            eps as f32,
        )?)
    })?;
    let rstd = rstd.into_tensor();
    let (xs, ws) = (x.detach(), w.detach());
    Ok(Some(record(OP, &[x, w], y.into_tensor(), move |g| {
        let dev = device_of(g, OP)?;
        let mut dx = Out::new(&dev, xs.shape().clone(), xs.dtype())?;
        let mut dw = Out::new(&dev, [dim], DType::F32)?;
        let mut work =
            Out::new(&dev, [k_rmsnorm::backward_workspace_bytes(rows, dim) / 4], DType::F32)?;
        with_gpu(OP, &[&xs, &ws, &rstd, g], |s| {
            Ok(k_rmsnorm::rmsnorm_backward(
                &*dev,
                cd,
                s[0].view(),
                s[1].view(),
                s[2].view(),
                s[3].view(),
                dx.view_mut(),
                dw.view_mut(),
                work.view_mut(),
                rows,
                dim,
            )?)
        })?;
        Ok(vec![Some(dx.into_tensor()), Some(dw.into_tensor().to_dtype(ws.dtype())?)])
    })))
}
