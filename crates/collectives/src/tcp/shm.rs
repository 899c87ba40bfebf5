//! Shared memory between two processes of one host: a ring of fixed-size slots per
//! directed pair of processes, which carries large payloads instead of the socket.
//!
//! # The ring
//!
//! The sender creates a file under `/dev/shm` (named after its process id, the job token
//! and both ranks), reserves its pages (so that a tmpfs too small fails here, not later
//! with a bus error), maps it, and offers its name and a random nonce to the receiver
//! over their socket. The receiver opens it, checks the header (magic, nonce, geometry),
//! maps it and unlinks the name; the sender unlinks it too once the receiver has
//! answered, whatever the answer. From then on only the two mappings hold the memory,
//! which the kernel frees when both processes have exited, however they exit. (A process
//! killed in the instant between creating its file and sending the offer leaves the file
//! behind: nobody else knows its name yet.)
//!
//! The file is a 4 KiB header, 2 KiB of padding (see `SLOTS_AT`), then `slots` slots of
//! `slot_bytes` bytes. The header holds two counts of chunks, each on its own
//! cache line: `produced`, written by the sender after it has filled a slot, and
//! `consumed`, written by the receiver after it has copied a slot out. Chunk `k` of the pair's stream lives in slot `k % slots`; the
//! sender fills a slot only while fewer than `slots` chunks are unconsumed, so a slot is
//! only ever touched by one side at a time.
//!
//! # Waiting
//!
//! Nobody spins. The receiver learns of each chunk from a notice on the socket (its
//! reader thread blocks there, as for any frame, and so notices a closed connection at
//! once). A sender that finds the ring full sleeps on `consumed` with a futex, which the
//! receiver wakes after each chunk it frees; the sender's own reader thread also wakes it
//! when the peer's connection ends.
//!
//! Linux only (`/dev/shm`, futexes); elsewhere [`Ring::create`] fails and every pair
//! keeps to its socket.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{TCP_SHM_ENV, TCP_SHM_MIN_ENV};

/// Where ring files are created.
const SHM_DIR: &str = "/dev/shm";
/// Every ring file's name starts with this.
pub(crate) const FILE_PREFIX: &str = "tpar-tcp-";
/// Opens a ring's header (`"tparSHM1"`).
const RING_MAGIC: u64 = u64::from_le_bytes(*b"tparSHM1");
/// Bytes of a ring's header.
const HEADER: usize = 4096;
/// Where the slots start: half a page past the header. Receive buffers are mostly large
/// allocations, which start 16 bytes past a page; copying into them from a page-aligned
/// slot puts the destination a few bytes ahead of the source modulo 4 KiB, where loads
/// wait on the stores they seem to alias and a copy runs 10-15x slower (measured on the
/// development machine: 2-3 GB/s against 25-33). From half a page, those copies, and
/// those into slots from such buffers, run at full speed.
const SLOTS_AT: usize = HEADER + 2048;
/// Offsets of the header's fields.
const AT_MAGIC: usize = 0;
const AT_NONCE: usize = 8;
const AT_SLOTS: usize = 16;
const AT_SLOT_BYTES: usize = 24;
/// The counters, each on its own cache line, and the flag of a sender asleep on a full
/// ring.
const AT_PRODUCED: usize = 64;
const AT_CONSUMED: usize = 128;
const AT_WAITING: usize = 192;
/// The largest slot and slot count a receiver accepts from a header.
const MAX_SLOT_BYTES: usize = 64 << 20;
const MAX_SLOTS: u32 = 1024;

/// Payloads of at least this many bytes go through a pair's ring, smaller ones through
/// its socket (measured: see docs/PERF.md).
pub(crate) const DEFAULT_MIN_BYTES: usize = 64 << 10;
/// Slots per ring.
pub(crate) const DEFAULT_SLOTS: u32 = 8;
/// Bytes per slot: a payload is streamed through the ring in chunks of this size.
pub(crate) const DEFAULT_SLOT_BYTES: usize = 256 << 10;

/// Whether and how a process moves large payloads to peers on its host through shared
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShmConfig {
    /// Offer rings to peers on this host and accept theirs.
    pub enabled: bool,
    /// Payloads of at least this many bytes (and not empty) go through a ring.
    pub min_bytes: usize,
    /// Slots of the rings this process creates.
    pub slots: u32,
    /// Bytes per slot of the rings this process creates.
    pub slot_bytes: usize,
}

