//! The primitives of one group over the world's TCP connections, reducing on the CPU with
//! the local backend's kernels.
//!
//! Algorithms are direct: every member exchanges with every other, so each step waits on
//! the peers it needs and notices at once when one of them is gone.
//!
//! - `AllReduce`: reduce-scatter then all-gather. Member `i` owns the `torch.chunk`
//!   range `i` of the flat buffer: every member sends it that range, it reduces the `n`
//!   terms in member order, and sends the result back to all. Each member moves
//!   `2 (n - 1) / n` of the buffer each way, and every member ends with the same bits
//!   (each range is reduced once, by its owner, in the local backend's order).
//! - `ReduceScatter`: block `j` of every member goes to member `j`, which reduces them
//!   in member order.
//! - `AllGather`: every member's block goes to every other; blocks are laid out in
//!   member order.
//! - `Broadcast`: the root sends to every other member.
//! - `Exchange` (`all_to_all`): each piece goes to its peer; a member's own piece is a
//!   local copy.
//! - `Send`/`Recv`: one frame on the group's point-to-point channel; a receive hands
//!   back what was sent, so a count mismatch is caught by the caller.
//!
//! Received frames are used in place where the algorithm only reads them (reduction
//! terms, pieces copied into the output), viewed as elements without a copy, and handed
//! back to the mesh for reuse afterwards.

use std::borrow::Cow;
use std::sync::Arc;

use super::mesh::{Channel, Mesh};
use crate::chunk_range;
use crate::local::kernels::reduce_runs;
use crate::remote::exec::{Deadline, NoDevice, Transport, Wire};
use crate::remote::plan::Prim;
use crate::{CollectiveError, ReduceOp, Result};

/// One member's view of a group over the world's connections.
pub(crate) struct TcpTransport {
    mesh: Arc<Mesh>,
    /// The group's id in frame headers.
    gid: u64,
    /// The members' global ranks.
    group: Arc<[usize]>,
    /// This member's group rank.
    me: usize,
}

impl TcpTransport {
    pub fn new(mesh: Arc<Mesh>, gid: u64, group: Arc<[usize]>, me: usize) -> TcpTransport {
        TcpTransport { mesh, gid, group, me }
    }

    fn post<T: Wire>(&self, op: &'static str, to: usize, chan: Channel, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.mesh.post(op, &self.group, self.group[to], self.gid, chan, bytes)
    }

    /// The next frame from each member of `from` (group ranks, distinct, not this one),
    /// as bytes; each must hold `len(j)` elements of `T` (`None`: any whole number). Hand
    /// the frames back with `self.mesh.recycle` once used.
    fn take_raw<T: Wire>(
        &self,
        op: &'static str,
        from: &[usize],
        chan: Channel,
        len: impl Fn(usize) -> Option<usize>,
        deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        let peers: Vec<usize> = from.iter().map(|&m| self.group[m]).collect();
        let frames = self.mesh.take(op, &self.group, &peers, self.gid, chan, deadline)?;
        let bad = frames
            .iter()
            .zip(from)
            .find_map(|(b, &m)| self.check::<T>(op, m, b.len(), len(m)).err());
        if let Some(e) = bad {
            self.mesh.recycle(frames);
            return Err(e);
        }
        Ok(frames)
    }

    /// [`take_raw`](Self::take_raw), as owned elements.
    fn take<T: Wire>(
        &self,
        op: &'static str,
        from: &[usize],
        chan: Channel,
        len: impl Fn(usize) -> Option<usize>,
        deadline: Deadline,
    ) -> Result<Vec<Vec<T>>> {
        let frames = self.take_raw::<T>(op, from, chan, len, deadline)?;
        let out = frames.iter().map(|b| bytemuck::pod_collect_to_vec(b)).collect();
        self.mesh.recycle(frames);
        Ok(out)
    }

    /// Checks that a frame of `bytes` bytes from member `m` holds `want` elements (`None`:
    /// any whole number of elements).
    fn check<T: Wire>(
        &self,
        op: &'static str,
        m: usize,
        bytes: usize,
        want: Option<usize>,
    ) -> Result<()> {
        let size = std::mem::size_of::<T>();
        let whole = bytes.is_multiple_of(size);
        if whole && want.is_none_or(|w| w * size == bytes) {
            return Ok(());
        }
        let me = self.group[self.me];
        let expected = match want {
            Some(w) => format!("{w} elements of {} ({} bytes)", T::DTYPE, w * size),
            None => format!("whole elements of {} ({size} bytes each)", T::DTYPE),
        };
        Err(CollectiveError::Mismatch {
            op,
            group: self.group.to_vec(),
            rank: self.group[m],
            expected: format!("{expected}, what rank {me} expects"),
            got: format!("{bytes} bytes sent to rank {me}"),
        })
    }

