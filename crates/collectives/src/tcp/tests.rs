//! The `tcp` backend with processes simulated by threads: every rank builds its own world
//! (its own listener, sockets and reader threads; only the store is shared), so
//! everything but process death runs over real sockets. Results are checked against
//! serial references computed here from every rank's input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tpar_tensor::{DType, Device, Rng, Tensor};

use crate::{
    chunk_range, CollectiveError, CollectiveKind, HashStore, ProcessGroup, ReduceOp, Store,
};

/// Runs `f(world)` on `n` threads, each with its own TCP world of `n` ranks.
fn run_world<R: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let store = store.clone();
            let f = f.clone();
            std::thread::spawn(move || {
                let world = ProcessGroup::tcp_world(store, rank, n, timeout).unwrap();
                assert_eq!((world.rank(), world.size(), world.backend_name()), (rank, n, "tcp"));
                f(world)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

pub(super) const T: Duration = Duration::from_secs(20);

const DTYPES: [DType; 5] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64];

pub(super) fn small_ints(dims: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.below(9) as f64 - 4.0).collect();
    Tensor::from_f64(&v, dims.to_vec(), dtype).unwrap()
}

/// Dims, dtype and values of a result.
pub(super) type Seen = (Vec<usize>, DType, Vec<f64>);

pub(super) fn seen(t: &Tensor) -> Seen {
    (t.dims().to_vec(), t.dtype(), t.to_vec_f64().unwrap())
}

pub(super) fn reduce_ref(inputs: &[Tensor], op: ReduceOp) -> Tensor {
    let vals: Vec<Vec<f64>> = inputs.iter().map(|t| t.to_vec_f64().unwrap()).collect();
    let n = vals.len() as f64;
    let out: Vec<f64> = (0..vals[0].len())
        .map(|i| {
            let it = vals.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => it.sum(),
                ReduceOp::Avg => it.sum::<f64>() / n,
                ReduceOp::Max => it.fold(f64::MIN, f64::max),
                ReduceOp::Min => it.fold(f64::MAX, f64::min),
                ReduceOp::Product => it.product(),
            }
        })
        .collect();
    Tensor::from_f64(&out, inputs[0].dims().to_vec(), inputs[0].dtype()).unwrap()
}

pub(super) fn narrow(t: &Tensor, dim: usize, (start, len): (usize, usize)) -> Tensor {
    t.narrow(dim as isize, start, len).unwrap().contiguous().unwrap()
}

pub(super) fn cat(ts: &[Tensor], dim: usize) -> Tensor {
    Tensor::cat(ts, dim as isize).unwrap()
}

pub(super) fn assert_close(got: &Seen, want: &Tensor, exact: bool, what: &str) {
    let w = seen(want);
    assert_eq!((&got.0, got.1), (&w.0, w.1), "{what}: dims and dtype");
    let tol = match (exact, got.1) {
        (true, _) | (_, DType::I64) => 0.0,
        (false, DType::BF16) => 2e-2,
        (false, DType::F16) => 2e-3,
        (false, _) => 1e-6,
    };
    for (i, (a, b)) in got.2.iter().zip(&w.2).enumerate() {
        assert!((a - b).abs() <= tol * b.abs().max(1.0), "{what}: element {i}: {a} vs {b}");
    }
}

/// The input of rank `r` of `n` for dtype index `k` and case `c`.
pub(super) fn input(dims: &[usize], dtype: DType, r: usize, c: u64) -> Tensor {
    small_ints(dims, dtype, 1000 * c + 10 * r as u64 + dtype as u64)
}

