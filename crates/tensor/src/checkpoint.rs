//! Activation checkpointing (PyTorch's `torch.utils.checkpoint`): a region's forward
//! runs without keeping its intermediate activations, and backward recomputes them.
//!
//! [`checkpoint`]`(inputs, keep, f)` runs `f(inputs)` with grad recording off, so none
//! of the region's intermediate tensors (nor the values its ops' backward closures would
//! save) outlive the call. It records one node, `checkpoint`, whose inputs are the
//! region's `inputs` and every tensor requiring a gradient that an op of the region read
//! from outside it (its parameters, or an FSDP unit's unsharded parameters): found while
//! the forward runs, as the inputs of the ops that would have recorded a node. In
//! backward that node's closure runs `f` again, with grad recording on, on copies of the
//! inputs cut from the graph, then backpropagates the output's gradient through the
//! recomputed graph down to those copies and the outside tensors (and no further: the
//! graph beyond them is the enclosing backward's), and hands the gradients to the
//! enclosing pass. So the engine's machinery sees an ordinary node: parameters get their
//! gradients from it (ready-leaf accumulation and post-accumulate-grad hooks, as DDP
//! uses), callbacks the recomputed graph's closures queue ([`crate::autograd::queue_callback`],
//! as FSDP's) join the running pass. In a split backward
//! ([`crate::autograd::backward_input`]) the input pass asks the node only for the
//! region's inputs: it recomputes the region, computes those, and (under the default
//! [`WeightPass::Keep`]) keeps the recomputed graph's parameter half, which the weight
//! pass asks for next (the region is recomputed once per backward, and its weight
//! gradients wait for the weight pass as a plain layer's do). A selective region's kept
//! outputs are dropped then: the recompute has used them, and the parameter half saved
//! none of them, so from the input pass to the weight pass a selective region holds what
//! a full one holds. Under [`WeightPass::Recompute`] ([`set_weight_pass`]) the input pass
//! drops the recomputed graph instead, and the weight pass recomputes the region again.
//!
//! **Bit-identical recompute.** The recompute runs the same `f` on the same values, so
//! it issues the same ops in the same order. The random ops draw from the thread's
//! default generator ([`crate::RngState`]; [`crate::Tensor::dropout`]): the region saves
//! its state when its forward starts and the recompute runs from that state, then puts
//! back the state it found (PyTorch's `preserve_rng_state`), so a recomputed dropout
//! drops what the forward dropped and the ops after the backward draw as if nothing had
//! been recomputed. Its output's shape and dtype are checked against the forward's.
//!
//! **Selective checkpointing.** With a non-empty `keep` (e.g. [`SaveOp::Matmul`] and
//! [`SaveOp::Sdpa`]; torchtitan keeps attention and every second matmul,
//! [`SaveOp::EveryOtherMatmul`], which is [`SaveOp::DEFAULT`]), the outputs of those ops
//! are kept from the forward and everything else (norms, elementwise ops, RoPE) is
//! recomputed. Products on meta tensors (the shape inference a DTensor op runs before
//! its local product) are neither kept nor counted, so a tensor-parallel layer keeps
//! what the same layer keeps at one rank. The mechanism is a per-thread stack of frames consulted by the kept ops themselves (one
//! call in the host matmul and the host attention): during the forward a *record* frame
//! appends each kept op's output (with the op and its operands' shapes) to a list; during
//! the recompute a *replay* frame hands those outputs back in order instead of computing
//! them, while the op still records its autograd node (its backward reads its inputs and
//! the saved output as usual). The replay checks each request against the next entry
//! (same op, same operand shapes) and that every entry was used at the end; any
//! difference fails the backward with [`TensorError::Recompute`] instead of computing a
//! gradient from a misaligned value. The device matmul and attention of CUDA tensors
//! consult the frames the same way.
//!
//! **Outputs no backward reads.** As PyTorch's checkpoint stops its recompute once every
//! tensor the backward needs is back, a recompute here skips the products whose values
//! nothing reads: a region's output is only the root of the backward through the
//! recomputed graph, so the last projection of a Llama decoder layer, whose output only
//! the residual add reads before it becomes the region's output, need not be computed
//! again (its backward reads its input and its weight). The code that knows it says so:
//! a region whose output is one module's (`tpar_nn::CheckpointWrapper`'s) leaves a
//! request ([`request_output_unread`]) just before it runs that module in a recompute;
//! `tpar_nn::call` hands it to the module ([`take_output_unread_request`]), which may pass
//! it on to the child that computes its output or run the ops that make it inside
//! [`unread_output`]. A region of any other function gets no request (its function may
//! read what its modules return), and a module that does not know passes nothing on. In
//! that scope, and only during a recompute, a matrix product records its node as always
//! but its output is zeros instead of the product; and since the recompute does not read
//! it, a selective region's forward does not keep it either (the request also runs
//! there), though the policy names its op: under torchtitan's every-second-matmul policy
//! a Llama layer keeps q, v and gate, not down. The gradients are those of the
//! forward, bit for bit; what a recompute skips is counted in
//! [`RecomputeCounts::skipped`].
//!
//! **Nesting.** A [`checkpoint`] called with grad recording off, or inside a selective
//! region's forward or recompute, runs `f` directly (the enclosing region already
//! decides what is kept). A full region inside a full region's recompute becomes a
//! region of its own.
//!
//! [`recompute_counts`] reports, per thread, how many regions were recomputed and how
//! many kept outputs were saved and reused, so tests and benchmarks can see what ran.
//! [`region_times`] (off unless [`set_region_timing`] turns it on) sums the wall time of
//! regions' forwards, their recomputes and the backward through the recomputed graphs,
//! so a benchmark can tell what a checkpointed step spends beyond one extra forward.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::autograd::{
    grad_within, grad_within_split, is_grad_enabled, needs_input_grad, record, DeferredWithin,
    GradModeGuard,
};
use crate::rng::{get_rng_state, RngState, RngStateGuard};
use crate::{DType, Result, Shape, Tensor, TensorError};