    fn others(&self) -> Vec<usize> {
        (0..self.group.len()).filter(|&m| m != self.me).collect()
    }

    /// Reduces `terms` (one run per member, in member order) with `op`.
    fn reduce<T: Wire>(terms: &[&[T]], op: ReduceOp) -> Vec<T> {
        let len = terms.first().map_or(0, |t| t.len());
        let mut out = Vec::with_capacity(len);
        reduce_runs(terms, op, &mut Vec::new(), &mut out);
        out
    }

    /// Sends block `j` of `blocks` to member `j`, receives this member's block from every
    /// other, and reduces them in member order.
    fn reduce_scatter<T: Wire>(
        &self,
        op: &'static str,
        rop: ReduceOp,
        send: &[T],
        range: impl Fn(usize) -> (usize, usize),
        deadline: Deadline,
    ) -> Result<Vec<T>> {
        let others = self.others();
        for &j in &others {
            let (start, len) = range(j);
            self.post(op, j, Channel::Collective, &send[start..start + len])?;
        }
        let (start, len) = range(self.me);
        let got = self.take_raw::<T>(op, &others, Channel::Collective, |_| Some(len), deadline)?;
        let reduced = {
            let views: Vec<Cow<'_, [T]>> = got.iter().map(|b| view(b)).collect();
            let mut terms: Vec<&[T]> = views.iter().map(|v| &**v).collect();
            terms.insert(self.me, &send[start..start + len]);
            Self::reduce(&terms, rop)
        };
        self.mesh.recycle(got);
        Ok(reduced)
    }

    /// Reduce-scatter then all-gather, in place in the output: this member reduces its
    /// range straight into the output, sends it from there, and copies the others' ranges
    /// in as they come.
    fn all_reduce<T: Wire>(
        &self,
        op: &'static str,
        rop: ReduceOp,
        send: &[T],
        deadline: Deadline,
    ) -> Result<Vec<T>> {
        let (n, len) = (self.group.len(), send.len());
        let range = |j: usize| chunk_range(len, n, j);
        let others = self.others();
        for &j in &others {
            let (start, l) = range(j);
            self.post(op, j, Channel::Collective, &send[start..start + l])?;
        }
        // Zeroed by the allocator (fresh pages), so nothing is written twice.
        let mut out: Vec<T> = bytemuck::zeroed_vec(len);
        let (start, l) = range(self.me);
        let got = self.take_raw::<T>(op, &others, Channel::Collective, |_| Some(l), deadline)?;
        {
            let views: Vec<Cow<'_, [T]>> = got.iter().map(|b| view(b)).collect();
            let mut terms: Vec<&[T]> = views.iter().map(|v| &**v).collect();
            terms.insert(self.me, &send[start..start + l]);
            reduce_into(&terms, rop, &mut out[start..start + l]);
        }
        self.mesh.recycle(got);
        for &j in &others {
            self.post(op, j, Channel::Collective, &out[start..start + l])?;
        }
        let got =
            self.take_raw::<T>(op, &others, Channel::Collective, |j| Some(range(j).1), deadline)?;
        for (&j, b) in others.iter().zip(&got) {
            let (s, l) = range(j);
            out[s..s + l].copy_from_slice(&view::<T>(b));
        }
        self.mesh.recycle(got);
        Ok(out)
    }

    /// Sends `mine` to every other member and lays every member's block out in member
    /// order (block `j` holding `len(j)` elements).
    fn all_gather<T: Wire>(
        &self,
        op: &'static str,
        mine: &[T],
        len: impl Fn(usize) -> usize,
        deadline: Deadline,
    ) -> Result<Vec<T>> {
        let others = self.others();
        for &j in &others {
            self.post(op, j, Channel::Collective, mine)?;
        }
        let got =
            self.take_raw::<T>(op, &others, Channel::Collective, |j| Some(len(j)), deadline)?;
        let total: usize = (0..self.group.len()).map(&len).sum();
        let mut out = Vec::with_capacity(total);
        let mut pieces = got.iter();
        for j in 0..self.group.len() {
            if j == self.me {
                out.extend_from_slice(mine);
            } else if let Some(b) = pieces.next() {
                out.extend_from_slice(&view::<T>(b));
            }
        }
        self.mesh.recycle(got);
        Ok(out)
    }
}

