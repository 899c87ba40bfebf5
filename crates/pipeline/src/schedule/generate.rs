//! The action lists of the generated schedules. Sizes are checked by the caller
//! (`pp`, `stages_per_rank` and `n` at least 1), and the result is checked by
//! `Schedule::validate` afterwards.

use super::{Action, Phase};

/// GPipe: every rank runs all forwards of its stage, then all backwards, both in
/// micro-batch order.
pub(super) fn gpipe(pp: usize, n: usize) -> Vec<Vec<Action>> {
    (0..pp)
        .map(|rank| {
            let forwards = (0..n).map(|m| Action::new(rank, m, Phase::F));
            forwards.chain((0..n).map(|m| Action::new(rank, m, Phase::B))).collect()
        })
        .collect()
}

/// 1F1B: rank `r` runs `min(pp-1-r, n)` forwards, then pairs of (next forward, oldest
/// backward), then the backwards left.
pub(super) fn one_f_one_b(pp: usize, n: usize) -> Vec<Vec<Action>> {
    (0..pp)
        .map(|rank| {
            let forwards: Vec<Action> = (0..n).map(|m| Action::new(rank, m, Phase::F)).collect();
            let backwards: Vec<Action> = (0..n).map(|m| Action::new(rank, m, Phase::B)).collect();
            one_f_one_b_order(&forwards, &backwards, (pp - 1 - rank).min(n))
        })
        .collect()
}

/// `warmup` forwards, then one forward and one backward at a time, then the remaining
/// backwards.
fn one_f_one_b_order(forwards: &[Action], backwards: &[Action], warmup: usize) -> Vec<Action> {
    debug_assert_eq!(forwards.len(), backwards.len());
    let total = forwards.len();
    let mut list = Vec::with_capacity(2 * total);
    list.extend_from_slice(&forwards[..warmup]);
    for k in 0..total - warmup {
        list.push(forwards[warmup + k]);
        list.push(backwards[k]);
    }
    list.extend_from_slice(&backwards[total - warmup..]);
    list
}

/// Interleaved 1F1B with `v` stages per rank (stage `c * pp + r` is chunk `c` of rank
/// `r`).
///
/// The micro-batches are cut into rounds: `max(1, n / pp)` of them, sizes differing
/// by at most one, the larger first, so every round has at least `pp` micro-batches
/// when `n >= pp` (and the one round is all of them when `n < pp`). Within a round a
/// rank runs the forwards of chunk 0 for each micro-batch of the round, then chunk 1,
/// and so on; the backwards go round by round with the chunks reversed. Rank `r`
/// warms up with `(v-1) * first_round + 2 (pp-1-r)` forwards (all of them if there
/// are fewer), then alternates one forward and one backward, then drains the
/// backwards. With `v == 1` this is 1F1B exactly (warm-up `pp-1-r`).
///
/// Rounds of at least `pp` micro-batches mean that by the time a rank has run chunk
/// `c` of a round, the first activation of the round has come back around the ring
/// for chunk `c+1`, so nothing waits in the steady state: with unit costs and
/// `n >= pp` the bubble is `(pp-1) / (v n + pp - 1)`. The larger first round keeps
/// every forward of the last stage ahead of its own backward. Rank `r` holds up to
/// `warm-up + 1` stage micro-batches (each a `1/v` share of its layers); when
/// `pp <= n < 2 pp` there is a single round and rank 0 may run every forward first.
pub(super) fn interleaved(pp: usize, v: usize, n: usize) -> Vec<Vec<Action>> {
    let rounds = round_sizes(pp, n);
    let first = rounds[0];
    (0..pp)
        .map(|rank| {
            let mut forwards = Vec::with_capacity(n * v);
            let mut backwards = Vec::with_capacity(n * v);
            let mut start = 0;
            for &size in &rounds {
                for chunk in 0..v {
                    let stage = chunk * pp + rank;
                    forwards.extend((start..start + size).map(|m| Action::new(stage, m, Phase::F)));
                    let stage = (v - 1 - chunk) * pp + rank;
                    backwards
                        .extend((start..start + size).map(|m| Action::new(stage, m, Phase::B)));
                }
                start += size;
            }
            let warmup = if v == 1 { pp - 1 - rank } else { (v - 1) * first + 2 * (pp - 1 - rank) };
            one_f_one_b_order(&forwards, &backwards, warmup.min(n * v))
        })
        .collect()
}

/// The round sizes of [`interleaved`]: `max(1, n / pp)` rounds, sizes differing by at
/// most one, the larger ones first.
fn round_sizes(pp: usize, n: usize) -> Vec<usize> {
    let count = (n / pp).max(1);
    let (base, extra) = (n / count, n % count);
    (0..count).map(|i| base + usize::from(i < extra)).collect()
}

/// ZB-H1: one stage per rank, the backward split into `I` (input gradient) and `W`
/// (weight gradient).
///
/// Rank `r` keeps 1F1B's order of forwards and `I`s (`I` in place of `B`) and defers
/// each `W` by `r` micro-batches: `W(m)` comes right after `I(m + r)`, and the last
/// `r` of them close the list. Rank 0 thus runs `I W` pairs like 1F1B's `B`s, while the
/// later ranks, whose gradients rank 0 waits for, push theirs back sooner and do the
/// weight gradients in the time a 1F1B rank would sit idle at the end. A rank keeps at
/// most `(pp - r) + r = pp` micro-batches in flight (1F1B's peak, on rank 0). With
/// every part costing 1 and `n >= pp` the bubble is `(pp-1) / (3n + pp - 1)`, a third
/// of 1F1B's idle time.
pub(super) fn zero_bubble_h1(pp: usize, n: usize) -> Vec<Vec<Action>> {
    (0..pp)
        .map(|rank| {
            let forwards: Vec<Action> = (0..n).map(|m| Action::new(rank, m, Phase::F)).collect();
            let inputs: Vec<Action> = (0..n).map(|m| Action::new(rank, m, Phase::I)).collect();
            let order = one_f_one_b_order(&forwards, &inputs, (pp - 1 - rank).min(n));
            let defer = rank;
            let mut list = Vec::with_capacity(3 * n);
            for a in order {
                list.push(a);
                if a.phase == Phase::I && a.microbatch >= defer {
                    list.push(Action::new(rank, a.microbatch - defer, Phase::W));
                }
            }
            list.extend((n.saturating_sub(defer)..n).map(|m| Action::new(rank, m, Phase::W)));
            list
        })
        .collect()
}