/// An op whose output a selective checkpoint keeps from the forward instead of
/// recomputing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SaveOp {
    /// Matrix products (`matmul`, `matmul_t`, and so `linear`).
    Matmul,
    /// Scaled dot-product attention (its output and log-sum-exps), also as the attention
    /// inside [`Tensor::attention_bshd`] and [`Tensor::attention_packed`].
    Sdpa,
    /// Every second matrix product of a region: the 1st, 3rd, 5th, ... are kept, the
    /// others recomputed (torchtitan's selective policy; [`SaveOp::Matmul`] wins when
    /// both are listed).
    EveryOtherMatmul,
}

impl SaveOp {
    /// What selective checkpointing keeps unless told otherwise: attention's output and
    /// every second matmul's (torchtitan's selective policy). On the CPU Llama of
    /// docs/PERF.md it keeps about half of what no checkpointing keeps and recomputes the
    /// other matmuls (k, o and up of each decoder layer) and the elementwise ops.
    ///
    /// Written `sdpa` first, so that a policy printer can tell this default from the
    /// same ops listed explicitly (`selective[matmul/2,sdpa]`).
    pub const DEFAULT: [SaveOp; 2] = [SaveOp::Sdpa, SaveOp::EveryOtherMatmul];

    /// The op's name as written in policies (`matmul`, `sdpa`, `matmul/2`).
    pub fn name(self) -> &'static str {
        match self {
            SaveOp::Matmul => "matmul",
            SaveOp::Sdpa => "sdpa",
            SaveOp::EveryOtherMatmul => "matmul/2",
        }
    }

    /// The op named `s` (`matmul`/`mm`/`linear`, `sdpa`/`attention` (also
    /// `attention_bshd`, `attention_packed`), `matmul/2`), if any.
    pub fn parse(s: &str) -> Option<SaveOp> {
        match s.trim() {
            "matmul" | "mm" | "linear" => Some(SaveOp::Matmul),
            "sdpa"
            | "attention"
            | "scaled_dot_product_attention"
            | "attention_bshd"
            | "attention_packed" => Some(SaveOp::Sdpa),
            "matmul/2" | "mm/2" => Some(SaveOp::EveryOtherMatmul),
            _ => None,
        }
    }

    /// Whether a region keeping `keep` keeps this call of `self`; `matmuls` counts the
    /// region's matrix products so far (for [`SaveOp::EveryOtherMatmul`]).
    fn kept_in(self, keep: &[SaveOp], matmuls: &mut usize) -> bool {
        if keep.contains(&self) {
            return true;
        }
        if self == SaveOp::Matmul && keep.contains(&SaveOp::EveryOtherMatmul) {
            *matmuls += 1;
            return *matmuls % 2 == 1;
        }
        false
    }
}

