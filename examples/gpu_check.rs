//! Checks every CUDA kernel family of `tpar::kernels::cuda::raw` against the
//! CPU kernels, then (with `--bench`, on a GPU) measures their throughput.
//!
//! ```text
//! gpu_check [--device gpu|emulator] [--ordinal N] [--quick] [--bench] [--no-checks]
//!           [--json PATH] [--only FAMILY,...] [--seed N] [--sabotage]
//! gpu_check --precompile ARCH
//! ```
//!
//! `--precompile sm_90` needs no GPU: NVRTC compiles every kernel source for
//! that architecture into the kernel cache (`TPAR_KERNEL_CACHE`, default
//! `~/.cache/tpar/kernels`), so GPU processes with the same NVRTC version
//! load them instead of compiling on first use; it prints the cache files.
//!
//! Part 1, correctness (unless `--no-checks`): fresh random inputs, rounded
//! to the dtype under test, go through the CUDA kernel and through the CPU
//! kernel in f64 on the same rounded values. One line per compared output:
//! `PASS|FAIL name dtype shape err bound`, where `err` is the largest
//! absolute difference divided by the largest reference magnitude and
//! `bound` is 1e-5 for f32 outputs, 1e-2 for bf16 and 2e-3 for f16. Integer
//! outputs (indices, counts, error slots, copies) must match exactly (`err`
//! counts the mismatches). Exit status 1 when a check fails.
//!
//! Sizes: on a GPU they are realistic (GEMM 1024^3 in every layout, the
//! Llama-8B projections 4096x4096x14336 and 4096x14336x4096 in bf16 checked on
//! 256 sampled outputs against an f64 dot product, attention at 1k tokens with
//! 32/8 heads of 128); with `--quick`, and always in the CPU emulator, tiny.
//! Families (for `--only`): gemm, sdpa, rmsnorm, rope, cross_entropy,
//! embedding, adamw, reduce, elementwise, layout. With `--bench`, `--only`
//! also picks the benchmarks: GEMM for `gemm`, attention for `sdpa`, the
//! memory-bound ones for any other family.
//!
//! Part 2, `--bench` (GPU only): bf16 GEMM TFLOP/s, ours and cuBLASLt, NN and
//! NT, for 4096^3, 8192^3 and the Llama-8B projections at 8192 tokens;
//! causal GQA attention (32 q / 8 kv heads of 128, batch x seq = 16k tokens)
//! forward and forward+backward TFLOP/s at seq 1k..8k, at the first two with
//! each tensor-core forward tiling forced (`.m64`, `.m128`), and at the
//! training step's shape of `scripts/gpu-check.sh` (`d64.s1024`: 16 q / 8 kv
//! heads of 64, batch 8, seq 1024; also with each tiling); RMSNorm, RoPE and
//! cross-entropy GB/s next to a measured device-to-device copy (1 GiB). Each
//! time is the median of 3 trials of enough back-to-back calls for ~0.2 s,
//! after a warm-up, bracketed by device synchronizations. `--json` writes the
//! checks and the numbers under the keys `benches/torch_ref.py` uses, so
//! `scripts/gpu-check.sh` can print ours / PyTorch and ours / cuBLASLt.
//!
//! `--sabotage` perturbs one reference value of every comparison, so every
//! check must FAIL: a self-test of the comparisons (exit status 1 when one
//! still passes). Without a GPU: `--device emulator --quick`.

use std::error::Error;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use bytemuck::Pod;
use half::{bf16, f16};
use rayon::prelude::*;

use tpar::kernels::cuda::cublaslt::CublasLt;
use tpar::kernels::cuda::device::CudaDevice;
use tpar::kernels::cuda::emu::{EmulatedGpu, Emulator};
use tpar::kernels::cuda::raw::gemm::{GemmProblem, GemmTile};
use tpar::kernels::cuda::raw::sdpa::{SdpaBwdBuffers, SdpaFwdBuffers, SdpaPath};
use tpar::kernels::cuda::raw::{
    adamw, cross_entropy as ce, elementwise as ew, embedding, gemm, layout, multi, reduce, rmsnorm,
    rope, sdpa,
};
use tpar::kernels::cuda::{CudaDType, DevPtr, DeviceBuffer, GpuDevice, Launcher};
use tpar::kernels::elementwise::{BinaryOp, UnaryOp};
use tpar::kernels::gemm::GemmShape;
use tpar::kernels::reduce::Reduction;
use tpar::kernels::rope::RopeShape;
use tpar::kernels::sdpa::SdpaShape;

use CudaDType::{BF16, F16, F32};

/// Every error of a check or a benchmark, reported and then skipped past.
type Res<T> = Result<T, Box<dyn Error>>;

const DTYPES: [CudaDType; 3] = [F32, BF16, F16];
const LAYOUTS: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];
/// The `ignore_index` of the cross-entropy checks.
const IGNORE: i64 = -100;

/// The largest error a check of an output of `dt` accepts, relative to the
/// largest reference magnitude.
fn bound(dt: CudaDType) -> f64 {
    match dt {
        F32 => 1e-5,
        BF16 => 1e-2,
        F16 => 2e-3,
    }
}

fn dn(dt: CudaDType) -> &'static str {
    dt.suffix()
}

/// `x` rounded to the nearest value of `dt`.
fn round_to(dt: CudaDType, x: f64) -> f64 {
    match dt {
        F32 => x as f32 as f64,
        BF16 => bf16::from_f64(x).to_f64(),
        F16 => f16::from_f64(x).to_f64(),
    }
}

// ------------------------------------------------------------------ raw data

fn as_bytes<T: Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn from_bytes<T: Pod>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
    let n = std::mem::size_of_val(v.as_slice());
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&b[..n]);
    v
}

/// `v` in the device representation of `dt`.
fn encode(dt: CudaDType, v: &[f64]) -> Vec<u8> {
    match dt {
        F32 => as_bytes(&v.par_iter().map(|&x| x as f32).collect::<Vec<f32>>()).to_vec(),
        BF16 => as_bytes(&v.par_iter().map(|&x| bf16::from_f64(x).to_bits()).collect::<Vec<_>>())
            .to_vec(),
        F16 => as_bytes(&v.par_iter().map(|&x| f16::from_f64(x).to_bits()).collect::<Vec<_>>())
            .to_vec(),
    }
}

/// Values of `dt` in device representation, widened.
fn decode(dt: CudaDType, b: &[u8]) -> Vec<f64> {
    match dt {
        F32 => from_bytes::<f32>(b).into_par_iter().map(f64::from).collect(),
        BF16 => from_bytes::<u16>(b).into_par_iter().map(|x| bf16::from_bits(x).to_f64()).collect(),
        F16 => from_bytes::<u16>(b).into_par_iter().map(|x| f16::from_bits(x).to_f64()).collect(),
    }
}

/// Words of `width` bytes (2, 4 or 8) in device representation.
fn encode_words(width: usize, v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes().into_iter().take(width)).collect()
}

fn decode_words(width: usize, b: &[u8]) -> Vec<u64> {
    b.chunks_exact(width)
        .map(|c| c.iter().rev().fold(0u64, |acc, &byte| (acc << 8) | byte as u64))
        .collect()
}

/// Deterministic random numbers: a 64-bit state advanced by splitmix64.
struct Rng(u64);

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix(self.0.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// `n` values uniform in `[lo, hi)`, rounded to `dt` (generated in parallel).
    fn vals(&mut self, dt: CudaDType, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        let seed = self.next();
        (0..n)
            .into_par_iter()
            .map(|i| {
                let u = (splitmix(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407)) >> 11)
                    as f64
                    / (1u64 << 53) as f64;
                round_to(dt, lo + (hi - lo) * u)
            })
            .collect()
    }

    /// `n` random words of `width` bytes.
    fn words(&mut self, n: usize, width: usize) -> Vec<u64> {
        let mask = if width >= 8 { u64::MAX } else { (1u64 << (8 * width)) - 1 };
        (0..n).map(|_| self.next() & mask).collect()
    }
}

// ------------------------------------------------------------------ the device

enum Backend {
    Gpu(Arc<CudaDevice>),
    Emulator(&'static Emulator),
}

/// The device under test: a GPU, or the CPU emulator running the same sources.
struct Dev {
    backend: Backend,
    mem: Arc<dyn GpuDevice>,
}

impl Dev {
    fn open(o: &Opts) -> Result<Dev, String> {
        if o.gpu {
            let cuda = CudaDevice::new(o.ordinal).map_err(|e| e.to_string())?;
            let mem: Arc<dyn GpuDevice> = cuda.clone();
            Ok(Dev { backend: Backend::Gpu(cuda), mem })
        } else {
            let emu = Emulator::get().map_err(|e| e.to_string())?;
            let mem = EmulatedGpu::open(o.ordinal).map_err(|e| e.to_string())?;
            Ok(Dev { backend: Backend::Emulator(emu), mem })
        }
    }

    /// The launcher of the kernels.
    fn l(&self) -> &dyn Launcher {
        match &self.backend {
            Backend::Gpu(d) => d.as_ref(),
            Backend::Emulator(e) => *e,
        }
    }

    fn cuda(&self) -> Option<&Arc<CudaDevice>> {
        match &self.backend {
            Backend::Gpu(d) => Some(d),
            Backend::Emulator(_) => None,
        }
    }

    fn alloc(&self, bytes: usize) -> Res<DeviceBuffer> {
        Ok(DeviceBuffer::alloc(&self.mem, bytes)?)
    }

    fn bytes(&self, b: &[u8]) -> Res<DeviceBuffer> {
        Ok(DeviceBuffer::from_host(&self.mem, b)?)
    }

    fn up(&self, dt: CudaDType, v: &[f64]) -> Res<DeviceBuffer> {
        self.bytes(&encode(dt, v))
    }

    fn up_raw<T: Pod>(&self, v: &[T]) -> Res<DeviceBuffer> {
        self.bytes(as_bytes(v))
    }

    /// An output buffer filled with 0xFF bytes (NaN in every float type), so
    /// that elements a kernel fails to write show up.
    fn junk(&self, bytes: usize) -> Res<DeviceBuffer> {
        self.bytes(&vec![0xFF; bytes])
    }

    fn zeros(&self, bytes: usize) -> Res<DeviceBuffer> {
        Ok(DeviceBuffer::zeros(&self.mem, bytes)?)
    }

    fn down(&self, dt: CudaDType, b: &DeviceBuffer) -> Res<Vec<f64>> {
        Ok(decode(dt, &b.to_host()?))
    }

    fn down_raw<T: Pod>(&self, b: &DeviceBuffer) -> Res<Vec<T>> {
        Ok(from_bytes(&b.to_host()?))
    }

    fn sync(&self) -> Res<()> {
        Ok(self.mem.synchronize()?)
    }
}

// ------------------------------------------------------------------ results

/// One compared output.
struct Check {
    name: String,
    dtype: String,
    shape: String,
    err: f64,
    bound: f64,
    pass: bool,
    note: String,
}

/// The checks so far; prints each as it is recorded.
struct Report {
    checks: Vec<Check>,
    sabotage: bool,
}

/// Largest `|got - want|` over the largest finite `|want|`; a NaN or
/// infinity on one side only is an infinite error.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    let mut e = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g.is_finite() && w.is_finite() {
            e = e.max((g - w).abs() / scale);
        } else if !(g == w || (g.is_nan() && w.is_nan())) {
            return f64::INFINITY;
        }
    }
    e
}

/// Moves the largest finite reference value by ten bounds (`--sabotage`).
fn sabotage(want: &mut [f64], bound: f64) {
    let Some((i, scale)) = want
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, v)| (i, v.abs()))
        .max_by(|a, b| a.1.total_cmp(&b.1))
    else {
        if let Some(w) = want.first_mut() {
            *w = 0.0;
        }
        return;
    };
    want[i] += 10.0 * bound.max(1e-6) * scale.max(1e-30);
}

impl Report {
    fn record(&mut self, name: &str, dtype: &str, shape: &str, err: f64, bound: f64, note: &str) {
        let pass = err <= bound;
        println!(
            "{} {name:<30} {dtype:<9} {shape:<30} err {err:9.2e} bound {bound:.0e}{}{note}",
            if pass { "PASS" } else { "FAIL" },
            if note.is_empty() { "" } else { "  " },
        );
        self.checks.push(Check {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.into(),
            err,
            bound,
            pass,
            note: note.into(),
        });
    }

    fn err_of(&self, got: &[f64], want: &[f64], bound: f64) -> f64 {
        if self.sabotage {
            let mut w = want.to_vec();
            sabotage(&mut w, bound);
            rel_err(got, &w)
        } else {
            rel_err(got, want)
        }
    }

    /// Compares one float output.
    fn close(&mut self, name: &str, dt: &str, shape: &str, got: &[f64], want: &[f64], bound: f64) {
        self.close_note(name, dt, shape, got, want, bound, "");
    }

    fn close_note(
        &mut self,
        name: &str,
        dt: &str,
        shape: &str,
        got: &[f64],
        want: &[f64],
        bound: f64,
        note: &str,
    ) {
        let err = self.err_of(got, want, bound);
        self.record(name, dt, shape, err, bound, note);
    }

    /// Compares several outputs as one check; the note names the worst.
    fn close_parts(
        &mut self,
        name: &str,
        dt: &str,
        shape: &str,
        parts: &[(String, Vec<f64>, Vec<f64>)],
        bound: f64,
    ) {
        let (err, label) = parts
            .iter()
            .map(|(label, got, want)| (self.err_of(got, want, bound), label.as_str()))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap_or((f64::INFINITY, "nothing compared"));
        let note = format!("{} parts, worst {label}", parts.len());
        self.record(name, dt, shape, err, bound, &note);
    }

