//! Launch wrappers for `cuda/gemm_hopper.cu`, the Hopper GEMM:
//! `C[b] = epilogue(alpha * op(A[b]) * op(B[b]) + beta * C[b])` with warpgroup
//! MMA (wgmma), bulk tensor copies (TMA) and mbarriers, for `sm_90a`.
//!
//! The problem is a [`GemmProblem`] (the layouts, leading dimensions, batch
//! strides and scales of [`super::gemm`]); A and B are bf16 or f16, C any of
//! bf16, f16 and f32 (f32 accumulation). One block of 384 threads (a producer
//! warpgroup and two consumer warpgroups) is persistent over 128 x 128 tiles
//! of C, K in steps of 64 through a 4-stage shared-memory ring, or over
//! 128 x 256 tiles through a 3-stage ring ([`HopperConfig::tile_n`]); the
//! kernel's source describes the pipeline and its shared-memory budget. [`Epilogue`] adds the fused steps a
//! transformer layer uses: a per-column bias, a residual matrix, SiLU of a
//! gate matrix times the product (SwiGLU), or the rotary position embedding
//! of the q and k heads of a packed projection ([`RopeEpilogue`]).
//!
//! Which GEMM kernel runs where: wgmma and `setmaxnreg` exist only for the
//! `sm_90a` target, so [`HopperTarget::of`] accepts a GPU handle whose kernels
//! are compiled for `sm_90a` (a compute capability 9.0 device's default, unless
//! its `CompileOptions::arch` names another target), and the emulator
//! when [`EMU_ARCH_ENV`]` = sm_90a`; everything else runs the `mma.sync`
//! kernels of [`super::gemm`] (Ampere and later), as do the problems
//! [`unsupported`] names: f32 inputs (wgmma here takes 16-bit operands), and
//! operands a tensor map cannot describe (A or B not 16-byte aligned, their
//! leading dimensions or batch strides not multiples of 8 elements).
//! Kernel names: `tpar_gemm_hopper_<layout>_<in>_<out>` (layout `nn`, `nt`,
//! `tn`, `tt`, first letter A, `t` = stored transposed), with `_n256` appended
//! for the 128 x 256 tiles.
//!
//! Clusters ([`HopperConfig::cluster`]): with 2, the kernel runs as 2 x 1 x 1
//! thread-block clusters whose two blocks take neighbouring tiles along N;
//! each loads half of their shared A tile and multicasts it to both, which
//! halves A's traffic from L2. The default is 1 (no clusters) until a GPU
//! measurement shows that 2 pays; [`CLUSTER_ENV`] overrides it for
//! measurement. Only the emulator has run the clustered kernel so far.
//!
//! Tile width ([`HopperConfig::tile_n`]): 128 (the default) or 256. At 256
//! each consumer warpgroup issues `wgmma` m64n256k16 and holds 128 f32
//! accumulators per thread, and every A tile in shared memory serves twice
//! the columns, halving A's shared-memory reads per FLOP (the lever of the
//! hand-written Hopper GEMMs that reach cuBLAS's speed); the ring has 3
//! stages instead of 4 and the epilogue stages 64 columns at a time so that
//! the block fits in 227 KiB. The default stays 128 until a GPU measurement
//! shows that 256 pays (not measured on a GPU: only the emulator has run
//! either width); [`TILE_N_ENV`] overrides it for measurement.

use bytemuck::{Pod, Zeroable};

use super::super::tensor_map::{TensorMap, TensorMapDType, TensorMapSwizzle, TiledDesc};
use super::super::{launch, CudaDType, DevPtr, GpuDevice, LaunchConfig, Launcher, MemorySpace};
use super::bad;
use super::gemm::GemmProblem;
use crate::Result;

const OP: &str = "cuda gemm (hopper)";

/// Environment variable naming the architecture the CPU emulator stands in
/// for when kernels are chosen by device: `sm_90a` makes [`HopperTarget::of`]
/// accept the emulator, so [`gemm_if_supported`] runs the Hopper kernel there.
pub const EMU_ARCH_ENV: &str = "TPAR_EMU_ARCH";

/// Environment variable overriding the cluster size [`gemm()`] launches
/// with: `1` or `2` (see [`HopperConfig`]); unset or empty: the default, 1.
pub const CLUSTER_ENV: &str = "TPAR_GEMM_CLUSTER";

/// Environment variable overriding the tile width [`gemm()`] launches with:
/// `128` or `256` (see [`HopperConfig::tile_n`]); unset or empty: the
/// default, 128.
pub const TILE_N_ENV: &str = "TPAR_GEMM_TILE_N";

/// Rows and columns of C per tile at the default tile width
/// ([`HopperConfig::tile`] gives a configuration's).
pub const TILE: (usize, usize) = (128, 128);

/// Threads per block: a producer and two consumer warpgroups.
pub const THREADS: u32 = 384;

/// Dynamic shared memory per block at tile width 128: 4 stages of a 128 x 64
/// A tile and a 64 x 128 B tile (16-bit), per consumer warpgroup a 64 x 128
/// f32 staging tile and a 16-bit image of C's tile for the epilogue, the
/// mbarriers, and 1024 bytes to align the 128-byte swizzle's pattern:
/// 230,496 bytes, within the 227 KiB a Hopper block may opt in to.
pub const SHARED_BYTES: u32 = shared_bytes_for(128);

/// Dynamic shared memory per block at tile width 256: 3 stages of a 128 x 64
/// A tile and a 64 x 256 B tile, per consumer warpgroup a 64 x 64 f32
/// staging chunk and its 16-bit image, the mbarriers and the 1024 bytes of
/// alignment: 197,712 bytes.
pub const SHARED_BYTES_N256: u32 = shared_bytes_for(256);

/// The ring's stages and the epilogue's chunk width (columns) at tile width
/// `tile_n` (`Geo<BN>` in the kernel).
const fn stages_and_chunk(tile_n: u32) -> (u32, u32) {
    if tile_n == 256 {
        (3, 64)
    } else {
        (4, 128)
    }
}

/// The kernel's dynamic shared memory at tile width `tile_n`: the ring, two
/// f32 staging chunks and their 16-bit images, the mbarriers (full and
/// empty per stage, two epilogue pairs) and 1024 bytes of alignment.
const fn shared_bytes_for(tile_n: u32) -> u32 {
    let (stages, chunk) = stages_and_chunk(tile_n);
    stages * (128 * 64 * 2 + tile_n * 64 * 2)
        + 2 * 64 * chunk * 4
        + 2 * 64 * chunk * 2
        + (2 * stages + 4) * 8
        + 1024
}

