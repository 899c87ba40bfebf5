//! Tensor ops with their backward functions.

use std::sync::RwLockReadGuard;

use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Result, Shape, Tensor, TensorError};

mod attention_block;
mod attention_bshd;
mod cross_entropy;
mod dropout;
mod elementwise;
mod gpu;
mod gpu_elem;
pub(crate) mod gpu_nn;
mod linear_add;
mod linear_concat;
mod linear_many;
mod matmul;
mod nn;
mod optim;
pub use optim::{adamw_coefficients, SgdParams};
mod reduce;
mod shape;

pub use attention_block::{
    block_attention_time, reset_block_attention_time, BlockAttentionTime, BlockMask,
};
pub use nn::RopeLayout;

/// Checks that all inputs share one device, returning it.
pub(crate) fn common_device(op: &'static str, inputs: &[&Tensor]) -> Result<Device> {
    let d = inputs.first().map(|t| t.device()).unwrap_or(Device::Cpu);
    for t in inputs {
        if t.device() != d {
            return Err(TensorError::DeviceMismatch { op, lhs: d, rhs: t.device() });
        }
    }
    Ok(d)
}

/// Checks that all inputs share one dtype, returning it.
pub(crate) fn common_dtype(op: &'static str, inputs: &[&Tensor]) -> Result<DType> {
    let d = inputs.first().map(|t| t.dtype()).unwrap_or(DType::F32);
    for t in inputs {
        if t.dtype() != d {
            return Err(TensorError::DTypeMismatch {
                op,
                expected: d.name().into(),
                got: t.dtype(),
            });
        }
    }
    Ok(d)
}

/// Runs a host computation over the inputs' storages producing a tensor of
/// `out_shape`. On the meta device no data is touched: the output is meta too.
pub(crate) fn compute(
    op: &'static str,
    inputs: &[&Tensor],
    out_shape: Shape,
    out_dtype: DType,
    f: impl FnOnce(&[&CpuStorage]) -> Result<CpuStorage>,
) -> Result<Tensor> {
    let mut outs = compute_multi(op, inputs, &[(out_shape, out_dtype)], |s| Ok(vec![f(s)?]))?;
    Ok(outs.swap_remove(0))
}

/// Like [`compute`] but the closure returns several storages (one per output shape).
pub(crate) fn compute_multi(
    op: &'static str,
    inputs: &[&Tensor],
    outs: &[(Shape, DType)],
    f: impl FnOnce(&[&CpuStorage]) -> Result<Vec<CpuStorage>>,
) -> Result<Vec<Tensor>> {
    for (shape, dtype) in outs {
        // A size no device could hold is an error, never an abort (meta included: a model
        // built on meta is materialized later).
        crate::storage::storage_bytes(op, shape, *dtype)?;
    }
    match common_device(op, inputs)? {
        Device::Meta => {
            return outs.iter().map(|(s, d)| Tensor::empty(s.clone(), *d, Device::Meta)).collect()
        }
        Device::Cuda(i) => return compute_on_host(op, i, inputs, outs, f),
        Device::Cpu => {}
    }
    let guards: Vec<RwLockReadGuard<'_, Storage>> =
        inputs.iter().map(|t| t.0.storage.read().unwrap_or_else(|p| p.into_inner())).collect();
    let mut storages = Vec::with_capacity(inputs.len());
    for g in &guards {
        match &**g {
            Storage::Cpu(s) => storages.push(s),
            Storage::Gpu(_) => {
                return Err(TensorError::DeviceMismatch {
                    op,
                    lhs: Device::Cpu,
                    rhs: Device::Cuda(0),
                })
            }
            Storage::Meta => return Err(TensorError::MetaTensor { op }),
            Storage::Released => return Err(TensorError::Released { op }),
        }
    }
    for (shape, dtype) in outs {
        // The kernels allocate their outputs infallibly: ask the allocator first.
        crate::storage::check_alloc(op, shape, *dtype)?;
    }
    let res = f(&storages)?;
    drop(guards);
    if res.len() != outs.len() {
        return Err(invalid(
            op,
            format!("{} outputs computed for {} expected", res.len(), outs.len()),
        ));
    }
    res.into_iter()
        .zip(outs)
        .map(|(s, (shape, _))| Tensor::from_storage(s, shape.clone()))
        .collect()
}

/// An op without a CUDA kernel on CUDA inputs: computes on host copies and
/// uploads the outputs (counted in [`crate::gpu::host_round_trips`]).
fn compute_on_host(
    op: &'static str,
    ordinal: usize,
    inputs: &[&Tensor],
    outs: &[(Shape, DType)],
    f: impl FnOnce(&[&CpuStorage]) -> Result<Vec<CpuStorage>>,
) -> Result<Vec<Tensor>> {
    let host: Vec<Tensor> =
        inputs.iter().map(|t| t.detach().to_device(Device::Cpu)).collect::<Result<_>>()?;
    crate::gpu::count_host_round_trip();
    let refs: Vec<&Tensor> = host.iter().collect();
    let res = compute_multi(op, &refs, outs, f)?;
    res.into_iter().map(|t| t.to_device(Device::Cuda(ordinal))).collect()
}

/// The CUDA ordinal the inputs live on, if they live on one (after checking
/// they share a device).
pub(crate) fn cuda_ordinal(op: &'static str, inputs: &[&Tensor]) -> Result<Option<usize>> {
    match common_device(op, inputs)? {
        Device::Cuda(i) => Ok(Some(i)),
        _ => Ok(None),
    }
}

/// Runs `f` (an op built from differentiable pieces) on host copies of CUDA
/// inputs and moves its output back: autograd flows through the two moves.
pub(crate) fn on_host(
    ordinal: usize,
    inputs: &[&Tensor],
    f: impl FnOnce(&[Tensor]) -> Result<Tensor>,
) -> Result<Tensor> {
    let host: Vec<Tensor> =
        inputs.iter().map(|t| t.to_device(Device::Cpu)).collect::<Result<_>>()?;
    crate::gpu::count_host_round_trip();
    f(&host)?.to_device(Device::Cuda(ordinal))
}

pub(crate) fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(TensorError::DTypeMismatch {
            op,
            expected: "a float dtype".into(),
            got: t.dtype(),
        });
    }
    Ok(())
}

pub(crate) fn invalid(op: &'static str, what: impl Into<String>) -> TensorError {
    TensorError::InvalidArgument { op, what: what.into() }
}
