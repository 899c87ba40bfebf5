//! `DTensorSpec`: the mesh, the placements and the global shape of a distributed tensor.

use std::fmt;

use tpar_mesh::DeviceMesh;
use tpar_placements::{
    fmt_placements, local_shape_and_offset, normalize_placements, Placement, PlacementError,
};

use crate::Result;

/// How a global tensor is laid out over a mesh.
#[derive(Clone)]
pub struct DTensorSpec {
    mesh: DeviceMesh,
    placements: Vec<Placement>,
    shape: Vec<usize>,
}

impl DTensorSpec {
    /// A spec; placements are validated against the mesh and the shape and normalised
    /// (negative shard dims counted from the end).
    pub fn new(
        mesh: &DeviceMesh,
        placements: &[Placement],
        shape: &[usize],
    ) -> Result<DTensorSpec> {
        if placements.len() != mesh.ndim() {
            return Err(PlacementError::MeshRankMismatch {
                context: format!(
                    "placements {} for a tensor of shape {shape:?}",
                    fmt_placements(placements)
                ),
                placements: placements.len(),
                mesh: mesh.shape().to_vec(),
            }
            .into());
        }
        let placements = normalize_placements(placements, shape.len())?;
        Ok(DTensorSpec { mesh: mesh.clone(), placements, shape: shape.to_vec() })
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
    /// The placements, one per mesh dim (normalised).
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }
    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// This rank's local shape and its offset in the global tensor.
    pub fn local_shape_and_offset(&self) -> Result<(Vec<usize>, Vec<usize>)> {
        self.local_at(self.mesh.coordinate())
    }

    /// The local shape and offset at any mesh coordinate.
    pub fn local_at(&self, coord: &[usize]) -> Result<(Vec<usize>, Vec<usize>)> {
        Ok(local_shape_and_offset(&self.shape, self.mesh.shape(), coord, &self.placements)?)
    }

    /// The same mesh and shape with other placements.
    pub fn with_placements(&self, placements: &[Placement]) -> Result<DTensorSpec> {
        DTensorSpec::new(&self.mesh, placements, &self.shape)
    }
}

impl fmt::Display for DTensorSpec {
    /// `shape [8, 16] as S(0)R on mesh (dp=2, tp=2)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shape {:?} as {} on mesh {}",
            self.shape,
            fmt_placements(&self.placements),
            self.mesh
        )
    }
}

impl fmt::Debug for DTensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
