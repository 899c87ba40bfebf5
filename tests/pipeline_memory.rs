//! Pipeline memory, measured with the tracking allocator: 1F1B and zero-bubble hold at
//! most the number of stages in micro-batches of activations, GPipe all of them. Alone
//! in its test binary: the allocator counts per rank slot, so rank threads of other
//! tests running at the same time would be counted too.

use tpar::prelude::*;
use tpar::tensor::memory;

mod common;
use common::llama_pipeline::{batch, config, loss_fn, stages};

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

/// Peak bytes above the start of a step on pp rank 0, for `kind` (4 stages of one layer).
fn step_peak(kind: ScheduleKind, m: usize) -> (i64, i64) {
    let cfg = LlamaConfig {
        hidden_size: 64,
        intermediate_size: 128,
        max_position_embeddings: 64,
        ..config(4, DType::F32)
    };
    let (ids, tgt) = batch(m * 2, 64, cfg.vocab_size);
    let out = tpar::spawn_scoped(tpar::SpawnConfig::new(4), |ctx| -> tpar::Result<(i64, i64)> {
        let rank = ctx.rank();
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[4], &["pp"])?;
        let st = stages(&cfg, &mesh, 1)?;
        // One micro-batch's activations on stage 0: what its forward keeps for backward.
        let per_mb = if rank == 0 {
            let mb = ids.narrow(0, 0, 2)?;
            // A first forward fills what the module caches (the RoPE tables it builds
            // on first use); the second one's growth is the activations alone.
            drop(call(st[0].module(), Args::new(vec![Value::Tensor(mb.clone())]))?);
            let before = memory::current(rank);
            let out = call(st[0].module(), Args::new(vec![Value::Tensor(mb)]))?;
            let kept = memory::current(rank) - before;
            drop(out);
            kept
        } else {
            0
        };
        let mut s = PipelineSchedule::new(kind, st, m, loss_fn(cfg.vocab_size))?;
        let before = memory::current(rank);
        memory::reset_peak(rank);
        s.step(Some(&ids), Some(&tgt))?;
        Ok((memory::peak(rank) - before, per_mb))
    })
    .unwrap();
    out[0]
}

/// Micro-batches of activations held at the peak on stage 0, measured once: GPipe,
/// 1F1B and zero-bubble over `m` micro-batches.
fn held_at_peak(m: usize) -> (f64, f64, f64, i64) {
    // One micro-batch: its activations plus the backward's transient workspace.
    let (single, per_mb) = step_peak(ScheduleKind::GPipe, 1);
    let workspace = single - per_mb;
    // Micro-batches of activations a step holds at its peak on stage 0.
    let held = |peak: i64| (peak - workspace) as f64 / per_mb as f64;
    let gpipe = held(step_peak(ScheduleKind::GPipe, m).0);
    let ofob = held(step_peak(ScheduleKind::OneFOneB, m).0);
    let zb = held(step_peak(ScheduleKind::ZeroBubble, m).0);
    (gpipe, ofob, zb, per_mb)
}

#[test]
fn one_f_one_b_holds_fewer_activations_than_gpipe_measured() {
    assert!(memory::is_tracking());
    let m = 8;
    // The slack of one micro-batch covers what the timing of the rank threads moves: the
    // backward's transient workspace at the peak, and activations sent but not yet taken
    // by stage 1 (a copy each, counted on the sender until the receiver drops it). The
    // rank threads' timing still moves a measurement past it now and then, so a
    // measurement that misses is taken again, up to three times: a real regression
    // misses every time.
    let within = |(gpipe, ofob, zb): (f64, f64, f64)| {
        gpipe >= m as f64 - 0.5 && ofob <= 5.0 && zb <= 5.0 && gpipe - ofob >= 3.0
    };
    let mut attempt = 0;
    let (gpipe, ofob, zb) = loop {
        attempt += 1;
        let (gpipe, ofob, zb, per_mb) = held_at_peak(m);
        println!(
            "stage 0 of 4, {m} micro-batches of {:.2} MiB activations: held at the peak gpipe {gpipe:.2}, 1f1b {ofob:.2}, zb {zb:.2}",
            per_mb as f64 / (1 << 20) as f64
        );
        if within((gpipe, ofob, zb)) || attempt == 3 {
            break (gpipe, ofob, zb);
        }
    };
    assert!(gpipe >= m as f64 - 0.5, "gpipe holds {gpipe} micro-batches, not all {m}");
    assert!(ofob <= 5.0, "1f1b holds {ofob} micro-batches, more than the 4 stages");
    assert!(zb <= 5.0, "zb holds {zb} micro-batches, more than the 4 stages");
    assert!(gpipe - ofob >= 3.0, "gpipe {gpipe} vs 1f1b {ofob}");
}
