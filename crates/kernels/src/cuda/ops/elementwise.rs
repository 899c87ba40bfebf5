//! Elementwise kernels (`cuda/elementwise.cu`) over device buffers: unary
//! maps and their gradients, scalar and binary ops, SwiGLU, fill, casts,
//! gradient accumulation and softmax; [`crate::cuda::raw::elementwise`]
//! documents the kernels.

use super::{count, pitched, reach, Check};
use crate::cuda::raw::elementwise as raw;
pub use crate::cuda::raw::elementwise::{binary_code, unary_code, SOFTMAX_WARP_MAX_COLS};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
pub use crate::elementwise::{BinaryOp, UnaryOp};
use crate::util::bad;
use crate::Result;

/// `y = op(x)` for `n` elements of `dtype`.
pub fn unary(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    op: UnaryOp,
    x: DeviceSlice<'_>,
    y: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("unary", dev);
    let (xp, yp) = (c.read("x", &x, n, dtype.size())?, c.write("y", &y, n, dtype.size())?);
    // SAFETY: both views are live buffers in `dev`'s memory of at least `n`
    // elements (checked above); `y` is an exclusive borrow, disjoint from `x`.
    unsafe { raw::unary(dev, dtype, op, xp, yp, n) }
}

/// `x = op(x)` for `n` elements of `dtype`, in place.
pub fn unary_in_place(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    op: UnaryOp,
    x: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("unary", dev);
    let xp = c.write("x", &x, n, dtype.size())?;
    // SAFETY: an exclusively borrowed live buffer of at least `n` elements in
    // `dev`'s memory (checked above); the kernel allows `y == x`.
    unsafe { raw::unary(dev, dtype, op, xp, xp, n) }
}

/// `dx = dy * op'(x)` given the forward input `x` and output `y = op(x)`.
pub fn unary_backward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    op: UnaryOp,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
    dy: DeviceSlice<'_>,
    dx: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("unary_backward", dev);
    let es = dtype.size();
    let (xp, yp, gp) =
        (c.read("x", &x, n, es)?, c.read("y", &y, n, es)?, c.read("dy", &dy, n, es)?);
    let dxp = c.write("dx", &dx, n, es)?;
    // SAFETY: as in `unary`.
    unsafe { raw::unary_backward(dev, dtype, op, xp, yp, gp, dxp, n) }
}

/// `y = x op s`, or `s op x` when `scalar_first` (the scalar is rounded to f32).
pub fn scalar(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    op: BinaryOp,
    x: DeviceSlice<'_>,
    s: f64,
    scalar_first: bool,
    y: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("scalar", dev);
    let (xp, yp) = (c.read("x", &x, n, dtype.size())?, c.write("y", &y, n, dtype.size())?);
    // SAFETY: as in `unary`.
    unsafe { raw::scalar(dev, dtype, op, xp, s, scalar_first, yp, n) }
}

/// `x = x op s` (or `s op x`), in place.
pub fn scalar_in_place(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    op: BinaryOp,
    x: DeviceSliceMut<'_>,
    s: f64,
    scalar_first: bool,
    n: usize,
) -> Result<()> {
    let c = Check::new("scalar", dev);
    let xp = c.write("x", &x, n, dtype.size())?;
    // SAFETY: as in `unary_in_place`.
    unsafe { raw::scalar(dev, dtype, op, xp, s, scalar_first, xp, n) }
}

/// `out = a op b` with `a` and `b` read at the given strides per output dim
/// (stride 0 broadcasts) into the contiguous `out` of `out_shape`.
pub fn binary(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    op: BinaryOp,
    a: DeviceSlice<'_>,
    a_strides: &[usize],
    b: DeviceSlice<'_>,
    b_strides: &[usize],
    out_shape: &[usize],
    out: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "binary";
    let c = Check::new(OP, dev);
    let es = dtype.size();
    let ap = c.read("a", &a, reach(OP, 0, out_shape, a_strides)?, es)?;
    let bp = c.read("b", &b, reach(OP, 0, out_shape, b_strides)?, es)?;
    let op_ = c.write("out", &out, count(OP, out_shape)?, es)?;
    // SAFETY: `a` and `b` hold every element their strides reach over
    // `out_shape`, `out` its elements (checked above), all live buffers in
    // `dev`'s memory; `out` is an exclusive borrow.
    unsafe { raw::binary(dev, dtype, op, ap, a_strides, bp, b_strides, out_shape, op_) }
}

