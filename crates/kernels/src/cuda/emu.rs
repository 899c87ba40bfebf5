//! The CPU emulator: runs the CUDA kernel sources on the host.
//!
//! [`Emulator::get`] builds the fiber scheduler `cuda/emu/emu.cpp` with the
//! host C++ compiler (`$CXX`, else `c++`) into a runtime library; the first
//! launch of a kernel builds its source against `cuda/emu/emu.h` into a
//! library linked to that runtime. Libraries are cached under the system
//! temporary directory by a hash of their text.
//! Device addresses are host addresses: the [`super::raw`] launchers take
//! `slice.as_ptr() as DevPtr` on the [`Emulator`] itself; [`EmulatedGpu`] owns
//! such memory as [`super::DeviceBuffer`]s for the safe [`super::ops`].
//!
//! Each launch checks what a GPU launch would reject (block size above the
//! kernel's launch bounds, an argument struct of the wrong size, more than
//! 227 KiB of dynamic shared memory) and what a kernel gets wrong that the
//! emulator can see (deadlocked barriers, misaligned `cp.async`/`ldmatrix`,
//! shuffles from exited lanes). A thread's access that the host faults on (an
//! aligned vector access at a misaligned address, an unmapped address, an
//! overflowed stack) fails its launch with the thread named, where a GPU reports
//! a misaligned or an illegal address, instead of ending the process; so does an
//! integer division by zero, which a GPU answers with an unspecified value.
//! Threads of a block run in a shuffled order between synchronization points
//! (seeded, [`Emulator::set_seed`]); blocks run one at a time, in the grid's
//! order or, [`BlockOrder::Shuffled`] ([`BLOCK_ORDER_ENV`]), in one drawn from the
//! seed, which shows results that depend on the order blocks run in.
//! [`Emulator::racecheck`] (or [`RACECHECK_ENV`]) also checks every access to
//! shared and global memory for data races, as `compute-sanitizer --tool
//! racecheck` does on a GPU, for out-of-bounds and misaligned addresses, as its
//! `memcheck` does, and for reads of device memory nothing wrote, as its `initcheck`
//! does.
//!
//! Hopper's instructions are emulated too (`crates/kernels/cuda/README.md`
//! says how): mbarriers (a wait no phase can complete is reported as a
//! deadlock), bulk tensor copies through tensor maps of
//! [`super::tensor_map::TensorMap::encode_tiled_emulated`], `wgmma.mma_async`
//! as a warpgroup collective (accumulators NaN until `wgmma_wait`),
//! `setmaxnreg` with the block's register pool (a block holds 64K registers
//! over its threads; `.inc` waits until `.dec` returned enough, so counts
//! that do not fit are reported as a deadlock, where a GPU hangs), and
//! thread-block clusters ([`Emulator::launch_cluster_raw`]:
//! distributed shared memory, the cluster barrier, multicast copies).
//!
//! ```no_run
//! use tpar_kernels::cuda::emu::Emulator;
//! let emu = Emulator::get()?;
//! println!("{} kernel sources", tpar_kernels::cuda::sources().len());
//! # let _ = emu;
//! # Ok::<(), tpar_kernels::KernelError>(())
//! ```

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use std::sync::Arc;

use super::raw::gemm_hopper::EMU_ARCH_ENV;
use super::{cuda_error, sources, Arch, DevPtr, GpuDevice, LaunchConfig, Launcher, MemorySpace};
use crate::Result;

const EMU_H: &str = include_str!("../../cuda/emu/emu.h");
const EMU_CPP: &str = include_str!("../../cuda/emu/emu.cpp");
const CXX_FLAGS: &[&str] = &["-std=c++17", "-O2", "-fPIC", "-DTPAR_EMU", "-w"];

type KernelFn = unsafe extern "C" fn(*const c_void);
type LaunchFn = unsafe extern "C" fn(
    KernelFn,
    *const c_void,
    usize,
    *const u32,
    *const u32,
    *const u32,
    usize,
    i32,
    u64,
    *mut c_char,
    usize,
) -> i32;
/// `tpar_emu_track(ptr, bytes, live)`: the checking runtime's allocation registry.
type TrackFn = unsafe extern "C" fn(*const c_void, usize, i32);
/// `tpar_emu_written(ptr, bytes)`: the host side wrote device memory (initcheck).
type WrittenFn = unsafe extern "C" fn(*const c_void, usize);

#[derive(Clone, Copy)]
struct KernelInfo {
    entry: KernelFn,
    args_size: usize,
    max_threads: u32,
}

/// The emulator runtime and the kernel libraries built so far; a
/// [`Launcher`] for every embedded kernel.
pub struct Emulator {
    launch: LaunchFn,
    cxx: String,
    /// Flags kernel sources are compiled with beyond [`CXX_FLAGS`] (see
    /// [`contraction_flags`]).
    kernel_flags: Vec<String>,
    /// Whether launches run the checks of [`RACECHECK_ENV`] (races, bounds,
    /// uninitialized reads).
    racecheck: bool,
    /// The checking runtime's allocation registry (memcheck), when checking.
    track: Option<(TrackFn, WrittenFn)>,
    rt_path: PathBuf,
    rt_hash: u64,
    libs: Mutex<
        HashMap<
            &'static str,
            std::result::Result<&'static libloading::Library, crate::KernelError>,
        >,
    >,
    kernels: Mutex<HashMap<String, KernelInfo>>,
    extra: Mutex<Vec<&'static libloading::Library>>,
    seed: AtomicU64,
    /// [`BlockOrder::Shuffled`].
    shuffle_blocks: AtomicBool,
    _rt: libloading::Library,
}

static EMULATOR: OnceLock<std::result::Result<Emulator, crate::KernelError>> = OnceLock::new();
static RACECHECK: OnceLock<std::result::Result<Emulator, crate::KernelError>> = OnceLock::new();

/// The environment variable that makes [`Emulator::get`] check every launch as
/// [`Emulator::racecheck`] does (data races in shared and global memory, out-of-bounds
/// and misaligned accesses, reads of device memory nothing wrote):
/// `TPAR_EMU_RACECHECK=1` (so a whole test suite can run under the check). Unset, empty
/// or `0`: off.
pub const RACECHECK_ENV: &str = "TPAR_EMU_RACECHECK";

