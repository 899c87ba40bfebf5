//! The Llama on a cp axis: inputs, labels and the padding mask sharded on the sequence in
//! the load-balanced layout; the global loss and every parameter's gradient (summed over
//! cp) equal the unsharded model's (f64, 1e-10), at cp 2 (ring and all-gather), cp 3
//! (uneven chunks), cp 2 x tp 2 (plain and vocab-parallel loss), cp 2 x dp 2 with FSDP
//! over dp x cp, cp 2 with full and selective activation checkpointing, and pp 2 x cp 2;
//! a checkpoint saved at cp 2 loads at cp 1 and cp 4.

use std::collections::BTreeMap;
use std::time::Duration;

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_dtensor::{CpLayout, CpMethod, Placement::Replicate, Placement::Shard};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::context_parallel::{
    all_reduce_gradients, apply_context_parallel, cp_cross_entropy,
};
use tpar_models::llama_plans::{megatron_layer_plan, parallelize_llama_with};
use tpar_models::{LlamaConfig, LlamaForPretraining};
use tpar_nn::{named_parameters, reset_parameters, NnError, Value};
use tpar_parallel_styles::{
    loss_parallel, ColwiseParallel, ParallelizePlan, RowwiseParallel, SequenceParallel,
};
use tpar_tensor::{DType, Device, Tensor};

const TOL: f64 = 1e-10;

/// Gradients by parameter name.
type Grads = BTreeMap<String, Vec<f64>>;
const VOCAB: usize = 40;

fn config() -> LlamaConfig {
    tpar_testing::tiny_llama_config(VOCAB, 32, 2, DType::F64)
}

/// Two sequences of `s` tokens, their next-token labels and a padding mask: with `pad`,
/// sequence 1 is left-padded by 3 tokens (mask 0, label ignored).
fn batch(s: usize, pad: bool) -> (Tensor, Tensor, Option<Tensor>) {
    let ids: Vec<i64> = (0..2 * s).map(|i| ((i * 7 + i / 3) % (VOCAB - 1) + 1) as i64).collect();
    let mut labels: Vec<i64> =
        (0..2 * s).map(|i| ((i * 5 + 3 + i / 4) % (VOCAB - 1) + 1) as i64).collect();
    let mut mask = vec![1i64; 2 * s];
    if pad {
        for j in 0..3 {
            mask[s + j] = 0;
            labels[s + j] = -100;
        }
    }
    (
        Tensor::from_vec(ids, [2, s]).unwrap(),
        Tensor::from_vec(labels, [2, s]).unwrap(),
        pad.then(|| Tensor::from_vec(mask, [2, s]).unwrap()),
    )
}

/// The unsharded model's loss and gradients by name.
fn reference(s: usize, pad: bool) -> (f64, BTreeMap<String, Vec<f64>>) {
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 3).unwrap();
    let (ids, labels, mask) = batch(s, pad);
    let logits = model.logits(&ids, mask.as_ref()).unwrap().into_tensor("ref").unwrap();
    let loss = logits
        .reshape([2 * s, VOCAB])
        .unwrap()
        .cross_entropy(&labels.reshape([2 * s]).unwrap(), -100)
        .unwrap();
    loss.backward().unwrap();
    let grads = named_parameters(&model)
        .into_iter()
        .map(|(n, p)| (n, p.local().grad().unwrap().to_vec_f64().unwrap()))
        .collect();
    (loss.item().unwrap(), grads)
}

/// Every parameter's whole gradient, by name (collective over the model's meshes).
fn full_grads(model: &LlamaForPretraining) -> Result<Grads, NnError> {
    let mut grads = BTreeMap::new();
    for (name, p) in named_parameters(model) {
        let full = p.grad()?.expect("every parameter has a gradient").full()?;
        grads.insert(name, full.to_vec_f64()?);
    }
    Ok(grads)
}

