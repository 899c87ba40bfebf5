//! Padded GEMM operands (`ops::gemm_pad`) in the CPU emulator: the LM head's
//! three products (forward NT, input gradient NN, weight gradient TN) at
//! small sizes with vocabularies 259 and 37, bf16 and f16 inputs, f32 and
//! 16-bit outputs, beta 0 and 1, one batch and several (packed, strided and
//! broadcast), on the default emulated architecture and as `sm_90a`.
//!
//! Each case runs three times through `ops::gemm::gemm_with` on tpar's
//! kernel: padded (`PadPolicy::Always`), unpadded (`PadPolicy::Never`), and
//! unpadded on operands the test itself lays out with 16-byte aligned rows
//! (a stride of row length rounded up to 8, plus 8). The padded run must
//! give the last one's bits (same kernel, only strides differ), reach the
//! aligned kernel (recorded launch names), launch one pitched copy per
//! staged operand, and leave the caller's C outside the product untouched;
//! padded and unpadded runs must both match the f64 reference within the
//! output type's tolerance, and give the same bits where the unpadded run
//! took the same kernel.

mod common;
#[path = "common/recording.rs"]
mod recording;

use std::sync::Arc;

use common::{data, RawBuf};
use recording::Recording;
use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::graph::CudaGraph;
use tpar_kernels::cuda::ops::gemm::{gemm_with, GemmBackend};
use tpar_kernels::cuda::ops::gemm_pad::{PadPolicy, PAD_MIN_WORK};
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, GpuDevice};
use tpar_kernels::gemm::GemmShape;

use CudaDType::{BF16, F16, F32};

// ------------------------------------------------------------ the cases

/// How the test stores B across batches.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Batches {
    /// One matrix after the other.
    Packed,
    /// Every operand's batches 5 elements further apart than one matrix
    /// (C's 3 elements): the per-batch copies.
    Strided,
    /// B broadcast (batch stride 0).
    BroadcastB,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    din: CudaDType,
    dout: CudaDType,
    ta: bool,
    tb: bool,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    beta: f32,
    batches: Batches,
    /// Elements of C's rows past `n` (caller's padding the GEMM must keep).
    ldc_extra: usize,
}

/// The LM head's products with `tokens` rows, vocabulary `v` and hidden
/// size `h` (a linear layer `y = x Wᵀ`, `W` stored `[v, h]`): forward NT
/// `[t, v, h]`, input gradient NN `[t, h, v]` (A = dlogits), weight
/// gradient TN `[v, h, t]` (A = dlogits read transposed).
fn lm_head(din: CudaDType, dout: CudaDType, (t, v, h): (usize, usize, usize)) -> [Case; 3] {
    let case = |ta, tb, m, n, k| Case {
        din,
        dout,
        ta,
        tb,
        batch: 1,
        m,
        n,
        k,
        beta: 0.0,
        batches: Batches::Packed,
        ldc_extra: 0,
    };
    [case(false, true, t, v, h), case(false, false, t, h, v), case(true, false, v, h, t)]
}

/// Every LM-head product at m = 96 tokens, hidden 64, vocabularies 259 and 37,
/// bf16 and f16 in, f32 and 16-bit out, beta 0 and 1.
fn lm_head_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for v in [259, 37] {
        for (din, dout) in [(BF16, F32), (BF16, BF16), (F16, F32), (F16, F16)] {
            for c in lm_head(din, dout, (96, v, 64)) {
                for beta in [0.0, 1.0] {
                    out.push(Case { beta, ..c });
                }
            }
        }
    }
    out
}

/// Batched products (3 batches) in each layout of the LM head, with each
/// kind of batch stride, beta 1 and C rows wider than `n`.
fn batched_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for batches in [Batches::Packed, Batches::Strided, Batches::BroadcastB] {
        for c in lm_head(BF16, F32, (40, 37, 24)) {
            out.push(Case { batch: 3, beta: 1.0, batches, ldc_extra: 3, ..c });
        }
    }
    out
}

