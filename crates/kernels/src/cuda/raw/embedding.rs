//! Embedding lookup and its gradient (`cuda/embedding.cu`), as the CPU
//! kernels of [`crate::embedding`], with the vocab-sharded (`masked`) mode.
//!
//! Two gradients:
//! - [`embedding_backward_csr`]: deterministic and equal to the CPU kernel
//!   (same summation order). It needs the positions of each table row, which
//!   [`EmbeddingCsr::build`] computes on the host from the ids (a counting
//!   sort, `O(ids + vocab)`; token ids usually come from the host anyway) and
//!   which the caller uploads.
//! - [`embedding_backward_sorted`]: the same sums from the ids alone: the
//!   CSR is built on the device (a stable radix sort of the positions by
//!   row), so nothing goes through the host and every run gives the CPU
//!   kernel's bits.
//! - [`embedding_backward_atomic`]: from the ids alone, with f32 `atomicAdd`s
//!   into an f32 accumulator; on a GPU the order of additions into a repeated
//!   row varies between runs, so results can differ in the last bits.
//!
//! A GPU kernel cannot return an error: ids outside the slice without
//! `masked` lower an optional i32 *error slot* (set it to [`NO_ERROR`] before
//! the launch) to the first offending position, and are otherwise treated as
//! masked (zero rows, no gradient).

use bytemuck::{Pod, Zeroable};

use super::{bad, check_ptr, to_i32};
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::{KernelError, Result};

/// The value of an error slot when no invalid id was found. Slots are
/// lowered with `atomicMin` to the first offending position.
pub const NO_ERROR: i32 = i32::MAX;

/// Arguments of `tpar_embedding_fwd_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbFwdArgs {
    /// Table slice `[vocab, dim]`.
    pub weight: DevPtr,
    /// i64 ids `[n]` (global).
    pub ids: DevPtr,
    /// Output `[n, dim]`.
    pub out: DevPtr,
    /// i32 error slot, or 0 for none.
    pub error: DevPtr,
    /// Global id of the slice's first row.
    pub vocab_start: i64,
    /// Rows of the slice.
    pub vocab: i32,
    /// Row length.
    pub dim: i32,
    /// Ids.
    pub n: i32,
    /// Threads per row (a power of two up to 256).
    pub group: i32,
    /// 1: ids outside the slice are expected (zero rows); 0: they are errors.
    pub masked: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_embedding_bwd_atomic_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbBwdAtomicArgs {
    /// i64 ids `[n]`.
    pub ids: DevPtr,
    /// Output gradient `[n, dim]`.
    pub dout: DevPtr,
    /// f32 accumulator `[vocab, dim]` (added to).
    pub acc: DevPtr,
    /// i32 error slot, or 0 for none.
    pub error: DevPtr,
    /// Global id of the slice's first row.
    pub vocab_start: i64,
    /// Rows of the slice.
    pub vocab: i32,
    /// Row length.
    pub dim: i32,
    /// Ids.
    pub n: i32,
    /// Threads per position (a power of two up to 256).
    pub group: i32,
    /// 1: ids outside the slice are skipped; 0: they are errors.
    pub masked: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_embedding_bwd_csr_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbBwdCsrArgs {
    /// i32 `[vocab + 1]`: row `v`'s positions are `positions[row_start[v]..row_start[v + 1]]`.
    pub row_start: DevPtr,
    /// i32 positions, increasing within each row.
    pub positions: DevPtr,
    /// Output gradient `[n, dim]`.
    pub dout: DevPtr,
    /// Table gradient `[vocab, dim]` (overwritten).
    pub dweight: DevPtr,
    /// Rows of the slice.
    pub vocab: i32,
    /// Row length.
    pub dim: i32,
    /// Threads per table row (a power of two up to 256).
    pub group: i32,
    /// Padding.
    pub pad: i32,
}

/// Arguments of `tpar_embedding_sort_hist`, `_scan` and `_scatter` (one pass
/// of [`embedding_backward_sorted`]'s radix sort).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbSortArgs {
    /// i64 ids `[n]`: the first pass's keys (`keys_in` 0).
    pub ids: DevPtr,
    /// i32 keys `[n]` of the previous pass, or 0.
    pub keys_in: DevPtr,
    /// i32 positions `[n]` of the previous pass, or 0 (the index).
    pub pos_in: DevPtr,
    /// i32 keys `[n]` written by the scatter.
    pub keys_out: DevPtr,
    /// i32 positions `[n]` written by the scatter.
    pub pos_out: DevPtr,
    /// u32 `[256 * tiles]`, digit-major.
    pub hist: DevPtr,
    /// Global id of the slice's first row.
    pub vocab_start: i64,
    /// Rows of the slice (the key of an id outside it).
    pub vocab: i32,
    /// Ids.
    pub n: i32,
    /// The pass's digit: key bits `shift..shift + 8`.
    pub shift: i32,
    /// Tiles of [`SORT_TILE`] positions.
    pub tiles: i32,
}

