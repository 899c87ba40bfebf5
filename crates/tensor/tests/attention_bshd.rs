//! `Tensor::attention_bshd` and `Tensor::attention_packed` against the composition they
//! are defined as (split and view as heads, transpose then RoPE, attention, transpose
//! back), bit for bit, forward and every input's gradient: on the host (f64, f32) and on
//! the emulated CUDA device (f32, bf16, f16), with grouped-query attention, causal
//! attention with and without a key-padding mask, a full additive mask, odd lengths and
//! tables longer than the sequence; bad inputs are typed errors naming the problem.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Rng, RopeLayout, Tensor};

/// An ordinal of its own, so the kernel counts see only this file's work.
const ORDINAL: usize = 5;
const DEV: Device = Device::Cuda(ORDINAL);

fn setup() {
    gpu::register_device(ORDINAL, EmulatedGpu::open(ORDINAL).expect("emulator"));
}

mod common;
use common::{assert_same_bits, bits, fails_naming};

/// One case: sizes, masking, and whether the input is packed.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    /// Rows of the RoPE tables (at least `s`).
    table_rows: usize,
    mask: Mask,
    packed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mask {
    /// Causal, no mask tensor.
    Causal,
    /// Causal with a `[b, 1, 1, s]` key-padding mask (the last key of batch 0 masked).
    CausalPadding,
    /// A full `[b, 1, s, s]` additive mask, not causal.
    Full,
}

/// The inputs of a case on the host: q, k, v `[b, s, h, hd]` (or the packed
/// `[b, s, (hq + 2 hkv) * hd]` as one), the tables, the mask and the output's gradient.
struct Inputs {
    qkv: Vec<Tensor>,
    cos: Tensor,
    sin: Tensor,
    mask: Option<Tensor>,
    dout: Tensor,
}

fn inputs(c: &Case, dtype: DType, rng: &mut Rng) -> Inputs {
    let mut r = |dims: &[usize]| Tensor::randn(dims, dtype, rng).unwrap();
    let qkv = if c.packed {
        vec![r(&[c.b, c.s, (c.hq + 2 * c.hkv) * c.hd])]
    } else {
        vec![r(&[c.b, c.s, c.hq, c.hd]), r(&[c.b, c.s, c.hkv, c.hd]), r(&[c.b, c.s, c.hkv, c.hd])]
    };
    let (cos, sin) = (r(&[c.table_rows, c.hd]), r(&[c.table_rows, c.hd]));
    let dout = if c.packed { r(&[c.b, c.s, c.hq * c.hd]) } else { r(&[c.b, c.s, c.hq, c.hd]) };
    let mask = match c.mask {
        Mask::Causal => None,
        Mask::CausalPadding => {
            let mut m = vec![0.0; c.b * c.s];
            m[c.s - 1] = f64::NEG_INFINITY;
            Some(Tensor::from_vec(m, [c.b, 1, 1, c.s]).unwrap().to_dtype(dtype).unwrap())
        }
        Mask::Full => Some(r(&[c.b, 1, c.s, c.s])),
    };
    Inputs { qkv, cos, sin, mask, dout }
}

/// The composition the ops are defined as, written out: split and view as heads
/// (packed), q and k rotated and brought to `[b, h, s, hd]` (by the transpose then
/// `rope` or, `one_pass`, by `rope_bshd_to_bhsd`, as the model ran it), v transposed,
/// attention, the output transposed back.
fn composition(
    c: &Case,
    x: &[Tensor],
    cos: &Tensor,
    sin: &Tensor,
    mask: Option<&Tensor>,
    one_pass: bool,
) -> Tensor {
    let (cos, sin) = (cos.narrow(0, 0, c.s).unwrap(), sin.narrow(0, 0, c.s).unwrap());
    let parts = if c.packed {
        let w = [c.hq * c.hd, c.hkv * c.hd, c.hkv * c.hd];
        let p = x[0].split_sizes(&w, -1).unwrap();
        let heads = [c.hq, c.hkv, c.hkv];
        p.iter().zip(heads).map(|(t, h)| t.reshape([c.b, c.s, h, c.hd]).unwrap()).collect()
    } else {
        x.to_vec()
    };
    let rot = |t: &Tensor| match one_pass {
        true => t.rope_bshd_to_bhsd(&cos, &sin).unwrap(),
        false => t.transpose(1, 2).unwrap().rope(&cos, &sin, RopeLayout::Bhsd).unwrap(),
    };
    let (q, k, v) = (rot(&parts[0]), rot(&parts[1]), parts[2].transpose(1, 2).unwrap());
    let causal = c.mask != Mask::Full;
    let a = Tensor::scaled_dot_product_attention(&q, &k, &v, mask, causal, None).unwrap();
    let a = a.transpose(1, 2).unwrap();
    if c.packed {
        a.reshape([c.b, c.s, c.hq * c.hd]).unwrap()
    } else {
        a
    }
}

