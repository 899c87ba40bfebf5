//! NVRTC compiles the Hopper test kernels (`tests/hopper/kernels.cu`: the
//! mbarrier, bulk tensor copy, wgmma, setmaxnreg and cluster wrappers of the
//! prelude and the TMA + wgmma GEMM tile) for `sm_90a`, without a GPU.
//!
//! Without a loadable NVRTC the tests print why and pass, unless
//! `TPAR_REQUIRE_NVRTC=1`, where they fail. NVRTC does not read inline PTX;
//! when `ptxas` is available (`TPAR_PTXAS`, or on `PATH`) the PTX is also
//! assembled for `sm_90a`, which checks every instruction, and the registers,
//! stack frame, spills and warnings of each kernel are reported; the GEMM and
//! the attention backward must have no stack frame, no spills and no warning
//! (such as a `setmaxnreg` that ptxas ignores). Every Hopper kernel's PTX
//! must hold the mbarrier watchdog (`%globaltimer`, its report, `brkpt`): a
//! wait that never completes stops the kernel with an error instead of
//! hanging, and says where it waited.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;

use tpar_kernels::cuda::device::{
    compile_ptx, compile_ptx_with, kernel_names, nvrtc_version, CompileOptions,
};
use tpar_kernels::cuda::KernelSource;

const ARCH: &str = "sm_90a";

const SOURCE: KernelSource =
    KernelSource { name: "hopper_test", text: include_str!("hopper/kernels.cu") };

fn say(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{text}");
}

/// Whether NVRTC can be used; without it, skips (prints the reason) or, when
/// required, fails.
fn nvrtc_or_skip(test: &str) -> bool {
    match nvrtc_version() {
        Ok(_) => true,
        Err(e) if std::env::var("TPAR_REQUIRE_NVRTC").is_ok_and(|v| v == "1") => {
            panic!("TPAR_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}")
        }
        Err(e) => {
            say(&format!("skipping {test}: {e}"));
            false
        }
    }
}

fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TPAR_PTXAS").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("ptxas")).find(|p| p.is_file())
}

/// The number right before `unit` in `line` ("0 bytes spill stores" -> 0).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.split_whitespace().next_back()?.parse().ok()
}

/// What `ptxas -v` says of one kernel.
#[derive(Debug, Default)]
struct Usage {
    kernel: String,
    registers: u32,
    /// Bytes of the stack frame (local memory the kernel itself keeps).
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    /// The warning lines ([`is_warning`]) while this kernel was compiled, or
    /// that name it.
    warnings: Vec<String>,
}

/// Whether a `ptxas -v` line warns: a `ptxas warning`, or an info line of a
/// lost optimisation, such as "(C7508) Potential Performance Loss:
/// 'setmaxnreg' ignored; unable to determine register count at entry" (which
/// names no kernel and comes before the first one).
fn is_warning(line: &str) -> bool {
    line.contains("ptxas warning") || line.contains("Potential Performance Loss")
}

/// Each kernel's figures from a `ptxas -v` log, and the warnings that belong
/// to no kernel.
fn parse_ptxas(log: &str) -> (Vec<Usage>, Vec<String>) {
    let mut out: Vec<Usage> = Vec::new();
    let mut loose = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or("?").to_string();
            out.push(Usage { kernel, ..Usage::default() });
            continue;
        }
        if is_warning(line) {
            let named = out.iter().position(|u| line.contains(&format!("'{}'", u.kernel)));
            match named.or(out.len().checked_sub(1)) {
                Some(i) => out[i].warnings.push(line.trim().to_string()),
                None => loose.push(line.trim().to_string()),
            }
            continue;
        }
        let Some(u) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            u.stack = number_before(line, "bytes stack frame").unwrap_or(0);
        }
        if line.contains("bytes spill stores") {
            u.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            u.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("registers") {
            u.registers = number_before(line, "registers").unwrap_or(0);
        }
    }
    (out, loose)
}

/// Asserts what a warp-specialised Hopper kernel needs of ptxas: no stack
/// frame (no array indexed at run time kept in local memory), no spills, and
/// no warning (a `setmaxnreg` that ptxas ignores, C7508, comes as one).
fn assert_clean((usage, loose): &(Vec<Usage>, Vec<String>)) {
    assert!(loose.is_empty(), "ptxas warnings: {loose:?}");
    for u in usage {
        assert!(u.stack == 0, "{} has a {}-byte stack frame", u.kernel, u.stack);
        assert!(
            u.spill_stores == 0 && u.spill_loads == 0,
            "{} spills ({} bytes stored, {} loaded)",
            u.kernel,
            u.spill_stores,
            u.spill_loads
        );
        assert!(u.warnings.is_empty(), "ptxas warns about {}: {:?}", u.kernel, u.warnings);
    }
}

