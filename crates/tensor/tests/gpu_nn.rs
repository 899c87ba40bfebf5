//! The fused NN ops and matrix products on the emulated CUDA device: each
//! against the same computation on the CPU, forward and gradients, with no
//! host round trip between the inputs' upload and the gradients' return.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Result, Rng, RopeLayout, Tensor};

const DEV: Device = Device::Cuda(0);

fn setup() {
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
}

/// Relative tolerance of a dtype (against the largest magnitude compared).
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 4e-3,
        _ => 2.5e-2,
    }
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (a, b) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let scale = b.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale || (x.is_nan() && y.is_nan()),
            "{what}: element {i}: device {x} vs host {y} (scale {scale})"
        );
    }
}

/// Runs `f` on the CPU leaves and on device copies of them, seeds both
/// backward passes with the same output gradient, and compares outputs and
/// the leaves' gradients. The device run (upload, forward, backward) must not
/// add a host round trip.
fn compare(what: &str, leaves: &[Tensor], tol: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let y = f(leaves).unwrap();
    let mut rng = Rng::new(99);
    let gy = Tensor::randn(y.shape().clone(), y.dtype(), &mut rng).unwrap();
    let trains = leaves.iter().any(|t| t.requires_grad());
    if trains {
        y.backward_with(&gy).unwrap();
    }
    let want: Vec<Option<Tensor>> = leaves.iter().map(|t| t.grad()).collect();
    leaves.iter().for_each(|t| t.zero_grad());

    let gyd = gy.to_device(DEV).unwrap();
    let before = gpu::host_round_trips();
    let dev: Vec<Tensor> = leaves.iter().map(|t| t.to_device(DEV).unwrap()).collect();
    let yd = f(&dev).unwrap();
    assert_eq!(yd.device(), DEV, "{what}: output device");
    if trains {
        yd.backward_with(&gyd).unwrap();
    }
    assert_eq!(gpu::host_round_trips(), before, "{what}: must stay on the device");
    assert_close(&format!("{what} output"), &yd, &y, tol);
    for (i, (leaf, w)) in leaves.iter().zip(want).enumerate() {
        match (leaf.grad(), w) {
            (Some(g), Some(w)) => assert_close(&format!("{what} grad {i}"), &g, &w, tol),
            (None, None) => {}
            (g, w) => panic!("{what} grad {i}: device {:?} vs host {:?}", g.is_some(), w.is_some()),
        }
        leaf.zero_grad();
    }
}

fn randn(dims: &[usize], dtype: DType, rng: &mut Rng, grad: bool) -> Tensor {
    Tensor::randn(dims, dtype, rng).unwrap().requires_grad_(grad)
}

#[test]
fn rope_runs_on_the_device() {
    setup();
    let mut rng = Rng::new(1);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (layout, dims) in [(RopeLayout::Bhsd, [2, 3, 5, 8]), (RopeLayout::Bshd, [2, 5, 3, 8])] {
            let x = randn(&dims, dtype, &mut rng, true);
            let cos = randn(&[5, 8], dtype, &mut rng, false);
            let sin = randn(&[5, 8], dtype, &mut rng, false);
            compare(&format!("rope {dtype:?} {layout:?}"), &[x, cos, sin], tol(dtype), |t| {
                t[0].rope(&t[1], &t[2], layout)
            });
        }
    }
}

