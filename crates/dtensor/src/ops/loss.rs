//! Cross-entropy, vocab-parallel (PyTorch's `loss_parallel`) when the logits are
//! sharded on the vocab dim: the logits are never gathered, forward or backward.

use tpar_mesh::DeviceMesh;
use tpar_placements::{Placement, ReduceOp};
use tpar_tensor::autograd::{
    incoming_grad_replicated, record_replication_aware, set_input_grad_replicated,
};
use tpar_tensor::{DType, Tensor, TensorError};

use super::{choose, finish, global_shape, meta, no_rule, prepare_all, Strategy};
use crate::{DTensor, Result};

use Placement::{Replicate, Shard};

/// Where the (prepared) logits are sharded, and what the local steps need.
#[derive(Clone)]
struct Layout {
    mesh: DeviceMesh,
    /// Mesh dims sharding the vocab (last) dim.
    vocab_dims: Vec<usize>,
    /// Mesh dims sharding a row dim.
    row_dims: Vec<usize>,
    vocab: usize,
    vocab_start: i64,
    ignore_index: i64,
    /// The dtype the per-row statistics cross the wire in: f32 with the CUDA kernels
    /// (f32, bf16 or f16 logits on a CUDA device), f64 otherwise (f32 statistics widened
    /// for the reduction and rounded back, f64 statistics as they are).
    wire: DType,
}

/// `t` (a tensor on any device) all-reduced with `op` over each of `dims` in turn.
fn all_reduce_tensor(mesh: &DeviceMesh, dims: &[usize], t: Tensor, op: ReduceOp) -> Result<Tensor> {
    let mut t = t;
    for &m in dims {
        t = mesh.group(m)?.all_reduce(&t, op)?;
    }
    Ok(t)
}

/// Statistics `t` all-reduced with `op` over each of `dims` in turn, in the `wire` dtype,
/// and returned in their own dtype.
fn all_reduce_stats(
    mesh: &DeviceMesh,
    dims: &[usize],
    t: Tensor,
    op: ReduceOp,
    wire: DType,
) -> Result<Tensor> {
    if dims.is_empty() {
        return Ok(t);
    }
    let dtype = t.dtype();
    let r = all_reduce_tensor(mesh, dims, t.to_dtype(wire)?, op)?;
    Ok(r.to_dtype(dtype)?)
}

impl Layout {
    /// The mesh dims sharding the logits (vocab and rows), sorted: a loss gradient that is
    /// a contribution is summed over them.
    fn grad_dims(&self) -> Vec<usize> {
        let mut dims = [self.vocab_dims.clone(), self.row_dims.clone()].concat();
        dims.sort_unstable();
        dims
    }

    /// The group the loss is Replicate over, on a 1-d mesh: its gradient may come back
    /// held in full there (`DTensor::backward_full_seed`'s seed).
    fn loss_group(&self) -> Option<u64> {
        crate::redistribute::replicated_tag(&self.mesh).map(|t| t.group)
    }
}

/// The local forward and the recorded backward, on any device: the per-row statistics,
/// the log-sum-exp, the loss sums and the gradient are tensor ops (the CUDA kernels for
/// f32, bf16 or f16 logits on a CUDA device, with f32 statistics and sums: nothing is
/// read back, a bad target is found through a 4-byte status read; the CPU kernels
/// otherwise, with statistics in the logits' accumulator type and f64 sums); the
/// all_reduces carry tensors on the logits' device.
fn run(logits: &Tensor, targets: &Tensor, lay: Layout) -> Result<Tensor> {
    let (max, sumexp, tl) =
        logits.ce_shard_stats(targets, lay.vocab_start, lay.vocab, lay.ignore_index)?;
    let (max, sumexp, tl) = if lay.vocab_dims.is_empty() {
        (max, sumexp, tl)
    } else {
        // loss_parallel: global max, sum-exp rescaled to it, target logit from its owner.
        let (mesh, dims, wire) = (&lay.mesh, &lay.vocab_dims, lay.wire);
        let gmax = all_reduce_stats(mesh, dims, max.clone(), ReduceOp::Max, wire)?;
        let sumexp = Tensor::ce_rescale(&max, &sumexp, &gmax)?;
        let sumexp = all_reduce_stats(mesh, dims, sumexp, ReduceOp::Sum, wire)?;
        let tl = all_reduce_stats(mesh, dims, tl, ReduceOp::Sum, wire)?;
        (gmax, sumexp, tl)
    };
    let lse = Tensor::ce_lse(&max, &sumexp)?;
    // [loss total, counted rows]
    let sums = Tensor::ce_loss_sums(&lse, &tl, targets, lay.ignore_index)?;
    let sums = all_reduce_tensor(&lay.mesh, &lay.row_dims, sums, ReduceOp::Sum)?;
    // total / max(count, 1): with no counted row the total is 0 and so is the loss.
    let count = sums.narrow(0, 1, 1)?.clamp_min(1.0)?;
    let loss = sums.narrow(0, 0, 1)?.div(&count)?.reshape(Vec::<usize>::new())?;
    let out = loss.to_dtype(logits.dtype())?;
    let stats_dtype = lse.dtype();
    let (x, t) = (logits.detach(), targets.detach());
    let (grad_dims, group) = (lay.grad_dims(), lay.loss_group());
    Ok(record_replication_aware("cross_entropy", &[logits], out, group, move |g| {
        // A gradient held in full is the gradient. Otherwise the local gradient is a
        // contribution: sum it over the mesh dims where the logits are sharded (each
        // rank's block needs the full gradient); on replicated mesh dims the contribution
        // flows on as is. Then `(softmax - onehot) * g / count` on the local vocab slice
        // (with no counted row every row is ignored and its gradient is zero).
        let (g, full) = loss_grad_in(g, group, grad_dims.is_empty())?;
        let g = g.to_dtype(count.dtype())?.reshape([1])?;
        let g = if full { g } else { all_reduce_tensor(&lay.mesh, &grad_dims, g, ReduceOp::Sum)? };
        let scale = g.div(&count)?.to_dtype(stats_dtype)?;
        let dl = x.ce_shard_backward(&t, lay.vocab_start, lay.ignore_index, &lse, &scale)?;
        Ok(vec![Some(dl)])
    }))
}

