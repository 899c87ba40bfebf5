//! Device memory of a [`CudaDevice`]: host copies in and out
//! ([`CudaDevice::upload`], [`CudaDevice::download`]), the memory pool setting
//! made when a device opens, and the [`GpuDevice`] implementation (stream-ordered
//! allocation, copies, peer copies, zeroing, and cuBLASLt as the vendor GEMM).

use std::ffi::c_void;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{result as dresult, CudaContext};

use super::modules::contexts;
use super::probe::{driver_error, guarded};
use super::CudaDevice;
use crate::cuda::{cuda_error, DevPtr, DeviceBuffer, GpuDevice, Launcher, MemorySpace};
use crate::{KernelError, Result};

impl CudaDevice {
    /// `bytes` of zeroed device memory.
    pub fn alloc_zeros(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        let dev: Arc<dyn GpuDevice> = self.clone();
        DeviceBuffer::zeros(&dev, bytes)
    }

    /// A new device buffer holding a copy of `data`.
    pub fn upload<T: Pod>(self: &Arc<Self>, data: &[T]) -> Result<DeviceBuffer> {
        let dev: Arc<dyn GpuDevice> = self.clone();
        DeviceBuffer::from_host(&dev, data)
    }

    /// Copies a whole buffer back as `T`s (returns once the data is here).
    pub fn download<T: Pod>(&self, src: &DeviceBuffer) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        if size == 0 || !src.len().is_multiple_of(size) {
            return Err(cuda_error(
                &self.op(),
                format!(
                    "a {}-byte buffer is not a whole number of {size}-byte elements",
                    src.len()
                ),
            ));
        }
        let mut out = vec![T::zeroed(); src.len() / size];
        src.as_slice().copy_to_host(&mut out)?;
        Ok(out)
    }
}

/// Makes the device's default memory pool (the one `cuMemAllocAsync` draws
/// from) keep freed memory for reuse instead of returning it to the driver at
/// every synchronisation: the default release threshold of 0 would make each
/// step's allocations real driver allocations again after a logged step's
/// read-back. As a caching allocator does, the pool then holds the step's peak.
/// A failure leaves the default, which is slower but correct.
pub(super) fn keep_pool_memory(ctx: &Arc<CudaContext>) {
    if !ctx.has_async_alloc() || ctx.bind_to_thread().is_err() {
        return;
    }
    let mut pool: cudarc::driver::sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: plain driver calls on this context's device with valid out- and
    // in-pointers (the threshold attribute is a cuuint64_t).
    unsafe {
        use cudarc::driver::sys as ds;
        if ds::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == CUresult::CUDA_SUCCESS {
            let _ = ds::cuMemPoolSetAttribute(
                pool,
                ds::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast::<c_void>(),
            );
        }
    }
}

// SAFETY: allocations come from the driver (stream-ordered where supported)
// in this device's context; every launch, copy and free of this handle goes on
// its one stream, in issue order, and `dtoh` synchronizes before returning;
// the memory space names that stream, so only this handle shares it.
unsafe impl GpuDevice for CudaDevice {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn memory_space(&self) -> MemorySpace {
        MemorySpace::Cuda { ordinal: self.ordinal, stream: self.stream.cu_stream() as usize as u64 }
    }

