//! Replicated data parallelism (DDP), hooked into the backward pass as PyTorch's
//! `DistributedDataParallel` is: every rank holds every parameter; as the backward pass
//! produces each parameter's gradient (a post-accumulate-grad hook on its leaf), the
//! parameter joins its bucket, and a full bucket is averaged over dp with one
//! asynchronous all_reduce while the backward goes on with the layers before it. An
//! end-of-backward callback waits for the buckets and puts the averages in place, so
//! the gradients are synchronized when `backward()` returns, with no call from the
//! training loop.
//!
//! Buckets hold parameters of one dtype in reverse registration order (the order a
//! backward pass produces their gradients), up to [`DataParallel::bucket_cap_bytes`]
//! each (25 MiB by default, as PyTorch's `bucket_cap_mb`), and start in that order on
//! every rank, so the ranks' all_reduces always pair up. [`DataParallel::no_sync`]
//! accumulates gradients locally (gradient accumulation over micro-batches): the next
//! synchronized backward averages the accumulated sum, and
//! [`DataParallel::sync_gradients`] averages it on request (a pipeline schedule's
//! micro-batches, whose last backward is not the loop's).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tpar_collectives::{ProcessGroup, ReduceOp, Work};
use tpar_mesh::DeviceMesh;
use tpar_nn::{Module, NnError};
use tpar_tensor::autograd::queue_callback_once;
use tpar_tensor::{Tensor, TensorError};

use crate::{PlanError, Result};

/// PyTorch DDP's default bucket size, `bucket_cap_mb = 25`.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 << 20;

/// Broadcasts `module`'s parameters from dp rank 0 over the 1-d `dp_mesh`, so every
/// replica starts equal (PyTorch DDP's `_sync_module_states`): what [`DataParallel::new`]
/// does first, and what a ZeRO-1 optimizer (which reduces gradients itself) needs alone.
pub fn sync_module_states(module: &mut dyn Module, dp_mesh: &DeviceMesh) -> Result<()> {
    let dp = dp_group(dp_mesh)?;
    for p in tpar_nn::parameters(module) {
        let t = p.trainable();
        let src = dp.broadcast(&t.detach(), 0).map_err(NnError::from)?;
        t.copy_(&src).map_err(NnError::from)?;
    }
    Ok(())
}

fn dp_group(dp_mesh: &DeviceMesh) -> Result<ProcessGroup> {
    if dp_mesh.ndim() != 1 {
        return Err(PlanError::BadStyle {
            style: "DataParallel".into(),
            what: format!("needs a 1-d mesh, got {dp_mesh}"),
        });
    }
    Ok(dp_mesh.group(0).map_err(NnError::from)?.clone())
}

/// Replicated data parallelism over a dp mesh dim (DDP); see the module docs.
///
/// ```
/// use tpar_collectives::{spawn_with, SpawnConfig};
/// use tpar_mesh::{DeviceMesh, DeviceType};
/// use tpar_nn::{call, Args, Linear, NnError};
/// use tpar_parallel_styles::DataParallel;
/// use tpar_tensor::{DType, Device, Tensor};
/// let grads = spawn_with(SpawnConfig::new(2), |ctx| -> Result<Vec<f32>, NnError> {
///     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
///     let mut lin = Linear::new(2, 1, false, DType::F32, Device::Cpu)?;
///     let ddp = DataParallel::new(&mut lin, &mesh);
///     let _ddp = ddp.map_err(|e| NnError::Config { what: e.to_string() })?;
///     // Each rank its own input: the gradient is averaged over the two by backward().
///     let x = Tensor::from_vec(vec![1.0f32 + ctx.rank() as f32, 0.0], [1, 2])?;
///     let y = call(&lin, Args::one(x))?.into_tensor("y")?;
///     y.sum_all()?.backward()?;
///     Ok(lin.weight.trainable().grad().unwrap().to_vec::<f32>()?)
/// })?;
/// assert_eq!(grads[0], vec![1.5, 0.0]);
/// assert_eq!(grads[0], grads[1]);
/// # Ok::<(), NnError>(())
/// ```
#[derive(Clone)]
pub struct DataParallel {
    reducer: Arc<Reducer>,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DataParallel(dp {:?}, {} parameters in {} buckets)",
            self.reducer.dp.ranks(),
            self.reducer.bucket_of.len(),
            self.reducer.buckets.len()
        )
    }
}

