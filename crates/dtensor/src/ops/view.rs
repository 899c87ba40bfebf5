//! Layout ops: transpose, permute, unsqueeze, squeeze, reshape, view, flatten.
//!
//! All of them are linear and move data only within a rank, so every placement passes
//! through (`Partial` of any op included) with its shard dim renumbered, except where a
//! sharded dim cannot map to one sharded dim of the result.

use tpar_placements::Placement;
use tpar_tensor::shape::normalize_dim;

use super::{finish, global_shape, meta, no_rule, prepare, unary_rule, Operand};
use crate::{DTensor, DTensorSpec, Result};

use Placement::{Replicate, Shard};

/// Groups of input and output dims whose products match (the dims a reshape merges or
/// splits together), as index ranges; trailing size-1 dims join the last group.
fn reshape_groups(
    a: &[usize],
    b: &[usize],
) -> Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let mut groups = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (si, sj) = (i, j);
        let (mut pa, mut pb) = (a[i], b[j]);
        i += 1;
        j += 1;
        while pa != pb {
            if pa < pb && i < a.len() {
                pa *= a[i];
                i += 1;
            } else if j < b.len() {
                pb *= b[j];
                j += 1;
            } else {
                break;
            }
        }
        groups.push((si..i, sj..j));
    }
    if i < a.len() || j < b.len() {
        match groups.last_mut() {
            Some(g) => {
                g.0.end = a.len();
                g.1.end = b.len();
            }
            None => groups.push((i..a.len(), j..b.len())),
        }
    }
    groups
}

impl DTensor {
    /// Reorders dims: output dim `i` is input dim `perm[i]`. Every placement passes; a
    /// shard of input dim `d` becomes a shard of the output dim that `d` moves to.
    /// No communication.
    pub fn permute(&self, perm: &[usize]) -> Result<DTensor> {
        let op = "permute";
        let out_shape = global_shape(op, &[("input", self)], || Ok(meta(self)?.permute(perm)?))?;
        let (_, out) = unary_rule(self, |p| match p {
            Shard(d) => {
                let to = perm.iter().position(|&q| q == d as usize).unwrap_or(0);
                (p, Shard(to as isize))
            }
            p => (p, p),
        });
        finish(self.local().permute(perm)?, self.mesh(), &out, &out_shape)
    }

