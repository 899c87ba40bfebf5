//! A training run's per-step figures, written off the training thread: as JSON lines
//! (one object per step with every field of [`StepMetrics`]) and as TensorBoard event
//! files (one scalar per figure and step).
//!
//! [`MetricsLogger::start`] creates the files on the calling thread (a path that cannot
//! be written fails there, before training), then hands them to a writer thread fed by a
//! channel: [`MetricsLogger::log`] only sends, so writing never stalls a step. A write
//! error stops that file's writing and is reported once on stderr, by
//! [`MetricsLogger::error`] and by [`MetricsLogger::finish`]; it never panics.
//!
//! ```no_run
//! use tpar_data::{MetricsConfig, MetricsLogger, StepMetrics};
//! let config = MetricsConfig {
//!     jsonl: Some("metrics.jsonl".into()),
//!     tensorboard: Some("runs/one".into()),
//! };
//! let logger = MetricsLogger::start(&config)?;
//! logger.log(StepMetrics { step: 1, loss: 5.6, lr: 1e-4, ..Default::default() });
//! logger.finish()?;
//! # Ok::<(), tpar_data::MetricsError>(())
//! ```

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

/// Errors of the metrics writers, naming the file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    /// A file or directory could not be created.
    #[error("metrics: cannot create {path}: {why}")]
    Create {
        /// The path.
        path: String,
        /// The reason, as the file system gave it.
        why: String,
    },
    /// A record could not be written (the file's writing stopped there).
    #[error("metrics: cannot write {path}: {why}")]
    Write {
        /// The path.
        path: String,
        /// The reason, as the file system gave it.
        why: String,
    },
    /// The writer thread could not be started, or ended abnormally.
    #[error("metrics: writer thread: {why}")]
    Thread {
        /// What happened.
        why: String,
    },
}

/// The figures of one optimizer step. A figure a step did not measure is NaN (written as
/// `null` in JSON); `peak_device_bytes` is `None` on the host.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct StepMetrics {
    /// The step, counted from 1 (the number of optimizer steps taken).
    pub step: u64,
    /// Seconds since the Unix epoch when the step ended (0: stamped by
    /// [`MetricsLogger::log`]).
    pub wall_time: f64,
    /// The training loss (averaged over data-parallel ranks).
    pub loss: f64,
    /// The learning rate the step ended with (the schedule's next).
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens (not padding) the step trained on, over all data-parallel ranks.
    pub tokens: u64,
    /// `tokens / step_time_s`.
    pub tokens_per_s: f64,
    /// The step's wall-clock seconds.
    pub step_time_s: f64,
    /// Peak bytes allocated on the host by the logging rank since training began.
    pub peak_host_bytes: u64,
    /// Peak device bytes of the logging rank, where measured.
    pub peak_device_bytes: Option<u64>,
}

impl StepMetrics {
    /// The TensorBoard scalars of this step: `loss`, `lr`, `grad_norm`, `tokens_per_s`,
    /// `step_time_s`, `memory/peak_host_mib` and, when measured, `memory/peak_device_mib`.
    pub fn scalars(&self) -> Vec<(&'static str, f32)> {
        const MIB: f64 = (1u64 << 20) as f64;
        let mut v = vec![
            ("loss", self.loss as f32),
            ("lr", self.lr as f32),
            ("grad_norm", self.grad_norm as f32),
            ("tokens_per_s", self.tokens_per_s as f32),
            ("step_time_s", self.step_time_s as f32),
            ("memory/peak_host_mib", (self.peak_host_bytes as f64 / MIB) as f32),
        ];
        if let Some(d) = self.peak_device_bytes {
            v.push(("memory/peak_device_mib", (d as f64 / MIB) as f32));
        }
        v
    }
}

/// Where a run's metrics go; both are optional.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsConfig {
    /// A JSON-lines file (created or truncated).
    pub jsonl: Option<PathBuf>,
    /// A directory (created if missing) for one new TensorBoard event file,
    /// `events.out.tfevents.<unix seconds>.<host>` (`.1`, `.2`, ... appended if taken).
    pub tensorboard: Option<PathBuf>,
}

impl MetricsConfig {
    /// Whether any output is asked for.
    pub fn is_enabled(&self) -> bool {
        self.jsonl.is_some() || self.tensorboard.is_some()
    }
}

