//! Checkpoints a run owns and validates: one test per way a checkpoint directory was
//! found to lose or silently mix a run. Each asserts that the error names what went wrong
//! (the file, the key, both values) and that nothing the user had on disk was deleted or
//! replaced.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tpar::checkpoint::format::{Metadata, Scalar, METADATA};
use tpar::checkpoint::{CheckpointConfig, CheckpointManager};
use tpar::prelude::*;

mod common;
use common::examples::{example, run_example};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-bad-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A small state: a tensor and counters.
struct Item {
    w: Vec<f32>,
    step: i64,
}

impl Stateful for Item {
    fn state_dict(&self) -> Result<StateDict, StateDictError> {
        Ok(StateDict::from([
            (
                "w".to_string(),
                StateValue::Tensor(Tensor::from_vec(self.w.clone(), [self.w.len()])?),
            ),
            ("step".to_string(), StateValue::Int(self.step)),
        ]))
    }
    fn load_state_dict(&mut self, mut s: StateDict) -> Result<(), StateDictError> {
        let Some(StateValue::Tensor(t)) = s.remove("w") else {
            return Err(StateDictError::Missing { keys: vec!["w".into()] });
        };
        self.w = t.to_vec::<f32>()?;
        self.step = tpar::tensor::state::take_int(&mut s, "step")?;
        tpar::tensor::state::expect_empty(s)
    }
}

/// Saves `item` as the checkpoint of `step` in `dir` over 2 ranks.
fn save_item(dir: &Path, step: u64, w: Vec<f32>) {
    let dir = dir.to_path_buf();
    spawn(2, move |ctx| -> tpar::Result<()> {
        let mut c = CheckpointManager::new(&dir, &ctx.world_group(), CheckpointConfig::default())?;
        let mut item = Item { w: w.clone(), step: step as i64 };
        c.save(step, &mut [("item", &mut item)])?;
        Ok(())
    })
    .unwrap();
}

/// Loads the newest checkpoint in `dir` over 2 ranks: rank 0's outcome.
fn load_latest(dir: &Path) -> tpar::Result<Option<(u64, Vec<f32>)>> {
    let dir = dir.to_path_buf();
    spawn(2, move |ctx| -> tpar::Result<Option<(u64, Vec<f32>)>> {
        let mut c = CheckpointManager::new(&dir, &ctx.world_group(), CheckpointConfig::default())?;
        let mut item = Item { w: vec![0.0; 3], step: -1 };
        let step = c.load_latest(&mut [("item", &mut item)])?;
        Ok(step.map(|s| (s, item.w)))
    })
    .map(|mut v| v.remove(0))
}