/// Whether [`RACECHECK_ENV`] asks for the race check.
fn racecheck_from_env() -> Result<bool> {
    match std::env::var(RACECHECK_ENV).ok().as_deref() {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => {
            Err(cuda_error("emulator", format!("{RACECHECK_ENV}={other:?}: expected 1 or 0")))
        }
    }
}

/// The environment variable that makes the emulator contract floating-point
/// expressions as a GPU compiler may: `TPAR_EMU_FP_CONTRACT=fast` compiles kernel
/// sources with `-ffp-contract=fast -mfma`, so `a * b + c` may become one fused
/// multiply-add where the host compiler chooses. A kernel whose bits must not
/// depend on the compiler's choice (two kernels that must agree, or one that
/// must equal the CPU kernel) then shows the difference here too; the default
/// compiles every operation as written.
pub const FP_CONTRACT_ENV: &str = "TPAR_EMU_FP_CONTRACT";

/// The flags [`FP_CONTRACT_ENV`] asks for: none unless it is `fast`, which
/// needs a host with FMA instructions.
fn contraction_flags() -> Result<Vec<String>> {
    match std::env::var(FP_CONTRACT_ENV).ok().as_deref() {
        None | Some("") | Some("off") => Ok(Vec::new()),
        Some("fast") => {
            #[cfg(target_arch = "x86_64")]
            let fma = std::arch::is_x86_feature_detected!("fma");
            #[cfg(not(target_arch = "x86_64"))]
            let fma = cfg!(target_arch = "aarch64");
            if !fma {
                return Err(cuda_error(
                    "emulator",
                    format!("{FP_CONTRACT_ENV}=fast needs a host with fused multiply-add"),
                ));
            }
            let mut f = vec!["-ffp-contract=fast".to_string()];
            if cfg!(target_arch = "x86_64") {
                f.push("-mfma".to_string());
            }
            Ok(f)
        }
        Some(other) => Err(cuda_error(
            "emulator",
            format!("{FP_CONTRACT_ENV}={other:?}: expected fast or off"),
        )),
    }
}

/// The environment variable that makes the emulator run a launch's blocks in an
/// order drawn from its seed instead of the grid's: `TPAR_EMU_BLOCK_ORDER=shuffled`
/// (`grid`, unset or empty: the grid's order). A GPU runs blocks in any order, so a
/// result that depends on it (float atomics of several blocks into one value) differs
/// between runs there; under this setting it differs between seeds here too, and a
/// check that expects such a result's bits fails. [`Emulator::set_block_order`] sets
/// it on one emulator.
pub const BLOCK_ORDER_ENV: &str = "TPAR_EMU_BLOCK_ORDER";

/// The order an [`Emulator`] runs a launch's blocks (clusters) in, one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOrder {
    /// The grid's: x fastest, then y, then z.
    Grid,
    /// A permutation drawn from the launch seed ([`Emulator::set_seed`]).
    Shuffled,
}

/// The order [`BLOCK_ORDER_ENV`] asks for.
fn block_order_from_env() -> Result<BlockOrder> {
    match std::env::var(BLOCK_ORDER_ENV).ok().as_deref() {
        None | Some("") | Some("grid") => Ok(BlockOrder::Grid),
        Some("shuffled") => Ok(BlockOrder::Shuffled),
        Some(other) => Err(cuda_error(
            "emulator",
            format!("{BLOCK_ORDER_ENV}={other:?}: expected grid or shuffled"),
        )),
    }
}

fn cache_root() -> PathBuf {
    std::env::temp_dir().join("tpar-emu")
}

