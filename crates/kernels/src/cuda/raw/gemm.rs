//! Launch wrappers for `cuda/gemm.cu`: the batched product
//! `C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b]`.
//!
//! bf16 and f16 inputs run on tensor cores with f32 accumulation and write
//! their own type or f32; f32 inputs run on the SIMT cores in exact f32 (no
//! TF32). The operand layouts follow the CPU [`GemmShape`]: `A[b]` is `[m, k]`
//! row-major, or stored `[k, m]` when `trans_a`; `B[b]` is `[k, n]`, or stored
//! `[n, k]` when `trans_b`; a batch stride of 0 broadcasts one matrix over the
//! batch. On top of that, [`GemmProblem`] carries leading dimensions (row
//! strides), the layout of C and the `alpha`/`beta` scales.
//!
//! The tensor-core kernels come in a 16-byte vectorized form (`cp.async`
//! pipeline) and an element-wise form for operands whose rows are not
//! 16-byte aligned ([`GemmProblem::is_vectorizable`]); [`GemmProblem::plan`]
//! picks between them, so any sizes and strides work.
//!
//! These `mma.sync` kernels run on every GPU and take every problem. Where
//! kernels are compiled for `sm_90a` (Hopper), tpar's GEMM
//! (`ops::gemm::ours`) runs the wgmma kernel of [`super::gemm_hopper`]
//! instead for the problems it takes (16-bit inputs, operands a tensor map
//! can describe); [`super::gemm_hopper`] says which.
//!
//! Kernel names: `tpar_gemm_<layout>_<tile>_<in>[_f32out]` (vectorized tensor
//! cores; layout `nn`, `nt`, `tn`, `tt`, first letter A; tile `128x128` or
//! `64x64`), `tpar_gemm_scalar_<in>[_f32out]` (element-wise tensor cores) and
//! `tpar_gemm_<tile>_f32`; the last two read the layout from
//! [`GemmArgs::trans`].

use bytemuck::{Pod, Zeroable};

use super::super::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use super::bad;
use crate::gemm::GemmShape;
use crate::Result;

const OP: &str = "cuda gemm";

/// The largest `m`, `n` or `k` the kernels take (their tile arithmetic is in
/// `i32` and rounds sizes up to a whole tile).
pub const MAX_DIM: usize = i32::MAX as usize - 256;

/// The largest batch (the grid's z extent).
pub const MAX_BATCH: usize = 65_535;

/// Streaming multiprocessors of the GPUs the default tile choice is tuned for
/// (H100 / H200 SXM).
const TARGET_SMS: usize = 132;

/// The argument struct of every `tpar_gemm_*` kernel (`GemmArgs` in `gemm.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct GemmArgs {
    /// A (`dtype_in`), batch 0.
    pub a: DevPtr,
    /// B (`dtype_in`), batch 0.
    pub b: DevPtr,
    /// C (`dtype_out`), batch 0.
    pub c: DevPtr,
    /// Elements between consecutive batches of A (0 = broadcast).
    pub batch_stride_a: i64,
    /// Elements between consecutive batches of B (0 = broadcast).
    pub batch_stride_b: i64,
    /// Elements between consecutive batches of C.
    pub batch_stride_c: i64,
    /// Rows of op(A) and C.
    pub m: i32,
    /// Columns of op(B) and C.
    pub n: i32,
    /// The contracted dimension.
    pub k: i32,
    /// Row stride of A as stored, in elements.
    pub lda: i32,
    /// Row stride of B as stored, in elements.
    pub ldb: i32,
    /// Row stride of C, in elements.
    pub ldc: i32,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the old C (0 = C is not read).
    pub beta: f32,
    /// Layout bits: 1 = A stored `[k, m]`, 2 = B stored `[n, k]`. Read by
    /// the kernels whose names carry no layout (`scalar`, f32).
    pub trans: i32,
    /// Padding (0).
    pub pad: i32,
}

/// The block tile of C one kernel block computes.
///
/// [`GemmProblem::default_tile`] picks one with a simple rule; benchmarks can
/// sweep [`GemmTile::ALL`] through [`gemm_with_tile`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmTile {
    /// 128 x 128: 8 warps of 64 x 32 on tensor cores (3-stage pipeline), or
    /// 8 x 8 outputs per thread for f32. For large products.
    T128x128,
    /// 64 x 64: 4 warps of 32 x 32 on tensor cores (4-stage pipeline), or
    /// 4 x 4 outputs per thread for f32. For small and skinny products, which
    /// the large tile leaves with too few blocks to fill the GPU.
    T64x64,
}

