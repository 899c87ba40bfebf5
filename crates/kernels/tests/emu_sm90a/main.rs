//! The Hopper attention kernels in the CPU emulator standing in for an `sm_90a`
//! device, one module per kernel (the forward with its backward on
//! `SdpaPath::Hopper`, the Hopper backward, both on strided operands), the
//! Hopper GEMM's rotary-embedding epilogue (`gemm_rope`), and seeded random
//! sweeps of the GEMM and the attention kernels (`random_sweep`), in one
//! test binary: `cargo test -p tpar-kernels --test emu_sm90a [module::]`.
//!
//! Every module sets `TPAR_EMU_ARCH=sm_90a` (and `sdpa_hopper` sets
//! `TPAR_SDPA=hopper`, which only the checked ops read, and only `sdpa_hopper`
//! calls them), so they share a process with each other but not with the tests
//! of the default architecture (`--test emu`).

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/recording.rs"]
mod recording;

mod gemm_rope;
mod random_sweep;
mod sdpa_hopper;
mod sdpa_hopper_bwd;
mod sdpa_hopper_strided;
