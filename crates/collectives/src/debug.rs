//! `CommDebug`: a per-rank recorder of the communication calls that ran, like PyTorch's
//! `CommDebugMode`, so tests assert *which* collectives happened, not only the numbers.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tpar_tensor::DType;

use crate::{CollectiveKind, ReduceOp};

/// One recorded communication call, as issued by one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommRecord {
    /// The collective.
    pub kind: CollectiveKind,
    /// The reduction, for `all_reduce` and `reduce_scatter`.
    pub op: Option<ReduceOp>,
    /// The group's members, as global ranks.
    pub group: Vec<usize>,
    /// Bytes of this rank's input (0 for `barrier`, `recv`, `recv_shaped` and non-source
    /// `broadcast`).
    pub bytes: usize,
    /// The input's dtype (`None` for `barrier`, `recv`, `recv_shaped` and non-source
    /// `broadcast`).
    pub dtype: Option<DType>,
    /// The input's shape (empty for `barrier`, `recv`, `recv_shaped` and non-source
    /// `broadcast`).
    pub shape: Vec<usize>,
    /// Whether it was issued through an `*_async` call.
    pub is_async: bool,
}

impl fmt::Display for CommRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if let Some(op) = self.op {
            write!(f, "({op})")?;
        }
        if self.is_async {
            f.write_str(" async")?;
        }
        write!(f, " on {:?}", self.group)?;
        if let Some(dt) = self.dtype {
            write!(f, ": {dt} {:?}", self.shape)?;
        }
        write!(f, ", {} B", self.bytes)
    }
}

#[derive(Default)]
struct Inner {
    enabled: AtomicBool,
    records: Mutex<Vec<CommRecord>>,
}

/// A recorder of communication calls. Cheap to clone (clones share the records).
///
/// Every rank of a [`World`](crate::World) owns one (see
/// [`ProcessGroup::comm_debug`](crate::ProcessGroup::comm_debug)); it is disabled until
/// [`enable`](CommDebug::enable)d, and then every collective the rank issues, on any group,
/// appends a [`CommRecord`].
///
/// ```
/// use tpar_collectives::{spawn, CollectiveError, CollectiveKind, ReduceOp};
/// use tpar_tensor::Tensor;
/// spawn(2, |ctx| -> Result<(), CollectiveError> {
///     let pg = ctx.world_group();
///     let dbg = pg.comm_debug();
///     dbg.enable();
///     let t = Tensor::from_vec(vec![1.0f32, 2.0], [2])?;
///     pg.all_reduce(&t, ReduceOp::Sum)?;
///     pg.all_gather(&t, 0)?;
///     assert_eq!(dbg.count(CollectiveKind::AllReduce), 1);
///     assert_eq!(dbg.total(), 2);
///     Ok(())
/// })?;
/// # Ok::<(), CollectiveError>(())
/// ```
#[derive(Clone, Default)]
pub struct CommDebug {
    inner: Arc<Inner>,
}

impl CommDebug {
    /// A new, disabled recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts recording.
    pub fn enable(&self) {
        self.inner.enabled.store(true, Ordering::SeqCst);
    }

    /// Stops recording (records are kept).
    pub fn disable(&self) {
        self.inner.enabled.store(false, Ordering::SeqCst);
    }

    /// Whether calls are being recorded.
    pub fn is_enabled(&self) -> bool {
        self.inner.enabled.load(Ordering::Relaxed)
    }

    /// Appends a record if enabled.
    pub(crate) fn record(&self, make: impl FnOnce() -> CommRecord) {
        if self.is_enabled() {
            let rec = make();
            self.lock().push(rec);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<CommRecord>> {
        self.inner.records.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A copy of the records, in issue order.
    pub fn records(&self) -> Vec<CommRecord> {
        self.lock().clone()
    }

    /// Removes and returns the records.
    pub fn take(&self) -> Vec<CommRecord> {
        std::mem::take(&mut *self.lock())
    }

    /// Forgets the records.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// How many calls of `kind` were recorded.
    pub fn count(&self, kind: CollectiveKind) -> usize {
        self.lock().iter().filter(|r| r.kind == kind).count()
    }

    /// How many calls were recorded in all.
    pub fn total(&self) -> usize {
        self.lock().len()
    }

    /// Calls per kind (kinds that never ran are absent).
    pub fn counts(&self) -> BTreeMap<CollectiveKind, usize> {
        let mut m = BTreeMap::new();
        for r in self.lock().iter() {
            *m.entry(r.kind).or_insert(0) += 1;
        }
        m
    }

    /// Input bytes of the recorded calls of `kind`.
    pub fn bytes(&self, kind: CollectiveKind) -> usize {
        self.lock().iter().filter(|r| r.kind == kind).map(|r| r.bytes).sum()
    }
}

impl fmt::Debug for CommDebug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommDebug")
            .field("enabled", &self.is_enabled())
            .field("counts", &self.counts())
            .finish()
    }
}
