//! The report of the mbarrier watchdog (`tpar.cuh`, `tpar_mbar_abort`): where
//! a Hopper kernel's wait timed out, read back after the launch failed.
//!
//! A wait that outlasts `TPAR_MBAR_TIMEOUT_MS` stops its kernel, which loses
//! the CUDA context ([`KernelError::ContextLost`](crate::KernelError::ContextLost)).
//! Before it stops, the first such thread of a module writes a record into
//! page-locked host memory the device can reach: the source line of the
//! `mbarrier_wait_parity` call, the barrier's shared-memory address, its
//! 64-bit word and the parity waited for, the block, the thread, its cluster
//! rank and SM, and the timeout. Each loaded module gets a record of its own
//! ([`attach`]: its `tpar_watchdog_report` global is set to the record's
//! device address); a lost context's error then carries every written record
//! ([`with_report`]), read from host memory, which outlives the context.
//!
//! Best effort: a device where the mapped memory cannot be had, a module
//! loaded while its stream captures a CUDA graph, a module whose global the
//! driver does not find (NVRTC emits it as a local symbol of the cubin), or
//! more modules than records, report nothing more than before. Not run on a
//! GPU yet. The records' memory (4 KiB per
//! device) is kept for the process's life.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self as dsys, CUresult, CUstreamCaptureStatus};
use cudarc::driver::{CudaContext, CudaModule, CudaStream, DevicePtr};

use super::modules::lock;

/// Words of one record (`TPAR_WATCHDOG_WORDS` in tpar.cuh).
const WORDS: usize = 16;
/// Records per device: one per loaded module.
const RECORDS: usize = 64;
/// The record's words (`TPAR_WATCHDOG_*` in tpar.cuh).
const MAGIC: usize = 0;
const LINE: usize = 1;
const BARRIER: usize = 2;
const PARITY: usize = 3;
const BLOCK: usize = 4;
const THREAD: usize = 7;
const SM: usize = 10;
const RANK: usize = 11;
const STATE: usize = 12;
const TIMEOUT: usize = 14;
/// The magic word's value once the rest of the record is written
/// (`TPAR_WATCHDOG_WRITTEN`).
const WRITTEN: u32 = 0x7470_6172;
/// The module global that holds the record's device address.
const GLOBAL: &str = "tpar_watchdog_report";

/// One device's records: `RECORDS` records of `WORDS` u32 words at `host`
/// (the device sees them at `dev`), the first `sources.len()` given to the
/// modules loaded so far, in order.
struct Records {
    /// Host address of the records (mapped, page-locked), or of test memory.
    host: usize,
    dev: u64,
    sources: Vec<String>,
}

/// Every device's records (`None` where the memory could not be had).
static RECORDS_OF: Mutex<Vec<(usize, Option<Records>)>> = Mutex::new(Vec::new());

/// Gives `module` (of source `source`, on device `ordinal`) a record: stores
/// the record's device address in the module's `tpar_watchdog_report`.
/// Silently does nothing where that cannot be done (see the module docs).
pub(super) fn attach(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    ordinal: usize,
    module: &Arc<CudaModule>,
    source: &str,
) {
    if capturing(stream) || ctx.bind_to_thread().is_err() {
        return;
    }
    let mut all = lock(&RECORDS_OF);
    let at = match all.iter().position(|(o, _)| *o == ordinal) {
        Some(i) => i,
        None => {
            all.push((ordinal, map_records()));
            all.len() - 1
        }
    };
    let Some(recs) = all[at].1.as_mut() else { return };
    if recs.sources.len() >= RECORDS {
        return;
    }
    let Ok(global) = module.get_global(GLOBAL, stream) else { return };
    if global.len() != 8 {
        return;
    }
    let (global_ptr, _sync) = global.device_ptr(stream);
    let record = recs.dev + (recs.sources.len() * WORDS * 4) as u64;
    // SAFETY: `global_ptr` is the module's 8-byte global (its size checked
    // above); the source is a live local u64; the copy is synchronous.
    let r = unsafe {
        dsys::cuMemcpyHtoD_v2(global_ptr, &record as *const u64 as *const std::ffi::c_void, 8)
    };
    if r == CUresult::CUDA_SUCCESS {
        recs.sources.push(source.to_string());
    }
}

/// Whether `stream` is capturing a CUDA graph (a synchronous copy then would
/// break the capture).
fn capturing(stream: &CudaStream) -> bool {
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream handle; writes one status to a live local.
    let r = unsafe { dsys::cuStreamIsCapturing(stream.cu_stream(), &mut status) };
    r != CUresult::CUDA_SUCCESS || status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// Mapped, page-locked memory for the current context's device's records,
/// zeroed, or `None`.
fn map_records() -> Option<Records> {
    let bytes = RECORDS * WORDS * 4;
    let flags = dsys::CU_MEMHOSTALLOC_DEVICEMAP | dsys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: allocates `bytes` of host memory; nothing else is touched.
    let host = unsafe { cudarc::driver::result::malloc_host(bytes, flags) }.ok()?;
    // SAFETY: `host` holds `bytes` writable bytes.
    unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
    let mut dev = 0;
    // SAFETY: `host` was allocated with DEVICEMAP; writes one address to a
    // live local.
    let r = unsafe { dsys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) };
    if r != CUresult::CUDA_SUCCESS {
        return None;
    }
    Some(Records { host: host as usize, dev, sources: Vec::new() })
}

