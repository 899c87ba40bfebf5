//! Pipeline parallelism: every schedule's loss and gradients equal the unpipelined
//! model's; the zero-bubble schedule idles less than 1F1B (measured); a 3-D mesh (pp x dp x tp) steps like one rank; a
//! stage that fails makes every rank fail, naming it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tpar::prelude::*;
use tpar::tensor::autograd::{apply, needs_input_grad, Function};
use tpar::tensor::memory;

mod common;
use common::llama_pipeline::{batch, config, loss_fn, stages};

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

/// Loss and every parameter gradient (by FQN) of the whole model on the whole batch.
fn reference(cfg: &LlamaConfig, ids: &Tensor, tgt: &Tensor) -> (f64, BTreeMap<String, Vec<f64>>) {
    let mut model = LlamaForPretraining::new(cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 7).unwrap();
    let logits = model.logits(ids, None).unwrap();
    let loss = loss_fn(cfg.vocab_size)(&logits, tgt).unwrap();
    loss.backward().unwrap();
    let grads = named_parameters(&model)
        .into_iter()
        .map(|(n, p)| (n, p.trainable().grad().unwrap().to_vec_f64().unwrap()))
        .collect();
    (loss.item().unwrap(), grads)
}

type Grads = BTreeMap<String, Vec<f64>>;

/// Runs one pipelined step; returns the mean micro-batch loss (from the last stage's
/// rank) and every gradient by FQN.
fn pipelined(
    kind: ScheduleKind,
    pp: usize,
    v: usize,
    m: usize,
    cfg: &LlamaConfig,
    ids: &Tensor,
    tgt: &Tensor,
) -> (f64, Grads) {
    let out = tpar::spawn_scoped(
        tpar::SpawnConfig::new(pp),
        |ctx| -> tpar::Result<(Option<f64>, Grads)> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[pp], &["pp"])?;
            let mut sched =
                PipelineSchedule::new(kind, stages(cfg, &mesh, v)?, m, loss_fn(cfg.vocab_size))?;
            let losses = sched.step(Some(ids), Some(tgt))?;
            let mut grads = Grads::new();
            for st in sched.stages() {
                for (n, p) in named_parameters(st.module()) {
                    let g = p.trainable().grad().expect("every parameter gets a gradient");
                    grads.insert(n, g.to_vec_f64()?);
                }
            }
            let loss =
                (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64);
            Ok((loss, grads))
        },
    )
    .unwrap_or_else(|e| panic!("{kind} pp {pp} v {v} m {m}: {e}"));
    let loss = out.iter().find_map(|(l, _)| *l).unwrap();
    let grads = out.into_iter().flat_map(|(_, g)| g).collect();
    (loss, grads)
}

fn assert_equal_to_reference(what: &str, got: (f64, Grads), want: &(f64, Grads)) {
    assert!((got.0 - want.0).abs() < 1e-10, "{what}: loss {} vs {}", got.0, want.0);
    assert_eq!(got.1.keys().collect::<Vec<_>>(), want.1.keys().collect::<Vec<_>>(), "{what}");
    for (k, g) in &got.1 {
        let w = &want.1[k];
        let err = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-10, "{what}: gradient of {k} differs by {err}");
    }
}

#[test]
fn every_schedule_equals_the_unpipelined_model() {
    let seq = 4;
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZeroBubble,
        ScheduleKind::Interleaved1F1B,
    ] {
        for pp in 2..=4 {
            let v = if kind == ScheduleKind::Interleaved1F1B { 2 } else { 1 };
            let cfg = config(pp * v + 1, DType::F64);
            for m in 1..=8 {
                if Schedule::build(kind, pp, v, m).is_err() {
                    continue; // a size the schedule refuses (checked in its own tests)
                }
                let (ids, tgt) = batch(m, seq, cfg.vocab_size);
                let want = reference(&cfg, &ids, &tgt);
                let got = pipelined(kind, pp, v, m, &cfg, &ids, &tgt);
                assert_equal_to_reference(&format!("{kind} pp {pp} m {m}"), got, &want);
            }
        }
    }
}

#[test]
fn uneven_micro_batches_are_an_error_naming_the_sizes() {
    let cfg = config(2, DType::F32);
    let (ids, tgt) = batch(6, 4, cfg.vocab_size);
    let err = tpar::spawn_scoped(tpar::SpawnConfig::new(2), |ctx| -> tpar::Result<()> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["pp"])?;
        let mut s = PipelineSchedule::new(
            ScheduleKind::OneFOneB,
            stages(&cfg, &mesh, 1)?,
            4,
            loss_fn(cfg.vocab_size),
        )?;
        s.step(Some(&ids), Some(&tgt))?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("[6, 4]") && err.contains("4 equal micro-batches"), "{err}");
}

