//! Elementwise, layout and reduction ops on CUDA tensors, launched through the
//! typed wrappers of `tpar_kernels::cuda::ops::{elementwise, layout, reduce}`.
//!
//! Every function takes inputs already on `cuda:N` and returns `Ok(None)` when
//! the device has no kernel for the case (f64 arithmetic, a broadcast that
//! merges to more dims than the kernels take, extents beyond their i32
//! range): the caller then runs its host fallback. Forward helpers that the op
//! functions wrap in their own `record` (binary, scalar, unary, casts, layout
//! copies, reductions) do not record; [`softmax`] records a backward that
//! launches too, as `super::gpu::rms_norm` does.
//!
//! Layout copies move bits, so they run for every dtype (2, 4 and 8-byte
//! elements, i64 and f64 included).

use tpar_kernels::cuda::ops::{
    dropout as k_drop, elementwise as k_ew, embedding as k_emb, layout as k_lay, reduce as k_red,
};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer};
use tpar_kernels::dropout::{DropoutMask, ShardRuns};
use tpar_kernels::elementwise::{BinaryOp, UnaryOp};
use tpar_kernels::reduce::Reduction;

use super::gpu::{cuda_dtype, device_of, with_gpu, Out};
use super::invalid;
use crate::autograd::record;
use crate::storage::{Element, Storage};
use crate::{DType, Device, Result, Shape, Tensor, TensorError};

/// The largest identity table (elements) the max backward builds on the device.
const MAX_EYE_ELEMS: usize = 2048 * 2049;

/// Number of dims the kernels see after merging `shape` read through each
/// stride set: size-1 dims dropped, neighbours joined where every set walks
/// them contiguously (the rule the kernel wrappers apply before launching).
fn merged_rank(shape: &[usize], strides: &[&[usize]]) -> usize {
    let mut rank = 0usize;
    let mut last: Vec<usize> = vec![0; strides.len()];
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        let mergeable = rank > 0
            && strides.iter().zip(&last).all(|(s, &l)| s[d].checked_mul(shape[d]) == Some(l));
        if !mergeable {
            rank += 1;
        }
        for (s, l) in strides.iter().zip(last.iter_mut()) {
            *l = s[d];
        }
    }
    rank.max(1)
}

/// Whether a strided problem over `shape` fits the kernels' merged-rank limit
/// (stride sets of another length are left to the kernel wrappers to reject).
fn rank_ok(shape: &[usize], strides: &[&[usize]]) -> bool {
    shape.contains(&0)
        || strides.iter().any(|s| s.len() != shape.len())
        || merged_rank(shape, strides) <= k_lay::MAX_RANK
}

fn fits_i32(vals: &[usize]) -> bool {
    vals.iter().all(|&v| v <= i32::MAX as usize)
}

/// An error unless `t` has dtype `want` (backward closures receive gradients
/// whose dtype the caller chose).
fn expect_dtype(op: &'static str, want: DType, t: &Tensor) -> Result<()> {
    if t.dtype() != want {
        return Err(TensorError::DTypeMismatch {
            op,
            expected: want.name().into(),
            got: t.dtype(),
        });
    }
    Ok(())
}

/// `a op b` with `a` and `b` read at broadcast strides `sa` / `sb` into a new
/// contiguous tensor of `out` (no autograd).
pub(crate) fn binary(
    a: &Tensor,
    sa: &[usize],
    b: &Tensor,
    sb: &[usize],
    op: BinaryOp,
    out: &Shape,
) -> Result<Option<Tensor>> {
    const OP: &str = "binary";
    let Some(cd) = cuda_dtype(a.dtype()) else { return Ok(None) };
    if b.dtype() != a.dtype() || !rank_ok(out.dims(), &[sa, sb]) {
        return Ok(None);
    }
    let dev = device_of(a, OP)?;
    let mut y = Out::new(&dev, out.clone(), a.dtype())?;
    with_gpu(OP, &[a, b], |s| {
        let (a, b) = (s[0].view(), s[1].view());
        Ok(k_ew::binary(&*dev, cd, op, a, sa, b, sb, out.dims(), y.view_mut())?)
    })?;
    Ok(Some(y.into_tensor()))
}

