//! Distributed checkpoint throughput and the cost of an asynchronous save to training.
//!
//! Part A: a world of rank threads holding ~500 MB of f32 state (four 2-D tensors
//! sharded along dim 0 and one replicated tensor) is saved (`tpar::checkpoint::save`:
//! copy, CRC-32, safetensors write, fsync, metadata, atomic rename) and loaded into a
//! target of the same layout; in the same run, one thread writes the same number of
//! bytes to one file with `std::fs::write` + `sync_all`, and reads them back with
//! `std::fs::read`. Nothing is dropped from the page cache: the reads (load and plain
//! read alike) come from memory.
//!
//! Part B: a sharded Llama (FSDP on dp = 2) trained with AdamW through a
//! `CheckpointManager` with `async_save: true` and `keep: Some(2)`: the median step time
//! without a save next to the median time of the steps that run while an asynchronous
//! save is in flight (each step followed by `poll()`, until the save commits), split
//! into the step itself and the `poll()` that commits; the process CPU a save costs
//! beyond its steps; and the time of a synchronous save of the same state.
//!
//! Run: `cargo bench --bench checkpoint`. Options after `--`: `--quick` (or
//! `TPAR_BENCH_QUICK=1`) for a smaller state and model; `--world 4` for four ranks in
//! part A; `--only a` / `--only b` for one part; `--keep K` for the manager's `keep`
//! (`0`: keep all, so no pruning at commit); `--writer-nice N` to alternate part B's
//! saves between writers at the library's default priority (nice 10) and at nice `N`
//! (Linux), reported side by side. Every figure is repeated on the final `summary:`
//! line as `key=value` pairs.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tpar::checkpoint::{async_save, load, LoadOptions, SaveOptions, ShardedTensor};
use tpar::prelude::*;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = std::result::Result<T, BoxError>;

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[s.len() / 2]
}

/// `n` f32 values of a xorshift sequence (not compressible, not zero pages).
fn pattern(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32) * 1e-7 - 0.8
        })
        .collect()
}

/// Bytes of the files under `dir` (recursively).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// CPU seconds (user, system) of the whole process so far, every thread included
/// (exited ones too), from `/proc/self/stat`; zeros where it cannot be read.
#[cfg(target_os = "linux")]
fn cpu_times() -> (f64, f64) {
    extern "C" {
        fn sysconf(name: i32) -> i64;
    }
    // SAFETY: sysconf has no preconditions; _SC_CLK_TCK is 2 on Linux.
    let hz = unsafe { sysconf(2) }.max(1) as f64;
    let Ok(stat) = fs::read_to_string("/proc/self/stat") else { return (0.0, 0.0) };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return (0.0, 0.0) };
    // After the command name: state is field 3, utime 14, stime 15.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / hz;
    (tick(11), tick(12))
}

#[cfg(not(target_os = "linux"))]
fn cpu_times() -> (f64, f64) {
    (0.0, 0.0)
}

