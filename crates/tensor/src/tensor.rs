//! The `Tensor` type: a shape, a dtype, a device, shared storage and an autograd node.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use crate::autograd::Node;
use crate::gpu::GpuStorage;
use crate::storage::{CpuStorage, Element, Storage};
use crate::{DType, Device, Result, Shape, TensorError};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct Inner {
    pub(crate) id: u64,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) storage: Arc<RwLock<Storage>>,
    pub(crate) node: Option<Arc<Node>>,
    pub(crate) requires_grad: AtomicBool,
    pub(crate) grad: Mutex<GradSlot>,
    /// What replaced this leaf in its module, once something did ([`Tensor::retire`]).
    pub(crate) retired: OnceLock<&'static str>,
    /// Run after each backward pass accumulates into this leaf's gradient
    /// ([`Tensor::register_post_accumulate_grad_hook`]).
    pub(crate) post_grad_hooks: Mutex<Vec<PostGradHook>>,
    /// What a higher layer keeps with this tensor ([`Tensor::attach`]).
    pub(crate) attachment: OnceLock<Attachment>,
}

/// An object a higher layer keeps with a tensor ([`Tensor::attach`]).
pub type Attachment = Arc<dyn std::any::Any + Send + Sync>;

/// A hook run after a backward pass accumulates into a leaf's gradient, with the leaf
/// ([`Tensor::register_post_accumulate_grad_hook`]).
pub type PostGradHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// A leaf's accumulated gradient and whether it is already reduced over the ranks that
/// share the parameter ([`Tensor::set_reduced_grad`]); a new accumulation or a clear
/// makes it unreduced again.
#[derive(Default)]
pub(crate) struct GradSlot {
    grad: Option<Tensor>,
    reduced: bool,
}

impl Drop for Inner {
    /// The last handle on a host storage hands its buffer to the host cache.
    fn drop(&mut self) {
        let Some(lock) = Arc::get_mut(&mut self.storage) else { return };
        let st = lock.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Storage::Cpu(cs) = std::mem::replace(st, Storage::Released) {
            crate::storage::recycle(cs);
        }
    }
}

/// An n-dimensional array with reverse-mode autograd.
///
/// Tensors are **contiguous row-major**: every op that changes the layout
/// (transpose, permute, narrow, expand) writes a new contiguous buffer, while
/// `reshape`, `detach` and `clone` share storage. Keeping one layout keeps every
/// kernel a plain loop over slices (and every CUDA kernel simple); the copies
/// it costs are small next to the matmuls of a transformer step.
///
/// A `Tensor` is a cheap handle (`Arc`): clones share data and graph.
///
/// ```
/// use tpar_tensor::{Tensor, DType};
/// let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])?.requires_grad_(true);
/// let loss = a.matmul(&a)?.sum_all()?;
/// loss.backward()?;
/// assert_eq!(a.grad().unwrap().to_vec::<f32>()?, vec![7.0, 11.0, 9.0, 13.0]);
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<Inner>);

/// A handle that does not keep its tensor alive, as Python's `weakref.ref(tensor)`
/// ([`Tensor::downgrade`]): a record kept beside tensors, keyed by [`Tensor::id`], can
/// drop the entries of tensors no handle holds any more (ids are never reused).
///
/// ```
/// use tpar_tensor::{Tensor, DType, Device};
/// let t = Tensor::zeros([2], DType::F32, Device::Cpu)?;
/// let w = t.downgrade();
/// assert_eq!(w.upgrade().map(|u| u.id()), Some(t.id()));
/// drop(t);
/// assert!(!w.is_alive() && w.upgrade().is_none());
/// # Ok::<(), tpar_tensor::TensorError>(())
/// ```
#[derive(Clone)]
pub struct WeakTensor(std::sync::Weak<Inner>);

impl WeakTensor {
    /// The tensor, while a [`Tensor`] handle of it is alive.
    pub fn upgrade(&self) -> Option<Tensor> {
        self.0.upgrade().map(Tensor)
    }

