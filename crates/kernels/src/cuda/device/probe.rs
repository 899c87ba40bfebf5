//! Probes of the CUDA libraries, before anything calls into them: whether the
//! driver (`libcuda`) and NVRTC load, their versions, the number of devices,
//! and whether the two versions can work together ([`check_toolchain`]).
//! Also the two helpers every other part of the GPU launcher uses to turn a
//! library failure into a [`KernelError::Cuda`]: [`guarded`] (a panic inside
//! cudarc) and [`driver_error`] (a driver error code, with its name and text;
//! a sticky code, which leaves the context unusable, is
//! [`KernelError::ContextLost`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{sys as dsys, CudaContext, DriverError};
use cudarc::nvrtc::sys as nsys;

use crate::cuda::cuda_error;
use crate::{KernelError, Result};

/// Runs `f`, turning a panic (a symbol missing from an old library) into an error.
pub(super) fn guarded<T>(op: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        cuda_error(op, format!("the CUDA library panicked: {msg}"))
    })
}

/// A driver error with its CUDA name and description; a sticky one
/// ([`is_sticky`]) is [`KernelError::ContextLost`].
pub(crate) fn driver_error(op: &str, what: &str, e: DriverError) -> KernelError {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    let detail = match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{:?}", e.0),
    };
    classify(op, format!("{what} failed ({detail})"), e.0)
}

/// The error of a driver call that failed with `code`: [`KernelError::ContextLost`]
/// for a sticky code, else [`KernelError::Cuda`].
fn classify(op: &str, what: String, code: CUresult) -> KernelError {
    if is_sticky(code) {
        KernelError::ContextLost { op: op.to_string(), what: super::watchdog::with_report(what) }
    } else {
        cuda_error(op, what)
    }
}

/// Whether `code` leaves the CUDA context unusable: the driver reports it for
/// a kernel that trapped or faulted (and for a context already destroyed), and
/// then returns it from every later call in the process.
fn is_sticky(code: CUresult) -> bool {
    use CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_NVLINK_UNCORRECTABLE
            | CUDA_ERROR_EXTERNAL_DEVICE
    )
}

/// The candidate file names cudarc tries for a library, shortened for messages.
fn tried(lib: &str) -> String {
    let names = cudarc::get_lib_name_candidates(lib);
    let shown: Vec<&str> = names
        .iter()
        .filter(|n| !n.contains("64_") && !n.contains("64."))
        .map(String::as_str)
        .take(6)
        .collect();
    format!("{}, ... ({} names)", shown.join(", "), names.len())
}

/// The number of CUDA devices, or why the CUDA driver cannot be used here.
///
/// Probes once per process: `libcuda` must be loadable (by the names cudarc
/// tries) and `cuInit` must succeed. Never panics.
pub fn device_count() -> Result<usize> {
    static PROBE: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: only `dlopen`s (and closes) the candidate names of the driver
            // library; nothing is called through it.
            if !unsafe { dsys::is_culib_present() } {
                return Err(format!(
                    "no CUDA driver library could be loaded (tried {}); this needs an NVIDIA \
                     GPU with its driver, or the driver's directory on LD_LIBRARY_PATH",
                    tried("cuda")
                ));
            }
            match guarded("cuda", CudaContext::device_count) {
                Ok(Ok(n)) => Ok(n.max(0) as usize),
                Ok(Err(e)) => Err(driver_error("cuda", "cuInit/cuDeviceGetCount", e).to_string()),
                Err(e) => Err(e.to_string()),
            }
        })
        .clone()
        .map_err(|why| cuda_error("cuda driver", why))
}

/// NVRTC's version `(major, minor)`, or why NVRTC cannot be used here.
///
/// Probes once per process: `libnvrtc` must be loadable by one of the names
/// cudarc tries (`libnvrtc.so`, ..., `libnvrtc.so.13`), which `dlopen` looks
/// up on `LD_LIBRARY_PATH` as it was when the process started
/// (`scripts/nvrtc-env.sh` installs NVRTC and sets it). Never panics.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    static PROBE: OnceLock<std::result::Result<(i32, i32), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: only `dlopen`s (and closes) the candidate names of NVRTC.
            if !unsafe { nsys::is_culib_present() } {
                return Err(format!(
                    "no NVRTC library could be loaded (tried {}); install the CUDA toolkit or \
                     the `nvidia-cuda-nvrtc` wheel and put its lib directory on LD_LIBRARY_PATH \
                     before the process starts (`source scripts/nvrtc-env.sh` does both)",
                    tried("nvrtc")
                ));
            }
            let v = guarded("nvrtc", || {
                let (mut major, mut minor) = (0, 0);
                // SAFETY: writes two ints through pointers to live locals.
                let r = unsafe { nsys::nvrtcVersion(&mut major, &mut minor) };
                (r == nsys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
            });
            match v {
                Ok(Some(v)) => Ok(v),
                Ok(None) => Err("NVRTC loaded but nvrtcVersion failed".into()),
                Err(e) => Err(e.to_string()),
            }
        })
        .clone()
        .map_err(|why| cuda_error("nvrtc", why))
}

