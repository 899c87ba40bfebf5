//! Reverse-mode autograd: the graph, `backward`, `grad`, `no_grad` and custom functions.
//!
//! Each op that has an input requiring a gradient records a [`Node`] holding its
//! inputs and a backward closure. `backward()` walks the graph from the output
//! in reverse topological order, summing gradients per tensor, and adds the
//! result into each leaf's `.grad()`. Whether ops record is a per-thread flag,
//! so ranks running as threads never see each other's `no_grad` scopes.
//!
//! While the engine calls a node's backward closure it sets that call's input
//! mask, read with [`needs_input_grad`], so a closure computes only the input
//! gradients asked for. [`backward_input`] uses it to split a backward in two
//! (for zero-bubble pipeline schedules): the gradients of chosen inputs at once,
//! and a [`WeightGrad`] that fills the parameters' `.grad()` later.
//!
//! A backward closure may [`queue_callback`] work for the end of the backward pass it
//! runs in (PyTorch's `queue_callback`): FSDP waits there for the gradient reductions it
//! started asynchronously.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use crate::{Result, Tensor, TensorError};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
    /// The input mask of the backward closure the engine is calling on this thread.
    static INPUT_MASK: RefCell<Option<Vec<bool>>> = const { RefCell::new(None) };
    /// The callbacks queued for the end of the backward pass running on this thread
    /// (`None` outside a backward pass).
    static CALLBACKS: RefCell<Option<Vec<Queued>>> = const { RefCell::new(None) };
    /// The tag of the gradient a replication-aware closure is called with.
    static INCOMING: Cell<Option<ReplicatedGrad>> = const { Cell::new(None) };
    /// The tags a replication-aware closure gives its input gradients.
    static OUTGOING: RefCell<Vec<Option<ReplicatedGrad>>> = const { RefCell::new(Vec::new()) };
}

/// A gradient held in full, identically, by every rank of one group (PyTorch's
/// `Replicate` gradient), as opposed to the default convention for a value replicated
/// over a group: each rank's local gradient is its *contribution* and the gradient is
/// their sum (`Partial(sum)`).
///
/// The tensor layer knows nothing of ranks: `group` is an opaque key of the group
/// (the layer above hashes its members) and `root` tells whether this rank is the one
/// that keeps the value when the gradient is turned back into a contribution
/// ([`demote`](ReplicatedGrad::demote): the value on the root, zeros elsewhere, which
/// sums to the same gradient and costs no communication).
///
/// Tags flow through the engine only where replication is known: a gradient is seeded
/// with one ([`Tensor::backward_with_replicated`]), a replication-aware node gives one
/// ([`record_replication_aware`], [`set_input_grad_replicated`]), and it passes through
/// a plain node only when every recorded input of that node is itself replicated over
/// the same group in forward ([`Tensor::replicated_group`]): a deterministic function of
/// values identical on every rank, fed an identical gradient, gives identical input
/// gradients. Anywhere else (a node with another input, a sum with an untagged
/// gradient, a leaf's `.grad()`, a gradient handed back by [`grad`] or
/// [`backward_input`]) the tag is dropped by demoting the gradient, so untagged
/// gradients always follow the contribution convention and no closure that does not
/// ask sees a tagged one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicatedGrad {
    /// The group's key.
    pub group: u64,
    /// Whether this rank keeps the value when the tag is dropped.
    pub root: bool,
}

impl ReplicatedGrad {
    /// The same gradient in the contribution convention: `g` on the root, zeros elsewhere.
    pub fn demote(&self, g: Tensor) -> Result<Tensor> {
        if self.root {
            Ok(g)
        } else {
            g.zeros_like()
        }
    }
}

/// In the backward closure of a [`record_replication_aware`] node: the tag of the
/// gradient it was called with (`None`: the contribution convention).
pub fn incoming_grad_replicated() -> Option<ReplicatedGrad> {
    INCOMING.with(|c| c.get())
}

/// In the backward closure of a [`record_replication_aware`] node: marks the gradient it
/// returns for input `i` as held in full by every rank of `tag.group`.
pub fn set_input_grad_replicated(i: usize, tag: ReplicatedGrad) {
    OUTGOING.with(|o| {
        let mut o = o.borrow_mut();
        if o.len() <= i {
            o.resize(i + 1, None);
        }
        o[i] = Some(tag);
    });
}

/// Work for the end of a backward pass (see [`queue_callback`]).
pub type Callback = Box<dyn FnOnce() -> Result<()> + Send>;

/// A queued callback and the key it was queued under, if any.
struct Queued {
    key: Option<u64>,
    f: Callback,
}

/// Queues `f` to run once the backward pass running on this thread has finished
/// propagating (after the leaves' `.grad()` are filled), as PyTorch's
/// `Variable._execution_engine.queue_callback`. Callbacks run in the order they were
/// queued, with grad recording off; one may queue more, which run after it. An error
/// from a callback is the backward's error.
///
/// Call it from a backward closure: outside a backward pass it fails with
/// [`TensorError::Autograd`]. A backward split with [`backward_input`] finishes when its
/// [`WeightGrad::run`] does, so callbacks queued during the input pass run at the end of
/// the weight pass (and not at all if the [`WeightGrad`] is dropped).
///
/// ```
/// use std::sync::{Arc, atomic::{AtomicBool, Ordering}};
/// use tpar_tensor::{autograd::{queue_callback, record}, Tensor};
/// let x = Tensor::from_vec(vec![1.0f64, 2.0], [2])?.requires_grad_(true);
/// let done = Arc::new(AtomicBool::new(false));
/// let flag = done.clone();
/// let y = record("watched", &[&x], x.detach(), move |g| {
///     let flag = flag.clone();
///     queue_callback(move || { flag.store(true, Ordering::SeqCst); Ok(()) })?;
///     Ok(vec![Some(g.clone())])
/// });
/// y.sum_all()?.backward()?;
/// assert!(done.load(Ordering::SeqCst) && x.grad().is_some());
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
pub fn queue_callback(f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    push_callback(None, Box::new(f)).map(|_| ())
}