    /// Swaps two dims; rules as [`DTensor::permute`].
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<DTensor> {
        let r = self.shape().len();
        let norm = |d| {
            normalize_dim("transpose", d, r)
                .map_err(|e| no_rule("transpose", &[("input", self)], &e.to_string()))
        };
        let (a, b) = (norm(d0)?, norm(d1)?);
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Inserts a size-1 dim at `dim`; shard dims at or after it shift by one. No
    /// communication.
    pub fn unsqueeze(&self, dim: isize) -> Result<DTensor> {
        let op = "unsqueeze";
        let out_shape = global_shape(op, &[("input", self)], || Ok(meta(self)?.unsqueeze(dim)?))?;
        let d = normalize_dim(op, dim, self.shape().len() + 1)
            .map_err(|e| no_rule(op, &[("input", self)], &e.to_string()))?;
        let (_, out) = unary_rule(self, |p| match p {
            Shard(s) if s as usize >= d => (p, Shard(s + 1)),
            p => (p, p),
        });
        finish(self.local().unsqueeze(dim)?, self.mesh(), &out, &out_shape)
    }

    /// Removes the size-1 dim `dim`; shard dims after it shift down. A mesh dim sharding
    /// `dim` itself is gathered first (implicit, one element per rank).
    pub fn squeeze(&self, dim: isize) -> Result<DTensor> {
        let op = "squeeze";
        let out_shape = global_shape(op, &[("input", self)], || Ok(meta(self)?.squeeze(dim)?))?;
        let d = normalize_dim(op, dim, self.shape().len())
            .map_err(|e| no_rule(op, &[("input", self)], &e.to_string()))?;
        let (target, out) = unary_rule(self, |p| match p {
            Shard(s) if s as usize == d => (Replicate, Replicate),
            Shard(s) if s as usize > d => (p, Shard(s - 1)),
            p => (p, p),
        });
        let x = prepare(op, "input", self, &target)?;
        finish(x.local().squeeze(dim)?, self.mesh(), &out, &out_shape)
    }

    /// The same elements with another global shape (same number of elements).
    ///
    /// Input and output dims fall into groups whose sizes multiply to the same number
    /// (the dims a reshape merges or splits together). A mesh dim sharding input dim `d`
    /// keeps a shard when `d` is the outermost dim of its group of size > 1 and every
    /// rank's block of the group maps to one block of the output group's outermost dim
    /// (checked for every mesh coordinate: e.g. `[6, 4] S(0) -> [24]` on 2 or 3 ranks,
    /// `[12] S(0) -> [3, 4]` on 3 ranks); the output is then sharded on that outermost
    /// output dim. Any other sharded mesh dim (an inner dim of a merge, or blocks that do
    /// not line up: `[3, 2] S(0) -> [6]` on 2 ranks) is gathered first (implicit
    /// all_gather). `Replicate` and `Partial` pass. No communication otherwise.
    pub fn reshape(&self, shape: &[usize]) -> Result<DTensor> {
        let op = "reshape";
        let operands: [Operand<'_>; 1] = [("input", self)];
        let out_shape = global_shape(op, &operands, || Ok(meta(self)?.reshape(shape.to_vec())?))?;
        let in_shape = self.shape().to_vec();
        let numel: usize = in_shape.iter().product();
        let mut target = self.placements().to_vec();
        let mut out: Vec<Placement>;
        if numel == 0 {
            // No data anywhere: shards become Replicate, each rank reshapes its empty block.
            out = target.iter().map(|p| if p.is_shard() { Replicate } else { *p }).collect();
        } else {
            let groups = reshape_groups(&in_shape, &out_shape);
            let group_of = |d: usize| groups.iter().position(|g| g.0.contains(&d));
            // Output dim for a valid shard of input dim d: the outermost non-trivial dims.
            let map = |d: usize| -> Option<usize> {
                let g = &groups[group_of(d)?];
                if g.1.is_empty() {
                    return None;
                }
                let outer = g.0.clone().find(|&i| in_shape[i] != 1).unwrap_or(g.0.start);
                (d == outer).then(|| g.1.clone().find(|&o| out_shape[o] != 1).unwrap_or(g.1.start))
            };
            let mut bad_groups: Vec<usize> = Vec::new();
            loop {
                out = Vec::with_capacity(target.len());
                for p in target.iter_mut() {
                    match *p {
                        Shard(d) => {
                            let d = d as usize;
                            match map(d)
                                .filter(|_| !group_of(d).is_some_and(|g| bad_groups.contains(&g)))
                            {
                                Some(o) => out.push(Shard(o as isize)),
                                None => {
                                    *p = Replicate;
                                    out.push(Replicate);
                                }
                            }
                        }
                        q => out.push(q),
                    }
                }
                // Every rank's block of a sharded group must map to the output's block.
                let src = self.spec().with_placements(&target)?;
                let dst = DTensorSpec::new(self.mesh(), &out, &out_shape)?;
                let mut newly_bad = Vec::new();
                for flat in 0..self.mesh().size() {
                    let coord = tpar_mesh::unflatten(flat, self.mesh().shape());
                    let (ls, lo) = src.local_at(&coord)?;
                    let (os, oo) = dst.local_at(&coord)?;
                    for (gi, g) in groups.iter().enumerate() {
                        let Some(d) = g.0.clone().find(|&d| target.contains(&Shard(d as isize)))
                        else {
                            continue;
                        };
                        let Some(o) = map(d) else { continue };
                        let inner_in: usize = in_shape[d + 1..g.0.end].iter().product();
                        let inner_out: usize = out_shape[o + 1..g.1.end].iter().product();
                        if lo[d] * inner_in != oo[o] * inner_out
                            || ls[d] * inner_in != os[o] * inner_out
                        {
                            newly_bad.push(gi);
                        }
                    }
                }
                if newly_bad.is_empty() {
                    break;
                }
                bad_groups.extend(newly_bad);
            }
        }
        let x = prepare(op, "input", self, &target)?;
        let spec = DTensorSpec::new(self.mesh(), &out, &out_shape)?;
        let (local_shape, _) = spec.local_shape_and_offset()?;
        finish(x.local().reshape(local_shape)?, self.mesh(), &out, &out_shape)
    }

    /// Reshape where one dim may be `-1` (inferred), as PyTorch's `view`; rules as
    /// [`DTensor::reshape`].
    pub fn view(&self, dims: &[isize]) -> Result<DTensor> {
        let shape = global_shape("view", &[("input", self)], || Ok(meta(self)?.view(dims)?))?;
        self.reshape(&shape)
    }

    /// Flattens dims `start..=end` into one; rules as [`DTensor::reshape`] (a shard of
    /// `start` survives when the blocks line up, a shard of a later dim is gathered).
    pub fn flatten(&self, start: isize, end: isize) -> Result<DTensor> {
        let shape =
            global_shape("flatten", &[("input", self)], || Ok(meta(self)?.flatten(start, end)?))?;
        self.reshape(&shape)
    }
}
