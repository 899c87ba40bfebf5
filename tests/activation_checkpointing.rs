//! Activation checkpointing: full, every-k-th, selective and mixed (`selective+full:K`)
//! AC give the loss and every gradient of the model without AC, bit for bit (single
//! rank, 2x2 FSDP x TP, pp 2 with 1F1B and zero-bubble); the recompute really runs and
//! the activations are really not kept (counted, and measured by the tracking
//! allocator); a recompute that differs from its forward in the kept ops fails with an
//! error instead of a wrong gradient.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tpar::nn::checkpoint::{checkpointable_modules, SaveOp};
use tpar::prelude::*;
use tpar::tensor::checkpoint::{
    checkpoint, recompute_counts, reset_recompute_counts, RecomputeCounts, WeightPass,
};
use tpar::tensor::memory;

mod common;
use common::llama_pipeline::{batch, grads_by_fqn, loss_backward, loss_fn};

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

type Grads = BTreeMap<String, Vec<u64>>;

fn policies() -> Vec<AcPolicy> {
    vec![
        AcPolicy::full(),
        AcPolicy::Full { every: 2 },
        AcPolicy::selective(),
        AcPolicy::Selective { every: 2, ops: vec![SaveOp::Sdpa] },
        AcPolicy::Selective { every: 1, ops: vec![SaveOp::Matmul] },
        AcPolicy::Selective { every: 1, ops: vec![SaveOp::EveryOtherMatmul, SaveOp::Sdpa] },
        AcPolicy::Mixed { full_every: 2, ops: SaveOp::DEFAULT.to_vec() },
        AcPolicy::Mixed { full_every: 3, ops: vec![SaveOp::Matmul, SaveOp::Sdpa] },
    ]
}

/// What a selectively checkpointed Llama layer keeps and reuses of `ops`: of 7 matmuls
/// (q, k, v, o, gate, up, down; every second one is the 1st, 3rd, 5th and 7th) and 1
/// attention, less down, whose output no recompute reads.
fn kept_per_layer(ops: &[SaveOp]) -> u64 {
    ops.iter()
        .map(|o| match o {
            SaveOp::Sdpa => 1,
            SaveOp::Matmul => 6,
            SaveOp::EveryOtherMatmul => 3,
        })
        .sum()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().unwrap().into_iter().map(f64::to_bits).collect()
}

/// Every parameter's gradient bits by FQN (none missing).
fn grads_of(model: &dyn Module) -> Grads {
    let to_bits = |g: Vec<f64>| g.into_iter().map(f64::to_bits).collect();
    grads_by_fqn(model).into_iter().map(|(n, g)| (n, to_bits(g))).collect()
}

/// Loss bits, every gradient's bits and the checkpointing counts of one step of a
/// 4-layer f64 Llama under `policy`, with a padding mask when `pad`.
fn single(policy: &AcPolicy, pad: bool) -> (u64, Grads, RecomputeCounts) {
    let cfg = tpar_testing::tiny_llama_config(40, 16, 4, DType::F64);
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 11).unwrap();
    apply_activation_checkpointing(&mut model, policy).unwrap();
    let (ids, tgt) = batch(3, 12, cfg.vocab_size);
    let mask = pad.then(|| {
        let m: Vec<i64> = (0..36).map(|i| i64::from(i % 12 < 12 - i / 12 * 3)).collect();
        Tensor::from_vec(m, [3, 12]).unwrap()
    });
    reset_recompute_counts();
    let loss = loss_backward(&model, cfg.vocab_size, (&ids, &tgt), mask.as_ref()).unwrap();
    (loss.item().unwrap().to_bits(), grads_of(&model), recompute_counts())
}

#[test]
fn single_rank_ac_equals_no_ac_bit_for_bit() {
    for pad in [false, true] {
        let (loss, grads, none) = single(&AcPolicy::None, pad);
        assert_eq!(none, RecomputeCounts::default());
        for p in policies() {
            let (l, g, counts) = single(&p, pad);
            assert_eq!(l, loss, "{p} (pad {pad}): loss differs");
            assert_eq!(g.len(), grads.len());
            for (k, v) in &grads {
                assert!(g[k] == *v, "{p} (pad {pad}): gradient of {k} differs");
            }
            // 4 layers: every 2nd is 2 of them; each recomputed once.
            let n = 4 / p.every().unwrap() as u64;
            assert_eq!((counts.regions, counts.recomputed), (n, n), "{p}: {counts:?}");
            // Each recompute leaves down_proj's product uncomputed (only the residual add
            // reads it before the layer's output), and no forward keeps it for that.
            assert_eq!(counts.skipped, n, "{p}: {counts:?}");
            // The selectively checkpointed layers and what each keeps.
            let (selective, per) = match &p {
                AcPolicy::Full { .. } => (0, 0),
                AcPolicy::Selective { ops, .. } => (n, kept_per_layer(ops)),
                AcPolicy::Mixed { full_every, ops } => {
                    (n - n / *full_every as u64, kept_per_layer(ops))
                }
                AcPolicy::None => unreachable!(),
            };
            let kept = selective * per;
            assert_eq!((counts.saved, counts.reused), (kept, kept), "{p}: {counts:?}");
        }
    }
}