#[test]
fn every_collective_and_dtype_matches_the_serial_reference() {
    for n in [2usize, 3, 4] {
        let rows = n * 3 + 1;
        // Every rank runs the same list of calls, for every dtype; results come back here.
        let outs = run_world(n, T, move |pg| {
            let r = pg.rank();
            let mut out: Vec<Seen> = Vec::new();
            for dtype in DTYPES {
                let full = input(&[rows, 2], dtype, r, 1);
                let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
                for op in ops {
                    if dtype == DType::I64 && op == ReduceOp::Avg {
                        continue;
                    }
                    out.push(seen(&pg.all_reduce(&full, op).unwrap()));
                    out.push(seen(&pg.reduce_scatter(&full, 0, op).unwrap()));
                }
                let wide = input(&[2, rows, 3], dtype, r, 2);
                out.push(seen(&pg.reduce_scatter(&wide, 1, ReduceOp::Sum).unwrap()));
                // Uneven torch.chunk shards (the last may be empty) along dims 0 and 1.
                let shard = input(&[chunk_range(rows, n, r).1, 2], dtype, r, 3);
                out.push(seen(&pg.all_gather(&shard, 0).unwrap()));
                let shard1 = input(&[2, chunk_range(n + 1, n, r).1, 3], dtype, r, 4);
                out.push(seen(&pg.all_gather(&shard1, 1).unwrap()));
                out.push(seen(&pg.all_to_all(&wide, 1, 0).unwrap()));
                out.push(seen(&pg.all_to_all(&wide, 1, 2).unwrap()));
                let src = n - 1;
                let b = if r == src {
                    input(&[3, 1], dtype, r, 5)
                } else {
                    Tensor::zeros([0], DType::I64, Device::Cpu).unwrap()
                };
                out.push(seen(&pg.broadcast(&b, src).unwrap()));
                // Empty tensors.
                let empty = Tensor::zeros([0, 3], dtype, Device::Cpu).unwrap();
                out.push(seen(&pg.all_reduce(&empty, ReduceOp::Sum).unwrap()));
                out.push(seen(&pg.all_gather(&empty, 0).unwrap()));
            }
            pg.barrier().unwrap();
            out
        });
        // The same list, computed serially from every rank's input.
        for (r, got) in outs.iter().enumerate() {
            let mut got = got.iter();
            let mut check = |want: Tensor, exact: bool, what: &str| {
                assert_close(
                    got.next().expect("a result"),
                    &want,
                    exact,
                    &format!("n={n} rank {r}: {what}"),
                );
            };
            for dtype in DTYPES {
                let all = |dims: &[usize], c: u64| -> Vec<Tensor> {
                    (0..n).map(|j| input(dims, dtype, j, c)).collect()
                };
                let full = all(&[rows, 2], 1);
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    if dtype == DType::I64 && op == ReduceOp::Avg {
                        continue;
                    }
                    let red = reduce_ref(&full, op);
                    let exact = op != ReduceOp::Avg;
                    check(red.clone(), exact, &format!("all_reduce {op} {dtype}"));
                    check(
                        narrow(&red, 0, chunk_range(rows, n, r)),
                        exact,
                        &format!("reduce_scatter {op} {dtype}"),
                    );
                }
                let wide = all(&[2, rows, 3], 2);
                let red = reduce_ref(&wide, ReduceOp::Sum);
                check(
                    narrow(&red, 1, chunk_range(rows, n, r)),
                    true,
                    &format!("reduce_scatter dim 1 {dtype}"),
                );
                let shards: Vec<Tensor> =
                    (0..n).map(|j| input(&[chunk_range(rows, n, j).1, 2], dtype, j, 3)).collect();
                check(cat(&shards, 0), true, &format!("all_gather dim 0 {dtype}"));
                let shards1: Vec<Tensor> = (0..n)
                    .map(|j| input(&[2, chunk_range(n + 1, n, j).1, 3], dtype, j, 4))
                    .collect();
                check(cat(&shards1, 1), true, &format!("all_gather dim 1 {dtype}"));
                for concat in [0, 2] {
                    let pieces: Vec<Tensor> =
                        wide.iter().map(|w| narrow(w, 1, chunk_range(rows, n, r))).collect();
                    check(cat(&pieces, concat), true, &format!("all_to_all 1->{concat} {dtype}"));
                }
                check(input(&[3, 1], dtype, n - 1, 5), true, &format!("broadcast {dtype}"));
                check(Tensor::zeros([0, 3], dtype, Device::Cpu).unwrap(), true, "empty all_reduce");
                check(Tensor::zeros([0, 3], dtype, Device::Cpu).unwrap(), true, "empty all_gather");
            }
            assert!(got.next().is_none(), "as many results as references");
        }
    }
}

