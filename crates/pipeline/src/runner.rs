//! `PipelineSchedule`: runs a [`Schedule`]'s actions for this rank's stages, with real
//! tensors, activations and gradients moving over the `pp` group.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tpar_collectives::ProcessGroup;
use tpar_nn::{call, Args, Param, Value};
use tpar_tensor::autograd::{backward_input, WeightGrad};
use tpar_tensor::checkpoint::{set_weight_pass, WeightPass};
use tpar_tensor::state::{StateDict, StateDictError};
use tpar_tensor::{DType, Device, Tensor};

use crate::{
    Action, MessageKind, Phase, PipelineError, PipelineStage, Result, Schedule, ScheduleKind, Span,
    Timeline,
};

/// The loss of one micro-batch: the last stage's output (logits, plain or distributed)
/// and the micro-batch's targets in, a one-element loss out (e.g.
/// `|logits, t| logits.reshape(&[-1, vocab])?.cross_entropy(&t.reshape([t.numel()])?, pad)`).
pub type LossFn = dyn Fn(&Value, &Tensor) -> tpar_nn::Result<Value> + Send + Sync;

/// A schedule bound to this rank's stages and a loss, ready to run training steps:
/// `ScheduleGPipe(stage, n_microbatches, loss_fn)`, `Schedule1F1B`, `ScheduleInterleaved1F1B`
/// and a zero-bubble schedule in one type.
///
/// Each [`step`](Self::step) cuts the batch into `n_microbatches` equal micro-batches along
/// dim 0, runs this rank's actions in the schedule's order, and leaves every parameter's
/// gradient accumulated over the micro-batches. Each micro-batch's loss is scaled by
/// `1 / n_microbatches` before its backward, so after a step the gradients are those of
/// the mean of the micro-batch losses, which is the whole-batch loss for a mean loss over
/// equal micro-batches: one optimizer step then equals the step on the whole batch.
///
/// Activations and gradients travel with `send` / `recv` on the `pp` group: the shape of
/// each stage boundary's activations is sent once, on the first step, and later steps
/// send data only. Every step must then have the same micro-batch shape (a different one
/// is an error on the rank that notices it, which fails its peers).
pub struct PipelineSchedule {
    schedule: Schedule,
    stages: Vec<PipelineStage>,
    loss_fn: Arc<LossFn>,
    group: ProcessGroup,
    /// Activation shapes this rank sent, by receiving stage.
    sent_shapes: HashMap<usize, (Vec<usize>, DType)>,
    /// Activation shapes agreed with the sender, by receiving stage.
    recv_shapes: HashMap<usize, (Vec<usize>, DType)>,
    timeline: Vec<Span>,
    /// What checkpointed regions hold between a split backward's two passes.
    weight_pass: WeightPass,
}

impl std::fmt::Debug for PipelineSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineSchedule")
            .field("schedule", &self.schedule.name())
            .field("stages", &self.stages)
            .finish()
    }
}

/// What one (stage, micro-batch) keeps between its forward and its backward.
struct Saved {
    /// The stage's input as a leaf that requires grad (not on stage 0).
    input: Option<Tensor>,
    /// The tensor the backward starts from: the output, or the loss on the last stage.
    root: Tensor,
    /// The gradient of `root`, when known at forward time (the last stage's loss seed).
    seed: Option<Tensor>,
    /// The deferred weight-gradient work of a split backward.
    weight: Option<WeightGrad>,
}

/// The inputs of one step, each cut into micro-batches along dim 0.
struct Batch {
    input: Vec<Tensor>,
    extras: Vec<Vec<Value>>,
    target: Vec<Tensor>,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

const DTYPES: [DType; 5] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64];

