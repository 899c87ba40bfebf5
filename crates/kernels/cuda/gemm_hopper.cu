// The Hopper GEMM (sm_90a): C[b] = epilogue(alpha * op(A[b]) * op(B[b]) + beta * C[b]),
// A and B bf16 or f16, f32 accumulation, C bf16, f16 or f32. Launcher:
// src/cuda/raw/gemm_hopper.rs, which documents the layouts and the epilogues.
//
// One block = 3 warpgroups (384 threads), persistent over BM x BN tiles of C,
// BM = 128 and BN = 128 (kernels tpar_gemm_hopper_<layout>_<in>_<out>) or
// BN = 256 (the same names + `_n256`; a template parameter, so that each
// width has its own accumulator array and unrolled code: a runtime width
// would hold the 256-column registers in every kernel):
// - warpgroup 0 produces: after setmaxnreg_dec, one thread brings the 128 x 64
//   tiles of A and 64 x BN tiles of B of each K step into a STAGES-deep ring
//   of shared-memory stages with bulk tensor copies (128-byte swizzle), each
//   stage guarded by a "full" mbarrier (the copies' transaction bytes) and an
//   "empty" mbarrier (the consumer warps' arrivals);
// - warpgroups 1 and 2 consume (setmaxnreg_inc): each owns 64 rows of the
//   tile, waits for a stage to be full, issues four wgmma m64nBNk16 over it
//   straight from the swizzled shared memory (descriptors below), commits, and
//   once the previous stage's group has retired (wgmma_wait<1>) releases that
//   stage to the producer; then the epilogue of its 64 x BN rows.
// BN = 256 holds 128 f32 accumulators per consumer thread (64 at BN = 128)
// and reads each A tile from shared memory once per 256 columns, half the
// A traffic per FLOP of BN = 128.
//
// Shared memory (bytes; 1024 more to align the swizzle pattern, and the
// mbarriers), within the 227 KiB (232,448) a block may opt in to:
//   BN = 128: 4 stages x (16,384 A + 16,384 B) = 131,072; epilogue 2 x
//             (64 x 128 f32 staging 32,768 + 16-bit image 16,384) = 98,304;
//             12 mbarriers 96: 230,496 in all;
//   BN = 256: 3 stages x (16,384 A + 32,768 B) = 147,456; epilogue in 64-
//             column chunks, 2 x (64 x 64 f32 16,384 + image 8,192) = 49,152;
//             10 mbarriers 80: 197,712 in all (four stages, 196,608, would
//             leave room for 32-column chunks only).
//
// Both sides walk the same tiles: t = blockIdx.x, t + gridDim.x, ... in a
// grouped order (`group` tile rows at a time, column by column inside a
// group) so that blocks running together share rows of A and columns of B.
//
// Clusters (`cluster` = 2, launched as 2 x 1 x 1 thread-block clusters): the
// two blocks of a cluster walk pairs of tiles, t = cluster id, + clusters,
// ..., in the grouped order over pairs; block `rank` takes the pair's tile
// at columns n0 + BN * rank, so both share the 128 rows of A. Each
// producer loads rows 64 * rank .. + 63 of the A tile (a 64-row box) and
// multicasts them into the same stage of both blocks, and loads its own B
// tile; a block's "full" barrier thus completes on its own and its peer's
// copies. A stage is refilled only when both blocks' consumers released it:
// each consumer warp arrives on its own block's "empty" barrier and on the
// peer's (16 arrivals per phase). When N has an odd number of tiles, the
// last pair's second tile lies past N: its block still loads its half of A
// for the peer (and zeros for B) and skips the epilogue. Both blocks meet
// at a cluster barrier after the barriers' initialisation (before any copy
// or remote arrival reaches the peer) and before exiting (no block leaves
// while its peer may still arrive on its barriers).
//
// Layouts (the kernel name's two letters, A first): `n` = as stored
// row-major ([m, k] for A, [k, n] for B), `t` = stored transposed ([k, m],
// [n, k]). The tensor maps follow the storage (their innermost dim is the
// contiguous one) and the wgmma descriptors the major-ness: A [m, k] and B
// [n, k] are K-major (128-row boxes of 64 k, one for A, BN / 128 for B, one
// after the other: rows of 128 bytes, 8-row groups 1024 bytes apart, a k
// slice 32 bytes further), A [k, m] and B [k, n] are M/N-major (64 x 64
// boxes of 64 m or n per 128-byte row, two for A, BN / 64 for B, each 8192
// bytes after the previous = the descriptor's leading byte offset; 8-row k
// groups 1024 bytes apart; a k slice 16 rows = 2048 bytes further). Out-of-range
// rows, columns and k (K not a multiple of 64) load as zeros.
//
// Epilogue (runtime flags, uniform per launch): v = alpha * acc + beta * C
// (C read only when beta != 0); EPI_BIAS adds bias[col]; EPI_RESIDUAL adds
// aux[row, col]; EPI_SILU_MUL makes v = silu(aux[row, col]) * v (aux = the
// gate projection, this GEMM the up projection of a SwiGLU MLP); EPI_ROPE
// (never with aux; the host refuses it) rotates the pairs (c, c + hd / 2) of
// the heads of hd columns in columns 0 .. rope_cols - 1 by the rotary
// embedding of position row % rope_seq (rope.cu's forward, in f32 from the
// f32 values: the q and k heads of a packed qkv projection; see rope_walk);
// the result is cast to C's type. bias, aux and the tables have C's element
// type. A consumer
// warpgroup takes its 64 x BN rows in chunks of EC columns (EC = 128 at
// BN = 128: one chunk; EC = 64 at BN = 256: four, those wholly past N
// skipped): it puts the chunk's accumulators into a f32 staging chunk in
// shared memory, then walks it row by row (EC consecutive columns per step,
// so the reads of C, bias and aux are coalesced) and writes C's image in
// shared memory for bulk tensor stores (c_tma: the launcher's map_c, which
// clips at the edges) or, when C's rows are not 16-byte aligned, C itself by
// guarded stores. A bulk store is not waited for at once: the warpgroup goes
// on (to the next chunk, or the next tile's main loop) while it writes C,
// and the next chunk first waits until it has read the image (epi_free).
//
// The staging chunk's layout (`staged`) is the bulk tensor copy's 128-byte
// swizzle of f32 boxes 32 columns x 64 rows: column c of row r lies in
// sub-box c / 32 (8192 bytes each), whose row r is 128 bytes at 128 r, and
// in it in 16-byte unit ((c % 32) / 4) ^ (r % 8) (eight units of 4 floats;
// the XOR is the swizzle's, bits 4..6 of the address XOR bits 7..9, on a
// chunk 1024-byte aligned), at float c % 4. Bank = (float index) % 32 =
// 4 * unit + c % 4, since rows are 32 floats.
// - The accumulators go in as 8-byte pairs (columns 2q, 2q + 1 of a row:
//   one unit, floats 2 (q % 2) and + 1). In the fragment, lane = 4 g + q of
//   warp w holds rows 16 w + g (+ 8) and, per 8-column block b, columns
//   8 b + 2 q, + 1. One store of a warp takes blocks b and b + 2 of a
//   sub-box (b % 4 in {0, 1}): lanes with h = q / 2 = s take b, the others
//   b + 2, the second store (s = 1) the other one (a select between two
//   registers, no indexing). The unit of lane (g, q) is then
//   (2 (b % 4) + 4 (s ^ h) + h) ^ g. In a half-warp (g in 0..3 or 4..7,
//   r % 8 = g) bit 2 of the unit gives s ^ h, hence h, and bits 0..1 then
//   give g % 4: its 16 lanes hit 8 distinct units, and the two lanes of a
//   unit (q % 2 = 0, 1) its two halves: 32 distinct banks, one wavefront
//   per half-warp, 2 for the warp's 256 bytes, the minimum (also where the
//   hardware serves the whole warp at once: every bank holds 2 of its words).
//   The row-major chunk before this layout put the 8 rows of a warp store
//   on the same 4 banks, 512 or 256 bytes apart: 8 ways.
// - The row walk's reads: a warp reads 32 consecutive columns of one row
//   (EC is a multiple of 32), one 128-byte row of a sub-box, whose 8 units
//   the XOR permutes: 32 distinct banks, one wavefront.
// For f32 C the image is the staging chunk itself: each element is read,
// scaled and written back at the same place by one thread, and EC / 32 bulk
// stores (map_c: f32, box 32 x 64, 128-byte swizzle; sub-boxes wholly past
// N skipped) write it, unswizzling as they go. For 16-bit C the image stays
// row-major (box EC x 64, no swizzle): a warp's 2-byte writes are 64
// consecutive bytes, conflict-free already, and one store covers the chunk.
// The guarded stores read the swizzled staging the same way. None of this
// is measured on a GPU: the bank arithmetic above is the whole claim.
//
// Compiled for an architecture without wgmma (sm_90, sm_80), the kernels
// are empty: the launcher only picks them for devices compiled for sm_90a.

