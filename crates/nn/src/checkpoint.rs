//! Activation checkpointing of modules (PyTorch's `checkpoint_wrapper` and
//! `apply_activation_checkpointing`, torchtitan's full and selective AC).
//!
//! [`CheckpointWrapper`] wraps a module without adding a name component: its children,
//! parameters and FQNs are the wrapped module's (`base_model.layers.3.mlp.up_proj.weight`
//! stays that), so state dicts, checkpoints and parallelize plans keyed by the old names
//! work unchanged, as PyTorch strips `_checkpoint_wrapped_module`. Its own hooks (those a
//! plan or `fully_shard` installs at the wrapper's FQN) run outside the checkpointed
//! region: an FSDP unit gathers its parameters before the region's forward and again
//! before its backward, which is when the recompute runs, so the recompute finds them
//! gathered (as FSDP2 re-gathers for the recompute).
//!
//! A wrapper's policy ([`AcPolicy`]) can be changed at any time
//! ([`CheckpointWrapper::set_policy`], or by FQN with [`apply_activation_checkpointing`]);
//! without one it is a plain pass-through (the Llama wraps every decoder layer so, and
//! trainers switch checkpointing on with one call). With one, its forward runs the
//! wrapped module's forward (with the wrapped module's own hooks) inside
//! [`tpar_tensor::checkpoint::checkpoint`]: plain and distributed tensor inputs enter the
//! region (a DTensor as its local shard, rebuilt with the same layout inside), other
//! values (RoPE tables, `None`) pass in unchanged, and the output leaves as the same kind
//! of value it was, with its layout.
//!
//! The backward's recompute needs the wrapped module: the wrapper holds it in an `Arc`
//! and the recorded node a weak reference. A backward through a region whose wrapper was
//! dropped, or whose module was reached mutably (`children_mut`, `param_slots`) after the
//! forward, fails with an error naming it instead of recomputing with a different module.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use tpar_dtensor::{local_layout, DTensor, DTensorSpec};
use tpar_tensor::checkpoint::checkpoint;
/// The ops a selective policy can keep (from the tensor layer).
pub use tpar_tensor::checkpoint::SaveOp;
use tpar_tensor::{Tensor, TensorError};

use crate::{
    call, named_modules, Args, AttentionHeads, ForwardHook, Module, ModuleCore, NnError, Param,
    ParamSlot, Result, Value,
};

/// What activation checkpointing does to the modules it is applied to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcPolicy {
    /// No checkpointing: every activation is kept.
    None,
    /// Full checkpointing of every `every`-th checkpointable module (1: all of them; 2:
    /// the 2nd, 4th, ...): nothing inside is kept, all is recomputed in backward.
    Full {
        /// Checkpoint the `every`-th, `2*every`-th, ... module (at least 1).
        every: usize,
    },
    /// Selective checkpointing of every `every`-th checkpointable module: the outputs of
    /// `ops` are kept, the rest (norms, elementwise ops, RoPE) is recomputed.
    Selective {
        /// Checkpoint the `every`-th, `2*every`-th, ... module (at least 1).
        every: usize,
        /// The ops whose outputs are kept ([`AcPolicy::selective`] keeps attention and
        /// every second matmul, as torchtitan does: [`SaveOp::DEFAULT`]).
        ops: Vec<SaveOp>,
    },
    /// Every checkpointable module checkpointed: every `full_every`-th fully, the others
    /// selectively keeping `ops` (`selective+full:2`: half the layers keep nothing, half
    /// keep attention and every second matmul). Between full and selective in memory and
    /// in recompute. On one module ([`CheckpointWrapper::set_policy`]) it has no position
    /// and sets the selective part; [`apply_activation_checkpointing_to`] refuses it.
    Mixed {
        /// Fully checkpoint the `full_every`-th, `2*full_every`-th, ... module (at least 1).
        full_every: usize,
        /// The ops the other modules keep.
        ops: Vec<SaveOp>,
    },
}

impl AcPolicy {
    /// Full checkpointing of every module.
    pub fn full() -> AcPolicy {
        AcPolicy::Full { every: 1 }
    }

    /// Selective checkpointing of every module, keeping attention's output and every
    /// second matmul's ([`SaveOp::DEFAULT`], torchtitan's selective policy).
    pub fn selective() -> AcPolicy {
        AcPolicy::Selective { every: 1, ops: SaveOp::DEFAULT.to_vec() }
    }