/// Fused SwiGLU forward `y = silu(a) * b` over `[rows, cols]`: `a` (gate) and
/// `b` (up) have row pitch `ld >= cols`; `y` is contiguous.
pub fn swiglu_forward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    ld: usize,
    y: DeviceSliceMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "swiglu_forward";
    let c = Check::new(OP, dev);
    let (es, rowsn) = (dtype.size(), pitched(OP, rows, cols, ld)?);
    let (ap, bp) = (c.read("a", &a, rowsn, es)?, c.read("b", &b, rowsn, es)?);
    let yp = c.write("y", &y, count(OP, &[rows, cols])?, es)?;
    // SAFETY: `a` and `b` hold `rows` rows at pitch `ld`, `y` `rows * cols`
    // elements (checked above), all live in `dev`'s memory; `y` is exclusive.
    unsafe { raw::swiglu_forward(dev, dtype, ap, bp, ld, yp, rows, cols) }
}

/// SwiGLU backward: `da = dy * b * silu'(a)`, `db = dy * silu(a)`, written at
/// the row pitch `ld` of `a` and `b`; `dy` is contiguous. (The two halves of
/// one fused gradient buffer cannot be borrowed apart; that layout is
/// [`crate::cuda::raw::elementwise::swiglu_backward`]'s.)
pub fn swiglu_backward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    ld: usize,
    dy: DeviceSlice<'_>,
    da: DeviceSliceMut<'_>,
    db: DeviceSliceMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "swiglu_backward";
    let c = Check::new(OP, dev);
    let (es, rowsn) = (dtype.size(), pitched(OP, rows, cols, ld)?);
    let (ap, bp) = (c.read("a", &a, rowsn, es)?, c.read("b", &b, rowsn, es)?);
    let gp = c.read("dy", &dy, count(OP, &[rows, cols])?, es)?;
    let (dap, dbp) = (c.write("da", &da, rowsn, es)?, c.write("db", &db, rowsn, es)?);
    // SAFETY: as in `swiglu_forward`; `da` and `db` are exclusive borrows.
    unsafe { raw::swiglu_backward(dev, dtype, ap, bp, ld, gp, dap, dbp, rows, cols) }
}

/// SwiGLU forward and backward on one packed `[rows, 2 cols]` buffer `x`, gate in
/// each row's first `cols` elements and up in its last (a fused gate/up projection's
/// output). [`SwigluPackedOut::Forward`] writes `y = silu(gate) * up` (contiguous
/// `[rows, cols]`); [`SwigluPackedOut::Backward`] writes the gradients for `dy`
/// (`[rows, cols]`) into `dx`'s halves in `x`'s layout: `dgate = dy * up * silu'(gate)`,
/// `dup = dy * silu(gate)`. The
/// kernels and the arithmetic of [`swiglu_forward`] and [`swiglu_backward`] at row
/// pitch `2 cols`.
pub fn swiglu_packed(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    y: SwigluPackedOut<'_, '_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "swiglu_packed";
    let c = Check::new(OP, dev);
    let es = dtype.size();
    let ld = cols.checked_mul(2).ok_or_else(|| bad(OP, format!("{cols} columns overflow")))?;
    let whole = count(OP, &[rows, ld])?;
    let xp = c.read("x", &x, whole, es)?;
    // the up half starts `cols` elements into each row
    let up = xp.wrapping_add((cols * es) as crate::cuda::DevPtr);
    let half = count(OP, &[rows, cols])?;
    match y {
        SwigluPackedOut::Forward(y) => {
            let yp = c.write("y", &y, half, es)?;
            // SAFETY: `x` holds `rows` rows of `2 cols` (checked above), so gate and up
            // read inside it at pitch `2 cols`; `y` holds `rows * cols` elements and is
            // an exclusive borrow; all live in `dev`'s memory.
            unsafe { raw::swiglu_forward(dev, dtype, xp, up, ld, yp, rows, cols) }
        }
        SwigluPackedOut::Backward { dy, dx } => {
            let gp = c.read("dy", &dy, half, es)?;
            let dxp = c.write("dx", &dx, whole, es)?;
            let dup = dxp.wrapping_add((cols * es) as crate::cuda::DevPtr);
            // SAFETY: as above; `dx` holds `rows` rows of `2 cols` and is an exclusive
            // borrow, its two halves written at pitch `2 cols` never meet.
            unsafe { raw::swiglu_backward(dev, dtype, xp, up, ld, gp, dxp, dup, rows, cols) }
        }
    }
}