/// The loss gradient a cross-entropy backward starts from, and whether it is held in full
/// over the loss's own replication `group` (then it is the gradient, not a contribution
/// to sum). A gradient held in full over another group is demoted to the plain
/// convention. When the logits are replicated too (`replicated_logits`), their gradient
/// is marked held in full as well.
fn loss_grad_in(
    g: &Tensor,
    group: Option<u64>,
    replicated_logits: bool,
) -> std::result::Result<(Tensor, bool), TensorError> {
    let incoming = incoming_grad_replicated();
    let full = incoming.filter(|t| Some(t.group) == group);
    let g = match (incoming, full) {
        (Some(t), None) => t.demote(g.clone())?,
        _ => g.clone(),
    };
    if let (Some(t), true) = (full, replicated_logits) {
        set_input_grad_replicated(0, t);
    }
    Ok((g, full.is_some()))
}

impl DTensor {
    /// Cross-entropy of logits `[..., vocab]` against i64 `targets` `[...]`, averaged over
    /// the targets that are not `ignore_index` (0 when all are). The loss is a 0-dim
    /// `Replicate` `DTensor`.
    ///
    /// Rules per mesh dim (operands `logits`, `targets`):
    /// * `S(-1)`, `R` — **loss_parallel**: each rank computes per-row statistics of its
    ///   vocab slice; forward issues three all_reduces of `rows` values each (max with
    ///   MAX; the sum of exponentials, rescaled to the global max, with SUM; the target
    ///   logit, non-zero only on the rank owning the target column, with SUM). The logits
    ///   are never gathered. Backward: one all_reduce of the scalar loss gradient (none
    ///   when it is held in full, as [`DTensor::backward_full_seed`] seeds a loss on a
    ///   1-d mesh),
    ///   then `(softmax - onehot) * grad / count` on the local vocab slice only.
    /// * `S(d)`, `S(d)` with `d` a row dim: forward one all_reduce of `[loss sum,
    ///   count]`; backward one all_reduce of the scalar loss gradient (none when it is
    ///   held in full).
    /// * `R`, `R`: the plain op, no communication.
    ///
    /// Other layouts are redistributed to the cheapest of these (implicit; partial
    /// logits are reduce-scattered onto the vocab dim). `Partial` targets are an error.
    ///
    /// On a CUDA device (f32, bf16 or f16 logits) forward and backward run with the
    /// device kernels and f32 statistics, and the all_reduces carry device tensors:
    /// nothing is read back to the host. Otherwise the CPU kernels compute (through host
    /// copies for f64 logits on a CUDA device), with statistics in the logits'
    /// accumulator type (f32, or f64 for f64 logits) all-reduced in f64, and f64 sums.
    /// Both are the tensor ops `Tensor::ce_*`.
    pub fn cross_entropy(&self, targets: &DTensor, ignore_index: i64) -> Result<DTensor> {
        let op = "cross_entropy";
        let operands = [("logits", self), ("targets", targets)];
        let out_shape = global_shape(op, &operands, || {
            Ok(meta(self)?.cross_entropy(&meta(targets)?, ignore_index)?)
        })?;
        if targets.placements().iter().any(|p| p.is_partial()) {
            return Err(no_rule(op, &operands, "targets cannot be Partial"));
        }
        let last = self.shape().len() - 1;
        let (targets_pl, _) = choose(op, &operands, |_| {
            let mut c = vec![
                Strategy::new(vec![Replicate, Replicate], Replicate),
                Strategy::new(vec![Shard(last as isize), Replicate], Replicate),
            ];
            for d in 0..last {
                c.push(Strategy::new(vec![Shard(d as isize); 2], Replicate));
            }
            c
        })?;
        let ins = prepare_all(op, &operands, &targets_pl)?;
        let logits_pl = &targets_pl[0];
        let dims_where = |f: &dyn Fn(usize) -> bool| -> Vec<usize> {
            logits_pl
                .iter()
                .enumerate()
                .filter_map(|(m, p)| p.shard_dim().filter(|&d| f(d as usize)).map(|_| m))
                .collect()
        };
        let (l, t) = (ins[0].local(), ins[1].local());
        if !l.dtype().is_float() {
            return Err(no_rule(op, &operands, "logits must be a float dtype"));
        }
        let on_device = matches!(l.device(), tpar_tensor::Device::Cuda(_))
            && matches!(l.dtype(), DType::F32 | DType::BF16 | DType::F16);
        let (_, offset) = ins[0].spec().local_shape_and_offset()?;
        let lay = Layout {
            mesh: self.mesh().clone(),
            vocab_dims: dims_where(&|d| d == last),
            row_dims: dims_where(&|d| d != last),
            vocab: self.shape()[last],
            vocab_start: offset[last] as i64,
            ignore_index,
            wire: if on_device { DType::F32 } else { DType::F64 },
        };
        let loss = run(l, t, lay)?;
        let rep = vec![Replicate; self.mesh().ndim()];
        finish(loss, self.mesh(), &rep, &out_shape)
    }
}
