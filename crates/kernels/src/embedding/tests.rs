use half::bf16;

use super::*;
use crate::testutil::*;

fn check<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    for &(vocab, dim, n, masked) in
        &[(1, 1, 1, false), (7, 33, 65, false), (33, 7, 130, true), (65, 130, 33, true)]
    {
        let start = if masked { 5 } else { 0 };
        let w: Vec<T> = rng.vec(vocab * dim, 1.0);
        // Masked: ids drawn from a global vocab around this shard; repeats are common.
        let ids: Vec<i64> = (0..n)
            .map(|_| if masked { rng.below(vocab + 10) as i64 } else { rng.below(vocab) as i64 })
            .collect();
        let mut out = vec![T::default(); n * dim];
        embedding_forward(&w, vocab, dim, &ids, start, masked, &mut out).unwrap();
        let want = reference::embedding_forward(&f64s(&w), vocab, dim, &ids, start);
        assert_close_t("embedding out", &out, &want);
        let dout: Vec<T> = rng.vec(n * dim, 1.0);
        let mut dw = vec![T::from_f64(3.0); vocab * dim];
        embedding_backward(&ids, start, masked, &dout, vocab, dim, &mut dw).unwrap();
        let want = reference::embedding_backward(&ids, start, &f64s(&dout), vocab, dim);
        assert_close_t("embedding dweight", &dw, &want);
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
    let mut rng = Rng::new(4);
    let (vocab, dim) = (5, 3);
    let w: Vec<f64> = rng.vec(vocab * dim, 1.0);
    let ids = [1i64, 3, 1, 7, 4, 4, 4];
    let dout: Vec<f64> = rng.vec(ids.len() * dim, 1.0);
    let f = |w: &[f64]| {
        let mut out = vec![0.0; ids.len() * dim];
        embedding_forward(w, vocab, dim, &ids, 2, true, &mut out).unwrap();
        out
    };
    let mut dw = vec![0.0; vocab * dim];
    embedding_backward(&ids, 2, true, &dout, vocab, dim, &mut dw).unwrap();
    assert_fd("dweight", f, &w, &dout, &dw);
}

#[test]
fn rejects_out_of_range_ids() {
    let w = [1.0f32; 6];
    let mut out = [7.0f32; 6];
    let err = embedding_forward(&w, 3, 2, &[0, 3, 1], 0, false, &mut out).unwrap_err();
    assert!(matches!(err, KernelError::IndexOutOfRange { index: 3, position: 1, .. }));
    assert!(out.iter().all(|&x| x == 7.0), "nothing written on error");
    assert!(embedding_forward(&w, 3, 2, &[i64::MIN, 0, 0], 1, false, &mut out).is_err());
    assert!(embedding_forward(&w, 3, 2, &[i64::MIN, 0, 0], 1, true, &mut out).is_ok());
    assert_eq!(out, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let mut dw = [0.0f32; 6];
    assert!(embedding_backward(&[0, -1, 1], 0, false, &[1.0; 6], 3, 2, &mut dw).is_err());
    assert!(embedding_backward(&[0, 1], 0, false, &[1.0; 6], 3, 2, &mut dw).is_err());
}
