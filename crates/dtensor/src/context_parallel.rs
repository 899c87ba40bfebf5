//! Context parallelism: causal attention over a sequence sharded on a `cp` process group,
//! as PyTorch's `context_parallel` runs it.
//!
//! The sequence is cut into `2 * cp` chunks by the `torch.chunk` rule (uneven and empty
//! chunks allowed) and rank `i` holds chunk `i` followed by its mirror chunk
//! `2 * cp - 1 - i` ([`CpLayout`]): with causal attention the early chunks see few keys
//! and the late ones many, so each rank gets one of each and the same work (PyTorch's
//! round-robin/head-tail load balancer). Without load balance ([`CpLayout::contiguous`])
//! rank `i` holds the `i`-th of `cp` contiguous chunks.
//!
//! [`context_parallel_attention`] takes each rank's `q`, `k`, `v` rows in that layout and
//! returns its rows of causal attention over the whole sequence. Keys and values reach
//! every rank by one of two [`CpMethod`]s:
//! - [`CpMethod::AllGather`]: one `all_gather` of `k` and of `v` on the sequence dim;
//!   backward reduce-scatters `dk`/`dv` (one `reduce_scatter` each).
//! - [`CpMethod::Ring`]: `cp - 1` hops of `send`/`recv` of `k` and `v` to the next rank;
//!   backward passes `k`/`v` around the ring again, each carrying the `dk`/`dv` the ranks
//!   it visited added, and a last hop brings them home (`cp` sends of `dk`/`dv`).
//!
//! Each block of (local queries, one rank's keys) is computed by
//! [`Tensor::sdpa_block_forward`] at the rows' true positions (causal across chunk
//! boundaries, skipping chunks nothing attends), and the partial outputs merge by their
//! log-sum-exps ([`Tensor::sdpa_lse_merge`]). Backward runs
//! [`Tensor::sdpa_block_backward`] per block from the merged output and log-sum-exp.
//! Grouped-query attention (fewer key/value heads) and additive key-padding masks (each
//! rank passes the mask of its own keys; the small masks are all-gathered once) work
//! across chunk boundaries. A key mask gets no gradient.

use tpar_collectives::{chunk_range, ProcessGroup, ReduceOp};
use tpar_tensor::autograd::record;
use tpar_tensor::{no_grad, Tensor};

use crate::{DTensorError, Result};

/// How keys and values reach every rank in [`context_parallel_attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpMethod {
    /// One `all_gather` of `k` and `v`; backward `reduce_scatter`s `dk` and `dv`.
    AllGather,
    /// `k`/`v` passed around the ring by `send`/`recv`, one hop per rank; backward carries
    /// `dk`/`dv` around the ring with them.
    #[default]
    Ring,
}

/// Which rows of a `seq_len` sequence each of `cp` ranks holds: two chunks of `2 * cp`
/// per rank (head `i` and tail `2 * cp - 1 - i`, load-balanced) or one of `cp`
/// contiguous chunks. Chunks follow the `torch.chunk` rule (ceil-sized, possibly empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpLayout {
    seq_len: usize,
    cp: usize,
    balanced: bool,
}

impl CpLayout {
    /// The load-balanced layout of `seq_len` positions over `cp` ranks.
    pub fn new(seq_len: usize, cp: usize) -> Result<CpLayout> {
        CpLayout::make(seq_len, cp, true)
    }

    /// The layout without load balance: rank `i` holds the `i`-th of `cp` contiguous
    /// chunks (with causal attention the last rank does the most work).
    pub fn contiguous(seq_len: usize, cp: usize) -> Result<CpLayout> {
        CpLayout::make(seq_len, cp, false)
    }

    fn make(seq_len: usize, cp: usize, balanced: bool) -> Result<CpLayout> {
        if cp == 0 {
            return Err(invalid("CpLayout", "a context-parallel group has at least one rank"));
        }
        Ok(CpLayout { seq_len, cp, balanced })
    }

    /// The sequence length.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The number of ranks.
    pub fn cp(&self) -> usize {
        self.cp
    }