struct GemmHopperArgs {
    TparTensorMap map_a;  // 3-D (inner, rows, batch) over A as stored
    TparTensorMap map_b;  // 3-D over B as stored
    TparTensorMap map_c;  // 3-D (n, m, batch) over C when c_tma: f32 box 32 x 64 (128-byte
                          // swizzle), 16-bit box EC x 64
    void* c;
    const void* bias;  // n elements (EPI_BIAS)
    const void* aux;   // residual or gate, like C with ld_aux / batch_stride_aux
    i64 batch_stride_c;
    i64 batch_stride_aux;
    i32 m, n, k;
    i32 ldc, ld_aux;
    i32 batch;
    i32 bcast_a, bcast_b;  // 1: one matrix for every batch (z = 0)
    float alpha, beta;
    i32 epilogue;  // EPI_* bits
    i32 c_tma;
    i32 group;    // tile rows per group of the tile order
    i32 cluster;  // blocks per cluster along N: 1, or 2 (A multicast)
    const void* rope_cos;  // EPI_ROPE: [>= rope_seq, rope_hd] tables of C's type
    const void* rope_sin;
    i32 rope_hd;    // head dim (even; divides EC)
    i32 rope_cols;  // columns 0 .. rope_cols - 1 rotated (a multiple of rope_hd)
    i32 rope_seq;   // row `row` of a batch is position row % rope_seq
    i32 pad[1];
};

