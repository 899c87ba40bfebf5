//! Embeds every CUDA source of `cuda/` (prelude `tpar.cuh`, kernels `*.cu`) into
//! the crate, so NVRTC (on a GPU) and the CPU emulator compile the same text.

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("cuda");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    names.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    names.sort();
    let mut out = String::from("&[\n");
    for p in &names {
        println!("cargo:rerun-if-changed={}", p.display());
        let stem = p.file_stem().unwrap().to_string_lossy();
        writeln!(
            out,
            "    KernelSource {{ name: {stem:?}, text: include_str!({:?}) }},",
            p.display().to_string()
        )
        .unwrap();
    }
    out.push(']');
    let dest = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("cuda_sources.rs");
    std::fs::write(dest, out).unwrap();
}
