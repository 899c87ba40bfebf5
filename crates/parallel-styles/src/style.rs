//! The parallel styles: how one module's parameters are sharded and how its inputs and
//! outputs are laid out, as PyTorch's `torch.distributed.tensor.parallel` styles.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use tpar_dtensor::redistribute::{cached_plan, grad_placements};
use tpar_dtensor::{distribute_tensor, local_layout, DTensor, Placement};
use tpar_mesh::DeviceMesh;
use tpar_nn::{Args, ForwardHook, Module, NnError, Param, Value};
use tpar_placements::{fmt_placements, PlanKey};

use crate::trace::{self, HookEvent};
use crate::{PlanError, Result};

use Placement::{Replicate, Shard};

/// A way to parallelize one module (see [`crate::parallelize_module`]).
pub trait ParallelStyle: Send + Sync + fmt::Debug {
    /// Short name with its layouts, for errors and `explain`.
    fn name(&self) -> String;
    /// Module types the style applies to (`["Linear", "Embedding"]`); empty means any.
    fn supported(&self) -> &'static [&'static str];
    /// Shards the module's parameters over `mesh` and installs its hooks.
    fn apply(&self, fqn: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()>;
    /// The layouts the style declares for its module's inputs and output, so a plan can
    /// be checked statically before it runs (see
    /// `tpar_models::llama_plans::check_llama_plan`). `None` (the default, for styles
    /// defined outside this crate) declares nothing: checks skip what flows through.
    fn layouts(&self) -> Option<StyleLayouts> {
        None
    }
}

/// How a style converts one input of its module (see [`ParallelStyle::layouts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputLayout {
    /// How a plain (local) tensor arriving here is taken; `None`: it passes untouched.
    pub given: Option<Placement>,
    /// The layout the module gets; `None`: as it arrives.
    pub desired: Option<Placement>,
    /// Whether the module gets this rank's shard (a plain tensor) instead of a DTensor.
    pub use_local: bool,
}

/// How a style converts its module's output (see [`ParallelStyle::layouts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputLayout {
    /// How a plain output of the module is taken; `None`: a plain output passes
    /// untouched (the sharding styles' modules compute DTensors).
    pub given: Option<Placement>,
    /// The layout the caller gets; `None`: as the module produced it.
    pub desired: Option<Placement>,
    /// Whether the caller gets this rank's shard (a plain tensor) instead of a DTensor.
    pub use_local: bool,
}

/// The layouts a style declares (see [`ParallelStyle::layouts`]).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct StyleLayouts {
    /// Per positional input (`None`: the input is not converted).
    pub inputs: Vec<Option<InputLayout>>,
    /// The output (`None`: not converted).
    pub output: Option<OutputLayout>,
    /// Whether the style shards the module's parameters (so the module computes on
    /// DTensors), as opposed to only converting layouts.
    pub shards_params: bool,
}

/// Who a hook works for, for messages and traces.
#[derive(Clone)]
struct Ctx {
    fqn: String,
    style: String,
    mesh: DeviceMesh,
}

fn same(
    mesh: &DeviceMesh,
    shape: &[usize],
    a: &[Placement],
    b: Placement,
) -> std::result::Result<bool, NnError> {
    let spec = tpar_dtensor::DTensorSpec::new(mesh, &[b], shape)?;
    Ok(a == spec.placements())
}

