//! Embedding lookup and its scatter-add gradient, with an optional
//! vocab-sharded mode (`masked`): a rank holds rows `[vocab_start,
//! vocab_start + vocab)` of the global table and ids outside its slice give
//! zero rows (the partial outputs are then summed across ranks).

mod cpu;
pub mod reference;
#[cfg(test)]
mod tests;

use tpar_memory::cache::filled;

use crate::util::{check_len, numel};
use crate::{Float, KernelError, Out, Result};

/// Checks every id (before anything is written) unless `masked`.
fn check_ids(
    op: &'static str,
    ids: &[i64],
    vocab_start: i64,
    vocab: usize,
    masked: bool,
) -> Result<()> {
    if masked {
        return Ok(());
    }
    for (position, &id) in ids.iter().enumerate() {
        if cpu::local_row(id, vocab_start, vocab).is_none() {
            return Err(KernelError::IndexOutOfRange { op, index: id, position, size: vocab });
        }
    }
    Ok(())
}

/// `out[n] = weight[ids[n] - vocab_start]` for `weight: [vocab, dim]`,
/// `out: [ids.len(), dim]`.
///
/// An id outside `[vocab_start, vocab_start + vocab)` gives a zero row when
/// `masked` (vocab-sharded embedding), else an `IndexOutOfRange` error (all
/// ids are checked before anything is written). Writes every element of `out`.
pub fn embedding_forward<T: Float, O: Out<T>>(
    weight: &[T],
    vocab: usize,
    dim: usize,
    ids: &[i64],
    vocab_start: i64,
    masked: bool,
    out: &mut [O],
) -> Result<()> {
    const OP: &str = "embedding_forward";
    check_len(OP, "weight", weight.len(), numel(OP, &[vocab, dim])?)?;
    check_len(OP, "out", out.len(), numel(OP, &[ids.len(), dim])?)?;
    check_ids(OP, ids, vocab_start, vocab, masked)?;
    cpu::forward(weight, vocab, dim, ids, vocab_start, out);
    Ok(())
}

/// [`embedding_forward`] with `out` in a new vector.
pub fn embedding_forward_new<T: Float>(
    weight: &[T],
    vocab: usize,
    dim: usize,
    ids: &[i64],
    vocab_start: i64,
    masked: bool,
) -> Result<Vec<T>> {
    let n = numel("embedding_forward", &[ids.len(), dim])?;
    // SAFETY: `embedding_forward` writes every element of `out` when it returns Ok.
    unsafe { filled(n, |o| embedding_forward(weight, vocab, dim, ids, vocab_start, masked, o)) }
}

/// `dweight[v] = sum of dout[n] over n with ids[n] - vocab_start == v`
/// (overwritten; accumulated in [`Float::Acc`] in id order, so deterministic).
///
/// Ids outside this slice are skipped when `masked`, else an error.
pub fn embedding_backward<T: Float>(
    ids: &[i64],
    vocab_start: i64,
    masked: bool,
    dout: &[T],
    vocab: usize,
    dim: usize,
    dweight: &mut [T],
) -> Result<()> {
    const OP: &str = "embedding_backward";
    check_len(OP, "dout", dout.len(), numel(OP, &[ids.len(), dim])?)?;
    check_len(OP, "dweight", dweight.len(), numel(OP, &[vocab, dim])?)?;
    check_ids(OP, ids, vocab_start, vocab, masked)?;
    cpu::backward(ids, vocab_start, dout, vocab, dim, dweight);
    Ok(())
}
