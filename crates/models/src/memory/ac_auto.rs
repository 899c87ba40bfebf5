//! Activation checkpointing chosen for a memory budget: [`least_recompute`] picks, among
//! the policies a trainer can set (none; `selective[matmul,sdpa]`, `selective` and
//! `full`, each on every K-th decoder layer; and every layer selective but every K-th
//! full, [`AcPolicy::Mixed`]), the one whose recomputes cost a step the
//! least of those whose predicted peak fits, as PyTorch's compiler does under an
//! activation memory budget (`torch._functorch.config.activation_memory_budget`), here
//! for the eager policies.
//!
//! A policy's cost is [`recompute_share`]: the work its recomputes add to a step, as a
//! share of the decoder layers' forward. Work is counted as a roofline would: the
//! multiply-adds of the matrix products and attention, plus the bytes the memory-bound
//! ops read and write (the norms, the residual adds, RoPE, SwiGLU and attention's head
//! permutes), each byte weighed as [`MACS_PER_BYTE`] multiply-adds (a machine's compute
//! rate over its memory bandwidth). A checkpointed layer recomputes its whole forward
//! under `full` but for `down_proj` (whose output no backward reads), and under
//! `selective` what its kept ops do not hand back (the memory-bound ops always). Under a
//! zero-bubble schedule whose weight pass recomputes ([`WeightPass::Recompute`]) a
//! checkpointed layer of a stage after the first counts twice, plus one more forward
//! for its backward's products into its activations, which the weight pass runs again.
//! That count is a rule of thumb for the time, not a prediction of it: docs/PERF.md
//! ("Activation checkpointing") sets it against measured recompute times.

use std::fmt;

use tpar_nn::checkpoint::AcPolicy;
use tpar_tensor::checkpoint::{SaveOp, WeightPass};

use super::{check_fits, mib, predict_memory, LayerShape, MemoryConfig, MemoryError};
use super::{DataParallelMode, MemoryEstimate};

/// The policy [`least_recompute`] picked, its prediction and its cost.
#[derive(Clone, Debug, PartialEq)]
pub struct AcChoice {
    /// The policy.
    pub policy: AcPolicy,
    /// What its checkpointed layers hold between a zero-bubble schedule's input and weight
    /// passes (the configuration's own elsewhere).
    pub weight_pass: WeightPass,
    /// The configuration's prediction under it (the stage with the highest peak under a
    /// pipeline).
    pub estimate: MemoryEstimate,
    /// [`recompute_share`] under it: 0 without checkpointing.
    pub recompute: f64,
}

impl fmt::Display for AcChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ac {}", self.policy)?;
        if self.weight_pass == WeightPass::Recompute {
            write!(f, " with the weight pass recomputing")?;
        }
        write!(
            f,
            ": predicted peak {}, recomputing {:.1} % of the decoder layers' forward",
            mib(self.estimate.peak),
            self.recompute * 100.0
        )
    }
}

/// Multiply-adds a byte of memory traffic is weighed as: on the host about the f32
/// multiply-add rate of a core's vector units over its share of memory bandwidth (5 on
/// the 2-core AVX-512 machines of docs/PERF.md, where an f32 layer's memory-bound ops took
/// 0.10 of its forward); on a CUDA device the tensor cores' rate over HBM bandwidth (an
/// H100's or H200's published dense bf16 rate over its memory bandwidth, about 100; not
/// measured on a GPU).
pub const MACS_PER_BYTE: [f64; 2] = [5.0, 100.0];

/// The work of one decoder layer's forward per token of a rank's rows, in multiply-adds:
/// each matrix product's in the order the layer runs them (as [`LayerShape::matmuls`]
/// lists them), attention's, and the memory-bound ops' traffic weighed by
/// [`MACS_PER_BYTE`].
struct LayerWork {
    matmuls: Vec<f64>,
    attention: f64,
    memory_bound: f64,
}

