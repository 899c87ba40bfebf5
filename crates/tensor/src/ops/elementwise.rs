//! Elementwise ops: broadcasting binary ops, scalar ops, unary maps, casts.

use tpar_kernels::elementwise::{self as k, BinaryOp, UnaryOp};

use super::{compute, compute_multi, cuda_ordinal, gpu_elem, require_float};
use crate::autograd::{needs_input_grad, record};
use crate::shape::{broadcast_shapes, broadcast_strides};
use crate::storage::Element;
use crate::tensor::typed;
use crate::{with_any_type, with_float_type, DType, Result, Shape, Tensor, TensorError};

fn binary_name(op: BinaryOp) -> &'static str {
    match op {
        BinaryOp::Add => "add",
        BinaryOp::Sub => "sub",
        BinaryOp::Mul => "mul",
        BinaryOp::Div => "div",
        BinaryOp::Max => "maximum",
        BinaryOp::Min => "minimum",
        BinaryOp::Pow => "pow",
    }
}

fn unary_name(op: UnaryOp) -> &'static str {
    match op {
        UnaryOp::Neg => "neg",
        UnaryOp::Exp => "exp",
        UnaryOp::Log => "log",
        UnaryOp::Sqrt => "sqrt",
        UnaryOp::Rsqrt => "rsqrt",
        UnaryOp::Silu => "silu",
        UnaryOp::Sigmoid => "sigmoid",
        UnaryOp::Square => "square",
        UnaryOp::Abs => "abs",
        UnaryOp::Relu => "relu",
        UnaryOp::Tanh => "tanh",
        UnaryOp::Recip => "reciprocal",
    }
}

impl Tensor {
    fn binary_raw(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        let name = binary_name(op);
        if self.dtype() != rhs.dtype() {
            return Err(TensorError::DTypeMismatch {
                op: name,
                expected: self.dtype().name().into(),
                got: rhs.dtype(),
            });
        }
        require_float(name, self)?;
        let out = broadcast_shapes(name, self.shape(), rhs.shape())?;
        let sa = broadcast_strides(self.shape(), &out);
        let sb = broadcast_strides(rhs.shape(), &out);
        if cuda_ordinal(name, &[self, rhs])?.is_some() {
            if let Some(t) = gpu_elem::binary(self, &sa, rhs, &sb, op, &out)? {
                return Ok(t);
            }
        }
        let dims = out.dims().to_vec();
        compute(name, &[self, rhs], out, self.dtype(), |s| {
            with_float_type!(s[0].dtype(), name, |T| {
                let (a, b) = (typed::<T>(name, s[0])?, typed::<T>(name, s[1])?);
                Ok(T::wrap(k::binary_new(op, a, &sa, b, &sb, &dims)?))
            })
        })
    }

