//! The Llama, its RoPE tables and attention under every mask form, against golden
//! values from an independent PyTorch implementation (`tests/golden/make_llama_golden.py`,
//! float64). Single-rank and 2x2 (FSDP x TP, both tensor-parallel plans) runs must both
//! match to 1e-10, so a mistake shared by the sharded and unsharded paths (a RoPE
//! frequency layout, a mask off by one, a norm's epsilon) fails here.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::golden::{self, assert_close, Golden};
use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::llama_plans::{
    megatron_layer_plan, parallelize_llama, sequence_parallel_layer_plan,
};
use tpar_models::{LlamaConfig, LlamaForPretraining, RotaryPositionEncoding};
use tpar_nn::{call, named_parameters, visit_modules_mut, Args, Module, NnError, Param, Value};
use tpar_parallel_styles::{fully_shard, loss_parallel, unshard, FsdpConfig, ParallelizePlan};
use tpar_tensor::{DType, Device, Tensor};

/// Agreement required with the float64 golden values: only summation order differs.
const TOL: f64 = 1e-10;

/// The configuration `make_llama_golden.py` builds.
fn config() -> LlamaConfig {
    tpar_testing::tiny_llama_config(32, 16, 2, DType::F64)
}

type Files = BTreeMap<String, Golden>;

fn tensor(g: &Golden) -> Tensor {
    Tensor::from_f64(&g.values, g.shape.clone(), DType::F64).unwrap()
}

fn ids(g: &Golden) -> Tensor {
    Tensor::from_vec(g.ints(), g.shape.clone()).unwrap()
}

/// Materializes every parameter of `model` (plain, DTensor or FSDP, on any mesh) with
/// the golden full value of the same FQN: each rank keeps only its shard.
fn load_golden_params(model: &mut dyn Module, file: &Files) -> Result<(), NnError> {
    visit_modules_mut(model, "", &mut |prefix, module| {
        for slot in module.param_slots() {
            let fqn = if prefix.is_empty() {
                slot.name.to_string()
            } else {
                format!("{prefix}.{}", slot.name)
            };
            let full = tensor(golden::get(file, &format!("param.{fqn}")));
            assert_eq!(full.dims(), slot.param.shape().as_slice(), "{fqn}: golden shape");
            *slot.param = match &*slot.param {
                Param::Tensor(_) => Param::Tensor(full.requires_grad_(true)),
                Param::DTensor(d) => {
                    let local = tpar_dtensor::redistribute::slice_full(&full, d.spec())?;
                    let leaf = local.requires_grad_(true);
                    // An FSDP parameter's state takes the new shard as its own.
                    if let Some(u) = slot.param.unsharder()? {
                        u.adopt(&leaf)?;
                    }
                    Param::DTensor(tpar_dtensor::DTensor::from_local(
                        &leaf,
                        d.mesh(),
                        d.placements(),
                        Some(d.shape()),
                    )?)
                }
            };
        }
        Ok(())
    })
}

/// What one forward + backward produced on one rank: its rows' logits (full vocab), its
/// loss, and every parameter's full gradient.
struct Outcome {
    logits: Vec<f64>,
    loss: f64,
    grads: BTreeMap<String, Vec<f64>>,
}

/// Forward, loss and backward of `model` on `rows` of the golden batch (`prefix` is ""
/// for the padded batch with its mask, "causal." for the unmasked one, "additive." for
/// the padded batch with the additive form of its mask). `typed` calls the model as a
/// trainer would (`logits`, `Value::reshape`, `Value::cross_entropy`, `loss.backward()`
/// inside `loss_parallel::enable`), else through `call` and `loss_parallel`'s functions.
fn run(
    model: &LlamaForPretraining,
    file: &Files,
    prefix: &str,
    rows: std::ops::Range<usize>,
    tp: Option<&DeviceMesh>,
    typed: bool,
) -> Result<Outcome, NnError> {
    let (r0, nr) = (rows.start, rows.len());
    // The additive mask is the padded batch's mask in the `[b, 1, s, s]` form.
    let data = if prefix == "additive." { "" } else { prefix };
    let input = ids(golden::get(file, &format!("{data}input_ids"))).narrow(0, r0, nr)?;
    let labels = ids(golden::get(file, &format!("{data}labels"))).narrow(0, r0, nr)?;
    let (s, v) = (input.dims()[1], config().vocab_size);
    let mask = match prefix {
        "" => Some(ids(golden::get(file, "attention_mask")).narrow(0, r0, nr)?),
        "additive." => Some(additive_mask(file).narrow(0, r0, nr)?),
        _ => None,
    };
    let labels = labels.reshape([nr * s])?;
    let (logits, loss) = if typed {
        // What a trainer writes: one handle for plain and sharded logits, and
        // `loss.backward()` inside loss_parallel's scope.
        let out = model.logits(&input, mask.as_ref())?;
        let loss = out.reshape(&[-1, v as isize])?.cross_entropy(&labels, -100)?;
        let _scope = tp.map(loss_parallel::enable);
        loss.backward()?;
        (out, loss)
    } else {
        let mut args = vec![Value::Tensor(input)];
        args.extend(mask.map(Value::Tensor));
        let out = call(model, Args::new(args))?;
        let flat = match &out {
            Value::DTensor(d) => Value::DTensor(d.view(&[(nr * s) as isize, v as isize])?),
            Value::Tensor(t) => Value::Tensor(t.reshape([nr * s, v])?),
            other => panic!("logits: {other:?}"),
        };
        let loss = loss_parallel::cross_entropy(&flat, &labels, -100)?;
        match tp {
            Some(tp) => loss_parallel::backward(&loss, tp)?,
            None => loss.clone().into_tensor("loss")?.backward()?,
        }
        (out, loss)
    };
    let loss_value = loss.item()?;
    let logits = match logits {
        Value::DTensor(d) => d.full_tensor()?,
        Value::Tensor(t) => t.detach(),
        other => panic!("logits: {other:?}"),
    };
    let mut grads = BTreeMap::new();
    for (n, p) in named_parameters(model) {
        let g = p.grad()?.unwrap_or_else(|| panic!("{n} has no gradient"));
        grads.insert(n, g.full()?.to_vec_f64()?);
    }
    Ok(Outcome { logits: logits.to_vec_f64()?, loss: loss_value, grads })
}

