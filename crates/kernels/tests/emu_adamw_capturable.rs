//! The capturable AdamW step (coefficients read from device memory) on the emulated
//! device: the non-capturable kernels' bits, launched eagerly and replayed from one
//! captured graph whose coefficients the host rewrites before each replay (with and
//! without bf16 working copies, a learning rate that changes every step, and more
//! tensors than one launch takes).

use std::sync::Arc;

use tpar_kernels::adamw::AdamWParams;
use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::cuda::graph::CudaGraph;
use tpar_kernels::cuda::ops::adamw::{
    adamw_step_each, adamw_step_each_device_coef, adamw_step_each_with_copies, AdamwViews,
};
use tpar_kernels::cuda::raw::adamw::coefficients;
use tpar_kernels::cuda::{CudaDType, DeviceBuffer, DeviceSliceMut, GpuDevice};

fn hyper(step: u64) -> AdamWParams {
    // A schedule: the learning rate changes every step.
    let lr = 1e-2 / (1.0 + 0.37 * step as f64);
    AdamWParams { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step }
}

/// A small deterministic generator (xorshift), values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// One optimizer's device state: parameters, gradients, moments, copies.
struct State {
    p: Vec<DeviceBuffer>,
    g: Vec<DeviceBuffer>,
    m: Vec<DeviceBuffer>,
    v: Vec<DeviceBuffer>,
    c: Vec<DeviceBuffer>,
    n: Vec<usize>,
}

impl State {
    fn new(dev: &Arc<dyn GpuDevice>, lens: &[usize], seed: u64) -> State {
        let mut r = Rng(seed);
        let up = |d: &[f32]| DeviceBuffer::from_host(dev, d).unwrap();
        let z = |n: usize| DeviceBuffer::zeros(dev, n * 4).unwrap();
        State {
            p: lens.iter().map(|&n| up(&r.vec(n))).collect(),
            g: lens.iter().map(|&n| up(&r.vec(n))).collect(),
            m: lens.iter().map(|&n| z(n)).collect(),
            v: lens.iter().map(|&n| z(n)).collect(),
            c: lens.iter().map(|&n| DeviceBuffer::zeros(dev, n * 2).unwrap()).collect(),
            n: lens.to_vec(),
        }
    }

    fn views(&mut self) -> Vec<AdamwViews<'_>> {
        let mut out = Vec::new();
        for ((((p, g), m), v), &n) in self
            .p
            .iter_mut()
            .zip(&self.g)
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut())
            .zip(&self.n)
        {
            out.push(AdamwViews {
                param: p.as_slice_mut(),
                grad: g.as_slice(),
                exp_avg: m.as_slice_mut(),
                exp_avg_sq: v.as_slice_mut(),
                n,
            });
        }
        out
    }

    /// Every buffer's bytes, to compare bit for bit.
    fn bytes(&self) -> Vec<Vec<u8>> {
        [&self.p, &self.m, &self.v, &self.c]
            .iter()
            .flat_map(|bs| bs.iter().map(|b| b.to_host().unwrap()))
            .collect()
    }

    /// New gradients for the next step (the same on both sides).
    fn regrad(&mut self, seed: u64) {
        let mut r = Rng(seed);
        for (g, &n) in self.g.iter_mut().zip(&self.n) {
            g.upload(&r.vec(n)).unwrap();
        }
    }
}

/// Working copies for every tensor but each third one.
fn copies_of(s: &mut [DeviceBuffer]) -> Vec<Option<DeviceSliceMut<'_>>> {
    s.iter_mut().enumerate().map(|(i, b)| (i % 3 != 1).then(|| b.as_slice_mut())).collect()
}

fn write_coef(coef: &mut DeviceBuffer, h: &AdamWParams) {
    coef.upload(bytemuck::bytes_of(&coefficients(h))).unwrap();
}

