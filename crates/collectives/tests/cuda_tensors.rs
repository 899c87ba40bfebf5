//! Collectives on CUDA tensors on the local backend (emulated devices, ranks as threads):
//! they run device to device (no host round trip), results come back on the caller's
//! device and are bit-equal to the host collectives' for every dtype, with every rank on
//! one device or each on its own.

use std::sync::Once;

use tpar_collectives::{spawn_scoped, CollectiveError, ProcessGroup, ReduceOp, SpawnConfig};
use tpar_tensor::gpu::{self, EmulatedGpu};
use tpar_tensor::{DType, Device, Rng, Tensor};

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Makes `cuda:0` .. `cuda:3` emulated devices, once for all the tests of this binary
/// (which run in parallel and must not swap a device under each other's tensors).
fn emulated_devices() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for o in 0..4 {
            gpu::register_device(o, EmulatedGpu::open(o).expect("emulator"));
        }
    });
}

/// The bit patterns of a tensor's elements (read on the host, after the counted part).
fn bits(t: &Tensor) -> Result<Vec<u64>, BoxErr> {
    let h = t.to_device(Device::Cpu)?;
    Ok(match h.dtype() {
        DType::F32 => h.to_vec::<f32>()?.iter().map(|v| v.to_bits() as u64).collect(),
        DType::F64 => h.to_vec::<f64>()?.iter().map(|v| v.to_bits()).collect(),
        DType::BF16 => h.to_vec::<half::bf16>()?.iter().map(|v| v.to_bits() as u64).collect(),
        DType::F16 => h.to_vec::<half::f16>()?.iter().map(|v| v.to_bits() as u64).collect(),
        DType::I64 => h.to_vec::<i64>()?.iter().map(|&v| v as u64).collect(),
    })
}

/// A host tensor of `dims` with values that make rounding differences show.
fn sample(dims: &[usize], dtype: DType, rng: &mut Rng) -> Result<Tensor, BoxErr> {
    if dtype == DType::I64 {
        let n: usize = dims.iter().product();
        let v: Vec<i64> = (0..n).map(|_| (rng.next_u64() % 2001) as i64 - 1000).collect();
        return Ok(Tensor::from_vec(v, dims.to_vec())?);
    }
    let t = Tensor::randn(dims.to_vec(), DType::F64, rng)?.mul_scalar(3.0)?;
    Ok(t.to_dtype(dtype)?)
}

/// Every collective of one rank, on `x` (its shapes depend on the rank: uneven gathers).
/// Returns the results in a fixed order.
fn run_all(pg: &ProcessGroup, x: &[Tensor; 4], dtype: DType) -> Result<Vec<Tensor>, BoxErr> {
    let (n, r) = (pg.size(), pg.rank());
    let [even, rows, mid, cols] = x;
    let mut out = Vec::new();
    let ops: &[ReduceOp] = if dtype == DType::I64 {
        &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product]
    } else {
        &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product]
    };
    for &op in ops {
        out.push(pg.all_reduce(even, op)?);
        out.push(pg.reduce_scatter(even, 0, op)?);
        out.push(pg.reduce_scatter(even, 1, op)?);
    }
    out.push(pg.all_gather(even, 1)?);
    out.push(pg.all_gather(rows, 0)?); // uneven, rank 0's shard is empty
    out.push(pg.all_gather(mid, 1)?); // uneven along a middle dim
    out.push(pg.all_to_all(even, 0, 1)?);
    out.push(pg.all_to_all(even, 1, 0)?);
    out.push(pg.all_to_all(even, 2, 2)?);
    out.push(pg.all_to_all(cols, 1, 0)?); // uneven split (torch.chunk rule)
    let sizes: Vec<usize> = (0..n).map(|j| if j == 0 { cols.dims()[1] } else { 0 }).collect();
    out.push(pg.all_to_all_sizes(cols, &sizes, 1, 1)?);
    out.push(pg.broadcast(even, n - 1)?);
    let a = pg.all_reduce_async(even, ReduceOp::Sum);
    let g = pg.all_gather_async(rows, 0);
    let s = pg.reduce_scatter_async(even, 1, ReduceOp::Max);
    out.push(a.wait()?);
    out.push(g.wait()?);
    out.push(s.wait()?);
    pg.barrier()?;
    pg.send(even, (r + 1) % n)?;
    pg.send_shaped(mid, (r + n - 1) % n)?;
    out.push(pg.recv((r + n - 1) % n)?);
    let from = (r + 1) % n;
    let want = [2, from + 1, 3];
    out.push(pg.recv_shaped(from, &want, dtype, even.device())?);
    Ok(out)
}