#[test]
fn results_equal_the_local_backend_bit_for_bit() {
    // bf16/f16 averages round: both backends accumulate in f32 in rank order. The large
    // size spans several reduction blocks and reuses received buffers on its second call.
    let n = 3;
    let calls = |pg: &ProcessGroup, r: usize| -> Vec<Seen> {
        let mut out = Vec::new();
        for len in [37usize, 100_003] {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let mut rng = Rng::new(77 + r as u64);
                let v: Vec<f64> = (0..len).map(|_| rng.below(1000) as f64 / 7.0).collect();
                let t = Tensor::from_f64(&v, [len], dtype).unwrap();
                out.push(seen(&pg.all_reduce(&t, ReduceOp::Avg).unwrap()));
                out.push(seen(&pg.all_reduce(&t, ReduceOp::Sum).unwrap()));
                out.push(seen(&pg.reduce_scatter(&t, 0, ReduceOp::Sum).unwrap()));
            }
        }
        out
    };
    let tcp = run_world(n, T, move |pg| calls(&pg, pg.rank()));
    let local = crate::spawn(n, move |ctx| -> crate::Result<_> {
        Ok(calls(&ctx.world_group(), ctx.rank()))
    })
    .unwrap();
    assert_eq!(tcp, local);
}

#[test]
fn sub_groups_of_a_mesh_run_beside_the_world() {
    // A 2x2 mesh: rows {0,1}, {2,3}; columns {0,2}, {1,3}.
    let outs = run_world(4, T, |pg| {
        let r = pg.rank();
        let row = pg.new_group(&[r / 2 * 2, r / 2 * 2 + 1]).unwrap();
        let col = pg.new_group(&[r % 2 + 2, r % 2]).unwrap();
        assert_eq!(col.ranks(), &[r % 2, r % 2 + 2]);
        // The same member list again is the same group (its calls are numbered together).
        let row_again = pg.new_group(&[r / 2 * 2 + 1, r / 2 * 2]).unwrap();
        let t = Tensor::from_vec(vec![r as f32 + 1.0; 5], [5]).unwrap();
        let a = row.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
        let w = pg.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
        let b = col.all_gather(&t, 0).unwrap().to_vec::<f32>().unwrap();
        let c = row_again.broadcast(&t, 1).unwrap().to_vec::<f32>().unwrap();
        // A group without some members, and point-to-point inside a sub-group.
        let trio = if r < 3 { Some(pg.new_group(&[0, 1, 2]).unwrap()) } else { None };
        let m = trio.map(|g| g.all_reduce(&t, ReduceOp::Max).unwrap().to_vec::<f32>().unwrap()[0]);
        if col.rank() == 0 {
            col.send(&t, 1).unwrap();
        } else {
            let got = col.recv(0).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(got, vec![(r - 2) as f32 + 1.0; 5]);
        }
        pg.barrier().unwrap();
        (a[0], w[0], b.len(), b[0], b[5], c[0], m)
    });
    let row_sum = [3.0, 3.0, 7.0, 7.0];
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.0, row_sum[r]);
        assert_eq!(o.1, 10.0);
        assert_eq!((o.2, o.3, o.4), (10, (r % 2) as f32 + 1.0, (r % 2 + 2) as f32 + 1.0));
        assert_eq!(o.5, (r / 2 * 2 + 1) as f32 + 1.0);
        assert_eq!(o.6, (r < 3).then_some(3.0));
    }
}