/// `y = x W` whose forward, input-gradient and weight-gradient parts each take `ms`
/// milliseconds (a sleep), so a measured timeline shows the schedule's shape whatever the
/// machine's cores.
struct SleepMatmul {
    ms: u64,
    saved: Option<(Tensor, Tensor)>,
}

impl Function for SleepMatmul {
    fn name(&self) -> &'static str {
        "sleep_matmul"
    }
    fn forward(&mut self, x: &[Tensor]) -> tpar::tensor::Result<Tensor> {
        std::thread::sleep(Duration::from_millis(self.ms));
        self.saved = Some((x[0].clone(), x[1].clone()));
        x[0].matmul(&x[1])
    }
    fn backward(&self, g: &Tensor) -> tpar::tensor::Result<Vec<Option<Tensor>>> {
        let (x, w) = self.saved.as_ref().expect("forward ran");
        let gx = if needs_input_grad(0) {
            std::thread::sleep(Duration::from_millis(self.ms));
            Some(g.matmul_t(w, false, true)?)
        } else {
            None
        };
        let gw = if needs_input_grad(1) {
            std::thread::sleep(Duration::from_millis(self.ms));
            Some(x.matmul_t(g, true, false)?)
        } else {
            None
        };
        Ok(vec![gx, gw])
    }
}

/// A stage of [`SleepMatmul`]s; fails (error or panic) at forward call `fail_at` if set.
struct Sleepy {
    core: tpar::nn::ModuleCore,
    w: Param,
    ms: u64,
    calls: AtomicUsize,
    fail_at: Option<(usize, bool)>,
}

impl Sleepy {
    fn new(d: usize, ms: u64, seed: u64) -> Sleepy {
        let mut rng = Rng::new(seed);
        let w = Tensor::randn([d, d], DType::F32, &mut rng).unwrap().mul_scalar(0.3).unwrap();
        Sleepy {
            core: Default::default(),
            w: Param::Tensor(w.requires_grad_(true)),
            ms,
            calls: AtomicUsize::new(0),
            fail_at: None,
        }
    }
}

impl Module for Sleepy {
    fn type_name(&self) -> &'static str {
        "Sleepy"
    }
    fn forward(&self, args: Args) -> tpar::nn::Result<Value> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some((at, panic)) = self.fail_at {
            if n == at {
                if panic {
                    panic!("stage module panicked at call {n}");
                }
                return Err(NnError::Config { what: format!("stage module failed at call {n}") });
            }
        }
        let x = args.get(0).into_tensor("Sleepy")?;
        let w = self.w.trainable();
        Ok(Value::Tensor(apply(SleepMatmul { ms: self.ms, saved: None }, &[&x, &w])?))
    }
    fn params(&self) -> Vec<(&'static str, &Param)> {
        vec![("weight", &self.w)]
    }
    tpar::nn::module_boilerplate!();
}

fn square_loss(out: &Value, _t: &Tensor) -> tpar::nn::Result<Value> {
    Ok(Value::Tensor(out.clone().into_tensor("loss")?.square()?.mean_all()?))
}

/// Measured bubble fraction (median of 3 steps) of `kind` on 4 sleepy stages.
fn measured_bubble(kind: ScheduleKind, m: usize) -> (f64, f64) {
    let pp = 4;
    let out = tpar::spawn_scoped(tpar::SpawnConfig::new(pp), |ctx| -> tpar::Result<(f64, f64)> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[pp], &["pp"])?;
        let r = mesh.local_rank();
        let stage = PipelineStage::new(Sleepy::new(8, 4, r as u64), r, pp, &mesh, Device::Cpu)?;
        let mut s = PipelineSchedule::new(kind, vec![stage], m, square_loss)?;
        let x = Tensor::ones([m * 2, 8], DType::F32, Device::Cpu)?;
        let mut bubbles = Vec::new();
        for _ in 0..3 {
            s.step(Some(&x), Some(&x))?;
            bubbles.push(s.gather_timeline()?.bubble_fraction());
        }
        bubbles.sort_by(f64::total_cmp);
        Ok((bubbles[1], s.schedule().bubble()))
    })
    .unwrap();
    out[0]
}