#[test]
fn policies_parse_print_and_apply_by_fqn() {
    for s in [
        "none",
        "full",
        "full:2",
        "selective",
        "selective:3",
        "selective[sdpa]:2",
        "selective[matmul/2,sdpa]",
        "selective+full:2",
        "selective[matmul,sdpa]+full:3",
    ] {
        let p: AcPolicy = s.parse().unwrap();
        assert_eq!(p.to_string(), s);
    }
    let bad_ones = ["full:0", "half", "selective[conv]", "full:x", "none:2", "selective+full:0"];
    for bad in bad_ones.into_iter().chain(["selective+full", "full+full:2", "none+full:2"]) {
        let e = bad.parse::<AcPolicy>().unwrap_err().to_string();
        assert!(e.contains(bad) || e.contains("conv"), "{bad}: {e}");
    }
    let cfg = tpar_testing::tiny_llama_config(40, 16, 4, DType::F64);
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    let names: Vec<String> = (0..4).map(|i| format!("base_model.layers.{i}")).collect();
    assert_eq!(checkpointable_modules(&model), names);
    let mixed: AcPolicy = "selective+full:2".parse().unwrap();
    assert_eq!(apply_activation_checkpointing(&mut model, &mixed).unwrap(), names);
    let e = apply_activation_checkpointing_to(&mut model, &["base_model.layers.0"], &mixed)
        .unwrap_err()
        .to_string();
    assert!(e.contains("by position"), "{e}");
    let chosen = apply_activation_checkpointing(&mut model, &AcPolicy::Full { every: 2 }).unwrap();
    assert_eq!(chosen, ["base_model.layers.1", "base_model.layers.3"]);
    // The wrapper adds no name component: parameter FQNs are the plain model's.
    assert!(named_parameters(&model)
        .iter()
        .any(|(n, _)| n == "base_model.layers.2.self_attn.q_proj.weight"));
    apply_activation_checkpointing_to(&mut model, &["base_model.layers.0"], &AcPolicy::selective())
        .unwrap();
    let e =
        apply_activation_checkpointing_to(&mut model, &["base_model.layer.2"], &AcPolicy::full())
            .unwrap_err()
            .to_string();
    assert!(
        e.contains("no module named \"base_model.layer.2\"") && e.contains("base_model.layers.2"),
        "{e}"
    );
    let e = apply_activation_checkpointing_to(&mut model, &["base_model.norm"], &AcPolicy::full())
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not checkpointable"), "{e}");
    let e = apply_activation_checkpointing(&mut model.lm_head, &AcPolicy::full()).unwrap_err();
    assert!(e.to_string().contains("no checkpointable module"), "{e}");
}

/// The tracking allocator's slot for the memory test (no rank thread of another test uses it).
const RANK: usize = 61;

/// Live bytes after the forward, peak bytes over forward and backward, on this thread.
fn memory_of(policy: &AcPolicy) -> (i64, i64) {
    let cfg = LlamaConfig {
        hidden_size: 32,
        intermediate_size: 96,
        ..tpar_testing::tiny_llama_config(40, 128, 4, DType::F64)
    };
    let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
    reset_parameters(&mut model, Device::Cpu, 5).unwrap();
    apply_activation_checkpointing(&mut model, policy).unwrap();
    let (ids, tgt) = batch(2, 128, cfg.vocab_size);
    memory::set_rank(Some(RANK));
    let before = memory::current(RANK);
    memory::reset_peak(RANK);
    let logits = model.logits(&ids, None).unwrap();
    let loss = loss_fn(cfg.vocab_size)(&logits, &tgt).unwrap().into_tensor("loss").unwrap();
    drop(logits);
    let live = memory::current(RANK) - before;
    loss.backward().unwrap();
    let peak = memory::peak(RANK) - before;
    drop(loss);
    memory::set_rank(None);
    (live, peak)
}

#[test]
fn activations_are_not_kept_but_recomputed() {
    let (none, none_peak) = memory_of(&AcPolicy::None);
    let (full, full_peak) = memory_of(&AcPolicy::full());
    let (sel, sel_peak) = memory_of(&AcPolicy::selective());
    // Full AC keeps each layer's input only; selective keeps matmul and attention outputs.
    assert!(full * 3 < none, "full AC keeps {full} bytes after forward, none {none}");
    assert!(full < sel && sel < none, "selective keeps {sel} (full {full}, none {none})");
    // The recompute's graph lives only while its layer's backward runs: the peak over
    // forward and backward falls too.
    assert!(full_peak * 2 < none_peak, "peak: full {full_peak}, none {none_peak}");
    assert!(sel_peak < none_peak, "peak: selective {sel_peak}, none {none_peak}");
    eprintln!(
        "after forward: none {none} B, selective {sel} B, full {full} B; peak: none {none_peak} B, \
         selective {sel_peak} B, full {full_peak} B"
    );
}

/// What a planted region computes on its `n`-th run (0: the forward; later: recomputes).
type Plant = fn(usize, &Tensor, &Tensor, &Tensor) -> tpar::tensor::Result<Tensor>;

/// A region run with a counter, so its forward and its recompute can differ.
fn region(
    w: &Tensor,
    w2: &Tensor,
    plant: Plant,
) -> impl Fn(&[Tensor]) -> tpar::tensor::Result<Tensor> + Send + Sync + 'static {
    let calls = Arc::new(AtomicUsize::new(0));
    let (w, w2) = (w.clone(), w2.clone());
    move |i: &[Tensor]| plant(calls.fetch_add(1, Ordering::SeqCst), &i[0], &w, &w2)
}

