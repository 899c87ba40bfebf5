//! Device memory behind a uniform interface, for GPUs and the emulator alike,
//! and the borrowed views of it that the safe launchers ([`super::ops`]) take.
//!
//! A [`DeviceBuffer`] owns an allocation. A kernel reads through a
//! [`DeviceSlice`] (a shared borrow of a byte range) and writes through a
//! [`DeviceSliceMut`] (an exclusive borrow of one), so Rust's borrow rules
//! keep every output of a launch apart from its inputs and from other
//! threads, as they do for host slices.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytemuck::Pod;

use super::{DevPtr, Launcher};
use crate::util::bad;
use crate::{KernelError, Result};

/// The memory a device's buffers live in, and what orders their use.
/// Buffers of devices with equal spaces may be used by each other's launches
/// and copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemorySpace {
    /// Host memory, used synchronously by the calling thread (the emulator).
    Host,
    /// Memory of GPU `ordinal`, used in the order of one stream.
    Cuda {
        /// The device ordinal (`cuda:N`).
        ordinal: usize,
        /// Which stream (one per device handle) orders every use.
        stream: u64,
    },
}

/// A device that runs kernels and owns memory: a GPU, or the emulator
/// (whose "device" memory is host memory).
///
/// Copies are ordered with the launches on the device's stream; `dtoh`
/// returns once the data is on the host.
///
/// # Safety
/// [`DeviceBuffer`], its views and the launchers of [`super::ops`] are safe
/// because an implementation keeps these promises:
/// - [`GpuDevice::alloc`] returns the address of at least `bytes` bytes (and
///   at least one) that no other live allocation overlaps, which the
///   device's launches and copies may read and write until it is passed to
///   [`GpuDevice::free`];
/// - launches, copies and frees take effect in the order they are issued
///   (one stream, or synchronously on the calling thread), so a buffer is
///   freed only after the work queued on it;
/// - two devices report the same [`GpuDevice::memory_space`] only if each
///   may use the other's buffers in that same order.
pub unsafe trait GpuDevice: Launcher {
    /// The device ordinal (`cuda:N`).
    fn ordinal(&self) -> usize;

    /// The memory this device's buffers live in (see [`MemorySpace`]).
    fn memory_space(&self) -> MemorySpace;

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

    /// Copies `bytes` from memory of `src_dev` (this device or another one)
    /// into this device's memory, without going through the host: a device
    /// copy when both share a [`MemorySpace`] (ordered as [`GpuDevice::dtod`]),
    /// else a peer copy between two GPUs, which waits for the work queued on
    /// `src_dev` first and returns once the copy is complete. Fails with
    /// [`KernelError::WrongDevice`] when no device path joins the two (an
    /// emulated device and a GPU).
    ///
    /// # Safety
    /// `src..src + bytes` is device memory of `src_dev` and
    /// `dst..dst + bytes` device memory of this device; they do not overlap.
    unsafe fn copy_from_device(
        &self,
        src_dev: &dyn GpuDevice,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    ) -> Result<()>;

    /// Sets device bytes to zero.
    ///
    /// # Safety
    /// The range is device memory of this device.
    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> Result<()>;

    /// Waits for all work queued on the device.
    fn synchronize(&self) -> Result<()>;

    /// Runs GEMM `p` with the device's vendor library (cuBLASLt on a GPU) when it has
    /// one that takes the problem, queued like a launch; `Ok(false)` when it does not,
    /// and the caller launches tpar's own kernel. None by default (the emulator).
    ///
    /// # Safety
    /// As [`crate::cuda::raw::gemm::gemm`]: `a`, `b` and `c` are this device's memory
    /// covering what `p` describes, and C overlaps neither A nor B.
    unsafe fn vendor_gemm(
        &self,
        p: &crate::cuda::raw::gemm::GemmProblem,
        a: DevPtr,
        b: DevPtr,
        c: DevPtr,
    ) -> Result<bool> {
        let _ = (p, a, b, c);
        Ok(false)
    }

    /// [`GpuDevice::vendor_gemm`] out of place: `d = alpha * op(a) op(b) + beta * c`,
    /// C read and D written with C's layout; `Ok(false)` when the device has no vendor
    /// library that takes the problem (the caller copies C into D and runs the GEMM in
    /// place). None by default (the emulator).
    ///
    /// # Safety
    /// As [`GpuDevice::vendor_gemm`], and `d` covers C's extent and overlaps none of
    /// A, B and C (unless it is C).
    unsafe fn vendor_gemm_to(
        &self,
        p: &crate::cuda::raw::gemm::GemmProblem,
        a: DevPtr,
        b: DevPtr,
        c: DevPtr,
        d: DevPtr,
    ) -> Result<bool> {
        let _ = (p, a, b, c, d);
        Ok(false)
    }

