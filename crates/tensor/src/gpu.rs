//! CUDA storage: tensors on `Device::Cuda(n)`.
//!
//! A CUDA device is a [`GpuDevice`]: a GPU driven through cudarc, or the CPU
//! emulator of the CUDA execution model (the same kernel sources, run on the
//! host; what the tests use on machines without a GPU). Which one serves
//! `cuda:N` is decided on first use: a device registered with
//! [`register_device`], else the emulator when `TPAR_CUDA=emulator`, else
//! the GPU.
//!
//! Ops with a CUDA kernel run on the device. The others (and host reads such
//! as [`crate::Tensor::to_vec`]) copy through the host; each such copy
//! counts in [`host_round_trips`], so a test can check that a training step
//! stays on the device.
//!
//! ```
//! use tpar_tensor::{gpu, DType, Device, Tensor};
//! gpu::register_device(7, tpar_kernels::cuda::emu::EmulatedGpu::open(7)?);
//! let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3])?.to_device(Device::Cuda(7))?;
//! assert_eq!(x.device(), Device::Cuda(7));
//! assert_eq!(x.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use tpar_kernels::cuda::emu::EmulatedGpu;
pub use tpar_kernels::cuda::{DeviceBuffer, GpuDevice, MemorySpace};
use tpar_kernels::cuda::{DeviceSlice, DeviceSliceMut};

use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Result, Shape, Tensor, TensorError};

fn registry() -> &'static Mutex<HashMap<usize, Arc<dyn GpuDevice>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<dyn GpuDevice>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