#if defined(TPAR_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TPAR_GEMM_HOPPER_BODY 1
#endif

namespace gemm_hopper {

constexpr int BM = 128, BK = 64;
constexpr u32 A_BYTES = BM * BK * 2;
// a 64 x 64 box of an M/N-major operand (64 m or n per 128-byte row, 64 k
// rows): the wgmma descriptor's leading byte offset between such boxes
constexpr u32 MN_BOX_BYTES = 64 * BK * 2;
// a 128-row box of a K-major B (128 rows of 64 k)
constexpr u32 K_BOX_BYTES = 128 * BK * 2;
enum { EPI_BIAS = 1, EPI_RESIDUAL = 2, EPI_SILU_MUL = 4, EPI_ROPE = 8 };

// What the tile width BN (128 or 256 columns of C) fixes: the ring's depth
// and the width EC of the epilogue's chunks (a consumer warpgroup stages
// and stores its 64 x BN rows EC columns at a time); the byte budget is in
// the header.
template <int BN>
struct Geo {
    static_assert(BN == 128 || BN == 256, "the Hopper GEMM's tile width is 128 or 256");
    static constexpr int STAGES = BN == 128 ? 4 : 3;
    static constexpr int EC = BN == 128 ? 128 : 64;
    static constexpr u32 B_BYTES = BN * BK * 2;
    static constexpr u32 STAGE_BYTES = A_BYTES + B_BYTES;
    // per consumer warpgroup: a 64 x EC f32 staging chunk (EC / 32 swizzled
    // sub-boxes, `staged`), and the 16-bit image of C's chunk (a f32 C is
    // converted in place)
    static constexpr u32 STAGING_BYTES = 64 * EC * 4;
};

// Columns of a staging sub-box: one 128-byte swizzle row of f32.
constexpr int SUB = 32;

// Two accumulators of a row, stored to the staging chunk as one 8-byte access.
struct alignas(8) Pair {
    float x, y;
};

// The float index of element (r, c) of a staging chunk (r < 64): sub-box
// c / 32 of 64 rows x 32 floats, row r, 16-byte unit ((c % 32) / 4) ^ (r % 8),
// float c % 4 (the 128-byte swizzle of a bulk tensor copy; the header shows
// the conflict-free accesses).
TPAR_DEVICE int staged(int r, int c) {
    return (c / SUB) * (64 * SUB) + r * SUB + ((((c % SUB) / 4) ^ (r % 8)) * 4) + c % 4;
}

// Where lane `lane` of warp `w` of a consumer warpgroup puts an accumulator
// pair in store `sw` (0 or 1) of the rows 16 w + lane / 4 + 8 e and the
// chunk's 8-column blocks `bl` and bl + 2 (bl % 4 in {0, 1}): `at`, the
// pair's staged float index, and `far`, whether it is block bl + 2's (lanes
// with q / 2 = sw take block bl; the header's argument).
struct PairSlot {
    int at;
    bool far;
};
TPAR_DEVICE PairSlot pair_slot(int w, int lane, int bl, int e, int sw) {
    const int g = lane / 4, q = lane % 4;
    const bool far = (sw ^ (q / 2)) != 0;
    return PairSlot{staged(16 * w + g + 8 * e, 8 * (bl + 2 * (int)far) + 2 * q), far};
}

// Element `idx` (row-major) of the row walk over a 64 x EC staging chunk.
template <int EC>
TPAR_DEVICE int walk_at(int idx) {
    return staged(idx / EC, idx % EC);
}

// The ring's stages and the consumer warpgroups' epilogue buffers are found
// by arithmetic (stage_a, stage_b, staging, out16), not kept in arrays of
// pointers: such an array indexed at run time (by the stage, by the
// warpgroup) would put the whole struct in local memory (a stack frame).
struct Smem {
    unsigned char* ring;        // [STAGES] x (A tile, then B tile)
    unsigned char* epi;         // [2] 64 x EC f32 staging chunks, then [2] 16-bit images
    u64* full;                  // [STAGES]
    u64* empty;                 // [STAGES]
    u64* epi_sync;              // [2]: a barrier of a consumer warpgroup (128 arrivals)
    u64* epi_free;              // [2]: its bulk store has read the image
};

template <int BN>
TPAR_DEVICE Smem carve() {
    using G = Geo<BN>;
    const u32 at = tpar_shared_addr(tpar_dyn_smem);
    unsigned char* base = tpar_dyn_smem + ((1024u - (at & 1023u)) & 1023u);
    Smem s;
    s.ring = base;
    unsigned char* p = base + G::STAGES * G::STAGE_BYTES;
    s.epi = p;
    u64* bars = reinterpret_cast<u64*>(p + 3 * G::STAGING_BYTES);
    s.full = bars;
    s.empty = bars + G::STAGES;
    s.epi_sync = bars + 2 * G::STAGES;
    s.epi_free = bars + 2 * G::STAGES + 2;
    return s;
}

// Stage `st`'s A and B tiles.
template <int BN>
TPAR_DEVICE unsigned char* stage_a(const Smem& s, int st) {
    return s.ring + st * Geo<BN>::STAGE_BYTES;
}
template <int BN>
TPAR_DEVICE unsigned char* stage_b(const Smem& s, int st) {
    return s.ring + st * Geo<BN>::STAGE_BYTES + A_BYTES;
}

// Consumer warpgroup `cw`'s 64 x EC f32 staging chunk, and its 64 x EC image
// of a 16-bit C.
template <int BN>
TPAR_DEVICE unsigned char* staging(const Smem& s, int cw) {
    return s.epi + cw * Geo<BN>::STAGING_BYTES;
}
template <int BN>
TPAR_DEVICE unsigned char* out16(const Smem& s, int cw) {
    return s.epi + 2 * Geo<BN>::STAGING_BYTES + cw * (Geo<BN>::STAGING_BYTES / 2);
}

struct Tile {
    int b, m0, n0;
};

// Units of work a block walks: tiles, or pairs of tiles along N (cluster 2).
template <int BN>
TPAR_DEVICE int work_units(const GemmHopperArgs& a) {
    const int tiles_m = (a.m + BM - 1) / BM, cols = (a.n + BN * a.cluster - 1) / (BN * a.cluster);
    return tiles_m * cols * a.batch;
}

// Block `rank`'s tile of unit `t` in the grouped order (units are
// `cluster` tiles wide along N).
template <int BN>
TPAR_DEVICE Tile tile_of(int t, const GemmHopperArgs& a, int rank) {
    const int tiles_m = (a.m + BM - 1) / BM, cols = (a.n + BN * a.cluster - 1) / (BN * a.cluster);
    const int per = tiles_m * cols;
    const int b = t / per, r = t % per;
    const int width = a.group * cols;
    const int first = (r / width) * a.group;
    const int rows = min(tiles_m - first, a.group);
    const int in = r % width;
    return Tile{b, (first + in % rows) * BM, ((in / rows) * a.cluster + rank) * BN};
}

// The first unit of this block and the stride between its units.
TPAR_DEVICE int first_unit(const GemmHopperArgs& a) { return (int)blockIdx.x / a.cluster; }
TPAR_DEVICE int unit_stride(const GemmHopperArgs& a) { return (int)gridDim.x / a.cluster; }

// Warpgroup 0, one thread: fills the ring.
template <int BN, int TA, int TB>
TPAR_DEVICE void produce(const GemmHopperArgs& a, const Smem& s, int total, int ktiles, int rank) {
    using G = Geo<BN>;
    int it = 0;
    for (int t = first_unit(a); t < total; t += unit_stride(a)) {
        const Tile tl = tile_of<BN>(t, a, rank);
        const int za = a.bcast_a ? 0 : tl.b, zb = a.bcast_b ? 0 : tl.b;
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
            const int st = it % G::STAGES;
            const u32 phase = (u32)((it / G::STAGES) & 1);
            mbarrier_wait_parity(&s.empty[st], phase ^ 1u);
            mbarrier_arrive_expect_tx(&s.full[st], G::STAGE_BYTES);
            const int k0 = kt * BK;
            unsigned char* sa = stage_a<BN>(s, st);
            unsigned char* sb = stage_b<BN>(s, st);
            if (a.cluster == 2) {
                // this block's 64 rows of A into both blocks' stage
                unsigned char* half = sa + rank * (A_BYTES / 2);
                if (TA == 0)
                    tma_load_3d_multicast(half, &a.map_a, k0, tl.m0 + 64 * rank, za, &s.full[st],
                                          (u16)3);
                else
                    tma_load_3d_multicast(half, &a.map_a, tl.m0 + 64 * rank, k0, za, &s.full[st],
                                          (u16)3);
            } else if (TA == 0) {
                tma_load_3d(sa, &a.map_a, k0, tl.m0, za, &s.full[st]);
            } else {
                tma_load_3d(sa, &a.map_a, tl.m0, k0, za, &s.full[st]);
                tma_load_3d(sa + MN_BOX_BYTES, &a.map_a, tl.m0 + 64, k0, za, &s.full[st]);
            }
            // B: BN / 128 boxes of 128 rows (K-major; together the 8-row
            // groups of one BN-row tile, 1024 bytes apart), or BN / 64 boxes
            // of 64 columns (N-major, MN_BOX_BYTES apart)
            if (TB == 0) {
#pragma unroll
                for (int h = 0; h < BN / 128; ++h)
                    tma_load_3d(sb + h * K_BOX_BYTES, &a.map_b, k0, tl.n0 + 128 * h, zb,
                                &s.full[st]);
            } else {
#pragma unroll
                for (int h = 0; h < BN / 64; ++h)
                    tma_load_3d(sb + h * MN_BOX_BYTES, &a.map_b, tl.n0 + 64 * h, k0, zb,
                                &s.full[st]);
            }
        }
    }
}

