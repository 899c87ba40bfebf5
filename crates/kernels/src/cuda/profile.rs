//! GPU time per kernel, for finding where a step's device time goes.
//!
//! With `TPAR_CUDA_PROFILE=1` in the environment, every kernel launch and
//! device copy of a [`super::device::CudaDevice`] is bracketed by two CUDA
//! events on its stream. The events are read back in batches (which waits for
//! the work between them, so a profiled run is slower). Each figure is the
//! time between a launch's two events on the GPU: the kernel's own time, plus
//! any wait for the host to queue it when the stream had run dry. [`report`]
//! sums them by kernel name, as in three steps of `llama_2d` on an H200:
//!
//! ```text
//! GPU time by kernel (TPAR_CUDA_PROFILE): 4728 launches, 153.3 ms in all
//!   kernel                                         calls   total ms   mean us  share
//!   tpar_gemm_nn_128x128_bf16                        168      20.20     120.2  13.2%
//! ```
//!
//! Without the variable nothing is recorded and nothing costs.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

/// Pairs read back at once; bounds the events alive.
const BATCH: usize = 2048;

#[derive(Default)]
struct Profile {
    pending: Vec<(String, CudaEvent, CudaEvent)>,
    totals: HashMap<String, (u64, f64)>,
    /// Whether some totals are the emulator's host time ([`emulated`]), not GPU time.
    emulated: bool,
}

impl Profile {
    /// Reads the pending pairs' times into the totals (waiting for their work).
    fn drain(&mut self) {
        for (name, start, end) in self.pending.drain(..) {
            let ms = start.elapsed_ms(&end).map_or(0.0, f64::from);
            let t = self.totals.entry(name).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += ms;
        }
    }
}

fn profile() -> Option<&'static Mutex<Profile>> {
    static P: OnceLock<Option<Mutex<Profile>>> = OnceLock::new();
    P.get_or_init(|| {
        std::env::var_os("TPAR_CUDA_PROFILE")
            .is_some_and(|v| v == "1")
            .then(|| Mutex::new(Profile::default()))
    })
    .as_ref()
}

/// Runs `f` (which queues work on `stream`) between two events named `name`
/// when profiling; just runs it otherwise. Profiling never fails the work: an
/// event that cannot be made or recorded leaves that launch unmeasured.
pub(crate) fn timed<T>(
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    name: impl FnOnce() -> String,
    f: impl FnOnce() -> T,
) -> T {
    let Some(p) = profile() else {
        return f();
    };
    let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok();
    let start = event().filter(|e| e.record(stream).is_ok());
    let out = f();
    if let (Some(start), Some(end)) = (start, event()) {
        if end.record(stream).is_ok() {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            p.pending.push((name(), start, end));
            if p.pending.len() >= BATCH {
                p.drain();
            }
        }
    }
    out
}

/// Runs `f` (a launch the CPU emulator runs on the calling thread) and, when
/// profiling, adds it to `name`'s calls with the host time it took: on the emulator
/// the census of a step's kernels (which ones, how often) is what the table means;
/// its times are the emulator's, not a GPU's, and [`report`] says so.
pub(crate) fn emulated<T>(name: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
    let Some(p) = profile() else {
        return f();
    };
    let t = std::time::Instant::now();
    let out = f();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
    p.emulated = true;
    let e = p.totals.entry(name()).or_insert((0, 0.0));
    e.0 += 1;
    e.1 += ms;
    out
}

/// The GPU time per kernel name since the start, largest first, as a table (on the
/// CPU emulator, the launches per kernel and the emulator's host time); `None`
/// without `TPAR_CUDA_PROFILE=1`. Waits for the profiled work still queued.
pub fn report() -> Option<String> {
    let mut p = profile()?.lock().unwrap_or_else(|e| e.into_inner());
    p.drain();
    let mut rows: Vec<(&String, &(u64, f64))> = p.totals.iter().collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1).then(a.0.cmp(b.0)));
    let calls: u64 = rows.iter().map(|r| r.1 .0).sum();
    let total: f64 = rows.iter().map(|r| r.1 .1).sum();
    let what = if p.emulated { "CPU emulator time" } else { "GPU time" };
    let mut s = format!(
        "{what} by kernel (TPAR_CUDA_PROFILE): {calls} launches, {total:.1} ms in all\n  \
         {:<44} {:>7} {:>10} {:>9} {:>6}\n",
        "kernel", "calls", "total ms", "mean us", "share"
    );
    for (name, &(n, ms)) in rows {
        let _ = writeln!(
            s,
            "  {name:<44} {n:>7} {ms:>10.2} {:>9.1} {:>5.1}%",
            ms * 1e3 / n.max(1) as f64,
            if total > 0.0 { 100.0 * ms / total } else { 0.0 }
        );
    }
    Some(s)
}