impl Default for ShmConfig {
    fn default() -> ShmConfig {
        ShmConfig {
            enabled: true,
            min_bytes: DEFAULT_MIN_BYTES,
            slots: DEFAULT_SLOTS,
            slot_bytes: DEFAULT_SLOT_BYTES,
        }
    }
}

impl ShmConfig {
    /// The defaults, with [`TCP_SHM_ENV`] (`0`, `off`, `false` or `no` turn shared memory
    /// off; `1`, `on`, `true`, `yes` or empty leave it on) and [`TCP_SHM_MIN_ENV`] (a byte
    /// count) applied. Another value is reported on stderr and the default kept.
    pub fn from_env() -> ShmConfig {
        let mut c = ShmConfig::default();
        if let Ok(raw) = std::env::var(TCP_SHM_ENV) {
            match raw.trim().to_ascii_lowercase().as_str() {
                "0" | "off" | "false" | "no" => c.enabled = false,
                "" | "1" | "on" | "true" | "yes" => {}
                _ => eprintln!("tpar: {TCP_SHM_ENV}={raw:?} is neither on nor off; leaving it on"),
            }
        }
        if let Ok(raw) = std::env::var(TCP_SHM_MIN_ENV) {
            match raw.trim().parse() {
                Ok(m) => c.min_bytes = m,
                Err(_) => eprintln!(
                    "tpar: {TCP_SHM_MIN_ENV}={raw:?} is not a number of bytes; using {}",
                    c.min_bytes
                ),
            }
        }
        c
    }
}

/// What this process tells its peers about its host in the store: the kernel's boot id,
/// which processes share exactly when they run on one kernel (containers of one host
/// included; whether they also share `/dev/shm` is checked by opening the ring). Empty
/// when unknown.
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The name of the ring file from global rank `from` to `to` of the job with `token`,
/// created by process `pid`.
pub(crate) fn file_name(pid: u32, token: u64, from: usize, to: usize) -> String {
    format!("{FILE_PREFIX}{pid}-{token:016x}-{from}-{to}")
}

/// The path of ring file `name`, or `None` when the name is not one of ours (a peer may
/// only make this process open ring files in [`SHM_DIR`]).
pub(crate) fn file_path(name: &str) -> Option<PathBuf> {
    let ok = name.starts_with(FILE_PREFIX)
        && name.len() <= 100
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    ok.then(|| Path::new(SHM_DIR).join(name))
}

