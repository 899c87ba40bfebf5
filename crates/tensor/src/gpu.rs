//! CUDA storage: tensors on `Device::Cuda(n)`.
//!
//! A CUDA device is a [`GpuDevice`]: a GPU driven through cudarc, or the CPU
//! emulator of the CUDA execution model (the same kernel sources, run on the
//! host; what the tests use on machines without a GPU). Which one serves
//! `cuda:N` is decided on first use: a device registered with
//! [`register_device`], else the emulator when `TPAR_CUDA=emulator`, else
//! the GPU.
//!
//! Ops with a CUDA kernel run on the device. The others (and host reads such
//! as [`crate::Tensor::to_vec`]) copy through the host; each such copy
//! counts in [`host_round_trips`], so a test can check that a training step
//! stays on the device.
//!
//! ```
//! use tpar_tensor::{gpu, DType, Device, Tensor};
//! gpu::register_device(7, tpar_kernels::cuda::emu::EmulatedGpu::open(7)?);
//! let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3])?.to_device(Device::Cuda(7))?;
//! assert_eq!(x.device(), Device::Cuda(7));
//! assert_eq!(x.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use tpar_kernels::cuda::emu::EmulatedGpu;
pub use tpar_kernels::cuda::{DeviceBuffer, GpuDevice};
use tpar_kernels::cuda::{DeviceSlice, DeviceSliceMut};

use crate::storage::CpuStorage;
use crate::{DType, Result, TensorError};

fn registry() -> &'static Mutex<HashMap<usize, Arc<dyn GpuDevice>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<dyn GpuDevice>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

thread_local! {
    static ROUND_TRIPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Makes `dev` serve `cuda:ordinal` from now on (replacing any earlier one).
pub fn register_device(ordinal: usize, dev: Arc<dyn GpuDevice>) {
    registry().lock().unwrap_or_else(|p| p.into_inner()).insert(ordinal, dev);
}

/// The device serving `cuda:ordinal`, opened on first use.
pub fn device(ordinal: usize) -> Result<Arc<dyn GpuDevice>> {
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = reg.get(&ordinal) {
        return Ok(d.clone());
    }
    let emulate = std::env::var("TPAR_CUDA").is_ok_and(|v| v == "emulator");
    let dev = if emulate {
        tpar_kernels::cuda::emu::EmulatedGpu::open(ordinal)
    } else {
        tpar_kernels::cuda::open_gpu(ordinal)
    }
    .map_err(|e| TensorError::Unavailable {
        what: format!("cuda:{ordinal}"),
        why: e.to_string(),
    })?;
    reg.insert(ordinal, dev.clone());
    Ok(dev)
}

/// How many times data has crossed between a CUDA device and the host on
/// this thread, for an op without a device kernel or a host read of device
/// data (explicit moves with `to_device` do not count).
pub fn host_round_trips() -> u64 {
    ROUND_TRIPS.with(|c| c.get())
}

/// Counts a host round trip: an op computing on host copies of CUDA data, a
/// host read of device data, or a collective backend staging CUDA tensors
/// through host memory.
///
/// With `TPAR_TRACE_ROUND_TRIPS=1` in the environment each one also prints
/// `host round trip:` and a backtrace to stderr, to find what makes a step
/// leave the device (build with debug info for file and line numbers).
pub fn count_host_round_trip() {
    static TRACE: OnceLock<bool> = OnceLock::new();
    if *TRACE.get_or_init(|| std::env::var_os("TPAR_TRACE_ROUND_TRIPS").is_some_and(|v| v == "1")) {
        eprintln!("host round trip: {}", std::backtrace::Backtrace::force_capture());
    }
    ROUND_TRIPS.with(|c| c.set(c.get() + 1));
}

/// A tensor's data on a CUDA device.
#[derive(Debug)]
pub struct GpuStorage {
    pub(crate) buf: DeviceBuffer,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
}

fn kerr(e: tpar_kernels::KernelError) -> TensorError {
    TensorError::Kernel(e)
}

impl GpuStorage {
    /// Uninitialized storage for `len` elements of `dtype`.
    pub(crate) fn alloc(dev: &Arc<dyn GpuDevice>, dtype: DType, len: usize) -> Result<Self> {
        let buf = DeviceBuffer::alloc(dev, len * dtype.size_in_bytes()).map_err(kerr)?;
        Ok(GpuStorage { buf, dtype, len })
    }

    /// Zero-filled storage.
    pub(crate) fn zeros(dev: &Arc<dyn GpuDevice>, dtype: DType, len: usize) -> Result<Self> {
        let buf = DeviceBuffer::zeros(dev, len * dtype.size_in_bytes()).map_err(kerr)?;
        Ok(GpuStorage { buf, dtype, len })
    }

    /// A device copy of host storage.
    pub(crate) fn upload(dev: &Arc<dyn GpuDevice>, s: &CpuStorage) -> Result<Self> {
        let buf = DeviceBuffer::from_host(dev, host_bytes(s)).map_err(kerr)?;
        Ok(GpuStorage { buf, dtype: s.dtype(), len: s.len() })
    }

    /// A host copy.
    pub(crate) fn download(&self) -> Result<CpuStorage> {
        let mut s = CpuStorage::zeros(self.dtype, self.len);
        self.buf.as_slice().copy_to_host(host_bytes_mut(&mut s)).map_err(kerr)?;
        Ok(s)
    }

    /// Overwrites the device data with host storage of the same dtype and length.
    pub(crate) fn upload_into(&mut self, s: &CpuStorage) -> Result<()> {
        self.buf.upload(host_bytes(s)).map_err(kerr)
    }

    /// A device copy of this storage.
    pub(crate) fn duplicate(&self) -> Result<Self> {
        Ok(GpuStorage {
            buf: self.buf.duplicate().map_err(kerr)?,
            dtype: self.dtype,
            len: self.len,
        })
    }

    /// The device address of the first element.
    pub fn ptr(&self) -> tpar_kernels::cuda::DevPtr {
        self.buf.ptr()
    }

    /// The data, for a kernel to read.
    pub(crate) fn view(&self) -> DeviceSlice<'_> {
        self.buf.as_slice()
    }

    /// The data, for a kernel to write.
    pub(crate) fn view_mut(&mut self) -> DeviceSliceMut<'_> {
        self.buf.as_slice_mut()
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn GpuDevice> {
        self.buf.device()
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.buf.len()
    }
}

/// The elements of host storage as bytes.
fn host_bytes(s: &CpuStorage) -> &[u8] {
    match s {
        CpuStorage::F32(v) => bytemuck::cast_slice(v),
        CpuStorage::F64(v) => bytemuck::cast_slice(v),
        CpuStorage::BF16(v) => bytemuck::cast_slice(v),
        CpuStorage::F16(v) => bytemuck::cast_slice(v),
        CpuStorage::I64(v) => bytemuck::cast_slice(v),
    }
}

/// The elements of host storage as bytes to overwrite.
fn host_bytes_mut(s: &mut CpuStorage) -> &mut [u8] {
    match s {
        CpuStorage::F32(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F64(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::BF16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::I64(v) => bytemuck::cast_slice_mut(v),
    }
}
