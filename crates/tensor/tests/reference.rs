//! Each op's forward against plain loops (or the kernels' f64 reference code) on
//! random inputs, in f32 and bf16, with tolerances from the dtype.

use tpar_kernels::rope::{reference as rope_ref, RopeShape};
use tpar_kernels::sdpa::{reference as sdpa_ref, SdpaMask, SdpaShape};
use tpar_kernels::{rmsnorm::reference as rms_ref, softmax::reference as sm_ref};
use tpar_tensor::tol::Tol;
use tpar_tensor::{DType, Rng, RopeLayout, Tensor};

/// Random values already rounded to `dtype`, so the reference sees the same inputs.
fn input(shape: &[usize], dtype: DType, rng: &mut Rng) -> (Tensor, Vec<f64>) {
    let t = Tensor::randn(shape.to_vec(), dtype, rng).unwrap();
    let v = t.to_vec_f64().unwrap();
    (t, v)
}

fn check(what: &str, dtype: DType, got: &Tensor, want: &[f64], scale: f64) {
    Tol::for_dtype(dtype)
        .scaled(scale)
        .check(&format!("{what} ({dtype})"), &got.to_vec_f64().unwrap(), want)
        .unwrap();
}

type UnaryCase = (&'static str, fn(&Tensor) -> tpar_tensor::Result<Tensor>, fn(f64) -> f64);

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

#[test]
fn elementwise_and_broadcast() {
    for dtype in DTYPES {
        let mut rng = Rng::new(1);
        let (a, av) = input(&[3, 5, 7], dtype, &mut rng);
        let (b, bv) = input(&[5, 1], dtype, &mut rng);
        let idx = |i: usize, j: usize, k: usize| ((i * 5 + j) * 7 + k, j);
        let mut want = Vec::new();
        for i in 0..3 {
            for j in 0..5 {
                for k in 0..7 {
                    let (ia, ib) = idx(i, j, k);
                    want.push(av[ia] * bv[ib] + av[ia]);
                }
            }
        }
        check("mul_add", dtype, &a.mul(&b).unwrap().add(&a).unwrap(), &want, 2.0);
        let unary: [UnaryCase; 5] = [
            ("exp", Tensor::exp, f64::exp),
            ("silu", Tensor::silu, |x| x / (1.0 + (-x).exp())),
            ("tanh", Tensor::tanh, f64::tanh),
            ("neg", Tensor::neg, |x| -x),
            ("square", Tensor::square, |x| x * x),
        ];
        for (name, f, r) in unary {
            let want: Vec<f64> = av.iter().map(|&x| r(x)).collect();
            check(name, dtype, &f(&a).unwrap(), &want, 1.0);
        }
        let want: Vec<f64> = av.iter().map(|&x| x.abs().sqrt()).collect();
        check("abs_sqrt", dtype, &a.abs().unwrap().sqrt().unwrap(), &want, 1.0);
    }
}

#[test]
fn reductions_and_layout() {
    for dtype in DTYPES {
        let mut rng = Rng::new(2);
        let (x, xv) = input(&[4, 6, 5], dtype, &mut rng);
        let mut sum1 = vec![0.0; 20];
        let mut max2 = vec![f64::NEG_INFINITY; 24];
        let mut tr = vec![0.0; 120];
        for i in 0..4 {
            for j in 0..6 {
                for k in 0..5 {
                    let v = xv[(i * 6 + j) * 5 + k];
                    sum1[i * 5 + k] += v;
                    max2[i * 6 + j] = max2[i * 6 + j].max(v);
                    tr[(k * 6 + j) * 4 + i] = v; // permute [2,1,0]
                }
            }
        }
        check("sum", dtype, &x.sum(1, false).unwrap(), &sum1, 4.0);
        let mean: Vec<f64> = sum1.iter().map(|v| v / 6.0).collect();
        check("mean", dtype, &x.mean(1, true).unwrap(), &mean, 4.0);
        check("max", dtype, &x.max(-1, false).unwrap(), &max2, 1.0);
        check("permute", dtype, &x.permute(&[2, 1, 0]).unwrap(), &tr, 0.0);
        let nar: Vec<f64> = (0..4)
            .flat_map(|i| (2..5).flat_map(move |j| (0..5).map(move |k| (i, j, k))))
            .map(|(i, j, k)| xv[(i * 6 + j) * 5 + k])
            .collect();
        check("narrow", dtype, &x.narrow(1, 2, 3).unwrap(), &nar, 0.0);
        let parts = x.chunk(4, 1).unwrap();
        assert_eq!(parts.iter().map(|p| p.dims()[1]).collect::<Vec<_>>(), vec![2, 2, 2]);
        check("cat", dtype, &Tensor::cat(&parts, 1).unwrap(), &xv, 0.0);
        let sm = sm_ref::forward(&xv, 5, false);
        check("softmax", dtype, &x.softmax(-1).unwrap(), &sm, 1.0);
        let lsm = sm_ref::forward(&xv, 5, true);
        check("log_softmax", dtype, &x.log_softmax(2).unwrap(), &lsm, 1.0);
        check("cast", dtype, &x.to_dtype(DType::F64).unwrap(), &xv, 0.0);
    }
}

#[test]
fn matmul_against_loops() {
    for dtype in DTYPES {
        let mut rng = Rng::new(3);
        let (b, m, k, n) = (3, 17, 33, 9);
        let (x, xv) = input(&[b, m, k], dtype, &mut rng);
        let (w, wv) = input(&[n, k], dtype, &mut rng);
        let mut want = vec![0.0; b * m * n];
        for bi in 0..b {
            for i in 0..m {
                for j in 0..n {
                    want[(bi * m + i) * n + j] =
                        (0..k).map(|l| xv[(bi * m + i) * k + l] * wv[j * k + l]).sum();
                }
            }
        }
        check("linear", dtype, &x.linear(&w, None).unwrap(), &want, 4.0);
        let wt = w.transpose(0, 1).unwrap();
        check("matmul", dtype, &x.matmul(&wt).unwrap(), &want, 4.0);
        let xt = x.transpose(1, 2).unwrap();
        check("matmul_tt", dtype, &xt.matmul_t(&w, true, true).unwrap(), &want, 4.0);
    }
}

#[test]
fn fused_nn_ops_against_references() {
    for dtype in DTYPES {
        let mut rng = Rng::new(4);
        let (x, xv) = input(&[2, 5, 16], dtype, &mut rng);
        let (w, wv) = input(&[16], dtype, &mut rng);
        let (want, _) = rms_ref::rmsnorm_forward(&xv, &wv, 16, 1e-6);
        check("rms_norm", dtype, &x.rms_norm(&w, 1e-6).unwrap(), &want, 1.0);

        let (q, qv) = input(&[2, 4, 5, 8], dtype, &mut rng);
        let (cos, cv) = input(&[5, 8], dtype, &mut rng);
        let (sin, sv) = input(&[5, 8], dtype, &mut rng);
        let rs = RopeShape { outer: 8, seq: 5, inner: 1, head_dim: 8 };
        check(
            "rope",
            dtype,
            &q.rope(&cos, &sin, RopeLayout::Bhsd).unwrap(),
            &rope_ref::rope_forward(&rs, &qv, &cv, &sv),
            2.0,
        );

        let (k, kv) = input(&[2, 2, 7, 8], dtype, &mut rng);
        let (v, vv) = input(&[2, 2, 7, 8], dtype, &mut rng);
        let mut mv = vec![0.0; 2 * 7];
        mv[13] = f64::NEG_INFINITY;
        let mask = Tensor::from_f64(&mv, [2, 1, 1, 7], dtype).unwrap();
        let s = SdpaShape {
            batch: 2,
            q_heads: 4,
            kv_heads: 2,
            q_len: 5,
            kv_len: 7,
            head_dim: 8,
            v_dim: 8,
            scale: 1.0 / 8f64.sqrt(),
            causal: true,
        };
        let m = SdpaMask { data: &mv[..], batch_stride: 7, head_stride: 0, row_stride: 0 };
        let (want, _) = sdpa_ref::sdpa_forward(&s, &qv, &kv, &vv, Some(&m));
        let got =
            Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), true, None).unwrap();
        check("sdpa", dtype, &got, &want, 2.0);

        let (logits, lv) = input(&[6, 11], dtype, &mut rng);
        let t = vec![3i64, -100, 0, 10, 5, -100];
        let targets = Tensor::from_vec(t.clone(), [6]).unwrap();
        let mut total = 0.0;
        for (r, &ti) in t.iter().enumerate() {
            if ti >= 0 {
                let row = &lv[r * 11..(r + 1) * 11];
                let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = mx + row.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
                total += lse - row[ti as usize];
            }
        }
        check(
            "cross_entropy",
            dtype,
            &logits.cross_entropy(&targets, -100).unwrap(),
            &[total / 4.0],
            1.0,
        );

        let (table, tv) = input(&[10, 4], dtype, &mut rng);
        let ids = Tensor::from_vec(vec![9i64, 0, 3, 3], [2, 2]).unwrap();
        let want: Vec<f64> =
            [9usize, 0, 3, 3].iter().flat_map(|&i| tv[i * 4..(i + 1) * 4].to_vec()).collect();
        check("embedding", dtype, &Tensor::embedding(&ids, &table).unwrap(), &want, 0.0);
    }
}