    /// Whether the layout is load-balanced (head and mirror tail chunks).
    pub fn is_balanced(&self) -> bool {
        self.balanced
    }

    /// The chunk ids rank `rank` holds, in its local order: `[rank, 2 * cp - 1 - rank]` of
    /// `2 * cp` chunks when balanced, `[rank]` of `cp` otherwise.
    pub fn chunk_ids(&self, rank: usize) -> Vec<usize> {
        if self.balanced {
            vec![rank, 2 * self.cp - 1 - rank]
        } else {
            vec![rank]
        }
    }

    /// The number of chunks the sequence is cut into.
    pub fn num_chunks(&self) -> usize {
        if self.balanced {
            2 * self.cp
        } else {
            self.cp
        }
    }

    /// The `(start, len)` position ranges of rank `rank`'s chunks, in its local order.
    pub fn ranges(&self, rank: usize) -> Vec<(usize, usize)> {
        let n = self.num_chunks();
        self.chunk_ids(rank).into_iter().map(|c| chunk_range(self.seq_len, n, c)).collect()
    }

    /// How many rows rank `rank` holds.
    pub fn local_len(&self, rank: usize) -> usize {
        self.ranges(rank).iter().map(|r| r.1).sum()
    }

    /// The positions in the full sequence of rank `rank`'s rows, in its local order.
    pub fn positions(&self, rank: usize) -> Vec<usize> {
        self.ranges(rank).into_iter().flat_map(|(s, l)| s..s + l).collect()
    }

    /// Rank `rank`'s rows of a full tensor `t` along `dim` (differentiable: narrows and a
    /// cat). `t`'s size along `dim` must be the layout's sequence length.
    pub fn shard(&self, t: &Tensor, dim: usize, rank: usize) -> Result<Tensor> {
        const OP: &str = "CpLayout::shard";
        if rank >= self.cp {
            return Err(invalid(OP, format!("rank {rank} of a cp group of {}", self.cp)));
        }
        if dim >= t.rank() || t.dims()[dim] != self.seq_len {
            return Err(invalid(
                OP,
                format!(
                    "tensor of shape {} has no dim {dim} of the sequence length {}",
                    t.shape(),
                    self.seq_len
                ),
            ));
        }
        let parts = self
            .ranges(rank)
            .into_iter()
            .map(|(s, l)| t.narrow(dim as isize, s, l))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Tensor::cat(&parts, dim as isize)?)
    }

    /// The full tensor from every rank's rows along `dim` (an `all_gather` over `group`,
    /// then the chunks put back in sequence order). Not differentiable.
    pub fn unshard(&self, local: &Tensor, dim: usize, group: &ProcessGroup) -> Result<Tensor> {
        const OP: &str = "CpLayout::unshard";
        self.check_group(OP, group)?;
        let me = group.rank();
        self.check_rows(OP, local, dim, me)?;
        let all = group.all_gather(&local.detach(), dim)?;
        let offsets = self.rank_offsets();
        let n = self.num_chunks();
        let mut parts = Vec::with_capacity(n);
        for c in 0..n {
            let (owner, slot) = self.owner(c);
            let ranges = self.ranges(owner);
            let within: usize = ranges[..slot].iter().map(|r| r.1).sum();
            parts.push(all.narrow(dim as isize, offsets[owner] + within, ranges[slot].1)?);
        }
        Ok(no_grad(|| Tensor::cat(&parts, dim as isize))?)
    }

    /// Dropout of rank `rank`'s rows `x` (its chunks end to end along `dim`, as
    /// [`CpLayout::shard`] gives them): each element keeps or drops as the element at its
    /// position in the full sequence would, and the generator moves by the full tensor's
    /// count ([`Tensor::dropout_pieces`]). Called on every cp rank from the same generator
    /// state, the ranks draw between them the unsharded tensor's mask and stay in step,
    /// where a plain [`Tensor::dropout`] on each rank's rows would draw another mask than
    /// the unsharded model's. No communication.
    ///
    /// # Errors
    /// [`DTensorError::InvalidArgument`] for a rank outside the group or a tensor whose
    /// dim `dim` is not the rank's row count, and dropout's own errors.
    pub fn dropout(
        &self,
        x: &Tensor,
        dim: usize,
        rank: usize,
        p: f64,
        training: bool,
    ) -> Result<Tensor> {
        const OP: &str = "CpLayout::dropout";
        if rank >= self.cp {
            return Err(invalid(OP, format!("rank {rank} of a cp group of {}", self.cp)));
        }
        self.check_rows(OP, x, dim, rank)?;
        let mut global = x.dims().to_vec();
        global[dim] = self.seq_len;
        let pieces: Vec<(Vec<usize>, usize)> = self
            .ranges(rank)
            .into_iter()
            .map(|(start, len)| {
                let mut offset = vec![0; x.rank()];
                offset[dim] = start;
                (offset, len)
            })
            .collect();
        Ok(x.dropout_pieces(p, training, &global, dim, &pieces)?)
    }

    /// The rank holding chunk `c` and its slot in that rank's local order.
    fn owner(&self, c: usize) -> (usize, usize) {
        if !self.balanced || c < self.cp {
            (c, 0)
        } else {
            (2 * self.cp - 1 - c, 1)
        }
    }

    /// Where each rank's rows start in a rank-ordered concatenation of all ranks' rows.
    fn rank_offsets(&self) -> Vec<usize> {
        let mut off = Vec::with_capacity(self.cp);
        let mut acc = 0;
        for r in 0..self.cp {
            off.push(acc);
            acc += self.local_len(r);
        }
        off
    }

    /// That `x` holds rank `rank`'s rows along `dim`.
    fn check_rows(&self, op: &'static str, x: &Tensor, dim: usize, rank: usize) -> Result<()> {
        if dim >= x.rank() || x.dims()[dim] != self.local_len(rank) {
            return Err(invalid(
                op,
                format!(
                    "rank {rank}'s tensor of shape {} has no dim {dim} of its {} rows",
                    x.shape(),
                    self.local_len(rank)
                ),
            ));
        }
        Ok(())
    }

    fn check_group(&self, op: &'static str, group: &ProcessGroup) -> Result<()> {
        if group.size() != self.cp {
            return Err(invalid(
                op,
                format!("a layout over {} ranks used on a group of {}", self.cp, group.size()),
            ));
        }
        Ok(())
    }
}

