//! The DTensor layer's error type.

use std::sync::Arc;

use tpar_collectives::CollectiveError;
use tpar_mesh::MeshError;
use tpar_placements::PlacementError;
use tpar_tensor::TensorError;

/// Everything a DTensor operation can fail with. Messages read like a sentence: the op,
/// the global shape, the placements per mesh dim and the mesh.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DTensorError {
    /// Bad placements (dim out of range, wrong count for the mesh, ...).
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// A mesh error.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A communication failure.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A local tensor op failed.
    #[error(transparent)]
    Tensor(TensorError),
    /// Operands live on different meshes.
    #[error("{op}: operands are on different meshes: {lhs} and {rhs}")]
    MeshMismatch {
        /// The op.
        op: &'static str,
        /// The first operand's mesh.
        lhs: String,
        /// The second operand's mesh.
        rhs: String,
    },
    /// A local shard does not fit the placements and global shape it was declared with.
    #[error(
        "{op}: rank {rank} holds a local shard of shape {local:?}, but {spec} needs {expected:?}"
    )]
    LocalShape {
        /// The op.
        op: &'static str,
        /// The (global) rank whose shard is wrong.
        rank: usize,
        /// Its local shape.
        local: Vec<usize>,
        /// What the spec needs there.
        expected: Vec<usize>,
        /// The spec, described.
        spec: String,
    },
    /// Ranks passed shards that do not fit one global layout: names the rank that
    /// differs from the majority of ranks and what differs (shape, dtype, or both).
    #[error("{op}: rank {rank} differs from the other ranks: {what}")]
    Inconsistent {
        /// The op.
        op: &'static str,
        /// The (global) rank whose shard differs from the majority (the lowest such rank).
        rank: usize,
        /// What differs, with the numbers: its shape and dtype, what the majority's layout
        /// needs there, and any other rank that differs too.
        what: String,
    },
    /// In strict mode, an op needed a redistribution the user did not ask for.
    #[error("{op}: {what} would need an implicit redistribution {from} -> {to} of {spec}; strict mode forbids it (redistribute explicitly first)")]
    ImplicitRedistribution {
        /// The op.
        op: &'static str,
        /// Which operand.
        what: String,
        /// Its placements.
        from: String,
        /// The placements the op needs.
        to: String,
        /// The operand's spec, described.
        spec: String,
    },
    /// A placement the backward pass cannot differentiate through.
    #[error("{op}: no gradient through {placement} (only Partial(sum) and Partial(avg) are differentiable)")]
    NotDifferentiable {
        /// The op.
        op: &'static str,
        /// The placement.
        placement: String,
    },
    /// An op's operands do not fit together (shapes, dtypes, dims), or no sharding rule
    /// applies to them; `operands` names each one's global shape and placements and the
    /// mesh (`lhs shape [8, 16] as S(1) and rhs shape [16, 4] as S(0) on mesh (tp=2)`).
    #[error("{op}: {operands}: {why}")]
    Op {
        /// The op.
        op: &'static str,
        /// The operands, described.
        operands: String,
        /// What is wrong.
        why: String,
    },
    /// Any other invalid argument, described.
    #[error("{op}: {what}")]
    InvalidArgument {
        /// The op.
        op: &'static str,
        /// What is wrong.
        what: String,
    },
}

impl From<TensorError> for DTensorError {
    /// Unwraps errors of this layer (or collectives) that travelled through autograd.
    fn from(e: TensorError) -> Self {
        if let TensorError::External(inner) = &e {
            if let Some(d) = inner.downcast_ref::<DTensorError>() {
                return d.clone();
            }
            if let Some(c) = inner.downcast_ref::<CollectiveError>() {
                return DTensorError::Collective(c.clone());
            }
        }
        DTensorError::Tensor(e)
    }
}

impl From<DTensorError> for TensorError {
    /// Carries a DTensor error through autograd (backward functions return `TensorError`).
    fn from(e: DTensorError) -> Self {
        match e {
            DTensorError::Tensor(t) => t,
            other => TensorError::External(Arc::new(other)),
        }
    }
}

/// Result type of the DTensor layer.
pub type Result<T> = std::result::Result<T, DTensorError>;
