//! Sub-groups (mesh rows and columns running concurrently), point-to-point, async work
//! and the communication recorder.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use tpar_collectives::{spawn_scoped, CollectiveError, CollectiveKind, ReduceOp, SpawnConfig};
use tpar_tensor::{DType, Device, Rng, Tensor};

/// On a rows x cols mesh (rank = row * cols + col), every rank alternates collectives on
/// its row group and its column group; results must only mix the right ranks.
fn mesh_groups(rows: usize, cols: usize) {
    let world = rows * cols;
    spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
        let r = ctx.rank();
        let (row, col) = (r / cols, r % cols);
        let row_ranks: Vec<usize> = (0..cols).map(|c| row * cols + c).collect();
        let col_ranks: Vec<usize> = (0..rows).map(|k| k * cols + col).collect();
        // Create in different orders on different ranks: same communicator anyway.
        let (row_pg, col_pg) = if r % 2 == 0 {
            (ctx.new_group(&row_ranks)?, ctx.new_group(&col_ranks)?)
        } else {
            let mut rev = col_ranks.clone();
            rev.reverse();
            let c = ctx.new_group(&rev)?;
            (ctx.new_group(&row_ranks)?, c)
        };
        assert_eq!(row_pg.ranks(), &row_ranks[..]);
        assert_eq!(row_pg.rank(), col);
        assert_eq!(col_pg.rank(), row);
        let value = |g: usize, step: usize| (g * 100 + step) as f64;
        for step in 0..30 {
            let x = Tensor::from_f64(&[value(r, step)], [1], DType::F64)?;
            let rs = row_pg.all_reduce(&x, ReduceOp::Sum)?.item()?;
            let want: f64 = row_ranks.iter().map(|&g| value(g, step)).sum();
            assert_eq!(rs, want, "row sum at step {step}");
            let cg = col_pg.all_gather(&x, 0)?.to_vec_f64()?;
            let want: Vec<f64> = col_ranks.iter().map(|&g| value(g, step)).collect();
            assert_eq!(cg, want, "column gather at step {step}");
            // Async on the row group overlapping a sync column collective.
            let w = row_pg.all_gather_async(&x, 0);
            let cm = col_pg.all_reduce(&x, ReduceOp::Max)?.item()?;
            assert_eq!(cm, col_ranks.iter().map(|&g| value(g, step)).fold(f64::MIN, f64::max));
            let rg = w.wait()?.to_vec_f64()?;
            assert_eq!(rg, row_ranks.iter().map(|&g| value(g, step)).collect::<Vec<_>>());
        }
        // The world group still works after the sub-groups.
        let t = Tensor::from_f64(&[1.0], [1], DType::F32)?;
        assert_eq!(ctx.world_group().all_reduce(&t, ReduceOp::Sum)?.item()?, world as f64);
        Ok(())
    })
    .unwrap();
}

#[test]
fn mesh_2x2_rows_and_columns() {
    mesh_groups(2, 2);
}

#[test]
fn mesh_2x3_rows_and_columns() {
    mesh_groups(2, 3);
}

#[test]
fn mesh_3x2_sub_group_of_sub_group() {
    mesh_groups(3, 2);
}

