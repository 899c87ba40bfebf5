// Batched GEMM: C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b].
//
// op(A) is [M, K]: A stored row-major [M, K] (row stride lda), or, transposed
// ("t" in the layout name), stored [K, M]. op(B) is [K, N]: B stored [K, N], or
// transposed, stored [N, K]. C is [M, N] with row stride ldc. Batch b (blockIdx.z)
// of each operand starts `batch_stride_*` elements after batch b-1 (0 broadcasts
// one matrix over the batch). With beta == 0, C is not read.
//
// Kernels: tpar_gemm_<layout>_<tile>_<in>[_f32out] (layout nn, nt, tn, tt: first
// letter A, second B; tile 128x128 or 64x64), tpar_gemm_scalar_<in>[_f32out]
// and tpar_gemm_<tile>_f32; the last two take the layout from args.trans.
//
// bf16 / f16 inputs run on tensor cores (mma.sync m16n8k16, f32 accumulation):
//   - tiles 128x128 (8 warps of 64x32, 3 stages, 48 KiB of shared memory) and
//     64x64 (4 warps of 32x32, 4 stages, 32 KiB), BK = 32: operands staged
//     into XOR-swizzled shared memory by 16-byte cp.async in a multi-stage
//     pipeline, fed to the tensor cores by ldmatrix (the .trans form for
//     operands whose contiguous dim is M or N). Chunks past the edges are
//     zero-filled through the cp.async predicate; a chunk cut by the edge of
//     the contiguous dim is copied element by element, so any M, N, K work.
//     This path needs 16-byte aligned operand rows: A and B 16-byte aligned,
//     leading dims and batch strides multiples of 8 elements;
//   - "scalar" (64x64, 2 stages, 16 KiB) for everything else: the same
//     tensor-core main loop with element-wise, bounds-checked loads.
// f32 runs on the SIMT cores in exact f32 (no TF32): tiles 128x128 (8x8 per
// thread) and 64x64 (4x4 per thread), 256 threads, BK = 8, register-prefetched
// double buffering.
// Launch: a 1-D grid of ceil(M / BM) * ceil(N / BN) blocks, gridDim.z = batch;
// the tiles are visited in groups of 8 tile rows for L2 reuse.

struct GemmArgs {
    const void* a;
    const void* b;
    void* c;
    i64 batch_stride_a;
    i64 batch_stride_b;
    i64 batch_stride_c;
    i32 m;
    i32 n;
    i32 k;
    i32 lda;
    i32 ldb;
    i32 ldc;
    float alpha;
    float beta;
    i32 trans;  // bit 0: A stored [K, M]; bit 1: B stored [N, K]
    i32 pad;
};

