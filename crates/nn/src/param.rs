//! Parameters: a plain tensor, or a DTensor once a parallel style or FSDP shards it.

use std::sync::Arc;

use tpar_dtensor::DTensor;
use tpar_tensor::{DType, Device, Shape, Tensor};

use crate::Result;

/// A parameter sharded over data-parallel ranks and gathered for compute: what the module
/// layer needs of it. FSDP's parameters (`tpar_fsdp::FsdpParam`) implement it; the module
/// layer knows no more of FSDP than this.
pub trait ShardedParam: Send + Sync + std::fmt::Debug {
    /// This rank's dp shard: the leaf the optimizer updates, which owns the gradient.
    fn sharded(&self) -> Tensor;
    /// The unsharded tensor the forward computes with (its storage may be released
    /// between uses).
    fn unsharded(&self) -> Tensor;
    /// What a layer computes with, gathered first if needed.
    fn compute(&self) -> Result<ComputeParam>;
    /// The dp shard as a DTensor laid out as it is held on this rank (pass the 2-d mesh
    /// when the parameter is also tensor-parallel).
    fn dtensor(&self, mesh: Option<&tpar_mesh::DeviceMesh>) -> Result<DTensor>;
    /// The tensor-parallel spec of the parameter, if it is also tensor-parallel.
    fn tp(&self) -> Option<&tpar_dtensor::DTensorSpec>;
    /// The shape of the (tensor-parallel local) parameter that is sharded over dp.
    fn local_shape(&self) -> &[usize];
    /// The dp group.
    fn dp(&self) -> &tpar_collectives::ProcessGroup;
    /// The reduced gradient of [`ShardedParam::sharded`].
    fn grad_local(&self) -> Result<Option<Tensor>>;
    /// The whole (tensor-parallel local) parameter from a dp shard laid out like
    /// [`ShardedParam::sharded`] (collective over dp).
    fn gather_full(&self, shard: &Tensor) -> Result<Tensor>;
    /// Replaces the shard with this rank's chunk of `local` (the whole tensor-parallel
    /// local value), as `reset_parameters` does.
    fn reinit(&self, local: &Tensor) -> Result<()>;
    /// Copies `shard` (this rank's chunk) into the shard, as loading a state dict does.
    fn load_shard(&self, shard: &Tensor) -> Result<()>;
    /// The concrete parameter, for its owner's crate to downcast.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// What a layer computes with: a plain tensor or a DTensor.
#[derive(Clone, Debug)]
pub enum ComputeParam {
    /// A plain tensor.
    Plain(Tensor),
    /// A distributed tensor.
    Dist(DTensor),
}

impl ComputeParam {
    /// The parameter as a plain tensor, for a layer computing on a plain input: the
    /// plain tensor itself, or a DTensor replicated on every mesh dim (its local tensor
    /// is the whole value; gradients flow into it as the rank's contribution). `None`
    /// for a sharded or partial DTensor, which needs a DTensor input.
    pub fn replicated_local(&self) -> Option<Tensor> {
        match self {
            ComputeParam::Plain(t) => Some(t.clone()),
            ComputeParam::Dist(d) => {
                d.placements().iter().all(|p| p.is_replicate()).then(|| d.to_local())
            }
        }
    }
}

/// A module parameter.
#[derive(Clone, Debug)]
pub enum Param {
    /// A plain tensor (every rank holds all of it).
    Tensor(Tensor),
    /// A distributed tensor (each rank holds its shard).
    DTensor(DTensor),
    /// Managed by FSDP (`tpar_fsdp::fully_shard`): sharded over the dp group, gathered
    /// for compute.
    Fsdp(Arc<dyn ShardedParam>),
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

