//! Seeded random sweeps of the Hopper kernels in the CPU emulator standing
//! in for an `sm_90a` device: the GEMM (`cuda/gemm_hopper.cu`, through
//! `gemm_hopper::gemm_with`) and the attention forward and backward
//! (`cuda/sdpa_hopper.cu`, `cuda/sdpa_hopper_bwd.cu`, through their
//! launchers), each problem drawn at random over what the launchers take and
//! checked against an f64 reference of the same rounded inputs, with the
//! tolerances of the fixed-case tests (`emu_gemm_hopper.rs`,
//! `sdpa_hopper.rs`, `sdpa_hopper_bwd.rs`).
//!
//! - GEMM: m, n and k from 1 to a few hundred (tiny, at and around the tile
//!   edges 64, 128, 192 and 256, and anything between), one in ten up to
//!   1400, 1100 and 1000 (more than 8 row tiles: several groups of the
//!   persistent tile order); every layout, bf16 / f16 in, bf16 / f16 / f32
//!   out, tile widths 128 and 256, clusters of 1 and 2, 1 to 8 persistent
//!   blocks (or 132); 1, 2, 3 or 5 batches, either operand broadcast or
//!   batches that overlap; alpha and beta (beta = 0 on a C that nothing has
//!   written, which must not be read); a bias, then a residual or gate
//!   matrix (its own row pitch and batch stride, 0 included) or the rotary
//!   embedding (head dims 2 to 128, any number of rotated heads, positions
//!   wrapping at any sequence length); C, the bias, the matrix and the
//!   tables at any address their type allows, C at any row pitch and batch
//!   stride (bulk or guarded stores). A and B hold NaN in every element
//!   outside their matrices (a K tail or a row read past its edge shows),
//!   and every element of C outside the product must keep its bits.
//! - Attention: 1 to 3 batches, 1 or 2 kv heads with 1, 2, 3 or 4 q heads
//!   each, q and kv lengths from 1 to a few hundred, one in ten up to 700
//!   (equal or not; long key sequences wrap the ring); head dims 64 and 128,
//!   causal or not, the scale; an additive mask broadcast over any of batch,
//!   head and row (key padding, random values, `-inf` entries, fully masked
//!   rows and batches); bf16 and f16; q, k, v and out dense, as `[b, s, h *
//!   d]` rows, packed in one projection output, or with gaps after every
//!   row, head and batch (`common::sdpa::Arrangement`). The inputs' gaps
//!   hold NaN and the outputs' a guard value they must keep; the backward
//!   runs from the forward's own out and lse, on a workspace nothing has
//!   written. The gradients are measured against the larger of their
//!   largest magnitude and that of the terms they sum ([`grad_terms`]),
//!   which cancel where a row sees one key.
//!
//! Some draws are problems the launchers refuse (f32 inputs, operands or
//! pitches off 16 bytes, another cluster size or tile width, a rotary
//! embedding that does not fit, other head dims, attention strides off 16
//! bytes): each must be refused with `KernelError::BadArguments` exactly
//! when the sweep predicts it, without writing anything; the rest must run.
//! Every case runs under its own thread order of the emulator; the sizes
//! are bounded so that a case runs in well under a second.
//!
//! The buffers are an emulated device's (`EmulatedGpu`), each followed by a
//! few elements of NaN or guards. With `TPAR_EMU_RACECHECK=1` the sweeps run
//! on the checking emulator, which reports races, and (the buffers then
//! without those tails) any access past a buffer's end and any read of
//! memory nothing has written.
//!
//! `TPAR_SWEEP_CASES` sets the number of cases of each sweep (default
//! [`GEMM_CASES`] and [`ATTENTION_CASES`]: a few seconds each in a release
//! build), `TPAR_SWEEP_SEED` the seed (decimal or `0x` hex, default
//! [`DEFAULT_SEED`]); case `i` of a seed is drawn from the seed and `i`
//! alone, and `TPAR_SWEEP_ONLY=i` runs that case only. A failure names the
//! seed, the case and its full description, and the command that replays
//! it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::common;

use bytemuck::Pod;
use common::sdpa::{guards_touched, max_rel, Arrangement, Inputs, Placed, Placement};
use common::{bits_of_value as to_bits, cvt, data, emu, f64s, value_of_bits as of_bits, Rng};
use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::raw::gemm_hopper::{
    self, AuxInput, AuxOp, Epilogue, HopperConfig, HopperTarget, RopeEpilogue, EMU_ARCH_ENV,
};
use tpar_kernels::cuda::raw::sdpa::{
    sdpa_backward_workspace_bytes, SdpaBwdBuffers, SdpaDevMask, SdpaFwdBuffers, SdpaLayout,
};
use tpar_kernels::cuda::raw::{sdpa_hopper, sdpa_hopper_bwd};
use tpar_kernels::cuda::{CudaDType, DevPtr, DeviceBuffer, GpuDevice};
use tpar_kernels::gemm::GemmShape;
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::{Float, KernelError};

use half::{bf16, f16};
use CudaDType::{BF16, F16, F32};

/// Cases of the GEMM sweep without `TPAR_SWEEP_CASES`.
const GEMM_CASES: usize = 96;

/// Cases of the attention sweep without `TPAR_SWEEP_CASES`.
const ATTENTION_CASES: usize = 28;

/// The seed without `TPAR_SWEEP_SEED`.
const DEFAULT_SEED: u64 = 0x5eed_0090;

/// The emulator's thread-order seed outside the sweeps (its default).
const DEFAULT_ORDER: u64 = 0x7470_6172;

/// Held while a case sets the emulator's thread order and launches, so that
/// the two sweeps (which may run at once) do not change each other's order.
static ORDER: Mutex<()> = Mutex::new(());

