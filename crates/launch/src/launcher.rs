//! The `tpar-run` launcher: starts one process per rank with the environment
//! torchrun gives its workers, for machines without torchrun.
//!
//! ```text
//! tpar-run --nproc-per-node 4 -- target/release/examples/llama_2d --steps 10
//! ```
//!
//! Each child gets what torchrun gives a worker: `RANK = node_rank * nproc_per_node +
//! local_rank`, `WORLD_SIZE = nnodes * nproc_per_node`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK` (the node rank), `GROUP_WORLD_SIZE` (the nodes), `ROLE_RANK`,
//! `ROLE_WORLD_SIZE`, `ROLE_NAME` (`default`), `MASTER_ADDR`, `MASTER_PORT`,
//! `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_RUN_ID`, and
//! `OMP_NUM_THREADS=1` when a node runs several ranks and the variable is unset (with a
//! notice). [`EnvInit::from_env`](crate::EnvInit::from_env) reads them. The children's
//! output is forwarded as it comes, in chunks, each line prefixed with `[rank i] `. When
//! a rank exits with a non-zero code or is killed, the launcher stops the others (a
//! termination signal, then `SIGKILL` after the grace period) and reports which rank
//! failed and how; with `--max-restarts N` it then starts the whole group again, up to N
//! times.
//!
//! When NCCL is installed only as `libnccl.so.2` (not found by cudarc's loader), the
//! children's `LD_LIBRARY_PATH` starts with a private directory holding a `libnccl.so`
//! link to it (see [`nccl_library_link`](tpar_collectives::nccl::nccl_library_link)).
//!
//! On Unix each child runs in its own process group, so stopping a rank also
//! stops whatever it started (`sh -c`, wrapper scripts); children read no
//! standard input. [`forward_signals`](crate::forward_signals) makes `SIGINT`, `SIGTERM`
//! and `SIGHUP` sent to the launcher stop the ranks the same way.
//!
//! The command line (`tpar-run --help`) is parsed by [`parse_args`](crate::cli::parse_args)
//! into a [`LaunchConfig`]; [`run`] takes the config, so a program can launch ranks without
//! building a command line.

use std::ffi::OsString;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use crate::cli::{UsageError, SYNOPSIS};
use crate::rendezvous::{RendezvousError, TcpStore};
use crate::{signals, sys};

/// Port used for multi-node jobs when `--master-port` is not given (torchrun's).
pub const DEFAULT_MULTI_NODE_PORT: u16 = 29500;