namespace gemm {

// Depth of one shared-memory K slice of the tensor-core kernels.
constexpr int BK = 32;

struct alignas(16) F4 {
    float x, y, z, w;
};

// Tile coordinates (tm, tn) of this block in a BM x BN tiling of C. The grid is
// 1-D over the tiles (z over the batch); consecutive blocks sweep groups of 8
// tile rows column by column, so the A rows and B columns they share stay in L2.
template <int BM, int BN>
TPAR_DEVICE void tile_coords(const GemmArgs& p, int& tm, int& tn) {
    constexpr int kGroup = 8;
    const int tiles_m = (p.m + BM - 1) / BM, tiles_n = (p.n + BN - 1) / BN;
    const int pid = (int)blockIdx.x;
    const int per_group = kGroup * tiles_n;
    const int first_m = (pid / per_group) * kGroup;
    const int gsize = min(tiles_m - first_m, kGroup);
    const int in_group = pid % per_group;
    tm = first_m + in_group % gsize;
    tn = in_group / gsize;
}

// ---------------------------------------------------------------- tensor cores

// Element offset of 16-byte chunk `c` of row `r` in a shared operand tile.
// K-contiguous tiles (KC) are [W][BK] (4 chunks a row, chunk XOR (r/2)%4);
// MN-contiguous tiles are [BK][W] (W/8 chunks a row, chunk XOR r%8). Either way
// the 8 rows one ldmatrix matrix reads fall in 8 distinct bank groups.
template <bool KC, int W>
TPAR_DEVICE int tile_off(int r, int c) {
    if (KC) return r * BK + ((c ^ ((r >> 1) & 3)) << 3);
    return r * W + ((c ^ (r & 7)) << 3);
}

template <typename T>
TPAR_DEVICE T zero16() {
    T z;
    z.bits = 0;
    return z;
}

// Starts the copy of the K slice [k0, k0 + BK) of one operand into the shared
// tile `s` (W rows or columns along M or N). Operand element (x, k) lies at
// g[x * ld + k] when KC, else at g[k * ld + x]; only x < xlim, k < klim are
// read, the rest of the tile is zero. Whole 16-byte chunks go through
// cp.async (zero-filled without a read when out of range); a chunk cut by the
// edge of the contiguous dimension is copied element by element.
template <typename T, bool KC, int W, int NT>
TPAR_DEVICE void load_vec(T* s, const T* g, int ld, int x0, int xlim, int k0, int klim) {
    constexpr int kChunksPerRow = KC ? BK / 8 : W / 8;
    constexpr int kChunks = W * BK / 8;
    static_assert(kChunks % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int i = 0; i < kChunks / NT; ++i) {
        const int q = (int)threadIdx.x + i * NT;
        const int r = q / kChunksPerRow, c = q % kChunksPerRow;
        const int x = KC ? x0 + r : x0 + c * 8;
        const int k = KC ? k0 + c * 8 : k0 + r;
        const bool row_ok = KC ? x < xlim : k < klim;  // the strided coordinate
        const int left = KC ? klim - k : xlim - x;      // elements left in the chunk's row
        T* dst = s + tile_off<KC, W>(r, c);
        const T* src = g + (KC ? (i64)x * ld + k : (i64)k * ld + x);
        if (row_ok && left > 0 && left < 8) {  // rare: keep it compact
#pragma unroll 1
            for (int e = 0; e < 8; ++e) dst[e] = e < left ? src[e] : zero16<T>();
        } else {
            const bool ok = row_ok && left >= 8;
            cp_async_16(dst, ok ? src : g, ok);
        }
    }
}

// The same slice with element loads (any alignment, any extents), stored
// K-contiguous ([W][BK]) whatever the global layout, so one kernel serves
// every layout: element (x, k) at g[x * ld + k] when `kc`, else at
// g[k * ld + x]. Consecutive threads walk the contiguous global dimension.
template <typename T, int W, int NT>
TPAR_DEVICE void load_scalar(T* s, const T* g, int ld, bool kc, int x0, int xlim, int k0,
                             int klim) {
    constexpr int kPer = W * BK / NT;
    static_assert(NT % BK == 0 && NT % W == 0, "threads must cover whole tile rows");
    const int tid = (int)threadIdx.x;
    // this thread's first element and the step to its next ones
    const int x = kc ? tid / BK : tid % W;
    const int k = kc ? tid % BK : tid / W;
    const int dx = kc ? NT / BK : 0, dk = kc ? 0 : NT / W;
    const i64 step = (i64)(dx + dk) * ld;
    const T* src = g + (kc ? (i64)(x0 + x) * ld + (k0 + k) : (i64)(k0 + k) * ld + (x0 + x));
    T v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const bool ok = x0 + x + i * dx < xlim && k0 + k + i * dk < klim;
        v[i] = ok ? src[i * step] : zero16<T>();
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const int xi = x + i * dx, ki = k + i * dk;
        s[tile_off<true, W>(xi, ki >> 3) + (ki & 7)] = v[i];
    }
}

