//! Cross-entropy (`cuda/cross_entropy.cu`) over device buffers, in the
//! pieces of the vocab-parallel composition; [`crate::cuda::raw::cross_entropy`]
//! documents the steps and the error slot. Logits are f32, bf16 or f16;
//! statistics, losses and scales f32; targets i64.

use super::{count, Check};
use crate::cuda::raw::cross_entropy as raw;
pub use crate::cuda::raw::cross_entropy::NO_ERROR;
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// Per-row f32 `max`, `sumexp` and `target_logit` of a logits shard
/// `[rows, v_local]` (`dtype`) holding global columns
/// `[vocab_start, vocab_start + v_local)`, from i64 `targets` `[rows]`;
/// targets outside `[0, vocab_size)` lower the i32 `error` slot, when given.
pub fn ce_local_stats(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    logits: DeviceSlice<'_>,
    rows: usize,
    v_local: usize,
    targets: DeviceSlice<'_>,
    vocab_start: i64,
    vocab_size: usize,
    ignore_index: i64,
    max: DeviceSliceMut<'_>,
    sumexp: DeviceSliceMut<'_>,
    target_logit: DeviceSliceMut<'_>,
    error: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    const OP: &str = "cuda_ce_local_stats";
    let c = Check::new(OP, dev);
    let lp = c.read("logits", &logits, count(OP, &[rows, v_local])?, dtype.size())?;
    let tp = c.read("targets", &targets, rows, 8)?;
    let mp = c.write("max", &max, rows, 4)?;
    let sp = c.write("sumexp", &sumexp, rows, 4)?;
    let tlp = c.write("target_logit", &target_logit, rows, 4)?;
    let ep = c.slot("error", error.as_ref())?;
    // SAFETY: every view is a live buffer in `dev`'s memory holding what the
    // kernel touches (checked above); the kernel reads a target's logit only
    // when it falls inside the shard; the written views are exclusive.
    unsafe {
        raw::ce_local_stats(
            dev,
            dtype,
            lp,
            rows,
            v_local,
            tp,
            vocab_start,
            vocab_size,
            ignore_index,
            mp,
            sp,
            tlp,
            ep,
        )
    }
}

/// Unsharded cross-entropy of `logits` `[rows, vocab]` (`dtype`) against i64
/// `targets`: f32 per-row losses `loss_rows` (0 for ignored rows) and `lse`;
/// the i32 `count`, when given, is incremented by the non-ignored rows, and
/// bad targets lower the i32 `error` slot, when given.
pub fn cross_entropy_forward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    logits: DeviceSlice<'_>,
    rows: usize,
    vocab: usize,
    targets: DeviceSlice<'_>,
    ignore_index: i64,
    loss_rows: DeviceSliceMut<'_>,
    lse: DeviceSliceMut<'_>,
    count_slot: Option<DeviceSliceMut<'_>>,
    error: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    const OP: &str = "cuda_cross_entropy_forward";
    let c = Check::new(OP, dev);
    let lp = c.read("logits", &logits, count(OP, &[rows, vocab])?, dtype.size())?;
    let tp = c.read("targets", &targets, rows, 8)?;
    let rp = c.write("loss_rows", &loss_rows, rows, 4)?;
    let lsep = c.write("lse", &lse, rows, 4)?;
    let cp = c.slot("count", count_slot.as_ref())?;
    let ep = c.slot("error", error.as_ref())?;
    // SAFETY: as in `ce_local_stats`; a target's logit is read only when the
    // target is inside `[0, vocab)`.
    unsafe {
        raw::cross_entropy_forward(dev, dtype, lp, rows, vocab, tp, ignore_index, rp, lsep, cp, ep)
    }
}

