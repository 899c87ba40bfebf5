//! Shared memory between the processes of one host, with processes simulated by threads
//! (every rank builds its own world, so every ring is created, offered, opened and
//! unlinked as between processes). Results are checked against serial references; ring
//! mappings are counted to show the rings were set up (or not), and `/dev/shm` is
//! checked for leftover files.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tpar_tensor::{DType, Device, Tensor};

use super::mesh::{Channel, Mesh};
use super::shm::{self, Ring, ShmConfig};
use super::tests::{assert_close, cat, input, narrow, reduce_ref, seen, T};
use crate::{chunk_range, CollectiveError, HashStore, ProcessGroup, ReduceOp, Store};

/// Rings of three 8 KiB slots, used from 4 KiB: payloads of tens of KiB wrap around them
/// several times.
const SMALL_RING: ShmConfig =
    ShmConfig { enabled: true, min_bytes: 4 << 10, slots: 3, slot_bytes: 8 << 10 };

const OFF: ShmConfig = ShmConfig { enabled: false, ..SMALL_RING };

/// Whether this machine can share memory between processes (else the tests check that
/// every pair falls back to its socket).
fn shm_here() -> bool {
    cfg!(target_os = "linux") && std::path::Path::new("/dev/shm").is_dir()
}

/// The job token of the world whose store is `store`.
fn token(store: &dyn Store) -> u64 {
    let v = store.get_timeout("tpar/tcp/token", T).unwrap();
    u64::from_le_bytes(v.as_slice().try_into().unwrap())
}

/// Mappings of the job's ring files held by this process.
fn ring_maps(token: u64) -> usize {
    let tag = format!("-{token:016x}-");
    shm::MAPPED.lock().unwrap().iter().filter(|(_, name)| name.contains(&tag)).count()
}

/// The job's ring files still named in `/dev/shm`.
fn ring_files(token: u64) -> Vec<String> {
    let tag = format!("-{token:016x}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.contains(&tag))
                .collect()
        })
        .unwrap_or_default()
}

/// What [`run_world_shm`] saw once every world was up.
struct Setup {
    /// Mappings of the job's rings in this process (every rank's).
    maps: usize,
    /// The job's ring files left in `/dev/shm`.
    files: Vec<String>,
    token: u64,
}

impl Setup {
    /// Checks that every directed pair has a ring, mapped by both sides (when this
    /// machine has shared memory and `cfg` turns it on), and that no file is left.
    fn check(&self, n: usize, cfg: ShmConfig) {
        let want = if cfg.enabled && shm_here() { 2 * n * (n - 1) } else { 0 };
        assert_eq!(self.maps, want, "ring mappings of a world of {n} ({cfg:?})");
        assert!(self.files.is_empty(), "files left in /dev/shm: {:?}", self.files);
        assert!(ring_files(self.token).is_empty());
    }
}

/// Runs `f(world)` on `n` threads, each with its own TCP world of `n` ranks and shared
/// memory as `cfg` says.
fn run_world_shm<R: Send + 'static>(
    n: usize,
    timeout: Duration,
    cfg: ShmConfig,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> (Vec<R>, Setup) {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let setup = Arc::new(Mutex::new(None));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (store, f, setup) = (store.clone(), f.clone(), setup.clone());
            std::thread::spawn(move || {
                let world = super::world_with(store.clone(), rank, n, timeout, cfg).unwrap();
                // Every world is up (and every handshake over) after the first barrier;
                // none is dropped before the second.
                world.barrier().unwrap();
                if rank == 0 {
                    let token = token(&*store);
                    let seen = Setup { maps: ring_maps(token), files: ring_files(token), token };
                    *setup.lock().unwrap() = Some(seen);
                }
                world.barrier().unwrap();
                f(world)
            })
        })
        .collect();
    let outs = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let setup = setup.lock().unwrap().take().unwrap();
    (outs, setup)
}

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F64, DType::I64];