/// [`queue_callback`] under `key`: does nothing and returns `Ok(false)` when a callback
/// with the same key is already queued for this backward pass, so a closure that runs
/// many times per backward (once per module, say) queues its work once.
pub fn queue_callback_once(
    key: u64,
    f: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<bool> {
    push_callback(Some(key), Box::new(f))
}

fn push_callback(key: Option<u64>, f: Callback) -> Result<bool> {
    CALLBACKS.with(|c| match c.borrow_mut().as_mut() {
        None => Err(TensorError::Autograd(
            "queue_callback: no backward pass is running on this thread".into(),
        )),
        Some(q) => {
            if key.is_some() && q.iter().any(|e| e.key == key) {
                return Ok(false);
            }
            q.push(Queued { key, f });
            Ok(true)
        }
    })
}

/// The callback queue of one backward pass: installed on this thread while the pass
/// runs, the previous one (an enclosing pass's) restored when dropped.
struct CallbackScope {
    prev: Option<Option<Vec<Queued>>>,
}

impl CallbackScope {
    /// Opens a pass's queue, holding `carried` (callbacks queued by an earlier part of
    /// the same backward).
    fn open(carried: Vec<Queued>) -> Self {
        CallbackScope { prev: Some(CALLBACKS.with(|c| c.replace(Some(carried)))) }
    }

    /// Takes the callbacks queued so far.
    fn take(&self) -> Vec<Queued> {
        CALLBACKS.with(|c| c.borrow_mut().as_mut().map(std::mem::take).unwrap_or_default())
    }

    /// Runs the queued callbacks in order (and those they queue) until none is left.
    fn run(&self) -> Result<()> {
        loop {
            let next = CALLBACKS.with(|c| {
                let mut c = c.borrow_mut();
                let q = c.as_mut()?;
                (!q.is_empty()).then(|| q.remove(0))
            });
            let Some(cb) = next else { return Ok(()) };
            (cb.f)()?;
        }
    }
}

impl Drop for CallbackScope {
    fn drop(&mut self) {
        let prev = self.prev.take().flatten();
        // At thread teardown the slot may be gone already; nothing is left to restore then.
        let _ = CALLBACKS.try_with(|c| *c.borrow_mut() = prev);
    }
}

/// The signature of a backward function: output gradient in, one optional
/// gradient per input out (`None` for inputs that get no gradient).
pub type BackwardFn = dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

/// A recorded op in the graph.
pub struct Node {
    pub(crate) name: &'static str,
    /// The graph's edges: each input as [`Tensor::edge`] makes it (a leaf that requires
    /// a gradient itself; any other input without its data, so the graph keeps alive
    /// only what the backward closures saved).
    pub(crate) inputs: Vec<Tensor>,
    /// The backward closure and what it saved; `None` once a backward pass that does
    /// not retain the graph has run it ([`Node::release`]).
    backward: Mutex<Option<Arc<BackwardFn>>>,
    /// The group the output is replicated over in forward (see [`ReplicatedGrad`]).
    pub(crate) replicated: Option<u64>,
    /// Whether the closure reads and gives gradient tags itself.
    pub(crate) aware: bool,
    /// Whether every backward pass may run it ([`record_persistent`]): it is never
    /// released.
    persistent: bool,
}

impl Node {
    fn new(
        name: &'static str,
        inputs: &[&Tensor],
        backward: Arc<BackwardFn>,
        replicated: Option<u64>,
        aware: bool,
    ) -> Node {
        Node {
            name,
            inputs: inputs.iter().map(|t| t.edge()).collect(),
            backward: Mutex::new(Some(backward)),
            replicated,
            aware,
            persistent: false,
        }
    }

    /// Calls the backward closure on `g`, or fails when a backward pass freed it.
    pub(crate) fn call(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let f = self.backward.lock().unwrap_or_else(PoisonError::into_inner).clone();
        match f {
            Some(f) => f(g),
            None => Err(TensorError::Autograd(format!(
                "backward through {} a second time: its saved tensors were freed by the \
                 backward pass that ran it (as PyTorch frees them); keep them with \
                 backward_retain_graph (PyTorch's retain_graph=True) to run another \
                 backward through the same graph",
                self.name
            ))),
        }
    }

    /// Drops the backward closure and the tensors it saved (after the pass that ran it,
    /// as PyTorch frees a node's saved tensors unless the graph is retained).
    fn release(&self) {
        if self.persistent {
            return;
        }
        let f = self.backward.lock().unwrap_or_else(PoisonError::into_inner).take();
        drop(f);
    }
}

/// Whether ops on this thread record the graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode when dropped.
pub struct GradModeGuard {
    prev: bool,
}

impl GradModeGuard {
    /// Sets the grad mode of this thread until the guard is dropped.
    pub fn new(enabled: bool) -> Self {
        let prev = GRAD_ENABLED.with(|g| g.replace(enabled));
        GradModeGuard { prev }
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

/// Runs `f` without recording the graph (as `torch.no_grad()`), on this thread.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = GradModeGuard::new(false);
    f()
}

/// Whether the backward closure running now should compute the gradient of its
/// input `i` (PyTorch's `ctx.needs_input_grad[i]`).
///
/// The engine sets a mask on the current thread for each call of a node's
/// backward closure and restores the previous one afterwards (so an engine run
/// nested in a closure, e.g. a closure that calls [`grad`], leaves the outer
/// mask intact). A plain backward asks for every input that requires a gradient;
/// [`backward_input`] and [`WeightGrad::run`] ask for disjoint subsets. Outside
/// such a call (no mask set), and for an `i` past the node's inputs, it is `true`.
///
/// A closure whose input halves cost separate work computes input `i`'s half
/// only when `inputs[i].requires_grad() && needs_input_grad(i)`, returning
/// `None` otherwise. Honoring the mask is optional: a closure that ignores it
/// stays correct. The mask is per thread: read it on the thread the closure was
/// called on, before handing work to other threads.
pub fn needs_input_grad(i: usize) -> bool {
    INPUT_MASK.with(|m| m.borrow().as_ref().is_none_or(|m| m.get(i).copied().unwrap_or(true)))
}

/// Sets this thread's input mask until dropped, then restores the previous one.
struct MaskGuard {
    prev: Option<Vec<bool>>,
}

impl MaskGuard {
    fn new(mask: Option<Vec<bool>>) -> Self {
        MaskGuard { prev: INPUT_MASK.with(|m| m.replace(mask)) }
    }
}

impl Drop for MaskGuard {
    fn drop(&mut self) {
        let prev = self.prev.take();
        // At thread teardown the slot may be gone already; nothing is left to restore then.
        let _ = INPUT_MASK.try_with(|m| *m.borrow_mut() = prev);
    }
}

/// Attaches a backward function to `output`, computed from `inputs`.
///
/// Returns `output` unchanged when grad mode is off or no input requires a
/// gradient. The closure gets the gradient of `output` and must return one
/// entry per input (shapes equal to the inputs'). This is the low-level hook
/// ops, collectives and fused kernels use; see [`Function`] for the trait form.
///
/// The closure may read [`needs_input_grad`] to skip the gradients not asked
/// for. It must be repeatable: [`backward_input`] may call it twice for one
/// backward, with disjoint masks (the input path first, the weights later).
pub fn record(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Tensor {
    record_node(inputs, output, || {
        let mut groups = inputs.iter().map(|t| t.replicated_group());
        let first = groups.next().flatten();
        let replicated = first.filter(|g| groups.all(|o| o == Some(*g)));
        Node::new(name, inputs, Arc::new(backward), replicated, false)
    })
}

/// `output` with the node `make` builds, when grad mode is on and an input requires a
/// gradient; otherwise `output` unchanged (its inputs noted for a checkpointed region).
fn record_node(inputs: &[&Tensor], output: Tensor, make: impl FnOnce() -> Node) -> Tensor {
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        crate::checkpoint::note_inputs(inputs);
        return output;
    }
    output.share(output.shape().clone(), Some(Arc::new(make())))
}

/// [`record`] for a node that outlives a step: the output is a long-lived tensor (FSDP's
/// unsharded view of a parameter) that every step's graph uses, so every backward pass
/// runs this node and none releases it. Its closure must save nothing of one pass.
pub fn record_persistent(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Tensor {
    record_node(inputs, output, || Node {
        persistent: true,
        ..Node::new(name, inputs, Arc::new(backward), None, false)
    })
}

/// [`record`] for a node that knows how its values are laid out over ranks (a
/// redistribution, a distributed loss): its output is replicated over `replicated` in
/// forward (when `Some`; the tensor layer takes the caller's word), and its closure is
/// called with tagged gradients as they are ([`incoming_grad_replicated`]) and may tag
/// the gradients it returns ([`set_input_grad_replicated`]). See [`ReplicatedGrad`].
pub fn record_replication_aware(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    replicated: Option<u64>,
    backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Tensor {
    record_node(inputs, output, || Node::new(name, inputs, Arc::new(backward), replicated, true))
}

/// A differentiable function written by the caller: forward and backward.
///
/// ```
/// use tpar_tensor::{autograd::{apply, Function}, Tensor, Result};
/// /// y = 3x, with a hand-written backward.
/// struct Triple;
/// impl Function for Triple {
///     fn name(&self) -> &'static str { "triple" }
///     fn forward(&mut self, x: &[Tensor]) -> Result<Tensor> { x[0].mul_scalar(3.0) }
///     fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> { Ok(vec![Some(g.mul_scalar(3.0)?)]) }
/// }
/// let x = Tensor::from_vec(vec![1.0f64, 2.0], [2])?.requires_grad_(true);
/// apply(Triple, &[&x])?.sum_all()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![3.0, 3.0]);
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
pub trait Function: Send + Sync + 'static {
    /// A name for the graph and error messages.
    fn name(&self) -> &'static str;
    /// Computes the output; runs with grad mode off. May save what backward needs in `self`.
    fn forward(&mut self, inputs: &[Tensor]) -> Result<Tensor>;
    /// Given the output's gradient, one optional gradient per input.
    ///
    /// [`needs_input_grad`] tells which inputs are asked for in this call; this
    /// may be called more than once per backward (see [`record`]).
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>>;
}

/// Runs a [`Function`]'s forward and records its backward.
pub fn apply<F: Function>(mut f: F, inputs: &[&Tensor]) -> Result<Tensor> {
    let owned: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let out = no_grad(|| f.forward(&owned))?;
    let name = f.name();
    Ok(record(name, inputs, out, move |g| f.backward(g)))
}

/// Reverse topological order of the non-leaf tensors reachable from `roots`,
/// and the leaves that require gradients.
fn topo(roots: &[Tensor]) -> (Vec<Tensor>, Vec<Tensor>) {
    let mut order = Vec::new();
    let mut leaves = Vec::new();
    let mut seen = HashSet::new();
    // Iterative post-order DFS: (tensor, children pushed?)
    let mut stack: Vec<(Tensor, bool)> = roots.iter().map(|t| (t.clone(), false)).collect();
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        match t.node() {
            None => {
                if t.requires_grad() {
                    leaves.push(t.clone());
                }
            }
            Some(node) => {
                let node = node.clone();
                stack.push((t, true));
                for inp in node.inputs.iter().rev() {
                    if inp.requires_grad() && !seen.contains(&inp.id()) {
                        stack.push((inp.clone(), false));
                    }
                }
            }
        }
    }
    order.reverse();
    (order, leaves)
}

/// Tags of the gradients in an engine map that are held in full ([`ReplicatedGrad`]).
type Tags = HashMap<u64, ReplicatedGrad>;

fn accumulate(map: &mut HashMap<u64, Tensor>, id: u64, g: Tensor) -> Result<()> {
    accumulate_tagged(map, &mut Tags::new(), id, g, None)
}

/// Adds `g` (tagged `tag`) into `id`'s gradient. Two gradients with the same tag sum to a
/// gradient with that tag; otherwise the tagged ones are demoted first.
fn accumulate_tagged(
    map: &mut HashMap<u64, Tensor>,
    tags: &mut Tags,
    id: u64,
    g: Tensor,
    tag: Option<ReplicatedGrad>,
) -> Result<()> {
    let (v, t) = match map.remove(&id) {
        None => (g, tag),
        Some(old) => match (tags.remove(&id), tag) {
            (Some(a), Some(b)) if a == b => (old.add(&g)?, Some(a)),
            (a, b) => {
                let old = match a {
                    Some(a) => a.demote(old)?,
                    None => old,
                };
                let g = match b {
                    Some(b) => b.demote(g)?,
                    None => g,
                };
                (old.add(&g)?, None)
            }
        },
    };
    map.insert(id, v);
    if let Some(t) = t {
        tags.insert(id, t);
    }
    Ok(())
}

/// Demotes every tagged gradient of `map` (see [`ReplicatedGrad`]).
fn demote_all(map: &mut HashMap<u64, Tensor>, tags: Tags) -> Result<()> {
    for (id, tag) in tags {
        if let Some(g) = map.remove(&id) {
            map.insert(id, tag.demote(g)?);
        }
    }
    Ok(())
}

/// The root gradients, checked against the roots' shapes and summed per tensor.
fn seed(roots: &[Tensor], grads: Vec<Tensor>) -> Result<HashMap<u64, Tensor>> {
    let mut map = HashMap::new();
    for (r, g) in roots.iter().zip(grads) {
        if g.shape() != r.shape() {
            return Err(TensorError::Autograd(format!(
                "gradient of shape {} given for an output of shape {}",
                g.shape(),
                r.shape()
            )));
        }
        accumulate(&mut map, r.id(), g)?;
    }
    Ok(map)
}

/// Calls `node`'s backward closure on `g` with the input mask `mask`; checks
/// that it returned one entry per input.
fn call_backward(node: &Node, g: &Tensor, mask: Vec<bool>) -> Result<Vec<Option<Tensor>>> {
    // Untagged in; a replication-aware closure may still tag what it returns: demote it.
    let (gs, tags) = call_backward_tagged(node, g, mask, None)?;
    gs.into_iter()
        .zip(tags)
        .map(|(gi, t)| match (gi, t) {
            (Some(gi), Some(t)) => t.demote(gi).map(Some),
            (gi, _) => Ok(gi),
        })
        .collect()
}

/// The input gradients a closure returned, each with its tag.
type TaggedGrads = (Vec<Option<Tensor>>, Vec<Option<ReplicatedGrad>>);

/// [`call_backward`] with the gradient's tag: a replication-aware node's closure sees it
/// and tags its input gradients itself; any other node (called only with a tag when it
/// is replicated over the tag's group) passes the tag on to every input gradient.
fn call_backward_tagged(
    node: &Node,
    g: &Tensor,
    mask: Vec<bool>,
    tag: Option<ReplicatedGrad>,
) -> Result<TaggedGrads> {
    let n = node.inputs.len();
    let (gs, tags) = {
        let _m = MaskGuard::new(Some(mask));
        if node.aware {
            let prev_in = INCOMING.with(|c| c.replace(tag));
            let prev_out = OUTGOING.with(|o| o.replace(vec![None; n]));
            let gs = node.call(g);
            INCOMING.with(|c| c.set(prev_in));
            let mut tags = OUTGOING.with(|o| o.replace(prev_out));
            tags.resize(n, None);
            (gs?, tags)
        } else {
            (node.call(g)?, vec![tag; n])
        }
    };
    if gs.len() != node.inputs.len() {
        return Err(TensorError::Autograd(format!(
            "backward of {} returned {} gradients for {} inputs",
            node.name,
            gs.len(),
            node.inputs.len()
        )));
    }
    Ok((gs, tags))
}

/// Checks the shape of a gradient `node` produced for `inp` and converts it to `inp`'s dtype.
fn checked(node: &Node, inp: &Tensor, gi: Tensor) -> Result<Tensor> {
    if gi.shape() != inp.shape() {
        return Err(TensorError::Autograd(format!(
            "backward of {} produced a gradient of shape {} for an input of shape {}",
            node.name,
            gi.shape(),
            inp.shape()
        )));
    }
    if gi.dtype() != inp.dtype() {
        gi.to_dtype(inp.dtype())
    } else {
        Ok(gi)
    }
}

/// The first pass of a split backward: the tensors from which an input is
/// reachable, and where the work left for the weight pass goes.
struct Split<'a> {
    on_path: &'a HashSet<u64>,
    weight: &'a mut WeightGrad,
}

/// The engine loop: runs the nodes of `order` (reverse topological), each on
/// the summed gradient of its output in `map`, and sums the input gradients
/// into `map`. Gradients of `keep` tensors stay in `map`.
///
/// Without `split`, every node's closure is called with the mask "input
/// requires grad". With it, the closure is called with the mask "input is on
/// the path" (and not called when no input is); the gradients of the other
/// inputs that require one are handed to the weight pass, as seeds when the
/// closure returned them anyway, else as a pending call of the node.
///
/// Unless `retain`, a node's closure (and what it saved) is freed once it has run for
/// the last time: at once, or after the weight pass's call when one is pending.
fn propagate(
    order: &[Tensor],
    map: &mut HashMap<u64, Tensor>,
    tags: &mut Tags,
    keep: &HashSet<u64>,
    mut split: Option<Split<'_>>,
    mut ready: Option<&mut ReadyLeaves>,
    retain: bool,
) -> Result<()> {
    for t in order {
        let Some(node) = t.node() else { continue };
        let kept = keep.contains(&t.id());
        let g = if kept { map.get(&t.id()).cloned() } else { map.remove(&t.id()) };
        let Some(g) = g else { continue };
        let mut tag = if kept { tags.get(&t.id()).copied() } else { tags.remove(&t.id()) };
        let g = match tag {
            Some(tg) if !(node.aware || node.replicated == Some(tg.group)) => {
                tag = None;
                tg.demote(g)?
            }
            _ => g,
        };
        let mask: Vec<bool> = node
            .inputs
            .iter()
            .map(|i| {
                i.requires_grad() && split.as_ref().is_none_or(|s| s.on_path.contains(&i.id()))
            })
            .collect();
        let (gs, gtags) = if split.is_none() || mask.contains(&true) {
            call_backward_tagged(node, &g, mask.clone(), tag)?
        } else {
            (vec![None; node.inputs.len()], vec![None; node.inputs.len()])
        };
        let mut later = Vec::new();
        for (i, ((inp, gi), gt)) in node.inputs.iter().zip(gs).zip(gtags).enumerate() {
            if !inp.requires_grad() {
                continue;
            }
            if mask[i] {
                if let Some(gi) = gi {
                    accumulate_tagged(map, tags, inp.id(), checked(node, inp, gi)?, gt)?;
                }
            } else if let Some(s) = &mut split {
                let slot = s.weight.seeds.len();
                let gi = gi.map(|gi| checked(node, inp, gi)).transpose()?;
                let gi = match (gi, gt) {
                    (Some(gi), Some(gt)) => Some(gt.demote(gi)?),
                    (gi, _) => gi,
                };
                if gi.is_none() {
                    later.push((i, slot));
                }
                s.weight.seeds.push((inp.clone(), gi));
            }
        }
        if let Some(r) = ready.as_deref_mut() {
            for inp in node.inputs.iter().filter(|i| i.requires_grad()) {
                r.edge_done(inp.id(), map, tags)?;
            }
        }
        if let (false, Some(s)) = (later.is_empty(), &mut split) {
            // The weight pass calls the closure again, untagged (and frees it then).
            let grad = match tag {
                Some(tg) => tg.demote(g)?,
                None => g,
            };
            s.weight.pending.push(Pending { node: node.clone(), grad, slots: later });
        } else if !retain {
            node.release();
        }
    }
    Ok(())
}

/// Propagates `grads` (one per root) back through the graph, freeing each node it
/// runs unless `retain`. Returns the gradients of the leaves and of the `keep` tensors.
fn run(
    roots: &[Tensor],
    grads: Vec<Tensor>,
    keep: &HashSet<u64>,
    retain: bool,
) -> Result<(Vec<Tensor>, HashMap<u64, Tensor>)> {
    run_tagged(roots, grads, Tags::new(), keep, retain)
}

/// [`run`] with some roots' gradients tagged (`tags`, by root id). The gradients
/// returned are all in the contribution convention.
fn run_tagged(
    roots: &[Tensor],
    grads: Vec<Tensor>,
    mut tags: Tags,
    keep: &HashSet<u64>,
    retain: bool,
) -> Result<(Vec<Tensor>, HashMap<u64, Tensor>)> {
    let _g = GradModeGuard::new(false);
    let _m = MaskGuard::new(None);
    let mut map = seed(roots, grads)?;
    let (order, leaves) = topo(roots);
    propagate(&order, &mut map, &mut tags, keep, None, None, retain)?;
    demote_all(&mut map, tags)?;
    Ok((leaves, map))
}

/// Propagates `grads` (one per root) and adds the result into every leaf's `.grad()`.
fn run_into_leaves(roots: &[Tensor], grads: Vec<Tensor>, retain: bool) -> Result<()> {
    run_into_leaves_tagged(roots, grads, Tags::new(), retain)
}

/// [`run_into_leaves`] with some roots' gradients tagged. A leaf with a post-accumulate
/// hook gets its gradient as soon as the last node that feeds it has run (its hooks run
/// then, while the pass goes on); the others at the end. Either way a leaf receives the
/// same sum, added once.
fn run_into_leaves_tagged(
    roots: &[Tensor],
    grads: Vec<Tensor>,
    mut tags: Tags,
    retain: bool,
) -> Result<()> {
    let _g = GradModeGuard::new(false);
    let _m = MaskGuard::new(None);
    let mut map = seed(roots, grads)?;
    let (order, leaves) = topo(roots);
    let mut ready = ReadyLeaves::new(&order, &leaves);
    propagate(&order, &mut map, &mut tags, &HashSet::new(), None, Some(&mut ready), retain)?;
    demote_all(&mut map, tags)?;
    for leaf in leaves {
        if let Some(g) = map.remove(&leaf.id()) {
            leaf.accumulate_grad(g)?;
        }
    }
    Ok(())
}

/// The leaves with post-accumulate hooks of one backward pass, each with the number of
/// graph edges (node inputs) still to deliver its gradient.
struct ReadyLeaves {
    pending: HashMap<u64, (Tensor, usize)>,
}

impl ReadyLeaves {
    fn new(order: &[Tensor], leaves: &[Tensor]) -> ReadyLeaves {
        let mut pending: HashMap<u64, (Tensor, usize)> = leaves
            .iter()
            .filter(|l| l.has_post_grad_hooks())
            .map(|l| (l.id(), (l.clone(), 0)))
            .collect();
        if !pending.is_empty() {
            for t in order {
                let Some(node) = t.node() else { continue };
                for inp in node.inputs.iter().filter(|i| i.requires_grad()) {
                    if let Some(e) = pending.get_mut(&inp.id()) {
                        e.1 += 1;
                    }
                }
            }
        }
        ReadyLeaves { pending }
    }

    /// One edge into `id` has been processed: on the last, the leaf's gradient leaves
    /// the engine's map for the leaf (demoted if tagged, as at the end of a pass).
    fn edge_done(
        &mut self,
        id: u64,
        map: &mut HashMap<u64, Tensor>,
        tags: &mut Tags,
    ) -> Result<()> {
        let Some(e) = self.pending.get_mut(&id) else { return Ok(()) };
        e.1 -= 1;
        if e.1 > 0 {
            return Ok(());
        }
        let Some((leaf, _)) = self.pending.remove(&id) else { return Ok(()) };
        if let Some(g) = map.remove(&id) {
            let g = match tags.remove(&id) {
                Some(tg) => tg.demote(g)?,
                None => g,
            };
            leaf.accumulate_grad(g)?;
        }
        Ok(())
    }
}

/// Runs one backward pass `f` with its own callback queue (holding `carried`), then the
/// callbacks queued during it, with grad recording off.
fn with_callbacks<R>(carried: Vec<Queued>, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let scope = CallbackScope::open(carried);
    let out = f()?;
    let _g = GradModeGuard::new(false);
    scope.run()?;
    Ok(out)
}

impl Tensor {
    /// Backpropagates from this scalar, adding into every leaf's `.grad()`.
    ///
    /// As in PyTorch, each node's saved tensors are freed as soon as the pass has run
    /// it, so activations go while the pass walks back and a second backward through
    /// the same graph is an error naming the node;
    /// [`backward_retain_graph`](Self::backward_retain_graph) keeps them.
    ///
    /// ```
    /// use tpar_tensor::{Tensor, DType, Device};
    /// let x = Tensor::full([3], 2.0, DType::F32, Device::Cpu)?.requires_grad_(true);
    /// let y = x.mul(&x)?.sum_all()?; // saves x for its backward
    /// y.backward_retain_graph(None)?;
    /// y.backward()?; // the saved x is still there; freed after this pass
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![8.0; 3]);
    /// assert!(y.backward().unwrap_err().to_string().contains("second time"));
    /// # Ok::<(), tpar_tensor::TensorError>(())
    /// ```
    pub fn backward(&self) -> Result<()> {
        self.backward_with(&self.ones_for_backward()?)
    }

    /// Backpropagates a given output gradient, adding into every leaf's `.grad()`
    /// (freeing saved tensors as [`backward`](Self::backward) does).
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        self.backward_impl(grad, false)
    }

    /// [`backward`](Self::backward) (`grad: None`, for a one-element output) or
    /// [`backward_with`](Self::backward_with) (`Some`), keeping every node's saved tensors
    /// for another backward through the same graph: PyTorch's
    /// `backward(retain_graph=True)`.
    pub fn backward_retain_graph(&self, grad: Option<&Tensor>) -> Result<()> {
        match grad {
            Some(g) => self.backward_impl(g, true),
            None => self.backward_impl(&self.ones_for_backward()?, true),
        }
    }

    /// The gradient `backward()` seeds: one, for a one-element output.
    fn ones_for_backward(&self) -> Result<Tensor> {
        if self.numel() != 1 {
            return Err(TensorError::Autograd(format!(
                "backward() needs a one-element output, got shape {}; use backward_with",
                self.shape()
            )));
        }
        Tensor::full(self.shape().clone(), 1.0, self.dtype(), self.device())
    }

    fn backward_impl(&self, grad: &Tensor, retain: bool) -> Result<()> {
        if !self.requires_grad() {
            return Err(TensorError::Autograd(
                "the tensor does not require grad and has no grad_fn".into(),
            ));
        }
        with_callbacks(Vec::new(), || {
            run_into_leaves(std::slice::from_ref(self), vec![grad.detach()], retain)
        })
    }

    /// As [`backward_with`](Self::backward_with), with `grad` held in full by every rank
    /// of `tag.group` (see [`ReplicatedGrad`]): where the graph is replication-aware the
    /// gradient stays whole and costs no reduction; anywhere else it is demoted, which
    /// gives exactly what `backward_with(tag.demote(grad))` gives.
    pub fn backward_with_replicated(&self, grad: &Tensor, tag: ReplicatedGrad) -> Result<()> {
        if !self.requires_grad() {
            return Err(TensorError::Autograd(
                "the tensor does not require grad and has no grad_fn".into(),
            ));
        }
        let tags = Tags::from([(self.id(), tag)]);
        with_callbacks(Vec::new(), || {
            run_into_leaves_tagged(std::slice::from_ref(self), vec![grad.detach()], tags, false)
        })
    }

    /// The group this tensor is replicated over in forward, when known: the output of a
    /// replication-aware node that says so ([`record_replication_aware`]), or of a node
    /// all of whose recorded inputs are replicated over that group. `None` for leaves.
    pub fn replicated_group(&self) -> Option<u64> {
        self.node().and_then(|n| n.replicated)
    }
}

