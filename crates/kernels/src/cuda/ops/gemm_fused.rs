//! The GEMM with a fused epilogue over device buffers:
//! `C[b] = epilogue(alpha * op(A[b]) * op(B[b]) + beta * C[b])`, the epilogue
//! a per-column bias, then a residual matrix, SiLU of a gate matrix times
//! the product, or the rotary position embedding of C's first columns
//! ([`FusedEpilogue`], [`FusedRope`]: the q and k heads of a packed qkv
//! projection rotated where the GEMM writes them).
//!
//! [`gemm_fused`] runs the Hopper kernel with the epilogue fused
//! ([`crate::cuda::raw::gemm_hopper`]) where the device runs `sm_90a`
//! kernels ([`HopperTarget::of`]), the kernel takes the problem
//! ([`unsupported`]) and the GEMM backend ([`super::gemm::gemm_backend`])
//! would run tpar's kernel; everywhere else (GPUs before Hopper, the
//! emulator without `TPAR_EMU_ARCH=sm_90a`, f32 inputs, A or B not 16-byte
//! aligned, leading dimensions or batch strides of A and B that are not
//! multiples of 8, and where `TPAR_GEMM` picks the vendor library) it runs
//! the plain GEMM ([`super::gemm::gemm`], so the backend choice applies) and
//! then the elementwise device ops that compute the same epilogue.
//!
//! On a GPU the backend picks the vendor library for `TPAR_GEMM=cublaslt`
//! and `check`, and for `auto` (the default) unless the tuning table of
//! `TPAR_GEMM_TABLE` prefers tpar's kernel for the problem; so with neither
//! `TPAR_GEMM=ours` nor such a table, [`gemm_fused`] runs the unfused path
//! there. The emulator has no vendor library. [`gemm_fused_via`] chooses
//! the path explicitly.
//!
//! The two paths round at different points. Fused, the product, the bias and
//! the epilogue matrix are combined in f32 and rounded once, to C's dtype,
//! at the end. Unfused, C is rounded to its dtype after the GEMM, again after
//! the bias add, and again after the residual add or `silu(gate) * v` (each
//! of which computes in f32). For an f32 C the two agree to f32 rounding;
//! for bf16 or f16 they differ by up to a few units in the last place of
//! the output's dtype.
//!
//! The rotary embedding ([`FusedRope`]) runs, fused, in the Hopper kernel's
//! epilogue after the bias, on the f32 values, rounded once to C's dtype;
//! unfused, as [`super::rope::rope_strided`]'s kernel in place on C's first
//! `cols` columns after the GEMM and the bias (C rounded after the GEMM,
//! after the bias add and again after the rotation, which computes in f32
//! from the rounded values). For an f32 C the paths agree to f32 rounding;
//! for bf16 or f16 by a few units in the last place. It combines with a bias,
//! not with a residual or gate matrix (an error on both paths). Rows need not
//! fill whole sequences: row `row` of a batch has position `row % seq` on
//! both paths. Fused, the head dim must divide the epilogue's chunk width
//! ([`HopperConfig::epilogue_cols`]: 128 columns at tile width 128, 64 at
//! 256): where the configuration picked for the problem has a chunk the head
//! dim does not divide, the kernel runs at tile width 128; a head dim that
//! does not divide 128 either runs unfused on [`EpiloguePath::Auto`] and is
//! an error on [`EpiloguePath::Fused`].
//!
//! The fused path launches the Hopper kernel in the configuration
//! [`super::gemm::hopper_config`] picks for the problem (as the plain GEMM
//! does): `TPAR_GEMM_TILE_N` / `TPAR_GEMM_CLUSTER` where set, else the
//! tuning table's, else the default.