impl Ctx {
    /// Turns an input into a DTensor laid out as `desired`: a plain tensor is taken as
    /// this rank's shard laid out as `given`; a DTensor keeps its own placements. Values
    /// that are not tensors, or inputs with no layout, pass through untouched.
    ///
    /// A plain tensor sharded on a dim whose global size the module knows (`known`: a
    /// Linear's `in_features` for its last dim) gets its global shape from it; so does
    /// one a style handed on as a DTensor's local shard, or an elementwise result of such
    /// shards of one layout (a residual sum; see [`local_layout`]). Other sharded plain
    /// tensors exchange their local shapes (one small i64 all_gather), so uneven shards
    /// are exact.
    fn convert(
        &self,
        what: &str,
        v: Value,
        given: Option<Placement>,
        desired: Option<Placement>,
        known: Option<(isize, usize)>,
    ) -> std::result::Result<Value, NnError> {
        let d = match (v, given) {
            (Value::Tensor(t), Some(g)) => {
                let shape = known_global_shape(t.dims(), g, known)
                    .or_else(|| local_layout::known_shape(&t, &self.mesh, &[g]));
                DTensor::from_local(&t, &self.mesh, &[g], shape.as_deref())?
            }
            (Value::DTensor(d), _) => d,
            (other, _) => return Ok(other),
        };
        let Some(want) = desired else { return Ok(Value::DTensor(d)) };
        if same(&self.mesh, d.shape(), d.placements(), want)? {
            return Ok(Value::DTensor(d));
        }
        if trace::enabled() {
            self.trace(what, &d, want)?;
        }
        Ok(Value::DTensor(d.redistribute(&[want])?))
    }

    fn trace(&self, what: &str, d: &DTensor, want: Placement) -> std::result::Result<(), NnError> {
        let plan = d.plan_to(&[want])?;
        let back = cached_plan(PlanKey {
            mesh_shape: plan.mesh_shape.clone(),
            global_shape: plan.global_shape.clone(),
            elem_bytes: plan.elem_bytes,
            src: grad_placements("trace", &plan.dst)?,
            dst: grad_placements("trace", &plan.src)?,
        })?;
        trace::record(HookEvent {
            fqn: self.fqn.clone(),
            style: self.style.clone(),
            what: what.to_string(),
            from: fmt_placements(&plan.src),
            to: fmt_placements(&plan.dst),
            shape: d.shape().to_vec(),
            forward: plan.steps.iter().map(|s| s.describe()).collect(),
            forward_bytes: plan.total_bytes(),
            backward_bytes: back.total_bytes(),
            forward_steps: plan.steps.clone(),
            backward_steps: back.steps.clone(),
        });
        Ok(())
    }

    /// The caller's form of a converted value: with `use_local`, a DTensor's local shard,
    /// remembered with its layout (see [`local_layout`]).
    fn local(v: Value, use_local: bool) -> Value {
        match v {
            Value::DTensor(d) if use_local => Value::Tensor(local_layout::remember(&d)),
            other => other,
        }
    }
}

/// The global shape of a plain tensor with local `dims` laid out as `given` on a 1-d
/// mesh, when `given` shards the dim whose global size `known` gives; `None` otherwise.
fn known_global_shape(
    dims: &[usize],
    given: Placement,
    known: Option<(isize, usize)>,
) -> Option<Vec<usize>> {
    let ((kd, n), Placement::Shard(g)) = (known?, given) else { return None };
    let r = dims.len() as isize;
    let norm = |d: isize| if d < 0 { d + r } else { d };
    let d = norm(g);
    if d != norm(kd) || !(0..r).contains(&d) {
        return None;
    }
    let mut shape = dims.to_vec();
    shape[d as usize] = n;
    Some(shape)
}

/// Converts a module's inputs (positional and named) before its forward.
struct InputHook {
    ctx: Ctx,
    given: Vec<Option<Placement>>,
    desired: Vec<Option<Placement>>,
    named_given: BTreeMap<String, Placement>,
    named_desired: BTreeMap<String, Placement>,
    use_local_output: bool,
    /// A dim of positional input 0 whose global size the module knows.
    known: Option<(isize, usize)>,
}

impl ForwardHook for InputHook {
    /// Converts inputs only.
    fn reads_output(&self) -> bool {
        false
    }

