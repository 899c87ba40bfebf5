// Reductions over the middle dim of a tensor viewed as [outer, len, inner]
// (sum, max, min, sum of squares) and max with the index of the first max.
//
// - inner == 1 (contiguous rows, e.g. a sum over the last dim or over all
//   elements): `tpar_reduce_last_*`, one block per (row, chunk) work item;
//   threads stride over the chunk with 16-byte loads and the block combines
//   the per-thread values in a fixed tree.
// - inner > 1: `tpar_reduce_mid_*`, a block covers 32 consecutive columns
//   (coalesced) with 8 lanes striding over the reduced rows, combined in a
//   fixed order through shared memory.
//
// Long reductions are split into `chunks` pieces of `chunk_len` reduced rows;
// each writes an f32 partial ([outer, chunks, inner]) and
// `tpar_reduce_final_*` folds the partials (reading f32, writing the output
// dtype). Every step has a fixed summation order for a given launch shape,
// so results are deterministic. Math is in f32; max/min propagate NaN.
// All kernels run with 256 threads per block.

struct ReduceArgs {
    const void* x;    // [outer, len, inner], the kernel's dtype (f32 for final)
    void* out;        // [outer, inner]: the kernel's dtype; f32 for sum of squares
    float* partial;   // [outer, chunks, inner] f32, used when chunks > 1
    i32 outer;
    i32 len;
    i32 inner;
    i32 chunks;       // >= 1
    i32 chunk_len;    // reduced rows per chunk (chunks * chunk_len >= len)
    i32 op;           // 0 sum, 1 max, 2 min, 3 sum of squares
};

struct ReduceArgmaxArgs {
    const void* x;    // [outer, len, inner]
    void* out;        // [outer, inner] max values
    i64* index;       // [outer, inner] index of the first max (first NaN if any)
    i32 outer;
    i32 len;          // >= 1
    i32 inner;
    i32 pad;
};

