//! CUDA graphs on the emulated device: capture records instead of running, a replay
//! issues the recorded launches, copies and memsets with the recorded argument bytes
//! (reading whatever device memory holds then), allocations during capture come from
//! the graph's private pool, and what CUDA refuses inside a capture is an error.

use std::sync::Arc;

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::graph::{CudaGraph, WorkCounts};
use tpar_kernels::cuda::ops::elementwise::{binary, scalar, BinaryOp};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, GpuDevice};
use tpar_kernels::KernelError;

/// Emulated device `cuda:n`: each test its own ordinal, since a capture records all of
/// its device's work (and the tests run on parallel threads).
fn dev(n: usize) -> Arc<dyn GpuDevice> {
    EmulatedGpu::open(n).expect("emulator")
}

fn f32s(b: &DeviceBuffer) -> Vec<f32> {
    bytemuck::cast_slice(&b.to_host().unwrap()).to_vec()
}

fn counts(d: &Arc<dyn GpuDevice>) -> WorkCounts {
    d.work_counts().expect("the emulator counts its work")
}

/// `y = (x + w) * 3` then `z = y`, and `t` zeroed: two kernels, a copy, a memset.
fn step(
    d: &Arc<dyn GpuDevice>,
    x: &DeviceBuffer,
    w: &DeviceBuffer,
    y: &mut DeviceBuffer,
    z: &mut DeviceBuffer,
    t: &mut DeviceBuffer,
    n: usize,
) -> tpar_kernels::Result<()> {
    let mut tmp = DeviceBuffer::alloc(d, n * 4)?;
    let f = CudaDType::F32;
    binary(
        &**d,
        f,
        BinaryOp::Add,
        x.as_slice(),
        &[1],
        w.as_slice(),
        &[1],
        &[n],
        tmp.as_slice_mut(),
    )?;
    scalar(&**d, f, BinaryOp::Mul, tmp.as_slice(), 3.0, false, y.as_slice_mut(), n)?;
    z.as_slice_mut().copy_from(y.as_slice())?;
    t.as_slice_mut().zero()?;
    Ok(())
}

#[test]
fn replay_reissues_the_recorded_work_on_current_memory() {
    let d = dev(1);
    let n = 37;
    let xs: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
    let ws: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.0)).collect();
    let mut x = DeviceBuffer::from_host(&d, &xs).unwrap();
    let w = DeviceBuffer::from_host(&d, &ws).unwrap();
    let mut y = DeviceBuffer::zeros(&d, n * 4).unwrap();
    let mut z = DeviceBuffer::zeros(&d, n * 4).unwrap();
    let mut t = DeviceBuffer::from_host(&d, &vec![7.0f32; n]).unwrap();
    // Eager: the reference (computed again on the host in f64 below).
    let c0 = counts(&d);
    step(&d, &x, &w, &mut y, &mut z, &mut t, n).unwrap();
    let eager = counts(&d) - c0;
    let want =
        |xs: &[f32]| -> Vec<f32> { xs.iter().zip(&ws).map(|(a, b)| (*a + *b) * 3.0).collect() };
    assert_eq!(f32s(&y), want(&xs));
    // Capture: nothing runs.
    y.as_slice_mut().zero().unwrap();
    z.as_slice_mut().zero().unwrap();
    t.upload(&vec![7.0f32; n]).unwrap();
    let c1 = counts(&d);
    let graph = CudaGraph::capture(&d, || step(&d, &x, &w, &mut y, &mut z, &mut t, n)).unwrap();
    assert_eq!(counts(&d) - c1, WorkCounts::default(), "capture ran nothing");
    assert!(f32s(&y).iter().all(|&v| v == 0.0));
    assert!(f32s(&t).iter().all(|&v| v == 7.0));
    let s = graph.stats();
    assert_eq!((s.kernels, s.copies, s.pool_blocks), (2, 2, 1), "{s:?}");
    assert!(!d.is_capturing());
    // Replay: the same work, one host call.
    let c2 = counts(&d);
    graph.replay().unwrap();
    let replay = counts(&d) - c2;
    assert_eq!(f32s(&y), want(&xs));
    assert_eq!(f32s(&z), want(&xs));
    assert!(f32s(&t).iter().all(|&v| v == 0.0));
    assert_eq!(eager.kernels_run, replay.kernels_run);
    assert_eq!(eager.copies_run, replay.copies_run);
    assert_eq!(eager.host_calls, eager.kernels_run + eager.copies_run);
    assert_eq!((replay.host_calls, replay.replays), (1, 1));
    // New input bytes in the same buffer: the replay reads them.
    let xs2: Vec<f32> = xs.iter().map(|v| v * -2.0 + 0.5).collect();
    x.upload(&xs2).unwrap();
    graph.replay().unwrap();
    assert_eq!(f32s(&y), want(&xs2));
    assert_eq!(f32s(&z), want(&xs2));
}

