//! The Llama's attention helpers on their own: the causal + padding mask builder
//! (which key each query may see, under right, left and middle padding and none), the
//! RoPE tables (HF layout: `cos`/`sin` of `p * base^(-2i/d)` with `i = j mod d/2`, the
//! frequencies repeated over both halves of the head dim) and `Tensor::rope` applying
//! them (rotate-half: pairs `(j, j + d/2)`), against values computed here.

use tpar_models::{causal_padding_mask, RotaryPositionEncoding};
use tpar_nn::NnError;
use tpar_tensor::{DType, Device, Rng, RopeLayout, Tensor};

// ---------------------------------------------------------------------------------------
// causal_padding_mask
// ---------------------------------------------------------------------------------------

/// The keys query `i` of sequence `b` may attend: the tokens among positions `0..=i`.
fn visible_keys(pad: Option<&[i64]>, seq: usize, b: usize, i: usize) -> Vec<usize> {
    (0..=i).filter(|&j| pad.is_none_or(|p| p[b * seq + j] == 1)).collect()
}

/// Checks shape, dtype and, for every (batch, query), that exactly the visible keys
/// hold 0 and every other key `-inf`.
fn check_mask(pad: Option<&[i64]>, batch: usize, seq: usize, pad_dtype: DType, dtype: DType) {
    let what = format!("pad {pad:?} ({pad_dtype:?}) batch {batch} seq {seq} -> {dtype:?}");
    let am = pad.map(|p| {
        let v: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        Tensor::from_f64(&v, [batch, seq], pad_dtype).unwrap()
    });
    let m = causal_padding_mask(am.as_ref(), batch, seq, dtype).unwrap();
    assert_eq!(m.dims(), &[batch, 1, seq, seq], "{what}: shape");
    assert_eq!(m.dtype(), dtype, "{what}: dtype");
    let v = m.to_vec_f64().unwrap();
    for b in 0..batch {
        for i in 0..seq {
            let row = &v[(b * seq + i) * seq..][..seq];
            assert!(
                row.iter().all(|&x| x == 0.0 || x == f64::NEG_INFINITY),
                "{what}: batch {b} query {i}: values other than 0 and -inf: {row:?}"
            );
            let open: Vec<usize> = (0..seq).filter(|&j| row[j] == 0.0).collect();
            assert_eq!(open, visible_keys(pad, seq, b, i), "{what}: batch {b} query {i}");
        }
    }
}

#[test]
fn causal_padding_mask_opens_exactly_the_earlier_tokens() {
    let patterns: Vec<(usize, usize, Option<Vec<i64>>)> = vec![
        (2, 5, None),
        (1, 1, None),
        // Right padding, different lengths per sequence.
        (2, 5, Some(vec![1, 1, 1, 0, 0, 1, 1, 1, 1, 1])),
        // Left padding: the leading queries see nothing at all.
        (2, 5, Some(vec![0, 0, 1, 1, 1, 0, 1, 1, 1, 1])),
        // Padding in the middle.
        (2, 6, Some(vec![1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 1, 0])),
        // All padding, all tokens, length one.
        (3, 4, Some(vec![0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1])),
        (2, 1, Some(vec![1, 0])),
    ];
    for (batch, seq, pad) in &patterns {
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            check_mask(pad.as_deref(), *batch, *seq, DType::I64, dtype);
        }
        check_mask(pad.as_deref(), *batch, *seq, DType::F32, DType::F32);
    }
    // A random pattern on a longer sequence.
    let mut rng = Rng::new(7);
    let (batch, seq) = (3, 19);
    let pad: Vec<i64> = (0..batch * seq).map(|_| (rng.below(3) != 0) as i64).collect();
    check_mask(Some(&pad), batch, seq, DType::I64, DType::F32);
    // An all-ones mask is the same as none.
    let ones = Tensor::from_vec(vec![1i64; 2 * 6], [2, 6]).unwrap();
    let a = causal_padding_mask(Some(&ones), 2, 6, DType::F32).unwrap();
    let b = causal_padding_mask(None, 2, 6, DType::F32).unwrap();
    assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
}

