//! Pipeline schedules as plain values.
//!
//! A [`Schedule`] says, for every rank of the pipeline axis, the ordered list of
//! [`Action`]s that rank runs in one training step: the forward ([`Phase::F`]) and
//! backward ([`Phase::B`], or its input-gradient part [`Phase::I`] and weight-gradient
//! part [`Phase::W`]) of one micro-batch on one stage. Nothing here touches a tensor:
//! a schedule is built, checked and simulated as data, and an executor runs the lists.
//!
//! * [`ScheduleKind`] names the generated schedules: GPipe, 1F1B, interleaved 1F1B
//!   (several virtual stages per rank) and zero-bubble ZB-H1 (split backward).
//!   [`Schedule::from_actions`] takes any other action lists and checks them; lists
//!   that cannot run (every unfinished rank waits on another) are a
//!   [`PipelineError::Deadlock`] naming each stuck rank and what it waits for.
//! * Stage `s` lives on rank `s % pp` ([`Schedule::rank_of_stage`]), so rank `r` holds
//!   stages `r, r + pp, r + 2 pp, …` ([`Schedule::stages_of_rank`]).
//! * [`Schedule::messages`] lists, in order, what one rank sends another: sends are
//!   eager (a message leaves when the action that produced it ends), receives block at
//!   the start of the action that consumes them, and the messages between two ranks are
//!   FIFO without tags, so this list is how an executor tells them apart.
//!   [`Schedule::send`] and [`Schedule::recv`] give the message an action sends or
//!   waits for, [`Schedule::producer`] and [`Schedule::consumer`] the actions at either
//!   end of a message.
//! * [`Schedule::simulate`] runs the lists against per-action [`Costs`] and gives a
//!   [`Timeline`]: its makespan, bubble fraction and a text chart
//!   ([`Timeline::render`]).
//!
//! # Dependencies
//!
//! With `S` stages: `F(s, m)` needs `F(s-1, m)` when `s > 0`; `B(s, m)` and `I(s, m)`
//! need `F(s, m)` and, when `s < S-1`, the `B` or `I` of `(s+1, m)`; `W(s, m)` needs
//! `I(s, m)`. Each rank runs its list strictly in order, and in a simulation an action
//! starts when both its rank is free and its dependencies have ended (communication
//! costs nothing).
//!
//! ```
//! use tpar_pipeline::{classic_bubble, Costs, Schedule, ScheduleKind};
//!
//! let schedule = Schedule::new(ScheduleKind::OneFOneB, 4, 8)?;
//! println!("{schedule}");
//! assert_eq!(schedule.actions(0).len(), 16);
//! assert_eq!(schedule.max_in_flight(0), 4);
//!
//! // Forward, input-gradient and weight-gradient parts cost one unit each.
//! let timeline = schedule.simulate(&Costs::unit())?;
//! println!("{}", timeline.render());
//! assert_eq!(timeline.makespan(), 33.0);
//! assert!((timeline.bubble_fraction() - classic_bubble(4, 8)).abs() < 1e-12);
//!
//! // Zero bubble defers the weight gradients into 1F1B's idle time.
//! let zb = Schedule::new(ScheduleKind::ZeroBubble, 4, 8)?;
//! assert!(zb.bubble() < schedule.bubble());
//! # Ok::<(), tpar_pipeline::PipelineError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use crate::error::{PipelineError, Result};

mod generate;
mod timeline;

pub use timeline::{Span, Timeline};

/// The generated schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al., "GPipe"). Every rank keeps the
    /// activations of all micro-batches.
    GPipe,
    /// One forward, one backward (PipeDream-Flush): after a warm-up, each rank
    /// alternates forwards and backwards, so rank `r` keeps at most `pp - r`
    /// micro-batches' activations.
    OneFOneB,
    /// Interleaved 1F1B (Narayanan et al., Megatron-LM): each rank holds several
    /// virtual stages (stage `s` on rank `s % pp`), which shrinks the bubble by that
    /// factor once there are at least `pp` micro-batches. Any micro-batch count works.
    Interleaved1F1B,
    /// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward split into
    /// an input-gradient part, on the critical path, and a weight-gradient part that
    /// fills the idle time. Every rank keeps at most `pp` micro-batches in flight (what
    /// 1F1B keeps on rank 0), so rank 0's memory is 1F1B's; later ranks, which 1F1B
    /// lets hold fewer, hold up to `pp` too (a deferred weight gradient keeps its
    /// micro-batch's graph), so the last stage (logits) can peak higher than 1F1B's
    /// rank 0 (docs/PERF.md measures it).
    ZeroBubble,
}