thread_local! {
    static ROUND_TRIPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Makes `dev` serve `cuda:ordinal` from now on (replacing any earlier one).
pub fn register_device(ordinal: usize, dev: Arc<dyn GpuDevice>) {
    registry().lock().unwrap_or_else(|p| p.into_inner()).insert(ordinal, dev);
}

/// The device serving `cuda:ordinal`, opened on first use.
pub fn device(ordinal: usize) -> Result<Arc<dyn GpuDevice>> {
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = reg.get(&ordinal) {
        return Ok(d.clone());
    }
    let unavailable =
        |why: String| TensorError::Unavailable { what: format!("cuda:{ordinal}"), why };
    let emulate =
        emulator_requested(std::env::var_os("TPAR_CUDA").as_deref()).map_err(unavailable)?;
    let dev = if emulate {
        tpar_kernels::cuda::emu::EmulatedGpu::open(ordinal)
    } else {
        tpar_kernels::cuda::open_gpu(ordinal)
    }
    .map_err(|e| unavailable(e.to_string()))?;
    reg.insert(ordinal, dev.clone());
    Ok(dev)
}

/// Whether `TPAR_CUDA`'s value asks for the CPU emulator (`emulator`) or the GPU (unset
/// or empty); any other value is an error naming it, not a silent choice of the GPU.
fn emulator_requested(value: Option<&std::ffi::OsStr>) -> std::result::Result<bool, String> {
    let Some(v) = value else { return Ok(false) };
    match v.to_str() {
        Some("") => Ok(false),
        Some("emulator") => Ok(true),
        _ => Err(format!(
            "TPAR_CUDA={:?}: expected emulator (the CPU emulator), or unset for the GPU",
            v.to_string_lossy()
        )),
    }
}

/// How many times data has crossed between a CUDA device and the host on
/// this thread, for an op without a device kernel or a host read of device
/// data (explicit moves with `to_device` do not count).
pub fn host_round_trips() -> u64 {
    ROUND_TRIPS.with(|c| c.get())
}

/// Counts a host round trip: an op computing on host copies of CUDA data, a
/// host read of device data, or a collective backend staging CUDA tensors
/// through host memory.
///
/// With `TPAR_TRACE_ROUND_TRIPS=1` in the environment each one also prints
/// `host round trip:` and a backtrace to stderr, to find what makes a step
/// leave the device (build with debug info for file and line numbers).
pub fn count_host_round_trip() {
    static TRACE: OnceLock<bool> = OnceLock::new();
    if *TRACE.get_or_init(|| std::env::var_os("TPAR_TRACE_ROUND_TRIPS").is_some_and(|v| v == "1")) {
        eprintln!("host round trip: {}", std::backtrace::Backtrace::force_capture());
    }
    ROUND_TRIPS.with(|c| c.set(c.get() + 1));
}

/// Turns deferral of this thread's device index checks on (`true`) or off; returns
/// the previous setting. Off by default.
///
/// By default the embedding forward, the cross-entropy forwards and
/// [`crate::Tensor::check_index_range`] on a CUDA device check their ids there and read a 4-byte status back at once: a device
/// synchronization per call, and a bad id is an `IndexOutOfRange` error at the op.
/// With deferral on, those ops launch their kernels with the status slot and
/// record it instead of reading it, so the op returns `Ok` even for a bad id;
/// [`check_deferred_index_checks`] later reads every recorded slot (one
/// synchronization) and returns the error the first bad call would have
/// returned. Turning deferral off leaves recorded checks pending.
///
/// **Until that check, work issued after a bad id runs on masked ids** (the
/// kernels give zero embedding rows and leave the row out of the loss): losses,
/// gradients and optimizer steps computed in between are wrong without any error.
/// A caller that defers must validate its ids itself (e.g. on the host before
/// they are uploaded) or call [`check_deferred_index_checks`] before anything
/// irreversible: an optimizer step it cannot undo, a checkpoint save, a reported
/// metric. [`crate::Tensor::first_index_out_of_range`] and CUDA graph captures
/// (which record no status) are unaffected.
pub fn defer_index_checks(on: bool) -> bool {
    crate::ops::gpu_nn::defer_index_checks(on)
}

/// Whether this thread defers its device index checks (see [`defer_index_checks`]).
pub fn index_checks_deferred() -> bool {
    crate::ops::gpu_nn::index_checks_deferred()
}

/// How many deferred index checks this thread has recorded and not yet read (see
/// [`defer_index_checks`]).
pub fn pending_index_checks() -> usize {
    crate::ops::gpu_nn::pending_index_checks()
}

/// Reads every index check this thread has deferred (see [`defer_index_checks`])
/// and clears them, whatever the outcome: one device synchronization (per device
/// the checks ran on), plus one read of the offending id when one is bad. Returns
/// the first bad call's error, in launch order, exactly as the immediate check
/// would have (`IndexOutOfRange` with the op, the position and the offending
/// value, read from the ids as they are now); `Ok` when none is pending or all
/// ids were in range.
pub fn check_deferred_index_checks() -> Result<()> {
    crate::ops::gpu_nn::check_deferred()
}

/// A tensor's data on a CUDA device.
#[derive(Debug)]
pub struct GpuStorage {
    pub(crate) buf: DeviceBuffer,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
}

fn kerr(e: tpar_kernels::KernelError) -> TensorError {
    TensorError::Kernel(e)
}

impl GpuStorage {
    /// Uninitialized storage for `len` elements of `dtype`.
    pub(crate) fn alloc(dev: &Arc<dyn GpuDevice>, dtype: DType, len: usize) -> Result<Self> {
        let buf = DeviceBuffer::alloc(dev, len * dtype.size_in_bytes()).map_err(kerr)?;
        Ok(GpuStorage { buf, dtype, len })
    }

    /// Zero-filled storage.
    pub(crate) fn zeros(dev: &Arc<dyn GpuDevice>, dtype: DType, len: usize) -> Result<Self> {
        let buf = DeviceBuffer::zeros(dev, len * dtype.size_in_bytes()).map_err(kerr)?;
        Ok(GpuStorage { buf, dtype, len })
    }

    /// A device copy of host storage.
    pub(crate) fn upload(dev: &Arc<dyn GpuDevice>, s: &CpuStorage) -> Result<Self> {
        let buf = DeviceBuffer::from_host(dev, host_bytes(s)).map_err(kerr)?;
        Ok(GpuStorage { buf, dtype: s.dtype(), len: s.len() })
    }

    /// A host copy.
    pub(crate) fn download(&self) -> Result<CpuStorage> {
        let mut s = CpuStorage::zeros(self.dtype, self.len);
        self.buf.as_slice().copy_to_host(host_bytes_mut(&mut s)).map_err(kerr)?;
        Ok(s)
    }

    /// Overwrites the device data with host storage of the same dtype and length.
    pub(crate) fn upload_into(&mut self, s: &CpuStorage) -> Result<()> {
        self.buf.upload(host_bytes(s)).map_err(kerr)
    }

    /// A device copy of this storage.
    pub(crate) fn duplicate(&self) -> Result<Self> {
        Ok(GpuStorage {
            buf: self.buf.duplicate().map_err(kerr)?,
            dtype: self.dtype,
            len: self.len,
        })
    }

    /// A copy of this storage on `dev` (another device), device to device.
    pub(crate) fn copy_to(&self, dev: &Arc<dyn GpuDevice>) -> Result<Self> {
        let mut out = GpuStorage::alloc(dev, self.dtype, self.len)?;
        out.view_mut().copy_from_device(self.view()).map_err(kerr)?;
        Ok(out)
    }

    /// The device address of the first element.
    pub fn ptr(&self) -> tpar_kernels::cuda::DevPtr {
        self.buf.ptr()
    }

    /// The data, for a kernel to read.
    pub(crate) fn view(&self) -> DeviceSlice<'_> {
        self.buf.as_slice()
    }

    /// The data, for a kernel to write.
    pub(crate) fn view_mut(&mut self) -> DeviceSliceMut<'_> {
        self.buf.as_slice_mut()
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn GpuDevice> {
        self.buf.device()
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.buf.len()
    }
}

