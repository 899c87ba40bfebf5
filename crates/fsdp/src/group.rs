//! An FSDP unit's parameters communicating together: one all-gather per unit per
//! gather, one reduce-scatter per unit per backward (FSDP2's `FSDPParamGroup`).
//!
//! **Gather (copy-in, all-gather, copy-out).** Each parameter's (tensor-parallel-local)
//! shape `[n, ...]` is split over the `k` dp ranks by the `torch.chunk` rule: rank `r`
//! holds rows `[r*c, min(n, (r+1)*c))` with `c = ceil(n / k)`, which may be fewer than `c`
//! (or none). Every rank copies its shards, cast to the compute dtype and each padded
//! with zeros to `c` rows, one after the other into one flat buffer of `S` elements
//! (the same `S` on every rank); one `all_gather` over dp makes `[k * S]`; viewed as
//! `[k, S]`, a parameter's columns `[off, off + c*R)` are its rows `[0, k*c)` (R elements
//! a row) in order, of which the first `n` are the unsharded parameter.
//!
//! **Reduce (copy-in, reduce-scatter, copy-out).** Once every parameter of the unit that
//! expects a gradient has received it (the unit's post-backward point), each gradient,
//! cast to the reduce dtype and padded to `k*c` rows, is laid out as `[k, c*R]` and the
//! unit's pieces are concatenated along dim 1 into `[k, S]`: row `r` is then exactly
//! what rank `r` keeps, so one `reduce_scatter` (averaged over dp) of the flat `[k * S]`
//! hands each rank its shards' gradients, which are added into the shards' `.grad()`
//! (cast to the shard's dtype). The reduce-scatter runs asynchronously: the rest of the
//! backward computes while it is in flight, and the unit's end-of-backward callback
//! ([`tpar_tensor::autograd::queue_callback`]) waits for it, so the gradients are in
//! place when `backward()` returns. A parameter that gets no gradient in a backward is
//! left out (its shard's gradient is untouched); the unit then reduces the others at
//! the end of the backward.
//!
//! **One dp rank.** Over a dp group of one, a gather is the shards themselves and an
//! average over one member is the gradient itself, so the unit issues no collective and
//! builds no flat buffer: each unsharded parameter is its shard cast to the compute
//! dtype (a copy when the dtype is the same), and each gradient, cast to the reduce
//! dtype and then to the shard's, is added into the shard's `.grad()`. The values are
//! those of the flat path, bit for bit; only the copies are gone.
//!
//! Parameters are bucketed by dtype (one collective per dtype present, usually one).
//! Every rank of the dp group must run the same units in the same order, as for any
//! collective.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tpar_collectives::{ProcessGroup, ReduceOp, Work};
use tpar_placements::chunk_range;
use tpar_tensor::autograd::queue_callback_once;
use tpar_tensor::{no_grad, DType, Device, Tensor};

use tpar_nn::{NnError, Result};

use crate::param::{into_tensor_error, FsdpParam};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One parameter's place in a flat buffer (its padded shard follows the previous
/// segment's in the per-rank buffer).
#[derive(Clone, Copy, Debug)]
struct Segment {
    /// The parameter's index in the group.
    index: usize,
    /// Rows of the unsharded parameter (`n`).
    rows: usize,
    /// Rows of a padded shard (`c = ceil(n / k)`).
    chunk: usize,
    /// Elements of one row (`R`).
    row_numel: usize,
}

/// A flat buffer's layout: one dtype, its members in order, `numel` elements per rank.
#[derive(Clone, Debug)]
struct Layout {
    dtype: DType,
    segments: Vec<Segment>,
    numel: usize,
}

/// A collective's result: in flight, or already here (with when it finished).
enum Outcome {
    InFlight(Box<Work>),
    Done(Tensor, Instant),
}

impl Outcome {
    fn wait(self) -> Result<(Tensor, Instant)> {
        match self {
            Outcome::InFlight(w) => Ok(w.wait_timed()?),
            Outcome::Done(t, at) => Ok((t, at)),
        }
    }
}

/// A collective of one bucket (`None` for an empty one, which needs none).
struct Flight {
    layout: Layout,
    work: Option<Outcome>,
}

/// The unit's all-gather in flight.
struct Gather {
    flights: Vec<Flight>,
    issued: Instant,
}