impl LayerWork {
    fn of(shape: &LayerShape, fused: bool, seq: usize, bytes: f64) -> LayerWork {
        let (full, q, kv, mlp) = (shape.full, shape.q, shape.kv, shape.mlp);
        // Output width times input width: q, k, v, gate and up read the normed input,
        // o_proj attention's output, down_proj SwiGLU's.
        let matmuls = if fused {
            vec![(q + 2.0 * kv) * full, full * q, 2.0 * mlp * full, full * mlp]
        } else {
            vec![q * full, kv * full, kv * full, full * q, mlp * full, mlp * full, full * mlp]
        };
        // Causal: a query attends to (s + 1) / 2 keys on average, for `Q K^T` and `P V`.
        let attention = shape.attn_q * (seq as f64 + 1.0);
        // Elements read and written: two norms (x in, the normed x out) and two residual
        // adds (two in, one out) on the residual stream, RoPE of q and k, the permutes of
        // q, k and v to heads and of the output back, SwiGLU (gate and up in, one out).
        let (aq, akv) = (shape.attn_q, shape.attn_kv);
        let elements = 4.0 * shape.resid
            + 6.0 * shape.resid
            + 2.0 * (aq + akv)
            + 2.0 * (aq + 2.0 * akv)
            + 2.0 * aq
            + 3.0 * mlp;
        let balance = MACS_PER_BYTE[usize::from(shape.device)];
        LayerWork { matmuls, attention, memory_bound: elements * bytes * balance }
    }

    fn forward(&self) -> f64 {
        self.matmuls.iter().sum::<f64>() + self.attention + self.memory_bound
    }

    /// What a layer checkpointed keeping `keep` (empty: full) recomputes.
    fn recompute(&self, shape: &LayerShape, keep: &[SaveOp], fused: bool) -> f64 {
        let kept = shape.matmuls(keep, fused);
        let down = kept.len() - 1;
        let matmuls: f64 = (0..down).filter(|&n| !kept[n].0).map(|n| self.matmuls[n]).sum();
        let attention = if keep.contains(&SaveOp::Sdpa) { 0.0 } else { self.attention };
        matmuls + attention + self.memory_bound
    }
}

/// The work `c`'s activation checkpointing adds to a step, as a share of its decoder
/// layers' forward (module docs): 0 for [`AcPolicy::None`], just under 1 for `full` on
/// every layer (`down_proj` is not recomputed). Under a pipeline the policy applies to
/// each stage's layers, as the trainers apply it; under zero-bubble with
/// [`WeightPass::Recompute`] the stages after the first recompute twice (module docs).
pub fn recompute_share(c: &MemoryConfig) -> Result<f64, MemoryError> {
    let compute = compute_dtype(c);
    let shape = LayerShape::of(c, compute);
    let fused = c.fusion.projections && c.tp == 1;
    let work = LayerWork::of(&shape, fused, c.seq, compute.size_in_bytes() as f64);
    let layers = c.model.num_hidden_layers;
    let stages = c.pp.max(1) * if c.pp > 1 { c.stages_per_rank } else { 1 };
    let ranges = tpar_pipeline::split_blocks(layers, stages, None)
        .map_err(|e| super::config_err(e.to_string()))?;
    let forward = layers as f64 * work.forward();
    if forward == 0.0 {
        return Ok(0.0);
    }
    // Under zero-bubble with the weight pass recomputing, a stage after the first (whose
    // backward splits) runs each checkpointed layer a second time and its backward's
    // products into the layer's activations again, counted as one more forward.
    let again = c.splits_backward() && c.ac_weight_pass == WeightPass::Recompute;
    // The policy counts each stage's layers from its first, as the trainers apply it.
    let recompute: f64 = ranges
        .iter()
        .enumerate()
        .flat_map(|(s, r)| (0..r.len()).filter_map(|l| c.ac.keeps(l)).map(move |k| (s, k)))
        .map(|(s, keep)| {
            let once = work.recompute(&shape, &keep, fused);
            if again && s > 0 {
                2.0 * once + work.forward()
            } else {
                once
            }
        })
        // from +0.0: `sum` of no f64 is -0.0, and none's share is printed
        .fold(0.0, |a, b| a + b);
    Ok(recompute / forward)
}

