//! Tensor-parallel collectives counted per kind on rank 0, one forward + loss + backward
//! of a Llama (2 decoder layers, 4 heads, 2 kv heads), against PyTorch's
//! `CommDebugMode` counts for the same model and plans (see the constants' docs):
//! tpar issues no more of any kind, in forward and in backward, on the tp group and, at
//! dp 2 x tp 2 with FSDP per layer and on the root, on the dp group. The gradients
//! still equal the unsharded model's.

use std::collections::BTreeMap;
use std::time::Duration;

use tpar_collectives::{spawn_scoped, CollectiveKind, CommRecord, SpawnConfig};
use tpar_dtensor::Placement::Replicate;
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::llama_plans::{
    megatron_layer_plan, parallelize_llama_with, sequence_parallel_layer_plan, top_level_plan,
};
use tpar_models::LlamaForPretraining;
use tpar_nn::{named_parameters, reset_parameters, NnError};
use tpar_parallel_styles::{
    explain_collectives, fully_shard, loss_parallel, unshard, ColwiseParallel, FsdpConfig,
    ParallelizePlan, RowwiseParallel,
};
use tpar_tensor::{tol::Tol, DType, Device};

mod common;
use common::{config, global_batch, loss_of, plan_err, reference_grads};

use CollectiveKind::{AllGather, AllReduce, ReduceScatter};

/// Per-kind calls: (all_gather, reduce_scatter, all_reduce).
type Counts = (usize, usize, usize);

fn counts(recs: &[CommRecord], group: &[usize]) -> Counts {
    let n = |k| recs.iter().filter(|r| r.kind == k && r.group == group).count();
    (n(AllGather), n(ReduceScatter), n(AllReduce))
}

/// Megatron-style tensor parallelism without sequence parallelism (PyTorch's
/// ColwiseParallel / RowwiseParallel only): replicated activations and norms, q/k/v,
/// gate and up column-wise, o_proj and down row-wise; the embedding row-wise back to
/// `Replicate`, the head column-wise into `loss_parallel`.
fn plain_megatron_plans() -> (ParallelizePlan, ParallelizePlan) {
    let layer = ParallelizePlan::new()
        .add("self_attn.q_proj", ColwiseParallel::new())
        .add("self_attn.k_proj", ColwiseParallel::new())
        .add("self_attn.v_proj", ColwiseParallel::new())
        .add("self_attn.o_proj", RowwiseParallel::new())
        .add("mlp.gate_proj", ColwiseParallel::new())
        .add("mlp.up_proj", ColwiseParallel::new())
        .add("mlp.down_proj", RowwiseParallel::new());
    let top = ParallelizePlan::new()
        .add("base_model.embed_tokens", RowwiseParallel::new().input_layouts(Replicate))
        .add("lm_head", ColwiseParallel::new().use_local_output(false));
    (layer, top)
}

struct Step {
    forward: Vec<CommRecord>,
    backward: Vec<CommRecord>,
    /// Reading every parameter's gradient (the reductions an optimizer triggers).
    grads: Vec<CommRecord>,
    tp: Vec<usize>,
    dp: Vec<usize>,
    table: String,
}

/// One forward + loss + backward on a (dp, tp) mesh; rank 0's records per phase.
fn step(dp: usize, tp: usize, layer: &ParallelizePlan, top: &ParallelizePlan) -> Step {
    let (layer, top) = (layer.clone(), top.clone());
    let want = reference_grads();
    let out = spawn_scoped(
        SpawnConfig::new(dp * tp).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            parallelize_llama_with(&mut model, &mesh["tp"], &layer, &top).map_err(plan_err)?;
            if dp > 1 {
                let fsdp = FsdpConfig::default();
                for layer in &mut model.base_model.layers.items {
                    fully_shard(layer, &mesh["dp"], &fsdp)?;
                }
                fully_shard(&mut model, &mesh["dp"], &fsdp)?;
            }
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let (ids, tgt) = global_batch();
            let rows = 4 / dp;
            let r = mesh["dp"].local_rank();
            let (ids, tgt) = (ids.narrow(0, rows * r, rows)?, tgt.narrow(0, rows * r, rows)?);
            let dbg = ctx.world_group().comm_debug();
            dbg.enable();
            if dp > 1 {
                unshard(&model)?;
            }
            let loss = loss_of(&model, &ids, &tgt)?;
            let forward = dbg.take();
            loss_parallel::backward(&loss, &mesh["tp"])?;
            let backward = dbg.take();
            for (_, p) in named_parameters(&model) {
                p.grad_local()?;
            }
            let grads = dbg.take();
            dbg.disable();
            let table = explain_collectives(&[
                ("forward", &forward),
                ("backward", &backward),
                ("grads", &grads),
            ]);
            let mut full_grads = BTreeMap::new();
            for (n, p) in named_parameters(&model) {
                let g = p.grad()?.expect("gradient");
                full_grads.insert(n, g.full()?.to_vec_f64()?);
            }
            let tp_ranks = mesh["tp"].group(0)?.ranks().to_vec();
            let dp_ranks = mesh["dp"].group(0)?.ranks().to_vec();
            Ok((Step { forward, backward, grads, tp: tp_ranks, dp: dp_ranks, table }, full_grads))
        },
    )
    .unwrap_or_else(|e| panic!("dp={dp} tp={tp}: {e}"));
    let tol = Tol::for_dtype(DType::F32).scaled(10.0);
    for (rank, (_, grads)) in out.iter().enumerate() {
        assert_eq!(grads.len(), want.len());
        for (n, g) in grads {
            tol.check(&format!("dp={dp} tp={tp} rank {rank} {n}"), g, &want[n]).unwrap();
        }
    }
    out.into_iter().next().unwrap().0
}

