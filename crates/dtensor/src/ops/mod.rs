//! Ops on [`DTensor`]s with sharding propagation.
//!
//! Every op is "the plain [`Tensor`] op on the local shards, plus an output spec from a
//! sharding rule". A rule picks, for each mesh dim independently, one *strategy*: the
//! placement each operand must have on that mesh dim and the placement the output then
//! has. When an operand is not laid out as the chosen strategy needs, it is redistributed
//! first:
//!
//! * a redistribution **without communication** (`Replicate -> Shard` is a local slice,
//!   `Replicate -> Partial` keeps the value on coordinate 0, `Shard -> Partial(sum)`
//!   zero-pads) is simply done: it is how a replicated bias meets a sharded activation;
//! * a redistribution **with communication** is an *implicit redistribution*: it is
//!   recorded on this thread's trace ([`crate::implicit_redistributions`]) or, inside
//!   [`crate::strict`], returned as [`DTensorError::ImplicitRedistribution`] naming the
//!   op, the operand and both placements. (Collectives over a mesh dim of size 1 move
//!   nothing and do not count.)
//!
//! Where several strategies apply, the cheapest is chosen (no change < local steps <
//! estimated bytes communicated; ties go to the first listed). Every choice depends only
//! on global shapes, placements and the mesh shape, so all ranks choose alike.
//!
//! # Gradients
//!
//! Under the crate's gradient convention (see [`DTensor`]) an op computed as a local op
//! needs no extra communication in backward: a `Replicate` operand's local gradient is
//! its contribution, a sharded one's is its shard, a `Partial` one's the full gradient.
//! The only op that communicates in backward is [`DTensor::cross_entropy`] (one
//! all_reduce of the scalar loss gradient per sharded mesh dim, see there), plus the
//! adjoints of whatever implicit redistributions ran forward.
//!
//! # `Partial` is carried only through ops linear in it
//!
//! `Partial(sum)` and `Partial(avg)` pass through: `neg`, `mul_scalar`, `div_scalar`,
//! `to_dtype`, `P + P` and `P - P` (same op), `P * R`, `R * P`, `P / R`, `sum`/`mean`,
//! `matmul`/`linear` with the other operand `Replicate`, `rope`, `embedding` (a partial
//! table), `scaled_dot_product_attention` (a partial `v`), and every layout op (which
//! also carry `Partial(max|min)`). Everything else first reduces the partial operand
//! (an implicit all_reduce or reduce_scatter): `P + scalar`, `P + R`, `P * P` (one side
//! is reduced), `R / P`, nonlinear unary ops (`exp`, `silu`, `square`, ...), softmax,
//! rms_norm, cross_entropy. A partial is never silently combined with a replicated term.
//!
//! # Rules (one mesh dim; `R` Replicate, `S(d)` Shard(d), `P` Partial(sum|avg))
//!
//! | op | operands | output | communication (forward / backward) |
//! |----|----------|--------|------------------------------------|
//! | [`linear`](DTensor::linear) `x [.., in]`, `w [out, in]`, `b [out]` | `R`, `S(0)`, `S(0)` (colwise) | `S(-1)` | none / none |
//! | | `S(-1)`, `S(1)`, `P` (rowwise; a `R` bias is partialized) | `P(sum)` | none / none |
//! | | `S(d)` (`d` not last), `R`, `R` | `S(d)` | none / none |
//! | | `P`, `R`, `P` or `R`, `P`, `P` | `P` | none / none |
//! | | `R`, `R`, `R` | `R` | none / none |
//! | [`matmul`](DTensor::matmul) `[.., m, k] x [.., k, n]` | `R x S(n)` | `S(-1)` | none |
//! | | `S(m) x R` | `S(-2)` | none |
//! | | `S(k) x S(k)` | `P(sum)` | none |
//! | | `S(b) x S(b)` (batch dim; a broadcast operand stays `R`) | `S(b)` | none |
//! | | `P x R`, `R x P` | `P` | none |
//! | elementwise binary (`add`, `sub`, `mul`, `div`) | `S(d)` with `S(d)`, or with `R` (sliced; a size-1 broadcast dim stays `R`) | `S(d)` | none |
//! | | `R`, `R` | `R` | none |
//! | | `add`/`sub`: `P`, `P` (same op); `mul`: `P`, `R` or `R`, `P`; `div`: `P`, `R` | `P` | none |
//! | | `P + R`, `P + S`, `P * P`, `R / P`, ... | the partial operand is reduced first (implicit) | all_reduce / reduce_scatter |
//! | unary / scalar ops | `S(d)`, `R` pass; `P` passes the linear ones (`neg`, `mul_scalar`, `div_scalar`, `to_dtype`) | same | none |
//! | | `P` into `exp`, `add_scalar`, `square`, ... | `R` (implicit all_reduce first) | all_reduce / all_reduce |
//! | [`sum`](DTensor::sum_dims) / [`mean`](DTensor::mean_dims) | `S(d)`, `d` reduced | `P(sum)` (mean: local sum / global count) | none |
//! | | `S(d)`, `d` kept | `S(d')` (`d'` shifted when `keepdim = false`) | none |
//! | | `R`, `P(sum|avg)` | same | none |
//! | [`softmax`](DTensor::softmax) / [`log_softmax`](DTensor::log_softmax) over `dim` | `S(d)`, `d != dim`; `R` | same | none |
//! | | `S(dim)`, `P` | `R` on that mesh dim (implicit all_gather / all_reduce) | |
//! | [`rms_norm`](DTensor::rms_norm) `x`, `w [D]` | `x` `S(d)` (`d` not last) or `R`; `w` `R` | like `x` | none (w's gradient: contributions) |
//! | | `x` `S(-1)` or `P`; `w` not `R` | redistributed to `R` first (implicit) | |
//! | [`rope`](DTensor::rope) `x` 4-d, full `cos`/`sin` `[seq, hd]` | `S(seq)` (tables narrowed to the local rows), `S(batch)`, `S(heads)`, `R`, `P` | same | none |
//! | | `S(-1)` (head_dim) | `R` first (implicit) | |
//! | [`scaled_dot_product_attention`](DTensor::scaled_dot_product_attention) `q, k, v` `[b, h, s, d]` | `S(1), S(1), S(1)` (kv heads consistent with GQA) | `S(1)` | none |
//! | | `S(0), S(0), S(0)` | `S(0)` | none |
//! | | `S(2), R, R` (query rows; causal masking uses the global offset) | `S(2)` | none |
//! | | `R, R, P` | `P` | none |
//! | [`embedding`](DTensor::embedding) `ids`, `table [V, D]` | `R`, `S(0)` (masked lookup with this rank's vocab offset) | `P(sum)` | none |
//! | | `R`, `S(1)` | `S(-1)` | none |
//! | | `S(d)` or `R`, `R` | like `ids` | none |
//! | | `R`, `P` | `P` | none |
//! | [`cross_entropy`](DTensor::cross_entropy) `logits [.., V]`, `targets [..]` | `S(-1)`, `R` (loss_parallel) | `R` | 3 all_reduces of per-row stats (max, sum-exp, target logit) / 1 all_reduce of the scalar gradient |
//! | | `S(d)`, `S(d)` (rows) | `R` | 1 all_reduce of `[loss sum, count]` / 1 all_reduce of the scalar gradient |
//! | | `R`, `R` | `R` | none / none |
//! | [`transpose`](DTensor::transpose) / [`permute`](DTensor::permute) | `S(d)` | `S(perm⁻¹(d))` | none |
//! | [`unsqueeze`](DTensor::unsqueeze) / [`squeeze`](DTensor::squeeze) | `S(d)` | `S(d')` (a squeezed sharded dim is gathered first) | none |
//! | [`reshape`](DTensor::reshape) / [`view`](DTensor::view) / [`flatten`](DTensor::flatten) | `S(d)`, `d` outermost of its merge/split group and every rank's block maps to one block of the result | `S(d')` (outermost of the result's group) | none |
//! | | otherwise | `R` on that mesh dim first (implicit all_gather) | |
//!
//! Operands on different meshes are [`DTensorError::MeshMismatch`]; operands whose
//! global shapes or dtypes do not fit are [`DTensorError::Op`], naming the op, each
//! operand's global shape and placements, and the mesh.

