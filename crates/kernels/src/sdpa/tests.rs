use half::bf16;

use super::*;
use crate::testutil::*;
use crate::Acc;

struct Case {
    s: SdpaShape,
    /// (batch_stride, head_stride, row_stride, len) of a mask with some -inf entries.
    mask: Option<(usize, usize, usize, usize)>,
}

fn cases() -> Vec<Case> {
    let sh = |batch, q_heads, kv_heads, q_len, kv_len, head_dim, v_dim, causal| SdpaShape {
        batch,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        v_dim,
        scale: 1.0 / (head_dim.max(1) as f64).sqrt(),
        causal,
    };
    vec![
        Case { s: sh(1, 1, 1, 1, 1, 1, 1, false), mask: None },
        Case { s: sh(2, 4, 2, 7, 33, 8, 5, false), mask: None },
        Case { s: sh(1, 2, 1, 65, 65, 16, 16, true), mask: None },
        Case { s: sh(1, 3, 3, 33, 130, 4, 6, true), mask: None },
        Case { s: sh(2, 2, 1, 70, 7, 6, 3, true), mask: None },
        // Key-padding mask [b, 1, 1, kv] broadcast over heads and rows.
        Case { s: sh(2, 4, 1, 33, 65, 8, 8, false), mask: Some((65, 0, 0, 2 * 65)) },
        // Full [b, h, q, kv] mask combined with causal.
        Case { s: sh(1, 2, 2, 65, 40, 8, 4, true), mask: Some((0, 65 * 40, 40, 2 * 65 * 40)) },
    ]
}

fn make_mask<T: Float>(rng: &mut Rng, len: usize, row: usize) -> Vec<T> {
    let mut m: Vec<T> = rng.vec(len, 1.0);
    for (idx, x) in m.iter_mut().enumerate() {
        if rng.below(4) == 0 || (row > 0 && idx / row.max(1) % 5 == 3) {
            *x = T::from_f64(f64::NEG_INFINITY);
        }
    }
    m
}

fn run<T: Float>(c: &Case, seed: u64) {
    for tiles in [SdpaTiles::forward(&c.s), SdpaTiles { q: 8, k: 16 }, SdpaTiles { q: 5, k: 3 }] {
        let mut rng = Rng::new(seed);
        let mdata: Vec<T> =
            c.mask.map_or(Vec::new(), |(_, _, rs, len)| make_mask(&mut rng, len, rs.max(1)));
        run_with(c, &mdata, tiles, &mut rng);
    }
}

fn run_with<T: Float>(c: &Case, mdata: &[T], tiles: SdpaTiles, rng: &mut Rng) {
    let s = &c.s;
    let nq = s.batch * s.q_heads * s.q_len;
    let nk = s.batch * s.kv_heads * s.kv_len;
    let q: Vec<T> = rng.vec(nq * s.head_dim, 1.5);
    let k: Vec<T> = rng.vec(nk * s.head_dim, 1.5);
    let v: Vec<T> = rng.vec(nk * s.v_dim, 1.0);
    let dout: Vec<T> = rng.vec(nq * s.v_dim, 1.0);
    let mask = c.mask.map(|(bs, hs, rs, _)| SdpaMask {
        data: mdata,
        batch_stride: bs,
        head_stride: hs,
        row_stride: rs,
    });
    let mf = f64s(mdata);
    let mask_f = c.mask.map(|(bs, hs, rs, _)| SdpaMask {
        data: &mf[..],
        batch_stride: bs,
        head_stride: hs,
        row_stride: rs,
    });
    let (qf, kf, vf, gf) = (f64s(&q), f64s(&k), f64s(&v), f64s(&dout));
    let (out_ref, lse_ref) = reference::sdpa_forward(s, &qf, &kf, &vf, mask_f.as_ref());
    let (dq_ref, dk_ref, dv_ref) = reference::sdpa_backward(s, &qf, &kf, &vf, mask_f.as_ref(), &gf);

    let mut out = vec![T::default(); nq * s.v_dim];
    let mut lse = vec![Acc::of(0.0); nq];
    sdpa_forward_tiled(s, tiles, &q, &k, &v, mask.as_ref(), &mut out, &mut lse).unwrap();
    let what = format!("{s:?} mask={:?} {tiles:?}", c.mask);
    assert_close_t(&format!("out {what}"), &out, &out_ref);
    let lse_f: Vec<f64> = lse.iter().map(|x| x.f64()).collect();
    assert_close(&format!("lse {what}"), &lse_f, &lse_ref, tol::<T>().min(1e-4));

    let mut dq = vec![T::default(); q.len()];
    let mut dk = vec![T::default(); k.len()];
    let mut dv = vec![T::default(); v.len()];
    let m = mask.as_ref();
    sdpa_backward_tiled(s, tiles, &q, &k, &v, m, &out, &lse, &dout, &mut dq, &mut dk, &mut dv)
        .unwrap();
    assert_close_t(&format!("dq {what}"), &dq, &dq_ref);
    assert_close_t(&format!("dk {what}"), &dk, &dk_ref);
    assert_close_t(&format!("dv {what}"), &dv, &dv_ref);
    for x in out.iter().chain(&dq).chain(&dk).chain(&dv) {
        assert!(!x.to_f64().is_nan(), "NaN in {what}");
    }
}

