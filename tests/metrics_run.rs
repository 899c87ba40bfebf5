//! The trainers' `--metrics` and `--tensorboard` (run as processes, as a user runs
//! them): a `llama_2d` run (dp 2 x tp 2, training on the parquet golden documents) writes
//! one JSON line per step with every field and an event file whose records pass their
//! CRCs and hold each step's scalars; the last step's loss in both equals the summary's
//! `final_loss_bits` (the f32 of it in the event file), and the per-step losses equal the
//! logged lines. A pipeline run (`llama_pp`) logs from its last stage. On a CUDA device
//! (the emulator serving `cuda`) each step also records the device's peak bytes, at
//! least the parameters' and gradients' bytes.

mod common;

use std::path::{Path, PathBuf};

use common::examples::run_example;

#[path = "common/tfevents.rs"]
mod tfevents;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-metrics-run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const FIELDS: [&str; 10] = [
    "grad_norm",
    "loss",
    "lr",
    "peak_device_bytes",
    "peak_host_bytes",
    "step",
    "step_time_s",
    "tokens",
    "tokens_per_s",
    "wall_time",
];

/// The JSON lines of `path`, each checked to hold every field, with steps 1, 2, ...
fn json_lines(
    path: &Path,
    steps: usize,
    device: bool,
) -> Vec<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(path).unwrap();
    let lines: Vec<_> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap().as_object().unwrap().clone())
        .collect();
    assert_eq!(lines.len(), steps, "{text}");
    for (i, obj) in lines.iter().enumerate() {
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, FIELDS, "line {}", i + 1);
        assert_eq!(obj["step"].as_u64(), Some(i as u64 + 1));
        for k in ["loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"] {
            let v = obj[k].as_f64().unwrap_or_else(|| panic!("line {}: {k} {:?}", i + 1, obj[k]));
            assert!(v.is_finite() && v > 0.0, "line {}: {k} = {v}", i + 1);
        }
        assert!(obj["tokens"].as_u64().unwrap() > 0);
        assert!(obj["peak_host_bytes"].as_u64().unwrap() > 0);
        // A CPU run measures no device memory; a device run does.
        if !device {
            assert!(obj["peak_device_bytes"].is_null());
        }
    }
    lines
}

/// `key=VALUE` of the summary line.
fn summary(out: &str, key: &str) -> String {
    let line = out.lines().find(|l| l.starts_with("summary:")).expect("a summary line");
    let v = line.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{key}=")));
    v.unwrap_or_else(|| panic!("{key} in {line}")).to_string()
}

fn event_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    files[0].clone()
}

/// The event file holds the version record, then one event per step with every tag, and
/// the scalars equal the JSON lines' figures (as f32).
fn check_events(dir: &Path, lines: &[serde_json::Map<String, serde_json::Value>]) {
    let events = tfevents::read_events(&event_file(dir));
    assert_eq!(events.len(), lines.len() + 1);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    let tags = ["grad_norm", "loss", "lr", "memory/peak_host_mib", "step_time_s", "tokens_per_s"];
    for (e, obj) in events[1..].iter().zip(lines) {
        assert_eq!(e.step as u64, obj["step"].as_u64().unwrap());
        let got: Vec<&str> = e.scalars.keys().map(String::as_str).collect();
        assert_eq!(got, tags, "step {}", e.step);
        for k in ["loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"] {
            assert_eq!(e.scalars[k], obj[k].as_f64().unwrap() as f32, "step {} {k}", e.step);
        }
        let mib = obj["peak_host_bytes"].as_u64().unwrap() as f64 / (1 << 20) as f64;
        assert_eq!(e.scalars["memory/peak_host_mib"], mib as f32);
    }
}