impl PipelineSchedule {
    /// A `kind` schedule over this rank's `stages` (one stage, or for
    /// [`ScheduleKind::Interleaved1F1B`] the rank's round-robin stages `r, r + pp, ...`),
    /// with `n_microbatches` micro-batches per step and `loss_fn` on the last stage.
    pub fn new(
        kind: ScheduleKind,
        stages: Vec<PipelineStage>,
        n_microbatches: usize,
        loss_fn: impl Fn(&Value, &Tensor) -> tpar_nn::Result<Value> + Send + Sync + 'static,
    ) -> Result<PipelineSchedule> {
        let Some(first) = stages.first() else {
            return Err(PipelineError::Schedule {
                schedule: kind.name().into(),
                what: "this rank has no stage".into(),
            });
        };
        let pp = first.group().size();
        let per_rank = first.num_stages() / pp;
        let schedule = Schedule::build(kind, pp, per_rank, n_microbatches)?;
        Self::with_schedule(schedule, stages, loss_fn)
    }

    /// Runs a given (for example custom, [`Schedule::from_actions`]) schedule.
    pub fn with_schedule(
        schedule: Schedule,
        mut stages: Vec<PipelineStage>,
        loss_fn: impl Fn(&Value, &Tensor) -> tpar_nn::Result<Value> + Send + Sync + 'static,
    ) -> Result<PipelineSchedule> {
        let bad = |what: String| PipelineError::Schedule { schedule: schedule.name().into(), what };
        stages.sort_by_key(|s| s.stage_index());
        let Some(first) = stages.first() else {
            return Err(bad("this rank has no stage".into()));
        };
        let group = first.group().clone();
        if group.size() != schedule.pp() || first.num_stages() != schedule.num_stages() {
            return Err(bad(format!(
                "the schedule is for {} pp ranks and {} stages; the stages are {} on {} pp ranks",
                schedule.pp(),
                schedule.num_stages(),
                first.num_stages(),
                group.size()
            )));
        }
        let want = schedule.stages_of_rank(group.rank());
        let have: Vec<usize> = stages.iter().map(|s| s.stage_index()).collect();
        if want != have {
            return Err(bad(format!(
                "pp rank {} runs stages {want:?} in this schedule, but was given stages {have:?}",
                group.rank()
            )));
        }
        Ok(PipelineSchedule {
            schedule,
            stages,
            loss_fn: Arc::new(loss_fn),
            group,
            sent_shapes: HashMap::new(),
            recv_shapes: HashMap::new(),
            timeline: Vec::new(),
            weight_pass: WeightPass::Keep,
        })
    }

    /// What an activation-checkpointed region of these stages holds between its split
    /// backward's input pass and weight pass (zero-bubble's I and W; the other schedules
    /// do not split): [`WeightPass::Keep`] (the default) keeps the recomputed graph's
    /// weight half, one recompute per micro-batch; [`WeightPass::Recompute`] drops it and
    /// recomputes the region again in the weight pass, so a stage whose weight passes wait
    /// holds much less of its checkpointed layers, for more time (docs/PERF.md). The
    /// gradients are the same bits either way.
    pub fn set_ac_weight_pass(&mut self, mode: WeightPass) {
        self.weight_pass = mode;
    }

    /// What [`PipelineSchedule::set_ac_weight_pass`] set.
    pub fn ac_weight_pass(&self) -> WeightPass {
        self.weight_pass
    }

    /// The schedule (a value: print it, simulate it).
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// This rank's stages, by stage index.
    pub fn stages(&self) -> &[PipelineStage] {
        &self.stages
    }

    /// This rank's stages, mutably.
    pub fn stages_mut(&mut self) -> &mut [PipelineStage] {
        &mut self.stages
    }

    /// The parameters of this rank's stages.
    pub fn parameters(&self) -> Vec<Param> {
        self.stages.iter().flat_map(|s| s.parameters()).collect()
    }

    /// One training step (forward and backward of every micro-batch; no optimizer step):
    /// `input` on the rank of stage 0 (ignored elsewhere), `target` on the rank of the
    /// last stage. Returns the last stage's per-micro-batch losses (unscaled), empty on
    /// other ranks.
    pub fn step(&mut self, input: Option<&Tensor>, target: Option<&Tensor>) -> Result<Vec<f64>> {
        self.step_with(input, &[], target)
    }

