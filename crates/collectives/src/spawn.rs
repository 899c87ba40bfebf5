//! `spawn`: run one thread per rank over a fresh [`World`], like `torch.multiprocessing.spawn`
//! for the `local` backend.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::world::DEFAULT_TIMEOUT;
use crate::{CollectiveError, RankCtx, World};

/// Stack size of rank threads: deep autograd graphs recurse.
pub const RANK_STACK_SIZE: usize = 64 << 20;

/// Which threads run a rank's parallel kernels (its rayon work).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankThreads {
    /// Every rank submits to the process's one global rayon pool (one worker per core):
    /// the ranks' work queues up on the same workers.
    Shared,
    /// Each rank runs in a rayon pool of its own of this many threads (at least 1), as
    /// processes with `OMP_NUM_THREADS = cores / ranks` would. Their allocations count
    /// as the rank's, and the pool's threads have exited (their thread-local buffers
    /// freed) when the rank returns.
    PerRank(usize),
}

impl RankThreads {
    /// A pool of its own per rank of `max(1, cores / world_size)` threads: this machine's
    /// cores split evenly between `world_size` ranks (the default; measured against
    /// [`RankThreads::Shared`] with `benches/llama_step.rs`, docs/PERF.md).
    pub fn per_rank(world_size: usize) -> RankThreads {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        RankThreads::PerRank((cores / world_size.max(1)).max(1))
    }
}

/// Rank threads a process runs per core at most: beyond that the ranks wait on each
/// other far more than they compute, and a typo (a world of a million) would start a
/// thread per rank until the machine gives out.
pub const RANKS_PER_CORE: usize = 64;

/// A number read from the first line of a file (`/proc/sys/...`), if it is one.
fn read_number(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.split_whitespace().next()?.parse().ok()
}

/// The most rank threads this process can run, with why: [`RANKS_PER_CORE`] per core,
/// and what the OS lets it start (Linux: the system's `threads-max`, the soft `Max
/// processes` limit, half of `vm.max_map_count` since each thread's stack is a mapping
/// plus a guard page), at two threads a rank (its own and its kernel pool's).
pub fn max_rank_threads() -> (usize, Vec<String>) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let by_cores = cores.saturating_mul(RANKS_PER_CORE);
    let mut bounds =
        vec![(by_cores, format!("{by_cores} at {RANKS_PER_CORE} per core on {cores} cores"))];
    let nproc = std::fs::read_to_string("/proc/self/limits").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("Max processes"))?;
        line.split_whitespace().nth(2)?.parse::<u64>().ok()
    });
    let maps = read_number("/proc/sys/vm/max_map_count").map(|m| m / 2);
    let os = [read_number("/proc/sys/kernel/threads-max"), nproc, maps].into_iter().flatten().min();
    if let Some(t) = os {
        let ranks = usize::try_from(t / 2).unwrap_or(usize::MAX);
        bounds.push((ranks, format!("{ranks} by the threads the OS lets it start")));
    }
    let limit = bounds.iter().map(|(n, _)| *n).min().unwrap_or(by_cores);
    (limit, bounds.into_iter().map(|(_, why)| why).collect())
}

/// `Err(InvalidArgument)` naming `world_size` and the limit when this process cannot run
/// that many rank threads ([`max_rank_threads`]); checked before anything is built.
fn check_world_size(world_size: usize) -> Result<(), CollectiveError> {
    let (limit, why) = max_rank_threads();
    if world_size <= limit {
        return Ok(());
    }
    Err(CollectiveError::InvalidArgument {
        op: "spawn",
        why: format!(
            "{world_size} ranks, but this process runs at most {limit} rank threads ({}); \
             run fewer ranks, or one process per rank",
            why.join("; ")
        ),
    })
}

/// How [`spawn_with`] runs its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpawnConfig {
    /// Number of ranks (threads).
    pub world_size: usize,
    /// How long collectives wait for peers (default 60 s).
    pub timeout: Duration,
    /// Stack size of each rank thread in bytes (default 64 MiB).
    pub stack_size: usize,
    /// Which threads run each rank's parallel kernels (default [`RankThreads::per_rank`]).
    pub threads: RankThreads,
}

