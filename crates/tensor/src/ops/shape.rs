//! Layout ops. Tensors are contiguous, so reshape shares storage and every
//! other layout change (transpose, permute, expand, narrow, cat) writes a new buffer.

use tpar_kernels::elementwise::strided_copy_new;

use super::{common_dtype, compute, cuda_ordinal, gpu_elem, invalid};
use crate::autograd::{needs_input_grad, record};
use crate::shape::normalize_dim;
use crate::storage::Element;
use crate::tensor::typed;
use crate::{with_any_type, Device, Result, Shape, Tensor, TensorError};

impl Tensor {
    pub(crate) fn reshape_raw(&self, shape: Shape) -> Result<Tensor> {
        if shape.numel() != self.numel() {
            return Err(TensorError::ShapeMismatch {
                op: "reshape",
                lhs: self.shape().clone(),
                rhs: shape,
                why: "element counts differ".into(),
            });
        }
        Ok(self.share(shape, None))
    }

    /// Same data, another shape with the same number of elements (shares storage).
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        let out = self.reshape_raw(shape)?;
        let in_shape = self.shape().clone();
        Ok(record("reshape", &[self], out, move |g| Ok(vec![Some(g.reshape(in_shape.clone())?)])))
    }

    /// Reshape where one dim may be `-1` (inferred), as PyTorch's `view`.
    pub fn view(&self, dims: &[isize]) -> Result<Tensor> {
        let known: usize = dims.iter().filter(|&&d| d >= 0).map(|&d| d as usize).product();
        let infer = dims.iter().filter(|&&d| d < 0).count();
        if infer > 1 || dims.iter().any(|&d| d < -1) {
            return Err(invalid("view", format!("at most one -1 allowed in {dims:?}")));
        }
        let shape: Vec<usize> = if infer == 1 {
            if known == 0 || !self.numel().is_multiple_of(known) {
                return Err(invalid("view", format!("cannot view {} as {dims:?}", self.shape())));
            }
            dims.iter().map(|&d| if d < 0 { self.numel() / known } else { d as usize }).collect()
        } else {
            dims.iter().map(|&d| d as usize).collect()
        };
        self.reshape(shape)
    }

    /// Flattens dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape([1]);
        }
        let s = normalize_dim("flatten", start, self.rank())?;
        let e = normalize_dim("flatten", end, self.rank())?;
        if e < s {
            return Err(invalid("flatten", format!("end dim {end} before start dim {start}")));
        }
        let mut d: Vec<usize> = self.dims()[..s].to_vec();
        d.push(self.dims()[s..=e].iter().product());
        d.extend_from_slice(&self.dims()[e + 1..]);
        self.reshape(d)
    }

    /// Inserts a size-1 dim at `dim` (`-1` appends).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("unsqueeze", dim, self.rank() + 1)?;
        let mut s = self.dims().to_vec();
        s.insert(d, 1);
        self.reshape(s)
    }

    /// Removes dim `dim`, which must have size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("squeeze", dim, self.rank())?;
        if self.dims()[d] != 1 {
            return Err(invalid("squeeze", format!("dim {dim} of {} is not 1", self.shape())));
        }
        let mut s = self.dims().to_vec();
        s.remove(d);
        self.reshape(s)
    }

    /// Returns the tensor itself: tensors are always contiguous.
    pub fn contiguous(&self) -> Result<Tensor> {
        Ok(self.clone())
    }

    fn strided_raw(
        &self,
        op: &'static str,
        base: usize,
        strides: Vec<usize>,
        shape: Shape,
    ) -> Result<Tensor> {
        if cuda_ordinal(op, &[self])?.is_some() {
            if let Some(t) = gpu_elem::strided(self, base, &strides, &shape)? {
                return Ok(t);
            }
        }
        let dims = shape.dims().to_vec();
        compute(op, &[self], shape, self.dtype(), |st| {
            with_any_type!(st[0].dtype(), |T| {
                Ok(T::wrap(strided_copy_new(typed::<T>(op, st[0])?, base, &strides, &dims)?))
            })
        })
    }

    /// Reorders dims: output dim `i` is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let r = self.rank();
        let mut seen = vec![false; r];
        if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true))
        {
            return Err(invalid("permute", format!("{perm:?} is not a permutation of {r} dims")));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        let st = self.shape().strides();
        let strides: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
        let shape = Shape::from(perm.iter().map(|&p| self.dims()[p]).collect::<Vec<_>>());
        let out = self.strided_raw("permute", 0, strides, shape)?;
        let mut inv = vec![0; r];
        perm.iter().enumerate().for_each(|(i, &p)| inv[p] = i);
        Ok(record("permute", &[self], out, move |g| Ok(vec![Some(g.permute(&inv)?)])))
    }

    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let a = normalize_dim("transpose", d0, self.rank())?;
        let b = normalize_dim("transpose", d1, self.rank())?;
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Broadcasts to `shape` (numpy rules), copying; the gradient is summed back.
    pub fn expand(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        let b = crate::shape::broadcast_shapes("expand", self.shape(), &shape)?;
        if b != shape {
            return Err(TensorError::ShapeMismatch {
                op: "expand",
                lhs: self.shape().clone(),
                rhs: shape,
                why: "cannot expand to a smaller shape".into(),
            });
        }
        let strides = crate::shape::broadcast_strides(self.shape(), &shape);
        let out = self.strided_raw("expand", 0, strides, shape)?;
        let src = self.shape().clone();
        Ok(record("expand", &[self], out, move |g| Ok(vec![Some(g.sum_to(&src)?)])))
    }

    /// Elements `start..start+len` along `dim` (a copy).
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = normalize_dim("narrow", dim, self.rank())?;
        let size = self.dims()[d];
        if start.checked_add(len).is_none_or(|e| e > size) {
            return Err(invalid(
                "narrow",
                format!(
                    "range {start}..{} out of bounds for dim {d} of size {size} in {}",
                    start + len,
                    self.shape()
                ),
            ));
        }
        if start == 0 && len == size {
            return Ok(self.clone());
        }
        let st = self.shape().strides();
        let mut od = self.dims().to_vec();
        od[d] = len;
        let out = self.strided_raw("narrow", start * st[d], st, Shape::from(od))?;
        Ok(record("narrow", &[self], out, zero_pad_adjoint(self.shape(), d, start, len)))
    }

    /// Splits into pieces of the given sizes along `dim` (they must sum to the dim's size).
    pub fn split_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = normalize_dim("split", dim, self.rank())?;
        if sizes.iter().sum::<usize>() != self.dims()[d] {
            return Err(invalid(
                "split",
                format!("sizes {sizes:?} do not sum to dim {d} of {}", self.shape()),
            ));
        }
        let (outer, _, inner) = self.shape().split_at_dim(d);
        if sizes.len() > 1 {
            // On a GPU every piece is copied in one launch.
            if let Some(pieces) = gpu_elem::split(self, sizes, outer, inner, d)? {
                let mut start = 0;
                return Ok(pieces
                    .into_iter()
                    .zip(sizes)
                    .map(|(p, &n)| {
                        let adjoint = zero_pad_adjoint(self.shape(), d, start, n);
                        start += n;
                        record("split", &[self], p, adjoint)
                    })
                    .collect());
            }
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&n| {
                let t = self.narrow(d as isize, start, n);
                start += n;
                t
            })
            .collect()
    }

    /// Splits into pieces of `size` along `dim` (the last may be smaller), as `torch.split`.
    pub fn split(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = normalize_dim("split", dim, self.rank())?;
        if size == 0 {
            return Err(invalid("split", "split size must be positive"));
        }
        let n = self.dims()[d];
        let mut sizes = vec![size; n / size];
        if !n.is_multiple_of(size) {
            sizes.push(n % size);
        }
        self.split_sizes(&sizes, dim)
    }

    /// `torch.chunk`: pieces of `ceil(n / chunks)` along `dim`; there may be fewer than `chunks`.
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = normalize_dim("chunk", dim, self.rank())?;
        if chunks == 0 {
            return Err(invalid("chunk", "number of chunks must be positive"));
        }
        let n = self.dims()[d];
        if n == 0 {
            return Ok(vec![self.clone()]);
        }
        self.split(n.div_ceil(chunks), dim)
    }

    /// Concatenates along `dim`; all other dims must agree.
    pub fn cat(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| invalid("cat", "no tensors given"))?;
        let d = normalize_dim("cat", dim, first.rank())?;
        let refs: Vec<&Tensor> = tensors.iter().collect();
        let dtype = common_dtype("cat", &refs)?;
        for t in tensors {
            let same = t.rank() == first.rank()
                && (0..first.rank()).all(|i| i == d || t.dims()[i] == first.dims()[i]);
            if !same {
                return Err(TensorError::ShapeMismatch {
                    op: "cat",
                    lhs: first.shape().clone(),
                    rhs: t.shape().clone(),
                    why: format!("all dims but {d} must agree"),
                });
            }
        }
        if tensors.len() == 1 {
            return Ok(first.clone());
        }
        let sizes: Vec<usize> = tensors.iter().map(|t| t.dims()[d]).collect();
        let mut od = first.dims().to_vec();
        od[d] = sizes.iter().sum();
        let (outer, total, inner) = Shape::from(od.clone()).split_at_dim(d);
        let on_device = match cuda_ordinal("cat", &refs)? {
            Some(_) => gpu_elem::cat(tensors, &sizes, outer, inner, &Shape::from(od.clone()))?,
            None => None,
        };
        let out = match on_device {
            Some(t) => t,
            None => compute("cat", &refs, Shape::from(od), dtype, |st| {
                with_any_type!(dtype, |T| {
                    // Written in order, each element once: no zero fill first.
                    let srcs =
                        st.iter().map(|s| typed::<T>("cat", s)).collect::<Result<Vec<_>>>()?;
                    let mut o = crate::storage::empty_vec::<T>(outer * total * inner);
                    for r in 0..outer {
                        for (src, &len) in srcs.iter().zip(&sizes) {
                            let blk = len * inner;
                            o.extend_from_slice(&src[r * blk..(r + 1) * blk]);
                        }
                    }
                    Ok(T::wrap(o))
                })
            })?,
        };
        Ok(record("cat", &refs, out, move |g| {
            // Each piece is a copy: cut only those asked for.
            let mut start = 0;
            let mut gs = Vec::with_capacity(sizes.len());
            for (i, &n) in sizes.iter().enumerate() {
                gs.push(if needs_input_grad(i) {
                    Some(g.narrow(d as isize, start, n)?)
                } else {
                    None
                });
                start += n;
            }
            Ok(gs)
        }))
    }

    /// Stacks equal-shaped tensors along a new dim.
    pub fn stack(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| invalid("stack", "no tensors given"))?;
        let d = normalize_dim("stack", dim, first.rank() + 1)? as isize;
        let parts = tensors.iter().map(|t| t.unsqueeze(d)).collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, d)
    }

    /// Deep copy of the data into new storage (a new leaf unless recorded).
    pub fn deep_clone(&self) -> Result<Tensor> {
        match self.device() {
            Device::Meta => Tensor::empty(self.shape().clone(), self.dtype(), Device::Meta),
            Device::Cuda(_) => {
                let out = gpu_elem::deep_clone(self)?;
                Ok(record("clone", &[self], out, |g| Ok(vec![Some(g.clone())])))
            }
            Device::Cpu => {
                let out = compute("clone", &[self], self.shape().clone(), self.dtype(), |st| {
                    Ok(st[0].clone())
                })?;
                Ok(record("clone", &[self], out, |g| Ok(vec![Some(g.clone())])))
            }
        }
    }

    /// Rows of `self` (any dtype) picked by an i64 index tensor along dim 0.
    pub fn index_select0(&self, index: &Tensor) -> Result<Tensor> {
        if self.rank() == 0 {
            return Err(invalid("index_select", "cannot select rows of a 0-dim tensor"));
        }
        if cuda_ordinal("index_select", &[self])?.is_some() {
            if let Some(t) = gpu_elem::index_select0(self, index)? {
                return Ok(t);
            }
        }
        let ids = index.to_vec::<i64>()?;
        let rows = self.dims().first().copied().unwrap_or(0);
        let inner: usize = self.dims().iter().skip(1).product();
        if let Some((p, &bad)) = ids.iter().enumerate().find(|(_, &i)| i < 0 || i as usize >= rows)
        {
            return Err(invalid(
                "index_select",
                format!("index {bad} at position {p} out of range for {rows} rows"),
            ));
        }
        let mut od = vec![ids.len()];
        od.extend_from_slice(&self.dims()[1..]);
        compute("index_select", &[self], Shape::from(od), self.dtype(), |st| {
            with_any_type!(st[0].dtype(), |T| {
                let src = typed::<T>("index_select", st[0])?;
                let mut o = Vec::with_capacity(ids.len() * inner);
                for &i in &ids {
                    let i = i as usize;
                    o.extend_from_slice(&src[i * inner..(i + 1) * inner]);
                }
                Ok(<T as Element>::wrap(o))
            })
        })
    }
}

/// The adjoint of taking `len` entries from `start` along dim `d` of a tensor of
/// `input` shape: the gradient zero-padded back to `input`.
fn zero_pad_adjoint(
    input: &Shape,
    d: usize,
    start: usize,
    len: usize,
) -> impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static {
    let input = input.clone();
    let size = input.dims()[d];
    move |g| {
        let zeros = |n: usize| -> Result<Option<Tensor>> {
            if n == 0 {
                return Ok(None);
            }
            let mut s = input.dims().to_vec();
            s[d] = n;
            Ok(Some(Tensor::zeros(s, g.dtype(), g.device())?))
        };
        let parts: Vec<Tensor> = [zeros(start)?, Some(g.clone()), zeros(size - start - len)?]
            .into_iter()
            .flatten()
            .collect();
        Ok(vec![Some(Tensor::cat(&parts, d as isize)?)])
    }
}
