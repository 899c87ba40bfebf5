//! The redistribution planner: placement lists in, a printable list of
//! steps with their byte counts out.

use std::fmt;

use crate::error::Result;
use crate::placement::{fmt_placements, Placement, ReduceOp};
use crate::shard::{check_mesh, chunk_range, largest_local_shape_unchecked, normalize_for};

/// What one step of a [`Plan`] does on its mesh dim.
///
/// Collectives run over the ranks that differ only in the step's mesh dim,
/// in coordinate order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// `Shard(tensor_dim)` → `Replicate`: concatenate the shards along
    /// `tensor_dim` in coordinate order.
    AllGather {
        /// The tensor dim being gathered.
        tensor_dim: usize,
    },
    /// `Partial(op)` → `Replicate`: every rank gets the reduction.
    AllReduce {
        /// How the terms combine.
        op: ReduceOp,
    },
    /// `Partial(op)` → `Shard(tensor_dim)`: reduce, and rank `i` keeps chunk
    /// `i` (see [`chunk_range`]) of the result along `tensor_dim`.
    ReduceScatter {
        /// How the terms combine.
        op: ReduceOp,
        /// The tensor dim of the output shards.
        tensor_dim: usize,
    },
    /// `Shard(from_dim)` → `Shard(to_dim)`: rank `i` chunks its local tensor
    /// along `to_dim`, sends chunk `j` to rank `j`, and concatenates what it
    /// receives along `from_dim` in coordinate order.
    AllToAll {
        /// The tensor dim sharded before the step.
        from_dim: usize,
        /// The tensor dim sharded after the step.
        to_dim: usize,
    },
    /// `Replicate` → `Shard(tensor_dim)`: rank `i` keeps chunk `i` of its
    /// local tensor along `tensor_dim`. No communication.
    LocalSlice {
        /// The tensor dim being sliced.
        tensor_dim: usize,
    },
    /// `Shard(tensor_dim)` → `Partial(sum)`: no communication. Each rank
    /// zero-pads its shard back to the unsharded size along `tensor_dim`, so the
    /// sum over the mesh dim is the tensor (the adjoint of a local slice).
    ZeroPad {
        /// The tensor dim being padded.
        tensor_dim: usize,
    },
    /// `Replicate` → `Partial(op)`: no communication. For `Sum`, the rank at
    /// coordinate 0 on the mesh dim keeps the value and the others hold
    /// zeros (exact in every dtype, unlike dividing by the mesh size); for
    /// `Avg`, `Max` and `Min` every rank keeps the value.
    Partialize {
        /// The reduce op of the resulting partial placement.
        op: ReduceOp,
    },
}

impl StepKind {
    /// The collective's short name: `all_gather`, `all_reduce`,
    /// `reduce_scatter`, `all_to_all`, `local_slice`, `partialize`.
    pub fn name(&self) -> &'static str {
        match self {
            StepKind::AllGather { .. } => "all_gather",
            StepKind::AllReduce { .. } => "all_reduce",
            StepKind::ReduceScatter { .. } => "reduce_scatter",
            StepKind::AllToAll { .. } => "all_to_all",
            StepKind::LocalSlice { .. } => "local_slice",
            StepKind::Partialize { .. } => "partialize",
            StepKind::ZeroPad { .. } => "zero_pad",
        }
    }

    /// Whether the step communicates (false for `LocalSlice`, `Partialize`, `ZeroPad`).
    pub fn is_collective(&self) -> bool {
        !matches!(
            self,
            StepKind::LocalSlice { .. } | StepKind::Partialize { .. } | StepKind::ZeroPad { .. }
        )
    }

    /// The placement the step's mesh dim has afterwards.
    pub fn result_placement(&self) -> Placement {
        match *self {
            StepKind::AllGather { .. } | StepKind::AllReduce { .. } => Placement::Replicate,
            StepKind::ReduceScatter { tensor_dim, .. } | StepKind::LocalSlice { tensor_dim } => {
                Placement::Shard(tensor_dim as isize)
            }
            StepKind::AllToAll { to_dim, .. } => Placement::Shard(to_dim as isize),
            StepKind::Partialize { op } => Placement::Partial(op),
            StepKind::ZeroPad { .. } => Placement::Partial(ReduceOp::Sum),
        }
    }
}

