//! Safe launchers over device buffers: one module per kernel source, the
//! functions of [`super::raw`] taking [`DeviceSlice`] views for what a kernel
//! reads and [`DeviceSliceMut`] views for what it writes, on a [`GpuDevice`].
//!
//! Before launching, every view is checked to live in the device's memory
//! ([`super::MemorySpace`]), to hold at least the bytes the kernel reaches with
//! the given sizes and strides, and to be aligned to its elements; a failed
//! check is a [`crate::KernelError`] (`WrongDevice`, `BufferTooSmall`,
//! `BadArguments`) and nothing runs. Outputs are exclusive borrows, so they
//! cannot overlap an input or another output; kernels that update a buffer in
//! place take it once, as a [`DeviceSliceMut`] (`*_in_place`, `accumulate`,
//! the optimizer step).
//!
//! Sizes are element counts and dtypes are [`CudaDType`](crate::cuda::CudaDType)s, as in
//! [`super::raw`]; views are bytes, so one buffer can hold values of any type
//! and be split into pieces ([`DeviceSliceMut::split_at`]).
//!
//! ```
//! use std::sync::Arc;
//! use tpar_kernels::cuda::{emu::EmulatedGpu, ops::elementwise, CudaDType, DeviceBuffer, GpuDevice};
//! use tpar_kernels::elementwise::UnaryOp;
//! let dev: Arc<dyn GpuDevice> = EmulatedGpu::open(0)?;
//! let x = DeviceBuffer::from_host(&dev, &[1.0f32, 4.0, 9.0])?;
//! let mut y = DeviceBuffer::alloc(&dev, 12)?;
//! elementwise::unary(&*dev, CudaDType::F32, UnaryOp::Sqrt, x.as_slice(), y.as_slice_mut(), 3)?;
//! let mut host = [0.0f32; 3];
//! y.as_slice().copy_to_host(&mut host)?;
//! assert_eq!(host, [1.0, 2.0, 3.0]);
//! // Too few bytes for the sizes given: an error, not an out-of-bounds launch.
//! let r = elementwise::unary(&*dev, CudaDType::F32, UnaryOp::Sqrt, x.as_slice(), y.as_slice_mut(), 4);
//! assert!(r.is_err());
//! # Ok::<(), tpar_kernels::KernelError>(())
//! ```

pub mod adamw;
pub mod collective;
pub mod cross_entropy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod gemm_fused;
pub mod gemm_pad;
pub mod gemm_tune;
pub mod layout;
pub mod multi;
pub mod reduce;
pub mod rmsnorm;
pub mod rope;
pub mod sdpa;

use std::sync::Arc;

use super::{DevPtr, DeviceSlice, DeviceSliceMut, GpuDevice, MemorySpace};
use crate::util::bad;
use crate::{KernelError, Result};

/// The checks of one launch on `dev`: each view's device, size and alignment.
pub(crate) struct Check<'d> {
    op: &'static str,
    dev: &'d dyn GpuDevice,
    space: MemorySpace,
}

impl<'d> Check<'d> {
    pub(crate) fn new(op: &'static str, dev: &'d dyn GpuDevice) -> Self {
        Check { op, dev, space: dev.memory_space() }
    }

    fn view(
        &self,
        what: &'static str,
        device: &Arc<dyn GpuDevice>,
        ptr: DevPtr,
        len: usize,
        need: usize,
        align: usize,
    ) -> Result<DevPtr> {
        if device.memory_space() != self.space {
            return Err(KernelError::WrongDevice {
                op: self.op,
                what,
                want: self.dev.describe(),
                got: device.describe(),
            });
        }
        if len < need {
            return Err(KernelError::BufferTooSmall { op: self.op, what, need, got: len });
        }
        if need > 0 && !ptr.is_multiple_of(align.max(1) as DevPtr) {
            return Err(bad(
                self.op,
                format!("{what} address {ptr:#x} is not {align}-byte aligned"),
            ));
        }
        Ok(ptr)
    }