#[test]
fn llama_2d_writes_json_lines_and_tensorboard_events() {
    let dir = tmp("2d");
    let jsonl = dir.join("m.jsonl");
    let tb = dir.join("tb");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/parquet/docs.parquet");
    let args = [
        "--steps",
        "4",
        "--log-every",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--layers",
        "1",
        "--data",
        data.to_str().unwrap(),
        "--metrics",
        jsonl.to_str().unwrap(),
        "--tensorboard",
        tb.to_str().unwrap(),
    ];
    let Some((code, out, err)) = run_example("llama_2d", &args) else {
        eprintln!("llama_2d is not built: skipped");
        return;
    };
    assert_eq!(code, 0, "{out}\n{err}");
    let lines = json_lines(&jsonl, 4, false);
    // The figures are the run's: the last loss is the summary's, bit for bit, and each
    // step's loss and learning rate are those of its logged line.
    let bits = u64::from_str_radix(&summary(&out, "final_loss_bits"), 16).unwrap();
    assert_eq!(lines[3]["loss"].as_f64().unwrap().to_bits(), bits);
    for obj in &lines {
        let step = obj["step"].as_u64().unwrap();
        let logged = out
            .lines()
            .find(|l| l.contains(&format!(" step {step:>4}/4 ")))
            .unwrap_or_else(|| panic!("no log line of step {step}:\n{out}"));
        let loss = format!(
            "loss {:.4} lr {:.2e}",
            obj["loss"].as_f64().unwrap(),
            obj["lr"].as_f64().unwrap()
        );
        assert!(logged.contains(&loss), "step {step}: {logged} vs {loss}");
        // The global batch: 2 dp ranks x 2 sequences of at most 32 tokens.
        assert!(obj["tokens"].as_u64().unwrap() <= 2 * 2 * 32);
    }
    check_events(&tb, &lines);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn llama_pp_logs_from_the_last_stage() {
    let dir = tmp("pp");
    let jsonl = dir.join("m.jsonl");
    let tb = dir.join("tb");
    let args = [
        "--steps",
        "3",
        "--metrics",
        jsonl.to_str().unwrap(),
        "--tensorboard",
        tb.to_str().unwrap(),
    ];
    let Some((code, out, err)) = run_example("llama_pp", &args) else {
        eprintln!("llama_pp is not built: skipped");
        return;
    };
    assert_eq!(code, 0, "{out}\n{err}");
    let lines = json_lines(&jsonl, 3, false);
    let bits = u64::from_str_radix(&summary(&out, "final_loss_bits"), 16).unwrap();
    assert_eq!(lines[2]["loss"].as_f64().unwrap().to_bits(), bits);
    check_events(&tb, &lines);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unwritable_metrics_path_fails_before_training() {
    let dir = tmp("bad");
    let file = dir.join("a_file");
    std::fs::write(&file, b"x").unwrap();
    let tb = file.join("tb");
    let args = ["--steps", "2", "--tensorboard", tb.to_str().unwrap()];
    let Some((code, out, err)) = run_example("llama_2d", &args) else {
        return;
    };
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("metrics: cannot create") && err.contains("a_file"), "{err}");
    assert!(!out.contains("summary:"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_device_run_records_the_device_peak() {
    let Some(exe) = common::examples::example("llama_2d") else {
        return;
    };
    let dir = tmp("device");
    let jsonl = dir.join("m.jsonl");
    let tb = dir.join("tb");
    let out = std::process::Command::new(exe)
        .env("TPAR_CUDA", "emulator")
        .args(["--world", "1", "--dp", "1", "--tp", "1", "--steps", "2", "--layers", "1"])
        .args(["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64"])
        .args(["--seq", "16", "--batch", "2", "--device", "cuda", "--no-fsdp"])
        .args(["--metrics", jsonl.to_str().unwrap(), "--tensorboard", tb.to_str().unwrap()])
        .output()
        .unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let lines = json_lines(&jsonl, 2, true);
    // Parameters and their gradients (f32) stay on the device through each step:
    // the embedding and the head (259 x 32 each), one layer's four attention and three
    // MLP matrices, and the norms.
    let (v, h, kv, i) = (259u64, 32u64, 16u64, 64u64);
    let params = 2 * v * h + (2 * h * h + 2 * h * kv) + 3 * h * i + 3 * h;
    for obj in &lines {
        let peak = obj["peak_device_bytes"].as_u64().expect("a device peak");
        assert!(peak >= 2 * params * 4, "peak {peak} < parameters and gradients");
    }
    let events = tfevents::read_events(&event_file(&tb));
    for (e, obj) in events[1..].iter().zip(&lines) {
        let mib = obj["peak_device_bytes"].as_u64().unwrap() as f64 / (1 << 20) as f64;
        assert_eq!(e.scalars["memory/peak_device_mib"], mib as f32);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
