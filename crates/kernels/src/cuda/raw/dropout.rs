//! Launch wrapper for `cuda/dropout.cu`: the dropout mask of
//! [`crate::dropout`] applied on the device, bit for bit what the CPU kernel
//! writes.

use bytemuck::{Pod, Zeroable};

use super::layout::grid_for;
use super::{bad, check_aligned, check_ptrs, numel, to_i64};
use crate::cuda::{launch, CudaDType, DevPtr, Launcher};
use crate::dropout::{DropoutMask, ShardRuns};
use crate::Result;

/// Threads per block.
const THREADS: u32 = 256;
/// Most dims outside a shard's runs ([`ShardRuns::outer`]) the kernel takes.
pub const MAX_RANK: usize = 6;
/// The u64 words of a device state ([`dropout`]).
pub const STATE_WORDS: usize = 5;

/// The device state words that make the kernel draw the stream of `seed` from word
/// `offset` on ([`dropout`]): the offset, then the key's eight words two at a time.
pub fn state_words(seed: u64, offset: u64) -> [u64; STATE_WORDS] {
    let key = crate::dropout::key_of(seed);
    let pair = |i: usize| u64::from(key[2 * i]) | (u64::from(key[2 * i + 1]) << 32);
    [offset, pair(0), pair(1), pair(2), pair(3)]
}

/// Arguments of `tpar_dropout_<dtype>`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct DropoutArgs {
    /// Input.
    pub x: DevPtr,
    /// Output.
    pub y: DevPtr,
    /// 0, or a device [`STATE_WORDS`]-word state read when the kernel runs
    /// ([`dropout`]).
    pub state: DevPtr,
    /// The ChaCha8 key.
    pub key: [u32; 8],
    /// The stream word of the whole tensor's element 0.
    pub offset: u64,
    /// Words below it drop their element.
    pub threshold: u64,
    /// Elements per run.
    pub run: i64,
    /// Runs in the shard.
    pub runs: i64,
    /// Threads per run (the ChaCha blocks a run's words can touch).
    pub blocks_per_run: i64,
    /// The whole tensor's position of the shard's first element.
    pub base: i64,
    /// Extents of the dims outside the runs (the last innermost).
    pub extent: [i64; MAX_RANK],
    /// Their strides in the whole tensor.
    pub stride: [i64; MAX_RANK],
    /// Dims in `extent` / `stride`.
    pub rank: i32,
    /// Factor of kept elements (rounded to f32).
    pub scale: f32,
}

/// `y = x * mask` for the shard `runs` of the mask's tensor (the CPU
/// [`crate::dropout::dropout`]): `x` and `y` hold the shard's `run * runs`
/// elements of `dtype`. With a `state` address (a device buffer of
/// [`STATE_WORDS`] u64s, [`state_words`]), the kernel reads it when it runs:
/// its offset is added to `mask.offset` and its key replaces `mask.key`, so a
/// CUDA graph that captured the launch draws, on each replay, the words the
/// state then names.
///
/// # Errors
/// [`crate::KernelError::BadArguments`] for a shard with more than
/// [`MAX_RANK`] outer dims, sizes that overflow, or null or misaligned
/// addresses.
///
/// # Safety
/// `x` and `y` must be device addresses valid for the shard's elements of
/// `dtype`; `y` may equal `x` but not overlap it otherwise; a `state` must be
/// valid for [`STATE_WORDS`] u64s when the kernel runs.
pub unsafe fn dropout(
    l: &dyn Launcher,
    dtype: CudaDType,
    mask: &DropoutMask,
    runs: &ShardRuns,
    x: DevPtr,
    y: DevPtr,
    state: Option<DevPtr>,
) -> Result<()> {
    const OP: &str = "dropout";
    let es = dtype.size();
    let n = runs.elements()?;
    numel(OP, &[n, es])?;
    if n == 0 {
        return Ok(());
    }
    if runs.outer.len() > MAX_RANK {
        return Err(bad(
            OP,
            format!("a shard with {} dims outside its runs (at most {MAX_RANK})", runs.outer.len()),
        ));
    }
    let ptrs = [("x", x), ("y", y)];
    check_ptrs(OP, &ptrs)?;
    check_aligned(OP, es, &ptrs)?;
    if let Some(s) = state {
        check_ptrs(OP, &[("state", s)])?;
        check_aligned(OP, 8, &[("state", s)])?;
    }
    let blocks_per_run = runs.run.div_ceil(16) + 1;
    let items = numel(OP, &[runs.runs, blocks_per_run])?;
    let (mut extent, mut stride) = ([1i64; MAX_RANK], [0i64; MAX_RANK]);
    for (d, &(e, s)) in runs.outer.iter().enumerate() {
        extent[d] = to_i64(OP, "extent", e)?;
        stride[d] = i64::try_from(s).map_err(|_| bad(OP, format!("stride {s} overflows")))?;
    }
    let base = i64::try_from(runs.base).map_err(|_| bad(OP, "the shard's position overflows"))?;
    let args = DropoutArgs {
        x,
        y,
        state: state.unwrap_or(0),
        key: mask.key,
        offset: mask.offset,
        threshold: mask.threshold,
        run: to_i64(OP, "run", runs.run)?,
        runs: to_i64(OP, "runs", runs.runs)?,
        blocks_per_run: to_i64(OP, "blocks", blocks_per_run)?,
        base,
        extent,
        stride,
        rank: runs.outer.len() as i32,
        scale: mask.scale as f32,
    };
    let kernel = format!("tpar_dropout_{}", dtype.suffix());
    // SAFETY: the caller guarantees the addresses.
    unsafe { launch(l, &kernel, grid_for(items, THREADS), &args) }
}
