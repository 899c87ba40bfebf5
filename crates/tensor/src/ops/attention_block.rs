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
//! On CUDA tensors the blocks that need no mask or the top-left causal one (every block
//! of the load-balanced context-parallel layout) run the flash kernels of
//! [`Tensor::scaled_dot_product_attention`] with their f32 log-sum-exps, and the merge
//! runs as device ops: ring attention stays on the device.
//!
//! These functions are not recorded by autograd: the caller (a context-parallel
//! attention op) records one node around all its blocks.
//!
//! Each thread adds the time it spends in them to its own [`BlockAttentionTime`]
//! ([`block_attention_time`], [`reset_block_attention_time`]): with ranks as threads,
//! each rank's attention time, so a benchmark can show how evenly causal attention's
//! work falls on the ranks of a context-parallel group.

use std::cell::Cell;
use std::time::{Duration, Instant};

use tpar_kernels::sdpa::{self, SdpaMask, SdpaShape};
use tpar_kernels::{Acc, Float};

use super::{common_device, common_dtype, gpu_nn, invalid, require_float};
use crate::{with_float_type, DType, Device, Result, Shape, Tensor, TensorError};

/// Time one thread spent in the blockwise attention ops since the last
/// [`reset_block_attention_time`] (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockAttentionTime {
    /// In [`Tensor::sdpa_block_forward`].
    pub forward: Duration,
    /// In [`Tensor::sdpa_block_backward`].
    pub backward: Duration,
    /// In [`Tensor::sdpa_lse_merge`].
    pub merge: Duration,
    /// Calls of [`Tensor::sdpa_block_forward`] that attended something (not
    /// [`BlockMask::Empty`]).
    pub forward_blocks: u64,
    /// Calls of [`Tensor::sdpa_block_backward`] that attended something.
    pub backward_blocks: u64,
}

impl BlockAttentionTime {
    /// Forward, backward and merge together.
    pub fn total(&self) -> Duration {
        self.forward + self.backward + self.merge
    }
}

thread_local! {
    static BLOCK_TIME: Cell<BlockAttentionTime> = const { Cell::new(BlockAttentionTime {
        forward: Duration::ZERO,
        backward: Duration::ZERO,
        merge: Duration::ZERO,
        forward_blocks: 0,
        backward_blocks: 0,
    }) };
}

/// This thread's time in the blockwise attention ops since the last
/// [`reset_block_attention_time`] (a rank thread's: its attention under context
/// parallelism).
pub fn block_attention_time() -> BlockAttentionTime {
    BLOCK_TIME.try_with(|c| c.get()).unwrap_or_default()
}

/// Zeroes this thread's [`block_attention_time`].
pub fn reset_block_attention_time() {
    let _ = BLOCK_TIME.try_with(|c| c.set(BlockAttentionTime::default()));
}

/// Which counter of [`BlockAttentionTime`] a timed call adds to.
#[derive(Clone, Copy)]
enum Timed {
    Forward,
    Backward,
    Merge,
}

/// Adds the time since `start` to this thread's counter `what` (and one block when
/// `block`).
fn add_time(what: Timed, start: Instant, block: bool) {
    let d = start.elapsed();
    let _ = BLOCK_TIME.try_with(|c| {
        let mut t = c.get();
        match what {
            Timed::Forward => {
                t.forward += d;
                t.forward_blocks += u64::from(block);
            }
            Timed::Backward => {
                t.backward += d;
                t.backward_blocks += u64::from(block);
            }
            Timed::Merge => t.merge += d,
        }
        c.set(t);
    });
}

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
/// (`[b, sk]` or `[b, 1, 1, sk]`, 0 or `-inf`), read into the host mask only when
/// `host_keys`.
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
    host_keys: bool,
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
            // The device path reads the key mask where it is (`host_keys` false).
            if host_keys {
                Some(m.to_device(Device::Cpu)?.to_vec_f64()?)
            } else {
                None
            }
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