/// Runs `f` under the emulator's thread order `seed`, then restores the
/// default order (another test's launch meanwhile runs under it too: every
/// kernel must be right under any order).
fn in_order<R>(seed: u64, f: impl FnOnce() -> R) -> R {
    let _held = ORDER.lock().unwrap_or_else(|p| p.into_inner());
    emu().set_seed(seed);
    let r = catch_unwind(AssertUnwindSafe(f));
    emu().set_seed(DEFAULT_ORDER);
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// The value of environment variable `name` (decimal or `0x` hex); `None`
/// when unset or empty.
fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    if v.is_empty() {
        return None;
    }
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

/// The sweep's seed and the cases to run (`default_cases` without
/// `TPAR_SWEEP_CASES`).
fn plan(default_cases: usize) -> (u64, Vec<usize>) {
    let seed = env_u64("TPAR_SWEEP_SEED").unwrap_or(DEFAULT_SEED);
    if let Some(only) = env_u64("TPAR_SWEEP_ONLY") {
        return (seed, vec![only as usize]);
    }
    let n = env_u64("TPAR_SWEEP_CASES").map_or(default_cases, |n| n as usize);
    (seed, (0..n).collect())
}

/// The generator of case `i` of `seed`.
fn case_rng(seed: u64, i: usize) -> Rng {
    let mut r = Rng(seed ^ (i as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    r.next();
    r
}

/// Uniform in `0..n`.
fn below(r: &mut Rng, n: usize) -> usize {
    (r.next() % n as u64) as usize
}

/// True with probability `p`.
fn chance(r: &mut Rng, p: f64) -> bool {
    ((r.next() >> 11) as f64 / (1u64 << 53) as f64) < p
}

fn pick<T: Copy>(r: &mut Rng, of: &[T]) -> T {
    of[below(r, of.len())]
}

/// A size from 1 to `max`, or (one in ten) to `long`: tiny, near a tile
/// edge (64, 128, 192, 256), or uniform.
fn size(r: &mut Rng, max: usize, long: usize) -> usize {
    match below(r, 10) {
        0..=2 => 1 + below(r, 16),
        3..=5 => {
            let edge = pick(r, &[64usize, 128, 192, 256]);
            (edge + below(r, 5)).saturating_sub(2).clamp(1, max)
        }
        6..=8 => 1 + below(r, max),
        _ => 1 + below(r, long),
    }
}

/// A value k / 16 for k in -16..16 (exact in every type: the products and
/// sums of the GEMM are exact in f32).
fn sixteenth(r: &mut Rng) -> f64 {
    below(r, 32) as f64 / 16.0 - 1.0
}

/// The outcome of a sweep's case.
enum Outcome {
    Ran,
    Refused,
}

/// Draws the cases of `plan(default_cases)` with `draw` and runs them with
/// `run`, counting them; each failing or panicking case is printed with the
/// seed, its index, its full description and the replay command, and the
/// test fails after the last case naming the first. Two thirds of the cases
/// less 4 must have run (not been refused).
fn sweep<C: std::fmt::Debug>(
    name: &str,
    default_cases: usize,
    draw: impl Fn(&mut Rng) -> C,
    run: impl Fn(&C) -> Result<Outcome, String>,
) {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    let (seed, cases) = plan(default_cases);
    let start = Instant::now();
    let check = if emu().checks_races() { "TPAR_EMU_RACECHECK=1 " } else { "" };
    let (mut ran, mut refused, mut failed) = (0, 0, Vec::new());
    for &i in &cases {
        let cs = draw(&mut case_rng(seed, i));
        let result = catch_unwind(AssertUnwindSafe(|| run(&cs))).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panicked: {msg}"))
        });
        match result {
            Ok(Outcome::Ran) => ran += 1,
            Ok(Outcome::Refused) => refused += 1,
            Err(why) => {
                let msg = format!(
                    "{name} sweep, seed {seed:#x}, case {i}: {why}\n{cs:#?}\nreplay: \
                     {check}TPAR_SWEEP_SEED={seed:#x} TPAR_SWEEP_ONLY={i} cargo test --release \
                     -p tpar-kernels --test emu_sm90a random_sweep::{name}"
                );
                eprintln!("{msg}");
                failed.push(msg);
            }
        }
    }
    eprintln!(
        "{name} sweep, seed {seed:#x}: {} cases, {ran} ran, {refused} refused, {} failed, {:.1} s",
        cases.len(),
        failed.len(),
        start.elapsed().as_secs_f64()
    );
    if let Some(first) = failed.first() {
        panic!("{} of {} cases failed; the first:\n{first}", failed.len(), cases.len());
    }
    // about one in eight is drawn to be refused
    let want = (cases.len() * 2 / 3).saturating_sub(4);
    assert!(ran >= want, "{name} sweep: {ran} of {} cases ran, {want} wanted", cases.len());
}

// ------------------------------------------------------------------- GEMM

/// The residual or gate matrix of a case.
#[derive(Clone, Copy, Debug)]
struct AuxCase {
    op: AuxOp,
    /// Row pitch (elements, `n` or more).
    ld: usize,
    /// Elements between batches (0: one matrix for every batch).
    stride: usize,
}

/// The rotary embedding of a case (head dim, rotated columns, positions).
#[derive(Clone, Copy, Debug)]
struct RopeCase {
    hd: usize,
    cols: usize,
    seq: usize,
}

/// One GEMM: A stored `[k, m]` when `ta` (else `[m, k]`), B `[n, k]` when
/// `tb` (else `[k, n]`), pitches and batch strides in elements, shifts in
/// bytes past a 16-byte boundary.
#[derive(Clone, Debug)]
struct GemmCase {
    din: CudaDType,
    dout: CudaDType,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    lda: usize,
    ldb: usize,
    ldc: usize,
    /// Batch strides of A, B and C (A's or B's 0: one for every batch).
    sa: usize,
    sb: usize,
    sc: usize,
    a_shift: usize,
    b_shift: usize,
    c_shift: usize,
    /// Bytes the bias, the matrix and the tables start past a 16-byte boundary.
    epi_shift: usize,
    alpha: f32,
    beta: f32,
    /// C is allocated and never written (with beta = 0, which must not
    /// read it: the emulated device fills new memory with NaN bytes, and the
    /// checking emulator reports a read).
    c_unwritten: bool,
    bias: bool,
    aux: Option<AuxCase>,
    rope: Option<RopeCase>,
    /// Persistent blocks (the emulated SM count).
    sms: u32,
    cluster: u32,
    tile_n: u32,
    /// The emulator's thread order.
    order: u64,
    /// The inputs' values.
    data: u64,
}

impl GemmCase {
    /// A's and B's stored (rows, columns).
    fn stored(&self) -> ((usize, usize), (usize, usize)) {
        let a = if self.ta { (self.k, self.m) } else { (self.m, self.k) };
        let b = if self.tb { (self.n, self.k) } else { (self.k, self.n) };
        (a, b)
    }

    /// The tile width's epilogue chunk (columns a rotary head dim must divide).
    fn chunk(&self) -> usize {
        if self.tile_n == 256 {
            64
        } else {
            128
        }
    }
}

fn draw_gemm(r: &mut Rng) -> GemmCase {
    let din = pick(r, &[BF16, F16]);
    let dout = pick(r, &[BF16, F16, F32]);
    let tile_n = pick(r, &[128u32, 256]);
    let cluster = pick(r, &[1u32, 2]);
    let (mut m, mut n, mut k) = (size(r, 300, 1400), size(r, 520, 1100), size(r, 300, 1000));
    let mut batch = pick(r, &[1usize, 1, 2, 3, 5]);
    // the emulated work: padded tiles x K steps, at most a few 128 x 256 x 256 tiles' worth
    let work = |m: usize, n: usize, k: usize, b: usize| {
        b * m.next_multiple_of(128) * n.next_multiple_of(tile_n as usize) * k.next_multiple_of(64)
    };
    while work(m, n, k, batch) > 3 * 128 * 512 * 320 {
        if batch > 1 {
            batch -= 1;
        } else if m >= n && m >= k {
            m = m.div_ceil(2);
        } else if n >= k {
            n = n.div_ceil(2);
        } else {
            k = k.div_ceil(2);
        }
    }
    let (ta, tb) = (chance(r, 0.5), chance(r, 0.5));
    let (ac, bc) = (if ta { m } else { k }, if tb { k } else { n });
    let (ar, br) = (if ta { k } else { m }, if tb { n } else { k });
    let lda = ac.next_multiple_of(8) + 8 * below(r, 3);
    let ldb = bc.next_multiple_of(8) + 8 * below(r, 3);
    // a batch stride: broadcast, overlapping batches, or past the matrix
    let stride = |r: &mut Rng, rows: usize, ld: usize| match below(r, 8) {
        0 if batch > 1 => 0,
        1 => 8 * (1 + below(r, (rows * ld / 8).max(1))),
        _ => rows * ld + 8 * below(r, 3),
    };
    let (sa, sb) = (stride(r, ar, lda), stride(r, br, ldb));
    let osz = dout.size();
    let per16 = 16 / osz;
    // C's pitch and batch stride: 16-byte multiples (bulk stores) or not
    let aligned = chance(r, 0.6);
    let ldc =
        if aligned { n.next_multiple_of(per16) + per16 * below(r, 2) } else { n + below(r, 9) };
    let span = (m - 1) * ldc + n;
    let sc = if aligned {
        span.next_multiple_of(per16) + per16 * below(r, 2)
    } else {
        span + below(r, ldc + 8)
    };
    let c_shift = if chance(r, 0.75) { 0 } else { osz * below(r, per16) };
    let epi_shift = if chance(r, 0.75) { 0 } else { osz * below(r, per16) };
    let alpha = pick(r, &[1.0f32, 1.0, 0.5, -1.0, 2.0, 0.25, -0.75, 1.5]);
    let beta = if chance(r, 0.5) { 0.0 } else { pick(r, &[1.0f32, -1.25, 0.75, 0.5, -2.0]) };
    let c_unwritten = beta == 0.0 && chance(r, 0.5);
    let bias = chance(r, 0.4);
    let (mut aux, mut rope) = (None, None);
    match below(r, 4) {
        0 => {
            let ld = n + below(r, 9);
            let stride =
                if batch > 1 && chance(r, 0.25) { 0 } else { (m - 1) * ld + n + below(r, 9) };
            let op = pick(r, &[AuxOp::Residual, AuxOp::SiluMul]);
            aux = Some(AuxCase { op, ld, stride });
        }
        1 => {
            let hd = pick(r, &[2usize, 4, 8, 16, 32, 64, 64, 128, 128]);
            // mostly some heads (all of them, or all but the v heads' share)
            let heads = n / hd;
            let cols = hd * if heads > 0 && chance(r, 0.85) { 1 + below(r, heads) } else { 0 };
            rope = Some(RopeCase { hd, cols, seq: 1 + below(r, m + 8) });
        }
        _ => {}
    }
    let sms = if chance(r, 0.1) { 132 } else { 1 + below(r, 8) as u32 };
    let mut cs = GemmCase {
        din,
        dout,
        batch,
        m,
        n,
        k,
        ta,
        tb,
        lda,
        ldb,
        ldc,
        sa,
        sb,
        sc,
        a_shift: 0,
        b_shift: 0,
        c_shift,
        epi_shift,
        alpha,
        beta,
        c_unwritten,
        bias,
        aux,
        rope,
        sms,
        cluster,
        tile_n,
        order: r.next(),
        data: r.next(),
    };
    // one in eight: something the launcher refuses
    if chance(r, 0.125) {
        match below(r, 8) {
            0 => (cs.din, cs.dout) = (F32, F32),
            1 => cs.lda += 1 + below(r, 7),
            2 => cs.ldb += 1 + below(r, 7),
            3 => cs.a_shift = 2 * (1 + below(r, 7)),
            4 => cs.b_shift = 2 * (1 + below(r, 7)),
            5 => cs.cluster = pick(r, &[0, 3, 4]),
            6 => cs.tile_n = pick(r, &[64, 192, 512]),
            _ => {
                // a batch stride off 8 elements, or a rotary embedding with a matrix
                if batch > 1 && cs.sa > 0 {
                    cs.sa += 1 + below(r, 7);
                } else {
                    let ld = n;
                    cs.aux = Some(AuxCase { op: AuxOp::Residual, ld, stride: m * ld });
                    cs.rope = Some(RopeCase { hd: 2, cols: 0, seq: 1 });
                }
            }
        }
    }
    cs
}

/// Whether the launcher must refuse `cs` (an independent statement of its
/// rules).
fn gemm_refused(cs: &GemmCase) -> bool {
    let by8 = |v: usize| v.is_multiple_of(8);
    cs.din == F32
        || !cs.a_shift.is_multiple_of(16)
        || !cs.b_shift.is_multiple_of(16)
        || !by8(cs.lda)
        || !by8(cs.ldb)
        || (cs.batch > 1 && (!by8(cs.sa) || !by8(cs.sb)))
        || !matches!(cs.cluster, 1 | 2)
        || !matches!(cs.tile_n, 128 | 256)
        || cs.rope.is_some_and(|rp| {
            cs.aux.is_some()
                || rp.hd == 0
                || !rp.hd.is_multiple_of(2)
                || !rp.cols.is_multiple_of(rp.hd)
                || rp.cols > cs.n
                || rp.seq == 0
                || !cs.chunk().is_multiple_of(rp.hd)
        })
}

/// The emulated device: its buffers are registered with the checking
/// emulator's memcheck and initcheck (`TPAR_EMU_RACECHECK=1`).
fn device() -> Arc<dyn GpuDevice> {
    EmulatedGpu::open(0).expect("the CPU emulator builds")
}

/// Elements of NaN (inputs) or guards (outputs) after a buffer's last
/// element: `n`, or none on the checking emulator, whose memcheck reports
/// any access past an allocation's end.
fn tail(n: usize) -> usize {
    if emu().checks_races() {
        0
    } else {
        n
    }
}

/// `len` elements of `dt` in device memory, from `shift` bytes into their
/// allocation.
struct Elems {
    buf: DeviceBuffer,
    dt: CudaDType,
    shift: usize,
    len: usize,
}

impl Elems {
    /// The elements of bits `bits`.
    fn upload(dev: &Arc<dyn GpuDevice>, dt: CudaDType, bits: &[u32], shift: usize) -> Self {
        let mut bytes = vec![0u8; shift];
        for &b in bits {
            bytes.extend_from_slice(&b.to_le_bytes()[..dt.size()]);
        }
        let buf = DeviceBuffer::from_host(dev, &bytes).unwrap();
        Elems { buf, dt, shift, len: bits.len() }
    }

    /// `len` elements nothing has written.
    fn unwritten(dev: &Arc<dyn GpuDevice>, dt: CudaDType, len: usize, shift: usize) -> Self {
        let buf = DeviceBuffer::alloc(dev, shift + len * dt.size()).unwrap();
        Elems { buf, dt, shift, len }
    }

    fn ptr(&self) -> DevPtr {
        self.buf.ptr() + self.shift as DevPtr
    }

    /// The elements' bits, read back.
    fn bits(&self) -> Vec<u32> {
        let bytes = self.buf.to_host().unwrap();
        let es = self.dt.size();
        (0..self.len)
            .map(|i| {
                let mut w = [0u8; 4];
                w[..es].copy_from_slice(&bytes[self.shift + i * es..][..es]);
                u32::from_le_bytes(w)
            })
            .collect()
    }
}

/// A matrix of `rows` x `cols` at pitch `ld`, `batch` of them `stride`
/// apart, and [`tail`] elements after them, as the bits of `dt`: random
/// values (k / 16) in the matrix's elements, NaN everywhere else.
fn matrix(
    r: &mut Rng,
    dt: CudaDType,
    (rows, cols, ld): (usize, usize, usize),
    (batch, stride): (usize, usize),
) -> Vec<u32> {
    let len = (batch - 1) * stride + (rows - 1) * ld + cols + tail(8);
    let mut m = vec![to_bits(dt, f64::NAN); len];
    for b in 0..batch {
        for i in 0..rows {
            for j in 0..cols {
                m[b * stride + i * ld + j] = to_bits(dt, sixteenth(r));
            }
        }
    }
    m
}

fn run_gemm(cs: &GemmCase) -> Result<Outcome, String> {
    let dev = device();
    let r = &mut Rng(cs.data);
    let (m, n, k, batch, dout) = (cs.m, cs.n, cs.k, cs.batch, cs.dout);
    let ((ar, ac), (br, bc)) = cs.stored();
    let a = matrix(r, cs.din, (ar, ac, cs.lda), (batch, cs.sa));
    let b = matrix(r, cs.din, (br, bc, cs.ldb), (batch, cs.sb));
    let clen = (batch - 1) * cs.sc + (m - 1) * cs.ldc + n + tail(8);
    let c = if cs.c_unwritten {
        Elems::unwritten(&dev, dout, clen, cs.c_shift)
    } else {
        let bits: Vec<u32> = (0..clen).map(|_| to_bits(dout, sixteenth(r))).collect();
        Elems::upload(&dev, dout, &bits, cs.c_shift)
    };
    let bias = matrix(r, dout, (1, n, n), (1, 0));
    let aux = cs.aux.map(|x| matrix(r, dout, (m, n, x.ld), (batch, x.stride)));
    let tabs = cs.rope.map(|rp| [0, 1].map(|_| matrix(r, dout, (rp.seq, rp.hd, rp.hd), (1, 0))));
    let (d_a, d_b) =
        (Elems::upload(&dev, cs.din, &a, cs.a_shift), Elems::upload(&dev, cs.din, &b, cs.b_shift));
    let at = cs.epi_shift;
    let d_bias = Elems::upload(&dev, dout, &bias, at);
    let d_aux = aux.as_ref().map(|x| Elems::upload(&dev, dout, x, at));
    let d_tabs = tabs.as_ref().map(|t| t.each_ref().map(|t| Elems::upload(&dev, dout, t, at)));

    let mut shape = GemmShape::new(batch, m, n, k);
    (shape.trans_a, shape.trans_b, shape.a_batch_stride, shape.b_batch_stride) =
        (cs.ta, cs.tb, cs.sa, cs.sb);
    let p = GemmProblem::new(shape, cs.din, dout)
        .with_leading_dims(cs.lda, cs.ldb, cs.ldc)
        .with_c_batch_stride(cs.sc)
        .with_scale(cs.alpha, cs.beta);
    let epi = Epilogue {
        bias: cs.bias.then(|| d_bias.ptr()),
        aux: cs.aux.zip(d_aux.as_ref()).map(|(x, buf)| AuxInput {
            ptr: buf.ptr(),
            ld: x.ld,
            batch_stride: x.stride,
            op: x.op,
        }),
        rope: cs.rope.zip(d_tabs.as_ref()).map(|(rp, [cos, sin])| RopeEpilogue {
            cos: cos.ptr(),
            sin: sin.ptr(),
            head_dim: rp.hd,
            cols: rp.cols,
            seq: rp.seq,
        }),
    };
    let before = c.bits();
    let cfg = HopperConfig { cluster: cs.cluster, tile_n: cs.tile_n };
    let launched = in_order(cs.order, || {
        // SAFETY: A, B, C, the bias, the matrix and the tables are device
        // buffers allocated above with the extents the problem, its pitches
        // and strides, n and seq x head dim reach, in the problem's types; C
        // overlaps none of them.
        unsafe {
            gemm_hopper::gemm_with(
                &*dev,
                HopperTarget::emulator(cs.sms),
                cfg,
                &p,
                &epi,
                d_a.ptr(),
                d_b.ptr(),
                c.ptr(),
            )
        }
    });
    let after = c.bits();
    match (launched, gemm_refused(cs)) {
        (Err(KernelError::BadArguments { .. }), true) => {
            return if after == before {
                Ok(Outcome::Refused)
            } else {
                Err("a refused launch wrote C".into())
            };
        }
        (Ok(()), false) => {}
        (Ok(()), true) => return Err("the launcher took a problem it must refuse".into()),
        (Err(e), _) => return Err(format!("launch failed: {e}")),
    }

    // op(A) as [m][k] and op(B) as [n][k] of each batch, then the reference
    let (ain, bin) = (|i: usize| of_bits(cs.din, a[i]), |i: usize| of_bits(cs.din, b[i]));
    let old = |i: usize| of_bits(dout, before[i]);
    let mut want_at = vec![None; clen];
    for bi in 0..batch {
        let opa: Vec<f64> = (0..m * k)
            .map(|x| {
                let (i, kk) = (x / k, x % k);
                ain(bi * cs.sa + if cs.ta { kk * cs.lda + i } else { i * cs.lda + kk })
            })
            .collect();
        let opb: Vec<f64> = (0..n * k)
            .map(|x| {
                let (j, kk) = (x / k, x % k);
                bin(bi * cs.sb + if cs.tb { j * cs.ldb + kk } else { kk * cs.ldb + j })
            })
            .collect();
        for i in 0..m {
            let mut v: Vec<f64> = (0..n)
                .map(|j| {
                    let acc: f64 =
                        opa[i * k..][..k].iter().zip(&opb[j * k..][..k]).map(|(x, y)| x * y).sum();
                    let mut v = cs.alpha as f64 * acc;
                    if cs.beta != 0.0 {
                        v += cs.beta as f64 * old(bi * cs.sc + i * cs.ldc + j);
                    }
                    if cs.bias {
                        v += of_bits(dout, bias[j]);
                    }
                    if let (Some(x), Some(g)) = (cs.aux, &aux) {
                        let g = of_bits(dout, g[bi * x.stride + i * x.ld + j]);
                        match x.op {
                            AuxOp::Residual => v += g,
                            AuxOp::SiluMul => v *= g / (1.0 + (-g).exp()),
                        }
                    }
                    v
                })
                .collect();
            if let (Some(rp), Some([cos, sin])) = (cs.rope, &tabs) {
                let (t, half) = (i % rp.seq, rp.hd / 2);
                let plain = v.clone();
                for (j, vj) in v.iter_mut().enumerate().take(rp.cols) {
                    let (h0, jj) = (j / rp.hd * rp.hd, j % rp.hd);
                    let (cs, sn) =
                        (of_bits(dout, cos[t * rp.hd + jj]), of_bits(dout, sin[t * rp.hd + jj]));
                    *vj = if jj < half {
                        plain[j] * cs - plain[h0 + jj + half] * sn
                    } else {
                        plain[j] * cs + plain[h0 + jj - half] * sn
                    };
                }
            }
            for (j, &w) in v.iter().enumerate() {
                want_at[bi * cs.sc + i * cs.ldc + j] = Some(w);
            }
        }
    }
    let eps = match dout {
        BF16 => 1.0 / 256.0,
        F16 => 1.0 / 1024.0,
        F32 => 1e-6,
    };
    let mut worst = (0.0f64, String::new());
    for (i, want) in want_at.iter().enumerate() {
        let got = of_bits(dout, after[i]);
        let err = match want {
            Some(_) if got.is_nan() => f64::INFINITY,
            Some(w) => (got - w).abs() / (eps * w.abs() + 1e-5 * (1.0 + w.abs())),
            None if after[i] == before[i] => 0.0,
            None => f64::INFINITY,
        };
        if err > worst.0 {
            let (bi, rem) = (i / cs.sc, i % cs.sc);
            let w = want.map_or(format!("its old bits {:#x}", before[i]), |w| w.to_string());
            let (row, col) = (rem / cs.ldc, rem % cs.ldc);
            worst = (err, format!("C[{i}] (batch {bi}, row {row}, col {col}) = {got}, want {w}"));
        }
    }
    if worst.0 > 1.0 {
        return Err(format!("{} ({:.1} x the tolerance)", worst.1, worst.0));
    }
    Ok(Outcome::Ran)
}

/// Random GEMMs of every kind the Hopper kernel takes (and some it refuses)
/// against the f64 reference.
#[test]
fn gemm() {
    sweep("gemm", GEMM_CASES, draw_gemm, run_gemm);
}

// -------------------------------------------------------------- attention

/// The additive mask of a case: which of batch, q head and row it varies
/// over (a stride of 0 broadcasts the others), keys masked at the end of
/// each batch (`kv_len - pad_step * b - pad_base` kept, down to none), random
/// values or zeros, `-inf` at every `inf_every`-th element, and whole rows
/// masked (one per (batch, head) it varies over).
#[derive(Clone, Copy, Debug)]
struct MaskCase {
    per_batch: bool,
    per_head: bool,
    per_row: bool,
    pad_step: usize,
    pad_base: usize,
    values: bool,
    inf_every: usize,
    dead_rows: bool,
}

/// One attention problem: the shape, the dtype, where the operands lie
/// (`None`: dense, passed without strides), the mask.
#[derive(Clone, Debug)]
struct AttnCase {
    dtype: CudaDType,
    shape: SdpaShape,
    layout: Option<Arrangement>,
    mask: Option<MaskCase>,
    order: u64,
    data: u64,
}

fn draw_attn(r: &mut Rng) -> AttnCase {
    let dtype = pick(r, &[BF16, F16]);
    let head_dim = pick(r, &[64usize, 128]);
    let kv_heads = pick(r, &[1usize, 1, 2]);
    let q_heads = kv_heads * pick(r, &[1usize, 2, 3, 4]);
    let mut batch = pick(r, &[1usize, 1, 2, 3]);
    let pad = |r: &mut Rng| pick(r, &[0usize, 8, 16, 64]);
    let layout = match below(r, 5) {
        0 => None,
        1 => Some(Arrangement::Bshd { pad: pad(r) }),
        2 => Some(Arrangement::Packed { pad: pad(r) }),
        3 => Some(Arrangement::Padded { pad: pad(r) }),
        _ => Some(Arrangement::Padded { pad: 0 }),
    };
    // one length for q, k and v packed in one buffer
    let packed = matches!(layout, Some(Arrangement::Packed { .. }));
    let mut q_len = size(r, 260, 700);
    let mut kv_len = if packed || chance(r, 0.3) { q_len } else { size(r, 260, 700) };
    // the emulated work: key tiles x q tiles x heads, at most a few
    let work = |b: usize, ql: usize, kl: usize| {
        b * q_heads * ql.div_ceil(64) * kl.div_ceil(128) * head_dim / 64
    };
    while work(batch, q_len, kv_len) > 48 {
        if batch > 1 {
            batch -= 1;
        } else if packed {
            (q_len, kv_len) = (q_len.div_ceil(2), kv_len.div_ceil(2));
        } else if q_len >= kv_len {
            q_len = q_len.div_ceil(2);
        } else {
            kv_len = kv_len.div_ceil(2);
        }
    }
    let causal = chance(r, 0.5);
    let scale = (0.5 + r.uniform() * 0.4) / (head_dim as f64).sqrt();
    let mask = match below(r, 4) {
        0 | 1 => None,
        kind => {
            let key_padding = kind == 2;
            Some(MaskCase {
                per_batch: key_padding || chance(r, 0.5),
                per_head: !key_padding && chance(r, 0.5),
                per_row: !key_padding && chance(r, 0.7),
                pad_step: below(r, 80),
                pad_base: if chance(r, 0.1) { kv_len } else { below(r, 40) },
                values: !key_padding,
                inf_every: if key_padding { 0 } else { pick(r, &[0, 0, 3, 7, 29]) },
                dead_rows: !key_padding && chance(r, 0.5),
            })
        }
    };
    let shape = SdpaShape {
        scale,
        ..common::sdpa::same_dim_shape(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal)
    };
    let mut cs = AttnCase { dtype, shape, layout, mask, order: r.next(), data: r.next() };
    // one in ten: something the launchers refuse
    if chance(r, 0.1) {
        match below(r, 3) {
            0 => {
                let d = pick(r, &[32usize, 96, 256]);
                (cs.shape.head_dim, cs.shape.v_dim) = (d, d);
                if cs.layout.is_some() {
                    cs.layout = Some(Arrangement::Bshd { pad: 0 });
                }
            }
            1 => {
                cs.shape.v_dim = if head_dim == 64 { 128 } else { 64 };
                cs.layout = None;
            }
            _ => {
                let p = 8 * below(r, 3) + pick(r, &[2usize, 4, 6]);
                cs.layout = Some(match below(r, 3) {
                    0 => Arrangement::Bshd { pad: p },
                    1 => Arrangement::Padded { pad: p },
                    _ => {
                        cs.shape.kv_len = cs.shape.q_len;
                        Arrangement::Packed { pad: p }
                    }
                });
            }
        }
    }
    cs
}

/// Whether the launchers must refuse `cs`: head dims other than equal 64 or
/// 128, or a stride (of a dim with more than one index) off 16 bytes.
fn attn_refused(cs: &AttnCase, pl: &Placement) -> bool {
    let s = &cs.shape;
    if s.head_dim != s.v_dim || !matches!(s.head_dim, 64 | 128) {
        return true;
    }
    let Some(_) = cs.layout else { return false };
    let off = |n: usize, stride: usize| n > 1 && !(stride * 2).is_multiple_of(16);
    [(pl.q, s.q_heads, s.q_len), (pl.k, s.kv_heads, s.kv_len), (pl.v, s.kv_heads, s.kv_len)]
        .into_iter()
        .chain([(pl.out, s.q_heads, s.q_len)])
        .any(|(p, heads, len)| {
            off(s.batch, p.st.batch) || off(heads, p.st.head) || off(len, p.st.row)
        })
}

/// The mask values and strides `(batch, head, row)` of `m` for `s`.
fn mask_values(r: &mut Rng, s: &SdpaShape, m: &MaskCase) -> (Vec<f64>, [usize; 3]) {
    let nb = if m.per_batch { s.batch } else { 1 };
    let nh = if m.per_head { s.q_heads } else { 1 };
    let nr = if m.per_row { s.q_len } else { 1 };
    let row = s.kv_len;
    let head = nr * row;
    let batch = nh * head;
    let mut v = vec![0.0; nb * batch];
    for (i, x) in v.iter_mut().enumerate() {
        if m.values {
            *x = r.uniform();
        }
        if m.inf_every > 0 && i % m.inf_every == m.inf_every / 2 {
            *x = f64::NEG_INFINITY;
        }
    }
    for b in 0..nb {
        let keep = s.kv_len.saturating_sub(m.pad_step * b + m.pad_base);
        for x in 0..nh * nr {
            let at = b * batch + x * row;
            v[at + keep..at + row].fill(f64::NEG_INFINITY);
            if m.dead_rows && nr > 1 && x % nr == (b * 5 + x / nr * 3 + 1) % nr {
                v[at..at + row].fill(f64::NEG_INFINITY);
            }
        }
    }
    let st = |per: bool, stride: usize| if per { stride } else { 0 };
    (v, [st(m.per_batch, batch), st(m.per_head, head), st(m.per_row, row)])
}

/// What the outputs' gaps hold (and must keep).
const GUARD: f64 = 12345.0;

/// Bytes after the backward's workspace that it must not write (a 64-query
/// tile of f32 rows at head dim 128).
const WORKSPACE_GUARD: usize = 64 * 128 * 4;

/// A device copy of `v`.
fn upload<T: Pod>(dev: &Arc<dyn GpuDevice>, v: &[T]) -> DeviceBuffer {
    DeviceBuffer::from_host(dev, v).unwrap()
}

/// The elements of `buf`, read back.
fn download<T: Pod + Default>(buf: &DeviceBuffer) -> Vec<T> {
    let mut v = vec![T::default(); buf.len() / std::mem::size_of::<T>()];
    buf.as_slice().copy_to_host(&mut v).unwrap();
    v
}

/// The address of element `i` of `buf`'s elements of `T`.
fn at<T>(buf: &DeviceBuffer, i: usize) -> DevPtr {
    buf.ptr() + (i * std::mem::size_of::<T>()) as DevPtr
}

fn run_attn(cs: &AttnCase) -> Result<Outcome, String> {
    match cs.dtype {
        BF16 => run_attn_t::<bf16>(cs),
        _ => run_attn_t::<f16>(cs),
    }
}

fn run_attn_t<T: Float + Pod>(cs: &AttnCase) -> Result<Outcome, String> {
    let dev = device();
    let (s, dt) = (&cs.shape, cs.dtype);
    let r = &mut Rng(cs.data);
    let nq = s.batch * s.q_heads * s.q_len;
    let nk = s.batch * s.kv_heads * s.kv_len;
    let mask = cs.mask.map(|m| {
        let (v, st) = mask_values(r, s, &m);
        (cvt::<T>(&v), st)
    });
    let x = Inputs::<T> {
        q: cvt(&data(nq * s.head_dim, r.next(), 1.5)),
        k: cvt(&data(nk * s.head_dim, r.next(), 1.5)),
        v: cvt(&data(nk * s.v_dim, r.next(), 1.0)),
        dout: cvt(&data(nq * s.v_dim, r.next(), 1.0)),
        mask,
    };
    // the mask, and NaN after it
    let d_mask = x.mask.as_ref().map(|(m, st)| {
        let mut v = m.clone();
        v.resize(m.len() + tail(64), T::from_f64(f64::NAN));
        (upload(&dev, &v), m.len(), *st)
    });
    let dev_mask = d_mask.as_ref().map(|(buf, len, [bs, hs, rs])| SdpaDevMask {
        data: buf.ptr(),
        len: *len,
        batch_stride: *bs,
        head_stride: *hs,
        row_stride: *rs,
    });
    // (`Placement` leaves 64 elements after the last operand, here [`tail`],
    // and its operands 16-byte aligned)
    let pl = Placement::new(s, cs.layout.unwrap_or(Arrangement::Padded { pad: 0 }));
    let (qkv_len, out_len) = (pl.qkv_len - 64 + tail(64), pl.out_len - 64 + tail(64));
    let layout = if cs.layout.is_some() { pl.layout() } else { SdpaLayout::default() };
    let qkv_ops = [&pl.q, &pl.k, &pl.v];
    let filled = |len: usize, fill: f64, ops: &[(&Placed, &[T])]| {
        let mut v = vec![T::from_f64(fill); len];
        for (p, x) in ops {
            p.scatter(x, &mut v);
        }
        upload(&dev, &v)
    };
    let qkv = filled(qkv_len, f64::NAN, &[(&pl.q, &x.q), (&pl.k, &x.k), (&pl.v, &x.v)]);
    let out = filled(out_len, GUARD, &[]);
    let lse = DeviceBuffer::alloc(&dev, nq * 4).unwrap();
    let fb = SdpaFwdBuffers {
        q: at::<T>(&qkv, pl.q.off),
        k: at::<T>(&qkv, pl.k.off),
        v: at::<T>(&qkv, pl.v.off),
        mask: dev_mask,
        out: at::<T>(&out, pl.out.off),
        lse: lse.ptr(),
        layout,
    };
    let dout = filled(out_len, f64::NAN, &[(&pl.out, &x.dout)]);
    let grads = filled(qkv_len, GUARD, &[]);
    // the workspace, never written before the backward (its pre kernel
    // initialises what it uses), and a guard after it
    let ws_bytes = sdpa_backward_workspace_bytes(s).unwrap();
    let ws = DeviceBuffer::alloc(&dev, ws_bytes + tail(WORKSPACE_GUARD)).unwrap();
    let ws_guard = ws.to_host().unwrap().split_off(ws_bytes);
    let bb = SdpaBwdBuffers {
        q: fb.q,
        k: fb.k,
        v: fb.v,
        mask: dev_mask,
        out: fb.out,
        lse: fb.lse,
        dout: at::<T>(&dout, pl.out.off),
        dq: at::<T>(&grads, pl.q.off),
        dk: at::<T>(&grads, pl.k.off),
        dv: at::<T>(&grads, pl.v.off),
        workspace: ws.ptr(),
        workspace_bytes: ws_bytes,
        layout,
    };
    let untouched = |buf: &DeviceBuffer, ops: &[&Placed], what: &str| -> Result<(), String> {
        let bad = guards_touched(&download::<T>(buf), ops, T::from_f64(GUARD));
        match bad.first() {
            None => Ok(()),
            Some((at, v)) => Err(format!(
                "{what}: {} elements outside the operands written, first [{at}] = {v}",
                bad.len()
            )),
        }
    };

    let fwd = in_order(cs.order, || {
        // SAFETY: device buffers holding every element the shape and strides
        // reach (`Placement`), the mask its `len` elements, lse one f32 a
        // query row.
        unsafe { sdpa_hopper::sdpa_forward(&*dev, dt, s, &fb) }
    });
    if attn_refused(cs, &pl) {
        let bwd = in_order(cs.order, || {
            // SAFETY: as for the forward; the workspace holds `ws_bytes`.
            unsafe { sdpa_hopper_bwd::sdpa_backward(&*dev, dt, s, &bb) }
        });
        for (what, r) in [("forward", fwd), ("backward", bwd)] {
            if !matches!(r, Err(KernelError::BadArguments { .. })) {
                return Err(format!("the {what} took a call it must refuse: {r:?}"));
            }
        }
        untouched(&out, &[], "a refused forward's out")?;
        untouched(&grads, &[], "a refused backward's gradients")?;
        return Ok(Outcome::Refused);
    }
    fwd.map_err(|e| format!("forward: {e}"))?;
    let tol = if dt == BF16 { 1e-2 } else { 2e-3 };
    untouched(&out, &[&pl.out], "out's buffer")?;
    let (out_ref, lse_ref) = x.reference_forward(s);
    let got = f64s(&pl.out.gather(&download::<T>(&out)));
    if got.iter().any(|v| !v.is_finite()) {
        return Err("out holds a value that is not finite".into());
    }
    let e = max_rel("out", &got, &out_ref);
    if e > tol {
        return Err(format!("out: rel err {e:e} > {tol:e}"));
    }
    for (i, (&g, &w)) in download::<f32>(&lse).iter().zip(&lse_ref).enumerate() {
        let g = g as f64;
        let ok = if w.is_infinite() { g == w } else { (g - w).abs() <= 1e-3 * (1.0 + w.abs()) };
        if !ok {
            return Err(format!("lse[{i}] = {g}, want {w}"));
        }
    }

    // the backward from this forward's out and lse
    in_order(cs.order ^ 1, || {
        // SAFETY: as for the forward; the workspace holds `ws_bytes`.
        unsafe { sdpa_hopper_bwd::sdpa_backward(&*dev, dt, s, &bb) }
    })
    .map_err(|e| format!("backward: {e}"))?;
    if ws.to_host().unwrap()[ws_bytes..] != ws_guard[..] {
        return Err("the backward wrote past its workspace".into());
    }
    untouched(&grads, &qkv_ops, "the gradients' buffer")?;
    let (dq_ref, dk_ref, dv_ref) = x.reference_backward(s);
    let terms = grad_terms(s, &x, &out_ref, &lse_ref);
    let grads = download::<T>(&grads);
    let wants = [("dq", &pl.q, &dq_ref), ("dk", &pl.k, &dk_ref), ("dv", &pl.v, &dv_ref)];
    for ((name, p, want), term) in wants.into_iter().zip(terms) {
        let got = f64s(&p.gather(&grads));
        if got.iter().any(|v| !v.is_finite()) {
            return Err(format!("{name} holds a value that is not finite"));
        }
        let largest = want.iter().fold(term, |m, w| m.max(w.abs())).max(1e-30);
        let (at, err) = got
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs())
            .enumerate()
            .fold((0, 0.0f64), |best, (i, e)| if e > best.1 { (i, e) } else { best });
        if err > tol * largest {
            return Err(format!(
                "{name}[{at}] = {}, want {}: error {:e} of the scale {largest:e} > {tol:e}",
                got[at],
                want[at],
                err / largest
            ));
        }
    }
    Ok(Outcome::Ran)
}

