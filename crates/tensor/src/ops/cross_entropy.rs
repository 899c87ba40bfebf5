//! The local steps of a vocab-parallel cross-entropy (PyTorch's `loss_parallel`) as
//! tensor ops, one entry point per step whatever the device: per-row statistics of a
//! vocab shard, the rescale of a shard's sum of exponentials to the global max, the
//! log-sum-exp, the loss sums and the gradient of a shard. The distributed loss calls
//! these between its all_reduces and never sees the kernels.
//!
//! CUDA logits of f32, bf16 or f16 (and their f32 statistics) go to the CUDA kernels
//! (`gpu_nn.rs`); everything else to the CPU kernels (`tpar_kernels::cross_entropy`),
//! through host copies for CUDA tensors of other dtypes (f64). The statistics are kept
//! in the logits' accumulator type: f32 for f32, bf16 and f16 logits, f64 for f64.

use tpar_kernels::cross_entropy as ce;
use tpar_kernels::{Acc, Float};

use super::{compute, compute_multi, invalid};
use crate::storage::Element;
use crate::tensor::typed;
use crate::{with_float_type, DType, Device, Result, Shape, Tensor, TensorError};

/// Whether the CUDA kernels compute on `t`: a CUDA tensor of f32, bf16 or f16 (logits),
/// or of f32 (statistics).
fn on_device_kernels(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cuda(_))
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// The dtype of the per-row statistics of `logits`: their accumulator type.
fn stats_dtype(op: &'static str, logits: &Tensor) -> Result<DType> {
    match logits.dtype() {
        DType::F64 => Ok(DType::F64),
        DType::F32 | DType::BF16 | DType::F16 => Ok(DType::F32),
        got => Err(TensorError::DTypeMismatch { op, expected: "float logits".into(), got }),
    }
}

/// The number of rows of `logits` (`[.., v_local]`) and `v_local`, checking there is one
/// i64 target per row.
fn rows_of(op: &'static str, logits: &Tensor, targets: &Tensor) -> Result<(usize, usize)> {
    let v_local = logits.dims().last().copied().unwrap_or(1);
    let rows = targets.numel();
    if targets.dtype() != DType::I64 || rows.checked_mul(v_local) != Some(logits.numel()) {
        return Err(invalid(
            op,
            format!(
                "logits {:?} need one i64 target per row, got {} {:?}",
                logits.dims(),
                targets.dtype(),
                targets.dims()
            ),
        ));
    }
    Ok((rows, v_local))
}

/// The common length of the statistics vectors `ts` and their common dtype (f32 or f64).
fn stats_rows(op: &'static str, ts: &[&Tensor]) -> Result<(usize, DType)> {
    let (n, dtype) = ts.first().map_or((0, DType::F32), |t| (t.numel(), t.dtype()));
    if !matches!(dtype, DType::F32 | DType::F64) {
        return Err(TensorError::DTypeMismatch {
            op,
            expected: "f32 or f64 statistics".into(),
            got: dtype,
        });
    }
    for t in ts {
        if t.dtype() != dtype || t.numel() != n {
            return Err(invalid(op, format!("needs {dtype} vectors of {n} values, got {t:?}")));
        }
    }
    Ok((n, dtype))
}

fn host_stats<T: Float + Element>(
    logits: &[T],
    targets: &[i64],
    rows: usize,
    v_local: usize,
    vocab_start: i64,
    vocab_size: usize,
    ignore_index: i64,
) -> Result<Vec<crate::storage::CpuStorage>>
where
    T::Acc: Element,
{
    let zero = T::Acc::of(0.0);
    let (mut max, mut sumexp, mut tl) = (vec![zero; rows], vec![zero; rows], vec![zero; rows]);
    ce::ce_local_stats(
        logits,
        rows,
        v_local,
        targets,
        vocab_start,
        vocab_size,
        ignore_index,
        &mut max,
        &mut sumexp,
        &mut tl,
    )?;
    Ok(vec![T::Acc::wrap(max), T::Acc::wrap(sumexp), T::Acc::wrap(tl)])
}

/// `f` on the f32 or f64 host data of `st` (all of `dtype`), wrapping its output.
macro_rules! with_acc_type {
    ($dtype:expr, $op:expr, |$A:ident| $body:block) => {
        match $dtype {
            DType::F32 => {
                type $A = f32;
                $body
            }
            DType::F64 => {
                type $A = f64;
                $body
            }
            got => Err(TensorError::DTypeMismatch {
                op: $op,
                expected: "f32 or f64 statistics".into(),
                got,
            }),
        }
    };
}

