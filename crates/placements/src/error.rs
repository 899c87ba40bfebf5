//! The crate's error type.

/// Everything that can go wrong in this crate: bad placements, meshes,
/// coordinates, parse input, or simulator input.
///
/// Every variant carries a `context` naming the operation (for example
/// `placements S(0)R -> RS(3) on mesh [2, 2]`) and the numbers involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// A `Shard(dim)` names a tensor dim outside `-rank..rank`.
    #[error("{context}: tensor dim {dim} out of range for {}", describe_tensor(*.rank, .shape))]
    DimOutOfRange {
        /// The operation that failed.
        context: String,
        /// The offending (unnormalised) tensor dim.
        dim: isize,
        /// The tensor's rank.
        rank: usize,
        /// The tensor's global shape, when known.
        shape: Option<Vec<usize>>,
    },
    /// The number of placements differs from the mesh's number of dims.
    #[error("{context}: {placements} placements for the {}-d mesh {mesh:?}", .mesh.len())]
    MeshRankMismatch {
        /// The operation that failed.
        context: String,
        /// How many placements were given.
        placements: usize,
        /// The mesh shape.
        mesh: Vec<usize>,
    },
    /// A mesh dim has size 0.
    #[error("{context}: mesh {mesh:?} has a mesh dim of size 0")]
    EmptyMeshDim {
        /// The operation that failed.
        context: String,
        /// The mesh shape.
        mesh: Vec<usize>,
    },
    /// A mesh coordinate has the wrong length or an entry out of range.
    #[error("{context}: coordinate {coord:?} does not fit mesh {mesh:?}")]
    CoordOutOfRange {
        /// The operation that failed.
        context: String,
        /// The offending coordinate.
        coord: Vec<usize>,
        /// The mesh shape.
        mesh: Vec<usize>,
    },
    /// A `Partial` placement with an operator placements do not support (`product`).
    #[error("{context}: Partial({op}) is not a supported placement (Partial takes sum, avg, max or min)")]
    UnsupportedPartial {
        /// The operation that failed.
        context: String,
        /// The operator.
        op: crate::ReduceOp,
    },
    /// A placement string could not be parsed.
    #[error("cannot parse placement {input:?}: {reason}")]
    Parse {
        /// The text that failed to parse.
        input: String,
        /// Why.
        reason: String,
    },
    /// The reference simulator was given inconsistent data.
    #[error("{context}: {reason}")]
    Simulation {
        /// The operation that failed.
        context: String,
        /// Why.
        reason: String,
    },
}

fn describe_tensor(rank: usize, shape: &Option<Vec<usize>>) -> String {
    match shape {
        Some(shape) => format!("shape {shape:?}"),
        None => format!("a rank-{rank} tensor"),
    }
}

impl PlacementError {
    /// Replaces the operation context and, where the variant has one, fills
    /// in the tensor's global shape.
    pub(crate) fn with_context(
        mut self,
        new_context: &str,
        global_shape: Option<&[usize]>,
    ) -> Self {
        match &mut self {
            PlacementError::DimOutOfRange { context, shape, .. } => {
                *context = new_context.to_string();
                if let Some(s) = global_shape {
                    *shape = Some(s.to_vec());
                }
            }
            PlacementError::MeshRankMismatch { context, .. }
            | PlacementError::EmptyMeshDim { context, .. }
            | PlacementError::CoordOutOfRange { context, .. }
            | PlacementError::UnsupportedPartial { context, .. }
            | PlacementError::Simulation { context, .. } => *context = new_context.to_string(),
            PlacementError::Parse { .. } => {}
        }
        self
    }
}

/// `Result` with [`PlacementError`] as the default error.
pub type Result<T, E = PlacementError> = std::result::Result<T, E>;
