//! Rotary position embedding (`cuda/rope.cu`) over device buffers;
//! [`crate::cuda::raw::rope`] documents the kernels and the layout.

use super::{count, Check};
use crate::cuda::raw::rope as raw;
pub use crate::cuda::raw::rope::{RopeOrder, RopeShape, RopeStrides};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// Elements of the rotated tensor and of each table.
fn sizes(op: &'static str, s: &RopeShape) -> Result<(usize, usize)> {
    Ok((count(op, &[s.outer, s.seq, s.inner, s.head_dim])?, count(op, &[s.seq, s.head_dim])?))
}

/// The checks and the launch behind the public wrappers: `x` (`dy` when
/// `backward`) of shape `s` read in `x_order`, rotated (or, when `backward`,
/// put through the transposed rotation) with the `[seq, head_dim]` tables
/// into `y` (`dx`) written in `y_order`.
#[allow(clippy::too_many_arguments)]
fn rotate(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &RopeShape,
    (x, x_order): (DeviceSlice<'_>, RopeOrder),
    cos: DeviceSlice<'_>,
    sin: DeviceSlice<'_>,
    (y, y_order): (DeviceSliceMut<'_>, RopeOrder),
    backward: bool,
) -> Result<()> {
    let op = if backward { "rope_backward" } else { "rope_forward" };
    sizes(op, s)?;
    let (xs, ys) = (x_order.strides(s), y_order.strides(s));
    rope_strided(dev, dtype, s, (x, xs), cos, sin, (y, ys), backward)
}

/// [`rope_forward`] (or, when `backward`, [`rope_backward`]) reading `x` at
/// the strides `xs` and writing `y` at `ys` ([`raw::rope_strided`]): e.g. the
/// q and k heads of a packed `[b, s, (hq + 2 hkv) * d]` projection output
/// rotated into a dense `[b, s, hq + hkv, d]` buffer in one launch, or the
/// gradient rotated back into those columns (the other columns of `y` are
/// left as they are). Each view must hold every element its strides reach;
/// strides under which two elements of `y` share an address are an error.
#[allow(clippy::too_many_arguments)]
pub fn rope_strided(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &RopeShape,
    (x, xs): (DeviceSlice<'_>, RopeStrides),
    cos: DeviceSlice<'_>,
    sin: DeviceSlice<'_>,
    (y, ys): (DeviceSliceMut<'_>, RopeStrides),
    backward: bool,
) -> Result<()> {
    let (op, [xn, yn]) =
        if backward { ("rope_backward", ["dy", "dx"]) } else { ("rope_forward", ["x", "y"]) };
    let c = Check::new(op, dev);
    let ((_, t), es) = (sizes(op, s)?, dtype.size());
    let (xspan, yspan) = (xs.span(op, xn, s, false)?, ys.span(op, yn, s, true)?);
    let (xp, yp) = (c.read(xn, &x, xspan, es)?, c.write(yn, &y, yspan, es)?);
    let (cp, sp) = (c.read("cos", &cos, t, es)?, c.read("sin", &sin, t, es)?);
    // SAFETY: every address starts a view of a live buffer in `dev`'s memory
    // holding every element the kernel reaches at its strides for `s` (checked
    // above); `y` is an exclusive borrow, disjoint from the inputs.
    unsafe { raw::rope_strided(dev, dtype, s, (xp, xs), cp, sp, (yp, ys), backward) }
}

/// `y = x * cos + rotate_half(x) * sin` for `x` and `y` of shape `s` and the
/// `[seq, head_dim]` tables `cos` and `sin`, all of `dtype`.
pub fn rope_forward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &RopeShape,
    x: DeviceSlice<'_>,
    cos: DeviceSlice<'_>,
    sin: DeviceSlice<'_>,
    y: DeviceSliceMut<'_>,
) -> Result<()> {
    let seq_inner = RopeOrder::SeqInner;
    rotate(dev, dtype, s, (x, seq_inner), cos, sin, (y, seq_inner), false)
}

/// [`rope_forward`] reading `x` in `x_order` and writing `y` in `y_order`
/// ([`raw::rope_forward_orders`]): with `(outer, seq, inner) = (b, s, h)`, `x`
/// `[b, s, h, d]` ([`RopeOrder::SeqInner`]) gives the rotated `transpose(1, 2)`
/// in `y` `[b, h, s, d]` ([`RopeOrder::InnerSeq`]) in one pass.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward_orders(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &RopeShape,
    x: DeviceSlice<'_>,
    x_order: RopeOrder,
    cos: DeviceSlice<'_>,
    sin: DeviceSlice<'_>,
    y: DeviceSliceMut<'_>,
    y_order: RopeOrder,
) -> Result<()> {
    rotate(dev, dtype, s, (x, x_order), cos, sin, (y, y_order), false)
}

/// Gradient of [`rope_forward_orders`]: `dy` read in `dy_order`, `dx` written
/// in `dx_order`.
#[allow(clippy::too_many_arguments)]
pub fn rope_backward_orders(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &RopeShape,
    dy: DeviceSlice<'_>,
    dy_order: RopeOrder,
    cos: DeviceSlice<'_>,
    sin: DeviceSlice<'_>,
    dx: DeviceSliceMut<'_>,
    dx_order: RopeOrder,
) -> Result<()> {
    rotate(dev, dtype, s, (dy, dy_order), cos, sin, (dx, dx_order), true)
}

/// Gradient of [`rope_forward`]: `dx` is the transpose of the forward map
/// applied to `dy`.
pub fn rope_backward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &RopeShape,
    dy: DeviceSlice<'_>,
    cos: DeviceSlice<'_>,
    sin: DeviceSlice<'_>,
    dx: DeviceSliceMut<'_>,
) -> Result<()> {
    let seq_inner = RopeOrder::SeqInner;
    rotate(dev, dtype, s, (dy, seq_inner), cos, sin, (dx, seq_inner), true)
}

/// Rotates queries and keys in place with the same tables (forward, or the
/// backward pass on their gradients when `backward`); the shapes may differ
/// in `outer` / `inner` (grouped-query attention) but not in `seq` and
/// `head_dim`.
pub fn rope_qk_in_place(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    q_shape: &RopeShape,
    q: DeviceSliceMut<'_>,
    k_shape: &RopeShape,
    k: DeviceSliceMut<'_>,
    cos: DeviceSlice<'_>,
    sin: DeviceSlice<'_>,
    backward: bool,
) -> Result<()> {
    const OP: &str = "rope_qk_in_place";
    let c = Check::new(OP, dev);
    let es = dtype.size();
    let ((nq, tq), (nk, tk)) = (sizes(OP, q_shape)?, sizes(OP, k_shape)?);
    let (qp, kp) = (c.write("q", &q, nq, es)?, c.write("k", &k, nk, es)?);
    let (cp, sp) = (c.read("cos", &cos, tq.max(tk), es)?, c.read("sin", &sin, tq.max(tk), es)?);
    // SAFETY: as in `rotate`; `q` and `k` are exclusive borrows, each
    // rotated in place (the kernel reads and writes the same elements).
    unsafe { raw::rope_qk_inplace(dev, dtype, q_shape, qp, k_shape, kp, cp, sp, backward) }
}