impl fmt::Display for SaveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-thread counts of what activation checkpointing did (see [`recompute_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecomputeCounts {
    /// Regions whose forward ran without keeping activations (nodes recorded).
    pub regions: u64,
    /// Regions recomputed in backward.
    pub recomputed: u64,
    /// Kept-op outputs saved by selective regions' forwards.
    pub saved: u64,
    /// Kept-op outputs handed back to recomputes (not computed again).
    pub reused: u64,
    /// Matrix products a recompute did not compute because no backward reads their
    /// outputs ([`unread_output`]).
    pub skipped: u64,
}

/// What checkpointing did on this thread since the last [`reset_recompute_counts`].
pub fn recompute_counts() -> RecomputeCounts {
    COUNTS.with(|c| c.get())
}

/// Zeroes this thread's [`recompute_counts`].
pub fn reset_recompute_counts() {
    COUNTS.with(|c| c.set(RecomputeCounts::default()));
}

/// What a checkpointed region holds from a split backward's input pass
/// ([`crate::autograd::backward_input`], a zero-bubble schedule's I) to its weight pass
/// ([`crate::autograd::WeightGrad::run`], its W). Set per thread ([`set_weight_pass`]);
/// the input pass decides. The gradients are the same bits either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightPass {
    /// The input pass recomputes the region once and keeps the recomputed graph's weight
    /// half (each product's input and its output's gradient) until the weight pass, which
    /// only finishes it: one recompute per backward, and about a plain layer's activations
    /// held in between.
    #[default]
    Keep,
    /// The input pass drops the recomputed graph once it has the region's input gradients;
    /// the weight pass recomputes the region again and backpropagates to its parameters.
    /// In between the region holds what it held before the input pass (its inputs and, for
    /// a selective region, its kept outputs) and the engine the gradient of its output,
    /// for a second recompute and the backward's products into the region's activations
    /// again. PyTorch's non-reentrant checkpoint recomputes once per backward call, so it
    /// behaves this way over a split backward's two calls, and as [`WeightPass::Keep`]
    /// when they run under one `torch.utils.checkpoint.GraphExecGroup`.
    Recompute,
}

impl WeightPass {
    /// The mode's name (`keep`, `recompute`).
    pub fn name(self) -> &'static str {
        match self {
            WeightPass::Keep => "keep",
            WeightPass::Recompute => "recompute",
        }
    }

    /// The mode named `s` ([`WeightPass::name`]).
    pub fn parse(s: &str) -> Option<WeightPass> {
        match s.trim() {
            "keep" => Some(WeightPass::Keep),
            "recompute" => Some(WeightPass::Recompute),
            _ => None,
        }
    }
}

impl fmt::Display for WeightPass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// This thread's [`WeightPass`]: what the split backwards' input passes run on it do
/// with the regions they recompute ([`WeightPass::Keep`] unless set).
pub fn weight_pass() -> WeightPass {
    WEIGHT_PASS.with(Cell::get)
}

/// Sets this thread's [`WeightPass`]; returns the one it replaces.
///
/// ```
/// use tpar_tensor::autograd::backward_input;
/// use tpar_tensor::checkpoint::{checkpoint, recompute_counts, set_weight_pass, WeightPass};
/// use tpar_tensor::Tensor;
/// let x = Tensor::from_vec(vec![1.0f64, -2.0, 0.5, 3.0], [2, 2])?.requires_grad_(true);
/// let w = Tensor::from_vec(vec![0.5f64, -1.0, 2.0, 0.25], [2, 2])?.requires_grad_(true);
/// let w2 = w.clone();
/// let y = checkpoint(&[x.clone()], &[], move |i| i[0].linear(&w2, None)?.silu()?.sum_all())?;
/// let before = set_weight_pass(WeightPass::Recompute);
/// let one = Tensor::from_vec(vec![1.0f64], [])?;
/// let (dx, weights) = backward_input(&[y], &[one], &[x.clone()])?;
/// set_weight_pass(before);
/// let n = recompute_counts().recomputed;
/// weights.run()?; // the region runs again here
/// assert_eq!(recompute_counts().recomputed, n + 1);
/// assert!(dx[0].is_some() && w.grad().is_some());
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
pub fn set_weight_pass(mode: WeightPass) -> WeightPass {
    WEIGHT_PASS.with(|w| w.replace(mode))
}

/// Wall time spent in activation checkpointing's parts, summed over every thread of the
/// process while [`set_region_timing`] is on (see [`region_times`]). A region nested in
/// another one's forward or recompute counts inside the outer one's time too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionTimes {
    /// Regions' forwards (grad recording off, nothing but the kept outputs kept).
    pub forward: Duration,
    /// Regions run again in backward, with grad recording on.
    pub recompute: Duration,
    /// The backward through the recomputed graphs, down to the regions' inputs and
    /// parameters (both passes of a split backward).
    pub backward: Duration,
}

static TIMING: AtomicBool = AtomicBool::new(false);
static FORWARD_NS: AtomicU64 = AtomicU64::new(0);
static RECOMPUTE_NS: AtomicU64 = AtomicU64::new(0);
static BACKWARD_NS: AtomicU64 = AtomicU64::new(0);

/// Turns the process-wide [`region_times`] on or off (off by default: no clock is read).
pub fn set_region_timing(on: bool) {
    TIMING.store(on, Ordering::Relaxed);
}

/// The wall time regions' forwards, recomputes and backwards took since the last
/// [`reset_region_times`], while [`set_region_timing`] was on.
pub fn region_times() -> RegionTimes {
    let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
    RegionTimes { forward: d(&FORWARD_NS), recompute: d(&RECOMPUTE_NS), backward: d(&BACKWARD_NS) }
}

/// Zeroes [`region_times`].
pub fn reset_region_times() {
    for a in [&FORWARD_NS, &RECOMPUTE_NS, &BACKWARD_NS] {
        a.store(0, Ordering::Relaxed);
    }
}

/// Runs `f`, adding its wall time to `slot` when region timing is on.
fn timed<T>(slot: &AtomicU64, f: impl FnOnce() -> T) -> T {
    if !TIMING.load(Ordering::Relaxed) {
        return f();
    }
    let t0 = Instant::now();
    let r = f();
    let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    slot.fetch_add(ns, Ordering::Relaxed);
    r
}

fn count(f: impl FnOnce(&mut RecomputeCounts)) {
    let _ = COUNTS.try_with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

/// One kept output: the op, its operands' shapes, and the value (whatever the op
/// needs back: a tensor, or a tensor and its log-sum-exps).
struct Entry {
    op: SaveOp,
    dims: Vec<Vec<usize>>,
    value: Arc<dyn Any + Send + Sync>,
}

enum Frame {
    Record { keep: Vec<SaveOp>, entries: Vec<Entry>, matmuls: usize },
    Replay { keep: Vec<SaveOp>, entries: Arc<Vec<Entry>>, next: usize, matmuls: usize },
}

/// The tensors requiring a gradient that ops read while a region's forward ran.
#[derive(Default)]
struct Capture {
    ids: HashSet<u64>,
    tensors: Vec<Tensor>,
}

thread_local! {
    /// Region recomputes running on this thread.
    static RECOMPUTING: Cell<usize> = const { Cell::new(0) };
    /// Set by a `CheckpointWrapper`'s region (or a module passing it on) for the next
    /// module `call` to take.
    static UNREAD_REQUEST: Cell<bool> = const { Cell::new(false) };
    /// [`unread_output`] scopes open on this thread (within the innermost region's run).
    static UNREAD_DEPTH: Cell<usize> = const { Cell::new(0) };
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
    static CAPTURES: RefCell<Vec<Capture>> = const { RefCell::new(Vec::new()) };
    /// What split backwards' input passes on this thread do with the regions they
    /// recompute.
    static WEIGHT_PASS: Cell<WeightPass> = const { Cell::new(WeightPass::Keep) };
    static COUNTS: Cell<RecomputeCounts> = const { Cell::new(RecomputeCounts {
        regions: 0, recomputed: 0, saved: 0, reused: 0, skipped: 0,
    }) };
}

/// Asks the next module run through `tpar_nn::call` on this thread to treat its output as
/// one no backward reads (module docs, "Outputs no backward reads"): a checkpointed
/// module's region asks it for that module, and a module whose output is its own
/// output's only source through ops that save nothing (a residual add) passes its own
/// request on this way, just before calling that child. Outside a recompute and a
/// selective region's forward it does nothing.
pub fn request_output_unread() {
    if unread_applies() {
        UNREAD_REQUEST.with(|r| r.set(true));
    }
}

/// Whether an unread output means anything here: in a recompute (it need not be
/// computed), or in a selective region's forward (it need not be kept for the recompute).
fn unread_applies() -> bool {
    RECOMPUTING.with(Cell::get) > 0
        || FRAMES.with(|s| matches!(s.borrow().last(), Some(Frame::Record { .. })))
}

/// Whether an [`unread_output`] scope is open on this thread.
fn unread_now() -> bool {
    UNREAD_DEPTH.with(Cell::get) > 0
}

/// Takes the request [`request_output_unread`] left for the module about
/// to run: `true` once, then `false` until the next request. `tpar_nn::call` takes it
/// before the module's hooks run.
pub fn take_output_unread_request() -> bool {
    UNREAD_REQUEST.with(|r| r.replace(false))
}

/// Runs `f`, whose output no backward will read (module docs): during a recompute the
/// matrix products `f` runs record their nodes but leave their outputs zero; in a
/// selective region's forward they are computed but not kept for the recompute (which
/// will not read them). Elsewhere it is `f()`.
///
/// It is the caller's word that nothing reads the values: a region's function may wrap
/// the ops that make its output when their backward reads only their inputs (a product,
/// an add), never ops whose output another op of the region saves.
///
/// ```
/// use tpar_tensor::checkpoint::{checkpoint, recompute_counts, reset_recompute_counts, unread_output};
/// use tpar_tensor::Tensor;
/// let x = Tensor::from_vec(vec![1.0f64, -2.0, 0.5, 3.0], [2, 2])?.requires_grad_(true);
/// let w = Tensor::from_vec(vec![0.5f64, -1.0, 2.0, 0.25], [2, 2])?.requires_grad_(true);
/// let w2 = w.clone();
/// // The region's output is its last product, whose backward reads silu(x) and w only.
/// let y = checkpoint(&[x.clone()], &[], move |i| {
///     let h = i[0].silu()?;
///     unread_output(|| h.matmul(&w2))
/// })?;
/// reset_recompute_counts();
/// y.sum_all()?.backward()?;
/// assert_eq!(recompute_counts().skipped, 1); // the recompute did not multiply again
/// let (x2, w3) = (x.detach().requires_grad_(true), w.detach().requires_grad_(true));
/// x2.silu()?.matmul(&w3)?.sum_all()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f64>()?, x2.grad().unwrap().to_vec::<f64>()?);
/// assert_eq!(w.grad().unwrap().to_vec::<f64>()?, w3.grad().unwrap().to_vec::<f64>()?);
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
pub fn unread_output<R>(f: impl FnOnce() -> R) -> R {
    if !unread_applies() {
        return f();
    }
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            let _ = UNREAD_DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
    UNREAD_DEPTH.with(|d| d.set(d.get() + 1));
    let _scope = Scope;
    f()
}

/// A matrix product's output of `dims`: zeros where no backward reads it (inside
/// [`unread_output`] during a recompute; counted in [`RecomputeCounts::skipped`]), else
/// `compute()`.
pub(crate) fn product_unless_unread(
    dims: &[usize],
    dtype: DType,
    device: crate::Device,
    compute: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    let skip = device != crate::Device::Meta
        && RECOMPUTING.with(Cell::get) > 0
        && UNREAD_DEPTH.with(Cell::get) > 0;
    if !skip {
        return compute();
    }
    count(|c| c.skipped += 1);
    Tensor::zeros(dims.to_vec(), dtype, device)
}

/// A region's own run (its forward or its recompute) on this thread, with no
/// [`unread_output`] scope or request of an enclosing run in force; restored when
/// dropped.
struct UnreadReset {
    depth: usize,
    request: bool,
}

impl UnreadReset {
    fn enter() -> UnreadReset {
        let depth = UNREAD_DEPTH.with(|d| d.replace(0));
        let request = UNREAD_REQUEST.with(|r| r.replace(false));
        UnreadReset { depth, request }
    }
}

impl Drop for UnreadReset {
    fn drop(&mut self) {
        let _ = UNREAD_REQUEST.try_with(|r| r.set(self.request));
        let _ = UNREAD_DEPTH.try_with(|d| d.set(self.depth));
    }
}

/// The recompute state of this thread while a region recomputes: counted as one more
/// recompute, in a reset [`UnreadReset`]; restored when dropped.
struct RecomputeScope {
    _reset: UnreadReset,
}

impl RecomputeScope {
    fn enter() -> RecomputeScope {
        RECOMPUTING.with(|r| r.set(r.get() + 1));
        RecomputeScope { _reset: UnreadReset::enter() }
    }
}

impl Drop for RecomputeScope {
    fn drop(&mut self) {
        let _ = RECOMPUTING.try_with(|r| r.set(r.get().saturating_sub(1)));
    }
}

/// Called by [`record`] when it records nothing: inside a region's forward, the inputs
/// that require a gradient are tensors from outside the region.
pub(crate) fn note_inputs(inputs: &[&Tensor]) {
    let _ = CAPTURES.try_with(|c| {
        let mut c = c.borrow_mut();
        if let Some(top) = c.last_mut() {
            for t in inputs {
                if t.requires_grad() && top.ids.insert(t.id()) {
                    top.tensors.push((*t).clone());
                }
            }
        }
    });
}

/// Pops the capture frame it pushed when dropped.
struct CaptureGuard;

impl CaptureGuard {
    fn push() -> CaptureGuard {
        CAPTURES.with(|c| c.borrow_mut().push(Capture::default()));
        CaptureGuard
    }

    fn take(self) -> Vec<Tensor> {
        let c = CAPTURES.with(|c| c.borrow_mut().pop()).unwrap_or_default();
        std::mem::forget(self);
        c.tensors
    }
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        let _ = CAPTURES.try_with(|c| c.borrow_mut().pop());
    }
}

/// Pops the selective frame it pushed when dropped.
struct FrameGuard;

impl FrameGuard {
    fn push(f: Frame) -> FrameGuard {
        FRAMES.with(|s| s.borrow_mut().push(f));
        FrameGuard
    }

    fn pop(self) -> Option<Frame> {
        let f = FRAMES.with(|s| s.borrow_mut().pop());
        std::mem::forget(self);
        f
    }
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        let _ = FRAMES.try_with(|s| s.borrow_mut().pop());
    }
}

