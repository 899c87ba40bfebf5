// The Hopper (sm_90a) attention forward pass, FlashAttention-3 style:
// out = softmax(scale * q k^T + mask) v and lse (f32, natural log) per
// (batch, q head), with the semantics of sdpa.cu's forward (GQA, top-left
// causal, an additive mask of the attention dtype broadcast by strides, fully
// masked rows give zeros and lse = -inf). bf16 and f16, head_dim == v_dim in
// {64, 128}. Launcher: src/cuda/raw/sdpa_hopper.rs.
//
// One block = 3 warpgroups (384 threads) per (128-row q tile, q head, batch),
// heavy causal tiles first:
// - warpgroup 0 produces (setmaxnreg_dec): one thread brings the q tile once
//   and the k and v tiles of BN = 128 keys into a ring of 3 stages (head dim
//   64) or 2 (128) by bulk tensor
//   copies (4-D maps over (head_dim, seq, heads, batch) with the operands'
//   row, head and batch strides, so q, k and v may lie dense as [batch,
//   heads, seq, head_dim] or side by side in the rows of a [batch, seq,
//   heads * head_dim] or packed qkv buffer; 128-byte swizzle, boxes of 64
//   columns: one box per 64 of the head dim), each stage guarded
//   by "k full" and "v full" mbarriers (the copies' transaction bytes) and
//   "k empty" and "v empty" mbarriers (lane 0 of each of the 8 consumer
//   warps); v lags k by one tile (k0, k1, v0, k2, v1, ...), the order the
//   consumers read them in, and a k tile's slot is refilled as soon as its
//   scores are computed;
// - warpgroups 1 and 2 consume (setmaxnreg_inc): each owns 64 q rows. Per key
//   tile: S = q k^T with wgmma_ss (q and k K-major: 128-byte rows of 64 head
//   dims, 8-row groups 1024 bytes apart, a 16-column k slice 32 bytes
//   further, the next 64 columns one box further); the scale folded into
//   exp2's argument; masks (keys past kv_len, the causal diagonal, the
//   additive mask read from global memory) only in the tiles that need them;
//   the online softmax in registers (a row's max and sum across the 4 threads
//   that hold it); P rounded to 16 bits in registers as wgmma's A fragments;
//   O += P v with wgmma_rs (v N-major: 64 head dims per 128-byte row, 8-key
//   groups 1024 bytes apart, 16 keys 2048 bytes further, the next 64 head
//   dims one box further = the leading byte offset). The scores of tile n are
//   issued with the P v of tile n - 1, so the softmax of one overlaps the
//   other (see `consume`), and the two consumer warpgroups take turns
//   issuing their products (an mbarrier per warpgroup), so that one's softmax
//   runs while the other's products occupy the tensor cores.
// Out-of-range q rows and keys load as zeros (the maps bound the sequence of
// each head of each batch: rows past seq never reach the next head's or
// batch's rows, whatever the strides); those keys are masked, those rows
// never stored. lse is written
// by one thread of each row. The output goes through shared memory, as in
// FlashAttention-3: once a consumer warpgroup's last q k^T has retired, its
// 64 rows of the q tile are free (the other warpgroup reads only its own),
// and it writes its normalised 16-bit O there in the q tile's layout (the
// 128-byte swizzle: element (r, c) of the warpgroup's rows in box c / 64,
// row r at 128 r, 16-byte unit ((c % 64) / 8) ^ (r % 8), `o_staged`), then
// one thread stores the HD / 64 boxes of 64 x 64 with bulk tensor stores
// (map_o, 4-D over out with its strides, which clips the rows past q_len and
// writes nothing else: an output in the rows of a wider buffer keeps the
// other columns). Each store of a warp (two
// elements, 4 bytes, per lane: rows 16 w + g (+ 8), columns 8 t + 2 q, + 1
// of an 8-column block t) puts its 8 rows' 16 bytes in units
// (t % 8) ^ g, 8 distinct units (r % 8 = g): 32 distinct banks, one
// wavefront for the 128 bytes (not measured on a GPU).
//
// Compiled for an architecture without wgmma (sm_90, sm_80), the kernels are
// empty: the launcher only picks them for devices compiled for sm_90a.