struct Args {
    quick: bool,
    world: usize,
    /// Part B only: every other save runs its writer at this nice value
    /// (`SaveOptions::writer_nice`; 0 = the training thread's priority) instead of the
    /// library's default: how much of the async-save cost is CPU competition.
    writer_nice: Option<i32>,
    /// Part B: the manager's `keep` (`--keep 0` keeps all); default 2.
    keep: Option<usize>,
    /// `--only a` or `--only b`: one part.
    only: Option<char>,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let value = |flag: &str| argv.iter().position(|a| a == flag).and_then(|i| argv.get(i + 1));
    let quick = argv.iter().any(|a| a == "--quick")
        || std::env::var("TPAR_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let world = value("--world").and_then(|w| w.parse().ok()).unwrap_or(2);
    let writer_nice = value("--writer-nice").and_then(|n| n.parse().ok());
    let keep = match value("--keep").and_then(|k| k.parse::<usize>().ok()) {
        Some(0) => None,
        Some(k) => Some(k),
        None => Some(2),
    };
    let only = value("--only").and_then(|p| p.chars().next());
    Args { quick, world, writer_nice, keep, only }
}

// ---------------------------------------------------------------------------------
// Part A: save / load throughput against plain file I/O.

/// The state of part A: `sharded` tensors of `[rows, cols]` split along dim 0 over the
/// world, and one replicated `[rep_rows, cols]` tensor every rank holds whole.
#[derive(Clone, Copy)]
struct StateSpec {
    sharded: usize,
    rows: usize,
    cols: usize,
    rep_rows: usize,
}

impl StateSpec {
    /// Bytes of the checkpoint's tensor data (each element written once).
    fn bytes(&self) -> usize {
        (self.sharded * self.rows + self.rep_rows) * self.cols * 4
    }
    /// Bytes all ranks together read on load (every rank reads the replicated tensor).
    fn load_bytes(&self, world: usize) -> usize {
        (self.sharded * self.rows + world * self.rep_rows) * self.cols * 4
    }
}

/// This rank's part of the state; `fill` false gives zeros of the same layout.
fn rank_state(s: StateSpec, rank: usize, world: usize, fill: bool) -> Res<StateDict> {
    let per = s.rows / world;
    let mut sd = StateDict::new();
    for i in 0..s.sharded {
        let n = per * s.cols;
        let data = if fill { pattern(n, (i * 64 + rank) as u64 + 1) } else { vec![0.0; n] };
        let t = Tensor::from_vec(data, [per, s.cols])?;
        let st =
            ShardedTensor::new(vec![s.rows, s.cols], DType::F32, vec![(vec![rank * per, 0], t)])?;
        sd.insert(format!("layers.{i}.weight"), StateValue::Sharded(st));
    }
    let n = s.rep_rows * s.cols;
    let data = if fill { pattern(n, 999) } else { vec![0.0; n] };
    sd.insert(
        "replicated".into(),
        StateValue::Tensor(Tensor::from_vec(data, [s.rep_rows, s.cols])?),
    );
    sd.insert("step".into(), StateValue::Int(if fill { 1000 } else { 0 }));
    Ok(sd)
}

/// Every tensor's elements of `a` equal `b`'s.
fn same_state(a: &StateDict, b: &StateDict) -> Res<bool> {
    for (k, va) in a {
        let ok = match (va, &b[k]) {
            (StateValue::Tensor(x), StateValue::Tensor(y)) => {
                x.to_vec::<f32>()? == y.to_vec::<f32>()?
            }
            (StateValue::Sharded(x), StateValue::Sharded(y)) => {
                let mut eq = x.chunks().len() == y.chunks().len();
                for (cx, cy) in x.chunks().iter().zip(y.chunks()) {
                    eq &= cx.offsets == cy.offsets
                        && cx.tensor.to_vec::<f32>()? == cy.tensor.to_vec::<f32>()?;
                }
                eq
            }
            (StateValue::Int(x), StateValue::Int(y)) => x == y,
            _ => false,
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

struct PartA {
    bytes: usize,
    load_bytes: usize,
    save_s: f64,
    load_s: f64,
    write_s: f64,
    read_s: f64,
    /// The save's phases: the `async_save` call (plan exchange + copy of the chunks),
    /// until the slowest rank's writer is done (write, fsync, CRC), the commit.
    call_s: f64,
    written_s: f64,
    commit_s: f64,
    /// Every rank writing its own shard's bytes to its own file at once, + `sync_all`.
    par_write_s: f64,
}

/// A buffer of `n` pattern bytes.
fn pattern_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(n);
    for v in pattern(n / 4, seed) {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.resize(n, 0);
    b
}

fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    fs::write(path, bytes)?;
    fs::File::open(path)?.sync_all()
}

fn part_a(spec: StateSpec, world: usize, reps: usize, root: &Path) -> Res<PartA> {
    let dir = root.join("throughput");
    let plain = root.join("plain.bin");
    let bytes = spec.bytes();
    let out =
        spawn_scoped(SpawnConfig::new(world).timeout(Duration::from_secs(600)), |ctx| -> Res<_> {
            let g = ctx.world_group();
            let rank = g.rank();
            let sd = rank_state(spec, rank, world, true)?;
            let mut target = rank_state(spec, rank, world, false)?;
            // The plain baselines' bytes: the whole checkpoint's size on rank 0 (one
            // sequential file), and each rank's own shard file's size (parallel files:
            // the lowest rank holding the replicated tensor writes it).
            let buf = if rank == 0 { pattern_bytes(bytes, 7) } else { Vec::new() };
            let mine = (spec.sharded * (spec.rows / world)
                + if rank == 0 { spec.rep_rows } else { 0 })
                * spec.cols
                * 4;
            let own = pattern_bytes(mine, 11 + rank as u64);
            let own_path = root.join(format!("plain-{rank}.bin"));
            let mut t = std::collections::BTreeMap::<&str, Vec<f64>>::new();
            let mut rec = |k: &'static str, v: f64| t.entry(k).or_default().push(v);
            for _ in 0..reps {
                // Plain sequential write of the same bytes by one thread (rank 0), into
                // a new file.
                if rank == 0 {
                    let _ = fs::remove_file(&plain);
                }
                g.barrier()?;
                if rank == 0 {
                    let t = Instant::now();
                    write_synced(&plain, &buf)?;
                    rec("write", t.elapsed().as_secs_f64());
                }
                // Every rank its own file at once.
                let _ = fs::remove_file(&own_path);
                g.barrier()?;
                let t = Instant::now();
                write_synced(&own_path, &own)?;
                g.barrier()?;
                rec("par_write", t.elapsed().as_secs_f64());
                // Distributed save into a new directory: copy, write, fsync, CRC,
                // metadata, commit (`save` is exactly `async_save(..)?.wait()`).
                if rank == 0 {
                    let _ = fs::remove_dir_all(&dir);
                }
                g.barrier()?;
                let t = Instant::now();
                let handle = async_save(&sd, &dir, &g, &SaveOptions::default())?;
                let call = t.elapsed().as_secs_f64();
                while !handle.is_written() {
                    std::thread::sleep(Duration::from_micros(500));
                }
                let written = t.elapsed().as_secs_f64();
                // The slowest rank's writer.
                let slowest =
                    g.all_reduce(&Tensor::scalar(written, DType::F64), ReduceOp::Max)?.item()?;
                let t1 = Instant::now();
                handle.wait()?;
                g.barrier()?;
                rec("save", t.elapsed().as_secs_f64());
                let commit = t1.elapsed().as_secs_f64();
                rec("call", call);
                rec("written", slowest);
                rec("commit", commit);
                // Plain sequential read (from the page cache).
                if rank == 0 {
                    let t = Instant::now();
                    let back = fs::read(&plain)?;
                    rec("read", t.elapsed().as_secs_f64());
                    assert_eq!(back.len(), bytes);
                }
                g.barrier()?;
                // Resharding load into a target of the same layout (CRC checked).
                let t = Instant::now();
                load(&mut target, &dir, &g, &LoadOptions::default())?;
                g.barrier()?;
                rec("load", t.elapsed().as_secs_f64());
            }
            let _ = fs::remove_file(&own_path);
            assert!(same_state(&sd, &target)?, "rank {rank}: the loaded state differs");
            Ok(t.into_iter()
                .map(|(k, v)| (k, median(&v)))
                .collect::<std::collections::BTreeMap<_, _>>())
        })?;
    let m = out.into_iter().next().expect("rank 0");
    let on_disk = dir_bytes(&dir);
    println!(
        "  checkpoint directory: {:.1} MB on disk for {:.1} MB of tensor data",
        on_disk as f64 / 1e6,
        bytes as f64 / 1e6
    );
    let _ = fs::remove_dir_all(&dir);
    let _ = fs::remove_file(&plain);
    Ok(PartA {
        bytes,
        load_bytes: spec.load_bytes(world),
        save_s: m["save"],
        load_s: m["load"],
        write_s: m["write"],
        read_s: m["read"],
        call_s: m["call"],
        written_s: m["written"],
        commit_s: m["commit"],
        par_write_s: m["par_write"],
    })
}

// ---------------------------------------------------------------------------------
// Part B: step time while an asynchronous save is in flight.

#[derive(Clone, Copy)]
struct ModelSpec {
    hidden: usize,
    intermediate: usize,
    layers: usize,
    vocab: usize,
    seq: usize,
    batch: usize,
    dp: usize,
    cycles: usize,
    plain_steps: usize,
}

impl ModelSpec {
    fn config(&self) -> LlamaConfig {
        LlamaConfig {
            vocab_size: self.vocab,
            max_position_embeddings: self.seq,
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            num_hidden_layers: self.layers,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            dtype: DType::F32,
        }
    }
}

struct Trainer {
    model: LlamaForPretraining,
    opt: AdamW,
    mesh: DeviceMesh,
    spec: ModelSpec,
}

impl Trainer {
    fn new(world: &ProcessGroup, spec: ModelSpec) -> Res<Trainer> {
        let mesh = DeviceMesh::new(world, DeviceType::Cpu, &[spec.dp, 1], &["dp", "tp"])?;
        let mut model = LlamaForPretraining::new(&spec.config(), Device::Meta)?;
        if spec.dp > 1 {
            let fsdp = FsdpConfig::default();
            for layer in &mut model.base_model.layers.items {
                fully_shard(layer, &mesh["dp"], &fsdp)?;
            }
            fully_shard(&mut model, &mesh["dp"], &fsdp)?;
        }
        reset_parameters(&mut model, Device::Cpu, 1)?;
        let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 };
        let opt = AdamW::with_names(named_parameters(&model), adamw)?;
        Ok(Trainer { model, opt, mesh, spec })
    }

    /// One training step on a synthetic batch.
    fn step(&mut self, step: usize) -> Res<f64> {
        let s = self.spec;
        let dp_rank = self.mesh["dp"].local_rank();
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((step * 131 + dp_rank) as u64);
        let ids: Vec<i64> = (0..s.batch * (s.seq + 1))
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) % s.vocab as u64) as i64
            })
            .collect();
        let all = Tensor::from_vec(ids, [s.batch, s.seq + 1])?;
        let (ids, targets) =
            (all.narrow(1, 0, s.seq)?.deep_clone()?, all.narrow(1, 1, s.seq)?.deep_clone()?);
        let _lp = loss_parallel::enable(&self.mesh["tp"]);
        unshard(&self.model)?;
        let logits = self.model.logits(&ids, None)?.reshape(&[-1, s.vocab as isize])?;
        let loss = logits.cross_entropy(&targets.reshape([targets.numel()])?, -100)?;
        loss.backward()?;
        clip_grad_norm_(&parameters(&self.model), 1.0, &ClipOptions::default())?;
        self.opt.step()?;
        self.opt.zero_grad();
        Ok(loss.item()?)
    }

    fn save(&mut self, ckpt: &mut CheckpointManager, step: u64) -> Res<()> {
        let mut model = ModuleState::new(&mut self.model);
        let mut items: [(&str, &mut dyn Stateful); 2] =
            [("model", &mut model), ("optim", &mut self.opt)];
        ckpt.save(step, &mut items)?;
        Ok(())
    }
}

