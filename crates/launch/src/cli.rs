//! The `tpar-run` command line: flags parsed by `clap` into a [`LaunchConfig`], every
//! mistake a typed [`UsageError`], and [`main`], the whole of the `tpar-run` binary.
//!
//! ```text
//! tpar-run [options] [--] program [args...]
//!
//!   --nproc-per-node N   processes on this node (default 1)
//!   --nnodes M           number of nodes (default 1)
//!   --node-rank R        this node's index, 0..M (default 0)
//!   --master-addr A      host of rank 0's rendezvous store
//!                        (default 127.0.0.1; required when M > 1)
//!   --master-port P      its port (default: a free port when M = 1, else 29500)
//!   --grace-period S     seconds between the termination signal and SIGKILL (default 5)
//!   --max-restarts N     restart the whole group up to N times after a failure (default 0)
//!   --run-id ID          the job's id, TORCHELASTIC_RUN_ID (default none)
//!   --join-timeout S     seconds the node launchers wait for each other (default 300)
//! ```
//!
//! Options come first, then `--` or the first argument that is not an option, then the
//! program and its arguments (everything after the program is its own, `--help`
//! included). Options also take `--name=value` and torchrun's underscore spellings
//! (`--nproc_per_node`); each may be given once.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, Parser};

use crate::{forward_signals, run, LaunchConfig, LaunchError};

/// The command line's synopsis, after `usage: `.
pub const SYNOPSIS: &str = "tpar-run [options] [--] program [args...]";

/// A bad command line or configuration, with the flag and value it is about.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// An option `tpar-run` does not have.
    #[error("unknown option {option}{}", match suggestion {
        Some(s) => format!(" (did you mean {s}?)"),
        None => String::new(),
    })]
    UnknownOption {
        /// The option as given.
        option: String,
        /// The closest option there is, when one is close.
        suggestion: Option<String>,
    },
    /// An option at the end of the command line, without its value.
    #[error("{flag} needs a value")]
    MissingValue {
        /// The option.
        flag: String,
    },
    /// An option given twice (in any spelling).
    #[error("{flag} given twice")]
    GivenTwice {
        /// The option.
        flag: String,
    },
    /// A value the option cannot take.
    #[error("{flag}: {value:?} {why}")]
    InvalidValue {
        /// The option.
        flag: String,
        /// The value as given.
        value: String,
        /// What it should be (`"is not a port number (1-65535)"`).
        why: String,
    },
    /// `--nnodes MIN:MAX`: torchrun's elastic ranges.
    #[error("--nnodes: {value:?}: elastic node ranges are not supported; give one number")]
    ElasticNodes {
        /// The value as given.
        value: String,
    },
    /// Nothing to run.
    #[error("no program to run")]
    NoProgram,
    /// `--` ends the command line.
    #[error("no program after `--`")]
    NoProgramAfterSeparator,
    /// A multi-node job without `--master-addr`.
    #[error(
        "--master-addr is required when --nnodes > 1 (the host of node 0, reachable from \
         every node)"
    )]
    MasterAddrRequired,
    /// `--nproc-per-node 0` or `--nnodes 0`.
    #[error("{flag} must be at least 1")]
    Zero {
        /// The option.
        flag: &'static str,
    },
    /// `--node-rank` not below `--nnodes`.
    #[error("--node-rank {node_rank} must be below --nnodes {nnodes}")]
    NodeRankOutOfRange {
        /// The node rank given.
        node_rank: usize,
        /// The number of nodes.
        nnodes: usize,
    },
    /// `--nproc-per-node` times `--nnodes` does not fit in a `usize`.
    #[error("--nproc-per-node times --nnodes overflows")]
    WorldSizeOverflow,
    /// `--master-addr ""`.
    #[error("--master-addr is empty")]
    EmptyMasterAddr,
    /// Port 0.
    #[error("--master-port must be between 1 and 65535")]
    PortZero,
    /// Any other mistake `clap` reports, in its words.
    #[error("{0}")]
    Other(String),
}