#[test]
fn zero_bubble_idles_less_than_1f1b_measured() {
    let (zb, zb_theory) = measured_bubble(ScheduleKind::ZeroBubble, 8);
    let (ofob, ofob_theory) = measured_bubble(ScheduleKind::OneFOneB, 8);
    println!("measured bubble: zb {zb:.3} (theory {zb_theory:.3}), 1f1b {ofob:.3} (theory {ofob_theory:.3})");
    assert!(zb < ofob, "zero-bubble {zb} is not below 1F1B {ofob}");
    // The measured shape follows the schedule's own simulation.
    assert!((ofob - ofob_theory).abs() < 0.1, "1F1B measured {ofob} vs simulated {ofob_theory}");
}

#[test]
fn a_failing_stage_fails_every_rank_naming_it() {
    for panic in [false, true] {
        let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t0 = Instant::now();
        let config = SpawnConfig::new(3).timeout(Duration::from_secs(30));
        let res = tpar::spawn_scoped(config, |ctx| -> tpar::Result<()> {
            let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[3], &["pp"])?;
            let r = mesh.local_rank();
            let mut module = Sleepy::new(8, 0, r as u64);
            if r == 1 {
                module.fail_at = Some((2, panic));
            }
            let stage = PipelineStage::new(module, r, 3, &mesh, Device::Cpu)?;
            let mut s = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![stage], 4, square_loss)?;
            let x = Tensor::ones([8, 8], DType::F32, Device::Cpu)?;
            let r2 = s.step(Some(&x), Some(&x));
            if let Err(e) = &r2 {
                errors.lock().unwrap().push((r, e.to_string()));
            }
            Ok(r2.map(|_| ())?)
        });
        let elapsed = t0.elapsed();
        assert!(res.is_err());
        assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
        let errors = errors.lock().unwrap();
        for (r, e) in errors.iter().filter(|(r, _)| *r != 1) {
            assert!(e.contains("rank 1"), "rank {r} (panic {panic}): {e}");
        }
        // Both peers failed (the panicking rank records nothing).
        assert_eq!(errors.iter().filter(|(r, _)| *r != 1).count(), 2, "{errors:?}");
    }
}

/// Every parameter after one AdamW step (clip 1.0) of the whole model on the whole batch.
fn reference_step(cfg: &LlamaConfig, ids: &Tensor, tgt: &Tensor) -> BTreeMap<String, Vec<f64>> {
    let mut model = LlamaForPretraining::new(cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 7).unwrap();
    let loss = loss_fn(cfg.vocab_size)(&model.logits(ids, None).unwrap(), tgt).unwrap();
    loss.backward().unwrap();
    let params = parameters(&model);
    clip_grad_norm_(&params, 1.0, &ClipOptions::default()).unwrap();
    let mut opt = AdamW::with_names(named_parameters(&model), adamw()).unwrap();
    opt.step().unwrap();
    named_parameters(&model)
        .into_iter()
        .map(|(n, p)| (n, p.trainable().to_vec_f64().unwrap()))
        .collect()
}

fn adamw() -> AdamWConfig {
    AdamWConfig { lr: 1e-2, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 }
}

