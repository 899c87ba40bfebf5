//! The emulator's block order: the grid's by default, or drawn from the launch seed
//! (`BlockOrder::Shuffled`, `TPAR_EMU_BLOCK_ORDER=shuffled`), so that a result that
//! depends on the order blocks run in (float atomics of several blocks into one value),
//! which a GPU does not fix, changes between seeds here too. One test: the order is a
//! setting of the process's emulator.

use bytemuck::{Pod, Zeroable};
use tpar_kernels::cuda::emu::{BlockOrder, Emulator};
use tpar_kernels::cuda::{DevPtr, LaunchConfig};

const SRC: &str = r#"
struct OrderArgs {
    const float* v;
    float* sum;
    u32* counter;
    u32* seen;
};

// Each block adds its value into one float and records where it ran: seen[i]
// is the linear index of the i-th block that ran.
TPAR_KERNEL(order_sum, OrderArgs, 32) {
    if (threadIdx.x == 0) {
        const u32 id = blockIdx.x + blockIdx.y * gridDim.x;
        atomicAdd(args.sum, args.v[id]);
        args.seen[atomicAdd(args.counter, 1u)] = id;
    }
}
"#;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct OrderArgs {
    v: DevPtr,
    sum: DevPtr,
    counter: DevPtr,
    seen: DevPtr,
}

/// One launch of `order_sum` over a `grid` of clusters of `cluster` blocks: the float
/// sum of `v` in the order the blocks ran, and that order.
fn run(emu: &Emulator, seed: u64, grid: [u32; 2], cluster: u32, v: &[f32]) -> (f32, Vec<u32>) {
    let n = (grid[0] * grid[1]) as usize;
    assert_eq!(v.len(), n);
    let (mut sum, mut counter, mut seen) = (0f32, 0u32, vec![u32::MAX; n]);
    let args = OrderArgs {
        v: v.as_ptr() as DevPtr,
        sum: &mut sum as *mut f32 as DevPtr,
        counter: &mut counter as *mut u32 as DevPtr,
        seen: seen.as_mut_ptr() as DevPtr,
    };
    let cfg = LaunchConfig { grid: [grid[0], grid[1], 1], ..LaunchConfig::linear(1, 32) };
    emu.set_seed(seed);
    // SAFETY: the kernel reads `v` (one value per block) and writes one f32, one u32
    // and `n` u32, the host buffers above; the emulator runs it before returning.
    unsafe {
        emu.launch_cluster_raw("order_sum", &cfg, [cluster, 1, 1], bytemuck::bytes_of(&args))
            .expect("launch");
    }
    (sum, seen)
}

#[test]
fn blocks_run_in_the_grid_order_or_one_drawn_from_the_seed() {
    let emu = Emulator::get().expect("emulator");
    emu.add_source("block_order", SRC).expect("the test kernel compiles");
    // Values whose float sum depends on the order: large and small alternating.
    let v: Vec<f32> = (0..48)
        .map(|i| if i % 2 == 0 { 1.0e8 * (i as f32 + 1.0) } else { 3.0 + i as f32 })
        .collect();
    let in_order = v.iter().fold(0f32, |s, &x| s + x);
    let grid_order: Vec<u32> = (0..48).collect();
    let seeds = [1u64, 2, 3, 4, 5, 6];

    assert_eq!(emu.block_order(), BlockOrder::Grid, "the default (TPAR_EMU_BLOCK_ORDER unset)");
    for &seed in &seeds {
        let (sum, seen) = run(emu, seed, [8, 6], 1, &v);
        assert_eq!(seen, grid_order, "seed {seed}: the grid's order");
        assert_eq!(sum.to_bits(), in_order.to_bits(), "seed {seed}");
    }

    emu.set_block_order(BlockOrder::Shuffled);
    let mut orders = Vec::new();
    let mut sums = Vec::new();
    for &seed in &seeds {
        let (sum, seen) = run(emu, seed, [8, 6], 1, &v);
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, grid_order, "seed {seed}: every block once: {seen:?}");
        assert_eq!(run(emu, seed, [8, 6], 1, &v).1, seen, "seed {seed}: the same order again");
        orders.push(seen);
        sums.push(sum.to_bits());
    }
    assert!(orders.iter().all(|o| *o != grid_order), "{orders:?}");
    orders.dedup();
    assert!(orders.len() > 1, "one order for every seed");
    assert!(sums.iter().any(|&s| s != in_order.to_bits()), "the sums never changed: {sums:?}");

    // Clusters of 2 blocks along x still run together (their threads interleaved).
    for &seed in &seeds {
        let (_, seen) = run(emu, seed, [8, 6], 2, &v);
        for pair in seen.chunks(2) {
            let low = pair[0].min(pair[1]);
            assert!(low % 2 == 0 && pair[0].max(pair[1]) == low + 1, "seed {seed}: {seen:?}");
        }
    }
    emu.set_block_order(BlockOrder::Grid);
    assert_eq!(run(emu, 1, [8, 6], 1, &v).1, grid_order);
}
