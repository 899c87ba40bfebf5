//! DTensor ops: for random shapes, meshes and placements, every op on sharded inputs equals
//! the op on full tensors, forward (`full_tensor` of the output) and backward (gradients of
//! the sharded leaves after `grad()` and `full_tensor`); exact collective counts for the
//! tensor-parallel matmul chain and loss_parallel; `Partial` never silently combined with a
//! replicated term; strict mode; typed errors.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tpar_collectives::{spawn_scoped, CollectiveKind, SpawnConfig};
use tpar_dtensor::{
    distribute_tensor, strict, take_implicit_redistributions, DTensor, DTensorError, Placement,
    ReduceOp,
};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_tensor::{manual_seed, tol::Tol, DType, Device, Rng, RopeLayout, Tensor};

use Placement::{Partial, Replicate, Shard};

const PSUM: Placement = Partial(ReduceOp::Sum);
const PAVG: Placement = Partial(ReduceOp::Avg);

type TResult<T> = Result<T, DTensorError>;

fn run<R: Send>(
    mesh_shape: &[usize],
    f: impl Fn(&DeviceMesh, usize) -> TResult<R> + Sync,
) -> Vec<R> {
    try_run(mesh_shape, f).unwrap_or_else(|e| panic!("{e}"))
}

fn try_run<R: Send>(
    mesh_shape: &[usize],
    f: impl Fn(&DeviceMesh, usize) -> TResult<R> + Sync,
) -> TResult<Vec<R>> {
    let n: usize = mesh_shape.iter().product();
    let names: Vec<String> = (0..mesh_shape.len()).map(|i| format!("d{i}")).collect();
    let cfg = SpawnConfig::new(n).timeout(Duration::from_secs(20));
    spawn_scoped(cfg, |ctx| {
        let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, mesh_shape, &names)?;
        f(&mesh, ctx.rank())
    })
}

/// A placement for a float operand of `rank` dims: shards half the time, then partials.
fn placement(code: u8, rank: usize) -> Placement {
    match code % 8 {
        0..=3 if rank > 0 => Shard((code as usize / 8 % rank) as isize),
        4 | 5 => PSUM,
        6 => PAVG,
        _ => Replicate,
    }
}

/// A placement for an integer operand (ids, targets): no partials.
fn int_placement(code: u8, rank: usize) -> Placement {
    match code % 4 {
        0 | 1 if rank > 0 => Shard((code as usize / 4 % rank) as isize),
        _ => Replicate,
    }
}

fn placements(codes: &[u8], ndim: usize, rank: usize) -> Vec<Placement> {
    (0..ndim).map(|i| placement(codes[i % codes.len()], rank)).collect()
}

fn int_placements(codes: &[u8], ndim: usize, rank: usize) -> Vec<Placement> {
    (0..ndim).map(|i| int_placement(codes[i % codes.len()], rank)).collect()
}

fn meshes() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![(1usize..=4).prop_map(|k| vec![k]), Just(vec![2, 2]), Just(vec![2, 3])]
}

fn codes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 8)
}

/// One operand of a checked op: the full tensor and how it is laid out.
struct Input {
    full: Tensor,
    placements: Vec<Placement>,
}

fn input(full: Tensor, placements: Vec<Placement>) -> Input {
    Input { full, placements }
}

fn randn(shape: &[usize], rng: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), DType::F64, rng).unwrap()
}

fn uniform(shape: &[usize], lo: f64, hi: f64, rng: &mut Rng) -> Tensor {
    Tensor::rand_uniform(shape.to_vec(), lo, hi, DType::F64, rng).unwrap()
}

fn ints(shape: &[usize], n: usize, ignore: Option<i64>, rng: &mut Rng) -> Tensor {
    let len: usize = shape.iter().product();
    let v: Vec<i64> = (0..len)
        .map(|_| match ignore {
            Some(i) if rng.uniform() < 0.2 => i,
            _ => rng.below(n.max(1) as u64) as i64,
        })
        .collect();
    Tensor::from_vec(v, shape.to_vec()).unwrap()
}

/// Runs `op_d` on the inputs distributed over `mesh_shape` and `op_t` on the full inputs;
/// checks the output (after `full_tensor`) and the gradient of every float input (the
/// loss is `sum(out * w)` for a fixed random `w`).
fn check(
    what: &str,
    mesh_shape: &[usize],
    inputs: &[Input],
    seed: u64,
    op_t: impl Fn(&[Tensor]) -> tpar_tensor::Result<Tensor>,
    op_d: impl Fn(&[DTensor]) -> TResult<DTensor> + Sync,
) -> Result<(), TestCaseError> {
    let is_float = |t: &Tensor| t.dtype() != DType::I64;
    let leaves: Vec<Tensor> =
        inputs.iter().map(|i| i.full.detach().requires_grad_(is_float(&i.full))).collect();
    let want = op_t(&leaves).unwrap_or_else(|e| panic!("{what}: reference op failed: {e}"));
    let mut rng = Rng::new(seed ^ 0x5eed);
    let w = randn(want.dims(), &mut rng);
    want.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let want_grads: Vec<Option<Vec<f64>>> =
        leaves.iter().map(|l| l.grad().map(|g| g.to_vec_f64().unwrap())).collect();
    let outs = run(mesh_shape, |mesh, _| {
        let ds = inputs
            .iter()
            .map(|i| {
                let t = i.full.detach().requires_grad_(is_float(&i.full));
                distribute_tensor(&t, mesh, &i.placements)
            })
            .collect::<TResult<Vec<_>>>()?;
        let out = op_d(&ds)?;
        let full = out.full_tensor()?;
        let loss = full.mul(&w)?.sum_all()?;
        let rep = vec![Replicate; mesh.ndim()];
        DTensor::from_local(&loss, mesh, &rep, Some(&[]))?.backward()?;
        let grads = ds
            .iter()
            .map(|d| match d.grad()? {
                Some(g) => Ok(Some(g.full_tensor()?.to_vec_f64()?)),
                None => Ok(None),
            })
            .collect::<TResult<Vec<_>>>()?;
        take_implicit_redistributions();
        Ok((full.dims().to_vec(), full.to_vec_f64()?, grads, out.placements().to_vec()))
    });
    let tol = Tol::for_dtype(DType::F64).scaled(100.0);
    let layouts: Vec<String> =
        inputs.iter().map(|i| format!("{:?} {:?}", i.full.dims(), i.placements)).collect();
    let ctx = format!("{what} on mesh {mesh_shape:?} with {layouts:?}");
    for (shape, full, grads, out_pl) in outs {
        prop_assert_eq!(&shape, &want.dims().to_vec(), "{}: output shape", ctx);
        tol.check(&format!("{ctx} -> {out_pl:?}: forward"), &full, &want.to_vec_f64().unwrap())
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, (g, wg)) in grads.iter().zip(&want_grads).enumerate() {
            match (g, wg) {
                (Some(g), Some(wg)) => tol
                    .check(&format!("{ctx} -> {out_pl:?}: gradient of input {i}"), g, wg)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?,
                (None, None) => {}
                (Some(g), None) => prop_assert!(
                    g.iter().all(|&v| v == 0.0),
                    "{}: input {} has a gradient the reference lacks",
                    ctx,
                    i
                ),
                (None, Some(wg)) => prop_assert!(
                    wg.iter().all(|&v| v == 0.0),
                    "{}: input {} got no gradient",
                    ctx,
                    i
                ),
            }
        }
    }
    Ok(())
}