// Loads (VEC: starts copying) the K slice from k0 of A and B into one
// pipeline stage `s`: the A tile, then the B tile. AKC / BKC: the layouts of
// the vectorized loads; the element-wise loads take theirs from p.trans.
template <typename T, bool AKC, bool BKC, int BM, int BN, int NT, bool VEC>
struct Loader {
    static TPAR_DEVICE void stage(T* s, const T* A, const T* B, const GemmArgs& p, int m0, int n0,
                                  int k0) {
        if (VEC) {
            load_vec<T, AKC, BM, NT>(s, A, p.lda, m0, p.m, k0, p.k);
            load_vec<T, BKC, BN, NT>(s + BM * BK, B, p.ldb, n0, p.n, k0, p.k);
        } else {
            load_scalar<T, BM, NT>(s, A, p.lda, (p.trans & 1) == 0, m0, p.m, k0, p.k);
            load_scalar<T, BN, NT>(s + BM * BK, B, p.ldb, (p.trans & 2) != 0, n0, p.n, k0, p.k);
        }
    }
};

// A fragment (16 rows of op(A) from `m` within the tile, k16 step `kk`).
template <typename T, bool KC, int W>
TPAR_DEVICE void frag_a(u32 r[4], const T* s, int m, int kk, int lane) {
    if (KC) {
        // matrices: rows m..m+7 / m+8..m+15, k chunk kk/8 then kk/8 + 1
        ldmatrix_x4(r, s + tile_off<true, W>(m + (lane & 15), (kk >> 3) + (lane >> 4)));
    } else {
        // stored [k][m]: transposed loads of (k 0-7, m 0-7), (k 0-7, m 8-15),
        // (k 8-15, m 0-7), (k 8-15, m 8-15)
        const int i = lane >> 3, j = lane & 7;
        ldmatrix_x4_trans(r, s + tile_off<false, W>(kk + ((i >> 1) << 3) + j, (m >> 3) + (i & 1)));
    }
}

// B fragments of two n8 tiles at `n`, `n + 8`: r[0..1] the first, r[2..3] the second.
template <typename T, bool KC, int W>
TPAR_DEVICE void frag_b2(u32 r[4], const T* s, int n, int kk, int lane) {
    const int i = lane >> 3, j = lane & 7;
    if (KC) {
        // stored [n][k]: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
        ldmatrix_x4(r, s + tile_off<true, W>(n + ((i >> 1) << 3) + j, (kk >> 3) + (i & 1)));
    } else {
        // stored [k][n]: transposed loads of (k 0-7, n 0-7), (k 8-15, n 0-7),
        // (k 0-7, n 8-15), (k 8-15, n 8-15)
        ldmatrix_x4_trans(r, s + tile_off<false, W>(kk + ((i & 1) << 3) + j, (n >> 3) + (i >> 1)));
    }
}

// Writes alpha * v (+ beta * old) to element `p` of C.
template <typename TO>
TPAR_DEVICE void store1(TO* p, float v, float alpha, float beta) {
    float o = alpha * v;
    if (beta != 0.0f) o += beta * to_f32(*p);
    *p = from_f32<TO>(o);
}

// Two adjacent elements of C as one 4- or 8-byte word.
template <typename TO>
struct Pair {
    u32 w;
    TPAR_DEVICE TO lo() const {
        TO r;
        r.bits = (u16)(w & 0xffffu);
        return r;
    }
    TPAR_DEVICE TO hi() const {
        TO r;
        r.bits = (u16)(w >> 16);
        return r;
    }
    static TPAR_DEVICE Pair make(float v0, float v1) {
        Pair r;
        r.w = pack2_f32<TO>(v0, v1);
        return r;
    }
};
template <>
struct alignas(8) Pair<float> {
    float x, y;
    TPAR_DEVICE float lo() const { return x; }
    TPAR_DEVICE float hi() const { return y; }
    static TPAR_DEVICE Pair make(float v0, float v1) {
        Pair r;
        r.x = v0;
        r.y = v1;
        return r;
    }
};

