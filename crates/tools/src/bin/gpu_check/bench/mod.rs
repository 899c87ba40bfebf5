//! Part 2, `--bench` (GPU only): GEMM and attention TFLOP/s (ours and
//! cuBLASLt) and the memory-bound kernels' GB/s, timed between device
//! synchronizations, and the table that prints them.

mod bandwidth;
mod gemm_pad;
mod matmul;

use std::time::Instant;

use tpar_kernels::cuda::cublaslt::CublasLt;
use tpar_kernels::cuda::ops::gemm_tune::GemmTable;
use tpar_kernels::cuda::raw::sdpa;
use tpar_kernels::cuda::raw::sdpa::{SdpaBwdBuffers, SdpaFwdBuffers, SdpaPath};
use tpar_kernels::cuda::CudaDType;

use CudaDType::BF16;

use crate::checks::{sdpa::sdpa_shape, IGNORE};
use crate::data::Rng;
use crate::dev::Dev;
use crate::stop::Stop;
use crate::Res;
use bandwidth::bandwidth_benches;
use gemm_pad::gemm_pad_benches;
use matmul::gemm_benches;

/// One measured quantity: ours, and cuBLASLt's where it applies.
pub(crate) struct Bench {
    pub(crate) key: String,
    pub(crate) unit: &'static str,
    pub(crate) ours: Option<f64>,
    pub(crate) cublaslt: Option<f64>,
    pub(crate) note: String,
}

/// Seconds per call of `f`: the median of three trials of back-to-back calls
/// (enough for about 0.2 s each) after a warm-up, between synchronizations.
pub(crate) fn time_per_call(d: &Dev, f: impl FnMut() -> Res<()>) -> Res<f64> {
    time_per_call_for(d, 0.2, f)
}

/// [`time_per_call`] with trials of about `trial` seconds each.
pub(crate) fn time_per_call_for(d: &Dev, trial: f64, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    f()?;
    d.sync()?;
    let t = Instant::now();
    f()?;
    d.sync()?;
    let one = t.elapsed().as_secs_f64().max(1e-6);
    let reps = ((trial / one).ceil() as usize).clamp(3, 2000);
    let mut trials = Vec::with_capacity(3);
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        d.sync()?;
        trials.push(t.elapsed().as_secs_f64() / reps as f64);
    }
    trials.sort_by(f64::total_cmp);
    Ok(trials[1])
}

/// `value / t`, scaled (1e12 for TFLOP/s, 1e9 for GB/s).
pub(crate) fn rate(amount: f64, seconds: f64, scale: f64) -> f64 {
    amount / seconds / scale
}

/// Prints a measurement as it comes and keeps it.
pub(crate) fn push(out: &mut Vec<Bench>, b: Bench) {
    println!(
        "  {:<34} ours {:>9} cuBLASLt {:>9} {}{}",
        b.key,
        b.ours.map_or("-".into(), |v| format!("{v:.1}")),
        b.cublaslt.map_or("-".into(), |v| format!("{v:.1}")),
        b.unit,
        if b.note.is_empty() { String::new() } else { format!("  ({})", b.note) }
    );
    out.push(b);
}

/// After the rows `rows` of the benchmark group `group` (already in `out`):
/// whether the CUDA context was lost in it, asked of the device with a
/// synchronization (the group's errors are in its rows' notes). The first
/// row whose note says so is named, else the first without a number, else
/// the group.
fn lost_in(d: &Dev, group: &str, rows: &[Bench], stop: &mut Stop) -> bool {
    let Err(e) = d.sync() else { return stop.stopped() };
    let row = rows
        .iter()
        .find(|b| b.note.contains("context is lost"))
        .or_else(|| rows.iter().find(|b| b.ours.is_none()))
        .map_or_else(|| format!("the {group} benchmarks"), |b| format!("benchmark {}", b.key));
    stop.see(&row, e.as_ref())
}