#[test]
fn cross_entropy_runs_on_the_device() {
    setup();
    let mut rng = Rng::new(2);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // a short vocab (one warp per row) and a long one (one block per row)
        for vocab in [11usize, 600] {
            let logits = randn(&[2, 3, vocab], dtype, &mut rng, true);
            let t: Vec<i64> = vec![0, -100, (vocab - 1) as i64, 4, -100, 7];
            let targets = Tensor::from_vec(t, [2, 3]).unwrap();
            compare(
                &format!("cross_entropy {dtype:?} vocab {vocab}"),
                &[logits, targets],
                tol(dtype),
                |t| t[0].cross_entropy(&t[1], -100),
            );
        }
    }
    // every target ignored: loss 0 and a zero gradient
    let logits = randn(&[3, 5], DType::F32, &mut rng, true);
    let targets = Tensor::from_vec(vec![-1i64; 3], [3]).unwrap();
    compare("cross_entropy all ignored", &[logits.clone(), targets.clone()], 0.0, |t| {
        t[0].cross_entropy(&t[1], -1)
    });
    let ld = logits.to_device(DEV).unwrap();
    let loss = ld.cross_entropy(&targets.to_device(DEV).unwrap(), -1).unwrap();
    assert_eq!(loss.item().unwrap(), 0.0);
}

#[test]
fn cross_entropy_reports_bad_targets_as_the_cpu_does() {
    setup();
    let mut rng = Rng::new(3);
    let logits = randn(&[4, 6], DType::BF16, &mut rng, false);
    let targets = Tensor::from_vec(vec![1i64, 2, 6, -5], [4]).unwrap();
    let want = logits.cross_entropy(&targets, -100).unwrap_err().to_string();
    let got = logits
        .to_device(DEV)
        .unwrap()
        .cross_entropy(&targets.to_device(DEV).unwrap(), -100)
        .unwrap_err()
        .to_string();
    assert_eq!(got, want);
    assert!(got.contains("index 6 at position 2"), "{got}");
}

/// The vocab-parallel pieces (`ce_shard_stats`, `ce_rescale`, `ce_lse`,
/// `ce_loss_sums`, `ce_shard_backward`) composed over two vocab shards, with the
/// all_reduces written as device ops, give the unsharded loss and gradient of the CPU,
/// with no host round trip.
#[test]
fn vocab_parallel_cross_entropy_pieces_run_on_the_device() {
    setup();
    let mut rng = Rng::new(6);
    let (rows, vocab, half) = (6usize, 14usize, 7usize);
    let logits = randn(&[rows, vocab], DType::F32, &mut rng, true);
    let targets = Tensor::from_vec(vec![0i64, -100, 13, 6, 7, -100], [rows]).unwrap();
    let loss = logits.cross_entropy(&targets, -100).unwrap();
    loss.backward().unwrap();
    let want_grad = logits.grad().unwrap();

    let before = gpu::host_round_trips();
    let ld = logits.detach().to_device(DEV).unwrap();
    let td = targets.to_device(DEV).unwrap();
    let shards = [ld.narrow(1, 0, half).unwrap(), ld.narrow(1, half, half).unwrap()];
    let stats: Vec<_> = shards
        .iter()
        .enumerate()
        .map(|(k, s)| s.ce_shard_stats(&td, (k * half) as i64, vocab, -100).unwrap())
        .collect();
    let gmax = stats[0].0.maximum(&stats[1].0).unwrap();
    let rescaled: Vec<Tensor> =
        stats.iter().map(|(m, s, _)| Tensor::ce_rescale(m, s, &gmax).unwrap()).collect();
    let sumexp = rescaled[0].add(&rescaled[1]).unwrap();
    let tl = stats[0].2.add(&stats[1].2).unwrap();
    let lse = Tensor::ce_lse(&gmax, &sumexp).unwrap();
    let sums = Tensor::ce_loss_sums(&lse, &tl, &td, -100).unwrap();
    let count = sums.narrow(0, 1, 1).unwrap();
    let got_loss = sums.narrow(0, 0, 1).unwrap().div(&count).unwrap();
    let scale = count.recip().unwrap();
    let grads: Vec<Tensor> = shards
        .iter()
        .enumerate()
        .map(|(k, s)| s.ce_shard_backward(&td, (k * half) as i64, -100, &lse, &scale).unwrap())
        .collect();
    let got_grad = Tensor::cat(&grads, 1).unwrap();
    assert_eq!(gpu::host_round_trips(), before, "must stay on the device");
    assert_close("sharded loss", &got_loss.reshape(Vec::<usize>::new()).unwrap(), &loss, 2e-6);
    assert_close("sharded gradient", &got_grad, &want_grad, 2e-6);

    // A bad target is an error naming it, as the plain op's.
    let bad = Tensor::from_vec(vec![1i64, 2, 14, 0, 0, 0], [rows]).unwrap();
    let err = shards[0].ce_shard_stats(&bad.to_device(DEV).unwrap(), 0, vocab, -100).unwrap_err();
    assert!(err.to_string().contains("index 14 at position 2"), "{err}");
}

