//! Fused AdamW step (`cuda/adamw.cu`) over flat buffers, as
//! [`crate::adamw::adamw_step`]: the hyper-parameters are folded into f32
//! coefficients on the host exactly as the CPU kernel folds them, and each
//! element follows the same f32 formula with every operation explicitly
//! rounded (never contracted into a fused multiply-add), so the results are the
//! CPU kernel's bits on any device and compiler.
//!
//! Parameters are f32, bf16 or f16; gradients have the parameters' dtype or
//! are f32 (e.g. gradients reduced in f32 for bf16 parameters); the moment
//! buffers `exp_avg` and `exp_avg_sq` are f32.
//!
//! [`adamw_step_each`] runs the same step over many tensors, up to
//! [`MULTI_MAX`] a launch (PyTorch's foreach AdamW), with the same arithmetic
//! per element as [`adamw_step`]: the same bits.
//!
//! [`adamw_step_with_copy`] and [`adamw_step_each_with_copies`] (f32 parameters and
//! gradients) also write each updated parameter rounded to bf16 or f16 into a working
//! copy in the same pass: the copy mixed-precision training computes with, the bits a
//! separate cast of the updated parameter gives (round to nearest even); the update
//! itself is [`adamw_step`]'s, bit for bit.

use bytemuck::{Pod, Zeroable};

use super::multi::{block_starts, MULTI_MAX};
use super::{bad, check_ptr, to_i64};
use crate::adamw::AdamWParams;
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::Result;

/// The coefficients of one step, folded from [`AdamWParams`] on the host.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct AdamwCoef {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `1 - beta1`.
    pub w1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub w2: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// Padding.
    pub pad: f32,
}

/// Arguments of `tpar_adamw_*` and `tpar_adamw_f32grad_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct AdamwArgs {
    /// Parameters `[n]` (updated).
    pub param: DevPtr,
    /// Gradients `[n]`.
    pub grad: DevPtr,
    /// f32 first moments `[n]` (updated).
    pub exp_avg: DevPtr,
    /// f32 second moments `[n]` (updated).
    pub exp_avg_sq: DevPtr,
    /// The working copy `[n]` (written by `tpar_adamw_f32_copy_*`; 0 otherwise).
    pub work: DevPtr,
    /// Elements.
    pub n: i64,
    /// The step's coefficients.
    pub coef: AdamwCoef,
    /// The address of an [`AdamwCoef`] in device memory the kernel reads instead of
    /// `coef` (0: `coef`).
    pub coef_dev: DevPtr,
}

/// Arguments of `tpar_multi_adamw_*` and `tpar_multi_adamw_f32grad_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct MultiAdamwArgs {
    /// Tensor `t`'s parameters (updated).
    pub param: [DevPtr; MULTI_MAX],
    /// Tensor `t`'s gradients.
    pub grad: [DevPtr; MULTI_MAX],
    /// Tensor `t`'s f32 first moments (updated).
    pub exp_avg: [DevPtr; MULTI_MAX],
    /// Tensor `t`'s f32 second moments (updated).
    pub exp_avg_sq: [DevPtr; MULTI_MAX],
    /// Tensor `t`'s working copy (written by `tpar_multi_adamw_f32_copy_*` unless 0).
    pub work: [DevPtr; MULTI_MAX],
    /// Tensor `t`'s elements.
    pub n: [i64; MULTI_MAX],
    /// Tensor `t`'s first block (its blocks end at the next tensor's first, the
    /// last tensor's at `total`).
    pub first: [i32; MULTI_MAX],
    /// Blocks in all.
    pub total: i32,
    /// Tensors used.
    pub count: i32,
    /// The step's coefficients.
    pub coef: AdamwCoef,
    /// The address of an [`AdamwCoef`] in device memory the kernel reads instead of
    /// `coef` (0: `coef`).
    pub coef_dev: DevPtr,
}

/// The device buffers of one tensor's step in [`adamw_step_each`], each of `n`
/// elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdamwBuffers {
    /// Parameters (updated).
    pub param: DevPtr,
    /// Gradients.
    pub grad: DevPtr,
    /// f32 first moments (updated).
    pub exp_avg: DevPtr,
    /// f32 second moments (updated).
    pub exp_avg_sq: DevPtr,
    /// Elements.
    pub n: usize,
}

/// Threads per block.
const BLOCK: u32 = 256;
/// Elements per thread per grid-stride step.
const VEC: usize = 8;
/// Most blocks: enough to fill an H200 several times; the kernel grid-strides.
const MAX_BLOCKS: u32 = 4096;

