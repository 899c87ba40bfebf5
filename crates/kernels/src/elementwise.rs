//! Elementwise kernels: unary maps, scalar ops, and binary ops with broadcasting.

use rayon::prelude::*;

use num_traits::{One, Zero};

use tpar_memory::cache::filled;

use crate::{Acc, Float, KernelError, Out, Result};

/// Below this many elements kernels run on the calling thread.
pub const PAR_THRESHOLD: usize = 1 << 15;

/// A binary elementwise operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// `max(a, b)`
    Max,
    /// `min(a, b)`
    Min,
    /// `a ^ b`
    Pow,
}

impl BinaryOp {
    /// Every binary op, in declaration order.
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Pow,
    ];

    /// Applies the op in the accumulator type.
    #[inline(always)]
    pub fn apply<A: Acc>(self, a: A, b: A) -> A {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Max => a.max(b),
            BinaryOp::Min => a.min(b),
            BinaryOp::Pow => a.powf(b),
        }
    }
}

/// Runs `$body` with `$f` bound to a closure computing `$op` on two `$acc` values
/// ([`BinaryOp::apply`] of a constant op), one arm per op, so each loop is compiled for
/// one op: no per-element `match`, and plain loops vectorize.
macro_rules! with_binary_fn {
    ($op:expr, $acc:ty, |$f:ident| $body:expr) => {
        with_binary_fn!(@arms $op, $acc, $f, $body, Add, Sub, Mul, Div, Max, Min, Pow)
    };
    (@arms $op:expr, $acc:ty, $f:ident, $body:expr, $($v:ident),*) => {
        match $op {
            $(BinaryOp::$v => {
                let $f = |a: $acc, b: $acc| BinaryOp::$v.apply(a, b);
                $body
            })*
        }
    };
}

/// A unary elementwise operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// natural log
    Log,
    /// square root
    Sqrt,
    /// `1 / sqrt(x)`
    Rsqrt,
    /// `x * sigmoid(x)` (SiLU / swish)
    Silu,
    /// `1 / (1 + e^-x)`
    Sigmoid,
    /// `x * x`
    Square,
    /// `|x|`
    Abs,
    /// `max(x, 0)`
    Relu,
    /// hyperbolic tangent
    Tanh,
    /// `1 / x`
    Recip,
}

#[inline(always)]
fn sigmoid<A: Acc>(x: A) -> A {
    A::one() / (A::one() + (-x).exp())
}

impl UnaryOp {
    /// Every unary op, in declaration order.
    pub const ALL: [UnaryOp; 12] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Silu,
        UnaryOp::Sigmoid,
        UnaryOp::Square,
        UnaryOp::Abs,
        UnaryOp::Relu,
        UnaryOp::Tanh,
        UnaryOp::Recip,
    ];

    /// Applies the op in the accumulator type.
    #[inline(always)]
    pub fn apply<A: Acc>(self, x: A) -> A {
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => A::one() / x.sqrt(),
            UnaryOp::Silu => x * sigmoid(x),
            UnaryOp::Sigmoid => sigmoid(x),
            UnaryOp::Square => x * x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Relu => x.max(A::zero()),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Recip => A::one() / x,
        }
    }

    /// `dy * f'(x)`, given the input `x` and output `y = f(x)`.
    #[inline(always)]
    pub fn derivative<A: Acc>(self, x: A, y: A, dy: A) -> A {
        let two = A::one() + A::one();
        match self {
            UnaryOp::Neg => -dy,
            UnaryOp::Exp => dy * y,
            UnaryOp::Log => dy / x,
            UnaryOp::Sqrt => dy / (two * y),
            UnaryOp::Rsqrt => -dy * y * y * y / two,
            UnaryOp::Silu => {
                let s = sigmoid(x);
                dy * s * (A::one() + x * (A::one() - s))
            }
            UnaryOp::Sigmoid => dy * y * (A::one() - y),
            UnaryOp::Square => dy * two * x,
            UnaryOp::Abs => dy * x.signum(),
            UnaryOp::Relu => {
                if x > A::zero() {
                    dy
                } else {
                    A::zero()
                }
            }
            UnaryOp::Tanh => dy * (A::one() - y * y),
            UnaryOp::Recip => -dy * y * y,
        }
    }
}

fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(KernelError::BadArguments {
            op,
            what: format!("{what} has {got} elements, expected {want}"),
        });
    }
    Ok(())
}

fn map_into<T: Float, O: Out<T>>(x: &[T], y: &mut [O], f: impl Fn(T) -> T + Sync) {
    if y.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(4096).zip(x.par_chunks(4096)).for_each(|(yc, xc)| {
            yc.iter_mut().zip(xc).for_each(|(o, &v)| o.put(f(v)));
        });
    } else {
        y.iter_mut().zip(x).for_each(|(o, &v)| o.put(f(v)));
    }
}

/// Elements per block of the vectorized (exp-based) unary paths.
const VBLOCK: usize = 1024;

/// Runs `f(x_block, out_block, scratch)` over aligned blocks of `x` and `out`, in
/// parallel when large; `scratch` is a per-task buffer.
fn blocks_into<X: Sync, Y: Send, A: Send>(
    x: &[X],
    out: &mut [Y],
    f: impl Fn(&[X], &mut [Y], &mut Vec<A>) + Sync + Send,
) {
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(VBLOCK)
            .zip(x.par_chunks(VBLOCK))
            .for_each_init(Vec::new, |buf, (o, x)| f(x, o, buf));
    } else {
        let mut buf = Vec::new();
        out.chunks_mut(VBLOCK).zip(x.chunks(VBLOCK)).for_each(|(o, x)| f(x, o, &mut buf));
    }
}

/// `y = op(x)`; writes every element of `y`.
pub fn unary<T: Float, O: Out<T>>(op: UnaryOp, x: &[T], y: &mut [O]) -> Result<()> {
    check_len("unary", "output", y.len(), x.len())?;
    // Exp-based ops run block by block on the vectorized math of the accumulator.
    let vector: Option<fn(&mut [T::Acc])> = match op {
        UnaryOp::Exp => Some(|b| {
            Acc::exp_sub_sum(b, T::Acc::zero());
        }),
        UnaryOp::Sigmoid => Some(Acc::sigmoid_slice),
        UnaryOp::Silu => Some(Acc::silu_slice),
        _ => None,
    };
    match vector {
        Some(f) => blocks_into(x, y, |x, y, buf: &mut Vec<T::Acc>| {
            buf.clear();
            buf.extend(x.iter().map(|v| v.to_acc()));
            f(buf);
            y.iter_mut().zip(buf.iter()).for_each(|(o, &v)| o.put(T::from_acc(v)));
        }),
        None => map_into(x, y, |v| T::from_acc(op.apply(v.to_acc()))),
    }
    Ok(())
}

/// [`unary`] into a new vector.
pub fn unary_new<T: Float>(op: UnaryOp, x: &[T]) -> Result<Vec<T>> {
    // SAFETY: `unary` writes every element of its output when it returns Ok.
    unsafe { filled(x.len(), |y| unary(op, x, y)) }
}

