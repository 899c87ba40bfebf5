//! The residual add in the GEMM ([`Tensor::linear_add`], [`LlamaFusion::residual`]): on
//! the host `x W^T + r` is the product then the add, bit for bit, and so is a Llama step
//! with the fusion (with and without fused projections, and with activation
//! checkpointing); on the emulated CUDA device the one-GEMM form matches the two ops
//! within the dtype's rounding (f32 and bf16), forward and backward, and a Llama step
//! with the fusion matches the unfused step in f32.

use std::collections::BTreeMap;
use std::sync::Once;

use tpar::models::LlamaFusion;
use tpar::prelude::*;
use tpar::tensor::gpu::{self, EmulatedGpu};

mod common;
use common::llama_pipeline::{batch, loss_fn};

type Grads = BTreeMap<String, Vec<f64>>;

const RESIDUAL: LlamaFusion = LlamaFusion { projections: false, residual: true };
const BOTH: LlamaFusion = LlamaFusion { projections: true, residual: true };
const PROJECTIONS: LlamaFusion = LlamaFusion { projections: true, residual: false };

fn values(t: &Tensor) -> Vec<f64> {
    t.to_device(Device::Cpu).unwrap().to_dtype(DType::F64).unwrap().to_vec_f64().unwrap()
}

/// Makes `cuda:0` an emulated device, once for this binary's tests.
fn emulated_device() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| gpu::register_device(0, EmulatedGpu::open(0).expect("emulator")));
}

/// `x` `[2, 3, 5]`, `w` `[7, 5]`, `r` `[2, 3, 7]` of `dtype` on `device`, requiring grads.
fn operands(dtype: DType, device: Device) -> [Tensor; 3] {
    let mut rng = Rng::new(17);
    let mut t = |dims: &[usize]| {
        Tensor::randn(dims.to_vec(), DType::F64, &mut rng)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_device(device)
            .unwrap()
            .requires_grad_(true)
    };
    [t(&[2, 3, 5]), t(&[7, 5]), t(&[2, 3, 7])]
}

/// Output and the gradients of x, w and r of `sum(out * out)` through `f`.
fn run(
    ops: &[Tensor; 3],
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> (Vec<f64>, [Vec<f64>; 3]) {
    let out = f(&ops[0], &ops[1], &ops[2]);
    out.mul(&out).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |t: &Tensor| values(&t.grad().expect("a gradient"));
    let grads = [g(&ops[0]), g(&ops[1]), g(&ops[2])];
    for t in ops {
        t.zero_grad();
    }
    (values(&out), grads)
}

fn fused(x: &Tensor, w: &Tensor, r: &Tensor) -> Tensor {
    x.linear_add(w, r).unwrap()
}

fn apart(x: &Tensor, w: &Tensor, r: &Tensor) -> Tensor {
    r.add(&x.linear(w, None).unwrap()).unwrap()
}

/// `got` within `tol` of `want`, relative to the larger of `floor` and the value.
fn assert_near_to(what: &str, got: &[f64], want: &[f64], tol: f64, floor: f64) {
    assert_eq!(got.len(), want.len(), "{what}: size");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= tol * b.abs().max(floor), "{what}[{i}]: {a} vs {b}");
    }
}

fn assert_near(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_near_to(what, got, want, tol, 1.0);
}

#[test]
fn linear_add_on_the_host_is_the_product_then_the_add_bit_for_bit() {
    let ops = operands(DType::F64, Device::Cpu);
    assert_eq!(run(&ops, fused), run(&ops, apart));
    // A residual of another shape, or a weight that does not fit: typed errors.
    let short = Tensor::zeros([2, 3, 6], DType::F64, Device::Cpu).unwrap();
    let e = ops[0].linear_add(&ops[1], &short).unwrap_err().to_string();
    assert!(e.contains("residual"), "{e}");
    let e = ops[0].linear_add(&ops[2], &ops[2]).unwrap_err().to_string();
    assert!(e.contains("weight"), "{e}");
}

#[test]
fn linear_add_on_the_emulated_gpu_matches_the_two_ops() {
    emulated_device();
    // The reference: the two ops in f64 on the host from the same (rounded) values.
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let ops = operands(dtype, Device::Cuda(0));
        let host: [Tensor; 3] = std::array::from_fn(|i| {
            ops[i].detach().to_device(Device::Cpu).unwrap().to_dtype(DType::F64).unwrap()
        });
        let host = host.map(|t| t.requires_grad_(true));
        let (out, grads) = run(&ops, fused);
        let (want, want_grads) = run(&host, apart);
        assert_near(&format!("{dtype} output"), &out, &want, tol);
        for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
            // sum(out^2)'s gradients are 2 out-scaled: bf16 rounding of out shows there.
            assert_near(&format!("{dtype} gradient {i}"), g, w, 4.0 * tol);
        }
    }
}

/// Loss and gradients of one step of a 2-layer Llama with `fusion` and `policy` on
/// `device` in `dtype`.
fn step(fusion: LlamaFusion, policy: &AcPolicy, dtype: DType, device: Device) -> (f64, Grads) {
    let cfg = tpar_testing::tiny_llama_config(40, 16, 2, dtype);
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, device, 11).unwrap();
    apply_activation_checkpointing(&mut model, policy).unwrap();
    model.set_fusion(fusion);
    let (ids, tgt) = batch(2, 9, cfg.vocab_size);
    let (ids, tgt) = (ids.to_device(device).unwrap(), tgt.to_device(device).unwrap());
    let logits = model.logits(&ids, None).unwrap();
    let loss = loss_fn(cfg.vocab_size)(&logits, &tgt).unwrap().into_tensor("loss").unwrap();
    loss.backward().unwrap();
    let grads = named_parameters(&model)
        .into_iter()
        .map(|(n, p)| {
            let g = p.local().grad().unwrap_or_else(|| panic!("{n} has no gradient"));
            (n, values(&g))
        })
        .collect();
    (values(&loss)[0], grads)
}

fn bits(r: (f64, Grads)) -> (u64, BTreeMap<String, Vec<u64>>) {
    let g = r.1.into_iter().map(|(n, v)| (n, v.into_iter().map(f64::to_bits).collect()));
    (r.0.to_bits(), g.collect())
}

#[test]
fn a_host_step_with_the_residual_fused_is_the_unfused_step_bit_for_bit() {
    let cpu = |f, p: &AcPolicy| bits(step(f, p, DType::F64, Device::Cpu));
    for policy in [AcPolicy::None, AcPolicy::full(), AcPolicy::selective()] {
        let plain = cpu(LlamaFusion::default(), &policy);
        assert!(cpu(RESIDUAL, &policy) == plain, "{policy}: residual fused");
        assert!(cpu(BOTH, &policy) == cpu(PROJECTIONS, &policy), "{policy}: with projections");
    }
}

#[test]
fn a_step_with_the_residual_fused_on_the_emulated_gpu_matches_the_unfused_step() {
    emulated_device();
    let dev = Device::Cuda(0);
    let want = step(LlamaFusion::default(), &AcPolicy::None, DType::F32, dev);
    for fusion in [RESIDUAL, BOTH] {
        let got = step(fusion, &AcPolicy::None, DType::F32, dev);
        assert_near(&format!("{fusion:?} loss"), &[got.0], &[want.0], 1e-5);
        for (name, w) in &want.1 {
            // f32 rounding, relative to the value down to 1e-2 (gradients are small).
            assert_near_to(&format!("{fusion:?} {name}"), &got.1[name], w, 2e-5, 1e-2);
        }
    }
}
