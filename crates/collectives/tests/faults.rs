//! Bad behaviour of one rank: every other rank gets a typed error naming it, promptly
//! (or after the timeout when it is merely absent), and `spawn` returns the originating
//! error. Never a hang, never a panic out of `spawn`.

use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tpar_collectives::{spawn, spawn_with, CollectiveError, ReduceOp, SpawnConfig, World};
use tpar_tensor::{DType, Device, Tensor};

const LONG: Duration = Duration::from_secs(20);

fn x(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::ones(dims.to_vec(), dtype, Device::Cpu).unwrap()
}

type Outcome = (Result<Vec<()>, CollectiveError>, Vec<Option<CollectiveError>>, Duration);

/// All ranks all_reduce twice, except `culprit`, which runs `bad` and returns an error
/// after the first. Returns spawn's result, the error each rank's second all_reduce
/// returned, and the elapsed time.
fn all_reduce_in(world: usize, timeout: Duration, culprit: usize, bad: fn(usize)) -> Outcome {
    let seen = Arc::new(Mutex::new(vec![None; world]));
    let seen2 = Arc::clone(&seen);
    let t0 = Instant::now();
    let r = spawn_with(SpawnConfig::new(world).timeout(timeout), move |ctx| {
        let pg = ctx.world_group();
        let rank = ctx.rank();
        pg.all_reduce(&x(&[8], DType::F32), ReduceOp::Sum)?; // everyone in step first
        if rank == culprit {
            bad(rank);
            return Err(CollectiveError::InvalidArgument {
                op: "user",
                why: "rank function failed".into(),
            });
        }
        let out = pg.all_reduce(&x(&[8], DType::F32), ReduceOp::Sum).map(|_| ());
        if let Err(e) = &out {
            seen2.lock().unwrap()[rank] = Some(e.clone());
        }
        out
    });
    let seen = seen.lock().unwrap().clone();
    (r, seen, t0.elapsed())
}

#[test]
fn a_panicking_rank_fails_its_peers_promptly() {
    let (r, seen, dt) = all_reduce_in(4, LONG, 2, |_| panic!("rank 2 exploded"));
    match r {
        Err(CollectiveError::Panicked { rank: 2, message }) => {
            assert!(message.contains("exploded"))
        }
        other => panic!("expected rank 2's panic, got {other:?}"),
    }
    for (rank, e) in seen.iter().enumerate() {
        if rank != 2 {
            match e {
                Some(CollectiveError::PeerFailed { rank: 2, why, .. }) => {
                    assert!(why.contains("exploded"), "{why}")
                }
                other => panic!("rank {rank}: expected PeerFailed(2), got {other:?}"),
            }
        }
    }
    assert!(dt < Duration::from_secs(5), "took {dt:?}");
}

#[test]
fn a_rank_returning_an_error_fails_its_peers_promptly() {
    let (r, seen, dt) = all_reduce_in(4, LONG, 1, |_| {});
    match r {
        Err(CollectiveError::InvalidArgument { op: "user", .. }) => {}
        other => panic!("expected rank 1's own error, got {other:?}"),
    }
    for (rank, e) in seen.iter().enumerate() {
        if rank != 1 {
            assert_eq!(e.as_ref().and_then(|e| e.culprit()), Some(1), "rank {rank}: {e:?}");
        }
    }
    assert!(dt < Duration::from_secs(5), "took {dt:?}");
}

