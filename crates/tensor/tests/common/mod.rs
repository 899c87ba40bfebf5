//! Helpers shared by this crate's bit-exact op tests.

#![allow(dead_code)]

use tpar_tensor::{Device, Tensor, TensorError};

/// The exact values of `t` (every float dtype widens to f64 exactly).
pub fn bits(t: &Tensor) -> Vec<u64> {
    t.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Whether `a` and `b` are the bits of `+0.0` and `-0.0` (in either order).
pub fn zeros_of_other_signs(a: u64, b: u64) -> bool {
    a != b && f64::from_bits(a) == 0.0 && f64::from_bits(b) == 0.0
}

/// `got` holds `want`'s bits, but for zeros of other signs where `zero_sign` allows
/// them; otherwise a failure naming `what`, the count and the first difference.
pub fn assert_same_bits(what: &str, got: &[u64], want: &[u64], zero_sign: bool) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let differ =
        |j: usize| got[j] != want[j] && !(zero_sign && zeros_of_other_signs(got[j], want[j]));
    let bad: Vec<usize> = (0..got.len()).filter(|&j| differ(j)).collect();
    let first = bad.first().map(|&j| (j, f64::from_bits(got[j]), f64::from_bits(want[j])));
    assert!(
        bad.is_empty(),
        "{what}: differs at {} of {} elements, first (index, got, want) {first:?}",
        bad.len(),
        got.len()
    );
}

/// `r` fails with an error whose text contains every one of `words`.
pub fn fails_naming(what: &str, r: Result<Tensor, TensorError>, words: &[&str]) {
    match r {
        Ok(t) => panic!("{what}: accepted, gave {}", t.shape()),
        Err(e) => {
            let text = e.to_string();
            for w in words {
                assert!(text.contains(w), "{what}: {text:?} does not name {w:?}");
            }
        }
    }
}
