//! DTensor: distribute -> redistribute -> full_tensor round trips on random layouts,
//! gradients through redistribute equal the unsharded ones, exact collective counts,
//! and typed errors for bad input.

use std::time::Duration;

use proptest::prelude::*;
use tpar_collectives::{spawn_with, CollectiveKind, SpawnConfig};
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
    spawn_with(cfg, |ctx| {
        let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, mesh_shape, &names)?;
        f(&mesh, ctx.rank())
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

fn placement(code: u8, rank: usize) -> Placement {
    match code % 4 {
        0 | 1 if rank > 0 => Shard((code as usize / 4 % rank) as isize),
        2 => Partial(ReduceOp::Sum),
        _ => Replicate,
    }
}

fn meshes() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![(1usize..=4).prop_map(|k| vec![k]), Just(vec![2, 2]), Just(vec![2, 3])]
}

fn shapes() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..7, 1..=3)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// distribute(src) -> redistribute(dst) -> full_tensor is the original, and the
    /// gradient of sum(full * w) reaching the sharded leaf is w, laid out as src.
    #[test]
    fn redistribute_round_trips_with_gradients(
        mesh_shape in meshes(),
        shape in shapes(),
        src_codes in prop::collection::vec(any::<u8>(), 2),
        dst_codes in prop::collection::vec(any::<u8>(), 2),
        seed in any::<u64>(),
    ) {
        let r = shape.len();
        let src: Vec<Placement> = (0..mesh_shape.len()).map(|i| placement(src_codes[i], r)).collect();
        let dst: Vec<Placement> = (0..mesh_shape.len()).map(|i| placement(dst_codes[i], r)).collect();
        let mut rng = Rng::new(seed);
        let x = Tensor::randn(shape.clone(), DType::F64, &mut rng).unwrap();
        let w = Tensor::randn(shape.clone(), DType::F64, &mut rng).unwrap();
        let outs = run(&mesh_shape, |mesh, _| {
            let d = distribute_tensor(&x.clone().requires_grad_(true), mesh, &src)?;
            let moved = d.redistribute(&dst)?;
            let full = moved.full_tensor()?;
            let loss = full.mul(&w)?.sum_all()?;
            let rep = vec![Replicate; mesh.ndim()];
            DTensor::from_local(&loss, mesh, &rep, Some(&[]))?.backward()?;
            let g = d.grad()?.expect("a gradient");
            assert_eq!(g.placements(), d.placements());
            Ok((full.to_vec_f64()?, g.full_tensor()?.to_vec_f64()?, moved.to_local().dims().to_vec(), moved.spec().local_shape_and_offset()?.0))
        });
        let tol = Tol::for_dtype(DType::F64);
        for (full, grad, local, want_local) in outs {
            tol.check("round trip", &full, &x.to_vec_f64().unwrap()).unwrap();
            tol.check("gradient", &grad, &w.to_vec_f64().unwrap()).unwrap();
            prop_assert_eq!(local, want_local);
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
        checked.contains("rank 1 holds a local shard of shape [2, 3]")
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