#[test]
fn a_recompute_that_differs_from_its_forward_fails() {
    let x = Tensor::from_vec((0..6).map(f64::from).collect(), [2, 3]).unwrap().requires_grad_(true);
    let w = Tensor::from_vec((0..12).map(|i| f64::from(i) * 0.1).collect(), [3, 4])
        .unwrap()
        .requires_grad_(true);
    let w2 = Tensor::from_vec((0..8).map(|i| f64::from(i) * 0.2).collect(), [4, 2])
        .unwrap()
        .requires_grad_(true);
    let keep = [SaveOp::Matmul];
    // As written: the same both times (the control).
    let same = region(&w, &w2, |_, x, w, w2| x.matmul(w)?.silu()?.matmul(w2)?.sum_all());
    checkpoint(std::slice::from_ref(&x), &keep, same).unwrap().backward().unwrap();
    // The recompute skips a kept op: one kept output is left unused.
    let fewer = region(&w, &w2, |n, x, w, w2| {
        let h = x.matmul(w)?.silu()?;
        if n == 0 {
            h.matmul(w2)?.sum_all()
        } else {
            h.sum_all()?.mul_scalar(1.0)
        }
    });
    let y = checkpoint(std::slice::from_ref(&x), &keep, fewer).unwrap();
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("used 1 of the 2 outputs the forward kept"), "{e}");
    // The recompute runs its kept ops in another order: the first request does not match
    // the first kept output.
    let swapped = region(&w, &w2, |n, x, w, w2| {
        if n == 0 {
            x.matmul(w)?.matmul(w2)?.sum_all()
        } else {
            let a = w.matmul(w2)?; // [3, 2] first
            x.matmul(&a)?.sum_all()
        }
    });
    let y = checkpoint(std::slice::from_ref(&x), &keep, swapped).unwrap();
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("asks for matmul with operands [[3, 4], [4, 2]]"), "{e}");
    // A kept op more in the recompute than in the forward.
    let more = region(&w, &w2, |n, x, w, w2| {
        let h = x.matmul(w)?.matmul(w2)?;
        if n == 0 {
            h.sum_all()
        } else {
            h.matmul(&w2.reshape([2, 4])?)?.sum_all()
        }
    });
    let y = checkpoint(std::slice::from_ref(&x), &keep, more).unwrap();
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("forward kept only 2 outputs"), "{e}");
    // Another output shape.
    let reshaped = region(&w, &w2, |n, x, w, _| {
        let h = x.matmul(w)?;
        if n == 0 {
            Ok(h)
        } else {
            h.reshape([4, 2])
        }
    });
    let y = checkpoint(std::slice::from_ref(&x), &[], reshaped).unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("recompute's output is f64 [4, 2]"), "{e}");
}

#[test]
fn the_kept_outputs_are_what_the_recompute_uses() {
    // A kept matmul output is not recomputed: changing the weight in place between the
    // forward and the backward changes the recomputed silu (which reads the kept output)
    // only through what was kept. With full AC the new weight is seen; with selective AC
    // the forward's product is used (so the value of silu' is the forward's).
    let run = |keep: &[SaveOp]| -> Vec<f64> {
        let x = Tensor::from_vec(vec![0.5f64, -1.0, 2.0, 0.25], [2, 2]).unwrap();
        let w =
            Tensor::from_vec(vec![1.0f64, 0.5, -0.5, 2.0], [2, 2]).unwrap().requires_grad_(true);
        let w2 = w.clone();
        let xx = x.clone().requires_grad_(true);
        let y = checkpoint(std::slice::from_ref(&xx), keep, move |i| {
            i[0].matmul(&w2)?.silu()?.sum_all()
        })
        .unwrap();
        no_grad(|| w.copy_(&w.mul_scalar(3.0)?)).unwrap();
        y.backward().unwrap();
        xx.grad().unwrap().to_vec_f64().unwrap()
    };
    let reference = |w_scale_in_silu: f64| -> Vec<f64> {
        // dx = silu'(x W_f) W_b^T with W_f the product's weight and W_b the backward's.
        let x = Tensor::from_vec(vec![0.5f64, -1.0, 2.0, 0.25], [2, 2]).unwrap();
        let w = Tensor::from_vec(vec![1.0f64, 0.5, -0.5, 2.0], [2, 2]).unwrap();
        let h = x.matmul(&w.mul_scalar(w_scale_in_silu).unwrap()).unwrap().requires_grad_(true);
        h.silu().unwrap().sum_all().unwrap().backward().unwrap();
        h.grad()
            .unwrap()
            .matmul_t(&w.mul_scalar(3.0).unwrap(), false, true)
            .unwrap()
            .to_vec_f64()
            .unwrap()
    };
    assert_eq!(run(&[]), reference(3.0));
    assert_eq!(run(&[SaveOp::Matmul]), reference(1.0));
}

/// One step of the tp config's Llama (f64, 2 layers made 4) on a 2x2 dp x tp mesh: FSDP
/// per layer and at the root, the sequence-parallel plan, loss_parallel; `policy`
/// applied after the plan and before FSDP (as torchtitan). Returns (loss bits, each
/// rank's local gradient bits by FQN).
/// A user's hook on each layer's MLP that scales its output by a learnable factor (whose
/// gradient reads the output's values).
struct Scale(Tensor);

impl tpar::nn::ForwardHook for Scale {
    fn post(&self, out: Value) -> tpar::nn::Result<Value> {
        Ok(Value::Tensor(out.into_tensor("mlp output")?.mul(&self.0)?))
    }
    fn describe(&self) -> String {
        "scale".into()
    }
}