impl ScheduleKind {
    /// Every kind, in the order of the enum.
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZeroBubble,
    ];

    /// The short name: `gpipe`, `1f1b`, `interleaved` or `zb`.
    pub fn name(&self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved",
            ScheduleKind::ZeroBubble => "zb",
        }
    }

    /// Whether the backward is split into [`Phase::I`] and [`Phase::W`] (zero bubble
    /// only).
    pub fn splits_backward(&self) -> bool {
        matches!(self, ScheduleKind::ZeroBubble)
    }

    /// The stages per rank [`Schedule::new`] uses: 2 for interleaved 1F1B, 1 for the
    /// others.
    pub fn default_stages_per_rank(&self) -> usize {
        match self {
            ScheduleKind::Interleaved1F1B => 2,
            _ => 1,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = PipelineError;

    /// Parses `gpipe`, `1f1b`, `interleaved` and `zb` in any case, and the aliases
    /// `interleaved1f1b`, `interleaved-1f1b`, `zbh1`, `zb-h1` and `zero-bubble`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" | "interleaved1f1b" | "interleaved-1f1b" => {
                Ok(ScheduleKind::Interleaved1F1B)
            }
            "zb" | "zbh1" | "zb-h1" | "zero-bubble" => Ok(ScheduleKind::ZeroBubble),
            _ => Err(PipelineError::Schedule {
                schedule: s.to_string(),
                what: "unknown schedule; expected one of gpipe, 1f1b, interleaved \
                       (interleaved1f1b), zb (zbh1, zero-bubble)"
                    .to_string(),
            }),
        }
    }
}

/// What an action computes for one micro-batch on one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Forward.
    F,
    /// Full backward: the input gradient and the weight gradient.
    B,
    /// The input-gradient part of the backward only (what the previous stage waits
    /// for).
    I,
    /// The weight-gradient part of the backward only.
    W,
}

impl Phase {
    /// The letter of the phase: `F`, `B`, `I` or `W`.
    pub fn letter(&self) -> char {
        match self {
            Phase::F => 'F',
            Phase::B => 'B',
            Phase::I => 'I',
            Phase::W => 'W',
        }
    }

    /// Whether the action sends a gradient to the previous stage ([`Phase::B`] or
    /// [`Phase::I`]).
    pub fn produces_input_grad(&self) -> bool {
        matches!(self, Phase::B | Phase::I)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.letter())
    }
}

/// One step of a rank's list: a phase of one micro-batch on one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    /// The stage (global index, `0..num_stages`).
    pub stage: usize,
    /// The micro-batch (`0..n_microbatches`).
    pub microbatch: usize,
    /// What is computed.
    pub phase: Phase,
}

impl Action {
    /// An action.
    pub const fn new(stage: usize, microbatch: usize, phase: Phase) -> Action {
        Action { stage, microbatch, phase }
    }
}

impl fmt::Display for Action {
    /// `{stage}{phase}{microbatch}`, e.g. `2F5` or `0W3`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.phase, self.microbatch)
    }
}

/// What a message between two ranks carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// A forward's output, the next stage's input.
    Activation,
    /// The gradient of a stage's input, the previous stage's output gradient.
    Gradient,
}

/// One message between two ranks: what it is, and the stage and micro-batch that
/// consume it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Message {
    /// Activation or gradient.
    pub kind: MessageKind,
    /// The stage that receives the message (the stage after the producer for an
    /// activation, the stage before it for a gradient).
    pub stage: usize,
    /// The micro-batch.
    pub microbatch: usize,
}

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            MessageKind::Activation => "activation",
            MessageKind::Gradient => "gradient",
        };
        write!(f, "{kind} for stage {} micro-batch {}", self.stage, self.microbatch)
    }
}

