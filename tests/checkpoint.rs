//! Distributed checkpoints of the Llama with its optimizer: saved under one mesh, plan
//! and data-parallel mode, loaded under another, every parameter and optimizer state
//! equal bit for bit; a resumed run equal to an uninterrupted one; failures that leave
//! the previous checkpoint loadable and name the rank, file and key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tpar::checkpoint::{
    full_state_dict, get_state_dict, import_safetensors, load, save, CheckpointConfig,
    CheckpointError, CheckpointManager, LoadOptions, ModuleState, SaveOptions, StateDictOptions,
};
use tpar::prelude::*;
use tpar::tensor::state::{StateDictError, Stateful};

/// How a run lays the model out.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Fsdp,
    Ddp,
    Zero1,
}

#[derive(Clone, Copy, Debug)]
struct Layout {
    dp: usize,
    tp: usize,
    mode: Mode,
    /// Sequence-parallel plan (else Megatron).
    sp: bool,
}

fn layout(dp: usize, tp: usize, mode: Mode, sp: bool) -> Layout {
    Layout { dp, tp, mode, sp }
}

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 48,
        max_position_embeddings: 8,
        hidden_size: 32,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        dtype: DType::F32,
    }
}

/// The optimizer of each mode, as one `Stateful`.
enum Opt {
    Plain(AdamW),
    Zero(ZeroRedundancyOptimizer<AdamW>),
}

impl Opt {
    fn get(&mut self) -> &mut dyn Optimizer {
        match self {
            Opt::Plain(a) => a,
            Opt::Zero(z) => z,
        }
    }
    fn stateful(&mut self) -> &mut dyn Stateful {
        match self {
            Opt::Plain(a) => a,
            Opt::Zero(z) => z,
        }
    }
}

struct Run {
    mesh: DeviceMesh,
    model: LlamaForPretraining,
    opt: Opt,
    _ddp: Option<DataParallel>,
    sched: LrScheduler<SequentialLR>,
    layout: Layout,
}

fn build(world: &ProcessGroup, l: Layout, seed: u64) -> tpar::Result<Run> {
    let mesh = DeviceMesh::new(world, DeviceType::Cpu, &[l.dp, l.tp], &["dp", "tp"])?;
    let mut model = LlamaForPretraining::new(&config(), Device::Meta)?;
    if l.tp > 1 {
        let plan = if l.sp { sequence_parallel_layer_plan() } else { megatron_layer_plan() };
        parallelize_llama(&mut model, &mesh["tp"], &plan)?;
    }
    if l.mode == Mode::Fsdp && l.dp > 1 {
        let fsdp = FsdpConfig::default();
        for layer in &mut model.base_model.layers.items {
            fully_shard(layer, &mesh["dp"], &fsdp)?;
        }
        fully_shard(&mut model, &mesh["dp"], &fsdp)?;
    }
    reset_parameters(&mut model, Device::Cpu, seed)?;
    let ddp = match l.mode {
        Mode::Ddp if l.dp > 1 => Some(DataParallel::new(&mut model, &mesh["dp"])?),
        Mode::Zero1 if l.dp > 1 => {
            sync_module_states(&mut model, &mesh["dp"])?;
            None
        }
        _ => None,
    };
    let adamw = AdamWConfig { lr: 1e-2, betas: (0.9, 0.99), eps: 1e-8, weight_decay: 0.1 };
    let mut opt = match l.mode {
        Mode::Zero1 => {
            Opt::Zero(ZeroRedundancyOptimizer::adamw(named_parameters(&model), &mesh["dp"], adamw)?)
        }
        _ => Opt::Plain(AdamW::with_names(named_parameters(&model), adamw)?),
    };
    let sched = LrScheduler::new(SequentialLR::warmup_cosine(2, 6, 0.1, 1e-3)?, opt.get());
    Ok(Run { mesh, model, opt, _ddp: ddp, sched, layout: l })
}

/// The global batch of `step` (8 sequences), the same whatever the layout; each dp rank
/// takes its rows.
fn batch(step: usize, dp: usize, dp_rank: usize) -> tpar::Result<(Tensor, Tensor)> {
    let (rows, seq, vocab) = (8usize, 8usize, 48u64);
    let mut ids = Vec::with_capacity(rows * (seq + 1));
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ step as u64;
    for _ in 0..rows * (seq + 1) {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ids.push(((x >> 33) % vocab) as i64);
    }
    let per = rows / dp;
    let mine: Vec<i64> = ids[dp_rank * per * (seq + 1)..(dp_rank + 1) * per * (seq + 1)].to_vec();
    let all = Tensor::from_vec(mine, [per, seq + 1])?;
    Ok((all.narrow(1, 0, seq)?.deep_clone()?, all.narrow(1, 1, seq)?.deep_clone()?))
}

