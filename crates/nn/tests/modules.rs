//! The module layer: fully-qualified parameter names, deferred initialisation of a
//! sharded model, PyTorch's initialisation statistics, train/eval mode, typed errors
//! for bad inputs to the Llama, and a context-parallel `Dropout` against the unsharded
//! one.

use std::time::Duration;

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_dtensor::distribute_tensor;
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_models::llama_plans::{megatron_layer_plan, parallelize_llama};
use tpar_models::{LlamaConfig, LlamaForPretraining};
use tpar_nn::{
    call, named_modules, named_parameters, reset_parameters, set_training, Args, Dropout,
    Embedding, Linear, NnError, Param, RmsNorm, Value,
};
use tpar_tensor::{DType, Device, Tensor};

fn config() -> LlamaConfig {
    tpar_testing::tp_llama_config(DType::F32)
}

#[test]
fn llama_parameter_names_match_the_reference() {
    let model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    let mut want = vec![
        ("base_model.embed_tokens.weight".to_string(), vec![48, 24]),
        ("base_model.norm.weight".to_string(), vec![24]),
        ("lm_head.weight".to_string(), vec![48, 24]),
    ];
    for i in 0..2 {
        let l = format!("base_model.layers.{i}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![24]),
            ("self_attn.q_proj.weight", vec![24, 24]),
            ("self_attn.k_proj.weight", vec![12, 24]),
            ("self_attn.v_proj.weight", vec![12, 24]),
            ("self_attn.o_proj.weight", vec![24, 24]),
            ("post_attention_layernorm.weight", vec![24]),
            ("mlp.gate_proj.weight", vec![40, 24]),
            ("mlp.up_proj.weight", vec![40, 24]),
            ("mlp.down_proj.weight", vec![24, 40]),
        ] {
            want.push((format!("{l}.{name}"), shape));
        }
    }
    let mut got: Vec<(String, Vec<usize>)> =
        named_parameters(&model).into_iter().map(|(n, p)| (n, p.shape())).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    let modules: Vec<String> = named_modules(&model).into_iter().map(|(n, _)| n).collect();
    for m in ["", "base_model", "base_model.layers", "base_model.layers.1.self_attn", "lm_head"] {
        assert!(modules.iter().any(|n| n == m), "{m} missing from {modules:?}");
    }
}

/// Built on `Device::Meta`, parallelized at tp=2, then materialized: every rank holds only
/// its shards, equal to the slices of the unsharded model's initial values.
#[test]
fn deferred_init_materializes_only_local_shards() {
    let mut reference = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    for (n, p) in named_parameters(&reference) {
        assert_eq!(p.local().device(), Device::Meta, "{n} is allocated before reset");
    }
    reset_parameters(&mut reference, Device::Cpu, 7).unwrap();
    let full: Vec<(String, Tensor)> =
        named_parameters(&reference).into_iter().map(|(n, p)| (n, p.local())).collect();
    let total: usize = full.iter().map(|(_, t)| t.numel()).sum();
    let locals = spawn_scoped(SpawnConfig::new(2).timeout(Duration::from_secs(30)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
        let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
        parallelize_llama(&mut model, &mesh, &megatron_layer_plan())
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        for (n, p) in named_parameters(&model) {
            if p.local().device() != Device::Meta {
                return Err(NnError::Config { what: format!("{n} allocated by parallelize") });
            }
        }
        reset_parameters(&mut model, Device::Cpu, 7)?;
        let mut held = 0;
        for ((n, p), (fname, f)) in named_parameters(&model).into_iter().zip(&full) {
            assert_eq!(&n, fname);
            let d = p.dtensor().expect("every parameter is a DTensor after parallelize");
            let local = d.to_local();
            assert_eq!(local.device(), Device::Cpu, "{n}");
            let want = distribute_tensor(f, &mesh, d.placements())?.to_local();
            assert_eq!(local.dims(), want.dims(), "{n}: local shape");
            assert_eq!(local.to_vec_f64()?, want.to_vec_f64()?, "{n}: local values");
            held += local.numel();
        }
        Ok::<_, NnError>(held)
    })
    .unwrap();
    // Sharded parameters are split; only the norms' weights are held whole by each rank.
    let norms: usize =
        full.iter().filter(|(n, _)| n.contains("norm")).map(|(_, t)| t.numel()).sum();
    for held in locals {
        assert_eq!(held, (total - norms) / 2 + norms);
    }
}

fn stats(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
    (mean, var)
}

