//! The `tcp` backend across real processes: this test binary re-executes itself once per
//! rank (the `child` test, selected by `TPAR_TCP_CHILD`) with a torchrun-style
//! environment, and every child builds its world with
//! `init_process_group_with("tcp", ..)` through the TCP store rank 0 hosts.
//!
//! - `collectives`: worlds of 2, 3 and 4 (and 4 again with `TPAR_TCP_SHM=0`) run
//!   all_reduce, all_gather (uneven shards), reduce_scatter and broadcast on several
//!   dtypes, then the same and send/recv on 12 MiB payloads (above the shared-memory
//!   threshold and larger than a ring, so they stream through it in chunks), and compare
//!   with serial references. Each child counts the shared-memory rings it has mapped: one
//!   to and one from every peer, or none with shared memory off.
//! - `kill`: world 3 runs all_reduce in a loop (of 4 KiB, through the sockets, or of
//!   16 MiB, through the rings); the test kills rank 1 with SIGKILL, and both survivors
//!   must report an error naming rank 1 well within the timeout. The detection time (from
//!   the kill to each survivor's report) is printed.
//!
//! After every run no ring file of the children is left in `/dev/shm`.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tpar_collectives::tcp::{TCP_SHM_ENV, TCP_SHM_MIN_ENV};
use tpar_collectives::{chunk_range, CollectiveError, ProcessGroup, ReduceOp};
use tpar_tensor::{DType, Device, Tensor};

const CHILD_ENV: &str = "TPAR_TCP_CHILD";
/// The collective timeout of the children: a failure must be seen well before it.
const TIMEOUT: Duration = Duration::from_secs(10);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap()
}

/// Starts `n` children in `mode`, with shared memory on or off and their output piped.
fn start(n: usize, mode: &str, shm: bool) -> Vec<Child> {
    let exe = std::env::current_exe().unwrap();
    let port = free_port().to_string();
    (0..n)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
                .env(CHILD_ENV, mode)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env_remove("TPAR_BACKEND")
                .env(TCP_SHM_ENV, if shm { "1" } else { "0" })
                .env_remove(TCP_SHM_MIN_ENV)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Every line the children print, as `(rank, line, when)`, through one channel.
fn lines(children: &mut [Child]) -> mpsc::Receiver<(usize, String, Instant)> {
    let (tx, rx) = mpsc::channel();
    for (rank, c) in children.iter_mut().enumerate() {
        let out = c.stdout.take().unwrap();
        let err = c.stderr.take().unwrap();
        for pipe in [Box::new(out) as Box<dyn std::io::Read + Send>, Box::new(err)] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send((rank, line, Instant::now()));
                }
            });
        }
    }
    rx
}

/// Waits for every child, with a limit; kills the ones still running after it.
fn wait_all(children: &mut [Child], limit: Duration) -> Vec<Option<i32>> {
    let end = Instant::now() + limit;
    children
        .iter_mut()
        .map(|c| loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s.code();
            }
            if Instant::now() >= end {
                let _ = c.kill();
                let _ = c.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        })
        .collect()
}

/// Whether processes of this machine can share memory.
fn shm_here() -> bool {
    cfg!(target_os = "linux") && std::path::Path::new("/dev/shm").is_dir()
}

/// The shared-memory rings this process has mapped. `/proc/self/maps` is not read in one
/// piece, so a mapping made or removed meanwhile (by the allocator, on another thread) can
/// hide a line: the count is read until it repeats.
fn rings_mapped() -> usize {
    let count = || {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        maps.lines().filter(|l| l.contains("/dev/shm/tpar-tcp-")).count()
    };
    let mut last = count();
    for _ in 0..20 {
        let now = count();
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// Ring files of these processes still named in `/dev/shm`.
fn files_left(pids: &[u32]) -> Vec<String> {
    let prefixes: Vec<String> = pids.iter().map(|p| format!("tpar-tcp-{p}-")).collect();
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
                .collect()
        })
        .unwrap_or_default()
}

fn input(dims: &[usize], dtype: DType, rank: usize, case: usize) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|i| ((i * 7 + rank * 13 + case * 5) % 11) as f64 - 5.0).collect();
    Tensor::from_f64(&v, dims.to_vec(), dtype).unwrap()
}

