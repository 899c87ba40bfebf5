//! The command-line flags (clap). `--help` prints them, then the tool's
//! description (the doc comment of `main.rs`).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// Where the kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum DeviceKind {
    /// A CUDA GPU (`--ordinal` picks which).
    #[value(alias = "cuda")]
    Gpu,
    /// The CPU emulator of the CUDA execution model (always `--quick`).
    #[value(alias = "emu")]
    Emulator,
}

/// Checks every CUDA kernel family against the CPU kernels, then (with
/// `--bench`, on a GPU) measures their throughput.
#[derive(Debug, Parser)]
#[command(name = "gpu_check", args_override_self = true, after_long_help = description())]
pub(crate) struct Opts {
    /// The device under test.
    #[arg(long, value_enum, default_value_t = DeviceKind::Gpu)]
    pub(crate) device: DeviceKind,
    /// The GPU (or emulated device) ordinal.
    #[arg(long, default_value_t = 0)]
    pub(crate) ordinal: usize,
    /// Small sizes (always on in the emulator).
    #[arg(long)]
    pub(crate) quick: bool,
    /// Run the benchmarks after the checks (GPU only).
    #[arg(long)]
    pub(crate) bench: bool,
    /// Skip the correctness checks.
    #[arg(long)]
    pub(crate) no_checks: bool,
    /// Write the checks and the benchmark numbers to this JSON file.
    #[arg(long, value_name = "PATH")]
    pub(crate) json: Option<PathBuf>,
    /// With `--bench`: write the GEMM tuning table (tpar's and cuBLASLt's
    /// rate per product) to this file, for `TPAR_GEMM=auto` through
    /// `TPAR_GEMM_TABLE`.
    #[arg(long, value_name = "PATH")]
    pub(crate) gemm_table: Option<PathBuf>,
    /// Only these families (comma-separated): gemm, sdpa, rmsnorm, rope,
    /// cross_entropy, embedding, adamw, reduce, elementwise, layout.
    #[arg(long, value_name = "FAMILY,...", value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x7470_6172)]
    pub(crate) seed: u64,
    /// Perturb one reference value of every comparison: every check must fail.
    #[arg(long)]
    pub(crate) sabotage: bool,
    /// Compile every kernel source for this architecture (`sm_90`, `sm_90a`)
    /// into the kernel cache, without a GPU, and exit.
    #[arg(long, value_name = "ARCH")]
    pub(crate) precompile: Option<String>,
}

impl Opts {
    /// The options as the tool uses them: `--only` names trimmed, and quick
    /// sizes in the emulator (it runs kernels one thread at a time on the CPU).
    pub(crate) fn finish(mut self) -> Opts {
        for o in &mut self.only {
            *o = o.trim().to_string();
        }
        if !self.gpu() {
            self.quick = true;
        }
        self
    }

    /// Whether the device under test is a GPU.
    pub(crate) fn gpu(&self) -> bool {
        self.device == DeviceKind::Gpu
    }
}

/// The long description of `--help`: the doc comment of `main.rs`.
fn description() -> String {
    let doc: Vec<&str> = include_str!("main.rs")
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .map(|l| l.trim_start_matches("//!").trim_start_matches(' '))
        .collect();
    doc.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Opts, clap::Error> {
        Opts::try_parse_from(std::iter::once("gpu_check").chain(args.iter().copied()))
            .map(Opts::finish)
    }

    #[test]
    fn flags_parse_as_the_scripts_pass_them() {
        Opts::command().debug_assert();
        let o = parse(&[]).unwrap();
        assert!(o.gpu() && !o.quick && !o.bench && !o.no_checks && !o.sabotage);
        assert_eq!((o.ordinal, o.seed, o.json, o.precompile), (0, 0x7470_6172, None, None));
        let o = parse(&["--bench", "--quick", "--json", "/tmp/x.json", "--quick"]).unwrap();
        assert_eq!(o.gemm_table, None);
        let t = parse(&["--bench", "--gemm-table", "/tmp/t.txt"]).unwrap().gemm_table;
        assert_eq!(t, Some(PathBuf::from("/tmp/t.txt")));
        assert!(o.bench && o.quick);
        assert_eq!(o.json, Some(PathBuf::from("/tmp/x.json")));
        let o = parse(&["--device", "emu", "--only", "rmsnorm, gemm", "--sabotage"]).unwrap();
        assert!(!o.gpu() && o.quick && o.sabotage);
        assert_eq!(o.only, ["rmsnorm", "gemm"]);
        assert!(parse(&["--device", "cuda", "--ordinal", "1"]).unwrap().gpu());
        assert_eq!(
            parse(&["--precompile", "sm_90a"]).unwrap().precompile.as_deref(),
            Some("sm_90a")
        );
        assert!(parse(&["--no-checks", "--seed", "7"]).is_ok_and(|o| o.no_checks && o.seed == 7));
        assert!(parse(&["--device", "tpu"]).is_err());
        assert!(parse(&["--seed", "x"]).is_err());
        assert!(parse(&["--frobnicate"]).is_err());
    }
}