/// Errors of the launcher.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `--help` was given: print [`help_text`](crate::cli::help_text) and exit
    /// successfully.
    #[error("help requested")]
    Help,
    /// Bad command line or configuration; the message is followed by the synopsis.
    #[error("{0}\n\nusage: {SYNOPSIS}\nRun `tpar-run --help` for the options.")]
    Usage(#[from] UsageError),
    /// The launcher's signal handlers could not be installed.
    #[error("cannot install the launcher's signal handlers: {source}")]
    Signals {
        /// The operating system's error.
        source: io::Error,
    },
    /// No free port could be found for the rendezvous store.
    #[error("cannot find a free port on {addr} for MASTER_PORT: {source}")]
    NoFreePort {
        /// The master address probed.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// A multi-node job's launchers could not meet at `--master-addr:--master-port`.
    #[error("node {node_rank}: joining the other nodes' launchers: {source}")]
    Join {
        /// This node's rank.
        node_rank: usize,
        /// The store's error.
        source: RendezvousError,
    },
    /// Two nodes of a multi-node job were started with different `--nproc-per-node` or
    /// `--nnodes` (or the same `--node-rank`): found at join, before any rank starts.
    #[error(
        "node {node_rank} runs with {this}, but node {other_node} runs with {other}: every \
         node must give the same --nproc-per-node and --nnodes"
    )]
    NodeMismatch {
        /// This node's rank.
        node_rank: usize,
        /// This node's settings.
        this: String,
        /// The node that disagrees.
        other_node: usize,
        /// Its settings.
        other: String,
    },
    /// Two launchers were started with the same `--node-rank`.
    #[error("--node-rank {node_rank} was given to {count} launchers; each node needs its own")]
    NodeRankTaken {
        /// The node rank.
        node_rank: usize,
        /// How many launchers claimed it.
        count: i64,
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

/// What to launch; [`parse_args`](crate::cli::parse_args) builds it from a command line.
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
    /// How many times to restart the whole group after a rank fails (torchrun's
    /// `--max-restarts`); each restart increments `TORCHELASTIC_RESTART_COUNT`.
    pub max_restarts: u32,
    /// The job's id, `TORCHELASTIC_RUN_ID` (torchrun's `--rdzv-id`, default `none`).
    pub run_id: String,
    /// How long the node launchers of a multi-node job wait for each other at join.
    pub join_timeout: Duration,
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
            max_restarts: 0,
            run_id: "none".into(),
            join_timeout: Duration::from_secs(300),
        }
    }

    /// Processes in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// Checks the numbers agree with each other.
    pub fn validate(&self) -> Result<(), UsageError> {
        if self.nproc_per_node == 0 {
            return Err(UsageError::Zero { flag: "--nproc-per-node" });
        }
        if self.nnodes == 0 {
            return Err(UsageError::Zero { flag: "--nnodes" });
        }
        if self.node_rank >= self.nnodes {
            return Err(UsageError::NodeRankOutOfRange {
                node_rank: self.node_rank,
                nnodes: self.nnodes,
            });
        }
        if self.nproc_per_node.checked_mul(self.nnodes).is_none() {
            return Err(UsageError::WorldSizeOverflow);
        }
        if self.master_addr.is_empty() {
            return Err(UsageError::EmptyMasterAddr);
        }
        if self.master_port == Some(0) {
            return Err(UsageError::PortZero);
        }
        if self.program.is_empty() {
            return Err(UsageError::NoProgram);
        }
        Ok(())
    }
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
            ChildExit::Signal(s) => match sys::signal_name(s) {
                Some(n) => write!(f, "was killed by signal {s} ({n})"),
                None => write!(f, "was killed by signal {s}"),
            },
        }
    }
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
    /// A rank on another node failed (its launcher said so through the launchers'
    /// store); this node's ranks were stopped.
    NodeFailed {
        /// The node whose rank failed.
        node_rank: usize,
        /// What its launcher reported (`rank 5 (local rank 1) exited with code 3`).
        message: String,
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
            LaunchOutcome::NodeFailed { .. } => 1,
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
            LaunchOutcome::NodeFailed { node_rank, message } => {
                write!(f, "node {node_rank} failed: {message}")
            }
            LaunchOutcome::Interrupted { signal } => match sys::signal_name(*signal) {
                Some(n) => write!(f, "interrupted by signal {signal} ({n})"),
                None => write!(f, "interrupted by signal {signal}"),
            },
        }
    }
}

/// Prints one of the launcher's status lines on standard error (`tpar-run: ...`), first
/// ending a rank's line left open there, so the two do not share a line.
macro_rules! notice {
    ($($arg:tt)*) => {
        notice_line(&format!($($arg)*))
    };
}