#[test]
fn an_absent_rank_times_out_naming_it() {
    let timeout = Duration::from_millis(500);
    let seen = Arc::new(Mutex::new(vec![None; 3]));
    let seen2 = Arc::clone(&seen);
    let t0 = Instant::now();
    let r = spawn_with(SpawnConfig::new(3).timeout(timeout), move |ctx| {
        if ctx.rank() == 1 {
            // Alive but never joins; done before spawn_with's grace after the timeout ends.
            std::thread::sleep(Duration::from_millis(700));
            return Ok(());
        }
        let out = ctx.world_group().all_gather(&x(&[2], DType::BF16), 0).map(|_| ());
        if let Err(e) = &out {
            seen2.lock().unwrap()[ctx.rank()] = Some(e.clone());
        }
        out
    });
    let dt = t0.elapsed();
    match r {
        Err(CollectiveError::Timeout { waiting_for, after, op, group, .. }) => {
            assert_eq!(
                (waiting_for, after, op, group),
                (vec![1], timeout, "all_gather", vec![0, 1, 2])
            );
        }
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
    for rank in [0, 2] {
        let e = seen.lock().unwrap()[rank].clone();
        assert!(matches!(e, Some(CollectiveError::Timeout { .. })), "rank {rank}: {e:?}");
    }
    assert!(dt >= timeout && dt < Duration::from_secs(5), "took {dt:?}");
}

#[test]
fn a_rank_that_leaves_without_joining_is_named_at_once() {
    let seen = Arc::new(Mutex::new(vec![None; 4]));
    let seen2 = Arc::clone(&seen);
    let t0 = Instant::now();
    let r = spawn(4, move |ctx| -> Result<(), CollectiveError> {
        if ctx.rank() == 3 {
            return Ok(());
        }
        let out = ctx.world_group().barrier();
        if let Err(e) = &out {
            seen2.lock().unwrap()[ctx.rank()] = Some(e.clone());
        }
        out
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    match r {
        Err(CollectiveError::PeerFailed { rank: 3, op: "barrier", .. }) => {}
        other => panic!("expected PeerFailed naming rank 3, got {other:?}"),
    }
    for rank in 0..3 {
        let e = seen.lock().unwrap()[rank].clone();
        assert_eq!(e.and_then(|e| e.culprit()), Some(3));
    }
}

/// An `all_reduce_` or `all_reduce_into` whose peer never joins (absent until the
/// timeout, or gone) fails naming it. The waiting members keep their input values
/// (nobody wrote into them); an `out` lent to the failed call holds zeros.
#[test]
fn a_lending_all_reduce_without_a_peer_fails_naming_it_and_keeps_values() {
    for (absent, into) in [(true, false), (false, false), (true, true), (false, true)] {
        let timeout = Duration::from_millis(1000);
        let t0 = Instant::now();
        let r = spawn_with(SpawnConfig::new(3).timeout(timeout), move |ctx| {
            if ctx.rank() == 2 {
                if absent {
                    std::thread::sleep(Duration::from_millis(2500));
                }
                return Ok(());
            }
            let t = Tensor::full([1 << 15], ctx.rank() as f64, DType::F32, Device::Cpu)?;
            let out = Tensor::full([1 << 15], 9.0, DType::F32, Device::Cpu)?;
            let pg = ctx.world_group();
            let e = if into {
                pg.all_reduce_into(&t, ReduceOp::Sum, &out).unwrap_err()
            } else {
                pg.all_reduce_(&t, ReduceOp::Sum).unwrap_err()
            };
            assert_eq!(e.culprit(), Some(2), "{e}");
            assert_eq!(t.to_vec::<f32>()?, vec![ctx.rank() as f32; 1 << 15]);
            let left = if into { 0.0 } else { 9.0 };
            assert_eq!(out.to_vec::<f32>()?, vec![left; 1 << 15]);
            Err(e)
        });
        assert!(r.is_err_and(|e| e.culprit() == Some(2)));
        assert!(t0.elapsed() < Duration::from_secs(8), "took {:?}", t0.elapsed());
    }
}

/// Every rank calls `f` on its world group; all must fail with a Mismatch naming `culprit`.
fn expect_mismatch(
    world: usize,
    culprit: usize,
    f: impl Fn(&tpar_collectives::ProcessGroup, usize) -> Result<Tensor, CollectiveError>
        + Send
        + Sync
        + 'static,
) {
    let seen = Arc::new(Mutex::new(vec![None; world]));
    let seen2 = Arc::clone(&seen);
    let t0 = Instant::now();
    let r = spawn_with(SpawnConfig::new(world).timeout(LONG), move |ctx| {
        let out = f(&ctx.world_group(), ctx.rank()).map(|_| ());
        if let Err(e) = &out {
            seen2.lock().unwrap()[ctx.rank()] = Some(e.clone());
        }
        out
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "mismatch must not wait for the timeout");
    match &r {
        Err(CollectiveError::Mismatch { rank, .. }) => assert_eq!(*rank, culprit, "{r:?}"),
        other => panic!("expected a mismatch naming {culprit}, got {other:?}"),
    }
    for (rank, e) in seen.lock().unwrap().clone().into_iter().enumerate() {
        match e {
            Some(CollectiveError::Mismatch { rank: c, .. }) => assert_eq!(c, culprit),
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn different_collectives_are_a_mismatch() {
    expect_mismatch(4, 1, |pg, rank| {
        let t = x(&[4], DType::F32);
        if rank == 1 {
            pg.all_gather(&t, 0)
        } else {
            pg.all_reduce(&t, ReduceOp::Sum)
        }
    });
}

#[test]
fn different_reduce_ops_are_a_mismatch() {
    expect_mismatch(3, 0, |pg, rank| {
        let op = if rank == 0 { ReduceOp::Max } else { ReduceOp::Sum };
        pg.all_reduce(&x(&[4], DType::F32), op)
    });
}

#[test]
fn different_dtypes_are_a_mismatch() {
    expect_mismatch(4, 3, |pg, rank| {
        let dtype = if rank == 3 { DType::F64 } else { DType::F32 };
        pg.all_reduce(&x(&[4], dtype), ReduceOp::Sum)
    });
}

#[test]
fn different_shapes_are_a_mismatch_naming_the_minority() {
    expect_mismatch(3, 0, |pg, rank| {
        let n = if rank == 0 { 5 } else { 4 };
        pg.reduce_scatter(&x(&[n, 2], DType::BF16), 0, ReduceOp::Sum)
    });
    expect_mismatch(4, 2, |pg, rank| {
        // all_gather may differ along dim 0 but not along dim 1
        let d1 = if rank == 2 { 3 } else { 2 };
        pg.all_gather(&x(&[rank, d1], DType::F16), 0)
    });
    expect_mismatch(2, 1, |pg, rank| {
        let d = if rank == 1 { Device::Meta } else { Device::Cpu };
        pg.all_reduce(&Tensor::zeros([2], DType::F32, d).unwrap(), ReduceOp::Sum)
    });
}

#[test]
fn an_invalid_argument_on_one_rank_fails_all_ranks_at_once() {
    let seen = Arc::new(Mutex::new(vec![None; 3]));
    let seen2 = Arc::clone(&seen);
    let t0 = Instant::now();
    let r = spawn_with(SpawnConfig::new(3).timeout(LONG), move |ctx| {
        let src = if ctx.rank() == 2 { 7 } else { 0 };
        let out = ctx.world_group().broadcast(&x(&[2], DType::F32), src).map(|_| ());
        if let Err(e) = &out {
            seen2.lock().unwrap()[ctx.rank()] = Some(e.clone());
        }
        out
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(matches!(r, Err(CollectiveError::InvalidArgument { .. })), "{r:?}");
    for (rank, e) in seen.lock().unwrap().clone().into_iter().enumerate() {
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("src 7") || msg.contains("rank 2"), "rank {rank}: {msg}");
    }
}

#[test]
fn recv_times_out_or_fails_naming_the_sender() {
    let timeout = Duration::from_millis(300);
    let r = spawn_with(SpawnConfig::new(2).timeout(timeout), |ctx| {
        if ctx.rank() == 1 {
            // Back before spawn_with stops waiting (one timeout after rank 0's).
            std::thread::sleep(Duration::from_millis(450));
            return Ok(());
        }
        ctx.world_group().recv(1).map(|_| ())
    });
    match r {
        Err(CollectiveError::Timeout { waiting_for, op: "recv", .. }) => {
            assert_eq!(waiting_for, vec![1])
        }
        other => panic!("expected a recv timeout, got {other:?}"),
    }
    let t0 = Instant::now();
    let r = spawn(2, |ctx| -> Result<(), CollectiveError> {
        if ctx.rank() == 0 {
            ctx.world_group().recv(1)?;
        }
        Ok(())
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(r.unwrap_err().culprit(), Some(1));
}

#[test]
fn spawn_rejects_an_empty_world_and_accepts_boxed_errors() {
    let r = spawn(0, |_ctx| -> Result<(), CollectiveError> { Ok(()) });
    assert!(matches!(r, Err(CollectiveError::InvalidArgument { .. })));

    // `?` on tensor and collective errors with a boxed error type.
    let r = spawn(2, |ctx| -> Result<usize, Box<dyn Error + Send + Sync>> {
        let t = Tensor::from_vec(vec![1.0f32], [1])?;
        let s = ctx.world_group().all_reduce(&t, ReduceOp::Sum)?;
        if ctx.rank() == 1 {
            Tensor::from_vec(vec![1.0f32], [2])?; // wrong length: a TensorError
        }
        Ok(s.item()? as usize)
    });
    let e = r.unwrap_err();
    assert!(e.to_string().contains("from_storage"), "{e}");
}

#[test]
fn a_failed_world_wakes_hand_driven_threads() {
    let world = World::with_timeout(2, LONG).unwrap();
    let ctx0 = world.rank(0).unwrap();
    let t0 = Instant::now();
    let h = std::thread::spawn(move || ctx0.world_group().barrier());
    std::thread::sleep(Duration::from_millis(50));
    assert!(world.fail(1, "lost its GPU"));
    assert!(!world.fail(0, "second failure is not recorded"));
    let e = h.join().unwrap().unwrap_err();
    assert!(
        matches!(&e, CollectiveError::PeerFailed { rank: 1, why, .. } if why == "lost its GPU"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(world.failure(), Some((1, "lost its GPU".to_string())));
    assert!(world.rank(2).is_err());
}

#[test]
fn errors_convert_into_tensor_errors() {
    let e = CollectiveError::Timeout {
        op: "all_reduce",
        group: vec![0, 1],
        waiting_for: vec![1],
        after: Duration::from_secs(1),
        chain: Vec::new(),
    };
    let t: tpar_tensor::TensorError = e.into();
    assert!(t.to_string().contains("waiting for rank(s) [1]"), "{t}");
}