/// Gradients of `outputs` (weighted by `grad_outputs`) with respect to `inputs`,
/// returned rather than accumulated (as `torch.autograd.grad`). An input that
/// does not influence the outputs gets `None`.
///
/// As `torch.autograd.grad` by default (`retain_graph=False`), each node's saved
/// tensors are freed once the pass has run it: a second pass through the same graph
/// is an error naming the node. [`grad_retain_graph`] keeps them.
///
/// ```
/// use tpar_tensor::{autograd, DType, Device, Tensor};
/// let x = Tensor::full([2], 3.0, DType::F64, Device::Cpu)?.requires_grad_(true);
/// let y = x.square()?.sum_all()?;
/// let one = Tensor::full([], 1.0, DType::F64, Device::Cpu)?;
/// let g = autograd::grad(&[y.clone()], &[one.clone()], &[x.clone()])?;
/// assert_eq!(g[0].as_ref().unwrap().to_vec::<f64>()?, vec![6.0, 6.0]);
/// assert!(autograd::grad(&[y], &[one], &[x]).is_err()); // the graph was freed
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
pub fn grad(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
) -> Result<Vec<Option<Tensor>>> {
    grad_impl(outputs, grad_outputs, inputs, false)
}

/// [`grad`], keeping every node's saved tensors for another pass through the same
/// graph: `torch.autograd.grad(..., retain_graph=True)`.
pub fn grad_retain_graph(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
) -> Result<Vec<Option<Tensor>>> {
    grad_impl(outputs, grad_outputs, inputs, true)
}