fn notice_line(line: &str) {
    let mut open = OPEN_LINE[Stream::Stderr as usize].lock().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::with_capacity(line.len() + 2);
    if open.take().is_some() {
        out.push(b'\n');
    }
    out.extend_from_slice(line.as_bytes());
    out.push(b'\n');
    emit(Stream::Stderr, &out);
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
/// returned [`LaunchOutcome`]. With [`max_restarts`](LaunchConfig::max_restarts) above
/// 0 the whole group is then started again, up to that many times. Status lines go to
/// standard error, prefixed `tpar-run: `.
///
/// With several nodes, the launchers meet first at `master_addr:master_port`: node 0's
/// launcher hosts a store there, every launcher publishes its `--nproc-per-node` and
/// `--nnodes` and checks them against node 0's (node 0 checks everyone's), so a
/// mismatch is [`LaunchError::NodeMismatch`] on both sides before any rank starts.
/// Node 0 then picks a free port for rank 0's store and hands it to the others.
///
/// The ranks die with the launcher: on Linux each gets `SIGKILL` when the thread that
/// called `run` exits (a parent-death signal), so a `kill -9` of `tpar-run` leaves none
/// running. `run` returns only once its ranks are done, so call it from a thread that
/// lives until then (the main thread, as `tpar-run` does).
pub fn run(cfg: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    cfg.validate()?;
    // NCCL installed only as libnccl.so.2, which cudarc does not look for: give the ranks a
    // libnccl.so link on LD_LIBRARY_PATH (removed when the job is over).
    let nccl_link = tpar_collectives::nccl::nccl_library_link();
    if let Some(l) = &nccl_link {
        notice!(
            "tpar-run: NCCL is installed as {} only; the ranks get {} (a libnccl.so link to \
             it) on LD_LIBRARY_PATH",
            l.target().display(),
            l.dir().display()
        );
    }
    let agents = if cfg.nnodes > 1 { Some(join_nodes(cfg)?) } else { None };
    // torchrun's rule: one OpenMP thread per rank unless the user says otherwise.
    let omp_threads = if cfg.nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        notice!(
            "tpar-run: setting OMP_NUM_THREADS=1 for each of the {} ranks on this node, so \
             they do not oversubscribe the CPU; set OMP_NUM_THREADS to tune it",
            cfg.nproc_per_node
        );
        true
    } else {
        false
    };
    let mut restart = 0u32;
    loop {
        let port = match &agents {
            Some(store) => attempt_port(cfg, store, restart)?,
            None => match cfg.master_port {
                Some(p) => p,
                None => free_port(&cfg.master_addr)?,
            },
        };
        let env = ChildEnv {
            port,
            restart,
            omp_threads,
            ld_library_path: nccl_link.as_ref().map(|l| l.ld_library_path()),
        };
        let peers = agents.as_ref().map(|store| Peers::new(store, cfg, restart));
        let outcome = run_once(cfg, &env, peers.as_ref())?;
        let failed =
            matches!(outcome, LaunchOutcome::RankFailed { .. } | LaunchOutcome::NodeFailed { .. });
        if let (Some(p), true) = (&peers, failed) {
            p.acknowledge(restart < cfg.max_restarts);
        }
        match outcome {
            LaunchOutcome::RankFailed { .. } | LaunchOutcome::NodeFailed { .. }
                if restart < cfg.max_restarts =>
            {
                restart += 1;
                notice!(
                    "tpar-run: {outcome}; restarting the group (restart {restart} of {})",
                    cfg.max_restarts
                );
            }
            outcome => return Ok(outcome),
        }
    }
}

/// What differs between the children of one attempt and the next.
struct ChildEnv {
    port: u16,
    restart: u32,
    omp_threads: bool,
    ld_library_path: Option<OsString>,
}

/// Key under which node `n`'s launcher publishes its settings in the launchers' store.
fn node_key(n: usize) -> String {
    format!("tpar-run/node/{n}")
}

/// The launchers of a multi-node job meet: node 0 hosts a store at
/// `master_addr:master_port`, each launcher checks its settings against node 0's.
fn join_nodes(cfg: &LaunchConfig) -> Result<TcpStore, LaunchError> {
    let node_rank = cfg.node_rank;
    let join = |source| LaunchError::Join { node_rank, source };
    let port = cfg.master_port.unwrap_or(DEFAULT_MULTI_NODE_PORT);
    let store = if node_rank == 0 {
        TcpStore::server(&bind_addr(&cfg.master_addr, port), cfg.nnodes, cfg.join_timeout)
    } else {
        TcpStore::client(&host_port(&cfg.master_addr, port), cfg.join_timeout)
    }
    .map_err(join)?;
    let count = store.add(&format!("{}/claims", node_key(node_rank)), 1).map_err(join)?;
    if count > 1 {
        return Err(LaunchError::NodeRankTaken { node_rank, count });
    }
    let this = format!("--nproc-per-node {} --nnodes {}", cfg.nproc_per_node, cfg.nnodes);
    let check = |other_node: usize| -> Result<(), LaunchError> {
        let other = store.get(&node_key(other_node)).map_err(join)?;
        let other = String::from_utf8_lossy(&other).into_owned();
        if other != this {
            return Err(LaunchError::NodeMismatch {
                node_rank,
                this: this.clone(),
                other_node,
                other,
            });
        }
        Ok(())
    };
    if node_rank == 0 {
        store.set(&node_key(0), this.as_bytes()).map_err(join)?;
        for other in 1..cfg.nnodes {
            check(other)?;
        }
    } else {
        // Read node 0's settings before publishing ours: node 0 stops its store as soon as
        // it sees a mismatch, and by then this node has what it needs to report it too.
        let verdict = check(0);
        store.set(&node_key(node_rank), this.as_bytes()).map_err(join)?;
        verdict?;
    }
    Ok(store)
}