/// The global range check of a vocab-sharded lookup runs on the device (a status read,
/// no round trip) and finds the first bad id as the host scan does.
#[test]
fn index_range_check_runs_on_the_device() {
    setup();
    for (ids, want) in [
        (vec![3i64, 0, 9, 3], None),
        (vec![3i64, 10, 9, -1], Some((1usize, 10i64))),
        (vec![3i64, 2, -4], Some((2, -4))),
    ] {
        let n = ids.len();
        let host = Tensor::from_vec(ids, [n]).unwrap();
        assert_eq!(host.first_index_out_of_range(10).unwrap(), want);
        let dev = host.to_device(DEV).unwrap();
        let before = gpu::host_round_trips();
        assert_eq!(dev.first_index_out_of_range(10).unwrap(), want);
        assert_eq!(gpu::host_round_trips(), before, "must stay on the device");
    }
}

#[test]
fn embedding_runs_on_the_device() {
    setup();
    let mut rng = Rng::new(4);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let w = randn(&[10, 12], dtype, &mut rng, true);
        // repeated ids exercise the scatter-add
        let ids = Tensor::from_vec(vec![3i64, 0, 9, 3, 3, 7, 0, 1], [2, 4]).unwrap();
        compare(&format!("embedding {dtype:?}"), &[ids, w], tol(dtype), |t| {
            Tensor::embedding(&t[0], &t[1])
        });
        // a vocab shard of rows 4..8: other ids give zero rows and no gradient
        let shard = randn(&[4, 12], dtype, &mut rng, true);
        let ids = Tensor::from_vec(vec![3i64, 4, 9, 5, 5, 7, 0, 8, 4], [9]).unwrap();
        compare(&format!("embedding masked {dtype:?}"), &[ids, shard], tol(dtype), |t| {
            Tensor::embedding_masked(&t[0], &t[1], 4, true)
        });
    }
}

/// The device's embedding gradient is the host's, bit for bit: each table row sums its
/// positions in position order (the CSR sorted on the device), over several of the sort's
/// tiles of 2048 positions and two radix passes (259 rows), with no host round trip.
#[test]
fn embedding_gradient_equals_the_host_bit_for_bit() {
    setup();
    let mut rng = Rng::new(7);
    let mut state = 12345u64;
    // Skewed ids, as text's bytes are: a third of them row 32.
    let ids: Vec<i64> = (0..5000)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let r = (state >> 33) % 259;
            if r.is_multiple_of(3) {
                32
            } else {
                r as i64
            }
        })
        .collect();
    let ids = Tensor::from_vec(ids, [2, 2500]).unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let w = randn(&[259, 24], dtype, &mut rng, true);
        compare(&format!("embedding 259 rows {dtype:?}"), &[ids.clone(), w], 0.0, |t| {
            Tensor::embedding(&t[0], &t[1])
        });
    }
}

#[test]
fn embedding_reports_bad_ids_as_the_cpu_does() {
    setup();
    let mut rng = Rng::new(5);
    let w = randn(&[5, 4], DType::F32, &mut rng, false);
    let ids = Tensor::from_vec(vec![1i64, 4, 5, 2, -1], [5]).unwrap();
    let want = Tensor::embedding(&ids, &w).unwrap_err().to_string();
    let got = Tensor::embedding(&ids.to_device(DEV).unwrap(), &w.to_device(DEV).unwrap())
        .unwrap_err()
        .to_string();
    assert_eq!(got, want);
    assert!(got.contains("index 5 at position 2"), "{got}");
}

