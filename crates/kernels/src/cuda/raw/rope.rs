//! Launch wrappers for `cuda/rope.cu`: rotary position embedding in the
//! rotate-half form, forward and backward (its exact transpose), out of
//! place or in place, as the CPU op [`crate::rope`].
//!
//! The layout is the CPU op's [`RopeShape`]: element `(o, t, i, j)` of the
//! rotated tensor is at `((o*seq + t)*inner + i)*head_dim + j`, and `cos` /
//! `sin` are `[seq, head_dim]` tables of the same dtype. [`rope_forward_orders`]
//! and [`rope_backward_orders`] read and write the tensor in separate
//! [`RopeOrder`]s: with `(outer, seq, inner) = (b, s, h)`, reading `[b, s, h, d]`
//! and writing `[b, h, s, d]` rotates the `transpose(1, 2)` of the input in one
//! pass (and the backward pass the reverse).

use bytemuck::{Pod, Zeroable};

use super::layout::grid_for;
use super::{bad, check_aligned, check_ptrs, numel, strided_span, to_i64};
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
    /// Elements between consecutive `outer` indices of `x`.
    pub xs_outer: i64,
    /// Elements between consecutive positions of `x`.
    pub xs_seq: i64,
    /// Elements between consecutive `inner` indices of `x`.
    pub xs_inner: i64,
    /// Elements between consecutive `outer` indices of `y`.
    pub ys_outer: i64,
    /// Elements between consecutive positions of `y`.
    pub ys_seq: i64,
    /// Elements between consecutive `inner` indices of `y`.
    pub ys_inner: i64,
    /// 1: apply the transpose (the backward pass).
    pub transpose: i32,
    /// Padding (0).
    pub pad: i32,
}

/// Where the rows (heads) of a [`RopeShape`] tensor lie: both orders are dense,
/// with the head dim contiguous.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RopeOrder {
    /// `((o*seq + t)*inner + i)*head_dim + j`: the layout of [`rope_forward`]
    /// (`[b, s, h, d]` for `(outer, seq, inner) = (b, s, h)`).
    #[default]
    SeqInner,
    /// `((o*inner + i)*seq + t)*head_dim + j` (`[b, h, s, d]` for
    /// `(outer, seq, inner) = (b, s, h)`).
    InnerSeq,
}

impl RopeOrder {
    /// Element strides of the `outer`, `seq` and `inner` indices for `s`
    /// (sizes already checked not to overflow).
    pub fn strides(self, s: &RopeShape) -> RopeStrides {
        let (seq, inner, d) = (s.seq, s.inner, s.head_dim);
        match self {
            RopeOrder::SeqInner => RopeStrides { outer: seq * inner * d, seq: inner * d, inner: d },
            RopeOrder::InnerSeq => RopeStrides { outer: seq * inner * d, seq: d, inner: seq * d },
        }
    }
}

/// Where the rows (heads) of a [`RopeShape`] tensor lie in a buffer: element
/// `(o, t, i, j)` is at `o*outer + t*seq + i*inner + j` (the head dim is
/// contiguous). A [`RopeOrder`] gives the dense ones; others read or write
/// some heads of a wider row, e.g. the q and k heads of a packed
/// `[b, s, (hq + 2 hkv) * d]` projection output: `(outer, seq, inner) =
/// (b, s, hq + hkv)` with strides `{ outer: s*w, seq: w, inner: d }` for `w =
/// (hq + 2 hkv) * d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RopeStrides {
    /// Elements between consecutive `outer` indices.
    pub outer: usize,
    /// Elements between consecutive positions.
    pub seq: usize,
    /// Elements between consecutive `inner` indices (heads).
    pub inner: usize,
}

impl RopeStrides {
    /// The strides of the dims `s` moves along (extent above 1), others 0: two
    /// stride sets with equal `moving` strides address every element alike.
    fn moving(self, s: &RopeShape) -> [usize; 3] {
        let keep = |n: usize, st: usize| if n > 1 { st } else { 0 };
        [keep(s.outer, self.outer), keep(s.seq, self.seq), keep(s.inner, self.inner)]
    }

