//! Launchers over bare device addresses: one module per kernel source, each
//! with the `#[repr(C)]` argument structs its kernels take ([`bytemuck::Pod`]
//! mirrors of the CUDA structs) and functions that check sizes, pick the grid
//! and launch on any [`super::Launcher`].
//!
//! They are `unsafe`: the caller vouches that every address is valid for what
//! the kernel touches. The emulator tests use them on host buffers standing in
//! for device memory; code that owns its memory as [`super::DeviceBuffer`]s
//! calls the checked wrappers of [`super::ops`] instead.

pub mod adamw;
pub mod collective;
pub mod cross_entropy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod gemm_hopper;
pub mod layout;
pub mod multi;
pub mod reduce;
pub mod rmsnorm;
pub mod rope;
pub mod sdpa;
pub mod sdpa_hopper;
pub mod sdpa_hopper_bwd;

// ---------------------------------------------------------------- argument checks
//
// Shared by the wrappers: every failure is a `KernelError::BadArguments`
// naming the operation and the offending argument.

use crate::cuda::DevPtr;
use crate::Result;

pub(crate) use crate::util::bad;

/// `v` as an `i32` for a kernel argument, or an error naming it.
pub(crate) fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| bad(op, format!("{what} = {v} exceeds the i32 range of the kernels")))
}

/// `v` as an `i64`, or an error naming it.
pub(crate) fn to_i64(op: &'static str, what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| bad(op, format!("{what} = {v} does not fit in i64")))
}

/// Why a strided layout is unusable ([`strided_span`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SpanError {
    /// Two elements share an address.
    Overlap,
    /// The last element's offset overflows `i64`.
    Overflow,
}

impl SpanError {
    /// The reason, for a message that names the operand.
    pub(crate) fn why(self) -> &'static str {
        match self {
            SpanError::Overlap => "two elements would share an address",
            SpanError::Overflow => "the extent overflows i64",
        }
    }
}

/// Elements a strided tensor spans (one past its last element): `inner`
/// contiguous elements (at least 1) repeated along each `(stride, extent)`
/// dim; dims with one index never move an address and are ignored. With
/// `disjoint`, sorted by stride, each dim must step past everything the dims
/// inside it reach, so no two elements share an address.
pub(crate) fn strided_span(
    inner: usize,
    dims: [(usize, usize); 3],
    disjoint: bool,
) -> std::result::Result<usize, SpanError> {
    let mut moving = dims.map(|(stride, n)| if n > 1 { (stride, n) } else { (0, 1) });
    moving.sort_unstable();
    let mut last = inner - 1;
    for (stride, n) in moving.into_iter().filter(|&(_, n)| n > 1) {
        if disjoint && stride <= last {
            return Err(SpanError::Overlap);
        }
        last = stride
            .checked_mul(n - 1)
            .and_then(|r| r.checked_add(last))
            .ok_or(SpanError::Overflow)?;
    }
    if i64::try_from(last).is_err() {
        return Err(SpanError::Overflow);
    }
    Ok(last + 1)
}

/// The product of `dims`, or an error if it overflows `i64`.
pub(crate) fn numel(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as usize)
        .ok_or_else(|| bad(op, format!("size {dims:?} overflows i64")))
}

/// Checks that a buffer of `n` elements of `elem` bytes at `ptr` is present
/// (non-null unless empty) and aligned to `elem`.
pub(crate) fn check_ptr(
    op: &'static str,
    what: &str,
    ptr: DevPtr,
    n: usize,
    elem: usize,
) -> Result<()> {
    if n > 0 && ptr == 0 {
        return Err(bad(op, format!("{what} is null but holds {n} elements")));
    }
    if !ptr.is_multiple_of(elem as u64) {
        return Err(bad(op, format!("{what} address {ptr:#x} is not {elem}-byte aligned")));
    }
    Ok(())
}

/// Errors when one of the named device pointers is null.
pub(crate) fn check_ptrs(op: &'static str, ptrs: &[(&str, DevPtr)]) -> Result<()> {
    match ptrs.iter().find(|(_, p)| *p == 0) {
        Some((name, _)) => Err(bad(op, format!("{name} is a null device pointer"))),
        None => Ok(()),
    }
}

/// Errors when one of the named device pointers is not a multiple of `elem_bytes`.
pub(crate) fn check_aligned(
    op: &'static str,
    elem_bytes: usize,
    ptrs: &[(&str, DevPtr)],
) -> Result<()> {
    match ptrs.iter().find(|(_, p)| p % elem_bytes as u64 != 0) {
        Some((name, p)) => Err(bad(
            op,
            format!("{name} = {p:#x} is not aligned to its {elem_bytes}-byte elements"),
        )),
        None => Ok(()),
    }
}