#[test]
fn initialisation_follows_pytorch_defaults() {
    // Linear: weight and bias U(-1/sqrt(in), 1/sqrt(in)), variance b^2 / 3.
    let mut lin = Linear::new(256, 128, true, DType::F64, Device::Meta).unwrap();
    reset_parameters(&mut lin, Device::Cpu, 1).unwrap();
    let b = 1.0 / 16.0;
    let w = lin.weight.local().to_vec_f64().unwrap();
    assert!(w.iter().all(|x| x.abs() <= b), "weight outside U(-{b}, {b})");
    let (mean, var) = stats(&w);
    assert!(mean.abs() < 0.002, "mean {mean}");
    assert!((var / (b * b / 3.0) - 1.0).abs() < 0.05, "var {var}");
    let bias = lin.bias.as_ref().unwrap().local().to_vec_f64().unwrap();
    assert_eq!(bias.len(), 128);
    assert!(bias.iter().all(|x| x.abs() <= b));
    assert!(bias.iter().any(|x| *x != 0.0));
    // Embedding: N(0, 1).
    let mut emb = Embedding::new(1000, 64, DType::F64, Device::Meta).unwrap();
    reset_parameters(&mut emb, Device::Cpu, 2).unwrap();
    let (mean, var) = stats(&emb.weight.local().to_vec_f64().unwrap());
    assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "N(0,1)? mean {mean} var {var}");
    // RMSNorm: ones.
    let mut norm = RmsNorm::new(24, 1e-6, DType::F32, Device::Meta).unwrap();
    reset_parameters(&mut norm, Device::Cpu, 3).unwrap();
    assert!(norm.weight.local().to_vec_f64().unwrap().iter().all(|&x| x == 1.0));
    // Values depend on (seed, FQN): two projections differ, the same seed repeats.
    let mut a = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    let mut b2 = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut a, Device::Cpu, 9).unwrap();
    reset_parameters(&mut b2, Device::Cpu, 9).unwrap();
    let attn = &a.base_model.layers.items[0].self_attn;
    assert_ne!(
        attn.q_proj.weight.local().to_vec_f64().unwrap(),
        attn.o_proj.weight.local().to_vec_f64().unwrap()
    );
    for ((n, p), (_, q)) in named_parameters(&a).into_iter().zip(named_parameters(&b2)) {
        assert_eq!(p.local().to_vec_f64().unwrap(), q.local().to_vec_f64().unwrap(), "{n}");
    }
}

#[test]
fn set_training_flips_every_module() {
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    assert!(named_modules(&model).iter().all(|(_, m)| m.core().training()));
    set_training(&mut model, false).unwrap();
    assert!(named_modules(&model).iter().all(|(_, m)| !m.core().training()));
    set_training(&mut model, true).unwrap();
    assert!(named_modules(&model).iter().all(|(_, m)| m.core().training()));
}

fn run(model: &LlamaForPretraining, args: Args) -> Result<Value, NnError> {
    call(model, args)
}

#[test]
fn bad_inputs_to_the_llama_are_typed_errors() {
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 0).unwrap();
    let ids = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        Tensor::from_vec((0..n).map(|i| (i % 48) as i64).collect::<Vec<_>>(), shape.to_vec())
            .unwrap()
    };
    // Wrong number of dims.
    for shape in [&[8][..], &[2, 2, 4][..]] {
        match run(&model, Args::one(ids(shape))) {
            Err(NnError::BadInput { module, what }) => {
                assert_eq!(module, "LlamaModel");
                assert!(what.contains("[batch, seq]"), "{what}");
            }
            other => panic!("{shape:?}: expected BadInput, got {other:?}"),
        }
    }
    // Longer than max_position_embeddings.
    match run(&model, Args::one(ids(&[1, 33]))) {
        Err(NnError::Config { what }) => {
            assert!(what.contains("33") && what.contains("max_position_embeddings 32"), "{what}")
        }
        other => panic!("expected Config, got {other:?}"),
    }
    // An attention mask of the wrong shape.
    let mask = Tensor::from_vec(vec![1i64; 8], [1, 8]).unwrap();
    match run(&model, Args::new(vec![Value::Tensor(ids(&[2, 8])), Value::Tensor(mask)])) {
        Err(NnError::BadInput { what, .. }) => assert!(what.contains("attention_mask"), "{what}"),
        other => panic!("expected BadInput, got {other:?}"),
    }
    // Ids outside the vocabulary, or not integers: errors, not panics.
    let big = Tensor::from_vec(vec![0i64, 48, 1, 2], [1, 4]).unwrap();
    assert!(run(&model, Args::one(big)).is_err());
    let floats = Tensor::from_vec(vec![0.0f32; 4], [1, 4]).unwrap();
    assert!(run(&model, Args::one(floats)).is_err());
    // Not a tensor at all.
    assert!(matches!(run(&model, Args::new(vec![Value::None])), Err(NnError::BadInput { .. })));
    // Configs that cannot work.
    for (hidden, heads, kv, why) in
        [(25, 4, 2, "hidden_size 25"), (24, 4, 3, "num_key_value_heads 3"), (24, 0, 1, "0")]
    {
        let cfg = LlamaConfig {
            hidden_size: hidden,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            ..config()
        };
        match LlamaForPretraining::new(&cfg, Device::Meta) {
            Err(NnError::Config { what }) => assert!(what.contains(why), "{what}"),
            Err(other) => panic!("expected Config, got {other:?}"),
            Ok(_) => panic!("{cfg:?} accepted"),
        }
    }
    // The model still works after all that.
    let ok = run(&model, Args::one(ids(&[2, 8]))).unwrap().into_tensor("test").unwrap();
    assert_eq!(ok.dims(), [2, 8, 48]);
    // A plain parameter is a Param::Tensor until a style or FSDP distributes it.
    assert!(named_parameters(&model).iter().all(|(_, p)| matches!(p, Param::Tensor(_))));
}