    /// The parameter as a DTensor laid out as it is held on this rank: a DTensor
    /// parameter itself; an FSDP parameter's dp shard with its layout (pass the 2-d mesh
    /// when it is also tensor-parallel, see [`ShardedParam::dtensor`]); `None` for a plain
    /// tensor.
    pub fn as_dtensor(&self, mesh: Option<&tpar_mesh::DeviceMesh>) -> Result<Option<DTensor>> {
        Ok(match self {
            Param::Tensor(_) => None,
            Param::DTensor(d) => Some(d.clone()),
            Param::Fsdp(f) => Some(f.dtensor(mesh)?),
        })
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
        if let Some(g) = self.reduced_grad() {
            return self.wrap_reduced_grad(g).map(Some);
        }
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
        if let Some(g) = self.reduced_grad() {
            return Ok(Some(g));
        }
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

// ---- Reduced gradients (optimizers and clip_grad_norm; see crate::optim) ----

/// Where the elements of a parameter's reduced local gradient live, for reductions
/// over all of them (a global norm; see `tpar_optim::sum_over_groups`).
#[derive(Clone, Debug)]
pub struct GradLayout {
    /// Whether this rank's elements count (false on a non-zero coordinate of a mesh dim
    /// where the parameter is `Replicate` or `Partial`, whose copies repeat rank 0's).
    pub counts: bool,
    /// The groups (size > 1) whose members together hold every distinct element.
    pub groups: Vec<tpar_collectives::ProcessGroup>,
}

impl Param {
    /// Brings the gradient to its reduced form ([`Param::grad_local`]) once and stores
    /// it back in the leaf ([`Param::trainable`]`.grad()`), marked, so that later calls of
    /// this, [`Param::grad_local`] and [`Param::grad`] use it without communicating again
    /// until a new backward accumulates into the leaf or the gradient is cleared.
    /// Collective the first time (every rank calls it). Returns the reduced gradient.
    /// Needs `trainable()` to return the same leaf handle on every call.
    pub fn reduce_grads_in_place(&self) -> Result<Option<Tensor>> {
        if let Some(g) = self.reduced_grad() {
            return Ok(Some(g));
        }
        let Some(g) = self.grad_local()? else { return Ok(None) };
        self.set_reduced_grad(Some(g.clone()));
        Ok(Some(g))
    }

    /// Replaces the leaf's gradient with `g`, an already-reduced gradient laid out like
    /// [`Param::trainable`] (e.g. a clipped one), marked as reduced; `None` clears it.
    pub fn set_reduced_grad(&self, g: Option<Tensor>) {
        self.trainable().set_reduced_grad(g);
    }

    /// The leaf's gradient when it is marked as reduced ([`Tensor::reduced_grad`]).
    fn reduced_grad(&self) -> Option<Tensor> {
        self.trainable().reduced_grad()
    }

    /// A reduced local gradient in the parameter's own layout (as [`Param::grad`]).
    fn wrap_reduced_grad(&self, g: Tensor) -> Result<Param> {
        Ok(match self {
            Param::Tensor(_) => Param::Tensor(g),
            Param::DTensor(d) => {
                Param::DTensor(DTensor::from_local(&g, d.mesh(), d.placements(), Some(d.shape()))?)
            }
            Param::Fsdp(f) => Param::Tensor(f.gather_full(&g)?),
        })
    }

    /// The layout of the reduced local gradient ([`Param::grad_local`]), for global
    /// reductions: which groups to sum over and whether this rank's copy counts.
    pub fn grad_layout(&self) -> Result<GradLayout> {
        use tpar_dtensor::Placement;
        let mut layout = GradLayout { counts: true, groups: Vec::new() };
        let mut add_spec = |mesh: &tpar_dtensor::DeviceMesh, placements: &[Placement]| {
            for (d, p) in placements.iter().enumerate() {
                if !matches!(p, Placement::Shard(_)) && mesh.coordinate()[d] != 0 {
                    layout.counts = false;
                }
                if mesh.shape()[d] > 1 {
                    layout.groups.push(mesh.group(d)?.clone());
                }
            }
            Ok::<(), crate::NnError>(())
        };
        match self {
            Param::Tensor(_) => {}
            Param::DTensor(d) => add_spec(d.mesh(), d.placements())?,
            Param::Fsdp(f) => {
                if let Some(spec) = f.tp() {
                    add_spec(spec.mesh(), spec.placements())?;
                }
                if f.dp().size() > 1 {
                    layout.groups.push(f.dp().clone());
                }
            }
        }
        Ok(layout)
    }
}

// ---- Retired parameters (an optimizer built before sharding) ----

impl Param {
    /// Puts `new` in this parameter's place in its module, and marks the old leaf
    /// ([`Param::trainable`]) retired by `by` (`"fully_shard"`, `"parallelize_module"`,
    /// `"reset_parameters"`) when `new` does not keep it: a copy of the old parameter
    /// still held elsewhere (by an optimizer built before sharding) then reports
    /// [`Param::retired_by`], and the optimizers refuse to step it
    /// ([`NnError::RetiredParam`](crate::NnError::RetiredParam)) instead of updating
    /// a tensor the model no longer computes with. A tensor shared by two slots (tied
    /// weights) is retired when either is replaced: replace both, as sharding a whole
    /// model does.
    pub fn replace(&mut self, new: Param, by: &'static str) {
        let old = self.trainable();
        let kept = new.trainable().id() == old.id();
        *self = new;
        if !kept {
            old.retire(by);
        }
    }

    /// What replaced this parameter in its module (see [`Param::replace`]), `None` while
    /// it is still the module's.
    pub fn retired_by(&self) -> Option<&'static str> {
        self.trainable().retired_by()
    }
}

/// `Err(`[`NnError::RetiredParam`](crate::NnError::RetiredParam)`)` naming the first of
/// `params` that was replaced in its module ([`Param::replace`]), what replaced it and
/// `holder` (an optimizer built too early: it must be built after sharding). One flag
/// read per parameter, so an optimizer checks at every step.
pub fn check_not_retired(holder: &str, params: &[(String, Param)]) -> Result<()> {
    for (name, p) in params {
        if let Some(by) = p.retired_by() {
            return Err(crate::NnError::RetiredParam {
                holder: holder.to_string(),
                param: name.clone(),
                by: by.to_string(),
            });
        }
    }
    Ok(())
}
