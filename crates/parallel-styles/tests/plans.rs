//! Plans as a whole: the collectives one decoder layer runs under the Megatron plan,
//! plan errors reported before any communication, the static layout check, and
//! `explain`.

use std::sync::Arc;
use std::time::Duration;

use tpar_collectives::{spawn_scoped, CollectiveKind, CommRecord, SpawnConfig};
use tpar_dtensor::{distribute_tensor, Placement};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::llama_plans::{
    check_llama_plan, megatron_layer_plan, parallelize_llama, parallelize_llama_with,
    sequence_parallel_layer_plan, top_level_plan,
};
use tpar_models::{LlamaConfig, LlamaDecoderLayer, LlamaForPretraining, RotaryPositionEncoding};
use tpar_nn::{call, named_parameters, reset_parameters, Args, NnError, Param, Value};
use tpar_parallel_styles::{
    explain, loss_parallel, trace, ColwiseParallel, ParallelizePlan, PlanError, PrepareModuleInput,
    RowwiseParallel, SequenceParallel,
};
use tpar_tensor::{tol::Tol, DType, Device, Rng, Tensor};

use CollectiveKind::{AllGather, AllReduce, ReduceScatter};
use Placement::{Replicate, Shard};

fn config() -> LlamaConfig {
    tpar_testing::tp_llama_config(DType::F32)
}

use tpar_testing::plan_err as cfg_err;

const BATCH: usize = 2;
const SEQ: usize = 7;

/// One decoder layer on `[2, 7, 24]` hidden states: output and every parameter's
/// gradient of `sum(out * w)`.
fn layer_inputs() -> (Tensor, Tensor, Value) {
    let cfg = config();
    let mut rng = Rng::new(5);
    let x = Tensor::randn([BATCH, SEQ, cfg.hidden_size], DType::F32, &mut rng).unwrap();
    let w = Tensor::randn([BATCH, SEQ, cfg.hidden_size], DType::F32, &mut rng).unwrap();
    let rope = RotaryPositionEncoding::new(cfg.head_dim(), 32, cfg.rope_theta, DType::F32)
        .unwrap()
        .tables(SEQ)
        .unwrap();
    (x, w, Value::Opaque(Arc::new(rope)))
}

type Grads = Vec<(String, Vec<f64>)>;

fn layer_reference() -> (Vec<f64>, Grads) {
    let mut layer = LlamaDecoderLayer::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut layer, Device::Cpu, 3).unwrap();
    let (x, w, rope) = layer_inputs();
    let out = call(&layer, Args::new(vec![Value::Tensor(x), rope, Value::None]))
        .unwrap()
        .into_tensor("test")
        .unwrap();
    out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = named_parameters(&layer)
        .into_iter()
        .map(|(n, p)| (n, p.local().grad().unwrap().to_vec_f64().unwrap()))
        .collect();
    (out.to_vec_f64().unwrap(), grads)
}

/// The float collectives (activations and gradients), in issue order.
fn float_kinds(records: &[CommRecord]) -> Vec<CollectiveKind> {
    records.iter().filter(|r| r.dtype.is_some_and(|d| d.is_float())).map(|r| r.kind).collect()
}