    fn pre(&self, mut args: Args) -> tpar_nn::Result<Args> {
        for (i, v) in args.pos.iter_mut().enumerate() {
            let given = self.given.get(i).copied().flatten();
            let desired = self.desired.get(i).copied().flatten();
            if given.is_none() && desired.is_none() {
                continue;
            }
            let known = if i == 0 { self.known } else { None };
            let out = self.ctx.convert(
                &format!("input {i}"),
                std::mem::replace(v, Value::None),
                given,
                desired,
                known,
            )?;
            *v = Ctx::local(out, self.use_local_output);
        }
        for (name, v) in args.named.iter_mut() {
            let given = self.named_given.get(name).copied();
            let desired = self.named_desired.get(name).copied();
            if given.is_none() && desired.is_none() {
                continue;
            }
            let out = self.ctx.convert(
                &format!("input {name}"),
                std::mem::replace(v, Value::None),
                given,
                desired,
                None,
            )?;
            *v = Ctx::local(out, self.use_local_output);
        }
        Ok(args)
    }

    /// `Style(...): inputs S(1),-,- -> R,-,-` (`-`: not converted), then named inputs.
    fn describe(&self) -> String {
        let mut s = format!(
            "{}: inputs {} -> {}",
            self.ctx.style,
            fmt_opt(&self.given),
            fmt_opt(&self.desired)
        );
        for (name, g) in &self.named_given {
            let d = self.named_desired.get(name).map_or("-".to_string(), |d| d.to_string());
            s.push_str(&format!(", {name} {g} -> {d}"));
        }
        if self.use_local_output {
            s.push_str(" (local)");
        }
        s
    }
}

/// `S(1),-,-` for per-input layouts (`-`: not converted).
fn fmt_opt(v: &[Option<Placement>]) -> String {
    v.iter().map(|p| p.map_or("-".to_string(), |p| p.to_string())).collect::<Vec<_>>().join(",")
}

/// Converts a module's output after its forward.
struct OutputHook {
    ctx: Ctx,
    given: Option<Placement>,
    desired: Option<Placement>,
    use_local_output: bool,
}

impl ForwardHook for OutputHook {
    /// A redistribution: its backward reads no values of the output.
    fn reads_output(&self) -> bool {
        false
    }

    fn post(&self, out: Value) -> tpar_nn::Result<Value> {
        let out = self.ctx.convert("output", out, self.given, self.desired, None)?;
        Ok(Ctx::local(out, self.use_local_output))
    }

    /// `Style(...): output S(-1)` (computed) or `output R -> S(1)` (a plain output taken
    /// as `R`), with ` (local)` when the caller gets this rank's shard.
    fn describe(&self) -> String {
        let given = self.given.map_or(String::new(), |g| format!("{g} -> "));
        let desired = self.desired.map_or("-".to_string(), |d| d.to_string());
        let local = if self.use_local_output { " (local)" } else { "" };
        format!("{}: output {given}{desired}{local}", self.ctx.style)
    }
}

fn one_d(style: &str, mesh: &DeviceMesh) -> Result<()> {
    if mesh.ndim() != 1 {
        return Err(PlanError::BadStyle {
            style: style.to_string(),
            what: format!("needs a 1-d mesh (e.g. mesh[\"tp\"]), got {mesh}"),
        });
    }
    Ok(())
}

/// Replaces a plain parameter by a DTensor with `placement` on the 1-d mesh (the old
/// tensor is retired: an optimizer still holding it refuses to step).
pub(crate) fn shard_param(p: &mut Param, mesh: &DeviceMesh, placement: Placement) -> Result<()> {
    if let Param::Tensor(t) = p {
        let d = distribute_tensor(t, mesh, &[placement])?;
        p.replace(Param::DTensor(d), "parallelize_module");
    }
    Ok(())
}

fn wrong_type(style: &dyn ParallelStyle, fqn: &str, module: &dyn Module) -> PlanError {
    PlanError::WrongModuleType {
        style: style.name(),
        fqn: fqn.to_string(),
        module_type: module.type_name().to_string(),
        supported: style.supported().join(", "),
    }
}

fn ctx(style: &dyn ParallelStyle, fqn: &str, mesh: &DeviceMesh) -> Ctx {
    Ctx { fqn: fqn.to_string(), style: style.name(), mesh: mesh.clone() }
}