/// Tile rows per group of the persistent tile order (blocks running together
/// share rows of A and columns of B).
const GROUP: i32 = 8;

/// Epilogue bits of [`GemmHopperArgs::epilogue`].
const EPI_BIAS: i32 = 1;
const EPI_RESIDUAL: i32 = 2;
const EPI_SILU_MUL: i32 = 4;
const EPI_ROPE: i32 = 8;

/// The argument struct of every `tpar_gemm_hopper_*` kernel
/// (`GemmHopperArgs` in `gemm_hopper.cu`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct GemmHopperArgs {
    /// A as stored: dims (inner, rows, batch), 128-byte swizzle.
    pub map_a: TensorMap,
    /// B as stored: dims (inner, rows, batch), 128-byte swizzle.
    pub map_b: TensorMap,
    /// C: dims (n, m, batch) (when `c_tma`); f32: box 32 x 64, 128-byte
    /// swizzle; 16-bit: box (epilogue chunk width) x 64, no swizzle.
    pub map_c: TensorMap,
    /// C, batch 0.
    pub c: DevPtr,
    /// The bias (n elements of C's type), or 0.
    pub bias: DevPtr,
    /// The residual or gate matrix (C's type), or 0.
    pub aux: DevPtr,
    /// Elements between consecutive batches of C.
    pub batch_stride_c: i64,
    /// Elements between consecutive batches of `aux`.
    pub batch_stride_aux: i64,
    /// Rows of C.
    pub m: i32,
    /// Columns of C.
    pub n: i32,
    /// The contracted dimension.
    pub k: i32,
    /// Row stride of C.
    pub ldc: i32,
    /// Row stride of `aux`.
    pub ld_aux: i32,
    /// Batches.
    pub batch: i32,
    /// 1: one A for every batch.
    pub bcast_a: i32,
    /// 1: one B for every batch.
    pub bcast_b: i32,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the old C (0: C is not read).
    pub beta: f32,
    /// Epilogue bits: 1 bias, 2 residual, 4 SiLU(aux) * v, 8 rotary embedding.
    pub epilogue: i32,
    /// 1: C is written by bulk tensor stores through `map_c`.
    pub c_tma: i32,
    /// Tile rows per group of the tile order.
    pub group: i32,
    /// Blocks per cluster along N: 1, or 2 (A multicast to both).
    pub cluster: i32,
    /// The rotary embedding's cosines (`[>= rope_seq, rope_hd]`, C's type), or 0.
    pub rope_cos: DevPtr,
    /// The rotary embedding's sines (like `rope_cos`), or 0.
    pub rope_sin: DevPtr,
    /// The rotated heads' dim (even), or 0.
    pub rope_hd: i32,
    /// Columns `0..rope_cols` are rotated, in heads of `rope_hd`.
    pub rope_cols: i32,
    /// Row `row` of a batch is position `row % rope_seq` (the tables' row).
    pub rope_seq: i32,
    /// Padding (0) to a multiple of 64 bytes.
    pub pad: [i32; 1],
}

/// How the Hopper kernel is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperConfig {
    /// Blocks per thread-block cluster: 1 (no clusters, the default), or 2
    /// (the two blocks of a cluster take neighbouring tiles along N and
    /// multicast halves of their common A tile to each other).
    pub cluster: u32,
    /// Columns of C per tile: 128 (the default; 128 x 128 tiles, a 4-stage
    /// ring) or 256 (128 x 256 tiles, `wgmma` m64n256k16, a 3-stage ring;
    /// the `_n256` kernels).
    pub tile_n: u32,
}

impl Default for HopperConfig {
    fn default() -> Self {
        HopperConfig { cluster: 1, tile_n: 128 }
    }
}

impl HopperConfig {
    /// A launch with clusters of `cluster` blocks (1 or 2, else an error)
    /// and the default tile width.
    pub fn with_cluster(cluster: u32) -> Result<HopperConfig> {
        let c = HopperConfig { cluster, ..HopperConfig::default() };
        c.check()?;
        Ok(c)
    }

    /// This configuration with `tile_n` columns of C per tile: 128 or 256,
    /// else an error naming it.
    pub fn with_tile_n(self, tile_n: u32) -> Result<HopperConfig> {
        let c = HopperConfig { tile_n, ..self };
        c.check()?;
        Ok(c)
    }

    /// The default, with the cluster size [`CLUSTER_ENV`] and the tile width
    /// [`TILE_N_ENV`] name where they are set; a value other than `1` or `2`,
    /// or `128` or `256`, is an error naming it.
    pub fn from_env() -> Result<HopperConfig> {
        let var = |name| std::env::var(name).ok();
        HopperConfig::from_env_values(var(CLUSTER_ENV).as_deref(), var(TILE_N_ENV).as_deref())
    }

    fn from_env_values(cluster: Option<&str>, tile_n: Option<&str>) -> Result<HopperConfig> {
        let d = HopperConfig::default();
        Ok(HopperConfig {
            cluster: env_choice(CLUSTER_ENV, cluster, &[1, 2])?.unwrap_or(d.cluster),
            tile_n: env_choice(TILE_N_ENV, tile_n, &[128, 256])?.unwrap_or(d.tile_n),
        })
    }

    fn check(&self) -> Result<()> {
        if !matches!(self.cluster, 1 | 2) {
            return Err(bad(
                OP,
                format!("cluster size {} (the Hopper GEMM takes 1 or 2)", self.cluster),
            ));
        }
        if !matches!(self.tile_n, 128 | 256) {
            return Err(bad(
                OP,
                format!("tile width {} (the Hopper GEMM takes 128 or 256 columns)", self.tile_n),
            ));
        }
        Ok(())
    }