/// The cost of each phase, for [`Schedule::simulate`]: per stage action, in any unit.
/// A [`Phase::B`] costs `backward_input + backward_weight`.
///
/// For interleaved schedules a stage is a `1/stages_per_rank` share of what a rank
/// holds; bubble fractions do not depend on the scale of the costs, makespans do.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// A forward ([`Phase::F`]).
    pub forward: f64,
    /// The input-gradient part of a backward ([`Phase::I`]).
    pub backward_input: f64,
    /// The weight-gradient part of a backward ([`Phase::W`]).
    pub backward_weight: f64,
}

impl Costs {
    /// Every part costs 1: a forward 1, a full backward 2.
    pub const fn unit() -> Costs {
        Costs { forward: 1.0, backward_input: 1.0, backward_weight: 1.0 }
    }

    /// Costs from the three parts.
    pub const fn new(forward: f64, backward_input: f64, backward_weight: f64) -> Costs {
        Costs { forward, backward_input, backward_weight }
    }

    /// The cost of one action of this phase.
    pub fn of(&self, phase: Phase) -> f64 {
        match phase {
            Phase::F => self.forward,
            Phase::B => self.backward_input + self.backward_weight,
            Phase::I => self.backward_input,
            Phase::W => self.backward_weight,
        }
    }
}

impl Default for Costs {
    /// [`Costs::unit`].
    fn default() -> Self {
        Costs::unit()
    }
}

/// The bubble fraction of GPipe and 1F1B with the same costs on every stage, whatever
/// the ratio of forward to backward: `(pp - 1) / (n_microbatches + pp - 1)` (0 when
/// `pp` is 0).
pub fn classic_bubble(pp: usize, n_microbatches: usize) -> f64 {
    let idle = pp.saturating_sub(1) as f64;
    let total = (n_microbatches + pp.saturating_sub(1)) as f64;
    if total == 0.0 {
        0.0
    } else {
        idle / total
    }
}

/// Per rank, the ordered actions of one training step, checked: every action on its
/// stage's rank, each `(stage, micro-batch)` with one forward and one backward (a `B`,
/// or an `I` and a `W`), and lists that run without deadlock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    kind: Option<ScheduleKind>,
    name: String,
    pp: usize,
    stages_per_rank: usize,
    n_microbatches: usize,
    actions: Vec<Vec<Action>>,
    /// By `stage * n_microbatches + microbatch`: whether that backward is split into
    /// `I` and `W` (filled in by `checked`).
    split: Vec<bool>,
}

impl Schedule {
    /// A generated schedule with the kind's default stages per rank (2 for interleaved
    /// 1F1B, 1 for the others).
    pub fn new(kind: ScheduleKind, pp: usize, n_microbatches: usize) -> Result<Schedule> {
        Schedule::build(kind, pp, kind.default_stages_per_rank(), n_microbatches)
    }

    /// A generated schedule over `pp` ranks with `stages_per_rank` stages each.
    ///
    /// GPipe, 1F1B and zero bubble take one stage per rank; interleaved 1F1B any
    /// number (with 1 it is 1F1B). Every size is supported, including `pp == 1` and
    /// `n_microbatches == 1` and micro-batch counts that are not multiples of `pp`.
    pub fn build(
        kind: ScheduleKind,
        pp: usize,
        stages_per_rank: usize,
        n_microbatches: usize,
    ) -> Result<Schedule> {
        let name = kind.name();
        check_sizes(name, pp, stages_per_rank, n_microbatches)?;
        if kind != ScheduleKind::Interleaved1F1B && stages_per_rank != 1 {
            return Err(PipelineError::Schedule {
                schedule: name.to_string(),
                what: format!(
                    "runs one stage per rank, got stages_per_rank {stages_per_rank} \
                     (interleaved takes several)"
                ),
            });
        }
        let actions = match kind {
            ScheduleKind::GPipe => generate::gpipe(pp, n_microbatches),
            ScheduleKind::OneFOneB => generate::one_f_one_b(pp, n_microbatches),
            ScheduleKind::Interleaved1F1B => {
                generate::interleaved(pp, stages_per_rank, n_microbatches)
            }
            ScheduleKind::ZeroBubble => generate::zero_bubble_h1(pp, n_microbatches),
        };
        let schedule = Schedule {
            kind: Some(kind),
            name: name.to_string(),
            pp,
            stages_per_rank,
            n_microbatches,
            actions,
            split: Vec::new(),
        };
        // A generated schedule failing its check is a bug here; report it rather than
        // let an executor hang on it.
        schedule.checked()
    }

