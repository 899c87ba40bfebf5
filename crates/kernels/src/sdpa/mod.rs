//! Scaled dot-product attention, flash-attention style.
//!
//! The forward pass walks the keys in tiles with an online softmax, so no
//! `[q_len, kv_len]` score matrix is ever materialized; it saves the per-row
//! log-sum-exp (`lse`) from which the backward pass recomputes the
//! probabilities tile by tile, once: a single pass over (key tile, query tile)
//! pairs computes `P` and `dS` and feeds `dv += Pᵀ dO`, `dk += dSᵀ Q` and
//! `dq += dS K` from them (five tile products and one `exp` per score).
//! The forward pass is split over (batch, q head, query block); the backward
//! pass over (batch, kv head), whose task owns its keys' `dk`/`dv` and its q
//! heads' `dq`; when there are fewer than 8 such heads their keys are split in
//! runs with a `dq` partial sum each, added in key order. The split depends on
//! the shape only, so results are deterministic whatever the thread count.
//! Everything accumulates in [`Float::Acc`].
//!
//! A mask that is the same for every query row (a key-padding mask
//! `[b, 1, 1, kv]`, row stride 0) is read once per key tile: tiles whose keys
//! are all masked are skipped, tiles with none masked skip the additions.
//!
//! Grouped-query attention: q head `h` reads kv head `h / (q_heads / kv_heads)`.
//! Causal masking is top-left aligned like PyTorch's `is_causal` (query `i`
//! sees keys `j <= i`). A query row whose keys are all masked gets an output
//! of zeros, `lse = -inf`, and contributes no gradient (PyTorch's behaviour
//! for padded positions), never NaN.

mod cpu;
pub mod reference;
#[cfg(test)]
mod tests;

use tpar_memory::cache::filled;

use crate::util::{bad, check_len, numel};
use crate::{Float, Out, Result};

/// Sizes of an attention call. q is `[batch, q_heads, q_len, head_dim]`, k
/// `[batch, kv_heads, kv_len, head_dim]`, v `[batch, kv_heads, kv_len, v_dim]`,
/// out `[batch, q_heads, q_len, v_dim]`, lse `[batch, q_heads, q_len]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SdpaShape {
    /// Batch size.
    pub batch: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query sequence length.
    pub q_len: usize,
    /// Key/value sequence length.
    pub kv_len: usize,
    /// Query/key head dim.
    pub head_dim: usize,
    /// Value head dim.
    pub v_dim: usize,
    /// Multiplier of `q·k` (usually `1/sqrt(head_dim)`).
    pub scale: f64,
    /// Top-left aligned causal mask: query `i` sees keys `j <= i`.
    pub causal: bool,
}

/// An additive attention mask, broadcast by strides: the element for
/// `(b, h, i, j)` (h a q head) is `data[b*batch_stride + h*head_stride + i*row_stride + j]`.
/// A stride of 0 broadcasts that dim; `-inf` masks a key out.
#[derive(Debug, Clone, Copy)]
pub struct SdpaMask<'a, T> {
    /// Mask values.
    pub data: &'a [T],
    /// Elements between batches (0 = broadcast).
    pub batch_stride: usize,
    /// Elements between q heads (0 = broadcast).
    pub head_stride: usize,
    /// Elements between query rows (0 = broadcast).
    pub row_stride: usize,
}

/// Tile sizes (query rows, key rows) of the CPU kernels. The defaults
/// ([`SdpaTiles::forward`], [`SdpaTiles::backward`]) were measured with
/// `cargo bench -p tpar-kernels --bench sdpa -- tiles` (docs/PERF.md); other
/// sizes give the same results up to rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpaTiles {
    /// Query rows per tile (and per forward task).
    pub q: usize,
    /// Key rows per tile.
    pub k: usize,
}

impl SdpaTiles {
    /// The forward pass's tiles for `s`: 64 query rows and 64 keys below 1024 queries (a
    /// causal diagonal tile wastes less, and `Q Kᵀ` runs on the narrow tile kernel in
    /// f32 with AVX-512), 128 and 128 from there on.
    pub fn forward(s: &SdpaShape) -> SdpaTiles {
        if s.q_len < 1024 {
            SdpaTiles { q: 64, k: 64 }
        } else {
            SdpaTiles { q: 128, k: 128 }
        }
    }

    /// The backward pass's tiles for `s`: 128 query rows, 64 keys.
    pub fn backward(_s: &SdpaShape) -> SdpaTiles {
        SdpaTiles { q: 128, k: 64 }
    }
}

/// Buffer lengths derived from a validated shape.
struct Sizes {
    q: usize,
    k: usize,
    v: usize,
    out: usize,
    lse: usize,
}

/// The offset of the last mask element attention reads for `s` with the
/// mask strides `(batch, head, row)`, or `None` where it overflows; every
/// dim of `s` that indexes the mask (batch, q heads, q and kv lengths) must
/// be non-zero.
pub(crate) fn mask_last_read(s: &SdpaShape, [batch, head, row]: [usize; 3]) -> Option<usize> {
    [(s.batch - 1, batch), (s.q_heads - 1, head), (s.q_len - 1, row), (s.kv_len - 1, 1)]
        .iter()
        .try_fold(0usize, |acc, &(i, st)| i.checked_mul(st)?.checked_add(acc))
}

