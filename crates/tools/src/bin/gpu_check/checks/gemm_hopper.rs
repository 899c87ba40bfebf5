//! The Hopper GEMM's checks (part of the `gemm` family), where the device
//! runs it: a GPU whose kernels are compiled for `sm_90a`, or the emulator
//! with `TPAR_EMU_ARCH=sm_90a`. Every layout and type pair, a problem with
//! partial tiles and K not a multiple of 64, scales with C read over a batch
//! with a broadcast B, each epilogue against the unfused computation, and on
//! a GPU the Llama-8B projections on sampled outputs; then the same kernel
//! with 2-block clusters (A multicast; names `gemm_hopper.c2.*`): every
//! layout, partial tiles with an odd tile count along N, the batch with a
//! broadcast operand, an epilogue and a sampled projection. All of it again
//! with 128 x 256 tiles (`HopperConfig::tile_n` 256; names
//! `gemm_hopper.n256.*` and `gemm_hopper.n256.c2.*`), where the partial
//! tiles reach past a multiple of 256 columns.

use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::raw::gemm_hopper::{
    self, AuxInput, AuxOp, Epilogue, HopperConfig, HopperTarget, EMU_ARCH_ENV,
};
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::gemm::GemmShape;

use CudaDType::{BF16, F16, F32};

use super::gemm::{gemm_inputs, gemm_label, layout_name, sampled, GemmData};
use super::{bound, Ctx, LAYOUTS};

/// The fused step a check adds after the product.
#[derive(Clone, Copy, PartialEq)]
enum Fused {
    None,
    Bias,
    Residual,
    SiluMul,
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub(crate) fn check_gemm_hopper(c: &mut Ctx) {
    let Some(target) = HopperTarget::of(&*c.d.mem) else {
        println!(
            "   gemm_hopper: skipped (the device does not run sm_90a kernels; in the emulator \
             set {EMU_ARCH_ENV}=sm_90a)"
        );
        return;
    };
    for tile_n in [128, 256] {
        let cfg = HopperConfig { cluster: 1, tile_n };
        block_checks(c, (target, cfg));
        cluster_checks(c, (target, HopperConfig { cluster: 2, ..cfg }));
    }
}

/// Every layout and type pair, partial tiles, scales over a batch with a
/// broadcast B, the three epilogues and (on a GPU) two sampled Llama-8B
/// projections, without clusters at `cfg`'s tile width.
fn block_checks(c: &mut Ctx, target: (HopperTarget, HopperConfig)) {
    let big = !c.quick;
    let wide = target.1.tile_n == 256;
    let (m, n, k) = if big { (1024, 1024, 1024) } else { (160, 144, 96) };
    for dt in [BF16, F16] {
        for out in [dt, F32] {
            for (ta, tb) in LAYOUTS {
                let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
                hopper_case(c, target, GemmProblem::new(s, dt, out), Fused::None);
            }
        }
    }
    // Partial tiles in M and N (at 256 columns: N past a multiple of 256), K
    // not a multiple of the 64-wide k step.
    let (m, n, k) = match (big, wide) {
        (true, _) => (1000, 776, 520),
        (false, false) => (200, 136, 72),
        (false, true) => (200, 264, 72),
    };
    for (ta, tb) in LAYOUTS {
        let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
        hopper_case(c, target, GemmProblem::new(s, BF16, BF16), Fused::None);
    }
    // Scales with C read, over a batch with one B for every batch.
    let s = GemmShape { b_batch_stride: 0, ..GemmShape::new(3, m, n, k) };
    hopper_case(c, target, GemmProblem::new(s, BF16, BF16).with_scale(0.5, 2.0), Fused::None);
    hopper_case(c, target, GemmProblem::new(s, F16, F32).with_scale(-1.5, 0.5), Fused::None);
    // The epilogues, on the layout of a linear layer's forward (B = W stored [n, k]).
    let s = GemmShape { trans_b: true, ..GemmShape::new(1, m, n, k) };
    for fused in [Fused::Bias, Fused::Residual, Fused::SiluMul] {
        hopper_case(c, target, GemmProblem::new(s, BF16, BF16), fused);
    }
    if big {
        hopper_sampled(c, target, [4096, 4096, 14336], false, false);
        hopper_sampled(c, target, [4096, 14336, 4096], false, true);
    }
}

/// 2-block clusters at `cfg`'s tile width: every layout, partial tiles with
/// N of an odd number of tiles (the last pair's second block past N), a
/// batch with a broadcast A (the multicast operand), an epilogue and (on a
/// GPU) a sampled projection.
fn cluster_checks(c: &mut Ctx, target: (HopperTarget, HopperConfig)) {
    let big = !c.quick;
    // (at 256 columns, 1160 is 5 tiles and 520 is 3)
    let (m, n, k) = match (big, target.1.tile_n == 256) {
        (true, _) => (1000, 1160, 520),
        (false, false) => (200, 264, 72),
        (false, true) => (200, 520, 72),
    };
    for (ta, tb) in LAYOUTS {
        let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
        hopper_case(c, target, GemmProblem::new(s, BF16, BF16), Fused::None);
    }
    let s = GemmShape { a_batch_stride: 0, ..GemmShape::new(3, m, n, k) };
    hopper_case(c, target, GemmProblem::new(s, F16, F32).with_scale(-1.5, 0.5), Fused::None);
    let s = GemmShape { trans_b: true, ..GemmShape::new(1, m, n, k) };
    hopper_case(c, target, GemmProblem::new(s, BF16, BF16), Fused::SiluMul);
    if big {
        hopper_sampled(c, target, [4096, 14336, 4096], false, true);
    }
}

/// The check's name prefix for a launch configuration: `gemm_hopper`, then
/// `.n256` for 128 x 256 tiles and `.c2` for 2-block clusters.
fn prefix(cfg: HopperConfig) -> &'static str {
    match (cfg.tile_n == 256, cfg.cluster == 2) {
        (false, false) => "gemm_hopper",
        (false, true) => "gemm_hopper.c2",
        (true, false) => "gemm_hopper.n256",
        (true, true) => "gemm_hopper.n256.c2",
    }
}