fn grad_impl(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
    retain: bool,
) -> Result<Vec<Option<Tensor>>> {
    if outputs.len() != grad_outputs.len() {
        return Err(TensorError::Autograd(format!(
            "{} outputs but {} output gradients",
            outputs.len(),
            grad_outputs.len()
        )));
    }
    let keep: HashSet<u64> = inputs.iter().map(|t| t.id()).collect();
    let grads = grad_outputs.iter().map(|g| g.detach()).collect();
    let (_, map) = with_callbacks(Vec::new(), || run(outputs, grads, &keep, retain))?;
    Ok(inputs.iter().map(|t| map.get(&t.id()).cloned()).collect())
}

/// The gradients of `outputs` (weighted by `grads`) with respect to `inputs`, computed
/// inside the backward pass running on this thread (an activation-checkpointed region's
/// recompute): the walk treats `inputs` as leaves (the graph beyond them is the enclosing
/// pass's), and callbacks queued by the closures it calls join the enclosing pass's queue.
/// Also returns the other leaves that requiring a gradient got one (the caller decides
/// what a gradient reaching past `inputs` means).
pub(crate) fn grad_within(
    outputs: &[Tensor],
    grads: Vec<Tensor>,
    inputs: &[Tensor],
) -> Result<(Vec<Option<Tensor>>, Vec<Tensor>)> {
    let _g = GradModeGuard::new(false);
    let _m = MaskGuard::new(None);
    let stop: HashSet<u64> = inputs.iter().map(|t| t.id()).collect();
    let mut map = seed(outputs, grads)?;
    let mut tags = Tags::new();
    let (order, leaves) = topo_until(outputs, &stop);
    propagate(&order, &mut map, &mut tags, &HashSet::new(), None, None, false)?;
    demote_all(&mut map, tags)?;
    let stray = leaves.into_iter().filter(|l| !stop.contains(&l.id()) && map.contains_key(&l.id()));
    let stray = stray.collect();
    Ok((inputs.iter().map(|t| map.remove(&t.id())).collect(), stray))
}