impl Emulator {
    /// The process-wide emulator; its runtime is compiled (or found in the
    /// cache) on first use, each kernel source on the first launch of one of
    /// its kernels.
    ///
    /// Fails with [`crate::KernelError::Cuda`] carrying the compiler's output
    /// when no C++ compiler is found or the runtime does not build.
    pub fn get() -> Result<&'static Emulator> {
        EMULATOR
            .get_or_init(|| Emulator::build(racecheck_from_env()?))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The process-wide emulator that checks every launch for data races on
    /// shared memory, as `compute-sanitizer --tool racecheck` does on a GPU, and
    /// also for asynchronous reads (bulk stores, bulk reductions, wgmma operands)
    /// of shared memory written by ordinary stores without a `fence.proxy.async`
    /// between, and for loads of shared memory nothing in the block has written.
    /// A launch with a race fails with [`crate::KernelError::Cuda`] naming
    /// both accesses (kind, threads, the shared-memory byte, the function).
    ///
    /// Its kernels are compiled with the host compiler's thread-sanitizer
    /// instrumentation (`-fsanitize=thread`; no sanitizer runtime is linked: the
    /// emulator implements the hooks) and run several times slower than
    /// [`Emulator::get`]'s. What orders accesses is what the CUDA memory model
    /// and the PTX ISA give: `__syncthreads`, `__syncwarp`, the cluster barrier,
    /// mbarrier arrivals and phase waits, and the completion of each asynchronous
    /// operation (a bulk tensor load's complete_tx, `wgmma.wait_group`,
    /// `cp.async.bulk.wait_group`, `cp.async.wait_group`); shuffles, votes and
    /// warpgroup operations order nothing. Global memory is checked too: between
    /// the threads of a block as shared memory is, and between the blocks of a
    /// launch, which nothing orders, any two accesses to one byte (one a write, not
    /// both atomics) are a race.
    ///
    /// The same check is a memcheck, as `compute-sanitizer --tool memcheck` is on a
    /// GPU: an access whose type needs an aligned address (a 2-, 4-, 8- or 16-byte
    /// load or store, an atomic) at a misaligned one; dynamic shared memory reached
    /// outside the bytes the launch gave the block; and, on launches of an
    /// [`EmulatedGpu`] (its buffers are registered with the check), global memory
    /// outside every live allocation: past a buffer's end, before its start, or in a
    /// freed one; and, as `initcheck`, a read of bytes of such an allocation that
    /// nothing has written since it was allocated (kernels' stores, bulk stores and
    /// atomics write, and so do the device's copies and memsets; an atomic reads what
    /// it updates). The thread stops before the access, and the launch fails naming
    /// it, the address and the nearest allocation. Raw launches on host memory the
    /// check does not know ([`Emulator::launch_cluster_raw`] with `Vec` addresses) are
    /// not checked for global bounds (what they write of a device allocation counts as
    /// written). Not covered: `__shared__` statics overrunning each other.
    ///
    /// ```no_run
    /// use tpar_kernels::cuda::emu::Emulator;
    /// let emu = Emulator::racecheck()?;
    /// // launch kernels on `emu` as on Emulator::get()'s
    /// # let _ = emu;
    /// # Ok::<(), tpar_kernels::KernelError>(())
    /// ```
    pub fn racecheck() -> Result<&'static Emulator> {
        RACECHECK.get_or_init(|| Emulator::build(true)).as_ref().map_err(Clone::clone)
    }

    /// Whether this emulator checks its launches for data races (and for memory
    /// errors: see [`Emulator::racecheck`]).
    pub fn checks_races(&self) -> bool {
        self.racecheck
    }

    /// Registers (`live`) or unregisters device memory with the checking
    /// runtime's memcheck; nothing without the check.
    fn track(&self, ptr: DevPtr, bytes: usize, live: bool) {
        if let Some((track, _)) = self.track {
            // SAFETY: records an address range in the runtime's registry; nothing
            // is dereferenced.
            unsafe { track(ptr as *const c_void, bytes, i32::from(live)) }
        }
    }

    /// Tells the checking runtime's initcheck that the host side wrote device memory.
    fn wrote(&self, ptr: DevPtr, bytes: usize) {
        if let Some((_, written)) = self.track {
            // SAFETY: marks an address range in the runtime's registry; nothing is
            // dereferenced.
            unsafe { written(ptr as *const c_void, bytes) }
        }
    }

    /// Sets the seed of the thread order (and, [`BlockOrder::Shuffled`], the block
    /// order) used by later launches.
    pub fn set_seed(&self, seed: u64) {
        self.seed.store(seed, Ordering::Relaxed);
    }

    /// Sets the order later launches run their blocks in (see [`BLOCK_ORDER_ENV`],
    /// which sets it for [`Emulator::get`] and [`Emulator::racecheck`]).
    pub fn set_block_order(&self, order: BlockOrder) {
        self.shuffle_blocks.store(order == BlockOrder::Shuffled, Ordering::Relaxed);
    }

    /// The order launches run their blocks in.
    pub fn block_order(&self) -> BlockOrder {
        if self.shuffle_blocks.load(Ordering::Relaxed) {
            BlockOrder::Shuffled
        } else {
            BlockOrder::Grid
        }
    }

    /// The emulator runtime library in use.
    pub fn runtime_path(&self) -> &Path {
        &self.rt_path
    }

    fn build(racecheck: bool) -> Result<Emulator> {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let mut kernel_flags = contraction_flags()?;
        let rt_flags: Vec<String> =
            if racecheck { vec![RACECHECK_DEFINE.to_string()] } else { Vec::new() };
        if racecheck {
            kernel_flags.push(RACECHECK_DEFINE.to_string());
        }
        let mut hash = Fnv::new();
        for part in [EMU_H, EMU_CPP, &cxx] {
            hash.add(part.as_bytes());
        }
        for f in CXX_FLAGS.iter().copied().chain(rt_flags.iter().map(String::as_str)) {
            hash.add(f.as_bytes());
        }
        let dir = cache_root().join(format!("runtime-{:016x}", hash.0));
        // distinct names: both runtimes may be loaded in one process, and each
        // kernel library names its own
        let rt_file = if racecheck { "libtpar_emu_rt_race.so" } else { "libtpar_emu_rt.so" };
        let rt_path = dir.join(rt_file);
        if !rt_path.exists() {
            build_library(
                &cxx,
                &dir,
                rt_file,
                &[("emu.h", EMU_H.to_string()), ("emu.cpp", EMU_CPP.to_string())],
                None,
                &rt_flags,
                &[],
            )?;
        }
        // SAFETY: the runtime is ours, built from the embedded emu.cpp; its
        // initializers only set up C++ statics.
        let rt = unsafe { libloading::Library::new(&rt_path) }
            .map_err(|e| cuda_error("emulator", format!("loading {}: {e}", rt_path.display())))?;
        // SAFETY: `tpar_emu_launch_cluster` is defined in emu.cpp with this signature.
        let launch: LaunchFn = unsafe {
            *rt.get::<LaunchFn>(b"tpar_emu_launch_cluster\0")
                .map_err(|e| cuda_error("emulator", format!("tpar_emu_launch_cluster: {e}")))?
        };
        let track = if racecheck {
            // SAFETY: the checking runtime defines `tpar_emu_track` and
            // `tpar_emu_written` with these signatures.
            Some(unsafe {
                (
                    *rt.get::<TrackFn>(b"tpar_emu_track\0")
                        .map_err(|e| cuda_error("emulator", format!("tpar_emu_track: {e}")))?,
                    *rt.get::<WrittenFn>(b"tpar_emu_written\0")
                        .map_err(|e| cuda_error("emulator", format!("tpar_emu_written: {e}")))?,
                )
            })
        } else {
            None
        };
        Ok(Emulator {
            launch,
            cxx,
            kernel_flags,
            racecheck,
            track,
            rt_path,
            rt_hash: hash.0,
            libs: Mutex::new(HashMap::new()),
            kernels: Mutex::new(HashMap::new()),
            extra: Mutex::new(Vec::new()),
            seed: AtomicU64::new(0x7470_6172),
            shuffle_blocks: AtomicBool::new(block_order_from_env()? == BlockOrder::Shuffled),
            _rt: rt,
        })
    }

    /// The library of one kernel source, compiled on first use.
    fn library(&self, src: &super::KernelSource) -> Result<&'static libloading::Library> {
        let mut libs = self.libs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = libs.get(src.name) {
            return r.clone();
        }
        let result = self.build_source(src.name, &src.full_text());
        libs.insert(src.name, result.clone());
        result
    }

    /// Compiles a kernel source of the caller's (CUDA C++ written to the
    /// conventions of `crates/kernels/cuda/README.md`; the prelude is added)
    /// and makes its kernels launchable by name on this emulator. Its kernel
    /// names must not repeat the embedded ones'.
    ///
    /// Useful to test kernels of one's own on a machine without a GPU.
    pub fn add_source(&self, name: &str, text: &str) -> Result<()> {
        let full = format!("{}\n#line 1 \"{name}.cu\"\n{text}", super::PRELUDE);
        let lib = self.build_source(name, &full)?;
        self.extra.lock().unwrap_or_else(|p| p.into_inner()).push(lib);
        Ok(())
    }

    fn build_source(&self, name: &str, text: &str) -> Result<&'static libloading::Library> {
        let src_name = name;
        let mut hash = Fnv::new();
        hash.add(&self.rt_hash.to_le_bytes());
        hash.add(text.as_bytes());
        for f in &self.kernel_flags {
            hash.add(f.as_bytes());
        }
        let dir = cache_root().join(format!("{src_name}-{:016x}", hash.0));
        let file = format!("libtpar_emu_{src_name}.so");
        let path = dir.join(&file);
        if !path.exists() {
            let unit = format!("#include \"emu.h\"\n{text}");
            build_library(
                &self.cxx,
                &dir,
                &file,
                &[("emu.h", EMU_H.to_string()), (&format!("{src_name}.cpp"), unit)],
                Some(&self.rt_path),
                &self.kernel_flags,
                if self.racecheck { INSTRUMENT_FLAGS } else { &[] },
            )?;
        }
        // SAFETY: built from CUDA C++ source against the emulator; loading runs
        // only C++ static initialization. Kept loaded for the process.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| cuda_error(src_name, format!("loading {}: {e}", path.display())))?;
        Ok(&*Box::leak(Box::new(lib)))
    }

    fn kernel(&self, name: &str) -> Result<KernelInfo> {
        if let Some(k) = self.kernels.lock().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(*k);
        }
        let sym = |suffix: &str| format!("{name}{suffix}\0").into_bytes();
        let lookup = |lib: &'static libloading::Library| -> Option<KernelInfo> {
            // SAFETY: TPAR_KERNEL (emu.h) defines these three symbols with exactly
            // these signatures for every kernel.
            unsafe {
                let entry = lib.get::<KernelFn>(&*sym("")).ok()?;
                let size =
                    lib.get::<unsafe extern "C" fn() -> usize>(&*sym("_tpar_args_size")).ok()?;
                let max =
                    lib.get::<unsafe extern "C" fn() -> u32>(&*sym("_tpar_max_threads")).ok()?;
                Some(KernelInfo { entry: *entry, args_size: size(), max_threads: max() })
            }
        };
        let extra: Vec<_> = self.extra.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(info) = extra.into_iter().find_map(lookup) {
            self.kernels.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string(), info);
            return Ok(info);
        }
        let declared = format!("TPAR_KERNEL({name},");
        let mut candidates: Vec<_> =
            sources().iter().filter(|s| s.text.contains(&declared)).collect();
        if candidates.is_empty() {
            // declared through a macro: look in every source
            candidates = sources().iter().collect();
        }
        let mut first_err = None;
        for src in candidates {
            let lib = match self.library(src) {
                Ok(l) => l,
                Err(e) => {
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            let Some(info) = lookup(lib) else { continue };
            self.kernels.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string(), info);
            return Ok(info);
        }
        Err(first_err.unwrap_or_else(|| cuda_error(name, "no such kernel in the embedded sources")))
    }
}

