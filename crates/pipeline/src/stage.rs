//! `PipelineStage`: one stage's module and its place in the pipeline.

use tpar_collectives::ProcessGroup;
use tpar_mesh::DeviceMesh;
use tpar_nn::{Module, Param};
use tpar_tensor::Device;

use crate::{PipelineError, Result};

/// One stage of a pipeline on this rank, as `torch.distributed.pipelining.PipelineStage`:
/// the stage's module (build it on `Device::Meta` with only its own layers, apply plans
/// and FSDP, then `reset_parameters`), its index, the number of stages, and the `pp`
/// mesh axis it exchanges activations and gradients over.
///
/// Stages are placed round-robin over the `pp` ranks: stage `s` runs on `pp` rank
/// `s % pp`, so a rank holds stages `r, r + pp, ...` (one stage per rank for GPipe,
/// 1F1B and zero-bubble; several for interleaved 1F1B).
pub struct PipelineStage {
    module: Box<dyn Module>,
    stage_index: usize,
    num_stages: usize,
    group: ProcessGroup,
    device: Device,
}

impl std::fmt::Debug for PipelineStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineStage")
            .field("module", &self.module.type_name())
            .field("stage_index", &self.stage_index)
            .field("num_stages", &self.num_stages)
            .field("pp_rank", &self.group.rank())
            .field("device", &self.device)
            .finish()
    }
}

impl PipelineStage {
    /// Stage `stage_index` of `num_stages`, running `module` on `device`, over the 1-d
    /// `pp_mesh` (`mesh["pp"]`). `num_stages` must be a multiple of the `pp` size and
    /// this rank must be the stage's round-robin owner (`stage_index % pp`).
    pub fn new(
        module: impl Module,
        stage_index: usize,
        num_stages: usize,
        pp_mesh: &DeviceMesh,
        device: Device,
    ) -> Result<PipelineStage> {
        Self::boxed(Box::new(module), stage_index, num_stages, pp_mesh, device)
    }

    /// [`new`](Self::new) for a module already boxed.
    pub fn boxed(
        module: Box<dyn Module>,
        stage_index: usize,
        num_stages: usize,
        pp_mesh: &DeviceMesh,
        device: Device,
    ) -> Result<PipelineStage> {
        let bad = |what: String| PipelineError::Stage { stage: stage_index, what };
        if pp_mesh.ndim() != 1 {
            return Err(bad(format!("needs a 1-d pp mesh (mesh[\"pp\"]), got {pp_mesh}")));
        }
        let group = pp_mesh.group(0)?.clone();
        let pp = group.size();
        if num_stages == 0 || !num_stages.is_multiple_of(pp) {
            return Err(bad(format!(
                "{num_stages} stages cannot be placed round-robin on {pp} pp ranks (a multiple of {pp} is needed)"
            )));
        }
        if stage_index >= num_stages {
            return Err(bad(format!("stage index out of range for {num_stages} stages")));
        }
        if stage_index % pp != group.rank() {
            return Err(bad(format!(
                "belongs to pp rank {} (stage % pp), but this is pp rank {}",
                stage_index % pp,
                group.rank()
            )));
        }
        Ok(PipelineStage { module, stage_index, num_stages, group, device })
    }

    /// The stage's module.
    pub fn module(&self) -> &dyn Module {
        &*self.module
    }

    /// The stage's module, mutably (to load a state dict, for instance).
    pub fn module_mut(&mut self) -> &mut dyn Module {
        &mut *self.module
    }

    /// The stage's module as its concrete type (`stage.module_as::<LlamaStage>()`).
    pub fn module_as<M: Module>(&self) -> Option<&M> {
        self.module.as_any().downcast_ref::<M>()
    }

    /// The stage's index in the pipeline.
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// How many stages the pipeline has.
    pub fn num_stages(&self) -> usize {
        self.num_stages
    }

    /// Whether this is stage 0 (it takes the batch's inputs).
    pub fn is_first(&self) -> bool {
        self.stage_index == 0
    }

    /// Whether this is the last stage (it computes the loss).
    pub fn is_last(&self) -> bool {
        self.stage_index + 1 == self.num_stages
    }

    /// The device the stage computes on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The `pp` group activations and gradients travel over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The stage's parameters (what its optimizer updates).
    pub fn parameters(&self) -> Vec<Param> {
        tpar_nn::parameters(&*self.module)
    }
}