/// One operand as the test stores it.
struct Operand {
    ld: usize,
    stride: usize,
    buf: RawBuf,
}

impl Operand {
    /// `copies` matrices of `rows x cols` from `vals` (row-major, packed),
    /// stored at row stride `ld` and batch stride `stride` (0: one matrix);
    /// every other element holds a marker value.
    fn new(
        dt: CudaDType,
        (rows, cols): (usize, usize),
        ld: usize,
        gap: usize,
        copies: usize,
        bcast: bool,
        vals: &[f64],
    ) -> Operand {
        let stride = if bcast { 0 } else { rows * ld + gap };
        let stored = if bcast { 1 } else { copies };
        // twice the span: a write past the operand lands on markers, not the heap
        let len = 2 * ((stored - 1) * stride + rows * ld);
        let mut buf = RawBuf::new(dt, len, 0);
        for i in 0..len {
            buf.set(i, 42.0);
        }
        for b in 0..stored {
            for r in 0..rows {
                for c in 0..cols {
                    buf.set(b * stride + r * ld + c, vals[(b * rows + r) * cols + c]);
                }
            }
        }
        Operand { ld, stride, buf }
    }

    /// Element (b, r, c) of the stored matrices.
    fn at(&self, b: usize, r: usize, c: usize) -> usize {
        b * self.stride + r * self.ld + c
    }
}

/// Row stride of a stored operand: dense, or 16-byte aligned by the test.
#[derive(Clone, Copy, PartialEq)]
enum Rows {
    Dense,
    Aligned,
}

impl Rows {
    fn ld(self, cols: usize) -> usize {
        match self {
            Rows::Dense => cols,
            Rows::Aligned => cols.next_multiple_of(8) + 8,
        }
    }
}

/// Values of one run: C's product region (batch, row, column order) as
/// bits and as f64, the kernels launched, and whether C's other elements
/// kept their marker.
struct Run {
    bits: Vec<u32>,
    vals: Vec<f64>,
    names: Vec<String>,
    rest_kept: bool,
}

/// Case inputs, rounded to their types: A, B, the old C (row-major, packed).
struct Inputs {
    a: Vec<f64>,
    b: Vec<f64>,
    c: Vec<f64>,
}

fn round(dt: CudaDType, v: Vec<f64>) -> Vec<f64> {
    let mut buf = RawBuf::new(dt, v.len(), 0);
    for (i, x) in v.iter().enumerate() {
        buf.set(i, *x);
    }
    (0..v.len()).map(|i| buf.get(i)).collect()
}

fn dims(cs: &Case) -> [(usize, usize); 3] {
    let a = if cs.ta { (cs.k, cs.m) } else { (cs.m, cs.k) };
    let b = if cs.tb { (cs.n, cs.k) } else { (cs.k, cs.n) };
    [a, b, (cs.m, cs.n)]
}

fn inputs(cs: &Case) -> Inputs {
    let [(ar, ac), (br, bc), _] = dims(cs);
    let b_copies = if cs.batches == Batches::BroadcastB { 1 } else { cs.batch };
    Inputs {
        a: round(cs.din, data(cs.batch * ar * ac, 11, 1.0)),
        b: round(cs.din, data(b_copies * br * bc, 12, 1.0)),
        c: round(cs.dout, data(cs.batch * cs.m * cs.n, 13, 1.0)),
    }
}

/// `op(A) op(B) + beta C` in f64 from the rounded inputs.
fn reference(cs: &Case, x: &Inputs) -> Vec<f64> {
    let [(_, ac), (_, bc), _] = dims(cs);
    let mut out = vec![0.0; cs.batch * cs.m * cs.n];
    for b in 0..cs.batch {
        let bb = if cs.batches == Batches::BroadcastB { 0 } else { b };
        for i in 0..cs.m {
            for j in 0..cs.n {
                let mut s = 0.0;
                for l in 0..cs.k {
                    let av = if cs.ta {
                        x.a[(b * cs.k + l) * ac + i]
                    } else {
                        x.a[(b * cs.m + i) * ac + l]
                    };
                    let bv = if cs.tb {
                        x.b[(bb * cs.n + j) * bc + l]
                    } else {
                        x.b[(bb * cs.k + l) * bc + j]
                    };
                    s += av * bv;
                }
                let o = (b * cs.m + i) * cs.n + j;
                out[o] = s + cs.beta as f64 * x.c[o];
            }
        }
    }
    out
}