fn in_selective_region() -> bool {
    FRAMES.try_with(|s| !s.borrow().is_empty()).unwrap_or(false)
}

/// A kept op's output: computed (and, in a selective region's forward, saved), or, in a
/// selective region's recompute, the saved one handed back. The ops that can be kept
/// call this around the computation of their output (not around recording their node).
pub(crate) fn kept<R: Clone + Send + Sync + 'static>(
    op: SaveOp,
    operands: &[&Tensor],
    compute: impl FnOnce() -> Result<R>,
) -> Result<R> {
    enum Act<R> {
        Compute,
        Save,
        Reuse(Result<R>),
    }
    if operands.iter().any(|t| t.device() == crate::Device::Meta) {
        // shape inference (a DTensor op running itself on meta tensors): no output to
        // keep, and no place in the region's count of kept ops
        return compute();
    }
    let act = FRAMES.with(|s| {
        let mut s = s.borrow_mut();
        match s.last_mut() {
            None => Act::Compute,
            // An output no recompute reads (inside `unread_output`) is not kept: it still
            // takes its place in the count of matmuls, in the forward as in the recompute.
            Some(Frame::Record { keep, matmuls, .. }) => match op.kept_in(keep, matmuls) {
                true if !unread_now() => Act::Save,
                _ => Act::Compute,
            },
            Some(Frame::Replay { keep, entries, next, matmuls }) => {
                if !op.kept_in(keep, matmuls) || unread_now() {
                    return Act::Compute;
                }
                let dims: Vec<Vec<usize>> = operands.iter().map(|t| t.dims().to_vec()).collect();
                let r = match entries.get(*next) {
                    None => Err(format!(
                        "the recompute asks for {op} output {} with operands {dims:?}, but the \
                         forward kept only {} outputs",
                        *next + 1,
                        entries.len()
                    )),
                    Some(e) if e.op != op || e.dims != dims => Err(format!(
                        "the recompute asks for {op} with operands {dims:?} where the forward \
                         kept {} with operands {:?} (kept output {} of {})",
                        e.op,
                        e.dims,
                        *next + 1,
                        entries.len()
                    )),
                    Some(e) => e.value.downcast_ref::<R>().cloned().ok_or_else(|| {
                        format!("kept output {} ({op}) holds another type of value", *next + 1)
                    }),
                };
                *next += 1;
                Act::Reuse(r.map_err(|what| TensorError::Recompute { what }))
            }
        }
    });
    match act {
        Act::Compute => compute(),
        Act::Reuse(r) => {
            if r.is_ok() {
                count(|c| c.reused += 1);
            }
            r
        }
        Act::Save => {
            let r = compute()?;
            let dims = operands.iter().map(|t| t.dims().to_vec()).collect();
            let e = Entry { op, dims, value: Arc::new(r.clone()) };
            FRAMES.with(|s| {
                if let Some(Frame::Record { entries, .. }) = s.borrow_mut().last_mut() {
                    entries.push(e);
                }
            });
            count(|c| c.saved += 1);
            Ok(r)
        }
    }
}