    /// Elements a tensor of shape `s` spans under these strides (one past its
    /// last element; 0 when empty), or an error naming `what` when the span
    /// overflows i64 or, for a `written` operand, two elements would share an
    /// address (sorted by stride, each dim that moves must step past all the
    /// dims inside it reach, the head dim's `head_dim` elements innermost).
    pub fn span(self, op: &'static str, what: &str, s: &RopeShape, written: bool) -> Result<usize> {
        let d = s.head_dim;
        if [s.outer, s.seq, s.inner, d].contains(&0) {
            return Ok(0);
        }
        let dims = [(self.outer, s.outer), (self.seq, s.seq), (self.inner, s.inner)];
        strided_span(d, dims, written)
            .map_err(|e| bad(op, format!("{what} strides {self:?} for {s:?}: {}", e.why())))
    }
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
    // SAFETY: forwarded to the caller.
    unsafe {
        apply_orders(
            op,
            l,
            dtype,
            s,
            (x, RopeOrder::SeqInner),
            cos,
            sin,
            (y, RopeOrder::SeqInner),
            transpose,
        )
    }
}

/// [`apply`] with `x` read in one order and `y` written in another.
///
/// # Safety
/// As [`rope_forward_orders`].
#[allow(clippy::too_many_arguments)]
unsafe fn apply_orders(
    op: &'static str,
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    (x, x_order): (DevPtr, RopeOrder),
    cos: DevPtr,
    sin: DevPtr,
    (y, y_order): (DevPtr, RopeOrder),
    transpose: bool,
) -> Result<()> {
    // The orders' strides overflow nowhere once the element count fits.
    let es = dtype.size();
    numel(op, &[s.outer, s.seq, s.inner, s.head_dim, es])?;
    let (xs, ys) = (x_order.strides(s), y_order.strides(s));
    // SAFETY: forwarded to the caller (both orders are dense layouts of `s`).
    unsafe { apply_strided(op, l, dtype, s, (x, xs), cos, sin, (y, ys), transpose) }
}

/// [`apply`] with `x` and `y` at any strides.
///
/// # Safety
/// As [`rope_strided`].
#[allow(clippy::too_many_arguments)]
unsafe fn apply_strided(
    op: &'static str,
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    (x, xs): (DevPtr, RopeStrides),
    cos: DevPtr,
    sin: DevPtr,
    (y, ys): (DevPtr, RopeStrides),
    transpose: bool,
) -> Result<()> {
    if !s.head_dim.is_multiple_of(2) {
        return Err(bad(op, format!("{s:?}: head_dim must be even")));
    }
    // In place, every element must be read and written at one address.
    if x == y && xs.moving(s) != ys.moving(s) {
        return Err(bad(
            op,
            format!("{s:?}: x and y are one buffer but at different strides ({xs:?}, {ys:?})"),
        ));
    }
    let es = dtype.size();
    let n = numel(op, &[s.outer, s.seq, s.inner, s.head_dim, es])? / es;
    numel(op, &[s.seq, s.head_dim, es])?;
    xs.span(op, "x", s, false)?;
    ys.span(op, "y", s, true)?;
    if n == 0 {
        return Ok(());
    }
    let ptrs = [("x", x), ("cos", cos), ("sin", sin), ("y", y)];
    check_ptrs(op, &ptrs)?;
    check_aligned(op, es, &ptrs)?;
    let half = s.head_dim / 2;
    // As the kernel decides (the grid only sizes the grid-stride loop).
    let vec = half.is_multiple_of(8)
        && [x, cos, sin, y].iter().all(|p| p % 16 == 0)
        && [xs.outer, xs.seq, xs.inner, ys.outer, ys.seq, ys.inner]
            .iter()
            .all(|st| st.is_multiple_of(8));
    let pairs = n / 2;
    let items = if vec { pairs / 8 } else { pairs };
    let i = |v: usize| to_i64(op, "stride", v);
    let args = RopeArgs {
        x,
        cos,
        sin,
        y,
        outer: s.outer as i64,
        seq: s.seq as i64,
        inner: s.inner as i64,
        head_dim: s.head_dim as i64,
        xs_outer: i(xs.outer)?,
        xs_seq: i(xs.seq)?,
        xs_inner: i(xs.inner)?,
        ys_outer: i(ys.outer)?,
        ys_seq: i(ys.seq)?,
        ys_inner: i(ys.inner)?,
        transpose: transpose as i32,
        pad: 0,
    };
    let name = format!("tpar_rope_{}", dtype.suffix());
    // SAFETY: the caller guarantees the addresses; sizes are checked above.
    unsafe { launch(l, &name, grid_for(items, THREADS), &args) }
}

