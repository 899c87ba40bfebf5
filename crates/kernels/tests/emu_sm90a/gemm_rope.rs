//! The rotary embedding in the Hopper GEMM's epilogue (`EPI_ROPE`,
//! `cuda::ops::gemm_fused::FusedRope`) in the CPU emulator standing in for an
//! `sm_90a` device: the q and k heads of a packed `[rows, (hq + 2 hkv) * hd]`
//! projection (with a bias) rotated where the GEMM writes them, on the fused
//! path (the kernel at tile widths 128 and 256) and the unfused one (the plain
//! GEMM, the bias, then rope's kernel in place), each against an f64 reference
//! of the same rounded inputs: bf16, f16 and f32 C, head dims 64 and 128, rows
//! that end mid-sequence and sequences that end mid-tile, one batch or two
//! with padded rows and batches in C. The v columns must equal the same
//! path's plain GEMM with the bias bit for bit, and C's padding must survive.

use std::sync::Arc;

use half::{bf16, f16};
use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::ops::gemm::GemmProblem;
use tpar_kernels::cuda::ops::gemm_fused::{gemm_fused_via, EpiloguePath, FusedEpilogue, FusedRope};
use tpar_kernels::cuda::raw::gemm_hopper::{
    self, Epilogue, HopperConfig, HopperTarget, RopeEpilogue, EMU_ARCH_ENV,
};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, GpuDevice};
use tpar_kernels::gemm::GemmShape;
use tpar_kernels::KernelError;

use crate::common::data;
use CudaDType::{BF16, F16, F32};

/// The emulated device, standing in for an `sm_90a` one (so that
/// [`EpiloguePath::Auto`] may pick the fused path).
fn dev() -> Arc<dyn GpuDevice> {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    EmulatedGpu::open(0).expect("the CPU emulator builds")
}

/// `x` rounded to `dt`: its value, and its little-endian bytes in `dt`.
fn to_dtype(dt: CudaDType, x: f64) -> (f64, Vec<u8>) {
    match dt {
        F32 => (x as f32 as f64, (x as f32).to_le_bytes().to_vec()),
        BF16 => (bf16::from_f64(x).to_f64(), bf16::from_f64(x).to_le_bytes().to_vec()),
        F16 => (f16::from_f64(x).to_f64(), f16::from_f64(x).to_le_bytes().to_vec()),
    }
}

/// `v` rounded to `dt`, as f64.
fn round(dt: CudaDType, v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| to_dtype(dt, x).0).collect()
}

/// A device buffer holding `v` in `dt`.
fn upload(dev: &Arc<dyn GpuDevice>, dt: CudaDType, v: &[f64]) -> DeviceBuffer {
    let bytes: Vec<u8> = v.iter().flat_map(|&x| to_dtype(dt, x).1).collect();
    DeviceBuffer::from_host(dev, &bytes).unwrap()
}

/// The buffer's elements of `dt` as f64.
fn download(b: &DeviceBuffer, dt: CudaDType) -> Vec<f64> {
    let bytes = b.to_host().unwrap();
    let el = |c: &[u8]| match dt {
        F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
        BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f64(),
        F16 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
    };
    bytes.chunks_exact(dt.size()).map(el).collect()
}

/// What C's padding holds before and after.
const PAD: f64 = 7.0;

/// One problem: `batch` x `m` rows (position `row % seq`) of a packed qkv
/// projection of `hq` query and `hkv` key/value heads of `hd`, K = `k`; C's
/// rows `pad_ld` wider than `n` and its batches `pad_batch` further apart.
#[derive(Clone, Copy, Debug)]
struct Case {
    dout: CudaDType,
    batch: usize,
    m: usize,
    seq: usize,
    k: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    pad_ld: usize,
    pad_batch: usize,
}

impl Case {
    fn n(&self) -> usize {
        (self.hq + 2 * self.hkv) * self.hd
    }
    fn cols(&self) -> usize {
        (self.hq + self.hkv) * self.hd
    }
    fn ldc(&self) -> usize {
        self.n() + self.pad_ld
    }
    fn cbs(&self) -> usize {
        self.m * self.ldc() + self.pad_batch
    }
    /// A = x [m, k] and B = the packed weights stored [n, k] (a linear
    /// layer's forward), 16-bit inputs of C's width.
    fn problem(&self) -> GemmProblem {
        let din = if self.dout == F16 { F16 } else { BF16 };
        let s = GemmShape { trans_b: true, ..GemmShape::new(self.batch, self.m, self.n(), self.k) };
        GemmProblem::new(s, din, self.dout)
            .with_leading_dims(self.k, self.k, self.ldc())
            .with_c_batch_stride(self.cbs())
    }
}

