//! Batched matrix multiply: `out[b] (+)= op(A[b]) · op(B[b])`.
//!
//! f32 and f64 call the `gemm` crate directly (transposes are expressed as
//! strides, so they cost nothing); bf16 and f16 run on the same f32 product
//! block by block: B is widened once, each task widens its 64 output rows' part
//! of A, multiplies with f32 accumulation and rounds its rows once, so no
//! full-size f32 copy of A or of the output is made.

mod cpu;
mod narrow;
pub mod reference;
#[cfg(test)]
mod tests;

use crate::util::{bad, check_len, numel};
use crate::{Float, Result};
pub(crate) use cpu::{narrow_matmul_ldb, narrow_takes, small_matmul};

/// The shape of a batched product `out[b] = op(A[b]) · op(B[b])`, `out[b]` `[m, n]`.
///
/// `A[b]` is `[m, k]` row-major, or stored as `[k, m]` when `trans_a`; `B[b]` is
/// `[k, n]`, or stored as `[n, k]` when `trans_b`. Batch `b` of A starts at
/// `b * a_batch_stride` (0 broadcasts one matrix over the batch); likewise B.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// Number of products.
    pub batch: usize,
    /// Rows of `op(A)` and of the output.
    pub m: usize,
    /// Columns of `op(B)` and of the output.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// A is stored as `[k, m]`.
    pub trans_a: bool,
    /// B is stored as `[n, k]`.
    pub trans_b: bool,
    /// Elements between consecutive batches of A (0 = broadcast).
    pub a_batch_stride: usize,
    /// Elements between consecutive batches of B (0 = broadcast).
    pub b_batch_stride: usize,
}

impl GemmShape {
    /// `batch` contiguous, un-transposed products `[m, k] · [k, n]`.
    pub fn new(batch: usize, m: usize, n: usize, k: usize) -> Self {
        GemmShape {
            batch,
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            a_batch_stride: m.saturating_mul(k),
            b_batch_stride: k.saturating_mul(n),
        }
    }

    /// Number of elements an operand buffer must at least hold.
    fn extent(&self, op: &'static str, per: usize, stride: usize) -> Result<usize> {
        if self.batch == 0 || per == 0 {
            return Ok(0);
        }
        (self.batch - 1)
            .checked_mul(stride)
            .and_then(|x| x.checked_add(per))
            .ok_or_else(|| bad(op, format!("{self:?}: operand extent overflows usize")))
    }
}

/// Checks operand lengths against the shape; returns the extents of A and B.
fn validate(s: &GemmShape, a_len: usize, b_len: usize) -> Result<(usize, usize)> {
    const OP: &str = "matmul";
    let a_need = s.extent(OP, numel(OP, &[s.m, s.k])?, s.a_batch_stride)?;
    let b_need = s.extent(OP, numel(OP, &[s.k, s.n])?, s.b_batch_stride)?;
    if a_len < a_need || b_len < b_need {
        return Err(bad(
            OP,
            format!(
                "{s:?}: A has {a_len} elements (needs {a_need}), B has {b_len} (needs {b_need})"
            ),
        ));
    }
    Ok((a_need, b_need))
}

/// `out = A·B` (or `out += A·B` when `accumulate`) for every batch; `out` is
/// `[batch, m, n]`.
///
/// `a` and `b` must hold at least `(batch-1)*stride + m*k` (resp. `k*n`)
/// elements; `out` exactly `batch*m*n`.
pub fn matmul<T: Float>(
    s: &GemmShape,
    a: &[T],
    b: &[T],
    out: &mut [T],
    accumulate: bool,
) -> Result<()> {
    let (a_need, b_need) = validate(s, a.len(), b.len())?;
    check_len("matmul", "out", out.len(), numel("matmul", &[s.batch, s.m, s.n])?)?;
    cpu::matmul(s, &a[..a_need], &b[..b_need], out, accumulate)
}

/// `A·B` into a newly allocated `[batch, m, n]` vector, skipping the zero-fill a
/// caller-provided buffer would need (measurable on small and mid-size products).
pub fn matmul_new<T: Float>(s: &GemmShape, a: &[T], b: &[T]) -> Result<Vec<T>> {
    let (a_need, b_need) = validate(s, a.len(), b.len())?;
    numel("matmul", &[s.batch, s.m, s.n])?;
    cpu::matmul_new(s, &a[..a_need], &b[..b_need])
}