/// [`composition`] with the transpose then `rope`.
fn reference(c: &Case, x: &[Tensor], cos: &Tensor, sin: &Tensor, mask: Option<&Tensor>) -> Tensor {
    composition(c, x, cos, sin, mask, false)
}

/// What a Llama attention block ran before these ops (and still runs on distributed
/// operands): [`composition`] with the one-pass RoPE.
fn model_composition(
    c: &Case,
    x: &[Tensor],
    cos: &Tensor,
    sin: &Tensor,
    mask: Option<&Tensor>,
) -> Tensor {
    composition(c, x, cos, sin, mask, true)
}

/// The op under test.
fn op(c: &Case, x: &[Tensor], cos: &Tensor, sin: &Tensor, mask: Option<&Tensor>) -> Tensor {
    let causal = c.mask != Mask::Full;
    if c.packed {
        Tensor::attention_packed(&x[0], c.hq, c.hkv, cos, sin, mask, causal).unwrap()
    } else {
        Tensor::attention_bshd(&x[0], &x[1], &x[2], cos, sin, mask, causal).unwrap()
    }
}

type Attention = fn(&Case, &[Tensor], &Tensor, &Tensor, Option<&Tensor>) -> Tensor;

/// Output bits, each input's gradient bits, and the kernels the device ran, of `f` on
/// `device` (fresh leaves).
fn run(c: &Case, i: &Inputs, device: Device, f: Attention) -> (Vec<u64>, Vec<Vec<u64>>, u64) {
    let kernels = || gpu::work_counts(ORDINAL).map_or(0, |w| w.kernels_run);
    let on = |t: &Tensor| t.to_device(device).unwrap();
    let leaves: Vec<Tensor> = i.qkv.iter().map(|t| on(t).detach().requires_grad_(true)).collect();
    let (cos, sin, dout) = (on(&i.cos), on(&i.sin), on(&i.dout));
    let mask = i.mask.as_ref().map(on);
    let before = kernels();
    let y = f(c, &leaves, &cos, &sin, mask.as_ref());
    assert_eq!(y.device(), device, "{c:?}: output device");
    y.backward_with(&dout).unwrap();
    let ran = kernels() - before;
    let grads = leaves.iter().map(|l| bits(&l.grad().expect("gradient"))).collect();
    (bits(&y), grads, ran)
}

const CASES: [Case; 6] = [
    // GQA, odd length, causal
    Case { b: 2, s: 5, hq: 4, hkv: 2, hd: 16, table_rows: 5, mask: Mask::Causal, packed: false },
    Case { b: 2, s: 5, hq: 4, hkv: 2, hd: 16, table_rows: 9, mask: Mask::Causal, packed: true },
    // key padding on top of causal, tables longer than the sequence
    Case {
        b: 2,
        s: 7,
        hq: 2,
        hkv: 1,
        hd: 8,
        table_rows: 12,
        mask: Mask::CausalPadding,
        packed: false,
    },
    Case {
        b: 2,
        s: 7,
        hq: 2,
        hkv: 1,
        hd: 8,
        table_rows: 7,
        mask: Mask::CausalPadding,
        packed: true,
    },
    // a full additive mask, multi-head attention, head dim 6 (RoPE's element path)
    Case { b: 1, s: 3, hq: 3, hkv: 3, hd: 6, table_rows: 3, mask: Mask::Full, packed: false },
    Case { b: 1, s: 66, hq: 2, hkv: 1, hd: 32, table_rows: 66, mask: Mask::Full, packed: true },
];

/// The op and the composition on `device` give the same output bits and the same
/// gradient bits, but for one known difference: on the device, a packed input's
/// gradient may hold `-0.0` where the composition's has `+0.0`, in the q columns of a
/// query whose only key leaves dS exactly 0. The op writes the kernels' dq there as it
/// is (a signed zero); the composition's packed gradient is the sum of the three
/// zero-padded slice gradients (`narrow`'s adjoint), and `-0.0 + +0.0` is `+0.0`. With
/// separate inputs (no such sum) the bits agree. Such pairs are allowed, any other
/// difference fails.
fn check(device: Device, dtype: DType, seed: u64) {
    let mut rng = Rng::new(seed);
    for c in CASES {
        let i = inputs(&c, dtype, &mut rng);
        let what = format!("{dtype:?} on {device}: {c:?}");
        let (y0, g0, _) = run(&c, &i, device, reference);
        let (y1, g1, _) = run(&c, &i, device, op);
        assert!(y1 == y0, "{what}: output differs");
        let zero_sign = c.packed && device != Device::Cpu;
        for (n, (a, b)) in g1.iter().zip(&g0).enumerate() {
            assert_same_bits(&format!("{what}: gradient of input {n}"), a, b, zero_sign);
        }
    }
}

