//! Hugging Face Llama checkpoints: tiny Llamas saved by `transformers`
//! (`tests/golden/hf_tiny`, sharded through its index, and `hf_tiny_tied`, one file with
//! tied embeddings; written by `scripts/make_hf_golden.py` with their logits) load into
//! tpar's Llama, plain and under 2x2 FSDP x TP, and give transformers' logits; an export
//! reads back bit for bit; bad directories are typed errors naming key and file.
//!
//! The trainers start from such a directory (`--init-from`, with its tokenizer.json) and
//! write one back (`--export-hf`).
//!
//! With `TPAR_HF_EXPORT_DIR` set, the export test also leaves its export of `hf_tiny`
//! there with the golden logits, for `python scripts/make_hf_golden.py --check-export`.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::examples::run_example;

use tpar::checkpoint::hf::{write_sharded_safetensors, SafetensorsDir, INDEX_FILE, SINGLE_FILE};
use tpar::checkpoint::import_safetensors;
use tpar::models::hf::{export_hf, HfCheckpoint, HfConfig, HfError};
use tpar::models::RopeScaling;
use tpar::prelude::*;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The golden batch and transformers' logits on it.
fn golden_logits(dir: &Path) -> (Tensor, Vec<f32>) {
    let f = import_safetensors(&dir.join("logits.safetensors")).unwrap();
    let (StateValue::Tensor(ids), StateValue::Tensor(logits)) = (&f["input_ids"], &f["logits"])
    else {
        panic!("logits.safetensors")
    };
    (ids.clone(), logits.to_vec::<f32>().unwrap())
}

fn assert_logits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err <= 1e-5, "{what}: max |tpar - transformers| = {err:e}");
    println!("{what}: max |tpar - transformers| = {err:e}");
}

/// `model`'s logits on `ids`, whole (gathered when vocab-sharded).
fn logits(model: &LlamaForPretraining, ids: &Tensor) -> tpar::Result<Vec<f32>> {
    let t = match model.logits(ids, None)? {
        Value::DTensor(d) => d.full_tensor()?,
        Value::Tensor(t) => t,
        other => panic!("logits: {other:?}"),
    };
    Ok(t.to_vec::<f32>()?)
}

/// A Llama of `cfg` on the host: plain with `mesh` `None`, else tensor-parallel
/// (sequence-parallel plan) on `tp` and FSDP on `dp`, materialized with seed 3.
fn build(cfg: &LlamaConfig, mesh: Option<&DeviceMesh>) -> tpar::Result<LlamaForPretraining> {
    let mut model = LlamaForPretraining::new(cfg, Device::Meta)?;
    if let Some(mesh) = mesh {
        parallelize_llama(&mut model, &mesh["tp"], &sequence_parallel_layer_plan())?;
        let fsdp = FsdpConfig::default();
        for layer in &mut model.base_model.layers.items {
            fully_shard(layer, &mesh["dp"], &fsdp)?;
        }
        fully_shard(&mut model, &mesh["dp"], &fsdp)?;
    }
    reset_parameters(&mut model, Device::Cpu, 3)?;
    Ok(model)
}

fn spawn4<R: Send>(f: impl Fn(&ProcessGroup) -> tpar::Result<R> + Sync) -> Vec<R> {
    spawn_scoped(SpawnConfig::new(4).timeout(Duration::from_secs(120)), |ctx| f(&ctx.world_group()))
        .unwrap_or_else(|e| panic!("2x2: {e}"))
}

fn mesh_2x2(world: &ProcessGroup) -> tpar::Result<DeviceMesh> {
    Ok(DeviceMesh::new(world, DeviceType::Cpu, &[2, 2], &["dp", "tp"])?)
}

/// Every tensor of a checkpoint directory as bit patterns, by name.
fn tensor_bits(dir: &Path) -> Vec<(String, Vec<usize>, Vec<u64>)> {
    let w = SafetensorsDir::open(dir).unwrap();
    w.tensors()
        .map(|(name, e)| {
            let t = w.read_box(name, &vec![0; e.shape.len()], &e.shape).unwrap();
            let bits = t.to_vec_f64().unwrap().into_iter().map(f64::to_bits).collect();
            (name.to_string(), e.shape.clone(), bits)
        })
        .collect()
}

#[test]
fn single_rank_logits_equal_transformers() {
    for name in ["hf_tiny", "hf_tiny_tied"] {
        let dir = golden(name);
        let ckpt = HfCheckpoint::open(&dir).unwrap();
        assert_eq!(ckpt.config.tie_word_embeddings, name.ends_with("tied"), "{name}");
        let mut model = build(&ckpt.config.llama, None).unwrap();
        let (ids, want) = golden_logits(&dir);
        let before = logits(&model, &ids).unwrap();
        ckpt.load_into(&mut model).unwrap();
        assert_logits(&logits(&model, &ids).unwrap(), &want, name);
        // The comparison can fail: the randomly initialized model is far off.
        let err = before.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err > 1e-2, "{name}: an unloaded model matches ({err})");
    }
}

