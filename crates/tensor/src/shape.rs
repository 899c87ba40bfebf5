//! Shapes, dim normalisation and broadcasting.

use std::fmt;

use smallvec::SmallVec;

use crate::{Result, TensorError};

/// The dims of a tensor. Tensors are contiguous row-major, so strides follow from the shape.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub SmallVec<[usize; 6]>);

impl Shape {
    /// A shape from its dims.
    pub fn new(dims: &[usize]) -> Self {
        Shape(SmallVec::from_slice(dims))
    }
    /// The dims.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Contiguous row-major strides, in elements.
    pub fn strides(&self) -> Vec<usize> {
        tpar_kernels::elementwise::contiguous_strides(&self.0)
    }
    /// `(outer, len, inner)` around dim `d`.
    pub fn split_at_dim(&self, d: usize) -> (usize, usize, usize) {
        let outer = self.0[..d].iter().product();
        let inner = self.0[d + 1..].iter().product();
        (outer, self.0[d], inner)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0.as_slice())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0.as_slice())
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape::new(d)
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(SmallVec::from_vec(d))
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape::new(&d)
    }
}
impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(d: &[usize; N]) -> Self {
        Shape::new(d)
    }
}

/// Normalises a possibly negative dim (`-1` is the last) against `rank`.
pub fn normalize_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(TensorError::DimOutOfRange { op, dim, rank });
    }
    Ok(d as usize)
}

/// The broadcast of two shapes (numpy rules), or an error naming both.
pub fn broadcast_shapes(op: &'static str, a: &Shape, b: &Shape) -> Result<Shape> {
    let r = a.rank().max(b.rank());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.rank() >= r { a.0[i + a.rank() - r] } else { 1 };
        let db = if i + b.rank() >= r { b.0[i + b.rank() - r] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: a.clone(),
                rhs: b.clone(),
                why: format!("dim {i} of the broadcast: {da} vs {db}"),
            });
        };
    }
    Ok(Shape::from(out))
}

/// Strides reading a tensor of shape `src` as if expanded to `out` (0 on broadcast dims).
pub fn broadcast_strides(src: &Shape, out: &Shape) -> Vec<usize> {
    let s = src.strides();
    let off = out.rank() - src.rank();
    (0..out.rank()).map(|i| if i < off || src.0[i - off] == 1 { 0 } else { s[i - off] }).collect()
}
