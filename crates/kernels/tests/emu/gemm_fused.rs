//! The checked GEMM with a fused epilogue (`cuda::ops::gemm_fused`) on the
//! emulated device: the fused Hopper path and the unfused fallback (plain
//! GEMM, then elementwise ops), for a bias, a residual and SiLU(gate) * up,
//! into bf16 and f32, each against an f64 reference of the rounded inputs and
//! against each other; batched, with padded rows and batches in C and in the
//! epilogue matrix; and the checks that refuse bad views.

use crate::common;

use std::sync::Arc;

use half::bf16;
use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::ops::gemm::GemmProblem;
use tpar_kernels::cuda::ops::gemm_fused::{
    gemm_fused, gemm_fused_via, AuxOp, EpiloguePath, FusedAux, FusedEpilogue,
};
use tpar_kernels::cuda::raw::gemm_hopper::HopperTarget;
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, GpuDevice};
use tpar_kernels::gemm::GemmShape;
use tpar_kernels::KernelError;

use common::{assert_close, data, Elsewhere};
use CudaDType::{BF16, F32};

fn dev() -> Arc<dyn GpuDevice> {
    EmulatedGpu::open(0).expect("the CPU emulator builds")
}

/// `v` rounded to `dt`, as f64.
fn round(dt: CudaDType, v: &[f64]) -> Vec<f64> {
    match dt {
        F32 => v.iter().map(|&x| x as f32 as f64).collect(),
        BF16 => v.iter().map(|&x| bf16::from_f64(x).to_f64()).collect(),
        CudaDType::F16 => v.iter().map(|&x| half::f16::from_f64(x).to_f64()).collect(),
    }
}