/// Every rank's global loss and every gradient equal the unsharded model's (within
/// [`TOL`]).
fn assert_equals_reference(what: &str, got: &[(f64, Grads)], want_loss: f64, want: &Grads) {
    for (rank, (loss, grads)) in got.iter().enumerate() {
        assert!((loss - want_loss).abs() <= TOL, "{what} rank {rank}: loss {loss} vs {want_loss}");
        for (name, w) in want {
            let d = max_diff(&grads[name], w);
            assert!(d <= TOL, "{what} rank {rank}: gradient of {name} differs by {d}");
        }
    }
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// The top-level plan for cp x tp: vocab-parallel embedding into sequence shards, a
/// sequence-parallel final norm and an lm_head whose logits come back whole (plain
/// tensors: the loss runs on this cp rank's rows).
fn cp_top_plan() -> ParallelizePlan {
    ParallelizePlan::new()
        .add(
            "base_model.embed_tokens",
            RowwiseParallel::new().input_layouts(Replicate).output_layouts(Shard(1)),
        )
        .add("base_model.norm", SequenceParallel::new())
        .add("lm_head", ColwiseParallel::new().input_layouts(Shard(1)).output_layouts(Replicate))
}

/// Runs one step on a (cp, tp) mesh; returns each rank's global loss and full gradients.
fn run(
    cp: usize,
    tp: usize,
    s: usize,
    pad: bool,
    method: CpMethod,
) -> Vec<(f64, BTreeMap<String, Vec<f64>>)> {
    let cfg = SpawnConfig::new(cp * tp).timeout(Duration::from_secs(60));
    spawn_scoped(cfg, |ctx| -> Result<(f64, BTreeMap<String, Vec<f64>>), NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[cp, tp], &["cp", "tp"])?;
        let g = mesh.group_of("cp")?.clone();
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        if tp > 1 {
            parallelize_llama_with(
                &mut model,
                mesh.dim("tp")?,
                &megatron_layer_plan(),
                &cp_top_plan(),
            )
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        }
        reset_parameters(&mut model, Device::Cpu, 3)?;
        apply_context_parallel(&mut model, &g, method)?;
        let layout = CpLayout::new(s, cp)?;
        let r = g.rank();
        let (ids, labels, mask) = batch(s, pad);
        let ids = layout.shard(&ids, 1, r)?;
        let labels = layout.shard(&labels, 1, r)?;
        let mask = mask.map(|m| layout.shard(&m, 1, r)).transpose()?;
        let n = ids.dims()[1];
        let logits = match model.logits(&ids, mask.as_ref())? {
            Value::Tensor(t) => t,
            Value::DTensor(d) => d.full_tensor()?,
            other => panic!("logits: {other:?}"),
        };
        let (loss, global) = cp_cross_entropy(
            &logits.reshape([2 * n, VOCAB])?,
            &labels.reshape([2 * n])?,
            -100,
            &g,
        )?;
        {
            // The loss is replicated over tp: seed its gradient once there.
            let _lp = loss_parallel::enable(mesh.dim("tp")?);
            Value::Tensor(loss).backward()?;
        }
        all_reduce_gradients(&model, &g)?;
        Ok((global, full_grads(&model)?))
    })
    .unwrap_or_else(|e| panic!("cp {cp} tp {tp} seq {s}: {e}"))
}

fn check(cp: usize, tp: usize, s: usize, pad: bool, method: CpMethod) {
    let (want_loss, want) = reference(s, pad);
    let got = run(cp, tp, s, pad, method);
    let what = format!("cp {cp} tp {tp} seq {s} pad {pad} {method:?}");
    for (rank, (_, grads)) in got.iter().enumerate() {
        assert_eq!(grads.len(), want.len(), "{what} rank {rank}: parameter count");
    }
    assert_equals_reference(&what, &got, want_loss, &want);
}

#[test]
fn cp2_equals_unsharded() {
    for method in [CpMethod::Ring, CpMethod::AllGather] {
        check(2, 1, 12, false, method);
        check(2, 1, 12, true, method);
    }
}

#[test]
fn cp3_uneven_equals_unsharded() {
    check(3, 1, 13, true, CpMethod::Ring);
    check(3, 1, 13, false, CpMethod::AllGather);
}

#[test]
fn cp2_tp2_equals_unsharded() {
    check(2, 2, 12, true, CpMethod::Ring);
}

