//! The two tensor-parallel plans for the Llama model, written as PyTorch users write
//! them (a per-layer plan applied to every decoder layer, and a top-level plan).

use tpar_dtensor::Placement::{self, Replicate, Shard};
use tpar_mesh::DeviceMesh;
use tpar_parallel_styles::{
    apply_plan, check_plan, matches, ColwiseParallel, ParallelizePlan, PlanError,
    PrepareModuleInput, Result, RowwiseParallel, SequenceParallel, StyleLayouts,
};

use crate::{LlamaForPretraining, LlamaStage};

/// The top-level plan shared by both layer plans: vocab-parallel embedding producing
/// sequence-sharded activations, sequence-parallel final norm, and a colwise lm_head
/// whose vocab-sharded logits feed `loss_parallel`.
pub fn top_level_plan() -> ParallelizePlan {
    ParallelizePlan::new()
        .add(
            "base_model.embed_tokens",
            RowwiseParallel::new().input_layouts(Replicate).output_layouts(Shard(1)),
        )
        .add("base_model.norm", SequenceParallel::new())
        .add("lm_head", ColwiseParallel::new().input_layouts(Shard(1)).use_local_output(false))
}

/// Plan 1, the reference plan verbatim: sequence-parallel norms, q/k/v gathered back to
/// `Replicate` (every rank computes attention for all heads), rowwise o_proj and
/// down_proj scattering back to sequence shards.
pub fn sequence_parallel_layer_plan() -> ParallelizePlan {
    ParallelizePlan::new()
        .add("input_layernorm", SequenceParallel::new())
        .add(
            "self_attn",
            PrepareModuleInput::new(
                vec![Some(Shard(1)), None, None],
                vec![Some(Replicate), None, None],
            ),
        )
        .add("self_attn.q_proj", ColwiseParallel::new().output_layouts(Replicate))
        .add("self_attn.k_proj", ColwiseParallel::new().output_layouts(Replicate))
        .add("self_attn.v_proj", ColwiseParallel::new().output_layouts(Replicate))
        .add(
            "self_attn.o_proj",
            RowwiseParallel::new().input_layouts(Replicate).output_layouts(Shard(1)),
        )
        .add("post_attention_layernorm", SequenceParallel::new())
        .add("mlp", PrepareModuleInput::new(vec![Some(Shard(1))], vec![Some(Replicate)]))
        .add("mlp.gate_proj", ColwiseParallel::new())
        .add("mlp.up_proj", ColwiseParallel::new())
        .add("mlp.down_proj", RowwiseParallel::new().output_layouts(Shard(1)))
}

/// Plan 2, Megatron-style sequence parallelism: q/k/v shard their heads (attention runs
/// on this rank's heads only, nothing gathered back), o_proj reduces-scatters; one
/// all_gather and one reduce_scatter per sub-layer in forward, their adjoints backward.
pub fn megatron_layer_plan() -> ParallelizePlan {
    ParallelizePlan::new()
        .add("input_layernorm", SequenceParallel::new())
        .add(
            "self_attn",
            PrepareModuleInput::new(
                vec![Some(Shard(1)), None, None],
                vec![Some(Replicate), None, None],
            ),
        )
        .add("self_attn.q_proj", ColwiseParallel::new())
        .add("self_attn.k_proj", ColwiseParallel::new())
        .add("self_attn.v_proj", ColwiseParallel::new())
        .add("self_attn.o_proj", RowwiseParallel::new().output_layouts(Shard(1)))
        .add("post_attention_layernorm", SequenceParallel::new())
        .add("mlp", PrepareModuleInput::new(vec![Some(Shard(1))], vec![Some(Replicate)]))
        .add("mlp.gate_proj", ColwiseParallel::new())
        .add("mlp.up_proj", ColwiseParallel::new())
        .add("mlp.down_proj", RowwiseParallel::new().output_layouts(Shard(1)))
}

