//! A slow, obviously-correct reference for layouts and plans: every rank's
//! local tensor is a row-major `Vec<f64>`, collectives are loops.
//!
//! Used by this crate's property tests and meant as the oracle for DTensor
//! tests: [`layout`] cuts a global array into every rank's local data,
//! [`execute`] runs a [`Plan`] with simulated collectives, and [`assemble`]
//! puts the global array back together.
//!
//! Ranks are numbered row-major over the mesh coordinates (the last mesh
//! dim varies fastest), as [`DeviceMesh`]es usually number them.
//!
//! [`DeviceMesh`]: https://pytorch.org/docs/stable/distributed.html#devicemesh
//!
//! ```
//! use tpar_placements::{plan, Placement::*, ReduceOp};
//! use tpar_placements::simulate::{assemble, execute, layout, Array};
//!
//! let global = Array::iota(&[5, 3]);
//! let mesh = [2, 2];
//! let src = [Partial(ReduceOp::Sum), Shard(0)];
//! let dst = [Shard(1), Replicate];
//! let locals = layout(&global, &mesh, &src, 7).unwrap();
//! let p = plan(&mesh, global.shape(), 8, &src, &dst).unwrap();
//! let out = execute(&p, locals).unwrap();
//! assert_eq!(out.get(&[1, 0]).unwrap().shape(), [5, 1]);
//! assert!(assemble(&out, &dst).unwrap().approx_eq(&global, 1e-9));
//! ```

use crate::error::{PlacementError, Result};
use crate::placement::{fmt_placements, Placement, ReduceOp};
use crate::plan::{Plan, Step, StepKind};
use crate::shard::{check_mesh, chunk_range, local_shape_and_offset_unchecked, normalize_for};

/// A dense row-major n-d array of `f64`.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    shape: Vec<usize>,
    data: Vec<f64>,
}

fn sim_err(context: &str, reason: String) -> PlacementError {
    PlacementError::Simulation { context: context.to_string(), reason }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Array {
    /// An array from its shape and row-major data.
    ///
    /// # Errors
    /// [`PlacementError::Simulation`] when `data.len()` is not the shape's size.
    pub fn new(shape: &[usize], data: Vec<f64>) -> Result<Self> {
        if data.len() != numel(shape) {
            return Err(sim_err(
                "Array::new",
                format!("{} values for shape {shape:?}", data.len()),
            ));
        }
        Ok(Array { shape: shape.to_vec(), data })
    }

    /// All zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Array { shape: shape.to_vec(), data: vec![0.0; numel(shape)] }
    }

    /// `0, 1, 2, ...` in row-major order: every element distinct, so a
    /// misplaced element shows.
    pub fn iota(shape: &[usize]) -> Self {
        Array { shape: shape.to_vec(), data: (0..numel(shape)).map(|i| i as f64).collect() }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The row-major data.
    pub fn data(&self) -> &[f64] {
        &self.data
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// (outer, size, inner) around `dim`.
    fn split_at_dim(shape: &[usize], dim: usize) -> (usize, usize, usize) {
        (numel(&shape[..dim]), shape[dim], numel(&shape[dim + 1..]))
    }

    /// Elements `start..start + len` along `dim`.
    ///
    /// # Errors
    /// [`PlacementError::Simulation`] when `dim` or the range is out of bounds.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Array> {
        if dim >= self.shape.len() || start + len > self.shape[dim] {
            return Err(sim_err(
                "narrow",
                format!(
                    "range {start}..{} of dim {dim} out of bounds for shape {:?}",
                    start + len,
                    self.shape
                ),
            ));
        }
        let (outer, size, inner) = Self::split_at_dim(&self.shape, dim);
        let mut data = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            let base = (o * size + start) * inner;
            data.extend_from_slice(&self.data[base..base + len * inner]);
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        Ok(Array { shape, data })
    }

    /// Concatenates `parts` along `dim`; all other dims must agree.
    ///
    /// # Errors
    /// [`PlacementError::Simulation`] when `parts` is empty, `dim` is out of
    /// range, or the other dims differ.
    pub fn concat(parts: &[Array], dim: usize) -> Result<Array> {
        let first = parts.first().ok_or_else(|| sim_err("concat", "no arrays".to_string()))?;
        let rank = first.shape.len();
        if dim >= rank {
            return Err(sim_err(
                "concat",
                format!("dim {dim} out of range for shape {:?}", first.shape),
            ));
        }
        for p in parts {
            let same = p.shape.len() == rank
                && (0..rank).all(|d| d == dim || p.shape[d] == first.shape[d]);
            if !same {
                return Err(sim_err(
                    "concat",
                    format!(
                        "shape {:?} does not match {:?} outside dim {dim}",
                        p.shape, first.shape
                    ),
                ));
            }
        }
        let total: usize = parts.iter().map(|p| p.shape[dim]).sum();
        let (outer, _, inner) = Self::split_at_dim(&first.shape, dim);
        let mut data = Vec::with_capacity(outer * total * inner);
        for o in 0..outer {
            for p in parts {
                let chunk = p.shape[dim] * inner;
                data.extend_from_slice(&p.data[o * chunk..(o + 1) * chunk]);
            }
        }
        let mut shape = first.shape.clone();
        shape[dim] = total;
        Ok(Array { shape, data })
    }

    /// Chunk `i` of `k` along `dim`, with [`chunk_range`].
    ///
    /// # Errors
    /// As [`Array::narrow`].
    pub fn chunk(&self, dim: usize, k: usize, i: usize) -> Result<Array> {
        let n = *self.shape.get(dim).ok_or_else(|| {
            sim_err("chunk", format!("dim {dim} out of range for shape {:?}", self.shape))
        })?;
        let (start, len) = chunk_range(n, k, i);
        self.narrow(dim, start, len)
    }

    /// The largest absolute elementwise difference, or `None` when the
    /// shapes differ.
    pub fn max_abs_diff(&self, other: &Array) -> Option<f64> {
        (self.shape == other.shape).then(|| {
            self.data.iter().zip(&other.data).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
        })
    }

    /// Same shape and every element within `tol`.
    pub fn approx_eq(&self, other: &Array, tol: f64) -> bool {
        self.max_abs_diff(other).is_some_and(|d| d <= tol)
    }
}

/// Every rank's local array on a mesh, indexed by row-major rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Locals {
    /// The mesh shape.
    pub mesh_shape: Vec<usize>,
    /// One local array per rank, row-major over mesh coordinates.
    pub ranks: Vec<Array>,
}

