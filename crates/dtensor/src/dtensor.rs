//! The `DTensor` type: a local shard plus its spec, with differentiable conversions.

use std::sync::Arc;

use tpar_mesh::DeviceMesh;
use tpar_placements::{fmt_placements, Placement, Plan, PlanKey, ReduceOp};
use tpar_tensor::autograd::{
    incoming_grad_replicated, record_replication_aware, set_input_grad_replicated,
};
use tpar_tensor::{no_grad, DType, Tensor};

use crate::mode::{self, ImplicitRedistribution};
use crate::redistribute::{
    adjoint_between, avg_factor, cached_plan, execute, grad_placements, replicated_tag, slice_full,
};
use crate::{DTensorError, DTensorSpec, Result};

/// A tensor distributed over a [`DeviceMesh`]: this rank's local shard and the spec
/// (mesh, one [`Placement`] per mesh dim, global shape).
///
/// Gradients follow the placements: the local gradient of a value sharded on a mesh
/// dim is the matching shard of the full gradient; on a dim where the value is
/// `Replicate`, each rank's local gradient is its *contribution* (`Partial(sum)`, the sum
/// over the dim is the full gradient); on a `Partial(sum)` dim it is the full gradient
/// (`Replicate`). Every redistribution's backward is the adjoint collective under this
/// rule: all_gather's adjoint is reduce_scatter, all_reduce's is all_reduce, a local
/// slice's is a zero-pad (no communication). [`DTensor::grad`] turns a parameter's local
/// gradient into a `DTensor` with the parameter's own placements, and
/// [`DTensor::backward`] seeds a replicated scalar loss so that contributions add up to 1.
///
/// A gradient may also be held in full by every rank of a 1-d mesh's group, as PyTorch's
/// `Replicate` gradients are, where the values it flows through are computed identically
/// on every rank (see `tpar_tensor::autograd::ReplicatedGrad`): a redistribution to
/// `Replicate` then takes it back without a reduction (`S(d) -> R`: a local slice;
/// `P -> R`: as is), and an `R -> S(d)` slice of such a value all-gathers its gradient
/// so that it does. Where it meets anything else it becomes a contribution again (no
/// communication), so the gradients are those of the rule above.
#[derive(Clone)]
pub struct DTensor {
    local: Tensor,
    spec: Arc<DTensorSpec>,
}

impl std::fmt::Debug for DTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DTensor({}, local {:?})", self.spec, self.local)
    }
}

fn spec_for(local: &Tensor, spec: DTensorSpec) -> Result<DTensor> {
    let (want, _) = spec.local_shape_and_offset()?;
    if local.dims() != want.as_slice() {
        return Err(DTensorError::LocalShape {
            op: "from_local",
            rank: spec.mesh().global_rank(),
            local: local.dims().to_vec(),
            expected: want,
            spec: spec.to_string(),
        });
    }
    Ok(DTensor { local: local.clone(), spec: Arc::new(spec) })
}

impl DTensor {
    /// Wraps this rank's shard as a `DTensor` (no copy; differentiable: the gradient
    /// flows to `local`).
    ///
    /// What is checked:
    /// - With `shape`, the global shape is taken as given (every rank must pass the same
    ///   one; this is not checked) and `local` is checked against it. No communication.
    /// - Without `shape`, when some placement is `Shard`, the global shape is computed with
    ///   one small all-gather of every rank's local shape and dtype (so uneven shards never
    ///   get an even-size guess), and that table is checked as in
    ///   [`DTensor::from_local_checked`] at no extra cost: a rank whose shard or dtype
    ///   differs from the majority is named in a [`DTensorError::Inconsistent`].
    /// - Without `shape` and without `Shard` (all `Replicate`/`Partial`), the local shape
    ///   *is* the global shape and nothing is exchanged: like PyTorch's
    ///   `from_local(run_check=False)`, the caller is trusted to pass the same shape and
    ///   dtype on every rank. Use [`DTensor::from_local_checked`] to verify it.
    pub fn from_local(
        local: &Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
        shape: Option<&[usize]>,
    ) -> Result<DTensor> {
        let shape = match shape {
            Some(s) => s.to_vec(),
            None if placements.iter().all(|p| !p.is_shard()) => local.dims().to_vec(),
            None => consensus(&gather_local_shapes(local, mesh)?, mesh, placements, local)?,
        };
        spec_for(local, DTensorSpec::new(mesh, placements, &shape)?)
    }

