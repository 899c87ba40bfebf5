//! Launch wrappers for `cuda/elementwise.cu`: unary maps and their gradients,
//! scalar ops, binary ops (contiguous or broadcast), fused SwiGLU, fill,
//! casts, gradient accumulation, and softmax / log-softmax over the last dim.
//!
//! Every op computes what the CPU kernel of the same name in
//! [`crate::elementwise`] / [`crate::softmax`] computes, in f32, on buffers of
//! one [`CudaDType`]. Sizes are element counts; an empty problem launches
//! nothing. The kernels take 16-byte vector paths when the addresses allow
//! and fall back to element-wise access otherwise, so any element-aligned
//! address works.

use bytemuck::{Pod, Zeroable};

use super::layout::{collapse, grid_for, max_offset, MAX_RANK};
use super::{bad, check_aligned, check_ptrs, numel};
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
pub use crate::elementwise::{BinaryOp, UnaryOp};
use crate::Result;

/// Threads per block of the flat kernels.
const THREADS: u32 = 256;
/// Elements per work item of the flat kernels (one 16-byte vector of 16-bit
/// elements, two of f32).
const ITEM: usize = 8;
/// Longest row the one-warp-per-row softmax kernels take.
pub const SOFTMAX_WARP_MAX_COLS: usize = 1024;
/// Rows (warps) per block of the warp softmax kernels.
const SOFTMAX_WARPS: u32 = 8;
/// Grid cap of the block-per-row softmax kernels.
const SOFTMAX_MAX_BLOCKS: usize = 4096;

/// Arguments of `tpar_unary_<dtype>`: `y = op(x)` (`y` may be `x`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct UnaryArgs {
    /// Input.
    pub x: DevPtr,
    /// Output.
    pub y: DevPtr,
    /// Elements.
    pub n: i64,
    /// Op code ([`unary_code`]).
    pub op: i32,
    /// Padding (0).
    pub pad: i32,
}

/// Arguments of `tpar_unary_bwd_<dtype>`: `dx = dy * op'(x)` given `y = op(x)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct UnaryBwdArgs {
    /// Forward input.
    pub x: DevPtr,
    /// Forward output.
    pub y: DevPtr,
    /// Gradient of the output.
    pub dy: DevPtr,
    /// Gradient of the input (may be `dy`).
    pub dx: DevPtr,
    /// Elements.
    pub n: i64,
    /// Op code ([`unary_code`]).
    pub op: i32,
    /// Padding (0).
    pub pad: i32,
}

/// Arguments of `tpar_scalar_<dtype>`: `y = x op s` (`s op x` when `scalar_first`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct ScalarArgs {
    /// Input.
    pub x: DevPtr,
    /// Output (may be `x`).
    pub y: DevPtr,
    /// Elements.
    pub n: i64,
    /// The scalar.
    pub s: f32,
    /// Op code ([`binary_code`]).
    pub op: i32,
    /// 1: the scalar is the left operand.
    pub scalar_first: i32,
    /// Padding (0).
    pub pad: i32,
}

/// Arguments of `tpar_binary_<dtype>`: `out = a op b`, all contiguous.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BinaryArgs {
    /// Left operand.
    pub a: DevPtr,
    /// Right operand.
    pub b: DevPtr,
    /// Output (may be `a` or `b`).
    pub out: DevPtr,
    /// Elements.
    pub n: i64,
    /// Op code ([`binary_code`]).
    pub op: i32,
    /// Padding (0).
    pub pad: i32,
}

/// Arguments of `tpar_binary_bcast_<dtype>`: contiguous `out` of `shape`,
/// `a` and `b` read at per-dim strides (0 broadcasts).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BinaryBcastArgs {
    /// Left operand.
    pub a: DevPtr,
    /// Right operand.
    pub b: DevPtr,
    /// Output.
    pub out: DevPtr,
    /// Output elements.
    pub n: i64,
    /// Output shape (first `rank` entries).
    pub shape: [i64; MAX_RANK],
    /// Strides of `a` per output dim, in elements.
    pub a_stride: [i64; MAX_RANK],
    /// Strides of `b` per output dim, in elements.
    pub b_stride: [i64; MAX_RANK],
    /// Dims used.
    pub rank: i32,
    /// Op code ([`binary_code`]).
    pub op: i32,
    /// 1: 8-element vector path allowed (see elementwise.cu).
    pub vec: i32,
    /// 1: every index fits in 32 bits.
    pub idx32: i32,
}

