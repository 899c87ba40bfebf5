//! Device memory behind a uniform interface, for GPUs and the emulator alike.

use std::sync::Arc;

use super::{cuda_error, DevPtr, Launcher};
use crate::Result;

/// A device that runs kernels and owns memory: a GPU, or the emulator
/// (whose "device" memory is host memory).
///
/// Copies are ordered with the launches on the device's stream; `dtoh`
/// returns once the data is on the host.
pub trait GpuDevice: Launcher {
    /// The device ordinal (`cuda:N`).
    fn ordinal(&self) -> usize;

    /// Allocates `bytes` (at least 256-byte aligned, contents unspecified).
    fn alloc(&self, bytes: usize) -> Result<DevPtr>;

    /// Frees an allocation of this device.
    ///
    /// # Safety
    /// `ptr` came from [`GpuDevice::alloc`] of this device with `bytes`, and
    /// nothing uses it afterwards.
    unsafe fn free(&self, ptr: DevPtr, bytes: usize);

    /// Copies host bytes to device memory.
    ///
    /// # Safety
    /// `dst..dst + src.len()` is device memory of this device.
    unsafe fn htod(&self, src: &[u8], dst: DevPtr) -> Result<()>;

    /// Copies device memory to host bytes.
    ///
    /// # Safety
    /// `src..src + dst.len()` is device memory of this device.
    unsafe fn dtoh(&self, src: DevPtr, dst: &mut [u8]) -> Result<()>;

    /// Copies between two device ranges of this device (they must not overlap).
    ///
    /// # Safety
    /// Both ranges are device memory of this device.
    unsafe fn dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<()>;

    /// Sets device bytes to zero.
    ///
    /// # Safety
    /// The range is device memory of this device.
    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> Result<()>;

    /// Waits for all work queued on the device.
    fn synchronize(&self) -> Result<()>;
}

/// An owned allocation on a [`GpuDevice`], freed on drop.
pub struct DeviceBuffer {
    dev: Arc<dyn GpuDevice>,
    ptr: DevPtr,
    bytes: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({} bytes on {})", self.bytes, self.dev.describe())
    }
}

impl DeviceBuffer {
    /// Allocates `bytes` on `dev` (contents unspecified).
    pub fn alloc(dev: &Arc<dyn GpuDevice>, bytes: usize) -> Result<DeviceBuffer> {
        let ptr = dev.alloc(bytes)?;
        Ok(DeviceBuffer { dev: dev.clone(), ptr, bytes })
    }

    /// Allocates `bytes` zeroed bytes on `dev`.
    pub fn zeros(dev: &Arc<dyn GpuDevice>, bytes: usize) -> Result<DeviceBuffer> {
        let b = DeviceBuffer::alloc(dev, bytes)?;
        // SAFETY: the range is the allocation just made.
        unsafe { dev.zero(b.ptr, bytes)? };
        Ok(b)
    }

    /// A device copy of host bytes.
    pub fn from_host(dev: &Arc<dyn GpuDevice>, data: &[u8]) -> Result<DeviceBuffer> {
        let b = DeviceBuffer::alloc(dev, data.len())?;
        // SAFETY: the range is the allocation just made.
        unsafe { dev.htod(data, b.ptr)? };
        Ok(b)
    }

    /// The device address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device it lives on.
    pub fn device(&self) -> &Arc<dyn GpuDevice> {
        &self.dev
    }

    /// Copies the whole buffer to the host.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.bytes];
        // SAFETY: the range is this allocation.
        unsafe { self.dev.dtoh(self.ptr, &mut v)? };
        Ok(v)
    }

    /// Overwrites the start of the buffer with host bytes.
    pub fn upload(&self, data: &[u8]) -> Result<()> {
        if data.len() > self.bytes {
            return Err(cuda_error(
                "upload",
                format!("{} bytes into a buffer of {}", data.len(), self.bytes),
            ));
        }
        // SAFETY: checked to lie within this allocation.
        unsafe { self.dev.htod(data, self.ptr) }
    }

    /// A device copy of this buffer.
    pub fn duplicate(&self) -> Result<DeviceBuffer> {
        let b = DeviceBuffer::alloc(&self.dev, self.bytes)?;
        // SAFETY: both ranges are allocations of this size on this device.
        unsafe { self.dev.dtod(self.ptr, b.ptr, self.bytes)? };
        Ok(b)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by `dev` with `bytes`, owned by this buffer alone.
        unsafe { self.dev.free(self.ptr, self.bytes) }
    }
}
