//! The per-shape table behind `TPAR_GEMM=auto`: for each measured problem,
//! tpar's kernel's and the vendor library's throughput on one kind of device.
//!
//! `gpu_check --bench` measures both on every benchmarked shape, prints the
//! table and writes it with `--gemm-table PATH`; a trainer reads it back
//! through [`GEMM_TABLE_ENV`]. [`GemmTable::prefers_ours`] answers per
//! problem: tpar's kernel where the table measured it at least as fast as the
//! vendor library on the same kind of device, the vendor library everywhere
//! else (shapes never measured included).
//!
//! The text format, one record per line (`#` starts a comment):
//!
//! ```text
//! device (sm_90, NVIDIA H200)
//! gemm bf16>bf16 nt b1 8192x1024x1024 ours=512.3 cublaslt=640.0
//! ```
//!
//! ```
//! use tpar_kernels::cuda::ops::gemm_tune::{GemmKey, GemmTable};
//! use tpar_kernels::cuda::raw::gemm::GemmProblem;
//! use tpar_kernels::cuda::CudaDType::BF16;
//! use tpar_kernels::gemm::GemmShape;
//! let p = GemmProblem::new(GemmShape { trans_b: true, ..GemmShape::new(1, 64, 32, 16) }, BF16, BF16);
//! let mut t = GemmTable::new("(sm_90, NVIDIA H200)");
//! t.insert(GemmKey::of(&p), 410.0, 400.0);
//! let back = GemmTable::parse(&t.to_text())?;
//! assert!(back.prefers_ours("cuda:1 (sm_90, NVIDIA H200)", &p));
//! assert!(!back.prefers_ours("cuda:0 (sm_80, NVIDIA A100)", &p));
//! # Ok::<(), tpar_kernels::KernelError>(())
//! ```

use std::collections::HashMap;
use std::fmt;

use crate::cuda::raw::gemm::GemmProblem;
use crate::cuda::CudaDType;
use crate::util::bad;
use crate::Result;

/// Environment variable naming the tuning table file `TPAR_GEMM=auto` reads.
pub const GEMM_TABLE_ENV: &str = "TPAR_GEMM_TABLE";

const OP: &str = "gemm table";

/// What a table row is keyed by: the problem's sizes, layout and dtypes
/// (leading dimensions, batch strides and scales do not enter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmKey {
    /// Element type of A and B.
    pub dtype_in: CudaDType,
    /// Element type of C.
    pub dtype_out: CudaDType,
    /// A stored `[k, m]`.
    pub trans_a: bool,
    /// B stored `[n, k]`.
    pub trans_b: bool,
    /// Batch count.
    pub batch: usize,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
}

impl GemmKey {
    /// The key of problem `p`.
    pub fn of(p: &GemmProblem) -> GemmKey {
        let s = &p.shape;
        GemmKey {
            dtype_in: p.dtype_in,
            dtype_out: p.dtype_out,
            trans_a: s.trans_a,
            trans_b: s.trans_b,
            batch: s.batch,
            m: s.m,
            n: s.n,
            k: s.k,
        }
    }
}

impl fmt::Display for GemmKey {
    /// `bf16>bf16 nt b1 8192x1024x1024`: dtypes, layout (A then B, `t` when
    /// transposed), batch and m x n x k.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = |x: bool| if x { 't' } else { 'n' };
        write!(
            f,
            "{}>{} {}{} b{} {}x{}x{}",
            self.dtype_in.suffix(),
            self.dtype_out.suffix(),
            t(self.trans_a),
            t(self.trans_b),
            self.batch,
            self.m,
            self.n,
            self.k
        )
    }
}

/// Measured throughputs (any one unit, e.g. TFLOP/s) of one problem.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmRates {
    /// tpar's kernel.
    pub ours: f64,
    /// The vendor library (cuBLASLt).
    pub vendor: f64,
}

/// Throughputs per problem, measured on one kind of device.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmTable {
    device: String,
    rows: HashMap<GemmKey, GemmRates>,
}

/// The part of a `Launcher::describe` string that names the kind of device:
/// `(sm_90, NVIDIA H200)` of `cuda:0 (sm_90, NVIDIA H200)`, so a table
/// measured on one ordinal applies to every device of that kind.
pub fn device_kind(describe: &str) -> &str {
    let d = describe.trim();
    match d.split_once(' ') {
        Some((first, rest)) if first.starts_with("cuda:") => rest.trim(),
        _ => d,
    }
}

