//! The Hopper GEMM (`cuda/gemm_hopper.cu`: TMA, mbarriers, wgmma, warp
//! specialization), run in the CPU emulator, against an f64 reference of the
//! rounded inputs: every layout, input and output type, alpha / beta,
//! batches, edges, the persistent tile walk and the fused epilogues (against
//! the unfused computation); the same with 2-block clusters multicasting A,
//! and all of it again with 128 x 256 tiles (the `_n256` kernels: N below,
//! at and past 256, not a multiple of 256, the epilogue's 64-column chunks
//! past N skipped, the 3-stage ring's phases over long walks).

mod common;

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::raw::gemm_hopper::{
    self, plan, AuxInput, AuxOp, Epilogue, HopperConfig, HopperLaunch, HopperTarget, EMU_ARCH_ENV,
};
use tpar_kernels::cuda::tensor_map::{TensorMap, TensorMapDType, TensorMapSwizzle, TiledDesc};
use tpar_kernels::cuda::{launch, CudaDType, DevPtr, LaunchConfig};
use tpar_kernels::gemm::GemmShape;

use common::{emu, RawBuf};
use CudaDType::{BF16, F16, F32};

/// One product: shapes, layouts (A stored `[k, m]` when `ta`, B `[n, k]`
/// when `tb`), types, scales, batch strides and the epilogue.
#[derive(Clone, Debug)]
struct Case {
    din: CudaDType,
    dout: CudaDType,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    alpha: f32,
    beta: f32,
    /// Extra elements of C's row pitch past `n` (odd: rows not 16-byte aligned).
    ldc_pad: usize,
    /// Bytes C starts past a 16-byte boundary.
    c_shift: usize,
    /// One B for every batch (batch stride 0).
    bcast_b: bool,
    /// One A for every batch (batch stride 0).
    bcast_a: bool,
    bias: bool,
    aux: Option<AuxOp>,
    /// Blocks of the persistent grid.
    sms: u32,
    /// Blocks per thread-block cluster (1 or 2).
    cluster: u32,
    /// Columns of C per tile (128 or 256).
    tile_n: u32,
}

impl Case {
    fn new(din: CudaDType, dout: CudaDType, (m, n, k): (usize, usize, usize)) -> Self {
        Case {
            din,
            dout,
            batch: 1,
            m,
            n,
            k,
            ta: false,
            tb: false,
            alpha: 1.0,
            beta: 0.0,
            ldc_pad: 0,
            c_shift: 0,
            bcast_b: false,
            bcast_a: false,
            bias: false,
            aux: None,
            sms: 4,
            cluster: 1,
            tile_n: 128,
        }
    }

    fn layout(mut self, ta: bool, tb: bool) -> Self {
        (self.ta, self.tb) = (ta, tb);
        self
    }

    /// The same case on `clusters` persistent clusters of 2 blocks.
    fn c2(mut self, clusters: u32) -> Self {
        (self.cluster, self.sms) = (2, 2 * clusters);
        self
    }

    /// The same case with `tile_n` columns of C per tile.
    fn tile_n(mut self, tile_n: u32) -> Self {
        self.tile_n = tile_n;
        self
    }

    fn config(&self) -> HopperConfig {
        HopperConfig::with_cluster(self.cluster).and_then(|c| c.with_tile_n(self.tile_n)).unwrap()
    }
}

/// Row pitch: the row length rounded up to 8 elements, plus 8 (so the kernel
/// must honour the leading dimension).
fn pitch(cols: usize) -> usize {
    cols.div_ceil(8) * 8 + 8
}

/// Everything one case allocates, and the f64 reference.
struct Run {
    c: RawBuf,
    want: Vec<f64>,
    /// C before the launch (what `beta` scales).
    p: GemmProblem,
    epi: Epilogue,
    a: RawBuf,
    b: RawBuf,
    bias: RawBuf,
    aux: RawBuf,
    ldc: usize,
    sc: usize,
}