/// The coefficients of one step, folded as the CPU kernel folds them (in f64,
/// then rounded to f32): what a capturable step reads from device memory.
pub fn coefficients(h: &AdamWParams) -> AdamwCoef {
    let step = i32::try_from(h.step).unwrap_or(i32::MAX);
    let bc1 = 1.0 - h.beta1.powi(step);
    let bc2 = 1.0 - h.beta2.powi(step);
    AdamwCoef {
        decay: (1.0 - h.lr * h.weight_decay) as f32,
        w1: (1.0 - h.beta1) as f32,
        beta2: h.beta2 as f32,
        w2: (1.0 - h.beta2) as f32,
        step_size: (h.lr / bc1) as f32,
        bc2_sqrt: bc2.sqrt() as f32,
        eps: h.eps as f32,
        pad: 0.0,
    }
}

/// The kernel variant for `dtype` parameters with `grad_dtype` gradients:
/// `bf16` (same dtype) or `f32grad_bf16` (f32 gradients).
fn variant(op: &'static str, dtype: CudaDType, grad_dtype: CudaDType) -> Result<String> {
    match (dtype, grad_dtype) {
        (d, g) if d == g => Ok(d.suffix().to_string()),
        (d, CudaDType::F32) => Ok(format!("f32grad_{}", d.suffix())),
        (d, g) => Err(bad(
            op,
            format!("{} gradients for {} parameters (same dtype or f32)", g.suffix(), d.suffix()),
        )),
    }
}

/// One in-place AdamW step on `n` parameters of `dtype` at `param` with
/// gradients of `grad_dtype` (`dtype` or [`CudaDType::F32`]) at `grad`,
/// updating the f32 moment buffers `exp_avg` and `exp_avg_sq`. `h.step` must
/// be at least 1.
///
/// # Safety
/// The four buffers must be device buffers of `n` elements, the updated ones
/// (`param`, `exp_avg`, `exp_avg_sq`) not overlapping any other.
pub unsafe fn adamw_step(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    param: DevPtr,
    grad: DevPtr,
    exp_avg: DevPtr,
    exp_avg_sq: DevPtr,
    n: usize,
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step";
    let name = format!("tpar_adamw_{}", variant(OP, dtype, grad_dtype)?);
    let bufs = AdamwBuffers { param, grad, exp_avg, exp_avg_sq, n };
    // SAFETY: forwarded from the caller.
    unsafe { step_one(launcher, OP, &name, dtype, grad_dtype, None, &bufs, h) }
}

/// [`adamw_step`] on `n` f32 parameters with f32 gradients that also writes each
/// updated parameter, rounded to `copy_dtype` ([`CudaDType::BF16`] or
/// [`CudaDType::F16`]), into the working copy `copy` of `n` elements: the bits
/// a separate cast of the updated parameters gives. The update is
/// [`adamw_step`]'s, bit for bit.
///
/// # Safety
/// As [`adamw_step`]; `copy` is a device buffer of `n` elements of
/// `copy_dtype` overlapping no other buffer.
pub unsafe fn adamw_step_with_copy(
    launcher: &dyn Launcher,
    param: DevPtr,
    grad: DevPtr,
    exp_avg: DevPtr,
    exp_avg_sq: DevPtr,
    copy_dtype: CudaDType,
    copy: DevPtr,
    n: usize,
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_with_copy";
    let name =
        format!("tpar_adamw_{}", copy_variant(OP, CudaDType::F32, CudaDType::F32, copy_dtype)?);
    let bufs = AdamwBuffers { param, grad, exp_avg, exp_avg_sq, n };
    let (f32d, copy) = (CudaDType::F32, Some((copy_dtype, copy)));
    // SAFETY: forwarded from the caller.
    unsafe { step_one(launcher, OP, &name, f32d, f32d, copy, &bufs, h) }
}

/// The kernel variant writing a `copy` working copy for `dtype` parameters with
/// `grad_dtype` gradients: `f32_copy_bf16` or `f32_copy_f16`.
fn copy_variant(
    op: &'static str,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    copy: CudaDType,
) -> Result<String> {
    match (dtype, grad_dtype, copy) {
        (CudaDType::F32, CudaDType::F32, c @ (CudaDType::BF16 | CudaDType::F16)) => {
            Ok(format!("f32_copy_{}", c.suffix()))
        }
        (d, g, c) => Err(bad(
            op,
            format!(
                "a {} working copy of {} parameters with {} gradients (the fused kernels \
                 write bf16 or f16 copies of f32 parameters with f32 gradients)",
                c.suffix(),
                d.suffix(),
                g.suffix()
            ),
        )),
    }
}

