//! Cross-entropy (whole and in vocab-parallel pieces), softmax and flash attention on
//! logits and scores of magnitude 1e3..1e4: positive, negative, both in one row, with
//! near-ties spread over the kernels' blocks (256 columns for cross-entropy, 64 keys for
//! attention) and rows where one entry dominates. Without the max shift `exp` overflows
//! to inf, or every term underflows to 0; shifting by the wrong max (the first element,
//! another row's, a block's instead of the running one) overflows too, and a skipped
//! rescale of the online sum is off by a factor. The oracles are f64 loops written out
//! here, each with its own max shift.
//!
//! Inputs are multiples of 1/4 (attention scores of 1/64), exact in f32, so what an f32
//! kernel loses is the rounding of its results: a log-sum-exp of size `M` rounds at
//! `eps * M`, and every probability and gradient computed from it inherits that relative
//! error. Tolerances are written in those terms (`K * eps * ((1 + M) |want| + sum of
//! the magnitudes the value is made of)`).

use tpar_kernels::cross_entropy::{
    ce_local_stats, ce_lse, ce_merge, ce_rescale, cross_entropy_backward, cross_entropy_forward,
};
use tpar_kernels::sdpa::{sdpa_backward, sdpa_forward, SdpaMask, SdpaShape};
use tpar_kernels::softmax::{
    log_softmax_backward, log_softmax_forward, softmax_backward, softmax_forward,
};
use tpar_kernels::{Acc, Float};

