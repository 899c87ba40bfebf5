//! The metrics writers: the TensorBoard event file is read back by a reader written here
//! (its own bitwise CRC-32C, its own protobuf decoding), every record's length and data
//! CRC checked, and its scalar tags, values and steps compared with what was logged; the
//! JSON lines hold one object per step with every field; a file that cannot be created or
//! written is a typed error, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tpar_data::metrics::tensorboard;
use tpar_data::{MetricsConfig, MetricsError, MetricsLogger, StepMetrics};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-metrics-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// CRC-32C, bit by bit (reflected polynomial 0x82F63B78).
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

fn masked(data: &[u8]) -> u32 {
    let c = crc32c(data);
    ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8)
}

/// The records of a TFRecord file, each CRC checked.
fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(len_crc, masked(len_bytes), "length CRC of the record at byte {at}");
        let data = &bytes[at + 12..at + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, masked(data), "data CRC of the record at byte {at}");
        out.push(data.to_vec());
        at += 16 + len;
    }
    assert_eq!(at, bytes.len());
    out
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// Protobuf fields: (field number, wire type, payload as bytes or the varint's value).
enum Field {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(Vec<u8>),
}

fn fields(b: &[u8]) -> Vec<(u64, Field)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at);
        let f = match key & 7 {
            0 => Field::Varint(varint(b, &mut at)),
            1 => {
                at += 8;
                Field::Fixed64(b[at - 8..at].try_into().unwrap())
            }
            2 => {
                let n = varint(b, &mut at) as usize;
                at += n;
                Field::Bytes(b[at - n..at].to_vec())
            }
            5 => {
                at += 4;
                Field::Fixed32(b[at - 4..at].try_into().unwrap())
            }
            w => panic!("wire type {w}"),
        };
        out.push((key >> 3, f));
    }
    out
}

/// A decoded Event: wall time, step, file version, scalars by tag.
#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    scalars: BTreeMap<String, f32>,
}

fn event(b: &[u8]) -> Event {
    let mut e = Event::default();
    for (n, f) in fields(b) {
        match (n, f) {
            (1, Field::Fixed64(x)) => e.wall_time = f64::from_le_bytes(x),
            (2, Field::Varint(x)) => e.step = x as i64,
            (3, Field::Bytes(s)) => e.file_version = Some(String::from_utf8(s).unwrap()),
            (5, Field::Bytes(summary)) => {
                for (n, v) in fields(&summary) {
                    let (1, Field::Bytes(value)) = (n, v) else { panic!("Summary field {n}") };
                    let (mut tag, mut val) = (None, None);
                    for (n, f) in fields(&value) {
                        match (n, f) {
                            (1, Field::Bytes(t)) => tag = Some(String::from_utf8(t).unwrap()),
                            (2, Field::Fixed32(x)) => val = Some(f32::from_le_bytes(x)),
                            (n, _) => panic!("Value field {n}"),
                        }
                    }
                    e.scalars.insert(tag.unwrap(), val.unwrap());
                }
            }
            (n, _) => panic!("Event field {n}"),
        }
    }
    e
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
