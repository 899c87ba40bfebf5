//! The GPU launcher: NVRTC compiles the embedded kernel sources for the
//! device's own architecture, cudarc loads and launches them.
//!
//! Nothing here needs CUDA at build time: cudarc loads `libcuda` and
//! `libnvrtc` when first used. Every entry point probes them first
//! ([`device_count`], [`nvrtc_version`]) and reports a missing library, a
//! missing device or a compile failure as [`KernelError::Cuda`], never as a
//! panic (cudarc itself panics when a library it calls into is absent).
//!
//! Compilation is lazy and shared: the first launch of a kernel compiles the
//! source file that defines it (found by its `TPAR_KERNEL(<name>, ...)`
//! line), for the device's architecture and the handle's [`CompileOptions`].
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

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use bytemuck::Pod;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUresult};
use cudarc::driver::{
    result as dresult, sys as dsys, CudaContext, CudaFunction, CudaModule, CudaStream, DriverError,
};
use cudarc::nvrtc::{result as nresult, sys as nsys, Ptx};

use super::{
    cuda_error, DevPtr, DeviceBuffer, GpuDevice, KernelSource, LaunchConfig, Launcher, MemorySpace,
};
use crate::{KernelError, Result};

/// Dynamic shared memory a kernel may use without opting in (48 KiB).
pub const DEFAULT_DYN_SMEM_LIMIT: u32 = 48 * 1024;

// ------------------------------------------------------------------ probes

/// Runs `f`, turning a panic (a symbol missing from an old library) into an error.
fn guarded<T>(op: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        cuda_error(op, format!("the CUDA library panicked: {msg}"))
    })
}

/// A driver error with its CUDA name and description.
pub(crate) fn driver_error(op: &str, what: &str, e: DriverError) -> KernelError {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    let detail = match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{:?}", e.0),
    };
    cuda_error(op, format!("{what} failed ({detail})"))
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

// ------------------------------------------------------------------ compile options

/// How kernel sources are compiled, beyond the fixed `-std=c++17` and the
/// target architecture. Part of the cache key of compiled modules.
///
/// The default keeps full accuracy: no `--use_fast_math`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    /// Preprocessor definitions, `-D NAME` or `-D NAME=VALUE`.
    pub defines: Vec<(String, Option<String>)>,
    /// Emit line information for profilers (`-lineinfo`).
    pub line_info: bool,
    /// `--use_fast_math`: approximate transcendentals, flushed denormals.
    pub fast_math: bool,
    /// A register cap per thread (`--maxrregcount`).
    pub max_registers: Option<u32>,
    /// Build for this architecture (`"sm_90a"`, `"sm_80"`) instead of the
    /// device's own `sm_<major><minor>`.
    pub arch: Option<String>,
}

impl CompileOptions {
    /// The same options with `-D name=value` (or `-D name` for `None`) added.
    pub fn define(mut self, name: &str, value: Option<&str>) -> Self {
        self.defines.push((name.to_string(), value.map(str::to_string)));
        self
    }

    /// The same options with `-lineinfo`.
    pub fn with_line_info(mut self) -> Self {
        self.line_info = true;
        self
    }

    /// The NVRTC command-line options for `arch`, after checking every piece.
    pub fn nvrtc_args(&self, arch: &str) -> Result<Vec<String>> {
        check_arch(arch)?;
        let mut args = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
        for (name, value) in &self.defines {
            let ident = !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ident {
                return Err(cuda_error("nvrtc", format!("bad macro name {name:?} in a define")));
            }
            match value {
                None => args.push(format!("-D{name}")),
                Some(v) if v.contains(['\0', '\n', '\r']) => {
                    return Err(cuda_error(
                        "nvrtc",
                        format!("the value of define {name} holds a NUL or line break"),
                    ))
                }
                Some(v) => args.push(format!("-D{name}={v}")),
            }
        }
        if self.line_info {
            args.push("-lineinfo".into());
        }
        if self.fast_math {
            args.push("--use_fast_math".into());
        }
        if let Some(r) = self.max_registers {
            args.push(format!("--maxrregcount={r}"));
        }
        Ok(args)
    }
}