/// `x op s` (`s op x` when `scalar_first`) into a new tensor (no autograd).
pub(crate) fn scalar(
    x: &Tensor,
    op: BinaryOp,
    s: f64,
    scalar_first: bool,
) -> Result<Option<Tensor>> {
    const OP: &str = "scalar";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, x.shape().clone(), x.dtype())?;
    with_gpu(OP, &[x], |xs| {
        let (xv, yv) = (xs[0].view(), y.view_mut());
        Ok(k_ew::scalar(&*dev, cd, op, xv, s, scalar_first, yv, x.numel())?)
    })?;
    Ok(Some(y.into_tensor()))
}

/// `op(x)` into a new tensor (no autograd).
pub(crate) fn unary(x: &Tensor, op: UnaryOp) -> Result<Option<Tensor>> {
    const OP: &str = "unary";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, x.shape().clone(), x.dtype())?;
    with_gpu(OP, &[x], |s| Ok(k_ew::unary(&*dev, cd, op, s[0].view(), y.view_mut(), x.numel())?))?;
    Ok(Some(y.into_tensor()))
}

/// The input gradient `g * op'(x)` of `y = op(x)`.
pub(crate) fn unary_backward(
    x: &Tensor,
    y: &Tensor,
    g: &Tensor,
    op: UnaryOp,
) -> Result<Option<Tensor>> {
    const OP: &str = "unary_backward";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    if y.dtype() != x.dtype() || g.dtype() != x.dtype() || g.shape() != x.shape() {
        return Ok(None);
    }
    let dev = device_of(x, OP)?;
    let mut dx = Out::new(&dev, x.shape().clone(), x.dtype())?;
    with_gpu(OP, &[x, y, g], |s| {
        let (xv, yv, gv) = (s[0].view(), s[1].view(), s[2].view());
        Ok(k_ew::unary_backward(&*dev, cd, op, xv, yv, gv, dx.view_mut(), x.numel())?)
    })?;
    Ok(Some(dx.into_tensor()))
}

/// `t` as `[rows, last dim]` (a scalar as `[1, 1]`, an empty tensor as `[0, 1]`).
fn rows_cols(t: &Tensor) -> (usize, usize) {
    let cols = t.dims().last().copied().unwrap_or(1).max(1);
    (t.numel() / cols, cols)
}

/// `silu(a) * b` (same shapes and dtype) on the device.
pub(crate) fn silu_mul(a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    const OP: &str = "silu_mul";
    let Some(cd) = cuda_dtype(a.dtype()) else { return Ok(None) };
    let dev = device_of(a, OP)?;
    let (rows, cols) = rows_cols(a);
    let mut y = Out::new(&dev, a.shape().clone(), a.dtype())?;
    with_gpu(OP, &[a, b], |s| {
        let (av, bv) = (s[0].view(), s[1].view());
        Ok(k_ew::swiglu_forward(&*dev, cd, av, bv, cols, y.view_mut(), rows, cols)?)
    })?;
    Ok(Some(y.into_tensor()))
}

/// The gradients `(da, db)` of `silu(a) * b` for the output gradient `g`.
pub(crate) fn silu_mul_backward(
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    const OP: &str = "silu_mul_backward";
    let Some(cd) = cuda_dtype(a.dtype()) else { return Ok(None) };
    if b.dtype() != a.dtype() || g.dtype() != a.dtype() || g.shape() != a.shape() {
        return Ok(None);
    }
    let dev = device_of(a, OP)?;
    let (rows, cols) = rows_cols(a);
    let mut da = Out::new(&dev, a.shape().clone(), a.dtype())?;
    let mut db = Out::new(&dev, a.shape().clone(), a.dtype())?;
    with_gpu(OP, &[a, b, g], |s| {
        let (av, bv, gv) = (s[0].view(), s[1].view(), s[2].view());
        let (dav, dbv) = (da.view_mut(), db.view_mut());
        Ok(k_ew::swiglu_backward(&*dev, cd, av, bv, cols, gv, dav, dbv, rows, cols)?)
    })?;
    Ok(Some((da.into_tensor(), db.into_tensor())))
}