/// A recompute leaves a product uncomputed only where no backward reads its output: with
/// a hook on the MLP that may read it (the default of `ForwardHook::reads_output`), full
/// checkpointing computes down_proj again and every gradient, the hook's factor's
/// included, is the one without checkpointing, bit for bit. A recompute that skipped it
/// anyway would give the factor a gradient from zeros.
#[test]
fn a_hook_that_may_read_an_output_keeps_it_computed() {
    let cfg = tpar_testing::tiny_llama_config(40, 16, 4, DType::F64);
    let run = |policy: &AcPolicy| {
        let mut model = LlamaForPretraining::new(&cfg, Device::Meta).unwrap();
        reset_parameters(&mut model, Device::Cpu, 11).unwrap();
        let factors: Vec<Tensor> = (0..cfg.num_hidden_layers)
            .map(|i| Tensor::full([], 1.0 + 0.25 * i as f64, DType::F64, Device::Cpu).unwrap())
            .map(|t| t.requires_grad_(true))
            .collect();
        for (layer, f) in model.base_model.layers.items.iter_mut().zip(&factors) {
            layer.mlp.core_mut().add_hook(Arc::new(Scale(f.clone())));
        }
        apply_activation_checkpointing(&mut model, policy).unwrap();
        let (ids, tgt) = batch(3, 12, cfg.vocab_size);
        reset_recompute_counts();
        let loss = loss_backward(&model, cfg.vocab_size, (&ids, &tgt), None).unwrap();
        let factor_grads: Vec<u64> =
            factors.iter().map(|f| f.grad().unwrap().item().unwrap().to_bits()).collect();
        (loss.item().unwrap().to_bits(), grads_of(&model), factor_grads, recompute_counts())
    };
    let (loss, grads, factors, _) = run(&AcPolicy::None);
    let (l, g, f, counts) = run(&AcPolicy::full());
    assert_eq!((counts.recomputed, counts.skipped), (4, 0), "{counts:?}");
    assert_eq!(l, loss);
    assert_eq!(f, factors, "the hooks' factors' gradients differ");
    assert!(g == grads, "a gradient differs");
}

/// A region of a plain function gets no request: here its function squares what a Llama
/// MLP returns (the square's backward reads it), so the recompute computes `down_proj`
/// again and the gradients are those without checkpointing, bit for bit. A recompute
/// that asked the MLP anyway would square zeros.
#[test]
fn a_region_of_a_function_that_reads_its_modules_output_skips_nothing() {
    let cfg = tpar_testing::tiny_llama_config(40, 16, 1, DType::F64);
    let mut mlp = tpar::models::LlamaMLP::new(&cfg, Device::Meta).unwrap();
    reset_parameters(&mut mlp, Device::Cpu, 5).unwrap();
    let mlp = Arc::new(mlp);
    let x0 = Tensor::randn([3, 4, cfg.hidden_size], DType::F64, &mut Rng::new(3)).unwrap();
    let run = |checkpointed: bool| {
        let x = x0.detach().requires_grad_(true);
        let m = mlp.clone();
        let f = move |i: &[Tensor]| -> tpar::tensor::Result<Tensor> {
            let y = call(&*m, Args::one(i[0].clone()))
                .and_then(|v| v.into_tensor("mlp output"))
                .map_err(|e| tpar::tensor::TensorError::External(Arc::new(e)))?;
            y.mul(&y)
        };
        reset_recompute_counts();
        let y = if checkpointed {
            checkpoint(std::slice::from_ref(&x), &[], f).unwrap()
        } else {
            f(std::slice::from_ref(&x)).unwrap()
        };
        y.sum_all().unwrap().backward().unwrap();
        (bits(&x.grad().unwrap()), grads_of(&*mlp), recompute_counts())
    };
    let (gx, gw, _) = run(false);
    for p in parameters(&*mlp) {
        p.local().zero_grad();
    }
    let (cx, cw, counts) = run(true);
    assert_eq!((counts.recomputed, counts.skipped), (1, 0), "{counts:?}");
    assert!(cx == gx, "the input's gradient differs");
    assert!(cw == gw, "a weight's gradient differs");
}

fn fsdp_tp(policy: &AcPolicy) -> Vec<(u64, Grads, RecomputeCounts)> {
    let cfg = LlamaConfig { num_hidden_layers: 4, ..tpar_testing::tp_llama_config(DType::F64) };
    let policy = policy.clone();
    spawn_scoped(
        SpawnConfig::new(4).timeout(Duration::from_secs(120)),
        move |ctx| -> tpar::Result<(u64, Grads, RecomputeCounts)> {
            reset_recompute_counts();
            let mesh =
                DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
            let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
            parallelize_llama(&mut model, &mesh["tp"], &sequence_parallel_layer_plan())?;
            apply_activation_checkpointing(&mut model, &policy)?;
            let fsdp = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &fsdp)?;
            }
            fully_shard(&mut model, &mesh["dp"], &fsdp)?;
            reset_parameters(&mut model, Device::Cpu, 9)?;
            let (ids, tgt) = batch(4, 8, cfg.vocab_size);
            let dp = mesh["dp"].local_rank();
            let (ids, tgt) = (ids.narrow(0, 2 * dp, 2)?, tgt.narrow(0, 2 * dp, 2)?);
            let _lp = loss_parallel::enable(&mesh["tp"]);
            let logits = model.logits(&ids, None)?.reshape(&[-1, cfg.vocab_size as isize])?;
            let loss = logits.cross_entropy(&tgt.reshape([tgt.numel()])?, -100)?;
            loss.backward()?;
            let grads = named_parameters(&model)
                .into_iter()
                .map(|(n, p)| (n, p.local().grad().map(|g| bits(&g)).unwrap_or_default()))
                .collect();
            Ok((loss.item()?.to_bits(), grads, recompute_counts()))
        },
    )
    .unwrap()
}