/// Every collective on payloads of `cols` columns, checked against the serial reference
/// on this rank.
fn collectives_match_the_reference(pg: &ProcessGroup, cols: usize) {
    let (r, n) = (pg.rank(), pg.size());
    let rows = 4 * n + 1;
    for dtype in DTYPES {
        let what = |op: &str| format!("n={n} rank {r} {dtype}: {op}");
        let all = |dims: &[usize], c: u64| -> Vec<Tensor> {
            (0..n).map(|j| input(dims, dtype, j, c)).collect()
        };
        let full = all(&[rows, cols], 1);
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            if dtype == DType::I64 && op == ReduceOp::Avg {
                continue;
            }
            let got = pg.all_reduce(&full[r], op).unwrap();
            let exact = op != ReduceOp::Avg;
            assert_close(
                &seen(&got),
                &reduce_ref(&full, op),
                exact,
                &what(&format!("all_reduce {op}")),
            );
        }
        let got = pg.reduce_scatter(&full[r], 0, ReduceOp::Sum).unwrap();
        let want = narrow(&reduce_ref(&full, ReduceOp::Sum), 0, chunk_range(rows, n, r));
        assert_close(&seen(&got), &want, true, &what("reduce_scatter"));
        // Uneven torch.chunk shards gather back to the whole.
        let shards: Vec<Tensor> =
            (0..n).map(|j| input(&[chunk_range(rows, n, j).1, cols], dtype, j, 3)).collect();
        let got = pg.all_gather(&shards[r], 0).unwrap();
        assert_close(&seen(&got), &cat(&shards, 0), true, &what("all_gather"));
        let src = n - 1;
        let b = if r == src {
            full[r].clone()
        } else {
            Tensor::zeros([0], DType::I64, Device::Cpu).unwrap()
        };
        let got = pg.broadcast(&b, src).unwrap();
        assert_close(&seen(&got), &full[src], true, &what("broadcast"));
        let got = pg.all_to_all(&full[r], 0, 1).unwrap();
        let pieces: Vec<Tensor> =
            full.iter().map(|t| narrow(t, 0, chunk_range(rows, n, r))).collect();
        assert_close(&seen(&got), &cat(&pieces, 1), true, &what("all_to_all"));
        // Around the ring: every rank sends before it receives.
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        pg.send(&full[r], next).unwrap();
        let got = pg.recv(prev).unwrap();
        assert_close(&seen(&got), &full[prev], true, &what("send/recv"));
    }
    pg.barrier().unwrap();
}

#[test]
fn collectives_through_small_rings_match_the_serial_reference() {
    // 3000 columns: f32 payloads of 200-400 KB, frames of 24-200 KB, each several times
    // the 24 KiB ring. The same with shared memory off.
    for cfg in [SMALL_RING, OFF] {
        for n in [2usize, 3, 4] {
            let (_, setup) =
                run_world_shm(n, T, cfg, |pg| collectives_match_the_reference(&pg, 3000));
            setup.check(n, cfg);
        }
    }
}

#[test]
fn default_rings_carry_payloads_larger_than_the_ring() {
    // 12 MiB of f32 per rank: all_reduce frames of 3-6 MiB, above the 2 MiB ring.
    let elems = 3 << 20;
    for n in [2usize, 4] {
        let cfg = ShmConfig::default();
        let value = |r: usize, i: usize| (i % 7) as f32 + r as f32;
        let (outs, setup) = run_world_shm(n, T, cfg, move |pg| {
            let r = pg.rank();
            let t = Tensor::from_vec((0..elems).map(|i| value(r, i)).collect(), [elems]).unwrap();
            let sum = pg.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
            let ranks: f32 = (0..n).map(|j| j as f32).sum();
            let sum_ok = sum.len() == elems
                && sum.iter().enumerate().all(|(i, &v)| v == n as f32 * (i % 7) as f32 + ranks);
            let all = pg.all_gather(&t, 0).unwrap().to_vec::<f32>().unwrap();
            let gather_ok = all.len() == n * elems
                && all.iter().enumerate().all(|(k, &v)| v == value(k / elems, k % elems));
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            pg.send(&t, next).unwrap();
            let got = pg.recv(prev).unwrap().to_vec::<f32>().unwrap();
            let p2p_ok =
                got.len() == elems && got.iter().enumerate().all(|(i, &v)| v == value(prev, i));
            pg.barrier().unwrap();
            (sum_ok, gather_ok, p2p_ok)
        });
        setup.check(n, cfg);
        for (r, o) in outs.into_iter().enumerate() {
            assert_eq!(o, (true, true, true), "n={n} rank {r}: all_reduce, all_gather, send/recv");
        }
    }
}

#[test]
fn results_through_rings_equal_the_local_backend_bit_for_bit() {
    let n = 3;
    let calls = |pg: &ProcessGroup, r: usize| -> Vec<super::tests::Seen> {
        let mut out = Vec::new();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let mut rng = tpar_tensor::Rng::new(7 + r as u64);
            let v: Vec<f64> = (0..100_003).map(|_| rng.below(1000) as f64 / 7.0).collect();
            let t = Tensor::from_f64(&v, [100_003], dtype).unwrap();
            out.push(seen(&pg.all_reduce(&t, ReduceOp::Avg).unwrap()));
            out.push(seen(&pg.reduce_scatter(&t, 0, ReduceOp::Sum).unwrap()));
        }
        out
    };
    let (tcp, setup) = run_world_shm(n, T, SMALL_RING, move |pg| calls(&pg, pg.rank()));
    setup.check(n, SMALL_RING);
    let local = crate::spawn(n, move |ctx| -> crate::Result<_> {
        Ok(calls(&ctx.world_group(), ctx.rank()))
    })
    .unwrap();
    assert_eq!(tcp, local);
}

