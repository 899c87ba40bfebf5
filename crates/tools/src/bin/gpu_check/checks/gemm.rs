//! The `gemm` family of checks.

use std::fmt::Write as _;

use rayon::prelude::*;
use tpar_kernels::cuda::cublaslt::CublasLt;
use tpar_kernels::cuda::raw::gemm;
use tpar_kernels::cuda::raw::gemm::{GemmProblem, GemmTile};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::gemm::GemmShape;

use CudaDType::{BF16, F16, F32};

use super::{bound, Ctx, DTYPES, LAYOUTS};
use crate::data::dn;
use crate::dev::Dev;
use crate::Res;

pub(crate) fn layout_name(ta: bool, tb: bool) -> &'static str {
    match (ta, tb) {
        (false, false) => "nn",
        (false, true) => "nt",
        (true, false) => "tn",
        (true, true) => "tt",
    }
}

pub(crate) fn check_gemm(c: &mut Ctx) {
    let big = !c.quick;
    // Quick sizes still span several 64x64 tiles and k steps.
    let (m, n, k) = if big { (1024, 1024, 1024) } else { (160, 144, 96) };
    for dt in DTYPES {
        for (ta, tb) in LAYOUTS {
            let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
            gemm_case(c, GemmProblem::new(s, dt, dt), None);
        }
    }
    // Rows that are not 16-byte aligned: the element-wise tensor-core kernel.
    let (m, n, k) = if big { (1023, 997, 515) } else { (37, 29, 45) };
    for dt in DTYPES {
        gemm_case(c, GemmProblem::new(GemmShape::new(1, m, n, k), dt, dt), None);
    }
    // f32 output of 16-bit inputs.
    let (m, n, k) = if big { (1024, 1024, 1024) } else { (160, 144, 96) };
    for dt in [BF16, F16] {
        for (ta, tb) in [(false, false), (false, true)] {
            let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
            gemm_case(c, GemmProblem::new(s, dt, F32), None);
        }
    }
    // Every tile; scales with C read; a batch with a broadcast B.
    let (m, n, k) = if big { (512, 384, 256) } else { (200, 136, 80) };
    for tile in GemmTile::ALL {
        for dt in [F32, BF16] {
            gemm_case(c, GemmProblem::new(GemmShape::new(1, m, n, k), dt, dt), Some(tile));
        }
    }
    let s = GemmShape { b_batch_stride: 0, ..GemmShape::new(3, m, n, k) };
    gemm_case(c, GemmProblem::new(s, BF16, BF16).with_scale(0.5, 2.0), None);
    gemm_case(c, GemmProblem::new(s, F32, F32).with_scale(-1.5, 0.5), None);
    if big {
        // Llama-8B MLP projections at 4096 tokens: down (K = 14336) and
        // gate/up (N = 14336, weight stored [N, K] as a Linear keeps it).
        gemm_sampled(c, 4096, 4096, 14336, false, false);
        gemm_sampled(c, 4096, 14336, 4096, false, true);
        if let Some(lt) = c.lt {
            for (ta, tb) in [(false, false), (false, true)] {
                let s =
                    GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, 1024, 1024, 1024) };
                cublaslt_case(c, lt, GemmProblem::new(s, BF16, BF16));
            }
        }
    }
    if let Some(lt) = c.lt {
        // The residual GEMM of `linear_add` (x W^T + r), C read from its own
        // buffer and D written to another (cuBLASLt's separate C and D).
        let (m, n, k) = if big { (1024, 1024, 1024) } else { (160, 144, 96) };
        for dt in [BF16, F32] {
            let s = GemmShape { trans_b: true, ..GemmShape::new(1, m, n, k) };
            cublaslt_to_case(c, lt, GemmProblem::new(s, dt, dt).with_scale(1.0, 1.0));
        }
    }
    super::gemm_hopper::check_gemm_hopper(c);
}

/// Host operands of one product and its f64 reference.
pub(crate) struct GemmData {
    pub(crate) a: Vec<f64>,
    pub(crate) b: Vec<f64>,
    /// The old C (zeros unless `beta != 0`).
    pub(crate) c_old: Vec<f64>,
    pub(crate) want: Vec<f64>,
}