mod embedding;
mod loss;
mod matmul;
mod nn;
mod pointwise;
mod reduce;
mod view;

use tpar_mesh::DeviceMesh;
use tpar_placements::{fmt_placements, Placement, ReduceOp};
use tpar_tensor::autograd::record;
use tpar_tensor::{no_grad, Device, Tensor};

use crate::{DTensor, DTensorError, Result};

use Placement::{Partial, Replicate, Shard};

/// A named operand, for error messages and the implicit-redistribution trace.
pub(crate) type Operand<'a> = (&'static str, &'a DTensor);

/// One way to run an op on one mesh dim: the placement each operand must have there, and
/// the output's placement on it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Strategy {
    pub inputs: Vec<Placement>,
    pub output: Placement,
}

impl Strategy {
    pub(crate) fn new(inputs: Vec<Placement>, output: Placement) -> Strategy {
        Strategy { inputs, output }
    }
}

/// `Partial(sum)` or `Partial(avg)`: the partials linear ops carry.
pub(crate) fn is_linear_partial(p: Placement) -> bool {
    matches!(p, Partial(ReduceOp::Sum | ReduceOp::Avg))
}

/// The cost of moving one operand's layout on one mesh dim of size `k` from `from` to
/// `to`: 0 when nothing changes, 1 for local steps (and anything on a size-1 mesh dim),
/// and `2 + estimated bytes` for a collective.
fn move_cost(from: Placement, to: Placement, bytes: f64, k: usize) -> f64 {
    if from == to {
        return 0.0;
    }
    if k <= 1 {
        return 1.0;
    }
    let frac = (k - 1) as f64 / k as f64;
    let comm = match (from, to) {
        (Replicate, _) => return 1.0,
        (Shard(_), Partial(ReduceOp::Sum)) => return 1.0,
        (Shard(_), Shard(_)) => bytes * frac / k as f64,
        (Shard(_), _) => bytes * frac,
        (Partial(_), Shard(_)) => bytes * frac,
        (Partial(_), _) => 2.0 * bytes * frac,
    };
    2.0 + comm
}