/// The forward of a block that attends nothing: a zero output of `dtype` on `dev` and
/// `-inf` log-sum-exps of the `(dtype, device)` `lse`.
fn nothing_attended(
    s: &SdpaShape,
    dtype: DType,
    dev: Device,
    lse: (DType, Device),
) -> Result<(Tensor, Tensor, bool)> {
    let out = Tensor::zeros([s.batch, s.q_heads, s.q_len, s.v_dim], dtype, dev)?;
    let lse = Tensor::full([s.batch, s.q_heads, s.q_len], f64::NEG_INFINITY, lse.0, lse.1)?;
    Ok((out, lse, false))
}

/// The backward of a block that attends nothing: zero gradients of q, k and v on `dev`.
fn zero_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dev: Device,
) -> Result<((Tensor, Tensor, Tensor), bool)> {
    let z = |t: &Tensor| Tensor::zeros(t.shape().clone(), t.dtype(), dev);
    Ok(((z(q)?, z(k)?, z(v)?), false))
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
    /// row's scaled, masked scores, `lse` `[b, hq, sq]` (`-inf` and a zero output row where
    /// the block has no visible key): f64 on the host, or, for CUDA tensors of f32, bf16
    /// or f16 whose block needs no mask or the top-left causal one, f32 on the device
    /// (the flash kernel's; the key mask is read where it is, nothing leaves the device).
    /// Other CUDA blocks are computed on host copies. The block is computed by the same
    /// flash kernel as [`Tensor::scaled_dot_product_attention`]: with no mask (every key
    /// before every query) or a top-left causal one (equal, increasing positions); other
    /// patterns get an explicit mask. Not recorded by autograd; see [`Tensor::sdpa_block_backward`].
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
        let start = Instant::now();
        let r = (|| -> Result<(Tensor, Tensor, bool)> {
            const OP: &str = "sdpa_block_forward";
            let on_device = device_candidate(q, q_pos, k_pos);
            let blk = prepare(OP, q, k, v, q_pos, k_pos, key_mask, scale, !on_device)?;
            if on_device && gpu_nn::sdpa_on_device(q, &blk.s) {
                return device_block_forward(q, k, v, key_mask, &blk);
            }
            let blk = match on_device {
                true => prepare(OP, q, k, v, q_pos, k_pos, key_mask, scale, true)?,
                false => blk,
            };
            let s = blk.s;
            let out_shape = Shape::new(&[s.batch, s.q_heads, s.q_len, s.v_dim]);
            let lse_shape = Shape::new(&[s.batch, s.q_heads, s.q_len]);
            if blk.kind == BlockMask::Empty {
                let dev = common_device(OP, &[q, k, v])?;
                return nothing_attended(&s, q.dtype(), dev, (DType::F64, Device::Cpu));
            }
            let (h, dev) = host(OP, &[q, k, v])?;
            let dtype = q.dtype();
            let rows = lse_shape.numel();
            let (out, lse) = with_float_type!(dtype, OP, |T| {
                let mask = mask_in::<T>(&blk.mask);
                let mut lse = vec![<T as Float>::Acc::default(); rows];
                let out = h[0].with_data::<T, _>(|qs| {
                    h[1].with_data::<T, _>(|ks| {
                        h[2].with_data::<T, _>(|vs| {
                            sdpa::sdpa_forward_new(
                                &s,
                                qs,
                                ks,
                                vs,
                                mask_view(&mask).as_ref(),
                                &mut lse,
                            )
                        })
                    })
                })????;
                let lse: Vec<f64> = lse.into_iter().map(|x| x.f64()).collect();
                Ok::<_, TensorError>((Tensor::from_vec(out, out_shape)?, lse))
            })?;
            let out = if dev == Device::Cpu { out } else { out.to_device(dev)? };
            Ok((out, Tensor::from_vec(lse, lse_shape)?, true))
        })();
        add_time(Timed::Forward, start, matches!(r, Ok((_, _, true))));
        r.map(|(out, lse, _)| (out, lse))
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
        let start = Instant::now();
        let r = (|| -> Result<((Tensor, Tensor, Tensor), bool)> {
            const OP: &str = "sdpa_block_backward";
            let on_device = device_candidate(q, q_pos, k_pos);
            let blk = prepare(OP, q, k, v, q_pos, k_pos, key_mask, scale, !on_device)?;
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
            if on_device && gpu_nn::sdpa_on_device(q, &s) {
                return device_block_backward(q, k, v, key_mask, &blk, out, lse, dout);
            }
            let blk = match on_device {
                true => prepare(OP, q, k, v, q_pos, k_pos, key_mask, scale, true)?,
                false => blk,
            };
            if blk.kind == BlockMask::Empty {
                return zero_grads(q, k, v, common_device(OP, &[q, k, v, out, dout])?);
            }
            let (h, dev) = host(OP, &[q, k, v, out, dout])?;
            let dtype = q.dtype();
            let lse64 = lse.to_device(Device::Cpu)?.to_vec_f64()?;
            let (dq, dk, dv) = with_float_type!(dtype, OP, |T| {
                let mask = mask_in::<T>(&blk.mask);
                let lse: Vec<<T as Float>::Acc> =
                    lse64.iter().map(|&x| <<T as Float>::Acc as Acc>::of(x)).collect();
                let [dq, dk, dv] = super::nn::host_sdpa_backward(
                    &s,
                    [&h[0], &h[1], &h[2], &h[3], &h[4]],
                    mask_view(&mask).as_ref(),
                    &lse,
                )?;
                Ok::<_, TensorError>((dq, dk, dv))
            })?;
            if dev == Device::Cpu {
                Ok(((dq, dk, dv), true))
            } else {
                Ok(((dq.to_device(dev)?, dk.to_device(dev)?, dv.to_device(dev)?), true))
            }
        })();
        add_time(Timed::Backward, start, matches!(r, Ok((_, true))));
        r.map(|(g, _)| g)
    }

    /// Merges two partial attention results over disjoint key sets by their log-sum-exps:
    /// `lse = log(e^lse_a + e^lse_b)` and `out = e^(lse_a - lse) out_a + e^(lse_b - lse)
    /// out_b`, row by row (a row with `lse = -inf` on both sides stays zero with `-inf`).
    /// `out_*` are `[..., rows, dv]` in one float dtype, `lse_*` `[..., rows]` (any float
    /// dtype); returns the merged output (the outputs' dtype) and log-sum-exp: on the host
    /// computed in f64 (lse f64); for CUDA outputs of f32, bf16 or f16 computed by device
    /// ops in f32 (lse f32 on the device; a host lse is moved there). Not recorded by
    /// autograd.
    pub fn sdpa_lse_merge(
        out_a: &Tensor,
        lse_a: &Tensor,
        out_b: &Tensor,
        lse_b: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let start = Instant::now();
        let r = (|| -> Result<(Tensor, Tensor)> {
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
            if matches!(out_a.device(), Device::Cuda(_)) && dtype != DType::F64 {
                return crate::autograd::no_grad(|| device_lse_merge(out_a, lse_a, out_b, lse_b));
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
                for ((o, &x), &y) in
                    out[span.clone()].iter_mut().zip(&oa[span.clone()]).zip(&ob[span])
                {
                    *o = wa * x + wb * y;
                }
            }
            let out = Tensor::from_f64(&out, out_a.shape().clone(), dtype)?;
            let out = if dev == Device::Cpu { out } else { out.to_device(dev)? };
            Ok((out, Tensor::from_vec(lse, lse_a.shape().clone())?))
        })();
        add_time(Timed::Merge, start, false);
        r
    }
}

