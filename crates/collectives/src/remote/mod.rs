//! What the backends whose members are separate processes (`nccl`, `tcp`) share: the
//! collectives over an abstract [`Transport`](exec::Transport) of flat host buffers
//! (header exchange and agreement checks, plans for uneven shards, packing), the wire
//! header, the worker thread that owns a group's transport and runs its jobs in order,
//! and the group handle ([`RemoteComm`]) whose `*_async` calls are queued jobs.
//!
//! A backend brings a `Transport` (NCCL on a CUDA stream; TCP sockets between
//! processes) and a [`RemoteWorld`] that sets groups up; everything else is here. A
//! transport with a device path names its work as its
//! [`DeviceJob`](exec::Transport::DeviceJob) (a [`DeviceWork`]), which the worker and the
//! handle carry without looking inside, so this layer knows no backend's types.

pub(crate) mod comm;
pub(crate) mod exec;
pub(crate) mod plan;
pub(crate) mod wire;
pub(crate) mod worker;

pub(crate) use comm::{Pending, RemoteComm, RemoteWorld, WeakComm};
pub(crate) use exec::{DeviceWork, NoDevice};
