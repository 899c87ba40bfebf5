//! Large host buffers kept for reuse: tensor storage of [`MIN_BYTES`] or more that is
//! dropped goes here instead of back to the allocator, and the next buffer of the same
//! element type and capacity is taken from here.
//!
//! A training step allocates the same large buffers every step (logits and their
//! gradient, activations, collective outputs). glibc returns blocks of 32 MiB and more
//! to the kernel on every free, and smaller ones whenever the top of its heap grows
//! past its trim threshold, so every step would fault their pages in again and the
//! kernel would zero them. Kept here, the pages stay mapped.
//!
//! What is kept is bounded: at most [`limit`] bytes (default 512 MiB; the environment
//! variable `TPAR_HOST_CACHE_MIB` sets it when the cache is first used, 0 turns the cache
//! off); past it the oldest buffers are freed. [`empty_cache`] frees everything, as
//! `torch.cuda.empty_cache()` does for PyTorch's CUDA caching allocator.
//!
//! With [`crate::TrackingAllocator`] installed, a kept buffer counts for no rank: a
//! rank's [`crate::current`] drops when its tensor is dropped, as without the cache, and
//! grows again when a buffer is taken, credited to the thread that takes it.
//!
//! ```
//! use tpar_memory::cache;
//! let n = cache::MIN_BYTES / 4;
//! let v: Vec<f32> = vec![1.0; n];
//! let ptr = v.as_ptr();
//! cache::give(v);
//! let again: Vec<f32> = cache::take(n).expect("kept");
//! assert_eq!((again.as_ptr(), again.len(), again.capacity()), (ptr, 0, n));
//! ```

use std::any::TypeId;
use std::collections::{HashMap, VecDeque};
use std::mem::{size_of, ManuallyDrop};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

/// Buffers smaller than this are left to the allocator, which reuses them well. From
/// 1 MiB the single-rank Llama step of `benches/llama_step.rs` faults in a quarter of
/// the pages it faults in when only blocks of 32 MiB and more (glibc's largest mmap
/// threshold) are kept, and runs 4-5 % faster; from 256 KiB the multi-rank steps, whose
/// per-rank activations are smaller, fault in a third to a sixth of the pages per step
/// they fault in from 1 MiB, with no larger resident set (docs/PERF.md, "Plain
/// collectives and the host cache").
pub const MIN_BYTES: usize = 256 << 10;

const DEFAULT_LIMIT: usize = 512 << 20;

/// A kept buffer: the allocation of a `Vec` whose element type and capacity are its key.
struct Block {
    ptr: *mut u8,
    bytes: usize,
    drop_fn: unsafe fn(*mut u8, usize),
}

// SAFETY: a block is plain memory owned by the cache alone (its Vec was forgotten).
unsafe impl Send for Block {}

type Key = (TypeId, usize);

#[derive(Default)]
struct Cache {
    limit: usize,
    bytes: usize,
    free: HashMap<Key, Vec<Block>>,
    /// Keys in the order their buffers were given (one entry per buffer), for eviction.
    order: VecDeque<Key>,
}

fn cache() -> MutexGuard<'static, Cache> {
    static C: OnceLock<Mutex<Cache>> = OnceLock::new();
    C.get_or_init(|| {
        let limit = match std::env::var("TPAR_HOST_CACHE_MIB") {
            Err(_) => DEFAULT_LIMIT,
            Ok(v) => v.trim().parse::<usize>().map_or_else(
                |_| {
                    eprintln!(
                        "tpar: TPAR_HOST_CACHE_MIB={v:?} is not a number of MiB; using {}",
                        DEFAULT_LIMIT >> 20
                    );
                    DEFAULT_LIMIT
                },
                |mib| mib.saturating_mul(1 << 20),
            ),
        };
        Mutex::new(Cache { limit, ..Cache::default() })
    })
    .lock()
    .unwrap_or_else(PoisonError::into_inner)
}

/// Rebuilds and drops the `Vec<T>` of capacity `bytes / size_of::<T>()` at `ptr`.
///
/// # Safety
/// `ptr` and `bytes` come from a `Vec<T>` forgotten by [`give`].
unsafe fn drop_vec<T>(ptr: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract: the allocation of a Vec<T> of this capacity.
    drop(unsafe { Vec::from_raw_parts(ptr.cast::<T>(), 0, bytes / size_of::<T>()) });
}

impl Cache {
    /// Frees the oldest buffers until at most `target` bytes are kept.
    fn evict_to(&mut self, target: usize) {
        while self.bytes > target {
            let Some(key) = self.order.pop_front() else { break };
            if let Some(b) = self.free.get_mut(&key).and_then(|list| list.pop()) {
                self.bytes -= b.bytes;
                // Freed from the cache's slot: no rank's figure moves.
                // SAFETY: the block came from `give` with this drop function.
                unsafe { (b.drop_fn)(b.ptr, b.bytes) };
            }
        }
    }
}