#[test]
fn attention_runs_on_the_device() {
    setup();
    let mut rng = Rng::new(6);
    // f32 runs the SIMT kernels, bf16 with head dim 16 the tensor-core ones
    for (dtype, d) in [(DType::F32, 8), (DType::BF16, 16), (DType::F16, 12)] {
        let (b, hq, hkv, sq, sk) = (1, 4, 2, 5, 7);
        let q = randn(&[b, hq, sq, d], dtype, &mut rng, true);
        let k = randn(&[b, hkv, sk, d], dtype, &mut rng, true);
        let v = randn(&[b, hkv, sk, d], dtype, &mut rng, true);
        let neg = f64::NEG_INFINITY;
        let pad = Tensor::from_f64(&[0.0, 0.0, 0.0, 0.0, 0.0, neg, neg], [sk], dtype).unwrap();
        let rows = Tensor::from_f64(&[0.0, -1.0, 0.5, 0.0, neg], [sq, 1], dtype).unwrap();
        let full = Tensor::randn([b, hq, sq, sk], dtype, &mut rng).unwrap();
        let masks: [(&str, Option<Tensor>); 4] = [
            ("none", None),
            ("key padding", Some(pad)),
            ("per row", Some(rows)),
            ("full", Some(full)),
        ];
        for (name, mask) in masks {
            for causal in [false, true] {
                let mut leaves = vec![q.clone(), k.clone(), v.clone()];
                leaves.extend(mask.clone());
                compare(
                    &format!("sdpa {dtype:?} mask {name} causal {causal}"),
                    &leaves,
                    tol(dtype),
                    |t| {
                        Tensor::scaled_dot_product_attention(
                            &t[0],
                            &t[1],
                            &t[2],
                            t.get(3),
                            causal,
                            None,
                        )
                    },
                );
            }
        }
    }
}

