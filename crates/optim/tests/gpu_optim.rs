//! Optimizers and gradient clipping on parameters on the emulated CUDA
//! device: the same steps as on the CPU, updated in place on the device.

use tpar_nn::Param;
use tpar_optim::{clip_grad_norm_, AdamW, AdamWConfig, ClipOptions, Optimizer, Sgd, SgdConfig};
use tpar_tensor::gpu::EmulatedGpu;
use tpar_tensor::{gpu, tol::Tol, AdamWParams, DType, Device, Rng, Tensor};

const DEV: Device = Device::Cuda(0);

/// `clip_grad_norm_` with the default options, the norm read back.
fn clip(params: &[Param], max_norm: f64) -> Result<f64, tpar_nn::NnError> {
    Ok(clip_grad_norm_(params, max_norm, &ClipOptions::default())?.item()?)
}

fn setup() {
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2,
    }
}

/// One ulp at `x`'s magnitude in a half dtype (bf16 keeps 8 significant bits, f16 11).
fn half_ulp(dtype: DType, x: f64) -> f64 {
    let bits = if dtype == DType::BF16 { 8 } else { 11 };
    2f64.powi(x.abs().max(f64::MIN_POSITIVE).log2().floor() as i32 + 1 - bits)
}

/// Parameters after an optimizer step, device against host. Half dtypes: within one ulp
/// of the element itself (both sides compute in f32 and round once), which for the
/// parameters here (|w| < 2) is below one AdamW step (`lr` = 1e-2 per element on the
/// first step), so a skipped or repeated step fails; a tolerance relative to the largest
/// element (as [`tol`]) would not see it. f32: [`tol`].
fn assert_step_close(what: &str, dtype: DType, got: &Tensor, want: &Tensor) {
    if dtype == DType::F32 {
        return assert_close(what, got, want, tol(dtype));
    }
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (a, b) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let ulp = half_ulp(dtype, x.abs().max(y.abs()));
        assert!((x - y).abs() <= ulp, "{what}: element {i}: device {x} vs host {y}");
    }
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (a, b) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let scale = b.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= tol * scale, "{what}: element {i}: device {x} vs host {y}");
    }
}

/// Host parameters and device copies of them (separate leaves).
fn params(dtype: DType, rng: &mut Rng) -> (Vec<Tensor>, Vec<Tensor>) {
    let host: Vec<Tensor> = [&[3usize, 5][..], &[7], &[2, 2, 4]]
        .iter()
        .map(|d| {
            Tensor::randn(*d, dtype, rng).unwrap().mul_scalar(0.5).unwrap().requires_grad_(true)
        })
        .collect();
    let dev =
        host.iter().map(|t| t.detach().to_device(DEV).unwrap().requires_grad_(true)).collect();
    (host, dev)
}

/// Gives both sets of leaves the same random gradients (`grad_dtype`, or the leaf's). The
/// values are representable in the leaf's dtype, so a host step that first casts an f32
/// gradient to a half leaf's dtype sees the same values as the device step reading it in
/// f32, and the two can be compared to one ulp.
fn set_grads(host: &[Tensor], dev: &[Tensor], grad_dtype: Option<DType>, rng: &mut Rng) {
    for (h, d) in host.iter().zip(dev) {
        let g = Tensor::randn(h.shape().clone(), h.dtype(), rng).unwrap();
        let g = g.to_dtype(grad_dtype.unwrap_or(h.dtype())).unwrap();
        d.set_grad(Some(g.to_device(DEV).unwrap()));
        h.set_grad(Some(g));
    }
}

fn wrap(ts: &[Tensor]) -> Vec<Param> {
    ts.iter().map(|t| Param::Tensor(t.clone())).collect()
}