/// Checks one tensor's buffers (and its working copy, when it has one).
fn check_bufs(
    op: &'static str,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    b: &AdamwBuffers,
    copy: Option<(CudaDType, DevPtr)>,
) -> Result<i64> {
    let n64 = to_i64(op, "elements", b.n)?;
    check_ptr(op, "param", b.param, b.n, dtype.size())?;
    check_ptr(op, "grad", b.grad, b.n, grad_dtype.size())?;
    check_ptr(op, "exp_avg", b.exp_avg, b.n, 4)?;
    check_ptr(op, "exp_avg_sq", b.exp_avg_sq, b.n, 4)?;
    if let Some((cd, ptr)) = copy {
        check_ptr(op, "copy", ptr, b.n, cd.size())?;
    }
    Ok(n64)
}

/// One tensor's step through kernel `name`, with its working copy if any.
///
/// # Safety
/// As [`adamw_step_with_copy`].
#[allow(clippy::too_many_arguments)]
unsafe fn step_one(
    launcher: &dyn Launcher,
    op: &'static str,
    name: &str,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    copy: Option<(CudaDType, DevPtr)>,
    b: &AdamwBuffers,
    h: &AdamWParams,
) -> Result<()> {
    if h.step == 0 {
        return Err(bad(op, "step must start at 1"));
    }
    let coef = coefficients(h);
    let n64 = check_bufs(op, dtype, grad_dtype, b, copy)?;
    if b.n == 0 {
        return Ok(());
    }
    let args = AdamwArgs {
        param: b.param,
        grad: b.grad,
        exp_avg: b.exp_avg,
        exp_avg_sq: b.exp_avg_sq,
        work: copy.map_or(0, |(_, p)| p),
        n: n64,
        coef,
        coef_dev: 0,
    };
    let cfg = LaunchConfig::for_items(b.n.div_ceil(VEC), BLOCK, MAX_BLOCKS);
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, name, cfg, &args) }
}

/// One in-place AdamW step, with the same hyper-parameters, on each tensor of
/// `tensors` (parameters of `dtype`, gradients of `grad_dtype`: `dtype` or
/// [`CudaDType::F32`]; f32 moments), one launch per [`MULTI_MAX`] tensors.
/// Each element gets [`adamw_step`]'s arithmetic. `h.step` must be at least 1.
///
/// # Safety
/// Each tensor's four buffers must be device buffers of its `n` elements on the
/// launcher's device; no updated buffer (`param`, `exp_avg`, `exp_avg_sq`)
/// overlaps any other buffer of any tensor.
pub unsafe fn adamw_step_each(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    tensors: &[AdamwBuffers],
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_each";
    let name = format!("tpar_multi_adamw_{}", variant(OP, dtype, grad_dtype)?);
    // SAFETY: forwarded from the caller.
    unsafe { step_many(launcher, OP, &name, dtype, grad_dtype, None, tensors, Coef::Host(h)) }
}

/// [`adamw_step_each`] on f32 parameters with f32 gradients that also writes each
/// tensor's updated parameters, rounded to `copy_dtype` ([`CudaDType::BF16`] or
/// [`CudaDType::F16`]), into its working copy `copies[i]` (of its `n` elements; 0:
/// no copy for that tensor) in the same launch: the bits a separate cast of the
/// updated parameters gives. The updates are [`adamw_step`]'s, bit for bit.
///
/// # Safety
/// As [`adamw_step_each`]; each non-zero `copies[i]` is a device buffer of tensor
/// `i`'s elements of `copy_dtype` overlapping no other buffer of any tensor.
pub unsafe fn adamw_step_each_with_copies(
    launcher: &dyn Launcher,
    copy_dtype: CudaDType,
    tensors: &[AdamwBuffers],
    copies: &[DevPtr],
    h: &AdamWParams,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_each_with_copies";
    let f32d = CudaDType::F32;
    let name = format!("tpar_multi_adamw_{}", copy_variant(OP, f32d, f32d, copy_dtype)?);
    if copies.len() != tensors.len() {
        return Err(bad(
            OP,
            format!("{} working copies for {} tensors", copies.len(), tensors.len()),
        ));
    }
    let copies = (copy_dtype, copies);
    // SAFETY: forwarded from the caller.
    unsafe { step_many(launcher, OP, &name, f32d, f32d, Some(copies), tensors, Coef::Host(h)) }
}

