//! Blockwise causal attention (`sdpa_block_forward` / `sdpa_block_backward` /
//! `sdpa_lse_merge`) against a naive f64 attention written out here: causal by true
//! positions, key padding, grouped-query heads, merged over key blocks in any split.

use tpar_tensor::{BlockMask, DType, Rng, Tensor};

const TOL: f64 = 1e-10;

/// Naive attention over the whole sequence for the query rows at `q_pos` (all in f64):
/// returns out `[b, hq, sq, dv]`, and given `dout`, (dq, dk, dv).
#[allow(clippy::too_many_arguments)]
fn naive(
    dims: (usize, usize, usize, usize, usize),
    q: &[f64],
    k: &[f64],
    v: &[f64],
    q_pos: &[usize],
    keep: &[Vec<bool>],
    dout: &[f64],
    sk: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (b, hq, hkv, d, dv) = dims;
    let sq = q_pos.len();
    let g = hq / hkv;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; b * hq * sq * dv];
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dvv = vec![0.0; v.len()];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / g;
            for (i, &qp) in q_pos.iter().enumerate() {
                let qi = &q[((bi * hq + h) * sq + i) * d..][..d];
                let vis: Vec<bool> = (0..sk).map(|j| j <= qp && keep[bi][j]).collect();
                let s: Vec<f64> = (0..sk)
                    .map(|j| {
                        let kj = &k[((bi * hkv + kh) * sk + j) * d..][..d];
                        scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let m = (0..sk).filter(|&j| vis[j]).map(|j| s[j]).fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let z: f64 = (0..sk).filter(|&j| vis[j]).map(|j| (s[j] - m).exp()).sum();
                let p: Vec<f64> =
                    (0..sk).map(|j| if vis[j] { (s[j] - m).exp() / z } else { 0.0 }).collect();
                let o = &mut out[((bi * hq + h) * sq + i) * dv..][..dv];
                for j in 0..sk {
                    for c in 0..dv {
                        o[c] += p[j] * v[((bi * hkv + kh) * sk + j) * dv + c];
                    }
                }
                let go = &dout[((bi * hq + h) * sq + i) * dv..][..dv];
                let dp: Vec<f64> = (0..sk)
                    .map(|j| (0..dv).map(|c| go[c] * v[((bi * hkv + kh) * sk + j) * dv + c]).sum())
                    .collect();
                let dot: f64 = (0..sk).map(|j| p[j] * dp[j]).sum();
                for j in 0..sk {
                    let ds = p[j] * (dp[j] - dot) * scale;
                    for c in 0..dv {
                        dvv[((bi * hkv + kh) * sk + j) * dv + c] += p[j] * go[c];
                    }
                    for c in 0..d {
                        dq[((bi * hq + h) * sq + i) * d + c] +=
                            ds * k[((bi * hkv + kh) * sk + j) * d + c];
                        dk[((bi * hkv + kh) * sk + j) * d + c] += ds * qi[c];
                    }
                }
            }
        }
    }
    (out, dq, dk, dvv)
}

fn close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= TOL * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

/// Rows `rows` (positions) of a `[b, h, s, d]` tensor.
fn rows(t: &Tensor, pos: &[usize]) -> Tensor {
    if pos.is_empty() {
        return t.narrow(2, 0, 0).unwrap();
    }
    let parts: Vec<Tensor> = pos.iter().map(|&p| t.narrow(2, p, 1).unwrap()).collect();
    Tensor::cat(&parts, 2).unwrap()
}

fn key_mask(keep: &[Vec<bool>], pos: &[usize]) -> Tensor {
    let b = keep.len();
    let v: Vec<f64> = (0..b)
        .flat_map(|bi| pos.iter().map(move |&p| (bi, p)))
        .map(|(bi, p)| if keep[bi][p] { 0.0 } else { f64::NEG_INFINITY })
        .collect();
    Tensor::from_vec(v, [b, 1, 1, pos.len()]).unwrap()
}

