//! The multi-process backends' collectives over an abstract [`Transport`] of flat host
//! buffers: header exchange and agreement checks, then the planned primitive, packing and
//! unpacking.
//!
//! The NCCL transport (`nccl/device.rs`) copies each buffer to the group's GPU, runs the
//! NCCL primitive on the group's stream and copies the result back; the TCP transport
//! (`tcp/transport.rs`) moves the buffers between processes over sockets and reduces on
//! the CPU. The unit tests below run the same code over an in-process transport.

use std::time::{Duration, Instant};

use tpar_tensor::{Device, Element, Tensor};

use super::plan::{gather_copies, plan, Layout, Prim};
use super::wire::{decode, encode, Header, HEADER_LEN, MAX_DIMS};
use crate::local::desc::{validate, Call, Desc, Place};
use crate::local::kernels::Reducible;
use crate::p2p::{check_arrival, Expect, Mail};
use crate::{CollectiveError, Result};

/// When a call must be over.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    /// The instant (`None`: never).
    pub at: Option<Instant>,
    /// The timeout that set it (for messages).
    pub timeout: Duration,
}

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        Deadline { at: Instant::now().checked_add(timeout), timeout }
    }

    /// Whether it has passed.
    pub fn passed(&self) -> bool {
        self.at.is_some_and(|at| Instant::now() >= at)
    }
}

/// Element types every transport handles (the host buffers, the CPU reduction kernels):
/// the tensor dtypes. A transport that needs more of an element type (NCCL's datatypes,
/// device copies) dispatches on its [`DType`](tpar_tensor::DType) (`Element::DTYPE`).
pub(crate) trait Wire: Element + Reducible + bytemuck::Pod {}

impl<T> Wire for T where T: Element + Reducible + bytemuck::Pod {}

/// A collective on device memory that a transport's device path enqueues (NCCL's, see
/// `nccl::ondevice`), and the completion it answers with. The worker and the group handle
/// carry it without looking inside; a transport without a device path takes
/// [`NoDevice`].
pub(crate) trait DeviceWork: Send + 'static {
    /// What comes back once the work is enqueued (a completion event).
    type Done: Send + Sync + 'static;
    /// The collective's name, for errors.
    fn op(&self) -> &'static str;
}

/// The device work of a transport without a device path: there is none.
pub(crate) enum NoDevice {}

impl DeviceWork for NoDevice {
    type Done = NoDevice;
    fn op(&self) -> &'static str {
        match *self {}
    }
}

/// Runs the primitives of [`Prim`] among the members of one group.
pub(crate) trait Transport {
    /// The work of this transport's device path ([`NoDevice`] where it has none).
    type DeviceJob: DeviceWork;
    /// Number of members.
    fn size(&self) -> usize;
    /// This member's group rank.
    fn rank(&self) -> usize;
    /// The members' global ranks.
    fn group(&self) -> &[usize];
    /// Runs `prim`, reading `send` and returning the `recv_len` elements received. Fails
    /// with `Timeout` (naming the awaited peers where the transport can tell, nobody
    /// otherwise) when the deadline passes, `PeerFailed` when a peer is known to be gone,
    /// or `Backend` when the transport itself fails. A `Recv` returns what was sent, which
    /// may be another count than `recv_len` where the transport can tell.
    fn run<T: Wire>(
        &mut self,
        op: &'static str,
        prim: &Prim,
        send: &[T],
        recv_len: usize,
        deadline: Deadline,
    ) -> Result<Vec<T>>;
    /// Gives up the transport after a fatal error (NCCL: `ncclCommAbort`); later calls
    /// fail. Does nothing by default.
    fn abort(&mut self) {}
    /// Enqueues a collective on device memory (see [`DeviceWork`]) and returns its
    /// completion without waiting for it. A transport without a device path fails.
    fn run_device(
        &mut self,
        seq: u64,
        job: Self::DeviceJob,
        deadline: Deadline,
    ) -> Result<std::sync::Arc<<Self::DeviceJob as DeviceWork>::Done>> {
        let _ = (seq, deadline);
        Err(internal(job.op(), "this backend has no device path"))
    }
    /// Whether device collectives are still in flight (the worker then polls).
    fn device_in_flight(&self) -> bool {
        false
    }
    /// Forgets the finished device collectives; the first one found past its deadline
    /// (or failed) comes back as the group's error with its sequence number and timeout.
    fn poll_device(&mut self) -> Option<(CollectiveError, u64, Duration)> {
        None
    }
}

fn internal(op: &'static str, what: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::InvalidArgument { op, why: format!("internal error: {what}") }
}

