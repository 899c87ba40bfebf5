//! A model tpar does not ship, written here as a user would: a GPT-2-style decoder
//! (LayerNorm with bias, GELU MLP, learned positions, biased projections, untied head)
//! from `tpar-nn`'s layers plus two modules of its own. Parallelized with the parallel
//! styles by FQN, with TP alone and with TP x FSDP, its loss and every gradient equal
//! the unsharded model's; the static plan check works on it.

use std::f64::consts::PI;
use std::time::Duration;

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_nn::{
    call, module_boilerplate, named_parameters, reset_parameters, Args, AttentionHeads, Embedding,
    Init, Linear, Module, ModuleCore, ModuleList, NnError, Param, ParamSlot, Value,
};
use tpar_parallel_styles::{
    check_plan, fully_shard, loss_parallel, parallelize_module, unshard, ColwiseParallel,
    FsdpConfig, ParallelizePlan, RowwiseParallel,
};
use tpar_tensor::{DType, Device, Tensor};

const VOCAB: usize = 40;
const D: usize = 16;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const POSITIONS: usize = 8;
const DTYPE: DType = DType::F64;

/// The first three dims of a value's shape, as `reshape` takes them.
fn dims3(v: &Value) -> Result<(isize, isize, isize), NnError> {
    let d = v.shape()?;
    Ok((d[0] as isize, d[1] as isize, d[2] as isize))
}

/// `torch.nn.LayerNorm(d)` with weight and bias.
struct LayerNorm {
    core: ModuleCore,
    weight: Param,
    bias: Param,
}

impl LayerNorm {
    fn new() -> Result<Self, NnError> {
        Ok(LayerNorm {
            core: ModuleCore::default(),
            weight: Param::new([D], DTYPE, Device::Meta)?,
            bias: Param::new([D], DTYPE, Device::Meta)?,
        })
    }
}

impl Module for LayerNorm {
    fn type_name(&self) -> &'static str {
        "LayerNorm"
    }
    fn forward(&self, args: Args) -> tpar_nn::Result<Value> {
        let x = args.get(0);
        let mu = x.mean(-1, true)?;
        let xc = x.sub(&mu)?;
        let var = xc.square()?.mean(-1, true)?;
        let y = xc.mul(&var.add_scalar(1e-5)?.rsqrt()?)?;
        let y = y.mul(&self.weight.compute()?.operand_for(&x, "LayerNorm")?)?;
        y.add(&self.bias.compute()?.operand_for(&x, "LayerNorm")?)
    }
    fn params(&self) -> Vec<(&'static str, &Param)> {
        vec![("weight", &self.weight), ("bias", &self.bias)]
    }
    fn param_slots(&mut self) -> Vec<ParamSlot<'_>> {
        // Not PyTorch's ones/zeros: random values, so the test sees their gradients mix.
        vec![
            ParamSlot { name: "weight", param: &mut self.weight, init: Init::Normal { std: 1.0 } },
            ParamSlot { name: "bias", param: &mut self.bias, init: Init::Normal { std: 0.1 } },
        ]
    }
    module_boilerplate!();
}

/// Causal self-attention with separate q/k/v projections (with bias); the head count
/// is read from the projections' outputs (this rank's heads when a plan hands on local
/// shards), so head-sharding needs no change here.
struct Attention {
    core: ModuleCore,
    c_q: Linear,
    c_k: Linear,
    c_v: Linear,
    c_proj: Linear,
}

