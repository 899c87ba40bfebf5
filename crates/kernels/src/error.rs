//! The kernels' error type.

/// An error a kernel reports instead of panicking.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// An index (token id, class target) is outside the valid range.
    #[error("{op}: index {index} at position {position} is out of range for size {size}")]
    IndexOutOfRange {
        /// The kernel that found it.
        op: &'static str,
        /// The offending index value.
        index: i64,
        /// Where in the index tensor it was found.
        position: usize,
        /// The valid range is `0..size`.
        size: usize,
    },
    /// Buffer lengths disagree with the sizes the kernel was given.
    #[error("{op}: {what}")]
    BadArguments {
        /// The kernel that found it.
        op: &'static str,
        /// What is wrong, with the numbers.
        what: String,
    },
    /// A device buffer (or a view of one) holds fewer bytes than an operation
    /// reads or writes.
    #[error("{op}: {what} holds {got} bytes, {need} needed")]
    BufferTooSmall {
        /// The operation that checked it.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// Bytes the operation touches.
        need: usize,
        /// Bytes the buffer holds.
        got: usize,
    },
    /// A device buffer belongs to another device (another memory, or another
    /// stream of the same GPU) than the one asked to use it.
    #[error("{op}: {what} lives on {got}, the operation runs on {want}")]
    WrongDevice {
        /// The operation that checked it.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// The device the operation runs on.
        want: String,
        /// The device the buffer belongs to.
        got: String,
    },
    /// A launch's thread-block cluster shape does not fit its grid or the
    /// portable limit.
    #[error("{kernel}: cluster {cluster:?} on grid {grid:?}: {why}")]
    BadCluster {
        /// The kernel being launched.
        kernel: String,
        /// Blocks per cluster in x, y, z.
        cluster: [u32; 3],
        /// Blocks of the grid in x, y, z.
        grid: [u32; 3],
        /// What is wrong.
        why: String,
    },
    /// A CUDA kernel could not be compiled or run (on a GPU or in the emulator).
    #[error("{op}: {what}")]
    Cuda {
        /// The kernel or step that failed.
        op: String,
        /// What went wrong (compiler log, driver error, emulator report).
        what: String,
    },
    /// A driver call failed with a sticky error (`CUDA_ERROR_LAUNCH_FAILED`,
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`, `CUDA_ERROR_ILLEGAL_INSTRUCTION`, ...): a
    /// kernel trapped or faulted, the device's CUDA context is lost, and
    /// every later call on that device fails the same way until the process
    /// exits. [`KernelError::is_context_lost`] tells it apart.
    #[error(
        "{op}: {what}; the CUDA context is lost (a kernel trapped or faulted; every later call \
         on this device fails); a Hopper kernel whose mbarrier wait outlasted \
         TPAR_MBAR_TIMEOUT_MS (a deadlock) stops this way, and the error then says where it \
         waited: TPAR_CUDA_ARCH=sm_90 runs the pre-Hopper kernels"
    )]
    ContextLost {
        /// The call that reported it.
        op: String,
        /// The driver error, with its code's name and text.
        what: String,
    },
}

impl KernelError {
    /// Whether this is [`KernelError::ContextLost`]: the device's CUDA
    /// context is gone, so every later call on it fails too (a caller that
    /// runs many independent GPU jobs stops at the first such error).
    pub fn is_context_lost(&self) -> bool {
        matches!(self, KernelError::ContextLost { .. })
    }
}