/// The input half of a split backward over `order` (the reverse topological order of
/// `roots`, whose gradients are seeded in `map`): only the nodes on a path to `targets`
/// run, each asked for its inputs on the path; root gradients off the path and the
/// node calls owed to inputs off it are set aside in the returned [`WeightGrad`].
fn input_pass(
    order: Vec<Tensor>,
    roots: &[Tensor],
    targets: &HashSet<u64>,
    map: &mut HashMap<u64, Tensor>,
) -> Result<WeightGrad> {
    // Reverse topological order lists consumers first: walk it backwards so a
    // node's inputs are settled before the node.
    let mut on_path = targets.clone();
    for t in order.iter().rev() {
        let Some(node) = t.node() else { continue };
        if node.inputs.iter().any(|i| i.requires_grad() && on_path.contains(&i.id())) {
            on_path.insert(t.id());
        }
    }
    let mut weight = WeightGrad { seeds: Vec::new(), pending: Vec::new(), callbacks: Vec::new() };
    for r in roots {
        if !on_path.contains(&r.id()) {
            if let Some(g) = map.remove(&r.id()) {
                weight.seeds.push((r.clone(), Some(g)));
            }
        }
    }
    let order: Vec<Tensor> = order.into_iter().filter(|t| on_path.contains(&t.id())).collect();
    let split = Split { on_path: &on_path, weight: &mut weight };
    let mut tags = Tags::new();
    propagate(&order, map, &mut tags, targets, Some(split), None, false)?;
    demote_all(map, tags)?;
    Ok(weight)
}