// Writes alpha * (v0, v1) (+ beta * old) to elements p[0] (when `in0`) and
// p[1] (when `in1`) of C, as one paired access when `pairs` (p[0] aligned to
// the pair) and both are in. With beta == 0, C is not read.
template <typename TO>
TPAR_DEVICE void store_pair(TO* p, float v0, float v1, bool in0, bool in1, bool pairs, float alpha,
                            float beta) {
    const bool pair = pairs && in1;
    float o0 = alpha * v0, o1 = alpha * v1;
    if (beta != 0.0f) {
        float c0 = 0.0f, c1 = 0.0f;
        if (pair) {
            const Pair<TO> old = *reinterpret_cast<const Pair<TO>*>(p);
            c0 = to_f32(old.lo());
            c1 = to_f32(old.hi());
        } else {
            if (in0) c0 = to_f32(p[0]);
            if (in1) c1 = to_f32(p[1]);
        }
        o0 += beta * c0;
        o1 += beta * c1;
    }
    const Pair<TO> w = Pair<TO>::make(o0, o1);
    if (pair) {
        *reinterpret_cast<Pair<TO>*>(p) = w;
    } else {
        if (in0) p[0] = w.lo();
        if (in1) p[1] = w.hi();
    }
}

// The tensor-core GEMM of one BM x BN tile of C per block; warps of WM x WN.
// T: input element (bf16 / f16); TO: output element; TA / TB: A / B stored
// transposed (for VEC only; the element-wise loads read p.trans); VEC: 16-byte
// cp.async loads (see the alignment conditions above).
template <typename T, typename TO, bool TA, bool TB, int BM, int BN, int WM, int WN, int STAGES,
          bool VEC>
TPAR_DEVICE void tc(const GemmArgs& p) {
    constexpr int kWarpsN = BN / WN;
    constexpr int NT = (BM / WM) * kWarpsN * TPAR_WARP;
    constexpr int MI = WM / 16, NI = WN / 8;
    // shared layouts: as stored for the vectorized loads, K-contiguous otherwise
    constexpr bool kAKC = !TA || !VEC, kBKC = TB || !VEC;
    constexpr int kATile = BM * BK, kStage = (BM + BN) * BK;
    typedef Loader<T, kAKC, kBKC, BM, BN, NT, VEC> Load;
    static_assert(NI % 2 == 0 && WM % 16 == 0, "warp tile must be a multiple of 16x16");
    static_assert(STAGES >= 2, "at least two stages");

    T* smem = reinterpret_cast<T*>(tpar_dyn_smem);
    int tm, tn;
    tile_coords<BM, BN>(p, tm, tn);
    const int m0 = tm * BM, n0 = tn * BN;
    const T* A = static_cast<const T*>(p.a) + (i64)blockIdx.z * p.batch_stride_a;
    const T* B = static_cast<const T*>(p.b) + (i64)blockIdx.z * p.batch_stride_b;
    const int warp = (int)threadIdx.x / TPAR_WARP, lane = (int)threadIdx.x % TPAR_WARP;
    const int wm0 = (warp / kWarpsN) * WM, wn0 = (warp % kWarpsN) * WN;
    const int kt_count = (p.k + BK - 1) / BK;

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < kt_count) Load::stage(smem + s * kStage, A, B, p, m0, n0, s * BK);
        cp_async_commit();
    }

    for (int kt = 0; kt < kt_count; ++kt) {
        // slice kt has landed; every warp is done with the stage refilled below
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int next = kt + STAGES - 1;
        if (next < kt_count)
            Load::stage(smem + (next % STAGES) * kStage, A, B, p, m0, n0, next * BK);
        cp_async_commit();

        const T* sa = smem + (kt % STAGES) * kStage;
        const T* sb = sa + kATile;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[MI][4];
            u32 bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
                frag_a<T, kAKC, BM>(af[mi], sa, wm0 + mi * 16, kk, lane);
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                u32 r[4];
                frag_b2<T, kBKC, BN>(r, sb, wn0 + nj * 16, kk, lane);
                bf[2 * nj][0] = r[0];
                bf[2 * nj][1] = r[1];
                bf[2 * nj + 1][0] = r[2];
                bf[2 * nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) mma_16816<T>(acc[mi][ni], af[mi], bf[ni]);
        }
    }
    cp_async_wait<0>();

    // Epilogue: lane (group g, thread t) holds C[g (+8)][2t, 2t + 1] of each 16x8 tile.
    TO* C = static_cast<TO*>(p.c) + (i64)blockIdx.z * p.batch_stride_c;
    const bool pairs = (p.ldc % 2 == 0) && (p.batch_stride_c % 2 == 0) &&
                       ((u64)p.c % (2 * sizeof(TO)) == 0);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm0 + mi * 16 + h * 8 + g;
            if (row >= p.m) continue;
            TO* crow = C + (i64)row * p.ldc;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const int col = n0 + wn0 + ni * 8 + 2 * t;
                store_pair(crow + col, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1], col < p.n,
                           col + 1 < p.n, pairs, p.alpha, p.beta);
            }
        }
}

