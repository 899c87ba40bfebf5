//! Classes of bad input, one test each: every one is a typed error whose message names
//! what is wrong, never a panic, an abort, a silent disagreement or a hang.

use std::time::{Duration, Instant};

use tpar::collectives::spawn_owned;
use tpar::prelude::*;

mod common;
use common::examples::run_example;
use tpar::tensor::TensorError;

fn small_llama() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32,
        max_position_embeddings: 16,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        ..Default::default()
    }
}

/// Class 1: a zero size, a non-finite learning rate or a flag of 0 is refused up front,
/// naming the field or the flag (exit code 2 for flags), never a panic in a rank.
#[test]
fn zero_sizes_and_bad_flags_are_refused_by_name() {
    assert!(small_llama().validate().is_ok());
    // A model of 0 layers (embedding, norm, head) is legal.
    assert!(LlamaConfig { num_hidden_layers: 0, ..small_llama() }.validate().is_ok());
    type Zero = fn(&mut LlamaConfig);
    let zeroed: [(&str, Zero); 6] = [
        ("vocab_size", |c| c.vocab_size = 0),
        ("hidden_size", |c| c.hidden_size = 0),
        ("intermediate_size", |c| c.intermediate_size = 0),
        ("num_attention_heads", |c| c.num_attention_heads = 0),
        ("num_key_value_heads", |c| c.num_key_value_heads = 0),
        ("max_position_embeddings", |c| c.max_position_embeddings = 0),
    ];
    for (field, zero) in zeroed {
        let mut c = small_llama();
        zero(&mut c);
        let m = c.validate().expect_err(field).to_string();
        assert!(m.contains(field) && m.contains("is 0"), "{field}: {m}");
        let Err(e) = LlamaForPretraining::new(&c, Device::Meta) else { panic!("{field}") };
        let m = e.to_string();
        assert!(m.contains(field), "{field}: {m}");
    }
    let m = LlamaConfig { rms_norm_eps: f64::NAN, ..small_llama() }.validate().unwrap_err();
    assert!(m.to_string().contains("rms_norm_eps"), "{m}");

    let p = Param::new([2], DType::F32, Device::Cpu).unwrap();
    for lr in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, -1e-3] {
        let cfg = AdamWConfig { lr, ..Default::default() };
        let Err(e) = AdamW::new(vec![p.clone()], cfg) else { panic!("lr {lr} accepted") };
        let m = e.to_string();
        assert!(m.contains("learning rate") && m.contains(&lr.to_string()), "{lr}: {m}");
    }

    for (name, args, flag) in [
        ("llama_2d", &["--batch", "0"][..], "--batch"),
        ("llama_2d", &["--seq", "0"][..], "--seq"),
        ("llama_2d", &["--steps", "0"][..], "--steps"),
        ("llama_2d", &["--hidden", "0"][..], "--hidden"),
        ("llama_2d", &["--heads", "3"][..], "--heads"),
        ("llama_2d", &["--lr", "inf"][..], "--lr"),
        ("llama_2d", &["--lr", "NaN"][..], "--lr"),
        ("llama_pp", &["--batch", "0"][..], "--batch"),
        ("llama_pp", &["--microbatches", "0"][..], "--microbatches"),
        ("llama_pp", &["--lr=-1"][..], "--lr"),
    ] {
        let Some((code, _, err)) = run_example(name, args) else {
            eprintln!("{name} not built; skipping its flag checks");
            continue;
        };
        assert_eq!(code, 2, "{name} {args:?}: {err}");
        assert!(err.contains(flag) && !err.contains("panicked"), "{name} {args:?}: {err}");
    }
}

