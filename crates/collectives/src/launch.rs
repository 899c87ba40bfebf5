//! The `tpar-run` launcher: starts one process per rank with the environment
//! torchrun gives its workers, for machines without torchrun.
//!
//! ```text
//! tpar-run --nproc-per-node 4 -- target/release/examples/llama_2d --steps 10
//! ```
//!
//! Each child gets `RANK = node_rank * nproc_per_node + local_rank`,
//! `WORLD_SIZE = nnodes * nproc_per_node`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK` (the node rank), `MASTER_ADDR` and `MASTER_PORT`, which
//! [`EnvInit::from_env`](crate::rendezvous::EnvInit::from_env) reads. Every
//! line a child prints is prefixed with `[rank i] `. When a rank exits with a
//! non-zero code or is killed, the launcher stops the others (a termination
//! signal, then `SIGKILL` after the grace period) and reports which rank
//! failed and how.
//!
//! When NCCL is installed only as `libnccl.so.2` (not found by cudarc's loader), the
//! children's `LD_LIBRARY_PATH` starts with a private directory holding a `libnccl.so`
//! link to it (see [`nccl_library_link`](crate::nccl::nccl_library_link)).
//!
//! On Unix each child runs in its own process group, so stopping a rank also
//! stops whatever it started (`sh -c`, wrapper scripts); children read no
//! standard input. [`forward_signals`] makes `SIGINT`, `SIGTERM` and `SIGHUP`
//! sent to the launcher stop the ranks the same way.

use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// The launcher's usage text, printed by `--help` and after a usage error.
pub const USAGE: &str = "\
usage: tpar-run [options] [--] program [args...]

Starts one process per rank with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT) and prefixes each line they print with `[rank i] `.
If a rank fails, the others are stopped and tpar-run exits non-zero.

options:
  --nproc-per-node N   processes on this node (default 1)
  --nnodes M           number of nodes (default 1)
  --node-rank R        this node's index, 0..M (default 0)
  --master-addr A      host of rank 0's rendezvous store
                       (default 127.0.0.1; required when M > 1)
  --master-port P      its port (default: a free port when M = 1, else 29500)
  --grace-period S     seconds between the termination signal and SIGKILL
                       when stopping ranks (default 5)
  -h, --help           print this text

Options also accept `--name=value` and torchrun's underscore spellings
(--nproc_per_node). Multi-node: run tpar-run on every node with the same
--nnodes, --master-addr and --master-port and a distinct --node-rank.
";

/// Port used for multi-node jobs when `--master-port` is not given (torchrun's).
pub const DEFAULT_MULTI_NODE_PORT: u16 = 29500;

/// Errors of the launcher.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `--help` was given: print [`USAGE`] and exit successfully.
    #[error("help requested")]
    Help,
    /// Bad command line or configuration; the message is followed by [`USAGE`].
    #[error("{message}\n\n{USAGE}")]
    Usage {
        /// What was wrong.
        message: String,
    },
    /// No free port could be found for the rendezvous store.
    #[error("cannot find a free port on {addr} for MASTER_PORT: {source}")]
    NoFreePort {
        /// The master address probed.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// A child process could not be started.
    #[error("cannot start rank {rank} ({program:?}): {source}")]
    Spawn {
        /// The rank that failed to start.
        rank: usize,
        /// The program.
        program: OsString,
        /// The operating system's error.
        source: io::Error,
    },
    /// Waiting for a child process failed.
    #[error("cannot wait for rank {rank}: {source}")]
    Wait {
        /// The rank being waited on.
        rank: usize,
        /// The operating system's error.
        source: io::Error,
    },
}

fn usage(message: impl Into<String>) -> LaunchError {
    LaunchError::Usage { message: message.into() }
}

/// What to launch; [`parse_args`] builds it from a command line.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchConfig {
    /// Processes to start on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index in `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of the store; `None` picks a free one (single node) or
    /// [`DEFAULT_MULTI_NODE_PORT`].
    pub master_port: Option<u16>,
    /// The program each rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Time between the termination signal and `SIGKILL` when stopping ranks.
    pub grace_period: Duration,
}

impl LaunchConfig {
    /// One node running `nproc_per_node` copies of `program`, defaults elsewhere.
    pub fn new(nproc_per_node: usize, program: impl Into<OsString>) -> Self {
        Self {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            program: program.into(),
            args: Vec::new(),
            grace_period: Duration::from_secs(5),
        }
    }