impl Locals {
    /// The coordinate of a rank.
    pub fn coord(&self, rank: usize) -> Vec<usize> {
        coord_of(&self.mesh_shape, rank)
    }

    /// The local array at a coordinate (`None` when out of range).
    pub fn get(&self, coord: &[usize]) -> Option<&Array> {
        if coord.len() != self.mesh_shape.len()
            || coord.iter().zip(&self.mesh_shape).any(|(c, m)| c >= m)
        {
            return None;
        }
        let rank = coord.iter().zip(&self.mesh_shape).fold(0, |acc, (c, m)| acc * m + c);
        self.ranks.get(rank)
    }
}

/// The mesh coordinate of a row-major rank.
pub fn coord_of(mesh_shape: &[usize], mut rank: usize) -> Vec<usize> {
    let mut coord = vec![0; mesh_shape.len()];
    for i in (0..mesh_shape.len()).rev() {
        coord[i] = rank % mesh_shape[i];
        rank /= mesh_shape[i];
    }
    coord
}

/// The ranks that differ from each other only along `mesh_dim`, each group
/// in coordinate order.
pub fn groups(mesh_shape: &[usize], mesh_dim: usize) -> Vec<Vec<usize>> {
    let k = mesh_shape[mesh_dim];
    let stride: usize = numel(&mesh_shape[mesh_dim + 1..]);
    let world = numel(mesh_shape);
    (0..world)
        .filter(|r| (r / stride).is_multiple_of(k))
        .map(|r| (0..k).map(|j| r + j * stride).collect())
        .collect()
}

/// SplitMix64: a tiny deterministic generator for [`layout`]'s terms.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `lo..=hi`, as `f64`.
    fn int(&mut self, lo: i64, hi: i64) -> f64 {
        (lo + (self.next() % (hi - lo + 1) as u64) as i64) as f64
    }
}

/// `k` terms whose `op`-reduction is `x`.
fn split_terms(rng: &mut Rng, op: ReduceOp, x: f64, k: usize) -> Vec<f64> {
    let mut t: Vec<f64> = Vec::with_capacity(k);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let target = if op == ReduceOp::Sum { x } else { x * k as f64 };
            let base = if op == ReduceOp::Sum { 0.0 } else { x };
            for _ in 1..k {
                t.push(base + rng.int(-4, 4));
            }
            let rest: f64 = t.iter().sum();
            t.push(target - rest);
        }
        ReduceOp::Max | ReduceOp::Min => {
            let winner = (rng.next() % k as u64) as usize;
            let sign = if op == ReduceOp::Max { -1.0 } else { 1.0 };
            for j in 0..k {
                let off = rng.int(1, 4);
                t.push(if j == winner { x } else { x + sign * off });
            }
        }
        // Not a placement (`normalize` refuses it); the terms are still well defined.
        ReduceOp::Product => {
            t.push(x);
            t.resize(k, 1.0);
        }
    }
    t
}

