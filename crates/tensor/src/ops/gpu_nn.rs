//! Device implementations of the fused NN ops, the matrix products and the
//! optimizer updates for CUDA tensors (f32, bf16, f16).
//!
//! Every op here takes inputs already on `cuda:N`, allocates its outputs
//! there, launches the typed kernel wrappers of `tpar_kernels::cuda::ops`,
//! and records a backward that launches too: no tensor data crosses to the
//! host. Dtypes without CUDA kernels (f64) return `None` so the caller falls
//! back to the host.
//!
//! Index checks (token ids, class targets) run on the device and report
//! through a 4-byte status slot that is read back once per call: a
//! synchronization, so a bad id is an error naming it as on the CPU, but no
//! tensor data moves (it is not counted in [`crate::gpu::host_round_trips`]).
//! A thread that turns on [`crate::gpu::defer_index_checks`] reads nothing at the
//! op: the embedding and cross-entropy forwards launch their kernels with the slot
//! and record it, and [`crate::gpu::check_deferred_index_checks`] reads all the
//! recorded slots at once (one synchronization) and returns the error the first
//! of them would have returned. Until then, work after a bad id runs on it
//! masked. [`crate::Tensor::check_index_range`] defers as those ops do;
//! [`crate::Tensor::first_index_out_of_range`] always reads its answer back at once.
//! Inside a CUDA graph capture (see [`crate::gpu::capture_graph`]) nothing can be read
//! back: the ops are recorded without their status slot, and the kernels treat ids out
//! of range as masked ones (zero rows, rows left out of the loss) on every replay, so
//! a captured step's ids are checked before they are written into its inputs.

use std::sync::Arc;

use tpar_kernels::adamw::AdamWParams;
use tpar_kernels::cuda::ops::{
    adamw as k_adamw, cross_entropy as k_ce, elementwise as k_ew, embedding as k_emb,
    gemm as k_gemm, layout as k_layout, multi as k_multi, reduce as k_reduce, rope as k_rope,
    sdpa as k_sdpa,
};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, DeviceSlice, DeviceSliceMut, GpuDevice};
use tpar_kernels::elementwise::BinaryOp;
use tpar_kernels::gemm::GemmShape;
use tpar_kernels::reduce::Reduction;
use tpar_kernels::rope::RopeShape;
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::KernelError;

use super::gpu::{cuda_dtype, device_of, with_gpu, with_gpu_mut, Out};
use super::{common_device, invalid};
use crate::autograd::{needs_input_grad, record};
use crate::gpu::GpuStorage;
use crate::{DType, Device, Result, Shape, Tensor, TensorError};

/// The byte range of elements `start..start + len` of `elem`-byte elements.
fn elems(start: usize, len: usize, elem: usize) -> std::ops::Range<usize> {
    start * elem..(start + len) * elem
}

/// The device of `tensors` (at least one, all on one CUDA device).
fn multi_device(op: &'static str, tensors: &[&Tensor]) -> Result<Arc<dyn GpuDevice>> {
    let Some(first) = tensors.first() else {
        return Err(invalid(op, "no tensors given (their device is unknown)"));
    };
    let Device::Cuda(_) = common_device(op, tensors)? else {
        return Err(invalid(op, format!("for CUDA tensors only; got {}", first.device())));
    };
    device_of(first, op)
}

/// `tensors` cut into maximal runs of one kernel dtype: `(start, end, dtype)`.
fn dtype_runs(op: &'static str, tensors: &[&Tensor]) -> Result<Vec<(usize, usize, CudaDType)>> {
    let mut runs: Vec<(usize, usize, CudaDType)> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let cd = kernel_dtype(op, t)?;
        match runs.last_mut() {
            Some(r) if r.2 == cd => r.1 = i + 1,
            _ => runs.push((i, i + 1, cd)),
        }
    }
    Ok(runs)
}

/// The kernel dtype of a CUDA tensor, or a dtype error naming `op`.
fn kernel_dtype(op: &'static str, t: &Tensor) -> Result<CudaDType> {
    cuda_dtype(t.dtype()).ok_or_else(|| TensorError::DTypeMismatch {
        op,
        expected: "f32, bf16 or f16".into(),
        got: t.dtype(),
    })
}

/// The i32 status slot the index-checking kernels lower to the first bad
/// position (see the module docs); none inside a graph capture.
struct Status(Option<DeviceBuffer>);

impl Status {
    fn new(dev: &Arc<dyn GpuDevice>) -> Result<Status> {
        // Both kernel families use `i32::MAX` for "no error".
        debug_assert_eq!(k_ce::NO_ERROR, k_emb::NO_ERROR);
        if dev.is_capturing() {
            return Ok(Status(None));
        }
        Ok(Status(Some(DeviceBuffer::from_host(dev, &[k_ce::NO_ERROR])?)))
    }

    fn slot(&mut self) -> Option<DeviceSliceMut<'_>> {
        self.0.as_mut().map(DeviceBuffer::as_slice_mut)
    }

    /// Whether this status is recorded for [`check_deferred`] instead of read now:
    /// it has a slot and this thread defers its index checks.
    fn deferred(&self) -> bool {
        self.0.is_some() && index_checks_deferred()
    }

    /// Waits for the launches before it and returns the first bad position
    /// with the offending i64 value read from `indices` (`n` of them); `None` without
    /// a slot.
    fn check(&self, indices: DeviceSlice<'_>, n: usize) -> Result<Option<(usize, i64)>> {
        let Some(slot) = &self.0 else { return Ok(None) };
        let mut first = [0i32];
        slot.as_slice().copy_to_host(&mut first)?;
        first_bad(first[0], indices, n)
    }

    /// [`Status::check`], or `None` without reading anything when the status is
    /// deferred (then [`Status::finish`] records it).
    fn check_now(&self, indices: DeviceSlice<'_>, n: usize) -> Result<Option<(usize, i64)>> {
        if self.deferred() {
            return Ok(None);
        }
        self.check(indices, n)
    }

    /// Records a deferred status (see [`Status::deferred`]) with what reading it
    /// later needs: `op` and `size` for the error, a handle on the `n` `ids` for
    /// the offending value. Does nothing for a status read now or without a slot.
    fn finish(self, op: &'static str, ids: &Tensor, n: usize, size: usize) {
        if !self.deferred() {
            return;
        }
        if let Some(slot) = self.0 {
            let check = PendingCheck { op, slot, ids: ids.detach(), n, size };
            PENDING.with(|p| p.borrow_mut().push(check));
        }
    }
}

/// The first bad position a status slot holds (`first`), with its i64 value read
/// from `indices` (`n` of them), or `None` when the slot says "no error".
fn first_bad(first: i32, indices: DeviceSlice<'_>, n: usize) -> Result<Option<(usize, i64)>> {
    if first == k_ce::NO_ERROR || first < 0 || first as usize >= n {
        return Ok(None);
    }
    let position = first as usize;
    let mut value = [0i64];
    indices.slice(elems(position, 1, 8))?.copy_to_host(&mut value)?;
    Ok(Some((position, value[0])))
}

/// An index check recorded while deferred: the launch's status slot, and the op
/// name, ids and valid range its error needs.
struct PendingCheck {
    op: &'static str,
    slot: DeviceBuffer,
    ids: Tensor,
    n: usize,
    size: usize,
}

