//! A run's configuration as a checkpoint item, so a resume compares itself with the run
//! that saved the checkpoint.

use std::collections::BTreeMap;

use tpar_tensor::state::{StateDict, StateDictError, StateValue, Stateful};

/// What a run was configured with, saved beside its state: a resume with another value
/// of a [`RunConfig::require`]d key is refused with every difference listed, instead of
/// training on a silent mix of the two runs; [`RunConfig::record`]ed keys (a mesh, a
/// plan, a dtype: what a checkpoint reshards across) are saved for the record and may
/// differ.
///
/// Put it first among a checkpoint's items, so a refused resume stops before the other
/// items load.
///
/// ```
/// use tpar_checkpoint::{RunConfig, Stateful};
/// let saved = RunConfig::new().require("lr", 3e-3).require("layers", 2).record("tp", 2);
/// let mut resumed = RunConfig::new()
///     .require("lr", 1e-3)
///     .note("lr", "--override-lr to change it")
///     .require("layers", 2)
///     .record("tp", 4);
/// let err = resumed.load_state_dict(saved.state_dict()?).unwrap_err().to_string();
/// assert!(err.contains("lr: saved 0.003, this run 0.001 (--override-lr to change it)"), "{err}");
/// assert!(!err.contains("tp"), "{err}");
/// # Ok::<(), tpar_checkpoint::StateDictError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct RunConfig {
    /// Each key's value and whether a resume must match it.
    entries: BTreeMap<String, (ConfigValue, bool)>,
    /// How to change a required key on purpose, added to its difference.
    notes: BTreeMap<String, String>,
}

/// A value of a [`RunConfig`]: an integer, a float or text.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigValue {
    /// An integer (sizes, counts, flags, seeds as their bits).
    Int(i64),
    /// A float (compared by value; NaN equals NaN).
    Float(f64),
    /// Text (names, paths, digests).
    Text(String),
}

impl std::fmt::Display for ConfigValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigValue::Int(i) => write!(f, "{i}"),
            ConfigValue::Float(x) => write!(f, "{x}"),
            ConfigValue::Text(t) => write!(f, "{t:?}"),
        }
    }
}

macro_rules! config_from_int {
    ($($t:ty),*) => {$(
        impl From<$t> for ConfigValue {
            fn from(v: $t) -> ConfigValue {
                ConfigValue::Int(v as i64)
            }
        }
    )*};
}
config_from_int!(i64, i32, u32, u64, usize, bool);

impl From<f64> for ConfigValue {
    fn from(v: f64) -> ConfigValue {
        ConfigValue::Float(v)
    }
}

impl From<&str> for ConfigValue {
    fn from(v: &str) -> ConfigValue {
        ConfigValue::Text(v.to_string())
    }
}

impl From<String> for ConfigValue {
    fn from(v: String) -> ConfigValue {
        ConfigValue::Text(v)
    }
}

impl ConfigValue {
    fn to_state(&self) -> StateValue {
        match self {
            ConfigValue::Int(i) => StateValue::Int(*i),
            ConfigValue::Float(x) => StateValue::Float(*x),
            ConfigValue::Text(t) => StateValue::Text(t.clone()),
        }
    }

    fn from_state(v: &StateValue) -> Option<ConfigValue> {
        Some(match v {
            StateValue::Int(i) => ConfigValue::Int(*i),
            StateValue::Float(x) => ConfigValue::Float(*x),
            StateValue::Text(t) => ConfigValue::Text(t.clone()),
            _ => return None,
        })
    }

    fn same(&self, other: &ConfigValue) -> bool {
        match (self, other) {
            (ConfigValue::Float(a), ConfigValue::Float(b)) => a == b || (a.is_nan() && b.is_nan()),
            (a, b) => a == b,
        }
    }
}

impl RunConfig {
    /// An empty configuration.
    pub fn new() -> RunConfig {
        RunConfig::default()
    }

    /// Adds `key`, which a resume must match (model shape, optimizer hyper-parameters,
    /// the schedule, the data and its order).
    pub fn require(mut self, key: &str, value: impl Into<ConfigValue>) -> RunConfig {
        self.entries.insert(key.to_string(), (value.into(), true));
        self
    }

    /// Adds `key` for the record: saved, and free to differ on resume (what a checkpoint
    /// reshards across: the mesh, the plan, the data-parallel mode).
    pub fn record(mut self, key: &str, value: impl Into<ConfigValue>) -> RunConfig {
        self.entries.insert(key.to_string(), (value.into(), false));
        self
    }

    /// Adds to `key`'s difference, should a resume refuse it, how to change it on
    /// purpose (a flag of the trainer, say).
    pub fn note(mut self, key: &str, how: &str) -> RunConfig {
        self.notes.insert(key.to_string(), how.to_string());
        self
    }

    /// This run's value of `key`.
    pub fn get(&self, key: &str) -> Option<&ConfigValue> {
        self.entries.get(key).map(|(v, _)| v)
    }
}

impl Stateful for RunConfig {
    fn state_dict(&self) -> Result<StateDict, StateDictError> {
        Ok(self.entries.iter().map(|(k, (v, _))| (k.clone(), v.to_state())).collect())
    }

    /// Compares the saved configuration with this one; nothing of this run changes.
    ///
    /// # Errors
    /// [`StateDictError::Mismatch`] listing every required key whose saved value
    /// differs, every required key the checkpoint lacks and every key it has that this
    /// run does not set.
    fn load_state_dict(&mut self, mut state: StateDict) -> Result<(), StateDictError> {
        let mut differences = Vec::new();
        for (key, (mine, required)) in &self.entries {
            let saved = state.remove(key);
            if !required {
                continue;
            }
            match saved.as_ref().map(|v| (v, ConfigValue::from_state(v))) {
                None => differences.push(format!("{key}: not saved, this run {mine}")),
                Some((v, None)) => {
                    differences.push(format!("{key}: saved a {}, this run {mine}", v.kind()))
                }
                Some((_, Some(saved))) if !saved.same(mine) => {
                    let note = self.notes.get(key).map(|n| format!(" ({n})")).unwrap_or_default();
                    differences.push(format!("{key}: saved {saved}, this run {mine}{note}"))
                }
                Some(_) => {}
            }
        }
        for (key, v) in state {
            let saved =
                ConfigValue::from_state(&v).map_or_else(|| v.kind().to_string(), |c| c.to_string());
            differences.push(format!("{key}: saved {saved}, this run does not set it"));
        }
        if differences.is_empty() {
            Ok(())
        } else {
            Err(StateDictError::Mismatch { differences })
        }
    }
}