    /// Stream-ordered (`cuMemAllocAsync`) where the device supports memory
    /// pools; a zero-byte request still gets a distinct (1-byte) allocation.
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        let op = self.op();
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op, "binding the context", e))?;
        let n = bytes.max(1);
        // During a graph capture: the graph's private pool.
        if let Some(r) = self.graph.alloc(&op, n) {
            return r;
        }
        // SAFETY: plain allocation calls in the current context, on its stream.
        let r = unsafe {
            if self.ctx.has_async_alloc() {
                dresult::malloc_async(self.stream.cu_stream(), n)
            } else {
                dresult::malloc_sync(n)
            }
        };
        r.map_err(|e| driver_error(&op, &format!("allocating {bytes} bytes"), e))
    }

    /// # Safety
    /// As [`GpuDevice::free`].
    unsafe fn free(&self, ptr: DevPtr, _bytes: usize) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // A block of a graph's private pool stays the graph's.
        if self.graph.free(&self.ctx, ptr) {
            return;
        }
        // SAFETY: the caller guarantees `ptr` is an allocation of this device
        // that nothing uses afterwards; the stream-ordered free runs after the
        // work queued before it, and the plain free after a synchronisation.
        // A failure cannot be reported from here; the memory is then leaked.
        unsafe {
            if self.ctx.has_async_alloc() {
                let _ = dresult::free_async(ptr, self.stream.cu_stream());
            } else {
                let _ = self.stream.synchronize();
                let _ = dresult::free_sync(ptr);
            }
        }
    }

    /// # Safety
    /// As [`GpuDevice::htod`].
    unsafe fn htod(&self, src: &[u8], dst: DevPtr) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let op = self.op();
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op, "binding the context", e))?;
        // SAFETY: the caller guarantees the destination range. From pageable
        // host memory the call returns once `src` has been staged, so the
        // caller may reuse it at once.
        unsafe { dresult::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| driver_error(&op, "cuMemcpyHtoDAsync", e))
    }

    /// # Safety
    /// As [`GpuDevice::dtoh`].
    unsafe fn dtoh(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let op = self.op();
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op, "binding the context", e))?;
        // SAFETY: the caller guarantees the source range; `dst` is live until
        // the synchronisation below returns.
        unsafe { dresult::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| driver_error(&op, "cuMemcpyDtoHAsync", e))?;
        GpuDevice::synchronize(self)
    }

    /// # Safety
    /// As [`GpuDevice::dtod`].
    unsafe fn dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let op = self.op();
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op, "binding the context", e))?;
        let name = || "(cuMemcpyDtoDAsync)".to_string();
        crate::cuda::profile::timed(&self.ctx, &self.stream, name, || {
            // SAFETY: the caller guarantees both ranges.
            unsafe { dresult::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
        })
        .map_err(|e| driver_error(&op, "cuMemcpyDtoDAsync", e))
    }

    /// A device copy within this handle's stream, or a peer copy
    /// (`cuMemcpyPeerAsync` on this handle's stream) from another GPU, after
    /// the source's stream has drained; the peer copy is waited for, so the
    /// source may be freed on its own stream as soon as this returns.
    ///
    /// # Safety
    /// As [`GpuDevice::copy_from_device`].
    unsafe fn copy_from_device(
        &self,
        src_dev: &dyn GpuDevice,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    ) -> Result<()> {
        let space = src_dev.memory_space();
        if space == GpuDevice::memory_space(self) {
            // SAFETY: the caller guarantees both ranges; same stream.
            return unsafe { self.dtod(src, dst, bytes) };
        }
        let MemorySpace::Cuda { ordinal, .. } = space else {
            return Err(KernelError::WrongDevice {
                op: "copy_from_device",
                what: "source",
                want: self.describe(),
                got: src_dev.describe(),
            });
        };
        if bytes == 0 {
            return Ok(());
        }
        // The source was written on its own stream: let that work finish.
        src_dev.synchronize()?;
        let op = self.op();
        if ordinal == self.ordinal {
            // Another handle's stream on this device: same context.
            // SAFETY: the caller guarantees both ranges.
            unsafe { self.dtod(src, dst, bytes) }?;
            return GpuDevice::synchronize(self);
        }
        let src_ctx = contexts().get_or_try(ordinal, || {
            guarded(&op, || CudaContext::new(ordinal))?
                .map_err(|e| driver_error(&op, "creating the source context", e))
        })?;
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op, "binding the context", e))?;
        // SAFETY: the caller guarantees both ranges, in the two contexts'
        // memory; the copy is ordered on this handle's stream and waited for
        // below, so neither range is used by it after this returns.
        unsafe {
            dresult::memcpy_peer_async(
                self.ctx.cu_ctx(),
                dst,
                src_ctx.cu_ctx(),
                src,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| driver_error(&op, "cuMemcpyPeerAsync", e))?;
        GpuDevice::synchronize(self)
    }

    /// # Safety
    /// As [`GpuDevice::zero`].
    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let op = self.op();
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op, "binding the context", e))?;
        let name = || "(cuMemsetD8Async)".to_string();
        crate::cuda::profile::timed(&self.ctx, &self.stream, name, || {
            // SAFETY: the caller guarantees the range.
            unsafe { dresult::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
        })
        .map_err(|e| driver_error(&op, "cuMemsetD8Async", e))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| driver_error(&self.op(), "cuStreamSynchronize", e))
    }

    /// The driver's stream capture of this handle's stream (relaxed mode), allocations
    /// during it from the graph's private pool.
    fn begin_capture(&self) -> Result<()> {
        self.graph.begin(&self.op(), &self.stream)
    }

    fn end_capture(&self) -> Result<Box<dyn crate::cuda::graph::GraphExec>> {
        self.graph.end(&self.op(), &self.ctx, &self.stream)
    }

    fn is_capturing(&self) -> bool {
        self.graph.is_capturing()
    }

    /// cuBLASLt, on this handle's stream, for every problem it takes (f32
    /// accumulation, no TF32); `Ok(false)` when cuBLASLt cannot be loaded or
    /// has no algorithm for the problem.
    ///
    /// # Safety
    /// As [`GpuDevice::vendor_gemm`].
    unsafe fn vendor_gemm(
        &self,
        p: &crate::cuda::raw::gemm::GemmProblem,
        a: DevPtr,
        b: DevPtr,
        c: DevPtr,
    ) -> Result<bool> {
        // SAFETY: forwarded from the caller (C is also the output).
        unsafe { self.vendor_gemm_to(p, a, b, c, c) }
    }

    /// cuBLASLt out of place (its separate C and D), as [`GpuDevice::vendor_gemm`].
    ///
    /// # Safety
    /// As [`GpuDevice::vendor_gemm_to`].
    unsafe fn vendor_gemm_to(
        &self,
        p: &crate::cuda::raw::gemm::GemmProblem,
        a: DevPtr,
        b: DevPtr,
        c: DevPtr,
        d: DevPtr,
    ) -> Result<bool> {
        let lt = self.vendor.get_or_init(|| {
            crate::cuda::cublaslt::CublasLt::new(&self.me.upgrade()?).ok().map(Arc::new)
        });
        let Some(lt) = lt else { return Ok(false) };
        let name = || "(cublasLtMatmul)".to_string();
        let r = crate::cuda::profile::timed(&self.ctx, &self.stream, name, || {
            // SAFETY: forwarded from the caller; cuBLASLt queues on this handle's stream.
            unsafe { lt.matmul_to(p, a, b, c, d) }
        });
        Ok(r.is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::tests::gpu_or_skip;

    #[test]
    fn gpu_memory_round_trip() {
        let Some(dev) = gpu_or_skip("gpu_memory_round_trip") else { return };
        let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let buf = dev.upload(&x).unwrap();
        assert_eq!(buf.len(), 4000);
        assert_eq!(buf.ptr() % 256, 0, "allocations are 256-byte aligned");
        assert_eq!(dev.download::<f32>(&buf).unwrap(), x);
        let h: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        assert_eq!(dev.download::<half::bf16>(&dev.upload(&h).unwrap()).unwrap(), h);
        let z = dev.alloc_zeros(4000).unwrap();
        assert!(dev.download::<u32>(&z).unwrap().iter().all(|&v| v == 0));
        // SAFETY: both ranges are the 4000-byte buffers above.
        unsafe { dev.dtod(buf.ptr(), z.ptr(), 4000).unwrap() };
        assert_eq!(dev.download::<f32>(&z).unwrap(), x);
        assert!(dev.download::<f64>(&dev.alloc_zeros(12).unwrap()).is_err(), "12 bytes as f64");
        let empty = dev.upload::<f32>(&[]).unwrap();
        assert!(dev.download::<f32>(&empty).unwrap().is_empty());
        GpuDevice::synchronize(dev.as_ref()).unwrap();
        // A second handle shares the context (and would share compiled modules).
        let dev2 = CudaDevice::new(0).unwrap();
        assert!(Arc::ptr_eq(dev.context(), dev2.context()));
        assert!(!Arc::ptr_eq(dev.stream(), dev2.stream()));
    }
}
