//! `DeviceMesh`: an n-d arrangement of ranks with named dims and one process
//! group per dim, as PyTorch's `init_device_mesh`.
//!
//! Ranks are laid out row-major: on a `(dp=2, tp=2)` mesh over ranks 0..4, rank 1 is at
//! coordinate `(0, 1)` and the `tp` groups are `{0, 1}` and `{2, 3}`.
//!
//! ```
//! use tpar_collectives::{spawn, ReduceOp};
//! use tpar_mesh::{DeviceMesh, DeviceType, MeshError};
//! use tpar_tensor::Tensor;
//! let out = spawn(4, |ctx| -> Result<(usize, usize, f32), MeshError> {
//!     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
//!     let tp = &mesh["tp"];
//!     let x = Tensor::from_vec(vec![ctx.rank() as f32], [1])?;
//!     let s = tp.group(0)?.all_reduce(&x, ReduceOp::Sum)?.to_vec::<f32>()?[0];
//!     Ok((mesh["dp"].local_rank(), tp.local_rank(), s))
//! })?;
//! assert_eq!(out, vec![(0, 0, 1.0), (0, 1, 1.0), (1, 0, 5.0), (1, 1, 5.0)]);
//! # Ok::<(), MeshError>(())
//! ```
#![warn(missing_docs)]

use std::fmt;
use std::ops::Index;
use std::sync::Arc;

use tpar_collectives::{CollectiveError, ProcessGroup};

/// The kind of device a mesh spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceType {
    /// Host CPUs (the local backend).
    Cpu,
    /// CUDA GPUs, one per rank.
    Cuda,
}

/// Errors building or indexing a mesh.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MeshError {
    /// The mesh's size does not match the ranks it is built over.
    #[error("mesh shape {shape:?} holds {size} ranks but the group has {world}")]
    SizeMismatch {
        /// The requested shape.
        shape: Vec<usize>,
        /// Its number of ranks.
        size: usize,
        /// The number of ranks available.
        world: usize,
    },
    /// A dim name that the mesh does not have.
    #[error("mesh has no dim named {name:?}; its dims are {available:?}")]
    UnknownDim {
        /// The name asked for.
        name: String,
        /// The names the mesh has.
        available: Vec<String>,
    },
    /// A dim index out of range.
    #[error("mesh dim {dim} out of range for a {ndim}-d mesh")]
    DimOutOfRange {
        /// The index asked for.
        dim: usize,
        /// The mesh's number of dims.
        ndim: usize,
    },
    /// Names that repeat, or a names list of the wrong length.
    #[error("invalid mesh dim names {names:?} for shape {shape:?}: {why}")]
    BadNames {
        /// The names given.
        names: Vec<String>,
        /// The shape given.
        shape: Vec<usize>,
        /// What is wrong.
        why: String,
    },
    /// This rank is not part of the mesh.
    #[error("rank {rank} is not in the mesh's ranks {ranks:?}")]
    NotAMember {
        /// This rank.
        rank: usize,
        /// The mesh's ranks.
        ranks: Vec<usize>,
    },
    /// A collective or group error underneath.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

impl From<tpar_tensor::TensorError> for MeshError {
    fn from(e: tpar_tensor::TensorError) -> Self {
        MeshError::Collective(CollectiveError::from(e))
    }
}

/// Result type of mesh operations.
pub type Result<T> = std::result::Result<T, MeshError>;

/// An n-d mesh of ranks with named dims, one process group per dim.
#[derive(Clone)]
pub struct DeviceMesh {
    device: DeviceType,
    shape: Vec<usize>,
    names: Vec<String>,
    /// Global ranks in row-major order of the mesh.
    ranks: Vec<usize>,
    coord: Vec<usize>,
    /// The group of the ranks along each dim through this rank's coordinate.
    groups: Vec<ProcessGroup>,
    /// The 1-d meshes of each dim (empty for a 1-d mesh, which is its own dim).
    dims: Vec<DeviceMesh>,
    /// The mesh this one was cut from by [`DeviceMesh::dim`] or [`DeviceMesh::slice`]
    /// (kept without its dim meshes); `None` for a mesh built over ranks.
    root: Option<Arc<DeviceMesh>>,
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceMesh({:?}, ", self.device)?;
        let dims: Vec<String> =
            self.names.iter().zip(&self.shape).map(|(n, s)| format!("{n}={s}")).collect();
        write!(f, "({}), ranks {:?}, coord {:?})", dims.join(", "), self.ranks, self.coord)
    }
}

