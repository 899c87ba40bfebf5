//! `all_reduce_` on the local backend: every member reduces one flat chunk of all members'
//! buffers and writes the result back into each of them.
//!
//! Each member lends its tensor's memory to the call (the storage moves out of the tensor
//! into an [`Arc<Lent>`] published in the slot); once every member has lent, member `k`
//! reads chunk `k` of every buffer block by block, reduces it (terms in member order, as
//! the out-of-place path does) and stores the result into chunk `k` of every buffer. Every
//! byte is read once and written once, two passes over the tensor per member; an
//! out-of-place `all_reduce` makes three or more, as its members each read the inputs and
//! write an output of their own.
//!
//! Chunks are disjoint, so no two members touch the same element. A lent buffer is kept
//! alive by the `Arc`s every member holds while it writes, so a member that gives up
//! early (timeout, failed peer) never frees memory a slow peer still writes: it takes its
//! buffer back only when it is the sole owner again, and otherwise gives its tensor new
//! zeroed memory.

use std::ptr::NonNull;
use std::sync::Arc;

use tpar_tensor::{CpuStorage, DType, Element, Tensor};

use super::kernels::{reduce_runs, Reducible, BLOCK};
use super::{internal, Clock, LocalComm, Phase};
use crate::{chunk_range, CollectiveError, ReduceOp, Result};

/// Elements from which a host `all_reduce_` of two or more members runs in place; smaller
/// ones are reduced out of place and moved into the tensor (one synchronisation fewer).
pub(super) const IN_PLACE_MIN: usize = 1 << 14;

/// A member's buffer lent to an in-place `all_reduce`.
pub(crate) struct Lent {
    /// Owns the memory; not touched while lent (all access goes through `ptr`).
    storage: CpuStorage,
    /// The first element, taken from the owning vector before it was lent.
    ptr: NonNull<u8>,
    numel: usize,
    dtype: DType,
}

// SAFETY: `Lent` owns its memory (like the `Vec` inside `storage`, which is Send + Sync);
// the raw pointer is only dereferenced by `reduce_chunk`, whose callers write disjoint
// chunks (see `LocalComm::all_reduce_in_place`).
unsafe impl Send for Lent {}
// SAFETY: as above; shared access never creates overlapping references.
unsafe impl Sync for Lent {}

impl Lent {
    fn new(mut storage: CpuStorage) -> Lent {
        let dtype = storage.dtype();
        let (ptr, numel) = tpar_tensor::with_any_type!(dtype, |T| {
            match <T as Element>::slice_mut(&mut storage) {
                Some(s) => {
                    let numel = s.len();
                    (NonNull::from(s).cast::<u8>(), numel)
                }
                None => (NonNull::dangling(), 0),
            }
        });
        Lent { storage, ptr, numel, dtype }
    }
}

/// Reduces elements `start..start + len` of every buffer with `op` (terms in buffer order)
/// and writes the result back into that range of each.
///
/// # Safety
/// Every pointer is valid for reads and writes of `start + len` elements of `T`, and no
/// other thread reads or writes elements `start..start + len` of any of them during the
/// call.
unsafe fn reduce_chunk<T: Reducible>(bufs: &[NonNull<T>], start: usize, len: usize, op: ReduceOp) {
    let mut acc = Vec::new();
    let mut sum: Vec<T> = Vec::with_capacity(BLOCK.min(len));
    let mut at = start;
    while at < start + len {
        let take = BLOCK.min(start + len - at);
        sum.clear();
        {
            // SAFETY: in range and not written by anyone while these borrows live.
            let runs: Vec<&[T]> = bufs
                .iter()
                .map(|p| unsafe { std::slice::from_raw_parts(p.as_ptr().add(at), take) })
                .collect();
            reduce_runs(&runs, op, &mut acc, &mut sum);
        }
        for p in bufs {
            // SAFETY: in range; the shared borrows above have ended and the buffers are
            // distinct allocations, so this is the only reference to these elements.
            unsafe { std::slice::from_raw_parts_mut(p.as_ptr().add(at), take) }
                .copy_from_slice(&sum);
        }
        at += take;
    }
}

/// Whether every member asked for an in-place `all_reduce` that this path can run:
/// host tensors of at least [`IN_PLACE_MIN`] elements, two or more members, no two of
/// which share storage (those are reduced out of place and filled, which gives them
/// the same values). All members decide alike, from the same posts.
pub(super) fn runs_in_place(tensors: &[Tensor], all_in_place: bool) -> bool {
    let n = tensors.len();
    all_in_place
        && n > 1
        && tensors.first().is_some_and(|t| t.numel() >= IN_PLACE_MIN)
        && tensors.iter().all(|t| t.device() == tpar_tensor::Device::Cpu)
        && (0..n).all(|i| (i + 1..n).all(|j| !tensors[i].same_storage(&tensors[j])))
}

