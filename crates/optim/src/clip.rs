//! Gradient clipping: one [`clip_grad_norm_`], as `torch.nn.utils.clip_grad_norm_`, for
//! plain, DTensor, FSDP and ZeRO-1 gradients and over pipeline stages.
//!
//! What it clips is a [`GradSource`]: a parameter list (`&[Param]`, `&Vec<Param>`), or an
//! optimizer (`&mut AdamW`, `&mut ZeroRedundancyOptimizer<_>`, `&mut dyn Optimizer`),
//! whose [`Optimizer::grads_for_clip`] lists the gradients its next step uses: a
//! parameter's reduced gradient, or for ZeRO-1 the dp-averaged gradient of this rank's
//! ranges after its reduce-scatter. Each comes with the groups over which the ranks'
//! shares add up to the whole gradient ([`GradLayout`]), so the norm is the norm of the
//! unsharded gradients whatever holds them.

use std::collections::HashMap;

use tpar_collectives::{ProcessGroup, ReduceOp};
use tpar_nn::{GradLayout, NnError, Param, Result};
use tpar_tensor::{no_grad, with_float_type, DType, Device, Tensor};

use crate::{config_err, on_device, Optimizer};

/// The options of [`clip_grad_norm_`], PyTorch's keyword arguments plus the pipeline group.
/// Build with struct syntax (`ClipOptions { norm_type: f64::INFINITY, ..Default::default() }`)
/// or the builder methods (`ClipOptions::default().pp(&pp_group)`).
#[derive(Clone, Copy, Debug)]
pub struct ClipOptions<'a> {
    /// The `p` of the p-norm (default 2.0): any finite `p` (`(sum |g|^p)^(1/p)`, with
    /// `p = 0` the count of non-zero elements, as `torch.linalg.vector_norm`),
    /// `f64::INFINITY` (the largest `|g|`) or `f64::NEG_INFINITY` (the smallest).
    pub norm_type: f64,
    /// PyTorch's `error_if_nonfinite`: a NaN or infinite total norm is
    /// [`NnError::NonFinite`], with the gradients left unscaled (default false: the norm
    /// is returned; an infinite norm zeroes the gradients, a NaN one leaves them).
    pub error_if_nonfinite: bool,
    /// For pipeline stages: the norm is over every stage's gradients, the stages'
    /// shares being combined over this group as well (one more scalar all_reduce).
    /// Every rank of the group calls it.
    pub pp: Option<&'a ProcessGroup>,
}

impl Default for ClipOptions<'_> {
    fn default() -> Self {
        ClipOptions { norm_type: 2.0, error_if_nonfinite: false, pp: None }
    }
}

impl<'a> ClipOptions<'a> {
    /// With the p-norm `norm_type` (see [`ClipOptions::norm_type`]).
    pub fn norm_type(mut self, norm_type: f64) -> Self {
        self.norm_type = norm_type;
        self
    }

    /// With `error_if_nonfinite` (see [`ClipOptions::error_if_nonfinite`]).
    pub fn error_if_nonfinite(mut self, error_if_nonfinite: bool) -> Self {
        self.error_if_nonfinite = error_if_nonfinite;
        self
    }

    /// Over the pipeline group `pp` too (see [`ClipOptions::pp`]).
    pub fn pp(mut self, pp: &'a ProcessGroup) -> Self {
        self.pp = Some(pp);
        self
    }
}

/// Where a clipped gradient goes back to.
#[derive(Clone, Debug)]
enum Target {
    /// A parameter's leaf, marked reduced ([`Param::set_reduced_grad`]).
    Param(Param),
    /// A leaf's `.grad()` as it is (ZeRO-1's shard leaves).
    Leaf(Tensor),
}

/// One gradient as [`clip_grad_norm_`] measures and scales it: a tensor (this rank's
/// share; none where this rank holds nothing of it), the [`GradLayout`] saying over
/// which groups the shares add up to the whole and whether this rank's share counts,
/// and where the scaled gradient goes. Every rank lists the same gradients in the same
/// order (the groups are all-reduced by position).
#[derive(Clone, Debug)]
pub struct ClipGrad {
    grad: Option<Tensor>,
    layout: GradLayout,
    target: Option<Target>,
}

