//! Misuse that used to pass silently or abort, one test each: every one is now a typed
//! error (or an exit with a message) naming what went wrong and the numbers.
//!
//! * an optimizer built before the model was sharded (it would step tensors the model
//!   no longer computes with, and the model would not train);
//! * trainer flags asking for more layers or ranks than the machine holds (they used
//!   to build for tens of seconds, then abort);
//! * the peak memory a trainer reports when its ranks are processes over tcp.

use std::time::Duration;

use tpar::prelude::*;

mod common;
use common::examples::{example, run_example_timed, run_limited};

fn tiny_llama() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 48,
        max_position_embeddings: 8,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        ..Default::default()
    }
}

/// How an optimizer built too early is caught: the sharding applied after it.
#[derive(Clone, Copy, Debug)]
enum Shard {
    /// `parallelize_llama` with the sequence-parallel plan on a tp mesh of 2.
    Tp,
    /// `fully_shard` per layer and at the root on a dp mesh of 2.
    Fsdp,
}

/// Which optimizer is built too early.
#[derive(Clone, Copy, Debug)]
enum Opt {
    AdamW,
    Sgd,
    Zero,
}

/// One training step's forward and backward on a fixed tiny batch.
fn forward_backward(model: &LlamaForPretraining, mesh: &DeviceMesh) -> tpar::Result<()> {
    let ids: Vec<i64> = (0..2 * 9).map(|i| (i * 7 % 48) as i64).collect();
    let all = Tensor::from_vec(ids, [2, 9])?;
    let (x, y) = (all.narrow(1, 0, 8)?.deep_clone()?, all.narrow(1, 1, 8)?.deep_clone()?);
    let _lp = loss_parallel::enable(&mesh["tp"]);
    unshard(model)?;
    let logits = model.logits(&x, None)?.reshape(&[-1, 48])?;
    let loss = logits.cross_entropy(&y.reshape([16])?, -100)?;
    loss.backward()?;
    Ok(())
}

fn shard(model: &mut LlamaForPretraining, mesh: &DeviceMesh, how: Shard) -> tpar::Result<()> {
    match how {
        Shard::Tp => parallelize_llama(model, &mesh["tp"], &sequence_parallel_layer_plan())?,
        Shard::Fsdp => {
            let fsdp = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &fsdp)?;
            }
            fully_shard(model, &mesh["dp"], &fsdp)?;
        }
    }
    Ok(())
}

/// Builds a materialized model and `opt` over it, then shards it as `how` says, runs a
/// forward and backward, and steps: returns each rank's error message (`None` if the
/// step passed). With `after`, the optimizer is built after sharding instead, as it
/// must be.
fn step_after_sharding(how: Shard, opt: Opt, after: bool) -> Vec<Option<String>> {
    let (dp, tp) = match how {
        Shard::Tp => (1, 2),
        Shard::Fsdp => (2, 1),
    };
    let cfg = SpawnConfig::new(2).timeout(Duration::from_secs(20));
    let run = spawn_owned(cfg, move |ctx| -> tpar::Result<Option<String>> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
        let mut model = LlamaForPretraining::new(&tiny_llama(), Device::Meta)?;
        let build = |model: &LlamaForPretraining| -> tpar::Result<Box<dyn Optimizer>> {
            let named = named_parameters(model);
            Ok(match opt {
                Opt::AdamW => Box::new(AdamW::with_names(named, AdamWConfig::default())?),
                Opt::Sgd => Box::new(Sgd::with_names(named, SgdConfig::default())?),
                Opt::Zero => Box::new(ZeroRedundancyOptimizer::adamw(
                    named,
                    &mesh["dp"],
                    AdamWConfig::default(),
                )?),
            })
        };
        let mut early = None;
        if !after {
            reset_parameters(&mut model, Device::Cpu, 0)?;
            early = Some(build(&model)?);
        }
        shard(&mut model, &mesh, how)?;
        if after {
            reset_parameters(&mut model, Device::Cpu, 0)?;
        }
        let mut opt = match early {
            Some(o) => o,
            None => build(&model)?,
        };
        forward_backward(&model, &mesh)?;
        Ok(opt.step().err().map(|e| e.to_string()))
    });
    run.expect("the ranks run")
}