impl Module for Attention {
    fn type_name(&self) -> &'static str {
        "Attention"
    }
    fn forward(&self, args: Args) -> tpar_nn::Result<Value> {
        let x = args.get(0);
        let hd = (D / HEADS) as isize;
        let heads = |l: &Linear| -> tpar_nn::Result<Value> {
            let t = call(l, Args::one(x.clone()))?;
            let (b, s, w) = dims3(&t)?;
            t.reshape(&[b, s, w / hd, hd])?.transpose(1, 2) // [b, h, s, hd]
        };
        let (q, k, v) = (heads(&self.c_q)?, heads(&self.c_k)?, heads(&self.c_v)?);
        let (b, h, s) = dims3(&q)?;
        let a = Value::scaled_dot_product_attention(&q, &k, &v, None, true, None)?;
        let a = a.transpose(1, 2)?.reshape(&[b, s, h * hd])?; // [b, s, h * hd]
        call(&self.c_proj, Args::one(a))
    }
    fn attention_heads(&self) -> Option<AttentionHeads> {
        Some(AttentionHeads {
            head_dim: D / HEADS,
            projections: vec![("c_q", D), ("c_k", D), ("c_v", D)],
        })
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("c_q".into(), &self.c_q as &dyn Module),
            ("c_k".into(), &self.c_k),
            ("c_v".into(), &self.c_v),
            ("c_proj".into(), &self.c_proj),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("c_q".into(), &mut self.c_q as &mut dyn Module),
            ("c_k".into(), &mut self.c_k),
            ("c_v".into(), &mut self.c_v),
            ("c_proj".into(), &mut self.c_proj),
        ]
    }
    module_boilerplate!();
}

/// `gelu(x, approximate="tanh")`.
fn gelu(x: &Value) -> tpar_nn::Result<Value> {
    let inner = x.add(&x.pow_scalar(3.0)?.mul_scalar(0.044715)?)?.mul_scalar((2.0 / PI).sqrt())?;
    x.mul(&inner.tanh()?.add_scalar(1.0)?)?.mul_scalar(0.5)
}

/// Pre-norm block: `x + attn(ln_1(x))`, then `x + c_proj(gelu(c_fc(ln_2(x))))`.
struct Block {
    core: ModuleCore,
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    c_fc: Linear,
    c_proj: Linear,
}

impl Block {
    fn new() -> Result<Self, NnError> {
        let lin = |i, o| Linear::new(i, o, true, DTYPE, Device::Meta);
        Ok(Block {
            core: ModuleCore::default(),
            ln_1: LayerNorm::new()?,
            attn: Attention {
                core: ModuleCore::default(),
                c_q: lin(D, D)?,
                c_k: lin(D, D)?,
                c_v: lin(D, D)?,
                c_proj: lin(D, D)?,
            },
            ln_2: LayerNorm::new()?,
            c_fc: lin(D, 3 * D)?,
            c_proj: lin(3 * D, D)?,
        })
    }
}

impl Module for Block {
    fn type_name(&self) -> &'static str {
        "Block"
    }
    fn forward(&self, args: Args) -> tpar_nn::Result<Value> {
        let x = args.get(0);
        let h = call(&self.ln_1, Args::one(x.clone()))?;
        let x = x.add(&call(&self.attn, Args::one(h))?)?;
        let h = call(&self.ln_2, Args::one(x.clone()))?;
        let h = call(&self.c_fc, Args::one(h))?;
        let h = call(&self.c_proj, Args::one(gelu(&h)?))?;
        x.add(&h)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("ln_1".into(), &self.ln_1 as &dyn Module),
            ("attn".into(), &self.attn),
            ("ln_2".into(), &self.ln_2),
            ("c_fc".into(), &self.c_fc),
            ("c_proj".into(), &self.c_proj),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("ln_1".into(), &mut self.ln_1 as &mut dyn Module),
            ("attn".into(), &mut self.attn),
            ("ln_2".into(), &mut self.ln_2),
            ("c_fc".into(), &mut self.c_fc),
            ("c_proj".into(), &mut self.c_proj),
        ]
    }
    module_boilerplate!();
}

/// Token and learned position embeddings, blocks, final norm, untied head.
struct Gpt2 {
    core: ModuleCore,
    wte: Embedding,
    wpe: Embedding,
    h: ModuleList<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
}

