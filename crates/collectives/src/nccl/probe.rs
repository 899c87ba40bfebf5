//! Finding the CUDA driver and NCCL at run time, before any cudarc call that would panic
//! without them, and making `libnccl.so.2` loadable for child processes.
//!
//! cudarc 0.19 loads NCCL with `dlopen` by bare file name, trying the names of
//! `cudarc::get_lib_name_candidates("nccl")`: `libnccl.so`, `libnccl64.so`, ...,
//! `libnccl.so.13` (the CUDA major version), `.12`, `.11`, `.10`, `.9`, `.1`. It reads no
//! environment variable for the path. NCCL's runtime packages (`libnccl2`, the
//! `nvidia-nccl-cu*` wheels) ship only `libnccl.so.2`, which is none of those names; the
//! `libnccl.so` link comes with the development package. `dlopen` reads
//! `LD_LIBRARY_PATH` once, when the process starts, so a process cannot make the name
//! resolve for itself; a parent can: [`nccl_library_link`] creates a private directory
//! holding a `libnccl.so` link to the real file, and the `tpar-run` launcher puts it at
//! the front of its ranks' `LD_LIBRARY_PATH`. The same works by hand:
//! `mkdir d && ln -s /usr/lib/x86_64-linux-gnu/libnccl.so.2 d/libnccl.so &&
//! LD_LIBRARY_PATH=$PWD/d:$LD_LIBRARY_PATH program`.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) use crate::spawn::guarded;

/// Environment variable naming the NCCL library file to link when cudarc cannot find
/// NCCL by its own names, e.g. a wheel's
/// `.../site-packages/nvidia/nccl/lib/libnccl.so.2`.
pub const NCCL_LIBRARY_ENV: &str = "TPAR_NCCL_LIBRARY";

/// Whether a library can be used, and the details either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LibStatus {
    /// Loaded and working; the text says what was found (version, devices).
    Present(String),
    /// Not loadable or not working; the text says why and what to do.
    Missing(String),
}

impl LibStatus {
    /// Whether the library is present and working.
    pub fn is_present(&self) -> bool {
        matches!(self, LibStatus::Present(_))
    }
}

impl fmt::Display for LibStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LibStatus::Present(s) => write!(f, "present ({s})"),
            LibStatus::Missing(s) => write!(f, "missing: {s}"),
        }
    }
}

/// What [`probe`] found: the CUDA driver and NCCL, each present or missing with a reason.
///
/// ```
/// let p = tpar_collectives::nccl::probe();
/// println!("{p}"); // "CUDA driver: present (...)\nNCCL: missing: ..."
/// if let Err(e) = p.check() {
///     println!("skipping the NCCL path: {e}");
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclProbe {
    /// The CUDA driver library (`libcuda.so.1`) and at least one device.
    pub driver: LibStatus,
    /// The NCCL library, as cudarc loads it.
    pub nccl: LibStatus,
    /// Number of CUDA devices the driver reports (when it loaded).
    pub devices: Option<usize>,
    /// NCCL's version `(major, minor, patch)`, when it loaded.
    pub nccl_version: Option<(u32, u32, u32)>,
    /// A versioned NCCL library file (`libnccl.so.2`) found on this machine while cudarc's
    /// names did not resolve: [`nccl_library_link`] can make it loadable for children.
    pub nccl_file: Option<PathBuf>,
}

impl NcclProbe {
    /// Whether both libraries are present, so an NCCL group can be created.
    pub fn is_usable(&self) -> bool {
        self.driver.is_present() && self.nccl.is_present()
    }

    /// Why an NCCL group cannot be created here (naming each missing library), if it cannot.
    pub fn why_unavailable(&self) -> Option<String> {
        let mut why = Vec::new();
        if let LibStatus::Missing(s) = &self.driver {
            why.push(format!("CUDA driver missing: {s}"));
        }
        if let LibStatus::Missing(s) = &self.nccl {
            why.push(format!("NCCL missing: {s}"));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// `Ok` when usable, else [`CollectiveError::Unavailable`](crate::CollectiveError)
    /// with `what = "NCCL backend"` and the reasons.
    pub fn check(&self) -> crate::Result<()> {
        match self.why_unavailable() {
            None => Ok(()),
            Some(why) => {
                Err(crate::CollectiveError::Unavailable { what: "NCCL backend".into(), why })
            }
        }
    }
}

impl fmt::Display for NcclProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "CUDA driver: {}", self.driver)?;
        write!(f, "NCCL: {}", self.nccl)
    }
}