    /// As [`DTensor::from_local`] without a shape, and always checks (one small all-gather
    /// of every rank's local shape and dtype, whatever the placements) that all ranks'
    /// shards fit one global layout with one dtype. The layout is the one most ranks agree
    /// on, so every rank reports the same error, naming the rank that differs from the
    /// majority and what differs (shape and/or dtype).
    pub fn from_local_checked(
        local: &Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<DTensor> {
        let shape = consensus(&gather_local_shapes(local, mesh)?, mesh, placements, local)?;
        spec_for(local, DTensorSpec::new(mesh, placements, &shape)?)
    }

    /// The spec.
    pub fn spec(&self) -> &DTensorSpec {
        &self.spec
    }
    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        self.spec.mesh()
    }
    /// The placements (normalised).
    pub fn placements(&self) -> &[Placement] {
        self.spec.placements()
    }
    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        self.spec.shape()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.local.dtype()
    }
    /// This rank's shard (a handle to the same data; differentiable).
    pub fn to_local(&self) -> Tensor {
        self.local.clone()
    }
    /// This rank's shard, borrowed.
    pub fn local(&self) -> &Tensor {
        &self.local
    }

    /// Marks the local shard as a parameter (a leaf that accumulates gradients).
    pub fn requires_grad_(self, on: bool) -> DTensor {
        let local = self.local.requires_grad_(on);
        DTensor { local, spec: self.spec }
    }

    /// Whether the local shard requires a gradient.
    pub fn requires_grad(&self) -> bool {
        self.local.requires_grad()
    }

    /// The plan redistributing to `placements`, without running it.
    pub fn plan_to(&self, placements: &[Placement]) -> Result<Plan> {
        let dst = self.spec.with_placements(placements)?;
        cached_plan(PlanKey {
            mesh_shape: self.mesh().shape().to_vec(),
            global_shape: self.shape().to_vec(),
            elem_bytes: self.dtype().size_in_bytes(),
            src: self.placements().to_vec(),
            dst: dst.placements().to_vec(),
        })
    }

    /// The same global tensor laid out with `placements`: the planner's steps run with
    /// the mesh's collectives (e.g. `Shard(0) -> Replicate` is one all_gather,
    /// `Partial -> Shard(0)` one reduce_scatter, `Replicate -> Shard(0)` a local slice).
    /// Differentiable: the backward runs the adjoint steps (see the type's docs).
    pub fn redistribute(&self, placements: &[Placement]) -> Result<DTensor> {
        let plan = self.plan_to(placements)?;
        if plan.is_empty() {
            return Ok(self.clone());
        }
        let out = execute(&plan, &self.local, self.mesh())?;
        let spec = self.spec.with_placements(placements)?;
        let (mesh, shape) = (self.mesh().clone(), self.shape().to_vec());
        let (src, dst) = (self.placements().to_vec(), spec.placements().to_vec());
        // Replicated gradients (see the type's docs): on a 1-d mesh, a `Replicate` output
        // is replicated over the mesh's group in forward, and its gradient may come back
        // held in full.
        let tag = replicated_tag(&mesh);
        let all_rep = |ps: &[Placement]| ps.iter().all(|p| *p == Placement::Replicate);
        let out_group = tag.filter(|_| all_rep(&dst)).map(|t| t.group);
        // A `Replicate` input computed from values replicated over the group: its
        // gradient is made whole here, so the collectives upstream that made those
        // values replicated take their gradients back without a reduction.
        let whole_input =
            tag.filter(|t| all_rep(&src) && self.local.replicated_group() == Some(t.group));
        let out =
            record_replication_aware("redistribute", &[&self.local], out, out_group, move |g| {
                let op = "redistribute backward";
                let rep = vec![Placement::Replicate; src.len()];
                let incoming = incoming_grad_replicated();
                let full = incoming.filter(|t| Some(t.group) == out_group);
                let g = match (incoming, full) {
                    (Some(t), None) => t.demote(g.clone())?,
                    _ => g.clone(),
                };
                let from = if full.is_some() { rep.clone() } else { grad_placements(op, &dst)? };
                let to = match whole_input {
                    Some(t) => {
                        set_input_grad_replicated(0, t);
                        rep.clone()
                    }
                    None => grad_placements(op, &src)?,
                };
                Ok(vec![Some(adjoint_between(&g, &mesh, &shape, &from, &to, &src, &dst)?)])
            });
        Ok(DTensor { local: out, spec: Arc::new(spec) })
    }

    /// Redistribution an op inserts on its own: recorded on this thread's trace, or an
    /// error naming the op in strict mode (see [`crate::strict`]).
    pub fn redistribute_implicit(
        &self,
        op: &'static str,
        operand: &str,
        placements: &[Placement],
    ) -> Result<DTensor> {
        let to = self.spec.with_placements(placements)?;
        if to.placements() == self.placements() {
            return Ok(self.clone());
        }
        let (from, to_s) = (fmt_placements(self.placements()), fmt_placements(to.placements()));
        if mode::is_strict() {
            return Err(DTensorError::ImplicitRedistribution {
                op,
                what: operand.to_string(),
                from,
                to: to_s,
                spec: self.spec.to_string(),
            });
        }
        mode::record(ImplicitRedistribution {
            op,
            operand: operand.to_string(),
            from,
            to: to_s,
            shape: self.shape().to_vec(),
        });
        self.redistribute(placements)
    }

    /// The whole tensor on every rank (redistribute to all-`Replicate`, then the local).
    pub fn full_tensor(&self) -> Result<Tensor> {
        let rep = vec![Placement::Replicate; self.mesh().ndim()];
        Ok(self.redistribute(&rep)?.to_local())
    }

    /// Backpropagates from a one-element DTensor loss. On mesh dims where the loss is
    /// `Replicate`, only the rank at coordinate 0 seeds 1 (the others seed 0), so the
    /// contributions add up to exactly one gradient; on `Partial(sum)` dims every rank
    /// seeds 1 (and `1/k` on `Partial(avg)` dims).
    pub fn backward(&self) -> Result<()> {
        let seed = self.backward_seed()?;
        Ok(self.local.backward_with(&seed)?)
    }

    /// As [`backward`](Self::backward), but a `Replicate` loss on a 1-d mesh is seeded
    /// with 1 on every rank, tagged as a gradient held in full (see the type's docs and
    /// `tpar_tensor::autograd::ReplicatedGrad`): where the graph is replication-aware
    /// (the loss-parallel cross-entropy, a redistribution to `Replicate`, plain ops on
    /// values replicated over the mesh) the seed needs no reduction (the loss-parallel
    /// cross-entropy then skips the all_reduce of its scalar gradient); anywhere else the
    /// engine turns it into [`backward`](Self::backward)'s seed, so the gradients are the
    /// same. Other losses and meshes are seeded as by [`backward`](Self::backward).
    /// `loss_parallel::backward` and `Value::backward` use it.
    pub fn backward_full_seed(&self) -> Result<()> {
        let seed = self.backward_seed()?;
        match replicated_tag(self.mesh()) {
            Some(tag) if self.placements() == [Placement::Replicate] => {
                let ones = Tensor::full(seed.shape().clone(), 1.0, seed.dtype(), seed.device())?;
                Ok(self.local.backward_with_replicated(&ones, tag)?)
            }
            _ => Ok(self.local.backward_with(&seed)?),
        }
    }

    /// The gradient [`backward`](Self::backward) seeds this rank's local tensor with: ones
    /// on the rank that counts a `Replicate` loss (coordinate 0 of each replicated mesh
    /// dim) and zeros elsewhere, divided by the dim's size on `Partial(avg)` dims. A
    /// pipeline schedule uses it to run the backward itself (split, or scaled per
    /// micro-batch). A loss with more than one element, or `Partial(max | min)`, is an
    /// error.
    pub fn backward_seed(&self) -> Result<Tensor> {
        if self.local.numel() != 1 {
            return Err(DTensorError::InvalidArgument {
                op: "backward",
                what: format!("needs a one-element loss, got {}", self.spec),
            });
        }
        let mut seed = 1.0;
        for ((p, &k), &c) in
            self.placements().iter().zip(self.mesh().shape()).zip(self.mesh().coordinate())
        {
            match p {
                Placement::Replicate if c != 0 => seed = 0.0,
                Placement::Partial(ReduceOp::Avg) => seed /= k as f64,
                Placement::Partial(ReduceOp::Max | ReduceOp::Min) => {
                    return Err(DTensorError::NotDifferentiable {
                        op: "backward",
                        placement: p.to_string(),
                    })
                }
                _ => {}
            }
        }
        Ok(Tensor::full(self.local.shape().clone(), seed, self.dtype(), self.local.device())?)
    }

    /// The accumulated gradient of a parameter as a `DTensor` with the parameter's
    /// placements (contributions on `Replicate` dims are all-reduced; on `Partial(avg)`
    /// dims every rank's term is the full gradient, so the terms average to it). Collective: every
    /// rank of the mesh calls it. `None` when no gradient was accumulated on this rank.
    pub fn grad(&self) -> Result<Option<DTensor>> {
        let Some(g) = self.local.grad() else { return Ok(None) };
        let key = PlanKey {
            mesh_shape: self.mesh().shape().to_vec(),
            global_shape: self.shape().to_vec(),
            elem_bytes: g.dtype().size_in_bytes(),
            src: grad_placements("grad", self.placements())?,
            dst: self.placements().to_vec(),
        };
        let g = execute(&cached_plan(key)?, &g, self.mesh())?;
        // On a Partial(avg) dim the local gradient is that of the rank's own term
        // (dL/dV / k); the gradient DTensor's terms must average to dL/dV.
        let scale = avg_factor(self.placements(), self.mesh());
        let g = if scale == 1.0 { g } else { no_grad(|| g.mul_scalar(scale))? };
        Ok(Some(DTensor { local: g, spec: self.spec.clone() }))
    }
}

