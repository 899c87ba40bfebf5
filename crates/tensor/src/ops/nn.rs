//! Fused neural-network ops: softmax, RMSNorm, RoPE, attention, cross-entropy, embedding.
//! Each calls one kernel forward and one backward, saving only what backward needs.

use tpar_kernels::cross_entropy as ce;
use tpar_kernels::embedding as emb;
use tpar_kernels::rmsnorm;
use tpar_kernels::rope::{self, RopeShape};
use tpar_kernels::sdpa::{self, SdpaMask, SdpaShape};
use tpar_kernels::softmax;
use tpar_kernels::{Acc, Float};

use super::{common_device, common_dtype, compute, cuda_ordinal, invalid, on_host, require_float};
use crate::autograd::{needs_input_grad, record};
use crate::shape::{broadcast_strides, normalize_dim};
use crate::storage::Element;
use crate::tensor::typed;
use crate::{with_float_type, DType, Device, Result, Shape, Tensor, TensorError};

/// Where the sequence dim sits in a 4-d tensor given to [`Tensor::rope`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// `[batch, heads, seq, head_dim]`.
    Bhsd,
    /// `[batch, seq, heads, head_dim]`.
    Bshd,
}

/// `Ok(true)` when the inputs are meta tensors (shape inference only).
fn is_meta(op: &'static str, inputs: &[&Tensor]) -> Result<bool> {
    Ok(common_device(op, inputs)? == Device::Meta)
}

fn meta(shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
    Tensor::empty(shape, dtype, Device::Meta)
}

fn shape_err(op: &'static str, a: &Tensor, b: &Tensor, why: impl Into<String>) -> TensorError {
    TensorError::ShapeMismatch {
        op,
        lhs: a.shape().clone(),
        rhs: b.shape().clone(),
        why: why.into(),
    }
}

/// The kernel's view of a host mask copy and its broadcast strides.
fn mask_ref<T>(md: &Option<(Vec<T>, Vec<usize>)>) -> Option<SdpaMask<'_, T>> {
    md.as_ref().map(|(data, st)| SdpaMask {
        data,
        batch_stride: st[0],
        head_stride: st[1],
        row_stride: st[2],
    })
}

/// The host SDPA backward of the float element type `T`: the gradients of q, k and
/// v (in their shapes) from `[q, k, v, out, dout]` (host tensors of `T`), the mask
/// and the forward's log-sum-exps, reading every input in place.
pub(crate) fn host_sdpa_backward<T: Float + Element>(
    s: &SdpaShape,
    [q, k, v, o, g]: [&Tensor; 5],
    mask: Option<&SdpaMask<'_, T>>,
    lse: &[T::Acc],
) -> Result<[Tensor; 3]> {
    let mut dq = crate::storage::zeros_vec::<T>(q.numel());
    let mut dk = crate::storage::zeros_vec::<T>(k.numel());
    let mut dv = crate::storage::zeros_vec::<T>(v.numel());
    q.with_data::<T, _>(|qs| {
        k.with_data::<T, _>(|ks| {
            v.with_data::<T, _>(|vs| {
                o.with_data::<T, _>(|os| {
                    g.with_data::<T, _>(|gs| {
                        sdpa::sdpa_backward(
                            s, qs, ks, vs, mask, os, lse, gs, &mut dq, &mut dk, &mut dv,
                        )
                    })
                })
            })
        })
    })??????;
    Ok([
        Tensor::from_vec(dq, q.shape().clone())?,
        Tensor::from_vec(dk, k.shape().clone())?,
        Tensor::from_vec(dv, v.shape().clone())?,
    ])
}

fn acc_to<T: Float>(v: Vec<T::Acc>) -> Vec<T> {
    v.into_iter().map(T::from_acc).collect()
}

/// Attention's default scale for a head dim of `head_dim`: `1/sqrt(head_dim)`.
pub(crate) fn default_sdpa_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim.max(1) as f64).sqrt()
}

