//! Every collective on world sizes 1, 2, 3, 4 and 8, on awkward shapes (uneven and empty
//! shards) and every dtype, against a serial reference each rank computes from all ranks'
//! (regenerated) inputs.

mod common;

use common::*;
use proptest::prelude::*;
use tpar_collectives::{
    chunk_range, spawn_scoped, CollectiveError, CollectiveKind, ProcessGroup, ReduceOp, SpawnConfig,
};
use tpar_tensor::{DType, Device, Rng, Tensor};

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

/// Rank `r`'s input for case `case` (any rank can regenerate any rank's input).
fn input(case: u64, r: usize, dims: &[usize], dtype: DType) -> Tensor {
    let mut rng = Rng::new(case * 1000 + r as u64 + 7);
    rand_tensor(dims, dtype, &mut rng)
}

fn run_all_reduce(pg: &ProcessGroup, case: u64, rng: &mut Rng) {
    let n = pg.size();
    let dims = rand_dims(rng, n);
    for dtype in DTYPES {
        let inputs: Vec<Tensor> = (0..n).map(|r| input(case, r, &dims, dtype)).collect();
        for op in OPS {
            if op == ReduceOp::Avg && dtype == DType::I64 {
                continue;
            }
            let got = pg.all_reduce(&inputs[pg.rank()], op).unwrap();
            let what = format!("all_reduce({op}) {dtype} {dims:?} world {n}");
            check(&what, &got, &reduce_ref(&inputs, op), &dims, dtype);
            let out = Tensor::zeros(dims.clone(), dtype, Device::Cpu).unwrap();
            pg.all_reduce_into(&inputs[pg.rank()], op, &out).unwrap();
            check_exact(&format!("{what} into"), &out, &got);
        }
    }
}

fn run_reduce_scatter(pg: &ProcessGroup, case: u64, rng: &mut Rng) {
    let n = pg.size();
    let dims = rand_dims(rng, n);
    let dim = rng.below(dims.len() as u64) as usize;
    for dtype in DTYPES {
        let inputs: Vec<Tensor> = (0..n).map(|r| input(case, r, &dims, dtype)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
            if op == ReduceOp::Avg && dtype == DType::I64 {
                continue;
            }
            let got = pg.reduce_scatter(&inputs[pg.rank()], dim, op).unwrap();
            let full =
                Tensor::from_f64(&reduce_ref(&inputs, op), dims.clone(), DType::F64).unwrap();
            let want = chunk_of(&full, dim, n, pg.rank());
            let what = format!("reduce_scatter(dim {dim}, {op}) {dtype} {dims:?} world {n}");
            check(&what, &got, &want.to_vec_f64().unwrap(), want.dims(), dtype);
            let out = Tensor::zeros(got.dims().to_vec(), dtype, Device::Cpu).unwrap();
            pg.reduce_scatter_into(&inputs[pg.rank()], dim, op, &out).unwrap();
            check_exact(&format!("{what} into"), &out, &got);
        }
    }
}

fn run_all_gather(pg: &ProcessGroup, case: u64, rng: &mut Rng) {
    let n = pg.size();
    let base = rand_dims(rng, n);
    let dim = rng.below(base.len() as u64) as usize;
    // Uneven torch.chunk shards of a global size, or arbitrary per-rank sizes.
    let global = awkward_size(rng, n);
    let arbitrary = rng.below(2) == 0;
    let sizes: Vec<usize> = (0..n)
        .map(|r| if arbitrary { awkward_size(rng, n) } else { chunk_range(global, n, r).1 })
        .collect();
    for dtype in DTYPES {
        let inputs: Vec<Tensor> = (0..n)
            .map(|r| {
                let mut d = base.clone();
                d[dim] = sizes[r];
                input(case, r, &d, dtype)
            })
            .collect();
        let got = pg.all_gather(&inputs[pg.rank()], dim).unwrap();
        let want = Tensor::cat(&inputs, dim as isize).unwrap();
        check_exact(&format!("all_gather(dim {dim}) {dtype} sizes {sizes:?}"), &got, &want);
        let out = Tensor::zeros(want.dims().to_vec(), dtype, Device::Cpu).unwrap();
        pg.all_gather_into(&inputs[pg.rank()], dim, &out).unwrap();
        check_exact(&format!("all_gather_into(dim {dim}) {dtype} sizes {sizes:?}"), &out, &want);
    }
}