    /// Reads [`HopperConfig`]'s display form, `n<tile_n>c<cluster>`
    /// (`n128c1` is the default, `n256c2` 128 x 256 tiles in 2-block
    /// clusters); other text, or a width or cluster size the kernel does not
    /// take, is an error naming it.
    pub fn parse(text: &str) -> Result<HopperConfig> {
        let fields = text.strip_prefix('n').and_then(|r| r.split_once('c'));
        let num = |s: &str| s.parse::<u32>().ok().filter(|_| s.bytes().all(|b| b.is_ascii_digit()));
        let Some((Some(tile_n), Some(cluster))) = fields.map(|(t, c)| (num(t), num(c))) else {
            return Err(bad(
                OP,
                format!("launch configuration {text:?} is not n<tile width>c<cluster size>"),
            ));
        };
        let c = HopperConfig { cluster, tile_n };
        c.check()?;
        Ok(c)
    }

    /// Rows and columns of C per tile: (128, [`HopperConfig::tile_n`]).
    pub fn tile(&self) -> (usize, usize) {
        (128, self.tile_n as usize)
    }

    /// The kernel's dynamic shared memory per block at this tile width
    /// ([`SHARED_BYTES`] or [`SHARED_BYTES_N256`]).
    pub fn shared_bytes(&self) -> u32 {
        shared_bytes_for(self.tile_n)
    }

    /// Columns of C the epilogue stages and stores at a time (the width of
    /// a 16-bit C's tensor-map box): the whole tile at 128, 64 at 256. A
    /// [`RopeEpilogue`]'s head dim must divide it.
    pub fn epilogue_cols(&self) -> u32 {
        stages_and_chunk(self.tile_n).1
    }
}

impl std::fmt::Display for HopperConfig {
    /// `n<tile_n>c<cluster>`, e.g. `n256c2` ([`HopperConfig::parse`] reads
    /// it back).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "n{}c{}", self.tile_n, self.cluster)
    }
}

/// The value of environment variable `name` (`v`, trimmed) when it is one of
/// `allowed`; `None` when unset or empty; an error naming it otherwise.
fn env_choice(name: &str, v: Option<&str>, allowed: &[u32]) -> Result<Option<u32>> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(s) => match s.parse::<u32>() {
            Ok(x) if allowed.contains(&x) => Ok(Some(x)),
            _ => {
                let list: Vec<String> = allowed.iter().map(u32::to_string).collect();
                Err(bad(OP, format!("{name}={s:?}: expected {}", list.join(" or "))))
            }
        },
    }
}

/// What a matrix [`AuxInput`] is combined with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuxOp {
    /// `v + aux` (a residual connection).
    Residual,
    /// `silu(aux) * v`: with aux the gate projection `x W_gate^T` and this
    /// GEMM the up projection `x W_up^T`, C is SwiGLU's hidden activation
    /// `silu(gate) * up` (the backward pass needs gate and up themselves,
    /// which the caller keeps).
    SiluMul,
}

/// A second matrix of C's shape and element type read by the epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuxInput {
    /// Batch 0 of the matrix (device address).
    pub ptr: DevPtr,
    /// Row stride in elements (`n` or more).
    pub ld: usize,
    /// Elements between consecutive batches (any value for one batch).
    pub batch_stride: usize,
    /// How it is combined.
    pub op: AuxOp,
}

/// The rotary position embedding (rotate-half form, as `cuda/rope.cu`'s
/// forward) applied to the first `cols` columns of C: each head of
/// `head_dim` columns, with `v1`, `v2` the values of columns `c` and
/// `c + head_dim / 2` (`c` in the head's first half, `j` its offset there)
/// and `t = row % seq` the position of row `row` of a batch, becomes
/// `(v1 cos[t, j] - v2 sin[t, j], v2 cos[t, j + h] + v1 sin[t, j + h])`
/// (`h = head_dim / 2`), computed in f32 and cast to C's type once: the q
/// and k heads of a packed `[rows, (hq + 2 hkv) * head_dim]` projection,
/// rotated where the GEMM writes them (`cols = (hq + hkv) * head_dim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeEpilogue {
    /// The cosines: `[>= seq, head_dim]` elements of C's type, rows
    /// `head_dim` apart (device address).
    pub cos: DevPtr,
    /// The sines, like `cos`.
    pub sin: DevPtr,
    /// Columns per head: even, and a divisor of the configuration's
    /// epilogue chunk width ([`HopperConfig::epilogue_cols`]).
    pub head_dim: usize,
    /// Columns `0..cols` are rotated: a multiple of `head_dim`, at most `n`.
    pub cols: usize,
    /// Positions per sequence: row `row` of a batch has position `row % seq`.
    pub seq: usize,
}

/// The fused steps after `v = alpha * op(A) op(B) + beta * C`, in this
/// order: `v += bias[col]`, then the [`AuxInput`] or the [`RopeEpilogue`]
/// (not both), then the cast to C's type. The default is none (a plain
/// GEMM).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Epilogue {
    /// A per-column bias: `n` elements of C's type (device address).
    pub bias: Option<DevPtr>,
    /// A residual or gate matrix.
    pub aux: Option<AuxInput>,
    /// A rotary embedding of C's first columns.
    pub rope: Option<RopeEpilogue>,
}

/// Where the Hopper kernel runs: how many blocks a persistent launch
/// starts, and how its tensor maps are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperTarget {
    /// Streaming multiprocessors (blocks of the persistent grid, at most).
    pub sms: u32,
    /// Tensor maps in the CPU emulator's encoding (else the driver's).
    pub emulated: bool,
}

impl HopperTarget {
    /// The CPU emulator standing in for a GPU of `sms` SMs.
    pub fn emulator(sms: u32) -> Self {
        HopperTarget { sms: sms.max(1), emulated: true }
    }

    /// The target of `dev` when it runs `sm_90a` kernels: a GPU handle
    /// compiling for `sm_90a`, or the emulator when [`EMU_ARCH_ENV`] says
    /// `sm_90a` (then standing in for an H100's 132 SMs); `None` otherwise.
    pub fn of(dev: &dyn GpuDevice) -> Option<HopperTarget> {
        match dev.memory_space() {
            MemorySpace::Host => {
                dev.compile_arch()?.has_wgmma().then(|| HopperTarget::emulator(132))
            }
            MemorySpace::Cuda { ordinal, .. } => {
                if !dev.compile_arch()?.has_wgmma() {
                    return None;
                }
                Some(HopperTarget { sms: gpu_sm_count(ordinal)?, emulated: false })
            }
        }
    }
}