/// One step of a [`Plan`]: a transition of one mesh dim's placement.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    /// The mesh dim whose placement changes.
    pub mesh_dim: usize,
    /// What happens.
    pub kind: StepKind,
    /// All placements before the step (normalised).
    pub before: Vec<Placement>,
    /// All placements after the step (normalised).
    pub after: Vec<Placement>,
    /// Bytes received (sent, for `reduce_scatter` and `all_to_all`) by the
    /// rank holding the largest shard, coordinate 0 on every mesh dim; see
    /// the crate docs for the exact rule per step kind. 0 for local steps.
    pub bytes: u64,
}

impl Step {
    /// The step in words, without the placements:
    /// `all_gather on mesh dim 0, tensor dim 0, 4.0 MiB`.
    pub fn describe(&self) -> String {
        let m = self.mesh_dim;
        let b = fmt_bytes(self.bytes);
        match self.kind {
            StepKind::AllGather { tensor_dim } => {
                format!("all_gather on mesh dim {m}, tensor dim {tensor_dim}, {b}")
            }
            StepKind::AllReduce { op } => format!("all_reduce({op}) on mesh dim {m}, {b}"),
            StepKind::ReduceScatter { op, tensor_dim } => {
                format!("reduce_scatter({op}) on mesh dim {m}, tensor dim {tensor_dim}, {b}")
            }
            StepKind::AllToAll { from_dim, to_dim } => {
                format!("all_to_all on mesh dim {m}, tensor dim {from_dim} -> {to_dim}, {b}")
            }
            StepKind::LocalSlice { tensor_dim } => {
                format!("local_slice on mesh dim {m}, tensor dim {tensor_dim}, no communication")
            }
            StepKind::Partialize { op } => {
                format!("partialize({op}) on mesh dim {m}, no communication")
            }
            StepKind::ZeroPad { tensor_dim } => {
                format!("zero_pad on mesh dim {m}, tensor dim {tensor_dim}, no communication")
            }
        }
    }
}

impl fmt::Display for Step {
    /// `S(0)R -> RR (all_gather on mesh dim 0, tensor dim 0, 4.0 MiB)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} -> {} ({})",
            fmt_placements(&self.before),
            fmt_placements(&self.after),
            self.describe()
        )
    }
}

/// A redistribution from `src` to `dst` placements: the steps to run in
/// order, each with the bytes it moves. A plain value: print it, compare it,
/// hash it, cache it (see [`PlanKey`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// The steps, in execution order. Empty when `src == dst`.
    pub steps: Vec<Step>,
    /// Source placements (normalised).
    pub src: Vec<Placement>,
    /// Destination placements (normalised).
    pub dst: Vec<Placement>,
    /// The mesh shape the plan is for.
    pub mesh_shape: Vec<usize>,
    /// The tensor's global shape.
    pub global_shape: Vec<usize>,
    /// Bytes per element, used for the byte counts.
    pub elem_bytes: usize,
}

impl Plan {
    /// One line per step, `before -> after (what, where, bytes)`:
    ///
    /// ```text
    /// S(0)R -> RR (all_gather on mesh dim 0, tensor dim 0, 4.0 MiB)
    /// ```
    ///
    /// An empty plan prints one line, `S(0)R -> S(0)R (nothing to do)`.
    pub fn explain(&self) -> String {
        if self.steps.is_empty() {
            let p = fmt_placements(&self.src);
            return format!("{p} -> {p} (nothing to do)");
        }
        self.steps.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("\n")
    }

    /// The sum of the steps' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes).fold(0, u64::saturating_add)
    }

    /// Bytes moved per mesh dim (indexed by mesh dim).
    pub fn bytes_per_mesh_dim(&self) -> Vec<u64> {
        let mut out = vec![0u64; self.mesh_shape.len()];
        for s in &self.steps {
            out[s.mesh_dim] = out[s.mesh_dim].saturating_add(s.bytes);
        }
        out
    }

    /// How many steps communicate.
    pub fn num_collectives(&self) -> usize {
        self.steps.iter().filter(|s| s.kind.is_collective()).count()
    }

    /// True when there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The inputs that produced this plan, for use as a cache key.
    pub fn key(&self) -> PlanKey {
        PlanKey {
            mesh_shape: self.mesh_shape.clone(),
            global_shape: self.global_shape.clone(),
            elem_bytes: self.elem_bytes,
            src: self.src.clone(),
            dst: self.dst.clone(),
        }
    }
}

