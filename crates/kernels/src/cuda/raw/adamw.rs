//! Fused AdamW step (`cuda/adamw.cu`) over flat buffers, as
//! [`crate::adamw::adamw_step`]: the hyper-parameters are folded into f32
//! coefficients on the host exactly as the CPU kernel folds them, and each
//! element follows the same f32 formula (a GPU may fuse multiply-adds, so
//! results agree to rounding).
//!
//! Parameters are f32, bf16 or f16; gradients have the parameters' dtype or
//! are f32 (e.g. gradients reduced in f32 for bf16 parameters); the moment
//! buffers `exp_avg` and `exp_avg_sq` are f32.

use bytemuck::{Pod, Zeroable};

use super::{bad, check_ptr};
use crate::adamw::AdamWParams;
use crate::cuda::{launch, CudaDType, DevPtr, LaunchConfig, Launcher};
use crate::Result;

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
    /// Elements.
    pub n: i64,
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

/// Threads per block.
const BLOCK: u32 = 256;
/// Elements per thread per grid-stride step.
const VEC: usize = 8;
/// Most blocks: enough to fill an H200 several times; the kernel grid-strides.
const MAX_BLOCKS: u32 = 4096;

/// The kernel arguments for one step, with the coefficients folded as the
/// CPU kernel folds them (in f64, then rounded to f32).
fn coefficients(h: &AdamWParams) -> AdamwArgs {
    let step = i32::try_from(h.step).unwrap_or(i32::MAX);
    let bc1 = 1.0 - h.beta1.powi(step);
    let bc2 = 1.0 - h.beta2.powi(step);
    AdamwArgs {
        param: 0,
        grad: 0,
        exp_avg: 0,
        exp_avg_sq: 0,
        n: 0,
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
    if h.step == 0 {
        return Err(bad(OP, "step must start at 1"));
    }
    let name = match (dtype, grad_dtype) {
        (d, g) if d == g => format!("tpar_adamw_{}", d.suffix()),
        (d, CudaDType::F32) => format!("tpar_adamw_f32grad_{}", d.suffix()),
        (d, g) => {
            return Err(bad(
                OP,
                format!(
                    "{} gradients for {} parameters (same dtype or f32)",
                    g.suffix(),
                    d.suffix()
                ),
            ))
        }
    };
    let n64 = i64::try_from(n).map_err(|_| bad(OP, format!("{n} elements overflow i64")))?;
    check_ptr(OP, "param", param, n, dtype.size())?;
    check_ptr(OP, "grad", grad, n, grad_dtype.size())?;
    check_ptr(OP, "exp_avg", exp_avg, n, 4)?;
    check_ptr(OP, "exp_avg_sq", exp_avg_sq, n, 4)?;
    if n == 0 {
        return Ok(());
    }
    let args = AdamwArgs { param, grad, exp_avg, exp_avg_sq, n: n64, ..coefficients(h) };
    let cfg = LaunchConfig::for_items(n.div_ceil(VEC), BLOCK, MAX_BLOCKS);
    // SAFETY: the caller vouches for the addresses; sizes are checked above.
    unsafe { launch(launcher, &name, cfg, &args) }
}