/// A deliberately wrong variant of context-parallel attention, for tests that show a
/// bug of that kind is caught. Not for use.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpFault {
    /// The log-sum-exp merge weighs each partial output by the other's log-sum-exp.
    SwapMergeTerms,
}

/// Context-parallel attention settings: the cp group, the layout, the exchange method and
/// the softmax scale.
#[derive(Debug, Clone)]
pub struct ContextParallel {
    group: ProcessGroup,
    layout: CpLayout,
    method: CpMethod,
    scale: Option<f64>,
    fault: Option<CpFault>,
}

impl ContextParallel {
    /// Attention over `group` (the cp axis) for sequences laid out as `layout`, exchanging
    /// keys and values by `method`. The scale defaults to `1/sqrt(head_dim)`.
    pub fn new(group: &ProcessGroup, layout: CpLayout, method: CpMethod) -> Result<Self> {
        layout.check_group("ContextParallel::new", group)?;
        Ok(ContextParallel { group: group.clone(), layout, method, scale: None, fault: None })
    }

    /// The same settings with the softmax scale `scale`.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Plants a deliberate bug (tests only).
    #[doc(hidden)]
    pub fn with_fault(mut self, fault: CpFault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// The layout.
    pub fn layout(&self) -> &CpLayout {
        &self.layout
    }

    /// The exchange method.
    pub fn method(&self) -> CpMethod {
        self.method
    }

    /// The cp group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// [`CpLayout::dropout`] of this rank's rows `x` along `dim` (the sequence dim).
    ///
    /// # Errors
    /// As [`CpLayout::dropout`].
    pub fn dropout(&self, x: &Tensor, dim: usize, p: f64, training: bool) -> Result<Tensor> {
        self.layout.dropout(x, dim, self.group.rank(), p, training)
    }
}

fn invalid(op: &'static str, what: impl Into<String>) -> DTensorError {
    DTensorError::InvalidArgument { op, what: what.into() }
}

/// Rows of a local tensor that a block touches: a contiguous local range and the
/// positions of its rows.
#[derive(Debug, Clone)]
struct Rows {
    start: usize,
    len: usize,
    pos: Vec<usize>,
}

/// The local rows of `ranges` (a rank's chunks in local order) kept by `keep`, as one
/// contiguous local range (empty chunks are dropped; the kept chunks of a head/tail pair
/// are always adjacent).
fn kept_rows(ranges: &[(usize, usize)], keep: impl Fn(usize, usize) -> bool) -> Rows {
    let mut local = 0;
    let (mut start, mut end) = (None, 0);
    let mut pos = Vec::new();
    for &(s, l) in ranges {
        if l > 0 && keep(s, l) {
            start.get_or_insert(local);
            end = local + l;
            pos.extend(s..s + l);
        }
        local += l;
    }
    let start = start.unwrap_or(0);
    Rows { start, len: end.saturating_sub(start), pos }
}

/// The query rows and key rows of a block (local queries of `me` against the keys of
/// `src`) that can see anything: key chunks after every query are dropped, then query
/// chunks before every kept key.
fn block_rows(layout: &CpLayout, me: usize, src: usize) -> (Rows, Rows) {
    let (qr, kr) = (layout.ranges(me), layout.ranges(src));
    let q_max = qr.iter().filter(|r| r.1 > 0).map(|r| r.0 + r.1 - 1).max();
    let kv = kept_rows(&kr, |s, _| q_max.is_some_and(|m| s <= m));
    let k_min = kv.pos.iter().min().copied();
    let q = kept_rows(&qr, |s, l| k_min.is_some_and(|m| s + l > m));
    (q, kv)
}

/// `t`'s rows `r` along dim 2 (the whole tensor when they are all of it).
fn rows_of(t: &Tensor, r: &Rows) -> Result<Tensor> {
    if r.start == 0 && r.len == t.dims()[2] {
        Ok(t.clone())
    } else {
        Ok(t.narrow(2, r.start, r.len)?)
    }
}

/// `g` (rows `r` of a dim-2 length `total`) added into `acc` at those rows.
fn add_rows(acc: &Tensor, g: &Tensor, r: &Rows) -> Result<Tensor> {
    let total = acc.dims()[2];
    if r.start == 0 && r.len == total {
        return Ok(acc.add(g)?);
    }
    let mut parts = Vec::with_capacity(3);
    if r.start > 0 {
        parts.push(acc.narrow(2, 0, r.start)?);
    }
    parts.push(acc.narrow(2, r.start, r.len)?.add(g)?);
    if r.start + r.len < total {
        parts.push(acc.narrow(2, r.start + r.len, total - r.start - r.len)?);
    }
    Ok(Tensor::cat(&parts, 2)?)
}

/// `acc`'s rows `r` replaced by `new` (dim 2).
fn set_rows(acc: &Tensor, new: &Tensor, r: &Rows) -> Result<Tensor> {
    let total = acc.dims()[2];
    if r.start == 0 && r.len == total {
        return Ok(new.clone());
    }
    let mut parts = Vec::with_capacity(3);
    if r.start > 0 {
        parts.push(acc.narrow(2, 0, r.start)?);
    }
    parts.push(new.clone());
    if r.start + r.len < total {
        parts.push(acc.narrow(2, r.start + r.len, total - r.start - r.len)?);
    }
    Ok(Tensor::cat(&parts, 2)?)
}

/// What every block of one rank's attention shares.
struct Ctx {
    cp: ContextParallel,
    me: usize,
    /// All ranks' key masks `[b, sum of local lens]` in rank order, and each rank's offset.
    masks: Option<(Tensor, Vec<usize>)>,
}

impl Ctx {
    /// Source rank `src`'s key mask restricted to rows `r`, as `[b, 1, 1, len]`.
    fn mask(&self, src: usize, r: &Rows) -> Result<Option<Tensor>> {
        let Some((all, off)) = &self.masks else { return Ok(None) };
        let m = all.narrow(1, off[src] + r.start, r.len)?;
        let b = m.dims()[0];
        Ok(Some(m.reshape([b, 1, 1, r.len])?))
    }