/// The SM count of GPU `ordinal` (the driver is loaded: the device exists).
fn gpu_sm_count(ordinal: usize) -> Option<u32> {
    use cudarc::driver::{result, sys};
    let dev = result::device::get(i32::try_from(ordinal).ok()?).ok()?;
    // SAFETY: `dev` is a valid device handle; the call writes one integer.
    let n = unsafe {
        result::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
    }
    .ok()?;
    u32::try_from(n).ok().filter(|&n| n > 0)
}

/// A resolved launch: kernel, grid (and cluster shape) and argument struct.
#[derive(Clone, Debug, PartialEq)]
pub struct HopperLaunch {
    /// Kernel name (`tpar_gemm_hopper_nt_bf16_f32`, ...).
    pub kernel: String,
    /// Persistent grid (min(tiles, SMs) blocks of 384 threads, or with
    /// clusters of 2 twice min(tile pairs, SMs / 2)), cluster shape and
    /// shared memory.
    pub cfg: LaunchConfig,
    /// The argument struct.
    pub args: GemmHopperArgs,
}

/// Why the Hopper kernel does not take `p` with operands at `a` and `b`
/// (`None`: it does). C may have any alignment (unaligned rows are written
/// without bulk stores).
pub fn unsupported(p: &GemmProblem, a: DevPtr, b: DevPtr) -> Option<String> {
    let s = &p.shape;
    if p.dtype_in.size() != 2 {
        return Some(format!("{:?} inputs (wgmma takes bf16 or f16 here)", p.dtype_in));
    }
    if !a.is_multiple_of(16) || !b.is_multiple_of(16) {
        return Some(format!("A {a:#x} or B {b:#x} is not 16-byte aligned (a tensor map's base)"));
    }
    if !p.lda.is_multiple_of(8) || !p.ldb.is_multiple_of(8) {
        return Some(format!(
            "lda {} or ldb {} is not a multiple of 8 elements (a tensor map's row pitch is a \
             multiple of 16 bytes)",
            p.lda, p.ldb
        ));
    }
    if s.batch > 1 && (!s.a_batch_stride.is_multiple_of(8) || !s.b_batch_stride.is_multiple_of(8)) {
        return Some(format!(
            "batch strides {} / {} are not multiples of 8 elements",
            s.a_batch_stride, s.b_batch_stride
        ));
    }
    None
}

/// Whether `dev` runs the Hopper kernel ([`HopperTarget::of`]) and it takes
/// `p` ([`unsupported`]).
pub fn supports(dev: &dyn GpuDevice, p: &GemmProblem, a: DevPtr, b: DevPtr) -> bool {
    HopperTarget::of(dev).is_some() && unsupported(p, a, b).is_none()
}

fn map_dtype(dt: CudaDType) -> TensorMapDType {
    match dt {
        CudaDType::BF16 => TensorMapDType::BF16,
        CudaDType::F16 => TensorMapDType::F16,
        CudaDType::F32 => TensorMapDType::F32,
    }
}

/// One operand's 3-D tensor map: `cols` contiguous elements per row, `rows`
/// rows `ld` apart, batches `stride` apart (one batch when `stride` is 0 or
/// there is one).
#[allow(clippy::too_many_arguments)]
fn operand_map(
    target: HopperTarget,
    dt: CudaDType,
    ptr: DevPtr,
    (cols, rows, ld): (usize, usize, usize),
    (batch, stride): (usize, usize),
    box_dims: [u32; 3],
    swizzle: TensorMapSwizzle,
) -> Result<TensorMap> {
    let es = dt.size() as u64;
    let (nb, bstride) = if batch > 1 && stride > 0 {
        (batch as u64, stride as u64 * es)
    } else {
        // one batch: any valid stride (a multiple of 16 bytes past the matrix)
        (1, (rows as u64 * ld as u64 * es).div_ceil(16).max(1) * 16)
    };
    let desc = TiledDesc {
        dtype: map_dtype(dt),
        global: ptr,
        dims: &[cols as u64, rows as u64, nb],
        strides: &[ld as u64 * es, bstride],
        box_dims: &box_dims,
        swizzle,
    };
    if target.emulated {
        TensorMap::encode_tiled_emulated(&desc)
    } else {
        TensorMap::encode_tiled_driver(&desc)
    }
}

/// The box and swizzle of C's tensor map: a f32 C is stored from the
/// epilogue's staging chunk itself, 32-column sub-boxes of 64 rows laid out
/// in the 128-byte swizzle (the kernel's `staged`); a 16-bit C from a
/// row-major image of the whole chunk (the epilogue's width x 64, no
/// swizzle).
fn c_box(dt: CudaDType, cfg: HopperConfig) -> ([u32; 3], TensorMapSwizzle) {
    if dt == CudaDType::F32 {
        ([32, 64, 1], TensorMapSwizzle::B128)
    } else {
        ([cfg.epilogue_cols(), 64, 1], TensorMapSwizzle::None)
    }
}

/// Checks `p` for the Hopper kernel: the checks of [`GemmProblem::validate`]
/// with any output type for 16-bit inputs, and [`unsupported`].
fn validate(p: &GemmProblem, a: DevPtr, b: DevPtr) -> Result<()> {
    if let Some(why) = unsupported(p, a, b) {
        return Err(bad(OP, format!("the Hopper kernel does not take this problem: {why}")));
    }
    // the shared checks, with the output type the mma.sync kernels pair with the input
    let mut q = *p;
    q.dtype_out = p.dtype_in;
    q.validate()
}

impl RopeEpilogue {
    /// Why a rotary embedding of `head_dim`, `cols` and `seq` does not fit a
    /// C of `n` columns on either path (`None`: it does): combined with an
    /// epilogue matrix (`with_aux`), a head dim that is not even and
    /// positive, columns that are not whole heads within `n`, or a sequence
    /// length outside `1..2^31`.
    pub fn unfit(
        (head_dim, cols, seq): (usize, usize, usize),
        n: usize,
        with_aux: bool,
    ) -> Option<String> {
        if with_aux {
            Some("the rotary embedding does not combine with a residual or gate matrix".into())
        } else if head_dim == 0 || !head_dim.is_multiple_of(2) {
            Some(format!("rotary head dim {head_dim} is not even and positive"))
        } else if !cols.is_multiple_of(head_dim) || cols > n {
            Some(format!(
                "rotary columns {cols} are not a multiple of head dim {head_dim} within n = {n}"
            ))
        } else if seq == 0 || i32::try_from(seq).is_err() {
            Some(format!("rotary sequence length {seq} is not in 1..2^31"))
        } else {
            None
        }
    }
}

