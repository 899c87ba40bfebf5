//! Bus bandwidth of the `tcp` backend across real processes, with and without shared
//! memory between them, next to the `local` backend (ranks as threads) and a
//! single-thread memcpy, all measured in the same run.
//!
//! `cargo bench -p tpar-launch --bench tcp_bandwidth` (add `-- --quick` to skip 256 MiB,
//! `-- --max-mib N` to stop at N MiB, `-- --min-kib N` to add sizes from N KiB up to
//! 1 MiB by factors of 4, `-- --repeat R` to run each `tcp` world R times, alternating
//! with and without shared memory, and keep each row's fastest run, `-- --shm-min-bytes
//! B` to send payloads of B bytes and more through shared memory instead of the default
//! threshold, `-- --worlds 2,4` to pick world sizes, `-- --ops all_reduce,all_gather,sendrecv`
//! to pick ops: `sendrecv` is a round trip of one frame each way between ranks 2i and
//! 2i+1, the cost of a frame without a collective around it). For each world size the bench
//! re-executes itself once per rank (child mode selected by `TPAR_TCP_BENCH_CHILD`) with
//! the environment `tpar-run` gives its children (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), plus `TPAR_TCP_SHM=0` for the rows marked `tcp` (every
//! pair of processes on its loopback socket) and `TPAR_TCP_SHM=1` for the rows marked
//! `tcp+shm` (payloads above the threshold through shared memory); every child builds
//! its world with `init_process_group_with("tcp", ..)` through the TCP store rank 0
//! hosts, and rank 0 reports its times to the parent, which prints every row. Sizes and
//! bandwidths follow nccl-tests, as the `local` backend's `bus_bandwidth` bench does:
//!
//! - algbw = size / time, with size the all_reduce buffer, or the all_gather *output*
//!   (each rank contributes size / n);
//! - busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for all_gather;
//! - busbw/cpy: against a single-thread memcpy into a reused buffer of the same size;
//!   busbw/local: against the `local` backend at the same world size, op and size;
//!   shm/tcp: a `tcp+shm` row's busbw against the `tcp` row of the same world, op and
//!   size.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tpar_collectives::tcp::{TCP_SHM_ENV, TCP_SHM_MIN_ENV};
use tpar_collectives::{spawn_scoped, CollectiveError, ProcessGroup, ReduceOp, SpawnConfig};
use tpar_tensor::Tensor;

const MIB: usize = 1 << 20;
/// Selects child mode; its value is unused.
const CHILD_ENV: &str = "TPAR_TCP_BENCH_CHILD";
/// The sizes to measure, in bytes, comma-separated (set by the parent for its children).
const SIZES_ENV: &str = "TPAR_TCP_BENCH_SIZES";
/// The ops to measure, comma-separated (set by the parent for its children).
const OPS_ENV: &str = "TPAR_TCP_BENCH_OPS";
/// The collective timeout of the children.
const TIMEOUT: Duration = Duration::from_secs(600);

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Single-thread memcpy bandwidth into a reused, already-touched buffer (best of 5).
fn memcpy_bandwidth(bytes: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    dst.copy_from_slice(&src); // warm up, fault in
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t0.elapsed());
        std::hint::black_box(&dst);
    }
    gbps(bytes, best)
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    AllReduce,
    AllGather,
    /// A round trip between ranks `2i` and `2i + 1`: the even one sends `size` bytes and
    /// receives as many back (the cost of moving one frame each way; world sizes even).
    SendRecv,
}

const OPS: [Op; 3] = [Op::AllReduce, Op::AllGather, Op::SendRecv];

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::SendRecv => "sendrecv",
        }
    }

    /// nccl-tests' factor from algbw to busbw at world size `n` (a round trip's algbw
    /// counts both directions).
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather => (n - 1.0) / n,
            Op::SendRecv => 1.0,
        }
    }

    /// Bytes moved per call, for algbw.
    fn bytes(self, size: usize) -> usize {
        match self {
            Op::SendRecv => 2 * size,
            _ => size,
        }
    }
}

/// The ops named in a comma-separated list.
fn parse_ops(list: &str) -> Res<Vec<Op>> {
    list.split(',')
        .map(|name| {
            let name = name.trim();
            OPS.iter().copied().find(|o| o.name() == name).ok_or_else(|| {
                format!("unknown op {name:?} (all_reduce, all_gather, sendrecv)").into()
            })
        })
        .collect()
}

