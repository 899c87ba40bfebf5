//! Checks every CUDA kernel family of `tpar_kernels::cuda::raw` against the
//! CPU kernels, then (with `--bench`, on a GPU) measures their throughput.
//!
//! ```text
//! gpu_check [--device gpu|emulator] [--ordinal N] [--quick] [--bench] [--no-checks]
//!           [--json PATH] [--gemm-table PATH] [--only FAMILY,...] [--seed N] [--sabotage]
//! gpu_check --precompile ARCH
//! ```
//!
//! Built by `cargo build --release -p tpar-tools --bin gpu_check` (the binary
//! is `target/release/gpu_check`); `scripts/gpu-check.sh` runs it on a GPU
//! machine.
//!
//! `--precompile sm_90a` (what a Hopper GPU compiles for) needs no GPU: NVRTC compiles every kernel source for
//! that architecture into the kernel cache (`TPAR_KERNEL_CACHE`, default
//! `~/.cache/tpar/kernels`), so GPU processes with the same NVRTC version
//! load them instead of compiling on first use; it prints the cache files.
//! `--precompile sm_90` fills it for a Hopper GPU run with
//! `TPAR_CUDA_ARCH=sm_90` (the pre-Hopper kernels).
//!
//! Part 1, correctness (unless `--no-checks`): fresh random inputs, rounded
//! to the dtype under test, go through the CUDA kernel and through the CPU
//! kernel in f64 on the same rounded values. One line per compared output:
//! `PASS|FAIL name dtype shape err bound`, where `err` is the largest
//! absolute difference divided by the largest reference magnitude and
//! `bound` is 1e-5 for f32 outputs, 1e-2 for bf16 and 2e-3 for f16. Integer
//! outputs (indices, counts, error slots, copies) must match exactly (`err`
//! counts the mismatches). Exit status 1 when a check fails.
//!
//! The `gemm` family also checks the Hopper GEMM (`raw::gemm_hopper`) where
//! the device runs `sm_90a` kernels (a compute capability 9.0 GPU; in the
//! emulator with `TPAR_EMU_ARCH=sm_90a`): every layout, bf16 and f16 into
//! their own type and f32, partial tiles with K not a multiple of 64, scales
//! over a batch, each epilogue (bias, residual, SiLU gate) against the
//! unfused computation, the rotary-embedding epilogue on a packed qkv
//! projection against an f64 reference and the unfused path, and on a GPU the
//! Llama-8B projections sampled.
//!
//! Sizes: on a GPU they are realistic (GEMM 1024^3 in every layout, the
//! Llama-8B projections 4096x4096x14336 and 4096x14336x4096 in bf16 checked on
//! 256 sampled outputs against an f64 dot product, attention at 1k tokens with
//! 32/8 heads of 128); with `--quick`, and always in the CPU emulator, tiny.
//! Families (for `--only`): gemm, gemm_pad, sdpa, rmsnorm, rope,
//! cross_entropy, embedding, adamw, reduce, elementwise, layout. With `--bench`, `--only`
//! also picks the benchmarks: GEMM for `gemm`, the padded LM-head products
//! for `gemm` and `gemm_pad`, attention for `sdpa`, the memory-bound ones for
//! any other family.
//!
//! Part 2, `--bench` (GPU only): bf16 GEMM TFLOP/s, ours and cuBLASLt, for
//! 4096^3 and 8192^3 (NN, NT, TN), the Llama-8B projections at 8192 tokens
//! (NN, NT), and every product of the training step of `scripts/gpu-check.sh`
//! (each linear's forward NT, input-gradient NN and weight-gradient TN),
//! summed as `gemm.step.sum` with each product weighted by its count per
//! step; where the device runs the Hopper kernel, every product also in each
//! of its four launch configurations (`.best` rows: the fastest, and
//! `gemm.step.sum.best`); every product measured on both goes into the tuning
//! table of `TPAR_GEMM=auto` (with the fastest Hopper configuration as
//! `hopper=`), printed after the benchmarks and written by
//! `--gemm-table PATH`;
//! causal GQA attention (32 q / 8 kv heads of 128, batch x seq = 16k tokens)
//! forward and forward+backward TFLOP/s at seq 1k..8k, at the first two with
//! each tensor-core forward tiling forced (`.m64`, `.m128`), and at the
//! training step's shape of `scripts/gpu-check.sh` (`d64.s1024`: 16 q / 8 kv
//! heads of 64, batch 8, seq 1024; also with each tiling); RMSNorm, RoPE and
//! cross-entropy GB/s next to a measured device-to-device copy (1 GiB). Each
//! time is the median of 3 trials of enough back-to-back calls for ~0.2 s,
//! after a warm-up, bracketed by device synchronizations. `--json` writes the
//! checks and the numbers under the keys `benches/torch_ref.py` uses, so
//! `scripts/gpu-check.sh` can print ours / PyTorch and ours / cuBLASLt.
//!
//! `--sabotage` perturbs one reference value of every comparison, so every
//! check must FAIL: a self-test of the comparisons (exit status 1 when one
//! still passes). Without a GPU: `--device emulator --quick`.
//!
//! A lost CUDA context (a kernel trapped or faulted, e.g. a deadlocked Hopper
//! kernel stopped by its mbarrier watchdog after `TPAR_MBAR_TIMEOUT_MS`):
//! every later call on the device would fail, so the first check or
//! benchmark that gets it ends the checks and the benchmarks, one line names
//! it, `--json` (with `"context_lost": NAME`) and `--gemm-table` are still
//! written with what ran, and the exit status is 3. `TPAR_CUDA_ARCH=sm_90`
//! then reruns everything on the pre-Hopper kernels (`scripts/gpu-check.sh`
//! does).
//!
//! Exit status: 0 every check passed; 1 a check failed (with `--sabotage`: a
//! check passed), or a file could not be written; 2 the device could not be
//! opened; 3 the CUDA context was lost (above).
//!
//! The files: `cli.rs` (the flags), `precompile.rs`, `dev.rs` (the device
//! under test), `data.rs` (host data and random numbers), `report.rs` (the
//! comparisons), `checks/` (one file per kernel family), `bench/` (the
//! benchmarks), `json.rs` (the `--json` file).