/// Probes the CUDA driver and NCCL without panicking: whether cudarc can load each
/// library, the device count and NCCL's version. The answer is computed once per process
/// (library search paths cannot change after start) and cloned afterwards.
///
/// Each library is first looked up with cudarc's own `is_culib_present()` (which only
/// tries to `dlopen` its candidate names); only when it is there are the first real
/// calls made (`cuInit`/`cuDeviceGetCount`, `ncclGetVersion`), inside `catch_unwind` in
/// case a symbol is missing from an old library.
pub fn probe() -> NcclProbe {
    static PROBE: OnceLock<NcclProbe> = OnceLock::new();
    PROBE.get_or_init(probe_now).clone()
}

fn probe_now() -> NcclProbe {
    let (driver, devices) = probe_driver();
    let (nccl, nccl_version, nccl_file) = probe_nccl();
    NcclProbe { driver, nccl, devices, nccl_version, nccl_file }
}

fn probe_driver() -> (LibStatus, Option<usize>) {
    // SAFETY: `is_culib_present` only `dlopen`s (and closes) the candidate names of the CUDA
    // driver library, running that library's initialisers: the same library cudarc loads
    // for every driver call; nothing is called through it.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    if !present {
        let names = cudarc::get_lib_name_candidates("cuda");
        return (
            LibStatus::Missing(format!(
                "no CUDA driver library could be loaded (tried {}); install the NVIDIA driver \
                 or add its directory to LD_LIBRARY_PATH",
                short_list(&names)
            )),
            None,
        );
    }
    let count = guarded(cudarc::driver::CudaContext::device_count);
    let version = guarded(|| {
        let mut v = 0i32;
        // SAFETY: `cuDriverGetVersion` writes one int through the pointer, which points to a
        // live local.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(v)
    })
    .ok()
    .flatten();
    let api =
        version.map_or_else(String::new, |v| format!("CUDA {}.{}, ", v / 1000, v % 1000 / 10));
    match count {
        Ok(Ok(n)) if n > 0 => {
            let n = n as usize;
            (LibStatus::Present(format!("{api}{n} device(s)")), Some(n))
        }
        Ok(Ok(_)) => (
            LibStatus::Missing(format!("the driver library loaded ({api}) but reports no device")),
            Some(0),
        ),
        Ok(Err(e)) => (
            LibStatus::Missing(format!(
                "the driver library loaded but cuInit/cuDeviceGetCount failed: {}",
                super::driver_error_text(&e)
            )),
            None,
        ),
        Err(p) => {
            (LibStatus::Missing(format!("the driver library loaded but panicked: {p}")), None)
        }
    }
}

fn probe_nccl() -> (LibStatus, Option<(u32, u32, u32)>, Option<PathBuf>) {
    if !nccl_loadable() {
        let names = cudarc::get_lib_name_candidates("nccl");
        let file = find_versioned_nccl();
        let why = match &file {
            Some(f) => format!(
                "cudarc loads NCCL by the names {} but this machine has it only as {}; start \
                 the job with tpar-run (it gives its ranks a libnccl.so link on \
                 LD_LIBRARY_PATH), or create a directory with a libnccl.so symlink to that \
                 file and put it on LD_LIBRARY_PATH before the process starts",
                short_list(&names),
                f.display()
            ),
            None => format!(
                "no NCCL library could be loaded (tried {}) and no libnccl.so.* was found on \
                 LD_LIBRARY_PATH, in the CUDA/NCCL directories or in the ldconfig cache; \
                 install NCCL, or set {NCCL_LIBRARY_ENV} to its file and launch with tpar-run",
                short_list(&names)
            ),
        };
        return (LibStatus::Missing(why), None, file);
    }
    match guarded(cudarc::nccl::result::get_nccl_version) {
        Ok(Ok(v)) => {
            let v = v.max(0) as u32;
            // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
            let ver = if v >= 10000 {
                (v / 10000, v % 10000 / 100, v % 100)
            } else {
                (v / 1000, v % 1000 / 100, v % 100)
            };
            (LibStatus::Present(format!("NCCL {}.{}.{}", ver.0, ver.1, ver.2)), Some(ver), None)
        }
        Ok(Err(e)) => (
            LibStatus::Missing(format!(
                "the NCCL library loaded but ncclGetVersion failed: {}",
                super::nccl_error_text(&e)
            )),
            None,
            None,
        ),
        Err(p) => {
            (LibStatus::Missing(format!("the NCCL library loaded but panicked: {p}")), None, None)
        }
    }
}

/// `a, b, c, ... (n names)` for long candidate lists.
fn short_list(names: &[String]) -> String {
    if names.len() <= 4 {
        return names.join(", ");
    }
    format!("{}, ... ({} names)", names[..3].join(", "), names.len())
}