/// Arguments of `tpar_embedding_csr_starts`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbStartsArgs {
    /// i32 sorted keys `[n]`, each in `0..=vocab`.
    pub keys: DevPtr,
    /// i32 `[vocab + 1]` written.
    pub row_start: DevPtr,
    /// Keys.
    pub n: i32,
    /// Rows of the slice.
    pub vocab: i32,
}

/// Positions per tile of the radix sort (`kSortTile` in `cuda/embedding.cu`).
pub const SORT_TILE: usize = 2048;
/// Threads of the radix sort's scan block (`kScanThreads`).
const SCAN_THREADS: u32 = 1024;

/// Bytes of device scratch [`embedding_backward_sorted`] needs for `n` ids and
/// a slice of `vocab` rows: two key and position arrays, the row offsets and
/// the sort's histograms (4 bytes each).
pub fn sorted_scratch_bytes(n: usize, vocab: usize) -> usize {
    4 * (4 * n + vocab + 1 + 256 * n.div_ceil(SORT_TILE))
}

/// Arguments of `tpar_embedding_zero_f32`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbZeroArgs {
    /// f32 buffer to zero.
    pub acc: DevPtr,
    /// Elements.
    pub n: i64,
}

/// Arguments of `tpar_embedding_check_ids`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbCheckArgs {
    /// i64 ids `[n]`.
    pub ids: DevPtr,
    /// i32 error slot.
    pub error: DevPtr,
    /// Ids must be in `[0, size)`.
    pub size: i64,
    /// Ids.
    pub n: i64,
}

/// Arguments of `tpar_embedding_cast_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct EmbCastArgs {
    /// f32 source.
    pub acc: DevPtr,
    /// Destination in the kernel's dtype.
    pub dweight: DevPtr,
    /// Elements.
    pub n: i64,
}

/// Positions of each row of a table slice in an id list, sorted, in CSR form
/// (the input of [`embedding_backward_csr`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddingCsr {
    /// `vocab + 1` offsets: row `v`'s positions are
    /// `positions[row_start[v]..row_start[v + 1]]`.
    pub row_start: Vec<i32>,
    /// Positions (indices into the ids) of ids inside the slice, grouped by
    /// row and increasing within each row.
    pub positions: Vec<i32>,
}

impl EmbeddingCsr {
    /// Groups the positions of `ids` by local row `id - vocab_start` of a
    /// slice of `vocab` rows (a stable counting sort). Ids outside the slice
    /// are skipped when `masked`, else the first is an `IndexOutOfRange`
    /// error, as in [`crate::embedding::embedding_backward`].
    pub fn build(ids: &[i64], vocab_start: i64, vocab: usize, masked: bool) -> Result<Self> {
        const OP: &str = "embedding_csr";
        to_i32(OP, "ids", ids.len())?;
        to_i32(OP, "vocab", vocab)?;
        let local =
            |id: i64| id.checked_sub(vocab_start).filter(|&r| r >= 0 && (r as u64) < vocab as u64);
        let mut row_start = vec![0i32; vocab + 1];
        for (position, &id) in ids.iter().enumerate() {
            match local(id) {
                Some(r) => row_start[r as usize + 1] += 1,
                None if masked => {}
                None => {
                    return Err(KernelError::IndexOutOfRange {
                        op: OP,
                        index: id,
                        position,
                        size: vocab,
                    })
                }
            }
        }
        for v in 0..vocab {
            row_start[v + 1] += row_start[v];
        }
        let mut fill = row_start.clone();
        let mut positions = vec![0i32; row_start[vocab] as usize];
        for (n, &id) in ids.iter().enumerate() {
            if let Some(r) = local(id) {
                let slot = &mut fill[r as usize];
                positions[*slot as usize] = n as i32;
                *slot += 1;
            }
        }
        Ok(EmbeddingCsr { row_start, positions })
    }
}

/// Threads per block of every embedding kernel.
const BLOCK: u32 = 256;
/// Most blocks launched; kernels stride over the remaining rows.
const MAX_BLOCKS: usize = 1 << 20;

