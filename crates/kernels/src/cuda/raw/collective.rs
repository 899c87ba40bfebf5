//! Launch wrappers for `cuda/collective.cu`: the elementwise reduction of a
//! collective over the buffers of several ranks (`all_reduce`,
//! `reduce_scatter` computed device to device).
//!
//! The fold is the host collectives': sources combined in their order, bf16
//! and f16 accumulated in f32 and rounded once, so a device result is
//! bit-equal to the host one for the same sources.

use bytemuck::{Pod, Zeroable};

use super::{bad, check_aligned, check_ptrs, numel, to_i32, to_i64};
use crate::cuda::{launch, DevPtr, Launcher};
use crate::Result;

/// Threads per block of the reduction kernels.
const THREADS: u32 = 256;

/// Element types the collective reductions are instantiated for (a superset
/// of [`crate::cuda::CudaDType`]: collectives also reduce f64 and i64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FoldDType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// bfloat16 (f32 accumulation).
    BF16,
    /// IEEE half (f32 accumulation).
    F16,
    /// 64-bit integer (wrapping arithmetic).
    I64,
}

impl FoldDType {
    /// The suffix of kernel names instantiated for this type.
    pub fn suffix(self) -> &'static str {
        match self {
            FoldDType::F32 => "f32",
            FoldDType::F64 => "f64",
            FoldDType::BF16 => "bf16",
            FoldDType::F16 => "f16",
            FoldDType::I64 => "i64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FoldDType::F32 => 4,
            FoldDType::F64 | FoldDType::I64 => 8,
            FoldDType::BF16 | FoldDType::F16 => 2,
        }
    }
}

/// How the sources of a collective reduction combine (the kernel-level twin
/// of the collectives' `ReduceOp`, which the layers above own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FoldOp {
    /// Sum.
    Sum,
    /// Sum divided by the number of sources (float types only).
    Avg,
    /// Largest (NaN wins).
    Max,
    /// Smallest (NaN wins).
    Min,
    /// Product.
    Product,
}

impl FoldOp {
    fn code(self) -> i32 {
        match self {
            FoldOp::Sum => 0,
            FoldOp::Avg => 1,
            FoldOp::Max => 2,
            FoldOp::Min => 3,
            FoldOp::Product => 4,
        }
    }
}

/// Arguments of `tpar_coll_reduce_<dtype>`: `out[r*cols + c] = fold_k
/// srcs[k][r*ld + c]` for `r < rows`, `c < cols`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct ReduceArgs {
    /// Device address of `n` source addresses (u64 each).
    pub srcs: DevPtr,
    /// The contiguous `[rows, cols]` output.
    pub out: DevPtr,
    /// Rows of the block.
    pub rows: i64,
    /// Elements per row.
    pub cols: i64,
    /// Elements between row starts in every source.
    pub ld: i64,
    /// Number of sources.
    pub n: i32,
    /// The [`FoldOp`] code.
    pub op: i32,
}

/// Reduces the `[rows, cols]` block at pitch `ld` of `n` sources, whose
/// addresses are the `n` u64 values at `srcs`, into the contiguous `out`.
///
/// # Safety
/// `srcs` must be a device address of `n` u64 source addresses, each valid
/// for the block's reads; `out` valid for `rows * cols` elements, not
/// overlapping any source.
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce(
    l: &dyn Launcher,
    dtype: FoldDType,
    op: FoldOp,
    srcs: DevPtr,
    n: usize,
    rows: usize,
    cols: usize,
    ld: usize,
    out: DevPtr,
) -> Result<()> {
    const OP: &str = "coll_reduce";
    if n == 0 {
        return Err(bad(OP, "no sources"));
    }
    if rows > 1 && ld < cols {
        return Err(bad(OP, format!("pitch {ld} is below the row length {cols}")));
    }
    let total = numel(OP, &[rows, cols])?;
    if total == 0 {
        return Ok(());
    }
    check_ptrs(OP, &[("srcs", srcs), ("out", out)])?;
    check_aligned(OP, 8, &[("srcs", srcs)])?;
    check_aligned(OP, dtype.size(), &[("out", out)])?;
    let args = ReduceArgs {
        srcs,
        out,
        rows: to_i64(OP, "rows", rows)?,
        cols: to_i64(OP, "cols", cols)?,
        ld: to_i64(OP, "ld", ld)?,
        n: to_i32(OP, "n", n)?,
        op: op.code(),
    };
    let cfg = super::layout::grid_for(total, THREADS);
    // SAFETY: the caller guarantees the addresses; sizes are checked above.
    unsafe { launch(l, &format!("tpar_coll_reduce_{}", dtype.suffix()), cfg, &args) }
}
