//! `linear_concat`: several linear layers of one input as one output, `x [W_0; W_1; ...]^T`
//! (a transformer's q, k and v projections computed as the packed input of
//! [`Tensor::attention_packed`]), and `linear_concat_rope`, the same with RoPE applied
//! to the first outputs' heads (the packed input of [`Tensor::attention_packed_rotated`]).
//!
//! The forward concatenates the weights on dim 0 (a transient copy, outside the graph)
//! and runs one product whose output is kept whole (not split, unlike
//! [`Tensor::linear_many`]). The node's inputs are `x` and each weight; it keeps the
//! weights themselves, not their concatenation (under FSDP the gathered weights are
//! what it keeps, as a separate linear layer would), and its backward concatenates them
//! again for `x`'s gradient, `g [W_0; W_1; ...]`, one product over every output column,
//! and computes the weights' gradients as the rows of one product `g^T x`.
//!
//! With RoPE, on a CUDA device the rotation is the GEMM's epilogue
//! ([`k_fused::gemm_fused`]: fused in the Hopper kernel where it takes the call, else
//! the plain GEMM then one RoPE launch in place), and the backward first rotates the
//! rotated columns of `g` back (one RoPE-backward launch into a new buffer, the other
//! columns copied beside them) before the same products. On the host (and for f64) it
//! is `linear_concat`, then [`Tensor::rope`] of those columns viewed as `[.., s, heads,
//! hd]` and the columns concatenated again.

use tpar_kernels::cuda::ops::gemm as k_gemm;
use tpar_kernels::cuda::ops::gemm_fused as k_fused;
use tpar_kernels::cuda::ops::{layout as k_layout, rope as k_rope};
use tpar_kernels::gemm::GemmShape;
use tpar_kernels::rope::RopeShape;

use super::gpu::{cuda_dtype, device_of, with_gpu, Out};
use super::nn::RopeLayout;
use super::{common_device, common_dtype, invalid};
use crate::autograd::{needs_input_grad, no_grad, record};
use crate::checkpoint::{kept, SaveOp};
use crate::Device;
use crate::{Result, Tensor};

const OP: &str = "linear_concat";
const ROPE_OP: &str = "linear_concat_rope";

impl Tensor {
    /// `self [W_0; W_1; ...]^T` for weights `[out_i, in]` and `self` `[..., in]` (no
    /// bias): `[..., sum(out_i)]`, each weight's outputs in its own columns, by one GEMM
    /// (see the module docs). Differentiable in `self` and every weight; the weights must
    /// share `in`, the dtype and the device of `self`.
    pub fn linear_concat(&self, weights: &[Tensor]) -> Result<Tensor> {
        if weights.is_empty() {
            return Err(super::invalid(OP, "no weights given"));
        }
        super::linear_many::check_weights(OP, self, weights)?;
        let detached: Vec<Tensor> = weights.iter().map(Tensor::detach).collect();
        // [..., in] x [sum(out), in]^T -> [..., sum(out)]
        let y = no_grad(|| self.detach().matmul_t(&Tensor::cat(&detached, 0)?, false, true))?;
        Ok(concat_node(OP, self, weights, y, None))
    }

    /// [`Tensor::linear_concat`] with RoPE (rotate-half, as [`Tensor::rope`]) applied to
    /// the outputs of the first `rotated` weights, in heads of `head_dim` columns (the
    /// width of `cos` and `sin`), each row at its position along dim -2 of `self`
    /// `[..., s, in]`: with `cos` and `sin` `[n, head_dim]`, `n >= s`, whose first `s`
    /// rows are used. For a Llama block's `x [Wq; Wk; Wv]^T` with `rotated = 2` it is the
    /// packed q/k/v projection with q and k rotated, as
    /// [`Tensor::attention_packed_rotated`] reads it. The rotated weights' widths must be
    /// multiples of `head_dim`, which must be even. Differentiable in `self` and every
    /// weight.
    ///
    /// On the host it is, bit for bit and with the same gradients, `linear_concat` and
    /// RoPE of those columns; on a CUDA device the rotation runs where the GEMM writes
    /// its output (see the module docs): fused in the Hopper kernel the product is
    /// rotated in f32 and rounded once, elsewhere rounded before and after the rotation
    /// as the host does.
    pub fn linear_concat_rope(
        &self,
        weights: &[Tensor],
        rotated: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        if weights.is_empty() {
            return Err(invalid(ROPE_OP, "no weights given"));
        }
        super::linear_many::check_weights(ROPE_OP, self, weights)?;
        let rope = Rope::of(self, weights, rotated, cos, sin)?;
        let mut all = vec![self, cos, sin];
        all.extend(weights);
        common_dtype(ROPE_OP, &all)?;
        if common_device(ROPE_OP, &all)? == Device::Meta {
            return self.linear_concat(weights);
        }
        let on_device = no_grad(|| rope.product_on_device(&self.detach(), weights))?;
        match on_device {
            Some(y) => Ok(concat_node(ROPE_OP, self, weights, y, Some(rope))),
            None => rope.rotate(&self.linear_concat(weights)?),
        }
    }
}

