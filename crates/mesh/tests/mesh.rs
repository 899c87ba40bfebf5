//! DeviceMesh layouts, per-dim groups running concurrently, slicing, flattening, errors.

use std::time::Duration;

use tpar_collectives::{spawn, spawn_with, ReduceOp, SpawnConfig};
use tpar_mesh::{DeviceMesh, DeviceType, MeshError};
use tpar_tensor::Tensor;

#[test]
fn row_major_layout_and_groups_2x3() {
    let out = spawn(6, |ctx| -> Result<_, MeshError> {
        let mesh = DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 3], &["dp", "tp"])?;
        let x = Tensor::from_vec(vec![ctx.rank() as f64], [1])?;
        // Row (tp) and column (dp) groups run at once without crosstalk.
        let tp_sum = mesh["tp"].group(0)?.all_reduce(&x, ReduceOp::Sum)?.item()?;
        let dp_sum = mesh.group_of("dp")?.all_reduce(&x, ReduceOp::Sum)?.item()?;
        Ok((
            mesh.coordinate().to_vec(),
            mesh["tp"].ranks().to_vec(),
            mesh["dp"].ranks().to_vec(),
            tp_sum,
            dp_sum,
        ))
    })
    .unwrap();
    for (r, (coord, tp, dp, tps, dps)) in out.into_iter().enumerate() {
        assert_eq!(coord, vec![r / 3, r % 3]);
        let row: Vec<usize> = (0..3).map(|j| (r / 3) * 3 + j).collect();
        assert_eq!(tp, row);
        assert_eq!(dp, vec![r % 3, r % 3 + 3]);
        assert_eq!(tps, row.iter().sum::<usize>() as f64);
        assert_eq!(dps, (2 * (r % 3) + 3) as f64);
    }
}

#[test]
fn local_ranks_slices_and_flatten_2x2x2() {
    let out = spawn(8, |ctx| -> Result<_, MeshError> {
        let mesh =
            DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2, 2], &["pp", "dp", "tp"])?;
        let dp_tp = mesh.slice(&["dp", "tp"])?;
        let flat = mesh.flatten(&["dp", "tp"], "dp_tp")?;
        let x = Tensor::from_vec(vec![1.0f32], [1])?;
        let n = flat.group(0)?.all_reduce(&x, ReduceOp::Sum)?.item()?;
        Ok((
            mesh["tp"].local_rank(),
            mesh.local_rank_of("pp")?,
            dp_tp.shape().to_vec(),
            dp_tp.ranks().to_vec(),
            flat.ranks().to_vec(),
            flat.local_rank(),
            n,
        ))
    })
    .unwrap();
    for (r, (tp, pp, shape, sub, flat, flat_rank, n)) in out.into_iter().enumerate() {
        assert_eq!((tp, pp), (r % 2, r / 4));
        assert_eq!(shape, vec![2, 2]);
        let block: Vec<usize> = (0..4).map(|i| (r / 4) * 4 + i).collect();
        assert_eq!(sub, block);
        assert_eq!(flat, block);
        assert_eq!(flat_rank, r % 4);
        assert_eq!(n, 4.0);
    }
}

#[test]
fn bad_meshes_are_typed_errors() {
    let cfg = SpawnConfig::new(4).timeout(Duration::from_secs(5));
    let errs = spawn_with(cfg, |ctx| -> Result<_, MeshError> {
        let w = ctx.world_group();
        let size =
            DeviceMesh::new(&w, DeviceType::Cpu, &[3, 2], &["dp", "tp"]).unwrap_err().to_string();
        let rep =
            DeviceMesh::new(&w, DeviceType::Cpu, &[2, 2], &["tp", "tp"]).unwrap_err().to_string();
        let mesh = DeviceMesh::new(&w, DeviceType::Cpu, &[2, 2], &["dp", "tp"])?;
        let unknown = mesh.dim("pp").unwrap_err().to_string();
        Ok((size, rep, unknown))
    })
    .unwrap();
    let (size, rep, unknown) = &errs[0];
    assert!(size.contains("[3, 2] holds 6 ranks but the group has 4"), "{size}");
    assert!(rep.contains("\"tp\" repeats"), "{rep}");
    assert!(
        unknown.contains("no dim named \"pp\"") && unknown.contains("\"dp\", \"tp\""),
        "{unknown}"
    );
}

/// A mesh cut from another (a dim, or a slice in any order) knows its root, and a slice
/// reuses the root's groups: a collective over a reordered slice's dim runs on the same
/// ranks as over the root's dim of that name, with no new group made.
#[test]
fn slices_know_their_root_and_keep_its_groups() {
    let out = spawn(8, |ctx| -> Result<_, MeshError> {
        let mesh =
            DeviceMesh::new(&ctx.world_group(), DeviceType::Cpu, &[2, 2, 2], &["pp", "dp", "tp"])?;
        let tp_dp = mesh.slice(&["tp", "dp"])?;
        let root_of_dim = mesh["dp"].root();
        let root_of_slice = tp_dp.root();
        let root_of_sub_dim = tp_dp["tp"].root();
        let x = Tensor::from_vec(vec![ctx.rank() as f64], [1])?;
        let via_slice = tp_dp.group_of("dp")?.all_reduce(&x, ReduceOp::Sum)?.item()?;
        let via_root = mesh.group_of("dp")?.all_reduce(&x, ReduceOp::Sum)?.item()?;
        let repeated = mesh.slice(&["dp", "dp"]).is_err();
        Ok((
            [root_of_dim, root_of_slice, root_of_sub_dim]
                .iter()
                .map(|m| (m.names().to_vec(), m.ranks().to_vec(), m.coordinate().to_vec()))
                .collect::<Vec<_>>(),
            tp_dp.ranks().to_vec(),
            tp_dp.coordinate().to_vec(),
            via_slice,
            via_root,
            repeated,
            mesh.root().ranks().to_vec(),
        ))
    })
    .unwrap();
    for (r, (roots, ranks, coord, via_slice, via_root, repeated, own)) in
        out.into_iter().enumerate()
    {
        for (names, rs, c) in &roots {
            assert_eq!(names, &["pp", "dp", "tp"], "rank {r}");
            assert_eq!(rs, &(0..8).collect::<Vec<_>>(), "rank {r}");
            assert_eq!(c, &vec![r / 4, (r / 2) % 2, r % 2], "rank {r}");
        }
        // (tp, dp) order: tp outer.
        let base = (r / 4) * 4;
        assert_eq!(ranks, vec![base, base + 2, base + 1, base + 3], "rank {r}");
        assert_eq!(coord, vec![r % 2, (r / 2) % 2], "rank {r}");
        assert_eq!(via_slice, via_root, "rank {r}");
        assert_eq!(via_root, (2 * (base + r % 2) + 2) as f64, "rank {r}");
        assert!(repeated, "a slice naming a dim twice is an error");
        assert_eq!(own, (0..8).collect::<Vec<_>>());
    }
}
