//! FSDP (`fully_shard`).
//!
//! `fully_shard(module, dp_mesh, config)` makes `module` one FSDP unit: every parameter
//! of its subtree not already in a child unit is sharded along dim 0 over the dp group
//! (the tensor-parallel local shard, when the parameter is a TP DTensor). The unit's
//! parameters communicate together ([`FsdpParamGroup`]): before the unit's forward one
//! all-gather (per dtype) brings them all; after it they are released
//! (`reshard_after_forward`); the first gradient reaching the unit's output gathers them
//! again; once all their gradients are complete, one reduce-scatter (averaged over dp)
//! brings each rank its shards' gradients. Apply it per decoder layer (optionally to the
//! base model), then to the root, as FSDP2.
//!
//! **Root and order.** The unit whose forward runs with no other unit's forward in
//! progress is the root of that forward (FSDP2's lazy root): it keeps its parameters
//! gathered after its forward when a backward follows (it would gather them again at
//! once), and it records the order in which the units ran. That order drives the
//! prefetching that overlaps communication with compute:
//!
//! - forward: when a unit starts, once its own parameters are here, it starts the
//!   all-gather of the unit that ran after it in the previous forward;
//! - backward: when a unit's backward starts, it starts the all-gather of the unit that
//!   finished its forward just before it (whose backward comes next);
//! - a unit's reduce-scatter runs asynchronously while the backward goes on; each unit
//!   waits for its own at the end of the backward (an end-of-backward callback), so the
//!   shards' gradients are in place when `backward()` returns.
//!
//! A prefetched gather the forward or backward did not use is dropped at its end, so
//! values changed by an optimizer step are always gathered afresh.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tpar_dtensor::DTensor;
use tpar_mesh::DeviceMesh;
use tpar_nn::{
    named_modules, visit_modules_mut, Args, ForwardHook, Module, NnError, Param, Result, Value,
};
use tpar_tensor::autograd::{is_grad_enabled, record};
use tpar_tensor::{DType, Tensor};

use crate::group::{FsdpParamGroup, FsdpTimeline, TimelineKind};
use crate::param::FsdpParam;

/// Compute and reduction dtypes for mixed precision (e.g. bf16 compute with f32 master
/// shards and f32 gradient reductions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MixedPrecision {
    /// The dtype parameters are gathered and computed in.
    pub param_dtype: DType,
    /// The dtype gradients are reduce-scattered in.
    pub reduce_dtype: DType,
}

/// Options of [`fully_shard`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FsdpConfig {
    /// Release the gathered parameters after the unit's forward (gather again for
    /// backward). On by default, as FSDP2. The root unit keeps its parameters after a
    /// forward that a backward will follow, whatever this says.
    pub reshard_after_forward: bool,
    /// Mixed precision; `None` computes in the parameters' own dtype.
    pub mixed_precision: Option<MixedPrecision>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig { reshard_after_forward: true, mixed_precision: None }
    }
}

/// What one root's forwards recorded, on one rank: the order units ran in.
#[derive(Default)]
struct RootState {
    /// Units in the order their forwards started, in the forward under way (or the
    /// last one).
    pre_order: Vec<Weak<Unit>>,
    /// The same, of the forward before it (forward prefetching follows it).
    prev_pre_order: Vec<Weak<Unit>>,
    /// Units in the order their forwards ended (backward prefetching follows it, in
    /// reverse).
    post_order: Vec<Weak<Unit>>,
}

type Root = Arc<Mutex<RootState>>;

fn lock_root(r: &Root) -> MutexGuard<'_, RootState> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    /// The root unit whose forward is running on this thread (rank), with its state.
    static ACTIVE_ROOT: RefCell<Option<(u64, Root)>> = const { RefCell::new(None) };
}

static NEXT_UNIT: AtomicU64 = AtomicU64::new(1);

/// Where a unit stands in the forward under way.
#[derive(Default)]
struct RunState {
    /// The root state of the unit's last forward.
    root: Option<Weak<Mutex<RootState>>>,
    /// Whether the unit was the root of its last forward.
    is_root: bool,
    /// When its forward compute started (for the timeline).
    forward_since: Option<Instant>,
}

/// One FSDP unit: its parameter group and its place in the forward order.
struct Unit {
    id: u64,
    group: Arc<FsdpParamGroup>,
    reshard_after_forward: bool,
    /// The order state this unit keeps when it is the root.
    own_root: Root,
    run: Mutex<RunState>,
}

impl Unit {
    fn run(&self) -> MutexGuard<'_, RunState> {
        self.run.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn root(&self) -> Option<Root> {
        self.run().root.as_ref().and_then(Weak::upgrade)
    }

