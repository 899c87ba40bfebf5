//! Test helpers: a deterministic RNG, dtype tolerances, closeness checks and
//! finite differences.

use crate::Float;

/// SplitMix64: tiny, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// `n` values uniform in [-scale, scale), rounded to `T`.
    pub fn vec<T: Float>(&mut self, n: usize, scale: f64) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.uniform() * scale)).collect()
    }
}

pub fn f64s<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// Relative tolerance for a dtype.
pub fn tol<T: Float>() -> f64 {
    match T::NAME {
        "f64" => 1e-10,
        "f32" => 1e-4,
        _ => 2e-2,
    }
}

/// `|got - want| <= tol * (1 + |want|)` elementwise (infinities must match).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() || g.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tol * (1.0 + w.abs())
        };
        assert!(ok, "{what}[{i}]: got {g}, want {w} (tol {tol})");
    }
}

/// Compares a `T` buffer against an f64 oracle with the dtype's tolerance.
pub fn assert_close_t<T: Float>(what: &str, got: &[T], want: &[f64]) {
    assert_close(&format!("{what} ({})", T::NAME), &f64s(got), want, tol::<T>());
}

/// Numerical gradient of `L(x) = <dy, f(x)>` by central differences.
pub fn fd_grad(f: impl Fn(&[f64]) -> Vec<f64>, x: &[f64], dy: &[f64]) -> Vec<f64> {
    let h = 1e-6;
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + h;
            let lp: f64 = f(&xp).iter().zip(dy).map(|(a, b)| a * b).sum();
            xp[i] = x[i] - h;
            let lm: f64 = f(&xp).iter().zip(dy).map(|(a, b)| a * b).sum();
            xp[i] = x[i];
            (lp - lm) / (2.0 * h)
        })
        .collect()
}

/// Checks an analytic gradient against finite differences.
pub fn assert_fd(what: &str, f: impl Fn(&[f64]) -> Vec<f64>, x: &[f64], dy: &[f64], grad: &[f64]) {
    let num = fd_grad(f, x, dy);
    assert_close(&format!("{what} vs finite differences"), grad, &num, 1e-6);
}