/// Llama 3's RoPE scaling (`rope_parameters` of `rope_type` llama3): the config reads
/// it, the logits equal transformers' (on 24 positions, past the original context of
/// 16), the same weights without the scaling are far off, and the config writes it
/// back as read; at 2x2 FSDP x TP the logits are the same.
#[test]
fn llama3_rope_scaling_logits_equal_transformers() {
    let dir = golden("hf_tiny_llama3");
    let ckpt = HfCheckpoint::open(&dir).unwrap();
    let scaling = ckpt.config.llama.rope_scaling.expect("llama3 scaling is read");
    assert_eq!(
        scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        }
    );
    let (ids, want) = golden_logits(&dir);
    let mut model = build(&ckpt.config.llama, None).unwrap();
    ckpt.load_into(&mut model).unwrap();
    assert_logits(&logits(&model, &ids).unwrap(), &want, "hf_tiny_llama3");
    // The scaling matters: plain RoPE on the same weights is off.
    let plain = LlamaConfig { rope_scaling: None, ..ckpt.config.llama };
    let mut unscaled = build(&plain, None).unwrap();
    ckpt.load_into(&mut unscaled).unwrap();
    let got = logits(&unscaled, &ids).unwrap();
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err > 1e-3, "plain RoPE matches llama3-scaled logits ({err})");
    // Written back and read again, the config is the same.
    let back = HfConfig::from_json(&ckpt.config.to_json(), "written").unwrap();
    assert_eq!(back.llama, ckpt.config.llama);
    // 2x2 FSDP x TP.
    let got = spawn4(|world| {
        let mesh = mesh_2x2(world)?;
        let mut model = build(&ckpt.config.llama, Some(&mesh))?;
        ckpt.load_into(&mut model)?;
        logits(&model, &ids)
    });
    for (r, g) in got.iter().enumerate() {
        assert_logits(g, &want, &format!("hf_tiny_llama3 2x2 rank {r}"));
    }
}

#[test]
fn fsdp_tp_2x2_logits_equal_transformers_reading_own_chunks() {
    let dir = golden("hf_tiny");
    let (ids, want) = golden_logits(&dir);
    let out = spawn4(|w| {
        let mesh = mesh_2x2(w)?;
        let ckpt = HfCheckpoint::open(&dir)?;
        let mut model = build(&ckpt.config.llama, Some(&mesh))?;
        // This rank's reads: a chunk of each sharded weight, never the whole tensor.
        let state = ckpt.state_dict_for(&model)?;
        let q = "base_model.layers.0.self_attn.q_proj.weight";
        let StateValue::Sharded(s) = &state[q] else { panic!("{q} is not sharded") };
        let read: usize = s.chunks().iter().map(|c| c.tensor.numel()).sum();
        assert!(read * 4 <= s.shape().iter().product::<usize>(), "{q}: read {read}");
        ckpt.load_into(&mut model)?;
        logits(&model, &ids)
    });
    for (rank, got) in out.iter().enumerate() {
        assert_logits(got, &want, &format!("2x2 rank {rank}"));
    }
}

