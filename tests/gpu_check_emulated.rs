//! The GPU check tool (`examples/gpu_check.rs`) on the emulated device: every
//! kernel family passes against the CPU kernels, and a perturbed reference
//! makes every check fail (so a broken kernel cannot pass unnoticed).

use std::path::PathBuf;
use std::process::Command;

fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let p = exe.parent().and_then(|d| d.parent()).expect("target dir").join("examples/gpu_check");
    assert!(p.exists(), "gpu_check example not built at {}", p.display());
    p
}

#[test]
fn every_kernel_passes_on_the_emulator() {
    let out = Command::new(example()).args(["--device", "emulator", "--quick"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().rev().find(|l| l.contains("checks:")).unwrap_or_default();
    assert!(last.contains(" 0 failed"), "{last}");
}

#[test]
fn a_perturbed_reference_fails_the_checks() {
    let out = Command::new(example())
        .args(["--device", "emulator", "--quick", "--sabotage", "--only", "rmsnorm,gemm"])
        .output()
        .unwrap();
    // in sabotage mode success means that every check failed
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(!stdout.lines().any(|l| l.starts_with("PASS")), "{stdout}");
    let last = stdout.lines().rev().find(|l| l.contains("checks:")).unwrap_or_default();
    assert!(last.contains(" 0 passed"), "{last}");
}