/// `out` with some leading dims dropped and some dims set to 1 (a broadcastable operand).
fn broadcast_operand(out: &[usize], code: u8) -> Vec<usize> {
    let drop = if out.len() > 1 && code.is_multiple_of(3) { 1 } else { 0 };
    out[drop..]
        .iter()
        .enumerate()
        .map(|(i, &d)| if (code >> (2 + i)) & 1 == 1 { 1 } else { d })
        .collect()
}

/// `cases` per property, or `TPAR_OPS_CASES` when set (for longer local hunts).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("TPAR_OPS_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn elementwise_binary_ops_match(
        mesh_shape in meshes(),
        out in prop::collection::vec(0usize..6, 1..=3),
        shape_codes in prop::collection::vec(any::<u8>(), 2),
        codes in codes(),
        op in 0usize..5,
        seed in any::<u64>(),
    ) {
        let (sa, sb) = (broadcast_operand(&out, shape_codes[0]), broadcast_operand(&out, shape_codes[1]));
        let mut rng = Rng::new(seed);
        let (a, b) = if op >= 3 {
            (uniform(&sa, 0.5, 2.0, &mut rng), uniform(&sb, 0.5, 2.0, &mut rng))
        } else {
            (randn(&sa, &mut rng), randn(&sb, &mut rng))
        };
        let n = mesh_shape.len();
        let inputs = [
            input(a, placements(&codes[0..2], n, sa.len())),
            input(b, placements(&codes[2..4], n, sb.len())),
        ];
        let names = ["add", "sub", "mul", "div", "pow"];
        check(names[op], &mesh_shape, &inputs, seed,
            |x| match op { 0 => x[0].add(&x[1]), 1 => x[0].sub(&x[1]), 2 => x[0].mul(&x[1]), 3 => x[0].div(&x[1]), _ => x[0].pow(&x[1]) },
            |x| match op { 0 => x[0].add(&x[1]), 1 => x[0].sub(&x[1]), 2 => x[0].mul(&x[1]), 3 => x[0].div(&x[1]), _ => x[0].pow(&x[1]) })?;
    }

    #[test]
    fn unary_and_scalar_ops_match(
        mesh_shape in meshes(),
        shape in prop::collection::vec(0usize..6, 0..=3),
        codes in codes(),
        op in 0usize..15,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let x = uniform(&shape, 0.5, 2.0, &mut rng);
        let inputs = [input(x, placements(&codes, mesh_shape.len(), shape.len()))];
        let names = ["neg", "exp", "silu", "sigmoid", "square", "rsqrt", "tanh", "log",
            "add_scalar", "mul_scalar", "div_scalar", "rsub_scalar", "pow_scalar", "sub_scalar",
            "dropout"];
        // dropout: every rank and the reference draw from one state, and the shards'
        // masks make up the full tensor's
        let drop = |x: &Tensor| { manual_seed(seed); x.dropout(0.3, true) };
        let drop_d = |x: &DTensor| { manual_seed(seed); x.dropout(0.3, true) };
        check(names[op], &mesh_shape, &inputs, seed,
            |x| { let x = &x[0]; match op {
                0 => x.neg(), 1 => x.exp(), 2 => x.silu(), 3 => x.sigmoid(), 4 => x.square(),
                5 => x.rsqrt(), 6 => x.tanh(), 7 => x.log(), 8 => x.add_scalar(1.5),
                9 => x.mul_scalar(-2.5), 10 => x.div_scalar(4.0), 11 => x.rsub_scalar(3.0),
                12 => x.pow_scalar(3.0), 13 => x.add_scalar(-0.25), _ => drop(x) } },
            |x| { let x = &x[0]; match op {
                0 => x.neg(), 1 => x.exp(), 2 => x.silu(), 3 => x.sigmoid(), 4 => x.square(),
                5 => x.rsqrt(), 6 => x.tanh(), 7 => x.log(), 8 => x.add_scalar(1.5),
                9 => x.mul_scalar(-2.5), 10 => x.div_scalar(4.0), 11 => x.rsub_scalar(3.0),
                12 => x.pow_scalar(3.0), 13 => x.sub_scalar(0.25), _ => drop_d(x) } })?;
    }

    #[test]
    fn silu_mul_matches(
        mesh_shape in meshes(),
        shape in prop::collection::vec(0usize..6, 0..=3),
        codes in codes(),
        codes_up in codes(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let (g, u) = (randn(&shape, &mut rng), randn(&shape, &mut rng));
        let n = mesh_shape.len();
        let inputs = [
            input(g, placements(&codes, n, shape.len())),
            input(u, placements(&codes_up, n, shape.len())),
        ];
        check("silu_mul", &mesh_shape, &inputs, seed,
            |x| x[0].silu_mul(&x[1]), |x| x[0].silu_mul(&x[1]))?;
    }

    #[test]
    fn reductions_match(
        mesh_shape in meshes(),
        shape in prop::collection::vec(0usize..6, 1..=3),
        dim_bits in any::<u8>(),
        keepdim in any::<bool>(),
        mean in any::<bool>(),
        all in any::<bool>(),
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let x = randn(&shape, &mut rng);
        let dims: Vec<isize> = (0..shape.len()).filter(|i| dim_bits >> i & 1 == 1)
            .map(|i| if dim_bits & 0x80 != 0 { i as isize - shape.len() as isize } else { i as isize })
            .collect();
        let inputs = [input(x, placements(&codes, mesh_shape.len(), shape.len()))];
        let what = format!("{}{} over {dims:?} keepdim {keepdim}", if mean { "mean" } else { "sum" }, if all { "_all" } else { "" });
        check(&what, &mesh_shape, &inputs, seed,
            |x| match (mean, all) {
                (false, true) => x[0].sum_all(), (true, true) => x[0].mean_all(),
                (false, false) => x[0].sum_dims(&dims, keepdim), (true, false) => x[0].mean_dims(&dims, keepdim) },
            |x| match (mean, all) {
                (false, true) => x[0].sum_all(), (true, true) => x[0].mean_all(),
                (false, false) => x[0].sum_dims(&dims, keepdim), (true, false) => x[0].mean_dims(&dims, keepdim) })?;
    }

    #[test]
    fn softmax_and_rms_norm_match(
        mesh_shape in meshes(),
        shape in prop::collection::vec(1usize..6, 1..=3),
        dim in 0usize..3,
        op in 0usize..3,
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let x = randn(&shape, &mut rng);
        let d = (dim % shape.len()) as isize;
        let n = mesh_shape.len();
        let mut inputs = vec![input(x, placements(&codes[0..2], n, shape.len()))];
        if op == 2 {
            let w = randn(&[shape[shape.len() - 1]], &mut rng);
            inputs.push(input(w, placements(&codes[2..4], n, 1)));
        }
        let names = ["softmax", "log_softmax", "rms_norm"];
        check(names[op], &mesh_shape, &inputs, seed,
            |x| match op { 0 => x[0].softmax(d), 1 => x[0].log_softmax(d), _ => x[0].rms_norm(&x[1], 1e-6) },
            |x| match op { 0 => x[0].softmax(d), 1 => x[0].log_softmax(d), _ => x[0].rms_norm(&x[1], 1e-6) })?;
    }

    #[test]
    fn matmul_matches(
        mesh_shape in meshes(),
        mkn in prop::collection::vec(0usize..6, 3),
        batch in prop::collection::vec(1usize..4, 0..=2),
        batch_mode in 0usize..3,
        codes in codes(),
        seed in any::<u64>(),
    ) {
        // Global k, n >= 1: the unsharded reference's backward cannot take k = 0 or n = 0
        // with a batched lhs and a 2-d rhs (a tpar-tensor bug); local shards still get 0.
        let (m, k, n) = (mkn[0], mkn[1].max(1), mkn[2].max(1));
        let mut sa = batch.clone();
        sa.extend([m, k]);
        let mut sb: Vec<usize> = match batch_mode {
            0 => vec![],
            1 => batch.clone(),
            _ => batch.iter().enumerate().map(|(i, &b)| if i == 0 { 1 } else { b }).collect(),
        };
        sb.extend([k, n]);
        let mut rng = Rng::new(seed);
        let nd = mesh_shape.len();
        let inputs = [
            input(randn(&sa, &mut rng), placements(&codes[0..2], nd, sa.len())),
            input(randn(&sb, &mut rng), placements(&codes[2..4], nd, sb.len())),
        ];
        check("matmul", &mesh_shape, &inputs, seed, |x| x[0].matmul(&x[1]), |x| x[0].matmul(&x[1]))?;
    }

    #[test]
    fn linear_matches(
        mesh_shape in meshes(),
        lead in prop::collection::vec(0usize..5, 1..=2),
        io in prop::collection::vec(0usize..6, 2),
        bias in any::<bool>(),
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let (i, o) = (io[0].max(1), io[1].max(1)); // see matmul_matches

        let mut sx = lead.clone();
        sx.push(i);
        let mut rng = Rng::new(seed);
        let nd = mesh_shape.len();
        let mut inputs = vec![
            input(randn(&sx, &mut rng), placements(&codes[0..2], nd, sx.len())),
            input(randn(&[o, i], &mut rng), placements(&codes[2..4], nd, 2)),
        ];
        if bias {
            inputs.push(input(randn(&[o], &mut rng), placements(&codes[4..6], nd, 1)));
        }
        check("linear", &mesh_shape, &inputs, seed,
            |x| x[0].linear(&x[1], x.get(2)),
            |x| x[0].linear(&x[1], x.get(2)))?;
    }

    #[test]
    fn rope_matches(
        mesh_shape in meshes(),
        dims in prop::collection::vec(0usize..5, 3),
        half in 1usize..3,
        bshd in any::<bool>(),
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let (b, h, s, hd) = (dims[0], dims[1], dims[2], 2 * half);
        let layout = if bshd { RopeLayout::Bshd } else { RopeLayout::Bhsd };
        let shape = if bshd { [b, s, h, hd] } else { [b, h, s, hd] };
        let mut rng = Rng::new(seed);
        let (cos, sin) = (randn(&[s, hd], &mut rng), randn(&[s, hd], &mut rng));
        let inputs = [input(randn(&shape, &mut rng), placements(&codes, mesh_shape.len(), 4))];
        check("rope", &mesh_shape, &inputs, seed,
            |x| x[0].rope(&cos, &sin, layout),
            |x| x[0].rope(&cos, &sin, layout))?;
    }

    #[test]
    fn attention_matches(
        mesh_shape in meshes(),
        dims in prop::collection::vec(1usize..4, 4),
        seqs in prop::collection::vec(0usize..5, 2),
        mask_mode in 0usize..3,
        causal in any::<bool>(),
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let (b, hkv, g, d) = (dims[0] - 1, dims[1], dims[2], dims[3]);
        let (sq, sk) = (seqs[0], seqs[1] + 1);
        let hq = hkv * g;
        let mut rng = Rng::new(seed);
        let nd = mesh_shape.len();
        let inputs = [
            input(randn(&[b, hq, sq, d], &mut rng), placements(&codes[0..2], nd, 4)),
            input(randn(&[b, hkv, sk, d], &mut rng), placements(&codes[2..4], nd, 4)),
            input(randn(&[b, hkv, sk, d + 1], &mut rng), placements(&codes[4..6], nd, 4)),
        ];
        let mask = match mask_mode {
            0 => None,
            1 => Some(randn(&[sq, sk], &mut rng)),
            _ => Some(randn(&[b, 1, sq, 1], &mut rng)),
        };
        let what = format!("sdpa causal {causal} mask {:?}", mask.as_ref().map(|m| m.dims().to_vec()));
        check(&what, &mesh_shape, &inputs, seed,
            |x| Tensor::scaled_dot_product_attention(&x[0], &x[1], &x[2], mask.as_ref(), causal, None),
            |x| DTensor::scaled_dot_product_attention(&x[0], &x[1], &x[2], mask.as_ref(), causal, None))?;
    }

    #[test]
    fn embedding_matches(
        mesh_shape in meshes(),
        ids_shape in prop::collection::vec(0usize..5, 1..=2),
        vd in prop::collection::vec(1usize..7, 2),
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let (v, d) = (vd[0], vd[1]);
        let mut rng = Rng::new(seed);
        let nd = mesh_shape.len();
        let inputs = [
            input(ints(&ids_shape, v, None, &mut rng), int_placements(&codes[0..2], nd, ids_shape.len())),
            input(randn(&[v, d], &mut rng), placements(&codes[2..4], nd, 2)),
        ];
        check("embedding", &mesh_shape, &inputs, seed,
            |x| Tensor::embedding(&x[0], &x[1]),
            |x| DTensor::embedding(&x[0], &x[1]))?;
    }

    #[test]
    fn cross_entropy_matches(
        mesh_shape in meshes(),
        rows in prop::collection::vec(0usize..5, 1..=2),
        vocab in 1usize..9,
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let mut shape = rows.clone();
        shape.push(vocab);
        let mut rng = Rng::new(seed);
        let nd = mesh_shape.len();
        let inputs = [
            input(randn(&shape, &mut rng), placements(&codes[0..2], nd, shape.len())),
            input(ints(&rows, vocab, Some(-100), &mut rng), int_placements(&codes[2..4], nd, rows.len())),
        ];
        check("cross_entropy", &mesh_shape, &inputs, seed,
            |x| x[0].cross_entropy(&x[1], -100),
            |x| x[0].cross_entropy(&x[1], -100))?;
    }

    #[test]
    fn layout_ops_match(
        mesh_shape in meshes(),
        shape in prop::collection::vec(0usize..7, 1..=3),
        op in 0usize..7,
        a in any::<usize>(),
        b in any::<usize>(),
        codes in codes(),
        seed in any::<u64>(),
    ) {
        let r = shape.len();
        let mut rng = Rng::new(seed);
        let inputs = [input(randn(&shape, &mut rng), placements(&codes, mesh_shape.len(), r))];
        let (d0, d1) = (a % r, b % r);
        let mut perm: Vec<usize> = (0..r).collect();
        perm.rotate_left(a % r);
        // A reshape target: merge dims d0..=d1, or split dim d0 into a divisor and the rest.
        let (lo, hi) = (d0.min(d1), d0.max(d1));
        let split = {
            let s = shape[d0];
            let divs: Vec<usize> = (1..=s).filter(|f| s % f == 0).collect();
            let f = if divs.is_empty() { 1 } else { divs[b % divs.len()] };
            let mut t = shape.clone();
            if s == 0 { t.insert(d0, 1); } else { t[d0] = s / f; t.insert(d0, f); }
            t
        };
        let merged: Vec<usize> = {
            let mut t = shape[..lo].to_vec();
            t.push(shape[lo..=hi].iter().product());
            t.extend_from_slice(&shape[hi + 1..]);
            t
        };
        let unit = shape.iter().position(|&s| s == 1);
        let what = format!("layout op {op} ({d0}, {d1}, perm {perm:?}, split {split:?})");
        let sq = unit.unwrap_or(0) as isize;
        check(&what, &mesh_shape, &inputs, seed,
            |x| { let x = &x[0]; match op {
                0 => x.transpose(d0 as isize, d1 as isize), 1 => x.permute(&perm),
                2 => x.unsqueeze(d0 as isize), 3 => x.flatten(lo as isize, hi as isize),
                4 => x.reshape(split.clone()), 5 => x.reshape(merged.clone()),
                _ => if unit.is_some() { x.squeeze(sq) } else { x.view(&[-1]) } } },
            |x| { let x = &x[0]; match op {
                0 => x.transpose(d0 as isize, d1 as isize), 1 => x.permute(&perm),
                2 => x.unsqueeze(d0 as isize), 3 => x.flatten(lo as isize, hi as isize),
                4 => x.reshape(&split), 5 => x.reshape(&merged),
                _ => if unit.is_some() { x.squeeze(sq) } else { x.view(&[-1]) } } })?;
    }
}

