//! Embedding lookup with a vocab-sharded, dim-sharded or replicated table.

use tpar_placements::{Placement, ReduceOp};
use tpar_tensor::{DType, Tensor};

use super::{
    choose, finish, global_shape, is_linear_partial, meta, no_rule, prepare_all, Strategy,
};
use crate::{DTensor, Result};

use Placement::{Partial, Replicate, Shard};

impl DTensor {
    /// Embedding lookup: rows of `weight` (`[vocab, dim]`) picked by i64 `ids`; the output
    /// is `ids.shape + [dim]`.
    ///
    /// Rules per mesh dim (operands `ids`, `weight` -> output):
    /// * vocab-parallel (PyTorch's RowwiseParallel embedding): `R`, `S(0)` ->
    ///   `Partial(sum)`: each rank looks up the ids in its vocab rows
    ///   (`Tensor::embedding_masked` with the shard's global row offset) and gives zero
    ///   rows for the others, so the terms sum to the lookup;
    /// * dim-parallel (ColwiseParallel): `R`, `S(1)` -> `S(-1)`;
    /// * replicated table: `S(d)` or `R`, `R` -> like `ids`;
    /// * partial table: `R`, `Partial(sum|avg)` -> the same `Partial` (lookup is linear).
    ///
    /// The cheapest applicable strategy wins: sharded ids meeting a sharded table are
    /// gathered (implicit all_gather of the ids, the small operand). `Partial` ids are an
    /// error, and so is an id outside `0..vocab` (checked on every rank, so no rank is
    /// left waiting). No communication forward or backward otherwise: the weight's local
    /// gradient is the scatter-add of the output gradient into its rows.
    pub fn embedding(ids: &DTensor, weight: &DTensor) -> Result<DTensor> {
        let op = "embedding";
        let operands = [("ids", ids), ("weight", weight)];
        let out_shape =
            global_shape(op, &operands, || Ok(Tensor::embedding(&meta(ids)?, &meta(weight)?)?))?;
        if ids.placements().iter().any(|p| p.is_partial()) {
            return Err(no_rule(op, &operands, "ids cannot be Partial"));
        }
        let out_dim = Shard(ids.shape().len() as isize);
        let (targets, out) = choose(op, &operands, |m| {
            let mut c = vec![
                Strategy::new(vec![Replicate, Replicate], Replicate),
                Strategy::new(vec![Replicate, Shard(0)], Partial(ReduceOp::Sum)),
                Strategy::new(vec![Replicate, Shard(1)], out_dim),
            ];
            let pi = ids.placements()[m];
            if pi.is_shard() {
                c.push(Strategy::new(vec![pi, Replicate], pi));
            }
            let pw = weight.placements()[m];
            if is_linear_partial(pw) {
                c.push(Strategy::new(vec![Replicate, pw], pw));
            }
            c
        })?;
        let ins = prepare_all(op, &operands, &targets)?;
        let masked = targets[1].contains(&Shard(0));
        let vocab = weight.shape()[0];
        let local_ids = ins[0].local();
        if masked {
            if ids.dtype() != DType::I64 {
                return Err(no_rule(op, &operands, "ids must be i64"));
            }
            // On a CUDA device the ids are checked there (no host round trip); a thread
            // that defers its index checks records this one too (an `IndexOutOfRange`
            // from `tpar_tensor::gpu::check_deferred_index_checks`).
            let deferred = matches!(local_ids.device(), tpar_tensor::Device::Cuda(_))
                && tpar_tensor::gpu::index_checks_deferred();
            let bad = if deferred {
                local_ids.check_index_range(vocab, "embedding")?;
                None
            } else {
                local_ids.first_index_out_of_range(vocab)?
            };
            if let Some((pos, id)) = bad {
                return Err(no_rule(
                    op,
                    &operands,
                    &format!("id {id} at local position {pos} is out of range for {vocab} rows"),
                ));
            }
        }
        let (_, offset) = ins[1].spec().local_shape_and_offset()?;
        let y = Tensor::embedding_masked(local_ids, ins[1].local(), offset[0] as i64, masked)?;
        finish(y, ids.mesh(), &out, &out_shape)
    }
}
