// The Hopper (sm_90a) attention backward pass, FlashAttention-3 style: the
// main kernel between sdpa.cu's `tpar_sdpa_bwd_pre_strided_*` (delta = rowsum(dout *
// out), the whole dq accumulator zeroed) and this file's
// `tpar_sdpa_bwd_hopper_dq_*` (dq = scale * the accumulator, converted from
// its tile layout, below). Same meaning as sdpa.cu's backward: q [batch,
// q_heads, q_len, d], k and v [batch, kv_heads, kv_len, d], out / dout like q,
// each through its own element strides (batch, head, row; the last dim
// contiguous: dense, or heads side by side in the rows of a [batch, len,
// heads * d] or packed qkv buffer), dq with q's strides, dk with k's, dv with
// v's, dout with out's; lse [batch, q_heads, q_len] (f32, natural log), GQA (q head h reads kv head
// h / (q_heads / kv_heads)), top-left causal masking, an optional additive
// mask of the attention type broadcast by strides; a row whose lse is -inf
// gets no gradient. Launcher: src/cuda/raw/sdpa_hopper_bwd.rs.
//
// Head dims (head_dim == v_dim) HD = 64 or 128, bf16 or f16. One block of 384
// threads per (128-key block, kv head, batch):
// - warpgroup 0 produces (setmaxnreg_dec): one warp brings the block's K and
//   V tiles once (bulk tensor copies through 4-D maps (d, len, heads, batch)
//   with the operands' strides, 64-column boxes, 128-byte swizzle, keys past
//   kv_len read as zeros: a map bounds each head of each batch) and then, for every q head of the group and
//   every 64-query tile from the block's first visible query (causal: the
//   block's first key), the Q and dO tiles into a 2-stage ring guarded by
//   "full" mbarriers (the copies' bytes and the warp's 32 arrivals, after it
//   wrote the tile's lse * log2(e) and delta into the stage while the
//   copies fly) and "empty"
//   mbarriers (lane 0 of each consumer warp); lane 0 of its warp 1 writes
//   dQ (below); its warps 2 and 3 exit;
// - warpgroups 1 and 2 consume (setmaxnreg_inc): warpgroup w owns keys
//   64 w .. 64 w + 63 of the block. Per tile: S^T = K Q^T and dP^T = V dO^T
//   (wgmma, both operands K-major from the swizzled tiles), P^T = exp2(S^T *
//   scale * log2e (+ mask) - lse) (0 outside the causal triangle, past either
//   length, and for a row with lse = -inf), dS^T = P^T (dP^T - delta); dV +=
//   P^T dO and dK += dS^T Q with P^T and dS^T as register A operands (the
//   accumulator fragment is the A fragment) and dO / Q as N-major B operands
//   of the same tiles; dS^T goes to shared memory ([128 keys][64 queries],
//   128-byte swizzle: the M-major A operand of dQ = dS K; two buffers, so
//   one barrier of the consumers per tile), and warpgroup w
//   computes columns w HD/2 .. of dQ over all 128 keys and stores them
//   (all 64 rows) into a dQ staging buffer. dK (times scale)
//   and dV stay in registers until the end: one writer per element. A
//   warpgroup whose keys no query of the tile sees (causal) skips S, dP, dV
//   and dK and contributes zeros to dS (so to dQ).
//
// dQ writer (FlashAttention-3's): the f32 accumulator dq_acc is not dQ's
// row-major layout but FlashAttention-3's permuted one (dq_unit below): per
// (batch, q head) and per 64-query tile one contiguous block of 64 x HD
// floats, ceil(q_len / 64) blocks a head, each in the order the consumers'
// registers hold the tile. Thread tw of consumer warpgroup cw holds, for
// column group j (0 .. HD / 16) of its m64n(HD/2) fragment, rows r = 16
// (tw / 32) + (tw % 32) / 4 and r + 8 of columns c = cw HD / 2 + 8 j + 2 (tw
// % 4) and c + 1: one 16-byte unit, stored at unit (cw HD / 16 + j) * 128 +
// tw. A warp's store covers 512 consecutive bytes (4 wavefronts, the least
// for 32 x 16 bytes; no bank conflicts), HD / 16 stores a thread per tile
// (it was HD / 8 8-byte stores hitting 8 rows of [64][HD] row-major that
// share 8 banks: 8 wavefronts where 2 would do). The staging buffer of tile
// it, it % 2, holds the tile's block as it sits in dq_acc (no padding or
// swizzle: the 1-D bulk reduction copies shared memory linearly), so the
// writer adds all 64 x HD floats with one cp.reduce.async.bulk ... add.f32;
// rows past q_len (P and so dS are 0 there) land in the last block's
// padding, which nothing reads. The consumers wait on "dq empty" (it % 2),
// store, fence the async proxy and arrive on "dq full" (256 arrivals); the
// writer waits on "dq full", reduces, commits, waits until the reduction
// has read the buffer (cp.async.bulk.wait_group.read 0) and arrives on "dq
// empty". The consumers issue no global atomics. The pre kernel zeroes
// every block (a last tile's valid rows are spread over its whole block),
// and `tpar_sdpa_bwd_hopper_dq_*` reads the blocks back (16-byte reads, 4
// threads on 64 consecutive bytes), scales and writes dq [batch, q_heads,
// q_len, HD] through q's strides, valid rows only, a warp writing 128
// consecutive bytes of each of its two rows. Callers size the workspace with
// sdpa_backward_workspace_bytes, which counts the padded rows.
//
// Shared memory: 1024 bytes of alignment slack, K and V (2 x 128 x HD x 2),
// two Q + dO stages (2 x 2 x 64 x HD x 2), two dS^T buffers (2 x 16 KiB),
// two dQ buffers (2 x 64 x HD x 4, the permuted layout takes no more than
// row-major did), lse and delta (1 KiB), ten mbarriers: 133 200 bytes at HD
// 64, 231 504 at HD 128 (the limit is 232 448). ptxas (CUDA 13.0, sm_90a):
// 168 registers at entry for every main kernel (the launch bounds' share;
// setmaxnreg then gives the consumers 240), no stack frame, no spills. The
// dQ writer and the permuted layout have not been measured on a GPU.
//
// At head dim 64 each warpgroup's dQ columns are 32 wide, so its K operand
// starts 64 bytes into the 128-byte swizzled rows (the swizzle applies to the
// resulting addresses, as for the K-major k steps 32 bytes apart).
//
// Compiled for an architecture without wgmma, the main kernels are empty: the
// launcher runs them only where kernels are compiled for sm_90a (or the
// emulator with TPAR_EMU_ARCH=sm_90a). Nothing here has run on a GPU yet:
// no speed is measured.