// ---- placements the rules promise ---------------------------------------------------------

fn ones(shape: &[usize]) -> Tensor {
    Tensor::ones(shape.to_vec(), DType::F64, Device::Cpu).unwrap()
}

/// A named op on a mesh, the output placement it must give, and how many implicit
/// redistributions it may need.
type RuleCase<'a> =
    (&'static str, Box<dyn Fn(&DeviceMesh) -> TResult<DTensor> + Sync + 'a>, Placement, usize);

/// Output placements and the implicit redistributions of `f` on a 1-d mesh of `k`.
fn placements_of(
    k: usize,
    f: impl Fn(&DeviceMesh) -> TResult<DTensor> + Sync,
) -> (Vec<Placement>, usize) {
    run(&[k], |mesh, _| {
        take_implicit_redistributions();
        let out = f(mesh)?;
        Ok((out.placements().to_vec(), take_implicit_redistributions().len()))
    })
    .swap_remove(0)
}

#[test]
fn matmul_and_linear_rules() {
    let d = |m: &DeviceMesh, s: &[usize], p: Placement| distribute_tensor(&ones(s), m, &[p]);
    let cases: Vec<RuleCase<'_>> = vec![
        (
            "R x S(col)",
            Box::new(|m| d(m, &[4, 6], Replicate)?.matmul(&d(m, &[6, 8], Shard(1))?)),
            Shard(1),
            0,
        ),
        (
            "S(-1) x S(row)",
            Box::new(|m| d(m, &[4, 6], Shard(1))?.matmul(&d(m, &[6, 8], Shard(0))?)),
            PSUM,
            0,
        ),
        (
            "S(m) x R",
            Box::new(|m| d(m, &[4, 6], Shard(0))?.matmul(&d(m, &[6, 8], Replicate)?)),
            Shard(0),
            0,
        ),
        (
            "S(-1) x R slices rhs",
            Box::new(|m| d(m, &[4, 6], Shard(1))?.matmul(&d(m, &[6, 8], Replicate)?)),
            PSUM,
            0,
        ),
        (
            "batch",
            Box::new(|m| d(m, &[2, 4, 6], Shard(0))?.matmul(&d(m, &[2, 6, 8], Replicate)?)),
            Shard(0),
            0,
        ),
        ("P x R", Box::new(|m| d(m, &[4, 6], PSUM)?.matmul(&d(m, &[6, 8], Replicate)?)), PSUM, 0),
        (
            "S(m) x S(n) gathers one",
            Box::new(|m| d(m, &[4, 6], Shard(0))?.matmul(&d(m, &[6, 8], Shard(1))?)),
            Shard(1),
            1,
        ),
        (
            "colwise",
            Box::new(|m| {
                d(m, &[3, 4, 6], Replicate)?
                    .linear(&d(m, &[8, 6], Shard(0))?, Some(&d(m, &[8], Replicate)?))
            }),
            Shard(2),
            0,
        ),
        (
            "rowwise",
            Box::new(|m| {
                d(m, &[3, 4, 6], Shard(2))?
                    .linear(&d(m, &[8, 6], Shard(1))?, Some(&d(m, &[8], Replicate)?))
            }),
            PSUM,
            0,
        ),
        (
            "sequence",
            Box::new(|m| {
                d(m, &[3, 4, 6], Shard(1))?
                    .linear(&d(m, &[8, 6], Replicate)?, Some(&d(m, &[8], Replicate)?))
            }),
            Shard(1),
            0,
        ),
        (
            "replicated",
            Box::new(|m| d(m, &[4, 6], Replicate)?.linear(&d(m, &[8, 6], Replicate)?, None)),
            Replicate,
            0,
        ),
    ];
    for (name, f, want, implicit) in cases {
        let (got, n) = placements_of(2, f);
        assert_eq!((got, n), (vec![want], implicit), "{name}");
    }
}

