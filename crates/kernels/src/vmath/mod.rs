//! Vectorized f32 math for the kernels' hot loops: `exp` (softmax, attention,
//! cross-entropy) and the sigmoid family (SiLU).
//!
//! The instruction set is picked once at run time: AVX-512 on x86 CPUs that have
//! it (16 lanes, one register per block), else AVX2 with FMA (8 lanes, two
//! registers per block), otherwise portable code (which the compiler still
//! vectorizes with the baseline SSE2 of x86-64, or the target's own SIMD
//! elsewhere, without fused multiply-adds). Every path runs the same polynomial,
//! within 2 ulp of the correctly rounded `e^x` over the whole f32 range, denormal
//! results included; the two fused paths give the same bits, sums included (both
//! add over the same 16 lanes). f64 math stays on libm.

mod lanes;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction set the vector functions run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// x86 AVX-512 (foundation), with AVX2 and fused multiply-add.
    Avx512,
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
        1 => Isa::Avx512,
        2 => Isa::Avx2Fma,
        3 => Isa::Portable,
        _ => {
            let isa = detect();
            let code = match isa {
                Isa::Avx512 => 1,
                Isa::Avx2Fma => 2,
                Isa::Portable => 3,
            };
            ISA.store(code, Ordering::Relaxed);
            isa
        }
    }
}

/// Every instruction set this CPU can run the vector functions on, the portable code
/// first and [`isa`] last.
pub fn isas() -> Vec<Isa> {
    match isa() {
        Isa::Avx512 => vec![Isa::Portable, Isa::Avx2Fma, Isa::Avx512],
        Isa::Avx2Fma => vec![Isa::Portable, Isa::Avx2Fma],
        Isa::Portable => vec![Isa::Portable],
    }
}

/// [`exp`] on the instruction set `isa`, or on the portable code where this CPU
/// cannot run `isa` (see [`isas`]); for comparing the paths.
pub fn exp_with(isa: Isa, x: &mut [f32]) {
    let isa = if isas().contains(&isa) { isa } else { Isa::Portable };
    exp_on(isa, x)
}

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
fn detect() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    if avx2 && is_x86_feature_detected!("avx512f") {
        Isa::Avx512
    } else if avx2 {
        Isa::Avx2Fma
    } else {
        Isa::Portable
    }
}

#[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
fn detect() -> Isa {
    Isa::Portable
}

/// A module `$name` of the lane bodies compiled with the target features `$features`
/// (the CPU must have them: `$needs` in each function's safety note).
macro_rules! lane_fns {
    ($(#[$doc:meta])* $name:ident, $features:literal, $needs:literal) => {
        $(#[$doc])*
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        mod $name {
            use super::lanes;

            /// # Safety
            #[doc = $needs]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn exp(x: &mut [f32]) {
                lanes::map::<true>(x, lanes::exp1::<true>);
            }

            /// # Safety
            #[doc = $needs]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn exp_sub_sum(x: &mut [f32], shift: f32) -> f32 {
                lanes::exp_sub_sum::<true>(x, shift)
            }

            /// # Safety
            #[doc = $needs]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn sigmoid(x: &mut [f32]) {
                lanes::map::<true>(x, lanes::sigmoid1::<true>);
            }

            /// # Safety
            #[doc = $needs]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn silu(x: &mut [f32]) {
                lanes::map::<true>(x, |v| v / (1.0 + lanes::exp1::<true>(-v)));
            }
        }
    };
}

lane_fns!(
    /// The AVX2 + FMA instances of the lane bodies (two 8-lane registers per block).
    avx2,
    "avx2,fma",
    "The CPU must support AVX2 and FMA."
);
lane_fns!(
    /// The AVX-512 instances of the lane bodies (one 16-lane register per block).
    avx512,
    "avx512f,avx2,fma",
    "The CPU must support AVX-512F, AVX2 and FMA."
);

/// Runs `$f` from module `avx512` or `avx2` by `$isa` (on an x86 build), else
/// `$portable`.
macro_rules! dispatch {
    ($isa:expr, $f:ident($($arg:expr),*), $portable:expr) => {
        match $isa {
            #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
            // SAFETY: `Isa::Avx512` is only used where the CPU has AVX-512F, AVX2 and
            // FMA (`detect`, or a test that took it from `isas`).
            Isa::Avx512 => unsafe { avx512::$f($($arg),*) },
            #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
            // SAFETY: `Isa::Avx2Fma` is only used where the CPU has AVX2 and FMA
            // (as above).
            Isa::Avx2Fma => unsafe { avx2::$f($($arg),*) },
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
    dispatch!(isa, exp(x), lanes::map::<false>(x, lanes::exp1::<false>))
}

pub(crate) fn exp_sub_sum_on(isa: Isa, x: &mut [f32], shift: f32) -> f32 {
    dispatch!(isa, exp_sub_sum(x, shift), lanes::exp_sub_sum::<false>(x, shift))
}

pub(crate) fn sigmoid_on(isa: Isa, x: &mut [f32]) {
    dispatch!(isa, sigmoid(x), lanes::map::<false>(x, lanes::sigmoid1::<false>))
}

pub(crate) fn silu_on(isa: Isa, x: &mut [f32]) {
    dispatch!(isa, silu(x), lanes::map::<false>(x, |v| v / (1.0 + lanes::exp1::<false>(-v))))
}