/// Directories where a versioned NCCL library usually lives, in search order.
fn nccl_search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&p).filter(|d| !d.as_os_str().is_empty()));
    }
    for var in ["NCCL_HOME", "NCCL_ROOT", "NCCL_DIR", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            dirs.push(root.join("lib"));
            dirs.push(root.join("lib64"));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/cuda/targets/sbsa-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/lib/x86_64-linux-gnu",
        "/lib64",
        "/usr/local/lib",
        "/usr/local/nccl/lib",
        "/opt/nccl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// A versioned NCCL library file: `$TPAR_NCCL_LIBRARY` if it names a file, else the first
/// `libnccl.so.<N>` (preferring `libnccl.so.2`) in [`nccl_search_dirs`], else the
/// `ldconfig -p` cache.
pub(crate) fn find_versioned_nccl() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(NCCL_LIBRARY_ENV) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
    }
    for dir in nccl_search_dirs() {
        if let Some(f) = versioned_in(&dir) {
            return Some(f);
        }
    }
    ldconfig_nccl()
}

/// `dir/libnccl.so.2`, else another `dir/libnccl.so.<N...>`.
fn versioned_in(dir: &Path) -> Option<PathBuf> {
    let exact = dir.join("libnccl.so.2");
    if exact.is_file() {
        return Some(exact);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("libnccl.so.")
                .is_some_and(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        })
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.into_iter().next()
}

/// The `libnccl.so.*` entry of the dynamic linker's cache, if `ldconfig -p` runs.
fn ldconfig_nccl() -> Option<PathBuf> {
    for prog in ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"] {
        let Ok(out) = std::process::Command::new(prog)
            .arg("-p")
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
        else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        // Lines look like
        // "\tlibnccl.so.2 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so.2".
        return text
            .lines()
            .filter(|l| l.trim_start().starts_with("libnccl.so."))
            .filter_map(|l| l.split("=>").nth(1))
            .map(|p| PathBuf::from(p.trim()))
            .find(|p| p.is_file());
    }
    None
}

/// A private directory holding a `libnccl.so` symlink to a versioned NCCL library, to be
/// put on a child process's `LD_LIBRARY_PATH`; removed when dropped.
///
/// Created by [`nccl_library_link`]; `tpar-run` makes one for its ranks.
#[derive(Debug)]
pub struct NcclLibLink {
    dir: PathBuf,
    target: PathBuf,
}

impl NcclLibLink {
    /// Creates a fresh directory (never reusing an existing one, so nobody can plant a
    /// library in it) under the temporary directory, readable only by this user, with a
    /// `libnccl.so` symlink to `target`.
    pub fn create(target: &Path) -> std::io::Result<NcclLibLink> {
        let target = target.canonicalize()?;
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("tpar-nccl-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&dir)?;
        let link = NcclLibLink { dir, target };
        link.populate()?;
        Ok(link)
    }

    #[cfg(unix)]
    fn populate(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))?;
        std::os::unix::fs::symlink(&self.target, self.dir.join("libnccl.so"))
    }

    #[cfg(not(unix))]
    fn populate(&self) -> std::io::Result<()> {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "NCCL library links are only made on Unix",
        ))
    }

    /// The directory to put on `LD_LIBRARY_PATH`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The library the link points to.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// This process's `LD_LIBRARY_PATH` with [`dir`](Self::dir) in front: the value to give
    /// a child process.
    pub fn ld_library_path(&self) -> OsString {
        let mut parts = vec![self.dir.clone()];
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            parts.extend(std::env::split_paths(&old).filter(|d| !d.as_os_str().is_empty()));
        }
        std::env::join_paths(parts).unwrap_or_else(|_| self.dir.clone().into_os_string())
    }
}

impl Drop for NcclLibLink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join("libnccl.so"));
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// When cudarc cannot load NCCL by its names but a versioned library (`libnccl.so.2`, or
/// the file `$TPAR_NCCL_LIBRARY` names) exists, creates a [`NcclLibLink`] to it; `None`
/// when NCCL already loads, when none is found, or when the link cannot be made.
///
/// The link only helps processes started with its
/// [`ld_library_path`](NcclLibLink::ld_library_path): `dlopen` reads `LD_LIBRARY_PATH`
/// once, at process start.
///
/// Only NCCL is looked up (the CUDA driver is not initialised), so a launcher can call it
/// cheaply before starting its ranks.
pub fn nccl_library_link() -> Option<NcclLibLink> {
    if nccl_loadable() {
        return None;
    }
    let file = find_versioned_nccl()?;
    NcclLibLink::create(&file).ok()
}

/// Whether cudarc finds NCCL by its names (computed once per process).
fn nccl_loadable() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `dlopen`s and closes cudarc's candidate names of NCCL, calling nothing in it.
    *PRESENT.get_or_init(|| unsafe { cudarc::nccl::sys::is_culib_present() })
}