    /// Whether a [`Tensor`] handle of it is alive.
    pub fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

fn storage_err<T: Element>(op: &'static str, s: &CpuStorage) -> TensorError {
    TensorError::DTypeMismatch { op, expected: T::DTYPE.name().into(), got: s.dtype() }
}

/// The typed slice of a storage, or a dtype error naming `op`.
pub(crate) fn typed<'a, T: Element>(op: &'static str, s: &'a CpuStorage) -> Result<&'a [T]> {
    T::slice(s).ok_or_else(|| storage_err::<T>(op, s))
}

impl Tensor {
    pub(crate) fn make(shape: Shape, dtype: DType, device: Device, storage: Storage) -> Tensor {
        Tensor(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape,
            dtype,
            device,
            storage: Arc::new(RwLock::new(storage)),
            node: None,
            requires_grad: AtomicBool::new(false),
            grad: Mutex::new(GradSlot::default()),
            retired: OnceLock::new(),
            post_grad_hooks: Mutex::new(Vec::new()),
            attachment: OnceLock::new(),
        }))
    }

    /// A new tensor handle over the same storage with another shape (same numel) and node.
    pub(crate) fn share(&self, shape: Shape, node: Option<Arc<Node>>) -> Tensor {
        let rg = node.is_some();
        Tensor(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape,
            dtype: self.0.dtype,
            device: self.0.device,
            storage: self.0.storage.clone(),
            node,
            requires_grad: AtomicBool::new(rg),
            grad: Mutex::new(GradSlot::default()),
            retired: OnceLock::new(),
            post_grad_hooks: Mutex::new(Vec::new()),
            attachment: OnceLock::new(),
        }))
    }

    /// A CPU tensor from host storage; the storage length must match the shape.
    pub fn from_storage(storage: CpuStorage, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if storage.len() != shape.numel() {
            return Err(TensorError::InvalidArgument {
                op: "from_storage",
                what: format!("{} elements cannot have shape {shape}", storage.len()),
            });
        }
        Ok(Tensor::make(shape, storage.dtype(), Device::Cpu, Storage::Cpu(storage)))
    }

    /// A CPU tensor from a vector of elements.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_storage(T::wrap(data), shape)
    }

    /// A CPU tensor converting `f64` values to `dtype`.
    pub fn from_f64(data: &[f64], shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(TensorError::InvalidArgument {
                op: "from_f64",
                what: format!("{} elements cannot have shape {shape}", data.len()),
            });
        }
        let s = crate::with_any_type!(dtype, |T| {
            let mut v = crate::storage::try_vec("from_f64", &shape, dtype, T::default())?;
            for (o, &x) in v.iter_mut().zip(data) {
                *o = <T as Element>::from_f64(x);
            }
            T::wrap(v)
        });
        Tensor::from_storage(s, shape)
    }

    /// A 0-dim tensor.
    pub fn scalar(v: f64, dtype: DType) -> Tensor {
        Tensor::make(
            Shape::new(&[]),
            dtype,
            Device::Cpu,
            Storage::Cpu(crate::with_any_type!(dtype, |T| {
                T::wrap(vec![<T as Element>::from_f64(v)])
            })),
        )
    }

    /// A tensor filled with `v` on `device` (meta tensors hold no data).
    pub fn full(shape: impl Into<Shape>, v: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let storage = match device {
            Device::Cpu => Storage::Cpu(CpuStorage::try_full("full", &shape, dtype, v)?),
            Device::Meta => {
                // Shape-only, but its size must still be one a device could hold.
                crate::storage::storage_bytes("full", &shape, dtype)?;
                Storage::Meta
            }
            Device::Cuda(i) => {
                let n =
                    crate::storage::storage_bytes("full", &shape, dtype)? / dtype.size_in_bytes();
                if v != 0.0 {
                    return Tensor::full_on_device(i, shape, v, dtype);
                }
                Storage::Gpu(GpuStorage::zeros(&crate::gpu::device(i)?, dtype, n)?)
            }
        };
        Ok(Tensor::make(shape, dtype, device, storage))
    }

    /// Zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }

    /// Ones.
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// Zeros with this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape().clone(), self.dtype(), self.device())
    }

    /// A tensor with no data yet: on `Device::Meta` it is shape and dtype only.
    pub fn empty(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::zeros(shape, dtype, device)
    }

    /// `0, 1, ..., n-1`.
    pub fn arange(n: usize, dtype: DType) -> Tensor {
        let s = crate::with_any_type!(dtype, |T| {
            T::wrap((0..n).map(|v| <T as Element>::from_f64(v as f64)).collect())
        });
        Tensor::make(Shape::new(&[n]), dtype, Device::Cpu, Storage::Cpu(s))
    }

    /// Standard normal samples from a seeded generator (deterministic per seed).
    pub fn randn(shape: impl Into<Shape>, dtype: DType, rng: &mut crate::Rng) -> Result<Tensor> {
        let shape = shape.into();
        crate::storage::check_alloc("randn", &shape, dtype)?;
        let mut v = crate::storage::try_vec("randn", &shape, DType::F64, 0.0)?;
        v.iter_mut().for_each(|x| *x = rng.normal());
        Tensor::from_f64(&v, shape, dtype)
    }

    /// Uniform samples in `[lo, hi)` from a seeded generator.
    pub fn rand_uniform(
        shape: impl Into<Shape>,
        lo: f64,
        hi: f64,
        dtype: DType,
        rng: &mut crate::Rng,
    ) -> Result<Tensor> {
        let shape = shape.into();
        crate::storage::check_alloc("rand_uniform", &shape, dtype)?;
        let mut v = crate::storage::try_vec("rand_uniform", &shape, DType::F64, 0.0)?;
        v.iter_mut().for_each(|x| *x = lo + (hi - lo) * rng.uniform());
        Tensor::from_f64(&v, shape, dtype)
    }

    /// A unique id of this handle (a node in the autograd graph).
    pub fn id(&self) -> u64 {
        self.0.id
    }
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }
    /// The dims.
    pub fn dims(&self) -> &[usize] {
        self.0.shape.dims()
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.0.shape.rank()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.shape.numel()
    }
    /// Size of dim `d` (negative counts from the end).
    pub fn size(&self, d: isize) -> Result<usize> {
        Ok(self.dims()[crate::shape::normalize_dim("size", d, self.rank())?])
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// The device.
    pub fn device(&self) -> Device {
        self.0.device
    }
    /// Bytes of data (numel * element size).
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }
    /// Whether two handles share the same storage.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// Whether gradients flow to (or through) this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Marks a leaf tensor as a parameter whose `.grad()` backward fills. Returns `self`.
    pub fn requires_grad_(self, on: bool) -> Tensor {
        self.0.requires_grad.store(on, Ordering::Relaxed);
        self
    }

    /// Whether the tensor was produced by a recorded op (not a leaf).
    pub fn is_leaf(&self) -> bool {
        self.0.node.is_none()
    }

    /// The recorded op's name, for non-leaf tensors.
    pub fn grad_fn_name(&self) -> Option<&'static str> {
        self.0.node.as_ref().map(|n| n.name)
    }

    fn grad_slot(&self) -> std::sync::MutexGuard<'_, GradSlot> {
        self.0.grad.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.grad_slot().grad.clone()
    }

    /// Replaces the accumulated gradient (`None` clears it, as `zero_grad(set_to_none=True)`).
    /// The gradient is unreduced (see [`Tensor::set_reduced_grad`]).
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.grad_slot() = GradSlot { grad: g, reduced: false };
    }

    /// Replaces the accumulated gradient with `g`, which is already reduced over the
    /// ranks that share the parameter (the data-parallel all-reduce, a replicated mesh
    /// dim's sum): [`Tensor::reduced_grad`] returns it until a backward accumulates into
    /// this leaf again or the gradient is cleared, so whoever reduces it next (the
    /// gradient clip, the optimizer) sees that it need not.
    pub fn set_reduced_grad(&self, g: Option<Tensor>) {
        let reduced = g.is_some();
        *self.grad_slot() = GradSlot { grad: g, reduced };
    }

    /// The accumulated gradient when it is marked reduced ([`Tensor::set_reduced_grad`]).
    pub fn reduced_grad(&self) -> Option<Tensor> {
        let slot = self.grad_slot();
        if slot.reduced {
            slot.grad.clone()
        } else {
            None
        }
    }

    /// Clears the gradient.
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }

    pub(crate) fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        {
            let mut slot = self.grad_slot();
            let new = match slot.grad.take() {
                Some(old) => crate::autograd::no_grad(|| old.add(&g))?,
                None => g,
            };
            *slot = GradSlot { grad: Some(new), reduced: false };
        }
        let hooks = self.0.post_grad_hooks.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for hook in hooks {
            hook(self)?;
        }
        Ok(())
    }

    /// Registers `hook` to run each time a backward pass has accumulated into this
    /// leaf's gradient (PyTorch's `register_post_accumulate_grad_hook`), with the leaf:
    /// as soon as every contribution of that pass has arrived, while the pass goes on
    /// with the rest of the graph (data parallelism starts the leaf's all-reduce there).
    /// An error from the hook is the backward's error.
    pub fn register_post_accumulate_grad_hook(&self, hook: PostGradHook) {
        self.0.post_grad_hooks.lock().unwrap_or_else(|p| p.into_inner()).push(hook);
    }

    /// Whether any [`Tensor::register_post_accumulate_grad_hook`] hook is registered.
    pub(crate) fn has_post_grad_hooks(&self) -> bool {
        !self.0.post_grad_hooks.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    /// Marks this leaf as no longer its module's: `by` (`"fully_shard"`,
    /// `"parallelize_module"`, `"reset_parameters"`) put another tensor in its place. Every
    /// handle of the leaf (an optimizer's copy) then reports it ([`Tensor::retired_by`]).
    /// The first mark stays.
    pub fn retire(&self, by: &'static str) {
        let _ = self.0.retired.set(by);
    }

    /// What replaced this leaf in its module ([`Tensor::retire`]), `None` while it is
    /// still the module's.
    pub fn retired_by(&self) -> Option<&'static str> {
        self.0.retired.get().copied()
    }

    /// Keeps `what` with this tensor (every handle of it sees it, a [`Tensor::detach`]ed
    /// copy does not): how a layer above finds its own state from a tensor it handed out
    /// (FSDP: the state that gathers a sharded parameter for compute, found from the
    /// parameter's shard). Set once: `false`, and nothing changes, when the tensor
    /// already has one.
    pub fn attach(&self, what: Attachment) -> bool {
        self.0.attachment.set(what).is_ok()
    }

    /// What [`Tensor::attach`] keeps with this tensor.
    pub fn attachment(&self) -> Option<&Attachment> {
        self.0.attachment.get()
    }

    /// This tensor as an edge of the autograd graph (an input of a recorded node): a
    /// leaf that requires a gradient is itself (its gradient and hooks live there); any
    /// other tensor is a handle with the same id, shape, dtype, device and node but no
    /// data, so that recording an op keeps no input's data alive: what a backward needs
    /// is what its closure saved, and an intermediate nothing saved is freed when its
    /// last user lets go of it (PyTorch's graph holds edges, not tensors).
    pub(crate) fn edge(&self) -> Tensor {
        if self.0.node.is_none() && self.requires_grad() {
            return self.clone();
        }
        Tensor(Arc::new(Inner {
            id: self.0.id,
            shape: self.0.shape.clone(),
            dtype: self.0.dtype,
            device: self.0.device,
            storage: Arc::new(RwLock::new(Storage::Released)),
            node: self.0.node.clone(),
            requires_grad: AtomicBool::new(self.requires_grad()),
            grad: Mutex::new(GradSlot::default()),
            retired: OnceLock::new(),
            post_grad_hooks: Mutex::new(Vec::new()),
            attachment: OnceLock::new(),
        }))
    }

    /// A handle that does not keep this tensor alive ([`WeakTensor`]).
    pub fn downgrade(&self) -> WeakTensor {
        WeakTensor(Arc::downgrade(&self.0))
    }

    /// A handle to the same data that is cut from the graph.
    pub fn detach(&self) -> Tensor {
        self.share(self.shape().clone(), None)
    }

    pub(crate) fn node(&self) -> Option<&Arc<Node>> {
        self.0.node.as_ref()
    }

    /// Runs `f` on the typed host data. Errors on meta/CUDA tensors and on a dtype mismatch.
    pub fn with_data<T: Element, R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        let g = self.0.storage.read().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Storage::Cpu(s) => Ok(f(typed::<T>("with_data", s)?)),
            Storage::Gpu(d) => {
                crate::gpu::count_host_round_trip();
                let h = d.download()?;
                drop(g);
                Ok(f(typed::<T>("with_data", &h)?))
            }
            Storage::Meta => Err(TensorError::MetaTensor { op: "with_data" }),
            Storage::Released => Err(TensorError::Released { op: "with_data" }),
        }
    }

    /// Runs `f` on the typed host data, mutably, in place. Not recorded by autograd: use it
    /// for optimizer updates and loading weights.
    pub fn with_data_mut<T: Element, R>(&self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        let mut g = self.0.storage.write().unwrap_or_else(|p| p.into_inner());
        match &mut *g {
            Storage::Cpu(s) => {
                let got = s.dtype();
                let sl = T::slice_mut(s).ok_or(TensorError::DTypeMismatch {
                    op: "with_data_mut",
                    expected: T::DTYPE.name().into(),
                    got,
                })?;
                Ok(f(sl))
            }
            Storage::Gpu(d) => {
                crate::gpu::count_host_round_trip();
                let mut h = d.download()?;
                let got = h.dtype();
                let sl = T::slice_mut(&mut h).ok_or(TensorError::DTypeMismatch {
                    op: "with_data_mut",
                    expected: T::DTYPE.name().into(),
                    got,
                })?;
                let r = f(sl);
                d.upload_into(&h)?;
                Ok(r)
            }
            Storage::Meta => Err(TensorError::MetaTensor { op: "with_data_mut" }),
            Storage::Released => Err(TensorError::Released { op: "with_data_mut" }),
        }
    }

    /// Runs `f` on the host storage of any dtype.
    pub(crate) fn with_storage<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&CpuStorage) -> Result<R>,
    ) -> Result<R> {
        let g = self.0.storage.read().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Storage::Cpu(s) => f(s),
            Storage::Gpu(d) => {
                crate::gpu::count_host_round_trip();
                let h = d.download()?;
                drop(g);
                f(&h)
            }
            Storage::Meta => Err(TensorError::MetaTensor { op }),
            Storage::Released => Err(TensorError::Released { op }),
        }
    }

    /// The elements as a vector of `T` (must be the tensor's dtype).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.with_data::<T, _>(|s| s.to_vec())
    }

    /// The elements converted to f64, whatever the dtype.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        self.with_storage("to_vec_f64", |s| {
            Ok(crate::with_any_type!(s.dtype(), |T| {
                typed::<T>("to_vec_f64", s)?.iter().map(|&v| v.to_f64()).collect()
            }))
        })
    }

    /// The single value of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(TensorError::InvalidArgument {
                op: "item",
                what: format!(
                    "tensor of shape {} has {} elements, not 1",
                    self.shape(),
                    self.numel()
                ),
            });
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// Overwrites this tensor's data with `src`'s (same shape; converted to this dtype).
    /// Not recorded by autograd.
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(TensorError::ShapeMismatch {
                op: "copy_",
                lhs: self.shape().clone(),
                rhs: src.shape().clone(),
                why: "copy needs equal shapes".into(),
            });
        }
        let src =
            if src.dtype() == self.dtype() { src.clone() } else { src.to_dtype(self.dtype())? };
        if self.same_storage(&src) {
            return Ok(());
        }
        let data = src.implicit_move(self.device())?.storage_copy("copy_")?;
        let mut g = self.0.storage.write().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Storage::Cpu(_) | Storage::Gpu(_) => {
                *g = data;
                Ok(())
            }
            Storage::Meta => Err(TensorError::MetaTensor { op: "copy_" }),
            Storage::Released => Err(TensorError::Released { op: "copy_" }),
        }
    }

    /// This tensor on `device` for an op that moves data without being asked
    /// to (`copy_`, `fill_storage_`): a device-to-host move counts in
    /// [`crate::gpu::host_round_trips`].
    fn implicit_move(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        if matches!(self.device(), Device::Cuda(_)) && device == Device::Cpu {
            crate::gpu::count_host_round_trip();
        }
        self.detach().to_device(device)
    }

    /// An owned copy of the data (host or device).
    fn storage_copy(&self, op: &'static str) -> Result<Storage> {
        let g = self.0.storage.read().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.clone())),
            Storage::Gpu(d) => Ok(Storage::Gpu(d.duplicate()?)),
            Storage::Meta => Err(TensorError::MetaTensor { op }),
            Storage::Released => Err(TensorError::Released { op }),
        }
    }

    /// Frees the data, keeping shape, dtype, graph and every handle sharing the storage
    /// (which then error with [`TensorError::Released`] until [`Tensor::fill_storage_`]).
    /// Returns the bytes freed.
    pub fn release_storage_(&self) -> usize {
        let mut g = self.0.storage.write().unwrap_or_else(|p| p.into_inner());
        let freed = match &*g {
            Storage::Cpu(s) => s.len() * s.dtype().size_in_bytes(),
            Storage::Gpu(d) => d.nbytes(),
            _ => 0,
        };
        if matches!(&*g, Storage::Cpu(_) | Storage::Gpu(_)) {
            if let Storage::Cpu(cs) = std::mem::replace(&mut *g, Storage::Released) {
                crate::storage::recycle(cs);
            }
        }
        freed
    }

    /// Takes the host data out of this tensor without a copy, leaving its storage released
    /// (as [`Tensor::release_storage_`]) until [`Tensor::fill_storage_`] refills it: how a
    /// collective writing into a caller's buffer reuses that buffer's memory. Errors on
    /// CUDA, meta and already released tensors, leaving them as they were.
    pub fn take_storage_(&self) -> Result<CpuStorage> {
        let mut g = self.0.storage.write().unwrap_or_else(|p| p.into_inner());
        match std::mem::replace(&mut *g, Storage::Released) {
            Storage::Cpu(s) => Ok(s),
            other => {
                let e = match &other {
                    Storage::Gpu(_) => TensorError::InvalidArgument {
                        op: "take_storage_",
                        what: format!("a tensor on {} (host tensors only)", self.device()),
                    },
                    Storage::Meta => TensorError::MetaTensor { op: "take_storage_" },
                    _ => TensorError::Released { op: "take_storage_" },
                };
                *g = other;
                Err(e)
            }
        }
    }

    /// A CPU tensor of `shape` whose storage starts released (filled later with
    /// [`Tensor::fill_storage_`]): a placeholder that costs no memory.
    pub fn new_released(shape: impl Into<Shape>, dtype: DType) -> Tensor {
        Tensor::make(shape.into(), dtype, Device::Cpu, Storage::Released)
    }

    /// [`Tensor::new_released`] for a tensor that lives on `device` once filled.
    pub fn new_released_on(shape: impl Into<Shape>, dtype: DType, device: Device) -> Tensor {
        Tensor::make(shape.into(), dtype, device, Storage::Released)
    }

    /// Whether the storage is currently released.
    pub fn is_released(&self) -> bool {
        matches!(&*self.0.storage.read().unwrap_or_else(|p| p.into_inner()), Storage::Released)
    }

    /// Refills this tensor's storage (released or not) with `src`'s data, in place, for
    /// every handle sharing it. Same shape and dtype required; not recorded by autograd.
    /// When `src` is the only handle to its data, the data moves without a copy.
    pub fn fill_storage_(&self, src: Tensor) -> Result<()> {
        if src.shape() != self.shape() || src.dtype() != self.dtype() {
            return Err(TensorError::InvalidArgument {
                op: "fill_storage_",
                what: format!(
                    "source {} {} does not fit {} {}",
                    src.shape(),
                    src.dtype(),
                    self.shape(),
                    self.dtype()
                ),
            });
        }
        // (Moved only when it must change device: a clone would keep a second handle.)
        let mut src =
            if src.device() == self.device() { src } else { src.implicit_move(self.device())? };
        // The only handle on the only storage handle: take the storage itself.
        let moved = Arc::get_mut(&mut src.0)
            .and_then(|inner| Arc::get_mut(&mut inner.storage))
            .map(|lock| {
                let st = lock.get_mut().unwrap_or_else(|p| p.into_inner());
                std::mem::replace(st, Storage::Released)
            });
        let data = match moved {
            Some(s @ (Storage::Cpu(_) | Storage::Gpu(_))) => s,
            Some(_) => {
                return Err(TensorError::InvalidArgument {
                    op: "fill_storage_",
                    what: "source has no data".into(),
                })
            }
            None => src.storage_copy("fill_storage_")?,
        };
        *self.0.storage.write().unwrap_or_else(|p| p.into_inner()) = data;
        Ok(())
    }

    /// `self += alpha * x` in place (not recorded by autograd): the SGD update.
    pub fn add_scaled_(&self, x: &Tensor, alpha: f64) -> Result<()> {
        let upd = crate::autograd::no_grad(|| x.mul_scalar(alpha)?.to_dtype(self.dtype()))?;
        let new = crate::autograd::no_grad(|| self.detach().add(&upd))?;
        self.copy_(&new)
    }

    /// Materializes a meta tensor on `device` (zero-filled), or copies a tensor there.
    /// The result is a new leaf keeping `requires_grad`.
    pub fn to_empty(&self, device: Device) -> Result<Tensor> {
        let t = Tensor::zeros(self.shape().clone(), self.dtype(), device)?;
        Ok(t.requires_grad_(self.requires_grad()))
    }

    /// Moves the tensor to `device` (differentiable for CPU; CUDA arrives with its backend).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        if device == Device::Meta {
            return Tensor::empty(self.shape().clone(), self.dtype(), Device::Meta);
        }
        if self.device() == Device::Meta {
            return Err(TensorError::MetaTensor { op: "to_device" });
        }
        let storage = {
            let g = self.0.storage.read().unwrap_or_else(|p| p.into_inner());
            match (&*g, device) {
                (Storage::Cpu(s), Device::Cuda(i)) => {
                    Storage::Gpu(GpuStorage::upload(&crate::gpu::device(i)?, s)?)
                }
                (Storage::Gpu(d), Device::Cpu) => Storage::Cpu(d.download()?),
                (Storage::Gpu(d), Device::Cuda(i)) => {
                    // between devices: device to device (a peer copy between GPUs),
                    // through the host only where no device path joins them
                    let dev = crate::gpu::device(i)?;
                    match d.copy_to(&dev) {
                        Ok(s) => Storage::Gpu(s),
                        Err(_) => Storage::Gpu(GpuStorage::upload(&dev, &d.download()?)?),
                    }
                }
                (Storage::Released, _) => return Err(TensorError::Released { op: "to_device" }),
                _ => return Err(TensorError::MetaTensor { op: "to_device" }),
            }
        };
        let out = Tensor::make(self.shape().clone(), self.dtype(), device, storage);
        let from = self.device();
        if !self.dtype().is_float() {
            return Ok(out);
        }
        Ok(crate::autograd::record("to_device", &[self], out, move |g| {
            Ok(vec![Some(g.to_device(from)?)])
        }))
    }

    /// Runs `f` on the CUDA storage of this tensor.
    pub(crate) fn with_gpu_storage<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&GpuStorage) -> Result<R>,
    ) -> Result<R> {
        let g = self.0.storage.read().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Storage::Gpu(d) => f(d),
            Storage::Cpu(_) => {
                Err(TensorError::DeviceMismatch { op, lhs: Device::Cuda(0), rhs: Device::Cpu })
            }
            Storage::Meta => Err(TensorError::MetaTensor { op }),
            Storage::Released => Err(TensorError::Released { op }),
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor[{}, {}, {}", self.shape(), self.dtype(), self.device())?;
        if let Some(n) = self.grad_fn_name() {
            write!(f, ", grad_fn={n}")?;
        } else if self.requires_grad() {
            write!(f, ", requires_grad")?;
        }
        if self.device() == Device::Cpu && self.numel() <= 16 {
            if let Ok(v) = self.to_vec_f64() {
                write!(f, ", {v:?}")?;
            }
        }
        write!(f, "]")
    }
}