fn run(with_copies: bool) {
    // One emulated device per test (a capture records all of its device's work).
    let dev = EmulatedGpu::open(usize::from(with_copies) + 1).unwrap();
    let d = &*dev;
    // 37 tensors (two launches), odd lengths, an empty one.
    let lens: Vec<usize> = (0..37).map(|i| (i * 7 + 3) % 41 + usize::from(i % 5 == 0)).collect();
    let mut lens = lens;
    lens[4] = 0;
    let (mut eager, mut dc, mut graphed) =
        (State::new(&dev, &lens, 11), State::new(&dev, &lens, 11), State::new(&dev, &lens, 11));
    let f32d = CudaDType::F32;
    let mut coef =
        DeviceBuffer::zeros(&dev, std::mem::size_of_val(&coefficients(&hyper(1)))).unwrap();
    let mut coef_g = DeviceBuffer::zeros(&dev, coef.len()).unwrap();
    // The graph of the capturable step on `graphed`'s buffers.
    let graph = {
        let s = &mut graphed;
        let mut c = std::mem::take(&mut s.c);
        let cs = copies_of(&mut c);
        let views = s.views();
        let cs = with_copies.then_some((CudaDType::BF16, cs.as_slice()));
        let g = CudaGraph::capture(&dev, || {
            adamw_step_each_device_coef(d, f32d, f32d, &views, cs, coef_g.as_slice())
        })
        .unwrap();
        drop(views);
        s.c = c;
        g
    };
    assert!(graph.stats().kernels >= 2, "{:?}", graph.stats());
    for step in 1..=4u64 {
        let h = hyper(step);
        // The reference: the non-capturable kernels, coefficients in the arguments.
        {
            let mut c = std::mem::take(&mut eager.c);
            let cs = copies_of(&mut c);
            let views = eager.views();
            if with_copies {
                adamw_step_each_with_copies(d, CudaDType::BF16, &views, &cs, &h).unwrap();
            } else {
                adamw_step_each(d, f32d, f32d, &views, &h).unwrap();
            }
            drop(views);
            eager.c = c;
        }
        // The capturable kernels launched eagerly.
        {
            write_coef(&mut coef, &h);
            let mut c = std::mem::take(&mut dc.c);
            let cs = copies_of(&mut c);
            let views = dc.views();
            let cs = with_copies.then_some((CudaDType::BF16, cs.as_slice()));
            adamw_step_each_device_coef(d, f32d, f32d, &views, cs, coef.as_slice()).unwrap();
            drop(views);
            dc.c = c;
        }
        // The graph, its coefficients written before the replay.
        write_coef(&mut coef_g, &h);
        graph.replay().unwrap();
        let want = eager.bytes();
        assert_eq!(dc.bytes(), want, "step {step}: device coefficients, eager launch");
        assert_eq!(graphed.bytes(), want, "step {step}: device coefficients, graph replay");
        for s in [&mut eager, &mut dc, &mut graphed] {
            s.regrad(100 + step);
        }
    }
    // The parameters moved (the test would see a step that did nothing).
    let fresh = State::new(&dev, &lens, 11);
    assert_ne!(eager.p[0].to_host().unwrap(), fresh.p[0].to_host().unwrap());
}

#[test]
fn capturable_adamw_is_the_plain_steps_bits() {
    run(false);
}

#[test]
fn capturable_adamw_with_working_copies_is_the_plain_steps_bits() {
    run(true);
}

#[test]
fn a_coefficient_buffer_too_small_is_an_error() {
    let dev = EmulatedGpu::open(3).unwrap();
    let mut s = State::new(&dev, &[5], 3);
    let small = DeviceBuffer::zeros(&dev, 16).unwrap();
    let views = s.views();
    let f32d = CudaDType::F32;
    let e = adamw_step_each_device_coef(&*dev, f32d, f32d, &views, None, small.as_slice());
    let e = e.unwrap_err().to_string();
    assert!(e.contains("coefficients"), "{e}");
}
