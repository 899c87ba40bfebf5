//! Executing the planner's steps with the mesh's collectives, and their adjoints.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tpar_mesh::DeviceMesh;
use tpar_placements::{
    chunk_range, local_shape_and_offset, Placement, Plan, PlanKey, ReduceOp, StepKind,
};
use tpar_tensor::autograd::ReplicatedGrad;
use tpar_tensor::{no_grad, Tensor};

use crate::{DTensorError, Result};

/// Plans kept by [`cached_plan`]: past this many the cache starts again, so a program
/// whose shapes keep changing (sequences of every length) holds a bounded cache.
const PLAN_CACHE_LIMIT: usize = 4096;

fn plan_cache() -> std::sync::MutexGuard<'static, HashMap<PlanKey, Plan>> {
    static CACHE: OnceLock<Mutex<HashMap<PlanKey, Plan>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    cache.lock().unwrap_or_else(|p| p.into_inner())
}

/// The plan for `key`, computed once per process and cached (plans are pure values; the
/// cache keeps at most 4096).
pub fn cached_plan(key: PlanKey) -> Result<Plan> {
    if let Some(p) = plan_cache().get(&key) {
        return Ok(p.clone());
    }
    let plan = key.plan()?;
    let mut cache = plan_cache();
    if cache.len() >= PLAN_CACHE_LIMIT {
        cache.clear();
    }
    cache.insert(key, plan.clone());
    Ok(plan)
}

/// Runs `plan` on this rank's local tensor: each step's collective over the ranks along
/// its mesh dim. Not recorded by autograd.
pub fn execute(plan: &Plan, local: &Tensor, mesh: &DeviceMesh) -> Result<Tensor> {
    no_grad(|| {
        let mut t = local.clone();
        for step in &plan.steps {
            let g = mesh.group(step.mesh_dim)?;
            t = match step.kind {
                StepKind::AllGather { tensor_dim } => g.all_gather(&t, tensor_dim)?,
                StepKind::AllReduce { op } => g.all_reduce(&t, op)?,
                StepKind::ReduceScatter { op, tensor_dim } => {
                    g.reduce_scatter(&t, tensor_dim, op)?
                }
                StepKind::AllToAll { from_dim, to_dim } => g.all_to_all(&t, to_dim, from_dim)?,
                StepKind::LocalSlice { tensor_dim } => {
                    let (start, len) = chunk_range(t.dims()[tensor_dim], g.size(), g.rank());
                    t.narrow(tensor_dim as isize, start, len)?
                }
                StepKind::ZeroPad { tensor_dim } => {
                    let (after, _) = local_shape_and_offset(
                        &plan.global_shape,
                        mesh.shape(),
                        mesh.coordinate(),
                        &step.after,
                    )?;
                    let full = after[tensor_dim];
                    let (start, len) = chunk_range(full, g.size(), g.rank());
                    zero_pad(&t, tensor_dim, start, full - start - len)?
                }
                StepKind::Partialize { op } => {
                    if op == ReduceOp::Sum && g.rank() != 0 {
                        t.zeros_like()?
                    } else {
                        t
                    }
                }
            };
        }
        Ok(t)
    })
}

/// `t` with `before` zeros in front of it and `after` zeros behind it along `dim`.
fn zero_pad(t: &Tensor, dim: usize, before: usize, after: usize) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(3);
    for (n, is_t) in [(before, false), (0, true), (after, false)] {
        if is_t {
            parts.push(t.clone());
        } else if n > 0 {
            let mut shape = t.dims().to_vec();
            shape[dim] = n;
            parts.push(Tensor::zeros(shape, t.dtype(), t.device())?);
        }
    }
    Ok(Tensor::cat(&parts, dim as isize)?)
}

/// The placement a local gradient has for a value with placement `p`: the gradient of
/// `Replicate` is `Partial(sum)` (each rank holds its contribution) and the gradient of a
/// `Partial` is `Replicate`; shards stay shards.
pub fn grad_placement(op: &'static str, p: Placement) -> Result<Placement> {
    Ok(match p {
        Placement::Shard(d) => Placement::Shard(d),
        Placement::Replicate => Placement::Partial(ReduceOp::Sum),
        Placement::Partial(ReduceOp::Sum | ReduceOp::Avg) => Placement::Replicate,
        Placement::Partial(_) => {
            return Err(DTensorError::NotDifferentiable { op, placement: p.to_string() })
        }
    })
}

/// Placements of the local gradient of a value with placements `ps`.
pub fn grad_placements(op: &'static str, ps: &[Placement]) -> Result<Vec<Placement>> {
    ps.iter().map(|&p| grad_placement(op, p)).collect()
}

