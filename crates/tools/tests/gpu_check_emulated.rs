//! The GPU check tool (`gpu_check`, the binary of `crates/tools`) on the
//! emulated device: every kernel family passes against the CPU kernels, and a
//! perturbed reference makes every check fail (so a broken kernel cannot pass
//! unnoticed).

use std::process::Command;

/// The `gpu_check` binary, built by cargo beside this test.
fn gpu_check() -> &'static str {
    env!("CARGO_BIN_EXE_gpu_check")
}

/// `gpu_check --device emulator --quick --only <family>` (with `--sabotage` when asked),
/// the emulator standing in for an `sm_90a` device when `sm90a` (else for its default
/// architecture, whatever the environment says): its report, after asserting that it
/// exited successfully.
fn quick_family(family: &str, sm90a: bool, sabotage: bool) -> String {
    let arch = tpar_kernels::cuda::raw::gemm_hopper::EMU_ARCH_ENV;
    let mut args = vec!["--device", "emulator", "--quick", "--only", family];
    if sabotage {
        args.push("--sabotage");
    }
    let mut cmd = Command::new(gpu_check());
    cmd.args(&args).env_remove(arch);
    if sm90a {
        cmd.env(arch, "sm_90a");
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_kernel_passes_on_the_emulator() {
    let out = Command::new(gpu_check())
        .args(["--device", "emulator", "--quick"])
        .env_remove(tpar_kernels::cuda::emu::RACECHECK_ENV)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("emulator checks: none"), "{stdout}");
    let last = stdout.lines().rev().find(|l| l.contains("checks:")).unwrap_or_default();
    assert!(last.contains(" 0 failed"), "{last}");
}

/// Every kernel family under the emulator's race check (`TPAR_EMU_RACECHECK=1`:
/// shared-memory races and missing proxy fences fail the launch, and so do
/// out-of-bounds and misaligned accesses, global memory checked against the
/// emulated device's allocations), the mma.sync
/// kernels at the default architecture and the Hopper ones (wgmma, bulk tensor
/// copies, mbarriers, clusters) at `sm_90a`: one test each, so that the two runs
/// share the harness's threads.
fn every_kernel_passes_the_race_check_at(sm90a: bool) {
    let arch = tpar_kernels::cuda::raw::gemm_hopper::EMU_ARCH_ENV;
    let mut cmd = Command::new(gpu_check());
    cmd.args(["--device", "emulator", "--quick"])
        .env(tpar_kernels::cuda::emu::RACECHECK_ENV, "1")
        .env_remove(arch);
    if sm90a {
        cmd.env(arch, "sm_90a");
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "sm_90a {sm90a}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().rev().find(|l| l.contains("checks:")).unwrap_or_default();
    assert!(last.contains(" 0 failed"), "sm_90a {sm90a}: {last}");
    assert!(!stdout.contains("racecheck"), "sm_90a {sm90a}: {stdout}");
    assert!(!stdout.contains("memcheck"), "sm_90a {sm90a}: {stdout}");
    // and it did run under the check
    assert!(
        stdout.contains("emulator checks: races and memory errors"),
        "sm_90a {sm90a}: {stdout}"
    );
}

#[test]
fn every_kernel_passes_the_race_check() {
    every_kernel_passes_the_race_check_at(false);
}

#[test]
fn every_kernel_passes_the_race_check_at_sm_90a() {
    every_kernel_passes_the_race_check_at(true);
}

#[test]
fn a_perturbed_reference_fails_the_checks() {
    let out = Command::new(gpu_check())
        .args(["--device", "emulator", "--quick", "--sabotage", "--only", "rmsnorm,gemm,dropout"])
        .output()
        .unwrap();
    // in sabotage mode success means that every check failed
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(!stdout.lines().any(|l| l.starts_with("PASS")), "{stdout}");
    let last = stdout.lines().rev().find(|l| l.contains("checks:")).unwrap_or_default();
    assert!(last.contains(" 0 passed"), "{last}");
}

/// The Hopper GEMM's checks run where the device runs `sm_90a` kernels (the emulator
/// standing in for one): every layout, type pair, edge and epilogue (the rotary one
/// included) passes, at both tile widths and with clusters, and a perturbed reference
/// fails every one of them.
#[test]
fn the_hopper_gemm_checks_run_on_an_emulated_sm_90a() {
    let run = |sabotage: bool| quick_family("gemm", true, sabotage);
    let good = run(false);
    let hopper: Vec<&str> = good.lines().filter(|l| l.contains(" gemm_hopper.")).collect();
    assert!(hopper.len() >= 62, "{good}");
    assert!(hopper.iter().all(|l| l.starts_with("PASS")), "{good}");
    // 25 rows per tile width without clusters, 6 with; the epilogues at both widths
    for (variant, rows) in [(".n256.c2.", 6), (".n256.", 31), (".c2.", 6)] {
        let n = hopper.iter().filter(|l| l.contains(&format!(" gemm_hopper{variant}"))).count();
        assert_eq!(n, rows, "gemm_hopper{variant} rows:\n{good}");
    }
    for fused in ["bias", "residual", "silu_mul"] {
        for width in ["gemm_hopper.", "gemm_hopper.n256."] {
            let row =
                |l: &&&str| l.contains(&format!(" {width}")) && l.contains(&format!(".{fused} "));
            assert!(hopper.iter().any(|l| row(&l)), "{width}*.{fused}:\n{good}");
        }
    }
    // the rotary epilogue: the kernel at both tile widths and the unfused path against
    // the reference, and the two paths against each other, with bf16 and f32 C
    for dt in ["bf16", "f32"] {
        for what in ["n128", "n256", "unfused", "fused_vs_unfused"] {
            let name = format!(" gemm_hopper.rope.{dt}.{what} ");
            assert!(hopper.iter().any(|l| l.contains(&name)), "{name}:\n{good}");
        }
    }
    let bad = run(true);
    assert!(!bad.lines().any(|l| l.starts_with("PASS")), "{bad}");
    assert_eq!(bad.lines().filter(|l| l.contains(" gemm_hopper.")).count(), hopper.len());
}

/// With the emulator contracting `a * b + c` into fused multiply-adds where the host
/// compiler chooses (as a GPU compiler may), the AdamW kernels still give the CPU
/// kernel's bits and agree with each other: every operation of their step is
/// explicitly rounded, so no compiler's choice can change it.
#[test]
fn adamw_bits_do_not_depend_on_contraction() {
    #[cfg(target_arch = "x86_64")]
    if !std::arch::is_x86_feature_detected!("fma") {
        eprintln!("skipped: this host has no fused multiply-add to contract into");
        return;
    }
    let out = Command::new(gpu_check())
        .args(["--device", "emulator", "--quick", "--only", "adamw"])
        .env(tpar_kernels::cuda::emu::FP_CONTRACT_ENV, "fast")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for check in ["adamw.cpu_bits", "adamw.each"] {
        assert!(stdout.lines().any(|l| l.starts_with("PASS") && l.contains(check)), "{stdout}");
    }
    assert!(!stdout.lines().any(|l| l.starts_with("FAIL")), "{stdout}");
}

/// With the emulator running each launch's blocks in an order drawn from its seed (as a
/// GPU runs them in any order), every check still passes: a check that states exact bits
/// states only bits no block order changes (the embedding's sorted gradient, AdamW,
/// dropout, the reductions' fixed folds), and results summed by float atomics of
/// several blocks (the attention backward's dq) are held to a bound.
#[test]
fn checks_do_not_depend_on_block_order() {
    let out = Command::new(gpu_check())
        .args(["--device", "emulator", "--quick"])
        .env(tpar_kernels::cuda::emu::BLOCK_ORDER_ENV, "shuffled")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(!stdout.lines().any(|l| l.starts_with("FAIL")), "{stdout}");
    let passed = stdout.lines().filter(|l| l.starts_with("PASS")).count();
    assert!(passed > 200, "{passed} checks passed:\n{stdout}");
}

/// The Hopper attention's checks run where the device runs `sm_90a` kernels (the
/// emulator standing in for one): forward and backward on `SdpaPath::Hopper` pass for
/// every case (the packed q/k/v layout included, as on the default path), and a
/// perturbed reference fails every one of them.
#[test]
fn the_hopper_attention_checks_run_on_an_emulated_sm_90a() {
    let run = |sabotage: bool| quick_family("sdpa", true, sabotage);
    let good = run(false);
    let hopper: Vec<&str> = good.lines().filter(|l| l.contains(" sdpa_hopper.")).collect();
    assert!(hopper.len() >= 20, "{good}");
    assert!(hopper.iter().all(|l| l.starts_with("PASS")), "{good}");
    for part in ["out", "lse", "dq", "dk", "dv"] {
        assert!(hopper.iter().any(|l| l.contains(&format!(".{part} "))), "{good}");
        // the packed layout (one q/k/v buffer, one gradient) on both kernel families
        for family in ["sdpa_hopper", "sdpa.auto"] {
            let row = format!(" {family}.packed.{part} ");
            let rows: Vec<&str> = good.lines().filter(|l| l.contains(&row)).collect();
            assert!(rows.len() >= 2 && rows.iter().all(|l| l.starts_with("PASS")), "{row}: {good}");
        }
    }
    let bad = run(true);
    assert!(!bad.lines().any(|l| l.starts_with("PASS")), "{bad}");
    assert_eq!(bad.lines().filter(|l| l.contains(" sdpa_hopper.")).count(), hopper.len());
}

/// The padded-GEMM checks (`gemm_pad`: the LM head's products with operands staged
/// in padded scratch, against the f64 reference and the unpadded run) pass on the
/// emulator, as itself and as an `sm_90a` device, and a perturbed reference fails
/// every one of them.
#[test]
fn the_padded_gemm_checks_pass_and_a_perturbed_reference_fails_them() {
    let run = |sm90a: bool, sabotage: bool| quick_family("gemm_pad", sm90a, sabotage);
    for sm90a in [false, true] {
        let good = run(sm90a, false);
        let rows: Vec<&str> = good.lines().filter(|l| l.contains(" gemm_pad.")).collect();
        // 3 layouts x 2 type pairs x beta 0 and 1, each against f64 and unpadded
        assert_eq!(rows.len(), 24, "{good}");
        assert!(rows.iter().all(|l| l.starts_with("PASS")), "{good}");
        let bad = run(sm90a, true);
        assert!(!bad.lines().any(|l| l.starts_with("PASS")), "{bad}");
        assert_eq!(bad.lines().filter(|l| l.contains(" gemm_pad.")).count(), rows.len());
    }
}
