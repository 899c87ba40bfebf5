//! Cross-entropy over class logits, written so the same code serves the
//! vocab-parallel case (logits sharded on the vocab dim; a rank holds columns
//! `[vocab_start, vocab_start + v_local)` of a global vocab).
//!
//! Vocab-parallel forward, per rank:
//! 1. [`ce_local_stats`] → local `max`, `sumexp` (relative to the local max) and
//!    `target_logit` (0 unless this rank owns the target column);
//! 2. all-reduce `max` with MAX, then [`ce_rescale`] `sumexp` to the global max,
//!    all-reduce `sumexp` and `target_logit` with SUM (or gather the pairs and
//!    fold them with [`ce_merge`]);
//! 3. [`ce_lse`] → `lse`, and `loss = lse - target_logit` for non-ignored rows.
//!
//! Backward: [`cross_entropy_backward`] on each shard with the global `lse`.
//! [`cross_entropy_forward`] is the unsharded composition of these steps.

mod cpu;
pub mod reference;
#[cfg(test)]
mod tests;

use num_traits::Zero;

use tpar_memory::cache::filled;

use crate::util::{bad, check_len, numel};
use crate::{Acc, Float, KernelError, Out, Result};

/// Checks targets: each is `ignore_index` or in `[0, vocab_size)`.
fn check_targets(op: &'static str, targets: &[i64], vocab_size: usize, ignore: i64) -> Result<()> {
    for (position, &t) in targets.iter().enumerate() {
        if t != ignore && (t < 0 || t as u64 >= vocab_size as u64) {
            return Err(KernelError::IndexOutOfRange { op, index: t, position, size: vocab_size });
        }
    }
    Ok(())
}

/// Per-row statistics of a (possibly vocab-sharded) logits block `[rows, v_local]`:
/// `max` (local max, `-inf` for an empty or all `-inf` row), `sumexp` (sum of
/// `exp(logit - max)`, one online pass) and `target_logit` (the target's logit
/// when `targets[r] - vocab_start` falls in `[0, v_local)`, else 0; 0 for ignored
/// rows). A target outside `[0, vocab_size)` that is not `ignore_index` is an
/// `IndexOutOfRange` error (checked before anything is written).
pub fn ce_local_stats<T: Float>(
    logits: &[T],
    rows: usize,
    v_local: usize,
    targets: &[i64],
    vocab_start: i64,
    vocab_size: usize,
    ignore_index: i64,
    max: &mut [T::Acc],
    sumexp: &mut [T::Acc],
    target_logit: &mut [T::Acc],
) -> Result<()> {
    const OP: &str = "ce_local_stats";
    check_len(OP, "logits", logits.len(), numel(OP, &[rows, v_local])?)?;
    check_len(OP, "targets", targets.len(), rows)?;
    check_len(OP, "max", max.len(), rows)?;
    check_len(OP, "sumexp", sumexp.len(), rows)?;
    check_len(OP, "target_logit", target_logit.len(), rows)?;
    let in_vocab = vocab_start >= 0
        && (vocab_start as u64).checked_add(v_local as u64).is_some_and(|e| e <= vocab_size as u64);
    if !in_vocab {
        return Err(bad(
            OP,
            format!("shard [{vocab_start}, +{v_local}) is not inside vocab of size {vocab_size}"),
        ));
    }
    check_targets(OP, targets, vocab_size, ignore_index)?;
    cpu::local_stats(
        logits,
        v_local,
        targets,
        vocab_start,
        ignore_index,
        max,
        sumexp,
        target_logit,
    );
    Ok(())
}

/// Folds another shard's `(other_max, other_sumexp)` into `(max, sumexp)`, row
/// by row: the result is relative to the larger max.
pub fn ce_merge<A: Acc>(
    max: &mut [A],
    sumexp: &mut [A],
    other_max: &[A],
    other_sumexp: &[A],
) -> Result<()> {
    const OP: &str = "ce_merge";
    let n = max.len();
    check_len(OP, "sumexp", sumexp.len(), n)?;
    check_len(OP, "other_max", other_max.len(), n)?;
    check_len(OP, "other_sumexp", other_sumexp.len(), n)?;
    for i in 0..n {
        let m = max[i].max(other_max[i]);
        sumexp[i] = rescale(sumexp[i], max[i], m) + rescale(other_sumexp[i], other_max[i], m);
        max[i] = m;
    }
    Ok(())
}

/// `sumexp * exp(from - to)`, 0 when `from` is `-inf`.
#[inline]
fn rescale<A: Acc>(sumexp: A, from: A, to: A) -> A {
    if from == A::neg_infinity() {
        A::zero()
    } else {
        sumexp * (from - to).exp()
    }
}