    /// A schedule from given action lists, one per rank, checked like the generated
    /// ones. Its [`kind`](Schedule::kind) is `None` and its name `kind_name`.
    pub fn from_actions(
        kind_name: &str,
        pp: usize,
        stages_per_rank: usize,
        n_microbatches: usize,
        actions: Vec<Vec<Action>>,
    ) -> Result<Schedule> {
        check_sizes(kind_name, pp, stages_per_rank, n_microbatches)?;
        Schedule {
            kind: None,
            name: kind_name.to_string(),
            pp,
            stages_per_rank,
            n_microbatches,
            actions,
            split: Vec::new(),
        }
        .checked()
    }

    /// The generated kind, `None` for a schedule from [`Schedule::from_actions`].
    pub fn kind(&self) -> Option<ScheduleKind> {
        self.kind
    }

    /// The kind's name, or the name given to [`Schedule::from_actions`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of pipeline ranks.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// The stages each rank holds.
    pub fn stages_per_rank(&self) -> usize {
        self.stages_per_rank
    }

    /// The number of stages, `pp * stages_per_rank`.
    pub fn num_stages(&self) -> usize {
        self.pp * self.stages_per_rank
    }

    /// The number of micro-batches in a step.
    pub fn n_microbatches(&self) -> usize {
        self.n_microbatches
    }

    /// Whether any backward is split into [`Phase::I`] and [`Phase::W`].
    pub fn splits_backward(&self) -> bool {
        self.split.iter().any(|&s| s)
    }

    /// The phase that computes the input gradient of `(stage, microbatch)`:
    /// [`Phase::I`] where that backward is split, [`Phase::B`] otherwise.
    ///
    /// # Panics
    /// If the stage or micro-batch is out of range.
    pub fn backward_phase(&self, stage: usize, microbatch: usize) -> Phase {
        assert!(stage < self.num_stages() && microbatch < self.n_microbatches);
        if self.split[stage * self.n_microbatches + microbatch] {
            Phase::I
        } else {
            Phase::B
        }
    }

    /// The rank holding `stage`: `stage % pp`.
    pub fn rank_of_stage(&self, stage: usize) -> usize {
        stage % self.pp
    }

    /// The stages on `rank`, in order: `rank, rank + pp, rank + 2 pp, …`.
    pub fn stages_of_rank(&self, rank: usize) -> Vec<usize> {
        (0..self.stages_per_rank).map(|v| v * self.pp + rank).collect()
    }

    /// The ordered actions of `rank`.
    ///
    /// # Panics
    /// If `rank >= pp`.
    pub fn actions(&self, rank: usize) -> &[Action] {
        &self.actions[rank]
    }

    /// The message `action` sends when it ends, with the rank it goes to: an activation
    /// after a forward of a stage that is not the last, a gradient after a `B` or `I`
    /// of a stage that is not the first; `None` for the others and when the receiving
    /// stage is on the same rank.
    pub fn send(&self, action: Action) -> Option<(usize, Message)> {
        let Action { stage, microbatch, phase } = action;
        let (kind, to_stage) = match phase {
            Phase::F if stage + 1 < self.num_stages() => (MessageKind::Activation, stage + 1),
            Phase::B | Phase::I if stage > 0 => (MessageKind::Gradient, stage - 1),
            _ => return None,
        };
        let to = self.rank_of_stage(to_stage);
        (to != self.rank_of_stage(stage))
            .then_some((to, Message { kind, stage: to_stage, microbatch }))
    }