/// Arguments of `tpar_swiglu_fwd_<dtype>`: `y = silu(a) * b` over `[rows, cols]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct SwigluFwdArgs {
    /// Gate input, row pitch `ld`.
    pub a: DevPtr,
    /// Up input, row pitch `ld`.
    pub b: DevPtr,
    /// Output, contiguous `[rows, cols]`.
    pub y: DevPtr,
    /// Rows.
    pub rows: i64,
    /// Columns.
    pub cols: i64,
    /// Row pitch of `a` and `b` in elements.
    pub ld: i64,
}

/// Arguments of `tpar_swiglu_bwd_<dtype>`: `da = dy * b * silu'(a)`, `db = dy * silu(a)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct SwigluBwdArgs {
    /// Gate input, row pitch `ld`.
    pub a: DevPtr,
    /// Up input, row pitch `ld`.
    pub b: DevPtr,
    /// Output gradient, contiguous `[rows, cols]`.
    pub dy: DevPtr,
    /// Gate gradient, row pitch `ld`.
    pub da: DevPtr,
    /// Up gradient, row pitch `ld`.
    pub db: DevPtr,
    /// Rows.
    pub rows: i64,
    /// Columns.
    pub cols: i64,
    /// Row pitch of `a`, `b`, `da`, `db` in elements.
    pub ld: i64,
}

/// Arguments of `tpar_fill_<dtype>`: `y[..n] = value`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct FillArgs {
    /// Output.
    pub y: DevPtr,
    /// Elements.
    pub n: i64,
    /// The value (rounded to the dtype).
    pub value: f32,
    /// Padding (0).
    pub pad: i32,
}

/// Arguments of `tpar_cast_<src>_<dst>`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct CastArgs {
    /// Input.
    pub src: DevPtr,
    /// Output.
    pub dst: DevPtr,
    /// Elements.
    pub n: i64,
}

/// Arguments of `tpar_accumulate_<src>_<dst>`: `dst += alpha * src`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct AccumulateArgs {
    /// Accumulator, read and written.
    pub dst: DevPtr,
    /// Addend.
    pub src: DevPtr,
    /// Elements.
    pub n: i64,
    /// Scale of the addend.
    pub alpha: f32,
    /// Padding (0).
    pub pad: i32,
}

/// Arguments of the softmax forward kernels (`tpar_softmax_fwd_{warp,block}_<dtype>`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct SoftmaxFwdArgs {
    /// Input `[rows, cols]`.
    pub x: DevPtr,
    /// Output `[rows, cols]` (may be `x`).
    pub y: DevPtr,
    /// Rows.
    pub rows: i64,
    /// Row length.
    pub cols: i64,
    /// 1: log-softmax.
    pub log: i32,
    /// Padding (0).
    pub pad: i32,
}

/// Arguments of the softmax backward kernels (`tpar_softmax_bwd_{warp,block}_<dtype>`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct SoftmaxBwdArgs {
    /// Forward output `[rows, cols]`.
    pub y: DevPtr,
    /// Output gradient.
    pub dy: DevPtr,
    /// Input gradient (may be `dy`).
    pub dx: DevPtr,
    /// Rows.
    pub rows: i64,
    /// Row length.
    pub cols: i64,
    /// 1: log-softmax.
    pub log: i32,
    /// Padding (0).
    pub pad: i32,
}

/// The kernel's code for a unary op.
pub fn unary_code(op: UnaryOp) -> i32 {
    match op {
        UnaryOp::Neg => 0,
        UnaryOp::Exp => 1,
        UnaryOp::Log => 2,
        UnaryOp::Sqrt => 3,
        UnaryOp::Rsqrt => 4,
        UnaryOp::Silu => 5,
        UnaryOp::Sigmoid => 6,
        UnaryOp::Square => 7,
        UnaryOp::Abs => 8,
        UnaryOp::Relu => 9,
        UnaryOp::Tanh => 10,
        UnaryOp::Recip => 11,
    }
}