/// The rounded inputs of a case: A, B, the bias, the tables (`max(m, seq)`
/// rows: those past `seq` differ from the first ones, so a position taken
/// as the row rather than `row % seq` reads other values).
struct Inputs {
    a: Vec<f64>,
    b: Vec<f64>,
    bias: Vec<f64>,
    cos: Vec<f64>,
    sin: Vec<f64>,
}

fn inputs(cs: &Case) -> Inputs {
    let p = cs.problem();
    let (m, n, k) = (cs.m, cs.n(), cs.k);
    let rows = cs.m.max(cs.seq);
    // angles t * theta_j as in Llama's tables, for the first `seq` rows
    let half = cs.hd / 2;
    let mut cos = Vec::with_capacity(rows * cs.hd);
    let mut sin = Vec::with_capacity(rows * cs.hd);
    let other = data(2 * rows * cs.hd, 9, 1.0);
    for t in 0..rows {
        for j in 0..cs.hd {
            let (c, s) = if t < cs.seq {
                let theta = 10000f64.powf(-((j % half) as f64) / half as f64);
                let ang = t as f64 * theta;
                (ang.cos(), ang.sin())
            } else {
                (other[2 * (t * cs.hd + j)], other[2 * (t * cs.hd + j) + 1])
            };
            cos.push(c);
            sin.push(s);
        }
    }
    Inputs {
        a: round(p.dtype_in, &data(cs.batch * m * k, 1, 1.0)),
        b: round(p.dtype_in, &data(cs.batch * n * k, 2, 0.5)),
        bias: round(cs.dout, &data(n, 3, 1.0)),
        cos: round(cs.dout, &cos),
        sin: round(cs.dout, &sin),
    }
}

/// The f64 reference of C (padding included): the product plus the bias,
/// then the rotation of the first `cols` columns.
fn reference(cs: &Case, x: &Inputs) -> (Vec<f64>, Vec<f64>) {
    let (m, n, k, ldc, cbs) = (cs.m, cs.n(), cs.k, cs.ldc(), cs.cbs());
    let mut want = vec![PAD; cs.batch * cbs];
    // the magnitude of the terms each element sums (for the tolerance: the
    // unfused path rounds the product before it adds the bias)
    let mut mag = vec![0.0; cs.batch * cbs];
    let half = cs.hd / 2;
    for bi in 0..cs.batch {
        for i in 0..m {
            let dot = |j: usize| -> f64 {
                (0..k).map(|l| x.a[(bi * m + i) * k + l] * x.b[(bi * n + j) * k + l]).sum()
            };
            let v: Vec<f64> = (0..n).map(|j| dot(j) + x.bias[j]).collect();
            let terms: Vec<f64> = (0..n).map(|j| dot(j).abs() + x.bias[j].abs()).collect();
            let t = i % cs.seq;
            for j in 0..n {
                let at = bi * cbs + i * ldc + j;
                (want[at], mag[at]) = if j < cs.cols() {
                    let (h, jj) = (j / cs.hd * cs.hd, j % cs.hd % half);
                    let (v1, v2) = (v[h + jj], v[h + jj + half]);
                    let tab = |tab: &[f64], c: usize| tab[t * cs.hd + c];
                    let y = if j % cs.hd < half {
                        v1 * tab(&x.cos, jj) - v2 * tab(&x.sin, jj)
                    } else {
                        v2 * tab(&x.cos, jj + half) + v1 * tab(&x.sin, jj + half)
                    };
                    (y, terms[h + jj] + terms[h + jj + half])
                } else {
                    (v[j], terms[j])
                };
            }
        }
    }
    (want, mag)
}

/// Which computation runs a case.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Via {
    /// `gemm_fused_via` on this path (the fused one at the configuration
    /// `hopper_config` picks: tile width 128 unless the environment says).
    Op(EpiloguePath),
    /// The kernel at this configuration (`gemm_hopper::gemm_with`).
    Kernel(HopperConfig),
}

