//! Placements and the redistribution planner: pure data, no tensors, no
//! devices, no communication.
//!
//! A tensor laid out on an N-d device mesh has one [`Placement`] per mesh
//! dim: [`Shard(d)`](Placement::Shard), [`Replicate`](Placement::Replicate)
//! or [`Partial(op)`](Placement::Partial), as in PyTorch's DTensor. This
//! crate owns the arithmetic of those layouts and plans how to move a tensor
//! from one layout to another:
//!
//! * [`chunk_range`] and [`local_shape_and_offset`]: which part of the global
//!   tensor each mesh coordinate holds;
//! * [`plan`]: the steps (collectives and local slices) of a redistribution,
//!   with the bytes each moves, printable with [`Plan::explain`];
//! * [`simulate`]: a slow reference that lays out, redistributes and
//!   reassembles `f64` arrays for every rank, used as the test oracle.
//!
//! ```
//! use tpar_placements::{plan, Placement::*, ReduceOp, StepKind};
//!
//! // A [2048, 1024] f32 matrix on a 2x2 mesh, rows sharded over mesh dim 0.
//! let p = plan(&[2, 2], &[2048, 1024], 4, &[Shard(0), Replicate], &[Replicate, Shard(-1)])?;
//! assert_eq!(
//!     p.explain(),
//!     "S(0)R -> RR (all_gather on mesh dim 0, tensor dim 0, 4.0 MiB)\n\
//!      RR -> RS(1) (local_slice on mesh dim 1, tensor dim 1, no communication)"
//! );
//! assert_eq!(p.total_bytes(), 4 << 20);
//!
//! // A partial sum becomes a shard with one reduce_scatter.
//! let p = plan(&[4], &[8, 8], 4, &[Partial(ReduceOp::Sum)], &[Shard(0)])?;
//! assert!(matches!(p.steps[..], [ref s] if s.kind == StepKind::ReduceScatter { op: ReduceOp::Sum, tensor_dim: 0 }));
//! # Ok::<(), tpar_placements::PlacementError>(())
//! ```
//!
//! # Semantics
//!
//! **Shard(d), uneven sizes.** Like `torch.chunk`: `n` items over `k` ranks
//! use `chunk = ceil(n / k)`; rank `i` holds `[min(n, i*chunk), min(n,
//! (i+1)*chunk))`, possibly empty (5 over 4 gives 2, 2, 1, 0). Negative dims
//! count from the end and are normalised against the tensor rank.
//!
//! **Nested sharding.** When several mesh dims shard one tensor dim, mesh
//! dims apply left to right, each chunking what the previous ones left: 9
//! rows on a 2x2 mesh as `[S(0), S(0)]` give 3, 2, 2, 2 rows, as in PyTorch.
//!
//! **Partial(op).** Every rank along the mesh dim holds a term; the value is
//! the `op`-reduction of the terms. Turning `Replicate` into `Partial(sum)`
//! ([`StepKind::Partialize`]) keeps the value on coordinate 0 of the mesh
//! dim and zeros elsewhere (exact in every dtype and cheap, where dividing
//! by the mesh size would round); `Partial(avg|max|min)` keep the value on
//! every rank. When one placement list has `Partial`s on several mesh dims,
//! their ops should commute ([`ReduceOp::commutes_with`]: all of
//! `sum`/`avg`, or all `max`, or all `min`); otherwise the value depends on
//! the order of reduction and no redistribution can preserve it. The
//! planner does not reject such lists (PyTorch does not either); the
//! [`simulate`] module defines their value as reducing the last mesh dim
//! first. `Partialize` produces terms that are equal or zero, so lists the
//! planner itself produces mix ops safely.
//!
//! # The planner
//!
//! [`plan`] normalises the shard dims, then works in two passes over the
//! mesh dims, keeping the `current` placements. Mesh dim `i` *keeps* its
//! placement when `src[i] == dst[i]` and, for `Shard(d)`, the mesh dims left
//! of `i` that shard `d` are the same in `src` and `dst` (a nested shard is
//! only meaningful under the same outer shards).
//!
//! 1. **Right to left**, for each mesh dim `i` that does not keep:
//!    * `Shard(d)`: if `dst[i]` is `Shard(e)`, `e != d`, no other mesh dim
//!      has `Shard(d)` or `Shard(e)` in `current` or `dst`, and the
//!      `all_to_all` moves no more bytes than an `all_gather`, emit
//!      [`AllToAll`](StepKind::AllToAll); otherwise emit
//!      [`AllGather`](StepKind::AllGather) (then `Replicate`).
//!    * `Partial(op)` to `Replicate` or another `Partial`: emit
//!      [`AllReduce`](StepKind::AllReduce) (and `Partialize`) now, unless it
//!      moves fewer bytes in pass 2 (after mesh dims to the left are sliced).
//!    * `Partial(op)` to `Shard(e)`: if the mesh dims left of `i` shard `e`
//!      as `dst` does, emit [`ReduceScatter`](StepKind::ReduceScatter) now
//!      unless pass 2 is cheaper; otherwise defer it to pass 2, except when an
//!      `all_reduce` now (then a local slice in pass 2) moves strictly fewer
//!      bytes, which is what PyTorch always does there.
//! 2. **Left to right**, for each mesh dim still off target:
//!    `Replicate → Shard` [`LocalSlice`](StepKind::LocalSlice),
//!    `Replicate → Partial` [`Partialize`](StepKind::Partialize),
//!    `Partial → Replicate` `AllReduce`, `Partial → Partial'` `AllReduce`
//!    then `Partialize`, `Partial → Shard` one `ReduceScatter`.
//!
//! *Why it is correct.* Each step must find its tensor dim sharded, on the
//! other mesh dims, exactly as the step's nested order assumes: for a gather
//! or slice of `d` on mesh dim `i`, the mesh dims left of `i` shard `d` as
//! the layout before/after says and no mesh dim right of `i` shards `d`.
//! In pass 1, a mesh dim right of `i` still sharding `d` either keeps it
//! (its left-set of `d`-shards contains `i` in both `src` and `dst`, so `i`
//! keeps too), or was turned into `Shard(d)` by an `all_to_all` (excluded:
//! `i` touches `d`) or by an aligned `reduce_scatter` (its alignment makes
//! `src[i] == dst[i] == Shard(d)` with aligned left dims, so `i` keeps).
//! Mesh dims left of `i` are untouched in pass 1. In pass 2, mesh dims left
//! of `i` are at `dst` and the same three cases exclude right dims sharding
//! `e`. `AllReduce` and `Partialize` are elementwise and valid anywhere.
//! Pass 1 leaves every mismatched shard gathered, so pass 2 only meets
//! `Replicate` and `Partial`. The property tests check all of this on random
//! meshes, shapes and placements against [`simulate`].
//!
//! *Cost.* The choices above make every mesh dim's bytes at most those of
//! [`naive_plan`] (gather and all-reduce everything right to left, then
//! slice left to right): pass 1 sees the mesh dims to the left as the naive
//! plan does and those to the right no larger.
//!
//! # Bytes
//!
//! [`Step::bytes`] counts what the rank at coordinate 0 on every mesh dim
//! (the rank holding the largest shard) receives, or sends for
//! `reduce_scatter`/`all_to_all`, exactly with uneven chunks: all_gather,
//! the gathered size minus its own shard; reduce_scatter, the input minus
//! its output chunk; all_reduce, `2 (k - 1) / k` of the local size (ring);
//! all_to_all, the local size minus the chunk it keeps; local steps, 0.
#![warn(missing_docs)]

mod error;
mod placement;
mod plan;
mod shard;
pub mod simulate;

pub use error::{PlacementError, Result};
pub use placement::{fmt_placements, normalize_placements, parse_placements, Placement, ReduceOp};
pub use plan::{fmt_bytes, naive_plan, plan, Plan, PlanKey, Step, StepKind};
pub use shard::{chunk_range, largest_local_shape, local_shape_and_offset};
