use half::bf16;

use super::*;
use crate::testutil::*;

/// Straight transcription of torch.optim.AdamW's single-tensor loop, in f64.
fn reference(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], h: &AdamWParams) {
    for i in 0..p.len() {
        p[i] *= 1.0 - h.lr * h.weight_decay;
        m[i] += (1.0 - h.beta1) * (g[i] - m[i]);
        v[i] = v[i] * h.beta2 + (1.0 - h.beta2) * g[i] * g[i];
        let bc1 = 1.0 - h.beta1.powi(h.step as i32);
        let bc2 = 1.0 - h.beta2.powi(h.step as i32);
        let denom = v[i].sqrt() / bc2.sqrt() + h.eps;
        p[i] -= h.lr / bc1 * m[i] / denom;
    }
}

fn check<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    let n = 33_000; // spans several parallel chunks
    let mut p: Vec<T> = rng.vec(n, 1.0);
    let mut pf = f64s(&p);
    let z = <T::Acc as Acc>::of(0.0);
    let (mut m, mut v) = (vec![z; n], vec![z; n]);
    let (mut mf, mut vf) = (vec![0.0; n], vec![0.0; n]);
    for step in 1..=3 {
        let g: Vec<T> = rng.vec(n, 0.1);
        let h =
            AdamWParams { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step };
        adamw_step(&mut p, &g, &mut m, &mut v, &h).unwrap();
        reference(&mut pf, &f64s(&g), &mut mf, &mut vf, &h);
        // bf16 re-rounds p every step; compare against the f64 trajectory loosely.
        assert_close_t(&format!("p step {step}"), &p, &pf);
        if T::NAME != "bf16" {
            let mv: Vec<f64> = m.iter().map(|x| x.f64()).collect();
            assert_close("exp_avg", &mv, &mf, tol::<T>());
        }
        // Start the reference from the rounded parameters to avoid drift.
        pf = f64s(&p);
    }
}

#[test]
fn matches_reference() {
    check::<f32>(1);
    check::<f64>(2);
    check::<bf16>(3);
}

#[test]
fn first_step_is_sign_like() {
    // Step 1 without decay: m_hat = g, v_hat = g^2, so p -= lr * g / (|g| + eps).
    let mut p = [1.0f64, -2.0, 0.5];
    let g = [0.3, -0.2, 0.0];
    let (mut m, mut v) = ([0.0; 3], [0.0; 3]);
    let h =
        AdamWParams { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1 };
    adamw_step(&mut p, &g, &mut m, &mut v, &h).unwrap();
    assert!((p[0] - 0.9).abs() < 1e-7 && (p[1] + 1.9).abs() < 1e-7 && p[2] == 0.5);
}

#[test]
fn rejects_bad_arguments() {
    let h =
        AdamWParams { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 0 };
    let (mut p, mut m, mut v) = ([0.0f32; 2], [0.0f32; 2], [0.0f32; 2]);
    assert!(adamw_step(&mut p, &[0.0; 2], &mut m, &mut v, &h).is_err());
    let h = AdamWParams { step: 1, ..h };
    assert!(adamw_step(&mut p, &[0.0; 1], &mut m, &mut v, &h).is_err());
    assert!(adamw_step(&mut p, &[0.0; 2], &mut m, &mut v[..1], &h).is_err());
    assert!(adamw_step(&mut p, &[0.0; 2], &mut m, &mut v, &h).is_ok());
}
