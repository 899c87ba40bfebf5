//! Fused projections ([`LlamaFusion::projections`]): q, k and v (and gate and up) by one
//! GEMM over the concatenated weights give the loss and every parameter's gradient of the
//! separate projections (f64, within 1e-12) at one rank, with full and selective
//! activation checkpointing, and under FSDP over 2 ranks; under a tensor-parallel plan
//! the fusion does not apply and the step is the unfused one bit for bit; on the
//! emulated CUDA device (f32) the fused step matches the unfused one within f32
//! rounding, and recomputes bit for bit under full and selective checkpointing. The
//! switch defaults to off, and off is the model as it always computed.

use std::collections::BTreeMap;
use std::sync::Once;
use std::time::Duration;

use tpar::models::LlamaFusion;
use tpar::prelude::*;
use tpar::tensor::gpu::{self, EmulatedGpu};

mod common;
use common::llama_pipeline::{batch, grads_by_fqn, loss_backward};

type Grads = BTreeMap<String, Vec<f64>>;

const FUSED: LlamaFusion = LlamaFusion { projections: true, residual: false };

/// A 2-layer f64 Llama of width 16 (q 16, k and v 8 wide: unequal pieces), MLP 24.
fn config(dtype: DType) -> LlamaConfig {
    tpar_testing::tiny_llama_config(40, 16, 2, dtype)
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap()
}

/// `got` within `tol` of `want` (relative to the larger of `floor` and the value), every
/// FQN.
fn assert_close_to(what: &str, got: &(f64, Grads), want: &(f64, Grads), tol: f64, floor: f64) {
    let near = |a: f64, b: f64| (a - b).abs() <= tol * b.abs().max(floor);
    assert!(near(got.0, want.0), "{what}: loss {} vs {}", got.0, want.0);
    assert_eq!(got.1.len(), want.1.len(), "{what}: parameter count");
    for (name, w) in &want.1 {
        let g = &got.1[name];
        assert_eq!(g.len(), w.len(), "{what}: {name} size");
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(near(*a, *b), "{what}: gradient of {name}[{i}] is {a}, unfused {b}");
        }
    }
}

/// [`assert_close_to`] relative to the larger of 1 and the value.
fn assert_close(what: &str, got: &(f64, Grads), want: &(f64, Grads), tol: f64) {
    assert_close_to(what, got, want, tol, 1.0);
}

/// Loss and gradients of one step at one rank on the host, with `fusion` and `policy`.
fn single(fusion: LlamaFusion, policy: &AcPolicy) -> (f64, Grads) {
    let cfg = config(DType::F64);
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 11).unwrap();
    apply_activation_checkpointing(&mut model, policy).unwrap();
    model.set_fusion(fusion);
    let (ids, tgt) = batch(3, 12, cfg.vocab_size);
    let loss = loss_backward(&model, cfg.vocab_size, (&ids, &tgt), None).unwrap();
    (loss.item().unwrap(), grads_by_fqn(&model))
}

#[test]
fn fused_projections_equal_separate_ones_at_one_rank() {
    let want = single(LlamaFusion::default(), &AcPolicy::None);
    assert_close("fused", &single(FUSED, &AcPolicy::None), &want, 1e-12);
    for policy in [AcPolicy::full(), AcPolicy::selective()] {
        assert_close(&format!("fused, {policy}"), &single(FUSED, &policy), &want, 1e-12);
    }
}

#[test]
fn the_fusion_applies_to_plain_weights_and_defaults_to_off() {
    let cfg = config(DType::F64);
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 3).unwrap();
    let x = Value::Tensor(Tensor::zeros([2, 5, cfg.hidden_size], DType::F64, Device::Cpu).unwrap());
    let layer = |m: &LlamaForPretraining| {
        let l = m.base_model.layers.items[1].inner();
        (l.self_attn.projections_fused_for(&x).unwrap(), l.mlp.projections_fused_for(&x).unwrap())
    };
    assert_eq!(layer(&model), (false, false));
    model.set_fusion(FUSED);
    assert_eq!(layer(&model), (true, true));
    // Off again: the separate projections.
    model.set_fusion(LlamaFusion::default());
    assert_eq!(layer(&model), (false, false));
}

