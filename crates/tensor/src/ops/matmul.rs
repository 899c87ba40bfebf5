//! Matrix products: batched, with transposed operands read in place, and `linear`.

use tpar_kernels::gemm::{matmul_new, GemmShape};

use super::{common_dtype, compute, require_float};
use crate::autograd::{needs_input_grad, record};
use crate::shape::broadcast_shapes;
use crate::storage::Element;
use crate::tensor::typed;
use crate::{with_float_type, Result, Shape, Tensor, TensorError};

/// `(rows, cols)` of an operand as used, after the optional transpose.
fn mat_dims(t: &Tensor, trans: bool) -> (usize, usize) {
    let r = t.rank();
    let (a, b) = (t.dims()[r - 2], t.dims()[r - 1]);
    if trans {
        (b, a)
    } else {
        (a, b)
    }
}

fn mm_raw(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
    let op = "matmul";
    require_float(op, a)?;
    let dtype = common_dtype(op, &[a, b])?;
    if a.rank() < 2 || b.rank() < 2 {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
            why: "both operands need at least 2 dims".into(),
        });
    }
    let (m, k) = mat_dims(a, ta);
    let (k2, n) = mat_dims(b, tb);
    if k != k2 {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
            why: format!("inner dims differ: {k} vs {k2} (transposed: lhs {ta}, rhs {tb})"),
        });
    }
    let ba = &a.dims()[..a.rank() - 2];
    let bb = &b.dims()[..b.rank() - 2];
    let (batch_dims, shape) = if bb.is_empty() && !ta {
        // Fold a's batch into its rows: one big GEMM.
        let rows: usize = ba.iter().product::<usize>() * m;
        (
            ba.to_vec(),
            GemmShape {
                batch: 1,
                m: rows,
                n,
                k,
                trans_a: false,
                trans_b: tb,
                a_batch_stride: 0,
                b_batch_stride: 0,
            },
        )
    } else if ba == bb || ba.is_empty() || bb.is_empty() {
        let bd = if ba.is_empty() { bb.to_vec() } else { ba.to_vec() };
        let batch = bd.iter().product();
        let sa = if ba.is_empty() { 0 } else { m * k };
        let sb = if bb.is_empty() { 0 } else { k * n };
        (
            bd,
            GemmShape {
                batch,
                m,
                n,
                k,
                trans_a: ta,
                trans_b: tb,
                a_batch_stride: sa,
                b_batch_stride: sb,
            },
        )
    } else {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
            why: "batch dims must be equal here (matmul broadcasts them first)".into(),
        });
    };
    let mut od = batch_dims;
    od.extend_from_slice(&[m, n]);
    compute(op, &[a, b], Shape::from(od), dtype, |st| {
        with_float_type!(dtype, op, |T| {
            Ok(T::wrap(matmul_new(&shape, typed::<T>(op, st[0])?, typed::<T>(op, st[1])?)?))
        })
    })
}

/// The dims of `op(a) x op(b)` for operands of rank 2 or more whose batch dims are equal
/// or absent on one side (what `mm_raw` takes), `None` otherwise.
fn product_dims(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Option<Vec<usize>> {
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return None;
    }
    let (ba, bb) = (&a.dims()[..ra - 2], &b.dims()[..rb - 2]);
    let batch = match (ba.is_empty(), bb.is_empty()) {
        (_, true) => ba,
        (true, false) => bb,
        (false, false) if ba == bb => ba,
        _ => return None,
    };
    let m = if ta { a.dims()[ra - 1] } else { a.dims()[ra - 2] };
    let n = if tb { b.dims()[rb - 2] } else { b.dims()[rb - 1] };
    let mut dims = batch.to_vec();
    dims.extend([m, n]);
    Some(dims)
}