/// One output file of the writer thread.
struct Sink {
    path: PathBuf,
    out: BufWriter<File>,
    kind: SinkKind,
    /// Stopped after a write error.
    failed: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SinkKind {
    Jsonl,
    Events,
}

impl Sink {
    fn write(&mut self, m: &StepMetrics) -> std::io::Result<()> {
        match self.kind {
            SinkKind::Jsonl => {
                let line = serde_json::to_string(m).map_err(std::io::Error::other)?;
                self.out.write_all(line.as_bytes())?;
                self.out.write_all(b"\n")
            }
            SinkKind::Events => {
                let event = tensorboard::scalars_event(m.wall_time, m.step as i64, &m.scalars());
                self.out.write_all(&tensorboard::record(&event))
            }
        }
    }
}

/// The writer thread of a run's metrics (see the module docs).
pub struct MetricsLogger {
    tx: Option<Sender<StepMetrics>>,
    thread: Option<JoinHandle<()>>,
    error: Arc<Mutex<Option<MetricsError>>>,
    paths: Vec<PathBuf>,
}

impl std::fmt::Debug for MetricsLogger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsLogger").field("paths", &self.paths).finish_non_exhaustive()
    }
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn create_err(path: &Path, e: impl std::fmt::Display) -> MetricsError {
    MetricsError::Create { path: path.display().to_string(), why: e.to_string() }
}

/// This machine's name, for the event file's name (`localhost` when unknown).
fn host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let name: String = name
        .trim()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
        .collect();
    if name.is_empty() {
        "localhost".to_string()
    } else {
        name
    }
}

/// Creates a new event file in `dir` and writes its first record (the file version).
fn create_event_file(dir: &Path) -> Result<(PathBuf, File), MetricsError> {
    std::fs::create_dir_all(dir).map_err(|e| create_err(dir, e))?;
    let wall = now();
    let base = format!("events.out.tfevents.{}.{}", wall as u64, host_name());
    for n in 0u32.. {
        let name = if n == 0 { base.clone() } else { format!("{base}.{n}") };
        let path = dir.join(name);
        match File::options().write(true).create_new(true).open(&path) {
            Ok(mut f) => {
                let first = tensorboard::record(&tensorboard::version_event(wall));
                f.write_all(&first).map_err(|e| create_err(&path, e))?;
                return Ok((path, f));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(create_err(&path, e)),
        }
    }
    Err(create_err(dir, "no free event file name"))
}

impl MetricsLogger {
    /// Creates the files of `config` and starts the writer thread.
    pub fn start(config: &MetricsConfig) -> Result<MetricsLogger, MetricsError> {
        let mut sinks = Vec::new();
        if let Some(path) = &config.jsonl {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|e| {
                    create_err(path, format!("its folder {}: {e}", parent.display()))
                })?;
            }
            let f = File::create(path).map_err(|e| create_err(path, e))?;
            sinks.push(Sink {
                path: path.clone(),
                out: BufWriter::new(f),
                kind: SinkKind::Jsonl,
                failed: false,
            });
        }
        if let Some(dir) = &config.tensorboard {
            let (path, f) = create_event_file(dir)?;
            sinks.push(Sink {
                path,
                out: BufWriter::new(f),
                kind: SinkKind::Events,
                failed: false,
            });
        }
        let paths = sinks.iter().map(|s| s.path.clone()).collect();
        let error = Arc::new(Mutex::new(None));
        let (tx, rx) = channel();
        let err = Arc::clone(&error);
        let thread = std::thread::Builder::new()
            .name("tpar-metrics".into())
            .spawn(move || write_loop(rx, sinks, &err))
            .map_err(|e| MetricsError::Thread { why: e.to_string() })?;
        Ok(MetricsLogger { tx: Some(tx), thread: Some(thread), error, paths })
    }

    /// The files written: the JSON-lines file, then the event file.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Queues one step's figures for the writer thread (stamping `wall_time` when it is
    /// 0); returns at once.
    pub fn log(&self, mut metrics: StepMetrics) {
        if metrics.wall_time == 0.0 {
            metrics.wall_time = now();
        }
        if let Some(tx) = &self.tx {
            // A writer that has ended has reported why; the step goes on.
            let _ = tx.send(metrics);
        }
    }

    /// The first write error so far, if any.
    pub fn error(&self) -> Option<MetricsError> {
        self.error.lock().map_or_else(|p| p.into_inner().clone(), |g| g.clone())
    }

    /// Writes what is queued, closes the files and returns the first error, if any.
    pub fn finish(mut self) -> Result<(), MetricsError> {
        self.close()
    }

    fn close(&mut self) -> Result<(), MetricsError> {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                return Err(MetricsError::Thread { why: "the writer thread panicked".into() });
            }
        }
        match self.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for MetricsLogger {
    fn drop(&mut self) {
        // Errors were reported on stderr when they happened.
        let _ = self.close();
    }
}