/// Cuts `global` into every rank's local array for `placements` on
/// `mesh_shape`.
///
/// Shards are exact slices ([`local_shape_and_offset`](crate::local_shape_and_offset)).
/// Partial mesh dims get random integer-valued terms drawn from `seed`:
/// `Partial(sum)` terms sum to the value, `Partial(avg)` terms average to
/// it, and for `Partial(max)`/`Partial(min)` one rank per group holds the
/// value and the others strictly smaller/larger values. With several
/// partial mesh dims the terms nest: the value is the first partial mesh
/// dim's reduction of terms that are themselves the next partial mesh dim's
/// reductions, so [`assemble`] reduces the last partial mesh dim first (the
/// order only matters when the ops do not commute, see
/// [`ReduceOp::commutes_with`]).
///
/// # Errors
/// As [`local_shape_and_offset`](crate::local_shape_and_offset).
pub fn layout(
    global: &Array,
    mesh_shape: &[usize],
    placements: &[Placement],
    seed: u64,
) -> Result<Locals> {
    let context = format!("layout {} on mesh {mesh_shape:?}", fmt_placements(placements));
    check_mesh(&context, mesh_shape, placements.len())?;
    let placements = normalize_for(&context, &global.shape, placements)?;
    let world = numel(mesh_shape);
    let mut ranks = Vec::with_capacity(world);
    for r in 0..world {
        let coord = coord_of(mesh_shape, r);
        let (shape, offset) =
            local_shape_and_offset_unchecked(&global.shape, mesh_shape, |i| coord[i], &placements);
        let mut a = global.clone();
        for d in 0..shape.len() {
            a = a.narrow(d, offset[d], shape[d])?;
        }
        ranks.push(a);
    }
    let partial_dims: Vec<usize> =
        (0..placements.len()).filter(|&i| placements[i].is_partial()).collect();
    for (t, &pd) in partial_dims.iter().enumerate() {
        let Placement::Partial(op) = placements[pd] else {
            continue;
        };
        let k = mesh_shape[pd];
        for (r, local) in ranks.iter_mut().enumerate() {
            let coord = coord_of(mesh_shape, r);
            // Ranks of one group (and replicas) must draw the same terms:
            // key on the shard coordinates and the partial dims already split.
            let mut h = seed ^ (t as u64).wrapping_mul(0xA24B_AED4_963E_E407);
            for (i, &c) in coord.iter().enumerate() {
                let keep = placements[i].is_shard() || partial_dims[..t].contains(&i);
                let c = if keep { c as u64 } else { u64::MAX };
                h = Rng(h ^ c.wrapping_mul(0x9FB2_1C65_1E98_DF25)).next();
            }
            let mut rng = Rng(h);
            for x in local.data.iter_mut() {
                *x = split_terms(&mut rng, op, *x, k)[coord[pd]];
            }
        }
    }
    Ok(Locals { mesh_shape: mesh_shape.to_vec(), ranks })
}

/// The exact local array a rank at `coord` holds for non-partial
/// `placements` (a partial mesh dim is treated as `Replicate`).
///
/// # Errors
/// As [`local_shape_and_offset`](crate::local_shape_and_offset).
pub fn expected_local(
    global: &Array,
    mesh_shape: &[usize],
    coord: &[usize],
    placements: &[Placement],
) -> Result<Array> {
    let (shape, offset) =
        crate::local_shape_and_offset(&global.shape, mesh_shape, coord, placements)?;
    let mut a = global.clone();
    for d in 0..shape.len() {
        a = a.narrow(d, offset[d], shape[d])?;
    }
    Ok(a)
}

fn reduce(context: &str, op: ReduceOp, parts: &[&Array]) -> Result<Array> {
    let first = parts[0];
    if let Some(p) = parts.iter().find(|p| p.shape != first.shape) {
        return Err(sim_err(
            context,
            format!("{op} over shapes {:?} and {:?}", first.shape, p.shape),
        ));
    }
    let mut out = first.clone();
    for p in &parts[1..] {
        for (o, v) in out.data.iter_mut().zip(&p.data) {
            *o = match op {
                ReduceOp::Sum | ReduceOp::Avg => *o + v,
                ReduceOp::Max => o.max(*v),
                ReduceOp::Min => o.min(*v),
                ReduceOp::Product => *o * v,
            };
        }
    }
    if op == ReduceOp::Avg {
        let k = parts.len() as f64;
        out.data.iter_mut().for_each(|o| *o /= k);
    }
    Ok(out)
}