/// `dlogits = (softmax(logits) - onehot(target)) * scale` on a shard
/// `[rows, v_local]` (`dtype`) starting at global column `vocab_start`, from
/// the global f32 `lse` and `row_scale_len` f32 scales (1 or `rows`).
pub fn cross_entropy_backward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    logits: DeviceSlice<'_>,
    rows: usize,
    v_local: usize,
    targets: DeviceSlice<'_>,
    vocab_start: i64,
    ignore_index: i64,
    lse: DeviceSlice<'_>,
    row_scale: DeviceSlice<'_>,
    row_scale_len: usize,
    dlogits: DeviceSliceMut<'_>,
) -> Result<()> {
    const OP: &str = "cuda_cross_entropy_backward";
    let c = Check::new(OP, dev);
    let n = count(OP, &[rows, v_local])?;
    let lp = c.read("logits", &logits, n, dtype.size())?;
    let tp = c.read("targets", &targets, rows, 8)?;
    let lsep = c.read("lse", &lse, rows, 4)?;
    let sp = c.read("row_scale", &row_scale, row_scale_len, 4)?;
    let dp = c.write("dlogits", &dlogits, n, dtype.size())?;
    // SAFETY: as in `ce_local_stats`; a target column is written only when it
    // falls inside the shard, and a scale length other than 1 or `rows` is
    // refused before the launch.
    unsafe {
        raw::cross_entropy_backward(
            dev,
            dtype,
            lp,
            rows,
            v_local,
            tp,
            vocab_start,
            ignore_index,
            lsep,
            sp,
            row_scale_len,
            dp,
        )
    }
}

/// Folds another shard's f32 `(other_max, other_sumexp)` into `(max, sumexp)`
/// row by row, for `n` rows.
pub fn ce_merge(
    dev: &dyn GpuDevice,
    max: DeviceSliceMut<'_>,
    sumexp: DeviceSliceMut<'_>,
    other_max: DeviceSlice<'_>,
    other_sumexp: DeviceSlice<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("cuda_ce_merge", dev);
    let (mp, sp) = (c.write("max", &max, n, 4)?, c.write("sumexp", &sumexp, n, 4)?);
    let omp = c.read("other_max", &other_max, n, 4)?;
    let osp = c.read("other_sumexp", &other_sumexp, n, 4)?;
    // SAFETY: four live f32 buffers in `dev`'s memory of at least `n`
    // elements (checked above); the updated ones are exclusive borrows.
    unsafe { raw::ce_merge(dev, mp, sp, omp, osp, n) }
}

/// Rescales f32 `sumexp` (relative to `local_max`) in place to be relative
/// to `global_max`, for `n` rows.
pub fn ce_rescale(
    dev: &dyn GpuDevice,
    local_max: DeviceSlice<'_>,
    sumexp: DeviceSliceMut<'_>,
    global_max: DeviceSlice<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("cuda_ce_rescale", dev);
    let lp = c.read("local_max", &local_max, n, 4)?;
    let sp = c.write("sumexp", &sumexp, n, 4)?;
    let gp = c.read("global_max", &global_max, n, 4)?;
    // SAFETY: as in `ce_merge`.
    unsafe { raw::ce_rescale(dev, lp, sp, gp, n) }
}

/// f32 `lse = max + ln(sumexp)` for `n` rows.
pub fn ce_lse(
    dev: &dyn GpuDevice,
    max: DeviceSlice<'_>,
    sumexp: DeviceSlice<'_>,
    lse: DeviceSliceMut<'_>,
    n: usize,
) -> Result<()> {
    let c = Check::new("cuda_ce_lse", dev);
    let (mp, sp) = (c.read("max", &max, n, 4)?, c.read("sumexp", &sumexp, n, 4)?);
    let lp = c.write("lse", &lse, n, 4)?;
    // SAFETY: as in `ce_merge`.
    unsafe { raw::ce_lse(dev, mp, sp, lp, n) }
}

/// f32 `loss[r] = lse[r] - target_logit[r]` (0 where the i64 target is
/// `ignore_index`); the i32 `count`, when given, is incremented by the
/// non-ignored rows.
pub fn ce_loss(
    dev: &dyn GpuDevice,
    lse: DeviceSlice<'_>,
    target_logit: DeviceSlice<'_>,
    targets: DeviceSlice<'_>,
    ignore_index: i64,
    rows: usize,
    loss: DeviceSliceMut<'_>,
    count_slot: Option<DeviceSliceMut<'_>>,
) -> Result<()> {
    let c = Check::new("cuda_ce_loss", dev);
    let lp = c.read("lse", &lse, rows, 4)?;
    let tlp = c.read("target_logit", &target_logit, rows, 4)?;
    let tp = c.read("targets", &targets, rows, 8)?;
    let op_ = c.write("loss", &loss, rows, 4)?;
    let cp = c.slot("count", count_slot.as_ref())?;
    // SAFETY: as in `ce_merge`.
    unsafe { raw::ce_loss(dev, lp, tlp, tp, ignore_index, rows, op_, cp) }
}