// A barrier of one consumer warpgroup (no named barriers here: an mbarrier of
// 128 arrivals); `use` counts its uses from 0, whose phases alternate parity.
TPAR_DEVICE void wg_sync(u64* bar, u32 use) {
    mbarrier_arrive(bar);
    mbarrier_wait_parity(bar, use & 1u);
}

TPAR_DEVICE float silu(float x) { return x / (1.0f + expf(-x)); }

template <typename O>
TPAR_DEVICE float load_out(const void* p, i64 i) {
    return to_f32(static_cast<const O*>(p)[i]);
}

// The hooks after v = alpha * acc of element (row, col) of batch b (at ci in
// C), in range: + beta * C, + bias[col], then (AUX: where the launch has
// one) the residual or the gate.
template <typename O, bool AUX>
TPAR_DEVICE float hooks(const GemmHopperArgs& a, float v, int b, int row, int col, i64 ci) {
    if (a.beta != 0.0f) v += a.beta * load_out<O>(a.c, ci);
    if (a.epilogue & EPI_BIAS) v += load_out<O>(a.bias, col);
    if (AUX && (a.epilogue & (EPI_RESIDUAL | EPI_SILU_MUL))) {
        const float x =
            load_out<O>(a.aux, (i64)b * a.batch_stride_aux + (i64)row * a.ld_aux + col);
        v = (a.epilogue & EPI_RESIDUAL) ? v + x : silu(x) * v;
    }
    return v;
}

