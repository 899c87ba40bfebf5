//! What would fit: the configurations near one whose predicted peak exceeds a budget
//! that keep its world size and its global batch and do fit ([`alternatives`]), and
//! [`check_fits`], which refuses a configuration with them in the error.
//!
//! The search changes seven settings, each over the values a trainer can choose without
//! changing what it trains (the same tokens per step, on the same ranks):
//!
//! - **activation checkpointing**: a policy predicted to hold less than the
//!   configuration's, of those [`least_recompute`](super::least_recompute) weighs (none,
//!   `selective[matmul,sdpa]:K`, `selective:K`, `full:K`, `selective+full:K`), the least
//!   recompute first, each holding less than every one that recomputes less;
//! - **the weight pass** (under a zero-bubble pipeline with checkpointing): recomputing
//!   the checkpointed layers again in the weight pass instead of keeping their
//!   recomputed graphs' weight halves ([`WeightPass::Recompute`]);
//! - **the data-parallel mode**: one that shards more (DDP, then ZeRO-1, then FSDP
//!   without mixed precision, so the parameters keep their dtype), where the
//!   data-parallel group has more than one rank;
//! - **the mesh**: another split of the same ranks into `dp x cp x tp` (`pp` kept), with
//!   `tp` dividing the query heads, the key/value heads, the hidden size, the MLP width
//!   and the sequence, `2 cp tp` dividing the sequence under context parallelism, and
//!   the global batch (`batch * dp`) divided evenly between the new `dp` ranks;
//! - **micro-batches** (under a pipeline): 2, 4 or 8 times as many, as long as they
//!   divide the batch;
//! - **the tensor-parallel plan**: Megatron's instead of the sequence-parallel one,
//!   whose attention computes every head on each rank (where `tp > 1` and `tp` divides
//!   the heads);
//! - **the context-parallel method**: the ring instead of the all-gather, which holds
//!   every rank's keys and values at once (where `cp > 1`).
//!
//! Every combination is predicted ([`predict_memory`]); of those that fit, only the
//! least ones are kept: a combination is left out when another that fits changes no
//! setting further (recomputes no more, shards no more, has no more micro-batches,
//! changes the plan or the method only where it does too, and keeps the mesh or has the
//! same one). They are listed with the fewest settings changed first, then in a fixed
//! order of how much a change costs a step (the data-parallel mode, the plan and the
//! method, which keep the arithmetic, first; then selective checkpointing,
//! micro-batches, the mesh, and full or mixed checkpointing and a recomputing weight pass
//! last; two policies by their recompute), then by predicted peak. That order is a rule of thumb, not a prediction
//! of step time.
//!
//! The predictions have the model's accuracy (`tests/memory_model.rs` holds each
//! within 15 % of the measured peak): a configuration predicted just under the budget
//! may not fit.

use std::cmp::Ordering;
use std::fmt;

use tpar_dtensor::CpMethod;
use tpar_nn::checkpoint::AcPolicy;
use tpar_tensor::checkpoint::WeightPass;

use super::{
    ac_candidates, mib, predict_memory, recompute_share, DataParallelMode, MemoryConfig,
    MemoryError, MemoryEstimate, TpPlan,
};

/// One setting an [`Alternative`] changes.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// The data-parallel mode.
    DataParallel(DataParallelMode),
    /// The activation-checkpointing policy of the decoder layers.
    Ac(AcPolicy),
    /// What checkpointed layers hold between a zero-bubble schedule's input and weight
    /// passes.
    WeightPass(WeightPass),
    /// Micro-batches per step (under a pipeline).
    Microbatches(usize),
    /// The tensor-parallel plan.
    Plan(TpPlan),
    /// How context-parallel attention exchanges keys and values.
    CpMethod(CpMethod),
    /// The split of the ranks into `dp x cp x tp` (`pp` kept), with the sequences per
    /// dp rank that keep the global batch.
    Mesh {
        /// Data-parallel degree.
        dp: usize,
        /// Context-parallel degree.
        cp: usize,
        /// Tensor-parallel degree.
        tp: usize,
        /// Sequences per dp rank per step.
        batch: usize,
    },
}

