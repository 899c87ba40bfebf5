//! NVRTC compiles every embedded kernel source (after the prelude) to PTX for
//! `sm_90`, without a GPU.
//!
//! Without a loadable NVRTC these tests print why and pass, unless
//! `TPAR_REQUIRE_NVRTC=1` (set by CI after `scripts/nvrtc-env.sh` installed
//! it), where they fail instead. When `ptxas` is available (`TPAR_PTXAS`, or
//! on `PATH`) the PTX is also assembled for `sm_90` and the registers and
//! spills of every kernel are reported; spills are information, not failures.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use tpar_kernels::cuda::device::{compile_ptx, kernel_names, nvrtc_version};
use tpar_kernels::cuda::{sources, KernelSource};
use tpar_kernels::KernelError;

const ARCH: &str = "sm_90";

/// Prints past the test harness's output capture, so skip reasons and
/// reports show in a plain `cargo test` run.
fn say(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{text}");
}

fn nvrtc_required() -> bool {
    std::env::var("TPAR_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Whether NVRTC can be used; without it, skips (prints the reason) or, when
/// required, fails.
fn nvrtc_or_skip(test: &str) -> bool {
    match nvrtc_version() {
        Ok(_) => true,
        Err(e) if nvrtc_required() => panic!("TPAR_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}"),
        Err(e) => {
            say(&format!("skipping {test}: {e}"));
            false
        }
    }
}

/// A kernel that calls every prelude helper (reductions, conversions, inline
/// PTX for mma.sync, ldmatrix and cp.async), so the prelude is checked even
/// where no kernel source uses a helper yet.
const PRELUDE_PROBE: KernelSource = KernelSource {
    name: "prelude_probe",
    text: r#"
struct ProbeArgs {
    const void* src;
    void* dst;
    float* out;
    i32 n;
    i32 pad;
};

namespace prelude_probe {
template <typename T>
TPAR_DEVICE void run(const ProbeArgs& a) {
    __shared__ __align__(16) u16 tile[16 * 16];
    __shared__ float scratch[33];
    const int t = threadIdx.x;
    const T* src = static_cast<const T*>(a.src);
    for (int i = t; i < 16 * 16; i += blockDim.x) tile[i] = src[i < a.n ? i : 0].bits;
    cp_async_16(tpar_dyn_smem + 16 * (t % 8), src + 8 * (t % 8), t < a.n);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 fa[4], fb[2], ft[4], fu[2];
    ldmatrix_x4(fa, &tile[(t % 16) * 16 + (t / 16) * 8]);
    ldmatrix_x2(fb, &tile[(t % 8) * 16]);
    ldmatrix_x4_trans(ft, &tile[(t % 16) * 16]);
    ldmatrix_x2_trans(fu, &tile[(t % 8) * 16 + 8]);
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16816<T>(d, fa, fb);
    mma_16816<T>(d, ft, fu);
    float v = d[0] + d[1] + d[2] + d[3] + to_f32(from_f32<T>(1.5f));
    v += to_f32(src[0]) + to_f32(from_f32<float>(v)) + __uint_as_float(pack2_f32<T>(v, 2.f) & 0u);
    v = warp_sum(v) + warp_max(v);
    v = block_sum(v, scratch) + block_max(v, scratch) + tpar_inf() * 0.f;
    static_cast<T*>(a.dst)[t] = from_f32<T>(v);
    if (t == 0) a.out[blockIdx.x] = v;
}
}  // namespace prelude_probe

TPAR_KERNEL(tpar_prelude_probe_bf16, ProbeArgs, 128) { prelude_probe::run<bf16>(args); }
TPAR_KERNEL(tpar_prelude_probe_f16, ProbeArgs, 128) { prelude_probe::run<f16>(args); }
"#,
};

/// One source's compile result and how long NVRTC took.
struct Compiled {
    source: KernelSource,
    ptx: Result<String, KernelError>,
    seconds: f64,
}

/// Runs `f` on every item, on as many threads as there are cores, keeping
/// the order of `items`.
fn parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len());
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                results.lock().unwrap()[i] = Some(r);
            });
        }
    });
    results.into_inner().unwrap().into_iter().map(|r| r.expect("every item ran")).collect()
}

/// Every embedded source and the probe, compiled once (in parallel).
fn compiled() -> &'static [Compiled] {
    static OUT: OnceLock<Vec<Compiled>> = OnceLock::new();
    OUT.get_or_init(|| {
        let all: Vec<KernelSource> = sources().iter().copied().chain([PRELUDE_PROBE]).collect();
        parallel_map(&all, |s| {
            let start = Instant::now();
            let ptx = compile_ptx(s, ARCH);
            Compiled { source: *s, ptx, seconds: start.elapsed().as_secs_f64() }
        })
    })
}