/// RoPE of the first `cols` output columns of a `[..., s, n]` product, in heads of `hd`.
struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// Positions per sequence (dim -2 of the input).
    s: usize,
    /// Rows of the product over all leading dims.
    rows: usize,
    /// Columns of the product.
    n: usize,
    /// Columns rotated.
    cols: usize,
    /// Head dim.
    hd: usize,
}

impl Rope {
    /// The rotation `linear_concat_rope` applies for `x`, `weights`, `rotated`, `cos`
    /// and `sin`, or the error naming what does not fit.
    fn of(
        x: &Tensor,
        weights: &[Tensor],
        rotated: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Rope> {
        if x.rank() < 2 {
            return Err(invalid(
                ROPE_OP,
                format!(
                    "the input must be [..., seq, in] (positions on dim -2), got {}",
                    x.shape()
                ),
            ));
        }
        if rotated > weights.len() {
            return Err(invalid(
                ROPE_OP,
                format!("{rotated} weights to rotate, {} given", weights.len()),
            ));
        }
        let s = x.dims()[x.rank() - 2];
        let hd = if cos.rank() == 2 { cos.dims()[1] } else { 0 };
        let table = |t: &Tensor| t.rank() == 2 && t.dims()[0] >= s && t.dims()[1] == hd;
        if hd == 0 || !hd.is_multiple_of(2) || !table(cos) || !table(sin) {
            return Err(invalid(
                ROPE_OP,
                format!(
                    "cos and sin must be [n, head_dim] with n >= the sequence length {s} and an \
                     even head_dim > 0, got {} and {}",
                    cos.shape(),
                    sin.shape()
                ),
            ));
        }
        if let Some(w) = weights[..rotated].iter().find(|w| !w.dims()[0].is_multiple_of(hd)) {
            return Err(invalid(
                ROPE_OP,
                format!("a rotated weight has {} outputs, not whole heads of {hd}", w.dims()[0]),
            ));
        }
        let cols = weights[..rotated].iter().map(|w| w.dims()[0]).sum();
        let n = weights.iter().map(|w| w.dims()[0]).sum();
        let rows = x.dims()[..x.rank() - 1].iter().product();
        let (cos, sin) = (cos.detach(), sin.detach());
        Ok(Rope { cos, sin, s, rows, n, cols, hd })
    }

    /// The dims of the rotated columns as `[outer, s, heads, hd]`.
    fn heads_dims(&self) -> [usize; 4] {
        [self.rows.checked_div(self.s).unwrap_or(0), self.s, self.cols / self.hd, self.hd]
    }

    /// The tables cut to the sequence.
    fn tables(&self) -> Result<(Tensor, Tensor)> {
        if self.cos.dims()[0] == self.s {
            return Ok((self.cos.clone(), self.sin.clone()));
        }
        Ok((self.cos.narrow(0, 0, self.s)?, self.sin.narrow(0, 0, self.s)?))
    }

    /// `y` `[..., n]` with its first `cols` columns rotated, by ops (the host's way; their
    /// autograd is the rotation's).
    fn rotate(&self, y: &Tensor) -> Result<Tensor> {
        if self.cols == 0 || y.numel() == 0 {
            return Ok(y.clone());
        }
        let (cos, sin) = self.tables()?;
        let parts = y.split_sizes(&[self.cols, self.n - self.cols], -1)?;
        let heads = parts[0].reshape(self.heads_dims())?;
        let rotated =
            heads.rope(&cos, &sin, RopeLayout::Bshd)?.reshape(parts[0].shape().clone())?;
        Tensor::cat(&[rotated, parts[1].clone()], -1)
    }

    /// The product `x w^T` rotated by one fused GEMM on a CUDA device; `None` where the
    /// operands are not CUDA tensors of a kernel dtype or the sizes do not fit a GEMM.
    fn product_on_device(&self, x: &Tensor, weights: &[Tensor]) -> Result<Option<Tensor>> {
        let Device::Cuda(_) = x.device() else { return Ok(None) };
        let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
        let k = x.dims()[x.rank() - 1];
        if [self.rows, self.n, k].iter().any(|&d| d == 0 || d > k_gemm::MAX_DIM) {
            return Ok(None);
        }
        let dev = device_of(x, ROPE_OP)?;
        let mut out_dims = x.dims().to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = self.n;
        }
        let mut operands = vec![x];
        operands.extend(weights);
        // A selective activation checkpoint keeps it as the matmul it contains (and its
        // recompute then concatenates no weights).
        let out = kept(SaveOp::Matmul, &operands, || {
            let detached: Vec<Tensor> = weights.iter().map(Tensor::detach).collect();
            let w = &Tensor::cat(&detached, 0)?; // [sum(out), in]
            let mut out = Out::new(&dev, out_dims.clone(), x.dtype())?;
            with_gpu(ROPE_OP, &[x, w, &self.cos, &self.sin], |v| {
                // [rows, k] x [n, k]^T -> [rows, n], the first `cols` columns rotated
                let shape = GemmShape {
                    batch: 1,
                    m: self.rows,
                    n: self.n,
                    k,
                    trans_a: false,
                    trans_b: true,
                    a_batch_stride: 0,
                    b_batch_stride: 0,
                };
                let p = k_gemm::GemmProblem::new(shape, cd, cd);
                let rope = (self.cols > 0).then(|| k_fused::FusedRope {
                    cos: v[2].view(),
                    sin: v[3].view(),
                    head_dim: self.hd,
                    cols: self.cols,
                    seq: self.s,
                });
                let epi = k_fused::FusedEpilogue { rope, ..Default::default() };
                k_fused::gemm_fused(&*dev, &p, epi, v[0].view(), v[1].view(), out.view_mut())?;
                Ok(())
            })?;
            Ok(out.into_tensor())
        })?;
        Ok(Some(out))
    }

