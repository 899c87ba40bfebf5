//! DTensor: distribute -> redistribute -> full_tensor round trips on random layouts
//! (`Partial` of every reduce op, with terms that differ per rank, reduced by a
//! collective with that op), gradients through redistribute equal the unsharded ones
//! (typed errors where a max/min partial has none), exact collective counts, and typed
//! errors for bad input.

use std::time::Duration;

use proptest::prelude::*;
use tpar_collectives::{spawn_scoped, CollectiveKind, SpawnConfig};
use tpar_dtensor::{distribute_tensor, DTensor, DTensorError, Placement, ReduceOp};
use tpar_mesh::{DeviceMesh, DeviceType};
use tpar_tensor::{tol::Tol, DType, Rng, Tensor};

use Placement::{Partial, Replicate, Shard};

fn run<R: Send>(
    mesh_shape: &[usize],
    f: impl Fn(&DeviceMesh, usize) -> Result<R, DTensorError> + Sync,
) -> Vec<R> {
    let n: usize = mesh_shape.iter().product();
    let names: Vec<String> = (0..mesh_shape.len()).map(|i| format!("d{i}")).collect();
    let cfg = SpawnConfig::new(n).timeout(Duration::from_secs(20));
    spawn_scoped(cfg, |ctx| {
        let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, mesh_shape, &names)?;
        f(&mesh, ctx.rank())
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

fn placement(code: u8, rank: usize) -> Placement {
    match code % 8 {
        0..=2 if rank > 0 => Shard((code as usize / 8 % rank) as isize),
        3 => Partial(ReduceOp::Sum),
        4 => Partial(ReduceOp::Avg),
        5 => Partial(ReduceOp::Max),
        6 => Partial(ReduceOp::Min),
        _ => Replicate,
    }
}

/// `codes` as placements for a tensor of `rank` dims; a `Partial` whose op does not
/// commute with an earlier one in the list becomes `Replicate` (such lists have no
/// order-independent value).
fn placement_list(codes: &[u8], ndim: usize, rank: usize) -> Vec<Placement> {
    let mut out: Vec<Placement> = Vec::with_capacity(ndim);
    for &code in &codes[..ndim] {
        let p = match placement(code, rank) {
            Partial(op) if out.iter().any(|q| matches!(q, Partial(o) if !o.commutes_with(op))) => {
                Replicate
            }
            p => p,
        };
        out.push(p);
    }
    out
}

/// Whether the backward of a redistribution between these placements is defined: only
/// `Partial(sum)` and `Partial(avg)` are differentiable.
fn differentiable(ps: &[Placement]) -> bool {
    !ps.iter().any(|p| matches!(p, Partial(ReduceOp::Max | ReduceOp::Min)))
}

/// Per-rank offsets that make the `Partial` terms of `placements` differ from rank to
/// rank while their reduction stays the value: for each mesh dim `i` with a `Partial`,
/// one global tensor per coordinate along `i`. `sum`/`avg`: random tensors summing to
/// zero elementwise. `max`/`min`: `-|n|` / `+|n|`, exactly zero at one randomly chosen
/// coordinate per element (the term that wins the reduction is the value itself).
fn partial_offsets(
    mesh_shape: &[usize],
    shape: &[usize],
    placements: &[Placement],
    rng: &mut Rng,
) -> Vec<Option<Vec<Tensor>>> {
    let numel: usize = shape.iter().product();
    placements
        .iter()
        .zip(mesh_shape)
        .map(|(p, &k)| {
            let Partial(op) = p else { return None };
            let mut terms: Vec<Vec<f64>> =
                (0..k).map(|_| (0..numel).map(|_| rng.normal()).collect()).collect();
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    for e in 0..numel {
                        let rest: f64 = terms[..k - 1].iter().map(|t| t[e]).sum();
                        terms[k - 1][e] = -rest;
                    }
                }
                ReduceOp::Product => unreachable!("Partial(product) is not a placement"),
                ReduceOp::Max | ReduceOp::Min => {
                    let sign = if *op == ReduceOp::Max { -1.0 } else { 1.0 };
                    for e in 0..numel {
                        let winner = rng.below(k as u64) as usize;
                        for (c, t) in terms.iter_mut().enumerate() {
                            t[e] = if c == winner { 0.0 } else { sign * (t[e].abs() + 0.25) };
                        }
                    }
                }
            }
            let tensors =
                terms.into_iter().map(|t| Tensor::from_vec(t, shape.to_vec()).unwrap()).collect();
            Some(tensors)
        })
        .collect()
}