/// The kernel's code for a binary op.
pub fn binary_code(op: BinaryOp) -> i32 {
    match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Max => 4,
        BinaryOp::Min => 5,
        BinaryOp::Pow => 6,
    }
}

fn kernel(name: &str, dtype: CudaDType) -> String {
    format!("tpar_{name}_{}", dtype.suffix())
}

/// Checks `n` and the pointers (not null, aligned to `es`-byte elements),
/// returning `n` as i64 (None: nothing to do).
fn flat(op: &'static str, n: usize, es: usize, ptrs: &[(&str, DevPtr)]) -> Result<Option<i64>> {
    let n64 = numel(op, &[n, es])? as i64 / es as i64;
    if n == 0 {
        return Ok(None);
    }
    check_ptrs(op, ptrs)?;
    check_aligned(op, es, ptrs)?;
    Ok(Some(n64))
}

fn flat_grid(n: usize) -> LaunchConfig {
    grid_for(n.div_ceil(ITEM), THREADS)
}

/// `y = op(x)` for `n` elements (`y` may equal `x`).
///
/// # Safety
/// `x` and `y` must be device addresses valid for `n` elements of `dtype`.
pub unsafe fn unary(
    l: &dyn Launcher,
    dtype: CudaDType,
    op: UnaryOp,
    x: DevPtr,
    y: DevPtr,
    n: usize,
) -> Result<()> {
    let Some(n64) = flat("unary", n, dtype.size(), &[("x", x), ("y", y)])? else { return Ok(()) };
    let args = UnaryArgs { x, y, n: n64, op: unary_code(op), pad: 0 };
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &kernel("unary", dtype), flat_grid(n), &args) }
}

/// `dx = dy * op'(x)` given the forward input `x` and output `y = op(x)`
/// (SiLU backward is `op = Silu`).
///
/// # Safety
/// All four addresses must be valid for `n` elements of `dtype`.
pub unsafe fn unary_backward(
    l: &dyn Launcher,
    dtype: CudaDType,
    op: UnaryOp,
    x: DevPtr,
    y: DevPtr,
    dy: DevPtr,
    dx: DevPtr,
    n: usize,
) -> Result<()> {
    let ptrs = [("x", x), ("y", y), ("dy", dy), ("dx", dx)];
    let Some(n64) = flat("unary_backward", n, dtype.size(), &ptrs)? else { return Ok(()) };
    let args = UnaryBwdArgs { x, y, dy, dx, n: n64, op: unary_code(op), pad: 0 };
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &kernel("unary_bwd", dtype), flat_grid(n), &args) }
}

/// `y = x op s`, or `s op x` when `scalar_first` (the scalar is rounded to f32).
///
/// # Safety
/// `x` and `y` must be valid for `n` elements of `dtype`.
pub unsafe fn scalar(
    l: &dyn Launcher,
    dtype: CudaDType,
    op: BinaryOp,
    x: DevPtr,
    s: f64,
    scalar_first: bool,
    y: DevPtr,
    n: usize,
) -> Result<()> {
    let Some(n64) = flat("scalar", n, dtype.size(), &[("x", x), ("y", y)])? else { return Ok(()) };
    let args = ScalarArgs {
        x,
        y,
        n: n64,
        s: s as f32,
        op: binary_code(op),
        scalar_first: scalar_first as i32,
        pad: 0,
    };
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &kernel("scalar", dtype), flat_grid(n), &args) }
}