const IGNORE: i64 = -100;
/// Columns of the cross-entropy kernel's online blocks.
const CE_BLOCK: usize = 256;
/// Keys per tile of the attention kernel.
const KEY_TILE: usize = 64;
/// Multiple of the rounding error a result may carry.
const K: f64 = 4.0;
/// Absolute slack for results so small that f32 holds them as subnormals.
const TINY: f64 = 1e-30;

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A multiple of 1/4 in `[-r, r]` (`4 r` an integer).
    fn quarter(&mut self, r: f64) -> f64 {
        let n = (4.0 * r) as u64;
        (self.next() % (2 * n + 1)) as f64 / 4.0 - r
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Machine epsilon of the dtype's arithmetic (f32 for f32, f64 for f64).
fn eps<T: Float>() -> f64 {
    if T::NAME == "f64" {
        f64::EPSILON
    } else {
        f32::EPSILON as f64
    }
}

fn to_t<T: Float>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

fn f64s<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

fn accs<A: Acc>(v: &[A]) -> Vec<f64> {
    v.iter().map(|x| x.f64()).collect()
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
// Cross-entropy and softmax data and oracles
// ---------------------------------------------------------------------------------------

/// Logit rows `[rows, vocab]` and targets. Rows cycle through six kinds, each around an
/// offset `off` of 1e3..1e4 (values are `±off` plus a multiple of 1/4 in [-3, 3]):
/// 0. all near `+off`, with a peak in every block, higher block after block (every
///    block carries mass, so the online sum is rescaled at each block);
/// 1. all near `-off` (every `exp` underflows without the shift), peaks lower block
///    after block;
/// 2. mixed: runs near `+off` and runs near `-off`; the first element is `-off`, far
///    below the max, and column 263 (a one-column shard below) is negative;
/// 3. near `±off` with one entry 40 above the rest, which is the target (loss ~ 0);
/// 4. like 3, the target elsewhere (loss ~ 40);
/// 5. an ignored row.
fn ce_data(rng: &mut Rng, rows: usize, vocab: usize) -> (Vec<f64>, Vec<i64>) {
    let offs = [1000.0, 2500.0, 5000.0, 8000.0, 9750.0];
    let mut x = Vec::with_capacity(rows * vocab);
    let mut targets = Vec::with_capacity(rows);
    for r in 0..rows {
        let off = offs[r % offs.len()];
        let kind = r % 6;
        let sign = if r % 2 == 0 { 1.0 } else { -1.0 };
        let mut row: Vec<f64> = (0..vocab)
            .map(|j| {
                let base = match kind {
                    0 => off,
                    1 => -off,
                    2 if j >= 450 || (j / 40) % 2 == 1 || j == 0 || j == 263 => -off,
                    2 => off,
                    _ => sign * off,
                };
                base + rng.quarter(3.0)
            })
            .collect();
        let blocks = vocab.div_ceil(CE_BLOCK);
        for b in 0..blocks {
            let c = (b * CE_BLOCK + 17).min(vocab - 1);
            match kind {
                0 => row[c] = off + 4.0 + b as f64,
                1 => row[c] = -off + 4.0 - b as f64,
                2 if row[c] > 0.0 => row[c] = off + 4.0 + b as f64,
                _ => {}
            }
        }
        let dominant = vocab - 1 - vocab / 7;
        if kind == 3 || kind == 4 {
            row[dominant] = sign * off + 40.0;
        }
        let t = match kind {
            3 => dominant as i64,
            5 => IGNORE,
            _ if r % 4 == 1 && vocab > 263 => 263,
            _ => loop {
                let t = rng.below(vocab);
                if t != dominant || vocab == 1 {
                    break t as i64;
                }
            },
        };
        x.extend(row);
        targets.push(t);
    }
    (x, targets)
}

/// `lse = m + ln(sum(exp(x - m)))`, `m` the row max.
fn lse_of(row: &[f64]) -> f64 {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    m + row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln()
}

/// `(loss_rows, lse, p)`: `loss = lse - x[t]` (0 when ignored) and `p = softmax(x)`.
fn ce_reference(x: &[f64], vocab: usize, targets: &[i64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut loss, mut lse, mut p) = (Vec::new(), Vec::new(), Vec::new());
    for (row, &t) in x.chunks(vocab).zip(targets) {
        let l = lse_of(row);
        lse.push(l);
        loss.push(if t == IGNORE { 0.0 } else { l - row[t as usize] });
        p.extend(row.iter().map(|&v| (v - l).exp()));
    }
    (loss, lse, p)
}

/// `dlogits = (p - onehot(t)) * scale[r]` (zeros for ignored rows) and the allowed
/// error of each element: `p` inherits the relative error `eps * M` of the lse.
fn ce_grad_reference(
    p: &[f64],
    vocab: usize,
    targets: &[i64],
    scale: &[f64],
    tol: f64,
    m: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (mut want, mut atol) = (Vec::new(), Vec::new());
    for (r, pr) in p.chunks(vocab).enumerate() {
        let s = scale[if scale.len() == 1 { 0 } else { r }];
        for (c, &pc) in pr.iter().enumerate() {
            let ignored = targets[r] == IGNORE;
            let onehot = f64::from(c as i64 == targets[r]);
            let w = if ignored { 0.0 } else { (pc - onehot) * s };
            want.push(w);
            atol.push(if ignored {
                0.0
            } else {
                tol * ((1.0 + m) * pc * s.abs() + w.abs()) + TINY
            });
        }
    }
    (want, atol)
}

const CE_SIZES: [(usize, usize); 3] = [(12, 600), (6, 5), (6, 257)];

fn check_cross_entropy<T: Float>(seed: u64) {
    let mut rng = Rng(seed);
    for (rows, vocab) in CE_SIZES {
        let (xf, targets) = ce_data(&mut rng, rows, vocab);
        let x: Vec<T> = to_t(&xf);
        let m = max_abs(&xf);
        let tol = K * eps::<T>();
        let what = format!("{} rows={rows} vocab={vocab}", T::NAME);
        let (loss_ref, lse_ref, p) = ce_reference(&xf, vocab, &targets);

        let z = <T::Acc as Acc>::of(0.0);
        let (mut loss, mut lse) = (vec![z; rows], vec![z; rows]);
        let count =
            cross_entropy_forward(&x, rows, vocab, &targets, IGNORE, &mut loss, &mut lse).unwrap();
        assert_eq!(count, targets.iter().filter(|&&t| t != IGNORE).count(), "{what}: count");
        // lse and loss are differences of numbers of size M: absolute error eps * M.
        check(&format!("lse {what}"), &accs(&lse), &lse_ref, |_| tol * (1.0 + m));
        check(&format!("loss {what}"), &accs(&loss), &loss_ref, |_| tol * (1.0 + m));

        for scale in [vec![0.75], (0..rows).map(|r| 0.25 * (r as f64 - 5.0)).collect()] {
            let sa: Vec<T::Acc> = scale.iter().map(|&s| Acc::of(s)).collect();
            let mut d = vec![T::default(); rows * vocab];
            cross_entropy_backward(&x, rows, vocab, &targets, 0, IGNORE, &lse, &sa, &mut d)
                .unwrap();
            let (want, atol) = ce_grad_reference(&p, vocab, &targets, &scale, tol, m);
            let what = format!("dlogits {what} scales={}", scale.len());
            check(&what, &f64s(&d), &want, |i| atol[i]);
        }
    }
}

#[test]
fn cross_entropy_matches_f64_on_logits_of_thousands() {
    check_cross_entropy::<f32>(1);
    check_cross_entropy::<f64>(2);
}

/// The loss_parallel pieces on three uneven vocab shards (one of a single column, one
/// spanning a block boundary): per-shard statistics relative to the shard's own max,
/// rescaled to the global max (all-reduce style) or merged pairwise, then the backward
/// of each shard with the global lse.
fn check_vocab_parallel<T: Float>(seed: u64) {
    let mut rng = Rng(seed);
    let (rows, vocab) = (12, 600);
    let bounds = [0usize, 263, 264, 600];
    let (xf, targets) = ce_data(&mut rng, rows, vocab);
    let m = max_abs(&xf);
    let tol = K * eps::<T>();
    let (loss_ref, lse_ref, p) = ce_reference(&xf, vocab, &targets);
    let z = <T::Acc as Acc>::of(0.0);
    let ninf = <T::Acc as Acc>::of(f64::NEG_INFINITY);

    struct Shard<T: Float> {
        start: usize,
        len: usize,
        x: Vec<T>,
        max: Vec<T::Acc>,
        sumexp: Vec<T::Acc>,
        target_logit: Vec<T::Acc>,
    }
    let mut shards: Vec<Shard<T>> = Vec::new();
    for w in bounds.windows(2) {
        let (start, len) = (w[0], w[1] - w[0]);
        let local: Vec<f64> =
            xf.chunks(vocab).flat_map(|r| r[start..start + len].iter().copied()).collect();
        let x: Vec<T> = to_t(&local);
        let (mut mx, mut se, mut tl) = (vec![z; rows], vec![z; rows], vec![z; rows]);
        ce_local_stats(
            &x,
            rows,
            len,
            &targets,
            start as i64,
            vocab,
            IGNORE,
            &mut mx,
            &mut se,
            &mut tl,
        )
        .unwrap();
        // The local statistics themselves: the max is one of the inputs, exactly.
        let what = format!("{} shard [{start}, +{len})", T::NAME);
        let mut want_max = Vec::new();
        let mut want_se = Vec::new();
        let mut want_tl = Vec::new();
        for (r, row) in local.chunks(len).enumerate() {
            let lm = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            want_max.push(lm);
            want_se.push(row.iter().map(|&v| (v - lm).exp()).sum::<f64>());
            let t = targets[r];
            let owns = t != IGNORE && (start as i64..(start + len) as i64).contains(&t);
            want_tl.push(if owns { row[t as usize - start] } else { 0.0 });
        }
        assert_eq!(accs(&mx), want_max, "local max {what}");
        check(&format!("local sumexp {what}"), &accs(&se), &want_se, |i| {
            tol * (len as f64).sqrt() * want_se[i]
        });
        assert_eq!(accs(&tl), want_tl, "target logit {what}");
        shards.push(Shard { start, len, x, max: mx, sumexp: se, target_logit: tl });
    }

    // All-reduce style: MAX of the maxes, each sumexp rescaled to it, SUM.
    let mut gmax = vec![ninf; rows];
    for sh in &shards {
        for (g, &l) in gmax.iter_mut().zip(&sh.max) {
            if l > *g {
                *g = l;
            }
        }
    }
    let (mut gsum, mut gtl) = (vec![z; rows], vec![z; rows]);
    for sh in &shards {
        let mut s = sh.sumexp.clone();
        ce_rescale(&sh.max, &mut s, &gmax).unwrap();
        for r in 0..rows {
            gsum[r] += s[r];
            gtl[r] += sh.target_logit[r];
        }
    }
    let mut lse = vec![z; rows];
    ce_lse(&gmax, &gsum, &mut lse).unwrap();
    let what = format!("{} all-reduce", T::NAME);
    check(&format!("lse {what}"), &accs(&lse), &lse_ref, |_| tol * (1.0 + m));
    let loss: Vec<f64> = (0..rows)
        .map(|r| if targets[r] == IGNORE { 0.0 } else { lse[r].f64() - gtl[r].f64() })
        .collect();
    check(&format!("loss {what}"), &loss, &loss_ref, |_| tol * (1.0 + m));

    // Pairwise merges, starting from each shard (the one-column shard's max is far
    // below the others' in the mixed rows).
    for order in [[0usize, 1, 2], [1, 0, 2], [2, 1, 0]] {
        let (mut mx, mut se) = (shards[order[0]].max.clone(), shards[order[0]].sumexp.clone());
        for &i in &order[1..] {
            ce_merge(&mut mx, &mut se, &shards[i].max, &shards[i].sumexp).unwrap();
        }
        let mut l2 = vec![z; rows];
        ce_lse(&mx, &se, &mut l2).unwrap();
        let what = format!("lse {} merged in order {order:?}", T::NAME);
        check(&what, &accs(&l2), &lse_ref, |_| tol * (1.0 + m));
    }

    // Backward per shard with the global lse, put back together.
    let scale = [0.75];
    let sa = [Acc::of(scale[0])];
    let mut d = vec![0.0; rows * vocab];
    for sh in &shards {
        let mut dl = vec![T::default(); rows * sh.len];
        cross_entropy_backward(
            &sh.x,
            rows,
            sh.len,
            &targets,
            sh.start as i64,
            IGNORE,
            &lse,
            &sa,
            &mut dl,
        )
        .unwrap();
        for r in 0..rows {
            for c in 0..sh.len {
                d[r * vocab + sh.start + c] = dl[r * sh.len + c].to_f64();
            }
        }
    }
    let (want, atol) = ce_grad_reference(&p, vocab, &targets, &scale, tol, m);
    check(&format!("sharded dlogits {}", T::NAME), &d, &want, |i| atol[i]);
}

#[test]
fn vocab_parallel_cross_entropy_pieces_match_f64_on_logits_of_thousands() {
    check_vocab_parallel::<f32>(3);
    check_vocab_parallel::<f64>(4);
}

fn check_softmax<T: Float>(seed: u64) {
    let mut rng = Rng(seed);
    let tol = K * eps::<T>();
    for (rows, cols) in CE_SIZES {
        let (xf, _) = ce_data(&mut rng, rows, cols);
        let x: Vec<T> = to_t(&xf);
        let dyf: Vec<f64> = (0..rows * cols).map(|_| rng.quarter(1.0)).collect();
        let dy: Vec<T> = to_t(&dyf);
        let what = format!("{} rows={rows} cols={cols}", T::NAME);
        // The oracle: y = exp(x - m) / sum(exp(x - m)), log y = (x - m) - ln(sum), m the max.
        let (mut p, mut logp) = (Vec::new(), Vec::new());
        for row in xf.chunks(cols) {
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|&v| (v - m).exp()).sum();
            p.extend(row.iter().map(|&v| (v - m).exp() / sum));
            logp.extend(row.iter().map(|&v| (v - m) - sum.ln()));
        }

        // The shift is exact (inputs are multiples of 1/4), so softmax is as accurate as
        // a softmax of small numbers: relative error that of the row sum, whatever M.
        let sum_tol = tol * (cols as f64).sqrt();
        let mut y = vec![T::default(); rows * cols];
        softmax_forward(&x, rows, cols, &mut y).unwrap();
        check(&format!("softmax {what}"), &f64s(&y), &p, |i| sum_tol * p[i] + TINY);
        // log_softmax: differences of numbers of size M.
        let mut ly = vec![T::default(); rows * cols];
        log_softmax_forward(&x, rows, cols, &mut ly).unwrap();
        check(&format!("log_softmax {what}"), &f64s(&ly), &logp, |i| {
            sum_tol * (1.0 + logp[i].abs())
        });

        // dx = y (dy - sum(dy y)) and dx = dy - exp(log y) sum(dy), row by row.
        let (mut dsm, mut dsm_tol, mut dls, mut dls_tol) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for ((pr, lr), gr) in p.chunks(cols).zip(logp.chunks(cols)).zip(dyf.chunks(cols)) {
            let s: f64 = pr.iter().zip(gr).map(|(y, g)| y * g).sum();
            let s_abs: f64 = pr.iter().zip(gr).map(|(y, g)| (y * g).abs()).sum();
            let g_sum: f64 = gr.iter().sum();
            let g_abs: f64 = gr.iter().map(|g| g.abs()).sum();
            for c in 0..cols {
                dsm.push(pr[c] * (gr[c] - s));
                dsm_tol.push(sum_tol * pr[c] * (gr[c].abs() + s_abs) + TINY);
                dls.push(gr[c] - lr[c].exp() * g_sum);
                // exp(log y) carries the absolute error of log y, eps * |log y|.
                dls_tol.push(sum_tol * (gr[c].abs() + pr[c] * g_abs * (1.0 + lr[c].abs())) + TINY);
            }
        }
        let mut dx = vec![T::default(); rows * cols];
        softmax_backward(&y, &dy, rows, cols, &mut dx).unwrap();
        check(&format!("softmax dx {what}"), &f64s(&dx), &dsm, |i| dsm_tol[i]);
        log_softmax_backward(&ly, &dy, rows, cols, &mut dx).unwrap();
        check(&format!("log_softmax dx {what}"), &f64s(&dx), &dls, |i| dls_tol[i]);
    }
}

#[test]
fn softmax_matches_f64_on_logits_of_thousands() {
    check_softmax::<f32>(5);
    check_softmax::<f64>(6);
}

// ---------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------

/// Head dim of the attention cases; the default scale `1/sqrt(16) = 1/4` is exact.
const HD: usize = 16;
const VD: usize = 8;

/// q, k, v and the upstream gradient for `s` (head dim 16, scale 1/4), built so the
/// score of query `i` against key `j` is `sigma_i * P_j` plus a few units, where
/// `sigma_i = ±1` alternates from row to row (and head to head), doubled on every third
/// row (so neighbouring rows' maxima differ by thousands), and
/// `P_j = s_j * big + f_j`, `big` one of 1500..5000 per kv head and `f_j` a multiple of
/// 1/4 in [-3, 3]. The sign `s_j` is mixed in key tile 0 (key 0 negative), positive in
/// tile 1, negative in tile 2, alternating in tile 3 (tiles repeat mod 4), and
/// `f_j = s_j * (4 + tile)` at offsets 5 and 6 of every tile: a positive row's running
/// max rises over tiles 0, 1, drops by 2 big in tile 2 and rises again in tile 3; a
/// negative row's likewise with tiles 1 and 2 swapped. Every fifth row also has one key
/// 40 above the rest (key 100 for positive rows, 140 for negative ones).
fn attn_data(s: &SdpaShape, seed: u64) -> [Vec<f64>; 4] {
    assert_eq!((s.head_dim, s.v_dim), (HD, VD));
    let mut rng = Rng(seed);
    let bigs = [3000.0, 4000.0, 1500.0, 5000.0];
    let mut k = vec![0.0; s.batch * s.kv_heads * s.kv_len * HD];
    for g in 0..s.batch * s.kv_heads {
        for j in 0..s.kv_len {
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
            let row = &mut k[(g * s.kv_len + j) * HD..][..HD];
            row[0] = 4.0 * (sj * bigs[g % 4] + f);
            for c in 1..HD {
                row[c] = rng.quarter(2.0);
            }
            row[1] = if j == 100 { 40.0 } else { row[1] };
            row[2] = if j == 140 { 40.0 } else { row[2] };
        }
    }
    let mut q = vec![0.0; s.batch * s.q_heads * s.q_len * HD];
    for bh in 0..s.batch * s.q_heads {
        for i in 0..s.q_len {
            let row = &mut q[(bh * s.q_len + i) * HD..][..HD];
            let sigma = if (i + bh) % 2 == 0 { 1.0 } else { -1.0 };
            row[0] = if i % 3 == 1 { 2.0 * sigma } else { sigma };
            for c in 1..HD {
                row[c] = rng.quarter(1.0);
            }
            if i % 5 == 4 {
                row[1] = 4.0;
                row[2] = 4.0;
            }
        }
    }
    let v = (0..s.batch * s.kv_heads * s.kv_len * VD).map(|_| rng.quarter(1.0)).collect();
    let dout = (0..s.batch * s.q_heads * s.q_len * VD).map(|_| rng.quarter(1.0)).collect();
    [q, k, v, dout]
}

/// Attention in f64 with a materialized score matrix, and for every output the sum of
/// the magnitudes of the terms it adds up (what its rounding error scales with).
struct AttnRef {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    out_mag: Vec<f64>,
    dq_mag: Vec<f64>,
    dk_mag: Vec<f64>,
    dv_mag: Vec<f64>,
    /// Largest finite |score|.
    max_score: f64,
}

fn attn_reference(s: &SdpaShape, x: &[Vec<f64>; 4], mask: Option<&SdpaMask<f64>>) -> AttnRef {
    let [q, k, v, dout] = x;
    let group = s.q_heads / s.kv_heads;
    let mut r = AttnRef {
        out: vec![0.0; dout.len()],
        lse: vec![0.0; s.batch * s.q_heads * s.q_len],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
        out_mag: vec![0.0; dout.len()],
        dq_mag: vec![0.0; q.len()],
        dk_mag: vec![0.0; k.len()],
        dv_mag: vec![0.0; v.len()],
        max_score: 0.0,
    };
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let g = b * s.kv_heads + h / group;
            for i in 0..s.q_len {
                let row = (b * s.q_heads + h) * s.q_len + i;
                let qi = &q[row * HD..][..HD];
                let key = |j: usize| &k[(g * s.kv_len + j) * HD..][..HD];
                let val = |j: usize| &v[(g * s.kv_len + j) * VD..][..VD];
                let scores: Vec<f64> = (0..s.kv_len)
                    .map(|j| {
                        let add = mask.map_or(0.0, |m| {
                            m.data[b * m.batch_stride + h * m.head_stride + i * m.row_stride + j]
                        });
                        if (s.causal && j > i) || add == f64::NEG_INFINITY {
                            return f64::NEG_INFINITY;
                        }
                        s.scale * qi.iter().zip(key(j)).map(|(a, c)| a * c).sum::<f64>() + add
                    })
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if mx == f64::NEG_INFINITY {
                    r.lse[row] = mx; // nothing visible: zero output, zero gradients
                    continue;
                }
                r.max_score = scores
                    .iter()
                    .filter(|x| x.is_finite())
                    .fold(r.max_score, |a, x| a.max(x.abs()));
                let sum: f64 = scores.iter().map(|&x| (x - mx).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|&x| (x - mx).exp() / sum).collect();
                r.lse[row] = mx + sum.ln();
                let g_out = &dout[row * VD..][..VD];
                let dp: Vec<f64> = (0..s.kv_len)
                    .map(|j| val(j).iter().zip(g_out).map(|(a, c)| a * c).sum())
                    .collect();
                let dsum: f64 = p.iter().zip(&dp).map(|(a, c)| a * c).sum();
                let vr = |j: usize| (g * s.kv_len + j) * VD;
                for j in 0..s.kv_len {
                    for c in 0..VD {
                        r.out[row * VD + c] += p[j] * v[vr(j) + c];
                        r.out_mag[row * VD + c] += p[j] * v[vr(j) + c].abs();
                        r.dv[vr(j) + c] += p[j] * g_out[c];
                        r.dv_mag[vr(j) + c] += p[j] * g_out[c].abs();
                    }
                }
                // The backward takes sum(dp * p) as dout . out, from the rounded out.
                let dsum_mag: f64 =
                    g_out.iter().zip(&r.out_mag[row * VD..][..VD]).map(|(a, c)| a.abs() * c).sum();
                for j in 0..s.kv_len {
                    let ds = p[j] * (dp[j] - dsum);
                    let ds_mag = p[j] * (dp[j].abs() + dsum_mag);
                    let kr = (g * s.kv_len + j) * HD;
                    for c in 0..HD {
                        r.dq[row * HD + c] += s.scale * ds * k[kr + c];
                        r.dq_mag[row * HD + c] += s.scale * ds_mag * k[kr + c].abs();
                        r.dk[kr + c] += s.scale * ds * qi[c];
                        r.dk_mag[kr + c] += s.scale * ds_mag * qi[c].abs();
                    }
                }
            }
        }
    }
    r
}