    /// [`step`](Self::step) with `extras`: tensors every stage's forward gets after its
    /// main input (an attention mask, for example), cut into micro-batches like the
    /// input. Every rank passes the same extras.
    pub fn step_with(
        &mut self,
        input: Option<&Tensor>,
        extras: &[Tensor],
        target: Option<&Tensor>,
    ) -> Result<Vec<f64>> {
        let batch = self.split(input, extras, target)?;
        let mut run = Run::new(self);
        let t0 = Instant::now();
        let base = t0.duration_since(epoch()).as_secs_f64();
        let actions = self.schedule.actions(self.group.rank()).to_vec();
        let mut spans = Vec::with_capacity(actions.len());
        for a in actions {
            let before = Instant::now();
            run.action(self, &batch, a).map_err(|e| match e {
                PipelineError::Stage { .. } | PipelineError::Collective(_) => e,
                other => PipelineError::Stage { stage: a.stage, what: format!("{a}: {other}") },
            })?;
            // An action's span starts once its inputs are in (waiting is bubble).
            let start = run.ready.take().unwrap_or(before);
            let at = |t: Instant| base + t.duration_since(t0).as_secs_f64();
            spans.push(Span { action: a, start: at(start), end: at(Instant::now()) });
        }
        self.timeline = spans;
        let mut losses = run.losses;
        losses.sort_by_key(|(m, _)| *m);
        Ok(losses.into_iter().map(|(_, l)| l).collect())
    }

    /// This rank's measured timeline of the last step (seconds).
    pub fn timeline(&self) -> Timeline {
        let mut ranks = vec![Vec::new(); self.schedule.pp()];
        ranks[self.group.rank()] = self.timeline.clone();
        Timeline { ranks }
    }

    /// The measured timeline of the last step on every pp rank (a collective on the `pp`
    /// group: every pp rank calls it). Times are seconds on each rank's clock since its
    /// process started using pipelines; ranks that are threads of one process share it.
    pub fn gather_timeline(&self) -> Result<Timeline> {
        let pp = self.schedule.pp();
        let width = (0..pp).map(|r| self.schedule.actions(r).len()).max().unwrap_or(0);
        let mut rows = vec![-1.0f64; width * 5];
        for (i, s) in self.timeline.iter().enumerate() {
            let phase = match s.action.phase {
                Phase::F => 0.0,
                Phase::B => 1.0,
                Phase::I => 2.0,
                Phase::W => 3.0,
            };
            rows[i * 5..i * 5 + 5].copy_from_slice(&[
                s.action.stage as f64,
                s.action.microbatch as f64,
                phase,
                s.start,
                s.end,
            ]);
        }
        let all = self.group.all_gather(&Tensor::from_vec(rows, [1, width * 5])?, 0)?;
        let all = all.to_vec::<f64>()?;
        let ranks = (0..pp)
            .map(|r| {
                all[r * width * 5..(r + 1) * width * 5]
                    .chunks(5)
                    .filter(|c| c[0] >= 0.0)
                    .map(|c| Span {
                        action: Action {
                            stage: c[0] as usize,
                            microbatch: c[1] as usize,
                            phase: [Phase::F, Phase::B, Phase::I, Phase::W][c[2] as usize],
                        },
                        start: c[3],
                        end: c[4],
                    })
                    .collect()
            })
            .collect();
        Ok(Timeline { ranks })
    }

    fn split(
        &self,
        input: Option<&Tensor>,
        extras: &[Tensor],
        target: Option<&Tensor>,
    ) -> Result<Batch> {
        let m = self.schedule.n_microbatches();
        let cut = |t: &Tensor, what: &str| -> Result<Vec<Tensor>> {
            let rows = t.dims().first().copied().unwrap_or(0);
            if t.rank() == 0 || rows == 0 || rows % m != 0 {
                return Err(PipelineError::Microbatch {
                    what: format!(
                        "the {what} of shape {:?} does not split into {m} equal micro-batches along dim 0 (its size must be a positive multiple of {m})",
                        t.dims()
                    ),
                });
            }
            let n = rows / m;
            Ok((0..m).map(|i| t.narrow(0, i * n, n)).collect::<tpar_tensor::Result<_>>()?)
        };
        let has_first = self.stages.iter().any(|s| s.is_first());
        let has_last = self.stages.iter().any(|s| s.is_last());
        let input = match (input, has_first) {
            (Some(t), true) => cut(t, "input")?,
            (None, true) => {
                return Err(PipelineError::Microbatch {
                    what: "the rank of stage 0 must pass the input to step()".into(),
                })
            }
            _ => Vec::new(),
        };
        let target = match (target, has_last) {
            (Some(t), true) => cut(t, "target")?,
            (None, true) => {
                return Err(PipelineError::Microbatch {
                    what: "the rank of the last stage must pass the target to step()".into(),
                })
            }
            _ => Vec::new(),
        };
        let mut per_mb = vec![Vec::new(); m];
        for e in extras {
            for (i, piece) in cut(e, "extra input")?.into_iter().enumerate() {
                per_mb[i].push(Value::Tensor(piece));
            }
        }
        Ok(Batch { input, extras: per_mb, target })
    }