#[test]
fn adamw_steps_on_the_device_as_on_the_host() {
    setup();
    let mut rng = Rng::new(11);
    let config = AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() };
    for (dtype, grad_dtype) in [
        (DType::F32, None),
        (DType::BF16, None),
        (DType::F16, None),
        (DType::BF16, Some(DType::F32)),
    ] {
        let (host, dev) = params(dtype, &mut rng);
        let mut opt_h = AdamW::new(wrap(&host), config).unwrap();
        let mut opt_d = AdamW::new(wrap(&dev), config).unwrap();
        for step in 0..3 {
            set_grads(&host, &dev, grad_dtype, &mut rng);
            opt_h.step().unwrap();
            let before = gpu::host_round_trips();
            opt_d.step().unwrap();
            assert_eq!(gpu::host_round_trips(), before, "AdamW step must stay on the device");
            for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
                assert_eq!(d.device(), DEV);
                let what = format!("{dtype:?} grads {grad_dtype:?} step {step} param {i}");
                assert_step_close(&what, dtype, d, h);
                let top = h.to_vec_f64().unwrap().iter().fold(0f64, |m, v| m.max(v.abs()));
                if dtype != DType::F32 {
                    assert!(
                        half_ulp(dtype, top) < config.lr,
                        "{what}: an ulp at {top} hides a step"
                    );
                }
            }
            opt_h.zero_grad();
            opt_d.zero_grad();
        }
        assert_eq!(opt_d.state_bytes(), opt_h.state_bytes());
        let (sh, sd) = (opt_h.state(0).unwrap().unwrap(), opt_d.state(0).unwrap().unwrap());
        assert_eq!(sd.step, 3);
        assert_eq!(sd.exp_avg.device(), DEV);
        // Moments are f32 for every parameter dtype: the f32 tolerance, not one for all.
        let mtol = Tol::for_dtype(sh.exp_avg.dtype());
        mtol.check_tensors(&format!("{dtype:?} exp_avg"), &sd.exp_avg, &sh.exp_avg).unwrap();
        mtol.check_tensors(&format!("{dtype:?} exp_avg_sq"), &sd.exp_avg_sq, &sh.exp_avg_sq)
            .unwrap();
    }
}

/// More parameters than one multi-tensor launch takes, of every dtype (half ones with
/// f32 gradients too) interleaved, and of two step numbers (every fourth parameter has
/// no gradient at the first step, so it lags one step behind): the same steps as on
/// the host.
#[test]
fn adamw_over_many_mixed_parameters_on_the_device_as_on_the_host() {
    setup();
    let mut rng = Rng::new(16);
    let config = AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() };
    let kinds = [
        (DType::F32, None),
        (DType::BF16, None),
        (DType::BF16, Some(DType::F32)),
        (DType::F16, None),
        (DType::F16, Some(DType::F32)),
    ];
    let (mut host, mut dev) = (Vec::new(), Vec::new());
    for i in 0..40usize {
        let n = if i == 5 { 16385 } else { 1 + 97 * i };
        let h = Tensor::randn([n], kinds[i % 5].0, &mut rng).unwrap().mul_scalar(0.5).unwrap();
        dev.push(h.to_device(DEV).unwrap().requires_grad_(true));
        host.push(h.requires_grad_(true));
    }
    let mut opt_h = AdamW::new(wrap(&host), config).unwrap();
    let mut opt_d = AdamW::new(wrap(&dev), config).unwrap();
    for step in 0..3 {
        for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
            set_grads(std::slice::from_ref(h), std::slice::from_ref(d), kinds[i % 5].1, &mut rng);
            if step == 0 && i % 4 == 3 {
                h.set_grad(None);
                d.set_grad(None);
            }
        }
        opt_h.step().unwrap();
        let before = gpu::host_round_trips();
        opt_d.step().unwrap();
        assert_eq!(gpu::host_round_trips(), before, "AdamW step must stay on the device");
        for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
            let what = format!("{:?} step {step} param {i}", kinds[i % 5]);
            assert_step_close(&what, h.dtype(), d, h);
            let (sh, sd) = (opt_h.state(i).unwrap(), opt_d.state(i).unwrap());
            assert_eq!(sd.map(|s| s.step), sh.map(|s| s.step), "{what}: steps taken");
        }
        opt_h.zero_grad();
        opt_d.zero_grad();
    }
}

