//! GEMM throughput of the tensor core (`Tensor::matmul`) against the `gemm` crate
//! called directly on the same buffers, in the same run.
//! Run: `cargo bench --bench gemm` (optionally `-- 256 512 1024`).

use std::time::Instant;

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

fn gemm_direct(n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let ns = n as isize;
    // SAFETY: a, b, c are n*n row-major buffers; strides (row n, col 1) stay inside them.
    unsafe {
        gemm::gemm(
            n,
            n,
            n,
            c.as_mut_ptr(),
            1,
            ns,
            false,
            a.as_ptr(),
            1,
            ns,
            b.as_ptr(),
            1,
            ns,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        )
    }
}

fn main() -> Result<(), TensorError> {
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
            let t_gemm = best_secs(1.0, || gemm_direct(n, &af, &bf, &mut c));
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