/// Checks an architecture name: `sm_XY`, `compute_XY` (two or three digits),
/// optionally with an `a` or `f` suffix.
fn check_arch(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").or_else(|| arch.strip_prefix("compute_"));
    let ok = digits.is_some_and(|d| {
        let d = d.strip_suffix(['a', 'f']).unwrap_or(d);
        (2..=3).contains(&d.len()) && d.chars().all(|c| c.is_ascii_digit())
    });
    if ok {
        Ok(())
    } else {
        Err(cuda_error(
            "nvrtc",
            format!("bad GPU architecture {arch:?} (expected e.g. \"sm_90\", \"sm_90a\")"),
        ))
    }
}

// ------------------------------------------------------------------ NVRTC

/// What one NVRTC compilation produced.
struct Compiled {
    ptx: String,
    /// The device binary, when the target was a real architecture (`sm_*`).
    cubin: Option<Vec<u8>>,
}

/// An NVRTC program, destroyed on drop.
struct Program(nsys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once.
        // A failure here leaks the program; nothing else can be done about it.
        let _ = unsafe { nresult::destroy_program(self.0) };
    }
}

/// Bytes from NVRTC (`char` buffers ending in NUL) as text.
fn c_text(buf: &[c_char]) -> String {
    // SAFETY: c_char and u8 have the same size and alignment.
    let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), buf.len()) };
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Compiles `text` (named `<name>.cu` in messages) with `args`.
fn nvrtc_compile(name: &str, text: &str, args: &[String], want_cubin: bool) -> Result<Compiled> {
    let op = format!("nvrtc {name}.cu");
    nvrtc_version()?;
    let src = CString::new(text)
        .map_err(|_| cuda_error(&op, "the source text holds a NUL byte".to_string()))?;
    let file = CString::new(format!("{name}.cu"))
        .map_err(|_| cuda_error(&op, "the source name holds a NUL byte".to_string()))?;
    if args.iter().any(|a| a.contains('\0')) {
        return Err(cuda_error(&op, "a compile option holds a NUL byte".to_string()));
    }
    guarded(&op, || {
        let prog = Program(
            nresult::create_program(&src, Some(&file))
                .map_err(|e| cuda_error(&op, format!("nvrtcCreateProgram failed ({e:?})")))?,
        );
        // SAFETY: `prog` is a live program; the options hold no NUL (checked above).
        let compiled = unsafe { nresult::compile_program(prog.0, args) };
        // SAFETY: `prog` is a live program.
        let log = unsafe { nresult::get_program_log(prog.0) }.map(|l| c_text(&l));
        if let Err(e) = compiled {
            let log = log.unwrap_or_else(|e| format!("(no log: {e:?})"));
            return Err(cuda_error(
                &op,
                format!(
                    "NVRTC failed to compile {name}.cu ({e:?}) with options [{}]:\n{}",
                    args.join(" "),
                    log.trim_end()
                ),
            ));
        }
        // SAFETY: `prog` compiled successfully.
        let ptx = unsafe { nresult::get_ptx(prog.0) }
            .map_err(|e| cuda_error(&op, format!("nvrtcGetPTX failed ({e:?})")))?;
        let mut cubin = None;
        if want_cubin {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; writes one usize to a live local.
            let r = unsafe { nsys::nvrtcGetCUBINSize(prog.0, &mut size) };
            if r == nsys::nvrtcResult::NVRTC_SUCCESS && size > 0 {
                let mut buf = vec![0u8; size];
                // SAFETY: `buf` holds the `size` bytes NVRTC said it will write.
                let r = unsafe { nsys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast()) };
                if r == nsys::nvrtcResult::NVRTC_SUCCESS {
                    cubin = Some(buf);
                }
            }
        }
        Ok(Compiled { ptx: c_text(&ptx), cubin })
    })?
}

/// Compiles one kernel source (after the prelude) to PTX for `arch`
/// (`"sm_90"`, ...) with the default [`CompileOptions`]. Needs NVRTC only,
/// no GPU; a compile error carries NVRTC's log.
pub fn compile_ptx(source: &KernelSource, arch: &str) -> Result<String> {
    compile_ptx_with(source, arch, &CompileOptions::default())
}