// The row walk of a 64 x EC staging chunk `f` (columns col0 .., rows row0 ..
// of batch b) with EPI_ROPE: thread tw takes pairs of columns (c, c + hd / 2)
// of a head (c in its first half; EC and col0 are multiples of hd, so a pair
// is in the chunk), for hd >= 64 32 consecutive c of a row per warp
// (coalesced reads of C and the tables; conflict-free reads of f, as in the
// plain walk). Both
// values go through the hooks; a pair in the rotated columns (col < rope_cols,
// whole heads) of a row in range then becomes
//   (v1 c1 - v2 s1, v2 c2 + v1 s2)
// in f32, the tables' row the position row % rope_seq, and each is cast to
// C's type once. One thread reads and writes both elements of its pair, so a
// f32 C's image (the staging chunk itself) is written in place with no
// thread reading an element another one has written.
//
// Not inlined on a GPU: the chunk loop is unrolled (BN / EC copies), and an
// inlined walk would repeat its ~256 instructions in each copy (4 at
// BN = 256) of every kernel, rope or not; called, it is there once per
// kernel (ptxas: the same 168 registers, no stack frame, no spills).
#ifdef TPAR_EMU
#define GEMM_HOPPER_ONCE inline
#else
#define GEMM_HOPPER_ONCE __device__ __noinline__
#endif
template <int EC, typename O>
GEMM_HOPPER_ONCE void rope_walk(const GemmHopperArgs& a, float* f, O* o, int b, int row0,
                                int col0, int tw) {
    // EC / 2 pairs per row: a thread keeps its pair (128 is a multiple of
    // EC / 2) and steps over rows
    static_assert(128 % (EC / 2) == 0, "a thread's pair is the same in every row it takes");
    const int hd = a.rope_hd, half = hd / 2, q = tw % (EC / 2);
    const int j = q % half, c1 = (q / half) * hd + j, c2 = c1 + half;
    const int col = col0 + c1;
    const bool rotated = col < a.rope_cols;
#pragma unroll 1
    for (int r = tw / (EC / 2); r < 64; r += 128 / (EC / 2)) {
        const int at1 = staged(r, c1), at2 = staged(r, c2);
        const int row = row0 + r;
        float v1 = a.alpha * f[at1], v2 = a.alpha * f[at2];
        const i64 ci = (i64)b * a.batch_stride_c + (i64)row * a.ldc + col;
        const bool in1 = row < a.m && col < a.n, in2 = row < a.m && col + half < a.n;
        // (no residual or gate with EPI_ROPE)
        if (in1) v1 = hooks<O, false>(a, v1, b, row, col, ci);
        if (in2) v2 = hooks<O, false>(a, v2, b, row, col + half, ci + half);
        // (col < rope_cols <= n: the pair is in range when the row is)
        if (row < a.m && rotated) {
            const i64 t = (i64)(row % a.rope_seq) * hd + j;
            const float cs1 = load_out<O>(a.rope_cos, t), cs2 = load_out<O>(a.rope_cos, t + half);
            const float sn1 = load_out<O>(a.rope_sin, t), sn2 = load_out<O>(a.rope_sin, t + half);
            const float x1 = v1, x2 = v2;
            v1 = x1 * cs1 - x2 * sn1;
            v2 = x2 * cs2 + x1 * sn2;
        }
        if (!a.c_tma) {
            if (in1) static_cast<O*>(a.c)[ci] = from_f32<O>(v1);
            if (in2) static_cast<O*>(a.c)[ci + half] = from_f32<O>(v2);
        } else {
            o[sizeof(O) == 4 ? at1 : r * EC + c1] = from_f32<O>(v1);
            o[sizeof(O) == 4 ? at2 : r * EC + c2] = from_f32<O>(v2);
        }
    }
}