impl SpawnConfig {
    /// `world_size` ranks with the default timeout, stack size and threads.
    pub fn new(world_size: usize) -> SpawnConfig {
        SpawnConfig {
            world_size,
            timeout: DEFAULT_TIMEOUT,
            stack_size: RANK_STACK_SIZE,
            threads: RankThreads::per_rank(world_size),
        }
    }

    /// Sets which threads run each rank's parallel kernels.
    pub fn threads(self, threads: RankThreads) -> SpawnConfig {
        SpawnConfig { threads, ..self }
    }

    /// Sets the collective timeout.
    pub fn timeout(self, timeout: Duration) -> SpawnConfig {
        SpawnConfig { timeout, ..self }
    }

    /// Sets the rank threads' stack size (at least 64 KiB is used).
    pub fn stack_size(self, bytes: usize) -> SpawnConfig {
        SpawnConfig { stack_size: bytes, ..self }
    }
}

/// Runs `f` on `world_size` rank threads (named `tpar-rank-{i}`) sharing a new [`World`]
/// with the default timeout; returns every rank's result in rank order.
///
/// If any rank fails, the world is marked failed at once, so peers blocked in collectives
/// return [`CollectiveError::PeerFailed`] instead of hanging, and `spawn` returns the
/// *originating* error: the one of the first rank that failed (a rank that panics is
/// reported as [`CollectiveError::Panicked`]), not the induced failures of its peers. A
/// rank that failed only because it timed out waiting for a slow peer (directly, or through
/// peers that were themselves waiting) blames that peer. Panics never escape `spawn`. A
/// rank that returns while peers wait for it in a collective makes them fail promptly
/// naming it.
///
/// `spawn` never hangs: after the first failure it waits at most the timeout for the other
/// ranks, then returns [`CollectiveError::Stuck`] naming the rank to blame and the ranks
/// still running (stuck outside any collective: a loop, a sleep, a blocking read in user
/// code), whose threads are left running, detached. That is why `f` is owned (`'static`):
/// a rank function shares the caller's data through an `Arc` or a clone it moves in.
///
/// The error type `E` is the rank function's: anything that a [`CollectiveError`] converts
/// into, such as `CollectiveError` itself (which converts from `TensorError`, so `?` works
/// on both), a higher layer's error enum, or `Box<dyn Error + Send + Sync>`.
///
/// ```
/// use tpar_collectives::{spawn, CollectiveError, ReduceOp};
/// use tpar_tensor::Tensor;
/// let out = spawn(4, |ctx| -> Result<Vec<f32>, CollectiveError> {
///     let t = Tensor::from_vec(vec![ctx.rank() as f32], [1])?;
///     Ok(ctx.world_group().all_gather(&t, 0)?.to_vec::<f32>()?)
/// })?;
/// assert_eq!(out[3], vec![0.0, 1.0, 2.0, 3.0]);
/// # Ok::<(), CollectiveError>(())
/// ```
pub fn spawn<R, E, F>(world_size: usize, f: F) -> Result<Vec<R>, E>
where
    R: Send + 'static,
    E: From<CollectiveError> + fmt::Display + Send + 'static,
    F: Fn(RankCtx) -> Result<R, E> + Send + Sync + 'static,
{
    spawn_with(SpawnConfig::new(world_size), f)
}

