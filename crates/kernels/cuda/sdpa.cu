// Scaled dot-product attention, flash-attention style (same meaning as the
// CPU op in src/sdpa/).
//
// q [batch, q_heads, q_len, head_dim], k [batch, kv_heads, kv_len, head_dim],
// v [batch, kv_heads, kv_len, v_dim], out [batch, q_heads, q_len, v_dim],
// each addressed through its element strides (SdpaOpStrides: element
// (b, h, i, j) at b*batch + h*head + i*row + j; dq, dk, dv and dout take the
// strides of q, k, v and out), so that e.g. the heads of a [b, s, h, d] tensor
// or of a packed q/k/v projection are read and written in place;
// lse [batch, q_heads, q_len] (f32, natural log), the mask, delta and the dq
// accumulator have fixed layouts. q head h reads kv head
// h / (q_heads / kv_heads). Causal masking is top-left aligned (query i sees
// keys j <= i). The optional additive mask (same element type as q) holds the
// element for (b, h, i, j) at b*mask_bs + h*mask_hs + i*mask_rs + j; -inf
// masks a key out. A query row with every key masked gets zeros, lse = -inf
// and no gradient.
//
// Forward: one block per (query block, q head, batch) walks the key tiles
// with an online softmax (exp2 domain, f32), never storing the score matrix,
// and saves lse.
// Backward: `bwd_pre` computes delta = rowsum(dout * out) and zeroes the f32
// dq accumulator; one block per (key block, kv head, batch) loops over the
// q heads of its group and their query tiles, recomputes P from lse, keeps
// dK and dV in registers (one writer per element) and adds dQ = dS K into
// the f32 accumulator with atomics; `bwd_dq` scales and converts it.
//
// Two kernel families:
// - `tc<HD>` (bf16/f16): tensor cores (mma.sync m16n8k16, ldmatrix from
//   XOR-swizzled shared tiles, cp.async loads overlapped with compute), head
//   dims padded to HD = 64 or 128; needs head_dim and v_dim multiples of 8,
//   16-byte aligned q/k/v/out/dout/dk/dv and strides that are multiples of
//   16 bytes (every row starts 16-byte aligned), row strides below 2^24
//   elements (tile offsets in i32). The forward takes 64 query
//   rows per block (`tc<HD>`) or 128 (`tc<HD>m2`, two 16-row tiles per warp).
// - `simt<NC>` (any type, head dims up to 32*NC <= 256): f32 FMA on 4x4
//   register tiles, the head dim streamed through shared memory in chunks of
//   32 columns.

// SdpaOpStrides and SdpaArgStrides (the operands' strides) are tpar.cuh's.

struct SdpaFwdArgs {
    const void* q;
    const void* k;
    const void* v;
    const void* mask;  // null: no mask
    void* out;
    float* lse;
    i64 mask_bs;
    i64 mask_hs;
    i64 mask_rs;
    i32 batch;
    i32 q_heads;
    i32 kv_heads;
    i32 q_len;
    i32 kv_len;
    i32 head_dim;
    i32 v_dim;
    i32 causal;
    float scale;
    i32 pad;
    SdpaArgStrides st;
};

// The backward kernels of this file take the shared SdpaBwdArgs (tpar.cuh)
// and the operands' strides (sdpa_hopper_bwd's launcher runs the pre and dq
// kernels with the same arguments).
struct SdpaBwdStridedArgs {
    SdpaBwdArgs a;
    SdpaArgStrides st;
};

namespace sdpa {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Query and key rows per tile.
constexpr int kBlock = 64;

// ------------------------------------------------------------------ SIMT

// Rows of the [*, 33] f32 chunk buffers (33: conflict-free column reads).
constexpr int kLd = 33;

// Copies columns c0..c0+31 of rows 0..ROWS-1 of a matrix whose rows are `ld`
// elements apart into s[ROWS][33] as f32; zero outside `nrows` x `ncols`.
template <typename T, int ROWS, int NT>
TPAR_DEVICE void simt_chunk(float* s, const T* g, i64 ld, int nrows, int c0, int ncols) {
    static_assert(ROWS * 32 % NT == 0, "whole passes of the block");
#pragma unroll
    for (int it = 0; it < ROWS * 32 / NT; ++it) {
        const int e = threadIdx.x + it * NT;
        const int r = e >> 5, c = e & 31;
        float x = 0.0f;
        if (r < nrows && c0 + c < ncols) x = to_f32(g[r * ld + c0 + c]);
        s[r * kLd + c] = x;
    }
}

// Max over the 16 lanes of a half warp.
TPAR_DEVICE float half_warp_max(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(TPAR_FULL_MASK, v, o));
    return v;
}

TPAR_DEVICE float half_warp_sum(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(TPAR_FULL_MASK, v, o);
    return v;
}

// Forward, 256 threads as a 16 x 16 grid (ty, tx): thread (ty, tx) owns
// query rows ty + 16i and key columns tx + 16j of the 64 x 64 score tile, and
// output columns c*32 + tx + 16e. NC = 32-column chunks of v_dim.
template <typename T, int NC>
TPAR_DEVICE void fwd_simt(const SdpaFwdArgs& a) {
    constexpr int NT = 256;
    float* sA = reinterpret_cast<float*>(tpar_dyn_smem);  // [64][33] q / v chunk
    float* sB = sA + kBlock * kLd;                         // [64][33] k chunk
    float* sP = sB + kBlock * kLd;                         // [64][65] probabilities
    constexpr int kLdP = kBlock + 1;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlock;  // heavy causal blocks first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (a.q_heads / a.kv_heads);
    const i64 bh = (i64)b * a.q_heads + h;
    const i64 qld = a.st.q.row, kld = a.st.k.row, vld = a.st.v.row;
    const T* Q = static_cast<const T*>(a.q) + a.st.q.at(b, h, q0);
    const T* K = static_cast<const T*>(a.k) + a.st.k.at(b, kvh, 0);
    const T* V = static_cast<const T*>(a.v) + a.st.v.at(b, kvh, 0);
    const T* M = a.mask ? static_cast<const T*>(a.mask) + b * a.mask_bs + h * a.mask_hs : nullptr;
    const int nq = min(kBlock, a.q_len - q0);
    const int kv_end = a.causal ? min(a.kv_len, q0 + kBlock) : a.kv_len;
    const float sl2 = a.scale * kLog2e;
    const float ninf = -tpar_inf();

    float o[4][2 * NC], m[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = ninf;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < 2 * NC; ++c) o[i][c] = 0.0f;
    }

    for (int j0 = 0; j0 < kv_end; j0 += kBlock) {
        const int nk = min(kBlock, a.kv_len - j0);
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
        for (int c0 = 0; c0 < a.head_dim; c0 += 32) {
            __syncthreads();
            simt_chunk<T, kBlock, NT>(sA, Q, qld, nq, c0, a.head_dim);
            simt_chunk<T, kBlock, NT>(sB, K + j0 * kld, kld, nk, c0, a.head_dim);
            __syncthreads();
#pragma unroll 8
            for (int d = 0; d < 32; ++d) {
                float qa[4], kb[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    qa[i] = sA[(ty + 16 * i) * kLd + d];
                    kb[i] = sB[(tx + 16 * i) * kLd + d];
                }
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) s[i][j] += qa[i] * kb[j];
            }
        }
        // Scores in the exp2 domain, masked; online softmax per row.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = q0 + ty + 16 * i;
            float mx = ninf;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = j0 + tx + 16 * j;
                float x = s[i][j] * sl2;
                if (c >= a.kv_len || (a.causal && c > r)) {
                    x = ninf;
                } else if (M != nullptr && r < a.q_len) {
                    x += to_f32(M[(i64)r * a.mask_rs + c]) * kLog2e;
                }
                s[i][j] = x;
                mx = fmaxf(mx, x);
            }
            mx = half_warp_max(mx);
            const float mnew = fmaxf(m[i], mx);
            const float base = mnew == ninf ? 0.0f : mnew;
            const float alpha = exp2f(m[i] - base);
            m[i] = mnew;
            l[i] *= alpha;
