//! `parallelize_module`: apply styles to modules by fully-qualified name.

use std::fmt;
use std::sync::Arc;

use tpar_dtensor::Placement;
use tpar_mesh::DeviceMesh;
use tpar_nn::{named_modules, visit_modules_mut, LlamaAttention, Module, Param};

use crate::style::{shard_param, ColwiseParallel, ParallelStyle};
use crate::{PlanError, Result};

/// An ordered map from module FQNs (relative to the module it is applied to; `*`
/// matches one path segment, e.g. `layers.*.mlp.gate_proj`) to styles.
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

    /// Adds `key: style` (later entries apply after earlier ones).
    pub fn add(mut self, key: &str, style: impl ParallelStyle + 'static) -> Self {
        self.entries.push((key.to_string(), Arc::new(style)));
        self
    }

    /// The entries.
    pub fn entries(&self) -> &[(String, Arc<dyn ParallelStyle>)] {
        &self.entries
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
/// Everything is checked before any parameter is touched or any byte is sent: every
/// key must match a module (an unknown key is an error listing the nearest names), each
/// style must fit its module's type, and head-sharded attention must split whole heads.
/// Then styles apply in plan order. Parameters the plan leaves plain become `Replicate`
/// DTensors on `mesh`, so their gradients (contributions from every rank) are reduced
/// like the others'.
pub fn parallelize_module(
    module: &mut dyn Module,
    mesh: &DeviceMesh,
    plan: &ParallelizePlan,
) -> Result<()> {
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
            let mut near: Vec<&String> = names.iter().filter(|n| !n.is_empty()).collect();
            near.sort_by_key(|n| edit_distance(key, n));
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
    // Whole heads per rank for head-sharded attention.
    let tp = mesh.size();
    for (name, m) in &modules {
        let Some(attn) = m.as_any().downcast_ref::<LlamaAttention>() else { continue };
        for (proj, lin) in
            [("q_proj", &attn.q_proj), ("k_proj", &attn.k_proj), ("v_proj", &attn.v_proj)]
        {
            let fqn = if name.is_empty() { proj.to_string() } else { format!("{name}.{proj}") };
            let head_sharded = plan.entries().iter().any(|(k, s)| {
                matches(k, &fqn)
                    && s.name()
                        == ColwiseParallel::new().output_layouts(Placement::Shard(-1)).name()
            });
            let heads = lin.out_features() / attn.head_dim().max(1);
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
    drop(modules);
    // Apply.
    visit_modules_mut(module, "", &mut |fqn, m| {
        for (key, style) in plan.entries() {
            if matches(key, fqn) {
                style.apply(fqn, m, mesh).map_err(|e| match e {
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