/// [`spawn`] with an explicit [`SpawnConfig`] (timeout, stack size, threads).
///
/// Returns every rank's result in rank order, or the originating error when ranks fail
/// and all finish. When ranks are still running `config.timeout` after the first
/// failure, returns [`CollectiveError::Stuck`] naming the rank to blame, its error and the
/// ranks still running; their threads are left running, detached (they own everything
/// they use, so this is sound), and the process can exit non-zero.
///
/// ```
/// use std::time::{Duration, Instant};
/// use tpar_collectives::{spawn_with, CollectiveError, SpawnConfig};
/// let cfg = SpawnConfig::new(2).timeout(Duration::from_millis(200));
/// let t0 = Instant::now();
/// // Rank 1 never joins the barrier: rank 0 times out naming it, and `spawn_with`
/// // returns one timeout later without waiting for rank 1's sleep to end.
/// let err = spawn_with(cfg, |ctx| -> Result<(), CollectiveError> {
///     if ctx.rank() == 0 {
///         ctx.world_group().barrier()?;
///     } else {
///         std::thread::sleep(Duration::from_secs(5)); // stuck in user code
///     }
///     Ok(())
/// })
/// .unwrap_err();
/// assert!(t0.elapsed() < Duration::from_secs(4));
/// assert_eq!(err.culprit(), Some(1));
/// assert!(matches!(err, CollectiveError::Stuck { rank: 1, ref running, .. } if running == &[1]));
/// ```
pub fn spawn_with<R, E, F>(config: SpawnConfig, f: F) -> Result<Vec<R>, E>
where
    R: Send + 'static,
    E: From<CollectiveError> + fmt::Display + Send + 'static,
    F: Fn(RankCtx) -> Result<R, E> + Send + Sync + 'static,
{
    check_world_size(config.world_size)?;
    let world = World::with_timeout(config.world_size, config.timeout)?;
    let stack = config.stack_size.max(64 << 10);
    let threads = config.threads;
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel::<(usize, Result<R, E>)>();
    let mut handles = Vec::with_capacity(world.size());
    let start_error = start_ranks(&world, |rank, ctx| {
        let (w, f, tx) = (world.clone(), Arc::clone(&f), tx.clone());
        let h = std::thread::Builder::new()
            .name(format!("tpar-rank-{rank}"))
            .stack_size(stack)
            .spawn(move || {
                let r = run_rank(&w, rank, ctx, &*f, threads, stack);
                // The receiver is gone when `spawn_with` already returned: nothing to do.
                let _ = tx.send((rank, r));
            })?;
        handles.push(h);
        Ok(())
    });
    drop(tx);
    let r = gather(&world, &rx, start_error, config.timeout, Stuck::Return);
    if r.is_ok() {
        for h in handles {
            // Every thread has sent its result; joining only reaps it.
            let _ = h.join();
        }
    }
    // Else threads still running are detached: dropping a JoinHandle does not wait.
    r
}

/// [`spawn_with`] by its former name (it was the variant that returns despite a rank stuck
/// outside any collective; now every `spawn` does).
pub fn spawn_owned<R, E, F>(config: SpawnConfig, f: F) -> Result<Vec<R>, E>
where
    R: Send + 'static,
    E: From<CollectiveError> + fmt::Display + Send + 'static,
    F: Fn(RankCtx) -> Result<R, E> + Send + Sync + 'static,
{
    spawn_with(config, f)
}

/// [`spawn_with`] for a rank function that borrows from the caller (`Fn + Sync`, not
/// `'static`), as [`std::thread::scope`] is to [`std::thread::spawn`]: it returns only
/// once every rank's thread has finished.
///
/// Results and errors are those of [`spawn_with`], and a rank that fails still makes its
/// peers in collectives fail promptly, or after the timeout. But a rank stuck outside any
/// collective (a loop, a sleep, a blocking read in user code) cannot be interrupted, and
/// since `f` may borrow from the caller's stack, `spawn_scoped` must wait for it: one
/// timeout after the first failure it writes the [`CollectiveError::Stuck`] message naming
/// the failed rank and the ranks still running to standard error, then keeps waiting. Use
/// it for tests and benches that share the caller's data; a trainer uses [`spawn`].
///
/// ```
/// use std::sync::Mutex;
/// use tpar_collectives::{spawn_scoped, CollectiveError, SpawnConfig};
/// let seen = Mutex::new(Vec::new());
/// spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
///     seen.lock().unwrap().push(ctx.rank());
///     ctx.world_group().barrier()
/// })?;
/// assert_eq!(seen.into_inner().unwrap().len(), 3);
/// # Ok::<(), CollectiveError>(())
/// ```
pub fn spawn_scoped<R, E, F>(config: SpawnConfig, f: F) -> Result<Vec<R>, E>
where
    R: Send,
    E: From<CollectiveError> + fmt::Display + Send,
    F: Fn(RankCtx) -> Result<R, E> + Sync,
{
    check_world_size(config.world_size)?;
    let world = World::with_timeout(config.world_size, config.timeout)?;
    let stack = config.stack_size.max(64 << 10);
    let threads = config.threads;
    let f = &f;
    let (tx, rx) = mpsc::channel::<(usize, Result<R, E>)>();
    std::thread::scope(|s| {
        let start_error = start_ranks(&world, |rank, ctx| {
            let (w, tx) = (world.clone(), tx.clone());
            std::thread::Builder::new()
                .name(format!("tpar-rank-{rank}"))
                .stack_size(stack)
                .spawn_scoped(s, move || {
                    let r = run_rank(&w, rank, ctx, f, threads, stack);
                    let _ = tx.send((rank, r));
                })?;
            Ok(())
        });
        drop(tx);
        // The scope joins every thread before returning.
        gather(&world, &rx, start_error, config.timeout, Stuck::Warn)
    })
}