/// Why a value parser refused a value; becomes [`UsageError::InvalidValue`] or
/// [`UsageError::ElasticNodes`] with the flag and value filled in.
#[derive(Debug, thiserror::Error)]
enum BadValue {
    #[error("is not a non-negative integer")]
    Count,
    #[error("is not a port number (1-65535)")]
    Port,
    #[error("is not a number of seconds")]
    Seconds,
    #[error("elastic node ranges are not supported")]
    Elastic,
}

fn count(v: &str) -> Result<usize, BadValue> {
    v.parse().map_err(|_| BadValue::Count)
}

fn nodes(v: &str) -> Result<usize, BadValue> {
    if v.contains(':') {
        return Err(BadValue::Elastic);
    }
    count(v)
}

fn restarts(v: &str) -> Result<u32, BadValue> {
    v.parse().map_err(|_| BadValue::Count)
}

fn port(v: &str) -> Result<u16, BadValue> {
    v.parse::<u16>().ok().filter(|p| *p != 0).ok_or(BadValue::Port)
}

fn seconds(v: &str) -> Result<Duration, BadValue> {
    let s = v.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0);
    s.map(Duration::from_secs_f64).ok_or(BadValue::Seconds)
}

/// The flags, as `clap` parses them. Every option takes the next argument as its value,
/// even one that starts with `-`.
#[derive(Debug, Parser)]
#[command(
    name = "tpar-run",
    override_usage = SYNOPSIS,
    help_template = "usage: {usage}\n\n{about}\n\noptions:\n{options}{after-help}\n",
    about = "Starts one process per rank with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, and
OMP_NUM_THREADS=1 when N > 1 and it is unset) and prefixes each line they print
with `[rank i] `. If a rank fails, the others are stopped and tpar-run exits
non-zero (or restarts the group, --max-restarts).",
    after_help = "Options also accept `--name=value` and torchrun's underscore spellings
(--nproc_per_node). Multi-node: run tpar-run on every node with the same
--nnodes, --master-addr and --master-port and a distinct --node-rank.",
    disable_version_flag = true
)]
struct Cli {
    /// Processes on this node
    #[arg(long, alias = "nproc_per_node", value_name = "N", default_value = "1",
          value_parser = count, allow_hyphen_values = true)]
    nproc_per_node: usize,
    /// Number of nodes
    #[arg(long, value_name = "M", default_value = "1", value_parser = nodes,
          allow_hyphen_values = true)]
    nnodes: usize,
    /// This node's index, 0..M
    #[arg(long, alias = "node_rank", value_name = "R", default_value = "0",
          value_parser = count, allow_hyphen_values = true)]
    node_rank: usize,
    /// Host of rank 0's rendezvous store
    /// [default: 127.0.0.1; required when M > 1]
    #[arg(
        verbatim_doc_comment,
        long,
        alias = "master_addr",
        value_name = "A",
        allow_hyphen_values = true
    )]
    master_addr: Option<String>,
    /// Its port [default: a free port when M = 1, else 29500]
    #[arg(long, alias = "master_port", value_name = "P", value_parser = port,
          allow_hyphen_values = true)]
    master_port: Option<u16>,
    /// Seconds between the termination signal and SIGKILL
    /// when stopping ranks
    #[arg(verbatim_doc_comment, long, alias = "grace_period", value_name = "S", default_value = "5",
          value_parser = seconds, allow_hyphen_values = true)]
    grace_period: Duration,
    /// Restart the whole group up to N times after a
    /// rank fails
    #[arg(verbatim_doc_comment, long, alias = "max_restarts", value_name = "N", default_value = "0",
          value_parser = restarts, allow_hyphen_values = true)]
    max_restarts: u32,
    /// The job's id (TORCHELASTIC_RUN_ID) [default: none]
    #[arg(long, aliases = ["run_id", "rdzv-id", "rdzv_id"], value_name = "ID",
          allow_hyphen_values = true)]
    run_id: Option<String>,
    /// Seconds the node launchers wait for each other
    #[arg(long, alias = "join_timeout", value_name = "S", default_value = "300",
          value_parser = seconds, allow_hyphen_values = true)]
    join_timeout: Duration,
    /// The program each rank runs, then its arguments
    #[arg(value_name = "PROGRAM", trailing_var_arg = true, value_parser = clap::value_parser!(OsString))]
    command: Vec<OsString>,
}