/// `silu(gate) * up` of a packed `[..., 2 i]` gate/up tensor on the device (see
/// [`Tensor::swiglu`]); `None` for a dtype without kernels.
pub(crate) fn swiglu_packed(x: &Tensor) -> Result<Option<Tensor>> {
    const OP: &str = "swiglu";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let dev = device_of(x, OP)?;
    let (rows, width) = rows_cols(x);
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = width / 2;
    }
    let mut y = Out::new(&dev, dims, x.dtype())?;
    with_gpu(OP, &[x], |s| {
        let out = k_ew::SwigluPackedOut::Forward(y.view_mut());
        Ok(k_ew::swiglu_packed(&*dev, cd, s[0].view(), out, rows, width / 2)?)
    })?;
    Ok(Some(y.into_tensor()))
}

/// The gradient `[..., 2 i]` of [`swiglu_packed`] for the output gradient `g`, both halves
/// written into one tensor.
pub(crate) fn swiglu_packed_backward(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu_backward";
    let cd = cuda_dtype(x.dtype())
        .ok_or_else(|| super::invalid(OP, format!("no device kernel for {}", x.dtype())))?;
    let (rows, width) = rows_cols(x);
    if g.dtype() != x.dtype() || g.numel() != rows * (width / 2) {
        return Err(TensorError::ShapeMismatch {
            op: OP,
            lhs: x.shape().clone(),
            rhs: g.shape().clone(),
            why: "the output gradient must be [..., i] of the input's dtype".into(),
        });
    }
    let dev = device_of(x, OP)?;
    let mut dx = Out::new(&dev, x.shape().clone(), x.dtype())?;
    with_gpu(OP, &[x, g], |s| {
        let out = k_ew::SwigluPackedOut::Backward { dy: s[1].view(), dx: dx.view_mut() };
        Ok(k_ew::swiglu_packed(&*dev, cd, s[0].view(), out, rows, width / 2)?)
    })?;
    Ok(dx.into_tensor())
}

/// `x` converted to `to` (float to float, or i64 to float; no autograd).
pub(crate) fn cast(x: &Tensor, to: DType) -> Result<Option<Tensor>> {
    const OP: &str = "to_dtype";
    let Some(cto) = cuda_dtype(to) else { return Ok(None) };
    let from = match (x.dtype(), cuda_dtype(x.dtype())) {
        (DType::I64, _) => None,
        (_, Some(cf)) => Some(cf),
        _ => return Ok(None),
    };
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, x.shape().clone(), to)?;
    let n = x.numel();
    with_gpu(OP, &[x], |s| {
        let (xv, yv) = (s[0].view(), y.view_mut());
        match from {
            Some(cfrom) => k_ew::cast(&*dev, cfrom, xv, cto, yv, n)?,
            None => k_ew::cast_i64(&*dev, xv, cto, yv, n)?,
        }
        Ok(())
    })?;
    Ok(Some(y.into_tensor()))
}

/// `dst[i] = x[base + sum(idx[d] * strides[d])]` into a new contiguous tensor
/// of `shape` (permute, expand, narrow; any dtype; no autograd).
pub(crate) fn strided(
    x: &Tensor,
    base: usize,
    strides: &[usize],
    shape: &Shape,
) -> Result<Option<Tensor>> {
    const OP: &str = "strided_copy";
    if !rank_ok(shape.dims(), &[strides]) {
        return Ok(None);
    }
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, shape.clone(), x.dtype())?;
    let es = x.dtype().size_in_bytes();
    with_gpu(OP, &[x], |s| {
        let (xv, yv) = (s[0].view(), y.view_mut());
        Ok(k_lay::strided_copy(&*dev, es, xv, base, strides, shape.dims(), yv)?)
    })?;
    Ok(Some(y.into_tensor()))
}

