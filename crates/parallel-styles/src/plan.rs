//! `parallelize_module`: apply styles to modules by fully-qualified name.

use std::fmt;
use std::sync::Arc;

use tpar_dtensor::Placement;
use tpar_mesh::DeviceMesh;
use tpar_nn::{named_modules, visit_modules_mut, Module, Param};

use crate::style::{shard_param, ParallelStyle};
use crate::{PlanError, Result};

/// An ordered map from module FQNs (relative to the module it is applied to; `*`
/// matches one path segment, e.g. `layers.*.mlp.gate_proj`) to styles. Every entry
/// whose key matches a module applies to it, in plan order (a wildcard key and an exact
/// key may both match); adding a key that is already in the plan replaces its style.
#[derive(Clone, Default)]
pub struct ParallelizePlan {
    entries: Vec<(String, Arc<dyn ParallelStyle>)>,
}

impl fmt::Debug for ParallelizePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.entries.iter().map(|(k, s)| (k, s.name()))).finish()
    }
}

impl fmt::Display for ParallelizePlan {
    /// One `key: style` line per entry.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, s) in &self.entries {
            writeln!(f, "{k}: {}", s.name())?;
        }
        Ok(())
    }
}

impl ParallelizePlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `key: style` (later entries apply after earlier ones); a key already in the
    /// plan keeps its place and gets the new style, as assigning to a dict key does.
    pub fn add(mut self, key: &str, style: impl ParallelStyle + 'static) -> Self {
        let style: Arc<dyn ParallelStyle> = Arc::new(style);
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = style,
            None => self.entries.push((key.to_string(), style)),
        }
        self
    }

    /// The entries.
    pub fn entries(&self) -> &[(String, Arc<dyn ParallelStyle>)] {
        &self.entries
    }

    /// The plan with only the entries whose key `keep` accepts, in the same order (e.g.
    /// the part of a whole model's plan that concerns one pipeline stage).
    pub fn filtered(&self, keep: impl Fn(&str) -> bool) -> ParallelizePlan {
        ParallelizePlan { entries: self.entries.iter().filter(|(k, _)| keep(k)).cloned().collect() }
    }
}

/// Whether `fqn` matches `pattern` (`*` matches one segment).
pub fn matches(pattern: &str, fqn: &str) -> bool {
    if pattern.is_empty() || fqn.is_empty() {
        return pattern == fqn;
    }
    let (p, f): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), fqn.split('.').collect());
    p.len() == f.len() && p.iter().zip(&f).all(|(a, b)| *a == "*" || a == b)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Applies `plan` to `module` over the 1-d `mesh`.
///
/// Everything is checked before any parameter is touched or any byte is sent (see
/// [`check_plan`]): every key must match a module (an unknown key is an error listing
/// the nearest names), each style must fit its module's type, and head-sharded
/// attention must split whole heads. Then styles apply in plan order. Parameters the
/// plan leaves plain become `Replicate` DTensors on `mesh`, so their gradients
/// (contributions from every rank) are reduced like the others'.
pub fn parallelize_module(
    module: &mut dyn Module,
    mesh: &DeviceMesh,
    plan: &ParallelizePlan,
) -> Result<()> {
    check_plan(module, mesh, plan)?;
    apply_plan(module, "", mesh, plan)
}

