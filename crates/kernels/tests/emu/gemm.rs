//! GEMM CUDA kernels, run in the CPU emulator, against the f64 reference of
//! the rounded inputs.

use crate::common;

use tpar_kernels::cuda::emu::Emulator;
use tpar_kernels::cuda::raw::gemm::{gemm, gemm_with_tile, GemmProblem, GemmTile, MAX_BATCH};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::gemm::{reference, GemmShape};
use tpar_kernels::KernelError;

use common::RawBuf;
use CudaDType::{BF16, F16, F32};

/// Deterministic values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

/// One product to check; `None` strides and leading dims mean dense.
#[derive(Clone, Debug)]
struct Case {
    dt_in: CudaDType,
    dt_out: CudaDType,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    lda: Option<usize>,
    ldb: Option<usize>,
    ldc: Option<usize>,
    sa: Option<usize>,
    sb: Option<usize>,
    sc: Option<usize>,
    alpha: f32,
    beta: f32,
    tile: Option<GemmTile>,
    misalign: bool,
    /// Whether the 16-byte kernel must be the one that runs.
    vectorized: Option<bool>,
}

impl Case {
    fn new(
        dt_in: CudaDType,
        dt_out: CudaDType,
        (m, n, k): (usize, usize, usize),
        ta: bool,
        tb: bool,
    ) -> Self {
        Case {
            dt_in,
            dt_out,
            batch: 1,
            m,
            n,
            k,
            ta,
            tb,
            lda: None,
            ldb: None,
            ldc: None,
            sa: None,
            sb: None,
            sc: None,
            alpha: 1.0,
            beta: 0.0,
            tile: None,
            misalign: false,
            vectorized: None,
        }
    }

    fn tile(mut self, t: GemmTile) -> Self {
        self.tile = Some(t);
        self
    }

    fn vec(mut self, v: bool) -> Self {
        self.vectorized = Some(v);
        self
    }
}

const LAYOUTS: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

/// Largest error of a product with output type `dt_out`, relative to the
/// largest reference magnitude.
fn tolerance(dt_out: CudaDType) -> f64 {
    match dt_out {
        F32 => 1e-5,
        BF16 => 8e-3,
        F16 => 2e-3,
    }
}

/// Runs `c` in the emulator and compares with the reference; returns the
/// relative error.
fn check(c: &Case) -> f64 {
    let emu = Emulator::get().expect("emulator");
    let (m, n, k, batch) = (c.m, c.n, c.k, c.batch);
    let (a_rows, a_cols) = if c.ta { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if c.tb { (n, k) } else { (k, n) };
    let lda = c.lda.unwrap_or(a_cols);
    let ldb = c.ldb.unwrap_or(b_cols);
    let ldc = c.ldc.unwrap_or(n);
    let sa = c.sa.unwrap_or(a_rows * lda);
    let sb = c.sb.unwrap_or(b_rows * ldb);
    let sc = c.sc.unwrap_or(m * ldc);
    let span =
        |rows: usize, cols: usize, ld: usize, s: usize| (batch - 1) * s + (rows - 1) * ld + cols;

    // Operands: NaN everywhere the product must not read, values where it must.
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (m * 131 + n * 17 + k) as u64);
    let operand = |rng: &mut Rng, rows, cols, ld, s| {
        let mut buf = RawBuf::new(
            c.dt_in,
            span(rows, cols, ld, s),
            if c.misalign { c.dt_in.size() } else { 0 },
        );
        for i in 0..buf.len() {
            buf.set(i, f64::NAN);
        }
        // dense op-layout copy of the rounded values, batch-strided like the buffer
        let dense_stride = if s == 0 { 0 } else { rows * cols };
        let mut dense = vec![0.0; (batch - 1) * dense_stride + rows * cols];
        for bi in 0..batch {
            for r in 0..rows {
                for col in 0..cols {
                    let at = bi * s + r * ld + col;
                    if bi > 0 && s == 0 {
                        continue;
                    }
                    buf.set(at, rng.next());
                    dense[bi * dense_stride + r * cols + col] = buf.get(at);
                }
            }
        }
        (buf, dense, dense_stride)
    };
    let (a, a_dense, a_ds) = operand(&mut rng, a_rows, a_cols, lda, sa);
    let (b, b_dense, b_ds) = operand(&mut rng, b_rows, b_cols, ldb, sb);

    // C: old values (or NaN when beta = 0: must not be read), a sentinel between rows.
    const SENTINEL: f64 = 7.0;
    let mut cbuf = RawBuf::new(c.dt_out, span(m, n, ldc, sc), 0);
    for i in 0..cbuf.len() {
        cbuf.set(i, SENTINEL);
    }
    let mut c_old = vec![0.0; batch * m * n];
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let at = bi * sc + i * ldc + j;
                if c.beta == 0.0 {
                    cbuf.set(at, f64::NAN);
                } else {
                    cbuf.set(at, rng.next());
                    c_old[(bi * m + i) * n + j] = cbuf.get(at);
                }
            }
        }
    }

    let shape = GemmShape {
        batch,
        m,
        n,
        k,
        trans_a: c.ta,
        trans_b: c.tb,
        a_batch_stride: sa,
        b_batch_stride: sb,
    };
    let p = GemmProblem::new(shape, c.dt_in, c.dt_out)
        .with_leading_dims(lda, ldb, ldc)
        .with_c_batch_stride(sc)
        .with_scale(c.alpha, c.beta);
    let tile = c.tile.unwrap_or_else(|| p.default_tile());
    let c_ptr = cbuf.mut_ptr();
    let plan = p.plan(tile, a.ptr(), b.ptr(), c_ptr).expect("plan");
    if let Some(v) = c.vectorized {
        assert_eq!(plan.vectorized, v, "{c:?}: ran {}", plan.kernel);
    }
    // SAFETY: the buffers span every element the problem reaches.
    unsafe { gemm_with_tile(emu, &p, tile, a.ptr(), b.ptr(), c_ptr) }
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));

    let ref_shape = GemmShape { a_batch_stride: a_ds, b_batch_stride: b_ds, ..shape };
    let prod = reference::matmul(&ref_shape, &a_dense, &b_dense, None);
    let want: Vec<f64> =
        prod.iter().zip(&c_old).map(|(p, o)| c.alpha as f64 * p + c.beta as f64 * o).collect();
    let scale = want.iter().fold(1e-6f64, |s, v| s.max(v.abs()));
    let mut err = 0.0f64;
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let got = cbuf.get(bi * sc + i * ldc + j);
                let e = (got - want[(bi * m + i) * n + j]).abs() / scale;
                // NaN-propagating max: a NaN result fails the bound below
                err = if e.is_nan() || e > err { e } else { err };
            }
        }
    }
    let written = |i: usize| {
        (0..batch).any(|bi| i >= bi * sc && i < bi * sc + m * ldc && (i - bi * sc) % ldc < n)
    };
    for i in 0..cbuf.len() {
        if !written(i) {
            assert_eq!(
                cbuf.get(i),
                SENTINEL,
                "{c:?}: element {i} of C outside the product was written"
            );
        }
    }
    let tol = tolerance(c.dt_out);
    assert!(err <= tol, "{c:?} ({}): relative error {err:e} > {tol:e}", plan.kernel);
    err
}

