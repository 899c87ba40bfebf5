//! The CPU emulator's tests of the kernel families, one module per family (the
//! CUDA sources of `cuda/` run on the host against the CPU kernels or the f64
//! references), in one test binary: `cargo test -p tpar-kernels --test emu
//! [module::]`. Each module was a test binary of its own; together they link
//! once and their tests share the harness's threads.
//!
//! Only tests that leave the process alone belong here. The ones that set
//! environment variables (`emu_sm90a`, `emu_gemm_hopper*`, `emu_gemm_table`),
//! change the emulator's thread-order seed (`emu_hopper`, `emu_selftest`,
//! `emu_setmaxnreg`) or capture CUDA graphs on a shared emulated device
//! (`emu_cuda_graph`, `emu_adamw_capturable`, `emu_gemm_pad`) keep binaries of
//! their own, so that no test here runs under another's settings.

#[path = "../common/mod.rs"]
mod common;

mod adamw;
mod cross_entropy;
mod dropout;
mod elementwise;
mod embedding;
mod gemm;
mod gemm_fused;
mod layout;
mod memcheck;
mod multi;
mod racecheck;
mod reduce;
mod rmsnorm;
mod rope;
mod safe_ops;
mod sdpa;
mod sdpa_strided;