fn files_under(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|r| r.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// Case 1: the only checkpoint's metadata deleted is a damaged checkpoint, named with the
/// file and what is wrong, never "no checkpoint"; and a save of that step never replaces
/// the directory (its shards stay on disk).
#[test]
fn a_damaged_checkpoint_is_an_error_and_is_never_replaced() {
    let dir = tmp("damaged");
    save_item(&dir, 5, vec![1.0, 2.0, 3.0]);
    assert_eq!(load_latest(&dir).unwrap(), Some((5, vec![1.0, 2.0, 3.0])));
    let step_dir = dir.join("step-00000005");
    std::fs::remove_file(step_dir.join(METADATA)).unwrap();
    let shards = files_under(&step_dir);
    assert!(!shards.is_empty());
    let m = load_latest(&dir).expect_err("a damaged checkpoint loaded").to_string();
    assert!(
        m.contains("damaged checkpoint") && m.contains("metadata.json") && m.contains("missing"),
        "{m}"
    );
    // A run that went on anyway (a fresh start) cannot replace it.
    let d = dir.clone();
    let m = spawn(2, move |ctx| -> tpar::Result<()> {
        let mut c = CheckpointManager::new(&d, &ctx.world_group(), CheckpointConfig::default())?;
        let mut item = Item { w: vec![9.0; 3], step: 5 };
        Ok(c.save(5, &mut [("item", &mut item)])?)
    })
    .expect_err("replaced a committed checkpoint")
    .to_string();
    assert!(m.contains("refusing to replace") && m.contains("step-00000005"), "{m}");
    assert_eq!(files_under(&step_dir), shards, "the damaged checkpoint's files changed");
    // Its metadata unreadable: damaged too, naming the file.
    std::fs::write(step_dir.join(METADATA), b"{ not json").unwrap();
    let m = load_latest(&dir).unwrap_err().to_string();
    assert!(
        m.contains("damaged checkpoint")
            && m.contains("metadata.json")
            && m.contains("not a readable"),
        "{m}"
    );
    // A plain directory without any checkpoint is "none", as before.
    let empty = tmp("damaged-none");
    assert_eq!(load_latest(&empty).unwrap(), None);
    let _ = (std::fs::remove_dir_all(&dir), std::fs::remove_dir_all(&empty));
}

/// Rewrites `dir`'s metadata through `f`, keeping (`resum`) or breaking its checksum.
fn edit_metadata(dir: &Path, resum: bool, f: impl FnOnce(&mut Metadata)) {
    let path = dir.join(METADATA);
    let mut meta: Metadata = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let saved = meta.checksum;
    f(&mut meta);
    let bytes = if resum {
        meta.to_json().unwrap()
    } else {
        meta.checksum = saved;
        serde_json::to_vec_pretty(&meta).unwrap()
    };
    std::fs::write(&path, bytes).unwrap();
}

/// Case 2: every scalar a resume reads is covered by the metadata's checksum: one changed
/// step, learning rate or byte of text is refused naming the file; a step that does not
/// match the directory's name is refused too, and a negative step is an error.
#[test]
fn metadata_scalars_are_checksummed_and_cross_checked() {
    let dir = tmp("scalars");
    save_item(&dir, 3, vec![1.0, 2.0, 3.0]);
    let step_dir = dir.join("step-00000003");
    let original = std::fs::read(step_dir.join(METADATA)).unwrap();
    // One bit of the step (3 -> 7), without the checksum's knowledge.
    edit_metadata(&step_dir, false, |m| {
        m.values.insert("item.step".into(), Scalar::Int(7));
    });
    let m = load_latest(&dir).unwrap_err().to_string();
    assert!(
        m.contains("damaged checkpoint") && m.contains("metadata.json") && m.contains("checksum"),
        "{m}"
    );
    // The same by editing the file's text: one digit of the file.
    let text = String::from_utf8(original.clone()).unwrap().replace("\"int\": 3", "\"int\": 2");
    assert_ne!(text.as_bytes(), original.as_slice());
    std::fs::write(step_dir.join(METADATA), text).unwrap();
    let m = load_latest(&dir).unwrap_err().to_string();
    assert!(m.contains("checksum") && m.contains("changed after it was written"), "{m}");
    // A consistent file whose recorded step is not its directory's.
    std::fs::write(step_dir.join(METADATA), &original).unwrap();
    edit_metadata(&step_dir, true, |m| m.step = Some(4));
    let m = load_latest(&dir).unwrap_err().to_string();
    assert!(m.contains("records step 4") && m.contains("named for step 3"), "{m}");
    // Back as written: loads.
    std::fs::write(step_dir.join(METADATA), &original).unwrap();
    assert_eq!(load_latest(&dir).unwrap(), Some((3, vec![1.0, 2.0, 3.0])));
    let _ = std::fs::remove_dir_all(&dir);

    // A negative trainer step (with a valid checksum) is refused by the example's trainer
    // state, not clamped to 0.
    let dir = tmp("scalars-example");
    let d = dir.to_str().unwrap();
    let args = ["--steps", "4", "--layers", "1", "--seq", "16", "--batch", "2", "--log-every", "1"];
    let Some((code, out, err)) = run_example(
        "llama_2d",
        &[&args[..], &["--checkpoint-dir", d, "--save-every", "2", "--stop-after", "2"]].concat(),
    ) else {
        return;
    };
    assert_eq!(code, 0, "{out}\n{err}");
    let step_dir = dir.join("step-00000002");
    edit_metadata(&step_dir, true, |m| {
        m.values.insert("trainer.step".into(), Scalar::Int(-1));
    });
    let (code, out, err) = run_example(
        "llama_2d",
        &[&args[..], &["--checkpoint-dir", d, "--save-every", "2"]].concat(),
    )
    .unwrap();
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("step") && err.contains("-1 is negative"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Case 3: a checkpoint directory belongs to one run at a time: a second manager (here in
/// the same process, or a second training process) is refused naming the owner's host
/// and pid, and the first run's checkpoints stay its own; a crashed owner's lock is taken
/// over.
#[test]
fn a_checkpoint_directory_is_owned_by_one_run() {
    let dir = tmp("owned");
    save_item(&dir, 1, vec![1.0, 1.0, 1.0]);
    let pid = std::process::id().to_string();
    let d = dir.clone();
    let m = spawn(2, move |ctx| -> tpar::Result<String> {
        let g = ctx.world_group();
        let _first = CheckpointManager::new(&d, &g, CheckpointConfig::default())?;
        let second = CheckpointManager::new(&d, &g, CheckpointConfig::default());
        Ok(second.expect_err("two owners").to_string())
    })
    .unwrap();
    assert!(
        m[0].contains("in use by another run")
            && m[0].contains(&format!("pid {pid}"))
            && m[0].contains(".lock"),
        "{}",
        m[0]
    );
    assert!(m[1].contains("rank(s) [0]") && m[1].contains("in use by another run"), "{}", m[1]);
    // Released with its manager.
    assert_eq!(load_latest(&dir).unwrap(), Some((1, vec![1.0; 3])));

    // A training process holds it: a second process is refused, and once the first is
    // killed (-9: no clean-up) the lock is taken over.
    let Some(exe) = example("llama_2d") else { return };
    let d = dir.to_str().unwrap().to_string();
    let _ = std::fs::remove_dir_all(&dir);
    let args = [
        "--steps",
        "100000",
        "--layers",
        "1",
        "--seq",
        "16",
        "--batch",
        "2",
        "--checkpoint-dir",
        &d,
    ];
    let mut first = Command::new(&exe)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lock = dir.join(".lock");
    let t0 = Instant::now();
    let want = format!("\"pid\":{}", first.id());
    while !std::fs::read_to_string(&lock).is_ok_and(|t| t.contains(&want)) {
        assert!(t0.elapsed() < Duration::from_secs(60), "the first run never took the lock");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, out, err) = run_example(
        "llama_2d",
        &["--steps", "2", "--layers", "1", "--seq", "16", "--batch", "2", "--checkpoint-dir", &d],
    )
    .unwrap();
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("in use by another run") && err.contains(&format!("pid {}", first.id())),
        "{err}"
    );
    first.kill().unwrap();
    first.wait().unwrap();
    let (code, out, err) = run_example(
        "llama_2d",
        &["--steps", "2", "--layers", "1", "--seq", "16", "--batch", "2", "--checkpoint-dir", &d],
    )
    .unwrap();
    assert_eq!(code, 0, "after the owner died: {out}\n{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Case 4: a resume with another learning rate (or any other setting of the run that may
/// not change) is refused listing both values, and `--override-lr` resumes with the new
/// one on purpose, on the new schedule from the saved step.
#[test]
fn a_resume_with_another_configuration_is_refused_with_the_differences() {
    let dir = tmp("config");
    let d = dir.to_str().unwrap();
    let base = [
        "--layers",
        "1",
        "--seq",
        "16",
        "--log-every",
        "1",
        "--checkpoint-dir",
        d,
        "--save-every",
        "3",
    ];
    let Some((code, out, err)) = run_example(
        "llama_2d",
        &[&base[..], &["--steps", "6", "--batch", "2", "--stop-after", "3"]].concat(),
    ) else {
        return;
    };
    assert_eq!(code, 0, "{out}\n{err}");
    let before = files_under(&dir.join("step-00000003"));
    let (code, out, err) = run_example(
        "llama_2d",
        &[&base[..], &["--steps", "6", "--batch", "2", "--lr", "2e-3", "--seed", "7"]].concat(),
    )
    .unwrap();
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("optim.lr: saved 0.001, this run 0.002"), "{err}");
    assert!(err.contains("data.seed: saved 42, this run 7"), "{err}");
    assert!(err.contains("--override-lr"), "{err}");
    let (code, out, err) =
        run_example("llama_2d", &[&base[..], &["--steps", "8", "--batch", "2"]].concat()).unwrap();
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("schedule.steps: saved 6, this run 8"), "{err}");
    // A mesh may change (the checkpoint reshards): dp 4 x tp 1 with 1 sequence per rank
    // resumes dp 2 x tp 2's run with 2 per rank (the same global batch, the same data).
    // And --override-lr takes the new learning rate on purpose.
    let (code, out, err) = run_example(
        "llama_2d",
        &[
            &base[..],
            &[
                "--steps",
                "6",
                "--batch",
                "1",
                "--lr",
                "2e-3",
                "--override-lr",
                "--dp",
                "4",
                "--tp",
                "1",
            ],
            &["--stop-after", "4"],
        ]
        .concat(),
    )
    .unwrap();
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("resumed from") && out.contains("at step 3"), "{out}");
    // Step 4's learning rate is the new schedule's: warmup 1, cosine over 5 steps from
    // 2e-3 to 2e-4, at cosine step 3.
    let want = 2e-4 + (2e-3 - 2e-4) * (1.0 + (std::f64::consts::PI * 3.0 / 5.0).cos()) / 2.0;
    let line = out.lines().find(|l| l.contains("step    4/")).unwrap_or_else(|| panic!("{out}"));
    let lr: f64 = line
        .split("lr ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    assert!((lr - want).abs() <= 0.01 * want, "{line}: want lr {want:.2e}");
    assert_eq!(files_under(&dir.join("step-00000003")), before);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Case 5: strict loading refuses a checkpoint with keys the model does not have: a
/// 2-layer checkpoint into a 1-layer model names layer 1's keys (and a 3-layer model
/// names the keys the checkpoint lacks, as before).
#[test]
fn a_checkpoint_with_keys_the_model_lacks_is_refused() {
    let dir = tmp("keys");
    let d = dir.to_str().unwrap();
    let base =
        ["--steps", "4", "--seq", "16", "--batch", "2", "--checkpoint-dir", d, "--save-every", "2"];
    let Some((code, out, err)) =
        run_example("llama_2d", &[&base[..], &["--layers", "2", "--stop-after", "2"]].concat())
    else {
        return;
    };
    assert_eq!(code, 0, "{out}\n{err}");
    for (layers, what) in [("1", "unexpected keys"), ("3", "missing keys")] {
        let (code, out, err) =
            run_example("llama_2d", &[&base[..], &["--layers", layers]].concat()).unwrap();
        assert_ne!(code, 0, "--layers {layers}: {out}");
        let key =
            if layers == "1" { "model.base_model.layers.1." } else { "model.base_model.layers.2." };
        assert!(err.contains(what) && err.contains(key), "--layers {layers}: {err}");
    }

    // The same through the library: the keys no rank's target has, from every rank.
    let dir2 = tmp("keys-lib");
    save_item(&dir2, 1, vec![1.0, 2.0, 3.0]);
    let d = dir2.clone();
    let errs = spawn(2, move |ctx| -> tpar::Result<Vec<String>> {
        let g = ctx.world_group();
        let mut c = CheckpointManager::new(&d, &g, CheckpointConfig::default())?;
        // A target without "item.w" on either rank.
        struct StepOnly(i64);
        impl Stateful for StepOnly {
            fn state_dict(&self) -> Result<StateDict, StateDictError> {
                Ok(StateDict::from([("step".to_string(), StateValue::Int(self.0))]))
            }
            fn load_state_dict(&mut self, mut s: StateDict) -> Result<(), StateDictError> {
                self.0 = tpar::tensor::state::take_int(&mut s, "step")?;
                Ok(())
            }
        }
        let e = c.load(1, &mut [("item", &mut StepOnly(0))]).unwrap_err().to_string();
        // Loading part of a checkpoint on purpose: another item's keys are out of scope.
        let mut other = StepOnly(0);
        let partial = c.load(1, &mut [("other", &mut other)]).unwrap_err().to_string();
        Ok(vec![e, partial])
    })
    .unwrap();
    assert!(
        errs[0][0].contains("unexpected keys") && errs[0][0].contains("item.w"),
        "{:?}",
        errs[0]
    );
    assert!(
        errs[0][1].contains("missing keys") && errs[0][1].contains("other.step"),
        "{:?}",
        errs[0]
    );
    let _ = (std::fs::remove_dir_all(&dir), std::fs::remove_dir_all(&dir2));
}

/// Case 6: what an interrupted deletion (or save) left behind is cleared by the next run
/// on the directory, and never taken for a checkpoint.
#[test]
fn interrupted_pruning_leaves_nothing_behind() {
    let dir = tmp("prune");
    save_item(&dir, 2, vec![2.0; 3]);
    for junk in [".step-00000001.deleting", ".step-00000003.tmp"] {
        std::fs::create_dir_all(dir.join(junk).join("inner")).unwrap();
        std::fs::write(dir.join(junk).join("inner").join("shard-00000.safetensors"), b"x").unwrap();
    }
    let d = dir.clone();
    spawn(2, move |ctx| -> tpar::Result<()> {
        let g = ctx.world_group();
        let config = CheckpointConfig { keep: Some(1), ..Default::default() };
        let mut c = CheckpointManager::new(&d, &g, config)?;
        assert_eq!(c.steps()?, vec![2]);
        let mut item = Item { w: vec![4.0; 3], step: 4 };
        c.save(4, &mut [("item", &mut item)])?;
        Ok(())
    })
    .unwrap();
    // The manager's background deletions finish with it.
    assert_eq!(files_under(&dir), vec![".lock".to_string(), "step-00000004".to_string()]);
    assert_eq!(load_latest(&dir).unwrap(), Some((4, vec![4.0; 3])));
    let _ = std::fs::remove_dir_all(&dir);
}