/// Applies a layer plan to every decoder layer and [`top_level_plan`] to the model (see
/// [`parallelize_llama_with`]).
pub fn parallelize_llama(
    model: &mut LlamaForPretraining,
    tp_mesh: &DeviceMesh,
    layer_plan: &ParallelizePlan,
) -> Result<()> {
    parallelize_llama_with(model, tp_mesh, layer_plan, &top_level_plan())
}

/// Applies `layer_plan` to every decoder layer (keys relative to the layer:
/// `self_attn.q_proj`) and `top_plan` to the model (keys relative to it:
/// `base_model.norm`), as torchtitan's `parallelize_llama` does.
///
/// Everything is checked first, before any parameter changes or any byte is sent:
/// [`check_plan`] on every layer and on the model (unknown keys with the nearest names,
/// styles that do not fit their module's type, heads that do not divide), then
/// [`check_llama_plan`] (adjacent layouts that cannot meet). Hooks and traces name
/// modules by their full FQN (`base_model.layers.3.self_attn.q_proj`).
pub fn parallelize_llama_with(
    model: &mut LlamaForPretraining,
    tp_mesh: &DeviceMesh,
    layer_plan: &ParallelizePlan,
    top_plan: &ParallelizePlan,
) -> Result<()> {
    for layer in &model.base_model.layers.items {
        check_plan(layer, tp_mesh, layer_plan)?;
    }
    check_plan(model, tp_mesh, top_plan)?;
    check_llama_plan(model, layer_plan, top_plan)?;
    for (i, layer) in model.base_model.layers.items.iter_mut().enumerate() {
        apply_plan(layer, &format!("base_model.layers.{i}"), tp_mesh, layer_plan)?;
    }
    apply_plan(model, "", tp_mesh, top_plan)
}

/// [`parallelize_llama_with`] for one pipeline stage: `layer_plan` on each of the
/// stage's decoder layers, and the entries of `top_plan` whose module the stage holds
/// (the embedding on the first stage, the norm and head on the last). Everything is
/// checked as for the whole model first: keys against the whole model (a key no stage
/// has is an error with the nearest names, a key another stage has is skipped here), and
/// the layouts where the stage's modules meet, on a meta-device copy of the whole model.
pub fn parallelize_llama_stage(
    stage: &mut LlamaStage,
    tp_mesh: &DeviceMesh,
    layer_plan: &ParallelizePlan,
    top_plan: &ParallelizePlan,
) -> Result<()> {
    let whole = LlamaForPretraining::new(&stage.config, tpar_tensor::Device::Meta)?;
    if let Some(layer) = whole.base_model.layers.items.first() {
        check_plan(layer, tp_mesh, layer_plan)?;
    }
    check_plan(&whole, tp_mesh, top_plan)?;
    check_llama_plan(&whole, layer_plan, top_plan)?;
    let present: Vec<String> =
        tpar_nn::named_modules(&*stage).into_iter().map(|(n, _)| n).collect();
    let top = top_plan.filtered(|k| present.iter().any(|fqn| matches(k, fqn)));
    check_plan(&*stage, tp_mesh, &top)?;
    let first = stage.base_model.layers.first_index();
    for (i, layer) in stage.base_model.layers.items.iter_mut().enumerate() {
        apply_plan(layer, &format!("base_model.layers.{}", first + i), tp_mesh, layer_plan)?;
    }
    apply_plan(stage, "", tp_mesh, &top)
}