/// Concatenation of same-dtype pieces along a dim, the output viewed as
/// `[outer, sum(sizes), inner]` of shape `out` (any dtype; no autograd).
pub(crate) fn cat(
    pieces: &[Tensor],
    sizes: &[usize],
    outer: usize,
    inner: usize,
    out: &Shape,
) -> Result<Option<Tensor>> {
    const OP: &str = "cat";
    let Some(first) = pieces.first() else { return Ok(None) };
    let dev = device_of(first, OP)?;
    let mut y = Out::new(&dev, out.clone(), first.dtype())?;
    let ts: Vec<&Tensor> = pieces.iter().collect();
    with_gpu(OP, &ts, |s| {
        let views: Vec<_> = s.iter().map(|p| p.view()).zip(sizes.iter().copied()).collect();
        let es = first.dtype().size_in_bytes();
        Ok(k_lay::cat(&*dev, es, &views, outer, inner, y.view_mut())?)
    })?;
    Ok(Some(y.into_tensor()))
}

/// The pieces of a CUDA tensor split along a dim, the input viewed as
/// `[outer, sum(sizes), inner]`, each a new contiguous tensor, all copied in
/// one launch (per 32 pieces); `None` when `x` is not a CUDA tensor. No
/// autograd.
pub(crate) fn split(
    x: &Tensor,
    sizes: &[usize],
    outer: usize,
    inner: usize,
    dim: usize,
) -> Result<Option<Vec<Tensor>>> {
    const OP: &str = "split";
    if !matches!(x.device(), Device::Cuda(_)) {
        return Ok(None);
    }
    let dev = device_of(x, OP)?;
    let mut outs = sizes
        .iter()
        .map(|&n| {
            let mut dims = x.dims().to_vec();
            dims[dim] = n;
            Out::new(&dev, Shape::from(dims), x.dtype())
        })
        .collect::<Result<Vec<Out>>>()?;
    with_gpu(OP, &[x], |s| {
        let mut views: Vec<_> = outs.iter_mut().map(Out::view_mut).collect();
        let es = x.dtype().size_in_bytes();
        Ok(k_lay::split(&*dev, es, s[0].view(), outer, sizes, inner, &mut views)?)
    })?;
    Ok(Some(outs.into_iter().map(Out::into_tensor).collect()))
}

/// A device copy of `x`'s data in new storage (no autograd).
pub(crate) fn deep_clone(x: &Tensor) -> Result<Tensor> {
    let data = x.with_gpu_storage("clone", |s| s.duplicate())?;
    Ok(Tensor::make(x.shape().clone(), x.dtype(), x.device(), Storage::Gpu(data)))
}

