//! `tpar-run`: starts one process per rank with torchrun's environment
//! (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...), prefixes
//! their output with `[rank i] ` and stops them all when one fails.
//! Run `tpar-run --help` for the options. The binary lives in the root package so that
//! `cargo install tpar` installs it; its flags and logic are `tpar::launch::cli`.

fn main() -> std::process::ExitCode {
    tpar::launch::cli::main(std::env::args_os().skip(1))
}
