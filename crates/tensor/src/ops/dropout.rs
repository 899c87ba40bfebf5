//! Dropout (PyTorch's `F.dropout`): each element is zeroed with probability `p` and the
//! others scaled by `1 / (1 - p)`, the mask drawn from the thread's default generator
//! ([`crate::RngState`]) by the element's position in the tensor the mask is drawn for.
//!
//! Element `g` (its row-major position in that tensor) is kept when word `offset + g` of
//! the ChaCha8 stream of the state's seed is at least `round(p * 2^32)`. So a shard
//! ([`Tensor::dropout_shard`]) keeps exactly the elements the whole tensor would keep at
//! its positions, and the backward draws the same mask again from the saved state instead
//! of keeping it.

use tpar_kernels::dropout::{dropout_new, DropoutMask, ShardRuns};
use tpar_kernels::KernelError;

use super::{compute, gpu_elem, invalid, require_float};
use crate::autograd::record;
use crate::rng::{capture_rng, take_words};
use crate::storage::Element;
use crate::tensor::typed;
use crate::{with_float_type, Device, Result, Tensor};

/// What a dropout's forward drew, which its backward draws again: the stream and
/// threshold, and where the shard's elements lie in the tensor the mask is drawn for.
struct Mask {
    mask: DropoutMask,
    runs: ShardRuns,
    /// Drawn inside a CUDA graph capture: the device state the replays write and the
    /// mask's offset past the capture's start.
    graph: Option<(Tensor, u64)>,
}