/// Item 7: an optimizer built on the materialized model before `parallelize_*` or
/// `fully_shard` holds tensors the model no longer has. Its first step is an error
/// naming the parameter (its FQN), what replaced it, and the advice to build it after
/// sharding; built after sharding, the same optimizer steps.
#[test]
fn an_optimizer_built_before_sharding_fails_at_its_first_step() {
    for (how, opt, by) in [
        (Shard::Tp, Opt::AdamW, "parallelize_module"),
        (Shard::Fsdp, Opt::AdamW, "fully_shard"),
        (Shard::Tp, Opt::Sgd, "parallelize_module"),
        (Shard::Fsdp, Opt::Sgd, "fully_shard"),
        (Shard::Tp, Opt::Zero, "parallelize_module"),
    ] {
        let errs = step_after_sharding(how, opt, false);
        for (rank, e) in errs.iter().enumerate() {
            let m = e.as_deref().unwrap_or_else(|| panic!("{how:?} {opt:?}: rank {rank} stepped"));
            assert!(m.contains("build the optimizer after sharding"), "{how:?} {opt:?}: {m}");
            assert!(m.contains(by) && m.contains("no longer the model's"), "{how:?} {opt:?}: {m}");
            // The first parameter, by its FQN.
            assert!(m.contains("parameter lm_head.weight"), "{how:?} {opt:?}: {m}");
        }
        let ok = step_after_sharding(how, opt, true);
        assert!(ok.iter().all(Option::is_none), "{how:?} {opt:?} built after: {ok:?}");
    }
}

/// Item 7, without a mesh: `reset_parameters` after the optimizer was built replaces the
/// tensors too; an optimizer over unnamed parameters names them by index. Building an
/// optimizer from a stale parameter list is refused at once.
#[test]
fn an_optimizer_over_replaced_parameters_names_them() {
    let mut model = LlamaForPretraining::new(&tiny_llama(), Device::Cpu).unwrap();
    let params = parameters(&model);
    let mut sgd = Sgd::new(params.clone(), SgdConfig::default()).unwrap();
    let mut adamw = AdamW::new(params.clone(), AdamWConfig::default()).unwrap();
    reset_parameters(&mut model, Device::Cpu, 1).unwrap();
    let m = sgd.step().unwrap_err().to_string();
    assert!(m.starts_with("SGD: parameter 0 is no longer the model's"), "{m}");
    assert!(m.contains("reset_parameters") && m.contains("build the optimizer after"), "{m}");
    let e = adamw.step().unwrap_err();
    assert!(matches!(e, NnError::RetiredParam { .. }), "{e}");
    let m = AdamW::new(params, AdamWConfig::default()).unwrap_err().to_string();
    assert!(m.contains("AdamW: parameter 0 is no longer the model's"), "{m}");
    // Over the model's parameters now, it steps.
    let mut fresh = AdamW::new(parameters(&model), AdamWConfig::default()).unwrap();
    fresh.step().unwrap();
}

/// Item 13, in the library: the Llama's parameter count is known before anything is
/// built, and a count that overflows is a typed error naming the layer count.
#[test]
fn the_parameter_count_is_known_up_front_and_checked() {
    for cfg in [tiny_llama(), LlamaConfig { num_hidden_layers: 0, ..tiny_llama() }] {
        let model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
        let counted: usize = parameters(&model).iter().map(Param::numel).sum();
        assert_eq!(cfg.num_parameters().unwrap(), counted, "{cfg:?}");
    }
    for layers in [usize::MAX, usize::MAX / 1000] {
        let cfg = LlamaConfig { num_hidden_layers: layers, ..tiny_llama() };
        let m = cfg.validate().unwrap_err().to_string();
        assert!(
            m.contains(&format!("num_hidden_layers {layers}")) && m.contains("overflows"),
            "{m}"
        );
        let Err(e) = LlamaForPretraining::new(&cfg, Device::Meta) else { panic!("{layers}") };
        assert!(matches!(e, NnError::Config { .. }), "{e}");
    }
}

/// Item 13: a layer count whose training state no machine here holds is refused before
/// anything is built, in a moment, naming the flag and the bytes; so is a count whose
/// parameter count overflows. No panic, no abort.
#[test]
fn too_many_layers_are_refused_before_building() {
    for name in ["llama_2d", "llama_pp"] {
        for layers in ["10000000", "1000000000", "18446744073709551615"] {
            let args = ["--layers", layers, "--steps", "1"];
            let Some((code, out, err, took)) =
                run_example_timed(name, &args, Duration::from_secs(60))
            else {
                eprintln!("{name} not built; skipping its size checks");
                continue;
            };
            let what = format!("{name} --layers {layers}");
            assert!(took < Duration::from_secs(10), "{what} took {took:?}: {err}");
            assert_eq!(code, 1, "{what}: {out}\n{err}");
            assert!(err.contains(&format!("--layers {layers}")), "{what}: {err}");
            assert!(err.contains("bytes") || err.contains("overflows"), "{what}: {err}");
            assert!(!err.contains("panicked") && !err.contains("backtrace"), "{what}: {err}");
            assert!(!out.contains("summary:"), "{what}: {out}");
        }
        // The numbers: the parameter count, the bytes it needs and what the machine has.
        let (_, _, err, _) =
            run_example_timed(name, &["--layers", "10000000"], Duration::from_secs(60)).unwrap();
        assert!(err.contains("parameters need at least") && err.contains("TiB"), "{err}");
    }
}

