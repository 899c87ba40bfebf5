// Test kernels of the emulator's race check (tests/emu_racecheck.rs): each
// takes a `mode`; mode 0 synchronizes correctly, the others leave out one
// thing a GPU needs, and the race check must name it.

struct RaceArgs {
    float* out;        // one float per thread
    const float* src;  // global source of the copies (16-byte aligned)
    i32 mode;
    i32 pad;
};

namespace race_test {
// Dynamic shared memory from its first 1024-byte boundary.
TPAR_DEVICE unsigned char* smem1024() {
    const u32 a = tpar_shared_addr(tpar_dyn_smem);
    return tpar_dyn_smem + ((1024u - (a & 1023u)) & 1023u);
}
}  // namespace race_test

// Ordinary stores and loads of shared memory (128 threads):
// 0 write, barrier, read another warp's value, barrier, write again;
// 1 the first barrier left out (a read races with a write);
// 2 the second barrier left out (the second write races with a read);
// 3 the same through dynamic shared memory, correct;
// 4 the same through dynamic shared memory, first barrier left out;
// 5 a warp exchanges through shared memory with __syncwarp between;
// 6 the same with only a shuffle between (a shuffle orders nothing);
// 7 every thread adds to one counter with atomicAdd, barrier, all read it;
// 8 the same without the barrier (the reads race with the atomics);
// 9 neighbouring threads write neighbouring bytes (no race);
// 10 threads read dynamic shared memory nothing in the block wrote.
TPAR_KERNEL(race_plain, RaceArgs, 128) {
    __shared__ float st[128];
    __shared__ int counter;
    float* dyn = reinterpret_cast<float*>(tpar_dyn_smem);
    const int t = threadIdx.x, m = args.mode;
    float* buf = (m == 3 || m == 4) ? dyn : st;
    float r = 0.0f;
    if (m <= 4) {
        buf[t] = (float)t;
        if (m != 1 && m != 4) __syncthreads();
        r = buf[(t + 32) % 128];
        if (m != 2) __syncthreads();
        buf[t] = r + 1.0f;
    } else if (m == 5 || m == 6) {
        buf[t] = (float)t;
        if (m == 5)
            __syncwarp();
        else
            r = __shfl_xor_sync(0xffffffffu, r, 1);
        r += buf[t ^ 1];
    } else if (m == 7 || m == 8) {
        if (t == 0) counter = 0;
        __syncthreads();
        atomicAdd(&counter, 1);
        if (m == 7) __syncthreads();
        r = (float)counter;
    } else if (m == 9) {
        unsigned char* bytes = tpar_dyn_smem;
        bytes[t] = (unsigned char)t;
        __syncthreads();
        r = (float)bytes[t ^ 1];
    } else {
        r = dyn[(t + 1) % 128];
    }
    args.out[t] = r;
}

// A bulk tensor load of a 32 x 32 f32 box (from args.src, a 32 x 32 tensor
// whose map is args.map) by thread 0, the others reading it (128 threads):
// 0 everyone waits on the mbarrier before reading;
// 1 warps 1..3 read without waiting;
// 2 thread 0 reads the box right after issuing the copy, before its wait.
struct RaceTmaArgs {
    TparTensorMap map;
    float* out;
    i32 mode;
    i32 pad[13];
};

