//! The flagship example trains on a CUDA device: 2-D (FSDP x TP) Llama steps
//! on the emulated `cuda:0` (rank threads sharing it) give the CPU run's losses.

use std::path::PathBuf;
use std::process::Command;

/// The `llama_2d` example binary `cargo test` built beside this test.
fn example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples").join("llama_2d");
    p.exists().then_some(p)
}

fn summary(device: &str, plan: &str) -> (String, String) {
    let exe = example().expect("llama_2d example (built by `cargo test`)");
    let out = Command::new(exe)
        .env("TPAR_CUDA", "emulator")
        .args(["--world", "4", "--dp", "2", "--tp", "2", "--steps", "3", "--layers", "2"])
        .args(["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64"])
        .args(["--seq", "16", "--batch", "2", "--log-every", "1", "--lr", "3e-3"])
        .args(["--device", device, "--plan", plan])
        .output()
        .expect("run llama_2d");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let line = stdout
        .lines()
        .find(|l| l.starts_with("summary:"))
        .unwrap_or_else(|| panic!("no summary line:\n{stdout}\n{stderr}"))
        .to_string();
    let losses: Vec<String> = stdout
        .lines()
        .filter(|l| l.starts_with("epoch"))
        .filter_map(|l| l.split("loss ").nth(1)?.split(' ').next().map(String::from))
        .collect();
    (line, losses.join(" "))
}

#[test]
fn two_d_training_on_the_emulated_gpu_matches_the_cpu() {
    for plan in ["sp", "megatron"] {
        let (_, cpu) = summary("cpu", plan);
        let (line, gpu) = summary("cuda", plan);
        assert_eq!(cpu.split(' ').count(), 3, "{cpu}");
        assert_eq!(gpu, cpu, "plan {plan}: per-step losses on cuda:0 vs cpu ({line})");
    }
}