fn prepare(cs: &Case) -> Run {
    let (m, n, k, batch) = (cs.m, cs.n, cs.k, cs.batch);
    let (ar, ac) = if cs.ta { (k, m) } else { (m, k) };
    let (br, bc) = if cs.tb { (n, k) } else { (k, n) };
    let (lda, ldb) = (pitch(ac), pitch(bc));
    let ldc = n + cs.ldc_pad;
    let sa = if cs.bcast_a { 0 } else { ar * lda + 8 };
    let (sb, sc) = (if cs.bcast_b { 0 } else { br * ldb + 16 }, m * ldc + 3);
    let mut a = RawBuf::new(cs.din, (batch - 1) * sa + ar * lda, 0);
    let mut b = RawBuf::new(cs.din, (batch - 1) * sb + br * ldb, 0);
    let mut c = RawBuf::new(cs.dout, (batch - 1) * sc + m * ldc, cs.c_shift);
    let mut bias = RawBuf::new(cs.dout, n, 0);
    let mut aux = RawBuf::new(cs.dout, (batch - 1) * sc + m * ldc, 0);
    a.fill(1 + m as u64);
    b.fill(2 + n as u64);
    c.fill(3 + k as u64);
    bias.fill(4);
    aux.fill(5);
    let mut want = vec![0.0; c.len()];
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0;
                for kk in 0..k {
                    let av = if cs.ta {
                        a.get(bi * sa + kk * lda + i)
                    } else {
                        a.get(bi * sa + i * lda + kk)
                    };
                    let bv = if cs.tb {
                        b.get(bi * sb + j * ldb + kk)
                    } else {
                        b.get(bi * sb + kk * ldb + j)
                    };
                    acc += av * bv;
                }
                let ci = bi * sc + i * ldc + j;
                let mut v = cs.alpha as f64 * acc + cs.beta as f64 * c.get(ci);
                if cs.bias {
                    v += bias.get(j);
                }
                match cs.aux {
                    Some(AuxOp::Residual) => v += aux.get(ci),
                    Some(AuxOp::SiluMul) => {
                        let g = aux.get(ci);
                        v *= g / (1.0 + (-g).exp());
                    }
                    None => {}
                }
                want[ci] = v;
            }
        }
    }
    let mut shape = GemmShape::new(batch, m, n, k);
    (shape.trans_a, shape.trans_b, shape.a_batch_stride, shape.b_batch_stride) =
        (cs.ta, cs.tb, sa, sb);
    let p = GemmProblem::new(shape, cs.din, cs.dout)
        .with_leading_dims(lda, ldb, ldc)
        .with_c_batch_stride(sc)
        .with_scale(cs.alpha, cs.beta);
    let epi = Epilogue {
        bias: cs.bias.then(|| bias.ptr()),
        aux: cs.aux.map(|op| AuxInput { ptr: aux.ptr(), ld: ldc, batch_stride: sc, op }),
        rope: None,
    };
    Run { c, want, p, epi, a, b, bias, aux, ldc, sc }
}

/// The largest |got - want| over the tolerance of C's type, at the element
/// where it is largest (> 1 fails); elements outside the batches' m x n
/// windows must keep their values.
fn worst(cs: &Case, r: &Run, before: &[f64]) -> (f64, String) {
    let eps = match cs.dout {
        BF16 => 1.0 / 256.0,
        F16 => 1.0 / 1024.0,
        F32 => 1e-6,
    };
    let mut worst = (0.0f64, String::new());
    for i in 0..r.c.len() {
        let (bi, rem) = (i / r.sc, i % r.sc);
        let (row, col) = (rem / r.ldc, rem % r.ldc);
        let inside = bi < cs.batch && row < cs.m && col < cs.n;
        let (got, want) = (r.c.get(i), if inside { r.want[i] } else { before[i] });
        let tol = if inside { eps * want.abs() + 1e-5 * (1.0 + want.abs()) } else { 0.0 };
        let err = if got.is_nan() { f64::INFINITY } else { (got - want).abs() / tol.max(1e-300) };
        let err = if !inside && got.to_bits() == want.to_bits() { 0.0 } else { err };
        if err > worst.0 {
            worst = (err, format!("C[{bi}][{row}][{col}] = {got}, want {want}"));
        }
    }
    worst
}

fn run(cs: &Case) {
    let mut r = prepare(cs);
    let before: Vec<f64> = (0..r.c.len()).map(|i| r.c.get(i)).collect();
    let cp = r.c.mut_ptr();
    // SAFETY: the buffers cover every element the problem reaches (built from
    // the same sizes and strides) and stay alive across the launch.
    unsafe {
        gemm_hopper::gemm_with(
            emu(),
            HopperTarget::emulator(cs.sms),
            cs.config(),
            &r.p,
            &r.epi,
            r.a.ptr(),
            r.b.ptr(),
            cp,
        )
    }
    .unwrap_or_else(|e| panic!("{cs:?}: {e}"));
    let (err, at) = worst(cs, &r, &before);
    assert!(err <= 1.0, "{cs:?}: {at} ({err:.1} x the tolerance)");
    let _ = (&r.bias, &r.aux);
}

const LAYOUTS: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

/// Every layout and type pair at tile width `tn` on an m x n x k product.
fn layouts_and_types(tn: u32, mnk: (usize, usize, usize)) {
    for (ta, tb) in LAYOUTS {
        for din in [BF16, F16] {
            for dout in [BF16, F16, F32] {
                run(&Case::new(din, dout, mnk).layout(ta, tb).tile_n(tn));
            }
        }
    }
}