/// The largest magnitude of the terms an element of dq, dk and dv sums, in
/// f64 from the rounded inputs and the reference's out and lse: `scale P
/// (|dP| + |delta|)` times `|k|` (dq) or `|q|` (dk), and `P |dout|` (dv).
/// The gradients are compared relative to the larger of this and their
/// largest magnitude: where the terms cancel (one visible key per row makes
/// dS = P (dP - delta) zero) the gradient is the size of the rounding of P,
/// dS and out's delta, not 0.
fn grad_terms<T: Float>(s: &SdpaShape, x: &Inputs<T>, out: &[f64], lse: &[f64]) -> [f64; 3] {
    let (d, group) = (s.head_dim, s.q_heads / s.kv_heads);
    let (q, k, v, g) = (f64s(&x.q), f64s(&x.k), f64s(&x.v), f64s(&x.dout));
    let mask = x.mask.as_ref().map(|(m, st)| (f64s(m), *st));
    let nk = s.batch * s.kv_heads * s.kv_len;
    let (mut tq, mut tk, mut tv) = (0.0f64, vec![0.0; nk * d], vec![0.0; nk * d]);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let kv = b * s.kv_heads + h / group;
            for i in 0..s.q_len {
                let r = (b * s.q_heads + h) * s.q_len + i;
                let (qi, gi) = (&q[r * d..][..d], &g[r * d..][..d]);
                let delta = dot(gi, &out[r * d..][..d]).abs();
                let mut row_q = vec![0.0; d];
                for j in 0..s.kv_len {
                    let kr = (kv * s.kv_len + j) * d;
                    let m = mask
                        .as_ref()
                        .map_or(0.0, |(m, [bs, hs, rs])| m[b * bs + h * hs + i * rs + j]);
                    let p = if lse[r] == f64::NEG_INFINITY || (s.causal && j > i) {
                        0.0
                    } else {
                        (s.scale * dot(qi, &k[kr..][..d]) + m - lse[r]).exp()
                    };
                    let ds = s.scale * p * (dot(gi, &v[kr..][..d]).abs() + delta);
                    for c in 0..d {
                        row_q[c] += ds * k[kr + c].abs();
                        tk[kr + c] += ds * qi[c].abs();
                        tv[kr + c] += p * gi[c].abs();
                    }
                }
                tq = row_q.iter().fold(tq, |a, &b| a.max(b));
            }
        }
    }
    let max = |t: &[f64]| t.iter().fold(0.0f64, |a, &b| a.max(b));
    [tq, max(&tk), max(&tv)]
}

/// Random attention problems of every kind the Hopper forward and backward
/// take (and some they refuse) against the f64 reference.
#[test]
fn attention() {
    sweep("attention", ATTENTION_CASES, draw_attn, run_attn);
}
