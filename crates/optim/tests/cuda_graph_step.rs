//! A whole training step (forward, loss, backward, clipping, capturable AdamW) captured
//! once as a CUDA graph on the emulated device and replayed: the eager steps' bits,
//! step for step, through a batch of another shape (run eagerly, then the replays go
//! on), and close to the same training in f64 on the host; with dropout in the step,
//! each replay draws the mask the eager step drew.

use tpar_nn::Param;
use tpar_optim::{clip_grad_norm_, AdamW, AdamWConfig, ClipOptions, Optimizer};
use tpar_tensor::gpu::{self, EmulatedGpu, GraphedStep, StepMode};
use tpar_tensor::{DType, Device, Rng, Tensor};

const DEV: Device = Device::Cuda(0);

/// Registers the emulated `cuda:0` and serializes the tests: a capture records all of the
/// device's work, so two tests must not share it at once.
fn setup() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = ONE.lock().unwrap_or_else(|p| p.into_inner());
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
    guard
}

/// Two weight matrices (`[6, 8]`, `[8, 3]`) as leaves on `device` in `dtype`.
fn weights(device: Device, dtype: DType) -> Vec<Tensor> {
    let mut rng = Rng::new(5);
    [[6usize, 8], [8, 3]]
        .iter()
        .map(|d| {
            let w = Tensor::randn(&d[..], DType::F64, &mut rng).unwrap().mul_scalar(0.4).unwrap();
            w.to_dtype(dtype).unwrap().to_device(device).unwrap().requires_grad_(true)
        })
        .collect()
}

/// Step `i`'s batch on the host: `rows` inputs `[rows, 6]` and targets `[rows, 3]`.
fn batch(i: u64, rows: usize, dtype: DType) -> [Tensor; 2] {
    let mut rng = Rng::new(100 + i);
    let x = Tensor::randn([rows, 6], DType::F64, &mut rng).unwrap();
    let t = Tensor::randn([rows, 3], DType::F64, &mut rng).unwrap();
    [x.to_dtype(dtype).unwrap(), t.to_dtype(dtype).unwrap()]
}

/// The step: `loss = sum((dropout(x W1, p) W2 - t)^2) / rows`, backward, clip to norm
/// 1, AdamW. Returns the loss and the gradient norm (tensors, on the weights' device).
fn step(opt: &mut AdamW, ws: &[Tensor], d: &[Tensor], p: f64) -> tpar_nn::Result<(Tensor, Tensor)> {
    let rows = d[0].dims()[0] as f64;
    // [rows, 6] @ [6, 8] @ [8, 3] -> [rows, 3]
    let y = d[0].matmul(&ws[0])?.dropout(p, true)?.matmul(&ws[1])?;
    let e = y.sub(&d[1])?;
    let loss = e.mul(&e)?.sum_all()?.mul_scalar(1.0 / rows)?;
    loss.backward()?;
    let params: Vec<Param> = ws.iter().map(|w| Param::Tensor(w.clone())).collect();
    let norm = clip_grad_norm_(&params[..], 1.0, &ClipOptions::default())?;
    opt.step()?;
    opt.zero_grad();
    Ok((loss.detach(), norm))
}

fn adamw(ws: &[Tensor]) -> AdamW {
    let params = ws.iter().map(|w| Param::Tensor(w.clone())).collect();
    AdamW::new(params, AdamWConfig { lr: 2e-2, weight_decay: 0.1, ..Default::default() }).unwrap()
}

/// Rows per step: step 4 has a batch of another shape.
const ROWS: [usize; 7] = [4, 4, 4, 3, 4, 4, 4];

/// A learning rate that changes every step (the schedule a replay must follow).
fn lr(i: usize) -> f64 {
    2e-2 / (1.0 + i as f64)
}

/// Eager training on `device` in `dtype` with dropout `p`: per-step (loss, norm) and the
/// final weights.
fn eager(device: Device, dtype: DType, p: f64) -> (Vec<(f64, f64)>, Vec<Vec<f64>>) {
    let ws = weights(device, dtype);
    let mut opt = adamw(&ws);
    let mut out = Vec::new();
    for (i, &rows) in ROWS.iter().enumerate() {
        opt.set_lr(lr(i));
        let b = batch(i as u64, rows, dtype);
        let d = [b[0].to_device(device).unwrap(), b[1].to_device(device).unwrap()];
        let (l, n) = step(&mut opt, &ws, &d, p).unwrap();
        out.push((l.item().unwrap(), n.item().unwrap()));
    }
    (out, ws.iter().map(|w| w.to_vec_f64().unwrap()).collect())
}

/// What [`graphed`] trained: per-step (loss, norm), how each step ran, the final weights
/// and the generator words a replay draws.
struct Graphed {
    steps: Vec<(f64, f64)>,
    modes: Vec<StepMode>,
    weights: Vec<Vec<f64>>,
    words: u64,
}

