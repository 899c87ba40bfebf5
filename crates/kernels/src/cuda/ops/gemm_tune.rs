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
//! On a device that runs the Hopper kernel, `gpu_check --bench` times tpar's
//! kernel in each launch configuration of [`HOPPER_CONFIGS`] and records the
//! fastest ([`best_config`]): its rate as `ours` and the configuration as
//! `hopper=`. [`GemmTable::hopper_config`] hands that configuration to
//! tpar's kernel for the problem (`ops::gemm::hopper_config`: unless
//! `TPAR_GEMM_TILE_N` or `TPAR_GEMM_CLUSTER` is set, which wins), so one
//! measured table decides both the backend and the Hopper configuration per
//! shape. A record without `hopper=` (tables written before it existed, and
//! devices without the Hopper kernel) means the default configuration.
//! No table has been measured on a GPU yet.
//!
//! The text format, one record per line (`#` starts a comment); `hopper=`
//! is `n<tile width>c<cluster size>` ([`HopperConfig`]'s display form) and
//! optional:
//!
//! ```text
//! device (sm_90, NVIDIA H200)
//! gemm bf16>bf16 nt b1 8192x1024x1024 ours=512.3 cublaslt=640.0 hopper=n256c2
//! gemm bf16>bf16 nn b1 8192x1024x1024 ours=498.0 cublaslt=610.5
//! ```
//!
//! ```
//! use tpar_kernels::cuda::ops::gemm_tune::{GemmKey, GemmRates, GemmTable};
//! use tpar_kernels::cuda::raw::gemm::GemmProblem;
//! use tpar_kernels::cuda::raw::gemm_hopper::HopperConfig;
//! use tpar_kernels::cuda::CudaDType::BF16;
//! use tpar_kernels::gemm::GemmShape;
//! let p = GemmProblem::new(GemmShape { trans_b: true, ..GemmShape::new(1, 64, 32, 16) }, BF16, BF16);
//! let n256c2 = HopperConfig { tile_n: 256, cluster: 2 };
//! let mut t = GemmTable::new("(sm_90, NVIDIA H200)");
//! t.insert_rates(GemmKey::of(&p), GemmRates { ours: 410.0, vendor: 400.0, hopper: Some(n256c2) });
//! let back = GemmTable::parse(&t.to_text())?;
//! assert!(back.prefers_ours("cuda:1 (sm_90, NVIDIA H200)", &p));
//! assert!(!back.prefers_ours("cuda:0 (sm_80, NVIDIA A100)", &p));
//! assert_eq!(back.hopper_config("cuda:1 (sm_90, NVIDIA H200)", &p), Some(n256c2));
//! assert_eq!(back.hopper_config("cuda:0 (sm_80, NVIDIA A100)", &p), None);
//! # Ok::<(), tpar_kernels::KernelError>(())
//! ```

use std::collections::HashMap;
use std::fmt;

use crate::cuda::raw::gemm::GemmProblem;
use crate::cuda::raw::gemm_hopper::HopperConfig;
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
    /// tpar's kernel (in the configuration `hopper` names, where it is set).
    pub ours: f64,
    /// The vendor library (cuBLASLt).
    pub vendor: f64,
    /// The Hopper kernel's launch configuration that gave `ours` (the
    /// fastest measured); `None`: the default (not measured per
    /// configuration, or no Hopper kernel on the device).
    pub hopper: Option<HopperConfig>,
}

/// The Hopper kernel's launch configurations `gpu_check --bench` times per
/// product, the default first.
pub const HOPPER_CONFIGS: [HopperConfig; 4] = [
    HopperConfig { tile_n: 128, cluster: 1 },
    HopperConfig { tile_n: 128, cluster: 2 },
    HopperConfig { tile_n: 256, cluster: 1 },
    HopperConfig { tile_n: 256, cluster: 2 },
];