impl Change {
    /// The change's place in the order of [`alternatives`] (a change that costs a step
    /// less comes first).
    fn rank(&self) -> u8 {
        match self {
            Change::DataParallel(_) | Change::Plan(_) | Change::CpMethod(_) => 0,
            Change::Ac(AcPolicy::Full { .. } | AcPolicy::Mixed { .. }) | Change::WeightPass(_) => 4,
            Change::Ac(_) => 1,
            Change::Microbatches(_) => 2,
            Change::Mesh { .. } => 3,
        }
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::DataParallel(DataParallelMode::None) => write!(f, "no data parallelism"),
            Change::DataParallel(DataParallelMode::Ddp) => write!(f, "DDP"),
            Change::DataParallel(DataParallelMode::Zero1) => write!(f, "ZeRO-1"),
            Change::DataParallel(DataParallelMode::Fsdp { param_dtype: None }) => {
                write!(f, "FSDP")
            }
            Change::DataParallel(DataParallelMode::Fsdp { param_dtype: Some(d) }) => {
                write!(f, "FSDP ({d} compute)")
            }
            Change::Ac(p) => write!(f, "ac {p}"),
            Change::WeightPass(w) => write!(f, "ac weight pass {w}"),
            Change::Microbatches(m) => write!(f, "{m} micro-batches"),
            Change::Plan(TpPlan::Megatron) => write!(f, "plan megatron"),
            Change::Plan(TpPlan::SequenceParallel) => write!(f, "plan sp"),
            Change::CpMethod(CpMethod::Ring) => write!(f, "cp ring"),
            Change::CpMethod(CpMethod::AllGather) => write!(f, "cp all-gather"),
            Change::Mesh { dp, cp, tp, batch } => {
                write!(f, "dp {dp} x cp {cp} x tp {tp} (batch {batch} per dp rank)")
            }
        }
    }
}

/// A configuration near another, and its prediction.
#[derive(Clone, Debug, PartialEq)]
pub struct Alternative {
    /// What it changes, the kinds that cost a step least first (module docs).
    pub changes: Vec<Change>,
    /// The configuration.
    pub config: MemoryConfig,
    /// Its prediction (the stage with the highest peak under a pipeline).
    pub estimate: MemoryEstimate,
}

impl fmt::Display for Alternative {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let words: Vec<String> = self.changes.iter().map(Change::to_string).collect();
        write!(f, "{}: predicted peak {}", words.join(", "), mib(self.estimate.peak))
    }
}

/// How far a candidate moves each setting from the configuration, one level per
/// setting in the order of [`candidates`]' dimensions: 0 keeps it, a higher level goes
/// further. The mesh (dimension [`MESH`]) has no order: its level is 1 + the index of
/// the split.
type Steps = [usize; 7];

/// The dimension of [`Steps`] that is the mesh.
const MESH: usize = 6;

/// Whether `a` changes no setting further than `b` (and is not `b`).
fn no_further_than(a: &Steps, b: &Steps) -> bool {
    a != b && (0..a.len()).all(|d| if d == MESH { a[d] == 0 || a[d] == b[d] } else { a[d] <= b[d] })
}

/// The activation-checkpointing policies to try instead of `c`'s, the least recompute
/// first: of [`ac_candidates`], those predicted (on `c`'s other settings) to hold less
/// than `c`'s own policy, and of those only the ones no other candidate beats on both
/// [`recompute_share`] and peak (the policies `least_recompute` can pick).
fn stronger_ac(c: &MemoryConfig) -> Vec<AcPolicy> {
    let Ok(own) = predict_memory(c) else { return Vec::new() };
    let mut scored: Vec<(f64, u64, AcPolicy)> = ac_candidates(c)
        .into_iter()
        .filter(|p| *p != c.ac)
        .filter_map(|p| {
            let n = MemoryConfig { ac: p.clone(), ..c.clone() };
            let peak = predict_memory(&n).ok()?.peak;
            Some((recompute_share(&n).ok()?, peak, p))
        })
        .filter(|(_, peak, _)| *peak < own.peak)
        .collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    // Walking up the cost, a policy is kept when it holds less than every cheaper one.
    let mut lowest = u64::MAX;
    let mut out = Vec::new();
    for (_, peak, p) in scored {
        if peak < lowest {
            lowest = peak;
            out.push(p);
        }
    }
    out
}

/// The data-parallel modes that shard more than `mode`, in order.
fn stronger_dp(mode: DataParallelMode) -> Vec<DataParallelMode> {
    let fsdp = DataParallelMode::Fsdp { param_dtype: None };
    match mode {
        DataParallelMode::None => vec![DataParallelMode::Ddp, DataParallelMode::Zero1, fsdp],
        DataParallelMode::Ddp => vec![DataParallelMode::Zero1, fsdp],
        DataParallelMode::Zero1 => vec![fsdp],
        DataParallelMode::Fsdp { .. } => Vec::new(),
    }
}

