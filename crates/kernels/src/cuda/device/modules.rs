//! Compiled kernels, loaded and kept: the process-wide caches of compiled
//! images (per architecture, source and options), loaded modules (per device,
//! source and options) and contexts (per device), the functions taken from a
//! module with what the launch checks need ([`LoadedFunction`]), and the
//! [`CudaDevice`] methods that compile and load a source on first use.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys::{CUfunction_attribute, CUresult};
use cudarc::driver::{sys as dsys, CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::disk_cache::{disk_cache_file, disk_cache_load, disk_cache_store};
use super::index::source_of;
use super::nvrtc::{nvrtc_compile, CompileOptions};
use super::probe::{driver_error, guarded};
use super::watchdog;
use super::CudaDevice;
use crate::cuda::{cuda_error, KernelSource};
use crate::Result;

/// Dynamic shared memory a kernel may use without opting in (48 KiB).
pub const DEFAULT_DYN_SMEM_LIMIT: u32 = 48 * 1024;

/// Locks a mutex, carrying on past a panic in another holder (the guarded
/// data are caches that are either filled or not).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A map of lazily filled slots: concurrent users of one key wait for one
/// producer; a failed production leaves the slot empty for a later retry.
pub(super) struct SlotMap<K, V> {
    slots: Mutex<HashMap<K, Arc<Mutex<Option<V>>>>>,
}

impl<K: Eq + Hash, V: Clone> SlotMap<K, V> {
    fn new() -> Self {
        SlotMap { slots: Mutex::new(HashMap::new()) }
    }

    pub(super) fn get_or_try(&self, key: K, make: impl FnOnce() -> Result<V>) -> Result<V> {
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

pub(super) fn contexts() -> &'static SlotMap<usize, Arc<CudaContext>> {
    static M: OnceLock<SlotMap<usize, Arc<CudaContext>>> = OnceLock::new();
    M.get_or_init(SlotMap::new)
}

/// A module loaded on one device, and the functions taken from it so far.
struct LoadedModule {
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, Arc<LoadedFunction>>>,
}

/// One kernel of a loaded module, with what the launch checks need.
pub(super) struct LoadedFunction {
    pub(super) func: CudaFunction,
    /// Size of the kernel's single parameter, where the driver can tell
    /// (`cuFuncGetParamInfo`, CUDA 12.4+).
    pub(super) param_size: Option<usize>,
    /// Whether the kernel takes more than one parameter (never ours).
    pub(super) extra_params: bool,
    /// Static shared memory per block, in bytes.
    pub(super) static_smem: u32,
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
    pub(super) fn allow_dyn_smem(&self, op: &str, bytes: u32) -> Result<()> {
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
            watchdog::attach(&self.ctx, &self.stream, self.ordinal, &module, source.name);
            Ok(Arc::new(LoadedModule { module, functions: Mutex::new(HashMap::new()) }))
        })
    }

    /// The loaded function `kernel` (compiling its source on first use).
    pub(super) fn function(&self, kernel: &str) -> Result<Arc<LoadedFunction>> {
        if let Some(f) = lock(&self.functions).get(kernel) {
            return Ok(f.clone());
        }
        let op = format!("{} {kernel}", self.op());
        let source = source_of(kernel).ok_or_else(|| {
            let names: Vec<&str> = crate::cuda::sources().iter().map(|s| s.name).collect();
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
        for source in crate::cuda::sources() {
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

#[cfg(test)]
mod tests {
    use crate::cuda::device::index::kernel_names;
    use crate::cuda::device::tests::{gpu_or_skip, say};
    use crate::cuda::Launcher;

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
}