/// Starts a thread per rank with `start`; on the first rank that cannot start, marks the
/// world failed and returns why (the ranks started so far fail promptly).
fn start_ranks(
    world: &World,
    mut start: impl FnMut(usize, RankCtx) -> std::io::Result<()>,
) -> Option<CollectiveError> {
    for rank in 0..world.size() {
        let ctx = match world.rank(rank) {
            Ok(c) => c,
            Err(e) => {
                world.fail(rank, e.to_string());
                return Some(e);
            }
        };
        if let Err(e) = start(rank, ctx) {
            let why = format!("could not start its thread: {e}");
            world.fail(rank, why.clone());
            return Some(CollectiveError::Unavailable { what: format!("rank {rank}"), why });
        }
    }
    None
}

/// What [`gather`] does when ranks are still running one timeout after the first failure.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stuck {
    /// Return [`CollectiveError::Stuck`] (the rank threads own what they use).
    Return,
    /// Write the `Stuck` message to standard error and keep waiting (they may borrow).
    Warn,
}

/// Collects every started rank's result from `rx` (in rank order), and returns them, or
/// the originating error: the error of the rank whose report failed the world (its own, or
/// its timeout naming the peer that held it up), else the lowest failed rank's.
fn gather<R, E>(
    world: &World,
    rx: &mpsc::Receiver<(usize, Result<R, E>)>,
    start_error: Option<CollectiveError>,
    timeout: Duration,
    stuck: Stuck,
) -> Result<Vec<R>, E>
where
    E: From<CollectiveError>,
{
    let n = world.size();
    let mut results: Vec<Option<Result<R, E>>> = (0..n).map(|_| None).collect();
    let mut failed_at: Option<Instant> = start_error.as_ref().map(|_| Instant::now());
    loop {
        let msg = match failed_at {
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(t) => match (t + timeout).checked_duration_since(Instant::now()) {
                Some(left) => rx.recv_timeout(left),
                None => Err(mpsc::RecvTimeoutError::Timeout),
            },
        };
        match msg {
            Ok((rank, r)) => {
                if r.is_err() && failed_at.is_none() {
                    failed_at = Some(Instant::now());
                }
                if let Some(slot) = results.get_mut(rank) {
                    *slot = Some(r);
                }
            }
            // Every sender is gone: run_rank never unwinds, so every started rank reported.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let running: Vec<usize> = (0..n).filter(|&r| results[r].is_none()).collect();
                let (rank, why) = world.failure().unwrap_or_else(|| {
                    let rank = results.iter().position(|r| matches!(r, Some(Err(_)))).unwrap_or(0);
                    (rank, "failed".to_string())
                });
                let e = CollectiveError::Stuck { rank, why, running, waited: timeout };
                match stuck {
                    Stuck::Return => return Err(E::from(e)),
                    Stuck::Warn => {
                        eprintln!(
                            "tpar spawn_scoped: {e}; waiting for them, as their rank function \
                             may borrow from the caller (`spawn` would return now)"
                        );
                        // From now on, wait without a deadline.
                        while let Ok((rank, r)) = rx.recv() {
                            if let Some(slot) = results.get_mut(rank) {
                                *slot = Some(r);
                            }
                        }
                        break;
                    }
                }
            }
        }
    }
    if let Some(e) = start_error {
        return Err(E::from(e));
    }
    let mut values = Vec::with_capacity(n);
    let mut errors = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok(v)) => values.push(v),
            Some(Err(e)) => errors.push((rank, e)),
            None => {}
        }
    }
    if errors.is_empty() {
        return Ok(values);
    }
    let first = world.reporter().or(world.failure().map(|(rank, _)| rank));
    let pick = errors.iter().position(|(r, _)| Some(*r) == first).unwrap_or(0);
    Err(errors.swap_remove(pick).1)
}