/// `what` (a lost context's driver error), followed by every record the
/// watchdog wrote, if any.
pub(super) fn with_report(what: String) -> String {
    let all = lock(&RECORDS_OF);
    let reports: Vec<String> = all
        .iter()
        .filter_map(|(ordinal, r)| r.as_ref().map(|r| r.written(*ordinal)))
        .flatten()
        .collect();
    if reports.is_empty() {
        what
    } else {
        format!("{what}; {}", reports.join("; "))
    }
}

impl Records {
    /// The written records of device `ordinal`, as sentences.
    fn written(&self, ordinal: usize) -> Vec<String> {
        self.sources
            .iter()
            .enumerate()
            .filter_map(|(i, source)| {
                let base = self.host as *const u32;
                // SAFETY: record `i` < RECORDS lies inside the `RECORDS *
                // WORDS` words at `host`, which live for the process; the
                // device may write them, so every read is volatile.
                let word = |w: usize| unsafe { base.add(i * WORDS + w).read_volatile() };
                (word(MAGIC) == WRITTEN).then(|| describe(ordinal, source, &word))
            })
            .collect()
    }
}

/// Record `word` (of a module of `source` on device `ordinal`) as a sentence.
fn describe(ordinal: usize, source: &str, word: &dyn Fn(usize) -> u32) -> String {
    let three = |at: usize| format!("({}, {}, {})", word(at), word(at + 1), word(at + 2));
    let state = (u64::from(word(STATE + 1)) << 32) | u64::from(word(STATE));
    format!(
        "the mbarrier watchdog stopped a kernel of {source}.cu on GPU {}: block {} thread {} \
         (cluster rank {}, SM {}) waited more than {} ms at {source}.cu:{} for the phase of \
         parity {} of the mbarrier at shared address {:#x} (its word then: {state:#018x})",
        ordinal,
        three(BLOCK),
        three(THREAD),
        word(RANK),
        word(SM),
        word(TIMEOUT),
        word(LINE),
        word(PARITY),
        word(BARRIER),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record's layout here is tpar.cuh's: every `TPAR_WATCHDOG_*` index,
    /// the word count and the magic value.
    #[test]
    fn the_layout_is_the_kernels() {
        let cuh = crate::cuda::PRELUDE;
        let value = |name: &str| -> u64 {
            let at =
                cuh.find(&format!("{name} = ")).unwrap_or_else(|| panic!("{name} in tpar.cuh"));
            let rest = &cuh[at + name.len() + 3..];
            let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap();
            rest[..end].parse().unwrap()
        };
        for (name, want) in [
            ("TPAR_WATCHDOG_MAGIC", MAGIC),
            ("TPAR_WATCHDOG_LINE", LINE),
            ("TPAR_WATCHDOG_BARRIER", BARRIER),
            ("TPAR_WATCHDOG_PARITY", PARITY),
            ("TPAR_WATCHDOG_BLOCK", BLOCK),
            ("TPAR_WATCHDOG_THREAD", THREAD),
            ("TPAR_WATCHDOG_SM", SM),
            ("TPAR_WATCHDOG_RANK", RANK),
            ("TPAR_WATCHDOG_STATE", STATE),
            ("TPAR_WATCHDOG_TIMEOUT", TIMEOUT),
            ("TPAR_WATCHDOG_WORDS", WORDS),
        ] {
            assert_eq!(value(name), want as u64, "{name}");
        }
        assert!(
            cuh.contains(&format!("#define TPAR_WATCHDOG_WRITTEN {WRITTEN:#010x}u")),
            "TPAR_WATCHDOG_WRITTEN differs from {WRITTEN:#010x}"
        );
        assert!(cuh.contains(&format!("__device__ u32* {GLOBAL} = nullptr;")), "{GLOBAL}");
    }

    /// A record as the kernel writes it becomes a sentence in the lost
    /// context's error; records without the magic word add nothing.
    #[test]
    fn a_written_record_is_reported() {
        let mut mem = vec![0u32; RECORDS * WORDS];
        let rec = &mut mem[WORDS..2 * WORDS];
        rec[LINE] = 376;
        rec[BARRIER] = 0x400;
        rec[PARITY] = 1;
        rec[BLOCK..BLOCK + 3].copy_from_slice(&[5, 0, 0]);
        rec[THREAD..THREAD + 3].copy_from_slice(&[130, 0, 0]);
        rec[SM] = 17;
        rec[RANK] = 1;
        rec[STATE] = 0xdead_beef;
        rec[STATE + 1] = 0x1;
        rec[TIMEOUT] = 10000;
        let ordinal = 1000;
        let recs = Records {
            host: mem.as_ptr() as usize,
            dev: 0,
            sources: vec!["sdpa_hopper".into(), "gemm_hopper".into()],
        };
        lock(&RECORDS_OF).push((ordinal, Some(recs)));
        let unwritten = with_report("launch failed".into());
        mem[WORDS + MAGIC] = WRITTEN;
        let written = with_report("launch failed".into());
        lock(&RECORDS_OF).retain(|(o, _)| *o != ordinal);
        assert_eq!(unwritten, "launch failed");
        assert_eq!(
            written,
            "launch failed; the mbarrier watchdog stopped a kernel of gemm_hopper.cu on GPU 1000: \
             block (5, 0, 0) thread (130, 0, 0) (cluster rank 1, SM 17) waited more than 10000 ms \
             at gemm_hopper.cu:376 for the phase of parity 1 of the mbarrier at shared address \
             0x400 (its word then: 0x00000001deadbeef)"
        );
    }
}