/// The other splits of `c`'s `dp * cp * tp` ranks that the model, the sequence and the
/// global batch allow: `(dp, cp, tp, batch per dp rank)`.
fn meshes(c: &MemoryConfig) -> Vec<(usize, usize, usize, usize)> {
    let m = &c.model;
    let ranks = c.dp * c.cp * c.tp;
    let global = c.batch * c.dp;
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for tp in divisors(ranks) {
        let tp_ok = [m.num_attention_heads, m.num_key_value_heads, m.hidden_size]
            .into_iter()
            .chain([m.intermediate_size, c.seq])
            .all(|n| n.is_multiple_of(tp));
        if !tp_ok {
            continue;
        }
        for cp in divisors(ranks / tp) {
            let dp = ranks / tp / cp;
            if (cp > 1 && !c.seq.is_multiple_of(2 * cp * tp)) || !global.is_multiple_of(dp) {
                continue;
            }
            if (dp, cp, tp) != (c.dp, c.cp, c.tp) {
                out.push((dp, cp, tp, global / dp));
            }
        }
    }
    out
}

/// Every configuration near `c` that keeps its world size and global batch and whose
/// predicted peak fits in `budget` bytes, the least changes first (module docs). Empty
/// when `c` fits already, or when no such change fits.
pub fn alternatives(c: &MemoryConfig, budget: u64) -> Vec<Alternative> {
    if predict_memory(c).is_ok_and(|e| e.peak <= budget) {
        return Vec::new();
    }
    let fitting: Vec<(Steps, Alternative)> =
        candidates(c).into_iter().filter(|(_, a)| a.estimate.peak <= budget).collect();
    let mut kept: Vec<(Steps, Alternative)> = fitting
        .iter()
        .filter(|(s, _)| !fitting.iter().any(|(o, _)| no_further_than(o, s)))
        .cloned()
        .collect();
    kept.sort_by(|(_, a), (_, b)| order(a, b));
    kept.into_iter().map(|(_, a)| a).collect()
}

/// The candidate near `c` (as [`alternatives`] searches) with the lowest predicted peak,
/// whether or not it fits; `None` when no setting can change.
pub fn lowest_peak(c: &MemoryConfig) -> Option<Alternative> {
    candidates(c)
        .into_iter()
        .map(|(_, a)| a)
        .min_by(|a, b| a.estimate.peak.cmp(&b.estimate.peak).then_with(|| order(a, b)))
}

/// The order of [`alternatives`]: fewer changes, then the cheaper kinds, then the less
/// recompute, then the lower peak.
fn order(a: &Alternative, b: &Alternative) -> Ordering {
    let ranks = |x: &Alternative| {
        let mut r: Vec<u8> = x.changes.iter().map(Change::rank).collect();
        r.sort_unstable_by(|p, q| q.cmp(p));
        r
    };
    a.changes
        .len()
        .cmp(&b.changes.len())
        .then_with(|| ranks(a).cmp(&ranks(b)))
        .then_with(|| {
            let share = |x: &Alternative| recompute_share(&x.config).unwrap_or(0.0);
            share(a).total_cmp(&share(b))
        })
        .then_with(|| a.estimate.peak.cmp(&b.estimate.peak))
}

/// Every combination of the seven settings but `c` itself that the model predicts.
fn candidates(c: &MemoryConfig) -> Vec<(Steps, Alternative)> {
    // Per setting, the changes in order (level 1, 2, ...); level 0 keeps `c`'s.
    let mut dims: Vec<Vec<Change>> = vec![
        stronger_dp(c.data_parallel).into_iter().map(Change::DataParallel).collect(),
        stronger_ac(c).into_iter().map(Change::Ac).collect(),
        // Only where the schedule splits the backward; pointless without checkpointing.
        if c.splits_backward() && c.ac_weight_pass == WeightPass::Keep {
            vec![Change::WeightPass(WeightPass::Recompute)]
        } else {
            Vec::new()
        },
        if c.pp > 1 {
            [2, 4, 8].map(|t| Change::Microbatches(c.microbatches * t)).to_vec()
        } else {
            Vec::new()
        },
        vec![Change::Plan(TpPlan::Megatron)],
        vec![Change::CpMethod(CpMethod::Ring)],
    ];
    let meshes =
        meshes(c).into_iter().map(|(dp, cp, tp, batch)| Change::Mesh { dp, cp, tp, batch });
    dims.push(meshes.collect());
    debug_assert_eq!(dims.len(), MESH + 1);
    let mut out = Vec::new();
    let mut steps: Steps = [0; 7];
    loop {
        if steps != [0; 7] {
            if let Some(a) = candidate(c, &dims, &steps) {
                out.push((steps, a));
            }
        }
        // The next combination, the last dimension fastest.
        let Some(d) = (0..dims.len()).rev().find(|&d| steps[d] < dims[d].len()) else {
            return out;
        };
        steps[d] += 1;
        steps[d + 1..].fill(0);
    }
}

