//! The two tensor-parallel plans for the Llama model, written as PyTorch users write
//! them (a per-layer plan applied to every decoder layer, and a top-level plan).

use tpar_dtensor::Placement::{Replicate, Shard};

use crate::{
    ColwiseParallel, ParallelizePlan, PrepareModuleInput, RowwiseParallel, SequenceParallel,
};

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

/// Applies a layer plan to every decoder layer and the top-level plan to the model.
pub fn parallelize_llama(
    model: &mut tpar_nn::LlamaForPretraining,
    tp_mesh: &tpar_mesh::DeviceMesh,
    layer_plan: &ParallelizePlan,
) -> crate::Result<()> {
    for layer in &mut model.base_model.layers.items {
        crate::parallelize_module(layer, tp_mesh, layer_plan)?;
    }
    crate::parallelize_module(model, tp_mesh, &top_level_plan())
}
