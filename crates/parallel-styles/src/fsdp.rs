//! FSDP (`fully_shard`) and plain data parallelism.
//!
//! `fully_shard(module, dp_mesh, config)` makes `module` one FSDP unit: every parameter
//! of its subtree not already in a child unit is sharded along dim 0 over the dp group
//! (the tensor-parallel local shard, when the parameter is a TP DTensor). Before the
//! unit's forward its parameters are all-gathered; after it they are released
//! (`reshard_after_forward`); the first gradient reaching the unit's output gathers them
//! again; each parameter's gradient is reduce-scattered (averaged over dp) into its
//! shard as soon as it is complete, and the gathered copy released. Apply it per
//! decoder layer, then to the base model, then to the root, as FSDP2.

use std::sync::Arc;

use tpar_collectives::ReduceOp;
use tpar_dtensor::DTensor;
use tpar_mesh::DeviceMesh;
use tpar_nn::fsdp_param::FsdpParam;
use tpar_nn::{visit_modules_mut, Args, ForwardHook, Module, NnError, Param, Value};
use tpar_tensor::autograd::{is_grad_enabled, record};
use tpar_tensor::{DType, Tensor};

use crate::{PlanError, Result};

/// Compute and reduction dtypes for mixed precision (e.g. bf16 compute with f32 master
/// shards and f32 gradient reductions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MixedPrecision {
    /// The dtype parameters are gathered and computed in.
    pub param_dtype: DType,
    /// The dtype gradients are reduce-scattered in.
    pub reduce_dtype: DType,
}

/// Options of [`fully_shard`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FsdpConfig {
    /// Release the gathered parameters after the unit's forward (gather again for
    /// backward). On by default, as FSDP2.
    pub reshard_after_forward: bool,
    /// Mixed precision; `None` computes in the parameters' own dtype.
    pub mixed_precision: Option<MixedPrecision>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig { reshard_after_forward: true, mixed_precision: None }
    }
}

struct FsdpHook {
    fqn: String,
    params: Vec<Arc<FsdpParam>>,
    reshard_after_forward: bool,
}

impl FsdpHook {
    fn unshard(&self) -> tpar_nn::Result<()> {
        for p in &self.params {
            p.unshard_async()?;
        }
        for p in &self.params {
            p.unshard()?;
        }
        Ok(())
    }

    /// An identity on `t` whose backward gathers the unit's parameters first.
    fn pre_backward(&self, t: &Tensor) -> Tensor {
        let params = self.params.clone();
        record("fsdp_pre_backward", &[t], t.detach(), move |g| {
            for p in &params {
                p.unshard_async().map_err(to_tensor_error)?;
            }
            for p in &params {
                p.unshard().map_err(to_tensor_error)?;
            }
            Ok(vec![Some(g.clone())])
        })
    }
}

fn to_tensor_error(e: NnError) -> tpar_tensor::TensorError {
    match e {
        NnError::Tensor(t) => t,
        other => tpar_tensor::TensorError::External(Arc::new(other)),
    }
}

impl ForwardHook for FsdpHook {
    fn pre(&self, args: Args) -> tpar_nn::Result<Args> {
        self.unshard()?;
        Ok(args)
    }

    fn post(&self, out: Value) -> tpar_nn::Result<Value> {
        if self.reshard_after_forward {
            for p in &self.params {
                p.reshard();
            }
        }
        if !is_grad_enabled() {
            return Ok(out);
        }
        Ok(match out {
            Value::Tensor(t) if t.requires_grad() => Value::Tensor(self.pre_backward(&t)),
            Value::DTensor(d) if d.requires_grad() => {
                let local = self.pre_backward(d.local());
                Value::DTensor(DTensor::from_local(
                    &local,
                    d.mesh(),
                    d.placements(),
                    Some(d.shape()),
                )?)
            }
            other => other,
        })
    }

    fn prefetch(&self) -> tpar_nn::Result<()> {
        for p in &self.params {
            p.unshard_async()?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "FSDP unit {:?} ({} parameters, reshard_after_forward {})",
            self.fqn,
            self.params.len(),
            self.reshard_after_forward
        )
    }
}

