//! cuBLASLt matmuls: the GEMM of [`crate::cuda::ops::gemm::gemm`] on a GPU
//! (see [`crate::cuda::ops::gemm::GemmBackend`]) and the baseline the
//! benchmarks compare the kernels of `gemm.cu` with.
//!
//! It takes the same [`GemmProblem`] as [`crate::cuda::raw::gemm`] (row-major
//! operands, `trans_a` / `trans_b`, leading dimensions, batch strides with 0
//! broadcasting, `alpha` / `beta`), so both run any problem and compare on
//! it. Inputs bf16, f16 or f32; f32 accumulation (`CUBLAS_COMPUTE_32F`: exact
//! f32 for f32 inputs, no TF32); output the input type or f32.
//!
//! cuBLAS is column-major: a row-major `[r, c]` matrix with row stride `ld` is
//! the column-major `[c, r]` matrix with the same `ld`, i.e. its transpose. So
//! `C = op(A) op(B)` (row-major) is computed as the column-major
//! `C^T = op(B)^T op(A)^T`: cuBLASLt's first operand is our B and its second
//! our A, each transposed exactly when ours is.
//!
//! cuBLASLt chooses an algorithm by a heuristic search that it would redo on
//! every call; [`CublasLt`] does it once per problem (shape, layout, types and
//! operand alignment) and caches the descriptors and the chosen algorithm.
//! Matmuls are queued one at a time: rank threads queueing them at once on one
//! handle got wrong results on an H100. Only usable on a GPU; constructing
//! one elsewhere is an error, not a panic.

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::device::CudaDevice;
use super::raw::gemm::GemmProblem;
use super::{cuda_error, CudaDType, DevPtr, GpuDevice};
use crate::{KernelError, Result};

const OP: &str = "cublaslt";

/// How many candidate algorithms the heuristic is asked for.
const HEURISTIC_CANDIDATES: usize = 8;

fn lt_error(what: &str, e: lt::CublasError) -> KernelError {
    cuda_error(OP, format!("{what} failed ({:?})", e.0))
}