/// The test kernels' PTX for `sm_90a` with the default options, compiled once for the
/// tests that read it (NVRTC takes seconds over them).
fn default_ptx() -> &'static str {
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PTX.get_or_init(|| compile_ptx(&SOURCE, ARCH).unwrap_or_else(|e| panic!("NVRTC rejected: {e}")))
}

#[test]
fn hopper_kernels_compile_for_sm_90a() {
    if !nvrtc_or_skip("hopper_kernels_compile_for_sm_90a") {
        return;
    }
    let ptx = default_ptx();
    let names = kernel_names(SOURCE.text);
    assert!(names.contains(&"hopper_gemm_tile_nt") && names.contains(&"hopper_gemm_tile_nn"));
    for n in &names {
        assert!(ptx.contains(&format!(".entry {n}(")), "no .entry for {n}");
    }
    for instr in [
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16",
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group",
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes",
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group",
        "mbarrier.try_wait.parity.shared::cta.b64",
        "setmaxnreg.dec.sync.aligned.u32",
        "multicast::cluster",
        "mapa.u64",
        "barrier.cluster.arrive.release.aligned",
    ] {
        assert!(ptx.contains(instr), "{instr} missing from the PTX");
    }
    assert_watchdog("hopper_test", ptx);
    say(&format!("NVRTC: {} kernel(s), {} KiB of PTX for {ARCH}", names.len(), ptx.len() / 1024));

    ptxas_report("hopper_test", ptx);
}

/// `-DTPAR_MBAR_TIMEOUT_MS=...` (through `CompileOptions::define`) sets the
/// watchdog's limit: another value changes the PTX, and a value out of
/// 1..=3600000 is refused by NVRTC with a message naming it.
#[test]
fn the_watchdog_limit_is_a_define() {
    if !nvrtc_or_skip("the_watchdog_limit_is_a_define") {
        return;
    }
    let with = |ms: &str| {
        compile_ptx_with(
            &SOURCE,
            ARCH,
            &CompileOptions::default().define("TPAR_MBAR_TIMEOUT_MS", Some(ms)),
        )
    };
    let default = default_ptx();
    let short = with("2000").unwrap_or_else(|e| panic!("NVRTC rejected: {e}"));
    assert_watchdog("hopper_test -DTPAR_MBAR_TIMEOUT_MS=2000", &short);
    assert!(default != short, "-DTPAR_MBAR_TIMEOUT_MS=2000 left the PTX as it was");
    for bad in ["0", "3600001"] {
        let e = with(bad).expect_err(bad).to_string();
        assert!(e.contains("TPAR_MBAR_TIMEOUT_MS must be in 1..=3600000"), "{bad}: {e}");
    }
}

/// Assembles `ptx` with `ptxas -arch=sm_90a -v` when a ptxas is at hand
/// (which checks every instruction) and prints each kernel's registers, stack
/// frame, spills and warnings; returns them and the warnings that belong to
/// no kernel (`None` when the check was skipped).
fn ptxas_report(name: &str, ptx: &str) -> Option<(Vec<Usage>, Vec<String>)> {
    let Some(ptxas) = find_ptxas() else {
        say("ptxas check skipped: no TPAR_PTXAS and no ptxas on PATH");
        return None;
    };
    let dir = std::env::temp_dir().join(format!("tpar-nvrtc-hopper-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{name}.ptx"));
    std::fs::write(&file, ptx).unwrap();
    let out = Command::new(&ptxas)
        .arg(format!("-arch={ARCH}"))
        .arg("-v")
        .arg(&file)
        .arg("-o")
        .arg(dir.join(format!("{name}.cubin")))
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.display()));
    let _ = std::fs::remove_dir_all(&dir);
    let log =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() && log.contains("Unsupported .version") {
        say(&format!(
            "ptxas check skipped: {} is older than the NVRTC that wrote the PTX:\n{log}",
            ptxas.display()
        ));
        return None;
    }
    assert!(out.status.success(), "ptxas rejected the PTX of {name}:\n{log}");
    let (usage, loose) = parse_ptxas(&log);
    let mut report = format!(
        "ptxas -arch={ARCH} -v ({name}):\n  {:<32} {:>5} {:>6} {:>8} {:>8} {:>8}",
        "kernel", "regs", "stack", "spill-st", "spill-ld", "warnings"
    );
    for u in &usage {
        report.push_str(&format!(
            "\n  {:<32} {:>5} {:>6} {:>8} {:>8} {:>8}",
            u.kernel,
            u.registers,
            u.stack,
            u.spill_stores,
            u.spill_loads,
            u.warnings.len()
        ));
        for w in &u.warnings {
            report.push_str(&format!("\n    {w}"));
        }
    }
    for w in &loose {
        report.push_str(&format!("\n  (no kernel) {w}"));
    }
    say(&report);
    Some((usage, loose))
}