#[test]
fn a_slow_member_is_a_timeout_naming_it_with_rings() {
    let (outs, setup) = run_world_shm(3, Duration::from_millis(400), SMALL_RING, |pg| {
        let t = Tensor::ones([100_000], DType::F32, Device::Cpu).unwrap();
        if pg.rank() == 2 {
            std::thread::sleep(Duration::from_millis(900));
        }
        let start = Instant::now();
        let e = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
        (pg.rank(), e, start.elapsed())
    });
    setup.check(3, SMALL_RING);
    for (r, e, took) in &outs[..2] {
        assert!(
            matches!(e, CollectiveError::Timeout { waiting_for, .. } if waiting_for == &vec![2]),
            "rank {r}: {e}"
        );
        assert!(*took >= Duration::from_millis(350) && *took < Duration::from_secs(3), "{took:?}");
    }
}

#[test]
fn a_member_that_drops_its_world_between_ring_transfers_is_named() {
    // The two survivors keep their worlds until both have seen the failure: one that
    // returned first would close its own connections, and a slower peer could then
    // rightly name it instead of rank 2.
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (outs, setup) = run_world_shm(3, Duration::from_secs(30), SMALL_RING, move |pg| {
        let r = pg.rank();
        let t = Tensor::ones([200_000], DType::F32, Device::Cpu).unwrap();
        for _ in 0..3 {
            let s = pg.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
            assert!(s.iter().all(|&v| v == 3.0));
        }
        if r == 2 {
            drop(pg);
            return None;
        }
        let start = Instant::now();
        let e = loop {
            match pg.all_reduce(&t, ReduceOp::Sum) {
                Ok(_) if start.elapsed() < Duration::from_secs(5) => continue,
                Ok(_) => panic!("rank {r}: no error 5 s after rank 2 left"),
                Err(e) => break e,
            }
        };
        let took = start.elapsed();
        failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let until = Instant::now() + Duration::from_secs(5);
        while failed.load(std::sync::atomic::Ordering::SeqCst) < 2 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        Some((e, took))
    });
    setup.check(3, SMALL_RING);
    for (e, took) in outs.into_iter().flatten() {
        assert!(matches!(e, CollectiveError::PeerFailed { rank: 2, .. }), "{e}");
        assert!(took < Duration::from_secs(1), "{took:?}");
    }
}

/// Frames of `len` bytes numbered `k` from rank `r`.
fn frame(r: usize, k: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + k * 7 + r * 101) as u8).collect()
}

#[test]
fn rings_carry_frames_of_every_size_in_order() {
    // Around the slot size (8 KiB) and the ring (24 KiB), below and above the 4 KiB
    // threshold, and far above the ring; point-to-point frames interleaved. Both ranks
    // send everything before they take anything: readers drain the rings as they go.
    let sizes = [0usize, 1, 4095, 4096, 8191, 8192, 8193, 3 * 8192, 3 * 8192 + 1, 100_003, 1 << 20];
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let m = Mesh::connect(&*store, rank, 2, T, SMALL_RING).unwrap();
                let (peer, group) = (1 - rank, [0usize, 1]);
                for (k, &len) in sizes.iter().enumerate() {
                    m.post("test", &group, peer, 7, Channel::Collective, &frame(rank, k, len))
                        .unwrap();
                    m.post("test", &group, peer, 7, Channel::P2p, &frame(rank, k, 10)).unwrap();
                }
                let deadline = crate::remote::exec::Deadline::after(T);
                for (k, &len) in sizes.iter().enumerate() {
                    let c =
                        m.take("test", &group, &[peer], 7, Channel::Collective, deadline).unwrap();
                    assert_eq!(c[0], frame(peer, k, len), "frame {k} of {len} bytes");
                    let p = m.take("test", &group, &[peer], 7, Channel::P2p, deadline).unwrap();
                    assert_eq!(p[0], frame(peer, k, 10));
                    m.recycle(c);
                }
                (m.shm_peers(), m.shm_frames())
            })
        })
        .collect();
    let through_rings = sizes.iter().filter(|&&l| l >= SMALL_RING.min_bytes).count() as u64;
    for (rank, h) in handles.into_iter().enumerate() {
        let (peers, frames) = h.join().unwrap();
        if shm_here() {
            assert_eq!((peers, frames), (vec![1 - rank], through_rings), "rank {rank}");
        } else {
            assert_eq!((peers, frames), (vec![], 0), "rank {rank}");
        }
    }
    assert!(ring_files(token(&*store)).is_empty());
}

