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

/// Blocks per thread-block cluster that every cluster-capable GPU launches
/// (compute capability 9.0 and later); larger clusters need the driver's
/// non-portable opt-in, which tpar's launchers do not ask for.
pub const MAX_PORTABLE_CLUSTER: u32 = 8;

/// Grid, block and thread-block cluster shape of a launch, and its dynamic
/// shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
    /// Blocks per thread-block cluster in x, y, z (`[1, 1, 1]`: no clusters).
    /// Each extent divides the grid's, and a cluster holds at most
    /// [`MAX_PORTABLE_CLUSTER`] blocks ([`LaunchConfig::check`]).
    pub cluster: [u32; 3],
}

impl LaunchConfig {
    /// A 1-D grid of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig::grid([blocks, 1, 1], threads)
    }

    /// A grid of `grid` blocks of `threads` threads (1-D blocks).
    pub fn grid(grid: [u32; 3], threads: u32) -> Self {
        LaunchConfig { grid, block: [threads, 1, 1], shared_bytes: 0, cluster: [1, 1, 1] }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_shared(mut self, bytes: u32) -> Self {
        self.shared_bytes = bytes;
        self
    }

    /// The same launch as a grid of thread-block clusters of `cluster` blocks
    /// (a Hopper feature: the blocks of a cluster run at once on one GPC and
    /// reach each other's shared memory). Checked at launch
    /// ([`LaunchConfig::check`]).
    pub fn with_cluster(mut self, cluster: [u32; 3]) -> Self {
        self.cluster = cluster;
        self
    }

    /// Blocks per cluster (1 without clusters).
    pub fn cluster_blocks(&self) -> u64 {
        self.cluster.iter().map(|&c| c as u64).product()
    }

    /// Whether the launch uses clusters of more than one block.
    pub fn is_clustered(&self) -> bool {
        self.cluster != [1, 1, 1]
    }

    /// Enough blocks of `threads` threads to give one thread to each of `n` items
    /// (at least one block), capped at `max_blocks` (kernels grid-stride past it).
    pub fn for_items(n: usize, threads: u32, max_blocks: u32) -> Self {
        let blocks = n.div_ceil(threads as usize).clamp(1, max_blocks as usize) as u32;
        LaunchConfig::linear(blocks, threads)
    }

    /// Checks what every launcher refuses before launching `kernel`: a zero
    /// grid or block extent and more than 1024 threads per block
    /// ([`KernelError::Cuda`]), and a cluster shape with a zero extent, an
    /// extent that does not divide the grid's, or more than
    /// [`MAX_PORTABLE_CLUSTER`] blocks ([`KernelError::BadCluster`]).
    pub fn check(&self, kernel: &str) -> Result<()> {
        for (what, v) in [("grid", self.grid), ("block", self.block)] {
            if v.contains(&0) {
                return Err(cuda_error(kernel, format!("{what} {v:?} has a zero extent")));
            }
        }
        let threads: u64 = self.block.iter().map(|&b| b as u64).product();
        if threads > 1024 {
            return Err(cuda_error(kernel, format!("{threads} threads per block (at most 1024)")));
        }
        self.check_cluster(kernel)
    }

    /// The cluster part of [`LaunchConfig::check`].
    pub fn check_cluster(&self, kernel: &str) -> Result<()> {
        let bad = |why: String| KernelError::BadCluster {
            kernel: kernel.to_string(),
            cluster: self.cluster,
            grid: self.grid,
            why,
        };
        if self.cluster.contains(&0) {
            return Err(bad("a cluster extent is zero".to_string()));
        }
        if let Some(d) = (0..3).find(|&d| !self.grid[d].is_multiple_of(self.cluster[d])) {
            return Err(bad(format!(
                "the grid's {} extent {} is not a multiple of the cluster's {}",
                ["x", "y", "z"][d],
                self.grid[d],
                self.cluster[d]
            )));
        }
        let blocks = self.cluster_blocks();
        if blocks > MAX_PORTABLE_CLUSTER as u64 {
            return Err(bad(format!(
                "{blocks} blocks per cluster (at most {MAX_PORTABLE_CLUSTER}, the portable size)"
            )));
        }
        Ok(())
    }
}

