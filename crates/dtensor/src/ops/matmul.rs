//! `matmul` and `linear` with the tensor-parallel sharding rules.

use tpar_placements::{Placement, ReduceOp};

use super::{
    choose, finish, global_shape, is_linear_partial, meta, prepare_all, zeros_recorded, Strategy,
};
use crate::{DTensor, DTensorSpec, Result};

use Placement::{Partial, Replicate, Shard};

const PSUM: Placement = Partial(ReduceOp::Sum);

/// The operand dim aligned with output batch dim `j` (of `nb` batch dims), if the operand
/// has it at the output's size (not broadcast).
fn batch_dim(shape: &[usize], j: usize, nb: usize, out: usize) -> Option<usize> {
    let own = shape.len().checked_sub(2)?;
    let d = (j + own).checked_sub(nb)?;
    (shape[d] == out).then_some(d)
}

fn shard_or_rep(d: Option<usize>) -> Placement {
    d.map_or(Replicate, |d| Shard(d as isize))
}

impl DTensor {
    /// Matrix product `[..., m, k] x [..., k, n]` with numpy batch broadcasting.
    ///
    /// Rules per mesh dim (the cheapest applicable; see [`crate::ops`]):
    /// `R x S(n) -> S(-1)`, `S(m) x R -> S(-2)`, `S(k) x S(k) -> Partial(sum)`,
    /// `S(b) x S(b) -> S(b)` on a batch dim (an operand broadcast there stays `R`),
    /// `P x R -> P`, `R x P -> P`, `R x R -> R`. A `Replicate` operand is sliced locally
    /// where the rule needs it sharded (`S(k) x R` slices the rhs rows and gives
    /// `Partial(sum)`); any other mismatch is an implicit redistribution of the operand
    /// that moves fewer bytes. Communication: none forward or backward beyond those
    /// redistributions.
    pub fn matmul(&self, rhs: &DTensor) -> Result<DTensor> {
        let op = "matmul";
        let operands = [("lhs", self), ("rhs", rhs)];
        let out_shape = global_shape(op, &operands, || Ok(meta(self)?.matmul(&meta(rhs)?)?))?;
        let (ra, rb, ro) = (self.shape().len(), rhs.shape().len(), out_shape.len());
        let nb = ro - 2;
        let (targets, out) = choose(op, &operands, |m| {
            let s = |d: usize| Shard(d as isize);
            let mut c = vec![
                Strategy::new(vec![Replicate, Replicate], Replicate),
                Strategy::new(vec![Replicate, s(rb - 1)], s(ro - 1)),
                Strategy::new(vec![s(ra - 2), Replicate], s(ro - 2)),
                Strategy::new(vec![s(ra - 1), s(rb - 2)], PSUM),
            ];
            for j in 0..nb {
                let a = batch_dim(self.shape(), j, nb, out_shape[j]);
                let b = batch_dim(rhs.shape(), j, nb, out_shape[j]);
                c.push(Strategy::new(vec![shard_or_rep(a), shard_or_rep(b)], s(j)));
            }
            for (i, (_, t)) in operands.iter().enumerate() {
                let p = t.placements()[m];
                if is_linear_partial(p) {
                    let mut inputs = vec![Replicate, Replicate];
                    inputs[i] = p;
                    c.push(Strategy::new(inputs, p));
                }
            }
            c
        })?;
        let ins = prepare_all(op, &operands, &targets)?;
        let (a, b) = (ins[0].local(), ins[1].local());
        let (local_shape, _) =
            DTensorSpec::new(self.mesh(), &out, &out_shape)?.local_shape_and_offset()?;
        let local = if local_shape.contains(&0) || a.dims()[ra - 1] == 0 {
            zeros_recorded(op, &[a, b], &local_shape)?
        } else {
            a.matmul(b)?
        };
        finish(local, self.mesh(), &out, &out_shape)
    }

    /// `x W^T + b` for a weight in PyTorch's Linear layout `[out_features, in_features]`
    /// and an optional bias `[out_features]`, over any leading dims of `x`.
    ///
    /// Rules per mesh dim (operands `x`, `weight`, `bias`):
    /// * colwise: `R`, `S(0)`, `S(0)` -> `S(-1)` (a replicated bias is sliced locally);
    /// * rowwise: `S(-1)`, `S(1)`, `Partial(sum)` -> `Partial(sum)`: a replicated bias is
    ///   *partialized* (kept on coordinate 0, zeros elsewhere: no communication), so it is
    ///   added exactly once when the output is reduced, as PyTorch's addmm rule does;
    /// * batch: `S(d)` (`d` not the last dim), `R`, `R` -> `S(d)`;
    /// * `P`, `R`, `P` or `R`, `P`, `P` -> `P` (linear in the partial operand);
    /// * `R`, `R`, `R` -> `R`.
    ///
    /// The cheapest applicable strategy wins; a `Replicate` weight meeting an `S(-1)`
    /// input is sliced locally (rowwise), an `S(-1)` input meeting an `S(0)` weight is
    /// gathered (implicit all_gather). A colwise layer followed by a rowwise one thus runs
    /// with no communication until the `Partial(sum)` output is redistributed (one
    /// all_reduce forward, one backward). Communication: none forward or backward beyond
    /// implicit redistributions.
    pub fn linear(&self, weight: &DTensor, bias: Option<&DTensor>) -> Result<DTensor> {
        let op = "linear";
        let mut operands = vec![("input", self), ("weight", weight)];
        if let Some(b) = bias {
            operands.push(("bias", b));
        }
        let out_shape = global_shape(op, &operands, || {
            let b = bias.map(meta).transpose()?;
            Ok(meta(self)?.linear(&meta(weight)?, b.as_ref())?)
        })?;
        let rx = self.shape().len();
        let with_bias = |x: Placement, w: Placement, b: Placement, o: Placement| {
            let mut inputs = vec![x, w];
            if bias.is_some() {
                inputs.push(b);
            }
            Strategy::new(inputs, o)
        };
        let last = Shard(rx as isize - 1);
        let (targets, out) = choose(op, &operands, |m| {
            let mut c = vec![
                with_bias(Replicate, Replicate, Replicate, Replicate),
                with_bias(Replicate, Shard(0), Shard(0), last),
                with_bias(last, Shard(1), PSUM, PSUM),
            ];
            for d in 0..rx - 1 {
                let s = Shard(d as isize);
                c.push(with_bias(s, Replicate, Replicate, s));
            }
            let (px, pw) = (self.placements()[m], weight.placements()[m]);
            if is_linear_partial(px) {
                c.push(with_bias(px, Replicate, px, px));
            }
            if is_linear_partial(pw) {
                c.push(with_bias(Replicate, pw, pw, pw));
            }
            c
        })?;
        let ins = prepare_all(op, &operands, &targets)?;
        let (x, w, b) = (ins[0].local(), ins[1].local(), ins.get(2).map(|b| b.local()));
        let (local_shape, _) =
            DTensorSpec::new(self.mesh(), &out, &out_shape)?.local_shape_and_offset()?;
        let local = if local_shape.contains(&0) {
            let mut inputs = vec![x, w];
            inputs.extend(b);
            zeros_recorded(op, &inputs, &local_shape)?
        } else if x.dims()[rx - 1] == 0 {
            // An empty contraction: the product is zeros, the bias (if any) remains.
            let z = zeros_recorded(op, &[x, w], &local_shape)?;
            match b {
                Some(b) => z.add(b)?,
                None => z,
            }
        } else {
            x.linear(w, b)?
        };
        finish(local, self.mesh(), &out, &out_shape)
    }
}