impl GemmTable {
    /// An empty table for the device described by `describe` (a
    /// `Launcher::describe` string or its [`device_kind`]).
    pub fn new(describe: &str) -> GemmTable {
        GemmTable { device: device_kind(describe).to_string(), rows: HashMap::new() }
    }

    /// The kind of device the rows were measured on.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Records (or replaces) a problem's throughputs.
    pub fn insert(&mut self, key: GemmKey, ours: f64, vendor: f64) {
        self.rows.insert(key, GemmRates { ours, vendor });
    }

    /// The throughputs recorded for `key`.
    pub fn get(&self, key: &GemmKey) -> Option<GemmRates> {
        self.rows.get(key).copied()
    }

    /// Number of problems recorded.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no problem is recorded.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Whether `TPAR_GEMM=auto` runs tpar's kernel for `p` on the device
    /// `describe`d: the table was measured on that kind of device and has
    /// `p`'s key with tpar's kernel at least as fast as the vendor library.
    pub fn prefers_ours(&self, describe: &str, p: &GemmProblem) -> bool {
        device_kind(describe) == self.device
            && self.get(&GemmKey::of(p)).is_some_and(|r| r.ours >= r.vendor)
    }

    /// The table as text, rows sorted ([`GemmTable::parse`] reads it back).
    pub fn to_text(&self) -> String {
        let mut rows: Vec<String> = self
            .rows
            .iter()
            .map(|(k, r)| format!("gemm {k} ours={} cublaslt={}\n", r.ours, r.vendor))
            .collect();
        rows.sort();
        format!("device {}\n{}", self.device, rows.concat())
    }

    /// Reads [`GemmTable::to_text`]'s format: one `device` line first, then
    /// `gemm` lines; blank lines and `#` comments are skipped. A malformed
    /// line is an error naming its number and what is wrong.
    pub fn parse(text: &str) -> Result<GemmTable> {
        let mut table: Option<GemmTable> = None;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let err = |what: &str| bad(OP, format!("gemm table line {}: {what}: {raw:?}", i + 1));
            if let Some(dev) = line.strip_prefix("device ") {
                if table.is_some() {
                    return Err(err("a second device line (one table per kind of device)"));
                }
                table = Some(GemmTable::new(dev.trim()));
                continue;
            }
            let Some(rest) = line.strip_prefix("gemm ") else {
                return Err(err("neither a `device` nor a `gemm` record"));
            };
            let Some(t) = table.as_mut() else {
                return Err(err("a gemm record before the device line"));
            };
            let (key, rates) = parse_row(rest).map_err(|w| err(&w))?;
            t.rows.insert(key, rates);
        }
        table.ok_or_else(|| bad(OP, "gemm table: no device line"))
    }
}

fn dtype(s: &str) -> std::result::Result<CudaDType, String> {
    match s {
        "f32" => Ok(CudaDType::F32),
        "bf16" => Ok(CudaDType::BF16),
        "f16" => Ok(CudaDType::F16),
        _ => Err(format!("unknown dtype {s:?} (f32, bf16 or f16)")),
    }
}