    /// Processes in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// Checks the numbers agree with each other.
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.nproc_per_node == 0 {
            return Err(usage("--nproc-per-node must be at least 1"));
        }
        if self.nnodes == 0 {
            return Err(usage("--nnodes must be at least 1"));
        }
        if self.node_rank >= self.nnodes {
            return Err(usage(format!(
                "--node-rank {} must be below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        if self.nproc_per_node.checked_mul(self.nnodes).is_none() {
            return Err(usage("--nproc-per-node times --nnodes overflows"));
        }
        if self.master_addr.is_empty() {
            return Err(usage("--master-addr is empty"));
        }
        if self.master_port == Some(0) {
            return Err(usage("--master-port must be between 1 and 65535"));
        }
        if self.program.is_empty() {
            return Err(usage("no program to run"));
        }
        Ok(())
    }
}

/// Parses the launcher's command line (without the launcher's own name):
/// options, then `--` or the first argument that is not an option, then the
/// program and its arguments.
pub fn parse_args<I, S>(args: I) -> Result<LaunchConfig, LaunchError>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let mut it = args.into_iter().map(Into::into);
    let mut cfg = LaunchConfig::new(1, OsString::new());
    let mut seen: Vec<&'static str> = Vec::new();
    let mut program = None;
    while let Some(arg) = it.next() {
        let Some(text) = arg.to_str() else {
            program = Some(arg);
            break;
        };
        if text == "--" {
            program = Some(it.next().ok_or_else(|| usage("no program after `--`"))?);
            break;
        }
        if text == "-h" || text == "--help" {
            return Err(LaunchError::Help);
        }
        if !text.starts_with('-') || text == "-" {
            program = Some(arg);
            break;
        }
        let (name, inline) = match text.split_once('=') {
            Some((n, v)) => (n.replace('_', "-"), Some(v.to_string())),
            None => (text.replace('_', "-"), None),
        };
        let flag: &'static str = match name.as_str() {
            "--nproc-per-node" => "--nproc-per-node",
            "--nnodes" => "--nnodes",
            "--node-rank" => "--node-rank",
            "--master-addr" => "--master-addr",
            "--master-port" => "--master-port",
            "--grace-period" => "--grace-period",
            _ => return Err(usage(format!("unknown option {text}"))),
        };
        if seen.contains(&flag) {
            return Err(usage(format!("{flag} given twice")));
        }
        seen.push(flag);
        let value = match inline {
            Some(v) => v,
            None => match it.next() {
                Some(v) => v
                    .into_string()
                    .map_err(|v| usage(format!("{flag}: value {v:?} is not UTF-8")))?,
                None => return Err(usage(format!("{flag} needs a value"))),
            },
        };
        let count = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| usage(format!("{flag}: {v:?} is not a non-negative integer")))
        };
        match flag {
            "--nproc-per-node" => cfg.nproc_per_node = count(&value)?,
            "--nnodes" => {
                if value.contains(':') {
                    return Err(usage(format!(
                        "--nnodes: {value:?}: elastic node ranges are not supported; give one number"
                    )));
                }
                cfg.nnodes = count(&value)?
            }
            "--node-rank" => cfg.node_rank = count(&value)?,
            "--master-addr" => cfg.master_addr = value,
            "--master-port" => {
                let p = value.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                    usage(format!("--master-port: {value:?} is not a port number (1-65535)"))
                })?;
                cfg.master_port = Some(p);
            }
            "--grace-period" => {
                let s = value.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0);
                let s = s.ok_or_else(|| {
                    usage(format!("--grace-period: {value:?} is not a number of seconds"))
                })?;
                cfg.grace_period = Duration::from_secs_f64(s);
            }
            _ => unreachable!("flag names are matched above"),
        }
    }
    cfg.program = program.ok_or_else(|| usage("no program to run"))?;
    cfg.args = it.collect();
    if cfg.nnodes > 1 && !seen.contains(&"--master-addr") {
        return Err(usage(
            "--master-addr is required when --nnodes > 1 (the host of node 0, reachable from every node)",
        ));
    }
    cfg.validate()?;
    Ok(cfg)
}

/// How a child process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChildExit {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal (Unix).
    Signal(i32),
}