/// Checks statically that the layouts of adjacent modules meet under `layer_plan` (per
/// decoder layer) and `top_plan` (whole model), walking the Llama's data flow: the ids
/// into `embed_tokens`, its output into each layer (the input norm and the residual),
/// the attention's output (`o_proj`) into the residual add, the post-attention norm,
/// the MLP's output (`down_proj`) into the second residual add, the final norm, and
/// `lm_head` into the loss. No communication, no parameter touched.
///
/// A DTensor handed from one module to the next always meets (it carries its
/// placements and is redistributed as needed). A plain (local) tensor carries the
/// layout its producer declared (the `output_layouts` of a style with
/// `use_local_output`, `SequenceParallel`'s `Shard(sequence_dim)`, the layout a plain
/// module's input had), and its consumer must take it as exactly that layout (a
/// style's `input_layouts`, `PrepareModuleInput`'s given layouts, `SequenceParallel`'s
/// `Shard(sequence_dim)`); both residual operands must agree; q/k/v must agree and keep
/// whole sequences; a plain Linear or RMSNorm needs the whole feature dim; plain logits
/// must be whole. A mismatch is [`PlanError::LayoutMismatch`] naming both modules and
/// both layouts. Styles defined outside this crate declare no layouts
/// ([`ParallelStyle::layouts`](tpar_parallel_styles::ParallelStyle::layouts)); what flows through them is not checked.
pub fn check_llama_plan(
    model: &LlamaForPretraining,
    layer_plan: &ParallelizePlan,
    top_plan: &ParallelizePlan,
) -> Result<()> {
    let w = Walker { layer_plan, top_plan };
    let ids = Flow { dtensor: false, layout: Some(Replicate), rank: 2, from: "input_ids".into() };
    let ids = w.enter("", ids)?;
    let ids = w.enter("base_model", ids)?;
    let x = w.leaf("base_model.embed_tokens", Leaf::Embedding, ids)?;
    let mut x = w.enter("base_model.layers", x)?;
    for i in 0..model.base_model.layers.items.len() {
        x = w.layer(&format!("base_model.layers.{i}"), x)?;
    }
    let x = w.exit("base_model.layers", x)?;
    let x = w.leaf("base_model.norm", Leaf::Norm, x)?;
    let x = w.exit("base_model", x)?;
    let logits = w.leaf("lm_head", Leaf::Linear, x)?;
    let logits = w.exit("", logits)?;
    w.meet(&logits, Replicate, "the loss (cross_entropy on plain logits)")
}

/// What one module hands the next, as far as the static check can tell.
#[derive(Clone, Debug)]
struct Flow {
    /// A DTensor (meets any consumer) or a plain local tensor.
    dtensor: bool,
    /// Its layout, normalised for `rank` dims; `None` when the check cannot tell.
    layout: Option<Placement>,
    /// The tensor's number of dims (2 for ids, 3 for activations).
    rank: usize,
    /// The producer (FQN and side), for messages.
    from: String,
}

#[derive(Clone, Copy, PartialEq)]
enum Leaf {
    Linear,
    Embedding,
    Norm,
}

fn norm(p: Placement, rank: usize) -> Placement {
    match p {
        Shard(d) if d < 0 => Shard(d + rank as isize),
        p => p,
    }
}

struct Walker<'a> {
    layer_plan: &'a ParallelizePlan,
    top_plan: &'a ParallelizePlan,
}

