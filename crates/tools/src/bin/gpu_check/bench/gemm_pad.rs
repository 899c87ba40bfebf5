//! The LM head's GEMMs with and without padded operands (`ops::gemm_pad`):
//! the three products of the training step's LM head (8192 tokens,
//! vocabulary 259, hidden 1024, bf16) through `ops::gemm::gemm_with`, on
//! tpar's kernel (the `ours` column) and on the device's vendor library (the
//! `cuBLASLt` column), once with every unaligned operand staged
//! (`gemm.lmhead.<layout>.pad`, `PadPolicy::Always`) and once without
//! (`.nopad`, `PadPolicy::Never`). The copies are part of the padded time.
//! These rows decide whether `TPAR_GEMM_PAD=auto` should pad for cuBLASLt
//! (it does not until they say so) and whether it should stage C.

use tpar_kernels::cuda::ops::gemm::{gemm_with, GemmBackend};
use tpar_kernels::cuda::ops::gemm_pad::PadPolicy;
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::CudaDType::BF16;
use tpar_kernels::gemm::GemmShape;

use super::{rate, time_per_call, Bench};
use crate::checks::gemm::layout_name;
use crate::checks::gemm_pad::lm_head_products;
use crate::data::Rng;
use crate::dev::Dev;
use crate::Res;

/// Tokens, vocabulary and hidden size of the LM head of `scripts/gpu-check.sh`'s model.
const LM_HEAD: (usize, usize, usize) = (8192, 259, 1024);

/// Seconds per call of `p` through `gemm_with` on `backend` with `pad`, on
/// random operands.
fn time_one(
    d: &Dev,
    rng: &mut Rng,
    p: &GemmProblem,
    backend: GemmBackend,
    pad: PadPolicy,
) -> Res<f64> {
    let [na, nb, nc] = p.extents()?;
    let a = d.up(BF16, &rng.vals(BF16, na, -1.0, 1.0))?;
    let b = d.up(BF16, &rng.vals(BF16, nb, -1.0, 1.0))?;
    let mut c = d.alloc(nc * p.dtype_out.size())?;
    time_per_call(d, || {
        gemm_with(&*d.mem, p, a.as_slice(), b.as_slice(), c.as_slice_mut(), backend, pad)?;
        Ok(())
    })
}

/// `gemm.lmhead.{nt,nn,tn}.{pad,nopad}` in TFLOP/s; the cuBLASLt column only
/// on a GPU (the emulator has no vendor library).
pub(super) fn gemm_pad_benches(d: &Dev, rng: &mut Rng) -> Vec<Bench> {
    let mut out = Vec::new();
    let vendor = d.cuda().is_some();
    for (ta, tb, [m, n, k]) in lm_head_products(LM_HEAD) {
        let shape = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
        let p = GemmProblem::new(shape, BF16, BF16);
        let flops = 2.0 * (m * n * k) as f64;
        for (sfx, pad) in [("pad", PadPolicy::Always), ("nopad", PadPolicy::Never)] {
            let mut tflops = |backend| match time_one(d, rng, &p, backend, pad) {
                Ok(t) => Some(rate(flops, t, 1e12)),
                Err(e) => {
                    eprintln!("gpu_check: gemm.lmhead {m}x{n}x{k} {backend:?} {pad:?}: {e}");
                    None
                }
            };
            let ours = tflops(GemmBackend::Ours);
            let cublaslt = if vendor { tflops(GemmBackend::Vendor) } else { None };
            out.push(Bench {
                key: format!("gemm.lmhead.{}.{sfx}", layout_name(ta, tb)),
                unit: "TFLOP/s",
                ours,
                cublaslt,
                note: format!("{m}x{n}x{k} bf16, LM head"),
            });
        }
    }
    out
}