/// A GPU architecture kernels are compiled for, as NVRTC names it:
/// `sm_90a` is compute capability 9.0 with its architecture-specific
/// instructions (wgmma, setmaxnreg), `sm_90` the same capability without
/// them, `sm_100f` a family target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arch {
    /// Compute capability, major.
    pub major: u32,
    /// Compute capability, minor.
    pub minor: u32,
    /// Which instructions beyond the capability's portable set it may use.
    pub variant: ArchVariant,
}

/// The suffix of an [`Arch`]'s name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArchVariant {
    /// `sm_XY`: the instructions every later architecture keeps.
    Portable,
    /// `sm_XYa`: also the instructions only this architecture has.
    Specific,
    /// `sm_XYf`: also the instructions of its family.
    Family,
}

impl Arch {
    /// `sm_90a`, the Hopper target of tpar's wgmma kernels.
    pub const SM_90A: Arch = Arch { major: 9, minor: 0, variant: ArchVariant::Specific };

    /// Parses `sm_XY[a|f]` or `compute_XY[a|f]` (two or three digits, the
    /// last one the minor capability); `None` for anything else.
    pub fn parse(name: &str) -> Option<Arch> {
        let rest = name.strip_prefix("sm_").or_else(|| name.strip_prefix("compute_"))?;
        let (digits, variant) = match rest.strip_suffix('a') {
            Some(d) => (d, ArchVariant::Specific),
            None => match rest.strip_suffix('f') {
                Some(d) => (d, ArchVariant::Family),
                None => (rest, ArchVariant::Portable),
            },
        };
        if !(2..=3).contains(&digits.len()) || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Some(Arch { major: major.parse().ok()?, minor: minor.parse().ok()?, variant })
    }

    /// Whether kernels compiled for it have Hopper's wgmma and setmaxnreg
    /// (exactly `sm_90a`).
    pub fn has_wgmma(self) -> bool {
        self == Arch::SM_90A
    }

    /// Whether it launches thread-block clusters (compute capability 9.0 and
    /// later).
    pub fn has_clusters(self) -> bool {
        self.major >= 9
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let suffix = match self.variant {
            ArchVariant::Portable => "",
            ArchVariant::Specific => "a",
            ArchVariant::Family => "f",
        };
        write!(f, "sm_{}{}{suffix}", self.major, self.minor)
    }
}

/// Something that runs kernels by name: a GPU ([`device::CudaDevice`]) or the
/// CPU emulator ([`emu::Emulator`]).
pub trait Launcher: Send + Sync {
    /// A short name for messages (`"cuda:0 (sm_90)"`, `"emulator"`).
    fn describe(&self) -> String;

    /// The architecture this launcher's kernels are compiled for: a GPU
    /// handle's target (`CudaDevice::arch`), the architecture the emulator
    /// stands in for when `TPAR_EMU_ARCH` names one, `None` otherwise (the
    /// default). Kernels that exist for one architecture only (the Hopper
    /// GEMM) are chosen by it.
    fn compile_arch(&self) -> Option<Arch> {
        None
    }

    /// How many clusters of `cfg.cluster` blocks of `kernel` (with `cfg`'s
    /// block size and shared memory) can be resident at once, where the
    /// launcher can tell: the driver's `cuOccupancyMaxActiveClusters` on a
    /// GPU. `Ok(None)` otherwise (the default, and the emulator, which runs
    /// clusters one after another). A persistent kernel sizes its grid by it.
    fn max_active_clusters(&self, kernel: &str, cfg: &LaunchConfig) -> Result<Option<u32>> {
        let _ = (kernel, cfg);
        Ok(None)
    }

