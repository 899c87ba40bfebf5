//! Typed launch wrappers: one module per kernel source, each with the
//! `#[repr(C)]` argument structs its kernels take and functions that check
//! sizes, pick the grid and launch on any [`super::Launcher`].

pub mod adamw;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod layout;
pub mod reduce;
pub mod rmsnorm;
pub mod rope;
pub mod sdpa;
