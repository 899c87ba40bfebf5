//! Each parallel style alone on one module equals the unsharded module: the forward
//! output (gathered to full when sharded) and every parameter's gradient (read with
//! `Param::grad` and gathered to full), for tp 1..=4 and random shapes with uneven
//! features and sequences (empty shards included), in f64.
//!
//! Every case builds the module on `Device::Meta`, parallelizes it, then materializes
//! it with `reset_parameters`, so the sharded and unsharded modules hold the same
//! values (initialisation depends only on the seed and the FQN).

use std::time::Duration;

use proptest::prelude::*;
use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_dtensor::{distribute_tensor, DTensor, Placement};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_nn::{
    call, named_parameters, reset_parameters, Args, Embedding, Linear, Module, NnError, RmsNorm,
    Value,
};
use tpar_parallel_styles::{
    loss_parallel, parallelize_module, ColwiseParallel, ParallelizePlan, PrepareModuleInput,
    PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
};
use tpar_tensor::{tol::Tol, DType, Device, Rng, Tensor};

use Placement::{Replicate, Shard};

const SEED: u64 = 11;

/// Random sizes of one case.
#[derive(Clone, Copy, Debug)]
struct Case {
    tp: usize,
    batch: usize,
    seq: usize,
    fin: usize,
    fout: usize,
    bias: bool,
    data_seed: u64,
}

fn cases() -> impl Strategy<Value = Case> {
    (1usize..=4, 1usize..=2, 1usize..=7, 1usize..=9, 1usize..=9, any::<bool>(), any::<u64>())
        .prop_map(|(tp, batch, seq, fin, fout, bias, data_seed)| Case {
            tp,
            batch,
            seq,
            fin,
            fout,
            bias,
            data_seed,
        })
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Linear,
    Embedding,
    Norm,
}

/// One style on one module: what the module gets and how its output is laid out.
struct Setup {
    kind: Kind,
    plan: ParallelizePlan,
    /// How each rank's plain input is cut from the full input.
    input: Placement,
    /// Whether the output is a DTensor (else a plain local tensor laid out as `output`).
    dtensor_out: bool,
    /// The layout of a plain output.
    output: Placement,
    /// Expected placements per parameter name.
    placements: Vec<(&'static str, Placement)>,
}

use tpar_testing::plan_err;

fn build(kind: Kind, c: &Case) -> tpar_nn::Result<Box<dyn Module>> {
    Ok(match kind {
        Kind::Linear => Box::new(Linear::new(c.fin, c.fout, c.bias, DType::F64, Device::Meta)?),
        // vocab fout, embedding dim fin
        Kind::Embedding => Box::new(Embedding::new(c.fout, c.fin, DType::F64, Device::Meta)?),
        Kind::Norm => Box::new(RmsNorm::new(c.fin, 1e-6, DType::F64, Device::Meta)?),
    })
}

/// The full input (the same on every rank) and the loss weights for an output of `out`.
fn input(kind: Kind, c: &Case) -> tpar_nn::Result<Tensor> {
    let mut rng = Rng::new(c.data_seed);
    Ok(match kind {
        Kind::Embedding => {
            let ids = (0..c.batch * c.seq).map(|_| rng.below(c.fout as u64) as i64).collect();
            Tensor::from_vec::<i64>(ids, [c.batch, c.seq])?
        }
        _ => Tensor::randn([c.batch, c.seq, c.fin], DType::F64, &mut rng)?,
    })
}

fn loss_weights(dims: &[usize], c: &Case) -> tpar_nn::Result<Tensor> {
    let mut rng = Rng::new(c.data_seed ^ 0x5eed);
    Ok(Tensor::randn(dims.to_vec(), DType::F64, &mut rng)?)
}

type Outcome = (Vec<f64>, Vec<(String, Vec<f64>)>);

/// The unsharded module: output and gradients of `sum(out * w)`.
fn reference(kind: Kind, c: &Case) -> tpar_nn::Result<Outcome> {
    let mut m = build(kind, c)?;
    reset_parameters(m.as_mut(), Device::Cpu, SEED)?;
    let out = call(m.as_ref(), Args::one(input(kind, c)?))?.into_tensor("reference")?;
    out.mul(&loss_weights(out.dims(), c)?)?.sum_all()?.backward()?;
    let grads = named_parameters(m.as_ref())
        .into_iter()
        .map(|(n, p)| {
            let g = p
                .local()
                .grad()
                .ok_or_else(|| NnError::Config { what: format!("{n}: no grad") })?;
            Ok((n, g.to_vec_f64()?))
        })
        .collect::<tpar_nn::Result<_>>()?;
    Ok((out.to_vec_f64()?, grads))
}

/// The module under `setup` on `c.tp` ranks: every rank's output (full) and gradients.
fn sharded(setup: &Setup, c: &Case) -> tpar_nn::Result<Vec<Outcome>> {
    spawn_scoped(SpawnConfig::new(c.tp).timeout(Duration::from_secs(30)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[c.tp], &["tp"])?;
        let mut m = build(setup.kind, c)?;
        parallelize_module(m.as_mut(), &mesh, &setup.plan).map_err(plan_err)?;
        reset_parameters(m.as_mut(), Device::Cpu, SEED)?;
        for (name, p) in named_parameters(m.as_ref()) {
            let want = setup.placements.iter().find(|(n, _)| *n == name).map(|(_, p)| *p);
            let got = p.dtensor().map(|d| d.placements()[0]);
            if got != want {
                return Err(NnError::Config {
                    what: format!("{name}: placement {got:?}, expected {want:?}"),
                });
            }
        }
        let full_in = input(setup.kind, c)?;
        let x = match setup.input {
            Replicate => full_in,
            p => distribute_tensor(&full_in, &mesh, &[p])?.to_local(),
        };
        let out = call(m.as_ref(), Args::one(x))?;
        let full = match out {
            Value::DTensor(d) if setup.dtensor_out => d.full_tensor()?,
            Value::Tensor(t) if !setup.dtensor_out => {
                let mut global = t.dims().to_vec();
                if let Shard(d) = setup.output {
                    let d = if d < 0 { d + global.len() as isize } else { d } as usize;
                    global[d] = match setup.kind {
                        Kind::Linear if d == 2 => c.fout,
                        _ if d == 2 => c.fin,
                        _ => c.seq,
                    };
                }
                DTensor::from_local(&t, &mesh, &[setup.output], Some(&global))?.full_tensor()?
            }
            other => return Err(NnError::Config { what: format!("unexpected output {other:?}") }),
        };
        let loss = full.mul(&loss_weights(full.dims(), c)?)?.sum_all()?;
        loss_parallel::backward(&Value::Tensor(loss), &mesh)?;
        let mut grads = Vec::new();
        for (n, p) in named_parameters(m.as_ref()) {
            let g = p.grad()?.ok_or_else(|| NnError::Config { what: format!("{n}: no grad") })?;
            grads.push((n, g.full()?.to_vec_f64()?));
        }
        Ok((full.to_vec_f64()?, grads))
    })
}

