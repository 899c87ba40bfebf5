//! Learning-rate schedules (PyTorch's closed forms) and the scheduler that drives one.

use super::*;

// ---------------------------------------------------------------------------------------
// Learning-rate schedules
// ---------------------------------------------------------------------------------------

/// A learning-rate schedule: the learning rate at a step, as a pure function of the step
/// and the optimizer's initial learning rate (PyTorch's closed forms).
pub trait LrSchedule: fmt::Debug + Send + Sync {
    /// The learning rate after `step` scheduler steps (step 0 is the value set at
    /// construction), for an optimizer whose initial learning rate is `base_lr`.
    fn lr_at(&self, step: usize, base_lr: f64) -> f64;
}

impl<S: LrSchedule + ?Sized> LrSchedule for Box<S> {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        (**self).lr_at(step, base_lr)
    }
}

/// `torch.optim.lr_scheduler.LinearLR`: the factor moves linearly from `start_factor` to
/// `end_factor` over `total_iters` steps, then stays:
/// `base_lr * (start + (end - start) * min(step, total_iters) / total_iters)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearLR {
    /// Factor at step 0 (torch's default 1/3).
    pub start_factor: f64,
    /// Factor from `total_iters` on (default 1).
    pub end_factor: f64,
    /// Steps of the ramp (default 5; 0 means `end_factor` from the start).
    pub total_iters: usize,
}

impl LinearLR {
    /// A checked `LinearLR` (torch's bounds: `0 < start_factor <= 1`,
    /// `0 <= end_factor <= 1`).
    pub fn new(start_factor: f64, end_factor: f64, total_iters: usize) -> Result<LinearLR> {
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(config_err(format!(
                "LinearLR: start_factor {start_factor} must be in (0, 1]"
            )));
        }
        if !(0.0..=1.0).contains(&end_factor) {
            return Err(config_err(format!("LinearLR: end_factor {end_factor} must be in [0, 1]")));
        }
        Ok(LinearLR { start_factor, end_factor, total_iters })
    }
}

impl LrSchedule for LinearLR {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        if self.total_iters == 0 {
            return base_lr * self.end_factor;
        }
        let t = step.min(self.total_iters) as f64 / self.total_iters as f64;
        base_lr * (self.start_factor + (self.end_factor - self.start_factor) * t)
    }
}

/// `torch.optim.lr_scheduler.CosineAnnealingLR`:
/// `eta_min + (base_lr - eta_min) * (1 + cos(pi * step / t_max)) / 2` (periodic past
/// `t_max`, as torch's; `t_max` 0 is taken as 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineAnnealingLR {
    /// Steps of the half cosine.
    pub t_max: usize,
    /// The minimum learning rate.
    pub eta_min: f64,
}

impl CosineAnnealingLR {
    /// A checked `CosineAnnealingLR` (`t_max >= 1`, `eta_min >= 0`).
    pub fn new(t_max: usize, eta_min: f64) -> Result<CosineAnnealingLR> {
        if t_max == 0 {
            return Err(config_err("CosineAnnealingLR: t_max must be at least 1"));
        }
        if !non_negative(eta_min) {
            return Err(config_err(format!("CosineAnnealingLR: invalid eta_min {eta_min}")));
        }
        Ok(CosineAnnealingLR { t_max, eta_min })
    }
}

impl LrSchedule for CosineAnnealingLR {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        let t_max = self.t_max.max(1) as f64;
        self.eta_min + (base_lr - self.eta_min) * (1.0 + (PI * step as f64 / t_max).cos()) / 2.0
    }
}

/// `torch.optim.lr_scheduler.SequentialLR`: `schedulers[i]` runs from `milestones[i-1]`
/// (0 for the first) with its own step count restarting at 0 there, as torch's
/// `step(0)` at a milestone does.
#[derive(Debug)]
pub struct SequentialLR {
    schedulers: Vec<Box<dyn LrSchedule>>,
    milestones: Vec<usize>,
}

impl SequentialLR {
    /// Chains `schedulers`; `milestones` must be one fewer and non-decreasing.
    pub fn new(
        schedulers: Vec<Box<dyn LrSchedule>>,
        milestones: Vec<usize>,
    ) -> Result<SequentialLR> {
        if schedulers.is_empty() {
            return Err(config_err("SequentialLR: needs at least one scheduler"));
        }
        if milestones.len() + 1 != schedulers.len() {
            return Err(config_err(format!(
                "SequentialLR: {} schedulers need {} milestones, got {}",
                schedulers.len(),
                schedulers.len() - 1,
                milestones.len()
            )));
        }
        if milestones.windows(2).any(|w| w[0] > w[1]) {
            return Err(config_err(format!(
                "SequentialLR: milestones {milestones:?} must be non-decreasing"
            )));
        }
        Ok(SequentialLR { schedulers, milestones })
    }