#[test]
fn tensor_core_layouts_and_tiles() {
    for dt in [BF16, F16] {
        for (ta, tb) in LAYOUTS {
            for tile in GemmTile::ALL {
                check(&Case::new(dt, dt, (128, 128, 64), ta, tb).tile(tile).vec(true));
            }
        }
    }
}

#[test]
fn tensor_core_vectorized_edges() {
    // odd sizes wherever the layout allows the 16-byte loads: only the
    // contiguous extent of each operand must be a multiple of 8
    let shapes = [(67, 48, 40), (67, 45, 40), (72, 40, 37), (72, 45, 40)];
    for ((ta, tb), mnk) in LAYOUTS.into_iter().zip(shapes) {
        for (dt_in, dt_out) in [(BF16, BF16), (F16, F32)] {
            for tile in GemmTile::ALL {
                check(&Case::new(dt_in, dt_out, mnk, ta, tb).tile(tile).vec(true));
            }
        }
    }
    // tiny and k below one slice
    for (ta, tb) in LAYOUTS {
        check(&Case::new(BF16, F32, (16, 24, 8), ta, tb).vec(true));
    }
    // padded leading dimensions (multiples of 8) with odd sizes: 16-byte
    // chunks cut by the edge of the contiguous dimension
    let mut c = Case::new(F16, F16, (67, 40, 24), true, false).vec(true);
    (c.lda, c.ldb, c.ldc) = (Some(72), Some(48), Some(41));
    check(&c);
    let mut c = Case::new(BF16, BF16, (67, 45, 37), false, false).vec(true);
    (c.lda, c.ldb) = (Some(40), Some(48));
    check(&c);
    let mut c = Case::new(BF16, F32, (67, 45, 37), true, true).vec(true);
    (c.lda, c.ldb) = (Some(72), Some(40));
    check(&c.clone().tile(GemmTile::T64x64));
    check(&c.tile(GemmTile::T128x128));
}

#[test]
fn tensor_core_unaligned_falls_back() {
    // odd n with B [k, n], odd k, odd m with A stored [k, m]
    for (ta, tb) in LAYOUTS {
        check(&Case::new(BF16, BF16, (67, 45, 40), ta, tb).vec(tb && !ta));
        check(&Case::new(F16, F32, (33, 40, 37), ta, tb).vec(false));
    }
    // leading dimension not a multiple of 8
    let mut c = Case::new(BF16, F32, (40, 48, 64), false, true).vec(false);
    (c.lda, c.ldb) = (Some(67), Some(64));
    check(&c);
    // base addresses one element off 16 bytes
    for dt in [BF16, F16] {
        let mut c = Case::new(dt, dt, (64, 64, 32), false, true).vec(false);
        c.misalign = true;
        check(&c);
    }
}

