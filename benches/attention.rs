//! Attention forward + backward with a key-padding mask at long sequences: time and
//! peak memory of `Tensor::scaled_dot_product_attention` (batch 1, 4 heads of 64, f32,
//! the last quarter of the positions padding). Two forms:
//! - `causal`: causal attention that also skips padded keys (what the Llama runs): a
//!   `[1, 1, 1, s]` key mask and the causal flag;
//! - `keys`: the key mask alone (not causal), the form PyTorch can run flash-style too.
//!
//! `benches/attention_torch.py` times PyTorch's `F.scaled_dot_product_attention` on the
//! same shapes (its causal form takes the `[1, 1, s, s]` mask PyTorch needs there).
//! Run: `cargo bench --bench attention [-- 1024 4096 8192 16384]`.

use std::time::Instant;

use tpar::prelude::*;
use tpar::tensor::memory;

#[global_allocator]
static ALLOC: memory::TrackingAllocator = memory::TrackingAllocator;

const MIB: f64 = (1 << 20) as f64;

/// This process's resident and peak-resident bytes (Linux; 0 elsewhere).
fn rss() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .map_or(0.0, |kb| kb * 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Restarts the peak-resident figure from the current one (Linux).
fn reset_rss_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn main() -> tpar::Result<()> {
    // Fix glibc's mmap threshold and turn tpar's host cache off, so freed large buffers
    // leave the resident set (the RSS column then measures each step alone, as the
    // PyTorch script does): re-run self.
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        let status = std::env::current_exe().and_then(|exe| {
            std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .env("MALLOC_MMAP_THRESHOLD_", "131072")
                .env("TPAR_HOST_CACHE_MIB", "0")
                .status()
        });
        std::process::exit(status.map_or(1, |s| s.code().unwrap_or(1)));
    }
    let mut seqs: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    if seqs.is_empty() {
        seqs = vec![1024, 4096, 8192, 16384];
    }
    let (b, h, d) = (1, 4, 64);
    println!("| seq | form | fwd+bwd s | heap peak MiB | RSS peak MiB |");
    println!("|---:|---|---:|---:|---:|");
    for &s in &seqs {
        let mut rng = Rng::new(s as u64);
        let mk = |rng: &mut Rng| -> tpar::Result<Tensor> {
            Ok(Tensor::randn([b, h, s, d], DType::F32, rng)?.requires_grad_(true))
        };
        let (q, k, v) = (mk(&mut rng)?, mk(&mut rng)?, mk(&mut rng)?);
        let tokens = s - s / 4;
        let pad: Vec<i64> = (0..s).map(|j| (j < tokens) as i64).collect();
        let pad = Tensor::from_vec(pad, [b, s])?;
        for (form, causal) in [("causal", true), ("keys", false)] {
            let step = || -> tpar::Result<()> {
                let mask = tpar::models::key_padding_mask(&pad, b, s, DType::F32)?;
                let y =
                    Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), causal, None)?;
                y.sum_all()?.backward()?;
                for t in [&q, &k, &v] {
                    t.zero_grad();
                }
                Ok(())
            };
            // Long sequences take seconds per step: one timed run, no warm-up.
            let reps = if s >= 8192 { 1 } else { 3 };
            if reps > 1 {
                step()?;
            }
            let mut times = Vec::new();
            let (mut heap, mut resident) = (0.0f64, 0.0f64);
            for _ in 0..reps {
                let heap0 = memory::current(memory::UNATTRIBUTED) as f64;
                memory::reset_peak(memory::UNATTRIBUTED);
                reset_rss_peak();
                let rss0 = rss().0;
                let t = Instant::now();
                step()?;
                times.push(t.elapsed().as_secs_f64());
                heap = heap.max(memory::peak(memory::UNATTRIBUTED) as f64 - heap0);
                resident = resident.max(rss().1 - rss0);
            }
            times.sort_by(f64::total_cmp);
            println!(
                "| {s} | {form} | {:.3} | {:.1} | {:.1} |",
                times[times.len() / 2],
                heap / MIB,
                resident / MIB
            );
        }
    }
    Ok(())
}
