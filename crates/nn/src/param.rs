//! Parameters: a plain tensor, or a DTensor once a parallel style or FSDP shards it.

use tpar_dtensor::DTensor;
use tpar_tensor::{DType, Device, Shape, Tensor};

use crate::Result;

/// A module parameter.
#[derive(Clone, Debug)]
pub enum Param {
    /// A plain tensor (every rank holds all of it).
    Tensor(Tensor),
    /// A distributed tensor (each rank holds its shard).
    DTensor(DTensor),
}

impl Param {
    /// A new parameter (a leaf requiring a gradient) of `shape` on `device`
    /// (`Device::Meta` for deferred initialisation).
    pub fn new(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Param> {
        Ok(Param::Tensor(Tensor::zeros(shape, dtype, device)?.requires_grad_(true)))
    }

    /// The tensor the forward pass computes with: the plain tensor or this rank's shard.
    pub fn local(&self) -> Tensor {
        match self {
            Param::Tensor(t) => t.clone(),
            Param::DTensor(d) => d.to_local(),
        }
    }

    /// The DTensor, when the parameter is distributed.
    pub fn dtensor(&self) -> Option<&DTensor> {
        match self {
            Param::DTensor(d) => Some(d),
            Param::Tensor(_) => None,
        }
    }

    /// The global shape.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Param::Tensor(t) => t.dims().to_vec(),
            Param::DTensor(d) => d.shape().to_vec(),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.local().dtype()
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
        })
    }

    /// The whole parameter on every rank (collective for DTensors).
    pub fn full(&self) -> Result<Tensor> {
        Ok(match self {
            Param::Tensor(t) => t.clone(),
            Param::DTensor(d) => d.full_tensor()?,
        })
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        self.local().zero_grad();
    }
}