use super::gemm::{hopper_config, operands, vendor_first};
use super::{pitched, Check};
use crate::cuda::raw::elementwise as ew;
use crate::cuda::raw::gemm::GemmProblem;
pub use crate::cuda::raw::gemm_hopper::AuxOp;
use crate::cuda::raw::gemm_hopper::{
    self, unsupported, AuxInput, Epilogue, HopperConfig, HopperTarget, RopeEpilogue,
};
use crate::cuda::raw::layout::{self, Block2d};
use crate::cuda::raw::rope::{self as raw_rope, RopeShape, RopeStrides};
use crate::cuda::{DevPtr, DeviceBuffer, DeviceSlice, DeviceSliceMut, GpuDevice, MemorySpace};
use crate::elementwise::BinaryOp;
use crate::util::bad;
use crate::Result;

const OP: &str = "cuda gemm_fused";

/// A matrix the epilogue reads: per batch `m` rows of `n` elements of C's
/// dtype, `ld` apart, batches `batch_stride` apart (any value for one batch).
#[derive(Clone, Copy, Debug)]
pub struct FusedAux<'a> {
    /// The matrix, starting at batch 0.
    pub view: DeviceSlice<'a>,
    /// Row stride in elements (`n` or more).
    pub ld: usize,
    /// Elements between consecutive batches.
    pub batch_stride: usize,
    /// How it is combined with the product.
    pub op: AuxOp,
}

/// The rotary position embedding (rotate-half form, as
/// [`super::rope::rope_forward`]) of C's columns `0..cols`, heads of
/// `head_dim` columns: with `v1`, `v2` the values of columns `c` and
/// `c + head_dim / 2` of a head (`c` in its first half, `j` its offset
/// there, `h = head_dim / 2`) in row `row` of a batch, and `t = row % seq`
/// its position, they become `(v1 cos[t, j] - v2 sin[t, j],
/// v2 cos[t, j + h] + v1 sin[t, j + h])`. For a packed
/// `[rows, (hq + 2 hkv) * head_dim]` qkv projection of `rows = batch * seq`
/// tokens, `cols = (hq + hkv) * head_dim` rotates q and k and leaves v.
#[derive(Clone, Copy, Debug)]
pub struct FusedRope<'a> {
    /// The cosines: at least `seq * head_dim` elements of C's dtype, read as
    /// a `[>= seq, head_dim]` table.
    pub cos: DeviceSlice<'a>,
    /// The sines, like `cos`.
    pub sin: DeviceSlice<'a>,
    /// Columns per head (even and positive).
    pub head_dim: usize,
    /// Columns `0..cols` are rotated: a multiple of `head_dim`, at most `n`.
    pub cols: usize,
    /// Positions per sequence (positive): row `row` of a batch of C has
    /// position `row % seq`.
    pub seq: usize,
}

/// The steps after `v = alpha * op(A) op(B) + beta * C`, in this order:
/// `v += bias[col]`, then the [`FusedAux`] (`v + aux` or `silu(aux) * v`) or
/// the [`FusedRope`] (not both). The default is none (a plain GEMM).
#[derive(Clone, Copy, Debug, Default)]
pub struct FusedEpilogue<'a> {
    /// A per-column bias: `n` elements of C's dtype.
    pub bias: Option<DeviceSlice<'a>>,
    /// A residual or gate matrix.
    pub aux: Option<FusedAux<'a>>,
    /// A rotary embedding of C's first `cols` columns.
    pub rope: Option<FusedRope<'a>>,
}

/// How [`gemm_fused_via`] computes the epilogue (and, as its result, how it
/// did).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpiloguePath {
    /// [`EpiloguePath::Fused`] where [`gemm_fused`]'s conditions hold,
    /// [`EpiloguePath::Unfused`] elsewhere.
    Auto,
    /// The Hopper kernel with the epilogue fused: on a GPU running `sm_90a`
    /// kernels, or on the emulator (as an H100, whatever `TPAR_EMU_ARCH`
    /// says); a device or problem the kernel does not take is an error.
    Fused,
    /// The plain GEMM, then the elementwise ops.
    Unfused,
}

