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
//! tiles reach past a multiple of 256 columns. Last the rotary-embedding
//! epilogue on a packed qkv projection with a bias (`gemm_hopper.rope.*`):
//! the kernel at both tile widths and the unfused path against the f64
//! reference, and fused against unfused.

use tpar_kernels::cuda::ops::gemm_fused::{gemm_fused_via, EpiloguePath, FusedEpilogue, FusedRope};
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::raw::gemm_hopper::{
    self, AuxInput, AuxOp, Epilogue, HopperConfig, HopperTarget, RopeEpilogue, EMU_ARCH_ENV,
};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer};
use tpar_kernels::gemm::GemmShape;

use CudaDType::{BF16, F16, F32};

use super::gemm::{gemm_inputs, gemm_label, layout_name, sampled, GemmData};
use super::rope::rope_tables;
use super::{bound, Ctx, LAYOUTS};
use crate::data::dn;
use crate::Res;

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
    rope_checks(c, target);
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

/// How a rotary-embedding check computes C.
#[derive(Clone, Copy)]
enum RopeVia {
    /// The Hopper kernel on this target at this configuration.
    Kernel(HopperTarget, HopperConfig),
    /// `gemm_fused_via` on the unfused path (the plain GEMM, the bias, then
    /// rope's kernel in place).
    Unfused,
}

/// A packed qkv projection's inputs on the device and its f64 reference:
/// `x [m, k]` and the weights stored `[n, k]` in bf16, the bias and the
/// `[seq, hd]` tables in C's dtype; C's first `cols` columns rotated.
struct RopeCase {
    p: GemmProblem,
    seq: usize,
    hd: usize,
    cols: usize,
    bufs: [DeviceBuffer; 5],
    want: Vec<f64>,
}

impl RopeCase {
    fn new(
        c: &mut Ctx,
        dt: CudaDType,
        (seqs, seq, k): (usize, usize, usize),
        (hq, hkv, hd): (usize, usize, usize),
    ) -> Res<Self> {
        let (m, n, cols) = (seqs * seq, (hq + 2 * hkv) * hd, (hq + hkv) * hd);
        let s = GemmShape { trans_b: true, ..GemmShape::new(1, m, n, k) };
        let p = GemmProblem::new(s, BF16, dt);
        let GemmData { a, b, mut want, .. } = gemm_inputs(c, &p)?;
        let bias = c.rng.vals(dt, n, -1.0, 1.0);
        let (cos, sin) = rope_tables(dt, seq, hd);
        let half = hd / 2;
        for (r, row) in want.chunks_exact_mut(n).enumerate() {
            for (w, x) in row.iter_mut().zip(&bias) {
                *w += x;
            }
            let t = (r % seq) * hd;
            for h in (0..cols).step_by(hd) {
                for j in 0..half {
                    let (v1, v2) = (row[h + j], row[h + j + half]);
                    row[h + j] = v1 * cos[t + j] - v2 * sin[t + j];
                    row[h + j + half] = v2 * cos[t + j + half] + v1 * sin[t + j + half];
                }
            }
        }
        let d = c.d;
        let bufs =
            [d.up(BF16, &a)?, d.up(BF16, &b)?, d.up(dt, &bias)?, d.up(dt, &cos)?, d.up(dt, &sin)?];
        Ok(RopeCase { p, seq, hd, cols, bufs, want })
    }

    /// C computed via `via`, and the kernel's name (or the path's).
    fn run(&self, c: &Ctx, via: RopeVia) -> Res<(Vec<f64>, String)> {
        let d = c.d;
        let [a, b, bias, cos, sin] = &self.bufs;
        let dt = self.p.dtype_out;
        let mut out = d.junk(self.want.len() * dt.size())?;
        let note = match via {
            RopeVia::Kernel(t, cfg) => {
                let rope = RopeEpilogue {
                    cos: cos.ptr(),
                    sin: sin.ptr(),
                    head_dim: self.hd,
                    cols: self.cols,
                    seq: self.seq,
                };
                let epi = Epilogue { bias: Some(bias.ptr()), aux: None, rope: Some(rope) };
                let (ap, bp, cp) = (a.ptr(), b.ptr(), out.ptr());
                let kernel = gemm_hopper::plan_with(&self.p, &epi, t, cfg, ap, bp, cp)?.kernel;
                // SAFETY: A, B, C, the bias and the tables were allocated with
                // the extents `p` describes (bias n, tables seq x hd, in C's
                // dtype).
                unsafe { gemm_hopper::gemm_with(d.l(), t, cfg, &self.p, &epi, ap, bp, cp)? };
                kernel
            }
            RopeVia::Unfused => {
                let rope = FusedRope {
                    cos: cos.as_slice(),
                    sin: sin.as_slice(),
                    head_dim: self.hd,
                    cols: self.cols,
                    seq: self.seq,
                };
                let fe = FusedEpilogue { bias: Some(bias.as_slice()), aux: None, rope: Some(rope) };
                let path = EpiloguePath::Unfused;
                gemm_fused_via(
                    &*d.mem,
                    path,
                    &self.p,
                    fe,
                    a.as_slice(),
                    b.as_slice(),
                    out.as_slice_mut(),
                )?;
                "unfused".to_string()
            }
        };
        Ok((d.down(dt, &out)?, note))
    }
}

/// The rotary-embedding epilogue (`gemm_hopper.rope.<dtype>.*`) on a packed
/// qkv projection with a bias, bf16 inputs, bf16 and f32 C (whose epilogue
/// image is the staging chunk, rotated in place), heads of 64: the kernel
/// at tile widths 128 and 256 and the unfused path against the f64
/// reference, and the kernel at 128 against the unfused path. Quick: 3 sequences of 24 rows (positions
/// wrap inside a tile), 4 + 2 + 2 heads, K 64; else a training step's
/// shape: 2 sequences of 256, 16 + 8 + 8 heads, K 1024.
fn rope_checks(c: &mut Ctx, target: HopperTarget) {
    let (rows, heads) =
        if c.quick { ((3, 24, 64), (4, 2, 64)) } else { ((2, 256, 1024), (16, 8, 64)) };
    let kernel = |tile_n| RopeVia::Kernel(target, HopperConfig { cluster: 1, tile_n });
    let label = |rc: &RopeCase| {
        let (dt, shape) = gemm_label(&rc.p);
        (dt, format!("{shape} seq{} hd{} rot{}", rc.seq, rc.hd, rc.cols))
    };
    for dt in [BF16, F32] {
        let pre = format!("gemm_hopper.rope.{}", dn(dt));
        c.guard(&pre, dn(dt), "", |c| {
            let rc = RopeCase::new(c, dt, rows, heads)?;
            let (dt, shape) = label(&rc);
            let mut outs = Vec::new();
            for (variant, via) in
                [("n128", kernel(128)), ("n256", kernel(256)), ("unfused", RopeVia::Unfused)]
            {
                let (got, note) = rc.run(c, via)?;
                let name = format!("{pre}.{variant}");
                c.r.close_note(&name, &dt, &shape, &got, &rc.want, bound(rc.p.dtype_out), &note);
                outs.push(got);
            }
            let name = format!("{pre}.fused_vs_unfused");
            c.r.close(&name, &dt, &shape, &outs[0], &outs[2], bound(rc.p.dtype_out));
            Ok(())
        });
    }
}
