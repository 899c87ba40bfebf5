//! Bus bandwidth of the `local` backend, reported the way nccl-tests does.
//!
//! `cargo bench -p tpar-collectives --bench bus_bandwidth` (add `-- --quick` for small
//! sizes only). For each world size and message size it times `all_reduce` and
//! `all_gather` (f32) and prints:
//!
//! - algbw = size / time, with size the all_reduce buffer, or the all_gather *output*
//!   (each rank contributes size / n), as nccl-tests counts it;
//! - busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for all_gather;
//!
//! next to the single-thread memcpy bandwidth of this machine at the same size, measured in
//! the same run (busbw/cpy is against memcpy into a reused buffer). Plain collectives are
//! out of place, so each call also allocates its output: from 256 KiB the host cache
//! (`tpar_memory::cache`) hands back the buffer a previous call's output left, while
//! a fresh mapping would fault in page by page, which the "fresh dst" memcpy column
//! shows on its own. The `_into` rows write into one output
//! buffer the caller keeps (`all_reduce_into`, `all_gather_into`); the `all_reduce_` row
//! reduces in place, into the input itself.

use std::time::{Duration, Instant};

use tpar_collectives::{spawn_scoped, CollectiveError, ProcessGroup, ReduceOp, SpawnConfig};
use tpar_tensor::{DType, Device, Tensor};

const MIB: usize = 1 << 20;

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Single-thread memcpy bandwidth (bytes copied per second, best of 5): into a reused,
/// already-touched buffer, and into a fresh allocation (what an out-of-place op pays:
/// large fresh buffers come straight from the kernel and fault in page by page).
fn memcpy_bandwidth(bytes: usize) -> (f64, f64) {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    dst.copy_from_slice(&src); // warm up, fault in
    let (mut pre, mut fresh) = (Duration::MAX, Duration::MAX);
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        pre = pre.min(t0.elapsed());
        std::hint::black_box(&dst);
        let t0 = Instant::now();
        let mut v: Vec<f32> = Vec::with_capacity(src.len());
        v.extend_from_slice(&src);
        std::hint::black_box(&v);
        drop(v);
        fresh = fresh.min(t0.elapsed());
    }
    (gbps(bytes, pre), gbps(bytes, fresh))
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Reduce,
    Gather,
    ReduceInto,
    ReduceInPlace,
    GatherInto,
}

/// Average time per call, measured on every rank between barriers; the slowest rank counts.
fn time_op(pg: &ProcessGroup, op: Op, size: usize) -> Result<Duration, CollectiveError> {
    let n = pg.size();
    let elems = match op {
        Op::Reduce | Op::ReduceInto | Op::ReduceInPlace => size / 4,
        Op::Gather | Op::GatherInto => size / 4 / n,
    };
    let x = Tensor::from_vec(vec![pg.rank() as f32 + 1.0; elems], [elems])?;
    let out_elems = if matches!(op, Op::Gather | Op::GatherInto) { elems * n } else { elems };
    let out = Tensor::zeros([out_elems], DType::F32, Device::Cpu)?;
    let run = |x: &Tensor| -> Result<Option<Tensor>, CollectiveError> {
        match op {
            Op::Reduce => pg.all_reduce(x, ReduceOp::Sum).map(Some),
            Op::Gather => pg.all_gather(x, 0).map(Some),
            Op::ReduceInto => pg.all_reduce_into(x, ReduceOp::Sum, &out).map(|()| None),
            // The sum grows by the world size each call: finite in f32 for these counts.
            Op::ReduceInPlace => pg.all_reduce_(x, ReduceOp::Sum).map(|()| None),
            Op::GatherInto => pg.all_gather_into(x, 0, &out).map(|()| None),
        }
    };
    // Roughly 1 GiB of payload per measurement, at least 3 calls.
    let iters = (1024 * MIB / size).clamp(3, 50);
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

fn main() -> Result<(), CollectiveError> {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: Vec<usize> =
        if quick { vec![MIB, 4 * MIB] } else { vec![MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB] };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("tpar local backend bus bandwidth (f32, out of place; {threads} hardware threads)");
    println!();
    println!("single-thread memcpy (GB/s)");
    println!("{:>9} {:>14} {:>14}", "size", "reused dst", "fresh dst");
    let mut memcpy = Vec::new();
    for &size in &sizes {
        let (pre, fresh) = memcpy_bandwidth(size);
        println!("{:>5} MiB {pre:>14.2} {fresh:>14.2}", size / MIB);
        memcpy.push(pre);
    }
    println!();
    println!(
        "{:>5}  {:<15} {:>9} {:>11} {:>12} {:>12} {:>10}",
        "world", "op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "busbw/cpy"
    );
    for world in [2usize, 4] {
        for op in [Op::Reduce, Op::ReduceInto, Op::ReduceInPlace, Op::Gather, Op::GatherInto] {
            let rows = spawn_scoped(
                SpawnConfig::new(world),
                |ctx| -> Result<Vec<(usize, Duration)>, CollectiveError> {
                    let pg = ctx.world_group();
                    sizes.iter().map(|&s| Ok((s, time_op(&pg, op, s)?))).collect()
                },
            )?;
            for (&(size, t), &cpy) in rows[0].iter().zip(&memcpy) {
                let n = world as f64;
                let algbw = gbps(size, t);
                let (name, factor) = match op {
                    Op::Reduce => ("all_reduce", 2.0 * (n - 1.0) / n),
                    Op::ReduceInto => ("all_reduce_into", 2.0 * (n - 1.0) / n),
                    Op::ReduceInPlace => ("all_reduce_", 2.0 * (n - 1.0) / n),
                    Op::Gather => ("all_gather", (n - 1.0) / n),
                    Op::GatherInto => ("all_gather_into", (n - 1.0) / n),
                };
                let busbw = algbw * factor;
                println!(
                    "{world:>5}  {name:<15} {:>5} MiB {:>11.1} {algbw:>12.2} {busbw:>12.2} {:>10.2}",
                    size / MIB,
                    t.as_secs_f64() * 1e6,
                    busbw / cpy
                );
            }
        }
    }
    Ok(())
}