/// A device buffer holding `v` in `dt`.
fn upload(dev: &Arc<dyn GpuDevice>, dt: CudaDType, v: &[f64]) -> DeviceBuffer {
    match dt {
        F32 => DeviceBuffer::from_host(dev, &v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        _ => DeviceBuffer::from_host(
            dev,
            &v.iter().map(|&x| bf16::from_f64(x).to_bits()).collect::<Vec<u16>>(),
        ),
    }
    .unwrap()
}

/// The buffer's elements of `dt` as f64.
fn download(b: &DeviceBuffer, dt: CudaDType) -> Vec<f64> {
    let bytes = b.to_host().unwrap();
    match dt {
        F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The epilogue of one case.
#[derive(Clone, Copy, Debug)]
enum Epi {
    Bias,
    Residual,
    SiluMul,
    BiasSiluMul,
}

// batch 2 of [M, K] x [K, N]; C rows LDC apart, batches CBS apart; the
// epilogue matrix rows LDX apart, batches XBS apart (padding everywhere)
const BATCH: usize = 2;
const M: usize = 20;
const N: usize = 24;
const K: usize = 32;
const LDC: usize = 28;
const CBS: usize = M * LDC + 8;
const LDX: usize = 30;
const XBS: usize = M * LDX + 4;
/// What C's padding holds before and after.
const PAD: f64 = 7.0;

/// Where the operands' rows and batches lie.
#[derive(Clone, Copy, Debug)]
struct Layout {
    batch: usize,
    /// C's row stride and batch stride.
    ldc: usize,
    cbs: usize,
    /// The epilogue matrix's row stride and batch stride.
    ldx: usize,
    xbs: usize,
}

/// Padded rows and batches in C and in the epilogue matrix.
const PADDED: Layout = Layout { batch: BATCH, ldc: LDC, cbs: CBS, ldx: LDX, xbs: XBS };

/// One batch, C and the epilogue matrix dense.
const DENSE: Layout = Layout { batch: 1, ldc: N, cbs: M * N, ldx: N, xbs: M * N };

fn problem(din: CudaDType, dout: CudaDType) -> GemmProblem {
    problem_in(PADDED, din, dout)
}

fn problem_in(l: Layout, din: CudaDType, dout: CudaDType) -> GemmProblem {
    GemmProblem::new(GemmShape::new(l.batch, M, N, K), din, dout)
        .with_leading_dims(K, N, l.ldc)
        .with_c_batch_stride(l.cbs)
        .with_scale(1.0, 0.5)
}

/// Runs one case on `path` with the layout `l`; returns the path taken, C's elements (padding
/// included) and the f64 reference of C's elements (padding included).
fn run(
    l: Layout,
    path: EpiloguePath,
    din: CudaDType,
    dout: CudaDType,
    epi: Epi,
) -> (EpiloguePath, Vec<f64>, Vec<f64>) {
    let dev = dev();
    let p = problem_in(l, din, dout);
    let a = round(din, &data(l.batch * M * K, 1, 1.0));
    let b = round(din, &data(l.batch * K * N, 2, 1.0));
    let bias = round(dout, &data(N, 3, 1.0));
    let x = round(dout, &data(l.batch * l.xbs, 4, 2.0));
    let c0v = data(l.batch * l.cbs, 5, 1.0);
    let mut c0 = vec![PAD; l.batch * l.cbs];
    let live = |i: usize| i % l.cbs < M * l.ldc && i % l.cbs % l.ldc < N;
    for (i, v) in c0.iter_mut().enumerate() {
        if live(i) {
            *v = c0v[i];
        }
    }
    let c0 = round(dout, &c0);
    let (da, db, dbias, dx) = (
        upload(&dev, din, &a),
        upload(&dev, din, &b),
        upload(&dev, dout, &bias),
        upload(&dev, dout, &x),
    );
    let mut dc = upload(&dev, dout, &c0);
    let op = match epi {
        Epi::Residual => Some(AuxOp::Residual),
        Epi::SiluMul | Epi::BiasSiluMul => Some(AuxOp::SiluMul),
        Epi::Bias => None,
    };
    let with_bias = matches!(epi, Epi::Bias | Epi::BiasSiluMul);
    let fe = FusedEpilogue {
        bias: with_bias.then(|| dbias.as_slice()),
        aux: op.map(|op| FusedAux { view: dx.as_slice(), ld: l.ldx, batch_stride: l.xbs, op }),
        rope: None,
    };
    let took = gemm_fused_via(&*dev, path, &p, fe, da.as_slice(), db.as_slice(), dc.as_slice_mut())
        .unwrap();
    let mut want = c0.clone();
    for bi in 0..l.batch {
        for i in 0..M {
            for j in 0..N {
                let dot: f64 =
                    (0..K).map(|l| a[bi * M * K + i * K + l] * b[bi * K * N + l * N + j]).sum();
                let ci = bi * l.cbs + i * l.ldc + j;
                let mut v = dot + 0.5 * c0[ci];
                if with_bias {
                    v += bias[j];
                }
                let g = x[bi * l.xbs + i * l.ldx + j];
                v = match op {
                    Some(AuxOp::Residual) => v + g,
                    Some(AuxOp::SiluMul) => silu(g) * v,
                    None => v,
                };
                want[ci] = v;
            }
        }
    }
    let got = download(&dc, dout);
    for (i, &g) in got.iter().enumerate() {
        if !live(i) {
            assert_eq!(g, PAD, "C's padding at {i} was written");
        }
    }
    (took, got, want)
}

fn tol(dt: CudaDType) -> f64 {
    match dt {
        F32 => 1e-5,
        _ => 1e-2,
    }
}

const CASES: [Epi; 4] = [Epi::Bias, Epi::Residual, Epi::SiluMul, Epi::BiasSiluMul];

#[test]
fn fused_and_unfused_match_the_reference_and_each_other() {
    for dout in [BF16, F32] {
        for epi in CASES {
            let what = format!("{epi:?} bf16 -> {dout:?}");
            for l in [PADDED, DENSE] {
                let what = format!("{what} batch {}", l.batch);
                let (tf, fused, want) = run(l, EpiloguePath::Fused, BF16, dout, epi);
                let (tu, unfused, _) = run(l, EpiloguePath::Unfused, BF16, dout, epi);
                assert_eq!((tf, tu), (EpiloguePath::Fused, EpiloguePath::Unfused), "{what}");
                assert_close(&format!("fused {what}"), &fused, &want, tol(dout));
                assert_close(&format!("unfused {what}"), &unfused, &want, tol(dout));
                assert_close(&format!("fused vs unfused {what}"), &fused, &unfused, tol(dout));
            }
        }
    }
}

#[test]
fn f32_inputs_run_unfused() {
    for (epi, l) in CASES.into_iter().flat_map(|e| [(e, PADDED), (e, DENSE)]) {
        let (took, got, want) = run(l, EpiloguePath::Auto, F32, F32, epi);
        assert_eq!(took, EpiloguePath::Unfused, "{epi:?} {l:?}");
        assert_close(&format!("{epi:?} f32 {l:?}"), &got, &want, tol(F32));
    }
    // the Hopper kernel takes 16-bit inputs only: asking for it is an error
    let dev = dev();
    let p = problem(F32, F32);
    let a = DeviceBuffer::zeros(&dev, BATCH * M * K * 4).unwrap();
    let b = DeviceBuffer::zeros(&dev, BATCH * K * N * 4).unwrap();
    let mut c = DeviceBuffer::zeros(&dev, BATCH * CBS * 4).unwrap();
    let r = gemm_fused_via(
        &*dev,
        EpiloguePath::Fused,
        &p,
        FusedEpilogue::default(),
        a.as_slice(),
        b.as_slice(),
        c.as_slice_mut(),
    );
    assert!(
        matches!(&r, Err(KernelError::BadArguments { what, .. }) if what.contains("F32")),
        "{r:?}"
    );
}

#[test]
fn auto_follows_the_device_architecture() {
    // Fused exactly where the emulator stands in for sm_90a (TPAR_EMU_ARCH).
    let dev = dev();
    let want =
        if HopperTarget::of(&*dev).is_some() { EpiloguePath::Fused } else { EpiloguePath::Unfused };
    let (took, got, reference) = run(PADDED, EpiloguePath::Auto, BF16, BF16, Epi::Residual);
    assert_eq!(took, want);
    assert_close("auto residual", &got, &reference, tol(BF16));
}

/// A bf16 problem with a bias of `n_bias` elements on `bias_dev` and a gate
/// matrix of `n_aux` elements at row stride `ld` on `aux_dev`; a refused
/// launch must leave C as it was.
fn refused(
    bias_dev: &Arc<dyn GpuDevice>,
    n_bias: usize,
    aux_dev: &Arc<dyn GpuDevice>,
    n_aux: usize,
    ld: usize,
) -> Result<EpiloguePath, KernelError> {
    let dev = dev();
    let p = problem(BF16, BF16);
    let a = DeviceBuffer::zeros(&dev, BATCH * M * K * 2).unwrap();
    let b = DeviceBuffer::zeros(&dev, BATCH * K * N * 2).unwrap();
    let bias = DeviceBuffer::zeros(bias_dev, n_bias * 2).unwrap();
    let x = DeviceBuffer::zeros(aux_dev, n_aux * 2).unwrap();
    let mut c = DeviceBuffer::zeros(&dev, BATCH * CBS * 2).unwrap();
    let fe = FusedEpilogue {
        bias: Some(bias.as_slice()),
        aux: Some(FusedAux { view: x.as_slice(), ld, batch_stride: XBS, op: AuxOp::SiluMul }),
        rope: None,
    };
    let before = c.to_host().unwrap();
    let r = gemm_fused(&*dev, &p, fe, a.as_slice(), b.as_slice(), c.as_slice_mut());
    if r.is_err() {
        assert_eq!(c.to_host().unwrap(), before, "a refused launch wrote C");
    }
    r
}

#[test]
fn bad_views_are_typed_errors() {
    let dev = dev();
    let aux_need = XBS + (M - 1) * LDX + N;
    assert!(refused(&dev, N, &dev, aux_need, LDX).is_ok());
    let r = refused(&dev, N - 1, &dev, aux_need, LDX);
    assert!(
        matches!(r, Err(KernelError::BufferTooSmall { what: "bias", need: 48, got: 46, .. })),
        "{r:?}"
    );
    let r = refused(&dev, N, &dev, aux_need - 1, LDX);
    assert!(matches!(r, Err(KernelError::BufferTooSmall { what: "epilogue matrix", .. })), "{r:?}");
    let r = refused(&dev, N, &dev, aux_need, N - 1);
    assert!(
        matches!(&r, Err(KernelError::BadArguments { what, .. }) if what.contains("ld 23")),
        "{r:?}"
    );
    let other: Arc<dyn GpuDevice> = Arc::new(Elsewhere(dev.clone()));
    let r = refused(&other, N, &dev, aux_need, LDX);
    assert!(matches!(r, Err(KernelError::WrongDevice { what: "bias", .. })), "{r:?}");
    let r = refused(&dev, N, &other, aux_need, LDX);
    assert!(matches!(r, Err(KernelError::WrongDevice { what: "epilogue matrix", .. })), "{r:?}");
}
