//! AdamW, SGD, `clip_grad_norm_` and the LR schedules against trajectories recorded from
//! `torch.optim` itself (`tests/golden/make_optim_golden.py`, float64): the same initial
//! parameters and per-step gradients go through tpar, and every step's parameters, the
//! final optimizer state, the clipped gradients and every learning rate must match.

mod common;

use std::collections::BTreeMap;

use common::golden::{self, Golden};
use tpar_nn::Param;
use tpar_optim::{
    clip_grad_norm_, AdamW, AdamWConfig, ClipOptions, CosineAnnealingLR, LinearLR, LrSchedule,
    LrScheduler, Optimizer, SequentialLR, Sgd, SgdConfig,
};
use tpar_tensor::{DType, Tensor};

type File = BTreeMap<String, Golden>;

/// Relative agreement required with torch. Both sides compute in f64 with the same
/// formulas; only the grouping of a few products differs (torch's `addcdiv_(m, denom,
/// value=-lr/bc1)` against `lr/bc1 * m / denom`, the norm of per-tensor norms against
/// one sum of squares, torch's recursive LR forms against closed forms), which costs a
/// few ulps per step. A wrong formula (bias correction, eps placement, coupled decay,
/// a schedule a step off) moves results by 1e-7 relative or more.
const RTOL: f64 = 1e-12;
/// Absolute slack, times the largest magnitude in the compared tensor, for elements
/// near zero whose relative rounding error is unbounded.
const ATOL_SCALE: f64 = 1e-13;

fn load() -> File {
    golden::load("optim.safetensors")
}

/// Compares with [`RTOL`] and an absolute slack scaled to `want`'s magnitude.
fn check(what: &str, got: &[f64], want: &[f64]) {
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    golden::assert_close(what, got, want, ATOL_SCALE * scale, RTOL);
}

fn values<'a>(f: &'a File, key: &str) -> &'a [f64] {
    &golden::get(f, key).values
}

/// Row `k` of a `[steps, *shape]` tensor, with that shape.
fn row(g: &Golden, k: usize) -> (&[f64], Vec<usize>) {
    let shape = g.shape[1..].to_vec();
    let n: usize = shape.iter().product();
    (&g.values[k * n..(k + 1) * n], shape)
}

fn tensor(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64(v, shape, DType::F64).unwrap()
}

/// Leaves holding each parameter's `init`, for a case with `num` parameters.
fn leaves(f: &File, prefix: &str, num: usize) -> Vec<Tensor> {
    (0..num)
        .map(|i| {
            let g = golden::get(f, &format!("{prefix}.p{i}.init"));
            tensor(&g.values, &g.shape).requires_grad_(true)
        })
        .collect()
}

/// Sets step `k`'s gradients (none where the golden `has_grad` is 0).
fn feed_grads(f: &File, prefix: &str, leaves: &[Tensor], k: usize) {
    for (i, w) in leaves.iter().enumerate() {
        let has = f.get(&format!("{prefix}.p{i}.has_grad")).is_none_or(|h| h.values[k] != 0.0);
        let g = has.then(|| {
            let (v, shape) = row(golden::get(f, &format!("{prefix}.p{i}.grad")), k);
            tensor(v, &shape)
        });
        w.set_grad(g);
    }
}

/// Compares every parameter with its golden value after step `k`.
fn check_params(f: &File, prefix: &str, leaves: &[Tensor], k: usize) {
    for (i, w) in leaves.iter().enumerate() {
        let (want, _) = row(golden::get(f, &format!("{prefix}.p{i}.param")), k);
        check(&format!("{prefix}.p{i} after step {}", k + 1), &w.to_vec_f64().unwrap(), want);
    }
}

// ---------------------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------------------