    /// The order in which ranks' keys are visited: this rank's first, then the ring's
    /// (the previous rank's, and so on).
    fn source(&self, hop: usize) -> usize {
        let n = self.cp.layout.cp;
        (self.me + n - hop) % n
    }
}

/// Forward of one block: merges (local queries of `me` x keys `k`, `v` of `src`) into
/// the running `(out, lse)`.
fn forward_block(
    ctx: &Ctx,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    src: usize,
    acc: (Tensor, Tensor),
) -> Result<(Tensor, Tensor)> {
    let (qr, kr) = block_rows(&ctx.cp.layout, ctx.me, src);
    if qr.len == 0 || kr.len == 0 {
        return Ok(acc);
    }
    let mask = ctx.mask(src, &kr)?;
    let (o, l) = Tensor::sdpa_block_forward(
        &rows_of(q, &qr)?,
        &rows_of(k, &kr)?,
        &rows_of(v, &kr)?,
        &qr.pos,
        &kr.pos,
        mask.as_ref(),
        ctx.cp.scale,
    )?;
    let (ao, al) = (rows_of(&acc.0, &qr)?, rows_of(&acc.1, &qr)?);
    let (mo, ml) = match ctx.cp.fault {
        Some(CpFault::SwapMergeTerms) => Tensor::sdpa_lse_merge(&ao, &l, &o, &al)?,
        None => Tensor::sdpa_lse_merge(&ao, &al, &o, &l)?,
    };
    Ok((set_rows(&acc.0, &mo, &qr)?, set_rows(&acc.1, &ml, &qr)?))
}

/// Saved forward state for the backward of one rank.
struct Saved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
}