/// [`compile_ptx`] with explicit options (`options.arch` is ignored: `arch` wins).
pub fn compile_ptx_with(
    source: &KernelSource,
    arch: &str,
    options: &CompileOptions,
) -> Result<String> {
    let args = options.nvrtc_args(arch)?;
    Ok(nvrtc_compile(source.name, &source.full_text(), &args, false)?.ptx)
}

// ------------------------------------------------------------------ on-disk cache

/// Environment variable for the on-disk cache of compiled kernel binaries:
/// a directory, or `off` (or `0`, or empty) to disable it. Unset, the cache is
/// `$XDG_CACHE_HOME/tpar/kernels` or `~/.cache/tpar/kernels`.
///
/// NVRTC takes up to a minute for the largest sources, and every process
/// would pay it again; the cache keeps each device binary under a hash of
/// everything that determines it (NVRTC version, options, architecture and
/// the full source text), so a changed source simply misses.
pub const KERNEL_CACHE_ENV: &str = "TPAR_KERNEL_CACHE";

fn disk_cache_dir() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| match std::env::var_os(KERNEL_CACHE_ENV) {
        Some(v) if v.is_empty() || v == "0" || v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("tpar").join("kernels")),
    })
    .as_deref()
}

/// 64-bit FNV-1a.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The cache file of one compilation, if the cache is enabled.
fn disk_cache_file(name: &str, arch: &str, args: &[String], text: &str) -> Option<PathBuf> {
    disk_cache_file_in(disk_cache_dir()?, name, arch, args, text).ok()
}

/// The file in cache directory `dir` of one compilation (its name hashes the
/// NVRTC version, so NVRTC must be loadable).
fn disk_cache_file_in(
    dir: &Path,
    name: &str,
    arch: &str,
    args: &[String],
    text: &str,
) -> Result<PathBuf> {
    let (major, minor) = nvrtc_version()?;
    let key = format!("nvrtc {major}.{minor}\n{}\n{text}", args.join("\n"));
    let mut sip = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut sip);
    let h = (sip.finish(), fnv1a(key.as_bytes()));
    Ok(dir.join(format!("{name}-{arch}-{:016x}{:016x}.cubin", h.0, h.1)))
}

/// Compiles every kernel source for `arch` (`"sm_90"`) with `options` into the
/// on-disk cache ([`KERNEL_CACHE_ENV`]) and returns the cache files, without a
/// GPU: NVRTC alone builds the device binaries. A GPU process whose NVRTC has
/// the same version then loads them instead of compiling on first use (a
/// login node can fill a cache that the GPU nodes share). Sources already in
/// the cache are not compiled again. Fails when the cache is off or NVRTC is
/// missing.
pub fn precompile(arch: &str, options: &CompileOptions) -> Result<Vec<PathBuf>> {
    let dir = disk_cache_dir().ok_or_else(|| {
        cuda_error("precompile", format!("the kernel cache is off ({KERNEL_CACHE_ENV})"))
    })?;
    super::sources().iter().map(|s| precompile_into(dir, s, arch, options)).collect()
}

/// [`precompile`] of one source into the cache directory `dir`.
fn precompile_into(
    dir: &Path,
    source: &KernelSource,
    arch: &str,
    options: &CompileOptions,
) -> Result<PathBuf> {
    let args = options.nvrtc_args(arch)?;
    let text = source.full_text();
    let file = disk_cache_file_in(dir, source.name, arch, &args, &text)?;
    if disk_cache_load(&file).is_none() {
        let cubin = nvrtc_compile(source.name, &text, &args, true)?.cubin.ok_or_else(|| {
            cuda_error("precompile", format!("{arch} is not a real architecture (sm_*)"))
        })?;
        disk_cache_store(&file, &cubin);
        if disk_cache_load(&file).is_none() {
            return Err(cuda_error("precompile", format!("could not write {}", file.display())));
        }
    }
    Ok(file)
}

/// A cached device binary (an ELF file), if present and plausible.
fn disk_cache_load(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    bytes.starts_with(b"\x7fELF").then_some(bytes)
}

/// Stores a device binary; failures only cost a later recompilation.
fn disk_cache_store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    // Written under a unique name and renamed, so readers never see a part.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

