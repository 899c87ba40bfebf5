//! Vectorized f32 math for the kernels' hot loops: `exp` (softmax, attention,
//! cross-entropy) and the sigmoid family (SiLU).
//!
//! The instruction set is picked once at run time: AVX2 with FMA on x86 CPUs
//! that have it (8 lanes, two registers per block), otherwise portable code
//! (which the compiler still vectorizes with the baseline SSE2 of x86-64, or
//! the target's own SIMD elsewhere, without fused multiply-adds). Both paths
//! run the same polynomial, within 2 ulp of the correctly rounded `e^x` over
//! the whole f32 range, denormal results included; f64 math stays on libm.

mod lanes;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction set the vector functions run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// x86 AVX2 with fused multiply-add.
    Avx2Fma,
    /// Portable code: whatever the compile target vectorizes to, no FMA.
    Portable,
}

/// The detected [`Isa`], cached after the first call (0 = not yet detected).
static ISA: AtomicU8 = AtomicU8::new(0);

/// The instruction set this CPU runs the vector functions on.
pub fn isa() -> Isa {
    match ISA.load(Ordering::Relaxed) {
        1 => Isa::Avx2Fma,
        2 => Isa::Portable,
        _ => {
            let isa = detect();
            ISA.store(if isa == Isa::Avx2Fma { 1 } else { 2 }, Ordering::Relaxed);
            isa
        }
    }
}

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
fn detect() -> Isa {
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        Isa::Avx2Fma
    } else {
        Isa::Portable
    }
}

#[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
fn detect() -> Isa {
    Isa::Portable
}

/// The AVX2 + FMA instances of the lane bodies.
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
mod avx2 {
    use super::lanes;

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp(x: &mut [f32]) {
        lanes::map::<true>(x, lanes::exp1::<true>);
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sub_sum(x: &mut [f32], shift: f32) -> f32 {
        lanes::exp_sub_sum::<true>(x, shift)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sigmoid(x: &mut [f32]) {
        lanes::map::<true>(x, lanes::sigmoid1::<true>);
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu(x: &mut [f32]) {
        lanes::map::<true>(x, |v| v / (1.0 + lanes::exp1::<true>(-v)));
    }
}

/// Runs `$avx2` when `$isa` is AVX2 + FMA (and this is an x86 build), else `$portable`.
macro_rules! dispatch {
    ($isa:expr, $avx2:expr, $portable:expr) => {
        match $isa {
            #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
            // SAFETY: `Isa::Avx2Fma` is only used where the CPU has AVX2 and FMA
            // (`detect`, or a test that checked `isa()` first).
            Isa::Avx2Fma => unsafe { $avx2 },
            _ => $portable,
        }
    };
}

/// `x[i] = e^x[i]`.
pub fn exp(x: &mut [f32]) {
    exp_on(isa(), x)
}

/// `x[i] = e^(x[i] - shift)`; returns the sum of the new values (summed in
/// f32 over 16 lanes). The softmax step: `shift` is the row max.
pub fn exp_sub_sum(x: &mut [f32], shift: f32) -> f32 {
    exp_sub_sum_on(isa(), x, shift)
}

/// `x[i] = 1 / (1 + e^-x[i])`.
pub fn sigmoid(x: &mut [f32]) {
    sigmoid_on(isa(), x)
}

/// `x[i] = x[i] / (1 + e^-x[i])` (SiLU, as PyTorch computes it).
pub fn silu(x: &mut [f32]) {
    silu_on(isa(), x)
}

pub(crate) fn exp_on(isa: Isa, x: &mut [f32]) {
    dispatch!(isa, avx2::exp(x), lanes::map::<false>(x, lanes::exp1::<false>))
}

pub(crate) fn exp_sub_sum_on(isa: Isa, x: &mut [f32], shift: f32) -> f32 {
    dispatch!(isa, avx2::exp_sub_sum(x, shift), lanes::exp_sub_sum::<false>(x, shift))
}

pub(crate) fn sigmoid_on(isa: Isa, x: &mut [f32]) {
    dispatch!(isa, avx2::sigmoid(x), lanes::map::<false>(x, lanes::sigmoid1::<false>))
}

pub(crate) fn silu_on(isa: Isa, x: &mut [f32]) {
    dispatch!(isa, avx2::silu(x), lanes::map::<false>(x, |v| v / (1.0 + lanes::exp1::<false>(-v))))
}