/// Picks one strategy per mesh dim (the cheapest of `candidates(mesh_dim)`; ties go to
/// the first), returning each operand's target placements and the output placements.
pub(crate) fn choose(
    op: &'static str,
    operands: &[Operand<'_>],
    candidates: impl Fn(usize) -> Vec<Strategy>,
) -> Result<(Vec<Vec<Placement>>, Vec<Placement>)> {
    let mesh = first_mesh(op, operands)?;
    let bytes: Vec<f64> = operands
        .iter()
        .map(|(_, t)| (t.shape().iter().product::<usize>() * t.dtype().size_in_bytes()) as f64)
        .collect();
    let mut targets = vec![Vec::with_capacity(mesh.ndim()); operands.len()];
    let mut out = Vec::with_capacity(mesh.ndim());
    for (m, &k) in mesh.shape().iter().enumerate() {
        let mut best: Option<(f64, Strategy)> = None;
        for s in candidates(m) {
            if s.inputs.len() != operands.len() {
                continue;
            }
            let c: f64 = operands
                .iter()
                .zip(&s.inputs)
                .zip(&bytes)
                .map(|(((_, t), &to), &b)| move_cost(t.placements()[m], to, b, k))
                .sum();
            if best.as_ref().is_none_or(|(bc, _)| c < *bc) {
                best = Some((c, s));
            }
        }
        let Some((_, s)) = best else {
            return Err(no_rule(op, operands, &format!("no sharding strategy on mesh dim {m}")));
        };
        for (t, &p) in targets.iter_mut().zip(&s.inputs) {
            t.push(p);
        }
        out.push(s.output);
    }
    Ok((targets, out))
}

/// The operand laid out as `to`: unchanged if it already is; redistributed on the spot
/// when that needs no communication; otherwise an implicit redistribution (recorded on
/// the trace, or an error in strict mode).
pub(crate) fn prepare(
    op: &'static str,
    what: &str,
    t: &DTensor,
    to: &[Placement],
) -> Result<DTensor> {
    let to = t.spec().with_placements(to)?;
    if to.placements() == t.placements() {
        return Ok(t.clone());
    }
    let plan = t.plan_to(to.placements())?;
    let mesh = t.mesh().shape();
    let communicates = plan
        .steps
        .iter()
        .any(|s| s.kind.is_collective() && mesh.get(s.mesh_dim).is_some_and(|&k| k > 1));
    if communicates {
        t.redistribute_implicit(op, what, to.placements())
    } else {
        t.redistribute(to.placements())
    }
}

/// Prepares every operand for its target placements.
pub(crate) fn prepare_all(
    op: &'static str,
    operands: &[Operand<'_>],
    targets: &[Vec<Placement>],
) -> Result<Vec<DTensor>> {
    operands.iter().zip(targets).map(|((name, t), to)| prepare(op, name, t, to)).collect()
}

/// Wraps an op's local result as a `DTensor`; the local shape is checked against the
/// spec (a wrong rule is an error, never a silently wrong tensor).
pub(crate) fn finish(
    local: Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
    shape: &[usize],
) -> Result<DTensor> {
    DTensor::from_local(&local, mesh, placements, Some(shape))
}

/// `lhs shape [8, 16] as S(1) and rhs shape [16, 4] as S(0) on mesh (tp=2)`.
pub(crate) fn describe(operands: &[Operand<'_>]) -> String {
    let parts: Vec<String> = operands
        .iter()
        .map(|(n, t)| format!("{n} shape {:?} as {}", t.shape(), fmt_placements(t.placements())))
        .collect();
    let mesh = operands.first().map(|(_, t)| t.mesh().to_string()).unwrap_or_default();
    let list = match parts.len() {
        0 => String::new(),
        1 => parts[0].clone(),
        n => format!("{} and {}", parts[..n - 1].join(", "), parts[n - 1]),
    };
    format!("{list} on mesh {mesh}")
}

/// [`DTensorError::Op`] for these operands.
pub(crate) fn no_rule(op: &'static str, operands: &[Operand<'_>], why: &str) -> DTensorError {
    DTensorError::Op { op, operands: describe(operands), why: why.to_string() }
}

fn same_mesh(a: &DeviceMesh, b: &DeviceMesh) -> bool {
    a.shape() == b.shape()
        && a.names() == b.names()
        && a.ranks() == b.ranks()
        && a.device_type() == b.device_type()
}

fn mesh_words(m: &DeviceMesh) -> String {
    format!("{m} over ranks {:?}", m.ranks())
}

/// The operands' common mesh, or [`DTensorError::MeshMismatch`].
pub(crate) fn first_mesh<'a>(op: &'static str, operands: &[Operand<'a>]) -> Result<&'a DeviceMesh> {
    let Some((_, first)) = operands.first() else {
        return Err(DTensorError::InvalidArgument { op, what: "no operands".into() });
    };
    let mesh = first.mesh();
    for (_, t) in &operands[1..] {
        if !same_mesh(mesh, t.mesh()) {
            return Err(DTensorError::MeshMismatch {
                op,
                lhs: mesh_words(mesh),
                rhs: mesh_words(t.mesh()),
            });
        }
    }
    Ok(mesh)
}

/// A meta tensor with the operand's global shape and dtype (no data).
pub(crate) fn meta(t: &DTensor) -> Result<Tensor> {
    Ok(Tensor::empty(t.shape().to_vec(), t.dtype(), Device::Meta)?)
}

/// A meta tensor shaped like a plain tensor.
pub(crate) fn meta_plain(t: &Tensor) -> Result<Tensor> {
    Ok(Tensor::empty(t.shape().clone(), t.dtype(), Device::Meta)?)
}

/// Runs the plain op on meta tensors of the operands' global shapes: validates shapes and
/// dtypes as the unsharded op would, and returns the output's global shape. Errors name
/// the op and the operands' global layouts.
pub(crate) fn global_shape(
    op: &'static str,
    operands: &[Operand<'_>],
    f: impl FnOnce() -> Result<Tensor>,
) -> Result<Vec<usize>> {
    match no_grad(f) {
        Ok(t) => Ok(t.dims().to_vec()),
        Err(DTensorError::Tensor(e)) => Err(no_rule(op, operands, &e.to_string())),
        Err(e) => Err(e),
    }
}

/// Per mesh dim, one `(target, output)` pair: the rule of a one-operand op.
pub(crate) fn unary_rule(
    t: &DTensor,
    rule: impl Fn(Placement) -> (Placement, Placement),
) -> (Vec<Placement>, Vec<Placement>) {
    t.placements().iter().map(|&p| rule(p)).unzip()
}

/// The `(start, len)` of tensor dim `dim` held at every mesh coordinate under `placements`.
pub(crate) fn ranges_at_all_coords(
    t: &DTensor,
    placements: &[Placement],
    dim: usize,
) -> Result<Vec<(usize, usize)>> {
    let spec = t.spec().with_placements(placements)?;
    let mesh = t.mesh();
    (0..mesh.size())
        .map(|flat| {
            let coord = tpar_mesh::unflatten(flat, mesh.shape());
            let (shape, off) = spec.local_at(&coord)?;
            Ok((off.get(dim).copied().unwrap_or(0), shape.get(dim).copied().unwrap_or(0)))
        })
        .collect()
}

/// Zeros of `shape` standing for an op's local result when that result cannot depend on
/// the inputs (an empty output, or an empty contraction): recorded so that every input
/// gets a (zero) gradient, keeping every rank's graph, and so its `grad()` calls, alike.
/// Local shards are empty routinely with uneven sharding; this keeps kernels from ever
/// seeing the degenerate shapes.
pub(crate) fn zeros_recorded(
    op: &'static str,
    inputs: &[&Tensor],
    shape: &[usize],
) -> Result<Tensor> {
    let (dtype, device) = match inputs.first() {
        Some(t) => (t.dtype(), t.device()),
        None => return Err(DTensorError::InvalidArgument { op, what: "no inputs".into() }),
    };
    let z = Tensor::zeros(shape.to_vec(), dtype, device)?;
    let zs = inputs.iter().map(|t| t.zeros_like()).collect::<tpar_tensor::Result<Vec<_>>>()?;
    Ok(record(op, inputs, z, move |_| Ok(zs.iter().cloned().map(Some).collect())))
}
