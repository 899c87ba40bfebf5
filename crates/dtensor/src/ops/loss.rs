//! Cross-entropy, vocab-parallel (PyTorch's `loss_parallel`) when the logits are
//! sharded on the vocab dim: the logits are never gathered, forward or backward.

use tpar_kernels::cross_entropy as ce;
use tpar_kernels::{Acc, Float};
use tpar_mesh::DeviceMesh;
use tpar_placements::{Placement, ReduceOp};
use tpar_tensor::autograd::{
    incoming_grad_replicated, record_replication_aware, set_input_grad_replicated,
};
use tpar_tensor::{DType, Element, Tensor, TensorError};

use super::{choose, finish, global_shape, meta, no_rule, prepare_all, Strategy};
use crate::{DTensor, Result};

use Placement::{Replicate, Shard};

/// Where the (prepared) logits are sharded, and what the local kernels need.
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
}

fn kernel(e: tpar_kernels::KernelError) -> TensorError {
    TensorError::from(e)
}

/// `v` all-reduced with `op` over each of `dims` in turn (f64 on the wire).
fn all_reduce(mesh: &DeviceMesh, dims: &[usize], v: Vec<f64>, op: ReduceOp) -> Result<Vec<f64>> {
    if dims.is_empty() {
        return Ok(v);
    }
    let n = v.len();
    let mut t = Tensor::from_vec(v, [n])?;
    for &m in dims {
        t = mesh.group(m)?.all_reduce(&t, op)?;
    }
    Ok(t.to_vec::<f64>()?)
}

fn widen<A: Acc>(v: &[A]) -> Vec<f64> {
    v.iter().map(|x| x.f64()).collect()
}

fn narrow<A: Acc>(v: &[f64]) -> Vec<A> {
    v.iter().map(|&x| A::of(x)).collect()
}