#[test]
fn host_equals_the_composition() {
    check(Device::Cpu, DType::F64, 1);
    check(Device::Cpu, DType::F32, 2);
}

#[test]
fn device_equals_the_composition_f32() {
    setup();
    check(DEV, DType::F32, 3);
}

#[test]
fn device_equals_the_composition_bf16() {
    setup();
    check(DEV, DType::BF16, 4);
}

#[test]
fn device_equals_the_composition_f16_and_f64() {
    setup();
    check(DEV, DType::F16, 5);
    // f64 has no device kernels: the composition through the host
    check(DEV, DType::F64, 6);
}

#[test]
fn bad_inputs_are_typed_errors() {
    setup();
    for device in [Device::Cpu, DEV] {
        let mut rng = Rng::new(7);
        let mut r = |dims: &[usize]| {
            Tensor::randn(dims, DType::F32, &mut rng).unwrap().to_device(device).unwrap()
        };
        let (q, k, v) = (r(&[1, 4, 4, 8]), r(&[1, 4, 2, 8]), r(&[1, 4, 2, 8]));
        let (cos, short) = (r(&[4, 8]), r(&[3, 8]));
        let qkv = r(&[1, 4, 64]); // (4 + 2 * 2) * 8
        let (k3, v6) = (r(&[1, 4, 3, 8]), r(&[1, 4, 2, 6]));
        let (q3d, q7) = (r(&[4, 4, 8]), r(&[1, 4, 4, 7]));
        let (tab7, f64q) = (r(&[4, 7]), q.to_dtype(DType::F64).unwrap());
        let a = |q: &Tensor, k: &Tensor, v: &Tensor, c: &Tensor| {
            Tensor::attention_bshd(q, k, v, c, c, None, true)
        };
        let p = |x: &Tensor, hq: usize, hkv: usize, c: &Tensor| {
            Tensor::attention_packed(x, hq, hkv, c, c, None, true)
        };
        let on = format!("on {device}");
        fails_naming(&format!("3-d q {on}"), a(&q3d, &k, &v, &cos), &["q must be", "[4, 4, 8]"]);
        fails_naming(&format!("v head dim {on}"), a(&q, &k, &v6, &cos), &["v is [1, 4, 2, 6]"]);
        fails_naming(
            &format!("3 kv heads {on}"),
            a(&q, &k3, &k3, &cos),
            &["4 query heads", "3 kv"],
        );
        fails_naming(&format!("short tables {on}"), a(&q, &k, &v, &short), &["[3, 8]", "length 4"]);
        fails_naming(&format!("odd head dim {on}"), a(&q7, &q7, &q7, &tab7), &["head_dim 7"]);
        fails_naming(&format!("dtypes {on}"), a(&f64q, &k, &v, &cos), &["attention_bshd"]);
        fails_naming(&format!("rank-4 packed {on}"), p(&q, 4, 2, &cos), &["qkv must be"]);
        fails_naming(&format!("width {on}"), p(&qkv, 4, 1, &cos), &["width 64", "4 + 2 * 1"]);
        fails_naming(&format!("no heads {on}"), p(&qkv, 0, 0, &cos), &["width 64"]);
        fails_naming(&format!("short tables packed {on}"), p(&qkv, 4, 2, &short), &["[3, 8]"]);
        let mask = r(&[1, 1, 3, 4]);
        fails_naming(
            &format!("mask {on}"),
            Tensor::attention_bshd(&q, &k, &v, &cos, &cos, Some(&mask), false),
            &["attention_bshd", "[1, 1, 3, 4]"],
        );
        assert_eq!(a(&q, &k, &v, &cos).unwrap().dims(), [1, 4, 4, 8]);
        assert_eq!(p(&qkv, 4, 2, &cos).unwrap().dims(), [1, 4, 32]);
    }
}