/// `Tensor::adamw_step_each_` refuses lists of different lengths and an updated buffer
/// shared by two parameters, before changing anything.
#[test]
fn adamw_step_each_refuses_bad_lists_before_any_update() {
    setup();
    let mut rng = Rng::new(17);
    let (_, dev) = params(DType::F32, &mut rng);
    let zeros = |t: &Tensor| Tensor::zeros(t.dims(), DType::F32, DEV).unwrap();
    let grads: Vec<Tensor> = dev
        .iter()
        .map(|t| Tensor::randn(t.dims(), DType::F32, &mut rng).unwrap().to_device(DEV).unwrap())
        .collect();
    let (m, v): (Vec<Tensor>, Vec<Tensor>) = dev.iter().map(|t| (zeros(t), zeros(t))).unzip();
    let before: Vec<Vec<f64>> = dev.iter().map(|t| t.to_vec_f64().unwrap()).collect();
    let h =
        AdamWParams { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step: 1 };
    fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
        ts.iter().collect()
    }
    let (p, g, m, v) = (refs(&dev), refs(&grads), refs(&m), refs(&v));
    let short = Tensor::adamw_step_each_(&p, &g[..2], &m, &v, &h);
    assert!(short.is_err(), "two gradients for three parameters were accepted");
    // The last parameter's first moment is the second one's too.
    let mut shared = m.clone();
    shared[2] = m[1];
    let (p2, g2) = (vec![p[1], p[1]], vec![g[1], g[1]]);
    assert!(Tensor::adamw_step_each_(&p, &g, &shared, &v, &h).is_err(), "a shared moment");
    // One parameter is another's gradient: read and updated in the same call.
    let four = || Tensor::zeros([4], DType::F32, DEV).unwrap();
    let (a, b, gb, m4, v4) = (four(), four(), four(), [four(), four()], [four(), four()]);
    let e = Tensor::adamw_step_each_(&[&a, &b], &[&b, &gb], &refs(&m4), &refs(&v4), &h);
    assert!(e.is_err(), "a parameter read as another's gradient was accepted");
    assert!(Tensor::adamw_step_each_(&p2, &g2, &m[..2], &v[..2], &h).is_err(), "a parameter twice");
    for (t, b) in dev.iter().zip(&before) {
        assert_eq!(&t.to_vec_f64().unwrap(), b, "a refused step changed a parameter");
    }
    Tensor::adamw_step_each_(&p, &g, &m, &v, &h).unwrap();
    assert_ne!(dev[0].to_vec_f64().unwrap(), before[0], "the step changed nothing");
}

#[test]
fn adamw_state_moves_with_set_state() {
    setup();
    let mut rng = Rng::new(12);
    let (host, dev) = params(DType::F32, &mut rng);
    let config = AdamWConfig::default();
    let mut opt_h = AdamW::new(wrap(&host), config).unwrap();
    let mut opt_d = AdamW::new(wrap(&dev), config).unwrap();
    set_grads(&host, &dev, None, &mut rng);
    opt_h.step().unwrap();
    // host state loaded into the device optimizer (as from a checkpoint)
    for i in 0..host.len() {
        opt_d.set_state(i, opt_h.state(i).unwrap().unwrap()).unwrap();
        dev[i].copy_(&host[i]).unwrap();
    }
    set_grads(&host, &dev, None, &mut rng);
    opt_h.step().unwrap();
    opt_d.step().unwrap();
    for (h, d) in host.iter().zip(&dev) {
        assert_close("after set_state", d, h, 1e-5);
    }
}