#[test]
fn other_op_rules() {
    let d = |m: &DeviceMesh, s: &[usize], p: Placement| distribute_tensor(&ones(s), m, &[p]);
    let ids = |m: &DeviceMesh| {
        distribute_tensor(&Tensor::from_vec(vec![0i64, 3, 5, 1], [2, 2]).unwrap(), m, &[Replicate])
    };
    let cases: Vec<RuleCase<'_>> = vec![
        ("sum over a sharded dim", Box::new(|m| d(m, &[4, 6], Shard(0))?.sum(0, false)), PSUM, 0),
        ("sum over another dim", Box::new(|m| d(m, &[4, 6], Shard(1))?.sum(0, false)), Shard(0), 0),
        ("mean over a sharded dim", Box::new(|m| d(m, &[4, 6], Shard(1))?.mean(1, true)), PSUM, 0),
        (
            "softmax over an unsharded dim",
            Box::new(|m| d(m, &[4, 6], Shard(0))?.softmax(1)),
            Shard(0),
            0,
        ),
        (
            "softmax over the sharded dim",
            Box::new(|m| d(m, &[4, 6], Shard(1))?.softmax(1)),
            Replicate,
            1,
        ),
        (
            "rms_norm sequence-sharded",
            Box::new(|m| d(m, &[2, 4, 6], Shard(1))?.rms_norm(&d(m, &[6], Replicate)?, 1e-5)),
            Shard(1),
            0,
        ),
        (
            "vocab-parallel embedding",
            Box::new(move |m| DTensor::embedding(&ids(m)?, &d(m, &[6, 4], Shard(0))?)),
            PSUM,
            0,
        ),
        (
            "dim-parallel embedding",
            Box::new(move |m| DTensor::embedding(&ids(m)?, &d(m, &[6, 4], Shard(1))?)),
            Shard(2),
            0,
        ),
        (
            "transpose moves the shard",
            Box::new(|m| d(m, &[4, 6], Shard(1))?.transpose(0, 1)),
            Shard(0),
            0,
        ),
        (
            "merge keeps the outer shard",
            Box::new(|m| d(m, &[6, 4], Shard(0))?.reshape(&[24])),
            Shard(0),
            0,
        ),
        (
            "split keeps the outer shard",
            Box::new(|m| d(m, &[12], Shard(0))?.reshape(&[2, 6])),
            Shard(0),
            0,
        ),
        (
            "merge of an inner shard gathers",
            Box::new(|m| d(m, &[6, 4], Shard(1))?.reshape(&[24])),
            Replicate,
            1,
        ),
        (
            "uneven merge gathers",
            Box::new(|m| d(m, &[3, 2], Shard(0))?.reshape(&[6])),
            Replicate,
            1,
        ),
        (
            "size-1 shard reshaped away",
            Box::new(|m| d(m, &[1], Shard(0))?.reshape(&[])),
            Replicate,
            1,
        ),
        ("unsqueeze shifts", Box::new(|m| d(m, &[4, 6], Shard(1))?.unsqueeze(0)), Shard(2), 0),
        ("P * 2 stays P", Box::new(|m| d(m, &[4], PSUM)?.mul_scalar(2.0)), PSUM, 0),
        ("P + P stays P", Box::new(|m| d(m, &[4], PSUM)?.add(&d(m, &[4], PSUM)?)), PSUM, 0),
        ("P * R stays P", Box::new(|m| d(m, &[4], PSUM)?.mul(&d(m, &[4], Replicate)?)), PSUM, 0),
        ("P * P reduces one", Box::new(|m| d(m, &[4], PSUM)?.mul(&d(m, &[4], PSUM)?)), PSUM, 1),
        (
            "P + R reduces",
            Box::new(|m| d(m, &[4], PSUM)?.add(&d(m, &[4], Replicate)?)),
            Replicate,
            1,
        ),
        ("P + scalar reduces", Box::new(|m| d(m, &[4], PSUM)?.add_scalar(1.0)), Replicate, 1),
        ("exp(P) reduces", Box::new(|m| d(m, &[4], PSUM)?.exp()), Replicate, 1),
        (
            "S + R slices",
            Box::new(|m| d(m, &[4, 6], Shard(0))?.add(&d(m, &[4, 6], Replicate)?)),
            Shard(0),
            0,
        ),
        (
            "S + broadcast R",
            Box::new(|m| d(m, &[4, 6], Shard(0))?.add(&d(m, &[1, 6], Replicate)?)),
            Shard(0),
            0,
        ),
    ];
    for (name, f, want, implicit) in cases {
        let (got, n) = placements_of(2, f);
        assert_eq!((got, n), (vec![want], implicit), "{name}");
    }
}