/// [`grad_within`] split in two as [`backward_input`] splits a backward: the gradients of
/// `now` at once (only the nodes on a path to them run, each asked for its inputs on the
/// path), and a [`DeferredWithin`] that computes those of `later` when finished (the
/// weight half of the nodes, and the rest of the graph down to `now` and `later`).
pub(crate) fn grad_within_split(
    outputs: &[Tensor],
    grads: Vec<Tensor>,
    now: &[Tensor],
    later: &[Tensor],
) -> Result<(Vec<Option<Tensor>>, DeferredWithin)> {
    let _g = GradModeGuard::new(false);
    let _m = MaskGuard::new(None);
    let stop: HashSet<u64> = now.iter().chain(later).map(|t| t.id()).collect();
    let mut map = seed(outputs, grads)?;
    let (order, _) = topo_until(outputs, &stop);
    let targets: HashSet<u64> = now.iter().filter(|t| t.requires_grad()).map(|t| t.id()).collect();
    let weight = input_pass(order, outputs, &targets, &mut map)?;
    let got = now.iter().map(|t| map.get(&t.id()).cloned()).collect();
    Ok((got, DeferredWithin { weight, stop, later: later.to_vec() }))
}

/// The deferred half of a [`grad_within_split`].
pub(crate) struct DeferredWithin {
    weight: WeightGrad,
    stop: HashSet<u64>,
    later: Vec<Tensor>,
}

impl DeferredWithin {
    /// The gradients of the split's `later` tensors, and the other leaves that got one (as
    /// [`grad_within`] returns them).
    pub(crate) fn finish(self) -> Result<(Vec<Option<Tensor>>, Vec<Tensor>)> {
        let _g = GradModeGuard::new(false);
        let _m = MaskGuard::new(None);
        let DeferredWithin { weight, stop, later } = self;
        let (roots, grads) = WeightGrad::settle(weight.seeds, weight.pending)?;
        if roots.is_empty() {
            return Ok((vec![None; later.len()], Vec::new()));
        }
        let mut map = seed(&roots, grads)?;
        let mut tags = Tags::new();
        let (order, leaves) = topo_until(&roots, &stop);
        propagate(&order, &mut map, &mut tags, &HashSet::new(), None, None, false)?;
        demote_all(&mut map, tags)?;
        let stray =
            leaves.into_iter().filter(|l| !stop.contains(&l.id()) && map.contains_key(&l.id()));
        let stray = stray.collect();
        Ok((later.iter().map(|t| map.remove(&t.id())).collect(), stray))
    }
}

/// [`topo`] with the tensors of `stop` taken as leaves (not expanded).
fn topo_until(roots: &[Tensor], stop: &HashSet<u64>) -> (Vec<Tensor>, Vec<Tensor>) {
    let mut order = Vec::new();
    let mut leaves = Vec::new();
    let mut seen = HashSet::new();
    let mut stack: Vec<(Tensor, bool)> = roots.iter().map(|t| (t.clone(), false)).collect();
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        match t.node().filter(|_| !stop.contains(&t.id())) {
            None => {
                if t.requires_grad() {
                    leaves.push(t.clone());
                }
            }
            Some(node) => {
                let node = node.clone();
                stack.push((t, true));
                for inp in node.inputs.iter().rev() {
                    if inp.requires_grad() && !seen.contains(&inp.id()) {
                        stack.push((inp.clone(), false));
                    }
                }
            }
        }
    }
    order.reverse();
    (order, leaves)
}