fn compute_dtype(c: &MemoryConfig) -> tpar_tensor::DType {
    match c.data_parallel {
        DataParallelMode::Fsdp { param_dtype } => param_dtype.unwrap_or(c.model.dtype),
        _ => c.model.dtype,
    }
}

/// The policies [`least_recompute`] weighs for `c`: none, then for each K from 1 to the
/// most layers a stage has, `selective[matmul,sdpa]:K`, `selective:K` and `full:K`, and
/// from 2 on `selective[matmul,sdpa]+full:K` and `selective+full:K`.
pub fn ac_candidates(c: &MemoryConfig) -> Vec<AcPolicy> {
    let stages = c.pp.max(1) * if c.pp > 1 { c.stages_per_rank } else { 1 };
    let most = c.model.num_hidden_layers.div_ceil(stages.max(1));
    let mut out = vec![AcPolicy::None];
    let kept_all = vec![SaveOp::Matmul, SaveOp::Sdpa];
    for every in 1..=most {
        out.push(AcPolicy::Selective { every, ops: kept_all.clone() });
        out.push(AcPolicy::Selective { every, ops: SaveOp::DEFAULT.to_vec() });
        out.push(AcPolicy::Full { every });
        if every > 1 {
            out.push(AcPolicy::Mixed { full_every: every, ops: kept_all.clone() });
            out.push(AcPolicy::Mixed { full_every: every, ops: SaveOp::DEFAULT.to_vec() });
        }
    }
    out
}