#pragma unroll
            for (int c = 0; c < 2 * NC; ++c) o[i][c] *= alpha;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = exp2f(s[i][j] - base);
                l[i] += p;
                s[i][j] = p;
            }
        }
        __syncthreads();  // earlier readers of sP and sA are done
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) sP[(ty + 16 * i) * kLdP + tx + 16 * j] = s[i][j];
        // o += P v, one 32-column chunk of v at a time.
#pragma unroll
        for (int vc = 0; vc < NC; ++vc) {
            if (vc * 32 < a.v_dim) {
                __syncthreads();
                simt_chunk<T, kBlock, NT>(sA, V + j0 * vld, vld, nk, vc * 32, a.v_dim);
                __syncthreads();
#pragma unroll 4
                for (int j = 0; j < kBlock; ++j) {
                    const float v0 = sA[j * kLd + tx], v1 = sA[j * kLd + tx + 16];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float p = sP[(ty + 16 * i) * kLdP + j];
                        o[i][2 * vc] += p * v0;
                        o[i][2 * vc + 1] += p * v1;
                    }
                }
            }
        }
    }

    T* out = static_cast<T*>(a.out) + a.st.out.at(b, h, 0);
    const i64 out_ld = a.st.out.row;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float lt = half_warp_sum(l[i]);
        const int r = q0 + ty + 16 * i;
        if (r < a.q_len) {
            const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
            for (int vc = 0; vc < NC; ++vc)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = vc * 32 + tx + 16 * e;
                    if (c < a.v_dim)
                        out[r * out_ld + c] = from_f32<T>(o[i][2 * vc + e] * inv);
                }
            if (tx == 0) a.lse[bh * a.q_len + r] = lt > 0.0f ? m[i] * kLn2 + logf(lt) : ninf;
        }
    }
}

// Backward dK/dV (and dQ by atomics), 256 threads as 16 x 16 (ty, tx):
// thread (ty, tx) owns keys ty + 16i of the block's 64 and queries tx + 16j
// of each 32-query tile, and dK/dV columns c*32 + tx + 16e.
template <typename T, int NC>
TPAR_DEVICE void bwd_simt_block(const SdpaBwdArgs& a, const SdpaArgStrides& st, int kb) {
    constexpr int NT = 256, BQ = 32;
    float* sA = reinterpret_cast<float*>(tpar_dyn_smem);  // [64][33] k / v chunk
    float* sB = sA + kBlock * kLd;                         // [32][33] q / dout chunk
    float* sPT = sB + kBlock * kLd;                        // [64 keys][33] P^T
    float* sDS = sPT + kBlock * kLd;                       // [64 keys][33] dS^T
    float* sL = sDS + kBlock * kLd;                        // [32] lse (exp2 domain)
    float* sD = sL + BQ;                                   // [32] delta
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int k0 = kb * kBlock, kvh = blockIdx.y, b = blockIdx.z;
    const int group = a.q_heads / a.kv_heads;
    const i64 qld = st.q.row, kld = st.k.row, vld = st.v.row, gld = st.out.row;
    const T* K = static_cast<const T*>(a.k) + st.k.at(b, kvh, k0);
    const T* V = static_cast<const T*>(a.v) + st.v.at(b, kvh, k0);
    const int nk = min(kBlock, a.kv_len - k0);
    const float sl2 = a.scale * kLog2e;
    const float inf = tpar_inf();

    float dk[4][2 * NC], dv[4][2 * NC];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int c = 0; c < 2 * NC; ++c) {
            dk[i][c] = 0.0f;
            dv[i][c] = 0.0f;
        }

    for (int gi = 0; gi < group; ++gi) {
        const int h = kvh * group + gi;
        const i64 bh = (i64)b * a.q_heads + h;
        const T* Qh = static_cast<const T*>(a.q) + st.q.at(b, h, 0);
        const T* Gh = static_cast<const T*>(a.dout) + st.out.at(b, h, 0);
        const float* Lh = a.lse + bh * a.q_len;
        const float* Dh = a.delta + bh * a.q_len;
        float* dQh = a.dq_acc + bh * a.q_len * a.head_dim;
        const T* M =
            a.mask ? static_cast<const T*>(a.mask) + b * a.mask_bs + h * a.mask_hs : nullptr;
        for (int i0 = a.causal ? k0 : 0; i0 < a.q_len; i0 += BQ) {
            const int nq = min(BQ, a.q_len - i0);
            const T* Q = Qh + i0 * qld;
            const T* G = Gh + i0 * gld;
            __syncthreads();  // the previous tile's readers are done
            if (threadIdx.x < BQ) {
                const int r = threadIdx.x;
                const float lv = r < nq ? Lh[i0 + r] : -inf;
                // A fully masked row (lse = -inf) gets P = 0 from exp2(x - inf).
                sL[r] = lv == -inf ? inf : lv * kLog2e;
                sD[r] = r < nq ? Dh[i0 + r] : 0.0f;
            }
            float st[4][2], dp[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    st[i][j] = 0.0f;
                    dp[i][j] = 0.0f;
                }
            // S^T = K Q^T
            for (int c0 = 0; c0 < a.head_dim; c0 += 32) {
                __syncthreads();
                simt_chunk<T, kBlock, NT>(sA, K, kld, nk, c0, a.head_dim);
                simt_chunk<T, BQ, NT>(sB, Q, qld, nq, c0, a.head_dim);
                __syncthreads();
#pragma unroll 8
                for (int d = 0; d < 32; ++d) {
                    const float q0v = sB[tx * kLd + d], q1v = sB[(tx + 16) * kLd + d];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float kv = sA[(ty + 16 * i) * kLd + d];
                        st[i][0] += kv * q0v;
                        st[i][1] += kv * q1v;
                    }
                }
            }
            // dP^T = V dout^T
            for (int c0 = 0; c0 < a.v_dim; c0 += 32) {
                __syncthreads();
                simt_chunk<T, kBlock, NT>(sA, V, vld, nk, c0, a.v_dim);
                simt_chunk<T, BQ, NT>(sB, G, gld, nq, c0, a.v_dim);
                __syncthreads();
#pragma unroll 8
                for (int d = 0; d < 32; ++d) {
                    const float g0 = sB[tx * kLd + d], g1 = sB[(tx + 16) * kLd + d];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float vv = sA[(ty + 16 * i) * kLd + d];
                        dp[i][0] += vv * g0;
                        dp[i][1] += vv * g1;
                    }
                }
            }
            __syncthreads();  // sL / sD visible
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int kl = ty + 16 * i, j = k0 + kl;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int qi = tx + 16 * e, r = i0 + qi;
                    float p = 0.0f;
                    if (j < a.kv_len && qi < nq && !(a.causal && j > r)) {
                        float x = st[i][e] * sl2;
                        if (M != nullptr) x += to_f32(M[(i64)r * a.mask_rs + j]) * kLog2e;
                        p = exp2f(x - sL[qi]);
                    }
                    sPT[kl * kLd + qi] = p;
                    sDS[kl * kLd + qi] = p * (dp[i][e] - sD[qi]);
                }
            }
            // dV += P^T dout