#[test]
fn group_ranks_and_validation() {
    spawn_scoped(SpawnConfig::new(4), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        assert_eq!((pg.size(), pg.rank(), pg.global_rank()), (4, ctx.rank(), ctx.rank()));
        assert_eq!(pg.backend_name(), "local");
        assert!(ctx.new_group(&[0, 0]).is_err());
        assert!(ctx.new_group(&[ctx.rank(), 9]).is_err());
        let other = (ctx.rank() + 1) % 4;
        let e = ctx.new_group(&[other]).unwrap_err();
        assert!(matches!(e, CollectiveError::InvalidArgument { .. }), "{e}");
        let pair = if ctx.rank() < 2 { [1, 0] } else { [3, 2] };
        let g = pg.new_group(&pair)?;
        assert_eq!(g.ranks(), if ctx.rank() < 2 { &[0, 1] } else { &[2, 3] });
        assert_eq!(g.group_rank_of(ctx.rank()), Some(ctx.rank() % 2));
        assert_eq!(g.global_rank_of(1), Some(if ctx.rank() < 2 { 1 } else { 3 }));
        assert_eq!(g.with_timeout(Duration::from_secs(3)).timeout(), Duration::from_secs(3));
        g.barrier()?;
        // Bad arguments are typed errors on every rank, never panics or hangs.
        let x = Tensor::zeros([2, 3], DType::F32, Device::Cpu)?;
        assert!(matches!(pg.all_gather(&x, 2), Err(CollectiveError::InvalidArgument { .. })));
        assert!(matches!(pg.broadcast(&x, 4), Err(CollectiveError::InvalidArgument { .. })));
        let i = Tensor::zeros([2], DType::I64, Device::Cpu)?;
        assert!(matches!(
            pg.all_reduce(&i, ReduceOp::Avg),
            Err(CollectiveError::InvalidArgument { .. })
        ));
        assert!(pg.all_to_all_sizes(&x, &[1, 1, 0], 0, 0).is_err());
        assert!(pg.send(&x, 7).is_err());
        assert!(pg.recv(4).is_err());
        // ...and the group is still in step afterwards.
        assert_eq!(
            pg.all_reduce(&x.add_scalar(1.0)?, ReduceOp::Sum)?.to_vec::<f32>()?,
            vec![4.0; 6]
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn send_recv_ring_is_fifo_per_pair() {
    for world in [1usize, 2, 3, 5] {
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let (me, n) = (pg.rank(), pg.size());
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            for k in 0..20usize {
                let dtype = DTYPES[k % 5];
                let t = Tensor::from_f64(&[(me * 20 + k) as f64, 1.0], [2], dtype)?;
                pg.send(&t, next)?;
            }
            for k in 0..20usize {
                let got = pg.recv(prev)?;
                assert_eq!(got.dtype(), DTYPES[k % 5]);
                assert_eq!(got.to_vec_f64()?, vec![(prev * 20 + k) as f64, 1.0]);
            }
            // Sending copies: mutating after send does not change what arrives.
            let t = Tensor::from_vec(vec![me as f32], [1])?;
            pg.send(&t, next)?;
            t.with_data_mut::<f32, _>(|s| s[0] = -1.0)?;
            assert_eq!(pg.recv(prev)?.to_vec::<f32>()?, vec![prev as f32]);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn pipeline_style_send_recv_on_a_sub_group() {
    // Stages 0 -> 1 -> 2 on a pp group, independently in two dp replicas.
    spawn_scoped(SpawnConfig::new(6), |ctx| -> Result<(), CollectiveError> {
        let (dp, stage) = (ctx.rank() / 3, ctx.rank() % 3);
        let pp = ctx.new_group(&[dp * 3, dp * 3 + 1, dp * 3 + 2])?;
        for mb in 0..5 {
            let mut x = if stage == 0 {
                Tensor::from_f64(&[(dp * 10 + mb) as f64], [1], DType::F32)?
            } else {
                pp.recv(stage - 1)?
            };
            x = x.add_scalar(1.0)?;
            if stage < 2 {
                pp.send(&x, stage + 1)?;
            } else {
                assert_eq!(x.item()?, (dp * 10 + mb) as f64 + 3.0, "micro-batch {mb}");
            }
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn async_work_overlaps_and_keeps_order() {
    spawn_scoped(SpawnConfig::new(4), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let mut rng = Rng::new(5);
        let xs: Vec<Tensor> = (0..6)
            .map(|k| Tensor::from_f64(&[(ctx.rank() * 10 + k) as f64; 8], [8], DType::F32).unwrap())
            .collect();
        // Several in flight at once, interleaved with sync calls.
        let w0 = pg.all_reduce_async(&xs[0], ReduceOp::Sum);
        let w1 = pg.all_gather_async(&xs[1], 0);
        let s2 = pg.all_reduce(&xs[2], ReduceOp::Max)?;
        let w3 = pg.reduce_scatter_async(&xs[3], 0, ReduceOp::Sum);
        let _ = rand_tensor(&[64, 64], DType::F32, &mut rng).matmul(&rand_tensor(
            &[64, 64],
            DType::F32,
            &mut rng,
        ))?;
        let r3 = w3.wait()?;
        let r1 = w1.wait()?;
        let r0 = w0.wait()?;
        assert_eq!(r0.to_vec::<f32>()?, vec![60.0; 8]);
        assert_eq!(r1.dims(), &[32]);
        assert_eq!(s2.to_vec::<f32>()?, vec![32.0; 8]);
        assert_eq!(r3.to_vec::<f32>()?, vec![(10 + 20 + 30 + 4 * 3) as f32; 2]);
        // A dropped Work still completes; peers are not left waiting.
        drop(pg.all_reduce_async(&xs[4], ReduceOp::Sum));
        let w = pg.all_reduce_async(&xs[5], ReduceOp::Sum);
        let out = w.wait()?;
        assert_eq!(out.to_vec::<f32>()?, vec![(60 + 20) as f32; 8]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn async_errors_come_back_through_wait() {
    let r = spawn_scoped(SpawnConfig::new(2).timeout(Duration::from_millis(500)), |ctx| {
        let pg = ctx.world_group();
        let x = Tensor::zeros([3], DType::F32, Device::Cpu)?;
        let w = if ctx.rank() == 0 {
            pg.all_reduce_async(&x, ReduceOp::Sum)
        } else {
            pg.all_gather_async(&x, 0)
        };
        w.wait().map(|_| ())
    });
    match r {
        Err(CollectiveError::Mismatch { .. }) => {}
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn comm_debug_counts_exactly_what_ran() {
    let counts = spawn_scoped(
        SpawnConfig::new(3),
        |ctx| -> Result<BTreeMap<CollectiveKind, usize>, CollectiveError> {
            let pg = ctx.world_group();
            let dbg = ctx.comm_debug();
            let x = Tensor::zeros([6, 2], DType::BF16, Device::Cpu)?;
            pg.all_reduce(&x, ReduceOp::Sum)?; // not recorded: disabled
            assert_eq!(dbg.total(), 0);
            dbg.enable();
            pg.all_reduce(&x, ReduceOp::Sum)?;
            pg.all_reduce(&x, ReduceOp::Avg)?;
            pg.all_gather(&x, 1)?;
            pg.reduce_scatter(&x, 0, ReduceOp::Sum)?;
            pg.all_to_all(&x, 0, 0)?;
            pg.broadcast(&x, 0)?;
            pg.barrier()?;
            pg.all_gather_async(&x, 0).wait()?;
            let sub = ctx.new_group(&[ctx.rank()])?;
            sub.all_reduce(&x, ReduceOp::Max)?;
            let recs = dbg.records();
            assert_eq!(recs[0].op, Some(ReduceOp::Sum));
            assert_eq!(recs[0].bytes, 24);
            assert_eq!(recs[0].group, vec![0, 1, 2]);
            assert_eq!(recs[0].shape, vec![6, 2]);
            assert_eq!(recs.last().map(|r| r.group.clone()), Some(vec![ctx.rank()]));
            assert!(recs.iter().any(|r| r.is_async));
            assert_eq!(dbg.bytes(CollectiveKind::AllReduce), 3 * 24);
            let bc = recs.iter().find(|r| r.kind == CollectiveKind::Broadcast).unwrap();
            assert_eq!(bc.bytes, if ctx.rank() == 0 { 24 } else { 0 });
            let counts = dbg.counts();
            dbg.clear();
            assert_eq!(dbg.total(), 0);
            dbg.disable();
            pg.barrier()?;
            assert_eq!(dbg.total(), 0);
            Ok(counts)
        },
    )
    .unwrap();
    let want: BTreeMap<CollectiveKind, usize> = [
        (CollectiveKind::AllReduce, 3),
        (CollectiveKind::AllGather, 2),
        (CollectiveKind::ReduceScatter, 1),
        (CollectiveKind::AllToAll, 1),
        (CollectiveKind::Broadcast, 1),
        (CollectiveKind::Barrier, 1),
    ]
    .into_iter()
    .collect();
    for c in counts {
        assert_eq!(c, want);
    }
}
