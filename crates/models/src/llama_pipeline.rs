//! A Llama cut into pipeline stages: each stage owns a contiguous range of decoder
//! layers, the first also the embedding, the last also the final norm and the head, with
//! the whole model's module names (`base_model.layers.5.mlp.up_proj`), so plans, FSDP and
//! checkpoints keyed by FQN apply to a stage unchanged.

use std::ops::Range;
use std::sync::Arc;

use tpar_nn::{
    call, module_boilerplate, Args, Embedding, Linear, Module, ModuleCore, ModuleList, NnError,
    Result, RmsNorm, Value,
};
use tpar_tensor::{DType, Device};

use crate::llama::attention_mask;
use crate::{LlamaConfig, LlamaDecoderLayer, RotaryPositionEncoding};
use tpar_nn::CheckpointWrapper;

/// The transformer part of a [`LlamaStage`], named `base_model` as in
/// [`crate::LlamaForPretraining`]: the embedding (first stage only), this stage's
/// decoder layers under their whole-model indices, and the final norm (last stage only).
pub struct LlamaStageModel {
    core: ModuleCore,
    /// Token embedding (first stage only).
    pub embed_tokens: Option<Embedding>,
    /// This stage's decoder layers, named by their index in the whole model.
    pub layers: ModuleList<CheckpointWrapper<LlamaDecoderLayer>>,
    /// Final norm (last stage only).
    pub norm: Option<RmsNorm>,
    /// RoPE tables.
    pub rotary_emb: RotaryPositionEncoding,
    max_positions: usize,
    dtype: DType,
    /// Set by [`crate::context_parallel::apply_context_parallel_stage`].
    pub(crate) context_parallel: Option<crate::context_parallel::CpConfig>,
}

impl Module for LlamaStageModel {
    fn type_name(&self) -> &'static str {
        "LlamaStageModel"
    }

    /// Inputs: token ids `[b, s]` (i64) on the first stage, hidden states `[b, s, hidden]`
    /// (this rank's sequence shard under sequence parallelism) on the others; then the
    /// optional mask in [`crate::LlamaModel`]'s forms, which every stage needs (a
    /// `[b, s]` padding mask or an additive `[b, 1, s, s]` mask; none for plain causal).
    /// Output: hidden states (normed on the last stage).
    fn forward(&self, args: Args) -> Result<Value> {
        let who = "LlamaStageModel";
        let x = args.get(0);
        let dims = x.shape()?;
        if dims.len() != if self.embed_tokens.is_some() { 2 } else { 3 } {
            return Err(NnError::BadInput {
                module: who.into(),
                what: format!(
                    "expected {} , got shape {dims:?}",
                    if self.embed_tokens.is_some() {
                        "input_ids [batch, seq]"
                    } else {
                        "hidden states [batch, seq, hidden]"
                    }
                ),
            });
        }
        let b = dims[0];
        let device = x.clone().into_local(who)?.device();
        let given = args.get(1).into_optional_tensor(who)?;
        // The sequence length: from the ids on the first stage, from the mask on the
        // others (the hidden states may be sequence-sharded); without a mask the whole
        // RoPE tables go on and attention takes the positions it needs.
        let s = match (&self.embed_tokens, &given) {
            (Some(_), _) => Some(dims[1]),
            (None, Some(m)) if m.rank() == 4 => Some(m.dims()[2]),
            (None, Some(m)) => Some(m.dims().get(1).copied().unwrap_or(0)),
            (None, None) => None,
        };
        let (mask, rope) = match &self.context_parallel {
            // Under context parallelism every stage's input holds this rank's rows (the
            // mask's length: hidden states may be sequence-sharded over tp too).
            Some(cp) => crate::context_parallel::cp_inputs(
                cp,
                &self.rotary_emb,
                given.as_ref(),
                b,
                s.unwrap_or(dims[1]),
                self.dtype,
                device,
            )?,
            None => {
                let mask = match s {
                    Some(s) => attention_mask(given.as_ref(), b, s, self.dtype, device)?,
                    None => None,
                };
                let rope = self.rotary_emb.tables_on(s.unwrap_or(self.max_positions), device)?;
                (mask, Value::Opaque(Arc::new(rope)))
            }
        };
        let mut x = match &self.embed_tokens {
            Some(e) => call(e, Args::new(vec![x]))?,
            None => x,
        };
        let mask = mask.map(Value::Tensor).unwrap_or(Value::None);
        if !self.layers.items.is_empty() {
            x = call(&self.layers, Args::new(vec![x, rope, mask]))?;
        }
        match &self.norm {
            Some(n) => call(n, Args::new(vec![x])),
            None => Ok(x),
        }
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = Vec::new();
        if let Some(e) = &self.embed_tokens {
            c.push(("embed_tokens".into(), e));
        }
        c.push(("layers".into(), &self.layers));
        if let Some(n) = &self.norm {
            c.push(("norm".into(), n));
        }
        c
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> = Vec::new();
        if let Some(e) = &mut self.embed_tokens {
            c.push(("embed_tokens".into(), e));
        }
        c.push(("layers".into(), &mut self.layers));
        if let Some(n) = &mut self.norm {
            c.push(("norm".into(), n));
        }
        c
    }

    module_boilerplate!();
}