#[test]
fn fsdp_x_tp_ac_equals_no_ac_bit_for_bit() {
    let want = fsdp_tp(&AcPolicy::None);
    let mixed = AcPolicy::Mixed { full_every: 2, ops: SaveOp::DEFAULT.to_vec() };
    for p in [AcPolicy::full(), AcPolicy::Full { every: 2 }, AcPolicy::selective(), mixed] {
        let got = fsdp_tp(&p);
        for (r, ((l, g, c), (wl, wg, _))) in got.iter().zip(&want).enumerate() {
            // Each rank recomputes its checkpointed layers once in backward.
            let n = 4 / p.every().unwrap() as u64;
            assert_eq!((c.regions, c.recomputed), (n, n), "{p}: rank {r} {c:?}");
            // selective: per layer attention and every second of the 7 local matmuls but
            // down, as at a single rank (the DTensor ops' shape inference on meta tensors
            // inside the region is not an op to keep and takes no place in the count)
            let kept = match p {
                AcPolicy::Selective { .. } => n * 4,
                // layers 1 and 3 selective, 2 and 4 full
                AcPolicy::Mixed { .. } => n / 2 * 4,
                _ => 0,
            };
            assert_eq!((c.saved, c.reused), (kept, kept), "{p}: rank {r} {c:?}");
            // FSDP's hooks and the styles' redistributions read no output values: the
            // recompute still skips down_proj's product.
            assert_eq!(c.skipped, n, "{p}: rank {r} {c:?}");
            assert_eq!(l, wl, "{p}: rank {r} loss differs");
            assert_eq!(g.len(), wg.len());
            for (k, v) in wg {
                assert!(!v.is_empty(), "rank {r}: {k} got no gradient");
                assert!(g[k] == *v, "{p}: rank {r} gradient of {k} differs");
            }
        }
    }
}

/// One pipelined step (pp 2, 4 micro-batches) of a 4-layer f64 Llama with `policy` on
/// every stage and `weight_pass` for its split backwards: the mean micro-batch loss bits,
/// every gradient's bits by FQN and the regions recomputed.
fn pipelined(kind: ScheduleKind, policy: &AcPolicy, weight_pass: WeightPass) -> (u64, Grads, u64) {
    let cfg = tpar_testing::tiny_llama_config(40, 8, 4, DType::F64);
    let (ids, tgt) = batch(4, 6, cfg.vocab_size);
    let policy = policy.clone();
    let out = spawn_scoped(SpawnConfig::new(2), |ctx| -> tpar::Result<(Option<u64>, Grads, u64)> {
        reset_recompute_counts();
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["pp"])?;
        let s = mesh.local_rank();
        let mut m = LlamaStage::for_stage(&cfg, s, 2, None, Device::Meta)?;
        reset_parameters(&mut m, Device::Cpu, 7)?;
        apply_activation_checkpointing(&mut m, &policy)?;
        let stage = PipelineStage::new(m, s, 2, &mesh, Device::Cpu)?;
        let mut sched = PipelineSchedule::new(kind, vec![stage], 4, loss_fn(cfg.vocab_size))?;
        sched.set_ac_weight_pass(weight_pass);
        let losses = sched.step(Some(&ids), Some(&tgt))?;
        let mut grads = Grads::new();
        for st in sched.stages() {
            grads.extend(grads_of(st.module()));
        }
        let loss = (!losses.is_empty()).then(|| (losses.iter().sum::<f64>() / 4.0).to_bits());
        Ok((loss, grads, recompute_counts().recomputed))
    })
    .unwrap_or_else(|e| panic!("{kind} {policy}: {e}"));
    let loss = out.iter().find_map(|(l, _, _)| *l).unwrap();
    let recomputed = out.iter().map(|(_, _, n)| n).sum();
    (loss, out.into_iter().flat_map(|(_, g, _)| g).collect(), recomputed)
}

#[test]
fn pipeline_1f1b_and_zero_bubble_with_ac_equal_no_ac_bit_for_bit() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble] {
        let (loss, grads, none) = pipelined(kind, &AcPolicy::None, WeightPass::Keep);
        assert_eq!(none, 0);
        let mixed = AcPolicy::Mixed { full_every: 2, ops: SaveOp::DEFAULT.to_vec() };
        for p in [AcPolicy::full(), AcPolicy::Full { every: 2 }, AcPolicy::selective(), mixed] {
            for wp in [WeightPass::Keep, WeightPass::Recompute] {
                let (l, g, recomputed) = pipelined(kind, &p, wp);
                // 2 stages of 2 layers, 4 micro-batches: each checkpointed layer once per
                // micro-batch, and on zero-bubble's stage 1 (whose input passes split the
                // backward) once more in the weight pass when it recomputes.
                let once = 4 * 4 / p.every().unwrap() as u64;
                let want = match (kind, wp) {
                    (ScheduleKind::ZeroBubble, WeightPass::Recompute) => once * 3 / 2,
                    _ => once,
                };
                assert_eq!(recomputed, want, "{kind} {p} {wp}");
                assert_eq!(l, loss, "{kind} {p} {wp}: loss differs");
                assert_eq!(g.len(), grads.len());
                for (k, v) in &grads {
                    assert!(g[k] == *v, "{kind} {p} {wp}: gradient of {k} differs");
                }
            }
        }
    }
}