/// Every tensor's step through the multi-tensor kernel `name`, [`MULTI_MAX`] a
/// launch, each with its working copy (`copies`, 0 for none) when there are copies.
///
/// # Safety
/// As [`adamw_step_each_with_copies`].
#[allow(clippy::too_many_arguments)]
unsafe fn step_many(
    launcher: &dyn Launcher,
    op: &'static str,
    name: &str,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    copies: Option<(CudaDType, &[DevPtr])>,
    tensors: &[AdamwBuffers],
    coef: Coef<'_>,
) -> Result<()> {
    let (coef, coef_dev) = match coef {
        Coef::Host(h) if h.step == 0 => return Err(bad(op, "step must start at 1")),
        Coef::Host(h) => (coefficients(h), 0),
        Coef::Device(p) => {
            check_ptr(op, "coefficients", p, 1, std::mem::size_of::<AdamwCoef>())?;
            (AdamwCoef::zeroed(), p)
        }
    };
    let copy_of = |i: usize| match copies {
        Some((cd, ptrs)) if ptrs[i] != 0 => Some((cd, ptrs[i])),
        _ => None,
    };
    for (i, b) in tensors.iter().enumerate() {
        check_bufs(op, dtype, grad_dtype, b, copy_of(i))?;
    }
    for (g, group) in tensors.chunks(MULTI_MAX).enumerate() {
        let lens: Vec<usize> = group.iter().map(|b| b.n).collect();
        let (first, blocks) = block_starts(op, &lens)?;
        if blocks == 0 {
            continue;
        }
        let mut args = MultiAdamwArgs {
            param: [0; MULTI_MAX],
            grad: [0; MULTI_MAX],
            exp_avg: [0; MULTI_MAX],
            exp_avg_sq: [0; MULTI_MAX],
            work: [0; MULTI_MAX],
            n: [0; MULTI_MAX],
            first,
            total: blocks,
            count: group.len() as i32,
            coef,
            coef_dev,
        };
        for (t, b) in group.iter().enumerate() {
            args.param[t] = b.param;
            args.grad[t] = b.grad;
            args.exp_avg[t] = b.exp_avg;
            args.exp_avg_sq[t] = b.exp_avg_sq;
            args.work[t] = copy_of(g * MULTI_MAX + t).map_or(0, |(_, p)| p);
            args.n[t] = b.n as i64;
        }
        let cfg = LaunchConfig::grid([blocks as u32, 1, 1], BLOCK);
        // SAFETY: the caller vouches for the addresses; sizes are checked above.
        unsafe { launch(launcher, name, cfg, &args)? };
    }
    Ok(())
}

/// Where a multi-tensor step takes its coefficients from.
#[derive(Clone, Copy)]
enum Coef<'a> {
    /// Folded from these hyper-parameters into the launch's arguments.
    Host(&'a AdamWParams),
    /// Read by the kernel from this device address (an [`AdamwCoef`]).
    Device(DevPtr),
}

/// The capturable form of [`adamw_step_each`] and [`adamw_step_each_with_copies`]:
/// the kernels read the step's coefficients from the [`AdamwCoef`] at `coef` in
/// device memory (written with [`coefficients`] of the step's hyper-parameters
/// before the kernels run) instead of from their arguments, so a CUDA graph that
/// captured these launches takes each step's learning rate and bias corrections
/// from there on every replay. `copies` (with their dtype, bf16 or f16; f32
/// parameters and gradients) are the working copies as in
/// [`adamw_step_each_with_copies`]. The arithmetic is the same, so with the same
/// coefficients the results are the same bits.
///
/// # Safety
/// As [`adamw_step_each_with_copies`] (or [`adamw_step_each`] without copies);
/// `coef` is device memory of the launcher's device holding an [`AdamwCoef`] when
/// the kernels run.
pub unsafe fn adamw_step_each_device_coef(
    launcher: &dyn Launcher,
    dtype: CudaDType,
    grad_dtype: CudaDType,
    tensors: &[AdamwBuffers],
    copies: Option<(CudaDType, &[DevPtr])>,
    coef: DevPtr,
) -> Result<()> {
    const OP: &str = "cuda_adamw_step_each_device_coef";
    let name = match copies {
        Some((cd, ptrs)) => {
            if ptrs.len() != tensors.len() {
                let what = format!("{} working copies for {} tensors", ptrs.len(), tensors.len());
                return Err(bad(OP, what));
            }
            format!("tpar_multi_adamw_{}", copy_variant(OP, dtype, grad_dtype, cd)?)
        }
        None => format!("tpar_multi_adamw_{}", variant(OP, dtype, grad_dtype)?),
    };
    let c = Coef::Device(coef);
    // SAFETY: forwarded from the caller.
    unsafe { step_many(launcher, OP, &name, dtype, grad_dtype, copies, tensors, c) }
}