/// `dx = dy * op'(x)` given `y = op(x)`; writes every element of `dx`.
pub fn unary_backward<T: Float, O: Out<T>>(
    op: UnaryOp,
    x: &[T],
    y: &[T],
    dy: &[T],
    dx: &mut [O],
) -> Result<()> {
    let n = x.len();
    check_len("unary_backward", "y", y.len(), n)?;
    check_len("unary_backward", "dy", dy.len(), n)?;
    check_len("unary_backward", "dx", dx.len(), n)?;
    if op == UnaryOp::Silu {
        // dx = dy * s * (1 + x * (1 - s)) with s = sigmoid(x) from the vectorized math.
        let one = T::Acc::one();
        let block = |buf: &mut Vec<T::Acc>, (i, dxb): (usize, &mut [O])| {
            let o = i * VBLOCK;
            let (xb, gb) = (&x[o..o + dxb.len()], &dy[o..o + dxb.len()]);
            buf.clear();
            buf.extend(xb.iter().map(|v| v.to_acc()));
            Acc::sigmoid_slice(buf);
            for ((d, &s), (xv, g)) in dxb.iter_mut().zip(buf.iter()).zip(xb.iter().zip(gb)) {
                d.put(T::from_acc(g.to_acc() * s * (one + xv.to_acc() * (one - s))));
            }
        };
        if n >= PAR_THRESHOLD {
            dx.par_chunks_mut(VBLOCK).enumerate().for_each_init(Vec::new, block);
        } else {
            let mut buf = Vec::new();
            dx.chunks_mut(VBLOCK).enumerate().for_each(|c| block(&mut buf, c));
        }
        return Ok(());
    }
    let body = |(i, o): (usize, &mut O)| {
        o.put(T::from_acc(op.derivative(x[i].to_acc(), y[i].to_acc(), dy[i].to_acc())));
    };
    if n >= PAR_THRESHOLD {
        dx.par_iter_mut().enumerate().with_min_len(4096).for_each(body);
    } else {
        dx.iter_mut().enumerate().for_each(body);
    }
    Ok(())
}

/// [`unary_backward`] into a new vector.
pub fn unary_backward_new<T: Float>(op: UnaryOp, x: &[T], y: &[T], dy: &[T]) -> Result<Vec<T>> {
    // SAFETY: `unary_backward` writes every element of its output when it returns Ok.
    unsafe { filled(x.len(), |dx| unary_backward(op, x, y, dy, dx)) }
}

/// The SwiGLU product `y = silu(a) * b` in one pass (`silu(a)` kept in the accumulator,
/// not rounded to `T` before the product; for f32 the same bits as [`unary`] SiLU then a
/// multiply). Writes every element of `y`.
pub fn silu_mul<T: Float, O: Out<T>>(a: &[T], b: &[T], y: &mut [O]) -> Result<()> {
    check_len("silu_mul", "b", b.len(), a.len())?;
    check_len("silu_mul", "output", y.len(), a.len())?;
    let block = |buf: &mut Vec<T::Acc>, (i, yb): (usize, &mut [O])| {
        let o = i * VBLOCK;
        let (ab, bb) = (&a[o..o + yb.len()], &b[o..o + yb.len()]);
        buf.clear();
        buf.extend(ab.iter().map(|v| v.to_acc()));
        Acc::silu_slice(buf);
        for ((out, &sv), bv) in yb.iter_mut().zip(buf.iter()).zip(bb) {
            out.put(T::from_acc(sv * bv.to_acc()));
        }
    };
    if y.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(VBLOCK).enumerate().for_each_init(Vec::new, block);
    } else {
        let mut buf = Vec::new();
        y.chunks_mut(VBLOCK).enumerate().for_each(|c| block(&mut buf, c));
    }
    Ok(())
}

/// [`silu_mul`] into a new vector.
pub fn silu_mul_new<T: Float>(a: &[T], b: &[T]) -> Result<Vec<T>> {
    // SAFETY: `silu_mul` writes every element of its output when it returns Ok.
    unsafe { filled(a.len(), |y| silu_mul(a, b, y)) }
}