fn run_all_to_all(pg: &ProcessGroup, case: u64, rng: &mut Rng) {
    let n = pg.size();
    let me = pg.rank();
    let base = rand_dims(rng, n);
    let split = rng.below(base.len() as u64) as usize;
    let concat = rng.below(base.len() as u64) as usize;
    let concat_sizes: Vec<usize> = (0..n).map(|_| awkward_size(rng, n)).collect();
    for dtype in DTYPES {
        let inputs: Vec<Tensor> = (0..n)
            .map(|r| {
                let mut d = base.clone();
                d[concat] = concat_sizes[r];
                input(case, r, &d, dtype)
            })
            .collect();
        let got = pg.all_to_all(&inputs[me], split, concat).unwrap();
        let pieces: Vec<Tensor> = inputs.iter().map(|x| chunk_of(x, split, n, me)).collect();
        let want = Tensor::cat(&pieces, concat as isize).unwrap();
        let what = format!("all_to_all(split {split}, concat {concat}) {dtype} {base:?} world {n}");
        check_exact(&what, &got, &want);
    }
}

fn run_all_to_all_sizes(pg: &ProcessGroup, case: u64, rng: &mut Rng) {
    let n = pg.size();
    let me = pg.rank();
    let mut tail = rand_dims(rng, n);
    tail[0] = awkward_size(rng, n).max(1);
    // Each rank splits its own rows with its own sizes (all_to_all_single, uneven).
    let split_sizes: Vec<Vec<usize>> =
        (0..n).map(|_| (0..n).map(|_| rng.below(4) as usize).collect()).collect();
    let dtype = DTYPES[(case % 5) as usize];
    let inputs: Vec<Tensor> = (0..n)
        .map(|r| {
            let mut d = tail.clone();
            d.insert(0, split_sizes[r].iter().sum());
            input(case, r, &d, dtype)
        })
        .collect();
    let got = pg.all_to_all_sizes(&inputs[me], &split_sizes[me], 0, 0).unwrap();
    let pieces: Vec<Tensor> = (0..n)
        .map(|r| {
            let start: usize = split_sizes[r][..me].iter().sum();
            inputs[r].narrow(0, start, split_sizes[r][me]).unwrap()
        })
        .collect();
    let want = Tensor::cat(&pieces, 0).unwrap();
    check_exact(&format!("all_to_all_sizes {split_sizes:?} {dtype}"), &got, &want);
}

fn run_broadcast(pg: &ProcessGroup, case: u64, rng: &mut Rng) {
    let n = pg.size();
    let src = rng.below(n as u64) as usize;
    let dims = rand_dims(rng, n);
    for dtype in DTYPES {
        let x = input(case, src, &dims, dtype);
        // Non-source ranks pass a placeholder of another shape and dtype.
        let mine = if pg.rank() == src { x.clone() } else { Tensor::arange(1, DType::I64) };
        let got = pg.broadcast(&mine, src).unwrap();
        check_exact(&format!("broadcast(src {src}) {dtype} {dims:?}"), &got, &x);
        assert!(!got.same_storage(&x), "broadcast must return new storage");
    }
}