thread_local! {
    static DEFER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PENDING: std::cell::RefCell<Vec<PendingCheck>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Turns deferral of this thread's index checks on or off; returns the previous
/// setting. See [`crate::gpu::defer_index_checks`].
pub(crate) fn defer_index_checks(on: bool) -> bool {
    DEFER.with(|d| d.replace(on))
}

/// Whether this thread defers its index checks.
pub(crate) fn index_checks_deferred() -> bool {
    DEFER.with(|d| d.get())
}

/// How many deferred index checks this thread holds.
pub(crate) fn pending_index_checks() -> usize {
    PENDING.with(|p| p.borrow().len())
}

/// Reads every deferred index check of this thread and clears them: the slots
/// of each device are gathered into one buffer on it (device-to-device copies, no
/// kernel)
/// and read back at once, so one device synchronization per device. The first
/// check, in launch order, that found a bad id gives its `IndexOutOfRange` error,
/// as the immediate check would have (its offending value is read then).
pub(crate) fn check_deferred() -> Result<()> {
    const OP: &str = "check_deferred_index_checks";
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let mut firsts = vec![k_ce::NO_ERROR; pending.len()];
    let mut read = vec![false; pending.len()];
    for i in 0..pending.len() {
        if read[i] {
            continue;
        }
        let dev = pending[i].slot.device().clone();
        let group: Vec<usize> = (i..pending.len())
            .filter(|&j| !read[j] && Arc::ptr_eq(pending[j].slot.device(), &dev))
            .collect();
        let mut values = vec![k_ce::NO_ERROR; group.len()];
        if let [only] = group[..] {
            pending[only].slot.as_slice().copy_to_host(&mut values)?;
        } else {
            let mut gather = DeviceBuffer::from_host(&dev, &values)?;
            for (k, &j) in group.iter().enumerate() {
                gather.slice_mut(elems(k, 1, 4))?.copy_from(pending[j].slot.as_slice())?;
            }
            gather.as_slice().copy_to_host(&mut values)?;
        }
        for (&j, v) in group.iter().zip(values) {
            firsts[j] = v;
            read[j] = true;
        }
    }
    for (p, first) in pending.iter().zip(firsts) {
        if first == k_ce::NO_ERROR {
            continue;
        }
        let bad = with_gpu(OP, &[&p.ids], |v| first_bad(first, v[0].view(), p.n))?;
        out_of_range(p.op, bad, p.size)?;
    }
    Ok(())
}

/// The error for the first bad index a kernel's [`Status`] found (`(position, value)`),
/// against `size` valid values.
fn out_of_range(op: &'static str, bad: Option<(usize, i64)>, size: usize) -> Result<()> {
    match bad {
        Some((position, index)) => {
            Err(KernelError::IndexOutOfRange { op, index, position, size }.into())
        }
        None => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------

/// Rotary embedding on the device; `None` when the dtype has no kernel.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, s: RopeShape) -> Result<Option<Tensor>> {
    const OP: &str = "rope";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let dev = device_of(x, OP)?;
    let mut y = Out::new(&dev, x.shape().clone(), x.dtype())?;
    with_gpu(OP, &[x, cos, sin], |v| {
        let (xv, cv, sv) = (v[0].view(), v[1].view(), v[2].view());
        Ok(k_rope::rope_forward(&*dev, cd, &s, xv, cv, sv, y.view_mut())?)
    })?;
    let (c, sn) = (cos.detach(), sin.detach());
    Ok(Some(record(OP, &[x], y.into_tensor(), move |g| {
        let dev = device_of(g, OP)?;
        let mut dx = Out::new(&dev, g.shape().clone(), g.dtype())?;
        with_gpu(OP, &[g, &c, &sn], |v| {
            let (gv, cv, sv) = (v[0].view(), v[1].view(), v[2].view());
            Ok(k_rope::rope_backward(&*dev, cd, &s, gv, cv, sv, dx.view_mut())?)
        })?;
        Ok(vec![Some(dx.into_tensor())])
    })))
}

/// [`Tensor::rope_bshd_to_bhsd`] on the device: `x` `[b, s, h, d]` (`s` is `(b, s, h, d)`)
/// read in one pass into the rotated `[b, h, s, d]`; the backward pass reads the
/// gradient `[b, h, s, d]` and writes `[b, s, h, d]`. `None` when the dtype has no kernel.
pub(crate) fn rope_bshd_to_bhsd(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
) -> Result<Option<Tensor>> {
    const OP: &str = "rope";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let (seq_major, head_major) = (k_rope::RopeOrder::SeqInner, k_rope::RopeOrder::InnerSeq);
    let dev = device_of(x, OP)?;
    let heads_first = Shape::from([s.outer, s.inner, s.seq, s.head_dim]);
    let mut y = Out::new(&dev, heads_first, x.dtype())?;
    with_gpu(OP, &[x, cos, sin], |v| {
        let (xv, cv, sv) = (v[0].view(), v[1].view(), v[2].view());
        Ok(k_rope::rope_forward_orders(
            &*dev,
            cd,
            &s,
            xv,
            seq_major,
            cv,
            sv,
            y.view_mut(),
            head_major,
        )?)
    })?;
    let (c, sn) = (cos.detach(), sin.detach());
    let seq_first = x.shape().clone();
    Ok(Some(record(OP, &[x], y.into_tensor(), move |g| {
        let dev = device_of(g, OP)?;
        let mut dx = Out::new(&dev, seq_first.clone(), g.dtype())?;
        with_gpu(OP, &[g, &c, &sn], |v| {
            let (gv, cv, sv) = (v[0].view(), v[1].view(), v[2].view());
            Ok(k_rope::rope_backward_orders(
                &*dev,
                cd,
                &s,
                gv,
                head_major,
                cv,
                sv,
                dx.view_mut(),
                seq_major,
            )?)
        })?;
        Ok(vec![Some(dx.into_tensor())])
    })))
}

// ---------------------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------------------

/// Mean cross-entropy of logits `[rows, vocab]` against i64 targets on the
/// device; `None` when the dtype has no kernel.
///
/// One pass over the logits gives per-row losses and `lse`; the ignored-row
/// mask comes from the vocab-parallel loss step (`lse = 1`, `target_logit = 0`
/// make it write 1 per counted row), both are summed in one reduction, and
/// `total / max(count, 1)` is the loss (0 when every row is ignored). The
/// count stays on the device for the backward's scale.
pub(crate) fn cross_entropy(
    x: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Option<Tensor>> {
    const OP: &str = "cross_entropy";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let vocab = x.dims().last().copied().unwrap_or(1);
    let rows = targets.numel();
    let f32d = CudaDType::F32;
    let dev = device_of(x, OP)?;
    // [2, rows]: per-row losses, then 1 for each counted row.
    let mut parts = Out::new(&dev, [2, rows], DType::F32)?;
    let mut lse = Out::new(&dev, [rows], DType::F32)?;
    let mut status = Status::new(&dev)?;
    let bad = with_gpu(OP, &[x, targets], |v| {
        let (lv, tv) = (v[0].view(), v[1].view());
        let (loss_rows, _) = parts.view_mut().split_at(rows * 4)?;
        let (lsev, err) = (lse.view_mut(), status.slot());
        k_ce::cross_entropy_forward(
            &*dev,
            cd,
            lv,
            rows,
            vocab,
            tv,
            ignore_index,
            loss_rows,
            lsev,
            None,
            err,
        )?;
        status.check_now(tv, rows)
    })?;
    out_of_range("ce_local_stats", bad, vocab)?;
    status.finish("ce_local_stats", targets, rows, vocab);
    let mut ones = Out::new(&dev, [rows], DType::F32)?;
    let zero = Out::zeros(&dev, [rows], DType::F32)?;
    let mut sums = Out::new(&dev, [2], DType::F32)?;
    let ws_len = k_reduce::reduce_workspace_len(2, rows, 1);
    let mut ws = Out::new(&dev, [ws_len], DType::F32)?;
    let mut loss = Out::new(&dev, Shape::new(&[]), x.dtype())?;
    let mut loss32 = if cd == f32d { None } else { Some(Out::new(&dev, [1], DType::F32)?) };
    k_ew::fill(&*dev, f32d, ones.view_mut(), rows, 1.0)?;
    with_gpu(OP, &[targets], |v| {
        let (_, counted) = parts.view_mut().split_at(rows * 4)?;
        let (ov, zv) = (ones.view(), zero.view());
        Ok(k_ce::ce_loss(&*dev, ov, zv, v[0].view(), ignore_index, rows, counted, None)?)
    })?;
    let (pv, sv) = (parts.view(), sums.view_mut());
    k_reduce::reduce(&*dev, Reduction::Sum, f32d, pv, sv, 2, rows, 1, Some(ws.view_mut()))?;
    // max(count, 1): with no counted row the total is 0 and so is the loss.
    let count = sums.view_mut().slice_mut(elems(1, 1, 4))?;
    k_ew::scalar_in_place(&*dev, f32d, BinaryOp::Max, count, 1.0, false, 1)?;
    let (total, count) = (sums.view().slice(elems(0, 1, 4))?, sums.view().slice(elems(1, 1, 4))?);
    let div = BinaryOp::Div;
    match &mut loss32 {
        Some(l32) => {
            k_ew::binary(&*dev, f32d, div, total, &[1], count, &[1], &[1], l32.view_mut())?;
            k_ew::cast(&*dev, f32d, l32.view(), cd, loss.view_mut(), 1)?;
        }
        None => k_ew::binary(&*dev, f32d, div, total, &[1], count, &[1], &[1], loss.view_mut())?,
    }
    let (xs, ts) = (x.detach(), targets.detach());
    let (lse, sums) = (lse.into_tensor(), sums.into_tensor());
    Ok(Some(record(OP, &[x], loss.into_tensor(), move |g| {
        let dev = device_of(g, OP)?;
        let gcd = kernel_dtype(OP, g)?;
        let mut scale = Out::new(&dev, [2], DType::F32)?;
        let mut dl = Out::new(&dev, xs.shape().clone(), xs.dtype())?;
        // `scale` holds two f32: g, then g / count.
        with_gpu(OP, &[g, &xs, &ts, &lse, &sums], |v| {
            let (gv, lv, tv, lsev) = (v[0].view(), v[1].view(), v[2].view(), v[3].view());
            let count = v[4].view().slice(elems(1, 1, 4))?;
            let (mut s0, mut s1) = scale.view_mut().split_at(4)?;
            k_ew::cast(&*dev, gcd, gv, f32d, s0.reborrow(), 1)?;
            k_ew::binary(
                &*dev,
                f32d,
                BinaryOp::Div,
                s0.as_slice(),
                &[1],
                count,
                &[1],
                &[1],
                s1.reborrow(),
            )?;
            Ok(k_ce::cross_entropy_backward(
                &*dev,
                cd,
                lv,
                rows,
                vocab,
                tv,
                0,
                ignore_index,
                lsev,
                s1.as_slice(),
                1,
                dl.view_mut(),
            )?)
        })?;
        Ok(vec![Some(dl.into_tensor())])
    })))
}

/// The kernel dtype of CUDA logits, or an error naming `op` (host or f64 logits).
fn ce_device_dtype(op: &'static str, t: &Tensor) -> Result<CudaDType> {
    let Device::Cuda(_) = t.device() else {
        return Err(invalid(op, format!("for CUDA tensors only; got {}", t.device())));
    };
    kernel_dtype(op, t)
}

/// The common length of f32 CUDA vectors, or an error naming `op`.
fn ce_rows(op: &'static str, ts: &[&Tensor]) -> Result<usize> {
    let n = ts.first().map_or(0, |t| t.numel());
    for t in ts {
        let Device::Cuda(_) = t.device() else {
            return Err(invalid(op, format!("for CUDA tensors only; got {}", t.device())));
        };
        if t.dtype() != DType::F32 || t.numel() != n {
            return Err(invalid(op, format!("needs f32 vectors of {n} values, got {t:?}")));
        }
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------

/// Embedding lookup on the device; `None` when the dtype has no kernel.
///
/// The weight gradient sums each row's positions in position order in f32, as the CPU
/// kernel does (the same bits, every run), from a CSR of the ids that kernels build on
/// the device (`embedding_backward_sorted`: nothing is read back).
pub(crate) fn embedding(
    ids: &Tensor,
    weight: &Tensor,
    vocab_start: i64,
    masked: bool,
    out_shape: Shape,
) -> Result<Option<Tensor>> {
    const OP: &str = "embedding";
    let Some(cd) = cuda_dtype(weight.dtype()) else { return Ok(None) };
    let (vocab, dim) = (weight.dims()[0], weight.dims()[1]);
    let n = ids.numel();
    let dev = device_of(weight, OP)?;
    let mut out = Out::new(&dev, out_shape, weight.dtype())?;
    let mut status = if masked { None } else { Some(Status::new(&dev)?) };
    let bad = with_gpu(OP, &[weight, ids], |v| {
        let (wv, iv) = (v[0].view(), v[1].view());
        let err = status.as_mut().and_then(Status::slot);
        let ov = out.view_mut();
        k_emb::embedding_forward(&*dev, cd, wv, vocab, dim, iv, n, vocab_start, masked, ov, err)?;
        status.as_ref().map_or(Ok(None), |s| s.check_now(iv, n))
    })?;
    out_of_range("embedding_forward", bad, vocab)?;
    if let Some(status) = status {
        status.finish("embedding_forward", ids, n, vocab);
    }
    let ids_c = ids.detach();
    let wdt = weight.dtype();
    Ok(Some(record(OP, &[weight], out.into_tensor(), move |g| {
        if !needs_input_grad(0) {
            return Ok(vec![None]);
        }
        let dev = device_of(g, OP)?;
        let mut dw = Out::new(&dev, [vocab, dim], wdt)?;
        // Bad ids were reported by the forward; here they are skipped.
        with_gpu(OP, &[&ids_c, g], |v| {
            let (iv, gv) = (v[0].view(), v[1].view());
            Ok(k_emb::embedding_backward_sorted(
                &*dev,
                cd,
                iv,
                n,
                vocab_start,
                gv,
                vocab,
                dim,
                dw.view_mut(),
            )?)
        })?;
        Ok(vec![Some(dw.into_tensor())])
    })))
}

// ---------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------

/// Whether the flash kernels take attention of shape `s` (head dims within their limit,
/// batches and heads within a grid, lengths within 32-bit offsets).
pub(crate) fn sdpa_fits(s: &SdpaShape) -> bool {
    s.head_dim <= k_sdpa::MAX_HEAD_DIM
        && s.v_dim <= k_sdpa::MAX_HEAD_DIM
        && s.batch <= 65_535
        && s.q_heads <= 65_535
        && s.q_len <= i32::MAX as usize / 2
        && s.kv_len <= i32::MAX as usize / 2
}

/// Whether attention of `q` (and k, v of its device and dtype) with shape `s` runs on the
/// device's flash kernels: a CUDA tensor of a kernel dtype and sizes they take.
pub(crate) fn sdpa_on_device(q: &Tensor, s: &SdpaShape) -> bool {
    matches!(q.device(), Device::Cuda(_)) && cuda_dtype(q.dtype()).is_some() && sdpa_fits(s)
}

/// One operand of a strided attention call: a CUDA tensor's buffer and the element of it
/// where the operand's element `(0, 0, 0, 0)` lies (its strides are in the call's
/// [`k_sdpa::SdpaLayout`]).
pub(crate) type SdpaAt<'t> = (&'t Tensor, usize);

/// The view of `g` from element `at` on (elements of `es` bytes).
fn view_from(g: &GpuStorage, at: usize, es: usize) -> Result<DeviceSlice<'_>> {
    let v = g.view();
    Ok(v.slice(at * es..v.len())?)
}

/// The writable view of `o` from element `at` on (elements of `es` bytes).
pub(crate) fn out_from(o: &mut Out, at: usize, es: usize) -> Result<DeviceSliceMut<'_>> {
    let v = o.view_mut();
    let len = v.len();
    Ok(v.slice_mut(at * es..len)?)
}

/// The flash kernels' forward (see [`sdpa_on_device`]): `(out, lse)` with `out`
/// `[b, hq, sq, dv]` in q's dtype and `lse` the f32 natural-log log-sum-exp of each
/// query row `[b, hq, sq]` (`-inf` for a row with every key masked). `mask` is additive,
/// 4-d, broadcastable to `[b, hq, sq, sk]`, with its last dim `sk`. Not recorded.
pub(crate) fn sdpa_forward_device(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    s: &SdpaShape,
) -> Result<(Tensor, Tensor)> {
    let out = Shape::new(&[s.batch, s.q_heads, s.q_len, s.v_dim]);
    sdpa_forward_at([(q, 0), (k, 0), (v, 0)], mask, s, k_sdpa::SdpaLayout::default(), out)
}

/// [`sdpa_forward_device`] with q, k and v read where `qkv` and `layout` place them, and
/// `out` (a new tensor of `out_shape`, which holds the elements `layout.out` reaches)
/// written at `layout.out`. Not recorded.
pub(crate) fn sdpa_forward_at(
    qkv: [SdpaAt<'_>; 3],
    mask: Option<&Tensor>,
    s: &SdpaShape,
    layout: k_sdpa::SdpaLayout,
    out_shape: Shape,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "scaled_dot_product_attention";
    let [(q, qa), (k, ka), (v, va)] = qkv;
    let cd = kernel_dtype(OP, q)?;
    let es = cd.size();
    let dev = device_of(q, OP)?;
    let strides = mask_strides(mask, s);
    let mut out = Out::new(&dev, out_shape, q.dtype())?;
    let mut lse = Out::new(&dev, [s.batch, s.q_heads, s.q_len], DType::F32)?;
    let mut ins = vec![q, k, v];
    ins.extend(mask);
    with_gpu(OP, &ins, |b| {
        let views = k_sdpa::SdpaFwdViews {
            q: view_from(b[0], qa, es)?,
            k: view_from(b[1], ka, es)?,
            v: view_from(b[2], va, es)?,
            mask: mask_view(b.get(3).copied(), strides.as_deref()),
            out: out.view_mut(),
            lse: lse.view_mut(),
            layout,
        };
        Ok(k_sdpa::sdpa_forward(&*dev, cd, s, views, k_sdpa::SdpaPath::Auto)?)
    })?;
    Ok((out.into_tensor(), lse.into_tensor()))
}

/// The flash kernels' backward of [`sdpa_forward_device`]: `(dq, dk, dv)` from the
/// forward's `out` and f32 `lse` (or, for one key block of a longer attention, the
/// merged ones over every key) and the output's gradient `dout`. Not recorded.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sdpa_backward_device(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    s: &SdpaShape,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "scaled_dot_product_attention";
    let dev = device_of(dout, OP)?;
    let mut dq = Out::new(&dev, q.shape().clone(), q.dtype())?;
    let mut dk = Out::new(&dev, k.shape().clone(), k.dtype())?;
    let mut dv = Out::new(&dev, v.shape().clone(), v.dtype())?;
    let grads = GradsAt::Separate([(&mut dq, 0), (&mut dk, 0), (&mut dv, 0)]);
    let dense = k_sdpa::SdpaLayout::default();
    sdpa_backward_at([(q, 0), (k, 0), (v, 0)], mask, s, dense, [out, lse, dout], grads)?;
    Ok((dq.into_tensor(), dk.into_tensor(), dv.into_tensor()))
}

/// Where [`sdpa_backward_at`] writes dq, dk and dv (at q's, k's and v's strides in its
/// layout).
pub(crate) enum GradsAt<'o> {
    /// Each into its output from an element of it.
    Separate([(&'o mut Out, usize); 3]),
    /// All three into one output (a packed q/k/v gradient), from these elements.
    Packed(&'o mut Out, [usize; 3]),
}

/// [`sdpa_backward_device`] with q, k and v read where `qkv` and `layout` place them,
/// `out` and `dout` at `layout.out`, and dq, dk and dv written where `grads` says ([`GradsAt`])
/// at q's, k's and v's strides.
/// `[out, lse, dout]` are the forward's output and log-sum-exps and the output's
/// gradient. Not recorded.
pub(crate) fn sdpa_backward_at(
    qkv: [SdpaAt<'_>; 3],
    mask: Option<&Tensor>,
    s: &SdpaShape,
    layout: k_sdpa::SdpaLayout,
    [out, lse, dout]: [&Tensor; 3],
    grads: GradsAt<'_>,
) -> Result<()> {
    const OP: &str = "scaled_dot_product_attention";
    let [(q, qa), (k, ka), (v, va)] = qkv;
    let cd = kernel_dtype(OP, q)?;
    let es = cd.size();
    let dev = device_of(dout, OP)?;
    let strides = mask_strides(mask, s);
    let ws_bytes = k_sdpa::sdpa_backward_workspace_bytes(s)?;
    let mut ws = Out::new(&dev, [ws_bytes.div_ceil(4)], DType::F32)?;
    let mut ins = vec![q, k, v, out, lse, dout];
    ins.extend(mask);
    with_gpu(OP, &ins, |b| {
        let views = k_sdpa::SdpaBwdViews {
            q: view_from(b[0], qa, es)?,
            k: view_from(b[1], ka, es)?,
            v: view_from(b[2], va, es)?,
            mask: mask_view(b.get(6).copied(), strides.as_deref()),
            out: b[3].view(),
            lse: b[4].view(),
            dout: b[5].view(),
            grads: match grads {
                GradsAt::Separate([(dq, dqa), (dk, dka), (dv, dva)]) => {
                    k_sdpa::SdpaGrads::Separate {
                        dq: out_from(dq, dqa, es)?,
                        dk: out_from(dk, dka, es)?,
                        dv: out_from(dv, dva, es)?,
                    }
                }
                GradsAt::Packed(d, at) => k_sdpa::SdpaGrads::Packed { dqkv: d.view_mut(), at },
            },
            workspace: ws.view_mut(),
            layout,
        };
        Ok(k_sdpa::sdpa_backward(&*dev, cd, s, views, k_sdpa::SdpaPath::Auto)?)
    })
}

/// The caller's 4-d attention mask (broadcastable to `[batch, q_heads, q_len, kv_len]`,
/// its last dim `kv_len` or 1) as the kernels read it: detached, and materialized to
/// the full key length when broadcast over the keys (they read it with unit stride
/// along them); `None` for no mask or an empty call.
pub(crate) fn device_mask(
    mask: Option<&Tensor>,
    s: &SdpaShape,
    cd: CudaDType,
) -> Result<Option<Tensor>> {
    const OP: &str = "scaled_dot_product_attention";
    let full = Shape::new(&[s.batch, s.q_heads, s.q_len, s.kv_len]);
    match mask {
        Some(m) if m.numel() > 0 && full.numel() > 0 => {
            let md = m.dims();
            if md[3] == s.kv_len {
                return Ok(Some(m.detach()));
            }
            let dev = device_of(m, OP)?;
            let out = [md[0], md[1], md[2], s.kv_len];
            let mut e = Out::new(&dev, out, m.dtype())?;
            with_gpu(OP, &[m], |v| {
                Ok(k_layout::expand(&*dev, cd.size(), v[0].view(), md, &out, e.view_mut())?)
            })?;
            Ok(Some(e.into_tensor()))
        }
        _ => Ok(None),
    }
}

/// Flash attention on the device; `None` when the dtype or sizes have no
/// kernel (f64, head dims above the kernels' limit, more batches or heads
/// than a grid holds). `mask` is the caller's 4-d mask, broadcastable to
/// `[batch, q_heads, q_len, kv_len]`, whose last dim is `kv_len` or 1.
pub(crate) fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    s: &SdpaShape,
) -> Result<Option<Tensor>> {
    const OP: &str = "scaled_dot_product_attention";
    let Some(cd) = cuda_dtype(q.dtype()) else { return Ok(None) };
    if !sdpa_fits(s) {
        return Ok(None);
    }
    let s = *s;
    let mask = device_mask(mask, &s, cd)?;
    // A selective activation checkpoint may keep the output and its log-sum-exps
    // (crate::checkpoint).
    let (out, lse) = crate::checkpoint::kept(crate::checkpoint::SaveOp::Sdpa, &[q, k, v], || {
        sdpa_forward_device(q, k, v, mask.as_ref(), &s)
    })?;
    let (qq, kk, vv, oo) = (q.detach(), k.detach(), v.detach(), out.detach());
    Ok(Some(record(OP, &[q, k, v], out, move |g| {
        let (dq, dk, dv) = sdpa_backward_device(&qq, &kk, &vv, mask.as_ref(), &s, &oo, &lse, g)?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    })))
}

/// The attention mask's view: its data read at its broadcast strides over
/// `[batch, q_heads, q_len, kv_len]`.
/// The strides `mask` is read at, broadcast over the scores `[batch, q_heads, q_len,
/// kv_len]` of `s`.
fn mask_strides(mask: Option<&Tensor>, s: &SdpaShape) -> Option<Vec<usize>> {
    let full = Shape::new(&[s.batch, s.q_heads, s.q_len, s.kv_len]);
    mask.map(|m| crate::shape::broadcast_strides(m.shape(), &full))
}

fn mask_view<'a>(
    m: Option<&'a GpuStorage>,
    strides: Option<&[usize]>,
) -> Option<k_sdpa::SdpaMaskView<'a>> {
    let (m, st) = (m?, strides?);
    Some(k_sdpa::SdpaMaskView {
        data: m.view(),
        batch_stride: st[0],
        head_stride: st[1],
        row_stride: st[2],
    })
}

// ---------------------------------------------------------------------------------------
// Matrix products
// ---------------------------------------------------------------------------------------

/// `C[i] = op(A[i]) op(B[i])` for every batch of `s` into the contiguous
/// `[batch, m, n]` buffer `c`. Empty products write nothing, an empty
/// contraction writes zeros, and batches beyond one grid run in pieces.
fn gemm(
    dev: &Arc<dyn GpuDevice>,
    cd: CudaDType,
    s: GemmShape,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    mut c: DeviceSliceMut<'_>,
) -> Result<()> {
    let es = cd.size();
    let per_c = s.m * s.n;
    if s.batch == 0 || per_c == 0 {
        return Ok(());
    }
    if s.k == 0 {
        c.slice_mut(0..s.batch * per_c * es)?.zero()?;
        return Ok(());
    }
    let mut done = 0;
    while done < s.batch {
        let len = (s.batch - done).min(k_gemm::MAX_BATCH);
        let p = k_gemm::GemmProblem::new(GemmShape { batch: len, ..s }, cd, cd);
        // The piece starts `done` batches in.
        let a = a.slice(done * s.a_batch_stride * es..a.len())?;
        let b = b.slice(done * s.b_batch_stride * es..b.len())?;
        let cl = c.len();
        let c = c.reborrow().slice_mut(done * per_c * es..cl)?;
        k_gemm::gemm(&**dev, &p, a, b, c)?;
        done += len;
    }
    Ok(())
}

/// One matmul operand over the broadcast batch: its data (the tensor itself,
/// or a copy expanded to the full batch) and its batch stride.
struct Operand {
    data: Tensor,
    stride: usize,
    /// The gradient of the full batch must be summed back to the operand's shape.
    reduce: bool,
}

fn operand(
    dev: &Arc<dyn GpuDevice>,
    x: &Tensor,
    batch_dims: &[usize],
    batch: usize,
) -> Result<Operand> {
    const OP: &str = "matmul";
    let r = x.rank();
    let mat = x.dims()[r - 2] * x.dims()[r - 1];
    let own: usize = x.dims()[..r - 2].iter().product();
    if own == batch {
        return Ok(Operand { data: x.detach(), stride: mat, reduce: false });
    }
    if own == 1 {
        return Ok(Operand { data: x.detach(), stride: 0, reduce: true });
    }
    let mut full = batch_dims.to_vec();
    full.extend_from_slice(&x.dims()[r - 2..]);
    let mut e = Out::new(dev, full.clone(), x.dtype())?;
    let es = x.dtype().size_in_bytes();
    with_gpu(OP, &[x], |v| {
        Ok(k_layout::expand(&**dev, es, v[0].view(), x.dims(), &full, e.view_mut())?)
    })?;
    Ok(Operand { data: e.into_tensor(), stride: mat, reduce: true })
}

/// `op(a) x op(b)` on the device with numpy batch broadcasting, as
/// [`Tensor::matmul_t`]; `None` when the inputs are not CUDA tensors of one
/// kernel dtype or do not fit together (the caller reports why).
///
/// A batch broadcast over one operand reads it with stride 0; a rank-2 right
/// operand under an untransposed left one folds the batch into the rows (one
/// GEMM, also in the backward). The backward reads transposed operands in
/// place through the GEMM's layouts and sums broadcast gradients on the device.
pub(crate) fn matmul(a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<Option<Tensor>> {
    const OP: &str = "matmul";
    let (Device::Cuda(_), true) = (a.device(), a.device() == b.device()) else { return Ok(None) };
    let Some(cd) = cuda_dtype(a.dtype()) else { return Ok(None) };
    if b.dtype() != a.dtype() || a.rank() < 2 || b.rank() < 2 {
        return Ok(None);
    }
    let mat = |t: &Tensor, tr: bool| {
        let r = t.rank();
        let (x, y) = (t.dims()[r - 2], t.dims()[r - 1]);
        if tr {
            (y, x)
        } else {
            (x, y)
        }
    };
    let (m, k) = mat(a, ta);
    let (k2, n) = mat(b, tb);
    if k != k2 {
        return Ok(None);
    }
    let ba = Shape::new(&a.dims()[..a.rank() - 2]);
    let bb = Shape::new(&b.dims()[..b.rank() - 2]);
    let Ok(bd) = crate::shape::broadcast_shapes(OP, &ba, &bb) else { return Ok(None) };
    let bd = bd.dims().to_vec();
    let nb: usize = bd.iter().product();
    let dev = device_of(a, OP)?;
    let oa = operand(&dev, a, &bd, nb)?;
    let ob = operand(&dev, b, &bd, nb)?;
    // A batch-free right operand under an untransposed left one: fold the batch into rows.
    let fold = bb.numel() == 1 && !ta;
    let (batch, me) = if fold { (1, nb * m) } else { (nb, m) };
    let (sa, sb) = if fold { (0, 0) } else { (oa.stride, ob.stride) };
    let mut od = bd.clone();
    od.extend_from_slice(&[m, n]);
    let shape = GemmShape {
        batch,
        m: me,
        n,
        k,
        trans_a: ta,
        trans_b: tb,
        a_batch_stride: sa,
        b_batch_stride: sb,
    };
    // A selective activation checkpoint may keep this output (crate::checkpoint).
    let out = crate::checkpoint::kept(crate::checkpoint::SaveOp::Matmul, &[a, b], || {
        // Inside a recompute, a product whose output no backward reads is not computed.
        crate::checkpoint::product_unless_unread(&od, a.dtype(), a.device(), || {
            let mut out = Out::new(&dev, od.clone(), a.dtype())?;
            with_gpu(OP, &[&oa.data, &ob.data], |v| {
                gemm(&dev, cd, shape, v[0].view(), v[1].view(), out.view_mut())
            })?;
            Ok(out.into_tensor())
        })
    })?;
    let (a_in, b_in) = (a.clone(), b.clone());
    let (a_red, b_red) = (oa.reduce && !fold, ob.reduce && !fold);
    let (ad, bdat) = (oa.data, ob.data);
    Ok(Some(record(OP, &[a, b], out, move |g| {
        let dev = device_of(g, OP)?;
        let sg = me * n;
        let full_dims = |t: &Tensor| {
            let mut d = bd.clone();
            d.extend_from_slice(&t.dims()[t.rank() - 2..]);
            d
        };
        let ga = if a_in.requires_grad() && needs_input_grad(0) {
            let (s, x, y) = if !ta {
                // dA = G op(B)^T
                let s = GemmShape {
                    batch,
                    m: me,
                    n: k,
                    k: n,
                    trans_a: false,
                    trans_b: !tb,
                    a_batch_stride: sg,
                    b_batch_stride: sb,
                };
                (s, g, &bdat)
            } else {
                // A is stored [k, m]: dA = op(B) G^T
                let s = GemmShape {
                    batch,
                    m: k,
                    n: me,
                    k: n,
                    trans_a: tb,
                    trans_b: true,
                    a_batch_stride: sb,
                    b_batch_stride: sg,
                };
                (s, &bdat, g)
            };
            let dims = if a_red { full_dims(&a_in) } else { a_in.dims().to_vec() };
            let mut da = Out::new(&dev, dims, a_in.dtype())?;
            with_gpu(OP, &[x, y], |v| gemm(&dev, cd, s, v[0].view(), v[1].view(), da.view_mut()))?;
            let da = da.into_tensor();
            Some(if a_red { da.sum_to(a_in.shape())? } else { da })
        } else {
            None
        };
        let gb = if b_in.requires_grad() && needs_input_grad(1) {
            let (s, x, y) = if !tb {
                // dB = op(A)^T G
                let s = GemmShape {
                    batch,
                    m: k,
                    n,
                    k: me,
                    trans_a: !ta,
                    trans_b: false,
                    a_batch_stride: sa,
                    b_batch_stride: sg,
                };
                (s, &ad, g)
            } else {
                // B is stored [n, k]: dB = G^T op(A)
                let s = GemmShape {
                    batch,
                    m: n,
                    n: k,
                    k: me,
                    trans_a: true,
                    trans_b: ta,
                    a_batch_stride: sg,
                    b_batch_stride: sa,
                };
                (s, g, &ad)
            };
            let dims = if b_red { full_dims(&b_in) } else { b_in.dims().to_vec() };
            let mut db = Out::new(&dev, dims, b_in.dtype())?;
            with_gpu(OP, &[x, y], |v| gemm(&dev, cd, s, v[0].view(), v[1].view(), db.view_mut()))?;
            let db = db.into_tensor();
            Some(if b_red { db.sum_to(b_in.shape())? } else { db })
        } else {
            None
        };
        Ok(vec![ga, gb])
    })))
}

// ---------------------------------------------------------------------------------------
// Optimizer entry points
// ---------------------------------------------------------------------------------------

/// Checks that `ts` share `t0`'s CUDA device and element count.
fn same_layout(op: &'static str, t0: &Tensor, ts: &[&Tensor]) -> Result<Arc<dyn GpuDevice>> {
    let Device::Cuda(_) = t0.device() else {
        return Err(invalid(op, format!("for CUDA tensors only; this one is on {}", t0.device())));
    };
    let mut all = vec![t0];
    all.extend_from_slice(ts);
    common_device(op, &all)?;
    for t in ts {
        if t.numel() != t0.numel() {
            return Err(invalid(
                op,
                format!("{} elements for a parameter of {}", t.numel(), t0.numel()),
            ));
        }
        if t.same_storage(t0) {
            return Err(invalid(op, "the update's inputs must not share the parameter's storage"));
        }
    }
    device_of(t0, op)
}

fn require_f32(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(TensorError::DTypeMismatch {
            op,
            expected: "f32 state".into(),
            got: t.dtype(),
        });
    }
    Ok(())
}

impl Tensor {
    /// One fused AdamW step on this CUDA parameter, in place, for optimizers
    /// (`tpar_optim::AdamW` calls it for parameters on a CUDA device).
    ///
    /// The parameter is f32, bf16 or f16; `grad` has its dtype or is f32;
    /// `exp_avg` and `exp_avg_sq` are f32 moment buffers, updated in place.
    /// All live on the parameter's device with its element count, in storages
    /// of their own. `h.step` is the step being taken (1 for the first). The
    /// update is the CPU kernel's formula, element for element, so results
    /// agree to rounding. Not recorded by autograd.
    pub fn adamw_step_(
        &self,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
        h: &AdamWParams,
    ) -> Result<()> {
        const OP: &str = "adamw_step_";
        let dev = same_layout(OP, self, &[grad, exp_avg, exp_avg_sq])?;
        if exp_avg.same_storage(exp_avg_sq) {
            return Err(invalid(OP, "exp_avg and exp_avg_sq must be separate buffers"));
        }
        let cd = kernel_dtype(OP, self)?;
        let gd = kernel_dtype(OP, grad)?;
        require_f32(OP, exp_avg)?;
        require_f32(OP, exp_avg_sq)?;
        let n = self.numel();
        with_gpu_mut(OP, &[self, exp_avg, exp_avg_sq], &[grad], |w, r| {
            let [p, m, v] = w else { return Err(invalid(OP, "three updated buffers expected")) };
            let (pv, mv, vv) = (p.view_mut(), m.view_mut(), v.view_mut());
            Ok(k_adamw::adamw_step(&*dev, cd, gd, pv, r[0].view(), mv, vv, n, h)?)
        })
    }

    /// The CUDA half of [`Tensor::adamw_step_each_with_copies_`]:
    /// [`Tensor::adamw_step_`] on many CUDA parameters at once, all with the same
    /// hyper-parameters and step `h`: parameter `i` with `grads[i]`, `exp_avgs[i]`
    /// and `exp_avg_sqs[i]`, each under `adamw_step_`'s rules. One launch covers up to
    /// 32 parameters of one dtype whose gradients share a dtype, wherever they stand in
    /// the lists (PyTorch's foreach AdamW), with `adamw_step_`'s arithmetic per element,
    /// so the results are the same bits. `copies[i]`, when given, receives the updated
    /// parameter cast to its dtype: in the same launch for f32 parameters with f32
    /// gradients and bf16 or f16 copies, by a cast after the step otherwise. No buffer
    /// updated may share its storage with any other argument. Every argument is checked
    /// before any parameter changes. Not recorded by autograd.
    pub(crate) fn cuda_adamw_step_each_(
        params: &[&Tensor],
        grads: &[&Tensor],
        exp_avgs: &[&Tensor],
        exp_avg_sqs: &[&Tensor],
        copies: &[Option<&Tensor>],
        h: &AdamWParams,
        coef: Option<&Tensor>,
    ) -> Result<()> {
        const OP: &str = "adamw_step_each_";
        let n = super::optim::same_lengths(OP, params, grads, exp_avgs, exp_avg_sqs)?;
        if n == 0 {
            return Ok(());
        }
        if copies.len() != n {
            return Err(invalid(OP, format!("{} copy slots for {n} parameters", copies.len())));
        }
        let dev = multi_device(OP, params)?;
        if let Some(c) = coef {
            // The coefficients a capturable step reads: 8 f32 on the parameters' device.
            same_layout(OP, c, &[])?;
            if c.dtype() != DType::F32 || c.numel() != 8 || c.device() != params[0].device() {
                return Err(invalid(
                    OP,
                    format!(
                        "the coefficients are {} {} values on {}; 8 f32 values on {} expected",
                        c.numel(),
                        c.dtype().name(),
                        c.device(),
                        params[0].device()
                    ),
                ));
            }
        }
        // (parameter, gradient, fused copy) kernel dtypes of each parameter.
        let mut kinds = Vec::with_capacity(n);
        for i in 0..n {
            same_layout(OP, params[i], &[grads[i], exp_avgs[i], exp_avg_sqs[i]])?;
            require_f32(OP, exp_avgs[i])?;
            require_f32(OP, exp_avg_sqs[i])?;
            let (cd, gd) = (kernel_dtype(OP, params[i])?, kernel_dtype(OP, grads[i])?);
            let fused = match copies[i] {
                Some(c) if (cd, gd) == (CudaDType::F32, CudaDType::F32) => {
                    same_layout(OP, params[i], &[c])?;
                    cuda_dtype(c.dtype()).filter(|d| *d != CudaDType::F32)
                }
                _ => None,
            };
            kinds.push((cd, gd, fused));
        }
        // Every sharing is refused before the first launch.
        let mut writes: Vec<&Tensor> =
            params.iter().chain(exp_avgs).chain(exp_avg_sqs).copied().collect();
        writes.extend(copies.iter().flatten().copied());
        with_gpu_mut(OP, &writes, grads, |_, _| Ok(()))?;
        // The parameters by kind, in their order within each: one group of launches
        // per kind, however the kinds interleave.
        let mut kinds_seen: Vec<(CudaDType, CudaDType, Option<CudaDType>)> = Vec::new();
        for k in &kinds {
            if !kinds_seen.contains(k) {
                kinds_seen.push(*k);
            }
        }
        fn pick<'t>(ts: &[&'t Tensor], idx: &[usize]) -> Vec<&'t Tensor> {
            idx.iter().map(|&i| ts[i]).collect()
        }
        for (cd, gd, fused) in kinds_seen {
            let idx: Vec<usize> = (0..n).filter(|&i| kinds[i] == (cd, gd, fused)).collect();
            let (ps, gs) = (pick(params, &idx), pick(grads, &idx));
            let cs: Vec<&Tensor> = match fused {
                Some(_) => idx.iter().filter_map(|&i| copies[i]).collect(),
                None => Vec::new(),
            };
            let writes: Vec<&Tensor> = ps
                .iter()
                .copied()
                .chain(pick(exp_avgs, &idx))
                .chain(pick(exp_avg_sqs, &idx))
                .chain(cs.iter().copied())
                .collect();
            let k = idx.len();
            let mut reads = gs.clone();
            reads.extend(coef);
            with_gpu_mut(OP, &writes, &reads, |w, r| {
                let (p, rest) = w.split_at_mut(k);
                let (m, rest) = rest.split_at_mut(k);
                let (v, c) = rest.split_at_mut(k);
                let views: Vec<k_adamw::AdamwViews<'_>> = p
                    .iter_mut()
                    .zip(m.iter_mut())
                    .zip(v.iter_mut())
                    .zip(r)
                    .zip(&ps)
                    .map(|((((p, m), v), g), t)| k_adamw::AdamwViews {
                        param: p.view_mut(),
                        grad: g.view(),
                        exp_avg: m.view_mut(),
                        exp_avg_sq: v.view_mut(),
                        n: t.numel(),
                    })
                    .collect();
                match (coef.is_some(), fused) {
                    (true, fused) => {
                        let copies: Vec<Option<DeviceSliceMut<'_>>> =
                            c.iter_mut().map(|c| Some(c.view_mut())).collect();
                        let copies = fused.map(|wd| (wd, copies.as_slice()));
                        let cv = r[k].view();
                        let d = &*dev;
                        Ok(k_adamw::adamw_step_each_device_coef(d, cd, gd, &views, copies, cv)?)
                    }
                    (false, Some(wd)) => {
                        let copies: Vec<Option<DeviceSliceMut<'_>>> =
                            c.iter_mut().map(|c| Some(c.view_mut())).collect();
                        Ok(k_adamw::adamw_step_each_with_copies(&*dev, wd, &views, &copies, h)?)
                    }
                    (false, None) => Ok(k_adamw::adamw_step_each(&*dev, cd, gd, &views, h)?),
                }
            })?;
        }
        // Copies no fused kernel writes: a cast of the updated parameter.
        for i in 0..n {
            if let (Some(c), None) = (copies[i], kinds[i].2) {
                crate::no_grad(|| c.copy_(params[i]))?;
            }
        }
        Ok(())
    }

    /// The CUDA half of [`Tensor::sgd_step_`]: one SGD step on this CUDA
    /// parameter, in place, as `torch.optim.SGD`:
    ///
    /// ```text
    /// d = grad + weight_decay * p
    /// b = d on the first step, else momentum * b + (1 - dampening) * d   (with momentum)
    /// d = d + momentum * b if nesterov, else b                           (with momentum)
    /// p = p - lr * d
    /// ```
    ///
    /// computed in f32. `grad` has the parameter's dtype or is f32;
    /// `momentum_buffer` is an f32 buffer of the parameter's size, updated in
    /// place (`None` without momentum). Not recorded by autograd.
    pub(crate) fn cuda_sgd_step_(
        &self,
        grad: &Tensor,
        momentum_buffer: Option<&Tensor>,
        h: &super::optim::SgdParams,
    ) -> Result<()> {
        const OP: &str = "sgd_step_";
        let super::optim::SgdParams { lr, weight_decay, momentum, dampening, nesterov, first_step } =
            *h;
        let mut others = vec![grad];
        others.extend(momentum_buffer);
        let dev = same_layout(OP, self, &others)?;
        let cd = kernel_dtype(OP, self)?;
        let gd = kernel_dtype(OP, grad)?;
        if let Some(b) = momentum_buffer {
            require_f32(OP, b)?;
        }
        let n = self.numel();
        let f32d = CudaDType::F32;
        let mut d = Out::new(&dev, [n], DType::F32)?;
        let mut writes = vec![self];
        writes.extend(momentum_buffer);
        with_gpu_mut(OP, &writes, &[grad], |w, r| {
            let (p, mut b) = match w {
                [p] => (p, None),
                [p, b] => (p, Some(b)),
                _ => return Err(invalid(OP, "one or two updated buffers expected")),
            };
            k_ew::cast(&*dev, gd, r[0].view(), f32d, d.view_mut(), n)?;
            if weight_decay != 0.0 {
                k_ew::accumulate(&*dev, cd, p.view(), f32d, d.view_mut(), n, weight_decay as f32)?;
            }
            if let Some(b) = &mut b {
                if first_step {
                    k_ew::cast(&*dev, f32d, d.view(), f32d, b.view_mut(), n)?;
                } else {
                    k_ew::scalar_in_place(
                        &*dev,
                        f32d,
                        BinaryOp::Mul,
                        b.view_mut(),
                        momentum,
                        false,
                        n,
                    )?;
                    let keep = (1.0 - dampening) as f32;
                    k_ew::accumulate(&*dev, f32d, d.view(), f32d, b.view_mut(), n, keep)?;
                }
                if nesterov {
                    k_ew::accumulate(
                        &*dev,
                        f32d,
                        b.view(),
                        f32d,
                        d.view_mut(),
                        n,
                        momentum as f32,
                    )?;
                }
            }
            let upd = match &b {
                Some(b) if !nesterov => b.view(),
                _ => d.view(),
            };
            Ok(k_ew::accumulate(&*dev, f32d, upd, cd, p.view_mut(), n, -(lr as f32))?)
        })
    }

    /// The per-row statistics of a vocab shard of CUDA logits `[.., v_local]` (f32, bf16
    /// or f16) holding global columns `[vocab_start, vocab_start + v_local)` of a vocab
    /// of `vocab_size`, against i64 `targets` (one per row): f32 `[rows]` tensors
    /// `(max, sumexp, target_logit)` on the device, as the CPU kernel
    /// `tpar_kernels::cross_entropy::ce_local_stats` defines them (step 1 of
    /// vocab-parallel cross-entropy). A target that is neither `ignore_index` nor in
    /// `[0, vocab_size)` is an `IndexOutOfRange` error (a 4-byte status read, no tensor
    /// data). For CUDA tensors only.
    pub(crate) fn cuda_ce_shard_stats(
        &self,
        targets: &Tensor,
        vocab_start: i64,
        vocab_size: usize,
        ignore_index: i64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "ce_shard_stats";
        let cd = ce_device_dtype(OP, self)?;
        let v_local = self.dims().last().copied().unwrap_or(1);
        let rows = targets.numel();
        if targets.dtype() != DType::I64 || rows * v_local != self.numel() {
            return Err(invalid(
                OP,
                format!(
                    "logits {:?} need one i64 target per row, got {} {:?}",
                    self.dims(),
                    targets.dtype(),
                    targets.dims()
                ),
            ));
        }
        let dev = device_of(self, OP)?;
        let mut max = Out::new(&dev, [rows], DType::F32)?;
        let mut sumexp = Out::new(&dev, [rows], DType::F32)?;
        let mut tl = Out::new(&dev, [rows], DType::F32)?;
        let mut status = Status::new(&dev)?;
        let bad = with_gpu(OP, &[self, targets], |v| {
            let (lv, tv) = (v[0].view(), v[1].view());
            k_ce::ce_local_stats(
                &*dev,
                cd,
                lv,
                rows,
                v_local,
                tv,
                vocab_start,
                vocab_size,
                ignore_index,
                max.view_mut(),
                sumexp.view_mut(),
                tl.view_mut(),
                status.slot(),
            )?;
            status.check_now(tv, rows)
        })?;
        out_of_range("ce_local_stats", bad, vocab_size)?;
        status.finish("ce_local_stats", targets, rows, vocab_size);
        Ok((max.into_tensor(), sumexp.into_tensor(), tl.into_tensor()))
    }

    /// `sumexp` (f32 `[n]`, relative to `local_max`) rescaled to be relative to
    /// `global_max`, on the device: the shards' values can then be summed. For CUDA
    /// tensors only.
    pub(crate) fn cuda_ce_rescale(
        local_max: &Tensor,
        sumexp: &Tensor,
        global_max: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "ce_rescale";
        let n = ce_rows(OP, &[local_max, sumexp, global_max])?;
        let dev = device_of(sumexp, OP)?;
        let mut out = Out::new(&dev, [n], DType::F32)?;
        with_gpu(OP, &[local_max, sumexp, global_max], |v| {
            let (lm, sv, gm) = (v[0].view(), v[1].view(), v[2].view());
            let mut o = out.view_mut();
            k_layout::copy(&*dev, 4, sv, o.reborrow(), n)?;
            Ok(k_ce::ce_rescale(&*dev, lm, o, gm, n)?)
        })?;
        Ok(out.into_tensor())
    }

    /// f32 `lse = max + ln(sumexp)` (`[n]`) on the device. For CUDA tensors only.
    pub(crate) fn cuda_ce_lse(max: &Tensor, sumexp: &Tensor) -> Result<Tensor> {
        const OP: &str = "ce_lse";
        let n = ce_rows(OP, &[max, sumexp])?;
        let dev = device_of(max, OP)?;
        let mut out = Out::new(&dev, [n], DType::F32)?;
        with_gpu(OP, &[max, sumexp], |v| {
            Ok(k_ce::ce_lse(&*dev, v[0].view(), v[1].view(), out.view_mut(), n)?)
        })?;
        Ok(out.into_tensor())
    }

    /// The two sums a mean cross-entropy needs, as an f32 `[2]` tensor on the device:
    /// the total of `lse - target_logit` over the rows whose i64 target is not
    /// `ignore_index`, and the number of those rows. For CUDA tensors only.
    pub(crate) fn cuda_ce_loss_sums(
        lse: &Tensor,
        target_logit: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
    ) -> Result<Tensor> {
        const OP: &str = "ce_loss_sums";
        let rows = ce_rows(OP, &[lse, target_logit])?;
        if targets.dtype() != DType::I64 || targets.numel() != rows {
            return Err(invalid(OP, format!("needs {rows} i64 targets, got {targets:?}")));
        }
        let f32d = CudaDType::F32;
        let dev = device_of(lse, OP)?;
        // [2, rows]: per-row losses, then 1 for each counted row (`lse = 1`,
        // `target_logit = 0`), summed in one reduction.
        let mut parts = Out::new(&dev, [2, rows], DType::F32)?;
        let mut ones = Out::new(&dev, [rows], DType::F32)?;
        let zero = Out::zeros(&dev, [rows], DType::F32)?;
        k_ew::fill(&*dev, f32d, ones.view_mut(), rows, 1.0)?;
        with_gpu(OP, &[lse, target_logit, targets], |v| {
            let (lv, tlv, tv) = (v[0].view(), v[1].view(), v[2].view());
            let (losses, counted) = parts.view_mut().split_at(rows * 4)?;
            k_ce::ce_loss(&*dev, lv, tlv, tv, ignore_index, rows, losses, None)?;
            let (ov, zv) = (ones.view(), zero.view());
            Ok(k_ce::ce_loss(&*dev, ov, zv, tv, ignore_index, rows, counted, None)?)
        })?;
        let mut sums = Out::new(&dev, [2], DType::F32)?;
        let ws_len = k_reduce::reduce_workspace_len(2, rows, 1);
        let mut ws = Out::new(&dev, [ws_len], DType::F32)?;
        let (pv, sv) = (parts.view(), sums.view_mut());
        k_reduce::reduce(&*dev, Reduction::Sum, f32d, pv, sv, 2, rows, 1, Some(ws.view_mut()))?;
        Ok(sums.into_tensor())
    }

    /// The cross-entropy gradient on a vocab shard of CUDA logits (`self`, `[..,
    /// v_local]`, starting at global column `vocab_start`): `(softmax - onehot(target)) *
    /// scale`, from the global f32 `lse` (`[rows]`) and a one-element f32 `scale`, in
    /// the logits' dtype; zero rows where the target is `ignore_index`. For CUDA tensors
    /// only.
    pub(crate) fn cuda_ce_shard_backward(
        &self,
        targets: &Tensor,
        vocab_start: i64,
        ignore_index: i64,
        lse: &Tensor,
        scale: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "ce_shard_backward";
        let cd = ce_device_dtype(OP, self)?;
        let v_local = self.dims().last().copied().unwrap_or(1);
        let rows = ce_rows(OP, &[lse])?;
        ce_rows(OP, &[scale]).and_then(|n| {
            if n == 1 {
                Ok(())
            } else {
                Err(invalid(OP, format!("scale must hold one value, got {n}")))
            }
        })?;
        if targets.dtype() != DType::I64
            || targets.numel() != rows
            || rows * v_local != self.numel()
        {
            return Err(invalid(
                OP,
                format!("logits {:?} need {rows} i64 targets, got {targets:?}", self.dims()),
            ));
        }
        let dev = device_of(self, OP)?;
        let mut dl = Out::new(&dev, self.shape().clone(), self.dtype())?;
        with_gpu(OP, &[self, targets, lse, scale], |v| {
            let (lv, tv, lsev, sv) = (v[0].view(), v[1].view(), v[2].view(), v[3].view());
            Ok(k_ce::cross_entropy_backward(
                &*dev,
                cd,
                lv,
                rows,
                v_local,
                tv,
                vocab_start,
                ignore_index,
                lsev,
                sv,
                1,
                dl.view_mut(),
            )?)
        })?;
        Ok(dl.into_tensor())
    }

    /// The first of these i64 indices (any shape, in element order) outside
    /// `[0, size)`, as `(position, index)`, or `None` when all are in range: the global
    /// range check of a vocab-sharded embedding lookup, whose kernels mask the ids
    /// outside their slice. On a CUDA device a kernel checks them and only a 4-byte
    /// status (and the offending index, when there is one) is read back: no tensor data
    /// crosses to the host.
    pub fn first_index_out_of_range(&self, size: usize) -> Result<Option<(usize, i64)>> {
        const OP: &str = "first_index_out_of_range";
        self.require_i64(OP)?;
        let Device::Cuda(_) = self.device() else {
            return self.with_data::<i64, _>(|is| {
                is.iter().copied().enumerate().find(|&(_, i)| i < 0 || i as u64 >= size as u64)
            });
        };
        Ok(self.device_index_check(OP, size, false)?.1)
    }

    /// Checks that every element of this i64 tensor is in `[0, size)`: otherwise an
    /// `IndexOutOfRange` error naming `op`, the first bad position and its value (as
    /// [`Tensor::first_index_out_of_range`] finds them). On a CUDA device a kernel checks
    /// them and a 4-byte status is read back, or, while this thread defers its index
    /// checks ([`crate::gpu::defer_index_checks`]), recorded and read by
    /// [`crate::gpu::check_deferred_index_checks`]: this call then returns `Ok` for bad
    /// ids too.
    pub fn check_index_range(&self, size: usize, op: &'static str) -> Result<()> {
        const OP: &str = "check_index_range";
        let Device::Cuda(_) = self.device() else {
            let bad = self.first_index_out_of_range(size)?;
            return out_of_range(op, bad, size);
        };
        self.require_i64(OP)?;
        let (status, bad) = self.device_index_check(OP, size, true)?;
        out_of_range(op, bad, size)?;
        status.finish(op, self, self.numel(), size);
        Ok(())
    }

    /// A `DTypeMismatch` error naming `op` unless this tensor holds i64 values.
    fn require_i64(&self, op: &'static str) -> Result<()> {
        if self.dtype() != DType::I64 {
            return Err(TensorError::DTypeMismatch {
                op,
                expected: "i64".into(),
                got: self.dtype(),
            });
        }
        Ok(())
    }

    /// The range check of this i64 CUDA tensor's ids against `[0, size)` on its device:
    /// the first bad `(position, value)`, read back now unless `deferrable` and this
    /// thread defers its checks (then `None`, and the returned status is to be
    /// [`Status::finish`]ed). Refused inside a CUDA graph capture, which cannot read
    /// a status back.
    fn device_index_check(
        &self,
        op: &'static str,
        size: usize,
        deferrable: bool,
    ) -> Result<(Status, Option<(usize, i64)>)> {
        let n = self.numel();
        let dev = device_of(self, op)?;
        let mut status = Status::new(&dev)?;
        if status.0.is_none() {
            return Err(invalid(
                op,
                "the check reads a status back, which a CUDA graph capture cannot: check the \
                 ids before they are written into the captured step's inputs",
            ));
        }
        let bad = with_gpu(op, &[self], |v| {
            let iv = v[0].view();
            let Some(slot) = status.slot() else { return Ok(None) };
            k_emb::embedding_check_ids(&*dev, iv, n, size, slot)?;
            if deferrable {
                status.check_now(iv, n)
            } else {
                status.check(iv, n)
            }
        })?;
        Ok((status, bad))
    }

    /// Squared L2 norms of CUDA tensors, for gradient clipping: an f32 tensor
    /// `[tensors.len()]` on their device whose entry `i` is the sum of squares
    /// of `tensors[i]`'s elements, accumulated in f32 on the device. The
    /// tensors are f32, bf16 or f16 and share one CUDA device. One launch pair
    /// covers up to 32 tensors of one dtype (PyTorch's `_foreach_norm`), and
    /// each entry depends only on its own tensor (deterministic).
    pub fn sum_squares_each(tensors: &[&Tensor]) -> Result<Tensor> {
        const OP: &str = "sum_squares_each";
        let dev = multi_device(OP, tensors)?;
        let mut out = Out::new(&dev, [tensors.len()], DType::F32)?;
        let runs = dtype_runs(OP, tensors)?;
        let ws_len = runs
            .iter()
            .map(|(s, e, _)| {
                let lens: Vec<usize> = tensors[*s..*e].iter().map(|t| t.numel()).collect();
                k_multi::sum_squares_each_workspace_len(&lens)
            })
            .max()
            .unwrap_or(0);
        let mut ws = Out::new(&dev, [ws_len.max(1)], DType::F32)?;
        for (s, e, cd) in runs {
            with_gpu(OP, &tensors[s..e], |v| {
                let xs: Vec<(DeviceSlice<'_>, usize)> =
                    v.iter().zip(&tensors[s..e]).map(|(g, t)| (g.view(), t.numel())).collect();
                let o = out.view_mut().slice_mut(elems(s, e - s, 4))?;
                Ok(k_multi::sum_squares_each(&*dev, cd, &xs, o, ws.view_mut())?)
            })?;
        }
        Ok(out.into_tensor())
    }

    /// Each CUDA tensor's data times the f32 scalar `coef` (one element, on their
    /// device), in place (PyTorch's `_foreach_mul_`): `coef` rounded to each tensor's
    /// dtype and the product rounded once (the bits of `t.mul(&coef.to_dtype(t.dtype()))`),
    /// without a second set of buffers. One launch covers up to 32 tensors of one
    /// dtype, for scaling every gradient by a clipping coefficient that stays on the
    /// device. Every handle on a tensor's storage sees the new values. No two tensors
    /// may share a storage (each would be scaled twice): an error before anything
    /// changes, as for a bad `coef`. Not recorded by autograd.
    pub fn scale_each_(tensors: &[&Tensor], coef: &Tensor) -> Result<()> {
        const OP: &str = "scale_each_";
        if tensors.is_empty() {
            return Ok(());
        }
        let dev = multi_device(OP, tensors)?;
        if coef.numel() != 1 || coef.dtype() != DType::F32 || coef.device() != tensors[0].device() {
            return Err(invalid(
                OP,
                format!(
                    "coef must be one f32 on {}; got {} {} on {}",
                    tensors[0].device(),
                    coef.shape(),
                    coef.dtype(),
                    coef.device()
                ),
            ));
        }
        let runs = dtype_runs(OP, tensors)?;
        // Refused before the first launch: a storage listed twice, or `coef`'s.
        with_gpu_mut(OP, tensors, &[coef], |_, _| Ok(()))?;
        for (s, e, cd) in runs {
            with_gpu_mut(OP, &tensors[s..e], &[coef], |w, r| {
                let mut ys: Vec<(DeviceSliceMut<'_>, usize)> = w
                    .iter_mut()
                    .zip(&tensors[s..e])
                    .map(|(g, t)| (g.view_mut(), t.numel()))
                    .collect();
                Ok(k_multi::scale_each_in_place(&*dev, cd, &mut ys, r[0].view())?)
            })?;
        }
        Ok(())
    }
}
