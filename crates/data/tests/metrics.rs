//! The metrics writers: the TensorBoard event file is read back by a reader written here
//! (its own bitwise CRC-32C, its own protobuf decoding), every record's length and data
//! CRC checked, and its scalar tags, values and steps compared with what was logged; the
//! JSON lines hold one object per step with every field; a file that cannot be created or
//! written is a typed error, never a panic.

use std::path::{Path, PathBuf};

use tpar_data::metrics::tensorboard;
use tpar_data::{MetricsConfig, MetricsError, MetricsLogger, StepMetrics};

#[path = "../../../tests/common/tfevents.rs"]
mod tfevents;
use tfevents::{crc32c, event, masked, records, Event};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-metrics-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn step(i: u64) -> StepMetrics {
    StepMetrics {
        step: i,
        wall_time: 0.0,
        loss: 5.0 / i as f64,
        lr: 1e-3 * i as f64,
        grad_norm: 0.5 + i as f64,
        tokens: 100 * i,
        tokens_per_s: 1000.0 * i as f64,
        step_time_s: 0.1 * i as f64,
        peak_host_bytes: (3 << 20) * i,
        peak_device_bytes: None,
    }
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

#[test]
fn crc_and_framing_match_an_independent_crc32c() {
    // The CRC-32C check value.
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    for data in [&b""[..], b"a", b"tensorboard event bytes"] {
        assert_eq!(tensorboard::masked_crc32c(data), masked(data));
        assert_eq!(records(&tensorboard::record(data)), vec![data.to_vec()]);
    }
}

#[test]
fn event_file_and_json_lines_hold_every_step() {
    let dir = tmp("both");
    let config = MetricsConfig {
        jsonl: Some(dir.join("sub/metrics.jsonl")),
        tensorboard: Some(dir.join("tb")),
    };
    let logger = MetricsLogger::start(&config).unwrap();
    assert_eq!(logger.paths().len(), 2);
    for i in 1..=5 {
        logger.log(step(i));
    }
    let mut last = step(6);
    last.peak_device_bytes = Some(7 << 20);
    last.loss = f64::NAN;
    logger.log(last);
    logger.finish().unwrap();

    let files = event_files(&dir.join("tb"));
    assert_eq!(files.len(), 1);
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let events: Vec<Event> =
        records(&std::fs::read(&files[0]).unwrap()).iter().map(|r| event(r)).collect();
    assert_eq!(events.len(), 7);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events[0].scalars.is_empty());
    for (i, e) in events[1..].iter().enumerate() {
        let want = step(i as u64 + 1);
        assert_eq!(e.step, want.step as i64);
        assert!(e.wall_time > 1.0e9, "wall time {}", e.wall_time);
        let mut tags: Vec<&str> = e.scalars.keys().map(String::as_str).collect();
        tags.sort();
        let mut expected =
            vec!["grad_norm", "loss", "lr", "memory/peak_host_mib", "step_time_s", "tokens_per_s"];
        if i == 5 {
            expected.push("memory/peak_device_mib");
            expected.sort();
            assert!(e.scalars["loss"].is_nan());
            assert_eq!(e.scalars["memory/peak_device_mib"], 7.0);
        } else {
            assert_eq!(e.scalars["loss"], want.loss as f32);
        }
        assert_eq!(tags, expected);
        assert_eq!(e.scalars["lr"], want.lr as f32);
        assert_eq!(e.scalars["grad_norm"], want.grad_norm as f32);
        assert_eq!(e.scalars["tokens_per_s"], want.tokens_per_s as f32);
        assert_eq!(e.scalars["step_time_s"], want.step_time_s as f32);
        assert_eq!(e.scalars["memory/peak_host_mib"], 3.0 * want.step as f32);
    }

    let text = std::fs::read_to_string(dir.join("sub/metrics.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6);
    let keys = [
        "step",
        "wall_time",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "tokens_per_s",
        "step_time_s",
        "peak_host_bytes",
        "peak_device_bytes",
    ];
    for (i, line) in lines.iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let obj = v.as_object().unwrap();
        let mut got: Vec<&str> = obj.keys().map(String::as_str).collect();
        got.sort();
        let mut want_keys = keys.to_vec();
        want_keys.sort();
        assert_eq!(got, want_keys, "line {}", i + 1);
        let want = step(i as u64 + 1);
        assert_eq!(obj["step"].as_u64(), Some(want.step));
        assert_eq!(obj["tokens"].as_u64(), Some(want.tokens));
        assert_eq!(obj["lr"].as_f64(), Some(want.lr));
        assert_eq!(obj["peak_host_bytes"].as_u64(), Some(want.peak_host_bytes));
        if i < 5 {
            assert_eq!(obj["loss"].as_f64(), Some(want.loss));
            assert!(obj["peak_device_bytes"].is_null());
        } else {
            // NaN has no JSON form: null.
            assert!(obj["loss"].is_null());
            assert_eq!(obj["peak_device_bytes"].as_u64(), Some(7 << 20));
        }
    }
    // A second logger in the same directory gets a new event file.
    MetricsLogger::start(&MetricsConfig { jsonl: None, tensorboard: Some(dir.join("tb")) })
        .unwrap()
        .finish()
        .unwrap();
    assert_eq!(event_files(&dir.join("tb")).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unwritable_files_are_typed_errors() {
    let dir = tmp("bad");
    let file = dir.join("a_file");
    std::fs::write(&file, b"x").unwrap();
    // A directory whose parent is a file.
    let e =
        MetricsLogger::start(&MetricsConfig { jsonl: None, tensorboard: Some(file.join("tb")) })
            .unwrap_err();
    assert!(matches!(&e, MetricsError::Create { path, .. } if path.contains("a_file")), "{e}");
    let e = MetricsLogger::start(&MetricsConfig { jsonl: Some(dir.clone()), tensorboard: None })
        .unwrap_err();
    assert!(matches!(e, MetricsError::Create { .. }), "{e}");
    // A device that is always full: the writes fail on the writer thread; logging goes
    // on and the error comes back from finish.
    let full = Path::new("/dev/full");
    if full.exists() {
        let logger =
            MetricsLogger::start(&MetricsConfig { jsonl: Some(full.into()), tensorboard: None })
                .unwrap();
        for i in 1..=3 {
            logger.log(step(i));
        }
        let e = logger.finish().unwrap_err();
        assert!(matches!(&e, MetricsError::Write { path, .. } if path == "/dev/full"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