/// What the save windows of one kind of save measured (rank 0).
#[derive(Default)]
struct Arm {
    /// Step + `poll()`, and the step alone, of every step while a save was in flight.
    inflight: Vec<f64>,
    inflight_c: Vec<f64>,
    /// `poll()` on the step where it committed, and on the steps where it did not.
    commit: Vec<f64>,
    busy: Vec<f64>,
    /// The blocking save call (plan exchange + copy), and save call to commit.
    call: Vec<f64>,
    total: Vec<f64>,
    saves: usize,
    steps: usize,
    /// Process CPU seconds (user, sys) over the save windows.
    cpu: (f64, f64),
}

/// One kind of save's figures.
struct ArmStats {
    inflight_step_s: f64,
    inflight_compute_s: f64,
    commit_poll_s: f64,
    busy_poll_s: f64,
    inflight_steps: usize,
    steps_per_save: f64,
    save_call_s: f64,
    async_total_s: f64,
    /// Process CPU seconds (user, sys) per save beyond its steps at the plain rate.
    cpu_extra_per_save: (f64, f64),
}

impl Arm {
    fn stats(&self, cpu_plain_step: (f64, f64)) -> ArmStats {
        let n = self.saves.max(1) as f64;
        let k = self.steps as f64;
        ArmStats {
            inflight_step_s: median(&self.inflight),
            inflight_compute_s: median(&self.inflight_c),
            commit_poll_s: median(&self.commit),
            busy_poll_s: median(&self.busy),
            inflight_steps: self.inflight.len(),
            steps_per_save: k / n,
            save_call_s: median(&self.call),
            async_total_s: median(&self.total),
            cpu_extra_per_save: (
                (self.cpu.0 - k * cpu_plain_step.0) / n,
                (self.cpu.1 - k * cpu_plain_step.1) / n,
            ),
        }
    }
}