impl Walker<'_> {
    /// The layouts of the styles on `fqn`, in the order their hooks run (layer plan,
    /// then top plan); `None` when a style declares none.
    fn styles(&self, fqn: &str) -> Option<Vec<StyleLayouts>> {
        let mut out = Vec::new();
        if let Some(rest) = fqn.strip_prefix("base_model.layers.") {
            let rel = rest.split_once('.').map_or("", |(_, r)| r);
            for (k, s) in self.layer_plan.entries() {
                if matches(k, rel) {
                    out.push(s.layouts()?);
                }
            }
        }
        for (k, s) in self.top_plan.entries() {
            if matches(k, fqn) {
                out.push(s.layouts()?);
            }
        }
        Some(out)
    }

    fn unknown(fqn: &str, rank: usize) -> Flow {
        Flow { dtensor: true, layout: None, rank, from: fqn.to_string() }
    }

    /// A plain `flow` must be laid out as `expected` for `consumer`.
    fn meet(&self, flow: &Flow, expected: Placement, consumer: &str) -> Result<()> {
        let expected = norm(expected, flow.rank);
        match flow.layout {
            Some(l) if !flow.dtensor && l != expected => Err(PlanError::LayoutMismatch {
                producer: flow.from.clone(),
                produced: l.to_string(),
                consumer: consumer.to_string(),
                expected: expected.to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// `x` through the input hooks of the styles on `fqn` (input 0).
    fn enter(&self, fqn: &str, x: Flow) -> Result<Flow> {
        let Some(styles) = self.styles(fqn) else { return Ok(Self::unknown(fqn, x.rank)) };
        let hooks = styles.iter().filter_map(|s| s.inputs.first().copied().flatten());
        let hooks = hooks.map(|i| (i.given, i.desired, i.use_local));
        self.through(fqn, x, hooks, "input", "input hook")
    }

    /// The module's own output `raw` through the output hooks of the styles on `fqn`.
    fn exit(&self, fqn: &str, raw: Flow) -> Result<Flow> {
        let Some(styles) = self.styles(fqn) else { return Ok(Self::unknown(fqn, raw.rank)) };
        let hooks =
            styles.iter().filter_map(|s| s.output).map(|o| (o.given, o.desired, o.use_local));
        self.through(fqn, raw, hooks, "output hook", "output")
    }

    /// `x` through hooks given as `(given, desired, use_local)`: a DTensor keeps its own
    /// layout unless one is desired; a plain tensor must meet the hook's given layout.
    fn through(
        &self,
        fqn: &str,
        mut x: Flow,
        hooks: impl Iterator<Item = (Option<Placement>, Option<Placement>, bool)>,
        meets_as: &str,
        from_as: &str,
    ) -> Result<Flow> {
        for (given, desired, use_local) in hooks {
            let layout = if x.dtensor {
                desired.or(x.layout)
            } else if let Some(g) = given {
                self.meet(&x, g, &format!("{} ({meets_as})", shown(fqn)))?;
                Some(desired.unwrap_or(g))
            } else {
                continue;
            };
            x = Flow {
                dtensor: !use_local,
                layout: layout.map(|p| norm(p, x.rank)),
                rank: x.rank,
                from: format!("{} ({from_as})", shown(fqn)),
            };
        }
        Ok(x)
    }

    /// A Linear, Embedding or RMSNorm: input hooks, the computation, output hooks.
    fn leaf(&self, fqn: &str, kind: Leaf, x: Flow) -> Result<Flow> {
        let Some(styles) = self.styles(fqn) else { return Ok(Self::unknown(fqn, 3)) };
        let sharded = styles.iter().any(|s| s.shards_params);
        let x = self.enter(fqn, x)?;
        let raw = if x.dtensor {
            // DTensor compute: the layout follows from the ops; the sharding styles'
            // output hooks fix it below.
            let layout = match x.layout {
                _ if sharded || kind == Leaf::Embedding => None,
                Some(Shard(2)) => None,
                l => l,
            };
            Flow { dtensor: true, layout, rank: 3, from: format!("{fqn} (output)") }
        } else {
            // Plain compute with whole (replicated) parameters: per token, so the
            // sequence layout carries over, but the feature dim must be whole.
            if kind != Leaf::Embedding && x.layout == Some(Shard(2)) {
                return Err(PlanError::LayoutMismatch {
                    producer: x.from,
                    produced: Shard(2).to_string(),
                    consumer: format!("{fqn} (no sharding style: it needs whole features)"),
                    expected: "R or S(1)".into(),
                });
            }
            Flow { dtensor: false, layout: x.layout, rank: 3, from: format!("{fqn} (output)") }
        };
        self.exit(fqn, raw)
    }

    /// `x + h`: a plain operand must be laid out as the other.
    fn residual(&self, fqn: &str, x: &Flow, h: Flow) -> Result<Flow> {
        if x.dtensor && h.dtensor {
            return Ok(Flow { from: format!("{fqn} (residual)"), ..x.clone() });
        }
        if let (Some(a), Some(b)) = (x.layout, h.layout) {
            if a != b {
                return Err(PlanError::LayoutMismatch {
                    producer: h.from,
                    produced: b.to_string(),
                    consumer: format!("{fqn} (residual add with {}, laid out as {a})", x.from),
                    expected: a.to_string(),
                });
            }
        }
        Ok(Flow {
            dtensor: false,
            layout: x.layout.or(h.layout),
            rank: 3,
            from: format!("{fqn} (residual)"),
        })
    }

    /// Two operands of an elementwise op on local tensors must be laid out alike.
    fn agree(&self, consumer: &str, a: &Flow, b: &Flow) -> Result<()> {
        match (a.layout, b.layout) {
            (Some(la), Some(lb)) if la != lb => Err(PlanError::LayoutMismatch {
                producer: b.from.clone(),
                produced: lb.to_string(),
                consumer: format!("{consumer} (with {}, laid out as {la})", a.from),
                expected: la.to_string(),
            }),
            _ => Ok(()),
        }
    }

    fn attention(&self, fqn: &str, x: Flow) -> Result<Flow> {
        let x = self.enter(fqn, x)?;
        let q = self.leaf(&format!("{fqn}.q_proj"), Leaf::Linear, x.clone())?;
        let k = self.leaf(&format!("{fqn}.k_proj"), Leaf::Linear, x.clone())?;
        let v = self.leaf(&format!("{fqn}.v_proj"), Leaf::Linear, x)?;
        let sdpa = format!("{fqn} (scaled_dot_product_attention)");
        self.agree(&sdpa, &q, &k)?;
        self.agree(&sdpa, &q, &v)?;
        if let Some(l) = q.layout.filter(|l| !matches!(l, Replicate | Shard(2))) {
            return Err(PlanError::LayoutMismatch {
                producer: q.from,
                produced: l.to_string(),
                consumer: sdpa,
                expected: "R or S(2) (whole sequences; heads may be sharded)".into(),
            });
        }
        // Attention runs on local tensors; its output keeps q's layout (heads).
        let a = Flow {
            dtensor: false,
            layout: q.layout,
            rank: 3,
            from: format!("{fqn} (attention output)"),
        };
        let o = self.leaf(&format!("{fqn}.o_proj"), Leaf::Linear, a)?;
        self.exit(fqn, o)
    }

    fn mlp(&self, fqn: &str, x: Flow) -> Result<Flow> {
        let x = self.enter(fqn, x)?;
        let g = self.leaf(&format!("{fqn}.gate_proj"), Leaf::Linear, x.clone())?;
        let u = self.leaf(&format!("{fqn}.up_proj"), Leaf::Linear, x)?;
        let h = if g.dtensor && u.dtensor {
            Flow { from: format!("{fqn} (silu(gate) * up)"), ..g }
        } else {
            self.agree(&format!("{fqn} (silu(gate) * up)"), &g, &u)?;
            Flow {
                dtensor: false,
                layout: g.layout.or(u.layout),
                rank: 3,
                from: format!("{fqn} (silu(gate) * up)"),
            }
        };
        let d = self.leaf(&format!("{fqn}.down_proj"), Leaf::Linear, h)?;
        self.exit(fqn, d)
    }

    fn layer(&self, fqn: &str, x: Flow) -> Result<Flow> {
        let x = self.enter(fqn, x)?;
        let h = self.leaf(&format!("{fqn}.input_layernorm"), Leaf::Norm, x.clone())?;
        let h = self.attention(&format!("{fqn}.self_attn"), h)?;
        let x = self.residual(fqn, &x, h)?;
        let h = self.leaf(&format!("{fqn}.post_attention_layernorm"), Leaf::Norm, x.clone())?;
        let h = self.mlp(&format!("{fqn}.mlp"), h)?;
        let x = self.residual(fqn, &x, h)?;
        self.exit(fqn, x)
    }
}

/// The root module's name in messages.
fn shown(fqn: &str) -> &str {
    if fqn.is_empty() {
        "the model"
    } else {
        fqn
    }
}