#pragma unroll
            for (int vc = 0; vc < NC; ++vc) {
                if (vc * 32 < a.v_dim) {
                    __syncthreads();
                    simt_chunk<T, BQ, NT>(sB, G, gld, nq, vc * 32, a.v_dim);
                    __syncthreads();
#pragma unroll 4
                    for (int qi = 0; qi < BQ; ++qi) {
                        const float g0 = sB[qi * kLd + tx], g1 = sB[qi * kLd + tx + 16];
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float p = sPT[(ty + 16 * i) * kLd + qi];
                            dv[i][2 * vc] += p * g0;
                            dv[i][2 * vc + 1] += p * g1;
                        }
                    }
                }
            }
            // dK += dS^T q (the scale is applied at the end)
#pragma unroll
            for (int dc = 0; dc < NC; ++dc) {
                if (dc * 32 < a.head_dim) {
                    __syncthreads();
                    simt_chunk<T, BQ, NT>(sB, Q, qld, nq, dc * 32, a.head_dim);
                    __syncthreads();
#pragma unroll 4
                    for (int qi = 0; qi < BQ; ++qi) {
                        const float q0v = sB[qi * kLd + tx], q1v = sB[qi * kLd + tx + 16];
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float ds = sDS[(ty + 16 * i) * kLd + qi];
                            dk[i][2 * dc] += ds * q0v;
                            dk[i][2 * dc + 1] += ds * q1v;
                        }
                    }
                }
            }
            // dQ += dS K: thread owns queries ty + 16i (i < 2), columns tx + 16e.
            for (int c0 = 0; c0 < a.head_dim; c0 += 32) {
                __syncthreads();
                simt_chunk<T, kBlock, NT>(sA, K, kld, nk, c0, a.head_dim);
                __syncthreads();
                float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll 4
                for (int kl = 0; kl < kBlock; ++kl) {
                    const float k0v = sA[kl * kLd + tx], k1v = sA[kl * kLd + tx + 16];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const float ds = sDS[kl * kLd + ty + 16 * i];
                        acc[i][0] += ds * k0v;
                        acc[i][1] += ds * k1v;
                    }
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int qi = ty + 16 * i;
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = c0 + tx + 16 * e;
                        if (qi < nq && c < a.head_dim)
                            atomicAdd(&dQh[(i64)(i0 + qi) * a.head_dim + c], acc[i][e]);
                    }
                }
            }
        }
    }

    T* dK = static_cast<T*>(a.dk) + st.k.at(b, kvh, k0);
    T* dV = static_cast<T*>(a.dv) + st.v.at(b, kvh, k0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int kl = ty + 16 * i;
        if (kl < nk) {
#pragma unroll
            for (int cc = 0; cc < NC; ++cc)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = cc * 32 + tx + 16 * e;
                    if (c < a.head_dim) dK[kl * kld + c] = from_f32<T>(dk[i][2 * cc + e] * a.scale);
                    if (c < a.v_dim) dV[kl * vld + c] = from_f32<T>(dv[i][2 * cc + e]);
                }
        }
    }
}

// ------------------------------------------------------------------ tensor cores

// Element offset of 16-byte chunk `c` of row `r` in a [rows][HD] tile of
// 16-bit elements whose chunks are XOR-swizzled by the row (HD >= 64), so
// that ldmatrix reads of eight rows at one chunk column hit distinct banks.
template <int HD>
TPAR_DEVICE int swz(int r, int c) {
    return r * HD + ((c ^ (r & 7)) << 3);
}

// A thread's share of copying [ROWS][HD] tiles with NT threads: 16-byte
// chunk `col8 / 8` of rows row, row + RS, row + 2 RS, ... (RS = NT / (HD /
// 8), a multiple of 8, so every pass keeps the first row's swizzle); `soff`
// is the element offset of the first chunk in the swizzled tile. Computed
// once per kernel; each pass adds constants.
template <int HD, int NT>
struct TileCopy {
    static constexpr int CH = HD / 8, RS = NT / CH;
    static_assert(HD >= 64 && RS % 8 == 0, "swizzle width; passes keep the swizzle");
    int row, col8, soff;
    TPAR_DEVICE TileCopy()
        : row(threadIdx.x / CH),
          col8(threadIdx.x % CH * 8),
          soff(swz<HD>(threadIdx.x / CH, threadIdx.x % CH)) {}
};

// Asynchronous copy of rows 0..ROWS-1 of a row-major matrix (`ld` elements
// per row, ROWS * ld within i32) into a swizzled [ROWS][HD] tile; zero
// outside `nrows` x `ncols` (`ncols` a multiple of 8, rows 16-byte aligned).
template <typename T, int ROWS, int HD, int NT>
TPAR_DEVICE void tc_load(T* s, const T* g, int ld, int nrows, int ncols,
                         const TileCopy<HD, NT>& tc) {
    constexpr int RS = TileCopy<HD, NT>::RS;
    static_assert(ROWS % RS == 0, "whole passes of the block");
    const bool col_ok = tc.col8 < ncols;
    const T* p = g + (tc.row * ld + tc.col8);
    const int step = RS * ld;
#pragma unroll
    for (int it = 0; it < ROWS / RS; ++it) {
        const bool ok = col_ok && tc.row + it * RS < nrows;
        cp_async_16(s + tc.soff + it * RS * HD, ok ? p + it * step : g, ok);
    }
}

// Stores rows 0..nrows-1, columns 0..ncols-1 of a swizzled [ROWS][HD] tile
// to a row-major matrix with `ld` elements per row, 16 bytes at a time.
template <typename T, int ROWS, int HD, int NT>
TPAR_DEVICE void tc_store(T* g, const T* s, int ld, int nrows, int ncols,
                          const TileCopy<HD, NT>& tc) {
    constexpr int RS = TileCopy<HD, NT>::RS;
    static_assert(ROWS % RS == 0, "whole passes of the block");
    if (tc.col8 >= ncols) return;
    T* p = g + (tc.row * ld + tc.col8);
#pragma unroll
    for (int it = 0; it < ROWS / RS; ++it)
        if (tc.row + it * RS < nrows)
            *reinterpret_cast<Raw16*>(p + it * RS * ld) =
                *reinterpret_cast<const Raw16*>(s + tc.soff + it * RS * HD);
}

