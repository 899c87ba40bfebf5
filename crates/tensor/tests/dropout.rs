//! Dropout and the default generator: the mask's rate and values, a shard drawing the
//! whole tensor's mask at its positions, the backward applying the forward's mask, an
//! activation-checkpointed region recomputing the forward's mask, the CUDA kernel (on the
//! emulator) drawing the host's mask without a host round trip, and typed errors.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::checkpoint::{checkpoint, SaveOp};
use tpar_tensor::{
    get_rng_state, gpu, manual_seed, set_rng_state, DType, Device, Rng, RngState, Tensor,
    TensorError,
};

fn uniform(dims: &[usize], seed: u64) -> Tensor {
    Tensor::rand_uniform(dims.to_vec(), 0.5, 2.0, DType::F64, &mut Rng::new(seed)).unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn values_are_dropped_or_scaled_at_the_asked_rate() {
    let x = uniform(&[64, 1000], 1);
    let xs = x.to_vec_f64().unwrap();
    for p in [0.1, 0.5, 0.9] {
        manual_seed(3);
        let y = x.dropout(p, true).unwrap().to_vec_f64().unwrap();
        assert_eq!(get_rng_state(), RngState { seed: 3, offset: 64_000 });
        let scale = 1.0 / (1.0 - p);
        let mut kept = 0usize;
        for (&a, &b) in xs.iter().zip(&y) {
            if b != 0.0 {
                assert_eq!(b, a * scale, "a kept element is x / (1 - p)");
                kept += 1;
            }
        }
        // the kept count is binomial(64000, 1 - p): within 5 standard deviations
        let (n, q) = (xs.len() as f64, 1.0 - p);
        let sd = (n * q * p).sqrt();
        assert!((kept as f64 - n * q).abs() < 5.0 * sd, "p {p}: kept {kept} of {n}");
        // the same state draws the same mask; the next call draws another
        manual_seed(3);
        let again = x.dropout(p, true).unwrap().to_vec_f64().unwrap();
        assert_eq!(again, y);
        let next = x.dropout(p, true).unwrap().to_vec_f64().unwrap();
        assert_ne!(next, y);
        // every float dtype drops the same elements
        for dt in [DType::F32, DType::BF16, DType::F16] {
            manual_seed(3);
            let z = x.to_dtype(dt).unwrap().dropout(p, true).unwrap().to_vec_f64().unwrap();
            let zeros = |v: &[f64]| v.iter().map(|&e| e == 0.0).collect::<Vec<_>>();
            assert_eq!(zeros(&z), zeros(&y), "{dt:?} drops other elements than f64");
        }
    }
    // a count that is not a whole ChaCha block moves the offset to the next block
    manual_seed(0);
    uniform(&[3, 7], 2).dropout(0.5, true).unwrap();
    assert_eq!(get_rng_state().offset, 32);
}

/// `t` narrowed to the box at `offset` of dims `dims`.
fn sub(t: &Tensor, offset: &[usize], dims: &[usize]) -> Tensor {
    let mut s = t.clone();
    for (d, (&o, &n)) in offset.iter().zip(dims).enumerate() {
        s = s.narrow(d as isize, o, n).unwrap();
    }
    s
}

#[test]
fn a_shard_draws_the_whole_tensors_mask_at_its_positions() {
    // (global dims, shard offset, shard dims): partial in the first, the last, a middle
    // and every dim, whole, a single element, and runs longer than one task's chunk
    let cases: &[(&[usize], &[usize], &[usize])] = &[
        (&[7], &[2], &[4]),
        (&[5, 9], &[1, 0], &[3, 9]),
        (&[5, 9], &[0, 4], &[5, 5]),
        (&[3, 4, 5], &[1, 1, 0], &[2, 2, 5]),
        (&[3, 4, 5], &[0, 0, 2], &[3, 4, 1]),
        (&[2, 3, 1, 6], &[1, 1, 0, 3], &[1, 2, 1, 3]),
        (&[2, 3, 1, 6], &[0, 0, 0, 0], &[2, 3, 1, 6]),
        (&[4, 6], &[3, 5], &[1, 1]),
        (&[3, 40_000], &[1, 5_000], &[2, 30_000]),
        (&[6, 20_000], &[2, 0], &[3, 20_000]),
        // an empty shard of a whole that is not: the generator still moves by the whole
        (&[4, 6], &[4, 0], &[0, 6]),
    ];
    for &(global, offset, dims) in cases {
        let x = uniform(global, 7);
        let start = RngState { seed: 11, offset: 48 };
        set_rng_state(start);
        let whole = x.dropout(0.3, true).unwrap();
        let after = get_rng_state();
        set_rng_state(start);
        let shard = sub(&x, offset, dims).contiguous().unwrap();
        let got = shard.dropout_shard(0.3, true, global, offset).unwrap();
        assert_eq!(
            bits(&got),
            bits(&sub(&whole, offset, dims).contiguous().unwrap()),
            "shard {dims:?} at {offset:?} of {global:?}"
        );
        assert_eq!(get_rng_state(), after, "the offset moves by the whole tensor's count");
    }
}

#[test]
fn the_backward_applies_the_forwards_mask() {
    let x = uniform(&[33, 17], 5).requires_grad_(true);
    let w = uniform(&[33, 17], 6);
    manual_seed(9);
    let y = x.dropout(0.4, true).unwrap();
    let drawn = get_rng_state();
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(get_rng_state(), drawn, "the backward draws nothing from the generator");
    let (ys, ws, gs) =
        (y.to_vec_f64().unwrap(), w.to_vec_f64().unwrap(), x.grad().unwrap().to_vec_f64().unwrap());
    for ((&yv, &wv), &g) in ys.iter().zip(&ws).zip(&gs) {
        let want = if yv == 0.0 { 0.0 } else { wv * (1.0 / 0.6) };
        assert_eq!(g, want);
    }
}

#[test]
fn pieces_end_to_end_draw_the_whole_tensors_mask_at_their_positions() {
    // A sequence of 10 in 6 chunks of 2 (the last empty), as cp 3 balances it: rank r
    // holds chunks r and 5 - r end to end along dim 1.
    let global = [2usize, 10, 3];
    let x = uniform(&global, 3);
    let start = RngState { seed: 4, offset: 32 };
    set_rng_state(start);
    let whole = x.dropout(0.5, true).unwrap();
    let after = get_rng_state();
    for chunks in [[(0, 2), (10, 0)], [(2, 2), (8, 2)], [(4, 2), (6, 2)]] {
        let local = Tensor::cat(&chunks.map(|(s, l)| x.narrow(1, s, l).unwrap()), 1).unwrap();
        let local = local.requires_grad_(true);
        let pieces: Vec<(Vec<usize>, usize)> =
            chunks.iter().map(|&(s, l)| (vec![0, s, 0], l)).collect();
        set_rng_state(start);
        let got = local.dropout_pieces(0.5, true, &global, 1, &pieces).unwrap();
        assert_eq!(get_rng_state(), after, "{chunks:?}: the offset moves once, by the whole");
        let want = Tensor::cat(&chunks.map(|(s, l)| whole.narrow(1, s, l).unwrap()), 1).unwrap();
        assert_eq!(bits(&got), bits(&want), "{chunks:?}");
        // the backward applies each piece's mask: the gradient of sum(y) is y / x
        got.sum_all().unwrap().backward().unwrap();
        let g = local.grad().unwrap().to_vec_f64().unwrap();
        let (y, xs) = (got.to_vec_f64().unwrap(), local.to_vec_f64().unwrap());
        for ((g, y), x) in g.iter().zip(&y).zip(&xs) {
            assert_eq!(*g, if *y == 0.0 { 0.0 } else { 2.0 }, "x {x}");
        }
    }
    let local = x.narrow(1, 0, 4).unwrap();
    for (pieces, why) in [
        (vec![(vec![0, 0, 0], 2), (vec![0, 8, 0], 1)], "rows"),
        (vec![(vec![0, 0, 0], 2), (vec![0, 9, 0], 2)], "not inside"),
    ] {
        match local.dropout_pieces(0.5, true, &global, 1, &pieces) {
            Err(TensorError::InvalidArgument { what, .. }) => assert!(what.contains(why), "{what}"),
            other => panic!("{pieces:?}: {other:?}"),
        }
    }
    assert!(local.dropout_pieces(0.5, true, &global, 3, &[]).is_err());
    // no rows at all (a rank whose chunks are empty): nothing drawn for it, and the
    // generator moves by the whole tensor's count as its peers' do
    for pieces in [vec![], vec![(vec![0, 10, 0], 0), (vec![0, 10, 0], 0)]] {
        let empty = x.narrow(1, 0, 0).unwrap();
        set_rng_state(start);
        let got = empty.dropout_pieces(0.5, true, &global, 1, &pieces).unwrap();
        assert_eq!(got.dims(), &[2, 0, 3]);
        assert_eq!(get_rng_state(), after, "{pieces:?}");
    }
}

#[test]
fn the_device_draws_the_hosts_mask_without_a_round_trip() {
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
    let dev = Device::Cuda(0);
    // (global dims, shard offset, shard dims): whole, partial in the last, the first
    // and every dim, and a single element
    let cases: &[(&[usize], &[usize], &[usize])] = &[
        (&[3, 50], &[0, 0], &[3, 50]),
        (&[5, 9], &[0, 4], &[5, 5]),
        (&[6, 33], &[2, 0], &[3, 33]),
        (&[2, 3, 1, 6], &[1, 1, 0, 3], &[1, 2, 1, 3]),
        (&[4, 6], &[3, 5], &[1, 1]),
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for &(global, offset, dims) in cases {
            let what = format!("{dtype:?} shard {dims:?} at {offset:?} of {global:?}");
            let x = sub(&uniform(global, 7), offset, dims).to_dtype(dtype).unwrap();
            let x = x.contiguous().unwrap().requires_grad_(true);
            let gy = uniform(dims, 8).to_dtype(dtype).unwrap();
            let start = RngState { seed: 11, offset: 21 };
            set_rng_state(start);
            let y = x.dropout_shard(0.4, true, global, offset).unwrap();
            y.backward_with(&gy).unwrap();
            let after = get_rng_state();

            let (xd, gyd) = (x.detach().to_device(dev).unwrap(), gy.to_device(dev).unwrap());
            let xd = xd.requires_grad_(true);
            set_rng_state(start);
            let before = gpu::host_round_trips();
            let yd = xd.dropout_shard(0.4, true, global, offset).unwrap();
            yd.backward_with(&gyd).unwrap();
            assert_eq!(gpu::host_round_trips(), before, "{what}: stays on the device");
            assert_eq!(get_rng_state(), after, "{what}: the generator moves alike");
            assert_eq!(yd.device(), dev);
            assert_eq!(bits(&yd), bits(&y), "{what}: output");
            assert_eq!(bits(&xd.grad().unwrap()), bits(&x.grad().unwrap()), "{what}: gradient");
        }
    }
}

/// A block with two dropouts (one after a checkpointed region's matmul, one on its
/// output) and a dropout after it: the loss, both weights' gradients and the generator's
/// state after the backward.
fn block_step(ac: Option<&[SaveOp]>) -> (u64, Vec<u64>, Vec<u64>, RngState) {
    let x = uniform(&[6, 16], 20).requires_grad_(true);
    let w1 = uniform(&[24, 16], 21).requires_grad_(true);
    let w2 = uniform(&[16, 24], 22).requires_grad_(true);
    let (a, b) = (w1.clone(), w2.clone());
    let f = move |i: &[Tensor]| -> tpar_tensor::Result<Tensor> {
        let h = i[0].linear(&a, None)?.silu()?.dropout(0.25, true)?;
        h.linear(&b, None)?.dropout(0.5, true)
    };
    manual_seed(42);
    let h = match ac {
        Some(keep) => checkpoint(std::slice::from_ref(&x), keep, f).unwrap(),
        None => f(std::slice::from_ref(&x)).unwrap(),
    };
    let loss = h.dropout(0.1, true).unwrap().square().unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let g = |t: &Tensor| bits(&t.grad().unwrap());
    (bits(&loss)[0], g(&w1), g(&w2), get_rng_state())
}

#[test]
fn checkpointed_dropout_recomputes_the_forwards_mask() {
    let plain = block_step(None);
    assert_eq!(block_step(Some(&[])), plain, "full checkpointing");
    assert_eq!(block_step(Some(&[SaveOp::Matmul])), plain, "selective checkpointing");
}

#[test]
fn bad_arguments_are_typed_errors() {
    let x = uniform(&[4, 4], 1);
    for p in [-0.1, 1.5, f64::NAN] {
        match x.dropout(p, true) {
            Err(TensorError::InvalidArgument { what, .. }) => {
                assert!(what.contains("between 0 and 1"), "{what}")
            }
            other => panic!("p {p}: {other:?}"),
        }
    }
    let ids = Tensor::from_vec(vec![1i64, 2, 3], [3]).unwrap();
    assert!(matches!(ids.dropout(0.5, true), Err(TensorError::DTypeMismatch { .. })));
    for (global, offset) in [(&[4usize, 3][..], &[0usize, 0][..]), (&[4, 4], &[1, 0]), (&[4], &[0])]
    {
        assert!(
            matches!(
                x.dropout_shard(0.5, true, global, offset),
                Err(TensorError::InvalidArgument { .. })
            ),
            "a [4, 4] shard at {offset:?} of {global:?}"
        );
    }
    // eval mode and p 0 hand back the input and draw nothing; p 1 zeros without drawing
    manual_seed(5);
    assert_eq!(x.dropout(0.5, false).unwrap().id(), x.id());
    assert_eq!(x.dropout(0.0, true).unwrap().id(), x.id());
    assert!(x.dropout(1.0, true).unwrap().to_vec_f64().unwrap().iter().all(|&v| v == 0.0));
    let meta = Tensor::empty([4, 4], DType::F32, Device::Meta).unwrap();
    assert_eq!(meta.dropout(0.5, true).unwrap().dims(), &[4, 4]);
    assert_eq!(get_rng_state(), RngState { seed: 5, offset: 0 });
}