/// Item 13: a world of rank threads the machine cannot run is refused before any rank
/// starts (exit 2), naming the flags, the count and the limit with its reasons.
#[test]
fn too_many_rank_threads_are_refused_before_spawning() {
    for (name, args, flags) in [
        (
            "llama_2d",
            &["--world", "1000000", "--dp", "1000000", "--tp", "1"][..],
            "--world 1000000",
        ),
        ("llama_2d", &["--dp", "1000", "--tp", "1000"][..], "--world 1000000"),
        ("llama_pp", &["--pp", "1000", "--dp", "1000"][..], "--pp 1000 x --dp 1000 x --tp 1"),
    ] {
        let Some((code, out, err, took)) = run_example_timed(name, args, Duration::from_secs(60))
        else {
            eprintln!("{name} not built; skipping its world checks");
            continue;
        };
        assert!(took < Duration::from_secs(10), "{name} {args:?} took {took:?}: {err}");
        assert_eq!(code, 2, "{name} {args:?}: {out}\n{err}");
        assert!(err.contains(flags) && err.contains("1000000 ranks"), "{name} {args:?}: {err}");
        assert!(err.contains("at most") && err.contains("per core"), "{name} {args:?}: {err}");
        assert!(!err.contains("panicked"), "{name} {args:?}: {err}");
    }
}

/// Item 14: `llama_pp` over tcp, one process per rank under `tpar-run`: the reporting
/// rank (the last stage's, rank 1 here) reports its own peak memory, not another rank's
/// empty accounting slot.
#[cfg(unix)]
#[test]
fn llama_pp_over_tcp_reports_its_own_peak_memory() {
    let Some(llama) = example("llama_pp") else {
        eprintln!("llama_pp not built; skipping");
        return;
    };
    let llama = llama.to_string_lossy().into_owned();
    let launcher = std::path::Path::new(env!("CARGO_BIN_EXE_tpar-run"));
    let args = [
        "--nproc-per-node",
        "2",
        "--",
        &llama,
        "--backend",
        "tcp",
        "--pp",
        "2",
        "--steps",
        "2",
        "--layers",
        "2",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "32",
        "--seq",
        "16",
        "--batch",
        "2",
        "--microbatches",
        "2",
    ];
    let (code, out, err, _) = run_limited(launcher, &args, Duration::from_secs(120));
    assert_eq!(code, 0, "{out}\n{err}");
    let peak: f64 = out
        .split_whitespace()
        .find_map(|f| f.strip_prefix("peak_mib_max="))
        .unwrap_or_else(|| panic!("no summary:\n{out}"))
        .parse()
        .unwrap();
    assert!(peak > 0.0, "peak_mib_max={peak}:\n{out}");
    assert!(out.contains("[rank 1] summary: world=2 pp=2"), "{out}");
}

/// Item 13, in the library: `spawn` refuses a world of more rank threads than the process
/// can run before it builds anything (no abort, no exhausted memory), naming the count
/// and the limit.
#[test]
fn spawn_refuses_more_rank_threads_than_the_process_runs() {
    let (limit, _) = tpar::collectives::max_rank_threads();
    for n in [1_000_000usize, usize::MAX] {
        let t0 = std::time::Instant::now();
        let err = spawn(n, |_ctx| Ok::<_, CollectiveError>(())).unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_secs(5), "{n}: took {:?}", t0.elapsed());
        assert!(
            err.contains(&format!("{n} ranks")) && err.contains(&format!("at most {limit}")),
            "{err}"
        );
        let cfg = SpawnConfig::new(n);
        let err =
            tpar::collectives::spawn_scoped(cfg, |_ctx| Ok::<_, CollectiveError>(())).unwrap_err();
        assert!(err.to_string().contains(&format!("{n} ranks")), "{err}");
    }
    // Within the limit it runs.
    assert_eq!(spawn(2, |ctx| Ok::<_, CollectiveError>(ctx.rank())).unwrap(), vec![0, 1]);
}