/// `rows * dim`, both within i32.
fn check_matrix(op: &'static str, what: &str, rows: usize, dim: usize) -> Result<usize> {
    to_i32(op, what, rows)?;
    to_i32(op, "dim", dim)?;
    Ok(rows * dim)
}

/// `(group, launch)` for `rows` rows of `dim` elements of `dtype`: about one
/// 16-byte vector per thread of a group, groups packed into 256-thread blocks.
fn group_launch(rows: usize, dim: usize, dtype: CudaDType) -> (i32, LaunchConfig) {
    let units = dim.div_ceil(16 / dtype.size()).max(1);
    let group = units.next_power_of_two().clamp(4, BLOCK as usize);
    let per_block = BLOCK as usize / group;
    let blocks = rows.div_ceil(per_block).clamp(1, MAX_BLOCKS) as u32;
    (group as i32, LaunchConfig::linear(blocks, BLOCK))
}

/// `out[p] = weight[ids[p] - vocab_start]` for a table slice `weight`
/// `[vocab, dim]` (`dtype`), `out` `[n, dim]`, as
/// [`crate::embedding::embedding_forward`]. Ids outside
/// `[vocab_start, vocab_start + vocab)` give zero rows; unless `masked` they
/// also lower the optional i32 `error` slot (0 for none) to their position.
///
/// # Safety
/// `weight`, `ids` (i64 `[n]`) and `out` must be device buffers of the stated
/// sizes, `out` not overlapping the others.
pub unsafe fn embedding_forward(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    weight: DevPtr,
    vocab: usize,
    dim: usize,
    ids: DevPtr,
    n: usize,
    vocab_start: i64,
    masked: bool,
    out: DevPtr,
    error: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_embedding_forward";
    let wn = check_matrix(OP, "vocab", vocab, dim)?;
    let on = check_matrix(OP, "ids", n, dim)?;
    check_ptr(OP, "weight", weight, wn, dtype.size())?;
    check_ptr(OP, "ids", ids, n, 8)?;
    check_ptr(OP, "out", out, on, dtype.size())?;
    check_ptr(OP, "error", error, 0, 4)?;
    if n == 0 || dim == 0 {
        return Ok(());
    }
    let (group, cfg) = group_launch(n, dim, dtype);
    let args = EmbFwdArgs {
        weight,
        ids,
        out,
        error,
        vocab_start,
        vocab: vocab as i32,
        dim: dim as i32,
        n: n as i32,
        group,
        masked: i32::from(masked),
        pad: 0,
    };
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, &format!("tpar_embedding_fwd_{}", dtype.suffix()), cfg, &args) }
}

/// Deterministic embedding gradient: `dweight[v] = sum of dout[p]` over the
/// positions `p` of table row `v`, in increasing `p`, accumulated in f32 and
/// rounded once (zeros for unused rows; overwritten) — the CPU kernel's
/// [`crate::embedding::embedding_backward`] result. `row_start`
/// (i32 `[vocab + 1]`) and `positions` (i32 `[n_positions]`) are an
/// [`EmbeddingCsr`] built from the ids and uploaded; `dout` is `[n, dim]`.
///
/// One group of threads per table row, so a row used by very many positions
/// (e.g. a padding id) is summed serially by one group.
///
/// # Safety
/// The buffers must have the stated sizes; the CSR must be consistent (as
/// built by [`EmbeddingCsr::build`] for these `vocab` and `n`): offsets
/// non-decreasing up to `n_positions`, positions below `n`.
pub unsafe fn embedding_backward_csr(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    row_start: DevPtr,
    positions: DevPtr,
    n_positions: usize,
    dout: DevPtr,
    n: usize,
    vocab: usize,
    dim: usize,
    dweight: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_embedding_backward_csr";
    let dn = check_matrix(OP, "ids", n, dim)?;
    let wn = check_matrix(OP, "vocab", vocab, dim)?;
    if n_positions > n {
        return Err(bad(OP, format!("{n_positions} positions for {n} ids")));
    }
    check_ptr(OP, "row_start", row_start, vocab + 1, 4)?;
    check_ptr(OP, "positions", positions, n_positions, 4)?;
    check_ptr(OP, "dout", dout, dn, dtype.size())?;
    check_ptr(OP, "dweight", dweight, wn, dtype.size())?;
    if vocab == 0 || dim == 0 {
        return Ok(());
    }
    let (group, cfg) = group_launch(vocab, dim, dtype);
    let args = EmbBwdCsrArgs {
        row_start,
        positions,
        dout,
        dweight,
        vocab: vocab as i32,
        dim: dim as i32,
        group,
        pad: 0,
    };
    // SAFETY: the caller vouches for the addresses and the CSR; sizes are checked above.
    unsafe { launch(launcher, &format!("tpar_embedding_bwd_csr_{}", dtype.suffix()), cfg, &args) }
}