/// Shards a Linear's output features (weight `Shard(0)`, bias `Shard(0)`) or an
/// Embedding's embedding dim (weight `Shard(1)`).
///
/// Defaults as PyTorch: `input_layouts = Replicate`, `output_layouts = Shard(-1)`,
/// `use_local_output = true`. Forward: the input is redistributed to `Replicate`
/// (an all_gather when it arrives sharded), the local matmul gives `Shard(-1)`, which is
/// redistributed to `output_layouts`. Backward: the adjoints (the input's gradient is a
/// `Partial(sum)` contribution, reduced where the input was redistributed). A plain
/// input sharded on its last dim takes its global width from the Linear's `in_features`
/// (no shape exchange).
#[derive(Clone, Debug, PartialEq)]
pub struct ColwiseParallel {
    /// How a plain input tensor is laid out.
    pub input_layouts: Placement,
    /// The output's layout.
    pub output_layouts: Placement,
    /// Hand the next module this rank's shard (true) or the DTensor.
    pub use_local_output: bool,
}

impl Default for ColwiseParallel {
    fn default() -> Self {
        ColwiseParallel {
            input_layouts: Replicate,
            output_layouts: Shard(-1),
            use_local_output: true,
        }
    }
}

impl ColwiseParallel {
    /// PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets `input_layouts`.
    pub fn input_layouts(mut self, p: Placement) -> Self {
        self.input_layouts = p;
        self
    }
    /// Sets `output_layouts`.
    pub fn output_layouts(mut self, p: Placement) -> Self {
        self.output_layouts = p;
        self
    }
    /// Sets `use_local_output`.
    pub fn use_local_output(mut self, on: bool) -> Self {
        self.use_local_output = on;
        self
    }
}

impl ParallelStyle for ColwiseParallel {
    fn name(&self) -> String {
        format!(
            "ColwiseParallel(input {}, output {}{})",
            self.input_layouts,
            self.output_layouts,
            if self.use_local_output { "" } else { ", dtensor" }
        )
    }
    fn supported(&self) -> &'static [&'static str] {
        &["Linear", "Embedding"]
    }
    fn layouts(&self) -> Option<StyleLayouts> {
        Some(StyleLayouts {
            inputs: vec![Some(InputLayout {
                given: Some(self.input_layouts),
                desired: Some(Replicate),
                use_local: false,
            })],
            output: Some(OutputLayout {
                given: None,
                desired: Some(self.output_layouts),
                use_local: self.use_local_output,
            }),
            shards_params: true,
        })
    }
    fn apply(&self, fqn: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        one_d(&self.name(), mesh)?;
        let c = ctx(self, fqn, mesh);
        let known = if let Some(l) = module.as_any_mut().downcast_mut::<tpar_nn::Linear>() {
            shard_param(&mut l.weight, mesh, Shard(0))?;
            if let Some(b) = &mut l.bias {
                shard_param(b, mesh, Shard(0))?;
            }
            Some((-1, l.in_features()))
        } else if let Some(e) = module.as_any_mut().downcast_mut::<tpar_nn::Embedding>() {
            shard_param(&mut e.weight, mesh, Shard(1))?;
            None
        } else {
            return Err(wrong_type(self, fqn, module));
        };
        install(
            module,
            c,
            vec![Some(self.input_layouts)],
            vec![Some(Replicate)],
            known,
            None,
            Some(self.output_layouts),
            self.use_local_output,
        );
        Ok(())
    }
}

/// Shards a Linear's input features (weight `Shard(1)`, bias `Replicate`) or an
/// Embedding's vocabulary (weight `Shard(0)`, a masked lookup).
///
/// Defaults as PyTorch: `input_layouts = Shard(-1)`, `output_layouts = Replicate`,
/// `use_local_output = true`. Forward: the input is redistributed to `Shard(-1)` (to
/// `Replicate` for an Embedding), the local product is a `Partial(sum)`, reduced to
/// `output_layouts` (an all_reduce for `Replicate`, a reduce_scatter for `Shard(1)`).
/// Backward: the adjoints (the output gradient gathered where the output was scattered).
/// A Linear's plain `Shard(-1)` input takes its global width from `in_features`, so no
/// shape exchange runs.
#[derive(Clone, Debug, PartialEq)]
pub struct RowwiseParallel {
    /// How a plain input tensor is laid out.
    pub input_layouts: Placement,
    /// The output's layout.
    pub output_layouts: Placement,
    /// Hand the next module this rank's shard (true) or the DTensor.
    pub use_local_output: bool,
}

