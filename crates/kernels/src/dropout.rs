//! Dropout masks drawn by position from a ChaCha8 stream: element `g` of a tensor
//! (its row-major position) is kept when word `offset + g` of the stream is at least
//! the mask's threshold, and kept elements are multiplied by its scale.
//!
//! A shard of a larger tensor ([`ShardRuns`]) reads the words of its elements'
//! positions in the whole tensor, so shards on different ranks draw, between them,
//! the whole tensor's mask. The CUDA kernel ([`crate::cuda::ops::dropout`]) draws the
//! same words and writes the same bits.
//!
//! ```
//! use tpar_kernels::dropout::{dropout, DropoutMask, ShardRuns};
//! let mask = DropoutMask::new(7, 0, 0.5)?;
//! let whole = ShardRuns::new(&[4, 6], &[4, 6], &[0, 0])?;
//! let x = vec![1.0f32; 24];
//! let mut y = vec![0.0f32; 24];
//! dropout(&mask, &whole, &x, &mut y)?;
//! assert!(y.iter().all(|&v| v == 0.0 || v == 2.0));
//! // the right half's shard keeps what the whole tensor keeps there
//! let half = ShardRuns::new(&[4, 3], &[4, 6], &[0, 3])?;
//! let mut h = vec![0.0f32; 12];
//! dropout(&mask, &half, &x[..12], &mut h)?;
//! let want: Vec<f32> = y.chunks(6).flat_map(|r| r[3..].to_vec()).collect();
//! assert_eq!(h, want);
//! # Ok::<(), tpar_kernels::KernelError>(())
//! ```

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use tpar_memory::cache::filled;

use crate::util::bad;
use crate::{Acc, Float, Out, Result};

/// Elements one task of the CPU kernel walks.
const CHUNK: usize = 1 << 14;

/// What a dropout draws: the stream (a ChaCha8 key and the word of the whole tensor's
/// element 0), which words drop their element, and the scale of the kept ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    /// The ChaCha8 key (little-endian words of the 32-byte seed).
    pub key: [u32; 8],
    /// The stream word of the whole tensor's element 0.
    pub offset: u64,
    /// Words below it drop their element: `round(p * 2^32)`.
    pub threshold: u64,
    /// The factor of kept elements: `1 / (1 - p)`.
    pub scale: f64,
}

impl DropoutMask {
    /// The mask of probability `p` (in `[0, 1)`) drawn from the stream that
    /// `ChaCha8Rng::seed_from_u64(seed)` generates, starting at word `offset`.
    ///
    /// # Errors
    /// [`crate::KernelError::BadArguments`] for `p` outside `[0, 1)` (NaN included).
    pub fn new(seed: u64, offset: u64, p: f64) -> Result<DropoutMask> {
        if !(0.0..1.0).contains(&p) {
            return Err(bad("dropout", format!("probability {p} is not in [0, 1)")));
        }
        Ok(DropoutMask {
            key: key_of(seed),
            offset,
            threshold: (p * 4_294_967_296.0).round() as u64,
            scale: 1.0 / (1.0 - p),
        })
    }

    /// The 32-byte seed of [`Self::key`].
    fn seed_bytes(&self) -> [u8; 32] {
        let mut s = [0u8; 32];
        for (b, k) in s.chunks_exact_mut(4).zip(self.key) {
            b.copy_from_slice(&k.to_le_bytes());
        }
        s
    }
}

/// The ChaCha8 key (little-endian words of the 32-byte seed) that
/// `ChaCha8Rng::seed_from_u64(seed)` expands `seed` to.
pub fn key_of(seed: u64) -> [u32; 8] {
    let bytes = ChaCha8Rng::seed_from_u64(seed).get_seed();
    let mut key = [0u32; 8];
    for (k, b) in key.iter_mut().zip(bytes.chunks_exact(4)) {
        *k = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    key
}

/// Where a shard's elements lie in the whole tensor: `runs` runs of `run` elements,
/// each contiguous in the shard and in the whole tensor (the shard's trailing dims
/// that are whole, and its innermost partial one). Run `j`'s first element is at
/// `base + sum(i_d * stride_d)` in the whole tensor, `i_d` the digits of `j` over
/// [`Self::outer`]'s extents (the last one innermost).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardRuns {
    /// Elements per run.
    pub run: usize,
    /// Runs in the shard (its elements are `run * runs`).
    pub runs: usize,
    /// The whole tensor's position of the shard's first element.
    pub base: u64,
    /// `(extent, stride in the whole tensor)` of the dims outside the runs, outermost
    /// first; dims of extent 1 are left out and neighbours the shard walks
    /// contiguously are joined.
    pub outer: Vec<(usize, u64)>,
}