/// `out = a op b` with `a` and `b` read at the given strides per output dim
/// (stride 0 broadcasts); `out` is contiguous of `out_shape` (the arguments
/// of the CPU [`crate::elementwise::binary`]). Same-shape operands run the
/// flat kernel; anything else (a row vector over rows, a column over
/// columns, general broadcasts of up to [`MAX_RANK`] merged dims) the
/// broadcast kernel.
///
/// # Safety
/// `a` and `b` must be valid for every element their strides reach, `out`
/// for `out_shape`'s elements.
pub unsafe fn binary(
    l: &dyn Launcher,
    dtype: CudaDType,
    op: BinaryOp,
    a: DevPtr,
    a_strides: &[usize],
    b: DevPtr,
    b_strides: &[usize],
    out_shape: &[usize],
    out: DevPtr,
) -> Result<()> {
    const OP: &str = "binary";
    if a_strides.len() != out_shape.len() || b_strides.len() != out_shape.len() {
        return Err(bad(
            OP,
            format!(
                "stride ranks {} and {} for an output of rank {}",
                a_strides.len(),
                b_strides.len(),
                out_shape.len()
            ),
        ));
    }
    let n = numel(OP, out_shape)?;
    if n == 0 {
        return Ok(());
    }
    let es = dtype.size();
    check_ptrs(OP, &[("a", a), ("b", b), ("out", out)])?;
    check_aligned(OP, es, &[("a", a), ("b", b), ("out", out)])?;
    let reach = |s: &[usize]| {
        max_offset(0, out_shape, s)
            .filter(|&m| m.checked_mul(es).is_some_and(|v| v <= i64::MAX as usize))
    };
    let (Some(ra), Some(rb)) = (reach(a_strides), reach(b_strides)) else {
        return Err(bad(
            OP,
            format!("strides {a_strides:?} / {b_strides:?} over {out_shape:?} overflow"),
        ));
    };
    let (shape, st) = collapse(out_shape, &[a_strides, b_strides]);
    let (sa, sb) = (&st[0], &st[1]);
    if shape.len() == 1 && sa[0] == 1 && sb[0] == 1 {
        let args = BinaryArgs { a, b, out, n: n as i64, op: binary_code(op), pad: 0 };
        // SAFETY: the caller guarantees the addresses.
        return unsafe { launch(l, &kernel("binary", dtype), flat_grid(n), &args) };
    }
    let rank = shape.len();
    if rank > MAX_RANK {
        return Err(bad(
            OP,
            format!("{rank} dims after merging {out_shape:?} (at most {MAX_RANK})"),
        ));
    }
    let last = rank - 1;
    let operand_ok = |s: &[usize], p: DevPtr| match s[last] {
        0 => true,
        1 => s[..last].iter().all(|v| v % ITEM == 0) && p.is_multiple_of(16),
        _ => false,
    };
    let vec =
        shape[last] % ITEM == 0 && operand_ok(sa, a) && operand_ok(sb, b) && out.is_multiple_of(16);
    let lim = i32::MAX as usize;
    let mut args = BinaryBcastArgs {
        a,
        b,
        out,
        n: n as i64,
        shape: [1; MAX_RANK],
        a_stride: [0; MAX_RANK],
        b_stride: [0; MAX_RANK],
        rank: rank as i32,
        op: binary_code(op),
        vec: vec as i32,
        idx32: (n <= lim && ra <= lim && rb <= lim) as i32,
    };
    for d in 0..rank {
        args.shape[d] = shape[d] as i64;
        args.a_stride[d] = sa[d] as i64;
        args.b_stride[d] = sb[d] as i64;
    }
    let items = if vec { n / ITEM } else { n };
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &kernel("binary_bcast", dtype), grid_for(items, THREADS), &args) }
}

/// Fused SwiGLU forward `y = silu(a) * b` over `[rows, cols]`: `a` (gate) and
/// `b` (up) have row pitch `ld >= cols` (`cols` when separate contiguous
/// tensors, `2 * cols` when they are the halves of one fused projection);
/// `y` is contiguous.
///
/// # Safety
/// `a` and `b` must be valid for `rows` rows at pitch `ld`, `y` for
/// `rows * cols` elements of `dtype`.
pub unsafe fn swiglu_forward(
    l: &dyn Launcher,
    dtype: CudaDType,
    a: DevPtr,
    b: DevPtr,
    ld: usize,
    y: DevPtr,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "swiglu_forward";
    let n = swiglu_check(OP, rows, cols, ld)?;
    if n == 0 {
        return Ok(());
    }
    check_ptrs(OP, &[("a", a), ("b", b), ("y", y)])?;
    check_aligned(OP, dtype.size(), &[("a", a), ("b", b), ("y", y)])?;
    let args = SwigluFwdArgs { a, b, y, rows: rows as i64, cols: cols as i64, ld: ld as i64 };
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &kernel("swiglu_fwd", dtype), flat_grid(n), &args) }
}