struct PartB {
    state_bytes: u64,
    /// Step + `poll()` (a no-op) without a save, and the step alone.
    plain_step_s: f64,
    plain_compute_s: f64,
    plain_steps: usize,
    /// Process CPU seconds (user, sys) per plain step.
    cpu_plain_step: (f64, f64),
    /// The saves as the library starts them, and (with `--writer-nice`) the saves
    /// whose writers started at that nice value, alternating with them.
    default: ArmStats,
    niced: Option<ArmStats>,
    sync_save_s: f64,
}

fn part_b(spec: ModelSpec, args: &Args, root: &Path) -> Res<PartB> {
    let writer_nice = args.writer_nice;
    let async_dir = root.join("async");
    let sync_dir = root.join("sync");
    let out = spawn_scoped(
        SpawnConfig::new(spec.dp).timeout(Duration::from_secs(600)),
        |ctx| -> Res<_> {
            let world = ctx.world_group();
            let mut tr = Trainer::new(&world, spec)?;
            let config =
                CheckpointConfig { keep: args.keep, async_save: true, ..Default::default() };
            let mut ckpt = CheckpointManager::new(&async_dir, &world, config)?;
            let mut alt = match writer_nice {
                Some(n) => {
                    let save_options = SaveOptions { writer_nice: n, ..Default::default() };
                    let config =
                        CheckpointConfig { keep: args.keep, async_save: true, save_options };
                    Some(CheckpointManager::new(async_dir.with_extension("alt"), &world, config)?)
                }
                None => None,
            };
            let mut step = 0usize;
            // Warm-up: the first steps allocate and fill the optimizer state.
            for _ in 0..3 {
                tr.step(step)?;
                step += 1;
            }
            // A first async save outside the measurement (creates the files' directory
            // entries and the writer's first allocations).
            tr.save(&mut ckpt, step as u64)?;
            ckpt.wait()?;
            let (mut plain, mut plain_c) = (vec![], vec![]);
            let mut arms = [Arm::default(), Arm::default()];
            // Process CPU seconds (user, sys) over the plain blocks, rank 0's view
            // between barriers.
            let mut cpu_plain = (0.0, 0.0);
            let add = |acc: &mut (f64, f64), a: (f64, f64), b: (f64, f64)| {
                acc.0 += b.0 - a.0;
                acc.1 += b.1 - a.1;
            };
            let cycles = if writer_nice.is_some() { 2 * spec.cycles } else { spec.cycles };
            for cycle in 0..cycles {
                world.barrier()?;
                let c0 = cpu_times();
                for _ in 0..spec.plain_steps {
                    let t = Instant::now();
                    tr.step(step)?;
                    let c = t.elapsed().as_secs_f64();
                    ckpt.poll()?; // no save pending: returns at once, no communication
                    plain.push(t.elapsed().as_secs_f64());
                    plain_c.push(c);
                    step += 1;
                }
                world.barrier()?;
                let c1 = cpu_times();
                add(&mut cpu_plain, c0, c1);
                // With --writer-nice, every other save goes through the manager whose
                // writers run at that nice value.
                let use_alt = cycle % 2 == 1 && alt.is_some();
                let arm = &mut arms[usize::from(use_alt)];
                let mgr = match (&mut alt, use_alt) {
                    (Some(a), true) => a,
                    _ => &mut ckpt,
                };
                let t0 = Instant::now();
                tr.save(mgr, step as u64)?;
                arm.call.push(t0.elapsed().as_secs_f64());
                let mut n = 0;
                loop {
                    let t = Instant::now();
                    tr.step(step)?;
                    let c = t.elapsed().as_secs_f64();
                    let committed = mgr.poll()?;
                    let all = t.elapsed().as_secs_f64();
                    arm.inflight.push(all);
                    arm.inflight_c.push(c);
                    if committed { &mut arm.commit } else { &mut arm.busy }.push(all - c);
                    step += 1;
                    n += 1;
                    if committed {
                        break;
                    }
                    if n > 1000 {
                        return Err("the asynchronous save did not commit in 1000 steps".into());
                    }
                }
                arm.total.push(t0.elapsed().as_secs_f64());
                arm.saves += 1;
                arm.steps += n;
                world.barrier()?;
                add(&mut arm.cpu, c1, cpu_times());
            }
            let n_plain = plain.len() as f64;
            let cpu_plain_step = (cpu_plain.0 / n_plain, cpu_plain.1 / n_plain);
            ckpt.wait()?;
            let state_bytes = ckpt.latest()?.map(|s| dir_bytes(&ckpt.step_dir(s))).unwrap_or(0);
            // Synchronous saves of the same state, for comparison.
            let config =
                CheckpointConfig { keep: Some(1), async_save: false, ..Default::default() };
            let mut sync = CheckpointManager::new(&sync_dir, &world, config)?;
            let mut sync_t = vec![];
            for i in 0..3 {
                world.barrier()?;
                let t = Instant::now();
                tr.save(&mut sync, (step + i) as u64)?;
                sync_t.push(t.elapsed().as_secs_f64());
            }
            Ok(PartB {
                state_bytes,
                plain_step_s: median(&plain),
                plain_compute_s: median(&plain_c),
                plain_steps: plain.len(),
                cpu_plain_step,
                default: arms[0].stats(cpu_plain_step),
                niced: writer_nice.map(|_| arms[1].stats(cpu_plain_step)),
                sync_save_s: median(&sync_t),
            })
        },
    )?;
    let _ = fs::remove_dir_all(&async_dir);
    let _ = fs::remove_dir_all(&sync_dir);
    Ok(out.into_iter().next().expect("rank 0"))
}

