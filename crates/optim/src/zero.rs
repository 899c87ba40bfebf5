//! ZeRO-1: optimizer-state sharding over data parallelism, the lighter alternative to
//! FSDP.
//!
//! Every dp rank holds every parameter (as with `tpar_parallel_styles::DataParallel`),
//! but the optimizer state only for its share of them. The parameters of one dtype are
//! laid end to end, flattened, in parameter order (a *bucket*, as DeepSpeed's stage 1
//! does); dp rank `r` owns the `torch.chunk` range `r` of each bucket
//! ([`chunk_range`]`(bucket_numel, dp, r)`), which covers whole parameters, parts of
//! parameters, or nothing of some. For every parameter overlapping its range the rank
//! keeps a *shard leaf*: a flat tensor holding those elements, which an ordinary
//! [`Optimizer`] (the inner one: [`AdamW`], [`Sgd`], ...) updates. AdamW and SGD are
//! elementwise, so stepping slices is exactly stepping the whole parameters.
//!
//! One step ([`Optimizer::step`]):
//!
//! 1. **reduce** ([`ZeroRedundancyOptimizer::reduce_gradients`]): the parameters'
//!    gradients (each reduced over its tensor-parallel mesh first, as
//!    [`Param::grad_local`]) are concatenated per bucket and **reduce-scattered**
//!    (averaged) over dp, instead of DDP's all_reduce, so each rank receives the mean
//!    gradient of its range, which it adds to its shard leaves' `.grad()`. The full
//!    gradients are then dropped. One scalar-per-parameter all_reduce (max) first
//!    agrees on which parameters have a gradient on any rank (a parameter missing a
//!    gradient on some ranks counts as zero there; one with none anywhere is skipped).
//! 2. **local step**: the shard leaves are refreshed from the current parameter values
//!    (so writes to the parameters, e.g. loading a checkpoint, are picked up), then the
//!    inner optimizer steps them.
//! 3. **all_gather** per bucket of the updated ranges, copied into every parameter.
//!
//! Collectives per step with one parameter dtype and no tensor parallelism: one
//! all_reduce of the gradient mask, one reduce_scatter, one all_gather (and, with
//! clipping, one more mask all_reduce and one scalar all_reduce of the norm's share).
//!
//! **Clipping.** After `reduce_gradients` the full gradients are gone and each rank
//! holds only its range's averaged gradient, so clip through the optimizer:
//! [`clip_grad_norm_`](crate::clip_grad_norm_)`(&mut opt, max_norm, &opts)` between the
//! backward and `step`. It reduce-scatters ([`Optimizer::grads_for_clip`]), computes the
//! global norm from the ranges (one all_reduce over dp, plus one per tensor-parallel
//! mesh dim where parameters are DTensors) and scales the shard gradients as
//! `torch.nn.utils.clip_grad_norm_` does. (Passing the model's parameters instead would
//! see no gradients after the reduction, or each rank's unaveraged ones before it.)
//!
//! **Requirements.** Build it after the parameters are materialized (not on the meta
//! device) and equal on every dp rank (same seed, or `DataParallel::new`'s broadcast);
//! every dp rank passes the same parameter list. FSDP parameters are refused (FSDP
//! shards the optimizer state already). Refused configurations are [`NnError::Config`].

use std::collections::BTreeMap;

use crate::{AdamW, AdamWConfig, ClipGrad, Optimizer, Sgd, SgdConfig};
use tpar_collectives::{chunk_range, ProcessGroup, ReduceOp};
use tpar_mesh::DeviceMesh;
use tpar_nn::{check_not_retired, NnError, Param, Result};
use tpar_tensor::{no_grad, DType, Device, Tensor};

/// This rank's part of one parameter: elements `start..start + leaf.numel()` of the
/// flattened parameter, as a leaf the inner optimizer steps.
#[derive(Debug)]
struct Shard {
    start: usize,
    leaf: Tensor,
}

/// One parameter's place in its bucket.
#[derive(Debug)]
struct Member {
    /// Index into the optimizer's parameter list.
    param: usize,
    /// Offset of its first element in the flat bucket.
    offset: usize,
    /// Its (local, tensor-parallel) element count.
    numel: usize,
    /// This rank's part, when its range overlaps the parameter.
    shard: Option<Shard>,
}

/// The parameters of one dtype, laid end to end.
#[derive(Debug)]
struct Bucket {
    dtype: DType,
    device: Device,
    numel: usize,
    /// This rank's `torch.chunk` range of the bucket.
    start: usize,
    len: usize,
    members: Vec<Member>,
}