/// The kernel names of a PTX module's `.entry` directives.
fn ptx_entries(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines().filter_map(|l| {
        let rest = l.trim_start().strip_prefix(".visible ").unwrap_or(l.trim_start());
        let rest = rest.strip_prefix(".entry ")?;
        Some(rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or(rest))
    })
}

#[test]
fn every_source_compiles_to_ptx_for_sm_90() {
    if !nvrtc_or_skip("every_source_compiles_to_ptx_for_sm_90") {
        return;
    }
    let (major, minor) = nvrtc_version().unwrap();
    say(&format!("NVRTC {major}.{minor}: compiling {} source(s) for {ARCH}", sources().len()));
    if sources().is_empty() {
        say("  (no crates/kernels/cuda/*.cu yet: only the prelude probe is compiled)");
    }
    let mut failures = Vec::new();
    for c in compiled() {
        let src = &c.source;
        let names = kernel_names(src.text);
        match &c.ptx {
            Ok(ptx) => {
                let missing: Vec<&&str> =
                    names.iter().filter(|n| !ptx.contains(&format!(".entry {n}("))).collect();
                say(&format!(
                    "  {}.cu: ok, {} kernel(s), {} KiB of PTX, {:.1} s",
                    src.name,
                    names.len(),
                    ptx.len().div_ceil(1024),
                    c.seconds
                ));
                if !missing.is_empty() {
                    failures.push(format!(
                        "{}.cu: no `.entry` in the PTX for {missing:?} (not extern \"C\"?)",
                        src.name
                    ));
                }
                // The other way round: a kernel the index does not list (one whose
                // name a macro pastes together, say) compiles but cannot be launched.
                let unindexed: Vec<&str> =
                    ptx_entries(ptx).filter(|e| !names.contains(e)).collect();
                if !unindexed.is_empty() {
                    failures.push(format!(
                        "{}.cu: kernels {unindexed:?} are in the PTX but not found by \
                         `kernel_names` (write `TPAR_KERNEL(<literal name>, ...)`)",
                        src.name
                    ));
                }
            }
            Err(e) => {
                say(&format!("  {}.cu: FAILED after {:.1} s", src.name, c.seconds));
                failures.push(e.to_string());
            }
        }
    }
    assert!(failures.is_empty(), "NVRTC rejected:\n\n{}", failures.join("\n\n"));
}

#[test]
fn a_broken_source_fails_with_the_nvrtc_log() {
    if !nvrtc_or_skip("a_broken_source_fails_with_the_nvrtc_log") {
        return;
    }
    let broken = KernelSource {
        name: "broken",
        text: "struct A { i32 n; };\n\
               TPAR_KERNEL(tpar_broken_f32, A, 32) { tpar_no_such_function(args.n); }\n",
    };
    match compile_ptx(&broken, ARCH) {
        Ok(_) => panic!("a source calling an undeclared function compiled"),
        Err(KernelError::Cuda { what, .. }) => {
            assert!(what.contains("tpar_no_such_function"), "no compiler log in: {what}");
            assert!(what.contains("broken.cu"), "the log does not name the file: {what}");
        }
        Err(e) => panic!("unexpected error kind: {e:?}"),
    }
    // A NUL byte in the text is an error, not a panic.
    let nul = KernelSource { name: "nul", text: "int x;\0" };
    assert!(matches!(compile_ptx(&nul, ARCH), Err(KernelError::Cuda { .. })));
}

#[test]
fn a_bad_architecture_is_an_error_without_nvrtc_too() {
    let src = sources().first().copied().unwrap_or(PRELUDE_PROBE);
    for arch in ["sm90", "sm_9", "x86_64", "sm_90 --use_fast_math"] {
        assert!(
            matches!(compile_ptx(&src, arch), Err(KernelError::Cuda { .. })),
            "{arch:?} accepted"
        );
    }
}

/// The ptxas binary to use: `TPAR_PTXAS`, else `ptxas` on `PATH`.
fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TPAR_PTXAS").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("ptxas")).find(|p| p.is_file())
}

/// The major CUDA version in `ptxas --version` ("... release 13.0, V13.0.88").
fn ptxas_major(ptxas: &PathBuf) -> Option<i32> {
    let out = Command::new(ptxas).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rel = text.split("release ").nth(1)?;
    rel.split('.').next()?.trim().parse().ok()
}

/// Per-kernel resource lines of `ptxas -v`: (kernel, registers, spill stores,
/// spill loads, stack frame, shared memory).
#[derive(Default, Debug)]
struct Usage {
    kernel: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    stack: u32,
    smem: u32,
}

/// The number right before `unit` in `line` ("0 bytes spill stores" -> 0).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.split_whitespace().next_back()?.parse().ok()
}