/// Backward of one block: `(dq over the block's query rows added into dq, dk and dv of
/// the source's keys as full local-length tensors)`.
fn backward_block(
    ctx: &Ctx,
    s: &Saved,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    src: usize,
    dq: &Tensor,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let (qr, kr) = block_rows(&ctx.cp.layout, ctx.me, src);
    if qr.len == 0 || kr.len == 0 {
        return Ok(None);
    }
    let mask = ctx.mask(src, &kr)?;
    let (gq, gk, gv) = Tensor::sdpa_block_backward(
        &rows_of(&s.q, &qr)?,
        &rows_of(k, &kr)?,
        &rows_of(v, &kr)?,
        &qr.pos,
        &kr.pos,
        mask.as_ref(),
        ctx.cp.scale,
        &rows_of(&s.out, &qr)?,
        &rows_of(&s.lse, &qr)?,
        &rows_of(dout, &qr)?,
    )?;
    let dq = add_rows(dq, &gq, &qr)?;
    let zk = Tensor::zeros(k.shape().clone(), k.dtype(), k.device())?;
    let zv = Tensor::zeros(v.shape().clone(), v.dtype(), v.device())?;
    Ok(Some((dq, add_rows(&zk, &gk, &kr)?, add_rows(&zv, &gv, &kr)?)))
}