/// Rows of `x` (dim 0, any dtype) picked by the i64 `index`, which may live on
/// the host (checked there, then uploaded) or on `x`'s device (checked by the
/// kernel, which reports the first bad position; reading that one flag back
/// is the only transfer). `None` for an index elsewhere.
pub(crate) fn index_select0(x: &Tensor, index: &Tensor) -> Result<Option<Tensor>> {
    const OP: &str = "index_select";
    if index.dtype() != DType::I64 || x.rank() == 0 {
        return Ok(None);
    }
    let rows = x.dims()[0];
    let inner: usize = x.dims()[1..].iter().product();
    // 8-byte elements travel as pairs of f32 words: the lookup kernel only moves values.
    let (cd, dim) = match cuda_dtype(x.dtype()) {
        Some(cd) => (cd, inner),
        None => (CudaDType::F32, inner.saturating_mul(x.dtype().size_in_bytes() / 4)),
    };
    let n = index.numel();
    if !fits_i32(&[rows, dim, n]) || n.checked_mul(dim).is_none() {
        return Ok(None);
    }
    let bad_index = |p: usize, bad: i64| {
        invalid(OP, format!("index {bad} at position {p} out of range for {rows} rows"))
    };
    // On the host the ids are checked before the launch; on the device the
    // kernel lowers an error slot to the first bad position.
    let (ids, on_device) = match index.device() {
        Device::Cpu => {
            let host = index.to_vec::<i64>()?;
            if let Some((p, &bad)) =
                host.iter().enumerate().find(|(_, &i)| i < 0 || i as usize >= rows)
            {
                return Err(bad_index(p, bad));
            }
            (index.to_device(x.device())?, false)
        }
        d if d == x.device() => (index.clone(), true),
        _ => return Ok(None),
    };
    let dev = device_of(x, OP)?;
    let mut od = vec![n];
    od.extend_from_slice(&x.dims()[1..]);
    let mut y = Out::new(&dev, od, x.dtype())?;
    let mut slot = if on_device && !dev.is_capturing() {
        // Inside a graph capture no status can be read back: ids out of range read
        // as masked (zero rows) on every replay.
        Some(DeviceBuffer::from_host(&dev, &[k_emb::NO_ERROR])?)
    } else {
        None
    };
    with_gpu(OP, &[x, &ids], |s| {
        let (xv, iv, err) = (s[0].view(), s[1].view(), slot.as_mut().map(|b| b.as_slice_mut()));
        Ok(k_emb::embedding_forward(&*dev, cd, xv, rows, dim, iv, n, 0, false, y.view_mut(), err)?)
    })?;
    if let Some(slot) = slot {
        let mut first = [0i32];
        slot.as_slice().copy_to_host(&mut first)?;
        match first[0] {
            k_emb::NO_ERROR => {}
            p if p >= 0 && (p as usize) < n => {
                let p = p as usize;
                let mut bad = [0i64];
                with_gpu(OP, &[&ids], |s| {
                    Ok(s[0].view().slice(p * 8..p * 8 + 8)?.copy_to_host(&mut bad)?)
                })?;
                return Err(bad_index(p, bad[0]));
            }
            _ => return Err(invalid(OP, format!("an index out of range for {rows} rows"))),
        }
    }
    Ok(Some(y.into_tensor()))
}

/// Reduces `x` (viewed as `[outer, len, inner]`) over its middle dim into a
/// new tensor of `out` (no autograd).
fn reduce_raw(
    x: &Tensor,
    op: Reduction,
    outer: usize,
    len: usize,
    inner: usize,
    out: &Shape,
) -> Result<Option<Tensor>> {
    const OP: &str = "reduce";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    if !fits_i32(&[outer, len, inner]) {
        return Ok(None);
    }
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, out.clone(), x.dtype())?;
    let wl = k_red::reduce_workspace_len(outer, len, inner);
    let mut work = if wl > 0 { Some(Out::new(&dev, [wl], DType::F32)?) } else { None };
    with_gpu(OP, &[x], |s| {
        let (xv, yv, wv) = (s[0].view(), y.view_mut(), work.as_mut().map(Out::view_mut));
        Ok(k_red::reduce(&*dev, op, cd, xv, yv, outer, len, inner, wv)?)
    })?;
    Ok(Some(y.into_tensor()))
}

/// Reduces `x` over the sorted, distinct dims `ds`, keeping them as size 1
/// (no autograd). Runs of neighbouring dims reduce in one launch.
pub(crate) fn reduce_dims(x: &Tensor, op: Reduction, ds: &[usize]) -> Result<Option<Tensor>> {
    if cuda_dtype(x.dtype()).is_none() {
        return Ok(None);
    }
    let mut dims = x.dims().to_vec();
    let mut t = x.clone();
    let mut i = ds.len();
    while i > 0 {
        let end = ds[i - 1];
        let mut start = end;
        i -= 1;
        while i > 0 && ds[i - 1] + 1 == start {
            start -= 1;
            i -= 1;
        }
        let outer: usize = dims[..start].iter().product();
        let len: usize = dims[start..=end].iter().product();
        let inner: usize = dims[end + 1..].iter().product();
        dims[start..=end].iter_mut().for_each(|d| *d = 1);
        match reduce_raw(&t, op, outer, len, inner, &Shape::from(dims.clone()))? {
            Some(r) => t = r,
            None => return Ok(None),
        }
    }
    Ok(Some(t))
}