/// Rank 0's store port for restart `restart` of a multi-node job: node 0 picks a free
/// one and publishes it, the other nodes read it.
fn attempt_port(cfg: &LaunchConfig, store: &TcpStore, restart: u32) -> Result<u16, LaunchError> {
    let join = |source| LaunchError::Join { node_rank: cfg.node_rank, source };
    let key = format!("tpar-run/restart/{restart}/master_port");
    if cfg.node_rank == 0 {
        let port = free_port_any(&cfg.master_addr)?;
        store.set(&key, port.to_string().as_bytes()).map_err(join)?;
        return Ok(port);
    }
    let v = store.get(&key).map_err(join)?;
    String::from_utf8_lossy(&v).parse().map_err(|_| {
        join(RendezvousError::Protocol {
            addr: store.addr().to_string(),
            what: format!("{key} holds {:?}, not a port", String::from_utf8_lossy(&v)),
        })
    })
}

/// How often a node's launcher looks for another node's failure.
const PEER_POLL: Duration = Duration::from_millis(200);
/// How long node 0's launcher (which hosts the launchers' store) waits, before it exits
/// after a failure, for the other nodes to have seen it.
const PEER_DRAIN: Duration = Duration::from_secs(3);

/// The other nodes' launchers, during one attempt of a multi-node job: a rank's failure
/// on one node is posted in the launchers' store, and every node stops its ranks when it
/// sees it (instead of waiting for their collectives to time out).
struct Peers<'a> {
    store: &'a TcpStore,
    node_rank: usize,
    nnodes: usize,
    key: String,
}

impl<'a> Peers<'a> {
    fn new(store: &'a TcpStore, cfg: &LaunchConfig, restart: u32) -> Self {
        Self {
            store,
            node_rank: cfg.node_rank,
            nnodes: cfg.nnodes,
            key: format!("tpar-run/restart/{restart}/failed"),
        }
    }

    /// Another node's failure, if one was posted. Store errors count as none: node 0's
    /// launcher exits (and its store with it) once its own ranks are done.
    fn failure(&self) -> Option<(usize, String)> {
        if !self.store.check(&[&self.key]).ok()? {
            return None;
        }
        let v = self.store.get(&self.key).ok()?;
        let v = String::from_utf8_lossy(&v);
        let (node, message) = v.split_once(' ')?;
        let node = node.parse().ok()?;
        (node != self.node_rank).then(|| (node, message.to_string()))
    }

    /// Posts this node's failure.
    fn report(&self, message: &str) {
        let _ = self.store.set(&self.key, format!("{} {message}", self.node_rank).as_bytes());
    }

    /// Counts this node as having seen the failure; node 0, when the job ends here
    /// (`restarting` false), waits a little for every node to have seen it before its
    /// store goes away.
    fn acknowledge(&self, restarting: bool) {
        let seen = format!("{}/seen", self.key);
        let _ = self.store.add(&seen, 1);
        if self.node_rank != 0 || restarting {
            return;
        }
        let deadline = Instant::now() + PEER_DRAIN;
        while Instant::now() < deadline {
            match self.store.add(&seen, 0) {
                Ok(n) if n >= self.nnodes as i64 => return,
                Ok(_) => thread::sleep(POLL),
                Err(_) => return,
            }
        }
    }
}