/// The elements of host storage as bytes.
fn host_bytes(s: &CpuStorage) -> &[u8] {
    match s {
        CpuStorage::F32(v) => bytemuck::cast_slice(v),
        CpuStorage::F64(v) => bytemuck::cast_slice(v),
        CpuStorage::BF16(v) => bytemuck::cast_slice(v),
        CpuStorage::F16(v) => bytemuck::cast_slice(v),
        CpuStorage::I64(v) => bytemuck::cast_slice(v),
    }
}

/// The elements of host storage as bytes to overwrite.
fn host_bytes_mut(s: &mut CpuStorage) -> &mut [u8] {
    match s {
        CpuStorage::F32(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F64(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::BF16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::I64(v) => bytemuck::cast_slice_mut(v),
    }
}

// ------------------------------------------------------------------ collectives

pub use tpar_kernels::cuda::ops::collective::FoldOp;
use tpar_kernels::cuda::ops::collective::{self as coll_kernels, FoldDType};

/// A `[rows, cols]` block of a tensor's flat row-major elements, rows `ld`
/// elements apart, starting at element `offset`: what a collective reads of
/// one rank's buffer (a chunk along a dim is `rows = outer`, `cols = len *
/// inner`, `ld = size * inner`, `offset = start * inner`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// First element.
    pub offset: usize,
    /// Number of rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Elements between row starts.
    pub ld: usize,
}

impl Block {
    /// `len` contiguous elements from `offset`.
    pub fn flat(offset: usize, len: usize) -> Block {
        Block { offset, rows: 1, cols: len, ld: len }
    }

    /// Elements from `offset` to one past the last one the block covers.
    fn reach(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1).saturating_mul(self.ld).saturating_add(self.cols)
        }
    }

    /// The pitch the copy kernels take (a single row has none).
    fn pitch(&self) -> usize {
        if self.rows > 1 {
            self.ld
        } else {
            self.cols
        }
    }

    /// The block's bytes range in a buffer of `len` elements of `es` bytes.
    fn bytes(&self, op: &'static str, es: usize, len: usize) -> Result<std::ops::Range<usize>> {
        if self.reach() == 0 {
            return Ok(0..0); // an empty block touches nothing, wherever it starts
        }
        let end = self.offset.saturating_add(self.reach());
        if end > len || (self.rows > 1 && self.ld < self.cols) {
            return Err(TensorError::InvalidArgument {
                op,
                what: format!("{self:?} does not fit a buffer of {len} elements"),
            });
        }
        Ok(self.offset * es..end * es)
    }
}