/// This rank's term of `x` laid out as `placements`, made distinct per rank on
/// `Partial` dims by `offsets` (see [`partial_offsets`]); a new leaf.
fn distinct_terms(
    x: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
    offsets: &[Option<Vec<Tensor>>],
) -> Result<DTensor, DTensorError> {
    let sliced: Vec<Placement> =
        placements.iter().map(|p| if p.is_partial() { Replicate } else { *p }).collect();
    let mut term = distribute_tensor(x, mesh, placements)?.to_local();
    for (i, off) in offsets.iter().enumerate() {
        if let Some(off) = off {
            let piece = distribute_tensor(&off[mesh.coordinate()[i]], mesh, &sliced)?.to_local();
            term = term.add(&piece)?;
        }
    }
    DTensor::from_local(&term.requires_grad_(true), mesh, placements, Some(x.dims()))
}

fn meshes() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![(1usize..=4).prop_map(|k| vec![k]), Just(vec![2, 2]), Just(vec![2, 3])]
}

fn shapes() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..7, 1..=3)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// from_local(distinct terms as src) -> redistribute(dst) -> full_tensor is the
    /// original for every placement (`Partial` of each reduce op included, with terms
    /// that differ per rank, so the op's reduction decides the value); every `Partial`
    /// of src that dst changes is reduced by a collective with its own op. Where src and
    /// dst have only sum/avg partials, the gradient of sum(full * w) reaching the leaf is
    /// w, laid out as src; with a max/min partial the backward is a typed
    /// `NotDifferentiable` error.
    #[test]
    fn redistribute_round_trips_with_gradients(
        mesh_shape in meshes(),
        shape in shapes(),
        src_codes in prop::collection::vec(any::<u8>(), 2),
        dst_codes in prop::collection::vec(any::<u8>(), 2),
        seed in any::<u64>(),
    ) {
        let (n, r) = (mesh_shape.len(), shape.len());
        let src = placement_list(&src_codes, n, r);
        let dst = placement_list(&dst_codes, n, r);
        let mut rng = Rng::new(seed);
        let x = Tensor::randn(shape.clone(), DType::F64, &mut rng).unwrap();
        let w = Tensor::randn(shape.clone(), DType::F64, &mut rng).unwrap();
        let offsets = partial_offsets(&mesh_shape, &shape, &src, &mut rng);
        let smooth = differentiable(&src) && differentiable(&dst);
        let outs = run(&mesh_shape, |mesh, _| {
            let d = distinct_terms(&x, mesh, &src, &offsets)?;
            let dbg = mesh.group(0)?.comm_debug();
            dbg.enable();
            let moved = d.redistribute(&dst)?;
            dbg.disable();
            let forward_ops: Vec<_> = dbg.take().iter().filter_map(|rec| rec.op).collect();
            let full = moved.full_tensor()?;
            let loss = full.mul(&w)?.sum_all()?;
            let rep = vec![Replicate; mesh.ndim()];
            let backward = DTensor::from_local(&loss, mesh, &rep, Some(&[]))?.backward();
            let grad = match backward {
                Ok(()) => {
                    let g = d.grad()?.expect("a gradient");
                    assert_eq!(g.placements(), d.placements());
                    Ok(g.full_tensor()?.to_vec_f64()?)
                }
                Err(e) => Err(e),
            };
            Ok((full.to_vec_f64()?, grad, forward_ops, moved.to_local().dims().to_vec(), moved.spec().local_shape_and_offset()?.0))
        });
        let tol = Tol::for_dtype(DType::F64);
        let what = format!("{src:?} -> {dst:?} on mesh {mesh_shape:?}, shape {shape:?}");
        for (full, grad, forward_ops, local, want_local) in outs {
            tol.check(&format!("{what}: round trip"), &full, &x.to_vec_f64().unwrap()).unwrap();
            for (i, (s, t)) in src.iter().zip(&dst).enumerate() {
                if let (Partial(op), true) = (s, s != t && mesh_shape[i] > 1) {
                    prop_assert!(
                        forward_ops.contains(op),
                        "{}: no {} collective in the forward ({:?})", what, op, forward_ops
                    );
                }
            }
            match grad {
                Ok(grad) => {
                    prop_assert!(smooth, "{}: backward through a max/min partial succeeded", what);
                    tol.check(&format!("{what}: gradient"), &grad, &w.to_vec_f64().unwrap()).unwrap();
                }
                Err(DTensorError::NotDifferentiable { placement, .. }) => {
                    prop_assert!(!smooth, "{}: {} reported not differentiable", what, placement);
                    prop_assert!(placement == "P(max)" || placement == "P(min)", "{}: {}", what, placement);
                }
                Err(e) => prop_assert!(false, "{}: backward failed: {}", what, e),
            }
            prop_assert_eq!(local, want_local);
        }
    }
}