#[test]
fn tensor_core_batched_broadcast_and_beta() {
    // batch 3: padded A batches, one B for all, C with padded rows and batches
    let mut c = Case::new(BF16, F32, (40, 48, 64), false, false).vec(true);
    c.batch = 3;
    c.sa = Some(40 * 64 + 16);
    c.sb = Some(0);
    c.ldc = Some(56);
    c.sc = Some(40 * 56 + 24);
    (c.alpha, c.beta) = (0.5, -1.5);
    for tile in GemmTile::ALL {
        check(&c.clone().tile(tile));
    }
    // broadcast A, transposed layouts, own-type output with beta
    let mut c = Case::new(F16, F16, (24, 72, 40), true, true).vec(true);
    c.batch = 3;
    c.sa = Some(0);
    (c.alpha, c.beta) = (2.0, 0.25);
    check(&c);
    // batch strides that are not multiples of 8 take the element-wise loads
    let mut c = Case::new(BF16, BF16, (24, 32, 16), true, false).vec(false);
    c.batch = 3;
    c.sa = Some(24 * 16 + 3);
    c.sb = Some(16 * 32 + 5);
    check(&c);
}

#[test]
fn f32_simt() {
    for (ta, tb) in LAYOUTS {
        for tile in GemmTile::ALL {
            check(&Case::new(F32, F32, (67, 45, 37), ta, tb).tile(tile));
            check(&Case::new(F32, F32, (130, 70, 20), ta, tb).tile(tile));
        }
        check(&Case::new(F32, F32, (16, 24, 8), ta, tb));
    }
    let mut c = Case::new(F32, F32, (33, 65, 19), false, true);
    c.batch = 3;
    c.sa = Some(0);
    c.sb = Some(65 * 19 + 1);
    c.ldc = Some(67);
    c.sc = Some(33 * 67 + 5);
    (c.alpha, c.beta) = (-1.0, 0.5);
    for tile in GemmTile::ALL {
        check(&c.clone().tile(tile));
    }
    c.misalign = true;
    check(&c);
}

#[test]
fn many_tiles_grouped_order() {
    // 11 x 3 tiles of 64: more than one group of 8 tile rows, a short last group
    let (m, n) = (64 * 10 + 5, 64 * 3);
    check(&Case::new(BF16, BF16, (m, n, 16), false, true).tile(GemmTile::T64x64).vec(true));
    check(&Case::new(F32, F32, (m, n, 12), true, false).tile(GemmTile::T64x64));
    // 9 x 2 tiles of 128, batched
    let mut c = Case::new(F16, F32, (128 * 8 + 3, 200, 16), false, false)
        .tile(GemmTile::T128x128)
        .vec(true);
    c.batch = 2;
    check(&c);
}

#[test]
fn bad_arguments_are_errors() {
    let emu = Emulator::get().expect("emulator");
    let mut a = RawBuf::new(BF16, 64, 0);
    let mut b = RawBuf::new(BF16, 64, 0);
    let mut c = RawBuf::new(F32, 64, 0);
    for i in 0..64 {
        a.set(i, 1.0);
        b.set(i, 0.5);
    }
    let (pa, pb, pc) = (a.ptr(), b.ptr(), c.mut_ptr());
    let run = |p: &GemmProblem, a: DevPtr, b: DevPtr, c: DevPtr| {
        // SAFETY: the buffers hold the 8 x 8 products of the valid case; every
        // other case must be rejected before a launch.
        unsafe { gemm(emu, p, a, b, c) }
    };
    let ok = GemmProblem::new(GemmShape::new(1, 8, 8, 8), BF16, F32);
    let bad = [
        GemmProblem::new(GemmShape::new(1, 0, 8, 8), BF16, F32),
        GemmProblem::new(GemmShape::new(1, 8, 0, 8), BF16, F32),
        GemmProblem::new(GemmShape::new(1, 8, 8, 0), BF16, F32),
        GemmProblem::new(GemmShape::new(0, 8, 8, 8), BF16, F32),
        GemmProblem::new(GemmShape::new(MAX_BATCH + 1, 1, 1, 1), BF16, F32),
        GemmProblem { dtype_out: F16, ..ok },
        GemmProblem { dtype_in: F16, dtype_out: BF16, ..ok },
        GemmProblem { dtype_in: F32, dtype_out: BF16, ..ok },
        GemmProblem { dtype_in: F32, dtype_out: F16, ..ok },
        ok.with_leading_dims(4, 8, 8),
        ok.with_leading_dims(8, 7, 8),
        ok.with_leading_dims(8, 8, 7),
        GemmProblem::new(GemmShape::new(2, 8, 8, 8), BF16, F32).with_c_batch_stride(32),
    ];
    for p in &bad {
        let r = run(p, pa, pb, pc);
        assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{p:?}: {r:?}");
    }
    // null and misaligned addresses
    for (x, y, z) in [(0, pb, pc), (pa + 1, pb, pc), (pa, pb, pc + 2)] {
        let r = run(&ok, x, y, z);
        assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{x:#x} {y:#x} {z:#x}: {r:?}");
    }
    // the valid product runs: every element is 8 * 1 * 0.5
    run(&ok, pa, pb, pc).expect("valid product");
    assert!((0..64).all(|i| c.get(i) == 4.0));
}