impl Emulator {
    /// Checks what a GPU launch of `kernel` with `cfg` and `args` would refuse (an
    /// argument struct of the wrong size, a block above the kernel's launch bounds),
    /// building its source on first use.
    fn validate(&self, kernel: &str, cfg: &LaunchConfig, args: &[u8]) -> Result<KernelInfo> {
        let info = self.kernel(kernel)?;
        let size = args.len();
        if size != info.args_size {
            return Err(cuda_error(
                kernel,
                format!(
                    "argument struct of {size} bytes; the kernel declares {} bytes",
                    info.args_size
                ),
            ));
        }
        let threads: u32 = cfg.block.iter().product();
        if threads > info.max_threads {
            return Err(cuda_error(
                kernel,
                format!(
                    "{threads} threads per block exceed its launch bounds ({})",
                    info.max_threads
                ),
            ));
        }
        Ok(info)
    }

    /// Launches `kernel` as a grid of thread-block clusters of `cluster`
    /// blocks (each dim dividing the grid's, at most 16 blocks; `cluster`
    /// replaces `cfg.cluster`): the blocks of a cluster run together, reach
    /// each other's dynamic shared memory (`cluster_map`), meet at
    /// `cluster_sync` and receive multicast bulk copies. `[1, 1, 1]` is an
    /// ordinary launch. [`Launcher::launch_raw`] launches `cfg.cluster`
    /// clusters, at most [`super::MAX_PORTABLE_CLUSTER`] blocks each, as a GPU does.
    ///
    /// # Safety
    /// As [`Launcher::launch_raw`].
    pub unsafe fn launch_cluster_raw(
        &self,
        kernel: &str,
        cfg: &LaunchConfig,
        cluster: [u32; 3],
        args: &[u8],
    ) -> Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.launch_checked(kernel, cfg, cluster, args, false) }
    }

    /// [`Emulator::launch_cluster_raw`]; `device_memory`: every global address
    /// the kernel reaches is [`EmulatedGpu`] memory (registered with the checking
    /// runtime, whose memcheck then refuses any other).
    ///
    /// # Safety
    /// As [`Launcher::launch_raw`].
    unsafe fn launch_checked(
        &self,
        kernel: &str,
        cfg: &LaunchConfig,
        cluster: [u32; 3],
        args: &[u8],
        device_memory: bool,
    ) -> Result<()> {
        let info = self.validate(kernel, cfg, args)?;
        let mut err = vec![0u8; 4096];
        // SAFETY: `info.entry` reads a struct of `size` bytes from `args`, as
        // checked above; the caller vouches for the addresses in it. The grid,
        // block and cluster are three u32 each; the error buffer has
        // `err.len()` bytes.
        let rc = unsafe {
            (self.launch)(
                info.entry,
                args.as_ptr().cast::<c_void>(),
                args.len(),
                cfg.grid.as_ptr(),
                cfg.block.as_ptr(),
                cluster.as_ptr(),
                cfg.shared_bytes as usize,
                i32::from(device_memory)
                    | (i32::from(self.shuffle_blocks.load(Ordering::Relaxed)) << 1),
                self.seed.load(Ordering::Relaxed),
                err.as_mut_ptr() as *mut c_char,
                err.len(),
            )
        };
        if rc != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            return Err(cuda_error(
                kernel,
                format!("emulated launch failed: {}", String::from_utf8_lossy(&err[..end])),
            ));
        }
        Ok(())
    }
}