#[derive(Clone, Copy, Debug)]
enum MaskForm {
    None,
    /// `[batch, 1, 1, kv_len]`: keys masked out per batch, among them the peaks of key
    /// tiles 1 and 3, so the row max is the max of what is left.
    KeyPadding,
    /// `[batch, q_heads, q_len, kv_len]`: 0, `-inf`, and finite values of ±1e3 that move
    /// scores by more than exp's range; one row fully masked.
    Full,
}

fn build_mask(s: &SdpaShape, form: MaskForm, seed: u64) -> Option<(Vec<f64>, [usize; 3])> {
    let ninf = f64::NEG_INFINITY;
    let mut rng = Rng(seed);
    match form {
        MaskForm::None => None,
        MaskForm::KeyPadding => {
            let mut m = vec![0.0; s.batch * s.kv_len];
            for b in 0..s.batch {
                for j in [69, 70, 197, 198] {
                    if j < s.kv_len {
                        m[b * s.kv_len + j] = ninf;
                    }
                }
                // Right padding of a different length per batch.
                let pad = 3 + 11 * b;
                m[b * s.kv_len + s.kv_len - pad..(b + 1) * s.kv_len].fill(ninf);
            }
            Some((m, [s.kv_len, 0, 0]))
        }
        MaskForm::Full => {
            let (rs, hs) = (s.kv_len, s.q_len * s.kv_len);
            let mut m: Vec<f64> = (0..s.batch * s.q_heads * hs)
                .map(|_| match rng.below(16) {
                    0 | 1 => ninf,
                    2 => 1250.5,
                    3 => -2500.0,
                    4 => -1000.25,
                    _ => 0.0,
                })
                .collect();
            let row = (s.q_heads - 1) * hs + (s.q_len / 2) * rs;
            m[row..row + rs].fill(ninf);
            Some((m, [s.q_heads * hs, hs, rs]))
        }
    }
}

