//! Reduction operators, collective kinds and the shard-size rule.

use std::fmt;

/// How `all_reduce` and `reduce_scatter` combine the members' tensors.
///
/// Floating-point reductions of bf16/f16 accumulate in f32 (f64 in f64) and round
/// once at the end. Members' terms are combined in group-rank order, so every
/// member gets bit-identical results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise mean over the members (float dtypes only).
    Avg,
    /// Elementwise maximum (NaN propagates).
    Max,
    /// Elementwise minimum (NaN propagates).
    Min,
    /// Elementwise product.
    Product,
}

impl ReduceOp {
    /// Short name: `sum`, `avg`, `max`, `min`, `product`.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
    /// [`ProcessGroup::send`](crate::ProcessGroup::send).
    Send,
    /// [`ProcessGroup::recv`](crate::ProcessGroup::recv).
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

/// The `torch.chunk` shard rule: splitting `n` elements over `k` shards, shard `i` holds
/// `len` elements starting at `start`.
///
/// The chunk size is `ceil(n / k)`; shard `i` covers `[i * chunk, min(n, (i + 1) * chunk))`,
/// which may be empty (`n = 5, k = 4` gives lengths 2, 2, 1, 0). `k = 0` or `i >= k` give
/// an empty range at `n`.
///
/// ```
/// use tpar_collectives::chunk_range;
/// let lens: Vec<usize> = (0..4).map(|i| chunk_range(5, 4, i).1).collect();
/// assert_eq!(lens, [2, 2, 1, 0]);
/// assert_eq!(chunk_range(5, 4, 2), (4, 1));
/// ```
pub fn chunk_range(n: usize, k: usize, i: usize) -> (usize, usize) {
    if k == 0 || i >= k {
        return (n, 0);
    }
    let chunk = n.div_ceil(k);
    let start = i.saturating_mul(chunk).min(n);
    let end = start.saturating_add(chunk).min(n);
    (start, end - start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_range_matches_torch_chunk() {
        for n in 0usize..40 {
            for k in 1..10 {
                let mut next = 0;
                let chunk = n.div_ceil(k);
                for i in 0..k {
                    let (s, l) = chunk_range(n, k, i);
                    assert_eq!(s, next.min(n), "n={n} k={k} i={i}");
                    assert!(l <= chunk);
                    next = s + l;
                    if l > 0 && s + l < n {
                        assert_eq!(l, chunk);
                    }
                }
                assert_eq!(next, n);
            }
        }
        assert_eq!(chunk_range(7, 0, 0), (7, 0));
        assert_eq!(chunk_range(usize::MAX, 2, 1).1, usize::MAX / 2);
    }
}