/// Runs `p` with the epilogue `epi` on the path of [`EpiloguePath::Auto`]:
/// A and B read from `a` and `b` (`p.dtype_in`), C written (and read when
/// `beta != 0`) in `c` (`p.dtype_out`), the bias and epilogue matrix read in
/// `p.dtype_out`; every view is checked (device, extent, alignment) before
/// anything runs. Returns the path that ran.
///
/// ```
/// use std::sync::Arc;
/// use tpar_kernels::cuda::emu::EmulatedGpu;
/// use tpar_kernels::cuda::ops::gemm::GemmProblem;
/// use tpar_kernels::cuda::ops::gemm_fused::{gemm_fused, AuxOp, FusedAux, FusedEpilogue};
/// use tpar_kernels::cuda::{CudaDType, DeviceBuffer, GpuDevice};
/// use tpar_kernels::gemm::GemmShape;
/// let dev: Arc<dyn GpuDevice> = EmulatedGpu::open(0)?;
/// // C [2, 3] = A [2, 4] B [4, 3] + bias + residual, in f32
/// let p = GemmProblem::new(GemmShape::new(1, 2, 3, 4), CudaDType::F32, CudaDType::F32);
/// let a = DeviceBuffer::from_host(&dev, &[1.0f32, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])?;
/// let b = DeviceBuffer::from_host(&dev, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])?;
/// let bias = DeviceBuffer::from_host(&dev, &[10.0f32, 20.0, 30.0])?;
/// let res = DeviceBuffer::from_host(&dev, &[0.5f32; 6])?;
/// let mut c = DeviceBuffer::zeros(&dev, 6 * 4)?;
/// let aux = FusedAux { view: res.as_slice(), ld: 3, batch_stride: 6, op: AuxOp::Residual };
/// let epi = FusedEpilogue { bias: Some(bias.as_slice()), aux: Some(aux), rope: None };
/// gemm_fused(&*dev, &p, epi, a.as_slice(), b.as_slice(), c.as_slice_mut())?;
/// let mut host = [0.0f32; 6];
/// c.as_slice().copy_to_host(&mut host)?;
/// assert_eq!(host, [11.5, 22.5, 33.5, 14.5, 25.5, 36.5]);
/// // A bias shorter than n: an error, and nothing runs.
/// let short = FusedEpilogue { bias: Some(bias.slice(0..8)?), ..FusedEpilogue::default() };
/// assert!(gemm_fused(&*dev, &p, short, a.as_slice(), b.as_slice(), c.as_slice_mut()).is_err());
/// # Ok::<(), tpar_kernels::KernelError>(())
/// ```
pub fn gemm_fused(
    dev: &dyn GpuDevice,
    p: &GemmProblem,
    epi: FusedEpilogue<'_>,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    c: DeviceSliceMut<'_>,
) -> Result<EpiloguePath> {
    gemm_fused_via(dev, EpiloguePath::Auto, p, epi, a, b, c)
}

/// [`gemm_fused`] on the path `path` asks for; returns the path that ran
/// ([`EpiloguePath::Fused`] or [`EpiloguePath::Unfused`]).
pub fn gemm_fused_via(
    dev: &dyn GpuDevice,
    path: EpiloguePath,
    p: &GemmProblem,
    epi: FusedEpilogue<'_>,
    a: DeviceSlice<'_>,
    b: DeviceSlice<'_>,
    mut c: DeviceSliceMut<'_>,
) -> Result<EpiloguePath> {
    let [ap, bp, cp] = operands(dev, p, &a, &b, &c)?;
    let raw_epi = epilogue(dev, p, &epi)?;
    let target = match path {
        EpiloguePath::Unfused => None,
        EpiloguePath::Auto => HopperTarget::of(dev).filter(|_| {
            unsupported(p, ap, bp).is_none()
                && !vendor_picked(dev, p)
                && rope_config(&raw_epi, HopperConfig::default()).is_ok()
        }),
        EpiloguePath::Fused => {
            let t = HopperTarget::of(dev).or_else(|| {
                (dev.memory_space() == MemorySpace::Host).then(|| HopperTarget::emulator(132))
            });
            let Some(t) = t else {
                return Err(bad(
                    OP,
                    format!(
                        "the fused epilogue needs sm_90a kernels; {} does not run them",
                        dev.describe()
                    ),
                ));
            };
            if let Some(why) = unsupported(p, ap, bp) {
                return Err(bad(
                    OP,
                    format!("the Hopper kernel does not take this problem: {why}"),
                ));
            }
            Some(t)
        }
    };
    if let Some(t) = target {
        let cfg = rope_config(&raw_epi, hopper_config(dev, p)?)?;
        // SAFETY: `operands` and `epilogue` checked that A, B, C, the bias and
        // the matrix are live buffers in `dev`'s memory covering every element
        // the problem reaches, in their dtypes; `c` is an exclusive borrow, so
        // C overlaps none of the views read.
        unsafe { gemm_hopper::gemm_with(dev, t, cfg, p, &raw_epi, ap, bp, cp)? };
        return Ok(EpiloguePath::Fused);
    }
    super::gemm::gemm(dev, p, a, b, c.reborrow())?;
    unfused(dev, p, &raw_epi, &c)?;
    if let Some(r) = raw_epi.rope {
        unfused_rope(dev, p, &r, &c)?;
    }
    Ok(EpiloguePath::Unfused)
}

