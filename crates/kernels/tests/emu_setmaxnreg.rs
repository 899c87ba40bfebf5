//! The emulator's `setmaxnreg` against the PTX ISA's register pool: a block
//! holds its launch's share of the register file (64K registers over its
//! threads, in units of 8: 168 per thread for 384 threads) and an empty pool;
//! `setmaxnreg.dec` returns registers to the pool and `setmaxnreg.inc` waits
//! until the pool has the registers it adds. Warpgroup counts that do not fit
//! make `.inc` wait forever, which a GPU shows as a hang and the emulator as
//! a deadlock report naming setmaxnreg.

use tpar_kernels::cuda::emu::Emulator;
use tpar_kernels::cuda::{launch, DevPtr, LaunchConfig};

const SRC: &str = include_str!("hopper/setmaxnreg.cu");

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SetmaxnregArgs {
    out: DevPtr,
    mode: i32,
    pad: i32,
}

/// Runs `hopper_setmaxnreg` in `mode` (see hopper/setmaxnreg.cu) with the
/// emulator's scheduling seed `seed`; returns what each thread wrote.
fn run(mode: i32, seed: u64) -> tpar_kernels::Result<Vec<i32>> {
    let e = Emulator::get().expect("emulator");
    static ADDED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ADDED.get_or_init(|| e.add_source("setmaxnreg_test", SRC).expect("the test kernel compiles"));
    e.set_seed(seed);
    let mut out = vec![0i32; 384];
    let args = SetmaxnregArgs { out: out.as_mut_ptr() as DevPtr, mode, pad: 0 };
    // SAFETY: `out` covers the 384 ints the kernel writes and outlives the launch.
    unsafe { launch(e, "hopper_setmaxnreg", LaunchConfig::linear(1, 384), &args)? };
    Ok(out)
}

fn every_thread_passed(out: &[i32]) {
    for (t, &v) in out.iter().enumerate() {
        assert_eq!(v, 1 + (t / 128) as i32, "thread {t}");
    }
}

#[test]
fn counts_that_fit_the_block_pass_in_any_order() {
    // 24 / 240 and 40 / 232: exactly the 384 x 168 registers the block holds
    for mode in [0, 2] {
        for seed in 0..4 {
            every_thread_passed(&run(mode, seed).unwrap());
        }
    }
}

#[test]
fn an_inc_waits_for_the_registers_a_later_dec_releases() {
    for seed in 0..4 {
        every_thread_passed(&run(3, seed).unwrap());
    }
}

#[test]
fn counts_past_the_block_share_deadlock_naming_setmaxnreg() {
    // 128 x 40 + 256 x 240 = 66,560 > 64,512
    let err = run(1, 0).unwrap_err().to_string();
    assert!(err.contains("deadlock") && err.contains("setmaxnreg.inc"), "{err}");
    assert!(err.contains("asks for 72 more per thread"), "{err}");
    assert!(err.contains("each thread held 168 at entry"), "{err}");
}

#[test]
fn an_inc_before_a_barrier_the_releasing_warps_wait_at_deadlocks() {
    let err = run(5, 0).unwrap_err().to_string();
    assert!(err.contains("deadlock") && err.contains("setmaxnreg.inc"), "{err}");
}

#[test]
fn an_inc_to_fewer_registers_than_held_is_an_error() {
    let err = run(4, 0).unwrap_err().to_string();
    assert!(err.contains("setmaxnreg.inc to 160 registers from 168"), "{err}");
}
