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

use std::sync::Arc;

use tpar_kernels::cuda::ops::{
    elementwise as k_ew, embedding as k_emb, layout as k_lay, reduce as k_red,
};
use tpar_kernels::cuda::{CudaDType, DevPtr, DeviceBuffer, GpuDevice};
use tpar_kernels::elementwise::{BinaryOp, UnaryOp};
use tpar_kernels::reduce::Reduction;

use super::gpu::{alloc, cuda_dtype, dev_ptr};
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

/// A new CUDA tensor of `shape` and `dtype` on `dev` (data uninitialized), and its address.
fn alloc_on(dev: &Arc<dyn GpuDevice>, shape: &Shape, dtype: DType) -> Result<(Tensor, DevPtr)> {
    let t = alloc(dev, shape.clone(), dtype)?;
    let (_, p) = dev_ptr(&t, "alloc")?;
    Ok((t, p))
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
    let (dev, ap) = dev_ptr(a, OP)?;
    let (_, bp) = dev_ptr(b, OP)?;
    let (y, yp) = alloc_on(&dev, out, a.dtype())?;
    // SAFETY: `a` and `b` hold their shapes' elements, which the broadcast
    // strides stay inside; `y` is a fresh allocation of `out`'s elements.
    unsafe { k_ew::binary(&*dev, cd, op, ap, sa, bp, sb, out.dims(), yp)? };
    Ok(Some(y))
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
    let (dev, xp) = dev_ptr(x, OP)?;
    let (y, yp) = alloc_on(&dev, x.shape(), x.dtype())?;
    // SAFETY: both buffers hold `x.numel()` elements of the dtype.
    unsafe { k_ew::scalar(&*dev, cd, op, xp, s, scalar_first, yp, x.numel())? };
    Ok(Some(y))
}

/// `op(x)` into a new tensor (no autograd).
pub(crate) fn unary(x: &Tensor, op: UnaryOp) -> Result<Option<Tensor>> {
    const OP: &str = "unary";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let (dev, xp) = dev_ptr(x, OP)?;
    let (y, yp) = alloc_on(&dev, x.shape(), x.dtype())?;
    // SAFETY: both buffers hold `x.numel()` elements of the dtype.
    unsafe { k_ew::unary(&*dev, cd, op, xp, yp, x.numel())? };
    Ok(Some(y))
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
    let (dev, xp) = dev_ptr(x, OP)?;
    let (_, yp) = dev_ptr(y, OP)?;
    let (_, gp) = dev_ptr(g, OP)?;
    let (dx, dxp) = alloc_on(&dev, x.shape(), x.dtype())?;
    // SAFETY: all four buffers hold `x.numel()` elements of the dtype.
    unsafe { k_ew::unary_backward(&*dev, cd, op, xp, yp, gp, dxp, x.numel())? };
    Ok(Some(dx))
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
    let (dev, xp) = dev_ptr(x, OP)?;
    let (y, yp) = alloc_on(&dev, x.shape(), to)?;
    let n = x.numel();
    // SAFETY: `x` holds `n` elements of its dtype, `y` `n` of `to`.
    unsafe {
        match from {
            Some(cfrom) => k_ew::cast(&*dev, cfrom, xp, cto, yp, n)?,
            None => k_ew::cast_i64(&*dev, xp, cto, yp, n)?,
        }
    };
    Ok(Some(y))
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
    let (dev, xp) = dev_ptr(x, OP)?;
    let (y, yp) = alloc_on(&dev, shape, x.dtype())?;
    let es = x.dtype().size_in_bytes();
    // SAFETY: the caller's strides and base address elements of `x` only (as
    // for the host copy); `y` holds `shape`'s elements.
    unsafe { k_lay::strided_copy(&*dev, es, xp, base, strides, shape.dims(), yp)? };
    Ok(Some(y))
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
    let mut ptrs = Vec::with_capacity(pieces.len());
    let mut dev = None;
    for (t, &len) in pieces.iter().zip(sizes) {
        let (d, p) = dev_ptr(t, OP)?;
        dev.get_or_insert(d);
        ptrs.push((p, len));
    }
    let Some(dev) = dev else { return Ok(None) };
    let (y, yp) = alloc_on(&dev, out, first.dtype())?;
    // SAFETY: each piece holds `outer * len * inner` elements, `y` the sum.
    unsafe { k_lay::cat(&*dev, first.dtype().size_in_bytes(), &ptrs, outer, inner, yp)? };
    Ok(Some(y))
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
    let (dev, xp) = dev_ptr(x, OP)?;
    let (_, ip) = dev_ptr(&ids, OP)?;
    let mut od = vec![n];
    od.extend_from_slice(&x.dims()[1..]);
    let (y, yp) = alloc_on(&dev, &Shape::from(od), x.dtype())?;
    let slot = if on_device {
        Some(DeviceBuffer::from_host(&dev, &k_emb::NO_ERROR.to_ne_bytes())?)
    } else {
        None
    };
    let sp = slot.as_ref().map_or(0, |s| s.ptr());
    // SAFETY: `x` holds `rows * dim` kernel elements, `ids` `n` i64 values,
    // `y` `n * dim` kernel elements; `sp` is a live 4-byte slot or 0.
    unsafe { k_emb::embedding_forward(&*dev, cd, xp, rows, dim, ip, n, 0, false, yp, sp)? };
    if let Some(slot) = slot {
        let b = slot.to_host()?;
        let first = b.get(..4).and_then(|w| <[u8; 4]>::try_from(w).ok()).map(i32::from_ne_bytes);
        match first {
            Some(k_emb::NO_ERROR) => {}
            Some(p) if p >= 0 && (p as usize) < n => {
                let p = p as usize;
                let mut bad = [0u8; 8];
                // SAFETY: `p < n`, so this is one i64 of `ids`.
                unsafe { dev.dtoh(ip + (p * 8) as u64, &mut bad)? };
                return Err(bad_index(p, i64::from_ne_bytes(bad)));
            }
            _ => return Err(invalid(OP, format!("an index out of range for {rows} rows"))),
        }
    }
    Ok(Some(y))
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
    let (dev, xp) = dev_ptr(x, OP)?;
    let (y, yp) = alloc_on(&dev, out, x.dtype())?;
    let wl = k_red::reduce_workspace_len(outer, len, inner);
    let work =
        if wl > 0 { Some(alloc_on(&dev, &Shape::from(vec![wl]), DType::F32)?) } else { None };
    let wp = work.as_ref().map_or(0, |w| w.1);
    // SAFETY: `x` holds `outer * len * inner` elements, `y` `outer * inner`,
    // the workspace `wl` f32 values; none overlap.
    unsafe { k_red::reduce(&*dev, op, cd, xp, yp, outer, len, inner, wp, wl)? };
    Ok(Some(y))
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
    let (dev, xp) = dev_ptr(x, OP)?;
    let (v, vp) = alloc_on(&dev, out, x.dtype())?;
    let (ix, ixp) = alloc_on(&dev, out, DType::I64)?;
    // SAFETY: `x` holds `outer * len * inner` elements, `v` and `ix` `outer * inner`.
    unsafe { k_red::max_with_index(&*dev, cd, xp, vp, ixp, outer, len, inner)? };
    Ok(Some((v, ix)))
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
    let (dev, gp) = dev_ptr(g, OP)?;
    let (_, ip) = dev_ptr(idx, OP)?;
    let es = dtype.size_in_bytes();
    // The pattern [1, 0, ..., 0] of len + 1 elements repeated len times: its
    // first len * len elements are the len x len identity.
    let pat = Tensor::zeros([len + 1], dtype, g.device())?;
    let (_, pp) = dev_ptr(&pat, OP)?;
    let (_eye, ep) = alloc_on(&dev, &Shape::from(vec![eye_len]), dtype)?;
    let (_onehot, op) = alloc_on(&dev, &Shape::from(vec![n, len]), dtype)?;
    let (gx, gxp) = alloc_on(&dev, in_shape, dtype)?;
    // SAFETY: `pat` holds len + 1 elements, `eye` len * (len + 1), `onehot`
    // n * len (rows picked by the in-range indices `idx` holds), `g` n and
    // `gx` outer * len * inner; the strides stay inside their buffers.
    unsafe {
        k_ew::fill(&*dev, cd, pp, 1, 1.0)?;
        k_lay::strided_copy(&*dev, es, pp, 0, &[0, 1], &[len, len + 1], ep)?;
        k_emb::embedding_forward(&*dev, cd, ep, len, len, ip, n, 0, false, op, 0)?;
        let (so, sg) = ([inner * len, 1, len], [inner, 0, 1]);
        k_ew::binary(&*dev, cd, BinaryOp::Mul, op, &so, gp, &sg, &[outer, len, inner], gxp)?;
    }
    Ok(Some(gx))
}