    /// Every how many modules one is checkpointed (`None` for [`AcPolicy::None`]).
    pub fn every(&self) -> Option<usize> {
        match self {
            AcPolicy::None => None,
            AcPolicy::Full { every } | AcPolicy::Selective { every, .. } => Some(*every),
            AcPolicy::Mixed { .. } => Some(1),
        }
    }

    /// What a checkpointed module keeps (`None`: not checkpointed; empty: nothing).
    fn keep(&self) -> Option<Vec<SaveOp>> {
        match self {
            AcPolicy::None => None,
            AcPolicy::Full { .. } => Some(Vec::new()),
            AcPolicy::Selective { ops, .. } | AcPolicy::Mixed { ops, .. } => Some(ops.clone()),
        }
    }

    /// What the `i`-th (from 0) of the modules the policy checkpoints keeps.
    fn keep_at(&self, i: usize) -> Option<Vec<SaveOp>> {
        match self {
            AcPolicy::Mixed { full_every, .. } if (i + 1).is_multiple_of(*full_every) => {
                Some(Vec::new())
            }
            _ => self.keep(),
        }
    }

    /// What the `i`-th (from 0) checkpointable module keeps under this policy (`None`: not
    /// checkpointed; empty: nothing), as [`apply_activation_checkpointing`] sets it: for a
    /// model of what a policy keeps or recomputes per module.
    pub fn keeps(&self, i: usize) -> Option<Vec<SaveOp>> {
        match self.every() {
            Some(every) if (i + 1).is_multiple_of(every.max(1)) => self.keep_at(i),
            _ => None,
        }
    }

