//! Pieces the training examples share: the loop's checkpointed progress, the sampler
//! over a dataset, and the progress bar.

use indicatif::{ProgressBar, ProgressStyle};
use tpar::prelude::*;
use tpar::tensor::state::{expect_empty, take_float, take_int};

/// The loop's own place in the run, checkpointed with the model: the step reached (the
/// data position follows from it) and the run's first loss (for the summary).
pub struct Progress {
    pub step: usize,
    pub first_loss: f64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> Result<StateDict, StateDictError> {
        Ok(StateDict::from([
            ("step".to_string(), StateValue::Int(self.step as i64)),
            ("first_loss".to_string(), StateValue::Float(self.first_loss)),
        ]))
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> Result<(), StateDictError> {
        self.step = take_int(&mut state, "step")?.max(0) as usize;
        self.first_loss = take_float(&mut state, "first_loss")?;
        expect_empty(state)
    }
}

/// The shuffled sampler of dp rank `dp_rank` over `len` samples, and how many batches
/// of `batch` an epoch has (an error when the data is too small for one).
pub fn sampler(
    len: usize,
    dp: usize,
    dp_rank: usize,
    batch: usize,
    seed: u64,
) -> tpar::Result<(DistributedSampler, usize)> {
    let sampler = DistributedSampler::new(dp, dp_rank)?
        .with_shuffle(true)
        .with_seed(seed)
        .with_drop_last(true);
    let per_epoch = len / dp / batch.max(1);
    if per_epoch == 0 {
        return Err(tpar::Error::from(NnError::Config {
            what: format!("{len} documents are too few for dp {dp} x batch {batch}"),
        }));
    }
    Ok((sampler, per_epoch))
}

/// A progress bar over `steps` (loss, lr, tokens/s, ETA), starting at `start`.
pub fn progress_bar(steps: usize, start: usize) -> ProgressBar {
    let bar = ProgressBar::new(steps as u64);
    let style = "{bar:30} {pos:>4}/{len} {msg} ETA {eta}";
    bar.set_style(ProgressStyle::with_template(style).unwrap_or(ProgressStyle::default_bar()));
    bar.set_position(start as u64);
    bar
}
