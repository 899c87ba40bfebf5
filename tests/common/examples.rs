//! The example binaries `cargo test` builds beside the tests, run as a user runs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// An example binary built beside this test (`None` when it is not built).
pub fn example(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples").join(name);
    p.exists().then_some(p)
}

/// Runs `program args...`, killing it past `limit` (a hang fails the test instead of
/// stalling it): (exit code, stdout, stderr, time taken).
pub fn run_limited(
    program: &Path,
    args: &[&str],
    limit: Duration,
) -> (i32, String, String, Duration) {
    use std::io::Read;
    let t0 = Instant::now();
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the program");
    let read_all = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = read_all(Box::new(child.stdout.take().expect("piped stdout")));
    let err = read_all(Box::new(child.stderr.take().expect("piped stderr")));
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the program") {
            break s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program:?} {args:?} ran past {limit:?}; stderr:\n{}", err.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = t0.elapsed();
    (status.code().unwrap_or(-1), out.join().unwrap(), err.join().unwrap(), took)
}

/// Runs an example with `args` (at most 120 s): (exit code, stdout, stderr); `None` when
/// it is not built.
pub fn run_example(name: &str, args: &[&str]) -> Option<(i32, String, String)> {
    run_example_timed(name, args, Duration::from_secs(120)).map(|(c, o, e, _)| (c, o, e))
}

/// [`run_example`] with a limit, also returning the time it took.
pub fn run_example_timed(
    name: &str,
    args: &[&str],
    limit: Duration,
) -> Option<(i32, String, String, Duration)> {
    Some(run_limited(&example(name)?, args, limit))
}