/// [`rope_forward`] (or, when `backward`, [`rope_backward`]) reading `x` at
/// the strides `xs` and writing `y` at `ys` ([`RopeStrides`]): one launch
/// rotates, say, the q and k heads of a packed `[b, s, (hq + 2 hkv) * d]`
/// projection output into a dense `[b, s, hq + hkv, d]` buffer, or the
/// gradient back into those columns, with the same bits per element as the
/// dense layouts. Strides under which two elements of `y` share an address
/// are an error naming it, and so is `y == x` at different strides (in
/// place, each element is read and written at one address).
///
/// # Safety
/// `x` must be a device address valid for every element the shape reaches at
/// `xs`, `y` likewise at `ys`, `cos` and `sin` for `seq * head_dim` elements,
/// all of `dtype`; `x` and `y` are either equal (with equal strides) or reach
/// disjoint elements.
#[allow(clippy::too_many_arguments)]
pub unsafe fn rope_strided(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    (x, xs): (DevPtr, RopeStrides),
    cos: DevPtr,
    sin: DevPtr,
    (y, ys): (DevPtr, RopeStrides),
    backward: bool,
) -> Result<()> {
    let op = if backward { "rope_backward" } else { "rope_forward" };
    // SAFETY: forwarded to the caller.
    unsafe { apply_strided(op, l, dtype, s, (x, xs), cos, sin, (y, ys), backward) }
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

/// [`rope_forward`] reading `x` in `x_order` and writing `y` in `y_order`:
/// with `(outer, seq, inner) = (b, s, h)`, `x` in [`RopeOrder::SeqInner`]
/// (`[b, s, h, d]`) and `y` in [`RopeOrder::InnerSeq`] (`[b, h, s, d]`), `y` is
/// the rotated `transpose(1, 2)` of `x`, bit for bit what the transpose then
/// [`rope_forward`] give. In place (`y == x`) only in one order (an error
/// otherwise, unless `seq` or `inner` is 1, when both orders are one layout).
///
/// # Safety
/// As [`rope_forward`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn rope_forward_orders(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    x: DevPtr,
    x_order: RopeOrder,
    cos: DevPtr,
    sin: DevPtr,
    y: DevPtr,
    y_order: RopeOrder,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe {
        apply_orders("rope_forward", l, dtype, s, (x, x_order), cos, sin, (y, y_order), false)
    }
}

/// Gradient of [`rope_forward_orders`]: `dy` read in `dy_order`, `dx` written
/// in `dx_order` (for the one-pass transpose above, `dy` in
/// [`RopeOrder::InnerSeq`] and `dx` in [`RopeOrder::SeqInner`]).
///
/// # Safety
/// As [`rope_forward`], with `dy` for `x` and `dx` for `y`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn rope_backward_orders(
    l: &dyn Launcher,
    dtype: CudaDType,
    s: &RopeShape,
    dy: DevPtr,
    dy_order: RopeOrder,
    cos: DevPtr,
    sin: DevPtr,
    dx: DevPtr,
    dx_order: RopeOrder,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe {
        apply_orders("rope_backward", l, dtype, s, (dy, dy_order), cos, sin, (dx, dx_order), true)
    }
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
