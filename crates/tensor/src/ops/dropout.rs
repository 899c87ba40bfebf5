//! Dropout (PyTorch's `F.dropout`): each element is zeroed with probability `p` and the
//! others scaled by `1 / (1 - p)`, the mask drawn from the thread's default generator
//! ([`crate::RngState`]) by the element's position in the tensor the mask is drawn for.
//!
//! Element `g` (its row-major position in that tensor) is kept when word `offset + g` of
//! the ChaCha8 stream of the state's seed is at least `round(p * 2^32)`. So a shard
//! ([`Tensor::dropout_shard`]) keeps exactly the elements the whole tensor would keep at
//! its positions, and the backward draws the same mask again from the saved state instead
//! of keeping it.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use tpar_kernels::{Acc, Float};

use super::{compute, invalid, require_float};
use crate::autograd::record;
use crate::rng::{take_words, RngState};
use crate::storage::{try_vec, Element};
use crate::tensor::typed;
use crate::{with_float_type, Device, Result, Tensor};

/// Elements one task of the mask walks.
const CHUNK: usize = 1 << 14;

/// What a dropout's forward drew, which its backward draws again.
#[derive(Clone, Debug)]
struct Mask {
    state: RngState,
    /// Words below it drop their element.
    threshold: u64,
    scale: f64,
    /// The shard's dims, the whole tensor's, and the shard's offset in it.
    local: Vec<usize>,
    global: Vec<usize>,
    offset: Vec<usize>,
}

impl Mask {
    /// `x` with the mask applied into `out` (zeros of `x`'s length): kept elements times
    /// the scale, dropped ones left zero.
    fn apply<T: Float>(&self, x: &[T], out: &mut [T]) {
        let rank = self.local.len();
        // The shard is a run of whole rows of dims `split..` (every dim after `split` whole
        // in the shard), each contiguous in the global tensor.
        let mut split = rank.saturating_sub(1);
        while split > 0 && self.local[split] == self.global[split] {
            split -= 1;
        }
        let run: usize = self.local[split.min(rank)..].iter().product::<usize>().max(1);
        let mut gstride = vec![1usize; rank];
        for d in (0..rank.saturating_sub(1)).rev() {
            gstride[d] = gstride[d + 1] * self.global[d + 1];
        }
        // The global position of the first element of run `j`.
        let run_start = |mut j: usize| -> u64 {
            let mut g = if rank == 0 { 0 } else { self.offset[split] * gstride[split] };
            for d in (0..split).rev() {
                let i = j % self.local[d];
                j /= self.local[d];
                g += (self.offset[d] + i) * gstride[d];
            }
            g as u64
        };
        let key = self.state.key();
        let scale = T::Acc::of(self.scale);
        out.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).enumerate().for_each(|(c, (o, xs))| {
            let mut rng = ChaCha8Rng::from_seed(key);
            let mut i = c * CHUNK;
            let mut pos = 0;
            while pos < o.len() {
                let (j, q) = (i / run, i % run);
                let n = (run - q).min(o.len() - pos);
                let word = self.state.offset as u128 + (run_start(j) + q as u64) as u128;
                rng.set_word_pos(word);
                for (y, &v) in o[pos..pos + n].iter_mut().zip(&xs[pos..pos + n]) {
                    if u64::from(rng.next_u32()) >= self.threshold {
                        let mut a = v.to_acc();
                        a *= scale;
                        *y = T::from_acc(a);
                    }
                }
                pos += n;
                i += n;
            }
        });
    }

    /// The mask applied to `x` as a new tensor (no autograd node).
    fn run(&self, op: &'static str, x: &Tensor) -> Result<Tensor> {
        compute(op, &[x], x.shape().clone(), x.dtype(), |st| {
            with_float_type!(st[0].dtype(), op, |T| {
                let mut out = try_vec(op, x.shape(), x.dtype(), T::default())?;
                self.apply(typed::<T>(op, st[0])?, &mut out);
                Ok(T::wrap(out))
            })
        })
    }
}