/// `cfg`, or where a rotary embedding's head dim does not divide its
/// epilogue chunk, `cfg` at tile width 128 (whose chunk is the widest);
/// an error naming the head dim when that chunk is not a multiple either.
fn rope_config(epi: &Epilogue, cfg: HopperConfig) -> Result<HopperConfig> {
    let Some(r) = epi.rope else { return Ok(cfg) };
    let fits = |c: HopperConfig| (c.epilogue_cols() as usize).is_multiple_of(r.head_dim);
    if fits(cfg) {
        return Ok(cfg);
    }
    let wide = cfg.with_tile_n(128)?;
    if fits(wide) {
        return Ok(wide);
    }
    Err(bad(
        OP,
        format!(
            "the fused rotary embedding needs a head dim that divides {} columns, not {}",
            wide.epilogue_cols(),
            r.head_dim
        ),
    ))
}

/// Whether [`super::gemm::gemm`] would hand `p` to the device's vendor
/// library (the emulator has none).
fn vendor_picked(dev: &dyn GpuDevice, p: &GemmProblem) -> bool {
    dev.memory_space() != MemorySpace::Host && vendor_first(dev, p)
}

/// The epilogue's addresses, after checking each view against `p`.
fn epilogue(dev: &dyn GpuDevice, p: &GemmProblem, epi: &FusedEpilogue<'_>) -> Result<Epilogue> {
    let ch = Check::new(OP, dev);
    let s = &p.shape;
    let es = p.dtype_out.size();
    let bias = epi.bias.as_ref().map(|v| ch.read("bias", v, s.n, es)).transpose()?;
    let aux = match &epi.aux {
        None => None,
        Some(x) => {
            if x.ld < s.n {
                return Err(bad(
                    OP,
                    format!("epilogue matrix ld {} is less than n = {}", x.ld, s.n),
                ));
            }
            let one = pitched(OP, s.m, s.n, x.ld)?;
            let need = if s.batch > 1 && one > 0 {
                (s.batch - 1)
                    .checked_mul(x.batch_stride)
                    .and_then(|v| v.checked_add(one))
                    .ok_or_else(|| {
                        bad(
                            OP,
                            format!("epilogue matrix batch stride {} overflows", x.batch_stride),
                        )
                    })?
            } else {
                one
            };
            let ptr = ch.read("epilogue matrix", &x.view, need, es)?;
            Some(AuxInput { ptr, ld: x.ld, batch_stride: x.batch_stride, op: x.op })
        }
    };
    let rope = match &epi.rope {
        None => None,
        Some(r) => Some(rope_epilogue(&ch, p, r, aux.is_some())?),
    };
    Ok(Epilogue { bias, aux, rope })
}