impl Run {
    /// One training step; returns the loss averaged over dp.
    fn step(&mut self, step: usize) -> tpar::Result<f64> {
        let l = self.layout;
        let (ids, targets) = batch(step, l.dp, self.mesh["dp"].local_rank())?;
        let _lp = loss_parallel::enable(&self.mesh["tp"]);
        unshard(&self.model)?;
        let logits = self.model.logits(&ids, None)?.reshape(&[-1, 48])?;
        let loss = logits.cross_entropy(&targets.reshape([targets.numel()])?, -100)?;
        loss.backward()?;
        match &mut self.opt {
            Opt::Plain(_) => {
                clip_grad_norm_(&parameters(&self.model), 1.0, &ClipOptions::default())?;
            }
            Opt::Zero(z) => {
                clip_grad_norm_(&mut *z, 1.0, &ClipOptions::default())?;
            }
        }
        self.opt.get().step()?;
        self.sched.step(self.opt.get());
        self.opt.get().zero_grad();
        let local = Tensor::scalar(loss.item()?, DType::F64);
        Ok(self.mesh.group_of("dp")?.all_reduce(&local, ReduceOp::Avg)?.item()?)
    }

    /// Model and optimizer as whole tensors (keys `model.*`, `optim.*`), gathered over
    /// the world, as f64 bit patterns for exact comparison.
    fn full(&mut self, world: &ProcessGroup) -> tpar::Result<Vec<(String, Vec<u64>)>> {
        let opts = StateDictOptions { full_state_dict: true, ..Default::default() };
        let (m, _) = get_state_dict(&self.model, None, world, &opts)?;
        let o = full_state_dict(&self.opt.stateful().state_dict()?, world, false)?;
        let mut out = Vec::new();
        for (prefix, sd) in [("model", m), ("optim", o)] {
            for (k, v) in sd {
                let bits = match v {
                    StateValue::Tensor(t) => t.to_vec_f64()?.iter().map(|x| x.to_bits()).collect(),
                    StateValue::Int(i) => vec![i as u64],
                    StateValue::Float(f) => vec![f.to_bits()],
                    other => panic!("{k}: unexpected {}", other.kind()),
                };
                out.push((format!("{prefix}.{k}"), bits));
            }
        }
        Ok(out)
    }

    /// Runs `f` on the run's checkpointed items (and the trainer's counters).
    fn with_items<R>(
        &mut self,
        progress: Option<&mut Progress>,
        f: impl FnOnce(&mut [(&str, &mut dyn Stateful)]) -> tpar::Result<R>,
    ) -> tpar::Result<R> {
        let Run { model, opt, sched, .. } = self;
        let mut model = ModuleState::new(model);
        let mut items: Vec<(&str, &mut dyn Stateful)> =
            vec![("model", &mut model), ("optim", opt.stateful()), ("lr_scheduler", sched)];
        if let Some(p) = progress {
            items.push(("trainer", p));
        }
        f(&mut items)
    }

    /// The run's state dict as one checkpoint holds it.
    fn state(&mut self) -> tpar::Result<StateDict> {
        self.with_items(None, |items| {
            let mut sd = StateDict::new();
            for (name, item) in items.iter() {
                sd.extend(tpar::tensor::state::with_prefix(name, item.state_dict()?));
            }
            Ok(sd)
        })
    }
}