/// ZeRO stage 1 over the 1-d dp mesh: replicated parameters, optimizer state sharded
/// by ranges of flattened parameters, gradients reduce-scattered and updated values
/// all-gathered (see the module docs for the layout and the collectives). `O` is the
/// optimizer that steps this rank's ranges; [`Optimizer::state_bytes`] is this rank's
/// share, about `1/dp` of the unsharded optimizer's.
///
/// ```
/// use tpar_collectives::spawn;
/// use tpar_mesh::{DeviceMesh, DeviceType};
/// use tpar_optim::{clip_grad_norm_, AdamWConfig, ClipOptions, Optimizer, ZeroRedundancyOptimizer};
/// use tpar_nn::{NnError, Param};
/// use tpar_tensor::Tensor;
/// spawn(2, |ctx| -> Result<(), NnError> {
///     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
///     let w = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], [3])?.requires_grad_(true);
///     let params = vec![("w".to_string(), Param::Tensor(w.clone()))];
///     let mut opt = ZeroRedundancyOptimizer::adamw(params, &mesh, AdamWConfig::default())?;
///     // Each rank's own data; the step uses the mean gradient over dp.
///     let k = (ctx.rank() + 1) as f64;
///     w.mul_scalar(k)?.sum_all()?.backward()?;
///     clip_grad_norm_(&mut opt, 1.0, &ClipOptions::default())?;
///     opt.step()?;
///     opt.zero_grad();
///     // Rank 0 holds the state of elements 0..2, rank 1 of element 2: two f32 moments.
///     assert_eq!(opt.state_bytes(), if ctx.rank() == 0 { 16 } else { 8 });
///     assert!(w.to_vec::<f32>()?[0] < 1.0);
///     Ok(())
/// })
/// .unwrap();
/// ```
#[derive(Debug)]
pub struct ZeroRedundancyOptimizer<O: Optimizer> {
    params: Vec<(String, Param)>,
    dp: ProcessGroup,
    buckets: Vec<Bucket>,
    inner: O,
}

/// A configuration ZeRO-1 refuses ([`NnError::Config`], naming it).
fn bad(what: impl Into<String>) -> NnError {
    NnError::Config { what: format!("ZeroRedundancyOptimizer: {}", what.into()) }
}

impl ZeroRedundancyOptimizer<AdamW> {
    /// ZeRO-1 [`AdamW`] over the named `params` (e.g. [`tpar_nn::named_parameters`]) and
    /// the 1-d `dp_mesh`.
    pub fn adamw(
        params: Vec<(String, Param)>,
        dp_mesh: &DeviceMesh,
        config: AdamWConfig,
    ) -> Result<Self> {
        Self::new(params, dp_mesh, |shards| AdamW::with_names(shards, config))
    }
}

impl ZeroRedundancyOptimizer<Sgd> {
    /// ZeRO-1 [`Sgd`] (its state is the momentum buffer) over the named `params` and the
    /// 1-d `dp_mesh`.
    pub fn sgd(
        params: Vec<(String, Param)>,
        dp_mesh: &DeviceMesh,
        config: SgdConfig,
    ) -> Result<Self> {
        Self::new(params, dp_mesh, |shards| Sgd::with_names(shards, config))
    }
}