/// One step of dp 2 x cp 2 x `tp` with FSDP sharding the parameters over the flattened
/// (dp, cp) mesh, as torchtitan does (and the Megatron plan on tp when `tp` > 1, each
/// parameter then a DTensor on the (tp, dp_cp) mesh: the flattened dim is registered
/// with the root mesh): each dp rank takes one sequence, each cp rank its rows of it;
/// FSDP's reduce-scatter averages over the 4 (dp, cp) ranks, so each rank's share of the
/// global-mean loss is scaled by 4. Loss and every gradient equal the unsharded model's.
fn check_fsdp_over_dp_cp(tp: usize) {
    use tpar_parallel_styles::{fully_shard, FsdpConfig};
    let (s, pad) = (12, true);
    let (want_loss, want) = reference(s, pad);
    let cfg = SpawnConfig::new(4 * tp).timeout(Duration::from_secs(60));
    let got = spawn_scoped(cfg, |ctx| -> Result<(f64, BTreeMap<String, Vec<f64>>), NnError> {
        let mesh =
            DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2, tp], &["dp", "cp", "tp"])?;
        let cp = mesh.group_of("cp")?.clone();
        let flat = mesh.flatten(&["dp", "cp"], "dp_cp")?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        if tp > 1 {
            parallelize_llama_with(
                &mut model,
                mesh.dim("tp")?,
                &megatron_layer_plan(),
                &cp_top_plan(),
            )
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        }
        let fc = FsdpConfig::default();
        for layer in &mut model.base_model.layers.items {
            fully_shard(layer, &flat, &fc)?;
        }
        fully_shard(&mut model, &flat, &fc)?;
        reset_parameters(&mut model, Device::Cpu, 3)?;
        if tp > 1 {
            for (name, p) in named_parameters(&model) {
                let d = p.dtensor().expect("FSDP parameters are DTensors");
                assert_eq!(d.mesh().names(), ["tp", "dp_cp"], "{name}: the (tp, dp_cp) mesh");
            }
        }
        apply_context_parallel(&mut model, &cp, CpMethod::Ring)?;
        let dp = mesh.local_rank_of("dp")?;
        let layout = CpLayout::new(s, 2)?;
        let (ids, labels, mask) = batch(s, pad);
        let row = |t: &Tensor| -> Result<Tensor, NnError> {
            Ok(layout.shard(&t.narrow(0, dp, 1)?, 1, cp.rank())?)
        };
        let (ids, labels) = (row(&ids)?, row(&labels)?);
        let mask = mask.map(|m| row(&m)).transpose()?;
        let n = ids.dims()[1];
        let logits = match model.logits(&ids, mask.as_ref())? {
            Value::Tensor(t) => t,
            Value::DTensor(d) => d.full_tensor()?,
            other => panic!("logits: {other:?}"),
        };
        let all = flat.group(0)?.clone();
        let (loss, global) =
            cp_cross_entropy(&logits.reshape([n, VOCAB])?, &labels.reshape([n])?, -100, &all)?;
        {
            // Replicated over tp: seed its gradient once there.
            let _lp = loss_parallel::enable(mesh.dim("tp")?);
            Value::Tensor(loss.mul_scalar(all.size() as f64)?).backward()?;
        }
        Ok((global, full_grads(&model)?))
    })
    .unwrap_or_else(|e| panic!("cp 2 x dp 2 x tp {tp} FSDP: {e}"));
    assert_equals_reference(&format!("cp 2 x dp 2 x tp {tp} FSDP"), &got, want_loss, &want);
}

#[test]
fn cp2_dp2_fsdp_equals_unsharded() {
    check_fsdp_over_dp_cp(1);
}

/// The 3-D composition torchtitan runs: dp 2 x cp 2 x tp 2 (8 ranks).
#[test]
fn cp2_dp2_tp2_fsdp_equals_unsharded() {
    check_fsdp_over_dp_cp(2);
}