/// The architecture the emulator stands in for: [`EMU_ARCH_ENV`] when it
/// names one (`sm_90a` runs the Hopper kernels), else none; a value that names
/// none is reported once on stderr.
fn emulated_arch() -> Option<Arch> {
    let v = std::env::var(EMU_ARCH_ENV).ok()?;
    let arch = Arch::parse(v.trim());
    if arch.is_none() && !v.trim().is_empty() {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!(
                "tpar: {EMU_ARCH_ENV}={v:?} names no architecture (such as sm_90a); the \
                 emulator stands in for none"
            );
        });
    }
    arch
}

impl Launcher for Emulator {
    fn describe(&self) -> String {
        "CPU emulator".to_string()
    }

    /// [`EMU_ARCH_ENV`] parsed, when set to an architecture's name.
    fn compile_arch(&self) -> Option<Arch> {
        emulated_arch()
    }

    /// # Safety
    /// As [`Launcher::launch_raw`].
    unsafe fn launch_raw(&self, kernel: &str, cfg: &LaunchConfig, args: &[u8]) -> Result<()> {
        cfg.check_cluster(kernel)?;
        // SAFETY: the caller's guarantee (the trait's contract).
        unsafe { self.launch_cluster_raw(kernel, cfg, cfg.cluster, args) }
    }
}

/// The define that builds the runtime's race check and the kernels' side of it.
const RACECHECK_DEFINE: &str = "-DTPAR_EMU_RACECHECK";

/// Kernel sources under racecheck: compiled with the thread-sanitizer's
/// instrumentation (hooks the racecheck runtime defines), linked without its
/// runtime, every symbol resolved at link time.
const INSTRUMENT_FLAGS: &[&str] = &["-fsanitize=thread"];

