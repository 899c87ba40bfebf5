//! `linear_many`: several linear layers of one input, `x W_i^T` for each weight, computed
//! by one GEMM (a transformer's q, k and v, or gate and up, projections).
//!
//! The forward concatenates the weights on dim 0 (a transient copy, outside the graph),
//! runs one product and splits its output on the last dim. Each piece is then a graph
//! node of its own with `x` and its own weight as inputs, whose backward is
//! [`Tensor::linear`]'s (`g W_i` for `x`, `g^T x` for `W_i`): the backward runs the
//! same products as separate linear layers would, and nothing of the concatenation is
//! kept for it.

use crate::autograd::{needs_input_grad, no_grad, record};
use crate::{Result, Tensor, TensorError};

const OP: &str = "linear_many";

impl Tensor {
    /// `[self W_0^T, self W_1^T, ...]` for weights `[out_i, in]` and `self` `[..., in]`
    /// (no bias), by one GEMM over the weights concatenated on dim 0; with autograd, each
    /// output's backward that of [`Tensor::linear`] with its own weight (see the module
    /// docs). The weights must share `in`, the dtype and the device of `self`.
    pub fn linear_many(&self, weights: &[Tensor]) -> Result<Vec<Tensor>> {
        check_weights(OP, self, weights)?;
        if weights.len() < 2 {
            return weights.iter().map(|w| self.linear(w, None)).collect();
        }
        let sizes: Vec<usize> = weights.iter().map(|w| w.dims()[0]).collect();
        let pieces = no_grad(|| -> Result<Vec<Tensor>> {
            let detached: Vec<Tensor> = weights.iter().map(Tensor::detach).collect();
            let w = Tensor::cat(&detached, 0)?; // [sum(out), in]
                                                // [..., in] x [sum(out), in]^T -> [..., sum(out)]
            let y = self.detach().matmul_t(&w, false, true)?;
            y.split_sizes(&sizes, -1)
        })?;
        Ok(pieces
            .into_iter()
            .zip(weights)
            .map(|(piece, w)| {
                let (x, w) = (self.clone(), w.clone());
                let inputs = [&x, &w];
                let adjoint = linear_adjoint(x.clone(), w.clone());
                record(OP, &inputs, piece, adjoint)
            })
            .collect())
    }
}

/// The backward of `x W^T` (as [`Tensor::matmul_t`]'s with `trans_b`): `g W` for `x`,
/// `g^T x` over the rows of every leading dim for `W`.
fn linear_adjoint(
    x: Tensor,
    w: Tensor,
) -> impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static {
    move |g| {
        let gx = if x.requires_grad() && needs_input_grad(0) {
            Some(g.matmul_t(&w, false, false)?.sum_to(x.shape())?) // [..., out] x [out, in]
        } else {
            None
        };
        let gw = if w.requires_grad() && needs_input_grad(1) {
            let r = if x.rank() > 2 {
                let rows: usize = x.dims()[..x.rank() - 1].iter().product();
                let x2 = x.reshape([rows, x.dims()[x.rank() - 1]])?;
                let g2 = g.reshape([rows, g.dims()[g.rank() - 1]])?;
                g2.matmul_t(&x2, true, false)? // [rows, out]^T x [rows, in] -> [out, in]
            } else {
                g.matmul_t(&x, true, false)?
            };
            Some(r.sum_to(w.shape())?)
        } else {
            None
        };
        Ok(vec![gx, gw])
    }
}

/// Checks that every weight is `[out_features, in_features]` for `x`'s last dim, with
/// `x`'s dtype and device (the weights of [`Tensor::linear_many`] and
/// [`Tensor::linear_concat`]).
pub(super) fn check_weights(op: &'static str, x: &Tensor, weights: &[Tensor]) -> Result<()> {
    let in_f = x.dims().last().copied();
    for w in weights {
        if w.rank() != 2 || Some(w.dims()[1]) != in_f {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: x.shape().clone(),
                rhs: w.shape().clone(),
                why: "each weight must be [out_features, in_features]".into(),
            });
        }
        if w.dtype() != x.dtype() || w.device() != x.device() {
            return Err(super::invalid(
                op,
                format!(
                    "weight {} on {:?} for an input {} on {:?}",
                    w.dtype(),
                    w.device(),
                    x.dtype(),
                    x.device()
                ),
            ));
        }
    }
    Ok(())
}