fn check(name: &str, setup: Setup, c: Case) -> Result<(), TestCaseError> {
    let tol = Tol::for_dtype(DType::F64).scaled(10.0);
    let what = format!("{name} {c:?}");
    let (want_out, want_grads) =
        reference(setup.kind, &c).map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    let ranks = sharded(&setup, &c).map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    for (rank, (out, grads)) in ranks.iter().enumerate() {
        tol.check(&format!("{what} rank {rank} output"), out, &want_out)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(grads.len(), want_grads.len());
        for ((n, g), (wn, wg)) in grads.iter().zip(&want_grads) {
            prop_assert_eq!(n, wn);
            tol.check(&format!("{what} rank {rank} grad {n}"), g, wg)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
    }
    Ok(())
}

fn linear_params(col: bool, bias: bool) -> Vec<(&'static str, Placement)> {
    let mut v = vec![("weight", if col { Shard(0) } else { Shard(1) })];
    if bias {
        v.push(("bias", if col { Shard(0) } else { Replicate }));
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// ColwiseParallel defaults: replicated input, output features sharded, local output.
    #[test]
    fn colwise_linear(c in cases()) {
        check("colwise", Setup {
            kind: Kind::Linear,
            plan: ParallelizePlan::new().add("", ColwiseParallel::new()),
            input: Replicate,
            dtensor_out: false,
            output: Shard(-1),
            placements: linear_params(true, c.bias),
        }, c)?;
    }

    /// ColwiseParallel gathering its output back: `output_layouts = Replicate`,
    /// `use_local_output = false` (the caller gets a DTensor).
    #[test]
    fn colwise_linear_replicated_dtensor_output(c in cases()) {
        check("colwise R dtensor", Setup {
            kind: Kind::Linear,
            plan: ParallelizePlan::new().add(
                "",
                ColwiseParallel::new().output_layouts(Replicate).use_local_output(false),
            ),
            input: Replicate,
            dtensor_out: true,
            output: Replicate,
            placements: linear_params(true, c.bias),
        }, c)?;
    }

    /// RowwiseParallel defaults: input features sharded, output all-reduced.
    #[test]
    fn rowwise_linear(c in cases()) {
        check("rowwise", Setup {
            kind: Kind::Linear,
            plan: ParallelizePlan::new().add("", RowwiseParallel::new()),
            input: Shard(-1),
            dtensor_out: false,
            output: Replicate,
            placements: linear_params(false, c.bias),
        }, c)?;
    }

    /// RowwiseParallel reduce-scattering onto the sequence: `output_layouts = Shard(1)`.
    #[test]
    fn rowwise_linear_sequence_output(c in cases()) {
        check("rowwise S(1)", Setup {
            kind: Kind::Linear,
            plan: ParallelizePlan::new().add("", RowwiseParallel::new().output_layouts(Shard(1))),
            input: Shard(-1),
            dtensor_out: false,
            output: Shard(1),
            placements: linear_params(false, c.bias),
        }, c)?;
    }

    /// Embedding: ColwiseParallel shards the embedding dim, RowwiseParallel the vocab
    /// (a masked lookup reduced to `Replicate`, or scattered onto the sequence).
    #[test]
    fn embedding_colwise_and_rowwise(c in cases()) {
        check("embedding colwise", Setup {
            kind: Kind::Embedding,
            plan: ParallelizePlan::new().add("", ColwiseParallel::new()),
            input: Replicate,
            dtensor_out: false,
            output: Shard(-1),
            placements: vec![("weight", Shard(1))],
        }, c)?;
        check("embedding rowwise", Setup {
            kind: Kind::Embedding,
            plan: ParallelizePlan::new().add("", RowwiseParallel::new().input_layouts(Replicate)),
            input: Replicate,
            dtensor_out: false,
            output: Replicate,
            placements: vec![("weight", Shard(0))],
        }, c)?;
        check("embedding rowwise S(1)", Setup {
            kind: Kind::Embedding,
            plan: ParallelizePlan::new().add(
                "",
                RowwiseParallel::new().input_layouts(Replicate).output_layouts(Shard(1)),
            ),
            input: Replicate,
            dtensor_out: false,
            output: Shard(1),
            placements: vec![("weight", Shard(0))],
        }, c)?;
    }

    /// SequenceParallel on an RMSNorm: sequence-sharded input and DTensor output, the
    /// weight replicated (its gradient reduced when read); also with a local output.
    #[test]
    fn sequence_parallel_norm(c in cases()) {
        check("sequence parallel", Setup {
            kind: Kind::Norm,
            plan: ParallelizePlan::new().add("", SequenceParallel::new()),
            input: Shard(1),
            dtensor_out: true,
            output: Shard(1),
            placements: vec![("weight", Replicate)],
        }, c)?;
        check("sequence parallel local", Setup {
            kind: Kind::Norm,
            plan: ParallelizePlan::new().add("", SequenceParallel::new().use_local_output(true)),
            input: Shard(1),
            dtensor_out: false,
            output: Shard(1),
            placements: vec![("weight", Replicate)],
        }, c)?;
    }

    /// PrepareModuleInput gathers a sequence-sharded input for a replicated Linear;
    /// PrepareModuleOutput scatters a replicated Linear's output onto the sequence;
    /// PrepareModuleInputOutput does both around an RMSNorm.
    #[test]
    fn prepare_module_input_output(c in cases()) {
        check("prepare input", Setup {
            kind: Kind::Linear,
            plan: ParallelizePlan::new()
                .add("", PrepareModuleInput::new(vec![Some(Shard(1))], vec![Some(Replicate)])),
            input: Shard(1),
            dtensor_out: true,
            output: Replicate,
            placements: linear_params(false, c.bias)
                .into_iter()
                .map(|(n, _)| (n, Replicate))
                .collect(),
        }, c)?;
        check("prepare output", Setup {
            kind: Kind::Linear,
            plan: ParallelizePlan::new().add("", PrepareModuleOutput::new(Replicate, Shard(1))),
            input: Replicate,
            dtensor_out: false,
            output: Shard(1),
            placements: linear_params(false, c.bias)
                .into_iter()
                .map(|(n, _)| (n, Replicate))
                .collect(),
        }, c)?;
        check("prepare input+output", Setup {
            kind: Kind::Norm,
            plan: ParallelizePlan::new().add(
                "",
                PrepareModuleInputOutput::new(
                    PrepareModuleInput::new(vec![Some(Shard(1))], vec![Some(Replicate)]),
                    PrepareModuleOutput::new(Replicate, Shard(1)).use_local_output(false),
                ),
            ),
            input: Shard(1),
            dtensor_out: true,
            output: Shard(1),
            placements: vec![("weight", Replicate)],
        }, c)?;
    }
}
