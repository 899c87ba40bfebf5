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

use std::sync::Arc;

use super::mesh::{Channel, Mesh};
use crate::chunk_range;
use crate::local::kernels::reduce_runs;
use crate::remote::exec::{Deadline, Transport, Wire};
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
    /// as elements; each must hold `len(j)` of them.
    fn take<T: Wire>(
        &self,
        op: &'static str,
        from: &[usize],
        chan: Channel,
        len: impl Fn(usize) -> Option<usize>,
        deadline: Deadline,
    ) -> Result<Vec<Vec<T>>> {
        let peers: Vec<usize> = from.iter().map(|&m| self.group[m]).collect();
        let frames = self.mesh.take(op, &self.group, &peers, self.gid, chan, deadline)?;
        frames
            .into_iter()
            .zip(from)
            .map(|(bytes, &m)| self.elements::<T>(op, m, bytes, len(m)))
            .collect()
    }

    /// Decodes a frame from member `m`; `want` is the element count it must hold (`None`:
    /// any whole number of elements).
    fn elements<T: Wire>(
        &self,
        op: &'static str,
        m: usize,
        bytes: Vec<u8>,
        want: Option<usize>,
    ) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        let whole = bytes.len() % size == 0;
        if whole && want.is_none_or(|w| w * size == bytes.len()) {
            return Ok(bytemuck::pod_collect_to_vec(&bytes));
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
            got: format!("{} bytes sent to rank {me}", bytes.len()),
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
        let got = self.take::<T>(op, &others, Channel::Collective, |_| Some(len), deadline)?;
        let mut terms: Vec<&[T]> = got.iter().map(Vec::as_slice).collect();
        terms.insert(self.me, &send[start..start + len]);
        Ok(Self::reduce(&terms, rop))
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
        let got = self.take::<T>(op, &others, Channel::Collective, |j| Some(len(j)), deadline)?;
        let total: usize = (0..self.group.len()).map(&len).sum();
        let mut out = Vec::with_capacity(total);
        let mut got = got.into_iter();
        for j in 0..self.group.len() {
            if j == self.me {
                out.extend_from_slice(mine);
            } else if let Some(b) = got.next() {
                out.extend(b);
            }
        }
        Ok(out)
    }
}

impl Transport for TcpTransport {
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
            Prim::AllReduce(rop) => {
                let len = send.len();
                let range = |j: usize| chunk_range(len, n, j);
                let mine = self.reduce_scatter(op, *rop, send, range, deadline)?;
                self.all_gather(op, &mine, |j| range(j).1, deadline)
            }
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
                let mut got =
                    self.take::<T>(op, &from, Channel::Collective, want, deadline)?.into_iter();
                let mut out = Vec::with_capacity(recv_len);
                for &(peer, len) in recvs {
                    if peer == self.me {
                        let piece = own.filter(|p| p.len() == len).ok_or_else(|| {
                            internal(op, "this member's own piece is missing or of another size")
                        })?;
                        out.extend_from_slice(piece);
                    } else if let Some(piece) = got.next() {
                        out.extend(piece);
                    }
                }
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

fn internal(op: &'static str, what: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::InvalidArgument { op, why: format!("internal error: {what}") }
}
