//! `llama_2d --cp N` and `llama_pp --cp N`: the trainers on a ["dp", "cp", "tp"] and a
//! ["pp", "dp", "cp", "tp"] mesh train the same model as without context parallelism
//! (losses equal to f32 rounding at cp 2 and cp 3, FSDP over dp x cp; cp 2 x tp 2 with
//! DDP and with FSDP over dp x cp; pp 2 x cp 2 under 1F1B and zero-bubble, and with tp 2
//! under FSDP), and their summary lines gain `cp=N`; `--cp-method all-gather` trains as
//! the ring does; a context of 131072 tokens, whose dense attention mask (never built)
//! would take 128 GiB, trains at cp 4.

mod common;
use common::examples::run_example;

/// The `key=value` of a summary line.
fn key(out: &str, k: &str) -> String {
    let line = out.lines().find(|l| l.starts_with("summary:")).expect("a summary line");
    let pre = format!(" {k}=");
    let at = line.find(&pre).unwrap_or_else(|| panic!("{k} in {line}"));
    line[at + pre.len()..].split_whitespace().next().unwrap().to_string()
}

fn losses(args: &[&str]) -> Option<(f64, f64, String)> {
    losses_of("llama_2d", args)
}

fn losses_of(example: &str, args: &[&str]) -> Option<(f64, f64, String)> {
    let base = ["--steps", "4", "--layers", "2", "--seq", "24", "--log-every", "1"];
    let all = [&base[..], args].concat();
    let (code, out, err) = run_example(example, &all)?;
    assert_eq!(code, 0, "{all:?}\n{out}\n{err}");
    let first: f64 = key(&out, "first_loss").parse().unwrap();
    let last: f64 = key(&out, "final_loss").parse().unwrap();
    Some((first, last, key(&out, "cp")))
}

#[test]
fn cp_runs_match_the_run_without_cp() {
    let Some(reference) = losses(&["--dp", "1", "--tp", "1", "--batch", "2"]) else { return };
    assert_eq!(reference.2, "1");
    for (args, cp) in [
        (&["--dp", "1", "--tp", "1", "--cp", "2", "--batch", "2"][..], "2"),
        (&["--dp", "1", "--tp", "1", "--cp", "3", "--batch", "2"][..], "3"),
        (&["--dp", "1", "--tp", "2", "--cp", "2", "--no-fsdp", "--batch", "2"][..], "2"),
        // FSDP over the flattened dp x cp mesh composed with tensor parallelism.
        (&["--dp", "1", "--tp", "2", "--cp", "2", "--batch", "2"][..], "2"),
    ] {
        let got = losses(args).unwrap();
        assert_eq!(got.2, cp, "{args:?}");
        for (g, w) in [(got.0, reference.0), (got.1, reference.1)] {
            assert!((g - w).abs() <= 2e-4 * w.abs(), "{args:?}: loss {g} vs {w}");
        }
    }
}

#[test]
fn llama_pp_cp_runs_match_the_run_without_cp() {
    let pp = ["--pp", "2", "--batch", "4", "--microbatches", "2"];
    let with = |extra: &[&'static str]| [&pp[..], extra].concat();
    let Some(reference) = losses_of("llama_pp", &with(&[])) else { return };
    for (extra, cp) in [
        (&["--cp", "2"][..], "2"),
        (&["--cp", "2", "--schedule", "zb"][..], "2"),
        (&["--cp", "2", "--tp", "2", "--no-fsdp"][..], "2"),
        (&["--cp", "2", "--tp", "2"][..], "2"),
    ] {
        let got = losses_of("llama_pp", &with(extra)).unwrap();
        assert_eq!(got.2, cp, "{extra:?}");
        for (g, w) in [(got.0, reference.0), (got.1, reference.1)] {
            assert!((g - w).abs() <= 2e-4 * w.abs(), "llama_pp {extra:?}: loss {g} vs {w}");
        }
    }
}

/// `--cp-method`: the all-gather exchange trains as the ring does (both trainers, the
/// same loss bits), the summary names the method, and an unknown method is refused.
#[test]
fn the_cp_method_flag_picks_the_exchange() {
    for (example, args) in [
        ("llama_2d", &["--dp", "1", "--tp", "2", "--cp", "2", "--batch", "2"][..]),
        ("llama_pp", &["--pp", "2", "--dp", "1", "--tp", "1", "--cp", "2", "--batch", "4"][..]),
    ] {
        let base = ["--steps", "3", "--layers", "2", "--seq", "24", "--log-every", "1"];
        let run = |method: &str| {
            let all = [&base[..], args, &["--cp-method", method]].concat();
            run_example(example, &all).map(|(code, out, err)| {
                assert_eq!(code, 0, "{all:?}\n{out}\n{err}");
                assert_eq!(key(&out, "cp_method"), method, "{example}");
                key(&out, "final_loss_bits")
            })
        };
        let Some(ring) = run("ring") else { return };
        assert_eq!(run("all-gather").unwrap(), ring, "{example}");
    }
    let (code, _, err) = run_example("llama_2d", &["--cp", "2", "--cp-method", "gossip"]).unwrap();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("gossip"), "{err}");
}

#[test]
fn a_long_context_that_fits_the_memory_model_trains() {
    // 131072 tokens at cp 4: a quarter of the sequence per rank, about 0.2 GiB each by
    // the memory model. Its full [1, 1, s, s] f64 attention mask (128 GiB), which the
    // model never builds, must not stand in for the check; a sequence that does not
    // fit is refused with the model's numbers (tests/bad_input_classes.rs).
    let args = ["--steps", "1", "--seq", "131072", "--batch", "1", "--layers", "1"];
    let args = [&args[..], &["--dp", "1", "--tp", "1", "--cp", "4"]].concat();
    let Some((code, out, err)) = run_example("llama_2d", &args) else { return };
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(key(&out, "cp"), "4");
    let predicted: f64 = key(&out, "predicted_peak_mib").parse().unwrap();
    let measured: f64 = key(&out, "peak_mib_max").parse().unwrap();
    assert!(predicted < 512.0 && measured < 1.2 * predicted, "{predicted} / {measured}");
}