#[test]
fn host_round_trips_inside_capture_are_errors() {
    let d = dev(2);
    let b = DeviceBuffer::from_host(&d, &[1.0f32, 2.0]).unwrap();
    let mut o = DeviceBuffer::zeros(&d, 8).unwrap();
    type Case<'a> = (&'a str, Box<dyn Fn(&mut DeviceBuffer) -> tpar_kernels::Result<()> + 'a>);
    let cases: [Case<'_>; 3] = [
        ("device-to-host", Box::new(|_| b.to_host().map(|_| ()))),
        ("host-to-device", Box::new(|o| o.upload(&[3.0f32, 4.0]))),
        ("synchronization", Box::new(|_| d.synchronize())),
    ];
    for (what, f) in cases {
        d.begin_capture().unwrap();
        let inside = f(&mut o);
        let end = d.end_capture();
        let e = inside.expect_err(what).to_string();
        assert!(e.contains(what) && e.contains("inside capture"), "{what}: {e}");
        let Err(KernelError::Cuda { op, what: msg }) = end else {
            panic!("{what}: the capture must fail")
        };
        assert_eq!(op, "cuda graph capture");
        assert!(msg.contains(what), "{msg}");
        assert!(!d.is_capturing());
    }
    // The device works as before, and captures again.
    assert_eq!(f32s(&o), vec![0.0, 0.0]);
    let g = CudaGraph::capture(&d, || o.as_slice_mut().copy_from(b.as_slice())).unwrap();
    g.replay().unwrap();
    assert_eq!(f32s(&o), vec![1.0, 2.0]);
}

#[test]
fn captures_do_not_nest_and_replays_wait_for_the_capture_to_end() {
    let d = dev(3);
    let mut o = DeviceBuffer::zeros(&d, 8).unwrap();
    let g = CudaGraph::capture(&d, || o.as_slice_mut().zero()).unwrap();
    d.begin_capture().unwrap();
    assert!(d.begin_capture().unwrap_err().to_string().contains("do not nest"));
    assert!(g.replay().unwrap_err().to_string().contains("replay inside a capture"));
    d.end_capture().unwrap();
    assert!(d.end_capture().err().unwrap().to_string().contains("not capturing"));
    g.replay().unwrap();
}

#[test]
fn work_from_another_thread_during_capture_is_an_error() {
    let d = dev(4);
    d.begin_capture().unwrap();
    let d2 = d.clone();
    let other =
        std::thread::spawn(move || DeviceBuffer::zeros(&d2, 64).map(|_| ())).join().unwrap();
    let e = other.unwrap_err().to_string();
    assert!(e.contains("another thread"), "{e}");
    let end = d.end_capture().err().expect("the capture is spoiled").to_string();
    assert!(end.contains("another thread"), "{end}");
}

#[test]
fn the_private_pool_keeps_captured_blocks_from_other_users() {
    let d = dev(5);
    let n = 64;
    let x = DeviceBuffer::from_host(&d, &vec![2.0f32; n]).unwrap();
    let mut out = DeviceBuffer::zeros(&d, n * 4).unwrap();
    let mut scratch_ptr = 0;
    let graph = CudaGraph::capture(&d, || {
        // A temporary of the capture, freed inside it: it stays the graph's.
        let mut tmp = DeviceBuffer::alloc(&d, n * 4)?;
        scratch_ptr = tmp.ptr();
        scalar(
            &*d,
            CudaDType::F32,
            BinaryOp::Mul,
            x.as_slice(),
            5.0,
            false,
            tmp.as_slice_mut(),
            n,
        )?;
        out.as_slice_mut().copy_from(tmp.as_slice())?;
        // A second temporary of the same size reuses the freed block (stream order).
        drop(tmp);
        let again = DeviceBuffer::alloc(&d, n * 4)?;
        assert_eq!(again.ptr(), scratch_ptr, "the capture reuses its own freed block");
        Ok(())
    })
    .unwrap();
    assert_eq!(graph.stats().pool_blocks, 1);
    // Buffers allocated after the capture never get the graph's block ...
    let others: Vec<DeviceBuffer> =
        (0..8).map(|_| DeviceBuffer::from_host(&d, &vec![-1.0f32; n]).unwrap()).collect();
    assert!(others.iter().all(|b| b.ptr() != scratch_ptr));
    // ... so replays do not write into them.
    graph.replay().unwrap();
    assert_eq!(f32s(&out), vec![10.0; n]);
    assert!(others.iter().all(|b| f32s(b) == vec![-1.0; n]));
    drop(graph);
}

#[test]
fn a_pre_capture_block_freed_during_capture_and_used_by_it_is_reported() {
    let d = dev(6);
    let old = DeviceBuffer::from_host(&d, &[1.0f32; 16]).unwrap();
    let mut out = DeviceBuffer::zeros(&d, 64).unwrap();
    let r = CudaGraph::capture(&d, || {
        out.as_slice_mut().copy_from(old.as_slice())?;
        drop(old);
        Ok(())
    });
    let e = r.unwrap_err().to_string();
    assert!(e.contains("allocated before the capture and freed during it"), "{e}");
    // A pre-capture block freed during a capture that does not use it is fine.
    let unused = DeviceBuffer::zeros(&d, 32).unwrap();
    let g = CudaGraph::capture(&d, || {
        drop(unused);
        out.as_slice_mut().zero()
    })
    .unwrap();
    g.replay().unwrap();
}