fn at_most(what: &str, got: Counts, torch: Counts, table: &str) {
    println!("{what}: tpar (ag, rs, ar) = {got:?}, PyTorch {torch:?}");
    let ok = got.0 <= torch.0 && got.1 <= torch.1 && got.2 <= torch.2;
    assert!(ok, "{what}: tpar (all_gather, reduce_scatter, all_reduce) {got:?} > PyTorch {torch:?}\n{table}");
}

// PyTorch 2.15's `CommDebugMode` counts, rank 0, (all_gather, reduce_scatter,
// all_reduce), from `python3 benches/torch_tp_counts.py` (2 ranks, gloo, CPU; the same
// model and plans):
//   sequence_parallel forward+loss 11 5 3
//   sequence_parallel backward 7 5 0
//   megatron_sequence_parallel forward+loss 5 5 3
//   megatron_sequence_parallel backward 5 5 0
//   megatron forward+loss 0 0 8
//   megatron backward 0 0 11

/// The sequence-parallel plan, forward + loss: per layer one all_gather into the
/// attention, three for q/k/v (gathered back to `Replicate`), one into the MLP, two
/// reduce_scatters (o_proj, down_proj); one reduce_scatter out of the embedding, one
/// all_gather into the head, three all_reduces in `loss_parallel`.
const TORCH_SP_FORWARD: Counts = (11, 5, 3);
/// The sequence-parallel plan, backward: the adjoints of the input all_gathers of the
/// attention and MLP and of the head (reduce_scatters), of the reduce_scatters (all_gathers),
/// plus one all_gather per o_proj (its `Replicate -> Shard(-1)` input slice takes a
/// `Shard` gradient back to a `Replicate` one); q/k/v's gathers take their `Replicate`
/// gradients back as local slices.
const TORCH_SP_BACKWARD: Counts = (7, 5, 0);
/// `megatron_layer_plan` (heads sharded, sequence-parallel norms), forward + loss.
const TORCH_MEGATRON_SP_FORWARD: Counts = (5, 5, 3);
/// `megatron_layer_plan`, backward.
const TORCH_MEGATRON_SP_BACKWARD: Counts = (5, 5, 0);
/// Megatron without sequence parallelism, forward + loss: one all_reduce per row-wise
/// linear (o_proj, down_proj per layer, the embedding), three in `loss_parallel`.
const TORCH_MEGATRON_FORWARD: Counts = (0, 0, 8);
/// Megatron without sequence parallelism, backward: one all_reduce per column-wise
/// input (q, k, v, gate, up per layer, the head): PyTorch takes a plain input's gradient
/// as `Replicate`, so each column-wise module all-reduces its `Partial` input gradient.
/// tpar keeps gradients of replicated values as contributions until something needs them
/// whole, and pays one all_reduce per row-wise output instead (o_proj, down_proj, the
/// embedding: 5).
const TORCH_MEGATRON_BACKWARD: Counts = (0, 0, 11);
/// What FSDP2 adds at dp 2 x tp 2 (`fully_shard` per layer and on the root), rank 0, on
/// the dp group: an all_gather per unit in forward, per layer in backward (the root keeps
/// its parameters), a reduce_scatter per unit, in backward.
const TORCH_FSDP_DP_FORWARD: Counts = (3, 0, 0);
/// See [`TORCH_FSDP_DP_FORWARD`].
const TORCH_FSDP_DP_BACKWARD: Counts = (2, 3, 0);
/// FSDP2 also all-reduces, on the tp group in backward, the `Partial` gradients of the
/// five sequence-parallel norm weights. tpar issues those reductions when the gradients
/// are read (`Param::grad`, the optimizers, `clip_grad_norm`), not in backward: the test
/// counts them in a third phase and holds backward + that phase to PyTorch's backward.
const TORCH_FSDP_SP_NORM_ALL_REDUCES: usize = 5;

