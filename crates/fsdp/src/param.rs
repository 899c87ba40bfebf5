//! The state of one FSDP-managed parameter: its dp shard (the leaf the optimizer
//! updates) and the unsharded tensor the forward computes with, whose storage exists
//! only while its unit runs. A unit's parameters communicate together through their
//! [`FsdpParamGroup`].

use std::sync::{Arc, Mutex, Weak};

use tpar_collectives::{ProcessGroup, ReduceOp, Work};
use tpar_dtensor::{DTensor, DTensorSpec, Placement};
use tpar_mesh::DeviceMesh;
use tpar_placements::chunk_range;
use tpar_tensor::autograd::{needs_input_grad, record_persistent, GradModeGuard};
use tpar_tensor::{no_grad, DType, Device, Tensor, TensorError};

use tpar_nn::{link_unsharder, ComputeParam, NnError, Result, Unshard};

use crate::group::FsdpParamGroup;

/// The group a parameter belongs to and its index there (shared with the backward
/// closure of the parameter's all-gather node).
type GroupLink = Arc<Mutex<Option<(Weak<FsdpParamGroup>, usize)>>>;

struct Inner {
    sharded: Tensor,
    unsharded: Tensor,
    pending: Option<Work>,
    /// The shard in the compute dtype as an optimizer step wrote it (mixed precision),
    /// kept between steps; `current` while it holds the shard's values.
    working: Option<Working>,
}

/// The working copy of [`Inner`].
struct Working {
    copy: Tensor,
    current: bool,
}

/// One parameter under FSDP.
///
/// `sharded` is this rank's `torch.chunk` of the (tensor-parallel-local) parameter
/// along dim 0 over the dp group; it is a leaf and owns the gradient and the optimizer
/// state. `unsharded` is a non-leaf produced from it by an all-gather node: its storage
/// is filled by [`FsdpParam::unshard`] and released by [`FsdpParam::reshard`].
///
/// In a unit ([`FsdpParamGroup`]), gathering and reducing are the group's: the whole
/// unit is gathered with one all-gather, and the all-gather node's backward hands the
/// gradient to the group, which reduce-scatters the unit's gradients together once all
/// have arrived. Alone, the parameter gathers itself and its node reduce-scatters its own
/// gradient (averaged over dp, in `reduce_dtype`) into the shard.
///
/// **Working copy (mixed precision).** When the compute dtype differs from the shard's,
/// an optimizer step can write the updated shard, cast to the compute dtype, into the
/// parameter's working copy in the same pass ([`Unshard::working_copy`], what
/// `tpar_optim::AdamW` does); the gathers until the shard's next gradient arrives then
/// read that copy instead of casting the shard (bit for bit the same values). The copy is
/// out of date once a gradient arrives (an optimizer may then change the shard), and on
/// [`FsdpParam::adopt`], [`FsdpParam::load_shard`] and [`FsdpParam::invalidate`]; the
/// gathers then cast the shard as without it. It costs one shard in the compute dtype.
pub struct FsdpParam {
    inner: Mutex<Inner>,
    /// This state, for the link its shards carry ([`link_unsharder`]).
    me: Weak<FsdpParam>,
    /// The parameter's layout as a DTensor: `[Shard(0)]` on the dp mesh, or the
    /// tensor-parallel placements then `Shard(0)` on the mesh of the tp dims and dp.
    layout: DTensorSpec,
    dp: ProcessGroup,
    tp: Option<DTensorSpec>,
    local_shape: Vec<usize>,
    param_dtype: DType,
    reduce_dtype: DType,
    group: GroupLink,
}

impl std::fmt::Debug for FsdpParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FsdpParam(local {:?} over dp {:?}, tp {:?})",
            self.local_shape,
            self.dp.ranks(),
            self.tp
        )
    }
}

