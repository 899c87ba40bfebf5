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
    launch_with(args, limit, |_| {})
}

/// [`launch`], with the launcher's environment adjusted by `env`.
fn launch_with(args: &[&str], limit: Duration, env: impl FnOnce(&mut Command)) -> Out {
    let t0 = Instant::now();
    let mut cmd = Command::new(LAUNCHER);
    env(&mut cmd);
    let mut child = cmd
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
    // Rank 2 prints the time (ns since the epoch) and kills itself with SIGKILL.
    let script = r#"if [ "$RANK" = 2 ]; then sleep 0.3; echo "dying $(date +%s%N)"; kill -9 $$; fi; exec sleep 30"#;
    let o = launch(
        &["--nproc-per-node", "3", "--grace-period", "0.2", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    let exited = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    assert_eq!(o.status.code(), Some(128 + 9), "{}", o.stderr);
    assert!(
        o.stderr.contains("rank 2 (local rank 2) was killed by signal 9 (SIGKILL)"),
        "{}",
        o.stderr
    );
    assert!(o.elapsed < Duration::from_secs(5), "took {:?}", o.elapsed);
    let died = o
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("[rank 2] dying ")?.trim().parse::<u128>().ok());
    if let Some(died) = died {
        let ms = (exited.as_nanos().saturating_sub(died)) as f64 / 1e6;
        println!(
            "rank 2 died by SIGKILL; the launcher stopped the others and exited {ms:.0} ms later"
        );
        assert!(ms < 3000.0, "{ms} ms from death to exit");
    }
}

#[test]
fn every_rank_gets_torchruns_variables() {
    let script = r#"echo "$GROUP_WORLD_SIZE $ROLE_NAME $ROLE_RANK $ROLE_WORLD_SIZE $OMP_NUM_THREADS $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_RUN_ID x${TORCHELASTIC_USE_AGENT_STORE}x""#;
    let args = ["--nproc-per-node", "2", "--run-id", "job7", "--", "sh", "-c", script];
    let o = launch_with(&args, Duration::from_secs(20), |c| {
        c.env_remove("OMP_NUM_THREADS").env("TORCHELASTIC_USE_AGENT_STORE", "True");
    });
    assert!(o.status.success(), "{}", o.stderr);
    for r in 0..2 {
        let want = format!("[rank {r}] 1 default {r} 2 1 0 0 job7 xx");
        assert!(o.stdout.lines().any(|l| l == want), "no {want:?} in\n{}", o.stdout);
    }
    assert!(o.stderr.contains("setting OMP_NUM_THREADS=1"), "{}", o.stderr);
    // The user's OMP_NUM_THREADS is kept, without a notice.
    let o = launch_with(&args, Duration::from_secs(20), |c| {
        c.env("OMP_NUM_THREADS", "3");
    });
    assert!(o.stdout.contains("[rank 1] 1 default 1 2 3 0 0 job7 xx"), "{}", o.stdout);
    assert!(!o.stderr.contains("OMP_NUM_THREADS"), "{}", o.stderr);
}

#[test]
fn output_streams_as_it_comes() {
    // A partial line, a pause, the rest: the first part must arrive before the rest.
    let script = r#"printf 'part1 10%%\r'; sleep 2; printf 'part2\n'; printf 'x%.0s' $(seq 3) >&2"#;
    let mut child = Command::new(LAUNCHER)
        .args(["--nproc-per-node", "1", "--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            let _ = tx.send((buf[..n].to_vec(), t0.elapsed()));
        }
    });
    let mut seen = Vec::new();
    let mut first_part_at = None;
    while let Ok((bytes, at)) = rx.recv_timeout(Duration::from_secs(10)) {
        seen.extend_from_slice(&bytes);
        if first_part_at.is_none() && seen.starts_with(b"[rank 0] part1 10%\r") {
            first_part_at = Some(at);
        }
    }
    let status = child.wait().unwrap();
    let ended = t0.elapsed();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&seen), "[rank 0] part1 10%\rpart2\n");
    assert_eq!(stderr, "[rank 0] xxx\n");
    let first = first_part_at.expect("the partial line arrived");
    println!("partial line forwarded after {first:?}; the launcher ended after {ended:?}");
    assert!(ended - first > Duration::from_secs(1), "{first:?} vs {ended:?}");
}

