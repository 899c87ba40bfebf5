//! Launching a kernel on a [`CudaDevice`]: the [`Launcher`] implementation,
//! which finds (compiling on first use) the kernel, checks the argument
//! struct's size and the shared memory against what the driver reports, and
//! calls `cuLaunchKernel` on the handle's stream, or `cuLaunchKernelEx` with
//! the cluster-dimension attribute for a clustered [`LaunchConfig`] (a stream
//! capture records the attribute with the launch, so a graph's replay keeps
//! the cluster shape). The cluster path follows the driver's documented API
//! and has not run on a GPU yet.

use std::ffi::c_void;

use cudarc::driver::result as dresult;
use cudarc::driver::sys;

use super::modules::DEFAULT_DYN_SMEM_LIMIT;
use super::probe::driver_error;
use super::CudaDevice;
use crate::cuda::{cuda_error, Arch, LaunchConfig, Launcher};
use crate::Result;

impl Launcher for CudaDevice {
    fn describe(&self) -> String {
        format!("cuda:{} ({}, {})", self.ordinal, self.arch, self.name)
    }

    /// [`CudaDevice::arch`] parsed (always an architecture: it was checked
    /// when the handle was opened).
    fn compile_arch(&self) -> Option<Arch> {
        Arch::parse(&self.arch)
    }

    /// The driver's `cuOccupancyMaxActiveClusters` for `kernel` launched
    /// with `cfg` (its cluster shape checked first); `None` without clusters.
    fn max_active_clusters(&self, kernel: &str, cfg: &LaunchConfig) -> Result<Option<u32>> {
        cfg.check_cluster(kernel)?;
        if !cfg.is_clustered() {
            return Ok(None);
        }
        let op = || format!("{} {kernel}", self.op());
        let f = self.function(kernel)?;
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op(), "binding the context", e))?;
        if cfg.shared_bytes > DEFAULT_DYN_SMEM_LIMIT {
            f.allow_dyn_smem(&op(), cfg.shared_bytes)?;
        }
        let mut attr = cluster_attribute(cfg);
        let config = launch_config(cfg, self.stream.cu_stream(), &mut attr);
        let mut n: std::ffi::c_int = 0;
        // SAFETY: the function is loaded in the current context; `config` and
        // its attribute live for the call, which writes one integer.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.func.cu_function(), &config) }
            .result()
            .map_err(|e| {
                driver_error(&op(), &format!("cuOccupancyMaxActiveClusters ({:?})", cfg.cluster), e)
            })?;
        Ok(Some(n.max(0) as u32))
    }

    /// # Safety
    /// As [`Launcher::launch_raw`].
    unsafe fn launch_raw(&self, kernel: &str, cfg: &LaunchConfig, args: &[u8]) -> Result<()> {
        let size = args.len();
        // the name for messages, built only when something fails
        let op = || format!("{} {kernel}", self.op());
        cfg.check_cluster(kernel)?;
        if cfg.is_clustered() && !Arch::parse(&self.arch).is_some_and(Arch::has_clusters) {
            return Err(cuda_error(
                &op(),
                format!(
                    "a cluster launch ({:?}) needs compute capability 9.0 or later; kernels here \
                     are compiled for {}",
                    cfg.cluster, self.arch
                ),
            ));
        }
        let f = self.function(kernel)?;
        if f.extra_params {
            return Err(cuda_error(&op(), "the kernel takes more than one parameter".to_string()));
        }
        if let Some(p) = f.param_size {
            if p != size {
                return Err(cuda_error(
                    &op(),
                    format!(
                        "the argument struct is {size} bytes but the kernel's parameter is {p} \
                         bytes (the Rust mirror and the CUDA struct disagree)"
                    ),
                ));
            }
        }
        let smem = cfg.shared_bytes;
        if smem as u64 + f.static_smem as u64 > self.max_smem_optin as u64 {
            return Err(cuda_error(
                &op(),
                format!(
                    "{smem} bytes of dynamic plus {} of static shared memory exceed the \
                     {}-byte limit per block",
                    f.static_smem, self.max_smem_optin
                ),
            ));
        }
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op(), "binding the context", e))?;
        if smem > DEFAULT_DYN_SMEM_LIMIT {
            f.allow_dyn_smem(&op(), smem)?;
        }
        // cuLaunchKernel reads each parameter's size in bytes from the pointer
        // given for it: the one parameter is the argument struct at `args`.
        let mut params: [*mut c_void; 1] = [args.as_ptr() as *mut c_void];
        let params: &mut [*mut c_void] = if size == 0 { &mut [] } else { &mut params };
        let g = cfg.grid;
        let b = cfg.block;
        let cl = cfg.cluster;
        let clustered = cfg.is_clustered();
        crate::cuda::profile::timed(
            &self.ctx,
            &self.stream,
            || kernel.to_string(),
            || {
                if clustered {
                    // SAFETY: as below; the launch configuration and its one
                    // attribute live on this frame for the duration of the call.
                    return unsafe {
                        launch_clustered(
                            f.func.cu_function(),
                            cfg,
                            self.stream.cu_stream(),
                            params.as_mut_ptr(),
                        )
                    };
                }
                // SAFETY: the function is loaded in this (current) context, the
                // stream belongs to it, and the caller guarantees `args` points to
                // `size` bytes laid out as the kernel's parameter (whose size was
                // checked above when the driver could tell) with valid addresses in it.
                unsafe {
                    dresult::launch_kernel(
                        f.func.cu_function(),
                        (g[0], g[1], g[2]),
                        (b[0], b[1], b[2]),
                        smem,
                        self.stream.cu_stream(),
                        params,
                    )
                }
            },
        )
        .map_err(|e| {
            let call = if clustered { "cuLaunchKernelEx" } else { "cuLaunchKernel" };
            driver_error(&op(), &format!("{call} (grid {g:?}, block {b:?}, cluster {cl:?})"), e)
        })
    }
}

