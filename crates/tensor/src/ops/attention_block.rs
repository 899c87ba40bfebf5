//! Blockwise causal attention: the local pieces of context-parallel (ring) attention.
//!
//! A query block and a key/value block each carry the true positions of their rows in
//! the full sequence, so causality is decided by position (query at `p` sees keys at
//! positions `<= p`), across chunk boundaries. The forward returns the block's output
//! and the log-sum-exp of each query row's scores; partial results over disjoint key
//! sets merge exactly by their log-sum-exps ([`Tensor::sdpa_lse_merge`]). The backward of
//! one block takes the merged (global) output and log-sum-exp, as flash attention does,
//! so the gradients of all blocks add up to the gradients of attention over all keys.
//!
//! These functions are not recorded by autograd: the caller (a context-parallel
//! attention op) records one node around all its blocks.

use tpar_kernels::sdpa::{self, SdpaMask, SdpaShape};
use tpar_kernels::{Acc, Float};

use super::{common_device, common_dtype, invalid, require_float};
use crate::{with_float_type, DType, Device, Result, Shape, Tensor, TensorError};

/// How a (query block, key block) pair is masked, decided from the positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMask {
    /// Every key is at or before every query: no causal mask.
    Full,
    /// Same positions on both sides, strictly increasing: the top-left causal mask.
    Diagonal,
    /// Every key is after every query (or a side is empty): nothing is attended.
    Empty,
    /// Any other pattern: an explicit `[sq, sk]` mask built from the positions.
    Explicit,
}

impl BlockMask {
    /// The mask a query block at `q_pos` needs against a key block at `k_pos`.
    pub fn classify(q_pos: &[usize], k_pos: &[usize]) -> BlockMask {
        let (Some(&q_min), Some(&q_max)) = (q_pos.iter().min(), q_pos.iter().max()) else {
            return BlockMask::Empty;
        };
        let (Some(&k_min), Some(&k_max)) = (k_pos.iter().min(), k_pos.iter().max()) else {
            return BlockMask::Empty;
        };
        if k_max <= q_min {
            BlockMask::Full
        } else if k_min > q_max {
            BlockMask::Empty
        } else if q_pos == k_pos && q_pos.windows(2).all(|w| w[0] < w[1]) {
            BlockMask::Diagonal
        } else {
            BlockMask::Explicit
        }
    }
}

/// Validated sizes and host copies of a block call's mask.
struct Block {
    s: SdpaShape,
    kind: BlockMask,
    /// Mask values (f64, converted per dtype later) and strides (batch, head, row).
    mask: Option<(Vec<f64>, [usize; 3])>,
}

fn check_positions(op: &'static str, what: &str, pos: &[usize], len: usize) -> Result<()> {
    if pos.len() != len {
        return Err(invalid(
            op,
            format!("{what} has {} positions for a block of {len} rows", pos.len()),
        ));
    }
    Ok(())
}