struct SdpaHopperFwdArgs {
    TparTensorMap map_q;  // (head_dim, q_len, q_heads, batch), box 64 x 128 x 1 x 1
    TparTensorMap map_k;  // (head_dim, kv_len, kv_heads, batch), box 64 x 128 x 1 x 1
    TparTensorMap map_v;  // like map_k over v
    TparTensorMap map_o;  // (head_dim, q_len, q_heads, batch) over out, box 64 x 64 x 1 x 1
    void* out;            // element (0, 0, 0, 0) of the output (written through map_o)
    float* lse;           // [batch, q_heads, q_len]
    const void* mask;     // additive mask (attention dtype), or null
    i64 mask_bs, mask_hs, mask_rs;
    i32 batch, q_heads, kv_heads, q_len, kv_len;
    i32 causal;
    float scale;
    i32 pad[13];
};

namespace sdpa_hopper {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int BM = 128, BN = 128;
// One box: 64 columns (128 bytes) of 128 rows.
constexpr u32 BOX_BYTES = 128 * 128;

template <int HD>
struct Smem {
    static constexpr u32 TILE = (u32)(HD / 64) * BOX_BYTES;  // q, k or v tile
    // stages of the k / v ring: 3 at head dim 64 (83 KiB more would not fit at 128)
    static constexpr int STAGES = HD == 64 ? 3 : 2;
    TPAR_DEVICE unsigned char* k(int st) const { return k0 + st * TILE; }
    TPAR_DEVICE unsigned char* v(int st) const { return v0 + st * TILE; }
    unsigned char* q;
    unsigned char* k0;  // stage st's k tile at k0 + st * TILE (computed, not an
    unsigned char* v0;  // array indexed at run time, which would live in local memory)
    u64* q_full;
    u64* k_full;  // [STAGES]
    u64* v_full;  // [STAGES]
    u64* k_empty; // [STAGES]
    u64* v_empty; // [STAGES]
    u64* turn;    // [2]: consumer warpgroup c may issue its products (128 arrivals)
    u64* o_ready; // [2]: consumer warpgroup c has staged its O rows (128 arrivals)
};

template <int HD>
TPAR_DEVICE Smem<HD> carve() {
    const u32 at = tpar_shared_addr(tpar_dyn_smem);
    unsigned char* base = tpar_dyn_smem + ((1024u - (at & 1023u)) & 1023u);
    Smem<HD> s;
    constexpr u32 T = Smem<HD>::TILE;
    constexpr int STAGES = Smem<HD>::STAGES;
    s.q = base;
    s.k0 = base + T;
    s.v0 = base + (1 + STAGES) * T;
    u64* bars = reinterpret_cast<u64*>(base + (1 + 2 * STAGES) * T);
    s.q_full = bars;
    s.k_full = bars + 1;
    s.v_full = bars + 1 + STAGES;
    s.k_empty = bars + 1 + 2 * STAGES;
    s.v_empty = bars + 1 + 3 * STAGES;
    s.turn = bars + 1 + 4 * STAGES;
    s.o_ready = bars + 3 + 4 * STAGES;
    return s;
}

// The byte offset of element (r, c) of a consumer warpgroup's 64 rows of O
// staged in its rows of the q tile: box c / 64, row r, 16-byte unit
// ((c % 64) / 8) ^ (r % 8) (the 128-byte swizzle), element c % 8.
TPAR_DEVICE u32 o_staged(int r, int c) {
    return (u32)((c / 64) * BOX_BYTES + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2);
}

// The block's q tile, heads and key tiles.
struct Work {
    int m0;       // first q row
    int h, b;     // q head, batch
    int kvh;      // kv head
    int tiles;    // key tiles to visit
};

TPAR_DEVICE Work work_of(const SdpaHopperFwdArgs& a) {
    Work w;
    w.m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heavy causal tiles first
    w.h = blockIdx.y;
    w.b = blockIdx.z;
    w.kvh = w.h / (a.q_heads / a.kv_heads);
    // Causal: keys past the tile's last row are masked for every row.
    const int kv_end = a.causal ? min(a.kv_len, w.m0 + BM) : a.kv_len;
    w.tiles = (kv_end + BN - 1) / BN;
    return w;
}

// Warpgroup 0, one thread: the q tile, then k and v through the ring.
template <int HD>
TPAR_DEVICE void produce(const SdpaHopperFwdArgs& a, const Smem<HD>& s, const Work& w) {
    constexpr u32 T = Smem<HD>::TILE;
    constexpr int STAGES = Smem<HD>::STAGES;
    mbarrier_arrive_expect_tx(s.q_full, T);
#pragma unroll
    for (int c = 0; c < HD / 64; ++c)
        tma_load_4d(s.q + c * BOX_BYTES, &a.map_q, c * 64, w.m0, w.h, w.b, s.q_full);
    // tile n of k (is_v = 0) or v (1) into its stage, once the slot is free
    auto load = [&](int n, int is_v) {
        const int st = n % STAGES;
        const u32 phase = (u32)((n / STAGES) & 1);
        u64* full = is_v ? &s.v_full[st] : &s.k_full[st];
        mbarrier_wait_parity(is_v ? &s.v_empty[st] : &s.k_empty[st], phase ^ 1u);
        mbarrier_arrive_expect_tx(full, T);
        unsigned char* dst = is_v ? s.v(st) : s.k(st);
        const TparTensorMap* map = is_v ? &a.map_v : &a.map_k;
#pragma unroll
        for (int c = 0; c < HD / 64; ++c)
            tma_load_4d(dst + c * BOX_BYTES, map, c * 64, n * BN, w.kvh, w.b, full);
    };
    if (w.tiles > 0) load(0, 0);
    for (int n = 0; n < w.tiles; ++n) {
        if (n + 1 < w.tiles) load(n + 1, 0);
        load(n, 1);
    }
}

// The scores of one key tile, in a consumer thread's registers: its two
// rows, the mask, and the running max and sum of the online softmax.
struct Rows {
    int row[2];      // this thread's rows (accumulator elements with (i / 2) % 2 = 0, 1)
    int wg_row0;     // the warpgroup's first row
    int q;           // lane % 4: the columns 2q, 2q + 1 of each 8-column group
    float m[2], l[2];
};

// Scales, masks (only tiles reaching past kv_len or above the warpgroup's
// first row when causal, or with an additive mask, look at elements) and
// exponentiates the scores `sc` of key tile j0 in place, updating the running
// max and (per-thread partial) sum; returns the factor each row's output
// must be rescaled by.
template <typename T>
TPAR_DEVICE void softmax_step(const SdpaHopperFwdArgs& a, const T* M, int j0, Rows& r,
                              float (&sc)[BN / 2], float (&alpha)[2]) {
    const float sl2 = a.scale * kLog2e;
    const float ninf = -tpar_inf();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) sc[i] *= sl2;
    const bool check = j0 + BN > a.kv_len || (a.causal && j0 + BN - 1 > r.wg_row0) || M;
    if (check) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int row = r.row[hr];
            // key j0 + c is visible when c < lim
            const int lim = (a.causal ? min(a.kv_len, row + 1) : a.kv_len) - j0;
            // Rows past q_len (never stored) read the last row's mask.
            const T* mr = M ? M + (i64)min(row, a.q_len - 1) * a.mask_rs + j0 : nullptr;
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) {
                if (((i / 2) % 2) != hr) continue;
                const int c = 8 * (i / 4) + 2 * r.q + (i % 2);
                if (c >= lim) {
                    sc[i] = ninf;
                } else if (mr) {
                    sc[i] += to_f32(mr[c]) * kLog2e;
                }
            }
        }
    }
    // Online softmax; `base` keeps exp2 finite for rows masked so far.
    float mx[2] = {ninf, ninf};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], sc[i]);
    float base[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(TPAR_FULL_MASK, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(TPAR_FULL_MASK, mx[hr], 2));
        const float mnew = fmaxf(r.m[hr], mx[hr]);
        base[hr] = mnew == ninf ? 0.0f : mnew;
        alpha[hr] = exp2_ftz(r.m[hr] - base[hr]);
        r.m[hr] = mnew;
        r.l[hr] *= alpha[hr];
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
        const float p = exp2_ftz(sc[i] - base[(i / 2) % 2]);
        r.l[(i / 2) % 2] += p;
        sc[i] = p;
    }
}