/// Class 2: a tensor whose bytes overflow, or that no allocator can give, is an
/// `OutOfMemory` error naming the op, the shape and the bytes, not an abort; models of
/// impossible sizes are refused the same way (and build nothing on the meta device).
#[test]
fn impossible_sizes_are_typed_errors_not_aborts() {
    let huge = [1usize << 40, 1 << 40];
    let e = Tensor::zeros(huge, DType::F32, Device::Cpu).unwrap_err();
    assert!(matches!(e, TensorError::OutOfMemory { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains("full") && m.contains("[1099511627776, 1099511627776]"), "{m}");
    assert!(m.contains("bytes") && m.contains("f32"), "{m}");
    // 2 TiB: fits in the address space, but no allocator here gives it.
    let e = Tensor::randn([1usize << 39], DType::F32, &mut Rng::new(0)).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, TensorError::OutOfMemory { .. }) && m.contains("randn"), "{m}");
    assert!(m.contains("2.0 TiB") && m.contains("2199023255552 bytes"), "{m}");
    // Op outputs too: a broadcast whose result cannot exist.
    let a = Tensor::zeros([1usize << 20, 1], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros([1, 1usize << 20], DType::F32, Device::Cpu).unwrap();
    let m = a.add(&b).unwrap_err().to_string();
    assert!(m.contains("add") && m.contains("4.0 TiB"), "{m}");
    // Meta tensors hold no data, but their size must still be one a device could hold.
    assert!(Tensor::zeros(huge, DType::F32, Device::Meta).is_err());

    // A model of 2e9 vocabulary and a huge width: built on meta (nothing allocated, RoPE
    // tables included), then materializing it is a typed error naming the bytes.
    let cfg = LlamaConfig {
        vocab_size: 2_000_000_000,
        hidden_size: 100_000,
        max_position_embeddings: 100_000_000,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        ..small_llama()
    };
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).expect("meta model");
    let m = tpar::nn::reset_parameters(&mut model, Device::Cpu, 0).unwrap_err().to_string();
    assert!(m.contains("cannot allocate") && m.contains("bytes"), "{m}");
    // RoPE tables are built lazily and only for the positions asked for.
    let t = model.base_model.rotary_emb.tables(4).unwrap();
    assert_eq!(t.cos.dims(), &[4, 25_000]);
    let m = tpar::models::causal_padding_mask(None, 4, 100_000_000, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(m.contains("causal_padding_mask") && m.contains("[4, 1, 100000000, 100000000]"), "{m}");
    // The trainer reports it and exits 1, without an abort.
    if let Some((code, _, err)) = run_example("llama_2d", &["--seq", "100000000", "--steps", "1"]) {
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("the memory model predicts a peak of"), "{err}");
        assert!(err.contains("but this machine has") || err.contains("allocator"), "{err}");
    }
}

/// A run over `--memory-budget` stops before building anything, exit code 2, with the
/// numbers and what on the same ranks would fit (the memory model's alternatives).
#[test]
fn a_run_over_its_memory_budget_is_refused_with_what_would_fit() {
    // llama_2d's default (dp 2 x tp 2, FSDP) is predicted at 4.3 MiB a rank; selective
    // checkpointing at 4.1.
    if let Some((code, out, err)) = run_example("llama_2d", &["--memory-budget", "0.004"]) {
        assert_eq!(code, 2, "{err}");
        assert!(!out.contains("summary:"), "it trained: {out}");
        for want in ["does not fit in 4.1 MiB", "would fit with ac selective: predicted peak"] {
            assert!(err.contains(want), "{want:?} missing from: {err}");
        }
    }
    // llama_pp's (pp 3, 1F1B, 4 micro-batches): 6.9 MiB; selective checkpointing keeping
    // every matmul and attention (5.9) or 8 micro-batches (5.3) within 0.006 GiB (6.14 MiB).
    if let Some((code, out, err)) = run_example("llama_pp", &["--memory-budget", "0.006"]) {
        assert_eq!(code, 2, "{err}");
        assert!(!out.contains("summary:"), "it trained: {out}");
        for want in ["would fit with ac selective", "or 8 micro-batches"] {
            assert!(err.contains(want), "{want:?} missing from: {err}");
        }
    }
}

/// `--ac auto` picks the policy that fits `--memory-budget` with the least recompute,
/// trains with it, and says which; without a budget, or under one no policy fits on its
/// own, it is refused with exit code 2.
#[test]
fn ac_auto_trains_with_the_policy_that_fits_the_budget() {
    if let Some((code, out, err)) = run_example("llama_2d", &["--ac", "auto", "--steps", "2"]) {
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("--ac auto needs --memory-budget"), "{err}");
        assert!(!out.contains("summary:"), "it trained: {out}");
    }
    // llama_2d's default is predicted at 4.3 MiB a rank, selective checkpointing at 3.9.
    let args = ["--ac", "auto", "--memory-budget", "0.004", "--steps", "2"];
    if let Some((code, out, err)) = run_example("llama_2d", &args) {
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("memory: --ac auto picks ac selective: predicted peak 3.9"), "{out}");
        assert!(out.contains(" ac=selective "), "{out}");
    }
    // llama_pp's: 6.9 MiB without checkpointing; keeping every matmul and attention on
    // every second layer (the norms and elementwise ops recomputed), 6.5.
    let args = ["--ac", "auto", "--memory-budget", "0.0065", "--steps", "2"];
    if let Some((code, out, err)) = run_example("llama_pp", &args) {
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(" ac=selective[matmul,sdpa]:2 "), "{out}");
    }
    // Under every policy's peak: refused, naming what would fit or come closest.
    let args = ["--ac", "auto", "--memory-budget", "0.0035", "--steps", "2"];
    if let Some((code, out, err)) = run_example("llama_2d", &args) {
        assert_eq!(code, 2, "{err}");
        assert!(!out.contains("summary:"), "it trained: {out}");
        for want in ["no checkpointing policy fits --memory-budget", "the lowest being"] {
            assert!(err.contains(want), "{want:?} missing from: {err}");
        }
    }
}