/// Makes `module` an FSDP unit over the 1-d `dp_mesh` (see the module docs). Parameters
/// already managed by a child unit stay with it. Works on parameters still on the meta
/// device (`reset_parameters` then materializes only the local shards) and on
/// tensor-parallel DTensor parameters (the TP shard is what gets sharded over dp).
pub fn fully_shard(
    module: &mut dyn Module,
    dp_mesh: &DeviceMesh,
    config: &FsdpConfig,
) -> Result<()> {
    if dp_mesh.ndim() != 1 {
        return Err(PlanError::BadStyle {
            style: "fully_shard".into(),
            what: format!("needs a 1-d mesh (mesh[\"dp\"]), got {dp_mesh}"),
        });
    }
    let mut params = Vec::new();
    visit_modules_mut(module, "", &mut |_, m| {
        for slot in m.param_slots() {
            let (local, tp) = match &*slot.param {
                Param::Fsdp(_) => continue,
                Param::Tensor(t) => (t.clone(), None),
                Param::DTensor(d) => (d.to_local(), Some(d.spec().clone())),
            };
            let (pd, rd) = match config.mixed_precision {
                Some(mp) => (mp.param_dtype, mp.reduce_dtype),
                None => (local.dtype(), local.dtype()),
            };
            let f = FsdpParam::new(&local, tp, dp_mesh, pd, rd)?;
            *slot.param = Param::Fsdp(f.clone());
            params.push(f);
        }
        Ok(())
    })?;
    let fqn = module.type_name().to_string();
    module.core_mut().add_hook(Arc::new(FsdpHook {
        fqn,
        params,
        reshard_after_forward: config.reshard_after_forward,
    }));
    Ok(())
}

/// Starts gathering `module`'s own FSDP parameters ahead of its forward (as FSDP2's
/// `module.unshard()`); the forward waits for them.
pub fn unshard(module: &dyn Module) -> Result<()> {
    for h in module.core().hooks() {
        h.prefetch()?;
    }
    Ok(())
}

/// Plain replicated data parallelism (DDP): every rank holds every parameter; after
/// backward, [`DataParallel::sync_gradients`] averages the gradients over dp with one
/// all_reduce of a flat bucket per dtype.
#[derive(Clone, Debug)]
pub struct DataParallel {
    dp: tpar_collectives::ProcessGroup,
}

impl DataParallel {
    /// Data parallelism over the 1-d `dp_mesh`; broadcasts `module`'s parameters from dp
    /// rank 0 so every replica starts equal.
    pub fn new(module: &mut dyn Module, dp_mesh: &DeviceMesh) -> Result<DataParallel> {
        if dp_mesh.ndim() != 1 {
            return Err(PlanError::BadStyle {
                style: "DataParallel".into(),
                what: format!("needs a 1-d mesh, got {dp_mesh}"),
            });
        }
        let dp = dp_mesh.group(0).map_err(NnError::from)?.clone();
        for p in tpar_nn::parameters(module) {
            let t = p.trainable();
            let src = dp.broadcast(&t.detach(), 0).map_err(NnError::from)?;
            t.copy_(&src).map_err(NnError::from)?;
        }
        Ok(DataParallel { dp })
    }

    /// Averages every parameter's accumulated gradient over dp (in place).
    pub fn sync_gradients(&self, module: &dyn Module) -> Result<()> {
        let mut by_dtype: std::collections::BTreeMap<&'static str, Vec<(Tensor, Tensor)>> =
            Default::default();
        for p in tpar_nn::parameters(module) {
            let t = p.trainable();
            if let Some(g) = t.grad() {
                by_dtype.entry(g.dtype().name()).or_default().push((t, g));
            }
        }
        for (_, items) in by_dtype {
            let flat: Vec<Tensor> = items
                .iter()
                .map(|(_, g)| g.detach().reshape([g.numel()]))
                .collect::<tpar_tensor::Result<_>>()
                .map_err(NnError::from)?;
            let bucket = Tensor::cat(&flat, 0).map_err(NnError::from)?;
            let avg = self.dp.all_reduce(&bucket, ReduceOp::Avg).map_err(NnError::from)?;
            let sizes: Vec<usize> = items.iter().map(|(_, g)| g.numel()).collect();
            for ((t, g), piece) in
                items.iter().zip(avg.split_sizes(&sizes, 0).map_err(NnError::from)?)
            {
                t.set_grad(Some(piece.reshape(g.shape().clone()).map_err(NnError::from)?));
            }
        }
        Ok(())
    }
}
