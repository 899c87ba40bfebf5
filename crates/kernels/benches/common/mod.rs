//! Timing shared by the kernel benches.

use std::time::Instant;

/// Median seconds of `reps` calls of `f` after `warmup` uncounted calls.
pub fn median_secs(warmup: usize, reps: usize, f: impl FnMut()) -> f64 {
    let t = times(warmup, reps, f);
    t[t.len() / 2]
}

/// Seconds of each of `reps` calls of `f` (at least one) after `warmup` uncounted
/// calls, fastest first.
pub fn times(warmup: usize, reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    for _ in 0..warmup {
        f();
    }
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t
}
