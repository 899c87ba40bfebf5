//! What is known of plain tensors that are DTensor shards, so a style that takes a plain
//! tensor back as a DTensor needs no communication to learn its global shape.
//!
//! A style with `use_local_output` hands the next module a DTensor's local shard; a later
//! style that takes that plain tensor back ([`DTensor::from_local`] without a shape, as
//! PyTorch's `from_local(run_check=False)`) would otherwise exchange every rank's local
//! shape to learn the global one (uneven shards are exact in tpar, never guessed).
//! Instead the handing-on side [`remember`]s the DTensor's layout under the local
//! tensor's identity (tensor ids are never reused), elementwise ops on plain shards of one
//! layout [`propagate`] it (a residual `x + h`), and the taking side asks
//! [`known_shape`].
//!
//! The record is per thread (per rank) and holds only tensors some handle still holds:
//! an entry is kept with a [`WeakTensor`], and whenever the record has doubled since it
//! was last pruned, the entries of dropped tensors go (a dropped tensor's id can never be
//! asked about again). A training step remembers a few shards per layer; the record stays
//! at the size of what one step keeps alive, however many steps run. Whether a tensor is
//! known depends only on the program's path and on global layouts, never on a rank's
//! data, so every rank of a group makes the same choice and none waits on a shape
//! exchange the others skip.

use std::cell::RefCell;
use std::collections::HashMap;

use tpar_mesh::DeviceMesh;
use tpar_placements::{normalize_placements, Placement};
use tpar_tensor::{Tensor, WeakTensor};

use crate::DTensor;

#[derive(Clone, PartialEq, Eq)]
struct Known {
    ranks: Vec<usize>,
    mesh_shape: Vec<usize>,
    placements: Vec<Placement>,
    shape: Vec<usize>,
    /// This rank's shard's offset in the global tensor.
    offset: Option<Vec<usize>>,
}

/// The smallest size at which the record is pruned.
const PRUNE_MIN: usize = 64;

/// Layouts by tensor id, each with a handle that tells whether its tensor is alive.
struct Record {
    known: HashMap<u64, (WeakTensor, Known)>,
    /// The size at which the entries of dropped tensors are next removed.
    prune_at: usize,
}

thread_local! {
    static RECORD: RefCell<Record> =
        RefCell::new(Record { known: HashMap::new(), prune_at: PRUNE_MIN });
}

fn insert(t: &Tensor, k: Known) {
    RECORD.with(|r| {
        let mut r = r.borrow_mut();
        if r.known.len() >= r.prune_at {
            r.known.retain(|_, (w, _)| w.is_alive());
            r.prune_at = (2 * r.known.len()).max(PRUNE_MIN);
        }
        r.known.insert(t.id(), (t.downgrade(), k));
    });
}

fn get(id: u64) -> Option<Known> {
    RECORD.with(|r| r.borrow().known.get(&id).map(|(_, k)| k.clone()))
}

/// How many tensors this thread's record holds (for tests).
#[doc(hidden)]
pub fn recorded() -> usize {
    RECORD.with(|r| r.borrow().known.len())
}

/// `d`'s local shard, remembered as the shard of `d`'s layout (mesh, placements, global
/// shape).
pub fn remember(d: &DTensor) -> Tensor {
    insert(
        d.local(),
        Known {
            ranks: d.mesh().ranks().to_vec(),
            mesh_shape: d.mesh().shape().to_vec(),
            placements: d.placements().to_vec(),
            shape: d.shape().to_vec(),
            offset: d.spec().local_shape_and_offset().ok().map(|(_, o)| o),
        },
    );
    d.to_local()
}

/// The global shape of `t` taken as this rank's shard laid out as `placements` on
/// `mesh`, when `t` was [`remember`]ed (or [`propagate`]d) with that layout.
pub fn known_shape(t: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Option<Vec<usize>> {
    let k = get(t.id())?;
    let ps = normalize_placements(placements, t.rank()).ok()?;
    let same = k.ranks == mesh.ranks() && k.mesh_shape == mesh.shape() && k.placements == ps;
    same.then_some(k.shape)
}

/// Where `t` sits in its global tensor, when it was [`remember`]ed (or [`propagate`]d)
/// as a DTensor's shard: the global shape and the shard's offset in it. A random op draws
/// by these positions ([`tpar_tensor::Tensor::dropout_shard`]), so plain shards draw the
/// global tensor's mask as its DTensor would.
pub fn known_shard(t: &Tensor) -> Option<(Vec<usize>, Vec<usize>)> {
    let k = get(t.id())?;
    Some((k.shape, k.offset?))
}

/// Records `out`, the result of an elementwise op on `operands`, with their layout when
/// all of them are known with one layout and have `out`'s local shape.
pub fn propagate(out: &Tensor, operands: &[&Tensor]) {
    let mut known = operands.iter().map(|t| (get(t.id()), t.dims()));
    let Some((Some(first), _)) = known.next() else { return };
    let dims = out.dims();
    if operands[0].dims() == dims && known.all(|(k, d)| k.as_ref() == Some(&first) && d == dims) {
        insert(out, first);
    }
}