#[test]
fn a_long_line_passes_through_in_chunks() {
    let n = 8_000_000;
    let script = format!("head -c {n} /dev/zero | tr '\\0' y; echo; echo after");
    let o = launch(&["--nproc-per-node", "1", "--", "sh", "-c", &script], Duration::from_secs(30));
    assert!(o.status.success(), "{}", o.stderr);
    let mut lines = o.stdout.lines();
    let long = lines.next().unwrap();
    assert_eq!(long.len(), "[rank 0] ".len() + n);
    assert!(long.starts_with("[rank 0] yyy") && !long[1..].contains('['));
    assert_eq!(lines.next(), Some("[rank 0] after"));
}

#[test]
fn a_200_mb_line_costs_the_launcher_a_chunk_not_the_line() {
    if !std::path::Path::new("/proc/self/status").exists() {
        println!("skipped: no /proc/<pid>/status to read the launcher's peak memory from");
        return;
    }
    let n: usize = 200 << 20;
    // The line, then a pause during which the launcher's peak memory is read.
    let script = format!("head -c {n} /dev/zero | tr '\\0' y; echo; sleep 2");
    let mut child = Command::new(LAUNCHER)
        .args(["--nproc-per-node", "1", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdout = child.stdout.take().unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0usize;
    let want = "[rank 0] ".len() + n + 1;
    while total < want {
        match stdout.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(k) => total += k,
        }
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse().ok())
        .unwrap();
    let _ = std::io::copy(&mut stdout, &mut std::io::sink());
    assert!(child.wait().unwrap().success());
    assert_eq!(total, want);
    println!(
        "a {} MiB line went through; the launcher's peak resident memory: {} MiB",
        n >> 20,
        peak_kib >> 10
    );
    assert!(peak_kib < 64 << 10, "the launcher peaked at {peak_kib} KiB");
}

#[test]
fn nodes_that_disagree_fail_at_join() {
    let port = free_port();
    let node = |rank: &'static str, nproc: &'static str| {
        let args: Vec<String> = [
            "--nproc-per-node",
            nproc,
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--",
            "sleep",
            "30",
        ]
        .map(String::from)
        .to_vec();
        thread::spawn(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            launch(&args, Duration::from_secs(20))
        })
    };
    let n1 = node("1", "1");
    thread::sleep(Duration::from_millis(200));
    let n0 = node("0", "2");
    for (who, o) in [("node 0", n0.join().unwrap()), ("node 1", n1.join().unwrap())] {
        assert_eq!(o.status.code(), Some(1), "{who}: {}", o.stderr);
        assert!(o.stderr.contains("--nproc-per-node 2 --nnodes 2"), "{who}: {}", o.stderr);
        assert!(o.stderr.contains("--nproc-per-node 1 --nnodes 2"), "{who}: {}", o.stderr);
        assert!(o.stderr.contains("every node must give the same"), "{who}: {}", o.stderr);
        assert!(o.stdout.is_empty(), "{who} started ranks: {}", o.stdout);
        println!("{who} failed after {:?}: {}", o.elapsed, o.stderr.trim());
        assert!(o.elapsed < Duration::from_secs(5), "{who} took {:?}", o.elapsed);
    }
}

/// Runs two one-rank node launchers of `script` on loopback, node 1 first.
fn two_nodes_of_one(script: &'static str, extra: &'static [&'static str]) -> (Out, Out) {
    let port = free_port();
    let node = |rank: &'static str| {
        let mut args: Vec<String> = [
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--grace-period",
            "0.5",
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|a| a.to_string()));
        args.extend(["--", "sh", "-c", script].map(String::from));
        thread::spawn(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            launch(&args, Duration::from_secs(30))
        })
    };
    let n1 = node("1");
    thread::sleep(Duration::from_millis(200));
    let n0 = node("0");
    (n0.join().unwrap(), n1.join().unwrap())
}

