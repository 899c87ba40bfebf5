//! The device under test: a GPU, or the CPU emulator running the same
//! kernel sources, with the upload/download helpers the checks use.

use std::sync::Arc;

use bytemuck::Pod;
use tpar_kernels::cuda::device::CudaDevice;
use tpar_kernels::cuda::emu::{EmulatedGpu, Emulator};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, GpuDevice, Launcher};

use crate::data::{as_bytes, decode, encode, from_bytes};
use crate::Res;

pub(crate) enum Backend {
    Gpu(Arc<CudaDevice>),
    Emulator(&'static Emulator),
}

/// The device under test: a GPU, or the CPU emulator running the same sources.
pub(crate) struct Dev {
    pub(crate) backend: Backend,
    pub(crate) mem: Arc<dyn GpuDevice>,
}

impl Dev {
    pub(crate) fn open(gpu: bool, ordinal: usize) -> Result<Dev, String> {
        if gpu {
            let cuda = CudaDevice::new(ordinal).map_err(|e| e.to_string())?;
            let mem: Arc<dyn GpuDevice> = cuda.clone();
            Ok(Dev { backend: Backend::Gpu(cuda), mem })
        } else {
            let emu = Emulator::get().map_err(|e| e.to_string())?;
            let mem = EmulatedGpu::open(ordinal).map_err(|e| e.to_string())?;
            Ok(Dev { backend: Backend::Emulator(emu), mem })
        }
    }

    /// The launcher of the kernels.
    pub(crate) fn l(&self) -> &dyn Launcher {
        match &self.backend {
            Backend::Gpu(d) => d.as_ref(),
            // the emulated device, whose launches the checking emulator
            // (TPAR_EMU_RACECHECK=1) checks against its allocations too
            Backend::Emulator(_) => self.mem.as_ref(),
        }
    }

    pub(crate) fn cuda(&self) -> Option<&Arc<CudaDevice>> {
        match &self.backend {
            Backend::Gpu(d) => Some(d),
            Backend::Emulator(_) => None,
        }
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Res<DeviceBuffer> {
        Ok(DeviceBuffer::alloc(&self.mem, bytes)?)
    }

    pub(crate) fn bytes(&self, b: &[u8]) -> Res<DeviceBuffer> {
        Ok(DeviceBuffer::from_host(&self.mem, b)?)
    }

    pub(crate) fn up(&self, dt: CudaDType, v: &[f64]) -> Res<DeviceBuffer> {
        self.bytes(&encode(dt, v))
    }

    pub(crate) fn up_raw<T: Pod>(&self, v: &[T]) -> Res<DeviceBuffer> {
        self.bytes(as_bytes(v))
    }

    /// An output buffer filled with 0xFF bytes (NaN in every float type), so
    /// that elements a kernel fails to write show up.
    pub(crate) fn junk(&self, bytes: usize) -> Res<DeviceBuffer> {
        self.bytes(&vec![0xFF; bytes])
    }

    pub(crate) fn zeros(&self, bytes: usize) -> Res<DeviceBuffer> {
        Ok(DeviceBuffer::zeros(&self.mem, bytes)?)
    }

    pub(crate) fn down(&self, dt: CudaDType, b: &DeviceBuffer) -> Res<Vec<f64>> {
        Ok(decode(dt, &b.to_host()?))
    }

    pub(crate) fn down_raw<T: Pod>(&self, b: &DeviceBuffer) -> Res<Vec<T>> {
        Ok(from_bytes(&b.to_host()?))
    }

    pub(crate) fn sync(&self) -> Res<()> {
        Ok(self.mem.synchronize()?)
    }
}