#[test]
fn matmul_runs_on_the_device() {
    setup();
    let mut rng = Rng::new(7);
    // (name, a as stored, b as stored, ta, tb)
    type Case = (&'static str, &'static [usize], &'static [usize], bool, bool);
    let cases: [Case; 11] = [
        ("plain", &[3, 4], &[4, 5], false, false),
        ("nt", &[3, 4], &[5, 4], false, true),
        ("tn", &[4, 3], &[4, 5], true, false),
        ("tt", &[4, 3], &[5, 4], true, true),
        ("batched", &[2, 3, 4], &[2, 4, 5], false, false),
        ("batched tt", &[2, 4, 3], &[2, 5, 4], true, true),
        ("folded rows", &[2, 3, 4], &[4, 5], false, false),
        ("folded rows nt", &[2, 2, 3, 4], &[5, 4], false, true),
        ("shared lhs", &[3, 4], &[2, 4, 5], false, false),
        ("transposed lhs, shared rhs", &[2, 4, 3], &[4, 5], true, false),
        ("broadcast both", &[2, 1, 3, 4], &[1, 3, 5, 4], false, true),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (name, ad, bd, ta, tb) in cases {
            let a = randn(ad, dtype, &mut rng, true);
            let b = randn(bd, dtype, &mut rng, true);
            compare(&format!("matmul {name} {dtype:?}"), &[a, b], tol(dtype), |t| {
                t[0].matmul_t(&t[1], ta, tb)
            });
        }
        // linear: [batch, seq, in] x [out, in]^T, one leaf without a gradient
        let x = randn(&[2, 3, 8], dtype, &mut rng, false);
        let w = randn(&[6, 8], dtype, &mut rng, true);
        compare(&format!("linear {dtype:?}"), &[x, w], tol(dtype), |t| t[0].linear(&t[1], None));
    }
}

#[test]
fn matmul_edge_sizes_on_the_device() {
    setup();
    let mut rng = Rng::new(8);
    // an empty contraction gives zeros; empty outputs give empty gradients
    for (ad, bd) in
        [(&[3usize, 0][..], &[0usize, 4][..]), (&[0, 5], &[5, 2]), (&[2, 0, 3], &[3, 4])]
    {
        let a = randn(ad, DType::F32, &mut rng, true);
        let b = randn(bd, DType::F32, &mut rng, true);
        compare(&format!("matmul {ad:?} x {bd:?}"), &[a, b], 0.0, |t| t[0].matmul(&t[1]));
    }
    // shapes that do not fit are the CPU op's errors
    let a = Tensor::zeros([2, 3], DType::F32, DEV).unwrap();
    let b = Tensor::zeros([4, 5], DType::F32, DEV).unwrap();
    let want = Tensor::zeros([2, 3], DType::F32, Device::Cpu)
        .unwrap()
        .matmul(&Tensor::zeros([4, 5], DType::F32, Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert_eq!(a.matmul(&b).unwrap_err().to_string(), want);
    let c = Tensor::zeros([3, 4, 5], DType::F32, DEV).unwrap();
    assert!(Tensor::zeros([2, 2, 3], DType::F32, DEV).unwrap().matmul(&c).is_err());
}

#[test]
fn f64_falls_back_through_the_host() {
    setup();
    let mut rng = Rng::new(9);
    let a = randn(&[3, 4], DType::F64, &mut rng, false);
    let b = randn(&[4, 2], DType::F64, &mut rng, false);
    let targets = Tensor::from_vec(vec![1i64, 0, -100], [3]).unwrap();
    let cos = randn(&[3, 4], DType::F64, &mut rng, false);
    let sin = randn(&[3, 4], DType::F64, &mut rng, false);
    let x = a.reshape([1, 1, 3, 4]).unwrap();
    let host = [
        a.matmul(&b).unwrap(),
        a.cross_entropy(&targets, -100).unwrap(),
        x.rope(&cos, &sin, RopeLayout::Bhsd).unwrap(),
    ];
    let d = |t: &Tensor| t.to_device(DEV).unwrap();
    let before = gpu::host_round_trips();
    let dev = [
        d(&a).matmul(&d(&b)).unwrap(),
        d(&a).cross_entropy(&d(&targets), -100).unwrap(),
        d(&x).rope(&d(&cos), &d(&sin), RopeLayout::Bhsd).unwrap(),
    ];
    assert_eq!(gpu::host_round_trips(), before + 3, "one host round trip per f64 op");
    for (g, w) in dev.iter().zip(&host) {
        assert_eq!(g.device(), DEV);
        assert_close("f64", g, w, 1e-12);
    }
}

/// A selective activation checkpoint keeps the device's matmul and attention outputs:
/// the recompute takes them back instead of launching those kernels again (counted),
/// and the gradients equal the region's without checkpointing, bit for bit.
#[test]
fn selective_checkpoints_keep_device_matmul_and_attention_outputs() {
    use tpar_tensor::checkpoint::{checkpoint, recompute_counts, reset_recompute_counts, SaveOp};
    setup();
    let mut rng = Rng::new(12);
    let (b, h, s, d) = (1, 2, 6, 8);
    let x = randn(&[b, s, h * d], DType::F32, &mut rng, false).to_device(DEV).unwrap();
    let ws: Vec<Tensor> = (0..3)
        .map(|_| randn(&[h * d, h * d], DType::F32, &mut rng, true).to_device(DEV).unwrap())
        .map(|w| w.detach().requires_grad_(true))
        .collect();
    let block = move |i: &[Tensor]| -> Result<Tensor> {
        let heads = |t: Tensor| t.reshape([b, s, h, d]);
        let q = heads(i[0].matmul(&i[1])?.silu()?)?.transpose(1, 2)?;
        let k = heads(i[0].matmul(&i[2])?)?.transpose(1, 2)?;
        let v = heads(i[0].matmul(&i[3])?)?.transpose(1, 2)?;
        let o = Tensor::scaled_dot_product_attention(&q, &k, &v, None, true, None)?;
        o.mul(&o)?.sum_all()
    };
    let run = |keep: Option<&[SaveOp]>| {
        for w in &ws {
            w.zero_grad();
        }
        let xx = x.detach().requires_grad_(true);
        let mut inputs = vec![xx.clone()];
        inputs.extend(ws.iter().cloned());
        reset_recompute_counts();
        let y = match keep {
            None => block(&inputs).unwrap(),
            Some(keep) => checkpoint(&inputs, keep, block).unwrap(),
        };
        y.backward().unwrap();
        let mut grads = vec![xx.grad().unwrap()];
        grads.extend(ws.iter().map(|w| w.grad().unwrap()));
        let bits: Vec<Vec<u32>> = grads
            .iter()
            .map(|g| g.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect();
        (y.to_vec::<f32>().unwrap()[0].to_bits(), bits, recompute_counts())
    };
    let (loss, grads, _) = run(None);
    for (keep, kept) in [
        (&[][..], 0),
        (&[SaveOp::Matmul][..], 3),
        (&[SaveOp::Sdpa][..], 1),
        (&[SaveOp::Matmul, SaveOp::Sdpa][..], 4),
        (&[SaveOp::EveryOtherMatmul][..], 2),
    ] {
        let (l, g, counts) = run(Some(keep));
        assert_eq!((l, &g), (loss, &grads), "keep {keep:?}");
        assert_eq!(counts.recomputed, 1, "keep {keep:?}");
        assert_eq!((counts.saved, counts.reused), (kept, kept), "keep {keep:?}: {counts:?}");
    }
}

/// The blockwise attention of context parallelism on the device: every block kind
/// (no mask, top-left causal, nothing visible, and an explicit pattern through the host)
/// with and without a key mask, forward, backward from merged results and the
/// log-sum-exp merge, against the same calls on the host; no host round trip, and the
/// blocks with kernels keep their log-sum-exps on the device.
#[test]
fn attention_blocks_run_on_the_device() {
    setup();
    let mut rng = Rng::new(21);
    let (b, hq, hkv, d) = (2, 4, 2, 8);
    let neg = f64::NEG_INFINITY;
    // (query positions, key positions, whether a kernel takes the block)
    let blocks: [(&[usize], &[usize], bool); 4] = [
        (&[4, 5, 6], &[0, 1, 2, 3], true),
        (&[0, 1, 6, 7], &[0, 1, 6, 7], true),
        (&[0, 1], &[5, 6, 7], true),
        (&[2, 5, 6], &[3, 4, 6], false),
    ];
    for (q_pos, k_pos, kernel) in blocks {
        for masked in [false, true] {
            let what = format!("block {q_pos:?} x {k_pos:?} masked {masked}");
            let (sq, sk) = (q_pos.len(), k_pos.len());
            let q = randn(&[b, hq, sq, d], DType::F32, &mut rng, false);
            let k = randn(&[b, hkv, sk, d], DType::F32, &mut rng, false);
            let v = randn(&[b, hkv, sk, d], DType::F32, &mut rng, false);
            let dout = randn(&[b, hq, sq, d], DType::F32, &mut rng, false);
            // Batch 1 pads its first key (a fully padded row where nothing else shows).
            let mask = masked.then(|| {
                let m: Vec<f64> = (0..b * sk).map(|i| if i == sk { neg } else { 0.0 }).collect();
                Tensor::from_f64(&m, [b, sk], DType::F32).unwrap()
            });
            let on = |t: &Tensor| t.to_device(DEV).unwrap();
            let host =
                Tensor::sdpa_block_forward(&q, &k, &v, q_pos, k_pos, mask.as_ref(), None).unwrap();
            let dm = mask.as_ref().map(on);
            let trips = gpu::host_round_trips();
            let dev = Tensor::sdpa_block_forward(
                &on(&q),
                &on(&k),
                &on(&v),
                q_pos,
                k_pos,
                dm.as_ref(),
                None,
            )
            .unwrap();
            let (hg, dg) = {
                let hg = Tensor::sdpa_block_backward(
                    &q,
                    &k,
                    &v,
                    q_pos,
                    k_pos,
                    mask.as_ref(),
                    None,
                    &host.0,
                    &host.1,
                    &dout,
                )
                .unwrap();
                let dg = Tensor::sdpa_block_backward(
                    &on(&q),
                    &on(&k),
                    &on(&v),
                    q_pos,
                    k_pos,
                    dm.as_ref(),
                    None,
                    &dev.0,
                    &dev.1,
                    &on(&dout),
                )
                .unwrap();
                (hg, dg)
            };
            let added = gpu::host_round_trips() - trips;
            assert_eq!(added, 0, "{what}: host round trips");
            // A kernel's log-sum-exps stay on the device (f32); the host's are f64.
            let want = if kernel { (DEV, DType::F32) } else { (Device::Cpu, DType::F64) };
            assert_eq!((dev.1.device(), dev.1.dtype()), want, "{what}");
            assert_eq!(dev.0.device(), DEV, "{what}");
            let lse = |t: &Tensor| t.to_device(Device::Cpu).unwrap().to_dtype(DType::F64).unwrap();
            assert_close(&format!("{what}: out"), &dev.0, &host.0, tol(DType::F32));
            let (hl, dl) = (lse(&host.1).to_vec_f64().unwrap(), lse(&dev.1).to_vec_f64().unwrap());
            for (i, (x, y)) in dl.iter().zip(&hl).enumerate() {
                let same = (x == y) || (x - y).abs() <= 1e-5 * y.abs().max(1.0);
                assert!(same, "{what}: lse {i}: device {x} vs host {y}");
            }
            for (name, a, h) in [("dq", &dg.0, &hg.0), ("dk", &dg.1, &hg.1), ("dv", &dg.2, &hg.2)] {
                assert_close(&format!("{what}: {name}"), a, h, tol(DType::F32));
            }
        }
    }
}

/// The log-sum-exp merge on the device equals the host's, including rows that only one
/// side sees and rows neither sees (zeros and `-inf`, never NaN), with a host lse on one
/// side (the running result's start); no host round trip.
#[test]
fn lse_merge_runs_on_the_device() {
    setup();
    let mut rng = Rng::new(22);
    let neg = f64::NEG_INFINITY;
    for dtype in [DType::F32, DType::BF16] {
        let oa = randn(&[2, 3, 4], dtype, &mut rng, false);
        let ob = randn(&[2, 3, 4], dtype, &mut rng, false);
        let la = Tensor::from_f64(&[0.5, neg, 2.0, neg, -1.0, 30.0], [2, 3], DType::F64).unwrap();
        let lb = Tensor::from_f64(&[1.5, 0.25, neg, neg, -1.0, -30.0], [2, 3], DType::F32).unwrap();
        let (ho, hl) = Tensor::sdpa_lse_merge(&oa, &la, &ob, &lb).unwrap();
        let trips = gpu::host_round_trips();
        let (d_oa, d_ob, d_lb) =
            (oa.to_device(DEV).unwrap(), ob.to_device(DEV).unwrap(), lb.to_device(DEV).unwrap());
        let (dout, dl) = Tensor::sdpa_lse_merge(&d_oa, &la, &d_ob, &d_lb).unwrap();
        assert_eq!(gpu::host_round_trips(), trips, "{dtype:?}");
        assert_close(&format!("merge {dtype:?}"), &dout, &ho, tol(dtype));
        let got = dl.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap();
        let want = hl.to_vec_f64().unwrap();
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            let same = (x == y) || (x - y).abs() <= 1e-6 * y.abs().max(1.0);
            assert!(same, "{dtype:?}: lse {i}: device {x} vs host {y}");
        }
        let o = dout.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap();
        assert!(o.iter().all(|x| x.is_finite()) && o[12..16].iter().all(|&x| x == 0.0), "{o:?}");
    }
}
