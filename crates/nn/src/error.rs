//! The module layer's error type.

use tpar_dtensor::DTensorError;
use tpar_tensor::TensorError;

/// Errors of modules, their forward passes and the hooks parallel styles install.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NnError {
    /// A local tensor op failed.
    #[error(transparent)]
    Tensor(TensorError),
    /// A DTensor op or redistribution failed.
    #[error(transparent)]
    DTensor(DTensorError),
    /// A module got an input of a kind it cannot use.
    #[error("{module}: {what}")]
    BadInput {
        /// The module (its type name, or FQN when known).
        module: String,
        /// What is wrong.
        what: String,
    },
    /// A state dict that does not fit the module (missing, unexpected or mis-shaped keys).
    #[error(transparent)]
    State(#[from] tpar_tensor::state::StateDictError),
    /// A value that must be finite is not (a gradient norm with `error_if_nonfinite`).
    #[error("{what} is {value} (non-finite)")]
    NonFinite {
        /// The op and the value it checked (`"clip_grad_norm: the total gradient norm"`).
        what: String,
        /// The value (NaN or ±inf).
        value: f64,
    },
    /// An optimizer (or another holder of parameters) holds a parameter its module no
    /// longer has: a parallel style, `fully_shard` or `reset_parameters` replaced it after
    /// the optimizer was built, so stepping it would not train the model.
    #[error(
        "{holder}: parameter {param} is no longer the model's ({by} replaced it after the \
         optimizer was built), so stepping it would not train the model; build the \
         optimizer after sharding and initialising the model (after parallelize_module, \
         fully_shard and reset_parameters), from its parameters then"
    )]
    RetiredParam {
        /// The optimizer (`"AdamW"`, `"SGD"`, `"ZeroRedundancyOptimizer"`).
        holder: String,
        /// The parameter's name as the optimizer knows it (its FQN when built with names).
        param: String,
        /// What replaced it (`"fully_shard"`, `"parallelize_module"`, `"reset_parameters"`).
        by: String,
    },
    /// A configuration that cannot work (head counts, sizes).
    #[error("{what}")]
    Config {
        /// What is wrong, with the numbers.
        what: String,
    },
}

impl From<TensorError> for NnError {
    fn from(e: TensorError) -> Self {
        match DTensorError::from(e) {
            DTensorError::Tensor(t) => NnError::Tensor(t),
            d => NnError::DTensor(d),
        }
    }
}

impl From<DTensorError> for NnError {
    fn from(e: DTensorError) -> Self {
        match e {
            DTensorError::Tensor(t) => NnError::Tensor(t),
            d => NnError::DTensor(d),
        }
    }
}

impl From<tpar_mesh::MeshError> for NnError {
    fn from(e: tpar_mesh::MeshError) -> Self {
        NnError::DTensor(e.into())
    }
}

impl From<tpar_collectives::CollectiveError> for NnError {
    fn from(e: tpar_collectives::CollectiveError) -> Self {
        NnError::DTensor(e.into())
    }
}

/// Result type of the module layer.
pub type Result<T> = std::result::Result<T, NnError>;