impl fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> =
            self.names.iter().zip(&self.shape).map(|(n, s)| format!("{n}={s}")).collect();
        write!(f, "({})", dims.join(", "))
    }
}

fn check_names(shape: &[usize], names: &[String]) -> Result<()> {
    let bad = |why: &str| MeshError::BadNames {
        names: names.to_vec(),
        shape: shape.to_vec(),
        why: why.into(),
    };
    if names.len() != shape.len() {
        return Err(bad("one name per dim is needed"));
    }
    for (i, n) in names.iter().enumerate() {
        if names[..i].contains(n) {
            return Err(bad(&format!("name {n:?} repeats")));
        }
    }
    if shape.is_empty() {
        return Err(bad("a mesh needs at least one dim"));
    }
    Ok(())
}

impl DeviceMesh {
    /// A mesh of `shape` over all members of `world` (row-major), as
    /// `init_device_mesh(device, shape, mesh_dim_names=names)`. Every member must call it.
    pub fn new(
        world: &ProcessGroup,
        device: DeviceType,
        shape: &[usize],
        names: &[&str],
    ) -> Result<DeviceMesh> {
        DeviceMesh::from_ranks(world, device, world.ranks(), shape, names)
    }

    /// A mesh over the given global ranks (row-major), which must include this rank.
    pub fn from_ranks(
        world: &ProcessGroup,
        device: DeviceType,
        ranks: &[usize],
        shape: &[usize],
        names: &[&str],
    ) -> Result<DeviceMesh> {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        check_names(shape, &names)?;
        let size: usize = shape.iter().product();
        if size != ranks.len() {
            return Err(MeshError::SizeMismatch {
                shape: shape.to_vec(),
                size,
                world: ranks.len(),
            });
        }
        let me = world.global_rank();
        let flat = ranks
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| MeshError::NotAMember { rank: me, ranks: ranks.to_vec() })?;
        let coord = unflatten(flat, shape);
        let mut groups = Vec::with_capacity(shape.len());
        for d in 0..shape.len() {
            let members: Vec<usize> = (0..shape[d])
                .map(|i| {
                    let mut c = coord.clone();
                    c[d] = i;
                    ranks[flatten(&c, shape)]
                })
                .collect();
            groups.push(world.new_group(&members)?);
        }
        let mut mesh = DeviceMesh {
            device,
            shape: shape.to_vec(),
            names,
            ranks: ranks.to_vec(),
            coord,
            groups,
            dims: Vec::new(),
            root: None,
        };
        mesh.fill_dims();
        Ok(mesh)
    }

    /// Builds the 1-d meshes of every dim (a mesh of more than one dim).
    fn fill_dims(&mut self) {
        if self.shape.len() > 1 {
            self.dims = (0..self.shape.len()).map(|d| self.dim_mesh(d)).collect();
        }
    }

    /// The mesh this one was cut from, without its dim meshes (itself when it was built
    /// over ranks).
    fn root_arc(&self) -> Arc<DeviceMesh> {
        match &self.root {
            Some(r) => r.clone(),
            None => Arc::new(DeviceMesh { dims: Vec::new(), root: None, ..self.clone() }),
        }
    }

    /// The mesh this one was cut from by [`DeviceMesh::dim`] or [`DeviceMesh::slice`]
    /// (PyTorch's root mesh): itself when it was built over ranks. FSDP uses it to lay
    /// a parameter out over its dp mesh and its tensor-parallel mesh together.
    pub fn root(&self) -> DeviceMesh {
        match &self.root {
            Some(r) => {
                let mut m = DeviceMesh::clone(r);
                m.fill_dims();
                m
            }
            None => self.clone(),
        }
    }

    /// The 1-d mesh along dim `d` through this rank (reusing its group).
    fn dim_mesh(&self, d: usize) -> DeviceMesh {
        let ranks: Vec<usize> = (0..self.shape[d])
            .map(|i| {
                let mut c = self.coord.clone();
                c[d] = i;
                self.ranks[flatten(&c, &self.shape)]
            })
            .collect();
        DeviceMesh {
            device: self.device,
            shape: vec![self.shape[d]],
            names: vec![self.names[d].clone()],
            ranks,
            coord: vec![self.coord[d]],
            groups: vec![self.groups[d].clone()],
            dims: Vec::new(),
            root: Some(self.root_arc()),
        }
    }

    /// The device type.
    pub fn device_type(&self) -> DeviceType {
        self.device
    }
    /// Number of dims.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    /// Size of every dim.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// Dim names.
    pub fn names(&self) -> &[String] {
        &self.names
    }
    /// Global ranks in row-major mesh order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    /// This rank's coordinate.
    pub fn coordinate(&self) -> &[usize] {
        &self.coord
    }
    /// This rank's global rank.
    pub fn global_rank(&self) -> usize {
        self.ranks[flatten(&self.coord, &self.shape)]
    }
    /// This rank's index along a 1-d mesh (its coordinate on dim 0), as
    /// `mesh["tp"].get_local_rank()`.
    pub fn local_rank(&self) -> usize {
        self.coord[0]
    }
    /// This rank's coordinate on a named dim.
    pub fn local_rank_of(&self, name: &str) -> Result<usize> {
        Ok(self.coord[self.dim_index(name)?])
    }

    /// Index of a named dim.
    pub fn dim_index(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| MeshError::UnknownDim {
            name: name.to_string(),
            available: self.names.clone(),
        })
    }

    /// The process group of mesh dim `d` (the ranks along `d` through this rank).
    pub fn group(&self, d: usize) -> Result<&ProcessGroup> {
        self.groups.get(d).ok_or(MeshError::DimOutOfRange { dim: d, ndim: self.ndim() })
    }

    /// The process group of a named dim.
    pub fn group_of(&self, name: &str) -> Result<&ProcessGroup> {
        self.group(self.dim_index(name)?)
    }

    /// The 1-d sub-mesh of a named dim (`mesh["tp"]` without panicking).
    pub fn dim(&self, name: &str) -> Result<&DeviceMesh> {
        let d = self.dim_index(name)?;
        Ok(if self.dims.is_empty() { self } else { &self.dims[d] })
    }

    /// The sub-mesh of several named dims, in the order given (`mesh["dp", "tp"]`,
    /// `mesh["tp", "dp"]`), through this rank. Each dim keeps its process group (nothing
    /// is communicated or created), and the sub-mesh remembers its root
    /// ([`DeviceMesh::root`]).
    pub fn slice(&self, names: &[&str]) -> Result<DeviceMesh> {
        let idx = names.iter().map(|n| self.dim_index(n)).collect::<Result<Vec<_>>>()?;
        if let Some(n) =
            names.iter().enumerate().find_map(|(i, n)| names[..i].contains(n).then_some(n))
        {
            return Err(MeshError::BadNames {
                names: names.iter().map(|s| s.to_string()).collect(),
                shape: self.shape.clone(),
                why: format!("name {n:?} repeats"),
            });
        }
        let shape: Vec<usize> = idx.iter().map(|&d| self.shape[d]).collect();
        let sub_size: usize = shape.iter().product();
        let ranks: Vec<usize> = (0..sub_size)
            .map(|f| {
                let sc = unflatten(f, &shape);
                let mut c = self.coord.clone();
                idx.iter().zip(&sc).for_each(|(&d, &v)| c[d] = v);
                self.ranks[flatten(&c, &self.shape)]
            })
            .collect();
        let mut mesh = DeviceMesh {
            device: self.device,
            names: names.iter().map(|s| s.to_string()).collect(),
            ranks,
            coord: idx.iter().map(|&d| self.coord[d]).collect(),
            groups: idx.iter().map(|&d| self.groups[d].clone()).collect(),
            shape,
            dims: Vec::new(),
            root: Some(self.root_arc()),
        };
        mesh.fill_dims();
        Ok(mesh)
    }

    /// The dims `names` (adjacent or not) flattened into one dim called `new_name`,
    /// as `mesh["dp", "tp"]._flatten("dp_tp")`.
    ///
    /// When `names` are adjacent dims of the root mesh ([`DeviceMesh::root`]) in its
    /// order (`["dp", "cp"]` of `["pp", "dp", "cp", "tp"]`), the flattened mesh's root
    /// is that root with those dims merged into `new_name` (`["pp", "dp_cp", "tp"]`,
    /// the other dims keeping their groups), as PyTorch registers a flattened dim
    /// with its root: FSDP over the flattened dim then lays a parameter out together
    /// with its tensor-parallel dim.
    pub fn flatten(&self, names: &[&str], new_name: &str) -> Result<DeviceMesh> {
        let sliced = self.slice(names)?;
        let mut flat = self.derive(sliced.ranks.clone(), vec![sliced.size()], &[new_name])?;
        flat.root = self.root().merged(names, new_name, &flat.groups[0]).map(Arc::new);
        Ok(flat)
    }

    /// This mesh (a root) with the adjacent dims `names` merged into one called
    /// `new_name` whose group is `group`; `None` unless `names` are adjacent dims in
    /// this mesh's order and `new_name` is not another dim's name.
    fn merged(&self, names: &[&str], new_name: &str, group: &ProcessGroup) -> Option<DeviceMesh> {
        let idx: Vec<usize> =
            names.iter().map(|n| self.dim_index(n).ok()).collect::<Option<_>>()?;
        let (first, last) = (*idx.first()?, *idx.last()?);
        if idx.iter().enumerate().any(|(k, &d)| d != first + k) {
            return None;
        }
        if self.names.iter().enumerate().any(|(d, n)| n == new_name && !(first..=last).contains(&d))
        {
            return None;
        }
        let size: usize = self.shape[first..=last].iter().product();
        let coord = flatten(&self.coord[first..=last], &self.shape[first..=last]);
        let splice = |v: &[usize], x: usize| -> Vec<usize> {
            let mut out = v[..first].to_vec();
            out.push(x);
            out.extend_from_slice(&v[last + 1..]);
            out
        };
        let mut groups = self.groups[..first].to_vec();
        groups.push(group.clone());
        groups.extend_from_slice(&self.groups[last + 1..]);
        let mut names_out = self.names[..first].to_vec();
        names_out.push(new_name.to_string());
        names_out.extend_from_slice(&self.names[last + 1..]);
        Some(DeviceMesh {
            device: self.device,
            shape: splice(&self.shape, size),
            names: names_out,
            ranks: self.ranks.clone(),
            coord: splice(&self.coord, coord),
            groups,
            dims: Vec::new(),
            root: None,
        })
    }

    fn derive(&self, ranks: Vec<usize>, shape: Vec<usize>, names: &[&str]) -> Result<DeviceMesh> {
        DeviceMesh::from_ranks(&self.groups[0], self.device, &ranks, &shape, names)
    }
}

impl Index<&str> for DeviceMesh {
    type Output = DeviceMesh;

    /// `mesh["tp"]`. Panics on an unknown name, as indexing does; use
    /// [`DeviceMesh::dim`] for a `Result`.
    fn index(&self, name: &str) -> &DeviceMesh {
        match self.dim(name) {
            Ok(m) => m,
            Err(e) => panic!("{e}"),
        }
    }
}

/// Row-major flat index of a coordinate.
pub fn flatten(coord: &[usize], shape: &[usize]) -> usize {
    coord.iter().zip(shape).fold(0, |acc, (&c, &s)| acc * s + c)
}

/// Row-major coordinate of a flat index.
pub fn unflatten(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        c[d] = flat % shape[d].max(1);
        flat /= shape[d].max(1);
    }
    c
}