/// The query rows at `q_pos` attend the whole sequence split into `key_blocks`; the
/// merged output and summed gradients equal the naive attention's.
fn check_split(
    hq: usize,
    hkv: usize,
    s: usize,
    q_pos: &[usize],
    key_blocks: &[Vec<usize>],
    pad: bool,
) {
    let (b, d, dv) = (2, 4, 3);
    let mut rng = Rng::new(7 + s as u64);
    let q = Tensor::randn([b, hq, s, d], DType::F64, &mut rng).unwrap();
    let k = Tensor::randn([b, hkv, s, d], DType::F64, &mut rng).unwrap();
    let v = Tensor::randn([b, hkv, s, dv], DType::F64, &mut rng).unwrap();
    let sq = q_pos.len();
    let dout = Tensor::randn([b, hq, sq, dv], DType::F64, &mut rng).unwrap();
    // Batch 1 pads its first key and two keys in the middle (query rows at 0 see nothing).
    let keep: Vec<Vec<bool>> = (0..b)
        .map(|bi| {
            (0..s).map(|j| !(pad && bi == 1 && (j == 0 || j == s / 2 || j == s / 2 + 1))).collect()
        })
        .collect();
    let qb = rows(&q, q_pos);
    let (want_o, want_dq, want_dk, want_dv) = naive(
        (b, hq, hkv, d, dv),
        &qb.to_vec_f64().unwrap(),
        &k.to_vec_f64().unwrap(),
        &v.to_vec_f64().unwrap(),
        q_pos,
        &keep,
        &dout.to_vec_f64().unwrap(),
        s,
    );
    let mut acc: Option<(Tensor, Tensor)> = None;
    for kp in key_blocks {
        let m = pad.then(|| key_mask(&keep, kp));
        let (o, l) = Tensor::sdpa_block_forward(
            &qb,
            &rows(&k, kp),
            &rows(&v, kp),
            q_pos,
            kp,
            m.as_ref(),
            None,
        )
        .unwrap();
        acc = Some(match acc {
            None => (o, l),
            Some((ao, al)) => Tensor::sdpa_lse_merge(&ao, &al, &o, &l).unwrap(),
        });
    }
    let (out, lse) = acc.unwrap();
    close("out", &out.to_vec_f64().unwrap(), &want_o);
    // Gradients: dq sums over key blocks; each key block's dk/dv land at its positions.
    let mut dq = vec![0.0; qb.numel()];
    let mut dk = vec![0.0; k.numel()];
    let mut dvv = vec![0.0; v.numel()];
    for kp in key_blocks {
        let m = pad.then(|| key_mask(&keep, kp));
        let (gq, gk, gv) = Tensor::sdpa_block_backward(
            &qb,
            &rows(&k, kp),
            &rows(&v, kp),
            q_pos,
            kp,
            m.as_ref(),
            None,
            &out,
            &lse,
            &dout,
        )
        .unwrap();
        for (a, g) in dq.iter_mut().zip(gq.to_vec_f64().unwrap()) {
            *a += g;
        }
        let (gk, gv) = (gk.to_vec_f64().unwrap(), gv.to_vec_f64().unwrap());
        let n = kp.len();
        for bh in 0..b * hkv {
            for (jj, &j) in kp.iter().enumerate() {
                for c in 0..d {
                    dk[(bh * s + j) * d + c] += gk[(bh * n + jj) * d + c];
                }
                for c in 0..dv {
                    dvv[(bh * s + j) * dv + c] += gv[(bh * n + jj) * dv + c];
                }
            }
        }
    }
    close("dq", &dq, &want_dq);
    close("dk", &dk, &want_dk);
    close("dv", &dvv, &want_dv);
}

#[test]
fn classify_by_positions() {
    assert_eq!(BlockMask::classify(&[4, 5], &[0, 1, 2, 3, 4]), BlockMask::Full);
    assert_eq!(BlockMask::classify(&[4, 5], &[6, 7]), BlockMask::Empty);
    assert_eq!(BlockMask::classify(&[], &[0]), BlockMask::Empty);
    assert_eq!(BlockMask::classify(&[0, 1, 6, 7], &[0, 1, 6, 7]), BlockMask::Diagonal);
    assert_eq!(BlockMask::classify(&[0, 1, 6, 7], &[2, 3, 4, 5]), BlockMask::Explicit);
    assert_eq!(BlockMask::classify(&[3, 4], &[2, 3, 4]), BlockMask::Explicit);
}

#[test]
fn head_and_tail_chunks_against_every_split() {
    // The query rows of a load-balanced rank (chunks 1 and 4 of 6 over 12 positions).
    let q_pos = vec![2, 3, 8, 9];
    let all: Vec<usize> = (0..12).collect();
    // Whole sequence in one block (explicit mask), in chunk pairs as ranks hold them, and
    // as single chunks (full, diagonal, empty and explicit blocks all occur).
    let pairs = vec![vec![0, 1, 10, 11], vec![2, 3, 8, 9], vec![4, 5, 6, 7]];
    let singles: Vec<Vec<usize>> = (0..6).map(|c| vec![2 * c, 2 * c + 1]).collect();
    for pad in [false, true] {
        check_split(4, 4, 12, &q_pos, std::slice::from_ref(&all), pad);
        check_split(4, 2, 12, &q_pos, &pairs, pad);
        check_split(4, 1, 12, &q_pos, &singles, pad);
    }
}