impl ChildExit {
    fn from_status(status: ExitStatus) -> Self {
        match status.code() {
            Some(c) => ChildExit::Code(c),
            None => ChildExit::Signal(sys::signal_of(status).unwrap_or(-1)),
        }
    }

    /// Whether it exited with code 0.
    pub fn success(self) -> bool {
        self == ChildExit::Code(0)
    }
}

impl fmt::Display for ChildExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ChildExit::Code(c) => write!(f, "exited with code {c}"),
            ChildExit::Signal(s) => match signal_name(s) {
                Some(n) => write!(f, "was killed by signal {s} ({n})"),
                None => write!(f, "was killed by signal {s}"),
            },
        }
    }
}

fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => return None,
    })
}

/// How a launch ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LaunchOutcome {
    /// Every rank on this node exited with code 0.
    Success,
    /// This rank failed first; the others were stopped.
    RankFailed {
        /// Its global rank.
        rank: usize,
        /// Its rank on this node.
        local_rank: usize,
        /// How it ended.
        exit: ChildExit,
    },
    /// The launcher received this signal and stopped every rank.
    Interrupted {
        /// The signal number.
        signal: i32,
    },
}

impl LaunchOutcome {
    /// Whether every rank succeeded.
    pub fn success(&self) -> bool {
        *self == LaunchOutcome::Success
    }

    /// The launcher's exit code: 0, the failed rank's code, or 128 + signal.
    pub fn exit_code(&self) -> i32 {
        match *self {
            LaunchOutcome::Success => 0,
            LaunchOutcome::RankFailed { exit: ChildExit::Code(c), .. } => {
                if (1..=255).contains(&c) {
                    c
                } else {
                    1
                }
            }
            LaunchOutcome::RankFailed { exit: ChildExit::Signal(s), .. }
            | LaunchOutcome::Interrupted { signal: s } => 128 + s.clamp(1, 127),
        }
    }
}

impl fmt::Display for LaunchOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LaunchOutcome::Success => write!(f, "all ranks exited with code 0"),
            LaunchOutcome::RankFailed { rank, local_rank, exit } => {
                write!(f, "rank {rank} (local rank {local_rank}) {exit}")
            }
            LaunchOutcome::Interrupted { signal } => match signal_name(*signal) {
                Some(n) => write!(f, "interrupted by signal {signal} ({n})"),
                None => write!(f, "interrupted by signal {signal}"),
            },
        }
    }
}

/// Signals received by the launcher since [`forward_signals`], 0 when none.
static SIGNAL: AtomicI32 = AtomicI32::new(0);
static SIGNAL_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Makes `SIGINT`, `SIGTERM` and `SIGHUP` sent to this process stop the
/// ranks of a running [`run`] (forwarding the signal, then `SIGKILL` after
/// the grace period; a second signal kills at once) instead of ending the
/// launcher and orphaning them. For launcher binaries; a no-op off Unix.
pub fn forward_signals() {
    sys::install_handlers();
}

const POLL: Duration = Duration::from_millis(20);
/// How long to keep forwarding output after the ranks have exited.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

struct Rank {
    rank: usize,
    child: Child,
    exit: Option<ChildExit>,
    /// Whether stopping signals its process group. Cleared when the rank
    /// succeeds: once reaped, its group id could in time name someone else's.
    signal_group: bool,
}