/// Checks a [`RopeEpilogue`] for a C of `n` columns of `osz`-byte elements
/// at configuration `cfg` (`with_aux`: an [`AuxInput`] is asked for too):
/// [`RopeEpilogue::unfit`], the chunk width, the tables' addresses.
fn check_rope(
    r: &RopeEpilogue,
    with_aux: bool,
    n: usize,
    osz: usize,
    cfg: HopperConfig,
) -> Result<()> {
    let chunk = cfg.epilogue_cols() as usize;
    let why = if let Some(why) = RopeEpilogue::unfit((r.head_dim, r.cols, r.seq), n, with_aux) {
        why
    } else if !chunk.is_multiple_of(r.head_dim) {
        format!(
            "rotary head dim {} does not divide the epilogue's chunk of {chunk} columns at tile \
             width {}",
            r.head_dim, cfg.tile_n
        )
    } else if let Some((what, p)) = [("cos", r.cos), ("sin", r.sin)]
        .into_iter()
        .find(|&(_, p)| p == 0 || !p.is_multiple_of(osz as u64))
    {
        format!("rotary {what} table address {p:#x} is null or not aligned to {osz} bytes")
    } else {
        return Ok(());
    };
    Err(bad(OP, why))
}

fn fit_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| bad(OP, format!("{what} = {v} does not fit i32")))
}

fn fit_i64(what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| bad(OP, format!("{what} = {v} does not fit i64")))
}

