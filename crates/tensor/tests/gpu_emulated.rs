//! CUDA tensors on the emulated device: storage, moves, host fallbacks and
//! device kernels, against the same computation on the CPU.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::{gpu, DType, Device, Rng, Tensor};

const DEV: Device = Device::Cuda(0);

fn setup() {
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
}

fn close(a: &[f64], b: &[f64], tol: f64) -> bool {
    let scale = b.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * scale)
}

#[test]
fn moves_between_host_and_device() {
    setup();
    let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.5], [3]).unwrap();
    let d = x.to_device(DEV).unwrap();
    assert_eq!(d.device(), DEV);
    assert_eq!(d.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    let back = d.to_device(Device::Cpu).unwrap();
    assert_eq!(back.device(), Device::Cpu);
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    let z = Tensor::full([2, 2], 1.5, DType::BF16, DEV).unwrap();
    assert_eq!(z.to_vec_f64().unwrap(), vec![1.5; 4]);
    let ids = Tensor::from_vec(vec![3i64, 1], [2]).unwrap().to_device(DEV).unwrap();
    assert_eq!(ids.to_vec::<i64>().unwrap(), vec![3, 1]);
    // copy_ and release / refill on the device
    let t = Tensor::zeros([3], DType::F32, DEV).unwrap();
    t.copy_(&x).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    assert_eq!(t.release_storage_(), 12);
    assert!(t.is_released());
    t.fill_storage_(x.to_device(DEV).unwrap()).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
}

#[test]
fn rms_norm_runs_on_the_device_forward_and_backward() {
    setup();
    let mut rng = Rng::new(3);
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::randn([4, 3, 40], dtype, &mut rng).unwrap().requires_grad_(true);
        let w = Tensor::randn([40], dtype, &mut rng).unwrap().requires_grad_(true);
        let gy = Tensor::randn([4, 3, 40], dtype, &mut rng).unwrap();
        // CPU reference
        let y = x.rms_norm(&w, 1e-6).unwrap();
        y.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
        let (gx_ref, gw_ref) = (x.grad().unwrap(), w.grad().unwrap());
        x.zero_grad();
        w.zero_grad();
        // device: leaves stay on the host, the graph crosses to cuda:0 and back
        let before = gpu::host_round_trips();
        let xd = x.to_device(DEV).unwrap();
        let wd = w.to_device(DEV).unwrap();
        let yd = xd.rms_norm(&wd, 1e-6).unwrap();
        assert_eq!(yd.device(), DEV);
        assert_eq!(gpu::host_round_trips(), before, "rms_norm forward must stay on the device");
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        assert!(close(&yd.to_vec_f64().unwrap(), &y.to_vec_f64().unwrap(), tol));
        let gyd = gy.to_device(DEV).unwrap();
        yd.mul(&gyd).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(close(
            &x.grad().unwrap().to_vec_f64().unwrap(),
            &gx_ref.to_vec_f64().unwrap(),
            tol
        ));
        assert!(close(
            &w.grad().unwrap().to_vec_f64().unwrap(),
            &gw_ref.to_vec_f64().unwrap(),
            tol
        ));
    }
}

#[test]
fn ops_without_device_kernels_fall_back_through_the_host() {
    setup();
    let mut rng = Rng::new(5);
    let a = Tensor::randn([5, 7], DType::F32, &mut rng).unwrap().requires_grad_(true);
    let b = Tensor::randn([7, 3], DType::F32, &mut rng).unwrap().requires_grad_(true);
    let want = a.matmul(&b).unwrap().tanh().unwrap().sum_all().unwrap();
    want.backward().unwrap();
    let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
    a.zero_grad();
    b.zero_grad();
    let ad = a.to_device(DEV).unwrap();
    let bd = b.to_device(DEV).unwrap();
    let got = ad.matmul(&bd).unwrap().tanh().unwrap().sum_all().unwrap();
    assert_eq!(got.device(), DEV);
    assert!((got.item().unwrap() - want.item().unwrap()).abs() < 1e-5);
    got.backward().unwrap();
    assert!(close(&a.grad().unwrap().to_vec_f64().unwrap(), &ga.to_vec_f64().unwrap(), 1e-5));
    assert!(close(&b.grad().unwrap().to_vec_f64().unwrap(), &gb.to_vec_f64().unwrap(), 1e-5));
}

#[test]
fn mixing_devices_is_an_error() {
    setup();
    let a = Tensor::zeros([2], DType::F32, DEV).unwrap();
    let b = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
    assert!(a.add(&b).is_err());
}

