//! The tuning table picks the Hopper GEMM's launch configuration per problem
//! (`ops::gemm::hopper_config`), in the CPU emulator standing in for
//! `sm_90a`: a problem whose record names `hopper=n256c2` launches the
//! `_n256` kernel in 2-block clusters, through `ops::gemm::gemm` and the
//! fused epilogue GEMM alike; a record without `hopper=` and a problem the
//! table lacks launch the default; `TPAR_GEMM_TILE_N` or `TPAR_GEMM_CLUSTER`,
//! once set, win over the table. The launched kernel's name says the tile
//! width, its cluster dimensions the cluster size.
//!
//! A test binary of its own with one test: the variables are process-wide and
//! the table is read once per process.

#[path = "common/recording.rs"]
mod recording;

use tpar_kernels::cuda::ops::gemm::gemm;
use tpar_kernels::cuda::ops::gemm_fused::{gemm_fused, EpiloguePath, FusedEpilogue};
use tpar_kernels::cuda::ops::gemm_tune::GEMM_TABLE_ENV;
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::raw::gemm_hopper::{CLUSTER_ENV, EMU_ARCH_ENV, TILE_N_ENV};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, Launcher};
use tpar_kernels::gemm::GemmShape;

use recording::Recording;

fn set(name: &str, value: Option<&str>) {
    // SAFETY (edition 2021 API): this binary's only test runs alone.
    match value {
        Some(v) => std::env::set_var(name, v),
        None => std::env::remove_var(name),
    }
}

const M: usize = 8;
const N: usize = 296;
const K: usize = 64;

/// A bf16 x bf16 -> f32 product of the test's sizes in layout `ta`, `tb`.
fn problem(ta: bool, tb: bool) -> GemmProblem {
    let shape = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, M, N, K) };
    GemmProblem::new(shape, CudaDType::BF16, CudaDType::F32)
}

/// What one product launched (kernel name, cluster shape), after checking
/// that C came out right: A and B are bf16 ones, so every element is K.
fn launched(dev: &Recording, p: &GemmProblem, fused: bool) -> Vec<(String, [u32; 3])> {
    let ones = vec![0x3f80u16; K * M.max(N)];
    let da = DeviceBuffer::from_host(&dev.inner, &ones[..M * K]).unwrap();
    let db = DeviceBuffer::from_host(&dev.inner, &ones[..K * N]).unwrap();
    let mut dc = DeviceBuffer::zeros(&dev.inner, M * N * 4).unwrap();
    dev.take();
    let (a, b, c) = (da.as_slice(), db.as_slice(), dc.as_slice_mut());
    if fused {
        let path = gemm_fused(dev, p, FusedEpilogue::default(), a, b, c).unwrap();
        assert_eq!(path, EpiloguePath::Fused);
    } else {
        gemm(dev, p, a, b, c).unwrap();
    }
    let host = dc.to_host().unwrap();
    let vals: Vec<f32> = bytemuck::pod_collect_to_vec(&host);
    assert!(vals.iter().all(|&v| v == K as f32), "{p:?}: C is not all {K}");
    dev.take().into_iter().map(|(name, cfg)| (name, cfg.cluster)).collect()
}

#[test]
fn the_table_picks_the_hopper_config_unless_the_environment_names_one() {
    set(EMU_ARCH_ENV, Some("sm_90a"));
    set(TILE_N_ENV, None);
    set(CLUSTER_ENV, None);
    let dev = Recording::new(None);
    let dir = std::env::temp_dir().join(format!("tpar-emu-gemm-table-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gemm.table");
    let kind = dev.describe().split_once(' ').unwrap().1.to_string();
    std::fs::write(
        &path,
        format!(
            "device {kind}\n\
             gemm bf16>f32 nt b1 {M}x{N}x{K} ours=2 cublaslt=1 hopper=n256c2\n\
             gemm bf16>f32 nn b1 {M}x{N}x{K} ours=2 cublaslt=1\n"
        ),
    )
    .unwrap();
    set(GEMM_TABLE_ENV, Some(path.to_str().unwrap()));

    let (nt, nn, tn) = (problem(false, true), problem(false, false), problem(true, false));
    let kernel = |layout: &str, wide: bool| {
        format!("tpar_gemm_hopper_{layout}_bf16_f32{}", if wide { "_n256" } else { "" })
    };
    let (one, two) = ([1, 1, 1], [2, 1, 1]);
    for (what, p, fused, tile_n, cluster, want) in [
        // the table's configuration, on both paths to the Hopper kernel
        ("table n256c2", &nt, false, None, None, (kernel("nt", true), two)),
        ("table n256c2, fused", &nt, true, None, None, (kernel("nt", true), two)),
        // a record without hopper=, and no record: the default
        ("record without hopper=", &nn, false, None, None, (kernel("nn", false), one)),
        ("not in the table", &tn, false, None, None, (kernel("tn", false), one)),
        // either variable set: the environment, the other one's default
        ("TILE_N=128 over n256c2", &nt, false, Some("128"), None, (kernel("nt", false), one)),
        ("CLUSTER=1 over n256c2", &nt, true, None, Some("1"), (kernel("nt", false), one)),
        ("CLUSTER=2 over the default", &nn, false, None, Some("2"), (kernel("nn", false), two)),
        ("TILE_N=256 not in the table", &tn, false, Some("256"), None, (kernel("tn", true), one)),
        // set but empty: unset, so the table again
        ("empty variables", &nt, false, Some(" "), Some(""), (kernel("nt", true), two)),
    ] {
        set(TILE_N_ENV, tile_n);
        set(CLUSTER_ENV, cluster);
        assert_eq!(launched(&dev, p, fused), [want], "{what}");
    }
    set(TILE_N_ENV, Some("512"));
    let a = DeviceBuffer::zeros(&dev.inner, M * K * 2).unwrap();
    let b = DeviceBuffer::zeros(&dev.inner, K * N * 2).unwrap();
    let mut c = DeviceBuffer::zeros(&dev.inner, M * N * 4).unwrap();
    let e = gemm(&dev, &nt, a.as_slice(), b.as_slice(), c.as_slice_mut()).unwrap_err();
    assert!(e.to_string().contains("TPAR_GEMM_TILE_N=\"512\""), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
