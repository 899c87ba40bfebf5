//! Layers: Linear, Embedding, RMSNorm, and an ordered list of modules.

use tpar_dtensor::CpLayout;
use tpar_tensor::{DType, Device};

use crate::module::{call, Init, ModuleCore, ParamSlot};
use crate::{Args, Module, Param, Result, Value};

/// The four accessors every [`Module`] implementation writes the same way, for a struct
/// with a `core: ModuleCore` field: `core`, `core_mut`, `as_any`, `as_any_mut`. Use it
/// inside `impl Module for YourType { .. }`.
#[macro_export]
macro_rules! module_boilerplate {
    () => {
        fn core(&self) -> &$crate::ModuleCore {
            &self.core
        }
        fn core_mut(&mut self) -> &mut $crate::ModuleCore {
            &mut self.core
        }
        fn as_any(&self) -> &dyn ::std::any::Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn ::std::any::Any {
            self
        }
    };
}

/// `y = x W^T + b` with `W` of shape `[out_features, in_features]`, as `torch.nn.Linear`.
pub struct Linear {
    core: ModuleCore,
    /// `[out_features, in_features]`.
    pub weight: Param,
    /// `[out_features]`, if any.
    pub bias: Option<Param>,
    in_features: usize,
}

impl Linear {
    /// A linear layer on `device` (`Device::Meta` to initialise later with `reset_parameters`).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
        device: Device,
    ) -> Result<Linear> {
        Ok(Linear {
            core: ModuleCore::default(),
            weight: Param::new([out_features, in_features], dtype, device)?,
            bias: if bias { Some(Param::new([out_features], dtype, device)?) } else { None },
            in_features,
        })
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features (global).
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl Module for Linear {
    fn type_name(&self) -> &'static str {
        "Linear"
    }

    fn forward(&self, args: Args) -> Result<Value> {
        let w = self.weight.compute()?;
        let b = self.bias.as_ref().map(Param::compute).transpose()?;
        if crate::output_unread() {
            // a recompute that needs only this product's node, not its values
            return tpar_tensor::checkpoint::unread_output(|| args.get(0).linear(&w, b.as_ref()));
        }
        args.get(0).linear(&w, b.as_ref())
    }

    fn params(&self) -> Vec<(&'static str, &Param)> {
        let mut v = vec![("weight", &self.weight)];
        if let Some(b) = &self.bias {
            v.push(("bias", b));
        }
        v
    }

    fn param_slots(&mut self) -> Vec<ParamSlot<'_>> {
        let bound = 1.0 / (self.in_features.max(1) as f64).sqrt();
        let mut v = vec![ParamSlot {
            name: "weight",
            param: &mut self.weight,
            init: Init::Uniform { bound },
        }];
        if let Some(b) = &mut self.bias {
            v.push(ParamSlot { name: "bias", param: b, init: Init::Uniform { bound } });
        }
        v
    }

    module_boilerplate!();
}

/// A lookup table `[num_embeddings, embedding_dim]`, as `torch.nn.Embedding`.
pub struct Embedding {
    core: ModuleCore,
    /// `[num_embeddings, embedding_dim]`.
    pub weight: Param,
}

impl Embedding {
    /// An embedding table on `device`.
    pub fn new(
        num_embeddings: usize,
        embedding_dim: usize,
        dtype: DType,
        device: Device,
    ) -> Result<Embedding> {
        Ok(Embedding {
            core: ModuleCore::default(),
            weight: Param::new([num_embeddings, embedding_dim], dtype, device)?,
        })
    }
}

impl Module for Embedding {
    fn type_name(&self) -> &'static str {
        "Embedding"
    }

    fn forward(&self, args: Args) -> Result<Value> {
        args.get(0).embedding(&self.weight.compute()?)
    }

    fn params(&self) -> Vec<(&'static str, &Param)> {
        vec![("weight", &self.weight)]
    }

    fn param_slots(&mut self) -> Vec<ParamSlot<'_>> {
        vec![ParamSlot { name: "weight", param: &mut self.weight, init: Init::Normal { std: 1.0 } }]
    }

    module_boilerplate!();
}

/// Root-mean-square normalisation over the last dim with a learned scale, as
/// `torch.nn.RMSNorm`.
pub struct RmsNorm {
    core: ModuleCore,
    /// `[dim]`.
    pub weight: Param,
    /// Added to the mean square.
    pub eps: f64,
}

impl RmsNorm {
    /// An RMSNorm over `dim` features.
    pub fn new(dim: usize, eps: f64, dtype: DType, device: Device) -> Result<RmsNorm> {
        Ok(RmsNorm { core: ModuleCore::default(), weight: Param::new([dim], dtype, device)?, eps })
    }
}

impl Module for RmsNorm {
    fn type_name(&self) -> &'static str {
        "RMSNorm"
    }

    fn forward(&self, args: Args) -> Result<Value> {
        args.get(0).rms_norm(&self.weight.compute()?, self.eps)
    }

    fn params(&self) -> Vec<(&'static str, &Param)> {
        vec![("weight", &self.weight)]
    }

    fn param_slots(&mut self) -> Vec<ParamSlot<'_>> {
        vec![ParamSlot { name: "weight", param: &mut self.weight, init: Init::Constant(1.0) }]
    }

    module_boilerplate!();
}