/// The region function of a [`checkpoint`].
type RegionFn = dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync;

/// What a region's node needs to recompute it.
struct Region {
    f: Arc<RegionFn>,
    /// The region's inputs, then the outside tensors its ops read.
    inputs: Vec<Tensor>,
    /// How many of `inputs` are the region's own inputs.
    own: usize,
    keep: Vec<SaveOp>,
    /// The kept ops' outputs (selective checkpointing), until a split backward's input
    /// pass has recomputed the region: its weight half then holds what the weight pass
    /// reads, and the outputs only the input half read are freed with the list.
    kept: Mutex<Option<Arc<Vec<Entry>>>>,
    shape: Shape,
    dtype: DType,
    /// The default generator's state when the forward started.
    rng: RngState,
    /// What a split backward's input pass left for the weight pass, until it asks.
    owed: Mutex<Option<Owed>>,
}

/// What a split backward's input pass leaves a region's weight pass: the input indices
/// that pass asks for, with the recomputed graph's parameter half ([`WeightPass::Keep`])
/// or without it, to recompute the region for them ([`WeightPass::Recompute`]).
enum Owed {
    Kept(Vec<usize>, DeferredWithin),
    Dropped(Vec<usize>),
}

/// Runs `f(inputs)` as an activation-checkpointed region (see the module docs): its
/// intermediate activations are not kept, and backward recomputes them by running `f`
/// again. `keep` lists the ops whose outputs are kept instead (selective checkpointing);
/// empty recomputes everything.
///
/// `f` must compute the same thing from the same inputs every time it is called (as any
/// forward does); a recompute that differs in its output's shape or dtype, or in the
/// kept ops it runs, fails the backward with [`TensorError::Recompute`]. With grad
/// recording off, or inside a selective region, it is `f(inputs)`.
///
/// ```
/// use tpar_tensor::{checkpoint::checkpoint, Tensor};
/// let x = Tensor::from_vec(vec![1.0f64, -2.0, 0.5, 3.0], [2, 2])?.requires_grad_(true);
/// let w = Tensor::from_vec(vec![0.5f64, -1.0, 2.0, 0.25], [2, 2])?.requires_grad_(true);
/// let w2 = w.clone();
/// let y = checkpoint(&[x.clone()], &[], move |i| i[0].linear(&w2, None)?.silu()?.sum_all())?;
/// y.backward()?;
/// let (gx, gw) = (x.grad().unwrap(), w.grad().unwrap());
/// // The same as without the checkpoint.
/// let (x2, w3) = (x.detach().requires_grad_(true), w.detach().requires_grad_(true));
/// x2.linear(&w3, None)?.silu()?.sum_all()?.backward()?;
/// assert_eq!(gx.to_vec::<f64>()?, x2.grad().unwrap().to_vec::<f64>()?);
/// assert_eq!(gw.to_vec::<f64>()?, w3.grad().unwrap().to_vec::<f64>()?);
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
pub fn checkpoint<F>(inputs: &[Tensor], keep: &[SaveOp], f: F) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    if !is_grad_enabled() || in_selective_region() {
        return f(inputs);
    }
    let rng = get_rng_state();
    let (out, captured, kept) = {
        let _g = GradModeGuard::new(false);
        let capture = CaptureGuard::push();
        let _reset = UnreadReset::enter();
        let frame = (!keep.is_empty()).then(|| {
            FrameGuard::push(Frame::Record { keep: keep.to_vec(), entries: Vec::new(), matmuls: 0 })
        });
        let out = timed(&FORWARD_NS, || f(inputs))?;
        let kept = match frame.and_then(FrameGuard::pop) {
            Some(Frame::Record { entries, .. }) => entries,
            _ => Vec::new(),
        };
        (out, capture.take(), kept)
    };
    let mut all: Vec<Tensor> = inputs.to_vec();
    let mut ids: HashSet<u64> = inputs.iter().map(|t| t.id()).collect();
    for t in captured {
        if ids.insert(t.id()) {
            all.push(t);
        }
    }
    if !all.iter().any(|t| t.requires_grad()) {
        return Ok(out);
    }
    count(|c| c.regions += 1);
    let region = Region {
        f: Arc::new(f),
        inputs: all.clone(),
        own: inputs.len(),
        keep: keep.to_vec(),
        kept: Mutex::new(Some(Arc::new(kept))),
        shape: out.shape().clone(),
        dtype: out.dtype(),
        rng,
        owed: Mutex::new(None),
    };
    let refs: Vec<&Tensor> = all.iter().collect();
    Ok(record("checkpoint", &refs, out, move |g| region.backward(g)))
}

