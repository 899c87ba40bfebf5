//! Host casts to bf16 and f16 round to nearest even exactly, as the CUDA cast kernels
//! and PyTorch do: f32 values just above a tie (the bits that decide it far down the
//! mantissa) round up, f64 values whose tie is broken beyond f32's precision too, and
//! random f32 values equal the bit-level rounding formula.

use half::{bf16, f16};
use tpar_tensor::{DType, Rng, Tensor};

/// bf16 of an f32 by the bit-level round-to-nearest-even formula (finite values).
fn bf16_rne(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn cast_bits(v: &[f64], from: DType, to: DType) -> Vec<u16> {
    let t = Tensor::from_f64(v, [v.len()], from).unwrap().to_dtype(to).unwrap();
    match to {
        DType::BF16 => t.to_vec::<bf16>().unwrap().iter().map(|x| x.to_bits()).collect(),
        _ => t.to_vec::<f16>().unwrap().iter().map(|x| x.to_bits()).collect(),
    }
}

#[test]
fn f32_just_above_a_tie_rounds_up() {
    // 1 + 2^-8 is the bf16 tie between 1 and 1 + 2^-7, 1 + 2^-11 the f16 one between 1
    // and 1 + 2^-10; one f32 ulp (2^-23) above each decides the rounding upward.
    let up = [1.0 + 2f64.powi(-8) + 2f64.powi(-23), -(1.0 + 2f64.powi(-8) + 3.0 * 2f64.powi(-23))];
    assert_eq!(cast_bits(&up, DType::F32, DType::BF16), [0x3f81, 0xbf81]);
    let ties = [1.0 + 2f64.powi(-8), 1.0 + 3.0 * 2f64.powi(-8)];
    assert_eq!(cast_bits(&ties, DType::F32, DType::BF16), [0x3f80, 0x3f82]);
    let up16 = [1.0 + 2f64.powi(-11) + 2f64.powi(-23)];
    assert_eq!(cast_bits(&up16, DType::F32, DType::F16), [0x3c01]);
}

#[test]
fn f64_ties_broken_below_f32_precision_round_up() {
    let tiny = 2f64.powi(-40);
    let v = [1.0 + 2f64.powi(-8) + tiny, 1.0 + 2f64.powi(-8), 1.0 + 2f64.powi(-8) - tiny];
    assert_eq!(cast_bits(&v, DType::F64, DType::BF16), [0x3f81, 0x3f80, 0x3f80]);
    let v = [1.0 + 2f64.powi(-11) + tiny, 1.0 + 2f64.powi(-11), 1.0 + 2f64.powi(-11) - tiny];
    assert_eq!(cast_bits(&v, DType::F64, DType::F16), [0x3c01, 0x3c00, 0x3c00]);
    // Tiny values: round-to-odd keeps a nonzero below f32's subnormals nonzero in spirit
    // (a bf16 / f16 of it is still a correctly rounded zero of its sign).
    let v = [1e-60, -1e-60];
    assert_eq!(cast_bits(&v, DType::F64, DType::BF16), [0x0000, 0x8000]);
    // Overflow and specials.
    let v = [1e300, -1e300, f64::INFINITY];
    assert_eq!(cast_bits(&v, DType::F64, DType::BF16), [0x7f80, 0xff80, 0x7f80]);
    assert_eq!(cast_bits(&v, DType::F64, DType::F16), [0x7c00, 0xfc00, 0x7c00]);
}

#[test]
fn random_f32_casts_equal_the_rounding_formula() {
    let mut rng = Rng::new(5);
    let x = Tensor::randn([1 << 16], DType::F32, &mut rng).unwrap();
    // Spread the values over many binades and plant near-ties: the low 15 bits of
    // every fourth value cleared but for its lowest three.
    let mut v = x.to_vec::<f32>().unwrap();
    for (i, x) in v.iter_mut().enumerate() {
        let scaled = *x * 2f32.powi((i % 61) as i32 - 30);
        let b = scaled.to_bits();
        *x = f32::from_bits(if i % 4 == 0 {
            (b & !0x7fff) | 0x8000 | (i as u32 % 7 + 1)
        } else {
            b
        });
    }
    let t = Tensor::from_vec(v.clone(), [v.len()]).unwrap();
    let got: Vec<u16> = t
        .to_dtype(DType::BF16)
        .unwrap()
        .to_vec::<bf16>()
        .unwrap()
        .iter()
        .map(|b| b.to_bits())
        .collect();
    for (i, (&x, &g)) in v.iter().zip(&got).enumerate() {
        assert_eq!(g, bf16_rne(x), "value {i}: {x:e} ({:#010x})", x.to_bits());
    }
    let got16: Vec<u16> = t
        .to_dtype(DType::F16)
        .unwrap()
        .to_vec::<f16>()
        .unwrap()
        .iter()
        .map(|b| b.to_bits())
        .collect();
    for (i, (&x, &g)) in v.iter().zip(&got16).enumerate() {
        assert_eq!(g, f16::from_f32(x).to_bits(), "value {i}: {x:e}");
    }
}