/// Activation checkpointing and cp together: full and selective checkpointing of every
/// decoder layer recompute the ring attention (its exchanges again) in backward, and the
/// loss and gradients still equal the unsharded model's.
#[test]
fn cp2_with_activation_checkpointing_equals_unsharded() {
    use tpar_nn::{apply_activation_checkpointing, AcPolicy};
    let (s, pad) = (12, true);
    let (want_loss, want) = reference(s, pad);
    for policy in [AcPolicy::full(), AcPolicy::selective()] {
        let cfg = SpawnConfig::new(2).timeout(Duration::from_secs(60));
        let p = policy.clone();
        let got =
            spawn_scoped(cfg, move |ctx| -> Result<(f64, BTreeMap<String, Vec<f64>>), NnError> {
                let g = ctx.world_group();
                let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
                let wrapped = apply_activation_checkpointing(&mut model, &p)?;
                assert_eq!(wrapped.len(), 2, "both decoder layers checkpointed");
                reset_parameters(&mut model, Device::Cpu, 3)?;
                apply_context_parallel(&mut model, &g, CpMethod::Ring)?;
                let layout = CpLayout::new(s, 2)?;
                let (ids, labels, mask) = batch(s, pad);
                let ids = layout.shard(&ids, 1, g.rank())?;
                let labels = layout.shard(&labels, 1, g.rank())?;
                let mask = mask.map(|m| layout.shard(&m, 1, g.rank())).transpose()?;
                let n = ids.dims()[1];
                let logits = model.logits(&ids, mask.as_ref())?.into_tensor("logits")?;
                let (loss, global) = cp_cross_entropy(
                    &logits.reshape([2 * n, VOCAB])?,
                    &labels.reshape([2 * n])?,
                    -100,
                    &g,
                )?;
                loss.backward()?;
                all_reduce_gradients(&model, &g)?;
                Ok((global, full_grads(&model)?))
            })
            .unwrap_or_else(|e| panic!("cp 2 with {policy}: {e}"));
        assert_equals_reference(&format!("cp 2 with {policy}"), &got, want_loss, &want);
    }
}

/// cp 2 x tp 2 with the default top-level plan: vocab-sharded logits and loss_parallel's
/// cross-entropy, scaled by this rank's token share (what a trainer does).
#[test]
fn cp2_tp2_loss_parallel_equals_unsharded() {
    use tpar_models::context_parallel::cp_token_share;
    use tpar_models::llama_plans::parallelize_llama;
    let (s, pad) = (12, true);
    let (want_loss, want) = reference(s, pad);
    let cfg = SpawnConfig::new(4).timeout(Duration::from_secs(60));
    let got = spawn_scoped(cfg, |ctx| -> Result<(f64, BTreeMap<String, Vec<f64>>), NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["cp", "tp"])?;
        let g = mesh.group_of("cp")?.clone();
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        parallelize_llama(&mut model, mesh.dim("tp")?, &megatron_layer_plan())
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        reset_parameters(&mut model, Device::Cpu, 3)?;
        apply_context_parallel(&mut model, &g, CpMethod::AllGather)?;
        let layout = CpLayout::new(s, 2)?;
        let (ids, labels, mask) = batch(s, pad);
        let ids = layout.shard(&ids, 1, g.rank())?;
        let labels = layout.shard(&labels, 1, g.rank())?;
        let labels = labels.reshape([labels.numel()])?;
        let mask = mask.map(|m| layout.shard(&m, 1, g.rank())).transpose()?;
        let rows = labels.numel() as isize;
        let logits = match model.logits(&ids, mask.as_ref())? {
            Value::DTensor(d) => Value::DTensor(d.view(&[rows, VOCAB as isize])?),
            other => panic!("expected vocab-sharded logits, got {other:?}"),
        };
        let share = cp_token_share(&labels, -100, &g)?;
        let loss = logits.cross_entropy(&labels, -100)?.mul_scalar(share)?;
        {
            let _lp = loss_parallel::enable(mesh.dim("tp")?);
            loss.backward()?;
        }
        let value = Tensor::from_vec(vec![loss.item()?], [1])?;
        let global = g.all_reduce(&value, tpar_dtensor::ReduceOp::Sum)?.to_vec::<f64>()?[0];
        all_reduce_gradients(&model, &g)?;
        Ok((global, full_grads(&model)?))
    })
    .unwrap_or_else(|e| panic!("cp 2 x tp 2 loss_parallel: {e}"));
    assert_equals_reference("cp 2 x tp 2 loss_parallel", &got, want_loss, &want);
}