fn check_attention<T: Float>(s: &SdpaShape, form: MaskForm, seed: u64) {
    let x = attn_data(s, seed);
    let md = build_mask(s, form, seed ^ 0x55);
    let mask_f = md.as_ref().map(|(d, st)| SdpaMask {
        data: &d[..],
        batch_stride: st[0],
        head_stride: st[1],
        row_stride: st[2],
    });
    let want = attn_reference(s, &x, mask_f.as_ref());
    let m_t: Vec<T> = md.as_ref().map_or(Vec::new(), |(d, _)| to_t(d));
    let mask = md.as_ref().map(|(_, st)| SdpaMask {
        data: &m_t[..],
        batch_stride: st[0],
        head_stride: st[1],
        row_stride: st[2],
    });
    let [q, k, v, dout]: [Vec<T>; 4] = x.each_ref().map(|a| to_t(a));
    let what =
        format!("{} {form:?} causal={} q_len={} kv_len={}", T::NAME, s.causal, s.q_len, s.kv_len);
    // Sums run over up to max(q_len, kv_len) terms.
    let tol = K * eps::<T>() * (s.q_len.max(s.kv_len) as f64).sqrt();
    // The lse rounds at eps * M, and the backward's probabilities exp(s - lse) carry
    // that as a relative error; the forward's shift is exact.
    let m1 = 1.0 + want.max_score;
    assert!(want.max_score >= 1000.0, "{what}: scores reach only {}", want.max_score);

    let mut out = vec![T::default(); q.len() / HD * VD];
    let mut lse = vec![<T::Acc as Acc>::of(0.0); q.len() / HD];
    sdpa_forward(s, &q, &k, &v, mask.as_ref(), &mut out, &mut lse).unwrap();
    check(&format!("out {what}"), &f64s(&out), &want.out, |i| {
        tol * (want.out[i].abs() + want.out_mag[i]) + TINY
    });
    check(&format!("lse {what}"), &accs(&lse), &want.lse, |_| tol * m1);

    let (mut dq, mut dk, mut dv) =
        (vec![T::default(); q.len()], vec![T::default(); k.len()], vec![T::default(); v.len()]);
    sdpa_backward(s, &q, &k, &v, mask.as_ref(), &out, &lse, &dout, &mut dq, &mut dk, &mut dv)
        .unwrap();
    // dq sums over the keys of one row, whose probabilities share that row's lse
    // rounding (a common factor); dk and dv sum over rows, each with its own.
    let grads = [
        ("dq", &dq, &want.dq, &want.dq_mag, 1.0),
        ("dk", &dk, &want.dk, &want.dk_mag, m1),
        ("dv", &dv, &want.dv, &want.dv_mag, m1),
    ];
    for (name, got, w, mag, mag_factor) in grads {
        check(&format!("{name} {what}"), &f64s(got), w, |i| {
            tol * (m1 * w[i].abs() + mag_factor * mag[i]) + TINY
        });
    }
}