/// Rescales local `sumexp` (relative to `local_max`) to be relative to the
/// all-reduced `global_max`, so the shards' values can be summed.
pub fn ce_rescale<A: Acc>(local_max: &[A], sumexp: &mut [A], global_max: &[A]) -> Result<()> {
    const OP: &str = "ce_rescale";
    check_len(OP, "sumexp", sumexp.len(), local_max.len())?;
    check_len(OP, "global_max", global_max.len(), local_max.len())?;
    for ((s, &lm), &gm) in sumexp.iter_mut().zip(local_max).zip(global_max) {
        *s = rescale(*s, lm, gm);
    }
    Ok(())
}

/// `lse = max + ln(sumexp)` (`-inf` when `sumexp` is 0).
pub fn ce_lse<A: Acc>(max: &[A], sumexp: &[A], lse: &mut [A]) -> Result<()> {
    const OP: &str = "ce_lse";
    check_len(OP, "sumexp", sumexp.len(), max.len())?;
    check_len(OP, "lse", lse.len(), max.len())?;
    for ((l, &m), &s) in lse.iter_mut().zip(max).zip(sumexp) {
        *l = if s == A::zero() { A::neg_infinity() } else { m + s.ln() };
    }
    Ok(())
}

/// Unsharded cross-entropy: `loss_rows[r] = lse[r] - logits[r, targets[r]]`
/// (0 for rows whose target is `ignore_index`) and the row `lse`.
/// Returns the number of non-ignored rows (the mean's denominator).
pub fn cross_entropy_forward<T: Float>(
    logits: &[T],
    rows: usize,
    vocab: usize,
    targets: &[i64],
    ignore_index: i64,
    loss_rows: &mut [T::Acc],
    lse: &mut [T::Acc],
) -> Result<usize> {
    check_len("cross_entropy_forward", "loss_rows", loss_rows.len(), rows)?;
    check_len("cross_entropy_forward", "lse", lse.len(), rows)?;
    let zero = T::Acc::zero();
    let (mut max, mut sumexp) = (vec![zero; rows], vec![zero; rows]);
    ce_local_stats(
        logits,
        rows,
        vocab,
        targets,
        0,
        vocab,
        ignore_index,
        &mut max,
        &mut sumexp,
        loss_rows,
    )?;
    ce_lse(&max, &sumexp, lse)?;
    let mut count = 0;
    for ((loss, &l), &t) in loss_rows.iter_mut().zip(lse.iter()).zip(targets) {
        if t == ignore_index {
            *loss = zero;
        } else {
            *loss = l - *loss;
            count += 1;
        }
    }
    Ok(count)
}

/// `dlogits = (softmax(logits) - onehot(target)) * scale` on a vocab shard
/// `[rows, v_local]` starting at column `vocab_start`, given the global `lse`.
///
/// `row_scale` has length `rows` (per-row scales, e.g. `reduction="none"`) or 1
/// (one scale for every row, e.g. `grad_loss / count`). Rows whose target is
/// `ignore_index` get zeros; a target outside this shard contributes only the
/// softmax term. Targets are range-checked by the forward pass. Writes every element
/// of `dlogits`.
pub fn cross_entropy_backward<T: Float, O: Out<T>>(
    logits: &[T],
    rows: usize,
    v_local: usize,
    targets: &[i64],
    vocab_start: i64,
    ignore_index: i64,
    lse: &[T::Acc],
    row_scale: &[T::Acc],
    dlogits: &mut [O],
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let n = numel(OP, &[rows, v_local])?;
    check_len(OP, "logits", logits.len(), n)?;
    check_len(OP, "targets", targets.len(), rows)?;
    check_len(OP, "lse", lse.len(), rows)?;
    if row_scale.len() != 1 && row_scale.len() != rows {
        return Err(bad(
            OP,
            format!("row_scale has {} elements, expected 1 or {rows}", row_scale.len()),
        ));
    }
    check_len(OP, "dlogits", dlogits.len(), n)?;
    cpu::backward(logits, v_local, targets, vocab_start, ignore_index, lse, row_scale, dlogits);
    Ok(())
}

/// [`cross_entropy_backward`] into a new vector.
pub fn cross_entropy_backward_new<T: Float>(
    logits: &[T],
    rows: usize,
    v_local: usize,
    targets: &[i64],
    vocab_start: i64,
    ignore_index: i64,
    lse: &[T::Acc],
    row_scale: &[T::Acc],
) -> Result<Vec<T>> {
    let backward = |dl: &mut [_]| {
        cross_entropy_backward(
            logits,
            rows,
            v_local,
            targets,
            vocab_start,
            ignore_index,
            lse,
            row_scale,
            dl,
        )
    };
    // SAFETY: `cross_entropy_backward` writes every element of `dlogits` when it
    // returns Ok.
    unsafe { filled(logits.len(), backward) }
}
