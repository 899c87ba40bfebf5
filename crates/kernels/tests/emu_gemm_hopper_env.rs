//! `gemm_hopper::gemm` takes its launch configuration from the environment:
//! `TPAR_GEMM_TILE_N` picks the tile width (the `_n256` kernels and their
//! shared memory at 256) and `TPAR_GEMM_CLUSTER` the cluster size, and a bad
//! value is a typed error naming it, before anything is launched. A test
//! binary of its own with one test: the variables are process-wide.

mod common;
#[path = "common/recording.rs"]
mod recording;

use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::raw::gemm_hopper::{
    self, Epilogue, HopperTarget, CLUSTER_ENV, SHARED_BYTES, SHARED_BYTES_N256, TILE_N_ENV,
};
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::gemm::GemmShape;

use common::Buf;
use recording::Recording;

fn set(name: &str, value: Option<&str>) {
    // SAFETY (edition 2021 API): this binary's only test runs alone.
    match value {
        Some(v) => std::env::set_var(name, v),
        None => std::env::remove_var(name),
    }
}

#[test]
fn the_tile_width_and_cluster_size_come_from_the_environment() {
    // A and B of bf16 ones: every element of C is k
    let (m, n, k) = (8, 296, 64);
    let mut a = Buf::new(&vec![0x3f80u16; m * k], 0);
    let mut b = Buf::new(&vec![0x3f80u16; k * n], 0);
    let p = GemmProblem::new(GemmShape::new(1, m, n, k), CudaDType::BF16, CudaDType::F32);
    let (ap, bp) = (a.ptr(), b.ptr());
    let rec = Recording::for_host_memory(None);
    let run = |tile_n: Option<&str>, cluster: Option<&str>| {
        set(TILE_N_ENV, tile_n);
        set(CLUSTER_ENV, cluster);
        let mut c = Buf::<f32>::zeros(m * n, 0);
        // SAFETY: A, B and C hold m x k, k x n and m x n elements, C apart.
        unsafe {
            gemm_hopper::gemm(
                &rec,
                HopperTarget::emulator(4),
                &p,
                &Epilogue::default(),
                ap,
                bp,
                c.ptr(),
            )
        }
        .map(|()| c.get())
    };
    let base = "tpar_gemm_hopper_nn_bf16_f32";
    for (tile_n, cluster, kernel, shared, shape) in [
        (None, None, base.to_string(), SHARED_BYTES, [1, 1, 1]),
        (Some(" 256"), None, format!("{base}_n256"), SHARED_BYTES_N256, [1, 1, 1]),
        (Some("256"), Some("2"), format!("{base}_n256"), SHARED_BYTES_N256, [2, 1, 1]),
        (Some("128"), Some(""), base.to_string(), SHARED_BYTES, [1, 1, 1]),
        (Some(""), Some("2"), base.to_string(), SHARED_BYTES, [2, 1, 1]),
    ] {
        let what = format!("{TILE_N_ENV}={tile_n:?} {CLUSTER_ENV}={cluster:?}");
        let c = run(tile_n, cluster).unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut launches = rec.take();
        let (got, cfg) = launches.pop().unwrap_or_else(|| panic!("{what}: no launch"));
        assert!(launches.is_empty(), "{what}: more than one launch: {launches:?}");
        assert_eq!((got.as_str(), cfg.shared_bytes, cfg.cluster), (kernel.as_str(), shared, shape));
        assert!(c.iter().all(|&v| v == k as f32), "{what}: C is not all {k}");
    }
    for (tile_n, cluster, named) in [
        (Some("512"), None, "TPAR_GEMM_TILE_N=\"512\": expected 128 or 256"),
        (Some("n256"), None, "TPAR_GEMM_TILE_N=\"n256\": expected 128 or 256"),
        (Some("256"), Some("3"), "TPAR_GEMM_CLUSTER=\"3\": expected 1 or 2"),
    ] {
        let e = run(tile_n, cluster).unwrap_err().to_string();
        assert!(e.contains(named), "{e}");
        assert!(rec.take().is_empty(), "launched despite {named}");
    }
}
