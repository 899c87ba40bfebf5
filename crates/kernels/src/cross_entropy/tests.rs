use half::bf16;

use super::*;
use crate::testutil::*;

const IGNORE: i64 = -100;

fn data<T: Float>(rng: &mut Rng, rows: usize, vocab: usize) -> (Vec<T>, Vec<i64>) {
    let logits: Vec<T> = rng.vec(rows * vocab, 6.0);
    let targets =
        (0..rows).map(|r| if r % 5 == 3 { IGNORE } else { rng.below(vocab) as i64 }).collect();
    (logits, targets)
}

fn accs<A: Acc>(v: &[A]) -> Vec<f64> {
    v.iter().map(|x| x.f64()).collect()
}

fn check<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    for &(rows, vocab) in &[(1, 1), (7, 33), (9, 130), (4, 700)] {
        let (logits, targets) = data::<T>(&mut rng, rows, vocab);
        let lf = f64s(&logits);
        let (loss_ref, lse_ref) = reference::cross_entropy_forward(&lf, vocab, &targets, IGNORE);
        let z = <T::Acc as Acc>::of(0.0);
        let (mut loss, mut lse) = (vec![z; rows], vec![z; rows]);
        let count =
            cross_entropy_forward(&logits, rows, vocab, &targets, IGNORE, &mut loss, &mut lse)
                .unwrap();
        assert_eq!(count, targets.iter().filter(|&&t| t != IGNORE).count());
        let t = tol::<T>().min(1e-4);
        assert_close("loss", &accs(&loss), &loss_ref, t);
        assert_close("lse", &accs(&lse), &lse_ref, t);

        let scale: Vec<f64> = (0..rows).map(|_| rng.uniform()).collect();
        let scale_a: Vec<T::Acc> = scale.iter().map(|&s| Acc::of(s)).collect();
        let d_ref = reference::cross_entropy_backward(&lf, vocab, &targets, IGNORE, &scale);
        let mut d = vec![T::default(); rows * vocab];
        cross_entropy_backward(&logits, rows, vocab, &targets, 0, IGNORE, &lse, &scale_a, &mut d)
            .unwrap();
        assert_close_t("dlogits", &d, &d_ref);
    }
}

#[test]
fn matches_reference() {
    check::<f32>(1);
    check::<f64>(2);
    check::<bf16>(3);
}

/// Three uneven vocab shards, combined both ways, must match the unsharded result.
fn check_sharded<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    let (rows, vocab) = (11, 67);
    let bounds = [0usize, 30, 31, 67]; // shard 1 has a single column
    let (logits, targets) = data::<T>(&mut rng, rows, vocab);
    let lf = f64s(&logits);
    let (loss_ref, lse_ref) = reference::cross_entropy_forward(&lf, vocab, &targets, IGNORE);
    let z = <T::Acc as Acc>::of(0.0);
    let mut shards = Vec::new();
    for w in bounds.windows(2) {
        let (start, vl) = (w[0], w[1] - w[0]);
        let local: Vec<T> =
            logits.chunks(vocab).flat_map(|r| r[start..start + vl].iter().copied()).collect();
        let (mut m, mut s, mut t) = (vec![z; rows], vec![z; rows], vec![z; rows]);
        ce_local_stats(
            &local,
            rows,
            vl,
            &targets,
            start as i64,
            vocab,
            IGNORE,
            &mut m,
            &mut s,
            &mut t,
        )
        .unwrap();
        shards.push((start, vl, local, m, s, t));
    }
    // All-reduce style: MAX, rescale, SUM.
    let mut gmax = vec![<T::Acc as num_traits::Float>::neg_infinity(); rows];
    for sh in &shards {
        gmax.iter_mut().zip(&sh.3).for_each(|(g, &m)| *g = num_traits::Float::max(*g, m));
    }
    let (mut gsum, mut tl) = (vec![z; rows], vec![z; rows]);
    for sh in &shards {
        let mut s = sh.4.clone();
        ce_rescale(&sh.3, &mut s, &gmax).unwrap();
        (0..rows).for_each(|r| {
            gsum[r] += s[r];
            tl[r] += sh.5[r];
        });
    }
    let mut lse = vec![z; rows];
    ce_lse(&gmax, &gsum, &mut lse).unwrap();
    let t = tol::<T>().min(1e-4);
    assert_close("sharded lse", &accs(&lse), &lse_ref, t);
    let loss: Vec<f64> = (0..rows)
        .map(|r| if targets[r] == IGNORE { 0.0 } else { (lse[r] - tl[r]).f64() })
        .collect();
    assert_close("sharded loss", &loss, &loss_ref, t);
    // Pairwise merge gives the same lse.
    let (mut m, mut s) = (shards[0].3.clone(), shards[0].4.clone());
    for sh in &shards[1..] {
        ce_merge(&mut m, &mut s, &sh.3, &sh.4).unwrap();
    }
    let mut lse2 = vec![z; rows];
    ce_lse(&m, &s, &mut lse2).unwrap();
    assert_close("merged lse", &accs(&lse2), &lse_ref, t);
    // Backward per shard, concatenated.
    let scale = [Acc::of(0.25)];
    let d_ref = reference::cross_entropy_backward(&lf, vocab, &targets, IGNORE, &[0.25; 11]);
    let mut d = vec![T::default(); rows * vocab];
    for (start, vl, local, ..) in &shards {
        let mut dl = vec![T::default(); rows * vl];
        cross_entropy_backward(
            local,
            rows,
            *vl,
            &targets,
            *start as i64,
            IGNORE,
            &lse,
            &scale,
            &mut dl,
        )
        .unwrap();
        for r in 0..rows {
            d[r * vocab + start..r * vocab + start + vl].copy_from_slice(&dl[r * vl..(r + 1) * vl]);
        }
    }
    assert_close_t("sharded dlogits", &d, &d_ref);
}