fn parse_ptxas(log: &str) -> Vec<Usage> {
    let mut out: Vec<Usage> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("?");
            out.push(Usage { kernel: name.to_string(), ..Usage::default() });
            continue;
        }
        let Some(u) = out.last_mut() else { continue };
        if line.contains("bytes spill stores") {
            u.stack = number_before(line, "bytes stack frame").unwrap_or(0);
            u.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            u.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("registers") {
            u.registers = number_before(line, "registers").unwrap_or(0);
            u.smem = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[test]
fn ptxas_reports_registers_and_spills() {
    if !nvrtc_or_skip("ptxas_reports_registers_and_spills") {
        return;
    }
    let Some(ptxas) = find_ptxas() else {
        say("ptxas report skipped: no TPAR_PTXAS and no ptxas on PATH");
        return;
    };
    let (nvrtc_major, _) = nvrtc_version().unwrap();
    match ptxas_major(&ptxas) {
        Some(m) if m >= nvrtc_major => {}
        found => {
            say(&format!(
                "ptxas report skipped: {} is CUDA {found:?}, older than NVRTC {nvrtc_major} \
                 (it cannot read that PTX)",
                ptxas.display()
            ));
            return;
        }
    }
    let dir = std::env::temp_dir().join(format!("tpar-nvrtc-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ok: Vec<(&str, &str)> = compiled()
        .iter()
        .filter_map(|c| c.ptx.as_ref().ok().map(|p| (c.source.name, p.as_str())))
        .collect(); // failures are reported by the compile test
    let runs = parallel_map(&ok, |&(name, ptx)| -> Result<Vec<Usage>, String> {
        let file = dir.join(format!("{name}.ptx"));
        std::fs::write(&file, ptx).map_err(|e| format!("writing {}: {e}", file.display()))?;
        let out = Command::new(&ptxas)
            .arg(format!("-arch={ARCH}"))
            .arg("-v")
            .arg(&file)
            .arg("-o")
            .arg(dir.join(format!("{name}.cubin")))
            .output()
            .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
        let log = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        if out.status.success() {
            Ok(parse_ptxas(&log))
        } else {
            Err(format!("ptxas rejected {name}.ptx:\n{log}"))
        }
    });
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for (&(name, _), run) in ok.iter().zip(runs) {
        match run {
            Ok(usage) => rows.extend(usage.into_iter().map(|u| (name, u))),
            Err(e) => failures.push(e),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut report = format!(
        "ptxas -arch={ARCH} -v ({}):\n  {:<14} {:<40} {:>5} {:>7} {:>7} {:>6} {:>6}",
        ptxas.display(),
        "source",
        "kernel",
        "regs",
        "spill-st",
        "spill-ld",
        "stack",
        "smem"
    );
    let spilling = rows.iter().filter(|(_, u)| u.spill_stores + u.spill_loads > 0).count();
    for (src, u) in &rows {
        report.push_str(&format!(
            "\n  {:<14} {:<40} {:>5} {:>7} {:>7} {:>6} {:>6}",
            src, u.kernel, u.registers, u.spill_stores, u.spill_loads, u.stack, u.smem
        ));
    }
    report.push_str(&format!("\n  {} kernel(s), {spilling} with spills", rows.len()));
    say(&report);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // The RMSNorm forward's and backward's vector kernels are bounded to two 512-thread
    // blocks per SM (`TPAR_BOUNDS(512, 2)`): 64 registers, which they must reach without
    // spilling.
    for name in ["fwd", "bwd"]
        .iter()
        .flat_map(|pass| ["f32", "bf16", "f16"].map(|dt| format!("tpar_rmsnorm_{pass}_{dt}")))
    {
        let u = rows.iter().map(|(_, u)| u).find(|u| u.kernel == name);
        let u = u.unwrap_or_else(|| panic!("ptxas reported no {name}"));
        assert!(
            u.registers <= 64 && u.spill_stores + u.spill_loads == 0,
            "{name}: {} registers, {} / {} bytes of spills (64 and none expected)",
            u.registers,
            u.spill_stores,
            u.spill_loads
        );
    }
}

#[test]
fn parses_ptxas_output() {
    let log = "ptxas info    : 0 bytes gmem\n\
               ptxas info    : Compiling entry function 'tpar_x_f32' for 'sm_90'\n\
               ptxas info    : Function properties for tpar_x_f32\n    \
               8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
               ptxas info    : Used 40 registers, used 1 barriers, 4352 bytes smem, 400 bytes cmem[0]\n";
    let u = parse_ptxas(log);
    assert_eq!(u.len(), 1);
    assert_eq!(
        (u[0].kernel.as_str(), u[0].registers, u[0].spill_stores, u[0].spill_loads),
        ("tpar_x_f32", 40, 4, 12)
    );
    assert_eq!((u[0].stack, u[0].smem), (8, 4352));
}