#[test]
fn async_handles_run_in_call_order() {
    let outs = run_world(3, T, |pg| {
        let r = pg.rank();
        pg.comm_debug().enable();
        let t = Tensor::from_vec(vec![r as f64 + 1.0; 7], [7, 1]).unwrap();
        let a = pg.all_reduce_async(&t, ReduceOp::Sum);
        let g = pg.all_gather_async(&t, 1);
        let s = pg.reduce_scatter_async(&t, 0, ReduceOp::Max);
        let sync = pg.all_reduce(&t, ReduceOp::Min).unwrap();
        // Waited out of order.
        let s = s.wait().unwrap();
        let g = g.wait().unwrap();
        assert!(a.is_completed() || !a.is_completed());
        let a = a.wait().unwrap();
        let counts = pg.comm_debug().counts();
        (
            a.to_vec::<f64>().unwrap()[0],
            g.dims().to_vec(),
            s.dims().to_vec(),
            s.to_vec::<f64>().unwrap().first().copied(),
            sync.to_vec::<f64>().unwrap()[0],
            counts[&CollectiveKind::AllReduce],
            pg.comm_debug().records().iter().filter(|c| c.is_async).count(),
        )
    });
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.0, 6.0);
        assert_eq!(o.1, vec![7, 3]);
        assert_eq!(o.2, vec![chunk_range(7, 3, r).1, 1]);
        assert_eq!(o.3, Some(3.0));
        assert_eq!(o.4, 1.0);
        assert_eq!((o.5, o.6), (2, 3));
    }
}

#[test]
fn large_sends_both_ways_at_once_do_not_wait_on_each_other() {
    // Each rank sends 64 MiB to the other before either receives: readers and writers
    // are separate threads, so neither send waits for the other's receive. Then the
    // same through all_reduce, twice (the second reuses the received buffers).
    let elems = 16 << 20;
    let outs = run_world(2, T, move |pg| {
        let r = pg.rank();
        let t = Tensor::from_vec(vec![r as f32 + 1.0; elems], [elems]).unwrap();
        pg.send(&t, 1 - r).unwrap();
        let got = pg.recv(1 - r).unwrap().to_vec::<f32>().unwrap();
        let first = got.iter().all(|&x| x == (2 - r) as f32);
        let sums: Vec<bool> = (0..2)
            .map(|_| {
                let s = pg.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
                s.len() == elems && s.iter().all(|&x| x == 3.0)
            })
            .collect();
        (got.len() == elems && first, sums)
    });
    for out in outs {
        assert_eq!(out, (true, vec![true, true]));
    }
}