    /// The message `action` waits for at its start, with the rank it comes from: the
    /// activation of a forward of a stage that is not the first, the gradient of a `B`
    /// or `I` of a stage that is not the last; `None` for the others and when the
    /// producing stage is on the same rank.
    pub fn recv(&self, action: Action) -> Option<(usize, Message)> {
        let Action { stage, microbatch, phase } = action;
        let (kind, from_stage) = match phase {
            Phase::F if stage > 0 => (MessageKind::Activation, stage - 1),
            Phase::B | Phase::I if stage + 1 < self.num_stages() => {
                (MessageKind::Gradient, stage + 1)
            }
            _ => return None,
        };
        let from = self.rank_of_stage(from_stage);
        (from != self.rank_of_stage(stage)).then_some((from, Message { kind, stage, microbatch }))
    }

    /// The action that sends `message`: `F` of the stage before for an activation, the
    /// `B` or `I` of the stage after for a gradient.
    ///
    /// # Panics
    /// If no action sends it (a first stage's activation, a last stage's gradient, or
    /// out of range).
    pub fn producer(&self, message: Message) -> Action {
        let Message { kind, stage, microbatch } = message;
        match kind {
            MessageKind::Activation => Action::new(stage - 1, microbatch, Phase::F),
            MessageKind::Gradient => {
                Action::new(stage + 1, microbatch, self.backward_phase(stage + 1, microbatch))
            }
        }
    }

    /// The action that waits for `message`: `F` of its stage for an activation, its
    /// `B` or `I` for a gradient.
    ///
    /// # Panics
    /// If the stage or micro-batch is out of range.
    pub fn consumer(&self, message: Message) -> Action {
        let Message { kind, stage, microbatch } = message;
        match kind {
            MessageKind::Activation => Action::new(stage, microbatch, Phase::F),
            MessageKind::Gradient => {
                Action::new(stage, microbatch, self.backward_phase(stage, microbatch))
            }
        }
    }

    /// The messages `from` sends `to`, in the order `from` sends them (the order of its
    /// list); empty when `from == to`.
    pub fn messages(&self, from: usize, to: usize) -> Vec<Message> {
        if from == to {
            return Vec::new();
        }
        self.actions[from]
            .iter()
            .filter_map(|&a| self.send(a))
            .filter(|&(dest, _)| dest == to)
            .map(|(_, m)| m)
            .collect()
    }

    /// The peak, over `rank`'s list, of the micro-batches whose activations it keeps,
    /// summed over its stages: a `(stage, micro-batch)` counts from its forward until
    /// its `B` (or, with a split backward, its `W`).
    pub fn max_in_flight(&self, rank: usize) -> usize {
        let (mut now, mut peak) = (0usize, 0usize);
        for a in &self.actions[rank] {
            match a.phase {
                Phase::F => {
                    now += 1;
                    peak = peak.max(now);
                }
                Phase::B | Phase::W => now = now.saturating_sub(1),
                Phase::I => {}
            }
        }
        peak
    }

