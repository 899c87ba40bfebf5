//! Per-rank memory accounting at the allocator, for peak-memory figures that are
//! measured rather than computed from a formula.
//!
//! Install [`TrackingAllocator`] as the binary's global allocator; every thread that
//! runs a rank calls [`set_rank`] (the collectives layer's `spawn` does it). Each
//! allocation records the rank of the thread that made it in a small header, so a block
//! freed on another thread is still credited back to its owner. Allocations of threads
//! with no rank (rayon workers' scratch) are counted under [`UNATTRIBUTED`].
//!
//! [`cache`] keeps large host buffers of dropped tensors for reuse; what it keeps counts
//! for no rank.
//!
//! The tensor crate re-exports this crate as `tpar_tensor::memory` (and the facade as
//! `tpar::tensor::memory`).
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOC: tpar_memory::TrackingAllocator = tpar_memory::TrackingAllocator;
//! ```
#![warn(missing_docs)]

pub mod cache;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// Ranks tracked separately (higher ranks share the last slot).
pub const MAX_RANKS: usize = 64;
/// The slot of allocations made by threads with no rank.
pub const UNATTRIBUTED: usize = MAX_RANKS;

/// The slot of buffers kept by [`cache`]: counted for no rank.
const CACHED: usize = MAX_RANKS + 1;
const SLOTS: usize = MAX_RANKS + 2;
const HEADER: usize = 16;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicI64 = AtomicI64::new(0);
static CURRENT: [AtomicI64; SLOTS] = [ZERO; SLOTS];
static PEAK: [AtomicI64; SLOTS] = [ZERO; SLOTS];
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static RANK: Cell<usize> = const { Cell::new(UNATTRIBUTED) };
}

/// Credits this thread's future allocations to `rank` (`None`: unattributed).
pub fn set_rank(rank: Option<usize>) {
    let slot = rank.map(|r| r.min(MAX_RANKS - 1)).unwrap_or(UNATTRIBUTED);
    // `try_with`: a thread being torn down has no thread-locals left.
    let _ = RANK.try_with(|c| c.set(slot));
}

/// The rank this thread's allocations are credited to ([`set_rank`]; `None`:
/// unattributed; ranks past [`MAX_RANKS`]` - 1` read as the last slot they share). A thread that works for a rank, such as a collective's helper
/// thread, passes it on with `set_rank(rank())` taken on the rank's thread.
pub fn rank() -> Option<usize> {
    RANK.try_with(|c| c.get()).ok().filter(|&s| s < MAX_RANKS)
}

/// Whether [`TrackingAllocator`] is the global allocator (figures are 0 otherwise).
pub fn is_tracking() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Bytes currently allocated by `rank`.
pub fn current(rank: usize) -> i64 {
    CURRENT[rank.min(UNATTRIBUTED)].load(Ordering::Relaxed)
}

/// Highest [`current`] of `rank` since the last [`reset_peak`].
pub fn peak(rank: usize) -> i64 {
    PEAK[rank.min(UNATTRIBUTED)].load(Ordering::Relaxed)
}

/// Restarts the peak of `rank` from its current usage.
pub fn reset_peak(rank: usize) {
    let r = rank.min(UNATTRIBUTED);
    PEAK[r].store(CURRENT[r].load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Moves the `bytes` of the live heap block at `ptr` from its owner's slot to slot `to`,
/// which its free will then credit. A no-op unless [`TrackingAllocator`] is the global
/// allocator.
fn move_block(ptr: *mut u8, bytes: usize, to: usize) {
    if is_tracking() {
        // SAFETY: with the tracking allocator installed every heap block came from it,
        // so the owner slot is the 8-byte word right before `ptr` (see `alloc`).
        unsafe {
            let header = ptr.sub(8) as *mut usize;
            credit(header.read().min(CACHED), -(bytes as i64));
            header.write(to);
            credit(to, bytes as i64);
        }
    }
}

/// Moves a block given to [`cache`] to the cache's slot (counted for no rank).
fn cache_block(ptr: *mut u8, bytes: usize) {
    move_block(ptr, bytes, CACHED);
}

/// Moves a block taken from [`cache`] to the calling thread's slot.
fn uncache(ptr: *mut u8, bytes: usize) {
    move_block(ptr, bytes, slot());
}

/// A global allocator that counts live bytes per rank (see the module docs).
pub struct TrackingAllocator;

fn slot() -> usize {
    RANK.try_with(|c| c.get()).unwrap_or(UNATTRIBUTED)
}

fn credit(slot: usize, bytes: i64) {
    let now = CURRENT[slot].fetch_add(bytes, Ordering::Relaxed) + bytes;
    if bytes > 0 {
        PEAK[slot].fetch_max(now, Ordering::Relaxed);
    }
}

/// The layout with room for the header in front, keeping the caller's alignment.
fn with_header(layout: Layout) -> Option<(Layout, usize)> {
    let offset = HEADER.max(layout.align());
    let size = layout.size().checked_add(offset)?;
    Layout::from_size_align(size, layout.align().max(HEADER)).ok().map(|l| (l, offset))
}

// SAFETY: every block handed out is `offset` bytes into a System allocation of the
// enlarged layout; the owner slot is written in the 8 bytes right before the block and
// read back on dealloc/realloc with the same layout arithmetic, so System gets back
// exactly the pointer and layout it returned.
unsafe impl GlobalAlloc for TrackingAllocator {
    /// # Safety
    /// As [`GlobalAlloc::alloc`]: `layout` has a non-zero size.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // Read first: a store on every allocation would bounce the cache line between threads.
        if !INSTALLED.load(Ordering::Relaxed) {
            INSTALLED.store(true, Ordering::Relaxed);
        }
        let Some((full, offset)) = with_header(layout) else { return std::ptr::null_mut() };
        // SAFETY: `full` has a non-zero size (offset >= 16).
        let base = unsafe { System.alloc(full) };
        if base.is_null() {
            return base;
        }
        let s = slot();
        // SAFETY: `base + offset` is inside the block (offset < full.size()) and the
        // header word at `base + offset - 8` is inside it too and 8-byte aligned
        // (offset is a multiple of 16 and base is at least 16-aligned).
        unsafe {
            let p = base.add(offset);
            (p.sub(8) as *mut usize).write(s);
            credit(s, layout.size() as i64);
            p
        }
    }

    /// # Safety
    /// As [`GlobalAlloc::dealloc`]: `ptr` came from this allocator with `layout`.
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some((full, offset)) = with_header(layout) else { return };
        // SAFETY: `ptr` came from `alloc` with this layout, so the header is 8 bytes
        // before it and the System block starts `offset` bytes before it.
        unsafe {
            let s = (ptr.sub(8) as *const usize).read();
            credit(s.min(CACHED), -(layout.size() as i64));
            System.dealloc(ptr.sub(offset), full);
        }
    }
}