namespace reduce {

enum { SUM = 0, MAX = 1, MIN = 2, SUMSQ = 3 };
constexpr int kBlock = 256;
constexpr int kCols = 32;                // columns per block of the middle reduction
constexpr int kLanes = kBlock / kCols;   // reduced rows in flight per column

TPAR_DEVICE bool is_nan(float v) { return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u; }

template <int OP>
struct Op;
template <>
struct Op<SUM> {
    static TPAR_DEVICE float init() { return 0.0f; }
    static TPAR_DEVICE float map(float v) { return v; }
    static TPAR_DEVICE float combine(float a, float b) { return a + b; }
};
template <>
struct Op<SUMSQ> {
    static TPAR_DEVICE float init() { return 0.0f; }
    static TPAR_DEVICE float map(float v) { return v * v; }
    static TPAR_DEVICE float combine(float a, float b) { return a + b; }
};
template <>
struct Op<MAX> {
    static TPAR_DEVICE float init() { return -tpar_inf(); }
    static TPAR_DEVICE float map(float v) { return v; }
    static TPAR_DEVICE float combine(float a, float b) { return (b > a || is_nan(b)) ? b : a; }
};
template <>
struct Op<MIN> {
    static TPAR_DEVICE float init() { return tpar_inf(); }
    static TPAR_DEVICE float map(float v) { return v; }
    static TPAR_DEVICE float combine(float a, float b) { return (b < a || is_nan(b)) ? b : a; }
};

// ---------------------------------------------------------------- block combines

template <int OP>
TPAR_DEVICE float warp_reduce(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = Op<OP>::combine(v, __shfl_xor_sync(TPAR_FULL_MASK, v, o));
    return v;
}

// The block's combined value, valid in thread 0. Starts with a barrier, so a
// block may call it once per work item.
template <int OP>
TPAR_DEVICE float block_reduce(float v) {
    __shared__ float s[32];
    const int lane = threadIdx.x % TPAR_WARP, warp = threadIdx.x / TPAR_WARP;
    const int nwarps = blockDim.x / TPAR_WARP;
    v = warp_reduce<OP>(v);
    __syncthreads();
    if (lane == 0) s[warp] = v;
    __syncthreads();
    float t = Op<OP>::init();
    if (warp == 0) {
        t = lane < nwarps ? s[lane] : Op<OP>::init();
        t = warp_reduce<OP>(t);
    }
    return t;
}

// (value, index) of a max search: NaN beats numbers, then the larger value,
// then the smaller index.
TPAR_DEVICE bool arg_better(float bv, int bi, float av, int ai) {
    const bool an = is_nan(av), bn = is_nan(bv);
    if (an != bn) return bn;
    if (!an && bv != av) return bv > av;
    return bi < ai;
}

TPAR_DEVICE void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(TPAR_FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(TPAR_FULL_MASK, i, o);
        if (arg_better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

template <typename T, int OP>
TPAR_DEVICE void store_out(void* out, i64 i, float r) {
    if (OP == SUMSQ) {
        static_cast<float*>(out)[i] = r;
    } else {
        static_cast<T*>(out)[i] = from_f32<T>(r);
    }
}

// ---------------------------------------------------------------- inner == 1

template <typename Tin, typename Tout, int OP>
TPAR_DEVICE void last(const ReduceArgs& a) {
    const Tin* x = static_cast<const Tin*>(a.x);
    const i64 items = (i64)a.outer * a.chunks;
    for (i64 w = blockIdx.x; w < items; w += gridDim.x) {
        const i64 o = w / a.chunks;
        const i64 begin = (w % a.chunks) * (i64)a.chunk_len;
        i64 n = (i64)a.len - begin;
        if (n > a.chunk_len) n = a.chunk_len;
        if (n < 0) n = 0;
        float acc = Op<OP>::init();
        for_each_chunk(x + o * a.len + begin, n, threadIdx.x, blockDim.x,
                       [&](i64, const float* e, int cnt) {
                           for (int j = 0; j < cnt; ++j)
                               acc = Op<OP>::combine(acc, Op<OP>::map(e[j]));
                       });
        acc = block_reduce<OP>(acc);
        if (threadIdx.x == 0) {
            if (a.chunks == 1) {
                store_out<Tout, OP>(a.out, o, acc);
            } else {
                a.partial[w] = acc;
            }
        }
    }
}

// ---------------------------------------------------------------- inner > 1

template <typename Tin, typename Tout, int OP>
TPAR_DEVICE void mid(const ReduceArgs& a) {
    __shared__ float s[kLanes][kCols + 1];
    const Tin* x = static_cast<const Tin*>(a.x);
    const int tx = threadIdx.x % kCols, ty = threadIdx.x / kCols;
    const i64 tiles = (a.inner + kCols - 1) / kCols;
    const i64 items = (i64)a.outer * tiles * a.chunks;
    for (i64 w = blockIdx.x; w < items; w += gridDim.x) {
        const i64 c = w % a.chunks, rest = w / a.chunks;
        const i64 tile = rest % tiles, o = rest / tiles;
        const i64 col = tile * kCols + tx;
        const i64 begin = c * a.chunk_len;
        i64 end = begin + a.chunk_len;
        if (end > a.len) end = a.len;
        float acc = Op<OP>::init();
        if (col < a.inner) {
            const Tin* p = x + o * (i64)a.len * a.inner + col;
            for (i64 l = begin + ty; l < end; l += kLanes) {
                acc = Op<OP>::combine(acc, Op<OP>::map(to_f32(p[l * a.inner])));
            }
        }
        __syncthreads();
        s[ty][tx] = acc;
        __syncthreads();
        if (ty == 0 && col < a.inner) {
            float r = s[0][tx];
#pragma unroll
            for (int k = 1; k < kLanes; ++k) r = Op<OP>::combine(r, s[k][tx]);
            if (a.chunks == 1) {
                store_out<Tout, OP>(a.out, o * a.inner + col, r);
            } else {
                a.partial[(o * a.chunks + c) * a.inner + col] = r;
            }
        }
    }
}

template <typename Tin, typename Tout, bool LAST>
TPAR_DEVICE void dispatch(const ReduceArgs& a) {
    switch (a.op) {
        case SUM: LAST ? last<Tin, Tout, SUM>(a) : mid<Tin, Tout, SUM>(a); break;
        case MAX: LAST ? last<Tin, Tout, MAX>(a) : mid<Tin, Tout, MAX>(a); break;
        case MIN: LAST ? last<Tin, Tout, MIN>(a) : mid<Tin, Tout, MIN>(a); break;
        case SUMSQ: LAST ? last<Tin, Tout, SUMSQ>(a) : mid<Tin, Tout, SUMSQ>(a); break;
        default: break;
    }
}

// Folds f32 partials [outer, chunks, inner] into the output.
template <typename T>
TPAR_DEVICE void final_pass(const ReduceArgs& a) {
    if (a.inner == 1) {
        dispatch<float, T, true>(a);
    } else {
        dispatch<float, T, false>(a);
    }
}

// ---------------------------------------------------------------- argmax

template <typename T>
TPAR_DEVICE void argmax_last(const ReduceArgmaxArgs& a) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const T* x = static_cast<const T*>(a.x);
    const int lane = threadIdx.x % TPAR_WARP, warp = threadIdx.x / TPAR_WARP;
    const int nwarps = blockDim.x / TPAR_WARP;
    for (i64 o = blockIdx.x; o < a.outer; o += gridDim.x) {
        float bv = -tpar_inf();
        int bi = 0x7fffffff;
        for_each_chunk(x + o * a.len, (i64)a.len, threadIdx.x, blockDim.x,
                       [&](i64 i, const float* e, int cnt) {
                           for (int j = 0; j < cnt; ++j) {
                               if (arg_better(e[j], (int)(i + j), bv, bi)) {
                                   bv = e[j];
                                   bi = (int)(i + j);
                               }
                           }
                       });
        warp_argmax(bv, bi);
        __syncthreads();
        if (lane == 0) {
            sv[warp] = bv;
            si[warp] = bi;
        }
        __syncthreads();
        if (warp == 0) {
            bv = lane < nwarps ? sv[lane] : -tpar_inf();
            bi = lane < nwarps ? si[lane] : 0x7fffffff;
            warp_argmax(bv, bi);
            if (lane == 0) {
                static_cast<T*>(a.out)[o] = from_f32<T>(bv);
                a.index[o] = bi;
            }
        }
    }
}

template <typename T>
TPAR_DEVICE void argmax_mid(const ReduceArgmaxArgs& a) {
    __shared__ float sv[kLanes][kCols + 1];
    __shared__ int si[kLanes][kCols + 1];
    const T* x = static_cast<const T*>(a.x);
    const int tx = threadIdx.x % kCols, ty = threadIdx.x / kCols;
    const i64 tiles = (a.inner + kCols - 1) / kCols;
    const i64 items = (i64)a.outer * tiles;
    for (i64 w = blockIdx.x; w < items; w += gridDim.x) {
        const i64 tile = w % tiles, o = w / tiles;
        const i64 col = tile * kCols + tx;
        float bv = -tpar_inf();
        int bi = 0x7fffffff;
        if (col < a.inner) {
            const T* p = x + o * (i64)a.len * a.inner + col;
            for (int l = ty; l < a.len; l += kLanes) {
                const float v = to_f32(p[(i64)l * a.inner]);
                if (arg_better(v, l, bv, bi)) {
                    bv = v;
                    bi = l;
                }
            }
        }
        __syncthreads();
        sv[ty][tx] = bv;
        si[ty][tx] = bi;
        __syncthreads();
        if (ty == 0 && col < a.inner) {
#pragma unroll
            for (int k = 1; k < kLanes; ++k) {
                if (arg_better(sv[k][tx], si[k][tx], bv, bi)) {
                    bv = sv[k][tx];
                    bi = si[k][tx];
                }
            }
            static_cast<T*>(a.out)[o * a.inner + col] = from_f32<T>(bv);
            a.index[o * a.inner + col] = bi;
        }
    }
}

}  // namespace reduce

TPAR_KERNEL(tpar_reduce_last_f32, ReduceArgs, 256) { reduce::dispatch<float, float, true>(args); }
TPAR_KERNEL(tpar_reduce_last_bf16, ReduceArgs, 256) { reduce::dispatch<bf16, bf16, true>(args); }
TPAR_KERNEL(tpar_reduce_last_f16, ReduceArgs, 256) { reduce::dispatch<f16, f16, true>(args); }

TPAR_KERNEL(tpar_reduce_mid_f32, ReduceArgs, 256) { reduce::dispatch<float, float, false>(args); }
TPAR_KERNEL(tpar_reduce_mid_bf16, ReduceArgs, 256) { reduce::dispatch<bf16, bf16, false>(args); }
TPAR_KERNEL(tpar_reduce_mid_f16, ReduceArgs, 256) { reduce::dispatch<f16, f16, false>(args); }

TPAR_KERNEL(tpar_reduce_final_f32, ReduceArgs, 256) { reduce::final_pass<float>(args); }
TPAR_KERNEL(tpar_reduce_final_bf16, ReduceArgs, 256) { reduce::final_pass<bf16>(args); }
TPAR_KERNEL(tpar_reduce_final_f16, ReduceArgs, 256) { reduce::final_pass<f16>(args); }

TPAR_KERNEL(tpar_reduce_argmax_last_f32, ReduceArgmaxArgs, 256) { reduce::argmax_last<float>(args); }
TPAR_KERNEL(tpar_reduce_argmax_last_bf16, ReduceArgmaxArgs, 256) { reduce::argmax_last<bf16>(args); }
TPAR_KERNEL(tpar_reduce_argmax_last_f16, ReduceArgmaxArgs, 256) { reduce::argmax_last<f16>(args); }

TPAR_KERNEL(tpar_reduce_argmax_mid_f32, ReduceArgmaxArgs, 256) { reduce::argmax_mid<float>(args); }
TPAR_KERNEL(tpar_reduce_argmax_mid_bf16, ReduceArgmaxArgs, 256) { reduce::argmax_mid<bf16>(args); }
TPAR_KERNEL(tpar_reduce_argmax_mid_f16, ReduceArgmaxArgs, 256) { reduce::argmax_mid<f16>(args); }
