use half::{bf16, f16};

use super::*;
use crate::testutil::*;

fn check<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    let dims = [1usize, 7, 33, 65, 130];
    for case in 0..24 {
        let (m, n, k) = (dims[rng.below(5)], dims[rng.below(5)], dims[rng.below(5)]);
        let batch = [1, 2, 3][rng.below(3)];
        let (trans_a, trans_b) = (case & 1 == 1, case & 2 == 2);
        let a_bcast = case % 5 == 4;
        let b_bcast = case % 7 == 6;
        let accumulate = case % 3 == 1;
        let s = GemmShape {
            batch,
            m,
            n,
            k,
            trans_a,
            trans_b,
            a_batch_stride: if a_bcast { 0 } else { m * k },
            b_batch_stride: if b_bcast { 0 } else { k * n },
        };
        let a: Vec<T> = rng.vec(if a_bcast { m * k } else { batch * m * k }, 1.0);
        let b: Vec<T> = rng.vec(if b_bcast { k * n } else { batch * k * n }, 1.0);
        let mut out: Vec<T> = rng.vec(batch * m * n, 1.0);
        let init = f64s(&out);
        let want = reference::matmul(&s, &f64s(&a), &f64s(&b), accumulate.then_some(&init[..]));
        matmul(&s, &a, &b, &mut out, accumulate).unwrap();
        // Products of k terms: scale the tolerance with sqrt(k).
        let t = tol::<T>() * (1.0 + (k as f64).sqrt());
        assert_close(
            &format!("matmul {s:?} acc={accumulate} ({})", T::NAME),
            &f64s(&out),
            &want,
            t,
        );
    }
}

#[test]
fn matches_reference() {
    check::<f32>(1);
    check::<f64>(2);
    check::<bf16>(3);
    check::<f16>(4);
}

#[test]
fn large_parallel_and_k_zero() {
    let mut rng = Rng::new(9);
    let s = GemmShape { trans_b: true, ..GemmShape::new(2, 70, 90, 80) };
    let a: Vec<f32> = rng.vec(2 * 70 * 80, 1.0);
    let b: Vec<f32> = rng.vec(2 * 90 * 80, 1.0);
    let mut out = vec![0.0f32; 2 * 70 * 90];
    matmul(&s, &a, &b, &mut out, false).unwrap();
    assert_close("big", &f64s(&out), &reference::matmul(&s, &f64s(&a), &f64s(&b), None), 1e-4);

    let s = GemmShape::new(2, 3, 4, 0);
    let mut out = vec![5.0f64; 24];
    matmul(&s, &[], &[], &mut out, true).unwrap();
    assert!(out.iter().all(|&x| x == 5.0));
    matmul(&s, &[], &[], &mut out, false).unwrap();
    assert!(out.iter().all(|&x| x == 0.0));
}

/// Large products split by rows across the pool's threads (chunks of a multiple of 32
/// rows, the last one short, with every layout, batches and accumulation) give the
/// reference's values, and the same bits on 1, 2 and 3 threads.
#[test]
fn row_split_products_match_reference_and_thread_counts() {
    let pool = |n: usize| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    let mut rng = Rng::new(21);
    for (case, (m, n, k)) in
        [(64, 70, 90), (97, 33, 130), (257, 65, 64), (200, 6, 300)].into_iter().enumerate()
    {
        for batch in [1, 2] {
            let (trans_a, trans_b, accumulate) = (case & 1 == 1, case & 2 == 2, batch == 2);
            let s = GemmShape { trans_a, trans_b, ..GemmShape::new(batch, m, n, k) };
            let a: Vec<f32> = rng.vec(batch * m * k, 1.0);
            let b: Vec<f32> = rng.vec(batch * k * n, 1.0);
            let init: Vec<f32> = rng.vec(batch * m * n, 1.0);
            let want = reference::matmul(
                &s,
                &f64s(&a),
                &f64s(&b),
                accumulate.then(|| f64s(&init)).as_deref(),
            );
            let outs: Vec<Vec<f32>> = [1, 2, 3]
                .iter()
                .map(|&t| {
                    let mut out = init.clone();
                    pool(t).install(|| matmul(&s, &a, &b, &mut out, accumulate)).unwrap();
                    out
                })
                .collect();
            let what = format!("{s:?} acc={accumulate}");
            assert_close(&what, &f64s(&outs[1]), &want, 1e-5 * (1.0 + k as f64));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&outs[0]), bits(&outs[1]), "{what}: 1 and 2 threads differ");
            assert_eq!(bits(&outs[0]), bits(&outs[2]), "{what}: 1 and 3 threads differ");
        }
    }
}

#[test]
fn rejects_bad_lengths() {
    let s = GemmShape::new(2, 3, 4, 5);
    let a = vec![0.0f32; 30];
    let b = vec![0.0f32; 40];
    let mut out = vec![0.0f32; 24];
    assert!(matmul(&s, &a[..29], &b, &mut out, false).is_err());
    assert!(matmul(&s, &a, &b[..39], &mut out, false).is_err());
    assert!(matmul(&s, &a, &b, &mut out[..23], false).is_err());
    let huge = GemmShape::new(usize::MAX, 2, 2, 2);
    assert!(matmul(&huge, &a, &b, &mut out, false).is_err());
    assert!(matmul(&s, &a, &b, &mut out, false).is_ok());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
    #[test]
    fn random_shapes(
        batch in 0usize..4, m in 0usize..40, n in 0usize..40, k in 0usize..40,
        trans_a: bool, trans_b: bool, a_bcast: bool, b_bcast: bool, accumulate: bool, seed: u64,
    ) {
        let mut rng = Rng::new(seed);
        let s = GemmShape {
            trans_a, trans_b,
            a_batch_stride: if a_bcast { 0 } else { m * k },
            b_batch_stride: if b_bcast { 0 } else { k * n },
            ..GemmShape::new(batch, m, n, k)
        };
        let a: Vec<f32> = rng.vec(if a_bcast { m * k } else { batch * m * k }, 1.0);
        let b: Vec<f32> = rng.vec(if b_bcast { k * n } else { batch * k * n }, 1.0);
        let mut out: Vec<f32> = rng.vec(batch * m * n, 1.0);
        let init = f64s(&out);
        let want = reference::matmul(&s, &f64s(&a), &f64s(&b), accumulate.then_some(&init[..]));
        matmul(&s, &a, &b, &mut out, accumulate).unwrap();
        assert_close("matmul", &f64s(&out), &want, 1e-5 * (1.0 + k as f64));
    }
}