impl Tensor {
    /// Matrix product with numpy batch broadcasting: `[..., m, k] x [..., k, n]`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.matmul_t(rhs, false, false)
    }

    /// `op(self) x op(rhs)` where `op` transposes the last two dims when its flag is set.
    /// Transposed operands are read in place (no copy), as BLAS's `T` flags.
    pub fn matmul_t(&self, rhs: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
        // CUDA tensors with GEMM kernels (broadcasting included) run on the device.
        if let Some(t) = super::gpu_nn::matmul(self, rhs, ta, tb)? {
            return Ok(t);
        }
        if self.rank() >= 2 && rhs.rank() >= 2 {
            let ba = Shape::new(&self.dims()[..self.rank() - 2]);
            let bb = Shape::new(&rhs.dims()[..rhs.rank() - 2]);
            let fast = ba == bb || ba.rank() == 0 || bb.rank() == 0;
            if !fast {
                let batch = broadcast_shapes("matmul", &ba, &bb)?;
                let full = |t: &Tensor| -> Result<Tensor> {
                    let mut d = batch.dims().to_vec();
                    d.extend_from_slice(&t.dims()[t.rank() - 2..]);
                    t.expand(d)
                };
                return full(self)?.matmul_t(&full(rhs)?, ta, tb);
            }
        }
        // A selective activation checkpoint may keep this output (crate::checkpoint).
        let keep = crate::checkpoint::SaveOp::Matmul;
        let out = crate::checkpoint::kept(keep, &[self, rhs], || {
            match product_dims(self, rhs, ta, tb) {
                // Inside a recompute, a product whose output no backward reads is not computed.
                Some(dims) => crate::checkpoint::product_unless_unread(
                    &dims,
                    self.dtype(),
                    self.device(),
                    || mm_raw(self, rhs, ta, tb),
                ),
                None => mm_raw(self, rhs, ta, tb),
            }
        })?;
        let (a, b) = (self.clone(), rhs.clone());
        Ok(record("matmul", &[self, rhs], out, move |g| {
            // Each half is a GEMM of its own: compute only those asked for.
            let ga = if a.requires_grad() && needs_input_grad(0) {
                let r = match (ta, tb) {
                    (false, false) => g.matmul_t(&b, false, true)?,
                    (false, true) => g.matmul_t(&b, false, false)?,
                    (true, false) => b.matmul_t(g, false, true)?,
                    (true, true) => b.matmul_t(g, true, true)?,
                };
                Some(r.sum_to(a.shape())?)
            } else {
                None
            };
            let gb = if b.requires_grad() && needs_input_grad(1) {
                let r = if b.rank() == 2 && a.rank() > 2 && !ta {
                    // Fold the batch dims into rows (counted from the dims, so empty
                    // inner or output dims keep their row count).
                    let rows: usize = a.dims()[..a.rank() - 1].iter().product();
                    let a2 = a.reshape([rows, a.dims()[a.rank() - 1]])?;
                    let g2 = g.reshape([rows, g.dims()[g.rank() - 1]])?;
                    if tb {
                        g2.matmul_t(&a2, true, false)?
                    } else {
                        a2.matmul_t(&g2, true, false)?
                    }
                } else {
                    match (ta, tb) {
                        (false, false) => a.matmul_t(g, true, false)?,
                        (false, true) => g.matmul_t(&a, true, false)?,
                        (true, false) => a.matmul_t(g, false, false)?,
                        (true, true) => g.matmul_t(&a, true, true)?,
                    }
                };
                Some(r.sum_to(b.shape())?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }))
    }

    /// `x W^T + b` for `W` of shape `[out, in]` (PyTorch's layout), over any leading dims.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if weight.rank() != 2 {
            return Err(TensorError::ShapeMismatch {
                op: "linear",
                lhs: self.shape().clone(),
                rhs: weight.shape().clone(),
                why: "weight must be [out_features, in_features]".into(),
            });
        }
        let y = self.matmul_t(weight, false, true)?; // [..., in] x [out, in]^T -> [..., out]
        match bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}