/// One step of a 4-layer f64 Llama under DDP over 2 ranks (gradients averaged by the
/// post-accumulate-grad hooks while the backward runs) with `policy`: each rank's loss
/// bits and gradient bits by FQN.
fn ddp(policy: &AcPolicy) -> Vec<(u64, Grads)> {
    let cfg = tpar_testing::tiny_llama_config(40, 16, 4, DType::F64);
    let policy = policy.clone();
    spawn_scoped(SpawnConfig::new(2), move |ctx| -> tpar::Result<(u64, Grads)> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
        let mut model = LlamaForPretraining::new(&cfg, Device::Meta)?;
        reset_parameters(&mut model, Device::Cpu, 13)?;
        apply_activation_checkpointing(&mut model, &policy)?;
        let _ddp = DataParallel::new(&mut model, &mesh["dp"])?;
        let (ids, tgt) = batch(4, 8, cfg.vocab_size);
        let r = mesh.local_rank();
        let (ids, tgt) = (ids.narrow(0, 2 * r, 2)?, tgt.narrow(0, 2 * r, 2)?);
        let loss = loss_backward(&model, cfg.vocab_size, (&ids, &tgt), None)?;
        Ok((loss.item()?.to_bits(), grads_of(&model)))
    })
    .unwrap()
}

#[test]
fn ddp_hooks_get_the_gradients_of_checkpointed_layers() {
    let want = ddp(&AcPolicy::None);
    // The two ranks saw different data, and DDP averaged their gradients.
    assert_ne!(want[0].0, want[1].0);
    assert_eq!(want[0].1, want[1].1);
    for p in [AcPolicy::full(), AcPolicy::Full { every: 2 }, AcPolicy::selective()] {
        assert_eq!(ddp(&p), want, "{p}");
    }
}

/// The input and two weights of the small region the split-backward tests run, as fresh
/// leaves.
fn split_leaves() -> (Tensor, Tensor, Tensor) {
    let leaf = |v: Vec<f64>, d: [usize; 2]| Tensor::from_vec(v, d).unwrap().requires_grad_(true);
    (
        leaf(vec![1.0, -2.0, 0.5, 3.0, 0.25, -1.5], [3, 2]),
        leaf(vec![0.5, -1.0, 2.0, 0.25, 1.5, -0.75, 0.1, 0.2], [4, 2]),
        leaf(vec![1.0, 1.5, -0.5, 2.0, 0.3, -0.2, 0.7, 0.9], [2, 4]),
    )
}

/// The output gradient of that region.
fn split_dy() -> Tensor {
    Tensor::from_vec(vec![1.0f64, -0.5, 0.25, 2.0, -1.0, 0.5], [3, 2]).unwrap()
}

/// The bits of the gradients of `x`, `w1` and `w2` through `silu(x w1^T) w2^T` without
/// checkpointing, for the output gradient `dy`: the reference of the split tests.
fn unchecked_grads(x: &Tensor, w1: &Tensor, w2: &Tensor, dy: &Tensor) -> Vec<Vec<u64>> {
    let y = x.linear(w1, None).unwrap().silu().unwrap().linear(w2, None).unwrap();
    y.backward_with(dy).unwrap();
    [x, w1, w2].iter().map(|t| bits(&t.grad().unwrap())).collect()
}

#[test]
fn a_split_backward_defers_the_weight_half_of_a_checkpointed_region() {
    use tpar::tensor::autograd::backward_input;
    let (make, dy) = (split_leaves, split_dy());
    // Without checkpointing: the reference.
    let (x, w1, w2) = make();
    let want = unchecked_grads(&x, &w1, &w2, &dy);
    for keep in [vec![], SaveOp::DEFAULT.to_vec()] {
        let (x, w1, w2) = make();
        let (a, b) = (w1.clone(), w2.clone());
        let f = move |i: &[Tensor]| i[0].linear(&a, None)?.silu()?.linear(&b, None);
        let y = checkpoint(std::slice::from_ref(&x), &keep, f).unwrap();
        reset_recompute_counts();
        let (dx, weights) =
            backward_input(&[y], std::slice::from_ref(&dy), std::slice::from_ref(&x)).unwrap();
        // The input pass recomputed the region once and left the weights for later.
        assert_eq!(recompute_counts().recomputed, 1, "{keep:?}");
        assert!(w1.grad().is_none() && w2.grad().is_none(), "{keep:?}");
        assert_eq!(bits(dx[0].as_ref().unwrap()), want[0], "{keep:?}");
        weights.run().unwrap();
        assert_eq!(recompute_counts().recomputed, 1, "{keep:?}: the weight pass recomputed");
        assert_eq!(bits(&w1.grad().unwrap()), want[1], "{keep:?}");
        assert_eq!(bits(&w2.grad().unwrap()), want[2], "{keep:?}");
    }
}

/// A selective region whose kept outputs a split backward's input pass dropped, asked
/// again for every gradient (its weight half dropped unrun, then a whole backward of the
/// same output), recomputes every op: the forward's gradients, bit for bit.
#[test]
fn a_region_asked_again_after_its_input_pass_recomputes_everything() {
    use tpar::tensor::autograd::backward_input;
    let (make, dy) = (split_leaves, split_dy());
    let (x, w1, w2) = make();
    let want = unchecked_grads(&x, &w1, &w2, &dy);
    let (x, w1, w2) = make();
    let (a, b) = (w1.clone(), w2.clone());
    let f = move |i: &[Tensor]| i[0].linear(&a, None)?.silu()?.linear(&b, None);
    let y = checkpoint(std::slice::from_ref(&x), &[SaveOp::Matmul], f).unwrap();
    let (_, weights) = backward_input(
        std::slice::from_ref(&y),
        std::slice::from_ref(&dy),
        std::slice::from_ref(&x),
    )
    .unwrap();
    drop(weights);
    y.backward_with(&dy).unwrap();
    let got: Vec<Vec<u64>> = [&x, &w1, &w2].iter().map(|t| bits(&t.grad().unwrap())).collect();
    assert_eq!(got, want);
}