    /// The usual LLM schedule: `LinearLR(start_factor, 1, warmup)` for `warmup` steps,
    /// then `CosineAnnealingLR(total - warmup, eta_min)`.
    pub fn warmup_cosine(
        warmup: usize,
        total: usize,
        start_factor: f64,
        eta_min: f64,
    ) -> Result<SequentialLR> {
        let cosine = CosineAnnealingLR::new(total.saturating_sub(warmup).max(1), eta_min)?;
        SequentialLR::new(
            vec![Box::new(LinearLR::new(start_factor, 1.0, warmup)?), Box::new(cosine)],
            vec![warmup],
        )
    }

    /// The milestones.
    pub fn milestones(&self) -> &[usize] {
        &self.milestones
    }
}

impl LrSchedule for SequentialLR {
    fn lr_at(&self, step: usize, base_lr: f64) -> f64 {
        // bisect_right(milestones, step)
        let idx = self.milestones.partition_point(|&m| m <= step);
        let start = if idx == 0 { 0 } else { self.milestones[idx - 1] };
        self.schedulers[idx].lr_at(step - start, base_lr)
    }
}

/// Drives an [`LrSchedule`] against an optimizer, as a torch scheduler object: created
/// after the optimizer (taking its learning rate as `base_lr` and setting step 0's
/// value), then [`LrScheduler::step`] once per optimizer step.
#[derive(Debug)]
pub struct LrScheduler<S: LrSchedule> {
    schedule: S,
    base_lr: f64,
    last_step: usize,
    last_lr: f64,
    /// Loading takes only the step from a checkpoint ([`LrScheduler::override_on_load`]).
    keep_own_schedule: bool,
}

impl<S: LrSchedule> LrScheduler<S> {
    /// Starts `schedule` at step 0 with `opt`'s current learning rate as the base.
    pub fn new<O: Optimizer + ?Sized>(schedule: S, opt: &mut O) -> LrScheduler<S> {
        let base_lr = opt.lr();
        let last_lr = schedule.lr_at(0, base_lr);
        opt.set_lr(last_lr);
        LrScheduler { schedule, base_lr, last_step: 0, last_lr, keep_own_schedule: false }
    }

    /// Advances one step and sets the optimizer's learning rate; returns it.
    pub fn step<O: Optimizer + ?Sized>(&mut self, opt: &mut O) -> f64 {
        self.last_step += 1;
        self.last_lr = self.schedule.lr_at(self.last_step, self.base_lr);
        opt.set_lr(self.last_lr);
        self.last_lr
    }

    /// Restores the position of the schedule (e.g. from a checkpoint); the optimizer's
    /// learning rate is restored with the optimizer's own state.
    pub fn restore(&mut self, last_step: usize, base_lr: f64, last_lr: f64) {
        (self.last_step, self.base_lr, self.last_lr) = (last_step, base_lr, last_lr);
    }

    /// Makes loading a checkpoint take only its step: this scheduler's own schedule and
    /// base learning rate stay, and the learning rate is recomputed at the loaded step.
    /// Without it, loading a checkpoint saved with another schedule is an error (a
    /// resume would otherwise follow a mix of the two); with it, a resumed run changes
    /// its learning rate on purpose. Set the optimizer's learning rate to
    /// [`LrScheduler::last_lr`] after loading (the optimizer's own state holds the
    /// saved one).
    pub fn override_on_load(&mut self) {
        self.keep_own_schedule = true;
    }

    /// Whether loading keeps this scheduler's schedule ([`LrScheduler::override_on_load`]).
    pub fn overrides_on_load(&self) -> bool {
        self.keep_own_schedule
    }

    /// The position after `last_step` steps of this scheduler's own schedule (its own
    /// base learning rate), as [`LrScheduler::override_on_load`] loads it.
    pub(crate) fn restore_step(&mut self, last_step: usize) {
        self.last_step = last_step;
        self.last_lr = self.schedule.lr_at(last_step, self.base_lr);
    }

    /// The learning rate the last step set (`get_last_lr()`).
    pub fn last_lr(&self) -> f64 {
        self.last_lr
    }

    /// Steps taken (`last_epoch`).
    pub fn last_step(&self) -> usize {
        self.last_step
    }

    /// The base learning rate (`initial_lr`).
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// The schedule.
    pub fn schedule(&self) -> &S {
        &self.schedule
    }
}