impl Gpt2 {
    fn new() -> Result<Self, NnError> {
        Ok(Gpt2 {
            core: ModuleCore::default(),
            wte: Embedding::new(VOCAB, D, DTYPE, Device::Meta)?,
            wpe: Embedding::new(POSITIONS, D, DTYPE, Device::Meta)?,
            h: ModuleList::new((0..LAYERS).map(|_| Block::new()).collect::<Result<_, _>>()?),
            ln_f: LayerNorm::new()?,
            lm_head: Linear::new(D, VOCAB, false, DTYPE, Device::Meta)?,
        })
    }
}

impl Module for Gpt2 {
    fn type_name(&self) -> &'static str {
        "Gpt2"
    }
    /// Input: token ids `[b, s]`; output: logits `[b, s, vocab]`.
    fn forward(&self, args: Args) -> tpar_nn::Result<Value> {
        let ids = args.get(0);
        let d = ids.shape()?;
        let (b, s) = (d[0], d[1]);
        let pos: Vec<i64> = (0..b * s).map(|i| (i % s) as i64).collect();
        let pos = Tensor::from_vec(pos, [b, s])?;
        let tok = call(&self.wte, Args::one(ids))?;
        let x = tok.add(&call(&self.wpe, Args::one(pos))?)?;
        let x = call(&self.h, Args::one(x))?;
        let x = call(&self.ln_f, Args::one(x))?;
        call(&self.lm_head, Args::one(x))
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("wte".into(), &self.wte as &dyn Module),
            ("wpe".into(), &self.wpe),
            ("h".into(), &self.h),
            ("ln_f".into(), &self.ln_f),
            ("lm_head".into(), &self.lm_head),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("wte".into(), &mut self.wte as &mut dyn Module),
            ("wpe".into(), &mut self.wpe),
            ("h".into(), &mut self.h),
            ("ln_f".into(), &mut self.ln_f),
            ("lm_head".into(), &mut self.lm_head),
        ]
    }
    module_boilerplate!();
}

/// Megatron-style TP for each block (keys relative to the block) and a vocab-sharded
/// head feeding loss_parallel.
fn block_plan() -> ParallelizePlan {
    ParallelizePlan::new()
        .add("attn.c_q", ColwiseParallel::new())
        .add("attn.c_k", ColwiseParallel::new())
        .add("attn.c_v", ColwiseParallel::new())
        .add("attn.c_proj", RowwiseParallel::new())
        .add("c_fc", ColwiseParallel::new())
        .add("c_proj", RowwiseParallel::new())
}

fn top_plan() -> ParallelizePlan {
    ParallelizePlan::new().add("lm_head", ColwiseParallel::new().use_local_output(false))
}

/// 4 sequences of 6 tokens and their next-token targets.
fn batch() -> (Tensor, Tensor) {
    let v: Vec<i64> = (0..4 * 7).map(|i| (i * 11 + i / 4) % (VOCAB as i64 - 1) + 1).collect();
    let all = Tensor::from_vec(v, [4, 7]).unwrap();
    (all.narrow(1, 0, 6).unwrap(), all.narrow(1, 1, 6).unwrap())
}

type Outcome = (f64, Vec<(String, Vec<f64>)>);

/// Loss and every parameter's full gradient on `rows` of the batch.
fn loss_and_grads(
    model: &Gpt2,
    rows: std::ops::Range<usize>,
    tp: Option<&DeviceMesh>,
) -> Result<Outcome, NnError> {
    let (ids, tgt) = batch();
    let (ids, tgt) =
        (ids.narrow(0, rows.start, rows.len())?, tgt.narrow(0, rows.start, rows.len())?);
    let _scope = tp.map(loss_parallel::enable);
    let logits = call(model, Args::one(ids))?;
    let loss = logits
        .reshape(&[-1, VOCAB as isize])?
        .cross_entropy(&tgt.reshape([rows.len() * 6])?, -100)?;
    loss.backward()?;
    let mut grads = Vec::new();
    for (n, p) in named_parameters(model) {
        let g = p.grad()?.unwrap_or_else(|| panic!("{n}: no gradient"));
        grads.push((n, g.full()?.to_vec_f64()?));
    }
    Ok((loss.item()?, grads))
}