/// pp 2 x cp 2 (GPipe, 1F1B and zero-bubble): each stage takes its cp rank's rows; the last stage's loss function
/// scales each micro-batch's mean by the rank's token share; after the schedule the
/// gradients are summed over cp. Loss and gradients equal the unsharded model's.
#[test]
fn pp2_cp2_equals_unsharded() {
    use tpar_models::context_parallel::{apply_context_parallel_stage, cp_token_share};
    use tpar_models::LlamaStage;
    use tpar_pipeline::{PipelineSchedule, PipelineStage, ScheduleKind};
    let s = 12;
    let (want_loss, want) = reference(s, false);
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble] {
        let cfg = SpawnConfig::new(4).timeout(Duration::from_secs(60));
        let got = spawn_scoped(cfg, |ctx| -> Result<(Option<f64>, Grads), NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["pp", "cp"])?;
            let cp = mesh.group_of("cp")?.clone();
            let pp = mesh.dim("pp")?;
            let stage_idx = pp.local_rank();
            let mut stage = LlamaStage::for_stage(&config(), stage_idx, 2, None, Device::Meta)?;
            reset_parameters(&mut stage, Device::Cpu, 3)?;
            apply_context_parallel_stage(&mut stage, &cp, CpMethod::Ring)?;
            let stage = PipelineStage::new(stage, stage_idx, 2, pp, Device::Cpu)
                .map_err(|e| NnError::Config { what: e.to_string() })?;
            let g = cp.clone();
            let loss_fn = move |logits: &Value, t: &Tensor| -> tpar_nn::Result<Value> {
                let t = t.reshape([t.numel()])?;
                let share = cp_token_share(&t, -100, &g)?;
                logits.reshape(&[-1, VOCAB as isize])?.cross_entropy(&t, -100)?.mul_scalar(share)
            };
            let mut sched = PipelineSchedule::new(kind, vec![stage], 2, loss_fn)
                .map_err(|e| NnError::Config { what: e.to_string() })?;
            let layout = CpLayout::new(s, 2)?;
            let (ids, labels, _) = batch(s, false);
            let ids = layout.shard(&ids, 1, cp.rank())?;
            let labels = layout.shard(&labels, 1, cp.rank())?;
            let losses = sched
                .step(Some(&ids), Some(&labels))
                .map_err(|e| NnError::Config { what: e.to_string() })?;
            // The last stage's loss: the micro-batches' mean, summed over cp.
            let loss = if losses.is_empty() {
                None
            } else {
                let mine = losses.iter().sum::<f64>() / losses.len() as f64;
                let t = Tensor::from_vec(vec![mine], [1])?;
                Some(cp.all_reduce(&t, tpar_dtensor::ReduceOp::Sum)?.to_vec::<f64>()?[0])
            };
            let module = sched.stages()[0].module();
            all_reduce_gradients(module, &cp)?;
            let mut grads = BTreeMap::new();
            for (name, p) in named_parameters(module) {
                grads.insert(name, p.trainable().grad().expect("a gradient").to_vec_f64()?);
            }
            Ok((loss, grads))
        })
        .unwrap_or_else(|e| panic!("pp 2 x cp 2 {kind}: {e}"));
        let mut all = BTreeMap::new();
        for (rank, (loss, grads)) in got.into_iter().enumerate() {
            if let Some(l) = loss {
                assert!(
                    (l - want_loss).abs() <= TOL,
                    "{kind} rank {rank}: loss {l} vs {want_loss}"
                );
            }
            for (name, g) in grads {
                let d = max_diff(&g, &want[&name]);
                assert!(d <= TOL, "{kind} rank {rank}: gradient of {name} differs by {d}");
                all.insert(name, ());
            }
        }
        assert_eq!(all.len(), want.len(), "{kind}: every parameter is on some stage");
    }
}

/// The Llama (seed `seed`) FSDP-sharded over the flattened (dp, cp) mesh and run
/// context-parallel over cp; returns it with the cp group.
fn fsdp_cp_model(
    mesh: &DeviceMesh,
    seed: u64,
) -> Result<(LlamaForPretraining, tpar_collectives::ProcessGroup), NnError> {
    use tpar_parallel_styles::{fully_shard, FsdpConfig};
    let cp = mesh.group_of("cp")?.clone();
    let flat = mesh.flatten(&["dp", "cp"], "dp_cp")?;
    let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
    for layer in &mut model.base_model.layers.items {
        fully_shard(layer, &flat, &FsdpConfig::default())?;
    }
    fully_shard(&mut model, &flat, &FsdpConfig::default())?;
    reset_parameters(&mut model, Device::Cpu, seed)?;
    apply_context_parallel(&mut model, &cp, CpMethod::Ring)?;
    Ok((model, cp))
}

