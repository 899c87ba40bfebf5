//! `loss_parallel`: cross-entropy on vocab-sharded logits without gathering them, and
//! the matching backward entry point.

use tpar_dtensor::{DTensor, Placement};
use tpar_mesh::DeviceMesh;
use tpar_nn::{NnError, Value};
use tpar_tensor::Tensor;

/// Mean cross-entropy of `logits` (`[..., vocab]`) against i64 `targets`, ignoring
/// `ignore_index`. Vocab-sharded DTensor logits (a `ColwiseParallel` lm_head with
/// `use_local_output = false`) use the loss_parallel algorithm: per-rank max, sum-exp
/// and target logit, each reduced with one all_reduce of a `[rows]` vector, never the
/// logits; the result is a `Replicate` DTensor. Plain logits use the plain op.
pub fn cross_entropy(
    logits: &Value,
    targets: &Tensor,
    ignore_index: i64,
) -> tpar_nn::Result<Value> {
    match logits {
        Value::Tensor(l) => Ok(Value::Tensor(l.cross_entropy(targets, ignore_index)?)),
        Value::DTensor(l) => {
            let n = l.mesh().ndim();
            let t = DTensor::from_local(
                targets,
                l.mesh(),
                &vec![Placement::Replicate; n],
                Some(targets.dims()),
            )?;
            Ok(Value::DTensor(l.cross_entropy(&t, ignore_index)?))
        }
        other => Err(NnError::BadInput {
            module: "cross_entropy".into(),
            what: format!("logits must be a tensor, got {other:?}"),
        }),
    }
}

/// Backpropagates a scalar loss of a model parallelized over `mesh`: a DTensor loss
/// seeds its own placements ([`DTensor::backward`]); a plain loss (the same value on
/// every rank) is treated as `Replicate` on `mesh`, so its gradient contributions add up
/// to one gradient however many ranks computed it.
pub fn backward(loss: &Value, mesh: &DeviceMesh) -> tpar_nn::Result<()> {
    match loss {
        Value::DTensor(d) => Ok(d.backward()?),
        Value::Tensor(t) => {
            let rep = vec![Placement::Replicate; mesh.ndim()];
            Ok(DTensor::from_local(t, mesh, &rep, Some(t.dims()))?.backward()?)
        }
        other => Err(NnError::BadInput {
            module: "backward".into(),
            what: format!("loss must be a tensor, got {other:?}"),
        }),
    }
}