fn validate<T>(op: &'static str, s: &SdpaShape, mask: Option<&SdpaMask<T>>) -> Result<Sizes> {
    if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
        return Err(bad(op, format!("{s:?}: q_heads must be a multiple of kv_heads > 0")));
    }
    let sizes = Sizes {
        q: numel(op, &[s.batch, s.q_heads, s.q_len, s.head_dim])?,
        k: numel(op, &[s.batch, s.kv_heads, s.kv_len, s.head_dim])?,
        v: numel(op, &[s.batch, s.kv_heads, s.kv_len, s.v_dim])?,
        out: numel(op, &[s.batch, s.q_heads, s.q_len, s.v_dim])?,
        lse: numel(op, &[s.batch, s.q_heads, s.q_len])?,
    };
    if let Some(m) = mask {
        if sizes.lse > 0 && s.kv_len > 0 {
            match mask_last_read(s, [m.batch_stride, m.head_stride, m.row_stride]) {
                Some(last) if last < m.data.len() => {}
                _ => {
                    return Err(bad(
                        op,
                        format!(
                            "{s:?}: mask with strides (batch {}, head {}, row {}) reads past \
                             its {} elements",
                            m.batch_stride,
                            m.head_stride,
                            m.row_stride,
                            m.data.len()
                        ),
                    ))
                }
            }
        }
    }
    Ok(sizes)
}

/// Attention forward: `out = softmax(scale * q kᵀ + mask) v` per (batch, q head),
/// and `lse` = log-sum-exp of the scaled, masked scores of each query row.
/// Writes every element of `out` (a fully masked row gets zeros).
pub fn sdpa_forward<T: Float, O: Out<T>>(
    s: &SdpaShape,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    out: &mut [O],
    lse: &mut [T::Acc],
) -> Result<()> {
    sdpa_forward_tiled(s, SdpaTiles::forward(s), q, k, v, mask, out, lse)
}

/// [`sdpa_forward`] with `out` in a new vector.
pub fn sdpa_forward_new<T: Float>(
    s: &SdpaShape,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    lse: &mut [T::Acc],
) -> Result<Vec<T>> {
    let n = numel("sdpa_forward", &[s.batch, s.q_heads, s.q_len, s.v_dim])?;
    // SAFETY: `sdpa_forward` writes every element of `out` when it returns Ok.
    unsafe { filled(n, |out| sdpa_forward(s, q, k, v, mask, out, lse)) }
}

/// [`sdpa_forward`] with explicit tile sizes (for tuning; sizes of 0 count as 1).
pub fn sdpa_forward_tiled<T: Float, O: Out<T>>(
    s: &SdpaShape,
    tiles: SdpaTiles,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    out: &mut [O],
    lse: &mut [T::Acc],
) -> Result<()> {
    const OP: &str = "sdpa_forward";
    let z = validate(OP, s, mask)?;
    check_len(OP, "q", q.len(), z.q)?;
    check_len(OP, "k", k.len(), z.k)?;
    check_len(OP, "v", v.len(), z.v)?;
    check_len(OP, "out", out.len(), z.out)?;
    check_len(OP, "lse", lse.len(), z.lse)?;
    cpu::forward(s, tiles, q, k, v, mask, out, lse);
    Ok(())
}

/// Attention backward from the forward's `out` and `lse`: writes `dq`, `dk`
/// and `dv` (overwritten; `dk`/`dv` sum over the q heads of each group).
/// No gradient is produced for the mask.
pub fn sdpa_backward<T: Float>(
    s: &SdpaShape,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    out: &[T],
    lse: &[T::Acc],
    dout: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) -> Result<()> {
    sdpa_backward_tiled(s, SdpaTiles::backward(s), q, k, v, mask, out, lse, dout, dq, dk, dv)
}

/// [`sdpa_backward`] with explicit tile sizes (for tuning; sizes of 0 count as 1).
pub fn sdpa_backward_tiled<T: Float>(
    s: &SdpaShape,
    tiles: SdpaTiles,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&SdpaMask<T>>,
    out: &[T],
    lse: &[T::Acc],
    dout: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) -> Result<()> {
    const OP: &str = "sdpa_backward";
    let z = validate(OP, s, mask)?;
    check_len(OP, "q", q.len(), z.q)?;
    check_len(OP, "k", k.len(), z.k)?;
    check_len(OP, "v", v.len(), z.v)?;
    check_len(OP, "out", out.len(), z.out)?;
    check_len(OP, "lse", lse.len(), z.lse)?;
    check_len(OP, "dout", dout.len(), z.out)?;
    check_len(OP, "dq", dq.len(), z.q)?;
    check_len(OP, "dk", dk.len(), z.k)?;
    check_len(OP, "dv", dv.len(), z.v)?;
    cpu::backward(s, tiles, q, k, v, mask, out, lse, dout, dq, dk, dv);
    Ok(())
}