/// The checks of a [`FusedRope`] both paths share (the head dim, the
/// columns, the sequence length, no epilogue matrix, the tables' views),
/// and its addresses.
fn rope_epilogue(
    ch: &Check<'_>,
    p: &GemmProblem,
    r: &FusedRope<'_>,
    with_aux: bool,
) -> Result<RopeEpilogue> {
    let hd = r.head_dim;
    if let Some(why) = RopeEpilogue::unfit((hd, r.cols, r.seq), p.shape.n, with_aux) {
        return Err(bad(OP, why));
    }
    let table = r
        .seq
        .checked_mul(hd)
        .ok_or_else(|| bad(OP, format!("rotary table of {} x {hd} elements overflows", r.seq)))?;
    let es = p.dtype_out.size();
    let cos = ch.read("rope cos", &r.cos, table, es)?;
    let sin = ch.read("rope sin", &r.sin, table, es)?;
    Ok(RopeEpilogue { cos, sin, head_dim: hd, cols: r.cols, seq: r.seq })
}

/// The epilogue after the plain GEMM wrote C: each step reads the current
/// value (C itself, then a contiguous temporary), computes in f32 and
/// rounds to C's dtype; the result is copied back into C's rows.
fn unfused(
    dev: &dyn GpuDevice,
    p: &GemmProblem,
    epi: &Epilogue,
    c: &DeviceSliceMut<'_>,
) -> Result<()> {
    if epi.bias.is_none() && epi.aux.is_none() {
        return Ok(());
    }
    let s = &p.shape;
    let (dt, es) = (p.dtype_out, p.dtype_out.size());
    let total = s.batch * s.m * s.n;
    if total == 0 {
        return Ok(());
    }
    let shape = [s.batch, s.m, s.n];
    let dense = [s.m * s.n, s.n, 1];
    let batched = |stride: usize| if s.batch > 1 { stride } else { 0 };
    let c_strides = [batched(p.c_batch_stride), p.ldc, 1];
    let alloc = || DeviceBuffer::alloc(c.device(), total * es);
    // the current value: (address, strides), C's until a step writes a temporary
    let mut cur: (DevPtr, [usize; 3]) = (c.ptr(), c_strides);
    let mut temps: Vec<DeviceBuffer> = Vec::new();
    if let Some(bias) = epi.bias {
        let t = alloc()?;
        // SAFETY: C and the bias were checked by `operands` and `epilogue` to
        // cover what these strides reach over `shape`; `t` holds `total`
        // elements and overlaps neither.
        unsafe {
            ew::binary(dev, dt, BinaryOp::Add, cur.0, &cur.1, bias, &[0, 0, 1], &shape, t.ptr())?
        };
        cur = (t.ptr(), dense);
        temps.push(t);
    }
    if let Some(x) = epi.aux {
        let x_strides = [batched(x.batch_stride), x.ld, 1];
        let t = alloc()?;
        match x.op {
            AuxOp::Residual => {
                // SAFETY: as above; the matrix was checked by `epilogue`.
                unsafe {
                    ew::binary(
                        dev,
                        dt,
                        BinaryOp::Add,
                        cur.0,
                        &cur.1,
                        x.ptr,
                        &x_strides,
                        &shape,
                        t.ptr(),
                    )?
                };
            }
            AuxOp::SiluMul => {
                // SwiGLU's kernel reads gate and value densely: copy what is not
                let gate = if x_strides == dense || s.batch == 1 && x.ld == s.n {
                    x.ptr
                } else {
                    let g = alloc()?;
                    // SAFETY: the matrix covers these strides (checked); `g`
                    // holds `total` elements.
                    unsafe {
                        layout::strided_copy(dev, es, x.ptr, 0, &x_strides, &shape, g.ptr())?
                    };
                    temps.push(g);
                    temps[temps.len() - 1].ptr()
                };
                let value = if cur.1 == dense || s.batch == 1 && cur.1[1] == s.n {
                    cur.0
                } else {
                    let v = alloc()?;
                    // SAFETY: C covers these strides (checked); `v` holds
                    // `total` elements.
                    unsafe { layout::strided_copy(dev, es, cur.0, 0, &cur.1, &shape, v.ptr())? };
                    temps.push(v);
                    temps[temps.len() - 1].ptr()
                };
                // SAFETY: `gate` and `value` hold `batch * m` dense rows of
                // `n`, `t` as many; `t` overlaps neither.
                unsafe {
                    ew::swiglu_forward(dev, dt, gate, value, s.n, t.ptr(), s.batch * s.m, s.n)?
                };
            }
        }
        cur = (t.ptr(), dense);
        temps.push(t);
    }
    let blocks: Vec<Block2d> = (0..s.batch)
        .map(|i| Block2d {
            src: cur.0 + (i * s.m * s.n * es) as DevPtr,
            src_ld: s.n,
            dst: c.ptr() + (i * c_strides[0] * es) as DevPtr,
            dst_ld: p.ldc,
            rows: s.m,
            cols: s.n,
        })
        .collect();
    // SAFETY: the temporary holds `batch` dense `m x n` matrices; C covers
    // `m` rows at `ldc` per batch at its batch stride (checked by `operands`)
    // and is exclusively borrowed, disjoint from the temporary.
    unsafe { layout::copy2d_batch(dev, es, &blocks)? };
    // the temporaries live until the copies are ordered after their writes
    drop(temps);
    Ok(())
}