/// Regression: under mixed precision the parameters (and so the activations) are bf16
/// while the model's RoPE tables and padding mask are built in the f32 config dtype; the
/// attention casts them to the activation dtype instead of failing with a dtype mismatch.
#[test]
fn bf16_parameters_with_f32_rope_tables_and_mask() {
    let mut model = LlamaForPretraining::new(&config(), Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 0).unwrap();
    let ids =
        Tensor::from_vec((0..16).map(|i| (i * 5 % 48) as i64).collect::<Vec<_>>(), [2, 8]).unwrap();
    let mask =
        Tensor::from_vec(vec![1i64, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], [2, 8]).unwrap();
    let args = || Args::new(vec![Value::Tensor(ids.clone()), Value::Tensor(mask.clone())]);
    let want = run(&model, args()).unwrap().into_tensor("f32").unwrap();
    tpar_nn::visit_modules_mut(&mut model, "", &mut |_, m| {
        for slot in m.param_slots() {
            let bf16 = slot.param.local().detach().to_dtype(DType::BF16)?.requires_grad_(true);
            *slot.param = Param::Tensor(bf16);
        }
        Ok(())
    })
    .unwrap();
    let got = run(&model, args()).unwrap().into_tensor("bf16").unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    tpar_tensor::tol::Tol::for_dtype(DType::BF16)
        .scaled(5.0)
        .check_tensors("bf16 logits vs f32", &got, &want)
        .unwrap();
    got.sum_all().unwrap().backward().unwrap();
    let (_, p) = &named_parameters(&model)[1];
    assert_eq!(p.local().grad().expect("gradient").dtype(), DType::BF16);
}

/// `Value::reshape` infers one `-1` dim and refuses shapes that cannot hold the values,
/// with a typed error naming the shape; `item` reads a one-element value.
#[test]
fn value_reshape_infers_one_dim_and_rejects_bad_shapes() {
    let v = tpar_nn::Value::Tensor(
        tpar_tensor::Tensor::from_vec((0..12).map(|x| x as f32).collect::<Vec<_>>(), [3, 4])
            .unwrap(),
    );
    let r = v.reshape(&[-1, 6]).unwrap().into_tensor("test").unwrap();
    assert_eq!(r.dims(), &[2, 6]);
    for bad in [&[-1, -1][..], &[5, -1], &[-2, 6], &[0, -1]] {
        let e = v.reshape(bad).expect_err("must be refused");
        assert!(matches!(e, tpar_nn::NnError::Tensor(_)), "{bad:?}: {e}");
        assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
    }
    let one = tpar_nn::Value::Tensor(tpar_tensor::Tensor::from_vec(vec![2.5f64], [1]).unwrap());
    assert_eq!(one.item().unwrap(), 2.5);
    assert!(tpar_nn::Value::None.item().is_err());
}

/// `Dropout::context_parallel` on each cp rank's rows (cp 3, a sequence of 13: uneven and
/// empty chunks) gives the unsharded `Dropout`'s rows, bit for bit; in eval mode its
/// input; a DTensor input is a typed error.
#[test]
fn a_context_parallel_dropout_equals_the_unsharded_one() {
    use tpar_dtensor::CpLayout;
    use tpar_tensor::manual_seed;
    let x = Tensor::randn([2, 13, 4], DType::F64, &mut tpar_tensor::Rng::new(8)).unwrap();
    manual_seed(2);
    let full = call(&Dropout::new(0.4).unwrap(), Args::one(x.clone())).unwrap();
    let full = full.into_tensor("full").unwrap().to_vec::<f64>().unwrap();
    let cfg = SpawnConfig::new(3).timeout(Duration::from_secs(20));
    spawn_scoped(cfg, |ctx| -> Result<(), NnError> {
        let g = ctx.world_group();
        let layout = CpLayout::new(13, 3)?;
        let local = layout.shard(&x, 1, g.rank())?;
        let mut d = Dropout::new(0.4)?.context_parallel(layout, g.rank(), 1);
        manual_seed(2);
        let y = call(&d, Args::one(local.clone()))?.into_tensor("y")?;
        let all = layout.unshard(&y, 1, &g)?.to_vec::<f64>()?;
        assert_eq!(all, full, "rank {}", g.rank());
        set_training(&mut d, false)?;
        let same = call(&d, Args::one(local.clone()))?.into_tensor("eval")?;
        assert_eq!(same.to_vec::<f64>()?, local.to_vec::<f64>()?);
        set_training(&mut d, true)?;
        let mesh = DeviceMesh::new(&g, DeviceType::Cpu, &[3], &["cp"])?;
        let dt = distribute_tensor(&x, &mesh, &[tpar_dtensor::Placement::Replicate])?;
        match call(&d, Args::new(vec![Value::DTensor(dt)])) {
            Err(NnError::BadInput { what, .. }) => assert!(what.contains("plain tensor"), "{what}"),
            other => panic!("{other:?}"),
        }
        Ok(())
    })
    .unwrap();
}