fn write_loop(
    rx: Receiver<StepMetrics>,
    mut sinks: Vec<Sink>,
    error: &Mutex<Option<MetricsError>>,
) {
    let report = |sink: &mut Sink, e: std::io::Error| {
        sink.failed = true;
        let e = MetricsError::Write { path: sink.path.display().to_string(), why: e.to_string() };
        eprintln!("{e} (no more records go to it)");
        let mut slot = error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
    };
    while let Ok(m) = rx.recv() {
        // Everything queued, then one flush per file (records reach the files while the
        // run goes on, without a flush per record when steps come fast).
        let mut batch = vec![m];
        batch.extend(rx.try_iter());
        for sink in &mut sinks {
            if sink.failed {
                continue;
            }
            let r = batch.iter().try_for_each(|m| sink.write(m)).and_then(|()| sink.out.flush());
            if let Err(e) = r {
                report(sink, e);
            }
        }
    }
}

/// TensorBoard's event-file format, encoded by hand: TFRecord framing (length, masked
/// CRC-32C of the length, data, masked CRC-32C of the data) around `tensorflow.Event`
/// protocol buffers, of which only these fields are written:
///
/// ```text
/// Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
/// Summary { repeated Value value = 1; }
/// Value   { string tag = 1; float simple_value = 2; }
/// ```
pub mod tensorboard {
    const CASTAGNOLI: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

    /// The version string of the first event of a file.
    pub const FILE_VERSION: &str = "brain.Event:2";

    /// TFRecord's masked CRC-32C of `data`.
    pub fn masked_crc32c(data: &[u8]) -> u32 {
        let c = CASTAGNOLI.checksum(data);
        c.rotate_right(15).wrapping_add(0xa282_ead8)
    }

    /// One TFRecord: `u64` length (little-endian), its masked CRC, the data, its masked
    /// CRC.
    pub fn record(data: &[u8]) -> Vec<u8> {
        let len = (data.len() as u64).to_le_bytes();
        let mut out = Vec::with_capacity(data.len() + 16);
        out.extend_from_slice(&len);
        out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        out
    }

    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// A field key: field number and wire type (0 varint, 1 fixed64, 2 bytes, 5 fixed32).
    fn key(out: &mut Vec<u8>, field: u64, wire: u64) {
        varint(out, (field << 3) | wire);
    }

    fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
        key(out, field, 2);
        varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    fn event_head(wall_time: f64, step: i64) -> Vec<u8> {
        let mut e = Vec::new();
        key(&mut e, 1, 1);
        e.extend_from_slice(&wall_time.to_le_bytes());
        if step != 0 {
            key(&mut e, 2, 0);
            // int64: negative values as their two's-complement bits, as protobuf does.
            varint(&mut e, step as u64);
        }
        e
    }

    /// The first event of a file: `wall_time` and [`FILE_VERSION`].
    pub fn version_event(wall_time: f64) -> Vec<u8> {
        let mut e = event_head(wall_time, 0);
        bytes_field(&mut e, 3, FILE_VERSION.as_bytes());
        e
    }

    /// An event holding one scalar summary value per `(tag, value)` at `step`.
    pub fn scalars_event(wall_time: f64, step: i64, scalars: &[(&str, f32)]) -> Vec<u8> {
        let mut summary = Vec::new();
        for (tag, v) in scalars {
            let mut value = Vec::new();
            bytes_field(&mut value, 1, tag.as_bytes());
            key(&mut value, 2, 5);
            value.extend_from_slice(&v.to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        let mut e = event_head(wall_time, step);
        bytes_field(&mut e, 5, &summary);
        e
    }
}