/// A full tensor (the same on every rank) laid out with `placements`: each rank keeps
/// its shard (no communication). `Partial(sum)` keeps the value at coordinate 0 and
/// zeros elsewhere. The result is a new leaf that requires a gradient when `t` does.
pub fn distribute_tensor(
    t: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
) -> Result<DTensor> {
    let spec = DTensorSpec::new(mesh, placements, t.dims())?;
    let local = slice_full(&t.detach(), &spec)?;
    let local = if local.same_storage(t) { no_grad(|| local.deep_clone())? } else { local };
    Ok(DTensor { local: local.requires_grad_(t.requires_grad()), spec: Arc::new(spec) })
}

/// As [`distribute_tensor`], with the full tensor taken from mesh rank `src` (an index
/// into `mesh.ranks()`) by one broadcast; other ranks' `t` only gives shape and dtype.
pub fn distribute_tensor_from(
    t: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
    src: usize,
) -> Result<DTensor> {
    let names: Vec<&str> = mesh.names().iter().map(|s| s.as_str()).collect();
    let all = mesh.flatten(&names, "all")?;
    let full = all.group(0)?.broadcast(t, src)?;
    let full = full.requires_grad_(t.requires_grad());
    distribute_tensor(&full, mesh, placements)
}

fn dtype_code(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        DType::I64 => 4,
    }
}