/// Checks shapes and builds the mask for a block of `q` `[b, hq, sq, d]` against `k`
/// `[b, hkv, sk, d]`, `v` `[b, hkv, sk, dv]`, with an optional additive key mask
/// (`[b, sk]` or `[b, 1, 1, sk]`, 0 or `-inf`).
#[allow(clippy::too_many_arguments)]
fn prepare(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_pos: &[usize],
    k_pos: &[usize],
    key_mask: Option<&Tensor>,
    scale: Option<f64>,
) -> Result<Block> {
    require_float(op, q)?;
    let dtype = common_dtype(op, &[q, k, v])?;
    let bad = |why: String| TensorError::ShapeMismatch {
        op,
        lhs: q.shape().clone(),
        rhs: k.shape().clone(),
        why,
    };
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(bad("q, k, v must be [batch, heads, seq, head_dim]".into()));
    }
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if kd[0] != qd[0] || vd[0] != qd[0] || kd[3] != qd[3] || vd[1] != kd[1] || vd[2] != kd[2] {
        return Err(bad(format!(
            "v is {}: batch, heads, key length or head_dim disagree",
            v.shape()
        )));
    }
    if kd[1] == 0 || qd[1] % kd[1] != 0 {
        return Err(bad(format!("{} query heads are not a multiple of {} kv heads", qd[1], kd[1])));
    }
    check_positions(op, "the query block", q_pos, qd[2])?;
    check_positions(op, "the key block", k_pos, kd[2])?;
    let kind = BlockMask::classify(q_pos, k_pos);
    let s = SdpaShape {
        batch: qd[0],
        q_heads: qd[1],
        kv_heads: kd[1],
        q_len: qd[2],
        kv_len: kd[2],
        head_dim: qd[3],
        v_dim: vd[3],
        scale: scale.unwrap_or(1.0 / (qd[3].max(1) as f64).sqrt()),
        causal: kind == BlockMask::Diagonal,
    };
    let (b, sq, sk) = (s.batch, s.q_len, s.kv_len);
    let keys: Option<Vec<f64>> = match key_mask {
        None => None,
        Some(m) => {
            if m.dtype() != dtype {
                return Err(TensorError::DTypeMismatch {
                    op,
                    expected: dtype.name().into(),
                    got: m.dtype(),
                });
            }
            let ok = match m.dims() {
                [mb, mk] => *mb == b && *mk == sk,
                [mb, 1, 1, mk] => *mb == b && *mk == sk,
                _ => false,
            };
            if !ok {
                return Err(TensorError::ShapeMismatch {
                    op,
                    lhs: m.shape().clone(),
                    rhs: k.shape().clone(),
                    why: format!("a key mask must be [{b}, {sk}] or [{b}, 1, 1, {sk}]"),
                });
            }
            Some(m.to_device(Device::Cpu)?.to_vec_f64()?)
        }
    };
    let mask = match (kind, keys) {
        (BlockMask::Empty, _) => None,
        (BlockMask::Explicit, keys) => {
            let rows = if keys.is_some() { b } else { 1 };
            let shape = Shape::new(&[rows, sq, sk]);
            let mut m = crate::storage::try_vec(op, &shape, DType::F64, 0.0f64)?;
            for bi in 0..rows {
                for (i, &qp) in q_pos.iter().enumerate() {
                    let row = &mut m[(bi * sq + i) * sk..(bi * sq + i + 1) * sk];
                    for (j, (o, &kp)) in row.iter_mut().zip(k_pos).enumerate() {
                        *o = if kp > qp {
                            f64::NEG_INFINITY
                        } else {
                            keys.as_ref().map_or(0.0, |kv| kv[bi * sk + j])
                        };
                    }
                }
            }
            let bs = if rows > 1 { sq * sk } else { 0 };
            Some((m, [bs, 0, sk]))
        }
        (_, Some(keys)) => Some((keys, [sk, 0, 0])),
        (_, None) => None,
    };
    Ok(Block { s, kind, mask })
}

fn mask_in<T: Float>(m: &Option<(Vec<f64>, [usize; 3])>) -> Option<(Vec<T>, [usize; 3])> {
    m.as_ref().map(|(d, st)| (d.iter().map(|&x| T::from_f64(x)).collect(), *st))
}

fn mask_view<T>(m: &Option<(Vec<T>, [usize; 3])>) -> Option<SdpaMask<'_, T>> {
    m.as_ref().map(|(data, st)| SdpaMask {
        data,
        batch_stride: st[0],
        head_stride: st[1],
        row_stride: st[2],
    })
}

/// Host copies of tensors on another device, with the device to return results to.
fn host(op: &'static str, ts: &[&Tensor]) -> Result<(Vec<Tensor>, Device)> {
    let dev = common_device(op, ts)?;
    if dev == Device::Meta {
        return Err(invalid(op, "meta tensors hold no values to attend over"));
    }
    let hs = ts
        .iter()
        .map(|t| if dev == Device::Cpu { Ok(t.detach()) } else { t.to_device(Device::Cpu) })
        .collect::<Result<Vec<_>>>()?;
    Ok((hs, dev))
}