// ------------------------------------------------------------------ kernel index

/// The kernel names a source defines: the first argument of each
/// `TPAR_KERNEL(<name>, ...)` outside `//` comments, in order.
pub fn kernel_names(text: &str) -> Vec<&str> {
    const MACRO: &str = "TPAR_KERNEL(";
    let mut out = Vec::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find(MACRO) {
            let before_ok = rest[..at]
                .chars()
                .next_back()
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
            let after = &rest[at + MACRO.len()..];
            rest = after;
            if !before_ok {
                continue;
            }
            let after = after.trim_start();
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            let (name, tail) = after.split_at(end);
            if !name.is_empty() && tail.trim_start().starts_with(',') {
                out.push(name);
            }
        }
    }
    out
}

/// The embedded source that defines `kernel`, if any.
pub fn source_of(kernel: &str) -> Option<&'static KernelSource> {
    static INDEX: OnceLock<HashMap<&'static str, &'static KernelSource>> = OnceLock::new();
    INDEX
        .get_or_init(|| {
            let mut index = HashMap::new();
            for src in super::sources() {
                for name in kernel_names(src.text) {
                    index.entry(name).or_insert(src);
                }
            }
            index
        })
        .get(kernel)
        .copied()
}

// ------------------------------------------------------------------ process-wide caches

/// Locks a mutex, carrying on past a panic in another holder (the guarded
/// data are caches that are either filled or not).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A map of lazily filled slots: concurrent users of one key wait for one
/// producer; a failed production leaves the slot empty for a later retry.
struct SlotMap<K, V> {
    slots: Mutex<HashMap<K, Arc<Mutex<Option<V>>>>>,
}

impl<K: Eq + Hash, V: Clone> SlotMap<K, V> {
    fn new() -> Self {
        SlotMap { slots: Mutex::new(HashMap::new()) }
    }

    fn get_or_try(&self, key: K, make: impl FnOnce() -> Result<V>) -> Result<V> {
        let slot = lock(&self.slots).entry(key).or_default().clone();
        let mut slot = lock(&slot);
        if let Some(v) = slot.as_ref() {
            return Ok(v.clone());
        }
        let v = make()?;
        *slot = Some(v.clone());
        Ok(v)
    }
}

/// A compiled image: CUBIN when NVRTC produced one, else PTX for the driver's JIT.
#[derive(Clone)]
enum Image {
    Cubin(Arc<Vec<u8>>),
    Ptx(Arc<String>),
}

type ImageKey = (String, &'static str, CompileOptions);
type ModuleKey = (usize, &'static str, CompileOptions);

fn images() -> &'static SlotMap<ImageKey, Image> {
    static M: OnceLock<SlotMap<ImageKey, Image>> = OnceLock::new();
    M.get_or_init(SlotMap::new)
}

fn modules() -> &'static SlotMap<ModuleKey, Arc<LoadedModule>> {
    static M: OnceLock<SlotMap<ModuleKey, Arc<LoadedModule>>> = OnceLock::new();
    M.get_or_init(SlotMap::new)
}

fn contexts() -> &'static SlotMap<usize, Arc<CudaContext>> {
    static M: OnceLock<SlotMap<usize, Arc<CudaContext>>> = OnceLock::new();
    M.get_or_init(SlotMap::new)
}

/// A module loaded on one device, and the functions taken from it so far.
struct LoadedModule {
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, Arc<LoadedFunction>>>,
}

/// One kernel of a loaded module, with what the launch checks need.
struct LoadedFunction {
    func: CudaFunction,
    /// Size of the kernel's single parameter, where the driver can tell
    /// (`cuFuncGetParamInfo`, CUDA 12.4+).
    param_size: Option<usize>,
    /// Whether the kernel takes more than one parameter (never ours).
    extra_params: bool,
    /// Static shared memory per block, in bytes.
    static_smem: u32,
    /// The dynamic shared memory the kernel is currently allowed (raised on
    /// demand through the function attribute; shared by every handle).
    dyn_smem_limit: Mutex<u32>,
}