/// One rank's local shard for the from_local tests: `odd` holds `odd_shape`/`odd_dtype`.
fn shard(rank: usize, odd: usize, shape: &[usize], odd_shape: &[usize], dtype: DType) -> Tensor {
    let (s, d) = if rank == odd { (odd_shape, dtype) } else { (shape, DType::F32) };
    Tensor::zeros(s.to_vec(), d, Device::Cpu).unwrap()
}

/// Runs `from_local(_checked)` on `world` ranks of a 1-d mesh; returns each rank's
/// error message (`None` when it succeeded).
fn from_local_errors(
    world: usize,
    checked: bool,
    placements: &'static [Placement],
    f: impl Fn(usize) -> Tensor + Sync + Send + 'static,
) -> Vec<Option<String>> {
    spawn_owned(SpawnConfig::new(world), move |ctx| -> tpar::Result<Option<String>> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[world], &["x"])?;
        let local = f(ctx.rank());
        let r = if checked {
            DTensor::from_local_checked(&local, &mesh, placements)
        } else {
            DTensor::from_local(&local, &mesh, placements, None)
        };
        Ok(r.err().map(|e| e.to_string()))
    })
    .expect("spawn")
}

/// Class 3: shards that do not fit one layout are named: the rank that differs from the
/// majority (first, middle or last), and what differs (shape, dtype).
#[test]
fn inconsistent_shards_name_the_odd_rank_and_what_differs() {
    const R: &[Placement] = &[Placement::Replicate];
    const S0: &[Placement] = &[Placement::Shard(0)];
    for world in [3usize, 4] {
        for odd in [0, world / 2, world - 1] {
            // Replicate, one rank's shape differs.
            let errs = from_local_errors(world, true, R, move |r| {
                shard(r, odd, &[2, 3], &[2, 4], DType::F32)
            });
            for e in &errs {
                let m = e.as_deref().expect("an error on every rank");
                assert!(m.contains(&format!("rank {odd} differs")), "world {world} odd {odd}: {m}");
                assert!(m.contains("[2, 4]") && m.contains("[2, 3]"), "{m}");
            }
            // Replicate, one rank's dtype differs.
            let errs = from_local_errors(world, true, R, move |r| {
                shard(r, odd, &[2, 3], &[2, 3], DType::F64)
            });
            for e in &errs {
                let m = e.as_deref().expect("an error on every rank");
                assert!(m.contains(&format!("rank {odd} differs")), "{m}");
                assert!(m.contains("dtype is f64") && m.contains("f32"), "{m}");
                assert!(!m.contains("local shard has shape"), "only the dtype differs: {m}");
            }
            // Shard(0) of 2 rows each, one rank holds 3: blamed, not its neighbours;
            // from_local (which gathers the shapes anyway) checks as much.
            for checked in [true, false] {
                let errs = from_local_errors(world, checked, S0, move |r| {
                    shard(r, odd, &[2, 3], &[3, 3], DType::F32)
                });
                for e in &errs {
                    let m = e.as_deref().expect("an error on every rank");
                    assert!(m.contains(&format!("rank {odd} differs")), "{m}");
                    assert!(m.contains("[3, 3]") && m.contains("[2, 3]"), "{m}");
                }
            }
        }
    }
    // Consistent uneven shards still pass (n = 5 on 4 ranks: 2, 2, 1, 0).
    let ok = from_local_errors(4, true, S0, |r| {
        Tensor::zeros([[2usize, 2, 1, 0][r], 3], DType::F32, Device::Cpu).unwrap()
    });
    assert!(ok.iter().all(Option::is_none), "{ok:?}");
}

