//! Element types the kernels work on, and the accumulator each one computes in.

use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

use half::{bf16, f16};

/// The type a kernel accumulates in: `f32` for f32/bf16/f16 data, `f64` for f64 data.
pub trait Acc:
    num_traits::Float
    + Send
    + Sync
    + Default
    + Debug
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Sum
    + 'static
{
    /// Converts from `f64` (rounding to the accumulator's precision).
    fn of(v: f64) -> Self;
    /// Widens to `f64`.
    fn f64(self) -> f64;
    /// `x[i] = e^(x[i] - shift)`; returns the sum of the new values. Vectorized for
    /// f32 ([`crate::vmath`]); libm for f64.
    fn exp_sub_sum(x: &mut [Self], shift: Self) -> Self;
    /// `x[i] = 1 / (1 + e^-x[i])`.
    fn sigmoid_slice(x: &mut [Self]);
    /// `x[i] = x[i] / (1 + e^-x[i])` (SiLU).
    fn silu_slice(x: &mut [Self]);
}

impl Acc for f32 {
    #[inline(always)]
    fn of(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self as f64
    }
    fn exp_sub_sum(x: &mut [Self], shift: Self) -> Self {
        crate::vmath::exp_sub_sum(x, shift)
    }
    fn sigmoid_slice(x: &mut [Self]) {
        crate::vmath::sigmoid(x)
    }
    fn silu_slice(x: &mut [Self]) {
        crate::vmath::silu(x)
    }
}

impl Acc for f64 {
    #[inline(always)]
    fn of(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self
    }
    fn exp_sub_sum(x: &mut [Self], shift: Self) -> Self {
        let mut sum = 0.0;
        for v in x.iter_mut() {
            *v = (*v - shift).exp();
            sum += *v;
        }
        sum
    }
    fn sigmoid_slice(x: &mut [Self]) {
        x.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp()));
    }
    fn silu_slice(x: &mut [Self]) {
        x.iter_mut().for_each(|v| *v /= 1.0 + (-*v).exp());
    }
}

/// A floating-point element type stored in tensors (f32, f64, bf16, f16).
///
/// Half-precision types accumulate in `f32`; `f64` accumulates in `f64`.
pub trait Float: Copy + Send + Sync + Default + PartialOrd + Debug + 'static {
    /// The accumulator type used for reductions and intermediate math.
    type Acc: Acc;
    /// Short dtype name used in error messages (`"f32"`, `"bf16"`, ...).
    const NAME: &'static str;
    /// Widens to the accumulator type.
    fn to_acc(self) -> Self::Acc;
    /// Rounds an accumulator value to the storage type.
    fn from_acc(v: Self::Acc) -> Self;
    /// Widens to `f64`.
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.to_acc().f64()
    }
    /// Rounds an `f64` to the storage type.
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        Self::from_acc(Self::Acc::of(v))
    }
    /// `s` itself when the storage type is its own accumulator (`f32`, `f64`), so a
    /// kernel can read it in place instead of widening a copy; `None` for bf16 / f16.
    #[inline(always)]
    fn as_acc(s: &[Self]) -> Option<&[Self::Acc]> {
        let _ = s;
        None
    }
}

impl Float for f32 {
    type Acc = f32;
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn as_acc(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Float for f64 {
    type Acc = f64;
    const NAME: &'static str = "f64";
    #[inline(always)]
    fn to_acc(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_acc(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn as_acc(s: &[f64]) -> Option<&[f64]> {
        Some(s)
    }
}

impl Float for bf16 {
    type Acc = f32;
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Float for f16 {
    type Acc = f32;
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// An output element a kernel writes and never reads: `T` itself, or
/// `MaybeUninit<T>` for a new buffer the kernel initializes, which then needs no
/// zero-filling pass first. Kernels whose output is `&mut [O]` with `O: Out<T>` write
/// every element when they return `Ok` (each says so), so a caller may treat a
/// `MaybeUninit` buffer they filled as initialized; their `*_new` forms do this with
/// `tpar_memory::cache::filled`.
pub trait Out<T>: Send {
    /// Stores `v`.
    fn put(&mut self, v: T);
}

impl<T: Send> Out<T> for T {
    #[inline(always)]
    fn put(&mut self, v: T) {
        *self = v;
    }
}

impl<T: Send> Out<T> for std::mem::MaybeUninit<T> {
    #[inline(always)]
    fn put(&mut self, v: T) {
        self.write(v);
    }
}
