//! Padded GEMM operands: [`super::gemm::gemm`] stages a 16-bit operand whose
//! rows are not 16-byte aligned in a device scratch buffer with a padded row
//! stride, so the product reaches a kernel that loads 16-byte chunks.
//!
//! tpar tensors are contiguous, so a `[tokens, 259]` tensor (the LM head's
//! logits and their gradient, byte vocabulary 259) has rows of 259 elements:
//! 518 bytes in bf16, not a multiple of 16. With such an operand A or B,
//! the Hopper kernel refuses the problem ([`gemm_hopper::unsupported`]: a
//! tensor map's row pitch is a multiple of 16 bytes) and the `mma.sync`
//! kernel runs its element-wise form instead of the `cp.async` one
//! ([`GemmProblem::is_vectorizable`]). Padding the vocabulary in the model
//! would change the parameter and logits shapes users see; here only the
//! strides change, inside the GEMM call:
//!
//! - each operand [`PadPlan`] names is copied (a pitched copy,
//!   `tpar_copy2d_*` of `cuda/layout.cu`) into scratch from the device's
//!   allocator whose row stride is its row length rounded up to a multiple
//!   of [`PAD_MULTIPLE`] (64) elements and whose batches are packed (a
//!   broadcast operand, batch stride 0, stays one matrix);
//! - the product runs on the staged operands with the same `m`, `n`, `k`,
//!   scales and layouts (C is copied in first when `beta != 0`);
//! - a staged C is copied back into the caller's rows.
//!
//! The padding columns are never read: every kernel bounds its loads by the
//! row length, not the stride, so they stay uninitialised. The scratch is
//! allocated and freed around the call, in stream order, which a CUDA graph
//! capture records from its private pool.
//!
//! Numerics: the kernels' reduction order does not depend on the strides, so
//! a padded run gives the bits an unpadded run of the same kernel gives on
//! the same values (`tests/emu_gemm_pad.rs` asserts it against operands the
//! test lays out aligned itself). Padding A or B can change which kernel
//! runs: on `sm_90a` the Hopper kernel instead of the `mma.sync` fallback,
//! elsewhere the vectorized `mma.sync` kernel instead of its element-wise
//! form. Those pairs are only promised to agree within the output type's
//! rounding (the tests check both against an f64 reference); in the
//! emulator, whose tensor-core instructions accumulate each K step of 16 in
//! the same order for every kernel, their bits were also equal in every
//! case tested, which a GPU need not reproduce.
//!
//! When ([`PadPolicy`], [`GEMM_PAD_ENV`]): by default ([`PadPolicy::Auto`])
//! only for tpar's kernel, only for products of at least [`PAD_MIN_WORK`]
//! multiply-adds, and only A and B (whose alignment picks the kernel); C's
//! alignment only changes how the Hopper kernel stores its tile (bulk or
//! guarded stores), which a copy back would cost more than it saves in
//! principle. The vendor library (cuBLASLt) is never padded by default until
//! a GPU measurement shows it pays (`gpu_check --bench`, rows
//! `gemm.lmhead.*.pad` and `.nopad`); nothing here has been measured on a
//! GPU yet.

use std::sync::OnceLock;

use super::super::raw::gemm::GemmProblem;
use super::super::raw::layout::{copy2d_batch, Block2d};
use super::super::{DevPtr, GpuDevice};
use super::gemm::env_choice;
#[cfg(doc)]
use crate::cuda::raw::gemm_hopper;
use crate::util::bad;
use crate::Result;

const OP: &str = "cuda gemm (padded operands)";

/// Environment variable choosing when [`super::gemm::gemm`] pads operands:
/// `auto`, `always` or `never` (see [`PadPolicy`]); read once per process.
pub const GEMM_PAD_ENV: &str = "TPAR_GEMM_PAD";

/// Padded row strides are multiples of this many elements.
pub const PAD_MULTIPLE: usize = 64;

/// The smallest `batch * m * n * k` [`PadPolicy::Auto`] pads: 2^24 (a
/// 256³ product). Staging an operand reads and writes it once more, which
/// costs about as much as the product's arithmetic on it divided by the
/// other dimension; below this size the copy launches themselves weigh.
/// A placeholder until measured on a GPU.
pub const PAD_MIN_WORK: u64 = 1 << 24;

