//! The nccl backend's collectives on CUDA tensors, device to device.
//!
//! `all_reduce`, `all_gather` and `reduce_scatter` (an even split) of CUDA tensors pass
//! the tensors' own device memory to NCCL, as PyTorch's `ProcessGroupNCCL` does:
//!
//! 1. the caller records an event on the stream that orders the tensor's work (tpar's
//!    stream of its device) and queues the collective on the group's worker;
//! 2. the worker makes the group's NCCL stream wait for that event, enqueues the NCCL
//!    call on it with the device addresses, records a completion event and replies at
//!    once with it: nothing waits on the host;
//! 3. the caller makes its stream wait for the completion event (at once for a blocking
//!    call, at [`Work::wait`](crate::Work::wait) for an async one, so its computation
//!    overlaps the collective) and goes on. Buffers are freed in its stream's order, so
//!    none is freed before NCCL is done with it.
//!
//! The worker polls its completion events between jobs: one still pending past the call's
//! timeout fails the group with `Timeout` (naming the members that never reached that
//! call, as the host path does) and aborts the communicator, which makes the stuck
//! kernels exit.
//!
//! Without the host path's header exchange nothing compares the members' calls: as with
//! PyTorch's `all_gather_into_tensor` every member's tensor must have the same shape, and
//! members that disagree time out instead of failing with `Mismatch`. `TPAR_NCCL_CHECK=1`
//! in the environment (of every process) turns the comparison back on by taking the host
//! path, which also handles uneven `all_gather` shards; an uneven `reduce_scatter` takes
//! the host path by itself (every member sees the same dims, so all of them do). Each
//! host-path call costs a host round trip (`tpar_tensor::gpu::host_round_trips`); the
//! device path costs none.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUresult, CUstream};
use cudarc::driver::{result as dresult, CudaContext, CudaStream, DriverError, SyncOnDrop};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceSlice};
use tpar_tensor::gpu::{self, Block, MemorySpace, Piece, RawDeviceMemory};
use tpar_tensor::{DType, Device, Tensor};

use super::device::driver_error_text;
use crate::local::desc::around;
use crate::local::desc::Call;
use crate::remote::plan::Prim;
use crate::remote::{DeviceWork, RemoteComm};
use crate::{CollectiveError, Result};

/// Whether `TPAR_NCCL_CHECK=1` asks for the checked host path.
fn checked() -> bool {
    static C: OnceLock<bool> = OnceLock::new();
    *C.get_or_init(|| std::env::var_os("TPAR_NCCL_CHECK").is_some_and(|v| v == "1"))
}

/// Whether `call` on `t` in a group of `n` takes the device path: a CUDA tensor on a GPU
/// (not the emulator), a collective whose shapes every member knows alone, and no
/// `TPAR_NCCL_CHECK=1`.
pub(crate) fn eligible(call: &Call, t: &Tensor, n: usize) -> bool {
    if checked() || !matches!(t.device(), Device::Cuda(_)) {
        return false;
    }
    let on_gpu =
        gpu::raw_device_memory(t).is_ok_and(|m| matches!(m.space, MemorySpace::Cuda { .. }));
    on_gpu
        && match call {
            Call::AllReduce { .. } => true,
            Call::AllGather { dim } => *dim < t.rank(),
            Call::ReduceScatter { dim, .. } => *dim < t.rank() && t.dims()[*dim].is_multiple_of(n),
            _ => false,
        }
}

