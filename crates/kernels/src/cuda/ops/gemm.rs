//! The batched GEMM (`cuda/gemm.cu`) over device buffers:
//! `C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b]`;
//! [`crate::cuda::raw::gemm`] documents the kernels, layouts and tiles.

use super::Check;
use crate::cuda::raw::gemm as raw;
pub use crate::cuda::raw::gemm::{GemmLaunch, GemmProblem, GemmTile, MAX_BATCH, MAX_DIM};
use crate::cuda::{DeviceSlice, DeviceSliceMut, GpuDevice};
use crate::Result;

/// Runs `p` with the tile of [`GemmProblem::default_tile`]: A and B read
/// from `a` and `b` (`p.dtype_in`), C written (and read when `beta != 0`)
/// in `c` (`p.dtype_out`), each view starting at its operand's batch 0.
pub fn gemm(
    dev: &dyn GpuDevice,
    p: &GemmProblem,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    c: DeviceSliceMut<'_>,
) -> Result<()> {
    gemm_with_tile(dev, p, p.default_tile(), a, b, c)
}

/// Runs `p` with an explicit tile (for benchmarks and tuning).
pub fn gemm_with_tile(
    dev: &dyn GpuDevice,
    p: &GemmProblem,
    tile: GemmTile,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    c: DeviceSliceMut<'_>,
) -> Result<()> {
    let ch = Check::new("cuda gemm", dev);
    let [na, nb, nc] = p.extents()?;
    let (ins, outs) = (p.dtype_in.size(), p.dtype_out.size());
    let (ap, bp) = (ch.read("A", &a, na, ins)?, ch.read("B", &b, nb, ins)?);
    let cp = ch.write("C", &c, nc, outs)?;
    // SAFETY: `a`, `b` and `c` are live buffers in `dev`'s memory covering
    // every element the problem's sizes, leading dimensions and batch strides
    // reach (checked above); `c` is an exclusive borrow, so C overlaps
    // neither A nor B.
    unsafe { raw::gemm_with_tile(dev, p, tile, ap, bp, cp) }
}