    /// Compares integer outputs exactly; `err` is the number of mismatches.
    fn exact(&mut self, name: &str, dt: &str, shape: &str, got: &[u64], want: &[u64]) {
        let mut want = want.to_vec();
        if self.sabotage && !want.is_empty() {
            let i = want.len() / 2;
            want[i] ^= 1;
        }
        let mism = if got.len() != want.len() {
            got.len().abs_diff(want.len()).max(1)
        } else {
            got.iter().zip(&want).filter(|(g, w)| g != w).count()
        };
        self.record(name, dt, shape, mism as f64, 0.0, "");
    }

    fn failure(&mut self, name: &str, dt: &str, shape: &str, e: &dyn std::fmt::Display) {
        self.record(name, dt, shape, f64::INFINITY, 0.0, &format!("error: {e}"));
    }
}

/// State of the checks.
struct Ctx<'a> {
    d: &'a Dev,
    r: Report,
    rng: Rng,
    quick: bool,
    only: Vec<String>,
    lt: Option<&'a CublasLt>,
}

impl Ctx<'_> {
    /// Runs one family of checks unless `--only` leaves it out.
    fn family(&mut self, name: &str, f: impl FnOnce(&mut Self)) {
        if !self.only.is_empty() && !self.only.iter().any(|o| o == name) {
            return;
        }
        println!("== {name}");
        let (n0, t0) = (self.r.checks.len(), Instant::now());
        f(self);
        let done = &self.r.checks[n0..];
        println!(
            "   {name}: {} checks, {} failed, {:.1} s",
            done.len(),
            done.iter().filter(|c| !c.pass).count(),
            t0.elapsed().as_secs_f64()
        );
    }

    /// Runs a check body; an error (a rejected launch, a failed copy) is a FAIL line.
    fn guard(&mut self, name: &str, dt: &str, shape: &str, f: impl FnOnce(&mut Self) -> Res<()>) {
        if let Err(e) = f(self) {
            self.r.failure(name, dt, shape, &e);
        }
    }
}

// ------------------------------------------------------------------ gemm

fn layout_name(ta: bool, tb: bool) -> &'static str {
    match (ta, tb) {
        (false, false) => "nn",
        (false, true) => "nt",
        (true, false) => "tn",
        (true, true) => "tt",
    }
}

fn check_gemm(c: &mut Ctx) {
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
}

/// Host operands of one product and its f64 reference.
struct GemmData {
    a: Vec<f64>,
    b: Vec<f64>,
    /// The old C (zeros unless `beta != 0`).
    c_old: Vec<f64>,
    want: Vec<f64>,
}

/// Random operands of `p` and the CPU reference `alpha * op(A) op(B) + beta * C`.
fn gemm_inputs(c: &mut Ctx, p: &GemmProblem) -> Res<GemmData> {
    let s = p.shape;
    let a_len = (s.batch - 1) * s.a_batch_stride + s.m * s.k;
    let b_len = (s.batch - 1) * s.b_batch_stride + s.k * s.n;
    let c_len = s.batch * s.m * s.n;
    let a = c.rng.vals(p.dtype_in, a_len, -1.0, 1.0);
    let b = c.rng.vals(p.dtype_in, b_len, -1.0, 1.0);
    let c_old =
        if p.beta != 0.0 { c.rng.vals(p.dtype_out, c_len, -1.0, 1.0) } else { vec![0.0; c_len] };
    let mut want = vec![0.0f64; c_len];
    tpar::kernels::gemm::matmul::<f64>(&s, &a, &b, &mut want, false)?;
    let (alpha, beta) = (p.alpha as f64, p.beta as f64);
    for (w, o) in want.iter_mut().zip(&c_old) {
        *w = alpha * *w + beta * o;
    }
    Ok(GemmData { a, b, c_old, want })
}