// Writes an mma accumulator tile (16 rows from `row`, HD columns) as T into a
// swizzled [*][HD] tile, multiplied by mul[0] (rows g) / mul[1] (rows g+8).
template <typename T, int HD>
TPAR_DEVICE void tc_stage(T* s, float (*acc)[4], int row, const float mul[2]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
        *reinterpret_cast<u32*>(s + swz<HD>(row + g, nt) + 2 * t) =
            pack2_rn<T>(acc[nt][0] * mul[0], acc[nt][1] * mul[0]);
        *reinterpret_cast<u32*>(s + swz<HD>(row + g + 8, nt) + 2 * t) =
            pack2_rn<T>(acc[nt][2] * mul[1], acc[nt][3] * mul[1]);
    }
}

// A lane's element offsets for ldmatrix_x4 reads of 16 rows x 16 columns
// (chunk pair kk, i.e. chunks 2kk and 2kk + 1) from a swizzled [*][HD] tile,
// computed once: the read of rows from `row` (a multiple of 8) is at
// row * HD + off[kk & 3] + (kk >> 2) * 64. Since row & 7 = lane & 7 and the
// chunk is 2kk ^ bit, the swizzled chunk is 8 (kk >> 2) + ((2 (kk & 3)) ^
// bit ^ (lane & 7)): four values per lane, the rest constants.
// - `a`: the A operand of a row-major tile, or ldmatrix_x4_trans's two B
//   operands of a [k][n] tile (lane rows (lane & 7) + ((lane >> 3) & 1) * 8,
//   chunk bit lane >> 4);
// - `b`: two B operands of a [n][k] tile (lane rows (lane & 7) + (lane >> 4)
//   * 8, chunk bit (lane >> 3) & 1); registers {0,1} and {2,3} are the
//   fragments of n rows 0-7 and 8-15.
template <int HD>
struct LdsmOffsets {
    int a[4], b[4];
    TPAR_DEVICE LdsmOffsets() {
        const int lane = threadIdx.x & 31, x = lane & 7;
        const int ra = x + ((lane >> 3) & 1) * 8, ya = (lane >> 4) ^ x;
        const int rb = x + (lane >> 4) * 8, yb = ((lane >> 3) & 1) ^ x;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            a[k] = ra * HD + (((2 * k) ^ ya) << 3);
            b[k] = rb * HD + (((2 * k) ^ yb) << 3);
        }
    }
    // Offset of chunk pair kk of rows from `row` (a multiple of 8).
    TPAR_DEVICE int at_a(int row, int kk) const { return row * HD + a[kk & 3] + (kk >> 2) * 64; }
    TPAR_DEVICE int at_b(int row, int kk) const { return row * HD + b[kk & 3] + (kk >> 2) * 64; }
};

// Forward with tensor cores: 4 warps, each owning MT m-tiles (16*MT query
// rows) of the block's BQ = 64*MT, so every v fragment read from shared
// memory feeds MT mma (the scores are computed one m-tile at a time, so
// that only one tile's are live). The q fragments stay in registers only at MT*HD =
// 64 (the q tile's space then takes the v tiles); elsewhere they are read
// from the q tile at each step, which keeps the registers under the launch
// bounds without spills. The v tile loads while the scores are
// computed, the next k tile while P v is. Address arithmetic is done once
// (TileCopy, LdsmOffsets; the k and v pointers advance by a tile); element
// masks are looked at only in tiles that reach past kv_len or the warp's
// causal diagonal, or with an additive mask, as one compare per element
// against a per-row limit.
template <typename T, int HD, int MT>
TPAR_DEVICE void fwd_tc(const SdpaFwdArgs& a) {
    constexpr int NT = 128, BQ = 64 * MT, KT = HD / 16;
    constexpr bool QREG = MT * HD <= 64;
    T* sQ = reinterpret_cast<T*>(tpar_dyn_smem);  // [BQ][HD]
    T* sK = sQ + BQ * HD;                          // [64][HD]
    T* sV = QREG ? sQ : sK + kBlock * HD;          // [64][HD]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // heavy causal blocks first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (a.q_heads / a.kv_heads);
    const i64 bh = (i64)b * a.q_heads + h;
    // Row strides (below 2^24: tile offsets stay in i32).
    const int qld = (int)a.st.q.row, kld = (int)a.st.k.row, vld = (int)a.st.v.row;
    const T* Q = static_cast<const T*>(a.q) + a.st.q.at(b, h, q0);
    const T* K = static_cast<const T*>(a.k) + a.st.k.at(b, kvh, 0);
    const T* V = static_cast<const T*>(a.v) + a.st.v.at(b, kvh, 0);
    const T* M = a.mask ? static_cast<const T*>(a.mask) + b * a.mask_bs + h * a.mask_hs : nullptr;
    const int nq = min(BQ, a.q_len - q0);
    const int kv_end = a.causal ? min(a.kv_len, q0 + BQ) : a.kv_len;
    const float sl2 = a.scale * kLog2e;
    const float ninf = -tpar_inf();
    const int wrow = warp * 16 * MT;  // the warp's first row in the block
    // This lane's rows of m-tile mt: q0 + wrow + 16*mt + g (+ 8).
    const int row_lo = q0 + wrow + g;
    const TileCopy<HD, NT> tcp;
    const LdsmOffsets<HD> lo;
    const int k_step = kBlock * kld, v_step = kBlock * vld;

    tc_load<T, BQ, HD, NT>(sQ, Q, qld, nq, a.head_dim, tcp);
    if (kv_end > 0) tc_load<T, kBlock, HD, NT>(sK, K, kld, min(kBlock, a.kv_len), a.head_dim, tcp);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[QREG ? MT * KT : 1][4];
    if (QREG) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < KT; ++kk)
                ldmatrix_x4(qf[QREG ? mt * KT + kk : 0], sQ + lo.at_a(wrow + 16 * mt, kk));
        __syncthreads();  // the q tile's space takes the v tiles
    }
    const T* sQw = sQ + wrow * HD;

    float o[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.0f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = ninf;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    for (int j0 = 0; j0 < kv_end; j0 += kBlock) {
        tc_load<T, kBlock, HD, NT>(sV, V, vld, min(kBlock, a.kv_len - j0), a.v_dim, tcp);
        cp_async_commit();
        V += v_step;

        // Per m-tile (so that one tile's scores are live at a time): S = q
        // k^T as 8 accumulator tiles of 16 x 8, masks, online softmax, and
        // P packed as the A fragments of P v.
        u32 pa[MT][4][4];
        const bool check =
            j0 + kBlock > a.kv_len || (a.causal && j0 + kBlock - 1 > q0 + wrow) || M != nullptr;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float s[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) {
                u32 qa[4];
                if (QREG) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) qa[i] = qf[QREG ? mt * KT + kk : 0][i];
                } else {
                    ldmatrix_x4(qa, sQw + lo.at_a(16 * mt, kk));
                }
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    u32 r[4];
                    ldmatrix_x4(r, sK + lo.at_b(np * 16, kk));
                    const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                    mma_16816<T>(s[2 * np], qa, b0);
                    mma_16816<T>(s[2 * np + 1], qa, b1);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] *= sl2;
            // Masks: key j0 + 2t + idx (idx = nt*8 + (e & 1)) is visible to
            // a row when idx < lim, the row's limit (kv_len, and the diagonal).
            if (check) {
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int r = row_lo + 16 * mt + 8 * hr;
                    const int lim = (a.causal ? min(a.kv_len, r + 1) : a.kv_len) - j0 - 2 * t;
                    if (M != nullptr) {
                        // Rows past q_len (never stored) read the last row's mask.
                        const T* mr = M + (i64)min(r, a.q_len - 1) * a.mask_rs + (j0 + 2 * t);
#pragma unroll
                        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                            for (int i = 0; i < 2; ++i) {
                                float& x = s[nt][2 * hr + i];
                                if (nt * 8 + i >= lim) {
                                    x = ninf;
                                } else {
                                    x += to_f32(mr[nt * 8 + i]) * kLog2e;
                                }
                            }
                    } else {
#pragma unroll
                        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                            for (int i = 0; i < 2; ++i)
                                if (nt * 8 + i >= lim) s[nt][2 * hr + i] = ninf;
                    }
                }
            }
            float mx[2] = {ninf, ninf};
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
            // Online softmax; `base` keeps exp2 finite for rows masked so far.
            float base[2];
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(TPAR_FULL_MASK, mx[hr], 1));
                mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(TPAR_FULL_MASK, mx[hr], 2));
                const float mnew = fmaxf(m[mt][hr], mx[hr]);
                base[hr] = mnew == ninf ? 0.0f : mnew;
                const float alpha = exp2_ftz(m[mt][hr] - base[hr]);
                m[mt][hr] = mnew;
                l[mt][hr] *= alpha;