fn run_rank<R, E, F>(
    world: &World,
    rank: usize,
    ctx: RankCtx,
    f: &F,
    threads: RankThreads,
    stack: usize,
) -> Result<R, E>
where
    R: Send,
    E: From<CollectiveError> + fmt::Display + Send,
    F: Fn(RankCtx) -> Result<R, E> + Sync,
{
    tpar_tensor::memory::set_rank(Some(rank));
    let r = match catch_unwind(AssertUnwindSafe(|| in_rank_pool(rank, threads, stack, || f(ctx)))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            world.fail_reported(rank, e.to_string());
            Err(e)
        }
        Err(p) => {
            let message = panic_message(&*p);
            world.fail_reported(rank, format!("panicked: {message}"));
            Err(E::from(CollectiveError::Panicked { rank, message }))
        }
    };
    world.mark_exited(rank);
    r
}

/// Runs `f` on the rank's threads: here (the shared pool), or on a pool of the rank's own
/// whose workers count their allocations as the rank's. A pool that cannot be built
/// (no threads left) falls back to the shared pool.
///
/// The rank's own pool is joined before this returns: its workers' thread-local buffers
/// (the kernels' packing buffers, counted as the rank's) are freed when a worker exits,
/// and a worker that outlived the call would free them later, into the accounting of
/// whatever runs as that rank next. The wait for the workers to exit is bounded
/// ([`POOL_EXIT_WAIT`]); workers still running then are left to finish on their own.
fn in_rank_pool<T: Send>(
    rank: usize,
    threads: RankThreads,
    stack: usize,
    f: impl FnOnce() -> T + Send,
) -> T {
    let RankThreads::PerRank(n) = threads else {
        return f();
    };
    let exited = Arc::new((Mutex::new(0usize), Condvar::new()));
    let mut workers = Vec::new();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n.max(1))
        .start_handler(move |_| tpar_tensor::memory::set_rank(Some(rank)))
        .exit_handler({
            let exited = exited.clone();
            move |_| {
                let (count, cv) = &*exited;
                *count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
                cv.notify_all();
            }
        })
        .spawn_handler(|worker| {
            let name = format!("tpar-rank-{rank}-{}", worker.index());
            let h = std::thread::Builder::new()
                .name(name)
                .stack_size(stack)
                .spawn(move || worker.run())?;
            workers.push(h);
            Ok(())
        })
        .build();
    let pool = match pool {
        Ok(pool) => pool,
        Err(_) => return f(),
    };
    let r = pool.install(f);
    drop(pool);
    let (count, cv) = &*exited;
    let deadline = Instant::now() + POOL_EXIT_WAIT;
    let mut done = count.lock().unwrap_or_else(PoisonError::into_inner);
    while *done < workers.len() {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
        done = cv.wait_timeout(done, left).unwrap_or_else(PoisonError::into_inner).0;
    }
    let all = *done >= workers.len();
    drop(done);
    if all {
        // Past their exit handlers the workers only run their thread-local destructors.
        for w in workers {
            let _ = w.join();
        }
    }
    r
}

/// How long a rank's own pool waits for its workers to exit after the rank's work.
const POOL_EXIT_WAIT: Duration = Duration::from_secs(10);

/// The text of a panic payload.
/// Runs `f`, turning a panic into `Err(message)`.
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| panic_message(&*p))
}

pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}
