//! Reverse-mode autograd: the graph, `backward`, `grad`, `no_grad` and custom functions.
//!
//! Each op that has an input requiring a gradient records a [`Node`] holding its
//! inputs and a backward closure. `backward()` walks the graph from the output
//! in reverse topological order, summing gradients per tensor, and adds the
//! result into each leaf's `.grad()`. Whether ops record is a per-thread flag,
//! so ranks running as threads never see each other's `no_grad` scopes.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::{Result, Tensor, TensorError};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// The signature of a backward function: output gradient in, one optional
/// gradient per input out (`None` for inputs that get no gradient).
pub type BackwardFn = dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

/// A recorded op in the graph.
pub struct Node {
    pub(crate) name: &'static str,
    pub(crate) inputs: Vec<Tensor>,
    pub(crate) backward: Box<BackwardFn>,
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

/// Attaches a backward function to `output`, computed from `inputs`.
///
/// Returns `output` unchanged when grad mode is off or no input requires a
/// gradient. The closure gets the gradient of `output` and must return one
/// entry per input (shapes equal to the inputs'). This is the low-level hook
/// ops, collectives and fused kernels use; see [`Function`] for the trait form.
pub fn record(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Tensor {
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return output;
    }
    let node = Node {
        name,
        inputs: inputs.iter().map(|t| (*t).clone()).collect(),
        backward: Box::new(backward),
    };
    output.share(output.shape().clone(), Some(Arc::new(node)))
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

fn accumulate(map: &mut HashMap<u64, Tensor>, id: u64, g: Tensor) -> Result<()> {
    let v = match map.remove(&id) {
        Some(old) => old.add(&g)?,
        None => g,
    };
    map.insert(id, v);
    Ok(())
}

/// Propagates `grads` (one per root) back through the graph. Returns the
/// gradients of the leaves and of the `keep` tensors.
fn run(
    roots: &[Tensor],
    grads: Vec<Tensor>,
    keep: &HashSet<u64>,
) -> Result<(Vec<Tensor>, HashMap<u64, Tensor>)> {
    let _g = GradModeGuard::new(false);
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
    let (order, leaves) = topo(roots);
    for t in order {
        let Some(node) = t.node() else { continue };
        let g =
            if keep.contains(&t.id()) { map.get(&t.id()).cloned() } else { map.remove(&t.id()) };
        let Some(g) = g else { continue };
        let gs = (node.backward)(&g)?;
        if gs.len() != node.inputs.len() {
            return Err(TensorError::Autograd(format!(
                "backward of {} returned {} gradients for {} inputs",
                node.name,
                gs.len(),
                node.inputs.len()
            )));
        }
        for (inp, gi) in node.inputs.iter().zip(gs) {
            let Some(gi) = gi else { continue };
            if !inp.requires_grad() {
                continue;
            }
            if gi.shape() != inp.shape() {
                return Err(TensorError::Autograd(format!(
                    "backward of {} produced a gradient of shape {} for an input of shape {}",
                    node.name,
                    gi.shape(),
                    inp.shape()
                )));
            }
            let gi = if gi.dtype() != inp.dtype() { gi.to_dtype(inp.dtype())? } else { gi };
            accumulate(&mut map, inp.id(), gi)?;
        }
    }
    Ok((leaves, map))
}

impl Tensor {
    /// Backpropagates from this scalar, adding into every leaf's `.grad()`.
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(TensorError::Autograd(format!(
                "backward() needs a one-element output, got shape {}; use backward_with",
                self.shape()
            )));
        }
        let one = Tensor::full(self.shape().clone(), 1.0, self.dtype(), self.device())?;
        self.backward_with(&one)
    }

    /// Backpropagates a given output gradient, adding into every leaf's `.grad()`.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        if !self.requires_grad() {
            return Err(TensorError::Autograd(
                "the tensor does not require grad and has no grad_fn".into(),
            ));
        }
        let (leaves, mut map) =
            run(std::slice::from_ref(self), vec![grad.detach()], &HashSet::new())?;
        for leaf in leaves {
            if let Some(g) = map.remove(&leaf.id()) {
                leaf.accumulate_grad(g)?;
            }
        }
        Ok(())
    }
}

/// Gradients of `outputs` (weighted by `grad_outputs`) with respect to `inputs`,
/// returned rather than accumulated (as `torch.autograd.grad`). An input that
/// does not influence the outputs gets `None`.
pub fn grad(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
) -> Result<Vec<Option<Tensor>>> {
    if outputs.len() != grad_outputs.len() {
        return Err(TensorError::Autograd(format!(
            "{} outputs but {} output gradients",
            outputs.len(),
            grad_outputs.len()
        )));
    }
    let keep: HashSet<u64> = inputs.iter().map(|t| t.id()).collect();
    let (_, map) = run(outputs, grad_outputs.iter().map(|g| g.detach()).collect(), &keep)?;
    Ok(inputs.iter().map(|t| map.get(&t.id()).cloned()).collect())
}