#[test]
fn causal_padding_mask_rejects_a_wrong_shape_with_a_typed_error() {
    let (batch, seq) = (2, 5);
    for shape in [vec![2, 4], vec![1, 5], vec![5, 2], vec![10], vec![2, 5, 1]] {
        let n: usize = shape.iter().product();
        let am = Tensor::from_vec(vec![1i64; n], shape.clone()).unwrap();
        match causal_padding_mask(Some(&am), batch, seq, DType::F32) {
            Err(NnError::BadInput { module, what }) => {
                assert_eq!(module, "LlamaModel");
                assert!(what.contains("attention_mask"), "{what}");
                assert!(what.contains(&format!("{shape:?}")), "{what}: names the shape given");
                assert!(what.contains("[2, 5]"), "{what}: names the shape expected");
            }
            other => panic!("{shape:?}: expected BadInput, got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// RoPE tables
// ---------------------------------------------------------------------------------------

/// `p * theta_i`, `theta_i = 1 / base^(2i / d)`: HF's `inv_freq` for frequency index `i`.
fn angle(base: f64, d: usize, i: usize, p: usize) -> f64 {
    p as f64 / base.powf((2 * i) as f64 / d as f64)
}

#[test]
fn rope_tables_hold_hf_frequencies_repeated_over_both_halves() {
    for (base, d, max_pos) in [(10_000.0, 8, 64), (500_000.0, 64, 4096), (10_000.0, 2, 5)] {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-7)] {
            let rope = RotaryPositionEncoding::new(d, max_pos, base, dtype).unwrap();
            let seq = max_pos;
            let t = rope.tables(seq).unwrap();
            let what = format!("base {base} head_dim {d} {dtype:?}");
            for x in [&t.cos, &t.sin] {
                assert_eq!(x.dims(), &[seq, d], "{what}");
                assert_eq!(x.dtype(), dtype, "{what}");
            }
            let (c, s) = (t.cos.to_vec_f64().unwrap(), t.sin.to_vec_f64().unwrap());
            let half = d / 2;
            for p in [0, 1, 2, 3, 17, seq / 2, seq - 1].into_iter().filter(|&p| p < seq) {
                for j in 0..d {
                    // Column j and column j + d/2 share frequency index j mod d/2.
                    let a = angle(base, d, j % half, p);
                    let (gc, gs) = (c[p * d + j], s[p * d + j]);
                    assert!((gc - a.cos()).abs() <= tol, "{what}: cos[{p}, {j}] = {gc}");
                    assert!((gs - a.sin()).abs() <= tol, "{what}: sin[{p}, {j}] = {gs}");
                }
            }
            // Shorter tables are the leading rows; on the host, tables_on is tables.
            let short = rope.tables(3.min(seq)).unwrap();
            assert_eq!(short.cos.to_vec_f64().unwrap(), c[..3.min(seq) * d]);
            let on = rope.tables_on(seq, Device::Cpu).unwrap();
            assert_eq!(on.sin.to_vec_f64().unwrap(), s);
        }
    }
}

#[test]
fn rope_tables_past_max_positions_are_a_typed_error() {
    let rope = RotaryPositionEncoding::new(8, 16, 10_000.0, DType::F32).unwrap();
    assert_eq!(rope.tables(16).unwrap().cos.dims(), &[16, 8]);
    assert_eq!(rope.tables(0).unwrap().sin.dims(), &[0, 8]);
    for seq in [17, 1000] {
        for r in [rope.tables(seq), rope.tables_on(seq, Device::Cpu)] {
            match r {
                Err(NnError::Config { what }) => {
                    assert!(what.contains(&seq.to_string()) && what.contains("16"), "{what}")
                }
                other => panic!("seq {seq}: expected Config, got {other:?}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tensor::rope with the tables
// ---------------------------------------------------------------------------------------

/// Rotates each pair `(x[j], x[j + d/2])` of a head vector at position `p` by
/// `p * theta_j` (or by its negative: the transpose, which is the gradient map).
fn rotate(x: &[f64], base: f64, p: usize, inverse: bool) -> Vec<f64> {
    let d = x.len();
    let half = d / 2;
    let mut y = vec![0.0; d];
    for j in 0..half {
        let a = angle(base, d, j, p);
        let (c, s) = (a.cos(), if inverse { -a.sin() } else { a.sin() });
        let (x1, x2) = (x[j], x[j + half]);
        y[j] = x1 * c - x2 * s;
        y[j + half] = x2 * c + x1 * s;
    }
    y
}

#[test]
fn rope_rotates_pairs_j_and_j_plus_half_by_the_position_angle() {
    let (b, h, seq, d, base) = (2, 3, 11, 8, 10_000.0);
    let mut rng = Rng::new(3);
    let n = b * h * seq * d;
    let xs: Vec<f64> = (0..n).map(|_| rng.uniform() * 2.0 - 1.0).collect();
    let rs: Vec<f64> = (0..n).map(|_| rng.uniform() * 2.0 - 1.0).collect();
    // Offset of element (b, h, t, j) in each layout.
    let at = |layout: RopeLayout, bi: usize, hi: usize, t: usize| match layout {
        RopeLayout::Bhsd => ((bi * h + hi) * seq + t) * d,
        RopeLayout::Bshd => ((bi * seq + t) * h + hi) * d,
    };
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        let rope = RotaryPositionEncoding::new(d, 32, base, dtype).unwrap();
        let tables = rope.tables(seq).unwrap();
        for layout in [RopeLayout::Bhsd, RopeLayout::Bshd] {
            let what = format!("{dtype:?} {layout:?}");
            let shape = match layout {
                RopeLayout::Bhsd => [b, h, seq, d],
                RopeLayout::Bshd => [b, seq, h, d],
            };
            // The same head vectors laid out per `layout`.
            let (mut xl, mut rl) = (vec![0.0; n], vec![0.0; n]);
            for bi in 0..b {
                for hi in 0..h {
                    for t in 0..seq {
                        let (src, dst) = (at(RopeLayout::Bhsd, bi, hi, t), at(layout, bi, hi, t));
                        xl[dst..dst + d].copy_from_slice(&xs[src..src + d]);
                        rl[dst..dst + d].copy_from_slice(&rs[src..src + d]);
                    }
                }
            }
            let x = Tensor::from_f64(&xl, shape, dtype).unwrap().requires_grad_(true);
            let r = Tensor::from_f64(&rl, shape, dtype).unwrap();
            let y = x.rope(&tables.cos, &tables.sin, layout).unwrap();
            y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            let (yv, gv) = (y.to_vec_f64().unwrap(), x.grad().unwrap().to_vec_f64().unwrap());
            let (xv, rv) = (x.to_vec_f64().unwrap(), r.to_vec_f64().unwrap());
            for bi in 0..b {
                for hi in 0..h {
                    for t in 0..seq {
                        let o = at(layout, bi, hi, t);
                        let want = rotate(&xv[o..o + d], base, t, false);
                        let gwant = rotate(&rv[o..o + d], base, t, true);
                        for j in 0..d {
                            let where_ = format!("{what} b {bi} h {hi} pos {t} j {j}");
                            assert!((yv[o + j] - want[j]).abs() <= tol, "y {where_}");
                            assert!((gv[o + j] - gwant[j]).abs() <= tol, "grad {where_}");
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// key_padding_mask
// ---------------------------------------------------------------------------------------

/// The `[b, 1, 1, s]` key mask with causal attention (what the model runs) attends
/// exactly as the explicit `[b, 1, s, s]` causal + padding mask without the flag, forward
/// and backward, under right, left and middle padding and a fully padded sequence.
#[test]
fn key_padding_mask_with_causal_attention_equals_the_full_mask() {
    let (batch, heads, seq, hd) = (4, 2, 9, 4);
    let pad: Vec<i64> = [
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 1, 1],
        [1, 0, 1, 1, 0, 1, 1, 0, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    .concat();
    let am = Tensor::from_vec(pad, [batch, seq]).unwrap();
    let keys = tpar_models::key_padding_mask(&am, batch, seq, DType::F32).unwrap();
    assert_eq!(keys.dims(), &[batch, 1, 1, seq]);
    let full = causal_padding_mask(Some(&am), batch, seq, DType::F32).unwrap();
    let mut rng = Rng::new(3);
    let mk = |rng: &mut Rng| {
        Tensor::randn([batch, heads, seq, hd], DType::F32, rng).unwrap().requires_grad_(true)
    };
    let (q, k, v) = (mk(&mut rng), mk(&mut rng), mk(&mut rng));
    let run = |mask: &Tensor, causal: bool| {
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(mask), causal, None).unwrap();
        let (gq, gk, gv) = {
            y.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
            let g = |t: &Tensor| t.grad().unwrap().to_vec_f64().unwrap();
            let r = (g(&q), g(&k), g(&v));
            for t in [&q, &k, &v] {
                t.zero_grad();
            }
            r
        };
        (y.to_vec_f64().unwrap(), gq, gk, gv)
    };
    let a = run(&keys, true);
    let b = run(&full, false);
    for (what, x, y) in
        [("out", &a.0, &b.0), ("dq", &a.1, &b.1), ("dk", &a.2, &b.2), ("dv", &a.3, &b.3)]
    {
        for (i, (x, y)) in x.iter().zip(y).enumerate() {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
        }
    }
}

/// Linear RoPE scaling interpolates positions: the scaled tables at position `2p` equal
/// the plain tables at `p` (factor 2), and a bad factor is a typed error naming it.
#[test]
fn linear_rope_scaling_interpolates_positions() {
    use tpar_models::{LlamaConfig, RopeScaling};
    let plain = RotaryPositionEncoding::new(8, 32, 10_000.0, DType::F64).unwrap();
    let scaled = RotaryPositionEncoding::new(8, 32, 10_000.0, DType::F64)
        .unwrap()
        .with_scaling(Some(RopeScaling::Linear { factor: 2.0 }));
    let (p, s) = (plain.tables(16).unwrap(), scaled.tables(32).unwrap());
    for (a, b) in [(&p.cos, &s.cos), (&p.sin, &s.sin)] {
        let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
        for pos in 0..16 {
            for j in 0..8 {
                let (x, y) = (a[pos * 8 + j], b[2 * pos * 8 + j]);
                assert!((x - y).abs() <= 1e-12, "position {pos} dim {j}: {x} vs {y}");
            }
        }
    }
    let cfg = LlamaConfig {
        rope_scaling: Some(RopeScaling::Linear { factor: 0.0 }),
        ..LlamaConfig {
            hidden_size: 16,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            ..Default::default()
        }
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("rope_scaling") && err.contains("factor"), "{err}");
}