/// SwiGLU backward: `da = dy * b * silu'(a)`, `db = dy * silu(a)`; `da` and
/// `db` are written at the row pitch `ld` of `a` and `b`, `dy` is contiguous.
///
/// # Safety
/// As [`swiglu_forward`], with `da`, `db` like `a`, `b` and `dy` like `y`.
pub unsafe fn swiglu_backward(
    l: &dyn Launcher,
    dtype: CudaDType,
    a: DevPtr,
    b: DevPtr,
    ld: usize,
    dy: DevPtr,
    da: DevPtr,
    db: DevPtr,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "swiglu_backward";
    let n = swiglu_check(OP, rows, cols, ld)?;
    if n == 0 {
        return Ok(());
    }
    let ptrs = [("a", a), ("b", b), ("dy", dy), ("da", da), ("db", db)];
    check_ptrs(OP, &ptrs)?;
    check_aligned(OP, dtype.size(), &ptrs)?;
    let args =
        SwigluBwdArgs { a, b, dy, da, db, rows: rows as i64, cols: cols as i64, ld: ld as i64 };
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &kernel("swiglu_bwd", dtype), flat_grid(n), &args) }
}

fn swiglu_check(op: &'static str, rows: usize, cols: usize, ld: usize) -> Result<usize> {
    if ld < cols {
        return Err(bad(op, format!("row pitch {ld} is below the row length {cols}")));
    }
    numel(op, &[rows, ld])?;
    numel(op, &[rows, cols])
}

/// `y[..n] = value` (rounded to `dtype`).
///
/// # Safety
/// `y` must be valid for `n` elements of `dtype`.
pub unsafe fn fill(
    l: &dyn Launcher,
    dtype: CudaDType,
    y: DevPtr,
    n: usize,
    value: f64,
) -> Result<()> {
    let Some(n64) = flat("fill", n, dtype.size(), &[("y", y)])? else { return Ok(()) };
    let args = FillArgs { y, n: n64, value: value as f32, pad: 0 };
    // SAFETY: the caller guarantees the address.
    unsafe { launch(l, &kernel("fill", dtype), flat_grid(n), &args) }
}

/// Converts `n` elements between float dtypes (round to nearest even; the
/// same dtype copies).
///
/// # Safety
/// `src` must be valid for `n` elements of `from`, `dst` for `n` of `to`.
pub unsafe fn cast(
    l: &dyn Launcher,
    from: CudaDType,
    src: DevPtr,
    to: CudaDType,
    dst: DevPtr,
    n: usize,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { cast_named(l, (from.suffix(), from.size()), src, to, dst, n) }
}

/// Converts `n` i64 values (token ids, counts) to a float dtype.
///
/// # Safety
/// `src` must be valid for `n` i64 values, `dst` for `n` elements of `to`.
pub unsafe fn cast_i64(
    l: &dyn Launcher,
    src: DevPtr,
    to: CudaDType,
    dst: DevPtr,
    n: usize,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { cast_named(l, ("i64", 8), src, to, dst, n) }
}

/// A cast from the source type named `from.0` with `from.1`-byte elements.
///
/// # Safety
/// `src` must be valid for `n` elements of `from.1` bytes, `dst` for `n` of `to`.
unsafe fn cast_named(
    l: &dyn Launcher,
    from: (&str, usize),
    src: DevPtr,
    to: CudaDType,
    dst: DevPtr,
    n: usize,
) -> Result<()> {
    let Some(n64) = flat("cast", n, to.size(), &[("dst", dst)])? else { return Ok(()) };
    flat("cast", n, from.1, &[("src", src)])?;
    let args = CastArgs { src, dst, n: n64 };
    let name = format!("tpar_cast_{}_{}", from.0, to.suffix());
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &name, flat_grid(n), &args) }
}