/// `t` (a tensor on any device) all-reduced with `op` over each of `dims` in turn.
fn all_reduce_tensor(mesh: &DeviceMesh, dims: &[usize], t: Tensor, op: ReduceOp) -> Result<Tensor> {
    let mut t = t;
    for &m in dims {
        t = mesh.group(m)?.all_reduce(&t, op)?;
    }
    Ok(t)
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

/// The local forward and the recorded backward on a CUDA device (f32, bf16 or f16
/// logits): the steps of [`run`] with device kernels and f32 statistics, the all_reduces
/// on device tensors; nothing is read back (a bad target is found through a 4-byte
/// status read, as the plain device op does).
fn run_device(logits: &Tensor, targets: &Tensor, lay: Layout) -> Result<Tensor> {
    let (max, sumexp, tl) =
        logits.ce_shard_stats(targets, lay.vocab_start, lay.vocab, lay.ignore_index)?;
    let (max, sumexp, tl) = if lay.vocab_dims.is_empty() {
        (max, sumexp, tl)
    } else {
        // loss_parallel: global max, sum-exp rescaled to it, target logit from its owner.
        let gmax = all_reduce_tensor(&lay.mesh, &lay.vocab_dims, max.clone(), ReduceOp::Max)?;
        let sumexp = Tensor::ce_rescale(&max, &sumexp, &gmax)?;
        let sumexp = all_reduce_tensor(&lay.mesh, &lay.vocab_dims, sumexp, ReduceOp::Sum)?;
        let tl = all_reduce_tensor(&lay.mesh, &lay.vocab_dims, tl, ReduceOp::Sum)?;
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
    let (x, t) = (logits.detach(), targets.detach());
    let (grad_dims, group) = (lay.grad_dims(), lay.loss_group());
    Ok(record_replication_aware("cross_entropy", &[logits], out, group, move |g| {
        // As in `run`: a gradient held in full is the gradient; otherwise the loss
        // gradient is summed over the sharded mesh dims. Then `(softmax - onehot) * g /
        // count` on the local vocab slice.
        let (g, full) = loss_grad_in(g, group, grad_dims.is_empty())?;
        let g = g.to_dtype(DType::F32)?.reshape([1])?;
        let g = if full { g } else { all_reduce_tensor(&lay.mesh, &grad_dims, g, ReduceOp::Sum)? };
        let scale = g.div(&count)?;
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

/// The local forward and the recorded backward for element type `T`.
fn run<T: Float + Element>(logits: &Tensor, targets: &Tensor, lay: Layout) -> Result<Tensor> {
    let rows = targets.numel();
    let v_local = logits.dims().last().copied().unwrap_or(0);
    let zero = T::Acc::of(0.0);
    let (mut max, mut sumexp, mut tl) = (vec![zero; rows], vec![zero; rows], vec![zero; rows]);
    logits.with_data::<T, _>(|ls| {
        targets.with_data::<i64, _>(|ts| {
            ce::ce_local_stats(
                ls,
                rows,
                v_local,
                ts,
                lay.vocab_start,
                lay.vocab,
                lay.ignore_index,
                &mut max,
                &mut sumexp,
                &mut tl,
            )
            .map_err(kernel)
        })
    })???;
    if !lay.vocab_dims.is_empty() {
        // loss_parallel: global max, sum-exp rescaled to it, target logit from its owner.
        let gmax: Vec<T::Acc> =
            narrow(&all_reduce(&lay.mesh, &lay.vocab_dims, widen(&max), ReduceOp::Max)?);
        ce::ce_rescale(&max, &mut sumexp, &gmax).map_err(kernel)?;
        sumexp = narrow(&all_reduce(&lay.mesh, &lay.vocab_dims, widen(&sumexp), ReduceOp::Sum)?);
        tl = narrow(&all_reduce(&lay.mesh, &lay.vocab_dims, widen(&tl), ReduceOp::Sum)?);
        max = gmax;
    }
    let mut lse = vec![zero; rows];
    ce::ce_lse(&max, &sumexp, &mut lse).map_err(kernel)?;
    let (mut total, mut count) = (0.0f64, 0.0f64);
    targets.with_data::<i64, _>(|ts| {
        for ((&t, &l), &x) in ts.iter().zip(&lse).zip(&tl) {
            if t != lay.ignore_index {
                total += (l - x).f64();
                count += 1.0;
            }
        }
    })?;
    if !lay.row_dims.is_empty() {
        let s = all_reduce(&lay.mesh, &lay.row_dims, vec![total, count], ReduceOp::Sum)?;
        (total, count) = (s[0], s[1]);
    }
    let loss = if count == 0.0 { 0.0 } else { total / count };
    // Host kernels: on a CUDA device only for dtypes without device kernels (f64),
    // through host copies (counted host round trips).
    let device = logits.device();
    let out = Tensor::from_f64(&[loss], Vec::<usize>::new(), logits.dtype())?.to_device(device)?;
    let (x, t) = (logits.detach(), targets.detach());
    let (grad_dims, group) = (lay.grad_dims(), lay.loss_group());
    Ok(record_replication_aware("cross_entropy", &[logits], out, group, move |g| {
        // A gradient held in full is the gradient. Otherwise the local gradient is a
        // contribution: sum it over the mesh dims where the logits are sharded (each
        // rank's block needs the full gradient); on replicated mesh dims the contribution
        // flows on as is.
        let (g, full) = loss_grad_in(g, group, grad_dims.is_empty())?;
        let g = if full {
            g.item()?
        } else {
            all_reduce(&lay.mesh, &grad_dims, vec![g.item()?], ReduceOp::Sum)?[0]
        };
        let scale = if count == 0.0 { 0.0 } else { g / count };
        let row_scale = [T::Acc::of(scale)];
        let dl = x.with_data::<T, _>(|ls| {
            t.with_data::<i64, _>(|ts| {
                ce::cross_entropy_backward_new(
                    ls,
                    rows,
                    v_local,
                    ts,
                    lay.vocab_start,
                    lay.ignore_index,
                    &lse,
                    &row_scale,
                )
                .map_err(kernel)
            })
        })???;
        Ok(vec![Some(Tensor::from_vec(dl, x.shape().clone())?.to_device(device)?)])
    }))
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
    /// nothing is read back to the host.
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
        let (_, offset) = ins[0].spec().local_shape_and_offset()?;
        let lay = Layout {
            mesh: self.mesh().clone(),
            vocab_dims: dims_where(&|d| d == last),
            row_dims: dims_where(&|d| d != last),
            vocab: self.shape()[last],
            vocab_start: offset[last] as i64,
            ignore_index,
        };
        let (l, t) = (ins[0].local(), ins[1].local());
        let on_device = matches!(l.device(), tpar_tensor::Device::Cuda(_))
            && matches!(l.dtype(), DType::F32 | DType::BF16 | DType::F16);
        let loss = match self.dtype() {
            _ if on_device => run_device(l, t, lay)?,
            DType::F32 => run::<f32>(l, t, lay)?,
            DType::F64 => run::<f64>(l, t, lay)?,
            DType::BF16 => run::<half::bf16>(l, t, lay)?,
            DType::F16 => run::<half::f16>(l, t, lay)?,
            DType::I64 => return Err(no_rule(op, &operands, "logits must be a float dtype")),
        };
        let rep = vec![Replicate; self.mesh().ndim()];
        finish(loss, self.mesh(), &rep, &out_shape)
    }
}
