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
    /// Threads per row slot (see [`RowLayout`]).
    pub tpr: i32,
    /// 1: rows are read and written in 16-byte vectors.
    pub vec: i32,
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
    /// Threads per row slot (see [`RowLayout`]).
    pub tpr: i32,
    /// 1: rows are read and written in 16-byte vectors.
    pub vec: i32,
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
/// Longest row supported (32 elements per thread, at most 512 threads per row).
pub const MAX_DIM: usize = PER_THREAD * MAX_THREADS;
/// Elements of a row each thread takes, at most.
const PER_THREAD: usize = 32;
/// Threads per block (and per row slot), at most.
const MAX_THREADS: usize = 512;

/// How the kernels lay threads over rows: a block holds `rows_per_block` row
/// slots of `threads_per_row` threads (a multiple of 32); each thread takes
/// the chunks of its row at a stride of `threads_per_row`, at most 32 elements,
/// a chunk being one 16-byte vector when `vec` (every row and operand 16-byte
/// aligned), else one element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    /// Threads per row slot.
    pub threads_per_row: u32,
    /// Row slots per block.
    pub rows_per_block: u32,
    /// Whether chunks are 16-byte vectors.
    pub vec: bool,
}

impl RowLayout {
    /// The layout for rows of `dim` elements of `dtype` at the addresses `ptrs`.
    pub fn new(dtype: CudaDType, dim: usize, ptrs: &[DevPtr]) -> RowLayout {
        let es = dtype.size();
        let vec = (dim * es).is_multiple_of(16) && ptrs.iter().all(|p| p.is_multiple_of(16));
        let chunks = if vec { dim * es / 16 } else { dim };
        let per_thread_chunks = if vec { PER_THREAD * es / 16 } else { PER_THREAD };
        let tpr = chunks.div_ceil(per_thread_chunks).next_multiple_of(32).clamp(32, MAX_THREADS);
        RowLayout { threads_per_row: tpr as u32, rows_per_block: (MAX_THREADS / tpr) as u32, vec }
    }

    /// Threads per block.
    pub fn threads(&self) -> u32 {
        self.threads_per_row * self.rows_per_block
    }
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

/// The kernel of `pass` (`fwd` or `bwd`) for the layout's path: the 16-byte vector
/// kernel, or the element-by-element one (`_elem_`) for rows or pointers that are not
/// 16-byte aligned.
fn kernel(pass: &str, vec: bool, dtype: CudaDType) -> String {
    let path = if vec { "" } else { "elem_" };
    format!("tpar_rmsnorm_{pass}_{path}{}", dtype.suffix())
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
    let lay = RowLayout::new(dtype, dim, &[x, w, y]);
    let (tpr, vec) = (lay.threads_per_row as i32, i32::from(lay.vec));
    let args = RmsnormFwdArgs { x, w, y, rstd, rows: r, dim: d, eps, tpr, vec, pad: 0 };
    let name = kernel("fwd", lay.vec, dtype);
    let blocks = rows.div_ceil(lay.rows_per_block as usize) as u32;
    // SAFETY: the caller guarantees the buffers (see above).
    unsafe { launch(l, &name, LaunchConfig::linear(blocks, lay.threads()), &args) }
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
    let lay = RowLayout::new(dtype, dim, &[x, w, dy, dx]);
    // Never more blocks than the workspace has rows for.
    let nblk = rows.div_ceil(lay.rows_per_block as usize).clamp(1, backward_blocks(rows));
    if rows > 0 {
        let (tpr, vec) = (lay.threads_per_row as i32, i32::from(lay.vec));
        let args =
            RmsnormBwdArgs { x, w, rstd, dy, dx, partial: workspace, rows: r, dim: d, tpr, vec };
        let name = kernel("bwd", lay.vec, dtype);
        // SAFETY: the caller guarantees the buffers (see above).
        unsafe { launch(l, &name, LaunchConfig::linear(nblk as u32, lay.threads()), &args)? };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_take_vectors_when_aligned() {
        let l = RowLayout::new(CudaDType::BF16, 1024, &[0, 256, 4096]);
        assert_eq!((l.threads_per_row, l.rows_per_block, l.vec), (32, 16, true));
        let l = RowLayout::new(CudaDType::BF16, 4096, &[0]);
        assert_eq!((l.threads_per_row, l.rows_per_block, l.vec), (128, 4, true));
        // A misaligned operand or row length: one element per chunk.
        assert!(!RowLayout::new(CudaDType::BF16, 1024, &[0, 2]).vec);
        assert!(!RowLayout::new(CudaDType::F32, 37, &[0]).vec);
        let l = RowLayout::new(CudaDType::F32, MAX_DIM, &[4]);
        assert_eq!((l.threads_per_row, l.rows_per_block, l.vec), (512, 1, false));
        for dim in [1, 37, 1000, 5000, MAX_DIM] {
            for dt in [CudaDType::F32, CudaDType::BF16, CudaDType::F16] {
                for vec in [false, true] {
                    let l = RowLayout::new(dt, dim, &[if vec { 0 } else { 2 }]);
                    let per = if l.vec { 16 / dt.size() } else { 1 };
                    // Every element has a thread, none more than 32.
                    let chunks = dim.div_ceil(per);
                    let per_thread = chunks.div_ceil(l.threads_per_row as usize) * per;
                    assert!(per_thread <= PER_THREAD, "{dt:?} {dim} {l:?}");
                    assert!(l.threads() as usize <= MAX_THREADS);
                }
            }
        }
    }
}
