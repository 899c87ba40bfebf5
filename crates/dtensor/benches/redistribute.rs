//! Redistribute overhead vs the raw collective, measured in the same run: 64 MiB f32
//! tensors (global) on a world of 2 local ranks.
//!
//! * `Shard(0) -> Replicate` vs `ProcessGroup::all_gather`
//! * `Partial(sum) -> Shard(0)` vs `ProcessGroup::reduce_scatter`
//! * `Partial(sum) -> Replicate` vs `ProcessGroup::all_reduce`
//!
//! Each timed call starts after a barrier; raw and redistribute calls alternate so drift
//! hits both alike; the median of the iterations is reported, with the ratio
//! `redistribute / raw`. Run with `cargo bench -p tpar-dtensor --bench redistribute`.

use std::time::{Duration, Instant};

use tpar_collectives::{spawn_scoped, ProcessGroup, ReduceOp as CommOp, SpawnConfig};
use tpar_dtensor::{DTensor, DTensorError, Placement, ReduceOp};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_tensor::{DType, Device, Tensor};

const WORLD: usize = 2;
const ROWS: usize = 4096;
const COLS: usize = 4096; // 4096 x 4096 f32 = 64 MiB
const ITERS: usize = 9;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Times `raw` and `dt` alternately; returns their medians.
fn compare(
    pg: &ProcessGroup,
    raw: impl Fn() -> Result<Tensor, DTensorError>,
    dt: impl Fn() -> Result<Tensor, DTensorError>,
) -> Result<(Duration, Duration), DTensorError> {
    let time = |f: &dyn Fn() -> Result<Tensor, DTensorError>| -> Result<Duration, DTensorError> {
        pg.barrier()?;
        let t0 = Instant::now();
        let out = f()?;
        let dt = t0.elapsed();
        drop(out);
        Ok(dt)
    };
    // Warm up both paths (plan cache, allocator).
    time(&raw)?;
    time(&dt)?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..ITERS {
        a.push(time(&raw)?);
        b.push(time(&dt)?);
    }
    Ok((median(a), median(b)))
}

fn main() -> Result<(), DTensorError> {
    let shape = [ROWS, COLS];
    let rows = spawn_scoped(
        SpawnConfig::new(WORLD),
        |ctx| -> Result<Vec<(String, Duration, Duration)>, DTensorError> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[WORLD], &["tp"])?;
            let pg = mesh.group(0)?.clone();
            let psum = [Placement::Partial(ReduceOp::Sum)];
            let mut out = Vec::new();

            let shard = Tensor::ones([ROWS / WORLD, COLS], DType::F32, Device::Cpu)?;
            let d = DTensor::from_local(&shard, &mesh, &[Placement::Shard(0)], Some(&shape))?;
            let (raw, red) = compare(
                &pg,
                || Ok(pg.all_gather(&shard, 0)?),
                || Ok(d.redistribute(&[Placement::Replicate])?.to_local()),
            )?;
            out.push(("Shard(0) -> Replicate vs all_gather".to_string(), raw, red));

            let full = Tensor::ones(shape, DType::F32, Device::Cpu)?;
            let p = DTensor::from_local(&full, &mesh, &psum, Some(&shape))?;
            let (raw, red) = compare(
                &pg,
                || Ok(pg.reduce_scatter(&full, 0, CommOp::Sum)?),
                || Ok(p.redistribute(&[Placement::Shard(0)])?.to_local()),
            )?;
            out.push(("Partial(sum) -> Shard(0) vs reduce_scatter".to_string(), raw, red));

            let (raw, red) = compare(
                &pg,
                || Ok(pg.all_reduce(&full, CommOp::Sum)?),
                || Ok(p.redistribute(&[Placement::Replicate])?.to_local()),
            )?;
            out.push(("Partial(sum) -> Replicate vs all_reduce".to_string(), raw, red));
            Ok(out)
        },
    )?;
    println!(
        "redistribute overhead, 64 MiB f32 global ({ROWS}x{COLS}), world {WORLD} (local backend), \
         median of {ITERS}, rank 0"
    );
    for (what, raw, red) in &rows[0] {
        println!(
            "{what:<45} raw {:>8.2} ms  redistribute {:>8.2} ms  ratio {:.3}",
            raw.as_secs_f64() * 1e3,
            red.as_secs_f64() * 1e3,
            red.as_secs_f64() / raw.as_secs_f64()
        );
    }
    Ok(())
}