#[test]
fn a_rank_killed_on_another_node_stops_this_node() {
    let script = r#"if [ "$RANK" = 1 ]; then sleep 0.5; kill -9 $$; fi; exec sleep 30"#;
    let (n0, n1) = two_nodes_of_one(script, &[]);
    assert_eq!(n1.status.code(), Some(137), "{}", n1.stderr);
    assert!(
        n1.stderr.contains("rank 1 (local rank 0) was killed by signal 9 (SIGKILL)"),
        "{}",
        n1.stderr
    );
    assert_eq!(n0.status.code(), Some(1), "{}", n0.stderr);
    let want = "node 1 failed: rank 1 (local rank 0) was killed by signal 9 (SIGKILL)";
    assert!(n0.stderr.contains(want), "{}", n0.stderr);
    println!(
        "node 0 stopped its rank and exited after {:?} (node 1 after {:?})",
        n0.elapsed, n1.elapsed
    );
    assert!(n0.elapsed < Duration::from_secs(8), "{:?}", n0.elapsed);
}

#[test]
fn max_restarts_restarts_every_node() {
    let script = r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 6; fi; if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exec sleep 30; fi; echo "ok $RANK $TORCHELASTIC_RESTART_COUNT $MASTER_PORT""#;
    let (n0, n1) = two_nodes_of_one(script, &["--max-restarts", "1"]);
    assert!(n0.status.success() && n1.status.success(), "{}\n{}", n0.stderr, n1.stderr);
    assert!(
        n0.stderr.contains("node 1 failed: rank 1 (local rank 0) exited with code 6; restarting"),
        "{}",
        n0.stderr
    );
    let port0 = n0
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("[rank 0] ok 0 1 "))
        .unwrap_or_else(|| panic!("{}", n0.stdout));
    let port1 = n1
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("[rank 1] ok 1 1 "))
        .unwrap_or_else(|| panic!("{}", n1.stdout));
    assert_eq!(port0, port1);
}

#[test]
fn max_restarts_restarts_the_group() {
    let script = r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 5; fi; echo "ok $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS""#;
    let o = launch(
        &["--nproc-per-node", "2", "--max-restarts", "1", "--", "sh", "-c", script],
        Duration::from_secs(20),
    );
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stderr.contains(
            "rank 1 (local rank 1) exited with code 5; restarting the group (restart 1 of 1)"
        ),
        "{}",
        o.stderr
    );
    assert!(
        o.stdout.contains("[rank 0] ok 1 1") && o.stdout.contains("[rank 1] ok 1 1"),
        "{}",
        o.stdout
    );
    // Out of restarts: the last failure is the launcher's.
    let o = launch(
        &[
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "2",
            "--",
            "sh",
            "-c",
            "echo run $TORCHELASTIC_RESTART_COUNT; exit 4",
        ],
        Duration::from_secs(20),
    );
    assert_eq!(o.status.code(), Some(4), "{}", o.stderr);
    assert_eq!(o.stdout.matches("[rank 0] run").count(), 3, "{}", o.stdout);
    assert!(o.stdout.contains("[rank 0] run 2"), "{}", o.stdout);
}

/// Where cargo puts this package's examples (next to the directory of this test).
fn example(name: &str) -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join(name);
    path.exists().then_some(path)
}