    /// The gradient of the unrotated product from `g`, the rotated one's: its first
    /// `cols` columns rotated back (RoPE's transpose), the others as they are.
    fn unrotate(&self, g: &Tensor) -> Result<Tensor> {
        if self.cols == 0 || g.numel() == 0 {
            return Ok(g.clone());
        }
        let on_device = match g.device() {
            Device::Cuda(_) => cuda_dtype(g.dtype()),
            _ => None,
        };
        // The node exists only where the product ran on the device (`product_on_device`).
        let Some(cd) = on_device else {
            return Err(invalid(ROPE_OP, format!("a {} gradient on {}", g.dtype(), g.device())));
        };
        let dev = device_of(g, ROPE_OP)?;
        let mut out = Out::new(&dev, g.shape().clone(), g.dtype())?;
        let [outer, s, heads, hd] = self.heads_dims();
        let es = cd.size();
        with_gpu(ROPE_OP, &[g, &self.cos, &self.sin], |v| {
            let shape = RopeShape { outer, seq: s, inner: heads, head_dim: hd };
            let st = k_rope::RopeStrides { outer: s * self.n, seq: self.n, inner: hd };
            let (c, sn) = (v[1].view(), v[2].view());
            k_rope::rope_strided(
                &*dev,
                cd,
                &shape,
                (v[0].view(), st),
                c,
                sn,
                (out.view_mut(), st),
                true,
            )?;
            let rest = self.n - self.cols;
            if rest > 0 {
                let src = v[0].view();
                let src = src.slice(self.cols * es..src.len())?;
                let dst = super::gpu_nn::out_from(&mut out, self.cols, es)?;
                k_layout::copy2d(&*dev, es, self.rows, rest, src, self.n, dst, self.n)?;
            }
            Ok(())
        })?;
        Ok(out.into_tensor())
    }
}

/// The node of `x [W_0; W_1; ...]^T` (rotated by `rope`) with output `y`: its backward
/// rotates `g` back, then `g [W_0; ...]` for `x` and the rows of `g^T x` for the weights.
fn concat_node(
    op: &'static str,
    x: &Tensor,
    weights: &[Tensor],
    y: Tensor,
    rope: Option<Rope>,
) -> Tensor {
    let detached: Vec<Tensor> = weights.iter().map(Tensor::detach).collect();
    let sizes: Vec<usize> = weights.iter().map(|w| w.dims()[0]).collect();
    let xd = x.detach();
    let mut inputs = vec![x];
    inputs.extend(weights);
    record(op, &inputs, y, move |g| {
        let g = match &rope {
            Some(r) => r.unrotate(g)?,
            None => g.clone(),
        };
        let mut grads = Vec::with_capacity(detached.len() + 1);
        grads.push(if needs_input_grad(0) {
            // [..., sum(out)] x [sum(out), in] -> [..., in]
            Some(g.matmul_t(&Tensor::cat(&detached, 0)?, false, false)?)
        } else {
            None
        });
        let rows: usize = xd.dims()[..xd.rank() - 1].iter().product();
        let x2 = xd.reshape([rows, xd.dims()[xd.rank() - 1]])?;
        let g2 = g.reshape([rows, g.dims()[g.rank() - 1]])?;
        // [rows, sum(out)]^T x [rows, in] -> [sum(out), in], one weight's rows each
        let gw = g2.matmul_t(&x2, true, false)?.split_sizes(&sizes, 0)?;
        grads.extend(gw.into_iter().map(Some));
        Ok(grads)
    })
}