// Releases stage `st` to the producers: this block's, and with clusters the
// peer's (whose multicast also writes this block's stage).
TPAR_DEVICE void release(const GemmHopperArgs& a, const Smem& s, int st, int rank) {
    mbarrier_arrive(&s.empty[st]);
    if (a.cluster == 2) mbarrier_arrive_cluster(&s.empty[st], (u32)(rank ^ 1));
}

// Warpgroups 1 and 2: the K loop of each tile, then its epilogue.
template <int BN, typename T, typename O, int TA, int TB>
TPAR_DEVICE void consume(const GemmHopperArgs& a, const Smem& s, int total, int ktiles, int cw,
                         int rank) {
    using G = Geo<BN>;
    constexpr int EC = G::EC;
    const int tw = threadIdx.x % 128;
    const int w = tw / 32, lane = tw % 32;
    float d[BN / 2];
    // `chunks` counts the epilogue chunks stored so far (the epilogue
    // barriers' phases)
    int it = 0, chunks = 0;
    for (int t = first_unit(a); t < total; t += unit_stride(a)) {
        const Tile tl = tile_of<BN>(t, a, rank);
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
            const int st = it % G::STAGES;
            mbarrier_wait_parity(&s.full[st], (u32)((it / G::STAGES) & 1));
            wgmma_fence();
            unsigned char* sa = stage_a<BN>(s, st);
            unsigned char* sb = stage_b<BN>(s, st);
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {
                const u64 da =
                    TA == 0 ? wgmma_desc(sa + cw * 64 * 128 + ks * 32, 16, 1024,
                                         TPAR_WG_SWIZZLE_128B)
                            : wgmma_desc(sa + cw * MN_BOX_BYTES + ks * 2048, MN_BOX_BYTES,
                                         1024, TPAR_WG_SWIZZLE_128B);
                const u64 db =
                    TB == 0 ? wgmma_desc(sb + ks * 32, 16, 1024, TPAR_WG_SWIZZLE_128B)
                            : wgmma_desc(sb + ks * 2048, MN_BOX_BYTES, 1024, TPAR_WG_SWIZZLE_128B);
                wgmma_ss<T, BN, TA, TB>(d, da, db, kt > 0 || ks > 0);
            }
            wgmma_commit();
            // the group before this one has retired: its stage may be refilled
            wgmma_wait<1>();
            if (kt > 0 && lane == 0) release(a, s, (it - 1) % G::STAGES, rank);
        }
        wgmma_wait<0>();
        if (lane == 0) release(a, s, (it - 1) % G::STAGES, rank);
        // the second tile of a pair past N (odd tile count): nothing to store
        if (tl.n0 >= a.n) continue;

        // epilogue of rows m0 + 64 cw .. + 63, EC columns at a time: the
        // chunk's accumulators into the f32 staging chunk, then row by row
        // (coalesced) the scales, hooks and cast
        const int row0 = tl.m0 + 64 * cw;
        float* f = reinterpret_cast<float*>(staging<BN>(s, cw));
        O* o = sizeof(O) == 4 ? reinterpret_cast<O*>(f) : reinterpret_cast<O*>(out16<BN>(s, cw));
#pragma unroll
        for (int j = 0; j < BN / EC; ++j) {
            const int col0 = tl.n0 + j * EC;
            // chunks wholly past N: nothing to store
            if (col0 >= a.n) break;
            // the previous chunk's bulk store has read its image (its global
            // writes went on meanwhile, across tiles during the main loop)
            if (a.c_tma && tw == 0 && chunks > 0) {
                tma_store_wait_read<0>();
                mbarrier_arrive(&s.epi_free[cw]);
            }
            if (a.c_tma) mbarrier_wait_parity(&s.epi_free[cw], (u32)(chunks & 1) ^ 1u);
            // accumulator i of lane 4 g + q is row 16 w + g + 8 ((i / 2) % 2),
            // column 8 (i / 4) + 2 q + i % 2 of the warpgroup's 64 x BN: in
            // pairs, 8-column blocks b and b + 2 of each sub-box swapped
            // between the lanes with q / 2 = 0 and 1 (pair_slot)
#pragma unroll
            for (int b0 = j * (EC / 8); b0 < (j + 1) * (EC / 8); b0 += SUB / 8) {
#pragma unroll
                for (int u = 0; u < 2; ++u) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
#pragma unroll
                        for (int sw = 0; sw < 2; ++sw) {
                            const PairSlot p = pair_slot(w, lane, b0 + u - j * (EC / 8), e, sw);
                            const int i0 = 4 * (b0 + u) + 2 * e, i1 = i0 + 8;
                            const Pair v =
                                p.far ? Pair{d[i1], d[i1 + 1]} : Pair{d[i0], d[i0 + 1]};
                            *reinterpret_cast<Pair*>(f + p.at) = v;
                        }
                    }
                }
            }
            wg_sync(&s.epi_sync[cw], 2u * (u32)chunks);
            if (a.epilogue & EPI_ROPE) {
                rope_walk<EC, O>(a, f, o, tl.b, row0, col0, tw);
            } else {
                for (int idx = tw; idx < 64 * EC; idx += 128) {
                    const int at = walk_at<EC>(idx);
                    const int row = row0 + idx / EC, col = col0 + idx % EC;
                    float v = a.alpha * f[at];
                    if (row < a.m && col < a.n) {
                        const i64 ci = (i64)tl.b * a.batch_stride_c + (i64)row * a.ldc + col;
                        v = hooks<O, true>(a, v, tl.b, row, col, ci);
                        if (!a.c_tma) static_cast<O*>(a.c)[ci] = from_f32<O>(v);
                    }
                    // (for f32 C, o is f: each element is read and written at
                    // the same place by one thread; a 16-bit image is row-major)
                    if (a.c_tma) o[sizeof(O) == 4 ? at : idx] = from_f32<O>(v);
                }
            }
            if (a.c_tma) fence_proxy_async();
            // every thread is done with f (and has written o) before the
            // store and the next chunk's (or tile's) accumulators
            wg_sync(&s.epi_sync[cw], 2u * (u32)chunks + 1u);
            if (a.c_tma && tw == 0) {
                if (sizeof(O) == 4) {
                    // the swizzled sub-boxes (those wholly past N skipped)
                    for (int sb = 0; sb < EC / SUB && col0 + SUB * sb < a.n; ++sb)
                        tma_store_3d(&a.map_c, col0 + SUB * sb, row0, tl.b, f + sb * 64 * SUB);
                } else {
                    tma_store_3d(&a.map_c, col0, row0, tl.b, o);
                }
                tma_store_commit();
            }
            ++chunks;
        }
    }
    // the last store has completed before the block (and its shared memory) ends
    if (a.c_tma && tw == 0) tma_store_wait<0>();
}