/// What [`swiglu_packed`] writes.
#[derive(Debug)]
pub enum SwigluPackedOut<'a, 'b> {
    /// The product `[rows, cols]`.
    Forward(DeviceSliceMut<'a>),
    /// The packed gradient `[rows, 2 cols]` for the product's gradient `dy`.
    Backward {
        /// The product's gradient `[rows, cols]`.
        dy: DeviceSlice<'b>,
        /// The packed gradient (written).
        dx: DeviceSliceMut<'a>,
    },
}

/// `y[..n] = value` (rounded to `dtype`).
pub fn fill(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    y: DeviceSliceMut<'_>,
    n: usize,
    value: f64,
) -> Result<()> {
    let yp = Check::new("fill", dev).write("y", &y, n, dtype.size())?;
    // SAFETY: an exclusively borrowed live buffer of at least `n` elements in
    // `dev`'s memory (checked above).
    unsafe { raw::fill(dev, dtype, yp, n, value) }
}

/// Converts `n` elements between float dtypes (round to nearest even).
pub fn cast(
    dev: &dyn GpuDevice,
    from: CudaDType,
    src: DeviceSlice<'_>,
    to: CudaDType,
    dst: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("cast", dev);
    let (sp, dp) = (c.read("src", &src, n, from.size())?, c.write("dst", &dst, n, to.size())?);
    // SAFETY: as in `unary`.
    unsafe { raw::cast(dev, from, sp, to, dp, n) }
}

/// Converts `n` i64 values to a float dtype.
pub fn cast_i64(
    dev: &dyn GpuDevice,
    src: DeviceSlice<'_>,
    to: CudaDType,
    dst: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("cast", dev);
    let (sp, dp) = (c.read("src", &src, n, 8)?, c.write("dst", &dst, n, to.size())?);
    // SAFETY: as in `unary`.
    unsafe { raw::cast_i64(dev, sp, to, dp, n) }
}

/// `dst += alpha * src` for `n` elements, in f32, with `src` and `dst` of
/// any float dtypes.
pub fn accumulate(
    dev: &dyn GpuDevice,
    src_dtype: CudaDType,
    src: DeviceSlice<'_>,
    dst_dtype: CudaDType,
    dst: DeviceSliceMut<'_>,
    n: usize,
    alpha: f32,
) -> Result<()> {
    let c = Check::new("accumulate", dev);
    let sp = c.read("src", &src, n, src_dtype.size())?;
    let dp = c.write("dst", &dst, n, dst_dtype.size())?;
    // SAFETY: as in `unary`; `dst` is read and written through its exclusive borrow.
    unsafe { raw::accumulate(dev, src_dtype, sp, dst_dtype, dp, n, alpha) }
}

/// Softmax (`log = false`) or log-softmax of each row of `x` `[rows, cols]`
/// into `y`.
pub fn softmax_forward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    x: DeviceSlice<'_>,
    y: DeviceSliceMut<'_>,
    rows: usize,
    cols: usize,
    log: bool,
) -> Result<()> {
    const OP: &str = "softmax_forward";
    let c = Check::new(OP, dev);
    let (n, es) = (count(OP, &[rows, cols])?, dtype.size());
    let (xp, yp) = (c.read("x", &x, n, es)?, c.write("y", &y, n, es)?);
    // SAFETY: as in `unary`.
    unsafe { raw::softmax_forward(dev, dtype, xp, yp, rows, cols, log) }
}

/// Backward of [`softmax_forward`] from its output `y` and the output
/// gradient `dy`.
pub fn softmax_backward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    y: DeviceSlice<'_>,
    dy: DeviceSlice<'_>,
    dx: DeviceSliceMut<'_>,
    rows: usize,
    cols: usize,
    log: bool,
) -> Result<()> {
    const OP: &str = "softmax_backward";
    let c = Check::new(OP, dev);
    let (n, es) = (count(OP, &[rows, cols])?, dtype.size());
    let (yp, gp) = (c.read("y", &y, n, es)?, c.read("dy", &dy, n, es)?);
    let dxp = c.write("dx", &dx, n, es)?;
    // SAFETY: as in `unary`.
    unsafe { raw::softmax_backward(dev, dtype, yp, gp, dxp, rows, cols, log) }
}