#[test]
fn sgd_steps_on_the_device_as_on_the_host() {
    setup();
    let mut rng = Rng::new(13);
    let configs = [
        SgdConfig { lr: 0.1, ..Default::default() },
        SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 0.01, nesterov: false },
        SgdConfig { lr: 0.05, momentum: 0.8, dampening: 0.0, weight_decay: 0.0, nesterov: true },
    ];
    for dtype in [DType::F32, DType::BF16] {
        for config in configs {
            let (host, dev) = params(dtype, &mut rng);
            let mut opt_h = Sgd::new(wrap(&host), config).unwrap();
            let mut opt_d = Sgd::new(wrap(&dev), config).unwrap();
            for step in 0..3 {
                set_grads(&host, &dev, None, &mut rng);
                opt_h.step().unwrap();
                let before = gpu::host_round_trips();
                opt_d.step().unwrap();
                assert_eq!(gpu::host_round_trips(), before, "SGD step must stay on the device");
                for (h, d) in host.iter().zip(&dev) {
                    assert_step_close(&format!("{dtype:?} {config:?} step {step}"), dtype, d, h);
                }
                opt_h.zero_grad();
                opt_d.zero_grad();
            }
            match (opt_h.momentum_buffer(1).unwrap(), opt_d.momentum_buffer(1).unwrap()) {
                (Some(h), Some(d)) => assert_close("momentum buffer", &d, &h, 1e-4),
                (None, None) => assert_eq!(config.momentum, 0.0),
                _ => panic!("momentum buffers differ in presence"),
            }
        }
    }
}

#[test]
fn clip_grad_norm_on_the_device_as_on_the_host() {
    setup();
    let mut rng = Rng::new(14);
    for dtype in [DType::F32, DType::BF16] {
        for max_norm in [1e6, 0.5] {
            let (host, dev) = params(dtype, &mut rng);
            set_grads(&host, &dev, None, &mut rng);
            let want = clip(&wrap(&host), max_norm).unwrap();
            let before = gpu::host_round_trips();
            let got = clip(&wrap(&dev), max_norm).unwrap();
            if max_norm > want {
                // nothing to scale: the only host read is the norm itself
                assert_eq!(gpu::host_round_trips(), before + 1);
            }
            assert!((got - want).abs() <= 1e-5 * want, "{dtype:?}: norm {got} vs {want}");
            for (h, d) in host.iter().zip(&dev) {
                let (gh, gd) = (h.grad().unwrap(), d.grad().unwrap());
                assert_eq!(gd.device(), DEV);
                assert_close(&format!("{dtype:?} clipped grad"), &gd, &gh, tol(dtype));
            }
        }
    }
}

/// More gradients than one multi-tensor launch takes (32), f32 and bf16 interleaved (so
/// the device folds and scales them in several runs), sizes from 1 to past one
/// 16384-element chunk: the norm and every clipped gradient as on the host.
#[test]
fn clip_grad_norm_over_many_mixed_gradients_on_the_device_as_on_the_host() {
    setup();
    let mut rng = Rng::new(15);
    let (mut host, mut dev) = (Vec::new(), Vec::new());
    for i in 0..40usize {
        let dtype = if i % 3 == 2 { DType::BF16 } else { DType::F32 };
        let n = if i == 5 { 16385 } else { 1 + 97 * i };
        let h = Tensor::randn([n], dtype, &mut rng).unwrap().requires_grad_(true);
        dev.push(h.detach().to_device(DEV).unwrap().requires_grad_(true));
        host.push(h);
    }
    set_grads(&host, &dev, None, &mut rng);
    let want = clip(&wrap(&host), 0.5).unwrap();
    let got = clip(&wrap(&dev), 0.5).unwrap();
    assert!((got - want).abs() <= 1e-5 * want, "norm {got} vs {want}");
    for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
        let (gh, gd) = (h.grad().unwrap(), d.grad().unwrap());
        assert_eq!(gd.device(), DEV);
        assert_close(&format!("gradient {i} ({:?})", h.dtype()), &gd, &gh, tol(h.dtype()));
    }
}

