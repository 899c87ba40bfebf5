//! Fully sharded data parallelism, as PyTorch's FSDP2 (`fully_shard`): every parameter
//! of a unit is sharded along dim 0 over the dp ranks (the tensor-parallel local shard,
//! when it is also tensor-parallel), gathered before the unit's forward and again for its
//! backward, and its gradient reduce-scattered (averaged over dp) into the shard.
//!
//! * [`fully_shard`], [`FsdpConfig`], [`MixedPrecision`], [`unshard`] (explicit
//!   prefetch), [`fsdp_units`], [`set_fsdp_timeline`]: the user's side; see [`mod@unit`] for
//!   roots, prefetch and overlap.
//! * [`FsdpParamGroup`]: one unit's parameters, gathered with one all-gather and
//!   reduced with one reduce-scatter per dtype, through flat per-unit buffers, with the
//!   unit's record in an [`FsdpTimeline`].
//! * [`FsdpParam`]: one parameter's dp shard (the leaf the optimizer updates) and its
//!   unsharded tensor. The module holds the parameter as a plain
//!   [`tpar_nn::Param::DTensor`] (`Shard(0)` on dp, after its tensor-parallel
//!   placements), whose shard links to this state ([`tpar_nn::Unshard`]); [`fsdp_param`]
//!   finds it.
//!
//! ```
//! use tpar_collectives::spawn;
//! use tpar_fsdp::{fully_shard, FsdpConfig};
//! use tpar_mesh::{DeviceMesh, DeviceType};
//! use tpar_nn::{parameters, reset_parameters, Linear, NnError};
//! use tpar_tensor::{DType, Device};
//! let numels = spawn(2, |ctx| -> Result<usize, NnError> {
//!     let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2], &["dp"])?;
//!     let mut lin = Linear::new(4, 5, false, DType::F32, Device::Meta)?;
//!     fully_shard(&mut lin, &mesh, &FsdpConfig::default())?;
//!     reset_parameters(&mut lin, Device::Cpu, 0)?;
//!     // Each rank holds its chunk of the 5 rows: 3 and 2.
//!     Ok(parameters(&lin)[0].trainable().numel())
//! })?;
//! assert_eq!(numels, vec![12, 8]);
//! # Ok::<(), NnError>(())
//! ```
#![warn(missing_docs)]

pub mod group;
pub mod param;
pub mod unit;

pub use group::{FsdpParamGroup, FsdpTimeline, TimelineEvent, TimelineKind};
pub use param::FsdpParam;
pub use unit::{
    fsdp_param, fsdp_units, fully_shard, set_fsdp_timeline, unshard, FsdpConfig, MixedPrecision,
};