/// The unit's reduce-scatter in flight.
struct Reduce {
    flights: Vec<Flight>,
    /// Over a dp group of one: each member's gradient in the reduce dtype.
    ready: Vec<(usize, Tensor)>,
    issued: Instant,
}

#[derive(Default)]
struct State {
    gather: Option<Gather>,
    /// Unsharded gradients received in this backward, by parameter index.
    grads: Vec<Option<Tensor>>,
    received: usize,
    reduce: Option<Reduce>,
    /// When this backward's compute of the unit started (for the timeline).
    backward_since: Option<Instant>,
}

/// An FSDP unit's parameters, gathered and reduced together (see the module docs).
pub struct FsdpParamGroup {
    id: u64,
    name: Mutex<String>,
    params: Vec<Arc<FsdpParam>>,
    dp: ProcessGroup,
    state: Mutex<State>,
    timeline: Mutex<Option<FsdpTimeline>>,
}

impl std::fmt::Debug for FsdpParamGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FsdpParamGroup({:?}, {} parameters)", self.name(), self.params.len())
    }
}

impl FsdpParamGroup {
    /// Groups `params` (each sharded over `dp`, none already in a unit) into one unit
    /// named `name`. A unit may have no parameters (it then never communicates). Fails
    /// when a parameter is sharded over another group or already belongs to a unit.
    pub fn new(
        name: &str,
        dp: &ProcessGroup,
        params: Vec<Arc<FsdpParam>>,
    ) -> Result<Arc<FsdpParamGroup>> {
        let dp = dp.clone();
        if let Some(p) = params.iter().find(|p| p.dp().ranks() != dp.ranks()) {
            return Err(NnError::Config {
                what: format!(
                    "FSDP unit {name:?}: parameters sharded over different dp groups ({:?} and {:?})",
                    dp.ranks(),
                    p.dp().ranks()
                ),
            });
        }
        let group = Arc::new(FsdpParamGroup {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name: Mutex::new(name.to_string()),
            params,
            dp,
            state: Mutex::new(State::default()),
            timeline: Mutex::new(None),
        });
        for (i, p) in group.params.iter().enumerate() {
            p.link(&group, i)?;
        }
        Ok(group)
    }

