//! Collectives on CUDA tensors (the emulated device, ranks as threads sharing
//! it): results equal the host collectives' and come back on the device.

use std::sync::Once;

use tpar_collectives::{spawn, ReduceOp};
use tpar_tensor::gpu::{self, EmulatedGpu};
use tpar_tensor::{DType, Device, Rng, Tensor};

/// Makes `cuda:0` the emulated device, once for all the tests of this binary (which run
/// in parallel and must not swap the device under each other's tensors).
fn emulated_cuda0() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| gpu::register_device(0, EmulatedGpu::open(0).expect("emulator")));
}

#[test]
fn collectives_take_and_return_cuda_tensors() {
    emulated_cuda0();
    spawn(3, |ctx| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let pg = ctx.world_group();
        let r = pg.rank();
        let mut rng = Rng::new(11 + r as u64);
        let host = Tensor::randn([5, 4], DType::F32, &mut rng)?;
        let dev = host.to_device(Device::Cuda(0))?;
        let before = gpu::host_round_trips();
        let sum = pg.all_reduce(&dev, ReduceOp::Sum)?;
        let gathered = pg.all_gather(&dev, 0)?;
        let scattered = pg.reduce_scatter(&dev, 1, ReduceOp::Sum)?;
        let staged = gpu::host_round_trips() - before;
        for t in [&sum, &gathered, &scattered] {
            assert_eq!(t.device(), Device::Cuda(0));
        }
        let want_sum = pg.all_reduce(&host, ReduceOp::Sum)?;
        let want_gather = pg.all_gather(&host, 0)?;
        let want_scatter = pg.reduce_scatter(&host, 1, ReduceOp::Sum)?;
        assert_eq!(sum.to_vec::<f32>()?, want_sum.to_vec::<f32>()?);
        assert_eq!(gathered.to_vec::<f32>()?, want_gather.to_vec::<f32>()?);
        assert_eq!(scattered.to_vec::<f32>()?, want_scatter.to_vec::<f32>()?);
        // the local backend stages device tensors through host memory, and says so
        assert_eq!(staged, 3);
        Ok(())
    })
    .unwrap();
}

#[test]
fn recv_shaped_delivers_on_the_requested_device() {
    emulated_cuda0();
    spawn(2, |ctx| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let pg = ctx.world_group();
        let host = Tensor::from_vec(vec![1.5f32, -2.0, 3.25, 0.0, 7.0, 8.5], [2, 3])?;
        if pg.rank() == 0 {
            // A host tensor for a receiver that wants it on the device, and back.
            pg.send_shaped(&host, 1)?;
            pg.send_shaped(&host.to_device(Device::Cuda(0))?, 1)?;
            pg.send_shaped(&host.to_device(Device::Cuda(0))?, 1)?;
        } else {
            let on_dev = pg.recv_shaped(0, &[2, 3], DType::F32, Device::Cuda(0))?;
            assert_eq!(on_dev.device(), Device::Cuda(0));
            assert_eq!(on_dev.to_vec::<f32>()?, host.to_vec::<f32>()?);
            let on_host = pg.recv_shaped(0, &[2, 3], DType::F32, Device::Cpu)?;
            assert_eq!(on_host.device(), Device::Cpu);
            assert_eq!(on_host.to_vec::<f32>()?, host.to_vec::<f32>()?);
            let stays = pg.recv_shaped(0, &[2, 3], DType::F32, Device::Cuda(0))?;
            assert_eq!(stays.device(), Device::Cuda(0));
            assert_eq!(stays.to_vec::<f32>()?, host.to_vec::<f32>()?);
        }
        Ok(())
    })
    .unwrap();
}