/// Runs one collective: exchanges headers, checks that every member called the same thing
/// with valid arguments (else every member fails alike, and nobody touches data), then
/// moves the data. `problem` is this member's own argument error, found before the call.
pub(crate) fn collective<X: Transport>(
    x: &mut X,
    seq: u64,
    call: Call,
    tensor: Option<Tensor>,
    problem: Option<CollectiveError>,
    deadline: Deadline,
) -> Result<Option<Tensor>> {
    let op = call.name();
    let n = x.size();
    let me = x.rank();
    let group = x.group().to_vec();
    // A broadcast's non-source placeholder is never read: its shape is not announced.
    let read = match &call {
        Call::Broadcast { src } if *src != me => None,
        _ => tensor.as_ref(),
    };
    let desc = Desc::new(call.clone(), read);
    let problem = problem.or_else(|| {
        (desc.dims.len() > MAX_DIMS).then(|| CollectiveError::InvalidArgument {
            op,
            why: format!(
                "process groups across processes carry tensors of at most {MAX_DIMS} dims, got shape {:?}",
                desc.dims
            ),
        })
    });

    // 1. Every member says what it called (a fixed-size all_gather, whatever it called).
    let mine = encode(seq, &desc, false, problem.is_some());
    let all = x.run::<i64>(op, &Prim::AllGather, &mine, n * HEADER_LEN, deadline)?;
    let headers = all
        .chunks(HEADER_LEN)
        .map(decode)
        .collect::<std::result::Result<Vec<Header>, String>>()
        .map_err(|e| internal(op, format!("malformed header from a peer: {e}")))?;
    if headers.len() != n {
        return Err(internal(op, format!("{} headers for {n} members", headers.len())));
    }
    if let Some(e) = problem {
        return Err(e);
    }
    if let Some(i) = headers.iter().position(|h| h.problem) {
        return Err(CollectiveError::InvalidArgument {
            op,
            why: format!(
                "rank {} passed invalid arguments (its own error names them)",
                group.get(i).copied().unwrap_or(i)
            ),
        });
    }
    if let Some(i) = headers.iter().position(|h| h.p2p) {
        return Err(internal(op, format!("member {i} sent a point-to-point header")));
    }

    // 2. Split sizes of a sized all_to_all, when every member has them.
    let mut descs: Vec<Desc> = headers.iter().map(|h| h.desc.clone()).collect();
    if headers.iter().all(|h| h.has_sizes) {
        let my_sizes: Vec<i64> = match &call {
            Call::AllToAll { sizes: Some(s), .. } if s.len() == n => {
                s.iter().map(|&v| v as i64).collect()
            }
            _ => return Err(internal(op, "split sizes announced but missing")),
        };
        let all = x.run::<i64>(op, &Prim::AllGather, &my_sizes, n * n, deadline)?;
        for (d, sizes) in descs.iter_mut().zip(all.chunks(n)) {
            if let Call::AllToAll { sizes: s, .. } = &mut d.call {
                *s = Some(sizes.iter().map(|&v| v.max(0) as usize).collect());
            }
        }
    }

    // 3. The same verdict on every member.
    let refs: Vec<&Desc> = descs.iter().collect();
    validate(&group, &refs)?;
    if let Some(j) = headers.iter().position(|h| h.seq != headers[me].seq) {
        return Err(CollectiveError::Mismatch {
            op,
            group: group.clone(),
            rank: group.get(j).copied().unwrap_or(j),
            expected: format!("{} as call #{} on this group", descs[me], headers[me].seq),
            got: format!("{} as call #{}", descs[j], headers[j].seq),
        });
    }

    // 4. The data.
    if matches!(call, Call::Barrier) {
        return Ok(None);
    }
    let meta = match &call {
        Call::Broadcast { src } => descs.get(*src).is_some_and(|d| d.place == Place::Meta),
        _ => descs.iter().any(|d| d.place == Place::Meta),
    };
    let layout = plan(&call, &descs, me).map_err(|e| internal(op, e))?;
    if meta {
        return Ok(Some(Tensor::empty(layout.out_dims, layout.out_dtype, Device::Meta)?));
    }
    let input = match &call {
        Call::Broadcast { src } if *src != me => None,
        _ => Some(tensor.ok_or_else(|| internal(op, "no input tensor"))?),
    };
    let out = tpar_tensor::with_any_type!(layout.out_dtype, |T| {
        move_data::<T, X>(x, op, &layout, input.as_ref(), deadline)?
    });
    Ok(Some(out))
}

/// Packs, runs the primitive, unpacks.
fn move_data<T: Wire, X: Transport>(
    x: &mut X,
    op: &'static str,
    layout: &Layout,
    input: Option<&Tensor>,
    deadline: Deadline,
) -> Result<Tensor> {
    if layout.idle {
        return Ok(Tensor::zeros(layout.out_dims.clone(), layout.out_dtype, Device::Cpu)?);
    }
    let recv = match (input, &layout.pack) {
        (None, _) => x.run::<T>(op, &layout.prim, &[], layout.recv_len, deadline)?,
        (Some(t), None) => {
            t.with_data::<T, _>(|s| x.run::<T>(op, &layout.prim, s, layout.recv_len, deadline))??
        }
        (Some(t), Some((len, copies))) => {
            let packed = t
                .with_data::<T, _>(|s| gather_copies(s, *len, copies))?
                .ok_or_else(|| internal(op, "packing copy out of bounds"))?;
            x.run::<T>(op, &layout.prim, &packed, layout.recv_len, deadline)?
        }
    };
    if recv.len() != layout.recv_len {
        return Err(internal(
            op,
            format!("{} elements came back, expected {}", recv.len(), layout.recv_len),
        ));
    }
    let numel: usize = layout.out_dims.iter().product();
    let out = match &layout.unpack {
        None => recv,
        Some(copies) => gather_copies(&recv, numel, copies)
            .ok_or_else(|| internal(op, "unpacking copy out of bounds"))?,
    };
    Ok(Tensor::from_vec(out, layout.out_dims.clone())?)
}

/// Sends `t` to group rank `dst`: a payload header, then the data (none for empty and
/// meta tensors).
pub(crate) fn send<X: Transport>(
    x: &mut X,
    t: &Tensor,
    dst: usize,
    deadline: Deadline,
) -> Result<()> {
    let op = "send";
    let desc = Desc::new(Call::Barrier, Some(t));
    if desc.dims.len() > MAX_DIMS {
        return Err(CollectiveError::InvalidArgument {
            op,
            why: format!(
                "process groups across processes carry tensors of at most {MAX_DIMS} dims"
            ),
        });
    }
    let header = encode(0, &desc, true, false);
    let prim = Prim::Send { peer: dst };
    x.run::<i64>(op, &prim, &header, 0, deadline)?;
    if desc.place == Place::Meta || t.numel() == 0 {
        return Ok(());
    }
    tpar_tensor::with_any_type!(t.dtype(), |T| {
        t.with_data::<T, _>(|s| x.run::<T>(op, &prim, s, 0, deadline))??;
    });
    Ok(())
}