/// Runs one group's part of a step: `members` in coordinate order.
fn run_group(context: &str, kind: StepKind, members: Vec<Array>) -> Result<Vec<Array>> {
    let k = members.len();
    let refs: Vec<&Array> = members.iter().collect();
    Ok(match kind {
        StepKind::AllGather { tensor_dim } => vec![Array::concat(&members, tensor_dim)?; k],
        StepKind::AllReduce { op } => vec![reduce(context, op, &refs)?; k],
        StepKind::ReduceScatter { op, tensor_dim } => {
            let full = reduce(context, op, &refs)?;
            (0..k).map(|j| full.chunk(tensor_dim, k, j)).collect::<Result<_>>()?
        }
        StepKind::AllToAll { from_dim, to_dim } => {
            // pieces[m][j]: what member m sends to member j.
            let pieces: Vec<Vec<Array>> = members
                .iter()
                .map(|a| (0..k).map(|j| a.chunk(to_dim, k, j)).collect::<Result<_>>())
                .collect::<Result<_>>()?;
            (0..k)
                .map(|j| {
                    let received: Vec<Array> = pieces.iter().map(|p| p[j].clone()).collect();
                    Array::concat(&received, from_dim)
                })
                .collect::<Result<_>>()?
        }
        StepKind::LocalSlice { tensor_dim } => members
            .iter()
            .enumerate()
            .map(|(j, a)| a.chunk(tensor_dim, k, j))
            .collect::<Result<_>>()?,
        StepKind::ZeroPad { tensor_dim } => {
            let sizes: Vec<usize> = members.iter().map(|a| a.shape[tensor_dim]).collect();
            let total: usize = sizes.iter().sum();
            let mut start = 0;
            let mut out = Vec::with_capacity(k);
            for (a, &n) in members.iter().zip(&sizes) {
                let mut parts = Vec::new();
                for len in [start, total - start - n] {
                    let mut shape = a.shape.clone();
                    shape[tensor_dim] = len;
                    parts.push(Array::zeros(&shape));
                }
                out.push(Array::concat(
                    &[parts[0].clone(), a.clone(), parts[1].clone()],
                    tensor_dim,
                )?);
                start += n;
            }
            out
        }
        StepKind::Partialize { op } => members
            .into_iter()
            .enumerate()
            .map(|(j, a)| if op == ReduceOp::Sum && j != 0 { Array::zeros(&a.shape) } else { a })
            .collect(),
    })
}

/// Runs one step on every group of ranks along its mesh dim.
///
/// # Errors
/// [`PlacementError::Simulation`] when the locals do not fit the mesh or the
/// step (a wrong shape or dim).
pub fn execute_step(step: &Step, mut locals: Locals) -> Result<Locals> {
    let context = step.to_string();
    if step.mesh_dim >= locals.mesh_shape.len() || locals.ranks.len() != numel(&locals.mesh_shape) {
        return Err(sim_err(
            &context,
            format!(
                "{} locals on mesh {:?} for a step on mesh dim {}",
                locals.ranks.len(),
                locals.mesh_shape,
                step.mesh_dim
            ),
        ));
    }
    for group in groups(&locals.mesh_shape, step.mesh_dim) {
        let members: Vec<Array> = group
            .iter()
            .map(|&r| std::mem::replace(&mut locals.ranks[r], Array::zeros(&[])))
            .collect();
        let out = run_group(&context, step.kind, members)?;
        for (r, a) in group.into_iter().zip(out) {
            locals.ranks[r] = a;
        }
    }
    Ok(locals)
}

/// Runs every step of `plan` in order.
///
/// # Errors
/// As [`execute_step`], and when the locals' mesh is not the plan's.
pub fn execute(plan: &Plan, locals: Locals) -> Result<Locals> {
    if locals.mesh_shape != plan.mesh_shape {
        return Err(sim_err(
            "execute",
            format!(
                "locals on mesh {:?} for a plan on mesh {:?}",
                locals.mesh_shape, plan.mesh_shape
            ),
        ));
    }
    plan.steps.iter().try_fold(locals, |l, s| execute_step(s, l))
}

