//! The rendezvous store names what went wrong with the ranks of a job, at once rather
//! than after its timeout:
//!
//! - a rank whose process is killed (its connection closes without the goodbye a dropped
//!   store sends): every rank waiting in the store gets an error naming it, in a job that
//!   uses the store alone (no collective backend);
//! - ranks started with different `WORLD_SIZE`s, or two processes with one `RANK`: the
//!   `tcp` backend fails on every rank before any collective, naming the two world sizes
//!   or the rank claimed twice.
//!
//! The killed rank is a child process: this test binary re-executed, running the `child`
//! test (selected by `TPAR_STORE_CHILD`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tpar_collectives::{CollectiveError, ProcessGroup, Store, StoreError};
use tpar_launch::{RendezvousError, TcpStore};

const CHILD_ENV: &str = "TPAR_STORE_CHILD";
/// The store's timeout: every failure here must be reported well before it.
const TIMEOUT: Duration = Duration::from_secs(20);

/// In a child: joins the store at `TPAR_STORE_CHILD` as rank 1 of 3, says so, and sleeps
/// until it is killed. Elsewhere: nothing.
#[test]
fn child() {
    let Ok(addr) = std::env::var(CHILD_ENV) else { return };
    let store = TcpStore::client(&addr, TIMEOUT).unwrap();
    store.join(1, 3).unwrap();
    println!("joined");
    thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_killed_rank_is_named_by_the_store_at_once() {
    let host = TcpStore::server("127.0.0.1:0", 3, TIMEOUT).unwrap();
    host.join(0, 3).unwrap();
    let addr = host.local_addr().unwrap().to_string();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, &addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    assert!(
        out.lines().map_while(Result::ok).any(|l| l.ends_with("joined")),
        "the child never joined"
    );
    // Rank 2 (a thread here) and rank 0 wait for a key nobody will set.
    let rank2 = {
        let addr = addr.clone();
        thread::spawn(move || {
            let store = TcpStore::client(&addr, TIMEOUT).unwrap();
            store.join(2, 3).unwrap();
            println!("rank 2 waits");
            let t0 = Instant::now();
            (store.get("never"), t0.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    child.kill().unwrap(); // SIGKILL: no goodbye
    child.wait().unwrap();
    let host_wait = host.wait(&["never"], TIMEOUT);
    let (r2, _) = rank2.join().unwrap();
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(5), "reported {took:?} after the kill");
    for (who, e) in [("rank 0", host_wait.unwrap_err()), ("rank 2", r2.unwrap_err())] {
        let m = e.to_string();
        assert!(matches!(e, RendezvousError::RankGone { rank: 1, .. }), "{who}: {m}");
        assert!(m.contains("rank 1") && m.contains("died"), "{who}: {m}");
        // Through the Store trait the backends use, the rank is kept.
        match StoreError::from(e) {
            StoreError::RankGone { rank: 1, .. } => {}
            other => panic!("{who}: expected StoreError::RankGone naming rank 1, got {other}"),
        }
    }
    // A later wait fails the same way, at once.
    let t0 = Instant::now();
    let e = host.get("other").unwrap_err();
    assert!(matches!(e, RendezvousError::RankGone { rank: 1, .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_dropped_store_is_not_a_dead_rank() {
    let host = TcpStore::server("127.0.0.1:0", 2, TIMEOUT).unwrap();
    host.join(0, 2).unwrap();
    let addr = host.local_addr().unwrap().to_string();
    let client = TcpStore::client(&addr, TIMEOUT).unwrap();
    client.join(1, 2).unwrap();
    client.set("k", b"v").unwrap();
    drop(client);
    // Rank 0 still waits out its timeout for a key nobody set: nobody died.
    let e = host.get_timeout("never", Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, RendezvousError::Timeout { .. }), "{e}");
    assert_eq!(host.get("k").unwrap(), b"v");
}

/// Runs `tcp_world` on ranks (threads) with the given `(RANK, WORLD_SIZE)`s, the first
/// hosting the store (with its world size); returns each one's error and how long the
/// slowest took.
fn tcp_worlds(ranks: &[(usize, usize)]) -> (Vec<CollectiveError>, Duration) {
    let (rank0, world0) = ranks[0];
    let host = TcpStore::server("127.0.0.1:0", world0, TIMEOUT).unwrap();
    let addr = host.local_addr().unwrap().to_string();
    let t0 = Instant::now();
    let mut host = Some(host);
    let handles: Vec<_> = ranks
        .iter()
        .map(|&(rank, world)| {
            let store = match host.take() {
                Some(h) => h,
                None => TcpStore::client(&addr, TIMEOUT).unwrap(),
            };
            let _ = rank0;
            thread::spawn(move || {
                let store: Arc<dyn Store> = Arc::new(store);
                let r = ProcessGroup::tcp_world(Arc::clone(&store), rank, world, TIMEOUT);
                // Keep the host's store up until every rank has its answer.
                thread::sleep(Duration::from_millis(500));
                r.map(|_| ())
            })
        })
        .collect();
    let errors = handles.into_iter().map(|h| h.join().unwrap().unwrap_err()).collect();
    (errors, t0.elapsed())
}

#[test]
fn a_world_size_mismatch_is_reported_by_every_rank() {
    // Rank 2 was started with WORLD_SIZE=4; the others (and the store's host) with 3.
    let (errors, took) = tcp_worlds(&[(0, 3), (1, 3), (2, 4)]);
    assert!(took < Duration::from_secs(8), "took {took:?}");
    for (rank, e) in errors.iter().enumerate() {
        let m = e.to_string();
        println!("rank {rank}: {m}");
        assert!(
            m.contains("world sizes differ")
                && m.contains("WORLD_SIZE=4")
                && m.contains("WORLD_SIZE=3"),
            "rank {rank}: {m}"
        );
        assert!(!m.contains("timed out"), "rank {rank}: {m}");
    }
    // And the other way round: the host is the one with the odd world size.
    let (errors, took) = tcp_worlds(&[(0, 2), (1, 3), (2, 3)]);
    assert!(took < Duration::from_secs(8), "took {took:?}");
    for (rank, e) in errors.iter().enumerate() {
        let m = e.to_string();
        assert!(m.contains("WORLD_SIZE=2") && m.contains("WORLD_SIZE=3"), "rank {rank}: {m}");
    }
}

#[test]
fn a_duplicate_rank_is_reported_by_every_rank() {
    // Two processes with RANK=1 (and none with 2).
    let (errors, took) = tcp_worlds(&[(0, 3), (1, 3), (1, 3)]);
    assert!(took < Duration::from_secs(8), "took {took:?}");
    for (i, e) in errors.iter().enumerate() {
        let m = e.to_string();
        println!("process {i}: {m}");
        assert!(m.contains("RANK=1 is claimed by two processes"), "process {i}: {m}");
        assert!(!m.contains("timed out"), "process {i}: {m}");
    }
}
