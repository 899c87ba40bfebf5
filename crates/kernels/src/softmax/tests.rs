use half::bf16;

use super::*;
use crate::testutil::*;

type Fwd<T> = fn(&[T], usize, usize, &mut [T]) -> Result<()>;
type Bwd<T> = fn(&[T], &[T], usize, usize, &mut [T]) -> Result<()>;

fn ops<T: Float>(log: bool) -> (Fwd<T>, Bwd<T>) {
    if log {
        (log_softmax_forward::<T>, log_softmax_backward::<T>)
    } else {
        (softmax_forward::<T>, softmax_backward::<T>)
    }
}

fn check<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    for log in [false, true] {
        let (fwd, bwd) = ops::<T>(log);
        for &(rows, cols) in &[(1, 1), (7, 33), (65, 7), (3, 130), (33, 65)] {
            let mut x: Vec<T> = rng.vec(rows * cols, 8.0);
            // A fully masked row and a partly masked one.
            if rows > 2 {
                x[..cols].fill(T::from_f64(f64::NEG_INFINITY));
                x[cols] = T::from_f64(f64::NEG_INFINITY);
            }
            let dy: Vec<T> = rng.vec(rows * cols, 1.0);
            let y_ref = reference::forward(&f64s(&x), cols, log);
            let mut y = vec![T::default(); rows * cols];
            fwd(&x, rows, cols, &mut y).unwrap();
            assert_close_t(&format!("softmax log={log} y"), &y, &y_ref);
            let dx_ref = reference::backward(&f64s(&y), &f64s(&dy), cols, log);
            let mut dx = vec![T::default(); rows * cols];
            bwd(&y, &dy, rows, cols, &mut dx).unwrap();
            assert_close_t(&format!("softmax log={log} dx"), &dx, &dx_ref);
            assert!(y.iter().chain(&dx).all(|v| !v.to_f64().is_nan()));
        }
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
    let mut rng = Rng::new(7);
    let (rows, cols) = (3, 9);
    let x: Vec<f64> = rng.vec(rows * cols, 3.0);
    let dy: Vec<f64> = rng.vec(rows * cols, 1.0);
    for log in [false, true] {
        let (fwd, bwd) = ops::<f64>(log);
        let f = |x: &[f64]| {
            let mut y = vec![0.0; rows * cols];
            fwd(x, rows, cols, &mut y).unwrap();
            y
        };
        let y = f(&x);
        let mut dx = vec![0.0; rows * cols];
        bwd(&y, &dy, rows, cols, &mut dx).unwrap();
        assert_fd(&format!("softmax log={log}"), f, &x, &dy, &dx);
    }
}

#[test]
fn rejects_bad_lengths() {
    let mut y = vec![0.0f32; 6];
    assert!(softmax_forward(&[0.0f32; 5], 2, 3, &mut y).is_err());
    assert!(log_softmax_backward(&[0.0f32; 6], &[0.0; 6], 2, 3, &mut y[..5]).is_err());
    assert!(softmax_forward(&[0.0f32; 6], usize::MAX, 3, &mut y).is_err());
    assert!(softmax_forward(&[0.0f32; 0], 0, 3, &mut []).is_ok());
}