/// Deterministic embedding gradient from the ids alone, on the device:
/// [`embedding_backward_csr`]'s result (the CPU kernel's sums, in position
/// order, the same bits every run) with the CSR built by kernels instead of
/// the host. The positions are sorted by local row `ids[p] - vocab_start`
/// with a stable LSD radix sort of 8-bit digits (one pass per byte of
/// `vocab`: a histogram per tile of [`SORT_TILE`] positions, one scan, one
/// scatter), the row offsets are read off the sorted keys, and the CSR kernel
/// sums. Ids outside the slice are skipped (the forward reports them).
/// `scratch` holds [`sorted_scratch_bytes`]`(n, vocab)` bytes of device memory.
///
/// # Safety
/// `ids` (i64 `[n]`), `dout` (`[n, dim]`), `dweight` (`[vocab, dim]`,
/// overwritten) and `scratch` must be device buffers of those sizes, `dweight`
/// and `scratch` overlapping nothing.
pub unsafe fn embedding_backward_sorted(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    ids: DevPtr,
    n: usize,
    vocab_start: i64,
    dout: DevPtr,
    vocab: usize,
    dim: usize,
    dweight: DevPtr,
    scratch: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_embedding_backward_sorted";
    let dn = check_matrix(OP, "ids", n, dim)?;
    let wn = check_matrix(OP, "vocab", vocab, dim)?;
    // The key of an id outside the slice is `vocab`, and `row_start` has vocab + 1.
    to_i32(OP, "vocab + 1", vocab + 1)?;
    check_ptr(OP, "ids", ids, n, 8)?;
    check_ptr(OP, "dout", dout, dn, dtype.size())?;
    check_ptr(OP, "dweight", dweight, wn, dtype.size())?;
    check_ptr(OP, "scratch", scratch, sorted_scratch_bytes(n, vocab) / 4, 4)?;
    if wn == 0 {
        return Ok(());
    }
    let at = |words: usize| scratch + 4 * words as DevPtr;
    let (keys, pos) = ([at(0), at(2 * n)], [at(n), at(3 * n)]);
    let row_start = at(4 * n);
    let hist = at(4 * n + vocab + 1);
    let tiles = n.div_ceil(SORT_TILE);
    // Bits of the largest key (`vocab`), one pass per 8.
    let bits = (usize::BITS - vocab.leading_zeros()) as usize;
    let passes = bits.div_ceil(8).max(1);
    let mut last = 0;
    if n > 0 {
        for pass in 0..passes {
            let (src, dst) = (pass % 2, (pass + 1) % 2);
            let args = EmbSortArgs {
                ids,
                keys_in: if pass == 0 { 0 } else { keys[src] },
                pos_in: if pass == 0 { 0 } else { pos[src] },
                keys_out: keys[dst],
                pos_out: pos[dst],
                hist,
                vocab_start,
                vocab: vocab as i32,
                n: n as i32,
                shift: 8 * pass as i32,
                tiles: tiles as i32,
            };
            let grid = LaunchConfig::linear(tiles as u32, BLOCK);
            // SAFETY: the sort reads `ids` (or the previous pass's arrays) and writes
            // `n` keys and positions and `256 * tiles` counts inside `scratch`, whose
            // size is checked above.
            unsafe {
                launch(launcher, "tpar_embedding_sort_hist", grid, &args)?;
                launch(
                    launcher,
                    "tpar_embedding_sort_scan",
                    LaunchConfig::linear(1, SCAN_THREADS),
                    &args,
                )?;
                launch(launcher, "tpar_embedding_sort_scatter", grid, &args)?;
            }
            last = dst;
        }
    }
    let starts = EmbStartsArgs { keys: keys[last], row_start, n: n as i32, vocab: vocab as i32 };
    let cfg = LaunchConfig::for_items(n + 1, BLOCK, 4096);
    // SAFETY: the keys are the sorted ones just written (each in 0..=vocab), and
    // `row_start` holds vocab + 1 offsets inside `scratch`.
    unsafe { launch(launcher, "tpar_embedding_csr_starts", cfg, &starts)? };
    // SAFETY: the offsets and positions are a consistent CSR of `n` ids over
    // `vocab` rows (sorted on the device above); the other buffers are checked.
    unsafe {
        embedding_backward_csr(
            launcher, dtype, row_start, pos[last], n, dout, n, vocab, dim, dweight,
        )
    }
}