/// One step of the 2-layer f64 Llama with FSDP over 2 ranks (per layer and at the root),
/// each rank half the batch: loss and each rank's gradient shards.
fn fsdp(fusion: LlamaFusion) -> Vec<(f64, Grads)> {
    let cfg = config(DType::F64);
    spawn_scoped(
        SpawnConfig::new(2).timeout(Duration::from_secs(120)),
        move |ctx| -> tpar::Result<(f64, Grads)> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
            let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
            model.set_fusion(fusion);
            let fsdp = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &fsdp)?;
            }
            fully_shard(&mut model, &mesh["dp"], &fsdp)?;
            reset_parameters(&mut model, Device::Cpu, 9)?;
            // The gathered weights are what the fused GEMM concatenates.
            let x = Value::Tensor(Tensor::zeros([1, 2, cfg.hidden_size], DType::F64, Device::Cpu)?);
            let layer = model.base_model.layers.items[0].inner();
            let fused =
                (layer.self_attn.projections_fused_for(&x)?, layer.mlp.projections_fused_for(&x)?);
            assert_eq!(fused, (fusion.projections, fusion.projections));
            let (ids, tgt) = batch(4, 8, cfg.vocab_size);
            let r = mesh.local_rank();
            let (ids, tgt) = (ids.narrow(0, 2 * r, 2)?, tgt.narrow(0, 2 * r, 2)?);
            let loss = loss_backward(&model, cfg.vocab_size, (&ids, &tgt), None)?;
            Ok((loss.item()?, grads_by_fqn(&model)))
        },
    )
    .unwrap()
}

#[test]
fn fused_projections_equal_separate_ones_under_fsdp() {
    let want = fsdp(LlamaFusion::default());
    for (r, (got, want)) in fsdp(FUSED).iter().zip(&want).enumerate() {
        assert_close(&format!("fsdp rank {r}"), got, want, 1e-12);
    }
}

/// One step of the 2-layer f64 tp Llama on 2 ranks with the sequence-parallel plan and
/// loss_parallel: loss bits and each rank's gradient bits.
fn tp(fusion: LlamaFusion) -> Vec<(u64, BTreeMap<String, Vec<u64>>)> {
    let cfg = tpar_testing::tp_llama_config(DType::F64);
    spawn_scoped(
        SpawnConfig::new(2).timeout(Duration::from_secs(120)),
        move |ctx| -> tpar::Result<(u64, BTreeMap<String, Vec<u64>>)> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["tp"])?;
            let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
            parallelize_llama(&mut model, &mesh["tp"], &sequence_parallel_layer_plan())?;
            model.set_fusion(fusion);
            reset_parameters(&mut model, Device::Cpu, 5)?;
            let x = Value::Tensor(Tensor::zeros([1, 2, cfg.hidden_size], DType::F64, Device::Cpu)?);
            let layer = model.base_model.layers.items[0].inner();
            assert!(
                !layer.self_attn.projections_fused_for(&x)?
                    && !layer.mlp.projections_fused_for(&x)?
            );
            let (ids, tgt) = batch(2, 8, cfg.vocab_size);
            let _lp = loss_parallel::enable(&mesh["tp"]);
            let logits = model.logits(&ids, None)?.reshape(&[-1, cfg.vocab_size as isize])?;
            let loss = logits.cross_entropy(&tgt.reshape([tgt.numel()])?, -100)?;
            loss.backward()?;
            let bits = grads_by_fqn(&model)
                .into_iter()
                .map(|(n, g)| (n, g.into_iter().map(f64::to_bits).collect()))
                .collect();
            Ok((loss.item()?.to_bits(), bits))
        },
    )
    .unwrap()
}

#[test]
fn under_a_tensor_parallel_plan_the_projections_stay_separate() {
    assert_eq!(tp(FUSED), tp(LlamaFusion::default()));
}

/// Makes `cuda:0` an emulated device, once for this binary's tests.
fn emulated_device() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| gpu::register_device(0, EmulatedGpu::open(0).expect("emulator")));
}