/// `c` with the changes `steps` picks from `dims`, predicted; `None` where a change has
/// no effect there (a data-parallel mode without a group to shard over, a plan without
/// tp, a method without cp), the mesh needs a mode, or the model refuses it.
fn candidate(c: &MemoryConfig, dims: &[Vec<Change>], steps: &Steps) -> Option<Alternative> {
    let mut n = c.clone();
    let mut changes: Vec<Change> = Vec::new();
    for (d, &level) in steps.iter().enumerate() {
        if level == 0 {
            continue;
        }
        let ch = dims[d][level - 1].clone();
        match &ch {
            Change::DataParallel(mode) => n.data_parallel = *mode,
            Change::Ac(ac) => n.ac = ac.clone(),
            Change::WeightPass(w) => n.ac_weight_pass = *w,
            Change::Microbatches(m) => n.microbatches = *m,
            Change::Plan(plan) => n.plan = *plan,
            Change::CpMethod(method) => n.cp_method = *method,
            Change::Mesh { dp, cp, tp, batch } => {
                (n.dp, n.cp, n.tp, n.batch) = (*dp, *cp, *tp, *batch)
            }
        }
        changes.push(ch);
    }
    let m = &n.model;
    let divides = |t: usize| {
        m.num_attention_heads.is_multiple_of(t) && m.num_key_value_heads.is_multiple_of(t)
    };
    let pointless = changes.iter().any(|ch| match ch {
        Change::DataParallel(_) => n.dp * n.cp == 1,
        Change::Plan(_) => n.tp == 1 || c.plan == TpPlan::Megatron || !divides(n.tp),
        Change::CpMethod(_) => n.cp == 1 || c.cp_method == CpMethod::Ring,
        Change::WeightPass(_) => n.ac == AcPolicy::None,
        _ => false,
    });
    if pointless || (n.dp > 1 && n.data_parallel == DataParallelMode::None) {
        return None;
    }
    let estimate = predict_memory(&n).ok()?;
    changes.sort_by_key(Change::rank);
    Some(Alternative { changes, config: n, estimate })
}

/// Predicts `c` and returns the estimate when its peak fits in `budget` bytes; otherwise
/// [`MemoryError::DoesNotFit`] with the estimate, the budget, the [`alternatives`] that
/// would fit and, when none does, the [`lowest_peak`] among them.
///
/// ```
/// use tpar_models::memory::{check_fits, predict_memory, MemoryConfig, MemoryError};
/// use tpar_models::LlamaConfig;
/// let model = LlamaConfig {
///     vocab_size: 256, hidden_size: 128, intermediate_size: 344, num_hidden_layers: 4,
///     num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 1024,
///     ..Default::default()
/// };
/// let c = MemoryConfig::new(model, 8, 1024);
/// let peak = predict_memory(&c)?.peak;
/// match check_fits(&c, peak * 3 / 4) {
///     Err(MemoryError::DoesNotFit { alternatives, .. }) => {
///         // activation checkpointing brings it under three quarters
///         assert!(alternatives[0].estimate.peak <= peak * 3 / 4);
///         assert!(alternatives[0].to_string().starts_with("ac "));
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), MemoryError>(())
/// ```
pub fn check_fits(c: &MemoryConfig, budget: u64) -> Result<MemoryEstimate, MemoryError> {
    let estimate = predict_memory(c)?;
    if estimate.peak <= budget {
        return Ok(estimate);
    }
    let alternatives = alternatives(c, budget);
    let lowest = if alternatives.is_empty() { lowest_peak(c).map(Box::new) } else { None };
    Err(MemoryError::DoesNotFit {
        config: estimate.config.clone(),
        estimate: Box::new(estimate),
        budget,
        alternatives,
        lowest,
    })
}

/// The end of [`MemoryError::DoesNotFit`]'s message: the alternatives (at most three),
/// or the lowest peak near it when none fits.
pub(super) fn hint(alternatives: &[Alternative], lowest: Option<&Alternative>) -> String {
    const SHOWN: usize = 3;
    if !alternatives.is_empty() {
        let shown: Vec<String> = alternatives.iter().take(SHOWN).map(|a| a.to_string()).collect();
        let more = match alternatives.len().saturating_sub(SHOWN) {
            0 => String::new(),
            n => format!("; and {n} more"),
        };
        return format!(
            "; on the same ranks with the same global batch it would fit with {}{more}",
            shown.join("; or ")
        );
    }
    match lowest {
        Some(l) => format!(
            "; no change of checkpointing, data-parallel mode, mesh, micro-batches, plan or \
             cp method on the same ranks fits either, the lowest being {l}"
        ),
        None => String::new(),
    }
}
