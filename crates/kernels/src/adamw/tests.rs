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

/// The step with a working copy: the parameters and moments are the plain step's bits,
/// and the copy is a separate cast ([`crate::elementwise::cast`]) of the updated
/// parameters, bit for bit, including values that round to infinity in f16, ties and
/// a NaN gradient.
fn copy_is_a_cast<T: Float<Acc = f32>, W: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    let n = 33_001; // spans several parallel chunks, odd tail
    let mut p: Vec<T> = rng.vec(n, 1.0);
    // Large magnitudes (f16 overflows past 65504) and values near rounding ties.
    p[0] = T::from_f64(70_000.0);
    p[1] = T::from_f64(-65_519.0);
    p[2] = T::from_f64(1.0 + 1.0 / 256.0);
    let mut q = p.clone();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let (mut mq, mut vq) = (m.clone(), v.clone());
    let mut copy = vec![W::from_f64(0.0); n];
    for step in 1..=3 {
        let mut g: Vec<T> = rng.vec(n, 0.1);
        g[3] = T::from_f64(f64::NAN);
        let h =
            AdamWParams { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step };
        adamw_step(&mut p, &g, &mut m, &mut v, &h).unwrap();
        let cast_one = |x: T| W::from_f64(x.to_f64());
        adamw_step_with_copy(&mut q, &g, &mut mq, &mut vq, &mut copy, cast_one, &h).unwrap();
        let what = format!("{} -> {} step {step}", T::NAME, W::NAME);
        let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&f64s(&q)), bits(&f64s(&p)), "{what}: parameters");
        assert_eq!(bits(&f64s(&mq)), bits(&f64s(&m)), "{what}: exp_avg");
        assert_eq!(bits(&f64s(&vq)), bits(&f64s(&v)), "{what}: exp_avg_sq");
        let mut cast = vec![W::from_f64(0.0); n];
        crate::elementwise::cast(&p, &mut cast).unwrap();
        assert_eq!(bits(&f64s(&copy)), bits(&f64s(&cast)), "{what}: working copy");
        assert!(f64s(&copy)[3].is_nan(), "{what}: a NaN gradient's parameter");
    }
    if W::NAME == "f16" {
        assert!(f64s(&copy)[0].is_infinite(), "70000 is past f16's range");
    }
}

#[test]
fn step_with_copy_writes_the_cast_of_the_update() {
    copy_is_a_cast::<f32, bf16>(11);
    copy_is_a_cast::<f32, half::f16>(12);
    copy_is_a_cast::<bf16, half::f16>(13);
}

#[test]
fn step_with_copy_rejects_a_short_copy() {
    let h =
        AdamWParams { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1 };
    let (mut p, mut m, mut v) = ([1.0f32; 4], [0.0f32; 4], [0.0f32; 4]);
    let mut short = [bf16::ZERO; 3];
    let cast = |x: f32| bf16::from_f32(x);
    assert!(adamw_step_with_copy(&mut p, &[0.5; 4], &mut m, &mut v, &mut short, cast, &h).is_err());
    assert_eq!(p, [1.0; 4], "a refused step changed the parameters");
}