/// The gradient averaging of one [`DataParallel`]. Its leaves' hooks own it; it holds
/// no tensor between backward passes (so no cycle keeps a model alive).
struct Reducer {
    dp: ProcessGroup,
    /// Leaf ids of each bucket's parameters, in launch order.
    buckets: Vec<Vec<u64>>,
    /// The bucket of each leaf, by id.
    bucket_of: HashMap<u64, usize>,
    /// Whether backward passes synchronize (false under [`DataParallel::no_sync`]).
    sync: AtomicBool,
    /// Key of this reducer's end-of-backward callback.
    id: u64,
    pass: Mutex<Pass>,
}

/// The reducer's state during one backward pass.
#[derive(Default)]
struct Pass {
    active: bool,
    /// The leaves whose gradients this pass has produced, by id.
    ready: HashMap<u64, Tensor>,
    /// Parameters of each bucket whose gradients are still to come.
    left: Vec<usize>,
    /// The next bucket to start.
    next: usize,
    /// Started buckets: their all_reduce and the leaves it averages, in bucket order.
    started: Vec<Started>,
}

/// A bucket's all_reduce in flight over the gradients of `leaves`.
struct Started {
    work: Work,
    leaves: Vec<Tensor>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn tensor_err(e: impl Into<NnError>) -> TensorError {
    match e.into() {
        NnError::Tensor(t) => t,
        other => TensorError::External(Arc::new(other)),
    }
}

impl Reducer {
    /// `leaf`'s gradient has been accumulated by the running backward pass.
    fn on_ready(self: &Arc<Self>, leaf: &Tensor) -> tpar_tensor::Result<()> {
        if !self.sync.load(Ordering::Acquire) || self.dp.size() == 1 {
            return Ok(());
        }
        let Some(&b) = self.bucket_of.get(&leaf.id()) else { return Ok(()) };
        let mut pass = self.pass.lock().unwrap_or_else(|p| p.into_inner());
        if !pass.active {
            *pass = Pass {
                active: true,
                left: self.buckets.iter().map(Vec::len).collect(),
                ..Pass::default()
            };
            let me = Arc::downgrade(self);
            queue_callback_once(self.id, move || match me.upgrade() {
                Some(r) => r.finish(),
                None => Ok(()),
            })?;
        }
        if pass.ready.insert(leaf.id(), leaf.clone()).is_none() {
            pass.left[b] = pass.left[b].saturating_sub(1);
        }
        // Buckets start in order, so every rank's all_reduces pair up.
        while pass.next < self.buckets.len() && pass.left[pass.next] == 0 {
            let b = pass.next;
            pass.next += 1;
            if let Some(s) = self.start(b, &pass.ready)? {
                pass.started.push(s);
            }
        }
        Ok(())
    }

    /// Starts bucket `b`'s all_reduce over the gradients of its leaves found in
    /// `leaves` (`None` when none has one).
    fn start(
        &self,
        b: usize,
        leaves: &HashMap<u64, Tensor>,
    ) -> tpar_tensor::Result<Option<Started>> {
        let mut with_grads = Vec::new();
        let mut flat = Vec::new();
        for id in &self.buckets[b] {
            let Some(leaf) = leaves.get(id) else { continue };
            let Some(g) = leaf.grad() else { continue };
            flat.push(g.detach().reshape([g.numel()])?);
            with_grads.push(leaf.clone());
        }
        if flat.is_empty() {
            return Ok(None);
        }
        let bucket = if flat.len() == 1 { flat[0].deep_clone()? } else { Tensor::cat(&flat, 0)? };
        let work = self.dp.all_reduce_async(&bucket, ReduceOp::Avg);
        Ok(Some(Started { work, leaves: with_grads }))
    }

    /// End of the backward pass: starts the buckets still waiting (parameters that got
    /// no gradient), waits for every bucket and puts the averages in place.
    fn finish(&self) -> tpar_tensor::Result<()> {
        let started = {
            let mut pass = self.pass.lock().unwrap_or_else(|p| p.into_inner());
            while pass.next < self.buckets.len() {
                let b = pass.next;
                pass.next += 1;
                if let Some(s) = self.start(b, &pass.ready)? {
                    pass.started.push(s);
                }
            }
            let started = std::mem::take(&mut pass.started);
            *pass = Pass::default();
            started
        };
        Self::put_back(started)
    }

    /// Waits for each bucket and splits its averaged gradients back into its leaves'.
    fn put_back(started: Vec<Started>) -> tpar_tensor::Result<()> {
        for Started { work, leaves } in started {
            let avg = work.wait().map_err(tensor_err)?;
            let mut at = 0;
            for t in leaves {
                let Some(g) = t.grad() else { continue };
                let piece = avg.narrow(0, at, g.numel())?.reshape(g.shape().clone())?;
                at += g.numel();
                t.set_grad(Some(piece));
            }
        }
        Ok(())
    }
}

/// Disables gradient synchronization while it lives (see [`DataParallel::no_sync`]).
#[derive(Debug)]
pub struct NoSync<'a> {
    ddp: &'a DataParallel,
    was: bool,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        self.ddp.reducer.sync.store(self.was, Ordering::Release);
    }
}