/// The gradients of [`silu_mul`]: `db = dy * silu(a)` and
/// `da = dy * b * s * (1 + a * (1 - s))` with `s = sigmoid(a)`, evaluated in that order
/// (for f32 the bits of a multiply's gradients followed by [`unary_backward`] SiLU).
/// Writes every element of `da` and `db`.
pub fn silu_mul_backward<T: Float, O: Out<T>>(
    a: &[T],
    b: &[T],
    dy: &[T],
    da: &mut [O],
    db: &mut [O],
) -> Result<()> {
    let n = a.len();
    for (what, len) in [("b", b.len()), ("dy", dy.len()), ("da", da.len()), ("db", db.len())] {
        check_len("silu_mul_backward", what, len, n)?;
    }
    let one = T::Acc::one();
    let block = |bufs: &mut (Vec<T::Acc>, Vec<T::Acc>),
                 (i, (dab, dbb)): (usize, (&mut [O], &mut [O]))| {
        let o = i * VBLOCK;
        let m = dab.len();
        let (ab, bb, gb) = (&a[o..o + m], &b[o..o + m], &dy[o..o + m]);
        let (sil, sig) = bufs;
        sil.clear();
        sil.extend(ab.iter().map(|v| v.to_acc()));
        sig.clear();
        sig.extend_from_slice(sil);
        Acc::silu_slice(sil);
        Acc::sigmoid_slice(sig);
        let outs = dab.iter_mut().zip(dbb.iter_mut());
        let ins = ab.iter().zip(bb).zip(gb).zip(sil.iter().zip(sig.iter()));
        for ((da_k, db_k), (((av, bv), g), (&y, &s))) in outs.zip(ins) {
            let (av, g) = (av.to_acc(), g.to_acc());
            db_k.put(T::from_acc(g * y));
            da_k.put(T::from_acc(g * bv.to_acc() * s * (one + av * (one - s))));
        }
    };
    if n >= PAR_THRESHOLD {
        da.par_chunks_mut(VBLOCK)
            .zip(db.par_chunks_mut(VBLOCK))
            .enumerate()
            .for_each_init(|| (Vec::new(), Vec::new()), block);
    } else {
        let mut bufs = (Vec::new(), Vec::new());
        let chunks = da.chunks_mut(VBLOCK).zip(db.chunks_mut(VBLOCK));
        chunks.enumerate().for_each(|c| block(&mut bufs, c));
    }
    Ok(())
}

/// [`silu_mul_backward`] into new vectors `(da, db)`.
pub fn silu_mul_backward_new<T: Float>(a: &[T], b: &[T], dy: &[T]) -> Result<(Vec<T>, Vec<T>)> {
    let mut db_out = None;
    // SAFETY: `silu_mul_backward` writes every element of both outputs when it returns Ok.
    let da = unsafe {
        filled(a.len(), |da| {
            db_out = Some(filled(a.len(), |db| silu_mul_backward(a, b, dy, da, db))?);
            Ok::<(), KernelError>(())
        })?
    };
    Ok((da, db_out.unwrap_or_default()))
}

/// `y = x op s` (or `s op x` when `scalar_first`); writes every element of `y`.
pub fn scalar<T: Float, O: Out<T>>(
    op: BinaryOp,
    x: &[T],
    s: f64,
    scalar_first: bool,
    y: &mut [O],
) -> Result<()> {
    check_len("scalar", "output", y.len(), x.len())?;
    let s = T::Acc::of(s);
    with_binary_fn!(op, T::Acc, |f| if scalar_first {
        map_into(x, y, |v| T::from_acc(f(s, v.to_acc())));
    } else {
        map_into(x, y, |v| T::from_acc(f(v.to_acc(), s)));
    });
    Ok(())
}

/// [`scalar`] into a new vector.
pub fn scalar_new<T: Float>(op: BinaryOp, x: &[T], s: f64, scalar_first: bool) -> Result<Vec<T>> {
    // SAFETY: `scalar` writes every element of its output when it returns Ok.
    unsafe { filled(x.len(), |y| scalar(op, x, s, scalar_first, y)) }
}

/// Contiguous row-major strides of a shape.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i];
    }
    strides
}

fn max_offset(shape: &[usize], strides: &[usize]) -> usize {
    shape.iter().zip(strides).map(|(&n, &s)| n.saturating_sub(1) * s).sum()
}

