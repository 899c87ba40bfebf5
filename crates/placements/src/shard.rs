//! Shard-size arithmetic: `torch.chunk` ranges and per-rank local shapes.

use crate::error::{PlacementError, Result};
use crate::placement::{fmt_placements, Placement};

/// The `(start, len)` of chunk `i` when `n` items are split into `k` chunks
/// with `torch.chunk` semantics: `chunk = ceil(n / k)`,
/// `start = min(n, i * chunk)`, `len = min(n, (i + 1) * chunk) - start`.
///
/// Trailing chunks may be short or empty: 5 over 4 gives lengths 2, 2, 1, 0.
/// `k == 0` is treated as `k == 1`, and `i >= k` gives an empty chunk at `n`.
///
/// ```
/// use tpar_placements::chunk_range;
/// let lens: Vec<usize> = (0..4).map(|i| chunk_range(5, 4, i).1).collect();
/// assert_eq!(lens, [2, 2, 1, 0]);
/// assert_eq!(chunk_range(5, 4, 2), (4, 1));
/// assert_eq!(chunk_range(5, 4, 3), (5, 0));
/// ```
pub fn chunk_range(n: usize, k: usize, i: usize) -> (usize, usize) {
    let k = k.max(1);
    if i >= k {
        return (n, 0);
    }
    let chunk = n.div_ceil(k);
    let start = n.min(i.saturating_mul(chunk));
    let end = n.min(start.saturating_add(chunk));
    (start, end - start)
}

/// Checks that every mesh dim is at least 1 and that there is one
/// placement per mesh dim.
pub(crate) fn check_mesh(context: &str, mesh_shape: &[usize], placements: usize) -> Result<()> {
    if mesh_shape.contains(&0) {
        return Err(PlacementError::EmptyMeshDim {
            context: context.to_string(),
            mesh: mesh_shape.to_vec(),
        });
    }
    if placements != mesh_shape.len() {
        return Err(PlacementError::MeshRankMismatch {
            context: context.to_string(),
            placements,
            mesh: mesh_shape.to_vec(),
        });
    }
    Ok(())
}

/// Normalises `placements` against `global_shape`, reporting errors under
/// `context` with the shape filled in.
pub(crate) fn normalize_for(
    context: &str,
    global_shape: &[usize],
    placements: &[Placement],
) -> Result<Vec<Placement>> {
    placements
        .iter()
        .map(|p| p.normalize(global_shape.len()))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| e.with_context(context, Some(global_shape)))
}

/// Local shape and global offset with already-validated, normalised inputs.
pub(crate) fn local_shape_and_offset_unchecked(
    global_shape: &[usize],
    mesh_shape: &[usize],
    coord: impl Fn(usize) -> usize,
    placements: &[Placement],
) -> (Vec<usize>, Vec<usize>) {
    let mut shape = global_shape.to_vec();
    let mut offset = vec![0; global_shape.len()];
    for (i, p) in placements.iter().enumerate() {
        if let Placement::Shard(d) = *p {
            let d = d as usize;
            let (start, len) = chunk_range(shape[d], mesh_shape[i], coord(i));
            offset[d] += start;
            shape[d] = len;
        }
    }
    (shape, offset)
}

/// The shape of the largest local shard: the one at coordinate 0 on every
/// mesh dim (inputs already validated and normalised).
pub(crate) fn largest_local_shape_unchecked(
    global_shape: &[usize],
    mesh_shape: &[usize],
    placements: &[Placement],
) -> Vec<usize> {
    local_shape_and_offset_unchecked(global_shape, mesh_shape, |_| 0, placements).0
}

/// The local shape and global offset of the shard held at mesh coordinate
/// `coord`, as PyTorch's `compute_local_shape_and_global_offset` computes them.
///
/// Mesh dims are walked left to right; a `Shard(d)` on mesh dim `i` chunks
/// the *current* local size of tensor dim `d` into `mesh_shape[i]` pieces
/// (see [`chunk_range`]) and keeps piece `coord[i]`, adding its start to the
/// offset. `Replicate` and `Partial` leave the shape alone. So nine rows on a
/// 2x2 mesh as `[S(0), S(0)]` give 3, 2, 2, 2 rows at coordinates (0,0),
/// (0,1), (1,0), (1,1).
///
/// # Errors
/// [`PlacementError::EmptyMeshDim`], [`PlacementError::MeshRankMismatch`]
/// (one placement per mesh dim), [`PlacementError::CoordOutOfRange`], and
/// [`PlacementError::DimOutOfRange`] for a shard dim outside the tensor.
///
/// ```
/// use tpar_placements::{local_shape_and_offset, Placement::*};
/// let sizes: Vec<(usize, usize)> = [[0, 0], [0, 1], [1, 0], [1, 1]]
///     .iter()
///     .map(|c| {
///         let (shape, off) = local_shape_and_offset(&[9], &[2, 2], c, &[Shard(0), Shard(0)]).unwrap();
///         (shape[0], off[0])
///     })
///     .collect();
/// assert_eq!(sizes, [(3, 0), (2, 3), (2, 5), (2, 7)]);
/// ```
pub fn local_shape_and_offset(
    global_shape: &[usize],
    mesh_shape: &[usize],
    coord: &[usize],
    placements: &[Placement],
) -> Result<(Vec<usize>, Vec<usize>)> {
    let context = format!(
        "local shape of {} on mesh {mesh_shape:?} at coordinate {coord:?}",
        fmt_placements(placements)
    );
    check_mesh(&context, mesh_shape, placements.len())?;
    if coord.len() != mesh_shape.len() || coord.iter().zip(mesh_shape).any(|(c, m)| c >= m) {
        return Err(PlacementError::CoordOutOfRange {
            context,
            coord: coord.to_vec(),
            mesh: mesh_shape.to_vec(),
        });
    }
    let placements = normalize_for(&context, global_shape, placements)?;
    Ok(local_shape_and_offset_unchecked(global_shape, mesh_shape, |i| coord[i], &placements))
}