    /// Bytes of `elems` elements of `elem` bytes.
    fn bytes(&self, what: &'static str, elems: usize, elem: usize) -> Result<usize> {
        elems.checked_mul(elem).ok_or_else(|| {
            bad(self.op, format!("{what}: {elems} elements of {elem} bytes overflow"))
        })
    }

    /// The address of `v`, which the launch reads as `elems` elements of
    /// `elem` bytes.
    pub(crate) fn read(
        &self,
        what: &'static str,
        v: &DeviceSlice<'_>,
        elems: usize,
        elem: usize,
    ) -> Result<DevPtr> {
        let need = self.bytes(what, elems, elem)?;
        self.view(what, v.device(), v.ptr(), v.len(), need, elem)
    }

    /// The address of `v`, which the launch writes (and may read) as `elems`
    /// elements of `elem` bytes.
    pub(crate) fn write(
        &self,
        what: &'static str,
        v: &DeviceSliceMut<'_>,
        elems: usize,
        elem: usize,
    ) -> Result<DevPtr> {
        let need = self.bytes(what, elems, elem)?;
        self.view(what, v.device(), v.ptr(), v.len(), need, elem)
    }

    /// The address of element `at` of `v`, from which the launch writes (and
    /// may read) `elems` elements of `elem` bytes.
    pub(crate) fn write_at(
        &self,
        what: &'static str,
        v: &DeviceSliceMut<'_>,
        at: usize,
        elems: usize,
        elem: usize,
    ) -> Result<DevPtr> {
        let skip = self.bytes(what, at, elem)?;
        let need = self.bytes(what, elems, elem)?;
        let (ptr, len) = (v.ptr().wrapping_add(skip as DevPtr), v.len().saturating_sub(skip));
        if need > 0 && skip > v.len() {
            return Err(KernelError::BufferTooSmall {
                op: self.op,
                what,
                need: skip.saturating_add(need),
                got: v.len(),
            });
        }
        self.view(what, v.device(), ptr, len, need, elem)
    }

    /// The address of `v`, which the launch writes as `bytes` bytes at an
    /// `align`-byte aligned address (workspaces).
    pub(crate) fn write_bytes(
        &self,
        what: &'static str,
        v: &DeviceSliceMut<'_>,
        bytes: usize,
        align: usize,
    ) -> Result<DevPtr> {
        self.view(what, v.device(), v.ptr(), v.len(), bytes, align)
    }

    /// The address of an optional i32 slot (error position, counter), 0 for none.
    pub(crate) fn slot(
        &self,
        what: &'static str,
        v: Option<&DeviceSliceMut<'_>>,
    ) -> Result<DevPtr> {
        v.map_or(Ok(0), |v| self.write(what, v, 1, 4))
    }
}

/// The product of `dims` (an element count), or an error naming `op`.
pub(crate) fn count(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(op, format!("size {dims:?} overflows")))
}

/// Elements a read of `shape` through `strides` from `base` reaches (one
/// past the largest offset), 0 when `shape` is empty.
pub(crate) fn reach(
    op: &'static str,
    base: usize,
    shape: &[usize],
    strides: &[usize],
) -> Result<usize> {
    if strides.len() != shape.len() {
        return Err(bad(
            op,
            format!("{} strides for a shape of rank {}", strides.len(), shape.len()),
        ));
    }
    if shape.contains(&0) {
        return Ok(0);
    }
    super::raw::layout::max_offset(base, shape, strides)
        .and_then(|m| m.checked_add(1))
        .ok_or_else(|| bad(op, format!("strides {strides:?} over {shape:?} overflow")))
}

/// Elements `rows` rows of `cols` at a pitch of `ld` reach, 0 when empty.
pub(crate) fn pitched(op: &'static str, rows: usize, cols: usize, ld: usize) -> Result<usize> {
    if rows == 0 || cols == 0 {
        return Ok(0);
    }
    (rows - 1)
        .checked_mul(ld)
        .and_then(|v| v.checked_add(cols))
        .ok_or_else(|| bad(op, format!("{rows} rows at pitch {ld} overflow")))
}