/// Keeps `v`'s buffer for reuse when it is large enough and fits under the limit;
/// otherwise drops it. Its contents are not kept.
pub fn give<T: Copy + 'static>(v: Vec<T>) {
    let bytes = v.capacity().saturating_mul(size_of::<T>());
    if bytes < MIN_BYTES {
        return;
    }
    let mut c = cache();
    if bytes > c.limit {
        return;
    }
    let target = c.limit - bytes;
    c.evict_to(target);
    let mut v = ManuallyDrop::new(v);
    let ptr = v.as_mut_ptr().cast::<u8>();
    crate::cache_block(ptr, bytes);
    let key = (TypeId::of::<T>(), v.capacity());
    c.free.entry(key).or_default().push(Block { ptr, bytes, drop_fn: drop_vec::<T> });
    c.order.push_back(key);
    c.bytes += bytes;
}

/// An empty `Vec<T>` with capacity exactly `len`, from a kept buffer if one fits
/// (its old contents are not visible: the length is 0). `None` when none is kept.
pub fn take<T: Copy + 'static>(len: usize) -> Option<Vec<T>> {
    if len.saturating_mul(size_of::<T>()) < MIN_BYTES {
        return None;
    }
    let key = (TypeId::of::<T>(), len);
    let mut c = cache();
    let b = c.free.get_mut(&key)?.pop()?;
    if let Some(i) = c.order.iter().rposition(|k| *k == key) {
        c.order.remove(i);
    }
    c.bytes -= b.bytes;
    drop(c);
    crate::uncache(b.ptr, b.bytes);
    // SAFETY: the block is the allocation of a Vec<T> (same TypeId) of capacity `len`,
    // which the cache owned alone since `give` forgot it.
    Some(unsafe { Vec::from_raw_parts(b.ptr.cast::<T>(), 0, len) })
}

/// A new `Vec<T>` of `len` elements that `fill` writes, in a kept buffer when one fits
/// ([`take`]). No pass zeroes the buffer first. When `fill` fails, its error is returned
/// and the buffer freed.
///
/// # Safety
/// When `fill` returns `Ok`, it must have written every element of the slice it was
/// given: the vector's elements are those values.
pub unsafe fn filled<T: Copy + 'static, E>(
    len: usize,
    fill: impl FnOnce(&mut [std::mem::MaybeUninit<T>]) -> Result<(), E>,
) -> Result<Vec<T>, E> {
    let mut v: Vec<T> = take(len).unwrap_or_else(|| Vec::with_capacity(len));
    fill(&mut v.spare_capacity_mut()[..len])?;
    // SAFETY: the capacity is at least `len`, and the caller's `fill` wrote elements
    // 0..len (this function's contract).
    unsafe { v.set_len(len) };
    Ok(v)
}

/// Bytes kept now.
pub fn cached_bytes() -> usize {
    cache().bytes
}

/// The most bytes kept at once.
pub fn limit() -> usize {
    cache().limit
}

/// Sets the most bytes kept at once (0 turns the cache off), freeing the oldest buffers
/// past it.
pub fn set_limit(bytes: usize) {
    let mut c = cache();
    c.limit = bytes;
    c.evict_to(bytes);
}

/// Frees every kept buffer.
pub fn empty_cache() {
    cache().evict_to(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test, so the process-wide cache sees one sequence of calls.
    #[test]
    fn keeps_large_buffers_by_type_and_capacity_under_a_limit() {
        let mib = MIN_BYTES;
        // Too small: not kept (`mib` is the smallest size kept).
        give(vec![0u8; mib - 1]);
        assert!(take::<u8>(mib - 1).is_none());
        // Kept, found by element type and capacity only.
        let v = vec![7u32; mib / 4];
        let p = v.as_ptr();
        give(v);
        assert!(take::<f32>(mib / 4).is_none(), "another type of the same size");
        assert!(take::<u32>(mib / 4 + 1).is_none(), "another capacity");
        let w = take::<u32>(mib / 4).unwrap();
        assert_eq!((w.as_ptr(), w.len(), w.capacity()), (p, 0, mib / 4));
        assert!(take::<u32>(mib / 4).is_none(), "taken once");
        // Over the limit the oldest buffers go first.
        let old = limit();
        set_limit(3 * mib);
        give(vec![1u8; mib]);
        give(vec![2u8; 2 * mib]);
        give(vec![3u8; 2 * mib]);
        assert!(cached_bytes() <= 3 * mib);
        assert!(take::<u8>(mib).is_none(), "the oldest was freed");
        assert!(take::<u8>(2 * mib).is_some());
        give(vec![0u8; 4 * mib]);
        assert!(take::<u8>(4 * mib).is_none(), "larger than the limit: not kept");
        empty_cache();
        assert_eq!(cached_bytes(), 0);
        set_limit(old);
    }
}