/// Runs `cs` on `dev` through `ops::gemm::gemm_with` (tpar's kernel, `pad`),
/// with operands stored as `rows` says.
fn run(dev: &Recording, cs: &Case, x: &Inputs, rows: Rows, pad: PadPolicy) -> Run {
    let [(ar, ac), (br, bc), (cr, cc)] = dims(cs);
    // batch gaps and C's wider rows: odd counts, or multiples of 8 when aligned
    let (gap, c_gap, c_ld) = match (cs.batches == Batches::Strided, rows) {
        (false, Rows::Dense) => (0, 0, cc + cs.ldc_extra),
        (true, Rows::Dense) => (5, 3, cc + cs.ldc_extra),
        (strided, Rows::Aligned) => {
            (8 * usize::from(strided), 8 * usize::from(strided), rows.ld(cc))
        }
    };
    let bcast = cs.batches == Batches::BroadcastB;
    let a = Operand::new(cs.din, (ar, ac), rows.ld(ac), gap, cs.batch, false, &x.a);
    let b = Operand::new(cs.din, (br, bc), rows.ld(bc), gap, cs.batch, bcast, &x.b);
    let c = Operand::new(cs.dout, (cr, cc), c_ld, c_gap, cs.batch, false, &x.c);
    let shape = GemmShape {
        trans_a: cs.ta,
        trans_b: cs.tb,
        a_batch_stride: a.stride,
        b_batch_stride: b.stride,
        ..GemmShape::new(cs.batch, cs.m, cs.n, cs.k)
    };
    let p = GemmProblem::new(shape, cs.din, cs.dout)
        .with_leading_dims(a.ld, b.ld, c.ld)
        .with_c_batch_stride(c.stride)
        .with_scale(1.0, cs.beta);
    let da = DeviceBuffer::from_host(&dev.inner, a.buf.bytes()).unwrap();
    let db = DeviceBuffer::from_host(&dev.inner, b.buf.bytes()).unwrap();
    let mut dc = DeviceBuffer::from_host(&dev.inner, c.buf.bytes()).unwrap();
    dev.take_names();
    gemm_with(dev, &p, da.as_slice(), db.as_slice(), dc.as_slice_mut(), GemmBackend::Ours, pad)
        .unwrap_or_else(|e| panic!("{cs:?} {pad:?}: {e}"));
    let names = dev.take_names();
    let mut out = RawBuf::new(cs.dout, c.buf.len(), 0);
    let host = dc.to_host().unwrap();
    for i in 0..out.len() {
        let w = cs.dout.size();
        let v = match w {
            2 => u16::from_le_bytes([host[2 * i], host[2 * i + 1]]) as u32,
            _ => u32::from_le_bytes(host[4 * i..4 * i + 4].try_into().unwrap()),
        };
        out.set_bits(i, v);
    }
    let mut inside = vec![false; out.len()];
    let (mut bits, mut vals) = (Vec::new(), Vec::new());
    for bt in 0..cs.batch {
        for r in 0..cr {
            for col in 0..cc {
                let i = c.at(bt, r, col);
                inside[i] = true;
                bits.push(out.bits(i));
                vals.push(out.get(i));
            }
        }
    }
    let rest_kept = (0..out.len()).all(|i| inside[i] || out.get(i) == 42.0);
    Run { bits, vals, names, rest_kept }
}

/// Largest difference relative to the largest reference magnitude.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).fold(0f64, |m, (g, w)| m.max((g - w).abs())) / scale
}

