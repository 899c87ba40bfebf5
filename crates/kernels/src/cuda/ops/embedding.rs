//! Embedding lookup and its gradients (`cuda/embedding.cu`) over device
//! buffers; [`crate::cuda::raw::embedding`] documents the kernels, the
//! vocab-sharded (`masked`) mode and the error slot.

use super::{count, Check};
use crate::cuda::raw::embedding as raw;
pub use crate::cuda::raw::embedding::{EmbeddingCsr, NO_ERROR};
use crate::cuda::{CudaDType, DeviceBuffer, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::util::bad;
use crate::Result;

/// `out[p] = weight[ids[p] - vocab_start]` for a table slice `weight`
/// `[vocab, dim]` (`dtype`), i64 `ids` `[n]` and `out` `[n, dim]`. Ids
/// outside the slice give zero rows; unless `masked` they also lower the
/// i32 `error` slot, when given, to their position.
pub fn embedding_forward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    weight: DeviceSlice<'_>,
    vocab: usize,
    dim: usize,
    ids: DeviceSlice<'_>,
    n: usize,
    vocab_start: i64,
    masked: bool,
    out: DeviceSliceMut<'_>,
    error: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    const OP: &str = "cuda_embedding_forward";
    let c = Check::new(OP, dev);
    let es = dtype.size();
    let wp = c.read("weight", &weight, count(OP, &[vocab, dim])?, es)?;
    let ip = c.read("ids", &ids, n, 8)?;
    let op_ = c.write("out", &out, count(OP, &[n, dim])?, es)?;
    let ep = c.slot("error", error.as_ref())?;
    // SAFETY: every view is a live buffer in `dev`'s memory holding what the
    // kernel touches (checked above); the kernel reads only table rows inside
    // the slice (others give zeros), and the written views are exclusive.
    unsafe {
        raw::embedding_forward(dev, dtype, wp, vocab, dim, ip, n, vocab_start, masked, op_, ep)
    }
}

/// Deterministic embedding gradient from the host-built CSR of the ids
/// (uploaded for the call): `dweight` (`[vocab, dim]`, overwritten) from
/// `dout` (`[n, dim]`), as the CPU kernel sums it.
pub fn embedding_backward_csr(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    csr: &EmbeddingCsr,
    dout: DeviceSlice<'_>,
    n: usize,
    vocab: usize,
    dim: usize,
    dweight: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "cuda_embedding_backward_csr";
    let (rs, pos) = (&csr.row_start, &csr.positions);
    let consistent = rs.len() == vocab + 1
        && rs.first() == Some(&0)
        && rs.windows(2).all(|w| w[0] <= w[1])
        && rs.last().is_some_and(|&e| e as usize == pos.len())
        && pos.iter().all(|&p| p >= 0 && (p as usize) < n);
    if !consistent {
        return Err(bad(
            OP,
            format!(
                "the CSR ({} offsets, {} positions) is not one built for {vocab} rows and {n} ids",
                rs.len(),
                pos.len()
            ),
        ));
    }
    let c = Check::new(OP, dev);
    let es = dtype.size();
    let gp = c.read("dout", &dout, count(OP, &[n, dim])?, es)?;
    let wp = c.write("dweight", &dweight, count(OP, &[vocab, dim])?, es)?;
    // On `dweight`'s device, which shares `dev`'s memory (checked above).
    let row_start = DeviceBuffer::from_host(dweight.device(), rs)?;
    let positions = DeviceBuffer::from_host(dweight.device(), pos)?;
    // SAFETY: the CSR was checked to be consistent (offsets from 0, not
    // decreasing, ending at the number of positions, each position below `n`)
    // and uploaded whole; `dout` and `dweight` hold what the kernel touches
    // (checked above); `dweight` is exclusive. The uploaded buffers are freed
    // after the launch in stream order.
    unsafe {
        raw::embedding_backward_csr(
            dev,
            dtype,
            row_start.ptr(),
            positions.ptr(),
            pos.len(),
            gp,
            n,
            vocab,
            dim,
            wp,
        )
    }
}

