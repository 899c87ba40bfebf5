//! Rotary position embedding (`cuda/rope.cu`) over device buffers;
//! [`crate::cuda::raw::rope`] documents the kernels and the layout.

use super::{count, Check};
use crate::cuda::raw::rope as raw;
pub use crate::cuda::raw::rope::{RopeOrder, RopeShape};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// Elements of the rotated tensor and of each table.
fn sizes(op: &'static str, s: &RopeShape) -> Result<(usize, usize)> {
    Ok((count(op, &[s.outer, s.seq, s.inner, s.head_dim])?, count(op, &[s.seq, s.head_dim])?))
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
    const OP: &str = "rope_forward";
    let c = Check::new(OP, dev);
    let ((n, t), es) = (sizes(OP, s)?, dtype.size());
    let (xp, yp) = (c.read("x", &x, n, es)?, c.write("y", &y, n, es)?);
    let (cp, sp) = (c.read("cos", &cos, t, es)?, c.read("sin", &sin, t, es)?);
    // SAFETY: every address starts a view of a live buffer in `dev`'s memory
    // holding what the kernel touches for `s` (checked above); `y` is an
    // exclusive borrow, disjoint from the inputs.
    unsafe { raw::rope_forward(dev, dtype, s, xp, cp, sp, yp) }
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
    const OP: &str = "rope_forward";
    let c = Check::new(OP, dev);
    let ((n, t), es) = (sizes(OP, s)?, dtype.size());
    let (xp, yp) = (c.read("x", &x, n, es)?, c.write("y", &y, n, es)?);
    let (cp, sp) = (c.read("cos", &cos, t, es)?, c.read("sin", &sin, t, es)?);
    // SAFETY: as in `rope_forward`; both orders are dense, so each reaches the
    // `n` elements checked above.
    unsafe { raw::rope_forward_orders(dev, dtype, s, xp, x_order, cp, sp, yp, y_order) }
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
    const OP: &str = "rope_backward";
    let c = Check::new(OP, dev);
    let ((n, t), es) = (sizes(OP, s)?, dtype.size());
    let (gp, dxp) = (c.read("dy", &dy, n, es)?, c.write("dx", &dx, n, es)?);
    let (cp, sp) = (c.read("cos", &cos, t, es)?, c.read("sin", &sin, t, es)?);
    // SAFETY: as in `rope_forward_orders`.
    unsafe { raw::rope_backward_orders(dev, dtype, s, gp, dy_order, cp, sp, dxp, dx_order) }
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
    const OP: &str = "rope_backward";
    let c = Check::new(OP, dev);
    let ((n, t), es) = (sizes(OP, s)?, dtype.size());
    let (gp, dxp) = (c.read("dy", &dy, n, es)?, c.write("dx", &dx, n, es)?);
    let (cp, sp) = (c.read("cos", &cos, t, es)?, c.read("sin", &sin, t, es)?);
    // SAFETY: as in `rope_forward`.
    unsafe { raw::rope_backward(dev, dtype, s, gp, cp, sp, dxp) }
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
    // SAFETY: as in `rope_forward`; `q` and `k` are exclusive borrows, each
    // rotated in place (the kernel reads and writes the same elements).
    unsafe { raw::rope_qk_inplace(dev, dtype, q_shape, qp, k_shape, kp, cp, sp, backward) }
}