impl<O: Optimizer> ZeroRedundancyOptimizer<O> {
    /// ZeRO-1 over the named `params` (plain tensors or tensor-parallel DTensors, whose
    /// local shards are what gets split) and the 1-d `dp_mesh`. `make_inner` builds the
    /// optimizer that steps this rank's ranges from named flat shard leaves (named
    /// `"{param}[start..end]"`; a rank whose range misses a parameter gets no leaf for
    /// it). Communicates nothing.
    pub fn new(
        params: Vec<(String, Param)>,
        dp_mesh: &DeviceMesh,
        make_inner: impl FnOnce(Vec<(String, Param)>) -> Result<O>,
    ) -> Result<Self> {
        if dp_mesh.ndim() != 1 {
            return Err(bad(format!("needs a 1-d mesh (mesh[\"dp\"]), got {dp_mesh}")));
        }
        let dp = dp_mesh.group(0)?.clone();
        check_not_retired("ZeroRedundancyOptimizer", &params)?;
        // Buckets by dtype, members in parameter order (the same on every rank).
        let mut by_dtype: BTreeMap<&'static str, Bucket> = BTreeMap::new();
        for (i, (name, p)) in params.iter().enumerate() {
            if p.unsharder()?.is_some() {
                return Err(bad(format!(
                    "parameter {name:?} is managed by FSDP, which shards optimizer state \
                     already; use a plain optimizer with fully_shard"
                )));
            }
            let t = p.trainable();
            if t.device() == Device::Meta {
                return Err(bad(format!(
                    "parameter {name:?} is still on the meta device; build the optimizer \
                     after reset_parameters"
                )));
            }
            let b = by_dtype.entry(t.dtype().name()).or_insert_with(|| Bucket {
                dtype: t.dtype(),
                device: t.device(),
                numel: 0,
                start: 0,
                len: 0,
                members: Vec::new(),
            });
            if b.device != t.device() {
                return Err(bad(format!(
                    "parameter {name:?} is on {:?}, other {} parameters on {:?}",
                    t.device(),
                    b.dtype,
                    b.device
                )));
            }
            b.members.push(Member { param: i, offset: b.numel, numel: t.numel(), shard: None });
            b.numel += t.numel();
        }
        let mut shards = Vec::new();
        let mut buckets: Vec<Bucket> = by_dtype.into_values().collect();
        for b in &mut buckets {
            (b.start, b.len) = chunk_range(b.numel, dp.size(), dp.rank());
            let (lo, hi) = (b.start, b.start + b.len);
            for m in &mut b.members {
                let (s, e) = (m.offset.max(lo), (m.offset + m.numel).min(hi));
                if s >= e {
                    continue;
                }
                let (name, p) = &params[m.param];
                let (start, len) = (s - m.offset, e - s);
                let leaf = no_grad(|| {
                    p.trainable().detach().reshape([m.numel])?.narrow(0, start, len)?.deep_clone()
                })?
                .requires_grad_(true);
                shards.push((
                    format!("{name}[{start}..{}]", start + len),
                    Param::Tensor(leaf.clone()),
                ));
                m.shard = Some(Shard { start, leaf });
            }
        }
        let inner = make_inner(shards)?;
        Ok(ZeroRedundancyOptimizer { params, dp, buckets, inner })
    }

    /// The optimizer stepping this rank's ranges (its parameters are the shard leaves).
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The inner optimizer, mutably (e.g. to load its state).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The full parameters, with their names.
    pub fn params(&self) -> &[(String, Param)] {
        &self.params
    }

    /// The dp group.
    pub fn dp(&self) -> &ProcessGroup {
        &self.dp
    }

    /// The range of parameter `index`'s flattened (local) elements whose optimizer state
    /// this rank holds, as `(start, len)`; `None` when it holds none of it (or `index`
    /// is out of range).
    pub fn shard_range(&self, index: usize) -> Option<(usize, usize)> {
        self.buckets
            .iter()
            .flat_map(|b| &b.members)
            .find(|m| m.param == index)
            .and_then(|m| m.shard.as_ref().map(|s| (s.start, s.leaf.numel())))
    }

    /// This rank's shard leaf of parameter `index`: the flat tensor holding elements
    /// [`Self::shard_range`] of the flattened parameter that the inner optimizer steps,
    /// whose `.grad()` is the dp-averaged gradient of that range after
    /// [`Self::reduce_gradients`]. `None` where [`Self::shard_range`] is.
    pub fn shard_leaf(&self, index: usize) -> Option<Tensor> {
        self.buckets
            .iter()
            .flat_map(|b| &b.members)
            .find(|m| m.param == index)
            .and_then(|m| m.shard.as_ref().map(|s| s.leaf.clone()))
    }