    fn binary_op(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        let out = self.binary_raw(rhs, op)?;
        // Save only what this op's backward reads (a sum needs no operand), so the graph
        // keeps no tensor alive that it does not need.
        let (keep_a, keep_b, keep_y) = match op {
            BinaryOp::Add | BinaryOp::Sub | BinaryOp::Max | BinaryOp::Min => (false, false, false),
            BinaryOp::Mul => (true, true, false),
            BinaryOp::Div => (false, true, true),
            BinaryOp::Pow => (true, true, true),
        };
        let saved = |keep: bool, t: &Tensor| keep.then(|| t.clone());
        let (a, b, y) = (saved(keep_a, self), saved(keep_b, rhs), saved(keep_y, &out.detach()));
        let (rg_a, rg_b) = (self.requires_grad(), rhs.requires_grad());
        let (sa, sb) = (self.shape().clone(), rhs.shape().clone());
        Ok(record(binary_name(op), &[self, rhs], out, move |g| {
            // Each side costs its own pass (and a reduction when broadcast):
            // compute only those asked for.
            let need_a = rg_a && needs_input_grad(0);
            let need_b = rg_b && needs_input_grad(1);
            let saved_err =
                || TensorError::Autograd(format!("{}: an operand was not saved", binary_name(op)));
            let a = || a.as_ref().ok_or_else(saved_err);
            let b = || b.as_ref().ok_or_else(saved_err);
            let y = || y.as_ref().ok_or_else(saved_err);
            let when = |need: bool, f: &dyn Fn() -> Result<Tensor>| need.then(f).transpose();
            let (ga, gb) = match op {
                BinaryOp::Add => {
                    (when(need_a, &|| Ok(g.clone()))?, when(need_b, &|| Ok(g.clone()))?)
                }
                BinaryOp::Sub => (when(need_a, &|| Ok(g.clone()))?, when(need_b, &|| g.neg())?),
                BinaryOp::Mul => (when(need_a, &|| g.mul(b()?))?, when(need_b, &|| g.mul(a()?))?),
                BinaryOp::Div => (
                    when(need_a, &|| g.div(b()?))?,
                    when(need_b, &|| g.mul(y()?)?.div(b()?)?.neg())?,
                ),
                BinaryOp::Pow => (
                    // d/da a^b = b a^(b-1); d/db a^b = a^b ln a
                    when(need_a, &|| {
                        g.mul(b()?)?.mul(&a()?.binary_raw(&b()?.add_scalar(-1.0)?, BinaryOp::Pow)?)
                    })?,
                    when(need_b, &|| g.mul(y()?)?.mul(&a()?.log()?))?,
                ),
                BinaryOp::Max | BinaryOp::Min => {
                    return Err(TensorError::Autograd(format!(
                        "{} has no backward",
                        binary_name(op)
                    )))
                }
            };
            Ok(vec![ga.map(|t| t.sum_to(&sa)).transpose()?, gb.map(|t| t.sum_to(&sb)).transpose()?])
        }))
    }

