//! How each collective maps onto one NCCL primitive over flat buffers: what to send, how
//! much comes back, and the strided copies that build the send buffer from the input and
//! the output from the receive buffer. Pure: no devices, unit-tested on the host.
//!
//! Uneven shards (`torch.chunk` sizes, which may be 0) meet NCCL's equal-count
//! primitives by padding:
//!
//! - `all_gather` along `dim`: every member sends a block of `outer * max_j(s_j) * inner`
//!   elements (its shard, zero-padded along `dim` to the largest shard); after NCCL's
//!   `ncclAllGather` each member copies the first `s_j` rows of block `j` into place.
//!   Moves `n * max_j(s_j)` rows instead of `sum_j(s_j)`: at most `n - 1` extra rows with
//!   `torch.chunk` sizes.
//! - `reduce_scatter` along `dim`: the input is cut into `n` chunks of `ceil(size / n)`
//!   rows, the short last chunks zero-padded; `ncclReduceScatter` reduces block `i` into
//!   member `i`, which trims the padding. Padding only ever reduces with padding, so any
//!   reduce op is exact.
//! - `all_to_all`: grouped `ncclSend`/`ncclRecv` (`ncclGroupStart`/`ncclGroupEnd`) of
//!   exact-size pieces, sizes known from the headers; no padding.
//!
//! Every copy is a [`Copy2D`]: `rows` runs of `width` elements at a source and a
//! destination pitch, the shape of `cuMemcpy2D`, so when tensors live on the device the
//! same plan runs as device-to-device copies.

use tpar_tensor::DType;

use crate::chunk_range;
use crate::local::desc::{around, Call, Desc};
use crate::ReduceOp;

/// A strided block copy: for `r in 0..rows`, the `width` elements at
/// `src[src_off + r * src_pitch..]` go to `dst[dst_off + r * dst_pitch..]` (in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Copy2D {
    pub src_off: usize,
    pub src_pitch: usize,
    pub dst_off: usize,
    pub dst_pitch: usize,
    pub width: usize,
    pub rows: usize,
}

impl Copy2D {
    /// Applies the copy on host slices; `false` (and a partial copy) when a run is out of
    /// bounds.
    pub fn apply<T: Copy>(&self, src: &[T], dst: &mut [T]) -> bool {
        if self.width == 0 {
            return true;
        }
        for r in 0..self.rows {
            let s = self.src_off + r * self.src_pitch;
            let d = self.dst_off + r * self.dst_pitch;
            match (src.get(s..s + self.width), dst.get_mut(d..d + self.width)) {
                (Some(from), Some(to)) => to.copy_from_slice(from),
                _ => return false,
            }
        }
        true
    }
}

/// Applies `copies` from `src` into a zeroed buffer of `len` elements.
pub(crate) fn gather_copies<T: Copy + Default>(
    src: &[T],
    len: usize,
    copies: &[Copy2D],
) -> Option<Vec<T>> {
    let mut out = vec![T::default(); len];
    copies.iter().all(|c| c.apply(src, &mut out)).then_some(out)
}

/// The NCCL primitive a collective runs, over flat buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Prim {
    /// `ncclAllReduce`: send and receive buffers of equal length.
    AllReduce(ReduceOp),
    /// `ncclAllGather`: every member sends a block of the same length `b`; `n * b` come back.
    AllGather,
    /// `ncclReduceScatter`: every member sends `n * b`; reduced block `rank` (`b`) comes back.
    ReduceScatter(ReduceOp),
    /// `ncclBroadcast` from group rank `root`: only the root's send buffer is read.
    Broadcast {
        /// The source's group rank.
        root: usize,
    },
    /// Grouped `ncclSend`/`ncclRecv`: `sends` are `(peer, start, len)` slices of the send
    /// buffer; `recvs` are `(peer, len)` pieces laid out back to back in the receive buffer.
    /// A piece to or from this member itself is a local copy.
    Exchange { sends: Vec<(usize, usize, usize)>, recvs: Vec<(usize, usize)> },
    /// `ncclSend` of the whole send buffer to a group rank.
    Send {
        /// The destination's group rank.
        peer: usize,
    },
    /// `ncclRecv` of the whole receive buffer from a group rank.
    Recv {
        /// The source's group rank.
        peer: usize,
    },
}

/// The plan of one member's part of a collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The primitive.
    pub prim: Prim,
    /// Builds the send buffer (length, copies from the input); `None` sends the input as is.
    pub pack: Option<(usize, Vec<Copy2D>)>,
    /// Elements that come back.
    pub recv_len: usize,
    /// Builds the output from the receive buffer; `None`: the receive buffer is the output.
    pub unpack: Option<Vec<Copy2D>>,
    /// The output's dims.
    pub out_dims: Vec<usize>,
    /// The output's dtype (the source's for a broadcast).
    pub out_dtype: DType,
    /// Whether this member has nothing to communicate (all counts zero, the same verdict on
    /// every member for collectives; per pair for `all_to_all`).
    pub idle: bool,
}

fn prod(d: &[usize]) -> usize {
    d.iter().product()
}