/// `clip_grad_norm_` scales the gradients in place, as torch's `mul_`: `.grad()` handles
/// taken before the call see the clipped values, on the host and on the emulated device
/// (f32 and bf16). Three leaves share one gradient storage (two given the same tensor, as
/// the backward of `p1 + p2` gives it, one a reshape of it): its norm counts three times
/// and each is scaled once, the bits of `g * coef` computed apart. On the device the
/// clipping allocates no second set of gradients: its peak above what was in use stays
/// under a tenth of the gradients' bytes (scaling into new tensors needs all of them).
/// The device is ordinal 7, which no other test of this binary uses, so the counters see
/// this test alone.
#[test]
fn clip_grad_norm_scales_in_place_each_storage_once() {
    const ORD: usize = 7;
    gpu::register_device(ORD, EmulatedGpu::open(ORD).expect("emulator"));
    let max_norm = 0.25;
    for device in [Device::Cpu, Device::Cuda(ORD)] {
        for dtype in [DType::F32, DType::BF16] {
            let mut rng = Rng::new(19);
            let leaf =
                |dims: &[usize]| Tensor::zeros(dims, dtype, device).unwrap().requires_grad_(true);
            let (p1, p2, p3) = (leaf(&[64, 40]), leaf(&[64, 40]), leaf(&[2560]));
            let shared = Tensor::randn([64, 40], dtype, &mut rng).unwrap();
            let own: Vec<Tensor> =
                (0..5).map(|_| Tensor::randn([96, 64], dtype, &mut rng).unwrap()).collect();
            let others: Vec<Tensor> = own.iter().map(|_| leaf(&[96, 64])).collect();
            // A copy of its own on `device` (on the host `to_device` would share `t`'s).
            let on = |t: &Tensor| {
                let copy = Tensor::from_f64(&t.to_vec_f64().unwrap(), t.dims(), dtype).unwrap();
                copy.to_device(device).unwrap()
            };
            let g = on(&shared);
            p1.set_grad(Some(g.clone()));
            p2.set_grad(Some(g.clone()));
            p3.set_grad(Some(g.reshape([2560]).unwrap()));
            for (o, gv) in others.iter().zip(&own) {
                o.set_grad(Some(on(gv)));
            }
            let held: Vec<Tensor> = others.iter().map(|o| o.grad().unwrap()).collect();
            let mut leaves = vec![p1.clone(), p2.clone(), p3.clone()];
            leaves.extend(others.iter().cloned());
            // The expected norm and scaling, from the values alone.
            let sq = |t: &Tensor| t.to_vec_f64().unwrap().iter().map(|v| v * v).sum::<f64>();
            let want = (3.0 * sq(&shared) + own.iter().map(sq).sum::<f64>()).sqrt();
            let coef = max_norm / (want + 1e-6);
            assert!(coef < 0.1, "{device:?} {dtype:?}: the case must clip ({coef})");
            let in_use = tpar_kernels::cuda::device_bytes_in_use(ORD);
            tpar_kernels::cuda::reset_device_peak(ORD);
            let got = clip(&wrap(&leaves), max_norm).unwrap();
            let rise = tpar_kernels::cuda::device_peak_bytes(ORD) - in_use;
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "{device:?} {dtype:?}: norm {got} vs {want}"
            );
            let grad_bytes =
                (shared.nbytes() + own.iter().map(Tensor::nbytes).sum::<usize>()) as u64;
            if device != Device::Cpu {
                assert!(rise * 10 < grad_bytes, "{dtype:?}: clipping took {rise} B above {in_use} B for {grad_bytes} B of gradients");
            }
            // The coefficient from the norm clipping found: in f64 times the gradient on
            // the host, in f32 rounded to the gradient's dtype on the device.
            let scaled = |t: &Tensor| {
                if device == Device::Cpu {
                    return bits(&t.mul_scalar(max_norm / (got + 1e-6)).unwrap());
                }
                let c = (max_norm as f32 / (got as f32 + 1e-6)).min(1.0) as f64;
                bits(&t.mul(&Tensor::scalar(c, DType::F32).to_dtype(dtype).unwrap()).unwrap())
            };
            let what = format!("{device:?} {dtype:?}");
            let same = |what: String, got: &Tensor, want: &[u64]| {
                let got = bits(got);
                let first = got.iter().zip(want).position(|(a, b)| a != b);
                assert!(
                    first.is_none(),
                    "{what}: element {first:?} of {} differs: {:?} vs {:?}",
                    want.len(),
                    first.map(|i| f64::from_bits(got[i])),
                    first.map(|i| f64::from_bits(want[i]))
                );
            };
            let want_shared = scaled(&shared);
            for (name, p) in [("p1", &p1), ("p2", &p2), ("p3", &p3)] {
                same(format!("{what}: {name} scaled once"), &p.grad().unwrap(), &want_shared);
            }
            let one = p1.grad().unwrap().same_storage(&p3.grad().unwrap());
            assert!(one, "{what}: the shared gradient is still one storage");
            for (i, ((o, h), gv)) in others.iter().zip(&held).zip(&own).enumerate() {
                let want = scaled(gv);
                same(format!("{what}: gradient {i}"), &o.grad().unwrap(), &want);
                same(format!("{what}: gradient {i} through a handle taken before"), h, &want);
            }
        }
    }
}