/// Starts the ranks of this node, forwards their output with `[rank i] `
/// prefixes, and waits for them. The first rank to fail (non-zero code or
/// killed) makes the launcher stop the others; its rank and exit are in the
/// returned [`LaunchOutcome`]. Status lines go to standard error, prefixed
/// `tpar-run: `.
pub fn run(cfg: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    cfg.validate()?;
    let port = match cfg.master_port {
        Some(p) => p,
        None if cfg.nnodes > 1 => DEFAULT_MULTI_NODE_PORT,
        None => free_port(&cfg.master_addr)?,
    };
    let world = cfg.world_size();
    // NCCL installed only as libnccl.so.2, which cudarc does not look for: give the ranks a
    // libnccl.so link on LD_LIBRARY_PATH (removed when the job is over).
    let nccl_link = crate::nccl::nccl_library_link();
    if let Some(l) = &nccl_link {
        eprintln!(
            "tpar-run: NCCL is installed as {} only; the ranks get {} (a libnccl.so link to \
             it) on LD_LIBRARY_PATH",
            l.target().display(),
            l.dir().display()
        );
    }
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut readers = 0;
    let mut ranks: Vec<Rank> = Vec::with_capacity(cfg.nproc_per_node);
    for local_rank in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local_rank;
        let mut cmd = Command::new(&cfg.program);
        cmd.args(&cfg.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("GROUP_RANK", cfg.node_rank.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(l) = &nccl_link {
            cmd.env("LD_LIBRARY_PATH", l.ld_library_path());
        }
        sys::own_process_group(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                stop(&mut ranks, sys::SIGTERM, cfg.grace_period);
                return Err(LaunchError::Spawn { rank, program: cfg.program.clone(), source });
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            readers += spawn_forwarder(out, prefix.clone(), false, done_tx.clone());
        }
        if let Some(err) = child.stderr.take() {
            readers += spawn_forwarder(err, prefix, true, done_tx.clone());
        }
        ranks.push(Rank { rank, child, exit: None, signal_group: true });
    }
    drop(done_tx);

    let outcome = monitor(&mut ranks, cfg);
    // Let the forwarders print what the ranks wrote last, without waiting on
    // a stray process that still holds a pipe.
    let deadline = Instant::now() + OUTPUT_DRAIN;
    for _ in 0..readers {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    outcome
}

/// Polls the ranks until all succeed, one fails, or a signal arrives.
fn monitor(ranks: &mut [Rank], cfg: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    loop {
        let signal = SIGNAL.load(Ordering::SeqCst);
        if signal != 0 {
            eprintln!(
                "tpar-run: received signal {signal}; stopping {} rank(s)",
                ranks.iter().filter(|r| r.exit.is_none()).count()
            );
            stop(ranks, signal, cfg.grace_period);
            return Ok(LaunchOutcome::Interrupted { signal });
        }
        let mut failed = None;
        for r in ranks.iter_mut().filter(|r| r.exit.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    let exit = ChildExit::from_status(status);
                    r.exit = Some(exit);
                    r.signal_group = !exit.success();
                    if !exit.success() && failed.is_none() {
                        failed = Some((r.rank, exit));
                    }
                }
                Ok(None) => {}
                Err(source) => {
                    let rank = r.rank;
                    stop(ranks, sys::SIGTERM, cfg.grace_period);
                    return Err(LaunchError::Wait { rank, source });
                }
            }
        }
        if let Some((rank, exit)) = failed {
            let running = ranks.iter().filter(|r| r.exit.is_none()).count();
            eprintln!("tpar-run: rank {rank} {exit}; stopping the other {running} rank(s)");
            stop(ranks, sys::SIGTERM, cfg.grace_period);
            let local_rank = rank - cfg.node_rank * cfg.nproc_per_node;
            return Ok(LaunchOutcome::RankFailed { rank, local_rank, exit });
        }
        if ranks.iter().all(|r| r.exit.is_some()) {
            return Ok(LaunchOutcome::Success);
        }
        thread::sleep(POLL);
    }
}

/// Sends `signal` to every rank's process group, waits up to `grace` (or
/// until another signal reaches the launcher) and kills what is left.
fn stop(ranks: &mut [Rank], signal: i32, grace: Duration) {
    let signals_before = SIGNAL_COUNT.load(Ordering::SeqCst);
    for r in ranks.iter_mut().filter(|r| r.signal_group) {
        sys::signal_group(&mut r.child, signal);
    }
    let deadline = Instant::now() + grace;
    loop {
        for r in ranks.iter_mut().filter(|r| r.exit.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.exit = Some(ChildExit::from_status(status));
            }
        }
        let again = SIGNAL_COUNT.load(Ordering::SeqCst) > signals_before;
        if ranks.iter().all(|r| r.exit.is_some()) || Instant::now() >= deadline || again {
            break;
        }
        thread::sleep(POLL);
    }
    for r in ranks.iter_mut().filter(|r| r.signal_group) {
        // Also reaches what the failed rank left behind in its group.
        sys::signal_group(&mut r.child, sys::SIGKILL);
        if r.exit.is_none() {
            if let Ok(status) = r.child.wait() {
                r.exit = Some(ChildExit::from_status(status));
            }
        }
    }
}