#pragma unroll
                for (int nt = 0; nt < HD / 8; ++nt) {
                    o[mt][nt][2 * hr] *= alpha;
                    o[mt][nt][2 * hr + 1] *= alpha;
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = exp2_ftz(s[nt][e] - base[e >> 1]);
                    l[mt][e >> 1] += p;
                    s[nt][e] = p;
                }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                pa[mt][kk][0] = pack2_rn<T>(s[2 * kk][0], s[2 * kk][1]);
                pa[mt][kk][1] = pack2_rn<T>(s[2 * kk][2], s[2 * kk][3]);
                pa[mt][kk][2] = pack2_rn<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[mt][kk][3] = pack2_rn<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
        }

        cp_async_wait<0>();
        __syncthreads();  // v tile in; every warp is done with the k tile
        if (j0 + kBlock < kv_end) {
            K += k_step;
            tc_load<T, kBlock, HD, NT>(sK, K, kld, min(kBlock, a.kv_len - j0 - kBlock), a.head_dim,
                                       tcp);
        }
        cp_async_commit();

        // o += P v.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int np = 0; np < HD / 16; ++np) {
                u32 r[4];
                ldmatrix_x4_trans(r, sV + lo.at_a(kk * 16, np));
                const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(o[mt][2 * np], pa[mt][kk], b0);
                    mma_16816<T>(o[mt][2 * np + 1], pa[mt][kk], b1);
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // next k tile in; every warp is done with the v tile
    }

    __syncthreads();  // (no key tile: the q tile may still be read)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float lt = l[mt][hr];
            lt += __shfl_xor_sync(TPAR_FULL_MASK, lt, 1);
            lt += __shfl_xor_sync(TPAR_FULL_MASK, lt, 2);
            inv[hr] = lt > 0.0f ? 1.0f / lt : 0.0f;
            const int r = row_lo + 16 * mt + hr * 8;
            if (t == 0 && r < a.q_len)
                a.lse[bh * a.q_len + r] = lt > 0.0f ? m[mt][hr] * kLn2 + logf(lt) : ninf;
        }
        tc_stage<T, HD>(sQ, o[mt], wrow + 16 * mt, inv);
    }
    __syncthreads();
    // The block's indices read again: kept live over the loop, they cost the
    // 128-row variant spills at head dim 128.
    const i64 out_at = a.st.out.at(blockIdx.z, blockIdx.y, (gridDim.x - 1 - blockIdx.x) * BQ);
    tc_store<T, BQ, HD, NT>(static_cast<T*>(a.out) + out_at, sQ, (int)a.st.out.row, nq, a.v_dim,
                            tcp);
}