/// When [`super::gemm::gemm`] stages unaligned operands ([`PadPlan::choose`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PadPolicy {
    /// For tpar's kernel, A and B of 16-bit products of at least
    /// [`PAD_MIN_WORK`] multiply-adds whose rows keep them from the aligned
    /// kernel (the Hopper kernel on `sm_90a`, the vectorized `mma.sync`
    /// kernel elsewhere). Never for the vendor library (not measured).
    Auto,
    /// Every unaligned operand (A, B and C) of every 16-bit product, on
    /// either backend, at any size: for measurement and tests.
    Always,
    /// Never (the behaviour before padding existed).
    Never,
}

impl PadPolicy {
    /// Parses `auto`, `always` and `never`.
    pub fn parse(s: &str) -> Option<PadPolicy> {
        match s {
            "auto" => Some(PadPolicy::Auto),
            "always" => Some(PadPolicy::Always),
            "never" => Some(PadPolicy::Never),
            _ => None,
        }
    }
}

/// The policy [`GEMM_PAD_ENV`] names; unset, [`PadPolicy::Auto`]. A value
/// that names no policy is reported once on stderr and the default is used.
pub fn pad_policy() -> PadPolicy {
    static P: OnceLock<PadPolicy> = OnceLock::new();
    *P.get_or_init(|| {
        let choices = "padding policy (auto, always or never)";
        env_choice(GEMM_PAD_ENV, PadPolicy::parse, choices, PadPolicy::Auto, "auto")
    })
}

/// Which GEMM the padded problem is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PadRoute {
    /// tpar's kernel ([`super::gemm::ours`]).
    Ours,
    /// The device's vendor library (cuBLASLt), tpar's kernel where it refuses.
    Vendor,
}

/// Which operands a call stages in padded scratch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PadPlan {
    /// Stage A.
    pub a: bool,
    /// Stage B.
    pub b: bool,
    /// Stage C (copied in when `beta != 0`, copied back after).
    pub c: bool,
}

/// Whether an operand at `ptr` with row stride `ld` and batch stride
/// `stride` (elements of `size` bytes) can be read in 16-byte chunks.
fn aligned(p: &GemmProblem, ptr: DevPtr, ld: usize, stride: usize, size: usize) -> bool {
    ptr.is_multiple_of(16)
        && (ld * size).is_multiple_of(16)
        && (p.shape.batch == 1 || (stride * size).is_multiple_of(16))
}

impl PadPlan {
    /// Whether nothing is staged.
    pub fn is_empty(&self) -> bool {
        !(self.a || self.b || self.c)
    }

    /// Which operands of `p` (at `[a, b, c]`) to stage under `policy` for
    /// `route`: none for f32 inputs or [`PadPolicy::Never`]; every unaligned
    /// one for [`PadPolicy::Always`]; for [`PadPolicy::Auto`], the unaligned
    /// A and B of a product of at least [`PAD_MIN_WORK`] multiply-adds on
    /// tpar's kernel. An operand is unaligned when its address, row stride
    /// or (with more than one batch) batch stride is not a multiple of 16
    /// bytes.
    pub fn choose(
        p: &GemmProblem,
        [a, b, c]: [DevPtr; 3],
        route: PadRoute,
        policy: PadPolicy,
    ) -> PadPlan {
        let s = &p.shape;
        if policy == PadPolicy::Never || p.dtype_in.size() != 2 {
            return PadPlan::default();
        }
        let (is, os) = (p.dtype_in.size(), p.dtype_out.size());
        let all = PadPlan {
            a: !aligned(p, a, p.lda, s.a_batch_stride, is),
            b: !aligned(p, b, p.ldb, s.b_batch_stride, is),
            c: !aligned(p, c, p.ldc, p.c_batch_stride, os),
        };
        if policy == PadPolicy::Always {
            return all;
        }
        let work = [s.batch, s.m, s.n, s.k].iter().fold(1u64, |w, &d| w.saturating_mul(d as u64));
        if route == PadRoute::Vendor || work < PAD_MIN_WORK {
            return PadPlan::default();
        }
        PadPlan { c: false, ..all }
    }

