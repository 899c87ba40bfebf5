//! The `Module` trait: named children, named parameters, forward hooks, train/eval mode.

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use tpar_tensor::{checkpoint, Device, Rng, Tensor};

use crate::{Args, Param, Result, Value};

/// How a parameter is initialised by `reset_parameters` (PyTorch's defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// `U(-b, b)` with `b = 1/sqrt(fan_in)` (Linear weight and bias: kaiming_uniform with a=sqrt(5)).
    Uniform {
        /// The bound `b`.
        bound: f64,
    },
    /// `N(0, std^2)` (Embedding: std 1).
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// A constant (RMSNorm weight: 1).
    Constant(f64),
}

/// A mutable view of one parameter and how to initialise it.
pub struct ParamSlot<'a> {
    /// The parameter's name within its module (`weight`, `bias`).
    pub name: &'static str,
    /// The parameter.
    pub param: &'a mut Param,
    /// Its initialisation.
    pub init: Init,
}

/// A transformation of a module's inputs before its forward and of its output after,
/// as PyTorch's forward pre/post hooks (what parallel styles install).
pub trait ForwardHook: Send + Sync {
    /// Transforms the inputs.
    fn pre(&self, args: Args) -> Result<Args> {
        Ok(args)
    }
    /// Transforms the output.
    fn post(&self, out: Value) -> Result<Value> {
        Ok(out)
    }
    /// A one-line description (`ColwiseParallel(input R -> R, output S(-1), local)`).
    fn describe(&self) -> String;
    /// Whether a description of the model (`explain`) lists this hook: `true` unless it
    /// does nothing now (an activation checkpointing slot with no policy set).
    fn shown(&self) -> bool {
        true
    }
    /// Starts work ahead of the next forward (FSDP: begin gathering parameters).
    fn prefetch(&self) -> Result<()> {
        Ok(())
    }
    /// The hook as `Any`, so the layer that installed it can find its own hooks on a
    /// model (`None`, the default, for hooks that need not be found).
    fn as_any(&self) -> Option<&dyn Any> {
        None
    }
    /// Whether a backward may read the values of the module's output through this hook
    /// (`true`, the default). A hook that only moves or reshards the output, or none of
    /// whose backward reads it (a parallel style's redistribution, FSDP's resharding),
    /// says `false`: a recompute may then leave that output uncomputed where nothing
    /// else reads it ([`output_unread`]).
    fn reads_output(&self) -> bool {
        true
    }
}

/// State every module carries: its hooks and its train/eval flag.
#[derive(Clone, Default)]
pub struct ModuleCore {
    hooks: Vec<Arc<dyn ForwardHook>>,
    eval: bool,
}

impl fmt::Debug for ModuleCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hooks: Vec<String> = self.hooks.iter().map(|h| h.describe()).collect();
        f.debug_struct("ModuleCore").field("hooks", &hooks).field("training", &!self.eval).finish()
    }
}

impl ModuleCore {
    /// Adds a hook (runs after the hooks already installed).
    pub fn add_hook(&mut self, h: Arc<dyn ForwardHook>) {
        self.hooks.push(h);
    }
    /// The installed hooks.
    pub fn hooks(&self) -> &[Arc<dyn ForwardHook>] {
        &self.hooks
    }
    /// Whether the module is in training mode (the default).
    pub fn training(&self) -> bool {
        !self.eval
    }
}

/// How an attention module lays out its heads (see [`Module::attention_heads`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionHeads {
    /// The width of one head.
    pub head_dim: usize,
    /// Each head-producing child by name, with its full output width (a multiple of
    /// `head_dim`).
    pub projections: Vec<(&'static str, usize)>,
}

