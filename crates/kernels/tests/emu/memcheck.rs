//! The emulator's memcheck (part of `Emulator::racecheck`) against kernels written
//! to fault: each mode of `racecheck/memcheck.cu`'s `mem_copy` makes one access a
//! GPU faults on or compute-sanitizer's memcheck reports, and the check must name
//! it: a read one float past a buffer's end, a write one float before its start, a
//! buffer used after it was freed, a 4-byte load, a 16-byte store and an atomic at
//! misaligned addresses, dynamic shared memory reached outside the launch's
//! bytes, past its end and before its start, and (initcheck) a read of device
//! memory nothing has written since it was allocated. Mode 0 copies in bounds and
//! passes.
//! Global bounds are checked on launches over an emulated device's buffers
//! (`EmulatedGpu`), whose allocations the check knows; the same faults run without
//! a report on the plain emulator.

use crate::common;

use std::sync::Arc;

use tpar_kernels::cuda::emu::{EmulatedGpu, Emulator};
use tpar_kernels::cuda::{launch, DevPtr, DeviceBuffer, GpuDevice, LaunchConfig};

const SRC: &str = include_str!("../racecheck/memcheck.cu");
const N: usize = 64;

fn emu(check: bool) -> &'static Emulator {
    common::emu_with(check, "mem_test", SRC)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MemArgs {
    out: DevPtr,
    src: DevPtr,
    n: i32,
    mode: i32,
}

fn input() -> Vec<f32> {
    (0..N).map(|i| i as f32 + 0.5).collect()
}

fn cfg() -> LaunchConfig {
    LaunchConfig::linear(1, N as u32).with_shared((N * 4) as u32)
}

/// How [`on_device`] prepares its buffers.
#[derive(Clone, Copy, PartialEq)]
enum Setup {
    /// `src` uploaded, `out` zeroed.
    Written,
    /// `src` freed before the launch.
    FreedSrc,
    /// `out` allocated and never written.
    UnwrittenOut,
}

/// Runs `mode` over device buffers of an emulated device on the checking
/// emulator: the output, or the launch's error.
fn on_device(mode: i32, setup: Setup) -> Result<Vec<f32>, String> {
    let dev: Arc<dyn GpuDevice> = EmulatedGpu::open_on(emu(true), 7);
    let src = DeviceBuffer::from_host(&dev, &input()).unwrap();
    let mut out = if setup == Setup::UnwrittenOut {
        DeviceBuffer::alloc(&dev, N * 4).unwrap()
    } else {
        DeviceBuffer::zeros(&dev, N * 4).unwrap()
    };
    let src_ptr = src.ptr();
    if setup == Setup::FreedSrc {
        drop(src);
    }
    let args = MemArgs { out: out.as_slice_mut().ptr(), src: src_ptr, n: N as i32, mode };
    // SAFETY: in bounds for mode 0; the other modes reach outside the buffers (or
    // a freed one), which the check stops before the access.
    let r = unsafe { launch(dev.as_ref(), "mem_copy", cfg(), &args) };
    r.map_err(|e| e.to_string())?;
    Ok(bytemuck::cast_slice(&out.to_host().unwrap()).to_vec())
}

/// Runs `mode` on the plain or the checking emulator over host memory with 16
/// floats of room on either side, so that every mode stays inside it: the output
/// or the launch's error.
fn on_host(mode: i32, check: bool) -> Result<Vec<f32>, String> {
    let mut src = vec![0f32; N + 32];
    src[16..16 + N].copy_from_slice(&input());
    let mut out = vec![0f32; N + 32];
    let args = MemArgs {
        out: out[16..].as_mut_ptr() as DevPtr,
        src: src[16..].as_ptr() as DevPtr,
        n: N as i32,
        mode,
    };
    // SAFETY: every mode stays inside `src` and `out`, which outlive the launch.
    let r = unsafe { launch(emu(check), "mem_copy", cfg(), &args) };
    r.map(|()| out[16..16 + N].to_vec()).map_err(|e| e.to_string())
}