impl fmt::Display for Plan {
    /// Same as [`Plan::explain`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.explain())
    }
}

/// The inputs of [`plan`], hashable, to cache plans in a `HashMap`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PlanKey {
    /// The mesh shape.
    pub mesh_shape: Vec<usize>,
    /// The tensor's global shape.
    pub global_shape: Vec<usize>,
    /// Bytes per element.
    pub elem_bytes: usize,
    /// Source placements.
    pub src: Vec<Placement>,
    /// Destination placements.
    pub dst: Vec<Placement>,
}

impl PlanKey {
    /// Runs [`plan`] on these inputs.
    ///
    /// # Errors
    /// As [`plan`].
    pub fn plan(&self) -> Result<Plan> {
        plan(&self.mesh_shape, &self.global_shape, self.elem_bytes, &self.src, &self.dst)
    }
}

/// Formats a byte count: `512 B`, `1.5 KiB`, `4.0 MiB`, `2.0 GiB`, `1.0 TiB`.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Shapes and sizes the byte counts need.
struct Costs<'a> {
    mesh: &'a [usize],
    shape: &'a [usize],
    elem_bytes: u64,
}

fn numel(shape: &[usize]) -> u64 {
    shape.iter().fold(1u64, |acc, &s| acc.saturating_mul(s as u64))
}

impl Costs<'_> {
    /// Bytes of `kind` on `mesh_dim` when the tensor is laid out as `before`
    /// (a valid intermediate state), for the rank at coordinate 0.
    fn bytes(&self, mesh_dim: usize, kind: StepKind, before: &[Placement]) -> u64 {
        let k = self.mesh[mesh_dim] as u64;
        let local = largest_local_shape_unchecked(self.shape, self.mesh, before);
        let elems = numel(&local);
        // Elements of the local tensor with `dim` replaced by its chunk 0.
        let chunk0 = |dim: usize| {
            let n = local[dim];
            if n == 0 {
                0
            } else {
                elems / n as u64 * chunk_range(n, k as usize, 0).1 as u64
            }
        };
        let moved = match kind {
            StepKind::AllGather { .. } => {
                let mut after = before.to_vec();
                after[mesh_dim] = Placement::Replicate;
                numel(&largest_local_shape_unchecked(self.shape, self.mesh, &after)) - elems
            }
            StepKind::AllReduce { .. } => {
                let b = 2 * (k as u128 - 1) * elems as u128 * self.elem_bytes as u128 / k as u128;
                return u64::try_from(b).unwrap_or(u64::MAX);
            }
            StepKind::ReduceScatter { tensor_dim, .. } => elems - chunk0(tensor_dim),
            StepKind::AllToAll { to_dim, .. } => elems - chunk0(to_dim),
            StepKind::LocalSlice { .. }
            | StepKind::Partialize { .. }
            | StepKind::ZeroPad { .. } => 0,
        };
        moved.saturating_mul(self.elem_bytes)
    }
}

/// Builds plans step by step, tracking the current placements.
struct Builder<'a> {
    costs: Costs<'a>,
    current: Vec<Placement>,
    steps: Vec<Step>,
}

impl Builder<'_> {
    fn push(&mut self, mesh_dim: usize, kind: StepKind) {
        let before = self.current.clone();
        let bytes = self.costs.bytes(mesh_dim, kind, &before);
        self.current[mesh_dim] = kind.result_placement();
        self.steps.push(Step { mesh_dim, kind, before, after: self.current.clone(), bytes });
    }

    /// Left-to-right pass from a state where every mesh dim is either at its
    /// target or `Replicate`/`Partial` waiting for it.
    fn finish_left_to_right(&mut self, dst: &[Placement]) {
        for i in 0..dst.len() {
            match (self.current[i], dst[i]) {
                (a, b) if a == b => {}
                (Placement::Replicate, Placement::Shard(e)) => {
                    self.push(i, StepKind::LocalSlice { tensor_dim: e as usize })
                }
                (Placement::Replicate, Placement::Partial(op)) => {
                    self.push(i, StepKind::Partialize { op })
                }
                (Placement::Partial(op), Placement::Replicate) => {
                    self.push(i, StepKind::AllReduce { op })
                }
                (Placement::Partial(op), Placement::Partial(to)) => {
                    self.push(i, StepKind::AllReduce { op });
                    self.push(i, StepKind::Partialize { op: to });
                }
                (Placement::Partial(op), Placement::Shard(e)) => {
                    self.push(i, StepKind::ReduceScatter { op, tensor_dim: e as usize })
                }
                (Placement::Shard(_), _) | (Placement::Replicate, Placement::Replicate) => {
                    // The right-to-left pass leaves every shard that differs
                    // from its target gathered (see the crate docs' proof).
                    unreachable!("planner invariant: mismatched shard after the first pass")
                }
            }
        }
    }

    fn finish(self, src: Vec<Placement>, dst: Vec<Placement>, elem_bytes: usize) -> Plan {
        debug_assert_eq!(self.current, dst);
        Plan {
            steps: self.steps,
            src,
            dst,
            mesh_shape: self.costs.mesh.to_vec(),
            global_shape: self.costs.shape.to_vec(),
            elem_bytes,
        }
    }
}

