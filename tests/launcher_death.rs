//! `tpar-run` killed with `SIGKILL` (no chance to stop its ranks): the ranks die with it,
//! as torchrun's children die with their agent, instead of running on until they next
//! print into the launcher's closed pipe.
#![cfg(target_os = "linux")]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const LAUNCHER: &str = env!("CARGO_BIN_EXE_tpar-run");

/// Whether process `pid` is gone (or a zombie nobody reaped yet), waiting up to `limit`.
fn gone_within(pid: u32, limit: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            // The state follows the parenthesised command name.
            Ok(stat)
                if stat.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')) =>
            {
                return true
            }
            Ok(_) => {}
        }
        if t0.elapsed() > limit {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ranks_die_when_the_launcher_is_killed() {
    // Each rank announces its pid, then becomes a silent `sleep` (same pid).
    let script = r#"echo "pid $$"; exec sleep 60"#;
    let mut child = Command::new(LAUNCHER)
        .args(["--nproc-per-node", "2", "--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tpar-run");
    let (tx, rx) = mpsc::channel();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut pids: Vec<u32> = Vec::new();
    while pids.len() < 2 {
        let line = rx.recv_timeout(Duration::from_secs(10)).expect("ranks started");
        pids.extend(line.split(" pid ").nth(1).and_then(|p| p.trim().parse::<u32>().ok()));
    }
    // The ranks have exec'd into `sleep` once their pid's command line says so.
    for &pid in &pids {
        let t0 = Instant::now();
        while !std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.starts_with("sleep"))
        {
            assert!(t0.elapsed() < Duration::from_secs(10), "rank {pid} never ran sleep");
            thread::sleep(Duration::from_millis(10));
        }
    }
    child.kill().unwrap(); // SIGKILL: no handler runs, nothing is forwarded
    child.wait().unwrap();
    for pid in pids {
        let alive = !gone_within(pid, Duration::from_secs(3));
        if alive {
            // Do not leave it behind.
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
        assert!(!alive, "rank process {pid} still running 3 s after tpar-run was killed");
    }
}
