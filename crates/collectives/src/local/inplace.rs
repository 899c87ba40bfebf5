//! Large host `all_reduce`s whose members lend their memory to each other: every member
//! reduces one flat chunk of all members' inputs and writes the result into that chunk
//! of every member's destination.
//!
//! Two calls run this way, once every member of the collective makes the same one:
//! - `all_reduce_` (in place): each member lends its tensor's memory, which is both the
//!   input and the destination. Member `k` reads chunk `k` of every buffer block by
//!   block, reduces it (terms in member order, as the out-of-place path does) and stores
//!   the result back into chunk `k` of every buffer: each store lands on a cache line the
//!   read just brought in.
//! - `all_reduce_into` (a separate output): each member lends its `out` memory; member
//!   `k` reads chunk `k` of every input and stores the reduced block into chunk `k` of
//!   every `out`. Large outputs are written with streaming stores, which do not read the
//!   destination's cache lines first.
//!
//! Either way every input byte is read once and every destination byte written once,
//! the least traffic a reduction can make; the staged or direct out-of-place paths read
//! or write each byte two or more times.
//!
//! The lending: a member's storage moves out of its tensor into an [`Arc<Lent>`]
//! published in the slot. Chunks are disjoint, so no two members touch the same
//! element. A lent buffer is kept alive by the `Arc`s every member holds while it
//! writes, so a member that gives up early (timeout, failed peer) never frees memory a
//! slow peer still writes: it takes its buffer back only when it is the sole owner
//! again, and otherwise gives its tensor new zeroed memory.

use std::ptr::NonNull;
use std::sync::Arc;

use tpar_tensor::{CpuStorage, DType, Element, Tensor};

use super::kernels::{
    reduce_runs, store, store_fence, with_slices, Reducible, BLOCK, STREAM_MIN_BYTES,
};
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

/// Reduces elements `start..start + len` of every input with `op` (terms in input order)
/// and writes the result into that range of every output, with streaming stores when
/// `stream`. The outputs may be the inputs themselves (in place): each block is read
/// in full before it is written.
///
/// # Safety
/// Every input pointer is valid for reads and every output pointer for writes of
/// `start + len` elements of `T`; no other thread writes elements `start..start + len`
/// of any of them, or reads those of an output, during the call.
unsafe fn reduce_chunk<T: Reducible>(
    inputs: &[NonNull<T>],
    outs: &[NonNull<T>],
    start: usize,
    len: usize,
    op: ReduceOp,
    stream: bool,
) {
    let mut acc = Vec::new();
    let mut sum: Vec<T> = Vec::with_capacity(BLOCK.min(len));
    let mut at = start;
    while at < start + len {
        let take = BLOCK.min(start + len - at);
        sum.clear();
        {
            // SAFETY: in range and not written by anyone while these borrows live.
            let runs: Vec<&[T]> = inputs
                .iter()
                .map(|p| unsafe { std::slice::from_raw_parts(p.as_ptr().add(at), take) })
                .collect();
            reduce_runs(&runs, op, &mut acc, &mut sum);
        }
        for p in outs {
            // SAFETY: in range; the shared borrows above have ended, `sum` is a buffer
            // of its own, and no one else touches these elements of an output.
            unsafe { store(p.as_ptr().add(at), &sum, stream) };
        }
        at += take;
    }
    if stream {
        store_fence();
    }
}

/// Whether every member asked for an in-place `all_reduce` that this path can run:
/// host tensors of at least [`IN_PLACE_MIN`] elements, two or more members, no two of
/// which share storage (those are reduced out of place and filled, which gives them
/// the same values). All members decide alike, from the same posts.
pub(super) fn runs_in_place(tensors: &[Tensor], all_in_place: bool) -> bool {
    let n = tensors.len();
    all_in_place
        && runs_into(tensors, true)
        && (0..n).all(|i| (i + 1..n).all(|j| !tensors[i].same_storage(&tensors[j])))
}

/// Whether every member lent an `out` to an `all_reduce_into` that this path can run:
/// host inputs of at least [`IN_PLACE_MIN`] elements and two or more members (inputs
/// are only read, so they may share storage). All members decide alike.
pub(super) fn runs_into(tensors: &[Tensor], all_into: bool) -> bool {
    all_into
        && tensors.len() > 1
        && tensors.first().is_some_and(|t| t.numel() >= IN_PLACE_MIN)
        && tensors.iter().all(|t| t.device() == tpar_tensor::Device::Cpu)
}

impl LocalComm {
    /// Publishes this member's lent buffer in slot `seq` and waits for every member's.
    /// On success returns all of them, in member order (this member's among them). On
    /// failure nobody has written: the buffer is withdrawn from the slot, this member has
    /// left it, and the caller gets its buffer back.
    fn lend(
        &self,
        seq: u64,
        op: &'static str,
        lent: Arc<Lent>,
        clock: Clock,
    ) -> std::result::Result<Vec<Arc<Lent>>, (CollectiveError, Arc<Lent>)> {
        let me = self.me;
        let n = self.ex.members.len();
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
        if r.is_ok() && bufs.len() == n {
            return Ok(bufs);
        }
        drop(bufs);
        if let Some(slot) = st.slots.get_mut(&seq) {
            if slot.lent.get_mut(me).and_then(Option::take).is_some() {
                slot.n_lent -= 1;
            }
        }
        let _ = self.leave(st, seq, op, clock, false);
        Err((r.err().unwrap_or_else(|| internal(op, "missing lent buffer")), lent))
    }