impl ClipGrad {
    /// `p`'s reduced gradient ([`Param::reduce_grads_in_place`]: collective the first
    /// time) with its [`Param::grad_layout`]; `None` when it has no gradient.
    pub fn of_param(p: &Param) -> Result<Option<ClipGrad>> {
        let Some(g) = p.reduce_grads_in_place()? else { return Ok(None) };
        let layout = p.grad_layout()?;
        Ok(Some(ClipGrad { grad: Some(g), layout, target: Some(Target::Param(p.clone())) }))
    }

    /// The gradient held in `leaf.grad()` (none when `leaf` is `None` or has no
    /// gradient), laid out as `layout` says; clipping writes the scaled gradient back
    /// with `set_grad`. ZeRO-1 lists its shard leaves so.
    pub fn of_leaf(leaf: Option<&Tensor>, layout: GradLayout) -> ClipGrad {
        ClipGrad {
            grad: leaf.and_then(|l| l.grad()),
            layout,
            target: leaf.map(|l| Target::Leaf(l.clone())),
        }
    }

    /// The gradient (this rank's share), if any.
    pub fn grad(&self) -> Option<&Tensor> {
        self.grad.as_ref()
    }

    /// Its layout.
    pub fn layout(&self) -> &GradLayout {
        &self.layout
    }

    fn set(&self, g: Tensor) {
        match &self.target {
            Some(Target::Param(p)) => p.set_reduced_grad(Some(g)),
            Some(Target::Leaf(l)) => l.set_grad(Some(g)),
            None => {}
        }
    }
}

/// The reduced gradients of `params` that have one, in order (collective: see
/// [`ClipGrad::of_param`]).
pub fn param_grads<'p>(params: impl IntoIterator<Item = &'p Param>) -> Result<Vec<ClipGrad>> {
    let mut out = Vec::new();
    for p in params {
        out.extend(ClipGrad::of_param(p)?);
    }
    Ok(out)
}

/// What [`clip_grad_norm_`] clips: a parameter list, or an optimizer (the gradients its
/// next step uses, [`Optimizer::grads_for_clip`]).
pub trait GradSource {
    /// The gradients, reduced (collective: every rank calls it).
    fn clip_grads(self) -> Result<Vec<ClipGrad>>;
}

impl GradSource for &[Param] {
    fn clip_grads(self) -> Result<Vec<ClipGrad>> {
        param_grads(self)
    }
}

impl GradSource for &Vec<Param> {
    fn clip_grads(self) -> Result<Vec<ClipGrad>> {
        param_grads(self)
    }
}

impl<const N: usize> GradSource for &[Param; N] {
    fn clip_grads(self) -> Result<Vec<ClipGrad>> {
        param_grads(self)
    }
}

impl<O: Optimizer + ?Sized> GradSource for &mut O {
    fn clip_grads(self) -> Result<Vec<ClipGrad>> {
        self.grads_for_clip()
    }
}

/// How per-gradient values combine across gradients and ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Agg {
    Sum,
    Max,
    Min,
}

impl Agg {
    fn identity(self) -> f64 {
        match self {
            Agg::Sum | Agg::Max => 0.0,
            Agg::Min => f64::INFINITY,
        }
    }

    fn op(self) -> ReduceOp {
        match self {
            Agg::Sum => ReduceOp::Sum,
            Agg::Max => ReduceOp::Max,
            Agg::Min => ReduceOp::Min,
        }
    }

    /// `a` combined with `b` (NaN wins for max and min, as torch's norms propagate it).
    fn combine(self, a: f64, b: f64) -> f64 {
        match self {
            Agg::Sum => a + b,
            _ if a.is_nan() || b.is_nan() => f64::NAN,
            Agg::Max => a.max(b),
            Agg::Min => a.min(b),
        }
    }
}