    /// Runs the lists against `costs`: every rank in list order, each action starting
    /// when its rank is free and its dependencies have ended.
    ///
    /// # Errors
    /// [`PipelineError::Schedule`] for a negative or non-finite cost. (A deadlock,
    /// [`PipelineError::Deadlock`] naming each unfinished rank and the action it waits
    /// at, does not depend on the costs and is refused when the schedule is made.)
    pub fn simulate(&self, costs: &Costs) -> Result<Timeline> {
        for (what, value) in [
            ("forward", costs.forward),
            ("backward_input", costs.backward_input),
            ("backward_weight", costs.backward_weight),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PipelineError::Schedule {
                    schedule: self.name.clone(),
                    what: format!("costs must be finite and non-negative, got {what} {value}"),
                });
            }
        }
        Simulation::new(self).run(costs)
    }

    /// The bubble fraction of [`simulate`](Schedule::simulate) with [`Costs::unit`]
    /// (forward 1, backward 2, or its parts 1 each).
    pub fn bubble(&self) -> f64 {
        self.simulate(&Costs::unit())
            .expect("a constructed schedule was checked to run without deadlock")
            .bubble_fraction()
    }

    /// Checks the lists: shape, every action on its stage's rank, one forward and one
    /// backward per `(stage, micro-batch)`, and no deadlock.
    fn checked(mut self) -> Result<Self> {
        let err = |what: String| PipelineError::Schedule { schedule: self.name.clone(), what };
        if self.actions.len() != self.pp {
            return Err(err(format!(
                "{} action lists for {} ranks; expected one per rank",
                self.actions.len(),
                self.pp
            )));
        }
        let (n_stages, n) = (self.num_stages(), self.n_microbatches);
        // Per (stage, micro-batch): how many F, B, I, W.
        let mut counts = vec![[0u32; 4]; n_stages * n];
        for (rank, list) in self.actions.iter().enumerate() {
            for &a in list {
                if a.stage >= n_stages {
                    return Err(err(format!(
                        "rank {rank}: {a} names stage {}, but there are {n_stages} stages",
                        a.stage
                    )));
                }
                if a.microbatch >= n {
                    return Err(err(format!(
                        "rank {rank}: {a} names micro-batch {}, but there are {n}",
                        a.microbatch
                    )));
                }
                let owner = self.rank_of_stage(a.stage);
                if owner != rank {
                    return Err(err(format!(
                        "{a} is on rank {rank}, but stage {} belongs to rank {owner}",
                        a.stage
                    )));
                }
                let c = &mut counts[a.stage * n + a.microbatch][a.phase as usize];
                *c += 1;
                if *c > 1 {
                    return Err(err(format!("{a} appears more than once")));
                }
            }
        }
        for stage in 0..n_stages {
            for mb in 0..n {
                let [f, b, i, w] = counts[stage * n + mb];
                let label = |p: Phase| Action::new(stage, mb, p);
                if f == 0 {
                    return Err(err(format!("{} is missing", label(Phase::F))));
                }
                if b == 1 && (i == 1 || w == 1) {
                    return Err(err(format!(
                        "stage {stage} micro-batch {mb} mixes a full backward {} with a split one",
                        label(Phase::B)
                    )));
                }
                if b == 0 {
                    match (i, w) {
                        (0, 0) => {
                            return Err(err(format!(
                                "{} (or {} and {}) is missing",
                                label(Phase::B),
                                label(Phase::I),
                                label(Phase::W)
                            )))
                        }
                        (0, _) => return Err(err(format!("{} is missing", label(Phase::I)))),
                        (_, 0) => return Err(err(format!("{} is missing", label(Phase::W)))),
                        _ => {}
                    }
                }
            }
        }
        self.split = counts.iter().map(|c| c[Phase::I as usize] == 1).collect();
        self.simulate(&Costs::unit())?;
        Ok(self)
    }
}

/// The size checks shared by [`Schedule::build`] and [`Schedule::from_actions`].
fn check_sizes(name: &str, pp: usize, stages_per_rank: usize, n_microbatches: usize) -> Result<()> {
    for (what, value) in
        [("pp", pp), ("stages_per_rank", stages_per_rank), ("n_microbatches", n_microbatches)]
    {
        if value == 0 {
            return Err(PipelineError::Schedule {
                schedule: name.to_string(),
                what: format!("{what} must be at least 1, got {value}"),
            });
        }
    }
    Ok(())
}

