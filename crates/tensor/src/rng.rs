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

/// PyTorch's default seed (`default_rng_seed_val`), which this thread's generator starts
/// from until [`manual_seed`].
pub const DEFAULT_SEED: u64 = 67_280_421_310_721;

/// The state of a thread's default generator, which random ops such as
/// [`crate::Tensor::dropout`] draw from (PyTorch's `torch.get_rng_state`): a seed and an
/// offset into the seed's stream, counted in 32-bit words.
///
/// A random op draws the words `offset..offset + n` of the ChaCha8 stream of `seed` (the
/// generator of [`Rng`]), `n` the element count of the tensor it draws for rounded up to a
/// multiple of 16 (one ChaCha block), and moves the offset past them. A shard of a
/// distributed tensor reads the words of its own elements' global positions, and every
/// rank moves the offset by the global tensor's count, so ranks that run the same ops
/// from the same state stay in step and draw what one rank would draw for the whole
/// tensor. Activation checkpointing saves the state at a region's start and sets it again
/// for the recompute (PyTorch's `preserve_rng_state`), so a recomputed random op draws
/// what the forward drew.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RngState {
    /// The stream's seed.
    pub seed: u64,
    /// The next word of the stream a random op draws.
    pub offset: u64,
}

impl Default for RngState {
    fn default() -> Self {
        RngState { seed: DEFAULT_SEED, offset: 0 }
    }
}

thread_local! {
    static DEFAULT_STATE: std::cell::Cell<RngState> = std::cell::Cell::new(RngState::default());
}

/// Seeds this thread's default generator (PyTorch's `torch.manual_seed`) and resets its
/// offset. Each rank thread has its own generator: call it on every rank, with the same
/// seed where the ranks must draw alike (ranks of one tensor-parallel group).
pub fn manual_seed(seed: u64) {
    set_rng_state(RngState { seed, offset: 0 });
}

/// This thread's default generator's state (PyTorch's `torch.get_rng_state`).
pub fn get_rng_state() -> RngState {
    DEFAULT_STATE.with(|s| s.get())
}

/// Sets this thread's default generator's state (PyTorch's `torch.set_rng_state`).
pub fn set_rng_state(state: RngState) {
    DEFAULT_STATE.with(|s| s.set(state));
}

/// Takes `words` words of this thread's stream (rounded up to a whole ChaCha block):
/// returns the state the caller draws from and moves the offset past them.
pub(crate) fn take_words(words: u64) -> RngState {
    DEFAULT_STATE.with(|s| {
        let now = s.get();
        let blocks = words.div_ceil(16);
        s.set(RngState {
            seed: now.seed,
            offset: now.offset.wrapping_add(blocks.wrapping_mul(16)),
        });
        now
    })
}

/// Sets this thread's generator to `state` until dropped, then back to what it was.
pub(crate) struct RngStateGuard(RngState);

impl RngStateGuard {
    pub(crate) fn set(state: RngState) -> RngStateGuard {
        let before = get_rng_state();
        set_rng_state(state);
        RngStateGuard(before)
    }
}

impl Drop for RngStateGuard {
    fn drop(&mut self) {
        let _ = DEFAULT_STATE.try_with(|s| s.set(self.0));
    }
}

/// While a CUDA graph is captured on this thread ([`crate::gpu::capture_graph`]): the
/// device state (`tpar_kernels::cuda::ops::dropout::STATE_WORDS` i64s) its random ops
/// read when they run, and the generator's state when the capture began. A random op
/// on that device draws at its offset past the capture's start, added on the device to
/// the offset each replay writes there.
#[derive(Clone, Debug)]
pub(crate) struct CaptureRng {
    pub(crate) state: crate::Tensor,
    pub(crate) start: RngState,
}

thread_local! {
    static CAPTURE_RNG: std::cell::RefCell<Option<CaptureRng>> = const { std::cell::RefCell::new(None) };
}

/// The capture this thread is in, if any.
pub(crate) fn capture_rng() -> Option<CaptureRng> {
    CAPTURE_RNG.with(|c| c.borrow().clone())
}

/// Marks this thread as capturing with `rng` until dropped.
pub(crate) struct CaptureRngGuard;

impl CaptureRngGuard {
    pub(crate) fn set(rng: CaptureRng) -> CaptureRngGuard {
        CAPTURE_RNG.with(|c| *c.borrow_mut() = Some(rng));
        CaptureRngGuard
    }
}

impl Drop for CaptureRngGuard {
    fn drop(&mut self) {
        let _ = CAPTURE_RNG.try_with(|c| c.borrow_mut().take());
    }
}
