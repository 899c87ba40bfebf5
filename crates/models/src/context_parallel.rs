//! The Llama on a context-parallel (`cp`) mesh axis.
//!
//! [`apply_context_parallel`] makes a [`LlamaForPretraining`] run on sequence shards: each
//! cp rank passes its rows of the token ids (and of a `[b, s]` padding mask) in the
//! load-balanced layout of [`CpLayout::new`] (cut them with [`CpLayout::shard`] on dim
//! 1), the model applies RoPE at each row's true position and runs attention through
//! [`context_parallel_attention`]; every other layer is per token and runs unchanged.
//! The logits are this rank's rows. [`cp_cross_entropy`] gives the loss as the mean over
//! the global non-ignored tokens (sum and count all-reduced over cp), and
//! [`all_reduce_gradients`] sums the gradients of the parameters over cp after backward
//! (parameters are replicated over cp). [`apply_context_parallel_stage`] does the same for
//! a pipeline stage.
//!
//! The global sequence length is the sum of the ranks' local lengths (one `all_reduce`
//! of a scalar per forward). An additive `[b, 1, s, s]` mask is refused under cp.

use std::sync::Arc;

use tpar_collectives::{ProcessGroup, ReduceOp};
use tpar_dtensor::{context_parallel_attention, ContextParallel, CpLayout, CpMethod};
use tpar_nn::{parameters, Module, NnError, Result, Value};
use tpar_tensor::{DType, Device, Tensor};

use crate::llama::{key_padding_mask, RopeTables, RotaryPositionEncoding};
use crate::{LlamaForPretraining, LlamaStage};

/// How a Llama runs on a cp axis: the group and the key/value exchange method.
#[derive(Debug, Clone)]
pub struct CpConfig {
    /// The cp process group (the `cp` mesh dim's group).
    pub group: ProcessGroup,
    /// How keys and values travel ([`CpMethod::Ring`] by default).
    pub method: CpMethod,
}

/// What attention receives in place of the plain RoPE tables under cp: the tables at this
/// rank's positions and the attention settings.
pub(crate) struct CpRope {
    pub(crate) tables: RopeTables,
    pub(crate) cp: ContextParallel,
}

fn bad(what: impl Into<String>) -> NnError {
    NnError::BadInput { module: "LlamaModel".into(), what: what.into() }
}

/// Runs `model` context-parallel over `group` (its attention exchanges keys and values by
/// `method`). Inputs must then be each rank's rows in the load-balanced layout.
pub fn apply_context_parallel(
    model: &mut LlamaForPretraining,
    group: &ProcessGroup,
    method: CpMethod,
) -> Result<()> {
    model.base_model.context_parallel = Some(CpConfig { group: group.clone(), method });
    Ok(())
}

/// [`apply_context_parallel`] for one pipeline stage: every stage of a pipeline on a cp
/// axis takes (and passes on) its rank's rows; the loss function of the last stage scales
/// each micro-batch's mean by [`cp_token_share`] and the gradients are summed over cp
/// ([`all_reduce_gradients`]) after the schedule's step.
pub fn apply_context_parallel_stage(
    stage: &mut LlamaStage,
    group: &ProcessGroup,
    method: CpMethod,
) -> Result<()> {
    stage.base_model.context_parallel = Some(CpConfig { group: group.clone(), method });
    Ok(())
}

/// The attention mask and the RoPE value of a context-parallel forward: the local key
/// padding mask (`[b, 1, 1, s_local]`) and [`CpRope`] at this rank's positions.
pub(crate) fn cp_inputs(
    cfg: &CpConfig,
    rope: &RotaryPositionEncoding,
    pad: Option<&Tensor>,
    b: usize,
    s_local: usize,
    dtype: DType,
    device: Device,
) -> Result<(Option<Tensor>, Value)> {
    let n = cfg.group.size();
    let me = cfg.group.rank();
    let len = Tensor::from_vec(vec![s_local as i64], [1])?;
    let seq = if n > 1 { cfg.group.all_reduce(&len, ReduceOp::Sum)? } else { len };
    let seq = seq.to_vec::<i64>()?[0] as usize;
    let layout = CpLayout::new(seq, n)?;
    if layout.local_len(me) != s_local {
        return Err(bad(format!(
            "cp rank {me} holds {s_local} positions; the load-balanced layout of a sequence of \
             {seq} over {n} ranks gives it {}",
            layout.local_len(me)
        )));
    }
    let mask = match pad {
        None => None,
        Some(m) if m.rank() == 2 => {
            Some(key_padding_mask(m, b, s_local, dtype)?.to_device(device)?)
        }
        Some(m) => {
            return Err(bad(format!(
                "context parallelism takes a [batch, seq] padding mask, not a mask of shape {:?}",
                m.dims()
            )))
        }
    };
    let full = rope.tables_on(seq, device)?;
    let tables =
        RopeTables { cos: layout.shard(&full.cos, 0, me)?, sin: layout.shard(&full.sin, 0, me)? };
    let cp = ContextParallel::new(&cfg.group, layout, cfg.method)?;
    Ok((mask, Value::Opaque(Arc::new(CpRope { tables, cp }))))
}