impl ShardRuns {
    /// The runs of the shard of dims `local` at `offset` in a tensor of dims `global`
    /// (all three the same length; `local == global` is the whole tensor, one run).
    ///
    /// # Errors
    /// [`crate::KernelError::BadArguments`] when the lengths differ or the shard does
    /// not fit in `global` at `offset`, or the whole tensor's count overflows.
    pub fn new(local: &[usize], global: &[usize], offset: &[usize]) -> Result<ShardRuns> {
        let inside = local.len() == global.len()
            && offset.len() == global.len()
            && local
                .iter()
                .zip(global)
                .zip(offset)
                .all(|((&l, &g), &o)| o.checked_add(l).is_some_and(|e| e <= g));
        if !inside {
            return Err(bad(
                "dropout",
                format!("a shard of dims {local:?} at offset {offset:?} is not inside a tensor of dims {global:?}"),
            ));
        }
        let total = global.iter().try_fold(1u64, |a, &g| a.checked_mul(g as u64));
        if total.is_none_or(|t| t > i64::MAX as u64) {
            return Err(bad("dropout", format!("a tensor of dims {global:?} is too large")));
        }
        let rank = local.len();
        let mut stride = vec![1u64; rank];
        for d in (0..rank.saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * global[d + 1] as u64;
        }
        let base = offset.iter().zip(&stride).map(|(&o, &s)| o as u64 * s).sum();
        // The runs: the innermost partial dim and every whole dim inside it.
        let mut split = rank.saturating_sub(1);
        while split > 0 && local[split] == global[split] {
            split -= 1;
        }
        let run: usize = local[split.min(rank)..].iter().product();
        // Outer dims of extent above 1, each joined to the one kept before it when it is
        // whole and only dims of extent 1 lie between them (stepping the earlier one then
        // steps the whole of this one).
        let mut outer: Vec<(usize, u64)> = Vec::new();
        let mut prev: Option<usize> = None;
        for d in 0..split {
            if local[d] == 1 {
                continue;
            }
            let joins =
                prev.is_some_and(|p| local[d] == global[d] && (p + 1..d).all(|e| global[e] == 1));
            match outer.last_mut() {
                Some(last) if joins => *last = (last.0 * local[d], stride[d]),
                _ => outer.push((local[d], stride[d])),
            }
            prev = Some(d);
        }
        let runs = outer.iter().map(|&(e, _)| e).product::<usize>();
        let runs = if local.contains(&0) { 0 } else { runs };
        Ok(ShardRuns { run: if runs == 0 { 0 } else { run }, runs, base, outer })
    }

    /// The shard's element count, after checking that the fields agree (what
    /// [`ShardRuns::new`] builds always does): the extents multiply to `runs`, and every
    /// position, one past the last run's end included, fits in an `i64`.
    ///
    /// # Errors
    /// [`crate::KernelError::BadArguments`] naming the field that disagrees.
    pub fn elements(&self) -> Result<usize> {
        let wrong = |what: String| bad("dropout", format!("{self:?}: {what}"));
        let runs = self.outer.iter().try_fold(1usize, |a, &(e, _)| a.checked_mul(e));
        if self.runs > 0 && runs != Some(self.runs) {
            return Err(wrong("the outer extents do not multiply to `runs`".into()));
        }
        let last = self.outer.iter().try_fold(self.base, |a, &(e, s)| {
            (e as u64).checked_sub(1).and_then(|m| m.checked_mul(s)).and_then(|m| a.checked_add(m))
        });
        let end = last.and_then(|l| l.checked_add(self.run as u64));
        if self.runs > 0 && end.is_none_or(|e| e > i64::MAX as u64) {
            return Err(wrong("positions overflow".into()));
        }
        self.run.checked_mul(self.runs).ok_or_else(|| wrong("the element count overflows".into()))
    }

    /// The whole tensor's position of run `j`'s first element.
    pub fn start(&self, mut j: usize) -> u64 {
        let mut g = self.base;
        for &(extent, stride) in self.outer.iter().rev() {
            g += (j % extent) as u64 * stride;
            j /= extent;
        }
        g
    }
}