impl Default for RowwiseParallel {
    fn default() -> Self {
        RowwiseParallel {
            input_layouts: Shard(-1),
            output_layouts: Replicate,
            use_local_output: true,
        }
    }
}

impl RowwiseParallel {
    /// PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets `input_layouts`.
    pub fn input_layouts(mut self, p: Placement) -> Self {
        self.input_layouts = p;
        self
    }
    /// Sets `output_layouts`.
    pub fn output_layouts(mut self, p: Placement) -> Self {
        self.output_layouts = p;
        self
    }
    /// Sets `use_local_output`.
    pub fn use_local_output(mut self, on: bool) -> Self {
        self.use_local_output = on;
        self
    }
}

impl ParallelStyle for RowwiseParallel {
    fn name(&self) -> String {
        format!(
            "RowwiseParallel(input {}, output {}{})",
            self.input_layouts,
            self.output_layouts,
            if self.use_local_output { "" } else { ", dtensor" }
        )
    }
    fn supported(&self) -> &'static [&'static str] {
        &["Linear", "Embedding"]
    }
    /// The module gets `Shard(-1)` (a Linear; an Embedding gets `Replicate` ids).
    fn layouts(&self) -> Option<StyleLayouts> {
        Some(StyleLayouts {
            inputs: vec![Some(InputLayout {
                given: Some(self.input_layouts),
                desired: Some(Shard(-1)),
                use_local: false,
            })],
            output: Some(OutputLayout {
                given: None,
                desired: Some(self.output_layouts),
                use_local: self.use_local_output,
            }),
            shards_params: true,
        })
    }
    fn apply(&self, fqn: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        one_d(&self.name(), mesh)?;
        let c = ctx(self, fqn, mesh);
        let (desired, known) =
            if let Some(l) = module.as_any_mut().downcast_mut::<tpar_nn::Linear>() {
                shard_param(&mut l.weight, mesh, Shard(1))?;
                if let Some(b) = &mut l.bias {
                    shard_param(b, mesh, Replicate)?;
                }
                (Shard(-1), Some((-1, l.in_features())))
            } else if let Some(e) = module.as_any_mut().downcast_mut::<tpar_nn::Embedding>() {
                shard_param(&mut e.weight, mesh, Shard(0))?;
                (Replicate, None)
            } else {
                return Err(wrong_type(self, fqn, module));
            };
        install(
            module,
            c,
            vec![Some(self.input_layouts)],
            vec![Some(desired)],
            known,
            None,
            Some(self.output_layouts),
            self.use_local_output,
        );
        Ok(())
    }
}

/// Sequence parallelism for norms: the weight is replicated (its gradient reduced over
/// the mesh), the input and output are sharded on the sequence dim.
///
/// Defaults as PyTorch: `sequence_dim = 1`, `use_local_output = false`. No communication
/// in forward beyond laying out the input as `Shard(sequence_dim)`: a DTensor input
/// needs none; a plain (local) input's global sequence length is known to no rank
/// alone, so the ranks exchange their local shapes (one all_gather of a few i64s) and
/// uneven sequence shards stay exact. Backward sends nothing; the weight's gradient
/// contributions are all-reduced when the gradient is read ([`tpar_nn::Param::grad`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceParallel {
    /// The sequence dim of the input.
    pub sequence_dim: isize,
    /// Hand the next module this rank's shard (true) or the DTensor.
    pub use_local_output: bool,
}

impl Default for SequenceParallel {
    fn default() -> Self {
        SequenceParallel { sequence_dim: 1, use_local_output: false }
    }
}

impl SequenceParallel {
    /// PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets `use_local_output`.
    pub fn use_local_output(mut self, on: bool) -> Self {
        self.use_local_output = on;
        self
    }
}

