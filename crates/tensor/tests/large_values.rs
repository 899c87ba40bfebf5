//! `Tensor::cross_entropy`, `softmax`/`log_softmax` (last and non-last dim) and
//! `Tensor::scaled_dot_product_attention` (grouped-query heads, causal, masks of every
//! broadcast form) on logits and scores of magnitude 1e3..1e4, forward and gradients,
//! in f32 and f64, against f64 loops written out here with their own max shift.
//! Rows mix large positive and negative values, put near-ties in different blocks of
//! the CPU kernels (256 columns for cross-entropy, 64 keys for attention) and sometimes
//! let one entry dominate, so a kernel that skips the max shift (inf/NaN, or an all-zero
//! sum), shifts by the wrong max or skips the online rescale fails here.
//!
//! Inputs are multiples of 1/4 (scores of 1/64), exact in f32; tolerances scale with
//! the rounding the dtype must make: a log-sum-exp of size `M` rounds at `eps * M`, and
//! what is computed from it inherits that relative error.

use tpar_tensor::{DType, Rng, Tensor};

const IGNORE: i64 = -100;
/// Multiple of the rounding error a result may carry.
const K: f64 = 4.0;
/// Absolute slack for results so small that f32 holds them as subnormals.
const TINY: f64 = 1e-30;
const DTYPES: [DType; 2] = [DType::F32, DType::F64];

/// Test data on a grid of quarters, which f32 holds exactly.
trait Quarters {
    /// A multiple of 1/4 in `[-r, r]` (`4 r` an integer).
    fn quarter(&mut self, r: f64) -> f64;
    /// `n` of them.
    fn quarters(&mut self, n: usize, r: f64) -> Vec<f64> {
        (0..n).map(|_| self.quarter(r)).collect()
    }
}

impl Quarters for Rng {
    fn quarter(&mut self, r: f64) -> f64 {
        let n = (4.0 * r) as u64;
        self.below(2 * n + 1) as f64 / 4.0 - r
    }
}

fn eps(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON,
        DType::F32 => f32::EPSILON as f64,
        other => panic!("no tolerance for {other:?}"),
    }
}

fn tensor(v: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_f64(v, shape.to_vec(), dtype).unwrap()
}

fn leaf(v: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    tensor(v, shape, dtype).requires_grad_(true)
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

fn grad_of(t: &Tensor) -> Vec<f64> {
    values(&t.grad().expect("a gradient"))
}

/// `|got - want| <= atol(i)` for every element; an infinite `want` must be matched
/// exactly, and NaN never passes.
fn check(what: &str, got: &[f64], want: &[f64], atol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() { g == w } else { (g - w).abs() <= atol(i) };
        assert!(ok, "{what}[{i}]: got {g}, want {w} (allowed {})", atol(i));
    }
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().filter(|x| x.is_finite()).fold(0.0, |m, x| m.max(x.abs()))
}

// ---------------------------------------------------------------------------------------
// Cross-entropy and softmax
// ---------------------------------------------------------------------------------------

/// Logit rows of magnitude 1e3..1e4 (`±off` plus multiples of 1/4 in [-3, 3]); rows
/// cycle through: all positive with a peak per 256-column block rising block after
/// block; all negative with peaks falling; mixed runs of both signs with the first
/// element far below the max and the last block (columns 450..) all negative, far
/// below the running max; one entry 40 above the rest (the target, or not).
fn logit_rows(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f64> {
    let offs = [1000.0, 2500.0, 5000.0, 8000.0, 9750.0];
    let mut x = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let (off, kind) = (offs[r % offs.len()], r % 5);
        let sign = if r % 2 == 0 { 1.0 } else { -1.0 };
        let mut row: Vec<f64> = (0..cols)
            .map(|j| {
                let base = match kind {
                    0 => off,
                    1 => -off,
                    2 if j == 0 || j >= 450 || (j / 40) % 2 == 1 => -off,
                    2 => off,
                    _ => sign * off,
                };
                base + rng.quarter(3.0)
            })
            .collect();
        for b in 0..cols.div_ceil(256) {
            let c = (b * 256 + 17).min(cols - 1);
            match kind {
                0 => row[c] = off + 4.0 + b as f64,
                1 => row[c] = -off + 4.0 - b as f64,
                2 if row[c] > 0.0 => row[c] = off + 4.0 + b as f64,
                _ => {}
            }
        }
        if kind >= 3 {
            row[cols - 1 - cols / 7] = sign * off + 40.0;
        }
        x.extend(row);
    }
    x
}