/// `mode` fails under the check with every one of `needles` in its report; on
/// the plain emulator it runs (unless the plain emulator is itself the checking
/// one, under `TPAR_EMU_RACECHECK=1`), except mode 4, whose misaligned 16-byte
/// store the host compiler may emit as an aligned vector store: there it runs or
/// fails the launch with the host's fault.
fn reported(mode: i32, device: bool, needles: &[&str]) {
    let err = if device { on_device(mode, Setup::Written) } else { on_host(mode, true) }
        .expect_err(&format!("mode {mode}: nothing reported"));
    assert!(err.contains("memcheck: "), "mode {mode}: {err}");
    for n in needles {
        assert!(err.contains(n), "mode {mode}: {n:?} not in: {err}");
    }
    if emu(false).checks_races() {
        return;
    }
    match on_host(mode, false) {
        Err(e) if mode == 4 => assert!(e.contains("fault: a general-protection fault"), "{e}"),
        r => {
            r.unwrap_or_else(|e| panic!("mode {mode} plain: {e}"));
        }
    }
}

#[test]
fn in_bounds_copies_pass_on_device_and_host_memory() {
    assert_eq!(on_device(0, Setup::Written).unwrap(), input());
    // mode 8 adds into out, zeroed first
    assert_eq!(on_device(8, Setup::Written).unwrap(), input());
    assert_eq!(on_host(0, true).unwrap(), input());
}

#[test]
fn global_reads_past_the_end_and_writes_before_the_start_are_named() {
    reported(
        1,
        true,
        &[
            "out of bounds: a load of 4 bytes",
            "at byte 256 of the 256-byte allocation",
            "past its end",
            "block (0,0,0) thread (63,0,0)",
            "mem_copy",
        ],
    );
    reported(
        2,
        true,
        &["a store of 4 bytes", "at byte -4 of the 256-byte allocation", "thread (0,0,0)"],
    );
    // host memory the check does not know is not checked for bounds
    on_host(1, true).unwrap();
    on_host(2, true).unwrap();
}

#[test]
fn a_buffer_used_after_it_was_freed_is_named() {
    let err = on_device(0, Setup::FreedSrc).expect_err("a freed buffer read");
    assert!(err.contains("memcheck: out of bounds: a load of 4 bytes"), "{err}");
    assert!(err.contains("of the 256-byte allocation at"), "{err}");
    assert!(err.contains("which has been freed"), "{err}");
}

#[test]
fn misaligned_accesses_are_named() {
    reported(3, true, &["misaligned address: a load of 4 bytes", "4-byte aligned"]);
    reported(4, false, &["misaligned address: a store of 16 bytes", "16-byte aligned"]);
    reported(7, false, &["misaligned address: an atomic of 4 bytes", "thread (0,0,0)"]);
}

#[test]
fn shared_memory_outside_the_launch_bytes_is_named() {
    reported(
        5,
        false,
        &[
            "out of bounds: a store of 4 bytes at byte 256 of the dynamic shared memory",
            "which has 256 bytes",
            "thread (63,0,0)",
        ],
    );
    reported(6, true, &["a load of 4 bytes at byte -4 of the dynamic shared memory"]);
}

#[test]
fn a_read_of_device_memory_nothing_wrote_is_named() {
    let err = on_device(8, Setup::UnwrittenOut).expect_err("a read of unwritten memory");
    for n in [
        "memcheck: uninitialized: a load of 4 bytes",
        "of the 256-byte allocation at",
        "has not been written since the allocation",
        "mem_copy",
    ] {
        assert!(err.contains(n), "{n:?} not in: {err}");
    }
    // a kernel's own stores count as writes: mode 0 writes out without reading it
    assert_eq!(on_device(0, Setup::UnwrittenOut).unwrap(), input());
}