    /// Moves the parameters' accumulated gradients into this rank's shard leaves:
    /// reduce-scatters (averages) each bucket's gradients over dp and adds this rank's
    /// range to the shard leaves' `.grad()`, then drops the full gradients (see the
    /// module docs). [`Optimizer::step`] and [`Optimizer::grads_for_clip`] call it; a second
    /// call with no backward in between communicates only the gradient mask.
    /// Collective over dp (and over tp for tensor-parallel parameters replicated there).
    pub fn reduce_gradients(&mut self) -> Result<()> {
        // Parameters the model no longer holds (an optimizer built before sharding).
        check_not_retired("ZeroRedundancyOptimizer", &self.params)?;
        if self.params.is_empty() {
            return Ok(());
        }
        let mut grads = Vec::with_capacity(self.params.len());
        for (_, p) in &self.params {
            grads.push(p.grad_local()?);
        }
        let local: Vec<f32> = grads.iter().map(|g| if g.is_some() { 1.0 } else { 0.0 }).collect();
        let n = local.len();
        let mask = self.dp.all_reduce(&Tensor::from_vec(local, [n])?, ReduceOp::Max)?;
        let mask: Vec<bool> = mask.to_vec::<f32>()?.into_iter().map(|v| v > 0.0).collect();
        for b in &self.buckets {
            if !b.members.iter().any(|m| mask[m.param]) {
                continue;
            }
            let mut pieces = Vec::with_capacity(b.members.len());
            for m in &b.members {
                let piece = match &grads[m.param] {
                    Some(g) if g.numel() == m.numel => {
                        no_grad(|| g.detach().reshape([m.numel])?.to_dtype(b.dtype))?
                    }
                    Some(g) => {
                        return Err(bad(format!(
                            "parameter {:?}: gradient of shape {:?} for {} elements",
                            self.params[m.param].0,
                            g.dims(),
                            m.numel
                        )))
                    }
                    None => Tensor::zeros([m.numel], b.dtype, b.device)?,
                };
                pieces.push(piece);
            }
            let flat = no_grad(|| Tensor::cat(&pieces, 0))?;
            drop(pieces);
            let mine = self.dp.reduce_scatter(&flat, 0, ReduceOp::Avg)?;
            drop(flat);
            for m in &b.members {
                let Some(s) = &m.shard else { continue };
                if !mask[m.param] {
                    continue;
                }
                let g = no_grad(|| -> tpar_tensor::Result<Tensor> {
                    let piece = mine.narrow(0, m.offset + s.start - b.start, s.leaf.numel())?;
                    match s.leaf.grad() {
                        Some(old) => old.add(&piece),
                        None => Ok(piece),
                    }
                })?;
                s.leaf.set_grad(Some(g));
            }
        }
        for (_, p) in &self.params {
            p.zero_grad();
        }
        Ok(())
    }
}

impl<O: Optimizer> Optimizer for ZeroRedundancyOptimizer<O> {
    /// Reduce-scatters the gradients, steps this rank's ranges with the inner optimizer,
    /// and all-gathers the updated ranges into every parameter (module docs).
    /// Collective over dp.
    fn step(&mut self) -> Result<()> {
        self.reduce_gradients()?;
        for b in &self.buckets {
            for m in &b.members {
                let Some(s) = &m.shard else { continue };
                let current = no_grad(|| {
                    self.params[m.param].1.trainable().detach().reshape([m.numel])?.narrow(
                        0,
                        s.start,
                        s.leaf.numel(),
                    )
                })?;
                s.leaf.copy_(&current)?;
            }
        }
        self.inner.step()?;
        for b in &self.buckets {
            let mine: Vec<Tensor> = b
                .members
                .iter()
                .filter_map(|m| m.shard.as_ref().map(|s| s.leaf.detach()))
                .collect();
            let local = if mine.is_empty() {
                Tensor::zeros([0], b.dtype, b.device)?
            } else {
                no_grad(|| Tensor::cat(&mine, 0))?
            };
            drop(mine);
            let full = self.dp.all_gather(&local, 0)?;
            if full.numel() != b.numel {
                return Err(bad(format!(
                    "all_gather of a {} bucket returned {} elements, expected {} (do all dp \
                     ranks pass the same parameters?)",
                    b.dtype,
                    full.numel(),
                    b.numel
                )));
            }
            for m in &b.members {
                let t = self.params[m.param].1.trainable();
                let v = no_grad(|| full.narrow(0, m.offset, m.numel)?.reshape(t.shape().clone()))?;
                t.copy_(&v)?;
            }
        }
        Ok(())
    }

    /// Drops the parameters' and the shard leaves' gradients.
    fn zero_grad(&self) {
        for (_, p) in &self.params {
            p.zero_grad();
        }
        self.inner.zero_grad();
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr);
    }

    /// This rank's share of the optimizer state (the inner optimizer's state).
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
    /// The gradients a step uses: reduces them first ([`Self::reduce_gradients`]), then
    /// lists this rank's shard leaves' gradients, one entry per parameter in bucket order
    /// (also where this rank holds none of it, so every rank names the same groups in the
    /// same order), each laid out as its parameter's gradient plus the dp group (the
    /// ranges split every bucket over dp). Clipping scales the shard leaves' gradients.
    fn grads_for_clip(&mut self) -> Result<Vec<ClipGrad>> {
        self.reduce_gradients()?;
        let mut out = Vec::with_capacity(self.params.len());
        for b in &self.buckets {
            for m in &b.members {
                let mut layout = self.params[m.param].1.grad_layout()?;
                if self.dp.size() > 1 {
                    layout.groups.push(self.dp.clone());
                }
                out.push(ClipGrad::of_leaf(m.shard.as_ref().map(|s| &s.leaf), layout));
            }
        }
        Ok(out)
    }
}