/// Rebuilds the global array from every rank's local array laid out as
/// `placements`: mesh dims right to left, gathering shards and reducing
/// partials (so the last partial mesh dim is reduced first, matching
/// [`layout`]), then returns rank 0's array.
///
/// # Errors
/// [`PlacementError::Simulation`] when the locals are inconsistent with the
/// placements, and the errors of [`Placement::normalize`].
pub fn assemble(locals: &Locals, placements: &[Placement]) -> Result<Array> {
    let context =
        format!("assemble {} on mesh {:?}", fmt_placements(placements), locals.mesh_shape);
    check_mesh(&context, &locals.mesh_shape, placements.len())?;
    let first = locals.ranks.first().ok_or_else(|| sim_err(&context, "no ranks".to_string()))?;
    let placements = normalize_for(&context, &first.shape, placements)?;
    let mut cur = locals.clone();
    for i in (0..placements.len()).rev() {
        let kind = match placements[i] {
            Placement::Shard(d) => StepKind::AllGather { tensor_dim: d as usize },
            Placement::Partial(op) => StepKind::AllReduce { op },
            Placement::Replicate => continue,
        };
        let mut after = placements.clone();
        after[i] = Placement::Replicate;
        let step = Step { mesh_dim: i, kind, before: placements.clone(), after, bytes: 0 };
        cur = execute_step(&step, cur).map_err(|e| e.with_context(&context, None))?;
    }
    Ok(cur.ranks.swap_remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use Placement::*;

    #[test]
    fn narrow_concat_chunk() {
        let a = Array::iota(&[3, 4]);
        let left = a.narrow(1, 0, 3).unwrap();
        let right = a.narrow(1, 3, 1).unwrap();
        assert_eq!(left.data(), [0., 1., 2., 4., 5., 6., 8., 9., 10.]);
        assert_eq!(right.data(), [3., 7., 11.]);
        assert_eq!(Array::concat(&[left, right], 1).unwrap(), a);
        let c = a.chunk(0, 2, 1).unwrap();
        assert_eq!(c.shape(), [1, 4]);
        assert!(a.narrow(0, 2, 2).is_err());
        assert!(Array::concat(&[a.clone(), Array::iota(&[3, 3])], 0).is_err());
        assert!(Array::new(&[2, 2], vec![0.0; 3]).is_err());
        assert_eq!(a.chunk(1, 4, 3).unwrap().data(), [3., 7., 11.]);
    }

    #[test]
    fn groups_and_coords() {
        assert_eq!(groups(&[2, 3], 0), [[0, 3], [1, 4], [2, 5]]);
        assert_eq!(groups(&[2, 3], 1), [[0, 1, 2], [3, 4, 5]]);
        assert_eq!(coord_of(&[2, 3], 4), [1, 1]);
    }

    #[test]
    fn layout_partials_reduce_to_the_value() {
        let g = Array::iota(&[3, 2]);
        for op in ReduceOp::PARTIAL {
            let l = layout(&g, &[3, 2], &[Partial(op), Partial(op)], 1).unwrap();
            assert!(assemble(&l, &[Partial(op), Partial(op)]).unwrap().approx_eq(&g, 1e-9));
            assert_ne!(l.ranks[0], l.ranks[1], "{op}: terms should differ");
        }
        let l = layout(&g, &[2, 2], &[Replicate, Partial(ReduceOp::Sum)], 3).unwrap();
        assert_eq!(l.ranks[0], l.ranks[2], "replicas hold the same terms");
    }

    #[test]
    fn nine_rows_on_two_by_two() {
        let g = Array::iota(&[9]);
        let l = layout(&g, &[2, 2], &[Shard(0), Shard(0)], 0).unwrap();
        let rows: Vec<&[f64]> = l.ranks.iter().map(|a| a.data()).collect();
        assert_eq!(rows, [&[0., 1., 2.][..], &[3., 4.], &[5., 6.], &[7., 8.]]);
        assert_eq!(assemble(&l, &[Shard(0), Shard(0)]).unwrap(), g);
    }

    #[test]
    fn partialize_sum_keeps_value_on_coordinate_zero() {
        let g = Array::iota(&[2]);
        let p = crate::plan(&[2], &[2], 8, &[Replicate], &[Partial(ReduceOp::Sum)]).unwrap();
        let out = execute(&p, layout(&g, &[2], &[Replicate], 0).unwrap()).unwrap();
        assert_eq!(out.ranks[0], g);
        assert_eq!(out.ranks[1], Array::zeros(&[2]));
    }
}