    /// The unit's name (its module's FQN once known, else its type name).
    pub fn name(&self) -> String {
        self.name.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Renames the unit (for timelines and messages).
    pub fn set_name(&self, name: &str) {
        *self.name.lock().unwrap_or_else(|p| p.into_inner()) = name.to_string();
    }

    /// The unit's parameters, in order.
    pub fn params(&self) -> &[Arc<FsdpParam>] {
        &self.params
    }

    /// The dp group.
    pub fn dp(&self) -> &ProcessGroup {
        &self.dp
    }

    /// Records this unit's collectives and backward compute into `timeline` (`None`
    /// stops recording).
    pub fn set_timeline(&self, timeline: Option<FsdpTimeline>) {
        *self.timeline.lock().unwrap_or_else(|p| p.into_inner()) = timeline;
    }

    /// The timeline this unit records into, if any.
    pub fn timeline(&self) -> Option<FsdpTimeline> {
        self.timeline.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, kind: TimelineKind, start: Instant, end: Instant, blocked: Duration) {
        if let Some(t) = self.timeline() {
            t.record(&self.name(), kind, start, end, blocked);
        }
    }

    /// The parameters that take part in gathers: those whose shard holds data.
    fn materialized(&self) -> Vec<usize> {
        (0..self.params.len())
            .filter(|&i| self.params[i].sharded().device() != Device::Meta)
            .collect()
    }

    /// Whether some materialized parameter's unsharded storage is released.
    fn needs_gather(&self) -> bool {
        self.materialized().iter().any(|&i| self.params[i].unsharded().is_released())
    }

    /// Whether every parameter's unsharded data is available now.
    pub fn is_unsharded(&self) -> bool {
        !self.needs_gather()
    }

    /// Whether a gather of this unit is in flight (started and not yet waited for).
    pub fn is_gathering(&self) -> bool {
        self.state().gather.is_some()
    }

    /// The flat layouts of `members` (parameter indices, in order), one per dtype
    /// (`dtype_of` a parameter), dtypes in order of first appearance.
    fn layouts(&self, members: &[usize], dtype_of: impl Fn(&FsdpParam) -> DType) -> Vec<Layout> {
        let k = self.dp.size();
        let mut out: Vec<Layout> = Vec::new();
        for &i in members {
            let p = &self.params[i];
            let dtype = dtype_of(p);
            let shape = p.local_shape();
            let (rows, row_numel) = (shape[0], shape[1..].iter().product::<usize>());
            let chunk = rows.div_ceil(k);
            let pos = match out.iter().position(|l| l.dtype == dtype) {
                Some(pos) => pos,
                None => {
                    out.push(Layout { dtype, segments: Vec::new(), numel: 0 });
                    out.len() - 1
                }
            };
            let l = &mut out[pos];
            l.segments.push(Segment { index: i, rows, chunk, row_numel });
            l.numel += chunk * row_numel;
        }
        out
    }

    /// This rank's padded shards of `layout`, cast to its dtype, as one flat buffer.
    fn copy_in_shards(&self, layout: &Layout) -> Result<Tensor> {
        let (k, r) = (self.dp.size(), self.dp.rank());
        no_grad(|| {
            let mut parts = Vec::with_capacity(2 * layout.segments.len());
            let mut device = Device::Cpu;
            for s in &layout.segments {
                let shard = self.params[s.index].sharded().detach();
                device = shard.device();
                let (_, len) = chunk_range(s.rows, k, r);
                if shard.numel() != len * s.row_numel {
                    return Err(NnError::Config {
                        what: format!(
                            "FSDP unit {:?}: parameter {} holds {} elements, its shard of {:?} has {}",
                            self.name(),
                            s.index,
                            shard.numel(),
                            self.params[s.index].local_shape(),
                            len * s.row_numel
                        ),
                    });
                }
                // The compute-dtype shard: the optimizer's working copy when current.
                let cast = match layout.dtype == shard.dtype() {
                    true => shard,
                    false => self.params[s.index].compute_shard()?.to_dtype(layout.dtype)?,
                };
                parts.push(cast.reshape([len * s.row_numel])?);
                let pad = (s.chunk - len) * s.row_numel;
                if pad > 0 {
                    parts.push(Tensor::zeros([pad], layout.dtype, device)?);
                }
            }
            match parts.is_empty() {
                true => Ok(Tensor::zeros([0], layout.dtype, device)?),
                false => Ok(Tensor::cat(&parts, 0)?),
            }
        })
    }

    /// Fills each member's unsharded storage (where released) from `full`, the
    /// all-gathered `[k * S]` buffer of `layout`.
    fn copy_out_params(&self, layout: &Layout, full: Tensor) -> Result<()> {
        let k = self.dp.size();
        no_grad(|| {
            // The segments tile `[0, S)` in order: one split (one launch on a GPU)
            // cuts every parameter's `[k, c*R]` columns out.
            let sizes: Vec<usize> = layout.segments.iter().map(|s| s.chunk * s.row_numel).collect();
            let pieces = full.reshape([k, layout.numel])?.split_sizes(&sizes, 1)?;
            for (s, piece) in layout.segments.iter().zip(pieces) {
                let p = &self.params[s.index];
                let u = p.unsharded();
                if !u.is_released() {
                    continue;
                }
                let mut dims = p.local_shape().to_vec();
                dims[0] = k * s.chunk;
                // `{ piece }` drops the piece's handle with the statement, so the
                // storage moves into the parameter instead of being copied again.
                let cut = { piece }.reshape(dims)?.narrow(0, 0, s.rows)?;
                u.fill_storage_(cut)?;
            }
            Ok(())
        })
    }

    /// Starts the unit's all-gather (returns at once; [`FsdpParamGroup::unshard`] waits
    /// for it). A no-op when the unit is gathered or a gather is in flight.
    pub fn unshard_async(&self) -> Result<()> {
        let mut st = self.state();
        if st.gather.is_some() || self.single() || !self.needs_gather() {
            return Ok(());
        }
        st.gather = Some(self.issue_gather(true)?);
        Ok(())
    }

    fn issue_gather(&self, is_async: bool) -> Result<Gather> {
        let issued = Instant::now();
        let mut flights = Vec::new();
        for layout in self.layouts(&self.materialized(), |p| p.param_dtype()) {
            let work = if layout.numel == 0 {
                None
            } else {
                let flat = self.copy_in_shards(&layout)?;
                Some(match is_async {
                    true => Outcome::InFlight(Box::new(self.dp.all_gather_async(&flat, 0))),
                    false => Outcome::Done(self.dp.all_gather(&flat, 0)?, Instant::now()),
                })
            };
            flights.push(Flight { layout, work });
        }
        Ok(Gather { flights, issued })
    }

    /// Makes the unit's unsharded parameters available: waits for a gather in flight,
    /// or gathers now (one all-gather per dtype); a no-op when they already are.
    pub fn unshard(&self) -> Result<()> {
        let mut st = self.state();
        let gather = match st.gather.take() {
            Some(g) => g,
            None if self.single() && self.needs_gather() => return self.fill_from_shards(),
            None if self.needs_gather() => self.issue_gather(false)?,
            None => return Ok(()),
        };
        drop(st);
        let waited = Instant::now();
        let mut done = waited;
        let k = self.dp.size();
        for f in gather.flights {
            let full = match f.work {
                Some(w) => {
                    let (t, at) = w.wait()?;
                    done = done.max(at);
                    t
                }
                None => Tensor::zeros([0], f.layout.dtype, Device::Cpu)?,
            };
            if full.numel() != k * f.layout.numel {
                return Err(NnError::Config {
                    what: format!(
                        "FSDP unit {:?}: all_gather returned {} elements, expected {}",
                        self.name(),
                        full.numel(),
                        k * f.layout.numel
                    ),
                });
            }
            self.copy_out_params(&f.layout, full)?;
        }
        let blocked = done.saturating_duration_since(waited);
        self.record(TimelineKind::AllGather, gather.issued, done.max(gather.issued), blocked);
        Ok(())
    }

    /// Whether the dp group has one member (see the module docs: no collectives then).
    fn single(&self) -> bool {
        self.dp.size() == 1
    }

    /// Over a dp group of one: fills each released unsharded parameter with its shard
    /// cast to the compute dtype, which is what the gather would give.
    fn fill_from_shards(&self) -> Result<()> {
        no_grad(|| {
            for i in self.materialized() {
                let p = &self.params[i];
                let u = p.unsharded();
                if !u.is_released() {
                    continue;
                }
                let shard = p.sharded().detach();
                let cast = match shard.dtype() == p.param_dtype() {
                    // A copy of its own: the optimizer updates the shard in place.
                    true => shard.deep_clone()?,
                    // The working copy when current (copied into the parameter's own
                    // storage, as it is kept), else the cast shard (moved).
                    false => p.compute_shard()?,
                };
                // `{ cast }` drops the cast's handle with the statement, so the storage
                // moves into the parameter instead of being copied again.
                let cast = { cast }.reshape(p.local_shape().to_vec())?;
                u.fill_storage_(cast)?;
            }
            Ok(())
        })
    }

    /// Waits for a gather in flight and drops its result (the shards changed since it
    /// started, or the unit did not run after all).
    pub fn discard_prefetch(&self) -> Result<()> {
        let gather = self.state().gather.take();
        if let Some(g) = gather {
            for f in g.flights {
                if let Some(w) = f.work {
                    w.wait()?;
                }
            }
        }
        Ok(())
    }

    /// Releases every parameter's unsharded storage. Returns the bytes freed.
    pub fn reshard(&self) -> usize {
        self.params.iter().map(|p| p.reshard()).sum()
    }

    /// Queues this unit's end-of-backward work ([`FsdpParamGroup::finish_backward`]) in
    /// the running backward pass, once per pass.
    fn queue_finish(self: &Arc<Self>) -> Result<()> {
        let me = Arc::downgrade(self);
        queue_callback_once(self.id, move || match me.upgrade() {
            Some(g) => g.finish_backward().map_err(into_tensor_error),
            None => Ok(()),
        })?;
        Ok(())
    }

    /// The unit's pre-backward: gathers its parameters (waiting for a prefetch) and
    /// makes sure its end-of-backward work runs. Call it from a backward closure.
    pub fn pre_backward(self: &Arc<Self>) -> Result<()> {
        self.queue_finish()?;
        self.unshard()?;
        self.state().backward_since.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Starts gathering the unit for its coming backward (a prefetch from the unit whose
    /// backward runs before it). Call it from a backward closure.
    pub fn prefetch_backward(self: &Arc<Self>) -> Result<()> {
        self.queue_finish()?;
        self.unshard_async()
    }

    /// Takes the unsharded gradient of member `index`; once every member that expects
    /// one has it, starts the unit's reduce-scatter and releases the unsharded
    /// parameters. Called by the members' all-gather nodes in backward.
    pub(crate) fn deposit_grad(self: &Arc<Self>, index: usize, g: &Tensor) -> Result<()> {
        self.queue_finish()?;
        let mut st = self.state();
        if st.grads.len() != self.params.len() {
            st.grads = vec![None; self.params.len()];
        }
        let g = no_grad(|| g.detach());
        match st.grads[index].take() {
            Some(old) => st.grads[index] = Some(no_grad(|| old.add(&g))?),
            None => {
                st.grads[index] = Some(g);
                st.received += 1;
            }
        }
        let expected = self.params.iter().filter(|p| p.expects_grad()).count();
        if st.received >= expected && st.reduce.is_none() {
            self.issue_reduce(&mut st)?;
        }
        Ok(())
    }

    /// Packs the received gradients and starts their reduce-scatter; releases the
    /// unsharded parameters.
    fn issue_reduce(&self, st: &mut State) -> Result<()> {
        let issued = Instant::now();
        let grads = std::mem::take(&mut st.grads);
        st.received = 0;
        let members: Vec<usize> = (0..grads.len()).filter(|&i| grads[i].is_some()).collect();
        let k = self.dp.size();
        let mut flights = Vec::new();
        // Over one dp rank each gradient is its own reduction: nothing to lay out.
        let (ready, members) = match self.single() {
            true => {
                let cast = |i: usize| -> Result<(usize, Tensor)> {
                    let g = grads[i].as_ref().ok_or_else(|| NnError::Config {
                        what: "internal error: a gradient left the FSDP unit".into(),
                    })?;
                    Ok((i, no_grad(|| g.to_dtype(self.params[i].reduce_dtype()))?))
                };
                (members.into_iter().map(cast).collect::<Result<Vec<_>>>()?, Vec::new())
            }
            false => (Vec::new(), members),
        };
        for layout in self.layouts(&members, |p| p.reduce_dtype()) {
            if layout.numel == 0 {
                flights.push(Flight { layout, work: None });
                continue;
            }
            let flat = no_grad(|| -> Result<Tensor> {
                let mut parts = Vec::with_capacity(layout.segments.len());
                for s in &layout.segments {
                    let g = grads[s.index].as_ref().ok_or_else(|| NnError::Config {
                        what: "internal error: a gradient left the FSDP unit".into(),
                    })?;
                    let n = s.rows * s.row_numel;
                    let mut g = g.to_dtype(layout.dtype)?.reshape([n])?;
                    let pad = k * s.chunk * s.row_numel - n;
                    if pad > 0 {
                        let z = Tensor::zeros([pad], layout.dtype, g.device())?;
                        g = Tensor::cat(&[g, z], 0)?;
                    }
                    parts.push(g.reshape([k, s.chunk * s.row_numel])?);
                }
                Ok(Tensor::cat(&parts, 1)?.reshape([k * layout.numel])?)
            })?;
            let work = self.dp.reduce_scatter_async(&flat, 0, ReduceOp::Avg);
            flights.push(Flight { layout, work: Some(Outcome::InFlight(Box::new(work))) });
        }
        drop(grads);
        if let Some(since) = st.backward_since.take() {
            self.record(TimelineKind::Backward, since, issued, Duration::ZERO);
        }
        st.reduce = Some(Reduce { flights, ready, issued });
        self.reshard();
        Ok(())
    }

    /// Waits for the reduce-scatter and adds each shard's piece into its `.grad()`.
    fn complete_reduce(&self, reduce: Reduce) -> Result<()> {
        let (k, r) = (self.dp.size(), self.dp.rank());
        let waited = Instant::now();
        let mut done = waited;
        no_grad(|| -> Result<()> {
            for (i, g) in reduce.ready {
                self.add_to_shard_grad(i, g)?;
            }
            Ok(())
        })?;
        for f in reduce.flights {
            let Some(w) = f.work else { continue };
            let (out, at) = w.wait()?;
            done = done.max(at);
            no_grad(|| -> Result<()> {
                // One split (one launch on a GPU) into the members' padded shards.
                let sizes: Vec<usize> =
                    f.layout.segments.iter().map(|s| s.chunk * s.row_numel).collect();
                let pieces = out.split_sizes(&sizes, 0)?;
                for (s, piece) in f.layout.segments.iter().zip(pieces) {
                    let (_, len) = chunk_range(s.rows, k, r);
                    self.add_to_shard_grad(s.index, piece.narrow(0, 0, len * s.row_numel)?)?;
                }
                Ok(())
            })?;
        }
        let blocked = done.saturating_duration_since(waited);
        self.record(TimelineKind::ReduceScatter, reduce.issued, done.max(reduce.issued), blocked);
        Ok(())
    }

    /// Adds `g` (member `i`'s reduced gradient shard, any shape of its elements and any
    /// float dtype) into the shard's `.grad()`, cast to the shard's dtype.
    fn add_to_shard_grad(&self, i: usize, g: Tensor) -> Result<()> {
        // An optimizer may change the shard from now on.
        self.params[i].working_out_of_date();
        let leaf = self.params[i].sharded();
        let g = g.reshape(leaf.shape().clone())?.to_dtype(leaf.dtype())?;
        let g = match leaf.grad() {
            Some(old) => old.add(&g)?,
            None => g,
        };
        leaf.set_grad(Some(g));
        Ok(())
    }

    /// The unit's end of backward (queued by its pre-backward and by its first
    /// gradient): reduce-scatters the gradients received but not yet reduced (some
    /// parameter got none), waits for the reduce-scatter and fills the shards'
    /// `.grad()`, drops a gather that was prefetched but not used, and releases the
    /// unsharded parameters. Runs by itself at the end of every backward pass that
    /// touched the unit; calling it again is a no-op.
    pub fn finish_backward(&self) -> Result<()> {
        let reduce = {
            let mut st = self.state();
            if st.received > 0 && st.reduce.is_none() {
                self.issue_reduce(&mut st)?;
            }
            st.grads.clear();
            st.received = 0;
            st.backward_since = None;
            st.reduce.take()
        };
        if let Some(r) = reduce {
            self.complete_reduce(r)?;
        }
        self.discard_prefetch()?;
        self.reshard();
        Ok(())
    }

    /// Whether a reduce-scatter of this unit is in flight.
    pub fn is_reducing(&self) -> bool {
        self.state().reduce.is_some()
    }
}

/// What a [`TimelineEvent`] spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TimelineKind {
    /// The unit's forward compute (children's forwards included).
    Forward,
    /// The unit's backward compute, from its pre-backward to its reduce-scatter's start.
    Backward,
    /// The unit's all-gather, from its start to its end.
    AllGather,
    /// The unit's reduce-scatter, from its start to its end.
    ReduceScatter,
}

impl TimelineKind {
    /// A short name (`forward`, `backward`, `all_gather`, `reduce_scatter`).
    pub fn name(&self) -> &'static str {
        match self {
            TimelineKind::Forward => "forward",
            TimelineKind::Backward => "backward",
            TimelineKind::AllGather => "all_gather",
            TimelineKind::ReduceScatter => "reduce_scatter",
        }
    }
}

/// One span of a [`FsdpTimeline`].
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineEvent {
    /// The unit.
    pub unit: String,
    /// What ran.
    pub kind: TimelineKind,
    /// Start, since the timeline's origin.
    pub start: Duration,
    /// End, since the timeline's origin. For a collective: when it finished (on the
    /// local backend, when its helper thread did; otherwise when its result was taken).
    pub end: Duration,
    /// For a collective: how long the compute waited for it (0 when it was done by
    /// the time it was needed: fully overlapped).
    pub blocked: Duration,
}

struct TimelineData {
    origin: Instant,
    events: Vec<TimelineEvent>,
}

/// A per-rank record of when each FSDP unit computed and communicated: the start and
/// end of every unit's forward and backward compute and of every all-gather and
/// reduce-scatter, to see what overlapped. Cheap to clone (clones share the record).
#[derive(Clone)]
pub struct FsdpTimeline {
    inner: Arc<Mutex<TimelineData>>,
}

impl Default for FsdpTimeline {
    fn default() -> Self {
        FsdpTimeline::new()
    }
}

impl std::fmt::Debug for FsdpTimeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FsdpTimeline({} events)", self.events().len())
    }
}

