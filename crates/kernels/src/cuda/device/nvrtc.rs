//! Compiling kernel sources with NVRTC: the [`CompileOptions`] that become
//! NVRTC's command line (part of every cache key), the checked architecture
//! name, and one compilation to PTX and, for a real architecture, a device
//! binary (CUBIN). Needs NVRTC only, no GPU.

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result as nresult, sys as nsys};

use super::probe::{guarded, nvrtc_version};
use crate::cuda::{cuda_error, KernelSource};
use crate::Result;

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
pub(super) fn check_arch(arch: &str) -> Result<()> {
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

/// Environment variable naming the architecture a GPU's kernels are compiled
/// for when [`CompileOptions::arch`] is unset (`sm_90`, `sm_80`, ...),
/// checked like an explicit architecture; unset or empty: the device's own
/// (`sm_90a` on compute capability 9.0). `TPAR_CUDA_ARCH=sm_90` on a Hopper
/// GPU compiles nothing for `sm_90a`, so the GEMM and the attention run
/// their `mma.sync` kernels instead of the Hopper (wgmma) ones: the way
/// around a Hopper kernel that fails on the hardware.
pub const CUDA_ARCH_ENV: &str = "TPAR_CUDA_ARCH";

/// The architecture a device of compute capability `cc` compiles for:
/// `explicit` ([`CompileOptions::arch`]) when set, else `env` (the value of
/// [`CUDA_ARCH_ENV`]) when set and not empty, else `sm_90a` on compute
/// capability 9.0 (the Hopper target with wgmma and setmaxnreg) and
/// `sm_<major><minor>` on every other device. A bad `explicit` or `env`
/// name is an error naming it (and the variable).
pub(super) fn choose_arch(
    explicit: Option<&str>,
    env: Option<&str>,
    cc: (u32, u32),
) -> Result<String> {
    if let Some(a) = explicit {
        check_arch(a)?;
        return Ok(a.to_string());
    }
    match env.filter(|v| !v.is_empty()) {
        Some(v) => match check_arch(v) {
            Ok(()) => Ok(v.to_string()),
            Err(_) => Err(cuda_error(
                "nvrtc",
                format!(
                    "{CUDA_ARCH_ENV}={v:?} is not a GPU architecture (expected e.g. \"sm_90\", \
                     \"sm_90a\"; unset it for the device's own)"
                ),
            )),
        },
        None if cc == (9, 0) => Ok("sm_90a".to_string()),
        None => Ok(format!("sm_{}{}", cc.0, cc.1)),
    }
}

/// What one NVRTC compilation produced.
pub(super) struct Compiled {
    pub(super) ptx: String,
    /// The device binary, when the target was a real architecture (`sm_*`).
    pub(super) cubin: Option<Vec<u8>>,
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
pub(super) fn nvrtc_compile(
    name: &str,
    text: &str,
    args: &[String],
    want_cubin: bool,
) -> Result<Compiled> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_architecture_comes_from_the_options_then_the_environment_then_the_device() {
        // unset (or empty): the device's own, sm_90a on compute capability 9.0
        assert_eq!(choose_arch(None, None, (9, 0)).unwrap(), "sm_90a");
        assert_eq!(choose_arch(None, Some(""), (9, 0)).unwrap(), "sm_90a");
        assert_eq!(choose_arch(None, None, (8, 0)).unwrap(), "sm_80");
        assert_eq!(choose_arch(None, None, (10, 0)).unwrap(), "sm_100");
        // TPAR_CUDA_ARCH=sm_90 on a Hopper GPU: the pre-Hopper kernels
        assert_eq!(choose_arch(None, Some("sm_90"), (9, 0)).unwrap(), "sm_90");
        assert_eq!(choose_arch(None, Some("sm_80"), (8, 6)).unwrap(), "sm_80");
        // an explicit CompileOptions::arch wins over the variable
        assert_eq!(choose_arch(Some("sm_90a"), Some("sm_90"), (9, 0)).unwrap(), "sm_90a");
        // a bad value names the variable and the value
        for bad in ["sm9", "90", "sm_90 ", "hopper"] {
            let e = choose_arch(None, Some(bad), (9, 0)).unwrap_err().to_string();
            assert!(e.contains("TPAR_CUDA_ARCH") && e.contains(&format!("{bad:?}")), "{e}");
        }
        let e = choose_arch(Some("sm_9"), None, (9, 0)).unwrap_err().to_string();
        assert!(e.contains("\"sm_9\""), "{e}");
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
}