/// `dst += alpha * src` for `n` elements, in f32, with `src` and `dst` of
/// any float dtypes (gradient accumulation, e.g. bf16 into f32).
///
/// # Safety
/// `src` must be valid for `n` elements of `src_dtype`, `dst` for `n` of
/// `dst_dtype`.
pub unsafe fn accumulate(
    l: &dyn Launcher,
    src_dtype: CudaDType,
    src: DevPtr,
    dst_dtype: CudaDType,
    dst: DevPtr,
    n: usize,
    alpha: f32,
) -> Result<()> {
    let Some(n64) = flat("accumulate", n, dst_dtype.size(), &[("dst", dst)])? else {
        return Ok(());
    };
    flat("accumulate", n, src_dtype.size(), &[("src", src)])?;
    let args = AccumulateArgs { dst, src, n: n64, alpha, pad: 0 };
    let name = format!("tpar_accumulate_{}_{}", src_dtype.suffix(), dst_dtype.suffix());
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &name, flat_grid(n), &args) }
}

/// The kernel variant and grid for `rows` softmax rows of `cols`.
fn softmax_launch(
    kind: &str,
    dtype: CudaDType,
    rows: usize,
    cols: usize,
) -> (String, LaunchConfig) {
    if cols <= SOFTMAX_WARP_MAX_COLS {
        let blocks = rows.div_ceil(SOFTMAX_WARPS as usize);
        let cfg = grid_for(blocks * (SOFTMAX_WARPS as usize) * 32, SOFTMAX_WARPS * 32);
        (format!("tpar_softmax_{kind}_warp_{}", dtype.suffix()), cfg)
    } else {
        // enough threads for one pass of 8-element items over the row
        let threads = cols.div_ceil(ITEM).next_multiple_of(32).clamp(128, 1024) as u32;
        let cfg = LaunchConfig::linear(rows.min(SOFTMAX_MAX_BLOCKS) as u32, threads);
        (format!("tpar_softmax_{kind}_block_{}", dtype.suffix()), cfg)
    }
}

/// Softmax (`log = false`) or log-softmax (`log = true`) of each row of
/// `x` `[rows, cols]` into `y` (may be `x`); max-subtracted, and a row of all
/// `-inf` gives zeros (resp. `-inf`), as [`crate::softmax::softmax_forward`].
///
/// # Safety
/// `x` and `y` must be valid for `rows * cols` elements of `dtype`.
pub unsafe fn softmax_forward(
    l: &dyn Launcher,
    dtype: CudaDType,
    x: DevPtr,
    y: DevPtr,
    rows: usize,
    cols: usize,
    log: bool,
) -> Result<()> {
    const OP: &str = "softmax_forward";
    if numel(OP, &[rows, cols])? == 0 {
        return Ok(());
    }
    check_ptrs(OP, &[("x", x), ("y", y)])?;
    check_aligned(OP, dtype.size(), &[("x", x), ("y", y)])?;
    let args =
        SoftmaxFwdArgs { x, y, rows: rows as i64, cols: cols as i64, log: log as i32, pad: 0 };
    let (name, cfg) = softmax_launch("fwd", dtype, rows, cols);
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &name, cfg, &args) }
}

/// Backward of [`softmax_forward`] from its output `y`: softmax
/// `dx = y * (dy - sum(dy * y))`, log-softmax `dx = dy - exp(y) * sum(dy)`.
///
/// # Safety
/// `y`, `dy` and `dx` must be valid for `rows * cols` elements of `dtype`.
pub unsafe fn softmax_backward(
    l: &dyn Launcher,
    dtype: CudaDType,
    y: DevPtr,
    dy: DevPtr,
    dx: DevPtr,
    rows: usize,
    cols: usize,
    log: bool,
) -> Result<()> {
    const OP: &str = "softmax_backward";
    if numel(OP, &[rows, cols])? == 0 {
        return Ok(());
    }
    check_ptrs(OP, &[("y", y), ("dy", dy), ("dx", dx)])?;
    check_aligned(OP, dtype.size(), &[("y", y), ("dy", dy), ("dx", dx)])?;
    let args =
        SoftmaxBwdArgs { y, dy, dx, rows: rows as i64, cols: cols as i64, log: log as i32, pad: 0 };
    let (name, cfg) = softmax_launch("bwd", dtype, rows, cols);
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &name, cfg, &args) }
}