fn gemm_label(p: &GemmProblem) -> (String, String) {
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

fn gemm_case(c: &mut Ctx, p: GemmProblem, tile: Option<GemmTile>) {
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

/// A bf16 product too large for a full CPU reference: 256 random outputs
/// against f64 dot products of the same rounded inputs.
fn gemm_sampled(c: &mut Ctx, m: usize, n: usize, k: usize, ta: bool, tb: bool) {
    let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
    let p = GemmProblem::new(s, BF16, BF16);
    let name = format!("gemm.{}.sampled", layout_name(ta, tb));
    let shape = format!("{m}x{n}x{k} (256 outputs)");
    c.guard(&name, "bf16", &shape, |c| {
        let d = c.d;
        let a = c.rng.vals(BF16, m * k, -1.0, 1.0);
        let b = c.rng.vals(BF16, k * n, -1.0, 1.0);
        let (da, db, dc) = (d.up(BF16, &a)?, d.up(BF16, &b)?, d.junk(m * n * 2)?);
        // SAFETY: A, B and C were allocated above with the extents `p` describes.
        unsafe { gemm::gemm(d.l(), &p, da.ptr(), db.ptr(), dc.ptr())? };
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
fn cublaslt_case(c: &mut Ctx, lt: &CublasLt, p: GemmProblem) {
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

// ------------------------------------------------------------------ sdpa

fn sdpa_shape(
    batch: usize,
    hq: usize,
    hkv: usize,
    q_len: usize,
    kv_len: usize,
    d: usize,
    causal: bool,
) -> SdpaShape {
    SdpaShape {
        batch,
        q_heads: hq,
        kv_heads: hkv,
        q_len,
        kv_len,
        head_dim: d,
        v_dim: d,
        scale: 1.0 / (d as f64).sqrt(),
        causal,
    }
}

fn check_sdpa(c: &mut Ctx) {
    use SdpaPath::*;
    if c.quick {
        for dt in DTYPES {
            sdpa_case(c, dt, sdpa_shape(1, 4, 2, 72, 72, 64, true), Auto);
        }
        sdpa_case(c, BF16, sdpa_shape(1, 4, 2, 80, 80, 128, true), Auto);
        sdpa_case(c, BF16, sdpa_shape(1, 2, 1, 136, 136, 64, true), TensorCoreWide);
        sdpa_case(c, BF16, sdpa_shape(1, 4, 2, 72, 72, 64, true), Simt);
        sdpa_case(c, F16, sdpa_shape(2, 2, 1, 40, 70, 64, false), Auto);
    } else {
        for dt in [BF16, F16] {
            sdpa_case(c, dt, sdpa_shape(2, 32, 8, 1024, 1024, 128, true), Auto);
        }
        sdpa_case(c, F32, sdpa_shape(1, 8, 2, 512, 512, 128, true), Auto);
        sdpa_case(c, BF16, sdpa_shape(4, 16, 4, 1024, 1024, 64, true), Auto);
        sdpa_case(c, BF16, sdpa_shape(1, 8, 2, 512, 512, 128, true), TensorCore);
        sdpa_case(c, BF16, sdpa_shape(1, 8, 2, 512, 512, 128, true), Simt);
        sdpa_case(c, BF16, sdpa_shape(2, 8, 8, 300, 1000, 128, false), Auto);
    }
}

fn sdpa_case(c: &mut Ctx, dt: CudaDType, s: SdpaShape, path: SdpaPath) {
    let base = format!("sdpa.{}", format!("{path:?}").to_lowercase());
    let shape = format!(
        "b{} h{}/{} s{}x{} d{}{}",
        s.batch,
        s.q_heads,
        s.kv_heads,
        s.q_len,
        s.kv_len,
        s.head_dim,
        if s.causal { " causal" } else { "" }
    );
    c.guard(&base, dn(dt), &shape, |c| {
        let d = c.d;
        let nq = s.batch * s.q_heads * s.q_len;
        let nk = s.batch * s.kv_heads * s.kv_len;
        let q = c.rng.vals(dt, nq * s.head_dim, -1.5, 1.5);
        let k = c.rng.vals(dt, nk * s.head_dim, -1.5, 1.5);
        let v = c.rng.vals(dt, nk * s.v_dim, -1.0, 1.0);
        let dout = c.rng.vals(dt, nq * s.v_dim, -1.0, 1.0);
        let mut out = vec![0.0; nq * s.v_dim];
        let mut lse = vec![0.0; nq];
        tpar::kernels::sdpa::sdpa_forward::<f64, _>(&s, &q, &k, &v, None, &mut out, &mut lse)?;
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        tpar::kernels::sdpa::sdpa_backward::<f64>(
            &s, &q, &k, &v, None, &out, &lse, &dout, &mut dq, &mut dk, &mut dv,
        )?;
        let es = dt.size();
        let (bq, bk, bv, bdo) = (d.up(dt, &q)?, d.up(dt, &k)?, d.up(dt, &v)?, d.up(dt, &dout)?);
        let (bo, bl) = (d.junk(out.len() * es)?, d.junk(nq * 4)?);
        let (bdq, bdk, bdv) = (d.junk(q.len() * es)?, d.junk(k.len() * es)?, d.junk(v.len() * es)?);
        let ws_bytes = sdpa::sdpa_backward_workspace_bytes(&s)?;
        let ws = d.junk(ws_bytes)?;
        let fb = SdpaFwdBuffers {
            q: bq.ptr(),
            k: bk.ptr(),
            v: bv.ptr(),
            mask: None,
            out: bo.ptr(),
            lse: bl.ptr(),
        };
        let bb = SdpaBwdBuffers {
            q: bq.ptr(),
            k: bk.ptr(),
            v: bv.ptr(),
            mask: None,
            out: bo.ptr(),
            lse: bl.ptr(),
            dout: bdo.ptr(),
            dq: bdq.ptr(),
            dk: bdk.ptr(),
            dv: bdv.ptr(),
            workspace: ws.ptr(),
            workspace_bytes: ws_bytes,
        };
        // SAFETY: every buffer was allocated above with the size `s` gives it.
        unsafe {
            sdpa::sdpa_forward(d.l(), dt, &s, &fb, path)?;
            sdpa::sdpa_backward(d.l(), dt, &s, &bb, path)?;
        }
        let b = bound(dt);
        let name = |what: &str| format!("{base}.{what}");
        c.r.close(&name("out"), dn(dt), &shape, &d.down(dt, &bo)?, &out, b);
        c.r.close(&name("lse"), dn(dt), &shape, &d.down(F32, &bl)?, &lse, b);
        c.r.close(&name("dq"), dn(dt), &shape, &d.down(dt, &bdq)?, &dq, b);
        c.r.close(&name("dk"), dn(dt), &shape, &d.down(dt, &bdk)?, &dk, b);
        c.r.close(&name("dv"), dn(dt), &shape, &d.down(dt, &bdv)?, &dv, b);
        Ok(())
    });
}

// ------------------------------------------------------------------ rmsnorm

fn check_rmsnorm(c: &mut Ctx) {
    let cases: &[(CudaDType, usize, usize)] = if c.quick {
        &[(F32, 33, 200), (BF16, 33, 200), (F16, 7, 1000), (BF16, 4, 4096)]
    } else {
        &[(F32, 4096, 4096), (BF16, 4096, 4096), (F16, 4096, 4096), (BF16, 1000, 5120)]
    };
    for &(dt, rows, dim) in cases {
        rmsnorm_case(c, dt, rows, dim);
    }
}

fn rmsnorm_case(c: &mut Ctx, dt: CudaDType, rows: usize, dim: usize) {
    let shape = format!("{rows}x{dim}");
    c.guard("rmsnorm", dn(dt), &shape, |c| {
        let d = c.d;
        let eps = 1e-5;
        let x = c.rng.vals(dt, rows * dim, -2.0, 2.0);
        let w: Vec<f64> = c.rng.vals(F32, dim, 0.5, 1.5).iter().map(|&v| round_to(dt, v)).collect();
        let dy = c.rng.vals(dt, rows * dim, -1.0, 1.0);
        let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
        tpar::kernels::rmsnorm::rmsnorm_forward::<f64, _>(
            &x, &w, rows, dim, eps, &mut y, &mut rstd,
        )?;
        let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; dim]);
        tpar::kernels::rmsnorm::rmsnorm_backward::<f64, _>(
            &x, &w, &rstd, &dy, rows, dim, &mut dx, &mut dw,
        )?;
        let es = dt.size();
        let (bx, bw, bdy) = (d.up(dt, &x)?, d.up(dt, &w)?, d.up(dt, &dy)?);
        let (by, brstd, bdx, bdw) =
            (d.junk(x.len() * es)?, d.junk(rows * 4)?, d.junk(x.len() * es)?, d.junk(dim * 4)?);
        let ws = d.junk(rmsnorm::backward_workspace_bytes(rows, dim))?;
        // SAFETY: every buffer was allocated above with the size the op needs.
        unsafe {
            rmsnorm::rmsnorm_forward(
                d.l(),
                dt,
                bx.ptr(),
                bw.ptr(),
                by.ptr(),
                brstd.ptr(),
                rows,
                dim,
                eps as f32,
            )?;
            rmsnorm::rmsnorm_backward(
                d.l(),
                dt,
                bx.ptr(),
                bw.ptr(),
                brstd.ptr(),
                bdy.ptr(),
                bdx.ptr(),
                bdw.ptr(),
                ws.ptr(),
                rows,
                dim,
            )?;
        }
        let b = bound(dt);
        c.r.close("rmsnorm.y", dn(dt), &shape, &d.down(dt, &by)?, &y, b);
        c.r.close("rmsnorm.rstd", dn(dt), &shape, &d.down(F32, &brstd)?, &rstd, b);
        c.r.close("rmsnorm.dx", dn(dt), &shape, &d.down(dt, &bdx)?, &dx, b);
        c.r.close("rmsnorm.dw", dn(dt), &shape, &d.down(F32, &bdw)?, &dw, b);
        Ok(())
    });
}

// ------------------------------------------------------------------ rope

/// HF-layout RoPE tables `[seq, head_dim]` (theta 10000), rounded to `dt`.
fn rope_tables(dt: CudaDType, seq: usize, hd: usize) -> (Vec<f64>, Vec<f64>) {
    let half = (hd / 2).max(1);
    let mut cos = Vec::with_capacity(seq * hd);
    let mut sin = Vec::with_capacity(seq * hd);
    for p in 0..seq {
        for j in 0..hd {
            let inv = 10000f64.powf(-2.0 * (j % half) as f64 / hd as f64);
            cos.push(round_to(dt, (p as f64 * inv).cos()));
            sin.push(round_to(dt, (p as f64 * inv).sin()));
        }
    }
    (cos, sin)
}

fn rope_label(s: &RopeShape) -> String {
    format!("o{} s{} i{} d{}", s.outer, s.seq, s.inner, s.head_dim)
}

fn check_rope(c: &mut Ctx) {
    let rs = |outer, seq, inner, head_dim| RopeShape { outer, seq, inner, head_dim };
    let cases: Vec<(CudaDType, RopeShape)> = if c.quick {
        vec![(F32, rs(3, 17, 2, 64)), (BF16, rs(3, 17, 2, 64)), (F16, rs(2, 9, 3, 6))]
    } else {
        vec![(BF16, rs(64, 2048, 1, 128)), (F32, rs(4, 1024, 8, 128)), (F16, rs(2, 1024, 32, 128))]
    };
    for (dt, s) in cases {
        rope_case(c, dt, s);
    }
    let (q, k) = if c.quick {
        (rs(2 * 4, 17, 1, 64), rs(2 * 2, 17, 1, 64))
    } else {
        (rs(2 * 32, 2048, 1, 128), rs(2 * 8, 2048, 1, 128))
    };
    rope_qk_case(c, BF16, q, k);
}

fn rope_case(c: &mut Ctx, dt: CudaDType, s: RopeShape) {
    let shape = rope_label(&s);
    c.guard("rope", dn(dt), &shape, |c| {
        let d = c.d;
        let n = s.outer * s.seq * s.inner * s.head_dim;
        let x = c.rng.vals(dt, n, -2.0, 2.0);
        let dy = c.rng.vals(dt, n, -1.0, 1.0);
        let (cos, sin) = rope_tables(dt, s.seq, s.head_dim);
        let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
        tpar::kernels::rope::rope_forward::<f64, _>(&s, &x, &cos, &sin, &mut y)?;
        tpar::kernels::rope::rope_backward::<f64, _>(&s, &dy, &cos, &sin, &mut dx)?;
        let (bx, bdy, bc, bs) = (d.up(dt, &x)?, d.up(dt, &dy)?, d.up(dt, &cos)?, d.up(dt, &sin)?);
        let (by, bdx) = (d.junk(n * dt.size())?, d.junk(n * dt.size())?);
        // SAFETY: every buffer was allocated above with the size `s` gives it.
        unsafe {
            rope::rope_forward(d.l(), dt, &s, bx.ptr(), bc.ptr(), bs.ptr(), by.ptr())?;
            rope::rope_backward(d.l(), dt, &s, bdy.ptr(), bc.ptr(), bs.ptr(), bdx.ptr())?;
        }
        c.r.close("rope.fwd", dn(dt), &shape, &d.down(dt, &by)?, &y, bound(dt));
        c.r.close("rope.bwd", dn(dt), &shape, &d.down(dt, &bdx)?, &dx, bound(dt));
        Ok(())
    });
}

/// Queries and keys (GQA: fewer key heads) rotated in place.
fn rope_qk_case(c: &mut Ctx, dt: CudaDType, qs: RopeShape, ks: RopeShape) {
    let shape = format!("q {} k o{}", rope_label(&qs), ks.outer);
    c.guard("rope.qk_inplace", dn(dt), &shape, |c| {
        let d = c.d;
        let nq = qs.outer * qs.seq * qs.inner * qs.head_dim;
        let nk = ks.outer * ks.seq * ks.inner * ks.head_dim;
        let (q, k) = (c.rng.vals(dt, nq, -2.0, 2.0), c.rng.vals(dt, nk, -2.0, 2.0));
        let (cos, sin) = rope_tables(dt, qs.seq, qs.head_dim);
        let (mut qr, mut kr) = (vec![0.0; nq], vec![0.0; nk]);
        tpar::kernels::rope::rope_forward::<f64, _>(&qs, &q, &cos, &sin, &mut qr)?;
        tpar::kernels::rope::rope_forward::<f64, _>(&ks, &k, &cos, &sin, &mut kr)?;
        let (bq, bk, bc, bs) = (d.up(dt, &q)?, d.up(dt, &k)?, d.up(dt, &cos)?, d.up(dt, &sin)?);
        // SAFETY: every buffer was allocated above with the size its shape gives it.
        unsafe {
            rope::rope_qk_inplace(
                d.l(),
                dt,
                &qs,
                bq.ptr(),
                &ks,
                bk.ptr(),
                bc.ptr(),
                bs.ptr(),
                false,
            )?
        };
        let parts =
            vec![("q".to_string(), d.down(dt, &bq)?, qr), ("k".to_string(), d.down(dt, &bk)?, kr)];
        c.r.close_parts("rope.qk_inplace", dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}

// ------------------------------------------------------------------ cross-entropy

fn check_cross_entropy(c: &mut Ctx) {
    let cases: &[(CudaDType, usize, usize)] = if c.quick {
        &[(F32, 37, 300), (BF16, 37, 300), (F16, 37, 300), (BF16, 9, 2000)]
    } else {
        &[(F32, 4096, 32000), (BF16, 4096, 32000), (F16, 4096, 32000), (BF16, 512, 128256)]
    };
    for &(dt, rows, vocab) in cases {
        ce_case(c, dt, rows, vocab);
    }
}

/// Random targets; every seventh row is ignored.
fn ce_targets(c: &mut Ctx, rows: usize, vocab: usize) -> Vec<i64> {
    (0..rows).map(|r| if r % 7 == 3 { IGNORE } else { c.rng.below(vocab) as i64 }).collect()
}

/// Columns `[start, start + width)` of a row-major `[rows, cols]` matrix.
fn columns(m: &[f64], cols: usize, start: usize, width: usize) -> Vec<f64> {
    m.chunks_exact(cols).flat_map(|row| row[start..start + width].iter().copied()).collect()
}

fn ce_case(c: &mut Ctx, dt: CudaDType, rows: usize, vocab: usize) {
    let shape = format!("{rows}x{vocab}");
    c.guard("cross_entropy", dn(dt), &shape, |c| {
        let d = c.d;
        let l = d.l();
        let b = bound(dt);
        let logits = c.rng.vals(dt, rows * vocab, -4.0, 4.0);
        let targets = ce_targets(c, rows, vocab);
        let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        let count = tpar::kernels::cross_entropy::cross_entropy_forward::<f64>(
            &logits, rows, vocab, &targets, IGNORE, &mut loss, &mut lse,
        )?;
        let scale = 1.0 / count.max(1) as f64;
        let mut dlogits = vec![0.0; logits.len()];
        tpar::kernels::cross_entropy::cross_entropy_backward::<f64, _>(
            &logits,
            rows,
            vocab,
            &targets,
            0,
            IGNORE,
            &lse,
            &[scale],
            &mut dlogits,
        )?;
        let (bl, bt) = (d.up(dt, &logits)?, d.up_raw(&targets)?);
        let (bloss, blse, bcount, berr) =
            (d.junk(rows * 4)?, d.junk(rows * 4)?, d.zeros(4)?, d.up_raw(&[ce::NO_ERROR])?);
        let (blse_ref, bscale) = (d.up(F32, &lse)?, d.up(F32, &[scale])?);
        let bdl = d.junk(logits.len() * dt.size())?;
        // SAFETY: every buffer was allocated above with the size the op needs.
        unsafe {
            ce::cross_entropy_forward(
                l,
                dt,
                bl.ptr(),
                rows,
                vocab,
                bt.ptr(),
                IGNORE,
                bloss.ptr(),
                blse.ptr(),
                bcount.ptr(),
                berr.ptr(),
            )?;
            ce::cross_entropy_backward(
                l,
                dt,
                bl.ptr(),
                rows,
                vocab,
                bt.ptr(),
                0,
                IGNORE,
                blse_ref.ptr(),
                bscale.ptr(),
                1,
                bdl.ptr(),
            )?;
        }
        c.r.close("ce.fwd.loss", dn(dt), &shape, &d.down(F32, &bloss)?, &loss, b);
        c.r.close("ce.fwd.lse", dn(dt), &shape, &d.down(F32, &blse)?, &lse, b);
        let got_count = d.down_raw::<i32>(&bcount)?[0];
        let got_err = d.down_raw::<i32>(&berr)?[0];
        c.r.exact(
            "ce.fwd.count+error",
            "i32",
            &shape,
            &[got_count as u64, got_err as u64],
            &[count as u64, ce::NO_ERROR as u64],
        );
        c.r.close("ce.bwd", dn(dt), &shape, &d.down(dt, &bdl)?, &dlogits, b);

        // Vocab-parallel pieces: two shards split at an unaligned column.
        let v0 = vocab / 3;
        let widths = [v0, vocab - v0];
        let mut stats = Vec::new();
        for (shard, &width) in widths.iter().enumerate() {
            let start = if shard == 0 { 0 } else { v0 };
            let part = columns(&logits, vocab, start, width);
            let (mut mx, mut se, mut tl) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
            tpar::kernels::cross_entropy::ce_local_stats::<f64>(
                &part,
                rows,
                width,
                &targets,
                start as i64,
                vocab,
                IGNORE,
                &mut mx,
                &mut se,
                &mut tl,
            )?;
            stats.push((mx, se, tl));
            if shard == 0 {
                continue;
            }
            let bpart = d.up(dt, &part)?;
            let (bmx, bse, btl, berr) = (
                d.junk(rows * 4)?,
                d.junk(rows * 4)?,
                d.junk(rows * 4)?,
                d.up_raw(&[ce::NO_ERROR])?,
            );
            // Per-row scales, backward of the shard with the global lse.
            let row_scale = c.rng.vals(F32, rows, 0.5, 1.5);
            let mut dpart = vec![0.0; part.len()];
            tpar::kernels::cross_entropy::cross_entropy_backward::<f64, _>(
                &part,
                rows,
                width,
                &targets,
                start as i64,
                IGNORE,
                &lse,
                &row_scale,
                &mut dpart,
            )?;
            let (brs, bdpart) = (d.up(F32, &row_scale)?, d.junk(part.len() * dt.size())?);
            // SAFETY: every buffer was allocated above with the size the op needs.
            unsafe {
                ce::ce_local_stats(
                    l,
                    dt,
                    bpart.ptr(),
                    rows,
                    width,
                    bt.ptr(),
                    start as i64,
                    vocab,
                    IGNORE,
                    bmx.ptr(),
                    bse.ptr(),
                    btl.ptr(),
                    berr.ptr(),
                )?;
                ce::cross_entropy_backward(
                    l,
                    dt,
                    bpart.ptr(),
                    rows,
                    width,
                    bt.ptr(),
                    start as i64,
                    IGNORE,
                    blse_ref.ptr(),
                    brs.ptr(),
                    rows,
                    bdpart.ptr(),
                )?;
            }
            let (mx, se, tl) = &stats[1];
            let parts = vec![
                ("max".to_string(), d.down(F32, &bmx)?, mx.clone()),
                ("sumexp".to_string(), d.down(F32, &bse)?, se.clone()),
                ("target_logit".to_string(), d.down(F32, &btl)?, tl.clone()),
            ];
            let sh = format!("{rows}x{width}@{start}");
            c.r.close_parts("ce.shard.stats", dn(dt), &sh, &parts, b);
            c.r.close("ce.shard.bwd", dn(dt), &sh, &d.down(dt, &bdpart)?, &dpart, b);
        }
        if dt == F32 {
            ce_fold(c, &shape, &stats, &targets, &loss, count)?;
        }
        Ok(())
    });
}

/// The f32 kernels that fold shard statistics: merge, rescale, lse, loss.
fn ce_fold(
    c: &mut Ctx,
    shape: &str,
    stats: &[(Vec<f64>, Vec<f64>, Vec<f64>)],
    targets: &[i64],
    loss_ref: &[f64],
    count: usize,
) -> Res<()> {
    use tpar::kernels::cross_entropy as cpu;
    let d = c.d;
    let l = d.l();
    let rows = targets.len();
    let b = bound(F32);
    let ((mx0, se0, tl0), (mx1, se1, tl1)) = (&stats[0], &stats[1]);
    let round = |v: &[f64]| v.iter().map(|&x| round_to(F32, x)).collect::<Vec<_>>();
    let (mx0, se0, mx1, se1) = (round(mx0), round(se0), round(mx1), round(se1));
    // merge
    let (mut mx, mut se) = (mx0.clone(), se0.clone());
    cpu::ce_merge::<f64>(&mut mx, &mut se, &mx1, &se1)?;
    let (bmx, bse, bmx1, bse1) =
        (d.up(F32, &mx0)?, d.up(F32, &se0)?, d.up(F32, &mx1)?, d.up(F32, &se1)?);
    // SAFETY: four f32 buffers of `rows` elements.
    unsafe { ce::ce_merge(l, bmx.ptr(), bse.ptr(), bmx1.ptr(), bse1.ptr(), rows)? };
    let parts = vec![
        ("max".to_string(), d.down(F32, &bmx)?, mx.clone()),
        ("sumexp".to_string(), d.down(F32, &bse)?, se.clone()),
    ];
    c.r.close_parts("ce.merge", "f32", shape, &parts, b);
    // rescale shard 1 to the merged max
    let mx_r = round(&mx);
    let mut se1r = se1.clone();
    cpu::ce_rescale::<f64>(&mx1, &mut se1r, &mx_r)?;
    let (bse1r, bgmx) = (d.up(F32, &se1)?, d.up(F32, &mx_r)?);
    // SAFETY: three f32 buffers of `rows` elements.
    unsafe { ce::ce_rescale(l, bmx1.ptr(), bse1r.ptr(), bgmx.ptr(), rows)? };
    c.r.close("ce.rescale", "f32", shape, &d.down(F32, &bse1r)?, &se1r, b);
    // lse of the merged statistics
    let se_r = round(&se);
    let mut lse = vec![0.0; rows];
    cpu::ce_lse::<f64>(&mx_r, &se_r, &mut lse)?;
    let (bse_r, blse) = (d.up(F32, &se_r)?, d.junk(rows * 4)?);
    // SAFETY: three f32 buffers of `rows` elements.
    unsafe { ce::ce_lse(l, bgmx.ptr(), bse_r.ptr(), blse.ptr(), rows)? };
    c.r.close("ce.lse", "f32", shape, &d.down(F32, &blse)?, &lse, b);
    // loss from the lse and the summed target logits: the unsharded loss
    let tl: Vec<f64> = tl0.iter().zip(tl1).map(|(a, b)| round_to(F32, a + b)).collect();
    let (btl, bt, bloss, bcount) =
        (d.up(F32, &tl)?, d.up_raw(targets)?, d.junk(rows * 4)?, d.zeros(4)?);
    // SAFETY: f32 buffers and i64 targets of `rows` elements, one i32 counter.
    unsafe {
        ce::ce_loss(l, blse.ptr(), btl.ptr(), bt.ptr(), IGNORE, rows, bloss.ptr(), bcount.ptr())?
    };
    c.r.close("ce.loss(sharded)", "f32", shape, &d.down(F32, &bloss)?, loss_ref, b);
    let got = d.down_raw::<i32>(&bcount)?[0];
    c.r.exact("ce.loss.count", "i32", shape, &[got as u64], &[count as u64]);
    Ok(())
}

// ------------------------------------------------------------------ embedding

fn check_embedding(c: &mut Ctx) {
    // (dtype, vocab, dim, ids, vocab_start, masked)
    let cases: &[(CudaDType, usize, usize, usize, i64, bool)] = if c.quick {
        &[(F32, 50, 72, 40, 0, false), (BF16, 30, 64, 40, 10, true), (F16, 50, 13, 33, 0, false)]
    } else {
        &[
            (BF16, 32000, 4096, 8192, 0, false),
            (F32, 64128, 1024, 4096, 64128, true),
            (F16, 32000, 4096, 8192, 0, false),
        ]
    };
    for &(dt, vocab, dim, n, start, masked) in cases {
        embedding_case(c, dt, vocab, dim, n, start, masked);
    }
}

fn embedding_case(
    c: &mut Ctx,
    dt: CudaDType,
    vocab: usize,
    dim: usize,
    n: usize,
    start: i64,
    masked: bool,
) {
    let shape = format!(
        "v{vocab} d{dim} n{n}{}",
        if masked { format!(" @{start} masked") } else { "".into() }
    );
    c.guard("embedding", dn(dt), &shape, |c| {
        use tpar::kernels::embedding as cpu;
        let d = c.d;
        let l = d.l();
        let b = bound(dt);
        let w = c.rng.vals(dt, vocab * dim, -1.0, 1.0);
        let mut ids: Vec<i64> = (0..n)
            .map(|_| {
                if masked {
                    c.rng.below(start as usize + vocab + 7) as i64
                } else {
                    start + c.rng.below(vocab) as i64
                }
            })
            .collect();
        for i in (0..n).step_by(5) {
            ids[i] = ids[0];
        }
        let dout = c.rng.vals(dt, n * dim, -1.0, 1.0);
        let mut out = vec![0.0; n * dim];
        cpu::embedding_forward::<f64, _>(&w, vocab, dim, &ids, start, masked, &mut out)?;
        let mut dw = vec![0.0; vocab * dim];
        cpu::embedding_backward::<f64>(&ids, start, masked, &dout, vocab, dim, &mut dw)?;
        let csr = embedding::EmbeddingCsr::build(&ids, start, vocab, masked)?;
        let es = dt.size();
        let (bw, bids, bdout) = (d.up(dt, &w)?, d.up_raw(&ids)?, d.up(dt, &dout)?);
        let (bout, berr) = (d.junk(out.len() * es)?, d.up_raw(&[embedding::NO_ERROR])?);
        let (brs, bpos) = (d.up_raw(&csr.row_start)?, d.up_raw(&csr.positions)?);
        let (bdw_csr, bdw_atomic) = (d.junk(dw.len() * es)?, d.junk(dw.len() * es)?);
        let acc = if dt == F32 { None } else { Some(d.junk(dw.len() * 4)?) };
        let acc_ptr = acc.as_ref().map_or(bdw_atomic.ptr(), DeviceBuffer::ptr);
        // SAFETY: every buffer was allocated above with the size the op needs;
        // the CSR was built for these ids and this table slice.
        unsafe {
            embedding::embedding_forward(
                l,
                dt,
                bw.ptr(),
                vocab,
                dim,
                bids.ptr(),
                n,
                start,
                masked,
                bout.ptr(),
                berr.ptr(),
            )?;
            embedding::embedding_backward_csr(
                l,
                dt,
                brs.ptr(),
                bpos.ptr(),
                csr.positions.len(),
                bdout.ptr(),
                n,
                vocab,
                dim,
                bdw_csr.ptr(),
            )?;
            embedding::embedding_backward_atomic(
                l,
                dt,
                bids.ptr(),
                n,
                start,
                masked,
                bdout.ptr(),
                vocab,
                dim,
                bdw_atomic.ptr(),
                acc_ptr,
                0,
            )?;
        }
        c.r.close("embedding.fwd", dn(dt), &shape, &d.down(dt, &bout)?, &out, b);
        let got_err = d.down_raw::<i32>(&berr)?[0];
        c.r.exact(
            "embedding.fwd.error",
            "i32",
            &shape,
            &[got_err as u64],
            &[embedding::NO_ERROR as u64],
        );
        c.r.close("embedding.bwd_csr", dn(dt), &shape, &d.down(dt, &bdw_csr)?, &dw, b);
        c.r.close("embedding.bwd_atomic", dn(dt), &shape, &d.down(dt, &bdw_atomic)?, &dw, b);
        Ok(())
    });
}

// ------------------------------------------------------------------ adamw

fn check_adamw(c: &mut Ctx) {
    let n = if c.quick { 1003 } else { (1 << 24) + 3 };
    let lens = multi_lens(c);
    for (dt, gdt) in [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)] {
        adamw_case(c, dt, gdt, n);
        adamw_each_case(c, dt, gdt, &lens);
    }
}

/// The hyper-parameters of the adamw checks: the third step.
fn adamw_hyper() -> tpar::kernels::adamw::AdamWParams {
    tpar::kernels::adamw::AdamWParams {
        lr: 0.05,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
    }
}

fn adamw_dtype(dt: CudaDType, gdt: CudaDType) -> String {
    if dt == gdt {
        dn(dt).to_string()
    } else {
        format!("{}+{}grad", dn(dt), dn(gdt))
    }
}

fn adamw_case(c: &mut Ctx, dt: CudaDType, gdt: CudaDType, n: usize) {
    let dtype = adamw_dtype(dt, gdt);
    let shape = format!("n{n} step 3");
    c.guard("adamw", &dtype, &shape, |c| {
        let d = c.d;
        let h = adamw_hyper();
        let p0 = c.rng.vals(dt, n, -1.0, 1.0);
        let g = c.rng.vals(gdt, n, -1.0, 1.0);
        let m0 = c.rng.vals(F32, n, -0.1, 0.1);
        let v0 = c.rng.vals(F32, n, 0.0, 0.01);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        tpar::kernels::adamw::adamw_step::<f64>(&mut p, &g, &mut m, &mut v, &h)?;
        let (bp, bg, bm, bv) = (d.up(dt, &p0)?, d.up(gdt, &g)?, d.up(F32, &m0)?, d.up(F32, &v0)?);
        // SAFETY: four buffers of `n` elements allocated above.
        unsafe {
            adamw::adamw_step(d.l(), dt, gdt, bp.ptr(), bg.ptr(), bm.ptr(), bv.ptr(), n, &h)?
        };
        c.r.close("adamw.param", &dtype, &shape, &d.down(dt, &bp)?, &p, bound(dt));
        let parts = vec![
            ("exp_avg".to_string(), d.down(F32, &bm)?, m),
            ("exp_avg_sq".to_string(), d.down(F32, &bv)?, v),
        ];
        c.r.close_parts("adamw.moments", &dtype, &shape, &parts, bound(F32));
        Ok(())
    });
}

/// `adamw::adamw_step_each` over tensors of `lens` against `adamw::adamw_step` on each
/// alone: parameters and moments, the same bits.
fn adamw_each_case(c: &mut Ctx, dt: CudaDType, gdt: CudaDType, lens: &[usize]) {
    let dtype = adamw_dtype(dt, gdt);
    let shape = format!("{} tensors step 3", lens.len());
    c.guard("adamw", &dtype, &shape, |c| {
        let d = c.d;
        let h = adamw_hyper();
        let (mut alone, mut each, mut grads) = (Vec::new(), Vec::new(), Vec::new());
        for &n in lens {
            let p0 = c.rng.vals(dt, n, -1.0, 1.0);
            let g = c.rng.vals(gdt, n, -1.0, 1.0);
            let m0 = c.rng.vals(F32, n, -0.1, 0.1);
            let v0 = c.rng.vals(F32, n, 0.0, 0.01);
            for set in [&mut alone, &mut each] {
                set.push((d.up(dt, &p0)?, d.up(F32, &m0)?, d.up(F32, &v0)?));
            }
            grads.push(d.up(gdt, &g)?);
        }
        for (((p, m, v), g), &n) in alone.iter().zip(&grads).zip(lens) {
            // SAFETY: four buffers of `n` elements allocated above.
            unsafe {
                adamw::adamw_step(d.l(), dt, gdt, p.ptr(), g.ptr(), m.ptr(), v.ptr(), n, &h)?
            };
        }
        let bufs: Vec<adamw::AdamwBuffers> = each
            .iter()
            .zip(&grads)
            .zip(lens)
            .map(|(((p, m, v), g), &n)| adamw::AdamwBuffers {
                param: p.ptr(),
                grad: g.ptr(),
                exp_avg: m.ptr(),
                exp_avg_sq: v.ptr(),
                n,
            })
            .collect();
        // SAFETY: every tensor's four buffers were allocated above with its elements.
        unsafe { adamw::adamw_step_each(d.l(), dt, gdt, &bufs, &h)? };
        let bits = |sets: &[(DeviceBuffer, DeviceBuffer, DeviceBuffer)]| -> Res<Vec<u64>> {
            let mut out = Vec::new();
            for (p, m, v) in sets {
                for (t, b) in [(dt, p), (F32, m), (F32, v)] {
                    out.extend(d.down(t, b)?.iter().map(|x| x.to_bits()));
                }
            }
            Ok(out)
        };
        c.r.exact("adamw.each", &dtype, &shape, &bits(&each)?, &bits(&alone)?);
        Ok(())
    });
}

// ------------------------------------------------------------------ reduce

fn check_reduce(c: &mut Ctx) {
    let shapes: &[(usize, usize, usize)] = if c.quick {
        &[(5, 300, 1), (3, 70, 40), (1, 40000, 1)]
    } else {
        &[(4096, 4096, 1), (64, 1000, 512), (1, 1 << 26, 1)]
    };
    for dt in DTYPES {
        for &(outer, len, inner) in shapes {
            reduce_case(c, dt, outer, len, inner);
        }
    }
    let (rows, len) = if c.quick { (4, 5000) } else { (64, 1 << 20) };
    for dt in DTYPES {
        sum_squares_case(c, dt, rows, len);
    }
    let lens = multi_lens(c);
    for dt in DTYPES {
        multi_case(c, dt, &lens);
    }
}

/// Tensor lengths for the multi-tensor checks: more tensors than one launch takes, sizes
/// around the 16384-element chunk.
fn multi_lens(c: &Ctx) -> Vec<usize> {
    let mut lens = vec![0, 1, 7, 16383, 16384, 16385, 3000, if c.quick { 40000 } else { 1 << 22 }];
    lens.extend((0..30).map(|i| 100 + 37 * i));
    lens
}

/// `multi::sum_squares_each` and `multi::scale_each` over tensors of `lens`.
fn multi_case(c: &mut Ctx, dt: CudaDType, lens: &[usize]) {
    let shape = format!("{} tensors", lens.len());
    c.guard("multi", dn(dt), &shape, |c| {
        let d = c.d;
        let xs: Vec<Vec<f64>> = lens.iter().map(|&n| c.rng.vals(dt, n, -1.0, 1.0)).collect();
        let bxs = xs.iter().map(|x| d.up(dt, x)).collect::<Res<Vec<_>>>()?;
        let ptrs: Vec<(DevPtr, usize)> = bxs.iter().zip(lens).map(|(b, &n)| (b.ptr(), n)).collect();
        let want: Vec<f64> = xs.iter().map(|x| x.iter().map(|v| v * v).sum()).collect();
        let ws_len = multi::sum_squares_each_workspace_len(lens);
        let (bout, ws) = (d.junk(lens.len() * 4)?, d.junk(ws_len.max(1) * 4)?);
        // SAFETY: every tensor, out and the workspace were allocated above with these sizes.
        unsafe { multi::sum_squares_each(d.l(), dt, &ptrs, bout.ptr(), ws.ptr(), ws_len)? };
        let got = d.down(F32, &bout)?;
        c.r.close("multi.sum_squares_each", dn(dt), &shape, &got, &want, bound(F32));
        let coef = 0.3712f32;
        let bc = d.up_raw(&[coef])?;
        let bys = lens.iter().map(|&n| d.junk(n.max(1) * dt.size())).collect::<Res<Vec<_>>>()?;
        let pairs: Vec<(DevPtr, DevPtr, usize)> =
            bxs.iter().zip(&bys).zip(lens).map(|((x, y), &n)| (x.ptr(), y.ptr(), n)).collect();
        // SAFETY: as above; each output holds its tensor's elements.
        unsafe { multi::scale_each(d.l(), dt, &pairs, bc.ptr())? };
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for ((x, y), &n) in xs.iter().zip(&bys).zip(lens) {
            got.extend(d.down(dt, y)?.into_iter().take(n));
            want.extend(x.iter().map(|v| v * coef as f64));
        }
        c.r.close("multi.scale_each", dn(dt), &shape, &got, &want, bound(dt));
        Ok(())
    });
}

fn reduce_case(c: &mut Ctx, dt: CudaDType, outer: usize, len: usize, inner: usize) {
    let shape = format!("[{outer}, {len}, {inner}]");
    c.guard("reduce", dn(dt), &shape, |c| {
        let d = c.d;
        // A positive mean keeps long sums away from zero, where cancellation
        // would make a relative error meaningless. In f16 the values shrink so
        // that a long sum (mean 0.25 per term) stays below f16's 65504: past
        // it the device's f16 sum is rightly inf, the f64 reference is not.
        let scale = if dt == F16 { (16384.0 / (0.25 * len as f64)).min(1.0) } else { 1.0 };
        let x = c.rng.vals(dt, outer * len * inner, -0.5 * scale, scale);
        let bx = d.up(dt, &x)?;
        let ws_len = reduce::reduce_workspace_len(outer, len, inner);
        let ws = d.junk(ws_len.max(1) * 4)?;
        for (op, name) in [
            (Reduction::Sum, "reduce.sum"),
            (Reduction::Max, "reduce.max"),
            (Reduction::Min, "reduce.min"),
        ] {
            let mut want = vec![0.0; outer * inner];
            tpar::kernels::reduce::reduce::<f64>(op, &x, outer, len, inner, &mut want)?;
            let bout = d.junk(want.len() * dt.size())?;
            // SAFETY: x, out and the workspace were allocated above with these sizes.
            unsafe {
                reduce::reduce(
                    d.l(),
                    op,
                    dt,
                    bx.ptr(),
                    bout.ptr(),
                    outer,
                    len,
                    inner,
                    ws.ptr(),
                    ws_len,
                )?
            };
            c.r.close(name, dn(dt), &shape, &d.down(dt, &bout)?, &want, bound(dt));
        }
        let (mut mx, mut idx) = (vec![0.0; outer * inner], vec![0i64; outer * inner]);
        tpar::kernels::reduce::max_with_index::<f64>(&x, outer, len, inner, &mut mx, &mut idx)?;
        let (bmx, bidx) = (d.junk(mx.len() * dt.size())?, d.junk(idx.len() * 8)?);
        // SAFETY: x, out and index were allocated above with these sizes.
        unsafe {
            reduce::max_with_index(d.l(), dt, bx.ptr(), bmx.ptr(), bidx.ptr(), outer, len, inner)?
        };
        c.r.close("reduce.argmax.value", dn(dt), &shape, &d.down(dt, &bmx)?, &mx, bound(dt));
        let got: Vec<u64> = d.down_raw::<i64>(&bidx)?.iter().map(|&i| i as u64).collect();
        let want: Vec<u64> = idx.iter().map(|&i| i as u64).collect();
        c.r.exact("reduce.argmax.index", "i64", &shape, &got, &want);
        Ok(())
    });
}

fn sum_squares_case(c: &mut Ctx, dt: CudaDType, rows: usize, len: usize) {
    let shape = format!("{rows}x{len}");
    c.guard("reduce.sum_squares", dn(dt), &shape, |c| {
        let d = c.d;
        let x = c.rng.vals(dt, rows * len, -1.0, 1.0);
        let mut sq = vec![0.0; x.len()];
        tpar::kernels::elementwise::unary::<f64, _>(UnaryOp::Square, &x, &mut sq)?;
        let mut want = vec![0.0; rows];
        tpar::kernels::reduce::reduce::<f64>(Reduction::Sum, &sq, rows, len, 1, &mut want)?;
        let ws_len = reduce::reduce_workspace_len(rows, len, 1);
        let (bx, bout, ws) = (d.up(dt, &x)?, d.junk(rows * 4)?, d.junk(ws_len.max(1) * 4)?);
        // SAFETY: x, out and the workspace were allocated above with these sizes.
        unsafe {
            reduce::sum_squares(d.l(), dt, bx.ptr(), rows, len, bout.ptr(), ws.ptr(), ws_len)?
        };
        c.r.close("reduce.sum_squares", dn(dt), &shape, &d.down(F32, &bout)?, &want, bound(F32));
        Ok(())
    });
}

// ------------------------------------------------------------------ elementwise

/// A broadcast pattern of a binary op: label, strides of a, strides of b, output shape.
type Broadcast = (&'static str, Vec<usize>, Vec<usize>, Vec<usize>);

fn check_elementwise(c: &mut Ctx) {
    let n = if c.quick { 1003 } else { (1 << 22) + 5 };
    for dt in DTYPES {
        unary_case(c, dt, n);
        scalar_case(c, dt, n);
    }
    let (r, k) = if c.quick { (37, 40) } else { (4096, 4096) };
    let cs = |shape: &[usize]| tpar::kernels::elementwise::contiguous_strides(shape);
    // (label, a strides, b strides, output shape)
    let patterns: Vec<Broadcast> = vec![
        ("same", vec![1], vec![1], vec![n]),
        ("row", cs(&[r, k]), vec![0, 1], vec![r, k]),
        ("col", cs(&[r, k]), vec![1, 0], vec![r, k]),
        ("3d", vec![24, 0, 1], vec![0, 1, 0], vec![4, 5, 24]),
    ];
    for dt in DTYPES {
        for (label, sa, sb, shape) in &patterns {
            binary_case(c, dt, label, sa, sb, shape);
        }
    }
    let (rows, cols) = if c.quick { (9, 40) } else { (2048, 14336) };
    for dt in DTYPES {
        swiglu_case(c, dt, rows, cols, true);
    }
    swiglu_case(c, BF16, rows, cols, false);
    for dt in DTYPES {
        fill_cast_case(c, dt, n);
    }
    for (src, dst) in [(BF16, F32), (F32, F32), (BF16, BF16), (F16, F32)] {
        accumulate_case(c, src, dst, n);
    }
    let shapes: &[(usize, usize)] =
        if c.quick { &[(37, 100), (5, 1500)] } else { &[(8192, 1000), (1024, 32000)] };
    for dt in DTYPES {
        for &(rows, cols) in shapes {
            softmax_case(c, dt, rows, cols);
        }
    }
}

/// Inputs in the domain of `op`.
fn unary_input(c: &mut Ctx, dt: CudaDType, op: UnaryOp, n: usize) -> Vec<f64> {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => {
            c.rng.vals(dt, n, 0.25, 3.0)
        }
        _ => c.rng.vals(dt, n, -4.0, 4.0),
    }
}

fn unary_case(c: &mut Ctx, dt: CudaDType, n: usize) {
    let shape = format!("n{n}");
    c.guard("unary", dn(dt), &shape, |c| {
        use tpar::kernels::elementwise as cpu;
        let d = c.d;
        let mut parts = Vec::new();
        for op in UnaryOp::ALL {
            let x = unary_input(c, dt, op, n);
            let dy = c.rng.vals(dt, n, -1.0, 1.0);
            let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
            cpu::unary::<f64, _>(op, &x, &mut y)?;
            cpu::unary_backward::<f64, _>(op, &x, &y, &dy, &mut dx)?;
            let (bx, bdy, by) = (d.up(dt, &x)?, d.up(dt, &dy)?, d.junk(n * dt.size())?);
            let bdx = d.junk(n * dt.size())?;
            // SAFETY: four buffers of `n` elements allocated above.
            unsafe {
                ew::unary(d.l(), dt, op, bx.ptr(), by.ptr(), n)?;
                ew::unary_backward(d.l(), dt, op, bx.ptr(), by.ptr(), bdy.ptr(), bdx.ptr(), n)?;
            }
            let name = format!("{op:?}").to_lowercase();
            parts.push((name.clone(), d.down(dt, &by)?, y));
            parts.push((format!("{name}.bwd"), d.down(dt, &bdx)?, dx));
        }
        c.r.close_parts("unary(12 ops, fwd+bwd)", dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}

fn scalar_case(c: &mut Ctx, dt: CudaDType, n: usize) {
    let shape = format!("n{n} s=1.5");
    c.guard("scalar", dn(dt), &shape, |c| {
        let d = c.d;
        let x = c.rng.vals(dt, n, 0.25, 3.0);
        let bx = d.up(dt, &x)?;
        let mut parts = Vec::new();
        for (i, op) in BinaryOp::ALL.into_iter().enumerate() {
            let first = i % 2 == 1;
            let mut y = vec![0.0; n];
            tpar::kernels::elementwise::scalar::<f64, _>(op, &x, 1.5, first, &mut y)?;
            let by = d.junk(n * dt.size())?;
            // SAFETY: two buffers of `n` elements allocated above.
            unsafe { ew::scalar(d.l(), dt, op, bx.ptr(), 1.5, first, by.ptr(), n)? };
            let label = format!("{}{op:?}", if first { "s " } else { "" }).to_lowercase();
            parts.push((label, d.down(dt, &by)?, y));
        }
        c.r.close_parts("scalar(7 ops)", dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}

/// Elements an operand read at `strides` over `shape` must hold.
fn reach(strides: &[usize], shape: &[usize]) -> usize {
    1 + strides.iter().zip(shape).map(|(s, n)| s * (n - 1)).sum::<usize>()
}

fn binary_case(
    c: &mut Ctx,
    dt: CudaDType,
    label: &str,
    sa: &[usize],
    sb: &[usize],
    shape: &[usize],
) {
    let name = format!("binary.{label}(7 ops)");
    let sh = format!("{shape:?}");
    c.guard(&name, dn(dt), &sh, |c| {
        let d = c.d;
        let a = c.rng.vals(dt, reach(sa, shape), 0.25, 3.0);
        let b = c.rng.vals(dt, reach(sb, shape), 0.5, 2.0);
        let (ba, bb) = (d.up(dt, &a)?, d.up(dt, &b)?);
        let n: usize = shape.iter().product();
        let mut parts = Vec::new();
        for op in BinaryOp::ALL {
            let mut want = vec![0.0; n];
            tpar::kernels::elementwise::binary::<f64, _>(op, &a, sa, &b, sb, shape, &mut want)?;
            let bo = d.junk(n * dt.size())?;
            // SAFETY: the operands cover every element their strides reach, out `n`.
            unsafe { ew::binary(d.l(), dt, op, ba.ptr(), sa, bb.ptr(), sb, shape, bo.ptr())? };
            parts.push((format!("{op:?}").to_lowercase(), d.down(dt, &bo)?, want));
        }
        c.r.close_parts(&name, dn(dt), &sh, &parts, bound(dt));
        Ok(())
    });
}

fn swiglu_case(c: &mut Ctx, dt: CudaDType, rows: usize, cols: usize, fused: bool) {
    let name = if fused { "swiglu(fused gate|up)" } else { "swiglu" };
    let shape = format!("{rows}x{cols}");
    c.guard(name, dn(dt), &shape, |c| {
        use tpar::kernels::elementwise as cpu;
        let d = c.d;
        let n = rows * cols;
        let es = dt.size();
        let gate = c.rng.vals(dt, n, -4.0, 4.0);
        let up = c.rng.vals(dt, n, -2.0, 2.0);
        let dy = c.rng.vals(dt, n, -1.0, 1.0);
        // reference from the CPU kernels: y = silu(a) * b; db = dy * silu(a);
        // da = silu'(a) * (dy * b)
        let (mut s, mut y, mut db, mut dyb, mut da) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let st = [1usize];
        cpu::unary::<f64, _>(UnaryOp::Silu, &gate, &mut s)?;
        cpu::binary::<f64, _>(BinaryOp::Mul, &s, &st, &up, &st, &[n], &mut y)?;
        cpu::binary::<f64, _>(BinaryOp::Mul, &dy, &st, &s, &st, &[n], &mut db)?;
        cpu::binary::<f64, _>(BinaryOp::Mul, &dy, &st, &up, &st, &[n], &mut dyb)?;
        cpu::unary_backward::<f64, _>(UnaryOp::Silu, &gate, &s, &dyb, &mut da)?;
        // device layout: [rows, 2 * cols] (gate | up) when fused, else two tensors
        let (ld, ga, ub, gbuf, ubuf) = if fused {
            let mut both = Vec::with_capacity(2 * n);
            for r in 0..rows {
                both.extend_from_slice(&gate[r * cols..(r + 1) * cols]);
                both.extend_from_slice(&up[r * cols..(r + 1) * cols]);
            }
            let b = d.up(dt, &both)?;
            (2 * cols, b.ptr(), b.ptr() + (cols * es) as DevPtr, b, None)
        } else {
            let (g, u) = (d.up(dt, &gate)?, d.up(dt, &up)?);
            (cols, g.ptr(), u.ptr(), g, Some(u))
        };
        let (bdy, by) = (d.up(dt, &dy)?, d.junk(n * es)?);
        let grads = d.junk(rows * ld * es)?;
        let grads2 = if fused { None } else { Some(d.junk(n * es)?) };
        let (pda, pdb) = match &grads2 {
            None => (grads.ptr(), grads.ptr() + (cols * es) as DevPtr),
            Some(g2) => (grads.ptr(), g2.ptr()),
        };
        // SAFETY: gate and up (and their gradients) hold `rows` rows at pitch
        // `ld`; y and dy `rows * cols` elements; all allocated above.
        unsafe {
            ew::swiglu_forward(d.l(), dt, ga, ub, ld, by.ptr(), rows, cols)?;
            ew::swiglu_backward(d.l(), dt, ga, ub, ld, bdy.ptr(), pda, pdb, rows, cols)?;
        }
        let g = d.down(dt, &grads)?;
        let (got_da, got_db): (Vec<f64>, Vec<f64>) = match &grads2 {
            None => (columns(&g, 2 * cols, 0, cols), columns(&g, 2 * cols, cols, cols)),
            Some(g2) => (g, d.down(dt, g2)?),
        };
        drop((gbuf, ubuf));
        let parts = vec![
            ("y".to_string(), d.down(dt, &by)?, y),
            ("da".to_string(), got_da, da),
            ("db".to_string(), got_db, db),
        ];
        c.r.close_parts(name, dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}

/// `x` converted to `to` by the CPU cast kernel.
fn cpu_cast(to: CudaDType, x: &[f64]) -> Res<Vec<f64>> {
    use tpar::kernels::elementwise::cast;
    Ok(match to {
        F32 => {
            let mut y = vec![0f32; x.len()];
            cast::<f64, f32>(x, &mut y)?;
            y.into_iter().map(f64::from).collect()
        }
        BF16 => {
            let mut y = vec![bf16::ZERO; x.len()];
            cast::<f64, bf16>(x, &mut y)?;
            y.into_iter().map(bf16::to_f64).collect()
        }
        F16 => {
            let mut y = vec![f16::ZERO; x.len()];
            cast::<f64, f16>(x, &mut y)?;
            y.into_iter().map(f16::to_f64).collect()
        }
    })
}

fn fill_cast_case(c: &mut Ctx, dt: CudaDType, n: usize) {
    let shape = format!("n{n}");
    c.guard("fill+cast", dn(dt), &shape, |c| {
        let d = c.d;
        let by = d.junk(n * dt.size())?;
        // SAFETY: `n` elements allocated above.
        unsafe { ew::fill(d.l(), dt, by.ptr(), n, 0.3)? };
        c.r.close("fill", dn(dt), &shape, &d.down(dt, &by)?, &vec![round_to(dt, 0.3); n], 0.0);
        let x = c.rng.vals(dt, n, -70000.0, 70000.0);
        let bx = d.up(dt, &x)?;
        let mut parts = Vec::new();
        for to in DTYPES {
            let bo = d.junk(n * to.size())?;
            // SAFETY: `n` elements of each type allocated above.
            unsafe { ew::cast(d.l(), dt, bx.ptr(), to, bo.ptr(), n)? };
            parts.push((format!(">{}", dn(to)), d.down(to, &bo)?, cpu_cast(to, &x)?));
        }
        let ids: Vec<i64> = (0..n).map(|_| c.rng.below(2001) as i64 - 1000).collect();
        let bi = d.up_raw(&ids)?;
        let bo = d.junk(n * dt.size())?;
        // SAFETY: `n` i64 and `n` elements of `dt` allocated above.
        unsafe { ew::cast_i64(d.l(), bi.ptr(), dt, bo.ptr(), n)? };
        let idf: Vec<f64> = ids.iter().map(|&i| i as f64).collect();
        parts.push(("i64>".to_string(), d.down(dt, &bo)?, cpu_cast(dt, &idf)?));
        // Casts round to nearest: exact.
        c.r.close_parts(&format!("cast({}>*)", dn(dt)), dn(dt), &shape, &parts, 0.0);
        Ok(())
    });
}

fn accumulate_case(c: &mut Ctx, src: CudaDType, dst: CudaDType, n: usize) {
    let dtype = format!("{}>{}", dn(src), dn(dst));
    let shape = format!("n{n} alpha 0.5");
    c.guard("accumulate", &dtype, &shape, |c| {
        let d = c.d;
        let s = c.rng.vals(src, n, -1.0, 1.0);
        let t = c.rng.vals(dst, n, -1.0, 1.0);
        let (mut half_s, mut want) = (vec![0.0; n], vec![0.0; n]);
        tpar::kernels::elementwise::scalar::<f64, _>(BinaryOp::Mul, &s, 0.5, false, &mut half_s)?;
        tpar::kernels::elementwise::binary::<f64, _>(
            BinaryOp::Add,
            &t,
            &[1],
            &half_s,
            &[1],
            &[n],
            &mut want,
        )?;
        let (bs, bt) = (d.up(src, &s)?, d.up(dst, &t)?);
        // SAFETY: `n` elements of each type allocated above.
        unsafe { ew::accumulate(d.l(), src, bs.ptr(), dst, bt.ptr(), n, 0.5)? };
        c.r.close("accumulate", &dtype, &shape, &d.down(dst, &bt)?, &want, bound(dst));
        Ok(())
    });
}

fn softmax_case(c: &mut Ctx, dt: CudaDType, rows: usize, cols: usize) {
    let shape = format!("{rows}x{cols}");
    c.guard("softmax", dn(dt), &shape, |c| {
        use tpar::kernels::softmax as cpu;
        let d = c.d;
        let n = rows * cols;
        let x = c.rng.vals(dt, n, -5.0, 5.0);
        let dy = c.rng.vals(dt, n, -1.0, 1.0);
        let (bx, bdy) = (d.up(dt, &x)?, d.up(dt, &dy)?);
        for log in [false, true] {
            let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
            if log {
                cpu::log_softmax_forward::<f64>(&x, rows, cols, &mut y)?;
                cpu::log_softmax_backward::<f64>(&y, &dy, rows, cols, &mut dx)?;
            } else {
                cpu::softmax_forward::<f64>(&x, rows, cols, &mut y)?;
                cpu::softmax_backward::<f64>(&y, &dy, rows, cols, &mut dx)?;
            }
            let (by, bdx) = (d.junk(n * dt.size())?, d.junk(n * dt.size())?);
            let by_ref = d.up(dt, &y)?;
            // SAFETY: every buffer holds `rows * cols` elements.
            unsafe {
                ew::softmax_forward(d.l(), dt, bx.ptr(), by.ptr(), rows, cols, log)?;
                ew::softmax_backward(
                    d.l(),
                    dt,
                    by_ref.ptr(),
                    bdy.ptr(),
                    bdx.ptr(),
                    rows,
                    cols,
                    log,
                )?;
            }
            let name = if log { "log_softmax" } else { "softmax" };
            let parts = vec![
                ("fwd".to_string(), d.down(dt, &by)?, y),
                ("bwd".to_string(), d.down(dt, &bdx)?, dx),
            ];
            c.r.close_parts(name, dn(dt), &shape, &parts, bound(dt));
        }
        Ok(())
    });
}

// ------------------------------------------------------------------ layout

fn check_layout(c: &mut Ctx) {
    let big = !c.quick;
    let n = if big { (1 << 24) + 3 } else { 1003 };
    for w in [2, 4, 8] {
        copy_case(c, w, n);
    }
    for w in [2, 4] {
        let (rows, cols, sld, dld) = if big { (4096, 4000, 4104, 4096) } else { (7, 13, 20, 16) };
        copy2d_case(c, w, rows, cols, sld, dld);
        let (outer, size, inner, start, len) =
            if big { (64, 1000, 128, 100, 500) } else { (3, 10, 6, 2, 5) };
        let strides = [size * inner, inner, 1];
        gather_case(
            c,
            "narrow",
            w,
            outer * size * inner,
            start * inner,
            &strides,
            &[outer, len, inner],
        );
        let (b, r, k) = if big { (8, 1000, 1030) } else { (2, 33, 45) };
        gather_case(c, "transpose", w, b * r * k, 0, &[r * k, 1, k], &[b, k, r]);
        let shape = if big { [4usize, 2048, 32, 128] } else { [2, 5, 3, 8] };
        permute_case(c, w, &shape, &[0, 2, 1, 3]);
        let (src, out) = if big {
            (vec![32, 1, 128], vec![4, 32, 512, 128])
        } else {
            (vec![3, 1, 5], vec![2, 3, 4, 5])
        };
        expand_case(c, w, &src, &out);
        gather_case(c, "strided_copy", w, 200, 3, &[40, 1, 7], &[4, 5, 3]);
        cat_case(c, w, if big { (64, 300, 700, 128) } else { (3, 4, 7, 5) });
    }
}

/// The CPU reference of every gather: `out[i] = src[base + sum(idx * strides)]`.
fn cpu_gather(src: &[u64], base: usize, strides: &[usize], shape: &[usize]) -> Res<Vec<u64>> {
    let mut out = vec![0u64; shape.iter().product()];
    tpar::kernels::elementwise::strided_copy::<u64, _>(src, base, strides, shape, &mut out)?;
    Ok(out)
}

fn copy_case(c: &mut Ctx, w: usize, n: usize) {
    let dtype = format!("{}-byte", w);
    let shape = format!("n{n}");
    c.guard("copy", &dtype, &shape, |c| {
        let d = c.d;
        let x = c.rng.words(n, w);
        let (bx, by) = (d.bytes(&encode_words(w, &x))?, d.junk(n * w)?);
        // SAFETY: `n` elements of `w` bytes allocated above.
        unsafe { layout::copy(d.l(), w, bx.ptr(), by.ptr(), n)? };
        c.r.exact("layout.copy", &dtype, &shape, &decode_words(w, &by.to_host()?), &x);
        Ok(())
    });
}

fn copy2d_case(c: &mut Ctx, w: usize, rows: usize, cols: usize, sld: usize, dld: usize) {
    let dtype = format!("{}-byte", w);
    let shape = format!("{rows}x{cols} ld {sld}>{dld}");
    c.guard("copy2d", &dtype, &shape, |c| {
        let d = c.d;
        let src = c.rng.words(rows * sld, w);
        let dst0 = c.rng.words(rows * dld, w);
        let rows_out = cpu_gather(&src, 0, &[sld, 1], &[rows, cols])?;
        let mut want = dst0.clone();
        for r in 0..rows {
            want[r * dld..r * dld + cols].copy_from_slice(&rows_out[r * cols..(r + 1) * cols]);
        }
        let (bs, bd) = (d.bytes(&encode_words(w, &src))?, d.bytes(&encode_words(w, &dst0))?);
        // SAFETY: both buffers hold `rows` rows at their pitches.
        unsafe { layout::copy2d(d.l(), w, rows, cols, bs.ptr(), sld, bd.ptr(), dld)? };
        c.r.exact("layout.copy2d", &dtype, &shape, &decode_words(w, &bd.to_host()?), &want);
        Ok(())
    });
}

/// `narrow`, `transpose` and general strided copies through `strided_copy`
/// (which dispatches to the pitched copy, the tiled transpose or the gather).
fn gather_case(
    c: &mut Ctx,
    what: &str,
    w: usize,
    src_len: usize,
    base: usize,
    strides: &[usize],
    shape: &[usize],
) {
    let dtype = format!("{}-byte", w);
    let sh = format!("{shape:?} st {strides:?}+{base}");
    let name = format!("layout.{what}");
    c.guard(&name, &dtype, &sh, |c| {
        let d = c.d;
        let src = c.rng.words(src_len, w);
        let want = cpu_gather(&src, base, strides, shape)?;
        let (bs, bo) = (d.bytes(&encode_words(w, &src))?, d.junk(want.len() * w)?);
        // SAFETY: the source covers every element the strides reach from `base`.
        unsafe { layout::strided_copy(d.l(), w, bs.ptr(), base, strides, shape, bo.ptr())? };
        c.r.exact(&name, &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

fn permute_case(c: &mut Ctx, w: usize, shape: &[usize], perm: &[usize]) {
    let dtype = format!("{}-byte", w);
    let sh = format!("{shape:?} perm {perm:?}");
    c.guard("layout.permute", &dtype, &sh, |c| {
        let d = c.d;
        let n: usize = shape.iter().product();
        let src = c.rng.words(n, w);
        let st = tpar::kernels::elementwise::contiguous_strides(shape);
        let strides: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
        let out: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        let want = cpu_gather(&src, 0, &strides, &out)?;
        let (bs, bo) = (d.bytes(&encode_words(w, &src))?, d.junk(n * w)?);
        // SAFETY: both buffers hold the tensor's `n` elements.
        unsafe { layout::permute(d.l(), w, bs.ptr(), shape, perm, bo.ptr())? };
        c.r.exact("layout.permute", &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

fn expand_case(c: &mut Ctx, w: usize, src_shape: &[usize], out: &[usize]) {
    let dtype = format!("{}-byte", w);
    let sh = format!("{src_shape:?}>{out:?}");
    c.guard("layout.expand", &dtype, &sh, |c| {
        let d = c.d;
        let src = c.rng.words(src_shape.iter().product(), w);
        let strides = layout::broadcast_strides("expand", src_shape, out)?;
        let want = cpu_gather(&src, 0, &strides, out)?;
        let (bs, bo) = (d.bytes(&encode_words(w, &src))?, d.junk(want.len() * w)?);
        // SAFETY: the source holds `src_shape`'s elements, the output `out`'s.
        unsafe { layout::expand(d.l(), w, bs.ptr(), src_shape, out, bo.ptr())? };
        c.r.exact("layout.expand", &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

fn cat_case(c: &mut Ctx, w: usize, (outer, len0, len1, inner): (usize, usize, usize, usize)) {
    let dtype = format!("{}-byte", w);
    let sh = format!("[{outer}, {len0}+{len1}, {inner}]");
    c.guard("layout.cat", &dtype, &sh, |c| {
        let d = c.d;
        let a = c.rng.words(outer * len0 * inner, w);
        let b = c.rng.words(outer * len1 * inner, w);
        let total = len0 + len1;
        let mut want = Vec::with_capacity(outer * total * inner);
        for o in 0..outer {
            want.extend_from_slice(&a[o * len0 * inner..(o + 1) * len0 * inner]);
            want.extend_from_slice(&b[o * len1 * inner..(o + 1) * len1 * inner]);
        }
        let (ba, bb) = (d.bytes(&encode_words(w, &a))?, d.bytes(&encode_words(w, &b))?);
        let bo = d.junk(want.len() * w)?;
        // SAFETY: each piece holds `outer * len * inner` elements, the output the sum.
        unsafe {
            layout::cat(d.l(), w, &[(ba.ptr(), len0), (bb.ptr(), len1)], outer, inner, bo.ptr())?
        };
        c.r.exact("layout.cat", &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

// ------------------------------------------------------------------ benchmarks

/// One measured quantity: ours, and cuBLASLt's where it applies.
struct Bench {
    key: String,
    unit: &'static str,
    ours: Option<f64>,
    cublaslt: Option<f64>,
    note: String,
}

/// Seconds per call of `f`: the median of three trials of back-to-back calls
/// (enough for about 0.2 s each) after a warm-up, between synchronizations.
fn time_per_call(d: &Dev, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    f()?;
    d.sync()?;
    let t = Instant::now();
    f()?;
    d.sync()?;
    let one = t.elapsed().as_secs_f64().max(1e-6);
    let reps = ((0.2 / one).ceil() as usize).clamp(3, 2000);
    let mut trials = Vec::with_capacity(3);
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        d.sync()?;
        trials.push(t.elapsed().as_secs_f64() / reps as f64);
    }
    trials.sort_by(f64::total_cmp);
    Ok(trials[1])
}

/// `value / t`, scaled (1e12 for TFLOP/s, 1e9 for GB/s).
fn rate(amount: f64, seconds: f64, scale: f64) -> f64 {
    amount / seconds / scale
}

/// Prints a measurement as it comes and keeps it.
fn push(out: &mut Vec<Bench>, b: Bench) {
    println!(
        "  {:<34} ours {:>9} cuBLASLt {:>9} {}{}",
        b.key,
        b.ours.map_or("-".into(), |v| format!("{v:.1}")),
        b.cublaslt.map_or("-".into(), |v| format!("{v:.1}")),
        b.unit,
        if b.note.is_empty() { String::new() } else { format!("  ({})", b.note) }
    );
    out.push(b);
}

/// The benchmarks: GEMM (`gemm` in `only`), attention (`sdpa`) and the
/// memory-bound kernels (any other family); all of them when `only` is empty.
fn run_benches(
    d: &Dev,
    lt: Option<&CublasLt>,
    quick: bool,
    rng: &mut Rng,
    only: &[String],
) -> Vec<Bench> {
    let want = |f: &str| only.is_empty() || only.iter().any(|o| o == f);
    let memory = only.is_empty() || only.iter().any(|o| o != "gemm" && o != "sdpa");
    let mut out = Vec::new();
    // One random bf16 source that every read-only operand points into.
    let src_elems = 8192 * 14336;
    let src = match d.up(BF16, &rng.vals(BF16, src_elems, -1.0, 1.0)) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpu_check: bench source buffer: {e}");
            return out;
        }
    };
    let s = src.ptr();

    // GEMM.
    let shapes: Vec<(&str, usize, usize, usize)> = if !want("gemm") {
        Vec::new()
    } else if quick {
        vec![("square", 4096, 4096, 4096)]
    } else {
        vec![
            ("square", 4096, 4096, 4096),
            ("square", 8192, 8192, 8192),
            ("llama8b q/o proj", 8192, 4096, 4096),
            ("llama8b k/v proj", 8192, 1024, 4096),
            ("llama8b gate/up proj", 8192, 14336, 4096),
            ("llama8b down proj", 8192, 4096, 14336),
        ]
    };
    for (label, m, n, k) in shapes {
        for tb in [false, true] {
            let shape = GemmShape { trans_b: tb, ..GemmShape::new(1, m, n, k) };
            let p = GemmProblem::new(shape, BF16, BF16);
            let key = format!("gemm.bf16.{}.{m}x{n}x{k}", layout_name(false, tb));
            let flops = 2.0 * (m * n * k) as f64;
            let mut b =
                Bench { key, unit: "TFLOP/s", ours: None, cublaslt: None, note: label.into() };
            match d.alloc(m * n * 2) {
                Ok(cbuf) => {
                    let c = cbuf.ptr();
                    // SAFETY: A and B lie inside the source buffer, C was allocated for m x n.
                    let ours = time_per_call(d, || {
                        unsafe { gemm::gemm(d.l(), &p, s, s, c)? };
                        Ok(())
                    });
                    match ours {
                        Ok(t) => b.ours = Some(rate(flops, t, 1e12)),
                        Err(e) => b.note = format!("{label}; ours: {e}"),
                    }
                    if let Some(lt) = lt {
                        // SAFETY: as above, on the GPU cuBLASLt was created on.
                        let theirs = time_per_call(d, || {
                            unsafe { lt.matmul(&p, s, s, c)? };
                            Ok(())
                        });
                        match theirs {
                            Ok(t) => b.cublaslt = Some(rate(flops, t, 1e12)),
                            Err(e) => b.note = format!("{}; cuBLASLt: {e}", b.note),
                        }
                    }
                }
                Err(e) => b.note = format!("{label}; {e}"),
            }
            push(&mut out, b);
        }
    }

    // Attention: causal GQA, 32 q / 8 kv heads of 128, batch x seq = 16k tokens; then
    // the shape of `scripts/gpu-check.sh`'s training step (16 q / 8 kv heads of 64,
    // batch 8 x seq 1024) with each tensor-core forward (64 or 128 query rows a block).
    let mut cases: Vec<(String, usize, usize, usize, usize, usize, SdpaPath)> = Vec::new();
    let seqs: &[usize] = match (want("sdpa"), quick) {
        (false, _) => &[],
        (true, true) => &[1024, 2048],
        (true, false) => &[1024, 2048, 4096, 8192],
    };
    for &seq in seqs {
        cases.push((format!("s{seq}"), 16384 / seq, 32, 8, seq, 128, SdpaPath::Auto));
    }
    for &seq in seqs.iter().take(2) {
        for (sfx, path) in [(".m64", SdpaPath::TensorCore), (".m128", SdpaPath::TensorCoreWide)] {
            cases.push((format!("s{seq}{sfx}"), 16384 / seq, 32, 8, seq, 128, path));
        }
    }
    if want("sdpa") {
        for (sfx, path) in [
            ("", SdpaPath::Auto),
            (".m64", SdpaPath::TensorCore),
            (".m128", SdpaPath::TensorCoreWide),
        ] {
            cases.push((format!("d64.s1024{sfx}"), 8, 16, 8, 1024, 64, path));
        }
    }
    for (label, batch, hq, hkv, seq, hd, path) in cases {
        let sh = sdpa_shape(batch, hq, hkv, seq, seq, hd, true);
        // 4 * b * h * s^2 * d for q k^T and p v, half of it under the causal mask;
        // the backward pass counts 2.5 times the forward.
        let fwd_flops = 4.0 * (batch * hq * seq * seq * hd) as f64 * 0.5;
        let note = format!("b{batch} h{hq}/{hkv} d{hd} causal, {path:?}");
        let res = (|| -> Res<(f64, f64)> {
            let nq = batch * hq * seq * hd;
            let nk = batch * hkv * seq * hd;
            let (o, lse) = (d.alloc(nq * 2)?, d.alloc(batch * hq * seq * 4)?);
            let (dq, dk, dv) = (d.alloc(nq * 2)?, d.alloc(nk * 2)?, d.alloc(nk * 2)?);
            let ws_bytes = sdpa::sdpa_backward_workspace_bytes(&sh)?;
            let ws = d.alloc(ws_bytes)?;
            let fb = SdpaFwdBuffers { q: s, k: s, v: s, mask: None, out: o.ptr(), lse: lse.ptr() };
            let bb = SdpaBwdBuffers {
                q: s,
                k: s,
                v: s,
                mask: None,
                out: o.ptr(),
                lse: lse.ptr(),
                dout: s,
                dq: dq.ptr(),
                dk: dk.ptr(),
                dv: dv.ptr(),
                workspace: ws.ptr(),
                workspace_bytes: ws_bytes,
            };
            let l = d.l();
            let t_fwd = time_per_call(d, || {
                // SAFETY: q, k, v and dout lie inside the source buffer; the
                // outputs and the workspace were allocated for `sh`.
                unsafe { sdpa::sdpa_forward(l, BF16, &sh, &fb, path)? };
                Ok(())
            })?;
            let t_all = time_per_call(d, || {
                // SAFETY: as above.
                unsafe {
                    sdpa::sdpa_forward(l, BF16, &sh, &fb, path)?;
                    sdpa::sdpa_backward(l, BF16, &sh, &bb, SdpaPath::Auto)?;
                }
                Ok(())
            })?;
            Ok((t_fwd, t_all))
        })();
        let (fwd, all) = match res {
            Ok((f, a)) => (Some(rate(fwd_flops, f, 1e12)), Some(rate(3.5 * fwd_flops, a, 1e12))),
            Err(e) => {
                eprintln!("gpu_check: sdpa {label}: {e}");
                (None, None)
            }
        };
        let mk = |key: String, v| Bench {
            key,
            unit: "TFLOP/s",
            ours: v,
            cublaslt: None,
            note: note.clone(),
        };
        push(&mut out, mk(format!("sdpa.fwd.{label}"), fwd));
        push(&mut out, mk(format!("sdpa.fwdbwd.{label}"), all));
    }

    // Memory-bound kernels, against a device-to-device copy.
    let bandwidth = if memory { bandwidth_benches(d, s, rng) } else { Vec::new() };
    for b in bandwidth {
        push(&mut out, b);
    }
    out
}

fn bandwidth_benches(d: &Dev, s: DevPtr, rng: &mut Rng) -> Vec<Bench> {
    let mut out = Vec::new();
    let gbs = |key: &str, bytes: f64, t: Res<f64>, note: &str| {
        let (ours, note) = match t {
            Ok(t) => (Some(rate(bytes, t, 1e9)), note.to_string()),
            Err(e) => (None, format!("{note}; {e}")),
        };
        Bench { key: key.into(), unit: "GB/s", ours, cublaslt: None, note }
    };
    let l = d.l();

    // Copy: 1 GiB device to device (bytes read + written).
    let n = 1usize << 30;
    let t = (|| -> Res<(f64, f64)> {
        let (a, b) = (d.alloc(n)?, d.alloc(n)?);
        let (pa, pb) = (a.ptr(), b.ptr());
        // SAFETY: two distinct allocations of `n` bytes.
        let t_dtod = time_per_call(d, || {
            unsafe { d.mem.dtod(pa, pb, n)? };
            Ok(())
        })?;
        // SAFETY: as above, `n / 2` two-byte elements.
        let t_kernel = time_per_call(d, || {
            unsafe { layout::copy(l, 2, pa, pb, n / 2)? };
            Ok(())
        })?;
        Ok((t_dtod, t_kernel))
    })();
    let (t_dtod, t_kernel) = match t {
        Ok((a, b)) => (Ok(a), Ok(b)),
        Err(e) => (Err(e.to_string().into()), Err(e)),
    };
    out.push(gbs("copy.dtod", 2.0 * n as f64, t_dtod, "1 GiB cuMemcpyDtoD"));
    out.push(gbs("copy.kernel", 2.0 * n as f64, t_kernel, "1 GiB layout::copy"));

    // RMSNorm, 16k tokens x 4096, bf16.
    let (rows, dim) = (16384usize, 4096usize);
    let nx = (rows * dim) as f64;
    let t = (|| -> Res<(f64, f64)> {
        let (y, rstd) = (d.alloc(rows * dim * 2)?, d.alloc(rows * 4)?);
        let (dx, dw) = (d.alloc(rows * dim * 2)?, d.alloc(dim * 4)?);
        let ws = d.alloc(rmsnorm::backward_workspace_bytes(rows, dim))?;
        let tf = time_per_call(d, || {
            // SAFETY: x and w lie inside the source; y and rstd were allocated here.
            unsafe {
                rmsnorm::rmsnorm_forward(l, BF16, s, s, y.ptr(), rstd.ptr(), rows, dim, 1e-5)?
            };
            Ok(())
        })?;
        let tb = time_per_call(d, || {
            // SAFETY: x, w and dy lie inside the source; the rest was allocated here.
            unsafe {
                rmsnorm::rmsnorm_backward(
                    l,
                    BF16,
                    s,
                    s,
                    rstd.ptr(),
                    s,
                    dx.ptr(),
                    dw.ptr(),
                    ws.ptr(),
                    rows,
                    dim,
                )?
            };
            Ok(())
        })?;
        Ok((tf, tb))
    })();
    let note = "16384x4096 bf16";
    match t {
        Ok((tf, tb)) => {
            out.push(gbs("rmsnorm.fwd", 2.0 * nx * 2.0, Ok(tf), note));
            out.push(gbs("rmsnorm.bwd", 3.0 * nx * 2.0, Ok(tb), note));
            out.push(gbs("rmsnorm.fwdbwd", 5.0 * nx * 2.0, Ok(tf + tb), note));
        }
        Err(e) => out.push(gbs("rmsnorm.fwd", 0.0, Err(e), note)),
    }

    // RoPE on queries [4, 32, 4096, 128] bf16.
    let rs = RopeShape { outer: 4 * 32, seq: 4096, inner: 1, head_dim: 128 };
    let nr = (rs.outer * rs.seq * rs.head_dim) as f64;
    let t = (|| -> Res<f64> {
        let y = d.alloc(nr as usize * 2)?;
        // SAFETY: x, cos and sin lie inside the source; y was allocated for x's shape.
        time_per_call(d, || {
            unsafe { rope::rope_forward(l, BF16, &rs, s, s, s, y.ptr())? };
            Ok(())
        })
    })();
    out.push(gbs("rope.fwd", 2.0 * nr * 2.0, t, "[4, 32, 4096, 128] bf16"));

    // Cross-entropy, 8192 tokens x 128256 classes (Llama 3 vocab), bf16.
    let (rows, vocab) = (8192usize, 128256usize);
    let nl = rows * vocab;
    let note = "8192x128256 bf16";
    let t = (|| -> Res<(f64, f64)> {
        let logits = d.alloc(nl * 2)?;
        let chunk = 8192 * 14336;
        let mut at = 0;
        while at < nl {
            let len = chunk.min(nl - at);
            // SAFETY: `len` elements inside both the source and the logits.
            unsafe { d.mem.dtod(s, logits.ptr() + (at * 2) as DevPtr, len * 2)? };
            at += len;
        }
        let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab) as i64).collect();
        let bt = d.up_raw(&targets)?;
        let (loss, lse, count) = (d.alloc(rows * 4)?, d.alloc(rows * 4)?, d.zeros(4)?);
        let (scale, dl) = (d.up(F32, &[1.0 / rows as f64])?, d.alloc(nl * 2)?);
        let tf = time_per_call(d, || {
            // SAFETY: every buffer was allocated above with the size the op needs.
            unsafe {
                ce::cross_entropy_forward(
                    l,
                    BF16,
                    logits.ptr(),
                    rows,
                    vocab,
                    bt.ptr(),
                    IGNORE,
                    loss.ptr(),
                    lse.ptr(),
                    count.ptr(),
                    0,
                )?
            };
            Ok(())
        })?;
        let tb = time_per_call(d, || {
            // SAFETY: as above.
            unsafe {
                ce::cross_entropy_backward(
                    l,
                    BF16,
                    logits.ptr(),
                    rows,
                    vocab,
                    bt.ptr(),
                    0,
                    IGNORE,
                    lse.ptr(),
                    scale.ptr(),
                    1,
                    dl.ptr(),
                )?
            };
            Ok(())
        })?;
        Ok((tf, tb))
    })();
    let nl = nl as f64;
    match t {
        Ok((tf, tb)) => {
            out.push(gbs("cross_entropy.fwd", nl * 2.0, Ok(tf), note));
            out.push(gbs("cross_entropy.bwd", 2.0 * nl * 2.0, Ok(tb), note));
            out.push(gbs("cross_entropy.fwdbwd", 3.0 * nl * 2.0, Ok(tf + tb), note));
        }
        Err(e) => out.push(gbs("cross_entropy.fwd", 0.0, Err(e), note)),
    }
    out
}

fn print_bench_table(rows: &[Bench]) {
    let copy = rows.iter().find(|b| b.key == "copy.dtod").and_then(|b| b.ours);
    println!(
        "\n{:<34} {:>10} {:>10} {:<8} {:>14}  note",
        "benchmark", "ours", "cuBLASLt", "unit", "ratio"
    );
    for b in rows {
        let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        let ratio = match (b.unit, b.ours, b.cublaslt, copy) {
            (_, Some(o), Some(c), _) => format!("{:.2} of cuBLASLt", o / c),
            ("GB/s", Some(o), None, Some(c)) if b.key != "copy.dtod" => {
                format!("{:.0}% of copy", 100.0 * o / c)
            }
            _ => String::new(),
        };
        println!(
            "{:<34} {:>10} {:>10} {:<8} {:>14}  {}",
            b.key,
            f(b.ours),
            f(b.cublaslt),
            b.unit,
            ratio,
            b.note
        );
    }
}

// ------------------------------------------------------------------ json

fn jstr(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for ch in s.chars() {
        match ch {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn jnum(v: f64) -> String {
    if v.is_finite() {
        format!("{v:e}")
    } else {
        "null".into()
    }
}

fn write_json(
    path: &PathBuf,
    device: &str,
    o: &Opts,
    checks: &[Check],
    benches: &[Bench],
) -> Res<()> {
    let mut s = String::new();
    let _ = writeln!(s, "{{\n  \"tool\": \"gpu_check\",\n  \"device\": {},", jstr(device));
    let _ = writeln!(s, "  \"quick\": {},\n  \"sabotage\": {},", o.quick, o.sabotage);
    let failed = checks.iter().filter(|c| !c.pass).count();
    let _ = writeln!(s, "  \"checks_total\": {},\n  \"checks_failed\": {failed},", checks.len());
    s.push_str("  \"checks\": [");
    for (i, c) in checks.iter().enumerate() {
        let _ = write!(
            s,
            "{}\n    {{\"name\": {}, \"dtype\": {}, \"shape\": {}, \"err\": {}, \"bound\": {}, \"pass\": {}, \"note\": {}}}",
            if i == 0 { "" } else { "," },
            jstr(&c.name),
            jstr(&c.dtype),
            jstr(&c.shape),
            jnum(c.err),
            jnum(c.bound),
            c.pass,
            jstr(&c.note)
        );
    }
    s.push_str("\n  ],\n");
    let section = |s: &mut String, name: &str, get: &dyn Fn(&Bench) -> Option<String>| {
        let items: Vec<String> = benches
            .iter()
            .filter_map(|b| get(b).map(|v| format!("      {}: {v}", jstr(&b.key))))
            .collect();
        let _ = write!(s, "    {}: {{\n{}\n    }}", jstr(name), items.join(",\n"));
    };
    s.push_str("  \"bench\": {\n");
    section(&mut s, "ours", &|b| b.ours.map(jnum));
    s.push_str(",\n");
    section(&mut s, "cublaslt", &|b| b.cublaslt.map(jnum));
    s.push_str("\n  },\n  \"units\": {\n");
    let units: Vec<String> =
        benches.iter().map(|b| format!("    {}: {}", jstr(&b.key), jstr(b.unit))).collect();
    s.push_str(&units.join(",\n"));
    s.push_str("\n  },\n  \"notes\": {\n");
    let notes: Vec<String> =
        benches.iter().map(|b| format!("    {}: {}", jstr(&b.key), jstr(&b.note))).collect();
    s.push_str(&notes.join(",\n"));
    s.push_str("\n  }\n}\n");
    std::fs::write(path, s)?;
    Ok(())
}

// ------------------------------------------------------------------ main

/// Command-line options.
struct Opts {
    gpu: bool,
    ordinal: usize,
    quick: bool,
    bench: bool,
    checks: bool,
    json: Option<PathBuf>,
    only: Vec<String>,
    seed: u64,
    sabotage: bool,
    precompile: Option<String>,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        gpu: true,
        ordinal: 0,
        quick: false,
        bench: false,
        checks: true,
        json: None,
        only: Vec::new(),
        seed: 0x7470_6172,
        sabotage: false,
        precompile: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match flag.as_str() {
            "--device" => {
                o.gpu = match val("--device")?.as_str() {
                    "gpu" | "cuda" => true,
                    "emulator" | "emu" => false,
                    other => return Err(format!("--device: gpu or emulator, not {other}")),
                }
            }
            "--ordinal" => {
                o.ordinal = val("--ordinal")?.parse().map_err(|_| "--ordinal: not a number")?
            }
            "--quick" => o.quick = true,
            "--bench" => o.bench = true,
            "--no-checks" => o.checks = false,
            "--json" => o.json = Some(PathBuf::from(val("--json")?)),
            "--only" => o.only = val("--only")?.split(',').map(|s| s.trim().to_string()).collect(),
            "--seed" => o.seed = val("--seed")?.parse().map_err(|_| "--seed: not a number")?,
            "--sabotage" => o.sabotage = true,
            "--precompile" => o.precompile = Some(val("--precompile")?),
            "-h" | "--help" => {
                let doc: Vec<&str> = include_str!("gpu_check.rs")
                    .lines()
                    .take_while(|l| l.starts_with("//!"))
                    .map(|l| l.trim_start_matches("//!").trim_start_matches(' '))
                    .collect();
                println!("{}", doc.join("\n"));
                std::process::exit(0);
            }
            other => return Err(format!("unknown flag {other} (see --help)")),
        }
    }
    if !o.gpu {
        // The emulator runs kernels one thread at a time on the CPU.
        o.quick = true;
    }
    Ok(o)
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gpu_check: {e}");
            std::process::exit(2);
        }
    };
    if let Some(arch) = &o.precompile {
        let t0 = Instant::now();
        let options = tpar::kernels::cuda::device::CompileOptions::default();
        match tpar::kernels::cuda::device::precompile(arch, &options) {
            Ok(files) => {
                for f in &files {
                    println!("{}", f.display());
                }
                println!(
                    "{} kernel sources compiled for {arch} ({:.1} s)",
                    files.len(),
                    t0.elapsed().as_secs_f64()
                );
                std::process::exit(0);
            }
            Err(e) => {
                eprintln!("gpu_check: --precompile {arch}: {e}");
                std::process::exit(2);
            }
        }
    }
    let dev = match Dev::open(&o) {
        Ok(d) => d,
        Err(e) => {
            let what =
                if o.gpu { format!("cuda:{}", o.ordinal) } else { "the CPU emulator".into() };
            eprintln!("gpu_check: cannot open {what}: {e}");
            std::process::exit(2);
        }
    };
    let device = dev.l().describe();
    println!(
        "gpu_check on {device}: {} sizes{}",
        if o.quick { "quick" } else { "full" },
        if o.sabotage { ", SABOTAGED references (every check must fail)" } else { "" }
    );
    if o.gpu {
        if let (Ok(d), Ok(n)) = (
            tpar::kernels::cuda::device::driver_version(),
            tpar::kernels::cuda::device::nvrtc_version(),
        ) {
            println!("CUDA driver {}.{}, NVRTC {}.{}", d.0, d.1, n.0, n.1);
        }
    }
    let lt = dev.cuda().and_then(|cuda| match CublasLt::new(cuda) {
        Ok(lt) => Some(lt),
        Err(e) => {
            eprintln!("gpu_check: no cuBLASLt baseline: {e}");
            None
        }
    });
    let t0 = Instant::now();
    let mut c = Ctx {
        d: &dev,
        r: Report { checks: Vec::new(), sabotage: o.sabotage },
        rng: Rng(o.seed),
        quick: o.quick,
        only: o.only.clone(),
        lt: lt.as_ref(),
    };
    if o.checks {
        c.family("gemm", check_gemm);
        c.family("sdpa", check_sdpa);
        c.family("rmsnorm", check_rmsnorm);
        c.family("rope", check_rope);
        c.family("cross_entropy", check_cross_entropy);
        c.family("embedding", check_embedding);
        c.family("adamw", check_adamw);
        c.family("reduce", check_reduce);
        c.family("elementwise", check_elementwise);
        c.family("layout", check_layout);
    }
    let checks = std::mem::take(&mut c.r.checks);
    let failed: Vec<&Check> = checks.iter().filter(|c| !c.pass).collect();
    println!(
        "\n{} checks: {} passed, {} failed ({:.1} s)",
        checks.len(),
        checks.len() - failed.len(),
        failed.len(),
        t0.elapsed().as_secs_f64()
    );
    if !o.sabotage {
        for f in &failed {
            println!("  FAIL {} {} {} err {:.2e} {}", f.name, f.dtype, f.shape, f.err, f.note);
        }
    }
    let mut benches = Vec::new();
    if o.bench {
        if dev.cuda().is_some() {
            println!("\n== benchmarks");
            benches = run_benches(&dev, lt.as_ref(), o.quick, &mut c.rng, &o.only);
            print_bench_table(&benches);
        } else {
            eprintln!("gpu_check: --bench needs a GPU (the emulator models no timing); skipped");
        }
    }
    if let Some(path) = &o.json {
        match write_json(path, &device, &o, &checks, &benches) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(e) => {
                eprintln!("gpu_check: writing {}: {e}", path.display());
                std::process::exit(1);
            }
        }
    }
    let bad = if o.sabotage {
        let passed: Vec<&Check> = checks.iter().filter(|c| c.pass).collect();
        for p in &passed {
            println!("  NOT CAUGHT by the sabotage: {} {} {}", p.name, p.dtype, p.shape);
        }
        !passed.is_empty()
    } else {
        !failed.is_empty()
    };
    std::process::exit(i32::from(bad));
}