/// `out = a op b` where `a` and `b` are read with the given strides per output dim
/// (stride 0 broadcasts); `out` is contiguous with shape `out_shape`. Writes every
/// element of `out`.
pub fn binary<T: Float, O: Out<T>>(
    op: BinaryOp,
    a: &[T],
    a_strides: &[usize],
    b: &[T],
    b_strides: &[usize],
    out_shape: &[usize],
    out: &mut [O],
) -> Result<()> {
    let n: usize = out_shape.iter().product();
    check_len("binary", "output", out.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    if a_strides.len() != out_shape.len() || b_strides.len() != out_shape.len() {
        return Err(KernelError::BadArguments {
            op: "binary",
            what: "stride rank mismatch".into(),
        });
    }
    if max_offset(out_shape, a_strides) >= a.len() || max_offset(out_shape, b_strides) >= b.len() {
        return Err(KernelError::BadArguments {
            op: "binary",
            what: "strides reach outside an operand".into(),
        });
    }
    let contig = contiguous_strides(out_shape);
    if a_strides == contig.as_slice() && b_strides == contig.as_slice() {
        with_binary_fn!(op, T::Acc, |f| zip_map(a, b, out, f));
        return Ok(());
    }
    let rank = out_shape.len();
    let last = if rank == 0 { 1 } else { out_shape[rank - 1] };
    let (sa, sb) = if rank == 0 { (0, 0) } else { (a_strides[rank - 1], b_strides[rank - 1]) };
    with_binary_fn!(op, T::Acc, |f| {
        row_blocks(out, last, |first, block| {
            let mut ra = RowWalk::new(first, out_shape, a_strides);
            let mut rb = RowWalk::new(first, out_shape, b_strides);
            for orow in block.chunks_mut(last) {
                binary_row(orow, (a, ra.offset, sa), (b, rb.offset, sb), f);
                ra.step();
                rb.step();
            }
        });
    });
    Ok(())
}

/// [`binary`] into a new vector.
pub fn binary_new<T: Float>(
    op: BinaryOp,
    a: &[T],
    a_strides: &[usize],
    b: &[T],
    b_strides: &[usize],
    out_shape: &[usize],
) -> Result<Vec<T>> {
    let n = out_shape.iter().product();
    // SAFETY: `binary` writes every element of its output when it returns Ok.
    unsafe { filled(n, |o| binary(op, a, a_strides, b, b_strides, out_shape, o)) }
}

/// Elements per task of the contiguous binary path.
const ZIP_CHUNK: usize = 16 * 1024;

/// `out[i] = f(a[i], b[i])` over contiguous operands, in parallel when large.
fn zip_map<T: Float, O: Out<T>>(
    a: &[T],
    b: &[T],
    out: &mut [O],
    f: impl Fn(T::Acc, T::Acc) -> T::Acc + Sync + Copy,
) {
    let run = |(o, (x, y)): (&mut [O], (&[T], &[T]))| {
        for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
            o.put(T::from_acc(f(x.to_acc(), y.to_acc())));
        }
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(ZIP_CHUNK)
            .zip(a.par_chunks(ZIP_CHUNK).zip(b.par_chunks(ZIP_CHUNK)))
            .for_each(run);
    } else {
        run((out, (a, b)));
    }
}

/// One output row of a strided binary op: `orow[j] = f(a[oa + j * sa], b[ob + j * sb])`,
/// with the common layouts (both contiguous, one broadcast along the row) as plain
/// slice loops.
#[inline(always)]
fn binary_row<T: Float, O: Out<T>>(
    orow: &mut [O],
    (a, oa, sa): (&[T], usize, usize),
    (b, ob, sb): (&[T], usize, usize),
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
) {
    let n = orow.len();
    match (sa, sb) {
        (1, 1) => {
            for ((o, &x), &y) in orow.iter_mut().zip(&a[oa..oa + n]).zip(&b[ob..ob + n]) {
                o.put(T::from_acc(f(x.to_acc(), y.to_acc())));
            }
        }
        (1, 0) => {
            let y = b[ob].to_acc();
            for (o, &x) in orow.iter_mut().zip(&a[oa..oa + n]) {
                o.put(T::from_acc(f(x.to_acc(), y)));
            }
        }
        (0, 1) => {
            let x = a[oa].to_acc();
            for (o, &y) in orow.iter_mut().zip(&b[ob..ob + n]) {
                o.put(T::from_acc(f(x, y.to_acc())));
            }
        }
        _ => {
            for (j, o) in orow.iter_mut().enumerate() {
                o.put(T::from_acc(f(a[oa + j * sa].to_acc(), b[ob + j * sb].to_acc())));
            }
        }
    }
}