impl Cli {
    /// The config, once the flags agree with each other. `saw_separator`: whether the
    /// command line held a `--` (which then ended it, since no program follows).
    fn into_config(self, saw_separator: bool) -> Result<LaunchConfig, UsageError> {
        let mut command = self.command.into_iter();
        let program = command.next().ok_or(if saw_separator {
            UsageError::NoProgramAfterSeparator
        } else {
            UsageError::NoProgram
        })?;
        if self.nnodes > 1 && self.master_addr.is_none() {
            return Err(UsageError::MasterAddrRequired);
        }
        let mut cfg = LaunchConfig::new(self.nproc_per_node, program);
        cfg.nnodes = self.nnodes;
        cfg.node_rank = self.node_rank;
        if let Some(addr) = self.master_addr {
            cfg.master_addr = addr;
        }
        cfg.master_port = self.master_port;
        cfg.grace_period = self.grace_period;
        cfg.max_restarts = self.max_restarts;
        if let Some(id) = self.run_id {
            cfg.run_id = id;
        }
        cfg.join_timeout = self.join_timeout;
        cfg.args = command.collect();
        cfg.validate()?;
        Ok(cfg)
    }
}

/// A context string of a clap error.
fn context(e: &clap::Error, kind: ContextKind) -> Option<String> {
    match e.get(kind)? {
        ContextValue::String(s) => Some(s.clone()),
        ContextValue::Strings(v) => v.first().cloned(),
        _ => None,
    }
}

/// The option's name in a clap context string (`"--nnodes <M>"` is `--nnodes`).
fn flag_name(arg: &str) -> String {
    arg.split([' ', '=']).next().unwrap_or(arg).to_string()
}

impl UsageError {
    /// The typed form of a `clap` error.
    fn from_clap(e: &clap::Error) -> UsageError {
        let arg = context(e, ContextKind::InvalidArg);
        let value = context(e, ContextKind::InvalidValue);
        let flag = || flag_name(arg.as_deref().unwrap_or_default());
        let source = std::error::Error::source(e).and_then(|s| s.downcast_ref::<BadValue>());
        match e.kind() {
            ErrorKind::UnknownArgument => UsageError::UnknownOption {
                option: arg.clone().unwrap_or_default(),
                suggestion: context(e, ContextKind::SuggestedArg).map(|s| flag_name(&s)),
            },
            ErrorKind::InvalidValue if value.as_deref().unwrap_or_default().is_empty() => {
                UsageError::MissingValue { flag: flag() }
            }
            ErrorKind::ArgumentConflict
                if context(e, ContextKind::PriorArg).map(|p| flag_name(&p)) == Some(flag()) =>
            {
                UsageError::GivenTwice { flag: flag() }
            }
            ErrorKind::ValueValidation if matches!(source, Some(BadValue::Elastic)) => {
                UsageError::ElasticNodes { value: value.unwrap_or_default() }
            }
            ErrorKind::ValueValidation if source.is_some() => UsageError::InvalidValue {
                flag: flag(),
                value: value.unwrap_or_default(),
                why: source.map(ToString::to_string).unwrap_or_default(),
            },
            ErrorKind::InvalidUtf8 => UsageError::InvalidValue {
                flag: flag(),
                value: value.unwrap_or_default(),
                why: "is not UTF-8".into(),
            },
            _ => {
                let text = e.render().to_string();
                let first = text.lines().next().unwrap_or_default();
                UsageError::Other(first.trim_start_matches("error: ").to_string())
            }
        }
    }
}

/// Parses the launcher's command line (without the launcher's own name): options, then
/// `--` or the first argument that is not an option, then the program and its arguments.
/// `--help` is [`LaunchError::Help`]; a mistake is [`LaunchError::Usage`].
pub fn parse_args<I, S>(args: I) -> Result<LaunchConfig, LaunchError>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let argv = std::iter::once(OsString::from("tpar-run")).chain(args.iter().cloned());
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) if e.kind() == ErrorKind::DisplayHelp => return Err(LaunchError::Help),
        Err(e) => return Err(UsageError::from_clap(&e).into()),
    };
    Ok(cli.into_config(args.iter().any(|a| a == "--"))?)
}

