//! The thread that owns one group's NCCL communicator: it creates the stream and the
//! communicator, then serves the group's jobs (`remote::worker::serve`).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::nccl::{Comm, Id};

use super::device::{driver_error_text, nccl_error_text, NcclDevice};
use super::ondevice::DeviceJob;
use super::probe::guarded;
use crate::remote::worker::{serve, Job, Shared};
use crate::{CollectiveError, Result, Store};

/// What a worker needs to set its communicator up.
pub(crate) struct Setup {
    pub ctx: Arc<CudaContext>,
    pub id: Id,
    pub me: usize,
    pub shared: Arc<Shared>,
    /// For the diagnosis of timeouts: the store and this group's key.
    pub store: Arc<dyn Store>,
    pub key: String,
}

/// The worker's body: sets up, says so on `ready`, then serves `jobs` until every handle
/// is gone.
pub(crate) fn main(setup: Setup, jobs: Receiver<Job<DeviceJob>>, ready: Sender<Result<()>>) {
    let shared = setup.shared.clone();
    let group = shared.group.clone();
    let backend = |op: &'static str, message: String| shared.backend_err(op, message);
    let made = guarded(|| -> Result<NcclDevice> {
        let stream = setup
            .ctx
            .new_stream()
            .map_err(|e| backend("init", format!("CUDA: {}", driver_error_text(&e))))?;
        let comm = Comm::from_rank(stream.clone(), setup.me, group.len(), setup.id)
            .map_err(|e| backend("init", format!("ncclCommInitRank: {}", nccl_error_text(&e))))?;
        Ok(NcclDevice::new(comm, stream, group.clone(), setup.me))
    });
    let mut dev = match made {
        Ok(Ok(d)) => d,
        Ok(Err(e)) => {
            let _ = ready.send(Err(e));
            return;
        }
        Err(p) => {
            let _ = ready.send(Err(backend("init", format!("panicked: {p}"))));
            return;
        }
    };
    if ready.send(Ok(())).is_err() {
        // The caller gave up waiting: nobody will use this communicator.
        return;
    }
    serve(&mut dev, setup.me, &shared, jobs, |e, seq, timeout| diagnose(e, seq, &setup, timeout));
}

/// Fills in who a timed-out collective was waiting for: each member that times out
/// publishes the sequence number it was stuck in under
/// `tpar/nccl_at/<group key>/<global rank>`; members that publish the same number within a
/// short grace were there, the others were not.
fn diagnose(
    e: CollectiveError,
    seq: Option<u64>,
    setup: &Setup,
    timeout: Duration,
) -> CollectiveError {
    let (CollectiveError::Timeout { op, group, waiting_for, after, .. }, Some(seq)) = (&e, seq)
    else {
        return e;
    };
    if !waiting_for.is_empty() {
        return e;
    }
    let me = group.get(setup.me).copied().unwrap_or(setup.me);
    let key = |r: usize| format!("tpar/nccl_at/{}/{r}", setup.key);
    if setup.store.set(&key(me), &seq.to_le_bytes()).is_err() {
        return e;
    }
    let grace = timeout.min(Duration::from_secs(3));
    let until = Instant::now() + grace;
    let mut missing = Vec::new();
    for &r in group.iter().filter(|&&r| r != me) {
        let left = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let there = setup
            .store
            .get_timeout(&key(r), left)
            .ok()
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .is_some_and(|v| u64::from_le_bytes(v) == seq);
        if !there {
            missing.push(r);
        }
    }
    CollectiveError::Timeout {
        op,
        group: group.clone(),
        waiting_for: missing,
        after: *after,
        chain: Vec::new(),
    }
}