/// The forward over all ranks' keys: `(out, lse)` of the local queries.
fn forward(ctx: &Ctx, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    let d = q.dims();
    let (b, hq, sq, dv) = (d[0], d[1], d[2], v.dims()[3]);
    let mut acc = (
        Tensor::zeros([b, hq, sq, dv], q.dtype(), q.device())?,
        Tensor::full(
            [b, hq, sq],
            f64::NEG_INFINITY,
            tpar_tensor::DType::F64,
            tpar_tensor::Device::Cpu,
        )?,
    );
    let n = ctx.cp.layout.cp;
    let g = &ctx.cp.group;
    match ctx.cp.method {
        CpMethod::AllGather => {
            let (ka, va) = if n > 1 {
                (g.all_gather(k, 2)?, g.all_gather(v, 2)?)
            } else {
                (k.clone(), v.clone())
            };
            let off = ctx.cp.layout.rank_offsets();
            for hop in 0..n {
                let src = ctx.source(hop);
                let len = ctx.cp.layout.local_len(src);
                let (ks, vs) = (ka.narrow(2, off[src], len)?, va.narrow(2, off[src], len)?);
                acc = forward_block(ctx, q, &ks, &vs, src, acc)?;
            }
        }
        CpMethod::Ring => {
            let (next, prev) = ((ctx.me + 1) % n, (ctx.me + n - 1) % n);
            let (mut kc, mut vc) = (k.clone(), v.clone());
            for hop in 0..n {
                // Queue this hop's keys to the next rank before computing on them.
                if hop + 1 < n {
                    g.send(&kc, next)?;
                    g.send(&vc, next)?;
                }
                acc = forward_block(ctx, q, &kc, &vc, ctx.source(hop), acc)?;
                if hop + 1 < n {
                    kc = g.recv(prev)?;
                    vc = g.recv(prev)?;
                }
            }
        }
    }
    Ok(acc)
}

/// The backward: `(dq, dk, dv)` of this rank's rows.
fn backward(ctx: &Ctx, s: &Saved, dout: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let n = ctx.cp.layout.cp;
    let g = &ctx.cp.group;
    let mut dq = Tensor::zeros(s.q.shape().clone(), s.q.dtype(), s.q.device())?;
    match ctx.cp.method {
        CpMethod::AllGather => {
            let (ka, va) = if n > 1 {
                (g.all_gather(&s.k, 2)?, g.all_gather(&s.v, 2)?)
            } else {
                (s.k.clone(), s.v.clone())
            };
            let off = ctx.cp.layout.rank_offsets();
            let width = (0..n).map(|r| ctx.cp.layout.local_len(r)).max().unwrap_or(0);
            let mut dks = vec![None; n];
            let mut dvs = vec![None; n];
            for hop in 0..n {
                let src = ctx.source(hop);
                let len = ctx.cp.layout.local_len(src);
                let (ks, vs) = (ka.narrow(2, off[src], len)?, va.narrow(2, off[src], len)?);
                let (gk, gv) = match backward_block(ctx, s, &ks, &vs, dout, src, &dq)? {
                    Some((q2, gk, gv)) => {
                        dq = q2;
                        (gk, gv)
                    }
                    None => (
                        Tensor::zeros(ks.shape().clone(), ks.dtype(), ks.device())?,
                        Tensor::zeros(vs.shape().clone(), vs.dtype(), vs.device())?,
                    ),
                };
                dks[src] = Some(pad_rows(&gk, width)?);
                dvs[src] = Some(pad_rows(&gv, width)?);
            }
            let mine = ctx.cp.layout.local_len(ctx.me);
            let scatter = |parts: Vec<Option<Tensor>>| -> Result<Tensor> {
                let parts: Vec<Tensor> = parts.into_iter().flatten().collect();
                let all = Tensor::cat(&parts, 2)?;
                let red = if n > 1 { g.reduce_scatter(&all, 2, ReduceOp::Sum)? } else { all };
                Ok(red.narrow(2, 0, mine)?)
            };
            Ok((dq, scatter(dks)?, scatter(dvs)?))
        }
        CpMethod::Ring => {
            let (next, prev) = ((ctx.me + 1) % n, (ctx.me + n - 1) % n);
            let (mut kc, mut vc) = (s.k.clone(), s.v.clone());
            let mut dk = Tensor::zeros(s.k.shape().clone(), s.k.dtype(), s.k.device())?;
            let mut dv = Tensor::zeros(s.v.shape().clone(), s.v.dtype(), s.v.device())?;
            for hop in 0..n {
                if hop + 1 < n {
                    g.send(&kc, next)?;
                    g.send(&vc, next)?;
                }
                if let Some((q2, gk, gv)) =
                    backward_block(ctx, s, &kc, &vc, dout, ctx.source(hop), &dq)?
                {
                    dq = q2;
                    dk = dk.add(&gk)?;
                    dv = dv.add(&gv)?;
                }
                // The dk/dv of the keys held now travel on with them; the last hop brings
                // every rank's own dk/dv home.
                if n > 1 {
                    g.send(&dk, next)?;
                    g.send(&dv, next)?;
                }
                if hop + 1 < n {
                    kc = g.recv(prev)?;
                    vc = g.recv(prev)?;
                }
                if n > 1 {
                    dk = g.recv(prev)?;
                    dv = g.recv(prev)?;
                }
            }
            Ok((dq, dk, dv))
        }
    }
}