// ---------------------------------------------------------------------------------------
// CUDA tensors
// ---------------------------------------------------------------------------------------

/// Whether a block of `q` at these positions may run on the device's flash kernels: a
/// CUDA tensor of a kernel dtype whose block needs no mask or the top-left causal one
/// (the sizes are checked once the block is prepared). Other blocks go through the host.
fn device_candidate(q: &Tensor, q_pos: &[usize], k_pos: &[usize]) -> bool {
    matches!(q.device(), Device::Cuda(_))
        && matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && BlockMask::classify(q_pos, k_pos) != BlockMask::Explicit
}

/// The key mask as the flash kernels take it: `[b, 1, 1, sk]`, on its device.
fn device_key_mask(key_mask: Option<&Tensor>, s: &SdpaShape) -> Result<Option<Tensor>> {
    key_mask.map(|m| m.reshape([s.batch, 1, 1, s.kv_len])).transpose()
}

/// [`Tensor::sdpa_block_forward`] of a device block: the flash kernel's output and f32
/// log-sum-exp, on the device (a block that attends nothing gets zeros and `-inf`).
fn device_block_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_mask: Option<&Tensor>,
    blk: &Block,
) -> Result<(Tensor, Tensor, bool)> {
    let s = blk.s;
    let dev = common_device("sdpa_block_forward", &[q, k, v])?;
    if blk.kind == BlockMask::Empty {
        return nothing_attended(&s, q.dtype(), dev, (DType::F32, dev));
    }
    let mask = device_key_mask(key_mask, &s)?;
    let (out, lse) = gpu_nn::sdpa_forward_device(q, k, v, mask.as_ref(), &s)?;
    Ok((out, lse, true))
}