impl FsdpTimeline {
    /// An empty timeline whose origin is now.
    pub fn new() -> Self {
        FsdpTimeline {
            inner: Arc::new(Mutex::new(TimelineData {
                origin: Instant::now(),
                events: Vec::new(),
            })),
        }
    }

    fn data(&self) -> MutexGuard<'_, TimelineData> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets the events and moves the origin to now.
    pub fn clear(&self) {
        let mut d = self.data();
        d.events.clear();
        d.origin = Instant::now();
    }

    /// Appends a span (times before the origin count as the origin).
    pub fn record(
        &self,
        unit: &str,
        kind: TimelineKind,
        start: Instant,
        end: Instant,
        blocked: Duration,
    ) {
        let mut d = self.data();
        let (s, e) =
            (start.saturating_duration_since(d.origin), end.saturating_duration_since(d.origin));
        d.events.push(TimelineEvent {
            unit: unit.to_string(),
            kind,
            start: s,
            end: e.max(s),
            blocked,
        });
    }

    /// The spans, in the order they were recorded.
    pub fn events(&self) -> Vec<TimelineEvent> {
        self.data().events.clone()
    }

    /// The spans as a table sorted by start (times in ms), then one bar per unit and
    /// kind over `width` columns (`#` compute, `=` collective in flight, `!` where the
    /// compute waited for it).
    pub fn render(&self, width: usize) -> String {
        use std::fmt::Write;
        let mut events = self.events();
        events.sort_by(|a, b| a.start.cmp(&b.start).then(a.kind.cmp(&b.kind)));
        let mut out = String::new();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let _ = writeln!(
            out,
            "{:>9} {:>9} {:>9}  {:<15} {:<24} {:>9}",
            "start_ms", "end_ms", "dur_ms", "what", "unit", "waited_ms"
        );
        for e in &events {
            let _ = writeln!(
                out,
                "{:>9.3} {:>9.3} {:>9.3}  {:<15} {:<24} {:>9.3}",
                ms(e.start),
                ms(e.end),
                ms(e.end - e.start),
                e.kind.name(),
                e.unit,
                ms(e.blocked)
            );
        }
        let total = events.iter().map(|e| e.end).max().unwrap_or_default();
        let width = width.max(10);
        if total.is_zero() || events.is_empty() {
            return out;
        }
        let col = |d: Duration| {
            ((d.as_secs_f64() / total.as_secs_f64()) * (width - 1) as f64).round() as usize
        };
        let mut rows: Vec<(String, TimelineKind)> = Vec::new();
        for e in &events {
            let key = (e.unit.clone(), e.kind);
            if !rows.contains(&key) {
                rows.push(key);
            }
        }
        rows.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(&b.0)));
        let _ =
            writeln!(out, "{:<40} |0{:>w$}|", "", format!("{:.1} ms", ms(total)), w = width - 1);
        for (unit, kind) in rows {
            let mut bar = vec![' '; width];
            for e in events.iter().filter(|e| e.unit == unit && e.kind == kind) {
                let (a, b) = (col(e.start), col(e.end).max(col(e.start)));
                let collective =
                    matches!(kind, TimelineKind::AllGather | TimelineKind::ReduceScatter);
                let blocked_from = col(e.end.saturating_sub(e.blocked));
                for (c, cell) in bar.iter_mut().enumerate().take(b + 1).skip(a) {
                    *cell = match (collective, e.blocked > Duration::ZERO && c >= blocked_from) {
                        (false, _) => '#',
                        (true, true) => '!',
                        (true, false) => '=',
                    };
                }
            }
            let label = format!("{unit} {}", kind.name());
            let _ = writeln!(out, "{label:<40} |{}|", bar.into_iter().collect::<String>());
        }
        out
    }
}