fn all_collectives(world: usize, cases: u64) {
    spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let dbg = ctx.comm_debug();
        dbg.enable();
        // Same shape stream on every rank.
        let mut rng = Rng::new(42 + world as u64);
        for case in 0..cases {
            run_all_reduce(&pg, case, &mut rng);
            run_reduce_scatter(&pg, case, &mut rng);
            run_all_gather(&pg, case, &mut rng);
            run_all_to_all(&pg, case, &mut rng);
            run_all_to_all_sizes(&pg, case, &mut rng);
            run_broadcast(&pg, case, &mut rng);
            pg.barrier()?;
        }
        // Per case: 48 all_reduce, 28 reduce_scatter, 10 all_gather (half of them
        // `*_into`), 6 all_to_all, 5 broadcast, 1 barrier.
        let per_case = [
            (CollectiveKind::AllReduce, 48),
            (CollectiveKind::ReduceScatter, 28),
            (CollectiveKind::AllGather, 10),
            (CollectiveKind::AllToAll, 6),
            (CollectiveKind::Broadcast, 5),
            (CollectiveKind::Barrier, 1),
        ];
        for (kind, k) in per_case {
            assert_eq!(dbg.count(kind), k * cases as usize, "{kind}");
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn world_1() {
    all_collectives(1, 12);
}

#[test]
fn world_2() {
    all_collectives(2, 12);
}

#[test]
fn world_3() {
    all_collectives(3, 12);
}

#[test]
fn world_4() {
    all_collectives(4, 12);
}

#[test]
fn world_8() {
    all_collectives(8, 8);
}

#[test]
fn reductions_are_bit_identical_across_ranks() {
    for world in WORLDS {
        let outs = spawn_scoped(
            SpawnConfig::new(world),
            |ctx| -> Result<Vec<Vec<f64>>, CollectiveError> {
                let pg = ctx.world_group();
                let mut v = Vec::new();
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    let x = input(9, ctx.rank(), &[37, 5], dtype);
                    v.push(pg.all_reduce(&x, ReduceOp::Sum)?.to_vec_f64()?);
                    v.push(pg.all_reduce(&x, ReduceOp::Avg)?.to_vec_f64()?);
                }
                Ok(v)
            },
        )
        .unwrap();
        for o in &outs[1..] {
            assert_eq!(o, &outs[0]);
        }
    }
}

#[test]
fn half_precision_accumulates_in_f32() {
    // A running bf16 sum would lose the small terms; accumulating in f32 and rounding
    // once gives the correctly rounded sum.
    spawn_scoped(SpawnConfig::new(8), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let v = if ctx.rank() == 0 { 256.0 } else { 1.0 };
        let x = Tensor::from_f64(&[v], [1], DType::BF16)?;
        let s = pg.all_reduce(&x, ReduceOp::Sum)?.item()?;
        // 256 + 7 = 263 rounds to 264 in bf16 (8 bits of mantissa); adding 1.0 seven times
        // in bf16 would stay at 256.
        assert_eq!(s, 264.0);
        Ok(())
    })
    .unwrap();
}

