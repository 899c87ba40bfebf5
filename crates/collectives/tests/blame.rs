//! Who is blamed when a rank is slow or stuck: `spawn` and `spawn_with` return within the
//! timeout even when a rank never comes back, and they name the rank that held the others
//! up, never a rank that was only waiting for it (directly, or through ranks that were
//! themselves waiting). Repeated, since the order in which the waiting ranks time out
//! varies from run to run.

use std::time::{Duration, Instant};

use tpar_collectives::{spawn_with, CollectiveError, RankThreads, ReduceOp, SpawnConfig, WaitLink};
use tpar_tensor::{DType, Device, Tensor};

const TIMEOUT: Duration = Duration::from_millis(100);

fn x() -> Tensor {
    Tensor::ones([8], DType::F32, Device::Cpu).unwrap()
}

fn config(world: usize) -> SpawnConfig {
    SpawnConfig::new(world).timeout(TIMEOUT).threads(RankThreads::Shared)
}

#[test]
fn spawn_with_returns_within_the_timeout_when_a_rank_is_stuck() {
    let t0 = Instant::now();
    let err = spawn_with(config(3), |ctx| -> Result<(), CollectiveError> {
        match ctx.rank() {
            1 => Err(CollectiveError::InvalidArgument { op: "train", why: "bad batch".into() }),
            // Stuck in user code, never in a collective.
            2 => {
                std::thread::sleep(Duration::from_secs(60));
                Ok(())
            }
            _ => ctx.world_group().barrier(),
        }
    })
    .unwrap_err();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    let m = err.to_string();
    assert!(
        matches!(&err, CollectiveError::Stuck { rank: 1, running, .. } if running == &[2]),
        "{m}"
    );
    assert!(m.contains("rank 1 failed") && m.contains("bad batch"), "{m}");
    assert!(m.contains("[2] still running"), "{m}");
}

#[test]
fn a_rank_stuck_before_a_collective_is_named_by_spawn_with() {
    // Nobody fails on its own: ranks 0 and 1 time out in the barrier waiting for rank 2,
    // which never comes; spawn_with returns one timeout later blaming rank 2.
    let t0 = Instant::now();
    let err = spawn_with(config(3), |ctx| -> Result<(), CollectiveError> {
        if ctx.rank() == 2 {
            std::thread::sleep(Duration::from_secs(60));
        }
        ctx.world_group().barrier()
    })
    .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "took {:?}", t0.elapsed());
    let m = err.to_string();
    assert!(
        matches!(&err, CollectiveError::Stuck { rank: 2, running, .. } if running == &[2]),
        "{m}"
    );
    assert!(m.contains("barrier") && m.contains("waiting for rank(s) [2]"), "{m}");
}

/// A pipeline of 4 ranks, each receiving from the one before it: rank 0 is slow (it
/// sleeps `slow`, past the timeout) before it sends; rank 1 computes a little before it
/// waits, so ranks 2 and 3 start waiting (and time out) before rank 1 does. Returns
/// spawn_with's error.
fn slow_pipeline(slow: Duration) -> CollectiveError {
    spawn_with(config(4), move |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let rank = ctx.rank();
        match rank {
            0 => {
                std::thread::sleep(slow);
                pg.send(&x(), 1)?;
            }
            _ => {
                if rank == 1 {
                    std::thread::sleep(TIMEOUT / 4);
                }
                let t = pg.recv(rank - 1)?;
                if rank < 3 {
                    pg.send(&t, rank + 1)?;
                }
            }
        }
        Ok(())
    })
    .unwrap_err()
}

#[test]
fn a_slow_pipeline_stage_is_blamed_not_the_stages_waiting_for_it() {
    for i in 0..24 {
        // Alternately: rank 0 done soon after the others' timeout (every rank finishes),
        // and rank 0 still asleep one timeout after it (spawn_with returns `Stuck`).
        let slow = if i % 2 == 0 { TIMEOUT * 13 / 10 } else { TIMEOUT * 4 };
        let err = slow_pipeline(slow);
        let m = err.to_string();
        assert_eq!(err.culprit(), Some(0), "run {i}: {m}");
        assert!(m.contains("for rank(s) [0]"), "run {i}: {m}");
        if let CollectiveError::Stuck { rank, running, .. } = &err {
            assert_eq!((*rank, running.as_slice()), (0, &[0][..]), "run {i}: {m}");
        }
    }
}

#[test]
fn a_slow_rank_in_a_collective_is_blamed_not_the_ranks_waiting_for_it() {
    for i in 0..12 {
        let slow = if i % 2 == 0 { TIMEOUT * 13 / 10 } else { TIMEOUT * 4 };
        let err = spawn_with(config(3), move |ctx| -> Result<(), CollectiveError> {
            if ctx.rank() == 2 {
                std::thread::sleep(slow);
            }
            ctx.world_group().all_reduce(&x(), ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap_err();
        let m = err.to_string();
        assert_eq!(err.culprit(), Some(2), "run {i}: {m}");
        assert!(m.contains("rank(s) [2]"), "run {i}: {m}");
    }
}

#[test]
fn a_timeout_names_the_chain_of_waits_behind_it() {
    // Rank 3 waits for rank 2, which waits for rank 1, which sleeps: rank 3's own timeout
    // (it starts waiting first) says so.
    let err = spawn_with(config(4), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        match ctx.rank() {
            1 => {
                std::thread::sleep(TIMEOUT * 3);
                pg.send(&x(), 2)?;
            }
            2 => {
                std::thread::sleep(TIMEOUT / 4);
                let t = pg.recv(1)?;
                pg.send(&t, 3)?;
            }
            3 => {
                pg.recv(2)?;
            }
            _ => {}
        }
        Ok(())
    })
    .unwrap_err();
    assert_eq!(err.culprit(), Some(1), "{err}");
    // Rank 3's view, rebuilt from the error type: its timeout names the chain.
    let e = CollectiveError::Timeout {
        op: "recv",
        group: vec![0, 1, 2, 3],
        waiting_for: vec![2],
        after: TIMEOUT,
        chain: vec![WaitLink {
            rank: 2,
            op: "recv",
            group: vec![0, 1, 2, 3],
            waiting_for: vec![1],
        }],
    };
    assert_eq!(e.culprit(), Some(1));
    let m = e.to_string();
    assert!(
        m.contains("waiting for rank(s) [2]; rank 2 was itself waiting in recv")
            && m.contains("for rank(s) [1] (rank 1 held them up, outside any collective)"),
        "{m}"
    );
}