    fn check(&self) -> Result<()> {
        let every = match self {
            AcPolicy::Mixed { full_every, .. } => Some(*full_every),
            _ => self.every(),
        };
        match every {
            Some(0) => Err(NnError::Config {
                what: format!("activation checkpointing policy {self}: every must be at least 1"),
            }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for AcPolicy {
    /// `none`, `full`, `full:2`, `selective`, `selective:2`, `selective[matmul]`. The
    /// ops are written out unless they are [`SaveOp::DEFAULT`] in its order, so a policy
    /// prints as it was written (`selective[matmul/2,sdpa]` lists the default's ops in
    /// another order and prints so).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, every) = match self {
            AcPolicy::None => return f.write_str("none"),
            AcPolicy::Full { every } => ("full", *every),
            AcPolicy::Selective { every, .. } | AcPolicy::Mixed { full_every: every, .. } => {
                ("selective", *every)
            }
        };
        f.write_str(name)?;
        if let AcPolicy::Selective { ops, .. } | AcPolicy::Mixed { ops, .. } = self {
            if ops.as_slice() != SaveOp::DEFAULT {
                let names: Vec<&str> = ops.iter().map(|o| o.name()).collect();
                write!(f, "[{}]", names.join(","))?;
            }
        }
        if let AcPolicy::Mixed { .. } = self {
            // The full part's K is always written.
            return write!(f, "+full:{every}");
        }
        if every != 1 {
            write!(f, ":{every}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for AcPolicy {
    type Err = NnError;

    /// Parses what [`Display`](fmt::Display) writes: `none`, `full`, `full:K`,
    /// `selective`, `selective:K`, `selective[matmul,sdpa]`, `selective[sdpa]:K`,
    /// `selective+full:K`, `selective[matmul,sdpa]+full:K`.
    fn from_str(s: &str) -> Result<AcPolicy> {
        let bad = |why: &str| NnError::Config {
            what: format!(
                "activation checkpointing policy {s:?}: {why} (expected none, full, full:K, \
                 selective, selective:K, selective[matmul,sdpa]:K or selective+full:K)"
            ),
        };
        let (head, every) = match s.rsplit_once(':') {
            Some((h, k)) => {
                let k: usize = k.trim().parse().map_err(|_| bad("K is not a whole number"))?;
                (h.trim(), Some(k))
            }
            None => (s.trim(), None),
        };
        let (head, mixed) = match head.strip_suffix("+full") {
            Some(h) => (h.trim(), true),
            None => (head, false),
        };
        if mixed && every.is_none() {
            return Err(bad("selective+full needs :K, the full layers' spacing"));
        }
        let (name, ops) = match head.split_once('[') {
            Some((n, rest)) => {
                let list = rest.strip_suffix(']').ok_or_else(|| bad("unclosed ["))?;
                let ops = list
                    .split(',')
                    .map(|o| SaveOp::parse(o).ok_or_else(|| bad(&format!("unknown op {o:?}"))))
                    .collect::<Result<Vec<_>>>()?;
                (n.trim(), Some(ops))
            }
            None => (head, None),
        };
        let policy = match (name, ops) {
            ("selective", ops) if mixed => AcPolicy::Mixed {
                full_every: every.unwrap_or(1),
                ops: ops.unwrap_or_else(|| SaveOp::DEFAULT.to_vec()),
            },
            _ if mixed => return Err(bad("only selective combines with +full")),
            ("none", None) if every.is_none() => AcPolicy::None,
            ("full", None) => AcPolicy::Full { every: every.unwrap_or(1) },
            ("selective", ops) => AcPolicy::Selective {
                every: every.unwrap_or(1),
                ops: ops.unwrap_or_else(|| SaveOp::DEFAULT.to_vec()),
            },
            _ => return Err(bad("unknown policy")),
        };
        policy.check().map_err(|_| bad("K must be at least 1"))?;
        Ok(policy)
    }
}

/// The hook a [`CheckpointWrapper`] installs on itself: it marks the module as
/// checkpointable and holds what its forward checkpoints (`None`: nothing). Its pre and
/// post are the identity.
struct AcSlot {
    keep: Mutex<Option<Vec<SaveOp>>>,
}

impl AcSlot {
    fn get(&self) -> Option<Vec<SaveOp>> {
        self.keep.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, keep: Option<Vec<SaveOp>>) {
        *self.keep.lock().unwrap_or_else(|p| p.into_inner()) = keep;
    }
}

impl ForwardHook for AcSlot {
    /// Holds the policy only.
    fn reads_output(&self) -> bool {
        false
    }

    fn shown(&self) -> bool {
        self.get().is_some()
    }

    fn describe(&self) -> String {
        match self.get() {
            None => "activation checkpointing: off".into(),
            Some(k) if k.is_empty() => "activation checkpointing: full".into(),
            Some(k) => {
                let names: Vec<&str> = k.iter().map(|o| o.name()).collect();
                format!("activation checkpointing: selective (keeps {})", names.join(", "))
            }
        }
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

fn slot_of(m: &dyn Module) -> Option<&AcSlot> {
    m.core().hooks().iter().find_map(|h| h.as_any().and_then(|a| a.downcast_ref::<AcSlot>()))
}

/// A module whose forward can be activation-checkpointed (see the module docs). It
/// dereferences to the wrapped module, so its fields read as before
/// (`layers.items[0].self_attn`).
pub struct CheckpointWrapper<M: Module> {
    core: ModuleCore,
    /// `None` only while [`CheckpointWrapper::inner_mut`] moves it.
    inner: Option<Arc<M>>,
    slot: Arc<AcSlot>,
}

/// Wraps `module` with full activation checkpointing (PyTorch's `checkpoint_wrapper`);
/// [`CheckpointWrapper::set_policy`] changes what it does.
///
/// ```
/// use tpar_nn::{call, checkpoint_wrapper, named_parameters, reset_parameters, Args, Linear};
/// use tpar_tensor::{DType, Device, Tensor};
/// let mut lin = checkpoint_wrapper(Linear::new(3, 2, true, DType::F64, Device::Meta)?);
/// reset_parameters(&mut lin, Device::Cpu, 0)?;
/// // The wrapped module's names: no `_checkpoint_wrapped_module` component.
/// let names: Vec<String> = named_parameters(&lin).into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["weight", "bias"]);
/// let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], [1, 3])?;
/// call(&lin, Args::one(x))?.into_tensor("y")?.sum_all()?.backward()?;
/// assert!(lin.weight.local().grad().is_some()); // the fields read through the wrapper
/// # Ok::<(), tpar_nn::NnError>(())
/// ```
pub fn checkpoint_wrapper<M: Module>(module: M) -> CheckpointWrapper<M> {
    let w = CheckpointWrapper::new(module);
    w.slot.set(Some(Vec::new()));
    w
}

impl<M: Module> CheckpointWrapper<M> {
    /// Wraps `module` without checkpointing (a pass-through until a policy is set).
    pub fn new(module: M) -> CheckpointWrapper<M> {
        let slot = Arc::new(AcSlot { keep: Mutex::new(None) });
        let mut core = ModuleCore::default();
        core.add_hook(slot.clone());
        CheckpointWrapper { core, inner: Some(Arc::new(module)), slot }
    }

    /// Sets what the forward checkpoints: [`AcPolicy::Full`] recomputes everything,
    /// [`AcPolicy::Selective`] keeps its ops' outputs, [`AcPolicy::None`] switches
    /// checkpointing off (`every` does not apply to a single module).
    pub fn set_policy(&self, policy: &AcPolicy) {
        self.slot.set(policy.keep());
    }

    /// Whether the forward is checkpointed, and what it keeps (empty: nothing).
    pub fn policy_keeps(&self) -> Option<Vec<SaveOp>> {
        self.slot.get()
    }

    /// The wrapped module.
    pub fn inner(&self) -> &M {
        self.shared()
    }

    /// The wrapped module, mutably. Graphs recorded by earlier forwards keep only a weak
    /// reference to it: reaching it mutably detaches it from them (their backward then
    /// fails with an error instead of recomputing with a changed module).
    pub fn inner_mut(&mut self) -> &mut M {
        if self.inner.as_mut().and_then(Arc::get_mut).is_none() {
            if let Some(mut arc) = self.inner.take() {
                // Only weak references of recorded graphs are left, unless a recompute is
                // running on another thread right now: wait for it, then move the module
                // out of the shared allocation (the weak references no longer upgrade).
                let m = loop {
                    match Arc::try_unwrap(arc) {
                        Ok(m) => break m,
                        Err(a) => {
                            arc = a;
                            std::thread::yield_now();
                        }
                    }
                };
                self.inner = Some(Arc::new(m));
            }
        }
        match self.inner.as_mut().and_then(Arc::get_mut) {
            Some(m) => m,
            None => unreachable!("the wrapped module is held alone here"),
        }
    }

    fn shared(&self) -> &Arc<M> {
        match &self.inner {
            Some(a) => a,
            None => unreachable!("the wrapped module is only taken out inside inner_mut"),
        }
    }

    /// Unwraps the module.
    pub fn into_inner(mut self) -> M {
        self.inner_mut();
        match self.inner.take().map(Arc::try_unwrap) {
            Some(Ok(m)) => m,
            _ => unreachable!("inner_mut left the module held alone"),
        }
    }
}

impl<M: Module> std::ops::Deref for CheckpointWrapper<M> {
    type Target = M;
    fn deref(&self) -> &M {
        self.shared()
    }
}

impl<M: Module> std::ops::DerefMut for CheckpointWrapper<M> {
    fn deref_mut(&mut self) -> &mut M {
        self.inner_mut()
    }
}

impl<M: Module> fmt::Debug for CheckpointWrapper<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointWrapper")
            .field("module", &self.shared().type_name())
            .field("policy", &self.slot.describe())
            .finish()
    }
}

/// The output of a checkpointed forward's first run (see `checkpointed`).
struct Ran {
    /// Whether a run stores its output (only until the forward returns).
    armed: bool,
    out: Option<(OutKind, Tensor)>,
}

/// How one input of a checkpointed forward is rebuilt inside the region.
#[derive(Clone)]
enum Slot {
    /// Region input `i`, a plain tensor.
    Tensor(usize),
    /// Region input `i`, the local shard of a DTensor with this layout.
    DTensor(usize, DTensorSpec),
    /// Passed in unchanged (not a tensor).
    Other(Value),
}

/// The layout of a checkpointed forward's output (set by each run of the region).
#[derive(Clone)]
enum OutKind {
    Tensor,
    DTensor(Box<DTensorSpec>),
}

fn to_tensor_error(e: NnError) -> TensorError {
    match e {
        NnError::Tensor(t) => t,
        other => TensorError::External(Arc::new(other)),
    }
}

fn rebuild(slots: &[Slot], tensors: &[Tensor]) -> Result<Vec<Value>> {
    slots
        .iter()
        .map(|s| {
            Ok(match s {
                Slot::Tensor(i) => Value::Tensor(tensors[*i].clone()),
                Slot::DTensor(i, spec) => Value::DTensor(DTensor::from_local(
                    &tensors[*i],
                    spec.mesh(),
                    spec.placements(),
                    Some(spec.shape()),
                )?),
                Slot::Other(v) => v.clone(),
            })
        })
        .collect()
}

fn split(values: &[Value], tensors: &mut Vec<Tensor>) -> Vec<Slot> {
    values
        .iter()
        .map(|v| match v {
            Value::Tensor(t) => {
                tensors.push(t.clone());
                Slot::Tensor(tensors.len() - 1)
            }
            Value::DTensor(d) => {
                tensors.push(d.to_local());
                Slot::DTensor(tensors.len() - 1, d.spec().clone())
            }
            other => Slot::Other(other.clone()),
        })
        .collect()
}

impl<M: Module> CheckpointWrapper<M> {
    /// The wrapped module's forward (with its own hooks) as a checkpointed region.
    fn checkpointed(&self, args: Args, keep: &[SaveOp]) -> Result<Value> {
        let mut tensors = Vec::new();
        let pos = split(&args.pos, &mut tensors);
        let named: Vec<(String, Slot)> = args
            .named
            .iter()
            .map(|(k, v)| (k.clone(), split(std::slice::from_ref(v), &mut tensors).remove(0)))
            .collect();
        // The inputs' layouts as plain shards are known to the DTensor layer by identity;
        // the recompute's copies are told the same.
        let originals = tensors.clone();
        let module: Weak<M> = Arc::downgrade(self.shared());
        // What the forward's run returned, for the caller to rebuild the output: only that
        // run stores it (a recompute's output holds its whole graph, which must not
        // outlive the recompute).
        let kind: Arc<Mutex<Ran>> = Arc::new(Mutex::new(Ran { armed: true, out: None }));
        let out_kind = kind.clone();
        let region = move |ins: &[Tensor]| -> tpar_tensor::Result<Tensor> {
            let m = module.upgrade().ok_or_else(|| TensorError::Recompute {
                what: format!(
                    "the checkpointed {} was dropped or changed (reached mutably) between \
                     its forward and its backward",
                    std::any::type_name::<M>()
                ),
            })?;
            for (copy, orig) in ins.iter().zip(&originals) {
                if copy.id() != orig.id() {
                    local_layout::propagate(copy, &[orig]);
                }
            }
            let run = || -> Result<Tensor> {
                let mut a = Args::new(rebuild(&pos, ins)?);
                for (k, s) in &named {
                    let v = rebuild(std::slice::from_ref(s), ins)?.remove(0);
                    a.named.insert(k.clone(), v);
                }
                // The module's output is the region's: a recompute need not compute what
                // only makes it (tpar_tensor::checkpoint, "Outputs no backward reads").
                tpar_tensor::checkpoint::request_output_unread();
                let (kind, t) = match call(&*m, a)? {
                    Value::Tensor(t) => (OutKind::Tensor, t),
                    Value::DTensor(d) => {
                        (OutKind::DTensor(Box::new(d.spec().clone())), d.to_local())
                    }
                    _ => {
                        return Err(NnError::BadInput {
                            module: m.type_name().into(),
                            what: "a checkpointed module must return a tensor or a DTensor".into(),
                        })
                    }
                };
                let mut ran = out_kind.lock().unwrap_or_else(|p| p.into_inner());
                if ran.armed {
                    ran.out = Some((kind, t.clone()));
                }
                Ok(t)
            };
            run().map_err(to_tensor_error)
        };
        let out = checkpoint(&tensors, keep, region)?;
        let ran = {
            let mut ran = kind.lock().unwrap_or_else(|p| p.into_inner());
            ran.armed = false;
            ran.out.take()
        };
        Ok(match ran {
            Some((OutKind::DTensor(spec), _)) => Value::DTensor(DTensor::from_local(
                &out,
                spec.mesh(),
                spec.placements(),
                Some(spec.shape()),
            )?),
            Some((OutKind::Tensor, fwd)) => {
                if fwd.id() != out.id() {
                    local_layout::propagate(&out, &[&fwd]);
                }
                Value::Tensor(out)
            }
            None => Value::Tensor(out),
        })
    }
}

impl<M: Module> Module for CheckpointWrapper<M> {
    /// The wrapped module's type name (parallel styles check it).
    fn type_name(&self) -> &'static str {
        self.shared().type_name()
    }

    fn forward(&self, args: Args) -> Result<Value> {
        match self.slot.get() {
            None => call(&**self.shared(), args),
            Some(keep) => self.checkpointed(args, &keep),
        }
    }

    fn core(&self) -> &ModuleCore {
        &self.core
    }

    fn core_mut(&mut self) -> &mut ModuleCore {
        &mut self.core
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.shared().children()
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.inner_mut().children_mut()
    }

    fn params(&self) -> Vec<(&'static str, &Param)> {
        self.shared().params()
    }

    fn param_slots(&mut self) -> Vec<ParamSlot<'_>> {
        self.inner_mut().param_slots()
    }

    fn attention_heads(&self) -> Option<AttentionHeads> {
        self.shared().attention_heads()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// The checkpointable modules of `model` ([`CheckpointWrapper`]s), with their FQNs, in
/// module order.
pub fn checkpointable_modules(model: &dyn Module) -> Vec<String> {
    named_modules(model)
        .into_iter()
        .filter(|(_, m)| slot_of(*m).is_some())
        .map(|(n, _)| n)
        .collect()
}

/// Applies `policy` to every checkpointable module of `model` (its
/// [`CheckpointWrapper`]s, e.g. the Llama's decoder layers), in module order: with
/// `every: k`, the `k`-th, `2k`-th, ... are checkpointed and the others are not;
/// [`AcPolicy::Mixed`] checkpoints every one, the `full_every`-th fully and the others
/// selectively; [`AcPolicy::None`] switches checkpointing off everywhere. Returns the
/// FQNs now checkpointed. A model with no checkpointable module is an error (unless the
/// policy is `None`), as is `every: 0`.
pub fn apply_activation_checkpointing(
    model: &mut dyn Module,
    policy: &AcPolicy,
) -> Result<Vec<String>> {
    policy.check()?;
    let all = checkpointable_modules(&*model);
    if all.is_empty() && *policy != AcPolicy::None {
        return Err(NnError::Config {
            what: format!(
                "activation checkpointing {policy}: {} has no checkpointable module (wrap \
                 modules with checkpoint_wrapper or CheckpointWrapper::new)",
                model.type_name()
            ),
        });
    }
    let chosen: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(i, _)| policy.keeps(*i).is_some())
        .map(|(_, n)| n.clone())
        .collect();
    for (fqn, m) in named_modules(&*model) {
        if let Some(slot) = slot_of(m) {
            slot.set(all.iter().position(|n| *n == fqn).and_then(|i| policy.keeps(i)));
        }
    }
    Ok(chosen)
}

/// Applies `policy` to the modules named by `fqns` (`base_model.layers.3`), each of which
/// must be checkpointable; `every` does not apply (each named module is set). Other
/// modules keep what they had. An FQN that names no module, or a module that is not
/// checkpointable, is an error naming the nearest checkpointable modules, and nothing is
/// changed.
pub fn apply_activation_checkpointing_to(
    model: &mut dyn Module,
    fqns: &[&str],
    policy: &AcPolicy,
) -> Result<()> {
    policy.check()?;
    if let AcPolicy::Mixed { .. } = policy {
        return Err(NnError::Config {
            what: format!(
                "activation checkpointing {policy}: a mixed policy picks modules by position; \
                 name the full and the selective modules with a policy each"
            ),
        });
    }
    let modules = named_modules(&*model);
    let mut slots = Vec::new();
    for fqn in fqns {
        match modules.iter().find(|(n, _)| n == fqn) {
            Some((_, m)) => match slot_of(*m) {
                Some(s) => slots.push(s),
                None => {
                    return Err(NnError::Config {
                        what: format!(
                            "activation checkpointing: {fqn:?} ({}) is not checkpointable; \
                             checkpointable modules: {}",
                            m.type_name(),
                            nearest(fqn, &checkpointable_modules(&*model))
                        ),
                    })
                }
            },
            None => {
                return Err(NnError::Config {
                    what: format!(
                        "activation checkpointing: no module named {fqn:?}; checkpointable \
                         modules: {}",
                        nearest(fqn, &checkpointable_modules(&*model))
                    ),
                })
            }
        }
    }
    for s in slots {
        s.set(policy.keep());
    }
    Ok(())
}

/// Up to five of `names`, those closest to `fqn` first (by edit distance).
fn nearest(fqn: &str, names: &[String]) -> String {
    if names.is_empty() {
        return "none".into();
    }
    let mut scored: Vec<(usize, &String)> =
        names.iter().map(|n| (edit_distance(fqn, n), n)).collect();
    scored.sort();
    let shown: Vec<&str> = scored.iter().take(5).map(|(_, n)| n.as_str()).collect();
    let more = names.len().saturating_sub(shown.len());
    if more > 0 {
        format!("{} (and {more} more)", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