#[test]
fn every_layout_input_and_output_type() {
    layouts_and_types(128, (70, 136, 72));
}

/// 128 x 256 tiles: N below 256 (one tile whose last two 64-column chunks
/// lie past N), and N of two tiles, the second 44 columns wide.
#[test]
fn n256_every_layout_input_and_output_type() {
    layouts_and_types(256, (70, 136, 72));
    layouts_and_types(256, (70, 300, 72));
}

/// Two batches with alpha and beta, then with one B for both.
fn scales_and_batches(tn: u32, mnk: (usize, usize, usize)) {
    for (ta, tb) in LAYOUTS {
        for (din, dout) in [(BF16, F32), (F16, F16)] {
            let cs = Case { batch: 2, alpha: 0.5, beta: -1.25, ..Case::new(din, dout, mnk) }
                .layout(ta, tb)
                .tile_n(tn);
            run(&cs);
            run(&Case { bcast_b: true, ..cs });
        }
    }
}

#[test]
fn alpha_beta_batches_and_a_broadcast_operand() {
    scales_and_batches(128, (130, 72, 40));
}

#[test]
fn n256_alpha_beta_batches_and_a_broadcast_operand() {
    scales_and_batches(256, (130, 300, 40));
}

/// Every layout on each m x n x k of `shapes` at tile width `tn`.
fn edges(tn: u32, shapes: &[(usize, usize, usize)]) {
    for &mnk in shapes {
        for (ta, tb) in LAYOUTS {
            run(&Case::new(BF16, BF16, mnk).layout(ta, tb).tile_n(tn));
        }
    }
}

#[test]
fn edges_in_m_n_and_k() {
    edges(
        128,
        &[(1, 1, 8), (1, 130, 72), (130, 1, 200), (129, 257, 136), (64, 64, 16), (200, 130, 64)],
    );
}

/// 128 x 256 tiles: N of 1, 64 (one chunk), 257 (a second tile one column
/// wide), 260, exactly 256, and 520 (three tiles, the last 8 columns).
#[test]
fn n256_edges_in_m_n_and_k() {
    edges(
        256,
        &[
            (1, 1, 8),
            (1, 260, 72),
            (130, 1, 200),
            (129, 257, 136),
            (64, 64, 16),
            (128, 256, 64),
            (200, 520, 64),
        ],
    );
}

/// Two batches of an m x n x k product on one block, then on two and five:
/// the ring's phases carry over from tile to tile.
fn walks(tn: u32, mnk: (usize, usize, usize)) {
    for sms in [1, 2, 5] {
        for (ta, tb) in [(false, true), (true, false)] {
            let cs = Case { batch: 2, sms, beta: 1.0, ..Case::new(F16, F32, mnk) };
            run(&cs.layout(ta, tb).tile_n(tn));
        }
    }
}

#[test]
fn one_block_walks_every_tile_of_every_batch() {
    // 3 x 3 tiles x 2 batches
    walks(128, (300, 260, 136));
}

#[test]
fn n256_one_block_walks_every_tile_of_every_batch() {
    // 3 x 3 tiles of 128 x 256 x 2 batches (18 tiles through a 3-stage ring)
    walks(256, (300, 520, 136));
}

/// C with rows not 16-byte aligned (or not starting on 16 bytes): guarded
/// stores, on a narrow product and on `wide`.
fn guarded(tn: u32, wide: (usize, usize, usize)) {
    for (dout, pad, shift) in [(BF16, 1, 0), (F16, 3, 2), (F32, 1, 4), (BF16, 0, 2)] {
        for (ta, tb) in LAYOUTS {
            let cs = Case {
                batch: 2,
                beta: 0.75,
                ldc_pad: pad,
                c_shift: shift,
                ..Case::new(BF16, dout, (70, 9, 24))
            };
            run(&cs.layout(ta, tb).tile_n(tn));
            let cs = Case { batch: 1, ldc_pad: pad, c_shift: shift, ..Case::new(F16, dout, wide) };
            run(&cs.layout(ta, tb).tile_n(tn));
        }
    }
}

#[test]
fn c_rows_not_16_byte_aligned_use_guarded_stores() {
    guarded(128, (33, 130, 80));
}

#[test]
fn n256_c_rows_not_16_byte_aligned_use_guarded_stores() {
    guarded(256, (33, 300, 80));
}

#[test]
fn epilogues_equal_the_unfused_ops() {
    epilogues(128, (70, 136, 72));
}

#[test]
fn n256_epilogues_equal_the_unfused_ops() {
    epilogues(256, (70, 300, 72));
}