// Large tile: 128x128, 8 warps of 64x32, 3 stages (48 KiB).
template <typename T, typename TO, bool TA, bool TB>
TPAR_DEVICE void tc_large(const GemmArgs& p) {
    tc<T, TO, TA, TB, 128, 128, 64, 32, 3, true>(p);
}
// Small tile: 64x64, 4 warps of 32x32, 4 stages (32 KiB).
template <typename T, typename TO, bool TA, bool TB>
TPAR_DEVICE void tc_small(const GemmArgs& p) {
    tc<T, TO, TA, TB, 64, 64, 32, 32, 4, true>(p);
}
// Unaligned operands, any layout (p.trans): 64x64, element loads, 2 stages (16 KiB).
template <typename T, typename TO>
TPAR_DEVICE void tc_scalar(const GemmArgs& p) {
    tc<T, TO, false, false, 64, 64, 32, 32, 2, false>(p);
}

// ---------------------------------------------------------------- f32 (SIMT)

// Depth of one K slice of the f32 kernels, and the padding of their shared rows.
constexpr int SBK = 8;
constexpr int SPAD = 4;

// Element (x, k) of this thread's i-th load of a W-wide operand slice:
// consecutive threads walk the contiguous global dimension (k when `kc`).
template <int W>
TPAR_DEVICE void f32_elem(bool kc, int i, int& x, int& k) {
    const int e = (int)threadIdx.x + i * 256;
    x = kc ? e / SBK : e % W;
    k = kc ? e % SBK : e / W;
}

// Loads this thread's share of the K slice [k0, k0 + SBK) of one operand
// (W along M or N) into registers; element (x, k) at g[x * ld + k] when `kc`,
// else at g[k * ld + x]; zero outside x < xlim, k < klim.
template <int W>
TPAR_DEVICE void fetch_f32(float* r, const float* g, int ld, bool kc, int x0, int xlim, int k0,
                           int klim) {
    constexpr int kPer = W * SBK / 256;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        int x, k;
        f32_elem<W>(kc, i, x, k);
        const int gx = x0 + x, gk = k0 + k;
        r[i] = (gx < xlim && gk < klim) ? g[kc ? (i64)gx * ld + gk : (i64)gk * ld + gx] : 0.0f;
    }
}

// Stores what fetch_f32 loaded into the shared slice `s`, [SBK][W + SPAD].
template <int W>
TPAR_DEVICE void put_f32(float* s, const float* r, bool kc) {
    constexpr int kPer = W * SBK / 256;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        int x, k;
        f32_elem<W>(kc, i, x, k);
        s[k * (W + SPAD) + x] = r[i];
    }
}