/// Average time per call, measured on every rank between barriers; the slowest rank counts.
/// CPU time of this whole process so far (every thread), in seconds; NaN where unknown.
fn process_cpu() -> f64 {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
        if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } == 0 {
            return ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
        }
    }
    f64::NAN
}

/// Per call: the time, measured on every rank between barriers (the slowest rank counts),
/// and the CPU time of the job (every rank's process, summed when `processes`; this
/// process alone, whose threads are all the ranks, otherwise).
fn time_op(
    pg: &ProcessGroup,
    op: Op,
    size: usize,
    processes: bool,
) -> Result<(Duration, f64), CollectiveError> {
    let n = pg.size();
    let elems = match op {
        Op::AllReduce => size / 4,
        Op::AllGather => size / 4 / n,
        Op::SendRecv => size / 4,
    };
    let x = Tensor::from_vec(vec![pg.rank() as f32 + 1.0; elems], [elems])?;
    let run = |x: &Tensor| -> Result<Tensor, CollectiveError> {
        match op {
            Op::AllReduce => pg.all_reduce(x, ReduceOp::Sum),
            Op::AllGather => pg.all_gather(x, 0),
            Op::SendRecv => {
                let (r, peer) = (pg.rank(), pg.rank() ^ 1);
                if peer >= pg.size() {
                    return Ok(x.clone());
                }
                if r % 2 == 0 {
                    pg.send(x, peer)?;
                    pg.recv(peer)
                } else {
                    let got = pg.recv(peer)?;
                    pg.send(&got, peer)?;
                    Ok(got)
                }
            }
        }
    };
    // Roughly 512 MiB of payload per measurement, at least 3 calls, at most 300.
    let iters = (512 * MIB / size).clamp(3, 300);
    drop(run(&x)?);
    pg.barrier()?;
    let (t0, c0) = (Instant::now(), process_cpu());
    for _ in 0..iters {
        std::hint::black_box(run(&x)?);
    }
    pg.barrier()?;
    let mine = t0.elapsed() / iters as u32;
    let cpu = (process_cpu() - c0) / iters as f64;
    let t = Tensor::from_vec(vec![mine.as_secs_f64()], [1])?;
    let slowest = pg.all_reduce(&t, ReduceOp::Max)?.item()?;
    let cpu = if processes {
        pg.all_reduce(&Tensor::from_vec(vec![cpu], [1])?, ReduceOp::Sum)?.item()?
    } else {
        cpu
    };
    Ok((Duration::from_secs_f64(slowest), cpu))
}

fn header() {
    println!(
        "{:>5}  {:<7} {:<10} {:>9} {:>11} {:>10} {:>12} {:>12} {:>10} {:>12} {:>8}",
        "world",
        "backend",
        "op",
        "size",
        "time (us)",
        "cpu (us)",
        "algbw (GB/s)",
        "busbw (GB/s)",
        "busbw/cpy",
        "busbw/local",
        "shm/tcp"
    );
}

/// A size for people: `256 KiB`, `16 MiB`.
fn show_size(bytes: usize) -> String {
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes / 1024)
    }
}

/// Everything a printed row needs.
struct Row {
    world: usize,
    backend: &'static str,
    op: Op,
    size: usize,
    time: Duration,
    /// CPU time of the whole job per call, in seconds.
    cpu: f64,
    cpy: f64,
    local: f64,
    /// The `tcp` row's busbw, for a `tcp+shm` row.
    tcp: Option<f64>,
}

impl Row {
    fn busbw(&self) -> f64 {
        gbps(self.op.bytes(self.size), self.time) * self.op.bus_factor(self.world)
    }

    fn print(&self) {
        let algbw = gbps(self.op.bytes(self.size), self.time);
        let busbw = self.busbw();
        let ratio = self.tcp.map_or(String::from("-"), |t| format!("{:.2}", busbw / t));
        println!(
            "{:>5}  {:<7} {:<10} {:>9} {:>11.1} {:>10.1} {algbw:>12.2} {busbw:>12.2} {:>10.2} \
             {:>12.2} {ratio:>8}",
            self.world,
            self.backend,
            self.op.name(),
            show_size(self.size),
            self.time.as_secs_f64() * 1e6,
            self.cpu * 1e6,
            busbw / self.cpy,
            busbw / self.local
        );
    }
}

