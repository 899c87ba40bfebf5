//! `linear_concat`: several linear layers of one input as one output, `x [W_0; W_1; ...]^T`
//! (a transformer's q, k and v projections computed as the packed input of
//! [`Tensor::attention_packed`]).
//!
//! The forward concatenates the weights on dim 0 (a transient copy, outside the graph)
//! and runs one product whose output is kept whole (not split, unlike
//! [`Tensor::linear_many`]). The node's inputs are `x` and each weight; it keeps the
//! weights themselves, not their concatenation (under FSDP the gathered weights are
//! what it keeps, as a separate linear layer would), and its backward concatenates them
//! again for `x`'s gradient, `g [W_0; W_1; ...]`, one product over every output column,
//! and computes the weights' gradients as the rows of one product `g^T x`.

use crate::autograd::{needs_input_grad, no_grad, record};
use crate::{Result, Tensor};

const OP: &str = "linear_concat";

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
        let sizes: Vec<usize> = weights.iter().map(|w| w.dims()[0]).collect();
        // the weights as one [sum(out), in]
        let concat = |ws: &[Tensor]| Tensor::cat(ws, 0);
        // [..., in] x [sum(out), in]^T -> [..., sum(out)]
        let y = no_grad(|| self.detach().matmul_t(&concat(&detached)?, false, true))?;
        let x = self.detach();
        let mut inputs = vec![self];
        inputs.extend(weights);
        Ok(record(OP, &inputs, y, move |g| {
            let mut grads = Vec::with_capacity(detached.len() + 1);
            grads.push(if needs_input_grad(0) {
                // [..., sum(out)] x [sum(out), in] -> [..., in]
                Some(g.matmul_t(&concat(&detached)?, false, false)?)
            } else {
                None
            });
            let rows: usize = x.dims()[..x.rank() - 1].iter().product();
            let x2 = x.reshape([rows, x.dims()[x.rank() - 1]])?;
            let g2 = g.reshape([rows, g.dims()[g.rank() - 1]])?;
            // [rows, sum(out)]^T x [rows, in] -> [sum(out), in], one weight's rows each
            let gw = g2.matmul_t(&x2, true, false)?.split_sizes(&sizes, 0)?;
            grads.extend(gw.into_iter().map(Some));
            Ok(grads)
        }))
    }
}