impl Tensor {
    /// Dropout (PyTorch's `F.dropout(x, p, training)`): in training, each element is
    /// zeroed with probability `p` and the others multiplied by `1 / (1 - p)`; out of
    /// training, or with `p` 0, `self` itself. `p` 1 gives `self * 0`. The mask comes from
    /// this thread's default generator ([`crate::manual_seed`], [`crate::RngState`]),
    /// whose offset moves past the words drawn, and the backward draws it again (nothing
    /// is kept for it but the generator's state). On a CUDA device the mask is applied on
    /// the host.
    ///
    /// # Errors
    /// [`crate::TensorError::InvalidArgument`] for `p` outside `[0, 1]`;
    /// [`crate::TensorError::DTypeMismatch`] for an integer tensor.
    ///
    /// ```
    /// use tpar_tensor::{manual_seed, Tensor};
    /// let x = Tensor::ones([4, 1000], tpar_tensor::DType::F64, tpar_tensor::Device::Cpu)?;
    /// manual_seed(7);
    /// let y = x.dropout(0.25, true)?.to_vec::<f64>()?;
    /// // every element is dropped or scaled by 1 / (1 - p)
    /// assert!(y.iter().all(|&v| v == 0.0 || v == 1.0 / 0.75));
    /// let kept = y.iter().filter(|&&v| v != 0.0).count();
    /// assert!((2900..3100).contains(&kept));
    /// // the same seed draws the same mask
    /// manual_seed(7);
    /// assert_eq!(x.dropout(0.25, true)?.to_vec::<f64>()?, y);
    /// # Ok::<(), tpar_tensor::TensorError>(())
    /// ```
    pub fn dropout(&self, p: f64, training: bool) -> Result<Tensor> {
        let zeros = vec![0; self.rank()];
        self.dropout_shard(p, training, self.dims(), &zeros)
    }

    /// [`Tensor::dropout`] of the shard at `offset` of a tensor of dims `global`: each
    /// element keeps or drops as the element at its position in the whole tensor would,
    /// and the generator's offset moves by the whole tensor's count. So ranks that hold
    /// the shards of one tensor and call this from the same generator state draw, between
    /// them, the whole tensor's mask (what a DTensor's dropout does).
    ///
    /// # Errors
    /// As [`Tensor::dropout`], and [`crate::TensorError::InvalidArgument`] when `global`
    /// or `offset` has another rank than `self`, or the shard does not fit in `global` at
    /// `offset`.
    pub fn dropout_shard(
        &self,
        p: f64,
        training: bool,
        global: &[usize],
        offset: &[usize],
    ) -> Result<Tensor> {
        const OP: &str = "dropout";
        require_float(OP, self)?;
        if !(0.0..=1.0).contains(&p) {
            return Err(invalid(
                OP,
                format!("dropout probability has to be between 0 and 1, but got {p}"),
            ));
        }
        let dims = self.dims();
        if global.len() != dims.len()
            || offset.len() != dims.len()
            || dims
                .iter()
                .zip(global)
                .zip(offset)
                .any(|((&l, &g), &o)| o.checked_add(l).is_none_or(|e| e > g))
        {
            return Err(invalid(
                OP,
                format!("a shard of dims {dims:?} at offset {offset:?} is not inside a tensor of dims {global:?}"),
            ));
        }
        if !training || p == 0.0 || self.numel() == 0 {
            return Ok(self.clone());
        }
        if p == 1.0 {
            return self.mul_scalar(0.0);
        }
        if self.device() == Device::Meta {
            return self.mul_scalar(1.0);
        }
        let words: u64 = global.iter().map(|&g| g as u64).product();
        let mask = Mask {
            state: take_words(words),
            threshold: (p * 4_294_967_296.0).round() as u64,
            scale: 1.0 / (1.0 - p),
            local: dims.to_vec(),
            global: global.to_vec(),
            offset: offset.to_vec(),
        };
        let out = mask.run(OP, self)?;
        Ok(record(OP, &[self], out, move |g| Ok(vec![Some(mask.run(OP, g)?)])))
    }
}