impl LocalComm {
    /// The in-place `all_reduce` of slot `seq` (see the module docs); `tensors` are the
    /// members' posted handles, in member order. On success this member's tensor holds
    /// the result. If the call fails before anyone wrote, the tensor keeps its values;
    /// after that it holds zeros.
    pub(super) fn all_reduce_in_place(
        &self,
        seq: u64,
        tensors: &[Tensor],
        rop: ReduceOp,
        clock: Clock,
    ) -> Result<Option<Tensor>> {
        let op = "all_reduce";
        let me = self.me;
        let n = tensors.len();
        let Some(mine) = tensors.get(me) else {
            return Err(internal(op, "member without a posted tensor"));
        };
        let lent = match mine.take_storage_() {
            Ok(s) => Arc::new(Lent::new(s)),
            Err(e) => {
                let e = CollectiveError::InvalidArgument { op, why: format!("the tensor: {e}") };
                self.abandon(seq, op, &e);
                return Err(e);
            }
        };
        let mut st = self.ex.lock();
        if let Some(slot) = st.slots.get_mut(&seq) {
            if let Some(l) = slot.lent.get_mut(me) {
                *l = Some(lent.clone());
                slot.n_lent += 1;
            }
            self.ex.cv.notify_all();
        }
        let (mut st, r) = self.wait(st, seq, op, clock, Phase::Lent);
        let bufs: Vec<Arc<Lent>> = match (&r, st.slots.get(&seq)) {
            (Ok(()), Some(slot)) => slot.lent.iter().flatten().cloned().collect(),
            _ => Vec::new(),
        };
        if r.is_err() || bufs.len() != n {
            // Nobody has written: take the buffer back untouched.
            if let Some(slot) = st.slots.get_mut(&seq) {
                if slot.lent.get_mut(me).and_then(Option::take).is_some() {
                    slot.n_lent -= 1;
                }
            }
            let _ = self.leave(st, seq, op, clock, false);
            let e = r.err().unwrap_or_else(|| internal(op, "missing lent buffer"));
            return Err(give_back(mine, lent, false).err().unwrap_or(e));
        }
        drop(st);

        let (start, len) = chunk_range(lent.numel, n, me);
        let consistent = bufs.iter().all(|b| b.numel == lent.numel && b.dtype == lent.dtype);
        if consistent && len > 0 {
            tpar_tensor::with_any_type!(lent.dtype, |T| {
                let ptrs: Vec<NonNull<T>> = bufs.iter().map(|b| b.ptr.cast::<T>()).collect();
                // SAFETY: every buffer holds `numel` elements of `T` (checked above) and
                // stays alive while `bufs` holds it; `start..start + len` is this member's
                // chunk, which no other member reads or writes, and the owners do not
                // touch their lent storage until they are its sole owner again.
                unsafe { reduce_chunk::<T>(&ptrs, start, len, rop) };
            });
        }
        drop(bufs);
        // Every member's chunk must be written before any owner takes its buffer back.
        let r = self.leave(self.ex.lock(), seq, op, clock, true);
        let r = match (r, consistent) {
            (Ok(()), false) => Err(internal(op, "lent buffers disagree with the descriptors")),
            (r, _) => r,
        };
        if let Err(e) = r {
            if let Some(slot) = self.ex.lock().slots.get_mut(&seq) {
                slot.lent.get_mut(me).and_then(Option::take);
            }
            return Err(give_back(mine, lent, true).err().unwrap_or(e));
        }
        give_back(mine, lent, false).map(|()| None)
    }
}

/// Puts a lent buffer back into its tensor: the memory itself once this is its only
/// owner (and `zero` is false), otherwise new zeroed memory (a peer still holds the
/// buffer, or the call failed half-way and the values are partial). Errs only if the
/// tensor cannot be refilled.
fn give_back(t: &Tensor, lent: Arc<Lent>, zero: bool) -> Result<()> {
    let op = "all_reduce";
    let dims = t.dims().to_vec();
    let filled = match Arc::try_unwrap(lent) {
        Ok(l) if !zero => Tensor::from_storage(l.storage, dims.clone()),
        _ => Tensor::zeros(dims.clone(), t.dtype(), t.device()),
    };
    filled.and_then(|f| t.fill_storage_(f)).map_err(|e| CollectiveError::InvalidArgument {
        op,
        why: format!("refilling the tensor after the in-place all_reduce: {e}"),
    })
}