impl fmt::Display for Schedule {
    /// One line per rank: `rank 0: 0F0 0F1 0B0 …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (rank, list) in self.actions.iter().enumerate() {
            write!(f, "rank {rank}:")?;
            for a in list {
                write!(f, " {a}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// The state of one simulation: per `(stage, micro-batch)` when each phase ended.
struct Simulation<'a> {
    schedule: &'a Schedule,
    /// End of `F`, by `stage * n + microbatch`.
    forward_end: Vec<Option<f64>>,
    /// End of `B` or `I`: when the input gradient is known.
    grad_end: Vec<Option<f64>>,
    /// End of `I` alone (what `W` waits for).
    input_end: Vec<Option<f64>>,
}

impl<'a> Simulation<'a> {
    fn new(schedule: &'a Schedule) -> Self {
        let len = schedule.num_stages() * schedule.n_microbatches;
        Simulation {
            schedule,
            forward_end: vec![None; len],
            grad_end: vec![None; len],
            input_end: vec![None; len],
        }
    }

    fn index(&self, stage: usize, microbatch: usize) -> usize {
        stage * self.schedule.n_microbatches + microbatch
    }

    /// The actions `a` depends on, with the slot holding each one's end time.
    fn dependencies(&self, a: Action) -> impl Iterator<Item = (Action, Option<f64>)> + '_ {
        let last = self.schedule.num_stages() - 1;
        let (s, m) = (a.stage, a.microbatch);
        let mut deps = [None, None];
        match a.phase {
            Phase::F if s > 0 => {
                deps[0] =
                    Some((Action::new(s - 1, m, Phase::F), self.forward_end[self.index(s - 1, m)]));
            }
            Phase::F => {}
            Phase::B | Phase::I => {
                deps[0] = Some((Action::new(s, m, Phase::F), self.forward_end[self.index(s, m)]));
                if s < last {
                    let phase = self.schedule.backward_phase(s + 1, m);
                    deps[1] =
                        Some((Action::new(s + 1, m, phase), self.grad_end[self.index(s + 1, m)]));
                }
            }
            Phase::W => {
                deps[0] = Some((Action::new(s, m, Phase::I), self.input_end[self.index(s, m)]));
            }
        }
        deps.into_iter().flatten()
    }

    fn run(mut self, costs: &Costs) -> Result<Timeline> {
        let schedule = self.schedule;
        let pp = schedule.pp;
        let mut next = vec![0usize; pp];
        let mut free = vec![0.0f64; pp];
        let mut ranks: Vec<Vec<Span>> =
            schedule.actions.iter().map(|l| Vec::with_capacity(l.len())).collect();
        loop {
            let mut progressed = false;
            for rank in 0..pp {
                while let Some(&a) = schedule.actions[rank].get(next[rank]) {
                    let mut ready = 0.0f64;
                    let mut blocked = false;
                    for (_, end) in self.dependencies(a) {
                        match end {
                            Some(t) => ready = ready.max(t),
                            None => blocked = true,
                        }
                    }
                    if blocked {
                        break;
                    }
                    let start = free[rank].max(ready);
                    let end = start + costs.of(a.phase);
                    let i = self.index(a.stage, a.microbatch);
                    match a.phase {
                        Phase::F => self.forward_end[i] = Some(end),
                        Phase::B => self.grad_end[i] = Some(end),
                        Phase::I => {
                            self.grad_end[i] = Some(end);
                            self.input_end[i] = Some(end);
                        }
                        Phase::W => {}
                    }
                    ranks[rank].push(Span { action: a, start, end });
                    free[rank] = end;
                    next[rank] += 1;
                    progressed = true;
                }
            }
            if (0..pp).all(|r| next[r] == schedule.actions[r].len()) {
                return Ok(Timeline { ranks });
            }
            if !progressed {
                return Err(self.deadlock(&next));
            }
        }
    }

    /// The error for a stuck simulation: each unfinished rank, the action it waits at
    /// and what that action waits for.
    fn deadlock(&self, next: &[usize]) -> PipelineError {
        let schedule = self.schedule;
        let mut parts = Vec::new();
        for (rank, list) in schedule.actions.iter().enumerate() {
            let Some(&a) = list.get(next[rank]) else { continue };
            let waits: Vec<String> = self
                .dependencies(a)
                .filter(|(_, end)| end.is_none())
                .map(|(dep, _)| {
                    let owner = schedule.rank_of_stage(dep.stage);
                    if owner == rank {
                        format!("{dep}, which comes later in its own list")
                    } else {
                        let what = if dep.phase == Phase::F { "activation" } else { "gradient" };
                        format!("the {what} from {dep} on rank {owner}")
                    }
                })
                .collect();
            parts.push(format!("rank {rank} waits at {a} for {}", waits.join(" and ")));
        }
        PipelineError::Deadlock { schedule: schedule.name.clone(), what: parts.join("; ") }
    }
}