/// Rank 1 of a world of 2, played by hand: it shakes hands with rank 0, takes the ring
/// rank 0 offers, and then neither reads its socket nor frees a slot. Returns its socket
/// and the ring, with rank 0's mesh.
fn stuck_peer(timeout: Duration) -> (TcpStream, Ring, Mesh) {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    store.set("tpar/tcp/host/1", shm::host_id().as_bytes()).unwrap();
    store.set("tpar/tcp/addr/1", listener.local_addr().unwrap().to_string().as_bytes()).unwrap();
    let s = store.clone();
    let rank0 = std::thread::spawn(move || Mesh::connect(&*s, 0, 2, timeout, SMALL_RING).unwrap());
    let (mut sock, _) = listener.accept().unwrap();
    let mut hello = [0u8; 44];
    sock.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"tparTCP\x02");
    let mut answer = [0u8; 9];
    answer[0] = 1;
    answer[1..].copy_from_slice(&1u64.to_le_bytes());
    sock.write_all(&answer).unwrap();
    // No ring from rank 1; rank 0's ring taken.
    let mut none = [0u8; 128];
    none[..4].copy_from_slice(&0x7470_4f31u32.to_le_bytes());
    sock.write_all(&none).unwrap();
    let mut offer = [0u8; 128];
    sock.read_exact(&mut offer).unwrap();
    assert_eq!(offer[4..8], 1u32.to_le_bytes(), "rank 0 offers a ring");
    let nonce = u64::from_le_bytes(offer[8..16].try_into().unwrap());
    let name_len = u64::from_le_bytes(offer[16..24].try_into().unwrap()) as usize;
    let name = std::str::from_utf8(&offer[24..24 + name_len]).unwrap().to_string();
    let path = shm::file_path(&name).unwrap();
    let ring = Ring::open(&path, nonce).unwrap();
    std::fs::remove_file(&path).unwrap();
    let mut yes = [0u8; 8];
    yes[..4].copy_from_slice(&0x7470_5231u32.to_le_bytes());
    yes[4..].copy_from_slice(&1u32.to_le_bytes());
    sock.write_all(&yes).unwrap();
    let mut refused = [0u8; 8];
    sock.read_exact(&mut refused).unwrap();
    assert_eq!(refused[4..], 0u32.to_le_bytes(), "rank 0 refuses the ring never offered");
    let mesh = rank0.join().unwrap();
    assert_eq!(mesh.shm_peers(), vec![1]);
    assert!(ring_files(token(&*store)).is_empty());
    (sock, ring, mesh)
}

#[test]
fn a_sender_on_a_full_ring_sees_its_peer_go_at_once() {
    if !shm_here() {
        println!("no shared memory here: nothing to test");
        return;
    }
    let (sock, ring, mesh) = stuck_peer(Duration::from_secs(30));
    let sender = std::thread::spawn(move || {
        let start = Instant::now();
        let e = mesh.post("test", &[0, 1], 1, 7, Channel::Collective, &[1u8; 100_000]).unwrap_err();
        (e, start.elapsed())
    });
    // The ring fills (three slots), the sender sleeps on it, then rank 1 goes.
    let start = Instant::now();
    while ring.produced() < 3 && start.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(ring.produced(), 3, "three chunks wait in the ring");
    std::thread::sleep(Duration::from_millis(100));
    let gone = Instant::now();
    drop(sock);
    let (e, _) = sender.join().unwrap();
    let after = gone.elapsed();
    println!("the sender saw its peer go {after:?} after it went: {e}");
    assert!(matches!(e, CollectiveError::PeerFailed { rank: 1, .. }), "{e}");
    // At once: the write timeout (30 s) plays no part.
    assert!(after < Duration::from_secs(2), "{after:?}");
}

#[test]
fn a_sender_on_a_ring_nobody_frees_times_out_naming_the_peer() {
    if !shm_here() {
        println!("no shared memory here: nothing to test");
        return;
    }
    let (_sock, ring, mesh) = stuck_peer(Duration::from_millis(300));
    let start = Instant::now();
    let e = mesh.post("test", &[0, 1], 1, 7, Channel::Collective, &[1u8; 100_000]).unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(&e, CollectiveError::Timeout { waiting_for, .. } if waiting_for == &vec![1]),
        "{e}"
    );
    assert!(took >= Duration::from_millis(290) && took < Duration::from_secs(3), "{took:?}");
    assert_eq!(ring.produced(), 3);
    // The pair is unusable now: later sends fail at once, naming the peer.
    let later = mesh.post("test", &[0, 1], 1, 7, Channel::Collective, &[1u8; 10]).unwrap_err();
    assert!(matches!(later, CollectiveError::PeerFailed { rank: 1, .. }), "{later}");
}
