//! The GPU launcher: NVRTC compiles the embedded kernel sources for the
//! device's own architecture, cudarc loads and launches them.
//!
//! Nothing here needs CUDA at build time: cudarc loads `libcuda` and
//! `libnvrtc` when first used. Every entry point probes them first
//! ([`device_count`], [`nvrtc_version`]) and reports a missing library, a
//! missing device or a compile failure as
//! [`KernelError::Cuda`](crate::KernelError::Cuda), never as a panic (cudarc
//! itself panics when a library it calls into is absent); a sticky driver
//! error (a kernel trapped or faulted, after which every call on the device
//! fails) as [`KernelError::ContextLost`](crate::KernelError::ContextLost).
//!
//! Compilation is lazy and shared: the first launch of a kernel compiles the
//! source file that defines it (found by its `TPAR_KERNEL(<name>, ...)`
//! line), for the device's architecture (or the one [`CUDA_ARCH_ENV`] or
//! [`CompileOptions::arch`] names) and the handle's [`CompileOptions`].
//! Compiled images are cached per (architecture, source, options) and loaded
//! modules per (device ordinal, source, options), process-wide, so every
//! [`CudaDevice`] handle and thread on one GPU shares them. Device binaries
//! are also kept on disk across processes ([`KERNEL_CACHE_ENV`]), since
//! NVRTC needs up to a minute for the largest sources.
//!
//! ```no_run
//! use tpar_kernels::cuda::device::CudaDevice;
//! # fn main() -> tpar_kernels::Result<()> {
//! let dev = CudaDevice::new(0)?; // Err (no panic) without a GPU or NVRTC
//! let x = dev.upload(&[1.0f32, 2.0, 3.0])?;
//! let back: Vec<f32> = dev.download(&x)?;
//! assert_eq!(back, [1.0, 2.0, 3.0]);
//! # Ok(())
//! # }
//! ```
//!
//! The parts, one file each:
//!
//! - `probe.rs`: is the driver there, is NVRTC, which versions, how many
//!   devices ([`device_count`], [`nvrtc_version`], [`driver_version`],
//!   [`check_toolchain`]);
//! - `nvrtc.rs`: [`CompileOptions`] and one NVRTC compilation
//!   ([`compile_ptx`]);
//! - `disk_cache.rs`: device binaries kept on disk across processes
//!   ([`KERNEL_CACHE_ENV`], [`precompile`]);
//! - `index.rs`: which source defines which kernel ([`kernel_names`],
//!   [`source_of`]);
//! - `modules.rs`: the process-wide caches of compiled images, loaded modules
//!   and contexts, and the functions taken from them ([`KernelInfo`]);
//! - `memory.rs`: a [`CudaDevice`]'s memory (allocation, copies, peer copies);
//! - `launch.rs`: a [`CudaDevice`]'s kernel launches;
//! - `watchdog.rs`: where a Hopper kernel's mbarrier wait timed out, read
//!   back into the lost context's error;
//! - this file: [`CudaDevice`] itself, opened with [`CudaDevice::new`].

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaStream};

use super::{cuda_error, Launcher};
use crate::Result;

mod disk_cache;
mod graph;
mod index;
mod launch;
mod memory;
mod modules;
mod nvrtc;
mod probe;
mod watchdog;

pub use disk_cache::{precompile, KERNEL_CACHE_ENV};
pub use index::{kernel_names, source_of};
pub use modules::{KernelInfo, DEFAULT_DYN_SMEM_LIMIT};
pub use nvrtc::{compile_ptx, compile_ptx_with, CompileOptions, CUDA_ARCH_ENV};
pub(crate) use probe::driver_error;
pub use probe::{check_toolchain, device_count, driver_version, nvrtc_version};

use memory::keep_pool_memory;
use modules::{contexts, LoadedFunction};
use nvrtc::choose_arch;
use probe::guarded;

