//! Every `Stateful` a training run checkpoints (the model, a pipeline schedule's stages,
//! AdamW, SGD, ZeRO-1, the LR schedule, the sampler, the examples' trainer counters) round-trips through a
//! checkpoint: saved from objects whose every field is off its default, loaded into
//! objects whose every field differs from the saved ones, the loaded objects' state
//! equals the saved state field by field and they behave as the saved ones do (the next
//! step, the next learning rate, the next epoch's indices). A field that a load forgot
//! fails this test.

use std::path::{Path, PathBuf};

use tpar::checkpoint::{CheckpointConfig, CheckpointManager, RunConfig};
use tpar::prelude::*;

#[path = "../examples/common/run.rs"]
#[allow(dead_code)]
mod run;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-roundtrip-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32,
        max_position_embeddings: 8,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        ..Default::default()
    }
}

/// Everything a run checkpoints, built from `seed`, `lr` and `epoch`, then trained
/// `steps` steps, so every field is set by the run: parameters, moments and step counts,
/// momentum buffers, the schedule's position, the sampler's epoch and seed, the
/// trainer's counters.
struct Run {
    model: LlamaForPretraining,
    adamw: AdamW,
    sgd_model: LlamaForPretraining,
    sgd: Sgd,
    zero_model: LlamaForPretraining,
    zero: ZeroRedundancyOptimizer<AdamW>,
    sched: LrScheduler<SequentialLR>,
    sampler: DistributedSampler,
    progress: run::Progress,
    config: RunConfig,
    /// Two pipeline stages (pp 2 over the two ranks), one on each rank.
    pipe: PipelineSchedule,
}

/// One training step of `model` on a fixed batch.
fn backward(model: &LlamaForPretraining, step: usize) -> tpar::Result<()> {
    let ids: Vec<i64> = (0..16).map(|i| ((i * 7 + step * 3) % 32) as i64).collect();
    let ids = Tensor::from_vec(ids, [2, 8])?;
    let targets = ids.reshape([16])?;
    let loss = model.logits(&ids, None)?.reshape(&[-1, 32])?.cross_entropy(&targets, -100)?;
    Ok(loss.backward()?)
}

/// `alt` takes other hyper-parameters everywhere (betas, eps, weight decay, momentum,
/// dampening, Nesterov).
fn build(
    g: &ProcessGroup,
    seed: u64,
    lr: f64,
    epoch: u64,
    steps: usize,
    alt: bool,
) -> tpar::Result<Run> {
    let new_model = |seed| -> tpar::Result<LlamaForPretraining> {
        let mut m = LlamaForPretraining::new(&config(), Device::Meta)?;
        reset_parameters(&mut m, Device::Cpu, seed)?;
        Ok(m)
    };
    let mesh = DeviceMesh::new(g, DeviceType::Cpu, &[g.size()], &["dp"])?;
    let model = new_model(seed)?;
    let cfg = if alt {
        AdamWConfig { lr, betas: (0.8, 0.9), eps: 1e-6, weight_decay: 0.2 }
    } else {
        AdamWConfig { lr, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 }
    };
    let mut adamw = AdamW::with_names(named_parameters(&model), cfg)?;
    let sgd_model = new_model(seed + 1)?;
    let sgd_cfg = if alt {
        SgdConfig { lr, momentum: 0.5, dampening: 0.0, weight_decay: 0.0, nesterov: true }
    } else {
        SgdConfig { lr, momentum: 0.9, dampening: 0.1, weight_decay: 0.01, nesterov: false }
    };
    let mut sgd = Sgd::with_names(named_parameters(&sgd_model), sgd_cfg)?;
    let mut zero_model = new_model(seed + 2)?;
    sync_module_states(&mut zero_model, &mesh["dp"])?;
    let mut zero = ZeroRedundancyOptimizer::adamw(named_parameters(&zero_model), &mesh["dp"], cfg)?;
    let mut sched =
        LrScheduler::new(SequentialLR::warmup_cosine(2, 10, 0.1, lr * 0.1)?, &mut adamw);
    for step in 0..steps {
        backward(&model, step)?;
        adamw.step()?;
        sched.step(&mut adamw);
        adamw.zero_grad();
        backward(&sgd_model, step)?;
        sgd.step()?;
        sgd.zero_grad();
        backward(&zero_model, step)?;
        zero.step()?;
        zero.zero_grad();
    }
    let mut sampler = DistributedSampler::new(g.size(), g.rank())?
        .with_shuffle(true)
        .with_seed(seed * 31 + 7)
        .with_drop_last(true);
    sampler.set_epoch(epoch);
    let progress = run::Progress { step: steps * 10 + 3, first_loss: 1.0 / (seed as f64 + 3.0) };
    let pp = DeviceMesh::new(g, DeviceType::Cpu, &[g.size()], &["pp"])?;
    let mut stage = LlamaStage::for_stage(&config(), pp.local_rank(), 2, None, Device::Meta)?;
    reset_parameters(&mut stage, Device::Cpu, seed + 3)?;
    let stage = PipelineStage::new(stage, pp.local_rank(), 2, &pp["pp"], Device::Cpu)?;
    let loss_fn = |logits: &Value, t: &Tensor| -> tpar::nn::Result<Value> {
        let l = logits.clone().into_tensor("logits")?;
        let l = l.reshape([l.numel() / 32, 32])?;
        Ok(Value::Tensor(l.cross_entropy(&t.reshape([t.numel()])?, -100)?))
    };
    let pipe = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![stage], 2, loss_fn)?;
    // Every stage parameter off its initial value (norm weights start at one everywhere).
    for p in pipe.parameters() {
        let t = p.trainable();
        tpar::tensor::no_grad(|| t.copy_(&t.mul_scalar(1.0 + seed as f64 / 64.0)?))?;
    }
    let config = RunConfig::new().require("layers", config().num_hidden_layers).record("lr", lr);
    Ok(Run {
        model,
        adamw,
        sgd_model,
        sgd,
        zero_model,
        zero,
        sched,
        sampler,
        progress,
        config,
        pipe,
    })
}