/// What the mbarrier watchdog of `mbarrier_wait_parity` (tpar.cuh) puts in
/// the PTX of every kernel that waits on an mbarrier: the global timer read
/// after the first failed try, the report (the record's address read from
/// the module global `tpar_watchdog_report`, the SM read into it, the system
/// fence before its magic word), and the `brkpt` (then a store to the null
/// address) that stops a wait past `TPAR_MBAR_TIMEOUT_MS` with a sticky error
/// instead of a hang.
const WATCHDOG: [&str; 5] =
    ["%globaltimer;", "[tpar_watchdog_report];", "%smid;", "membar.sys;", "brkpt;"];

/// Asserts that the PTX of `name` holds the mbarrier watchdog ([`WATCHDOG`]).
fn assert_watchdog(name: &str, ptx: &str) {
    for instr in WATCHDOG {
        assert!(ptx.contains(instr), "{name}: the mbarrier watchdog's {instr} is missing");
    }
}

/// Compiles the embedded kernel source `source_name` for sm_90a with NVRTC
/// and asserts that it has `kernels` kernels (`what` says which), an `.entry`
/// for each, and every instruction of `instrs` in the PTX (one written
/// `!instr` must be absent from it); with ptxas, also
/// that it assembles into exactly those kernels with no stack frame, spills or
/// warnings ([`assert_clean`]), and returns ptxas's figures (`None` when
/// NVRTC or ptxas is not at hand).
fn assert_compiles_clean(
    test: &str,
    source_name: &str,
    kernels: usize,
    what: &str,
    instrs: &[&str],
) -> Option<Vec<Usage>> {
    if !nvrtc_or_skip(test) {
        return None;
    }
    let source = *tpar_kernels::cuda::sources()
        .iter()
        .find(|s| s.name == source_name)
        .unwrap_or_else(|| panic!("{source_name}.cu is embedded"));
    let ptx = compile_ptx(&source, ARCH).unwrap_or_else(|e| panic!("NVRTC rejected: {e}"));
    let names = kernel_names(source.text);
    assert_eq!(names.len(), kernels, "{what}: {names:?}");
    for n in &names {
        assert!(ptx.contains(&format!(".entry {n}(")), "no .entry for {n}");
    }
    for instr in instrs {
        match instr.strip_prefix('!') {
            Some(absent) => assert!(!ptx.contains(absent), "{absent} in the PTX"),
            None => assert!(ptx.contains(instr), "{instr} missing from the PTX"),
        }
    }
    assert_watchdog(source_name, &ptx);
    say(&format!("NVRTC: {} kernel(s), {} KiB of PTX for {ARCH}", names.len(), ptx.len() / 1024));
    let report = ptxas_report(source_name, &ptx)?;
    assert_eq!(report.0.len(), names.len(), "ptxas reported other kernels than NVRTC compiled");
    assert_clean(&report);
    Some(report.0)
}

