//! `llama_2d --cuda-graph` on the emulated `cuda:0`: one eager warm-up step, one
//! captured step, replays after it; the eager run's losses bit for bit, no host round
//! trip on quiet steps, the same kernels per step as the eager run from a handful of
//! host calls, and the configurations it does not support refused by name.

use std::path::PathBuf;
use std::process::Command;

/// The `llama_2d` example binary `cargo test` built beside this test.
fn example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples").join("llama_2d");
    p.exists().then_some(p)
}

/// One rank on the emulated `cuda:0`.
const WORLD1: [&str; 8] = ["--world", "1", "--dp", "1", "--tp", "1", "--device", "cuda"];

/// `llama_2d` on a tiny model with `args` (the emulator serving `cuda`): exit success,
/// stdout, stderr.
fn run(args: &[&str]) -> (bool, String, String) {
    let exe = example().expect("llama_2d example (built by `cargo test`)");
    let out = Command::new(exe)
        .env("TPAR_CUDA", "emulator")
        .args(["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2"])
        .args(["--intermediate", "64", "--seq", "16", "--batch", "2", "--lr", "3e-3"])
        .args(args)
        .output()
        .expect("run llama_2d");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success(), stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The value of `key=` on the line starting with `prefix`.
fn value<'a>(out: &'a str, prefix: &str, key: &str) -> &'a str {
    let line = out.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{out}"));
    let v = line.split_whitespace().find_map(|kv| kv.strip_prefix(key));
    v.unwrap_or_else(|| panic!("no {key} in {line}"))
}

fn list(out: &str, prefix: &str, key: &str) -> Vec<String> {
    value(out, prefix, key).split(',').map(String::from).collect()
}

fn nums(out: &str, key: &str) -> Vec<u64> {
    list(out, "work:", key).iter().map(|v| v.parse().unwrap()).collect()
}

/// Each step's logged loss (`epoch ... loss X` lines).
fn losses(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("epoch"))
        .filter_map(|l| l.split("loss ").nth(1)?.split(' ').next().map(String::from))
        .collect()
}

#[test]
fn graph_replays_train_as_the_eager_steps() {
    for mode in [&["--no-fsdp"][..], &[]] {
        let steps = ["--steps", "5", "--log-every", "2"];
        let (ok, eager, err) = run(&[&WORLD1, mode, &steps[..]].concat());
        assert!(ok, "{mode:?} eager:\n{eager}\n{err}");
        let (ok, graph, err) = run(&[&WORLD1, mode, &steps[..], &["--cuda-graph"]].concat());
        assert!(ok, "{mode:?} --cuda-graph:\n{graph}\n{err}");
        let bits = |o: &str| value(o, "summary:", "final_loss_bits=").to_string();
        assert_eq!(bits(&graph), bits(&eager), "{mode:?}: final loss bits");
        assert_eq!(losses(&graph), losses(&eager), "{mode:?}: logged losses");
        assert_eq!(losses(&graph).len(), 3, "{graph}");
        assert_eq!(value(&graph, "summary:", "cuda_graph="), "1");
        assert_eq!(value(&eager, "summary:", "cuda_graph="), "0");
        assert_eq!(
            list(&graph, "work:", "modes="),
            ["warmup", "captured", "replayed", "replayed", "replayed"],
            "{mode:?}"
        );
        // Every step runs the eager step's kernels; a replayed step issues them from a
        // handful of host calls (the batch's three uploads, the optimizer's coefficients,
        // the replay, and on logging steps the read-back) instead of one call each.
        let (ek, gk) = (nums(&eager, "kernels="), nums(&graph, "kernels="));
        assert_eq!(gk, ek, "{mode:?}: kernels per step");
        let (ec, gc) = (nums(&eager, "host_calls="), nums(&graph, "host_calls="));
        for s in 2..5 {
            assert!(gc[s] <= 8 && ek[s] > 100 && ec[s] > ek[s], "{mode:?} step {s}: {gc:?} {ec:?}");
        }
        let quiet = value(&graph, "summary:", "launches_per_step=").parse::<u64>().unwrap();
        assert_eq!(quiet, 5, "{mode:?}: host calls of a quiet replayed step");
    }
}

/// No host round trip on a step that does not log, one on a step that does, with the
/// graph replaying (steps 1 and 4 log, 2 is captured, 3 replayed).
#[test]
fn replayed_steps_read_the_host_only_to_log() {
    let args = ["--no-fsdp", "--steps", "4", "--log-every", "10", "--cuda-graph"];
    let (ok, out, err) = run(&[&WORLD1[..], &args].concat());
    assert!(ok, "{out}\n{err}");
    assert_eq!(value(&out, "device:", "round_trips_logging="), "1,1", "{out}");
    assert_eq!(value(&out, "device:", "round_trips_quiet="), "0,0", "{out}");
}

#[test]
fn unsupported_configurations_are_refused_by_name() {
    let w1 = ["--world", "1", "--dp", "1", "--tp", "1"];
    let cases: [(&[&str], &str); 4] = [
        (&["--world", "2", "--dp", "2", "--tp", "1", "--device", "cuda"], "a world of 2 ranks"),
        (&[&WORLD1[..], &["--zero1"]].concat(), "--zero1"),
        (&[&WORLD1[..], &["--nonfinite", "skip"]].concat(), "--nonfinite skip"),
        (&[&w1[..], &["--device", "cpu"]].concat(), "--device cpu"),
    ];
    for (args, what) in cases {
        let (ok, out, err) = run(&[args, &["--steps", "1", "--cuda-graph"]].concat());
        assert!(!ok, "{args:?} must be refused:\n{out}");
        assert!(err.contains("--cuda-graph does not support") && err.contains(what), "{err}");
    }
}