/// Compiles `units` (file name, text) into the shared library `dir/file`,
/// linked against the runtime `rt` when given. Builds in a private temporary
/// folder renamed into place, so concurrent builds never see half a library.
/// With `compile_only` flags (the instrumentation), each unit is compiled with
/// them first and the objects linked without them.
fn build_library(
    cxx: &str,
    dir: &Path,
    file: &str,
    units: &[(&str, String)],
    rt: Option<&Path>,
    extra_flags: &[String],
    compile_only: &[&str],
) -> Result<()> {
    let err = |what: String| cuda_error("emulator build", what);
    let tmp = cache_root().join(format!("build-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&tmp).map_err(|e| err(format!("{}: {e}", tmp.display())))?;
    let mut cpps = Vec::new();
    for (name, text) in units {
        let p = tmp.join(name);
        std::fs::write(&p, text).map_err(|e| err(format!("{}: {e}", p.display())))?;
        if name.ends_with(".cpp") {
            cpps.push(p);
        }
    }
    let run = |cmd: &mut Command| -> Result<()> {
        let out = cmd
            .output()
            .map_err(|e| err(format!("running {cxx}: {e} (set CXX to a C++17 compiler)")))?;
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(err(format!(
                "{file} does not compile:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    };
    if !compile_only.is_empty() {
        let mut objs = Vec::new();
        for cpp in &cpps {
            let obj = cpp.with_extension("o");
            run(Command::new(cxx)
                .args(CXX_FLAGS)
                .args(extra_flags)
                .args(compile_only)
                .arg("-c")
                .arg(cpp)
                .arg("-o")
                .arg(&obj))?;
            objs.push(obj);
        }
        cpps = objs;
    }
    let lib = tmp.join(file);
    let mut cmd = Command::new(cxx);
    cmd.args(CXX_FLAGS).args(extra_flags).arg("-shared").args(&cpps).arg("-o").arg(&lib);
    if !compile_only.is_empty() {
        // a hook the runtime lacks is a link error, not a crash mid-kernel
        cmd.arg("-Wl,-z,defs");
    }
    if let Some(rt) = rt {
        cmd.arg(rt);
        if let Some(d) = rt.parent() {
            cmd.arg(format!("-Wl,-rpath,{}", d.display()));
        }
    }
    run(&mut cmd)?;
    match std::fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        // another process finished first: use its library
        Err(_) if dir.join(file).exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => Err(err(format!("{} -> {}: {e}", tmp.display(), dir.display()))),
    }
}

fn unique() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// 64-bit FNV-1a, a stable hash for the cache key.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn add(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // separate fields
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// The emulator as a [`GpuDevice`]: "device" memory is host memory (256-byte
/// aligned), copies are `memcpy`, kernels run on the calling thread. A fresh
/// allocation holds 0xFF bytes (NaN in every float dtype), as hostile as a GPU's
/// leftover contents, so a result that depends on memory nothing wrote shows.
/// Its launches reach device memory only: under the checking emulator
/// ([`Emulator::racecheck`]) any global address outside the live allocations of the
/// emulated devices (a host `Vec`, a freed buffer, past a buffer's end) fails the
/// launch.
///
/// It captures CUDA graphs ([`super::graph`]): during a capture launches, device
/// copies and memsets are recorded, allocations come from the graph's private
/// pool, and what CUDA refuses inside a capture (a device-to-host or
/// host-to-device copy, a synchronization, work or an allocation from another
/// thread) fails and spoils the capture; a block allocated before the capture,
/// freed during it and used by the recorded work is reported when the capture
/// ends. It also counts the work issued ([`GpuDevice::work_counts`]). Every handle
/// [`EmulatedGpu::open`] gives for one ordinal shares the capture state and the counts.
///
/// ```no_run
/// use std::sync::Arc;
/// use tpar_kernels::cuda::{emu::EmulatedGpu, DeviceBuffer, GpuDevice};
/// let dev: Arc<dyn GpuDevice> = EmulatedGpu::open(0)?;
/// let buf = DeviceBuffer::from_host(&dev, &[1u8, 2, 3, 4])?;
/// assert_eq!(buf.to_host()?, vec![1, 2, 3, 4]);
/// # Ok::<(), tpar_kernels::KernelError>(())
/// ```
pub struct EmulatedGpu {
    emu: &'static Emulator,
    ordinal: usize,
    shared: Arc<Shared>,
}

/// What an emulated device shares with the graphs it captured.
#[derive(Default)]
struct Shared {
    capture: Mutex<Option<Capture>>,
    /// Whether `capture` holds one (read without the lock on every call).
    capturing: AtomicBool,
    /// The private pools of live graphs, and of dead ones whose blocks buffers
    /// still hold.
    pools: Mutex<Vec<Arc<Mutex<Pool>>>>,
    /// `pools.len()`, read without the lock on every free.
    pool_count: AtomicUsize,
    host_calls: AtomicU64,
    kernels_run: AtomicU64,
    copies_run: AtomicU64,
    replays: AtomicU64,
    dtoh_reads: AtomicU64,
    device_ns: AtomicU64,
}

/// One recorded piece of work.
enum Node {
    Kernel {
        name: String,
        cfg: LaunchConfig,
        /// The argument bytes, in 8-byte words (kernels read the struct aligned).
        args: Vec<u64>,
        len: usize,
    },
    Copy {
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    },
    Zero {
        dst: DevPtr,
        bytes: usize,
    },
}

/// A graph's private memory pool: block address -> (bytes, held by a buffer).
#[derive(Default)]
struct Pool {
    blocks: HashMap<DevPtr, (usize, bool)>,
    graph_alive: bool,
}

struct Capture {
    thread: std::thread::ThreadId,
    nodes: Vec<Node>,
    pool: Arc<Mutex<Pool>>,
    fault: Option<String>,
    /// Blocks allocated before the capture and freed during it (freed at its end).
    freed_outside: Vec<(DevPtr, usize)>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn capture_error(what: impl Into<String>) -> crate::KernelError {
    cuda_error(super::graph::CAPTURE_OP, what)
}

impl EmulatedGpu {
    /// An emulated device `cuda:ordinal` (builds the emulator on first use).
    pub fn open(ordinal: usize) -> Result<Arc<dyn GpuDevice>> {
        // Every handle of one ordinal shares its capture state, pools and counters: a
        // capture on `cuda:N` sees all of `cuda:N`'s work, whichever handle issues it.
        static SHARED: OnceLock<Mutex<HashMap<usize, Arc<Shared>>>> = OnceLock::new();
        let shared = lock(SHARED.get_or_init(Default::default)).entry(ordinal).or_default().clone();
        Ok(Arc::new(EmulatedGpu { emu: Emulator::get()?, ordinal, shared }))
    }

    /// An emulated device `cuda:ordinal` on `emu`, e.g. [`Emulator::racecheck`]'s, whose
    /// launches are then checked for races and memory errors without setting
    /// [`RACECHECK_ENV`]. Its buffers belong to `emu`: use them with its launches only.
    /// It does not share [`EmulatedGpu::open`]'s capture state or counters.
    pub fn open_on(emu: &'static Emulator, ordinal: usize) -> Arc<dyn GpuDevice> {
        Arc::new(EmulatedGpu { emu, ordinal, shared: Arc::default() })
    }

    /// Inside a capture, `what` issued on this thread: `Ok(true)` to record it;
    /// refused (and the capture spoiled) from another thread or when `host` (a
    /// host round trip). `Ok(false)` outside a capture.
    fn capturing(&self, what: &str, host: bool) -> Result<bool> {
        if !self.shared.capturing.load(Ordering::Acquire) {
            return Ok(false);
        }
        let mut g = lock(&self.shared.capture);
        let Some(c) = g.as_mut() else { return Ok(false) };
        let fault = if host {
            format!(
                "{what} inside capture on {} (a host round trip; CUDA refuses it too)",
                self.describe()
            )
        } else if c.thread != std::thread::current().id() {
            format!(
                "{what} from another thread than the capturing one on {} (not ordered with \
                 the captured work)",
                self.describe()
            )
        } else {
            return Ok(true);
        };
        if std::env::var_os(TRACE_CAPTURE_ENV).is_some_and(|v| v == "1") {
            eprintln!("capture fault: {fault}\n{}", std::backtrace::Backtrace::force_capture());
        }
        c.fault.get_or_insert_with(|| fault.clone());
        Err(capture_error(fault))
    }

    fn record(&self, node: Node) {
        if let Some(c) = lock(&self.shared.capture).as_mut() {
            c.nodes.push(node);
        }
    }

    /// Counts one piece of work issued by the host and times `f`, which runs it.
    fn issue<R>(&self, kernel: bool, f: impl FnOnce() -> R) -> R {
        let sh = &self.shared;
        sh.host_calls.fetch_add(1, Ordering::Relaxed);
        if kernel { &sh.kernels_run } else { &sh.copies_run }.fetch_add(1, Ordering::Relaxed);
        let t = std::time::Instant::now();
        let r = f();
        sh.device_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    fn layout(bytes: usize) -> Result<std::alloc::Layout> {
        std::alloc::Layout::from_size_align(bytes.max(1), EMU_ALIGN)
            .map_err(|e| cuda_error("alloc", e.to_string()))
    }
}

/// Frees a block of [`EmulatedGpu`] memory.
fn dealloc(emu: &Emulator, ptr: DevPtr, bytes: usize) {
    emu.track(ptr, bytes, false);
    if let Ok(layout) = std::alloc::Layout::from_size_align(bytes.max(1), EMU_ALIGN) {
        // SAFETY: allocated by `EmulatedGpu::alloc` with this layout, freed once.
        unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
    }
}

/// Releases a pool's free blocks once its graph is gone.
fn release_free_blocks(emu: &Emulator, pool: &mut Pool) {
    pool.blocks.retain(|&p, &mut (bytes, held)| {
        if !held {
            dealloc(emu, p, bytes);
        }
        held
    });
}

/// Whether `node` touches `[ptr, ptr + bytes)`: its copy ranges, or an 8-byte word
/// of its argument struct holding an address in the range.
fn touches(node: &Node, ptr: DevPtr, bytes: usize) -> bool {
    let end = ptr + bytes.max(1) as DevPtr;
    let overlaps = |a: DevPtr, n: usize| a < end && ptr < a + n.max(1) as DevPtr;
    match node {
        Node::Kernel { args, .. } => args.iter().any(|&w| w >= ptr && w < end),
        Node::Copy { src, dst, bytes } => overlaps(*src, *bytes) || overlaps(*dst, *bytes),
        Node::Zero { dst, bytes } => overlaps(*dst, *bytes),
    }
}

/// A graph the emulator captured.
struct EmuGraph {
    emu: &'static Emulator,
    shared: Arc<Shared>,
    nodes: Vec<Node>,
    pool: Arc<Mutex<Pool>>,
    describe: String,
}

impl super::graph::GraphExec for EmuGraph {
    fn replay(&self) -> Result<()> {
        let sh = &self.shared;
        if sh.capturing.load(Ordering::Acquire) {
            return Err(capture_error(format!(
                "a graph replay inside a capture on {}",
                self.describe
            )));
        }
        sh.host_calls.fetch_add(1, Ordering::Relaxed);
        sh.replays.fetch_add(1, Ordering::Relaxed);
        let t = std::time::Instant::now();
        let mut result = Ok(());
        for node in &self.nodes {
            match node {
                Node::Kernel { name, cfg, args, len } => {
                    sh.kernels_run.fetch_add(1, Ordering::Relaxed);
                    let bytes = &bytemuck::cast_slice::<u64, u8>(args)[..*len];
                    // SAFETY: the bytes and addresses the capture recorded: the
                    // addresses were valid for the launch then, and stay so while the
                    // graph lives (its private pool keeps its blocks; the caller keeps
                    // the buffers it captured with, as with CUDA graphs).
                    result =
                        unsafe { self.emu.launch_checked(name, cfg, cfg.cluster, bytes, true) };
                }
                Node::Copy { src, dst, bytes } => {
                    sh.copies_run.fetch_add(1, Ordering::Relaxed);
                    // SAFETY: as for the kernels above.
                    unsafe { std::ptr::copy(*src as *const u8, *dst as *mut u8, *bytes) };
                    self.emu.wrote(*dst, *bytes);
                }
                Node::Zero { dst, bytes } => {
                    sh.copies_run.fetch_add(1, Ordering::Relaxed);
                    // SAFETY: as for the kernels above.
                    unsafe { std::ptr::write_bytes(*dst as *mut u8, 0, *bytes) };
                    self.emu.wrote(*dst, *bytes);
                }
            }
            if result.is_err() {
                break;
            }
        }
        sh.device_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        result
    }

    fn stats(&self) -> super::graph::GraphStats {
        let kernels = self.nodes.iter().filter(|n| matches!(n, Node::Kernel { .. })).count();
        let pool = lock(&self.pool);
        super::graph::GraphStats {
            kernels,
            copies: self.nodes.len() - kernels,
            pool_blocks: pool.blocks.len(),
            pool_bytes: pool.blocks.values().map(|&(b, _)| b).sum(),
        }
    }
}

impl Drop for EmuGraph {
    fn drop(&mut self) {
        let mut pool = lock(&self.pool);
        pool.graph_alive = false;
        release_free_blocks(self.emu, &mut pool);
        let empty = pool.blocks.is_empty();
        drop(pool);
        if empty {
            let mut pools = lock(&self.shared.pools);
            pools.retain(|p| !Arc::ptr_eq(p, &self.pool));
            self.shared.pool_count.store(pools.len(), Ordering::Release);
        }
    }
}

const EMU_ALIGN: usize = 256;

/// With `TPAR_TRACE_CAPTURE=1` in the environment, each fault an emulated capture
/// sees (a host round trip, work from another thread) also prints a backtrace to
/// stderr, to find what in a captured step leaves the device.
pub const TRACE_CAPTURE_ENV: &str = "TPAR_TRACE_CAPTURE";

impl Launcher for EmulatedGpu {
    fn describe(&self) -> String {
        format!("cuda:{} (CPU emulator)", self.ordinal)
    }

    fn compile_arch(&self) -> Option<Arch> {
        emulated_arch()
    }

    /// # Safety
    /// As [`Launcher::launch_raw`].
    unsafe fn launch_raw(&self, kernel: &str, cfg: &LaunchConfig, args: &[u8]) -> Result<()> {
        cfg.check_cluster(kernel)?;
        if self.capturing(&format!("launch of {kernel}"), false)? {
            self.emu.validate(kernel, cfg, args)?;
            let mut words = vec![0u64; args.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..args.len()].copy_from_slice(args);
            self.record(Node::Kernel {
                name: kernel.to_string(),
                cfg: *cfg,
                args: words,
                len: args.len(),
            });
            return Ok(());
        }
        // SAFETY: the caller's guarantee (the trait's contract) is the emulator's;
        // its addresses are this device's memory.
        self.issue(true, || {
            crate::cuda::profile::emulated(
                || kernel.to_string(),
                || unsafe { self.emu.launch_checked(kernel, cfg, cfg.cluster, args, true) },
            )
        })
    }
}

// SAFETY: allocations are fresh host blocks of at least the requested size
// (`std::alloc`, 256-byte aligned) freed with the same layout, once: blocks of a
// graph's private pool are freed when both the graph and their buffer are gone;
// launches and copies run to completion on the calling thread before returning
// (or are recorded into a graph during a capture, and run by its replays), so
// every use is ordered, and all emulated devices address the same host memory.
unsafe impl GpuDevice for EmulatedGpu {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn memory_space(&self) -> MemorySpace {
        MemorySpace::Host
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        let pool = if self.capturing(&format!("an allocation of {bytes} bytes"), false)? {
            let g = lock(&self.shared.capture);
            g.as_ref().map(|c| c.pool.clone())
        } else {
            None
        };
        let size = bytes.max(1);
        if let Some(pool) = &pool {
            // A block the capture freed already serves again (stream order).
            let mut pool = lock(pool);
            if let Some((&p, e)) = pool.blocks.iter_mut().find(|(_, e)| e.0 == size && !e.1) {
                e.1 = true;
                self.emu.track(p, bytes, true);
                return Ok(p);
            }
        }
        let layout = EmulatedGpu::layout(bytes)?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(cuda_error("alloc", format!("out of memory allocating {bytes} bytes")));
        }
        // Contents unspecified, as on a GPU, and hostile: 0xFF bytes (NaN in every
        // float dtype, -1 in every signed integer), so that a result that depends on
        // memory nothing wrote shows instead of reading the zeros of fresh pages.
        // SAFETY: `p` holds `size` bytes.
        unsafe { std::ptr::write_bytes(p, 0xFF, size) };
        if let Some(pool) = pool {
            lock(&pool).blocks.insert(p as DevPtr, (size, true));
        }
        self.emu.track(p as DevPtr, bytes, true);
        Ok(p as DevPtr)
    }

    /// # Safety
    /// As [`GpuDevice::free`].
    unsafe fn free(&self, ptr: DevPtr, bytes: usize) {
        if self.shared.pool_count.load(Ordering::Acquire) > 0 {
            let mut pools = lock(&self.shared.pools);
            let mut found = None;
            for (i, pool) in pools.iter().enumerate() {
                let mut pl = lock(pool);
                if let Some(e) = pl.blocks.get_mut(&ptr) {
                    // free for the pool's next allocation; the graph's replays still
                    // use it, so the memcheck keeps it until it is deallocated
                    e.1 = false;
                    if !pl.graph_alive {
                        release_free_blocks(self.emu, &mut pl);
                        if pl.blocks.is_empty() {
                            found = Some(i);
                        }
                    }
                    found.get_or_insert(usize::MAX);
                    break;
                }
            }
            if let Some(i) = found {
                if i != usize::MAX {
                    pools.remove(i);
                    self.shared.pool_count.store(pools.len(), Ordering::Release);
                }
                return;
            }
        }
        if self.shared.capturing.load(Ordering::Acquire) {
            if let Some(c) = lock(&self.shared.capture).as_mut() {
                // Freed at the end of the capture, after checking that nothing
                // recorded uses it.
                c.freed_outside.push((ptr, bytes));
                return;
            }
        }
        dealloc(self.emu, ptr, bytes);
    }

    /// # Safety
    /// As [`GpuDevice::htod`].
    unsafe fn htod(&self, src: &[u8], dst: DevPtr) -> Result<()> {
        self.capturing(&format!("a host-to-device copy of {} bytes", src.len()), true)?;
        // SAFETY: the caller guarantees the destination range.
        self.issue(false, || unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len())
        });
        self.emu.wrote(dst, src.len());
        Ok(())
    }

    /// # Safety
    /// As [`GpuDevice::dtoh`].
    unsafe fn dtoh(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        self.capturing(&format!("a device-to-host copy of {} bytes", dst.len()), true)?;
        self.shared.dtoh_reads.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller guarantees the source range.
        self.issue(false, || unsafe {
            std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len())
        });
        Ok(())
    }

    /// # Safety
    /// As [`GpuDevice::dtod`].
    unsafe fn dtod(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<()> {
        if self.capturing("a device-to-device copy", false)? {
            self.record(Node::Copy { src, dst, bytes });
            return Ok(());
        }
        // SAFETY: the caller guarantees both ranges.
        self.issue(false, || unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) });
        self.emu.wrote(dst, bytes);
        Ok(())
    }

    /// # Safety
    /// As [`GpuDevice::copy_from_device`].
    unsafe fn copy_from_device(
        &self,
        src_dev: &dyn GpuDevice,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    ) -> Result<()> {
        if src_dev.memory_space() != MemorySpace::Host {
            return Err(crate::KernelError::WrongDevice {
                op: "copy_from_device",
                what: "source",
                want: self.describe(),
                got: src_dev.describe(),
            });
        }
        if self.capturing("a device-to-device copy", false)? {
            self.record(Node::Copy { src, dst, bytes });
            return Ok(());
        }
        // SAFETY: every emulated device addresses host memory; the caller
        // guarantees both ranges and that they do not overlap.
        self.issue(false, || unsafe {
            std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes)
        });
        self.emu.wrote(dst, bytes);
        Ok(())
    }

    /// # Safety
    /// As [`GpuDevice::zero`].
    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> Result<()> {
        if self.capturing("a memset", false)? {
            self.record(Node::Zero { dst, bytes });
            return Ok(());
        }
        // SAFETY: the caller guarantees the range.
        self.issue(false, || unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) });
        self.emu.wrote(dst, bytes);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.capturing("a device synchronization", true)?;
        Ok(())
    }

    fn begin_capture(&self) -> Result<()> {
        let mut g = lock(&self.shared.capture);
        if g.is_some() {
            return Err(capture_error(format!(
                "{} is capturing already (captures do not nest)",
                self.describe()
            )));
        }
        let pool = Arc::new(Mutex::new(Pool { blocks: HashMap::new(), graph_alive: true }));
        {
            let mut pools = lock(&self.shared.pools);
            pools.push(pool.clone());
            self.shared.pool_count.store(pools.len(), Ordering::Release);
        }
        *g = Some(Capture {
            thread: std::thread::current().id(),
            nodes: Vec::new(),
            pool,
            fault: None,
            freed_outside: Vec::new(),
        });
        self.shared.capturing.store(true, Ordering::Release);
        Ok(())
    }

    fn end_capture(&self) -> Result<Box<dyn super::graph::GraphExec>> {
        let c = {
            let mut g = lock(&self.shared.capture);
            match g.as_ref() {
                None => return Err(capture_error(format!("{} is not capturing", self.describe()))),
                Some(c) if c.thread != std::thread::current().id() => {
                    return Err(capture_error(format!(
                        "ending the capture on {} from another thread than the one that \
                         began it",
                        self.describe()
                    )))
                }
                Some(_) => {}
            }
            self.shared.capturing.store(false, Ordering::Release);
            g.take()
        };
        let Some(mut c) = c else {
            return Err(capture_error(format!("{} is not capturing", self.describe())));
        };
        for &(ptr, bytes) in &c.freed_outside {
            if c.fault.is_none() {
                if let Some(n) = c.nodes.iter().position(|n| touches(n, ptr, bytes)) {
                    c.fault = Some(format!(
                        "recorded work {n} uses a block of {bytes} bytes at {ptr:#x} that \
                         was allocated before the capture and freed during it (a replay \
                         would touch freed memory); keep it alive while the graph lives"
                    ));
                }
            }
            dealloc(self.emu, ptr, bytes);
        }
        let graph = EmuGraph {
            emu: self.emu,
            shared: self.shared.clone(),
            nodes: c.nodes,
            pool: c.pool,
            describe: self.describe(),
        };
        match c.fault {
            // Dropping the graph releases its pool's free blocks.
            Some(f) => Err(capture_error(format!("the capture failed: {f}"))),
            None => Ok(Box::new(graph)),
        }
    }

    fn is_capturing(&self) -> bool {
        self.shared.capturing.load(Ordering::Acquire)
    }

    fn work_counts(&self) -> Option<super::graph::WorkCounts> {
        let sh = &self.shared;
        Some(super::graph::WorkCounts {
            host_calls: sh.host_calls.load(Ordering::Relaxed),
            kernels_run: sh.kernels_run.load(Ordering::Relaxed),
            copies_run: sh.copies_run.load(Ordering::Relaxed),
            replays: sh.replays.load(Ordering::Relaxed),
            dtoh_reads: sh.dtoh_reads.load(Ordering::Relaxed),
            device_ns: sh.device_ns.load(Ordering::Relaxed),
        })
    }
}