    /// Starts capturing this device's work into a graph (see [`super::graph`]):
    /// until [`GpuDevice::end_capture`], launches, device copies and memsets are
    /// recorded instead of run, and allocations come from the graph's private
    /// pool. An error where the device cannot capture (the default).
    fn begin_capture(&self) -> Result<()> {
        Err(super::cuda_error(
            super::graph::CAPTURE_OP,
            format!("{} does not capture CUDA graphs", self.describe()),
        ))
    }

    /// Ends the capture: the executable graph, or the first fault the capture saw.
    fn end_capture(&self) -> Result<Box<dyn super::graph::GraphExec>> {
        Err(super::cuda_error(
            super::graph::CAPTURE_OP,
            format!("{} is not capturing", self.describe()),
        ))
    }

    /// Whether a capture is under way on this device.
    fn is_capturing(&self) -> bool {
        false
    }

    /// The work issued to this device so far, where it counts it (the emulator);
    /// `None` otherwise.
    fn work_counts(&self) -> Option<super::graph::WorkCounts> {
        None
    }
}

/// An owned allocation on a [`GpuDevice`], freed on drop.
///
/// ```
/// use std::sync::Arc;
/// use tpar_kernels::cuda::{emu::EmulatedGpu, DeviceBuffer, GpuDevice};
/// let dev: Arc<dyn GpuDevice> = EmulatedGpu::open(0)?;
/// let mut buf = DeviceBuffer::from_host(&dev, &[1.0f32, 2.0, 3.0])?;
/// buf.as_slice_mut().slice_mut(4..8)?.copy_from_host(&[5.0f32])?;
/// let mut back = [0.0f32; 3];
/// buf.as_slice().copy_to_host(&mut back)?;
/// assert_eq!(back, [1.0, 5.0, 3.0]);
/// # Ok::<(), tpar_kernels::KernelError>(())
/// ```
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

/// `range` as a sub-range of `0..len`, or an error naming `op`.
fn sub_range(op: &'static str, range: Range<usize>, len: usize) -> Result<Range<usize>> {
    if range.start > range.end {
        return Err(bad(op, format!("byte range {range:?} is reversed")));
    }
    if range.end > len {
        return Err(KernelError::BufferTooSmall { op, what: "view", need: range.end, got: len });
    }
    Ok(range)
}

/// Device ordinals whose [`DeviceBuffer`] bytes are counted apart (higher ordinals share
/// the last slot).
const COUNTED_DEVICES: usize = 64;
static DEVICE_CURRENT: [AtomicU64; COUNTED_DEVICES] =
    [const { AtomicU64::new(0) }; COUNTED_DEVICES];
static DEVICE_PEAK: [AtomicU64; COUNTED_DEVICES] = [const { AtomicU64::new(0) }; COUNTED_DEVICES];

fn device_slot(ordinal: usize) -> usize {
    ordinal.min(COUNTED_DEVICES - 1)
}

/// Bytes of the live [`DeviceBuffer`]s of device `ordinal` (a GPU, or the emulator's
/// device of that ordinal), over every handle and thread that uses it: the local
/// backend's rank threads sharing one GPU count together. Memory the driver or the
/// vendor libraries hold (contexts, a pool's cached blocks, cuBLASLt workspaces, NCCL
/// buffers) is not counted.
pub fn device_bytes_in_use(ordinal: usize) -> u64 {
    DEVICE_CURRENT[device_slot(ordinal)].load(Ordering::Relaxed)
}

/// The highest [`device_bytes_in_use`] of device `ordinal` since the last
/// [`reset_device_peak`].
pub fn device_peak_bytes(ordinal: usize) -> u64 {
    DEVICE_PEAK[device_slot(ordinal)].load(Ordering::Relaxed)
}

/// Restarts the peak of device `ordinal` from its bytes in use now.
pub fn reset_device_peak(ordinal: usize) {
    let slot = device_slot(ordinal);
    DEVICE_PEAK[slot].store(DEVICE_CURRENT[slot].load(Ordering::Relaxed), Ordering::Relaxed);
}

impl DeviceBuffer {
    /// Allocates `bytes` on `dev` (contents unspecified).
    pub fn alloc(dev: &Arc<dyn GpuDevice>, bytes: usize) -> Result<DeviceBuffer> {
        let ptr = dev.alloc(bytes)?;
        let slot = device_slot(dev.ordinal());
        let now = DEVICE_CURRENT[slot].fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        DEVICE_PEAK[slot].fetch_max(now, Ordering::Relaxed);
        Ok(DeviceBuffer { dev: dev.clone(), ptr, bytes })
    }