/// Context-parallel attention of `q`, `k`, `v` (plain tensors: this rank's rows, and its
/// heads under tensor parallelism).
pub(crate) fn cp_attention(
    cp: &CpRope,
    q: &Value,
    k: &Value,
    v: &Value,
    mask: Option<&Tensor>,
) -> Result<Value> {
    let plain = |x: &Value, what: &str| -> Result<Tensor> {
        match x {
            Value::Tensor(t) => Ok(t.clone()),
            other => Err(NnError::BadInput {
                module: "LlamaAttention".into(),
                what: format!("context parallelism takes local {what} tensors, got {other:?}"),
            }),
        }
    };
    let (q, k, v) = (plain(q, "query")?, plain(k, "key")?, plain(v, "value")?);
    Ok(Value::Tensor(context_parallel_attention(&q, &k, &v, mask, &cp.cp)?))
}

/// This rank's share of the batch's non-ignored tokens: `local / global`, where `local`
/// counts this rank's `labels` that are not `ignore_index` and `global` is their sum over
/// `group` (0 when no token is left). A rank's mean loss times its share, summed over the
/// ranks, is the mean over the global tokens; under a loss-parallel (vocab-sharded) loss,
/// scale the rank's [`Value`] loss by it (`Value::mul_scalar`). One `all_reduce`.
pub fn cp_token_share(labels: &Tensor, ignore_index: i64, group: &ProcessGroup) -> Result<f64> {
    let local = labels.to_vec::<i64>()?.iter().filter(|&&l| l != ignore_index).count();
    let count = Tensor::from_vec(vec![local as f64], [1])?;
    let global = if group.size() > 1 {
        group.all_reduce(&count, ReduceOp::Sum)?.to_vec::<f64>()?[0]
    } else {
        local as f64
    };
    Ok(if global > 0.0 { local as f64 / global } else { 0.0 })
}

/// The mean cross-entropy over the global non-ignored tokens of a cp-sharded batch:
/// `logits` `[n, vocab]` and `labels` `[n]` (i64) are this rank's rows. Returns
/// `(loss, global)`: `loss` is this rank's share (its tokens' summed loss over the global
/// count, [`cp_token_share`]), whose backward gives this rank's gradient contribution (sum
/// them over cp with [`all_reduce_gradients`]), and `global` the loss itself, equal on
/// every rank. One `all_reduce` of the count and one of the loss over `group`.
///
/// With data parallelism too, `group` is every rank holding tokens of the batch (the
/// flattened dp x cp group). FSDP sharded over that group averages gradients in its
/// reduce-scatter: multiply `loss` by the group's size before backward (the test
/// `cp2_dp2_fsdp_equals_unsharded` does so).
pub fn cp_cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    ignore_index: i64,
    group: &ProcessGroup,
) -> Result<(Tensor, f64)> {
    let share = cp_token_share(labels, ignore_index, group)?;
    let loss = logits.cross_entropy(labels, ignore_index)?.mul_scalar(share)?;
    let value = Tensor::from_vec(vec![loss.item()?], [1])?;
    let total = if group.size() > 1 {
        group.all_reduce(&value, ReduceOp::Sum)?.to_vec::<f64>()?[0]
    } else {
        loss.item()?
    };
    Ok((loss, total))
}

/// Sums every parameter's local gradient over `group` (the cp axis, over which the
/// parameters are replicated), in place. A parameter without a gradient is skipped on
/// every rank alike (ranks share the model).
pub fn all_reduce_gradients(model: &dyn Module, group: &ProcessGroup) -> Result<()> {
    if group.size() == 1 {
        return Ok(());
    }
    for p in parameters(model) {
        let t = p.trainable();
        if let Some(g) = t.grad() {
            let s = group.all_reduce(&g, ReduceOp::Sum)?;
            t.set_grad(Some(s));
        }
    }
    Ok(())
}
