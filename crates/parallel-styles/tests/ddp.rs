//! DDP hooked into the backward pass: the gradients are averaged over dp when
//! `backward()` returns with no call from the loop, each bucket's all_reduce starts while
//! the backward is still running, `no_sync` accumulates locally, and the averages equal
//! the gradients of the global batch on one rank.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tpar_collectives::{spawn_with, CollectiveKind, ReduceOp, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_nn::{call, reset_parameters, Args, Linear, ModuleList, NnError};
use tpar_parallel_styles::DataParallel;
use tpar_tensor::autograd::record;
use tpar_tensor::{DType, Device, Tensor};

/// Four rows of input, 6 features; rank r of 2 takes rows 2r and 2r+1.
fn rows() -> Vec<f64> {
    (0..24).map(|i| ((i * 7 % 11) as f64 - 5.0) / 4.0).collect()
}

fn model() -> Result<ModuleList<Linear>, NnError> {
    let mut m = ModuleList::new(vec![
        Linear::new(6, 5, true, DType::F64, Device::Cpu)?,
        Linear::new(5, 4, true, DType::F64, Device::Cpu)?,
        Linear::new(4, 3, false, DType::F64, Device::Cpu)?,
    ]);
    reset_parameters(&mut m, Device::Cpu, 11)?;
    Ok(m)
}

/// The mean over rows of the model's squared outputs, through `x` (recording, in the
/// backward of an identity node on `x`, how many all_reduces had started by then).
fn loss(
    m: &ModuleList<Linear>,
    x: &Tensor,
    seen: Option<(Arc<Mutex<Option<usize>>>, tpar_collectives::CommDebug)>,
) -> Result<Tensor, NnError> {
    let x = match seen {
        Some((slot, dbg)) => record("marker", &[x], x.detach(), move |g| {
            *slot.lock().unwrap() = Some(dbg.records().len());
            Ok(vec![Some(g.clone())])
        }),
        None => x.clone(),
    };
    let mut h = x;
    for l in &m.items {
        h = call(l, Args::one(h))?.into_tensor("h")?;
    }
    let rows = h.dims()[0] as f64;
    Ok(h.mul(&h)?.sum_all()?.mul_scalar(1.0 / rows)?)
}

/// Every parameter's gradient, as f64 values.
fn grads(m: &ModuleList<Linear>) -> Result<Vec<Vec<f64>>, NnError> {
    tpar_nn::parameters(m)
        .iter()
        .map(|p| Ok(p.trainable().grad().expect("a gradient").to_vec_f64()?))
        .collect()
}

/// The gradients of the whole batch's mean loss on one rank.
fn reference() -> Vec<Vec<f64>> {
    let m = model().unwrap();
    let x = Tensor::from_f64(&rows(), [4, 6], DType::F64).unwrap().requires_grad_(true);
    loss(&m, &x, None).unwrap().backward().unwrap();
    grads(&m).unwrap()
}

fn close(got: &[Vec<f64>], want: &[Vec<f64>], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{what}: parameter {i}: {a} vs {b}");
        }
    }
}

#[test]
fn backward_averages_the_gradients_with_buckets_started_during_it() {
    let want = reference();
    let cfg = SpawnConfig::new(2).timeout(Duration::from_secs(60));
    let out = spawn_with(cfg, |ctx| -> Result<_, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
        let mut m = model()?;
        // A bucket per parameter: five all_reduces, the last layers' first.
        let ddp = DataParallel::with_bucket_cap(&mut m, &mesh, 1)
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        assert_eq!(ddp.num_buckets(), 5);
        let r = ctx.rank();
        let x = Tensor::from_f64(&rows()[r * 12..(r + 1) * 12], [2, 6], DType::F64)?
            .requires_grad_(true);
        let dbg = mesh.group(0)?.comm_debug();
        dbg.enable();
        let seen = Arc::new(Mutex::new(None));
        // The local loss is the mean over this rank's rows: the average over dp is the
        // global batch's mean.
        loss(&m, &x, Some((seen.clone(), dbg.clone())))?.backward()?;
        dbg.disable();
        let recs = dbg.take();
        let started_before_input = seen.lock().unwrap().expect("the marker ran");
        Ok((grads(&m)?, recs, started_before_input))
    })
    .unwrap();
    for (rank, (g, recs, started)) in out.into_iter().enumerate() {
        close(&g, &want, &format!("rank {rank}"));
        assert_eq!(recs.len(), 5, "rank {rank}: one all_reduce per bucket");
        for rec in &recs {
            assert_eq!((rec.kind, rec.op), (CollectiveKind::AllReduce, Some(ReduceOp::Avg)));
            assert!(rec.is_async, "rank {rank}: {rec}");
        }
        // The input's gradient is the backward's last step: by then the buckets of the
        // layers behind the first had started.
        assert!(started >= 3, "rank {rank}: only {started} all_reduces started before the end");
    }
}

#[test]
fn no_sync_accumulates_locally_and_the_next_backward_averages_the_sum() {
    // Two micro-batches of one row per rank, the first under no_sync: each rank's
    // gradient is the sum of its two micro-batch losses' gradients, then averaged over
    // the 2 ranks; on one rank that is every micro-batch loss, halved, accumulated.
    let single = {
        let m = model().unwrap();
        let all = rows();
        for r in 0..2 {
            for mb in 0..2 {
                let at = r * 12 + mb * 6;
                let x = Tensor::from_f64(&all[at..at + 6], [1, 6], DType::F64).unwrap();
                let x = x.requires_grad_(true);
                // Each rank's sum of micro-batch losses, averaged over the 2 ranks.
                loss(&m, &x, None).unwrap().mul_scalar(0.5).unwrap().backward().unwrap();
            }
        }
        grads(&m).unwrap()
    };
    let cfg = SpawnConfig::new(2).timeout(Duration::from_secs(60));
    let out = spawn_with(cfg, |ctx| -> Result<_, NnError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
        let mut m = model()?;
        let ddp = DataParallel::new(&mut m, &mesh)
            .map_err(|e| NnError::Config { what: e.to_string() })?;
        let dbg = mesh.group(0)?.comm_debug();
        dbg.enable();
        let all = rows();
        let r = ctx.rank();
        let mb = |i: usize| -> Result<Tensor, NnError> {
            let at = r * 12 + i * 6;
            Ok(Tensor::from_f64(&all[at..at + 6], [1, 6], DType::F64)?.requires_grad_(true))
        };
        {
            let _ns = ddp.no_sync();
            assert!(!ddp.requires_gradient_sync());
            loss(&m, &mb(0)?, None)?.backward()?;
        }
        assert!(ddp.requires_gradient_sync());
        let during_no_sync = dbg.records().len();
        loss(&m, &mb(1)?, None)?.backward()?;
        dbg.disable();
        Ok((grads(&m)?, during_no_sync, dbg.take().len()))
    })
    .unwrap();
    for (rank, (g, during, total)) in out.into_iter().enumerate() {
        assert_eq!(during, 0, "rank {rank}: no_sync communicated");
        assert_eq!(total, 1, "rank {rank}: one bucket (f64) for the synchronized backward");
        close(&g, &single, &format!("rank {rank}"));
    }
}