#[test]
fn send_and_recv_keep_order_shape_and_dtype() {
    let n = 3;
    let outs = run_world(n, T, move |pg| {
        let r = pg.rank();
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        // Every rank sends before it receives: sends never wait for the receiver.
        for k in 0..4 {
            pg.send(&small_ints(&[k + 1, 2], DType::BF16, (10 * r + k) as u64), next).unwrap();
        }
        pg.send(&Tensor::zeros([0, 5], DType::I64, Device::Cpu).unwrap(), next).unwrap();
        pg.send(&Tensor::empty([4, 4], DType::F16, Device::Meta).unwrap(), next).unwrap();
        pg.send_shaped(&small_ints(&[2, 3], DType::F64, 99), next).unwrap();
        pg.send_shaped(&small_ints(&[4], DType::F32, 98), next).unwrap();
        pg.send(&Tensor::from_vec(vec![r as i64], [1]).unwrap(), r).unwrap();
        let mine = pg.recv(r).unwrap().to_vec::<i64>().unwrap();
        assert_eq!(mine, vec![r as i64]);
        let got: Vec<Seen> = (0..4).map(|_| seen(&pg.recv(prev).unwrap())).collect();
        let empty = pg.recv(prev).unwrap();
        assert_eq!((empty.dims(), empty.dtype()), (&[0usize, 5][..], DType::I64));
        let meta = pg.recv(prev).unwrap();
        assert_eq!((meta.dims(), meta.device()), (&[4usize, 4][..], Device::Meta));
        let shaped = pg.recv_shaped(prev, &[2, 3], DType::F64, Device::Cpu).unwrap();
        // Another byte count than was sent: a Mismatch naming the sender.
        let wrong = pg.recv_shaped(prev, &[3], DType::F32, Device::Cpu).unwrap_err();
        (got, seen(&shaped), wrong)
    });
    for (r, (got, shaped, wrong)) in outs.iter().enumerate() {
        let prev = (r + n - 1) % n;
        for (k, g) in got.iter().enumerate() {
            assert_eq!(g, &seen(&small_ints(&[k + 1, 2], DType::BF16, (10 * prev + k) as u64)));
        }
        assert_eq!(shaped, &seen(&small_ints(&[2, 3], DType::F64, 99)));
        assert!(
            matches!(wrong, CollectiveError::Mismatch { rank, .. } if *rank == prev),
            "{wrong}"
        );
        assert!(wrong.to_string().contains("f32 [3]"), "{wrong}");
    }
}

#[test]
fn mismatched_calls_fail_every_member_naming_the_rank() {
    let errs = run_world(3, T, |pg| {
        let dtype = if pg.rank() == 1 { DType::F64 } else { DType::F32 };
        let t = Tensor::zeros([4], dtype, Device::Cpu).unwrap();
        let e = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
        // The group stays usable after a mismatch.
        let shape = if pg.rank() == 2 { vec![5] } else { vec![4] };
        let e2 = pg
            .all_reduce(&Tensor::zeros(shape, DType::F32, Device::Cpu).unwrap(), ReduceOp::Sum)
            .unwrap_err();
        let e3 = if pg.rank() == 0 {
            pg.barrier().unwrap_err()
        } else {
            pg.broadcast(&t, 0).unwrap_err()
        };
        let ok = pg.all_reduce(&Tensor::ones([2], DType::F32, Device::Cpu).unwrap(), ReduceOp::Sum);
        (e, e2, e3, ok.unwrap().to_vec::<f32>().unwrap())
    });
    for (e, e2, e3, ok) in errs {
        assert!(matches!(e, CollectiveError::Mismatch { rank: 1, .. }), "{e}");
        assert!(matches!(e2, CollectiveError::Mismatch { rank: 2, .. }), "{e2}");
        assert!(matches!(e3, CollectiveError::Mismatch { .. }), "{e3}");
        assert_eq!(ok, vec![3.0, 3.0]);
    }
}

#[test]
fn meta_and_host_only_arguments() {
    let outs = run_world(2, T, |pg| {
        let m = Tensor::empty([5, 2], DType::BF16, Device::Meta).unwrap();
        let g = pg.all_gather(&m, 1).unwrap();
        let s = pg.reduce_scatter(&m, 0, ReduceOp::Sum).unwrap();
        let e = pg.recv_shaped(0, &[2], DType::F32, Device::Cuda(0)).unwrap_err();
        let bad =
            pg.all_gather(&Tensor::zeros([2], DType::F32, Device::Cpu).unwrap(), 3).unwrap_err();
        (g.dims().to_vec(), g.device(), s.dims().to_vec(), e, bad)
    });
    for (r, (g, dev, s, e, bad)) in outs.into_iter().enumerate() {
        assert_eq!((g, dev), (vec![5, 4], Device::Meta));
        assert_eq!(s, vec![chunk_range(5, 2, r).1, 2]);
        assert!(
            matches!(&e, CollectiveError::InvalidArgument { op: "recv_shaped", why } if why.contains("the tcp backend carries host tensors")),
            "{e}"
        );
        assert!(matches!(bad, CollectiveError::InvalidArgument { .. }), "{bad}");
    }
}

