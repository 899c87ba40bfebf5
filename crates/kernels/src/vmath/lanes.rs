//! The lane-wise bodies of the vector math functions, written branch-free over
//! fixed-size blocks so the compiler turns each block into SIMD instructions.
//! `FMA` selects fused multiply-adds (only where the CPU has them: without the
//! instruction `mul_add` would be a slow library call).

/// Elements per block: two AVX2 registers of f32, so two independent chains
/// keep the FMA units busy.
pub(super) const LANES: usize = 16;

/// `a * b + c`, fused when `FMA`.
#[inline(always)]
fn mad<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `e^x` in f32, within 2 ulp of the correctly rounded value over the whole
/// range (denormal results included); `-inf` and underflow give 0, overflow
/// and `+inf` give `+inf`, NaN stays NaN.
///
/// Method: `x = n ln2 + r` with `|r| <= ln2/2` (Cody-Waite: `ln2` split in a
/// short high part, so `n * LN2_HI` is exact, and a low part), `e^r` by its
/// Taylor polynomial of degree 7 (truncation error below 0.1 ulp), then the
/// result scaled by `2^n` in two exact power-of-two steps, so results in the
/// denormal range are rounded once.
#[inline(always)]
pub(super) fn exp1<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4; // 355 / 512: 9 significant bits
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 - LN2_HI
                                         // Below -104 the result rounds to 0, above 89 to +inf; NaN passes the clamp.
    let x = x.clamp(-104.0, 89.0);
    let t = mad::<FMA>(x, LOG2E, SHIFTER);
    let n_f = t - SHIFTER;
    let n = (t.to_bits() as i32).wrapping_sub(SHIFTER.to_bits() as i32);
    let r = mad::<FMA>(n_f, -LN2_HI, x);
    let r = mad::<FMA>(n_f, -LN2_LO, r);
    let mut p = 1.0 / 5040.0;
    p = mad::<FMA>(p, r, 1.0 / 720.0);
    p = mad::<FMA>(p, r, 1.0 / 120.0);
    p = mad::<FMA>(p, r, 1.0 / 24.0);
    p = mad::<FMA>(p, r, 1.0 / 6.0);
    p = mad::<FMA>(p, r, 0.5);
    p = mad::<FMA>(p, r, 1.0);
    p = mad::<FMA>(p, r, 1.0);
    // n is in [-150, 128]; both halves keep the exponent field normal.
    let n1 = n >> 1;
    let n2 = n - n1;
    let s1 = f32::from_bits(((n1 + 127) << 23) as u32);
    let s2 = f32::from_bits(((n2 + 127) << 23) as u32);
    p * s1 * s2
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub(super) fn sigmoid1<const FMA: bool>(x: f32) -> f32 {
    1.0 / (1.0 + exp1::<FMA>(-x))
}

/// `x[i] = f(x[i])` block by block.
#[inline(always)]
pub(super) fn map<const FMA: bool>(x: &mut [f32], f: impl Fn(f32) -> f32) {
    let mut blocks = x.chunks_exact_mut(LANES);
    for b in &mut blocks {
        for v in b.iter_mut() {
            *v = f(*v);
        }
    }
    for v in blocks.into_remainder() {
        *v = f(*v);
    }
}

/// `x[i] = e^(x[i] - shift)`; returns the sum of the new values.
#[inline(always)]
pub(super) fn exp_sub_sum<const FMA: bool>(x: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut blocks = x.chunks_exact_mut(LANES);
    for b in &mut blocks {
        for (v, a) in b.iter_mut().zip(acc.iter_mut()) {
            *v = exp1::<FMA>(*v - shift);
            *a += *v;
        }
    }
    let mut tail = 0.0;
    for v in blocks.into_remainder() {
        *v = exp1::<FMA>(*v - shift);
        tail += *v;
    }
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
}
