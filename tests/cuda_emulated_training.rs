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

/// `llama_2d` on a tiny model (2 layers, hidden 32, seq 16, batch 2) with `args`, the
/// emulator serving `cuda`: its stdout and stderr.
fn run_tiny(args: &[&str]) -> (String, String) {
    let model = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2"];
    let shape = ["--intermediate", "64", "--seq", "16", "--batch", "2"];
    run_with(&[], &[&model[..], &shape, args].concat())
}

/// `llama_2d` with `args` and the environment `env`, the emulator serving `cuda`: its
/// stdout and stderr.
fn run_with(env: &[(&str, &str)], args: &[&str]) -> (String, String) {
    let exe = example().expect("llama_2d example (built by `cargo test`)");
    let mut cmd = Command::new(exe);
    cmd.env("TPAR_CUDA", "emulator").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run llama_2d");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The `final_loss_bits` of a run's summary line (failing with its output when there is
/// none).
fn final_bits(what: &str, (stdout, stderr): (String, String)) -> String {
    let line = stdout.lines().find(|l| l.starts_with("summary:"));
    let line = line.unwrap_or_else(|| panic!("{what}: no summary line:\n{stdout}\n{stderr}"));
    let v = line.split_whitespace().find_map(|kv| kv.strip_prefix("final_loss_bits="));
    v.unwrap_or_else(|| panic!("{what}: no final_loss_bits in {line}")).to_string()
}

fn summary(device: &str, plan: &str) -> (String, String) {
    let (stdout, stderr) = run_tiny(&[
        "--world",
        "4",
        "--dp",
        "2",
        "--tp",
        "2",
        "--steps",
        "3",
        "--log-every",
        "1",
        "--lr",
        "3e-3",
        "--device",
        device,
        "--plan",
        plan,
    ]);
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

/// Rank 0's host round trips of each step of a 4-step emulated CUDA run that logs
/// steps 1 and 4 (`--log-every 10`): `(logging steps, quiet steps)`, from the
/// `round_trips_logging=` / `round_trips_quiet=` lists of the `device:` line.
fn step_round_trips(args: &[&str]) -> (Vec<u64>, Vec<u64>) {
    let mut all = vec!["--steps", "4", "--log-every", "10", "--device", "cuda"];
    all.extend_from_slice(args);
    let (stdout, stderr) = run_tiny(&all);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("device:"))
        .unwrap_or_else(|| panic!("{args:?}: no device line:\n{stdout}\n{stderr}"));
    let list = |key: &str| -> Vec<u64> {
        let v = line.split(key).nth(1).and_then(|r| r.split(' ').next());
        let v = v.unwrap_or_else(|| panic!("{args:?}: no {key} in {line}"));
        v.split(',').filter(|s| !s.is_empty()).map(|s| s.parse().expect(line)).collect()
    };
    (list("round_trips_logging="), list("round_trips_quiet="))
}

/// On the device a training step stays there: no host round trip on a step that does
/// not log, exactly one (the loss and the gradient norm, read together) on a step that
/// does, with and without FSDP at world 1, at cp 2 (ring attention's blocks and merges on
/// the device) and with FSDP x TP at 2x2 for both plans: one test each, so that the
/// runs share the harness's threads.
fn reads_the_host_only_to_log(args: &[&str]) {
    let (logging, quiet) = step_round_trips(args);
    assert!(
        logging == [1, 1] && quiet == [0, 0],
        "{}: round trips on logging steps {logging:?} (want [1, 1]), on the others {quiet:?} \
         (want [0, 0])",
        args.join(" ")
    );
}

#[test]
fn a_device_step_reads_the_host_only_to_log_without_fsdp() {
    reads_the_host_only_to_log(&["--world", "1", "--dp", "1", "--tp", "1", "--no-fsdp"]);
}

#[test]
fn a_device_step_reads_the_host_only_to_log_at_cp_2() {
    reads_the_host_only_to_log(&["--world", "2", "--dp", "1", "--cp", "2", "--tp", "1"]);
}

#[test]
fn a_device_step_reads_the_host_only_to_log_with_fsdp() {
    reads_the_host_only_to_log(&["--world", "1", "--dp", "1", "--tp", "1"]);
}

#[test]
fn a_device_step_reads_the_host_only_to_log_at_2x2_sp() {
    reads_the_host_only_to_log(&["--world", "4", "--dp", "2", "--tp", "2", "--plan", "sp"]);
}

#[test]
fn a_device_step_reads_the_host_only_to_log_at_2x2_megatron() {
    reads_the_host_only_to_log(&["--world", "4", "--dp", "2", "--tp", "2", "--plan", "megatron"]);
}

/// Context parallelism on the device: cp 2 x tp 2 steps (ring attention's blocks, the
/// log-sum-exp merges and the backward on `cuda:0`) end with the CPU run's loss bits.
#[test]
fn context_parallel_training_on_the_emulated_gpu_matches_the_cpu() {
    let bits = |device: &str| -> String {
        let args = ["--world", "4", "--dp", "1", "--cp", "2", "--tp", "2", "--steps", "2"];
        let out = run_tiny(&[&args[..], &["--log-every", "1", "--device", device]].concat());
        assert!(out.0.contains(" cp=2"), "{device}: {}", out.0);
        final_bits(device, out)
    };
    assert_eq!(bits("cuda"), bits("cpu"));
}

/// A quiet eager step on the device reads nothing back: the embedding's and the loss's
/// index checks are deferred (the ids were checked on the host) and read on logging
/// steps, so the device-to-host reads the emulator counts are 0 on steps 2 and 3 of a
/// 4-step run that logs steps 1 and 4 (each id check read its status back before,
/// 2 reads a step), and the run ends with the CPU run's loss bits; with and without
/// FSDP. (At world 4 the ranks share the device and its counts, so a rank's step
/// window also sees its peers' logging reads: world 1 counts one rank exactly.)
#[test]
fn quiet_device_steps_read_nothing_back() {
    let world1 = ["--world", "1", "--dp", "1", "--tp", "1"];
    let configs: [&[&str]; 2] = [&[&world1[..], &["--no-fsdp"]].concat(), &world1];
    for mode in configs {
        let run = |device: &str| -> String {
            let rest = ["--steps", "4", "--log-every", "10", "--device", device];
            let (stdout, stderr) = run_tiny(&[mode, &rest].concat());
            assert!(stdout.contains("summary:"), "{mode:?} {device}:\n{stdout}\n{stderr}");
            stdout
        };
        let field = |out: &str, prefix: &str, key: &str| -> String {
            let line =
                out.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{out}"));
            let v = line.split_whitespace().find_map(|kv| kv.strip_prefix(key));
            v.unwrap_or_else(|| panic!("no {key} in {line}")).to_string()
        };
        let (cpu, gpu) = (run("cpu"), run("cuda"));
        let nums = |key: &str| -> Vec<u64> {
            field(&gpu, "work:", key).split(',').map(|v| v.parse().unwrap()).collect()
        };
        let (logging, reads) = (nums("logging="), nums("dtoh_reads="));
        assert_eq!(logging, [1, 0, 0, 1], "{mode:?}: {gpu}");
        let quiet: Vec<u64> =
            reads.iter().zip(&logging).filter(|p| *p.1 == 0).map(|p| *p.0).collect();
        assert_eq!(quiet, [0, 0], "{mode:?}: device-to-host reads of the quiet steps ({reads:?})");
        // A logging step reads the loss and the norm, and the recorded index checks.
        assert!(reads[0] >= 1 && reads[3] >= 1, "{mode:?}: {reads:?}");
        let bits = |o: &str| field(o, "summary:", "final_loss_bits=");
        assert_eq!(bits(&gpu), bits(&cpu), "{mode:?}: final loss bits, cuda:0 vs cpu");
    }
}

/// The emulator's race check (`TPAR_EMU_RACECHECK=1`: a data race in shared or global
/// memory, or a missing proxy fence, fails the launch).
const RACE: (&str, &str) = ("TPAR_EMU_RACECHECK", "1");

/// The emulated training step under the race check: a 2x2 FSDP x TP step of the tiny
/// model ends with the loss bits of the same run without the check. One step (forward,
/// loss, backward, clipping, AdamW): every kernel of the step once, under the check's
/// several-fold slowdown.
#[test]
fn the_training_step_passes_the_race_check() {
    let args = ["--world", "4", "--dp", "2", "--tp", "2", "--steps", "1", "--device", "cuda"];
    let tiny = |env: &[(&str, &str)]| {
        let model = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2"];
        let shape = ["--intermediate", "64", "--seq", "16", "--batch", "2"];
        final_bits("2x2", run_with(env, &[&model[..], &shape, &args].concat()))
    };
    assert_eq!(tiny(&[RACE]), tiny(&[]), "2x2 FSDP x TP under the race check");
}

/// As above, a bf16 step of one layer at head dim 64 with the Hopper kernels (`sm_90a`:
/// the wgmma GEMM and attention forward and backward, the packed q/k/v and the fused
/// residual); a test of its own, so that the two checked runs share the harness's threads.
#[test]
fn the_hopper_training_step_passes_the_race_check() {
    let hopper = [("TPAR_EMU_ARCH", "sm_90a"), ("TPAR_SDPA", "hopper"), ("TPAR_GEMM", "ours")];
    let step = |env: &[(&str, &str)]| {
        let model = ["--layers", "1", "--hidden", "256", "--heads", "4", "--kv-heads", "2"];
        let shape = ["--intermediate", "256", "--seq", "128", "--batch", "1", "--dtype", "bf16"];
        let rest = ["--steps", "1", "--device", "cuda", "--fuse-proj", "--fuse-residual"];
        final_bits("hopper", run_with(env, &[&model[..], &shape, &rest].concat()))
    };
    assert_eq!(step(&[&hopper[..], &[RACE]].concat()), step(&hopper), "the Hopper kernels");
}

/// `TPAR_CUDA_PROFILE=1` on the emulator lists the step's kernels (calls per kernel,
/// the emulator's time): at least the launches the steps' work counts saw, the
/// embedding's gradient through the device-sorted CSR (deterministic: no f32 atomics),
/// and a header that says the times are the emulator's.
#[test]
fn the_emulated_profile_lists_the_steps_kernels() {
    let args = ["--world", "1", "--dp", "1", "--tp", "1", "--steps", "2", "--device", "cuda"];
    let (stdout, stderr) = {
        let model = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2"];
        let shape = ["--intermediate", "64", "--seq", "16", "--batch", "2"];
        run_with(&[("TPAR_CUDA_PROFILE", "1")], &[&model[..], &shape, &args].concat())
    };
    let all = format!("{stdout}\n{stderr}");
    let head = all
        .lines()
        .find(|l| l.starts_with("CPU emulator time by kernel (TPAR_CUDA_PROFILE): "))
        .unwrap_or_else(|| panic!("no emulator profile:\n{all}"));
    let launches: u64 =
        head.split(": ").nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
    let work = all.lines().find(|l| l.starts_with("work:")).unwrap_or_else(|| panic!("{all}"));
    let kernels: u64 = work
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("kernels="))
        .unwrap()
        .split(',')
        .map(|v| v.parse::<u64>().unwrap())
        .sum();
    assert!(launches >= kernels, "{launches} profiled launches, {kernels} in the steps:\n{all}");
    let calls = |name: &str| -> u64 {
        all.lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(name)).then(|| w.next()?.parse().ok()).flatten()
            })
            .unwrap_or(0)
    };
    assert_eq!(calls("tpar_embedding_bwd_csr_f32"), 2, "one sorted gradient a step:\n{all}");
    assert!(calls("tpar_embedding_sort_scatter") >= 2, "{all}");
    assert_eq!(calls("tpar_embedding_bwd_atomic_f32"), 0, "{all}");
}