use std::error::Error;
use std::time::Instant;

use clap::Parser as _;
use tpar_kernels::cuda::cublaslt::CublasLt;
use tpar_kernels::cuda::ops::gemm_tune::GemmTable;

mod bench;
mod checks;
mod cli;
mod data;
mod dev;
mod json;
mod precompile;
mod report;
mod stop;

use checks::Ctx;
use cli::Opts;
use data::Rng;
use dev::{Backend, Dev};
use report::{Check, Report};
use stop::Stop;

/// Every error of a check or a benchmark, reported and then skipped past.
pub(crate) type Res<T> = Result<T, Box<dyn Error>>;

fn main() {
    let o = Opts::parse().finish();
    if let Some(arch) = &o.precompile {
        std::process::exit(precompile::run(arch));
    }
    let dev = match Dev::open(o.gpu(), o.ordinal) {
        Ok(d) => d,
        Err(e) => {
            let what =
                if o.gpu() { format!("cuda:{}", o.ordinal) } else { "the CPU emulator".into() };
            eprintln!("gpu_check: cannot open {what}: {e}");
            std::process::exit(2);
        }
    };
    let device = dev.l().describe();
    println!(
        "gpu_check on {device}: {} sizes{}",
        if o.quick { "quick" } else { "full" },
        if o.sabotage { ", SABOTAGED references (every check must fail)" } else { "" }
    );
    if let Backend::Emulator(emu) = &dev.backend {
        println!(
            "emulator checks: {}",
            if emu.checks_races() {
                "races and memory errors (every launch)"
            } else {
                "none (TPAR_EMU_RACECHECK=1 checks races and memory errors)"
            }
        );
    }
    if o.gpu() {
        if let (Ok(d), Ok(n)) = (
            tpar_kernels::cuda::device::driver_version(),
            tpar_kernels::cuda::device::nvrtc_version(),
        ) {
            println!("CUDA driver {}.{}, NVRTC {}.{}", d.0, d.1, n.0, n.1);
        }
    }
    let lt = dev.cuda().and_then(|cuda| match CublasLt::new(cuda) {
        Ok(lt) => Some(lt),
        Err(e) => {
            eprintln!("gpu_check: no cuBLASLt baseline: {e}");
            None
        }
    });
    let t0 = Instant::now();
    let mut c = Ctx {
        d: &dev,
        r: Report { checks: Vec::new(), sabotage: o.sabotage },
        rng: Rng(o.seed),
        quick: o.quick,
        only: o.only.clone(),
        lt: lt.as_ref(),
        stop: Stop::default(),
    };
    if !o.no_checks {
        checks::run_all(&mut c);
    }
    let checks = std::mem::take(&mut c.r.checks);
    let failed: Vec<&Check> = checks.iter().filter(|c| !c.pass).collect();
    println!(
        "\n{} checks: {} passed, {} failed ({:.1} s)",
        checks.len(),
        checks.len() - failed.len(),
        failed.len(),
        t0.elapsed().as_secs_f64()
    );
    if !o.sabotage {
        for f in &failed {
            println!("  FAIL {} {} {} err {:.2e} {}", f.name, f.dtype, f.shape, f.err, f.note);
        }
    }
    let mut benches = Vec::new();
    if o.bench {
        if dev.cuda().is_some() {
            println!("\n== benchmarks");
            let mut table = GemmTable::new(&dev.l().describe());
            if let Some(by) = c.stop.lost_by() {
                println!("skipped: {by} lost the CUDA context");
            } else {
                benches = bench::run_benches(
                    &dev,
                    lt.as_ref(),
                    o.quick,
                    &mut c.rng,
                    &o.only,
                    &mut table,
                    &mut c.stop,
                );
            }
            bench::print_bench_table(&benches);
            if !table.is_empty() {
                println!("\n== GEMM tuning table (TPAR_GEMM=auto reads it from TPAR_GEMM_TABLE)");
                print!("{}", table.to_text());
            }
            if let Some(path) = &o.gemm_table {
                if let Err(e) = std::fs::write(path, table.to_text()) {
                    eprintln!("gpu_check: writing {}: {e}", path.display());
                    std::process::exit(1);
                }
                println!("wrote {} ({} products)", path.display(), table.len());
            }
        } else {
            eprintln!("gpu_check: --bench needs a GPU (the emulator models no timing); skipped");
        }
    }
    if let Some(path) = &o.json {
        match json::write_json(path, &device, &o, &checks, &benches, c.stop.lost_by()) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(e) => {
                eprintln!("gpu_check: writing {}: {e}", path.display());
                std::process::exit(1);
            }
        }
    }
    let bad = if o.sabotage {
        let passed: Vec<&Check> = checks.iter().filter(|c| c.pass).collect();
        for p in &passed {
            println!("  NOT CAUGHT by the sabotage: {} {} {}", p.name, p.dtype, p.shape);
        }
        !passed.is_empty()
    } else {
        !failed.is_empty()
    };
    if let Some(by) = c.stop.lost_by() {
        println!(
            "\ngpu_check: stopped early: {by} lost the CUDA context (exit status {}); \
             TPAR_CUDA_ARCH=sm_90 runs the pre-Hopper kernels",
            stop::EXIT_CONTEXT_LOST
        );
    }
    std::process::exit(stop::exit_status(&c.stop, bad));
}