/// Runs the AdamW case `name` (driven by `warmup_cosine` when the case has a schedule).
fn adamw_case(name: &str) {
    let f = load();
    let prefix = format!("adamw.{name}");
    let c = values(&f, &format!("{prefix}.config"));
    let config = AdamWConfig { lr: c[0], betas: (c[1], c[2]), eps: c[3], weight_decay: c[4] };
    let (steps, num) = (c[5] as usize, c[6] as usize);
    let leaves = leaves(&f, &prefix, num);
    let params: Vec<Param> = leaves.iter().cloned().map(Param::Tensor).collect();
    let mut opt = AdamW::new(params, config).unwrap();
    let mut sched = f.get(&format!("{prefix}.schedule")).map(|s| {
        let s = &s.values;
        let schedule =
            SequentialLR::warmup_cosine(s[0] as usize, s[1] as usize, s[2], s[3]).unwrap();
        LrScheduler::new(schedule, &mut opt)
    });
    for k in 0..steps {
        feed_grads(&f, &prefix, &leaves, k);
        if sched.is_some() {
            let want = values(&f, &format!("{prefix}.lr"))[k];
            check(&format!("{prefix} lr at step {}", k + 1), &[opt.lr()], &[want]);
        }
        opt.step().unwrap();
        opt.zero_grad();
        if let Some(s) = sched.as_mut() {
            s.step(&mut opt);
        }
        check_params(&f, &prefix, &leaves, k);
    }
    for i in 0..num {
        let p = format!("{prefix}.p{i}");
        let st = opt.state(i).unwrap().expect("state after steps");
        assert_eq!(st.step as f64, values(&f, &format!("{p}.step"))[0], "{p}: step count");
        check(
            &format!("{p}.exp_avg"),
            &st.exp_avg.to_vec_f64().unwrap(),
            values(&f, &format!("{p}.exp_avg")),
        );
        check(
            &format!("{p}.exp_avg_sq"),
            &st.exp_avg_sq.to_vec_f64().unwrap(),
            values(&f, &format!("{p}.exp_avg_sq")),
        );
    }
}

/// Three parameters of different shapes, six steps of changing gradients, non-default
/// betas/eps and weight decay; one parameter has no gradient for two steps (skipped,
/// its step count held back).
#[test]
fn adamw_matches_torch_trajectory() {
    adamw_case("main");
}

/// Gradients around 1e-7 with eps 1e-6: eps is a large part of the denominator, so
/// adding it inside the square root or before the bias correction changes the result.
#[test]
fn adamw_with_tiny_gradients_places_eps_as_torch() {
    adamw_case("tiny");
}

/// The learning rate of every step set by `SequentialLR::warmup_cosine` through
/// `LrScheduler`, and the parameters it produces.
#[test]
fn adamw_driven_by_warmup_cosine_matches_torch() {
    adamw_case("sched");
}

// ---------------------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------------------

fn sgd_case(name: &str) {
    let f = load();
    let prefix = format!("sgd.{name}");
    let c = values(&f, &format!("{prefix}.config"));
    let config = SgdConfig {
        lr: c[0],
        momentum: c[1],
        dampening: c[2],
        weight_decay: c[3],
        nesterov: c[4] != 0.0,
    };
    let (steps, num) = (c[5] as usize, c[6] as usize);
    let leaves = leaves(&f, &prefix, num);
    let params: Vec<Param> = leaves.iter().cloned().map(Param::Tensor).collect();
    let mut opt = Sgd::new(params, config).unwrap();
    for k in 0..steps {
        feed_grads(&f, &prefix, &leaves, k);
        opt.step().unwrap();
        opt.zero_grad();
        check_params(&f, &prefix, &leaves, k);
    }
    for i in 0..num {
        let key = format!("{prefix}.p{i}.momentum_buffer");
        let got = opt.momentum_buffer(i).unwrap();
        match f.get(&key) {
            Some(want) => {
                check(&key, &got.expect("a momentum buffer").to_vec_f64().unwrap(), &want.values)
            }
            None => assert!(got.is_none(), "{key}: torch keeps no buffer without momentum"),
        }
    }
}

/// No momentum, with (coupled) weight decay.
#[test]
fn sgd_plain_matches_torch() {
    sgd_case("plain");
}

/// Momentum 0.9, no dampening.
#[test]
fn sgd_momentum_matches_torch() {
    sgd_case("momentum");
}

/// Momentum with dampening 0.3 (not applied on the first step) and weight decay.
#[test]
fn sgd_dampening_matches_torch() {
    sgd_case("dampening");
}

/// Nesterov momentum with weight decay.
#[test]
fn sgd_nesterov_matches_torch() {
    sgd_case("nesterov");
}

// ---------------------------------------------------------------------------------------
// clip_grad_norm_
// ---------------------------------------------------------------------------------------

fn clip_case(name: &str) {
    let f = load();
    let prefix = format!("clip.{name}");
    let max_norm = values(&f, &format!("{prefix}.max_norm"))[0];
    let num = values(&f, &format!("{prefix}.num_grads"))[0] as usize;
    let leaves: Vec<Tensor> = (0..num)
        .map(|i| {
            let g = golden::get(&f, &format!("{prefix}.g{i}"));
            let w = tensor(&vec![0.0; g.values.len()], &g.shape).requires_grad_(true);
            w.set_grad(Some(tensor(&g.values, &g.shape)));
            w
        })
        .collect();
    let params: Vec<Param> = leaves.iter().cloned().map(Param::Tensor).collect();
    let total = clip_grad_norm_(&params, max_norm, &ClipOptions::default()).unwrap();
    let total = total.item().unwrap();
    check(&format!("{prefix}.total_norm"), &[total], values(&f, &format!("{prefix}.total_norm")));
    for (i, w) in leaves.iter().enumerate() {
        let got = w.grad().expect("a gradient").to_vec_f64().unwrap();
        check(&format!("{prefix}.clipped{i}"), &got, values(&f, &format!("{prefix}.clipped{i}")));
    }
}

