//! [`Store`]: the key-value store the processes of a job share to agree on what they
//! must know before the first collective (PyTorch's `c10d::Store`).
//!
//! The NCCL backend needs four operations of it: `set` (rank 0 publishes a group's
//! unique id; every member says it arrived), `get_timeout` (the others read the id),
//! `wait` (all wait for all) and `check` (which members are missing after a timeout).
//! The `tcp` backend uses `set` and `get_timeout` to publish and read each process's
//! listening address. This crate defines the trait and [`HashStore`], an in-memory store
//! for ranks that are threads of one process; `tpar-launch` implements it with its TCP
//! store (`tpar_launch::TcpStore`, hosted by rank 0 at `MASTER_ADDR:MASTER_PORT`), and a
//! user can bring another (a file system, a job scheduler's key-value service).

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

/// A boxed error of a store implementation, kept whole so callers can downcast it.
pub type BoxedStoreError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a [`Store`] operation failed: the keys did not appear in time, or the store
/// itself failed (connection lost, protocol error). Both carry the implementation's own
/// error, whose text names the store's address and the keys.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The keys were not set within the timeout.
    #[error(transparent)]
    Timeout(BoxedStoreError),
    /// Any other failure.
    #[error(transparent)]
    Failed(BoxedStoreError),
    /// A process of the job is gone (the store saw its connection close without a
    /// goodbye): the store names its rank.
    #[error("{source}")]
    RankGone {
        /// The rank whose process is gone.
        rank: usize,
        /// The store's error, naming it.
        source: BoxedStoreError,
    },
}

/// A key-value store shared by every process of a job. Values are bytes; keys are
/// strings. Every operation is bounded: a method that waits takes its timeout, the
/// others are bounded by the store's own.
///
/// The NCCL world (`ProcessGroup::nccl_world`) holds one for its lifetime: keys under
/// `tpar/` are its own. A store whose server lives in one process must outlive every
/// other process's use of it (call a barrier before that process exits).
pub trait Store: Send + Sync + fmt::Debug {
    /// Stores `value` under `key`, replacing any previous value and waking every
    /// [`get_timeout`](Self::get_timeout) and [`wait`](Self::wait) on it.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// The value of `key`, waiting up to `timeout` for it to be set;
    /// [`StoreError::Timeout`] if it is not.
    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError>;

    /// Waits up to `timeout` until every key in `keys` is set;
    /// [`StoreError::Timeout`] if one is not.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;

    /// Whether every key in `keys` is set, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool, StoreError>;

    /// Registers this process as `rank` of a job of `world_size` processes, before its
    /// first wait in the store (the `tcp` backend's setup calls it). A store that can tell
    /// (`tpar_launch::TcpStore`) refuses a world size other than its host's, or a rank
    /// another live process holds, with an error naming both values, and fails every
    /// other rank's waits with it; later, when this process dies, it fails their waits
    /// with [`StoreError::RankGone`] naming `rank`. The default accepts.
    fn join(&self, rank: usize, world_size: usize) -> Result<(), StoreError> {
        let _ = (rank, world_size);
        Ok(())
    }

    /// The IP address of this process's end of its connection to the store, when it has
    /// one: the interface through which the other processes of the job can usually reach
    /// this one. The `tcp` backend advertises it to its peers (unless
    /// [`TCP_HOST_ENV`](crate::tcp::TCP_HOST_ENV) says otherwise). `None` by default.
    fn local_ip(&self) -> Option<IpAddr> {
        None
    }
}

/// A [`Store`] in this process's memory, shared by reference: PyTorch's
/// `torch.distributed.HashStore`. For ranks that are threads of one process (tests,
/// [`nccl::StandIn`](crate::nccl::StandIn) checks); processes need a store they can all
/// reach, such as `tpar_launch::TcpStore`.
///
/// ```
/// use std::time::Duration;
/// use tpar_collectives::{HashStore, Store, StoreError};
/// let store = HashStore::new();
/// store.set("k", b"v")?;
/// assert_eq!(store.get_timeout("k", Duration::from_secs(1))?, b"v");
/// assert!(matches!(
///     store.get_timeout("missing", Duration::from_millis(10)),
///     Err(StoreError::Timeout(_))
/// ));
/// # Ok::<(), StoreError>(())
/// ```
#[derive(Debug, Default)]
pub struct HashStore {
    map: std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
    changed: std::sync::Condvar,
}

/// The keys a [`HashStore`] wait ended without.
#[derive(Debug, thiserror::Error)]
#[error("in-memory store: key(s) {0:?} not set within the timeout")]
struct MissingKeys(Vec<String>);

impl HashStore {
    /// An empty store.
    pub fn new() -> HashStore {
        HashStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Store for HashStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], timeout)?;
        self.lock()
            .get(key)
            .cloned()
            .ok_or_else(|| StoreError::Timeout(Box::new(MissingKeys(vec![key.to_string()]))))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        // `None`: a timeout too long to reach (waits as long as it takes).
        let deadline = std::time::Instant::now().checked_add(timeout);
        let mut map = self.lock();
        loop {
            let missing: Vec<String> =
                keys.iter().filter(|k| !map.contains_key(**k)).map(|k| k.to_string()).collect();
            if missing.is_empty() {
                return Ok(());
            }
            let left = deadline
                .map_or(timeout, |d| d.saturating_duration_since(std::time::Instant::now()));
            if left.is_zero() {
                return Err(StoreError::Timeout(Box::new(MissingKeys(missing))));
            }
            map = self
                .changed
                .wait_timeout(map, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let map = self.lock();
        Ok(keys.iter().all(|k| map.contains_key(*k)))
    }
}