/// The activation-checkpointing policy for `c` (its own `ac` is not read) with the least
/// [`recompute_share`] among [`ac_candidates`] whose predicted peak fits in `budget`
/// bytes; of equal cost, the lower peak, then the earlier candidate. Under a zero-bubble
/// pipeline each checkpointing policy is weighed with either weight pass (`c`'s own
/// `ac_weight_pass` is not read either; `keep` first); elsewhere the choice keeps `c`'s.
///
/// When none fits, [`MemoryError::DoesNotFit`] for `c` without checkpointing, whose
/// alternatives combine checkpointing with the other settings ([`check_fits`]).
///
/// ```
/// use tpar_models::memory::{least_recompute, predict_memory, MemoryConfig};
/// use tpar_models::LlamaConfig;
/// use tpar_nn::checkpoint::AcPolicy;
/// let model = LlamaConfig {
///     vocab_size: 256, hidden_size: 128, intermediate_size: 344, num_hidden_layers: 4,
///     num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 1024,
///     ..Default::default()
/// };
/// let c = MemoryConfig::new(model, 8, 1024);
/// let none = predict_memory(&c)?.peak;
/// // Room for everything: nothing is recomputed.
/// assert_eq!(least_recompute(&c, none)?.policy, AcPolicy::None);
/// // Three quarters: the cheapest policy that fits, and it does.
/// let choice = least_recompute(&c, none * 3 / 4)?;
/// assert!(choice.estimate.peak <= none * 3 / 4 && choice.recompute > 0.0);
/// # Ok::<(), tpar_models::memory::MemoryError>(())
/// ```
pub fn least_recompute(c: &MemoryConfig, budget: u64) -> Result<AcChoice, MemoryError> {
    let modes = if c.splits_backward() {
        vec![WeightPass::Keep, WeightPass::Recompute]
    } else {
        vec![c.ac_weight_pass]
    };
    let mut best: Option<AcChoice> = None;
    for policy in ac_candidates(c) {
        for &weight_pass in &modes {
            // Without checkpointing the weight pass has nothing to recompute.
            if policy == AcPolicy::None && weight_pass != modes[0] {
                continue;
            }
            let n = MemoryConfig { ac: policy.clone(), ac_weight_pass: weight_pass, ..c.clone() };
            let estimate = predict_memory(&n)?;
            if estimate.peak > budget {
                continue;
            }
            let recompute = recompute_share(&n)?;
            let better = best
                .as_ref()
                .is_none_or(|b| (recompute, estimate.peak) < (b.recompute, b.estimate.peak));
            if better {
                best = Some(AcChoice { policy: policy.clone(), weight_pass, estimate, recompute });
            }
        }
    }
    if let Some(choice) = best {
        return Ok(choice);
    }
    let none = MemoryConfig { ac: AcPolicy::None, ..c.clone() };
    check_fits(&none, budget)?;
    // `none` is a candidate, so it fits only where the prediction did not fail above.
    Err(super::config_err("no activation-checkpointing policy was predicted"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LlamaConfig;
    use tpar_pipeline::ScheduleKind;

    fn config(layers: usize, seq: usize) -> MemoryConfig {
        let model = LlamaConfig {
            vocab_size: 256,
            hidden_size: 256,
            intermediate_size: 688,
            num_hidden_layers: layers,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            max_position_embeddings: seq,
            ..Default::default()
        };
        MemoryConfig::new(model, 1, seq)
    }

    fn share(c: &MemoryConfig, ac: &str) -> f64 {
        recompute_share(&MemoryConfig { ac: ac.parse().unwrap(), ..c.clone() }).unwrap()
    }

    /// Under zero-bubble with the weight pass recomputing, the second stage's layers count
    /// twice plus a forward; the first stage's, and every stage of 1F1B, once.
    #[test]
    fn a_recomputing_weight_pass_counts_the_later_stages_twice_and_a_forward() {
        let pp = |schedule, wp| MemoryConfig {
            pp: 2,
            microbatches: 2,
            schedule,
            ac_weight_pass: wp,
            ..config(8, 2048)
        };
        let zb = ScheduleKind::ZeroBubble;
        let keep = share(&pp(zb, WeightPass::Keep), "full");
        let again = share(&pp(zb, WeightPass::Recompute), "full");
        // Half the layers: (once + once + forward) instead of once, over all layers' forward.
        assert!((again - (1.5 * keep + 0.5)).abs() < 1e-12, "{keep} {again}");
        let f1b = ScheduleKind::OneFOneB;
        assert_eq!(
            share(&pp(f1b, WeightPass::Recompute), "full").to_bits(),
            share(&pp(f1b, WeightPass::Keep), "full").to_bits()
        );
        assert_eq!(share(&pp(zb, WeightPass::Recompute), "none").to_bits(), 0.0f64.to_bits());
    }

    #[test]
    fn the_shares_follow_what_each_policy_recomputes() {
        let c = config(8, 2048);
        assert_eq!(share(&c, "none").to_bits(), 0.0f64.to_bits());
        let full = share(&c, "full");
        // Everything but down_proj: 176K of the layer's 1.25M multiply-adds per token at
        // hidden 256, MLP 688 and 2048 tokens, with 6928 f32 elements of memory-bound
        // traffic (139K at 5 per byte): 1.21M of 1.39M.
        assert!((full - 1_211_968.0 / 1_388_096.0).abs() < 1e-12, "{full}");
        // Every second layer of 8: half.
        assert!((share(&c, "full:2") - full / 2.0).abs() < 1e-12);
        // Selective keeps attention and q, v, gate: it recomputes k, o, up and the
        // memory-bound ops.
        let selective = share(&c, "selective");
        assert!((selective - 412_992.0 / 1_388_096.0).abs() < 1e-12, "{selective}");
        // Keeping every matmul and attention leaves the memory-bound ops.
        let kept_all = share(&c, "selective[matmul,sdpa]");
        assert!((kept_all - 138_560.0 / 1_388_096.0).abs() < 1e-12, "{kept_all}");
        // On a device a byte weighs more against the tensor cores' rate.
        let device = MemoryConfig { host: false, ..c.clone() };
        assert!(share(&device, "selective[matmul,sdpa]") > kept_all);
        // Attention's share grows with the sequence: selective costs less of a forward.
        let short = config(8, 128);
        assert!(share(&short, "selective") > selective);
    }

    #[test]
    fn the_cheapest_policy_that_fits_is_picked() {
        let c = config(8, 2048);
        let none = predict_memory(&c).unwrap().peak;
        let full =
            predict_memory(&MemoryConfig { ac: AcPolicy::full(), ..c.clone() }).unwrap().peak;
        assert_eq!(least_recompute(&c, none).unwrap().policy, AcPolicy::None);
        let mut seen = Vec::new();
        for k in 1..10 {
            let budget = full + (none - full) * k / 10;
            let choice = least_recompute(&c, budget).unwrap();
            assert!(choice.estimate.peak <= budget);
            // No candidate that costs less fits.
            for p in ac_candidates(&c) {
                let n = MemoryConfig { ac: p.clone(), ..c.clone() };
                if recompute_share(&n).unwrap() < choice.recompute {
                    assert!(predict_memory(&n).unwrap().peak > budget, "{p} fits {budget}");
                }
            }
            seen.push(choice.policy.to_string());
        }
        // The budgets between full's peak and none's pick more than the two ends.
        seen.dedup();
        assert!(seen.len() >= 3, "{seen:?}");
        assert_eq!(least_recompute(&c, full).unwrap().recompute, share(&c, "full"));
    }

    /// Under zero-bubble the pick weighs the recomputing weight pass: at a budget no policy
    /// fits keeping the recomputed graphs, one fits recomputing them; with room, the
    /// cheaper keep is picked.
    #[test]
    fn zero_bubble_picks_the_weight_pass_too() {
        let c = MemoryConfig {
            pp: 2,
            microbatches: 2,
            schedule: ScheduleKind::ZeroBubble,
            batch: 2,
            ..config(8, 2048)
        };
        let peak = |ac: AcPolicy, wp| {
            predict_memory(&MemoryConfig { ac, ac_weight_pass: wp, ..c.clone() }).unwrap().peak
        };
        let keep_least =
            ac_candidates(&c).into_iter().map(|p| peak(p, WeightPass::Keep)).min().unwrap();
        let again = peak(AcPolicy::full(), WeightPass::Recompute);
        assert!(again < keep_least, "{again} {keep_least}");
        let choice = least_recompute(&c, again).unwrap();
        assert_eq!(choice.weight_pass, WeightPass::Recompute, "{choice}");
        assert!(choice.estimate.peak <= again && choice.to_string().contains("recomputing"));
        // Its cost is the recomputing weight pass's.
        let n = MemoryConfig {
            ac: choice.policy.clone(),
            ac_weight_pass: WeightPass::Recompute,
            ..c.clone()
        };
        assert_eq!(choice.recompute.to_bits(), recompute_share(&n).unwrap().to_bits());
        // Room for keeping: the same policy costs less kept.
        let roomy = least_recompute(&c, keep_least).unwrap();
        assert_eq!(roomy.weight_pass, WeightPass::Keep, "{roomy}");
        // Without a split backward the configuration's own mode stays.
        let f1b = MemoryConfig {
            schedule: ScheduleKind::OneFOneB,
            ac_weight_pass: WeightPass::Recompute,
            ..c.clone()
        };
        let budget = predict_memory(&MemoryConfig { ac: AcPolicy::full(), ..f1b.clone() }).unwrap();
        assert_eq!(least_recompute(&f1b, budget.peak).unwrap().weight_pass, WeightPass::Recompute);
    }

    #[test]
    fn a_budget_nothing_fits_names_what_would() {
        let c = MemoryConfig { dp: 2, data_parallel: DataParallelMode::Ddp, ..config(8, 2048) };
        let full = MemoryConfig { ac: AcPolicy::full(), ..c.clone() };
        let budget = predict_memory(&full).unwrap().peak - 1;
        match least_recompute(&c, budget) {
            Err(MemoryError::DoesNotFit { alternatives, .. }) => {
                assert!(!alternatives.is_empty());
                assert!(alternatives.iter().all(|a| a.estimate.peak <= budget));
            }
            other => panic!("{other:?}"),
        }
    }
}