/// `t` padded with zero rows (dim 2) to `width` rows.
fn pad_rows(t: &Tensor, width: usize) -> Result<Tensor> {
    let have = t.dims()[2];
    if have == width {
        return Ok(t.clone());
    }
    let mut d = t.dims().to_vec();
    d[2] = width - have;
    let z = Tensor::zeros(d, t.dtype(), t.device())?;
    Ok(Tensor::cat(&[t.clone(), z], 2)?)
}

/// Causal attention of this rank's queries over the whole context-parallel sequence.
///
/// `q` `[b, hq, s_local, d]`, `k` `[b, hkv, s_local, d]`, `v` `[b, hkv, s_local, dv]` hold
/// this rank's rows in `cp`'s layout (`s_local = cp.layout().local_len(rank)`; `hq` a
/// multiple of `hkv`). `key_mask` is an optional additive mask of this rank's keys
/// (`[b, s_local]` or `[b, 1, 1, s_local]`, 0 for a token and `-inf` for padding, in q's
/// dtype). Returns this rank's rows of `softmax(scale q kᵀ + causal + key mask) v`
/// (`[b, hq, s_local, dv]`), equal to the unsharded causal attention's rows at the same
/// positions; a query row with no visible key gets zeros.
///
/// Differentiable in `q`, `k` and `v`. Collectives over `cp`'s group, forward: two
/// `all_gather`s ([`CpMethod::AllGather`]) or `2 (cp - 1)` sends and receives per rank
/// ([`CpMethod::Ring`]), plus one `all_gather` of the key mask when one is given;
/// backward: the same exchange of `k`/`v` again, then two `reduce_scatter`s (all-gather)
/// or `2 cp` more sends and receives (ring).
pub fn context_parallel_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_mask: Option<&Tensor>,
    cp: &ContextParallel,
) -> Result<Tensor> {
    const OP: &str = "context_parallel_attention";
    let me = cp.group.rank();
    let local = cp.layout.local_len(me);
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 || t.dims()[2] != local {
            return Err(invalid(
                OP,
                format!(
                    "{name} of shape {} on cp rank {me}: expected [batch, heads, {local}, \
                     head_dim] (this rank's rows of a sequence of {} over {} ranks)",
                    t.shape(),
                    cp.layout.seq_len,
                    cp.layout.cp
                ),
            ));
        }
    }
    let masks = match key_mask {
        None => None,
        Some(m) => {
            let b = q.dims()[0];
            let ok = matches!(m.dims(), [mb, ml] | [mb, 1, 1, ml] if *mb == b && *ml == local);
            if !ok {
                return Err(invalid(
                    OP,
                    format!(
                        "key mask of shape {} on cp rank {me}: expected [{b}, {local}] or \
                         [{b}, 1, 1, {local}]",
                        m.shape()
                    ),
                ));
            }
            let m2 = m.detach().reshape([b, local])?;
            let all = if cp.layout.cp > 1 { cp.group.all_gather(&m2, 1)? } else { m2 };
            Some((all, cp.layout.rank_offsets()))
        }
    };
    let ctx = Ctx { cp: cp.clone(), me, masks };
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let (out, lse) = no_grad(|| forward(&ctx, &qd, &kd, &vd))?;
    let saved = Saved { q: qd, k: kd, v: vd, out: out.detach(), lse };
    Ok(record(OP, &[q, k, v], out, move |g| {
        let (dq, dk, dv) = no_grad(|| backward(&ctx, &saved, g))?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }))
}