// f32 GEMM of one (64 RM) x (64 RN) tile per block of 256 threads (16 x 16);
// thread (ty, tx) computes rows r * 64 + 4 ty + i and columns c * 64 + 4 tx + j.
// The layout comes from p.trans.
template <int RM, int RN>
TPAR_DEVICE void simt(const GemmArgs& p) {
    constexpr int BM = 64 * RM, BN = 64 * RN;
    constexpr int LA = BM + SPAD, LB = BN + SPAD;
    constexpr int NA = BM * SBK / 256, NB = BN * SBK / 256;
    const bool akc = (p.trans & 1) == 0, bkc = (p.trans & 2) != 0;
    float* sa = reinterpret_cast<float*>(tpar_dyn_smem);  // [2][SBK][LA]
    float* sb = sa + 2 * SBK * LA;                         // [2][SBK][LB]

    int tm, tn;
    tile_coords<BM, BN>(p, tm, tn);
    const int m0 = tm * BM, n0 = tn * BN;
    const float* A = static_cast<const float*>(p.a) + (i64)blockIdx.z * p.batch_stride_a;
    const float* B = static_cast<const float*>(p.b) + (i64)blockIdx.z * p.batch_stride_b;
    const int tx = (int)threadIdx.x % 16, ty = (int)threadIdx.x / 16;
    const int kt_count = (p.k + SBK - 1) / SBK;

    float acc[4 * RM][4 * RN];
#pragma unroll
    for (int i = 0; i < 4 * RM; ++i)
#pragma unroll
        for (int j = 0; j < 4 * RN; ++j) acc[i][j] = 0.0f;

    float ra[NA], rb[NB];
    fetch_f32<BM>(ra, A, p.lda, akc, m0, p.m, 0, p.k);
    fetch_f32<BN>(rb, B, p.ldb, bkc, n0, p.n, 0, p.k);
    put_f32<BM>(sa, ra, akc);
    put_f32<BN>(sb, rb, bkc);
    __syncthreads();

    for (int kt = 0; kt < kt_count; ++kt) {
        const int buf = kt & 1;
        const bool more = kt + 1 < kt_count;
        if (more) {  // global loads of the next slice overlap this slice's math
            fetch_f32<BM>(ra, A, p.lda, akc, m0, p.m, (kt + 1) * SBK, p.k);
            fetch_f32<BN>(rb, B, p.ldb, bkc, n0, p.n, (kt + 1) * SBK, p.k);
        }
        const float* ca = sa + buf * SBK * LA;
        const float* cb = sb + buf * SBK * LB;
#pragma unroll
        for (int k = 0; k < SBK; ++k) {
            float a[4 * RM], b[4 * RN];
#pragma unroll
            for (int r = 0; r < RM; ++r) {
                const F4 v = *reinterpret_cast<const F4*>(ca + k * LA + r * 64 + ty * 4);
                a[4 * r] = v.x;
                a[4 * r + 1] = v.y;
                a[4 * r + 2] = v.z;
                a[4 * r + 3] = v.w;
            }
#pragma unroll
            for (int c = 0; c < RN; ++c) {
                const F4 v = *reinterpret_cast<const F4*>(cb + k * LB + c * 64 + tx * 4);
                b[4 * c] = v.x;
                b[4 * c + 1] = v.y;
                b[4 * c + 2] = v.z;
                b[4 * c + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < 4 * RM; ++i)
#pragma unroll
                for (int j = 0; j < 4 * RN; ++j) acc[i][j] = a[i] * b[j] + acc[i][j];
        }
        if (more) {
            put_f32<BM>(sa + (buf ^ 1) * SBK * LA, ra, akc);
            put_f32<BN>(sb + (buf ^ 1) * SBK * LB, rb, bkc);
        }
        // the next slice is in place; nobody reads this one any more
        __syncthreads();
    }

    float* C = static_cast<float*>(p.c) + (i64)blockIdx.z * p.batch_stride_c;
    const bool quads = (p.ldc % 4 == 0) && (p.batch_stride_c % 4 == 0) && ((u64)p.c % 16 == 0);
#pragma unroll
    for (int i = 0; i < 4 * RM; ++i) {
        const int row = m0 + (i / 4) * 64 + ty * 4 + (i % 4);
        if (row >= p.m) continue;
        float* crow = C + (i64)row * p.ldc;
#pragma unroll
        for (int c = 0; c < RN; ++c) {
            const int col = n0 + c * 64 + tx * 4;
            if (quads && col + 3 < p.n) {
                F4 o;
                o.x = p.alpha * acc[i][4 * c];
                o.y = p.alpha * acc[i][4 * c + 1];
                o.z = p.alpha * acc[i][4 * c + 2];
                o.w = p.alpha * acc[i][4 * c + 3];
                if (p.beta != 0.0f) {
                    const F4 old = *reinterpret_cast<const F4*>(crow + col);
                    o.x += p.beta * old.x;
                    o.y += p.beta * old.y;
                    o.z += p.beta * old.z;
                    o.w += p.beta * old.w;
                }
                *reinterpret_cast<F4*>(crow + col) = o;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (col + j < p.n) store1(crow + col + j, acc[i][4 * c + j], p.alpha, p.beta);
            }
        }
    }
}

}  // namespace gemm