/// Every mesh rank's `[dtype, dims...]`, in row-major mesh order.
fn gather_local_shapes(local: &Tensor, mesh: &DeviceMesh) -> Result<Vec<Vec<i64>>> {
    let names: Vec<&str> = mesh.names().iter().map(|s| s.as_str()).collect();
    let all = mesh.flatten(&names, "all")?;
    let mut mine = vec![dtype_code(local.dtype()) as i64];
    mine.extend(local.dims().iter().map(|&d| d as i64));
    let n = mine.len();
    let row = Tensor::from_vec(mine, [1, n])?;
    let table = all.group(0)?.all_gather(&row, 0)?.to_vec::<i64>()?;
    Ok(table.chunks(n).map(|c| c.to_vec()).collect())
}

fn dtype_name(code: i64) -> String {
    [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64]
        .into_iter()
        .find(|d| dtype_code(*d) as i64 == code)
        .map_or_else(|| format!("dtype #{code}"), |d| d.name().to_string())
}

/// The global shape most ranks' `[dtype, dims...]` rows agree on under `placements`;
/// an error naming the lowest rank that differs from it (or from the majority dtype).
/// Every rank computes the same answer from the same table.
fn consensus(
    shapes: &[Vec<i64>],
    mesh: &DeviceMesh,
    placements: &[Placement],
    local: &Tensor,
) -> Result<Vec<usize>> {
    let op = "from_local";
    let ndim = local.rank();
    let ps = tpar_placements::normalize_placements(placements, ndim)?;
    let mesh_shape = mesh.shape();
    for (flat, s) in shapes.iter().enumerate() {
        if s.len() != ndim + 1 {
            return Err(DTensorError::InvalidArgument {
                op,
                what: format!(
                    "rank {} holds a {}-d shard, this rank a {ndim}-d one",
                    mesh.ranks()[flat],
                    s.len().saturating_sub(1)
                ),
            });
        }
    }
    let dims_of = |s: &Vec<i64>| -> Vec<usize> { s[1..].iter().map(|&d| d as usize).collect() };
    // The majority dtype (ties: the one of the lowest rank).
    let count = |code: i64| shapes.iter().filter(|s| s[0] == code).count();
    let dtype = shapes
        .iter()
        .map(|s| s[0])
        .max_by_key(|&c| (count(c), std::cmp::Reverse(shapes.iter().position(|s| s[0] == c))));
    let dtype = dtype.unwrap_or(dtype_code(local.dtype()) as i64);
    let coords: Vec<Vec<usize>> =
        (0..shapes.len()).map(|flat| tpar_mesh::unflatten(flat, mesh_shape)).collect();
    let local_at = |global: &[usize], flat: usize| -> Result<Vec<usize>> {
        Ok(tpar_placements::local_shape_and_offset(global, mesh_shape, &coords[flat], &ps)?.0)
    };
    // Each dim independently: the global size with which the fewest ranks disagree.
    let mut global: Vec<usize> = dims_of(&shapes[0]);
    for d in 0..ndim {
        let sharding: Vec<usize> =
            (0..ps.len()).filter(|&m| ps[m] == Placement::Shard(d as isize)).collect();
        let sizes: Vec<usize> = shapes.iter().map(|s| s[d + 1] as usize).collect();
        let mut candidates: Vec<usize> = sizes.clone();
        if !sharding.is_empty() {
            let k: usize = sharding.iter().map(|&m| mesh_shape[m]).product();
            let mut distinct = sizes.clone();
            distinct.push(0);
            distinct.sort_unstable();
            distinct.dedup();
            // The sum over each rank's shard group, from every rank's point of view ...
            let mut totals: Vec<usize> = coords
                .iter()
                .map(|me| {
                    (0..shapes.len())
                        .filter(|&f| {
                            (0..ps.len()).all(|m| sharding.contains(&m) || coords[f][m] == me[m])
                        })
                        .map(|f| sizes[f])
                        .sum()
                })
                .collect();
            totals.sort_unstable();
            totals.dedup();
            // ... and with one shard assumed wrong, the right one being any size seen.
            for &total in &totals {
                for &s in &distinct {
                    for &x in &distinct {
                        if let Some(t) = total.checked_sub(s) {
                            candidates.push(t + x);
                        }
                    }
                }
            }
            // Every size whose largest (first) shard is one seen.
            if k.saturating_mul(distinct.len()) <= 1 << 16 {
                for &c in &distinct {
                    candidates.extend(c.saturating_sub(1) * k + 1..=c * k);
                }
            }
        }
        candidates.sort_unstable();
        candidates.dedup();
        // Ties (no majority) go to the size closest to what rank 0 sees: its own size, or
        // the sum of its shard group's sizes.
        let reference: usize = (0..shapes.len())
            .filter(|&f| {
                (0..ps.len()).all(|m| sharding.contains(&m) || coords[f][m] == coords[0][m])
            })
            .map(|f| sizes[f])
            .sum();
        let reference = if sharding.is_empty() { sizes[0] } else { reference };
        let mut best: Option<(usize, usize, usize)> = None;
        for &n in &candidates {
            let mut g = global.clone();
            g[d] = n;
            let mut wrong = 0;
            for (flat, &size) in sizes.iter().enumerate() {
                if local_at(&g, flat)?[d] != size {
                    wrong += 1;
                }
            }
            let key = (wrong, n.abs_diff(reference), n);
            if best.is_none_or(|b| key < b) {
                best = Some(key);
            }
        }
        global[d] = best.map_or(global[d], |(_, _, n)| n);
    }
    let mut odd = Vec::new();
    for (flat, s) in shapes.iter().enumerate() {
        let want = local_at(&global, flat)?;
        if dims_of(s) != want || s[0] != dtype {
            odd.push((flat, want));
        }
    }
    let Some((flat, want)) = odd.first() else { return Ok(global) };
    let s = &shapes[*flat];
    let mut what = Vec::new();
    if dims_of(s) != *want {
        what.push(format!(
            "its local shard has shape {:?}, but {want:?} is needed there",
            dims_of(s)
        ));
    }
    if s[0] != dtype {
        what.push(format!("its dtype is {}, the others' {}", dtype_name(s[0]), dtype_name(dtype)));
    }
    let mut what = format!(
        "{} (the majority of ranks hold a {} tensor of global shape {global:?} placed {} on mesh {:?})",
        what.join(", and "),
        dtype_name(dtype),
        fmt_placements(&ps),
        mesh_shape
    );
    if odd.len() > 1 {
        let others: Vec<usize> = odd[1..].iter().map(|(f, _)| mesh.ranks()[*f]).collect();
        what.push_str(&format!("; rank(s) {others:?} differ too"));
    }
    Err(DTensorError::Inconsistent { op, rank: mesh.ranks()[*flat], what })
}