/// A layer or model: forward, named children, named parameters.
///
/// Implement `forward` and the accessors; call modules through [`call`] so their hooks
/// run. Fully-qualified names (`base_model.layers.3.self_attn.q_proj.weight`) are the
/// children's names joined by dots, the same keys as a state dict.
pub trait Module: Send + Sync + Any {
    /// The type's name (`"Linear"`, `"LlamaAttention"`): parallel styles check it.
    fn type_name(&self) -> &'static str;
    /// The computation, without hooks.
    fn forward(&self, args: Args) -> Result<Value>;
    /// Hooks and mode.
    fn core(&self) -> &ModuleCore;
    /// Hooks and mode, mutably.
    fn core_mut(&mut self) -> &mut ModuleCore;
    /// Direct children, by name.
    fn children(&self) -> Vec<(String, &dyn Module)> {
        Vec::new()
    }
    /// Direct children, mutably.
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        Vec::new()
    }
    /// Direct parameters, by name.
    fn params(&self) -> Vec<(&'static str, &Param)> {
        Vec::new()
    }
    /// Direct parameters, mutably, with their initialisation.
    fn param_slots(&mut self) -> Vec<ParamSlot<'_>> {
        Vec::new()
    }
    /// For an attention module: its head width and the children whose output features
    /// are whole heads (`q_proj`, `k_proj`, `v_proj` with their `out_features`), so a
    /// plan that shards heads over tensor-parallel ranks is checked to give each rank
    /// whole heads ([`AttentionHeads`]). `None` (the default) for every other module.
    fn attention_heads(&self) -> Option<AttentionHeads> {
        None
    }
    /// `self` as `Any` (to downcast to a concrete layer).
    fn as_any(&self) -> &dyn Any;
    /// `self` as `Any`, mutably.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// Runs a module with its hooks: every hook's `pre`, the forward, every hook's `post`.
pub fn call(m: &dyn Module, mut args: Args) -> Result<Value> {
    // A recompute's request that this module's output go unread (tpar_tensor::checkpoint,
    // "Outputs no backward reads"), honoured unless a hook may read it.
    let unread = checkpoint::take_output_unread_request()
        && m.core().hooks().iter().all(|h| !h.reads_output());
    for h in m.core().hooks() {
        args = h.pre(args)?;
    }
    let mut out = {
        let _frame = UnreadFrame::enter(unread);
        m.forward(args)?
    };
    for h in m.core().hooks() {
        out = h.post(out)?;
    }
    Ok(out)
}

thread_local! {
    /// Whether the output of the module whose forward runs on this thread goes unread.
    static OUTPUT_UNREAD: Cell<bool> = const { Cell::new(false) };
}

/// Sets [`output_unread`] for one module's forward, restoring the caller's when dropped.
struct UnreadFrame {
    outer: bool,
}

impl UnreadFrame {
    fn enter(unread: bool) -> UnreadFrame {
        UnreadFrame { outer: OUTPUT_UNREAD.with(|u| u.replace(unread)) }
    }
}

impl Drop for UnreadFrame {
    fn drop(&mut self) {
        let _ = OUTPUT_UNREAD.try_with(|u| u.set(self.outer));
    }
}

/// Whether no backward reads the output of the module whose forward is running (called
/// by that forward): `true` only while an activation checkpoint recomputes (or, for what it
/// keeps, a selective one runs its forward), for the module a `CheckpointWrapper`'s region
/// runs and for the children those modules pass the request on to
/// ([`checkpoint::request_output_unread`]; `tpar_tensor::checkpoint`, "Outputs no backward
/// reads"). Such a forward may run the ops that make its output inside
/// [`checkpoint::unread_output`], or pass the request on to the child whose output becomes
/// its own through ops whose backward reads no values (a residual add), and to no other.
pub fn output_unread() -> bool {
    OUTPUT_UNREAD.with(Cell::get)
}

pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Every module with its FQN (the root is `""`), parents before children.
pub fn named_modules(m: &dyn Module) -> Vec<(String, &dyn Module)> {
    let mut out = vec![(String::new(), m)];
    let mut i = 0;
    while i < out.len() {
        let (prefix, module) = (out[i].0.clone(), out[i].1);
        for (name, child) in module.children() {
            out.push((join(&prefix, &name), child));
        }
        i += 1;
    }
    out
}

