//! Errors of parallel styles and plans.

use tpar_nn::NnError;

/// Why a plan cannot be applied. Reported before any communication.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PlanError {
    /// Plan keys that match no module.
    #[error("parallelize_module: no module matches {keys:?}; did you mean {suggestions:?}? (modules: {available})")]
    UnknownKeys {
        /// The keys.
        keys: Vec<String>,
        /// The nearest module names per key.
        suggestions: Vec<String>,
        /// A short list of the module names that exist.
        available: String,
    },
    /// A style applied to a module type it does not support.
    #[error("parallelize_module: {style} does not apply to {fqn:?}, a {module_type} (it applies to {supported})")]
    WrongModuleType {
        /// The style.
        style: String,
        /// The module.
        fqn: String,
        /// Its type.
        module_type: String,
        /// What the style supports.
        supported: String,
    },
    /// Sizes that cannot be split over the mesh (heads over tp ranks).
    #[error("parallelize_module: {fqn:?}: {what}")]
    Indivisible {
        /// The module.
        fqn: String,
        /// What does not divide.
        what: String,
    },
    /// Layouts of adjacent modules that cannot meet: `producer` hands on a plain (local)
    /// tensor laid out as `produced`, and `consumer` takes it as `expected`.
    #[error("parallelize_module: layouts do not meet: {producer} hands on a plain tensor laid out as {produced}, but {consumer} takes it as {expected} (make the layouts equal, or hand on a DTensor with use_local_output = false)")]
    LayoutMismatch {
        /// The FQN (and side) of the module producing the tensor.
        producer: String,
        /// Its layout.
        produced: String,
        /// The FQN (and side) of the module consuming it.
        consumer: String,
        /// The layout the consumer declares.
        expected: String,
    },
    /// A style's configuration itself is wrong (mesh not 1-d, ...).
    #[error("{style}: {what}")]
    BadStyle {
        /// The style.
        style: String,
        /// What is wrong.
        what: String,
    },
    /// An error of the module layer while applying the plan.
    #[error(transparent)]
    Nn(#[from] NnError),
}

impl From<tpar_dtensor::DTensorError> for PlanError {
    fn from(e: tpar_dtensor::DTensorError) -> Self {
        PlanError::Nn(e.into())
    }
}

/// Result type of plans and styles.
pub type Result<T> = std::result::Result<T, PlanError>;
