//! The emulator itself: tensor-core and ldmatrix fragment layouts against
//! their documented definitions, and the kernel bugs it must report.

use tpar_kernels::cuda::emu::Emulator;
use tpar_kernels::cuda::{launch, DevPtr, LaunchConfig};

const SRC: &str = r#"
struct SelfArgs {
    const void* a;
    const void* b;
    float* out;
    i32 n;
    i32 pad;
};

// D(16x8) = A(16x16, row-major bf16) * B(16x8, row-major bf16) with one
// warp; fragments gathered by hand from the documented layout.
TPAR_KERNEL(selftest_mma, SelfArgs, 32) {
    const u16* A = static_cast<const u16*>(args.a);
    const u16* B = static_cast<const u16*>(args.b);
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    u32 a[4], b[2];
    a[0] = tpar_pack2(A[g * 16 + 2 * t], A[g * 16 + 2 * t + 1]);
    a[1] = tpar_pack2(A[(g + 8) * 16 + 2 * t], A[(g + 8) * 16 + 2 * t + 1]);
    a[2] = tpar_pack2(A[g * 16 + 2 * t + 8], A[g * 16 + 2 * t + 9]);
    a[3] = tpar_pack2(A[(g + 8) * 16 + 2 * t + 8], A[(g + 8) * 16 + 2 * t + 9]);
    b[0] = tpar_pack2(B[(2 * t) * 8 + g], B[(2 * t + 1) * 8 + g]);
    b[1] = tpar_pack2(B[(2 * t + 8) * 8 + g], B[(2 * t + 9) * 8 + g]);
    float d[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    mma_16816<bf16>(d, a, b);
    args.out[g * 8 + 2 * t] = d[0];
    args.out[g * 8 + 2 * t + 1] = d[1];
    args.out[(g + 8) * 8 + 2 * t] = d[2];
    args.out[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// ldmatrix x4 (and .trans) of four 8x8 u16 matrices stored row-major one
// after another: out[lane][i] = the register i of each lane.
TPAR_KERNEL(selftest_ldmatrix, SelfArgs, 32) {
    __shared__ __align__(16) u16 tile[4 * 64];
    const u16* src = static_cast<const u16*>(args.a);
    for (int i = threadIdx.x; i < 256; i += 32) tile[i] = src[i];
    __syncwarp();
    const int lane = threadIdx.x;
    u32 r[4];
    if (args.n == 0)
        ldmatrix_x4(r, &tile[lane * 8]);
    else
        ldmatrix_x4_trans(r, &tile[lane * 8]);
    u32* out = reinterpret_cast<u32*>(args.out);
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// Half of warp 1 waits at a shuffle the other half never reaches, while
// everyone else waits at the barrier.
TPAR_KERNEL(selftest_deadlock, SelfArgs, 64) {
    if (threadIdx.x >= 32 && threadIdx.x < 48)
        args.out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
    __syncthreads();
    args.out[threadIdx.x] = 1.0f;
}

// A shuffle reading a lane that has returned.
TPAR_KERNEL(selftest_exited_lane, SelfArgs, 32) {
    if (threadIdx.x >= 16) return;
    args.out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 16);
}

// cp.async from an address that is not 16-byte aligned.
TPAR_KERNEL(selftest_misaligned, SelfArgs, 32) {
    __shared__ __align__(16) unsigned char buf[16 * 32];
    const unsigned char* src = static_cast<const unsigned char*>(args.a);
    cp_async_16(&buf[threadIdx.x * 16], src + 4 + threadIdx.x * 16, true);
    cp_async_commit();
    cp_async_wait<0>();
}

// Warp w writes its slot, and (without the barrier when n == 0) warp w+1
// reads it: the emulator's warp order must expose the race.
TPAR_KERNEL(selftest_race, SelfArgs, 256) {
    __shared__ float slot[8];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) slot[warp] = (float)(warp + 1);
    if (args.n != 0) __syncthreads();
    if (lane == 0) args.out[warp] = slot[(warp + 1) % 8];
    __syncthreads();
    if (lane == 0) slot[warp] = 0.0f;
}
"#;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SelfArgs {
    a: DevPtr,
    b: DevPtr,
    out: DevPtr,
    n: i32,
    pad: i32,
}

fn emu() -> &'static Emulator {
    let e = Emulator::get().expect("emulator");
    static ADDED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ADDED.get_or_init(|| e.add_source("selftest", SRC).expect("self-test kernels compile"));
    e
}