impl Region {
    /// Recomputes the region and returns the gradients of its node's inputs.
    ///
    /// Called by a split backward's input pass with only some inputs asked for
    /// ([`needs_input_grad`]: the region's inputs, not the parameters), it computes those
    /// now; the weight pass calls it again asking for exactly the rest. Under
    /// [`WeightPass::Keep`] it keeps the recomputed graph's backward for the parameters'
    /// half for that call, which finishes it (the region is recomputed once, and its
    /// weight gradients wait for the weight pass as a plain layer's do); under
    /// [`WeightPass::Recompute`] it drops the recomputed graph, and that call recomputes
    /// the region again.
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let n = self.inputs.len();
        let wants = |i: usize| self.inputs[i].requires_grad() && needs_input_grad(i);
        let asked: Vec<usize> = (0..n).filter(|&i| wants(i)).collect();
        let owed: Vec<usize> =
            (0..n).filter(|&i| self.inputs[i].requires_grad() && !wants(i)).collect();
        // A call asking for other inputs than the input pass left (a whole backward after
        // it) starts afresh.
        let mut weights_again = false;
        match self.owed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(Owed::Kept(later, d)) if later == asked => {
                let (grads, stray) = timed(&BACKWARD_NS, || d.finish())?;
                stray_check(&stray)?;
                let mut out = vec![None; n];
                for (i, gi) in later.into_iter().zip(grads) {
                    out[i] = gi;
                }
                return Ok(out);
            }
            // The weight pass after an input pass that dropped the recomputed graph: the
            // region runs again, its inputs' copies taking no gradient unless asked for
            // (none is, normally), so the backward computes only what reaches the
            // parameters.
            Some(Owed::Dropped(later)) => weights_again = later == asked,
            _ => {}
        }
        let copy_grad =
            |i: usize| self.inputs[i].requires_grad() && (!weights_again || asked.contains(&i));
        let Some((out, targets)) = timed(&RECOMPUTE_NS, || self.recompute(copy_grad))? else {
            return Ok(vec![None; n]);
        };
        if weights_again || owed.is_empty() || asked.is_empty() {
            let (grads, stray) =
                timed(&BACKWARD_NS, || grad_within(&[out], vec![g.clone()], &targets))?;
            stray_check(&stray)?;
            return Ok(grads
                .into_iter()
                .zip(&self.inputs)
                .map(|(g, t)| g.filter(|_| t.requires_grad()))
                .collect());
        }
        let now: Vec<Tensor> = asked.iter().map(|&i| targets[i].clone()).collect();
        let later: Vec<Tensor> = owed.iter().map(|&i| targets[i].clone()).collect();
        let (grads, d) =
            timed(&BACKWARD_NS, || grad_within_split(&[out], vec![g.clone()], &now, &later))?;
        let left = match weight_pass() {
            WeightPass::Keep => {
                // The weight pass finishes the recomputed graph instead of recomputing the
                // region: the kept outputs are no longer read here (the recomputed graph's
                // nodes hold what they saved of them), so a waiting micro-batch of a
                // zero-bubble schedule does not hold them until its weight pass.
                *self.kept.lock().unwrap_or_else(|p| p.into_inner()) = None;
                Owed::Kept(owed, d)
            }
            // The recomputed graph goes with `d`; the kept outputs stay for the weight
            // pass's recompute.
            WeightPass::Recompute => Owed::Dropped(owed),
        };
        *self.owed.lock().unwrap_or_else(|p| p.into_inner()) = Some(left);
        let mut res = vec![None; n];
        for (i, gi) in asked.into_iter().zip(grads) {
            res[i] = gi;
        }
        Ok(res)
    }

    /// Runs the region again with grad recording on: its output, and the tensors its
    /// node's input gradients are taken at (the inputs' copies, requiring a gradient where
    /// `copy_grad` says, then the outside tensors); `None` when the output does not
    /// require a gradient.
    fn recompute(
        &self,
        copy_grad: impl Fn(usize) -> bool,
    ) -> Result<Option<(Tensor, Vec<Tensor>)>> {
        count(|c| c.recomputed += 1);
        let copies: Vec<Tensor> = self.inputs[..self.own]
            .iter()
            .enumerate()
            .map(|(i, t)| t.detach().requires_grad_(copy_grad(i)))
            .collect();
        let out = {
            let _g = GradModeGuard::new(true);
            let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let frame = (!self.keep.is_empty()).then(|| {
                FrameGuard::push(match kept {
                    Some(entries) => {
                        Frame::Replay { keep: self.keep.clone(), entries, next: 0, matmuls: 0 }
                    }
                    // Released by a split backward's input pass, and a later pass asks for
                    // other inputs than that pass owed (its weight half dropped unrun, a
                    // whole backward after it): a selective region that keeps nothing
                    // computes every op again, the same values as the kept ones.
                    None => Frame::Record { keep: Vec::new(), entries: Vec::new(), matmuls: 0 },
                })
            });
            let out = {
                let _scope = RecomputeScope::enter();
                let _rng = RngStateGuard::set(self.rng);
                (self.f)(&copies)?
            };
            if let Some(Frame::Replay { entries, next, .. }) = frame.and_then(FrameGuard::pop) {
                if next != entries.len() {
                    return Err(TensorError::Recompute {
                        what: format!(
                            "the recompute used {next} of the {} outputs the forward kept",
                            entries.len()
                        ),
                    });
                }
            }
            out
        };
        if out.shape() != &self.shape || out.dtype() != self.dtype {
            return Err(TensorError::Recompute {
                what: format!(
                    "the recompute's output is {} {} where the forward's was {} {}",
                    out.dtype().name(),
                    out.shape(),
                    self.dtype.name(),
                    self.shape
                ),
            });
        }
        if !out.requires_grad() {
            return Ok(None);
        }
        let mut targets = copies;
        targets.extend_from_slice(&self.inputs[self.own..]);
        Ok(Some((out, targets)))
    }
}

/// A gradient that reached a leaf outside the region's node inputs is an error.
fn stray_check(stray: &[Tensor]) -> Result<()> {
    match stray.first() {
        None => Ok(()),
        Some(t) => Err(TensorError::Recompute {
            what: format!(
                "the recompute reached a tensor requiring a gradient ({} {}) that no op of \
                 the forward read",
                t.dtype().name(),
                t.shape()
            ),
        }),
    }
}
