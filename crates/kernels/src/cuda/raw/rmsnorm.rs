//! RMSNorm forward and backward (`cuda/rmsnorm.cu`).

use bytemuck::{Pod, Zeroable};

use super::bad;
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::Result;

/// Arguments of `tpar_rmsnorm_fwd_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RmsnormFwdArgs {
    /// Input `[rows, dim]`.
    pub x: DevPtr,
    /// Weight `[dim]`.
    pub w: DevPtr,
    /// Output `[rows, dim]`.
    pub y: DevPtr,
    /// Saved `1/rms` per row, f32 `[rows]`.
    pub rstd: DevPtr,
    /// Rows.
    pub rows: i32,
    /// Row length.
    pub dim: i32,
    /// Epsilon added to the mean square.
    pub eps: f32,
    /// Padding (keeps the struct free of implicit padding).
    pub pad: i32,
}

/// Arguments of `tpar_rmsnorm_bwd_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RmsnormBwdArgs {
    /// Forward input `[rows, dim]`.
    pub x: DevPtr,
    /// Weight `[dim]`.
    pub w: DevPtr,
    /// Saved `1/rms`, f32 `[rows]`.
    pub rstd: DevPtr,
    /// Gradient of the output `[rows, dim]`.
    pub dy: DevPtr,
    /// Gradient of the input `[rows, dim]` (written).
    pub dx: DevPtr,
    /// f32 workspace `[blocks, dim]` of per-block weight-gradient partials.
    pub partial: DevPtr,
    /// Rows.
    pub rows: i32,
    /// Row length.
    pub dim: i32,
}

/// Arguments of `tpar_rmsnorm_dw_reduce`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RmsnormDwArgs {
    /// f32 partials `[nblk, dim]`.
    pub partial: DevPtr,
    /// f32 weight gradient `[dim]` (written).
    pub dw: DevPtr,
    /// Blocks that wrote partials.
    pub nblk: i32,
    /// Row length.
    pub dim: i32,
}

/// Most blocks the backward pass uses (each writes one row of partials).
pub const MAX_BACKWARD_BLOCKS: usize = 264;
/// Longest row supported (the backward keeps 32 columns per thread in
/// registers, at most 512 threads per block).
pub const MAX_DIM: usize = 32 * 512;

fn threads_for(dim: usize) -> u32 {
    // enough threads that each keeps at most 32 columns, at least 128
    (dim.div_ceil(32).next_multiple_of(32)).clamp(128, 512) as u32
}

fn check(op: &'static str, rows: usize, dim: usize) -> Result<(i32, i32)> {
    if dim == 0 || dim > MAX_DIM {
        return Err(bad(op, format!("row length {dim} outside 1..={MAX_DIM}")));
    }
    let r =
        i32::try_from(rows).map_err(|_| bad(op, format!("{rows} rows exceed the i32 range")))?;
    if rows.checked_mul(dim).is_none_or(|n| n > i64::MAX as usize) {
        return Err(bad(op, "size overflows"));
    }
    Ok((r, dim as i32))
}

/// Blocks the backward pass of `rows` rows uses (rows of the workspace).
pub fn backward_blocks(rows: usize) -> usize {
    rows.clamp(1, MAX_BACKWARD_BLOCKS)
}

/// Bytes of f32 workspace [`rmsnorm_backward`] needs.
pub fn backward_workspace_bytes(rows: usize, dim: usize) -> usize {
    backward_blocks(rows) * dim * 4
}

/// Forward RMSNorm of `rows` rows of length `dim`; writes `y` and the f32 `rstd`.
///
/// # Safety
/// `x`, `y`: `rows * dim` elements of `dtype`; `w`: `dim`; `rstd`: `rows` f32;
/// all valid on the launcher's device.
pub unsafe fn rmsnorm_forward(
    l: &dyn Launcher,
    dtype: CudaDType,
    x: DevPtr,
    w: DevPtr,
    y: DevPtr,
    rstd: DevPtr,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    let (r, d) = check("rmsnorm_forward", rows, dim)?;
    if rows == 0 {
        return Ok(());
    }
    let args = RmsnormFwdArgs { x, w, y, rstd, rows: r, dim: d, eps, pad: 0 };
    let name = format!("tpar_rmsnorm_fwd_{}", dtype.suffix());
    let threads = (dim.next_multiple_of(32)).clamp(32, 1024) as u32;
    // SAFETY: the caller guarantees the buffers (see above).
    unsafe { launch(l, &name, LaunchConfig::linear(r as u32, threads), &args) }
}

/// Backward RMSNorm: writes `dx` and the f32 weight gradient `dw` (overwritten,
/// summed over rows in a fixed order), using `workspace`
/// ([`backward_workspace_bytes`] bytes).
///
/// # Safety
/// Buffers as in [`rmsnorm_forward`]; `dy`, `dx`: `rows * dim`; `dw`: `dim` f32;
/// `workspace` large enough; all valid on the launcher's device.
pub unsafe fn rmsnorm_backward(
    l: &dyn Launcher,
    dtype: CudaDType,
    x: DevPtr,
    w: DevPtr,
    rstd: DevPtr,
    dy: DevPtr,
    dx: DevPtr,
    dw: DevPtr,
    workspace: DevPtr,
    rows: usize,
    dim: usize,
) -> Result<()> {
    let (r, d) = check("rmsnorm_backward", rows, dim)?;
    let nblk = backward_blocks(rows);
    if rows > 0 {
        let args = RmsnormBwdArgs { x, w, rstd, dy, dx, partial: workspace, rows: r, dim: d };
        let name = format!("tpar_rmsnorm_bwd_{}", dtype.suffix());
        // SAFETY: the caller guarantees the buffers (see above).
        unsafe { launch(l, &name, LaunchConfig::linear(nblk as u32, threads_for(dim)), &args)? };
    }
    let red = RmsnormDwArgs {
        partial: workspace,
        dw,
        nblk: if rows > 0 { nblk as i32 } else { 0 },
        dim: d,
    };
    // SAFETY: as above.
    unsafe {
        launch(l, "tpar_rmsnorm_dw_reduce", LaunchConfig::for_items(dim, 256, u32::MAX), &red)
    }
}
