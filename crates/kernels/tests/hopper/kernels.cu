// Test kernels of the Hopper emulation (tests/emu_hopper.rs) and its NVRTC
// compile test for sm_90a (tests/nvrtc_hopper.rs): mbarriers, bulk tensor
// copies, wgmma and setmaxnreg through the prelude's functions.

namespace hopper_test {
// Dynamic shared memory from its first 1024-byte boundary (the 128-byte
// swizzle's pattern repeats every 1024 bytes of the shared window).
TPAR_DEVICE unsigned char* smem1024() {
    const u32 a = tpar_shared_addr(tpar_dyn_smem);
    return tpar_dyn_smem + ((1024u - (a & 1023u)) & 1023u);
}
}  // namespace hopper_test

struct MbarArgs {
    float* out;
    i32 rounds;
    i32 mode;
};

// A producer warp fills a shared slot and arrives on `full` (32 arrivals);
// three consumer warps wait on it, sum the slot and arrive on `empty` (96),
// which the producer waits for before the next round. No __syncthreads
// between rounds: only the mbarriers order them, parities flipping each
// round (the producer's first wait, for parity 1 of a fresh barrier,
// returns at once). out[round * 96 + consumer] = the sum it read.
TPAR_KERNEL(hopper_mbar_ring, MbarArgs, 128) {
    __shared__ __align__(8) u64 full, empty;
    __shared__ float slot[32];
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    if (t == 0) {
        mbarrier_init(&full, 32);
        mbarrier_init(&empty, 96);
        fence_mbarrier_init();
    }
    __syncthreads();
    for (int r = 0; r < args.rounds; ++r) {
        const u32 parity = (u32)(r & 1);
        if (warp == 0) {
            mbarrier_wait_parity(&empty, parity ^ 1u);
            slot[lane] = (float)(r * 100 + lane);
            mbarrier_arrive(&full);
        } else {
            mbarrier_wait_parity(&full, parity);
            float s = 0.0f;
            for (int i = 0; i < 32; ++i) s += slot[i];
            args.out[r * 96 + (t - 32)] = s;
            mbarrier_arrive(&empty);
        }
    }
}

// mbarrier misuse the emulator must report, by `mode`: 0 waits for a second
// phase nobody completes (the parity not flipped back), 1 announces more
// transaction bytes than arrive, 2 uses a barrier never initialized, 3 is
// the correct use (with a legal setmaxnreg): no error.
TPAR_KERNEL(hopper_mbar_misuse, MbarArgs, 128) {
    __shared__ __align__(8) u64 bar;
    const int t = threadIdx.x;
    if (args.mode != 2 && t == 0) mbarrier_init(&bar, 1);
    __syncthreads();
    if (args.mode == 0) {
        if (t == 0) mbarrier_arrive(&bar);
        mbarrier_wait_parity(&bar, 0);
        mbarrier_wait_parity(&bar, 1);
    } else if (args.mode == 1) {
        if (t == 0) mbarrier_arrive_expect_tx(&bar, 64);
        mbarrier_wait_parity(&bar, 0);
    } else if (args.mode == 2) {
        if (t == 0) mbarrier_arrive(&bar);
    } else {
        setmaxnreg_dec<40>();
        if (t == 0) mbarrier_arrive(&bar);
        mbarrier_wait_parity(&bar, 0);
        args.out[t] = 1.0f;
    }
}

struct TmaArgs {
    TparTensorMap map;  // offset 0
    const void* src;    // store: the box's shared-memory image
    void* out;          // load: the box's shared-memory image
    i32 x, y;
    i32 bytes;          // box bytes
    i32 extra_tx;       // expect this many bytes more than the box (0)
};