/// One piece of a tensor [`assemble`]d from others: `from` (a block of
/// `src`) lands at element `to_offset` of the output, rows `to_ld` apart.
#[derive(Clone, Copy, Debug)]
pub struct Piece<'a> {
    /// The CUDA tensor read (on any CUDA device).
    pub src: &'a Tensor,
    /// The block of `src` copied.
    pub from: Block,
    /// Where its first element lands in the output.
    pub to_offset: usize,
    /// Elements between the output rows it fills.
    pub to_ld: usize,
}

fn fold_dtype(dtype: DType) -> FoldDType {
    match dtype {
        DType::F32 => FoldDType::F32,
        DType::F64 => FoldDType::F64,
        DType::BF16 => FoldDType::BF16,
        DType::F16 => FoldDType::F16,
        DType::I64 => FoldDType::I64,
    }
}

/// `view` as a buffer in `dev`'s memory: itself when `dev` can use it, else
/// a copy in `tmp` made device to device (a peer copy between GPUs).
fn reachable<'a>(
    dev: &Arc<dyn GpuDevice>,
    view: DeviceSlice<'a>,
    tmp: &'a mut Option<DeviceBuffer>,
) -> Result<DeviceSlice<'a>> {
    if view.device().memory_space() == dev.memory_space() {
        return Ok(view);
    }
    let mut b = DeviceBuffer::alloc(dev, view.len()).map_err(kerr)?;
    b.as_slice_mut().copy_from_device(view).map_err(kerr)?;
    Ok(tmp.insert(b).as_slice())
}

fn not_cuda(op: &'static str, t: &Tensor) -> TensorError {
    TensorError::DeviceMismatch { op, lhs: Device::Cuda(0), rhs: t.device() }
}