#[test]
fn matches_reference() {
    for (i, c) in cases().iter().enumerate() {
        run::<f32>(c, i as u64);
        run::<f64>(c, 100 + i as u64);
        run::<bf16>(c, 200 + i as u64);
    }
}

/// A `[b, 1, 1, kv]` key-padding mask (0 for tokens, `-inf` for padding) whose
/// padded and open runs cover whole tiles, partial tiles and whole batches.
#[test]
fn key_padding_masks_match_reference() {
    let kv = 70;
    // Tokens per batch: right padding, left padding, no padding, all padding.
    let rows: [Box<dyn Fn(usize) -> bool>; 4] =
        [Box::new(|j| j < 37), Box::new(|j| j >= 20), Box::new(|_| true), Box::new(|_| false)];
    let mdata: Vec<f64> = rows
        .iter()
        .flat_map(|tok| (0..kv).map(move |j| if tok(j) { 0.0 } else { f64::NEG_INFINITY }))
        .collect();
    for causal in [false, true] {
        let s = SdpaShape {
            batch: 4,
            q_heads: 4,
            kv_heads: 2,
            q_len: kv,
            kv_len: kv,
            head_dim: 8,
            v_dim: 8,
            scale: 0.35,
            causal,
        };
        let c = Case { s, mask: Some((kv, 0, 0, 4 * kv)) };
        // {5, 4}: 18 key tiles of 4 and 14 query tiles of 5, the last ones partial.
        let small = SdpaTiles { q: 5, k: 4 };
        for tiles in
            [SdpaTiles::backward(&s), SdpaTiles { q: 16, k: 16 }, SdpaTiles { q: 7, k: 10 }, small]
        {
            let m32: Vec<f32> = mdata.iter().map(|&x| x as f32).collect();
            run_with::<f32>(&c, &m32, tiles, &mut Rng::new(5));
            run_with::<f64>(&c, &mdata, tiles, &mut Rng::new(6));
        }
    }
}

/// One head of 300 keys (fewer heads than backward tasks, so the keys split into runs
/// with a `dq` partial each) with tiles of 3 keys: each run holds many key tiles, the
/// last run fewer, and the padding starts inside a tile.
#[test]
fn key_runs_with_dq_partials_match_reference() {
    let kv = 300;
    let mdata: Vec<f64> = (0..kv).map(|j| if j < 251 { 0.0 } else { f64::NEG_INFINITY }).collect();
    for causal in [false, true] {
        let s = SdpaShape {
            batch: 1,
            q_heads: 2,
            kv_heads: 1,
            q_len: 20,
            kv_len: kv,
            head_dim: 4,
            v_dim: 3,
            scale: 0.5,
            causal,
        };
        let c = Case { s, mask: Some((kv, 0, 0, kv)) };
        run_with::<f64>(&c, &mdata, SdpaTiles { q: 6, k: 3 }, &mut Rng::new(7));
        let m32: Vec<f32> = mdata.iter().map(|&x| x as f32).collect();
        run_with::<f32>(&c, &m32, SdpaTiles { q: 6, k: 3 }, &mut Rng::new(8));
    }
}

