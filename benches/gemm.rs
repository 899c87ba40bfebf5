//! GEMM throughput of the tensor core (`Tensor::matmul`) against the `gemm` crate
//! called directly on the same buffers, in the same run.
//! Run: `cargo bench --bench gemm` (optionally `-- 256 512 1024`).
//!
//! `-- --llama-step` instead times the f32 products of one step of the Llama of
//! `benches/llama_step.rs` (2048 tokens; each linear layer's forward, input gradient
//! and weight gradient, with their layouts): tpar's kernel (`tpar::kernels::gemm::matmul`,
//! which splits a large product by rows, one serial gemm call per pool thread) against
//! the gemm crate's own parallel split on the same buffers, the two alternated, median
//! of 9 each; the last line sums each side over the step (each shape times its count).

use std::time::Instant;

use tpar::kernels::gemm::GemmShape;
use tpar::prelude::*;

/// Best-of time for `f`, repeated until about `budget` seconds have passed.
fn best_secs(budget: f64, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 3 || (start.elapsed().as_secs_f64() < budget && runs < 200) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    best
}

/// `C = A B` with the gemm crate's own thread split: A `[m, k]` (stored `[k, m]` with
/// `trans_a`), B `[k, n]` (stored `[n, k]` with `trans_b`), all row-major.
fn gemm_crate_split(s: &GemmShape, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (s.m, s.n, s.k);
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let (a_rs, a_cs) = if s.trans_a { (1, m as isize) } else { (k as isize, 1) };
    let (b_rs, b_cs) = if s.trans_b { (1, k as isize) } else { (n as isize, 1) };
    // SAFETY: the strides address elements below m*k of `a` and k*n of `b` (asserted
    // lengths), and `c` holds m*n elements with row stride n.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        )
    }
}

/// The `--llama-step` table (see the crate docs).
fn llama_step_products() -> Result<(), TensorError> {
    use tpar::kernels::gemm::matmul;
    let t = 2048;
    // (name, m, n, k, A transposed, B transposed, count per step): 4 layers of q, k, v,
    // o, gate, up, down, and the output head.
    let shapes = [
        ("fwd q/o", t, 256, 256, false, true, 8),
        ("fwd k/v", t, 128, 256, false, true, 8),
        ("fwd gate/up", t, 768, 256, false, true, 8),
        ("fwd down", t, 256, 768, false, true, 4),
        ("fwd head", t, 4096, 256, false, true, 1),
        ("dx q/o", t, 256, 256, false, false, 8),
        ("dx k/v", t, 256, 128, false, false, 8),
        ("dx gate/up", t, 256, 768, false, false, 8),
        ("dx down", t, 768, 256, false, false, 4),
        ("dx head", t, 256, 4096, false, false, 1),
        ("dw q/o", 256, 256, t, true, false, 8),
        ("dw k/v", 128, 256, t, true, false, 8),
        ("dw gate/up", 768, 256, t, true, false, 8),
        ("dw down", 256, 768, t, true, false, 4),
        ("dw head", 4096, 256, t, true, false, 1),
    ];
    println!("threads: {}", rayon::current_num_threads());
    println!(
        "{:<12} {:>15} {:>10} {:>12} {:>8}",
        "product", "m x n x k", "tpar ms", "gemm ms", "ratio"
    );
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut sum_tpar, mut sum_gemm) = (0.0, 0.0);
    let mut rng = Rng::new(5);
    for (name, m, n, k, trans_a, trans_b, count) in shapes {
        let s = GemmShape { trans_a, trans_b, ..GemmShape::new(1, m, n, k) };
        let a = Tensor::randn([m * k], DType::F32, &mut rng)?.to_vec::<f32>()?;
        let b = Tensor::randn([k * n], DType::F32, &mut rng)?.to_vec::<f32>()?;
        let mut c = vec![0f32; m * n];
        let (mut tt, mut tg) = (Vec::new(), Vec::new());
        for _ in 0..9 {
            let t0 = Instant::now();
            matmul(&s, &a, &b, &mut c, false)
                .map_err(|e| TensorError::External(std::sync::Arc::new(e)))?;
            tt.push(t0.elapsed().as_secs_f64() * 1e3);
            let t0 = Instant::now();
            gemm_crate_split(&s, &a, &b, &mut c);
            tg.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let (mt, mg) = (median(&mut tt), median(&mut tg));
        sum_tpar += mt * count as f64;
        sum_gemm += mg * count as f64;
        println!(
            "{name:<12} {:>15} {mt:>10.3} {mg:>12.3} {:>8.3}",
            format!("{m}x{n}x{k}"),
            mt / mg
        );
    }
    println!(
        "per step: tpar {sum_tpar:.1} ms, gemm crate split {sum_gemm:.1} ms, ratio {:.3}",
        sum_tpar / sum_gemm
    );
    Ok(())
}

fn main() -> Result<(), TensorError> {
    if std::env::args().any(|a| a == "--llama-step") {
        return llama_step_products();
    }
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![256, 512, 1024] } else { sizes };
    println!("threads: {}", rayon::current_num_threads());
    println!(
        "{:>6} {:>6} {:>14} {:>14} {:>8}",
        "n", "dtype", "tpar GFLOP/s", "gemm GFLOP/s", "ratio"
    );
    for &n in &sizes {
        let flops = 2.0 * (n as f64).powi(3);
        let mut rng = Rng::new(n as u64);
        for dtype in [DType::F32, DType::BF16] {
            let a = Tensor::randn([n, n], dtype, &mut rng)?;
            let b = Tensor::randn([n, n], dtype, &mut rng)?;
            let t_tpar = best_secs(1.0, || {
                a.matmul(&b).expect("matmul");
            });
            // Baseline: the gemm crate in f32 on the same values (bf16 has no native CPU GEMM).
            let af = a.to_dtype(DType::F32)?.to_vec::<f32>()?;
            let bf = b.to_dtype(DType::F32)?.to_vec::<f32>()?;
            let mut c = vec![0f32; n * n];
            let t_gemm =
                best_secs(1.0, || gemm_crate_split(&GemmShape::new(1, n, n, n), &af, &bf, &mut c));
            println!(
                "{n:>6} {:>6} {:>14.1} {:>14.1} {:>8.3}",
                dtype.name(),
                flops / t_tpar / 1e9,
                flops / t_gemm / 1e9,
                t_gemm / t_tpar
            );
        }
    }
    Ok(())
}