fn spawn_layout<R: Send>(l: Layout, f: impl Fn(&ProcessGroup) -> tpar::Result<R> + Sync) -> Vec<R> {
    spawn_scoped(SpawnConfig::new(l.dp * l.tp).timeout(Duration::from_secs(120)), |ctx| {
        f(&ctx.world_group())
    })
    .unwrap_or_else(|e| panic!("{l:?}: {e}"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Trains two steps under `from`, saves, loads under `to` into a differently seeded
/// model and a fresh optimizer: the full parameters and optimizer state equal.
fn round_trip(from: Layout, to: Layout) {
    let dir = tmp(&format!(
        "rt-{}{}{:?}{}-{}{}{:?}{}",
        from.dp, from.tp, from.mode, from.sp, to.dp, to.tp, to.mode, to.sp
    ));
    let saved = spawn_layout(from, |w| {
        let mut r = build(w, from, 1)?;
        r.step(0)?;
        r.step(1)?;
        save(&r.state()?, &dir, w, &SaveOptions::default())?;
        r.full(w)
    });
    let loaded = spawn_layout(to, |w| {
        let mut r = build(w, to, 2)?;
        let mut sd = r.state()?;
        load(&mut sd, &dir, w, &LoadOptions::default())?;
        r.with_items(None, |items| {
            for (name, item) in items.iter_mut() {
                item.load_state_dict(tpar::tensor::state::split_prefix(name, &mut sd))?;
            }
            Ok(())
        })?;
        r.full(w)
    });
    let (a, b) = (&saved[0], &loaded[0]);
    assert_eq!(a.len(), b.len(), "{from:?} -> {to:?}: key counts");
    for ((ka, va), (kb, vb)) in a.iter().zip(b) {
        assert_eq!(ka, kb, "{from:?} -> {to:?}");
        assert!(va == vb, "{from:?} -> {to:?}: {ka} differs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fsdp_2x2_loads_under_every_layout() {
    let from = layout(2, 2, Mode::Fsdp, true);
    for to in [
        layout(1, 4, Mode::Fsdp, true),
        layout(4, 1, Mode::Fsdp, true),
        layout(1, 1, Mode::Fsdp, true),
        layout(2, 1, Mode::Ddp, true),
        layout(2, 2, Mode::Zero1, true),
        layout(2, 2, Mode::Fsdp, false),
    ] {
        round_trip(from, to);
    }
}

#[test]
fn every_layout_loads_under_fsdp_2x2() {
    let to = layout(2, 2, Mode::Fsdp, true);
    for from in [
        layout(1, 4, Mode::Fsdp, false),
        layout(4, 1, Mode::Fsdp, true),
        layout(1, 1, Mode::Fsdp, true),
        layout(2, 1, Mode::Ddp, true),
        layout(2, 2, Mode::Zero1, false),
        layout(2, 2, Mode::Fsdp, false),
    ] {
        round_trip(from, to);
    }
}

/// The trainer's own counters.
struct Progress {
    step: i64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> Result<StateDict, StateDictError> {
        Ok(StateDict::from([("step".to_string(), StateValue::Int(self.step))]))
    }
    fn load_state_dict(&mut self, mut s: StateDict) -> Result<(), StateDictError> {
        self.step = tpar::tensor::state::take_int(&mut s, "step")?;
        tpar::tensor::state::expect_empty(s)
    }
}

/// `steps` steps from a fresh start or from the latest checkpoint in `dir`, saving every
/// `save_every` steps and stopping after `stop_after`: per-step losses and the final
/// full state.
fn train(
    l: Layout,
    dir: &Path,
    stop_after: usize,
    async_save: bool,
) -> (Vec<u64>, Vec<(String, Vec<u64>)>) {
    let out = spawn_layout(l, |w| {
        let mut r = build(w, l, 1)?;
        let config = CheckpointConfig { keep: Some(2), async_save, ..Default::default() };
        let mut ckpt = CheckpointManager::new(dir, w, config)?;
        let mut progress = Progress { step: 0 };
        r.with_items(Some(&mut progress), |items| Ok(ckpt.load_latest(items)?))?;
        let mut losses = Vec::new();
        while (progress.step as usize) < stop_after {
            losses.push(r.step(progress.step as usize)?.to_bits());
            progress.step += 1;
            ckpt.poll()?;
            if progress.step % 2 == 1 {
                let step = progress.step as u64;
                r.with_items(Some(&mut progress), |items| Ok(ckpt.save(step, items)?))?;
            }
        }
        ckpt.wait()?;
        Ok((losses, r.full(w)?))
    });
    out.into_iter().next().expect("rank 0")
}

#[test]
fn resumed_run_equals_uninterrupted_run() {
    for (l, async_save) in
        [(layout(2, 2, Mode::Fsdp, true), false), (layout(2, 2, Mode::Zero1, false), true)]
    {
        let (a, b) = (tmp("straight"), tmp("resumed"));
        let (losses, full) = train(l, &a, 6, async_save);
        let (mut first, _) = train(l, &b, 3, async_save);
        let (rest, resumed) = train(l, &b, 6, async_save);
        first.extend(rest);
        assert_eq!(losses, first, "{l:?}: per-step losses");
        assert!(full == resumed, "{l:?}: final state differs");
        // keep = 2: the two newest of steps 1, 3, 5.
        let kept: Vec<_> = std::fs::read_dir(&b)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| !n.to_string_lossy().starts_with('.'))
            .collect();
        assert_eq!(kept.len(), 2, "{kept:?}");
        let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    }
}

#[test]
fn failed_save_keeps_previous_checkpoint_and_names_the_rank() {
    let l = layout(2, 2, Mode::Fsdp, true);
    let dir = tmp("fault");
    let errors = spawn_layout(l, |w| {
        let mut r = build(w, l, 1)?;
        let config = CheckpointConfig::default();
        let mut ckpt = CheckpointManager::new(&dir, w, config)?;
        r.with_items(None, |items| Ok(ckpt.save(1, items)?))?;
        r.step(0)?;
        // One manager owns the directory at a time.
        drop(ckpt);
        // A failing writer on rank 2 while saving the next step.
        let mut bad = CheckpointManager::new(
            &dir,
            w,
            CheckpointConfig {
                save_options: SaveOptions { inject_write_failure: Some(2), ..Default::default() },
                ..Default::default()
            },
        )?;
        let err = r
            .with_items(None, |items| Ok(bad.save(2, items)))
            .map(|r| r.expect_err("must fail"))?;
        // The previous checkpoint of step 1 still loads, and is still the newest.
        let mut fresh = build(w, l, 3)?;
        assert_eq!(fresh.with_items(None, |items| Ok(bad.load_latest(items)?))?, Some(1));
        Ok(err.to_string())
    });
    for e in errors {
        assert!(e.contains("rank(s) [2]") && e.contains("injected"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn corrupt_chunk_and_bad_keys_are_typed_errors() {
    let l = layout(1, 2, Mode::Fsdp, false);
    let dir = tmp("corrupt");
    spawn_layout(l, |w| {
        let mut r = build(w, l, 1)?;
        let sd = r.state()?;
        save(&sd, &dir, w, &SaveOptions::default())?;
        // A key the checkpoint lacks: strict is an error, non-strict keeps the value.
        let mut extra = sd.clone();
        extra.insert("model.extra".into(), StateValue::Int(1));
        match load(&mut extra, &dir, w, &LoadOptions::default()) {
            Err(CheckpointError::State(StateDictError::Missing { keys })) => {
                assert_eq!(keys, ["model.extra"])
            }
            other => panic!("missing key: {other:?}"),
        }
        load(&mut extra, &dir, w, &LoadOptions { strict: false })?;
        assert!(matches!(extra["model.extra"], StateValue::Int(1)));
        // A model state dict with an unexpected key.
        let mut m = tpar::nn::state_dict(&r.model)?;
        m.insert("lm_head.bias".into(), StateValue::Int(0));
        let e = tpar::nn::load_state_dict(&mut r.model, m, true).expect_err("unexpected key");
        assert!(e.to_string().contains("lm_head.bias"), "{e}");
        w.barrier()?;
        Ok(())
    });
    // Flip one byte of the data region of rank 1's file.
    let file = dir.join("shard-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let errors = spawn_layout(l, |w| {
        let mut r = build(w, l, 1)?;
        let mut sd = r.state()?;
        Ok(load(&mut sd, &dir, w, &LoadOptions::default()).expect_err("corrupt").to_string())
    });
    for e in errors {
        assert!(e.contains("shard-00001.safetensors") && e.contains("checksum"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn safetensors_written_by_python_loads_into_a_sharded_llama() {
    // tests/golden/make_checkpoint_import.py writes it with Python's safetensors.
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/llama_import.safetensors");
    let file = import_safetensors(&path).unwrap();
    let l = layout(2, 2, Mode::Fsdp, true);
    let out = spawn_layout(l, |w| {
        let mut r = build(w, l, 9)?;
        tpar::nn::load_state_dict(&mut r.model, file.clone(), true)?;
        let opts = StateDictOptions { full_state_dict: true, ..Default::default() };
        let (m, _) = get_state_dict(&r.model, None, w, &opts)?;
        // And back out as one file.
        let out =
            std::env::temp_dir().join(format!("tpar-export-{}.safetensors", std::process::id()));
        tpar::checkpoint::export_safetensors(&tpar::nn::state_dict(&r.model)?, &out, w)?;
        Ok((m, out))
    });
    let (m, exported) = &out[0];
    let again = import_safetensors(exported).unwrap();
    for (k, v) in &file {
        let (StateValue::Tensor(want), StateValue::Tensor(got), StateValue::Tensor(back)) =
            (v, &m[k], &again[k])
        else {
            panic!("{k}")
        };
        assert_eq!(want.to_vec_f64().unwrap(), got.to_vec_f64().unwrap(), "{k}");
        assert_eq!(want.to_vec_f64().unwrap(), back.to_vec_f64().unwrap(), "{k}");
    }
    let _ = std::fs::remove_file(exported);
}

#[test]
fn set_state_dict_broadcasts_rank0s_full_state() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/llama_import.safetensors");
    let l = layout(2, 2, Mode::Zero1, false);
    let out = spawn_layout(l, |w| {
        let mut r = build(w, l, 5)?;
        r.step(0)?;
        // The optimizer's whole state, on rank 0 only.
        let rank0_full =
            StateDictOptions { full_state_dict: true, cpu_offload: true, ..Default::default() };
        let (_, optim_full) = get_state_dict(&r.model, Some(r.opt.stateful()), w, &rank0_full)?;
        assert_eq!(optim_full.is_empty(), w.rank() != 0);
        let before = r.full(w)?;
        // Only rank 0 reads the file; every rank ends up with its own chunks of it, and
        // the optimizer state goes back in through the same broadcast.
        let model_sd = if w.rank() == 0 { import_safetensors(&path)? } else { StateDict::new() };
        let opts = StateDictOptions { broadcast_from_rank0: true, ..Default::default() };
        let Run { model, opt, .. } = &mut r;
        tpar::checkpoint::set_state_dict(
            model,
            Some(opt.stateful()),
            model_sd,
            optim_full,
            w,
            &opts,
        )?;
        Ok((before, r.full(w)?))
    });
    let file = import_safetensors(&path).unwrap();
    let (before, after) = &out[0];
    for (k, bits) in after {
        if let Some(name) = k.strip_prefix("model.") {
            let StateValue::Tensor(t) = &file[name] else { panic!("{name}") };
            let want: Vec<u64> = t.to_vec_f64().unwrap().iter().map(|x| x.to_bits()).collect();
            assert!(*bits == want, "{k}: not the file's values");
        } else {
            let (_, b) = before.iter().find(|(kb, _)| kb == k).expect("same keys");
            assert!(bits == b, "{k}: optimizer state changed by the round trip");
        }
    }
}

#[test]
fn module_state_dict_strictness_and_truncated_files() {
    let l = layout(1, 1, Mode::Fsdp, true);
    let dir = tmp("truncated");
    spawn_layout(l, |w| {
        let mut r = build(w, l, 1)?;
        let mut sd = tpar::nn::state_dict(&r.model)?;
        let removed = sd.remove("lm_head.weight").is_some();
        assert!(removed);
        sd.insert("extra".into(), StateValue::Int(0));
        match tpar::nn::load_state_dict(&mut r.model, sd.clone(), true) {
            Err(NnError::State(StateDictError::Missing { keys })) => {
                assert_eq!(keys, ["lm_head.weight"])
            }
            other => panic!("strict: {other:?}"),
        }
        // Not strict: the present keys load, the rest are ignored.
        tpar::nn::load_state_dict(&mut r.model, sd, false)?;
        // A value of the wrong shape names its key.
        let mut bad = tpar::nn::state_dict(&r.model)?;
        bad.insert(
            "base_model.norm.weight".into(),
            StateValue::Tensor(Tensor::zeros([3], DType::F32, Device::Cpu)?),
        );
        let e = tpar::nn::load_state_dict(&mut r.model, bad, true).expect_err("shape");
        assert!(e.to_string().contains("base_model.norm.weight"), "{e}");
        save(&r.state()?, &dir, w, &SaveOptions::default())?;
        Ok(())
    });
    let file = dir.join("shard-00000.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len - 100).unwrap();
    let errors = spawn_layout(l, |w| {
        let mut r = build(w, l, 1)?;
        let mut sd = r.state()?;
        Ok(load(&mut sd, &dir, w, &LoadOptions::default()).expect_err("truncated").to_string())
    });
    assert!(
        errors[0].contains("shard-00000.safetensors") && errors[0].contains("key"),
        "{}",
        errors[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