struct SdpaHopperBwdArgs {
    TparTensorMap map_q;   // 4-D (head_dim, q_len, q_heads, batch), box 64 x 64 x 1 x 1
    TparTensorMap map_k;   // 4-D (head_dim, kv_len, kv_heads, batch), box 64 x 128 x 1 x 1
    TparTensorMap map_v;   // like map_k over v
    TparTensorMap map_do;  // like map_q over dout (out's strides)
    SdpaBwdArgs a;
    SdpaArgStrides st;  // (tpar.cuh) dq, dk and dv go through q's, k's and v's strides
};

namespace sdpa_hopper_bwd {

constexpr int BR = 64;   // queries per tile
constexpr int BC = 128;  // keys per block (64 per consumer warpgroup)
constexpr int STAGES = 2;
constexpr float kLog2e = 1.4426950408889634f;
// One 64-column box of a K / V tile (128 rows) and of a Q / dO tile (64 rows).
constexpr u32 KBOX = BC * 64 * 2, QBOX = BR * 64 * 2;
constexpr u32 DS_BYTES = BC * BR * 2;

// The dQ accumulator's tile layout. dq_acc holds, per (batch, q head) and
// per 64-query tile, one block of 64 x HD floats (tile t of head bh at
// (bh * ceil(q_len / 64) + t) * 64 * HD) in units of 4 floats: the unit
// whose first element is row r (r % 16 < 8), column c (c even) of the tile
// holds (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1) -- the four
// accumulators i = 4 j .. 4 j + 3 of a consumer thread's m64n(HD/2) wgmma
// fragment -- and sits at unit (c / 8) * 128 + 32 (r / 16) + 4 (r % 16) +
// (c % 8) / 2: column group c / 8 (consumer warpgroup c / (HD / 2), its
// group j), then the consumer thread that holds it (warp r / 16, lane 4 (r %
// 16) + (c % 8) / 2). A warp's 32 units of one group are 512 consecutive
// bytes. Returns the unit's first float within the tile.
TPAR_DEVICE int dq_unit(int r, int c) {
    return ((c / 8) * 128 + 32 * (r / 16) + 4 * (r % 16) + (c % 8) / 2) * 4;
}

// The unit (its first float in the tile) that thread `tw` of consumer
// warpgroup `cw` stores for its column group j (0 .. HD / 16): accumulators
// 4 j .. 4 j + 3 of its m64n(HD/2) fragment, rows 16 (tw / 32) + (tw % 32) /
// 4 and + 8, columns cw HD / 2 + 8 j + 2 (tw % 4) and + 1.
template <int HD>
TPAR_DEVICE int dq_frag_unit(int cw, int tw, int j) {
    return dq_unit(16 * (tw / 32) + (tw % 32) / 4, cw * (HD / 2) + 8 * j + 2 * (tw % 4));
}

// 64-query tiles per (batch, q head) in dq_acc.
TPAR_DEVICE int dq_tiles(const SdpaBwdArgs& a) { return (a.q_len + BR - 1) / BR; }

// The first float of the dq_acc block of query tile `i0 / 64` of head `bh`.
template <int HD>
TPAR_DEVICE i64 dq_block(const SdpaBwdArgs& a, i64 bh, int i0) {
    return (bh * dq_tiles(a) + i0 / BR) * (i64)(BR * HD);
}

struct Smem {
    unsigned char* k;            // [HD / 64] boxes of [128 keys][64 columns]
    unsigned char* v;            // likewise
    // stage i: Q at stage + i * 2 QT ([HD / 64] boxes of [64 queries][64
    // columns]), dO QT bytes after it (QT = 64 * HD * 2)
    unsigned char* stage;
    // dS^T [128 keys][64 queries], 128-byte swizzle; tile it in buffer it % 2
    unsigned char* ds;
    // dQ staging, buffer it % 2 for tile it: 64 x HD f32 in dq_acc's tile
    // layout (dq_unit), so one bulk reduction adds it to the tile's block
    float* dq;
    // stage i: lse * log2(e) (+inf for no gradient) at rows + 128 i, delta
    // 64 floats after it
    float* rows;
    u64* kv_full;                // the K and V copies
    u64* full;                   // [STAGES]
    u64* empty;                  // [STAGES]
    u64* csync;                  // a barrier of the 256 consumer threads
    u64* dq_full;                // [2] the consumers wrote the dQ buffer
    u64* dq_empty;               // [2] the writer's reduction read it
};

template <int HD>
TPAR_DEVICE Smem carve() {
    constexpr u32 KV = BC * HD * 2, QT = BR * HD * 2;
    const u32 at = tpar_shared_addr(tpar_dyn_smem);
    unsigned char* base = tpar_dyn_smem + ((1024u - (at & 1023u)) & 1023u);
    Smem s;
    s.k = base;
    s.v = base + KV;
    s.stage = base + 2 * KV;
    s.ds = base + 2 * KV + STAGES * 2 * QT;
    s.dq = reinterpret_cast<float*>(s.ds + 2 * DS_BYTES);
    float* f = s.dq + 2 * BR * HD;
    s.rows = f;
    u64* bars = reinterpret_cast<u64*>(f + 2 * BR * STAGES);
    s.kv_full = bars;
    s.full = bars + 1;
    s.empty = bars + 1 + STAGES;
    s.csync = bars + 1 + 2 * STAGES;
    s.dq_full = bars + 2 + 2 * STAGES;
    s.dq_empty = bars + 4 + 2 * STAGES;
    return s;
}

// The block's place and its q tiles: `per_head` tiles of 64 queries from
// `i_start` for each of the `group` q heads of kv head `kvh`.
struct Work {
    int k0, kvh, b, group, i_start, per_head, ntiles;
};

TPAR_DEVICE Work work_of(const SdpaBwdArgs& a) {
    Work w;
    w.k0 = blockIdx.x * BC;
    w.kvh = blockIdx.y;
    w.b = blockIdx.z;
    w.group = a.q_heads / a.kv_heads;
    // causal: queries before the block's first key see none of its keys
    w.i_start = a.causal ? w.k0 : 0;
    w.per_head = a.q_len > w.i_start ? (a.q_len - w.i_start + BR - 1) / BR : 0;
    w.ntiles = w.group * w.per_head;
    return w;
}

// Warpgroup 0, warp 0: the K and V tiles, then the ring of Q / dO tiles.
template <int HD>
TPAR_DEVICE void produce(const SdpaHopperBwdArgs& p, const Smem& s, const Work& w) {
    constexpr int QT = BR * HD * 2;
    const SdpaBwdArgs& a = p.a;
    const int lane = threadIdx.x % 32;
    if (lane == 0) {
        mbarrier_arrive_expect_tx(s.kv_full, 2u * BC * HD * 2);
        for (int j = 0; j < HD / 64; ++j) {
            tma_load_4d(s.k + j * KBOX, &p.map_k, 64 * j, w.k0, w.kvh, w.b, s.kv_full);
            tma_load_4d(s.v + j * KBOX, &p.map_v, 64 * j, w.k0, w.kvh, w.b, s.kv_full);
        }
    }
    const float inf = tpar_inf();
    for (int it = 0; it < w.ntiles; ++it) {
        const int st = it % STAGES;
        mbarrier_wait_parity(&s.empty[st], (u32)((it / STAGES) & 1) ^ 1u);
        const int h = w.kvh * w.group + it / w.per_head;
        const int i0 = w.i_start + (it % w.per_head) * BR;
        const i64 bh = (i64)w.b * a.q_heads + h;
        unsigned char* sq = s.stage + st * 2 * QT;
        float* sl = s.rows + st * 2 * BR;
        // the copies first (their bytes announced), then lse and delta while
        // they fly; the phase completes with the warp's 32 arrivals and the bytes
        if (lane == 0) {
            mbarrier_expect_tx(&s.full[st], 2u * BR * HD * 2);
            for (int j = 0; j < HD / 64; ++j) {
                tma_load_4d(sq + j * QBOX, &p.map_q, 64 * j, i0, h, w.b, &s.full[st]);
                tma_load_4d(sq + QT + j * QBOX, &p.map_do, 64 * j, i0, h, w.b, &s.full[st]);
            }
        }
        for (int r = lane; r < BR; r += 32) {
            const int i = i0 + r;
            const float lv = i < a.q_len ? a.lse[bh * a.q_len + i] : -inf;
            // a row without gradient (lse = -inf, or past q_len) gets P = 0
            sl[r] = lv == -inf ? inf : lv * kLog2e;
            sl[BR + r] = i < a.q_len ? a.delta[bh * a.q_len + i] : 0.0f;
        }
        mbarrier_arrive(&s.full[st]);
    }
}

// Warpgroup 0, warp 1, lane 0: for every tile, once the consumers filled dQ
// buffer it % 2, adds the whole buffer to the tile's block of dq_acc with
// one bulk reduction (rows past q_len land in the block's padding, which
// nothing reads) and frees the buffer once the reduction has read it.
template <int HD>
TPAR_DEVICE void write_dq(const SdpaBwdArgs& a, const Smem& s, const Work& w) {
    for (int it = 0; it < w.ntiles; ++it) {
        const int b = it & 1;
        const int h = w.kvh * w.group + it / w.per_head;
        const int i0 = w.i_start + (it % w.per_head) * BR;
        const i64 bh = (i64)w.b * a.q_heads + h;
        mbarrier_wait_parity(&s.dq_full[b], (u32)((it / 2) & 1));
        bulk_reduce_add_f32(a.dq_acc + dq_block<HD>(a, bh, i0), s.dq + b * BR * HD,
                            (u32)(BR * HD * 4));
        tma_store_commit();
        tma_store_wait_read<0>();
        mbarrier_arrive(&s.dq_empty[b]);
    }
    tma_store_wait<0>();
}

// A barrier of the 256 consumer threads; `use` counts its uses from 0.
TPAR_DEVICE void csync(u64* bar, u32 use) {
    mbarrier_arrive(bar);
    mbarrier_wait_parity(bar, use & 1u);
}

// acc (BR / 2 accumulators a thread: 64 keys x 64 queries) = the 64 rows of
// the K or V tile `kv` that consumer warpgroup `cw` owns times the Q or dO
// tile `qt` transposed, over HD; issued, not committed (S^T = K Q^T from s.k
// and the stage's Q, dP^T = V dO^T from s.v and its dO).
template <typename T, int HD>
TPAR_DEVICE void keys_by_queries(float* acc, const unsigned char* kv, const unsigned char* qt,
                                 int cw) {
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
        const u32 ko = (ks / 4) * KBOX + cw * 64 * 128 + (ks % 4) * 32;
        const u32 qo = (ks / 4) * QBOX + (ks % 4) * 32;
        wgmma_ss<T, BR, 0, 0>(acc, wgmma_desc(kv + ko, 16, 1024, TPAR_WG_SWIZZLE_128B),
                              wgmma_desc(qt + qo, 16, 1024, TPAR_WG_SWIZZLE_128B), ks > 0);
    }
}

