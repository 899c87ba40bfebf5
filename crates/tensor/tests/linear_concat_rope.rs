//! `Tensor::linear_concat_rope` then `Tensor::attention_packed_rotated` (q and k rotated
//! where the projection writes them) against `Tensor::linear_concat` then
//! `Tensor::attention_packed` (rotated inside attention), bit for bit, forward and the
//! gradients of the input and every weight: on the host (f64, f32) and on the emulated
//! CUDA device (f32, bf16, f16; the GEMM then one RoPE launch in place there), with
//! grouped-query attention, a key-padding mask, a full additive mask, tables longer than
//! the sequence and more than one batch. On the device the pair runs 3 kernels fewer per
//! forward and backward (no q/k rotation into buffers of their own, no second rotation
//! in the backward, dq and dk written into the packed gradient). Bad inputs are typed
//! errors naming the problem.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Rng, Tensor};

/// The device of the bit checks.
const DEV: Device = Device::Cuda(6);
/// An ordinal of its own for the kernel counts, which only one test uses.
const COUNTED: usize = 7;

fn setup() {
    for ordinal in [6, COUNTED] {
        gpu::register_device(ordinal, EmulatedGpu::open(ordinal).expect("emulator"));
    }
}

mod common;
use common::{assert_same_bits, bits, fails_naming};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mask {
    /// Causal, no mask tensor.
    Causal,
    /// Causal with a `[b, 1, 1, s]` key-padding mask (the last key of batch 0 masked).
    CausalPadding,
    /// A full `[b, 1, s, s]` additive mask, not causal.
    Full,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    s: usize,
    hidden: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    table_rows: usize,
    mask: Mask,
}

const CASES: [Case; 4] = [
    Case { b: 2, s: 5, hidden: 24, hq: 4, hkv: 2, hd: 16, table_rows: 9, mask: Mask::Causal },
    Case { b: 2, s: 7, hidden: 16, hq: 2, hkv: 1, hd: 8, table_rows: 7, mask: Mask::CausalPadding },
    Case { b: 1, s: 3, hidden: 8, hq: 3, hkv: 3, hd: 6, table_rows: 3, mask: Mask::Full },
    Case { b: 1, s: 66, hidden: 32, hq: 2, hkv: 1, hd: 32, table_rows: 70, mask: Mask::Causal },
];

/// The host inputs of a case: x, the three weights, the tables, the mask and the
/// output's gradient.
struct Inputs {
    x: Tensor,
    w: [Tensor; 3],
    cos: Tensor,
    sin: Tensor,
    mask: Option<Tensor>,
    dout: Tensor,
}

fn inputs(c: &Case, dtype: DType, rng: &mut Rng) -> Inputs {
    let mut r = |dims: &[usize]| Tensor::randn(dims, dtype, rng).unwrap();
    let x = r(&[c.b, c.s, c.hidden]);
    let w = [c.hq, c.hkv, c.hkv].map(|h| r(&[h * c.hd, c.hidden]));
    let (cos, sin) = (r(&[c.table_rows, c.hd]), r(&[c.table_rows, c.hd]));
    let dout = r(&[c.b, c.s, c.hq * c.hd]);
    let mask = match c.mask {
        Mask::Causal => None,
        Mask::CausalPadding => {
            let mut m = vec![0.0; c.b * c.s];
            m[c.s - 1] = f64::NEG_INFINITY;
            Some(Tensor::from_vec(m, [c.b, 1, 1, c.s]).unwrap().to_dtype(dtype).unwrap())
        }
        Mask::Full => Some(r(&[c.b, 1, c.s, c.s])),
    };
    Inputs { x, w, cos, sin, mask, dout }
}

/// The attention output of x, the weights, the tables and the mask.
type Block = fn(&Case, &Tensor, &[Tensor], &Tensor, &Tensor, Option<&Tensor>) -> Tensor;

/// Rotated inside attention (what fused projections ran before).
fn unrotated(
    c: &Case,
    x: &Tensor,
    w: &[Tensor],
    cos: &Tensor,
    sin: &Tensor,
    m: Option<&Tensor>,
) -> Tensor {
    let qkv = x.linear_concat(w).unwrap();
    Tensor::attention_packed(&qkv, c.hq, c.hkv, cos, sin, m, c.mask != Mask::Full).unwrap()
}

/// Rotated by the projection.
fn rotated(
    c: &Case,
    x: &Tensor,
    w: &[Tensor],
    cos: &Tensor,
    sin: &Tensor,
    m: Option<&Tensor>,
) -> Tensor {
    let qkv = x.linear_concat_rope(w, 2, cos, sin).unwrap();
    Tensor::attention_packed_rotated(&qkv, c.hq, c.hkv, m, c.mask != Mask::Full).unwrap()
}