#[test]
fn inputs_are_untouched_and_outputs_are_fresh() {
    spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let x = input(1, ctx.rank(), &[4, 3], DType::F32);
        let before = x.to_vec::<f32>()?;
        let outs = [
            pg.all_reduce(&x, ReduceOp::Sum)?,
            pg.all_gather(&x, 1)?,
            pg.reduce_scatter(&x, 0, ReduceOp::Sum)?,
            pg.all_to_all(&x, 0, 1)?,
        ];
        assert_eq!(x.to_vec::<f32>()?, before);
        for o in &outs {
            assert!(!o.same_storage(&x));
            assert!(!o.requires_grad());
        }
        // Mutating our input right after a collective must not disturb the peers.
        for _ in 0..50 {
            let y = x.deep_clone()?;
            let g = pg.all_gather(&y, 0)?;
            y.with_data_mut::<f32, _>(|s| s.fill(f32::NAN))?;
            assert!(g.to_vec::<f32>()?.iter().all(|v| !v.is_nan()));
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn works_on_grad_tensors_under_no_grad_and_on_meta() {
    spawn_scoped(SpawnConfig::new(2), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let w = Tensor::ones([2, 2], DType::F32, Device::Cpu)?.requires_grad_(true);
        let y = w.mul_scalar(2.0)?; // non-leaf with history
        let s = pg.all_reduce(&y, ReduceOp::Sum)?;
        assert_eq!(s.to_vec::<f32>()?, vec![4.0; 4]);
        let g = tpar_tensor::no_grad(|| pg.all_gather(&w, 0))?;
        assert_eq!(g.dims(), &[4, 2]);
        // Meta tensors: shapes only.
        let m = Tensor::empty([3 + ctx.rank(), 4], DType::BF16, Device::Meta)?;
        let mg = pg.all_gather(&m, 0)?;
        assert_eq!((mg.dims(), mg.device()), (&[7usize, 4][..], Device::Meta));
        let mr =
            pg.reduce_scatter(&Tensor::empty([5, 2], DType::F32, Device::Meta)?, 0, ReduceOp::Sum)?;
        assert_eq!(mr.dims(), &[chunk_range(5, 2, ctx.rank()).1, 2]);
        let ma = pg.all_reduce(&m.narrow(0, 0, 3)?, ReduceOp::Max)?;
        assert_eq!(ma.dims(), &[3, 4]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn scalars_and_empty_tensors() {
    spawn_scoped(SpawnConfig::new(4), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let s = Tensor::scalar(ctx.rank() as f64, DType::F64);
        assert_eq!(pg.all_reduce(&s, ReduceOp::Sum)?.item()?, 6.0);
        assert_eq!(pg.all_reduce(&s, ReduceOp::Max)?.dims(), &[] as &[usize]);
        assert_eq!(pg.broadcast(&s, 3)?.item()?, 3.0);
        let e = Tensor::zeros([0, 3], DType::F16, Device::Cpu)?;
        assert_eq!(pg.all_reduce(&e, ReduceOp::Sum)?.dims(), &[0, 3]);
        assert_eq!(pg.all_gather(&e, 0)?.dims(), &[0, 3]);
        assert_eq!(pg.all_gather(&e, 1)?.dims(), &[0, 12]);
        let mine = chunk_range(3, 4, ctx.rank()).1;
        assert_eq!(pg.reduce_scatter(&e, 1, ReduceOp::Sum)?.dims(), &[0, mine]);
        assert_eq!(pg.all_to_all(&e, 1, 0)?.dims(), &[0, mine]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn large_all_reduce_staged_path_every_dtype_and_op() {
    // Big enough for the staged (reduce-scatter + gather) path, not divisible by world.
    for world in [3usize, 4] {
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let dims = [131, 127];
            for dtype in DTYPES {
                let inputs: Vec<Tensor> = (0..world).map(|r| input(77, r, &dims, dtype)).collect();
                for op in OPS {
                    if op == ReduceOp::Avg && dtype == DType::I64 {
                        continue;
                    }
                    let got = pg.all_reduce(&inputs[ctx.rank()], op)?;
                    let what = format!("staged all_reduce({op}) {dtype} world {world}");
                    check(&what, &got, &reduce_ref(&inputs, op), &dims, dtype);
                }
            }
            Ok(())
        })
        .unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Shard(dim) round trip: reduce_scatter of world copies, then all_gather, gives
    /// `world *` the input back, whatever the shape.
    #[test]
    fn reduce_scatter_then_all_gather_round_trips(
        world in 1usize..6,
        dims in proptest::collection::vec(0usize..7, 1..4),
        dim_pick in 0usize..3,
        seed in 0u64..1000,
    ) {
        let dim = dim_pick % dims.len();
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let x = rand_tensor(&dims, DType::F64, &mut Rng::new(seed));
            let shard = pg.reduce_scatter(&x, dim, ReduceOp::Sum)?;
            assert_eq!(shard.dims()[dim], chunk_range(dims[dim], world, ctx.rank()).1);
            let full = pg.all_gather(&shard, dim)?;
            let want: Vec<f64> = x.to_vec_f64()?.iter().map(|v| v * world as f64).collect();
            check("round trip", &full, &want, &dims, DType::F64);
            Ok(())
        }).unwrap();
    }
}

/// `*_into` writes into the caller's buffer: the same memory call after call (the direct
/// all_reduce of small tensors and the lent one of large tensors alike), bit-equal to the
/// out-of-place collectives.
#[test]
fn into_collectives_reuse_the_callers_buffer() {
    for (world, rows) in [(2, 4), (3, 4), (2, 64), (3, 64)] {
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let n = pg.size();
            let cols = 1024; // 4 Ki elements run direct, 64 Ki lent
            let out = Tensor::zeros([rows, cols], DType::F32, Device::Cpu)?;
            let gathered = Tensor::zeros([rows * n, cols], DType::F32, Device::Cpu)?;
            let chunk =
                Tensor::zeros([chunk_range(rows, n, pg.rank()).1, cols], DType::F32, Device::Cpu)?;
            let addr = |t: &Tensor| t.with_data::<f32, _>(|s| s.as_ptr() as usize).unwrap();
            let (a_out, a_gathered, a_chunk) = (addr(&out), addr(&gathered), addr(&chunk));
            for step in 0..3 {
                let mut rng = Rng::new(step * 10 + pg.rank() as u64);
                let x = rand_tensor(&[rows, cols], DType::F32, &mut rng);
                pg.all_reduce_into(&x, ReduceOp::Sum, &out)?;
                check_exact("all_reduce_into", &out, &pg.all_reduce(&x, ReduceOp::Sum)?);
                pg.all_gather_into(&x, 0, &gathered)?;
                check_exact("all_gather_into", &gathered, &pg.all_gather(&x, 0)?);
                pg.reduce_scatter_into(&x, 0, ReduceOp::Max, &chunk)?;
                check_exact(
                    "reduce_scatter_into",
                    &chunk,
                    &pg.reduce_scatter(&x, 0, ReduceOp::Max)?,
                );
                assert_eq!(
                    (addr(&out), addr(&gathered), addr(&chunk)),
                    (a_out, a_gathered, a_chunk)
                );
            }
            Ok(())
        })
        .unwrap();
    }
}

/// A wrong `out` (shape, dtype, or the input itself) fails every member's call without a
/// hang, and leaves `out` zeroed; the group works on afterwards.
#[test]
fn into_collectives_reject_a_wrong_out_on_every_member() {
    spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let x = Tensor::from_vec(vec![pg.rank() as f32 + 1.0; 6], [2, 3])?;
        let good = Tensor::from_vec(vec![7.0f32; 6], [2, 3])?;
        // Rank 1 alone passes a bad buffer; everyone's call fails.
        let bad = match pg.rank() {
            1 => Tensor::from_vec(vec![7.0f32; 3], [3])?,
            _ => good.clone(),
        };
        let e = pg.all_reduce_into(&x, ReduceOp::Sum, &bad).unwrap_err();
        assert!(
            matches!(e, CollectiveError::InvalidArgument { .. } | CollectiveError::Mismatch { .. }),
            "{e}"
        );
        // The bad buffer is left as it was; the good ones were lent to the failed call.
        let left = if pg.rank() == 1 { 7.0 } else { 0.0 };
        assert_eq!(bad.to_vec::<f32>()?, vec![left; bad.numel()]);
        let same = x.clone();
        assert!(pg.all_reduce_into(&x, ReduceOp::Sum, &same).is_err());
        assert_eq!(x.to_vec::<f32>()?, vec![pg.rank() as f32 + 1.0; 6], "the input is untouched");
        let f64_out = Tensor::zeros([2, 3], DType::F64, Device::Cpu)?;
        assert!(pg.all_reduce_into(&x, ReduceOp::Sum, &f64_out).is_err());
        // An all_gather's shape is known only from every member's size: checked on the result.
        let short = Tensor::zeros([5, 3], DType::F32, Device::Cpu)?;
        let e = pg.all_gather_into(&x, 0, &short).unwrap_err();
        assert!(e.to_string().contains("[6, 3]"), "{e}");
        // Still in step.
        pg.all_reduce_into(&x, ReduceOp::Sum, &good)?;
        assert_eq!(good.to_vec::<f32>()?, vec![6.0; 6]);
        Ok(())
    })
    .unwrap();
}

/// `all_reduce_` leaves in the tensor exactly what `all_reduce` returns, for every dtype
/// and op, below and above the in-place size and with uneven chunks; above it the result
/// is written into the tensor's own memory, which every handle on it sees.
#[test]
fn all_reduce_in_place_equals_all_reduce() {
    for world in [2, 3, 4] {
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let (n, r) = (pg.size(), pg.rank());
            // 1 << 14 elements is the in-place size; 4 * 12503 splits unevenly on 3 and 4.
            for (case, dims) in [vec![7, 3], vec![128, 128], vec![4, 12503]].iter().enumerate() {
                for dtype in DTYPES {
                    for op in OPS {
                        if op == ReduceOp::Avg && dtype == DType::I64 {
                            continue;
                        }
                        let case = case as u64 * 10 + 500;
                        let want = pg.all_reduce(&input(case, r, dims, dtype), op)?;
                        let t = input(case, r, dims, dtype);
                        let flat = t.reshape([t.numel()])?; // shares the storage
                        let addr = |t: &Tensor| {
                            tpar_tensor::with_any_type!(dtype, |T| {
                                t.with_data::<T, _>(|s| s.as_ptr() as usize).unwrap()
                            })
                        };
                        let before = addr(&t);
                        pg.all_reduce_(&t, op)?;
                        let what = format!("all_reduce_({op}) {dtype} {dims:?} world {n}");
                        check_exact(&what, &t, &want);
                        check_exact(&what, &flat.reshape(dims.clone())?, &want);
                        if t.numel() >= 1 << 14 {
                            assert_eq!(addr(&t), before, "{what}: not in place");
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    }
}

/// `all_reduce_into` leaves in `out` exactly what `all_reduce` returns, for every dtype
/// and op, below and above the size from which members write into each other's `out`
/// (with uneven chunks), and at sizes whose outputs are written with streaming stores
/// (odd element counts, so chunks start off any alignment); `out` keeps its memory.
#[test]
fn all_reduce_into_equals_all_reduce() {
    for world in [2, 3, 4] {
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let (n, r) = (pg.size(), pg.rank());
            let mut cases: Vec<(Vec<usize>, DType, ReduceOp)> = Vec::new();
            for dims in [vec![7, 3], vec![128, 128], vec![4, 12503]] {
                for dtype in DTYPES {
                    for op in OPS {
                        if !(op == ReduceOp::Avg && dtype == DType::I64) {
                            cases.push((dims.clone(), dtype, op));
                        }
                    }
                }
            }
            // 16 MiB and a little more: streamed.
            cases.push((vec![(4 << 20) + 7], DType::F32, ReduceOp::Sum));
            cases.push((vec![(8 << 20) + 3], DType::BF16, ReduceOp::Max));
            for (case, (dims, dtype, op)) in cases.into_iter().enumerate() {
                let case = case as u64 + 700;
                let x = input(case, r, &dims, dtype);
                let want = pg.all_reduce(&x, op)?;
                let out = Tensor::zeros(dims.clone(), dtype, Device::Cpu)?;
                let addr = |t: &Tensor| {
                    tpar_tensor::with_any_type!(dtype, |T| {
                        t.with_data::<T, _>(|s| s.as_ptr() as usize).unwrap()
                    })
                };
                let before = addr(&out);
                pg.all_reduce_into(&x, op, &out)?;
                let what = format!("all_reduce_into({op}) {dtype} {dims:?} world {n}");
                check_exact(&what, &out, &want);
                check_exact(&format!("{what}: input"), &x, &input(case, r, &dims, dtype));
                assert_eq!(addr(&out), before, "{what}: not into `out`");
            }
            Ok(())
        })
        .unwrap();
    }
}

/// Outputs of 16 MiB and more are written with streaming stores: `all_gather` and
/// `all_gather_into` still equal the concatenation, gathering along the leading dim (one
/// run per member) and an inner one (many short runs, each starting off any alignment),
/// with uneven shards.
#[test]
fn large_all_gathers_equal_the_concatenation() {
    for world in [2, 3] {
        spawn_scoped(SpawnConfig::new(world), |ctx| -> Result<(), CollectiveError> {
            let pg = ctx.world_group();
            let (n, r) = (pg.size(), pg.rank());
            // f32: (4 Mi + 13) rows of 1 (dim 0); bf16: [1031, 2 Ki + 7] along dim 1.
            let cases: [(DType, Vec<usize>, usize); 2] = [
                (DType::F32, vec![(4 << 20) + 13, 1], 0),
                (DType::BF16, vec![1031, (8 << 10) + 7], 1),
            ];
            for (case, (dtype, global, dim)) in cases.into_iter().enumerate() {
                let inputs: Vec<Tensor> = (0..n)
                    .map(|k| {
                        let mut d = global.clone();
                        d[dim] = chunk_range(global[dim], n, k).1;
                        input(case as u64 + 900, k, &d, dtype)
                    })
                    .collect();
                let want = Tensor::cat(&inputs, dim as isize)?;
                let what = format!("all_gather(dim {dim}) {dtype} {global:?} world {n}");
                check_exact(&what, &pg.all_gather(&inputs[r], dim)?, &want);
                let out = Tensor::zeros(want.dims().to_vec(), dtype, Device::Cpu)?;
                pg.all_gather_into(&inputs[r], dim, &out)?;
                check_exact(&format!("{what} into"), &out, &want);
            }
            Ok(())
        })
        .unwrap();
    }
}

/// Members may mix `all_reduce_into` with `all_reduce` and `all_reduce_`, or pass inputs
/// that share storage: every member still ends with the result.
#[test]
fn all_reduce_into_mixes_with_other_calls_and_shared_inputs() {
    let shared = Tensor::from_vec(vec![1.5f32; 1 << 15], [1 << 15]).unwrap();
    spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let r = pg.rank();
        let x = || Tensor::from_vec(vec![r as f32 + 1.0; 1 << 15], [1 << 15]);
        let out = Tensor::zeros([1 << 15], DType::F32, Device::Cpu)?;
        let t = x()?;
        match r {
            0 => assert_eq!(pg.all_reduce(&t, ReduceOp::Sum)?.to_vec::<f32>()?, vec![6.0; 1 << 15]),
            1 => {
                pg.all_reduce_(&t, ReduceOp::Sum)?;
                assert_eq!(t.to_vec::<f32>()?, vec![6.0; 1 << 15]);
            }
            _ => {
                pg.all_reduce_into(&t, ReduceOp::Sum, &out)?;
                assert_eq!(out.to_vec::<f32>()?, vec![6.0; 1 << 15]);
            }
        }
        // Ranks 0 and 2 pass the same input, rank 1 its own.
        let t = if r == 1 { x()? } else { shared.clone() };
        pg.all_reduce_into(&t, ReduceOp::Sum, &out)?;
        assert_eq!(out.to_vec::<f32>()?, vec![5.0; 1 << 15]);
        assert_eq!(t.to_vec::<f32>()?[0], if r == 1 { 2.0 } else { 1.5 }, "input kept");
        Ok(())
    })
    .unwrap();
}

/// Members may mix `all_reduce_` with `all_reduce`, or pass tensors that share storage:
/// the in-place members still end with the result.
#[test]
fn all_reduce_in_place_mixes_with_all_reduce_and_shared_storage() {
    let shared = Tensor::from_vec(vec![1.5f32; 1 << 15], [1 << 15]).unwrap();
    spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let r = pg.rank();
        let x = || Tensor::from_vec(vec![r as f32 + 1.0; 1 << 15], [1 << 15]);
        let t = x()?;
        if r == 1 {
            assert_eq!(pg.all_reduce(&t, ReduceOp::Sum)?.to_vec::<f32>()?, vec![6.0; 1 << 15]);
            assert_eq!(t.to_vec::<f32>()?, vec![2.0; 1 << 15], "all_reduce left its input");
        } else {
            pg.all_reduce_(&t, ReduceOp::Sum)?;
            assert_eq!(t.to_vec::<f32>()?, vec![6.0; 1 << 15]);
        }
        // Ranks 0 and 2 pass the same tensor, rank 1 its own.
        let t = if r == 1 { x()? } else { shared.clone() };
        pg.all_reduce_(&t, ReduceOp::Sum)?;
        assert_eq!(t.to_vec::<f32>()?, vec![5.0; 1 << 15]);
        Ok(())
    })
    .unwrap();
}