/// One measured row of a `tcp` world.
#[derive(Clone, Copy)]
struct Timed {
    op: Op,
    size: usize,
    time: Duration,
    /// CPU seconds per call, every rank's process summed.
    cpu: f64,
}

/// Opens each line a child rank 0 reports: `ROW <op> <size in bytes> <seconds> <cpu
/// seconds>`.
const ROW_TAG: &str = "ROW";

/// One rank of a `tcp` world: times every op and size; rank 0 reports them on stdout.
fn child() -> Res<()> {
    let sizes: Vec<usize> = std::env::var(SIZES_ENV)?
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<_, _>>()?;
    let ops = parse_ops(&std::env::var(OPS_ENV)?)?;
    let pg = tpar_launch::init_process_group_with("tcp", TIMEOUT)?;
    let mut rows = Vec::new();
    for op in ops {
        for &size in &sizes {
            rows.push((op, size, time_op(&pg, op, size, true)?));
        }
    }
    pg.barrier()?; // before rank 0, which hosts the store, exits
    if pg.rank() == 0 {
        for (op, size, (t, cpu)) in rows {
            println!("{ROW_TAG} {} {size} {} {cpu}", op.name(), t.as_secs_f64());
        }
    }
    Ok(())
}

fn free_port() -> std::io::Result<u16> {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port())
}

/// Runs `world` children of this binary as one `tcp` world, with shared memory on or off
/// (on: from `shm_min` bytes, else the backend's default threshold), and returns rank 0's
/// times by op and size.
fn run_tcp_world(
    world: usize,
    ops: &[Op],
    sizes: &[usize],
    shm: bool,
    shm_min: Option<usize>,
) -> Res<Vec<Timed>> {
    let exe = std::env::current_exe()?;
    let port = free_port()?.to_string();
    let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let mut children = Vec::with_capacity(world);
    for rank in 0..world {
        let mut c = Command::new(&exe);
        c.env(CHILD_ENV, "1")
            .env(SIZES_ENV, list.join(","))
            .env(OPS_ENV, ops.iter().map(|o| o.name()).collect::<Vec<_>>().join(","))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env(TCP_SHM_ENV, if shm { "1" } else { "0" })
            .stdout(if rank == 0 { Stdio::piped() } else { Stdio::inherit() });
        match shm_min {
            Some(min) => c.env(TCP_SHM_MIN_ENV, min.to_string()),
            None => c.env_remove(TCP_SHM_MIN_ENV),
        };
        children.push(c.spawn()?);
    }
    let mut failed = Vec::new();
    let mut times = Vec::new();
    for (rank, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            failed.push(format!("rank {rank}: {}", out.status));
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let op = OPS.iter().copied().find(|o| f.get(1) == Some(&o.name()));
            match (f.first(), op, f.get(2).and_then(|s| s.parse::<usize>().ok())) {
                (Some(&ROW_TAG), Some(op), Some(size)) => {
                    let num = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok());
                    let secs = num(3).unwrap_or(0.0).max(0.0);
                    let cpu = num(4).unwrap_or(f64::NAN);
                    times.push(Timed { op, size, time: Duration::from_secs_f64(secs), cpu });
                }
                _ => println!("{line}"),
            }
        }
    }
    if failed.is_empty() {
        Ok(times)
    } else {
        Err(format!("tcp world of {world} failed: {}", failed.join(", ")).into())
    }
}

/// The value after flag `name`, parsed.
fn flag<T: std::str::FromStr>(args: &[String], name: &str) -> Res<Option<T>>
where
    T::Err: std::error::Error + 'static,
{
    match args.iter().position(|a| a == name) {
        Some(i) => {
            let v = args.get(i + 1).ok_or_else(|| format!("{name} needs a value"))?;
            Ok(Some(v.parse::<T>()?))
        }
        None => Ok(None),
    }
}