/// Class 4: a non-finite gradient norm is an error naming the norm with
/// `clip_grad_norm_` with `error_if_nonfinite` (PyTorch's `error_if_nonfinite=True`); the trainers fail
/// fast naming the step and the rank, or skip the step with `--nonfinite skip`.
#[test]
fn non_finite_norms_are_errors_when_asked() {
    let w = Tensor::from_vec(vec![1.0f32, 2.0], [2]).unwrap().requires_grad_(true);
    let p = Param::Tensor(w.clone());
    let loss = w.mul_scalar(f64::NAN).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let checked = ClipOptions::default().error_if_nonfinite(true);
    let e = clip_grad_norm_(std::slice::from_ref(&p), 1.0, &checked).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("clip_grad_norm") && m.contains("norm") && m.contains("NaN"), "{m}");
    // Without the check the norm is returned as it is.
    let norm = clip_grad_norm_(std::slice::from_ref(&p), 1.0, &ClipOptions::default()).unwrap();
    assert!(norm.item().unwrap().is_nan());
    // A finite norm passes and clips.
    let v = Tensor::from_vec(vec![3.0f32, 4.0], [2]).unwrap().requires_grad_(true);
    let q = Param::Tensor(v.clone());
    v.square().unwrap().sum_all().unwrap().mul_scalar(0.5).unwrap().backward().unwrap();
    let n = clip_grad_norm_(std::slice::from_ref(&q), 1.0, &checked).unwrap().item().unwrap();
    assert!((n - 5.0).abs() < 1e-5, "{n}");
    // The trainers: an infinite learning rate is refused; a huge one blows the loss up.
    let args = ["--steps", "6", "--lr", "1e30", "--layers", "1", "--seq", "16", "--batch", "2"];
    if let Some((code, out, err)) = run_example("llama_2d", &args) {
        assert_eq!(code, 1, "{out}\n{err}");
        assert!(
            err.contains("non-finite") && err.contains("step") && err.contains("rank"),
            "{err}"
        );
        let skip = [&args[..], &["--nonfinite", "skip"]].concat();
        let (code, out, err) = run_example("llama_2d", &skip).unwrap();
        assert!(out.contains("optimizer step skipped"), "{out}\n{err}");
        assert!(out.contains("summary: world=4 dp=2 tp=2 steps=6 first_loss="), "{out}");
        assert!(code == 0 || err.contains("loss did not fall"), "{code}: {err}");
    }
}

/// Class 5: with ranks as threads, a rank stuck outside any collective does not keep
/// `spawn_owned` from returning the failing rank's error within the timeout, naming the
/// ranks still running.
#[test]
fn a_rank_stuck_outside_collectives_does_not_hang_spawn() {
    let t0 = Instant::now();
    let cfg = SpawnConfig::new(3).timeout(Duration::from_secs(1));
    let err = spawn_owned(cfg, |ctx| -> Result<(), CollectiveError> {
        match ctx.rank() {
            1 => Err(CollectiveError::InvalidArgument { op: "train", why: "bad batch".into() }),
            2 => {
                std::thread::sleep(Duration::from_secs(60));
                Ok(())
            }
            _ => Ok(()),
        }
    })
    .unwrap_err();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    let m = err.to_string();
    assert_eq!(err.culprit(), Some(1), "{m}");
    assert!(m.contains("rank 1 failed") && m.contains("bad batch"), "{m}");
    assert!(m.contains("[2] still running"), "{m}");
    // Ranks that all finish: the originating error, as spawn_with gives.
    let err = spawn_owned(SpawnConfig::new(2), |ctx| -> Result<(), CollectiveError> {
        if ctx.rank() == 0 {
            return Err(CollectiveError::InvalidArgument { op: "train", why: "first".into() });
        }
        ctx.world_group().barrier()
    })
    .unwrap_err();
    assert!(err.to_string().contains("first"), "{err}");
    // And results in rank order when none fails.
    let out = spawn_owned(SpawnConfig::new(3), |ctx| Ok::<_, CollectiveError>(ctx.rank())).unwrap();
    assert_eq!(out, vec![0, 1, 2]);
}

/// Class 6: a run too short to judge is valid: "loss did not fall" is a warning there.
#[test]
fn short_runs_warn_instead_of_failing() {
    let args = ["--steps", "1", "--layers", "1", "--seq", "16", "--batch", "2"];
    if let Some((code, out, err)) = run_example("llama_2d", &args) {
        assert_eq!(code, 0, "{out}\n{err}");
        assert!(out.contains("summary: world=4 dp=2 tp=2 steps=1"), "{out}");
    }
}