/// `Tensor::scale_each_` refuses, before anything changes, a storage listed twice (it
/// would be scaled twice) and a coefficient that is not one f32 on the tensors' device.
#[test]
fn scale_each_in_place_refuses_shared_storage_and_bad_coefficients() {
    setup();
    let a = Tensor::ones([4], DType::F32, DEV).unwrap();
    let b = Tensor::ones([3], DType::BF16, DEV).unwrap();
    let coef = Tensor::scalar(0.5, DType::F32).to_device(DEV).unwrap();
    let view = a.reshape([2, 2]).unwrap();
    let bad: [(&[&Tensor], Tensor); 4] = [
        (&[&a, &b, &view], coef.clone()),
        (&[&a, &b, &a], coef.clone()),
        (&[&a, &b], Tensor::scalar(0.5, DType::F64).to_device(DEV).unwrap()),
        (&[&a, &b], Tensor::scalar(0.5, DType::F32)),
    ];
    for (i, (ts, c)) in bad.iter().enumerate() {
        assert!(Tensor::scale_each_(ts, c).is_err(), "case {i} accepted");
        assert_eq!(a.to_vec_f64().unwrap(), vec![1.0; 4], "case {i} changed a");
        assert_eq!(b.to_vec_f64().unwrap(), vec![1.0; 3], "case {i} changed b");
    }
    Tensor::scale_each_(&[&a, &b], &coef).unwrap();
    assert_eq!(a.to_vec_f64().unwrap(), vec![0.5; 4]);
    assert_eq!(view.to_vec_f64().unwrap(), vec![0.5; 4], "a handle on the same storage");
    assert_eq!(b.to_vec_f64().unwrap(), vec![0.5; 3]);
}