/// Copies `src` line by line to our stdout or stderr, each line prefixed.
/// Returns the number of threads started (0 or 1).
fn spawn_forwarder(
    src: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    done: mpsc::Sender<()>,
) -> usize {
    let body = move || {
        let mut reader = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut buf = Vec::with_capacity(prefix.len() + line.len());
                    buf.extend_from_slice(prefix.as_bytes());
                    buf.extend_from_slice(&line);
                    // Keep draining even if our own output is closed, so the rank never blocks.
                    let _ = if to_stderr {
                        io::stderr().lock().write_all(&buf)
                    } else {
                        let mut out = io::stdout().lock();
                        out.write_all(&buf).and_then(|_| out.flush())
                    };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = done.send(());
    };
    thread::Builder::new().name("tpar-run-output".into()).spawn(body).map_or(0, |_| 1)
}

/// A port that is free on `addr` right now (the usual race applies: another
/// process could take it before rank 0 binds it).
fn free_port(addr: &str) -> Result<u16, LaunchError> {
    let err = |source| LaunchError::NoFreePort { addr: addr.to_string(), source };
    let l = TcpListener::bind((addr, 0)).map_err(err)?;
    Ok(l.local_addr().map_err(err)?.port())
}

#[cfg(unix)]
mod sys {
    use std::os::raw::c_int;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Child, Command, ExitStatus};
    use std::sync::atomic::Ordering;

    pub const SIGHUP: i32 = 1;
    pub const SIGINT: i32 = 2;
    pub const SIGKILL: i32 = 9;
    pub const SIGTERM: i32 = 15;

    extern "C" {
        fn kill(pid: i32, sig: c_int) -> c_int;
        fn signal(signum: c_int, handler: extern "C" fn(c_int)) -> usize;
    }

    pub fn own_process_group(cmd: &mut Command) {
        cmd.process_group(0);
    }

    pub fn signal_of(status: ExitStatus) -> Option<i32> {
        status.signal()
    }

    /// Signals the process group the child leads (see `own_process_group`).
    pub fn signal_group(child: &mut Child, sig: i32) {
        let Ok(pid) = i32::try_from(child.id()) else { return };
        // SAFETY: kill(2) takes plain integers and touches no memory of ours;
        // a negative pid addresses the process group the child leads, which
        // cannot be recycled while any of its members (or the unreaped child) exists.
        let rc = unsafe { kill(-pid, sig) };
        if rc != 0 && sig == SIGKILL {
            let _ = child.kill();
        }
    }

    extern "C" fn on_signal(sig: c_int) {
        // Only atomics here: they are async-signal-safe.
        super::SIGNAL.store(sig, Ordering::SeqCst);
        super::SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
    }

    pub fn install_handlers() {
        for sig in [SIGHUP, SIGINT, SIGTERM] {
            // SAFETY: `on_signal` has the C handler signature and only touches
            // atomics, which is async-signal-safe.
            unsafe {
                signal(sig, on_signal);
            }
        }
    }
}

#[cfg(not(unix))]
mod sys {
    use std::process::{Child, Command, ExitStatus};

    pub const SIGKILL: i32 = 9;
    pub const SIGTERM: i32 = 15;

    pub fn own_process_group(_cmd: &mut Command) {}

    pub fn signal_of(_status: ExitStatus) -> Option<i32> {
        None
    }

    /// No process groups or signals here: killing is all there is.
    pub fn signal_group(child: &mut Child, _sig: i32) {
        let _ = child.kill();
    }

    pub fn install_handlers() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<LaunchConfig, LaunchError> {
        parse_args(args.iter().copied())
    }

    fn usage_msg(args: &[&str]) -> String {
        match parse(args) {
            Err(LaunchError::Usage { message }) => message,
            other => panic!("expected a usage error for {args:?}, got {other:?}"),
        }
    }

    #[test]
    fn parses_single_node() {
        let c = parse(&["--nproc-per-node", "4", "--", "python", "train.py", "--lr", "1"]).unwrap();
        assert_eq!(c.nproc_per_node, 4);
        assert_eq!((c.nnodes, c.node_rank, c.world_size()), (1, 0, 4));
        assert_eq!(c.master_addr, "127.0.0.1");
        assert_eq!(c.master_port, None);
        assert_eq!(c.program, "python");
        assert_eq!(c.args, ["train.py", "--lr", "1"]);
        assert_eq!(c.grace_period, Duration::from_secs(5));
    }