// Consumer warpgroup `cw` (0 or 1): keys k0 + 64 cw .. + 63.
template <typename T, int HD>
TPAR_DEVICE void consume(const SdpaHopperBwdArgs& p, const Smem& s, const Work& w, int cw) {
    constexpr int QT = BR * HD * 2;
    const SdpaBwdArgs& a = p.a;
    const int tw = threadIdx.x % 128;
    const int wi = tw / 32, lane = tw % 32, g = lane / 4, t = lane % 4;
    const int kb = w.k0 + 64 * cw;  // this warpgroup's first key
    const float sl2 = a.scale * kLog2e;
    const T* mask = static_cast<const T*>(a.mask);
    mbarrier_wait_parity(s.kv_full, 0);

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) {
        dk[i] = 0.0f;
        dv[i] = 0.0f;
    }
    for (int it = 0; it < w.ntiles; ++it) {
        const int st = it % STAGES;
        const int h = w.kvh * w.group + it / w.per_head;
        const int i0 = w.i_start + (it % w.per_head) * BR;
        const int nq = min(BR, a.q_len - i0);
        mbarrier_wait_parity(&s.full[st], (u32)((it / STAGES) & 1));
        unsigned char* const sq = s.stage + st * 2 * QT;
        unsigned char* const sg = sq + QT;

        // dS^T of this warpgroup's keys, packed as A fragments (all zeros
        // when causality hides its keys from every query of the tile: then
        // S, dP, dV and dK are skipped).
        u32 sa[4][4];
        if (a.causal && i0 + nq - 1 < kb) {
#pragma unroll
            for (int kq = 0; kq < 4; ++kq)
#pragma unroll
                for (int j = 0; j < 4; ++j) sa[kq][j] = 0u;
        } else {
            // S^T = K Q^T and dP^T = V dO^T: 64 keys x 64 queries, k over HD.
            float sc[BR / 2], dp[BR / 2];
            wgmma_fence();
            keys_by_queries<T, HD>(sc, s.k, sq, cw);
            keys_by_queries<T, HD>(dp, s.v, sg, cw);
            wgmma_commit();
            wgmma_wait<0>();

            // P^T and dS^T. Element i: key kb + r, query i0 + c.
            const float* L = s.rows + st * 2 * BR;
            const float* D = L + BR;
            const bool edge = mask != nullptr || nq < BR || kb + 64 > a.kv_len ||
                              (a.causal && i0 < kb + 63);
#pragma unroll
            for (int i = 0; i < BR / 2; ++i) {
                const int r = 16 * wi + g + 8 * ((i / 2) % 2);
                const int c = 8 * (i / 4) + 2 * t + (i % 2);
                float x = sc[i] * sl2;
                bool ok = true;
                if (edge) {
                    const int j = kb + r, qi = i0 + c;
                    ok = c < nq && j < a.kv_len && !(a.causal && j > qi);
                    if (ok && mask != nullptr)
                        x += to_f32(mask[(i64)w.b * a.mask_bs + (i64)h * a.mask_hs +
                                         (i64)qi * a.mask_rs + j]) *
                             kLog2e;
                }
                const float pv = ok ? exp2_ftz(x - L[c]) : 0.0f;
                sc[i] = pv;
                dp[i] = pv * (dp[i] - D[c]);
            }
            // The accumulator fragment of k step kq (queries 16 kq ..) is the A
            // fragment.
            u32 pa[4][4];
#pragma unroll
            for (int kq = 0; kq < 4; ++kq)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    pa[kq][j] = pack2_rn<T>(sc[8 * kq + 2 * j], sc[8 * kq + 2 * j + 1]);
                    sa[kq][j] = pack2_rn<T>(dp[8 * kq + 2 * j], dp[8 * kq + 2 * j + 1]);
                }

            // dV += P^T dO, dK += dS^T Q (B: the tiles as N-major operands, 16
            // query rows = 2048 bytes per k step, 64-column boxes QBOX apart).
            wgmma_fence();
#pragma unroll
            for (int kq = 0; kq < 4; ++kq) {
                wgmma_rs<T, HD, 1>(dv, pa[kq],
                                   wgmma_desc(sg + kq * 2048, QBOX, 1024, TPAR_WG_SWIZZLE_128B),
                                   true);
                wgmma_rs<T, HD, 1>(dk, sa[kq],
                                   wgmma_desc(sq + kq * 2048, QBOX, 1024, TPAR_WG_SWIZZLE_128B),
                                   true);
            }
            wgmma_commit();
        }

        // dS^T into shared memory, buffer it % 2: both warpgroups' dQ of
        // tile it - 2, which read it, retired before they passed the barrier
        // below in tile it - 1.
        unsigned char* const ds = s.ds + (it & 1) * DS_BYTES;