/// Max of `x` over the middle dim of `[outer, len, inner]` and the i64 index
/// of the first max, both of shape `out` (no autograd).
pub(crate) fn max_dim(
    x: &Tensor,
    outer: usize,
    len: usize,
    inner: usize,
    out: &Shape,
) -> Result<Option<(Tensor, Tensor)>> {
    const OP: &str = "max";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    if len == 0 || !fits_i32(&[outer, len, inner]) {
        return Ok(None);
    }
    let dev = device_of(x, OP)?;
    let mut v = Out::new(&dev, out.clone(), x.dtype())?;
    let mut ix = Out::new(&dev, out.clone(), DType::I64)?;
    with_gpu(OP, &[x], |s| {
        let (xv, vv, iv) = (s[0].view(), v.view_mut(), ix.view_mut());
        Ok(k_red::max_with_index(&*dev, cd, xv, vv, iv, outer, len, inner)?)
    })?;
    Ok(Some((v.into_tensor(), ix.into_tensor())))
}

/// The gradient of [`max_dim`]: `g` (`[outer, inner]`) placed at the max
/// index of each reduced line of an `in_shape` (`[outer, len, inner]`) zero
/// tensor. Built from a one-hot lookup: rows of an identity table picked by
/// the indices, times `g`. `None` when that table would be too large (more
/// than 2048 reduced elements). Unlike the host scatter, a non-finite entry
/// of `g` also turns the other positions of its line into NaN (`0 * inf`).
pub(crate) fn max_backward(
    g: &Tensor,
    idx: &Tensor,
    outer: usize,
    len: usize,
    inner: usize,
    in_shape: &Shape,
) -> Result<Option<Tensor>> {
    const OP: &str = "max_backward";
    let Some(cd) = cuda_dtype(g.dtype()) else { return Ok(None) };
    let n = outer.saturating_mul(inner);
    let eye_len = len.saturating_mul(len + 1);
    if idx.dtype() != DType::I64
        || g.numel() != n
        || idx.numel() != n
        || eye_len > MAX_EYE_ELEMS
        || !fits_i32(&[n, len])
        || n.checked_mul(len).is_none()
    {
        return Ok(None);
    }
    let dtype = g.dtype();
    let dev = device_of(g, OP)?;
    let es = dtype.size_in_bytes();
    // The pattern [1, 0, ..., 0] of len + 1 elements repeated len times: its
    // first len * len elements are the len x len identity.
    let mut pat = Out::zeros(&dev, [len + 1], dtype)?;
    let mut eye = Out::new(&dev, [eye_len], dtype)?;
    let mut onehot = Out::new(&dev, [n, len], dtype)?;
    let mut gx = Out::new(&dev, in_shape.clone(), dtype)?;
    k_ew::fill(&*dev, cd, pat.view_mut(), 1, 1.0)?;
    k_lay::strided_copy(&*dev, es, pat.view(), 0, &[0, 1], &[len, len + 1], eye.view_mut())?;
    with_gpu(OP, &[g, idx], |s| {
        let (gv, iv) = (s[0].view(), s[1].view());
        let (ev, ov) = (eye.view(), onehot.view_mut());
        k_emb::embedding_forward(&*dev, cd, ev, len, len, iv, n, 0, false, ov, None)?;
        let (so, sg) = ([inner * len, 1, len], [inner, 0, 1]);
        let (ov, shape) = (onehot.view(), [outer, len, inner]);
        Ok(k_ew::binary(&*dev, cd, BinaryOp::Mul, ov, &so, gv, &sg, &shape, gx.view_mut())?)
    })?;
    Ok(Some(gx.into_tensor()))
}

/// Softmax (or log-softmax) over rows of `cols`, recording a backward that
/// launches too.
pub(crate) fn softmax(x: &Tensor, rows: usize, cols: usize, log: bool) -> Result<Option<Tensor>> {
    let name = if log { "log_softmax" } else { "softmax" };
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let dev = device_of(x, name)?;
    let mut y = Out::new(&dev, x.shape().clone(), x.dtype())?;
    with_gpu(name, &[x], |s| {
        Ok(k_ew::softmax_forward(&*dev, cd, s[0].view(), y.view_mut(), rows, cols, log)?)
    })?;
    let y = y.into_tensor();
    let ys = y.detach();
    Ok(Some(record(name, &[x], y, move |g| {
        expect_dtype(name, ys.dtype(), g)?;
        let dev = device_of(g, name)?;
        let mut dx = Out::new(&dev, ys.shape().clone(), ys.dtype())?;
        with_gpu(name, &[&ys, g], |s| {
            let (yv, gv) = (s[0].view(), s[1].view());
            Ok(k_ew::softmax_backward(&*dev, cd, yv, gv, dx.view_mut(), rows, cols, log)?)
        })?;
        Ok(vec![Some(dx.into_tensor())])
    })))
}

