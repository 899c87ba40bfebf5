//! The emulator's race check (`Emulator::racecheck`) against kernels written to
//! race: each kernel of `racecheck/kernels.cu` runs once synchronized as a GPU
//! needs (no report, the values right) and once with one thing left out, which
//! the check must name: a barrier between a shared-memory write and another
//! warp's read (static `__shared__` and dynamic shared memory), between a read
//! and the next write, a `__syncwarp` replaced by a shuffle, reads of an atomic
//! counter before the barrier, an mbarrier wait before reading a bulk tensor
//! copy (by other warps and by the issuing thread), a `fence.proxy.async`
//! before a bulk store or a wgmma reads ordinary stores, the wait for a bulk
//! store or a wgmma before its source is overwritten, and `cp.async.wait_group`;
//! in global memory, two blocks of a launch writing the same bytes, one reading
//! what the other wrote, and two threads of a block writing the same bytes; and a
//! load of shared memory nothing in the block wrote.
//! The same planted kernels run without a report on the plain emulator: the
//! check is what finds them.

use crate::common;

use tpar_kernels::cuda::emu::Emulator;
use tpar_kernels::cuda::tensor_map::{TensorMap, TensorMapDType, TensorMapSwizzle, TiledDesc};
use tpar_kernels::cuda::{launch, DevPtr, LaunchConfig};

const SRC: &str = include_str!("../racecheck/kernels.cu");

fn emu(racecheck: bool) -> &'static Emulator {
    common::emu_with(racecheck, "race_test", SRC)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RaceArgs {
    out: DevPtr,
    src: DevPtr,
    mode: i32,
    pad: i32,
}

#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RaceTmaArgs {
    map: TensorMap,
    out: DevPtr,
    mode: i32,
    pad: [i32; 13],
}

/// 1024 floats (`i * 0.5`) at a 16-byte aligned address: cp.async's source, and
/// a 32 x 32 tensor the bulk copies load from and store to.
fn global() -> Vec<u128> {
    let mut words = vec![0u128; 1024 / 4];
    let floats: &mut [f32] = bytemuck::cast_slice_mut(&mut words);
    for (i, f) in floats.iter_mut().enumerate() {
        *f = i as f32 * 0.5;
    }
    words
}

/// The 32 x 32 f32 map (one box) over the tensor at `at`.
fn map(at: DevPtr) -> TensorMap {
    TensorMap::encode_tiled_emulated(&TiledDesc {
        dtype: TensorMapDType::F32,
        global: at,
        dims: &[32, 32],
        strides: &[128],
        box_dims: &[32, 32],
        swizzle: TensorMapSwizzle::None,
    })
    .expect("a 32 x 32 f32 map")
}

/// Runs `kernel` (128 threads) in `mode` on the racecheck or the plain emulator:
/// the outputs, or the launch's error message.
fn run(kernel: &str, mode: i32, racecheck: bool) -> Result<Vec<f32>, String> {
    let mut global = global();
    let at = global.as_mut_ptr() as DevPtr;
    let mut out = vec![0f32; 256];
    let e = emu(racecheck);
    let tma = kernel == "race_tma" || kernel == "race_store";
    let shared = if tma || kernel == "race_wgmma" { 1024 + 4096 } else { 4096 };
    let blocks = if kernel == "race_global" { 2 } else { 1 };
    let cfg = LaunchConfig::linear(blocks, 128).with_shared(shared);
    // SAFETY: the kernels read at most 1024 floats of `global` (through the map
    // or `src`), write at most 256 floats of `out` and, for race_store, the map's
    // 1024 floats; both live across the launch.
    let r = unsafe {
        if tma {
            let args =
                RaceTmaArgs { map: map(at), out: out.as_mut_ptr() as DevPtr, mode, pad: [0; 13] };
            launch(e, kernel, cfg, &args)
        } else {
            let args = RaceArgs { out: out.as_mut_ptr() as DevPtr, src: at, mode, pad: 0 };
            launch(e, kernel, cfg, &args)
        }
    };
    out.truncate(if kernel == "race_global" { 256 } else { 128 });
    r.map(|()| out).map_err(|e| e.to_string())
}

/// `kernel` in `mode` fails under the race check with a message holding every
/// one of `needles`, and runs on the plain emulator (unless that is the checking
/// one too, under `TPAR_EMU_RACECHECK=1`). (A missing barrier shows as a hazard,
/// or as a load of unwritten shared memory when the reader runs first.)
fn reported(kernel: &str, mode: i32, needles: &[&str]) {
    let err = run(kernel, mode, true).expect_err(&format!("{kernel} mode {mode}: no race found"));
    assert!(err.contains("racecheck"), "{kernel} mode {mode}: {err}");
    for n in needles {
        assert!(err.contains(n), "{kernel} mode {mode}: {n:?} not in: {err}");
    }
    if !emu(false).checks_races() {
        run(kernel, mode, false).unwrap_or_else(|e| panic!("{kernel} mode {mode} plain: {e}"));
    }
}