impl DataParallel {
    /// Data parallelism over the 1-d `dp_mesh`: broadcasts `module`'s parameters from dp
    /// rank 0 so every replica starts equal ([`sync_module_states`]), then hooks every
    /// parameter's leaf so backward passes average the gradients over dp, in buckets of
    /// at most [`DEFAULT_BUCKET_CAP_BYTES`].
    pub fn new(module: &mut dyn Module, dp_mesh: &DeviceMesh) -> Result<DataParallel> {
        DataParallel::with_bucket_cap(module, dp_mesh, DEFAULT_BUCKET_CAP_BYTES)
    }

    /// [`DataParallel::new`] with buckets of at most `cap_bytes` (at least one
    /// parameter each).
    pub fn with_bucket_cap(
        module: &mut dyn Module,
        dp_mesh: &DeviceMesh,
        cap_bytes: usize,
    ) -> Result<DataParallel> {
        sync_module_states(module, dp_mesh)?;
        let dp = dp_group(dp_mesh)?;
        let params: Vec<Tensor> =
            tpar_nn::parameters(module).iter().map(|p| p.trainable()).collect();
        // Reverse registration order (a backward's), one dtype per bucket: a bucket
        // closes when the next parameter of its dtype would take it past the cap.
        let mut buckets: Vec<Vec<u64>> = Vec::new();
        let mut open: Vec<(tpar_tensor::DType, usize, usize)> = Vec::new(); // dtype, bucket, bytes
        let mut bucket_of = HashMap::new();
        for t in params.iter().rev() {
            let bytes = t.numel() * t.dtype().size_in_bytes();
            let slot = open.iter().position(|(d, _, _)| *d == t.dtype());
            let b = match slot {
                Some(k) if open[k].2 + bytes <= cap_bytes => {
                    open[k].2 += bytes;
                    open[k].1
                }
                _ => {
                    buckets.push(Vec::new());
                    let b = buckets.len() - 1;
                    match slot {
                        Some(k) => open[k] = (t.dtype(), b, bytes),
                        None => open.push((t.dtype(), b, bytes)),
                    }
                    b
                }
            };
            buckets[b].push(t.id());
            bucket_of.insert(t.id(), b);
        }
        let reducer = Arc::new(Reducer {
            dp,
            buckets,
            bucket_of,
            sync: AtomicBool::new(true),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed) | (1 << 62),
            pass: Mutex::new(Pass::default()),
        });
        for t in &params {
            let r = Arc::clone(&reducer);
            t.register_post_accumulate_grad_hook(Arc::new(move |leaf: &Tensor| r.on_ready(leaf)));
        }
        Ok(DataParallel { reducer })
    }

    /// How many buckets the gradients are averaged in (each one all_reduce per
    /// synchronized backward).
    pub fn num_buckets(&self) -> usize {
        self.reducer.buckets.len()
    }

    /// PyTorch's `no_sync()`: backward passes while the guard lives accumulate gradients
    /// on each rank without communicating; the next synchronized backward (or
    /// [`DataParallel::sync_gradients`]) averages the accumulated sums.
    pub fn no_sync(&self) -> NoSync<'_> {
        let was = self.reducer.sync.swap(false, Ordering::AcqRel);
        NoSync { ddp: self, was }
    }

    /// Whether backward passes synchronize gradients now (false under
    /// [`DataParallel::no_sync`]).
    pub fn requires_gradient_sync(&self) -> bool {
        self.reducer.sync.load(Ordering::Acquire)
    }

    /// Averages `module`'s accumulated gradients over dp now, in the same buckets: for
    /// gradients accumulated under [`DataParallel::no_sync`] with no synchronized
    /// backward after them (a pipeline schedule's micro-batches), or set by hand. A
    /// synchronized backward does this itself; calling it after one averages again. With
    /// one dp rank nothing is issued.
    pub fn sync_gradients(&self, module: &dyn Module) -> Result<()> {
        let r = &self.reducer;
        if r.dp.size() == 1 {
            return Ok(());
        }
        let leaves: HashMap<u64, Tensor> = tpar_nn::parameters(module)
            .iter()
            .map(|p| p.trainable())
            .map(|t| (t.id(), t))
            .collect();
        let mut started = Vec::with_capacity(r.buckets.len());
        for b in 0..r.buckets.len() {
            started.extend(r.start(b, &leaves).map_err(NnError::from)?);
        }
        Reducer::put_back(started).map_err(NnError::from)?;
        Ok(())
    }
}