/// A CUDA event (no timing) of the context current when it was made.
pub(crate) struct DeviceEvent(CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread of the process (with its
// context current, which every user below makes sure of).
unsafe impl Send for DeviceEvent {}
// SAFETY: as above; the driver synchronises concurrent uses of one event.
unsafe impl Sync for DeviceEvent {}

impl DeviceEvent {
    /// A new event in the current context.
    pub fn new() -> std::result::Result<DeviceEvent, DriverError> {
        dresult::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).map(DeviceEvent)
    }

    /// Records the work queued on `stream` so far.
    pub fn record(&self, stream: CUstream) -> std::result::Result<(), DriverError> {
        // SAFETY: a live event and a live stream of the current context.
        unsafe { dresult::event::record(self.0, stream) }
    }

    /// Makes `stream` wait (on the device) for the recorded work.
    pub fn wait_on(&self, stream: CUstream) -> std::result::Result<(), DriverError> {
        // SAFETY: a live event and a live stream.
        unsafe {
            dresult::stream::wait_event(stream, self.0, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
    }

    /// Whether the recorded work is done.
    pub fn is_complete(&self) -> std::result::Result<bool, DriverError> {
        // SAFETY: a live event.
        match unsafe { dresult::event::query(self.0) } {
            Ok(()) => Ok(true),
            Err(DriverError(CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl Drop for DeviceEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once; pending work still completes (the driver frees the
        // event's resources when it does).
        let _ = unsafe { dresult::event::destroy(self.0) };
    }
}

/// One collective for the worker to enqueue: device addresses (kept alive by the caller
/// until its stream has waited for `done`), the element count NCCL takes (the send
/// buffer's for all_reduce and all_gather, the receive buffer's for reduce_scatter), and
/// the event after the inputs' last writes.
pub(crate) struct DeviceJob {
    pub op: &'static str,
    pub prim: Prim,
    pub dtype: DType,
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub ready: DeviceEvent,
}

/// The NCCL transport's device work: the worker enqueues it and answers with the
/// collective's completion event.
impl DeviceWork for DeviceJob {
    type Done = DeviceEvent;
    fn op(&self) -> &'static str {
        self.op
    }
}

/// Device memory NCCL reads or writes through cudarc's safe calls: an address and length
/// that the caller keeps valid (cudarc's own ordering does not apply: the events above
/// order every use).
pub(crate) struct Borrowed<T> {
    pub ptr: u64,
    pub len: usize,
    pub stream: Arc<CudaStream>,
    pub _t: std::marker::PhantomData<T>,
}

impl<T> DeviceSlice<T> for Borrowed<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Borrowed<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Borrowed<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// The CUDA context of `ordinal` (the primary one, which tpar's kernels use too), made
/// current on this thread.
fn bind(ordinal: usize) -> std::result::Result<(), DriverError> {
    static CTX: OnceLock<std::sync::Mutex<Vec<Option<Arc<CudaContext>>>>> = OnceLock::new();
    let mut all = CTX.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if all.len() <= ordinal {
        all.resize(ordinal + 1, None);
    }
    let ctx = match &all[ordinal] {
        Some(c) => c.clone(),
        None => {
            let c = CudaContext::new(ordinal)?;
            all[ordinal] = Some(c.clone());
            c
        }
    };
    drop(all);
    ctx.bind_to_thread()
}

/// A collective in flight on the device: the completion event and what must live until
/// the caller's stream has waited for it.
pub(crate) struct InFlight {
    op: &'static str,
    ordinal: usize,
    stream: CUstream,
    done: Option<Arc<DeviceEvent>>,
    /// What NCCL reads and writes, kept until the caller's stream waits for it.
    send: Option<Tensor>,
    recv: Option<Tensor>,
    /// The result's dims.
    out_dims: Vec<usize>,
    /// For an all_gather along an inner dim: `(members, outer, columns per member)` of
    /// the blocks NCCL gathered, to be laid out as column bands.
    unpack: Option<(usize, usize, usize)>,
    group: Vec<usize>,
    rank: usize,
}

// SAFETY: the stream handle is only passed to the driver (any thread may), with the
// context made current first.
unsafe impl Send for InFlight {}

impl InFlight {
    fn err(&self, message: String) -> CollectiveError {
        CollectiveError::Backend {
            backend: "nccl",
            op: self.op,
            group: self.group.clone(),
            rank: self.rank,
            message,
        }
    }

    /// Makes the caller's stream wait for the collective (on the device) and returns the
    /// result. Nothing waits on the host.
    pub fn finish(mut self) -> Result<Tensor> {
        self.join()?;
        self.send = None;
        let recv = self.recv.take().ok_or_else(|| self.err("no result".into()))?;
        match self.unpack {
            // all_gather along an inner dim: NCCL gathered whole blocks, member after
            // member; each becomes a column band of the result.
            Some((n, outer, cols)) => {
                let pieces: Vec<Piece> = (0..n)
                    .map(|r| Piece {
                        src: &recv,
                        from: Block { offset: r * outer * cols, rows: outer, cols, ld: cols },
                        to_offset: r * cols,
                        to_ld: n * cols,
                    })
                    .collect();
                gpu::assemble(self.ordinal, &self.out_dims, recv.dtype(), &pieces)
                    .map_err(|e| self.err(format!("laying the gathered blocks out: {e}")))
            }
            None => Ok(recv),
        }
    }

    /// Whether the collective has finished on the device (an event query; a failed
    /// query counts as finished: [`finish`](Self::finish) then reports the failure).
    pub fn is_completed(&self) -> bool {
        self.done
            .as_ref()
            .is_none_or(|d| bind(self.ordinal).and_then(|()| d.is_complete()).unwrap_or(true))
    }

    /// Enqueues the caller stream's wait for the completion event (once).
    fn join(&mut self) -> Result<()> {
        let Some(done) = self.done.take() else { return Ok(()) };
        bind(self.ordinal).and_then(|()| done.wait_on(self.stream)).map_err(|e| {
            self.err(format!("CUDA: waiting for the collective: {}", driver_error_text(&e)))
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Dropped unwaited (an async call's `Work` dropped): the buffers must still outlive
        // the collective, so the caller's stream waits for it before they are freed.
        let _ = self.join();
    }
}

/// Starts `call` on CUDA tensor `t` (an [`eligible`] call) on the device; see the module
/// docs. The returned [`InFlight`] gives the result.
pub(crate) fn start(
    comm: &RemoteComm<DeviceJob>,
    seq: u64,
    call: &Call,
    t: &Tensor,
    timeout: Duration,
) -> Result<InFlight> {
    let op = call.name();
    let n = comm.ranks().len();
    let Device::Cuda(ordinal) = t.device() else {
        return Err(CollectiveError::InvalidArgument { op, why: "not a CUDA tensor".into() });
    };
    let group = comm.ranks().to_vec();
    let rank = comm.global_rank();
    let backend = |message: String| CollectiveError::Backend {
        backend: "nccl",
        op,
        group: group.clone(),
        rank,
        message,
    };
    let tensor_err = |e: tpar_tensor::TensorError| backend(format!("on the device: {e}"));
    let dims = t.dims().to_vec();
    let (dtype, numel) = (t.dtype(), t.numel());
    let input = t.detach();
    let mut unpack = None;
    let mut out_dims = dims.clone();
    let (prim, send, recv, count) = match *call {
        Call::AllReduce { op: rop } => {
            let recv = Tensor::empty(dims.clone(), dtype, t.device()).map_err(tensor_err)?;
            (Prim::AllReduce(rop), input, recv, numel)
        }
        Call::AllGather { dim } => {
            let (outer, inner) = around(&dims, dim);
            out_dims[dim] *= n;
            let recv_dims = if outer == 1 { out_dims.clone() } else { vec![n * numel] };
            if outer > 1 {
                unpack = Some((n, outer, dims[dim] * inner));
            }
            let recv = Tensor::empty(recv_dims, dtype, t.device()).map_err(tensor_err)?;
            (Prim::AllGather, input, recv, numel)
        }
        Call::ReduceScatter { dim, op: rop } => {
            let (outer, inner) = around(&dims, dim);
            let len = dims[dim] / n;
            out_dims[dim] = len;
            // NCCL scatters contiguous blocks: along an inner dim, member r's block is
            // first gathered from its column band.
            let send = if outer == 1 {
                input
            } else {
                let cols = len * inner;
                let pieces: Vec<Piece> = (0..n)
                    .map(|r| Piece {
                        src: &input,
                        from: Block { offset: r * cols, rows: outer, cols, ld: dims[dim] * inner },
                        to_offset: r * outer * cols,
                        to_ld: cols,
                    })
                    .collect();
                gpu::assemble(ordinal, &[numel], dtype, &pieces).map_err(tensor_err)?
            };
            let recv = Tensor::empty(out_dims.clone(), dtype, t.device()).map_err(tensor_err)?;
            let count = recv.numel();
            (Prim::ReduceScatter(rop), send, recv, count)
        }
        _ => {
            return Err(CollectiveError::InvalidArgument {
                op,
                why: "internal error: not a device-path collective".into(),
            })
        }
    };
    let (s, r) = (
        gpu::raw_device_memory(&send).map_err(tensor_err)?,
        gpu::raw_device_memory(&recv).map_err(tensor_err)?,
    );
    let RawDeviceMemory { space: MemorySpace::Cuda { stream, .. }, .. } = s else {
        return Err(backend("internal error: not GPU memory".into()));
    };
    let stream = stream as usize as CUstream;
    let cuda =
        |what: &str, e: DriverError| backend(format!("CUDA: {what}: {}", driver_error_text(&e)));
    bind(ordinal).map_err(|e| cuda("binding the context", e))?;
    let ready = DeviceEvent::new().map_err(|e| cuda("creating an event", e))?;
    ready.record(stream).map_err(|e| cuda("recording the inputs' event", e))?;
    let job = DeviceJob { op, prim, dtype, send: s.ptr, recv: r.ptr, count, ready };
    let done = comm.run_device(seq, job, timeout)?;
    Ok(InFlight {
        op,
        ordinal,
        stream,
        done: Some(done),
        send: Some(send),
        recv: Some(recv),
        out_dims,
        unpack,
        group,
        rank,
    })
}