/// The norm a `norm_type` asks for.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Norm {
    /// p = 2 (sums of squares; on CUDA devices by the fused kernels).
    L2,
    /// Any other finite non-zero p.
    P(f64),
    /// p = 0: non-zero elements.
    Count,
    /// p = inf.
    Inf,
    /// p = -inf.
    NegInf,
}

impl Norm {
    fn of(p: f64) -> Result<Norm> {
        Ok(match p {
            _ if p.is_nan() => {
                return Err(config_err("clip_grad_norm_: norm_type is NaN".to_string()))
            }
            2.0 => Norm::L2,
            0.0 => Norm::Count,
            f64::INFINITY => Norm::Inf,
            f64::NEG_INFINITY => Norm::NegInf,
            p => Norm::P(p),
        })
    }

    fn agg(self) -> Agg {
        match self {
            Norm::L2 | Norm::P(_) | Norm::Count => Agg::Sum,
            Norm::Inf => Agg::Max,
            Norm::NegInf => Agg::Min,
        }
    }

    /// This gradient's share of the aggregate, in f64 on the host.
    fn local(self, g: &Tensor) -> Result<f64> {
        if self == Norm::L2 {
            return sum_sq(g);
        }
        let v = g.to_vec_f64()?;
        let agg = self.agg();
        Ok(match self {
            Norm::P(p) => v.iter().map(|x| x.abs().powf(p)).sum(),
            Norm::Count => v.iter().filter(|x| **x != 0.0).count() as f64,
            _ => v.iter().fold(agg.identity(), |a, x| agg.combine(a, x.abs())),
        })
    }

    /// The norm from the aggregate.
    fn finish(self, total: f64) -> f64 {
        match self {
            Norm::L2 => total.sqrt(),
            Norm::P(p) => total.powf(1.0 / p),
            Norm::Count | Norm::Inf | Norm::NegInf => total,
        }
    }
}

/// Sum of squares of a float tensor's elements, accumulated in f64.
fn sum_sq(t: &Tensor) -> Result<f64> {
    Ok(with_float_type!(t.dtype(), "clip_grad_norm_", |T| {
        t.with_data::<T, _>(|s| {
            s.iter().map(|&x| tpar_tensor::Element::to_f64(x).powi(2)).sum::<f64>()
        })
    })?)
}

/// The global sum of per-rank partial values: `parts[i] = (groups, value)` is this rank's
/// share of a quantity whose total is the sum of `value` over every member of every group
/// in `groups` (orthogonal groups that together hold all its elements, as
/// [`Param::grad_layout`] gives them; no groups means the value is already global).
///
/// Parts are keyed by their groups' ranks in first-seen order (so every rank must pass
/// the same groups in the same order), and each distinct group is all-reduced once,
/// carrying one slot per part spanning it: for parts on one mesh that is one scalar-vector
/// all_reduce per mesh dim of size > 1. Collective over every group named.
pub fn sum_over_groups(parts: &[(Vec<ProcessGroup>, f64)]) -> Result<f64> {
    reduce_over_groups(parts, Agg::Sum)
}

/// [`sum_over_groups`] with `agg` in place of the sum.
fn reduce_over_groups(parts: &[(Vec<ProcessGroup>, f64)], agg: Agg) -> Result<f64> {
    let (layouts, slot_of) = layout_slots(parts.iter().map(|(g, _)| g.as_slice()));
    let mut sums = vec![agg.identity(); layouts.len()];
    let mut local_only = agg.identity();
    for ((_, v), slot) in parts.iter().zip(&slot_of) {
        match slot {
            Some(j) => sums[*j] = agg.combine(sums[*j], *v),
            None => local_only = agg.combine(local_only, *v),
        }
    }
    for (group, slots) in group_spans(&layouts) {
        let vals: Vec<f64> = slots.iter().map(|&j| sums[j]).collect();
        let n = vals.len();
        let reduced = group.all_reduce(&Tensor::from_vec(vals, [n])?, agg.op())?;
        for (&j, v) in slots.iter().zip(reduced.to_vec::<f64>()?) {
            sums[j] = v;
        }
    }
    Ok(match agg {
        Agg::Sum => local_only + sums.iter().sum::<f64>(),
        _ => sums.iter().fold(local_only, |a, &b| agg.combine(a, b)),
    })
}

