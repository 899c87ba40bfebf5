//! `ProcessGroup`: the communicator handle every layer above talks through.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tpar_tensor::{DType, Device, Tensor};

use crate::local::{Call, Dest, LocalComm};
use crate::nccl::DeviceJob;
use crate::p2p::{to_requested, Expect};
use crate::remote::{DeviceWork, NoDevice, Pending, RemoteComm};
use crate::spawn::panic_message;
use crate::{CollectiveError, CollectiveKind, CommDebug, CommRecord, ReduceOp, Result, Store};

/// The transport behind a group: an enum over backends that live in their own modules, so
/// no backend generic leaks into user signatures.
///
/// Each `ProcessGroup` method dispatches with one `match` on this enum; argument checks,
/// sequence numbering and [`CommDebug`] recording stay in `ProcessGroup` and are shared
/// by all. The `nccl` module always compiles (cudarc loads CUDA at run time); a machine
/// without the CUDA driver or NCCL reports [`CollectiveError::Unavailable`] when such a
/// group is requested. `Nccl` and `Tcp` share their handle (the `remote` module's job
/// queue to the group's worker) and differ in the transport that worker owns, and so in
/// the handle's device work (NCCL's device path; none for TCP).
#[derive(Clone)]
pub(crate) enum Backend {
    /// Ranks are threads of this process (see the `local` module).
    Local(LocalComm),
    /// One process per GPU, over NCCL (see the `nccl` module), built through a [`Store`].
    Nccl(RemoteComm<DeviceJob>),
    /// Ranks are processes on one host or several, over TCP sockets (see the `tcp`
    /// module), built through a [`Store`].
    Tcp(RemoteComm<NoDevice>),
}

/// A collective call numbered and checked on the calling thread, ready to run.
struct Issued {
    seq: u64,
    call: Call,
    tensor: Option<Tensor>,
    problem: Option<CollectiveError>,
    /// Where the caller's tensor lives: results go back there.
    device: Device,
    /// The nccl backend runs it on the CUDA tensor's own memory (`tensor` is not staged).
    on_device: bool,
}