/// One attempt: starts the ranks, forwards their output, waits for them.
fn run_once(
    cfg: &LaunchConfig,
    env: &ChildEnv,
    peers: Option<&Peers<'_>>,
) -> Result<LaunchOutcome, LaunchError> {
    let world = cfg.world_size();
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
            .env("GROUP_WORLD_SIZE", cfg.nnodes.to_string())
            .env("ROLE_NAME", "default")
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", env.port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", env.restart.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts.to_string())
            .env("TORCHELASTIC_RUN_ID", &cfg.run_id)
            // Rank 0 hosts the job's store itself (no agent store here).
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if env.omp_threads {
            cmd.env("OMP_NUM_THREADS", "1");
        }
        if let Some(p) = &env.ld_library_path {
            cmd.env("LD_LIBRARY_PATH", p);
        }
        sys::own_process_group(&mut cmd);
        sys::die_with_launcher(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                stop(&mut ranks, sys::SIGTERM, cfg.grace_period);
                return Err(LaunchError::Spawn { rank, program: cfg.program.clone(), source });
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            readers += spawn_forwarder(out, rank, prefix.clone(), Stream::Stdout, done_tx.clone());
        }
        if let Some(err) = child.stderr.take() {
            readers += spawn_forwarder(err, rank, prefix, Stream::Stderr, done_tx.clone());
        }
        ranks.push(Rank { rank, child, exit: None, signal_group: true });
    }
    drop(done_tx);

    let outcome = monitor(&mut ranks, cfg, peers);
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
fn monitor(
    ranks: &mut [Rank],
    cfg: &LaunchConfig,
    peers: Option<&Peers<'_>>,
) -> Result<LaunchOutcome, LaunchError> {
    let mut polled = Instant::now();
    // The failed rank to name and when it was found: one that exited with an error is
    // named after SETTLE (see there) unless a rank killed by a signal turns up meanwhile.
    let mut failed: Option<(usize, ChildExit, Instant)> = None;
    loop {
        if let Some(p) = peers.filter(|_| polled.elapsed() >= PEER_POLL) {
            polled = Instant::now();
            if let Some((node_rank, message)) = p.failure() {
                notice!(
                    "tpar-run: node {node_rank} failed ({message}); stopping {} rank(s)",
                    ranks.iter().filter(|r| r.exit.is_none()).count()
                );
                stop(ranks, sys::SIGTERM, cfg.grace_period);
                return Ok(LaunchOutcome::NodeFailed { node_rank, message });
            }
        }
        if let Some(signal) = signals::received() {
            notice!(
                "tpar-run: received signal {signal}; stopping {} rank(s)",
                ranks.iter().filter(|r| r.exit.is_none()).count()
            );
            stop(ranks, signal, cfg.grace_period);
            return Ok(LaunchOutcome::Interrupted { signal });
        }
        for r in ranks.iter_mut().filter(|r| r.exit.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    let exit = ChildExit::from_status(status);
                    r.exit = Some(exit);
                    r.signal_group = !exit.success();
                    // Ranks usually fail because one of them did: of those found
                    // failed, name one killed by a signal first.
                    let first = match failed {
                        None => true,
                        Some((_, seen, _)) => !killed(seen) && killed(exit),
                    };
                    if !exit.success() && first {
                        failed = Some((r.rank, exit, Instant::now()));
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
        let all_exited = ranks.iter().all(|r| r.exit.is_some());
        let settled = |&(_, exit, at): &(usize, ChildExit, Instant)| {
            killed(exit) || all_exited || at.elapsed() >= SETTLE
        };
        if let Some((rank, exit, _)) = failed.filter(settled) {
            let running = ranks.iter().filter(|r| r.exit.is_none()).count();
            notice!("tpar-run: rank {rank} {exit}; stopping the other {running} rank(s)");
            let local_rank = rank - cfg.node_rank * cfg.nproc_per_node;
            let outcome = LaunchOutcome::RankFailed { rank, local_rank, exit };
            if let Some(p) = peers {
                p.report(&outcome.to_string());
            }
            stop(ranks, sys::SIGTERM, cfg.grace_period);
            return Ok(outcome);
        }
        if failed.is_none() && all_exited {
            return Ok(LaunchOutcome::Success);
        }
        thread::sleep(POLL);
    }
}

/// How long a failure first seen as a rank's error exit waits before it is named:
/// ranks usually exit with an error because a peer died, and a peer killed by a signal
/// closes its connections (which its peers see) before it can be reaped. A rank found
/// killed by a signal meanwhile is named instead.
const SETTLE: Duration = Duration::from_millis(500);

/// Whether a rank's exit looks like a kill rather than an error it reported: a signal,
/// or a shell's 128 + signal exit code.
fn killed(exit: ChildExit) -> bool {
    match exit {
        ChildExit::Signal(_) => true,
        ChildExit::Code(c) => c > 128,
    }
}

/// Sends `signal` to every rank's process group, waits up to `grace` (or
/// until another signal reaches the launcher) and kills what is left.
fn stop(ranks: &mut [Rank], signal: i32, grace: Duration) {
    let signals_before = signals::count();
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
        let again = signals::count() > signals_before;
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

/// Which of the launcher's outputs a child's stream goes to.
#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// Per output: the rank whose line is still open (its last chunk did not end in `\n`).
static OPEN_LINE: [Mutex<Option<usize>>; 2] = [Mutex::new(None), Mutex::new(None)];

/// Bytes read from a child at a time: a long line costs this much, not its length.
const CHUNK: usize = 64 << 10;

/// Copies `src` to our stdout or stderr as it arrives, in chunks (no waiting for whole
/// lines, so `\r` progress bars show and a huge line costs one chunk of memory), writing
/// `prefix` at the start of each line. When another rank's output interrupts an open
/// line, that line is ended first so that every line carries one prefix.
/// Returns the number of threads started (0 or 1).
fn spawn_forwarder(
    mut src: impl Read + Send + 'static,
    rank: usize,
    prefix: String,
    stream: Stream,
    done: mpsc::Sender<()>,
) -> usize {
    let body = move || {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => write_chunk(&buf[..n], rank, prefix.as_bytes(), stream),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        // End the rank's last line if it left one open.
        let mut open = OPEN_LINE[stream as usize].lock().unwrap_or_else(|p| p.into_inner());
        if *open == Some(rank) {
            emit(stream, b"\n");
            *open = None;
        }
        let _ = done.send(());
    };
    thread::Builder::new().name("tpar-run-output".into()).spawn(body).map_or(0, |_| 1)
}

/// Writes one chunk of `rank`'s output, prefixing the lines it starts.
fn write_chunk(chunk: &[u8], rank: usize, prefix: &[u8], stream: Stream) {
    let mut open = OPEN_LINE[stream as usize].lock().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::with_capacity(chunk.len() + 2 * prefix.len() + 1);
    let mut at_line_start = match *open {
        Some(r) if r == rank => false,
        Some(_) => {
            out.push(b'\n');
            true
        }
        None => true,
    };
    for piece in chunk.split_inclusive(|b| *b == b'\n') {
        if at_line_start {
            out.extend_from_slice(prefix);
        }
        out.extend_from_slice(piece);
        at_line_start = piece.ends_with(b"\n");
    }
    *open = if at_line_start { None } else { Some(rank) };
    emit(stream, &out);
}

/// Writes to our stdout or stderr and flushes. Errors are ignored: the forwarders keep
/// draining the ranks' pipes even when our own output is closed, so no rank blocks.
fn emit(stream: Stream, bytes: &[u8]) {
    let _ = match stream {
        Stream::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(bytes).and_then(|_| out.flush())
        }
        Stream::Stderr => {
            let mut err = io::stderr().lock();
            err.write_all(bytes).and_then(|_| err.flush())
        }
    };
}

/// `host:port`, bracketing IPv6 literals.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Where node 0's launcher listens: `addr` itself when it resolves to loopback only,
/// every interface otherwise (other nodes must reach it).
fn bind_addr(addr: &str, port: u16) -> String {
    let resolved: Vec<SocketAddr> =
        (addr, port).to_socket_addrs().map(|a| a.collect()).unwrap_or_default();
    match resolved.first() {
        Some(a) if resolved.iter().all(|a| a.ip().is_loopback()) => a.to_string(),
        Some(a) if a.is_ipv6() => format!("[::]:{port}"),
        _ => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port).to_string(),
    }
}

/// A port free on the interface rank 0's store will bind (see [`bind_addr`]).
fn free_port_any(addr: &str) -> Result<u16, LaunchError> {
    let bind = bind_addr(addr, 0);
    let err = |source| LaunchError::NoFreePort { addr: bind.clone(), source };
    let l = TcpListener::bind(&bind).map_err(err)?;
    Ok(l.local_addr().map_err(err)?.port())
}

/// A port that is free on `addr` right now (the usual race applies: another
/// process could take it before rank 0 binds it).
fn free_port(addr: &str) -> Result<u16, LaunchError> {
    let err = |source| LaunchError::NoFreePort { addr: addr.to_string(), source };
    let l = TcpListener::bind((addr, 0)).map_err(err)?;
    Ok(l.local_addr().map_err(err)?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

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
