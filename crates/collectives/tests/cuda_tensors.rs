//! Collectives on CUDA tensors (the emulated device, ranks as threads sharing
//! it): results equal the host collectives' and come back on the device.

use tpar_collectives::{spawn, ReduceOp};
use tpar_tensor::gpu::{self, EmulatedGpu};
use tpar_tensor::{DType, Device, Rng, Tensor};

#[test]
fn collectives_take_and_return_cuda_tensors() {
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
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
