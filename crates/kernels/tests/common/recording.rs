//! An emulated device that records every kernel launched through it (name
//! and launch configuration), for tests that check which kernel, and in what
//! configuration, an op chose. Included with
//! `#[path = "common/recording.rs"] mod recording;`.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use tpar_kernels::cuda::emu::{EmulatedGpu, Emulator};
use tpar_kernels::cuda::{Arch, DevPtr, GpuDevice, LaunchConfig, Launcher, MemorySpace};

/// The emulated device of ordinal 0 standing in for `arch` (`None`: what
/// `TPAR_EMU_ARCH` says), recording each launch.
pub struct Recording {
    /// The emulated device every call goes to.
    pub inner: Arc<dyn GpuDevice>,
    arch: Option<Option<Arch>>,
    launches: Mutex<Vec<(String, LaunchConfig)>>,
    /// Launches go to the emulator itself: their addresses may be host memory
    /// (`Vec`s), which the memcheck of an emulated device's launches refuses.
    host_memory: bool,
}

impl Recording {
    /// Standing in for `arch` when given (so tests of several architectures
    /// run side by side), else for what the emulator reads from
    /// `TPAR_EMU_ARCH`.
    pub fn new(arch: Option<&str>) -> Recording {
        Recording {
            inner: EmulatedGpu::open(0).unwrap(),
            arch: arch.map(|a| Some(Arch::parse(a).unwrap())),
            launches: Mutex::new(Vec::new()),
            host_memory: false,
        }
    }

    /// As [`Recording::new`], for launches whose buffers are host memory.
    pub fn for_host_memory(arch: Option<&str>) -> Recording {
        Recording { host_memory: true, ..Recording::new(arch) }
    }

    /// Standing in for exactly `arch`: `None` is no architecture (the
    /// emulator's default), whatever `TPAR_EMU_ARCH` says.
    pub fn with_arch(arch: Option<&str>) -> Recording {
        Recording { arch: Some(arch.map(|a| Arch::parse(a).unwrap())), ..Recording::new(None) }
    }

    /// The launches since the last take, oldest first.
    pub fn take(&self) -> Vec<(String, LaunchConfig)> {
        std::mem::take(&mut self.launches.lock().unwrap())
    }

    /// The names of the kernels launched since the last take.
    pub fn take_names(&self) -> Vec<String> {
        self.take().into_iter().map(|(name, _)| name).collect()
    }
}

impl Launcher for Recording {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn compile_arch(&self) -> Option<Arch> {
        self.arch.unwrap_or_else(|| self.inner.compile_arch())
    }
    /// # Safety
    /// As [`Launcher::launch_raw`].
    unsafe fn launch_raw(
        &self,
        kernel: &str,
        cfg: &LaunchConfig,
        args: &[u8],
    ) -> tpar_kernels::Result<()> {
        self.launches.lock().unwrap().push((kernel.to_string(), *cfg));
        // SAFETY: forwarded as given; the caller vouches for the arguments.
        unsafe {
            if self.host_memory {
                Emulator::get()?.launch_raw(kernel, cfg, args)
            } else {
                self.inner.launch_raw(kernel, cfg, args)
            }
        }
    }
}

// SAFETY: every call forwards to the emulated device, whose memory, order
// and promises it shares; only the architecture it reports may differ.
unsafe impl GpuDevice for Recording {
    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }
    fn memory_space(&self) -> MemorySpace {
        self.inner.memory_space()
    }
    fn alloc(&self, bytes: usize) -> tpar_kernels::Result<DevPtr> {
        self.inner.alloc(bytes)
    }
    /// # Safety
    /// As [`GpuDevice::free`].
    unsafe fn free(&self, ptr: DevPtr, bytes: usize) {
        // SAFETY: the caller's guarantee; allocated by the emulated device.
        unsafe { self.inner.free(ptr, bytes) }
    }
    /// # Safety
    /// As [`GpuDevice::htod`].
    unsafe fn htod(&self, src: &[u8], dst: DevPtr) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.inner.htod(src, dst) }
    }
    /// # Safety
    /// As [`GpuDevice::dtoh`].
    unsafe fn dtoh(&self, src: DevPtr, dst: &mut [u8]) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.inner.dtoh(src, dst) }
    }
    /// # Safety
    /// As [`GpuDevice::dtod`].
    unsafe fn dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.inner.dtod(src, dst, bytes) }
    }
    /// # Safety
    /// As [`GpuDevice::copy_from_device`].
    unsafe fn copy_from_device(
        &self,
        src_dev: &dyn GpuDevice,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    ) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.inner.copy_from_device(src_dev, src, dst, bytes) }
    }
    /// # Safety
    /// As [`GpuDevice::zero`].
    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.inner.zero(dst, bytes) }
    }
    fn synchronize(&self) -> tpar_kernels::Result<()> {
        self.inner.synchronize()
    }
}