fn main() -> Res<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child().inspect_err(|e| eprintln!("tcp_bandwidth child: {e}"));
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let max_mib = flag::<usize>(&args, "--max-mib")?.unwrap_or(if quick { 64 } else { 256 });
    let repeat = flag::<usize>(&args, "--repeat")?.unwrap_or(1).max(1);
    let shm_min = flag::<usize>(&args, "--shm-min-bytes")?;
    let ops =
        parse_ops(&flag::<String>(&args, "--ops")?.unwrap_or("all_reduce,all_gather".into()))?;
    let worlds: Vec<usize> = match flag::<String>(&args, "--worlds")? {
        Some(w) => w.split(',').map(|x| x.trim().parse::<usize>()).collect::<Result<_, _>>()?,
        None => vec![2, 4],
    };
    let mut sizes: Vec<usize> = Vec::new();
    if let Some(kib) = flag::<usize>(&args, "--min-kib")? {
        let mut s = kib.max(1) * 1024;
        while s < MIB {
            sizes.push(s);
            s *= 4;
        }
    }
    sizes.extend([1, 16, 64, 256].into_iter().filter(|&m| m <= max_mib).map(|m| m * MIB));
    if sizes.is_empty() {
        return Err("--max-mib leaves no size (the smallest is 1 MiB)".into());
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "tpar tcp backend bus bandwidth (f32, out of place, loopback; {threads} hardware \
         threads; a world of n is n processes; tcp: TPAR_TCP_SHM=0, tcp+shm: shared memory \
         from {}; best of {repeat} run(s) per tcp row)",
        shm_min.map_or_else(
            || "the backend's default threshold".to_string(),
            |b| format!("{b} bytes")
        )
    );
    println!();
    println!("single-thread memcpy, reused dst (GB/s)");
    let memcpy: Vec<f64> = sizes.iter().map(|&s| memcpy_bandwidth(s)).collect();
    for (&size, cpy) in sizes.iter().zip(&memcpy) {
        println!("{:>9} {cpy:>8.2}", show_size(size));
    }
    println!();
    header();
    for world in worlds {
        // The local backend first (ranks as threads), then the same world as processes.
        // busbw of the local backend by op and size.
        let mut local: Vec<(Op, usize, f64)> = Vec::new();
        for &op in &ops {
            let rows = spawn_scoped(
                SpawnConfig::new(world),
                |ctx| -> Result<Vec<(Duration, f64)>, CollectiveError> {
                    let pg = ctx.world_group();
                    sizes.iter().map(|&s| time_op(&pg, op, s, false)).collect()
                },
            )?;
            for (i, (&size, &(time, cpu))) in sizes.iter().zip(&rows[0]).enumerate() {
                let row = Row {
                    world,
                    backend: "local",
                    op,
                    size,
                    time,
                    cpu,
                    cpy: memcpy[i],
                    local: 1.0,
                    tcp: None,
                };
                let busbw = row.busbw();
                local.push((op, size, busbw));
                Row { local: busbw, ..row }.print();
            }
        }
        // Without and with shared memory, alternating; each row keeps its fastest run.
        let mut best: [Vec<Timed>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..repeat {
            for (k, shm) in [false, true].into_iter().enumerate() {
                let times = run_tcp_world(world, &ops, &sizes, shm, shm_min)?;
                if best[k].is_empty() {
                    best[k] = times;
                } else {
                    for (b, t) in best[k].iter_mut().zip(times) {
                        if t.time < b.time {
                            *b = t;
                        }
                    }
                }
            }
        }
        let mut tcp_busbw = Vec::new();
        for (k, backend) in ["tcp", "tcp+shm"].into_iter().enumerate() {
            for &Timed { op, size, time, cpu } in &best[k] {
                let i = sizes.iter().position(|&s| s == size).unwrap_or(0);
                let l = local
                    .iter()
                    .find(|(o, s, _)| *o == op && *s == size)
                    .map_or(f64::NAN, |&(_, _, b)| b);
                let tcp = (k == 1)
                    .then(|| tcp_busbw.iter().find(|(o, s, _)| *o == op && *s == size))
                    .flatten()
                    .map(|&(_, _, b)| b);
                let row =
                    Row { world, backend, op, size, time, cpu, cpy: memcpy[i], local: l, tcp };
                if k == 0 {
                    tcp_busbw.push((op, size, row.busbw()));
                }
                row.print();
            }
        }
    }
    Ok(())
}