    /// `self + rhs` with broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Add)
    }
    /// `self - rhs` with broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Sub)
    }
    /// `self * rhs` with broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Mul)
    }
    /// `self / rhs` with broadcasting.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Div)
    }
    /// `self ^ rhs` with broadcasting.
    pub fn pow(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Pow)
    }
    /// Elementwise maximum (not differentiable).
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_raw(rhs, BinaryOp::Max)
    }
    /// Elementwise minimum (not differentiable).
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_raw(rhs, BinaryOp::Min)
    }

    fn scalar_raw(&self, op: BinaryOp, s: f64, scalar_first: bool) -> Result<Tensor> {
        let name = binary_name(op);
        require_float(name, self)?;
        if cuda_ordinal(name, &[self])?.is_some() {
            if let Some(t) = gpu_elem::scalar(self, op, s, scalar_first)? {
                return Ok(t);
            }
        }
        compute(name, &[self], self.shape().clone(), self.dtype(), |st| {
            with_float_type!(st[0].dtype(), name, |T| {
                let x = typed::<T>(name, st[0])?;
                Ok(T::wrap(k::scalar_new(op, x, s, scalar_first)?))
            })
        })
    }

    /// `self + s`.
    pub fn add_scalar(&self, s: f64) -> Result<Tensor> {
        let out = self.scalar_raw(BinaryOp::Add, s, false)?;
        Ok(record("add_scalar", &[self], out, |g| Ok(vec![Some(g.clone())])))
    }
    /// `self * s`.
    pub fn mul_scalar(&self, s: f64) -> Result<Tensor> {
        let out = self.scalar_raw(BinaryOp::Mul, s, false)?;
        Ok(record("mul_scalar", &[self], out, move |g| Ok(vec![Some(g.mul_scalar(s)?)])))
    }
    /// `self / s`.
    pub fn div_scalar(&self, s: f64) -> Result<Tensor> {
        self.mul_scalar(1.0 / s)
    }
    /// `s - self`.
    pub fn rsub_scalar(&self, s: f64) -> Result<Tensor> {
        let out = self.scalar_raw(BinaryOp::Sub, s, true)?;
        Ok(record("rsub_scalar", &[self], out, |g| Ok(vec![Some(g.neg()?)])))
    }
    /// `self ^ p`.
    pub fn pow_scalar(&self, p: f64) -> Result<Tensor> {
        let out = self.scalar_raw(BinaryOp::Pow, p, false)?;
        let x = self.clone();
        Ok(record("pow_scalar", &[self], out, move |g| {
            Ok(vec![Some(g.mul(&x.scalar_raw(BinaryOp::Pow, p - 1.0, false)?.mul_scalar(p)?)?)])
        }))
    }
    /// Clamps from below (not differentiable at the clamp; gradient passes where unclamped).
    pub fn clamp_min(&self, lo: f64) -> Result<Tensor> {
        self.scalar_raw(BinaryOp::Max, lo, false)
    }

    fn unary_op(&self, op: UnaryOp) -> Result<Tensor> {
        let name = unary_name(op);
        require_float(name, self)?;
        let on_device = match cuda_ordinal(name, &[self])? {
            Some(_) => gpu_elem::unary(self, op)?,
            None => None,
        };
        let out = match on_device {
            Some(t) => t,
            None => compute(name, &[self], self.shape().clone(), self.dtype(), |st| {
                with_float_type!(st[0].dtype(), name, |T| {
                    Ok(T::wrap(k::unary_new(op, typed::<T>(name, st[0])?)?))
                })
            })?,
        };
        let (x, y) = (self.clone(), out.detach());
        Ok(record(name, &[self], out, move |g| {
            if cuda_ordinal(name, &[&x, &y, g])?.is_some() {
                if let Some(gx) = gpu_elem::unary_backward(&x, &y, g, op)? {
                    return Ok(vec![Some(gx)]);
                }
            }
            let gx = compute(name, &[&x, &y, g], x.shape().clone(), x.dtype(), |st| {
                with_float_type!(st[0].dtype(), name, |T| {
                    let (x, y, g) = (
                        typed::<T>(name, st[0])?,
                        typed::<T>(name, st[1])?,
                        typed::<T>(name, st[2])?,
                    );
                    Ok(T::wrap(k::unary_backward_new(op, x, y, g)?))
                })
            })?;
            Ok(vec![Some(gx)])
        }))
    }

    /// `-self`.
    pub fn neg(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Neg)
    }
    /// `e^self`.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Exp)
    }
    /// Natural log.
    pub fn log(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Log)
    }
    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sqrt)
    }
    /// `1 / sqrt(self)`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Rsqrt)
    }
    /// SiLU (`x * sigmoid(x)`).
    pub fn silu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Silu)
    }
    /// The SwiGLU product `silu(self) * up` as one op (PyTorch's
    /// `F.silu(gate) * up`), for a gated MLP: one kernel forward and one backward
    /// instead of two and three, with no `silu(self)` kept for the backward. `up` has this
    /// tensor's shape and dtype (no broadcasting). `silu(self)` is not rounded to the
    /// dtype before the product (for f32 the bits equal `self.silu()?.mul(up)`).
    pub fn silu_mul(&self, up: &Tensor) -> Result<Tensor> {
        const OP: &str = "silu_mul";
        require_float(OP, self)?;
        if up.shape() != self.shape() {
            return Err(TensorError::ShapeMismatch {
                op: OP,
                lhs: self.shape().clone(),
                rhs: up.shape().clone(),
                why: "the gate and up operands must have one shape".into(),
            });
        }
        if up.dtype() != self.dtype() {
            return Err(TensorError::DTypeMismatch {
                op: OP,
                expected: self.dtype().to_string(),
                got: up.dtype(),
            });
        }
        let on_device = match cuda_ordinal(OP, &[self, up])? {
            Some(_) => gpu_elem::silu_mul(self, up)?,
            None => None,
        };
        let out = match on_device {
            Some(t) => t,
            None => compute(OP, &[self, up], self.shape().clone(), self.dtype(), |st| {
                with_float_type!(st[0].dtype(), OP, |T| {
                    Ok(T::wrap(k::silu_mul_new(typed::<T>(OP, st[0])?, typed::<T>(OP, st[1])?)?))
                })
            })?,
        };
        let (a, b) = (self.clone(), up.clone());
        Ok(record(OP, &[self, up], out, move |g| {
            if cuda_ordinal(OP, &[&a, &b, g])?.is_some() {
                if let Some((ga, gb)) = gpu_elem::silu_mul_backward(&a, &b, g)? {
                    return Ok(vec![Some(ga), Some(gb)]);
                }
            }
            let outs = [(a.shape().clone(), a.dtype()), (a.shape().clone(), a.dtype())];
            let mut grads = compute_multi(OP, &[&a, &b, g], &outs, |st| {
                with_float_type!(st[0].dtype(), OP, |T| {
                    let (x, u, dy) =
                        (typed::<T>(OP, st[0])?, typed::<T>(OP, st[1])?, typed::<T>(OP, st[2])?);
                    let (da, db) = k::silu_mul_backward_new(x, u, dy)?;
                    Ok(vec![T::wrap(da), T::wrap(db)])
                })
            })?;
            let gb = grads.pop();
            let ga = grads.pop();
            Ok(vec![ga, gb])
        }))
    }

    /// SwiGLU of a packed gate/up tensor: with `self` `[..., 2 i]` holding gate in the
    /// first `i` columns of its last dim and up in the last `i` (a fused gate/up
    /// projection's output, `x [W_gate; W_up]^T`), `silu(gate) * up`, `[..., i]`. It is,
    /// bit for bit and with the same gradient, the last dim split in halves and
    /// [`Tensor::silu_mul`]. On a CUDA device it reads the halves in place, keeps `self`,
    /// and its backward writes both halves' gradients into one `[..., 2 i]` tensor (no
    /// split copies, no concatenation); elsewhere it runs the split. Differentiable in
    /// `self`.
    pub fn swiglu(&self) -> Result<Tensor> {
        const OP: &str = "swiglu";
        require_float(OP, self)?;
        let width = self.dims().last().copied().unwrap_or(0);
        if self.rank() == 0 || !width.is_multiple_of(2) {
            return Err(super::invalid(
                OP,
                format!(
                    "the last dim must hold gate and up halves of one width, got {}",
                    self.shape()
                ),
            ));
        }
        let half = width / 2;
        let on_device = match cuda_ordinal(OP, &[self])? {
            Some(_) if self.numel() > 0 => gpu_elem::swiglu_packed(self)?,
            _ => None,
        };
        let Some(out) = on_device else {
            let parts = self.split_sizes(&[half, half], -1)?;
            return parts[0].silu_mul(&parts[1]);
        };
        let x = self.detach();
        Ok(record(OP, &[self], out, move |g| {
            Ok(vec![Some(gpu_elem::swiglu_packed_backward(&x, g)?)])
        }))
    }

    /// Logistic sigmoid.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sigmoid)
    }
    /// `self * self`.
    pub fn square(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Square)
    }
    /// Absolute value.
    pub fn abs(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Abs)
    }
    /// `max(self, 0)`.
    pub fn relu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Relu)
    }
    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Tanh)
    }
    /// `1 / self`.
    pub fn recip(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Recip)
    }

    /// Converts to another dtype (differentiable between float dtypes).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let n = self.numel();
        let on_device = match cuda_ordinal("to_dtype", &[self])? {
            Some(_) => gpu_elem::cast(self, dtype)?,
            None => None,
        };
        let out = match on_device {
            Some(t) => t,
            None => compute("to_dtype", &[self], self.shape().clone(), dtype, |st| {
                with_any_type!(st[0].dtype(), |S| {
                    let src = typed::<S>("to_dtype", st[0])?;
                    Ok(with_any_type!(dtype, |D| {
                        D::wrap(src.iter().map(|&v| <D as Element>::from_f64(v.to_f64())).collect())
                    }))
                })
            })?,
        };
        debug_assert_eq!(out.numel(), n);
        let src_dtype = self.dtype();
        if !dtype.is_float() || !src_dtype.is_float() {
            return Ok(out);
        }
        Ok(record("to_dtype", &[self], out, move |g| Ok(vec![Some(g.to_dtype(src_dtype)?)])))
    }

    /// Sums a broadcast gradient back down to `shape` (the adjoint of broadcasting).
    pub fn sum_to(&self, shape: &Shape) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let r = self.rank();
        if shape.rank() > r {
            return Err(TensorError::ShapeMismatch {
                op: "sum_to",
                lhs: self.shape().clone(),
                rhs: shape.clone(),
                why: "target has more dims".into(),
            });
        }
        let off = r - shape.rank();
        let dims: Vec<isize> = (0..r)
            .filter(|&i| i < off || (shape.dims()[i - off] == 1 && self.dims()[i] != 1))
            .map(|i| i as isize)
            .collect();
        let s = if dims.is_empty() { self.clone() } else { self.sum_dims(&dims, true)? };
        s.reshape(shape.clone())
    }
}