// One box into shared memory through the tensor map, guarded by an
// mbarrier; the raw shared bytes (swizzled as they landed) go to `out`.
TPAR_KERNEL(hopper_tma_load, TPAR_GRID_CONSTANT(TmaArgs), 128) {
    __shared__ __align__(8) u64 bar;
    unsigned char* s = hopper_test::smem1024();
    const int t = threadIdx.x;
    if (t == 0) {
        tma_prefetch(&args.map);
        mbarrier_init(&bar, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (t == 0) {
        mbarrier_arrive_expect_tx(&bar, (u32)(args.bytes + args.extra_tx));
        tma_load_2d(s, &args.map, args.x, args.y, &bar);
    }
    mbarrier_wait_parity(&bar, 0);
    unsigned char* out = static_cast<unsigned char*>(args.out);
    for (int i = t; i < args.bytes; i += blockDim.x) out[i] = s[i];
}

// As hopper_tma_load for a 3-D map, the box at (x, y, z = extra_tx); then
// the image stored back through the same map at (x, y, z + 1).
TPAR_KERNEL(hopper_tma_3d, TPAR_GRID_CONSTANT(TmaArgs), 128) {
    __shared__ __align__(8) u64 bar;
    unsigned char* s = hopper_test::smem1024();
    const int t = threadIdx.x;
    if (t == 0) {
        mbarrier_init(&bar, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (t == 0) {
        mbarrier_arrive_expect_tx(&bar, (u32)args.bytes);
        tma_load_3d(s, &args.map, args.x, args.y, args.extra_tx, &bar);
    }
    mbarrier_wait_parity(&bar, 0);
    unsigned char* out = static_cast<unsigned char*>(args.out);
    for (int i = t; i < args.bytes; i += blockDim.x) out[i] = s[i];
    fence_proxy_async();
    __syncthreads();
    if (t == 0) {
        tma_store_3d(&args.map, args.x, args.y, args.extra_tx + 1, s);
        tma_store_commit();
        tma_store_wait<0>();
    }
}

// The raw shared-memory image `src` of one box written to the tensor at
// (x, y) through the tensor map.
TPAR_KERNEL(hopper_tma_store, TPAR_GRID_CONSTANT(TmaArgs), 128) {
    unsigned char* s = hopper_test::smem1024();
    const unsigned char* src = static_cast<const unsigned char*>(args.src);
    for (int i = threadIdx.x; i < args.bytes; i += blockDim.x) s[i] = src[i];
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        tma_store_2d(&args.map, args.x, args.y, s);
        tma_store_commit();
        tma_store_wait<0>();
    }
    __syncthreads();
}

struct WgmmaArgs {
    const void* a;      // A's shared image (bytes), or the A fragments (4 u32 per thread)
    const void* b;      // B's shared image
    const float* c;     // initial accumulators, N / 2 per thread
    float* out;         // accumulators after the wait, N / 2 per thread
    u32 a_bytes, b_bytes, b_at;  // image sizes; B's offset in shared memory
    u32 a_start, b_start;        // descriptor start offsets within the images
    u32 lbo_a, sbo_a, lbo_b, sbo_b;
    i32 mode_a, mode_b;          // TPAR_WG_SWIZZLE_*
    i32 variant;                 // bit 0 f16, 1 A M-major, 2 B N-major, 3 A in registers, 4.. N index
    i32 accumulate;
    i32 early_read;              // read the accumulators before the wait (a bug)
};

namespace hopper_test {
template <typename T, int N, int TA, int TB, bool RS>
TPAR_DEVICE void wgmma_case(const WgmmaArgs& a) {
    unsigned char* s = smem1024();
    const int t = threadIdx.x;
    const unsigned char* ai = static_cast<const unsigned char*>(a.a);
    const unsigned char* bi = static_cast<const unsigned char*>(a.b);
    if (!RS)
        for (u32 i = t; i < a.a_bytes; i += blockDim.x) s[i] = ai[i];
    for (u32 i = t; i < a.b_bytes; i += blockDim.x) s[a.b_at + i] = bi[i];
    fence_proxy_async();
    __syncthreads();
    float d[N / 2];
    for (int i = 0; i < N / 2; ++i) d[i] = a.c[t * (N / 2) + i];
    u32 fa[4];
    for (int i = 0; i < 4; ++i) fa[i] = RS ? static_cast<const u32*>(a.a)[t * 4 + i] : 0u;
    const u64 db = wgmma_desc(s + a.b_at + a.b_start, a.lbo_b, a.sbo_b, a.mode_b);
    wgmma_fence();
    if (RS) {
        wgmma_rs<T, N, TB>(d, fa, db, a.accumulate != 0);
    } else {
        const u64 da = wgmma_desc(s + a.a_start, a.lbo_a, a.sbo_a, a.mode_a);
        wgmma_ss<T, N, TA, TB>(d, da, db, a.accumulate != 0);
    }
    wgmma_commit();
    if (a.early_read) a.out[t * (N / 2)] = d[0];
    wgmma_wait<0>();
    for (int i = a.early_read ? 1 : 0; i < N / 2; ++i) a.out[t * (N / 2) + i] = d[i];
}

template <typename T, int N>
TPAR_DEVICE void wgmma_n(const WgmmaArgs& a) {
    switch ((a.variant >> 1) & 7) {
        case 0: wgmma_case<T, N, 0, 0, false>(a); break;
        case 1: wgmma_case<T, N, 1, 0, false>(a); break;
        case 2: wgmma_case<T, N, 0, 1, false>(a); break;
        case 3: wgmma_case<T, N, 1, 1, false>(a); break;
        case 4: wgmma_case<T, N, 0, 0, true>(a); break;
        case 6: wgmma_case<T, N, 0, 1, true>(a); break;
        default: break;
    }
}

template <typename T>
TPAR_DEVICE void wgmma_t(const WgmmaArgs& a) {
    switch (a.variant >> 4) {
        case 0: wgmma_n<T, 16>(a); break;
        case 1: wgmma_n<T, 64>(a); break;
        case 2: wgmma_n<T, 128>(a); break;
        case 3: wgmma_n<T, 256>(a); break;
        default: break;
    }
}
}  // namespace hopper_test

// One wgmma.mma_async of a warpgroup over operands the test laid out.
TPAR_KERNEL(hopper_wgmma, WgmmaArgs, 128) {
    if (args.variant & 1)
        hopper_test::wgmma_t<f16>(args);
    else
        hopper_test::wgmma_t<bf16>(args);
}

// A wgmma whose results are never waited for (a bug the emulator reports).
TPAR_KERNEL(hopper_wgmma_no_wait, WgmmaArgs, 128) {
    unsigned char* s = hopper_test::smem1024();
    float d[32];
    const u64 desc = wgmma_desc(s, 128, 256, TPAR_WG_SWIZZLE_NONE);
    wgmma_fence();
    wgmma_ss<bf16, 64, 0, 0>(d, desc, desc, false);
    wgmma_commit();
}

// Two commit groups on two accumulators: after wgmma_wait<1> only the
// first group's results have landed, after wgmma_wait<0> both.
// out[4t..4t+4] = first, second accumulator after wait<1>, then after wait<0>.
TPAR_KERNEL(hopper_wgmma_groups, WgmmaArgs, 128) {
    unsigned char* s = hopper_test::smem1024();
    const int t = threadIdx.x;
    for (int i = t; i < 4096; i += blockDim.x) s[i] = (i % 2) ? 0x3f : 0x80;  // 1.0 in bf16
    fence_proxy_async();
    __syncthreads();
    float d1[32], d2[32];
    const u64 desc = wgmma_desc(s, 128, 256, TPAR_WG_SWIZZLE_NONE);
    wgmma_fence();
    wgmma_ss<bf16, 64, 0, 0>(d1, desc, desc, false);
    wgmma_commit();
    wgmma_ss<bf16, 64, 0, 0>(d2, desc, desc, false);
    wgmma_commit();
    wgmma_wait<1>();
    args.out[4 * t] = d1[0];
    args.out[4 * t + 1] = d2[0];
    wgmma_wait<0>();
    args.out[4 * t + 2] = d1[0];
    args.out[4 * t + 3] = d2[0];
}

struct GemmTileArgs {
    TparTensorMap map_a;  // A: M x K bf16 row-major, box 64 x 64, 128-byte swizzle
    TparTensorMap map_b;  // B: N x K (K-major) or K x N (N-major), box 64 x 64, 128-byte swizzle
    float* c;             // C: M x N f32 row-major
    i32 m, n, k;
    i32 pad[11];
};

namespace hopper_test {
// C = A * B^T (TB = 0, B stored N x K) or A * B (TB = 1, B stored K x N):
// each block one 64 x 64 tile of C with one warpgroup, K in 64-wide tiles
// brought by bulk tensor copies (128-byte swizzle) and an mbarrier, four
// wgmma m64n64k16 per tile.
template <int TB>
TPAR_DEVICE void gemm_tile(const GemmTileArgs& a) {
    __shared__ __align__(8) u64 bar;
    unsigned char* sa = smem1024();
    unsigned char* sb = sa + 64 * 64 * 2;
    const int t = threadIdx.x;
    const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    if (t == 0) {
        tma_prefetch(&a.map_a);
        tma_prefetch(&a.map_b);
        mbarrier_init(&bar, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    float d[32];
    const int ktiles = (a.k + 63) / 64;
    for (int kt = 0; kt < ktiles; ++kt) {
        if (t == 0) {
            mbarrier_arrive_expect_tx(&bar, 2 * 64 * 64 * 2);
            tma_load_2d(sa, &a.map_a, kt * 64, m0, &bar);
            if (TB == 0)
                tma_load_2d(sb, &a.map_b, kt * 64, n0, &bar);
            else
                tma_load_2d(sb, &a.map_b, n0, kt * 64, &bar);
        }
        mbarrier_wait_parity(&bar, (u32)(kt & 1));
        wgmma_fence();
        for (int ks = 0; ks < 4; ++ks) {
            // K-major: 8-row groups 1024 bytes apart, the k slice 32 bytes in;
            // N-major: 8-row k groups 1024 bytes apart, the k slice 16 rows down
            const u64 da = wgmma_desc(sa + ks * 32, 16, 1024, TPAR_WG_SWIZZLE_128B);
            const u64 db = TB == 0 ? wgmma_desc(sb + ks * 32, 16, 1024, TPAR_WG_SWIZZLE_128B)
                                   : wgmma_desc(sb + ks * 2048, 8192, 1024, TPAR_WG_SWIZZLE_128B);
            wgmma_ss<bf16, 64, 0, TB>(d, da, db, kt > 0 || ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        __syncthreads();  // every warp done with the tiles before they are refilled
    }
    const int w = t / 32, g = (t % 32) / 4, q = t % 4;
    for (int i = 0; i < 32; ++i) {
        const int row = m0 + 16 * w + g + 8 * ((i / 2) % 2);
        const int col = n0 + 8 * (i / 4) + 2 * q + (i % 2);
        if (row < a.m && col < a.n) a.c[(i64)row * a.n + col] = d[i];
    }
}
}  // namespace hopper_test

TPAR_KERNEL(hopper_gemm_tile_nt, TPAR_GRID_CONSTANT(GemmTileArgs), 128) {
    hopper_test::gemm_tile<0>(args);
}
TPAR_KERNEL(hopper_gemm_tile_nn, TPAR_GRID_CONSTANT(GemmTileArgs), 128) {
    hopper_test::gemm_tile<1>(args);
}

struct ClusterArgs {
    TparTensorMap map;  // the multicast test's tensor (64 x 16 bf16 boxes, 128-byte swizzle)
    i32* out;
    i32 bytes;          // multicast box bytes
    i32 mask;           // multicast mask
    i32 pad[12];
};

// Blocks of a cluster (shared memory in tpar_dyn_smem only): each fills its
// shared words, then reads its next neighbour's through cluster_map; every
// block's thread 0 arrives on rank 0's mbarrier, which rank 0 waits for.
// out[block * 64 + t] = the neighbour's word t; out[grid * 64 + block * 2 +
// {0, 1}] = rank and cluster size (thread 0).
TPAR_KERNEL(hopper_cluster_exchange, ClusterArgs, 64) {
    unsigned char* s = hopper_test::smem1024();
    u64* bar = reinterpret_cast<u64*>(s);
    i32* words = reinterpret_cast<i32*>(s + 64);
    const int t = threadIdx.x;
    const u32 rank = cluster_ctarank(), n = cluster_nctarank();
    if (t == 0) {
        mbarrier_init(bar, n);
        fence_mbarrier_init();
    }
    words[t] = (i32)(blockIdx.x * 1000 + t);
    cluster_sync();
    const i32* next = cluster_map(words, (rank + 1) % n);
    args.out[blockIdx.x * 64 + t] = next[t];
    if (t == 0) {
        mbarrier_arrive_cluster(bar, 0);
        args.out[gridDim.x * 64 + blockIdx.x * 2] = (i32)rank;
        args.out[gridDim.x * 64 + blockIdx.x * 2 + 1] = (i32)n;
    }
    if (rank == 0) mbarrier_wait_parity(bar, 0);
    cluster_sync();  // no block leaves while another may still read its shared memory
}

// Rank 0 multicasts one box to the blocks of `mask`; each of those waits on
// its own mbarrier (same offset) and copies its shared bytes to
// out[block * bytes ..] (as bytes); the other blocks copy theirs after the
// copy was issued.
TPAR_KERNEL(hopper_cluster_multicast, TPAR_GRID_CONSTANT(ClusterArgs), 128) {
    unsigned char* s = hopper_test::smem1024();
    u64* bar = reinterpret_cast<u64*>(s + args.bytes);
    const int t = threadIdx.x;
    const u32 rank = cluster_ctarank();
    const bool mine = (args.mask >> rank) & 1;
    if (t == 0) {
        mbarrier_init(bar, 1);
        fence_mbarrier_init();
    }
    cluster_sync();
    if (t == 0 && mine) mbarrier_arrive_expect_tx(bar, (u32)args.bytes);
    if (t == 0 && rank == 0) tma_load_2d_multicast(s, &args.map, 0, 0, bar, (u16)args.mask);
    unsigned char* out = reinterpret_cast<unsigned char*>(args.out) + blockIdx.x * args.bytes;
    if (mine) {
        mbarrier_wait_parity(bar, 0);
        for (int i = t; i < args.bytes; i += blockDim.x) out[i] = s[i];
    }
    cluster_sync();
    // a block outside the mask: what its shared memory holds after the copy
    if (!mine)
        for (int i = t; i < args.bytes; i += blockDim.x) out[i] = s[i];
}

// Rank 0 multicasts one 3-D box (args.x, args.y, args.extra_tx) to the blocks
// of `mask` (the high bits of args.extra_tx >> 8); each of them copies its
// shared bytes to out[block * bytes ..]; block 0 then loads the same box
// with the plain tma_load_3d into shared memory past the first image and
// copies it to out[gridDim.x * bytes ..].
TPAR_KERNEL(hopper_cluster_multicast_3d, TPAR_GRID_CONSTANT(TmaArgs), 128) {
    unsigned char* s = hopper_test::smem1024();
    const int bytes = args.bytes;
    const int span = (bytes + 1023) / 1024 * 1024;
    u64* bar = reinterpret_cast<u64*>(s + 2 * span);
    const int t = threadIdx.x;
    const u32 rank = cluster_ctarank();
    const int z = args.extra_tx & 255, mask = args.extra_tx >> 8;
    const bool mine = (mask >> rank) & 1;
    if (t == 0) {
        mbarrier_init(&bar[0], 1);
        mbarrier_init(&bar[1], 1);
        fence_mbarrier_init();
    }
    cluster_sync();
    if (t == 0 && mine) mbarrier_arrive_expect_tx(&bar[0], (u32)bytes);
    if (t == 0 && rank == 0)
        tma_load_3d_multicast(s, &args.map, args.x, args.y, z, &bar[0], (u16)mask);
    unsigned char* out = static_cast<unsigned char*>(args.out);
    if (mine) {
        mbarrier_wait_parity(&bar[0], 0);
        for (int i = t; i < bytes; i += blockDim.x) out[blockIdx.x * bytes + i] = s[i];
    }
    if (blockIdx.x == 0) {
        if (t == 0) {
            mbarrier_arrive_expect_tx(&bar[1], (u32)bytes);
            tma_load_3d(s + span, &args.map, args.x, args.y, z, &bar[1]);
        }
        mbarrier_wait_parity(&bar[1], 0);
        for (int i = t; i < bytes; i += blockDim.x) out[gridDim.x * bytes + i] = s[span + i];
    }
    cluster_sync();
}