/// The Hopper GEMM (`cuda/gemm_hopper.cu`, embedded like every kernel
/// source) compiles for sm_90a with its wgmma, bulk tensor copies, mbarriers
/// and setmaxnreg, and (with ptxas) assembles with no stack frame, spills or
/// warnings; registers and spills of its kernels are reported. ptxas
/// reports the count at entry that the launch bounds (384 threads, one
/// block per SM) fix; `setmaxnreg` then gives the consumer warpgroups 232,
/// and no spills means their code fits in those (the `_n256` kernels hold
/// 128 accumulators per thread). Compiled for plain sm_90 its kernels are
/// empty (`tests/nvrtc.rs` covers that build).
#[test]
fn the_hopper_gemm_compiles_for_sm_90a() {
    let usage = assert_compiles_clean(
        "the_hopper_gemm_compiles_for_sm_90a",
        "gemm_hopper",
        48,
        "4 layouts x 2 input x 3 output types x tile widths 128 and 256",
        &[
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16",
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16",
            "wgmma.wait_group.sync.aligned",
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes",
            "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group",
            "mbarrier.try_wait.parity.shared::cta.b64",
            "mbarrier.arrive.expect_tx.shared::cta.b64",
            "setmaxnreg.dec.sync.aligned.u32",
            "setmaxnreg.inc.sync.aligned.u32",
            // clusters of 2: A multicast, remote empty arrivals, the cluster barrier
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster",
            "mbarrier.arrive.release.cluster.shared::cluster.b64",
            "barrier.cluster.arrive.release.aligned",
            "%cluster_ctarank",
            // the epilogue waits for its previous bulk store to have read the image
            "cp.async.bulk.wait_group.read 0",
            // the accumulators staged as 8-byte pairs (the swizzled staging chunk)
            "st.shared.v2.f32",
        ],
    );
    const CONSUMER_REGISTERS: u32 = 232;
    for u in usage.iter().flatten() {
        assert!(
            u.registers <= CONSUMER_REGISTERS,
            "{} uses {} registers, above the consumers' setmaxnreg {CONSUMER_REGISTERS}",
            u.kernel,
            u.registers
        );
    }
    let wide = usage.iter().flatten().filter(|u| u.kernel.ends_with("_n256")).count();
    assert!(usage.is_none() || wide == 24, "ptxas reported {wide} _n256 kernels");
}

/// The Hopper attention backward (`cuda/sdpa_hopper_bwd.cu`) compiles for
/// sm_90a with its wgmma (shared and register A operands), bulk tensor
/// copies through 4-D maps that carry each operand's strides, mbarriers, setmaxnreg and the dQ writer's 1-D bulk reduction (no
/// per-element `red.global.add` atomics left; dQ staged with 16-byte stores,
/// none of 8 bytes), and the kernels that convert
/// the dQ accumulator, and (with ptxas) assembles with no stack frame, spills
/// or warnings; registers and spills of its kernels are reported.
#[test]
fn the_hopper_attention_backward_compiles_for_sm_90a() {
    assert_compiles_clean(
        "the_hopper_attention_backward_compiles_for_sm_90a",
        "sdpa_hopper_bwd",
        6,
        "head dims 64 and 128 x bf16 and f16, and the dQ conversion for bf16 and f16",
        &[
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16",
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",
            // the dQ writer: one bulk reduction a tile, its source freed by wait_group.read
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
            "cp.async.bulk.commit_group",
            "cp.async.bulk.wait_group.read 0",
            "!red.global.add",
            // dQ staged in the accumulator's permuted order: 16-byte stores, no 8-byte ones
            "st.shared.v4.f32",
            "!st.shared.u64",
            // q, dO, k and v through 4-D maps (d, len, heads, batch) with their strides
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes",
            "!cp.async.bulk.tensor.3d",
            "mbarrier.try_wait.parity.shared::cta.b64",
            "mbarrier.arrive.expect_tx.shared::cta.b64",
            "setmaxnreg.dec.sync.aligned.u32",
            "setmaxnreg.inc.sync.aligned.u32",
        ],
    );
}

/// The Hopper attention forward (`cuda/sdpa_hopper.cu`) compiles for sm_90a
/// with its wgmma (from shared memory and from registers), bulk tensor
/// copies through 4-D maps that carry each operand's strides (the loads of
/// q, k and v, the stores of O staged in shared memory), mbarriers and setmaxnreg, and (with ptxas) assembles with no stack
/// frame, spills or warnings; registers and spills of its kernels are
/// reported.
#[test]
fn the_hopper_attention_forward_compiles_for_sm_90a() {
    assert_compiles_clean(
        "the_hopper_attention_forward_compiles_for_sm_90a",
        "sdpa_hopper",
        4,
        "2 head dims x 2 dtypes",
        &[
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16",
            // q, k, v and O through 4-D maps (d, len, heads, batch) with their strides
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes",
            "!cp.async.bulk.tensor.3d",
            "mbarrier.try_wait.parity.shared::cta.b64",
            "mbarrier.arrive.expect_tx.shared::cta.b64",
            "setmaxnreg.dec.sync.aligned.u32",
            "setmaxnreg.inc.sync.aligned.u32",
            // O staged in the q tile, then bulk tensor stores after an async-proxy fence
            "fence.proxy.async.shared::cta",
            "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group",
        ],
    );
}