/// The fused epilogue at tile width `tn` equals the unfused computation: the
/// plain GEMM's C (rounded to its type), then bias, residual or SiLU(gate) *
/// C on the host.
fn epilogues(tn: u32, mnk: (usize, usize, usize)) {
    for (bias, aux) in [
        (true, None),
        (false, Some(AuxOp::Residual)),
        (true, Some(AuxOp::Residual)),
        (false, Some(AuxOp::SiluMul)),
        (true, Some(AuxOp::SiluMul)),
    ] {
        for (din, dout) in [(BF16, BF16), (F16, F32)] {
            for (ta, tb) in [(false, true), (true, false)] {
                let cs = Case { batch: 2, bias, aux, alpha: 0.5, ..Case::new(din, dout, mnk) }
                    .layout(ta, tb)
                    .tile_n(tn);
                run(&cs);
                // unfused: the plain GEMM into C, then the ops in f64
                let plain = Case { bias: false, aux: None, ..cs.clone() };
                let mut r = prepare(&plain);
                let fused = prepare(&cs);
                let cp = r.c.mut_ptr();
                // SAFETY: as in `run`.
                unsafe {
                    gemm_hopper::gemm(
                        emu(),
                        HopperTarget::emulator(3),
                        &r.p,
                        &r.epi,
                        r.a.ptr(),
                        r.b.ptr(),
                        cp,
                    )
                }
                .unwrap();
                for bi in 0..cs.batch {
                    for i in 0..cs.m {
                        for j in 0..cs.n {
                            let ci = bi * r.sc + i * r.ldc + j;
                            let mut v = r.c.get(ci);
                            if bias {
                                v += r.bias.get(j);
                            }
                            match aux {
                                Some(AuxOp::Residual) => v += r.aux.get(ci),
                                Some(AuxOp::SiluMul) => {
                                    let g = r.aux.get(ci);
                                    v *= g / (1.0 + (-g).exp());
                                }
                                None => {}
                            }
                            let tol = 2.0 / 256.0 * v.abs().max(1.0);
                            assert!(
                                (v - fused.want[ci]).abs() <= tol,
                                "{cs:?}: unfused {v} vs fused reference {} at [{bi}][{i}][{j}]",
                                fused.want[ci]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Runs `cs` on one block with its planned launch changed by `edit` (given
/// the buffers), and returns the worst error over the tolerance.
fn run_edited(cs: &Case, edit: impl FnOnce(&mut HopperLaunch, &Run)) -> f64 {
    let mut r = prepare(cs);
    let before: Vec<f64> = (0..r.c.len()).map(|i| r.c.get(i)).collect();
    let cp = r.c.mut_ptr();
    let (a, b, t) = (r.a.ptr(), r.b.ptr(), HopperTarget::emulator(1));
    let mut l = gemm_hopper::plan_with(&r.p, &r.epi, t, cs.config(), a, b, cp).unwrap();
    edit(&mut l, &r);
    // SAFETY: as in `run`.
    unsafe { launch(emu(), &l.kernel, l.cfg, &l.args) }.unwrap();
    worst(cs, &r, &before).0
}

/// A wrong shared-memory layout is caught: the same launch with A's tensor
/// map encoded without the 128-byte swizzle the wgmma descriptors assume
/// gives wrong products.
#[test]
fn a_map_without_the_swizzle_gives_wrong_results() {
    let cs = Case::new(BF16, F32, (128, 128, 64)).layout(false, true);
    let err = run_edited(&cs, |l, r| {
        let lda = r.p.lda as u64;
        l.args.map_a = TensorMap::encode_tiled_emulated(&TiledDesc {
            dtype: TensorMapDType::BF16,
            global: r.a.ptr(),
            dims: &[64, 128, 1],
            strides: &[lda * 2, lda * 2 * 128],
            box_dims: &[64, 128, 1],
            swizzle: TensorMapSwizzle::None,
        })
        .unwrap();
    });
    assert!(err > 1.0, "an unswizzled A tile went unnoticed");
}

/// The epilogue's staging chunk is laid out in the 128-byte swizzle, and a
/// f32 C is stored from it by 32-column boxes that unswizzle it: the same
/// launch with C's map encoded without the swizzle (box 32 x 64) writes
/// permuted columns, at both tile widths, while the planned map is exact.
#[test]
fn a_f32_c_map_without_the_swizzle_gives_wrong_results() {
    for tile_n in [128, 256] {
        let cs = Case::new(F16, F32, (128, 256, 64)).layout(false, true).tile_n(tile_n);
        let unswizzled = |l: &mut HopperLaunch, r: &Run| {
            let ldc = r.ldc as u64 * 4;
            l.args.map_c = TensorMap::encode_tiled_emulated(&TiledDesc {
                dtype: TensorMapDType::F32,
                global: r.c.ptr(),
                dims: &[256, 128, 1],
                strides: &[ldc, ldc * 128],
                box_dims: &[32, 64, 1],
                swizzle: TensorMapSwizzle::None,
            })
            .unwrap();
        };
        let planned = run_edited(&cs, |_, _| {});
        assert!(planned <= 1.0, "tile width {tile_n}: the planned launch ({planned})");
        let err = run_edited(&cs, unswizzled);
        assert!(err > 1.0, "tile width {tile_n}: an unswizzled C map went unnoticed ({err})");
    }
}

#[test]
fn bad_problems_are_refused_with_reasons() {
    let mut p = GemmProblem::new(GemmShape::new(1, 8, 8, 12), BF16, F32);
    let t = HopperTarget::emulator(2);
    let e = plan(&p, &Epilogue::default(), t, 4096, 8192, 16384).unwrap_err().to_string();
    assert!(e.contains("lda 12"), "{e}");
    p = p.with_leading_dims(16, 8, 8);
    let e = plan(&p, &Epilogue::default(), t, 4100, 8192, 16384).unwrap_err().to_string();
    assert!(e.contains("16-byte aligned"), "{e}");
    let f = GemmProblem::new(GemmShape::new(1, 8, 8, 8), F32, F32);
    let e = plan(&f, &Epilogue::default(), t, 4096, 8192, 16384).unwrap_err().to_string();
    assert!(e.contains("F32 inputs"), "{e}");
    let z = GemmProblem::new(GemmShape::new(1, 0, 8, 8), BF16, BF16);
    assert!(plan(&z, &Epilogue::default(), t, 4096, 8192, 16384).is_err());
    let e = plan(&p, &Epilogue::default(), t, 4096, 8192, 16386).unwrap_err().to_string();
    assert!(e.contains("C address"), "{e}");
}

/// `ops::gemm` with `TPAR_GEMM=ours` on an emulated device standing in for
/// sm_90a runs the Hopper kernel; the mma.sync kernel's result agrees.
#[test]
fn the_checked_op_picks_the_hopper_kernel_when_the_device_runs_it() {
    use tpar_kernels::cuda::{ops, DeviceBuffer};
    // SAFETY (edition 2021 API): set before any other thread of this test reads them.
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    std::env::set_var(ops::gemm::GEMM_BACKEND_ENV, "ours");
    let dev = EmulatedGpu::open(0).unwrap();
    assert!(HopperTarget::of(dev.as_ref()).is_some());
    let cs = Case::new(BF16, F32, (70, 136, 72)).layout(true, false);
    let r = prepare(&cs);
    let a = DeviceBuffer::from_host(&dev, r.a.bytes()).unwrap();
    let b = DeviceBuffer::from_host(&dev, r.b.bytes()).unwrap();
    let (ap, bp) = (a.as_slice().ptr(), b.as_slice().ptr());
    assert!(gemm_hopper::supports(dev.as_ref(), &r.p, ap, bp));
    let check = |c: &DeviceBuffer, what: &str| {
        let mut out = vec![0f32; r.c.len()];
        c.as_slice().copy_to_host(&mut out).unwrap();
        for (i, (&got, &want)) in out.iter().zip(&r.want).enumerate() {
            let (row, col) = (i / r.ldc, i % r.ldc);
            if row < cs.m && col < cs.n {
                let ok = (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs());
                assert!(ok, "{what}: C[{row}][{col}] = {got}, want {want}");
            }
        }
    };
    // the entry `ops::gemm::ours` takes first: it runs the Hopper kernel here
    let mut c = DeviceBuffer::from_host(&dev, r.c.bytes()).unwrap();
    let cp = c.as_slice_mut().ptr();
    // SAFETY: the three buffers cover what the problem reaches (the same
    // sizes as the host buffers they were copied from); C is separate.
    let ran = unsafe { gemm_hopper::gemm_if_supported(dev.as_ref(), &r.p, ap, bp, cp) }.unwrap();
    assert!(ran, "the Hopper kernel did not take the problem");
    check(&c, "gemm_if_supported");
    let mut c = DeviceBuffer::from_host(&dev, r.c.bytes()).unwrap();
    ops::gemm::gemm(dev.as_ref(), &r.p, a.as_slice(), b.as_slice(), c.as_slice_mut()).unwrap();
    check(&c, "ops::gemm");
    // a problem it does not take (an odd leading dimension) runs the mma.sync kernel
    let odd = r.p.with_leading_dims(r.p.lda + 1, r.p.ldb, r.p.ldc);
    assert!(!gemm_hopper::supports(dev.as_ref(), &odd, ap, bp));
}

// ---------------------------------------------------------------- clusters of 2

/// Every layout and two type pairs with 2-block clusters at tile width
/// `tn`, N of 3 tiles (the last pair's second tile past N) and K not a
/// multiple of 64.
fn clusters_odd_tile_count(tn: u32, mnk: (usize, usize, usize)) {
    for (ta, tb) in LAYOUTS {
        for (din, dout) in [(BF16, F32), (F16, BF16)] {
            run(&Case::new(din, dout, mnk).layout(ta, tb).c2(2).tile_n(tn));
        }
    }
}

#[test]
fn clusters_every_layout_with_an_odd_tile_count() {
    clusters_odd_tile_count(128, (70, 264, 72));
}

#[test]
fn n256_clusters_every_layout_with_an_odd_tile_count() {
    clusters_odd_tile_count(256, (70, 600, 72));
}

/// Every layout on each m x n x k of `shapes` on one cluster.
fn clusters_edges(tn: u32, shapes: &[(usize, usize, usize)]) {
    for &mnk in shapes {
        for (ta, tb) in LAYOUTS {
            run(&Case::new(BF16, BF16, mnk).layout(ta, tb).c2(1).tile_n(tn));
        }
    }
}

#[test]
fn clusters_edges_in_m_n_and_k() {
    clusters_edges(128, &[(1, 1, 8), (130, 1, 200), (1, 130, 72), (129, 257, 136), (128, 384, 64)]);
}

#[test]
fn n256_clusters_edges_in_m_n_and_k() {
    clusters_edges(256, &[(1, 1, 8), (130, 1, 200), (1, 260, 72), (129, 257, 136), (128, 768, 64)]);
}

/// Batches with alpha / beta and a broadcast A (the multicast operand) or B.
fn clusters_batches(tn: u32, mnk: (usize, usize, usize)) {
    for (ta, tb) in LAYOUTS {
        let cs = Case { batch: 3, alpha: 0.5, beta: -1.25, ..Case::new(F16, F32, mnk) }
            .layout(ta, tb)
            .c2(2)
            .tile_n(tn);
        run(&Case { bcast_a: true, ..cs.clone() });
        run(&Case { bcast_b: true, ..cs });
    }
}

#[test]
fn clusters_batches_and_broadcast_operands() {
    clusters_batches(128, (130, 200, 40));
}

#[test]
fn n256_clusters_batches_and_broadcast_operands() {
    clusters_batches(256, (130, 300, 40));
}

/// Two batches of pairs of tiles, the last of each row band half past N, on
/// 1, 2 and 5 persistent clusters: the ring's phases and both blocks'
/// barriers carry over from pair to pair.
fn clusters_walks(tn: u32, mnk: (usize, usize, usize)) {
    for clusters in [1, 2, 5] {
        for (ta, tb) in [(false, true), (true, false)] {
            let cs = Case { batch: 2, beta: 1.0, ..Case::new(F16, F32, mnk) };
            run(&cs.layout(ta, tb).c2(clusters).tile_n(tn));
        }
    }
}

#[test]
fn clusters_walk_every_pair_on_1_2_and_5_clusters() {
    // 3 x 3 tiles x 2 batches: 12 pairs
    clusters_walks(128, (300, 260, 136));
}

#[test]
fn n256_clusters_walk_every_pair_on_1_2_and_5_clusters() {
    // 3 x 3 tiles of 128 x 256 x 2 batches: 12 pairs
    clusters_walks(256, (300, 520, 136));
}

/// The three epilogues on `mnk` (N of an odd tile count), and C with rows
/// not 16-byte aligned on `unaligned`.
fn clusters_epilogues(tn: u32, mnk: (usize, usize, usize), unaligned: (usize, usize, usize)) {
    for (bias, aux) in [(true, None), (false, Some(AuxOp::Residual)), (true, Some(AuxOp::SiluMul))]
    {
        let cs = Case { batch: 2, bias, aux, alpha: 0.5, ..Case::new(BF16, BF16, mnk) };
        run(&cs.layout(false, true).c2(2).tile_n(tn));
    }
    let cs = Case { batch: 2, beta: 0.75, ldc_pad: 1, ..Case::new(BF16, F16, unaligned) };
    run(&cs.layout(true, false).c2(2).tile_n(tn));
}

#[test]
fn clusters_with_the_epilogues_and_guarded_stores() {
    clusters_epilogues(128, (70, 390, 72), (70, 140, 24));
}

#[test]
fn n256_clusters_with_the_epilogues_and_guarded_stores() {
    clusters_epilogues(256, (70, 780, 72), (70, 300, 24));
}

/// The clustered launch is what runs: the plan asks for 2 x 1 x 1 clusters,
/// and the kernel launched without them (its blocks alone, never receiving
/// their peer's half of A) is reported as a deadlock, not a result.
#[test]
fn clusters_are_launched_as_clusters() {
    let cs = Case::new(BF16, F32, (128, 256, 64)).layout(false, true);
    let mut r = prepare(&cs);
    let cp = r.c.mut_ptr();
    let c2 = HopperConfig::with_cluster(2).unwrap();
    let t = HopperTarget::emulator(2);
    let l = gemm_hopper::plan_with(&r.p, &r.epi, t, c2, r.a.ptr(), r.b.ptr(), cp).unwrap();
    assert_eq!((l.cfg.grid, l.cfg.cluster, l.args.cluster), ([2, 1, 1], [2, 1, 1], 2));
    let mut alone = l.cfg;
    alone.cluster = [1, 1, 1];
    // SAFETY: as in `run`.
    let e = unsafe { launch(emu(), &l.kernel, alone, &l.args) }.unwrap_err().to_string();
    assert!(e.contains("deadlock") || e.contains("cluster"), "{e}");
}

/// 2 x 2 pairs on one cluster under thread orders that let one block's
/// producer run ahead of its peer's consumers: a producer that refilled a
/// stage before both blocks' consumers released it (a missing remote
/// "empty" arrival) overwrites the peer's A half under these seeds (found by
/// planting that bug; the emulator's default order does not show it).
#[test]
fn clusters_under_shuffled_thread_orders() {
    for seed in [9, 13, 18] {
        emu().set_seed(seed);
        run(&Case::new(F16, F32, (256, 512, 512)).layout(false, true).c2(1));
    }
    emu().set_seed(0x7470_6172);
}

/// The same at 128 x 256 tiles: 2 x 2 pairs on one cluster, the 3-stage
/// ring under shuffled thread orders.
#[test]
fn n256_clusters_under_shuffled_thread_orders() {
    for seed in [9, 13, 18] {
        emu().set_seed(seed);
        run(&Case::new(F16, F32, (256, 1024, 512)).layout(false, true).c2(1).tile_n(256));
    }
    emu().set_seed(0x7470_6172);
}

/// A launcher that says how many clusters fit at once (as a GPU's occupancy
/// query does) and runs the emulator.
struct Fits(u32);

impl tpar_kernels::cuda::Launcher for Fits {
    fn describe(&self) -> String {
        format!("emulator fitting {} clusters", self.0)
    }

    fn max_active_clusters(
        &self,
        _kernel: &str,
        cfg: &tpar_kernels::cuda::LaunchConfig,
    ) -> tpar_kernels::Result<Option<u32>> {
        assert_eq!(cfg.cluster, [2, 1, 1]);
        Ok(Some(self.0))
    }

    unsafe fn launch_raw(
        &self,
        kernel: &str,
        cfg: &tpar_kernels::cuda::LaunchConfig,
        args: &[u8],
    ) -> tpar_kernels::Result<()> {
        assert!(cfg.grid[0] <= 2 * self.0, "grid {:?} above {} clusters", cfg.grid, self.0);
        // SAFETY: forwarded from the caller.
        unsafe { emu().launch_raw(kernel, cfg, args) }
    }
}

/// The persistent grid shrinks to the clusters that fit at once (12 pairs
/// planned on 5 clusters run on 1 or 3), and none fitting is an error.
#[test]
fn clusters_are_capped_at_what_fits() {
    let cs = Case { batch: 2, ..Case::new(F16, F32, (300, 260, 136)) }.layout(true, true).c2(5);
    for fit in [1, 3] {
        let mut r = prepare(&cs);
        let before: Vec<f64> = (0..r.c.len()).map(|i| r.c.get(i)).collect();
        let cp = r.c.mut_ptr();
        // SAFETY: as in `run`.
        unsafe {
            gemm_hopper::gemm_with(
                &Fits(fit),
                HopperTarget::emulator(cs.sms),
                HopperConfig::with_cluster(2).unwrap(),
                &r.p,
                &r.epi,
                r.a.ptr(),
                r.b.ptr(),
                cp,
            )
        }
        .unwrap();
        let (err, at) = worst(&cs, &r, &before);
        assert!(err <= 1.0, "{fit} clusters: {at} ({err:.1} x the tolerance)");
    }
    let mut r = prepare(&cs);
    let cp = r.c.mut_ptr();
    // SAFETY: refused before launching.
    let e = unsafe {
        gemm_hopper::gemm_with(
            &Fits(0),
            HopperTarget::emulator(cs.sms),
            HopperConfig::with_cluster(2).unwrap(),
            &r.p,
            &r.epi,
            r.a.ptr(),
            r.b.ptr(),
            cp,
        )
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("no cluster of 2 blocks"), "{e}");
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StagingArgs {
    pairs: DevPtr,
    walk: DevPtr,
}

/// Shared-memory wavefronts of one warp access of `width` bytes per lane
/// (4 or 8) at the given float indices, 32 banks of 4 bytes: the warp is
/// served in groups of 128 / width lanes (8-byte accesses per half-warp),
/// each group in as many wavefronts as the most distinct words one bank
/// holds.
fn wavefronts(at: &[i32], width: usize) -> usize {
    at.chunks(128 / width)
        .map(|group| {
            let mut words: Vec<Vec<i32>> = vec![Vec::new(); 32];
            for &a in group {
                for word in a..a + (width / 4) as i32 {
                    let bank = &mut words[word.rem_euclid(32) as usize];
                    if !bank.contains(&word) {
                        bank.push(word);
                    }
                }
            }
            words.iter().map(Vec::len).max().unwrap_or(0)
        })
        .sum()
}

/// The epilogue's staging layout, from the kernel's own device functions
/// (`pair_slot`, `walk_at`, run in the emulator; the layout itself is the
/// 128-byte swizzle the f32 C store's map unswizzles, which the products
/// above check): at both chunk widths the row walk reads every element of
/// the 64 x EC chunk once, each warp read in one wavefront; the accumulator
/// pairs land 8-byte aligned where the walk reads their row and columns,
/// each element once, each warp store in 2 wavefronts (one per half-warp,
/// the minimum for 256 bytes).
#[test]
fn the_epilogue_staging_stores_and_reads_without_bank_conflicts() {
    const SRC: &str = concat!(
        "#define TPAR_GEMM_HOPPER_NO_KERNELS\n",
        include_str!("../cuda/gemm_hopper.cu"),
        "\n",
        include_str!("hopper/gemm_staging.cu")
    );
    emu().add_source("gemm_hopper_staging", SRC).expect("the staging test kernel compiles");
    let mut pairs = vec![0i32; 16 * 2 * 2 * 128];
    let mut walk = vec![0i32; 64 * 128 + 64 * 64];
    let args =
        StagingArgs { pairs: pairs.as_mut_ptr() as DevPtr, walk: walk.as_mut_ptr() as DevPtr };
    // SAFETY: the kernel writes 16 * 2 * 2 * 128 and 64 * 192 i32s, the sizes above.
    unsafe { launch(emu(), "gemm_hopper_staging_slots", LaunchConfig::linear(1, 128), &args) }
        .unwrap();
    for ec in [128usize, 64] {
        let walk = if ec == 128 { &walk[..64 * 128] } else { &walk[64 * 128..] };
        let mut read = vec![0u8; 64 * ec];
        for &a in walk {
            read[a as usize] += 1;
        }
        assert!(read.iter().all(|&n| n == 1), "EC {ec}: the walk reads every element once");
        for (k, warp) in walk.chunks(32).enumerate() {
            assert_eq!(wavefronts(warp, 4), 1, "EC {ec}: walk read {k}");
        }
        // the stores of one chunk: block bl (bl % 4 in {0, 1}) with bl + 2
        let mut stored = vec![0u8; 64 * ec];
        for bl in (0..ec / 8).filter(|b| b % 4 < 2) {
            for e in 0..2 {
                for sw in 0..2 {
                    let store = &pairs[((bl * 2 + e) * 2 + sw) * 128..][..128];
                    for (w, warp) in store.chunks(32).enumerate() {
                        let at: Vec<i32> = warp.iter().map(|v| v >> 1).collect();
                        let n = wavefronts(&at, 8);
                        assert_eq!(n, 2, "EC {ec}: block {bl}, rows +{e}, store {sw}, warp {w}");
                        for (lane, v) in warp.iter().enumerate() {
                            let (g, q, far) = (lane / 4, lane % 4, (v & 1) as usize);
                            let (r, c) = (16 * w + g + 8 * e, 8 * (bl + 2 * far) + 2 * q);
                            let a = v >> 1;
                            let want = (walk[r * ec + c], walk[r * ec + c + 1]);
                            assert_eq!((a, a + 1), want, "EC {ec}: lane {lane} of warp {w}");
                            assert_eq!(a % 2, 0, "EC {ec}: an 8-byte pair at odd float {a}");
                            stored[a as usize] += 1;
                            stored[a as usize + 1] += 1;
                        }
                    }
                }
            }
        }
        assert!(stored.iter().all(|&n| n == 1), "EC {ec}: every element stored once");
    }
}