/// After a split backward's input pass a selective region holds what a full one holds
/// (the recomputed graph's weight half) until the weight pass: the outputs it kept from
/// the forward, which only the input half read, are freed then, not with the weight pass.
#[test]
fn a_split_backward_frees_the_kept_outputs_after_the_input_pass() {
    use tpar::tensor::autograd::backward_input;
    // The tracking allocator's slot for this test (no rank thread of another test uses it).
    const SLOT: usize = 60;
    let (n, d, f) = (256, 64, 512);
    let fill = |len: usize, s: f64| (0..len).map(|i| ((i % 97) as f64 - 48.0) * s).collect();
    // Bytes live on this thread after the input pass, beyond those before the forward.
    let held_after_input_pass = |keep: &[SaveOp]| {
        let x = Tensor::from_vec(fill(n * d, 1e-2), [n, d]).unwrap().requires_grad_(true);
        let w1 = Tensor::from_vec(fill(f * d, 1e-3), [f, d]).unwrap().requires_grad_(true);
        let w2 = Tensor::from_vec(fill(d * f, 2e-3), [d, f]).unwrap().requires_grad_(true);
        let dy = Tensor::from_vec(fill(n * d, 1e-1), [n, d]).unwrap();
        memory::set_rank(Some(SLOT));
        let before = memory::current(SLOT);
        let (a, b) = (w1.clone(), w2.clone());
        let g = move |i: &[Tensor]| i[0].linear(&a, None)?.silu()?.linear(&b, None);
        let y = checkpoint(std::slice::from_ref(&x), keep, g).unwrap();
        let (dx, weights) =
            backward_input(&[y], std::slice::from_ref(&dy), std::slice::from_ref(&x)).unwrap();
        drop(dx);
        let held = memory::current(SLOT) - before;
        weights.run().unwrap();
        memory::set_rank(None);
        assert!(w1.grad().is_some() && w2.grad().is_some(), "{keep:?}");
        held
    };
    let full = held_after_input_pass(&[]);
    let selective = held_after_input_pass(&[SaveOp::Matmul]);
    // The first product's output alone is `n f` f64s (1 MiB), kept by the selective forward.
    let kept = (n * f * 8) as i64;
    assert!(full > kept, "the weight half holds {full} B");
    assert!(
        selective < full + kept / 8,
        "after the input pass a selective region holds {selective} B, a full one {full} B"
    );
}

/// Under [`WeightPass::Recompute`] a split backward's input pass drops the recomputed
/// graph (a full region then holds nothing of it until the weight pass, a selective one
/// only what its forward kept) and the weight pass recomputes the region: the gradients
/// of the region without checkpointing, bit for bit, from two recomputes.
#[test]
fn the_weight_pass_can_recompute_a_region_instead_of_holding_its_weight_half() {
    use tpar::tensor::autograd::backward_input;
    use tpar::tensor::checkpoint::set_weight_pass;
    // The tracking allocator's slot for this test (no rank thread of another test uses it).
    const SLOT: usize = 61;
    let (n, d, f) = (256, 64, 512);
    let fill = |len: usize, s: f64| (0..len).map(|i| ((i % 97) as f64 - 48.0) * s).collect();
    let leaves = || {
        let leaf =
            |v: Vec<f64>, dims: [usize; 2]| Tensor::from_vec(v, dims).unwrap().requires_grad_(true);
        (
            leaf(fill(n * d, 1e-2), [n, d]),
            leaf(fill(f * d, 1e-3), [f, d]),
            leaf(fill(d * f, 2e-3), [d, f]),
        )
    };
    let dy = Tensor::from_vec(fill(n * d, 1e-1), [n, d]).unwrap();
    let (x, w1, w2) = leaves();
    let want = unchecked_grads(&x, &w1, &w2, &dy);
    // Bytes live on this thread after the input pass beyond those before the forward, the
    // regions recomputed, and the gradients.
    let split = |keep: &[SaveOp], mode: WeightPass| {
        let (x, w1, w2) = leaves();
        memory::set_rank(Some(SLOT));
        let before = memory::current(SLOT);
        let (a, b) = (w1.clone(), w2.clone());
        let g = move |i: &[Tensor]| i[0].linear(&a, None)?.silu()?.linear(&b, None);
        let y = checkpoint(std::slice::from_ref(&x), keep, g).unwrap();
        reset_recompute_counts();
        let was = set_weight_pass(mode);
        let (dx, weights) =
            backward_input(&[y], std::slice::from_ref(&dy), std::slice::from_ref(&x)).unwrap();
        set_weight_pass(was);
        let dx_bits = bits(dx[0].as_ref().unwrap());
        drop(dx);
        // Less the bits just taken.
        let held = memory::current(SLOT) - before - (dx_bits.capacity() * 8) as i64;
        assert!(w1.grad().is_none() && w2.grad().is_none(), "{keep:?} {mode}");
        weights.run().unwrap();
        memory::set_rank(None);
        let got = vec![dx_bits, bits(&w1.grad().unwrap()), bits(&w2.grad().unwrap())];
        assert_eq!(got, want, "{keep:?} {mode}");
        assert!(x.grad().is_none(), "{keep:?} {mode}: the weight pass reached the input");
        (held, recompute_counts().recomputed)
    };
    // The first product's output alone is `n f` f64s (1 MiB).
    let big = (n * f * 8) as i64;
    for keep in [vec![], vec![SaveOp::Matmul]] {
        let (kept, once) = split(&keep, WeightPass::Keep);
        let (dropped, twice) = split(&keep, WeightPass::Recompute);
        assert_eq!((once, twice), (1, 2), "{keep:?}");
        assert!(kept > big, "{keep:?}: the weight half holds {kept} B");
        // What the forward kept: nothing (full), both products' outputs (selective).
        let forward_kept = if keep.is_empty() { 0 } else { big + (n * d * 8) as i64 };
        assert!(
            dropped < forward_kept + big / 8,
            "{keep:?}: after the input pass the region holds {dropped} B (kept {forward_kept} B)"
        );
    }
}