#pragma unroll
        for (int kq = 0; kq < 4; ++kq)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = 64 * cw + 16 * wi + g + 8 * (j % 2);
                const int col = 16 * kq + 8 * (j / 2) + 2 * t;
                *reinterpret_cast<u32*>(ds + row * 128 + (((col / 8) ^ (row % 8)) * 16) +
                                        (col % 8) * 2) = sa[kq][j];
            }
        fence_proxy_async();
        csync(s.csync, (u32)it);

        // dQ[:, cw HD/2 ..] = dS K over the block's 128 keys (A: dS^T as the
        // M-major operand; B: K as N-major, its 64-column boxes KBOX apart).
        float dq[HD / 4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            const u32 bo = HD == 128 ? cw * KBOX : cw * 64;
            wgmma_ss<T, HD / 2, 1, 1>(
                dq, wgmma_desc(ds + kk * 2048, 8192, 1024, TPAR_WG_SWIZZLE_128B),
                wgmma_desc(s.k + bo + kk * 2048, KBOX, 1024, TPAR_WG_SWIZZLE_128B), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        // every read of this stage (S, dP, dV, dK) has retired
        if (lane == 0) mbarrier_arrive(&s.empty[st]);

        // this warpgroup's columns of the tile into dQ buffer it % 2 in
        // dq_acc's tile layout (dq_unit: one 16-byte store per column group,
        // a warp's 32 at consecutive addresses) once the writer's reduction
        // of tile it - 2 has read it; the writer reduces them when all 256
        // threads arrived
        const int b = it & 1;
        mbarrier_wait_parity(&s.dq_empty[b], (u32)((it / 2) & 1) ^ 1u);
        float* const sdq = s.dq + b * BR * HD;
#pragma unroll
        for (int i = 0; i < HD / 4; i += 4) {
            *reinterpret_cast<Raw16*>(sdq + dq_frag_unit<HD>(cw, tw, i / 4)) =
                Raw16{{__float_as_uint(dq[i]), __float_as_uint(dq[i + 1]),
                       __float_as_uint(dq[i + 2]), __float_as_uint(dq[i + 3])}};
        }
        fence_proxy_async();
        mbarrier_arrive(&s.dq_full[b]);
    }

    // dK (times scale) and dV of this warpgroup's keys, through k's and v's strides.
    T* dkp = static_cast<T*>(a.dk) + p.st.k.at(w.b, w.kvh, 0);
    T* dvp = static_cast<T*>(a.dv) + p.st.v.at(w.b, w.kvh, 0);
#pragma unroll
    for (int i = 0; i < HD / 2; i += 2) {
        const int r = 16 * wi + g + 8 * ((i / 2) % 2);
        const int c = 8 * (i / 4) + 2 * t;
        const int j = kb + r;
        if (j < a.kv_len) {
            *reinterpret_cast<u32*>(dkp + j * p.st.k.row + c) =
                pack2_rn<T>(dk[i] * a.scale, dk[i + 1] * a.scale);
            *reinterpret_cast<u32*>(dvp + j * p.st.v.row + c) = pack2_rn<T>(dv[i], dv[i + 1]);
        }
    }
}