/// Runs `cs` via `via`, with the rotary embedding or (`rope` false) the bias
/// alone; returns C (padding included) and the path that ran (`Auto` for the
/// kernel).
fn run_on(
    cs: &Case,
    x: &Inputs,
    via: Via,
    rope: bool,
) -> Result<(Vec<f64>, EpiloguePath), KernelError> {
    let dev = dev();
    let p = cs.problem();
    let (da, db) = (upload(&dev, p.dtype_in, &x.a), upload(&dev, p.dtype_in, &x.b));
    let dbias = upload(&dev, cs.dout, &x.bias);
    let (dcos, dsin) = (upload(&dev, cs.dout, &x.cos), upload(&dev, cs.dout, &x.sin));
    let mut dc = upload(&dev, cs.dout, &vec![PAD; cs.batch * cs.cbs()]);
    match via {
        Via::Op(path) => {
            let fr = FusedRope {
                cos: dcos.as_slice(),
                sin: dsin.as_slice(),
                head_dim: cs.hd,
                cols: cs.cols(),
                seq: cs.seq,
            };
            let fe =
                FusedEpilogue { bias: Some(dbias.as_slice()), aux: None, rope: rope.then_some(fr) };
            let (a, b, c) = (da.as_slice(), db.as_slice(), dc.as_slice_mut());
            let took = gemm_fused_via(&*dev, path, &p, fe, a, b, c)?;
            return Ok((download(&dc, cs.dout), took));
        }
        Via::Kernel(cfg) => {
            let r = RopeEpilogue {
                cos: dcos.ptr(),
                sin: dsin.ptr(),
                head_dim: cs.hd,
                cols: cs.cols(),
                seq: cs.seq,
            };
            let epi = Epilogue { bias: Some(dbias.ptr()), aux: None, rope: rope.then_some(r) };
            let t = HopperTarget::emulator(132);
            // SAFETY: every buffer was allocated above with the extents `p`,
            // the bias (n) and the tables (max(m, seq) x hd) describe, in the
            // problem's dtypes; C overlaps none of them.
            unsafe {
                gemm_hopper::gemm_with(&*dev, t, cfg, &p, &epi, da.ptr(), db.ptr(), dc.ptr())?
            };
        }
    }
    Ok((download(&dc, cs.dout), EpiloguePath::Auto))
}

/// [`run_on`] on a path that must be the one asked for.
fn run(cs: &Case, x: &Inputs, via: Via, rope: bool) -> Result<Vec<f64>, KernelError> {
    let (got, took) = run_on(cs, x, via, rope)?;
    if let Via::Op(path) = via {
        assert_eq!(took, path, "{cs:?}");
    }
    Ok(got)
}

/// The unit in the last place at 1 of C's dtype.
fn ulp1(dt: CudaDType) -> f64 {
    match dt {
        F32 => f64::powi(2.0, -23),
        BF16 => f64::powi(2.0, -7),
        F16 => f64::powi(2.0, -10),
    }
}

/// `got` against the reference: f32 within 1e-5 of the largest magnitude;
/// 16-bit within 3 units in the last place of the magnitude of the terms
/// each element sums (product, bias, and for a rotated one its pair's: a
/// sum of rounded values may cancel), plus 1e-5 of the largest magnitude
/// (the f32 accumulation); padding untouched.
fn assert_matches(what: &str, cs: &Case, got: &[f64], (want, mag): &(Vec<f64>, Vec<f64>)) {
    let scale = want.iter().fold(1e-30f64, |s, v| s.max(v.abs()));
    for (i, ((&g, &w), &mg)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = match cs.dout {
            F32 => 1e-5 * scale,
            dt => 3.0 * ulp1(dt) * mg.max(w.abs()) + 1e-5 * scale,
        };
        let (bi, r) = (i / cs.cbs(), i % cs.cbs());
        let (row, col) = (r / cs.ldc(), r % cs.ldc());
        assert!(
            (g - w).abs() <= tol,
            "{what} {cs:?}: batch {bi} row {row} col {col}: got {g}, want {w} (tol {tol})"
        );
    }
}

/// Every path of `cs` against the reference, and the v columns against the
/// same path without the rotary embedding, bit for bit.
fn check(cs: &Case, vias: &[Via]) {
    let x = inputs(cs);
    let want = reference(cs, &x);
    for &via in vias {
        let got = run(cs, &x, via, true).unwrap();
        assert_matches(&format!("{via:?}"), cs, &got, &want);
        let plain = run(cs, &x, via, false).unwrap();
        for (i, (g, p)) in got.iter().zip(&plain).enumerate() {
            let col = i % cs.cbs() % cs.ldc();
            if col >= cs.cols() {
                assert_eq!(g.to_bits(), p.to_bits(), "{via:?} {cs:?}: element {i} (col {col})");
            }
        }
    }
}

const FUSED: Via = Via::Op(EpiloguePath::Fused);
const UNFUSED: Via = Via::Op(EpiloguePath::Unfused);

fn cfg(tile_n: u32) -> Via {
    Via::Kernel(HopperConfig::default().with_tile_n(tile_n).unwrap())
}

/// hq = 4, hkv = 2 heads of 64: N = 512, rotated 384; 72 rows of sequences
/// of 24 (positions wrap inside the 64-row halves of a tile).
const HD64: Case = Case {
    dout: BF16,
    batch: 1,
    m: 72,
    seq: 24,
    k: 64,
    hq: 4,
    hkv: 2,
    hd: 64,
    pad_ld: 0,
    pad_batch: 0,
};

/// hq = 2, hkv = 1 heads of 128: N = 512, rotated 384; 80 rows, the last 8
/// a partial sequence; K past a multiple of 64.
const HD128: Case = Case { m: 80, k: 96, hq: 2, hkv: 1, hd: 128, ..HD64 };

