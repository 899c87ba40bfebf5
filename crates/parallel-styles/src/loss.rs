//! `loss_parallel`: cross-entropy on vocab-sharded logits without gathering them, and
//! the matching backward entry point.

use tpar_mesh::DeviceMesh;
use tpar_nn::{replicated_loss_scope, ReplicatedLossScope, Value};
use tpar_tensor::Tensor;

/// Mean cross-entropy of `logits` (`[..., vocab]`) against i64 `targets`, ignoring
/// `ignore_index` ([`Value::cross_entropy`]). Vocab-sharded DTensor logits (a
/// `ColwiseParallel` lm_head with `use_local_output = false`) use the loss_parallel
/// algorithm: per-rank max, sum-exp and target logit, each reduced with one all_reduce
/// of a `[rows]` vector, never the logits; the result is a `Replicate` DTensor. Plain
/// logits use the plain op.
pub fn cross_entropy(
    logits: &Value,
    targets: &Tensor,
    ignore_index: i64,
) -> tpar_nn::Result<Value> {
    logits.cross_entropy(targets, ignore_index)
}

/// PyTorch's `with loss_parallel():` for a model parallelized over `mesh`: while the
/// guard lives, `loss.backward()` ([`Value::backward`]) on this thread takes a plain
/// loss as the same value on every rank of `mesh`, so the ranks' gradient contributions
/// add up to one gradient. A DTensor loss (what [`cross_entropy`] gives for
/// vocab-sharded logits) needs no scope; opening one around the whole training loop
/// makes `loss.backward()` right for both.
///
/// ```
/// use tpar_collectives::spawn;
/// use tpar_mesh::{DeviceMesh, DeviceType};
/// use tpar_nn::{NnError, Value};
/// use tpar_parallel_styles::loss_parallel;
/// use tpar_tensor::Tensor;
/// let grads = spawn(2, |ctx| -> Result<f32, NnError> {
///     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
///     let _lp = loss_parallel::enable(&mesh);
///     let w = Tensor::from_vec(vec![3.0f32], [1])?.requires_grad_(true);
///     // The same loss on both ranks: its gradient is seeded once, on rank 0.
///     Value::Tensor(w.square()?.sum_all()?).backward()?;
///     Ok(w.grad().map(|g| g.to_vec::<f32>()).transpose()?.map_or(0.0, |g| g[0]))
/// })
/// .unwrap();
/// assert_eq!(grads.iter().sum::<f32>(), 6.0);
/// ```
pub fn enable(mesh: &DeviceMesh) -> ReplicatedLossScope {
    replicated_loss_scope(mesh)
}

/// Backpropagates a scalar loss of a model parallelized over `mesh`: `loss.backward()`
/// inside [`enable`]`(mesh)`.
pub fn backward(loss: &Value, mesh: &DeviceMesh) -> tpar_nn::Result<()> {
    let _scope = enable(mesh);
    loss.backward()
}
