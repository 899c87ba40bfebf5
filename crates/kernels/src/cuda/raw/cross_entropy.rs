//! Cross-entropy (`cuda/cross_entropy.cu`), in the same pieces as the CPU
//! kernels of [`crate::cross_entropy`], so the vocab-parallel composition is
//! the same on a GPU:
//!
//! 1. [`ce_local_stats`] on each vocab shard → local `max`, `sumexp`,
//!    `target_logit` (f32, one value per row);
//! 2. all-reduce `max` with MAX, [`ce_rescale`] `sumexp` to it, all-reduce
//!    `sumexp` and `target_logit` with SUM (or gather and fold with
//!    [`ce_merge`]);
//! 3. [`ce_lse`] and [`ce_loss`] → per-row `lse` and loss, and the count of
//!    non-ignored rows;
//! 4. backward: [`cross_entropy_backward`] on each shard with the global `lse`.
//!
//! [`cross_entropy_forward`] is the unsharded forward in one kernel.
//!
//! Logits are f32, bf16 or f16; statistics, losses and scales are f32;
//! targets are i64. A GPU kernel cannot return an error, so target checks
//! report through an optional i32 *error slot*: the caller sets it to
//! [`NO_ERROR`] before the launch and, after it, a smaller value is the
//! first row whose target is neither `ignore_index` nor in `[0, vocab_size)`
//! (the CPU kernels' `IndexOutOfRange`); outputs of that launch are then
//! meaningless for such rows.

use bytemuck::{Pod, Zeroable};

use super::{bad, check_ptr, to_i32};
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::Result;

/// The value of an error slot when no invalid index was found. Slots are
/// lowered with `atomicMin` to the first offending position.
pub const NO_ERROR: i32 = i32::MAX;