#[test]
fn barriers_order_shared_memory_and_missing_ones_are_named() {
    let out = run("race_plain", 0, true).unwrap();
    for (t, v) in out.iter().enumerate() {
        assert_eq!(*v, ((t + 32) % 128) as f32, "thread {t}");
    }
    assert_eq!(run("race_plain", 3, true).unwrap(), out);
    // static __shared__ arrays (the kernel library's data) and dynamic shared memory
    reported("race_plain", 1, &["a __shared__ variable", "race_plain"]);
    reported("race_plain", 2, &["a __shared__ variable", "hazard"]);
    reported("race_plain", 4, &["dynamic shared memory"]);
}

#[test]
fn syncwarp_orders_a_warp_and_a_shuffle_does_not() {
    let out = run("race_plain", 5, true).unwrap();
    for (t, v) in out.iter().enumerate() {
        assert_eq!(*v, (t ^ 1) as f32, "thread {t}");
    }
    reported("race_plain", 6, &["a __shared__ variable"]);
}

#[test]
fn atomics_do_not_race_with_each_other_but_plain_reads_do() {
    let out = run("race_plain", 7, true).unwrap();
    assert!(out.iter().all(|&v| v == 128.0), "{out:?}");
    reported("race_plain", 8, &["atomic"]);
}

#[test]
fn a_load_of_unwritten_shared_memory_is_named() {
    reported("race_plain", 10, &["uninitialized shared memory", "dynamic shared memory"]);
}

#[test]
fn neighbouring_bytes_are_not_a_race() {
    let out = run("race_plain", 9, true).unwrap();
    for (t, v) in out.iter().enumerate() {
        assert_eq!(*v, (t ^ 1) as f32, "thread {t}");
    }
}

#[test]
fn a_bulk_copy_is_read_only_after_its_mbarrier_phase() {
    let out = run("race_tma", 0, true).unwrap();
    for (t, v) in out.iter().enumerate() {
        assert_eq!(*v, ((t * 7) % 1024) as f32 * 0.5, "thread {t}");
    }
    reported("race_tma", 1, &["dynamic shared memory"]);
    // the issuing thread itself must wait too
    reported("race_tma", 2, &["read-after-write", "asynchronous write", "thread (0,0,0)"]);
}

#[test]
fn a_bulk_store_needs_the_proxy_fence_and_its_wait() {
    assert!(run("race_store", 0, true).unwrap().iter().all(|&v| v == -1.0));
    reported("race_store", 1, &["fence.proxy.async", "bulk tensor store"]);
    reported("race_store", 2, &["write-after-read", "asynchronous read"]);
}

#[test]
fn a_wgmma_needs_the_proxy_fence_and_its_wait() {
    run("race_wgmma", 0, true).unwrap();
    reported("race_wgmma", 1, &["fence.proxy.async", "wgmma"]);
    reported("race_wgmma", 2, &["write-after-read", "asynchronous read"]);
}

#[test]
fn cp_async_copies_are_read_only_after_their_wait() {
    let out = run("race_cp_async", 0, true).unwrap();
    for (t, v) in out.iter().enumerate() {
        assert_eq!(*v, (4 * ((t + 32) % 128)) as f32 * 0.5, "thread {t}");
    }
    reported("race_cp_async", 1, &["read-after-write", "asynchronous write"]);
}

#[test]
fn blocks_of_a_launch_are_not_ordered_in_global_memory() {
    let out = run("race_global", 0, true).unwrap();
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, i as f32, "element {i}");
    }
    let out = run("race_global", 3, true).unwrap();
    assert!(out[..32].iter().all(|&v| v == 8.0), "{:?}", &out[..32]);
    reported(
        "race_global",
        1,
        &[
            "write-after-write",
            "global memory",
            "block (0,0,0)",
            "another block of the same launch",
        ],
    );
    // A read-after-write hazard in the grid's block order, write-after-read when the
    // reading block runs first (TPAR_EMU_BLOCK_ORDER=shuffled): both blocks named.
    reported("race_global", 2, &["-after-", "global memory", "block (0,0,0)", "block (1,0,0)"]);
    reported("race_global", 4, &["write-after-write", "global memory", "block (0,0,0)"]);
}
