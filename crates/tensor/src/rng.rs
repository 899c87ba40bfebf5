//! The seeded generator behind initialisation and random tensors: ChaCha8 (from
//! `rand_chacha`), whose stream for a given seed is fixed across platforms and `rand`
//! releases, so every rank that seeds it alike draws the same numbers (which is how a
//! sharded model initialises exactly the shards of the unsharded one).

use rand::{Rng as _, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

/// Deterministic random numbers from a 64-bit seed.
#[derive(Clone, Debug)]
pub struct Rng(ChaCha8Rng);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(ChaCha8Rng::seed_from_u64(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0.random::<f64>()
    }

    /// Uniform integer in `0..n` (0 for `n == 0`), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        self.0.random_range(0..n)
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        self.0.sample(StandardNormal)
    }
}