/// Receives the next tensor group rank `src` sent.
pub(crate) fn recv<X: Transport>(x: &mut X, src: usize, deadline: Deadline) -> Result<Tensor> {
    let op = "recv";
    let prim = Prim::Recv { peer: src };
    let raw = x.run::<i64>(op, &prim, &[], HEADER_LEN, deadline)?;
    let h = decode(&raw).map_err(|e| internal(op, format!("malformed header: {e}")))?;
    if !h.p2p {
        return Err(internal(op, "expected a send header"));
    }
    let Desc { dtype, dims, place, .. } = h.desc;
    if place == Place::Meta {
        return Ok(Tensor::empty(dims, dtype, Device::Meta)?);
    }
    let numel: usize = dims.iter().product();
    if numel == 0 {
        return Ok(Tensor::zeros(dims, dtype, Device::Cpu)?);
    }
    Ok(tpar_tensor::with_any_type!(dtype, |T| {
        let data = x.run::<T>(op, &prim, &[], numel, deadline)?;
        Tensor::from_vec(data, dims)?
    }))
}

/// Sends `t`'s data alone to group rank `dst`, which receives it with [`recv_shaped`]
/// (nothing moves for empty and meta tensors).
pub(crate) fn send_shaped<X: Transport>(
    x: &mut X,
    t: &Tensor,
    dst: usize,
    deadline: Deadline,
) -> Result<()> {
    let op = "send_shaped";
    if t.device() == Device::Meta || t.numel() == 0 {
        return Ok(());
    }
    let prim = Prim::Send { peer: dst };
    tpar_tensor::with_any_type!(t.dtype(), |T| {
        t.with_data::<T, _>(|s| x.run::<T>(op, &prim, s, 0, deadline))??;
    });
    Ok(())
}

/// Receives the next [`send_shaped`] payload from group rank `src` into a tensor of the
/// expected shape and dtype (nothing moves for empty tensors and meta expectations).
///
/// NCCL itself does not compare counts; a transport that hands back what was actually
/// sent (the in-process one of the tests) lets a count mismatch fail here with
/// [`CollectiveError::Mismatch`].
pub(crate) fn recv_shaped<X: Transport>(
    x: &mut X,
    src: usize,
    expect: &Expect,
    deadline: Deadline,
) -> Result<Tensor> {
    let op = "recv_shaped";
    let dims = expect.dims.clone();
    if expect.meta {
        return Ok(Tensor::empty(dims, expect.dtype, Device::Meta)?);
    }
    let numel = expect.numel();
    if numel == 0 {
        return Ok(Tensor::zeros(dims, expect.dtype, Device::Cpu)?);
    }
    let prim = Prim::Recv { peer: src };
    Ok(tpar_tensor::with_any_type!(expect.dtype, |T| {
        let data = x.run::<T>(op, &prim, &[], numel, deadline)?;
        if data.len() != numel {
            return Err(count_mismatch(x, src, expect, data.len()));
        }
        Tensor::from_vec(data, dims)?
    }))
}

/// A `recv_shaped` that got `got` elements from `src` where it expected another count.
fn count_mismatch<X: Transport>(x: &X, src: usize, expect: &Expect, got: usize) -> CollectiveError {
    let group = x.group();
    let global = |m: usize| group.get(m).copied().unwrap_or(m);
    let me = global(x.rank());
    CollectiveError::Mismatch {
        op: "recv_shaped",
        group: group.to_vec(),
        rank: global(src),
        expected: format!(
            "{} elements: {} (what recv_shaped on rank {me} expects)",
            expect.numel(),
            expect.describe()
        ),
        got: format!("{got} elements through send_shaped to rank {me}"),
    }
}

/// Delivers a message this member sent to itself, to its `recv` (`expect` is `None`) or
/// `recv_shaped`: checks that the pair matches (as the local backend does, the tensor
/// being at hand), then moves the data through the device with [`loopback`] (header and
/// payload) or [`loopback_data`] (payload alone).
pub(crate) fn to_self<X: Transport>(
    x: &mut X,
    mail: &Mail,
    expect: Option<&Expect>,
    deadline: Deadline,
) -> Result<Tensor> {
    let op = if expect.is_some() { "recv_shaped" } else { "recv" };
    let me = x.rank();
    check_arrival(op, x.group(), me, me, mail, expect)?;
    match expect {
        None => loopback(x, &mail.tensor, deadline),
        Some(_) => loopback_data(x, op, &mail.tensor, deadline),
    }
}

/// The device round trip of a tensor's data alone, from this member to itself.
fn loopback_data<X: Transport>(
    x: &mut X,
    op: &'static str,
    t: &Tensor,
    deadline: Deadline,
) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    if t.device() == Device::Meta {
        return Ok(Tensor::empty(dims, t.dtype(), Device::Meta)?);
    }
    let numel = t.numel();
    if numel == 0 {
        return Ok(Tensor::zeros(dims, t.dtype(), Device::Cpu)?);
    }
    let me = x.rank();
    let prim = Prim::Exchange { sends: vec![(me, 0, numel)], recvs: vec![(me, numel)] };
    Ok(tpar_tensor::with_any_type!(t.dtype(), |T| {
        let data = t.with_data::<T, _>(|s| x.run::<T>(op, &prim, s, numel, deadline))??;
        Tensor::from_vec(data, dims)?
    }))
}