    /// Waits until every member has written its chunk (nobody writes this member's
    /// buffer any more); on failure withdraws this member's buffer from the slot.
    fn finish_lent(
        &self,
        seq: u64,
        op: &'static str,
        clock: Clock,
        consistent: bool,
    ) -> Result<()> {
        let r = self.leave(self.ex.lock(), seq, op, clock, true);
        let r = match (r, consistent) {
            (Ok(()), false) => Err(internal(op, "lent buffers disagree with the descriptors")),
            (r, _) => r,
        };
        if r.is_err() {
            if let Some(slot) = self.ex.lock().slots.get_mut(&seq) {
                slot.lent.get_mut(self.me).and_then(Option::take);
            }
        }
        r
    }

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
        let (op, me, n) = ("all_reduce", self.me, tensors.len());
        let mine = own(tensors, me)?;
        let lent = match mine.take_storage_() {
            Ok(s) => Arc::new(Lent::new(s)),
            Err(e) => {
                let e = CollectiveError::InvalidArgument { op, why: format!("the tensor: {e}") };
                self.abandon(seq, op, &e);
                return Err(e);
            }
        };
        let bufs = match self.lend(seq, op, lent, clock) {
            Ok(b) => b,
            Err((e, lent)) => return Err(give_back(mine, lent, false).err().unwrap_or(e)),
        };
        let Some(lent) = bufs.get(me).cloned() else {
            return Err(internal(op, "missing lent buffer"));
        };

        let (start, len) = chunk_range(lent.numel, n, me);
        let consistent = bufs.iter().all(|b| b.numel == lent.numel && b.dtype == lent.dtype);
        if consistent && len > 0 {
            tpar_tensor::with_any_type!(lent.dtype, |T| {
                let ptrs: Vec<NonNull<T>> = bufs.iter().map(|b| b.ptr.cast::<T>()).collect();
                // SAFETY: every buffer holds `numel` elements of `T` (checked above) and
                // stays alive while `bufs` holds it; `start..start + len` is this member's
                // chunk, which no other member reads or writes, and the owners do not
                // touch their lent storage until they are its sole owner again.
                unsafe { reduce_chunk::<T>(&ptrs, &ptrs, start, len, rop, false) };
            });
        }
        drop(bufs);
        // Every member's chunk must be written before any owner takes its buffer back.
        if let Err(e) = self.finish_lent(seq, op, clock, consistent) {
            return Err(give_back(mine, lent, true).err().unwrap_or(e));
        }
        give_back(mine, lent, false).map(|()| None)
    }

    /// The `all_reduce_into` of slot `seq` whose members all lent their `out` memory
    /// (see the module docs): `tensors` are the members' inputs, in member order, and
    /// `out` this member's output storage. Returns the output, refilled with the sum.
    /// After an error nothing is returned: the caller gives its `out` fresh memory.
    pub(super) fn all_reduce_lent_into(
        &self,
        seq: u64,
        tensors: &[Tensor],
        rop: ReduceOp,
        clock: Clock,
        out: CpuStorage,
    ) -> Result<Option<Tensor>> {
        let (op, me, n) = ("all_reduce", self.me, tensors.len());
        let mine = own(tensors, me)?;
        let dims = mine.dims().to_vec();
        let bufs = self.lend(seq, op, Arc::new(Lent::new(out)), clock).map_err(|(e, _)| e)?;
        let Some(lent) = bufs.get(me).cloned() else {
            return Err(internal(op, "missing lent buffer"));
        };

        let numel = mine.numel();
        let (start, len) = chunk_range(numel, n, me);
        let consistent = bufs.iter().all(|b| b.numel == numel && b.dtype == lent.dtype)
            && tensors.iter().all(|t| t.numel() == numel && t.dtype() == lent.dtype);
        let mut written = Ok(true);
        if consistent && len > 0 {
            let stream = numel * lent.dtype.size_in_bytes() >= STREAM_MIN_BYTES;
            written = tpar_tensor::with_any_type!(lent.dtype, |T| {
                let outs: Vec<NonNull<T>> = bufs.iter().map(|b| b.ptr.cast::<T>()).collect();
                with_slices::<T, _>(tensors, |inputs| {
                    if inputs.iter().any(|i| i.len() < start + len) {
                        return false;
                    }
                    let ins: Vec<NonNull<T>> =
                        inputs.iter().map(|i| NonNull::from(*i).cast()).collect();
                    // SAFETY: every input holds `start + len` elements (checked just
                    // above) and is read-locked; every output holds `numel` elements of
                    // `T` (checked above) and stays alive while `bufs` holds it;
                    // `start..start + len` is this member's chunk, which no other member
                    // writes, and the owners do not touch their lent storage until they
                    // are its sole owner again. Outputs are storage taken out of the
                    // members' `out` tensors, which share no storage with the inputs
                    // (checked when posting): an input sharing it would have been left
                    // without memory and failed above.
                    unsafe { reduce_chunk::<T>(&ins, &outs, start, len, rop, stream) };
                    true
                })
            });
        }
        drop(bufs);
        let consistent = consistent && matches!(written, Ok(true));
        self.finish_lent(seq, op, clock, consistent)?;
        written.map_err(|e| CollectiveError::InvalidArgument { op, why: e.to_string() })?;
        let Ok(l) = Arc::try_unwrap(lent) else {
            return Err(internal(op, "a peer still holds the output after the call"));
        };
        Ok(Some(Tensor::from_storage(l.storage, dims)?))
    }
}

/// Member `me`'s posted tensor.
fn own(tensors: &[Tensor], me: usize) -> Result<&Tensor> {
    tensors.get(me).ok_or_else(|| internal("all_reduce", "member without a posted tensor"))
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