/// The `key=value` of an example's summary line.
fn summary_key(out: &str, k: &str) -> String {
    let line = out.lines().find(|l| l.starts_with("summary:")).expect("a summary line");
    let pre = format!(" {k}=");
    let at = line.find(&pre).unwrap_or_else(|| panic!("{k} in {line}"));
    line[at + pre.len()..].split_whitespace().next().unwrap().to_string()
}

#[test]
fn the_trainers_ac_flag_keeps_the_losses_and_names_the_policy() {
    use common::examples::run_example;
    for (example, base) in [
        ("llama_2d", &["--steps", "3", "--seq", "16", "--layers", "2", "--log-every", "1"][..]),
        ("llama_pp", &["--steps", "3", "--seq", "16", "--log-every", "1"][..]),
    ] {
        let mut want = None;
        for ac in ["none", "full", "full:2", "selective", "selective[matmul/2,sdpa]:2"] {
            let args = [base, &["--ac", ac][..]].concat();
            let Some((code, out, err)) = run_example(example, &args) else { return };
            assert_eq!(code, 0, "{example} {args:?}\n{out}\n{err}");
            assert_eq!(summary_key(&out, "ac"), ac, "{example}");
            let bits = summary_key(&out, "final_loss_bits");
            let first = summary_key(&out, "first_loss");
            match &want {
                None => want = Some((bits, first)),
                Some(w) => assert_eq!(&(bits, first), w, "{example} --ac {ac}"),
            }
        }
        let (code, _, err) =
            run_example(example, &[base, &["--ac", "full:0"][..]].concat()).unwrap();
        assert_eq!(code, 2, "{example}: {err}");
        assert!(err.contains("full:0") && err.contains("at least 1"), "{example}: {err}");
    }
}

/// `llama_pp --ac-weight-pass recompute` trains the zero-bubble pipeline over FSDP (pp 2 x
/// dp 2) to the losses of `keep` and of no checkpointing, bit for bit, names the mode in
/// its summary, and refuses a mode it does not know.
#[test]
fn the_pipeline_trainers_weight_pass_flag_keeps_the_losses() {
    use common::examples::run_example;
    let base = ["--steps", "2", "--seq", "16", "--log-every", "1", "--schedule", "zb"];
    let base = [&base[..], &["--pp", "2", "--dp", "2"]].concat();
    let mut want = None;
    for (ac, wp) in
        [("none", "keep"), ("full", "keep"), ("full", "recompute"), ("selective", "recompute")]
    {
        let args = [&base[..], &["--ac", ac, "--ac-weight-pass", wp]].concat();
        let Some((code, out, err)) = run_example("llama_pp", &args) else { return };
        assert_eq!(code, 0, "{args:?}\n{out}\n{err}");
        assert_eq!(summary_key(&out, "ac_weight_pass"), wp);
        let got = (summary_key(&out, "final_loss_bits"), summary_key(&out, "first_loss"));
        match &want {
            None => want = Some(got),
            Some(w) => assert_eq!(&got, w, "--ac {ac} --ac-weight-pass {wp}"),
        }
    }
    let args = [&base[..], &["--ac", "full", "--ac-weight-pass", "later"]].concat();
    let (code, _, err) = run_example("llama_pp", &args).unwrap();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("later") && err.contains("keep or recompute"), "{err}");
    let auto = [&base[..], &["--ac", "auto", "--memory-budget", "1", "--ac-weight-pass", "keep"]];
    let (code, _, err) = run_example("llama_pp", &auto.concat()).unwrap();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--ac auto chooses the weight pass"), "{err}");
}

/// `llama_pp --ac auto` under zero-bubble picks the weight pass with the policy and trains
/// with it: at 92 MiB no policy fits a stage that keeps its recomputed graphs (full
/// checkpointing is predicted 175 MiB on stage 1), one recomputing them does (full, 83
/// MiB), and the summary names it.
#[test]
fn the_pipeline_trainers_auto_policy_picks_the_weight_pass() {
    use common::examples::run_example;
    let args = [
        "--pp",
        "2",
        "--layers",
        "4",
        "--seq",
        "4096",
        "--microbatches",
        "2",
        "--batch",
        "4",
        "--schedule",
        "zb",
        "--steps",
        "1",
        "--ac",
        "auto",
        "--memory-budget",
        "0.09",
    ];
    let Some((code, out, err)) = run_example("llama_pp", &args) else { return };
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("with the weight pass recomputing"), "{out}");
    assert_eq!(summary_key(&out, "ac_weight_pass"), "recompute", "{out}");
    let predicted: f64 = summary_key(&out, "predicted_peak_mib").parse().unwrap();
    assert!(predicted <= 0.09 * 1024.0, "{out}");
}
