//! The on-disk cache of compiled device binaries ([`KERNEL_CACHE_ENV`]), shared
//! by every process with the same NVRTC version, and [`precompile`], which
//! fills it ahead of time without a GPU (`gpu_check --precompile sm_90a`).

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::nvrtc::{nvrtc_compile, CompileOptions};
use super::probe::nvrtc_version;
use crate::cuda::{cuda_error, KernelSource};
use crate::Result;

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
pub(super) fn disk_cache_file(
    name: &str,
    arch: &str,
    args: &[String],
    text: &str,
) -> Option<PathBuf> {
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
    crate::cuda::sources().iter().map(|s| precompile_into(dir, s, arch, options)).collect()
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
pub(super) fn disk_cache_load(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    bytes.starts_with(b"\x7fELF").then_some(bytes)
}

/// Stores a device binary; failures only cost a later recompilation.
pub(super) fn disk_cache_store(path: &Path, bytes: &[u8]) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::source_of;

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
}