/// Whether the driver library exports `symbol` (newer entry points are
/// missing from older drivers, and cudarc panics when calling those).
fn driver_has(symbol: &str) -> bool {
    // SAFETY: only called after `device_count` found the library; looking up a
    // symbol calls nothing.
    unsafe { dsys::culib().get::<unsafe extern "C" fn()>(symbol.as_bytes()).is_ok() }
}

impl LoadedFunction {
    fn new(op: &str, module: &Arc<CudaModule>, name: &str) -> Result<Self> {
        let func =
            module.load_function(name).map_err(|e| driver_error(op, "cuModuleGetFunction", e))?;
        let (mut param_size, mut extra_params) = (None, false);
        if driver_has("cuFuncGetParamInfo") {
            let (mut off, mut size) = (0usize, 0usize);
            // SAFETY: a live function handle; writes two usizes to live locals.
            let r = unsafe { dsys::cuFuncGetParamInfo(func.cu_function(), 0, &mut off, &mut size) };
            if r == CUresult::CUDA_SUCCESS {
                param_size = Some(size);
                // SAFETY: as above; an out-of-range index only returns an error.
                let r1 =
                    unsafe { dsys::cuFuncGetParamInfo(func.cu_function(), 1, &mut off, &mut size) };
                extra_params = r1 == CUresult::CUDA_SUCCESS;
            }
        }
        let static_smem = func
            .shared_size_bytes()
            .map_err(|e| driver_error(op, "cuFuncGetAttribute(SHARED_SIZE_BYTES)", e))?
            .max(0) as u32;
        Ok(LoadedFunction {
            func,
            param_size,
            extra_params,
            static_smem,
            dyn_smem_limit: Mutex::new(DEFAULT_DYN_SMEM_LIMIT),
        })
    }

    /// Allows at least `bytes` of dynamic shared memory (only ever raises it).
    fn allow_dyn_smem(&self, op: &str, bytes: u32) -> Result<()> {
        let mut limit = lock(&self.dyn_smem_limit);
        if bytes > *limit {
            let v = i32::try_from(bytes)
                .map_err(|_| cuda_error(op, format!("{bytes} bytes of shared memory")))?;
            self.func
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    v,
                )
                .map_err(|e| {
                    driver_error(op, &format!("allowing {bytes} bytes of dynamic shared memory"), e)
                })?;
            *limit = bytes;
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ memory

// ------------------------------------------------------------------ the device

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
    vendor: OnceLock<Option<Arc<super::cublaslt::CublasLt>>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Register and memory use of one compiled kernel, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// Registers per thread.
    pub registers: u32,
    /// Local memory per thread (register spills and local arrays), bytes.
    pub local_bytes: u32,
    /// Static shared memory per block, bytes.
    pub static_smem: u32,
    /// The most threads per block this kernel can be launched with.
    pub max_threads: u32,
    /// Size of the kernel's argument struct as compiled, when the driver can tell.
    pub param_bytes: Option<usize>,
}

impl CudaDevice {
    /// Opens GPU `ordinal` with the default [`CompileOptions`].
    ///
    /// Fails with [`KernelError::Cuda`] (no panic) when the CUDA driver or
    /// NVRTC cannot be loaded, or there is no such device.
    pub fn new(ordinal: usize) -> Result<Arc<CudaDevice>> {
        CudaDevice::with_options(ordinal, CompileOptions::default())
    }

    /// Opens GPU `ordinal`; its kernels are compiled with `options`.
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
        let arch = match &options.arch {
            Some(a) => {
                check_arch(a)?;
                a.clone()
            }
            None => format!("sm_{}{}", cc.0, cc.1),
        };
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

    /// The architecture kernels are compiled for (`"sm_90"`).
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