/// `out[i] = src[offset(i)]` for a contiguous `out` of shape `out_shape`, reading `src` at
/// `base + sum(idx[d] * src_strides[d])`. Serves permute, expand (stride 0) and narrow.
/// Writes every element of `out`.
pub fn strided_copy<T: Copy + Send + Sync, O: Out<T>>(
    src: &[T],
    base: usize,
    src_strides: &[usize],
    out_shape: &[usize],
    out: &mut [O],
) -> Result<()> {
    let n: usize = out_shape.iter().product();
    check_len("strided_copy", "output", out.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    if src_strides.len() != out_shape.len()
        || base + max_offset(out_shape, src_strides) >= src.len()
    {
        return Err(KernelError::BadArguments {
            op: "strided_copy",
            what: format!(
                "strides {src_strides:?} from offset {base} over shape {out_shape:?} reach outside {} elements",
                src.len()
            ),
        });
    }
    let rank = out_shape.len();
    let last = if rank == 0 { 1 } else { out_shape[rank - 1] };
    let s = if rank == 0 { 0 } else { src_strides[rank - 1] };
    row_blocks(out, last, |first, block| {
        let mut rows = RowWalk::new(first, out_shape, src_strides);
        for orow in block.chunks_mut(last) {
            let o = base + rows.offset;
            if s == 1 {
                orow.iter_mut().zip(&src[o..o + last]).for_each(|(v, &x)| v.put(x));
            } else {
                for (j, v) in orow.iter_mut().enumerate() {
                    v.put(src[o + j * s]);
                }
            }
            rows.step();
        }
    });
    Ok(())
}

/// Runs `f(first row, block)` over `out` cut in blocks of whole rows of `last` elements,
/// at least 4096 elements each, in parallel from [`PAR_THRESHOLD`] elements: a block
/// finds its first row's offsets once and steps from row to row with a [`RowWalk`]
/// (no division per row).
fn row_blocks<O: Send>(out: &mut [O], last: usize, f: impl Fn(usize, &mut [O]) + Sync) {
    // An empty last dim leaves `out` empty; the width only has to be non-zero.
    let width = last.max(1);
    let rows = (4096 / width).max(1);
    let block = |(b, block): (usize, &mut [O])| f(b * rows, block);
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(rows * width).enumerate().for_each(block);
    } else {
        out.chunks_mut(rows * width).enumerate().for_each(block);
    }
}

/// The source offset of consecutive rows (all dims but the last) of a strided view:
/// an odometer over the row's index that adds and takes back strides as it turns.
struct RowWalk<'a> {
    shape: &'a [usize],
    strides: &'a [usize],
    index: Vec<usize>,
    offset: usize,
}

impl<'a> RowWalk<'a> {
    /// Starts at row `row` (rows counted in row-major order).
    fn new(row: usize, shape: &'a [usize], strides: &'a [usize]) -> Self {
        let outer = shape.len().saturating_sub(1);
        let mut index = vec![0; outer];
        let mut rem = row;
        for d in (0..outer).rev() {
            index[d] = rem % shape[d];
            rem /= shape[d];
        }
        let offset = index.iter().zip(strides).map(|(i, s)| i * s).sum();
        RowWalk { shape, strides, index, offset }
    }

    /// Moves to the next row (past the last one the offset is not used).
    #[inline]
    fn step(&mut self) {
        for d in (0..self.index.len()).rev() {
            self.index[d] += 1;
            self.offset += self.strides[d];
            if self.index[d] < self.shape[d] {
                return;
            }
            self.offset -= self.shape[d] * self.strides[d];
            self.index[d] = 0;
        }
    }
}