TPAR_KERNEL(race_tma, TPAR_GRID_CONSTANT(RaceTmaArgs), 128) {
    __shared__ __align__(8) u64 full;
    float* s = reinterpret_cast<float*>(race_test::smem1024());
    const int t = threadIdx.x, m = args.mode;
    if (t == 0) {
        mbarrier_init(&full, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    float r = 0.0f;
    if (t == 0) {
        mbarrier_arrive_expect_tx(&full, 32 * 32 * 4);
        tma_load_2d(s, &args.map, 0, 0, &full);
        if (m == 2) r = s[5];
    }
    if (!(m == 1 && t >= 32)) mbarrier_wait_parity(&full, 0);
    r += s[(t * 7) % 1024];
    args.out[t] = r;
}

// Threads write a 32 x 32 f32 box into shared memory, thread 0 stores it
// with a bulk tensor store (128 threads):
// 0 each thread fences (fence.proxy.async) after its writes, barrier, store,
//   wait for the store's reads, barrier, the threads write again;
// 1 no fence: the store reads ordinary stores the async proxy may not see;
// 2 no wait for the store before the second writes (they race with its reads).
TPAR_KERNEL(race_store, TPAR_GRID_CONSTANT(RaceTmaArgs), 128) {
    float* s = reinterpret_cast<float*>(race_test::smem1024());
    const int t = threadIdx.x, m = args.mode;
    for (int i = t; i < 1024; i += 128) s[i] = (float)i;
    if (m != 1) fence_proxy_async();
    __syncthreads();
    if (t == 0) {
        tma_store_2d(&args.map, 0, 0, s);
        tma_store_commit();
        if (m != 2) tma_store_wait_read<0>();
    }
    __syncthreads();
    for (int i = t; i < 1024; i += 128) s[i] = -1.0f;
    if (t == 0 && m == 2) tma_store_wait<0>();
    args.out[t] = s[t];
}

// One warpgroup multiplies a 64 x 16 A by a 16 x 16 B, both written by the
// threads into shared memory as K-major core matrices without swizzle
// (A at 0: 8-row groups 256 bytes apart, the second 8 k 128 bytes on; B
// likewise at 2048):
// 0 writes, fence.proxy.async, barrier, wgmma, wait, barrier, rewrite A;
// 1 no fence between the writes and the wgmma;
// 2 A rewritten after a barrier but before the wgmma's wait.
TPAR_KERNEL(race_wgmma, RaceArgs, 128) {
    unsigned char* s = race_test::smem1024();
    u16* h = reinterpret_cast<u16*>(s);
    const int t = threadIdx.x, m = args.mode;
    for (int i = t; i < (2048 + 512) / 2; i += 128) h[i] = (u16)(0x3f80u + (i % 7));
    if (m != 1) fence_proxy_async();
    __syncthreads();
    float d[8] = {};
    const u64 da = wgmma_desc(s, 128, 256, TPAR_WG_SWIZZLE_NONE);
    const u64 db = wgmma_desc(s + 2048, 128, 256, TPAR_WG_SWIZZLE_NONE);
    wgmma_fence();
    wgmma_ss<bf16, 16, 0, 0>(d, da, db, false);
    wgmma_commit();
    if (m != 2) wgmma_wait<0>();
    __syncthreads();
    for (int i = t; i < 2048 / 2; i += 128) h[i] = 0;
    if (m == 2) wgmma_wait<0>();
    args.out[t] = d[0];
}

// Each thread copies 16 bytes from global memory into shared memory with
// cp.async; then every thread reads another warp's 16 bytes (128 threads):
// 0 commit, wait_group 0, barrier, read;
// 1 commit, barrier, read (the copies are not waited for).
TPAR_KERNEL(race_cp_async, RaceArgs, 128) {
    float* s = reinterpret_cast<float*>(tpar_dyn_smem);
    const int t = threadIdx.x;
    cp_async_16(s + 4 * t, args.src + 4 * t, true);
    cp_async_commit();
    if (args.mode != 1) cp_async_wait<0>();
    __syncthreads();
    args.out[t] = s[4 * ((t + 32) % 128)];
    cp_async_wait<0>();
}

// Global memory, 2 blocks of 128 threads, `out` holding 256 floats:
// 0 each block writes its own 128 (no race);
// 1 both blocks write the same 128 (blocks of a launch are not ordered);
// 2 block 1 reads what block 0 wrote;
// 3 every thread of both blocks adds to out[t % 32] with atomicAdd (no race);
// 4 threads t and t + 64 of one block write out[t % 64] with nothing between.
TPAR_KERNEL(race_global, RaceArgs, 128) {
    const int t = threadIdx.x, b = blockIdx.x, m = args.mode;
    if (m == 0) args.out[b * 128 + t] = (float)(b * 128 + t);
    if (m == 1) args.out[t] = (float)(b * 128 + t);
    if (m == 2) {
        if (b == 0) args.out[t] = (float)t;
        if (b == 1) args.out[128 + t] = args.out[t];
    }
    if (m == 3) atomicAdd(&args.out[t % 32], 1.0f);
    if (m == 4 && b == 0) args.out[t % 64] = (float)t;
}