#[test]
fn attention_head_sharding_respects_gqa() {
    // 4 query heads over 2 kv heads on 2 ranks: each rank's query heads use its kv head.
    let (pl, n) = placements_of(2, |m| {
        let q = distribute_tensor(&ones(&[1, 4, 3, 2]), m, &[Shard(1)])?;
        let kv = distribute_tensor(&ones(&[1, 2, 3, 2]), m, &[Shard(1)])?;
        DTensor::scaled_dot_product_attention(&q, &kv, &kv, None, true, None)
    });
    assert_eq!((pl, n), (vec![Shard(1)], 0));
    // 3 kv heads on 2 ranks (2 + 1) with 6 query heads (3 + 3): inconsistent, gathered.
    let (pl, n) = placements_of(2, |m| {
        let q = distribute_tensor(&ones(&[1, 6, 3, 2]), m, &[Shard(1)])?;
        let kv = distribute_tensor(&ones(&[1, 3, 3, 2]), m, &[Shard(1)])?;
        DTensor::scaled_dot_product_attention(&q, &kv, &kv, None, false, None)
    });
    // (The cost model then prefers moving q, k, v to the batch dim over gathering them.)
    assert_ne!(pl, vec![Shard(1)]);
    assert_eq!(n, 3);
}

// ---- communication counts -------------------------------------------------------------------

