use super::*;

/// Position of `x` on the ordered line of f32 values (so ulp distance is a difference).
fn ordinal(x: f32) -> i64 {
    let b = x.to_bits() as i32;
    if b < 0 {
        -((b & 0x7fff_ffff) as i64)
    } else {
        b as i64
    }
}

/// Distance in ulps between `got` and the f32 nearest to `want` (0 for two NaNs).
fn ulps(got: f32, want: f64) -> i64 {
    let want = want as f32;
    if got.is_nan() || want.is_nan() {
        return if got.is_nan() && want.is_nan() { 0 } else { i64::MAX };
    }
    (ordinal(got) - ordinal(want)).abs()
}

/// A dense sweep of f32 bit patterns (every 1021st, both signs) plus edge values.
fn sweep() -> Vec<f32> {
    let mut v: Vec<f32> = (0..=u32::MAX).step_by(1021).map(f32::from_bits).collect();
    v.extend([
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        1e-45,
        -1e-45,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN,
        88.72283,  // the largest x with a finite e^x
        88.72284,  // overflows
        -87.33654, // e^x near the smallest normal
        -103.27893,
        -103.97208, // e^x near half the smallest denormal
        -104.0,
        -200.0,
        0.5 * std::f32::consts::LN_2,
        -0.5 * std::f32::consts::LN_2,
    ]);
    // Every value around the half-ln2 reduction boundaries and small integers.
    for c in [0.346_573_6f32, 1.0, 2.0, 10.0, 50.0, 80.0] {
        for s in [c, -c] {
            let b = s.to_bits();
            v.extend((b - 64..b + 64).map(f32::from_bits));
        }
    }
    v
}

#[test]
fn exp_is_within_two_ulp_of_libm_everywhere() {
    let xs = sweep();
    for isa in isas() {
        let mut y = xs.clone();
        exp_on(isa, &mut y);
        let mut worst = (0i64, 0.0f32);
        for (&x, &e) in xs.iter().zip(&y) {
            let u = ulps(e, (x as f64).exp());
            if u > worst.0 {
                worst = (u, x);
            }
        }
        eprintln!("{isa:?}: worst exp error {} ulp at {}", worst.0, worst.1);
        assert!(worst.0 <= 2, "{isa:?}: exp({}) is {} ulp off", worst.1, worst.0);
    }
}

#[test]
fn exp_edge_values() {
    for isa in isas() {
        let mut y = [f32::NEG_INFINITY, -1e30, -104.0, f32::INFINITY, 1e30, 89.0, f32::NAN, 0.0];
        exp_on(isa, &mut y);
        assert_eq!(&y[..6], &[0.0, 0.0, 0.0, f32::INFINITY, f32::INFINITY, f32::INFINITY]);
        assert!(y[6].is_nan(), "{isa:?}");
        assert_eq!(y[7], 1.0);
        // Results in the denormal range are denormals, not flushed to zero.
        let mut d = [-100.0f32, -103.0];
        exp_on(isa, &mut d);
        assert!(d.iter().all(|&v| v > 0.0 && v < f32::MIN_POSITIVE), "{isa:?}: {d:?}");
    }
}

#[test]
fn exp_sub_sum_matches_elementwise_exp_at_every_length() {
    for isa in isas() {
        for n in [0usize, 1, 7, 15, 16, 17, 33, 64, 100, 257] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 23) as f32 * 0.7 - 8.0).collect();
            let shift = 3.25f32;
            let mut got = x.clone();
            let sum = exp_sub_sum_on(isa, &mut got, shift);
            let mut want: Vec<f32> = x.iter().map(|v| v - shift).collect();
            exp_on(isa, &mut want);
            assert_eq!(got, want, "{isa:?} n={n}");
            let exact: f64 = x.iter().map(|&v| (v as f64 - shift as f64).exp()).sum();
            assert!((sum as f64 - exact).abs() <= 1e-6 * exact.max(1.0), "{isa:?} n={n}");
        }
    }
}

#[test]
fn sigmoid_and_silu_match_f64() {
    let xs: Vec<f32> = (-4000..=4000)
        .map(|i| i as f32 * 0.025)
        .chain([f32::NEG_INFINITY, f32::INFINITY, -1e30, 1e30, 0.0])
        .collect();
    for isa in isas() {
        let (mut s, mut u) = (xs.clone(), xs.clone());
        sigmoid_on(isa, &mut s);
        silu_on(isa, &mut u);
        for ((&x, &s), &u) in xs.iter().zip(&s).zip(&u) {
            let xd = x as f64;
            let sd = 1.0 / (1.0 + (-xd).exp());
            // Below x = -88.7, e^-x overflows f32 and both give 0 (as f32 math does),
            // while the true values are tiny denormals: compare those absolutely.
            let close = |got: f32, want: f64, n: i64| {
                ulps(got, want) <= n || (got as f64 - want).abs() < 1e-36
            };
            assert!(close(s, sd, 3), "{isa:?}: sigmoid({x}) = {s}, want {sd}");
            if x.is_finite() {
                assert!(close(u, xd * sd, 4), "{isa:?}: silu({x}) = {u}, want {}", xd * sd);
            }
        }
        // silu(-inf) = -inf / inf is NaN in PyTorch too; silu(+inf) = +inf.
        let mut e = [f32::INFINITY];
        silu_on(isa, &mut e);
        assert_eq!(e[0], f32::INFINITY);
    }
}

#[test]
fn fused_paths_give_the_same_bits() {
    let fused: Vec<Isa> = isas().into_iter().filter(|&i| i != Isa::Portable).collect();
    let xs: Vec<f32> = sweep().into_iter().filter(|v| !v.is_nan()).collect();
    let run = |isa: Isa| {
        let (mut e, mut s, mut u, mut d) = (xs.clone(), xs.clone(), xs.clone(), xs.clone());
        exp_on(isa, &mut e);
        sigmoid_on(isa, &mut s);
        silu_on(isa, &mut u);
        let sums: Vec<u32> = [0usize, 5, 16, 31, 1000]
            .iter()
            .map(|&n| exp_sub_sum_on(isa, &mut d[..n], 1.5).to_bits())
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (bits(&e), bits(&s), bits(&u), bits(&d), sums)
    };
    if let Some((&first, rest)) = fused.split_first() {
        let want = run(first);
        for &isa in rest {
            assert!(run(isa) == want, "{isa:?} differs from {first:?}");
        }
    }
}