/// The distinct layouts among `parts` (by their groups' ranks, in first-seen order) and
/// each part's slot among them (`None` for a part with no groups: already global).
fn layout_slots<'a>(
    parts: impl Iterator<Item = &'a [ProcessGroup]>,
) -> (Vec<&'a [ProcessGroup]>, Vec<Option<usize>>) {
    let mut layouts: Vec<&[ProcessGroup]> = Vec::new();
    let mut keys: HashMap<Vec<Vec<usize>>, usize> = HashMap::new();
    let slot_of = parts
        .map(|groups| {
            if groups.is_empty() {
                return None;
            }
            let key: Vec<Vec<usize>> = groups.iter().map(|g| g.ranks().to_vec()).collect();
            Some(*keys.entry(key).or_insert_with(|| {
                layouts.push(groups);
                layouts.len() - 1
            }))
        })
        .collect();
    (layouts, slot_of)
}

/// Each distinct group of `layouts` (first-seen order) with the layouts spanning it: one
/// all_reduce per group carries the slots of all of them.
fn group_spans<'a>(layouts: &[&'a [ProcessGroup]]) -> Vec<(&'a ProcessGroup, Vec<usize>)> {
    let mut out: Vec<(&ProcessGroup, Vec<usize>)> = Vec::new();
    for group in layouts.iter().flat_map(|l| l.iter()) {
        if out.iter().any(|(g, _)| g.ranks() == group.ranks()) {
            continue;
        }
        let spanning = (0..layouts.len())
            .filter(|&j| layouts[j].iter().any(|h| h.ranks() == group.ranks()))
            .collect();
        out.push((group, spanning));
    }
    out
}

/// Clips gradients by their total norm, as `torch.nn.utils.clip_grad_norm_`: computes
/// the p-norm of all of `grads`' gradients together (`opts.norm_type`, default 2) and,
/// when `max_norm / (norm + 1e-6)` is below 1, scales every gradient by it, in place (as
/// torch's: every handle on a gradient, `.grad()` taken before the call included, sees
/// the clipped values, and no second set of gradients is allocated). Returns the
/// norm before clipping as a 0-dim tensor (0 when there is no gradient): an f64 host
/// tensor for gradients on the host, an f32 tensor on the gradients' CUDA device
/// otherwise.
///
/// `grads` is a parameter list (`&params`: the PyTorch form) or an optimizer
/// (`&mut opt`, `opt.as_mut()` for a `Box<dyn Optimizer>`: the gradients its next step
/// uses). An optimizer is the one form that also serves ZeRO-1, whose gradients live in
/// the ranks' ranges after its reduce-scatter
/// ([`ZeroRedundancyOptimizer::grads_for_clip`](crate::ZeroRedundancyOptimizer)); for
/// the others both forms are the same.
///
/// **Sharded gradients.** Each distinct element of each gradient counts once: on mesh
/// dims where a parameter is sharded (including FSDP's dp dim and ZeRO-1's ranges) every
/// rank's share counts; on dims where it is `Replicate` (or `Partial`, whose gradient is
/// replicated) only the rank at coordinate 0 counts. The local shares (sums of `|g|^p`,
/// or maxima for the inf-norm) are all-reduced once per process group that the
/// gradients' layouts span (for parameters on one mesh: one scalar all_reduce per mesh
/// dim of size > 1), with one slot per distinct layout, so parameters on different
/// meshes are reduced correctly; with `opts.pp`, once more over the pipeline group.
/// Collective: every rank of every group calls it, with the same gradient list.
///
/// **Gradients are reduced here, once.** Each parameter's gradient is first brought to
/// its reduced form ([`Param::reduce_grads_in_place`]), so that afterwards the leaves'
/// `.grad()` hold the *reduced* (and clipped) gradients, marked so that
/// [`Param::grad_local`], [`Param::grad`] and the optimizers use them as they are. Call
/// it after the last backward of a step.
///
/// **Non-finite norms.** By default a non-finite norm is returned as it is: an infinite
/// norm zeroes the gradients (as torch's), a NaN norm leaves them unscaled; a trainer
/// should skip such a step. With `opts.error_if_nonfinite` it is
/// [`NnError::NonFinite`] instead, the gradients left unscaled.
///
/// **Devices.** With the 2-norm and gradients on a CUDA device, the per-gradient sums of
/// squares, their all_reduces, the square root and the scaling by the coefficient
/// `min(1, max_norm / (norm + 1e-6))` all stay on the device (one launch per 32
/// gradients of a dtype): nothing is read back unless `error_if_nonfinite` asks to check
/// the norm, or the gradients are split over the host and devices. Other norm types
/// read the gradients back to compute their shares.
///
/// An invalid `max_norm` (negative or NaN) or `norm_type` (NaN) is
/// [`NnError::Config`].
pub fn clip_grad_norm_(
    grads: impl GradSource,
    max_norm: f64,
    opts: &ClipOptions<'_>,
) -> Result<Tensor> {
    // An infinite max_norm is legal (the norm without clipping), as in torch.
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(config_err(format!("clip_grad_norm_: invalid max_norm {max_norm}")));
    }
    let norm = Norm::of(opts.norm_type)?;
    let entries = grads.clip_grads()?;
    let total = clip(&entries, max_norm, norm, opts)?;
    if opts.error_if_nonfinite {
        nonfinite_is_error(&total)?;
    }
    Ok(total)
}

