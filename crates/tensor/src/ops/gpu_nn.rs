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

use std::sync::Arc;

use tpar_kernels::adamw::AdamWParams;
use tpar_kernels::cuda::ops::{
    adamw as k_adamw, cross_entropy as k_ce, elementwise as k_ew, embedding as k_emb,
    gemm as k_gemm, layout as k_layout, reduce as k_reduce, rope as k_rope, sdpa as k_sdpa,
};
use tpar_kernels::cuda::{CudaDType, DevPtr, DeviceBuffer, GpuDevice};
use tpar_kernels::elementwise::BinaryOp;
use tpar_kernels::gemm::GemmShape;
use tpar_kernels::reduce::Reduction;
use tpar_kernels::rope::RopeShape;
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::KernelError;

use super::gpu::{alloc, cuda_dtype, dev_ptr};
use super::{common_device, invalid};
use crate::autograd::record;
use crate::{DType, Device, Result, Shape, Tensor, TensorError};

/// The byte address of element `index` of a buffer of `elem`-byte elements.
fn at(ptr: DevPtr, index: usize, elem: usize) -> DevPtr {
    ptr + (index * elem) as u64
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
/// position (see the module docs).
struct Status(DeviceBuffer);

impl Status {
    fn new(dev: &Arc<dyn GpuDevice>) -> Result<Status> {
        // Both kernel families use `i32::MAX` for "no error".
        debug_assert_eq!(k_ce::NO_ERROR, k_emb::NO_ERROR);
        Ok(Status(DeviceBuffer::from_host(dev, &k_ce::NO_ERROR.to_ne_bytes())?))
    }

    fn ptr(&self) -> DevPtr {
        self.0.ptr()
    }

    /// Waits for the launches before it and returns the first bad position
    /// with the offending i64 value read from `indices` (`n` of them).
    fn check(&self, indices: DevPtr, n: usize) -> Result<Option<(usize, i64)>> {
        let bytes = self.0.to_host()?;
        let mut b4 = [0u8; 4];
        b4.copy_from_slice(&bytes[..4]);
        let v = i32::from_ne_bytes(b4);
        if v == k_ce::NO_ERROR || v < 0 || v as usize >= n {
            return Ok(None);
        }
        let position = v as usize;
        let mut b8 = [0u8; 8];
        // SAFETY: `indices` holds `n` i64 values and `position < n`.
        unsafe { self.0.device().dtoh(at(indices, position, 8), &mut b8)? };
        Ok(Some((position, i64::from_ne_bytes(b8))))
    }
}

// ---------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------

/// Rotary embedding on the device; `None` when the dtype has no kernel.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, s: RopeShape) -> Result<Option<Tensor>> {
    const OP: &str = "rope";
    let Some(cd) = cuda_dtype(x.dtype()) else { return Ok(None) };
    let (dev, xp) = dev_ptr(x, OP)?;
    let (_, cp) = dev_ptr(cos, OP)?;
    let (_, sp) = dev_ptr(sin, OP)?;
    let y = alloc(&dev, x.shape().clone(), x.dtype())?;
    let (_, yp) = dev_ptr(&y, OP)?;
    // SAFETY: x and y hold the rotated tensor's elements, cos / sin `[seq, head_dim]`
    // (checked by the caller), all of one dtype.
    unsafe { k_rope::rope_forward(&*dev, cd, &s, xp, cp, sp, yp)? };
    let (c, sn) = (cos.detach(), sin.detach());
    Ok(Some(record(OP, &[x], y, move |g| {
        let (dev, gp) = dev_ptr(g, OP)?;
        let (_, cp) = dev_ptr(&c, OP)?;
        let (_, sp) = dev_ptr(&sn, OP)?;
        let dx = alloc(&dev, g.shape().clone(), g.dtype())?;
        let (_, dxp) = dev_ptr(&dx, OP)?;
        // SAFETY: as in the forward; the gradient has the input's shape.
        unsafe { k_rope::rope_backward(&*dev, cd, &s, gp, cp, sp, dxp)? };
        Ok(vec![Some(dx)])
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
    let (dev, lp) = dev_ptr(x, OP)?;
    let (_, tp) = dev_ptr(targets, OP)?;
    // [2, rows]: per-row losses, then 1 for each counted row.
    let parts = alloc(&dev, [2, rows], DType::F32)?;
    let lse = alloc(&dev, [rows], DType::F32)?;
    let (_, pp) = dev_ptr(&parts, OP)?;
    let (_, lsep) = dev_ptr(&lse, OP)?;
    let status = Status::new(&dev)?;
    // SAFETY: logits `[rows, vocab]`, i64 targets `[rows]`, f32 outputs of `rows`.
    unsafe {
        k_ce::cross_entropy_forward(
            &*dev,
            cd,
            lp,
            rows,
            vocab,
            tp,
            ignore_index,
            pp,
            lsep,
            0,
            status.ptr(),
        )?
    };
    if let Some((position, index)) = status.check(tp, rows)? {
        return Err(KernelError::IndexOutOfRange {
            op: "ce_local_stats",
            index,
            position,
            size: vocab,
        }
        .into());
    }
    let ones = alloc(&dev, [rows], DType::F32)?;
    let zero = Tensor::zeros([rows], DType::F32, Device::Cuda(dev.ordinal()))?;
    let (_, onep) = dev_ptr(&ones, OP)?;
    let (_, zp) = dev_ptr(&zero, OP)?;
    let counted = at(pp, rows, 4);
    let sums = alloc(&dev, [2], DType::F32)?;
    let (_, sp) = dev_ptr(&sums, OP)?;
    let count = at(sp, 1, 4);
    let ws_len = k_reduce::reduce_workspace_len(2, rows, 1);
    let ws = alloc(&dev, [ws_len], DType::F32)?;
    let (_, wsp) = dev_ptr(&ws, OP)?;
    let loss = alloc(&dev, Shape::new(&[]), x.dtype())?;
    let (_, lossp) = dev_ptr(&loss, OP)?;
    let loss32 = if cd == CudaDType::F32 { None } else { Some(alloc(&dev, [1], DType::F32)?) };
    let l32p = match &loss32 {
        Some(t) => dev_ptr(t, OP)?.1,
        None => lossp,
    };
    // SAFETY: every buffer was allocated above with the size used here.
    unsafe {
        k_ew::fill(&*dev, CudaDType::F32, onep, rows, 1.0)?;
        k_ce::ce_loss(&*dev, onep, zp, tp, ignore_index, rows, counted, 0)?;
        k_reduce::reduce(&*dev, Reduction::Sum, CudaDType::F32, pp, sp, 2, rows, 1, wsp, ws_len)?;
        // max(count, 1): with no counted row the total is 0 and so is the loss.
        k_ew::scalar(&*dev, CudaDType::F32, BinaryOp::Max, count, 1.0, false, count, 1)?;
        k_ew::binary(&*dev, CudaDType::F32, BinaryOp::Div, sp, &[1], count, &[1], &[1], l32p)?;
        if l32p != lossp {
            k_ew::cast(&*dev, CudaDType::F32, l32p, cd, lossp, 1)?;
        }
    }
    let (xs, ts) = (x.detach(), targets.detach());
    Ok(Some(record(OP, &[x], loss, move |g| {
        let (dev, gp) = dev_ptr(g, OP)?;
        let (_, lp) = dev_ptr(&xs, OP)?;
        let (_, tp) = dev_ptr(&ts, OP)?;
        let (_, lsep) = dev_ptr(&lse, OP)?;
        let (_, sp) = dev_ptr(&sums, OP)?;
        let gcd = kernel_dtype(OP, g)?;
        let scale = alloc(&dev, [2], DType::F32)?;
        let (_, scp) = dev_ptr(&scale, OP)?;
        let dl = alloc(&dev, xs.shape().clone(), xs.dtype())?;
        let (_, dlp) = dev_ptr(&dl, OP)?;
        // SAFETY: g is one element; `scale` holds two f32 (g, then g / count);
        // the logits, targets and lse are the forward's.
        unsafe {
            k_ew::cast(&*dev, gcd, gp, CudaDType::F32, scp, 1)?;
            let s1 = at(scp, 1, 4);
            k_ew::binary(
                &*dev,
                CudaDType::F32,
                BinaryOp::Div,
                scp,
                &[1],
                at(sp, 1, 4),
                &[1],
                &[1],
                s1,
            )?;
            k_ce::cross_entropy_backward(
                &*dev,
                cd,
                lp,
                rows,
                vocab,
                tp,
                0,
                ignore_index,
                lsep,
                s1,
                1,
                dlp,
            )?;
        }
        Ok(vec![Some(dl)])
    })))
}

// ---------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------

/// Embedding lookup on the device; `None` when the dtype has no kernel.
///
/// The weight gradient is the atomic scatter-add (`embedding_backward_atomic`,
/// accumulated in f32): the deterministic CSR variant needs the ids grouped
/// by row on the host each call, which would read the ids back.
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
    let (dev, wp) = dev_ptr(weight, OP)?;
    let (_, ip) = dev_ptr(ids, OP)?;
    let out = alloc(&dev, out_shape, weight.dtype())?;
    let (_, op) = dev_ptr(&out, OP)?;
    let status = if masked { None } else { Some(Status::new(&dev)?) };
    let err = status.as_ref().map_or(0, Status::ptr);
    // SAFETY: weight `[vocab, dim]`, i64 ids `[n]`, out `[n, dim]`.
    unsafe {
        k_emb::embedding_forward(&*dev, cd, wp, vocab, dim, ip, n, vocab_start, masked, op, err)?
    };
    if let Some(s) = &status {
        if let Some((position, index)) = s.check(ip, n)? {
            return Err(KernelError::IndexOutOfRange {
                op: "embedding_forward",
                index,
                position,
                size: vocab,
            }
            .into());
        }
    }
    let ids_c = ids.detach();
    let wdt = weight.dtype();
    Ok(Some(record(OP, &[weight], out, move |g| {
        let (dev, gp) = dev_ptr(g, OP)?;
        let (_, ip) = dev_ptr(&ids_c, OP)?;
        let dw = alloc(&dev, [vocab, dim], wdt)?;
        let (_, dwp) = dev_ptr(&dw, OP)?;
        let acc =
            if cd == CudaDType::F32 { None } else { Some(alloc(&dev, [vocab, dim], DType::F32)?) };
        let accp = match &acc {
            Some(t) => dev_ptr(t, OP)?.1,
            None => dwp,
        };
        // SAFETY: ids `[n]`, gradient `[n, dim]`, dw and the f32 accumulator
        // `[vocab, dim]` (the same buffer only for f32). Bad ids were reported by
        // the forward; here they are skipped.
        unsafe {
            k_emb::embedding_backward_atomic(
                &*dev,
                cd,
                ip,
                n,
                vocab_start,
                masked,
                gp,
                vocab,
                dim,
                dwp,
                accp,
                0,
            )?
        };
        Ok(vec![Some(dw)])
    })))
}

// ---------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------

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
    let fits = s.head_dim <= k_sdpa::MAX_HEAD_DIM
        && s.v_dim <= k_sdpa::MAX_HEAD_DIM
        && s.batch <= 65_535
        && s.q_heads <= 65_535
        && s.q_len <= i32::MAX as usize / 2
        && s.kv_len <= i32::MAX as usize / 2;
    if !fits {
        return Ok(None);
    }
    let s = *s;
    let (dev, qp) = dev_ptr(q, OP)?;
    let (_, kp) = dev_ptr(k, OP)?;
    let (_, vp) = dev_ptr(v, OP)?;
    let full = Shape::new(&[s.batch, s.q_heads, s.q_len, s.kv_len]);
    // The kernels read the mask with unit stride along the keys: a mask broadcast
    // over them is materialized to its full key length first.
    let mask: Option<Tensor> = match mask {
        Some(m) if m.numel() > 0 && full.numel() > 0 => {
            let md = m.dims();
            if md[3] == s.kv_len {
                Some(m.detach())
            } else {
                let e = alloc(&dev, [md[0], md[1], md[2], s.kv_len], m.dtype())?;
                let (_, mp) = dev_ptr(m, OP)?;
                let (_, ep) = dev_ptr(&e, OP)?;
                let out = e.dims().to_vec();
                // SAFETY: m holds its shape's elements, e the expanded shape's.
                unsafe { k_layout::expand(&*dev, cd.size(), mp, md, &out, ep)? };
                Some(e)
            }
        }
        _ => None,
    };
    let dev_mask = move |m: &Option<Tensor>| -> Result<Option<k_sdpa::SdpaDevMask>> {
        let Some(m) = m else { return Ok(None) };
        let st = crate::shape::broadcast_strides(m.shape(), &full);
        Ok(Some(k_sdpa::SdpaDevMask {
            data: dev_ptr(m, OP)?.1,
            len: m.numel(),
            batch_stride: st[0],
            head_stride: st[1],
            row_stride: st[2],
        }))
    };
    let rows = s.batch * s.q_heads * s.q_len;
    let out = alloc(&dev, [s.batch, s.q_heads, s.q_len, s.v_dim], q.dtype())?;
    let lse = alloc(&dev, [rows], DType::F32)?;
    let buffers = k_sdpa::SdpaFwdBuffers {
        q: qp,
        k: kp,
        v: vp,
        mask: dev_mask(&mask)?,
        out: dev_ptr(&out, OP)?.1,
        lse: dev_ptr(&lse, OP)?.1,
    };
    // SAFETY: q, k, v, out have the shapes `s` gives them (checked by the caller),
    // lse `rows` f32, the mask its own elements.
    unsafe { k_sdpa::sdpa_forward(&*dev, cd, &s, &buffers, k_sdpa::SdpaPath::Auto)? };
    let (qq, kk, vv, oo) = (q.detach(), k.detach(), v.detach(), out.detach());
    Ok(Some(record(OP, &[q, k, v], out, move |g| {
        let (dev, gp) = dev_ptr(g, OP)?;
        let dq = alloc(&dev, qq.shape().clone(), qq.dtype())?;
        let dk = alloc(&dev, kk.shape().clone(), kk.dtype())?;
        let dv = alloc(&dev, vv.shape().clone(), vv.dtype())?;
        let ws_bytes = k_sdpa::sdpa_backward_workspace_bytes(&s)?;
        let ws = alloc(&dev, [ws_bytes.div_ceil(4)], DType::F32)?;
        let b = k_sdpa::SdpaBwdBuffers {
            q: dev_ptr(&qq, OP)?.1,
            k: dev_ptr(&kk, OP)?.1,
            v: dev_ptr(&vv, OP)?.1,
            mask: dev_mask(&mask)?,
            out: dev_ptr(&oo, OP)?.1,
            lse: dev_ptr(&lse, OP)?.1,
            dout: gp,
            dq: dev_ptr(&dq, OP)?.1,
            dk: dev_ptr(&dk, OP)?.1,
            dv: dev_ptr(&dv, OP)?.1,
            workspace: dev_ptr(&ws, OP)?.1,
            workspace_bytes: ws.numel() * 4,
        };
        // SAFETY: as in the forward; the gradients have the inputs' shapes and the
        // workspace the size the kernels ask for.
        unsafe { k_sdpa::sdpa_backward(&*dev, cd, &s, &b, k_sdpa::SdpaPath::Auto)? };
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    })))
}

// ---------------------------------------------------------------------------------------
// Matrix products
// ---------------------------------------------------------------------------------------

/// `C[i] = op(A[i]) op(B[i])` for every batch of `s` into the contiguous
/// `[batch, m, n]` buffer `c`. Empty products write nothing, an empty
/// contraction writes zeros, and batches beyond one grid run in pieces.
///
/// # Safety
/// `a`, `b` and `c` must be live device buffers covering what `s` reaches.
unsafe fn gemm(
    dev: &Arc<dyn GpuDevice>,
    cd: CudaDType,
    s: GemmShape,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<()> {
    let es = cd.size();
    let per_c = s.m * s.n;
    if s.batch == 0 || per_c == 0 {
        return Ok(());
    }
    if s.k == 0 {
        // SAFETY: c holds `batch * m * n` elements.
        unsafe { dev.zero(c, s.batch * per_c * es)? };
        return Ok(());
    }
    let mut done = 0;
    while done < s.batch {
        let len = (s.batch - done).min(k_gemm::MAX_BATCH);
        let p = k_gemm::GemmProblem::new(GemmShape { batch: len, ..s }, cd, cd);
        // SAFETY: forwarded contract; the piece starts `done` batches in.
        unsafe {
            k_gemm::gemm(
                &**dev,
                &p,
                at(a, done * s.a_batch_stride, es),
                at(b, done * s.b_batch_stride, es),
                at(c, done * per_c, es),
            )?
        };
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
    let e = alloc(dev, full.clone(), x.dtype())?;
    let (_, xp) = dev_ptr(x, OP)?;
    let (_, ep) = dev_ptr(&e, OP)?;
    // SAFETY: x holds its elements, e those of the broadcast shape.
    unsafe { k_layout::expand(&**dev, x.dtype().size_in_bytes(), xp, x.dims(), &full, ep)? };
    Ok(Operand { data: e, stride: mat, reduce: true })
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
    let (dev, _) = dev_ptr(a, OP)?;
    let oa = operand(&dev, a, &bd, nb)?;
    let ob = operand(&dev, b, &bd, nb)?;
    // A batch-free right operand under an untransposed left one: fold the batch into rows.
    let fold = bb.numel() == 1 && !ta;
    let (batch, me) = if fold { (1, nb * m) } else { (nb, m) };
    let (sa, sb) = if fold { (0, 0) } else { (oa.stride, ob.stride) };
    let mut od = bd.clone();
    od.extend_from_slice(&[m, n]);
    let out = alloc(&dev, od, a.dtype())?;
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
    // SAFETY: the operands cover their strides over `batch`, out is `[batch, me, n]`.
    unsafe {
        gemm(
            &dev,
            cd,
            shape,
            dev_ptr(&oa.data, OP)?.1,
            dev_ptr(&ob.data, OP)?.1,
            dev_ptr(&out, OP)?.1,
        )?
    };
    let (a_in, b_in) = (a.clone(), b.clone());
    let (a_red, b_red) = (oa.reduce && !fold, ob.reduce && !fold);
    let (ad, bdat) = (oa.data, ob.data);
    Ok(Some(record(OP, &[a, b], out, move |g| {
        let (dev, gp) = dev_ptr(g, OP)?;
        let ap = dev_ptr(&ad, OP)?.1;
        let bp = dev_ptr(&bdat, OP)?.1;
        let sg = me * n;
        let full_dims = |t: &Tensor| {
            let mut d = bd.clone();
            d.extend_from_slice(&t.dims()[t.rank() - 2..]);
            d
        };
        let ga = if a_in.requires_grad() {
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
                (s, gp, bp)
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
                (s, bp, gp)
            };
            let dims = if a_red { full_dims(&a_in) } else { a_in.dims().to_vec() };
            let da = alloc(&dev, dims, a_in.dtype())?;
            // SAFETY: G is `[batch, me, n]`, the operands as in the forward.
            unsafe { gemm(&dev, cd, s, x, y, dev_ptr(&da, OP)?.1)? };
            Some(if a_red { da.sum_to(a_in.shape())? } else { da })
        } else {
            None
        };
        let gb = if b_in.requires_grad() {
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
                (s, ap, gp)
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
                (s, gp, ap)
            };
            let dims = if b_red { full_dims(&b_in) } else { b_in.dims().to_vec() };
            let db = alloc(&dev, dims, b_in.dtype())?;
            // SAFETY: as above.
            unsafe { gemm(&dev, cd, s, x, y, dev_ptr(&db, OP)?.1)? };
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
    Ok(dev_ptr(t0, op)?.0)
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
        let (pp, gp) = (dev_ptr(self, OP)?.1, dev_ptr(grad, OP)?.1);
        let (mp, vp) = (dev_ptr(exp_avg, OP)?.1, dev_ptr(exp_avg_sq, OP)?.1);
        // SAFETY: four live buffers of `numel` elements (checked above), the updated
        // ones in storages of their own.
        unsafe { k_adamw::adamw_step(&*dev, cd, gd, pp, gp, mp, vp, self.numel(), h)? };
        Ok(())
    }

    /// One SGD step on this CUDA parameter, in place, for optimizers
    /// (`tpar_optim::Sgd` calls it for parameters on a CUDA device), as
    /// `torch.optim.SGD`:
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
    pub fn sgd_step_(
        &self,
        grad: &Tensor,
        momentum_buffer: Option<&Tensor>,
        first_step: bool,
        lr: f64,
        weight_decay: f64,
        momentum: f64,
        dampening: f64,
        nesterov: bool,
    ) -> Result<()> {
        const OP: &str = "sgd_step_";
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
        let pp = dev_ptr(self, OP)?.1;
        let gp = dev_ptr(grad, OP)?.1;
        let d = alloc(&dev, [n], DType::F32)?;
        let dp = dev_ptr(&d, OP)?.1;
        // SAFETY: every buffer holds `n` elements of its dtype (checked above).
        unsafe {
            k_ew::cast(&*dev, gd, gp, f32d, dp, n)?;
            if weight_decay != 0.0 {
                k_ew::accumulate(&*dev, cd, pp, f32d, dp, n, weight_decay as f32)?;
            }
            let mut upd = dp;
            if let Some(b) = momentum_buffer {
                let bp = dev_ptr(b, OP)?.1;
                if first_step {
                    k_ew::cast(&*dev, f32d, dp, f32d, bp, n)?;
                } else {
                    k_ew::scalar(&*dev, f32d, BinaryOp::Mul, bp, momentum, false, bp, n)?;
                    k_ew::accumulate(&*dev, f32d, dp, f32d, bp, n, (1.0 - dampening) as f32)?;
                }
                if nesterov {
                    k_ew::accumulate(&*dev, f32d, bp, f32d, dp, n, momentum as f32)?;
                } else {
                    upd = bp;
                }
            }
            k_ew::accumulate(&*dev, f32d, upd, cd, pp, n, -(lr as f32))?;
        }
        Ok(())
    }

    /// Squared L2 norms of CUDA tensors, for gradient clipping: an f32 tensor
    /// `[tensors.len()]` on their device whose entry `i` is the sum of squares
    /// of `tensors[i]`'s elements, accumulated in f32 on the device. The
    /// tensors are f32, bf16 or f16 and share one CUDA device.
    pub fn sum_squares_each(tensors: &[&Tensor]) -> Result<Tensor> {
        const OP: &str = "sum_squares_each";
        let Some(first) = tensors.first() else {
            return Err(invalid(OP, "no tensors given (their device is unknown)"));
        };
        let Device::Cuda(_) = common_device(OP, tensors)? else {
            return Err(invalid(OP, format!("for CUDA tensors only; got {}", first.device())));
        };
        let (dev, _) = dev_ptr(first, OP)?;
        let out = alloc(&dev, [tensors.len()], DType::F32)?;
        let op = dev_ptr(&out, OP)?.1;
        let ws_len = tensors
            .iter()
            .map(|t| k_reduce::reduce_workspace_len(1, t.numel(), 1))
            .max()
            .unwrap_or(0);
        let ws = alloc(&dev, [ws_len], DType::F32)?;
        let wp = dev_ptr(&ws, OP)?.1;
        for (i, t) in tensors.iter().enumerate() {
            let cd = kernel_dtype(OP, t)?;
            let tp = dev_ptr(t, OP)?.1;
            // SAFETY: t holds `numel` elements, out `len` f32, ws `ws_len` f32.
            unsafe {
                k_reduce::sum_squares(&*dev, cd, tp, 1, t.numel(), at(op, i, 4), wp, ws_len)?
            };
        }
        Ok(out)
    }
}