/// The fastest of `measured` (configuration, throughput) pairs: the highest
/// finite rate; of equal rates the first listed (list the default first, so
/// a tie keeps it). `None` when no rate is finite.
pub fn best_config(measured: &[(HopperConfig, f64)]) -> Option<(HopperConfig, f64)> {
    measured.iter().filter(|(_, r)| r.is_finite()).fold(None, |best, &(c, r)| match best {
        Some((_, b)) if b >= r => best,
        _ => Some((c, r)),
    })
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

    /// Records (or replaces) a problem's throughputs, tpar's kernel in its
    /// default configuration.
    pub fn insert(&mut self, key: GemmKey, ours: f64, vendor: f64) {
        self.insert_rates(key, GemmRates { ours, vendor, hopper: None });
    }

    /// Records (or replaces) a problem's throughputs and the Hopper
    /// configuration that gave `ours`.
    pub fn insert_rates(&mut self, key: GemmKey, rates: GemmRates) {
        self.rows.insert(key, rates);
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

    /// The Hopper kernel's launch configuration for `p` on the device
    /// `describe`d: the one the table measured fastest for `p`'s key (the
    /// default where its record names none), when the table was measured on
    /// that kind of device and has the key; `None` otherwise.
    pub fn hopper_config(&self, describe: &str, p: &GemmProblem) -> Option<HopperConfig> {
        if device_kind(describe) != self.device {
            return None;
        }
        self.get(&GemmKey::of(p)).map(|r| r.hopper.unwrap_or_default())
    }

    /// The table as text, rows sorted ([`GemmTable::parse`] reads it back).
    pub fn to_text(&self) -> String {
        let mut rows: Vec<String> = self
            .rows
            .iter()
            .map(|(k, r)| {
                let cfg = r.hopper.map(|c| format!(" hopper={c}")).unwrap_or_default();
                format!("gemm {k} ours={} cublaslt={}{cfg}\n", r.ours, r.vendor)
            })
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
    let (fixed, hopper) = match f[..] {
        [ref fixed @ .., last] if f.len() == 7 => (fixed, Some(last)),
        ref fixed => (fixed, None),
    };
    let [types, layout, batch, mnk, ours, vendor] = fixed[..] else {
        return Err(format!("{} fields where 6 (or 7 with hopper=) are expected", f.len()));
    };
    let hopper = hopper
        .map(|h| {
            let cfg = h.strip_prefix("hopper=").ok_or(format!("{h:?} is not hopper=<config>"))?;
            HopperConfig::parse(cfg).map_err(|e| e.to_string())
        })
        .transpose()?;
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
    let rates =
        GemmRates { ours: rate(ours, "ours=")?, vendor: rate(vendor, "cublaslt=")?, hopper };
    Ok((key, rates))
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
            (format!("{dev}gemm bf16>bf16 nn b1 1x1x1 ours=1 cublaslt=1 n256c2"), "hopper="),
            (format!("{dev}gemm bf16>bf16 nn b1 1x1x1 ours=1 cublaslt=1 hopper=n256"), "n256"),
            (
                format!("{dev}gemm bf16>bf16 nn b1 1x1x1 ours=1 cublaslt=1 hopper=n512c1"),
                "tile width 512",
            ),
            (
                format!("{dev}gemm bf16>bf16 nn b1 1x1x1 ours=1 cublaslt=1 hopper=n128c4"),
                "cluster size 4",
            ),
            (format!("{dev}gemm bf16>bf16 nn b1 1x1x1 ours=1 cublaslt=1 hopper=n1 c2"), "8 fields"),
        ] {
            let e = GemmTable::parse(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn each_record_keeps_its_hopper_config_and_old_records_mean_the_default() {
        let h200 = "cuda:0 (sm_90, NVIDIA H200)";
        let (wide, old, lost) = (
            problem(false, true, 8192, 1024, 1024),
            problem(false, false, 8192, 1024, 1024),
            problem(true, false, 1024, 1024, 8192),
        );
        let text = "device (sm_90, NVIDIA H200)\n\
            gemm bf16>bf16 nt b1 8192x1024x1024 ours=512.3 cublaslt=640 hopper=n256c2\n\
            gemm bf16>bf16 nn b1 8192x1024x1024 ours=498 cublaslt=610.5 # written before hopper=\n\
            gemm bf16>bf16 tn b1 1024x1024x8192 ours=700 cublaslt=610.5 hopper=n128c2\n";
        let t = GemmTable::parse(text).unwrap();
        let n256c2 = HopperConfig { tile_n: 256, cluster: 2 };
        assert_eq!(t.hopper_config(h200, &wide), Some(n256c2));
        assert_eq!(t.hopper_config(h200, &old), Some(HopperConfig::default()));
        assert_eq!(t.hopper_config(h200, &lost), Some(HopperConfig { tile_n: 128, cluster: 2 }));
        assert_eq!(t.hopper_config(h200, &problem(false, true, 64, 64, 64)), None);
        assert_eq!(t.hopper_config("cuda:0 (sm_90, NVIDIA H100 80GB HBM3)", &wide), None);
        assert_eq!(t.get(&GemmKey::of(&old)).unwrap().hopper, None);
        // Round trip: the configuration is written back only where recorded.
        let back = t.to_text();
        assert!(back.contains("nt b1 8192x1024x1024 ours=512.3 cublaslt=640 hopper=n256c2\n"));
        assert!(back.contains("nn b1 8192x1024x1024 ours=498 cublaslt=610.5\n"), "{back}");
        assert_eq!(GemmTable::parse(&back).unwrap(), t);
        // Every configuration's display form reads back as itself.
        for c in HOPPER_CONFIGS {
            assert_eq!(HopperConfig::parse(&c.to_string()).unwrap(), c);
        }
    }

    #[test]
    fn the_best_config_is_the_fastest_and_a_tie_keeps_the_first() {
        let [d, c2, n256, n256c2] = HOPPER_CONFIGS;
        assert_eq!(d, HopperConfig::default(), "the default is listed first");
        let best = |m: &[(HopperConfig, f64)]| best_config(m);
        assert_eq!(
            best(&[(d, 500.0), (c2, 520.0), (n256, 610.0), (n256c2, 590.0)]),
            Some((n256, 610.0))
        );
        assert_eq!(
            best(&[(d, 500.0), (c2, 480.0), (n256, 470.0), (n256c2, 460.0)]),
            Some((d, 500.0))
        );
        assert_eq!(best(&[(d, 500.0), (c2, 500.0)]), Some((d, 500.0)), "a tie keeps the default");
        assert_eq!(best(&[(d, f64::NAN), (n256c2, 3.0)]), Some((n256c2, 3.0)));
        assert_eq!(best(&[(d, f64::NAN)]), None);
        assert_eq!(best(&[]), None);
    }

    #[test]
    fn device_kind_drops_the_ordinal_only() {
        assert_eq!(device_kind("cuda:7 (sm_90, NVIDIA H200)"), "(sm_90, NVIDIA H200)");
        assert_eq!(device_kind("(sm_90, NVIDIA H200)"), "(sm_90, NVIDIA H200)");
        assert_eq!(device_kind("emulator cuda:0"), "emulator cuda:0");
    }
}