impl ParallelStyle for SequenceParallel {
    fn name(&self) -> String {
        format!("SequenceParallel(dim {})", self.sequence_dim)
    }
    fn supported(&self) -> &'static [&'static str] {
        &["RMSNorm"]
    }
    fn layouts(&self) -> Option<StyleLayouts> {
        let s = Some(Shard(self.sequence_dim));
        Some(StyleLayouts {
            inputs: vec![Some(InputLayout { given: s, desired: s, use_local: false })],
            output: Some(OutputLayout {
                given: None,
                desired: s,
                use_local: self.use_local_output,
            }),
            shards_params: true,
        })
    }
    fn apply(&self, fqn: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        one_d(&self.name(), mesh)?;
        let c = ctx(self, fqn, mesh);
        let Some(n) = module.as_any_mut().downcast_mut::<tpar_nn::RmsNorm>() else {
            return Err(wrong_type(self, fqn, module));
        };
        shard_param(&mut n.weight, mesh, Replicate)?;
        let s = Shard(self.sequence_dim);
        install(
            module,
            c,
            vec![Some(s)],
            vec![Some(s)],
            None,
            None,
            Some(s),
            self.use_local_output,
        );
        Ok(())
    }
}

/// Lays out a module's inputs: each positional (and named) input given as
/// `input_layouts` is redistributed to `desired_input_layouts`; `None` entries (the RoPE
/// tables, a mask) pass through. Default `use_local_output = false` (the module gets
/// DTensors), as PyTorch.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct PrepareModuleInput {
    /// Layouts of the positional inputs (`None`: not a tensor to convert).
    pub input_layouts: Vec<Option<Placement>>,
    /// Layouts they are redistributed to.
    pub desired_input_layouts: Vec<Option<Placement>>,
    /// Layouts of named inputs.
    pub input_kwarg_layouts: BTreeMap<String, Placement>,
    /// Layouts named inputs are redistributed to.
    pub desired_input_kwarg_layouts: BTreeMap<String, Placement>,
    /// Hand the module local shards instead of DTensors.
    pub use_local_output: bool,
}

impl PrepareModuleInput {
    /// Positional layouts `given -> desired`.
    pub fn new(
        input_layouts: Vec<Option<Placement>>,
        desired_input_layouts: Vec<Option<Placement>>,
    ) -> Self {
        PrepareModuleInput { input_layouts, desired_input_layouts, ..Default::default() }
    }
    /// Adds a named input's layouts.
    pub fn kwarg(mut self, name: &str, given: Placement, desired: Placement) -> Self {
        self.input_kwarg_layouts.insert(name.to_string(), given);
        self.desired_input_kwarg_layouts.insert(name.to_string(), desired);
        self
    }
    /// Sets `use_local_output`.
    pub fn use_local_output(mut self, on: bool) -> Self {
        self.use_local_output = on;
        self
    }
}

impl ParallelStyle for PrepareModuleInput {
    fn name(&self) -> String {
        format!(
            "PrepareModuleInput({} -> {})",
            fmt_opt(&self.input_layouts),
            fmt_opt(&self.desired_input_layouts)
        )
    }
    fn supported(&self) -> &'static [&'static str] {
        &[]
    }
    fn layouts(&self) -> Option<StyleLayouts> {
        let n = self.input_layouts.len().max(self.desired_input_layouts.len());
        let inputs = (0..n)
            .map(|i| {
                let given = self.input_layouts.get(i).copied().flatten();
                let desired = self.desired_input_layouts.get(i).copied().flatten();
                (given.is_some() || desired.is_some()).then_some(InputLayout {
                    given,
                    desired,
                    use_local: self.use_local_output,
                })
            })
            .collect();
        Some(StyleLayouts { inputs, output: None, shards_params: false })
    }
    fn apply(&self, fqn: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        one_d(&self.name(), mesh)?;
        if self.input_layouts.len() != self.desired_input_layouts.len() {
            return Err(PlanError::BadStyle {
                style: self.name(),
                what: "input_layouts and desired_input_layouts differ in length".into(),
            });
        }
        module.core_mut().add_hook(Arc::new(InputHook {
            ctx: ctx(self, fqn, mesh),
            given: self.input_layouts.clone(),
            desired: self.desired_input_layouts.clone(),
            named_given: self.input_kwarg_layouts.clone(),
            named_desired: self.desired_input_kwarg_layouts.clone(),
            use_local_output: self.use_local_output,
            known: None,
        }));
        Ok(())
    }
}