fn tol(dt: CudaDType) -> f64 {
    match dt {
        F32 => 1e-5,
        BF16 => 1e-2,
        F16 => 2e-3,
    }
}

/// Whether a run's launches include tpar's aligned GEMM kernel: the Hopper
/// kernel as `sm_90a`, else the vectorized `mma.sync` kernel (named by its
/// layout, not `scalar`).
fn aligned_kernel(names: &[String], hopper: bool) -> bool {
    names.iter().any(|n| {
        if hopper {
            n.starts_with("tpar_gemm_hopper_")
        } else {
            n.starts_with("tpar_gemm_")
                && !n.starts_with("tpar_gemm_scalar")
                && !n.contains("hopper")
        }
    })
}

fn copies(names: &[String]) -> usize {
    names.iter().filter(|n| n.starts_with("tpar_copy2d")).count()
}

/// Runs every check of the module docs on `cs` as `arch`.
fn check(arch: Option<&str>, cs: &Case) {
    // `None` is the default architecture even where TPAR_EMU_ARCH names another.
    let dev = Recording::with_arch(arch);
    let hopper = arch == Some("sm_90a");
    let x = inputs(cs);
    let want = reference(cs, &x);
    let padded = run(&dev, cs, &x, Rows::Dense, PadPolicy::Always);
    let plain = run(&dev, cs, &x, Rows::Dense, PadPolicy::Never);
    let aligned = run(&dev, cs, &x, Rows::Aligned, PadPolicy::Never);
    let what = format!("{arch:?} {cs:?}");
    assert!(padded.rest_kept, "{what}: the padded run wrote C outside the product");
    assert!(plain.rest_kept && aligned.rest_kept, "{what}: C outside the product changed");
    // same kernel, strides only: the same bits
    let same = padded.bits.iter().zip(&aligned.bits).filter(|(a, b)| a != b).count();
    assert_eq!(
        same,
        0,
        "{what}: padded vs aligned-by-hand: {same} of {} outputs differ",
        padded.bits.len()
    );
    // both against the f64 reference
    for (label, r) in [("padded", &padded), ("unpadded", &plain)] {
        let err = rel_err(&r.vals, &want);
        assert!(err <= tol(cs.dout), "{what}: {label} rel err {err:.2e}");
    }
    // the test's own aligned layout reaches the aligned kernel without copies
    assert!(aligned_kernel(&aligned.names, hopper), "{what}: {:?}", aligned.names);
    assert_eq!(copies(&aligned.names), 0, "{what}: {:?}", aligned.names);
    // padded: the aligned kernel, one copy per staged operand (C twice when read)
    assert!(aligned_kernel(&padded.names, hopper), "{what}: {:?}", padded.names);
    let [(_, ac), (_, bc), _] = dims(cs);
    let odd = |cols: usize, dt: CudaDType| {
        cs.batches == Batches::Strided || !(cols * dt.size()).is_multiple_of(16)
    };
    let staged_c = odd(cs.n + cs.ldc_extra, cs.dout);
    let want_copies = usize::from(odd(ac, cs.din))
        + usize::from(odd(bc, cs.din))
        + if staged_c { 1 + usize::from(cs.beta != 0.0) } else { 0 };
    assert_eq!(copies(&padded.names), want_copies, "{what}: {:?}", padded.names);
    // where the unpadded run took the same kernel, the same bits too
    if aligned_kernel(&plain.names, hopper) {
        assert_eq!(plain.bits, padded.bits, "{what}: padded vs unpadded on the same kernel");
    }
}

#[test]
fn lm_head_products_default_arch() {
    for cs in lm_head_cases() {
        check(None, &cs);
    }
}

#[test]
fn lm_head_products_sm_90a() {
    for cs in lm_head_cases() {
        check(Some("sm_90a"), &cs);
    }
}

#[test]
fn batched_products_default_arch() {
    for cs in batched_cases() {
        check(None, &cs);
    }
}