impl Transport for TcpTransport {
    type DeviceJob = NoDevice;

    fn size(&self) -> usize {
        self.group.len()
    }

    fn rank(&self) -> usize {
        self.me
    }

    fn group(&self) -> &[usize] {
        &self.group
    }

    fn run<T: Wire>(
        &mut self,
        op: &'static str,
        prim: &Prim,
        send: &[T],
        recv_len: usize,
        deadline: Deadline,
    ) -> Result<Vec<T>> {
        let n = self.group.len();
        match prim {
            Prim::AllReduce(rop) => self.all_reduce(op, *rop, send, deadline),
            Prim::ReduceScatter(rop) => {
                let b = recv_len;
                if send.len() != n * b {
                    return Err(internal(
                        op,
                        format!("{} elements for {n} blocks of {b}", send.len()),
                    ));
                }
                self.reduce_scatter(op, *rop, send, |j| (j * b, b), deadline)
            }
            Prim::AllGather => {
                let b = send.len();
                self.all_gather(op, send, |_| b, deadline)
            }
            Prim::Broadcast { root } => {
                if *root == self.me {
                    for j in self.others() {
                        self.post(op, j, Channel::Collective, send)?;
                    }
                    Ok(send.to_vec())
                } else {
                    let got = self.take::<T>(
                        op,
                        &[*root],
                        Channel::Collective,
                        |_| Some(recv_len),
                        deadline,
                    )?;
                    Ok(got.into_iter().next().unwrap_or_default())
                }
            }
            Prim::Exchange { sends, recvs } => {
                let mut own: Option<&[T]> = None;
                for &(peer, start, len) in sends {
                    let piece = send
                        .get(start..start + len)
                        .ok_or_else(|| internal(op, "exchange piece out of bounds"))?;
                    if peer == self.me {
                        own = Some(piece);
                    } else {
                        self.post(op, peer, Channel::Collective, piece)?;
                    }
                }
                let from: Vec<usize> =
                    recvs.iter().map(|r| r.0).filter(|&p| p != self.me).collect();
                let want = |p: usize| recvs.iter().find(|r| r.0 == p).map(|r| r.1);
                let got = self.take_raw::<T>(op, &from, Channel::Collective, want, deadline)?;
                let mut pieces = got.iter();
                let mut out = Vec::with_capacity(recv_len);
                for &(peer, len) in recvs {
                    if peer == self.me {
                        let piece = own.filter(|p| p.len() == len).ok_or_else(|| {
                            internal(op, "this member's own piece is missing or of another size")
                        })?;
                        out.extend_from_slice(piece);
                    } else if let Some(piece) = pieces.next() {
                        out.extend_from_slice(&view::<T>(piece));
                    }
                }
                self.mesh.recycle(got);
                Ok(out)
            }
            Prim::Send { peer } => {
                self.post(op, *peer, Channel::P2p, send)?;
                Ok(Vec::new())
            }
            Prim::Recv { peer } => {
                let got = self.take::<T>(op, &[*peer], Channel::P2p, |_| None, deadline)?;
                Ok(got.into_iter().next().unwrap_or_default())
            }
        }
    }
}

/// Reduces `terms` (one run per member, in member order, each as long as `out`) into
/// `out`, a cache-sized block at a time through the local backend's kernel (so the
/// results are the same bits).
fn reduce_into<T: Wire>(terms: &[&[T]], op: ReduceOp, out: &mut [T]) {
    const BLOCK: usize = 16 << 10;
    let (mut acc, mut tmp) = (Vec::new(), Vec::with_capacity(BLOCK.min(out.len())));
    let mut block: Vec<&[T]> = Vec::with_capacity(terms.len());
    for (b, dst) in out.chunks_mut(BLOCK).enumerate() {
        let at = b * BLOCK;
        block.clear();
        block.extend(terms.iter().map(|t| &t[at..at + dst.len()]));
        tmp.clear();
        reduce_runs(&block, op, &mut acc, &mut tmp);
        dst.copy_from_slice(&tmp);
    }
}

/// The elements of a received frame: the bytes themselves when they are aligned for `T`
/// (large allocations always are), else a copy.
fn view<T: Wire>(bytes: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

fn internal(op: &'static str, what: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::InvalidArgument { op, why: format!("internal error: {what}") }
}