#[test]
fn fully_masked_rows_are_zero() {
    let s = SdpaShape {
        batch: 1,
        q_heads: 1,
        kv_heads: 1,
        q_len: 3,
        kv_len: 4,
        head_dim: 2,
        v_dim: 2,
        scale: 1.0,
        causal: false,
    };
    let ninf = f32::NEG_INFINITY;
    let m = [0.0, 0.0, ninf, 0.0, ninf, ninf, ninf, ninf, 0.0, ninf, ninf, ninf];
    let mask = SdpaMask { data: &m[..], batch_stride: 0, head_stride: 0, row_stride: 4 };
    let q = [1.0f32; 6];
    let k = [0.5f32; 8];
    let v = [2.0f32; 8];
    let mut out = [9.0f32; 6];
    let mut lse = [0.0f32; 3];
    sdpa_forward(&s, &q, &k, &v, Some(&mask), &mut out, &mut lse).unwrap();
    assert_eq!(&out[2..4], &[0.0, 0.0]);
    assert_eq!(lse[1], ninf);
    assert!((out[0] - 2.0).abs() < 1e-6 && (lse[2] - 1.0).abs() < 1e-6);
    let (mut dq, mut dk, mut dv) = ([0.0f32; 6], [0.0f32; 8], [0.0f32; 8]);
    let dout = [1.0f32; 6];
    sdpa_backward(&s, &q, &k, &v, Some(&mask), &out, &lse, &dout, &mut dq, &mut dk, &mut dv)
        .unwrap();
    assert_eq!(&dq[2..4], &[0.0, 0.0]);
    assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()));
}

#[test]
fn finite_differences() {
    let s = SdpaShape {
        batch: 1,
        q_heads: 2,
        kv_heads: 1,
        q_len: 5,
        kv_len: 6,
        head_dim: 3,
        v_dim: 2,
        scale: 0.7,
        causal: true,
    };
    let mut rng = Rng::new(11);
    let q: Vec<f64> = rng.vec(2 * 5 * 3, 1.0);
    let k: Vec<f64> = rng.vec(6 * 3, 1.0);
    let v: Vec<f64> = rng.vec(6 * 2, 1.0);
    let dout: Vec<f64> = rng.vec(2 * 5 * 2, 1.0);
    let mut m = [0.0; 6];
    m[2] = f64::NEG_INFINITY;
    m[4] = -0.5;
    let mask = SdpaMask { data: &m[..], batch_stride: 0, head_stride: 0, row_stride: 0 };
    let fwd = |q: &[f64], k: &[f64], v: &[f64]| {
        let mut out = vec![0.0; 20];
        let mut lse = vec![0.0; 10];
        sdpa_forward(&s, q, k, v, Some(&mask), &mut out, &mut lse).unwrap();
        (out, lse)
    };
    let (out, lse) = fwd(&q, &k, &v);
    let (mut dq, mut dk, mut dv) = (vec![0.0; 30], vec![0.0; 18], vec![0.0; 12]);
    sdpa_backward(&s, &q, &k, &v, Some(&mask), &out, &lse, &dout, &mut dq, &mut dk, &mut dv)
        .unwrap();
    assert_fd("dq", |x| fwd(x, &k, &v).0, &q, &dout, &dq);
    assert_fd("dk", |x| fwd(&q, x, &v).0, &k, &dout, &dk);
    assert_fd("dv", |x| fwd(&q, &k, x).0, &v, &dout, &dv);
}