/// A group of ranks that run collectives together: PyTorch's `ProcessGroup`.
///
/// Cheap to clone (clones are the same group). Each rank holds its own handle; members
/// are identified by *global* rank in [`ranks`](Self::ranks) (sorted), while the `src`
/// and `dst` arguments of [`broadcast`](Self::broadcast), [`send`](Self::send) and
/// [`recv`](Self::recv) are *group* ranks, `0..size()`.
///
/// Collectives are out of place: they read `&Tensor` and return a new tensor with its own
/// storage (no autograd history; the DTensor layer records adjoints). They work on every
/// dtype, on tensors that require grad, inside or outside `no_grad`, and on meta tensors
/// (the result is a meta tensor of the right shape). Every member must call the same
/// collectives on a group in the same order; a member that disagrees (another collective,
/// dtype or shape) makes every member fail with [`CollectiveError::Mismatch`] naming it.
///
/// ```
/// use tpar_collectives::{spawn, CollectiveError, ReduceOp};
/// use tpar_tensor::Tensor;
/// let sums = spawn(3, |ctx| -> Result<Vec<f32>, CollectiveError> {
///     let pg = ctx.world_group();
///     let t = Tensor::from_vec(vec![ctx.rank() as f32; 2], [2])?;
///     Ok(pg.all_reduce(&t, ReduceOp::Sum)?.to_vec::<f32>()?)
/// })?;
/// assert_eq!(sums, vec![vec![3.0, 3.0]; 3]);
/// # Ok::<(), CollectiveError>(())
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    ranks: Arc<[usize]>,
    rank: usize,
    global_rank: usize,
    world_size: usize,
    timeout: Duration,
    debug: CommDebug,
    backend: Backend,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend_name())
            .field("ranks", &self.ranks)
            .field("rank", &self.rank)
            .field("global_rank", &self.global_rank)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ProcessGroup {
    pub(crate) fn local(
        comm: LocalComm,
        ranks: Arc<[usize]>,
        rank: usize,
        global_rank: usize,
        world_size: usize,
        timeout: Duration,
        debug: CommDebug,
    ) -> ProcessGroup {
        ProcessGroup {
            ranks,
            rank,
            global_rank,
            world_size,
            timeout,
            debug,
            backend: Backend::Local(comm),
        }
    }

    pub(crate) fn nccl(comm: RemoteComm<DeviceJob>, timeout: Duration) -> ProcessGroup {
        ProcessGroup::remote(&comm, timeout, Backend::Nccl(comm.clone()))
    }

    pub(crate) fn tcp(comm: RemoteComm<NoDevice>, timeout: Duration) -> ProcessGroup {
        ProcessGroup::remote(&comm, timeout, Backend::Tcp(comm.clone()))
    }

    fn remote<D: DeviceWork>(
        comm: &RemoteComm<D>,
        timeout: Duration,
        backend: Backend,
    ) -> ProcessGroup {
        ProcessGroup {
            ranks: comm.ranks(),
            rank: comm.rank(),
            global_rank: comm.global_rank(),
            world_size: comm.world_size(),
            timeout,
            debug: comm.debug(),
            backend,
        }
    }

    /// The NCCL world group of this process: PyTorch's
    /// `init_process_group("nccl", store=store, rank=rank, world_size=world_size)`.
    /// The processes of the job agree on the communicator through `store`, which every
    /// one of them shares; the world communicator lives on CUDA device `device` (the
    /// process's `LOCAL_RANK` under a launcher); `timeout` bounds the setup and is the
    /// group's collective timeout. `tpar_launch::init_process_group` does this from the
    /// launch environment, with the TCP store rank 0 hosts.
    ///
    /// Fails with [`CollectiveError::InvalidArgument`] when `rank` is not below
    /// `world_size`, and with [`CollectiveError::Unavailable`] naming the missing library
    /// when the CUDA driver or NCCL cannot be loaded (see
    /// [`nccl::probe`](crate::nccl::probe)), or when there is no device `device`.
    /// Sub-groups come from [`new_group`](Self::new_group), which every member calls. See
    /// the [`nccl`](crate::nccl) module for the design and its limits.
    pub fn nccl_world(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        crate::nccl::world(store, rank, world_size, device, timeout)
    }

    /// The TCP world group of this process: PyTorch's
    /// `init_process_group("gloo", store=store, rank=rank, world_size=world_size)`. Ranks
    /// are processes, on one host or several, connected pairwise over TCP; tensors live on
    /// the host and reductions run on the CPU. The processes find each other through
    /// `store`, which every one of them shares (and this world keeps for its lifetime);
    /// `timeout` bounds the setup and is the group's collective timeout.
    /// `tpar_launch::init_process_group_with("tcp", ..)` does this from the launch
    /// environment, with the TCP store rank 0 hosts.
    ///
    /// Fails with [`CollectiveError::InvalidArgument`] when `rank` is not below
    /// `world_size`, with [`CollectiveError::Timeout`] naming the ranks that did not show
    /// up within `timeout`, and with [`CollectiveError::Backend`] when a socket or the
    /// store fails. Sub-groups come from [`new_group`](Self::new_group), which every member
    /// calls. See the [`tcp`](crate::tcp) module for the design and the failure semantics.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tpar_collectives::{HashStore, ProcessGroup, ReduceOp, Store};
    /// use tpar_tensor::Tensor;
    ///
    /// // Two processes (threads here, with real sockets) sharing one store.
    /// let store: Arc<dyn Store> = Arc::new(HashStore::new());
    /// let ranks: Vec<_> = (0..2)
    ///     .map(|rank| {
    ///         let store = store.clone();
    ///         std::thread::spawn(move || -> tpar_collectives::Result<Vec<f32>> {
    ///             let world = ProcessGroup::tcp_world(store, rank, 2, Duration::from_secs(10))?;
    ///             assert_eq!(world.backend_name(), "tcp");
    ///             let t = Tensor::from_vec(vec![rank as f32 + 1.0; 3], [3])?;
    ///             Ok(world.all_reduce(&t, ReduceOp::Sum)?.to_vec::<f32>()?)
    ///         })
    ///     })
    ///     .collect();
    /// for r in ranks {
    ///     assert_eq!(r.join().unwrap()?, vec![3.0; 3]);
    /// }
    /// # Ok::<(), tpar_collectives::CollectiveError>(())
    /// ```
    pub fn tcp_world(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        crate::tcp::world(store, rank, world_size, timeout)
    }

    /// The members' global ranks, sorted.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// This rank's index in the group (`0..size()`).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// This rank's global rank.
    pub fn global_rank(&self) -> usize {
        self.global_rank
    }

    /// Number of ranks in the whole world this group belongs to.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// How long a collective waits for its peers before failing with
    /// [`CollectiveError::Timeout`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The same group with another timeout (only this handle is affected).
    pub fn with_timeout(&self, timeout: Duration) -> ProcessGroup {
        ProcessGroup { timeout, ..self.clone() }
    }

    /// The group rank of a global rank, if it is a member.
    pub fn group_rank_of(&self, global: usize) -> Option<usize> {
        self.ranks.binary_search(&global).ok()
    }

    /// The global rank of a group rank.
    pub fn global_rank_of(&self, group_rank: usize) -> Option<usize> {
        self.ranks.get(group_rank).copied()
    }

    /// This rank's communication recorder (shared by all its groups in the world).
    pub fn comm_debug(&self) -> CommDebug {
        self.debug.clone()
    }

    /// The backend's name: `"local"`, `"nccl"` or `"tcp"`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Local(_) => "local",
            Backend::Nccl(_) => "nccl",
            Backend::Tcp(_) => "tcp",
        }
    }

    /// Another group of the same world, from global ranks (any order, no duplicates) that
    /// include this rank. Every member must create it; all handles on the same rank list
    /// share one communicator, whichever rank created them.
    pub fn new_group(&self, ranks: &[usize]) -> Result<ProcessGroup> {
        match &self.backend {
            Backend::Local(l) => {
                crate::world::local_group(l.world(), self.global_rank, ranks, Some(self.timeout))
            }
            Backend::Nccl(c) => c.new_group(ranks, self.timeout),
            Backend::Tcp(c) => c.new_group(ranks, self.timeout),
        }
    }

    // ---- collectives ---------------------------------------------------------------

    /// Reduces every member's tensor elementwise with `op`; every member gets the result.
    ///
    /// All members pass the same shape and dtype. bf16/f16 accumulate in f32; `Avg` needs a
    /// float dtype.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let i = self.issue(Call::AllReduce { op }, Some(t), false);
        expect_tensor("all_reduce", self.execute(i))
    }

    /// Concatenates every member's tensor along `dim`, in group-rank order.
    ///
    /// Members may hold different sizes along `dim` (including 0, as uneven `torch.chunk`
    /// shards do); all other dims and the dtype must agree.
    pub fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let i = self.issue(Call::AllGather { dim }, Some(t), false);
        expect_tensor("all_gather", self.execute(i))
    }

    /// Reduces every member's tensor with `op`, then member `i` keeps chunk `i` of `dim`,
    /// split by the `torch.chunk` rule of [`chunk_range`](crate::chunk_range) (chunks may
    /// be empty). All members pass the same shape and dtype.
    pub fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let i = self.issue(Call::ReduceScatter { dim, op }, Some(t), false);
        expect_tensor("reduce_scatter", self.execute(i))
    }

    /// [`all_reduce`](Self::all_reduce) into the caller's tensor `out` (same shape, dtype
    /// and device as `t`, its own storage): PyTorch's `all_reduce` with an output buffer
    /// kept across calls. On the local backend a host `out`'s memory is written in place,
    /// so a large collective does not fault in a fresh allocation each call; other
    /// backends compute as usual and move the result into `out`.
    ///
    /// On the local backend, when every member calls `all_reduce_into` on host tensors of
    /// 16 Ki elements or more, members lend each other their `out`s: each member reduces
    /// one chunk of all members' inputs and writes it into every member's `out`, so each
    /// input byte is read once and each output byte written once (from 16 MiB with
    /// streaming stores, which do not read the output's cache lines first).
    ///
    /// A wrong `out` fails every member's call, as a wrong argument does, and is left as
    /// it was (on the nccl backend's device path, which compares nothing across members,
    /// only this member's call fails, after taking part). After another error, an `out`
    /// whose memory the local backend was writing holds zeros.
    ///
    /// ```
    /// use tpar_collectives::{spawn, ReduceOp};
    /// use tpar_tensor::{DType, Device, Tensor};
    /// spawn(2, |ctx| -> Result<(), tpar_collectives::CollectiveError> {
    ///     let pg = ctx.world_group();
    ///     let out = Tensor::zeros([3], DType::F32, Device::Cpu)?; // reused by every call
    ///     for step in 0..3 {
    ///         let t = Tensor::from_vec(vec![(pg.rank() + step) as f32; 3], [3])?;
    ///         pg.all_reduce_into(&t, ReduceOp::Sum, &out)?;
    ///         assert_eq!(out.to_vec::<f32>()?, vec![(1 + 2 * step) as f32; 3]);
    ///     }
    ///     Ok(())
    /// })?;
    /// # Ok::<(), tpar_collectives::CollectiveError>(())
    /// ```
    pub fn all_reduce_into(&self, t: &Tensor, op: ReduceOp, out: &Tensor) -> Result<()> {
        let i = self.issue(Call::AllReduce { op }, Some(t), false);
        self.execute_into(i, t, out, Some(t.dims().to_vec()))
    }

    /// [`all_reduce`](Self::all_reduce) in place: `t` holds the result on every member, as
    /// PyTorch's `dist.all_reduce(t)`. Not recorded by autograd (as
    /// [`Tensor::fill_storage_`]); every handle sharing `t`'s storage sees the result.
    ///
    /// On the local backend, when every member calls `all_reduce_` on host tensors of
    /// 16 Ki elements or more, each member reduces one chunk of all members' tensors and
    /// writes it back into each of them: every byte is read once and written once, and
    /// each write lands on a cache line its read just brought in. Otherwise (smaller
    /// tensors, other backends, a member calling `all_reduce` meanwhile) the result is
    /// computed as by [`all_reduce`](Self::all_reduce) and moved into `t`.
    ///
    /// A wrong argument fails every member's call and leaves `t` as it was. If the call
    /// fails once members have begun writing each other's memory (a peer fails or times
    /// out), `t` holds zeros.
    ///
    /// ```
    /// use tpar_collectives::{spawn, ReduceOp};
    /// use tpar_tensor::Tensor;
    /// spawn(2, |ctx| -> Result<(), tpar_collectives::CollectiveError> {
    ///     let pg = ctx.world_group();
    ///     let t = Tensor::from_vec(vec![pg.rank() as f32 + 1.0; 1 << 16], [1 << 16])?;
    ///     pg.all_reduce_(&t, ReduceOp::Sum)?;
    ///     assert_eq!(t.to_vec::<f32>()?, vec![3.0; 1 << 16]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), tpar_collectives::CollectiveError>(())
    /// ```
    pub fn all_reduce_(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        let i = self.issue(Call::AllReduce { op }, Some(t), false);
        let r = match &self.backend {
            Backend::Local(l) if !i.on_device => back_to(
                i.device,
                l.run(i.seq, i.call, i.tensor, i.problem, self.timeout, Dest::InPlace),
            ),
            _ => self.execute(i),
        };
        match r? {
            None => Ok(()),
            Some(result) => t.fill_storage_(result).map_err(|e| CollectiveError::InvalidArgument {
                op: "all_reduce",
                why: format!("filling the tensor with the result: {e}"),
            }),
        }
    }

    /// [`all_gather`](Self::all_gather) into the caller's tensor `out` (the gathered
    /// shape, `t`'s dtype and device): PyTorch's `all_gather_into_tensor`, along any dim.
    /// Memory and errors as [`all_reduce_into`](Self::all_reduce_into).
    pub fn all_gather_into(&self, t: &Tensor, dim: usize, out: &Tensor) -> Result<()> {
        let i = self.issue(Call::AllGather { dim }, Some(t), false);
        // Members may hold uneven sizes along `dim`: the shape is checked on the result.
        self.execute_into(i, t, out, None)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) into the caller's tensor `out` (this
    /// member's chunk shape, `t`'s dtype and device): PyTorch's `reduce_scatter_tensor`,
    /// along any dim. Memory and errors as [`all_reduce_into`](Self::all_reduce_into).
    pub fn reduce_scatter_into(
        &self,
        t: &Tensor,
        dim: usize,
        op: ReduceOp,
        out: &Tensor,
    ) -> Result<()> {
        let i = self.issue(Call::ReduceScatter { dim, op }, Some(t), false);
        let mut dims = t.dims().to_vec();
        if let Some(d) = dims.get_mut(dim) {
            *d = crate::chunk_range(*d, self.size(), self.rank()).1;
        }
        self.execute_into(i, t, out, Some(dims))
    }

    /// Splits `t` along `split_dim` into `size()` chunks ([`chunk_range`](crate::chunk_range)
    /// rule), sends chunk `j` to member `j`, and concatenates what it receives along
    /// `concat_dim` in group-rank order.
    ///
    /// All dims but `concat_dim` must agree across members (members may differ along
    /// `concat_dim`, e.g. uneven sequence shards).
    pub fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let call = Call::AllToAll { split_dim, concat_dim, sizes: None };
        let i = self.issue(call, Some(t), false);
        expect_tensor("all_to_all", self.execute(i))
    }

    /// [`all_to_all`](Self::all_to_all) with explicit split sizes: this member sends the
    /// `split_sizes[j]` consecutive slices of `split_dim` starting at
    /// `split_sizes[..j].sum()` to member `j` (`split_sizes` has `size()` entries summing
    /// to the dim's size). When `split_dim != concat_dim`, all members must pass the same
    /// sizes; when they are equal, each member may pass its own (`all_to_all_single` with
    /// uneven splits).
    pub fn all_to_all_sizes(
        &self,
        t: &Tensor,
        split_sizes: &[usize],
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor> {
        let call = Call::AllToAll { split_dim, concat_dim, sizes: Some(split_sizes.to_vec()) };
        let i = self.issue(call, Some(t), false);
        expect_tensor("all_to_all", self.execute(i))
    }

    /// Every member gets a copy of group rank `src`'s tensor.
    ///
    /// Only the source's tensor is read: other members may pass any tensor (a buffer of the
    /// right shape, as in PyTorch, or an empty placeholder); its shape and dtype are
    /// ignored, and the result has the source's.
    pub fn broadcast(&self, t: &Tensor, src: usize) -> Result<Tensor> {
        let i = self.issue(Call::Broadcast { src }, Some(t), false);
        expect_tensor("broadcast", self.execute(i))
    }

    /// Every member's `bytes`, in group-rank order, on every member: PyTorch's
    /// `all_gather_object` for byte strings (a serialized plan, an error's text). Members
    /// may pass different lengths. Two all-gathers: the lengths, then the bytes packed
    /// eight to an i64 and padded to the longest.
    ///
    /// ```
    /// use tpar_collectives::{spawn, CollectiveError};
    /// let all = spawn(2, |ctx| -> Result<Vec<Vec<u8>>, CollectiveError> {
    ///     let mine = "x".repeat(ctx.rank() * 9);
    ///     ctx.world_group().all_gather_bytes(mine.as_bytes())
    /// })?;
    /// assert_eq!(all[1], vec![Vec::new(), b"xxxxxxxxx".to_vec()]);
    /// # Ok::<(), CollectiveError>(())
    /// ```
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        if self.size() == 1 {
            return Ok(vec![bytes.to_vec()]);
        }
        let len = Tensor::from_vec(vec![bytes.len() as i64], [1])?;
        let lens = self.all_gather(&len, 0)?.to_vec::<i64>()?;
        let words = lens.iter().map(|&l| (l as usize).div_ceil(8)).max().unwrap_or(0).max(1);
        let mut packed = vec![0i64; words];
        for (i, c) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            packed[i] = i64::from_le_bytes(w);
        }
        let all = self.all_gather(&Tensor::from_vec(packed, [1, words])?, 0)?.to_vec::<i64>()?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &l)| {
                let mut out: Vec<u8> =
                    all[r * words..(r + 1) * words].iter().flat_map(|w| w.to_le_bytes()).collect();
                out.truncate(l as usize);
                out
            })
            .collect())
    }

    /// Waits until every member has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        let i = self.issue(Call::Barrier, None, false);
        self.execute(i).map(|_| ())
    }

    /// Sends a copy of `t` to group rank `dst`. Returns at once (the copy is queued);
    /// messages between one pair of ranks arrive in order.
    ///
    /// The message describes itself (dtype, dims, device travel with it: on NCCL as a
    /// header transfer before the data), so the receiver needs to know nothing. It must
    /// be received with [`recv`](Self::recv), never [`recv_shaped`](Self::recv_shaped),
    /// which pairs with [`send_shaped`](Self::send_shaped).
    pub fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        let op = "send";
        if dst >= self.size() {
            return Err(bad_rank(op, "dst", dst, self.size()));
        }
        self.host_only(op, t.device())?;
        let copy = tpar_tensor::no_grad(|| t.detach().deep_clone())?;
        self.debug.record(|| self.record(CollectiveKind::Send, None, Some(t), false));
        match &self.backend {
            Backend::Local(l) => l.send(dst, copy, false),
            Backend::Nccl(c) => c.send(dst, copy, self.timeout)?,
            Backend::Tcp(c) => c.send(dst, copy, self.timeout)?,
        }
        Ok(())
    }

    /// Receives the next tensor group rank `src` sent to this rank, waiting up to the
    /// group's timeout.
    ///
    /// Pairs with [`send`](Self::send) only; a transfer from
    /// [`send_shaped`](Self::send_shaped) is received with
    /// [`recv_shaped`](Self::recv_shaped) (the local backend fails a `recv` that meets one
    /// with [`CollectiveError::Mismatch`]).
    pub fn recv(&self, src: usize) -> Result<Tensor> {
        let op = "recv";
        if src >= self.size() {
            return Err(bad_rank(op, "src", src, self.size()));
        }
        self.debug.record(|| self.record(CollectiveKind::Recv, None, None, false));
        match &self.backend {
            Backend::Local(l) => l.recv(src, self.timeout),
            Backend::Nccl(c) => c.recv(src, self.timeout),
            Backend::Tcp(c) => c.recv(src, self.timeout),
        }
    }

    /// Sends `t`'s data alone to group rank `dst`, whose receiver already knows its dims
    /// and dtype: the transfer PyTorch's `send(tensor, dst)` makes for a `recv` into a
    /// tensor of known shape, as a pipeline stage does every step once the activation
    /// shape is agreed. Returns at once (a copy is queued); transfers between one pair of
    /// ranks arrive in order, shaped or not.
    ///
    /// # Pairing
    ///
    /// A `send_shaped` must be received by [`recv_shaped`](Self::recv_shaped) with the same
    /// dims and dtype (a meta `t` by a `recv_shaped` asking for [`Device::Meta`], and only
    /// by one), never by [`recv`](Self::recv); a [`send`](Self::send) pairs with `recv`.
    /// The local backend, where the tensor itself travels, checks every pair and fails the
    /// receiver with [`CollectiveError::Mismatch`]. The NCCL backend sends the payload
    /// alone (no header transfer; empty and meta tensors move nothing), so a disagreement
    /// goes undetected there: a receiver expecting more bytes waits until the timeout
    /// (which fails the group), one expecting fewer bytes or another dtype gets wrong
    /// values, and later transfers of the pair are out of step. Test pipelines on the
    /// local backend.
    ///
    /// Recorded in [`CommDebug`] as [`CollectiveKind::Send`] with `t`'s bytes, dtype and
    /// shape, as [`send`](Self::send) is.
    ///
    /// ```
    /// use tpar_collectives::{spawn, CollectiveError};
    /// use tpar_tensor::{DType, Device, Tensor};
    /// // Two pipeline stages agree on the activation shape once; then only data moves.
    /// let dims = [2, 3];
    /// let seen = spawn(2, move |ctx| -> Result<Vec<f32>, CollectiveError> {
    ///     let pg = ctx.world_group();
    ///     let mut seen = Vec::new();
    ///     for step in 0..3 {
    ///         if pg.rank() == 0 {
    ///             let act = Tensor::full(dims, step as f64, DType::F32, Device::Cpu)?;
    ///             pg.send_shaped(&act, 1)?;
    ///         } else {
    ///             let act = pg.recv_shaped(0, &dims, DType::F32, Device::Cpu)?;
    ///             assert_eq!(act.dims(), &dims);
    ///             seen.push(act.to_vec::<f32>()?[5]);
    ///         }
    ///     }
    ///     Ok(seen)
    /// })?;
    /// assert_eq!(seen[1], vec![0.0, 1.0, 2.0]);
    /// # Ok::<(), CollectiveError>(())
    /// ```
    pub fn send_shaped(&self, t: &Tensor, dst: usize) -> Result<()> {
        let op = "send_shaped";
        if dst >= self.size() {
            return Err(bad_rank(op, "dst", dst, self.size()));
        }
        self.host_only(op, t.device())?;
        let copy = tpar_tensor::no_grad(|| t.detach().deep_clone())?;
        self.debug.record(|| self.record(CollectiveKind::Send, None, Some(t), false));
        match &self.backend {
            Backend::Local(l) => l.send(dst, copy, true),
            Backend::Nccl(c) => c.send_shaped(dst, copy, self.timeout)?,
            Backend::Tcp(c) => c.send_shaped(dst, copy, self.timeout)?,
        }
        Ok(())
    }

    /// Receives the next [`send_shaped`](Self::send_shaped) transfer from group rank `src`
    /// into a new tensor of `dims` and `dtype` on `device`, waiting up to the group's
    /// timeout: PyTorch's `recv(tensor, src)` into a tensor of known shape, returned
    /// rather than filled in. The tensor does not require grad.
    ///
    /// Pairs with `send_shaped` only, with the same dims and dtype (see the pairing rules
    /// of [`send_shaped`](Self::send_shaped)); [`send`](Self::send) pairs with
    /// [`recv`](Self::recv). On the local backend a disagreement (another shape, dtype,
    /// meta-ness, or a `send`) consumes the transfer and fails with
    /// [`CollectiveError::Mismatch`] naming the sender as the culprit, the receiver, and
    /// both descriptions; a sender that fails or returns without sending makes it fail
    /// with [`CollectiveError::PeerFailed`], and one that is only late, with
    /// [`CollectiveError::Timeout`].
    ///
    /// `device`: [`Device::Meta`] gives a meta tensor (the sender sends a meta tensor, and
    /// no data moves); a CUDA device gets the data moved there (`to_device`) when it
    /// arrives elsewhere, as it does on the NCCL backend's host path. Recorded in
    /// [`CommDebug`] as [`CollectiveKind::Recv`], as [`recv`](Self::recv) is (no input:
    /// 0 bytes).
    ///
    /// ```
    /// use tpar_collectives::{spawn, CollectiveError};
    /// use tpar_tensor::{DType, Device, Tensor};
    /// let r = spawn(2, |ctx| -> Result<(), CollectiveError> {
    ///     let pg = ctx.world_group();
    ///     if pg.rank() == 0 {
    ///         pg.send_shaped(&Tensor::from_vec(vec![1i64, 2, 3, 4], [2, 2])?, 1)?;
    ///         pg.send_shaped(&Tensor::zeros([4], DType::F32, Device::Cpu)?, 1)?;
    ///     } else {
    ///         let t = pg.recv_shaped(0, &[2, 2], DType::I64, Device::Cpu)?;
    ///         assert_eq!(t.to_vec::<i64>()?, vec![1, 2, 3, 4]);
    ///         // The second transfer has 4 elements, not [2, 2]: a typed error.
    ///         pg.recv_shaped(0, &[2, 2], DType::F32, Device::Cpu)?;
    ///     }
    ///     Ok(())
    /// });
    /// let e = r.unwrap_err();
    /// assert!(matches!(e, CollectiveError::Mismatch { rank: 0, .. }), "{e}");
    /// assert!(e.to_string().contains("f32 [2, 2]") && e.to_string().contains("rank 1"));
    /// ```
    pub fn recv_shaped(
        &self,
        src: usize,
        dims: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let op = "recv_shaped";
        if src >= self.size() {
            return Err(bad_rank(op, "src", src, self.size()));
        }
        self.host_only(op, device)?;
        let expect = Expect::new(op, dims, dtype, device)?;
        self.debug.record(|| self.record(CollectiveKind::Recv, None, None, false));
        let t = match &self.backend {
            Backend::Local(l) => l.recv_shaped(src, &expect, self.timeout)?,
            Backend::Nccl(c) => c.recv_shaped(src, expect, self.timeout)?,
            Backend::Tcp(c) => c.recv_shaped(src, expect, self.timeout)?,
        };
        to_requested(op, t, device)
    }

    /// [`all_reduce`](Self::all_reduce) running on a helper thread; see [`Work`].
    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Work {
        self.start(Call::AllReduce { op }, t)
    }

    /// [`all_gather`](Self::all_gather) running on a helper thread; see [`Work`].
    pub fn all_gather_async(&self, t: &Tensor, dim: usize) -> Work {
        self.start(Call::AllGather { dim }, t)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) running on a helper thread; see [`Work`].
    pub fn reduce_scatter_async(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Work {
        self.start(Call::ReduceScatter { dim, op }, t)
    }

    // ---- plumbing --------------------------------------------------------------------

    fn record(
        &self,
        kind: CollectiveKind,
        op: Option<ReduceOp>,
        t: Option<&Tensor>,
        is_async: bool,
    ) -> CommRecord {
        CommRecord {
            kind,
            op,
            group: self.ranks.to_vec(),
            bytes: t.map_or(0, |t| t.nbytes()),
            dtype: t.map(|t| t.dtype()),
            shape: t.map_or_else(Vec::new, |t| t.dims().to_vec()),
            is_async,
        }
    }

    /// The tcp backend moves host memory only: a CUDA tensor is an `InvalidArgument`.
    fn host_only(&self, op: &'static str, device: Device) -> Result<()> {
        match (&self.backend, device) {
            (Backend::Tcp(_), Device::Cuda(_)) => Err(CollectiveError::InvalidArgument {
                op,
                why: format!(
                    "the tcp backend carries host tensors, got one on {device} (move it to the \
                     CPU first, or use the nccl backend)"
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Checks arguments, records the call and takes its sequence number, on the calling
    /// thread (so async calls are numbered in program order).
    fn issue(&self, call: Call, t: Option<&Tensor>, is_async: bool) -> Issued {
        let problem = match t {
            Some(t) => self.host_only(call.name(), t.device()).err(),
            None => None,
        };
        let problem = problem.or_else(|| self.check(&call, t).err());
        if problem.is_none() {
            let read = match call {
                Call::Broadcast { src } if src != self.rank => None,
                _ => t,
            };
            self.debug.record(|| self.record(call.kind(), call.reduce_op(), read, is_async));
        }
        let seq = match &self.backend {
            Backend::Local(l) => l.next_seq(),
            Backend::Nccl(c) => c.next_seq(),
            Backend::Tcp(c) => c.next_seq(),
        };
        let device = t.map(Tensor::device).unwrap_or(Device::Cpu);
        // The local backend reads CUDA tensors where they are (device to device), and so
        // does the nccl backend for the calls of its device path; otherwise the
        // multi-process backends compute on host copies.
        let on_device = matches!(self.backend, Backend::Nccl(_))
            && problem.is_none()
            && t.is_some_and(|t| crate::nccl::ondevice::eligible(&call, t, self.size()));
        let in_place = matches!(self.backend, Backend::Local(_)) || on_device;
        let prepare =
            |t: &Tensor| if in_place { Ok(t.detach()) } else { stage_to_host(call.name(), t) };
        let (tensor, problem) = match t.map(prepare).transpose() {
            Ok(tensor) => (tensor, problem),
            Err(e) => (None, problem.or(Some(e))),
        };
        Issued { seq, call, tensor, problem, device, on_device }
    }

    /// Starts an issued device-path call (see [`Issued::on_device`]) on the nccl backend.
    fn start_on_device(&self, i: &Issued) -> Result<crate::nccl::ondevice::InFlight> {
        match (&self.backend, &i.tensor) {
            (Backend::Nccl(c), Some(t)) => {
                crate::nccl::ondevice::start(c, i.seq, &i.call, t, self.timeout)
            }
            _ => Err(CollectiveError::InvalidArgument {
                op: i.call.name(),
                why: "internal error: a device-path call off the nccl backend".into(),
            }),
        }
    }

    fn execute(&self, i: Issued) -> Result<Option<Tensor>> {
        if i.on_device {
            return self.start_on_device(&i).and_then(|f| f.finish()).map(Some);
        }
        let device = i.device;
        let r = match &self.backend {
            Backend::Local(l) => l.run(i.seq, i.call, i.tensor, i.problem, self.timeout, Dest::New),
            Backend::Nccl(c) => c.run(i.seq, i.call, i.tensor, i.problem, self.timeout),
            Backend::Tcp(c) => c.run(i.seq, i.call, i.tensor, i.problem, self.timeout),
        };
        back_to(device, r)
    }

    /// Runs an issued collective whose result goes into `out`: checks `out` against `t` and
    /// the expected dims (as a member's argument problem, so every member fails alike),
    /// lends a host `out`'s memory to the local backend, and refills `out` with the result
    /// (zeros after an error).
    fn execute_into(
        &self,
        mut i: Issued,
        t: &Tensor,
        out: &Tensor,
        dims: Option<Vec<usize>>,
    ) -> Result<()> {
        let op = i.call.name();
        let bad = |why: String| CollectiveError::InvalidArgument { op, why };
        if i.problem.is_none() {
            i.problem = if out.same_storage(t) {
                Some(bad("`out` shares its storage with the input".into()))
            } else if out.dtype() != t.dtype() || out.device() != t.device() {
                Some(bad(format!(
                    "`out` is {} on {}, the input {} on {}",
                    out.dtype(),
                    out.device(),
                    t.dtype(),
                    t.device()
                )))
            } else {
                match &dims {
                    Some(d) if out.dims() != d.as_slice() => {
                        Some(bad(format!("`out` has shape {:?}, the result {d:?}", out.dims())))
                    }
                    _ => None,
                }
            };
        }
        let reuse = match (&self.backend, i.problem.is_none(), out.device()) {
            (Backend::Local(_), true, Device::Cpu) => out.take_storage_().ok(),
            _ => None,
        };
        let dest = reuse.map_or(Dest::New, Dest::Into);
        let device = i.device;
        let r = match &self.backend {
            // The device path exchanges no headers, so a problem with `out` alone cannot
            // be told to the peers: this member takes part (they would wait for it), then
            // reports the problem.
            _ if i.on_device => {
                let r = self.start_on_device(&i).and_then(|f| f.finish()).map(Some);
                match i.problem {
                    Some(e) => Err(e),
                    None => r,
                }
            }
            Backend::Local(l) => l.run(i.seq, i.call, i.tensor, i.problem, self.timeout, dest),
            Backend::Nccl(c) => c.run(i.seq, i.call, i.tensor, i.problem, self.timeout),
            Backend::Tcp(c) => c.run(i.seq, i.call, i.tensor, i.problem, self.timeout),
        };
        let r = expect_tensor(op, back_to(device, r)).and_then(|result| {
            if result.dims() != out.dims() {
                return Err(bad(format!(
                    "`out` has shape {:?}, the result {:?}",
                    out.dims(),
                    result.dims()
                )));
            }
            out.fill_storage_(result).map_err(|e| bad(format!("filling `out`: {e}")))
        });
        if r.is_err() && out.is_released() {
            // Its memory was lent to the failed collective: give it zeros.
            if let Ok(z) = Tensor::zeros(out.dims().to_vec(), out.dtype(), out.device()) {
                let _ = out.fill_storage_(z);
            }
        }
        r
    }

    /// Argument checks every member can make alone.
    fn check(&self, call: &Call, t: Option<&Tensor>) -> Result<()> {
        let op = call.name();
        let Some(t) = t else { return Ok(()) };
        let dim_ok = |dim: usize, what: &str| {
            if dim < t.rank() {
                Ok(())
            } else {
                Err(CollectiveError::InvalidArgument {
                    op,
                    why: format!("{what} {dim} out of range for a tensor of shape {}", t.shape()),
                })
            }
        };
        let float_ok = |rop: ReduceOp| {
            if rop == ReduceOp::Avg && t.dtype() == DType::I64 {
                Err(CollectiveError::InvalidArgument {
                    op,
                    why: "avg needs a float dtype, got i64 (use sum and divide)".into(),
                })
            } else {
                Ok(())
            }
        };
        match call {
            Call::Broadcast { src } => {
                if *src >= self.size() {
                    return Err(bad_rank(op, "src", *src, self.size()));
                }
                if *src != self.rank {
                    return Ok(());
                }
            }
            Call::AllReduce { op } => float_ok(*op)?,
            Call::ReduceScatter { dim, op } => {
                dim_ok(*dim, "dim")?;
                float_ok(*op)?;
            }
            Call::AllGather { dim } => dim_ok(*dim, "dim")?,
            Call::AllToAll { split_dim, concat_dim, sizes } => {
                dim_ok(*split_dim, "split_dim")?;
                dim_ok(*concat_dim, "concat_dim")?;
                if let Some(s) = sizes {
                    let size = t.dims()[*split_dim];
                    if s.len() != self.size() || s.iter().sum::<usize>() != size {
                        return Err(CollectiveError::InvalidArgument {
                            op,
                            why: format!(
                                "split sizes {s:?} must have {} entries summing to {size} \
                                 (dim {split_dim} of {})",
                                self.size(),
                                t.shape()
                            ),
                        });
                    }
                }
            }
            Call::Barrier => {}
        }
        Ok(())
    }

    fn start(&self, call: Call, t: &Tensor) -> Work {
        let op = call.name();
        let issued = self.issue(call, Some(t), true);
        let world = match &self.backend {
            Backend::Local(l) => l.world().clone(),
            // The device path: enqueued now; the caller's stream waits at `Work::wait`.
            Backend::Nccl(_) if issued.on_device => {
                let state = match self.start_on_device(&issued) {
                    Ok(f) => WorkState::OnDevice(f),
                    Err(e) => WorkState::Done(Err(e), Instant::now()),
                };
                return Work { op, state };
            }
            // The group's worker thread runs it: queue it and hand out the reply.
            Backend::Nccl(c) => return queue(op, c, issued, self.timeout),
            Backend::Tcp(c) => return queue(op, c, issued, self.timeout),
        };
        let me = self.global_rank;
        world.async_started(me);
        // The issued call is taken by the helper thread, or back here if none starts.
        let cell = Arc::new(Mutex::new(Some(issued)));
        // What the helper thread allocates (the call's output) is the issuing rank's.
        let rank = tpar_tensor::memory::rank();
        let job = {
            let cell = cell.clone();
            let pg = self.clone();
            let world = world.clone();
            move || {
                tpar_tensor::memory::set_rank(rank);
                let issued = cell.lock().unwrap_or_else(PoisonError::into_inner).take();
                let r = match issued {
                    Some(i) => {
                        catch_unwind(AssertUnwindSafe(|| pg.execute(i))).unwrap_or_else(|p| {
                            Err(CollectiveError::Panicked { rank: me, message: panic_message(&*p) })
                        })
                    }
                    None => Err(CollectiveError::InvalidArgument {
                        op,
                        why: "internal error: async call ran twice".into(),
                    }),
                };
                world.async_finished(me);
                (r, Instant::now())
            }
        };
        let spawned = std::thread::Builder::new().name(format!("tpar-work-{me}")).spawn(job);
        match spawned {
            Ok(h) => Work { op, state: WorkState::Running(h) },
            Err(_) => {
                // No thread could start: run the call here, synchronously.
                let issued = cell.lock().unwrap_or_else(PoisonError::into_inner).take();
                let r = match issued {
                    Some(i) => self.execute(i),
                    None => Err(CollectiveError::InvalidArgument {
                        op,
                        why: "internal error: async call lost".into(),
                    }),
                };
                world.async_finished(me);
                Work { op, state: WorkState::Done(r, Instant::now()) }
            }
        }
    }
}

/// Queues an issued call on a multi-process group's worker thread; the reply is the
/// returned `Work`'s.
fn queue<D: DeviceWork>(op: &'static str, c: &RemoteComm<D>, i: Issued, timeout: Duration) -> Work {
    let p = c.start(i.seq, i.call, i.tensor, i.problem, timeout);
    Work { op, state: WorkState::Queued(p, i.device) }
}

fn bad_rank(op: &'static str, what: &str, r: usize, size: usize) -> CollectiveError {
    CollectiveError::InvalidArgument {
        op,
        why: format!(
            "{what} {r} is not a rank of a group of size {size} (group ranks are 0..{size})"
        ),
    }
}

/// The detached host copy a multi-process (`nccl`, `tcp`) collective computes with:
/// CUDA tensors are staged through the host (counted in
/// `tpar_tensor::gpu::host_round_trips`). The local backend does not stage: it runs
/// collectives on CUDA tensors device to device (see the `local` module); nor does the
/// nccl backend's device path (see `nccl::ondevice`).
fn stage_to_host(op: &'static str, t: &Tensor) -> Result<Tensor> {
    let t = t.detach();
    if let Device::Cuda(_) = t.device() {
        tpar_tensor::gpu::count_host_round_trip();
        return t.to_device(Device::Cpu).map_err(|e| CollectiveError::InvalidArgument {
            op,
            why: format!("staging a {} tensor through the host: {e}", t.device()),
        });
    }
    Ok(t)
}

/// Moves a collective's result to the device the caller's tensor lives on.
fn back_to(device: Device, r: Result<Option<Tensor>>) -> Result<Option<Tensor>> {
    match (device, r) {
        (Device::Cuda(_), Ok(Some(t))) => {
            t.to_device(device).map(Some).map_err(|e| CollectiveError::InvalidArgument {
                op: "collective",
                why: format!("moving the result to {device}: {e}"),
            })
        }
        (_, r) => r,
    }
}

fn expect_tensor(op: &'static str, r: Result<Option<Tensor>>) -> Result<Tensor> {
    r?.ok_or_else(|| CollectiveError::InvalidArgument {
        op,
        why: "internal error: the collective produced no tensor".into(),
    })
}

enum WorkState {
    /// On a helper thread, which hands back the result and when it finished.
    Running(JoinHandle<(Result<Option<Tensor>>, Instant)>),
    Done(Result<Option<Tensor>>, Instant),
    /// Queued on a multi-process group's worker thread.
    Queued(Pending, Device),
    /// Enqueued on the device by the nccl backend (see `nccl::ondevice`).
    OnDevice(crate::nccl::ondevice::InFlight),
}

/// A collective in flight, returned by the `*_async` methods of [`ProcessGroup`].
///
/// The call is checked, recorded and numbered when it is issued (so async and sync calls
/// keep program order), then runs on a helper thread: the caller's computation overlaps
/// the whole collective, including waiting for slow peers. [`wait`](Work::wait) joins it.
/// Dropping a `Work` without waiting lets the collective finish in the background (peers
/// are not left waiting), but its result is lost.
pub struct Work {
    op: &'static str,
    state: WorkState,
}

impl Work {
    /// Waits for the collective and returns its result.
    pub fn wait(self) -> Result<Tensor> {
        self.wait_timed().map(|(t, _)| t)
    }

    /// [`wait`](Self::wait), also returning when the collective finished: on the local
    /// backend, when its helper thread did (which may be well before this call, when the
    /// collective overlapped other work); on the multi-process backends, when this rank
    /// received the result (at the latest, now).
    pub fn wait_timed(self) -> Result<(Tensor, Instant)> {
        let (r, at) = match self.state {
            WorkState::Done(r, at) => (r, at),
            WorkState::Running(h) => h.join().unwrap_or_else(|p| {
                let message = panic_message(&*p);
                (Err(CollectiveError::Panicked { rank: usize::MAX, message }), Instant::now())
            }),
            WorkState::Queued(p, device) => {
                let r = back_to(device, p.wait());
                (r, Instant::now())
            }
            WorkState::OnDevice(f) => (f.finish().map(Some), Instant::now()),
        };
        Ok((expect_tensor(self.op, r)?, at))
    }

    /// Whether the collective has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        match &self.state {
            WorkState::Done(..) => true,
            WorkState::Running(h) => h.is_finished(),
            WorkState::Queued(p, _) => p.is_completed(),
            WorkState::OnDevice(f) => f.is_completed(),
        }
    }

    /// The collective's name.
    pub fn op(&self) -> &'static str {
        self.op
    }
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("completed", &self.is_completed())
            .finish()
    }
}
