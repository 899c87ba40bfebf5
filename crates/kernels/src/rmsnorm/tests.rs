use half::bf16;

use super::*;
use crate::testutil::*;

const EPS: f64 = 1e-5;

fn check<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    for &(rows, dim) in &[(1, 1), (7, 33), (65, 7), (130, 65), (3, 130)] {
        let x: Vec<T> = rng.vec(rows * dim, 2.0);
        let w: Vec<T> = rng.vec(dim, 1.5);
        let dy: Vec<T> = rng.vec(rows * dim, 1.0);
        let (xf, wf, dyf) = (f64s(&x), f64s(&w), f64s(&dy));
        let (y_ref, rstd_ref) = reference::rmsnorm_forward(&xf, &wf, dim, EPS);
        let (dx_ref, dw_ref) = reference::rmsnorm_backward(&xf, &wf, &dyf, dim, EPS);

        let mut y = vec![T::default(); rows * dim];
        let mut rstd = vec![<T::Acc as crate::Acc>::of(0.0); rows];
        rmsnorm_forward(&x, &w, rows, dim, EPS, &mut y, &mut rstd).unwrap();
        assert_close_t("y", &y, &y_ref);
        let rstd_f: Vec<f64> = rstd.iter().map(|r| crate::Acc::f64(*r)).collect();
        assert_close("rstd", &rstd_f, &rstd_ref, tol::<T>().min(1e-4));

        let mut dx = vec![T::default(); rows * dim];
        let mut dw = vec![<T::Acc as crate::Acc>::of(7.0); dim];
        rmsnorm_backward(&x, &w, &rstd, &dy, rows, dim, &mut dx, &mut dw).unwrap();
        assert_close_t("dx", &dx, &dx_ref);
        let dw_f: Vec<f64> = dw.iter().map(|r| crate::Acc::f64(*r)).collect();
        assert_close("dweight", &dw_f, &dw_ref, tol::<T>().min(1e-4) * 10.0);
    }
}

#[test]
fn matches_reference() {
    check::<f32>(1);
    check::<f64>(2);
    check::<bf16>(3);
}

#[test]
fn finite_differences() {
    let mut rng = Rng::new(5);
    let (rows, dim) = (3, 7);
    let x: Vec<f64> = rng.vec(rows * dim, 1.0);
    let w: Vec<f64> = rng.vec(dim, 1.0);
    let dy: Vec<f64> = rng.vec(rows * dim, 1.0);
    let fwd = |x: &[f64], w: &[f64]| {
        let mut y = vec![0.0; rows * dim];
        let mut r = vec![0.0; rows];
        rmsnorm_forward(x, w, rows, dim, EPS, &mut y, &mut r).unwrap();
        (y, r)
    };
    let (_, rstd) = fwd(&x, &w);
    let mut dx = vec![0.0; rows * dim];
    let mut dw = vec![0.0; dim];
    rmsnorm_backward(&x, &w, &rstd, &dy, rows, dim, &mut dx, &mut dw).unwrap();
    assert_fd("dx", |x| fwd(x, &w).0, &x, &dy, &dx);
    assert_fd("dweight", |w| fwd(&x, w).0, &w, &dy, &dw);
}

#[test]
fn rejects_bad_lengths() {
    let mut y = vec![0.0f32; 6];
    let mut r = vec![0.0f32; 2];
    assert!(rmsnorm_forward(&[0.0f32; 5], &[1.0; 3], 2, 3, EPS, &mut y, &mut r).is_err());
    assert!(rmsnorm_forward(&[0.0f32; 6], &[1.0; 2], 2, 3, EPS, &mut y, &mut r).is_err());
    assert!(rmsnorm_forward(&[0.0f32; 6], &[1.0; 3], 2, 3, EPS, &mut y, &mut r[..1]).is_err());
    let mut dx = vec![0.0f32; 6];
    let mut dw = vec![0.0f32; 3];
    let ok = rmsnorm_backward(&[0.0f32; 6], &[1.0; 3], &r, &[0.0; 6], 2, 3, &mut dx, &mut dw);
    assert!(ok.is_ok());
    assert!(
        rmsnorm_backward(&[0.0f32; 6], &[1.0; 3], &r, &[0.0; 5], 2, 3, &mut dx, &mut dw).is_err()
    );
}