// P as wgmma's A fragments: 16-key slice kk is accumulator elements 8 kk ..
// 8 kk + 7 (rows g, g + 8 of key groups 2 kk, 2 kk + 1).
template <typename T>
TPAR_DEVICE void to_fragments(const float (&sc)[BN / 2], u32 (&pa)[BN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) pa[kk][j] = pack2_rn<T>(sc[8 * kk + 2 * j], sc[8 * kk + 2 * j + 1]);
}

// Issues S = q k^T over stage st (64 x BN per warpgroup) as one commit group.
template <typename T, int HD>
TPAR_DEVICE void issue_qk(const Smem<HD>& s, int st, int cw, float (&sc)[BN / 2]) {
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
        const u64 da = wgmma_desc(s.q + (ks / 4) * BOX_BYTES + cw * 64 * 128 + (ks % 4) * 32, 16,
                                  1024, TPAR_WG_SWIZZLE_128B);
        const u64 db = wgmma_desc(s.k(st) + (ks / 4) * BOX_BYTES + (ks % 4) * 32, 16, 1024,
                                  TPAR_WG_SWIZZLE_128B);
        wgmma_ss<T, BN, 0, 0>(sc, da, db, ks > 0);
    }
    wgmma_commit();
}

// Issues O += P v over stage st (64 x HD per warpgroup) as one commit group.
template <typename T, int HD>
TPAR_DEVICE void issue_pv(const Smem<HD>& s, int st, const u32 (&pa)[BN / 16][4],
                          float (&o)[HD / 2]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        const u64 db = wgmma_desc(s.v(st) + kk * 2048, BOX_BYTES, 1024, TPAR_WG_SWIZZLE_128B);
        wgmma_rs<T, HD, 1>(o, pa[kk], db, true);
    }
    wgmma_commit();
}