/// One `LlamaDecoderLayer` under `megatron_layer_plan()`, its input a plain local
/// `Shard(1)` tensor (sequence-sharded hidden states, as the embedding hands them on).
///
/// What is counted, per rank, from `CommDebug` (every collective the rank issues):
/// - forward, float data: per sub-layer one all_gather (`PrepareModuleInput`
///   `S(1) -> R` before attention / MLP) and one reduce_scatter (`RowwiseParallel`
///   o_proj / down_proj `P -> S(1)`): `[AG, RS, AG, RS]`, nothing else;
/// - forward, metadata: one tiny i64 all_gather of local shapes per `SequenceParallel`
///   norm, whose plain input's global sequence length no rank knows alone (uneven
///   shards are exact, never guessed); the rowwise projections know their input's
///   global width (`in_features`) and exchange nothing;
/// - backward: the adjoints in reverse order, down_proj's reduce_scatter becoming an
///   all_gather and the MLP input's all_gather a reduce_scatter, then the same for
///   attention: `[AG, RS, AG, RS]`, and nothing else (no metadata);
/// - reading the gradients (`Param::grad`): the sequence-parallel norms' replicated
///   weights hold per-rank contributions, reduced when read: one all_reduce per norm;
///   the sharded projections' gradients are already their shards.
#[test]
fn megatron_decoder_layer_collective_counts() {
    let (want_out, want_grads) = layer_reference();
    for tp in [2usize, 3] {
        let outs = spawn_scoped(SpawnConfig::new(tp).timeout(Duration::from_secs(30)), |ctx| {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[tp], &["tp"])?;
            let mut layer = LlamaDecoderLayer::new(&config(), Device::Meta)?;
            tpar_parallel_styles::parallelize_module(&mut layer, &mesh, &megatron_layer_plan())
                .map_err(cfg_err)?;
            reset_parameters(&mut layer, Device::Cpu, 3)?;
            let (x, w, rope) = layer_inputs();
            let x = distribute_tensor(&x, &mesh, &[Shard(1)])?.to_local();
            let w = distribute_tensor(&w, &mesh, &[Shard(1)])?.to_local();
            let dbg = mesh.group(0)?.comm_debug();
            dbg.enable();
            let out = call(&layer, Args::new(vec![Value::Tensor(x), rope, Value::None]))?;
            let fwd = dbg.take();
            // The output is this rank's sequence shard: sum(out * w) over all ranks is
            // the loss, and each rank seeds its own part (no communication).
            let out = out.into_tensor("test")?;
            out.mul(&w)?.sum_all()?.backward()?;
            let bwd = dbg.take();
            let mut grads = Vec::new();
            for (n, p) in named_parameters(&layer) {
                grads.push((n, p.grad()?.expect("a gradient")));
            }
            let read = dbg.take();
            dbg.disable();
            let mut full_grads = Vec::new();
            for (n, g) in grads {
                full_grads.push((n, g.full()?.to_vec_f64()?));
            }
            let global = [BATCH, SEQ, 24];
            let full = tpar_dtensor::DTensor::from_local(
                &out.detach(),
                &mesh,
                &[Shard(1)],
                Some(&global),
            )?
            .full_tensor()?;
            Ok::<_, NnError>((fwd, bwd, read, full.to_vec_f64()?, full_grads))
        })
        .unwrap_or_else(|e| panic!("tp={tp}: {e}"));
        let tol = Tol::for_dtype(DType::F32).scaled(10.0);
        for (rank, (fwd, bwd, read, out, grads)) in outs.iter().enumerate() {
            let at = format!("tp={tp} rank {rank}");
            assert_eq!(
                float_kinds(fwd),
                vec![AllGather, ReduceScatter, AllGather, ReduceScatter],
                "{at} forward: {fwd:#?}"
            );
            let meta: Vec<&CommRecord> =
                fwd.iter().filter(|r| r.dtype == Some(DType::I64)).collect();
            assert_eq!(meta.len(), 2, "{at}: one shape exchange per SequenceParallel norm");
            assert!(meta.iter().all(|r| r.kind == AllGather && r.bytes <= 64), "{at}: {meta:?}");
            assert_eq!(fwd.len(), 6, "{at}: nothing else in forward: {fwd:#?}");
            assert_eq!(
                float_kinds(bwd),
                vec![AllGather, ReduceScatter, AllGather, ReduceScatter],
                "{at} backward: {bwd:#?}"
            );
            assert_eq!(bwd.len(), 4, "{at}: nothing else in backward: {bwd:#?}");
            // Bytes: each all_gather sends this rank's [2, s_local, 24] f32 shard; the
            // reduce_scatters send the whole [2, 7, 24] partial sum.
            let s_local = tpar_placements::chunk_range(SEQ, tp, rank).1;
            for r in fwd.iter().filter(|r| r.dtype == Some(DType::F32)) {
                let want = if r.kind == AllGather { 2 * s_local * 24 * 4 } else { 2 * 7 * 24 * 4 };
                assert_eq!(r.bytes, want, "{at}: {r}");
            }
            assert_eq!(float_kinds(read), vec![AllReduce, AllReduce], "{at} reading grads");
            tol.check(&format!("{at} output"), out, &want_out).unwrap();
            for ((n, g), (wn, wg)) in grads.iter().zip(&want_grads) {
                assert_eq!(n, wn);
                tol.check(&format!("{at} grad {n}"), g, wg).unwrap();
            }
        }
    }
}