fn main() -> Res<()> {
    let a = args();
    let root: PathBuf =
        PathBuf::from("/tmp").join(format!("tpar-bench-checkpoint-{}", std::process::id()));
    fs::create_dir_all(&root)?;
    let result = run(&a, &root);
    let _ = fs::remove_dir_all(&root);
    result
}

/// The 1-minute load average (other processes on a shared machine show up here).
fn loadavg() -> f64 {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn run(a: &Args, root: &Path) -> Res<()> {
    let t_all = Instant::now();
    let load0 = loadavg();
    println!(
        "{} cores, 1-min load average {load0:.2} at the start",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let mut summary: Vec<(String, String)> = vec![("quick".into(), a.quick.to_string())];
    let mut kv = |k: &str, v: String| summary.push((k.to_string(), v));
    if a.only != Some('b') {
        let (spec, reps) = if a.quick {
            (StateSpec { sharded: 4, rows: 1792, cols: 4096, rep_rows: 512 }, 2)
        } else {
            (StateSpec { sharded: 4, rows: 7168, cols: 4096, rep_rows: 2048 }, 3)
        };
        assert!(spec.rows % a.world == 0, "rows must divide over the world");
        println!(
            "part A: world {} rank threads, {} x [{}, {}] f32 sharded on dim 0 + [{}, {}] replicated = {:.1} MB, median of {reps}",
            a.world, spec.sharded, spec.rows, spec.cols, spec.rep_rows, spec.cols, spec.bytes() as f64 / 1e6
        );
        let pa = part_a(spec, a.world, reps, root)?;
        let mbps = |s: f64| pa.bytes as f64 / 1e6 / s;
        let (save_mbps, write_mbps) = (mbps(pa.save_s), mbps(pa.write_s));
        let (load_mbps, read_mbps) = (mbps(pa.load_s), mbps(pa.read_s));
        let par_write_mbps = mbps(pa.par_write_s);
        println!(
            "  save (plan + copy + write + fsync + CRC + metadata + commit): {:.3} s = {save_mbps:.0} MB/s",
            pa.save_s
        );
        println!(
            "    phases: async_save call (plan + copy) {:.3} s, writers done (write + fsync + CRC) at {:.3} s, commit {:.3} s",
            pa.call_s, pa.written_s, pa.commit_s
        );
        println!(
            "  plain fs::write + sync_all, one file, one thread: {:.3} s = {write_mbps:.0} MB/s -> save / plain write = {:.2}",
            pa.write_s,
            save_mbps / write_mbps
        );
        println!(
            "  plain fs::write + sync_all, each rank its shard file's bytes at once: {:.3} s = {par_write_mbps:.0} MB/s -> save / this = {:.2}",
            pa.par_write_s,
            save_mbps / par_write_mbps
        );
        println!(
            "  load (read + CRC + assemble, page cache): {:.3} s = {load_mbps:.0} MB/s of checkpoint ({:.1} MB read by all ranks: the replicated tensor on each)",
            pa.load_s,
            pa.load_bytes as f64 / 1e6
        );
        println!(
            "  plain fs::read, one file, one thread, page cache: {:.3} s = {read_mbps:.0} MB/s -> load / plain read = {:.2}",
            pa.read_s,
            load_mbps / read_mbps
        );
        kv("world", a.world.to_string());
        kv("state_mb", format!("{:.1}", pa.bytes as f64 / 1e6));
        kv("save_s", format!("{:.3}", pa.save_s));
        kv("save_mbps", format!("{save_mbps:.0}"));
        kv("plain_write_mbps", format!("{write_mbps:.0}"));
        kv("save_over_plain_write", format!("{:.3}", save_mbps / write_mbps));
        kv("plain_par_write_mbps", format!("{par_write_mbps:.0}"));
        kv("save_over_plain_par_write", format!("{:.3}", save_mbps / par_write_mbps));
        kv("save_call_s", format!("{:.3}", pa.call_s));
        kv("save_written_s", format!("{:.3}", pa.written_s));
        kv("save_commit_s", format!("{:.3}", pa.commit_s));
        kv("load_s", format!("{:.3}", pa.load_s));
        kv("load_mbps", format!("{load_mbps:.0}"));
        kv("plain_read_mbps", format!("{read_mbps:.0}"));
        kv("load_over_plain_read", format!("{:.3}", load_mbps / read_mbps));
    }
    if a.only != Some('a') {
        let ms = if a.quick {
            ModelSpec {
                hidden: 256,
                intermediate: 704,
                layers: 2,
                vocab: 4096,
                seq: 64,
                batch: 2,
                dp: 2,
                cycles: 3,
                plain_steps: 4,
            }
        } else {
            ModelSpec {
                hidden: 256,
                intermediate: 704,
                layers: 4,
                vocab: 4096,
                seq: 128,
                batch: 2,
                dp: 2,
                cycles: 8,
                plain_steps: 5,
            }
        };
        println!(
            "part B: Llama hidden {} x {} layers (MLP {}), vocab {}, seq {}, batch {} per dp rank, FSDP dp={} tp=1, AdamW, CheckpointManager async_save keep {:?}",
            ms.hidden, ms.layers, ms.intermediate, ms.vocab, ms.seq, ms.batch, ms.dp, a.keep
        );
        let pb = part_b(ms, a, root)?;
        println!(
            "  checkpoint of model + AdamW state: {:.1} MB on disk",
            pb.state_bytes as f64 / 1e6
        );
        println!(
            "  median step without a save: {:.1} ms ({} steps); process CPU per step: user {:.0} ms + sys {:.0} ms",
            pb.plain_step_s * 1e3,
            pb.plain_steps,
            pb.cpu_plain_step.0 * 1e3,
            pb.cpu_plain_step.1 * 1e3
        );
        kv("llama_ckpt_mb", format!("{:.1}", pb.state_bytes as f64 / 1e6));
        kv("step_ms", format!("{:.1}", pb.plain_step_s * 1e3));
        let arms = [("", Some(&pb.default)), ("nice_", pb.niced.as_ref())];
        for (prefix, arm) in arms {
            let Some(s) = arm else { continue };
            if !prefix.is_empty() {
                println!("  saves whose writers start at nice {}:", a.writer_nice.unwrap_or(0));
            }
            let ratio = s.inflight_step_s / pb.plain_step_s;
            let compute_ratio = s.inflight_compute_s / pb.plain_compute_s;
            println!(
                "  median step while an async save is in flight (step + poll, until commit): {:.1} ms ({} steps, {:.1} per save) -> ratio {ratio:.3} (target <= 1.1)",
                s.inflight_step_s * 1e3,
                s.inflight_steps,
                s.steps_per_save
            );
            println!(
                "    of which the step alone (no poll): {:.1} ms while in flight vs {:.1} ms without -> ratio {compute_ratio:.3}",
                s.inflight_compute_s * 1e3,
                pb.plain_compute_s * 1e3
            );
            println!(
                "    poll() on the committing step (gather + metadata + fsyncs + rename + prune): {:.1} ms; on steps with writers still busy: {}",
                s.commit_poll_s * 1e3,
                if s.busy_poll_s.is_nan() {
                    "none".to_string()
                } else {
                    format!("{:.1} ms", s.busy_poll_s * 1e3)
                }
            );
            println!(
                "    process CPU per save beyond its steps: user {:.0} ms + sys {:.0} ms",
                s.cpu_extra_per_save.0 * 1e3,
                s.cpu_extra_per_save.1 * 1e3
            );
            println!(
                "    the blocking save call (plan + copy) {:.1} ms, save call to commit {:.1} ms",
                s.save_call_s * 1e3,
                s.async_total_s * 1e3
            );
            let key = |k: &str| format!("{prefix}{k}");
            kv(&key("async_step_ms"), format!("{:.1}", s.inflight_step_s * 1e3));
            kv(&key("async_step_ratio"), format!("{ratio:.3}"));
            kv(&key("async_compute_ratio"), format!("{compute_ratio:.3}"));
            kv(&key("commit_poll_ms"), format!("{:.1}", s.commit_poll_s * 1e3));
            kv(&key("steps_per_save"), format!("{:.1}", s.steps_per_save));
            kv(
                &key("save_cpu_extra_ms"),
                format!("{:.0}", (s.cpu_extra_per_save.0 + s.cpu_extra_per_save.1) * 1e3),
            );
            kv(&key("async_call_ms"), format!("{:.1}", s.save_call_s * 1e3));
            kv(&key("async_total_ms"), format!("{:.1}", s.async_total_s * 1e3));
        }
        println!(
            "  synchronous save of the same state: {:.1} ms = {:.2} steps",
            pb.sync_save_s * 1e3,
            pb.sync_save_s / pb.plain_step_s
        );
        kv("sync_save_ms", format!("{:.1}", pb.sync_save_s * 1e3));
        kv("keep", a.keep.map_or("all".to_string(), |k| k.to_string()));
        if let Some(n) = a.writer_nice {
            kv("writer_nice", n.to_string());
        }
    }
    kv("load_avg_start", format!("{load0:.2}"));
    kv("load_avg_end", format!("{:.2}", loadavg()));
    kv("total_s", format!("{:.1}", t_all.elapsed().as_secs_f64()));
    let line: Vec<String> = summary.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("summary: {}", line.join(" "));
    Ok(())
}