/// A new tensor of `dims` and `dtype` on `cuda:ordinal` built from blocks of
/// CUDA tensors, device to device: each [`Piece`] is one pitched copy (a peer
/// copy first when its source is on another GPU). The pieces must cover the
/// output (elements no piece writes are unspecified). What `all_gather`,
/// `all_to_all` and `broadcast` of CUDA tensors are made of; nothing goes
/// through the host.
pub fn assemble(
    ordinal: usize,
    dims: &[usize],
    dtype: DType,
    pieces: &[Piece<'_>],
) -> Result<Tensor> {
    const OP: &str = "assemble";
    let dev = device(ordinal)?;
    let shape = Shape::new(dims);
    let len = shape.numel();
    let es = dtype.size_in_bytes();
    let mut out = GpuStorage::alloc(&dev, dtype, len)?;
    for p in pieces {
        if p.src.dtype() != dtype {
            return Err(TensorError::DTypeMismatch {
                op: OP,
                expected: dtype.name().into(),
                got: p.src.dtype(),
            });
        }
        let to = Block { offset: p.to_offset, ld: p.to_ld, ..p.from };
        let dst_range = to.bytes(OP, es, len)?;
        p.src
            .with_gpu_storage(OP, |s| {
                let src_range = p.from.bytes(OP, es, s.len)?;
                let mut tmp = None;
                let src = s.view().slice(src_range).map_err(kerr)?;
                let src = reachable(&dev, src, &mut tmp)?;
                let dst = out.view_mut().slice_mut(dst_range).map_err(kerr)?;
                let (rows, cols) = (p.from.rows, p.from.cols);
                tpar_kernels::cuda::ops::layout::copy2d(
                    &*dev,
                    es,
                    rows,
                    cols,
                    src,
                    p.from.pitch(),
                    dst,
                    to.pitch(),
                )
                .map_err(kerr)
            })
            .map_err(|e| match e {
                TensorError::DeviceMismatch { .. } => not_cuda(OP, p.src),
                e => e,
            })?;
    }
    Ok(Tensor::make(shape, dtype, Device::Cuda(ordinal), Storage::Gpu(out)))
}

/// Reduces the same `block` of every source (CUDA tensors of one dtype, on
/// any CUDA devices) elementwise with `op`, in source order, into a new
/// contiguous tensor of `dims` (`block.rows * block.cols` elements) on
/// `cuda:ordinal`, with a device kernel. The fold is the host collectives'
/// (bf16/f16 accumulate in f32 and round once), so the result is bit-equal
/// to theirs; sources on another GPU are first copied peer to peer. What
/// `all_reduce` and `reduce_scatter` of CUDA tensors compute with.
pub fn reduce(
    ordinal: usize,
    dims: &[usize],
    srcs: &[&Tensor],
    block: Block,
    op: FoldOp,
) -> Result<Tensor> {
    const OP: &str = "reduce";
    let dev = device(ordinal)?;
    let shape = Shape::new(dims);
    let Some(first) = srcs.first() else {
        return Err(TensorError::InvalidArgument { op: OP, what: "no sources".into() });
    };
    let dtype = first.dtype();
    if shape.numel() != block.rows * block.cols {
        return Err(TensorError::InvalidArgument {
            op: OP,
            what: format!("{block:?} does not fill shape {shape}"),
        });
    }
    let es = dtype.size_in_bytes();
    let mut out = GpuStorage::alloc(&dev, dtype, shape.numel())?;
    // Read locks on every distinct storage (handles sharing one lock it once).
    let mut guards = Vec::with_capacity(srcs.len());
    let mut which = Vec::with_capacity(srcs.len());
    for (i, t) in srcs.iter().enumerate() {
        if t.dtype() != dtype {
            return Err(TensorError::DTypeMismatch {
                op: OP,
                expected: dtype.name().into(),
                got: t.dtype(),
            });
        }
        match (0..i).find(|&j| srcs[j].same_storage(t)) {
            Some(j) => which.push(which[j]),
            None => {
                which.push(guards.len());
                guards.push(t.0.storage.read().unwrap_or_else(|p| p.into_inner()));
            }
        }
    }
    let mut storages = Vec::with_capacity(srcs.len());
    for (&w, t) in which.iter().zip(srcs.iter()) {
        match guards.get(w).map(|g| &**g) {
            Some(Storage::Gpu(s)) => storages.push(s),
            _ => return Err(not_cuda(OP, t)),
        }
    }
    let mut tmps: Vec<Option<DeviceBuffer>> = (0..srcs.len()).map(|_| None).collect();
    let mut views = Vec::with_capacity(srcs.len());
    for (s, tmp) in storages.iter().zip(tmps.iter_mut()) {
        let v = s.view().slice(block.bytes(OP, es, s.len)?).map_err(kerr)?;
        views.push(reachable(&dev, v, tmp)?);
    }
    coll_kernels::reduce(
        &*dev,
        fold_dtype(dtype),
        op,
        &views,
        block.rows,
        block.cols,
        block.pitch(),
        out.view_mut(),
    )
    .map_err(kerr)?;
    drop(views);
    drop(guards);
    Ok(Tensor::make(shape, dtype, Device::Cuda(ordinal), Storage::Gpu(out)))
}

/// Where a CUDA tensor's data lives, for a library that reads or writes it on
/// its own stream (NCCL): see [`raw_device_memory`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawDeviceMemory {
    /// The device address of the first element.
    pub ptr: tpar_kernels::cuda::DevPtr,
    /// Bytes of the tensor's data.
    pub bytes: usize,
    /// The memory and the stream that orders every use of it by tpar
    /// ([`MemorySpace::Cuda`]'s `stream` is the raw `CUstream`;
    /// [`MemorySpace::Host`] on the emulator).
    pub space: MemorySpace,
}