#[test]
fn colwise_then_rowwise_is_one_all_reduce_each_way() {
    let counts = run(&[2], |mesh, _| {
        let dbg = mesh.group(0)?.comm_debug();
        let mut rng = Rng::new(7);
        let d = |t: Tensor, p: Placement| distribute_tensor(&t.requires_grad_(true), mesh, &[p]);
        let x = d(randn(&[3, 5, 8], &mut rng), Replicate)?;
        let w1 = d(randn(&[12, 8], &mut rng), Shard(0))?;
        let b1 = d(randn(&[12], &mut rng), Replicate)?;
        let w2 = d(randn(&[8, 12], &mut rng), Shard(1))?;
        let b2 = d(randn(&[8], &mut rng), Replicate)?;
        dbg.enable();
        let h = x.linear(&w1, Some(&b1))?.silu()?; // [3, 5, 12] as S(-1)
        let y = h.linear(&w2, Some(&b2))?; // [3, 5, 8] as P(sum)
        assert_eq!(y.placements(), &[PSUM]);
        let y = y.redistribute(&[Replicate])?;
        let fwd = (dbg.total(), dbg.count(CollectiveKind::AllReduce));
        dbg.clear();
        let loss = y.to_local().square()?.sum_all()?;
        DTensor::from_local(&loss, mesh, &[Replicate], Some(&[]))?.backward()?;
        let bwd = (dbg.total(), dbg.count(CollectiveKind::AllReduce));
        dbg.disable();
        assert!(take_implicit_redistributions().is_empty());
        Ok((fwd, bwd))
    });
    for (fwd, bwd) in counts {
        assert_eq!(fwd, (1, 1), "forward");
        assert_eq!(bwd, (1, 1), "backward");
    }
}