#[test]
fn batched_products_sm_90a() {
    for cs in batched_cases() {
        check(Some("sm_90a"), &cs);
    }
}

/// The default policy leaves small products alone and pads the input
/// gradient once it reaches `PAD_MIN_WORK` multiply-adds.
#[test]
fn auto_pads_large_enough_products_only() {
    let dev = Recording::with_arch(None);
    let [_, small, _] = lm_head(BF16, BF16, (96, 259, 64));
    let x = inputs(&small);
    let r = run(&dev, &small, &x, Rows::Dense, PadPolicy::Auto);
    assert_eq!(copies(&r.names), 0, "{:?}", r.names);
    assert!(r.names.iter().any(|n| n.starts_with("tpar_gemm_scalar")), "{:?}", r.names);
    // 1024 x 64 x 259 = 16.97M multiply-adds >= 2^24
    let [_, big, _] = lm_head(BF16, BF16, (1024, 259, 64));
    assert!((big.m * big.n * big.k) as u64 >= PAD_MIN_WORK);
    let x = inputs(&big);
    let r = run(&dev, &big, &x, Rows::Dense, PadPolicy::Auto);
    assert_eq!(copies(&r.names), 1, "{:?}", r.names);
    assert!(aligned_kernel(&r.names, false), "{:?}", r.names);
    let err = rel_err(&r.vals, &reference(&big, &x));
    assert!(err <= tol(BF16), "rel err {err:.2e}");
}

/// A padded product captured into a CUDA graph (scratch from the graph's
/// pool) replays to the eager result.
#[test]
fn padded_products_capture_into_a_graph() {
    let d: Arc<dyn GpuDevice> = EmulatedGpu::open(0).unwrap();
    // the forward product: C's rows (259 elements) are staged, copied in and back
    let cs = Case { beta: 1.0, ..lm_head(BF16, BF16, (96, 259, 64))[0] };
    let x = inputs(&cs);
    let [(ar, ac), (br, bc), (cr, cc)] = dims(&cs);
    let a = Operand::new(cs.din, (ar, ac), ac, 0, 1, false, &x.a);
    let b = Operand::new(cs.din, (br, bc), bc, 0, 1, false, &x.b);
    let c = Operand::new(cs.dout, (cr, cc), cc, 0, 1, false, &x.c);
    let shape = GemmShape { trans_b: true, ..GemmShape::new(1, cs.m, cs.n, cs.k) };
    let p = GemmProblem::new(shape, cs.din, cs.dout).with_scale(1.0, 1.0);
    let da = DeviceBuffer::from_host(&d, a.buf.bytes()).unwrap();
    let db = DeviceBuffer::from_host(&d, b.buf.bytes()).unwrap();
    let mut dc = DeviceBuffer::from_host(&d, c.buf.bytes()).unwrap();
    let step = |dc: &mut DeviceBuffer| {
        gemm_with(
            &*d,
            &p,
            da.as_slice(),
            db.as_slice(),
            dc.as_slice_mut(),
            GemmBackend::Ours,
            PadPolicy::Always,
        )
    };
    step(&mut dc).unwrap();
    let eager = dc.to_host().unwrap();
    dc.upload(c.buf.bytes()).unwrap();
    let graph = CudaGraph::capture(&d, || step(&mut dc)).unwrap();
    assert_eq!(dc.to_host().unwrap(), c.buf.bytes(), "capture ran nothing");
    let s = graph.stats();
    // C in, the GEMM, C back
    assert_eq!(s.kernels, 3, "{s:?}");
    graph.replay().unwrap();
    assert_eq!(dc.to_host().unwrap(), eager);
    // again: C accumulates (beta 1) from the eager result
    dc.upload(&eager).unwrap();
    graph.replay().unwrap();
    let mut again = DeviceBuffer::from_host(&d, &eager).unwrap();
    step(&mut again).unwrap();
    assert_eq!(dc.to_host().unwrap(), again.to_host().unwrap());
    assert_ne!(again.to_host().unwrap(), eager);
}