/// One CUDA GPU as a kernel [`Launcher`]: its (process-shared) context, a
/// stream of its own that every launch and copy of this handle goes on,
/// and the compile options its kernels are built with.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    cc: (u32, u32),
    arch: String,
    options: CompileOptions,
    max_smem_optin: u32,
    sm_count: u32,
    functions: Mutex<HashMap<String, Arc<LoadedFunction>>>,
    /// This handle, for the cuBLASLt handle made from it on first use.
    me: std::sync::Weak<CudaDevice>,
    /// cuBLASLt for [`GpuDevice::vendor_gemm`], made on first use (`None`: not
    /// loadable). It holds this device, which therefore lives as long as the
    /// process once a vendor GEMM has run.
    vendor: OnceLock<Option<Arc<crate::cuda::cublaslt::CublasLt>>>,
    /// CUDA graph capture on this handle's stream and the graphs' private pools.
    graph: graph::GraphState,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` with the default [`CompileOptions`].
    ///
    /// Fails with [`KernelError::Cuda`](crate::KernelError::Cuda) (no panic)
    /// when the CUDA driver or NVRTC cannot be loaded, or there is no such
    /// device.
    pub fn new(ordinal: usize) -> Result<Arc<CudaDevice>> {
        CudaDevice::with_options(ordinal, CompileOptions::default())
    }

    /// Opens GPU `ordinal`; its kernels are compiled with `options`, for
    /// [`CompileOptions::arch`] when set, else for the architecture
    /// [`CUDA_ARCH_ENV`] (`TPAR_CUDA_ARCH`) names, else for the device's own
    /// ([`CudaDevice::arch`]). A bad architecture name is an error naming it.
    pub fn with_options(ordinal: usize, options: CompileOptions) -> Result<Arc<CudaDevice>> {
        let op = format!("cuda:{ordinal}");
        let count = device_count()?;
        if ordinal >= count {
            return Err(cuda_error(
                &op,
                format!("no such device: the driver reports {count} CUDA device(s)"),
            ));
        }
        check_toolchain(nvrtc_version()?, driver_version()?)?;
        let ctx = contexts().get_or_try(ordinal, || {
            guarded(&op, || CudaContext::new(ordinal))?
                .map_err(|e| driver_error(&op, "creating the context", e))
        })?;
        let attr = |a: CUdevice_attribute, what: &str| -> Result<u32> {
            ctx.attribute(a).map(|v| v.max(0) as u32).map_err(|e| driver_error(&op, what, e))
        };
        let cc = (
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cc major")?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cc minor")?,
        );
        let max_smem_optin = attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory limit",
        )?;
        let sm_count =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count")?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        // Compute capability 9.0 compiles for `sm_90a`, the Hopper target
        // with wgmma and setmaxnreg (the Hopper GEMM, `raw::gemm_hopper`);
        // every other device for its own `sm_XY`; TPAR_CUDA_ARCH or the
        // options say otherwise.
        let env = match std::env::var(CUDA_ARCH_ENV) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(cuda_error(
                    &op,
                    format!("{CUDA_ARCH_ENV}={v:?} is not a GPU architecture (not UTF-8)"),
                ))
            }
        };
        let arch = choose_arch(options.arch.as_deref(), env.as_deref(), cc)?;
        let stream = ctx.new_stream().map_err(|e| driver_error(&op, "creating a stream", e))?;
        keep_pool_memory(&ctx);
        Ok(Arc::new_cyclic(|me| CudaDevice {
            ordinal,
            ctx,
            stream,
            name,
            cc,
            arch,
            options,
            max_smem_optin,
            sm_count,
            functions: Mutex::new(HashMap::new()),
            me: me.clone(),
            vendor: OnceLock::new(),
            graph: graph::GraphState::default(),
        }))
    }

    /// The device's name (`"NVIDIA H200"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.cc
    }

    /// The architecture kernels are compiled for: [`CompileOptions::arch`]
    /// when set, else [`CUDA_ARCH_ENV`] (`TPAR_CUDA_ARCH`) when set, else
    /// `"sm_90a"` on a compute capability 9.0 device and `"sm_XY"` on the
    /// others.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The compile options of this handle.
    pub fn options(&self) -> &CompileOptions {
        &self.options
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The most shared memory (static plus dynamic) one block may opt in to.
    pub fn max_shared_per_block(&self) -> u32 {
        self.max_smem_optin
    }

    /// The cudarc context (shared by every handle on this device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream this handle launches and copies on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn op(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KernelError;

    #[test]
    fn no_gpu_is_an_error_not_a_panic() {
        // On a machine with a GPU this opens it; without one it must fail cleanly.
        match CudaDevice::new(0) {
            Ok(dev) => assert!(dev.describe().starts_with("cuda:0")),
            Err(e) => assert!(matches!(e, KernelError::Cuda { .. }), "{e:?}"),
        }
        let far = CudaDevice::new(1 << 20);
        assert!(matches!(far, Err(KernelError::Cuda { .. })));
    }

    /// Prints past the test harness's capture.
    pub(super) fn say(text: &str) {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), "{text}");
    }

    /// GPU 0, or `None` (with the reason printed) where there is none.
    pub(super) fn gpu_or_skip(test: &str) -> Option<Arc<CudaDevice>> {
        match CudaDevice::new(0) {
            Ok(d) => Some(d),
            Err(e) => {
                say(&format!("skipping {test} (no usable GPU): {e}"));
                None
            }
        }
    }
}
