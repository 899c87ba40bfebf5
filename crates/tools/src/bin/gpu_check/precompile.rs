//! `gpu_check --precompile ARCH`: NVRTC compiles every kernel source for
//! `ARCH` (`sm_90`, `sm_90a`) into the on-disk kernel cache, without a GPU.

use std::time::Instant;

use tpar_kernels::cuda::device::{precompile, CompileOptions};

/// Fills the kernel cache for `arch` and prints its files; the exit status
/// (0, or 2 when NVRTC or the cache is missing or a source fails).
pub(crate) fn run(arch: &str) -> i32 {
    let t0 = Instant::now();
    let options = CompileOptions::default();
    match precompile(arch, &options) {
        Ok(files) => {
            for f in &files {
                println!("{}", f.display());
            }
            println!(
                "{} kernel sources compiled for {arch} ({:.1} s)",
                files.len(),
                t0.elapsed().as_secs_f64()
            );
            0
        }
        Err(e) => {
            eprintln!("gpu_check: --precompile {arch}: {e}");
            2
        }
    }
}