    /// The unit after this one in `order`.
    fn next_in(order: &[Weak<Unit>], me: &Unit) -> Option<Arc<Unit>> {
        let pos = order.iter().position(|u| std::ptr::eq(u.as_ptr(), me))?;
        order.get(pos + 1).and_then(Weak::upgrade)
    }

    /// The unit whose forward ended just before this one's (its backward comes next).
    fn backward_next(&self) -> Option<Arc<Unit>> {
        let root = self.root()?;
        let st = lock_root(&root);
        let pos = st.post_order.iter().position(|u| std::ptr::eq(u.as_ptr(), self))?;
        pos.checked_sub(1).and_then(|p| st.post_order[p].upgrade())
    }

    /// Gathers the unit for its backward and starts gathering the next unit's.
    fn pre_backward(self: &Arc<Self>) -> tpar_nn::Result<()> {
        self.group.pre_backward()?;
        if let Some(next) = self.backward_next() {
            next.group.prefetch_backward()?;
        }
        Ok(())
    }
}

struct FsdpHook {
    unit: Arc<Unit>,
}

impl FsdpHook {
    /// An identity on `t` whose backward gathers the unit's parameters first.
    fn pre_backward(&self, t: &Tensor) -> Tensor {
        let unit = self.unit.clone();
        let out = record("fsdp_pre_backward", &[t], t.detach(), move |g| {
            unit.pre_backward().map_err(to_tensor_error)?;
            Ok(vec![Some(g.clone())])
        });
        // The same values: a plain shard of a known layout stays known.
        tpar_dtensor::local_layout::propagate(&out, &[t]);
        out
    }
}

fn to_tensor_error(e: NnError) -> tpar_tensor::TensorError {
    match e {
        NnError::Tensor(t) => t,
        other => tpar_tensor::TensorError::External(Arc::new(other)),
    }
}

impl ForwardHook for FsdpHook {
    /// Gathers and reshards parameters: it reads no values of the output.
    fn reads_output(&self) -> bool {
        false
    }

    fn pre(&self, args: Args) -> tpar_nn::Result<Args> {
        let unit = &self.unit;
        let (root, is_root) = ACTIVE_ROOT.with(|a| {
            let mut a = a.borrow_mut();
            match &*a {
                Some((id, root)) if *id != unit.id => (root.clone(), false),
                // No forward under way (or this unit's own, left by an error): the root.
                _ => {
                    *a = Some((unit.id, unit.own_root.clone()));
                    (unit.own_root.clone(), true)
                }
            }
        });
        let next = {
            let mut st = lock_root(&root);
            if is_root {
                let last = std::mem::take(&mut st.pre_order);
                if !last.is_empty() {
                    st.prev_pre_order = last;
                }
                st.post_order.clear();
            }
            st.pre_order.push(Arc::downgrade(unit));
            Unit::next_in(&st.prev_pre_order, unit)
        };
        {
            let mut run = unit.run();
            run.root = Some(Arc::downgrade(&root));
            run.is_root = is_root;
        }
        unit.group.unshard()?;
        // Overlap the next unit's gather with this unit's compute.
        if let Some(next) = next {
            next.group.unshard_async()?;
        }
        unit.run().forward_since = Some(Instant::now());
        Ok(args)
    }

    fn post(&self, out: Value) -> tpar_nn::Result<Value> {
        let unit = &self.unit;
        let (is_root, since) = {
            let mut run = unit.run();
            (run.is_root, run.forward_since.take())
        };
        if let (Some(since), Some(t)) = (since, unit.group.timeline()) {
            t.record(
                &unit.group.name(),
                TimelineKind::Forward,
                since,
                Instant::now(),
                Duration::ZERO,
            );
        }
        let root = unit.root();
        if let Some(root) = &root {
            lock_root(root).post_order.push(Arc::downgrade(unit));
        }
        let backward_follows = is_grad_enabled()
            && match &out {
                Value::Tensor(t) => t.requires_grad(),
                Value::DTensor(d) => d.requires_grad(),
                _ => false,
            };
        let reshard = match is_root {
            true => !backward_follows,
            false => unit.reshard_after_forward,
        };
        if reshard {
            unit.group.reshard();
        }
        if is_root {
            ACTIVE_ROOT.with(|a| {
                let mut a = a.borrow_mut();
                if matches!(&*a, Some((id, _)) if *id == unit.id) {
                    *a = None;
                }
            });
            // Gathers prefetched for units that did not run this time.
            if let Some(root) = &root {
                let stray: Vec<Arc<Unit>> = {
                    let st = lock_root(root);
                    st.prev_pre_order
                        .iter()
                        .filter(|u| !st.pre_order.iter().any(|v| v.ptr_eq(u)))
                        .filter_map(Weak::upgrade)
                        .collect()
                };
                for u in stray {
                    u.group.discard_prefetch()?;
                }
            }
        }
        if !backward_follows {
            return Ok(out);
        }
        Ok(match out {
            Value::Tensor(t) => Value::Tensor(self.pre_backward(&t)),
            Value::DTensor(d) => {
                let local = self.pre_backward(d.local());
                Value::DTensor(DTensor::from_local(
                    &local,
                    d.mesh(),
                    d.placements(),
                    Some(d.shape()),
                )?)
            }
            other => other,
        })
    }