impl Tensor {
    /// A CUDA tensor of `shape` filled with `v` on the device: the fill kernel
    /// for f32/bf16/f16, one uploaded element broadcast by a strided copy for
    /// i64/f64.
    pub(crate) fn full_on_device(
        ordinal: usize,
        shape: Shape,
        v: f64,
        dtype: DType,
    ) -> Result<Tensor> {
        const OP: &str = "full";
        let dev = crate::gpu::device(ordinal)?;
        let n = shape.numel();
        let mut t = Out::new(&dev, shape, dtype)?;
        if n == 0 {
            return Ok(t.into_tensor());
        }
        match cuda_dtype(dtype) {
            Some(cd) => {
                // Rounded to the dtype on the host, so the kernel's f32 value is exact.
                let exact =
                    crate::with_any_type!(dtype, |T| { <T as Element>::from_f64(v).to_f64() });
                k_ew::fill(&*dev, cd, t.view_mut(), n, exact)?;
            }
            None => {
                let one = Tensor::scalar(v, dtype).to_device(Device::Cuda(ordinal))?;
                let es = dtype.size_in_bytes();
                with_gpu(OP, &[&one], |s| {
                    Ok(k_lay::strided_copy(&*dev, es, s[0].view(), 0, &[0], &[n], t.view_mut())?)
                })?;
            }
        }
        Ok(t.into_tensor())
    }
}

/// The dropout mask `mask` applied to `x`, the shard `runs` of the mask's tensor, into a
/// new tensor (no autograd); `None` when the dtype has no kernel or the shard has more
/// dims outside its runs than the kernel takes. With `graph` (drawn inside a CUDA graph
/// capture: the device state and the mask's offset past the capture's start), the kernel
/// reads the stream from the state when it runs.
pub(crate) fn dropout(
    x: &Tensor,
    mask: &DropoutMask,
    runs: &ShardRuns,
    graph: Option<&(Tensor, u64)>,
) -> Result<Option<Tensor>> {
    const OP: &str = "dropout";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    if runs.outer.len() > k_drop::MAX_RANK {
        return Ok(None);
    }
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, x.shape().clone(), x.dtype())?;
    match graph {
        None => with_gpu(OP, &[x], |v| {
            Ok(k_drop::dropout(&*dev, cd, mask, runs, v[0].view(), y.view_mut(), None)?)
        })?,
        Some((state, rel)) => {
            let mask = DropoutMask { offset: *rel, ..*mask };
            with_gpu(OP, &[x, state], |v| {
                let s = Some(v[1].view());
                Ok(k_drop::dropout(&*dev, cd, &mask, runs, v[0].view(), y.view_mut(), s)?)
            })?
        }
    }
    Ok(Some(y.into_tensor()))
}

#[cfg(test)]
mod tests {
    use super::merged_rank;

    #[test]
    fn merged_rank_joins_contiguous_dims_and_drops_ones() {
        assert_eq!(merged_rank(&[2, 3, 4], &[&[12, 4, 1], &[12, 4, 1]]), 1);
        assert_eq!(merged_rank(&[2, 3, 4], &[&[12, 4, 1], &[0, 0, 1]]), 2);
        assert_eq!(merged_rank(&[2, 1, 4], &[&[4, 4, 1]]), 1);
        assert_eq!(merged_rank(&[1, 1], &[&[1, 1]]), 1);
        assert_eq!(merged_rank(&[3, 4], &[&[1, 3]]), 2);
    }
}