    fn stage(&self, index: usize) -> &PipelineStage {
        let first = self.stages[0].stage_index();
        &self.stages[(index - first) / self.schedule.pp()]
    }

    /// Sends `t`, stage `to_stage`'s input activation, announcing its shape the first time.
    fn send_activation(&mut self, t: &Tensor, to_stage: usize, dst: usize) -> Result<()> {
        let shape = (t.dims().to_vec(), t.dtype());
        match self.sent_shapes.get(&to_stage) {
            None => {
                let code = DTYPES.iter().position(|d| *d == t.dtype()).unwrap_or(0) as i64;
                let mut meta = vec![code, t.rank() as i64];
                meta.extend(t.dims().iter().map(|&d| d as i64));
                let n = meta.len();
                self.group.send(&Tensor::from_vec(meta, [n])?, dst)?;
                self.sent_shapes.insert(to_stage, shape);
            }
            Some(agreed) if *agreed != shape => {
                return Err(PipelineError::Stage {
                    stage: to_stage - 1,
                    what: format!(
                        "its output is {} {:?}, but the shape agreed at the first step is {} {:?}; a pipeline's micro-batch shapes are fixed (build a new schedule for another shape)",
                        shape.1, shape.0, agreed.1, agreed.0
                    ),
                });
            }
            Some(_) => {}
        }
        self.group.send_shaped(t, dst)?;
        Ok(())
    }

    fn recv_activation(&mut self, to_stage: usize, src: usize, device: Device) -> Result<Tensor> {
        if !self.recv_shapes.contains_key(&to_stage) {
            let meta = self.group.recv(src)?.to_vec::<i64>()?;
            let bad = || PipelineError::Stage {
                stage: to_stage,
                what: format!("malformed shape message {meta:?} from pp rank {src}"),
            };
            let dtype = *DTYPES.get(*meta.first().ok_or_else(bad)? as usize).ok_or_else(bad)?;
            let n = *meta.get(1).ok_or_else(bad)? as usize;
            if meta.len() != n + 2 {
                return Err(bad());
            }
            let dims = meta[2..].iter().map(|&d| d as usize).collect();
            self.recv_shapes.insert(to_stage, (dims, dtype));
        }
        let (dims, dtype) = &self.recv_shapes[&to_stage];
        Ok(self.group.recv_shaped(src, dims, *dtype, device)?)
    }
}

/// The state of one step on this rank.
struct Run {
    saved: HashMap<(usize, usize), Saved>,
    /// Messages between two stages of this rank (no communication).
    local: HashMap<(MessageKind, usize, usize), Tensor>,
    /// Messages received ahead of their use, by (kind, receiving stage, micro-batch).
    arrived: HashMap<(MessageKind, usize, usize), Tensor>,
    /// Per peer pp rank, the messages it will send us this step, in order.
    expected: HashMap<usize, VecDeque<crate::Message>>,
    losses: Vec<(usize, f64)>,
    scale: f64,
    /// When the running action had its inputs and began computing.
    ready: Option<Instant>,
}