/// Whether the cuBLASLt library can be loaded, with its version; or why not.
pub fn cublaslt_version() -> Result<usize> {
    // SAFETY: only `dlopen`s (and closes) the candidate names of cuBLASLt.
    if !unsafe { sys::is_culib_present() } {
        let names = cudarc::get_lib_name_candidates("cublasLt");
        return Err(cuda_error(
            OP,
            format!(
                "no cuBLASLt library could be loaded (tried {} names such as {}); install \
                 the CUDA toolkit or the nvidia-cublas wheel and put its lib directory on \
                 LD_LIBRARY_PATH",
                names.len(),
                names.iter().rev().take(3).cloned().collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    std::panic::catch_unwind(|| {
        // SAFETY: a plain query without arguments.
        unsafe { sys::cublasLtGetVersion() }
    })
    .map_err(|_| cuda_error(OP, "cuBLASLt loaded but cublasLtGetVersion is missing".to_string()))
}

fn data_type(t: CudaDType) -> sys::cudaDataType {
    match t {
        CudaDType::F32 => sys::cudaDataType::CUDA_R_32F,
        CudaDType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        CudaDType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// The largest power of two (at most 256) dividing `ptr`: the alignment the
/// heuristic may assume for an operand.
fn alignment(ptr: DevPtr) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

/// What the cached algorithm choice depends on: everything in the problem
/// except the scales, plus the operands' alignment and whether C is read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype_in: CudaDType,
    dtype_out: CudaDType,
    trans_a: bool,
    trans_b: bool,
    dims: [usize; 4],
    lds: [usize; 3],
    strides: [usize; 3],
    /// Alignments of A, B, C and D (the output; C's address when in place).
    align: [u32; 4],
    reads_c: bool,
}

/// Owned cuBLASLt descriptors of one problem and its chosen algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

// SAFETY: the descriptors are plain host-side objects that cuBLASLt only reads
// during a matmul; they are not tied to a thread.
unsafe impl Send for Plan {}
// SAFETY: as above; nothing mutates them after the plan is built.
unsafe impl Sync for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once for this plan and is destroyed
        // once (null ones, from a half-built plan, are skipped).
        unsafe {
            for l in [self.a, self.b, self.c] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A matmul preference, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created once by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// Sets one attribute of a descriptor from a typed value.
///
/// # Safety
/// `set` must be the cuBLASLt setter for `handle`'s kind, and `T` the type the
/// attribute expects.
unsafe fn set_attr<H, A, T>(
    set: unsafe fn(H, A, *const c_void, usize) -> std::result::Result<(), lt::CublasError>,
    handle: H,
    attr: A,
    value: T,
    what: &str,
) -> Result<()> {
    // SAFETY: the caller guarantees the setter and the value type; the value
    // lives across the call.
    unsafe { set(handle, attr, &value as *const T as *const c_void, size_of::<T>()) }
        .map_err(|e| lt_error(what, e))
}

/// A cuBLASLt handle on one [`CudaDevice`], with its workspace and the
/// per-problem plan cache. Matmuls run on the device's stream.
pub struct CublasLt {
    dev: Arc<CudaDevice>,
    handle: sys::cublasLtHandle_t,
    workspace: DevPtr,
    workspace_bytes: usize,
    /// Each problem's plan, or why it has none (the heuristic is not asked twice).
    plans: Mutex<HashMap<PlanKey, Result<Arc<Plan>>>>,
    /// Held while a matmul is queued: concurrent `cublasLtMatmul` calls on one
    /// handle and one plan's descriptors computed wrong results on an H100
    /// (four rank threads sharing the device), so calls queue one at a time.
    queue: Mutex<()>,
}

// SAFETY: the handle is used under the plan lock or, for matmuls, under the
// queue lock, on the one stream of `dev`.
unsafe impl Send for CublasLt {}
// SAFETY: as above.
unsafe impl Sync for CublasLt {}

impl fmt::Debug for CublasLt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CublasLt({}, {} MiB workspace, {} cached plans)",
            crate::cuda::Launcher::describe(self.dev.as_ref()),
            self.workspace_bytes >> 20,
            self.cached_plans()
        )
    }
}

impl Drop for CublasLt {
    fn drop(&mut self) {
        lock(&self.plans).clear();
        // SAFETY: created once in `new`, destroyed once; the workspace came from
        // this device's `alloc` with this size, and its stream-ordered free
        // follows every matmul queued on the stream.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
            self.dev.free(self.workspace, self.workspace_bytes);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CublasLt {
    /// A handle on `dev` with the workspace NVIDIA recommends (32 MiB on
    /// Hopper and newer, 4 MiB before). Fails cleanly without cuBLASLt.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<CublasLt> {
        let bytes = if dev.compute_capability().0 >= 9 { 32 << 20 } else { 4 << 20 };
        CublasLt::with_workspace(dev, bytes)
    }

    /// A handle with `workspace_bytes` of workspace (0 allowed: fewer algorithms).
    pub fn with_workspace(dev: &Arc<CudaDevice>, workspace_bytes: usize) -> Result<CublasLt> {
        cublaslt_version()?;
        dev.context()
            .bind_to_thread()
            .map_err(|e| super::device::driver_error(OP, "binding the context", e))?;
        let handle = lt::create_handle().map_err(|e| lt_error("cublasLtCreate", e))?;
        let workspace = match dev.alloc(workspace_bytes) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the handle was just created and is not used elsewhere.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(e);
            }
        };
        Ok(CublasLt {
            dev: dev.clone(),
            handle,
            workspace,
            workspace_bytes,
            plans: Mutex::new(HashMap::new()),
            queue: Mutex::new(()),
        })
    }

    /// The device the matmuls run on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Workspace size in bytes.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace_bytes
    }

    /// How many problems have a cached algorithm choice.
    pub fn cached_plans(&self) -> usize {
        lock(&self.plans).values().filter(|p| p.is_ok()).count()
    }

    /// `C[b] = alpha * op(A[b]) op(B[b]) + beta * C[b]` for every batch, with the
    /// layouts of `p` (row-major, as [`crate::cuda::raw::gemm`]); queued on the
    /// device's stream.
    ///
    /// # Safety
    /// `a`, `b` and `c` must be device memory of this device spanning the
    /// extents `p` describes, in `p`'s element types, and C must not overlap A
    /// or B.
    pub unsafe fn matmul(&self, p: &GemmProblem, a: DevPtr, b: DevPtr, c: DevPtr) -> Result<()> {
        // SAFETY: forwarded from the caller (C is also the output).
        unsafe { self.matmul_to(p, a, b, c, c) }
    }

    /// [`CublasLt::matmul`] out of place: `D[b] = alpha * op(A[b]) op(B[b]) +
    /// beta * C[b]`, C read and D written with the same layout (C's leading
    /// dimension and batch stride), so a residual add needs no copy of the
    /// residual into the output first. `c == d` is [`CublasLt::matmul`].
    ///
    /// # Safety
    /// As [`CublasLt::matmul`], for `d` too: `d` spans C's extent, and D
    /// overlaps neither A nor B, nor C unless it is C.
    pub unsafe fn matmul_to(
        &self,
        p: &GemmProblem,
        a: DevPtr,
        b: DevPtr,
        c: DevPtr,
        d: DevPtr,
    ) -> Result<()> {
        p.validate()?;
        if a == 0 || b == 0 || c == 0 || d == 0 {
            return Err(cuda_error(OP, "a null operand address".to_string()));
        }
        let s = &p.shape;
        let key = PlanKey {
            dtype_in: p.dtype_in,
            dtype_out: p.dtype_out,
            trans_a: s.trans_a,
            trans_b: s.trans_b,
            dims: [s.batch, s.m, s.n, s.k],
            lds: [p.lda, p.ldb, p.ldc],
            strides: [s.a_batch_stride, s.b_batch_stride, p.c_batch_stride],
            align: [alignment(a), alignment(b), alignment(c), alignment(d)],
            reads_c: p.beta != 0.0,
        };
        let plan = self.plan(&key)?;
        self.dev
            .context()
            .bind_to_thread()
            .map_err(|e| super::device::driver_error(OP, "binding the context", e))?;
        let (alpha, beta) = (p.alpha, p.beta);
        let stream = self.dev.stream().cu_stream() as sys::cudaStream_t;
        let _queued = lock(&self.queue);
        // SAFETY: the plan's descriptors describe exactly these operands (the
        // caller guarantees the memory); cuBLASLt's first operand is our B and
        // its second our A (see the module docs); C (input) and D (output)
        // share one layout; the scales are host f32 values that live across the
        // call; the workspace belongs to this handle and is used on one stream.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                plan.a,
                a as *const c_void,
                plan.b,
                c as *const c_void,
                plan.c,
                d as *mut c_void,
                plan.c,
                &plan.algo,
                self.workspace as *mut c_void,
                plan.workspace,
                stream,
            )
        }
        .map_err(|e| lt_error("cublasLtMatmul", e))
    }

    /// The cached plan of `key`, building it (and running the heuristic) on first
    /// use; a problem without one fails the same way again without a new search.
    fn plan(&self, key: &PlanKey) -> Result<Arc<Plan>> {
        let mut plans = lock(&self.plans);
        plans.entry(key.clone()).or_insert_with(|| self.build_plan(key).map(Arc::new)).clone()
    }

    fn build_plan(&self, key: &PlanKey) -> Result<Plan> {
        let [batch, m, n, k] = key.dims;
        let [lda, ldb, ldc] = key.lds;
        let [sa, sb, sc] = key.strides;
        let i64_of = |what: &str, v: usize| {
            i64::try_from(v).map_err(|_| cuda_error(OP, format!("{what} = {v} does not fit i64")))
        };
        let batch_i32 = i32::try_from(batch)
            .map_err(|_| cuda_error(OP, format!("batch {batch} does not fit i32")))?;

        let mut plan = Plan {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            // SAFETY: a plain-data struct that the heuristic overwrites.
            algo: unsafe { std::mem::zeroed() },
            workspace: 0,
        };
        plan.desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| lt_error("cublasLtMatmulDescCreate", e))?;
        // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let op = |t: bool| i32::from(t);
        // SAFETY: matmul-descriptor setters with the i32 (cublasOperation_t)
        // values TRANSA / TRANSB take.
        unsafe {
            set_attr(
                lt::set_matmul_desc_attribute,
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                op(key.trans_b),
                "setting TRANSA",
            )?;
            set_attr(
                lt::set_matmul_desc_attribute,
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                op(key.trans_a),
                "setting TRANSB",
            )?;
        }

        // Column-major views (rows, cols) of the stored operands:
        //   cuBLASLt's A = our B: [n, k] (stored [k, n] row-major), or [k, n] when trans_b;
        //   cuBLASLt's B = our A: [k, m] (stored [m, k] row-major), or [m, k] when trans_a;
        //   C: [n, m] with ld = ldc.
        let (ar, ac) = if key.trans_b { (k, n) } else { (n, k) };
        let (br, bc) = if key.trans_a { (m, k) } else { (k, m) };
        let din = data_type(key.dtype_in);
        let dout = data_type(key.dtype_out);
        let layouts = [
            (din, ar, ac, ldb, sb, "our B"),
            (din, br, bc, lda, sa, "our A"),
            (dout, n, m, ldc, sc, "C"),
        ];
        for (i, (dt, rows, cols, ld, stride, what)) in layouts.into_iter().enumerate() {
            let l = lt::create_matrix_layout(dt, rows as u64, cols as u64, i64_of("ld", ld)?)
                .map_err(|e| lt_error(&format!("cublasLtMatrixLayoutCreate ({what})"), e))?;
            match i {
                0 => plan.a = l,
                1 => plan.b = l,
                _ => plan.c = l,
            }
            if batch > 1 {
                // SAFETY: layout setters with the i32 / i64 values BATCH_COUNT
                // and STRIDED_BATCH_OFFSET take.
                unsafe {
                    set_attr(
                        lt::set_matrix_layout_attribute,
                        l,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        batch_i32,
                        "setting BATCH_COUNT",
                    )?;
                    set_attr(
                        lt::set_matrix_layout_attribute,
                        l,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        i64_of("batch stride", stride)?,
                        "setting STRIDED_BATCH_OFFSET",
                    )?;
                }
            }
        }

        let pref = Pref(
            lt::create_matmul_pref().map_err(|e| lt_error("cublasLtMatmulPreferenceCreate", e))?,
        );
        type PA = sys::cublasLtMatmulPreferenceAttributes_t;
        let [al_a, al_b, al_c, al_d] = key.align;
        // SAFETY: preference setters with the u64 / u32 values these attributes take.
        unsafe {
            set_attr(
                lt::set_matmul_pref_attribute,
                pref.0,
                PA::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                self.workspace_bytes as u64,
                "setting MAX_WORKSPACE_BYTES",
            )?;
            // cuBLASLt's A is our B and its B our A; D is the output (C when in place).
            for (attr, v) in [
                (PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_b),
                (PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_a),
                (PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c),
                (PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_d),
            ] {
                set_attr(lt::set_matmul_pref_attribute, pref.0, attr, v, "setting MIN_ALIGNMENT")?;
            }
        }

        // SAFETY: a plain-data array the heuristic fills.
        let mut results: [sys::cublasLtMatmulHeuristicResult_t; HEURISTIC_CANDIDATES] =
            unsafe { std::mem::zeroed() };
        let mut found: i32 = 0;
        // SAFETY: every descriptor is live; `results` has room for the number
        // of candidates requested; `found` is a live local.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                pref.0,
                HEURISTIC_CANDIDATES as i32,
                results.as_mut_ptr(),
                &mut found,
            )
        }
        .result()
        .map_err(|e| lt_error("cublasLtMatmulAlgoGetHeuristic", e))?;
        let found = usize::try_from(found).unwrap_or(0).min(HEURISTIC_CANDIDATES);
        let best = results[..found]
            .iter()
            .find(|r| {
                r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && r.workspaceSize <= self.workspace_bytes
            })
            .ok_or_else(|| {
                cuda_error(
                    OP,
                    format!(
                        "no cuBLASLt algorithm for {:?} x {:?} -> {:?}, trans_a {} trans_b {}, \
                         batch {batch} m {m} n {n} k {k}, ld {lda}/{ldb}/{ldc}, alignment {:?}",
                        key.dtype_in,
                        key.dtype_in,
                        key.dtype_out,
                        key.trans_a,
                        key.trans_b,
                        key.align
                    ),
                )
            })?;
        plan.algo = best.algo;
        plan.workspace = best.workspaceSize;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1001), 1);
    }

    /// Rounds through the storage type of `t`, and back to f64.
    fn round(t: CudaDType, v: f64) -> f64 {
        match t {
            CudaDType::F32 => v as f32 as f64,
            CudaDType::BF16 => half::bf16::from_f64(v).to_f64(),
            CudaDType::F16 => half::f16::from_f64(v).to_f64(),
        }
    }

    /// Uploads values (already representable) in the storage type of `t`.
    fn upload(dev: &Arc<CudaDevice>, t: CudaDType, v: &[f64]) -> crate::cuda::DeviceBuffer {
        match t {
            CudaDType::F32 => dev.upload(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
            CudaDType::BF16 => {
                dev.upload(&v.iter().map(|&x| half::bf16::from_f64(x)).collect::<Vec<_>>())
            }
            CudaDType::F16 => {
                dev.upload(&v.iter().map(|&x| half::f16::from_f64(x)).collect::<Vec<_>>())
            }
        }
        .unwrap()
    }

    fn download(dev: &Arc<CudaDevice>, t: CudaDType, b: &crate::cuda::DeviceBuffer) -> Vec<f64> {
        match t {
            CudaDType::F32 => dev.download::<f32>(b).unwrap().iter().map(|&x| x as f64).collect(),
            CudaDType::BF16 => {
                dev.download::<half::bf16>(b).unwrap().iter().map(|x| x.to_f64()).collect()
            }
            CudaDType::F16 => {
                dev.download::<half::f16>(b).unwrap().iter().map(|x| x.to_f64()).collect()
            }
        }
    }

    #[test]
    fn gpu_matches_a_cpu_reference_in_every_layout() {
        use crate::gemm::GemmShape;
        let dev = match CudaDevice::new(0) {
            Ok(d) => d,
            Err(e) => {
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "skipping the cuBLASLt test (no GPU): {e}");
                return;
            }
        };
        let lt = CublasLt::new(&dev).unwrap();
        let (batch, m, n, k) = (3, 37, 29, 45);
        let mut seed = 0x2545_f491_u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 2001) as f64 / 1000.0 - 1.0
        };
        use CudaDType::*;
        for (din, dout, tol) in
            [(F32, F32, 1e-4), (BF16, F32, 1e-4), (BF16, BF16, 1e-2), (F16, F16, 2e-3)]
        {
            for (trans_a, trans_b) in [(false, false), (false, true), (true, false), (true, true)] {
                for broadcast_b in [false, true] {
                    let mut shape = GemmShape::new(batch, m, n, k);
                    shape.trans_a = trans_a;
                    shape.trans_b = trans_b;
                    if broadcast_b {
                        shape.b_batch_stride = 0;
                    }
                    let p = GemmProblem::new(shape, din, dout).with_scale(1.5, 0.5);
                    let a: Vec<f64> = (0..batch * m * k).map(|_| round(din, rnd())).collect();
                    let b: Vec<f64> = (0..batch * k * n).map(|_| round(din, rnd())).collect();
                    let c0: Vec<f64> = (0..batch * m * n).map(|_| round(dout, rnd())).collect();
                    let (da, db, dc) =
                        (upload(&dev, din, &a), upload(&dev, din, &b), upload(&dev, dout, &c0));
                    // SAFETY: the buffers hold the extents the problem spans.
                    unsafe { lt.matmul(&p, da.ptr(), db.ptr(), dc.ptr()).unwrap() };
                    let got = download(&dev, dout, &dc);
                    for bi in 0..batch {
                        let (oa, ob) = (bi * shape.a_batch_stride, bi * shape.b_batch_stride);
                        for i in 0..m {
                            for j in 0..n {
                                let mut acc = 0.0;
                                for q in 0..k {
                                    let av = if trans_a {
                                        a[oa + q * p.lda + i]
                                    } else {
                                        a[oa + i * p.lda + q]
                                    };
                                    let bv = if trans_b {
                                        b[ob + j * p.ldb + q]
                                    } else {
                                        b[ob + q * p.ldb + j]
                                    };
                                    acc += av * bv;
                                }
                                let at = bi * m * n + i * n + j;
                                let want = 1.5 * acc + 0.5 * c0[at];
                                let err = (got[at] - want).abs() / want.abs().max(1.0);
                                assert!(
                                    err <= tol,
                                    "{din:?}->{dout:?} ta {trans_a} tb {trans_b} bcast {broadcast_b} \
                                     [{bi},{i},{j}]: got {} want {want}",
                                    got[at]
                                );
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(lt.cached_plans(), 4 * 4 * 2);
    }

    #[test]
    fn no_library_is_an_error_not_a_panic() {
        // With cuBLASLt present this reports its version; without, an error.
        match cublaslt_version() {
            Ok(v) => assert!(v > 0),
            Err(e) => assert!(matches!(e, KernelError::Cuda { .. })),
        }
    }
}