/// Delivers a tensor this member sent to itself: header and payload make the device
/// round trip of a self `Exchange` (the path of `all_to_all`'s own piece), no NCCL
/// send/receive pair being possible on one worker that runs jobs in order.
pub(crate) fn loopback<X: Transport>(x: &mut X, t: &Tensor, deadline: Deadline) -> Result<Tensor> {
    let op = "recv";
    let me = x.rank();
    let to_self = |len: usize| Prim::Exchange { sends: vec![(me, 0, len)], recvs: vec![(me, len)] };
    let desc = Desc::new(Call::Barrier, Some(t));
    let header = encode(0, &desc, true, false);
    let raw = x.run::<i64>(op, &to_self(HEADER_LEN), &header, HEADER_LEN, deadline)?;
    let h = decode(&raw).map_err(|e| internal(op, format!("malformed header: {e}")))?;
    let Desc { dtype, dims, place, .. } = h.desc;
    if place == Place::Meta {
        return Ok(Tensor::empty(dims, dtype, Device::Meta)?);
    }
    let numel: usize = dims.iter().product();
    if numel == 0 {
        return Ok(Tensor::zeros(dims, dtype, Device::Cpu)?);
    }
    Ok(tpar_tensor::with_any_type!(dtype, |T| {
        let data =
            t.with_data::<T, _>(|s| x.run::<T>(op, &to_self(numel), s, numel, deadline))??;
        Tensor::from_vec(data, dims)?
    }))
}