impl Run {
    fn new(p: &PipelineSchedule) -> Run {
        let me = p.group.rank();
        let expected = (0..p.schedule.pp())
            .filter(|&r| r != me)
            .map(|r| (r, p.schedule.messages(r, me).into_iter().collect()))
            .collect();
        Run {
            saved: HashMap::new(),
            local: HashMap::new(),
            arrived: HashMap::new(),
            expected,
            losses: Vec::new(),
            ready: None,
            scale: 1.0 / p.schedule.n_microbatches() as f64,
        }
    }

    /// The message `(kind, stage, mb)` addressed to this rank, from `src`: taken from the
    /// local handoffs, the early arrivals, or received in the sender's order.
    fn fetch(
        &mut self,
        p: &mut PipelineSchedule,
        kind: MessageKind,
        stage: usize,
        mb: usize,
    ) -> Result<Tensor> {
        let me = p.group.rank();
        let src = match kind {
            MessageKind::Activation => p.schedule.rank_of_stage(stage - 1),
            MessageKind::Gradient => p.schedule.rank_of_stage(stage + 1),
        };
        let key = (kind, stage, mb);
        if src == me {
            return self.local.remove(&key).ok_or_else(|| PipelineError::Stage {
                stage,
                what: format!("internal error: no local {kind:?} for micro-batch {mb}"),
            });
        }
        loop {
            if let Some(t) = self.arrived.remove(&key) {
                return Ok(t);
            }
            let next =
                self.expected.get_mut(&src).and_then(|q| q.pop_front()).ok_or_else(|| {
                    PipelineError::Stage {
                        stage,
                        what: format!(
                            "internal error: pp rank {src} sends no {kind:?} for micro-batch {mb}"
                        ),
                    }
                })?;
            let device = p.stage(next.stage).device();
            let t = match next.kind {
                MessageKind::Activation => p.recv_activation(next.stage, src, device)?,
                MessageKind::Gradient => {
                    let root = &self
                        .saved
                        .get(&(next.stage, next.microbatch))
                        .ok_or_else(|| PipelineError::Stage {
                            stage: next.stage,
                            what: format!(
                                "a gradient for micro-batch {} arrived before its forward",
                                next.microbatch
                            ),
                        })?
                        .root;
                    p.group.recv_shaped(src, root.dims(), root.dtype(), device)?
                }
            };
            self.arrived.insert((next.kind, next.stage, next.microbatch), t);
        }
    }

    /// Hands `t` to stage `to_stage` (another rank's, or this rank's own).
    fn deliver(
        &mut self,
        p: &mut PipelineSchedule,
        kind: MessageKind,
        to_stage: usize,
        mb: usize,
        t: Tensor,
    ) -> Result<()> {
        let dst = p.schedule.rank_of_stage(to_stage);
        if dst == p.group.rank() {
            self.local.insert((kind, to_stage, mb), t);
            return Ok(());
        }
        match kind {
            MessageKind::Activation => p.send_activation(&t, to_stage, dst),
            MessageKind::Gradient => Ok(p.group.send_shaped(&t, dst)?),
        }
    }

    fn action(&mut self, p: &mut PipelineSchedule, batch: &Batch, a: Action) -> Result<()> {
        let (s, m) = (a.stage, a.microbatch);
        match a.phase {
            Phase::F => self.forward(p, batch, s, m),
            Phase::B | Phase::I => self.backward(p, s, m, a.phase == Phase::I),
            Phase::W => {
                self.ready = Some(Instant::now());
                let saved = self.saved.remove(&(s, m)).ok_or_else(|| missing(s, m, "W"))?;
                if let Some(w) = saved.weight {
                    w.run()?;
                }
                Ok(())
            }
        }
    }