/// Visits every module mutably with its FQN, parents before children.
pub fn visit_modules_mut(
    m: &mut dyn Module,
    prefix: &str,
    f: &mut dyn FnMut(&str, &mut dyn Module) -> Result<()>,
) -> Result<()> {
    f(prefix, m)?;
    for (name, child) in m.children_mut() {
        visit_modules_mut(child, &join(prefix, &name), f)?;
    }
    Ok(())
}

/// Every parameter with its FQN (`layers.0.mlp.up_proj.weight`).
pub fn named_parameters(m: &dyn Module) -> Vec<(String, Param)> {
    named_modules(m)
        .into_iter()
        .flat_map(|(prefix, module)| {
            module
                .params()
                .into_iter()
                .map(move |(n, p)| (join(&prefix, n), p.clone()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every parameter (the values of [`named_parameters`]).
pub fn parameters(m: &dyn Module) -> Vec<Param> {
    named_parameters(m).into_iter().map(|(_, p)| p).collect()
}

/// Sets training (`true`) or eval mode on every module.
pub fn set_training(m: &mut dyn Module, training: bool) -> Result<()> {
    visit_modules_mut(m, "", &mut |_, module| {
        module.core_mut().eval = !training;
        Ok(())
    })
}

/// A seed for one parameter from the model seed and its FQN, so initialisation does not
/// depend on the order modules are visited nor on how parameters are sharded.
fn param_seed(seed: u64, fqn: &str) -> u64 {
    fqn.bytes()
        .fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The full initial value of a parameter of `shape`.
pub fn init_value(
    init: Init,
    shape: &[usize],
    dtype: tpar_tensor::DType,
    seed: u64,
) -> Result<Tensor> {
    let mut rng = Rng::new(seed);
    Ok(match init {
        Init::Uniform { bound } => {
            Tensor::rand_uniform(shape.to_vec(), -bound, bound, dtype, &mut rng)?
        }
        Init::Normal { std } => Tensor::randn(shape.to_vec(), dtype, &mut rng)?.mul_scalar(std)?,
        Init::Constant(c) => Tensor::full(shape.to_vec(), c, dtype, Device::Cpu)?,
    })
}

/// Materializes every parameter on `device` (local shards only, for DTensors) and fills
/// it with PyTorch's default initialisation from `seed`: `to_empty` + `reset_parameters`
/// in one go. Each parameter's values depend only on `(seed, fqn)`, so a sharded model
/// holds exactly the shards of the unsharded model's values.
pub fn reset_parameters(m: &mut dyn Module, device: Device, seed: u64) -> Result<()> {
    visit_modules_mut(m, "", &mut |prefix, module| {
        for slot in module.param_slots() {
            let fqn = join(prefix, slot.name);
            let shape = slot.param.shape();
            let dtype = slot.param.dtype();
            let full = tpar_tensor::no_grad(|| {
                init_value(slot.init, &shape, dtype, param_seed(seed, &fqn))
            })?;
            let new = match &*slot.param {
                Param::Tensor(_) => Param::Tensor(full.to_device(device)?.requires_grad_(true)),
                Param::DTensor(d) => {
                    let local = tpar_dtensor::redistribute::slice_full(&full, d.spec())?;
                    let leaf = local.to_device(device)?.requires_grad_(true);
                    // An FSDP parameter's state takes the new shard as its own.
                    if let Some(u) = slot.param.unsharder()? {
                        u.adopt(&leaf)?;
                    }
                    Param::DTensor(tpar_dtensor::DTensor::from_local(
                        &leaf,
                        d.mesh(),
                        d.placements(),
                        Some(d.shape()),
                    )?)
                }
            };
            // An optimizer built before this holds the old tensors: its step will say so.
            slot.param.replace(new, "reset_parameters");
        }
        Ok(())
    })
}
