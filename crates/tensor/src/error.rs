//! The tensor core's error type.

use crate::{DType, Device, Shape};

/// Everything a tensor op can fail with. Messages name the op and the numbers.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TensorError {
    /// Shapes that do not fit together.
    #[error("{op}: shapes {lhs} and {rhs} do not match: {why}")]
    ShapeMismatch {
        /// The op.
        op: &'static str,
        /// First operand's shape.
        lhs: Shape,
        /// Second operand's shape.
        rhs: Shape,
        /// What exactly disagrees.
        why: String,
    },
    /// An operand has the wrong dtype.
    #[error("{op}: expected dtype {expected}, got {got}")]
    DTypeMismatch {
        /// The op.
        op: &'static str,
        /// What the op needs (e.g. `"f32"`, `"a float type"`).
        expected: String,
        /// What it got.
        got: DType,
    },
    /// Operands live on different devices.
    #[error("{op}: operands on different devices: {lhs} and {rhs}")]
    DeviceMismatch {
        /// The op.
        op: &'static str,
        /// First operand's device.
        lhs: Device,
        /// Second operand's device.
        rhs: Device,
    },
    /// A dim index outside `-rank..rank`.
    #[error("{op}: dim {dim} out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The op.
        op: &'static str,
        /// The dim asked for.
        dim: isize,
        /// The tensor's rank.
        rank: usize,
    },
    /// Any other invalid argument, described.
    #[error("{op}: {what}")]
    InvalidArgument {
        /// The op.
        op: &'static str,
        /// What is wrong, with the numbers.
        what: String,
    },
    /// A feature or device that is not available on this build or machine.
    #[error("{what} is unavailable: {why}")]
    Unavailable {
        /// The feature.
        what: String,
        /// Why it is not available.
        why: String,
    },
    /// An op needs data but the tensor is on the meta device.
    #[error("{op}: tensor on the meta device has no data (materialize it with to_empty first)")]
    MetaTensor {
        /// The op.
        op: &'static str,
    },
    /// The tensor's storage was released (e.g. an FSDP parameter between uses).
    #[error("{op}: the tensor's storage was released (an FSDP parameter outside its unit's forward/backward); unshard it first")]
    Released {
        /// The op.
        op: &'static str,
    },
    /// A tensor's storage cannot be allocated: its byte count overflows, or the allocator
    /// refused it. Returned instead of aborting the process.
    #[error(
        "{op}: cannot allocate a {dtype} tensor of shape {shape}: {} ({why})",
        crate::storage::human_bytes(*bytes)
    )]
    OutOfMemory {
        /// The op or the tensor being allocated (`"zeros"`, `"randn"`, `"rope tables"`, ...).
        op: &'static str,
        /// The shape asked for.
        shape: Shape,
        /// The element type.
        dtype: DType,
        /// The bytes asked for (saturating at `u128::MAX` when the product overflows).
        bytes: u128,
        /// Why it failed (`"more bytes than the address space holds"`, `"the allocator refused"`).
        why: String,
    },
    /// Autograd misuse (backward from a non-scalar without a gradient, ...).
    #[error("autograd: {0}")]
    Autograd(String),
    /// An activation-checkpointed region whose recompute in backward did not match its
    /// forward (another output shape, a kept op's output asked for out of order, a tensor
    /// the forward never used), so no gradient is computed from it.
    #[error("activation checkpointing: {what}")]
    Recompute {
        /// What differed.
        what: String,
    },
    /// An error of a layer above (collectives, DTensor) raised inside a backward function,
    /// carried through autograd unchanged.
    #[error("{0}")]
    External(std::sync::Arc<dyn std::error::Error + Send + Sync>),
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] tpar_kernels::KernelError),
}