impl FsdpParam {
    /// Shards `local` (a plain parameter, or a DTensor parameter's local shard with its
    /// `tp` spec) along dim 0 over `dp`. `param_dtype` is the dtype the forward computes
    /// in (bf16 for mixed precision), `reduce_dtype` the dtype gradients are reduced in.
    pub fn new(
        local: &Tensor,
        tp: Option<DTensorSpec>,
        dp_mesh: &DeviceMesh,
        param_dtype: DType,
        reduce_dtype: DType,
    ) -> Result<Arc<FsdpParam>> {
        let dp = dp_mesh.group(0)?.clone();
        if local.rank() == 0 {
            return Err(NnError::Config { what: "FSDP cannot shard a 0-d parameter".into() });
        }
        let layout = Self::layout(local.dims(), tp.as_ref(), dp_mesh)?;
        let sharded = Self::shard_of(local, &dp)?;
        let p = Arc::new_cyclic(|me| FsdpParam {
            inner: Mutex::new(Inner {
                unsharded: sharded.clone(),
                sharded: sharded.clone(),
                pending: None,
                working: None,
            }),
            me: me.clone(),
            layout,
            dp,
            tp,
            local_shape: local.dims().to_vec(),
            param_dtype,
            reduce_dtype,
            group: Arc::new(Mutex::new(None)),
        });
        p.install(sharded)?;
        Ok(p)
    }

    /// The DTensor layout of the dp shards of `local` (the tensor-parallel local
    /// parameter, laid out by `tp`). FSDP shards the TP-local shard, so the TP split is
    /// the outer one: the mesh is the tp dims then dp, cut from their common root mesh
    /// ([`DeviceMesh::root`]), with the tp placements then `Shard(0)`, which nests exactly
    /// as the shards are held.
    fn layout(
        local: &[usize],
        tp: Option<&DTensorSpec>,
        dp_mesh: &DeviceMesh,
    ) -> Result<DTensorSpec> {
        let Some(spec) = tp else {
            return Ok(DTensorSpec::new(dp_mesh, &[Placement::Shard(0)], local)?);
        };
        // The dp mesh's root holds the tp dims too (the same mesh, or it with dims
        // flattened into the dp dim, as `mesh.flatten(["dp", "cp"], "dp_cp")` gives).
        let root = dp_mesh.root();
        let tp_root = spec.mesh().root();
        let tp_names: Vec<&str> = spec.mesh().names().iter().map(String::as_str).collect();
        let same_tp = root.ranks() == tp_root.ranks()
            && root.slice(&tp_names).is_ok_and(|m| m.ranks() == spec.mesh().ranks());
        if !same_tp {
            return Err(NnError::Config {
                what: format!(
                    "fully_shard's dp mesh {dp_mesh} and the tensor-parallel mesh {} of a \
                     parameter must be cut from one mesh (mesh[\"dp\"] and mesh[\"tp\"])",
                    spec.mesh()
                ),
            });
        }
        let mut names: Vec<&str> = spec.mesh().names().iter().map(String::as_str).collect();
        names.extend(dp_mesh.names().iter().map(String::as_str));
        let mesh = root.slice(&names)?;
        let mut placements = spec.placements().to_vec();
        placements.push(Placement::Shard(0));
        Ok(DTensorSpec::new(&mesh, &placements, spec.shape())?)
    }

    fn shard_of(local: &Tensor, dp: &ProcessGroup) -> Result<Tensor> {
        let (start, len) = chunk_range(local.dims()[0], dp.size(), dp.rank());
        Ok(no_grad(|| local.detach().narrow(0, start, len)?.deep_clone())?.requires_grad_(true))
    }