    /// Allocates `bytes` zeroed bytes on `dev`.
    pub fn zeros(dev: &Arc<dyn GpuDevice>, bytes: usize) -> Result<DeviceBuffer> {
        let mut b = DeviceBuffer::alloc(dev, bytes)?;
        b.as_slice_mut().zero()?;
        Ok(b)
    }

    /// A device copy of host data (plain values, copied as their bytes).
    pub fn from_host<T: Pod>(dev: &Arc<dyn GpuDevice>, data: &[T]) -> Result<DeviceBuffer> {
        let mut b = DeviceBuffer::alloc(dev, std::mem::size_of_val(data))?;
        b.as_slice_mut().copy_from_host(data)?;
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

    /// The whole buffer, to read.
    pub fn as_slice(&self) -> DeviceSlice<'_> {
        DeviceSlice { buf: self, start: 0, len: self.bytes }
    }

    /// The whole buffer, to write.
    pub fn as_slice_mut(&mut self) -> DeviceSliceMut<'_> {
        let len = self.bytes;
        DeviceSliceMut { buf: self, start: 0, len, _unique: PhantomData }
    }

    /// Bytes `range` of the buffer, to read.
    pub fn slice(&self, range: Range<usize>) -> Result<DeviceSlice<'_>> {
        self.as_slice().slice(range)
    }

    /// Bytes `range` of the buffer, to write.
    pub fn slice_mut(&mut self, range: Range<usize>) -> Result<DeviceSliceMut<'_>> {
        self.as_slice_mut().slice_mut(range)
    }

    /// Copies the whole buffer to the host.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        self.as_slice().to_host()
    }

    /// Overwrites the start of the buffer with host data.
    pub fn upload<T: Pod>(&mut self, data: &[T]) -> Result<()> {
        let (n, len) = (std::mem::size_of_val(data), self.bytes);
        if n > len {
            return Err(bad("upload", format!("{n} bytes into a buffer of {len}")));
        }
        self.slice_mut(0..n)?.copy_from_host(data)
    }

    /// A device copy of this buffer.
    pub fn duplicate(&self) -> Result<DeviceBuffer> {
        let mut b = DeviceBuffer::alloc(&self.dev, self.bytes)?;
        b.as_slice_mut().copy_from(self.as_slice())?;
        Ok(b)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        DEVICE_CURRENT[device_slot(self.dev.ordinal())]
            .fetch_sub(self.bytes as u64, Ordering::Relaxed);
        // SAFETY: allocated by `dev` with `bytes`, owned by this buffer alone;
        // no view outlives the buffer, and the device frees it only after the
        // work queued on it (the `GpuDevice` contract).
        unsafe { self.dev.free(self.ptr, self.bytes) }
    }
}

/// A byte range of a [`DeviceBuffer`] that kernels and copies read.
#[derive(Clone, Copy)]
pub struct DeviceSlice<'a> {
    buf: &'a DeviceBuffer,
    start: usize,
    len: usize,
}

/// A byte range of a [`DeviceBuffer`] that kernels and copies write (and
/// may read): it holds the buffer's exclusive borrow, so nothing else reads
/// or writes these bytes meanwhile.
pub struct DeviceSliceMut<'a> {
    buf: &'a DeviceBuffer,
    start: usize,
    len: usize,
    _unique: PhantomData<&'a mut DeviceBuffer>,
}

impl std::fmt::Debug for DeviceSlice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceSlice({} bytes at +{} of {:?})", self.len, self.start, self.buf)
    }
}

impl std::fmt::Debug for DeviceSliceMut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceSliceMut({} bytes at +{} of {:?})", self.len, self.start, self.buf)
    }
}

impl<'a> DeviceSlice<'a> {
    /// The device address of the first byte.
    pub fn ptr(&self) -> DevPtr {
        self.buf.ptr + self.start as DevPtr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the bytes live on.
    pub fn device(&self) -> &'a Arc<dyn GpuDevice> {
        &self.buf.dev
    }

    /// Bytes `range` of this view.
    pub fn slice(&self, range: Range<usize>) -> Result<DeviceSlice<'a>> {
        let r = sub_range("slice", range, self.len)?;
        Ok(DeviceSlice { buf: self.buf, start: self.start + r.start, len: r.len() })
    }

    /// Copies the view to host values of exactly its size (returns once the
    /// data is on the host).
    pub fn copy_to_host<T: Pod>(&self, dst: &mut [T]) -> Result<()> {
        let dst: &mut [u8] = bytemuck::cast_slice_mut(dst);
        if dst.len() != self.len {
            return Err(bad(
                "copy_to_host",
                format!("{} bytes of device data into {} host bytes", self.len, dst.len()),
            ));
        }
        // SAFETY: the range lies inside a live allocation of this device
        // (views are checked sub-ranges of their buffer).
        unsafe { self.buf.dev.dtoh(self.ptr(), dst) }
    }

    /// Copies the view to a new host vector.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }
}