/// One step of `layer` + `top` at dp x tp 2; tpar's tp counts at most `torch` (forward +
/// loss, backward), and at dp 2 the dp counts at most FSDP2's. At dp 2, PyTorch's
/// backward also holds FSDP2's all_reduces of the `sp_norms` sequence-parallel norm
/// gradients, which tpar issues when the gradients are read: backward alone, and backward
/// plus reading every gradient, are each held to that. At dp 1 PyTorch leaves those
/// gradients `Partial` (reduced when an optimizer uses them), as tpar leaves them
/// contributions, so neither side's backward has them.
fn check(
    what: &str,
    dp: usize,
    layer: &ParallelizePlan,
    top: &ParallelizePlan,
    torch: [Counts; 2],
    sp_norms: usize,
) {
    let s = step(dp, 2, layer, top);
    println!("{what} dp={dp} tp=2, rank 0:\n{}", s.table);
    let (fwd, bwd, grads) =
        (counts(&s.forward, &s.tp), counts(&s.backward, &s.tp), counts(&s.grads, &s.tp));
    at_most(&format!("{what} dp={dp} tp forward+loss"), fwd, torch[0], &s.table);
    if dp == 1 {
        at_most(&format!("{what} dp={dp} tp backward"), bwd, torch[1], &s.table);
        return;
    }
    let torch_bwd = (torch[1].0, torch[1].1, torch[1].2 + sp_norms);
    at_most(&format!("{what} dp={dp} tp backward"), bwd, torch_bwd, &s.table);
    let with_grads = (bwd.0 + grads.0, bwd.1 + grads.1, bwd.2 + grads.2);
    at_most(
        &format!("{what} dp={dp} tp backward + reading the gradients"),
        with_grads,
        torch_bwd,
        &s.table,
    );
    at_most(
        &format!("{what} dp={dp} dp forward"),
        counts(&s.forward, &s.dp),
        TORCH_FSDP_DP_FORWARD,
        &s.table,
    );
    at_most(
        &format!("{what} dp={dp} dp backward"),
        counts(&s.backward, &s.dp),
        TORCH_FSDP_DP_BACKWARD,
        &s.table,
    );
}

#[test]
fn sequence_parallel_plan_issues_no_more_collectives_than_pytorch() {
    let (layer, top) = (sequence_parallel_layer_plan(), top_level_plan());
    let torch = [TORCH_SP_FORWARD, TORCH_SP_BACKWARD];
    let norms = TORCH_FSDP_SP_NORM_ALL_REDUCES;
    check("sequence-parallel", 1, &layer, &top, torch, norms);
    check("sequence-parallel", 2, &layer, &top, torch, norms);
}

#[test]
fn megatron_sequence_parallel_plan_issues_no_more_collectives_than_pytorch() {
    let (layer, top) = (megatron_layer_plan(), top_level_plan());
    let torch = [TORCH_MEGATRON_SP_FORWARD, TORCH_MEGATRON_SP_BACKWARD];
    let norms = TORCH_FSDP_SP_NORM_ALL_REDUCES;
    check("megatron sequence-parallel", 1, &layer, &top, torch, norms);
    check("megatron sequence-parallel", 2, &layer, &top, torch, norms);
}

#[test]
fn megatron_plan_issues_no_more_collectives_than_pytorch() {
    let (layer, top) = plain_megatron_plans();
    let torch = [TORCH_MEGATRON_FORWARD, TORCH_MEGATRON_BACKWARD];
    // The norms are not in the plan: PyTorch's are plain parameters with identical full
    // gradients (nothing to reduce); tpar reduces their contributions when read (5
    // all_reduces), still within PyTorch's backward.
    check("megatron", 1, &layer, &top, torch, 0);
    check("megatron", 2, &layer, &top, torch, 0);
}