#[test]
fn head_dim_64_bf16_f16_f32_fused_at_both_widths_and_unfused() {
    for dout in [BF16, F16, F32] {
        check(&Case { dout, ..HD64 }, &[FUSED, UNFUSED, cfg(256)]);
    }
}

#[test]
fn head_dim_128_bf16_f16_f32_fused_and_unfused() {
    for dout in [BF16, F16, F32] {
        check(&Case { dout, ..HD128 }, &[FUSED, UNFUSED]);
    }
    // the 64-column chunks of tile width 256 cannot hold a head of 128
    let cs = HD128;
    let e = run(&cs, &inputs(&cs), cfg(256), true).unwrap_err().to_string();
    assert!(e.contains("head dim 128 does not divide the epilogue's chunk of 64"), "{e}");
}

#[test]
fn batches_with_padded_rows_and_partial_sequences() {
    // two batches of 40 rows (sequences of 24: rows 24..39 are positions
    // 0..15 again), C's rows 8 elements wider, batches 24 further apart;
    // hq = 3, hkv = 1: N = 320 ends inside a column tile; then C's rows not
    // 16-byte aligned (the guarded stores)
    let cs = Case { batch: 2, m: 40, pad_ld: 8, pad_batch: 24, hq: 3, hkv: 1, ..HD64 };
    check(&cs, &[FUSED, UNFUSED, cfg(256)]);
    check(&Case { dout: F32, pad_ld: 3, ..cs }, &[FUSED, UNFUSED]);
}

#[test]
fn bad_rope_views_and_combinations_are_typed_errors() {
    let dev = dev();
    let cs = HD64;
    let p = cs.problem();
    let x = inputs(&cs);
    let a = upload(&dev, BF16, &x.a);
    let b = upload(&dev, BF16, &x.b);
    let (cos, sin) = (upload(&dev, BF16, &x.cos), upload(&dev, BF16, &x.sin));
    let gate = upload(&dev, BF16, &vec![1.0; cs.m * cs.n()]);
    let mut c = upload(&dev, BF16, &vec![PAD; cs.m * cs.n()]);
    let good =
        FusedRope { cos: cos.as_slice(), sin: sin.as_slice(), head_dim: 64, cols: 384, seq: 24 };
    let short = cos.slice(0..(24 * 64 - 1) * 2).unwrap();
    let aux = tpar_kernels::cuda::ops::gemm_fused::FusedAux {
        view: gate.as_slice(),
        ld: cs.n(),
        batch_stride: 0,
        op: tpar_kernels::cuda::ops::gemm_fused::AuxOp::SiluMul,
    };
    let cases: [(FusedRope, bool, &str); 6] = [
        (FusedRope { head_dim: 63, ..good }, false, "rotary head dim 63 is not even"),
        (FusedRope { cols: 400, ..good }, false, "rotary columns 400 are not a multiple"),
        (FusedRope { cols: 576, ..good }, false, "within n = 512"),
        (FusedRope { seq: 0, ..good }, false, "rotary sequence length 0"),
        (FusedRope { cos: short, ..good }, false, "rope cos"),
        (good, true, "does not combine with a residual or gate matrix"),
    ];
    for path in [EpiloguePath::Fused, EpiloguePath::Unfused, EpiloguePath::Auto] {
        for (r, with_aux, want) in cases {
            let fe = FusedEpilogue { bias: None, aux: with_aux.then_some(aux), rope: Some(r) };
            let before = c.to_host().unwrap();
            let e =
                gemm_fused_via(&*dev, path, &p, fe, a.as_slice(), b.as_slice(), c.as_slice_mut())
                    .unwrap_err();
            assert!(e.to_string().contains(want), "{path:?} {want}: {e}");
            assert_eq!(c.to_host().unwrap(), before, "{path:?} {want}: a refused launch wrote C");
        }
    }
    // a head dim that divides no chunk width runs unfused on Auto, and is an
    // error on the fused path
    let odd = Case { hq: 2, hkv: 1, hd: 96, m: 24, ..HD64 };
    let xo = inputs(&odd);
    let want = reference(&odd, &xo);
    let (got, took) = run_on(&odd, &xo, Via::Op(EpiloguePath::Auto), true).unwrap();
    assert_eq!(took, EpiloguePath::Unfused);
    assert_matches("auto head dim 96", &odd, &got, &want);
    // (and a head dim the kernel takes runs fused on Auto)
    let (_, took) = run_on(&cs, &x, Via::Op(EpiloguePath::Auto), true).unwrap();
    assert_eq!(took, EpiloguePath::Fused);
    let e = run(&odd, &xo, FUSED, true).unwrap_err().to_string();
    assert!(e.contains("head dim that divides 128 columns, not 96"), "{e}");
}