fn run(name: &str, threads: u32, a: &[u16], out: &mut [f32], n: i32) -> tpar_kernels::Result<()> {
    let args = SelfArgs {
        a: a.as_ptr() as DevPtr,
        b: a.as_ptr().wrapping_add(256) as DevPtr,
        out: out.as_mut_ptr() as DevPtr,
        n,
        pad: 0,
    };
    // SAFETY: each test passes the host buffers its kernel touches: `a` with
    // every u16 it reads (A, then B 256 elements in; the misaligned
    // `cp.async` reads 516 bytes), `out` with every f32 (or u32) it writes.
    unsafe { launch(emu(), name, LaunchConfig::linear(1, threads), &args) }
}

#[test]
fn mma_fragments_follow_the_documented_layout() {
    let a: Vec<f32> = (0..256).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
    let b: Vec<f32> = (0..128).map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0).collect();
    let mut ab: Vec<u16> = a.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    ab.extend(b.iter().map(|&v| half::bf16::from_f32(v).to_bits()));
    let mut out = vec![0f32; 128];
    run("selftest_mma", 32, &ab, &mut out, 0).unwrap();
    for i in 0..16 {
        for j in 0..8 {
            let want: f32 = 1.0 + (0..16).map(|k| a[i * 16 + k] * b[k * 8 + j]).sum::<f32>();
            assert!(
                (out[i * 8 + j] - want).abs() < 1e-4,
                "D[{i}][{j}] {} vs {want}",
                out[i * 8 + j]
            );
        }
    }
}

#[test]
fn ldmatrix_fragments_follow_the_documented_layout() {
    let m: Vec<u16> = (0..256).collect();
    for trans in [0, 1] {
        let mut out = vec![0f32; 128];
        run("selftest_ldmatrix", 32, &m, &mut out, trans).unwrap();
        let regs: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            for i in 0..4 {
                let at = |r: usize, c: usize| m[i * 64 + r * 8 + c] as u32;
                let (lo, hi) = if trans == 0 {
                    (at(g, 2 * t), at(g, 2 * t + 1))
                } else {
                    (at(2 * t, g), at(2 * t + 1, g))
                };
                assert_eq!(
                    regs[lane * 4 + i],
                    lo | (hi << 16),
                    "lane {lane} reg {i} trans {trans}"
                );
            }
        }
    }
}

fn err_of(name: &str, threads: u32) -> String {
    let a = vec![0u16; 2048];
    let mut out = vec![0f32; 64];
    format!("{}", run(name, threads, &a, &mut out, 0).unwrap_err())
}

#[test]
fn kernel_bugs_are_reported_not_hung() {
    assert!(err_of("selftest_deadlock", 64).contains("deadlock"));
    assert!(err_of("selftest_exited_lane", 32).contains("exited"));
    assert!(err_of("selftest_misaligned", 32).contains("aligned"));
    // the emulator keeps working after a failed launch
    mma_fragments_follow_the_documented_layout();
}

#[test]
fn a_missing_barrier_shows_in_some_warp_order() {
    let a = vec![0u16; 512];
    let want: Vec<f32> = (0..8).map(|w| ((w + 1) % 8 + 1) as f32).collect();
    let mut out = vec![0f32; 8];
    run("selftest_race", 256, &a, &mut out, 1).unwrap();
    assert_eq!(out, want, "with the barrier every warp reads its neighbour's value");
    if emu().checks_races() {
        // under TPAR_EMU_RACECHECK=1 the race check names the missing barrier at once
        let err = run("selftest_race", 256, &a, &mut out, 0).unwrap_err().to_string();
        assert!(err.contains("racecheck"), "{err}");
        return;
    }
    let mut wrong = 0;
    for seed in 0..8 {
        emu().set_seed(seed);
        let mut out = vec![0f32; 8];
        run("selftest_race", 256, &a, &mut out, 0).unwrap();
        wrong += (out != want) as usize;
    }
    emu().set_seed(0x7470_6172);
    assert!(wrong > 0, "the race went unseen in 8 warp orders");
}