    /// The loaded module of `source` on this device (compiling it on first use).
    fn module(&self, source: &'static KernelSource) -> Result<Arc<LoadedModule>> {
        let op = format!("{} {}.cu", self.op(), source.name);
        let key = (self.ordinal, source.name, self.options.clone());
        modules().get_or_try(key, || {
            let ikey = (self.arch.clone(), source.name, self.options.clone());
            let image = images().get_or_try(ikey, || {
                let args = self.options.nvrtc_args(&self.arch)?;
                let text = source.full_text();
                let file = disk_cache_file(source.name, &self.arch, &args, &text);
                if let Some(bytes) = file.as_deref().and_then(disk_cache_load) {
                    return Ok(Image::Cubin(Arc::new(bytes)));
                }
                let c = nvrtc_compile(source.name, &text, &args, true)?;
                Ok(match c.cubin {
                    Some(b) => {
                        if let Some(f) = &file {
                            disk_cache_store(f, &b);
                        }
                        Image::Cubin(Arc::new(b))
                    }
                    None => Image::Ptx(Arc::new(c.ptx)),
                })
            })?;
            let ptx = match image {
                Image::Cubin(b) => Ptx::from_binary(b.as_ref().clone()),
                Image::Ptx(p) => {
                    if p.contains('\0') {
                        return Err(cuda_error(&op, "the PTX holds a NUL byte".to_string()));
                    }
                    Ptx::from_src(p.as_ref().clone())
                }
            };
            let module = guarded(&op, || self.ctx.load_module(ptx))?
                .map_err(|e| driver_error(&op, "cuModuleLoadData", e))?;
            Ok(Arc::new(LoadedModule { module, functions: Mutex::new(HashMap::new()) }))
        })
    }

    /// The loaded function `kernel` (compiling its source on first use).
    fn function(&self, kernel: &str) -> Result<Arc<LoadedFunction>> {
        if let Some(f) = lock(&self.functions).get(kernel) {
            return Ok(f.clone());
        }
        let op = format!("{} {kernel}", self.op());
        let source = source_of(kernel).ok_or_else(|| {
            let names: Vec<&str> = super::sources().iter().map(|s| s.name).collect();
            cuda_error(
                &op,
                format!(
                    "no kernel source defines it (no `TPAR_KERNEL({kernel}, ...)` in {})",
                    names.join(", ")
                ),
            )
        })?;
        let loaded = self.module(source)?;
        self.ctx.bind_to_thread().map_err(|e| driver_error(&op, "binding the context", e))?;
        let f = {
            let mut fns = lock(&loaded.functions);
            match fns.get(kernel) {
                Some(f) => f.clone(),
                None => {
                    let f = Arc::new(LoadedFunction::new(&op, &loaded.module, kernel)?);
                    fns.insert(kernel.to_string(), f.clone());
                    f
                }
            }
        };
        lock(&self.functions).insert(kernel.to_string(), f.clone());
        Ok(f)
    }

    /// Compiles and loads every embedded source now (instead of on first
    /// use), so compile errors surface at once.
    pub fn compile_all(&self) -> Result<()> {
        for source in super::sources() {
            self.module(source)?;
        }
        Ok(())
    }