fn parse_row(rest: &str) -> std::result::Result<(GemmKey, GemmRates), String> {
    let f: Vec<&str> = rest.split_whitespace().collect();
    let [types, layout, batch, mnk, ours, vendor] = f[..] else {
        return Err(format!("{} fields where 6 are expected", f.len()));
    };
    let (din, dout) = types.split_once('>').ok_or("dtypes are written in>out")?;
    let lay: Vec<char> = layout.chars().collect();
    let flag = |c: char| match c {
        'n' => Ok(false),
        't' => Ok(true),
        _ => Err(format!("layout {layout:?} is not two of n/t")),
    };
    let [la, lb] = lay[..] else { return Err(format!("layout {layout:?} is not two of n/t")) };
    let num = |s: &str, what: &str| {
        s.parse::<usize>()
            .ok()
            .filter(|&v| v > 0)
            .ok_or(format!("{what} {s:?} is not a positive integer"))
    };
    let batch = num(batch.strip_prefix('b').ok_or("batch is written b<count>")?, "batch")?;
    let dims: Vec<&str> = mnk.split('x').collect();
    let [m, n, k] = dims[..] else { return Err(format!("sizes {mnk:?} are not m x n x k")) };
    let rate = |s: &str, name: &str| {
        s.strip_prefix(name)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or(format!("{s:?} is not {name}<rate>"))
    };
    let key = GemmKey {
        dtype_in: dtype(din)?,
        dtype_out: dtype(dout)?,
        trans_a: flag(la)?,
        trans_b: flag(lb)?,
        batch,
        m: num(m, "m")?,
        n: num(n, "n")?,
        k: num(k, "k")?,
    };
    Ok((key, GemmRates { ours: rate(ours, "ours=")?, vendor: rate(vendor, "cublaslt=")? }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::GemmShape;
    use CudaDType::{BF16, F16, F32};

    fn problem(ta: bool, tb: bool, m: usize, n: usize, k: usize) -> GemmProblem {
        let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
        GemmProblem::new(s, BF16, BF16)
    }

    #[test]
    fn the_text_round_trips_and_auto_picks_the_faster() {
        let h200 = "cuda:0 (sm_90, NVIDIA H200)";
        let mut t = GemmTable::new(h200);
        let (fast, slow) = (problem(false, true, 256, 128, 64), problem(true, false, 128, 64, 256));
        t.insert(GemmKey::of(&fast), 700.5, 690.0);
        t.insert(GemmKey::of(&slow), 300.0, 650.25);
        let f16 = GemmProblem::new(GemmShape::new(2, 8, 8, 8), F16, F32);
        t.insert(GemmKey::of(&f16), 1.0, 1.0);
        let text = t.to_text();
        assert!(text.contains("gemm f16>f32 nn b2 8x8x8 ours=1 cublaslt=1"), "{text}");
        let back = GemmTable::parse(&format!("# measured\n\n{text}")).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.device(), "(sm_90, NVIDIA H200)");
        assert!(back.prefers_ours(h200, &fast));
        assert!(back.prefers_ours("cuda:3 (sm_90, NVIDIA H200)", &fast));
        assert!(!back.prefers_ours(h200, &slow));
        assert!(back.prefers_ours(h200, &f16), "a tie goes to ours");
        // Not measured: the vendor library.
        assert!(!back.prefers_ours(h200, &problem(false, false, 256, 128, 64)));
        // Another kind of device: the vendor library.
        assert!(!back.prefers_ours("cuda:0 (sm_90, NVIDIA H100 80GB HBM3)", &fast));
        assert!(!back.prefers_ours("emulator", &fast));
    }

    #[test]
    fn malformed_tables_name_the_line() {
        let dev = "device (sm_90, NVIDIA H200)\n";
        for (text, want) in [
            ("gemm bf16>bf16 nn b1 1x1x1 ours=1 cublaslt=1\n".to_string(), "before the device"),
            (String::new(), "no device line"),
            (format!("{dev}{dev}"), "second device"),
            (format!("{dev}gemm bf16>bf16 nn b1 1x1 ours=1 cublaslt=1"), "line 2: sizes"),
            (format!("{dev}gemm bf16>bf32 nn b1 1x1x1 ours=1 cublaslt=1"), "dtype"),
            (format!("{dev}gemm bf16>bf16 nx b1 1x1x1 ours=1 cublaslt=1"), "layout"),
            (format!("{dev}gemm bf16>bf16 nn b0 1x1x1 ours=1 cublaslt=1"), "batch"),
            (format!("{dev}gemm bf16>bf16 nn b1 1x1x1 ours=-1 cublaslt=1"), "ours="),
            (format!("{dev}gemm bf16>bf16 nn b1 1x1x1 ours=1"), "5 fields"),
            (format!("{dev}gemmm"), "neither"),
        ] {
            let e = GemmTable::parse(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn device_kind_drops_the_ordinal_only() {
        assert_eq!(device_kind("cuda:7 (sm_90, NVIDIA H200)"), "(sm_90, NVIDIA H200)");
        assert_eq!(device_kind("(sm_90, NVIDIA H200)"), "(sm_90, NVIDIA H200)");
        assert_eq!(device_kind("emulator cuda:0"), "emulator cuda:0");
    }
}