/// The text `tpar-run --help` prints.
pub fn help_text() -> String {
    Cli::command().render_help().to_string()
}

/// The `tpar-run` binary: parses `args` (without the program's name), forwards the
/// launcher's termination signals to the ranks, runs them and turns the outcome into the
/// exit code: 0, the failed rank's code, 128 + the signal that stopped a rank or the
/// launcher, 2 for a bad command line, 1 when ranks could not be started or waited for.
pub fn main<I, S>(args: I) -> ExitCode
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let cfg = match parse_args(args) {
        Ok(cfg) => cfg,
        Err(LaunchError::Help) => {
            print!("{}", help_text());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("tpar-run: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = forward_signals() {
        eprintln!("tpar-run: {e}");
        return ExitCode::from(1);
    }
    match run(&cfg) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<LaunchConfig, LaunchError> {
        parse_args(args.iter().copied())
    }

    fn usage_msg(args: &[&str]) -> String {
        match parse(args) {
            Err(LaunchError::Usage(e)) => e.to_string(),
            other => panic!("expected a usage error for {args:?}, got {other:?}"),
        }
    }

    #[test]
    fn parses_single_node() {
        let c = parse(&["--nproc-per-node", "4", "--", "python", "train.py", "--lr", "1"]).unwrap();
        assert_eq!(c.nproc_per_node, 4);
        assert_eq!((c.nnodes, c.node_rank, c.world_size()), (1, 0, 4));
        assert_eq!(c.master_addr, "127.0.0.1");
        assert_eq!(c.master_port, None);
        assert_eq!(c.program, "python");
        assert_eq!(c.args, ["train.py", "--lr", "1"]);
        assert_eq!(c.grace_period, Duration::from_secs(5));
    }

    #[test]
    fn parses_multi_node_torchrun_spellings_and_no_separator() {
        let c = parse(&[
            "--nproc_per_node=2",
            "--nnodes",
            "3",
            "--node_rank=2",
            "--master-addr",
            "10.0.0.1",
            "--master_port",
            "1234",
            "--grace-period",
            "0.5",
            "./train",
            "--nnodes",
            "9",
        ])
        .unwrap();
        assert_eq!((c.nproc_per_node, c.nnodes, c.node_rank), (2, 3, 2));
        assert_eq!(c.world_size(), 6);
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.1", Some(1234)));
        assert_eq!(c.grace_period, Duration::from_millis(500));
        // Everything after the program belongs to it.
        assert_eq!(c.program, "./train");
        assert_eq!(c.args, ["--nnodes", "9"]);
        let c = parse(&["prog"]).unwrap();
        assert_eq!((c.nproc_per_node, c.program.to_str()), (1, Some("prog")));
    }

    #[test]
    fn parses_restarts_run_id_and_join_timeout() {
        let c =
            parse(&["--max-restarts", "2", "--rdzv-id", "job", "--join-timeout=1.5", "p"]).unwrap();
        assert_eq!((c.max_restarts, c.run_id.as_str()), (2, "job"));
        assert_eq!(c.join_timeout, Duration::from_millis(1500));
        let c = parse(&["p"]).unwrap();
        assert_eq!((c.max_restarts, c.run_id.as_str()), (0, "none"));
        assert_eq!(c.join_timeout, Duration::from_secs(300));
        let m = usage_msg(&["--max-restarts", "-1", "p"]);
        assert!(m.contains("--max-restarts") && m.contains("\"-1\""), "{m}");
    }

    #[test]
    fn help_is_its_own_variant() {
        assert!(matches!(parse(&["--help"]), Err(LaunchError::Help)));
        assert!(matches!(parse(&["--nnodes", "1", "-h", "x"]), Err(LaunchError::Help)));
        // After the separator, --help is the program's.
        let c = parse(&["--", "prog", "--help"]).unwrap();
        assert_eq!(c.args, ["--help"]);
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        let m = usage_msg(&["--nproc-per-node", "two", "--", "p"]);
        assert!(m.contains("--nproc-per-node") && m.contains("\"two\""), "{m}");
        assert!(usage_msg(&["--nproc-per-node", "0", "p"]).contains("at least 1"));
        assert!(usage_msg(&["--bogus", "p"]).contains("unknown option --bogus"));
        assert!(usage_msg(&["-x", "p"]).contains("unknown option -x"));
        assert!(usage_msg(&["--nnodes"]).contains("--nnodes needs a value"));
        assert!(usage_msg(&["--nproc-per-node", "2"]).contains("no program"));
        assert!(usage_msg(&["--"]).contains("no program after"));
        assert!(usage_msg(&["--master-port", "0", "p"]).contains("--master-port"));
        assert!(usage_msg(&["--master-port", "65536", "p"]).contains("\"65536\""));
        assert!(usage_msg(&["--nnodes", "1:4", "p"]).contains("elastic"));
        assert!(usage_msg(&["--nnodes", "2", "p"]).contains("--master-addr is required"));
        let m = usage_msg(&["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "p"]);
        assert!(m.contains("--node-rank 2 must be below --nnodes 2"), "{m}");
        assert!(usage_msg(&["--nnodes", "1", "--nnodes=1", "p"]).contains("given twice"));
        assert!(usage_msg(&["--grace-period", "-1", "p"]).contains("--grace-period"));
        // The error's text carries the usage.
        let e = parse(&["--bogus"]).unwrap_err().to_string();
        assert!(e.contains("unknown option --bogus") && e.contains("usage: tpar-run"), "{e}");
    }

    #[test]
    fn usage_errors_are_typed() {
        let err = |args: &[&str]| match parse(args) {
            Err(LaunchError::Usage(e)) => e,
            other => panic!("expected a usage error for {args:?}, got {other:?}"),
        };
        assert_eq!(
            err(&["--nproc-per-node", "two", "p"]),
            UsageError::InvalidValue {
                flag: "--nproc-per-node".into(),
                value: "two".into(),
                why: "is not a non-negative integer".into(),
            }
        );
        assert_eq!(err(&["--nproc_per_node=1", "--nproc-per-node", "2", "p"]), {
            UsageError::GivenTwice { flag: "--nproc-per-node".into() }
        });
        assert_eq!(
            err(&["--master-port"]),
            UsageError::MissingValue { flag: "--master-port".into() }
        );
        assert_eq!(
            err(&["--nnodes", "2:4", "p"]),
            UsageError::ElasticNodes { value: "2:4".into() }
        );
        assert_eq!(err(&["--nnodes", "0", "p"]), UsageError::Zero { flag: "--nnodes" });
        assert_eq!(err(&["--master-addr", "", "p"]), UsageError::EmptyMasterAddr);
        assert_eq!(err(&[]), UsageError::NoProgram);
        assert_eq!(err(&["--nnodes", "1", "--"]), UsageError::NoProgramAfterSeparator);
        match err(&["--nproc-per-nod", "2", "p"]) {
            UsageError::UnknownOption { option, suggestion } => {
                assert_eq!(option, "--nproc-per-nod");
                assert_eq!(suggestion.as_deref(), Some("--nproc-per-node"));
            }
            other => panic!("{other:?}"),
        }
        // An option's value may start with a dash; it is still checked.
        let m = err(&["--master-port", "-5", "p"]).to_string();
        assert_eq!(m, "--master-port: \"-5\" is not a port number (1-65535)");
    }

    #[test]
    fn help_lists_every_flag() {
        let h = help_text();
        assert!(h.starts_with("usage: tpar-run [options] [--] program [args...]"), "{h}");
        for flag in [
            "--nproc-per-node",
            "--nnodes",
            "--node-rank",
            "--master-addr",
            "--master-port",
            "--grace-period",
            "--max-restarts",
            "--run-id",
            "--join-timeout",
            "--help",
        ] {
            assert!(h.contains(flag), "{flag} in\n{h}");
        }
    }
}