/// The bf16 elementwise kernels store 16-byte vectors that a call returns
/// (`Pack16<bf16>::pack`), a store the host compiler's instrumentation misses unless
/// the checked build inlines device functions: then the product below would be
/// reported as never written when the second product reads it.
#[test]
fn a_real_kernels_vector_stores_count_as_written() {
    use tpar_kernels::cuda::ops::elementwise::{binary, BinaryOp};
    use tpar_kernels::cuda::CudaDType;
    let dev: Arc<dyn GpuDevice> = EmulatedGpu::open_on(emu(true), 7);
    let n = 480;
    let one = DeviceBuffer::from_host(&dev, &vec![0x3f80u16; n]).unwrap(); // bf16 1.0
    let mut y = DeviceBuffer::alloc(&dev, n * 2).unwrap();
    let mut z = DeviceBuffer::alloc(&dev, n * 2).unwrap();
    let (d, bf16, mul) = (dev.as_ref(), CudaDType::BF16, BinaryOp::Mul);
    binary(d, bf16, mul, one.as_slice(), &[1], one.as_slice(), &[1], &[n], y.as_slice_mut())
        .unwrap();
    binary(d, bf16, mul, y.as_slice(), &[1], one.as_slice(), &[1], &[n], z.as_slice_mut())
        .unwrap_or_else(|e| panic!("the second product reads the first one's output: {e}"));
    let bits: Vec<u16> = bytemuck::cast_slice(&z.to_host().unwrap()).to_vec();
    assert!(bits.iter().all(|&b| b == 0x3f80), "{bits:?}");
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct FaultArgs {
    out: DevPtr,
    mode: i32,
    zero: i32,
}

/// Runs `mem_fault`'s `mode` (thread 5 of block 1 faults) on the plain or the
/// checking emulator: `out[0]` afterwards, or the launch's error. `out` starts
/// 16-byte aligned, so that 8 bytes into it is not.
fn fault(mode: i32, check: bool) -> Result<f32, String> {
    let mut buf = [0f32; 16];
    let skip = buf.as_ptr().align_offset(16);
    let out = &mut buf[skip..skip + 8];
    let args = FaultArgs { out: out.as_mut_ptr() as DevPtr, mode, zero: 0 };
    // SAFETY: mode 0 writes out[0]; the others fault, which the emulator turns
    // into the launch's error before anything is written.
    let r = unsafe { launch(emu(check), "mem_fault", LaunchConfig::linear(2, 32), &args) };
    r.map(|()| out[0]).map_err(|e| e.to_string())
}

/// A fault of kernel code (what a GPU reports as a misaligned or an illegal
/// address; an integer division by zero, where a GPU gives an unspecified value)
/// fails its launch with the thread named, on the plain and the checking emulator
/// alike, and the process and the emulator go on: the next launch runs.
#[test]
fn host_faults_of_kernel_code_fail_the_launch_not_the_process() {
    let mut modes: Vec<(i32, Vec<&str>)> = vec![
        (1, vec!["fault: an illegal address: an access at 0x10, where the host maps nothing"]),
        (3, vec!["fault: the thread's stack overflowed", "256 KiB"]),
    ];
    // (an aligned vector instruction, and a division that traps: x86-64's)
    if cfg!(target_arch = "x86_64") {
        modes.push((2, vec!["fault: a general-protection fault", "misaligned address"]));
        modes.push((4, vec!["fault: an arithmetic fault (an integer division by zero"]));
    }
    for check in [false, true] {
        for (mode, needles) in &modes {
            let err = fault(*mode, check)
                .expect_err(&format!("mode {mode} (check {check}): nothing reported"));
            for n in needles.iter().chain(&["by block (1,0,0) thread (5,0,0)"]) {
                assert!(err.contains(n), "mode {mode} (check {check}): {n:?} not in: {err}");
            }
            // the plain emulator points to the check that names the access
            let hint = "(the memcheck, TPAR_EMU_RACECHECK=1, names a bad access";
            assert_eq!(err.contains(hint), !emu(check).checks_races(), "{err}");
            assert_eq!(fault(0, check), Ok(1.0), "the launch after mode {mode} (check {check})");
        }
    }
}
