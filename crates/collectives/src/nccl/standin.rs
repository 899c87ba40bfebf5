//! NCCL's bring-up without a GPU: the same rendezvous, unique-id exchange and one
//! communicator per member list as [`ProcessGroup::nccl_world`], with the three calls into
//! CUDA and NCCL (the context, `ncclGetUniqueId`, `ncclCommInitRank`) replaced by a
//! record of what would have been created.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{check_rank, start_world, Bringup, DeviceJob, GroupSetup};
use crate::remote::worker::Job;
use crate::{CollectiveError, ProcessGroup, Result, Store};

/// One communicator the [`StandIn`] brought up: what `ncclCommInitRank` would have been
/// called with on this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StandInComm {
    /// The group's members, as global ranks (sorted).
    pub ranks: Vec<usize>,
    /// This process's place in `ranks` (NCCL's rank in the communicator).
    pub member: usize,
    /// The group's store key: the member list and how many communicators that list had
    /// before (`0,1/0`); the unique id lives under `tpar/nccl_id/<key>`.
    pub key: String,
    /// The unique id every member of the group received (member 0 made it).
    pub unique_id: [u8; 128],
}

/// The NCCL backend's bring-up without a GPU, to check a launch before it meets one.
///
/// [`StandIn::world`] runs what [`ProcessGroup::nccl_world`] runs up to the first call
/// into CUDA or NCCL: the argument checks, the rendezvous of the group's members through
/// the job's [`Store`], member 0 publishing the group's unique id and the others reading
/// it, one communicator per member list (sub-groups from
/// [`new_group`](ProcessGroup::new_group), so a `DeviceMesh` gets one per mesh axis), and
/// the same timeouts naming the members that did not arrive. Instead of creating a
/// communicator it records a [`StandInComm`]; every collective on its groups fails with
/// [`CollectiveError::Unavailable`], since nothing can run one.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tpar_collectives::{nccl::StandIn, HashStore, ReduceOp};
///
/// let store = Arc::new(HashStore::new());
/// let (world, standin) = StandIn::world(store, 0, 1, Duration::from_secs(5))?;
/// let comms = standin.communicators();
/// assert_eq!((comms[0].ranks.clone(), comms[0].member), (vec![0], 0));
/// let t = tpar_tensor::Tensor::from_vec(vec![1.0f32], [1])?;
/// assert!(world.all_reduce(&t, ReduceOp::Sum).is_err()); // the first NCCL call
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct StandIn {
    log: Arc<Mutex<Vec<StandInComm>>>,
}

impl StandIn {
    /// This process's world group over `store` as `rank` of `world_size`, brought up
    /// without a GPU, and the record of its communicators (the world's first; each
    /// `new_group` of a new member list adds one).
    pub fn world(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<(ProcessGroup, StandIn)> {
        check_rank(rank, world_size)?;
        let standin = StandIn { log: Arc::new(Mutex::new(Vec::new())) };
        let world = start_world(store, rank, world_size, Arc::new(standin.clone()), timeout)?;
        Ok((world, standin))
    }

    /// The communicators brought up so far, in order.
    pub fn communicators(&self) -> Vec<StandInComm> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// 128 bytes no other call (in this process or another) is likely to give.
fn fresh_id() -> [u8; 128] {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let seed = RandomState::new();
    let mut id = [0u8; 128];
    for (i, chunk) in id.chunks_mut(8).enumerate() {
        let mut h = seed.build_hasher();
        h.write_u64(call);
        h.write_u32(std::process::id());
        h.write_usize(i);
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    id
}

impl Bringup for StandIn {
    fn unique_id(&self) -> std::result::Result<[u8; 128], String> {
        Ok(fresh_id())
    }

    fn start(
        &self,
        g: GroupSetup,
        jobs: Receiver<Job<DeviceJob>>,
        ready: Sender<Result<()>>,
    ) -> std::io::Result<()> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner).push(StandInComm {
            ranks: g.shared.group.to_vec(),
            member: g.me,
            key: g.key.clone(),
            unique_id: g.id,
        });
        std::thread::Builder::new().name(format!("tpar-nccl-standin-{}", g.key)).spawn(
            move || {
                if ready.send(Ok(())).is_err() {
                    return;
                }
                let unavailable = |op: &'static str| CollectiveError::Unavailable {
                    what: format!("NCCL {op}"),
                    why: "this group was brought up by the NCCL stand-in, which runs no \
                          collective (it checks a launch without a GPU)"
                        .into(),
                };
                for job in jobs {
                    let op = job.op();
                    match job {
                        Job::Collective { reply, .. } | Job::Recv { reply, .. } => {
                            let _ = reply.send(Err(unavailable(op)));
                        }
                        Job::Device { reply, .. } => {
                            let _ = reply.send(Err(unavailable(op)));
                        }
                        Job::Send { .. } => g.shared.fail(unavailable(op)),
                    }
                }
            },
        )?;
        Ok(())
    }
}
