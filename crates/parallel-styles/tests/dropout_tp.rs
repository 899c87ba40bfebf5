//! Dropout under tensor and sequence parallelism, with and without activation
//! checkpointing: an MLP block with a dropout on the column-parallel hidden shards, one on
//! a residual sum and one on the block's output gives, on tp 2 and 3 ranks, the unsharded
//! block's output and gradients (f64), because every rank draws its shard's part of the
//! full tensors' masks from one generator state.

use std::time::Duration;

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_dtensor::{distribute_tensor, DTensor, Placement};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_nn::{
    call, checkpoint_wrapper, module_boilerplate, named_parameters, reset_parameters, Args,
    Dropout, Linear, Module, ModuleCore, NnError, Value,
};
use tpar_parallel_styles::{
    loss_parallel, parallelize_module, ColwiseParallel, ParallelizePlan, RowwiseParallel,
};
use tpar_tensor::{manual_seed, tol::Tol, DType, Device, Rng, Tensor};
use tpar_testing::plan_err;

use Placement::{Replicate, Shard};

const SEED: u64 = 5;
const DROP_SEED: u64 = 77;
const BATCH: usize = 2;
const SEQ: usize = 7;
const DIM: usize = 6;
const HIDDEN: usize = 10;

/// `out_drop(x + down(drop(silu(up(x))))) `, then a dropout of the residual sum.
struct Block {
    core: ModuleCore,
    up: Linear,
    drop: Dropout,
    down: Linear,
    out_drop: Dropout,
}

impl Block {
    fn new() -> tpar_nn::Result<Block> {
        Ok(Block {
            core: ModuleCore::default(),
            up: Linear::new(DIM, HIDDEN, false, DType::F64, Device::Meta)?,
            drop: Dropout::new(0.3)?,
            down: Linear::new(HIDDEN, DIM, false, DType::F64, Device::Meta)?,
            out_drop: Dropout::new(0.2)?,
        })
    }
}

impl Module for Block {
    fn type_name(&self) -> &'static str {
        "Block"
    }

    fn forward(&self, args: Args) -> tpar_nn::Result<Value> {
        let x = args.get(0);
        let h = call(&self.up, Args::one(x.clone()))?.silu()?;
        let h = call(&self.drop, Args::one(h))?;
        let y = call(&self.down, Args::one(h))?;
        call(&self.out_drop, Args::one(x.add(&y)?))
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("up".into(), &self.up as &dyn Module),
            ("drop".into(), &self.drop),
            ("down".into(), &self.down),
            ("out_drop".into(), &self.out_drop),
        ]
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("up".into(), &mut self.up as &mut dyn Module),
            ("drop".into(), &mut self.drop),
            ("down".into(), &mut self.down),
            ("out_drop".into(), &mut self.out_drop),
        ]
    }

    module_boilerplate!();
}

fn build(ac: bool) -> tpar_nn::Result<Box<dyn Module>> {
    Ok(if ac { Box::new(checkpoint_wrapper(Block::new()?)) } else { Box::new(Block::new()?) })
}

fn data() -> (Tensor, Tensor) {
    let mut rng = Rng::new(3);
    let x = Tensor::randn([BATCH, SEQ, DIM], DType::F64, &mut rng).unwrap();
    let w = Tensor::randn([BATCH, SEQ, DIM], DType::F64, &mut rng).unwrap();
    (x, w)
}

type Outcome = (Vec<f64>, Vec<(String, Vec<f64>)>);

/// The unsharded block: output, then the gradients of `sum(out * w)` and of a dropout
/// after the backward (which shows the generator's state).
fn reference() -> tpar_nn::Result<Outcome> {
    let mut m = build(false)?;
    reset_parameters(m.as_mut(), Device::Cpu, SEED)?;
    let (x, w) = data();
    manual_seed(DROP_SEED);
    let out = call(m.as_ref(), Args::one(x.clone()))?.into_tensor("out")?;
    out.mul(&w)?.sum_all()?.backward()?;
    let mut grads = Vec::new();
    for (n, p) in named_parameters(m.as_ref()) {
        grads.push((n, p.local().grad().expect("a gradient").to_vec_f64()?));
    }
    grads.push(("next draw".into(), x.dropout(0.5, true)?.to_vec_f64()?));
    Ok((out.to_vec_f64()?, grads))
}

/// The block on `tp` ranks: with `sequence`, the input and output are sequence shards
/// (the rowwise product reduce-scatters onto the sequence), else replicated.
fn sharded(tp: usize, sequence: bool, ac: bool) -> tpar_nn::Result<Vec<Outcome>> {
    spawn_scoped(SpawnConfig::new(tp).timeout(Duration::from_secs(30)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[tp], &["tp"])?;
        let mut m = build(ac)?;
        let plan = if sequence {
            ParallelizePlan::new()
                .add("up", ColwiseParallel::new().input_layouts(Shard(1)))
                .add("down", RowwiseParallel::new().output_layouts(Shard(1)))
        } else {
            ParallelizePlan::new()
                .add("up", ColwiseParallel::new())
                .add("down", RowwiseParallel::new())
        };
        parallelize_module(m.as_mut(), &mesh, &plan).map_err(plan_err)?;
        reset_parameters(m.as_mut(), Device::Cpu, SEED)?;
        let (x, w) = data();
        let layout = if sequence { Shard(1) } else { Replicate };
        // the input as the previous layer would hand it on: a known shard
        let x_local =
            tpar_dtensor::local_layout::remember(&distribute_tensor(&x, &mesh, &[layout])?);
        manual_seed(DROP_SEED);
        let out = call(m.as_ref(), Args::one(x_local))?.into_tensor("out")?;
        let full =
            DTensor::from_local(&out, &mesh, &[layout], Some(&[BATCH, SEQ, DIM]))?.full_tensor()?;
        let loss = full.mul(&w)?.sum_all()?;
        loss_parallel::backward(&Value::Tensor(loss), &mesh)?;
        let mut grads = Vec::new();
        for (n, p) in named_parameters(m.as_ref()) {
            let g = p.grad()?.ok_or_else(|| NnError::Config { what: format!("{n}: no grad") })?;
            grads.push((n, g.full()?.to_vec_f64()?));
        }
        grads.push(("next draw".into(), x.dropout(0.5, true)?.to_vec_f64()?));
        Ok::<_, NnError>((full.to_vec_f64()?, grads))
    })
}

#[test]
fn dropout_under_tensor_and_sequence_parallelism_equals_the_unsharded_block() {
    let (want, want_grads) = reference().unwrap();
    let tol = Tol::for_dtype(DType::F64).scaled(10.0);
    for (tp, sequence, ac) in
        [(2, false, false), (2, true, false), (3, true, false), (2, false, true), (3, true, true)]
    {
        let ctx = format!("tp {tp}, sequence parallel {sequence}, checkpointed {ac}");
        for (rank, (out, grads)) in sharded(tp, sequence, ac).unwrap().into_iter().enumerate() {
            tol.check(&format!("{ctx}, rank {rank}: output"), &out, &want).unwrap();
            assert_eq!(grads.len(), want_grads.len());
            for ((n, g), (wn, wg)) in grads.iter().zip(&want_grads) {
                assert_eq!(n, wn);
                tol.check(&format!("{ctx}, rank {rank}: {n}"), g, wg).unwrap();
            }
        }
    }
}