/// Random operands of `p` and the CPU reference `alpha * op(A) op(B) + beta * C`.
pub(crate) fn gemm_inputs(c: &mut Ctx, p: &GemmProblem) -> Res<GemmData> {
    let s = p.shape;
    let a_len = (s.batch - 1) * s.a_batch_stride + s.m * s.k;
    let b_len = (s.batch - 1) * s.b_batch_stride + s.k * s.n;
    let c_len = s.batch * s.m * s.n;
    let a = c.rng.vals(p.dtype_in, a_len, -1.0, 1.0);
    let b = c.rng.vals(p.dtype_in, b_len, -1.0, 1.0);
    let c_old =
        if p.beta != 0.0 { c.rng.vals(p.dtype_out, c_len, -1.0, 1.0) } else { vec![0.0; c_len] };
    let mut want = vec![0.0f64; c_len];
    tpar_kernels::gemm::matmul::<f64>(&s, &a, &b, &mut want, false)?;
    let (alpha, beta) = (p.alpha as f64, p.beta as f64);
    for (w, o) in want.iter_mut().zip(&c_old) {
        *w = alpha * *w + beta * o;
    }
    Ok(GemmData { a, b, c_old, want })
}

pub(crate) fn gemm_label(p: &GemmProblem) -> (String, String) {
    let s = p.shape;
    let dtype = if p.dtype_in == p.dtype_out {
        dn(p.dtype_in).to_string()
    } else {
        format!("{}>{}", dn(p.dtype_in), dn(p.dtype_out))
    };
    let mut shape = format!("{}x{}x{}", s.m, s.n, s.k);
    if s.batch > 1 {
        let _ = write!(shape, " b{}", s.batch);
    }
    if p.alpha != 1.0 || p.beta != 0.0 {
        let _ = write!(shape, " a{} b{}", p.alpha, p.beta);
    }
    (dtype, shape)
}

pub(crate) fn gemm_case(c: &mut Ctx, p: GemmProblem, tile: Option<GemmTile>) {
    let s = p.shape;
    let name = match tile {
        Some(t) => format!("gemm.{}.{}", layout_name(s.trans_a, s.trans_b), t.name()),
        None => format!("gemm.{}", layout_name(s.trans_a, s.trans_b)),
    };
    let (dtype, shape) = gemm_label(&p);
    c.guard(&name, &dtype, &shape, |c| {
        let d = c.d;
        let GemmData { a, b, c_old, want } = gemm_inputs(c, &p)?;
        let (da, db) = (d.up(p.dtype_in, &a)?, d.up(p.dtype_in, &b)?);
        let dc = if p.beta != 0.0 {
            d.up(p.dtype_out, &c_old)?
        } else {
            d.junk(want.len() * p.dtype_out.size())?
        };
        let tile = tile.unwrap_or_else(|| p.default_tile());
        let kernel = p.plan(tile, da.ptr(), db.ptr(), dc.ptr())?.kernel;
        // SAFETY: A, B and C were allocated above with the extents `p` describes.
        unsafe { gemm::gemm_with_tile(d.l(), &p, tile, da.ptr(), db.ptr(), dc.ptr())? };
        let got = d.down(p.dtype_out, &dc)?;
        c.r.close_note(&name, &dtype, &shape, &got, &want, bound(p.dtype_out), &kernel);
        Ok(())
    });
}

/// A bf16 product too large for a full CPU reference, on tpar's `mma.sync`
/// kernel: 256 random outputs against f64 dot products of the same rounded
/// inputs.
pub(crate) fn gemm_sampled(c: &mut Ctx, m: usize, n: usize, k: usize, ta: bool, tb: bool) {
    sampled(c, "gemm", [m, n, k], ta, tb, |d, p, a, b, out| {
        // SAFETY: the caller allocated A, B and C with the extents `p` describes.
        unsafe { gemm::gemm(d.l(), p, a, b, out)? };
        Ok(())
    });
}