/// Runs every collective on the device and on the host, for every dtype: no round trip,
/// results on the caller's device, bit-equal to the host collectives'.
fn check(world: usize, ordinal_of: fn(usize) -> usize) {
    emulated_devices();
    spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), BoxErr> {
        let pg = ctx.world_group();
        let r = pg.rank();
        let here = Device::Cuda(ordinal_of(r));
        for (k, dtype) in
            [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64].into_iter().enumerate()
        {
            let mut rng = Rng::new(100 * k as u64 + r as u64);
            let host = [
                sample(&[world * 2 + 1, world + 2, 3], dtype, &mut rng)?,
                sample(&[r, 3], dtype, &mut rng)?,
                sample(&[2, r + 1, 3], dtype, &mut rng)?,
                sample(&[2, world + 1], dtype, &mut rng)?,
            ];
            let dev = [
                host[0].to_device(here)?,
                host[1].to_device(here)?,
                host[2].to_device(here)?,
                host[3].to_device(here)?,
            ];
            let before = gpu::host_round_trips();
            let got = run_all(&pg, &dev, dtype)?;
            assert_eq!(gpu::host_round_trips() - before, 0, "{dtype} on {here}: round trips");
            let want = run_all(&pg, &host, dtype)?;
            assert_eq!(got.len(), want.len());
            let last = got.len() - 2; // `recv` keeps the sender's device
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let sender = Device::Cuda(ordinal_of((r + world - 1) % world));
                let on = if i == last { sender } else { here };
                assert_eq!(g.device(), on, "{dtype} result {i}");
                assert_eq!(g.dims(), w.dims(), "{dtype} result {i}");
                assert_eq!(bits(g)?, bits(w)?, "{dtype} result {i} on rank {r}");
            }
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn two_ranks_on_one_device() {
    check(2, |_| 0);
}

#[test]
fn three_ranks_on_one_device() {
    check(3, |_| 0);
}

#[test]
fn four_ranks_on_one_device() {
    check(4, |_| 0);
}

#[test]
fn two_ranks_on_two_devices() {
    check(2, |r| r);
}

#[test]
fn three_ranks_on_three_devices() {
    check(3, |r| r);
}

#[test]
fn four_ranks_on_four_devices() {
    check(4, |r| r);
}

#[test]
fn all_reduce_is_bit_identical_on_every_rank() {
    emulated_devices();
    // Many bf16 terms: any other summation order or rounding would show.
    let results = spawn_scoped(SpawnConfig::new(4), |ctx| -> Result<Vec<u64>, BoxErr> {
        let pg = ctx.world_group();
        let mut rng = Rng::new(7 + pg.rank() as u64);
        let t = sample(&[64, 33], DType::BF16, &mut rng)?.to_device(Device::Cuda(pg.rank()))?;
        let s = pg.all_reduce(&t, ReduceOp::Sum)?;
        assert_eq!(s.device(), Device::Cuda(pg.rank()));
        bits(&s)
    })
    .unwrap();
    assert!(results.iter().all(|r| r == &results[0]));
}

#[test]
fn host_and_cuda_members_mix() {
    emulated_devices();
    spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), BoxErr> {
        let pg = ctx.world_group();
        let r = pg.rank();
        let here = if r == 0 { Device::Cpu } else { Device::Cuda(r) };
        let mut rng = Rng::new(31 + r as u64);
        let host = sample(&[7, 5], DType::BF16, &mut rng)?;
        let x = host.to_device(here)?;
        let got = [
            pg.all_reduce(&x, ReduceOp::Sum)?,
            pg.all_gather(&x, 1)?,
            pg.reduce_scatter(&x, 0, ReduceOp::Avg)?,
            pg.all_to_all(&x, 0, 1)?,
            pg.broadcast(&x, 1)?,
        ];
        let want = [
            pg.all_reduce(&host, ReduceOp::Sum)?,
            pg.all_gather(&host, 1)?,
            pg.reduce_scatter(&host, 0, ReduceOp::Avg)?,
            pg.all_to_all(&host, 0, 1)?,
            pg.broadcast(&host, 1)?,
        ];
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.device(), here);
            assert_eq!(bits(g)?, bits(w)?);
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_meta_member_among_cuda_members_is_a_typed_mismatch() {
    emulated_devices();
    let r = spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let d = if pg.rank() == 0 { Device::Meta } else { Device::Cuda(0) };
        let t = Tensor::zeros([4], DType::F32, d)?;
        pg.all_reduce(&t, ReduceOp::Sum)?;
        Ok(())
    });
    assert!(matches!(r, Err(CollectiveError::Mismatch { .. })), "{r:?}");
}

#[test]
fn recv_shaped_delivers_on_the_requested_device() {
    emulated_devices();
    spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<(), BoxErr> {
        let pg = ctx.world_group();
        let host = Tensor::from_vec(vec![1.5f32, -2.0, 3.25, 0.0, 7.0, 8.5], [2, 3])?;
        if pg.rank() == 0 {
            // A host tensor for a receiver that wants it on the device, and back.
            pg.send_shaped(&host, 1)?;
            pg.send_shaped(&host.to_device(Device::Cuda(0))?, 1)?;
            pg.send_shaped(&host.to_device(Device::Cuda(0))?, 1)?;
            pg.send_shaped(&host.to_device(Device::Cuda(0))?, 1)?;
        } else {
            let on_dev = pg.recv_shaped(0, &[2, 3], DType::F32, Device::Cuda(0))?;
            assert_eq!(on_dev.device(), Device::Cuda(0));
            assert_eq!(on_dev.to_vec::<f32>()?, host.to_vec::<f32>()?);
            let on_host = pg.recv_shaped(0, &[2, 3], DType::F32, Device::Cpu)?;
            assert_eq!(on_host.device(), Device::Cpu);
            assert_eq!(on_host.to_vec::<f32>()?, host.to_vec::<f32>()?);
            let stays = pg.recv_shaped(0, &[2, 3], DType::F32, Device::Cuda(0))?;
            assert_eq!(stays.device(), Device::Cuda(0));
            assert_eq!(stays.to_vec::<f32>()?, host.to_vec::<f32>()?);
            // From cuda:0 to cuda:1, device to device.
            let before = gpu::host_round_trips();
            let moved = pg.recv_shaped(0, &[2, 3], DType::F32, Device::Cuda(1))?;
            assert_eq!(gpu::host_round_trips(), before);
            assert_eq!(moved.device(), Device::Cuda(1));
            assert_eq!(moved.to_vec::<f32>()?, host.to_vec::<f32>()?);
        }
        Ok(())
    })
    .unwrap();
}