/// Embedding gradient from the ids alone: zeroes the f32 accumulator `acc`
/// `[vocab, dim]`, adds every `dout[p]` (`[n, dim]`, `dtype`) into row
/// `ids[p] - vocab_start` with f32 `atomicAdd`, then writes `dweight`
/// (`dtype`, overwritten). For f32, `acc` may be `dweight` itself (no copy).
/// Ids outside the slice are skipped; unless `masked` they lower the optional
/// i32 `error` slot (0 for none).
///
/// The order of additions into a repeated row is not fixed on a GPU, so the
/// result may vary in the last bits between runs; [`embedding_backward_csr`]
/// is the deterministic alternative.
///
/// # Safety
/// The buffers must have the stated sizes; `acc` must not overlap `dout` or
/// `ids`, and overlaps `dweight` only by being it (f32).
pub unsafe fn embedding_backward_atomic(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    ids: DevPtr,
    n: usize,
    vocab_start: i64,
    masked: bool,
    dout: DevPtr,
    vocab: usize,
    dim: usize,
    dweight: DevPtr,
    acc: DevPtr,
    error: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_embedding_backward_atomic";
    let dn = check_matrix(OP, "ids", n, dim)?;
    let wn = check_matrix(OP, "vocab", vocab, dim)?;
    check_ptr(OP, "ids", ids, n, 8)?;
    check_ptr(OP, "dout", dout, dn, dtype.size())?;
    check_ptr(OP, "dweight", dweight, wn, dtype.size())?;
    check_ptr(OP, "acc", acc, wn, 4)?;
    check_ptr(OP, "error", error, 0, 4)?;
    if acc == dweight && dtype != CudaDType::F32 && wn > 0 {
        return Err(bad(OP, "acc may be dweight only for f32 gradients"));
    }
    if wn == 0 {
        return Ok(());
    }
    let items = LaunchConfig::for_items(wn, BLOCK, 4096);
    let zero = EmbZeroArgs { acc, n: wn as i64 };
    // SAFETY: `acc` holds `wn` f32 values (checked above, vouched for by the caller).
    unsafe { launch(launcher, "tpar_embedding_zero_f32", items, &zero)? };
    if n > 0 {
        let (group, cfg) = group_launch(n, dim, dtype);
        let args = EmbBwdAtomicArgs {
            ids,
            dout,
            acc,
            error,
            vocab_start,
            vocab: vocab as i32,
            dim: dim as i32,
            n: n as i32,
            group,
            masked: i32::from(masked),
            pad: 0,
        };
        let name = format!("tpar_embedding_bwd_atomic_{}", dtype.suffix());
        // SAFETY: the caller vouches for the addresses; sizes are checked above.
        unsafe { launch(launcher, &name, cfg, &args)? };
    }
    if acc == dweight {
        return Ok(());
    }
    let args = EmbCastArgs { acc, dweight, n: wn as i64 };
    let cfg = LaunchConfig::for_items(wn, BLOCK, 4096);
    // SAFETY: `acc` and `dweight` hold `wn` elements each (checked above).
    unsafe { launch(launcher, &format!("tpar_embedding_cast_{}", dtype.suffix()), cfg, &args) }
}

/// Checks `n` i64 `ids` against `[0, size)`: an id outside lowers the i32
/// `error` slot to its position (set the slot to [`NO_ERROR`] first). The
/// global range check of a vocab-sharded lookup, whose kernels mask ids
/// outside their slice instead of reporting them.
///
/// # Safety
/// `ids` must hold `n` i64 values and `error` one i32, in the launcher's memory.
pub unsafe fn embedding_check_ids(
    launcher: &dyn Launcher,
    ids: DevPtr,
    n: usize,
    size: usize,
    error: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_embedding_check_ids";
    check_ptr(OP, "ids", ids, n, 8)?;
    check_ptr(OP, "error", error, 1, 4)?;
    if error == 0 {
        return Err(bad(OP, "needs an error slot"));
    }
    if n == 0 {
        return Ok(());
    }
    let args = EmbCheckArgs { ids, error, size: size.min(i64::MAX as usize) as i64, n: n as i64 };
    let cfg = LaunchConfig::for_items(n, BLOCK, 4096);
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, "tpar_embedding_check_ids", cfg, &args) }
}
