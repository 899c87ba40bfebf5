//! `tpar-run`: starts one process per rank with torchrun's environment
//! (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...), prefixes
//! their output with `[rank i] ` and stops them all when one fails.
//! Run `tpar-run --help` for the options; the logic is
//! `tpar_collectives::launch`.

use std::process::ExitCode;

use tpar_collectives::launch::{self, LaunchError, USAGE};

fn main() -> ExitCode {
    let cfg = match launch::parse_args(std::env::args_os().skip(1)) {
        Ok(cfg) => cfg,
        Err(LaunchError::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("tpar-run: {e}");
            return ExitCode::from(2);
        }
    };
    launch::forward_signals();
    match launch::run(&cfg) {
        Ok(outcome) if outcome.success() => ExitCode::SUCCESS,
        Ok(outcome) => {
            eprintln!("tpar-run: {outcome}");
            ExitCode::from(u8::try_from(outcome.exit_code()).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("tpar-run: {e}");
            ExitCode::from(1)
        }
    }
}