/// Each reduce op over distinct per-rank terms on 3 ranks: `P(op) -> R` is one
/// all_reduce and `P(op) -> S(0)` one reduce_scatter, each with the op itself, and the
/// value is the op's reduction of the terms. The backward of `P(sum|avg) -> R` hands
/// each term its gradient (`w`, or `w / 3` for avg); for `P(max|min)` it is a typed
/// `NotDifferentiable` error.
#[test]
fn every_partial_op_reduces_distinct_terms_through_its_own_collective() {
    let terms: [[f64; 6]; 3] = [
        [1.0, -2.0, 0.5, 4.0, -3.0, 0.0],
        [3.0, -1.0, -0.5, 2.0, 1.0, -1.0],
        [-2.0, 5.0, 0.25, 1.0, 2.0, 7.0],
    ];
    let w = [0.5, -1.0, 2.0, 1.5, -0.25, 3.0];
    for op in ReduceOp::PARTIAL {
        let want: Vec<f64> = (0..6)
            .map(|e| {
                let col = terms.iter().map(|t| t[e]);
                match op {
                    ReduceOp::Sum => col.sum(),
                    ReduceOp::Avg => col.sum::<f64>() / 3.0,
                    ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
                    ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
                    ReduceOp::Product => unreachable!("Partial(product) is not a placement"),
                }
            })
            .collect();
        let out = run(&[3], |mesh, rank| {
            let dbg = mesh.group(0)?.comm_debug();
            let term = Tensor::from_vec(terms[rank].to_vec(), [6])?.requires_grad_(true);
            let d = DTensor::from_local(&term, mesh, &[Partial(op)], Some(&[6]))?;
            dbg.enable();
            let rep = d.redistribute(&[Replicate])?;
            let shard = d.redistribute(&[Shard(0)])?;
            dbg.disable();
            let recs = dbg.take();
            let kinds: Vec<_> = recs.iter().map(|r| (r.kind, r.op, r.dtype, r.bytes)).collect();
            let loss = rep.to_local().mul(&Tensor::from_vec(w.to_vec(), [6])?)?.sum_all()?;
            let backward = DTensor::from_local(&loss, mesh, &[Replicate], Some(&[]))?.backward();
            let grad = match backward {
                Ok(()) => Ok(term.grad().expect("a gradient").to_vec_f64()?),
                Err(e) => Err(e),
            };
            Ok((rep.to_local().to_vec_f64()?, shard.to_local().to_vec_f64()?, kinds, grad))
        });
        let cop = Some(op);
        for (rank, (rep, shard, kinds, grad)) in out.into_iter().enumerate() {
            let what = format!("P({op}) rank {rank}");
            assert_eq!(
                kinds,
                vec![
                    (CollectiveKind::AllReduce, cop, Some(DType::F64), 48),
                    (CollectiveKind::ReduceScatter, cop, Some(DType::F64), 48),
                ],
                "{what}"
            );
            let tol = Tol::for_dtype(DType::F64);
            tol.check(&format!("{what} -> R"), &rep, &want).unwrap();
            tol.check(&format!("{what} -> S(0)"), &shard, &want[2 * rank..2 * rank + 2]).unwrap();
            match (op, grad) {
                (ReduceOp::Sum, Ok(g)) => tol.check(&what, &g, &w).unwrap(),
                (ReduceOp::Avg, Ok(g)) => {
                    let third: Vec<f64> = w.iter().map(|v| v / 3.0).collect();
                    tol.check(&what, &g, &third).unwrap()
                }
                (
                    ReduceOp::Max | ReduceOp::Min,
                    Err(DTensorError::NotDifferentiable { placement, .. }),
                ) => {
                    assert_eq!(placement, format!("P({op})"), "{what}")
                }
                (_, other) => panic!("{what}: backward gave {other:?}"),
            }
        }
    }
}