/// The piece of the member described by `desc` that `all_to_all` sends to member `to`:
/// `(start, len)` along `split_dim` (its split sizes, else the `torch.chunk` rule).
fn a2a_piece(desc: &Desc, split_dim: usize, to: usize, n: usize) -> (usize, usize) {
    match &desc.call {
        Call::AllToAll { sizes: Some(s), .. } if s.len() == n => (s[..to].iter().sum(), s[to]),
        _ => chunk_range(desc.dims.get(split_dim).copied().unwrap_or(0), n, to),
    }
}

/// Plans member `me`'s part of `call`, from every member's (validated, non-meta) call.
/// `Err` is an internal inconsistency (descriptors that passed validation should plan).
pub(crate) fn plan(call: &Call, descs: &[Desc], me: usize) -> Result<Layout, String> {
    let n = descs.len();
    let mine = descs.get(me).ok_or("member index out of range")?;
    let dims = &mine.dims;
    let dim_ok = |d: usize| {
        if d < dims.len() {
            Ok(())
        } else {
            Err(format!("dim {d} out of range for {dims:?}"))
        }
    };
    let layout = match call {
        Call::Barrier => return Err("barrier has no data step".into()),
        Call::AllReduce { op } => {
            let numel = prod(dims);
            Layout {
                prim: Prim::AllReduce(*op),
                pack: None,
                recv_len: numel,
                unpack: None,
                out_dims: dims.clone(),
                out_dtype: mine.dtype,
                idle: numel == 0,
            }
        }
        Call::Broadcast { src } => {
            let root = descs.get(*src).ok_or("broadcast source out of range")?;
            let numel = prod(&root.dims);
            Layout {
                prim: Prim::Broadcast { root: *src },
                pack: None,
                recv_len: numel,
                unpack: None,
                out_dims: root.dims.clone(),
                out_dtype: root.dtype,
                idle: numel == 0,
            }
        }
        Call::AllGather { dim } => {
            let d = *dim;
            dim_ok(d)?;
            let (outer, inner) = around(dims, d);
            let s: Vec<usize> = descs.iter().map(|x| x.dims.get(d).copied().unwrap_or(0)).collect();
            let smax = s.iter().copied().max().unwrap_or(0);
            let total: usize = s.iter().sum();
            let block = outer * smax * inner;
            let s_me = s[me];
            let pack = (s_me != smax).then(|| {
                let c = Copy2D {
                    src_off: 0,
                    src_pitch: s_me * inner,
                    dst_off: 0,
                    dst_pitch: smax * inner,
                    width: s_me * inner,
                    rows: outer,
                };
                (block, vec![c])
            });
            let even = s.iter().all(|&x| x == smax);
            let unpack = (!(even && outer == 1)).then(|| {
                let mut off = 0;
                let mut copies = Vec::with_capacity(n);
                for (j, &sj) in s.iter().enumerate() {
                    copies.push(Copy2D {
                        src_off: j * block,
                        src_pitch: smax * inner,
                        dst_off: off * inner,
                        dst_pitch: total * inner,
                        width: sj * inner,
                        rows: outer,
                    });
                    off += sj;
                }
                copies
            });
            let mut out_dims = dims.clone();
            out_dims[d] = total;
            Layout {
                prim: Prim::AllGather,
                pack,
                recv_len: n * block,
                unpack,
                out_dims,
                out_dtype: mine.dtype,
                idle: block == 0,
            }
        }
        Call::ReduceScatter { dim, op } => {
            let d = *dim;
            dim_ok(d)?;
            let (outer, inner) = around(dims, d);
            let size = dims[d];
            let chunk = size.div_ceil(n.max(1));
            let blk = outer * chunk * inner;
            let even = size == chunk * n;
            let pack = (!(even && outer == 1)).then(|| {
                let copies = (0..n)
                    .map(|i| {
                        let (start, len) = chunk_range(size, n, i);
                        Copy2D {
                            src_off: start * inner,
                            src_pitch: size * inner,
                            dst_off: i * blk,
                            dst_pitch: chunk * inner,
                            width: len * inner,
                            rows: outer,
                        }
                    })
                    .collect();
                (n * blk, copies)
            });
            let c_me = chunk_range(size, n, me).1;
            let unpack = (c_me != chunk).then(|| {
                vec![Copy2D {
                    src_off: 0,
                    src_pitch: chunk * inner,
                    dst_off: 0,
                    dst_pitch: c_me * inner,
                    width: c_me * inner,
                    rows: outer,
                }]
            });
            let mut out_dims = dims.clone();
            out_dims[d] = c_me;
            Layout {
                prim: Prim::ReduceScatter(*op),
                pack,
                recv_len: blk,
                unpack,
                out_dims,
                out_dtype: mine.dtype,
                idle: blk == 0,
            }
        }
        Call::AllToAll { split_dim, concat_dim, .. } => {
            let (sd, cd) = (*split_dim, *concat_dim);
            dim_ok(sd)?;
            dim_ok(cd)?;
            // What this member sends: piece i of its own input goes to member i.
            let (outer_s, inner_s) = around(dims, sd);
            let mut sends = Vec::with_capacity(n);
            let mut copies = Vec::with_capacity(n);
            let mut off = 0;
            for i in 0..n {
                let (start, len) = a2a_piece(mine, sd, i, n);
                let count = outer_s * len * inner_s;
                copies.push(Copy2D {
                    src_off: start * inner_s,
                    src_pitch: dims[sd] * inner_s,
                    dst_off: off,
                    dst_pitch: len * inner_s,
                    width: len * inner_s,
                    rows: outer_s,
                });
                if count > 0 {
                    sends.push((i, off, count));
                }
                off += count;
            }
            let pack = (outer_s != 1).then_some((off, copies));
            // What it receives: piece `me` of every member's input.
            let pieces: Vec<Vec<usize>> = descs
                .iter()
                .map(|d| {
                    let mut p = d.dims.clone();
                    if let Some(x) = p.get_mut(sd) {
                        *x = a2a_piece(d, sd, me, n).1;
                    }
                    p
                })
                .collect();
            let mut recvs = Vec::with_capacity(n);
            let mut recv_len = 0;
            for (j, p) in pieces.iter().enumerate() {
                let count = prod(p);
                if count > 0 {
                    recvs.push((j, count));
                }
                recv_len += count;
            }
            let p0 = &pieces[0];
            if cd >= p0.len() {
                return Err(format!("concat_dim {cd} out of range for {p0:?}"));
            }
            let (outer_c, inner_c) = around(p0, cd);
            let total_c: usize = pieces.iter().map(|p| p.get(cd).copied().unwrap_or(0)).sum();
            let unpack = (outer_c != 1).then(|| {
                let mut src = 0;
                let mut cum = 0;
                let mut copies = Vec::with_capacity(n);
                for p in &pieces {
                    let w = p[cd] * inner_c;
                    copies.push(Copy2D {
                        src_off: src,
                        src_pitch: w,
                        dst_off: cum * inner_c,
                        dst_pitch: total_c * inner_c,
                        width: w,
                        rows: outer_c,
                    });
                    src += prod(p);
                    cum += p[cd];
                }
                copies
            });
            let mut out_dims = p0.clone();
            out_dims[cd] = total_c;
            let idle = sends.is_empty() && recvs.is_empty();
            Layout {
                prim: Prim::Exchange { sends, recvs },
                pack,
                recv_len,
                unpack,
                out_dims,
                out_dtype: mine.dtype,
                idle,
            }
        }
    };
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::desc::Place;

    fn desc(call: Call, dims: &[usize]) -> Desc {
        Desc { call, dtype: DType::F32, dims: dims.to_vec(), place: Place::Cpu }
    }

    #[test]
    fn copy2d_bounds() {
        let c = Copy2D { src_off: 1, src_pitch: 3, dst_off: 0, dst_pitch: 2, width: 2, rows: 2 };
        let src = [0, 1, 2, 3, 4, 5];
        let mut dst = [9; 4];
        assert!(c.apply(&src, &mut dst));
        assert_eq!(dst, [1, 2, 4, 5]);
        let bad = Copy2D { rows: 3, ..c };
        assert!(!bad.apply(&src, &mut dst));
    }

    #[test]
    fn even_shards_move_without_copies() {
        let call = Call::AllGather { dim: 0 };
        let descs = vec![desc(call.clone(), &[2, 3]); 4];
        let l = plan(&call, &descs, 1).unwrap();
        assert_eq!((l.pack.clone(), l.unpack.clone(), l.recv_len), (None, None, 24));
        assert_eq!(l.out_dims, vec![8, 3]);
        let call = Call::ReduceScatter { dim: 0, op: ReduceOp::Sum };
        let descs = vec![desc(call.clone(), &[8, 3]); 4];
        let l = plan(&call, &descs, 3).unwrap();
        assert_eq!((l.pack, l.unpack, l.recv_len), (None, None, 6));
    }

    #[test]
    fn uneven_gather_pads_to_the_largest_shard() {
        // torch.chunk(5, 4) = 2, 2, 1, 0 along dim 1 of [2, s, 3].
        let call = Call::AllGather { dim: 1 };
        let sizes = [2, 2, 1, 0];
        let descs: Vec<Desc> = sizes.iter().map(|&s| desc(call.clone(), &[2, s, 3])).collect();
        let l = plan(&call, &descs, 2).unwrap();
        assert_eq!(l.recv_len, 4 * 2 * 2 * 3);
        assert_eq!(l.out_dims, vec![2, 5, 3]);
        assert_eq!(l.pack.as_ref().map(|p| p.0), Some(12));
        assert!(!l.idle);
        let l3 = plan(&call, &descs, 3).unwrap();
        assert_eq!(l3.pack.as_ref().map(|p| p.0), Some(12), "an empty shard still sends a block");
        let all_empty: Vec<Desc> = (0..3).map(|_| desc(call.clone(), &[2, 0, 3])).collect();
        assert!(plan(&call, &all_empty, 0).unwrap().idle);
    }
}