    /// Registers, spills and shared memory of `kernel` as compiled here.
    pub fn kernel_info(&self, kernel: &str) -> Result<KernelInfo> {
        let f = self.function(kernel)?;
        let op = format!("{} {kernel}", self.op());
        let get = |a: CUfunction_attribute, what: &str| -> Result<u32> {
            f.func.get_attribute(a).map(|v| v.max(0) as u32).map_err(|e| driver_error(&op, what, e))
        };
        Ok(KernelInfo {
            registers: get(CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS, "NUM_REGS")?,
            local_bytes: get(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                "LOCAL_SIZE_BYTES",
            )?,
            static_smem: f.static_smem,
            max_threads: get(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                "MAX_THREADS_PER_BLOCK",
            )?,
            param_bytes: f.param_size,
        })
    }
}

/// Makes the device's default memory pool (the one `cuMemAllocAsync` draws
/// from) keep freed memory for reuse instead of returning it to the driver at
/// every synchronisation: the default release threshold of 0 would make each
/// step's allocations real driver allocations again after a logged step's
/// read-back. As a caching allocator does, the pool then holds the step's peak.
/// A failure leaves the default, which is slower but correct.
fn keep_pool_memory(ctx: &Arc<CudaContext>) {
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
        super::profile::timed(&self.ctx, &self.stream, name, || {
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
        super::profile::timed(&self.ctx, &self.stream, name, || {
            // SAFETY: the caller guarantees the range.
            unsafe { dresult::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
        })
        .map_err(|e| driver_error(&op, "cuMemsetD8Async", e))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| driver_error(&self.op(), "cuStreamSynchronize", e))
    }

    /// cuBLASLt, on this handle's stream, for every problem it takes (f32
    /// accumulation, no TF32); `Ok(false)` when cuBLASLt cannot be loaded or
    /// has no algorithm for the problem.
    ///
    /// # Safety
    /// As [`GpuDevice::vendor_gemm`].
    unsafe fn vendor_gemm(
        &self,
        p: &super::raw::gemm::GemmProblem,
        a: DevPtr,
        b: DevPtr,
        c: DevPtr,
    ) -> Result<bool> {
        let lt = self
            .vendor
            .get_or_init(|| super::cublaslt::CublasLt::new(&self.me.upgrade()?).ok().map(Arc::new));
        let Some(lt) = lt else { return Ok(false) };
        let name = || "(cublasLtMatmul)".to_string();
        let r = super::profile::timed(&self.ctx, &self.stream, name, || {
            // SAFETY: forwarded from the caller; cuBLASLt queues on this handle's stream.
            unsafe { lt.matmul(p, a, b, c) }
        });
        Ok(r.is_ok())
    }
}

impl Launcher for CudaDevice {
    fn describe(&self) -> String {
        format!("cuda:{} ({}, {})", self.ordinal, self.arch, self.name)
    }

    /// # Safety
    /// As [`Launcher::launch_raw`].
    unsafe fn launch_raw(&self, kernel: &str, cfg: &LaunchConfig, args: &[u8]) -> Result<()> {
        let size = args.len();
        // the name for messages, built only when something fails
        let op = || format!("{} {kernel}", self.op());
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
        super::profile::timed(
            &self.ctx,
            &self.stream,
            || kernel.to_string(),
            || {
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
        .map_err(|e| driver_error(&op(), &format!("cuLaunchKernel (grid {g:?}, block {b:?})"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_kernel_names() {
        let text = "// TPAR_KERNEL(commented, A, 32)\n\
                    TPAR_KERNEL(tpar_a_f32, Args, 256) { }\n\
                    TPAR_KERNEL( tpar_b_bf16 , Args, 256) {}  TPAR_KERNEL(tpar_c_f16,X,32){}\n\
                    #define MY_TPAR_KERNEL(x, y) x\n\
                    TPAR_KERNEL(not_a_kernel)\n";
        assert_eq!(kernel_names(text), ["tpar_a_f32", "tpar_b_bf16", "tpar_c_f16"]);
    }

    #[test]
    fn every_embedded_kernel_is_indexed() {
        for src in crate::cuda::sources() {
            for name in kernel_names(src.text) {
                assert_eq!(source_of(name).map(|s| s.name), Some(src.name), "{name}");
            }
        }
        assert!(source_of("tpar_no_such_kernel").is_none());
    }

    #[test]
    fn precompiled_binaries_land_where_a_device_looks() {
        let nvrtc = nvrtc_version();
        if nvrtc.is_err() && std::env::var("TPAR_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
            panic!("TPAR_REQUIRE_NVRTC=1 but NVRTC is unavailable: {nvrtc:?}");
        }
        let dir = std::env::temp_dir().join(format!("tpar-precompile-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let source = source_of("tpar_adamw_f32").expect("adamw.cu is indexed");
        let options = CompileOptions::default();
        let got = precompile_into(&dir, source, "sm_90", &options);
        if nvrtc.is_err() {
            // Without NVRTC the file name (it hashes NVRTC's version) is unknown.
            assert!(got.is_err());
            return;
        }
        let file = got.unwrap();
        // The name a device of sm_90 with these options computes when it loads the source.
        let args = options.nvrtc_args("sm_90").unwrap();
        let want = disk_cache_file_in(&dir, source.name, "sm_90", &args, &source.full_text());
        assert_eq!(file, want.unwrap());
        assert!(disk_cache_load(&file).is_some(), "not an ELF device binary");
        // A second run finds it and leaves it as it is.
        let before = std::fs::metadata(&file).unwrap().modified().unwrap();
        assert_eq!(precompile_into(&dir, source, "sm_90", &options).unwrap(), file);
        assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), before);
        // A virtual architecture has no device binary to cache.
        assert!(precompile_into(&dir, source, "compute_90", &options).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn options_become_nvrtc_args() {
        let o = CompileOptions::default().define("TILE", Some("64")).define("FAST", None);
        let args = o.nvrtc_args("sm_90").unwrap();
        assert_eq!(args, ["--gpu-architecture=sm_90", "-std=c++17", "-DTILE=64", "-DFAST"]);
        assert!(!args.iter().any(|a| a.contains("fast_math")));
        let o = CompileOptions { line_info: true, max_registers: Some(128), ..o };
        let args = o.nvrtc_args("sm_90a").unwrap();
        assert!(args.contains(&"-lineinfo".to_string()));
        assert!(args.contains(&"--maxrregcount=128".to_string()));
    }

    #[test]
    fn bad_options_are_errors() {
        for arch in ["", "sm_", "sm_9", "sm_9000", "gfx90a", "sm_90 -x", "compute_9x"] {
            assert!(CompileOptions::default().nvrtc_args(arch).is_err(), "{arch:?}");
        }
        for arch in ["sm_80", "sm_90", "sm_90a", "sm_100f", "compute_90"] {
            assert!(CompileOptions::default().nvrtc_args(arch).is_ok(), "{arch:?}");
        }
        let bad = CompileOptions::default().define("1X", None);
        assert!(bad.nvrtc_args("sm_90").is_err());
        let bad = CompileOptions::default().define("X Y", None);
        assert!(bad.nvrtc_args("sm_90").is_err());
        let bad = CompileOptions::default().define("X", Some("a\0b"));
        assert!(bad.nvrtc_args("sm_90").is_err());
    }

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

    #[test]
    fn disk_cache_round_trip() {
        let dir = std::env::temp_dir().join(format!("tpar-kcache-test-{}", std::process::id()));
        let f = dir.join("x-sm_90-0.cubin");
        disk_cache_store(&f, b"\x7fELF and the rest");
        assert_eq!(disk_cache_load(&f).as_deref(), Some(&b"\x7fELF and the rest"[..]));
        disk_cache_store(&f, b"not a binary");
        assert_eq!(disk_cache_load(&f), None);
        assert_eq!(disk_cache_load(&dir.join("missing.cubin")), None);
        let _ = std::fs::remove_dir_all(&dir);
        assert_ne!(fnv1a(b"a"), fnv1a(b"b"));
    }

    #[test]
    fn probes_do_not_panic() {
        let _ = device_count();
        let _ = nvrtc_version();
    }

    /// Prints past the test harness's capture.
    fn say(text: &str) {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), "{text}");
    }

    /// GPU 0, or `None` (with the reason printed) where there is none.
    pub(crate) fn gpu_or_skip(test: &str) -> Option<Arc<CudaDevice>> {
        match CudaDevice::new(0) {
            Ok(d) => Some(d),
            Err(e) => {
                say(&format!("skipping {test} (no usable GPU): {e}"));
                None
            }
        }
    }

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

    #[test]
    fn gpu_compiles_and_loads_every_kernel() {
        let Some(dev) = gpu_or_skip("gpu_compiles_and_loads_every_kernel") else { return };
        let start = std::time::Instant::now();
        dev.compile_all().unwrap();
        let mut report = format!(
            "{}: compiled and loaded {} source(s) in {:.1} s\n  {:<40} {:>5} {:>6} {:>6} {:>6} {:>6}",
            dev.describe(),
            crate::cuda::sources().len(),
            start.elapsed().as_secs_f64(),
            "kernel",
            "regs",
            "local",
            "smem",
            "maxthr",
            "param"
        );
        for src in crate::cuda::sources() {
            for name in kernel_names(src.text) {
                let i = dev.kernel_info(name).unwrap();
                assert!(i.max_threads > 0, "{name}");
                report.push_str(&format!(
                    "\n  {name:<40} {:>5} {:>6} {:>6} {:>6} {:>6}",
                    i.registers,
                    i.local_bytes,
                    i.static_smem,
                    i.max_threads,
                    i.param_bytes.map_or("?".into(), |p| p.to_string())
                ));
            }
        }
        say(&report);
    }

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