/// The unfused rotary embedding: rope's kernel in place on C's first
/// `cols` columns, per batch the rows that fill whole sequences in one
/// launch (`(outer, seq, inner) = (m / seq, seq, cols / head_dim)`) and the
/// rows after them (positions `0..m % seq`, the tables' first rows) in
/// another; one launch for all batches when they follow each other
/// without a gap and `m` fills whole sequences.
fn unfused_rope(
    dev: &dyn GpuDevice,
    p: &GemmProblem,
    r: &RopeEpilogue,
    c: &DeviceSliceMut<'_>,
) -> Result<()> {
    let s = &p.shape;
    let (hd, es) = (r.head_dim, p.dtype_out.size());
    let inner = r.cols / hd;
    if s.batch * s.m * inner == 0 {
        return Ok(());
    }
    let (full, rest) = (s.m / r.seq, s.m % r.seq);
    let run = |at: usize, outer: usize, seq: usize| -> Result<()> {
        let shape = RopeShape { outer, seq, inner, head_dim: hd };
        let st = RopeStrides { outer: seq * p.ldc, seq: p.ldc, inner: hd };
        let x = c.ptr() + (at * es) as DevPtr;
        // SAFETY: C covers `m` rows at `ldc` per batch at its batch stride
        // (checked by `operands`) and these rows are among them; the tables
        // hold `seq * head_dim` elements (checked by `epilogue`); C is
        // rotated in place at equal strides and is an exclusive borrow.
        unsafe {
            raw_rope::rope_strided(dev, p.dtype_out, &shape, (x, st), r.cos, r.sin, (x, st), false)
        }
    };
    if rest == 0 && (s.batch == 1 || p.c_batch_stride == s.m * p.ldc) {
        return run(0, s.batch * full, r.seq);
    }
    for b in 0..s.batch {
        let at = b * p.c_batch_stride;
        if full > 0 {
            run(at, full, r.seq)?;
        }
        if rest > 0 {
            run(at + full * r.seq * p.ldc, 1, rest)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rope_hook_picks_a_chunk_its_head_dim_divides() {
        let n256 = HopperConfig::default().with_tile_n(256).unwrap();
        let c2 = HopperConfig::with_cluster(2).unwrap().with_tile_n(256).unwrap();
        let rope = |head_dim| Epilogue {
            rope: Some(RopeEpilogue { cos: 64, sin: 128, head_dim, cols: 0, seq: 1 }),
            ..Epilogue::default()
        };
        // no rope, or a head dim the chunk holds: the configuration as given
        assert_eq!(rope_config(&Epilogue::default(), n256).unwrap(), n256);
        assert_eq!(rope_config(&rope(64), n256).unwrap(), n256);
        assert_eq!(rope_config(&rope(32), c2).unwrap(), c2);
        // 128 does not divide 64 columns: tile width 128, the cluster kept
        let wide = rope_config(&rope(128), c2).unwrap();
        assert_eq!((wide.tile_n, wide.cluster), (128, 2));
        // 96 divides neither chunk
        let e = rope_config(&rope(96), n256).unwrap_err().to_string();
        assert!(e.contains("divides 128 columns, not 96"), "{e}");
    }
}