    /// `p` on the staged operands: each staged operand's row stride rounded
    /// up from its row length to a multiple of [`PAD_MULTIPLE`], its batches
    /// packed (a broadcast operand stays broadcast).
    pub fn problem(&self, p: &GemmProblem) -> Result<GemmProblem> {
        let mut q = *p;
        let s = &mut q.shape;
        let [a, b, c] = self.layouts(p)?;
        if let Some(l) = a {
            (q.lda, s.a_batch_stride) = (l.ld, l.stride);
        }
        if let Some(l) = b {
            (q.ldb, s.b_batch_stride) = (l.ld, l.stride);
        }
        if let Some(l) = c {
            (q.ldc, q.c_batch_stride) = (l.ld, l.stride);
        }
        Ok(q)
    }

    /// The staged layout of each operand this plan stages.
    fn layouts(&self, p: &GemmProblem) -> Result<[Option<Staged>; 3]> {
        let s = &p.shape;
        let (a_rows, a_cols) = if s.trans_a { (s.k, s.m) } else { (s.m, s.k) };
        let (b_rows, b_cols) = if s.trans_b { (s.n, s.k) } else { (s.k, s.n) };
        let one =
            |on: bool, rows, cols, stride| on.then(|| Staged::new(s.batch, rows, cols, stride));
        Ok([
            one(self.a, a_rows, a_cols, s.a_batch_stride).transpose()?,
            one(self.b, b_rows, b_cols, s.b_batch_stride).transpose()?,
            one(self.c, s.m, s.n, p.c_batch_stride).transpose()?,
        ])
    }
}

/// One operand's staged layout.
#[derive(Clone, Copy, Debug)]
struct Staged {
    /// Matrices stored: the batch, or 1 for a broadcast operand.
    copies: usize,
    rows: usize,
    cols: usize,
    /// Padded row stride.
    ld: usize,
    /// Padded batch stride (0 for a broadcast operand).
    stride: usize,
}

impl Staged {
    fn new(batch: usize, rows: usize, cols: usize, stride: usize) -> Result<Staged> {
        let broadcast = batch > 1 && stride == 0;
        let ld = cols
            .checked_next_multiple_of(PAD_MULTIPLE)
            .ok_or_else(|| bad(OP, format!("row length {cols} overflows when padded")))?;
        let one = rows
            .checked_mul(ld)
            .ok_or_else(|| bad(OP, format!("{rows} rows of {ld} elements overflow")))?;
        let copies = if broadcast { 1 } else { batch };
        Ok(Staged { copies, rows, cols, ld, stride: if broadcast { 0 } else { one } })
    }

    /// Elements the staged operand spans.
    fn elems(&self) -> Result<usize> {
        self.copies
            .checked_mul(self.rows * self.ld)
            .ok_or_else(|| bad(OP, format!("{self:?} spans more elements than fit usize")))
    }
}

/// A scratch allocation of `dev`, freed on drop (in stream order).
pub(crate) struct Scratch<'d> {
    dev: &'d dyn GpuDevice,
    /// The allocation's address.
    pub(crate) ptr: DevPtr,
    len: usize,
}