// Warpgroups 1 and 2 (cw = 0, 1): rows m0 + 64 cw .. + 63. Key tile n's
// scores are issued together with tile n - 1's P v, so that the softmax of
// tile n overlaps that product (FlashAttention-3's intra-warpgroup
// pipelining): wait for the scores (wgmma_wait<1>), softmax, wait for P v
// (wgmma_wait<0>), release tile n - 1's stage, rescale O, and only then
// overwrite P (the pending P v reads it).
template <typename T, int HD>
TPAR_DEVICE void consume(const SdpaHopperFwdArgs& a, const Smem<HD>& s, const Work& w, int cw) {
    constexpr int STAGES = Smem<HD>::STAGES;
    const int tw = threadIdx.x % 128;
    const int wp = tw / 32, lane = tw % 32, g = lane / 4;
    const float ninf = -tpar_inf();
    Rows r;
    r.wg_row0 = w.m0 + 64 * cw;
    r.row[0] = r.wg_row0 + 16 * wp + g;
    r.row[1] = r.row[0] + 8;
    r.q = lane % 4;
    r.m[0] = r.m[1] = ninf;
    r.l[0] = r.l[1] = 0.0f;
    const int q = r.q;
    const T* M = a.mask ? static_cast<const T*>(a.mask) + (i64)w.b * a.mask_bs +
                              (i64)w.h * a.mask_hs
                        : nullptr;

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.0f;
    float sc[BN / 2];
    u32 pa[BN / 16][4];
    float alpha[2];

    // The two consumer warpgroups take turns issuing their products (FA3's
    // ping-pong): the k-th issue of warpgroup c waits for phase k of turn[c]
    // and then completes a phase of turn[1 - c], so one warpgroup's softmax
    // runs while the other's products occupy the tensor cores. Warpgroup 1
    // opens turn[0]'s first phase.
    u32 turns = 0;
    auto my_turn = [&]() { mbarrier_wait_parity(&s.turn[cw], turns++ & 1u); };
    auto pass_turn = [&]() { mbarrier_arrive(&s.turn[1 - cw]); };
    if (cw == 1) pass_turn();

    mbarrier_wait_parity(s.q_full, 0u);
    if (w.tiles > 0) {
        mbarrier_wait_parity(&s.k_full[0], 0u);
        my_turn();
        wgmma_fence();
        issue_qk<T, HD>(s, 0, cw, sc);
        pass_turn();
        wgmma_wait<0>();
        if (lane == 0) mbarrier_arrive(&s.k_empty[0]);
        softmax_step<T>(a, M, 0, r, sc, alpha);  // O is 0: alpha is not needed
        to_fragments<T>(sc, pa);
    }
    for (int n = 1; n < w.tiles; ++n) {
        const int st = n % STAGES, pst = (n - 1) % STAGES;
        mbarrier_wait_parity(&s.k_full[st], (u32)((n / STAGES) & 1));
        mbarrier_wait_parity(&s.v_full[pst], (u32)(((n - 1) / STAGES) & 1));
        my_turn();
        wgmma_fence();
        issue_qk<T, HD>(s, st, cw, sc);
        issue_pv<T, HD>(s, pst, pa, o);
        pass_turn();
        wgmma_wait<1>();  // the scores (k tile n is read); P v may still run
        if (lane == 0) mbarrier_arrive(&s.k_empty[st]);
        softmax_step<T>(a, M, n * BN, r, sc, alpha);
        wgmma_wait<0>();  // P v of tile n - 1: its v tile is read, O and P free
        if (lane == 0) mbarrier_arrive(&s.v_empty[pst]);
#pragma unroll
        for (int i = 0; i < HD / 2; ++i) o[i] *= alpha[(i / 2) % 2];
        to_fragments<T>(sc, pa);
    }
    if (w.tiles > 0) {
        const int last = w.tiles - 1, st = last % STAGES;
        mbarrier_wait_parity(&s.v_full[st], (u32)((last / STAGES) & 1));
        my_turn();
        wgmma_fence();
        issue_pv<T, HD>(s, st, pa, o);
        pass_turn();
        wgmma_wait<0>();
        if (lane == 0) mbarrier_arrive(&s.v_empty[st]);
    }

    // Final normalisation and lse; O into this warpgroup's rows of the q
    // tile (its last q k^T has retired: wgmma_wait<0> above), then the bulk
    // stores of those rows (the header's argument).
    unsigned char* stage = s.q + cw * 64 * 128;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float lt = r.l[hr];
        lt += __shfl_xor_sync(TPAR_FULL_MASK, lt, 1);
        lt += __shfl_xor_sync(TPAR_FULL_MASK, lt, 2);
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        const int row = r.row[hr];
        if (row < a.q_len && q == 0)
            a.lse[((i64)w.b * a.q_heads + w.h) * a.q_len + row] = lt > 0.0f ? r.m[hr] * kLn2 + logf(lt) : ninf;
        const int lr = row - r.wg_row0;
#pragma unroll
        for (int i = 0; i < HD / 2; i += 2) {
            if (((i / 2) % 2) != hr) continue;
            const int c = 8 * (i / 4) + 2 * q;
            *reinterpret_cast<u32*>(stage + o_staged(lr, c)) =
                pack2_rn<T>(o[i] * inv, o[i + 1] * inv);
        }
    }
    fence_proxy_async();
    mbarrier_arrive(&s.o_ready[cw]);
    mbarrier_wait_parity(&s.o_ready[cw], 0u);
    if (tw == 0) {
#pragma unroll
        for (int c = 0; c < HD / 64; ++c)
            tma_store_4d(&a.map_o, c * 64, r.wg_row0, w.h, w.b, stage + c * BOX_BYTES);
        tma_store_commit();
        // the stores have read the staging (and written out) before the block ends
        tma_store_wait<0>();
    }
}