/// `{prefix}.{layout}.sampled`: a bf16 product of `[m, n, k]` run by `run` (on
/// device buffers of A, B and C), checked on 256 random outputs.
pub(crate) fn sampled(
    c: &mut Ctx,
    prefix: &str,
    [m, n, k]: [usize; 3],
    ta: bool,
    tb: bool,
    run: impl FnOnce(&Dev, &GemmProblem, DevPtr, DevPtr, DevPtr) -> Res<()>,
) {
    let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
    let p = GemmProblem::new(s, BF16, BF16);
    let name = format!("{prefix}.{}.sampled", layout_name(ta, tb));
    let shape = format!("{m}x{n}x{k} (256 outputs)");
    c.guard(&name, "bf16", &shape, |c| {
        let d = c.d;
        let a = c.rng.vals(BF16, m * k, -1.0, 1.0);
        let b = c.rng.vals(BF16, k * n, -1.0, 1.0);
        let (da, db, dc) = (d.up(BF16, &a)?, d.up(BF16, &b)?, d.junk(m * n * 2)?);
        run(d, &p, da.ptr(), db.ptr(), dc.ptr())?;
        let out = d.down(BF16, &dc)?;
        let picks: Vec<(usize, usize)> =
            (0..256).map(|_| (c.rng.below(m), c.rng.below(n))).collect();
        let want: Vec<f64> = picks
            .par_iter()
            .map(|&(i, j)| {
                (0..k)
                    .map(|kk| {
                        let x = if ta { a[kk * m + i] } else { a[i * k + kk] };
                        let y = if tb { b[j * k + kk] } else { b[kk * n + j] };
                        x * y
                    })
                    .sum()
            })
            .collect();
        let got: Vec<f64> = picks.iter().map(|&(i, j)| out[i * n + j]).collect();
        c.r.close(&name, "bf16", &shape, &got, &want, bound(BF16));
        Ok(())
    });
}

/// The cuBLASLt baseline itself, against the same reference.
/// [`CublasLt::matmul_to`]: D close to `alpha * op(A) op(B) + beta * C`, and C
/// left exactly as it was.
fn cublaslt_to_case(c: &mut Ctx, lt: &CublasLt, p: GemmProblem) {
    let s = p.shape;
    let name = format!("cublaslt.to.{}", layout_name(s.trans_a, s.trans_b));
    let (dtype, shape) = gemm_label(&p);
    c.guard(&name, &dtype, &shape, |c| {
        let d = c.d;
        let GemmData { a, b, c_old, want } = gemm_inputs(c, &p)?;
        let (da, db) = (d.up(p.dtype_in, &a)?, d.up(p.dtype_in, &b)?);
        let dc = d.up(p.dtype_out, &c_old)?;
        let dd = d.junk(want.len() * p.dtype_out.size())?;
        // SAFETY: A, B, C and D were allocated above on this GPU with the extents `p`
        // describes; D is its own allocation.
        unsafe { lt.matmul_to(&p, da.ptr(), db.ptr(), dc.ptr(), dd.ptr())? };
        let got = d.down(p.dtype_out, &dd)?;
        c.r.close(&name, &dtype, &shape, &got, &want, bound(p.dtype_out));
        let c_after = d.down(p.dtype_out, &dc)?;
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        c.r.exact(&format!("{name}.c_kept"), &dtype, &shape, &bits(&c_after), &bits(&c_old));
        Ok(())
    });
}

pub(crate) fn cublaslt_case(c: &mut Ctx, lt: &CublasLt, p: GemmProblem) {
    let s = p.shape;
    let name = format!("cublaslt.{}", layout_name(s.trans_a, s.trans_b));
    let (dtype, shape) = gemm_label(&p);
    c.guard(&name, &dtype, &shape, |c| {
        let d = c.d;
        let GemmData { a, b, want, .. } = gemm_inputs(c, &p)?;
        let (da, db) = (d.up(p.dtype_in, &a)?, d.up(p.dtype_in, &b)?);
        let dc = d.junk(want.len() * p.dtype_out.size())?;
        // SAFETY: A, B and C were allocated above on this GPU with the extents `p` describes.
        unsafe { lt.matmul(&p, da.ptr(), db.ptr(), dc.ptr())? };
        let got = d.down(p.dtype_out, &dc)?;
        c.r.close(&name, &dtype, &shape, &got, &want, bound(p.dtype_out));
        Ok(())
    });
}