/// `log_softmax(x)` of each row: `(x - m) - ln(sum(exp(x - m)))`, `m` the row max.
fn log_softmax_rows(x: &[f64], cols: usize) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(cols) {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let ln_sum = row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
        y.extend(row.iter().map(|&v| (v - m) - ln_sum));
    }
    y
}

/// `softmax(x)` of each row.
fn softmax_rows(x: &[f64], cols: usize) -> Vec<f64> {
    log_softmax_rows(x, cols).into_iter().map(f64::exp).collect()
}

#[test]
fn cross_entropy_on_logits_of_thousands() {
    for dtype in DTYPES {
        let mut rng = Rng::new(1);
        for (b, s, vocab) in [(2, 6, 600), (3, 2, 7)] {
            let rows = b * s;
            let xf = logit_rows(&mut rng, rows, vocab);
            let targets: Vec<i64> = (0..rows)
                .map(|r| match r % 5 {
                    3 => (vocab - 1 - vocab / 7) as i64,
                    _ if r % 6 == 5 => IGNORE,
                    _ => rng.below(vocab as u64) as i64,
                })
                .collect();
            let what = format!("{dtype:?} [{b}, {s}, {vocab}]");
            let logits = leaf(&xf, &[b, s, vocab], dtype);
            let t = Tensor::from_vec(targets.clone(), [b, s]).unwrap();
            let loss = logits.cross_entropy(&t, IGNORE).unwrap();

            // The oracle: mean over kept rows of lse - x[t], lse = m + ln(sum(exp(x - m))).
            let kept = targets.iter().filter(|&&t| t != IGNORE).count() as f64;
            let mut want = 0.0;
            for (row, &ti) in xf.chunks(vocab).zip(&targets) {
                if ti != IGNORE {
                    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let lse = m + row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
                    want += (lse - row[ti as usize]) / kept;
                }
            }
            let m1 = 1.0 + max_abs(&xf);
            let tol = K * eps(dtype) * (vocab as f64).sqrt();
            check(&format!("loss {what}"), &values(&loss), &[want], |_| tol * m1);

            // d loss / d x = (softmax(x) - onehot(t)) / kept, zero for ignored rows.
            loss.backward().unwrap();
            let p = softmax_rows(&xf, vocab);
            let mut dwant = vec![0.0; rows * vocab];
            for (r, &ti) in targets.iter().enumerate() {
                if ti != IGNORE {
                    for c in 0..vocab {
                        let onehot = f64::from(c as i64 == ti);
                        dwant[r * vocab + c] = (p[r * vocab + c] - onehot) / kept;
                    }
                }
            }
            check(&format!("dlogits {what}"), &grad_of(&logits), &dwant, |i| {
                tol * (m1 * p[i] / kept + dwant[i].abs()) + TINY
            });
        }
    }
}

