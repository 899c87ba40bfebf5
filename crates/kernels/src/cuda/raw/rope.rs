//! Launch wrappers for `cuda/rope.cu`: rotary position embedding in the
//! rotate-half form, forward and backward (its exact transpose), out of
//! place or in place, as the CPU op [`crate::rope`].
//!
//! The layout is the CPU op's [`RopeShape`]: element `(o, t, i, j)` of the
//! rotated tensor is at `((o*seq + t)*inner + i)*head_dim + j`, and `cos` /
//! `sin` are `[seq, head_dim]` tables of the same dtype.

use bytemuck::{Pod, Zeroable};

use super::layout::grid_for;
use super::{bad, check_aligned, check_ptrs, numel};
use crate::cuda::{launch, CudaDType, DevPtr, Launcher};
pub use crate::rope::RopeShape;
use crate::Result;

/// Threads per block.
const THREADS: u32 = 256;

/// Arguments of `tpar_rope_<dtype>`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct RopeArgs {
    /// Input (`x` forward, `dy` backward).
    pub x: DevPtr,
    /// `[seq, head_dim]` cosines.
    pub cos: DevPtr,
    /// `[seq, head_dim]` sines.
    pub sin: DevPtr,
    /// Output (may be `x`).
    pub y: DevPtr,
    /// Product of the dims before the sequence dim.
    pub outer: i64,
    /// Sequence length.
    pub seq: i64,
    /// Product of the dims between the sequence dim and the head dim.
    pub inner: i64,
    /// Head dim (even).
    pub head_dim: i64,
    /// 1: apply the transpose (the backward pass).
    pub transpose: i32,
    /// Padding (0).
    pub pad: i32,
}

/// The rotation (or its transpose) of `x` into `y` with the tables `cos`, `sin`.
///
/// # Safety
/// As [`rope_forward`].
unsafe fn apply(
    op: &'static str,
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    x: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    y: DevPtr,
    transpose: bool,
) -> Result<()> {
    if !s.head_dim.is_multiple_of(2) {
        return Err(bad(op, format!("{s:?}: head_dim must be even")));
    }
    let es = dtype.size();
    let n = numel(op, &[s.outer, s.seq, s.inner, s.head_dim, es])? / es;
    numel(op, &[s.seq, s.head_dim, es])?;
    if n == 0 {
        return Ok(());
    }
    let ptrs = [("x", x), ("cos", cos), ("sin", sin), ("y", y)];
    check_ptrs(op, &ptrs)?;
    check_aligned(op, es, &ptrs)?;
    let half = s.head_dim / 2;
    let vec = half.is_multiple_of(8) && [x, cos, sin, y].iter().all(|p| p % 16 == 0);
    let pairs = n / 2;
    let items = if vec { pairs / 8 } else { pairs };
    let args = RopeArgs {
        x,
        cos,
        sin,
        y,
        outer: s.outer as i64,
        seq: s.seq as i64,
        inner: s.inner as i64,
        head_dim: s.head_dim as i64,
        transpose: transpose as i32,
        pad: 0,
    };
    let name = format!("tpar_rope_{}", dtype.suffix());
    // SAFETY: the caller guarantees the addresses; sizes are checked above.
    unsafe { launch(l, &name, grid_for(items, THREADS), &args) }
}

/// `y = x * cos + rotate_half(x) * sin` (`y` may be `x`: in place).
///
/// # Safety
/// `x` and `y` must be device addresses valid for the tensor of shape `s`,
/// `cos` and `sin` for `seq * head_dim` elements, all of `dtype`; `x` and `y`
/// are either equal or disjoint.
pub unsafe fn rope_forward(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    x: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    y: DevPtr,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { apply("rope_forward", l, dtype, s, x, cos, sin, y, false) }
}

/// Gradient of [`rope_forward`]: `dx` is the transpose of the forward map
/// applied to `dy` (`dx` may be `dy`: in place).
///
/// # Safety
/// As [`rope_forward`], with `dy` for `x` and `dx` for `y`.
pub unsafe fn rope_backward(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    dy: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    dx: DevPtr,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { apply("rope_backward", l, dtype, s, dy, cos, sin, dx, true) }
}

/// Rotates queries and keys in place with the same tables (forward, or the
/// backward pass on their gradients when `backward`). The two shapes may
/// differ in `outer` / `inner` (grouped-query attention) but must agree on
/// `seq` and `head_dim`.
///
/// # Safety
/// `q` and `k` must be valid for their shapes, `cos` and `sin` for
/// `seq * head_dim` elements, all of `dtype`.
pub unsafe fn rope_qk_inplace(
    l: &dyn Launcher,
    dtype: CudaDType,
    q_shape: &RopeShape,
    q: DevPtr,
    k_shape: &RopeShape,
    k: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    backward: bool,
) -> Result<()> {
    let op = if backward { "rope_backward" } else { "rope_forward" };
    if q_shape.seq != k_shape.seq || q_shape.head_dim != k_shape.head_dim {
        return Err(bad(op, format!("q {q_shape:?} and k {k_shape:?} differ in seq or head_dim")));
    }
    // SAFETY: forwarded to the caller.
    unsafe {
        apply(op, l, dtype, q_shape, q, cos, sin, q, backward)?;
        apply(op, l, dtype, k_shape, k, cos, sin, k, backward)
    }
}