#[test]
fn loss_parallel_never_gathers_the_logits() {
    let counts = run(&[3], |mesh, _| {
        let dbg = mesh.group(0)?.comm_debug();
        let mut rng = Rng::new(11);
        let logits = randn(&[2, 4, 10], &mut rng).requires_grad_(true);
        let targets = ints(&[2, 4], 10, Some(-100), &mut rng);
        let dl = distribute_tensor(&logits, mesh, &[Shard(-1)])?;
        let dt = distribute_tensor(&targets, mesh, &[Replicate])?;
        dbg.enable();
        let loss = dl.cross_entropy(&dt, -100)?;
        let fwd = dbg.records();
        dbg.clear();
        loss.backward()?;
        let bwd = dbg.records();
        dbg.disable();
        // The loss and gradients equal the unsharded ones.
        let full = logits.detach().requires_grad_(true);
        let want = full.cross_entropy(&targets, -100)?;
        want.backward()?;
        let tol = Tol::for_dtype(DType::F64).scaled(10.0);
        tol.check_tensors("loss", &loss.to_local(), &want)?;
        tol.check_tensors(
            "grad",
            &dl.grad()?.expect("grad").full_tensor()?,
            &full.grad().expect("grad"),
        )?;
        Ok((fwd, bwd))
    });
    for (fwd, bwd) in counts {
        let kinds: Vec<_> = fwd.iter().map(|r| r.kind).collect();
        assert_eq!(kinds, vec![CollectiveKind::AllReduce; 3], "{fwd:?}");
        // Per-row statistics only: 8 rows of f64, never the [2, 4, 10] logits.
        assert!(fwd.iter().all(|r| r.shape == vec![8]), "{fwd:?}");
        assert_eq!(bwd.len(), 1, "{bwd:?}");
        assert_eq!((bwd[0].kind, bwd[0].shape.clone()), (CollectiveKind::AllReduce, vec![1]));
    }
}

// ---- partials are never silently combined with replicated terms -----------------------------

#[test]
fn partial_plus_scalar_redistributes_and_is_exact() {
    for k in [2, 3, 4] {
        let out = run(&[k], |mesh, _| {
            let x = Tensor::from_vec(vec![1.0f64, -2.0, 3.5], [3])?;
            let p = distribute_tensor(&x, mesh, &[PSUM])?;
            take_implicit_redistributions();
            let y = p.add_scalar(10.0)?;
            let trace = take_implicit_redistributions();
            let z = p.rsub_scalar(1.0)?.full_tensor()?.to_vec::<f64>()?;
            let m = p.mul_scalar(2.0)?; // linear: stays partial, no communication
            Ok((
                y.placements().to_vec(),
                y.full_tensor()?.to_vec::<f64>()?,
                trace,
                z,
                m.placements().to_vec(),
                m.full_tensor()?.to_vec::<f64>()?,
            ))
        });
        for (pl, v, trace, z, mpl, mv) in out {
            assert_eq!(pl, vec![Replicate]);
            assert_eq!(v, vec![11.0, 8.0, 13.5], "k = {k}: the scalar is added once");
            assert_eq!(trace.len(), 1);
            assert_eq!(
                (trace[0].op, trace[0].from.as_str(), trace[0].to.as_str()),
                ("add_scalar", "P(sum)", "R")
            );
            assert_eq!(z, vec![0.0, 3.0, -2.5]);
            assert_eq!((mpl, mv), (vec![PSUM], vec![2.0, -4.0, 7.0]));
        }
    }
}

#[test]
fn partial_with_replicate_is_exact_and_strict_mode_rejects_it() {
    let out = run(&[3], |mesh, _| {
        let a = Tensor::from_vec(vec![1.0f64, 2.0], [2])?;
        let b = Tensor::from_vec(vec![10.0f64, 20.0], [2])?;
        let pa = distribute_tensor(&a, mesh, &[PSUM])?;
        let rb = distribute_tensor(&b, mesh, &[Replicate])?;
        let strict_add = strict(|| pa.add(&rb)).unwrap_err();
        let strict_exp = strict(|| pa.exp()).unwrap_err();
        let strict_pp = strict(|| pa.mul(&pa)).unwrap_err();
        // Linear uses are fine in strict mode: no redistribution needed.
        let fine = strict(|| -> TResult<_> {
            Ok((
                pa.mul(&rb)?.placements().to_vec(),
                pa.add(&pa)?.placements().to_vec(),
                pa.div(&rb)?.placements().to_vec(),
            ))
        })?;
        take_implicit_redistributions();
        let sum = pa.add(&rb)?;
        let trace = take_implicit_redistributions();
        let prod = pa.mul(&pa)?.full_tensor()?.to_vec::<f64>()?;
        let quot = rb.div(&pa)?.full_tensor()?.to_vec::<f64>()?;
        Ok((
            strict_add.to_string(),
            strict_exp.to_string(),
            strict_pp,
            fine,
            sum.placements().to_vec(),
            sum.full_tensor()?.to_vec::<f64>()?,
            trace,
            prod,
            quot,
        ))
    });
    for (add, exp, pp, fine, pl, v, trace, prod, quot) in out {
        assert!(
            add.contains("add")
                && add.contains("lhs")
                && add.contains("P(sum) -> R")
                && add.contains("strict"),
            "{add}"
        );
        assert!(exp.contains("exp") && exp.contains("P(sum) -> R"), "{exp}");
        assert!(matches!(pp, DTensorError::ImplicitRedistribution { op: "mul", .. }), "{pp}");
        assert_eq!(fine, (vec![PSUM], vec![PSUM], vec![PSUM]));
        assert_eq!((pl, v), (vec![Replicate], vec![11.0, 22.0]));
        assert_eq!(trace.len(), 1);
        assert_eq!(trace[0].operand, "lhs");
        assert_eq!(prod, vec![1.0, 4.0]);
        assert_eq!(quot, vec![10.0, 10.0]);
    }
}

// ---- errors ---------------------------------------------------------------------------------

