//! CUDA kernels of our own, and the two ways to run them.
//!
//! The kernel sources (`crates/kernels/cuda/*.cu`, CUDA C++ behind the common
//! prelude `tpar.cuh`) are embedded in the crate. They run either
//!
//! - on a GPU: compiled at run time by NVRTC for the device's own architecture
//!   (`sm_90a` on Hopper) and launched through cudarc ([`device`]), or
//! - on the CPU: compiled by the host C++ compiler against a small emulator
//!   of the CUDA execution model ([`emu`]: blocks, warps, shared memory,
//!   barriers, shuffles, `mma.sync`, `ldmatrix`), so every kernel is tested
//!   against the CPU reference on machines without a GPU.
//!
//! Every kernel takes one `#[repr(C)]` argument struct, plain data
//! ([`bytemuck::Pod`]) passed to [`launch`] as its bytes. Two layers fill it
//! and pick the grid:
//!
//! - [`ops`], the safe front door: functions over [`DeviceSlice`] /
//!   [`DeviceSliceMut`] views of [`DeviceBuffer`]s that check every buffer's
//!   device, size and alignment against what the kernel will touch, and
//!   return a [`KernelError`] instead of launching out of bounds;
//! - [`raw`], the same launchers over bare device addresses ([`DevPtr`]),
//!   `unsafe` because the caller vouches for the memory: for memory tpar does
//!   not own (host buffers standing in for device memory in the emulator
//!   tests, benchmarks).

use crate::{KernelError, Result};

pub mod cublaslt;
pub mod device;
pub mod emu;
pub mod graph;
mod memory;
pub mod ops;
pub mod profile;
pub mod raw;
pub mod tensor_map;

pub use memory::{
    device_bytes_in_use, device_peak_bytes, reset_device_peak, DeviceBuffer, DeviceSlice,
    DeviceSliceMut, GpuDevice, MemorySpace,
};

/// One embedded kernel source file (`crates/kernels/cuda/<name>.cu`).
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// The file stem (`"rmsnorm"`, `"gemm"`, ...).
    pub name: &'static str,
    /// The CUDA C++ text, without the prelude.
    pub text: &'static str,
}

/// The common prelude every kernel source is compiled after.
pub const PRELUDE: &str = include_str!("../../cuda/tpar.cuh");

/// Every embedded kernel source, sorted by name.
pub fn sources() -> &'static [KernelSource] {
    include!(concat!(env!("OUT_DIR"), "/cuda_sources.rs"))
}

impl KernelSource {
    /// The text as compiled: prelude, then the kernels.
    pub fn full_text(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}.cu\"\n{}", self.name, self.text)
    }
}

/// A device address (a `CUdeviceptr` on a GPU, a host address in the emulator).
pub type DevPtr = u64;

/// Element types the CUDA kernels are instantiated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaDType {
    /// 32-bit float.
    F32,
    /// bfloat16 (f32 accumulation).
    BF16,
    /// IEEE half (f32 accumulation).
    F16,
}

impl CudaDType {
    /// The suffix of kernel names instantiated for this type.
    pub fn suffix(self) -> &'static str {
        match self {
            CudaDType::F32 => "f32",
            CudaDType::BF16 => "bf16",
            CudaDType::F16 => "f16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            CudaDType::F32 => 4,
            CudaDType::BF16 | CudaDType::F16 => 2,
        }
    }
}

/// Grid and block shape of a launch, and its dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D grid of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig { grid: [blocks, 1, 1], block: [threads, 1, 1], shared_bytes: 0 }
    }

    /// A grid of `grid` blocks of `threads` threads (1-D blocks).
    pub fn grid(grid: [u32; 3], threads: u32) -> Self {
        LaunchConfig { grid, block: [threads, 1, 1], shared_bytes: 0 }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_shared(mut self, bytes: u32) -> Self {
        self.shared_bytes = bytes;
        self
    }

    /// Enough blocks of `threads` threads to give one thread to each of `n` items
    /// (at least one block), capped at `max_blocks` (kernels grid-stride past it).
    pub fn for_items(n: usize, threads: u32, max_blocks: u32) -> Self {
        let blocks = n.div_ceil(threads as usize).clamp(1, max_blocks as usize) as u32;
        LaunchConfig::linear(blocks, threads)
    }
}

/// Something that runs kernels by name: a GPU ([`device::CudaDevice`]) or the
/// CPU emulator ([`emu::Emulator`]).
pub trait Launcher: Send + Sync {
    /// A short name for messages (`"cuda:0 (sm_90)"`, `"emulator"`).
    fn describe(&self) -> String;

    /// Launches `kernel` with the bytes of its argument struct.
    ///
    /// # Safety
    /// `args` must be laid out (and aligned) as the kernel's argument struct,
    /// and every address in it must be valid for the kernel's accesses.
    unsafe fn launch_raw(&self, kernel: &str, cfg: &LaunchConfig, args: &[u8]) -> Result<()>;
}

/// Launches `kernel` on `launcher` with the argument struct `args`
/// (a `#[repr(C)]` mirror of the kernel's, plain data without padding).
///
/// # Safety
/// `A` must be laid out field for field as the struct the kernel source
/// declares (its size is checked at launch, not its fields), and every
/// address in `args` must be valid for the accesses the kernel makes.
pub unsafe fn launch<A: bytemuck::Pod>(
    launcher: &dyn Launcher,
    kernel: &str,
    cfg: LaunchConfig,
    args: &A,
) -> Result<()> {
    for (what, v) in [("grid", cfg.grid), ("block", cfg.block)] {
        if v.contains(&0) {
            return Err(cuda_error(kernel, format!("{what} {v:?} has a zero extent")));
        }
    }
    let threads: u64 = cfg.block.iter().map(|&b| b as u64).product();
    if threads > 1024 {
        return Err(cuda_error(kernel, format!("{threads} threads per block (at most 1024)")));
    }
    // SAFETY: the bytes are those of `args`, aligned as `A` (`Pod`: every byte
    // initialized); the caller vouches that `A` mirrors the kernel's argument
    // struct and for the addresses in it.
    unsafe { launcher.launch_raw(kernel, &cfg, bytemuck::bytes_of(args)) }
}

/// Opens `cuda:ordinal` on a GPU as a [`GpuDevice`] (the driver and NVRTC are
/// probed first: without them this is an error, never a panic).
pub fn open_gpu(ordinal: usize) -> Result<std::sync::Arc<dyn GpuDevice>> {
    let dev: std::sync::Arc<dyn GpuDevice> = device::CudaDevice::new(ordinal)?;
    Ok(dev)
}

/// A CUDA-side error (compilation, launch, missing library) as a kernel error.
pub(crate) fn cuda_error(op: &str, what: impl Into<String>) -> KernelError {
    KernelError::Cuda { op: op.to_string(), what: what.into() }
}
