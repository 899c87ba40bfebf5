//! Comparison tolerances per dtype, written once for every test in the workspace.

use crate::{DType, Result, Tensor, TensorError};

/// Relative and absolute tolerance for comparing results of one dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tol {
    /// Relative tolerance.
    pub rel: f64,
    /// Absolute tolerance.
    pub abs: f64,
}

impl Tol {
    /// The tolerance appropriate for results computed in `dtype`.
    pub fn for_dtype(dtype: DType) -> Tol {
        match dtype {
            DType::F64 => Tol { rel: 1e-9, abs: 1e-10 },
            DType::F32 => Tol { rel: 1e-4, abs: 1e-5 },
            DType::BF16 => Tol { rel: 2e-2, abs: 2e-2 },
            DType::F16 => Tol { rel: 5e-3, abs: 5e-3 },
            DType::I64 => Tol { rel: 0.0, abs: 0.0 },
        }
    }

    /// Scales both tolerances (for long reductions or chains of ops).
    pub fn scaled(self, k: f64) -> Tol {
        Tol { rel: self.rel * k, abs: self.abs * k }
    }

    /// Whether `got` is within tolerance of `want`.
    pub fn close(&self, got: f64, want: f64) -> bool {
        (got - want).abs() <= self.abs + self.rel * want.abs() || (got.is_nan() && want.is_nan())
    }

    /// Compares two slices element by element; the error names the first mismatch.
    pub fn check(&self, what: &str, got: &[f64], want: &[f64]) -> Result<()> {
        if got.len() != want.len() {
            return Err(TensorError::InvalidArgument {
                op: "tol_check",
                what: format!("{what}: {} values vs {} expected", got.len(), want.len()),
            });
        }
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if !self.close(g, w) {
                return Err(TensorError::InvalidArgument {
                    op: "tol_check",
                    what: format!("{what}: element {i}: got {g}, expected {w} (tol {self:?})"),
                });
            }
        }
        Ok(())
    }

    /// Compares two tensors (any dtypes, same shape).
    pub fn check_tensors(&self, what: &str, got: &Tensor, want: &Tensor) -> Result<()> {
        if got.shape() != want.shape() {
            return Err(TensorError::ShapeMismatch {
                op: "tol_check",
                lhs: got.shape().clone(),
                rhs: want.shape().clone(),
                why: what.to_string(),
            });
        }
        self.check(what, &got.to_vec_f64()?, &want.to_vec_f64()?)
    }
}