/// Softmax (or log-softmax) over rows of `cols`, recording a backward that
/// launches too.
pub(crate) fn softmax(x: &Tensor, rows: usize, cols: usize, log: bool) -> Result<Option<Tensor>> {
    let name = if log { "log_softmax" } else { "softmax" };
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let (dev, xp) = dev_ptr(x, name)?;
    let (y, yp) = alloc_on(&dev, x.shape(), x.dtype())?;
    // SAFETY: `x` and `y` hold `rows * cols` elements of the dtype.
    unsafe { k_ew::softmax_forward(&*dev, cd, xp, yp, rows, cols, log)? };
    let ys = y.detach();
    Ok(Some(record(name, &[x], y, move |g| {
        expect_dtype(name, ys.dtype(), g)?;
        let (dev, gp) = dev_ptr(g, name)?;
        let (_, yp) = dev_ptr(&ys, name)?;
        let (dx, dxp) = alloc_on(&dev, ys.shape(), ys.dtype())?;
        // SAFETY: `ys`, `g` (same shape, checked by autograd) and `dx` hold
        // `rows * cols` elements of the dtype.
        unsafe { k_ew::softmax_backward(&*dev, cd, yp, gp, dxp, rows, cols, log)? };
        Ok(vec![Some(dx)])
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
        let (t, p) = alloc_on(&dev, &shape, dtype)?;
        let n = shape.numel();
        if n == 0 {
            return Ok(t);
        }
        match cuda_dtype(dtype) {
            Some(cd) => {
                // Rounded to the dtype on the host, so the kernel's f32 value is exact.
                let exact =
                    crate::with_any_type!(dtype, |T| { <T as Element>::from_f64(v).to_f64() });
                // SAFETY: `t` holds `n` elements of the dtype.
                unsafe { k_ew::fill(&*dev, cd, p, n, exact)? };
            }
            None => {
                let one = Tensor::scalar(v, dtype).to_device(Device::Cuda(ordinal))?;
                let (_, op) = dev_ptr(&one, OP)?;
                // SAFETY: stride 0 reads the single element of `one`; `t` holds `n`.
                unsafe { k_lay::strided_copy(&*dev, dtype.size_in_bytes(), op, 0, &[0], &[n], p)? };
            }
        }
        Ok(t)
    }
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