    /// Sets the shard (linked to this state, [`link_unsharder`]) and builds the unsharded
    /// tensor with its all-gather node.
    fn install(&self, sharded: Tensor) -> Result<()> {
        let me: Weak<dyn Unshard> = self.me.clone();
        link_unsharder(&sharded, me)?;
        let placeholder = if sharded.device() == Device::Meta {
            Tensor::empty(self.local_shape.clone(), self.param_dtype, Device::Meta)?
        } else {
            Tensor::new_released_on(self.local_shape.clone(), self.param_dtype, sharded.device())
        };
        let u = placeholder.clone();
        let (dp, reduce, master) = (self.dp.clone(), self.reduce_dtype, sharded.dtype());
        let link = self.group.clone();
        let me = self.me.clone();
        // The node is part of the parameter whatever the caller's grad mode.
        let _grad = GradModeGuard::new(true);
        let unsharded = record_persistent("fsdp_all_gather", &[&sharded], placeholder, move |g| {
            if !needs_input_grad(0) {
                return Ok(vec![None]);
            }
            if let Some((group, i)) = linked(&link) {
                // The unit reduce-scatters its gradients together (and fills the shard's
                // gradient) once all have arrived.
                group.deposit_grad(i, g).map_err(into_tensor_error)?;
                return Ok(vec![None]);
            }
            let g = g.to_dtype(reduce)?;
            let shard = dp.reduce_scatter(&g, 0, ReduceOp::Avg)?;
            u.release_storage_();
            if let Some(me) = me.upgrade() {
                me.working_out_of_date();
            }
            Ok(vec![Some(shard.to_dtype(master)?)])
        });
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        *inner = Inner { sharded, unsharded, pending: None, working: None };
        Ok(())
    }

    /// Marks the working copy out of date (the shard may change, or did).
    pub(crate) fn working_out_of_date(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = &mut inner.working {
            w.current = false;
        }
    }