/// Validates `p`, the epilogue and the addresses and resolves the launch on
/// `target` without clusters and with 128 x 128 tiles ([`plan_with`] the
/// default [`HopperConfig`]).
pub fn plan(
    p: &GemmProblem,
    epi: &Epilogue,
    target: HopperTarget,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<HopperLaunch> {
    plan_with(p, epi, target, HopperConfig::default(), a, b, c)
}

/// Validates `p`, the epilogue, the addresses and `cfg` and resolves the
/// launch on `target`: the kernel (for `cfg`'s tile width), a persistent
/// grid of min(tiles, SMs) blocks (clusters of 2: min(tile pairs, SMs / 2)
/// clusters), and the
/// argument struct with the tensor maps of A, B and (when C's address, row
/// pitch and batch stride are 16-byte multiples) C.
pub fn plan_with(
    p: &GemmProblem,
    epi: &Epilogue,
    target: HopperTarget,
    cfg: HopperConfig,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<HopperLaunch> {
    cfg.check()?;
    validate(p, a, b)?;
    let s = &p.shape;
    let osz = p.dtype_out.size();
    if c == 0 || !c.is_multiple_of(osz as u64) {
        return Err(bad(OP, format!("C address {c:#x} is null or not aligned to {osz} bytes")));
    }
    let mut flags = 0;
    let (mut aux, mut ld_aux, mut aux_stride) = (0, 0, 0);
    if let Some(bias) = epi.bias {
        if bias == 0 || !bias.is_multiple_of(osz as u64) {
            return Err(bad(OP, format!("bias address {bias:#x} is null or misaligned")));
        }
        flags |= EPI_BIAS;
    }
    if let Some(x) = epi.aux {
        if x.ptr == 0 || !x.ptr.is_multiple_of(osz as u64) {
            return Err(bad(
                OP,
                format!("epilogue matrix address {:#x} is null or misaligned", x.ptr),
            ));
        }
        if x.ld < s.n {
            return Err(bad(OP, format!("epilogue matrix ld {} is less than n = {}", x.ld, s.n)));
        }
        flags |= match x.op {
            AuxOp::Residual => EPI_RESIDUAL,
            AuxOp::SiluMul => EPI_SILU_MUL,
        };
        (aux, ld_aux, aux_stride) = (x.ptr, x.ld, if s.batch > 1 { x.batch_stride } else { 0 });
    }
    let rope = epi.rope;
    if let Some(r) = rope {
        check_rope(&r, epi.aux.is_some(), s.n, osz, cfg)?;
        flags |= EPI_ROPE;
    }
    let (bm, bn) = cfg.tile();
    let tiles = s.m.div_ceil(bm).saturating_mul(s.n.div_ceil(bn)).saturating_mul(s.batch);
    if tiles > i32::MAX as usize {
        return Err(bad(OP, format!("{} x {} x batch {} has too many tiles", s.m, s.n, s.batch)));
    }
    let (ta, tb) = (s.trans_a, s.trans_b);
    let sw = TensorMapSwizzle::B128;
    // (inner, outer) of each operand as stored, and its box: A [m, k] / B [n, k]
    // (K-major) one 64 x 128 box; A [k, m] / B [k, n] two 64 x 64
    // (with clusters of 2, a block loads 64 rows of the A tile: 64 x 64 boxes)
    let cl = cfg.cluster as usize;
    let (a_dims, a_box) =
        if ta { ((s.m, s.k), [64, 64, 1]) } else { ((s.k, s.m), [64, 128 / cl as u32, 1]) };
    let (b_dims, b_box) = if tb { ((s.k, s.n), [64, 128, 1]) } else { ((s.n, s.k), [64, 64, 1]) };
    let (ab, bb) = ((s.batch, s.a_batch_stride), (s.batch, s.b_batch_stride));
    let map_a = operand_map(target, p.dtype_in, a, (a_dims.0, a_dims.1, p.lda), ab, a_box, sw)?;
    let map_b = operand_map(target, p.dtype_in, b, (b_dims.0, b_dims.1, p.ldb), bb, b_box, sw)?;
    let c_tma = c.is_multiple_of(16)
        && (p.ldc * osz).is_multiple_of(16)
        && (s.batch == 1 || (p.c_batch_stride * osz).is_multiple_of(16));
    let map_c = if c_tma {
        let (c_box, c_swizzle) = c_box(p.dtype_out, cfg);
        operand_map(
            target,
            p.dtype_out,
            c,
            (s.n, s.m, p.ldc),
            (s.batch, p.c_batch_stride),
            c_box,
            c_swizzle,
        )?
    } else {
        TensorMap::zeroed()
    };
    let layout = match (ta, tb) {
        (false, false) => "nn",
        (false, true) => "nt",
        (true, false) => "tn",
        (true, true) => "tt",
    };
    let width = if cfg.tile_n == 256 { "_n256" } else { "" };
    let kernel = format!(
        "tpar_gemm_hopper_{layout}_{}_{}{width}",
        p.dtype_in.suffix(),
        p.dtype_out.suffix()
    );
    // units of work: tiles, or pairs of tiles along N
    let units = s.m.div_ceil(bm) * s.n.div_ceil(bn * cl) * s.batch;
    let clusters = units.min((target.sms as usize / cl).max(1)) as u32;
    let launch_cfg = LaunchConfig::linear(clusters * cfg.cluster, THREADS)
        .with_shared(cfg.shared_bytes())
        .with_cluster([cfg.cluster, 1, 1]);
    let args = GemmHopperArgs {
        map_a,
        map_b,
        map_c,
        c,
        bias: epi.bias.unwrap_or(0),
        aux,
        batch_stride_c: fit_i64("C batch stride", p.c_batch_stride)?,
        batch_stride_aux: fit_i64("epilogue matrix batch stride", aux_stride)?,
        m: fit_i32("m", s.m)?,
        n: fit_i32("n", s.n)?,
        k: fit_i32("k", s.k)?,
        ldc: fit_i32("ldc", p.ldc)?,
        ld_aux: fit_i32("epilogue matrix ld", ld_aux)?,
        batch: fit_i32("batch", s.batch)?,
        bcast_a: i32::from(s.batch == 1 || s.a_batch_stride == 0),
        bcast_b: i32::from(s.batch == 1 || s.b_batch_stride == 0),
        alpha: p.alpha,
        beta: p.beta,
        epilogue: flags,
        c_tma: i32::from(c_tma),
        group: GROUP,
        cluster: cfg.cluster as i32,
        rope_cos: rope.map_or(0, |r| r.cos),
        rope_sin: rope.map_or(0, |r| r.sin),
        rope_hd: rope.map_or(0, |r| r.head_dim as i32),
        rope_cols: rope.map_or(0, |r| r.cols as i32),
        rope_seq: rope.map_or(0, |r| r.seq as i32),
        pad: [0; 1],
    };
    Ok(HopperLaunch { kernel, cfg: launch_cfg, args })
}

/// Runs `p` with epilogue `epi` on `l` (a device of `target`), with the
/// cluster size and tile width [`HopperConfig::from_env`] gives (1 and 128
/// unless [`CLUSTER_ENV`] or [`TILE_N_ENV`] say otherwise).
///
/// # Safety
/// `a`, `b` and `c` (and the epilogue's bias and matrix) must be device
/// addresses (host addresses in the emulator) of buffers covering every
/// element the problem's sizes, leading dimensions and batch strides reach,
/// A and B in `p.dtype_in`, C, bias and matrix in `p.dtype_out`; C must not
/// overlap A, B, the bias or the matrix.
pub unsafe fn gemm(
    l: &dyn Launcher,
    target: HopperTarget,
    p: &GemmProblem,
    epi: &Epilogue,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { gemm_with(l, target, HopperConfig::from_env()?, p, epi, a, b, c) }
}

/// [`gemm()`] with an explicit [`HopperConfig`]. With clusters, the grid of
/// [`plan_with`] is capped at the clusters the launcher says can be resident
/// at once ([`Launcher::max_active_clusters`]; none of them fitting is an
/// error).
///
/// # Safety
/// As [`gemm()`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_with(
    l: &dyn Launcher,
    target: HopperTarget,
    cfg: HopperConfig,
    p: &GemmProblem,
    epi: &Epilogue,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<()> {
    let mut plan = plan_with(p, epi, target, cfg, a, b, c)?;
    if plan.cfg.is_clustered() {
        // no more clusters than can be resident at once (the persistent walk
        // strides by the grid): where the launcher can tell
        if let Some(fit) = l.max_active_clusters(&plan.kernel, &plan.cfg)? {
            if fit == 0 {
                return Err(bad(
                    OP,
                    format!(
                        "{}: no cluster of {} blocks with {} bytes of shared memory each fits \
                         on {}",
                        plan.kernel,
                        cfg.cluster,
                        cfg.shared_bytes(),
                        l.describe()
                    ),
                ));
            }
            plan.cfg.grid[0] = plan.cfg.grid[0].min(fit.saturating_mul(cfg.cluster));
        }
    }
    // SAFETY: the caller guarantees the buffers; `plan` checked the sizes fit
    // the argument struct, which mirrors the kernel's.
    unsafe { launch(l, &plan.kernel, plan.cfg, &plan.args) }
}

/// Runs `p` (no epilogue) on `dev` with the Hopper kernel when `dev` runs
/// it and it takes the problem ([`supports`]); `Ok(false)` otherwise, and
/// the caller runs the `mma.sync` kernel of [`super::gemm`].
///
/// # Safety
/// As [`gemm()`].
pub unsafe fn gemm_if_supported(
    dev: &dyn GpuDevice,
    p: &GemmProblem,
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
) -> Result<bool> {
    let Some(target) = HopperTarget::of(dev) else { return Ok(false) };
    if unsupported(p, a, b).is_some() {
        return Ok(false);
    }
    // SAFETY: forwarded from the caller.
    unsafe { gemm(dev, target, p, &Epilogue::default(), a, b, c)? };
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::GemmShape;

    #[test]
    fn args_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<GemmHopperArgs>(), 512);
        const { assert!(SHARED_BYTES <= 227 * 1024) };
        assert_eq!(std::mem::align_of::<GemmHopperArgs>(), 64);
    }

    #[test]
    fn only_sm_90a_has_wgmma() {
        use crate::cuda::Arch;
        assert!(Arch::parse("sm_90a").is_some_and(Arch::has_wgmma));
        for other in ["sm_90", "sm_80", "sm_100a", "sm_100f", "compute_90"] {
            assert!(!Arch::parse(other).unwrap().has_wgmma(), "{other}");
        }
        assert_eq!(Arch::parse("cuda:0 (CPU emulator)"), None);
    }

    #[test]
    fn plans_name_kernels_grids_and_refusals() {
        let shape = GemmShape::new(2, 300, 200, 72);
        let p = GemmProblem::new(shape, CudaDType::BF16, CudaDType::F32);
        let t = HopperTarget::emulator(4);
        let l = plan(&p, &Epilogue::default(), t, 4096, 8192, 16384).unwrap();
        assert_eq!(l.kernel, "tpar_gemm_hopper_nn_bf16_f32");
        // 3 x 2 tiles x 2 batches on 4 blocks
        assert_eq!(l.cfg.grid, [4, 1, 1]);
        assert_eq!(l.cfg.block, [384, 1, 1]);
        assert_eq!(l.args.c_tma, 1);
        assert_eq!(l.args.bcast_a, 0);
        // f32 inputs, unaligned operands and odd leading dims are refused
        let f = GemmProblem::new(shape, CudaDType::F32, CudaDType::F32);
        assert!(unsupported(&f, 4096, 8192).is_some());
        assert!(unsupported(&p, 4098, 8192).is_some());
        let odd = GemmProblem::new(GemmShape::new(1, 8, 8, 37), CudaDType::F16, CudaDType::F16);
        assert!(unsupported(&odd, 4096, 8192).unwrap().contains("lda 37"));
        assert!(plan(&odd, &Epilogue::default(), t, 4096, 8192, 16384).is_err());
        // a cross output type is taken; C with odd rows is stored without TMA
        let x = GemmProblem::new(GemmShape::new(1, 8, 9, 16), CudaDType::F16, CudaDType::BF16)
            .with_leading_dims(16, 16, 9);
        let l = plan(&x, &Epilogue::default(), t, 4096, 8192, 16384).unwrap();
        assert_eq!((l.kernel.as_str(), l.args.c_tma), ("tpar_gemm_hopper_nn_f16_bf16", 0));
        let bad_aux = Epilogue {
            bias: None,
            aux: Some(AuxInput { ptr: 64, ld: 4, batch_stride: 0, op: AuxOp::Residual }),
            rope: None,
        };
        assert!(plan(&x, &bad_aux, t, 4096, 8192, 16384).unwrap_err().to_string().contains("ld 4"));
    }

    #[test]
    fn cluster_plans_pair_tiles_and_refuse_other_sizes() {
        // 3 x 2 tiles x 2 batches = 6 pairs along N
        let shape = GemmShape::new(2, 300, 200, 72);
        let p = GemmProblem::new(shape, CudaDType::BF16, CudaDType::F32);
        let c2 = HopperConfig::with_cluster(2).unwrap();
        let plan2 = |sms| {
            plan_with(&p, &Epilogue::default(), HopperTarget::emulator(sms), c2, 4096, 8192, 16384)
        };
        let l = plan2(4).unwrap();
        assert_eq!((l.cfg.grid, l.cfg.cluster), ([4, 1, 1], [2, 1, 1]));
        assert_eq!(l.args.cluster, 2);
        assert_eq!(plan2(132).unwrap().cfg.grid, [12, 1, 1]);
        // one SM still runs one cluster
        assert_eq!(plan2(1).unwrap().cfg.grid, [2, 1, 1]);
        assert_eq!(
            plan(&p, &Epilogue::default(), HopperTarget::emulator(4), 4096, 8192, 16384)
                .unwrap()
                .cfg
                .cluster,
            [1, 1, 1]
        );
        for bad_size in [0, 3, 4] {
            let e = HopperConfig::with_cluster(bad_size).unwrap_err().to_string();
            assert!(e.contains(&format!("cluster size {bad_size}")), "{e}");
            let cfg = HopperConfig { cluster: bad_size, tile_n: 128 };
            assert!(plan_with(
                &p,
                &Epilogue::default(),
                HopperTarget::emulator(4),
                cfg,
                4096,
                8192,
                16384
            )
            .is_err());
        }
        let cluster = |v| HopperConfig::from_env_values(v, None).map(|c| c.cluster);
        assert_eq!(cluster(None).unwrap(), 1);
        assert_eq!(cluster(Some("")).unwrap(), 1);
        assert_eq!(cluster(Some(" 2")).unwrap(), 2);
        assert_eq!(cluster(Some("1")).unwrap(), 1);
        let e = cluster(Some("4")).unwrap_err().to_string();
        assert!(e.contains("TPAR_GEMM_CLUSTER=\"4\": expected 1 or 2"), "{e}");
    }

    #[test]
    fn tile_width_256_plans_n256_kernels_and_refuses_other_widths() {
        // 3 row tiles x 2 column tiles of 256 (n = 296) x 2 batches
        let shape = GemmShape::new(2, 300, 296, 72);
        let p = GemmProblem::new(shape, CudaDType::F16, CudaDType::BF16);
        let n256 = HopperConfig::default().with_tile_n(256).unwrap();
        assert_eq!((n256.tile(), n256.cluster), ((128, 256), 1));
        let t = HopperTarget::emulator(132);
        let e = Epilogue::default();
        let l = plan_with(&p, &e, t, n256, 4096, 8192, 16384).unwrap();
        assert_eq!(l.kernel, "tpar_gemm_hopper_nn_f16_bf16_n256");
        assert_eq!((l.cfg.grid, l.cfg.shared_bytes), ([12, 1, 1], SHARED_BYTES_N256));
        // the same problem at 128 columns: 3 column tiles
        let l128 = plan(&p, &e, t, 4096, 8192, 16384).unwrap();
        assert_eq!(l128.kernel, "tpar_gemm_hopper_nn_f16_bf16");
        assert_eq!((l128.cfg.grid, l128.cfg.shared_bytes), ([18, 1, 1], SHARED_BYTES));
        // C's box is the epilogue's chunk: 64 columns at 256, 128 at 128
        assert_ne!(l.args.map_c, l128.args.map_c);
        // clusters of 2 pair 256-column tiles: 3 x 1 pairs x 2 batches
        let c2 = HopperConfig { cluster: 2, ..n256 };
        let l = plan_with(&p, &e, t, c2, 4096, 8192, 16384).unwrap();
        assert_eq!((l.cfg.grid, l.cfg.cluster), ([12, 1, 1], [2, 1, 1]));
        assert_eq!(SHARED_BYTES, 230_496);
        assert_eq!(SHARED_BYTES_N256, 197_712);
        const { assert!(SHARED_BYTES_N256 <= 227 * 1024) };
        for bad_width in [0, 64, 192, 512] {
            let e = HopperConfig::default().with_tile_n(bad_width).unwrap_err().to_string();
            assert!(e.contains(&format!("tile width {bad_width}")), "{e}");
            let cfg = HopperConfig { cluster: 1, tile_n: bad_width };
            assert!(plan_with(&p, &Epilogue::default(), t, cfg, 4096, 8192, 16384).is_err());
        }
        let width = |v| HopperConfig::from_env_values(None, v).map(|c| c.tile_n);
        assert_eq!(width(None).unwrap(), 128);
        assert_eq!(width(Some(" ")).unwrap(), 128);
        assert_eq!(width(Some("256")).unwrap(), 256);
        assert_eq!(width(Some("128 ")).unwrap(), 128);
        for bad_value in ["64", "wide", "-256"] {
            let e = width(Some(bad_value)).unwrap_err().to_string();
            let want = format!("TPAR_GEMM_TILE_N={bad_value:?}: expected 128 or 256");
            assert!(e.contains(&want), "{e}");
        }
        let both = HopperConfig::from_env_values(Some("2"), Some("256")).unwrap();
        assert_eq!(both, HopperConfig { cluster: 2, tile_n: 256 });
    }

    #[test]
    fn f32_c_is_stored_in_swizzled_32_column_boxes() {
        // C [300, 296] f32 (ldc 296: rows 16-byte aligned), one batch
        let shape = GemmShape::new(1, 300, 296, 72);
        let p = GemmProblem::new(shape, CudaDType::BF16, CudaDType::F32);
        let t = HopperTarget::emulator(8);
        let e = Epilogue::default();
        let c = 16384;
        let want = |box_dims: [u32; 3], swizzle| {
            TensorMap::encode_tiled_emulated(&TiledDesc {
                dtype: TensorMapDType::F32,
                global: c,
                dims: &[296, 300, 1],
                strides: &[296 * 4, 300 * 296 * 4],
                box_dims: &box_dims,
                swizzle,
            })
            .unwrap()
        };
        // the staging chunk's sub-boxes, at either tile width
        for tile_n in [128, 256] {
            let cfg = HopperConfig::default().with_tile_n(tile_n).unwrap();
            let l = plan_with(&p, &e, t, cfg, 4096, 8192, c).unwrap();
            assert_eq!(l.args.map_c, want([32, 64, 1], TensorMapSwizzle::B128), "{cfg}");
        }
        // a 16-bit C: the row-major image of a whole chunk
        let p16 = GemmProblem::new(shape, CudaDType::BF16, CudaDType::BF16);
        let l = plan(&p16, &e, t, 4096, 8192, c).unwrap();
        let (box16, sw16) = c_box(CudaDType::BF16, HopperConfig::default());
        assert_eq!((box16, sw16), ([128, 64, 1], TensorMapSwizzle::None));
        assert_ne!(l.args.map_c, want([32, 64, 1], TensorMapSwizzle::B128));
    }

    #[test]
    fn rope_epilogues_are_checked_before_the_launch() {
        // C [72, 512] bf16: q/k heads of 64 in columns 0..384, v after
        let p = GemmProblem::new(GemmShape::new(1, 72, 512, 64), CudaDType::BF16, CudaDType::BF16);
        let t = HopperTarget::emulator(4);
        let n128 = HopperConfig::default();
        let n256 = n128.with_tile_n(256).unwrap();
        let good = RopeEpilogue { cos: 1 << 20, sin: 1 << 21, head_dim: 64, cols: 384, seq: 24 };
        let run = |r: RopeEpilogue, aux: Option<AuxInput>, cfg: HopperConfig| {
            let epi = Epilogue { bias: Some(4096), aux, rope: Some(r) };
            plan_with(&p, &epi, t, cfg, 8192, 16384, 32768)
        };
        let err = |r, aux, cfg| run(r, aux, cfg).unwrap_err().to_string();
        for cfg in [n128, n256] {
            let l = run(good, None, cfg).unwrap();
            assert_eq!(l.args.epilogue, EPI_BIAS | EPI_ROPE);
            let a = &l.args;
            assert_eq!((a.rope_cos, a.rope_sin), (1 << 20, 1 << 21));
            assert_eq!((a.rope_hd, a.rope_cols, a.rope_seq), (64, 384, 24));
        }
        // head dim 128 fits the 128-column chunk, not the 64-column one
        let hd128 = RopeEpilogue { head_dim: 128, ..good };
        assert!(run(hd128, None, n128).is_ok());
        let e = err(hd128, None, n256);
        assert!(e.contains("head dim 128 does not divide the epilogue's chunk of 64"), "{e}");
        for (head_dim, want) in [(0, "head dim 0 is not even"), (7, "head dim 7 is not even")] {
            let e = err(RopeEpilogue { head_dim, ..good }, None, n128);
            assert!(e.contains(want), "{e}");
        }
        let e = err(RopeEpilogue { head_dim: 12, cols: 36, ..good }, None, n128);
        assert!(e.contains("head dim 12 does not divide"), "{e}");
        let e = err(RopeEpilogue { cols: 100, ..good }, None, n128);
        assert!(e.contains("rotary columns 100 are not a multiple of head dim 64"), "{e}");
        let e = err(RopeEpilogue { cols: 576, ..good }, None, n128);
        assert!(e.contains("rotary columns 576") && e.contains("n = 512"), "{e}");
        let e = err(RopeEpilogue { seq: 0, ..good }, None, n128);
        assert!(e.contains("rotary sequence length 0"), "{e}");
        let e = err(RopeEpilogue { cos: 0, ..good }, None, n128);
        assert!(e.contains("rotary cos table address 0x0 is null"), "{e}");
        let e = err(RopeEpilogue { sin: (1 << 21) + 1, ..good }, None, n128);
        assert!(e.contains("rotary sin table address 0x200001"), "{e}");
        let x = AuxInput { ptr: 1 << 22, ld: 512, batch_stride: 0, op: AuxOp::Residual };
        let e = err(good, Some(x), n128);
        assert!(e.contains("does not combine with a residual or gate matrix"), "{e}");
        let e = err(good, Some(AuxInput { op: AuxOp::SiluMul, ..x }), n128);
        assert!(e.contains("does not combine"), "{e}");
        // no rotary embedding: the fields stay 0
        let l = plan(&p, &Epilogue::default(), t, 8192, 16384, 32768).unwrap();
        let a = &l.args;
        assert_eq!((a.epilogue, a.rope_cos, a.rope_hd, a.rope_cols, a.rope_seq), (0, 0, 0, 0, 0));
    }
}