/// `--deterministic` (`use_deterministic_algorithms`): the attention backward's dQ,
/// which every key block adds with f32 atomics, is summed in key-block order whatever
/// order the device runs blocks in. With the emulator running blocks in an order drawn
/// from its seed (`TPAR_EMU_BLOCK_ORDER=shuffled`, as a GPU runs them in any order), a
/// default step's loss bits change, and a deterministic step's are the grid order's.
#[test]
fn deterministic_steps_do_not_depend_on_the_block_order() {
    let bits = |order: &str, deterministic: bool| {
        let model = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2"];
        // Four key blocks of 64: dQ sums the parts of several blocks.
        let shape = ["--intermediate", "256", "--seq", "256", "--batch", "2"];
        let mut args = vec!["--world", "1", "--dp", "1", "--tp", "1", "--steps", "2"];
        args.extend(["--device", "cuda"]);
        if deterministic {
            args.push("--deterministic");
        }
        let env = [("TPAR_EMU_BLOCK_ORDER", order)];
        let what = format!("{order} deterministic {deterministic}");
        final_bits(&what, run_with(&env, &[&model[..], &shape, &args].concat()))
    };
    let grid = bits("grid", false);
    assert_ne!(bits("shuffled", false), grid, "the default step depends on the block order");
    assert_eq!(bits("shuffled", true), grid, "deterministic, shuffled blocks");
    assert_eq!(bits("grid", true), grid, "deterministic, the grid's order");
}