impl GemmTile {
    /// Every tile, largest first.
    pub const ALL: [GemmTile; 2] = [GemmTile::T128x128, GemmTile::T64x64];

    /// Rows and columns of C per block.
    pub fn dims(self) -> (usize, usize) {
        match self {
            GemmTile::T128x128 => (128, 128),
            GemmTile::T64x64 => (64, 64),
        }
    }

    /// The tile as it appears in kernel names (`"128x128"`).
    pub fn name(self) -> &'static str {
        match self {
            GemmTile::T128x128 => "128x128",
            GemmTile::T64x64 => "64x64",
        }
    }
}

/// One batched product to run on a [`Launcher`]: shapes, layouts, element
/// types and scales; the device addresses come with the call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmProblem {
    /// Batch, sizes, transposes and the A / B batch strides (in elements).
    pub shape: GemmShape,
    /// Element type of A and B: `BF16`, `F16` or `F32`.
    pub dtype_in: CudaDType,
    /// Element type of C: `dtype_in`, or `F32` for 16-bit inputs.
    pub dtype_out: CudaDType,
    /// Row stride of A as stored (`m` or more when `trans_a`, else `k` or more).
    pub lda: usize,
    /// Row stride of B as stored (`k` or more when `trans_b`, else `n` or more).
    pub ldb: usize,
    /// Row stride of C (`n` or more).
    pub ldc: usize,
    /// Elements between consecutive batches of C; batches must not overlap.
    pub c_batch_stride: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the old C; with 0, C is write-only (not read at all).
    pub beta: f32,
}

/// A resolved launch: kernel, grid and argument struct.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmLaunch {
    /// Kernel name (`tpar_gemm_nt_128x128_bf16_f32out`, ...).
    pub kernel: String,
    /// Grid (1-D over tiles, z over the batch), block and shared memory.
    pub cfg: LaunchConfig,
    /// The argument struct.
    pub args: GemmArgs,
    /// Whether the 16-byte `cp.async` kernel runs (else the element-wise
    /// tensor-core kernel, or the f32 kernel).
    pub vectorized: bool,
}

/// Checks `v <= max` and converts it for the argument struct.
fn fit_i32(what: &str, v: usize, max: usize) -> Result<i32> {
    if v > max {
        return Err(bad(OP, format!("{what} = {v} exceeds {max}")));
    }
    i32::try_from(v).map_err(|_| bad(OP, format!("{what} = {v} does not fit i32")))
}

fn fit_i64(what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| bad(OP, format!("{what} = {v} does not fit i64")))
}