#[test]
fn export_then_import_is_bit_identical() {
    let src = golden("hf_tiny");
    let (ids, want) = golden_logits(&src);
    let out = tmp("export");
    // A 2x2 FSDP x TP model writes shards of at most 30 kB (the checkpoint is ~99 kB).
    spawn4(|w| {
        let mesh = mesh_2x2(w)?;
        let ckpt = HfCheckpoint::open(&src)?;
        let mut model = build(&ckpt.config.llama, Some(&mesh))?;
        ckpt.load_into(&mut model)?;
        export_hf(&tpar::nn::state_dict(&model)?, &ckpt.config, &out, w, 30_000)?;
        Ok(())
    });
    assert!(out.join(INDEX_FILE).is_file());
    let shards = std::fs::read_dir(&out)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("model-"))
        .count();
    assert!(shards >= 4, "{shards} shards");
    for e in std::fs::read_dir(&out).unwrap() {
        let p = e.unwrap().path();
        assert!(std::fs::metadata(&p).unwrap().len() <= 30_000 + 4096, "{}", p.display());
    }
    // Every tensor bit for bit, the config's sizes, and the logits of a plain model
    // loaded from the export.
    assert_eq!(tensor_bits(&out), tensor_bits(&src));
    let back = HfCheckpoint::open(&out).unwrap();
    let orig = HfConfig::from_file(&src.join("config.json")).unwrap();
    assert_eq!(back.config.llama, orig.llama);
    assert!(!back.config.tie_word_embeddings);
    let mut model = build(&back.config.llama, None).unwrap();
    back.load_into(&mut model).unwrap();
    let got = logits(&model, &ids).unwrap();
    assert_logits(&got, &want, "exported");
    if let Some(keep) = std::env::var_os("TPAR_HF_EXPORT_DIR") {
        let keep = PathBuf::from(keep);
        std::fs::create_dir_all(&keep).unwrap();
        for e in std::fs::read_dir(&out).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, keep.join(p.file_name().unwrap())).unwrap();
        }
        std::fs::copy(src.join("logits.safetensors"), keep.join("logits.safetensors")).unwrap();
    }
    let _ = std::fs::remove_dir_all(&out);

    // Tied embeddings stay tied: one file, no lm_head.weight, tie_word_embeddings true.
    let src = golden("hf_tiny_tied");
    let out = tmp("export-tied");
    let ckpt = HfCheckpoint::open(&src).unwrap();
    let mut model = build(&ckpt.config.llama, None).unwrap();
    ckpt.load_into(&mut model).unwrap();
    spawn_scoped(SpawnConfig::new(1).timeout(Duration::from_secs(60)), |ctx| {
        export_hf(&tpar::nn::state_dict(&model)?, &ckpt.config, &out, &ctx.world_group(), 1 << 30)
    })
    .unwrap();
    assert!(out.join(SINGLE_FILE).is_file() && !out.join(INDEX_FILE).exists());
    assert_eq!(tensor_bits(&out), tensor_bits(&src));
    assert!(HfCheckpoint::open(&out).unwrap().config.tie_word_embeddings);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_failed_export_names_its_cause_on_every_rank() {
    // The export directory lies under a regular file: rank 0's write fails, and every
    // rank's error (whichever a caller reports) names the file and the cause.
    let base = tmp("export-under-a-file");
    std::fs::create_dir_all(&base).unwrap();
    let blocker = base.join("a-file");
    std::fs::write(&blocker, b"not a folder").unwrap();
    let out = blocker.join("export");
    let src = golden("hf_tiny");
    let errors = spawn4(|w| {
        let mesh = mesh_2x2(w)?;
        let ckpt = HfCheckpoint::open(&src)?;
        let mut model = build(&ckpt.config.llama, Some(&mesh))?;
        ckpt.load_into(&mut model)?;
        let r = export_hf(&tpar::nn::state_dict(&model)?, &ckpt.config, &out, w, 1 << 30);
        Ok(r.expect_err("an export under a regular file"))
    });
    let cause = errors[0].to_string();
    assert!(!matches!(errors[0], HfError::ExportFailed { .. }), "rank 0: {cause}");
    assert!(cause.contains("a-file"), "rank 0's error names the path: {cause}");
    for (rank, e) in errors.iter().enumerate().skip(1) {
        assert!(matches!(e, HfError::ExportFailed { .. }), "rank {rank}: {e}");
        assert!(e.to_string().ends_with(&cause), "rank {rank}: {e} (rank 0: {cause})");
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// A copy of `hf_tiny` in a fresh directory.
fn copy_of_tiny(name: &str) -> PathBuf {
    let d = tmp(name);
    for e in std::fs::read_dir(golden("hf_tiny")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
    }
    d
}

fn edit(path: &Path, from: &str, to: &str) {
    let s = std::fs::read_to_string(path).unwrap();
    assert!(s.contains(from), "{}: {from}", path.display());
    std::fs::write(path, s.replacen(from, to, 1)).unwrap();
}

#[test]
fn bad_directories_are_typed_errors_naming_key_and_file() {
    // Not a Llama.
    let d = copy_of_tiny("arch");
    edit(&d.join("config.json"), "\"LlamaForCausalLM\"", "\"MistralForCausalLM\"");
    match HfCheckpoint::open(&d) {
        Err(HfError::Architecture { file, found }) => {
            assert!(file.ends_with("config.json") && found.contains("MistralForCausalLM"));
        }
        other => panic!("{other:?}"),
    }

    // A RoPE tpar does not have.
    let d = copy_of_tiny("rope");
    edit(&d.join("config.json"), "\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"");
    match HfCheckpoint::open(&d) {
        Err(HfError::Unsupported { key, file, .. }) => {
            assert_eq!(key, "rope_parameters");
            assert!(file.ends_with("config.json"));
        }
        other => panic!("{other:?}"),
    }

    // A tensor missing from the index.
    let d = copy_of_tiny("missing");
    let index = d.join(INDEX_FILE);
    let text = std::fs::read_to_string(&index).unwrap();
    let kept: String = text
        .lines()
        .filter(|l| !l.contains("\"model.layers.1.mlp.up_proj.weight\""))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&index, kept).unwrap();
    match HfCheckpoint::open(&d) {
        Err(HfError::MissingTensor { key, file }) => {
            assert_eq!(key, "model.layers.1.mlp.up_proj.weight");
            assert!(file.ends_with(INDEX_FILE), "{file}");
        }
        other => panic!("{other:?}"),
    }

    // A shape that disagrees with the config (intermediate_size 64 -> 48).
    let d = copy_of_tiny("shape");
    edit(&d.join("config.json"), "\"intermediate_size\": 64", "\"intermediate_size\": 48");
    match HfCheckpoint::open(&d) {
        Err(HfError::Shape { key, file, expected, got }) => {
            assert!(key.contains(".mlp."), "{key}");
            assert!(file.ends_with(".safetensors"), "{file}");
            assert!(expected.contains(&48) && got.contains(&64), "{expected:?} {got:?}");
        }
        other => panic!("{other:?}"),
    }

    // An unexpected tensor (a third layer in a two-layer config), in one model.safetensors.
    let d = tmp("unexpected");
    std::fs::copy(golden("hf_tiny/config.json"), d.join("config.json")).unwrap();
    let w = SafetensorsDir::open(&golden("hf_tiny")).unwrap();
    let mut tensors: Vec<(String, Tensor)> = w
        .tensors()
        .map(|(n, e)| (n.to_string(), w.read_box(n, &vec![0; e.shape.len()], &e.shape).unwrap()))
        .collect();
    let extra =
        tensors.iter().find(|(n, _)| n == "model.layers.1.mlp.up_proj.weight").unwrap().1.clone();
    tensors.push(("model.layers.2.mlp.up_proj.weight".into(), extra));
    write_sharded_safetensors(&tensors, &d, 1 << 30).unwrap();
    match HfCheckpoint::open(&d) {
        Err(HfError::UnexpectedTensor { key, file }) => {
            assert_eq!(key, "model.layers.2.mlp.up_proj.weight");
            assert!(file.ends_with(SINGLE_FILE), "{file}");
        }
        other => panic!("{other:?}"),
    }

    // A model of another config than the checkpoint's.
    let ckpt = HfCheckpoint::open(&golden("hf_tiny")).unwrap();
    let other = LlamaConfig { intermediate_size: 40, ..ckpt.config.llama };
    let mut model = build(&other, None).unwrap();
    match ckpt.load_into(&mut model) {
        Err(HfError::Shape { key, file, .. }) => {
            assert!(key.contains(".mlp."), "{key}");
            assert!(file.ends_with(".safetensors"), "{file}");
        }
        other => panic!("{other:?}"),
    }
    for n in ["arch", "rope", "missing", "shape", "unexpected"] {
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("tpar-hf-{}-{n}", std::process::id())),
        );
    }
}

