//! Host-side data of the checks: values rounded to a device dtype, their
//! device representation (encode/decode), raw words, and the deterministic
//! random numbers every input is drawn from.

use bytemuck::Pod;
use half::{bf16, f16};
use rayon::prelude::*;
use tpar_kernels::cuda::CudaDType;

use CudaDType::{BF16, F16, F32};

pub(crate) fn dn(dt: CudaDType) -> &'static str {
    dt.suffix()
}

/// `x` rounded to the nearest value of `dt`.
pub(crate) fn round_to(dt: CudaDType, x: f64) -> f64 {
    match dt {
        F32 => x as f32 as f64,
        BF16 => bf16::from_f64(x).to_f64(),
        F16 => f16::from_f64(x).to_f64(),
    }
}

// ------------------------------------------------------------------ raw data

pub(crate) fn as_bytes<T: Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

pub(crate) fn from_bytes<T: Pod>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
    let n = std::mem::size_of_val(v.as_slice());
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&b[..n]);
    v
}

/// `v` in the device representation of `dt`.
pub(crate) fn encode(dt: CudaDType, v: &[f64]) -> Vec<u8> {
    match dt {
        F32 => as_bytes(&v.par_iter().map(|&x| x as f32).collect::<Vec<f32>>()).to_vec(),
        BF16 => as_bytes(&v.par_iter().map(|&x| bf16::from_f64(x).to_bits()).collect::<Vec<_>>())
            .to_vec(),
        F16 => as_bytes(&v.par_iter().map(|&x| f16::from_f64(x).to_bits()).collect::<Vec<_>>())
            .to_vec(),
    }
}

/// Values of `dt` in device representation, widened.
pub(crate) fn decode(dt: CudaDType, b: &[u8]) -> Vec<f64> {
    match dt {
        F32 => from_bytes::<f32>(b).into_par_iter().map(f64::from).collect(),
        BF16 => from_bytes::<u16>(b).into_par_iter().map(|x| bf16::from_bits(x).to_f64()).collect(),
        F16 => from_bytes::<u16>(b).into_par_iter().map(|x| f16::from_bits(x).to_f64()).collect(),
    }
}

/// Words of `width` bytes (2, 4 or 8) in device representation.
pub(crate) fn encode_words(width: usize, v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes().into_iter().take(width)).collect()
}

pub(crate) fn decode_words(width: usize, b: &[u8]) -> Vec<u64> {
    b.chunks_exact(width)
        .map(|c| c.iter().rev().fold(0u64, |acc, &byte| (acc << 8) | byte as u64))
        .collect()
}

/// Deterministic random numbers: a 64-bit state advanced by splitmix64.
pub(crate) struct Rng(pub(crate) u64);

pub(crate) fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix(self.0.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// `n` values uniform in `[lo, hi)`, rounded to `dt` (generated in parallel).
    pub(crate) fn vals(&mut self, dt: CudaDType, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        let seed = self.next();
        (0..n)
            .into_par_iter()
            .map(|i| {
                let u = (splitmix(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407)) >> 11)
                    as f64
                    / (1u64 << 53) as f64;
                round_to(dt, lo + (hi - lo) * u)
            })
            .collect()
    }

    /// `n` random words of `width` bytes.
    pub(crate) fn words(&mut self, n: usize, width: usize) -> Vec<u64> {
        let mask = if width >= 8 { u64::MAX } else { (1u64 << (8 * width)) - 1 };
        (0..n).map(|_| self.next() & mask).collect()
    }
}