fn hopper_case(
    c: &mut Ctx,
    (target, cfg): (HopperTarget, HopperConfig),
    p: GemmProblem,
    fused: Fused,
) {
    let s = p.shape;
    let lay = layout_name(s.trans_a, s.trans_b);
    let pre = prefix(cfg);
    let name = match fused {
        Fused::None => format!("{pre}.{lay}"),
        Fused::Bias => format!("{pre}.{lay}.bias"),
        Fused::Residual => format!("{pre}.{lay}.residual"),
        Fused::SiluMul => format!("{pre}.{lay}.silu_mul"),
    };
    let (dtype, shape) = gemm_label(&p);
    c.guard(&name, &dtype, &shape, |c| {
        let d = c.d;
        let GemmData { a, b, c_old, mut want } = gemm_inputs(c, &p)?;
        let (da, db) = (d.up(p.dtype_in, &a)?, d.up(p.dtype_in, &b)?);
        let dc = if p.beta != 0.0 {
            d.up(p.dtype_out, &c_old)?
        } else {
            d.junk(want.len() * p.dtype_out.size())?
        };
        let (mn, n) = (s.m * s.n, s.n);
        // The epilogue's inputs in C's type, and the reference after it.
        let (bias, aux) = match fused {
            Fused::None => (None, None),
            Fused::Bias => {
                let v = c.rng.vals(p.dtype_out, n, -1.0, 1.0);
                for (i, w) in want.iter_mut().enumerate() {
                    *w += v[i % n];
                }
                (Some(d.up(p.dtype_out, &v)?), None)
            }
            Fused::Residual | Fused::SiluMul => {
                let v = c.rng.vals(p.dtype_out, mn, -3.0, 3.0);
                for (w, x) in want.iter_mut().zip(&v) {
                    *w = if fused == Fused::Residual { *w + x } else { silu(*x) * *w };
                }
                (None, Some(d.up(p.dtype_out, &v)?))
            }
        };
        let epi = Epilogue {
            bias: bias.as_ref().map(|b| b.ptr()),
            aux: aux.as_ref().map(|x| AuxInput {
                ptr: x.ptr(),
                ld: n,
                batch_stride: mn,
                op: if fused == Fused::Residual { AuxOp::Residual } else { AuxOp::SiluMul },
            }),
            rope: None,
        };
        let (ap, bp, cp) = (da.ptr(), db.ptr(), dc.ptr());
        let kernel = gemm_hopper::plan_with(&p, &epi, target, cfg, ap, bp, cp)?.kernel;
        // SAFETY: A, B, C, the bias and the matrix were allocated above with the
        // extents `p` describes (bias n, matrix m x n, both in C's type).
        unsafe { gemm_hopper::gemm_with(d.l(), target, cfg, &p, &epi, ap, bp, cp)? };
        let got = d.down(p.dtype_out, &dc)?;
        c.r.close_note(&name, &dtype, &shape, &got, &want, bound(p.dtype_out), &kernel);
        Ok(())
    });
}

/// A Llama-8B-sized bf16 product on the Hopper kernel, checked on 256
/// sampled outputs.
fn hopper_sampled(
    c: &mut Ctx,
    (target, cfg): (HopperTarget, HopperConfig),
    mnk: [usize; 3],
    ta: bool,
    tb: bool,
) {
    sampled(c, prefix(cfg), mnk, ta, tb, |d, p, a, b, out| {
        let epi = Epilogue::default();
        // SAFETY: the caller allocated A, B and C with the extents `p` describes.
        unsafe { gemm_hopper::gemm_with(d.l(), target, cfg, p, &epi, a, b, out)? };
        Ok(())
    });
}