/// The input gradients of a split backward now, and the parameter gradients
/// later (the I and W halves of a zero-bubble pipeline schedule).
///
/// Computes the gradients of `roots` (weighted by `grad_roots`, one per root,
/// of the root's shape) with respect to `inputs`, returned rather than
/// accumulated (as [`grad`]); an input the roots do not depend on, or that does
/// not require a gradient, gets `None`. Every root must require a gradient.
///
/// Only the nodes on the path run now: those reachable from the roots from
/// which one of `inputs` can be reached. Each is called once, with
/// [`needs_input_grad`] true for its inputs on the path (or in `inputs`) that
/// require a gradient. The rest of the backward goes into the returned
/// [`WeightGrad`]:
///
/// - a gradient a node on the path returned for an input off the path (its
///   closure ignored the mask) is kept as it is, so such a closure runs once;
/// - for an input off the path that got `None` (the closure honored the mask),
///   the node and its output gradient are kept, and [`WeightGrad::run`] calls
///   the closure again with the mask set to those inputs only. A closure may
///   thus be called twice for one backward, with disjoint masks: it must be
///   repeatable (no state consumed by the first call);
/// - roots off the path (those from which no input can be reached) keep their
///   gradients as they are.
///
/// [`WeightGrad::run`] then sums these gradients per tensor and propagates them
/// through the rest of the graph as [`Tensor::backward_with`] does, adding into
/// each leaf's `.grad()`. Together the two passes compute what a full backward
/// computes, each tensor's gradient summed over all its uses before it
/// propagates; `inputs`' `.grad()` is not touched. When no input is reachable
/// (e.g. `inputs` is empty), this pass does nothing and the [`WeightGrad`] does
/// the whole backward. Both passes run with grad recording off.
///
/// ```
/// use tpar_tensor::{autograd::backward_input, Tensor};
/// // A pipeline stage: y = silu(x W1^T) W2^T, with x received from the previous stage.
/// let x = Tensor::from_vec(vec![1.0f64, -2.0, 0.5, 3.0], [2, 2])?.requires_grad_(true);
/// let w1 = Tensor::from_vec(vec![0.5f64, -1.0, 2.0, 0.25], [2, 2])?.requires_grad_(true);
/// let w2 = Tensor::from_vec(vec![1.0f64, 1.5, -0.5, 2.0], [2, 2])?.requires_grad_(true);
/// let y = x.linear(&w1, None)?.silu()?.linear(&w2, None)?;
/// let dy = Tensor::full([2, 2], 1.0, y.dtype(), y.device())?;
/// // I: the input gradient, sent to the previous stage at once.
/// let (dx, weights) = backward_input(&[y], &[dy], &[x.clone()])?;
/// assert_eq!(dx[0].as_ref().unwrap().dims(), &[2, 2]);
/// assert!(w1.grad().is_none() && w2.grad().is_none());
/// // W: later, when the schedule has a bubble.
/// weights.run()?;
/// assert!(w1.grad().is_some() && w2.grad().is_some() && x.grad().is_none());
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
pub fn backward_input(
    roots: &[Tensor],
    grad_roots: &[Tensor],
    inputs: &[Tensor],
) -> Result<(Vec<Option<Tensor>>, WeightGrad)> {
    if roots.len() != grad_roots.len() {
        return Err(TensorError::Autograd(format!(
            "{} roots but {} root gradients",
            roots.len(),
            grad_roots.len()
        )));
    }
    if let Some(i) = roots.iter().position(|r| !r.requires_grad()) {
        return Err(TensorError::Autograd(format!(
            "root {i} does not require grad and has no grad_fn"
        )));
    }
    let _g = GradModeGuard::new(false);
    let _m = MaskGuard::new(None);
    let scope = CallbackScope::open(Vec::new());
    let mut map = seed(roots, grad_roots.iter().map(|g| g.detach()).collect())?;
    let (order, _) = topo(roots);
    let targets: HashSet<u64> =
        inputs.iter().filter(|t| t.requires_grad()).map(|t| t.id()).collect();
    let mut weight = input_pass(order, roots, &targets, &mut map)?;
    // The backward ends with the weight pass: its callbacks wait for it.
    weight.callbacks = scope.take();
    Ok((inputs.iter().map(|t| map.get(&t.id()).cloned()).collect(), weight))
}

/// A node call left for the weight pass: the node, its output's gradient, and
/// which of its inputs it still owes, each with the seed slot it fills.
struct Pending {
    node: Arc<Node>,
    grad: Tensor,
    /// `(input index, index in WeightGrad::seeds)`.
    slots: Vec<(usize, usize)>,
}

/// The deferred half of a [`backward_input`]: the parameter gradients.
///
/// Holds the gradients already computed for tensors off the input path and the
/// node calls still owed for them (each with its output gradient, so the
/// memory of those gradients and of the nodes' saved tensors stays alive until
/// [`WeightGrad::run`]). It is `Send`: the weight pass may run on another
/// thread. Dropping it without running skips the parameter gradients.
#[must_use = "the parameter gradients are only computed by WeightGrad::run"]
pub struct WeightGrad {
    /// Gradients of tensors off the input path, in the order the first pass
    /// produced them; `None` until the pending call that owes it runs.
    seeds: Vec<(Tensor, Option<Tensor>)>,
    pending: Vec<Pending>,
    /// Callbacks the input pass queued: they run at the end of this pass.
    callbacks: Vec<Queued>,
}

impl WeightGrad {
    /// Whether there is nothing left to do (no gradient flows to a tensor off the input
    /// path, and the input pass queued no callback).
    pub fn is_empty(&self) -> bool {
        self.seeds.is_empty() && self.callbacks.is_empty()
    }

    /// Runs the weight pass: calls each pending node's backward closure with the
    /// mask set to the inputs it owes, sums all gradients per tensor, then
    /// propagates them at once through the rest of the graph as
    /// [`Tensor::backward_with`] does, adding into each leaf's `.grad()` (on top
    /// of what is there, so micro-batches accumulate). Runs with grad recording off.
    /// Then the callbacks queued during either pass run ([`queue_callback`]).
    pub fn run(self) -> Result<()> {
        let WeightGrad { seeds, pending, callbacks } = self;
        with_callbacks(callbacks, || Self::propagate(seeds, pending))
    }

    fn propagate(seeds: Vec<(Tensor, Option<Tensor>)>, pending: Vec<Pending>) -> Result<()> {
        let _g = GradModeGuard::new(false);
        let _m = MaskGuard::new(None);
        let (roots, grads) = Self::settle(seeds, pending)?;
        if roots.is_empty() {
            return Ok(());
        }
        run_into_leaves(&roots, grads, false)
    }

    /// Runs the pending node calls and sums the gradients per tensor: the roots the rest
    /// of the weight pass propagates from, with their gradients.
    fn settle(
        mut seeds: Vec<(Tensor, Option<Tensor>)>,
        pending: Vec<Pending>,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        for p in pending {
            let mut mask = vec![false; p.node.inputs.len()];
            for &(i, _) in &p.slots {
                mask[i] = true;
            }
            let mut gs = call_backward(&p.node, &p.grad, mask)?;
            // Its last call: what it saved goes.
            p.node.release();
            drop(p.grad);
            for (i, slot) in p.slots {
                if let Some(gi) = gs[i].take() {
                    seeds[slot].1 = Some(checked(&p.node, &p.node.inputs[i], gi)?);
                }
            }
        }
        // Sum per tensor, in the order the gradients were produced.
        let mut roots: Vec<Tensor> = Vec::new();
        let mut grads: Vec<Tensor> = Vec::new();
        let mut index: HashMap<u64, usize> = HashMap::new();
        for (t, g) in seeds {
            let Some(g) = g else { continue };
            match index.get(&t.id()) {
                Some(&k) => grads[k] = grads[k].add(&g)?,
                None => {
                    index.insert(t.id(), roots.len());
                    roots.push(t);
                    grads.push(g);
                }
            }
        }
        Ok((roots, grads))
    }
}

