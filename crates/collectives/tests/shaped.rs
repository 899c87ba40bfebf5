//! `send_shaped`/`recv_shaped` on the local backend: data-only point-to-point transfers
//! whose shape both sides agreed on, their pairing checks, and their failures.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::rand_tensor;
use tpar_collectives::{spawn_scoped, CollectiveError, CollectiveKind, SpawnConfig};
use tpar_tensor::{DType, Device, Rng, Tensor};

/// The dtypes and shapes of the round trips, the empty and 0-d tensors included.
fn cases() -> Vec<(DType, Vec<usize>)> {
    vec![
        (DType::F32, vec![3, 4]),
        (DType::F64, vec![5]),
        (DType::BF16, vec![2, 3, 2]),
        (DType::F16, vec![7]),
        (DType::I64, vec![4, 1]),
        (DType::F32, vec![0, 4]),
        (DType::I64, vec![0]),
        (DType::F64, vec![]),
    ]
}

/// What rank `r` sends in case `k`: every rank can rebuild it.
fn payload(r: usize, k: usize, dtype: DType, dims: &[usize]) -> Tensor {
    rand_tensor(dims, dtype, &mut Rng::new((r * 100 + k) as u64))
}

#[test]
fn round_trips_every_dtype_around_a_ring_of_2_and_3() {
    for world in [2usize, 3] {
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let (me, n) = (pg.rank(), pg.size());
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            for (k, (dtype, dims)) in cases().into_iter().enumerate() {
                let t = payload(me, k, dtype, &dims);
                pg.send_shaped(&t, next)?;
                let got = pg.recv_shaped(prev, &dims, dtype, Device::Cpu)?;
                let want = payload(prev, k, dtype, &dims);
                assert_eq!((got.dims(), got.dtype()), (dims.as_slice(), dtype), "case {k}");
                assert_eq!(got.device(), Device::Cpu);
                assert!(!got.requires_grad());
                assert_eq!(got.to_vec_f64()?, want.to_vec_f64()?, "{dtype} {dims:?} n={n}");
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn shaped_transfers_are_fifo_per_pair_and_keep_order_with_send() {
    spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let me = pg.rank();
        let dims = |k: usize| vec![k % 3 + 1, 2];
        if me == 0 {
            // Several shaped transfers queued before anyone receives, to both peers, with a
            // self-describing one in the middle of the stream to rank 1.
            for k in 0..12usize {
                let dst = 1 + k % 2;
                let t = Tensor::full(dims(k), k as f64, DType::F32, Device::Cpu)?;
                pg.send_shaped(&t, dst)?;
                if k == 6 {
                    pg.send(&Tensor::from_vec(vec![-1i64, -2], [2])?, 1)?;
                }
            }
            // Sending copies: changing the tensor after send_shaped changes nothing.
            let t = Tensor::from_vec(vec![5.0f64], [1])?;
            pg.send_shaped(&t, 2)?;
            t.with_data_mut::<f64, _>(|s| s[0] = 0.0)?;
        } else {
            for k in (0..12usize).filter(|k| 1 + k % 2 == me) {
                let got = pg.recv_shaped(0, &dims(k), DType::F32, Device::Cpu)?;
                assert_eq!(got.to_vec::<f32>()?, vec![k as f32; dims(k).iter().product()]);
                if k == 6 {
                    assert_eq!(pg.recv(0)?.to_vec::<i64>()?, vec![-1, -2]);
                }
            }
            if me == 2 {
                let got = pg.recv_shaped(0, &[1], DType::F64, Device::Cpu)?;
                assert_eq!(got.to_vec::<f64>()?, vec![5.0]);
            }
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_rank_may_send_to_itself_and_sub_groups_use_group_ranks() {
    spawn_scoped(SpawnConfig::new(4), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let t = Tensor::from_vec(vec![ctx.rank() as f32, 1.0], [1, 2])?;
        pg.send_shaped(&t, pg.rank())?;
        let back = pg.recv_shaped(pg.rank(), &[1, 2], DType::F32, Device::Cpu)?;
        assert_eq!(back.to_vec::<f32>()?, t.to_vec::<f32>()?);
        // Pairs {0, 2} and {1, 3}: group rank 1 of each sends to group rank 0.
        let g = ctx.new_group(&[ctx.rank() % 2, ctx.rank() % 2 + 2])?;
        if g.rank() == 1 {
            g.send_shaped(&Tensor::from_vec(vec![ctx.rank() as i64; 3], [3])?, 0)?;
        } else {
            let got = g.recv_shaped(1, &[3], DType::I64, Device::Cpu)?;
            assert_eq!(got.to_vec::<i64>()?, vec![ctx.rank() as i64 + 2; 3]);
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn meta_tensors_move_no_data_and_keep_their_shape() {
    spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        if pg.rank() == 0 {
            pg.send_shaped(&Tensor::empty([6, 2], DType::BF16, Device::Meta)?, 1)?;
        } else {
            let got = pg.recv_shaped(0, &[6, 2], DType::BF16, Device::Meta)?;
            assert_eq!((got.dims(), got.device()), (&[6usize, 2][..], Device::Meta));
        }
        Ok(())
    })
    .unwrap();
}

/// Runs a two-or-more-rank world where rank `from` sends `sent` to rank `to` (through
/// `send_shaped`, or `send` when `plain`) and rank `to` calls `recv_shaped` with `dims`
/// and `dtype` on `device` (or `recv` when `expect` is `None`); returns the receiver's
/// error, which must exist.
fn receiver_error(
    world: usize,
    (from, to): (usize, usize),
    sent: fn() -> Tensor,
    plain: bool,
    expect: Option<(&'static [usize], DType, Device)>,
) -> CollectiveError {
    let seen = Mutex::new(None);
    let t0 = Instant::now();
    let r = spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        if pg.rank() == from {
            if plain {
                pg.send(&sent(), to)?;
            } else {
                pg.send_shaped(&sent(), to)?;
            }
        } else if pg.rank() == to {
            let got = match expect {
                Some((dims, dtype, device)) => pg.recv_shaped(from, dims, dtype, device),
                None => pg.recv(from),
            };
            if let Err(e) = &got {
                *seen.lock().unwrap() = Some(e.clone());
            }
            got?;
        }
        Ok(())
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "a mismatch fails at once");
    let e = seen.into_inner().unwrap().expect("the receiver fails");
    assert_eq!(r.unwrap_err().to_string(), e.to_string(), "spawn reports the receiver's error");
    e
}

fn assert_names_both(e: &CollectiveError, op: &str, from: usize, to: usize, parts: &[&str]) {
    let msg = e.to_string();
    assert!(
        matches!(e, CollectiveError::Mismatch { op: o, rank, .. } if *o == op && *rank == from),
        "{msg}"
    );
    assert_eq!(e.culprit(), Some(from));
    assert!(msg.contains(&format!("rank {from}")), "{msg}");
    assert!(msg.contains(&format!("rank {to}")), "{msg}");
    for p in parts {
        assert!(msg.contains(p), "{msg} lacks {p:?}");
    }
}

#[test]
fn a_shape_mismatch_is_a_typed_error_naming_both_ranks() {
    fn sent() -> Tensor {
        Tensor::zeros([3, 2], DType::F32, Device::Cpu).unwrap()
    }
    let e = receiver_error(3, (2, 0), sent, false, Some((&[2, 3], DType::F32, Device::Cpu)));
    assert_names_both(&e, "recv_shaped", 2, 0, &["f32 [2, 3]", "f32 [3, 2]"]);
    // Same element count, other rank: still a mismatch, dims are compared exactly.
    let e = receiver_error(2, (0, 1), sent, false, Some((&[6], DType::F32, Device::Cpu)));
    assert_names_both(&e, "recv_shaped", 0, 1, &["f32 [6]", "f32 [3, 2]"]);
}

#[test]
fn a_dtype_mismatch_is_a_typed_error_naming_both_ranks() {
    fn sent() -> Tensor {
        Tensor::zeros([4], DType::BF16, Device::Cpu).unwrap()
    }
    let e = receiver_error(2, (1, 0), sent, false, Some((&[4], DType::F16, Device::Cpu)));
    assert_names_both(&e, "recv_shaped", 1, 0, &["f16 [4]", "bf16 [4]"]);
}

#[test]
fn meta_and_data_do_not_pair() {
    fn meta() -> Tensor {
        Tensor::empty([2], DType::F32, Device::Meta).unwrap()
    }
    fn data() -> Tensor {
        Tensor::zeros([2], DType::F32, Device::Cpu).unwrap()
    }
    let e = receiver_error(2, (0, 1), meta, false, Some((&[2], DType::F32, Device::Cpu)));
    assert_names_both(&e, "recv_shaped", 0, 1, &["on meta"]);
    let e = receiver_error(2, (0, 1), data, false, Some((&[2], DType::F32, Device::Meta)));
    assert_names_both(&e, "recv_shaped", 0, 1, &["on meta"]);
}

#[test]
fn send_pairs_with_recv_and_send_shaped_with_recv_shaped() {
    fn sent() -> Tensor {
        Tensor::zeros([2, 2], DType::F32, Device::Cpu).unwrap()
    }
    // Same shape and dtype, but the transfer came from `send`.
    let e = receiver_error(2, (0, 1), sent, true, Some((&[2, 2], DType::F32, Device::Cpu)));
    assert_names_both(&e, "recv_shaped", 0, 1, &["through send to", "send pairs with recv"]);
    // A `recv` meeting a `send_shaped` transfer.
    let e = receiver_error(2, (1, 0), sent, false, None);
    assert_names_both(&e, "recv", 1, 0, &["send_shaped pairs with recv_shaped"]);
}

#[test]
fn a_dead_sender_makes_recv_shaped_fail_promptly() {
    // The sender's rank function fails without sending.
    let seen = Mutex::new(None);
    let t0 = Instant::now();
    let r = spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        if pg.rank() == 1 {
            return Err(CollectiveError::InvalidArgument { op: "stage", why: "boom".into() });
        }
        let got = pg.recv_shaped(1, &[4], DType::F32, Device::Cpu);
        if let Err(e) = &got {
            *seen.lock().unwrap() = Some(e.clone());
        }
        got.map(|_| ())
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "no hang");
    assert!(r.unwrap_err().to_string().contains("boom"), "spawn reports the originating error");
    let e = seen.into_inner().unwrap().expect("rank 0 fails");
    assert!(matches!(e, CollectiveError::PeerFailed { op: "recv_shaped", rank: 1, .. }), "{e}");

    // The sender returns Ok without sending: the receiver fails naming it.
    let t0 = Instant::now();
    let r = spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
        if ctx.rank() == 0 {
            ctx.world_group().recv_shaped(2, &[1], DType::I64, Device::Cpu)?;
        }
        Ok(())
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "no hang");
    let e = r.unwrap_err();
    assert!(matches!(e, CollectiveError::PeerFailed { op: "recv_shaped", rank: 2, .. }), "{e}");

    // A sender that is only late: the group's timeout.
    let r = spawn_scoped(SpawnConfig::new(2).timeout(Duration::from_millis(300)), |ctx| {
        if ctx.rank() == 1 {
            std::thread::sleep(Duration::from_millis(800));
            return Ok(());
        }
        ctx.world_group().recv_shaped(1, &[2], DType::F32, Device::Cpu).map(|_| ())
    });
    match r {
        Err(CollectiveError::Timeout { op: "recv_shaped", waiting_for, .. }) => {
            assert_eq!(waiting_for, vec![1])
        }
        other => panic!("expected a recv_shaped timeout, got {other:?}"),
    }
}

#[test]
fn bad_ranks_are_refused_and_calls_are_recorded() {
    spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let t = Tensor::zeros([2, 3], DType::BF16, Device::Cpu)?;
        let e = pg.send_shaped(&t, 2).unwrap_err();
        assert!(matches!(e, CollectiveError::InvalidArgument { op: "send_shaped", .. }), "{e}");
        assert!(e.to_string().contains("dst 2"), "{e}");
        let e = pg.recv_shaped(5, &[2, 3], DType::BF16, Device::Cpu).unwrap_err();
        assert!(matches!(e, CollectiveError::InvalidArgument { op: "recv_shaped", .. }), "{e}");
        assert!(e.to_string().contains("src 5"), "{e}");
        let e = pg.recv_shaped(0, &[usize::MAX, 3], DType::F32, Device::Cpu).unwrap_err();
        assert!(matches!(e, CollectiveError::InvalidArgument { op: "recv_shaped", .. }), "{e}");

        let dbg = pg.comm_debug();
        dbg.enable();
        let peer = 1 - pg.rank();
        pg.send_shaped(&t, peer)?;
        pg.recv_shaped(peer, &[2, 3], DType::BF16, Device::Cpu)?;
        let recs = dbg.take();
        assert_eq!(recs.len(), 2, "{recs:?}");
        assert_eq!(recs[0].kind, CollectiveKind::Send);
        assert_eq!((recs[0].bytes, recs[0].dtype), (12, Some(DType::BF16)));
        assert_eq!(recs[0].shape, vec![2, 3]);
        assert_eq!(recs[1].kind, CollectiveKind::Recv);
        assert_eq!((recs[1].bytes, recs[1].dtype), (0, None));
        // The same records as `send` and `recv` make.
        pg.send(&t, peer)?;
        pg.recv(peer)?;
        assert_eq!(dbg.take(), recs);
        Ok(())
    })
    .unwrap();
}
