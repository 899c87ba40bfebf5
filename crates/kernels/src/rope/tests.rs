use half::bf16;

use super::*;
use crate::testutil::*;

fn check<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    // The last two run in several blocks (rows of 200 and 130 elements), the last in
    // parallel, with blocks that start mid-sequence.
    let shapes = [
        (1, 1, 1, 2),
        (2, 7, 1, 8),
        (1, 33, 3, 6),
        (3, 5, 2, 130),
        (1, 65, 1, 4),
        (3, 37, 2, 100),
        (2, 129, 1, 130),
    ];
    for &(outer, seq, inner, head_dim) in &shapes {
        let s = RopeShape { outer, seq, inner, head_dim };
        let n = outer * seq * inner * head_dim;
        let x: Vec<T> = rng.vec(n, 1.0);
        // Independent halves: the backward must be the exact transpose anyway.
        let cos: Vec<T> = rng.vec(seq * head_dim, 1.0);
        let sin: Vec<T> = rng.vec(seq * head_dim, 1.0);
        let (xf, cf, sf) = (f64s(&x), f64s(&cos), f64s(&sin));
        let mut y = vec![T::default(); n];
        rope_forward(&s, &x, &cos, &sin, &mut y).unwrap();
        assert_close_t("rope y", &y, &reference::rope_forward(&s, &xf, &cf, &sf));
        let mut dx = vec![T::default(); n];
        rope_backward(&s, &x, &cos, &sin, &mut dx).unwrap();
        assert_close_t("rope dx", &dx, &reference::rope_backward(&s, &xf, &cf, &sf));
    }
}

#[test]
fn matches_reference() {
    check::<f32>(1);
    check::<f64>(2);
    check::<bf16>(3);
}

/// The AVX-512 build gives the portable build's bits, forward and backward, at the
/// head dims with a constant half (32, 64, 128) and others, in f32 and bf16.
#[test]
fn avx512_build_gives_the_portable_bits() {
    if !cpu::avx512() {
        return; // only the portable build runs here
    }
    fn both<T: Float + PartialEq + std::fmt::Debug>(rng: &mut Rng) {
        for (outer, seq, inner, hd) in
            [(16, 256, 1, 32), (2, 100, 3, 64), (3, 50, 2, 128), (4, 60, 1, 20)]
        {
            let s = RopeShape { outer, seq, inner, head_dim: hd };
            let n = outer * seq * inner * hd;
            let x: Vec<T> = rng.vec(n, 1.0);
            let (cos, sin): (Vec<T>, Vec<T>) = (rng.vec(seq * hd, 1.0), rng.vec(seq * hd, 1.0));
            for transpose in [false, true] {
                let mut y = [vec![T::default(); n], vec![T::default(); n]];
                for (y, avx512) in y.iter_mut().zip([false, true]) {
                    cpu::apply(&s, &x, &cos, &sin, y, transpose, avx512);
                }
                assert!(y[0] == y[1], "{s:?} transpose {transpose}: the builds differ");
            }
        }
    }
    let mut rng = Rng::new(5);
    both::<f32>(&mut rng);
    both::<bf16>(&mut rng);
}

#[test]
fn backward_is_transpose() {
    let mut rng = Rng::new(4);
    let s = RopeShape { outer: 2, seq: 3, inner: 2, head_dim: 6 };
    let n = 2 * 3 * 2 * 6;
    let x: Vec<f64> = rng.vec(n, 1.0);
    let dy: Vec<f64> = rng.vec(n, 1.0);
    let cos: Vec<f64> = rng.vec(18, 1.0);
    let sin: Vec<f64> = rng.vec(18, 1.0);
    let mut dx = vec![0.0; n];
    rope_backward(&s, &dy, &cos, &sin, &mut dx).unwrap();
    let fwd = |x: &[f64]| {
        let mut y = vec![0.0; n];
        rope_forward(&s, x, &cos, &sin, &mut y).unwrap();
        y
    };
    assert_fd("rope dx", fwd, &x, &dy, &dx);
}

#[test]
fn rejects_bad_arguments() {
    let s = RopeShape { outer: 1, seq: 2, inner: 1, head_dim: 3 };
    let mut y = vec![0.0f32; 6];
    assert!(rope_forward(&s, &[0.0; 6], &[0.0; 6], &[0.0; 6], &mut y).is_err());
    let s = RopeShape { head_dim: 4, ..s };
    let mut y = vec![0.0f32; 8];
    assert!(rope_forward(&s, &[0.0; 8], &[0.0; 7], &[0.0; 8], &mut y).is_err());
    assert!(rope_backward(&s, &[0.0; 8], &[0.0; 8], &[0.0; 8], &mut y[..7]).is_err());
    assert!(rope_forward(&s, &[0.0; 8], &[0.0; 8], &[0.0; 8], &mut y).is_ok());
}