/// The CUDA driver's version `(major, minor)` (`cuDriverGetVersion`: the
/// newest CUDA the installed driver supports), or why it cannot be read.
pub fn driver_version() -> Result<(i32, i32)> {
    device_count()?;
    let v = guarded("cuda", || {
        let mut v = 0;
        // SAFETY: the driver library is loaded (`device_count` probed it); writes one
        // int through a pointer to a live local.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        (r == CUresult::CUDA_SUCCESS).then_some(v)
    })?;
    let v = v.ok_or_else(|| cuda_error("cuda driver", "cuDriverGetVersion failed".to_string()))?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// Whether the kernels NVRTC `nvrtc` compiles can load on a driver of CUDA
/// `driver` (both `(major, minor)`), with the reason and the fix when not.
///
/// tpar's cudarc bindings are CUDA 13.0's, loaded at run time, so one build
/// finds the libraries of a CUDA 13 or a CUDA 12 install (`libnvrtc.so.13`,
/// then `.12`) and runs on the drivers of both. What must hold is the CUDA
/// rule for device code: the driver is at least as new, in major version, as
/// the compiler (within one major version, minor-version compatibility loads
/// the device binaries NVRTC produces for the GPU's own architecture).
///
/// ```
/// use tpar_kernels::cuda::device::check_toolchain;
/// assert!(check_toolchain((13, 0), (13, 0)).is_ok());
/// assert!(check_toolchain((12, 8), (13, 0)).is_ok()); // an older NVRTC on a newer driver
/// assert!(check_toolchain((12, 9), (12, 4)).is_ok()); // minor-version compatibility
/// assert!(check_toolchain((13, 0), (12, 8)).is_err()); // NVRTC 13 on a CUDA 12 driver
/// ```
pub fn check_toolchain(nvrtc: (i32, i32), driver: (i32, i32)) -> Result<()> {
    if nvrtc.0 <= driver.0 {
        return Ok(());
    }
    Err(cuda_error(
        "nvrtc",
        format!(
            "NVRTC {}.{} compiles device code that the CUDA {}.{} driver cannot load; put an \
             NVRTC of CUDA {} first on LD_LIBRARY_PATH (e.g. the `nvidia-cuda-nvrtc-cu{}` \
             wheel's lib directory) or update the driver to CUDA {} or newer",
            nvrtc.0, nvrtc.1, driver.0, driver.1, driver.0, driver.0, nvrtc.0
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_driver_errors_are_a_lost_context() {
        use CUresult::*;
        for code in [
            CUDA_ERROR_LAUNCH_FAILED,
            CUDA_ERROR_ILLEGAL_INSTRUCTION,
            CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_MISALIGNED_ADDRESS,
            CUDA_ERROR_HARDWARE_STACK_ERROR,
            CUDA_ERROR_INVALID_PC,
            CUDA_ERROR_ASSERT,
            CUDA_ERROR_LAUNCH_TIMEOUT,
        ] {
            let e = classify("cuda:0", format!("cuStreamSynchronize failed ({code:?})"), code);
            assert!(e.is_context_lost(), "{code:?}: {e}");
            let text = e.to_string();
            assert!(text.starts_with("cuda:0: cuStreamSynchronize failed ("), "{text}");
            assert!(text.contains("the CUDA context is lost"), "{text}");
            assert!(text.contains("TPAR_CUDA_ARCH=sm_90"), "{text}");
        }
        // errors after which the context still works: the call alone failed
        for code in [
            CUDA_ERROR_OUT_OF_MEMORY,
            CUDA_ERROR_INVALID_VALUE,
            CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
            CUDA_ERROR_INVALID_IMAGE,
            CUDA_ERROR_NOT_FOUND,
            CUDA_ERROR_NO_BINARY_FOR_GPU,
            CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
        ] {
            let e = classify("cuda:0", "cuLaunchKernel failed".into(), code);
            assert!(!e.is_context_lost(), "{code:?}: {e}");
            assert!(matches!(e, KernelError::Cuda { .. }), "{code:?}: {e:?}");
            assert!(!e.to_string().contains("context is lost"), "{e}");
        }
    }

    #[test]
    fn probes_do_not_panic() {
        let _ = device_count();
        let _ = nvrtc_version();
    }
}