fn reference() -> Outcome {
    let mut model = Gpt2::new().unwrap();
    reset_parameters(&mut model, Device::Cpu, 11).unwrap();
    loss_and_grads(&model, 0..4, None).unwrap()
}

use tpar_testing::plan_err;

/// Runs on a (dp, tp) mesh: TP by plan on every block and the head, FSDP per block and
/// at the root when dp > 1.
fn sharded(dp: usize, tp: usize) -> Vec<(usize, Outcome)> {
    spawn_scoped(SpawnConfig::new(dp * tp).timeout(Duration::from_secs(60)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[dp, tp], &["dp", "tp"])?;
        let mut model = Gpt2::new()?;
        for block in &mut model.h.items {
            parallelize_module(block, &mesh["tp"], &block_plan()).map_err(plan_err)?;
        }
        parallelize_module(&mut model, &mesh["tp"], &top_plan()).map_err(plan_err)?;
        if dp > 1 {
            for block in &mut model.h.items {
                fully_shard(block, &mesh["dp"], &FsdpConfig::default())?;
            }
            fully_shard(&mut model, &mesh["dp"], &FsdpConfig::default())?;
        }
        reset_parameters(&mut model, Device::Cpu, 11)?;
        if dp > 1 {
            unshard(&model)?;
        }
        let r = mesh["dp"].local_rank();
        let rows = 4 / dp;
        Ok::<_, NnError>((r, loss_and_grads(&model, r * rows..(r + 1) * rows, Some(&mesh["tp"]))?))
    })
    .unwrap_or_else(|e| panic!("dp={dp} tp={tp}: {e}"))
}

fn check(dp: usize, tp: usize) {
    let (want_loss, want) = reference();
    assert_eq!(want.len(), 5 + LAYERS * 16, "parameter count");
    let outs = sharded(dp, tp);
    // Equal rows per dp rank: the mean of the halves' losses is the batch's loss.
    let mean = outs.iter().map(|(_, (l, _))| l).sum::<f64>() / outs.len() as f64;
    assert!((mean - want_loss).abs() < 1e-12, "dp={dp} tp={tp}: loss {mean} vs {want_loss}");
    for (rank, (_, (_, grads))) in outs.iter().enumerate() {
        assert_eq!(grads.len(), want.len());
        for ((n, g), (wn, w)) in grads.iter().zip(&want) {
            assert_eq!(n, wn);
            let err = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            let scale = w.iter().map(|v| v.abs()).fold(0.0, f64::max);
            assert!(err <= 1e-10 * scale.max(1.0), "dp={dp} tp={tp} rank {rank} {n}: {err:e}");
        }
    }
}

#[test]
fn tensor_parallel_gpt2_equals_the_unsharded_model() {
    check(1, 2);
    check(1, 4);
}

#[test]
fn tp_times_fsdp_gpt2_equals_the_unsharded_model() {
    check(2, 2);
}

/// The plan check knows the user's module: a misspelt key names the nearest modules,
/// and head-sharding 4 heads over 3 ranks is refused before anything changes.
#[test]
fn the_plan_check_works_on_a_user_model() {
    let errs = spawn_scoped(SpawnConfig::new(3).timeout(Duration::from_secs(30)), |ctx| {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[3], &["tp"])?;
        let model = Gpt2::new()?;
        let typo = ParallelizePlan::new().add("h.0.attn.c_qq", ColwiseParallel::new());
        let typo = check_plan(&model, &mesh, &typo).expect_err("unknown key");
        let heads = check_plan(&model.h.items[0], &mesh, &block_plan()).expect_err("4 heads / 3");
        Ok::<_, NnError>((typo.to_string(), heads.to_string()))
    })
    .unwrap();
    let (typo, heads) = &errs[0];
    assert!(typo.contains("h.0.attn.c_q"), "{typo}");
    assert!(heads.contains("4 heads cannot be sharded over 3 ranks"), "{heads}");
}