/// Lays out a module's output: a plain output is taken as `output_layouts`, then
/// redistributed to `desired_output_layouts`. Default `use_local_output = true`.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareModuleOutput {
    /// Layout of a plain output.
    pub output_layouts: Placement,
    /// Layout it is redistributed to.
    pub desired_output_layouts: Placement,
    /// Hand the caller this rank's shard.
    pub use_local_output: bool,
}

impl PrepareModuleOutput {
    /// `given -> desired`.
    pub fn new(output_layouts: Placement, desired_output_layouts: Placement) -> Self {
        PrepareModuleOutput { output_layouts, desired_output_layouts, use_local_output: true }
    }
    /// Sets `use_local_output`.
    pub fn use_local_output(mut self, on: bool) -> Self {
        self.use_local_output = on;
        self
    }
}

impl ParallelStyle for PrepareModuleOutput {
    fn name(&self) -> String {
        format!("PrepareModuleOutput({} -> {})", self.output_layouts, self.desired_output_layouts)
    }
    fn supported(&self) -> &'static [&'static str] {
        &[]
    }
    fn layouts(&self) -> Option<StyleLayouts> {
        Some(StyleLayouts {
            inputs: Vec::new(),
            output: Some(OutputLayout {
                given: Some(self.output_layouts),
                desired: Some(self.desired_output_layouts),
                use_local: self.use_local_output,
            }),
            shards_params: false,
        })
    }
    fn apply(&self, fqn: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        one_d(&self.name(), mesh)?;
        module.core_mut().add_hook(Arc::new(OutputHook {
            ctx: ctx(self, fqn, mesh),
            given: Some(self.output_layouts),
            desired: Some(self.desired_output_layouts),
            use_local_output: self.use_local_output,
        }));
        Ok(())
    }
}

/// Both [`PrepareModuleInput`] and [`PrepareModuleOutput`] on one module.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareModuleInputOutput {
    /// The input side.
    pub input: PrepareModuleInput,
    /// The output side.
    pub output: PrepareModuleOutput,
}

impl PrepareModuleInputOutput {
    /// Both sides.
    pub fn new(input: PrepareModuleInput, output: PrepareModuleOutput) -> Self {
        PrepareModuleInputOutput { input, output }
    }
}

impl ParallelStyle for PrepareModuleInputOutput {
    fn name(&self) -> String {
        format!("PrepareModuleInputOutput({}, {})", self.input.name(), self.output.name())
    }
    fn supported(&self) -> &'static [&'static str] {
        &[]
    }
    fn layouts(&self) -> Option<StyleLayouts> {
        let input = self.input.layouts()?;
        Some(StyleLayouts { output: self.output.layouts()?.output, ..input })
    }
    fn apply(&self, fqn: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        self.input.apply(fqn, module, mesh)?;
        self.output.apply(fqn, module, mesh)
    }
}

/// Installs the input hook (given -> desired, handing the module DTensors; `known`: a
/// dim of input 0 whose global size the module knows) and the output hook (-> output
/// layout, local if asked).
fn install(
    module: &mut dyn Module,
    c: Ctx,
    given: Vec<Option<Placement>>,
    desired: Vec<Option<Placement>>,
    known: Option<(isize, usize)>,
    out_given: Option<Placement>,
    out_desired: Option<Placement>,
    use_local_output: bool,
) {
    module.core_mut().add_hook(Arc::new(InputHook {
        ctx: c.clone(),
        given,
        desired,
        named_given: BTreeMap::new(),
        named_desired: BTreeMap::new(),
        use_local_output: false,
        known,
    }));
    module.core_mut().add_hook(Arc::new(OutputHook {
        ctx: c,
        given: out_given,
        desired: out_desired,
        use_local_output,
    }));
}