/// The training of [`eager`] on the emulated device in f32 through a `GraphedStep` (one
/// warm-up step, capturable AdamW).
fn graphed(p: f64) -> Graphed {
    let ws = weights(DEV, DType::F32);
    let mut opt = adamw(&ws);
    opt.set_capturable(true);
    let mut graphed = GraphedStep::<(Tensor, Tensor)>::new(0, 1);
    let (mut steps, mut modes) = (Vec::new(), Vec::new());
    for (i, &rows) in ROWS.iter().enumerate() {
        opt.set_lr(lr(i));
        let b = batch(i as u64, rows, DType::F32);
        let ((l, n), mode) = graphed
            .run(&mut opt, &b, |opt, d| step(opt, &ws, d, p), |opt| opt.prepare_replay())
            .unwrap();
        steps.push((l.item().unwrap(), n.item().unwrap()));
        modes.push(mode);
    }
    let words = graphed.graph().unwrap().random_words();
    Graphed { steps, modes, weights: ws.iter().map(|w| w.to_vec_f64().unwrap()).collect(), words }
}

/// Every step's loss and gradient norm the same bits as the eager run's.
fn assert_eager_bits(got: &[(f64, f64)], want: &[(f64, f64)]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.0.to_bits(), w.0.to_bits(), "step {}: loss {} vs eager {}", i + 1, g.0, w.0);
        assert_eq!(g.1.to_bits(), w.1.to_bits(), "step {}: norm {} vs eager {}", i + 1, g.1, w.1);
    }
}

#[test]
fn a_captured_step_replays_the_eager_steps_bits() {
    let _one = setup();
    let (want, want_w) = eager(DEV, DType::F32, 0.0);
    let Graphed { steps: got, modes, weights: got_w, words } = graphed(0.0);
    use StepMode::*;
    assert_eq!(modes, [Warmup, Captured, Replayed, Fallback, Replayed, Replayed, Replayed]);
    assert_eager_bits(&got, &want);
    assert_eq!(got_w, want_w, "final weights");
    assert_eq!(words, 0, "nothing random");
    // The same training in f64 on the host: close (f32 rounding only).
    let (host, host_w) = eager(Device::Cpu, DType::F64, 0.0);
    for (i, (g, h)) in got.iter().zip(&host).enumerate() {
        assert!((g.0 - h.0).abs() <= 1e-4 * h.0.abs().max(1.0), "step {}: {g:?} vs {h:?}", i + 1);
    }
    for (g, h) in got_w.iter().flatten().zip(host_w.iter().flatten()) {
        assert!((g - h).abs() <= 1e-4, "weight {g} vs f64 {h}");
    }
    // The weights moved.
    let start: Vec<f64> = weights(Device::Cpu, DType::F64)[0].to_vec_f64().unwrap();
    assert_ne!(got_w[0], start);
}

/// Dropout in the captured step: every replay draws the mask the eager step in its place
/// drew (the generator's state written to the device before the replay), so losses, norms
/// and weights are the eager run's bits, and the generator ends where the eager run's
/// does.
#[test]
fn a_captured_step_with_dropout_draws_the_eager_steps_masks() {
    use tpar_tensor::{get_rng_state, manual_seed};
    let _one = setup();
    manual_seed(7);
    let (want, want_w) = eager(DEV, DType::F32, 0.25);
    let want_rng = get_rng_state();
    manual_seed(7);
    let Graphed { steps: got, weights: got_w, words, .. } = graphed(0.25);
    assert_eq!(words, 32, "one [4, 8] mask a step");
    assert_eager_bits(&got, &want);
    assert_eq!(got_w, want_w, "final weights");
    assert_eq!(get_rng_state(), want_rng, "the generator");
    // The masks differ from step to step: without dropout the same steps give other losses.
    let (plain, _) = eager(DEV, DType::F32, 0.0);
    assert!(got.iter().zip(&plain).filter(|(g, p)| g.0 != p.0).count() >= 5);
}

#[test]
fn capturing_before_any_eager_step_is_an_error() {
    let _one = setup();
    let ws = weights(DEV, DType::F32);
    let mut opt = adamw(&ws);
    opt.set_capturable(true);
    let b = batch(0, 4, DType::F32);
    let d = [b[0].to_device(DEV).unwrap(), b[1].to_device(DEV).unwrap()];
    // Forward, backward and the optimizer step, captured with no eager step before.
    let r = gpu::capture_graph(0, || -> tpar_nn::Result<()> {
        let e = d[0].matmul(&ws[0])?.matmul(&ws[1])?.sub(&d[1])?;
        e.mul(&e)?.sum_all()?.backward()?;
        opt.step()
    });
    let e = r.expect_err("no state to capture").to_string();
    assert!(e.contains("eager step"), "{e}");
    assert!(!gpu::is_capturing(0));
    // Without a captured step there is nothing to replay.
    let e = opt.prepare_replay().unwrap_err().to_string();
    assert!(e.contains("no captured step"), "{e}");
}

#[test]
fn a_host_read_inside_the_captured_step_is_an_error() {
    let _one = setup();
    let ws = weights(DEV, DType::F32);
    let mut opt = adamw(&ws);
    opt.set_capturable(true);
    let mut graphed = GraphedStep::<(Tensor, Tensor)>::new(0, 1);
    for i in 0..2 {
        let b = batch(i, 4, DType::F32);
        let r = graphed.run(
            &mut opt,
            &b,
            |opt, d| {
                let out = step(opt, &ws, d, 0.0)?;
                // Reading the loss inside the step: fine eagerly, refused under capture.
                out.0.item()?;
                Ok(out)
            },
            |opt| opt.prepare_replay(),
        );
        if i == 0 {
            r.unwrap();
        } else {
            let e = r.expect_err("a read-back under capture").to_string();
            assert!(e.contains("device-to-host") && e.contains("inside capture"), "{e}");
        }
    }
    assert!(!gpu::is_capturing(0));
}
