//! Part 1, correctness: every kernel family against the CPU kernels, one
//! file per family; [`Ctx`] carries the device, the report and the random
//! numbers through them.

use std::time::Instant;

use tpar_kernels::cuda::cublaslt::CublasLt;
use tpar_kernels::cuda::CudaDType;

use CudaDType::{BF16, F16, F32};

use crate::data::Rng;
use crate::dev::Dev;
use crate::report::Report;
use crate::stop::Stop;
use crate::Res;

pub(crate) mod adamw;
pub(crate) mod cross_entropy;
pub(crate) mod dropout;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod gemm;
pub(crate) mod gemm_hopper;
pub(crate) mod gemm_pad;
pub(crate) mod layout;
pub(crate) mod reduce;
pub(crate) mod rmsnorm;
pub(crate) mod rope;
pub(crate) mod sdpa;
pub(crate) mod sdpa_hopper;

pub(crate) const DTYPES: [CudaDType; 3] = [F32, BF16, F16];
pub(crate) const LAYOUTS: [(bool, bool); 4] =
    [(false, false), (false, true), (true, false), (true, true)];
/// The `ignore_index` of the cross-entropy checks.
pub(crate) const IGNORE: i64 = -100;

/// The largest error a check of an output of `dt` accepts, relative to the
/// largest reference magnitude.
pub(crate) fn bound(dt: CudaDType) -> f64 {
    match dt {
        F32 => 1e-5,
        BF16 => 1e-2,
        F16 => 2e-3,
    }
}

/// State of the checks.
pub(crate) struct Ctx<'a> {
    pub(crate) d: &'a Dev,
    pub(crate) r: Report,
    pub(crate) rng: Rng,
    pub(crate) quick: bool,
    pub(crate) only: Vec<String>,
    pub(crate) lt: Option<&'a CublasLt>,
    /// Set by the first check that loses the CUDA context; the rest are skipped.
    pub(crate) stop: Stop,
}

impl Ctx<'_> {
    /// Runs one family of checks unless `--only` leaves it out or the CUDA
    /// context is lost; after it, a device synchronization tells whether the
    /// context was lost by work no check waited for (then the family is named).
    pub(crate) fn family(&mut self, name: &str, f: impl FnOnce(&mut Self)) {
        if self.stop.stopped() || (!self.only.is_empty() && !self.only.iter().any(|o| o == name)) {
            return;
        }
        println!("== {name}");
        let (n0, t0) = (self.r.checks.len(), Instant::now());
        f(self);
        if !self.stop.stopped() {
            if let Err(e) = self.d.sync() {
                self.stop.see(&format!("the {name} checks"), e.as_ref());
            }
        }
        let done = &self.r.checks[n0..];
        println!(
            "   {name}: {} checks, {} failed, {:.1} s",
            done.len(),
            done.iter().filter(|c| !c.pass).count(),
            t0.elapsed().as_secs_f64()
        );
    }

    /// Runs a check body; an error (a rejected launch, a failed copy) is a
    /// FAIL line, and a lost CUDA context also stops the checks (the body
    /// does not run once they are stopped).
    pub(crate) fn guard(
        &mut self,
        name: &str,
        dt: &str,
        shape: &str,
        f: impl FnOnce(&mut Self) -> Res<()>,
    ) {
        if self.stop.stopped() {
            return;
        }
        if let Err(e) = f(self) {
            self.r.failure(name, dt, shape, &e);
            self.stop.see(&format!("check {name} {dt} {shape}"), e.as_ref());
        }
    }
}

/// Runs every family of checks (those `--only` names, when given).
pub(crate) fn run_all(c: &mut Ctx) {
    c.family("gemm", gemm::check_gemm);
    c.family("gemm_pad", gemm_pad::check_gemm_pad);
    c.family("sdpa", sdpa::check_sdpa);
    c.family("rmsnorm", rmsnorm::check_rmsnorm);
    c.family("rope", rope::check_rope);
    c.family("cross_entropy", cross_entropy::check_cross_entropy);
    c.family("embedding", embedding::check_embedding);
    c.family("adamw", adamw::check_adamw);
    c.family("reduce", reduce::check_reduce);
    c.family("elementwise", elementwise::check_elementwise);
    c.family("layout", layout::check_layout);
    c.family("dropout", dropout::check_dropout);
}