// Backward dK/dV (and dQ by atomics) with tensor cores: 4 warps, each
// owning 16 keys of the block's 64, over the 64-query tiles of every q head
// of the group. Shared memory: k and v tiles, two buffers of q and dout tiles
// (the next tile loads while this one is computed), dS^T [64 keys][64
// queries], lse and delta. As in the forward, addresses are computed once
// and element masks are looked at only in tiles that need them (a partial
// key or query tile, the warp's causal diagonal, an additive mask).
template <typename T, int HD>
TPAR_DEVICE void bwd_tc_block(const SdpaBwdArgs& a, const SdpaArgStrides& st, int kb) {
    constexpr int NT = 128;
    constexpr int TILE = kBlock * HD;
    T* sK = reinterpret_cast<T*>(tpar_dyn_smem);
    T* sV = sK + TILE;
    T* sQb = sV + TILE;       // [2][64][HD]
    T* sGb = sQb + 2 * TILE;  // [2][64][HD]
    T* sS = sGb + 2 * TILE;
    float* sL = reinterpret_cast<float*>(sS + kBlock * kBlock);
    float* sD = sL + kBlock;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int k0 = kb * kBlock, kvh = blockIdx.y, b = blockIdx.z;
    const int group = a.q_heads / a.kv_heads;
    const int nk = min(kBlock, a.kv_len - k0);
    const float sl2 = a.scale * kLog2e;
    const float inf = tpar_inf();
    const int kl0 = warp * 16 + g;  // this lane's keys: kl0, kl0 + 8 (local)
    // Query tiles: `per_head` per q head of the group, from `i_start`
    // (causal: queries before the block's first key see none of its keys).
    const int i_start = a.causal ? k0 : 0;
    const int per_head = a.q_len > i_start ? (a.q_len - i_start + kBlock - 1) / kBlock : 0;
    const int ntiles = group * per_head;
    // Row strides (below 2^24: tile offsets stay in i32).
    const int qld = (int)st.q.row, kld = (int)st.k.row, vld = (int)st.v.row, gld = (int)st.out.row;
    const T* Qb = static_cast<const T*>(a.q) + st.q.at(b, 0, 0);
    const T* Gb = static_cast<const T*>(a.dout) + st.out.at(b, 0, 0);
    const TileCopy<HD, NT> tcp;
    const LdsmOffsets<HD> lo;
    const T* sKw = sK + warp * 16 * HD;
    const T* sVw = sV + warp * 16 * HD;
    // dS^T: this lane's stores (rows kl0, kl0 + 8; chunk nt at (nt ^ g) * 8)
    // and its ldmatrix_x4_trans reads (queries warp*16.., keys 16 kk..).
    const int ds_st = kl0 * kBlock + 2 * t;
    const int ds_ld = swz<kBlock>((lane >> 4) * 8 + (lane & 7), warp * 2 + ((lane >> 3) & 1));
    // This lane's dQ elements: query rows warp*16 + g (+ 8), columns 2t (+1).
    const int dq_off = (warp * 16 + g) * a.head_dim + 2 * t, dq_row8 = 8 * a.head_dim;

    const i64 koff = st.k.at(b, kvh, k0), voff = st.v.at(b, kvh, k0);
    tc_load<T, kBlock, HD, NT>(sK, static_cast<const T*>(a.k) + koff, kld, nk, a.head_dim, tcp);
    tc_load<T, kBlock, HD, NT>(sV, static_cast<const T*>(a.v) + voff, vld, nk, a.v_dim, tcp);
    if (ntiles > 0) {
        const int h0 = kvh * group, nq = min(kBlock, a.q_len - i_start);
        tc_load<T, kBlock, HD, NT>(sQb, Qb + st.q.at(0, h0, i_start), qld, nq, a.head_dim, tcp);
        tc_load<T, kBlock, HD, NT>(sGb, Gb + st.out.at(0, h0, i_start), gld, nq, a.v_dim, tcp);
    }
    cp_async_commit();

    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dk[nt][e] = 0.0f;
            dv[nt][e] = 0.0f;
        }

    int h = kvh * group, i0 = i_start;  // this tile's q head and first query
    // This lane's first dQ element of the tile (carried from tile to tile).
    float* dQ = a.dq_acc + (((i64)b * a.q_heads + h) * a.q_len + i0) * a.head_dim + dq_off;
    for (int it = 0; it < ntiles; ++it) {
        // The next tile: the next 64 queries, or the next head's first.
        int h_next = h, i_next = i0 + kBlock;
        if (i_next >= a.q_len) {
            i_next = i_start;
            ++h_next;
        }
        const int nq = min(kBlock, a.q_len - i0);
        const i64 bh = (i64)b * a.q_heads + h;
        const T* sQ = sQb + (it & 1) * TILE;
        const T* sG = sGb + (it & 1) * TILE;
        // Every warp passed the previous tile's dS^T barrier: lse and delta
        // are free to overwrite.
        if (threadIdx.x < kBlock) {
            const int r = threadIdx.x;
            const float lv = r < nq ? a.lse[bh * a.q_len + i0 + r] : -inf;
            // A fully masked row (lse = -inf) gets P = 0 from exp2(x - inf).
            sL[r] = lv == -inf ? inf : lv * kLog2e;
            sD[r] = r < nq ? a.delta[bh * a.q_len + i0 + r] : 0.0f;
        }
        cp_async_wait<0>();
        __syncthreads();  // this tile's q and dout are in; the previous tile is done
        if (it + 1 < ntiles) {
            const int nq2 = min(kBlock, a.q_len - i_next);
            T* dstQ = sQb + ((it + 1) & 1) * TILE;
            T* dstG = sGb + ((it + 1) & 1) * TILE;
            tc_load<T, kBlock, HD, NT>(dstQ, Qb + st.q.at(0, h_next, i_next), qld, nq2, a.head_dim,
                                       tcp);
            tc_load<T, kBlock, HD, NT>(dstG, Gb + st.out.at(0, h_next, i_next), gld, nq2, a.v_dim,
                                       tcp);
        }
        cp_async_commit();

        // S^T = K Q^T and dP^T = V dout^T (16 keys x 64 queries per warp).
        float st[8][4], dp[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                st[nt][e] = 0.0f;
                dp[nt][e] = 0.0f;
            }
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 ka[4], va[4];
            ldmatrix_x4(ka, sKw + lo.at_a(0, kk));
            ldmatrix_x4(va, sVw + lo.at_a(0, kk));
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 r[4];
                ldmatrix_x4(r, sQ + lo.at_b(np * 16, kk));
                const u32 q0f[2] = {r[0], r[1]}, q1f[2] = {r[2], r[3]};
                mma_16816<T>(st[2 * np], ka, q0f);
                mma_16816<T>(st[2 * np + 1], ka, q1f);
                ldmatrix_x4(r, sG + lo.at_b(np * 16, kk));
                const u32 g0f[2] = {r[0], r[1]}, g1f[2] = {r[2], r[3]};
                mma_16816<T>(dp[2 * np], va, g0f);
                mma_16816<T>(dp[2 * np + 1], va, g1f);
            }
        }

        // P^T = exp2(S^T * scale * log2e (+ mask) - lse), dS^T = P^T (dP^T - delta).
        // Query i0 + 2t + idx (idx = nt*8 + (e & 1)) and key j of a lane
        // row: visible when lo <= idx < hi (hi: nq, none past kv_len; lo:
        // the causal diagonal).
        if (k0 + kBlock <= a.kv_len && nq == kBlock &&
            !(a.causal && k0 + warp * 16 + 15 > i0) && a.mask == nullptr) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qi = nt * 8 + 2 * t + (e & 1);
                    const float p = exp2_ftz(st[nt][e] * sl2 - sL[qi]);
                    st[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - sD[qi]);
                }
        } else {
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int j = k0 + kl0 + 8 * hr;
                const int hi = j < a.kv_len ? nq - 2 * t : 0;
                const int lo_ = a.causal ? j - i0 - 2 * t : -kBlock;
                const T* mp = a.mask ? static_cast<const T*>(a.mask) + b * a.mask_bs +
                                           h * a.mask_hs + (i64)(i0 + 2 * t) * a.mask_rs + j
                                     : nullptr;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const int e = 2 * hr + i, idx = nt * 8 + i, qi = idx + 2 * t;
                        float p = 0.0f;
                        if (idx < hi && idx >= lo_) {
                            float x = st[nt][e] * sl2;
                            if (mp != nullptr) x += to_f32(mp[i * a.mask_rs]) * kLog2e;
                            p = exp2_ftz(x - sL[qi]);
                        }
                        st[nt][e] = p;
                        dp[nt][e] = p * (dp[nt][e] - sD[qi]);
                    }
                    if (mp != nullptr) mp += 8 * a.mask_rs;
                }
            }
        }

        // dV += P^T dout, dK += dS^T q (P^T, dS^T as A fragments).