/// `softmax`/`log_softmax` of `[rows, cols]` over the last dim, and of its transpose
/// `[cols, rows]` over dim 0; gradients of `sum(y * r)`.
#[test]
fn softmax_and_log_softmax_on_logits_of_thousands() {
    for dtype in DTYPES {
        let mut rng = Rng::new(2);
        for (rows, cols) in [(10, 600), (5, 6)] {
            let xf = logit_rows(&mut rng, rows, cols);
            let rf = rng.quarters(rows * cols, 1.0);
            let p = softmax_rows(&xf, cols);
            let logp = log_softmax_rows(&xf, cols);
            let tol = K * eps(dtype) * (cols as f64).sqrt();
            // Transposed copies for the dim-0 case.
            let tr = |v: &[f64]| -> Vec<f64> {
                (0..rows * cols).map(|i| v[(i % rows) * cols + i / rows]).collect()
            };
            for log in [false, true] {
                // dx = y (r - sum(r y)); for log-softmax dx = r - softmax * sum(r).
                let mut dwant = Vec::new();
                let mut dtol = Vec::new();
                for ((pr, lr), rr) in p.chunks(cols).zip(logp.chunks(cols)).zip(rf.chunks(cols)) {
                    let s: f64 = pr.iter().zip(rr).map(|(a, b)| a * b).sum();
                    let s_abs: f64 = pr.iter().zip(rr).map(|(a, b)| (a * b).abs()).sum();
                    let r_sum: f64 = rr.iter().sum();
                    let r_abs: f64 = rr.iter().map(|v| v.abs()).sum();
                    for c in 0..cols {
                        if log {
                            dwant.push(rr[c] - pr[c] * r_sum);
                            dtol.push(tol * (rr[c].abs() + pr[c] * r_abs * (1.0 + lr[c].abs())));
                        } else {
                            dwant.push(pr[c] * (rr[c] - s));
                            dtol.push(tol * pr[c] * (rr[c].abs() + s_abs));
                        }
                    }
                }
                let want = if log { &logp } else { &p };
                // Probabilities: relative error; log-probabilities: absolute eps * |log p|.
                let ytol = |i: usize| {
                    let w = want[i].abs();
                    if log {
                        tol * (1.0 + w)
                    } else {
                        tol * w + TINY
                    }
                };
                for dim0 in [false, true] {
                    let what = format!("{dtype:?} log={log} [{rows}, {cols}] dim0={dim0}");
                    let (x, r) = if dim0 {
                        (
                            leaf(&tr(&xf), &[cols, rows], dtype),
                            tensor(&tr(&rf), &[cols, rows], dtype),
                        )
                    } else {
                        (leaf(&xf, &[rows, cols], dtype), tensor(&rf, &[rows, cols], dtype))
                    };
                    let dim = if dim0 { 0 } else { -1 };
                    let y = if log { x.log_softmax(dim) } else { x.softmax(dim) }.unwrap();
                    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
                    let (mut got, mut dgot) = (values(&y), grad_of(&x));
                    if dim0 {
                        // Back to [rows, cols] order.
                        let back = |v: &[f64]| -> Vec<f64> {
                            (0..rows * cols).map(|i| v[(i % cols) * rows + i / cols]).collect()
                        };
                        (got, dgot) = (back(&got), back(&dgot));
                    }
                    check(&format!("y {what}"), &got, want, ytol);
                    check(&format!("dx {what}"), &dgot, &dwant, |i| dtol[i] + TINY);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------

const HD: usize = 16;
const VD: usize = 8;
const KEY_TILE: usize = 64;

#[derive(Clone, Copy, Debug)]
struct Attn {
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    causal: bool,
}

/// q `[b, hq, sq, 16]`, k `[b, hkv, sk, 16]`, v `[b, hkv, sk, 8]` and the weights `r` of
/// the loss `sum(out * r)`. The default scale is 1/4 and the score of query `i` and key
/// `j` is `sigma_i * P_j` plus a few units: `sigma_i = ±1` alternates over rows and
/// heads and doubles on every third row (neighbouring rows' maxima differ by
/// thousands), `P_j = s_j * big + f_j` with `big` 1500..5000 per kv head, `s_j` mixed in key
/// tile 0 (key 0 negative), positive in tile 1, negative in tile 2, alternating in tile
/// 3, and peaks `f_j = s_j * (4 + tile)` at offsets 5 and 6 of each tile (the running
/// max rises, drops far, rises again). Every fifth row gets one key 40 above the rest.
fn attn_data(a: &Attn, seed: u64) -> [Vec<f64>; 4] {
    let mut rng = Rng::new(seed);
    let bigs = [3000.0, 4000.0, 1500.0, 5000.0];
    let mut k = Vec::with_capacity(a.b * a.hkv * a.sk * HD);
    for g in 0..a.b * a.hkv {
        for j in 0..a.sk {
            let tile = j / KEY_TILE;
            let sj = match tile % 4 {
                0 if j % 3 == 0 => -1.0,
                0 | 1 => 1.0,
                2 => -1.0,
                _ if j % 2 == 0 => 1.0,
                _ => -1.0,
            };
            let f = match j % KEY_TILE {
                5 | 6 => sj * (4.0 + tile as f64),
                _ => rng.quarter(3.0),
            };
            k.push(4.0 * (sj * bigs[g % 4] + f));
            for c in 1..HD {
                let x = rng.quarter(2.0);
                k.push(if (c, j) == (1, 100) || (c, j) == (2, 140) { 40.0 } else { x });
            }
        }
    }
    let mut q = Vec::with_capacity(a.b * a.hq * a.sq * HD);
    for bh in 0..a.b * a.hq {
        for i in 0..a.sq {
            let sigma = if (i + bh) % 2 == 0 { 1.0 } else { -1.0 };
            q.push(if i % 3 == 1 { 2.0 * sigma } else { sigma });
            for c in 1..HD {
                let x = rng.quarter(1.0);
                q.push(if i % 5 == 4 && c <= 2 { 4.0 } else { x });
            }
        }
    }
    let v = rng.quarters(a.b * a.hkv * a.sk * VD, 1.0);
    let r = rng.quarters(a.b * a.hq * a.sq * VD, 1.0);
    [q, k, v, r]
}

/// An additive mask and its shape (broadcast to `[b, hq, sq, sk]` by the op).
struct Mask {
    data: Vec<f64>,
    shape: Vec<usize>,
}

impl Mask {
    /// The mask value for `(b, h, i, j)`, broadcasting dims of size 1 (and missing
    /// leading dims).
    fn at(&self, idx: [usize; 4]) -> f64 {
        let shape: Vec<usize> = std::iter::repeat_n(1, 4 - self.shape.len())
            .chain(self.shape.iter().copied())
            .collect();
        let mut off = 0;
        for d in 0..4 {
            off = off * shape[d] + if shape[d] == 1 { 0 } else { idx[d] };
        }
        self.data[off]
    }
}

fn masks(a: &Attn, rng: &mut Rng) -> Vec<Option<Mask>> {
    let ninf = f64::NEG_INFINITY;
    let mut key_pad = vec![0.0; a.b * a.sk];
    for b in 0..a.b {
        for j in [69, 70, 197, 198] {
            if j < a.sk {
                key_pad[b * a.sk + j] = ninf;
            }
        }
        let pad = 3 + 11 * b;
        key_pad[(b + 1) * a.sk - pad..(b + 1) * a.sk].fill(ninf);
    }
    let mut pick = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| match rng.below(16) {
                0 | 1 => ninf,
                2 => 1250.5,
                3 => -2500.0,
                4 => -1000.25,
                _ => 0.0,
            })
            .collect()
    };
    let mut full = pick(a.b * a.hq * a.sq * a.sk);
    // One query row that sees nothing.
    let row = ((a.b * a.hq - 1) * a.sq + a.sq / 2) * a.sk;
    full[row..row + a.sk].fill(ninf);
    vec![
        None,
        Some(Mask { data: key_pad, shape: vec![a.b, 1, 1, a.sk] }),
        Some(Mask { data: pick(a.sq * a.sk), shape: vec![a.sq, a.sk] }),
        Some(Mask { data: full, shape: vec![a.b, a.hq, a.sq, a.sk] }),
    ]
}

/// Output, gradients of `sum(out * r)` for q, k, v, and for each of these the sum of
/// the magnitudes of its terms; the largest finite |score|.
struct AttnRef {
    out: [Vec<f64>; 2],
    dq: [Vec<f64>; 2],
    dk: [Vec<f64>; 2],
    dv: [Vec<f64>; 2],
    max_score: f64,
}

fn attn_reference(a: &Attn, x: &[Vec<f64>; 4], mask: Option<&Mask>) -> AttnRef {
    let [q, k, v, r] = x;
    let scale = 0.25;
    let zeros = |n: usize| [vec![0.0; n], vec![0.0; n]];
    let mut o = AttnRef {
        out: zeros(r.len()),
        dq: zeros(q.len()),
        dk: zeros(k.len()),
        dv: zeros(v.len()),
        max_score: 0.0,
    };
    for b in 0..a.b {
        for h in 0..a.hq {
            let g = b * a.hkv + h / (a.hq / a.hkv);
            for i in 0..a.sq {
                let row = (b * a.hq + h) * a.sq + i;
                let qi = &q[row * HD..][..HD];
                let scores: Vec<f64> = (0..a.sk)
                    .map(|j| {
                        let add = mask.map_or(0.0, |m| m.at([b, h, i, j]));
                        if (a.causal && j > i) || add == f64::NEG_INFINITY {
                            return f64::NEG_INFINITY;
                        }
                        let kj = &k[(g * a.sk + j) * HD..][..HD];
                        scale * qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f64>() + add
                    })
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if mx == f64::NEG_INFINITY {
                    continue; // nothing visible: zero output and gradients
                }
                o.max_score = max_abs(&scores).max(o.max_score);
                let sum: f64 = scores.iter().map(|&s| (s - mx).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|&s| (s - mx).exp() / sum).collect();
                let ri = &r[row * VD..][..VD];
                let vj = |j: usize| &v[(g * a.sk + j) * VD..][..VD];
                for j in 0..a.sk {
                    for c in 0..VD {
                        o.out[0][row * VD + c] += p[j] * vj(j)[c];
                        o.out[1][row * VD + c] += p[j] * vj(j)[c].abs();
                        o.dv[0][(g * a.sk + j) * VD + c] += p[j] * ri[c];
                        o.dv[1][(g * a.sk + j) * VD + c] += p[j] * ri[c].abs();
                    }
                }
                let dp: Vec<f64> =
                    (0..a.sk).map(|j| vj(j).iter().zip(ri).map(|(x, y)| x * y).sum()).collect();
                let dsum: f64 = p.iter().zip(&dp).map(|(x, y)| x * y).sum();
                // The backward takes sum(p * dp) as r . out, from the rounded out.
                let dsum_mag: f64 =
                    ri.iter().zip(&o.out[1][row * VD..][..VD]).map(|(x, y)| x.abs() * y).sum();
                for j in 0..a.sk {
                    let (ds, ds_mag) = (p[j] * (dp[j] - dsum), p[j] * (dp[j].abs() + dsum_mag));
                    let kr = (g * a.sk + j) * HD;
                    for c in 0..HD {
                        o.dq[0][row * HD + c] += scale * ds * k[kr + c];
                        o.dq[1][row * HD + c] += scale * ds_mag * k[kr + c].abs();
                        o.dk[0][kr + c] += scale * ds * qi[c];
                        o.dk[1][kr + c] += scale * ds_mag * qi[c].abs();
                    }
                }
            }
        }
    }
    o
}

#[test]
fn attention_on_scores_of_thousands_with_every_mask_form() {
    let cases = [
        Attn { b: 2, hq: 4, hkv: 2, sq: 70, sk: 200, causal: false },
        Attn { b: 1, hq: 2, hkv: 1, sq: 150, sk: 150, causal: true },
        Attn { b: 2, hq: 2, hkv: 1, sq: 40, sk: 150, causal: false },
    ];
    for (n, a) in cases.iter().enumerate() {
        let x = attn_data(a, 10 + n as u64);
        for mask in &masks(a, &mut Rng::new(20 + n as u64)) {
            let want = attn_reference(a, &x, mask.as_ref());
            let m1 = 1.0 + want.max_score;
            assert!(want.max_score >= 1000.0, "scores reach only {}", want.max_score);
            for dtype in DTYPES {
                let what = format!("{dtype:?} {a:?} mask {:?}", mask.as_ref().map(|m| &m.shape));
                let q = leaf(&x[0], &[a.b, a.hq, a.sq, HD], dtype);
                let k = leaf(&x[1], &[a.b, a.hkv, a.sk, HD], dtype);
                let v = leaf(&x[2], &[a.b, a.hkv, a.sk, VD], dtype);
                let r = tensor(&x[3], &[a.b, a.hq, a.sq, VD], dtype);
                let mt = mask.as_ref().map(|m| tensor(&m.data, &m.shape, dtype));
                let out =
                    Tensor::scaled_dot_product_attention(&q, &k, &v, mt.as_ref(), a.causal, None)
                        .unwrap();
                out.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
                let tol = K * eps(dtype) * (a.sq.max(a.sk) as f64).sqrt();
                // The forward's shift is exact; the backward's probabilities exp(s - lse)
                // carry the lse's rounding eps * M, common to one row (dq sums over one
                // row's keys), different from row to row (dk, dv sum over rows).
                let [w, mag] = &want.out;
                check(&format!("out {what}"), &values(&out), w, |i| {
                    tol * (w[i].abs() + mag[i]) + TINY
                });
                for (name, t, [w, mag], f) in
                    [("dq", &q, &want.dq, 1.0), ("dk", &k, &want.dk, m1), ("dv", &v, &want.dv, m1)]
                {
                    check(&format!("{name} {what}"), &grad_of(t), w, |i| {
                        tol * (m1 * w[i].abs() + f * mag[i]) + TINY
                    });
                }
            }
        }
    }
}
