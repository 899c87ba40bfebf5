//! Neural-network ops: softmax, RMSNorm, RoPE and attention on sharded activations.

use tpar_placements::Placement;
use tpar_tensor::shape::normalize_dim;
use tpar_tensor::{RopeLayout, Tensor};

use super::{
    choose, finish, first_mesh, global_shape, is_linear_partial, meta, meta_plain, no_rule,
    prepare, prepare_all, ranges_at_all_coords, unary_rule, zeros_recorded, Strategy,
};
use crate::{DTensor, DTensorSpec, Result};

use Placement::{Replicate, Shard};

impl DTensor {
    fn softmax_impl(&self, dim: isize, log: bool) -> Result<DTensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        let operands = [("input", self)];
        let out_shape = global_shape(op, &operands, || {
            let m = meta(self)?;
            Ok(if log { m.log_softmax(dim)? } else { m.softmax(dim)? })
        })?;
        let d = normalize_dim(op, dim, self.shape().len().max(1))
            .map_err(|e| no_rule(op, &operands, &e.to_string()))?;
        let (target, out) = unary_rule(self, |p| match p {
            Shard(s) if s as usize == d => (Replicate, Replicate),
            p if p.is_partial() => (Replicate, Replicate),
            p => (p, p),
        });
        let x = prepare(op, "input", self, &target)?;
        let y = if log { x.local().log_softmax(dim)? } else { x.local().softmax(dim)? };
        finish(y, self.mesh(), &out, &out_shape)
    }

    /// Softmax over `dim`. Rules per mesh dim: shards of other dims and `Replicate` pass;
    /// a shard of `dim` is gathered first and a `Partial` reduced first (implicit).
    /// No communication otherwise, forward or backward.
    pub fn softmax(&self, dim: isize) -> Result<DTensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax over `dim`; rules as [`DTensor::softmax`].
    pub fn log_softmax(&self, dim: isize) -> Result<DTensor> {
        self.softmax_impl(dim, true)
    }

    /// RMSNorm over the last dim with a `[D]` weight.
    ///
    /// Rules per mesh dim: the input's shards of any dim but the last (sequence
    /// parallelism: `S(1)` on `[b, s, D]`) and `Replicate` pass; a shard of the last dim
    /// is gathered and a `Partial` reduced first (implicit). The weight is used
    /// replicated (a sharded or partial weight is redistributed, implicitly); its local
    /// gradient is each rank's contribution, as the gradient convention wants, so the
    /// backward communicates nothing. Output placements: the input's.
    pub fn rms_norm(&self, weight: &DTensor, eps: f64) -> Result<DTensor> {
        let op = "rms_norm";
        let operands = [("input", self), ("weight", weight)];
        first_mesh(op, &operands)?;
        let out_shape =
            global_shape(op, &operands, || Ok(meta(self)?.rms_norm(&meta(weight)?, eps)?))?;
        let last = self.shape().len().saturating_sub(1);
        let (target, out) = unary_rule(self, |p| match p {
            Shard(s) if s as usize == last => (Replicate, Replicate),
            p if p.is_partial() => (Replicate, Replicate),
            p => (p, p),
        });
        let wt = vec![Replicate; weight.placements().len()];
        let ins = prepare_all(op, &operands, &[target, wt])?;
        let y = ins[0].local().rms_norm(ins[1].local(), eps)?;
        finish(y, self.mesh(), &out, &out_shape)
    }

    /// Rotary position embedding of a 4-d input (`layout` says where the sequence dim
    /// is) with the *full* `cos`/`sin` tables `[seq, head_dim]` (plain tensors, the same
    /// on every rank).
    ///
    /// Rules per mesh dim: a shard of the sequence dim passes, and each rank narrows the
    /// tables to its own rows (the spec's local offset, uneven shards included); shards
    /// of the batch and head dims, `Replicate` and `Partial(sum|avg)` (rope is linear)
    /// pass; a shard of `head_dim` (rope mixes its halves) is gathered first (implicit).
    /// No communication forward or backward otherwise.
    pub fn rope(&self, cos: &Tensor, sin: &Tensor, layout: RopeLayout) -> Result<DTensor> {
        let op = "rope";
        let operands = [("input", self)];
        let out_shape = global_shape(op, &operands, || {
            Ok(meta(self)?.rope(&meta_plain(cos)?, &meta_plain(sin)?, layout)?)
        })?;
        let seq = match layout {
            RopeLayout::Bhsd => 2,
            RopeLayout::Bshd => 1,
        };
        let (target, out) = unary_rule(self, |p| match p {
            Shard(3) => (Replicate, Replicate),
            p if p.is_partial() && !is_linear_partial(p) => (Replicate, Replicate),
            p => (p, p),
        });
        let x = prepare(op, "input", self, &target)?;
        let (local_shape, offset) = x.spec().local_shape_and_offset()?;
        let (start, len) = (offset[seq], local_shape[seq]);
        let (c, s) = if (start, len) == (0, cos.dims()[0]) {
            (cos.clone(), sin.clone())
        } else {
            (cos.detach().narrow(0, start, len)?, sin.detach().narrow(0, start, len)?)
        };
        finish(x.local().rope(&c, &s, layout)?, self.mesh(), &out, &out_shape)
    }

    /// Scaled dot-product attention on `q [b, hq, sq, d]`, `k [b, hkv, sk, d]`,
    /// `v [b, hkv, sk, dv]` (GQA when `hkv < hq`), with an optional *full* additive
    /// `mask` (a plain tensor broadcastable to `[b, hq, sq, sk]`; each rank narrows it to
    /// its own block), `causal` (top-left aligned, as PyTorch's `is_causal`) and `scale`
    /// (default `1/sqrt(d)`).
    ///
    /// Rules per mesh dim (operands `q`, `k`, `v` -> output):
    /// * heads: `S(1)`, `S(1)`, `S(1)` -> `S(1)`, when every rank's query heads are
    ///   exactly the query heads of its kv heads (`hq/hkv` per kv head; always so when the
    ///   mesh dim divides `hkv`); otherwise the heads are gathered (implicit);
    /// * batch: `S(0)`, `S(0)`, `S(0)` -> `S(0)`;
    /// * query rows: `S(2)`, `R`, `R` -> `S(2)`; with `causal`, each rank masks with its
    ///   rows' global positions;
    /// * `R`, `R`, `P` -> `P` (linear in `v`); `R`, `R`, `R` -> `R`.
    ///
    /// The cheapest applicable strategy wins; a `Replicate` operand is sliced locally.
    /// No communication forward or backward beyond implicit redistributions.
    pub fn scaled_dot_product_attention(
        q: &DTensor,
        k: &DTensor,
        v: &DTensor,
        mask: Option<&Tensor>,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<DTensor> {
        let op = "scaled_dot_product_attention";
        let operands = [("query", q), ("key", k), ("value", v)];
        let out_shape = global_shape(op, &operands, || {
            let m = mask.map(meta_plain).transpose()?;
            Ok(Tensor::scaled_dot_product_attention(
                &meta(q)?,
                &meta(k)?,
                &meta(v)?,
                m.as_ref(),
                causal,
                scale,
            )?)
        })?;
        let groups = q.shape()[1] / k.shape()[1].max(1);
        let pick = |heads: bool| {
            choose(op, &operands, |m| {
                let mut c = vec![
                    Strategy::new(vec![Replicate; 3], Replicate),
                    Strategy::new(vec![Shard(0); 3], Shard(0)),
                    Strategy::new(vec![Shard(2), Replicate, Replicate], Shard(2)),
                ];
                if heads {
                    c.push(Strategy::new(vec![Shard(1); 3], Shard(1)));
                }
                let pv = v.placements()[m];
                if is_linear_partial(pv) {
                    c.push(Strategy::new(vec![Replicate, Replicate, pv], pv));
                }
                c
            })
        };
        let (mut targets, mut out) = pick(true)?;
        if out.contains(&Shard(1)) {
            let qr = ranges_at_all_coords(q, &targets[0], 1)?;
            let kr = ranges_at_all_coords(k, &targets[1], 1)?;
            let ok = qr.iter().zip(&kr).all(|(a, b)| a.0 == groups * b.0 && a.1 == groups * b.1);
            if !ok {
                (targets, out) = pick(false)?;
            }
        }
        let ins = prepare_all(op, &operands, &targets)?;
        let (ql, kl, vl) = (ins[0].local(), ins[1].local(), ins[2].local());
        let out_spec = DTensorSpec::new(q.mesh(), &out, &out_shape)?;
        let (local_shape, offset) = out_spec.local_shape_and_offset()?;
        if local_shape.contains(&0) {
            let y = zeros_recorded(op, &[ql, kl, vl], &local_shape)?;
            return finish(y, q.mesh(), &out, &out_shape);
        }
        // The mask's block for this rank: narrow its batch, head and query-row dims.
        let mut local_mask = match mask {
            None => None,
            Some(m) => {
                let mut m = m.detach();
                let r = m.rank();
                for o in 0..3usize {
                    let Some(d) = (o + r).checked_sub(4) else { continue };
                    if m.dims()[d] != 1 {
                        m = m.narrow(d as isize, offset[o], local_shape[o])?;
                    }
                }
                Some(m)
            }
        };
        let rows_sharded = out.contains(&Shard(2));
        if causal && rows_sharded {
            let (rows, keys, start) = (local_shape[2], k.shape()[2], offset[2]);
            let mut block = vec![0.0; rows * keys];
            for i in 0..rows {
                for j in (start + i + 1).min(keys)..keys {
                    block[i * keys + j] = f64::NEG_INFINITY;
                }
            }
            let block = Tensor::from_f64(&block, [rows, keys], q.dtype())?
                .to_device(q.to_local().device())?;
            local_mask = Some(match local_mask {
                Some(m) => m.add(&block)?,
                None => block,
            });
        }
        let scale = Some(scale.unwrap_or(1.0 / (q.shape()[3].max(1) as f64).sqrt()));
        let y = Tensor::scaled_dot_product_attention(
            ql,
            kl,
            vl,
            local_mask.as_ref(),
            causal && !rows_sharded,
            scale,
        )?;
        finish(y, q.mesh(), &out, &out_shape)
    }
}