#pragma unroll
        for (int kq = 0; kq < 4; ++kq) {
            const u32 pa[4] = {pack2_rn<T>(st[2 * kq][0], st[2 * kq][1]),
                               pack2_rn<T>(st[2 * kq][2], st[2 * kq][3]),
                               pack2_rn<T>(st[2 * kq + 1][0], st[2 * kq + 1][1]),
                               pack2_rn<T>(st[2 * kq + 1][2], st[2 * kq + 1][3])};
            const u32 sa[4] = {pack2_rn<T>(dp[2 * kq][0], dp[2 * kq][1]),
                               pack2_rn<T>(dp[2 * kq][2], dp[2 * kq][3]),
                               pack2_rn<T>(dp[2 * kq + 1][0], dp[2 * kq + 1][1]),
                               pack2_rn<T>(dp[2 * kq + 1][2], dp[2 * kq + 1][3])};
#pragma unroll
            for (int np = 0; np < HD / 16; ++np) {
                u32 r[4];
                ldmatrix_x4_trans(r, sG + lo.at_a(kq * 16, np));
                const u32 g0f[2] = {r[0], r[1]}, g1f[2] = {r[2], r[3]};
                mma_16816<T>(dv[2 * np], pa, g0f);
                mma_16816<T>(dv[2 * np + 1], pa, g1f);
                ldmatrix_x4_trans(r, sQ + lo.at_a(kq * 16, np));
                const u32 q0f[2] = {r[0], r[1]}, q1f[2] = {r[2], r[3]};
                mma_16816<T>(dk[2 * np], sa, q0f);
                mma_16816<T>(dk[2 * np + 1], sa, q1f);
            }
        }

        // dS^T to shared memory for dQ = dS K.
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int c = (nt ^ g) << 3;
            *reinterpret_cast<u32*>(sS + ds_st + c) = pack2_rn<T>(dp[nt][0], dp[nt][1]);
            *reinterpret_cast<u32*>(sS + ds_st + 8 * kBlock + c) =
                pack2_rn<T>(dp[nt][2], dp[nt][3]);
        }
        __syncthreads();  // dS^T complete; every warp is done with this q / dout buffer

        // dQ (queries warp*16.., all columns) = dS K, 32 columns at a time,
        // added to the f32 accumulator.
        u32 af[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldmatrix_x4_trans(af[kk], sS + ds_ld + kk * 16 * kBlock);
        const bool row_ok[2] = {warp * 16 + g < nq, warp * 16 + g + 8 < nq};
        // The lane's two dQ rows as pointers: the columns below are constants.
        float* const dq_rows[2] = {dQ, dQ + dq_row8};
#pragma unroll
        for (int nc = 0; nc < HD / 32; ++nc) {
            if (nc * 32 < a.head_dim) {
                float dq[4][4];
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                    for (int np2 = 0; np2 < 2; ++np2) {
                        u32 r[4];
                        ldmatrix_x4_trans(r, sK + lo.at_a(kk * 16, nc * 2 + np2));
                        const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                        mma_16816<T>(dq[2 * np2], af[kk], b0);
                        mma_16816<T>(dq[2 * np2 + 1], af[kk], b1);
                    }
                }
                // Column nc*32 + n*8 + 2t + (e & 1) < head_dim (a multiple of
                // 8) when nc*32 + n*8 < head_dim.
#pragma unroll
                for (int n = 0; n < 4; ++n)
                    if (nc * 32 + n * 8 < a.head_dim)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (row_ok[e >> 1])
                                atomicAdd(dq_rows[e >> 1] + (nc * 32 + n * 8 + (e & 1)), dq[n][e]);
            }
        }
        dQ = h_next == h ? dQ + kBlock * a.head_dim
                         : a.dq_acc +
                               (((i64)b * a.q_heads + h_next) * a.q_len + i_next) * a.head_dim +
                               dq_off;
        h = h_next;
        i0 = i_next;
    }

    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the last tile (or, with none, the copies are in)
    const float mk[2] = {a.scale, a.scale}, mv[2] = {1.0f, 1.0f};
    tc_stage<T, HD>(sQb, dk, warp * 16, mk);
    tc_stage<T, HD>(sGb, dv, warp * 16, mv);
    __syncthreads();
    tc_store<T, kBlock, HD, NT>(static_cast<T*>(a.dk) + koff, sQb, kld, nk, a.head_dim, tcp);
    tc_store<T, kBlock, HD, NT>(static_cast<T*>(a.dv) + voff, sGb, vld, nk, a.v_dim, tcp);
}

// The backward kernels' blocks each take key blocks blockIdx.x, blockIdx.x +
// gridDim.x, ...: one each with a grid of every key block (the default), or,
// with a grid of one along x (deterministic mode), every key block of its
// (kv head, batch) in order, so the dQ atomics of the heads it owns run in
// key-block order whatever order the blocks run in: the same sum, every run.
template <typename Block>
TPAR_DEVICE void over_key_blocks(const SdpaBwdArgs& a, Block&& block) {
    const int nkb = (a.kv_len + kBlock - 1) / kBlock;
    for (int kb = blockIdx.x; kb < nkb; kb += gridDim.x) {
        // the previous key block's last reads of shared memory are done
        if (kb != (int)blockIdx.x) __syncthreads();
        block(kb);
    }
}

template <typename T, int NC>
TPAR_DEVICE void bwd_simt(const SdpaBwdArgs& a, const SdpaArgStrides& st) {
    over_key_blocks(a, [&](int kb) { bwd_simt_block<T, NC>(a, st, kb); });
}

template <typename T, int HD>
TPAR_DEVICE void bwd_tc(const SdpaBwdArgs& a, const SdpaArgStrides& st) {
    over_key_blocks(a, [&](int kb) { bwd_tc_block<T, HD>(a, st, kb); });
}

// ------------------------------------------------------------------ backward helpers

// The offset under `s` of the first element of query row r (of the
// batch * q_heads * q_len rows, batch-major).
TPAR_DEVICE i64 query_row(const SdpaOpStrides& s, const SdpaBwdArgs& a, i64 r) {
    const i64 bh = r / a.q_len;
    return s.at(bh / a.q_heads, bh % a.q_heads, r % a.q_len);
}

// delta[r] = sum_c dout[r, c] * out[r, c] (one warp per row, grid-strided;
// `os` the strides of out and dout), and the whole dq accumulator zeroed:
// ceil(q_len / 64) * 64 rows of
// head_dim floats per (batch, q head), the extent of the Hopper backward's
// tile layout (sdpa_hopper_bwd.cu), whose last tile spreads its valid rows
// over its whole block; the row-major kernels here use the first
// batch * q_heads * q_len rows. The extent is a multiple of 64 floats and
// dq_acc is 256-byte aligned: 16-byte stores, grid-strided.
template <typename T>
TPAR_DEVICE void bwd_pre(const SdpaBwdArgs& a, const SdpaOpStrides& os) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const i64 rows = (i64)a.batch * a.q_heads * a.q_len;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows;
         r += (i64)gridDim.x * warps) {
        const i64 at = query_row(os, a, r);
        const T* o = static_cast<const T*>(a.out) + at;
        const T* gr = static_cast<const T*>(a.dout) + at;
        float s = 0.0f;
        for (int c = lane; c < a.v_dim; c += 32) s += to_f32(o[c]) * to_f32(gr[c]);
        s = warp_sum(s);
        if (lane == 0) a.delta[r] = s;
    }
    constexpr int kTile = 64;  // sdpa_hopper_bwd.cu's query tile (BR)
    const i64 units = (i64)a.batch * a.q_heads * ((a.q_len + kTile - 1) / kTile) * kTile *
                      a.head_dim / 4;
    Raw16* acc = reinterpret_cast<Raw16*>(a.dq_acc);
    for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < units;
         u += (i64)gridDim.x * blockDim.x)
        acc[u] = Raw16{{0u, 0u, 0u, 0u}};
}

