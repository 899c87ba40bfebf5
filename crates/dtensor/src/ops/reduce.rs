//! Reductions: `sum` and `mean` over dims.

use tpar_placements::{Placement, ReduceOp};
use tpar_tensor::shape::normalize_dim;

use super::{finish, global_shape, is_linear_partial, meta, no_rule, prepare, unary_rule};
use crate::{DTensor, Result};

use Placement::{Partial, Replicate, Shard};

impl DTensor {
    /// The sorted, deduplicated dims of a reduction, or an error naming them.
    fn reduce_dims(&self, op: &'static str, dims: &[isize]) -> Result<Vec<usize>> {
        let mut ds = dims
            .iter()
            .map(|&d| normalize_dim(op, d, self.shape().len()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| no_rule(op, &[("input", self)], &e.to_string()))?;
        ds.sort_unstable();
        ds.dedup();
        Ok(ds)
    }

    /// Sum over `dims` (negative dims count from the end).
    ///
    /// Rules per mesh dim: `S(d)` with `d` reduced -> `Partial(sum)` (each rank sums its
    /// rows; no communication); `S(d)` with `d` kept -> `S(d')` (`d'` counts the removed
    /// dims when `keepdim` is false); `R` -> `R`; `Partial(sum|avg)` passes (sum is
    /// linear); `Partial(max|min)` is reduced first (implicit all_reduce). No
    /// communication forward or backward otherwise.
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<DTensor> {
        let op = "sum";
        let ds = self.reduce_dims(op, dims)?;
        let out_shape =
            global_shape(op, &[("input", self)], || Ok(meta(self)?.sum_dims(dims, keepdim)?))?;
        let (target, out) = unary_rule(self, |p| match p {
            Shard(d) if ds.contains(&(d as usize)) => (p, Partial(ReduceOp::Sum)),
            Shard(d) => {
                let d = d as usize;
                let shift = if keepdim { 0 } else { ds.iter().filter(|&&r| r < d).count() };
                (p, Shard((d - shift) as isize))
            }
            p if p.is_partial() && !is_linear_partial(p) => (Replicate, Replicate),
            p => (p, p),
        });
        let x = prepare(op, "input", self, &target)?;
        finish(x.local().sum_dims(dims, keepdim)?, self.mesh(), &out, &out_shape)
    }

    /// Sum over one dim; rules as [`DTensor::sum_dims`].
    pub fn sum(&self, dim: isize, keepdim: bool) -> Result<DTensor> {
        self.sum_dims(&[dim], keepdim)
    }

    /// Sum of all elements (a 0-dim `DTensor`); rules as [`DTensor::sum_dims`]: any
    /// sharded mesh dim makes it `Partial(sum)`.
    pub fn sum_all(&self) -> Result<DTensor> {
        let dims: Vec<isize> = (0..self.shape().len() as isize).collect();
        self.sum_dims(&dims, false)
    }

    /// Mean over `dims`: the sum (rules of [`DTensor::sum_dims`]) divided by the *global*
    /// number of elements reduced. Over a sharded dim the result is `Partial(sum)` whose
    /// terms are each rank's local sum over the global count; exact with uneven and
    /// empty shards (a `Partial(avg)` of local means would weigh uneven shards wrongly).
    pub fn mean_dims(&self, dims: &[isize], keepdim: bool) -> Result<DTensor> {
        let ds = self.reduce_dims("mean", dims)?;
        let n: usize = ds.iter().map(|&d| self.shape()[d]).product();
        self.sum_dims(dims, keepdim)?.div_scalar(n as f64)
    }

    /// Mean over one dim; rules as [`DTensor::mean_dims`].
    pub fn mean(&self, dim: isize, keepdim: bool) -> Result<DTensor> {
        self.mean_dims(&[dim], keepdim)
    }

    /// Mean of all elements; rules as [`DTensor::mean_dims`].
    /// As [`Tensor::mean_all`](tpar_tensor::Tensor::mean_all), an empty tensor's mean is 0.
    pub fn mean_all(&self) -> Result<DTensor> {
        let n: usize = self.shape().iter().product();
        self.sum_all()?.div_scalar(n.max(1) as f64)
    }
}