/// One f32 step on the emulated `cuda:0`.
fn on_device(fusion: LlamaFusion) -> (f64, Grads) {
    on_device_with(fusion, &AcPolicy::None)
}

/// One f32 step on the emulated `cuda:0` under the checkpointing `policy`.
fn on_device_with(fusion: LlamaFusion, policy: &AcPolicy) -> (f64, Grads) {
    emulated_device();
    let cfg = config(DType::F32);
    let dev = Device::Cuda(0);
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, dev, 11).unwrap();
    apply_activation_checkpointing(&mut model, policy).unwrap();
    model.set_fusion(fusion);
    let (ids, tgt) = batch(2, 9, cfg.vocab_size);
    let (ids, tgt) = (ids.to_device(dev).unwrap(), tgt.to_device(dev).unwrap());
    let loss = loss_backward(&model, cfg.vocab_size, (&ids, &tgt), None).unwrap();
    (values(&loss)[0], grads_by_fqn(&model))
}

#[test]
fn fused_projections_on_the_emulated_gpu_match_separate_ones() {
    // f32 rounding, relative to the value down to 1e-2 (gradients are small).
    let (got, want) = (on_device(FUSED), on_device(LlamaFusion::default()));
    assert_close_to("cuda f32", &got, &want, 1e-5, 1e-2);
}

/// On the device the fused step (q and k rotated by the q/k/v GEMM, SwiGLU on the whole
/// gate/up output) recomputes bit for bit: under full and selective checkpointing the loss
/// and every gradient equal the step without.
#[test]
fn fused_projections_on_the_emulated_gpu_recompute_bit_for_bit() {
    let want = on_device_with(FUSED, &AcPolicy::None);
    for policy in [AcPolicy::full(), AcPolicy::selective()] {
        let got = on_device_with(FUSED, &policy);
        assert_eq!(got.0.to_bits(), want.0.to_bits(), "{policy}: loss");
        for (name, w) in &want.1 {
            let g = &got.1[name];
            let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{policy}: gradient of {name} differs");
        }
    }
}

#[test]
fn linear_many_equals_separate_linears_and_checks_its_operands() {
    let mut rng = Rng::new(3);
    let mut t = |dims: &[usize]| {
        Tensor::randn(dims.to_vec(), DType::F64, &mut rng).unwrap().requires_grad_(true)
    };
    let (x, ws) = (t(&[2, 3, 5]), [t(&[4, 5]), t(&[2, 5]), t(&[3, 5])]);
    // sum(piece_i * c_i) with distinct c_i, so every piece's gradient differs.
    let run = |pieces: Vec<Tensor>| -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let mut loss = Tensor::zeros([], DType::F64, Device::Cpu).unwrap();
        for (i, p) in pieces.iter().enumerate() {
            let s = p.mul(p).unwrap().mul_scalar(i as f64 + 1.0).unwrap().sum_all().unwrap();
            loss = loss.add(&s).unwrap();
        }
        loss.backward().unwrap();
        let out = pieces.iter().map(values).collect();
        let grads = std::iter::once(&x).chain(&ws).map(|t| values(&t.grad().unwrap())).collect();
        x.zero_grad();
        ws.iter().for_each(Tensor::zero_grad);
        (out, grads)
    };
    let (got, got_g) = run(x.linear_many(&ws).unwrap());
    let (want, want_g) = run(ws.iter().map(|w| x.linear(w, None).unwrap()).collect());
    for (a, b) in got.iter().chain(&got_g).zip(want.iter().chain(&want_g)) {
        assert_eq!(a.len(), b.len());
        for (u, v) in a.iter().zip(b) {
            assert!((u - v).abs() <= 1e-12 * v.abs().max(1.0), "{u} vs {v}");
        }
    }
    // Weights of another width, or of another dtype: typed errors.
    let narrow = Tensor::zeros([2, 4], DType::F64, Device::Cpu).unwrap();
    assert!(x.linear_many(&[ws[0].clone(), narrow]).is_err());
    let f32w = Tensor::zeros([2, 5], DType::F32, Device::Cpu).unwrap();
    assert!(x.linear_many(&[ws[0].clone(), f32w]).is_err());
}