/// Product of the mesh sizes of the dims where `ps` is `Partial(avg)`.
pub(crate) fn avg_factor(ps: &[Placement], mesh: &DeviceMesh) -> f64 {
    ps.iter()
        .zip(mesh.shape())
        .filter(|(p, _)| **p == Placement::Partial(ReduceOp::Avg))
        .map(|(_, &k)| k as f64)
        .product()
}

/// The adjoint of redistributing `src -> dst`: maps a local gradient laid out for `dst`
/// to one laid out for `src`. A `Partial(avg)` value's local gradient is the gradient
/// of its own term (`dL/dV / k`), so the adjoint rescales where src and dst differ in it.
pub fn adjoint(
    grad: &Tensor,
    mesh: &DeviceMesh,
    shape: &[usize],
    src: &[Placement],
    dst: &[Placement],
) -> Result<Tensor> {
    let op = "redistribute backward";
    adjoint_between(
        grad,
        mesh,
        shape,
        &grad_placements(op, dst)?,
        &grad_placements(op, src)?,
        src,
        dst,
    )
}

/// The adjoint of redistributing `src -> dst` with the local gradients' layouts given:
/// `from`, how the gradient for `dst` is laid out, and `to`, how the gradient for `src`
/// must be (for [`adjoint`], [`grad_placements`] of `dst` and `src`; a gradient held in
/// full on a `Replicate` dim is laid out `Replicate` instead of `Partial(sum)`).
pub(crate) fn adjoint_between(
    grad: &Tensor,
    mesh: &DeviceMesh,
    shape: &[usize],
    from: &[Placement],
    to: &[Placement],
    src: &[Placement],
    dst: &[Placement],
) -> Result<Tensor> {
    let key = PlanKey {
        mesh_shape: mesh.shape().to_vec(),
        global_shape: shape.to_vec(),
        elem_bytes: grad.dtype().size_in_bytes(),
        src: from.to_vec(),
        dst: to.to_vec(),
    };
    let out = execute(&cached_plan(key)?, grad, mesh)?;
    let scale = avg_factor(dst, mesh) / avg_factor(src, mesh);
    Ok(if scale == 1.0 { out } else { no_grad(|| out.mul_scalar(scale))? })
}

/// The key of a 1-d mesh's group for the autograd engine's replicated gradients (a hash
/// of its members' global ranks) and whether this rank is its root (coordinate 0), as a
/// [`ReplicatedGrad`] tag; `None` for meshes of other ranks.
pub(crate) fn replicated_tag(mesh: &DeviceMesh) -> Option<ReplicatedGrad> {
    use std::hash::{Hash, Hasher};
    if mesh.ndim() != 1 {
        return None;
    }
    let g = mesh.group(0).ok()?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ("tpar mesh group", g.ranks()).hash(&mut h);
    Some(ReplicatedGrad { group: h.finish(), root: mesh.coordinate()[0] == 0 })
}

/// This rank's shard of a full tensor laid out as `spec` (no communication): the
/// narrowed block for `Shard` dims; on `Partial(sum)` dims the value at coordinate 0 and
/// zeros elsewhere (every rank keeps it for avg/max/min).
pub fn slice_full(full: &Tensor, spec: &crate::DTensorSpec) -> Result<Tensor> {
    if full.dims() != spec.shape() {
        return Err(DTensorError::InvalidArgument {
            op: "distribute_tensor",
            what: format!("tensor of shape {:?} given for {spec}", full.dims()),
        });
    }
    no_grad(|| {
        let (shape, offset) = spec.local_shape_and_offset()?;
        let mut t = full.clone();
        for d in 0..shape.len() {
            t = t.narrow(d as isize, offset[d], shape[d])?;
        }
        let coord = spec.mesh().coordinate();
        let zeroed = spec
            .placements()
            .iter()
            .zip(coord)
            .any(|(p, &c)| *p == Placement::Partial(ReduceOp::Sum) && c != 0);
        Ok(if zeroed { t.zeros_like()? } else { t })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpar_placements::Placement::{Replicate, Shard};

    /// Plans of ever new shapes leave the cache at its limit, and a cached plan equals a
    /// fresh one.
    #[test]
    fn the_plan_cache_is_bounded() {
        let key = |n: usize| PlanKey {
            mesh_shape: vec![2],
            global_shape: vec![n, 3],
            elem_bytes: 4,
            src: vec![Shard(0)],
            dst: vec![Replicate],
        };
        for n in 1..=PLAN_CACHE_LIMIT + 100 {
            let plan = cached_plan(key(n)).unwrap();
            assert_eq!(plan, key(n).plan().unwrap());
            assert!(plan_cache().len() <= PLAN_CACHE_LIMIT);
        }
    }
}
