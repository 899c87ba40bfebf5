//! Bus bandwidth of the `tcp` backend across real processes, next to the `local` backend
//! (ranks as threads) and a single-thread memcpy, all measured in the same run.
//!
//! `cargo bench -p tpar-launch --bench tcp_bandwidth` (add `-- --quick` to skip 256 MiB,
//! or `-- --max-mib N` to stop at N MiB). For world sizes 2 and 4 the bench re-executes
//! itself once per rank (child mode selected by `TPAR_TCP_BENCH_CHILD`) with the
//! environment `tpar-run` gives its children (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`); every child builds its world with
//! `init_process_group_with("tcp", ..)` through the TCP store rank 0 hosts, and rank 0
//! prints the rows of its world. Sizes and bandwidths follow nccl-tests, as the `local`
//! backend's `bus_bandwidth` bench does:
//!
//! - algbw = size / time, with size the all_reduce buffer, or the all_gather *output*
//!   (each rank contributes size / n);
//! - busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for all_gather;
//! - busbw/cpy: against a single-thread memcpy into a reused buffer of the same size;
//!   busbw/local: against the `local` backend at the same world size, op and size.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use tpar_collectives::{spawn, CollectiveError, ProcessGroup, ReduceOp};
use tpar_tensor::Tensor;

const MIB: usize = 1 << 20;
/// Selects child mode; its value is unused.
const CHILD_ENV: &str = "TPAR_TCP_BENCH_CHILD";
/// The sizes to measure, in MiB, comma-separated (set by the parent for its children).
const SIZES_ENV: &str = "TPAR_TCP_BENCH_SIZES";
/// The baselines rank 0 prints its rows against: `size_mib,memcpy,local_ar,local_ag;...`
/// (GB/s; the local columns are busbw at the child's world size).
const REF_ENV: &str = "TPAR_TCP_BENCH_REF";
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
}

const OPS: [Op; 2] = [Op::AllReduce, Op::AllGather];

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
        }
    }

    /// nccl-tests' factor from algbw to busbw at world size `n`.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather => (n - 1.0) / n,
        }
    }
}

/// Average time per call, measured on every rank between barriers; the slowest rank counts.
fn time_op(pg: &ProcessGroup, op: Op, size: usize) -> Result<Duration, CollectiveError> {
    let n = pg.size();
    let elems = match op {
        Op::AllReduce => size / 4,
        Op::AllGather => size / 4 / n,
    };
    let x = Tensor::from_vec(vec![pg.rank() as f32 + 1.0; elems], [elems])?;
    let run = |x: &Tensor| -> Result<Tensor, CollectiveError> {
        match op {
            Op::AllReduce => pg.all_reduce(x, ReduceOp::Sum),
            Op::AllGather => pg.all_gather(x, 0),
        }
    };
    // Roughly 512 MiB of payload per measurement, at least 3 calls.
    let iters = (512 * MIB / size).clamp(3, 30);
    drop(run(&x)?);
    pg.barrier()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(run(&x)?);
    }
    pg.barrier()?;
    let mine = t0.elapsed() / iters as u32;
    let t = Tensor::from_vec(vec![mine.as_secs_f64()], [1])?;
    let slowest = pg.all_reduce(&t, ReduceOp::Max)?.item()?;
    Ok(Duration::from_secs_f64(slowest))
}

fn header() {
    println!(
        "{:>5}  {:<7} {:<10} {:>9} {:>11} {:>12} {:>12} {:>10} {:>12}",
        "world",
        "backend",
        "op",
        "size",
        "time (us)",
        "algbw (GB/s)",
        "busbw (GB/s)",
        "busbw/cpy",
        "busbw/local"
    );
}

fn row(world: usize, backend: &str, op: Op, size: usize, t: Duration, cpy: f64, local: f64) {
    let algbw = gbps(size, t);
    let busbw = algbw * op.bus_factor(world);
    println!(
        "{world:>5}  {backend:<7} {:<10} {:>5} MiB {:>11.1} {algbw:>12.2} {busbw:>12.2} \
         {:>10.2} {:>12.2}",
        op.name(),
        size / MIB,
        t.as_secs_f64() * 1e6,
        busbw / cpy,
        busbw / local
    );
}