impl GemmProblem {
    /// A problem on densely stored operands: leading dimensions equal to the
    /// stored row lengths, C contiguous `[batch, m, n]`, `alpha = 1`, `beta = 0`.
    pub fn new(shape: GemmShape, dtype_in: CudaDType, dtype_out: CudaDType) -> Self {
        GemmProblem {
            shape,
            dtype_in,
            dtype_out,
            lda: if shape.trans_a { shape.m } else { shape.k },
            ldb: if shape.trans_b { shape.k } else { shape.n },
            ldc: shape.n,
            c_batch_stride: shape.m.saturating_mul(shape.n),
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// The same problem computing `alpha * op(A) * op(B) + beta * C`.
    pub fn with_scale(mut self, alpha: f32, beta: f32) -> Self {
        self.alpha = alpha;
        self.beta = beta;
        self
    }

    /// The same problem with explicit row strides of A, B and C.
    pub fn with_leading_dims(mut self, lda: usize, ldb: usize, ldc: usize) -> Self {
        self.lda = lda;
        self.ldb = ldb;
        self.ldc = ldc;
        self
    }

    /// The same problem with batch `b` of C starting at `b * stride`.
    pub fn with_c_batch_stride(mut self, stride: usize) -> Self {
        self.c_batch_stride = stride;
        self
    }

    /// Element count one operand spans: `(batch-1)*stride + (rows-1)*ld + cols`.
    fn extent(
        &self,
        what: &str,
        rows: usize,
        cols: usize,
        ld: usize,
        stride: usize,
    ) -> Result<usize> {
        let s = &self.shape;
        (s.batch - 1)
            .checked_mul(stride)
            .and_then(|x| x.checked_add((rows - 1).checked_mul(ld)?))
            .and_then(|x| x.checked_add(cols))
            .filter(|&x| i64::try_from(x).is_ok())
            .ok_or_else(|| bad(OP, format!("{what} spans more elements than fit i64 ({self:?})")))
    }

    /// Checks everything that does not depend on the addresses: supported
    /// types, non-zero sizes within the kernels' limits, leading dimensions at
    /// least the stored row lengths, non-overlapping C batches.
    pub fn validate(&self) -> Result<()> {
        use CudaDType::*;
        let s = &self.shape;
        match (self.dtype_in, self.dtype_out) {
            (BF16, BF16 | F32) | (F16, F16 | F32) | (F32, F32) => {}
            (i, o) => {
                return Err(bad(
                    OP,
                    format!("no kernel takes {i:?} inputs to {o:?} output (16-bit inputs write their own type or F32; F32 writes F32)"),
                ))
            }
        }
        if s.batch == 0 || s.m == 0 || s.n == 0 || s.k == 0 {
            return Err(bad(
                OP,
                format!("zero-sized product (batch {}, m {}, n {}, k {})", s.batch, s.m, s.n, s.k),
            ));
        }
        if s.batch > MAX_BATCH {
            return Err(bad(OP, format!("batch {} exceeds {MAX_BATCH}", s.batch)));
        }
        for (what, v) in [("m", s.m), ("n", s.n), ("k", s.k)] {
            fit_i32(what, v, MAX_DIM)?;
        }
        let (a_rows, a_cols) = if s.trans_a { (s.k, s.m) } else { (s.m, s.k) };
        let (b_rows, b_cols) = if s.trans_b { (s.n, s.k) } else { (s.k, s.n) };
        for (what, ld, need) in
            [("lda", self.lda, a_cols), ("ldb", self.ldb, b_cols), ("ldc", self.ldc, s.n)]
        {
            if ld < need {
                return Err(bad(OP, format!("{what} = {ld} is less than the row length {need}")));
            }
            fit_i32(what, ld, i32::MAX as usize)?;
        }
        self.extent("A", a_rows, a_cols, self.lda, s.a_batch_stride)?;
        self.extent("B", b_rows, b_cols, self.ldb, s.b_batch_stride)?;
        let c_span = self.extent("C batch", s.m, s.n, self.ldc, 0)?;
        if s.batch > 1 && self.c_batch_stride < c_span {
            return Err(bad(
                OP,
                format!(
                    "C batch stride {} is less than one batch of C ({c_span} elements): batches would overlap",
                    self.c_batch_stride
                ),
            ));
        }
        self.extent("C", s.m, s.n, self.ldc, self.c_batch_stride)?;
        for (what, v) in [
            ("A batch stride", s.a_batch_stride),
            ("B batch stride", s.b_batch_stride),
            ("C batch stride", self.c_batch_stride),
        ] {
            fit_i64(what, v)?;
        }
        Ok(())
    }

    /// Elements of A, B and C the problem reaches, each counted from its
    /// operand's first element (after [`GemmProblem::validate`]).
    pub fn extents(&self) -> Result<[usize; 3]> {
        self.validate()?;
        let s = &self.shape;
        let (a_rows, a_cols) = if s.trans_a { (s.k, s.m) } else { (s.m, s.k) };
        let (b_rows, b_cols) = if s.trans_b { (s.n, s.k) } else { (s.k, s.n) };
        Ok([
            self.extent("A", a_rows, a_cols, self.lda, s.a_batch_stride)?,
            self.extent("B", b_rows, b_cols, self.ldb, s.b_batch_stride)?,
            self.extent("C", s.m, s.n, self.ldc, self.c_batch_stride)?,
        ])
    }

    /// The tile [`gemm()`] uses: 128 x 128 when that still gives at least one
    /// block per SM of an H100/H200 (132), else 64 x 64.
    ///
    /// A placeholder rule: to be replaced by a table measured on the GPU
    /// (sweep [`GemmTile::ALL`] with [`gemm_with_tile`]).
    pub fn default_tile(&self) -> GemmTile {
        let s = &self.shape;
        let blocks = s.m.div_ceil(128).saturating_mul(s.n.div_ceil(128)).saturating_mul(s.batch);
        if blocks >= TARGET_SMS {
            GemmTile::T128x128
        } else {
            GemmTile::T64x64
        }
    }

    /// Whether the 16-byte `cp.async` tensor-core kernels can load the
    /// operands at these addresses: 16-bit inputs, A and B 16-byte aligned,
    /// and leading dimensions and (for more than one batch) batch strides
    /// multiples of 8 elements. The sizes themselves are free.
    pub fn is_vectorizable(&self, a: DevPtr, b: DevPtr) -> bool {
        let s = &self.shape;
        let strides_ok = s.batch == 1
            || (s.a_batch_stride.is_multiple_of(8) && s.b_batch_stride.is_multiple_of(8));
        self.dtype_in.size() == 2
            && a.is_multiple_of(16)
            && b.is_multiple_of(16)
            && self.lda.is_multiple_of(8)
            && self.ldb.is_multiple_of(8)
            && strides_ok
    }

    /// Validates the problem and the addresses (non-null, aligned to their
    /// element type) and resolves the launch with tile `tile`. Operands the
    /// vectorized kernels cannot load run on the element-wise tensor-core
    /// kernel, whose tile is always 64 x 64.
    pub fn plan(&self, tile: GemmTile, a: DevPtr, b: DevPtr, c: DevPtr) -> Result<GemmLaunch> {
        self.validate()?;
        let s = &self.shape;
        let (isz, osz) = (self.dtype_in.size() as u64, self.dtype_out.size() as u64);
        for (what, p, align) in [("A", a, isz), ("B", b, isz), ("C", c, osz)] {
            if p == 0 || p % align != 0 {
                return Err(bad(
                    OP,
                    format!("{what} address {p:#x} is null or not aligned to {align} bytes"),
                ));
            }
        }
        let layout = match (s.trans_a, s.trans_b) {
            (false, false) => "nn",
            (false, true) => "nt",
            (true, false) => "tn",
            (true, true) => "tt",
        };
        let out = match (self.dtype_in, self.dtype_out) {
            (i, o) if i == o => "",
            _ => "_f32out",
        };
        let vectorized = self.is_vectorizable(a, b);
        let suffix = self.dtype_in.suffix();
        // (kernel name, C tile, threads, dynamic shared bytes)
        let (kernel, (bm, bn), threads, smem) = match self.dtype_in {
            CudaDType::F32 => {
                let (bm, bn) = tile.dims();
                // two [8][bm + 4] and two [8][bn + 4] f32 slices
                let smem = 2 * 8 * (bm + 4 + bn + 4) * 4;
                (format!("tpar_gemm_{}_f32", tile.name()), (bm, bn), 256, smem)
            }
            _ if !vectorized => {
                let smem = 2 * (64 + 64) * 32 * 2;
                (format!("tpar_gemm_scalar_{suffix}{out}"), (64, 64), 128, smem)
            }
            _ => {
                let (threads, stages) = match tile {
                    GemmTile::T128x128 => (256, 3),
                    GemmTile::T64x64 => (128, 4),
                };
                let (bm, bn) = tile.dims();
                let name = format!("tpar_gemm_{layout}_{}_{suffix}{out}", tile.name());
                (name, (bm, bn), threads, stages * (bm + bn) * 32 * 2)
            }
        };
        // the kernels index tiles (and groups of 8 tile rows) in i32
        let tiles_n = s.n.div_ceil(bn);
        let tiles = s.m.div_ceil(bm).saturating_mul(tiles_n);
        if tiles > i32::MAX as usize || tiles_n > i32::MAX as usize / 8 {
            return Err(bad(OP, format!("{} x {} has too many {bm}x{bn} tiles", s.m, s.n)));
        }
        let cfg =
            LaunchConfig::grid([tiles as u32, 1, s.batch as u32], threads).with_shared(smem as u32);
        let args = GemmArgs {
            a,
            b,
            c,
            batch_stride_a: fit_i64("A batch stride", s.a_batch_stride)?,
            batch_stride_b: fit_i64("B batch stride", s.b_batch_stride)?,
            batch_stride_c: fit_i64("C batch stride", self.c_batch_stride)?,
            m: fit_i32("m", s.m, MAX_DIM)?,
            n: fit_i32("n", s.n, MAX_DIM)?,
            k: fit_i32("k", s.k, MAX_DIM)?,
            lda: fit_i32("lda", self.lda, i32::MAX as usize)?,
            ldb: fit_i32("ldb", self.ldb, i32::MAX as usize)?,
            ldc: fit_i32("ldc", self.ldc, i32::MAX as usize)?,
            alpha: self.alpha,
            beta: self.beta,
            trans: i32::from(s.trans_a) | (i32::from(s.trans_b) << 1),
            pad: 0,
        };
        Ok(GemmLaunch { kernel, cfg, args, vectorized })
    }
}

/// Runs `p` on `l` with the tile of [`GemmProblem::default_tile`].
///
/// # Safety
/// `a`, `b` and `c` must be device addresses (host addresses in the
/// emulator) of buffers covering every element the problem's sizes, leading
/// dimensions and batch strides reach, in `p.dtype_in` (A, B) and
/// `p.dtype_out` (C); C must not overlap A or B.
pub unsafe fn gemm(
    l: &dyn Launcher,
    p: &GemmProblem,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { gemm_with_tile(l, p, p.default_tile(), a, b, c) }
}

/// Runs `p` on `l` with an explicit tile (for benchmarks and tuning).
///
/// # Safety
/// As for [`gemm()`].
pub unsafe fn gemm_with_tile(
    l: &dyn Launcher,
    p: &GemmProblem,
    tile: GemmTile,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<()> {
    let plan = p.plan(tile, a, b, c)?;
    // SAFETY: the caller guarantees the buffers cover what `p` describes, and
    // `plan` checked that the sizes fit the kernel's argument types.
    unsafe { launch(l, &plan.kernel, plan.cfg, &plan.args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(dt_in: CudaDType, dt_out: CudaDType, m: usize, n: usize, k: usize) -> GemmProblem {
        GemmProblem::new(GemmShape::new(1, m, n, k), dt_in, dt_out)
    }

    #[test]
    fn args_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<GemmArgs>(), 88);
    }

    #[test]
    fn plans_name_kernels_and_grids() {
        let p = problem(CudaDType::BF16, CudaDType::F32, 300, 200, 64);
        let l = p.plan(GemmTile::T128x128, 4096, 8192, 16384).unwrap();
        assert_eq!(l.kernel, "tpar_gemm_nn_128x128_bf16_f32out");
        assert_eq!(l.cfg.grid, [3 * 2, 1, 1]);
        assert_eq!(l.cfg.block, [256, 1, 1]);
        assert_eq!(l.cfg.shared_bytes, 49152);
        assert!(l.vectorized);
        // an odd k leaves the rows of A unaligned (lda = k)
        let p = problem(CudaDType::F16, CudaDType::F16, 64, 64, 37);
        let l = p.plan(GemmTile::T128x128, 4096, 8192, 16384).unwrap();
        assert_eq!(l.kernel, "tpar_gemm_scalar_f16");
        assert!(!l.vectorized);
        let p = problem(CudaDType::F32, CudaDType::F32, 65, 64, 8);
        let l = p.plan(GemmTile::T64x64, 4096, 8192, 16384).unwrap();
        assert_eq!(l.kernel, "tpar_gemm_64x64_f32");
        assert_eq!(l.cfg.grid, [2, 1, 1]);
        // batches on z; the default tile grows with the grid
        let p =
            GemmProblem::new(GemmShape::new(3, 2048, 2048, 64), CudaDType::BF16, CudaDType::BF16);
        assert_eq!(p.default_tile(), GemmTile::T128x128);
        let l = p.plan(p.default_tile(), 4096, 8192, 16384).unwrap();
        assert_eq!(l.cfg.grid, [16 * 16, 1, 3]);
        assert_eq!(
            problem(CudaDType::BF16, CudaDType::BF16, 512, 512, 512).default_tile(),
            GemmTile::T64x64
        );
    }

    #[test]
    fn rejects_bad_problems() {
        use CudaDType::*;
        for (i, o) in [(BF16, F16), (F16, BF16), (F32, BF16), (F32, F16)] {
            assert!(problem(i, o, 8, 8, 8).validate().is_err());
        }
        assert!(problem(BF16, BF16, 0, 8, 8).validate().is_err());
        assert!(problem(BF16, BF16, 8, 8, 0).validate().is_err());
        assert!(problem(BF16, BF16, MAX_DIM + 1, 8, 8).validate().is_err());
        assert!(problem(BF16, BF16, 8, 8, 8).with_leading_dims(4, 8, 8).validate().is_err());
        let p = GemmProblem::new(GemmShape::new(2, 8, 8, 8), F32, F32).with_c_batch_stride(0);
        assert!(p.validate().is_err());
        assert!(problem(BF16, BF16, 8, 8, 8).plan(GemmTile::T64x64, 0, 16, 16).is_err());
        assert!(problem(F32, F32, 8, 8, 8).plan(GemmTile::T64x64, 16, 18, 16).is_err());
    }
}