/// An attention mask brought to 4 dims whose last is the key length (or 1), after checking
/// its dtype (`dtype`) and that it broadcasts to `[batch, q_heads, q_len, kv_len]` of `s`;
/// errors name `op` (and `q`, the query tensor, for shapes).
pub(crate) fn sdpa_mask4(
    op: &'static str,
    mask: Option<&Tensor>,
    dtype: DType,
    s: &SdpaShape,
    q: &Tensor,
) -> Result<Option<Tensor>> {
    let Some(m) = mask else { return Ok(None) };
    if m.dtype() != dtype {
        return Err(TensorError::DTypeMismatch {
            op,
            expected: dtype.name().into(),
            got: m.dtype(),
        });
    }
    if m.rank() > 4 {
        return Err(invalid(op, format!("mask of shape {} has more than 4 dims", m.shape())));
    }
    let mut md = vec![1; 4 - m.rank()];
    md.extend_from_slice(m.dims());
    let full = Shape::new(&[s.batch, s.q_heads, s.q_len, s.kv_len]);
    let m4 = m.detach().reshape(md)?;
    let b = crate::shape::broadcast_shapes(op, m4.shape(), &full)?;
    if b != full {
        return Err(shape_err(op, m, q, format!("mask does not broadcast to {full}")));
    }
    Ok(Some(m4))
}

impl Tensor {
    fn softmax_impl(&self, dim: isize, log: bool) -> Result<Tensor> {
        let name = if log { "log_softmax" } else { "softmax" };
        require_float(name, self)?;
        let d = normalize_dim(name, dim, self.rank().max(1))?;
        if self.rank() == 0 {
            return self.reshape([1])?.softmax_impl(0, log)?.reshape(Shape::new(&[]));
        }
        if d != self.rank() - 1 {
            let last = self.rank() as isize - 1;
            return self
                .transpose(d as isize, last)?
                .softmax_impl(last, log)?
                .transpose(d as isize, last);
        }
        let cols = self.dims()[d];
        let rows = self.numel().checked_div(cols).unwrap_or(0);
        if cuda_ordinal(name, &[self])?.is_some() {
            if let Some(t) = super::gpu_elem::softmax(self, rows, cols, log)? {
                return Ok(t);
            }
        }
        let n = self.numel();
        let out = compute(name, &[self], self.shape().clone(), self.dtype(), |st| {
            with_float_type!(st[0].dtype(), name, |T| {
                let mut y = crate::storage::zeros_vec::<T>(n);
                let x = typed::<T>(name, st[0])?;
                if log {
                    softmax::log_softmax_forward(x, rows, cols, &mut y)?;
                } else {
                    softmax::softmax_forward(x, rows, cols, &mut y)?;
                }
                Ok(T::wrap(y))
            })
        })?;
        let y = out.detach();
        Ok(record(name, &[self], out, move |g| {
            let dx = compute(name, &[&y, g], y.shape().clone(), y.dtype(), |st| {
                with_float_type!(st[0].dtype(), name, |T| {
                    let mut dx = crate::storage::zeros_vec::<T>(n);
                    let (ys, gs) = (typed::<T>(name, st[0])?, typed::<T>(name, st[1])?);
                    if log {
                        softmax::log_softmax_backward(ys, gs, rows, cols, &mut dx)?;
                    } else {
                        softmax::softmax_backward(ys, gs, rows, cols, &mut dx)?;
                    }
                    Ok(T::wrap(dx))
                })
            })?;
            Ok(vec![Some(dx)])
        }))
    }