fn nonfinite_is_error(total: &Tensor) -> Result<()> {
    let norm = total.item()?;
    if norm.is_finite() {
        return Ok(());
    }
    Err(NnError::NonFinite {
        what: "clip_grad_norm: the total norm of the gradients (some gradient holds NaN or inf; \
               the gradients were left unscaled)"
            .into(),
        value: norm,
    })
}

/// The total norm of `entries`' gradients, scaling them unless the norm is non-finite
/// and `opts.error_if_nonfinite`.
fn clip(entries: &[ClipGrad], max_norm: f64, norm: Norm, opts: &ClipOptions<'_>) -> Result<Tensor> {
    let counted = |e: &ClipGrad| e.layout.counts && e.grad.is_some();
    if norm == Norm::L2 && entries.iter().any(|e| counted(e) && on_device(e.grad.as_ref().unwrap()))
    {
        return clip_on_device(entries, max_norm, opts);
    }
    let agg = norm.agg();
    let mut parts: Vec<(Vec<ProcessGroup>, f64)> = Vec::with_capacity(entries.len());
    let mut device = None;
    for e in entries {
        let v = match &e.grad {
            Some(g) if e.layout.counts => norm.local(g)?,
            _ => agg.identity(),
        };
        if let Some(g) = &e.grad {
            if g.device() != Device::Cpu && device.is_none() {
                device = Some(g.device());
            }
        }
        parts.push((e.layout.groups.clone(), v));
    }
    let mut total = reduce_over_groups(&parts, agg)?;
    if let Some(pp) = opts.pp {
        let t = Tensor::scalar(total, DType::F64);
        total = pp.all_reduce(&t, agg.op())?.item()?;
    }
    let total = norm.finish(total);
    let out = match device {
        Some(d) => Tensor::scalar(total, DType::F32).to_device(d)?,
        None => Tensor::scalar(total, DType::F64),
    };
    if opts.error_if_nonfinite && !total.is_finite() {
        return Ok(out);
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        let grads: Vec<(&ClipGrad, &Tensor)> =
            entries.iter().filter_map(|e| e.grad.as_ref().map(|g| (e, g))).collect();
        scale_in_place(&grads, |g| no_grad(|| g.mul_scalar(coef)))?;
    }
    Ok(out)
}