/// The norm is above max_norm: every gradient scaled by `max_norm / (norm + 1e-6)`.
#[test]
fn clip_grad_norm_clips_as_torch() {
    clip_case("clips");
}

/// The norm is far below max_norm: gradients unchanged, norm returned.
#[test]
fn clip_grad_norm_below_max_leaves_grads_as_torch() {
    clip_case("below");
}

/// max_norm equal to the norm: torch's `+ 1e-6` still scales by about 1 - 3e-7.
#[test]
fn clip_grad_norm_at_max_norm_scales_as_torch() {
    clip_case("at_max");
}

// ---------------------------------------------------------------------------------------
// LR schedules
// ---------------------------------------------------------------------------------------

/// Checks `schedule` against the golden `lr.<name>.lrs`: both `lr_at` for every step and
/// the rates an `LrScheduler` sets on an optimizer (step 0 at construction).
fn lr_case<S: LrSchedule>(name: &str, make: impl Fn(&[f64]) -> S) {
    let f = load();
    let base_lr = values(&f, &format!("lr.{name}.base_lr"))[0];
    let args = values(&f, &format!("lr.{name}.params"));
    let want = values(&f, &format!("lr.{name}.lrs"));
    let schedule = make(args);
    let closed: Vec<f64> = (0..want.len()).map(|s| schedule.lr_at(s, base_lr)).collect();
    check(&format!("lr.{name} lr_at"), &closed, want);

    let mut opt = Sgd::new(vec![], SgdConfig { lr: base_lr, ..Default::default() }).unwrap();
    let mut sched = LrScheduler::new(make(args), &mut opt);
    let mut driven = vec![opt.lr()];
    for _ in 1..want.len() {
        let lr = sched.step(&mut opt);
        assert_eq!(lr, opt.lr(), "lr.{name}: the rate returned is the one set");
        driven.push(lr);
    }
    check(&format!("lr.{name} LrScheduler"), &driven, want);
}

/// `LinearLR(0.25, 0.9, 5)`, run past its end.
#[test]
fn linear_lr_matches_torch() {
    lr_case("linear", |a| LinearLR::new(a[0], a[1], a[2] as usize).unwrap());
}

/// `LinearLR` with torch's defaults (1/3, 1, 5).
#[test]
fn linear_lr_with_torch_defaults_matches_torch() {
    lr_case("linear_default", |a| LinearLR::new(a[0], a[1], a[2] as usize).unwrap());
}

/// `CosineAnnealingLR(6, 0.01)` over more than two periods' halves (torch's is periodic).
#[test]
fn cosine_annealing_lr_matches_torch() {
    lr_case("cosine", |a| CosineAnnealingLR::new(a[0] as usize, a[1]).unwrap());
}

/// `CosineAnnealingLR(5, 0)`, reaching exactly zero at `t_max`.
#[test]
fn cosine_annealing_lr_to_zero_matches_torch() {
    lr_case("cosine_zero_min", |a| CosineAnnealingLR::new(a[0] as usize, a[1]).unwrap());
}

/// `SequentialLR::warmup_cosine(3, 10, 0.1, 1e-3)` against torch's SequentialLR of
/// LinearLR(0.1, 1, 3) and CosineAnnealingLR(7, 1e-3) with milestone 3, past the end.
#[test]
fn warmup_cosine_matches_torch_sequential_lr() {
    lr_case("warmup_cosine", |a| {
        SequentialLR::warmup_cosine(a[0] as usize, a[1] as usize, a[2], a[3]).unwrap()
    });
}

/// Three schedules and two milestones: each restarts its own count at its milestone.
#[test]
fn sequential_lr_of_three_matches_torch() {
    lr_case("sequential3", |a| {
        let parts: Vec<Box<dyn LrSchedule>> = vec![
            Box::new(LinearLR::new(0.5, 1.0, 2).unwrap()),
            Box::new(CosineAnnealingLR::new(4, 0.002).unwrap()),
            Box::new(LinearLR::new(1.0, 0.2, 3).unwrap()),
        ];
        SequentialLR::new(parts, vec![a[0] as usize, a[1] as usize]).unwrap()
    });
}