    #[test]
    fn parses_multi_node_torchrun_spellings_and_no_separator() {
        let c = parse(&[
            "--nproc_per_node=2",
            "--nnodes",
            "3",
            "--node_rank=2",
            "--master-addr",
            "10.0.0.1",
            "--master_port",
            "1234",
            "--grace-period",
            "0.5",
            "./train",
            "--nnodes",
            "9",
        ])
        .unwrap();
        assert_eq!((c.nproc_per_node, c.nnodes, c.node_rank), (2, 3, 2));
        assert_eq!(c.world_size(), 6);
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.1", Some(1234)));
        assert_eq!(c.grace_period, Duration::from_millis(500));
        // Everything after the program belongs to it.
        assert_eq!(c.program, "./train");
        assert_eq!(c.args, ["--nnodes", "9"]);
        let c = parse(&["prog"]).unwrap();
        assert_eq!((c.nproc_per_node, c.program.to_str()), (1, Some("prog")));
    }

    #[test]
    fn help_is_its_own_variant() {
        assert!(matches!(parse(&["--help"]), Err(LaunchError::Help)));
        assert!(matches!(parse(&["--nnodes", "1", "-h", "x"]), Err(LaunchError::Help)));
        // After the separator, --help is the program's.
        let c = parse(&["--", "prog", "--help"]).unwrap();
        assert_eq!(c.args, ["--help"]);
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        let m = usage_msg(&["--nproc-per-node", "two", "--", "p"]);
        assert!(m.contains("--nproc-per-node") && m.contains("\"two\""), "{m}");
        assert!(usage_msg(&["--nproc-per-node", "0", "p"]).contains("at least 1"));
        assert!(usage_msg(&["--bogus", "p"]).contains("unknown option --bogus"));
        assert!(usage_msg(&["-x", "p"]).contains("unknown option -x"));
        assert!(usage_msg(&["--nnodes"]).contains("--nnodes needs a value"));
        assert!(usage_msg(&["--nproc-per-node", "2"]).contains("no program"));
        assert!(usage_msg(&["--"]).contains("no program after"));
        assert!(usage_msg(&["--master-port", "0", "p"]).contains("--master-port"));
        assert!(usage_msg(&["--master-port", "65536", "p"]).contains("\"65536\""));
        assert!(usage_msg(&["--nnodes", "1:4", "p"]).contains("elastic"));
        assert!(usage_msg(&["--nnodes", "2", "p"]).contains("--master-addr is required"));
        let m = usage_msg(&["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "p"]);
        assert!(m.contains("--node-rank 2 must be below --nnodes 2"), "{m}");
        assert!(usage_msg(&["--nnodes", "1", "--nnodes=1", "p"]).contains("given twice"));
        assert!(usage_msg(&["--grace-period", "-1", "p"]).contains("--grace-period"));
        // The error's text carries the usage.
        let e = parse(&["--bogus"]).unwrap_err().to_string();
        assert!(e.contains("unknown option --bogus") && e.contains("usage: tpar-run"), "{e}");
    }

    #[test]
    fn outcome_exit_codes_and_messages() {
        let failed = LaunchOutcome::RankFailed { rank: 5, local_rank: 1, exit: ChildExit::Code(3) };
        assert_eq!(failed.exit_code(), 3);
        assert_eq!(failed.to_string(), "rank 5 (local rank 1) exited with code 3");
        let killed =
            LaunchOutcome::RankFailed { rank: 0, local_rank: 0, exit: ChildExit::Signal(9) };
        assert_eq!(killed.exit_code(), 137);
        assert!(killed.to_string().contains("signal 9 (SIGKILL)"));
        assert_eq!(LaunchOutcome::Interrupted { signal: 15 }.exit_code(), 143);
        assert_eq!(LaunchOutcome::Success.exit_code(), 0);
    }

    #[test]
    fn spawn_failure_names_the_rank_and_program() {
        let cfg = LaunchConfig::new(2, "/nonexistent/tpar-test-program");
        match run(&cfg) {
            Err(e @ LaunchError::Spawn { rank: 0, .. }) => {
                assert!(e.to_string().contains("/nonexistent/tpar-test-program"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }
}