impl std::fmt::Debug for WeightGrad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pending: Vec<&str> = self.pending.iter().map(|p| p.node.name).collect();
        f.debug_struct("WeightGrad")
            .field("seeds", &self.seeds.len())
            .field("pending", &pending)
            .field("callbacks", &self.callbacks.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Rng};

    fn randn(dims: &[usize], rng: &mut Rng) -> Tensor {
        Tensor::randn(dims.to_vec(), DType::F64, rng).unwrap().requires_grad_(true)
    }

    /// Which gradients `t`'s backward closure returns when called with `mask`.
    fn returned(t: &Tensor, mask: &[bool]) -> Vec<bool> {
        let node = t.node().expect("a recorded tensor");
        let g = Tensor::ones(t.dims().to_vec(), t.dtype(), t.device()).unwrap();
        let _g = GradModeGuard::new(false);
        call_backward(node, &g, mask.to_vec()).unwrap().iter().map(Option::is_some).collect()
    }

    #[test]
    fn heavy_closures_honor_the_mask() {
        let mut rng = Rng::new(1);
        let x = randn(&[3, 4], &mut rng);
        let x3 = randn(&[2, 3, 4], &mut rng);
        let w = randn(&[2, 4], &mut rng);
        let b = randn(&[2], &mut rng);
        let mm = [
            x.matmul_t(&w, false, true).unwrap(),
            x3.matmul_t(&w, false, true).unwrap(),
            x3.matmul(&w.reshape([4, 2]).unwrap()).unwrap(),
            x.matmul_t(&x, true, false).unwrap(),
        ];
        let lin = x.linear(&w, None).unwrap();
        let elementwise = [
            lin.add(&b).unwrap(),
            lin.sub(&b).unwrap(),
            lin.mul(&b).unwrap(),
            lin.div(&b).unwrap(),
            lin.pow(&b).unwrap(),
        ];
        for t in mm.iter().chain(&elementwise) {
            let name = t.grad_fn_name();
            for mask in [[true, false], [false, true], [true, true]] {
                assert_eq!(returned(t, &mask), mask, "{name:?} with {mask:?}");
            }
        }
        let cat = Tensor::cat(&[x.clone(), w.clone(), x.clone()], 0).unwrap();
        assert_eq!(returned(&cat, &[false, true, false]), [false, true, false]);
        assert_eq!(returned(&cat, &[true, false, true]), [true, false, true]);
        let ids = Tensor::from_vec(vec![1i64, 0], [2]).unwrap();
        let e = Tensor::embedding(&ids, &w).unwrap();
        assert_eq!(returned(&e, &[false]), [false]);
        assert_eq!(returned(&e, &[true]), [true]);
        // Called outside the engine (no mask), a closure computes every half.
        let g = Tensor::ones([3, 2], DType::F64, crate::Device::Cpu).unwrap();
        let gs = mm[0].node().unwrap().call(&g).unwrap();
        assert!(gs.iter().all(Option::is_some));
    }

    #[test]
    fn mask_guards_nest_and_restore() {
        assert!(needs_input_grad(0));
        {
            let _a = MaskGuard::new(Some(vec![true, false]));
            assert!(needs_input_grad(0) && !needs_input_grad(1) && needs_input_grad(2));
            {
                let _b = MaskGuard::new(None);
                assert!(needs_input_grad(1));
            }
            {
                let _b = MaskGuard::new(Some(vec![false]));
                assert!(!needs_input_grad(0));
            }
            assert!(needs_input_grad(0) && !needs_input_grad(1));
        }
        assert!(needs_input_grad(1));
        let r = std::panic::catch_unwind(|| {
            let _a = MaskGuard::new(Some(vec![false]));
            panic!("inside a closure");
        });
        assert!(r.is_err() && needs_input_grad(0));
    }

    /// An identity on `x` whose backward queues a callback (once per key, if given)
    /// that appends `tag` to `log`, after checking that `leaf` already has its gradient.
    fn queuing(
        x: &Tensor,
        leaf: &Tensor,
        tag: &'static str,
        key: Option<u64>,
        log: &Arc<std::sync::Mutex<Vec<String>>>,
    ) -> Tensor {
        let (leaf, log) = (leaf.clone(), log.clone());
        record("queuing", &[x], x.detach(), move |g| {
            let (leaf, log) = (leaf.clone(), log.clone());
            let cb = move || {
                let seen = if leaf.grad().is_some() { "after" } else { "before" };
                log.lock().unwrap().push(format!("{tag} {seen}"));
                Ok(())
            };
            match key {
                Some(k) => {
                    queue_callback_once(k, cb)?;
                }
                None => queue_callback(cb)?,
            }
            Ok(vec![Some(g.clone())])
        })
    }

    #[test]
    fn callbacks_run_after_the_leaves_in_order_and_once_per_key() {
        let mut rng = Rng::new(3);
        let x = randn(&[3], &mut rng);
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let a = queuing(&x, &x, "a", None, &log);
        let b = queuing(&a, &x, "b", Some(7), &log);
        let c = queuing(&b, &x, "c", Some(7), &log);
        c.sum_all().unwrap().backward().unwrap();
        // c's closure runs first (reverse order) and queues under key 7; b's is skipped.
        assert_eq!(*log.lock().unwrap(), ["c after", "a after"]);
        // Outside a backward pass there is nowhere to queue.
        assert!(queue_callback(|| Ok(())).is_err());
        // A failing callback fails the backward.
        let y = record("failing", &[&x], x.detach(), |g| {
            queue_callback(|| Err(TensorError::Autograd("callback failed".into())))?;
            Ok(vec![Some(g.clone())])
        });
        let e = y.sum_all().unwrap().backward().unwrap_err();
        assert!(e.to_string().contains("callback failed"), "{e}");
    }

    #[test]
    fn callbacks_of_a_split_backward_run_after_the_weight_pass() {
        let mut rng = Rng::new(4);
        let (x, w) = (randn(&[2, 3], &mut rng), randn(&[4, 3], &mut rng));
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let y = queuing(&x.linear(&w, None).unwrap(), &w, "y", None, &log);
        let g = Tensor::ones([2, 4], DType::F64, crate::Device::Cpu).unwrap();
        let (_, weights) = backward_input(&[y], &[g], std::slice::from_ref(&x)).unwrap();
        assert!(log.lock().unwrap().is_empty(), "ran before the weight pass");
        assert!(!weights.is_empty());
        weights.run().unwrap();
        assert_eq!(*log.lock().unwrap(), ["y after"]);
    }

    #[test]
    fn linear_defers_its_weight_and_bias_halves() {
        let mut rng = Rng::new(2);
        let (x, w, b) = (randn(&[3, 4], &mut rng), randn(&[2, 4], &mut rng), randn(&[2], &mut rng));
        let y = x.linear(&w, Some(&b)).unwrap().silu().unwrap();
        let g = Tensor::ones([3, 2], DType::F64, crate::Device::Cpu).unwrap();
        let (gx, weights) = backward_input(&[y], &[g], std::slice::from_ref(&x)).unwrap();
        assert!(gx[0].is_some());
        let names: Vec<&str> = weights.pending.iter().map(|p| p.node.name).collect();
        assert_eq!(names, ["add", "matmul"]);
        assert!(weights.seeds.iter().all(|(_, g)| g.is_none()));
        assert_eq!(weights.seeds.len(), 2);
        weights.run().unwrap();
        assert!(w.grad().is_some() && b.grad().is_some() && x.grad().is_none());
    }
}