fn collectives_child(world: &ProcessGroup) {
    let (r, n) = (world.rank(), world.size());
    // Counted before any large buffer comes and goes.
    world.barrier().unwrap();
    let rings = rings_mapped();
    let rows = 3 * n + 1;
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::I64] {
        let full = input(&[rows, 3], dtype, r, 1);
        let all: Vec<Vec<f64>> =
            (0..n).map(|j| input(&[rows, 3], dtype, j, 1).to_vec_f64().unwrap()).collect();
        let sum: Vec<f64> = (0..rows * 3).map(|i| all.iter().map(|v| v[i]).sum()).collect();
        let max: Vec<f64> =
            (0..rows * 3).map(|i| all.iter().map(|v| v[i]).fold(f64::MIN, f64::max)).collect();
        assert_eq!(world.all_reduce(&full, ReduceOp::Sum).unwrap().to_vec_f64().unwrap(), sum);
        assert_eq!(world.all_reduce(&full, ReduceOp::Max).unwrap().to_vec_f64().unwrap(), max);
        let (start, len) = chunk_range(rows, n, r);
        let rs = world.reduce_scatter(&full, 0, ReduceOp::Sum).unwrap();
        assert_eq!(rs.dims(), &[len, 3]);
        assert_eq!(rs.to_vec_f64().unwrap(), sum[start * 3..(start + len) * 3].to_vec());
        // Uneven shards along dim 0 gather back to the whole.
        let shard = |j: usize| input(&[chunk_range(rows, n, j).1, 3], dtype, j, 2);
        let gathered = world.all_gather(&shard(r), 0).unwrap();
        let want: Vec<f64> = (0..n).flat_map(|j| shard(j).to_vec_f64().unwrap()).collect();
        assert_eq!((gathered.dims(), gathered.to_vec_f64().unwrap()), (&[rows, 3][..], want));
        let b = world.broadcast(&input(&[2, 2], dtype, r, 3), n - 1).unwrap();
        assert_eq!(b.to_vec_f64().unwrap(), input(&[2, 2], dtype, n - 1, 3).to_vec_f64().unwrap());
    }
    let avg = world
        .all_reduce(&Tensor::full([4], r as f64, DType::F32, Device::Cpu).unwrap(), ReduceOp::Avg)
        .unwrap();
    assert_eq!(avg.to_vec::<f32>().unwrap(), vec![(n - 1) as f32 / 2.0; 4]);
    large_collectives(world);
    world.barrier().unwrap();
    println!("rank {r}: {rings} rings mapped");
    println!("rank {r}: collectives match the serial reference");
}

/// 12 MiB of f32 per rank (frames of 3-6 MiB, larger than a 2 MiB ring): all_reduce,
/// reduce_scatter, all_gather, broadcast and send/recv against closed forms.
fn large_collectives(world: &ProcessGroup) {
    let (r, n) = (world.rank(), world.size());
    let elems = 3 << 20;
    let value = |rank: usize, i: usize| ((i * 7 + rank * 13) % 11) as f32 - 5.0;
    let mine = Tensor::from_vec((0..elems).map(|i| value(r, i)).collect(), [elems]).unwrap();
    let sum = |i: usize| (0..n).map(|j| value(j, i)).sum::<f32>();
    let got = world.all_reduce(&mine, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
    assert!(got.len() == elems && got.iter().enumerate().all(|(i, &v)| v == sum(i)), "all_reduce");
    let max = |i: usize| (0..n).map(|j| value(j, i)).fold(f32::MIN, f32::max);
    let got = world.all_reduce(&mine, ReduceOp::Max).unwrap().to_vec::<f32>().unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == max(i)), "all_reduce max");
    let inplace = Tensor::from_vec((0..elems).map(|i| value(r, i)).collect(), [elems]).unwrap();
    world.all_reduce_(&inplace, ReduceOp::Sum).unwrap();
    let got = inplace.to_vec::<f32>().unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == sum(i)), "all_reduce_");
    let (start, len) = chunk_range(elems, n, r);
    let got = world.reduce_scatter(&mine, 0, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
    assert!(got.len() == len && got.iter().enumerate().all(|(i, &v)| v == sum(start + i)));
    let got = world.all_gather(&mine, 0).unwrap().to_vec::<f32>().unwrap();
    assert!(got.len() == n * elems);
    assert!(got.iter().enumerate().all(|(k, &v)| v == value(k / elems, k % elems)), "all_gather");
    let got = world.broadcast(&mine, n - 1).unwrap().to_vec::<f32>().unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == value(n - 1, i)), "broadcast");
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    world.send(&mine, next).unwrap();
    let got = world.recv(prev).unwrap().to_vec::<f32>().unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == value(prev, i)), "send/recv");
}

fn kill_child(world: &ProcessGroup, elems: usize) {
    let r = world.rank();
    world.barrier().unwrap();
    println!("READY {r} rings={}", rings_mapped());
    let t = Tensor::ones([elems], DType::F32, Device::Cpu).unwrap();
    let start = Instant::now();
    loop {
        match world.all_reduce(&t, ReduceOp::Sum) {
            Ok(_) => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => {
                let kind = match &e {
                    CollectiveError::PeerFailed { .. } => "PeerFailed",
                    CollectiveError::Timeout { .. } => "Timeout",
                    _ => "other",
                };
                println!("FAILED {r} culprit={:?} kind={kind}: {e}", e.culprit());
                // Stay a moment, so the other survivor sees rank 1 go, not this process.
                std::thread::sleep(Duration::from_millis(500));
                std::process::exit(if e.culprit() == Some(1) { 0 } else { 3 });
            }
        }
        if start.elapsed() > 2 * TIMEOUT {
            println!("FAILED {r}: no error after {:?}", start.elapsed());
            std::process::exit(4);
        }
    }
}