#[cfg(test)]
mod tests {
    //! The executor over an in-process transport, against the local backend.

    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Condvar, Mutex};

    use tpar_tensor::{DType, Rng, Tensor};

    use super::*;
    use crate::{spawn, ReduceOp};

    #[derive(Default)]
    struct BusState {
        rounds: HashMap<u64, Vec<Option<Vec<f64>>>>,
        mail: HashMap<(usize, usize), VecDeque<Vec<f64>>>,
    }

    /// Members meeting in shared memory: collectives by round number, p2p by mailbox.
    struct Bus {
        n: usize,
        state: Mutex<BusState>,
        cv: Condvar,
    }

    struct Fake {
        bus: Arc<Bus>,
        me: usize,
        group: Vec<usize>,
        round: u64,
    }

    fn reduce(op: ReduceOp, terms: &[&[f64]], n: usize) -> Vec<f64> {
        let len = terms[0].len();
        (0..len)
            .map(|i| {
                let mut a = terms[0][i];
                for t in &terms[1..] {
                    a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => a + t[i],
                        ReduceOp::Max => a.max(t[i]),
                        ReduceOp::Min => a.min(t[i]),
                        ReduceOp::Product => a * t[i],
                    };
                }
                if op == ReduceOp::Avg {
                    a / n as f64
                } else {
                    a
                }
            })
            .collect()
    }

    impl Transport for Fake {
        type DeviceJob = NoDevice;
        fn size(&self) -> usize {
            self.bus.n
        }
        fn rank(&self) -> usize {
            self.me
        }
        fn group(&self) -> &[usize] {
            &self.group
        }
        fn run<T: Wire>(
            &mut self,
            _op: &'static str,
            prim: &Prim,
            send: &[T],
            recv_len: usize,
            _deadline: Deadline,
        ) -> Result<Vec<T>> {
            let n = self.bus.n;
            let me = self.me;
            let mine: Vec<f64> = send.iter().map(|v| v.to_f64()).collect();
            let back = |v: Vec<f64>| v.into_iter().map(T::from_f64).collect::<Vec<T>>();
            let mut st = self.bus.state.lock().unwrap();
            let out = match prim {
                Prim::Send { peer } => {
                    st.mail.entry((me, *peer)).or_default().push_back(mine);
                    self.bus.cv.notify_all();
                    Vec::new()
                }
                Prim::Recv { peer } => loop {
                    if let Some(v) = st.mail.get_mut(&(*peer, me)).and_then(|q| q.pop_front()) {
                        break v;
                    }
                    st = self.bus.cv.wait(st).unwrap();
                },
                Prim::Exchange { sends, recvs } => {
                    for &(peer, start, len) in sends {
                        st.mail
                            .entry((me, peer))
                            .or_default()
                            .push_back(mine[start..start + len].to_vec());
                    }
                    self.bus.cv.notify_all();
                    let mut out = Vec::new();
                    for &(peer, len) in recvs {
                        let v = loop {
                            if let Some(v) =
                                st.mail.get_mut(&(peer, me)).and_then(|q| q.pop_front())
                            {
                                break v;
                            }
                            st = self.bus.cv.wait(st).unwrap();
                        };
                        assert_eq!(v.len(), len, "piece from {peer} to {me}");
                        out.extend(v);
                    }
                    out
                }
                _ => {
                    let round = self.round;
                    self.round += 1;
                    let slot = st.rounds.entry(round).or_insert_with(|| vec![None; n]);
                    slot[me] = Some(mine);
                    self.bus.cv.notify_all();
                    let all: Vec<Vec<f64>> = loop {
                        let slot = &st.rounds[&round];
                        if slot.iter().all(Option::is_some) {
                            break slot.iter().flatten().cloned().collect();
                        }
                        st = self.bus.cv.wait(st).unwrap();
                    };
                    let terms: Vec<&[f64]> = all.iter().map(Vec::as_slice).collect();
                    match prim {
                        Prim::AllGather => {
                            assert!(all.iter().all(|v| v.len() == all[0].len()), "equal blocks");
                            all.concat()
                        }
                        Prim::AllReduce(op) => reduce(*op, &terms, n),
                        Prim::ReduceScatter(op) => {
                            let r = reduce(*op, &terms, n);
                            assert_eq!(r.len(), n * recv_len);
                            r[me * recv_len..(me + 1) * recv_len].to_vec()
                        }
                        Prim::Broadcast { root } => all[*root].clone(),
                        _ => unreachable!(),
                    }
                }
            };
            drop(st);
            // A receive hands back what was sent, whatever the count asked for (as a
            // transport that can tell would), so that callers' count checks are tested.
            if !matches!(prim, Prim::Recv { .. }) {
                assert_eq!(out.len(), recv_len, "{prim:?}");
            }
            Ok(back(out))
        }
    }

    /// Runs `f(rank, transport)` on `n` threads over one bus.
    fn on_bus<R: Send + 'static>(
        n: usize,
        f: impl Fn(usize, &mut Fake) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let bus = Arc::new(Bus { n, state: Mutex::new(BusState::default()), cv: Condvar::new() });
        let f = Arc::new(f);
        let handles: Vec<_> = (0..n)
            .map(|me| {
                let bus = bus.clone();
                let f = f.clone();
                std::thread::spawn(move || {
                    let mut x = Fake { bus, me, group: (0..n).map(|r| r * 10).collect(), round: 0 };
                    f(me, &mut x)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn small_ints(dims: &[usize], dtype: DType, seed: u64) -> Tensor {
        let mut rng = Rng::new(seed);
        let n: usize = dims.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.below(7) as f64 - 3.0).collect();
        Tensor::from_f64(&v, dims.to_vec(), dtype).unwrap()
    }

    fn dl() -> Deadline {
        Deadline::after(Duration::from_secs(30))
    }

    /// The same calls on the local backend and on the executor give the same tensors.
    fn same_as_local(n: usize, dims_of: fn(usize, usize) -> Vec<usize>, calls: Vec<Call>) {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64] {
            for call in &calls {
                if dtype == DType::I64 && call.reduce_op() == Some(ReduceOp::Avg) {
                    continue;
                }
                let input = move |r: usize| small_ints(&dims_of(r, n), dtype, 7 + r as u64);
                let c = call.clone();
                let want: Vec<Option<Vec<f64>>> = spawn(n, move |ctx| -> crate::Result<_> {
                    let pg = ctx.world_group();
                    let t = input(ctx.rank());
                    let out = match &c {
                        Call::AllReduce { op } => Some(pg.all_reduce(&t, *op)?),
                        Call::AllGather { dim } => Some(pg.all_gather(&t, *dim)?),
                        Call::ReduceScatter { dim, op } => Some(pg.reduce_scatter(&t, *dim, *op)?),
                        Call::AllToAll { split_dim, concat_dim, sizes: None } => {
                            Some(pg.all_to_all(&t, *split_dim, *concat_dim)?)
                        }
                        Call::AllToAll { split_dim, concat_dim, sizes: Some(s) } => {
                            Some(pg.all_to_all_sizes(&t, s, *split_dim, *concat_dim)?)
                        }
                        Call::Broadcast { src } => Some(pg.broadcast(&t, *src)?),
                        Call::Barrier => {
                            pg.barrier()?;
                            None
                        }
                    };
                    Ok(out.map(|t| (t.dims().to_vec(), t.to_vec_f64().unwrap())).map(|(d, v)| {
                        let mut x = d.iter().map(|&d| d as f64).collect::<Vec<_>>();
                        x.push(f64::NAN);
                        x.extend(v);
                        x
                    }))
                })
                .unwrap();
                let c = call.clone();
                let got = on_bus(n, move |me, x| {
                    let t = input(me);
                    let out = collective(x, 0, c.clone(), Some(t), None, dl()).unwrap();
                    out.map(|t| {
                        let mut v = t.dims().iter().map(|&d| d as f64).collect::<Vec<_>>();
                        v.push(f64::NAN);
                        v.extend(t.to_vec_f64().unwrap());
                        v
                    })
                });
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    let same = match (g, w) {
                        (Some(g), Some(w)) => {
                            g.len() == w.len()
                                && g.iter().zip(w).all(|(a, b)| {
                                    (a.is_nan() && b.is_nan())
                                        || (a - b).abs() <= 1e-2 * b.abs().max(1.0)
                                })
                        }
                        (None, None) => true,
                        _ => false,
                    };
                    assert!(same, "{call} {dtype} n={n} rank {r}: got {g:?}, want {w:?}");
                }
            }
        }
    }

    fn reductions(dim: usize) -> Vec<Call> {
        [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product]
            .into_iter()
            .flat_map(|op| [Call::AllReduce { op }, Call::ReduceScatter { dim, op }])
            .collect()
    }

    #[test]
    fn reductions_match_the_local_backend() {
        for n in 1..=4 {
            same_as_local(n, |_, n| vec![n * 3 + 1, 2, 3], reductions(0));
            same_as_local(n, |_, n| vec![2, n * 3 + 2, 3], reductions(1));
            same_as_local(n, |_, _| vec![3, 2, 5], reductions(2));
        }
    }

    #[test]
    fn uneven_gathers_match_the_local_backend() {
        for n in 1..=4 {
            // torch.chunk shards of 5 rows on dims 0, 1 and 2 (some empty).
            let calls = vec![Call::AllGather { dim: 0 }];
            same_as_local(n, |r, n| vec![chunk(5, n, r), 3], calls);
            same_as_local(n, |r, n| vec![2, chunk(5, n, r), 3], vec![Call::AllGather { dim: 1 }]);
            same_as_local(n, |r, n| vec![2, 3, chunk(5, n, r)], vec![Call::AllGather { dim: 2 }]);
            same_as_local(n, |_, _| vec![2, 0, 3], vec![Call::AllGather { dim: 1 }]);
        }
    }

    fn chunk(size: usize, n: usize, r: usize) -> usize {
        crate::chunk_range(size, n, r).1
    }

    #[test]
    fn broadcasts_barriers_and_all_to_all_match_the_local_backend() {
        for n in 1..=4 {
            let mut calls: Vec<Call> = (0..n).map(|src| Call::Broadcast { src }).collect();
            calls.push(Call::Barrier);
            for (s, c) in [(0, 1), (1, 0), (1, 1), (0, 2), (2, 0)] {
                calls.push(Call::AllToAll { split_dim: s, concat_dim: c, sizes: None });
            }
            same_as_local(n, |_, n| vec![n * 2 + 1, n + 2, 2], calls);
            // Uneven sequence shards exchanged for head shards (split != concat).
            let a2a = vec![Call::AllToAll { split_dim: 2, concat_dim: 1, sizes: None }];
            same_as_local(n, |r, n| vec![2, chunk(7, n, r), 5], a2a);
        }
    }

    #[test]
    fn sized_all_to_all_matches_the_local_backend() {
        for n in 1..=4usize {
            let sizes: Vec<usize> = (0..n).map(|i| (i * 2 + 1) % 3).collect();
            let total = sizes.iter().sum::<usize>();
            // Same sizes on every member, split != concat.
            let call = Call::AllToAll { split_dim: 1, concat_dim: 0, sizes: Some(sizes.clone()) };
            let input = move |r: usize| small_ints(&[2, total, 3], DType::F32, r as u64);
            let c = call.clone();
            let want = spawn(n, move |ctx| -> crate::Result<Vec<f64>> {
                let Call::AllToAll { split_dim, concat_dim, sizes: Some(s) } = &c else {
                    unreachable!()
                };
                let t = ctx.world_group().all_to_all_sizes(
                    &input(ctx.rank()),
                    s,
                    *split_dim,
                    *concat_dim,
                )?;
                let mut v: Vec<f64> = t.dims().iter().map(|&d| d as f64).collect();
                v.extend(t.to_vec_f64()?);
                Ok(v)
            })
            .unwrap();
            let got = on_bus(n, move |me, x| {
                let t =
                    collective(x, 0, call.clone(), Some(input(me)), None, dl()).unwrap().unwrap();
                let mut v: Vec<f64> = t.dims().iter().map(|&d| d as f64).collect();
                v.extend(t.to_vec_f64().unwrap());
                v
            });
            assert_eq!(got, want, "n={n}");
        }
    }

    #[test]
    fn per_member_split_sizes_along_the_concat_dim() {
        // all_to_all_single with uneven splits: member r sends sizes[r][j] rows to j.
        let n = 3;
        let sizes = [[1usize, 0, 2], [2, 2, 0], [0, 1, 1]];
        let input = move |r: usize| {
            let rows: usize = sizes[r].iter().sum();
            small_ints(&[rows, 2], DType::I64, 40 + r as u64)
        };
        let want = spawn(n, move |ctx| -> crate::Result<Vec<f64>> {
            let r = ctx.rank();
            Ok(ctx.world_group().all_to_all_sizes(&input(r), &sizes[r], 0, 0)?.to_vec_f64()?)
        })
        .unwrap();
        let got = on_bus(n, move |me, x| {
            let call =
                Call::AllToAll { split_dim: 0, concat_dim: 0, sizes: Some(sizes[me].to_vec()) };
            collective(x, 0, call, Some(input(me)), None, dl())
                .unwrap()
                .unwrap()
                .to_vec_f64()
                .unwrap()
        });
        assert_eq!(got, want);
    }

    #[test]
    fn disagreements_fail_every_member_alike() {
        // Member 1 passes another dtype: everyone gets the local backend's Mismatch.
        let errs = on_bus(3, |me, x| {
            let dt = if me == 1 { DType::F64 } else { DType::F32 };
            let t = small_ints(&[4], dt, 1);
            collective(x, 0, Call::AllReduce { op: ReduceOp::Sum }, Some(t), None, dl())
                .unwrap_err()
        });
        for e in &errs {
            assert!(matches!(e, CollectiveError::Mismatch { rank: 10, .. }), "{e}");
        }
        // Member 2 found its own arguments invalid: it keeps its error, the others name it.
        let errs = on_bus(3, |me, x| {
            let t = small_ints(&[4], DType::F32, 1);
            let problem = (me == 2).then(|| CollectiveError::InvalidArgument {
                op: "all_gather",
                why: "dim 5".into(),
            });
            collective(x, 0, Call::AllGather { dim: 0 }, Some(t), problem, dl()).unwrap_err()
        });
        assert!(errs[2].to_string().contains("dim 5"), "{}", errs[2]);
        for e in &errs[..2] {
            assert!(e.to_string().contains("rank 20 passed invalid arguments"), "{e}");
        }
        // Offset sequence numbers (a member skipped a call) are a mismatch too.
        let errs = on_bus(2, |me, x| {
            let t = small_ints(&[4], DType::F32, 1);
            collective(x, me as u64, Call::AllGather { dim: 0 }, Some(t), None, dl()).unwrap_err()
        });
        assert!(errs.iter().all(|e| matches!(e, CollectiveError::Mismatch { .. })), "{errs:?}");
        // Different collectives.
        let errs = on_bus(2, |me, x| {
            let t = small_ints(&[4], DType::F32, 1);
            let call = if me == 0 { Call::Barrier } else { Call::Broadcast { src: 0 } };
            collective(x, 0, call, Some(t), None, dl()).unwrap_err()
        });
        assert!(errs.iter().all(|e| matches!(e, CollectiveError::Mismatch { .. })), "{errs:?}");
    }

    #[test]
    fn broadcast_placeholders_may_have_any_shape_and_dtype() {
        let outs = on_bus(3, |me, x| {
            let t = if me == 1 {
                small_ints(&[2, 5], DType::BF16, 11)
            } else {
                Tensor::zeros(vec![0; MAX_DIMS + 3], DType::I64, Device::Cpu).unwrap()
            };
            let out = collective(x, 0, Call::Broadcast { src: 1 }, Some(t), None, dl());
            let out = out.unwrap().unwrap();
            (out.dims().to_vec(), out.dtype(), out.to_vec_f64().unwrap())
        });
        let want = small_ints(&[2, 5], DType::BF16, 11).to_vec_f64().unwrap();
        for (dims, dtype, vals) in outs {
            assert_eq!((dims, dtype), (vec![2, 5], DType::BF16));
            assert_eq!(vals, want);
        }
    }

    #[test]
    fn meta_tensors_get_shapes_without_data() {
        let outs = on_bus(3, |me, x| {
            let t = Tensor::empty([5, 2], DType::BF16, Device::Meta).unwrap();
            let rs = collective(
                x,
                0,
                Call::ReduceScatter { dim: 0, op: ReduceOp::Sum },
                Some(t.clone()),
                None,
                dl(),
            );
            let ag = collective(x, 1, Call::AllGather { dim: 1 }, Some(t), None, dl());
            let rs = rs.unwrap().unwrap();
            let ag = ag.unwrap().unwrap();
            assert_eq!(rs.device(), Device::Meta);
            (me, rs.dims().to_vec(), ag.dims().to_vec())
        });
        assert_eq!(outs[0].1, vec![2, 2]);
        assert_eq!(outs[2].1, vec![1, 2]);
        assert!(outs.iter().all(|o| o.2 == vec![5, 6]));
    }

    #[test]
    fn send_and_recv_carry_shape_and_dtype() {
        let got = on_bus(2, |me, x| {
            if me == 0 {
                send(x, &small_ints(&[2, 3], DType::BF16, 3), 1, dl()).unwrap();
                send(x, &Tensor::zeros([0, 4], DType::I64, Device::Cpu).unwrap(), 1, dl()).unwrap();
                send(x, &Tensor::empty([7], DType::F16, Device::Meta).unwrap(), 1, dl()).unwrap();
                Vec::new()
            } else {
                (0..3).map(|_| recv(x, 0, dl()).unwrap()).collect()
            }
        });
        let r = &got[1];
        assert_eq!((r[0].dims(), r[0].dtype()), (&[2usize, 3][..], DType::BF16));
        assert_eq!(
            r[0].to_vec_f64().unwrap(),
            small_ints(&[2, 3], DType::BF16, 3).to_vec_f64().unwrap()
        );
        assert_eq!((r[1].dims(), r[1].dtype()), (&[0usize, 4][..], DType::I64));
        assert_eq!((r[2].dims(), r[2].device()), (&[7usize][..], Device::Meta));
    }

    fn expect(dims: &[usize], dtype: DType, device: Device) -> Expect {
        Expect::new("recv_shaped", dims, dtype, device).unwrap()
    }

    /// What `send_shaped` puts on the wire from member 0 to member 1, received raw: the
    /// payloads alone, one transfer each (nothing for empty and meta tensors), and the
    /// same data `recv_shaped` builds the expected tensors from.
    #[test]
    fn send_shaped_puts_the_payload_alone_on_the_wire() {
        let cases: Vec<(Vec<usize>, DType)> = vec![
            (vec![2, 3], DType::F32),
            (vec![0, 4], DType::F64),
            (vec![5], DType::BF16),
            (vec![7], DType::F16),
            (vec![3, 1, 2], DType::I64),
            (vec![], DType::F64),
        ];
        let input = |k: usize, dims: &[usize], dtype: DType| small_ints(dims, dtype, 50 + k as u64);
        let c = cases.clone();
        let got = on_bus(2, move |me, x| {
            if me == 0 {
                for (k, (dims, dtype)) in c.iter().enumerate() {
                    send_shaped(x, &input(k, dims, *dtype), 1, dl()).unwrap();
                    let meta = Tensor::empty(dims.clone(), *dtype, Device::Meta).unwrap();
                    send_shaped(x, &meta, 1, dl()).unwrap();
                }
                // The same again, for `recv_shaped`.
                for (k, (dims, dtype)) in c.iter().enumerate() {
                    send_shaped(x, &input(k, dims, *dtype), 1, dl()).unwrap();
                }
                return (Vec::new(), Vec::new());
            }
            let raw: Vec<Vec<f64>> = c
                .iter()
                .filter(|(dims, _)| dims.iter().product::<usize>() > 0)
                .map(|_| x.run::<f64>("test", &Prim::Recv { peer: 0 }, &[], 0, dl()).unwrap())
                .collect();
            let built: Vec<Tensor> = c
                .iter()
                .map(|(dims, dtype)| {
                    recv_shaped(x, 0, &expect(dims, *dtype, Device::Cpu), dl()).unwrap()
                })
                .collect();
            (raw, built)
        });
        let (raw, built) = &got[1];
        let full: Vec<usize> = (0..cases.len()).filter(|&k| !cases[k].0.contains(&0)).collect();
        assert_eq!(raw.len(), full.len(), "one transfer per non-empty payload, no headers");
        for (r, &k) in raw.iter().zip(&full) {
            let (dims, dtype) = &cases[k];
            assert_eq!(r, &input(k, dims, *dtype).to_vec_f64().unwrap(), "case {k}");
        }
        for (k, ((dims, dtype), t)) in cases.iter().zip(built).enumerate() {
            assert_eq!((t.dims(), t.dtype(), t.device()), (dims.as_slice(), *dtype, Device::Cpu));
            assert_eq!(t.to_vec_f64().unwrap(), input(k, dims, *dtype).to_vec_f64().unwrap());
        }
    }

    #[test]
    fn shaped_and_self_describing_transfers_interleave_in_order() {
        let got = on_bus(3, |me, x| {
            let a = small_ints(&[2, 2], DType::BF16, 1);
            let b = small_ints(&[3], DType::I64, 2);
            match me {
                2 => {
                    send(x, &a, 0, dl()).unwrap();
                    send_shaped(x, &b, 0, dl()).unwrap();
                    send(x, &b, 0, dl()).unwrap();
                    send_shaped(x, &a, 0, dl()).unwrap();
                    let meta = Tensor::empty([2, 2], DType::BF16, Device::Meta).unwrap();
                    send_shaped(x, &meta, 0, dl()).unwrap();
                    None
                }
                0 => {
                    let r1 = recv(x, 2, dl()).unwrap();
                    let r2 = recv_shaped(x, 2, &expect(&[3], DType::I64, Device::Cpu), dl());
                    let r3 = recv(x, 2, dl()).unwrap();
                    let meta = expect(&[2, 2], DType::BF16, Device::Meta);
                    let r4 = recv_shaped(x, 2, &expect(&[2, 2], DType::BF16, Device::Cpu), dl());
                    let m = recv_shaped(x, 2, &meta, dl()).unwrap();
                    assert_eq!((m.dims(), m.device()), (&[2usize, 2][..], Device::Meta));
                    let vals = |t: &Tensor| (t.dtype(), t.to_vec_f64().unwrap());
                    Some([vals(&r1), vals(&r2.unwrap()), vals(&r3), vals(&r4.unwrap())])
                }
                _ => None,
            }
        });
        let a = small_ints(&[2, 2], DType::BF16, 1);
        let b = small_ints(&[3], DType::I64, 2);
        let vals = |t: &Tensor| (t.dtype(), t.to_vec_f64().unwrap());
        assert_eq!(got[0], Some([vals(&a), vals(&b), vals(&b), vals(&a)]));
    }

    #[test]
    fn a_count_mismatch_fails_recv_shaped_where_the_transport_tells() {
        let got = on_bus(2, |me, x| {
            if me == 1 {
                send_shaped(x, &small_ints(&[3, 2], DType::F32, 4), 0, dl()).unwrap();
                send_shaped(x, &small_ints(&[2], DType::F32, 5), 0, dl()).unwrap();
                return None;
            }
            let too_many = recv_shaped(x, 1, &expect(&[7], DType::F32, Device::Cpu), dl());
            let too_few = recv_shaped(x, 1, &expect(&[1], DType::F32, Device::Cpu), dl());
            Some((too_many.unwrap_err(), too_few.unwrap_err()))
        });
        let (too_many, too_few) = got[0].clone().unwrap();
        for (e, want) in [(too_many, "7 elements: f32 [7]"), (too_few, "1 elements: f32 [1]")] {
            let msg = e.to_string();
            // Group ranks 0 and 1 are global ranks 0 and 10 on the bus.
            assert!(
                matches!(e, CollectiveError::Mismatch { op: "recv_shaped", rank: 10, .. }),
                "{msg}"
            );
            assert!(msg.contains(want) && msg.contains("rank 0"), "{msg}");
        }
    }

    #[test]
    fn to_self_checks_the_pair_then_round_trips_the_data() {
        let got = on_bus(1, |_, x| {
            let t = small_ints(&[3, 2], DType::F16, 9);
            let shaped = Mail { tensor: t.clone(), shaped: true };
            let plain = Mail { tensor: t.clone(), shaped: false };
            let want = expect(&[3, 2], DType::F16, Device::Cpu);
            let ok = to_self(x, &shaped, Some(&want), dl()).unwrap();
            let ok_plain = to_self(x, &plain, None, dl()).unwrap();
            let wrong = [
                to_self(x, &shaped, Some(&expect(&[6], DType::F16, Device::Cpu)), dl()),
                to_self(x, &shaped, Some(&expect(&[3, 2], DType::F32, Device::Cpu)), dl()),
                to_self(x, &shaped, None, dl()),
                to_self(x, &plain, Some(&want), dl()),
            ];
            let meta = Mail {
                tensor: Tensor::empty([4], DType::I64, Device::Meta).unwrap(),
                shaped: true,
            };
            let m = to_self(x, &meta, Some(&expect(&[4], DType::I64, Device::Meta)), dl()).unwrap();
            assert_eq!((m.dims(), m.device()), (&[4usize][..], Device::Meta));
            let empty = Mail {
                tensor: Tensor::zeros([0, 3], DType::F64, Device::Cpu).unwrap(),
                shaped: true,
            };
            let e =
                to_self(x, &empty, Some(&expect(&[0, 3], DType::F64, Device::Cpu)), dl()).unwrap();
            assert_eq!(e.dims(), &[0, 3]);
            (t, ok, ok_plain, wrong.map(|r| r.unwrap_err()))
        });
        let (t, ok, ok_plain, wrong) = &got[0];
        for out in [ok, ok_plain] {
            assert_eq!((out.dims(), out.dtype()), (t.dims(), t.dtype()));
            assert_eq!(out.to_vec_f64().unwrap(), t.to_vec_f64().unwrap());
        }
        for e in wrong {
            assert!(matches!(e, CollectiveError::Mismatch { rank: 0, .. }), "{e}");
        }
    }

    #[test]
    fn loopback_returns_the_same_tensor() {
        let got = on_bus(1, |_, x| {
            let t = small_ints(&[3, 2], DType::F16, 9);
            let back = loopback(x, &t, dl()).unwrap();
            (
                t.to_vec_f64().unwrap(),
                back.dims().to_vec(),
                back.dtype(),
                back.to_vec_f64().unwrap(),
            )
        });
        let (want, dims, dtype, vals) = &got[0];
        assert_eq!((dims.as_slice(), *dtype), (&[3usize, 2][..], DType::F16));
        assert_eq!(vals, want);
    }
}