impl<'d> Scratch<'d> {
    /// Allocates `bytes` (256-byte aligned) on `dev`.
    pub(crate) fn new(dev: &'d dyn GpuDevice, bytes: usize) -> Result<Scratch<'d>> {
        Ok(Scratch { dev, ptr: dev.alloc(bytes)?, len: bytes })
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this length; what was queued on it
        // runs before the free (stream order), and nothing uses it after.
        unsafe { self.dev.free(self.ptr, self.len) };
    }
}

/// Copies the `copies` matrices of `rows x cols` elements of `size` bytes
/// from `src` (row stride `src_ld`, batch stride `src_stride`) to `dst`
/// (`dst_ld`, `dst_stride`): one pitched copy when the batches follow each
/// other on both sides, else one block per matrix.
///
/// # Safety
/// Both sides are `dev`'s memory covering what the strides reach; they do
/// not overlap.
#[allow(clippy::too_many_arguments)]
unsafe fn copy_matrices(
    dev: &dyn GpuDevice,
    size: usize,
    (copies, rows, cols): (usize, usize, usize),
    (src, src_ld, src_stride): (DevPtr, usize, usize),
    (dst, dst_ld, dst_stride): (DevPtr, usize, usize),
) -> Result<()> {
    let packed = copies == 1 || (src_stride == rows * src_ld && dst_stride == rows * dst_ld);
    let blocks: Vec<Block2d> = if packed {
        vec![Block2d { src, src_ld, dst, dst_ld, rows: rows * copies, cols }]
    } else {
        let at = |p: DevPtr, stride: usize, i: usize| p + (i * stride * size) as u64;
        (0..copies)
            .map(|i| Block2d {
                src: at(src, src_stride, i),
                src_ld,
                dst: at(dst, dst_stride, i),
                dst_ld,
                rows,
                cols,
            })
            .collect()
    };
    // SAFETY: the caller vouches for both sides.
    unsafe { copy2d_batch(dev, size, &blocks) }
}

/// Runs `run` on `p` with the operands `plan` names staged in padded scratch
/// ([`PadPlan::problem`]), then copies a staged C back.
///
/// # Safety
/// As [`crate::cuda::raw::gemm::gemm`]: `a`, `b` and `c` are `dev`'s memory
/// covering every element `p` reaches, and C overlaps neither A nor B; `run`
/// needs the same of the problem and addresses it is given.
pub(crate) unsafe fn padded(
    dev: &dyn GpuDevice,
    p: &GemmProblem,
    plan: PadPlan,
    [a, b, c]: [DevPtr; 3],
    run: impl FnOnce(&GemmProblem, DevPtr, DevPtr, DevPtr) -> Result<()>,
) -> Result<()> {
    let q = plan.problem(p)?;
    let layouts = plan.layouts(p)?;
    let sizes = [p.dtype_in.size(), p.dtype_in.size(), p.dtype_out.size()];
    // one allocation, each staged operand at a 256-byte boundary
    let mut offsets = [0usize; 3];
    let mut total = 0usize;
    for (i, l) in layouts.iter().enumerate() {
        if let Some(l) = l {
            offsets[i] = total;
            let bytes = l.elems()?.checked_mul(sizes[i]).and_then(|b| b.checked_add(255));
            total = bytes
                .and_then(|b| total.checked_add(b & !255))
                .ok_or_else(|| bad(OP, format!("scratch for {p:?} overflows")))?;
        }
    }
    let scratch = Scratch::new(dev, total)?;
    let srcs = [(a, p.lda, p.shape.a_batch_stride), (b, p.ldb, p.shape.b_batch_stride)];
    let mut ptrs = [a, b, c];
    for (i, l) in layouts.iter().enumerate() {
        let Some(l) = l else { continue };
        ptrs[i] = scratch.ptr + offsets[i] as u64;
        let dst = (ptrs[i], l.ld, l.stride);
        let dims = (l.copies, l.rows, l.cols);
        if i < 2 {
            // SAFETY: the caller vouches for the source; the scratch holds
            // `l.elems()` elements at this offset.
            unsafe { copy_matrices(dev, sizes[i], dims, srcs[i], dst)? };
        } else if p.beta != 0.0 {
            // SAFETY: as above, for C.
            unsafe { copy_matrices(dev, sizes[i], dims, (c, p.ldc, p.c_batch_stride), dst)? };
        }
    }
    run(&q, ptrs[0], ptrs[1], ptrs[2])?;
    if let Some(l) = layouts[2] {
        let src = (ptrs[2], l.ld, l.stride);
        // SAFETY: the scratch holds the staged C; the caller vouches for `c`.
        unsafe {
            copy_matrices(
                dev,
                sizes[2],
                (l.copies, l.rows, l.cols),
                src,
                (c, p.ldc, p.c_batch_stride),
            )?
        };
    }
    drop(scratch);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaDType::{BF16, F16, F32};
    use crate::gemm::GemmShape;

    /// The LM head's three products at the benchmark model's size (8192
    /// tokens, vocabulary 259, hidden 1024), bf16 in and out.
    fn lm_head() -> [GemmProblem; 3] {
        let (t, v, h) = (8192, 259, 1024);
        let shape =
            |ta, tb, m, n, k| GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
        [shape(false, true, t, v, h), shape(false, false, t, h, v), shape(true, false, v, h, t)]
            .map(|s| GemmProblem::new(s, BF16, BF16))
    }

    const AT: [DevPtr; 3] = [1 << 20, 2 << 20, 3 << 20];

    #[test]
    fn policies_parse() {
        assert_eq!(PadPolicy::parse("auto"), Some(PadPolicy::Auto));
        assert_eq!(PadPolicy::parse("always"), Some(PadPolicy::Always));
        assert_eq!(PadPolicy::parse("never"), Some(PadPolicy::Never));
        assert_eq!(PadPolicy::parse("yes"), None);
    }

    #[test]
    fn auto_pads_the_lm_head_backward_inputs_for_tpar_only() {
        let [fwd, dx, dw] = lm_head();
        let plan = |p: &GemmProblem, r, pol| PadPlan::choose(p, AT, r, pol);
        // forward: only C (ldc 259) is unaligned; auto leaves C alone
        assert!(plan(&fwd, PadRoute::Ours, PadPolicy::Auto).is_empty());
        assert_eq!(
            plan(&fwd, PadRoute::Ours, PadPolicy::Always),
            PadPlan { a: false, b: false, c: true }
        );
        // input gradient (lda 259) and weight gradient (A read transposed, lda 259)
        for p in [dx, dw] {
            let want = PadPlan { a: true, b: false, c: false };
            assert_eq!(plan(&p, PadRoute::Ours, PadPolicy::Auto), want);
            assert_eq!(plan(&p, PadRoute::Ours, PadPolicy::Always), want);
            assert!(plan(&p, PadRoute::Vendor, PadPolicy::Auto).is_empty());
            assert_eq!(plan(&p, PadRoute::Vendor, PadPolicy::Always), want);
            assert!(plan(&p, PadRoute::Ours, PadPolicy::Never).is_empty());
        }
        // the padded problem: same sizes, A's row stride 259 -> 320
        let q = plan(&dw, PadRoute::Ours, PadPolicy::Auto).problem(&dw).unwrap();
        assert_eq!((q.shape.m, q.shape.n, q.shape.k, q.lda, q.ldb), (259, 1024, 8192, 320, 1024));
        assert!(q.is_vectorizable(AT[0], AT[1]));
    }

    #[test]
    fn auto_skips_small_aligned_and_f32_problems() {
        let small = GemmProblem::new(GemmShape::new(1, 96, 64, 259), BF16, BF16);
        let at = |p: &GemmProblem, pol| PadPlan::choose(p, AT, PadRoute::Ours, pol);
        assert!(at(&small, PadPolicy::Auto).is_empty());
        assert!(at(&small, PadPolicy::Always).a);
        let f32s = GemmProblem::new(GemmShape::new(1, 1024, 1024, 259), F32, F32);
        assert!(at(&f32s, PadPolicy::Always).is_empty());
        let aligned = GemmProblem::new(GemmShape::new(1, 1024, 1024, 256), F16, F32);
        assert!(at(&aligned, PadPolicy::Always).is_empty());
        // an unaligned base address alone is enough
        let p = PadPlan::choose(
            &aligned,
            [AT[0] + 2, AT[1], AT[2] + 4],
            PadRoute::Ours,
            PadPolicy::Always,
        );
        assert_eq!(p, PadPlan { a: true, b: false, c: true });
        // an odd batch stride with aligned rows
        let s = GemmShape { a_batch_stride: 1024 * 256 + 2, ..GemmShape::new(2, 1024, 1024, 256) };
        let odd = GemmProblem::new(s, BF16, BF16);
        assert!(at(&odd, PadPolicy::Auto).a);
        let q = at(&odd, PadPolicy::Auto).problem(&odd).unwrap();
        assert_eq!((q.lda, q.shape.a_batch_stride), (256, 1024 * 256));
    }

    #[test]
    fn broadcast_operands_stay_broadcast_and_c_is_padded_per_batch() {
        let s = GemmShape { b_batch_stride: 0, ..GemmShape::new(3, 96, 37, 64) };
        let p = GemmProblem::new(s, BF16, F32).with_leading_dims(64, 37, 37);
        let plan = PadPlan::choose(&p, AT, PadRoute::Ours, PadPolicy::Always);
        assert_eq!(plan, PadPlan { a: false, b: true, c: true });
        let q = plan.problem(&p).unwrap();
        assert_eq!((q.ldb, q.shape.b_batch_stride), (64, 0));
        assert_eq!((q.ldc, q.c_batch_stride), (64, 96 * 64));
        assert_eq!((q.shape.m, q.shape.n, q.shape.k, q.lda), (96, 37, 64, 64));
    }
}
