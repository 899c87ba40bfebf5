//! The `tpar-run` launcher end to end: real processes on loopback, their
//! environment and prefixed output, failure and signal handling, and a
//! rendezvous through the TCP store from the variables it sets.
#![cfg(unix)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use tpar::launch::EnvInit;

const LAUNCHER: &str = env!("CARGO_BIN_EXE_tpar-run");
/// Set for the processes the rendezvous tests launch: they run `rendezvous_child`.
const CHILD_ENV: &str = "TPAR_LAUNCHER_TEST_CHILD";

struct Out {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// Runs `tpar-run args...`, failing the test if it runs past `limit`.
fn launch(args: &[&str], limit: Duration) -> Out {
    let t0 = Instant::now();
    let mut child = Command::new(LAUNCHER)
        .args(args)
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tpar-run");
    let read_all = |mut r: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = read_all(Box::new(child.stdout.take().unwrap()));
    let err = read_all(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tpar-run {args:?} ran past {limit:?}; stderr:\n{}", err.join().unwrap());
        }
        thread::sleep(Duration::from_millis(10));
    };
    let elapsed = t0.elapsed();
    Out { status, stdout: out.join().unwrap(), stderr: err.join().unwrap(), elapsed }
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet), waiting up to 3 s.
fn gone(pid: u32) -> bool {
    if !std::path::Path::new("/proc/self").exists() {
        return true; // nothing to look at on this system
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(stat) => {
                // The state follows the parenthesised command name.
                if stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')) {
                    return true;
                }
            }
        }
        thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The pids that lines `[rank i] pid N` announce.
fn announced_pids(stdout: &str) -> Vec<u32> {
    stdout.lines().filter_map(|l| l.split(" pid ").nth(1)?.trim().parse().ok()).collect()
}

#[test]
fn every_rank_gets_its_environment_and_prefix() {
    let script = r#"echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT"; echo "err $RANK" >&2; printf "tail $RANK""#;
    let o = launch(&["--nproc-per-node", "3", "--", "sh", "-c", script], Duration::from_secs(20));
    assert!(o.status.success(), "{:?}\n{}", o.status, o.stderr);
    let mut ports = Vec::new();
    for i in 0..3 {
        let prefix = format!("[rank {i}] {i} 3 {i} 3 0 127.0.0.1 ");
        let line = o.stdout.lines().find(|l| l.starts_with(&prefix));
        let line = line.unwrap_or_else(|| panic!("no line {prefix:?} in\n{}", o.stdout));
        ports.push(line[prefix.len()..].parse::<u16>().unwrap());
        assert!(o.stdout.lines().any(|l| l == format!("[rank {i}] tail {i}")), "{}", o.stdout);
        assert!(o.stderr.lines().any(|l| l == format!("[rank {i}] err {i}")), "{}", o.stderr);
    }
    assert!(ports[0] != 0 && ports.iter().all(|p| *p == ports[0]), "{ports:?}");
    assert_eq!(o.stdout.lines().count(), 6, "{}", o.stdout);
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    // Rank 1 exits 3; the others start a grandchild and wait on it.
    let script = r#"if [ "$RANK" = 1 ]; then sleep 0.5; echo bye; exit 3; fi; sleep 30 & echo "pid $!"; wait"#;
    let o = launch(&["--nproc-per-node", "3", "--", "sh", "-c", script], Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(3), "{}", o.stderr);
    assert!(o.elapsed < Duration::from_secs(5), "took {:?}", o.elapsed);
    assert!(o.stderr.contains("rank 1 (local rank 1) exited with code 3"), "{}", o.stderr);
    assert!(o.stdout.contains("[rank 1] bye"), "{}", o.stdout);
    let pids = announced_pids(&o.stdout);
    assert_eq!(pids.len(), 2, "{}", o.stdout);
    for pid in pids {
        assert!(gone(pid), "grandchild {pid} of a stopped rank survived");
    }
}