/// Scales `grads` in place, as torch's `clip_grad_norm_` does with `mul_`: `scaled`
/// gives one gradient's new values, which replace its data for every handle on it
/// (`Tensor::fill_storage_`: moved, not copied), so only one gradient's worth is ever
/// held twice. A storage shared by several gradients (two parameters given one gradient
/// tensor by the backward, as `p1 + p2` does) is scaled once. Each gradient is handed
/// back to its parameter or leaf.
fn scale_in_place(
    grads: &[(&ClipGrad, &Tensor)],
    scaled: impl Fn(&Tensor) -> tpar_tensor::Result<Tensor>,
) -> Result<()> {
    for g in distinct_storages(grads) {
        g.fill_storage_(scaled(g)?)?;
    }
    for &(e, g) in grads {
        e.set(g.clone());
    }
    Ok(())
}

/// `grads`' tensors with one per storage (the first of each), for an in-place update
/// that must touch each storage once ([`scale_in_place`]).
fn distinct_storages<'a>(grads: &[(&ClipGrad, &'a Tensor)]) -> Vec<&'a Tensor> {
    let mut out: Vec<&Tensor> = Vec::with_capacity(grads.len());
    for &(_, g) in grads {
        if !out.iter().any(|h| h.same_storage(g)) {
            out.push(g);
        }
    }
    out
}

