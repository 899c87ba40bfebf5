//! Checks of the trainers' command-line flags, shared by `llama_2d` and `llama_pp`: a
//! flag that cannot work is a one-line message and exit code 2, never a panic deep in a
//! rank.
#![allow(dead_code)]

use clap::ValueEnum;

/// What a trainer does with a non-finite loss or gradient norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum NonFinite {
    /// Stop at the first one with an error naming the step and the rank.
    Fail,
    /// Skip that optimizer step (the gradients are zeroed) and log a line.
    Skip,
}

/// `Err` naming the first flag whose value is 0 (`pairs` are `(flag, value)`).
pub fn positive(pairs: &[(&str, usize)]) -> Result<(), String> {
    for (flag, v) in pairs {
        if *v == 0 {
            return Err(format!("{flag} is 0; it must be at least 1"));
        }
    }
    Ok(())
}

/// `Err` unless the learning rate is finite and not negative.
pub fn learning_rate(lr: f64) -> Result<(), String> {
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(format!("--lr {lr}: the learning rate must be finite and not negative"));
    }
    Ok(())
}

/// The model flags checked as [`tpar::models::LlamaConfig::validate`] checks a config
/// (heads dividing the width, an even head dim), with the flag names in the message.
pub fn llama_shape(hidden: usize, heads: usize, kv_heads: usize) -> Result<(), String> {
    if !hidden.is_multiple_of(heads) {
        return Err(format!("--hidden {hidden} is not a multiple of --heads {heads}"));
    }
    if !heads.is_multiple_of(kv_heads) {
        return Err(format!("--heads {heads} is not a multiple of --kv-heads {kv_heads}"));
    }
    if !(hidden / heads).is_multiple_of(2) {
        return Err(format!(
            "--hidden {hidden} / --heads {heads} = head dim {}, which must be even (RoPE)",
            hidden / heads
        ));
    }
    Ok(())
}

/// A number read from the first line of a file (`/proc/sys/...`), if it is one.
fn read_number(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.split_whitespace().next()?.parse().ok()
}

/// `Err` when the local backend (every rank a thread of this process) cannot run `world`
/// ranks on this machine: more than [`tpar::collectives::RANKS_PER_CORE`] per core, more than the OS
/// lets this process start (two threads a rank: its own and its kernel pool's), or more
/// than the memory accounting tells apart (`tpar::tensor::memory::MAX_RANKS`; beyond it
/// the trainers' per-rank peaks would be sums of ranks). `what` names the flags that set
/// the world (`"--world 1000000"`). Checked before any rank starts.
pub fn local_world(world: usize, what: &str) -> Result<(), String> {
    let (threads, mut why) = tpar::collectives::max_rank_threads();
    let tracked = tpar::tensor::memory::MAX_RANKS;
    why.push(format!("{tracked} whose peak memory is tracked apart"));
    let limit = threads.min(tracked);
    if world <= limit {
        return Ok(());
    }
    Err(format!(
        "{what}: {world} ranks, but the local backend runs each rank as a thread of this \
         process and takes at most {limit} here ({}); run fewer ranks, or one process per \
         rank (--backend tcp under tpar-run)",
        why.join("; ")
    ))
}

/// Memory this machine can give a process, in bytes: its RAM (`MemTotal`), or the
/// cgroup's limit when that is lower; `None` where neither can be read.
pub fn machine_memory() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
    });
    let cgroup = read_number("/sys/fs/cgroup/memory.max");
    [total, cgroup].into_iter().flatten().min()
}

/// Bytes of training state per parameter element, at least: the parameter in `dtype`,
/// its gradient, and AdamW's two moments (f32, f64 for f64 parameters).
pub fn training_bytes_per_parameter(dtype: tpar::tensor::DType) -> u128 {
    let state = if dtype == tpar::tensor::DType::F64 { 8 } else { 4 };
    2 * dtype.size_in_bytes() as u128 + 2 * state
}

/// `Err` when the model of `cfg` cannot be trained by this process, before anything is
/// built: its parameter count overflows, or the training state this process must hold
/// (`ranks_here` of the `world` ranks, each parameter element held at least once in the
/// world with its gradient and AdamW state: [`training_bytes_per_parameter`]) exceeds
/// the machine's memory ([`machine_memory`]), or the allocator refuses it. Every
/// sharding and replication only adds to this lower bound. `flags` names the size flags
/// for the message (`"--layers 100000 (hidden 64, intermediate 176)"`).
pub fn model_fits(
    cfg: &tpar::models::LlamaConfig,
    ranks_here: usize,
    world: usize,
    flags: &str,
) -> Result<(), String> {
    let params = cfg.num_parameters().map_err(|e| format!("{flags}: {e}"))?;
    let per = training_bytes_per_parameter(cfg.dtype);
    let need = (params as u128 * per * ranks_here as u128).div_ceil(world.max(1) as u128);
    let human = tpar::tensor::human_bytes;
    let refuse = |have: String| {
        format!(
            "{flags}: {params} parameters need at least {} of training state in this \
             process ({per} bytes a parameter for its value, gradient and AdamW moments, \
             {ranks_here} of {world} ranks here), but {have}; lower --layers (or the widths)",
            human(need)
        )
    };
    match machine_refuses(need) {
        Some(have) => Err(refuse(have)),
        None => Ok(()),
    }
}

/// Why this machine cannot give this process `need` bytes ("this machine has 23.4 GiB",
/// "the allocator refuses that much"), or `None` when it may: over
/// [`machine_memory`], else where that is unknown or fits, the allocator has the last
/// word.
fn machine_refuses(need: u128) -> Option<String> {
    if let Some(mem) = machine_memory() {
        if need > mem as u128 {
            return Some(format!("this machine has {}", tpar::tensor::human_bytes(mem as u128)));
        }
    }
    let fits = usize::try_from(need).ok().is_some_and(|n| {
        n < tpar::tensor::PROBE_BYTES || Vec::<u8>::new().try_reserve_exact(n).is_ok()
    });
    (!fits).then(|| "the allocator refuses that much".to_string())
}

/// The processes a launcher started on this machine, this one included
/// (`LOCAL_WORLD_SIZE`; 1 where it is not set): under a process backend they share the
/// machine's memory.
pub fn processes_on_this_machine() -> usize {
    tpar::launch::EnvInit::from_env().ok().and_then(|e| e.local_world_size).unwrap_or(1).max(1)
}

/// `Err` when the host peaks the memory model predicts for the ranks on this machine
/// (`peaks`, one per rank: this process's rank threads, or under a process backend one
/// per process on the machine, in bytes) together exceed what this machine can give
/// ([`machine_memory`], or the allocator): before anything is built, with the numbers
/// and what would lower them. A sequence or batch too long for the machine stops here
/// instead of at an allocation mid-step.
pub fn peaks_fit(peaks: &[u64]) -> Result<(), String> {
    let need: u128 = peaks.iter().map(|&p| u128::from(p)).sum();
    let Some(have) = machine_refuses(need) else { return Ok(()) };
    let human = tpar::tensor::human_bytes;
    let most = peaks.iter().copied().max().unwrap_or(0);
    Err(format!(
        "the memory model predicts a peak of {} per rank ({} for the {} rank(s) on this \
         machine), but {have}; shorten --seq or --batch, raise --cp, or recompute \
         activations (--ac full)",
        human(u128::from(most)),
        human(need),
        peaks.len()
    ))
}