/// [`strided_copy`] into a new vector.
pub fn strided_copy_new<T: Copy + Send + Sync + 'static>(
    src: &[T],
    base: usize,
    src_strides: &[usize],
    out_shape: &[usize],
) -> Result<Vec<T>> {
    let n = out_shape.iter().product();
    // SAFETY: `strided_copy` writes every element of its output when it returns Ok.
    unsafe { filled(n, |o| strided_copy(src, base, src_strides, out_shape, o)) }
}

/// Converts between element types (through f64 for exactness across all pairs).
pub fn cast<S: Float, D: Float>(src: &[S], dst: &mut [D]) -> Result<()> {
    check_len("cast", "output", dst.len(), src.len())?;
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = D::from_f64(s.to_f64()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_add_matches_loops() {
        // a: [2,1,3] -> strides over out [2,4,3]: [3,0,1]; b: [4,1] -> [0,1,0]
        let a: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let b: Vec<f32> = (0..4).map(|v| 10.0 * v as f32).collect();
        let mut out = vec![0f32; 24];
        binary(BinaryOp::Add, &a, &[3, 0, 1], &b, &[0, 1, 0], &[2, 4, 3], &mut out).unwrap();
        for i in 0..2 {
            for j in 0..4 {
                for k in 0..3 {
                    assert_eq!(out[(i * 4 + j) * 3 + k], a[i * 3 + k] + b[j]);
                }
            }
        }
    }

    /// The source offset of element `i` of a row-major `shape` read with `strides`.
    fn naive_offset(mut i: usize, shape: &[usize], strides: &[usize]) -> usize {
        let mut off = 0;
        for d in (0..shape.len()).rev() {
            off += (i % shape[d]) * strides[d];
            i /= shape[d];
        }
        off
    }

    /// Strided copies and strided binary ops of ranks 0-5 (permutes, broadcasts, local
    /// slices from an offset, a non-unit last stride), serial and parallel sizes, with
    /// rows that do not divide the blocks, read each element from where a loop over the
    /// whole index says.
    #[test]
    fn strided_views_match_an_index_loop() {
        // (shape, strides of the view, base offset)
        let views: Vec<(Vec<usize>, Vec<usize>, usize)> = vec![
            (vec![], vec![], 3),
            (vec![7], vec![2], 1),
            (vec![5, 3], vec![1, 5], 0),
            (vec![4, 6, 32], vec![6 * 32, 32 * 4, 1], 0),
            (vec![8, 24, 40, 32], vec![40 * 24 * 32, 32, 24 * 32, 1], 0),
            (vec![8, 40, 24, 32], vec![24 * 40 * 32, 32, 40 * 32, 1], 0),
            (vec![3, 5, 7, 2, 3], vec![0, 7 * 6, 6, 3, 1], 2),
            (vec![2, 3, 4, 5, 6], vec![3 * 4 * 5 * 6, 4 * 5 * 6, 5 * 6, 0, 1], 0),
            (vec![300, 77], vec![154, 1], 77),
            (vec![9, 4, 131], vec![4 * 262, 262, 2], 1),
            (vec![7, 13, 24, 37], vec![24 * 13 * 37, 37, 13 * 37, 1], 0),
        ];
        for (shape, strides, base) in views {
            let n: usize = shape.iter().product();
            let len = base + max_offset(&shape, &strides) + 1;
            let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let mut out = vec![f32::NAN; n];
            strided_copy(&src, base, &strides, &shape, &mut out).unwrap();
            let want: Vec<f32> =
                (0..n).map(|i| src[base + naive_offset(i, &shape, &strides)]).collect();
            assert_eq!(out, want, "strided_copy of {shape:?} by {strides:?} from {base}");
            // The same view as the left operand of a binary op, a contiguous right one.
            let contig = contiguous_strides(&shape);
            let b: Vec<f32> = (0..n).map(|i| 0.5 * i as f32).collect();
            let a = &src[base..];
            binary(BinaryOp::Sub, a, &strides, &b, &contig, &shape, &mut out).unwrap();
            let want: Vec<f32> =
                (0..n).map(|i| a[naive_offset(i, &shape, &strides)] - b[i]).collect();
            assert_eq!(out, want, "binary of {shape:?} by {strides:?}");
        }
    }

    /// Every op on every layout path (contiguous, a row broadcast on either side, a
    /// general stride, scalars), serial and parallel sizes, in three dtypes, gives the
    /// bits of `BinaryOp::apply` element by element.
    #[test]
    fn binary_paths_give_apply_bits() {
        fn check<T: Float>(of: impl Fn(f64) -> T) {
            let val = |i: usize| of(0.25 + ((i * 7919) % 1013) as f64 / 257.0);
            for rows in [3usize, 40_000 / 17] {
                let shape = [rows, 17];
                let n = rows * 17;
                let a: Vec<T> = (0..n).map(val).collect();
                let b: Vec<T> = (0..n).map(|i| val(i + 5)).collect();
                // (a strides, b strides) over `shape`: element (i, j) reads a[i*sa0 + j*sa1].
                let layouts: [([usize; 2], [usize; 2]); 6] = [
                    ([17, 1], [17, 1]),
                    ([17, 1], [1, 0]),
                    ([1, 0], [17, 1]),
                    ([0, 1], [17, 1]),
                    ([1, rows], [17, 1]),
                    ([0, 0], [17, 1]),
                ];
                for op in BinaryOp::ALL {
                    for (sa, sb) in layouts {
                        let mut out = vec![T::default(); n];
                        binary(op, &a, &sa, &b, &sb, &shape, &mut out).unwrap();
                        for i in 0..rows {
                            for j in 0..17 {
                                let (x, y) = (a[i * sa[0] + j * sa[1]], b[i * sb[0] + j * sb[1]]);
                                let want = T::from_acc(op.apply(x.to_acc(), y.to_acc()));
                                let got = out[i * 17 + j];
                                assert!(
                                    got.to_f64().to_bits() == want.to_f64().to_bits(),
                                    "{op:?} {sa:?} {sb:?} at ({i}, {j}): {got:?} vs {want:?}"
                                );
                            }
                        }
                    }
                    for first in [false, true] {
                        let mut out = vec![T::default(); n];
                        scalar(op, &a, 1.5, first, &mut out).unwrap();
                        let s = T::Acc::of(1.5);
                        for (i, (&x, &got)) in a.iter().zip(&out).enumerate() {
                            let x = x.to_acc();
                            let want =
                                T::from_acc(if first { op.apply(s, x) } else { op.apply(x, s) });
                            assert!(
                                got.to_f64().to_bits() == want.to_f64().to_bits(),
                                "scalar {op:?} first={first} at {i}"
                            );
                        }
                    }
                }
            }
        }
        check::<f32>(|v| v as f32);
        check::<f64>(|v| v);
        check::<half::bf16>(half::bf16::from_f64);
    }

    #[test]
    fn strided_copy_permutes() {
        let x: Vec<i64> = (0..6).collect(); // [2,3]
        let mut out = vec![0i64; 6]; // transpose -> [3,2]
        strided_copy(&x, 0, &[1, 3], &[3, 2], &mut out).unwrap();
        assert_eq!(out, vec![0, 3, 1, 4, 2, 5]);
        assert!(strided_copy(&x, 1, &[1, 3], &[3, 2], &mut out).is_err());
    }

    #[test]
    fn derivatives_match_finite_differences() {
        for op in UnaryOp::ALL {
            for &x in &[0.3f64, 1.7, 2.5] {
                let h = 1e-6;
                let fd = (op.apply(x + h) - op.apply(x - h)) / (2.0 * h);
                let an = op.derivative(x, op.apply(x), 1.0);
                assert!((fd - an).abs() < 1e-6 * (1.0 + fd.abs()), "{op:?} at {x}: {fd} vs {an}");
            }
        }
    }
}
