//! Multi-tensor kernels (`cuda/multi.cu`): one launch over up to
//! [`MULTI_MAX`] tensors of one dtype, as PyTorch's foreach ops, for
//! gradient-norm clipping: the sum of squares of each tensor
//! ([`sum_squares_each`]) and each tensor times one device scalar
//! ([`scale_each`]).
//!
//! Tensor `t`'s elements are cut into chunks of [`CHUNK`] elements, one block
//! each, so a launch has as many blocks as its tensors' chunks and tensors of
//! any sizes share it. More tensors than [`MULTI_MAX`] take more launches.
//! Each tensor's sum of squares is folded from its own chunks' f32 partials in
//! order: it depends on that tensor alone, and is deterministic.

use bytemuck::{Pod, Zeroable};

use super::{bad, check_ptr, to_i32, to_i64};
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::Result;

/// Tensors per launch.
pub const MULTI_MAX: usize = 32;
/// Elements per block.
pub const CHUNK: usize = 16384;
/// Threads per block (the final fold of the sums runs one warp per tensor).
const THREADS: u32 = 256;

/// Arguments of `tpar_multi_sumsq_*` and `tpar_multi_sumsq_final`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct MultiSumSqArgs {
    /// Tensor `t`'s first element.
    pub x: [DevPtr; MULTI_MAX],
    /// Tensor `t`'s elements.
    pub n: [i64; MULTI_MAX],
    /// Tensor `t`'s first block (its blocks end at the next tensor's first, the
    /// last tensor's at `total`).
    pub first: [i32; MULTI_MAX],
    /// Blocks in all.
    pub total: i32,
    /// Tensors used.
    pub count: i32,
    /// f32 per-block sums (`first[count]` of them).
    pub partial: DevPtr,
    /// f32 per-tensor sums (`count` of them).
    pub out: DevPtr,
}

/// Arguments of `tpar_multi_scale_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct MultiScaleArgs {
    /// Tensor `t`'s first element.
    pub x: [DevPtr; MULTI_MAX],
    /// Output `t` (as long as tensor `t`).
    pub y: [DevPtr; MULTI_MAX],
    /// Tensor `t`'s elements.
    pub n: [i64; MULTI_MAX],
    /// Tensor `t`'s first block (its blocks end at the next tensor's first, the
    /// last tensor's at `total`).
    pub first: [i32; MULTI_MAX],
    /// Blocks in all.
    pub total: i32,
    /// Tensors used.
    pub count: i32,
    /// The f32 scalar multiplied in.
    pub coef: DevPtr,
}

/// Blocks of a tensor of `n` elements.
fn blocks_of(n: usize) -> usize {
    n.div_ceil(CHUNK)
}

/// f32 partials [`sum_squares_each`] needs for tensors of `lens` elements: the
/// most any one launch's group of [`MULTI_MAX`] tensors needs.
pub fn sum_squares_each_workspace_len(lens: &[usize]) -> usize {
    lens.chunks(MULTI_MAX).map(|g| g.iter().map(|&n| blocks_of(n)).sum()).max().unwrap_or(0)
}

/// Each tensor's first block for one group of lengths, and the blocks in all.
pub(super) fn block_starts(op: &'static str, lens: &[usize]) -> Result<([i32; MULTI_MAX], i32)> {
    let mut first = [0i32; MULTI_MAX];
    let mut at = 0usize;
    for (f, &n) in first.iter_mut().zip(lens) {
        *f = to_i32(op, "blocks", at)?;
        at += blocks_of(n);
    }
    Ok((first, to_i32(op, "blocks", at)?))
}