/// One pipeline stage of a [`crate::LlamaForPretraining`]: the same module names, only
/// this stage's parts. Build it on `Device::Meta`, apply plans and FSDP, then
/// `reset_parameters`: each rank materializes only its own stage, with the values the
/// whole model would have (initialisation depends only on the seed and the FQN).
///
/// ```
/// use tpar_models::{LlamaConfig, LlamaStage};
/// use tpar_nn::named_parameters;
/// use tpar_tensor::Device;
/// let cfg = LlamaConfig {
///     vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 5,
///     num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 16,
///     ..Default::default()
/// };
/// // 5 layers over 3 stages: 0..2, 2..4, 4..5.
/// let mid = LlamaStage::for_stage(&cfg, 1, 3, None, Device::Meta)?;
/// let names: Vec<String> = named_parameters(&mid).into_iter().map(|(n, _)| n).collect();
/// assert!(names.contains(&"base_model.layers.3.mlp.up_proj.weight".to_string()));
/// assert!(!names.iter().any(|n| n.contains("embed_tokens") || n.contains("lm_head")));
/// let last = LlamaStage::for_stage(&cfg, 2, 3, None, Device::Meta)?;
/// assert_eq!(last.layer_range(), 4..5);
/// assert!(last.lm_head.is_some());
/// # Ok::<(), tpar_nn::NnError>(())
/// ```
pub struct LlamaStage {
    core: ModuleCore,
    /// Embedding, layers, norm (each as this stage has them).
    pub base_model: LlamaStageModel,
    /// The language-model head (last stage only).
    pub lm_head: Option<Linear>,
    /// The whole model's configuration.
    pub config: LlamaConfig,
    layers: Range<usize>,
}

impl LlamaStage {
    /// The stage owning decoder `layers`, with the embedding when `first` and the final
    /// norm and head when `last`.
    pub fn new(
        cfg: &LlamaConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
        device: Device,
    ) -> Result<Self> {
        cfg.validate()?;
        if layers.end > cfg.num_hidden_layers || layers.start > layers.end {
            return Err(NnError::Config {
                what: format!(
                    "stage layers {layers:?} outside the model's {} layers",
                    cfg.num_hidden_layers
                ),
            });
        }
        let items = layers
            .clone()
            .map(|_| LlamaDecoderLayer::new(cfg, device).map(CheckpointWrapper::new))
            .collect::<Result<Vec<_>>>()?;
        let base_model = LlamaStageModel {
            core: ModuleCore::default(),
            embed_tokens: first
                .then(|| Embedding::new(cfg.vocab_size, cfg.hidden_size, cfg.dtype, device))
                .transpose()?,
            layers: ModuleList::starting_at(layers.start, items),
            norm: last
                .then(|| RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device))
                .transpose()?,
            rotary_emb: RotaryPositionEncoding::new(
                cfg.head_dim(),
                cfg.max_position_embeddings,
                cfg.rope_theta,
                cfg.dtype,
            )?
            .with_scaling(cfg.rope_scaling),
            max_positions: cfg.max_position_embeddings,
            dtype: cfg.dtype,
            context_parallel: None,
        };
        Ok(LlamaStage {
            core: ModuleCore::default(),
            base_model,
            lm_head: last
                .then(|| Linear::new(cfg.hidden_size, cfg.vocab_size, false, cfg.dtype, device))
                .transpose()?,
            config: *cfg,
            layers,
        })
    }

    /// Stage `stage_index` of `num_stages`, its layers given by
    /// [`tpar_pipeline::split_blocks`] (an even split, or `boundaries`: the layer indices
    /// where stages `1..num_stages` start).
    pub fn for_stage(
        cfg: &LlamaConfig,
        stage_index: usize,
        num_stages: usize,
        boundaries: Option<&[usize]>,
        device: Device,
    ) -> Result<Self> {
        let ranges = tpar_pipeline::split_blocks(cfg.num_hidden_layers, num_stages, boundaries)
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        let Some(layers) = ranges.get(stage_index).cloned() else {
            return Err(NnError::Config {
                what: format!("stage index {stage_index} out of range for {num_stages} stages"),
            });
        };
        Self::new(cfg, layers, stage_index == 0, stage_index + 1 == num_stages, device)
    }

    /// The decoder layers this stage owns (indices in the whole model).
    pub fn layer_range(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Whether this stage holds the embedding (takes token ids).
    pub fn is_first(&self) -> bool {
        self.base_model.embed_tokens.is_some()
    }

    /// Whether this stage holds the head (gives logits).
    pub fn is_last(&self) -> bool {
        self.lm_head.is_some()
    }
}

impl Module for LlamaStage {
    fn type_name(&self) -> &'static str {
        "LlamaStage"
    }

    /// Inputs as [`LlamaStageModel`]; output: logits `[b, s, vocab]` on the last stage
    /// (plain, or vocab-sharded under a plan that keeps them distributed), hidden states
    /// on the others.
    fn forward(&self, args: Args) -> Result<Value> {
        let h = call(&self.base_model, args)?;
        match &self.lm_head {
            Some(head) => call(head, Args::new(vec![h])),
            None => Ok(h),
        }
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![("base_model".into(), &self.base_model)];
        if let Some(h) = &self.lm_head {
            c.push(("lm_head".into(), h));
        }
        c
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> =
            vec![("base_model".into(), &mut self.base_model)];
        if let Some(h) = &mut self.lm_head {
            c.push(("lm_head".into(), h));
        }
        c
    }

    module_boilerplate!();
}
