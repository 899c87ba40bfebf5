//! SGD (`torch.optim.SGD`): momentum, dampening, weight decay, Nesterov.

use super::*;

// ---------------------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------------------

/// Hyper-parameters of [`Sgd`]; the defaults are `torch.optim.SGD`'s (lr 1e-3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 keeps no state).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient (coupled, as torch's SGD).
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

impl SgdConfig {
    pub(crate) fn check(&self) -> Result<()> {
        if !non_negative(self.lr) {
            return Err(config_err(format!("SGD: invalid learning rate {}", self.lr)));
        }
        if !non_negative(self.momentum) {
            return Err(config_err(format!("SGD: invalid momentum {}", self.momentum)));
        }
        if !non_negative(self.weight_decay) {
            return Err(config_err(format!("SGD: invalid weight_decay {}", self.weight_decay)));
        }
        if !self.dampening.is_finite() {
            return Err(config_err(format!("SGD: invalid dampening {}", self.dampening)));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(config_err(
                "SGD: Nesterov momentum requires a momentum and zero dampening",
            ));
        }
        Ok(())
    }
}

/// `torch.optim.SGD` (not maximize) over one parameter group:
///
/// ```text
/// g = grad + weight_decay * p
/// b = g                                   (first step)
/// b = momentum * b + (1 - dampening) * g  (later steps)
/// g = nesterov ? g + momentum * b : b     (when momentum != 0)
/// p -= lr * g
/// ```
///
/// Local, like [`AdamW`]: the momentum buffer is sharded like the parameter, allocated
/// on the first step (only when momentum is non-zero), in f32 for f32/bf16/f16 parameters
/// and f64 for f64 ones; the update is computed in that precision.
#[derive(Debug)]
pub struct Sgd {
    params: Vec<(String, Param)>,
    config: SgdConfig,
    momentum_buffer: Vec<Option<Tensor>>,
}

impl Sgd {
    /// SGD over `params`.
    pub fn new(params: Vec<Param>, config: SgdConfig) -> Result<Sgd> {
        Sgd::with_names(numbered(params), config)
    }

    /// SGD over named parameters.
    pub fn with_names(params: Vec<(String, Param)>, config: SgdConfig) -> Result<Sgd> {
        config.check()?;
        check_not_retired("SGD", &params)?;
        let momentum_buffer = vec![None; params.len()];
        Ok(Sgd { params, config, momentum_buffer })
    }

    /// The hyper-parameters (with the current learning rate).
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The parameters, with their names.
    pub fn params(&self) -> &[(String, Param)] {
        &self.params
    }

    /// The momentum buffer of parameter `index` (a copy laid out like its local shard),
    /// `None` before its first step or without momentum.
    pub fn momentum_buffer(&self, index: usize) -> Result<Option<Tensor>> {
        let (Some(Some(b)), Some((_, p))) =
            (self.momentum_buffer.get(index), self.params.get(index))
        else {
            return Ok(None);
        };
        Ok(Some(state_copy(b, p.trainable().dims())?))
    }

    /// Replaces the hyper-parameters (e.g. from a checkpoint).
    pub fn set_config(&mut self, config: SgdConfig) {
        self.config = config;
    }

    /// Replaces the momentum buffer of parameter `index` (`None`: no buffer, as before
    /// the first step); a buffer must have the parameter's local shape.
    pub fn set_momentum_buffer(&mut self, index: usize, buffer: Option<Tensor>) -> Result<()> {
        let Some((name, p)) = self.params.get(index) else {
            return Err(config_err(format!(
                "SGD::set_momentum_buffer: index {index} out of range for {} parameters",
                self.params.len()
            )));
        };
        let leaf = p.trainable();
        self.momentum_buffer[index] = match buffer {
            None => None,
            Some(b) if b.dims() != leaf.dims() => {
                return Err(bad_param(
                    "SGD",
                    name,
                    format!(
                        "momentum_buffer of shape {:?} for a local shard {:?}",
                        b.dims(),
                        leaf.dims()
                    ),
                ))
            }
            Some(b) => Some(state_from(&b, &leaf)?),
        };
        Ok(())
    }

    /// One parameter's step, in place, through [`Tensor::sgd_step_`]; the momentum buffer
    /// (with momentum only) lives on the parameter's device.
    fn step_one(
        name: &str,
        leaf: &Tensor,
        g: &Tensor,
        buf: &mut Option<Tensor>,
        c: &SgdConfig,
    ) -> Result<()> {
        let g = &grad_on(leaf, g)?;
        let first = buf.is_none();
        let b = if c.momentum != 0.0 {
            let s = match buf {
                Some(s) => s,
                None => buf.insert(zeros_state(leaf)?),
            };
            Some(state_for("SGD", name, s, leaf)?)
        } else {
            None
        };
        let h = SgdParams {
            lr: c.lr,
            weight_decay: c.weight_decay,
            momentum: c.momentum,
            dampening: c.dampening,
            nesterov: c.nesterov,
            first_step: first,
        };
        leaf.sgd_step_(g, b.as_ref(), &h)?;
        Ok(())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        check_not_retired("SGD", &self.params)?;
        for ((name, p), buf) in self.params.iter().zip(&mut self.momentum_buffer) {
            let leaf = p.trainable();
            let Some(g) = grad_for_step("SGD", name, p, &leaf)? else { continue };
            Sgd::step_one(name, &leaf, &g, buf, &self.config)?;
            // A sharded parameter's low-precision working copy no longer holds the shard.
            if let Some(u) = p.unsharder()? {
                u.stepped(false)?;
            }
        }
        Ok(())
    }

    fn zero_grad(&self) {
        for (_, p) in &self.params {
            p.zero_grad();
        }
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state_bytes(&self) -> usize {
        self.momentum_buffer.iter().flatten().map(bytes).sum()
    }
    fn grads_for_clip(&mut self) -> Result<Vec<ClipGrad>> {
        param_grads(self.params.iter().map(|(_, p)| p))
    }
}