/// The benchmarks: GEMM (`gemm` in `only`; each product's rates go into
/// `table`), padded GEMM operands (`gemm` or `gemm_pad`), attention (`sdpa`)
/// and the memory-bound kernels (any other family); all of them when `only`
/// is empty. The first group (or attention case) that loses the CUDA
/// context ends them: `stop` names it, and the rows so far are returned.
pub(crate) fn run_benches(
    d: &Dev,
    lt: Option<&CublasLt>,
    quick: bool,
    rng: &mut Rng,
    only: &[String],
    table: &mut GemmTable,
    stop: &mut Stop,
) -> Vec<Bench> {
    let want = |f: &str| only.is_empty() || only.iter().any(|o| o == f);
    let memory =
        only.is_empty() || only.iter().any(|o| !matches!(o.as_str(), "gemm" | "gemm_pad" | "sdpa"));
    let mut out = Vec::new();
    // One random bf16 source that every read-only operand points into.
    let src_elems = 8192 * 14336;
    let src = match d.up(BF16, &rng.vals(BF16, src_elems, -1.0, 1.0)) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpu_check: bench source buffer: {e}");
            stop.see("the benchmarks' source buffer", e.as_ref());
            return out;
        }
    };
    let s = src.ptr();
    // Pushes a group's rows; whether the context was lost in it.
    let group = |out: &mut Vec<Bench>, name: &str, rows: Vec<Bench>, stop: &mut Stop| {
        let n0 = out.len();
        for b in rows {
            push(out, b);
        }
        lost_in(d, name, &out[n0..], stop)
    };

    // GEMM.
    if want("gemm") && group(&mut out, "GEMM", gemm_benches(d, lt, quick, s, table), stop) {
        return out;
    }
    if (want("gemm") || want("gemm_pad"))
        && group(&mut out, "padded GEMM", gemm_pad_benches(d, rng), stop)
    {
        return out;
    }

    // Attention: causal GQA, 32 q / 8 kv heads of 128, batch x seq = 16k tokens; then
    // the shape of `scripts/gpu-check.sh`'s training step (16 q / 8 kv heads of 64,
    // batch 8 x seq 1024) with each tensor-core forward (64 or 128 query rows a block).
    let mut cases: Vec<(String, usize, usize, usize, usize, usize, SdpaPath)> = Vec::new();
    let seqs: &[usize] = match (want("sdpa"), quick) {
        (false, _) => &[],
        (true, true) => &[1024, 2048],
        (true, false) => &[1024, 2048, 4096, 8192],
    };
    for &seq in seqs {
        cases.push((format!("s{seq}"), 16384 / seq, 32, 8, seq, 128, SdpaPath::Auto));
    }
    for &seq in seqs.iter().take(2) {
        for (sfx, path) in [(".m64", SdpaPath::TensorCore), (".m128", SdpaPath::TensorCoreWide)] {
            cases.push((format!("s{seq}{sfx}"), 16384 / seq, 32, 8, seq, 128, path));
        }
    }
    if want("sdpa") {
        for (sfx, path) in [
            ("", SdpaPath::Auto),
            (".m64", SdpaPath::TensorCore),
            (".m128", SdpaPath::TensorCoreWide),
        ] {
            cases.push((format!("d64.s1024{sfx}"), 8, 16, 8, 1024, 64, path));
        }
    }
    // The same cases on the Hopper kernels (forward and backward), where the
    // device runs sm_90a kernels.
    if want("sdpa") && tpar_kernels::cuda::raw::sdpa_hopper::target_of(d.l()).is_some() {
        for &seq in seqs {
            cases.push((format!("s{seq}.hopper"), 16384 / seq, 32, 8, seq, 128, SdpaPath::Hopper));
        }
        cases.push(("d64.s1024.hopper".to_string(), 8, 16, 8, 1024, 64, SdpaPath::Hopper));
    }
    for (label, batch, hq, hkv, seq, hd, path) in cases {
        let sh = sdpa_shape(batch, hq, hkv, seq, seq, hd, true);
        // 4 * b * h * s^2 * d for q k^T and p v, half of it under the causal mask;
        // the backward pass counts 2.5 times the forward.
        let fwd_flops = 4.0 * (batch * hq * seq * seq * hd) as f64 * 0.5;
        let note = format!("b{batch} h{hq}/{hkv} d{hd} causal, {path:?}");
        let res = (|| -> Res<(f64, f64)> {
            let nq = batch * hq * seq * hd;
            let nk = batch * hkv * seq * hd;
            let (o, lse) = (d.alloc(nq * 2)?, d.alloc(batch * hq * seq * 4)?);
            let (dq, dk, dv) = (d.alloc(nq * 2)?, d.alloc(nk * 2)?, d.alloc(nk * 2)?);
            let ws_bytes = sdpa::sdpa_backward_workspace_bytes(&sh)?;
            let ws = d.alloc(ws_bytes)?;
            let fb = SdpaFwdBuffers {
                q: s,
                k: s,
                v: s,
                mask: None,
                out: o.ptr(),
                lse: lse.ptr(),
                layout: Default::default(),
            };
            let bb = SdpaBwdBuffers {
                q: s,
                k: s,
                v: s,
                mask: None,
                out: o.ptr(),
                lse: lse.ptr(),
                dout: s,
                dq: dq.ptr(),
                dk: dk.ptr(),
                dv: dv.ptr(),
                workspace: ws.ptr(),
                workspace_bytes: ws_bytes,
                layout: Default::default(),
            };
            let l = d.l();
            // the Hopper rows time the Hopper backward too
            let bwd_path = if path == SdpaPath::Hopper { path } else { SdpaPath::Auto };
            let t_fwd = time_per_call(d, || {
                // SAFETY: q, k, v and dout lie inside the source buffer; the
                // outputs and the workspace were allocated for `sh`.
                unsafe { sdpa::sdpa_forward(l, BF16, &sh, &fb, path)? };
                Ok(())
            })?;
            let t_all = time_per_call(d, || {
                // SAFETY: as above.
                unsafe {
                    sdpa::sdpa_forward(l, BF16, &sh, &fb, path)?;
                    sdpa::sdpa_backward(l, BF16, &sh, &bb, bwd_path)?;
                }
                Ok(())
            })?;
            Ok((t_fwd, t_all))
        })();
        let (fwd, all) = match &res {
            Ok((f, a)) => (Some(rate(fwd_flops, *f, 1e12)), Some(rate(3.5 * fwd_flops, *a, 1e12))),
            Err(e) => {
                eprintln!("gpu_check: sdpa {label}: {e}");
                (None, None)
            }
        };
        let mk = |key: String, v| Bench {
            key,
            unit: "TFLOP/s",
            ours: v,
            cublaslt: None,
            note: note.clone(),
        };
        push(&mut out, mk(format!("sdpa.fwd.{label}"), fwd));
        push(&mut out, mk(format!("sdpa.fwdbwd.{label}"), all));
        if let Err(e) = res {
            if stop.see(&format!("benchmark sdpa {label}"), e.as_ref()) {
                return out;
            }
        }
    }

    // Memory-bound kernels, against a device-to-device copy.
    if memory {
        group(&mut out, "memory-bound", bandwidth_benches(d, s, rng), stop);
    }
    out
}

pub(crate) fn print_bench_table(rows: &[Bench]) {
    let copy = rows.iter().find(|b| b.key == "copy.dtod").and_then(|b| b.ours);
    println!(
        "\n{:<34} {:>10} {:>10} {:<8} {:>14}  note",
        "benchmark", "ours", "cuBLASLt", "unit", "ratio"
    );
    for b in rows {
        let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        let ratio = match (b.unit, b.ours, b.cublaslt, copy) {
            (_, Some(o), Some(c), _) => format!("{:.2} of cuBLASLt", o / c),
            ("GB/s", Some(o), None, Some(c)) if b.key != "copy.dtod" => {
                format!("{:.0}% of copy", 100.0 * o / c)
            }
            _ => String::new(),
        };
        println!(
            "{:<34} {:>10} {:>10} {:<8} {:>14}  {}",
            b.key,
            f(b.ours),
            f(b.cublaslt),
            b.unit,
            ratio,
            b.note
        );
    }
}