    /// Softmax over `dim` (max-subtracted; a row of all `-inf` gives zeros).
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax over `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }

    /// Fused RMSNorm over the last dim: `x / sqrt(mean(x^2) + eps) * weight`.
    /// Statistics in f32 (f64 for f64 tensors); backward fuses the weight-gradient reduction.
    pub fn rms_norm(&self, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let op = "rms_norm";
        require_float(op, self)?;
        let dtype = common_dtype(op, &[self, weight])?;
        let dim = self.dims().last().copied().unwrap_or(1);
        if weight.dims() != [dim] {
            return Err(shape_err(op, self, weight, format!("weight must be [{dim}]")));
        }
        if is_meta(op, &[self, weight])? {
            return meta(self.shape().clone(), dtype);
        }
        if let Some(i) = cuda_ordinal(op, &[self, weight])? {
            if let Some(t) = super::gpu::rms_norm(self, weight, eps)? {
                return Ok(t);
            }
            return on_host(i, &[self, weight], |h| h[0].rms_norm(&h[1], eps));
        }
        let rows = self.numel().checked_div(dim).unwrap_or(0);
        with_float_type!(dtype, op, |T| {
            let mut rstd = vec![<T as Float>::Acc::default(); rows];
            let y = self.with_data::<T, _>(|xs| {
                weight.with_data::<T, _>(|ws| {
                    rmsnorm::rmsnorm_forward_new(xs, ws, rows, dim, eps, &mut rstd)
                })
            })???;
            let out = Tensor::from_vec(y, self.shape().clone())?;
            let (x, w) = (self.clone(), weight.clone());
            Ok(record(op, &[self, weight], out, move |g| {
                let mut dw = vec![<T as Float>::Acc::default(); dim];
                let dx = x.with_data::<T, _>(|xs| {
                    w.with_data::<T, _>(|ws| {
                        g.with_data::<T, _>(|gs| {
                            rmsnorm::rmsnorm_backward_new(xs, ws, &rstd, gs, rows, dim, &mut dw)
                        })
                    })
                })????;
                Ok(vec![
                    Some(Tensor::from_vec(dx, x.shape().clone())?),
                    Some(Tensor::from_vec(acc_to::<T>(dw), [dim])?),
                ])
            }))
        })
    }

    /// Rotary position embedding, rotate-half form: `x * cos + cat(-x2, x1) * sin`, where
    /// `x1`/`x2` are the halves of the last dim and `cos`/`sin` are `[seq, head_dim]`.
    /// Differentiable in `x` (the tables are constants).
    pub fn rope(&self, cos: &Tensor, sin: &Tensor, layout: RopeLayout) -> Result<Tensor> {
        let op = "rope";
        require_float(op, self)?;
        let dtype = common_dtype(op, &[self, cos, sin])?;
        if self.rank() != 4 {
            return Err(invalid(op, format!("x must be 4-d, got {}", self.shape())));
        }
        let d = self.dims();
        let s = match layout {
            RopeLayout::Bhsd => {
                RopeShape { outer: d[0] * d[1], seq: d[2], inner: 1, head_dim: d[3] }
            }
            RopeLayout::Bshd => RopeShape { outer: d[0], seq: d[1], inner: d[2], head_dim: d[3] },
        };
        if cos.dims() != [s.seq, s.head_dim] || sin.dims() != [s.seq, s.head_dim] {
            return Err(shape_err(
                op,
                self,
                cos,
                format!("cos/sin must be [{}, {}]", s.seq, s.head_dim),
            ));
        }
        if s.head_dim % 2 != 0 {
            return Err(invalid(op, format!("head_dim {} must be even", s.head_dim)));
        }
        if cuda_ordinal(op, &[self, cos, sin])?.is_some() {
            if let Some(t) = super::gpu_nn::rope(self, cos, sin, s)? {
                return Ok(t);
            }
            // f64: `compute` below runs it through the host.
        }
        let out = compute(op, &[self, cos, sin], self.shape().clone(), dtype, |st| {
            with_float_type!(dtype, op, |T| {
                let (x, c, sn) =
                    (typed::<T>(op, st[0])?, typed::<T>(op, st[1])?, typed::<T>(op, st[2])?);
                Ok(T::wrap(rope::rope_forward_new(&s, x, c, sn)?))
            })
        })?;
        let (c, sn) = (cos.detach(), sin.detach());
        Ok(record(op, &[self], out, move |g| {
            let dx = compute(op, &[g, &c, &sn], g.shape().clone(), dtype, |st| {
                with_float_type!(dtype, op, |T| {
                    let (dy, c, sn) =
                        (typed::<T>(op, st[0])?, typed::<T>(op, st[1])?, typed::<T>(op, st[2])?);
                    Ok(T::wrap(rope::rope_backward_new(&s, dy, c, sn)?))
                })
            })?;
            Ok(vec![Some(dx)])
        }))
    }

    /// RoPE of the heads-first view of `self` `[b, s, h, d]` (a projection's output split
    /// into heads): `self.transpose(1, 2)?.rope(cos, sin, RopeLayout::Bhsd)`, `[b, h, s, d]`,
    /// with the same values bit for bit. On a CUDA device one kernel reads `[b, s, h, d]`
    /// and writes the rotated `[b, h, s, d]` (no transpose copy), and the backward pass
    /// writes the gradient as `[b, s, h, d]` the same way; elsewhere (and for f64) it is
    /// the transpose then [`Tensor::rope`]. Differentiable in `self`.
    pub fn rope_bshd_to_bhsd(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let op = "rope";
        require_float(op, self)?;
        common_dtype(op, &[self, cos, sin])?;
        if self.rank() != 4 {
            return Err(invalid(op, format!("x must be 4-d [b, s, h, d], got {}", self.shape())));
        }
        let d = self.dims();
        let s = RopeShape { outer: d[0], seq: d[1], inner: d[2], head_dim: d[3] };
        let tables_fit = cos.dims() == [s.seq, s.head_dim] && sin.dims() == [s.seq, s.head_dim];
        if tables_fit
            && s.head_dim.is_multiple_of(2)
            && cuda_ordinal(op, &[self, cos, sin])?.is_some()
        {
            if let Some(t) = super::gpu_nn::rope_bshd_to_bhsd(self, cos, sin, s)? {
                return Ok(t);
            }
        }
        // Bad tables or head dims get `rope`'s errors here.
        self.transpose(1, 2)?.rope(cos, sin, RopeLayout::Bhsd)
    }

    /// Scaled dot-product attention, flash style (no `S x S` matrix is stored).
    ///
    /// `q`: `[b, hq, sq, d]`, `k`: `[b, hkv, sk, d]`, `v`: `[b, hkv, sk, dv]` with
    /// `hq % hkv == 0` (grouped-query attention). `mask` is an additive float mask
    /// broadcastable to `[b, hq, sq, sk]`; `causal` masks keys after the query (top-left
    /// aligned, as PyTorch's `is_causal`). `scale` defaults to `1/sqrt(d)`. A query whose
    /// keys are all masked gets zeros and a zero gradient, never NaN.
    pub fn scaled_dot_product_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        let op = "scaled_dot_product_attention";
        let mask_arg = mask;
        require_float(op, q)?;
        let dtype = common_dtype(op, &[q, k, v])?;
        if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
            return Err(shape_err(op, q, k, "q, k, v must be [batch, heads, seq, head_dim]"));
        }
        let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
        if kd[0] != qd[0] || vd[0] != qd[0] || kd[3] != qd[3] || vd[1] != kd[1] || vd[2] != kd[2] {
            return Err(shape_err(
                op,
                q,
                k,
                format!("v is {}: batch, heads, key length or head_dim disagree", v.shape()),
            ));
        }
        if kd[1] == 0 || qd[1] % kd[1] != 0 {
            return Err(shape_err(
                op,
                q,
                k,
                format!("{} query heads are not a multiple of {} kv heads", qd[1], kd[1]),
            ));
        }
        let s = SdpaShape {
            batch: qd[0],
            q_heads: qd[1],
            kv_heads: kd[1],
            q_len: qd[2],
            kv_len: kd[2],
            head_dim: qd[3],
            v_dim: vd[3],
            scale: scale.unwrap_or_else(|| default_sdpa_scale(qd[3])),
            causal,
        };
        let out_shape = Shape::new(&[s.batch, s.q_heads, s.q_len, s.v_dim]);
        let mask = sdpa_mask4(op, mask, dtype, &s, q)?;
        let mut inputs = vec![q, k, v];
        if let Some(m) = &mask {
            inputs.push(m);
        }
        if is_meta(op, &inputs)? {
            return meta(out_shape, dtype);
        }
        if let Some(i) = cuda_ordinal(op, &inputs)? {
            if let Some(t) = super::gpu_nn::sdpa(q, k, v, mask.as_ref(), &s)? {
                return Ok(t);
            }
            let mut ins = vec![q, k, v];
            ins.extend(mask_arg);
            return on_host(i, &ins, |h| {
                Tensor::scaled_dot_product_attention(&h[0], &h[1], &h[2], h.get(3), causal, scale)
            });
        }
        // The host kernel reads the mask by strides; a mask broadcast over the keys
        // is expanded to the key length first.
        let mask = match mask {
            None => None,
            Some(m4) => {
                let full = Shape::new(&[s.batch, s.q_heads, s.q_len, s.kv_len]);
                let m4 = if m4.dims()[3] != s.kv_len {
                    let mut e = m4.dims().to_vec();
                    e[3] = s.kv_len;
                    crate::autograd::no_grad(|| m4.expand(e))?
                } else {
                    m4
                };
                let st = broadcast_strides(m4.shape(), &full);
                Some((m4, st))
            }
        };
        let rows = s.batch * s.q_heads * s.q_len;
        with_float_type!(dtype, op, |T| {
            // The mask is small next to q/k/v; one host copy keeps the borrows simple.
            let mask_data: Option<(Vec<T>, Vec<usize>)> = match &mask {
                Some((m, st)) => Some((m.to_vec::<T>()?, st.clone())),
                None => None,
            };
            // A selective activation checkpoint may keep this output (crate::checkpoint).
            let keep = crate::checkpoint::SaveOp::Sdpa;
            let (out_t, lse) = crate::checkpoint::kept(keep, &[q, k, v], || {
                let mut lse = vec![<T as Float>::Acc::default(); rows];
                // Read q, k, v in place (no copies of the activations).
                let out = q.with_data::<T, _>(|qs| {
                    k.with_data::<T, _>(|ks| {
                        v.with_data::<T, _>(|vs| {
                            let m = mask_ref(&mask_data);
                            sdpa::sdpa_forward_new(&s, qs, ks, vs, m.as_ref(), &mut lse)
                        })
                    })
                })????;
                Ok((Tensor::from_vec(out, out_shape.clone())?, std::sync::Arc::new(lse)))
            })?;
            let (qq, kk, vt, oo) = (q.detach(), k.detach(), v.detach(), out_t.detach());
            Ok(record(op, &[q, k, v], out_t, move |g| {
                let m = mask_ref(&mask_data);
                let [dq, dk, dv] =
                    host_sdpa_backward(&s, [&qq, &kk, &vt, &oo, g], m.as_ref(), &lse)?;
                Ok(vec![Some(dq), Some(dk), Some(dv)])
            }))
        })
    }

    /// Cross-entropy of `self` (logits `[..., vocab]`) against i64 `targets` (`[...]`),
    /// averaged over targets that are not `ignore_index`; log-sum-exp in one pass, no
    /// softmax stored. When every target is ignored the loss is 0 with a zero gradient.
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: i64) -> Result<Tensor> {
        let op = "cross_entropy";
        require_float(op, self)?;
        if targets.dtype() != DType::I64 {
            return Err(TensorError::DTypeMismatch {
                op,
                expected: "i64 targets".into(),
                got: targets.dtype(),
            });
        }
        if self.rank() == 0 || targets.dims() != &self.dims()[..self.rank() - 1] {
            return Err(shape_err(
                op,
                self,
                targets,
                "targets must have the logits' shape without the vocab dim",
            ));
        }
        let dtype = self.dtype();
        if is_meta(op, &[self, targets])? {
            return meta(Shape::new(&[]), dtype);
        }
        if let Some(i) = cuda_ordinal(op, &[self, targets])? {
            if let Some(t) = super::gpu_nn::cross_entropy(self, targets, ignore_index)? {
                return Ok(t);
            }
            return on_host(i, &[self, targets], |h| h[0].cross_entropy(&h[1], ignore_index));
        }
        let vocab = self.dims()[self.rank() - 1];
        let rows = targets.numel();
        with_float_type!(dtype, op, |T| {
            let mut loss_rows = vec![<T as Float>::Acc::default(); rows];
            let mut lse = vec![<T as Float>::Acc::default(); rows];
            let count = self.with_data::<T, _>(|ls| {
                targets.with_data::<i64, _>(|ts| {
                    ce::cross_entropy_forward(
                        ls,
                        rows,
                        vocab,
                        ts,
                        ignore_index,
                        &mut loss_rows,
                        &mut lse,
                    )
                })
            })???;
            let total: f64 = loss_rows.iter().map(|v| v.f64()).sum();
            let loss = if count == 0 { 0.0 } else { total / count as f64 };
            let out = Tensor::from_vec(vec![<T as Element>::from_f64(loss)], Shape::new(&[]))?;
            let (x, t) = (self.detach(), targets.detach());
            Ok(record(op, &[self], out, move |g| {
                let scale = if count == 0 { 0.0 } else { g.item()? / count as f64 };
                let row_scale = [<<T as Float>::Acc as Acc>::of(scale)];
                let dl = x.with_data::<T, _>(|ls| {
                    t.with_data::<i64, _>(|ts| {
                        ce::cross_entropy_backward_new(
                            ls,
                            rows,
                            vocab,
                            ts,
                            0,
                            ignore_index,
                            &lse,
                            &row_scale,
                        )
                    })
                })???;
                Ok(vec![Some(Tensor::from_vec(dl, x.shape().clone())?)])
            }))
        })
    }

    /// Embedding lookup: rows of `weight` (`[vocab, dim]`) picked by i64 `ids`; output
    /// `ids.shape + [dim]`. An id outside `0..vocab` is an error naming it. The gradient
    /// of `weight` is a deterministic scatter-add.
    pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
        Tensor::embedding_masked(ids, weight, 0, false)
    }

    /// Embedding over a vocab shard holding rows `vocab_start..vocab_start + weight.rows`.
    /// With `masked`, ids outside the shard give zero rows (the vocab-parallel embedding,
    /// whose partial outputs are then summed across ranks); otherwise they are errors.
    pub fn embedding_masked(
        ids: &Tensor,
        weight: &Tensor,
        vocab_start: i64,
        masked: bool,
    ) -> Result<Tensor> {
        let op = "embedding";
        require_float(op, weight)?;
        if ids.dtype() != DType::I64 {
            return Err(TensorError::DTypeMismatch {
                op,
                expected: "i64 ids".into(),
                got: ids.dtype(),
            });
        }
        if weight.rank() != 2 {
            return Err(shape_err(op, ids, weight, "weight must be [vocab, dim]"));
        }
        let (vocab, dim) = (weight.dims()[0], weight.dims()[1]);
        let mut od = ids.dims().to_vec();
        od.push(dim);
        let dtype = weight.dtype();
        if is_meta(op, &[ids, weight])? {
            return meta(od, dtype);
        }
        if let Some(i) = cuda_ordinal(op, &[ids, weight])? {
            let out =
                super::gpu_nn::embedding(ids, weight, vocab_start, masked, od.clone().into())?;
            if let Some(t) = out {
                return Ok(t);
            }
            return on_host(i, &[ids, weight], |h| {
                Tensor::embedding_masked(&h[0], &h[1], vocab_start, masked)
            });
        }
        with_float_type!(dtype, op, |T| {
            let out = ids.with_data::<i64, _>(|is| {
                weight.with_data::<T, _>(|ws| {
                    emb::embedding_forward_new(ws, vocab, dim, is, vocab_start, masked)
                })
            })???;
            let out_t = Tensor::from_vec(out, od)?;
            let ids_c = ids.detach();
            Ok(record(op, &[weight], out_t, move |g| {
                if !needs_input_grad(0) {
                    return Ok(vec![None]);
                }
                let mut dw = crate::storage::zeros_vec::<T>(vocab * dim);
                ids_c.with_data::<i64, _>(|is| {
                    g.with_data::<T, _>(|gs| {
                        emb::embedding_backward(is, vocab_start, masked, gs, vocab, dim, &mut dw)
                    })
                })???;
                Ok(vec![Some(Tensor::from_vec(dw, [vocab, dim])?)])
            }))
        })
    }
}