/// The static checks [`parallelize_module`] runs before it changes anything: a 1-d
/// mesh, every key matching a module ([`PlanError::UnknownKeys`] with the nearest
/// names), every style fitting its module's type ([`PlanError::WrongModuleType`]), and
/// whole attention heads per rank where a plan shards q/k/v heads
/// ([`PlanError::Indivisible`]). No communication.
pub fn check_plan(module: &dyn Module, mesh: &DeviceMesh, plan: &ParallelizePlan) -> Result<()> {
    if mesh.ndim() != 1 {
        return Err(PlanError::BadStyle {
            style: "parallelize_module".into(),
            what: format!("needs a 1-d mesh (e.g. mesh[\"tp\"]), got {mesh}"),
        });
    }
    let modules = named_modules(module);
    let names: Vec<String> = modules.iter().map(|(n, _)| n.clone()).collect();
    // Unknown keys.
    let mut unknown = Vec::new();
    let mut suggestions = Vec::new();
    for (key, _) in plan.entries() {
        if !names.iter().any(|n| matches(key, n)) {
            // Names the key starts (a truncated name) first, then by edit distance.
            let mut near: Vec<&String> = names.iter().filter(|n| !n.is_empty()).collect();
            near.sort_by_key(|n| (!n.starts_with(key.as_str()), edit_distance(key, n)));
            suggestions.push(near.first().map(|s| s.to_string()).unwrap_or_default());
            unknown.push(key.clone());
        }
    }
    if !unknown.is_empty() {
        let shown: Vec<&str> = names
            .iter()
            .filter(|n| !n.is_empty() && !n.contains("layers.1"))
            .take(24)
            .map(|s| s.as_str())
            .collect();
        return Err(PlanError::UnknownKeys {
            keys: unknown,
            suggestions,
            available: shown.join(", "),
        });
    }
    // Types.
    for (key, style) in plan.entries() {
        for (name, m) in modules.iter().filter(|(n, _)| matches(key, n)) {
            let ok = style.supported().is_empty() || style.supported().contains(&m.type_name());
            if !ok {
                return Err(PlanError::WrongModuleType {
                    style: style.name(),
                    fqn: name.clone(),
                    module_type: m.type_name().to_string(),
                    supported: style.supported().join(", "),
                });
            }
        }
    }
    // Whole heads per rank for head-sharded attention: a projection whose last style
    // that lays out its output leaves it sharded on the feature (head) dim.
    let tp = mesh.size();
    for (name, m) in &modules {
        let Some(attn) = m.attention_heads() else { continue };
        for (proj, out_features) in attn.projections {
            let fqn = if name.is_empty() { proj.to_string() } else { format!("{name}.{proj}") };
            let out = plan
                .entries()
                .iter()
                .filter(|(k, _)| matches(k, &fqn))
                .filter_map(|(_, s)| s.layouts()?.output?.desired)
                .next_back();
            let head_sharded = matches!(out, Some(Placement::Shard(-1) | Placement::Shard(2)));
            let heads = out_features / attn.head_dim.max(1);
            if head_sharded && heads % tp != 0 {
                return Err(PlanError::Indivisible {
                    fqn,
                    what: format!(
                        "{heads} heads cannot be sharded over {tp} ranks (whole heads per rank)"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Applies `plan` (already checked) to `module`, whose FQN is `prefix` (hooks and
/// traces name modules by `prefix` + their relative name); then replicates every
/// parameter the plan left plain. Run [`check_plan`] first: this is the second half
/// of [`parallelize_module`], for a plan applied to one submodule of a larger model
/// (each decoder layer of a Llama, say) so that its FQNs stay the model's.
pub fn apply_plan(
    module: &mut dyn Module,
    prefix: &str,
    mesh: &DeviceMesh,
    plan: &ParallelizePlan,
) -> Result<()> {
    visit_modules_mut(module, "", &mut |fqn, m| {
        for (key, style) in plan.entries() {
            if matches(key, fqn) {
                let full = match (prefix.is_empty(), fqn.is_empty()) {
                    (true, _) => fqn.to_string(),
                    (false, true) => prefix.to_string(),
                    (false, false) => format!("{prefix}.{fqn}"),
                };
                style.apply(&full, m, mesh).map_err(|e| match e {
                    PlanError::Nn(n) => n,
                    other => tpar_nn::NnError::Config { what: other.to_string() },
                })?;
            }
        }
        Ok(())
    })?;
    // Replicate the rest.
    visit_modules_mut(module, "", &mut |_, m| {
        for slot in m.param_slots() {
            if matches!(slot.param, Param::Tensor(_)) {
                shard_param(slot.param, mesh, Placement::Replicate)
                    .map_err(|e| tpar_nn::NnError::Config { what: e.to_string() })?;
            }
        }
        Ok(())
    })?;
    Ok(())
}