#[test]
fn trainers_start_from_and_export_a_hugging_face_directory() {
    // One step at a learning rate far below every weight's last bit: the exported
    // weights are the loaded ones, bit for bit, through FSDP x TP and through a pipeline.
    let src = golden("hf_tiny");
    for (name, layout) in [
        ("llama_2d", &["--dp", "2", "--tp", "2"][..]),
        ("llama_pp", &["--pp", "2", "--dp", "1", "--tp", "2"][..]),
    ] {
        let out = tmp(&format!("{name}-export"));
        let args = [
            layout,
            &["--init-from", src.to_str().unwrap(), "--export-hf", out.to_str().unwrap()],
            &["--export-shard-size", "40000", "--steps", "1", "--seq", "16", "--lr", "1e-30"],
        ]
        .concat();
        let Some((code, stdout, stderr)) = run_example(name, &args) else {
            eprintln!("{name} is not built (cargo test builds it with the whole suite); skipped");
            continue;
        };
        assert_eq!(code, 0, "{name}: {stdout}\n{stderr}");
        assert!(stdout.contains("--init-from"), "{name}: {stdout}");
        assert!(out.join(INDEX_FILE).is_file(), "{name}: no index");
        assert_eq!(tensor_bits(&out), tensor_bits(&src), "{name}");
        let back = HfCheckpoint::open(&out).unwrap();
        assert_eq!(back.config.llama, HfConfig::from_file(&src.join("config.json")).unwrap().llama);
        let _ = std::fs::remove_dir_all(&out);
    }
}