template <typename T, int HD>
TPAR_DEVICE void run(const SdpaHopperFwdArgs& a) {
    const Smem<HD> s = carve<HD>();
    constexpr int STAGES = Smem<HD>::STAGES;
    const Work w = work_of(a);
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        tma_prefetch(&a.map_q);
        tma_prefetch(&a.map_k);
        tma_prefetch(&a.map_v);
        tma_prefetch(&a.map_o);
        mbarrier_init(s.q_full, 1);
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(&s.k_full[i], 1);
            mbarrier_init(&s.v_full[i], 1);
            mbarrier_init(&s.k_empty[i], 8);  // lane 0 of each consumer warp
            mbarrier_init(&s.v_empty[i], 8);
        }
        mbarrier_init(&s.turn[0], 128);
        mbarrier_init(&s.turn[1], 128);
        mbarrier_init(&s.o_ready[0], 128);
        mbarrier_init(&s.o_ready[1], 128);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) produce<HD>(a, s, w);
    } else {
        setmaxnreg_inc<240>();
        consume<T, HD>(a, s, w, wg - 1);
    }
}

}  // namespace sdpa_hopper

// tpar_sdpa_hopper_fwd<head_dim>_<dtype>
TPAR_KERNEL(tpar_sdpa_hopper_fwd64_bf16, TPAR_GRID_CONSTANT(SdpaHopperFwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper, bf16, 64);
}
TPAR_KERNEL(tpar_sdpa_hopper_fwd128_bf16, TPAR_GRID_CONSTANT(SdpaHopperFwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper, bf16, 128);
}
TPAR_KERNEL(tpar_sdpa_hopper_fwd64_f16, TPAR_GRID_CONSTANT(SdpaHopperFwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper, f16, 64);
}
TPAR_KERNEL(tpar_sdpa_hopper_fwd128_f16, TPAR_GRID_CONSTANT(SdpaHopperFwdArgs), TPAR_SDPA_HOPPER_BOUNDS) {
    TPAR_SDPA_HOPPER_RUN(sdpa_hopper, f16, 128);
}