    /// The shard in the compute dtype, as a gather sends it: the working copy an
    /// optimizer step wrote when it is current, else the shard cast (the shard itself
    /// when the dtypes agree; callers copy before writing).
    pub(crate) fn compute_shard(&self) -> Result<Tensor> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        self.compute_shard_of(&inner)
    }

    fn compute_shard_of(&self, inner: &Inner) -> Result<Tensor> {
        if let Some(Working { copy, current: true }) = &inner.working {
            return Ok(copy.clone());
        }
        Ok(no_grad(|| inner.sharded.detach().to_dtype(self.param_dtype))?)
    }

    /// Whether a current working copy stands in for the cast shard (for tests and
    /// reports).
    pub fn has_current_working_copy(&self) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.working.as_ref().is_some_and(|w| w.current)
    }

    /// See [`Unshard::working_copy`]: the working copy (allocated on first use, in the
    /// compute dtype, shaped and placed as the shard), marked out of date until
    /// [`FsdpParam::stepped`]; `None` when the shard is in the compute dtype or holds
    /// no data (meta).
    pub fn working_copy(&self) -> Result<Option<Tensor>> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let shard = &inner.sharded;
        if shard.dtype() == self.param_dtype || shard.device() == Device::Meta {
            return Ok(None);
        }
        let fits = inner
            .working
            .as_ref()
            .is_some_and(|w| w.copy.shape() == shard.shape() && w.copy.device() == shard.device());
        if !fits {
            let copy = Tensor::zeros(shard.shape().clone(), self.param_dtype, shard.device())?;
            inner.working = Some(Working { copy, current: false });
        }
        let w = inner.working.as_mut().ok_or_else(|| NnError::Config {
            what: "internal error: the FSDP working copy vanished".into(),
        })?;
        w.current = false;
        Ok(Some(w.copy.clone()))
    }

    /// See [`Unshard::stepped`]: the shard was updated in place; the working copy is
    /// current when the update wrote it too.
    pub fn stepped(&self, copy_written: bool) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = &mut inner.working {
            w.current = copy_written;
        }
    }

    /// Makes `shard` (a new leaf laid out as the current shard, e.g. at initialisation)
    /// the shard; the old gradient is dropped (and a gather of the old values that is in
    /// flight, discarded).
    pub fn adopt(&self, shard: &Tensor) -> Result<()> {
        let want = self.sharded();
        if shard.dims() != want.dims() {
            return Err(NnError::Config {
                what: format!(
                    "a new shard of {:?} for the FSDP parameter {self:?}, whose shard is {:?}",
                    shard.dims(),
                    want.dims()
                ),
            });
        }
        self.install(shard.clone())?;
        if let Some((group, _)) = self.group() {
            group.discard_prefetch()?;
        }
        Ok(())
    }

    /// Copies `shard` (this rank's dp shard of a saved value) into the shard in place,
    /// keeping the leaf and its optimizer state's identity, and drops what was gathered
    /// of the old values ([`FsdpParam::invalidate`]).
    pub fn load_shard(&self, shard: &Tensor) -> Result<()> {
        no_grad(|| self.sharded().copy_(shard))?;
        self.invalidate()
    }

    /// Releases any gathered copy (or discards a gather in flight), so the next use
    /// gathers the shard's current values (after they were overwritten in place).
    pub fn invalidate(&self) -> Result<()> {
        {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(w) = &mut inner.working {
                w.current = false;
            }
            if !inner.unsharded.is_released() && inner.unsharded.device() != Device::Meta {
                inner.unsharded.release_storage_();
            }
        }
        if let Some((group, _)) = self.group() {
            group.discard_prefetch()?;
        }
        Ok(())
    }

    /// This state as the `Arc` it lives in.
    pub(crate) fn this(&self) -> Option<Arc<FsdpParam>> {
        self.me.upgrade()
    }

    /// The unit this parameter belongs to, and its index there.
    pub fn group(&self) -> Option<(Arc<FsdpParamGroup>, usize)> {
        linked(&self.group)
    }

    /// Makes this parameter member `index` of `group` (once; see
    /// [`FsdpParamGroup::new`]).
    pub(crate) fn link(&self, group: &Arc<FsdpParamGroup>, index: usize) -> Result<()> {
        let mut slot = self.group.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_some_and(|(g, _)| g.strong_count() > 0) {
            return Err(NnError::Config {
                what: format!("{self:?} already belongs to an FSDP unit"),
            });
        }
        *slot = Some((Arc::downgrade(group), index));
        Ok(())
    }

    /// The dtype the unsharded parameter is gathered and computed in.
    pub fn param_dtype(&self) -> DType {
        self.param_dtype
    }

    /// The dtype the gradient is reduce-scattered in.
    pub fn reduce_dtype(&self) -> DType {
        self.reduce_dtype
    }

    /// Whether the unsharded tensor gets a gradient in backward (its shard requires one
    /// and holds data).
    pub fn expects_grad(&self) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.unsharded.requires_grad() && inner.sharded.device() != Device::Meta
    }

    /// The dp shard (the leaf the optimizer updates).
    pub fn sharded(&self) -> Tensor {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).sharded.clone()
    }

    /// The unsharded tensor (its storage may be released).
    pub fn unsharded(&self) -> Tensor {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).unsharded.clone()
    }

    /// The parameter as a DTensor whose local shard is the dp shard (the leaf the
    /// optimizer updates): what the module holds as its parameter
    /// ([`Param::DTensor`](tpar_nn::Param::DTensor)), for state dicts, optimizers and
    /// checkpoints. Without tensor parallelism it lives on the dp mesh as
    /// `[Shard(0)]`; with it, on the tp dims then dp as `[<tp placements>, Shard(0)]`
    /// (see [`FsdpParam::new`]).
    pub fn dtensor(&self) -> Result<DTensor> {
        let l = &self.layout;
        Ok(DTensor::from_local(&self.sharded(), l.mesh(), l.placements(), Some(l.shape()))?)
    }

    /// The dp group.
    pub fn dp(&self) -> &ProcessGroup {
        &self.dp
    }

    /// The tensor-parallel layout of the unsharded tensor, if any.
    pub fn tp(&self) -> Option<&DTensorSpec> {
        self.tp.as_ref()
    }

    /// The (tp-local) unsharded shape.
    pub fn local_shape(&self) -> &[usize] {
        &self.local_shape
    }

    /// Starts gathering the unsharded tensor (returns at once; [`FsdpParam::unshard`]
    /// waits for it). In a unit, the whole unit is gathered.
    pub fn unshard_async(&self) -> Result<()> {
        if let Some((group, _)) = self.group() {
            return group.unshard_async();
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if !inner.unsharded.is_released() || inner.pending.is_some() {
            return Ok(());
        }
        let src = self.compute_shard_of(&inner)?;
        inner.pending = Some(self.dp.all_gather_async(&src, 0));
        Ok(())
    }

    /// Makes the unsharded tensor's data available (waiting for a started gather, or
    /// gathering now). A no-op when it already is. In a unit, the whole unit is gathered.
    pub fn unshard(&self) -> Result<()> {
        if let Some((group, _)) = self.group() {
            if self.unsharded().is_released() {
                return group.unshard();
            }
            return Ok(());
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if !inner.unsharded.is_released() {
            inner.pending = None;
            return Ok(());
        }
        let full = match inner.pending.take() {
            Some(w) => w.wait()?,
            None => {
                let src = self.compute_shard_of(&inner)?;
                no_grad(|| self.dp.all_gather(&src, 0))?
            }
        };
        inner.unsharded.fill_storage_(full)?;
        Ok(())
    }

    /// Releases the unsharded tensor's data. Returns the bytes freed.
    pub fn reshard(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).unsharded.release_storage_()
    }

    /// What the forward computes with: the unsharded tensor (as a DTensor with the
    /// tensor-parallel layout, when there is one). Gathers first if needed.
    pub fn compute(&self) -> Result<ComputeParam> {
        self.unshard()?;
        let u = self.unsharded();
        Ok(match &self.tp {
            Some(spec) => ComputeParam::Dist(DTensor::from_local(
                &u,
                spec.mesh(),
                spec.placements(),
                Some(spec.shape()),
            )?),
            None => ComputeParam::Plain(u),
        })
    }

    /// The shard's gradient with tensor-parallel contributions reduced (an all_reduce
    /// over the tp mesh where the parameter is `Replicate` there).
    pub fn grad_local(&self) -> Result<Option<Tensor>> {
        let Some(g) = self.sharded().grad() else { return Ok(None) };
        let Some(spec) = &self.tp else { return Ok(Some(g)) };
        let mut g = g;
        for (d, p) in spec.placements().iter().enumerate() {
            if *p == Placement::Replicate && spec.mesh().shape()[d] > 1 {
                g = spec.mesh().group(d)?.all_reduce(&g, ReduceOp::Sum)?;
            }
        }
        Ok(Some(g))
    }

    /// Gathers a dp-sharded tensor (the shard or its gradient) back to the tp-local
    /// shape, then to the full parameter if there is a tp layout.
    pub fn gather_full(&self, shard: &Tensor) -> Result<Tensor> {
        let local = no_grad(|| self.dp.all_gather(&shard.detach(), 0))?;
        Ok(match &self.tp {
            Some(spec) => {
                DTensor::from_local(&local, spec.mesh(), spec.placements(), Some(spec.shape()))?
                    .full_tensor()?
            }
            None => local,
        })
    }
}

fn linked(link: &GroupLink) -> Option<(Arc<FsdpParamGroup>, usize)> {
    let slot = link.lock().unwrap_or_else(|p| p.into_inner());
    slot.as_ref().and_then(|(g, i)| g.upgrade().map(|g| (g, *i)))
}

/// A module-layer error as the tensor error a backward closure returns.
pub(crate) fn into_tensor_error(e: NnError) -> TensorError {
    match e {
        NnError::Tensor(t) => t,
        other => TensorError::External(Arc::new(other)),
    }
}

/// The module layer's view of an FSDP parameter ([`tpar_nn::Param::unsharder`]).
impl Unshard for FsdpParam {
    fn compute(&self) -> Result<ComputeParam> {
        FsdpParam::compute(self)
    }
    fn adopt(&self, shard: &Tensor) -> Result<()> {
        FsdpParam::adopt(self, shard)
    }
    fn invalidate(&self) -> Result<()> {
        FsdpParam::invalidate(self)
    }
    fn working_copy(&self) -> Result<Option<Tensor>> {
        FsdpParam::working_copy(self)
    }
    fn stepped(&self, copy_written: bool) -> Result<()> {
        FsdpParam::stepped(self, copy_written);
        Ok(())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