/// The golden batch's causal + key-padding mask as an additive `[b, 1, s, s]` float
/// mask: 0 where query `i` may read key `j` (`j <= i`, key `j` a token), -inf elsewhere.
fn additive_mask(file: &Files) -> Tensor {
    let pad = golden::get(file, "attention_mask");
    let (b, s) = (pad.shape[0], pad.shape[1]);
    let mut m = vec![f64::NEG_INFINITY; b * s * s];
    for r in 0..b {
        for i in 0..s {
            for j in 0..=i {
                if pad.values[r * s + j] != 0.0 {
                    m[(r * s + i) * s + j] = 0.0;
                }
            }
        }
    }
    Tensor::from_f64(&m, [b, 1, s, s], DType::F64).unwrap()
}

/// Compares one rank's outcome with the golden values for `rows`.
fn check(what: &str, out: &Outcome, file: &Files, prefix: &str, rows: std::ops::Range<usize>) {
    let prefix = if prefix == "additive." { "" } else { prefix };
    let logits = golden::get(file, &format!("{prefix}logits"));
    let per_row = logits.values.len() / logits.shape[0];
    let want = &logits.values[rows.start * per_row..rows.end * per_row];
    assert_close(&format!("{what}: logits"), &out.logits, want, TOL, TOL);
    if rows.len() == logits.shape[0] {
        let loss = golden::get(file, &format!("{prefix}loss")).values[0];
        assert_close(&format!("{what}: loss"), &[out.loss], &[loss], TOL, TOL);
    }
    // Gradients are averaged over the data-parallel halves, which hold the same number
    // of counted labels: the average of their means is the whole batch's mean.
    assert_eq!(out.grads.len(), config().num_hidden_layers * 9 + 3, "{what}: parameter count");
    for (name, g) in &out.grads {
        let want = golden::get(file, &format!("{prefix}grad.{name}"));
        assert_close(&format!("{what}: grad {name}"), g, &want.values, TOL, TOL);
    }
}

#[test]
fn single_rank_llama_equals_pytorch() {
    let file = golden::load("llama.safetensors");
    for prefix in ["", "causal.", "additive."] {
        let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
        load_golden_params(&mut model, &file).unwrap();
        let out = run(&model, &file, prefix, 0..4, None, false).unwrap();
        check(&format!("single rank {prefix}"), &out, &file, prefix, 0..4);
        let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
        load_golden_params(&mut model, &file).unwrap();
        let out = run(&model, &file, prefix, 0..4, None, true).unwrap();
        check(&format!("single rank typed {prefix}"), &out, &file, prefix, 0..4);
    }
}

use tpar_testing::plan_err;