/// Deterministic embedding gradient from the ids alone: `dweight`
/// (`[vocab, dim]`, `dtype`, overwritten) from `dout` (`[n, dim]`) and the i64
/// `ids`, the CPU kernel's sums in position order (the bits of
/// [`embedding_backward_csr`]), with the CSR built on the device from scratch
/// memory allocated for the call; nothing is read back. Ids outside the slice
/// are skipped (the forward reports them).
pub fn embedding_backward_sorted(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    ids: DeviceSlice<'_>,
    n: usize,
    vocab_start: i64,
    dout: DeviceSlice<'_>,
    vocab: usize,
    dim: usize,
    dweight: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "cuda_embedding_backward_sorted";
    let c = Check::new(OP, dev);
    let es = dtype.size();
    let ip = c.read("ids", &ids, n, 8)?;
    let gp = c.read("dout", &dout, count(OP, &[n, dim])?, es)?;
    let wp = c.write("dweight", &dweight, count(OP, &[vocab, dim])?, es)?;
    // On `dweight`'s device, which shares `dev`'s memory (checked above); freed
    // after the launches in stream order.
    let scratch = DeviceBuffer::alloc(dweight.device(), raw::sorted_scratch_bytes(n, vocab))?;
    // SAFETY: every view is a live buffer in `dev`'s memory holding what the
    // kernels touch (checked above); `dweight` is exclusive and `scratch` is this
    // call's own, of the size the kernels need.
    unsafe {
        raw::embedding_backward_sorted(
            dev,
            dtype,
            ip,
            n,
            vocab_start,
            gp,
            vocab,
            dim,
            wp,
            scratch.ptr(),
        )
    }
}

/// Embedding gradient from the ids alone, with f32 atomic adds: `dweight`
/// (`[vocab, dim]`, `dtype`, overwritten) from `dout` (`[n, dim]`) and the
/// i64 `ids`, accumulated in the f32 `acc` (`[vocab, dim]`; `None` for f32
/// gradients accumulates in `dweight` itself). Ids outside the slice are
/// skipped; unless `masked` they lower the i32 `error` slot, when given.
pub fn embedding_backward_atomic(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    ids: DeviceSlice<'_>,
    n: usize,
    vocab_start: i64,
    masked: bool,
    dout: DeviceSlice<'_>,
    vocab: usize,
    dim: usize,
    dweight: DeviceSliceMut<'_>,
    acc: Option<DeviceSliceMut<'_>>,
    error: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    const OP: &str = "cuda_embedding_backward_atomic";
    let c = Check::new(OP, dev);
    let (es, wn) = (dtype.size(), count(OP, &[vocab, dim])?);
    let ip = c.read("ids", &ids, n, 8)?;
    let gp = c.read("dout", &dout, count(OP, &[n, dim])?, es)?;
    let wp = c.write("dweight", &dweight, wn, es)?;
    let ap = match &acc {
        Some(a) => c.write("acc", a, wn, 4)?,
        None if dtype == CudaDType::F32 => wp,
        None => return Err(bad(OP, "only f32 gradients accumulate in dweight itself")),
    };
    let ep = c.slot("error", error.as_ref())?;
    // SAFETY: every view is a live buffer in `dev`'s memory holding what the
    // kernel touches (checked above); ids outside the slice are skipped; the
    // written views are exclusive, and `acc` is `dweight` only for f32.
    unsafe {
        raw::embedding_backward_atomic(
            dev,
            dtype,
            ip,
            n,
            vocab_start,
            masked,
            gp,
            vocab,
            dim,
            wp,
            ap,
            ep,
        )
    }
}

/// Lowers the i32 `error` slot to the first position of the `n` i64 `ids`
/// that falls outside `[0, size)` (set the slot to [`NO_ERROR`] first): the
/// global range check of a vocab-sharded (`masked`) lookup.
pub fn embedding_check_ids(
    dev: &dyn GpuDevice,
    ids: DeviceSlice<'_>,
    n: usize,
    size: usize,
    error: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "cuda_embedding_check_ids";
    let c = Check::new(OP, dev);
    let ip = c.read("ids", &ids, n, 8)?;
    let ep = c.write("error", &error, 1, 4)?;
    // SAFETY: both views are live buffers in `dev`'s memory of the checked sizes;
    // the kernel only reads the ids and lowers the slot.
    unsafe { raw::embedding_check_ids(dev, ip, n, size, ep) }
}