/// Removes a ring file's name when dropped (the mappings keep the memory).
pub(crate) struct Unlink(pub PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One mapped ring, on either side.
pub(crate) struct Ring {
    base: NonNull<u8>,
    len: usize,
    slots: u32,
    slot_bytes: usize,
}

// SAFETY: `Ring` owns its mapping, valid until it is dropped; every access goes through
// atomics (the counters) or raw-pointer copies of a slot that the protocol gives to one
// side at a time, never through references, so sharing it between threads is sound.
unsafe impl Send for Ring {}
// SAFETY: as for `Send`: no method hands out references into the mapping.
unsafe impl Sync for Ring {}

impl Ring {
    /// Creates the ring file `path` (which must not exist), reserves and maps it, and
    /// writes its header. On error nothing is left behind.
    pub fn create(path: &Path, nonce: u64, slots: u32, slot_bytes: usize) -> io::Result<Ring> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidInput, why.to_string());
        if slots == 0 || slots > MAX_SLOTS || slot_bytes == 0 || slot_bytes > MAX_SLOT_BYTES {
            return Err(bad("ring geometry out of range"));
        }
        let len = (slots as usize)
            .checked_mul(slot_bytes)
            .and_then(|d| d.checked_add(SLOTS_AT))
            .ok_or_else(|| bad("ring too large"))?;
        let file = create_file(path)?;
        let ring = match sys::reserve(&file, len)
            .and_then(|()| Ring::map(&file, len, slots, slot_bytes))
            .map(|r| r.noted(path))
        {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        ring.write_u64(AT_NONCE, nonce);
        ring.write_u64(AT_SLOTS, u64::from(slots));
        ring.write_u64(AT_SLOT_BYTES, slot_bytes as u64);
        ring.write_u64(AT_MAGIC, RING_MAGIC);
        Ok(ring)
    }

    /// Opens and maps the ring file `path` created by a peer, checking that its header
    /// holds `nonce` and a sane geometry that fills the file.
    pub fn open(path: &Path, nonce: u64) -> io::Result<Ring> {
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = usize::try_from(file.metadata()?.len()).map_err(|_| bad("too large".into()))?;
        if len < HEADER {
            return Err(bad(format!("{len} bytes, shorter than a ring's header")));
        }
        // Map the header alone first, so that a wrong file is never mapped whole.
        let head = Ring::map(&file, HEADER, 0, 0)?;
        let (magic, got_nonce) = (head.read_u64(AT_MAGIC), head.read_u64(AT_NONCE));
        let (slots, slot_bytes) = (head.read_u64(AT_SLOTS), head.read_u64(AT_SLOT_BYTES));
        drop(head);
        if magic != RING_MAGIC || got_nonce != nonce {
            return Err(bad("not the ring that was offered".into()));
        }
        let geometry = u32::try_from(slots)
            .ok()
            .filter(|s| (1..=MAX_SLOTS).contains(s))
            .zip(usize::try_from(slot_bytes).ok().filter(|b| (1..=MAX_SLOT_BYTES).contains(b)));
        let Some((slots, slot_bytes)) = geometry else {
            return Err(bad(format!("ring geometry {slots} x {slot_bytes} out of range")));
        };
        if SLOTS_AT + slots as usize * slot_bytes != len {
            return Err(bad(format!("{slots} slots of {slot_bytes} bytes do not fill {len}")));
        }
        Ring::map(&file, len, slots, slot_bytes).map(|r| r.noted(path))
    }

    fn map(file: &File, len: usize, slots: u32, slot_bytes: usize) -> io::Result<Ring> {
        let base = sys::map(file, len)?;
        Ok(Ring { base, len, slots, slot_bytes })
    }

    /// Records the ring among [`MAPPED`] (tests count them); does nothing otherwise.
    fn noted(self, _path: &Path) -> Ring {
        #[cfg(test)]
        {
            let name = _path.file_name().map(|n| n.to_string_lossy().into_owned());
            let mut m = MAPPED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            m.push((self.base.as_ptr() as usize, name.unwrap_or_default()));
        }
        self
    }

    /// Slots in the ring.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn write_u64(&self, at: usize, v: u64) {
        debug_assert!(at + 8 <= HEADER);
        // SAFETY: `at + 8` lies inside the header of a live mapping of at least HEADER
        // bytes; unaligned writes are allowed.
        unsafe { self.base.as_ptr().add(at).cast::<u64>().write_unaligned(v.to_le()) }
    }

    fn read_u64(&self, at: usize) -> u64 {
        debug_assert!(at + 8 <= HEADER);
        // SAFETY: as in `write_u64`.
        u64::from_le(unsafe { self.base.as_ptr().add(at).cast::<u64>().read_unaligned() })
    }

    fn counter(&self, at: usize) -> &AtomicU32 {
        // SAFETY: the counters lie in the header of a live page-aligned mapping (so they
        // are aligned), which outlives `&self`; both processes only touch them atomically.
        unsafe { AtomicU32::from_ptr(self.base.as_ptr().add(at).cast::<u32>()) }
    }

    /// Chunks the receiver has copied out (wrapping).
    pub fn consumed(&self) -> u32 {
        self.counter(AT_CONSUMED).load(Ordering::Acquire)
    }

    /// Chunks the sender has filled (wrapping).
    pub fn produced(&self) -> u32 {
        self.counter(AT_PRODUCED).load(Ordering::Acquire)
    }

    /// Sender: publishes that `produced` chunks are filled.
    pub fn set_produced(&self, produced: u32) {
        self.counter(AT_PRODUCED).store(produced, Ordering::Release);
    }

    /// Receiver: frees every chunk before `consumed` and wakes the sender if it sleeps.
    pub fn set_consumed(&self, consumed: u32) {
        // Sequentially consistent with the sender's flag and check in `wait_consumed`:
        // either the sender sees the new count, or this sees the flag and wakes it.
        self.counter(AT_CONSUMED).store(consumed, Ordering::SeqCst);
        if self.counter(AT_WAITING).load(Ordering::SeqCst) != 0 {
            self.wake();
        }
    }

    /// Sender: sleeps until `consumed` differs from `seen`, a wake-up, or `timeout`; may
    /// return early.
    pub fn wait_consumed(&self, seen: u32, timeout: Duration) {
        let (waiting, consumed) = (self.counter(AT_WAITING), self.counter(AT_CONSUMED));
        waiting.store(1, Ordering::SeqCst);
        if consumed.load(Ordering::SeqCst) == seen {
            sys::futex_wait(consumed, seen, timeout);
        }
        waiting.store(0, Ordering::SeqCst);
    }

    /// Wakes a sender sleeping in [`wait_consumed`](Self::wait_consumed).
    pub fn wake(&self) {
        sys::futex_wake(self.counter(AT_CONSUMED));
    }

    /// The start of slot `k % slots` and its capacity.
    fn slot(&self, k: u32) -> *mut u8 {
        let i = (k % self.slots.max(1)) as usize;
        // SAFETY: slot `i < slots` lies inside the mapping (checked at create/open).
        unsafe { self.base.as_ptr().add(SLOTS_AT + i * self.slot_bytes) }
    }

    /// Sender: copies `chunk` (at most a slot) into the slot of chunk `k`, which the
    /// receiver has freed.
    pub fn fill(&self, k: u32, chunk: &[u8]) {
        let n = chunk.len().min(self.slot_bytes);
        // SAFETY: the slot holds `slot_bytes >= n` bytes of the live mapping; `chunk` is
        // ordinary memory, so the ranges do not overlap; the protocol leaves the slot to
        // the sender until it is announced.
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.slot(k), n) }
    }

    /// Receiver: appends the first `n` bytes (at most a slot) of the slot of chunk `k`,
    /// which the sender has filled, to `dst`, whose spare capacity must hold them.
    pub fn drain(&self, k: u32, n: usize, dst: &mut Vec<u8>) {
        let n = n.min(self.slot_bytes).min(dst.capacity() - dst.len());
        // SAFETY: the slot holds at least `n` bytes of the live mapping and `dst` has `n`
        // bytes of spare capacity past its length (ordinary memory: no overlap); after
        // the copy those bytes are initialized, so the length may grow by `n`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.slot(k), dst.as_mut_ptr().add(dst.len()), n);
            dst.set_len(dst.len() + n);
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        #[cfg(test)]
        {
            let mut m = MAPPED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            m.retain(|(base, _)| *base != self.base.as_ptr() as usize);
        }
        sys::unmap(self.base, self.len);
    }
}