#[test]
fn torchrun_and_tpar_run_train_llama_2d_alike_on_the_tcp_backend() {
    if !have_torchrun() {
        return;
    }
    let Some(llama) = example("llama_2d") else {
        println!("skipped: llama_2d is not built (cargo build --release --example llama_2d)");
        return;
    };
    let llama = llama.to_string_lossy().into_owned();
    let train = ["--backend", "tcp", "--steps", "2", "--dp", "2", "--tp", "1"];
    let summary =
        |out: &str| out.lines().find_map(|l| l.split("summary: ").nth(1).map(String::from));
    let mut torchrun = Command::new("torchrun");
    torchrun.args(["--standalone", "--nproc-per-node", "2", "--no-python", &llama]).args(train);
    let t = torchrun.stdin(Stdio::null()).output().unwrap();
    let t_out = String::from_utf8_lossy(&t.stdout);
    assert!(t.status.success(), "{t_out}\n{}", String::from_utf8_lossy(&t.stderr));
    let mut args = vec!["--nproc-per-node", "2", "--", &llama];
    args.extend(train);
    let o = launch(&args, Duration::from_secs(120));
    assert!(o.status.success(), "{}", o.stderr);
    let (a, b) = (summary(&t_out), summary(&o.stdout));
    assert!(a.is_some(), "no summary from torchrun's run:\n{t_out}");
    // The same run, bit for bit, whichever launcher started it, timings aside. The peak
    // memory is a timing too: FSDP's prefetched all-gathers and pending reduce-scatters
    // free their buffers when the peer's bytes arrive, so it moves by a tenth of a MiB
    // between runs of the same launcher.
    let strip = |s: String| {
        s.split(' ')
            .filter(|f| {
                !["tokens_per_s=", "seconds=", "peak_mib_max="].iter().any(|k| f.starts_with(k))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(a.map(strip), b.map(strip));
}

/// NCCL's bring-up across 4 real processes started by tpar-run, without a GPU:
/// `rendezvous_check --nccl-mesh 2x2` runs the NCCL backend's rendezvous, unique-id
/// exchange over the launcher's TCP store and one communicator per mesh axis with
/// `nccl::StandIn`. Each process reports the world, its dp and its tp communicator, and
/// every member of a group holds the same unique id.
#[test]
fn nccl_bringup_of_a_2x2_mesh_across_processes() {
    let Some(check) = example("rendezvous_check") else {
        println!("skipped: rendezvous_check is not built (cargo build --release --examples)");
        return;
    };
    let check = check.to_string_lossy().into_owned();
    let o = launch(
        &["--nproc-per-node", "4", "--", &check, "--nccl-mesh", "2x2"],
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}\n{}", o.stdout, o.stderr);
    // group -> (member -> id), from lines "[rank R] rank R communicator ranks=.. member=.. id=.."
    let mut groups: std::collections::BTreeMap<String, Vec<(usize, usize, String)>> =
        Default::default();
    for line in o.stdout.lines().filter(|l| l.contains(" communicator ranks=")) {
        let field = |k: &str| line.split(k).nth(1).and_then(|v| v.split(' ').next()).unwrap();
        let rank: usize =
            line.split("] rank ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        let member: usize = field("member=").parse().unwrap();
        groups.entry(field("ranks=").to_string()).or_default().push((
            rank,
            member,
            field("id=").to_string(),
        ));
    }
    let want = ["0,1", "0,1,2,3", "0,2", "1,3", "2,3"];
    assert_eq!(groups.keys().map(String::as_str).collect::<Vec<_>>(), want, "{}", o.stdout);
    for (ranks, members) in &groups {
        let list: Vec<usize> = ranks.split(',').map(|r| r.parse().unwrap()).collect();
        assert_eq!(members.len(), list.len(), "{ranks}: {members:?}");
        for (rank, member, id) in members {
            assert_eq!(list[*member], *rank, "{ranks}: {members:?}");
            assert_eq!(id, &members[0].2, "members of {ranks} disagree on the unique id");
        }
    }
    let ids: std::collections::HashSet<_> = groups.values().map(|m| m[0].2.clone()).collect();
    assert_eq!(ids.len(), want.len(), "two groups share a unique id: {groups:?}");
    assert_eq!(o.stdout.matches("first collective: NCCL all_reduce").count(), 4, "{}", o.stdout);
}

/// Rank 1's wrapper on the first attempt: a watcher waits for the checkpoint of step 4
/// to be committed, then kills the rank with SIGKILL (a real crash mid-run, between
/// saves) while the rank's process runs the training (`exec`: the same pid). On a
/// restart, or on any other rank, the training runs alone. `$0` is the example, `$@`
/// its flags, `$CK` the checkpoint directory.
const CRASH_RANK_1: &str = r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then
  me=$$
  (while kill -0 "$me" 2>/dev/null && [ ! -f "$CK/step-00000004/metadata.json" ]; do sleep 0.01; done
   kill -9 "$me" && echo "killed rank 1 after the step-4 checkpoint") &
fi
exec "$0" "$@""#;

#[test]
fn a_rank_killed_mid_training_restarts_and_resumes_to_the_uninterrupted_parameters() {
    let Some(llama) = example("llama_2d") else {
        println!("skipped: llama_2d is not built (cargo build --release --example llama_2d)");
        return;
    };
    let llama = llama.to_string_lossy().into_owned();
    let dir = std::env::temp_dir().join(format!("tpar-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // One run as 4 tcp processes (dp 2 x tp 2, FSDP), saving every 2 steps, exporting
    // its final parameters; `sh -c SCRIPT llama_2d FLAGS...` runs it through `script`.
    let run = |name: &str, script: &str, restarts: &str| {
        let ck = dir.join(name);
        let export = dir.join(format!("{name}.safetensors"));
        let (ck_s, export_s) = (ck.to_string_lossy(), export.to_string_lossy());
        let mut args = vec!["--nproc-per-node", "4", "--max-restarts", restarts, "--"];
        args.extend(["sh", "-c", script, &llama]);
        args.extend(["--backend", "tcp", "--steps", "16", "--log-every", "1", "--layers", "1"]);
        args.extend(["--save-every", "2", "--checkpoint-dir", &ck_s, "--export", &export_s]);
        let o = launch_with(&args, Duration::from_secs(300), |c| {
            c.env("CK", &ck);
        });
        assert!(o.status.success(), "{name}: {}\n{}", o.stdout, o.stderr);
        let summary = o.stdout.lines().find_map(|l| l.split("summary: ").nth(1).map(String::from));
        let bits = summary
            .and_then(|s| {
                s.split(' ').find_map(|f| f.strip_prefix("final_loss_bits=").map(String::from))
            })
            .unwrap_or_else(|| panic!("{name}: no summary:\n{}", o.stdout));
        (o, bits, std::fs::read(&export).expect("the exported model"))
    };
    let (_, straight_bits, straight) = run("straight", r#"exec "$0" "$@""#, "0");
    let (o, bits, resumed) = run("crashed", CRASH_RANK_1, "1");
    let _ = std::fs::remove_dir_all(&dir);
    // Rank 1 was killed between saves, the launcher restarted the group, and the ranks
    // resumed from the last committed checkpoint (step 4 or a later one).
    assert!(o.stdout.contains("killed rank 1"), "the crash did not happen:\n{}", o.stdout);
    assert!(
        o.stderr.contains("rank 1 (local rank 1) was killed by signal 9 (SIGKILL); restarting the group (restart 1 of 1)"),
        "{}",
        o.stderr
    );
    assert!(o.stdout.contains("resumed from"), "{}", o.stdout);
    assert_eq!(bits, straight_bits, "final loss bits after the crash and resume");
    assert!(resumed == straight, "the final parameters differ from the uninterrupted run's");
}

/// The byte counts in parentheses of a line, in order (`16.7 GiB (17924040000 bytes)`).
fn byte_counts(line: &str) -> Vec<u64> {
    line.split(" bytes)").filter_map(|part| part.rsplit('(').next()?.trim().parse().ok()).collect()
}

/// Under a launcher each process checks the memory model's predicted peak times the
/// processes on its machine (`LOCAL_WORLD_SIZE`) against the machine's memory: two
/// processes whose peaks fit the machine one at a time but not together are refused
/// before anything is built, naming both figures. A `--memory-budget` under the peak
/// stops the run in any case, so nothing large is ever allocated.
#[test]
fn processes_on_one_machine_are_refused_their_peaks_together() {
    let Some(llama) = example("llama_2d") else {
        println!("skipped: llama_2d is not built (cargo build --release --example llama_2d)");
        return;
    };
    let llama = llama.to_str().unwrap().to_string();
    let run = |seq: u64, budget_gib: f64| {
        let (seq, budget) = (seq.to_string(), format!("{budget_gib:.3}"));
        #[rustfmt::skip]
        let args = [
            "--nproc-per-node", "2", "--", &llama, "--backend", "tcp", "--dp", "2", "--tp",
            "1", "--layers", "1", "--batch", "1", "--seq", &seq, "--memory-budget", &budget,
        ];
        let o = launch(&args, Duration::from_secs(60));
        assert!(!o.status.success(), "{}", o.stdout);
        let all = format!("{}\n{}", o.stdout, o.stderr);
        let refusal = all.lines().find(|l| l.contains("rank(s) on this machine")).map(|l| {
            let n = byte_counts(l);
            assert_eq!(n.len(), 3, "{l}");
            (n[0], n[1], n[2], l.to_string())
        });
        (refusal, all)
    };
    // A sequence far past any machine: the per-rank peak per token and the machine's memory.
    let huge = 1u64 << 32;
    let (calibration, all) = run(huge, 1.0);
    let Some((per_rank, _, machine, _)) = calibration else {
        panic!("no refusal at seq {huge}:\n{all}")
    };
    // Per rank three quarters of the machine: one fits, two do not.
    let seq = (0.75 * machine as f64 / (per_rank as f64 / huge as f64)) as u64;
    let budget = 0.5 * machine as f64 / (1u64 << 30) as f64;
    let (refusal, all) = run(seq, budget);
    let Some((one, both, have, line)) = refusal else {
        panic!("seq {seq}: two processes were not refused for the machine:\n{all}")
    };
    assert!(one < have && have < both && both == 2 * one, "{line}");
    assert!(line.contains("for the 2 rank(s) on this machine"), "{line}");
}

#[test]
fn llama_2d_refuses_a_launch_on_the_local_backend() {
    let Some(llama) = example("llama_2d") else {
        println!("skipped: llama_2d is not built (cargo build --release --example llama_2d)");
        return;
    };
    let out = Command::new(llama)
        .args(["--steps", "1"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("RANK=0, WORLD_SIZE=2") && stderr.contains("process backend"),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("summary:"));
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

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// Set for `rendezvous_child`: rank 1 fails after meeting the others on the first
/// attempt (`TORCHELASTIC_RESTART_COUNT=0`).
const FAIL_FIRST_ATTEMPT_ENV: &str = "TPAR_LAUNCHER_TEST_FAIL_FIRST_ATTEMPT";

/// Runs `torchrun rdzv_args --nproc-per-node 2 --no-python <this test> rendezvous_child`
/// and checks both ranks met through tpar's store (joined via torchrun's agent store).
fn torchrun_rendezvous(mode: &str, rdzv_args: &[String]) {
    torchrun_rendezvous_with(mode, rdzv_args, false)
}

fn torchrun_rendezvous_with(mode: &str, rdzv_args: &[String], fail_first: bool) {
    let t0 = Instant::now();
    let mut cmd = Command::new("torchrun");
    cmd.args(rdzv_args)
        .args(["--nproc-per-node", "2", "--no-python"])
        .args(&child_args()[1..])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null());
    if fail_first {
        cmd.env(FAIL_FIRST_ATTEMPT_ENV, "1");
    }
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
    if fail_first {
        // Two attempts of two ranks each.
        let met = stdout.matches("RDV agent_store=true").count();
        assert_eq!(met, 4, "torchrun {mode}: {stdout}\n{stderr}");
    }
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
fn torchrun_restart_meets_again_under_fresh_keys() {
    if have_torchrun() {
        // Rank 1 fails after the first rendezvous; the restarted pair must not read the
        // first attempt's store address from the agent's store.
        let args = ["--standalone", "--max-restarts", "1"];
        torchrun_rendezvous_with("--max-restarts 1", &args.map(String::from), true);
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
    if std::env::var_os(FAIL_FIRST_ATTEMPT_ENV).is_some() && env.rank == 1 && env.restart_count == 0
    {
        std::process::exit(3);
    }
}