/// The shape of the largest local shard of a tensor laid out as
/// `placements`: the one at coordinate 0 on every mesh dim. Useful for
/// memory estimates; the planner's byte counts use it.
///
/// # Errors
/// As [`local_shape_and_offset`].
pub fn largest_local_shape(
    global_shape: &[usize],
    mesh_shape: &[usize],
    placements: &[Placement],
) -> Result<Vec<usize>> {
    let zero = vec![0; mesh_shape.len()];
    local_shape_and_offset(global_shape, mesh_shape, &zero, placements).map(|(s, _)| s)
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
        assert_eq!(chunk_range(usize::MAX, 2, 1).1, usize::MAX / 2);
    }
    use Placement::*;

    #[test]
    fn chunk_table() {
        let table = |n, k| (0..k).map(|i| chunk_range(n, k, i)).collect::<Vec<_>>();
        assert_eq!(table(5, 4), [(0, 2), (2, 2), (4, 1), (5, 0)]);
        assert_eq!(table(8, 4), [(0, 2), (2, 2), (4, 2), (6, 2)]);
        assert_eq!(table(0, 3), [(0, 0), (0, 0), (0, 0)]);
        assert_eq!(table(1, 3), [(0, 1), (1, 0), (1, 0)]);
        assert_eq!(table(7, 3), [(0, 3), (3, 3), (6, 1)]);
        assert_eq!(table(9, 2), [(0, 5), (5, 4)]);
        assert_eq!(table(6, 4), [(0, 2), (2, 2), (4, 2), (6, 0)]);
        assert_eq!(table(3, 1), [(0, 3)]);
        assert_eq!(chunk_range(3, 0, 0), (0, 3));
        assert_eq!(chunk_range(3, 2, 5), (3, 0));
    }

    #[test]
    fn nested_sharding_chunks_the_current_size() {
        let mesh = [2, 2];
        let got: Vec<usize> = [[0, 0], [0, 1], [1, 0], [1, 1]]
            .iter()
            .map(|c| local_shape_and_offset(&[9], &mesh, c, &[Shard(0), Shard(0)]).unwrap().0[0])
            .collect();
        assert_eq!(got, [3, 2, 2, 2]);
    }

    #[test]
    fn two_dims_and_negative_dims() {
        let (s, o) =
            local_shape_and_offset(&[5, 7], &[2, 3], &[1, 2], &[Shard(0), Shard(-1)]).unwrap();
        assert_eq!(s, [2, 1]);
        assert_eq!(o, [3, 6]);
        let (s, o) = local_shape_and_offset(
            &[5, 7],
            &[2, 3],
            &[1, 2],
            &[Replicate, Partial(crate::ReduceOp::Sum)],
        )
        .unwrap();
        assert_eq!((s, o), (vec![5, 7], vec![0, 0]));
        assert_eq!(largest_local_shape(&[5, 7], &[2, 3], &[Shard(1), Shard(1)]).unwrap(), [5, 2]);
    }

    #[test]
    fn errors_name_the_numbers() {
        let e =
            local_shape_and_offset(&[8, 16], &[2, 2], &[0, 0], &[Replicate, Shard(3)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "local shape of RS(3) on mesh [2, 2] at coordinate [0, 0]: tensor dim 3 out of range for shape [8, 16]"
        );
        let e =
            local_shape_and_offset(&[8], &[2, 2], &[0, 2], &[Replicate, Replicate]).unwrap_err();
        assert!(matches!(e, PlacementError::CoordOutOfRange { .. }), "{e}");
        assert!(e.to_string().contains("coordinate [0, 2] does not fit mesh [2, 2]"), "{e}");
        let e = local_shape_and_offset(&[8], &[2, 2], &[0], &[Replicate, Replicate]).unwrap_err();
        assert!(matches!(e, PlacementError::CoordOutOfRange { .. }), "{e}");
        let e = local_shape_and_offset(&[8], &[2, 2], &[0, 0], &[Replicate]).unwrap_err();
        assert!(e.to_string().ends_with("1 placements for the 2-d mesh [2, 2]"), "{e}");
        let e =
            local_shape_and_offset(&[8], &[2, 0], &[0, 0], &[Replicate, Replicate]).unwrap_err();
        assert!(matches!(e, PlacementError::EmptyMeshDim { .. }), "{e}");
    }
}