#[test]
fn a_member_that_drops_its_world_is_a_peer_failure_naming_it() {
    let outs = run_world(3, Duration::from_secs(30), |pg| {
        let r = pg.rank();
        let pair = (r < 2).then(|| pg.new_group(&[0, 1]).unwrap());
        pg.barrier().unwrap();
        if r == 2 {
            // Leaves without calling: its sockets close.
            drop(pg);
            return None;
        }
        let t = Tensor::ones([4], DType::F32, Device::Cpu).unwrap();
        let start = Instant::now();
        let e = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
        let took = start.elapsed();
        // Later calls on the world fail alike, at once; a group without rank 2 still works.
        let later = pg.all_gather(&t, 0).unwrap_err();
        let async_later = pg.all_reduce_async(&t, ReduceOp::Sum).wait().unwrap_err();
        let fine = pair.unwrap().all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
        Some((e, later, async_later, took, fine))
    });
    for o in outs.into_iter().flatten() {
        let (e, later, async_later, took, fine) = o;
        println!("peer failure seen after {took:?}: {e}");
        assert!(matches!(e, CollectiveError::PeerFailed { rank: 2, .. }), "{e}");
        assert!(took < Duration::from_secs(1), "{took:?}");
        assert!(matches!(later, CollectiveError::PeerFailed { rank: 2, .. }), "{later}");
        assert!(
            matches!(async_later, CollectiveError::PeerFailed { rank: 2, .. }),
            "{async_later}"
        );
        assert_eq!(fine, vec![2.0; 4]);
    }
}

/// A member dies, a survivor that saw it leaves too, and a third member calls only
/// after both connections ended: its collective names the member that went first, not
/// the survivor whose connection it happened to miss first.
#[test]
fn a_collective_names_the_first_member_to_go_not_a_survivor_that_left_after() {
    let outs = run_world(3, Duration::from_secs(30), |pg| {
        pg.barrier().unwrap();
        match pg.rank() {
            1 => None,
            0 => {
                // Sees rank 1 go, then leaves as a failing survivor would.
                std::thread::sleep(Duration::from_millis(300));
                None
            }
            _ => {
                std::thread::sleep(Duration::from_millis(900));
                let t = Tensor::ones([4], DType::F32, Device::Cpu).unwrap();
                Some(pg.all_reduce(&t, ReduceOp::Sum).unwrap_err())
            }
        }
    });
    let e = outs.into_iter().flatten().next().unwrap();
    assert!(matches!(e, CollectiveError::PeerFailed { rank: 1, .. }), "{e}");
}

#[test]
fn a_slow_member_is_a_timeout_naming_it() {
    let outs = run_world(3, Duration::from_millis(400), |pg| {
        let t = Tensor::ones([3], DType::F32, Device::Cpu).unwrap();
        if pg.rank() == 2 {
            std::thread::sleep(Duration::from_millis(900));
        }
        let start = Instant::now();
        let e = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
        let recv = if pg.rank() == 0 { Some(pg.recv(1).unwrap_err()) } else { None };
        (pg.rank(), e, start.elapsed(), recv)
    });
    for (r, e, took, _) in &outs[..2] {
        assert!(
            matches!(e, CollectiveError::Timeout { waiting_for, .. } if waiting_for == &vec![2]),
            "rank {r}: {e}"
        );
        assert!(*took >= Duration::from_millis(350) && *took < Duration::from_secs(3), "{took:?}");
    }
    // The group failed on rank 0 with the timeout: later calls report it.
    let recv = outs[0].3.as_ref().unwrap();
    assert!(matches!(recv, CollectiveError::Timeout { .. }), "{recv}");
}