impl<'a> DeviceSliceMut<'a> {
    /// The device address of the first byte.
    pub fn ptr(&self) -> DevPtr {
        self.buf.ptr + self.start as DevPtr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the bytes live on.
    pub fn device(&self) -> &'a Arc<dyn GpuDevice> {
        &self.buf.dev
    }

    /// The same bytes, to read (while this borrow lasts).
    pub fn as_slice(&self) -> DeviceSlice<'_> {
        DeviceSlice { buf: self.buf, start: self.start, len: self.len }
    }

    /// The same bytes, to read, giving up writing them.
    pub fn into_slice(self) -> DeviceSlice<'a> {
        DeviceSlice { buf: self.buf, start: self.start, len: self.len }
    }

    /// A shorter-lived view of the same bytes, to pass on while keeping this one.
    pub fn reborrow(&mut self) -> DeviceSliceMut<'_> {
        DeviceSliceMut { buf: self.buf, start: self.start, len: self.len, _unique: PhantomData }
    }

    /// Bytes `range` of this view.
    pub fn slice_mut(self, range: Range<usize>) -> Result<DeviceSliceMut<'a>> {
        let r = sub_range("slice_mut", range, self.len)?;
        Ok(DeviceSliceMut {
            buf: self.buf,
            start: self.start + r.start,
            len: r.len(),
            _unique: PhantomData,
        })
    }

    /// The bytes before and from `mid`, as two views that can be written
    /// independently.
    pub fn split_at(self, mid: usize) -> Result<(DeviceSliceMut<'a>, DeviceSliceMut<'a>)> {
        sub_range("split_at", 0..mid, self.len)?;
        let head =
            DeviceSliceMut { buf: self.buf, start: self.start, len: mid, _unique: PhantomData };
        let tail = DeviceSliceMut {
            buf: self.buf,
            start: self.start + mid,
            len: self.len - mid,
            _unique: PhantomData,
        };
        Ok((head, tail))
    }

    /// Overwrites the view with host values of exactly its size.
    pub fn copy_from_host<T: Pod>(&mut self, src: &[T]) -> Result<()> {
        let src: &[u8] = bytemuck::cast_slice(src);
        if src.len() != self.len {
            return Err(bad(
                "copy_from_host",
                format!("{} host bytes into {} bytes of device data", src.len(), self.len),
            ));
        }
        // SAFETY: the range lies inside a live allocation of this device,
        // borrowed exclusively.
        unsafe { self.buf.dev.htod(src, self.ptr()) }
    }

    /// Overwrites the view with a device copy of `src` (of the same size, on
    /// the same device).
    pub fn copy_from(&mut self, src: DeviceSlice<'_>) -> Result<()> {
        const OP: &str = "copy_from";
        if src.len() != self.len {
            return Err(bad(OP, format!("{} bytes into {} bytes", src.len(), self.len)));
        }
        let (want, got) = (self.buf.dev.memory_space(), src.buf.dev.memory_space());
        if want != got {
            return Err(KernelError::WrongDevice {
                op: OP,
                what: "source",
                want: self.buf.dev.describe(),
                got: src.buf.dev.describe(),
            });
        }
        // SAFETY: both ranges lie inside live allocations usable by this
        // device (same memory space); they do not overlap, as the destination
        // is borrowed exclusively while the source is borrowed.
        unsafe { self.buf.dev.dtod(src.ptr(), self.ptr(), self.len) }
    }

    /// Overwrites the view with a copy of `src` (of the same size), which may
    /// live on another device: a device copy within one memory space, a peer
    /// copy between GPUs (see [`GpuDevice::copy_from_device`]); never through
    /// the host.
    pub fn copy_from_device(&mut self, src: DeviceSlice<'_>) -> Result<()> {
        const OP: &str = "copy_from_device";
        if src.len() != self.len {
            return Err(bad(OP, format!("{} bytes into {} bytes", src.len(), self.len)));
        }
        // SAFETY: both ranges lie inside live allocations of their devices;
        // they do not overlap, as the destination is borrowed exclusively
        // while the source is borrowed.
        unsafe { self.buf.dev.copy_from_device(&*src.buf.dev, src.ptr(), self.ptr(), self.len) }
    }

    /// Sets the view's bytes to zero.
    pub fn zero(&mut self) -> Result<()> {
        // SAFETY: the range lies inside a live allocation of this device,
        // borrowed exclusively.
        unsafe { self.buf.dev.zero(self.ptr(), self.len) }
    }
}
