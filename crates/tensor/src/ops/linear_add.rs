//! `linear_add`: a linear layer's product with a residual added, `x W^T + r`, as one op
//! (a transformer block's `h = x + o_proj(a)`).
//!
//! On the host it is [`Tensor::linear`] then [`Tensor::add`], so its results (and
//! gradients) are those of the two ops bit for bit. On a CUDA device it is one GEMM that
//! reads the residual as its C operand (`D = X W^T + 1 * C`), so no elementwise add
//! kernel runs: cuBLASLt reads C from the residual and writes D to the output
//! ([`k_gemm::gemm_to`]); tpar's own GEMM (and the emulator) first copies the residual
//! into the output on the device and accumulates onto it. The product and the residual are then summed in f32 and
//! rounded once, where the two ops round the product first: for bf16 and f16 outputs
//! the results may differ from the two ops' by a unit in the last place.

use tpar_kernels::cuda::ops::gemm as k_gemm;
use tpar_kernels::gemm::GemmShape;

use super::gpu::{cuda_dtype, device_of, with_gpu, Out};
use crate::autograd::{needs_input_grad, record};
use crate::{Device, Result, Tensor, TensorError};

const OP: &str = "linear_add";

impl Tensor {
    /// `self W^T + residual` for `W` `[out, in]`, `self` `[..., in]` and `residual`
    /// `[..., out]` (the shape of the product; no broadcasting), with autograd: the
    /// residual's gradient is the output's, `self`'s and `W`'s are [`Tensor::linear`]'s.
    ///
    /// On the host it is `residual + self.linear(W)` (the same bits); on a CUDA device one
    /// GEMM that reads the residual as its C operand (see the module docs for rounding).
    pub fn linear_add(&self, weight: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let mismatch = |rhs: &Tensor, why: String| TensorError::ShapeMismatch {
            op: OP,
            lhs: self.shape().clone(),
            rhs: rhs.shape().clone(),
            why,
        };
        if weight.rank() != 2
            || self.rank() == 0
            || self.dims()[self.rank() - 1] != weight.dims()[1]
        {
            return Err(mismatch(weight, "weight must be [out_features, in_features]".into()));
        }
        let mut out_dims = self.dims().to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = weight.dims()[0];
        }
        if residual.dims() != out_dims.as_slice() {
            return Err(mismatch(
                residual,
                format!("the residual must have the product's shape {out_dims:?}"),
            ));
        }
        if let Some(t) = on_device(self, weight, residual, &out_dims)? {
            return Ok(t);
        }
        residual.add(&self.linear(weight, None)?)
    }
}

/// The one-GEMM form on a CUDA device; `None` where the operands are not CUDA tensors of
/// one kernel dtype on one device (the caller then composes the two ops).
fn on_device(x: &Tensor, w: &Tensor, r: &Tensor, out_dims: &[usize]) -> Result<Option<Tensor>> {
    let Device::Cuda(_) = x.device() else { return Ok(None) };
    if w.device() != x.device() || r.device() != x.device() {
        return Ok(None);
    }
    if w.dtype() != x.dtype() || r.dtype() != x.dtype() {
        return Ok(None);
    }
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let (n, k) = (w.dims()[0], w.dims()[1]);
    let rows = x.numel().checked_div(k).unwrap_or(0);
    if [rows, n, k].iter().any(|&d| d == 0 || d > k_gemm::MAX_DIM) {
        return Ok(None);
    }
    let dev = device_of(x, OP)?;
    // A selective activation checkpoint keeps it as the matmul it contains.
    let keep = crate::checkpoint::SaveOp::Matmul;
    let out = crate::checkpoint::kept(keep, &[x, w, r], || {
        // Inside a recompute, an output no backward reads is not computed.
        crate::checkpoint::product_unless_unread(out_dims, x.dtype(), x.device(), || {
            let mut out = Out::new(&dev, out_dims.to_vec(), x.dtype())?;
            with_gpu(OP, &[x, w, r], |v| {
                // [rows, k] x [n, k]^T + C -> [rows, n], C = the residual: read in place by
                // cuBLASLt (separate C and D), else copied into the output first.
                let shape = GemmShape {
                    batch: 1,
                    m: rows,
                    n,
                    k,
                    trans_a: false,
                    trans_b: true,
                    a_batch_stride: 0,
                    b_batch_stride: 0,
                };
                let p = k_gemm::GemmProblem::new(shape, cd, cd).with_scale(1.0, 1.0);
                Ok(k_gemm::gemm_to(
                    &*dev,
                    &p,
                    v[0].view(),
                    v[1].view(),
                    v[2].view(),
                    out.view_mut(),
                )?)
            })?;
            Ok(out.into_tensor())
        })
    })?;
    let (xi, wi) = (x.clone(), w.clone());
    Ok(Some(record(OP, &[x, w, r], out, move |g| {
        let gx = if xi.requires_grad() && needs_input_grad(0) {
            Some(g.matmul(&wi)?) // [..., n] x [n, k] -> [..., k]
        } else {
            None
        };
        let gw = if wi.requires_grad() && needs_input_grad(1) {
            let x2 = xi.reshape([rows, k])?;
            let g2 = g.reshape([rows, n])?;
            Some(g2.matmul_t(&x2, true, false)?) // [rows, n]^T x [rows, k] -> [n, k]
        } else {
            None
        };
        Ok(vec![gx, gw, Some(g.clone())])
    })))
}