/// Bits of every element, widened to f64 (a NaN's too).
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// `Tensor::adamw_step_each_with_copies_` on the emulated device and on the host, over
/// more parameters than one launch takes: f32 parameters with bf16 and f16 working copies
/// (the fused kernels), some without a copy, and pairs no fused kernel writes (a bf16
/// parameter with an f32 copy, an f32 parameter with an f32 copy: stepped, then cast).
/// Parameters and moments are `adamw_step_each_`'s bits on twins, every copy is the cast
/// of its updated parameter bit for bit, and the device step makes no host round trip.
#[test]
fn adamw_working_copies_are_the_cast_of_the_update() {
    setup();
    let mut rng = Rng::new(18);
    let copy_kinds: [(DType, Option<DType>); 6] = [
        (DType::F32, Some(DType::BF16)),
        (DType::F32, Some(DType::F16)),
        (DType::F32, None),
        (DType::BF16, Some(DType::F32)),
        (DType::F32, Some(DType::F32)),
        (DType::F32, Some(DType::BF16)),
    ];
    for device in [Device::Cpu, DEV] {
        let (mut ps, mut twins, mut gs, mut copies, mut states) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..38usize {
            let (dtype, copy) = copy_kinds[i % copy_kinds.len()];
            let n = if i == 7 { 16385 } else { 1 + 61 * i };
            let p = Tensor::randn([n], dtype, &mut rng).unwrap().to_device(device).unwrap();
            twins.push(p.deep_clone().unwrap());
            ps.push(p);
            gs.push(Tensor::randn([n], dtype, &mut rng).unwrap().to_device(device).unwrap());
            copies.push(copy.map(|d| Tensor::zeros([n], d, device).unwrap()));
            let z = || Tensor::zeros([n], DType::F32, device).unwrap();
            states.push([z(), z(), z(), z()]);
        }
        fn r(ts: &[Tensor]) -> Vec<&Tensor> {
            ts.iter().collect()
        }
        let col = |k: usize| states.iter().map(|s| &s[k]).collect::<Vec<_>>();
        let cs: Vec<Option<&Tensor>> = copies.iter().map(Option::as_ref).collect();
        for step in 1..=3 {
            let h = AdamWParams {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                step,
            };
            Tensor::adamw_step_each_(&r(&twins), &r(&gs), &col(0), &col(1), &h).unwrap();
            let before = gpu::host_round_trips();
            Tensor::adamw_step_each_with_copies_(&r(&ps), &r(&gs), &col(2), &col(3), &cs, &h)
                .unwrap();
            if device == DEV {
                let fused = gpu::host_round_trips() - before;
                assert_eq!(fused, 0, "the step with working copies left the device");
            }
            for i in 0..ps.len() {
                let what = format!("{device} {:?} param {i} step {step}", copy_kinds[i % 6]);
                assert_eq!(bits(&ps[i]), bits(&twins[i]), "{what}: parameter");
                assert_eq!(bits(&states[i][2]), bits(&states[i][0]), "{what}: exp_avg");
                assert_eq!(bits(&states[i][3]), bits(&states[i][1]), "{what}: exp_avg_sq");
                if let Some(c) = &copies[i] {
                    let cast = ps[i].to_dtype(c.dtype()).unwrap();
                    assert_eq!(bits(c), bits(&cast), "{what}: working copy");
                    assert_eq!(c.device(), device, "{what}: copy's device");
                }
            }
        }
        // A copy of another shape, and one shared with a moment, are refused before any
        // update.
        let before = bits(&ps[0]);
        let h = AdamWParams {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 4,
        };
        let wrong = Tensor::zeros([2], DType::BF16, device).unwrap();
        let mut bad = cs.clone();
        bad[0] = Some(&wrong);
        let e = Tensor::adamw_step_each_with_copies_(&r(&ps), &r(&gs), &col(2), &col(3), &bad, &h);
        assert!(e.is_err(), "{device}: a copy of another shape was accepted");
        bad[0] = Some(&states[0][2]);
        let e = Tensor::adamw_step_each_with_copies_(&r(&ps), &r(&gs), &col(2), &col(3), &bad, &h);
        assert!(e.is_err(), "{device}: a copy that is a moment was accepted");
        let e =
            Tensor::adamw_step_each_with_copies_(&r(&ps), &r(&gs), &col(2), &col(3), &cs[1..], &h);
        assert!(e.is_err(), "{device}: one copy slot too few was accepted");
        assert_eq!(bits(&ps[0]), before, "{device}: a refused step changed a parameter");
    }
}
