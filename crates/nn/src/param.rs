//! Parameters: a plain tensor, or a DTensor once a parallel style or FSDP shards it.

use std::sync::Arc;

use tpar_dtensor::DTensor;
use tpar_tensor::{DType, Device, Shape, Tensor};

use crate::fsdp_param::FsdpParam;
use crate::Result;

/// What a layer computes with: a plain tensor or a DTensor.
#[derive(Clone, Debug)]
pub enum ComputeParam {
    /// A plain tensor.
    Plain(Tensor),
    /// A distributed tensor.
    Dist(DTensor),
}

/// A module parameter.
#[derive(Clone, Debug)]
pub enum Param {
    /// A plain tensor (every rank holds all of it).
    Tensor(Tensor),
    /// A distributed tensor (each rank holds its shard).
    DTensor(DTensor),
    /// Managed by FSDP: sharded over the dp group, gathered for compute.
    Fsdp(Arc<FsdpParam>),
}

impl Param {
    /// A new parameter (a leaf requiring a gradient) of `shape` on `device`
    /// (`Device::Meta` for deferred initialisation).
    pub fn new(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Param> {
        Ok(Param::Tensor(Tensor::zeros(shape, dtype, device)?.requires_grad_(true)))
    }

    /// The tensor the forward pass computes with: the plain tensor, this rank's shard, or
    /// FSDP's unsharded tensor (whose storage may be released between uses).
    pub fn local(&self) -> Tensor {
        match self {
            Param::Tensor(t) => t.clone(),
            Param::DTensor(d) => d.to_local(),
            Param::Fsdp(f) => f.unsharded(),
        }
    }

    /// What a layer computes with (an FSDP parameter is gathered first if needed).
    pub fn compute(&self) -> Result<ComputeParam> {
        Ok(match self {
            Param::Tensor(t) => ComputeParam::Plain(t.clone()),
            Param::DTensor(d) => ComputeParam::Dist(d.clone()),
            Param::Fsdp(f) => f.compute()?,
        })
    }

    /// The DTensor, when the parameter is distributed.
    pub fn dtensor(&self) -> Option<&DTensor> {
        match self {
            Param::DTensor(d) => Some(d),
            Param::Tensor(_) | Param::Fsdp(_) => None,
        }
    }

    /// The global shape.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Param::Tensor(t) => t.dims().to_vec(),
            Param::DTensor(d) => d.shape().to_vec(),
            Param::Fsdp(f) => {
                f.tp().map(|s| s.shape().to_vec()).unwrap_or_else(|| f.local_shape().to_vec())
            }
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.trainable().dtype()
    }

    /// Number of elements of the global parameter.
    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }

    /// The gradient with the parameter's own layout: a plain tensor's `.grad()`, or
    /// [`DTensor::grad`] (collective: every rank of the mesh calls it).
    pub fn grad(&self) -> Result<Option<Param>> {
        Ok(match self {
            Param::Tensor(t) => t.grad().map(Param::Tensor),
            Param::DTensor(d) => d.grad()?.map(Param::DTensor),
            Param::Fsdp(f) => match f.grad_local()? {
                None => None,
                Some(g) => Some(Param::Tensor(f.gather_full(&g)?)),
            },
        })
    }

    /// The whole parameter on every rank (collective for DTensors).
    pub fn full(&self) -> Result<Tensor> {
        Ok(match self {
            Param::Tensor(t) => t.clone(),
            Param::DTensor(d) => d.full_tensor()?,
            Param::Fsdp(f) => f.gather_full(&f.sharded())?,
        })
    }

    /// The leaf an optimizer updates in place: the plain tensor, or this rank's shard.
    pub fn trainable(&self) -> Tensor {
        match self {
            Param::Fsdp(f) => f.sharded(),
            other => other.local(),
        }
    }

    /// The gradient of [`Param::trainable`], laid out like it, with the contributions of
    /// replicated mesh dims reduced (collective for DTensors: every rank calls it).
    pub fn grad_local(&self) -> Result<Option<Tensor>> {
        Ok(match self {
            Param::Tensor(t) => t.grad(),
            Param::DTensor(d) => d.grad()?.map(|g| g.to_local()),
            Param::Fsdp(f) => f.grad_local()?,
        })
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        self.trainable().zero_grad();
    }
}