#[test]
fn vocab_parallel_matches_unsharded() {
    check_sharded::<f32>(4);
    check_sharded::<f64>(5);
    check_sharded::<bf16>(6);
}

#[test]
fn finite_differences() {
    let mut rng = Rng::new(8);
    let (rows, vocab) = (4, 6);
    let (logits, targets) = data::<f64>(&mut rng, rows, vocab);
    let scale: Vec<f64> = (0..rows).map(|_| rng.uniform()).collect();
    let f = |x: &[f64]| {
        let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        cross_entropy_forward(x, rows, vocab, &targets, IGNORE, &mut loss, &mut lse).unwrap();
        loss
    };
    let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
    cross_entropy_forward(&logits, rows, vocab, &targets, IGNORE, &mut loss, &mut lse).unwrap();
    let mut d = vec![0.0; rows * vocab];
    cross_entropy_backward(&logits, rows, vocab, &targets, 0, IGNORE, &lse, &scale, &mut d)
        .unwrap();
    assert_fd("dlogits", f, &logits, &scale, &d);
}

#[test]
fn rejects_bad_targets_and_lengths() {
    let logits = [0.0f32; 6];
    let (mut a, mut b) = ([0.0f32; 2], [0.0f32; 2]);
    let err = cross_entropy_forward(&logits, 2, 3, &[1, 3], IGNORE, &mut a, &mut b).unwrap_err();
    assert!(matches!(err, KernelError::IndexOutOfRange { index: 3, position: 1, size: 3, .. }));
    assert!(cross_entropy_forward(&logits, 2, 3, &[-1, 0], IGNORE, &mut a, &mut b).is_err());
    assert_eq!(cross_entropy_forward(&logits, 2, 3, &[IGNORE, 2], IGNORE, &mut a, &mut b), Ok(1));
    assert!(cross_entropy_forward(&logits[..5], 2, 3, &[0, 0], IGNORE, &mut a, &mut b).is_err());
    let (mut m, mut s, mut t) = ([0.0f32; 2], [0.0f32; 2], [0.0f32; 2]);
    // Shard [2, 5) does not fit a vocab of 4.
    assert!(ce_local_stats(&logits, 2, 3, &[0, 0], 2, 4, IGNORE, &mut m, &mut s, &mut t).is_err());
    let mut d = [0.0f32; 6];
    let lse = [0.0f32; 2];
    assert!(
        cross_entropy_backward(&logits, 2, 3, &[0, 0], 0, IGNORE, &lse, &[1.0; 3], &mut d).is_err()
    );
    assert!(cross_entropy_backward(&logits, 2, 3, &[0, 0], 0, IGNORE, &lse, &[1.0], &mut d).is_ok());
}