/// dp = 2 (FSDP per layer, then the model) x tp = 2 under `plan`; each dp rank runs two
/// of the four rows.
fn two_by_two(plan: fn() -> ParallelizePlan, name: &str, typed: bool) {
    let file = golden::load("llama.safetensors");
    for prefix in ["", "causal.", "additive."] {
        let outs = spawn_scoped(SpawnConfig::new(4).timeout(Duration::from_secs(120)), |ctx| {
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
            parallelize_llama(&mut model, &mesh["tp"], &plan()).map_err(plan_err)?;
            let fsdp = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &fsdp)?;
            }
            fully_shard(&mut model, &mesh["dp"], &fsdp)?;
            load_golden_params(&mut model, &file)?;
            unshard(&model)?;
            let r = mesh["dp"].local_rank();
            Ok::<_, NnError>((
                r,
                run(&model, &file, prefix, 2 * r..2 * r + 2, Some(&mesh["tp"]), typed)?,
            ))
        })
        .unwrap_or_else(|e| panic!("2x2 {name} {prefix}: {e}"));
        for (rank, (r, out)) in outs.iter().enumerate() {
            let what = format!("2x2 {name} {prefix}rank {rank}");
            check(&what, out, &file, prefix, 2 * r..2 * r + 2);
        }
        // The whole batch's loss is the mean of the two halves' losses.
        let mean = outs.iter().map(|(_, o)| o.loss).sum::<f64>() / outs.len() as f64;
        let data = if prefix == "additive." { "" } else { prefix };
        let want = golden::get(&file, &format!("{data}loss")).values[0];
        assert_close(&format!("2x2 {name} {prefix}mean loss"), &[mean], &[want], TOL, TOL);
    }
}

#[test]
fn fsdp_x_megatron_llama_equals_pytorch() {
    two_by_two(megatron_layer_plan, "megatron", false);
    two_by_two(megatron_layer_plan, "megatron typed", true);
}

#[test]
fn fsdp_x_sequence_parallel_llama_equals_pytorch() {
    two_by_two(sequence_parallel_layer_plan, "sequence-parallel", true);
}

#[test]
fn rope_tables_equal_pytorch() {
    let file = golden::load("rope.safetensors");
    for (name, hd, n, theta) in
        [("d8_theta1e4", 8, 16, 1e4), ("d16_theta5e5", 16, 32, 5e5), ("d6_theta100", 6, 12, 100.0)]
    {
        let rope = RotaryPositionEncoding::new(hd, n, theta, DType::F64).unwrap();
        let t = rope.tables(n).unwrap();
        let (cos, sin) = (
            golden::get(&file, &format!("{name}.cos")),
            golden::get(&file, &format!("{name}.sin")),
        );
        assert_eq!(t.cos.dims(), cos.shape.as_slice(), "{name}: cos shape");
        assert_close(&format!("{name} cos"), &t.cos.to_vec_f64().unwrap(), &cos.values, 1e-13, 0.0);
        assert_close(&format!("{name} sin"), &t.sin.to_vec_f64().unwrap(), &sin.values, 1e-13, 0.0);
        // A prefix of the tables is the tables of the shorter sequence.
        let short = rope.tables(3).unwrap();
        assert_eq!(
            short.cos.to_vec_f64().unwrap(),
            t.cos.narrow(0, 0, 3).unwrap().to_vec_f64().unwrap()
        );
    }
}

/// Grouped-query SDPA (4 query heads over 2 key/value heads, 9 positions) forward and
/// backward under each mask form: none, causal (the flag, no mask tensor), key padding
/// and a general additive mask (both as `[b, 1, s, s]` tensors).
#[test]
fn attention_mask_forms_equal_pytorch() {
    let file = golden::load("attention.safetensors");
    for form in ["none", "causal", "key_padding", "additive"] {
        let leaf = |k: &str| tensor(golden::get(&file, k)).requires_grad_(true);
        let (q, k, v) = (leaf("q"), leaf("k"), leaf("v"));
        let w = tensor(golden::get(&file, "w"));
        let mask = file.get(&format!("{form}.mask")).map(tensor);
        let out =
            Tensor::scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), form == "causal", None)
                .unwrap();
        out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let want = |x: &str| &golden::get(&file, &format!("{form}.{x}")).values;
        assert_close(&format!("{form}: out"), &out.to_vec_f64().unwrap(), want("out"), TOL, TOL);
        for (name, t) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            let g = t.grad().unwrap_or_else(|| panic!("{form}: no {name}")).to_vec_f64().unwrap();
            assert_close(&format!("{form}: {name}"), &g, want(name), TOL, TOL);
        }
    }
}

/// A mask that is neither `[b, s]` nor `[b, 1, s, s]` float is a typed error naming the
/// expected shape.
#[test]
fn a_misshaped_additive_mask_is_a_typed_error() {
    let file = golden::load("llama.safetensors");
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    load_golden_params(&mut model, &file).unwrap();
    let input = ids(golden::get(&file, "input_ids"));
    let bad = Tensor::zeros([4, 1, 8, 7], DType::F64, Device::Cpu).unwrap();
    let err = call(&model, Args::new(vec![Value::Tensor(input), Value::Tensor(bad)]))
        .expect_err("a [4, 1, 8, 7] mask must be refused");
    assert!(err.to_string().contains("[4, 1, 8, 8]"), "{err}");
}
