//! The NCCL backend. Here (no GPU, no CUDA libraries) these tests check that the backend
//! reports why it is unavailable instead of panicking; on a machine with the CUDA driver
//! and NCCL, `world_size_one_runs_every_collective` runs every collective on one GPU, and
//! `world_size_one_keeps_cuda_tensors_on_the_device` checks the device path of CUDA
//! tensors.
//! The world's store is an in-memory one ([`HashStore`](tpar_collectives::HashStore)): the TCP store and the launch
//! environment are `tpar-launch`'s, tested there.
//!
//! When NCCL is installed only as `libnccl.so.2` (which cudarc's loader does not try), that
//! test re-runs itself in a child process whose `LD_LIBRARY_PATH` holds a `libnccl.so`
//! link, as `tpar-run` does for its ranks.

use std::sync::Arc;
use std::time::Duration;

use tpar_collectives::nccl::{self, LibStatus};
use tpar_collectives::{
    CollectiveError, CollectiveKind, HashStore, ProcessGroup, ReduceOp, Store, StoreError,
};
use tpar_tensor::{DType, Device, Rng, Tensor};

/// Marks the child process of the `libnccl.so` re-run.
const CHILD_ENV: &str = "TPAR_NCCL_TEST_CHILD";

/// A world of one: rank 0 of 1 on device 0.
fn world_of_one(timeout: Duration) -> tpar_collectives::Result<ProcessGroup> {
    ProcessGroup::nccl_world(Arc::new(HashStore::new()), 0, 1, 0, timeout)
}