#[test]
fn rejects_bad_arguments() {
    let s = SdpaShape {
        batch: 1,
        q_heads: 3,
        kv_heads: 2,
        q_len: 2,
        kv_len: 2,
        head_dim: 2,
        v_dim: 2,
        scale: 1.0,
        causal: false,
    };
    let (q, k, v) = ([0.0f32; 12], [0.0f32; 8], [0.0f32; 8]);
    let (mut out, mut lse) = ([0.0f32; 12], [0.0f32; 6]);
    assert!(sdpa_forward(&s, &q, &k, &v, None, &mut out, &mut lse).is_err());
    let s = SdpaShape { q_heads: 2, ..s };
    let (q, mut out, mut lse) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 4]);
    assert!(sdpa_forward(&s, &q, &k, &v, None, &mut out, &mut lse).is_ok());
    assert!(sdpa_forward(&s, &q[..7], &k, &v, None, &mut out, &mut lse).is_err());
    let m = [0.0f32; 7];
    let mask = SdpaMask { data: &m[..], batch_stride: 0, head_stride: 4, row_stride: 2 };
    assert!(sdpa_forward(&s, &q, &k, &v, Some(&mask), &mut out, &mut lse).is_err());
    let mask = SdpaMask { row_stride: usize::MAX, ..mask };
    assert!(sdpa_forward(&s, &q, &k, &v, Some(&mask), &mut out, &mut lse).is_err());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    #[test]
    fn random_shapes(
        batch in 1usize..3, kv_heads in 1usize..3, group in 1usize..4,
        q_len in 1usize..80, kv_len in 1usize..80, head_dim in 1usize..10, v_dim in 1usize..10,
        causal: bool, masked: bool, seed: u64,
    ) {
        let s = SdpaShape {
            batch, q_heads: kv_heads * group, kv_heads, q_len, kv_len, head_dim, v_dim,
            scale: 0.5, causal,
        };
        // A per-batch key-padding mask broadcast over heads and rows.
        let mask = masked.then_some((kv_len, 0, 0, batch * kv_len));
        let c = Case { s, mask };
        run::<f64>(&c, seed);
        run::<f32>(&c, seed);
    }
}

/// The Llama step's causal attention (8 / 4 heads of 32, 256 positions) at the tiles
/// the kernels use, where causal tiles on the diagonal are cut into row pieces that
/// see fewer keys (on the narrow tile kernel in f32, with AVX-512): equal to the
/// reference, plain and with a key-padding mask; and at other tile sizes whose pieces
/// end inside a tile.
#[test]
fn causal_diagonal_pieces_match_reference() {
    let s = SdpaShape {
        batch: 1,
        q_heads: 8,
        kv_heads: 4,
        q_len: 256,
        kv_len: 256,
        head_dim: 32,
        v_dim: 32,
        scale: 1.0 / 32f64.sqrt(),
        causal: true,
    };
    let pad: Vec<f32> = (0..256).map(|j| if j >= 200 { f32::NEG_INFINITY } else { 0.0 }).collect();
    for mask in [None, Some((256, 0, 0, 256))] {
        let c = Case { s, mask };
        let m: &[f32] = if mask.is_some() { &pad } else { &[] };
        for tiles in [
            SdpaTiles::forward(&s),
            SdpaTiles::backward(&s),
            SdpaTiles { q: 96, k: 48 },
            SdpaTiles { q: 100, k: 70 },
        ] {
            run_with::<f32>(&c, m, tiles, &mut Rng::new(11));
        }
    }
}

/// A head dim of 0 (every score 0, uniform attention over the keys a query sees) or a
/// value dim of 0 (an empty output) at the default tiles, causal and not: no panic, and
/// the reference's values.
#[test]
fn empty_head_dims_match_reference() {
    for (causal, (head_dim, v_dim)) in [false, true]
        .into_iter()
        .zip([(0, 4), (4, 0)])
        .chain([false, true].into_iter().zip([(4, 0), (0, 4)]))
    {
        let s = SdpaShape {
            batch: 1,
            q_heads: 2,
            kv_heads: 1,
            q_len: 70,
            kv_len: 70,
            head_dim,
            v_dim,
            scale: 1.0,
            causal,
        };
        let c = Case { s, mask: None };
        for tiles in [SdpaTiles::forward(&s), SdpaTiles::backward(&s)] {
            run_with::<f32>(&c, &[], tiles, &mut Rng::new(3));
        }
    }
}