/// [`Tensor::sdpa_block_backward`] of a device block: the flash kernel's backward from
/// the merged output and log-sum-exp (moved to the device as f32 where they are not).
#[allow(clippy::too_many_arguments)]
fn device_block_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_mask: Option<&Tensor>,
    blk: &Block,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
) -> Result<((Tensor, Tensor, Tensor), bool)> {
    let dev = common_device("sdpa_block_backward", &[q, k, v, out, dout])?;
    if blk.kind == BlockMask::Empty {
        return zero_grads(q, k, v, dev);
    }
    let lse = f32_on(lse, dev)?;
    let mask = device_key_mask(key_mask, &blk.s)?;
    let g = gpu_nn::sdpa_backward_device(q, k, v, mask.as_ref(), &blk.s, out, &lse, dout)?;
    Ok((g, true))
}

/// `t` as f32 on `dev`: a host tensor is cast on the host and uploaded (the device has
/// no f64 kernels), a device tensor cast there where needed.
fn f32_on(t: &Tensor, dev: Device) -> Result<Tensor> {
    let t = if t.dtype() == DType::F32 || t.device() == dev {
        t.clone()
    } else {
        t.to_dtype(DType::F32)?
    };
    let t = if t.device() == dev { t } else { t.to_device(dev)? };
    if t.dtype() == DType::F32 {
        Ok(t)
    } else {
        t.to_dtype(DType::F32)
    }
}

/// [`Tensor::sdpa_lse_merge`] of device outputs, by device ops in f32: with `m` the
/// larger log-sum-exp (held finite, so a row masked on both sides gets weights 0),
/// `lse = m + log(e^(lse_a - m) + e^(lse_b - m))` and each output weighted by its share
/// of that sum. The log-sum-exps may come from the host (moved to the device once).
fn device_lse_merge(
    out_a: &Tensor,
    lse_a: &Tensor,
    out_b: &Tensor,
    lse_b: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let dev = common_device("sdpa_lse_merge", &[out_a, out_b])?;
    let (la, lb) = (f32_on(lse_a, dev)?, f32_on(lse_b, dev)?);
    let m = la.maximum(&lb)?.clamp_min(f64::from(f32::MIN))?;
    let (ea, eb) = (la.sub(&m)?.exp()?, lb.sub(&m)?.exp()?);
    let sum = ea.add(&eb)?;
    let lse = m.add(&sum.log()?)?;
    let denom = sum.clamp_min(f64::from(f32::MIN_POSITIVE))?;
    let (wa, wb) = (ea.div(&denom)?.unsqueeze(-1)?, eb.div(&denom)?.unsqueeze(-1)?);
    let out = f32_on(out_a, dev)?.mul(&wa)?.add(&f32_on(out_b, dev)?.mul(&wb)?)?;
    Ok((out.to_dtype(out_a.dtype())?, lse))
}