/// Checkpoints reshard across cp: saved with FSDP over dp 2 x cp 2, loaded at cp 1 (one
/// rank, plain parameters) and at cp 4 (FSDP over dp 1 x cp 4), each into a model
/// initialised with another seed: the parameters are the saved ones and the cp 4 model's
/// loss equals the unsharded model's.
#[test]
fn checkpoint_saved_at_cp2_loads_at_cp1_and_cp4() {
    use tpar_checkpoint::{load, save, LoadOptions, SaveOptions};
    use tpar_nn::state_dict;
    let dir = std::env::temp_dir().join(format!("tpar-cp-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (s, pad) = (12, true);
    let (want_loss, _) = reference(s, pad);
    let mut want_params = BTreeMap::new();
    {
        let mut m = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
        reset_parameters(&mut m, Device::Cpu, 3).unwrap();
        for (n, p) in named_parameters(&m) {
            want_params.insert(n, p.local().to_vec_f64().unwrap());
        }
    }
    let d = dir.clone();
    spawn_scoped(
        SpawnConfig::new(4).timeout(Duration::from_secs(60)),
        |ctx| -> Result<(), NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "cp"])?;
            let (model, _) = fsdp_cp_model(&mesh, 3)?;
            save(&state_dict(&model)?, &d, &ctx.world_group(), &SaveOptions::default())
                .map_err(|e| NnError::Config { what: e.to_string() })?;
            Ok(())
        },
    )
    .unwrap();
    // cp 1: one rank, plain parameters.
    let d = dir.clone();
    let one = spawn_scoped(SpawnConfig::new(1), |ctx| -> Result<Grads, NnError> {
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        reset_parameters(&mut model, Device::Cpu, 11)?;
        let mut sd = state_dict(&model)?;
        load(&mut sd, &d, &ctx.world_group(), &LoadOptions::default())
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        tpar_nn::load_state_dict(&mut model, sd, true)?;
        let mut params = BTreeMap::new();
        for (n, p) in named_parameters(&model) {
            params.insert(n, p.full()?.to_vec_f64()?);
        }
        Ok(params)
    })
    .unwrap();
    for (n, w) in &want_params {
        assert_eq!(&one[0][n], w, "cp 1: {n} differs from the saved parameter");
    }
    // cp 4: FSDP over dp 1 x cp 4; the loaded model's loss on the cp-sharded batch.
    let d = dir.clone();
    let four = spawn_scoped(
        SpawnConfig::new(4).timeout(Duration::from_secs(60)),
        |ctx| -> Result<(f64, Grads), NnError> {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[1, 4], &["dp", "cp"])?;
            let (mut model, cp) = fsdp_cp_model(&mesh, 11)?;
            let mut sd = state_dict(&model)?;
            load(&mut sd, &d, &ctx.world_group(), &LoadOptions::default())
                .map_err(|e| NnError::Config { what: e.to_string() })?;
            tpar_nn::load_state_dict(&mut model, sd, true)?;
            let layout = CpLayout::new(s, 4)?;
            let (ids, labels, mask) = batch(s, pad);
            let ids = layout.shard(&ids, 1, cp.rank())?;
            let labels = layout.shard(&labels, 1, cp.rank())?;
            let mask = mask.map(|m| layout.shard(&m, 1, cp.rank())).transpose()?;
            let n = ids.dims()[1];
            let logits = model.logits(&ids, mask.as_ref())?.into_tensor("logits")?;
            let (_, global) = cp_cross_entropy(
                &logits.reshape([2 * n, VOCAB])?,
                &labels.reshape([2 * n])?,
                -100,
                &cp,
            )?;
            let mut params = BTreeMap::new();
            for (name, p) in named_parameters(&model) {
                params.insert(name, p.full()?.to_vec_f64()?);
            }
            Ok((global, params))
        },
    )
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    for (rank, (loss, params)) in four.iter().enumerate() {
        assert!((loss - want_loss).abs() <= TOL, "cp 4 rank {rank}: loss {loss} vs {want_loss}");
        for (n, w) in &want_params {
            assert_eq!(&params[n], w, "cp 4 rank {rank}: {n} differs from the saved parameter");
        }
    }
}