/// Dropout as `torch.nn.Dropout(p)`: in training mode (the default;
/// [`crate::set_training`]) each element of its input is zeroed with probability `p` and
/// the others scaled by `1 / (1 - p)`; in eval mode its input passes unchanged. The mask
/// comes from the rank thread's default generator ([`tpar_tensor::manual_seed`]); a
/// DTensor input is masked as its full tensor would be ([`tpar_dtensor::DTensor::dropout`]),
/// and so is a plain tensor known as a DTensor's shard (a parallel style's local output:
/// [`crate::Value::dropout`]); a checkpointed region recomputes the same mask. Any other
/// plain tensor is masked by its own positions, so plain shards of other kinds (a
/// data-parallel rank's batch, a context-parallel rank's chunks) draw alike on every rank
/// that runs from the same state. A context-parallel rank's chunks draw the unsharded
/// sequence's mask through [`Dropout::context_parallel`] (or
/// [`tpar_dtensor::ContextParallel::dropout`] on a plain tensor).
pub struct Dropout {
    core: ModuleCore,
    /// The probability of zeroing an element.
    pub p: f64,
    /// Under context parallelism: the layout, this rank and the sequence dim of the rows
    /// it takes.
    cp: Option<(CpLayout, usize, usize)>,
}

impl Dropout {
    /// A dropout of probability `p`.
    ///
    /// # Errors
    /// [`crate::NnError::Config`] for `p` outside `[0, 1]`.
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(crate::NnError::Config {
                what: format!("dropout probability has to be between 0 and 1, but got {p}"),
            });
        }
        Ok(Dropout { core: ModuleCore::default(), p, cp: None })
    }

    /// The same dropout on context-parallel rank `rank`'s rows of `layout` along
    /// `seq_dim` ([`CpLayout::shard`]): each element keeps or drops as the unsharded
    /// sequence's element at its position would ([`CpLayout::dropout`]), when every cp
    /// rank runs from the same generator state. Its input must then be a plain tensor of
    /// the rank's rows; anything else is an error naming it.
    pub fn context_parallel(mut self, layout: CpLayout, rank: usize, seq_dim: usize) -> Dropout {
        self.cp = Some((layout, rank, seq_dim));
        self
    }
}

impl Module for Dropout {
    fn type_name(&self) -> &'static str {
        "Dropout"
    }

    fn forward(&self, args: Args) -> Result<Value> {
        let (x, training) = (args.get(0), self.core.training());
        match (&self.cp, &x) {
            (None, x) => x.dropout(self.p, training),
            (Some((layout, rank, dim)), Value::Tensor(t)) => {
                Ok(Value::Tensor(layout.dropout(t, *dim, *rank, self.p, training)?))
            }
            (Some(_), other) => Err(crate::NnError::BadInput {
                module: "Dropout".into(),
                what: format!(
                    "a context-parallel dropout takes a plain tensor of its rank's rows, not \
                     {other:?}"
                ),
            }),
        }
    }

    module_boilerplate!();
}

/// An ordered list of modules named `0`, `1`, ... (as `torch.nn.ModuleList`).
pub struct ModuleList<M: Module> {
    core: ModuleCore,
    /// The modules.
    pub items: Vec<M>,
    first: usize,
}

impl<M: Module> ModuleList<M> {
    /// A list of modules, named `0`, `1`, ...
    pub fn new(items: Vec<M>) -> Self {
        Self::starting_at(0, items)
    }

    /// A list of modules named `first`, `first + 1`, ...: a slice of a longer list that
    /// keeps the longer list's names (a pipeline stage's share of the decoder layers is
    /// `layers.4` to `layers.7`, so plans and checkpoints keyed by FQN still match).
    pub fn starting_at(first: usize, items: Vec<M>) -> Self {
        ModuleList { core: ModuleCore::default(), items, first }
    }

    /// The name (index) of the first module.
    pub fn first_index(&self) -> usize {
        self.first
    }
}

impl<M: Module> Module for ModuleList<M> {
    fn type_name(&self) -> &'static str {
        "ModuleList"
    }

    /// Runs the modules in sequence, each getting the previous output as its first input
    /// and the other inputs unchanged.
    fn forward(&self, mut args: Args) -> Result<Value> {
        for m in &self.items {
            let out = call(m, args.clone())?;
            if args.pos.is_empty() {
                args.pos.push(out);
            } else {
                args.pos[0] = out;
            }
        }
        Ok(args.get(0))
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        let first = self.first;
        self.items
            .iter()
            .enumerate()
            .map(|(i, m)| ((first + i).to_string(), m as &dyn Module))
            .collect()
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let first = self.first;
        self.items
            .iter_mut()
            .enumerate()
            .map(|(i, m)| ((first + i).to_string(), m as &mut dyn Module))
            .collect()
    }

    module_boilerplate!();
}