/// Validates and normalises the planner's inputs.
fn prepare(
    mesh_shape: &[usize],
    global_shape: &[usize],
    src: &[Placement],
    dst: &[Placement],
) -> Result<(Vec<Placement>, Vec<Placement>)> {
    let context = format!(
        "placements {} -> {} on mesh {mesh_shape:?}",
        fmt_placements(src),
        fmt_placements(dst)
    );
    check_mesh(&context, mesh_shape, src.len())?;
    check_mesh(&context, mesh_shape, dst.len())?;
    let src = normalize_for(&context, global_shape, src)?;
    let dst = normalize_for(&context, global_shape, dst)?;
    Ok((src, dst))
}

/// Plans the redistribution of a tensor of `global_shape` (elements of
/// `elem_bytes` bytes) on a mesh of `mesh_shape` from `src` to `dst`
/// placements. Pure: no communication, no devices.
///
/// The algorithm follows PyTorch's (`_gen_transform_infos`), with byte-aware
/// choices; the crate docs give it in full with its correctness argument.
/// In short: mesh dims are visited right to left, gathering every shard
/// that cannot stay (nested shardings are undone innermost first), turning
/// `Shard(d)` into `Shard(e)` with one `all_to_all` where no other mesh dim
/// touches `d` or `e`, and reducing `Partial`s where that is cheapest; then
/// left to right, replicated mesh dims are sliced or partialized and the
/// remaining `Partial`s reduced (`Partial → Shard` as one `reduce_scatter`).
/// `plan(.., x, x)` is empty.
///
/// # Errors
/// [`PlacementError::EmptyMeshDim`](crate::PlacementError::EmptyMeshDim),
/// [`PlacementError::MeshRankMismatch`](crate::PlacementError::MeshRankMismatch)
/// and [`PlacementError::DimOutOfRange`](crate::PlacementError::DimOutOfRange),
/// naming both placement lists, the mesh and the shape.
///
/// ```
/// use tpar_placements::{plan, Placement::*, ReduceOp, StepKind};
/// let p = plan(&[4], &[8, 8], 4, &[Partial(ReduceOp::Sum)], &[Shard(1)]).unwrap();
/// assert_eq!(p.steps.len(), 1);
/// assert_eq!(p.steps[0].kind, StepKind::ReduceScatter { op: ReduceOp::Sum, tensor_dim: 1 });
/// assert_eq!(p.total_bytes(), (64 - 16) * 4);
/// ```
pub fn plan(
    mesh_shape: &[usize],
    global_shape: &[usize],
    elem_bytes: usize,
    src: &[Placement],
    dst: &[Placement],
) -> Result<Plan> {
    use Placement::{Partial, Replicate, Shard};

    let (src, dst) = prepare(mesh_shape, global_shape, src, dst)?;
    let n = mesh_shape.len();
    let mut b = Builder {
        costs: Costs { mesh: mesh_shape, shape: global_shape, elem_bytes: elem_bytes as u64 },
        current: src.clone(),
        steps: Vec::new(),
    };

    // Mesh dims left of `i` shard tensor dim `d` identically in src and dst.
    let left_aligned =
        |i: usize, d: isize| (0..i).all(|m| src[m].is_shard_dim(d) == dst[m].is_shard_dim(d));
    let keeps = |i: usize| {
        src[i] == dst[i]
            && match src[i] {
                Shard(d) => left_aligned(i, d),
                _ => true,
            }
    };

    // Pass 1: right to left.
    for i in (0..n).rev() {
        if keeps(i) {
            continue;
        }
        // The state the left-to-right pass would see at mesh dim `i`: dims
        // left of it at their targets, dims right of it as this pass leaves them.
        let later = |cur: &[Placement]| {
            let mut s = dst[..i].to_vec();
            s.extend_from_slice(&cur[i..]);
            s
        };
        match (b.current[i], dst[i]) {
            (Shard(d), Partial(ReduceOp::Sum)) => {
                // Dims right of `i` sharding `d` were gathered above (they cannot keep).
                b.push(i, StepKind::ZeroPad { tensor_dim: d as usize });
            }
            (Shard(d), target) => {
                if let Shard(e) = target {
                    let touches = |p: Placement| p == Shard(d) || p == Shard(e);
                    let free = (0..n)
                        .filter(|&m| m != i)
                        .all(|m| !touches(b.current[m]) && !touches(dst[m]));
                    if e != d && free {
                        let a2a = StepKind::AllToAll { from_dim: d as usize, to_dim: e as usize };
                        let gather = StepKind::AllGather { tensor_dim: d as usize };
                        if b.costs.bytes(i, a2a, &b.current) <= b.costs.bytes(i, gather, &b.current)
                        {
                            b.push(i, a2a);
                            continue;
                        }
                    }
                }
                b.push(i, StepKind::AllGather { tensor_dim: d as usize });
            }
            (Partial(op), Replicate | Partial(_)) => {
                // An all_reduce is valid at any time; run it where the local
                // tensor is smallest (here, or in pass 2).
                let kind = StepKind::AllReduce { op };
                if b.costs.bytes(i, kind, &b.current) <= b.costs.bytes(i, kind, &later(&b.current))
                {
                    b.push(i, kind);
                    if let Partial(to) = dst[i] {
                        b.push(i, StepKind::Partialize { op: to });
                    }
                }
            }
            (Partial(op), Shard(e)) => {
                let rs = StepKind::ReduceScatter { op, tensor_dim: e as usize };
                let deferred = b.costs.bytes(i, rs, &later(&b.current));
                if left_aligned(i, e) {
                    // The mesh dims left of `i` already shard `e` as dst does.
                    if b.costs.bytes(i, rs, &b.current) <= deferred {
                        b.push(i, rs);
                    }
                } else {
                    // reduce_scatter must wait for pass 2; reducing now (and
                    // slicing in pass 2) is PyTorch's choice, taken only when
                    // strictly cheaper.
                    let ar = StepKind::AllReduce { op };
                    if b.costs.bytes(i, ar, &b.current) < deferred {
                        b.push(i, ar);
                    }
                }
            }
            (Replicate, _) => {}
        }
    }

    // Pass 2: left to right.
    b.finish_left_to_right(&dst);
    Ok(b.finish(src, dst, elem_bytes))
}