impl Mask {
    /// The mask applied to `x` as a new tensor (no autograd): by the dropout kernel on
    /// a CUDA device (bit for bit the host's), on the host otherwise.
    fn run(&self, x: &Tensor) -> Result<Tensor> {
        if matches!(x.device(), Device::Cuda(_)) {
            let graph = self.graph.as_ref().filter(|(state, _)| state.device() == x.device());
            if let Some(y) = gpu_elem::dropout(x, &self.mask, &self.runs, graph)? {
                return Ok(y);
            }
        }
        compute(OP, &[x], x.shape().clone(), x.dtype(), |st| {
            with_float_type!(st[0].dtype(), OP, |T| {
                Ok(T::wrap(dropout_new(&self.mask, &self.runs, typed::<T>(OP, st[0])?)?))
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
    /// is kept for it but the generator's state). On a CUDA device a kernel applies the
    /// same mask without a host round trip (f32, bf16 and f16; f64, and a shard cut along
    /// more than six dims, may run on the host).
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
    /// and the generator's offset moves by the whole tensor's count (an empty shard's
    /// too). So ranks that hold the shards of one tensor and call this from the same
    /// generator state draw, between them, the whole tensor's mask (what a DTensor's
    /// dropout does), and stay in step.
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
        check_dropout(self, p)?;
        let runs = shard_runs(self.dims(), global, offset)?;
        if let Some(undrawn) = self.undrawn(p, training, global) {
            return undrawn;
        }
        let (mask, graph) = draw(p, global)?;
        masked(self, Mask { mask, runs, graph })
    }

    /// [`Tensor::dropout_shard`] of a tensor made of shards of one tensor of dims
    /// `global` laid end to end along `dim`: piece `k` of `pieces` is `(offset, len)`, the
    /// next `len` of `self`'s rows along `dim`, at `offset` in the whole tensor (its
    /// extent in the other dims is `self`'s). Each element keeps or drops as the whole
    /// tensor's element at its position would, and the generator's offset moves once, by
    /// the whole tensor's count. Context parallelism's head and mirror tail chunks of a
    /// sequence are such pieces.
    ///
    /// # Errors
    /// As [`Tensor::dropout_shard`] for each piece, and
    /// [`crate::TensorError::InvalidArgument`] when `dim` is not a dim of `self` or the
    /// pieces' lengths do not add up to its size.
    ///
    /// ```
    /// use tpar_tensor::{manual_seed, DType, Device, Tensor};
    /// let x = Tensor::ones([2, 8], DType::F32, Device::Cpu)?;
    /// manual_seed(1);
    /// let whole = x.dropout(0.5, true)?;
    /// // columns 0..2 and 6..8 of the whole tensor, end to end
    /// let ends = Tensor::cat(&[x.narrow(1, 0, 2)?, x.narrow(1, 6, 2)?], 1)?;
    /// manual_seed(1);
    /// let got = ends.dropout_pieces(0.5, true, &[2, 8], 1, &[(vec![0, 0], 2), (vec![0, 6], 2)])?;
    /// let want = Tensor::cat(&[whole.narrow(1, 0, 2)?, whole.narrow(1, 6, 2)?], 1)?;
    /// assert_eq!(got.to_vec::<f32>()?, want.to_vec::<f32>()?);
    /// # Ok::<(), tpar_tensor::TensorError>(())
    /// ```
    pub fn dropout_pieces(
        &self,
        p: f64,
        training: bool,
        global: &[usize],
        dim: usize,
        pieces: &[(Vec<usize>, usize)],
    ) -> Result<Tensor> {
        check_dropout(self, p)?;
        let Some(&size) = self.dims().get(dim) else {
            return Err(invalid(OP, format!("dim {dim} of a tensor of shape {}", self.shape())));
        };
        let lens: Vec<usize> = pieces.iter().map(|(_, len)| *len).collect();
        if lens.iter().try_fold(0usize, |a, &l| a.checked_add(l)) != Some(size) {
            return Err(invalid(
                OP,
                format!(
                    "pieces of {lens:?} rows along dim {dim} of a tensor of shape {}",
                    self.shape()
                ),
            ));
        }
        let mut runs = Vec::with_capacity(pieces.len());
        for (offset, len) in pieces {
            let mut dims = self.dims().to_vec();
            dims[dim] = *len;
            runs.push(shard_runs(&dims, global, offset)?);
        }
        if let Some(undrawn) = self.undrawn(p, training, global) {
            return undrawn;
        }
        let (mask, graph) = draw(p, global)?;
        match &runs[..] {
            // no pieces: no rows either (their lengths add up to the dim's size)
            [] => return Ok(self.clone()),
            [runs] => return masked(self, Mask { mask, runs: runs.clone(), graph }),
            _ => {}
        }
        let parts = self.split_sizes(&lens, dim as isize)?;
        let outs = parts
            .iter()
            .zip(runs)
            .map(|(x, runs)| masked(x, Mask { mask, runs, graph: graph.clone() }))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&outs, dim as isize)
    }

    /// What dropout gives without drawing: `self` out of training, with `p` 0 or for an
    /// empty whole tensor; `self * 0` for `p` 1; a meta tensor of `self`'s shape.
    fn undrawn(&self, p: f64, training: bool, global: &[usize]) -> Option<Result<Tensor>> {
        if !training || p == 0.0 || global.contains(&0) {
            Some(Ok(self.clone()))
        } else if p == 1.0 {
            Some(self.mul_scalar(0.0))
        } else if self.device() == Device::Meta {
            Some(self.mul_scalar(1.0))
        } else {
            None
        }
    }
}

const OP: &str = "dropout";

/// A float tensor and `p` in `[0, 1]`.
fn check_dropout(x: &Tensor, p: f64) -> Result<()> {
    require_float(OP, x)?;
    if !(0.0..=1.0).contains(&p) {
        return Err(invalid(
            OP,
            format!("dropout probability has to be between 0 and 1, but got {p}"),
        ));
    }
    Ok(())
}

/// The runs of the shard of dims `local` at `offset` in a tensor of dims `global`.
fn shard_runs(local: &[usize], global: &[usize], offset: &[usize]) -> Result<ShardRuns> {
    ShardRuns::new(local, global, offset).map_err(|e| match e {
        KernelError::BadArguments { what, .. } => invalid(OP, what),
        other => other.into(),
    })
}

/// The mask of probability `p` (in `(0, 1)`) for a tensor of dims `global`, from the
/// generator's words it takes; inside a CUDA graph capture also the device state its
/// replays write and the offset past the capture's start.
fn draw(p: f64, global: &[usize]) -> Result<(DropoutMask, Option<(Tensor, u64)>)> {
    let state = take_words(global.iter().map(|&g| g as u64).product());
    let graph = capture_rng().map(|c| (c.state, state.offset.wrapping_sub(c.start.offset)));
    Ok((DropoutMask::new(state.seed, state.offset, p)?, graph))
}

/// `x` times `mask`, recorded: the backward applies the same mask to the gradient.
fn masked(x: &Tensor, mask: Mask) -> Result<Tensor> {
    let out = mask.run(x)?;
    Ok(record(OP, &[x], out, move |g| Ok(vec![Some(mask.run(g)?)])))
}