/// The device half of [`clip`] for the 2-norm: the per-gradient sums of squares of the
/// counted gradients on a CUDA device ([`Tensor::sum_squares_each`]) and the host sums
/// of the others are folded into one f32 slot per distinct layout on the device (a 0/1
/// matrix product), each distinct group all-reduces the slots spanning it as
/// [`sum_over_groups`] does, and the norm and the clipping coefficient stay on the
/// device.
fn clip_on_device(entries: &[ClipGrad], max_norm: f64, opts: &ClipOptions<'_>) -> Result<Tensor> {
    // Host parts filled in, device ones 0; counted device gradients with their index.
    let mut parts: Vec<(Vec<ProcessGroup>, f64)> = Vec::with_capacity(entries.len());
    let mut on_devices: Vec<(usize, Tensor)> = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let sq = match &e.grad {
            Some(g) if e.layout.counts && on_device(g) => {
                on_devices.push((i, g.clone()));
                0.0
            }
            Some(g) if e.layout.counts => sum_sq(g)?,
            _ => 0.0,
        };
        parts.push((e.layout.groups.clone(), sq));
    }
    let device = on_devices[0].1.device();
    // Gradients on another device than the first: their sums move to it.
    let mut sums: Vec<Tensor> = Vec::new();
    let mut order: Vec<usize> = Vec::new();
    let mut devices: Vec<Device> = Vec::new();
    for (_, g) in &on_devices {
        if !devices.contains(&g.device()) {
            devices.push(g.device());
        }
    }
    for d in devices {
        let (idx, ts): (Vec<usize>, Vec<&Tensor>) =
            on_devices.iter().filter(|(_, g)| g.device() == d).map(|(i, g)| (*i, g)).unzip();
        sums.push(Tensor::sum_squares_each(&ts)?.to_device(device)?);
        order.extend(idx);
    }
    let sq = if sums.len() == 1 { sums.remove(0) } else { Tensor::cat(&sums, 0)? };
    // Slots: one per distinct layout (by its groups' ranks, first-seen order), then one
    // for the parts that are already global.
    let (layouts, slot_of) = layout_slots(parts.iter().map(|(g, _)| g.as_slice()));
    let n_slots = layouts.len() + 1;
    let slot = |i: usize| slot_of[i].unwrap_or(layouts.len());
    let mut fold = vec![0f32; n_slots * order.len()];
    for (k, &i) in order.iter().enumerate() {
        fold[slot(i) * order.len() + k] = 1.0;
    }
    let mut host = vec![0f32; n_slots];
    for (i, (_, v)) in parts.iter().enumerate() {
        host[slot(i)] += *v as f32;
    }
    let fold = device_constant(fold, &[n_slots, order.len()], device)?;
    let host = device_constant(host, &[n_slots], device)?;
    // [n_slots, k] @ [k, 1] -> [n_slots]
    let slots = fold.matmul(&sq.reshape([order.len(), 1])?)?.reshape([n_slots])?.add(&host)?;
    let mut slots: Vec<Tensor> =
        (0..n_slots).map(|j| slots.narrow(0, j, 1)).collect::<std::result::Result<_, _>>()?;
    // One all_reduce per distinct group, carrying the slots of every layout spanning it.
    for (group, spanning) in group_spans(&layouts) {
        let vals: Vec<Tensor> = spanning.iter().map(|&j| slots[j].clone()).collect();
        let reduced = group.all_reduce(&Tensor::cat(&vals, 0)?, ReduceOp::Sum)?;
        for (k, &j) in spanning.iter().enumerate() {
            slots[j] = reduced.narrow(0, k, 1)?;
        }
    }
    let mut total_sq = Tensor::cat(&slots, 0)?.sum_all()?;
    if let Some(pp) = opts.pp {
        total_sq = pp.all_reduce(&total_sq, ReduceOp::Sum)?;
    }
    let total = total_sq.sqrt()?;
    if opts.error_if_nonfinite && !total.item()?.is_finite() {
        return Ok(total);
    }
    let grads: Vec<(&ClipGrad, &Tensor)> =
        entries.iter().filter_map(|e| e.grad.as_ref().map(|g| (e, g))).collect();
    // min(1, max_norm / (norm + 1e-6)), on the device: 1 for a NaN norm (fmin), 0 for an
    // infinite one.
    let one = Tensor::ones([], DType::F32, device)?;
    let coef = no_grad(|| total.add_scalar(1e-6)?.recip()?.mul_scalar(max_norm)?.minimum(&one))?;
    let host_coef =
        if grads.iter().any(|(_, g)| g.device() != device) { Some(coef.item()?) } else { None };
    if host_coef.is_none() && grads.iter().all(|(_, g)| on_device(g)) {
        // Every gradient scaled in place by the device coefficient, one launch per 32.
        Tensor::scale_each_(&distinct_storages(&grads), &coef)?;
        for (e, g) in grads {
            e.set(g.clone());
        }
        return Ok(total);
    }
    match host_coef {
        Some(c) if c < 1.0 => scale_in_place(&grads, |g| no_grad(|| g.mul_scalar(c)))?,
        Some(_) => {}
        None => scale_in_place(&grads, |g| no_grad(|| g.mul(&coef.to_dtype(g.dtype())?)))?,
    }
    Ok(total)
}

/// Host values on `device`, uploaded once per distinct (values, shape, device) on this
/// thread and shared after: the fold matrix and the host parts repeat from step to step,
/// so a step needs no host-to-device copy for them (and can be captured into a CUDA
/// graph, which refuses one). Values that change every step (host parts of gradients
/// on the host) are uploaded each time; the cache keeps the last 64.
fn device_constant(values: Vec<f32>, dims: &[usize], device: Device) -> Result<Tensor> {
    type Key = (Vec<u32>, Vec<usize>, Device);
    thread_local! {
        static CONSTANTS: std::cell::RefCell<Vec<(Key, Tensor)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    let key: Key = (values.iter().map(|v| v.to_bits()).collect(), dims.to_vec(), device);
    if let Some(t) =
        CONSTANTS.with(|c| c.borrow().iter().find(|(k, _)| *k == key).map(|e| e.1.clone()))
    {
        return Ok(t);
    }
    let t = Tensor::from_vec(values, dims)?.to_device(device)?;
    CONSTANTS.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= 64 {
            c.remove(0);
        }
        c.push((key, t.clone()));
    });
    Ok(t)
}