template <typename T, int HD>
TPAR_DEVICE void run(const SdpaHopperBwdArgs& p) {
    const Smem s = carve<HD>();
    const Work w = work_of(p.a);
    if (threadIdx.x == 0) {
        tma_prefetch(&p.map_q);
        tma_prefetch(&p.map_k);
        tma_prefetch(&p.map_v);
        tma_prefetch(&p.map_do);
        mbarrier_init(s.kv_full, 1);
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(&s.full[i], 32);  // the producer warp
            mbarrier_init(&s.empty[i], 8);  // lane 0 of each consumer warp
        }
        mbarrier_init(s.csync, 256);
        for (int i = 0; i < 2; ++i) {
            mbarrier_init(&s.dq_full[i], 256);  // every consumer thread
            mbarrier_init(&s.dq_empty[i], 1);   // the writer
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<24>();
        if (threadIdx.x < 32)
            produce<HD>(p, s, w);
        else if (threadIdx.x == 32)
            write_dq<HD>(p.a, s, w);
    } else {
        setmaxnreg_inc<240>();
        consume<T, HD>(p, s, w, wg - 1);
    }
}

// dq = scale * dq_acc rounded to T, from the tile layout (dq_unit) into dq
// [batch, q_heads, q_len, HD] through its strides, rows past q_len skipped;
// grid-strided. Item e
// is unit (r, c) of tile e / (16 HD) (p = e % (16 HD) / (HD / 2): r = 16 (p
// / 8) + p % 8, c = 2 (e % (HD / 2))): a 16-byte read (4 consecutive items
// read 64 consecutive bytes) and the pairs (r, c..) and (r + 8, c..) written
// (a warp's 32 items write 128 consecutive bytes of each of its two rows).
template <typename T, int HD>
TPAR_DEVICE void convert_dq(const SdpaHopperBwdArgs& args) {
    const SdpaBwdArgs& a = args.a;
    const int tiles = dq_tiles(a);
    const i64 n = (i64)a.batch * a.q_heads * tiles * (16 * HD);
    T* dq = static_cast<T*>(a.dq);
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += step) {
        const i64 tile = e / (16 * HD), bh = tile / tiles;
        const int p = (int)(e % (16 * HD)) / (HD / 2);
        const int r = 16 * (p / 8) + p % 8, c = 2 * (int)(e % (HD / 2));
        const int i0 = (int)(tile % tiles) * BR;
        const Raw16 v =
            *reinterpret_cast<const Raw16*>(a.dq_acc + dq_block<HD>(a, bh, i0) + dq_unit(r, c));
        T* const head = dq + args.st.q.at(bh / a.q_heads, bh % a.q_heads, 0) + c;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int i = i0 + r + 8 * k;
            if (i < a.q_len) {
                T* o = head + i * args.st.q.row;
                o[0] = from_f32<T>(__uint_as_float(v.w[2 * k]) * a.scale);
                o[1] = from_f32<T>(__uint_as_float(v.w[2 * k + 1]) * a.scale);
            }
        }
    }
}