/// The cluster-dimension launch attribute of `cfg`.
fn cluster_attribute(cfg: &LaunchConfig) -> sys::CUlaunchAttribute {
    let mut value = sys::CUlaunchAttributeValue { pad: [0; 64] };
    value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
        x: cfg.cluster[0],
        y: cfg.cluster[1],
        z: cfg.cluster[2],
    };
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value,
    }
}

/// The driver's launch configuration of `cfg` on `stream` with the one
/// attribute `attr` (which must outlive the configuration's use).
fn launch_config(
    cfg: &LaunchConfig,
    stream: sys::CUstream,
    attr: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: cfg.grid[0],
        gridDimY: cfg.grid[1],
        gridDimZ: cfg.grid[2],
        blockDimX: cfg.block[0],
        blockDimY: cfg.block[1],
        blockDimZ: cfg.block[2],
        sharedMemBytes: cfg.shared_bytes,
        hStream: stream,
        attrs: attr,
        numAttrs: 1,
    }
}

/// `cuLaunchKernelEx` of `func` with `cfg`'s grid, block, shared memory and
/// its cluster shape as the `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION` attribute
/// (at most [`crate::cuda::MAX_PORTABLE_CLUSTER`] blocks, so the non-portable
/// opt-in is not needed).
///
/// # Safety
/// As `cuLaunchKernel`: `func` is loaded in the current context, `stream`
/// belongs to it, and `params` points to the kernel's parameter pointers.
unsafe fn launch_clustered(
    func: sys::CUfunction,
    cfg: &LaunchConfig,
    stream: sys::CUstream,
    params: *mut *mut c_void,
) -> std::result::Result<(), dresult::DriverError> {
    let mut attr = cluster_attribute(cfg);
    let config = launch_config(cfg, stream, &mut attr);
    // SAFETY: `config` and the attribute it points to are alive for the call;
    // the caller vouches for the function, the stream and the parameters.
    unsafe { sys::cuLaunchKernelEx(&config, func, params, std::ptr::null_mut()) }.result()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::index::kernel_names;
    use crate::cuda::device::tests::{gpu_or_skip, say};
    use crate::KernelError;

    #[test]
    fn gpu_launch_errors_are_reported() {
        let Some(dev) = gpu_or_skip("gpu_launch_errors_are_reported") else { return };
        let cfg = LaunchConfig::linear(1, 32);
        let x = 0u8;
        // SAFETY: the kernel does not exist, so nothing is launched.
        let r = unsafe { dev.launch_raw("tpar_no_such_kernel", &cfg, &[x]) };
        assert!(matches!(r, Err(KernelError::Cuda { .. })));
        let Some(name) = crate::cuda::sources().iter().flat_map(|s| kernel_names(s.text)).next()
        else {
            return;
        };
        let info = dev.kernel_info(name).unwrap();
        if let Some(p) = info.param_bytes {
            assert!(p > 1, "{name} takes a {p}-byte argument struct");
            // SAFETY: the size check rejects the launch before anything runs.
            let r = unsafe { dev.launch_raw(name, &cfg, &[x]) };
            let msg = format!("{r:?}");
            assert!(msg.contains("argument struct is 1 bytes"), "{msg}");
            // Too much shared memory is refused before the launch, too.
            let big = LaunchConfig::linear(1, 32).with_shared(dev.max_shared_per_block() + 1);
            let args = vec![0u8; p];
            // SAFETY: refused before anything runs (the limit check).
            let r = unsafe { dev.launch_raw(name, &big, &args) };
            assert!(format!("{r:?}").contains("shared memory"), "{r:?}");
        } else {
            say("the driver cannot report parameter sizes (cuFuncGetParamInfo needs CUDA 12.4+)");
        }
    }
}