#[test]
fn a_peer_that_never_starts_is_a_setup_timeout_naming_it() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let s = store.clone();
    let h = std::thread::spawn(move || {
        ProcessGroup::tcp_world(s, 0, 3, Duration::from_millis(300)).unwrap_err()
    });
    let e1 = ProcessGroup::tcp_world(store, 1, 3, Duration::from_millis(300)).unwrap_err();
    let e0 = h.join().unwrap();
    for e in [e0, e1] {
        assert!(
            matches!(&e, CollectiveError::Timeout { op: "tcp_world", waiting_for, .. } if waiting_for == &vec![2]),
            "{e}"
        );
    }
    let e = ProcessGroup::tcp_world(Arc::new(HashStore::new()), 3, 3, T).unwrap_err();
    assert!(matches!(e, CollectiveError::InvalidArgument { .. }), "{e}");
}

#[test]
fn a_connection_from_another_job_or_rank_is_refused() {
    use std::io::{Read, Write};
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let n = 3;
    let ranks: Vec<_> = (0..n)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                if rank == 1 {
                    // Late, so that rank 2 is still accepting when the strangers come.
                    std::thread::sleep(Duration::from_millis(300));
                }
                let world = ProcessGroup::tcp_world(store, rank, n, T).unwrap();
                let t = Tensor::from_vec(vec![rank as i64], [1]).unwrap();
                world.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<i64>().unwrap()
            })
        })
        .collect();
    let addr = String::from_utf8(store.get_timeout("tpar/tcp/addr/2", T).unwrap()).unwrap();
    let token = store.get_timeout("tpar/tcp/token", T).unwrap();
    let hello = |token: &[u8], from: u64| {
        let mut b = b"tparTCP\x02".to_vec();
        b.extend(0x0102_0304u32.to_ne_bytes());
        b.extend(token);
        b.extend(3u64.to_le_bytes());
        b.extend(from.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b
    };
    let wrong_token: Vec<u8> = token.iter().map(|b| b ^ 0xff).collect();
    let strangers = [
        hello(&wrong_token, 1), // another job
        hello(&token, 2),       // not a lower rank
        vec![7u8; 44],          // not a hello at all
    ];
    for (i, h) in strangers.iter().enumerate() {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(h).unwrap();
        let mut answer = [9u8; 9];
        s.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], 0, "stranger {i} is refused");
    }
    for r in ranks {
        assert_eq!(r.join().unwrap(), vec![3]);
    }
}

#[test]
fn all_to_all_with_split_sizes_and_a_late_sender() {
    // all_to_all_single with uneven splits: member r sends sizes[r][j] rows to member j.
    let sizes = [[1usize, 0, 2], [2, 2, 0], [0, 1, 1]];
    let rows_of = move |r: usize| sizes[r].iter().sum::<usize>();
    let inp = move |r: usize| small_ints(&[rows_of(r), 2], DType::I64, 40 + r as u64);
    let outs = run_world(3, Duration::from_millis(500), move |pg| {
        let r = pg.rank();
        let out = pg.all_to_all_sizes(&inp(r), &sizes[r], 0, 0).unwrap();
        pg.barrier().unwrap();
        // A receive whose sender is late: a timeout naming the sender.
        let late = if r == 0 {
            Some(pg.recv(2).unwrap_err())
        } else {
            if r == 2 {
                std::thread::sleep(Duration::from_millis(700));
            }
            None
        };
        (seen(&out), late)
    });
    for (i, (got, late)) in outs.iter().enumerate() {
        let pieces: Vec<Tensor> = (0..3)
            .map(|j| {
                let start: usize = sizes[j][..i].iter().sum();
                narrow(&inp(j), 0, (start, sizes[j][i]))
            })
            .collect();
        assert_eq!(got, &seen(&cat(&pieces, 0)), "member {i}");
        if let Some(e) = late {
            assert!(
                matches!(e, CollectiveError::Timeout { op: "recv", waiting_for, .. }
                    if waiting_for == &vec![2]),
                "{e}"
            );
        }
    }
}