/// One rank of a `tcp` world: times every op and size; rank 0 prints the rows.
fn child() -> Res<()> {
    let sizes: Vec<usize> = std::env::var(SIZES_ENV)?
        .split(',')
        .map(|s| s.trim().parse::<usize>().map(|m| m * MIB))
        .collect::<Result<_, _>>()?;
    let refs: Vec<(f64, f64, f64)> = std::env::var(REF_ENV)?
        .split(';')
        .map(|r| {
            let v: Vec<f64> = r.split(',').map(|x| x.trim().parse().unwrap_or(f64::NAN)).collect();
            let at = |i: usize| v.get(i).copied().unwrap_or(f64::NAN);
            (at(1), at(2), at(3))
        })
        .collect();
    let pg = tpar_launch::init_process_group_with("tcp", TIMEOUT)?;
    let n = pg.size();
    let mut rows = Vec::new();
    for op in OPS {
        for &size in &sizes {
            rows.push((op, size, time_op(&pg, op, size)?));
        }
    }
    pg.barrier()?; // before rank 0, which hosts the store, exits
    if pg.rank() == 0 {
        for (op, size, t) in rows {
            let i = sizes.iter().position(|&s| s == size).unwrap_or(0);
            let (cpy, ar, ag) = refs.get(i).copied().unwrap_or((f64::NAN, f64::NAN, f64::NAN));
            let local = if op == Op::AllReduce { ar } else { ag };
            row(n, "tcp", op, size, t, cpy, local);
        }
    }
    Ok(())
}

fn free_port() -> std::io::Result<u16> {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port())
}

/// Runs `world` children of this binary as one `tcp` world and waits for them.
fn run_tcp_world(world: usize, sizes: &[usize], refs: &str) -> Res<()> {
    let exe = std::env::current_exe()?;
    let port = free_port()?.to_string();
    let list: Vec<String> = sizes.iter().map(|s| (s / MIB).to_string()).collect();
    let mut children = Vec::with_capacity(world);
    for rank in 0..world {
        children.push(
            Command::new(&exe)
                .env(CHILD_ENV, "1")
                .env(SIZES_ENV, list.join(","))
                .env(REF_ENV, refs)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .spawn()?,
        );
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            failed.push(format!("rank {rank}: {status}"));
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("tcp world of {world} failed: {}", failed.join(", ")).into())
    }
}

fn main() -> Res<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child().inspect_err(|e| eprintln!("tcp_bandwidth child: {e}"));
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let max_mib = match args.iter().position(|a| a == "--max-mib") {
        Some(i) => args.get(i + 1).ok_or("--max-mib needs a value")?.parse::<usize>()?,
        None if quick => 64,
        None => 256,
    };
    let sizes: Vec<usize> =
        [1, 16, 64, 256].into_iter().filter(|&m| m <= max_mib).map(|m| m * MIB).collect();
    if sizes.is_empty() {
        return Err("--max-mib leaves no size (the smallest is 1 MiB)".into());
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "tpar tcp backend bus bandwidth (f32, out of place, loopback; {threads} hardware \
         threads; a world of n is n processes)"
    );
    println!();
    println!("single-thread memcpy, reused dst (GB/s)");
    let memcpy: Vec<f64> = sizes.iter().map(|&s| memcpy_bandwidth(s)).collect();
    for (&size, cpy) in sizes.iter().zip(&memcpy) {
        println!("{:>5} MiB {cpy:>8.2}", size / MIB);
    }
    println!();
    header();
    for world in [2usize, 4] {
        // The local backend first (ranks as threads), then the same world as processes.
        let mut local = vec![(0.0, 0.0); sizes.len()];
        for op in OPS {
            let rows = spawn(world, |ctx| -> Result<Vec<Duration>, CollectiveError> {
                let pg = ctx.world_group();
                sizes.iter().map(|&s| time_op(&pg, op, s)).collect()
            })?;
            for (i, (&size, &t)) in sizes.iter().zip(&rows[0]).enumerate() {
                let busbw = gbps(size, t) * op.bus_factor(world);
                match op {
                    Op::AllReduce => local[i].0 = busbw,
                    Op::AllGather => local[i].1 = busbw,
                }
                row(world, "local", op, size, t, memcpy[i], busbw);
            }
        }
        let refs: Vec<String> = sizes
            .iter()
            .zip(&memcpy)
            .zip(&local)
            .map(|((s, c), (ar, ag))| format!("{},{c},{ar},{ag}", s / MIB))
            .collect();
        run_tcp_world(world, &sizes, &refs.join(";"))?;
    }
    Ok(())
}