/// Runs `f` on 2 ranks with communication recorded; returns its result on rank 0 and
/// how many collectives ran.
fn on_two_ranks<R: Send>(
    f: impl Fn(&DeviceMesh, &mut LlamaForPretraining) -> R + Sync,
) -> (R, usize, bool) {
    let mut outs = spawn_scoped(SpawnConfig::new(2).timeout(Duration::from_secs(30)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        let dbg = mesh.group(0)?.comm_debug();
        dbg.enable();
        let r = f(&mesh, &mut model);
        dbg.disable();
        let untouched = named_parameters(&model).iter().all(|(_, p)| matches!(p, Param::Tensor(_)));
        Ok::<_, NnError>((r, dbg.total(), untouched))
    })
    .unwrap();
    outs.swap_remove(0)
}

#[test]
fn unknown_keys_are_reported_with_the_nearest_names() {
    let plan = megatron_layer_plan()
        .add("self_attn.q_prj", ColwiseParallel::new())
        .add("mlp.down", RowwiseParallel::new());
    let (r, comms, untouched) = on_two_ranks(|mesh, m| parallelize_llama(m, mesh, &plan));
    match r {
        Err(PlanError::UnknownKeys { keys, suggestions, available }) => {
            assert_eq!(keys, ["self_attn.q_prj", "mlp.down"]);
            assert_eq!(suggestions, ["self_attn.q_proj", "mlp.down_proj"]);
            assert!(available.contains("self_attn.o_proj"), "{available}");
        }
        other => panic!("expected UnknownKeys, got {other:?}"),
    }
    assert_eq!(comms, 0, "reported before any communication");
    assert!(untouched, "no parameter sharded");
    // A top-level key too, after the layers were checked (still nothing applied).
    let top = top_level_plan().add("base_model.nrom", SequenceParallel::new());
    let (r, comms, untouched) =
        on_two_ranks(|mesh, m| parallelize_llama_with(m, mesh, &megatron_layer_plan(), &top));
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("base_model.nrom") && msg.contains("base_model.norm"), "{msg}");
    assert_eq!((comms, untouched), (0, true));
}

#[test]
fn styles_that_do_not_fit_the_module_type_are_reported() {
    let plan = megatron_layer_plan().add("self_attn.q_proj", SequenceParallel::new());
    let (r, comms, untouched) = on_two_ranks(|mesh, m| parallelize_llama(m, mesh, &plan));
    match r {
        Err(PlanError::WrongModuleType { fqn, module_type, supported, .. }) => {
            assert_eq!(fqn, "self_attn.q_proj");
            assert_eq!(module_type, "Linear");
            assert_eq!(supported, "RMSNorm");
        }
        other => panic!("expected WrongModuleType, got {other:?}"),
    }
    assert_eq!((comms, untouched), (0, true));
    let plan = ParallelizePlan::new().add("input_layernorm", ColwiseParallel::new());
    let (r, ..) = on_two_ranks(|mesh, m| parallelize_llama(m, mesh, &plan));
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("input_layernorm") && msg.contains("RMSNorm"), "{msg}");
}