    fn forward(
        &mut self,
        p: &mut PipelineSchedule,
        batch: &Batch,
        s: usize,
        m: usize,
    ) -> Result<()> {
        let (first, last) = (s == 0, s + 1 == p.schedule.num_stages());
        let input = if first {
            None
        } else {
            let t = self.fetch(p, MessageKind::Activation, s, m)?;
            Some(tpar_tensor::no_grad(|| t.detach()).requires_grad_(true))
        };
        self.ready = Some(Instant::now());
        let x = match &input {
            Some(t) => t.clone(),
            None => batch.input[m].clone(),
        };
        let mut args = vec![Value::Tensor(x)];
        args.extend(batch.extras[m].iter().cloned());
        let out = call(p.stage(s).module(), Args::new(args))?;
        if last {
            let loss = (p.loss_fn)(&out, &batch.target[m])?;
            let (root, seed) = loss.backward_seed()?;
            self.losses.push((m, loss.item()?));
            let seed = tpar_tensor::no_grad(|| seed.mul_scalar(self.scale))?;
            self.saved.insert((s, m), Saved { input, root, seed: Some(seed), weight: None });
            return Ok(());
        }
        let out = match out {
            Value::Tensor(t) => t,
            other => {
                return Err(PipelineError::Stage {
                    stage: s,
                    what: format!(
                        "stages hand each other plain tensors, but this stage's output is {other:?} (give its last module use_local_output)"
                    ),
                })
            }
        };
        let send = tpar_tensor::no_grad(|| out.detach());
        self.saved.insert((s, m), Saved { input, root: out, seed: None, weight: None });
        self.deliver(p, MessageKind::Activation, s + 1, m, send)
    }

    fn backward(
        &mut self,
        p: &mut PipelineSchedule,
        s: usize,
        m: usize,
        split: bool,
    ) -> Result<()> {
        let last = s + 1 == p.schedule.num_stages();
        let grad = if last { None } else { Some(self.fetch(p, MessageKind::Gradient, s, m)?) };
        self.ready = Some(Instant::now());
        let mut saved = self.saved.remove(&(s, m)).ok_or_else(|| missing(s, m, "backward"))?;
        let grad = match (grad, saved.seed.take()) {
            (Some(g), _) | (None, Some(g)) => g,
            (None, None) => return Err(missing(s, m, "the loss seed")),
        };
        let inputs: Vec<Tensor> = saved.input.iter().cloned().collect();
        let input_grad = if split {
            let before = set_weight_pass(p.weight_pass);
            let split = backward_input(
                std::slice::from_ref(&saved.root),
                std::slice::from_ref(&grad),
                &inputs,
            );
            set_weight_pass(before);
            let (g, w) = split?;
            saved.weight = Some(w);
            g.into_iter().next().flatten()
        } else {
            saved.root.backward_with(&grad)?;
            saved.input.as_ref().and_then(|t| t.grad())
        };
        if let Some(input) = &saved.input {
            let g = match input_grad {
                Some(g) => g,
                None => Tensor::zeros(input.shape().clone(), input.dtype(), input.device())?,
            };
            self.deliver(p, MessageKind::Gradient, s - 1, m, g)?;
        }
        if split {
            // Keep the graph for W; the activations go when it runs.
            saved.input = None;
            self.saved.insert((s, m), saved);
        }
        Ok(())
    }
}

fn missing(s: usize, m: usize, what: &str) -> PipelineError {
    PipelineError::Stage {
        stage: s,
        what: format!("internal error: no saved state for micro-batch {m} at {what}"),
    }
}

/// The model state of this rank's stages, as one checkpoint item (the stages' FQNs are
/// the whole model's, so they never collide): saving it from every rank writes the whole
/// model, and loading gives each stage exactly its own keys, strictly (a missing key, or
/// one no stage of this rank has, is an error naming it).
impl tpar_tensor::state::Stateful for PipelineSchedule {
    fn state_dict(&self) -> std::result::Result<StateDict, StateDictError> {
        let mut out = StateDict::new();
        for s in &self.stages {
            out.extend(tpar_nn::state_dict(s.module()).map_err(tpar_nn::state::into_state_err)?);
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> std::result::Result<(), StateDictError> {
        for s in &mut self.stages {
            let names: Vec<String> =
                tpar_nn::named_parameters(s.module()).into_iter().map(|(n, _)| n).collect();
            let mine: StateDict = names.iter().filter_map(|n| state.remove_entry(n)).collect();
            tpar_nn::load_state_dict(s.module_mut(), mine, true)
                .map_err(tpar_nn::state::into_state_err)?;
        }
        tpar_tensor::state::expect_empty(state)
    }
}