/// The baseline plan: right to left, gather every `Shard` and all-reduce
/// every `Partial` to `Replicate`; then left to right, slice or partialize
/// to `dst`. Always correct, never cheaper than [`plan`]; useful as a
/// reference and to measure what the planner saves.
///
/// # Errors
/// As [`plan`].
pub fn naive_plan(
    mesh_shape: &[usize],
    global_shape: &[usize],
    elem_bytes: usize,
    src: &[Placement],
    dst: &[Placement],
) -> Result<Plan> {
    let (src, dst) = prepare(mesh_shape, global_shape, src, dst)?;
    let mut b = Builder {
        costs: Costs { mesh: mesh_shape, shape: global_shape, elem_bytes: elem_bytes as u64 },
        current: src.clone(),
        steps: Vec::new(),
    };
    if src != dst {
        for i in (0..mesh_shape.len()).rev() {
            match b.current[i] {
                Placement::Shard(d) => b.push(i, StepKind::AllGather { tensor_dim: d as usize }),
                Placement::Partial(op) => b.push(i, StepKind::AllReduce { op }),
                Placement::Replicate => {}
            }
        }
        b.finish_left_to_right(&dst);
    }
    Ok(b.finish(src, dst, elem_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PlacementError;
    use Placement::*;

    const SUM: ReduceOp = ReduceOp::Sum;

    fn kinds(p: &Plan) -> Vec<(usize, StepKind)> {
        p.steps.iter().map(|s| (s.mesh_dim, s.kind)).collect()
    }

    #[test]
    fn explain_text() {
        let p = plan(&[2, 2], &[2048, 1024], 4, &[Shard(0), Replicate], &[Replicate, Replicate])
            .unwrap();
        assert_eq!(p.explain(), "S(0)R -> RR (all_gather on mesh dim 0, tensor dim 0, 4.0 MiB)");
        assert_eq!(p.to_string(), p.explain());

        let p =
            plan(&[2, 4], &[8, 16], 2, &[Partial(SUM), Shard(0)], &[Shard(1), Shard(-1)]).unwrap();
        assert_eq!(
            p.explain(),
            "P(sum)S(0) -> P(sum)R (all_gather on mesh dim 1, tensor dim 0, 192 B)\n\
             P(sum)R -> S(1)R (reduce_scatter(sum) on mesh dim 0, tensor dim 1, 128 B)\n\
             S(1)R -> S(1)S(1) (local_slice on mesh dim 1, tensor dim 1, no communication)"
        );
        assert_eq!(p.total_bytes(), 320);
        assert_eq!(p.bytes_per_mesh_dim(), [128, 192]);
        assert_eq!(p.num_collectives(), 2);

        let p = plan(&[2], &[4], 4, &[Shard(-1)], &[Shard(0)]).unwrap();
        assert!(p.is_empty());
        assert_eq!(p.explain(), "S(0) -> S(0) (nothing to do)");

        let p = plan(&[3], &[3, 1024], 1, &[Replicate], &[Partial(ReduceOp::Max)]).unwrap();
        assert_eq!(p.explain(), "R -> P(max) (partialize(max) on mesh dim 0, no communication)");
        let p = plan(&[4], &[8, 8], 4, &[Shard(0)], &[Shard(1)]).unwrap();
        assert_eq!(p.explain(), "S(0) -> S(1) (all_to_all on mesh dim 0, tensor dim 0 -> 1, 48 B)");
        let p = plan(&[4], &[1024, 1024], 4, &[Partial(ReduceOp::Avg)], &[Replicate]).unwrap();
        assert_eq!(p.explain(), "P(avg) -> R (all_reduce(avg) on mesh dim 0, 6.0 MiB)");
    }

    #[test]
    fn fmt_bytes_units() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(1536), "1.5 KiB");
        assert_eq!(fmt_bytes(4 << 20), "4.0 MiB");
        assert_eq!(fmt_bytes(3 << 30), "3.0 GiB");
        assert_eq!(fmt_bytes(5 << 40), "5.0 TiB");
        assert_eq!(fmt_bytes(5 << 50), "5120.0 TiB");
    }

    #[test]
    fn partial_to_shard_is_one_reduce_scatter() {
        for op in ReduceOp::PARTIAL {
            let p = plan(&[3], &[7, 5], 4, &[Partial(op)], &[Shard(1)]).unwrap();
            assert_eq!(kinds(&p), [(0, StepKind::ReduceScatter { op, tensor_dim: 1 })]);
            // 35 elements in, chunk 0 of 5 columns over 3 ranks is 2 columns.
            assert_eq!(p.total_bytes(), (35 - 14) * 4);
        }
    }

    #[test]
    fn shard_to_shard_is_one_all_to_all() {
        let p = plan(&[2], &[6, 4], 4, &[Shard(0)], &[Shard(1)]).unwrap();
        assert_eq!(kinds(&p), [(0, StepKind::AllToAll { from_dim: 0, to_dim: 1 })]);
        // Local 3x4, keeps 3x2.
        assert_eq!(p.total_bytes(), 6 * 4);
    }

    #[test]
    fn nested_sharding_is_undone_innermost_first() {
        let p = plan(&[2, 2], &[9, 4], 4, &[Shard(0), Shard(0)], &[Replicate, Shard(0)]).unwrap();
        assert_eq!(
            kinds(&p),
            [
                (1, StepKind::AllGather { tensor_dim: 0 }),
                (0, StepKind::AllGather { tensor_dim: 0 }),
                (1, StepKind::LocalSlice { tensor_dim: 0 }),
            ]
        );
        // Rank (0,0) holds 3 of 5 rows, gathers 2; then holds 5 of 9, gathers 4.
        assert_eq!(p.steps[0].bytes, 2 * 4 * 4);
        assert_eq!(p.steps[1].bytes, 4 * 4 * 4);

        // Keeping the outer shard: only the inner one moves.
        let p = plan(&[2, 2], &[9, 4], 4, &[Shard(0), Shard(0)], &[Shard(0), Replicate]).unwrap();
        assert_eq!(kinds(&p), [(1, StepKind::AllGather { tensor_dim: 0 })]);

        // Swapping the order of two mesh dims sharding one tensor dim.
        let p = plan(&[2, 3], &[9], 4, &[Shard(0), Replicate], &[Replicate, Shard(0)]).unwrap();
        assert_eq!(
            kinds(&p),
            [
                (0, StepKind::AllGather { tensor_dim: 0 }),
                (1, StepKind::LocalSlice { tensor_dim: 0 }),
            ]
        );
    }

    #[test]
    fn partial_reduced_where_smallest() {
        // All-reduce while mesh dim 0 still shards: half the bytes.
        let p =
            plan(&[2, 2], &[8, 8], 4, &[Shard(0), Partial(SUM)], &[Replicate, Replicate]).unwrap();
        assert_eq!(
            kinds(&p),
            [(1, StepKind::AllReduce { op: SUM }), (0, StepKind::AllGather { tensor_dim: 0 }),]
        );
        // After slicing mesh dim 0 the all-reduce is cheaper.
        let p =
            plan(&[2, 2], &[8, 8], 4, &[Replicate, Partial(SUM)], &[Shard(0), Replicate]).unwrap();
        assert_eq!(
            kinds(&p),
            [(0, StepKind::LocalSlice { tensor_dim: 0 }), (1, StepKind::AllReduce { op: SUM }),]
        );
        // Partial -> Partial of another op.
        let p = plan(&[2], &[8], 4, &[Partial(SUM)], &[Partial(ReduceOp::Max)]).unwrap();
        assert_eq!(
            kinds(&p),
            [(0, StepKind::AllReduce { op: SUM }), (0, StepKind::Partialize { op: ReduceOp::Max }),]
        );
        // Same partial stays.
        assert!(plan(&[2], &[8], 4, &[Partial(SUM)], &[Partial(SUM)]).unwrap().is_empty());
    }

    #[test]
    fn naive_plan_gathers_everything() {
        let p = naive_plan(&[2, 2], &[8, 8], 4, &[Shard(0), Partial(SUM)], &[Shard(1), Shard(0)])
            .unwrap();
        assert_eq!(
            kinds(&p),
            [
                (1, StepKind::AllReduce { op: SUM }),
                (0, StepKind::AllGather { tensor_dim: 0 }),
                (0, StepKind::LocalSlice { tensor_dim: 1 }),
                (1, StepKind::LocalSlice { tensor_dim: 0 }),
            ]
        );
        assert!(naive_plan(&[2], &[8], 4, &[Shard(0)], &[Shard(0)]).unwrap().is_empty());
    }

    #[test]
    fn errors_name_everything() {
        let e =
            plan(&[2, 2], &[8, 16], 4, &[Shard(0), Replicate], &[Replicate, Shard(3)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "placements S(0)R -> RS(3) on mesh [2, 2]: tensor dim 3 out of range for shape [8, 16]"
        );
        assert!(matches!(e, PlacementError::DimOutOfRange { dim: 3, rank: 2, .. }));
        let e = plan(&[2, 2], &[8], 4, &[Shard(0)], &[Replicate, Replicate]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "placements S(0) -> RR on mesh [2, 2]: 1 placements for the 2-d mesh [2, 2]"
        );
        let e = plan(&[0], &[8], 4, &[Shard(0)], &[Replicate]).unwrap_err();
        assert!(matches!(e, PlacementError::EmptyMeshDim { .. }), "{e}");
    }

    #[test]
    fn plans_are_cacheable_values() {
        use std::collections::HashMap;
        let p = plan(&[2, 2], &[8, 8], 4, &[Shard(0), Shard(-1)], &[Replicate, Shard(0)]).unwrap();
        let key = p.key();
        assert_eq!(key.src, [Shard(0), Shard(1)]);
        let mut cache = HashMap::new();
        cache.insert(key.clone(), p.clone());
        assert_eq!(cache[&key], key.plan().unwrap());
    }

    #[test]
    fn zero_dim_mesh_and_scalars() {
        assert!(plan(&[], &[3], 4, &[], &[]).unwrap().is_empty());
        let p = plan(&[2], &[], 4, &[Partial(SUM)], &[Replicate]).unwrap();
        assert_eq!(kinds(&p), [(0, StepKind::AllReduce { op: SUM })]);
        assert_eq!(p.total_bytes(), 4);
    }
}