impl Tensor {
    /// Causal attention of a query block against a key/value block at given positions.
    ///
    /// `q`: `[b, hq, sq, d]`, `k`: `[b, hkv, sk, d]`, `v`: `[b, hkv, sk, dv]` (grouped-query
    /// attention when `hkv < hq`); `q_pos` and `k_pos` are the rows' positions in the full
    /// sequence: query `i` attends key `j` when `k_pos[j] <= q_pos[i]`. `key_mask` is an
    /// optional additive mask over this block's keys (`[b, sk]` or `[b, 1, 1, sk]`, 0 for a
    /// token, `-inf` for padding, in q's dtype). `scale` defaults to `1/sqrt(d)`.
    ///
    /// Returns `(out, lse)`: `out` `[b, hq, sq, dv]` and the log-sum-exp of each query
    /// row's scaled, masked scores, `lse` `[b, hq, sq]` in f64 (`-inf` and a zero output
    /// row where the block has no visible key). The block is computed by the same flash
    /// kernel as [`Tensor::scaled_dot_product_attention`]: with no mask (every key before
    /// every query) or a top-left causal one (equal, increasing positions); other patterns
    /// get an explicit mask. Not recorded by autograd; see [`Tensor::sdpa_block_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn sdpa_block_forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        q_pos: &[usize],
        k_pos: &[usize],
        key_mask: Option<&Tensor>,
        scale: Option<f64>,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "sdpa_block_forward";
        let blk = prepare(OP, q, k, v, q_pos, k_pos, key_mask, scale)?;
        let s = blk.s;
        let out_shape = Shape::new(&[s.batch, s.q_heads, s.q_len, s.v_dim]);
        let lse_shape = Shape::new(&[s.batch, s.q_heads, s.q_len]);
        let (h, dev) = host(OP, &[q, k, v])?;
        let dtype = q.dtype();
        if blk.kind == BlockMask::Empty {
            let out = Tensor::zeros(out_shape, dtype, dev)?;
            let lse = Tensor::full(lse_shape, f64::NEG_INFINITY, DType::F64, Device::Cpu)?;
            return Ok((out, lse));
        }
        let rows = lse_shape.numel();
        let (out, lse) = with_float_type!(dtype, OP, |T| {
            let mask = mask_in::<T>(&blk.mask);
            let mut lse = vec![<T as Float>::Acc::default(); rows];
            let out = h[0].with_data::<T, _>(|qs| {
                h[1].with_data::<T, _>(|ks| {
                    h[2].with_data::<T, _>(|vs| {
                        sdpa::sdpa_forward_new(&s, qs, ks, vs, mask_view(&mask).as_ref(), &mut lse)
                    })
                })
            })????;
            let lse: Vec<f64> = lse.into_iter().map(|x| x.f64()).collect();
            Ok::<_, TensorError>((Tensor::from_vec(out, out_shape)?, lse))
        })?;
        let out = if dev == Device::Cpu { out } else { out.to_device(dev)? };
        Ok((out, Tensor::from_vec(lse, lse_shape)?))
    }

    /// The backward of [`Tensor::sdpa_block_forward`] given the *merged* output and
    /// log-sum-exp of the query rows over all key blocks (flash-attention style): with
    /// `out` and `lse` those of attention over every key, and `dout` the gradient of that
    /// output, returns this block's `(dq, dk, dv)`. Summing `dq` over all key blocks, and
    /// `dk`/`dv` over all query blocks, gives the gradients of attention over the whole
    /// sequence. Arguments are as in the forward; `out` is `[b, hq, sq, dv]` in q's dtype,
    /// `lse` `[b, hq, sq]` (any float dtype; read as f64), `dout` like `out`. A block with
    /// no visible key gets zeros. Not recorded by autograd.
    #[allow(clippy::too_many_arguments)]
    pub fn sdpa_block_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        q_pos: &[usize],
        k_pos: &[usize],
        key_mask: Option<&Tensor>,
        scale: Option<f64>,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "sdpa_block_backward";
        let blk = prepare(OP, q, k, v, q_pos, k_pos, key_mask, scale)?;
        let s = blk.s;
        let out_dims = [s.batch, s.q_heads, s.q_len, s.v_dim];
        let lse_dims = [s.batch, s.q_heads, s.q_len];
        for (name, t, want) in [("out", out, &out_dims[..]), ("dout", dout, &out_dims[..])] {
            if t.dims() != want || t.dtype() != q.dtype() {
                return Err(invalid(
                    OP,
                    format!(
                        "{name} is {} {}, expected {:?} {}",
                        t.dtype().name(),
                        t.shape(),
                        want,
                        q.dtype().name()
                    ),
                ));
            }
        }
        if lse.dims() != lse_dims || !lse.dtype().is_float() {
            return Err(invalid(
                OP,
                format!(
                    "lse is {} {}, expected a float {lse_dims:?}",
                    lse.dtype().name(),
                    lse.shape()
                ),
            ));
        }
        let (h, dev) = host(OP, &[q, k, v, out, dout])?;
        let dtype = q.dtype();
        if blk.kind == BlockMask::Empty {
            return Ok((
                Tensor::zeros(q.shape().clone(), dtype, dev)?,
                Tensor::zeros(k.shape().clone(), dtype, dev)?,
                Tensor::zeros(v.shape().clone(), dtype, dev)?,
            ));
        }
        let lse64 = lse.to_device(Device::Cpu)?.to_vec_f64()?;
        let (dq, dk, dv) = with_float_type!(dtype, OP, |T| {
            let mask = mask_in::<T>(&blk.mask);
            let lse: Vec<<T as Float>::Acc> =
                lse64.iter().map(|&x| <<T as Float>::Acc as Acc>::of(x)).collect();
            let mut dq = crate::storage::zeros_vec::<T>(h[0].numel());
            let mut dk = crate::storage::zeros_vec::<T>(h[1].numel());
            let mut dv = crate::storage::zeros_vec::<T>(h[2].numel());
            h[0].with_data::<T, _>(|qs| {
                h[1].with_data::<T, _>(|ks| {
                    h[2].with_data::<T, _>(|vs| {
                        h[3].with_data::<T, _>(|os| {
                            h[4].with_data::<T, _>(|gs| {
                                sdpa::sdpa_backward(
                                    &s,
                                    qs,
                                    ks,
                                    vs,
                                    mask_view(&mask).as_ref(),
                                    os,
                                    &lse,
                                    gs,
                                    &mut dq,
                                    &mut dk,
                                    &mut dv,
                                )
                            })
                        })
                    })
                })
            })??????;
            Ok::<_, TensorError>((
                Tensor::from_vec(dq, q.shape().clone())?,
                Tensor::from_vec(dk, k.shape().clone())?,
                Tensor::from_vec(dv, v.shape().clone())?,
            ))
        })?;
        if dev == Device::Cpu {
            Ok((dq, dk, dv))
        } else {
            Ok((dq.to_device(dev)?, dk.to_device(dev)?, dv.to_device(dev)?))
        }
    }

    /// Merges two partial attention results over disjoint key sets by their log-sum-exps:
    /// `lse = log(e^lse_a + e^lse_b)` and `out = e^(lse_a - lse) out_a + e^(lse_b - lse)
    /// out_b`, row by row (a row with `lse = -inf` on both sides stays zero with `-inf`).
    /// `out_*` are `[..., rows, dv]` in one float dtype, `lse_*` `[..., rows]` (read as
    /// f64); returns the merged output (the outputs' dtype) and log-sum-exp (f64). Computed
    /// in f64. Not recorded by autograd.
    pub fn sdpa_lse_merge(
        out_a: &Tensor,
        lse_a: &Tensor,
        out_b: &Tensor,
        lse_b: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "sdpa_lse_merge";
        require_float(OP, out_a)?;
        let dtype = common_dtype(OP, &[out_a, out_b])?;
        let shape_ok = out_a.dims() == out_b.dims()
            && lse_a.dims() == lse_b.dims()
            && out_a.rank() >= 1
            && lse_a.dims() == &out_a.dims()[..out_a.rank() - 1];
        if !shape_ok {
            return Err(invalid(
                OP,
                format!(
                    "outputs {} and {} with log-sum-exps {} and {}: an lse must be its \
                     output's shape without the last dim",
                    out_a.shape(),
                    out_b.shape(),
                    lse_a.shape(),
                    lse_b.shape()
                ),
            ));
        }
        let (h, dev) = host(OP, &[out_a, out_b])?;
        let la = lse_a.to_device(Device::Cpu)?.to_vec_f64()?;
        let lb = lse_b.to_device(Device::Cpu)?.to_vec_f64()?;
        let oa = h[0].to_vec_f64()?;
        let ob = h[1].to_vec_f64()?;
        let width = out_a.dims()[out_a.rank() - 1];
        let mut out = vec![0.0f64; oa.len()];
        let mut lse = vec![f64::NEG_INFINITY; la.len()];
        for (r, (&a, &b)) in la.iter().zip(&lb).enumerate() {
            let m = a.max(b);
            if m == f64::NEG_INFINITY {
                continue;
            }
            let l = m + ((a - m).exp() + (b - m).exp()).ln();
            let (wa, wb) = ((a - l).exp(), (b - l).exp());
            lse[r] = l;
            let span = r * width..(r + 1) * width;
            for ((o, &x), &y) in out[span.clone()].iter_mut().zip(&oa[span.clone()]).zip(&ob[span])
            {
                *o = wa * x + wb * y;
            }
        }
        let out = Tensor::from_f64(&out, out_a.shape().clone(), dtype)?;
        let out = if dev == Device::Cpu { out } else { out.to_device(dev)? };
        Ok((out, Tensor::from_vec(lse, lse_a.shape().clone())?))
    }
}
