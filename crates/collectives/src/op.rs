//! Collective kinds; the reduction operators and the shard-size rule, re-exported from
//! `tpar-placements`, which owns them.

use std::fmt;

pub use tpar_placements::ReduceOp;

/// The kind of a communication call, as recorded by [`CommDebug`](crate::CommDebug).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CollectiveKind {
    /// [`ProcessGroup::all_reduce`](crate::ProcessGroup::all_reduce).
    AllReduce,
    /// [`ProcessGroup::all_gather`](crate::ProcessGroup::all_gather).
    AllGather,
    /// [`ProcessGroup::reduce_scatter`](crate::ProcessGroup::reduce_scatter).
    ReduceScatter,
    /// [`ProcessGroup::all_to_all`](crate::ProcessGroup::all_to_all) and its sized variant.
    AllToAll,
    /// [`ProcessGroup::broadcast`](crate::ProcessGroup::broadcast).
    Broadcast,
    /// [`ProcessGroup::barrier`](crate::ProcessGroup::barrier).
    Barrier,
    /// [`ProcessGroup::send`](crate::ProcessGroup::send) and
    /// [`ProcessGroup::send_shaped`](crate::ProcessGroup::send_shaped).
    Send,
    /// [`ProcessGroup::recv`](crate::ProcessGroup::recv) and
    /// [`ProcessGroup::recv_shaped`](crate::ProcessGroup::recv_shaped).
    Recv,
}

impl CollectiveKind {
    /// Every kind, in declaration order.
    pub const ALL: [CollectiveKind; 8] = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
        CollectiveKind::Send,
        CollectiveKind::Recv,
    ];

    /// Short name, as PyTorch spells the function: `all_reduce`, `all_gather`, ...
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::Send => "send",
            CollectiveKind::Recv => "recv",
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub use tpar_placements::chunk_range;