fn host_backward<T: Float + Element>(
    logits: &[T],
    targets: &[i64],
    lse: &[T::Acc],
    scale: &[T::Acc],
    rows: usize,
    v_local: usize,
    vocab_start: i64,
    ignore_index: i64,
) -> Result<crate::storage::CpuStorage>
where
    T::Acc: Element,
{
    let dl = ce::cross_entropy_backward_new(
        logits,
        rows,
        v_local,
        targets,
        vocab_start,
        ignore_index,
        lse,
        scale,
    )?;
    Ok(T::wrap(dl))
}

impl Tensor {
    /// The per-row statistics of a vocab shard of logits `self` (`[.., v_local]`,
    /// holding global columns `[vocab_start, vocab_start + v_local)` of a vocab of
    /// `vocab_size`) against i64 `targets` (one per row): `(max, sumexp, target_logit)`,
    /// `[rows]` tensors in the logits' accumulator type (f32 for f32, bf16 and f16, f64
    /// for f64) on the logits' device. `max` is the row's local max, `sumexp` the sum of
    /// `exp(logit - max)`, `target_logit` the target's logit when this shard holds its
    /// column (else 0, and 0 for ignored rows): step 1 of vocab-parallel cross-entropy,
    /// as `tpar_kernels::cross_entropy::ce_local_stats` defines it.
    ///
    /// A target that is neither `ignore_index` nor in `[0, vocab_size)` is an
    /// `IndexOutOfRange` error naming it (on a CUDA device through a 4-byte status read,
    /// no tensor data; from [`crate::gpu::check_deferred_index_checks`] instead while the
    /// thread defers its index checks). Not recorded by autograd.
    pub fn ce_shard_stats(
        &self,
        targets: &Tensor,
        vocab_start: i64,
        vocab_size: usize,
        ignore_index: i64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "ce_shard_stats";
        let sd = stats_dtype(OP, self)?;
        if on_device_kernels(self) {
            return self.cuda_ce_shard_stats(targets, vocab_start, vocab_size, ignore_index);
        }
        let (rows, v_local) = rows_of(OP, self, targets)?;
        let outs = vec![(Shape::new(&[rows]), sd); 3];
        let mut v = compute_multi(OP, &[self, targets], &outs, |st| {
            let ts = typed::<i64>(OP, st[1])?;
            with_float_type!(st[0].dtype(), OP, |T| {
                host_stats::<T>(
                    typed::<T>(OP, st[0])?,
                    ts,
                    rows,
                    v_local,
                    vocab_start,
                    vocab_size,
                    ignore_index,
                )
            })
        })?;
        let tl = v.pop();
        let sumexp = v.pop();
        let max = v.pop();
        match (max, sumexp, tl) {
            (Some(m), Some(s), Some(t)) => Ok((m, s, t)),
            _ => Err(invalid(OP, "three statistics expected")),
        }
    }

    /// `sumexp` (relative to `local_max`) rescaled to be relative to `global_max`, so the
    /// shards' values can be summed: `sumexp * exp(local_max - global_max)`, 0 where
    /// `local_max` is `-inf`. All three are `[n]` statistics of one dtype (f32 or f64) on
    /// one device. Not recorded by autograd.
    pub fn ce_rescale(local_max: &Tensor, sumexp: &Tensor, global_max: &Tensor) -> Result<Tensor> {
        const OP: &str = "ce_rescale";
        let (n, dtype) = stats_rows(OP, &[local_max, sumexp, global_max])?;
        if on_device_kernels(sumexp) {
            return Tensor::cuda_ce_rescale(local_max, sumexp, global_max);
        }
        compute(OP, &[local_max, sumexp, global_max], Shape::new(&[n]), dtype, |st| {
            with_acc_type!(dtype, OP, |A| {
                let mut s = typed::<A>(OP, st[1])?.to_vec();
                ce::ce_rescale(typed::<A>(OP, st[0])?, &mut s, typed::<A>(OP, st[2])?)?;
                Ok(A::wrap(s))
            })
        })
    }