#[test]
fn errors_name_the_op_shapes_placements_and_mesh() {
    let msgs = run(&[2], |mesh, _| {
        let a = distribute_tensor(&ones(&[8, 16]), mesh, &[Shard(1)])?;
        let b = distribute_tensor(&ones(&[15, 4]), mesh, &[Shard(0)])?;
        let mm = a.matmul(&b).unwrap_err().to_string();
        let c = distribute_tensor(&ones(&[8, 3]), mesh, &[Replicate])?;
        let add = a.add(&c).unwrap_err().to_string();
        let names: Vec<&str> = vec!["other"];
        let other = DeviceMesh::new(mesh.group(0)?, DeviceType::Cpu, &[2], &names)?;
        let d = distribute_tensor(&ones(&[8, 16]), &other, &[Replicate])?;
        let mismatch = a.add(&d).unwrap_err();
        let w = distribute_tensor(&ones(&[16]), &other, &[Replicate])?;
        assert!(matches!(
            a.rms_norm(&w, 1e-5),
            Err(DTensorError::MeshMismatch { op: "rms_norm", .. })
        ));
        let sum = a.sum(2, false).unwrap_err().to_string();
        let ids = distribute_tensor(&Tensor::from_vec(vec![0i64, 9], [2])?, mesh, &[Replicate])?;
        let table = distribute_tensor(&ones(&[4, 3]), mesh, &[Shard(0)])?;
        let emb = DTensor::embedding(&ids, &table).unwrap_err().to_string();
        Ok((mm, add, mismatch, sum, emb))
    });
    let (mm, add, mismatch, sum, emb) = &msgs[0];
    assert!(
        mm.starts_with(
            "matmul: lhs shape [8, 16] as S(1) and rhs shape [15, 4] as S(0) on mesh (d0=2): "
        ),
        "{mm}"
    );
    assert!(
        add.starts_with("add: lhs shape [8, 16] as S(1) and rhs shape [8, 3] as R on mesh (d0=2)"),
        "{add}"
    );
    assert!(matches!(mismatch, DTensorError::MeshMismatch { op: "add", .. }), "{mismatch}");
    assert!(sum.starts_with("sum: input shape [8, 16] as S(1)"), "{sum}");
    assert!(emb.contains("id 9") && emb.contains("4 rows"), "{emb}");
}

#[test]
fn partial_avg_operands_stay_exact() {
    // Partial(avg) through linear ops and reductions, forward and backward.
    let mut rng = Rng::new(3);
    let x = randn(&[4, 6], &mut rng);
    let w = randn(&[5, 6], &mut rng);
    let inputs = [input(x, vec![PAVG, Shard(1)]), input(w, vec![Replicate, Shard(1)])];
    check(
        "linear with P(avg)",
        &[2, 3],
        &inputs,
        1,
        |x| x[0].linear(&x[1], None),
        |x| x[0].linear(&x[1], None),
    )
    .unwrap();
    let x = randn(&[4, 6], &mut rng);
    let inputs = [input(x, vec![PAVG, Shard(0)])];
    check(
        "mean of P(avg)",
        &[3, 2],
        &inputs,
        2,
        |x| x[0].mean(0, false)?.mul_scalar(3.0),
        |x| x[0].mean(0, false)?.mul_scalar(3.0),
    )
    .unwrap();
}

#[test]
fn two_d_mesh_loss_parallel_with_row_sharding() {
    // dp x tp: rows on dp, vocab on tp; all_reduces over tp for stats, over dp for the mean.
    let mut rng = Rng::new(5);
    let logits = randn(&[5, 3, 7], &mut rng);
    let targets = ints(&[5, 3], 7, Some(-100), &mut rng);
    let inputs =
        [input(logits, vec![Shard(0), Shard(2)]), input(targets, vec![Shard(0), Replicate])];
    check(
        "cross_entropy dp x tp",
        &[2, 3],
        &inputs,
        9,
        |x| x[0].cross_entropy(&x[1], -100),
        |x| x[0].cross_entropy(&x[1], -100),
    )
    .unwrap();
}

#[test]
fn tensor_parallel_block_with_loss_parallel_on_a_2d_mesh() {
    // (dp=2, tp=2): batch on dp; colwise -> silu -> rowwise, residual, RMSNorm, a colwise
    // lm head and loss_parallel; loss and every gradient equal the unsharded ones.
    let mut rng = Rng::new(17);
    let inputs = [
        input(randn(&[4, 3, 6], &mut rng), vec![Shard(0), Replicate]),
        input(randn(&[8, 6], &mut rng), vec![Replicate, Shard(0)]),
        input(randn(&[8], &mut rng), vec![Replicate, Replicate]),
        input(randn(&[6, 8], &mut rng), vec![Replicate, Shard(1)]),
        input(randn(&[6], &mut rng), vec![Replicate, Replicate]),
        input(randn(&[10, 6], &mut rng), vec![Replicate, Shard(0)]),
        input(ints(&[4, 3], 10, Some(-100), &mut rng), vec![Shard(0), Replicate]),
    ];
    check(
        "block",
        &[2, 2],
        &inputs,
        3,
        |x| {
            let h = x[0].linear(&x[1], Some(&x[2]))?.silu()?;
            let y = h.linear(&x[3], None)?.add(&x[0])?.rms_norm(&x[4], 1e-6)?;
            y.linear(&x[5], None)?.cross_entropy(&x[6], -100)
        },
        |x| {
            let h = x[0].linear(&x[1], Some(&x[2]))?.silu()?; // [4, 3, 8] as S(0)S(2)
            let y = h.linear(&x[3], None)?; // [4, 3, 6] as S(0)P(sum)
            let y = y.add(&x[0])?.rms_norm(&x[4], 1e-6)?; // all_reduce, then S(0)R
            y.linear(&x[5], None)?.cross_entropy(&x[6], -100) // logits S(0)S(2)
        },
    )
    .unwrap();
}

/// A rank whose shard is empty (2 rows over 3 ranks) moves its generator by the full
/// tensor's count as its peers do, so the next random op (a replicated tensor's dropout)
/// draws the same mask on every rank.
#[test]
fn a_rank_with_an_empty_shard_stays_in_step() {
    let full = Tensor::ones([2, 4], DType::F64, Device::Cpu).unwrap();
    let next = Tensor::ones([40], DType::F64, Device::Cpu).unwrap();
    let drawn = run(&[3], |mesh, _| {
        manual_seed(1);
        let x = distribute_tensor(&full, mesh, &[Shard(0)])?;
        x.dropout(0.5, true)?;
        let y = distribute_tensor(&next, mesh, &[Replicate])?;
        Ok((tpar_tensor::get_rng_state(), y.dropout(0.5, true)?.local().to_vec::<f64>()?))
    });
    assert!(drawn.iter().all(|d| *d == drawn[0]), "{drawn:?}");
}
