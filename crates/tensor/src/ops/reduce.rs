//! Reductions: sum, mean, max over dims.

use tpar_kernels::reduce::{self as k, Reduction};

use super::{compute, compute_multi, cuda_ordinal, gpu_elem, require_float};
use crate::autograd::record;
use crate::shape::normalize_dim;
use crate::storage::Element;
use crate::tensor::typed;
use crate::{with_float_type, DType, Result, Shape, Tensor};

impl Tensor {
    fn reduce_one(&self, op: Reduction, d: usize, keepdim: bool) -> Result<Tensor> {
        let name = "reduce";
        require_float(name, self)?;
        let (outer, len, inner) = self.shape().split_at_dim(d);
        let mut dims = self.dims().to_vec();
        if keepdim {
            dims[d] = 1;
        } else {
            dims.remove(d);
        }
        compute(name, &[self], Shape::from(dims), self.dtype(), |st| {
            with_float_type!(st[0].dtype(), name, |T| {
                let mut o = crate::storage::zeros_vec::<T>(outer * inner);
                k::reduce(op, typed::<T>(name, st[0])?, outer, len, inner, &mut o)?;
                Ok(T::wrap(o))
            })
        })
    }

    fn reduce_dims_raw(
        &self,
        op: Reduction,
        dims: &[isize],
        keepdim: bool,
    ) -> Result<(Tensor, Vec<usize>)> {
        let mut ds = dims
            .iter()
            .map(|&d| normalize_dim("sum", d, self.rank()))
            .collect::<Result<Vec<_>>>()?;
        ds.sort_unstable();
        ds.dedup();
        let on_device = match cuda_ordinal("sum", &[self])? {
            Some(_) if !ds.is_empty() => {
                require_float("reduce", self)?;
                gpu_elem::reduce_dims(self, op, &ds)?
            }
            _ => None,
        };
        let mut t = match on_device {
            Some(t) => t,
            None => {
                let mut t = self.clone();
                for &d in ds.iter().rev() {
                    t = t.reduce_one(op, d, true)?;
                }
                t
            }
        };
        if !keepdim {
            let kept: Vec<usize> =
                (0..self.rank()).filter(|i| !ds.contains(i)).map(|i| self.dims()[i]).collect();
            t = t.reshape_raw(Shape::from(kept))?;
        }
        Ok((t, ds))
    }

    /// Sum over `dims` (negative dims count from the end).
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let (out, ds) =
            crate::autograd::no_grad(|| self.reduce_dims_raw(Reduction::Sum, dims, keepdim))?;
        let in_shape = self.shape().clone();
        Ok(record("sum", &[self], out, move |g| {
            let mut kd = in_shape.dims().to_vec();
            ds.iter().for_each(|&d| kd[d] = 1);
            Ok(vec![Some(g.reshape(Shape::from(kd))?.expand(in_shape.clone())?)])
        }))
    }

    /// Sum over one dim.
    pub fn sum(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.sum_dims(&[dim], keepdim)
    }

    /// Sum of all elements (a 0-dim tensor).
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.rank() as isize).collect();
        self.sum_dims(&dims, false)
    }

    /// Mean over `dims`.
    pub fn mean_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let mut n = 1usize;
        for &d in dims {
            n *= self.dims()[normalize_dim("mean", d, self.rank())?];
        }
        self.sum_dims(dims, keepdim)?.div_scalar(n as f64)
    }

    /// Mean over one dim.
    pub fn mean(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.mean_dims(&[dim], keepdim)
    }

    /// Mean of all elements.
    pub fn mean_all(&self) -> Result<Tensor> {
        let n = self.numel().max(1);
        self.sum_all()?.div_scalar(n as f64)
    }

    /// Max over one dim and the index of the (first) max; the gradient flows to that index.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let name = "max";
        require_float(name, self)?;
        let d = normalize_dim(name, dim, self.rank())?;
        let (outer, len, inner) = self.shape().split_at_dim(d);
        let mut od = self.dims().to_vec();
        if keepdim {
            od[d] = 1;
        } else {
            od.remove(d);
        }
        let oshape = Shape::from(od);
        let on_device = match cuda_ordinal(name, &[self])? {
            Some(_) => gpu_elem::max_dim(self, outer, len, inner, &oshape)?,
            None => None,
        };
        let outs = if let Some((v, i)) = on_device {
            vec![v, i]
        } else {
            compute_multi(
                name,
                &[self],
                &[(oshape.clone(), self.dtype()), (oshape.clone(), DType::I64)],
                |st| {
                    with_float_type!(st[0].dtype(), name, |T| {
                        let mut o = crate::storage::zeros_vec::<T>(outer * inner);
                        let mut idx = vec![0i64; outer * inner];
                        k::max_with_index(
                            typed::<T>(name, st[0])?,
                            outer,
                            len,
                            inner,
                            &mut o,
                            &mut idx,
                        )?;
                        Ok(vec![T::wrap(o), <i64 as Element>::wrap(idx)])
                    })
                },
            )?
        };
        let (vals, idx) = (outs[0].clone(), outs[1].clone());
        let in_shape = self.shape().clone();
        let idx2 = idx.clone();
        let vals = record(name, &[self], vals, move |g| {
            if cuda_ordinal(name, &[g, &idx2])?.is_some() {
                if let Some(gx) = gpu_elem::max_backward(g, &idx2, outer, len, inner, &in_shape)? {
                    return Ok(vec![Some(gx)]);
                }
            }
            let gx = compute("max_backward", &[g, &idx2], in_shape.clone(), g.dtype(), |st| {
                with_float_type!(st[0].dtype(), "max_backward", |T| {
                    let gs = typed::<T>("max_backward", st[0])?;
                    let is = typed::<i64>("max_backward", st[1])?;
                    let mut o = crate::storage::zeros_vec::<T>(outer * len * inner);
                    for oi in 0..outer {
                        for i in 0..inner {
                            let l = is[oi * inner + i] as usize;
                            o[(oi * len + l) * inner + i] = gs[oi * inner + i];
                        }
                    }
                    Ok(T::wrap(o))
                })
            })?;
            Ok(vec![Some(gx)])
        });
        Ok((vals, idx))
    }

    /// Max over one dim (values only).
    pub fn max(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(self.max_dim(dim, keepdim)?.0)
    }

    /// Index of the max over one dim (i64).
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(crate::autograd::no_grad(|| self.max_dim(dim, keepdim))?.1)
    }
}
