//! Parameters: a plain tensor, or a DTensor once a parallel style or FSDP shards it.

use std::sync::{Arc, Weak};

use tpar_dtensor::DTensor;
use tpar_tensor::{DType, Device, Shape, Tensor};

use crate::Result;

/// The state that gathers a sharded parameter for compute: what the module layer needs
/// of FSDP. FSDP's parameters are plain [`Param::DTensor`]s (`Shard(0)` over the dp mesh,
/// with their tensor-parallel placements); the shard of each carries its FSDP state
/// (`tpar_fsdp::FsdpParam`), which implements this, so that a layer computes with the
/// gathered parameter ([`Param::compute`]) and initialisation and loading keep the state
/// in step ([`Param::unsharder`]).
pub trait Unshard: Send + Sync + std::fmt::Debug {
    /// What a layer computes with: the gathered parameter (a DTensor with its
    /// tensor-parallel layout when it has one), gathered first if needed.
    fn compute(&self) -> Result<ComputeParam>;
    /// Makes `shard`, a new leaf laid out as the current shard, the parameter's shard (as
    /// `reset_parameters` does); what was gathered of the old one is dropped.
    fn adopt(&self, shard: &Tensor) -> Result<()>;
    /// The shard's values were overwritten in place (a state dict was loaded): drops
    /// what was gathered of the old values, so the next use gathers the new ones.
    fn invalidate(&self) -> Result<()>;
    /// The low-precision working copy an optimizer step may write beside its in-place
    /// update of the shard (the updated shard cast to this tensor's dtype, in the same
    /// pass), so the next gather reads it instead of casting the shard again; `None`
    /// when the parameter computes in the shard's own dtype. Asking for it marks any
    /// copy written before as out of date until [`Unshard::stepped`] says otherwise.
    fn working_copy(&self) -> Result<Option<Tensor>> {
        Ok(None)
    }
    /// An optimizer updated the shard in place; `copy_written`: the update also wrote
    /// [`Unshard::working_copy`]'s tensor with the updated values.
    fn stepped(&self, copy_written: bool) -> Result<()> {
        let _ = copy_written;
        Ok(())
    }
    /// The concrete state, for its owner's crate to downcast.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// What a sharded parameter's leaf carries ([`Tensor::attach`]): a weak link to its
/// [`Unshard`] state (the state holds the leaf, so a strong one would never be freed).
struct UnshardLink(Weak<dyn Unshard>);

/// Links `shard` (the leaf of a sharded parameter) to the state that gathers it for
/// compute; [`Param::unsharder`] finds it. A leaf is linked once.
///
/// # Errors
/// [`NnError::Config`](crate::NnError::Config) when the leaf already carries something.
pub fn link_unsharder(shard: &Tensor, state: Weak<dyn Unshard>) -> Result<()> {
    if shard.attach(Arc::new(UnshardLink(state))) {
        Ok(())
    } else {
        Err(crate::NnError::Config {
            what: format!("{shard:?} is already linked to a sharded parameter's state"),
        })
    }
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
    /// A distributed tensor (each rank holds its shard). FSDP's parameters are these too
    /// (`Shard(0)` on the dp mesh), gathered for compute by their [`Param::unsharder`].
    DTensor(DTensor),
}

impl Param {
    /// A new parameter (a leaf requiring a gradient) of `shape` on `device`
    /// (`Device::Meta` for deferred initialisation).
    pub fn new(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Param> {
        Ok(Param::Tensor(Tensor::zeros(shape, dtype, device)?.requires_grad_(true)))
    }

    /// The tensor this rank holds: the plain tensor, or this rank's shard (for an FSDP
    /// parameter, its dp shard; see [`Param::compute`] for what the forward uses).
    pub fn local(&self) -> Tensor {
        match self {
            Param::Tensor(t) => t.clone(),
            Param::DTensor(d) => d.to_local(),
        }
    }

    /// The state that gathers this parameter for compute, when it is sharded by FSDP
    /// ([`link_unsharder`]); `None` for any other parameter.
    ///
    /// # Errors
    /// [`NnError::Config`](crate::NnError::Config) when the parameter was sharded by a
    /// module that no longer exists (its state is gone).
    pub fn unsharder(&self) -> Result<Option<Arc<dyn Unshard>>> {
        let Param::DTensor(d) = self else { return Ok(None) };
        let Some(link) = d.local().attachment().and_then(|a| a.downcast_ref::<UnshardLink>())
        else {
            return Ok(None);
        };
        match link.0.upgrade() {
            Some(u) => Ok(Some(u)),
            None => Err(crate::NnError::Config {
                what: format!(
                    "{d:?} was sharded by FSDP in a module that no longer exists; take parameters from the live model"
                ),
            }),
        }
    }

    /// What a layer computes with (an FSDP parameter is gathered first if needed).
    pub fn compute(&self) -> Result<ComputeParam> {
        if let Some(u) = self.unsharder()? {
            return u.compute();
        }
        Ok(match self {
            Param::Tensor(t) => ComputeParam::Plain(t.clone()),
            Param::DTensor(d) => ComputeParam::Dist(d.clone()),
        })
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
        })
    }

    /// The whole parameter on every rank (collective for DTensors).
    pub fn full(&self) -> Result<Tensor> {
        Ok(match self {
            Param::Tensor(t) => t.clone(),
            Param::DTensor(d) => d.full_tensor()?,
        })
    }

    /// The leaf an optimizer updates in place: the plain tensor, or this rank's shard.
    pub fn trainable(&self) -> Tensor {
        self.local()
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
        if let Param::DTensor(d) = self {
            add_spec(d.mesh(), d.placements())?;
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