/// The device address, size and ordering stream of CUDA tensor `t`'s data.
///
/// The address stays valid while `t` (or a handle sharing its storage) lives
/// and its storage is not replaced; its memory is freed in the order of
/// [`RawDeviceMemory::space`]'s stream. Work on another stream must therefore
/// start after an event recorded on that stream (the tensor's pending writes)
/// and be waited for on that stream before the tensor may be dropped.
pub fn raw_device_memory(t: &Tensor) -> Result<RawDeviceMemory> {
    t.with_gpu_storage("raw_device_memory", |s| {
        Ok(RawDeviceMemory {
            ptr: s.ptr(),
            bytes: s.len * s.dtype.size_in_bytes(),
            space: s.device().memory_space(),
        })
    })
}

/// Whether every CUDA device this process has opened orders its work on one
/// stream (one GPU, or the emulator): then all CUDA tensors' work runs in issue
/// order, and threads sharing them need no synchronisation between each
/// other's launches.
pub fn single_stream() -> bool {
    let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    let mut spaces = reg.values().map(|d| d.memory_space());
    match spaces.next() {
        None => true,
        Some(first) => spaces.all(|s| s == first),
    }
}

/// Waits for the work queued on `cuda:ordinal` (a no-op on the emulator).
pub fn synchronize(ordinal: usize) -> Result<()> {
    device(ordinal)?.synchronize().map_err(kerr)
}

// ------------------------------------------------------------------ CUDA graphs

pub use tpar_kernels::cuda::graph::{CudaGraph, GraphStats, WorkCounts};
use tpar_kernels::cuda::ops::dropout::{state_words, STATE_WORDS};

use crate::rng::{CaptureRng, CaptureRngGuard};

/// Captures the CUDA work `f` issues on `cuda:ordinal` into a graph (see
/// [`tpar_kernels::cuda::graph`]): tensor ops inside `f` are recorded, not run;
/// tensors they create live in the graph's private memory pool, and a
/// [`Graph::replay`] rewrites them. Returns the graph and what `f` returned (the
/// static outputs to read after a replay). A host round trip inside `f` (reading a
/// tensor back, an op without a device kernel) fails it, as does any fault the
/// capture saw; the device is out of capture mode either way.
///
/// Random ops captured on the device (dropout) draw, on each replay, the words the
/// thread's generator then gives (PyTorch's graph-safe generator): a replay moves the
/// generator past them as the eager ops would have, and the capture itself moves it
/// nothing. So replays draw new masks, and the same masks as running `f` eagerly in
/// their place would, the backward of a captured forward included when it is captured
/// with it.
pub fn capture_graph<R, E: From<TensorError>>(
    ordinal: usize,
    f: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<(Graph, R), E> {
    let dev = device(ordinal)?;
    // Allocated before the capture, so that it lives outside the graph's pool.
    let state = Tensor::zeros([STATE_WORDS], DType::I64, Device::Cuda(ordinal))?;
    let start = crate::get_rng_state();
    dev.begin_capture().map_err(kerr)?;
    let r = {
        let _rng = CaptureRngGuard::set(CaptureRng { state: state.clone(), start });
        f()
    };
    let graph = CudaGraph::end(&dev);
    let words = crate::get_rng_state().offset.wrapping_sub(start.offset);
    // Nothing ran: the replays draw the words.
    crate::set_rng_state(start);
    let r = r?;
    let rng = (words > 0).then_some(GraphRng { state, words });
    Ok((Graph { graph: graph.map_err(kerr)?, rng }, r))
}

/// What a graph's random ops draw on a replay: the device state they read and the words
/// the capture took.
#[derive(Debug)]
struct GraphRng {
    state: Tensor,
    words: u64,
}

/// A captured CUDA graph ([`capture_graph`]): the recorded work and, when it holds
/// random ops, the generator state their replays read.
#[derive(Debug)]
pub struct Graph {
    graph: CudaGraph,
    rng: Option<GraphRng>,
}

impl Graph {
    /// Issues the recorded work once, in order, on the device's stream. When the graph
    /// holds random ops, first writes the thread's generator state to the device (one
    /// small host-to-device copy) and moves the generator past the words they draw.
    pub fn replay(&self) -> Result<()> {
        if let Some(rng) = &self.rng {
            let now = crate::get_rng_state();
            let words = state_words(now.seed, now.offset).map(|w| w as i64);
            write_from_host(&rng.state, &Tensor::from_vec(words.to_vec(), [STATE_WORDS])?)?;
            crate::set_rng_state(crate::RngState {
                seed: now.seed,
                offset: now.offset.wrapping_add(rng.words),
            });
        }
        self.graph.replay().map_err(kerr)
    }

    /// What was recorded.
    pub fn stats(&self) -> GraphStats {
        self.graph.stats()
    }

    /// The generator words a replay draws (0 without random ops).
    pub fn random_words(&self) -> u64 {
        self.rng.as_ref().map_or(0, |r| r.words)
    }

    /// The kernels layer's graph.
    pub fn cuda_graph(&self) -> &CudaGraph {
        &self.graph
    }
}

/// How [`GraphedStep::run`] ran a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMode {
    /// Eagerly, as a warm-up step.
    Warmup,
    /// Captured into the graph, then replayed once.
    Captured,
    /// Replayed from the graph.
    Replayed,
    /// Eagerly, because its inputs' shapes or dtypes differ from the captured ones.
    Fallback,
}