/// The body of a child process (does nothing when run as a plain test).
#[test]
fn child() {
    let Ok(mode) = std::env::var(CHILD_ENV) else { return };
    let world = tpar_launch::init_process_group_with("tcp", TIMEOUT).unwrap();
    assert_eq!(world.backend_name(), "tcp");
    match mode.as_str() {
        "collectives" => collectives_child(&world),
        "kill" => kill_child(&world, 1024),
        "kill_large" => kill_child(&world, 4 << 20),
        other => panic!("unknown child mode {other}"),
    }
}

fn run_collectives(n: usize, shm: bool) {
    let mut children = start(n, "collectives", shm);
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let rx = lines(&mut children);
    let codes = wait_all(&mut children, Duration::from_secs(60));
    let out: Vec<String> = rx.try_iter().map(|(r, l, _)| format!("[{r}] {l}")).collect();
    println!("{}", out.join("\n"));
    assert!(codes.iter().all(|c| *c == Some(0)), "world {n}: exit codes {codes:?}");
    let rings = if shm && shm_here() { 2 * (n - 1) } else { 0 };
    for r in 0..n {
        let has = |s: &str| out.iter().any(|l| l.starts_with(&format!("[{r}]")) && l.contains(s));
        let ok = format!("rank {r}: collectives match the serial reference");
        assert!(has(&ok), "world {n}: rank {r} did not finish");
        let mapped = format!("rank {r}: {rings} rings mapped");
        assert!(has(&mapped), "world {n} (shm {shm}): rank {r} should have {rings} rings");
    }
    assert_eq!(files_left(&pids), Vec::<String>::new(), "ring files left in /dev/shm");
}

#[test]
fn tcp_world_of_processes_matches_the_serial_reference() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    run_collectives(2, true);
    run_collectives(3, true);
    run_collectives(4, true);
    run_collectives(4, false);
}

#[test]
fn a_killed_process_is_named_by_every_survivor() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    kill_one("kill");
}

#[test]
fn a_process_killed_mid_ring_transfer_is_named_by_every_survivor() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    kill_one("kill_large");
}

/// Runs a world of 3 children in `mode`, kills rank 1 once all are looping, and checks
/// that both survivors name it, soon.
fn kill_one(mode: &str) {
    let n = 3;
    let victim = 1;
    let mut children = start(n, mode, true);
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let rx = lines(&mut children);
    let mut log = Vec::new();
    let mut ready = 0;
    let until = Instant::now() + Duration::from_secs(30);
    while ready < n {
        let left = until.saturating_duration_since(Instant::now());
        let Ok((r, l, _)) = rx.recv_timeout(left) else {
            wait_all(&mut children, Duration::ZERO);
            panic!("children not ready:\n{}", log.join("\n"));
        };
        if l.contains("READY") {
            ready += 1;
        }
        log.push(format!("[{r}] {l}"));
    }
    // Let the survivors be mid-loop, then kill the victim.
    std::thread::sleep(Duration::from_millis(200));
    let killed = Instant::now();
    children[victim].kill().unwrap();
    let mut detected = Vec::new();
    while detected.len() < n - 1 {
        let left = (killed + 2 * TIMEOUT).saturating_duration_since(Instant::now());
        let Ok((r, l, when)) = rx.recv_timeout(left) else { break };
        log.push(format!("[{r}] {l}"));
        if l.contains("FAILED") && r != victim {
            detected.push((r, when.duration_since(killed), l));
        }
    }
    let codes = wait_all(&mut children, Duration::from_secs(10));
    println!("{}", log.join("\n"));
    for (r, after, line) in &detected {
        println!("rank {r} reported the death of rank {victim} {after:?} after the kill: {line}");
    }
    assert_eq!(detected.len(), n - 1, "every survivor reports:\n{}", log.join("\n"));
    for (r, after, line) in &detected {
        assert!(
            line.contains("culprit=Some(1)") && line.contains("kind=PeerFailed"),
            "rank {r}: {line}"
        );
        assert!(*after < TIMEOUT / 2, "rank {r} took {after:?}");
    }
    for (r, c) in codes.iter().enumerate() {
        if r != victim {
            assert_eq!(*c, Some(0), "survivor {r} exit code");
        }
    }
    if shm_here() {
        let rings = format!("rings={}", 2 * (n - 1));
        assert!(log.iter().filter(|l| l.contains("READY") && l.contains(&rings)).count() == n);
    }
    assert_eq!(files_left(&pids), Vec::<String>::new(), "ring files left in /dev/shm");
}