impl Run {
    fn items<R>(
        &mut self,
        f: impl FnOnce(&mut [(&str, &mut dyn Stateful)]) -> tpar::Result<R>,
    ) -> tpar::Result<R> {
        let mut model = ModuleState::new(&mut self.model);
        let mut sgd_model = ModuleState::new(&mut self.sgd_model);
        let mut zero_model = ModuleState::new(&mut self.zero_model);
        f(&mut [
            ("config", &mut self.config),
            ("model", &mut model),
            ("optim", &mut self.adamw),
            ("sgd_model", &mut sgd_model),
            ("sgd", &mut self.sgd),
            ("zero_model", &mut zero_model),
            ("zero", &mut self.zero),
            ("lr_scheduler", &mut self.sched),
            ("sampler", &mut self.sampler),
            ("trainer", &mut self.progress),
            ("pipe", &mut self.pipe),
        ])
    }

    /// Every item's state, each value as bits (tensors whole, by their f64 bits).
    fn state(&mut self) -> tpar::Result<Vec<(String, Vec<u64>)>> {
        self.items(|items| {
            let mut out = Vec::new();
            for (name, item) in items.iter() {
                for (k, v) in item.state_dict()? {
                    let bits = match v {
                        StateValue::Tensor(t) => {
                            t.to_vec_f64()?.iter().map(|x| x.to_bits()).collect()
                        }
                        StateValue::Sharded(s) => {
                            let mut b = Vec::new();
                            for c in s.chunks() {
                                b.extend(c.offsets.iter().map(|&o| o as u64));
                                b.extend(c.tensor.to_vec_f64()?.iter().map(|x| x.to_bits()));
                            }
                            b
                        }
                        StateValue::Int(i) => vec![i as u64],
                        StateValue::Float(f) => vec![f.to_bits()],
                        StateValue::Text(t) => t.bytes().map(u64::from).collect(),
                    };
                    out.push((format!("{name}.{k}"), bits));
                }
            }
            Ok(out)
        })
    }

    /// What the next step does: the parameters after one more step of each optimizer,
    /// the next learning rate, the sampler's indices.
    fn next(&mut self) -> tpar::Result<Vec<u64>> {
        let mut out = Vec::new();
        backward(&self.model, 100)?;
        self.adamw.step()?;
        out.push(self.sched.step(&mut self.adamw).to_bits());
        backward(&self.sgd_model, 100)?;
        self.sgd.step()?;
        backward(&self.zero_model, 100)?;
        self.zero.step()?;
        for m in [&self.model, &self.sgd_model, &self.zero_model] {
            for p in parameters(m) {
                out.extend(p.local().to_vec_f64()?.iter().map(|x| x.to_bits()));
            }
        }
        out.extend(self.sampler.indices(50).iter().map(|&i| i as u64));
        Ok(out)
    }
}

fn roundtrip(dir: &Path) -> tpar::Result<()> {
    let dir = dir.to_path_buf();
    spawn(2, move |ctx| -> tpar::Result<()> {
        let g = ctx.world_group();
        let mut saved = build(&g, 1, 1e-2, 5, 3, false)?;
        // Every field differs from the saved run's: other parameters, no optimizer
        // state, another learning rate, step 0 of the schedule, epoch 0 and another seed.
        let mut loaded = build(&g, 99, 3e-2, 0, 0, true)?;
        loaded.sampler = DistributedSampler::new(g.size(), g.rank())?
            .with_shuffle(true)
            .with_seed(12345)
            .with_drop_last(true);
        loaded.progress = run::Progress { step: 0, first_loss: f64::NAN };
        let before = loaded.state()?;
        let want = saved.state()?;
        for ((k, a), (_, b)) in want.iter().zip(&before) {
            // Only the run's configuration (which must match to resume) and the
            // sampler's recorded-only fields are the same before the load.
            let same_by_design = k.starts_with("config.")
                || [
                    "sampler.num_replicas",
                    "sampler.shuffle",
                    "sampler.drop_last",
                    "lr_scheduler.schedule",
                ]
                .contains(&k.as_str());
            assert!(
                a != b || same_by_design,
                "{k} is the same before the load ({a:?}): the test could not see it restored"
            );
        }
        let mut manager = CheckpointManager::new(&dir, &g, CheckpointConfig::default())?;
        saved.items(|items| Ok(manager.save(7, items)?))?;
        // The loaded scheduler keeps its own (higher) base learning rate unless the
        // checkpoint's is restored: the schedules are the same function of it.
        loaded.sched = LrScheduler::new(
            SequentialLR::warmup_cosine(2, 10, 0.1, 1e-2 * 0.1)?,
            &mut loaded.adamw,
        );
        let step = loaded.items(|items| Ok(manager.load_latest(items)?))?;
        assert_eq!(step, Some(7));
        let got = loaded.state()?;
        assert_eq!(got.len(), want.len());
        for ((k, a), (k2, b)) in want.iter().zip(&got) {
            assert_eq!(k, k2);
            // A run's configuration is compared on load, never replaced by the saved one.
            assert!(a == b || k == "config.lr", "{k}: not restored");
        }
        assert_eq!(loaded.sampler.epoch(), 5);
        assert_eq!(saved.next()?, loaded.next()?, "the loaded run's next step differs");
        Ok(())
    })?;
    Ok(())
}

#[test]
fn every_stateful_round_trips_through_a_checkpoint() {
    let dir = tmp("all");
    roundtrip(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