/// `out[t] = sum of x_t[i]^2` (f32) for tensors `xs` (`(address, elements)`,
/// `dtype`), into `out` (`xs.len()` f32), with `workspace` holding
/// [`sum_squares_each_workspace_len`] f32 values (`workspace_len` of them).
///
/// # Safety
/// Every tensor must be valid for its elements of `dtype`, `out` for
/// `xs.len()` f32 and `workspace` for `workspace_len` f32, all on the
/// launcher's device; `out` and `workspace` overlap nothing else.
pub unsafe fn sum_squares_each(
    l: &dyn Launcher,
    dtype: CudaDType,
    xs: &[(DevPtr, usize)],
    out: DevPtr,
    workspace: DevPtr,
    workspace_len: usize,
) -> Result<()> {
    const OP: &str = "cuda sum_squares_each";
    let es = dtype.size();
    for &(p, n) in xs {
        check_ptr(OP, "x", p, n, es)?;
        to_i64(OP, "elements", n)?;
    }
    check_ptr(OP, "out", out, xs.len(), 4)?;
    let lens: Vec<usize> = xs.iter().map(|&(_, n)| n).collect();
    let need = sum_squares_each_workspace_len(&lens);
    if workspace_len < need {
        return Err(bad(
            OP,
            format!("workspace of {workspace_len} f32; these tensors need {need}"),
        ));
    }
    check_ptr(OP, "workspace", workspace, need, 4)?;
    for (g, group) in xs.chunks(MULTI_MAX).enumerate() {
        let lens: Vec<usize> = group.iter().map(|&(_, n)| n).collect();
        let (first, blocks) = block_starts(OP, &lens)?;
        let mut args = MultiSumSqArgs {
            x: [0; MULTI_MAX],
            n: [0; MULTI_MAX],
            first,
            total: blocks,
            count: group.len() as i32,
            partial: workspace,
            out: out + (g * MULTI_MAX * 4) as DevPtr,
        };
        for (t, &(p, n)) in group.iter().enumerate() {
            args.x[t] = p;
            args.n[t] = n as i64;
        }
        let sfx = dtype.suffix();
        if blocks > 0 {
            let cfg = LaunchConfig::grid([blocks as u32, 1, 1], THREADS);
            // SAFETY: addresses checked above; the caller vouches for validity.
            unsafe { launch(l, &format!("tpar_multi_sumsq_{sfx}"), cfg, &args)? };
        }
        let cfg = LaunchConfig::grid([group.len() as u32, 1, 1], 32);
        // SAFETY: as above; the fold reads the partials just written.
        unsafe { launch(l, "tpar_multi_sumsq_final", cfg, &args)? };
    }
    Ok(())
}

/// `y_t = x_t * c` for each pair of `xy` (`(x, y, elements)`, `dtype`), with
/// `c` the f32 at `coef` rounded to `dtype`, the product rounded once. A `y`
/// may be its own `x` (in place): each element is read, then written, by one
/// thread.
///
/// # Safety
/// Every `x` and `y` must be valid for its elements of `dtype` and `coef` for
/// one f32, on the launcher's device; no `y` overlaps another buffer than its
/// own `x`, and then only as that same address.
pub unsafe fn scale_each(
    l: &dyn Launcher,
    dtype: CudaDType,
    xy: &[(DevPtr, DevPtr, usize)],
    coef: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda scale_each";
    let es = dtype.size();
    for &(x, y, n) in xy {
        check_ptr(OP, "x", x, n, es)?;
        check_ptr(OP, "y", y, n, es)?;
        to_i64(OP, "elements", n)?;
    }
    check_ptr(OP, "coef", coef, 1, 4)?;
    for group in xy.chunks(MULTI_MAX) {
        let lens: Vec<usize> = group.iter().map(|&(_, _, n)| n).collect();
        let (first, blocks) = block_starts(OP, &lens)?;
        if blocks == 0 {
            continue;
        }
        let mut args = MultiScaleArgs {
            x: [0; MULTI_MAX],
            y: [0; MULTI_MAX],
            n: [0; MULTI_MAX],
            first,
            total: blocks,
            count: group.len() as i32,
            coef,
        };
        for (t, &(x, y, n)) in group.iter().enumerate() {
            args.x[t] = x;
            args.y[t] = y;
            args.n[t] = n as i64;
        }
        let cfg = LaunchConfig::grid([blocks as u32, 1, 1], THREADS);
        // SAFETY: addresses checked above; the caller vouches for validity.
        unsafe { launch(l, &format!("tpar_multi_scale_{}", dtype.suffix()), cfg, &args)? };
    }
    Ok(())
}