fn shape(b: usize, hq: usize, hkv: usize, sq: usize, sk: usize, causal: bool) -> SdpaShape {
    SdpaShape {
        batch: b,
        q_heads: hq,
        kv_heads: hkv,
        q_len: sq,
        kv_len: sk,
        head_dim: HD,
        v_dim: VD,
        scale: 0.25,
        causal,
    }
}

/// Shapes spanning several key tiles (and query tiles), with grouped-query heads.
fn attention_cases() -> Vec<(SdpaShape, MaskForm)> {
    vec![
        (shape(2, 4, 2, 70, 200, false), MaskForm::None),
        (shape(1, 2, 1, 150, 150, true), MaskForm::None),
        (shape(2, 2, 2, 70, 200, false), MaskForm::KeyPadding),
        (shape(1, 2, 1, 150, 200, true), MaskForm::KeyPadding),
        (shape(1, 2, 1, 150, 150, true), MaskForm::Full),
        (shape(2, 2, 1, 40, 150, false), MaskForm::Full),
    ]
}

#[test]
fn flash_attention_matches_f64_on_scores_of_thousands() {
    for (i, (s, form)) in attention_cases().into_iter().enumerate() {
        check_attention::<f32>(&s, form, 10 + i as u64);
        check_attention::<f64>(&s, form, 20 + i as u64);
    }
}