    fn prefetch(&self) -> tpar_nn::Result<()> {
        self.unit.group.unshard_async()
    }

    fn describe(&self) -> String {
        format!(
            "FSDP unit {:?} ({} parameters, reshard_after_forward {})",
            self.unit.group.name(),
            self.unit.group.params().len(),
            self.unit.reshard_after_forward
        )
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// Makes `module` an FSDP unit over the 1-d `dp_mesh` (see the module docs). Parameters
/// already managed by a child unit stay with it. Works on parameters still on the meta
/// device (`reset_parameters` then materializes only the local shards) and on
/// tensor-parallel DTensor parameters (the TP shard is what gets sharded over dp).
pub fn fully_shard(
    module: &mut dyn Module,
    dp_mesh: &DeviceMesh,
    config: &FsdpConfig,
) -> Result<()> {
    if dp_mesh.ndim() != 1 {
        return Err(NnError::Config {
            what: format!("fully_shard needs a 1-d mesh (mesh[\"dp\"]), got {dp_mesh}"),
        });
    }
    let mut params = Vec::new();
    visit_modules_mut(module, "", &mut |_, m| {
        for slot in m.param_slots() {
            if slot.param.unsharder()?.is_some() {
                // A child unit's.
                continue;
            }
            let (local, tp) = match &*slot.param {
                Param::Tensor(t) => (t.clone(), None),
                Param::DTensor(d) => (d.to_local(), Some(d.spec().clone())),
            };
            let (pd, rd) = match config.mixed_precision {
                Some(mp) => (mp.param_dtype, mp.reduce_dtype),
                None => (local.dtype(), local.dtype()),
            };
            let f = FsdpParam::new(&local, tp, dp_mesh, pd, rd)?;
            slot.param.replace(Param::DTensor(f.dtensor()?), "fully_shard");
            params.push(f);
        }
        Ok(())
    })?;
    let dp = dp_mesh.group(0).map_err(NnError::from)?;
    let group = FsdpParamGroup::new(module.type_name(), dp, params)?;
    module.core_mut().add_hook(Arc::new(FsdpHook {
        unit: Arc::new(Unit {
            id: NEXT_UNIT.fetch_add(1, Ordering::Relaxed),
            group,
            reshard_after_forward: config.reshard_after_forward,
            own_root: Root::default(),
            run: Mutex::new(RunState::default()),
        }),
    }));
    Ok(())
}

/// The FSDP state of `param` when `fully_shard` sharded it (its
/// [`Param::unsharder`]); `None` for any other parameter.
///
/// # Errors
/// As [`Param::unsharder`]: the module that sharded it no longer exists.
pub fn fsdp_param(param: &Param) -> Result<Option<Arc<FsdpParam>>> {
    let Some(u) = param.unsharder()? else { return Ok(None) };
    Ok(u.as_any().downcast_ref::<FsdpParam>().and_then(FsdpParam::this))
}

/// Starts gathering `module`'s own FSDP parameters ahead of its forward (as FSDP2's
/// `module.unshard()`); the forward waits for them.
pub fn unshard(module: &dyn Module) -> Result<()> {
    for h in module.core().hooks() {
        h.prefetch()?;
    }
    Ok(())
}

/// The FSDP units of `model` with their modules' FQNs (`""` for the root module),
/// parents before children; names each unit after its FQN (`(root)` for the root
/// module), for timelines and messages.
pub fn fsdp_units(model: &dyn Module) -> Vec<(String, Arc<FsdpParamGroup>)> {
    let mut out = Vec::new();
    for (fqn, m) in named_modules(model) {
        for h in m.core().hooks() {
            if let Some(hook) = h.as_any().and_then(|a| a.downcast_ref::<FsdpHook>()) {
                let name = if fqn.is_empty() { "(root)" } else { fqn.as_str() };
                hook.unit.group.set_name(name);
                out.push((fqn.clone(), hook.unit.group.clone()));
            }
        }
    }
    out
}

/// Records every FSDP unit of `model` into `timeline` (each unit's forward and
/// backward compute, all-gathers and reduce-scatters, on this rank); `None` stops
/// recording. Units are named after their FQNs ([`fsdp_units`]).
pub fn set_fsdp_timeline(model: &dyn Module, timeline: Option<&FsdpTimeline>) {
    for (_, g) in fsdp_units(model) {
        g.set_timeline(timeline.cloned());
    }
}