/// The rings this process has mapped: base address and file name.
#[cfg(test)]
pub(crate) static MAPPED: std::sync::Mutex<Vec<(usize, String)>> =
    std::sync::Mutex::new(Vec::new());

fn create_file(path: &Path) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    o.open(path)
}

#[cfg(target_os = "linux")]
mod sys {
    //! mmap, fallocate and futexes.

    use std::fs::File;
    use std::io;
    use std::os::fd::AsRawFd;
    use std::ptr::NonNull;
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    /// Allocates the file's first `len` bytes now.
    pub fn reserve(file: &File, len: usize) -> io::Result<()> {
        let len = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "ring too large"))?;
        // SAFETY: a plain system call on an open descriptor.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(rc))
        }
    }

    /// Maps the file's first `len` bytes, shared, readable and writable.
    pub fn map(file: &File, len: usize) -> io::Result<NonNull<u8>> {
        // SAFETY: a fresh shared mapping of an open descriptor; no existing memory is
        // affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
    }

    pub fn unmap(base: NonNull<u8>, len: usize) {
        // SAFETY: `base..base + len` is a mapping made by `map` that nothing uses anymore.
        unsafe { libc::munmap(base.as_ptr().cast(), len) };
    }

    /// Sleeps while `word` holds `seen`, at most `timeout` (or until woken).
    pub fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            // Below 10^9: fits a c_long of any width.
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a live, aligned 32-bit atomic in a shared mapping (hence a
        // shared, not private, futex); `ts` outlives the call. Every outcome (woken,
        // value changed, timed out, interrupted) is fine for the caller, which re-checks.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Wakes every sleeper on `word`.
    pub fn futex_wake(word: &AtomicU32) {
        // SAFETY: as in `futex_wait`; waking has no memory effects.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    //! No shared memory here: rings cannot be made, so nothing else is ever called.

    use std::fs::File;
    use std::io;
    use std::ptr::NonNull;
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    fn unsupported() -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, "shared memory rings need Linux")
    }

    pub fn reserve(_: &File, _: usize) -> io::Result<()> {
        Err(unsupported())
    }

    pub fn map(_: &File, _: usize) -> io::Result<NonNull<u8>> {
        Err(unsupported())
    }

    pub fn unmap(_: NonNull<u8>, _: usize) {}

    pub fn futex_wait(_: &AtomicU32, _: u32, timeout: Duration) {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
    }

    pub fn futex_wake(_: &AtomicU32) {}
}