template <int BN, typename T, typename O, int TA, int TB>
TPAR_DEVICE void run(const GemmHopperArgs& a) {
    using G = Geo<BN>;
    const Smem s = carve<BN>();
    const int wg = threadIdx.x / 128;
    const int rank = a.cluster == 2 ? (int)cluster_ctarank() : 0;
    if (threadIdx.x == 0) {
        tma_prefetch(&a.map_a);
        tma_prefetch(&a.map_b);
        for (int i = 0; i < G::STAGES; ++i) {
            mbarrier_init(&s.full[i], 1);
            // lane 0 of each consumer warp (of both blocks of a cluster)
            mbarrier_init(&s.empty[i], 8 * a.cluster);
        }
        for (int i = 0; i < 2; ++i) {
            mbarrier_init(&s.epi_sync[i], 128);
            mbarrier_init(&s.epi_free[i], 1);
        }
        fence_mbarrier_init();
    }
    // with clusters, the peer's barriers are initialised before any copy or
    // arrival of this block reaches them
    if (a.cluster == 2)
        cluster_sync();
    else
        __syncthreads();
    const int total = work_units<BN>(a);
    const int ktiles = (a.k + BK - 1) / BK;
    if (wg == 0) {
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) produce<BN, TA, TB>(a, s, total, ktiles, rank);
    } else {
        setmaxnreg_inc<232>();
        consume<BN, T, O, TA, TB>(a, s, total, ktiles, wg - 1, rank);
    }
    // no block leaves while its peer may still arrive on its barriers (the
    // producer warp's lanes first reconverge: the cluster barrier is .aligned)
    if (a.cluster == 2) {
        __syncwarp();
        cluster_sync();
    }
}

}  // namespace gemm_hopper

