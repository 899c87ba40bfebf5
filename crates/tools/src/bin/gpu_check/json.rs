//! The `--json` file: the checks and the benchmark numbers, under the keys
//! `benches/torch_ref.py` uses, read by `scripts/gpu-check.sh`'s summary.
//!
//! ```text
//! {"tool": "gpu_check", "device": ..., "quick": ..., "sabotage": ...,
//!  "checks_total": N, "checks_failed": N,
//!  "checks": [{"name", "dtype", "shape", "err", "bound", "pass", "note"}, ...],
//!  "bench": {"ours": {key: value}, "cublaslt": {key: value}},
//!  "units": {key: unit}, "notes": {key: note},
//!  "context_lost": null or the check or benchmark that lost the CUDA context}
//! ```
//!
//! Maps keep the order the benchmarks ran in (the summary's table follows
//! it); a value that is not finite is `null`.

use std::path::Path;

use serde::{Serialize, Serializer};

use crate::bench::Bench;
use crate::cli::Opts;
use crate::report::Check;
use crate::Res;

/// The whole file.
#[derive(Serialize)]
struct Output<'a> {
    tool: &'static str,
    device: &'a str,
    quick: bool,
    sabotage: bool,
    checks_total: usize,
    checks_failed: usize,
    checks: Vec<CheckOut<'a>>,
    bench: BenchOut<'a>,
    #[serde(serialize_with = "in_order")]
    units: Vec<(&'a str, &'a str)>,
    #[serde(serialize_with = "in_order")]
    notes: Vec<(&'a str, &'a str)>,
    /// The check or benchmark that lost the CUDA context (the rest did not run).
    context_lost: Option<&'a str>,
}

/// One compared output.
#[derive(Serialize)]
struct CheckOut<'a> {
    name: &'a str,
    dtype: &'a str,
    shape: &'a str,
    err: Option<f64>,
    bound: Option<f64>,
    pass: bool,
    note: &'a str,
}

/// The measured numbers, ours and cuBLASLt's, by benchmark key.
#[derive(Serialize)]
struct BenchOut<'a> {
    #[serde(serialize_with = "in_order")]
    ours: Vec<(&'a str, Option<f64>)>,
    #[serde(serialize_with = "in_order")]
    cublaslt: Vec<(&'a str, Option<f64>)>,
}

/// Key-value pairs as a JSON object, in their order.
fn in_order<V: Serialize, S: Serializer>(pairs: &[(&str, V)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(pairs.iter().map(|(k, v)| (k, v)))
}

/// `v`, or `None` (JSON `null`) when it is not finite.
fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

/// Writes the `--json` file.
pub(crate) fn write_json(
    path: &Path,
    device: &str,
    o: &Opts,
    checks: &[Check],
    benches: &[Bench],
    context_lost: Option<&str>,
) -> Res<()> {
    let by_key = |get: &dyn Fn(&Bench) -> Option<f64>| -> Vec<(&str, Option<f64>)> {
        benches.iter().filter_map(|b| get(b).map(|v| (b.key.as_str(), finite(v)))).collect()
    };
    let out = Output {
        tool: "gpu_check",
        device,
        quick: o.quick,
        sabotage: o.sabotage,
        checks_total: checks.len(),
        checks_failed: checks.iter().filter(|c| !c.pass).count(),
        checks: checks
            .iter()
            .map(|c| CheckOut {
                name: &c.name,
                dtype: &c.dtype,
                shape: &c.shape,
                err: finite(c.err),
                bound: finite(c.bound),
                pass: c.pass,
                note: &c.note,
            })
            .collect(),
        bench: BenchOut { ours: by_key(&|b| b.ours), cublaslt: by_key(&|b| b.cublaslt) },
        units: benches.iter().map(|b| (b.key.as_str(), b.unit)).collect(),
        notes: benches.iter().map(|b| (b.key.as_str(), b.note.as_str())).collect(),
        context_lost,
    };
    let mut text = serde_json::to_string_pretty(&out)?;
    text.push('\n');
    std::fs::write(path, text)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[test]
    fn fields_and_order_are_what_the_summary_reads() {
        let o = Opts::parse_from(["gpu_check", "--quick"]);
        let check = |name: &str, err: f64, pass: bool| Check {
            name: name.into(),
            dtype: "bf16".into(),
            shape: "2x3".into(),
            err,
            bound: 1e-2,
            pass,
            note: String::new(),
        };
        let bench = |key: &str, ours: Option<f64>, cublaslt: Option<f64>| Bench {
            key: key.into(),
            unit: "GB/s",
            ours,
            cublaslt,
            note: "n".into(),
        };
        let checks = [check("b.first", 0.5e-3, true), check("a.second", f64::INFINITY, false)];
        let benches =
            [bench("z.copy", Some(10.0), None), bench("a.gemm", Some(f64::NAN), Some(2.0))];
        let path = std::env::temp_dir().join(format!("gpu_check_json_{}.json", std::process::id()));
        write_json(&path, "dev", &o, &checks, &benches, Some("check gemm nn")).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["tool"], "gpu_check");
        assert_eq!((v["quick"].as_bool(), v["sabotage"].as_bool()), (Some(true), Some(false)));
        assert_eq!((v["checks_total"].as_u64(), v["checks_failed"].as_u64()), (Some(2), Some(1)));
        assert_eq!(v["checks"][1]["name"], "a.second");
        assert!(v["checks"][1]["err"].is_null() && v["checks"][1]["pass"] == false);
        assert_eq!(v["bench"]["ours"]["z.copy"], 10.0);
        assert!(v["bench"]["ours"]["a.gemm"].is_null());
        assert_eq!(v["bench"]["cublaslt"]["a.gemm"], 2.0);
        assert!(v["bench"]["cublaslt"].get("z.copy").is_none());
        assert_eq!(v["units"]["a.gemm"], "GB/s");
        assert_eq!(v["notes"]["z.copy"], "n");
        assert_eq!(v["context_lost"], "check gemm nn");
        // The benchmarks' order, not sorted keys.
        assert!(text.find("\"z.copy\"").unwrap() < text.find("\"a.gemm\"").unwrap());
    }
}