    /// `lse = max + ln(sumexp)` (`-inf` where `sumexp` is 0) of `[n]` statistics of one
    /// dtype (f32 or f64), on their device. Not recorded by autograd.
    pub fn ce_lse(max: &Tensor, sumexp: &Tensor) -> Result<Tensor> {
        const OP: &str = "ce_lse";
        let (n, dtype) = stats_rows(OP, &[max, sumexp])?;
        if on_device_kernels(max) {
            return Tensor::cuda_ce_lse(max, sumexp);
        }
        compute(OP, &[max, sumexp], Shape::new(&[n]), dtype, |st| {
            with_acc_type!(dtype, OP, |A| {
                let mut lse = vec![A::of(0.0); n];
                ce::ce_lse(typed::<A>(OP, st[0])?, typed::<A>(OP, st[1])?, &mut lse)?;
                Ok(A::wrap(lse))
            })
        })
    }

    /// The two sums a mean cross-entropy needs, as a `[2]` tensor on the statistics'
    /// device: the total of `lse - target_logit` over the rows whose i64 target is not
    /// `ignore_index`, and the number of those rows. `lse` and `target_logit` are `[rows]`
    /// statistics of one dtype. With the CUDA kernels (f32 statistics on a CUDA device)
    /// the sums are f32, reduced on the device; otherwise they are f64, each row's
    /// `lse - target_logit` computed in the statistics' dtype and added in row order.
    /// Not recorded by autograd.
    pub fn ce_loss_sums(
        lse: &Tensor,
        target_logit: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
    ) -> Result<Tensor> {
        const OP: &str = "ce_loss_sums";
        let (rows, dtype) = stats_rows(OP, &[lse, target_logit])?;
        if targets.dtype() != DType::I64 || targets.numel() != rows {
            return Err(invalid(OP, format!("needs {rows} i64 targets, got {targets:?}")));
        }
        if on_device_kernels(lse) {
            return Tensor::cuda_ce_loss_sums(lse, target_logit, targets, ignore_index);
        }
        compute(OP, &[lse, target_logit, targets], Shape::new(&[2]), DType::F64, |st| {
            let ts = typed::<i64>(OP, st[2])?;
            with_acc_type!(dtype, OP, |A| {
                let (lse, tl) = (typed::<A>(OP, st[0])?, typed::<A>(OP, st[1])?);
                let (mut total, mut count) = (0.0f64, 0.0f64);
                for ((&t, &l), &x) in ts.iter().zip(lse).zip(tl) {
                    if t != ignore_index {
                        total += (l - x).f64();
                        count += 1.0;
                    }
                }
                Ok(f64::wrap(vec![total, count]))
            })
        })
    }

    /// The cross-entropy gradient on a vocab shard of logits `self` (`[.., v_local]`,
    /// starting at global column `vocab_start`): `(softmax - onehot(target)) * scale`,
    /// from the global `lse` (`[rows]`) and a one-element `scale`, both in the logits'
    /// accumulator type (see [`Tensor::ce_shard_stats`]); in the logits' dtype, on their
    /// device, with zero rows where the target is `ignore_index`. Not recorded by
    /// autograd.
    pub fn ce_shard_backward(
        &self,
        targets: &Tensor,
        vocab_start: i64,
        ignore_index: i64,
        lse: &Tensor,
        scale: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "ce_shard_backward";
        let sd = stats_dtype(OP, self)?;
        if on_device_kernels(self) {
            return self.cuda_ce_shard_backward(targets, vocab_start, ignore_index, lse, scale);
        }
        let (rows, v_local) = rows_of(OP, self, targets)?;
        for (what, t, n) in [("lse", lse, rows), ("scale", scale, 1)] {
            if t.dtype() != sd || t.numel() != n {
                return Err(invalid(
                    OP,
                    format!(
                        "{what} must be {sd} with {n} values for {} logits, got {t:?}",
                        self.dtype()
                    ),
                ));
            }
        }
        compute(OP, &[self, targets, lse, scale], self.shape().clone(), self.dtype(), |st| {
            let ts = typed::<i64>(OP, st[1])?;
            with_float_type!(st[0].dtype(), OP, |T| {
                host_backward::<T>(
                    typed::<T>(OP, st[0])?,
                    ts,
                    typed::<<T as Float>::Acc>(OP, st[2])?,
                    typed::<<T as Float>::Acc>(OP, st[3])?,
                    rows,
                    v_local,
                    vocab_start,
                    ignore_index,
                )
            })
        })
    }
}