#[test]
fn collective_counts_forward_and_backward() {
    let cases: [(&[Placement], &[Placement], CollectiveKind, CollectiveKind); 3] = [
        (&[Shard(0)], &[Replicate], CollectiveKind::AllGather, CollectiveKind::ReduceScatter),
        (
            &[Partial(ReduceOp::Sum)],
            &[Shard(0)],
            CollectiveKind::ReduceScatter,
            CollectiveKind::AllGather,
        ),
        (&[Shard(0)], &[Shard(1)], CollectiveKind::AllToAll, CollectiveKind::AllToAll),
    ];
    for (src, dst, fwd, bwd) in cases {
        let counts = run(&[3], |mesh, _| {
            let dbg = mesh.group(0)?.comm_debug();
            dbg.enable();
            let x =
                Tensor::ones([7, 5], DType::F32, tpar_tensor::Device::Cpu)?.requires_grad_(true);
            let d = DTensor::from_local(
                &distribute_tensor(&x, mesh, src)?.to_local(),
                mesh,
                src,
                Some(&[7, 5]),
            )?;
            let d = DTensor::from_local(
                &d.to_local().detach().requires_grad_(true),
                mesh,
                src,
                Some(&[7, 5]),
            )?;
            dbg.clear();
            let out = d.redistribute(dst)?;
            let f = (dbg.total(), dbg.count(fwd));
            dbg.clear();
            out.to_local().sum_all()?.backward()?;
            Ok((f, (dbg.total(), dbg.count(bwd))))
        });
        for (f, b) in counts {
            assert_eq!(f, (1, 1), "{src:?} -> {dst:?} forward");
            assert_eq!(b, (1, 1), "{src:?} -> {dst:?} backward");
        }
    }
    // Replicate -> Shard(0) is a local slice both ways: no communication at all.
    let none = run(&[2], |mesh, _| {
        let dbg = mesh.group(0)?.comm_debug();
        dbg.enable();
        let x = Tensor::ones([5, 2], DType::F32, tpar_tensor::Device::Cpu)?;
        let d = distribute_tensor(&x.requires_grad_(true), mesh, &[Replicate])?;
        dbg.clear();
        d.redistribute(&[Shard(0)])?.to_local().sum_all()?.backward()?;
        Ok(dbg.total())
    });
    assert_eq!(none, vec![0, 0]);
}

#[test]
fn from_local_computes_uneven_global_shapes() {
    // 9 rows over a 2x2 mesh as [S(0), S(0)]: local rows 3, 2, 2, 2.
    let out = run(&[2, 2], |mesh, rank| {
        let rows = [3, 2, 2, 2][rank];
        let local = Tensor::zeros([rows, 4], DType::F32, tpar_tensor::Device::Cpu)?;
        let d = DTensor::from_local(&local, mesh, &[Shard(0), Shard(0)], None)?;
        let c = DTensor::from_local_checked(&local, mesh, &[Shard(0), Shard(0)])?;
        Ok((d.shape().to_vec(), c.shape().to_vec()))
    });
    assert!(out.iter().all(|(a, b)| a == &vec![9, 4] && b == &vec![9, 4]));
}

#[test]
fn bad_input_is_a_typed_error() {
    let msgs = run(&[2], |mesh, rank| {
        let x = Tensor::zeros([4, 4], DType::F32, tpar_tensor::Device::Cpu)?;
        let dim = distribute_tensor(&x, mesh, &[Shard(2)]).unwrap_err().to_string();
        let count = distribute_tensor(&x, mesh, &[Shard(0), Replicate]).unwrap_err().to_string();
        // Rank 1's shard has the wrong width.
        let local = Tensor::zeros(
            [2, if rank == 1 { 3 } else { 4 }],
            DType::F32,
            tpar_tensor::Device::Cpu,
        )?;
        let checked =
            DTensor::from_local_checked(&local, mesh, &[Shard(0)]).unwrap_err().to_string();
        let given = DTensor::from_local(&local, mesh, &[Shard(0)], Some(&[4, 4]))
            .err()
            .map(|e| e.to_string());
        Ok((dim, count, checked, given))
    });
    let (dim, count, checked, _) = &msgs[0];
    assert!(dim.contains("tensor dim 2 out of range"), "{dim}");
    assert!(count.contains("2 placements for the 1-d mesh"), "{count}");
    assert!(
        checked.contains("rank 1 differs")
            && checked.contains("shard has shape [2, 3]")
            && checked.contains("[2, 4]"),
        "{checked}"
    );
    assert!(msgs[0].3.is_none());
    assert!(msgs[1].3.as_deref().is_some_and(|m| m.contains("rank 1")));
}