/// One training step as a CUDA graph, PyTorch's whole-network capture: a few eager
/// warm-up steps (lazy allocations, kernel builds, optimizer state), then the step is
/// captured once with its inputs in static device tensors and replayed for each later
/// step after the new inputs are written into those tensors; a step whose inputs have
/// other shapes or dtypes than the captured ones runs eagerly instead (the graph stays
/// for the steps that match again).
///
/// The step closure gets the inputs on the device and returns its outputs (tensors it
/// computed, e.g. the loss); under capture those are the graph's static outputs, which
/// every replay rewrites, and a replayed step returns them again. Whatever the step
/// changes on the host (an optimizer's step count, the learning rate) must reach the
/// device before a replay: `before_replay` runs then (e.g. `Optimizer::prepare_replay`).
pub struct GraphedStep<O> {
    ordinal: usize,
    warmup_left: usize,
    graph: Option<Graph>,
    inputs: Vec<Tensor>,
    outputs: Option<O>,
}

impl<O: Clone> GraphedStep<O> {
    /// Steps on `cuda:ordinal`, the first `warmup` (at least 1) run eagerly.
    pub fn new(ordinal: usize, warmup: usize) -> Self {
        GraphedStep {
            ordinal,
            warmup_left: warmup.max(1),
            graph: None,
            inputs: Vec::new(),
            outputs: None,
        }
    }

    /// The captured graph, once there is one.
    pub fn graph(&self) -> Option<&Graph> {
        self.graph.as_ref()
    }

    /// The shapes and dtypes the graph was captured with.
    pub fn captured_inputs(&self) -> Vec<(Shape, DType)> {
        self.inputs.iter().map(|t| (t.shape().clone(), t.dtype())).collect()
    }

    fn matches(&self, inputs: &[Tensor]) -> bool {
        inputs.len() == self.inputs.len()
            && inputs
                .iter()
                .zip(&self.inputs)
                .all(|(a, b)| a.shape() == b.shape() && a.dtype() == b.dtype())
    }