/// Arguments of `tpar_ce_stats_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CeStatsArgs {
    /// Logits `[rows, v_local]`.
    pub logits: DevPtr,
    /// i64 targets `[rows]` (global class indices).
    pub targets: DevPtr,
    /// f32 local max `[rows]` (written).
    pub max: DevPtr,
    /// f32 sum of `exp(logit - max)` `[rows]` (written).
    pub sumexp: DevPtr,
    /// f32 target logit when this shard owns the target, else 0 `[rows]` (written).
    pub target_logit: DevPtr,
    /// i32 error slot, or 0 for none.
    pub error: DevPtr,
    /// First global column of this shard.
    pub vocab_start: i64,
    /// Global vocab size (targets must be below it).
    pub vocab_size: i64,
    /// Target value of rows that do not count.
    pub ignore_index: i64,
    /// Rows.
    pub rows: i32,
    /// Columns of this shard.
    pub v_local: i32,
    /// 1: one warp per row; 0: one block per row.
    pub warp_rows: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_ce_fwd_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CeFwdArgs {
    /// Logits `[rows, vocab]`.
    pub logits: DevPtr,
    /// i64 targets `[rows]`.
    pub targets: DevPtr,
    /// f32 loss per row, 0 for ignored rows (written).
    pub loss: DevPtr,
    /// f32 log-sum-exp per row (written).
    pub lse: DevPtr,
    /// i32 counter incremented by the number of non-ignored rows, or 0.
    pub count: DevPtr,
    /// i32 error slot, or 0 for none.
    pub error: DevPtr,
    /// Target value of rows that do not count.
    pub ignore_index: i64,
    /// Rows.
    pub rows: i32,
    /// Classes.
    pub vocab: i32,
    /// 1: one warp per row; 0: one block per row.
    pub warp_rows: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_ce_bwd_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CeBwdArgs {
    /// Logits `[rows, v_local]`.
    pub logits: DevPtr,
    /// i64 targets `[rows]`.
    pub targets: DevPtr,
    /// f32 global log-sum-exp `[rows]`.
    pub lse: DevPtr,
    /// f32 scales: `[rows]` when `scale_per_row`, else `[1]`.
    pub row_scale: DevPtr,
    /// Gradient of the logits `[rows, v_local]` (written; may be `logits`).
    pub dlogits: DevPtr,
    /// First global column of this shard.
    pub vocab_start: i64,
    /// Target value of rows that do not count.
    pub ignore_index: i64,
    /// Rows.
    pub rows: i32,
    /// Columns of this shard.
    pub v_local: i32,
    /// 1: one scale per row; 0: one scale for all rows.
    pub scale_per_row: i32,
    /// 1: one warp per row; 0: one block per row.
    pub warp_rows: i32,
}

/// Arguments of `tpar_ce_merge_f32`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CeMergeArgs {
    /// f32 `[n]`, updated to the larger max.
    pub max: DevPtr,
    /// f32 `[n]`, updated to the merged sum relative to the new max.
    pub sumexp: DevPtr,
    /// f32 `[n]`.
    pub other_max: DevPtr,
    /// f32 `[n]`.
    pub other_sumexp: DevPtr,
    /// Rows.
    pub n: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_ce_rescale_f32`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CeRescaleArgs {
    /// f32 `[n]`: the max `sumexp` is relative to.
    pub local_max: DevPtr,
    /// f32 `[n]`, rescaled in place.
    pub sumexp: DevPtr,
    /// f32 `[n]`: the max to rescale to.
    pub global_max: DevPtr,
    /// Rows.
    pub n: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_ce_lse_f32`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CeLseArgs {
    /// f32 `[n]`.
    pub max: DevPtr,
    /// f32 `[n]`.
    pub sumexp: DevPtr,
    /// f32 `[n]` (written).
    pub lse: DevPtr,
    /// Rows.
    pub n: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_ce_loss_f32`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CeLossArgs {
    /// f32 `[rows]`.
    pub lse: DevPtr,
    /// f32 `[rows]` (summed over shards).
    pub target_logit: DevPtr,
    /// i64 `[rows]`.
    pub targets: DevPtr,
    /// f32 `[rows]` (written).
    pub loss: DevPtr,
    /// i32 counter incremented by the number of non-ignored rows, or 0.
    pub count: DevPtr,
    /// Target value of rows that do not count.
    pub ignore_index: i64,
    /// Rows.
    pub rows: i32,
    /// Padding.
    pub pad: i32,
}

/// Rows of at most this many 16-byte vectors get one warp each.
const WARP_ROW_VECTORS: usize = 64;
/// Threads per block of the warp-per-row and per-row-vector kernels.
const BLOCK: u32 = 256;
/// Most blocks of the small per-row kernels (they grid-stride).
const MAX_SMALL_BLOCKS: usize = 1024;

/// An optional i32 slot (0 = none) must be 4-byte aligned.
fn check_slot(op: &'static str, what: &str, ptr: DevPtr) -> Result<()> {
    check_ptr(op, what, ptr, 0, 4)
}

/// `rows * cols` as a checked element count (both within i32).
fn check_matrix(op: &'static str, rows: usize, cols: usize) -> Result<usize> {
    to_i32(op, "rows", rows)?;
    to_i32(op, "columns", cols)?;
    Ok(rows * cols)
}

/// `(warp_rows, launch)` for a row kernel over `rows` rows of `cols` elements.
fn row_launch(rows: usize, cols: usize, dtype: CudaDType) -> (i32, LaunchConfig) {
    let vectors = cols.div_ceil(16 / dtype.size());
    if vectors <= WARP_ROW_VECTORS {
        let per_block = (BLOCK / 32) as usize;
        (1, LaunchConfig::linear(rows.div_ceil(per_block).max(1) as u32, BLOCK))
    } else {
        // About four vectors per thread, 64..=256 threads (the kernels keep
        // their row state in registers: launch bounds of 256).
        let threads = vectors.div_ceil(4).next_multiple_of(32).clamp(64, 256) as u32;
        (0, LaunchConfig::linear(rows.max(1) as u32, threads))
    }
}

fn small_launch(n: usize) -> LaunchConfig {
    LaunchConfig::for_items(n, BLOCK, MAX_SMALL_BLOCKS as u32)
}

/// Per-row statistics of a logits shard `[rows, v_local]` (`dtype`) holding
/// global columns `[vocab_start, vocab_start + v_local)`: f32 `max`,
/// `sumexp` (relative to `max`) and `target_logit` (the target's logit when
/// this shard owns it and the row is not ignored, else 0), as
/// [`crate::cross_entropy::ce_local_stats`]. `error` is an optional i32 error
/// slot (see the module docs) for targets outside `[0, vocab_size)`.
///
/// # Safety
/// Every pointer must be a device buffer of the stated size (i64 `targets`,
/// f32 outputs of `rows` elements), outputs not overlapping the inputs.
pub unsafe fn ce_local_stats(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    logits: DevPtr,
    rows: usize,
    v_local: usize,
    targets: DevPtr,
    vocab_start: i64,
    vocab_size: usize,
    ignore_index: i64,
    max: DevPtr,
    sumexp: DevPtr,
    target_logit: DevPtr,
    error: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_ce_local_stats";
    let n = check_matrix(OP, rows, v_local)?;
    let in_vocab = vocab_start >= 0
        && (vocab_start as u64).checked_add(v_local as u64).is_some_and(|e| e <= vocab_size as u64)
        && i64::try_from(vocab_size).is_ok();
    if !in_vocab {
        return Err(bad(
            OP,
            format!("shard [{vocab_start}, +{v_local}) is not inside vocab of size {vocab_size}"),
        ));
    }
    check_ptr(OP, "logits", logits, n, dtype.size())?;
    check_ptr(OP, "targets", targets, rows, 8)?;
    check_ptr(OP, "max", max, rows, 4)?;
    check_ptr(OP, "sumexp", sumexp, rows, 4)?;
    check_ptr(OP, "target_logit", target_logit, rows, 4)?;
    check_slot(OP, "error", error)?;
    if rows == 0 {
        return Ok(());
    }
    let (warp_rows, cfg) = row_launch(rows, v_local, dtype);
    let args = CeStatsArgs {
        logits,
        targets,
        max,
        sumexp,
        target_logit,
        error,
        vocab_start,
        vocab_size: vocab_size as i64,
        ignore_index,
        rows: rows as i32,
        v_local: v_local as i32,
        warp_rows,
        pad: 0,
    };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, &format!("tpar_ce_stats_{}", dtype.suffix()), cfg, &args) }
}

/// Unsharded cross-entropy of logits `[rows, vocab]` (`dtype`): f32
/// `loss_rows[r] = lse[r] - logits[r, targets[r]]` (0 for ignored rows) and
/// f32 `lse`, as [`crate::cross_entropy::cross_entropy_forward`], in one pass
/// over the logits. `count` (optional i32, 0 for none) is incremented by the
/// number of non-ignored rows, the mean's denominator: zero it first. `error`
/// is an optional error slot (see the module docs).
///
/// # Safety
/// Every pointer must be a device buffer of the stated size, outputs not
/// overlapping the inputs.
pub unsafe fn cross_entropy_forward(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    logits: DevPtr,
    rows: usize,
    vocab: usize,
    targets: DevPtr,
    ignore_index: i64,
    loss_rows: DevPtr,
    lse: DevPtr,
    count: DevPtr,
    error: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_cross_entropy_forward";
    let n = check_matrix(OP, rows, vocab)?;
    check_ptr(OP, "logits", logits, n, dtype.size())?;
    check_ptr(OP, "targets", targets, rows, 8)?;
    check_ptr(OP, "loss_rows", loss_rows, rows, 4)?;
    check_ptr(OP, "lse", lse, rows, 4)?;
    check_slot(OP, "count", count)?;
    check_slot(OP, "error", error)?;
    if rows == 0 {
        return Ok(());
    }
    let (warp_rows, cfg) = row_launch(rows, vocab, dtype);
    let args = CeFwdArgs {
        logits,
        targets,
        loss: loss_rows,
        lse,
        count,
        error,
        ignore_index,
        rows: rows as i32,
        vocab: vocab as i32,
        warp_rows,
        pad: 0,
    };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, &format!("tpar_ce_fwd_{}", dtype.suffix()), cfg, &args) }
}

/// `dlogits = (softmax(logits) - onehot(target)) * scale` on a shard
/// `[rows, v_local]` (`dtype`) starting at global column `vocab_start`, given
/// the global f32 `lse`, as [`crate::cross_entropy::cross_entropy_backward`]:
/// ignored rows get zeros; a target outside the shard contributes only the
/// softmax term. `row_scale` holds `row_scale_len` f32 values: 1 (one scale
/// for every row) or `rows`. `dlogits` may be `logits` (in place).
///
/// # Safety
/// Every pointer must be a device buffer of the stated size; `dlogits` either
/// is `logits` or does not overlap it.
pub unsafe fn cross_entropy_backward(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    logits: DevPtr,
    rows: usize,
    v_local: usize,
    targets: DevPtr,
    vocab_start: i64,
    ignore_index: i64,
    lse: DevPtr,
    row_scale: DevPtr,
    row_scale_len: usize,
    dlogits: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_cross_entropy_backward";
    let n = check_matrix(OP, rows, v_local)?;
    if row_scale_len != 1 && row_scale_len != rows {
        return Err(bad(
            OP,
            format!("row_scale has {row_scale_len} elements, expected 1 or {rows}"),
        ));
    }
    check_ptr(OP, "logits", logits, n, dtype.size())?;
    check_ptr(OP, "targets", targets, rows, 8)?;
    check_ptr(OP, "lse", lse, rows, 4)?;
    check_ptr(OP, "row_scale", row_scale, row_scale_len, 4)?;
    check_ptr(OP, "dlogits", dlogits, n, dtype.size())?;
    if n == 0 {
        return Ok(());
    }
    let (warp_rows, cfg) = row_launch(rows, v_local, dtype);
    let args = CeBwdArgs {
        logits,
        targets,
        lse,
        row_scale,
        dlogits,
        vocab_start,
        ignore_index,
        rows: rows as i32,
        v_local: v_local as i32,
        scale_per_row: i32::from(row_scale_len != 1),
        warp_rows,
    };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, &format!("tpar_ce_bwd_{}", dtype.suffix()), cfg, &args) }
}

/// Folds another shard's f32 `(other_max, other_sumexp)` into `(max, sumexp)`
/// row by row (the result is relative to the larger max), as
/// [`crate::cross_entropy::ce_merge`].
///
/// # Safety
/// Four f32 device buffers of `n` elements; `max`/`sumexp` do not overlap the others.
pub unsafe fn ce_merge(
    launcher: &dyn Launcher,
    max: DevPtr,
    sumexp: DevPtr,
    other_max: DevPtr,
    other_sumexp: DevPtr,
    n: usize,
) -> Result<()> {
    const OP: &str = "cuda_ce_merge";
    let n32 = to_i32(OP, "n", n)?;
    for (what, p) in
        [("max", max), ("sumexp", sumexp), ("other_max", other_max), ("other_sumexp", other_sumexp)]
    {
        check_ptr(OP, what, p, n, 4)?;
    }
    if n == 0 {
        return Ok(());
    }
    let args = CeMergeArgs { max, sumexp, other_max, other_sumexp, n: n32, pad: 0 };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, "tpar_ce_merge_f32", small_launch(n), &args) }
}

/// Rescales f32 `sumexp` (relative to `local_max`) in place to be relative to
/// the all-reduced `global_max`, as [`crate::cross_entropy::ce_rescale`].
///
/// # Safety
/// Three f32 device buffers of `n` elements.
pub unsafe fn ce_rescale(
    launcher: &dyn Launcher,
    local_max: DevPtr,
    sumexp: DevPtr,
    global_max: DevPtr,
    n: usize,
) -> Result<()> {
    const OP: &str = "cuda_ce_rescale";
    let n32 = to_i32(OP, "n", n)?;
    for (what, p) in [("local_max", local_max), ("sumexp", sumexp), ("global_max", global_max)] {
        check_ptr(OP, what, p, n, 4)?;
    }
    if n == 0 {
        return Ok(());
    }
    let args = CeRescaleArgs { local_max, sumexp, global_max, n: n32, pad: 0 };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, "tpar_ce_rescale_f32", small_launch(n), &args) }
}

/// f32 `lse = max + ln(sumexp)` (`-inf` when `sumexp` is 0), as
/// [`crate::cross_entropy::ce_lse`].
///
/// # Safety
/// Three f32 device buffers of `n` elements; `lse` may alias neither input
/// unless it is exactly one of them.
pub unsafe fn ce_lse(
    launcher: &dyn Launcher,
    max: DevPtr,
    sumexp: DevPtr,
    lse: DevPtr,
    n: usize,
) -> Result<()> {
    const OP: &str = "cuda_ce_lse";
    let n32 = to_i32(OP, "n", n)?;
    for (what, p) in [("max", max), ("sumexp", sumexp), ("lse", lse)] {
        check_ptr(OP, what, p, n, 4)?;
    }
    if n == 0 {
        return Ok(());
    }
    let args = CeLseArgs { max, sumexp, lse, n: n32, pad: 0 };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, "tpar_ce_lse_f32", small_launch(n), &args) }
}

/// The last forward step of the vocab-parallel loss: f32
/// `loss[r] = lse[r] - target_logit[r]`, 0 for rows whose target is
/// `ignore_index`; `count` (optional i32, 0 for none) is incremented by the
/// number of non-ignored rows (zero it first).
///
/// # Safety
/// f32 `lse`, `target_logit`, `loss` and i64 `targets` device buffers of
/// `rows` elements.
pub unsafe fn ce_loss(
    launcher: &dyn Launcher,
    lse: DevPtr,
    target_logit: DevPtr,
    targets: DevPtr,
    ignore_index: i64,
    rows: usize,
    loss: DevPtr,
    count: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_ce_loss";
    let n32 = to_i32(OP, "rows", rows)?;
    for (what, p) in [("lse", lse), ("target_logit", target_logit), ("loss", loss)] {
        check_ptr(OP, what, p, rows, 4)?;
    }
    check_ptr(OP, "targets", targets, rows, 8)?;
    check_slot(OP, "count", count)?;
    if rows == 0 {
        return Ok(());
    }
    let args =
        CeLossArgs { lse, target_logit, targets, loss, count, ignore_index, rows: n32, pad: 0 };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, "tpar_ce_loss_f32", small_launch(rows), &args) }
}