// ---------------------------------------------------------------- kernels

// Tensor cores, 128x128.
TPAR_KERNEL(tpar_gemm_nn_128x128_bf16, GemmArgs, 256) {
    gemm::tc_large<bf16, bf16, false, false>(args);
}
TPAR_KERNEL(tpar_gemm_nt_128x128_bf16, GemmArgs, 256) {
    gemm::tc_large<bf16, bf16, false, true>(args);
}
TPAR_KERNEL(tpar_gemm_tn_128x128_bf16, GemmArgs, 256) {
    gemm::tc_large<bf16, bf16, true, false>(args);
}
TPAR_KERNEL(tpar_gemm_tt_128x128_bf16, GemmArgs, 256) {
    gemm::tc_large<bf16, bf16, true, true>(args);
}
TPAR_KERNEL(tpar_gemm_nn_128x128_bf16_f32out, GemmArgs, 256) {
    gemm::tc_large<bf16, float, false, false>(args);
}
TPAR_KERNEL(tpar_gemm_nt_128x128_bf16_f32out, GemmArgs, 256) {
    gemm::tc_large<bf16, float, false, true>(args);
}
TPAR_KERNEL(tpar_gemm_tn_128x128_bf16_f32out, GemmArgs, 256) {
    gemm::tc_large<bf16, float, true, false>(args);
}
TPAR_KERNEL(tpar_gemm_tt_128x128_bf16_f32out, GemmArgs, 256) {
    gemm::tc_large<bf16, float, true, true>(args);
}
TPAR_KERNEL(tpar_gemm_nn_128x128_f16, GemmArgs, 256) {
    gemm::tc_large<f16, f16, false, false>(args);
}
TPAR_KERNEL(tpar_gemm_nt_128x128_f16, GemmArgs, 256) {
    gemm::tc_large<f16, f16, false, true>(args);
}
TPAR_KERNEL(tpar_gemm_tn_128x128_f16, GemmArgs, 256) {
    gemm::tc_large<f16, f16, true, false>(args);
}
TPAR_KERNEL(tpar_gemm_tt_128x128_f16, GemmArgs, 256) { gemm::tc_large<f16, f16, true, true>(args); }
TPAR_KERNEL(tpar_gemm_nn_128x128_f16_f32out, GemmArgs, 256) {
    gemm::tc_large<f16, float, false, false>(args);
}
TPAR_KERNEL(tpar_gemm_nt_128x128_f16_f32out, GemmArgs, 256) {
    gemm::tc_large<f16, float, false, true>(args);
}
TPAR_KERNEL(tpar_gemm_tn_128x128_f16_f32out, GemmArgs, 256) {
    gemm::tc_large<f16, float, true, false>(args);
}
TPAR_KERNEL(tpar_gemm_tt_128x128_f16_f32out, GemmArgs, 256) {
    gemm::tc_large<f16, float, true, true>(args);
}