#[test]
fn a_killed_rank_is_reported_with_its_signal() {
    let script = r#"if [ "$RANK" = 2 ]; then kill -9 $$; fi; exec sleep 30"#;
    let o = launch(
        &["--nproc-per-node", "3", "--grace-period", "0.2", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    assert_eq!(o.status.code(), Some(128 + 9), "{}", o.stderr);
    assert!(o.stderr.contains("rank 2 (local rank 2) was killed by signal 9"), "{}", o.stderr);
    assert!(o.elapsed < Duration::from_secs(5), "took {:?}", o.elapsed);
}

#[test]
fn a_signal_to_the_launcher_stops_every_rank() {
    let script = r#"sleep 30 & echo "pid $!"; wait"#;
    let mut child = Command::new(LAUNCHER)
        .args(["--nproc-per-node", "2", "--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut pids = Vec::new();
    while pids.len() < 2 {
        let line = rx.recv_timeout(Duration::from_secs(10)).expect("ranks started");
        pids.extend(announced_pids(&line));
    }
    let t0 = Instant::now();
    let sent = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(sent.success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "launcher ignored SIGTERM");
        thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("interrupted by signal 15"), "{stderr}");
    for pid in pids {
        assert!(gone(pid), "grandchild {pid} survived the launcher's SIGTERM");
    }
}

#[test]
fn help_and_bad_flags() {
    let o = launch(&["--help"], Duration::from_secs(10));
    assert!(o.status.success());
    assert!(o.stdout.contains("usage: tpar-run") && o.stdout.contains("--nproc-per-node"));
    let o = launch(&["--nproc-per-node", "2", "--bogus", "x"], Duration::from_secs(10));
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stderr.contains("unknown option --bogus"), "{}", o.stderr);
    assert!(o.stderr.contains("usage: tpar-run"), "{}", o.stderr);
    let o =
        launch(&["--nproc-per-node", "1", "--", "/nonexistent/program"], Duration::from_secs(10));
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stderr.contains("cannot start rank 0") && o.stderr.contains("/nonexistent/program"));
}

/// The arguments that make this test binary run only `rendezvous_child`.
fn child_args() -> Vec<String> {
    let exe = std::env::current_exe().unwrap().to_string_lossy().into_owned();
    ["--", &exe, "rendezvous_child", "--exact", "--nocapture", "--test-threads=1"]
        .map(String::from)
        .to_vec()
}

/// Checks the `RDV ...` lines the children print: one per rank of `ranks`.
fn check_rendezvous(o: &Out, ranks: std::ops::Range<usize>, world: usize) {
    assert!(o.status.success(), "{:?}\nstdout:\n{}\nstderr:\n{}", o.status, o.stdout, o.stderr);
    let sum: usize = (1..=world).map(|r| 100 * r).sum();
    for r in ranks {
        // The test harness may print `test rendezvous_child ... ` on the same line.
        let (prefix, want) =
            (format!("[rank {r}] "), format!("RDV rank={r} world={world} sum={sum} id_ok=true"));
        let found = o.stdout.lines().any(|l| l.starts_with(&prefix) && l.ends_with(&want));
        assert!(found, "no {want:?} from rank {r} in\n{}", o.stdout);
    }
}

#[test]
fn three_processes_rendezvous_through_the_store() {
    let mut args = vec!["--nproc-per-node".to_string(), "3".to_string()];
    args.extend(child_args());
    let o = launch(&args.iter().map(String::as_str).collect::<Vec<_>>(), Duration::from_secs(30));
    check_rendezvous(&o, 0..3, 3);
}

#[test]
fn two_nodes_of_two_rendezvous_through_the_store() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let port = port.to_string();
    let child = child_args();
    let node = |rank: &'static str| {
        let mut args: Vec<String> = [
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
        ]
        .map(String::from)
        .to_vec();
        args.extend(child.iter().cloned());
        thread::spawn(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            launch(&args, Duration::from_secs(30))
        })
    };
    // Node 1 first: its ranks must wait for node 0's store.
    let n1 = node("1");
    thread::sleep(Duration::from_millis(300));
    let n0 = node("0");
    check_rendezvous(&n0.join().unwrap(), 0..2, 4);
    check_rendezvous(&n1.join().unwrap(), 2..4, 4);
}

/// Runs `torchrun rdzv_args --nproc-per-node 2 --no-python <this test> rendezvous_child`
/// and checks both ranks met through tpar's store (joined via torchrun's agent store).
fn torchrun_rendezvous(mode: &str, rdzv_args: &[String]) {
    let t0 = Instant::now();
    let mut cmd = Command::new("torchrun");
    cmd.args(rdzv_args)
        .args(["--nproc-per-node", "2", "--no-python"])
        .args(&child_args()[1..])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null());
    let out = cmd.output().expect("run torchrun");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "torchrun {mode}: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let sum = 100 + 200;
    for r in 0..2 {
        let want = format!("RDV rank={r} world=2 sum={sum} id_ok=true");
        assert!(
            stdout.lines().any(|l| l.ends_with(&want)),
            "torchrun {mode}: no {want:?} in\n{stdout}\n{stderr}"
        );
    }
    assert!(stdout.contains("RDV agent_store=true"), "torchrun {mode}: {stdout}");
    println!("torchrun {mode}: both ranks met through the store in {:?}", t0.elapsed());
}

/// Whether `torchrun` is on PATH; prints why a test is skipped when it is not.
fn have_torchrun() -> bool {
    let ok = Command::new("torchrun")
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("skipped: torchrun is not on PATH (pip install torch to run this test)");
    }
    ok
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

#[test]
fn torchrun_standalone_rendezvous() {
    if have_torchrun() {
        torchrun_rendezvous("--standalone", &["--standalone".into()]);
    }
}

#[test]
fn torchrun_static_master_port_rendezvous() {
    if have_torchrun() {
        let args = ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", &free_port()];
        torchrun_rendezvous("--master-port", &args.map(String::from));
    }
}

#[test]
fn torchrun_c10d_rendezvous() {
    if have_torchrun() {
        let endpoint = format!("localhost:{}", free_port());
        let args = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint];
        torchrun_rendezvous("--rdzv-backend c10d", &args.map(String::from));
    }
}

/// Not a test of its own: what each launched process runs (a no-op otherwise).
#[test]
fn rendezvous_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let env = EnvInit::from_env().expect("launcher environment");
    let store = env.store(Duration::from_secs(20)).expect("connect to the store");
    assert_eq!(store.world_size(), env.world_size);
    // What the NCCL backend does: rank 0 publishes the unique id.
    let id: Vec<u8> = (0..128).map(|i| (i * 7 % 251) as u8).collect();
    if env.rank == 0 {
        store.set("nccl_id/world", &id).unwrap();
    }
    let got = store.get("nccl_id/world").unwrap();
    store
        .set(&format!("value/{}", env.rank), &(100 * (env.rank as u64 + 1)).to_le_bytes())
        .unwrap();
    let sum: u64 = (0..env.world_size)
        .map(|r| u64::from_le_bytes(store.get(&format!("value/{r}")).unwrap().try_into().unwrap()))
        .sum();
    store.add("arrived", 1).unwrap();
    store.barrier("done").unwrap();
    assert_eq!(store.get("arrived").unwrap(), env.world_size.to_string().into_bytes());
    println!("RDV agent_store={}", env.agent_store);
    println!("RDV rank={} world={} sum={sum} id_ok={}", env.rank, env.world_size, got == id);
    // Rank 0 hosts the store: nobody may leave before everyone has read.
    store.barrier("exit").unwrap();
}
