//! CUDA graphs: record a stretch of a device's work once, replay it with one call
//! (PyTorch's `torch.cuda.graph` / `CUDAGraph`).
//!
//! [`CudaGraph::capture`] runs a closure with the device in capture mode: its
//! kernel launches, device-to-device copies and memsets are recorded, not run,
//! with their launch configurations and argument bytes; [`CudaGraph::replay`]
//! then issues the recorded work in order, as often as asked. Nothing a replay
//! does is decided on the host, so everything that changes between replays
//! must live in device memory the graph reads (inputs copied into static
//! buffers before a replay, coefficients written to the device).
//!
//! **Memory.** Every allocation made during capture comes from a private pool
//! the graph owns (PyTorch's graph memory pool): the recorded work addresses
//! those blocks, so a block freed during or after capture goes back to the
//! pool, never to other users, while the graph lives; dropping the graph
//! releases the pool's free blocks (blocks still held by buffers are released
//! when those are dropped).
//!
//! **Faults** a capture reports (as CUDA refuses them, or where the emulator
//! can see them), as [`crate::KernelError::Cuda`] with op `"cuda graph
//! capture"`: a host round trip inside capture (a device-to-host copy, a
//! host-to-device copy of host bytes, a synchronization); work or an
//! allocation issued from another thread during capture (it would not be
//! ordered with the captured work, nor come from the private pool); and a
//! block allocated before capture, freed during it, that the captured work
//! uses (a replay would touch freed memory). A capture that saw a fault ends
//! with that error and no graph.
//!
//! The CPU emulator ([`super::emu::EmulatedGpu`]) implements capture and checks the
//! faults above. A GPU ([`super::device::CudaDevice`]) captures with the driver's
//! stream capture of its handle's stream (relaxed mode), allocations during it from
//! the graph's private pool, blocks of earlier allocations freed during it released
//! when it ends; the driver itself refuses the host round trips (the capture then
//! ends with its error). That path follows the driver's documented rules and has not
//! run on a GPU yet. A device without capture answers [`GpuDevice::begin_capture`]
//! with an error saying so.
//!
//! ```
//! use std::sync::Arc;
//! use tpar_kernels::cuda::{emu::EmulatedGpu, graph::CudaGraph, DeviceBuffer, GpuDevice};
//! let dev: Arc<dyn GpuDevice> = EmulatedGpu::open(0)?;
//! let src = DeviceBuffer::from_host(&dev, &[1u8, 2, 3, 4])?;
//! let mut dst = DeviceBuffer::zeros(&dev, 4)?;
//! let graph = CudaGraph::capture(&dev, || dst.as_slice_mut().copy_from(src.as_slice()))?;
//! assert_eq!(dst.to_host()?, vec![0, 0, 0, 0]); // recorded, not run
//! graph.replay()?;
//! assert_eq!(dst.to_host()?, vec![1, 2, 3, 4]);
//! # Ok::<(), tpar_kernels::KernelError>(())
//! ```

use std::sync::Arc;

use super::GpuDevice;
use crate::Result;

/// The op name of capture and replay errors.
pub const CAPTURE_OP: &str = "cuda graph capture";

/// What a device has been asked to do so far, for counting launches per step and
/// the host time spent issuing them. Counters only grow; subtract two readings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkCounts {
    /// Calls the host made to issue work: kernel launches, copies and memsets
    /// issued one by one, and graph replays (one call each, whatever they hold).
    pub host_calls: u64,
    /// Kernels the device ran, issued one by one or by a graph replay.
    pub kernels_run: u64,
    /// Copies and memsets the device ran (device to device, host to device,
    /// device to host, zeroing), one by one or by a replay.
    pub copies_run: u64,
    /// Graph replays.
    pub replays: u64,
    /// Device-to-host copies issued by the host (each one a synchronization: the
    /// host waits for the work before it). Also counted in `copies_run`.
    pub dtoh_reads: u64,
    /// Nanoseconds the host spent in the device's work itself (the emulator runs
    /// kernels on the calling thread: the time inside them); a step's wall time
    /// minus this is the host's own time between pieces of work.
    pub device_ns: u64,
}

impl std::ops::Sub for WorkCounts {
    type Output = WorkCounts;
    fn sub(self, o: WorkCounts) -> WorkCounts {
        WorkCounts {
            host_calls: self.host_calls.saturating_sub(o.host_calls),
            kernels_run: self.kernels_run.saturating_sub(o.kernels_run),
            copies_run: self.copies_run.saturating_sub(o.copies_run),
            replays: self.replays.saturating_sub(o.replays),
            dtoh_reads: self.dtoh_reads.saturating_sub(o.dtoh_reads),
            device_ns: self.device_ns.saturating_sub(o.device_ns),
        }
    }
}

/// The size of a captured graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Kernel launches recorded.
    pub kernels: usize,
    /// Copies and memsets recorded.
    pub copies: usize,
    /// Blocks in the graph's private memory pool.
    pub pool_blocks: usize,
    /// Bytes in the graph's private memory pool.
    pub pool_bytes: usize,
}

/// A device's executable graph, as [`GpuDevice::end_capture`] returns it.
pub trait GraphExec: Send + Sync {
    /// Issues the recorded work once, in order.
    fn replay(&self) -> Result<()>;
    /// What was recorded.
    fn stats(&self) -> GraphStats;
}

/// A captured graph on one device (see the [module docs](self)).
pub struct CudaGraph {
    exec: Box<dyn GraphExec>,
    dev: Arc<dyn GpuDevice>,
}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaGraph({:?} on {})", self.exec.stats(), self.dev.describe())
    }
}

impl CudaGraph {
    /// Runs `f` with `dev` capturing, then returns the graph of the work `f`
    /// issued on it (recorded, not run). An error of `f`, or a fault the capture
    /// saw (see the [module docs](self)), ends the capture and is returned
    /// instead; the device is out of capture mode either way.
    pub fn capture<R>(
        dev: &Arc<dyn GpuDevice>,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<CudaGraph> {
        CudaGraph::capture_with(dev, f).map(|(g, _)| g)
    }

    /// [`CudaGraph::capture`] that also returns what `f` returned (the static
    /// outputs a replay rewrites, for example).
    pub fn capture_with<R>(
        dev: &Arc<dyn GpuDevice>,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<(CudaGraph, R)> {
        dev.begin_capture()?;
        let r = f();
        let exec = dev.end_capture();
        let r = r?;
        Ok((CudaGraph { exec: exec?, dev: dev.clone() }, r))
    }

    /// Starts capturing on `dev` (pair with [`CudaGraph::end`]); prefer
    /// [`CudaGraph::capture`], which always ends the capture.
    pub fn begin(dev: &Arc<dyn GpuDevice>) -> Result<()> {
        dev.begin_capture()
    }

    /// Ends the capture [`CudaGraph::begin`] started on `dev`: the graph, or the
    /// first fault the capture saw.
    pub fn end(dev: &Arc<dyn GpuDevice>) -> Result<CudaGraph> {
        Ok(CudaGraph { exec: dev.end_capture()?, dev: dev.clone() })
    }

    /// Issues the recorded work once, in order, on the device's stream.
    pub fn replay(&self) -> Result<()> {
        self.exec.replay()
    }

    /// What was recorded.
    pub fn stats(&self) -> GraphStats {
        self.exec.stats()
    }

    /// The device the graph runs on.
    pub fn device(&self) -> &Arc<dyn GpuDevice> {
        &self.dev
    }
}