    /// Launches `kernel` with the bytes of its argument struct, as a grid of
    /// `cfg.cluster` clusters when that is not `[1, 1, 1]` (refused with
    /// [`KernelError::BadCluster`] where [`LaunchConfig::check_cluster`] fails).
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
    cfg.check(kernel)?;
    // SAFETY: the bytes are those of `args`, aligned as `A` (`Pod`: every byte
    // initialized); the caller vouches that `A` mirrors the kernel's argument
    // struct and for the addresses in it.
    unsafe { launcher.launch_raw(kernel, &cfg, bytemuck::bytes_of(args)) }
}

static DETERMINISTIC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the kernels whose results depend on the order a GPU runs their blocks in run
/// in a fixed order instead, process-wide (PyTorch's
/// `torch.use_deterministic_algorithms`). Today that is the attention backward: by
/// default every key block adds its part of dQ with f32 atomics, so on a GPU dQ's
/// last bits vary between runs; deterministic, one block per (kv head, batch) takes
/// every key block in order ([`raw::sdpa::sdpa_backward`]): the same bits on every run,
/// slower where kv heads times batch is below the GPU's multiprocessor count (and the
/// `sm_90a` backward gives way to the tensor-core one).
/// The embedding gradient is deterministic either way (its positions are sorted on
/// the device, [`ops::embedding::embedding_backward_sorted`]).
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_deterministic`] is on.
pub fn deterministic() -> bool {
    DETERMINISTIC.load(std::sync::atomic::Ordering::Relaxed)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_parse_and_print() {
        for (name, major, minor, variant) in [
            ("sm_90a", 9, 0, ArchVariant::Specific),
            ("sm_90", 9, 0, ArchVariant::Portable),
            ("sm_80", 8, 0, ArchVariant::Portable),
            ("sm_100f", 10, 0, ArchVariant::Family),
            ("sm_120a", 12, 0, ArchVariant::Specific),
        ] {
            let a = Arch::parse(name).unwrap();
            assert_eq!(a, Arch { major, minor, variant }, "{name}");
            assert_eq!(a.to_string(), name);
        }
        assert_eq!(Arch::parse("compute_90a"), Some(Arch::SM_90A));
        for bad in ["", "sm_", "sm_9", "sm_9000", "gfx90a", "sm_90b", "sm_9x", "sm_90 "] {
            assert_eq!(Arch::parse(bad), None, "{bad:?}");
        }
        assert!(Arch::SM_90A.has_wgmma() && Arch::SM_90A.has_clusters());
        assert!(!Arch::parse("sm_90").unwrap().has_wgmma());
        assert!(!Arch::parse("sm_80").unwrap().has_clusters());
    }

    #[test]
    fn cluster_shapes_are_checked() {
        let base = LaunchConfig::linear(6, 128);
        assert_eq!(base.cluster, [1, 1, 1]);
        assert!(!base.is_clustered());
        assert!(base.check("k").is_ok());
        let two = base.with_cluster([2, 1, 1]);
        assert!(two.is_clustered() && two.cluster_blocks() == 2);
        assert!(two.check("k").is_ok());
        let bad = |cfg: LaunchConfig, want: &str| {
            let e = cfg.check("tpar_k").unwrap_err();
            assert!(matches!(e, KernelError::BadCluster { .. }), "{e:?}");
            assert!(e.to_string().contains(want), "{e}");
            assert!(e.to_string().contains("tpar_k"), "{e}");
        };
        bad(base.with_cluster([4, 1, 1]), "x extent 6 is not a multiple of the cluster's 4");
        bad(base.with_cluster([0, 1, 1]), "zero");
        bad(LaunchConfig::grid([4, 4, 1], 32).with_cluster([4, 4, 1]), "16 blocks per cluster");
        bad(LaunchConfig::grid([2, 3, 1], 32).with_cluster([1, 2, 1]), "y extent 3");
        assert!(LaunchConfig::grid([8, 2, 1], 32).with_cluster([4, 2, 1]).check("k").is_ok());
        // the other checks keep their errors
        assert!(matches!(LaunchConfig::linear(0, 32).check("k"), Err(KernelError::Cuda { .. })));
    }
}