#[test]
fn strict_mode_rejects_implicit_redistribution_and_trace_records_it() {
    let out = run(&[2], |mesh, _| {
        let x = Tensor::zeros([4, 2], DType::F32, tpar_tensor::Device::Cpu)?;
        let d = distribute_tensor(&x, mesh, &[Shard(0)])?;
        let err = tpar_dtensor::strict(|| {
            d.redistribute_implicit("matmul", "lhs", &[Replicate]).unwrap_err().to_string()
        });
        tpar_dtensor::take_implicit_redistributions();
        d.redistribute_implicit("matmul", "lhs", &[Replicate])?;
        Ok((err, tpar_dtensor::implicit_redistributions()))
    });
    let (err, trace) = &out[0];
    assert!(err.contains("matmul") && err.contains("S(0) -> R") && err.contains("strict"), "{err}");
    assert_eq!(trace.len(), 1);
    assert_eq!(
        (trace[0].op, trace[0].from.as_str(), trace[0].to.as_str()),
        ("matmul", "S(0)", "R")
    );
}

/// The record of remembered local shards (`local_layout`) holds only tensors some
/// handle still holds: a loop that remembers a shard and drops it, many thousands of
/// times, leaves the record at a few dozen entries, and a shard kept alive all along is
/// still known at the end, as is a residual sum of it.
#[test]
fn remembered_local_layouts_are_kept_while_their_tensors_live() {
    use tpar_dtensor::local_layout;
    let out = run(&[2], |mesh, _| {
        let shard = |v: f32| Tensor::full([3, 2], v as f64, DType::F32, tpar_tensor::Device::Cpu);
        let keep = DTensor::from_local(&shard(1.0)?, mesh, &[Shard(0)], Some(&[6, 2]))?;
        let kept = local_layout::remember(&keep);
        let mut most = 0;
        for i in 0..10_000 {
            let d = DTensor::from_local(&shard(i as f32)?, mesh, &[Shard(0)], Some(&[6, 2]))?;
            let t = local_layout::remember(&d);
            let sum = t.add(&t)?;
            local_layout::propagate(&sum, &[&t, &t]);
            most = most.max(local_layout::recorded());
        }
        let residual = kept.add(&kept)?;
        local_layout::propagate(&residual, &[&kept, &kept]);
        Ok((
            most,
            local_layout::known_shape(&kept, mesh, &[Shard(0)]),
            local_layout::known_shape(&residual, mesh, &[Shard(0)]),
        ))
    });
    for (rank, (most, kept, residual)) in out.into_iter().enumerate() {
        assert!(most <= 128, "rank {rank}: the record grew to {most} entries for 3 live tensors");
        assert_eq!(kept.as_deref(), Some(&[6usize, 2][..]), "rank {rank}: the kept shard");
        assert_eq!(residual.as_deref(), Some(&[6usize, 2][..]), "rank {rank}: its residual sum");
    }
}

/// The implicit-redistribution trace keeps the latest `IMPLICIT_TRACE_LIMIT` records, so
/// a loop that redistributes on every step holds a bounded trace.
#[test]
fn the_implicit_redistribution_trace_keeps_the_latest_records() {
    use tpar_dtensor::{implicit_redistributions, IMPLICIT_TRACE_LIMIT};
    let n = IMPLICIT_TRACE_LIMIT + 300;
    let out = run(&[2], |mesh, _| {
        let x = Tensor::zeros([4, 2], DType::F32, tpar_tensor::Device::Cpu)?;
        let d = distribute_tensor(&x, mesh, &[Shard(0)])?;
        tpar_dtensor::take_implicit_redistributions();
        for i in 0..n {
            d.redistribute_implicit("matmul", &format!("lhs {i}"), &[Replicate])?;
        }
        let trace = implicit_redistributions();
        let taken = tpar_dtensor::take_implicit_redistributions();
        Ok((trace, taken.len(), implicit_redistributions().len()))
    });
    for (trace, taken, after) in out {
        assert_eq!(trace.len(), IMPLICIT_TRACE_LIMIT);
        assert_eq!(trace[0].operand, format!("lhs {}", n - IMPLICIT_TRACE_LIMIT));
        assert_eq!(trace.last().unwrap().operand, format!("lhs {}", n - 1));
        assert_eq!((taken, after), (IMPLICIT_TRACE_LIMIT, 0));
    }
}