    /// Runs one step on host `inputs` (see the type's docs): its outputs and how it ran.
    /// `ctx` is what both closures work on (the optimizer, for example).
    pub fn run<C, E: From<TensorError>>(
        &mut self,
        ctx: &mut C,
        inputs: &[Tensor],
        mut step: impl FnMut(&mut C, &[Tensor]) -> std::result::Result<O, E>,
        mut before_replay: impl FnMut(&mut C) -> std::result::Result<(), E>,
    ) -> std::result::Result<(O, StepMode), E> {
        let to_device = |ts: &[Tensor]| -> Result<Vec<Tensor>> {
            ts.iter().map(|t| t.to_device(Device::Cuda(self.ordinal))).collect()
        };
        if self.warmup_left > 0 {
            self.warmup_left -= 1;
            return Ok((step(ctx, &to_device(inputs)?)?, StepMode::Warmup));
        }
        let mode = match &self.graph {
            Some(_) if !self.matches(inputs) => {
                return Ok((step(ctx, &to_device(inputs)?)?, StepMode::Fallback));
            }
            Some(_) => {
                for (dst, src) in self.inputs.iter().zip(inputs) {
                    write_from_host(dst, src)?;
                }
                StepMode::Replayed
            }
            None => {
                self.inputs = to_device(inputs)?;
                let statics = self.inputs.clone();
                let (graph, out) = capture_graph(self.ordinal, || step(ctx, &statics))?;
                self.graph = Some(graph);
                self.outputs = Some(out);
                StepMode::Captured
            }
        };
        before_replay(ctx)?;
        let (Some(graph), Some(out)) = (&self.graph, &self.outputs) else {
            return Err(TensorError::InvalidArgument {
                op: "GraphedStep::run",
                what: "no graph".into(),
            }
            .into());
        };
        graph.replay()?;
        Ok((out.clone(), mode))
    }
}

/// Whether `cuda:ordinal` is capturing a graph now (false for a device never opened).
pub fn is_capturing(ordinal: usize) -> bool {
    let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    reg.get(&ordinal).is_some_and(|d| d.is_capturing())
}

/// The work issued to `cuda:ordinal` so far, where the device counts it (the
/// emulator): kernels, copies, host calls, graph replays and the time inside them.
pub fn work_counts(ordinal: usize) -> Option<WorkCounts> {
    let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    reg.get(&ordinal).and_then(|d| d.work_counts())
}

/// Overwrites CUDA tensor `dst`'s data, in place, with host tensor `src` of the same
/// shape and dtype: one host-to-device copy into the same device memory (a
/// [`crate::Tensor::copy_`] gives `dst` new storage instead). What feeds a captured
/// graph's static inputs before a replay.
pub fn write_from_host(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "write_from_host";
    if src.shape() != dst.shape() || src.dtype() != dst.dtype() {
        return Err(TensorError::InvalidArgument {
            op: OP,
            what: format!(
                "a {} {} host tensor into a {} {} device tensor (same shape and dtype needed)",
                src.shape(),
                src.dtype().name(),
                dst.shape(),
                dst.dtype().name()
            ),
        });
    }
    let host = {
        let g = src.0.storage.read().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Storage::Cpu(s) => s.clone(),
            _ => {
                return Err(TensorError::DeviceMismatch {
                    op: OP,
                    lhs: Device::Cpu,
                    rhs: src.device(),
                })
            }
        }
    };
    let mut g = dst.0.storage.write().unwrap_or_else(|p| p.into_inner());
    match &mut *g {
        Storage::Gpu(d) => d.upload_into(&host),
        _ => Err(TensorError::DeviceMismatch { op: OP, lhs: Device::Cuda(0), rhs: dst.device() }),
    }
}

#[cfg(test)]
mod tests {
    use super::emulator_requested;
    use std::ffi::OsStr;

    #[test]
    fn tpar_cuda_takes_emulator_or_nothing() {
        assert_eq!(emulator_requested(None), Ok(false));
        assert_eq!(emulator_requested(Some(OsStr::new(""))), Ok(false));
        assert_eq!(emulator_requested(Some(OsStr::new("emulator"))), Ok(true));
        for typo in ["emu", "1", "Emulator", "emulator "] {
            let e = emulator_requested(Some(OsStr::new(typo))).unwrap_err();
            assert!(e.contains(&format!("TPAR_CUDA={typo:?}")) && e.contains("expected"), "{e}");
        }
    }
}