/// `linear_concat` (the packed projection `attention_packed` reads) against
/// `linear_many`'s pieces side by side: the same output bit for bit (one GEMM, whose
/// columns each piece is), and the gradients (one GEMM each over every output column,
/// where `linear_many` runs one per piece) within rounding; bad weights are errors.
#[test]
fn linear_concat_is_linear_many_side_by_side() {
    setup();
    for (device, dtype, tol) in [(Device::Cpu, DType::F64, 1e-12), (DEV, DType::F32, 1e-5)] {
        let mut rng = Rng::new(8);
        let mut r = |dims: &[usize]| Tensor::randn(dims, dtype, &mut rng).unwrap();
        let (x, g) = (r(&[2, 3, 12]), r(&[2, 3, 20]));
        let ws = [r(&[8, 12]), r(&[4, 12]), r(&[8, 12])];
        let leaves = |ts: &[&Tensor]| -> Vec<Tensor> {
            ts.iter().map(|t| t.to_device(device).unwrap().detach().requires_grad_(true)).collect()
        };
        let g = g.to_device(device).unwrap();
        let run = |concat: bool| {
            let l = leaves(&[&x, &ws[0], &ws[1], &ws[2]]);
            let y = if concat {
                l[0].linear_concat(&l[1..]).unwrap()
            } else {
                Tensor::cat(&l[0].linear_many(&l[1..]).unwrap(), -1).unwrap()
            };
            y.backward_with(&g).unwrap();
            let grads: Vec<Tensor> = l.iter().map(|t| t.grad().unwrap()).collect();
            (y, grads)
        };
        let ((y1, g1), (y0, g0)) = (run(true), run(false));
        let what = format!("{dtype:?} on {device}");
        assert_eq!(y1.dims(), [2, 3, 20], "{what}");
        assert!(bits(&y1) == bits(&y0), "{what}: output");
        for (i, (g1, g0)) in g1.iter().zip(&g0).enumerate() {
            let (a, b) = (g1.to_vec_f64().unwrap(), g0.to_vec_f64().unwrap());
            for (j, (a, b)) in a.iter().zip(&b).enumerate() {
                let near = (a - b).abs() <= tol * b.abs().max(1.0);
                assert!(near, "{what}: gradient {j} of input {i}: {a} vs {b}");
            }
        }
    }
    let mut rng = Rng::new(9);
    let mut r = |dims: &[usize]| Tensor::randn(dims, DType::F32, &mut rng).unwrap();
    let x = r(&[2, 12]);
    let err = x.linear_concat(&[]).unwrap_err().to_string();
    assert!(err.contains("linear_concat") && err.contains("no weights"), "{err}");
    let err = x.linear_concat(&[r(&[4, 12]), r(&[4, 11])]).unwrap_err().to_string();
    assert!(err.contains("[4, 11]") && err.contains("in_features"), "{err}");
    let f64_weight = r(&[4, 12]).to_dtype(DType::F64).unwrap();
    let err = x.linear_concat(&[r(&[4, 12]), f64_weight]).unwrap_err().to_string();
    assert!(err.contains("linear_concat") && err.contains("weight f64"), "{err}");
}

/// The device node runs no transposes, splits or concatenations: with the flash
/// kernels taking strided operands, separate q, k, v cost 4 kernels fewer than the
/// model's former composition (the transposes of v and the output, forward and
/// backward), and a packed input 2 more than separate ones (q and k rotated again in the
/// backward) but none of the split's and concatenation's kernels and copies.
#[test]
fn the_device_node_runs_no_transposes() {
    // a device of its own: the other tests run on theirs meanwhile
    const ORD: usize = ORDINAL + 1;
    gpu::register_device(ORD, EmulatedGpu::open(ORD).expect("emulator"));
    // (kernels, copies) of one forward and backward, after the kernel probe ran
    let work = |c: &Case, f: Attention| {
        let i = inputs(c, DType::F32, &mut Rng::new(3));
        run(c, &i, Device::Cuda(ORD), op);
        let w = || gpu::work_counts(ORD).unwrap();
        let before = w();
        run(c, &i, Device::Cuda(ORD), f);
        let d = w() - before;
        (d.kernels_run, d.copies_run)
    };
    let (separate, packed) = (CASES[0], CASES[1]);
    let (sep_op, sep_model) = (work(&separate, op), work(&separate, model_composition));
    assert_eq!(sep_op, (sep_model.0 - 4, sep_model.1), "separate: (kernels, copies)");
    let (pk_op, pk_model) = (work(&packed, op), work(&packed, model_composition));
    assert_eq!(pk_op.0, sep_op.0 + 2, "packed: kernels");
    // the uploads of one packed input instead of three, the download of one gradient
    assert!(pk_op.1 < sep_op.1, "packed: copies {pk_op:?} vs separate {sep_op:?}");
    assert!(pk_model.0 > sep_model.0 && pk_model.1 >= sep_model.1, "{pk_model:?}");
}