// Tensor cores, 64x64.
TPAR_KERNEL(tpar_gemm_nn_64x64_bf16, GemmArgs, 128) {
    gemm::tc_small<bf16, bf16, false, false>(args);
}
TPAR_KERNEL(tpar_gemm_nt_64x64_bf16, GemmArgs, 128) {
    gemm::tc_small<bf16, bf16, false, true>(args);
}
TPAR_KERNEL(tpar_gemm_tn_64x64_bf16, GemmArgs, 128) {
    gemm::tc_small<bf16, bf16, true, false>(args);
}
TPAR_KERNEL(tpar_gemm_tt_64x64_bf16, GemmArgs, 128) {
    gemm::tc_small<bf16, bf16, true, true>(args);
}
TPAR_KERNEL(tpar_gemm_nn_64x64_bf16_f32out, GemmArgs, 128) {
    gemm::tc_small<bf16, float, false, false>(args);
}
TPAR_KERNEL(tpar_gemm_nt_64x64_bf16_f32out, GemmArgs, 128) {
    gemm::tc_small<bf16, float, false, true>(args);
}
TPAR_KERNEL(tpar_gemm_tn_64x64_bf16_f32out, GemmArgs, 128) {
    gemm::tc_small<bf16, float, true, false>(args);
}
TPAR_KERNEL(tpar_gemm_tt_64x64_bf16_f32out, GemmArgs, 128) {
    gemm::tc_small<bf16, float, true, true>(args);
}
TPAR_KERNEL(tpar_gemm_nn_64x64_f16, GemmArgs, 128) { gemm::tc_small<f16, f16, false, false>(args); }
TPAR_KERNEL(tpar_gemm_nt_64x64_f16, GemmArgs, 128) { gemm::tc_small<f16, f16, false, true>(args); }
TPAR_KERNEL(tpar_gemm_tn_64x64_f16, GemmArgs, 128) { gemm::tc_small<f16, f16, true, false>(args); }
TPAR_KERNEL(tpar_gemm_tt_64x64_f16, GemmArgs, 128) { gemm::tc_small<f16, f16, true, true>(args); }
TPAR_KERNEL(tpar_gemm_nn_64x64_f16_f32out, GemmArgs, 128) {
    gemm::tc_small<f16, float, false, false>(args);
}
TPAR_KERNEL(tpar_gemm_nt_64x64_f16_f32out, GemmArgs, 128) {
    gemm::tc_small<f16, float, false, true>(args);
}
TPAR_KERNEL(tpar_gemm_tn_64x64_f16_f32out, GemmArgs, 128) {
    gemm::tc_small<f16, float, true, false>(args);
}
TPAR_KERNEL(tpar_gemm_tt_64x64_f16_f32out, GemmArgs, 128) {
    gemm::tc_small<f16, float, true, true>(args);
}

// Tensor cores, unaligned operands, any layout (args.trans).
TPAR_KERNEL(tpar_gemm_scalar_bf16, GemmArgs, 128) { gemm::tc_scalar<bf16, bf16>(args); }
TPAR_KERNEL(tpar_gemm_scalar_bf16_f32out, GemmArgs, 128) { gemm::tc_scalar<bf16, float>(args); }
TPAR_KERNEL(tpar_gemm_scalar_f16, GemmArgs, 128) { gemm::tc_scalar<f16, f16>(args); }
TPAR_KERNEL(tpar_gemm_scalar_f16_f32out, GemmArgs, 128) { gemm::tc_scalar<f16, float>(args); }

// f32 on the SIMT cores, any layout (args.trans).
TPAR_KERNEL(tpar_gemm_128x128_f32, GemmArgs, 256) { gemm::simt<2, 2>(args); }
TPAR_KERNEL(tpar_gemm_64x64_f32, GemmArgs, 256) { gemm::simt<1, 1>(args); }