#[test]
fn the_in_memory_store_times_out_with_the_missing_keys() {
    let s = HashStore::new();
    s.set("here", b"1").unwrap();
    assert!(s.check(&["here"]).unwrap() && !s.check(&["here", "absent"]).unwrap());
    assert_eq!(s.get_timeout("here", Duration::ZERO).unwrap(), b"1");
    match s.wait(&["here", "absent"], Duration::from_millis(10)) {
        Err(StoreError::Timeout(e)) => assert!(e.to_string().contains("absent"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn probe_reports_each_library_without_panicking() {
    let p = nccl::probe();
    println!("{p}");
    let text = p.to_string();
    assert!(text.contains("CUDA driver: "), "{text}");
    assert!(text.contains("NCCL: "), "{text}");
    assert_eq!(nccl::probe(), p, "the probe is stable within a process");
    for lib in [&p.driver, &p.nccl] {
        if let LibStatus::Missing(why) = lib {
            assert!(!why.is_empty());
        }
    }
    match p.check() {
        Ok(()) => {
            assert!(p.is_usable() && p.why_unavailable().is_none());
            assert!(p.devices.unwrap_or(0) > 0);
            assert!(p.nccl_version.is_some());
        }
        Err(CollectiveError::Unavailable { what, why }) => {
            assert_eq!(what, "NCCL backend");
            assert!(!p.is_usable());
            assert_eq!(Some(why.clone()), p.why_unavailable());
            if !p.driver.is_present() {
                assert!(why.contains("CUDA driver missing"), "{why}");
            }
            if !p.nccl.is_present() {
                assert!(why.contains("NCCL missing"), "{why}");
            }
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn nccl_world_is_unavailable_not_a_panic_without_cuda() {
    let p = nccl::probe();
    if p.is_usable() {
        println!("skipped: CUDA and NCCL are present here");
        return;
    }
    match world_of_one(Duration::from_secs(5)) {
        Err(CollectiveError::Unavailable { what, why }) => {
            println!("nccl_world: {what} is unavailable: {why}");
            assert_eq!(what, "NCCL backend");
            let named = (!p.driver.is_present() && why.contains("CUDA driver"))
                || (!p.nccl.is_present() && why.contains("NCCL missing"));
            assert!(named, "the reason names the missing library: {why}");
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(pg) => panic!("an NCCL group without CUDA: {pg:?}"),
    }
}

#[test]
fn nccl_world_checks_its_rank() {
    let store = Arc::new(HashStore::new());
    for (rank, world) in [(1, 1), (0, 0), (5, 2)] {
        match ProcessGroup::nccl_world(store.clone(), rank, world, 0, Duration::from_secs(1)) {
            Err(CollectiveError::InvalidArgument { why, .. }) => {
                assert!(why.contains(&format!("rank {rank}")), "{why}")
            }
            other => panic!("rank {rank} of {world}: {other:?}"),
        }
    }
}

#[test]
fn the_libnccl_link_points_at_the_versioned_library() {
    // A stand-in library file: the link is only a symlink in a private directory.
    let dir = std::env::temp_dir().join(format!("tpar-nccl-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libnccl.so.2");
    std::fs::write(&lib, b"not a library").unwrap();
    let link = nccl::NcclLibLink::create(&lib).unwrap();
    let linked = link.dir().join("libnccl.so");
    assert_eq!(std::fs::read_link(&linked).unwrap(), lib.canonicalize().unwrap());
    let path = link.ld_library_path();
    let first = std::env::split_paths(&path).next().unwrap();
    assert_eq!(first, link.dir());
    let made = link.dir().to_path_buf();
    drop(link);
    assert!(!made.exists(), "the link directory is removed on drop");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Marks the child of `a_libnccl_so_2_alone_becomes_loadable_through_the_link`.
const LINK_CHILD_ENV: &str = "TPAR_NCCL_LINK_CHILD";

#[test]
fn a_libnccl_so_2_alone_becomes_loadable_through_the_link() {
    if nccl::probe().nccl.is_present() {
        println!("skipped: NCCL already loads here");
        return;
    }
    // A stand-in NCCL that only knows its version, installed the way the runtime package
    // installs NCCL: as libnccl.so.2, with no libnccl.so.
    let dir = std::env::temp_dir().join(format!("tpar-nccl-stub-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("stub.c");
    std::fs::write(
        &src,
        "int ncclGetVersion(int *v) { *v = 22703; return 0; }\n\
         const char *ncclGetErrorString(int r) { (void)r; return \"stub\"; }\n",
    )
    .unwrap();
    let lib = dir.join("libnccl.so.2");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o"])
        .arg(&lib)
        .arg(&src)
        .status();
    if !built.is_ok_and(|s| s.success()) {
        println!("skipped: no C compiler to build a stand-in libnccl.so.2");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let link = nccl::NcclLibLink::create(&lib).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["linked_child_sees_nccl", "--exact", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", link.ld_library_path())
        .env(LINK_CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    drop(link);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("NCCL: present (NCCL 2.27.3)"), "{stdout}");
}

/// Runs only as the child of the test above: cudarc finds "libnccl.so" through the link.
#[test]
fn linked_child_sees_nccl() {
    if std::env::var_os(LINK_CHILD_ENV).is_none() {
        return;
    }
    let p = nccl::probe();
    println!("{p}");
    assert!(p.nccl.is_present(), "{p}");
    assert_eq!(p.nccl_version, Some((2, 27, 3)));
}

/// Re-runs this test in a child whose `LD_LIBRARY_PATH` makes `libnccl.so.2` loadable,
/// when that is what is missing. Returns whether it did.
fn rerun_with_nccl_link(test: &str) -> bool {
    let p = nccl::probe();
    if std::env::var_os(CHILD_ENV).is_some() || !p.driver.is_present() || p.nccl.is_present() {
        return false;
    }
    let Some(link) = nccl::nccl_library_link() else { return false };
    println!(
        "re-running with {} -> {} on LD_LIBRARY_PATH",
        link.dir().display(),
        link.target().display()
    );
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", link.ld_library_path())
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    println!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the re-run failed: {}", out.status);
    true
}

/// Whether NCCL is usable in this process. If not, `test` re-runs in a child with the
/// `libnccl.so` link where that helps (the child runs it), or it prints why it skips.
fn nccl_or_skip(test: &str) -> bool {
    let p = nccl::probe();
    if p.is_usable() {
        return true;
    }
    if !rerun_with_nccl_link(test) {
        println!("skipped: {}", p.why_unavailable().unwrap_or_default());
    }
    false
}

fn rand_tensor(dims: &[usize], dtype: DType, rng: &mut Rng) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.below(9) as f64 - 4.0).collect();
    Tensor::from_f64(&v, dims.to_vec(), dtype).unwrap()
}

fn same(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dims(), want.dims(), "{what}: dims");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap(), "{what}: values");
}

#[test]
fn world_size_one_runs_every_collective() {
    if !nccl_or_skip("world_size_one_runs_every_collective") {
        return;
    }
    println!("{}", nccl::probe());
    let pg = world_of_one(Duration::from_secs(60)).expect("NCCL world of one");
    assert_eq!(pg.backend_name(), "nccl");
    assert_eq!((pg.size(), pg.rank(), pg.global_rank(), pg.world_size()), (1, 0, 0, 1));
    let debug = pg.comm_debug();
    debug.enable();
    let mut rng = Rng::new(5);
    let dtypes = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64];
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product];
    for dtype in dtypes {
        let t = rand_tensor(&[5, 3, 2], dtype, &mut rng);
        for op in ops {
            if dtype == DType::I64 && op == ReduceOp::Avg {
                assert!(pg.all_reduce(&t, op).is_err(), "avg of i64 is refused");
                continue;
            }
            same(&format!("all_reduce {op} {dtype}"), &pg.all_reduce(&t, op).unwrap(), &t);
            for dim in 0..3 {
                let what = format!("reduce_scatter {op} dim {dim} {dtype}");
                same(&what, &pg.reduce_scatter(&t, dim, op).unwrap(), &t);
            }
        }
        for dim in 0..3 {
            same(&format!("all_gather dim {dim} {dtype}"), &pg.all_gather(&t, dim).unwrap(), &t);
        }
        for (s, c) in [(0, 0), (0, 1), (2, 0), (1, 2)] {
            same(&format!("all_to_all {s}->{c} {dtype}"), &pg.all_to_all(&t, s, c).unwrap(), &t);
        }
        same("all_to_all_sizes", &pg.all_to_all_sizes(&t, &[5], 0, 0).unwrap(), &t);
        same(&format!("broadcast {dtype}"), &pg.broadcast(&t, 0).unwrap(), &t);
        pg.send(&t, 0).unwrap();
        same(&format!("send/recv {dtype}"), &pg.recv(0).unwrap(), &t);
        pg.send_shaped(&t, 0).unwrap();
        let back = pg.recv_shaped(0, t.dims(), dtype, Device::Cpu).unwrap();
        same(&format!("send_shaped/recv_shaped {dtype}"), &back, &t);
    }
    pg.barrier().unwrap();

    // Empty and meta tensors, a 0-d tensor, a large tensor.
    let empty = Tensor::zeros([0, 4], DType::F32, Device::Cpu).unwrap();
    same("all_gather of nothing", &pg.all_gather(&empty, 0).unwrap(), &empty);
    let meta = Tensor::empty([6, 2], DType::BF16, Device::Meta).unwrap();
    let m = pg.reduce_scatter(&meta, 0, ReduceOp::Sum).unwrap();
    assert_eq!((m.dims(), m.device()), (&[6usize, 2][..], Device::Meta));
    let scalar = Tensor::scalar(2.5, DType::F32);
    same("0-d all_reduce", &pg.all_reduce(&scalar, ReduceOp::Sum).unwrap(), &scalar);
    let big = rand_tensor(&[1 << 20], DType::F32, &mut rng);
    same("4 MiB all_reduce", &pg.all_reduce(&big, ReduceOp::Sum).unwrap(), &big);

    // Async calls, completed in order by the group's worker.
    let t = rand_tensor(&[4, 4], DType::F32, &mut rng);
    let works = [
        pg.all_reduce_async(&t, ReduceOp::Max),
        pg.all_gather_async(&t, 1),
        pg.reduce_scatter_async(&t, 0, ReduceOp::Sum),
    ];
    for w in works {
        let op = w.op();
        same(&format!("{op} async"), &w.wait().unwrap(), &t);
    }

    // Bad arguments fail alone, and the group stays usable.
    assert!(matches!(pg.all_gather(&t, 7), Err(CollectiveError::InvalidArgument { .. })));
    assert!(matches!(pg.recv(0), Err(CollectiveError::InvalidArgument { .. })));
    pg.send_shaped(&t, 0).unwrap();
    let e = pg.recv_shaped(0, &[16], DType::F32, Device::Cpu).unwrap_err();
    assert!(matches!(e, CollectiveError::Mismatch { op: "recv_shaped", .. }), "{e}");
    same("after errors", &pg.all_reduce(&t, ReduceOp::Sum).unwrap(), &t);

    // new_group: in a world of one, [0] is the world's own list, so it shares the world's
    // communicator (handles on one list always do); larger worlds get one per list.
    let sub = pg.new_group(&[0]).unwrap();
    assert_eq!((sub.backend_name(), sub.ranks()), ("nccl", &[0usize][..]));
    same("sub-group all_reduce", &sub.all_reduce(&t, ReduceOp::Sum).unwrap(), &t);
    same("interleaved", &pg.all_gather(&t, 0).unwrap(), &t);
    let again = sub.new_group(&[0]).unwrap();
    same("same list again", &again.broadcast(&t, 0).unwrap(), &t);
    assert!(pg.new_group(&[0, 1]).is_err(), "rank 1 does not exist");

    let kinds: Vec<CollectiveKind> = debug.records().iter().map(|r| r.kind).collect();
    for k in CollectiveKind::ALL {
        assert!(kinds.contains(&k), "{k} was recorded");
    }
    println!("{} calls ran on NCCL", kinds.len());
}

/// On a GPU: collectives of CUDA tensors run on the device (NCCL on the tensors' own
/// memory, ordered by events): the results equal the inputs at world size 1, they stay
/// on the device, and no call reads the host (`gpu::host_round_trips`), async calls
/// included; the host-path calls on CUDA tensors (broadcast, all_to_all) still work.
#[test]
fn world_size_one_keeps_cuda_tensors_on_the_device() {
    if !nccl_or_skip("world_size_one_keeps_cuda_tensors_on_the_device") {
        return;
    }
    let pg = world_of_one(Duration::from_secs(60)).expect("NCCL world of one");
    let cuda = Device::Cuda(0);
    let mut rng = Rng::new(9);
    let dtypes = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64];
    let mut calls = 0;
    for dtype in dtypes {
        let host = rand_tensor(&[4, 6, 2], dtype, &mut rng);
        let t = host.to_device(cuda).unwrap();
        let before = tpar_tensor::gpu::host_round_trips();
        let mut results = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            results.push((format!("all_reduce {op}"), pg.all_reduce(&t, op).unwrap()));
            for dim in 0..3 {
                let r = pg.reduce_scatter(&t, dim, op).unwrap();
                results.push((format!("reduce_scatter {op} dim {dim}"), r));
            }
        }
        for dim in 0..3 {
            results.push((format!("all_gather dim {dim}"), pg.all_gather(&t, dim).unwrap()));
        }
        let w = pg.all_gather_async(&t, 1);
        results.push(("all_gather async".into(), w.wait().unwrap()));
        let out = Tensor::zeros(t.dims().to_vec(), dtype, cuda).unwrap();
        pg.all_reduce_into(&t, ReduceOp::Sum, &out).unwrap();
        results.push(("all_reduce_into".into(), out));
        // A wrong `out` fails this member alone (after taking part), and the group goes on.
        let wrong = Tensor::zeros([3], dtype, cuda).unwrap();
        let e = pg.all_reduce_into(&t, ReduceOp::Sum, &wrong).unwrap_err();
        assert!(matches!(e, CollectiveError::InvalidArgument { .. }), "{e}");
        assert_eq!(
            tpar_tensor::gpu::host_round_trips() - before,
            0,
            "{dtype}: a device-path collective read the host"
        );
        for (what, r) in &results {
            assert_eq!(r.device(), cuda, "{what} {dtype}: result off the device");
            same(&format!("{what} {dtype}"), &r.to_device(Device::Cpu).unwrap(), &host);
        }
        calls += results.len();
        // Host-path calls on CUDA tensors: staged, and still right.
        same("broadcast", &pg.broadcast(&t, 0).unwrap().to_device(Device::Cpu).unwrap(), &host);
        let a2a = pg.all_to_all(&t, 0, 1).unwrap().to_device(Device::Cpu).unwrap();
        same("all_to_all", &a2a, &host);
    }
    // A large one, and an async one dropped unwaited (its buffers outlive it on the device).
    let big = rand_tensor(&[1 << 22], DType::F32, &mut rng);
    let big_d = big.to_device(cuda).unwrap();
    drop(pg.all_reduce_async(&big_d, ReduceOp::Sum));
    same(
        "16 MiB",
        &pg.all_reduce(&big_d, ReduceOp::Sum).unwrap().to_device(Device::Cpu).unwrap(),
        &big,
    );
    pg.barrier().unwrap();
    println!("{calls} collectives of CUDA tensors ran on the device");
}

/// NCCL's bring-up on 4 ranks (threads sharing a [`HashStore`]) with the stand-in: the
/// world and a 2 x 2 mesh's groups (dp: {0,2} {1,3}; tp: {0,1} {2,3}), as `DeviceMesh`
/// creates them. Every member of a group gets the same unique id, other groups other ids;
/// a live group is reused; the first collective is where the stand-in stops.
#[test]
fn the_standin_brings_up_the_world_and_each_mesh_axis() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let t = Duration::from_secs(20);
    let runs: Vec<_> = (0..4)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let (world, standin) = nccl::StandIn::world(store, rank, 4, t).unwrap();
                let dp = world.new_group(&[rank % 2, rank % 2 + 2]).unwrap();
                let tp = world.new_group(&[rank / 2 * 2, rank / 2 * 2 + 1]).unwrap();
                let again = world.new_group(&[rank % 2 + 2, rank % 2]).unwrap();
                assert_eq!((dp.rank(), tp.rank(), again.rank()), (rank / 2, rank % 2, rank / 2));
                let x = Tensor::from_vec(vec![1.0f32; 4], [4]).unwrap();
                let e = tp.all_reduce(&x, ReduceOp::Sum).unwrap_err();
                assert!(
                    matches!(&e, CollectiveError::Unavailable { why, .. } if why.contains("stand-in")),
                    "{e}"
                );
                world.barrier().unwrap_err();
                standin.communicators()
            })
        })
        .collect();
    let comms: Vec<_> = runs.into_iter().map(|h| h.join().unwrap()).collect();
    let mut by_group: std::collections::BTreeMap<Vec<usize>, Vec<[u8; 128]>> = Default::default();
    for (rank, cs) in comms.iter().enumerate() {
        // The world, then dp, then tp; the repeated dp group made none.
        let lists: Vec<_> = cs.iter().map(|c| c.ranks.clone()).collect();
        let (dp, tp) = (vec![rank % 2, rank % 2 + 2], vec![rank / 2 * 2, rank / 2 * 2 + 1]);
        assert_eq!(lists, vec![vec![0, 1, 2, 3], dp.clone(), tp.clone()], "rank {rank}");
        for c in cs {
            assert_eq!(c.ranks[c.member], rank, "{c:?}");
            assert!(c.key.ends_with("/0"), "the first communicator of its list: {}", c.key);
            by_group.entry(c.ranks.clone()).or_default().push(c.unique_id);
        }
    }
    assert_eq!(by_group.len(), 5, "{:?}", by_group.keys());
    for (ranks, ids) in &by_group {
        assert_eq!(ids.len(), ranks.len(), "{ranks:?}");
        assert!(ids.iter().all(|id| id == &ids[0]), "members of {ranks:?} disagree on the id");
    }
    let firsts: std::collections::HashSet<_> = by_group.values().map(|ids| ids[0]).collect();
    assert_eq!(firsts.len(), 5, "two groups share a unique id");
}

/// A member that never arrives: the others fail within the timeout, naming it.
#[test]
fn the_standin_names_the_member_that_never_arrived() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let t = Duration::from_millis(400);
    let runs: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || nccl::StandIn::world(store, rank, 3, t).map(drop))
        })
        .collect();
    for h in runs {
        match h.join().unwrap() {
            Err(CollectiveError::Timeout { waiting_for, .. }) => assert_eq!(waiting_for, [2]),
            other => panic!("{other:?}"),
        }
    }
    let e = nccl::StandIn::world(Arc::new(HashStore::new()), 3, 3, t).map(drop).unwrap_err();
    assert!(matches!(e, CollectiveError::InvalidArgument { .. }), "{e}");
}