#[test]
fn uneven_and_empty_blocks() {
    // 7 positions in chunks of 2, 2, 2, 1, 0, 0 (torch.chunk of 7 into 6).
    let q_pos = vec![0, 1, 6];
    let blocks = vec![vec![0, 1, 6], vec![], vec![2, 3], vec![4, 5]];
    check_split(2, 1, 7, &q_pos, &blocks, true);
    check_split(2, 2, 7, &q_pos, &blocks, false);
}

#[test]
fn diagonal_block_equals_causal_sdpa() {
    // One block holding the whole sequence is the existing causal SDPA, bit for bit.
    let mut rng = Rng::new(3);
    let q = Tensor::randn([1, 4, 9, 8], DType::F64, &mut rng).unwrap();
    let k = Tensor::randn([1, 2, 9, 8], DType::F64, &mut rng).unwrap();
    let v = Tensor::randn([1, 2, 9, 8], DType::F64, &mut rng).unwrap();
    let pos: Vec<usize> = (0..9).collect();
    let (o, _) = Tensor::sdpa_block_forward(&q, &k, &v, &pos, &pos, None, None).unwrap();
    let want = Tensor::scaled_dot_product_attention(&q, &k, &v, None, true, None).unwrap();
    assert_eq!(o.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
}

#[test]
fn merge_matches_log_sum_exp_and_handles_empty_rows() {
    let oa = Tensor::from_vec(vec![1.0f64, 2.0, 5.0, 6.0, 0.0, 0.0], [3, 2]).unwrap();
    let ob = Tensor::from_vec(vec![3.0f64, 4.0, 0.0, 0.0, 0.0, 0.0], [3, 2]).unwrap();
    let ninf = f64::NEG_INFINITY;
    let la = Tensor::from_vec(vec![0.5f64, 1.0, ninf], [3]).unwrap();
    let lb = Tensor::from_vec(vec![-0.25f64, ninf, ninf], [3]).unwrap();
    let (o, l) = Tensor::sdpa_lse_merge(&oa, &la, &ob, &lb).unwrap();
    let l0 = (0.5f64.exp() + (-0.25f64).exp()).ln();
    let (wa, wb) = (0.5f64.exp() / l0.exp(), (-0.25f64).exp() / l0.exp());
    close("lse", &l.to_vec_f64().unwrap()[..2], &[l0, 1.0]);
    assert_eq!(l.to_vec_f64().unwrap()[2], ninf);
    close(
        "out",
        &o.to_vec_f64().unwrap(),
        &[wa * 1.0 + wb * 3.0, wa * 2.0 + wb * 4.0, 5.0, 6.0, 0.0, 0.0],
    );
    // Swapping the weights (a planted bug in a merge) is visibly wrong.
    assert!((wb * 1.0 + wa * 3.0 - o.to_vec_f64().unwrap()[0]).abs() > 1e-3);
}

#[test]
fn bad_arguments_are_typed_errors() {
    let q = Tensor::zeros([1, 2, 3, 4], DType::F64, tpar_tensor::Device::Cpu).unwrap();
    let k = Tensor::zeros([1, 2, 2, 4], DType::F64, tpar_tensor::Device::Cpu).unwrap();
    let e = Tensor::sdpa_block_forward(&q, &k, &k, &[0, 1], &[0, 1], None, None).unwrap_err();
    assert!(e.to_string().contains("3 rows"), "{e}");
    let k3 = Tensor::zeros([1, 3, 2, 4], DType::F64, tpar_tensor::Device::Cpu).unwrap();
    let e = Tensor::sdpa_block_forward(&q, &k3, &k3, &[0, 1, 2], &[0, 1], None, None).unwrap_err();
    assert!(e.to_string().contains("multiple"), "{e}");
    let m = Tensor::zeros([1, 3], DType::F64, tpar_tensor::Device::Cpu).unwrap();
    let e =
        Tensor::sdpa_block_forward(&q, &k, &k, &[0, 1, 2], &[0, 1], Some(&m), None).unwrap_err();
    assert!(e.to_string().contains("key mask"), "{e}");
    let l = Tensor::zeros([3], DType::F64, tpar_tensor::Device::Cpu).unwrap();
    let e = Tensor::sdpa_lse_merge(&q, &l, &q, &l).unwrap_err();
    assert!(e.to_string().contains("lse"), "{e}");
}