/// A wrong shape, or a tensor without data, on one member fails every member's
/// `all_reduce_` without a hang, leaves the other members' tensors as they were, and
/// the group goes on.
#[test]
fn all_reduce_in_place_rejects_bad_input_on_every_member() {
    spawn_scoped(SpawnConfig::new(3), |ctx| -> Result<(), CollectiveError> {
        let pg = ctx.world_group();
        let r = pg.rank();
        let x = |len: usize| Tensor::from_vec(vec![r as f32 + 1.0; len], [len]);
        let t = if r == 1 { x(1 << 14)? } else { x(1 << 15)? };
        let e = pg.all_reduce_(&t, ReduceOp::Sum).unwrap_err();
        assert!(matches!(e, CollectiveError::Mismatch { rank: 1, .. }), "{e}");
        assert_eq!(t.to_vec::<f32>()?, vec![r as f32 + 1.0; t.numel()]);
        let t = x(1 << 15)?;
        if r == 1 {
            t.release_storage_();
        }
        let e = pg.all_reduce_(&t, ReduceOp::Sum).unwrap_err();
        let named = if r == 1 { "released" } else { "rank 1" };
        assert!(e.to_string().contains(named), "{e}");
        if r != 1 {
            assert_eq!(t.to_vec::<f32>()?, vec![r as f32 + 1.0; 1 << 15], "values kept");
        }
        let t = x(1 << 15)?;
        pg.all_reduce_(&t, ReduceOp::Max)?;
        assert_eq!(t.to_vec::<f32>()?, vec![3.0; 1 << 15]);
        Ok(())
    })
    .unwrap();
}