template <typename T>
TPAR_DEVICE void convert_dq(const SdpaHopperBwdArgs& p) {
    if (p.a.head_dim == 64)
        convert_dq<T, 64>(p);
    else
        convert_dq<T, 128>(p);
}

}  // namespace sdpa_hopper_bwd

TPAR_KERNEL(tpar_sdpa_bwd_hopper64_bf16, TPAR_GRID_CONSTANT(SdpaHopperBwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper_bwd, bf16, 64);
}
TPAR_KERNEL(tpar_sdpa_bwd_hopper128_bf16, TPAR_GRID_CONSTANT(SdpaHopperBwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper_bwd, bf16, 128);
}
TPAR_KERNEL(tpar_sdpa_bwd_hopper64_f16, TPAR_GRID_CONSTANT(SdpaHopperBwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper_bwd, f16, 64);
}
TPAR_KERNEL(tpar_sdpa_bwd_hopper128_f16, TPAR_GRID_CONSTANT(SdpaHopperBwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper_bwd, f16, 128);
}

// dq from the accumulator's tile layout (any architecture: no wgmma).
// (It takes the main kernels' arguments for the strides of dq; the maps are unused.)
TPAR_KERNEL(tpar_sdpa_bwd_hopper_dq_bf16, SdpaHopperBwdArgs, 256) {
    sdpa_hopper_bwd::convert_dq<bf16>(args);
}
TPAR_KERNEL(tpar_sdpa_bwd_hopper_dq_f16, SdpaHopperBwdArgs, 256) {
    sdpa_hopper_bwd::convert_dq<f16>(args);
}