#[test]
fn head_counts_that_do_not_divide_are_reported() {
    // 12 query heads and 6 kv heads over 4 ranks: the kv heads do not split.
    let mut outs = spawn_scoped(SpawnConfig::new(4).timeout(Duration::from_secs(30)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[4], &["tp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        let dbg = mesh.group(0)?.comm_debug();
        dbg.enable();
        let r = parallelize_llama(&mut model, &mesh, &megatron_layer_plan());
        let seq = parallelize_llama(&mut model, &mesh, &sequence_parallel_layer_plan());
        Ok::<_, NnError>((r, seq, dbg.total()))
    })
    .unwrap();
    let (r, seq, comms) = outs.swap_remove(0);
    match r {
        Err(PlanError::Indivisible { fqn, what }) => {
            assert_eq!(fqn, "self_attn.k_proj");
            assert!(what.contains("6 heads") && what.contains("4 ranks"), "{what}");
        }
        other => panic!("expected Indivisible, got {other:?}"),
    }
    // Plan 1 gathers q/k/v back to Replicate: no head split, so tp=4 is fine.
    assert!(seq.is_ok(), "{seq:?}");
    assert_eq!(comms, 0);
}

#[track_caller]
fn mismatch(layer: &ParallelizePlan, top: &ParallelizePlan) -> (String, String, String, String) {
    let model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    match check_llama_plan(&model, layer, top) {
        Err(PlanError::LayoutMismatch { producer, produced, consumer, expected }) => {
            (producer, produced, consumer, expected)
        }
        other => panic!("expected LayoutMismatch, got {other:?}"),
    }
}

#[test]
fn layouts_that_cannot_meet_are_reported() {
    let model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    check_llama_plan(&model, &sequence_parallel_layer_plan(), &top_level_plan()).unwrap();
    check_llama_plan(&model, &megatron_layer_plan(), &top_level_plan()).unwrap();
    // No plan at all: everything plain and whole.
    check_llama_plan(&model, &ParallelizePlan::new(), &ParallelizePlan::new()).unwrap();

    // o_proj hands on Replicate while the residual stream is sequence-sharded.
    let plan = megatron_layer_plan()
        .add("self_attn.o_proj", RowwiseParallel::new().output_layouts(Replicate));
    let (producer, produced, consumer, expected) = mismatch(&plan, &top_level_plan());
    assert_eq!(producer, "base_model.layers.0.self_attn.o_proj (output)");
    assert_eq!((produced.as_str(), expected.as_str()), ("R", "S(1)"));
    assert!(consumer.starts_with("base_model.layers.0 (residual add"), "{consumer}");
    assert!(consumer.contains("base_model.embed_tokens (output)"), "{consumer}");
    let (r, comms, untouched) = on_two_ranks(|mesh, m| parallelize_llama(m, mesh, &plan));
    let msg = r.unwrap_err().to_string();
    assert!(
        msg.contains("base_model.layers.0.self_attn.o_proj")
            && msg.contains("laid out as R")
            && msg.contains("takes it as S(1)"),
        "{msg}"
    );
    assert_eq!((comms, untouched), (0, true), "reported before any communication");

    // down_proj takes Replicate, but gate/up hand on their feature shards.
    let plan = megatron_layer_plan().add(
        "mlp.down_proj",
        RowwiseParallel::new().input_layouts(Replicate).output_layouts(Shard(1)),
    );
    let (producer, produced, consumer, expected) = mismatch(&plan, &top_level_plan());
    assert_eq!(producer, "base_model.layers.0.mlp (silu(gate) * up)");
    assert_eq!(consumer, "base_model.layers.0.mlp.down_proj (input)");
    assert_eq!((produced.as_str(), expected.as_str()), ("S(2)", "R"));

    // A norm handing on its local shard to attention that takes it as Replicate.
    let plan = megatron_layer_plan()
        .add("input_layernorm", SequenceParallel::new().use_local_output(true))
        .add(
            "self_attn",
            PrepareModuleInput::new(vec![Some(Replicate), None, None], vec![Some(Replicate)]),
        );
    let (producer, _, consumer, _) = mismatch(&plan, &top_level_plan());
    assert_eq!(producer, "base_model.layers.0.input_layernorm (output)");
    assert_eq!(consumer, "base_model.layers.0.self_attn (input)");

    // q heads sharded, k and v gathered: attention cannot pair them.
    let plan = megatron_layer_plan()
        .add("self_attn.k_proj", ColwiseParallel::new().output_layouts(Replicate));
    let (producer, produced, consumer, expected) = mismatch(&plan, &top_level_plan());
    assert_eq!(producer, "base_model.layers.0.self_attn.k_proj (output)");
    assert!(consumer.contains("scaled_dot_product_attention"), "{consumer}");
    assert_eq!((produced.as_str(), expected.as_str()), ("R", "S(2)"));

    // The embedding with RowwiseParallel's default input layout: ids are whole.
    let top = top_level_plan()
        .add("base_model.embed_tokens", RowwiseParallel::new().output_layouts(Shard(1)));
    let (producer, produced, consumer, _) = mismatch(&megatron_layer_plan(), &top);
    assert_eq!(producer, "input_ids");
    assert_eq!(produced, "R");
    assert_eq!(consumer, "base_model.embed_tokens (input)");

    // lm_head handing on local vocab shards to a plain cross_entropy.
    let top = top_level_plan()
        .add("lm_head", ColwiseParallel::new().input_layouts(Shard(1)).use_local_output(true));
    let (producer, produced, consumer, _) = mismatch(&megatron_layer_plan(), &top);
    assert_eq!(producer, "lm_head (output)");
    assert_eq!(produced, "S(2)");
    assert!(consumer.contains("loss"), "{consumer}");

    // Layers without styles take whole activations: a sequence-sharded residual
    // stream into a plain layer meets (per-token ops), a feature-sharded one does not.
    let top = ParallelizePlan::new()
        .add("base_model.embed_tokens", ColwiseParallel::new().output_layouts(Shard(-1)));
    let (producer, produced, consumer, _) = mismatch(&ParallelizePlan::new(), &top);
    assert_eq!(producer, "base_model.embed_tokens (output)");
    assert_eq!(produced, "S(2)");
    assert!(consumer.starts_with("base_model.layers.0.input_layernorm"), "{consumer}");
}

/// Runs one forward (traced) and backward of the tiny Llama under `layer_plan` at tp=2,
/// returning rank 0's explanation and its hook byte totals.
fn explained(layer_plan: &ParallelizePlan) -> (String, u64, u64) {
    let mut outs = spawn_scoped(SpawnConfig::new(2).timeout(Duration::from_secs(30)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        parallelize_llama(&mut model, &mesh, layer_plan).map_err(cfg_err)?;
        reset_parameters(&mut model, Device::Cpu, 7)?;
        let ids = Tensor::from_vec((0..16).map(|i| (i * 7 % 48) as i64).collect(), [2, 8])?;
        let tgt = Tensor::from_vec((0..16).map(|i| (i * 5 % 48) as i64).collect(), [16])?;
        let (loss, events) = trace::capture(|| -> tpar_nn::Result<Value> {
            let logits = match call(&model, Args::one(ids.clone()))? {
                Value::DTensor(d) => Value::DTensor(d.view(&[16, 48])?),
                other => other,
            };
            loss_parallel::cross_entropy(&logits, &tgt, -100)
        });
        loss_parallel::backward(&loss?, &mesh)?;
        let fwd = events.iter().map(|e| e.forward_bytes).sum();
        let bwd = events.iter().map(|e| e.backward_bytes).sum();
        Ok::<_, NnError>((explain(&model, &events), fwd, bwd))
    })
    .unwrap();
    outs.swap_remove(0)
}

/// Forward and backward calls of `kind` in `explain`'s table.
fn calls(text: &str, kind: &str) -> (usize, usize) {
    let line = text.lines().find(|l| l.trim_start().starts_with(&format!("{kind} "))).unwrap();
    let w: Vec<&str> = line.split_whitespace().collect();
    (w[2].parse().unwrap(), w[7].parse().unwrap())
}

#[test]
fn explain_shows_styles_placements_and_collectives() {
    let (text2, f2, b2) = explained(&megatron_layer_plan());
    let (text1, f1, b1) = explained(&sequence_parallel_layer_plan());
    for (text, f, b) in [(&text2, f2, b2), (&text1, f1, b1)] {
        assert!(text.contains("base_model.layers.1.self_attn.q_proj (Linear)"), "{text}");
        assert!(text.contains("weight   [24, 24] S(0) on (tp=2), local [12, 24]"), "{text}");
        assert!(text.contains("base_model.layers.0.input_layernorm (RMSNorm)"), "{text}");
        assert!(text.contains("ColwiseParallel"), "{text}");
        assert!(text.contains("all_gather") && text.contains("reduce_scatter"), "{text}");
        let total = format!("total: forward {f} B, backward {b} B, forward+backward {} B", f + b);
        assert!(text.contains(&total), "{total} not in\n{text}");
        assert!(!text.contains("(modules not in this model)"), "{text}");
    }
    // Plan 2: per layer one all_gather + one reduce_scatter per sub-layer forward, and
    // the lm_head input's all_gather; backward the same kinds swapped.
    assert_eq!(calls(&text2, "all_gather"), (5, 5), "{text2}");
    assert_eq!(calls(&text2, "reduce_scatter"), (5, 5), "{text2}");
    assert!(
        f2 + b2 < f1 + b1,
        "plan 2 {} B must move fewer bytes than plan 1 {} B",
        f2 + b2,
        f1 + b1
    );
}