// A source that includes this file for its device functions alone (the
// staging layout's lane-level test) defines TPAR_GEMM_HOPPER_NO_KERNELS.
#ifndef TPAR_GEMM_HOPPER_NO_KERNELS

#ifdef TPAR_GEMM_HOPPER_BODY
#define TPAR_GEMM_HOPPER(BN, T, O, TA, TB) gemm_hopper::run<BN, T, O, TA, TB>(args)
#else
#define TPAR_GEMM_HOPPER(BN, T, O, TA, TB)
#endif

// 384 threads and at least one block per SM: with the minimum given, ptxas
// knows the registers at entry, so that setmaxnreg applies (without it ptxas
// may ignore setmaxnreg, C7508); the emulator takes the thread count alone.
#ifndef TPAR_EMU
#define GEMM_HOPPER_BOUNDS 384, 1
#else
#define GEMM_HOPPER_BOUNDS 384
#endif

// tpar_gemm_hopper_<layout>_<in>_<out>[_n256] (the suffix: 128 x 256 tiles); wgmma's TB is
// 1 for B stored [k, n] (N-major).
TPAR_KERNEL(tpar_gemm_hopper_nn_bf16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, bf16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_bf16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, bf16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_bf16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, bf16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_bf16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, bf16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_bf16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, f16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_bf16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, f16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_bf16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, f16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_bf16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, f16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_bf16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, float, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_bf16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, float, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_bf16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, float, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_bf16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, bf16, float, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_f16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, bf16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_f16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, bf16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_f16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, bf16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_f16_bf16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, bf16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_f16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, f16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_f16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, f16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_f16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, f16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_f16_f16, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, f16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_f16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, float, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_f16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, float, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_f16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, float, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_f16_f32, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(128, f16, float, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_bf16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, bf16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_bf16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, bf16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_bf16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, bf16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_bf16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, bf16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_bf16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, f16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_bf16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, f16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_bf16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, f16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_bf16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, f16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_bf16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, float, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_bf16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, float, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_bf16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, float, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_bf16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, bf16, float, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_f16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, bf16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_f16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, bf16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_f16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, bf16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_f16_bf16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, bf16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_f16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, f16, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_f16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, f16, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_f16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, f16, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_f16_f16_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, f16, 1, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_nn_f16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, float, 0, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_nt_f16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, float, 0, 0);
}
TPAR_KERNEL(tpar_gemm_hopper_tn_f16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, float, 1, 1);
}
TPAR_KERNEL(tpar_gemm_hopper_tt_f16_f32_n256, TPAR_GRID_CONSTANT(GemmHopperArgs), GEMM_HOPPER_BOUNDS) {
    TPAR_GEMM_HOPPER(256, f16, float, 1, 0);
}

#endif  // TPAR_GEMM_HOPPER_NO_KERNELS