/// Output bits, the gradient bits of x and each weight, and the kernels the device ran
/// on [`COUNTED`] (forward and backward), of `f` on `device` (fresh leaves).
fn run(c: &Case, i: &Inputs, device: Device, f: Block) -> (Vec<u64>, Vec<Vec<u64>>, u64) {
    let kernels = || gpu::work_counts(COUNTED).map_or(0, |w| w.kernels_run);
    let on = |t: &Tensor| t.to_device(device).unwrap();
    let leaf = |t: &Tensor| on(t).detach().requires_grad_(true);
    let (x, w) = (leaf(&i.x), i.w.each_ref().map(leaf));
    let (cos, sin, dout) = (on(&i.cos), on(&i.sin), on(&i.dout));
    let mask = i.mask.as_ref().map(on);
    let before = kernels();
    let y = f(c, &x, &w, &cos, &sin, mask.as_ref());
    assert_eq!(y.device(), device, "{c:?}: output device");
    y.backward_with(&dout).unwrap();
    let ran = kernels() - before;
    let grads = [&x, &w[0], &w[1], &w[2]].map(|l| bits(&l.grad().expect("gradient")));
    (bits(&y), grads.to_vec(), ran)
}

/// The two forms give the same output and gradient bits on `device`. The one allowed difference is a zero's sign in x's
/// gradient on the device: there the unrotated form's packed gradient came from RoPE's
/// backward kernel writing into a zeroed buffer, and the rotated form's from the
/// attention kernels' dq and dk as they are (a signed zero where a query's only key
/// leaves dS exactly 0), then RoPE's backward; through the product with the weights such
/// a zero can only reach x's gradient as a zero.
fn check(device: Device, dtype: DType, seed: u64) {
    let mut rng = Rng::new(seed);
    for c in CASES {
        let i = inputs(&c, dtype, &mut rng);
        let what = format!("{dtype:?} on {device}: {c:?}");
        let (y0, g0, n0) = run(&c, &i, device, unrotated);
        let (y1, g1, n1) = run(&c, &i, device, rotated);
        assert!(y1 == y0, "{what}: output differs");
        for (n, (a, b)) in g1.iter().zip(&g0).enumerate() {
            assert_same_bits(&format!("{what}: gradient of input {n}"), a, b, true);
        }
        if device == Device::Cuda(COUNTED) {
            let (n0, n1) = (n0 as i64, n1 as i64);
            assert_eq!(
                n0 - n1,
                3,
                "{what}: kernels, rotated inside attention {n0}, by the projection {n1}"
            );
        }
    }
}

/// On the device the rotated form runs 3 kernels fewer per forward and backward: the
/// forward's 2 rotations of q and k into buffers of their own become the RoPE launch on
/// the product, and the backward's 2 rotations again and 2 rotations back become one
/// rotation back and one copy of the v columns.
#[test]
fn on_the_device_the_rotated_form_runs_3_kernels_fewer() {
    setup();
    check(Device::Cuda(COUNTED), DType::BF16, 8);
}

#[test]
fn host_equals_rotation_inside_attention() {
    check(Device::Cpu, DType::F64, 1);
    check(Device::Cpu, DType::F32, 2);
}

#[test]
fn device_equals_rotation_inside_attention_f32() {
    setup();
    check(DEV, DType::F32, 3);
}

#[test]
fn device_equals_rotation_inside_attention_bf16_and_f16() {
    setup();
    check(DEV, DType::BF16, 4);
    check(DEV, DType::F16, 5);
}

#[test]
fn f64_on_the_device_is_the_host_composition() {
    setup();
    check(DEV, DType::F64, 6);
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    let mut rng = Rng::new(7);
    let mut r = |dims: &[usize]| Tensor::randn(dims, DType::F32, &mut rng).unwrap();
    let (x, table) = (r(&[2, 5, 8]), r(&[5, 4]));
    let w = [r(&[8, 8]), r(&[4, 8]), r(&[4, 8])];
    let ok = x.linear_concat_rope(&w, 2, &table, &table).unwrap();
    assert_eq!(ok.dims(), [2, 5, 16]);
    let go = |x: &Tensor, w: &[Tensor], n: usize, c: &Tensor| x.linear_concat_rope(w, n, c, c);
    fails_naming("no weights", go(&x, &[], 0, &table), &["no weights"]);
    fails_naming("rank 1", go(&r(&[8]), &w, 2, &table), &["[..., seq, in]"]);
    fails_naming("3 of 2 rotated", go(&x, &w[..2], 3, &table), &["3 weights to rotate", "2 given"]);
    fails_naming("short tables", go(&x, &w, 2, &r(&[4, 4])), &["sequence length 5", "[4, 4]"]);
    fails_naming("odd head dim", go(&x, &w, 2, &r(&[5, 3])), &["even head_dim"]);
    let partial = [r(&[6, 8]), r(&[4, 8])];
    fails_naming("partial heads", go(&x, &partial, 1, &table), &["6 outputs", "heads of 4"]);
    fails_naming("input width", go(&x, &[r(&[8, 7])], 1, &table), &["linear_concat_rope"]);
    let f16 = table.to_dtype(DType::F16).unwrap();
    fails_naming("table dtype", go(&x, &w, 2, &f16), &["linear_concat_rope"]);
    // the attention side: a width that is not whole heads
    let qkv = r(&[2, 5, 18]);
    let e = Tensor::attention_packed_rotated(&qkv, 2, 1, None, true);
    fails_naming("packed width", e, &["attention_packed_rotated", "18", "q_heads + 2 kv_heads"]);
    let e = Tensor::attention_packed_rotated(&r(&[10, 16]), 2, 1, None, true);
    fails_naming("rank 2", e, &["attention_packed_rotated", "[batch, seq"]);
    let e = Tensor::attention_packed_rotated(&r(&[2, 5, 21]), 3, 2, None, true);
    fails_naming("heads", e, &["3 query heads", "2 kv heads"]);
}