// dq = scale * dq_acc, rounded to T, written through q's strides `qs` (the
// accumulator is row-major); one warp per query row, grid-strided.
template <typename T>
TPAR_DEVICE void bwd_dq(const SdpaBwdArgs& a, const SdpaOpStrides& qs) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const i64 rows = (i64)a.batch * a.q_heads * a.q_len;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows;
         r += (i64)gridDim.x * warps) {
        T* dq = static_cast<T*>(a.dq) + query_row(qs, a, r);
        const float* acc = a.dq_acc + r * a.head_dim;
        for (int c = lane; c < a.head_dim; c += 32) dq[c] = from_f32<T>(acc[c] * a.scale);
    }
}

}  // namespace sdpa

// The kernels are written out one by one, not generated by token-pasting
// macros: the host finds a kernel's source by the literal first argument of
// `TPAR_KERNEL(...)` (`kernel_names`), and the NVRTC test checks that every
// `.entry` of the PTX is such a name.

// SIMT kernels: NC = 32-column chunks of the larger head dim (1, 2, 4, 8).
TPAR_KERNEL(tpar_sdpa_fwd_simt1_f32, SdpaFwdArgs, 256) { sdpa::fwd_simt<float, 1>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt1_f32, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<float, 1>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt2_f32, SdpaFwdArgs, 256) { sdpa::fwd_simt<float, 2>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt2_f32, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<float, 2>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt4_f32, SdpaFwdArgs, 256) { sdpa::fwd_simt<float, 4>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt4_f32, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<float, 4>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt8_f32, SdpaFwdArgs, 256) { sdpa::fwd_simt<float, 8>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt8_f32, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<float, 8>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt1_bf16, SdpaFwdArgs, 256) { sdpa::fwd_simt<bf16, 1>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt1_bf16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<bf16, 1>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt2_bf16, SdpaFwdArgs, 256) { sdpa::fwd_simt<bf16, 2>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt2_bf16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<bf16, 2>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt4_bf16, SdpaFwdArgs, 256) { sdpa::fwd_simt<bf16, 4>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt4_bf16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<bf16, 4>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt8_bf16, SdpaFwdArgs, 256) { sdpa::fwd_simt<bf16, 8>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt8_bf16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<bf16, 8>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt1_f16, SdpaFwdArgs, 256) { sdpa::fwd_simt<f16, 1>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt1_f16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<f16, 1>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt2_f16, SdpaFwdArgs, 256) { sdpa::fwd_simt<f16, 2>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt2_f16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<f16, 2>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt4_f16, SdpaFwdArgs, 256) { sdpa::fwd_simt<f16, 4>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt4_f16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<f16, 4>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_simt8_f16, SdpaFwdArgs, 256) { sdpa::fwd_simt<f16, 8>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_simt8_f16, SdpaBwdStridedArgs, 256) { sdpa::bwd_simt<f16, 8>(args.a, args.st); }

// Tensor-core kernels: HD = padded head dim (64, 128); forward with 64
// (`tc<HD>`) or 128 (`tc<HD>m2`) query rows per block. The 64-row forward
// asks for three blocks of 128 threads per SM (at most 168 registers, which
// it fits without spills at both head dims); the emulator takes the thread
// count alone.
#ifndef TPAR_EMU
#define SDPA_TC_FWD_BOUNDS 128, 3
#else
#define SDPA_TC_FWD_BOUNDS 128
#endif
TPAR_KERNEL(tpar_sdpa_fwd_tc64_bf16, SdpaFwdArgs, SDPA_TC_FWD_BOUNDS) { sdpa::fwd_tc<bf16, 64, 1>(args); }
TPAR_KERNEL(tpar_sdpa_fwd_tc64m2_bf16, SdpaFwdArgs, 128) { sdpa::fwd_tc<bf16, 64, 2>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_tc64_bf16, SdpaBwdStridedArgs, 128) { sdpa::bwd_tc<bf16, 64>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_tc128_bf16, SdpaFwdArgs, SDPA_TC_FWD_BOUNDS) { sdpa::fwd_tc<bf16, 128, 1>(args); }
TPAR_KERNEL(tpar_sdpa_fwd_tc128m2_bf16, SdpaFwdArgs, 128) { sdpa::fwd_tc<bf16, 128, 2>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_tc128_bf16, SdpaBwdStridedArgs, 128) { sdpa::bwd_tc<bf16, 128>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_tc64_f16, SdpaFwdArgs, SDPA_TC_FWD_BOUNDS) { sdpa::fwd_tc<f16, 64, 1>(args); }
TPAR_KERNEL(tpar_sdpa_fwd_tc64m2_f16, SdpaFwdArgs, 128) { sdpa::fwd_tc<f16, 64, 2>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_tc64_f16, SdpaBwdStridedArgs, 128) { sdpa::bwd_tc<f16, 64>(args.a, args.st); }
TPAR_KERNEL(tpar_sdpa_fwd_tc128_f16, SdpaFwdArgs, SDPA_TC_FWD_BOUNDS) { sdpa::fwd_tc<f16, 128, 1>(args); }
TPAR_KERNEL(tpar_sdpa_fwd_tc128m2_f16, SdpaFwdArgs, 128) { sdpa::fwd_tc<f16, 128, 2>(args); }
TPAR_KERNEL(tpar_sdpa_bwd_tc128_f16, SdpaBwdStridedArgs, 128) { sdpa::bwd_tc<f16, 128>(args.a, args.st); }

// delta and the zeroed accumulator: `_strided` for the kernels of this file,
// the plain ones (dense out and dout) for sdpa_hopper_bwd's launcher, which
// passes SdpaBwdArgs alone.
TPAR_KERNEL(tpar_sdpa_bwd_pre_strided_f32, SdpaBwdStridedArgs, 256) { sdpa::bwd_pre<float>(args.a, args.st.out); }
TPAR_KERNEL(tpar_sdpa_bwd_pre_strided_bf16, SdpaBwdStridedArgs, 256) { sdpa::bwd_pre<bf16>(args.a, args.st.out); }
TPAR_KERNEL(tpar_sdpa_bwd_pre_strided_f16, SdpaBwdStridedArgs, 256) { sdpa::bwd_pre<f16>(args.a, args.st.out); }
TPAR_KERNEL(tpar_sdpa_bwd_dq_f32, SdpaBwdStridedArgs, 256) { sdpa::bwd_dq<float>(args.a, args.st.q); }
TPAR_KERNEL(tpar_sdpa_bwd_dq_bf16, SdpaBwdStridedArgs, 256) { sdpa::bwd_dq<bf16>(args.a, args.st.q); }
TPAR_KERNEL(tpar_sdpa_bwd_dq_f16, SdpaBwdStridedArgs, 256) { sdpa::bwd_dq<f16>(args.a, args.st.q); }