#[test]
fn split_backward_on_the_device() {
    use tpar_tensor::autograd::backward_input;
    setup();
    let mut rng = Rng::new(6);
    let x = Tensor::randn([2, 3, 4], DType::F32, &mut rng).unwrap();
    let w = Tensor::randn([5, 4], DType::F32, &mut rng).unwrap().requires_grad_(true);
    let v = Tensor::randn([5, 2], DType::F32, &mut rng).unwrap().requires_grad_(true);
    let gy = Tensor::randn([2, 3, 2], DType::F32, &mut rng).unwrap();
    let fwd = |x: &Tensor, w: &Tensor, v: &Tensor| {
        x.linear(w, None).unwrap().tanh().unwrap().matmul(v).unwrap()
    };
    let xc = x.clone().requires_grad_(true);
    fwd(&xc, &w, &v).backward_with(&gy).unwrap();
    let (gx, gw, gv) = (xc.grad().unwrap(), w.grad().unwrap(), v.grad().unwrap());
    // The same on the device, split in two passes.
    let xd = x.to_device(DEV).unwrap().requires_grad_(true);
    let (wd, vd) = (w.detach().to_device(DEV).unwrap(), v.detach().to_device(DEV).unwrap());
    let (wd, vd) = (wd.requires_grad_(true), vd.requires_grad_(true));
    let y = fwd(&xd, &wd, &vd);
    let (dx, weights) = backward_input(&[y], &[gy.to_device(DEV).unwrap()], &[xd]).unwrap();
    assert!(wd.grad().is_none() && vd.grad().is_none());
    // The device matmul left its weight halves for the weight pass.
    let pending = format!("{weights:?}");
    assert_eq!(pending.matches("\"matmul\"").count(), 2, "{pending}");
    let dx = dx[0].clone().unwrap();
    assert_eq!(dx.device(), DEV);
    assert!(close(&dx.to_vec_f64().unwrap(), &gx.to_vec_f64().unwrap(), 1e-5));
    weights.run().unwrap();
    assert!(close(&wd.grad().unwrap().to_vec_f64().unwrap(), &gw.to_vec_f64().unwrap(), 1e-5));
    assert!(close(&vd.grad().unwrap().to_vec_f64().unwrap(), &gv.to_vec_f64().unwrap(), 1e-5));
}

#[test]
fn collective_building_blocks_run_device_to_device() {
    use gpu::{Block, FoldOp, Piece};
    // Devices of this test alone (others re-register cuda:0).
    gpu::register_device(5, EmulatedGpu::open(5).expect("emulator"));
    gpu::register_device(6, EmulatedGpu::open(6).expect("emulator"));
    let vals = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let a = Tensor::from_vec(vals.to_vec(), [2, 3]).unwrap().to_device(Device::Cuda(5)).unwrap();
    let before = gpu::host_round_trips();
    // cuda:5 -> cuda:6 without the host.
    let b = a.mul_scalar(1.0).unwrap().to_device(Device::Cuda(6)).unwrap();
    // Column 1..3 of both, in a [2, 4] output on cuda:6, a's then b's columns.
    let piece = |src, to_offset| Piece {
        src,
        from: Block { offset: 1, rows: 2, cols: 2, ld: 3 },
        to_offset,
        to_ld: 4,
    };
    let cat = gpu::assemble(6, &[2, 4], DType::F32, &[piece(&a, 0), piece(&b, 2)]).unwrap();
    // bf16 terms: one f32 accumulation rounded once, as the host collectives do.
    let h = Tensor::from_vec(vec![1.0f32, 1.0 / 256.0, 1.0 / 256.0], [3])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let terms: Vec<Tensor> = (0..3).map(|_| h.to_device(Device::Cuda(5)).unwrap()).collect();
    let refs: Vec<&Tensor> = terms.iter().collect();
    let sum = gpu::reduce(6, &[3], &refs, Block::flat(0, 3), FoldOp::Sum).unwrap();
    let max = gpu::reduce(
        5,
        &[1, 2],
        &[&a, &b],
        Block { offset: 1, rows: 1, cols: 2, ld: 3 },
        FoldOp::Max,
    )
    .unwrap();
    assert_eq!(gpu::host_round_trips(), before);
    assert_eq!(
        (b.device(), cat.device(), sum.device()),
        (Device::Cuda(6), Device::Cuda(6), Device::Cuda(6))
    );
    assert_eq!(cat.to_vec::<f32>().unwrap(), vec![2.0, 3.0, 2.0, 3.0, 5.0, 6.0, 5.0, 6.0]);
    assert_eq!(sum.to_vec_f64().unwrap(), vec![3.0, 3.0 / 256.0, 3.0 / 256.0]);
    assert_eq!(max.to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
    // Host sources and blocks that do not fit are typed errors.
    let host = Tensor::from_vec(vals.to_vec(), [6]).unwrap();
    assert!(gpu::reduce(5, &[6], &[&host], Block::flat(0, 6), FoldOp::Sum).is_err());
    assert!(gpu::reduce(5, &[7], &[&a], Block::flat(0, 7), FoldOp::Sum).is_err());
    let far = Piece { src: &a, from: Block::flat(4, 4), to_offset: 0, to_ld: 4 };
    assert!(gpu::assemble(5, &[4], DType::F32, &[far]).is_err());
}