/// `y = x * mask` for the shard `runs` of the mask's tensor: kept elements times the
/// scale (in `T`'s accumulator type), dropped ones zero. Writes every element of `y`.
///
/// # Errors
/// [`crate::KernelError::BadArguments`] when `x` or `y` does not hold the shard's
/// elements.
pub fn dropout<T: Float, O: Out<T>>(
    mask: &DropoutMask,
    runs: &ShardRuns,
    x: &[T],
    y: &mut [O],
) -> Result<()> {
    let n = runs.elements()?;
    if x.len() != n || y.len() != n {
        return Err(bad(
            "dropout",
            format!("the shard has {n} elements; x has {}, y has {}", x.len(), y.len()),
        ));
    }
    let seed = mask.seed_bytes();
    let scale = T::Acc::of(mask.scale);
    let run = runs.run.max(1);
    y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).enumerate().for_each(|(c, (o, xs))| {
        let mut rng = ChaCha8Rng::from_seed(seed);
        let mut words = vec![0u32; o.len()];
        let (mut i, mut pos) = (c * CHUNK, 0);
        while pos < o.len() {
            let (j, q) = (i / run, i % run);
            let len = (run - q).min(o.len() - pos);
            rng.set_word_pos(mask.offset as u128 + (runs.start(j) + q as u64) as u128);
            // The stream's bytes are its words in little-endian order.
            rng.fill_bytes(bytemuck::cast_slice_mut(&mut words[pos..pos + len]));
            pos += len;
            i += len;
        }
        for ((out, &v), &w) in o.iter_mut().zip(xs).zip(&words) {
            let mut a = v.to_acc();
            a *= scale;
            let keep = u64::from(u32::from_le(w)) >= mask.threshold;
            out.put(if keep { T::from_acc(a) } else { T::default() });
        }
    });
    Ok(())
}

/// [`dropout`] into a new vector (uninitialized before the kernel writes every element).
///
/// # Errors
/// As [`dropout`].
pub fn dropout_new<T: Float>(mask: &DropoutMask, runs: &ShardRuns, x: &[T]) -> Result<Vec<T>> {
    // SAFETY: `dropout` writes every element of `y` when it returns Ok.
    unsafe { filled(x.len(), |y| dropout(mask, runs, x, y)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole tensor's positions of a shard's elements, walked one by one.
    fn positions(local: &[usize], global: &[usize], offset: &[usize]) -> Vec<u64> {
        let n: usize = local.iter().product();
        (0..n)
            .map(|mut i| {
                let mut g = 0u64;
                let mut stride = 1u64;
                for d in (0..local.len()).rev() {
                    g += ((i % local[d]) + offset[d]) as u64 * stride;
                    i /= local[d];
                    stride *= global[d] as u64;
                }
                g
            })
            .collect()
    }

    #[test]
    fn runs_address_every_element_of_the_shard() {
        let cases: &[(&[usize], &[usize], &[usize])] = &[
            (&[], &[], &[]),
            (&[5], &[9], &[3]),
            (&[2, 3, 4], &[2, 3, 4], &[0, 0, 0]),
            (&[2, 3, 4], &[4, 3, 4], &[2, 0, 0]),
            (&[2, 3, 4], &[2, 6, 4], &[0, 3, 0]),
            (&[2, 3, 4], &[2, 3, 8], &[0, 0, 4]),
            (&[3, 1, 5, 2], &[4, 3, 5, 6], &[1, 2, 0, 4]),
            (&[2, 1, 1, 3, 4], &[3, 1, 2, 3, 4], &[1, 0, 1, 0, 0]),
            (&[2, 2, 2, 2], &[3, 2, 5, 2], &[1, 0, 2, 0]),
            (&[1, 1, 7], &[2, 2, 9], &[1, 1, 1]),
            (&[2, 0, 3], &[2, 4, 3], &[0, 1, 0]),
        ];
        for &(local, global, offset) in cases {
            let r = ShardRuns::new(local, global, offset).unwrap();
            let walked: Vec<u64> = (0..r.runs)
                .flat_map(|j| (0..r.run as u64).map(move |q| (j, q)))
                .map(|(j, q)| r.start(j) + q)
                .collect();
            assert_eq!(
                walked,
                positions(local, global, offset),
                "{local:?} {global:?} {offset:?}: {r:?}"
            );
        }
    }

    #[test]
    fn shards_outside_the_tensor_are_refused() {
        assert!(ShardRuns::new(&[3], &[4], &[2]).is_err());
        assert!(ShardRuns::new(&[3, 1], &[4], &[0]).is_err());
        assert!(ShardRuns::new(&[1], &[1], &[usize::MAX]).is_err());
        assert!(DropoutMask::new(0, 0, 1.0).is_err());
        // fields that disagree are refused, not divided by
        let good = ShardRuns::new(&[2, 3, 4], &[4, 3, 8], &[1, 0, 4]).unwrap();
        assert_eq!(good.elements().unwrap(), 24);
        let zero = ShardRuns { outer: vec![(0, 1)], ..good.clone() };
        assert!(zero.elements().is_err());
        let far = ShardRuns { base: u64::MAX - 3, ..good.clone() };
        assert!(far.elements().is_err());
        let (x, mut y) = (vec![1.0f32; 24], vec![0.0f32; 24]);
        assert!(dropout(&DropoutMask::new(0, 0, 0.5).unwrap(), &zero, &x, &mut y).is_err());
        assert!(DropoutMask::new(0, 0, f64::NAN).is_err());
    }
}