/// One step on a (pp=2, dp=2, tp=2) mesh of 8 ranks: the stages tensor-parallel on tp
/// (`sp`: the sequence-parallel plan, else Megatron) and FSDP (else DDP) on dp.
fn step_3d(
    kind: ScheduleKind,
    sp: bool,
    fsdp: bool,
    cfg: &LlamaConfig,
    ids: &Tensor,
    tgt: &Tensor,
) -> BTreeMap<String, Vec<f64>> {
    let out = tpar::spawn_scoped(
        tpar::SpawnConfig::new(8),
        |ctx| -> tpar::Result<BTreeMap<String, Vec<f64>>> {
            let world = ctx.world_group();
            let mesh = DeviceMesh::new(&world, DeviceType::Cpu, &[2, 2, 2], &["pp", "dp", "tp"])?;
            let (pp_rank, dp_rank) = (mesh["pp"].local_rank(), mesh["dp"].local_rank());
            let mut st = LlamaStage::for_stage(cfg, pp_rank, 2, None, Device::Meta)?;
            let layer_plan =
                if sp { sequence_parallel_layer_plan() } else { megatron_layer_plan() };
            parallelize_llama_stage(&mut st, &mesh["tp"], &layer_plan, &top_level_plan())?;
            if fsdp {
                for layer in &mut st.base_model.layers.items {
                    fully_shard(layer, &mesh["dp"], &FsdpConfig::default())?;
                }
                fully_shard(&mut st, &mesh["dp"], &FsdpConfig::default())?;
            }
            reset_parameters(&mut st, Device::Cpu, 7)?;
            let ddp = if fsdp { None } else { Some(DataParallel::new(&mut st, &mesh["dp"])?) };
            let stage = PipelineStage::new(st, pp_rank, 2, &mesh["pp"], Device::Cpu)?;
            let mut sched = PipelineSchedule::new(kind, vec![stage], 2, loss_fn(cfg.vocab_size))?;
            let rows = ids.dims()[0] / 2;
            let (my_ids, my_tgt) =
                (ids.narrow(0, dp_rank * rows, rows)?, tgt.narrow(0, dp_rank * rows, rows)?);
            {
                let _loss_parallel = loss_parallel::enable(&mesh["tp"]);
                // DDP: the micro-batches accumulate, averaged once after the schedule.
                let _no_sync = ddp.as_ref().map(DataParallel::no_sync);
                sched.step(Some(&my_ids), Some(&my_tgt))?;
            }
            if let Some(ddp) = &ddp {
                ddp.sync_gradients(sched.stages()[0].module())?;
            }
            let params = sched.parameters();
            clip_grad_norm_(&params, 1.0, &ClipOptions::default().pp(mesh.group_of("pp")?))?;
            let mut opt = AdamW::with_names(named_parameters(sched.stages()[0].module()), adamw())?;
            opt.step()?;
            let opts = StateDictOptions { full_state_dict: true, ..Default::default() };
            let (sd, _) =
                tpar::checkpoint::get_state_dict(sched.stages()[0].module(), None, &world, &opts)?;
            let mut out = BTreeMap::new();
            for (k, v) in sd {
                if let StateValue::Tensor(t) = v {
                    out.insert(k, t.to_vec_f64()?);
                }
            }
            Ok(out)
        },
    )
    .unwrap_or_else(|e| panic!("3-D {kind} sp {sp} fsdp {fsdp}: {e}"));
    out.into_iter().next().unwrap()
}

#[test]
fn three_d_pp_dp_tp_step_equals_the_single_rank_step() {
    let cfg = config(4, DType::F64);
    let (ids, tgt) = batch(8, 4, cfg.vocab_size);
    let want = reference_step(&cfg, &ids, &tgt);
    for (kind, sp, fsdp) in [
        (ScheduleKind::OneFOneB, true, true),
        (ScheduleKind::ZeroBubble, false, false),
        (ScheduleKind::ZeroBubble, true, true),
        (ScheduleKind::GPipe, false, true),
    ] {
        let got = step_3d(kind, sp, fsdp, &cfg, &ids, &tgt);
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        for (k, g) in &got {
            let err = g.iter().zip(&want[k]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            assert!(err < 1e-9, "{kind} sp {sp} fsdp {fsdp}: {k} differs by {err}");
        }
    }
}

#[test]
fn shapes_are_agreed_on_the_first_step_only() {
    let cfg = config(2, DType::F32);
    let (ids, tgt) = batch(4, 4, cfg.vocab_size);
    let sends = tpar::spawn_scoped(
        tpar::SpawnConfig::new(2),
        |ctx| -> tpar::Result<Vec<Vec<Vec<usize>>>> {
            let world = ctx.world_group();
            let mesh = DeviceMesh::new(&world, DeviceType::Cpu, &[2], &["pp"])?;
            let mut s = PipelineSchedule::new(
                ScheduleKind::OneFOneB,
                stages(&cfg, &mesh, 1)?,
                4,
                loss_fn(cfg.vocab_size),
            )?;
            let debug = world.comm_debug();
            debug.enable();
            let mut per_step = Vec::new();
            for _ in 0..2 {
                s.step(Some(&ids), Some(&tgt))?;
                let recs = debug.take();
                per_step.push(
                    recs.iter()
                        .filter(|r| r.kind == tpar::collectives::CollectiveKind::Send)
                        .map(|r| r.shape.clone())
                        .collect(),
                );
            }
            Ok(per_step)
        },
    )
    .unwrap();
    // Stage 0 sends its 4 activations each step, and their shape only before the first.
    let act = vec![1, 4, 16];
    assert_eq!(sends[0][0], vec![vec![5], act.clone(), act.clone(), act.clone(), act.clone()]);
    assert_eq!(sends[0][1], vec![act.clone(); 4]);
    // Stage 1 sends 4 gradients each step, never a shape.
    assert_eq!(sends[1][0], vec![act.clone(); 4]);
    assert_eq!(sends[1][1], vec![act; 4]);
}
