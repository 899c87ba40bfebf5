//! The safe launchers of `cuda::ops` on the emulated device: device buffer
//! views, host copies, the size and device checks that refuse a launch, and
//! results equal to the address-level launchers of `cuda::raw`.

use crate::common;

use std::sync::Arc;

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::ops::{elementwise as ew, gemm, layout, reduce};
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, GpuDevice};
use tpar_kernels::elementwise::{BinaryOp, UnaryOp};
use tpar_kernels::gemm::GemmShape;
use tpar_kernels::reduce::Reduction;
use tpar_kernels::KernelError;

use common::Elsewhere;

fn dev() -> Arc<dyn GpuDevice> {
    EmulatedGpu::open(0).expect("the CPU emulator builds")
}

fn download(b: &DeviceBuffer) -> Vec<f32> {
    let mut v = vec![0f32; b.len() / 4];
    b.as_slice().copy_to_host(&mut v).unwrap();
    v
}

#[test]
fn views_and_host_copies() {
    let dev = dev();
    let mut b = DeviceBuffer::from_host(&dev, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(b.len(), 16);
    let (mut head, mut tail) = b.as_slice_mut().split_at(8).unwrap();
    head.copy_from_host(&[10.0f32, 20.0]).unwrap();
    tail.zero().unwrap();
    assert_eq!(download(&b), [10.0, 20.0, 0.0, 0.0]);
    assert!(b.as_slice_mut().split_at(17).is_err());
    let v = b.slice(4..12).unwrap();
    assert_eq!((v.len(), v.ptr()), (8, b.ptr() + 4));
    let mut two = [0f32; 2];
    v.copy_to_host(&mut two).unwrap();
    assert_eq!(two, [20.0, 0.0]);
    // Out of range, reversed, or of another size than the host side: errors.
    assert!(matches!(b.slice(8..20), Err(KernelError::BufferTooSmall { need: 20, got: 16, .. })));
    let (start, end) = (12, 8);
    assert!(b.slice(start..end).is_err(), "reversed");
    assert!(v.copy_to_host(&mut [0f32; 3]).is_err());
    let mut c = DeviceBuffer::alloc(&dev, 16).unwrap();
    c.as_slice_mut().copy_from(b.as_slice()).unwrap();
    assert_eq!(download(&c), download(&b));
    assert!(c.as_slice_mut().copy_from(v).is_err(), "sizes differ");
    let mut u = DeviceBuffer::zeros(&dev, 8).unwrap();
    u.upload(&[7u8, 8]).unwrap();
    assert_eq!(u.to_host().unwrap(), [7, 8, 0, 0, 0, 0, 0, 0]);
    assert!(u.upload(&[0u8; 9]).is_err());
    assert_eq!(b.duplicate().unwrap().to_host().unwrap(), b.to_host().unwrap());
}

#[test]
fn elementwise_ops_check_sizes_and_run() {
    let dev = dev();
    let f = CudaDType::F32;
    let x = DeviceBuffer::from_host(&dev, &[1.0f32, 4.0, 9.0, 16.0]).unwrap();
    let mut y = DeviceBuffer::alloc(&dev, 16).unwrap();
    ew::unary(&*dev, f, UnaryOp::Sqrt, x.as_slice(), y.as_slice_mut(), 4).unwrap();
    assert_eq!(download(&y), [1.0, 2.0, 3.0, 4.0]);
    ew::scalar_in_place(&*dev, f, BinaryOp::Mul, y.as_slice_mut(), 2.0, false, 4).unwrap();
    assert_eq!(download(&y), [2.0, 4.0, 6.0, 8.0]);
    ew::unary_in_place(&*dev, f, UnaryOp::Neg, y.slice_mut(8..16).unwrap(), 2).unwrap();
    assert_eq!(download(&y), [2.0, 4.0, -6.0, -8.0]);
    // A row broadcast over rows: out[i][j] = a[i][j] + b[j].
    let b = DeviceBuffer::from_host(&dev, &[0.5f32, -0.5]).unwrap();
    let mut out = DeviceBuffer::alloc(&dev, 16).unwrap();
    let (a, bv) = (x.as_slice(), b.as_slice());
    ew::binary(&*dev, f, BinaryOp::Add, a, &[2, 1], bv, &[0, 1], &[2, 2], out.as_slice_mut())
        .unwrap();
    assert_eq!(download(&out), [1.5, 3.5, 9.5, 15.5]);
    ew::accumulate(&*dev, f, x.as_slice(), f, out.as_slice_mut(), 4, -1.0).unwrap();
    assert_eq!(download(&out), [0.5, -0.5, 0.5, -0.5]);

    // Views too small for the sizes given are refused before the launch.
    let before = download(&out);
    let short = x.slice(0..12).unwrap();
    let r = ew::unary(&*dev, f, UnaryOp::Exp, short, out.as_slice_mut(), 4);
    assert!(
        matches!(r, Err(KernelError::BufferTooSmall { what: "x", need: 16, got: 12, .. })),
        "{r:?}"
    );
    let r = ew::unary(&*dev, f, UnaryOp::Exp, x.as_slice(), out.slice_mut(0..8).unwrap(), 4);
    assert!(matches!(r, Err(KernelError::BufferTooSmall { what: "y", .. })), "{r:?}");
    // A stride that reaches past the operand.
    let r =
        ew::binary(&*dev, f, BinaryOp::Add, a, &[2, 1], bv, &[1, 1], &[2, 2], out.as_slice_mut());
    assert!(matches!(r, Err(KernelError::BufferTooSmall { what: "b", need: 12, .. })), "{r:?}");
    // A view that is not aligned to its elements.
    let odd = x.slice(2..10).unwrap();
    let r = ew::unary(&*dev, f, UnaryOp::Exp, odd, out.as_slice_mut(), 2);
    assert!(matches!(r, Err(KernelError::BadArguments { .. })), "{r:?}");
    assert_eq!(download(&out), before, "nothing ran");
}

#[test]
fn layout_reduce_and_gemm_match_the_host() {
    let dev = dev();
    let f = CudaDType::F32;
    // [2, 3] transposed by a strided copy.
    let x = DeviceBuffer::from_host(&dev, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let mut t = DeviceBuffer::alloc(&dev, 24).unwrap();
    layout::strided_copy(&*dev, 4, x.as_slice(), 0, &[1, 3], &[3, 2], t.as_slice_mut()).unwrap();
    assert_eq!(download(&t), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    let r = layout::strided_copy(&*dev, 4, x.as_slice(), 1, &[1, 3], &[3, 2], t.as_slice_mut());
    assert!(matches!(r, Err(KernelError::BufferTooSmall { what: "src", need: 28, .. })), "{r:?}");
    // Row sums.
    let mut s = DeviceBuffer::alloc(&dev, 8).unwrap();
    reduce::reduce(&*dev, Reduction::Sum, f, x.as_slice(), s.as_slice_mut(), 2, 3, 1, None)
        .unwrap();
    assert_eq!(download(&s), [6.0, 15.0]);
    // [2, 3] x [3, 2].
    let p = gemm::GemmProblem::new(GemmShape::new(1, 2, 2, 3), f, f);
    let mut c = DeviceBuffer::alloc(&dev, 16).unwrap();
    gemm::gemm(&*dev, &p, x.as_slice(), t.as_slice(), c.as_slice_mut()).unwrap();
    assert_eq!(download(&c), [14.0, 32.0, 32.0, 77.0]);
    let r = gemm::gemm(&*dev, &p, x.slice(0..20).unwrap(), t.as_slice(), c.as_slice_mut());
    assert!(matches!(r, Err(KernelError::BufferTooSmall { what: "A", need: 24, .. })), "{r:?}");
}

#[test]
fn buffers_of_another_memory_space_are_refused() {
    let dev = dev();
    let other: Arc<dyn GpuDevice> = Arc::new(Elsewhere(dev.clone()));
    let x = DeviceBuffer::from_host(&other, &[1.0f32; 4]).unwrap();
    let mut y = DeviceBuffer::alloc(&dev, 16).unwrap();
    let r = ew::unary(&*dev, CudaDType::F32, UnaryOp::Exp, x.as_slice(), y.as_slice_mut(), 4);
    assert!(matches!(r, Err(KernelError::WrongDevice { what: "x", .. })), "{r:?}");
    assert!(y.as_slice_mut().copy_from(x.as_slice()).is_err());
    // Two emulated devices share host memory.
    let second = EmulatedGpu::open(3).unwrap();
    let z = DeviceBuffer::from_host(&second, &[0.0f32; 4]).unwrap();
    ew::unary(&*dev, CudaDType::F32, UnaryOp::Exp, z.as_slice(), y.as_slice_mut(), 4).unwrap();
    assert_eq!(download(&y), [1.0; 4]);
    // Copies between devices: within one memory space they go device to device,
    // across spaces without a device path they are refused.
    let w = DeviceBuffer::from_host(&second, &[2.0f32, 3.0, 4.0, 5.0]).unwrap();
    y.as_slice_mut().copy_from_device(w.as_slice()).unwrap();
    assert_eq!(download(&y), [2.0, 3.0, 4.0, 5.0]);
    let r = y.as_slice_mut().copy_from_device(x.as_slice());
    assert!(matches!(r, Err(KernelError::WrongDevice { what: "source", .. })), "{r:?}");
    assert!(y.as_slice_mut().copy_from_device(w.slice(0..8).unwrap()).is_err());
}
