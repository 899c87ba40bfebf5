// RMSNorm over the last dim: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
//
// A block holds `ry = blockDim.x / tpr` row slots of `tpr` threads (a multiple
// of 32, at most 512); thread `tx` of a slot takes the chunks tx, tx + tpr, ...
// of its row, at most 32 elements. A chunk is one 16-byte vector (4 f32 or
// 8 bf16/f16) when `vec` is set (every row and pointer 16-byte aligned, as the
// host checks), else one element.
//
// Forward: each row slot normalises one row; rstd (f32) saved per row.
// Backward: the blocks stride over the rows `ry` at a time; each thread keeps
// the weight-gradient partials of its columns in registers, the row slots of
// a block add theirs into the block's row of a [nblk, dim] f32 workspace in
// slot order, and a second kernel sums the workspace over blocks in block
// order (deterministic dweight).

struct RmsnormFwdArgs {
    const void* x;
    const void* w;
    void* y;
    float* rstd;
    i32 rows;
    i32 dim;
    float eps;
    i32 tpr;  // threads per row slot
    i32 vec;  // 1: 16-byte chunks (the vector kernels; 0: the _elem_ ones)
};

struct RmsnormBwdArgs {
    const void* x;
    const void* w;
    const float* rstd;
    const void* dy;
    void* dx;
    float* partial;  // [gridDim.x, dim]
    i32 rows;
    i32 dim;
    i32 tpr;
    i32 vec;
};

struct RmsnormDwArgs {
    const float* partial;  // [nblk, dim]
    float* dw;             // [dim]
    i32 nblk;
    i32 dim;
};

namespace rmsnorm {

// Elements per thread and row.
constexpr int kPerThread = 32;

// V consecutive elements at p as f32 (V = 1, or one 16-byte vector).
template <typename T, int V>
TPAR_DEVICE void load(const T* p, float* e) {
    if constexpr (V == 1) {
        e[0] = to_f32(*p);
    } else {
        Pack16<T>::unpack(*reinterpret_cast<const Raw16*>(p), e);
    }
}

template <typename T, int V>
TPAR_DEVICE void store(T* p, const float* e) {
    if constexpr (V == 1) {
        *p = from_f32<T>(e[0]);
    } else {
        *reinterpret_cast<Raw16*>(p) = Pack16<T>::pack(e);
    }
}

// The sum of `v` over the `tpr` threads of each row slot; every thread gets
// its slot's total. Starts and ends with a barrier (call it uniformly).
TPAR_DEVICE float slot_sum(float v, int tpr, float* scratch) {
    const int warp = threadIdx.x / TPAR_WARP, wpr = tpr / TPAR_WARP;
    v = warp_sum(v);
    __syncthreads();
    if (threadIdx.x % TPAR_WARP == 0) scratch[warp] = v;
    __syncthreads();
    const int first = (threadIdx.x / tpr) * wpr;
    float t = 0.0f;
    for (int i = 0; i < wpr; ++i) t += scratch[first + i];
    __syncthreads();
    return t;
}

template <typename T, int V>
TPAR_DEVICE void forward(const RmsnormFwdArgs& a) {
    constexpr int S = kPerThread / V;
    __shared__ float scratch[32];
    const int tpr = a.tpr, ry = blockDim.x / tpr;
    const int ty = threadIdx.x / tpr, tx = threadIdx.x % tpr;
    const int chunks = a.dim / V;
    const i64 row = (i64)blockIdx.x * ry + ty;
    const bool live = row < a.rows;
    const T* x = static_cast<const T*>(a.x) + (live ? row : 0) * a.dim;
    const T* w = static_cast<const T*>(a.w);
    T* y = static_cast<T*>(a.y) + (live ? row : 0) * a.dim;
    float xv[S * V];
    float ss = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
        const int j = tx + s * tpr;
        if (live && j < chunks) {
            load<T, V>(x + (i64)j * V, xv + s * V);
#pragma unroll
            for (int e = 0; e < V; ++e) ss += xv[s * V + e] * xv[s * V + e];
        }
    }
    ss = slot_sum(ss, tpr, scratch);
    if (!live) return;
    const float rs = rsqrtf(ss / (float)a.dim + a.eps);
    if (tx == 0) a.rstd[row] = rs;
#pragma unroll
    for (int s = 0; s < S; ++s) {
        const int j = tx + s * tpr;
        if (j < chunks) {
            float wv[V], out[V];
            load<T, V>(w + (i64)j * V, wv);
#pragma unroll
            for (int e = 0; e < V; ++e) out[e] = xv[s * V + e] * rs * wv[e];
            store<T, V>(y + (i64)j * V, out);
        }
    }
}

template <typename T, int V>
TPAR_DEVICE void backward(const RmsnormBwdArgs& a) {
    constexpr int S = kPerThread / V;
    __shared__ float scratch[32];
    const int tpr = a.tpr, ry = blockDim.x / tpr;
    const int ty = threadIdx.x / tpr, tx = threadIdx.x % tpr;
    const int chunks = a.dim / V;
    const T* w = static_cast<const T*>(a.w);
    const float inv_dim = 1.0f / (float)a.dim;
    float dw[S * V];
#pragma unroll
    for (int i = 0; i < S * V; ++i) dw[i] = 0.0f;
    // Every thread runs the same iterations (slot_sum has barriers).
    for (i64 base = (i64)blockIdx.x * ry; base < a.rows; base += (i64)gridDim.x * ry) {
        const i64 row = base + ty;
        const bool live = row < a.rows;
        const T* x = static_cast<const T*>(a.x) + (live ? row : 0) * a.dim;
        const T* dy = static_cast<const T*>(a.dy) + (live ? row : 0) * a.dim;
        T* dx = static_cast<T*>(a.dx) + (live ? row : 0) * a.dim;
        // dot = sum_j dy_j * w_j * x_j
        float dot = 0.0f;
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int j = tx + s * tpr;
            if (live && j < chunks) {
                float g[V], xv[V], wv[V];
                load<T, V>(dy + (i64)j * V, g);
                load<T, V>(x + (i64)j * V, xv);
                load<T, V>(w + (i64)j * V, wv);
#pragma unroll
                for (int e = 0; e < V; ++e) dot += g[e] * wv[e] * xv[e];
            }
        }
        dot = slot_sum(dot, tpr, scratch);
        if (!live) continue;
        const float rs = a.rstd[row];
        const float k = dot * rs * rs * rs * inv_dim;
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int j = tx + s * tpr;
            if (j < chunks) {
                float g[V], xv[V], wv[V], out[V];
                load<T, V>(dy + (i64)j * V, g);
                load<T, V>(x + (i64)j * V, xv);
                load<T, V>(w + (i64)j * V, wv);
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    out[e] = rs * g[e] * wv[e] - k * xv[e];
                    dw[s * V + e] += g[e] * xv[e] * rs;
                }
                store<T, V>(dx + (i64)j * V, out);
            }
        }
    }
    // The row slots add their partials into the block's workspace row in slot
    // order; the barrier makes each slot's writes visible to the next.
    float* part = a.partial + (i64)blockIdx.x * a.dim;
    for (int y = 0; y < ry; ++y) {
        if (ty == y) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int j = tx + s * tpr;
                if (j < chunks) {
#pragma unroll
                    for (int e = 0; e < V; ++e) {
                        const i64 c = (i64)j * V + e;
                        part[c] = (y == 0 ? 0.0f : part[c]) + dw[s * V + e];
                    }
                }
            }
        }
        __syncthreads();
    }
}

}  // namespace rmsnorm

// Each pass has a kernel per path, so that its 16-byte vector path (every row
// and pointer aligned: the common case) is not held to the registers of the
// element path: bounded to two 512-thread blocks per SM, the vector kernels
// take 64 registers without spilling (NVRTC 13), where one kernel for both
// paths took 102 (forward) and 128 (backward) and fit one block. The host picks
// the kernel by alignment (`vec` in the arguments says the same). The element
// kernels fit one block: the forward's takes 102 registers, the backward's,
// bounded to one block so that ptxas may use 128 (left to itself it takes 64
// and spills 1.5 KB a thread), spills about 0.9 KB a thread (the joint kernel
// 0.7 KB).
TPAR_KERNEL(tpar_rmsnorm_fwd_f32, RmsnormFwdArgs, TPAR_BOUNDS(512, 2)) {
    rmsnorm::forward<float, 4>(args);
}
TPAR_KERNEL(tpar_rmsnorm_fwd_bf16, RmsnormFwdArgs, TPAR_BOUNDS(512, 2)) {
    rmsnorm::forward<bf16, 8>(args);
}
TPAR_KERNEL(tpar_rmsnorm_fwd_f16, RmsnormFwdArgs, TPAR_BOUNDS(512, 2)) {
    rmsnorm::forward<f16, 8>(args);
}
TPAR_KERNEL(tpar_rmsnorm_fwd_elem_f32, RmsnormFwdArgs, 512) { rmsnorm::forward<float, 1>(args); }
TPAR_KERNEL(tpar_rmsnorm_fwd_elem_bf16, RmsnormFwdArgs, 512) { rmsnorm::forward<bf16, 1>(args); }
TPAR_KERNEL(tpar_rmsnorm_fwd_elem_f16, RmsnormFwdArgs, 512) { rmsnorm::forward<f16, 1>(args); }
TPAR_KERNEL(tpar_rmsnorm_bwd_f32, RmsnormBwdArgs, TPAR_BOUNDS(512, 2)) {
    rmsnorm::backward<float, 4>(args);
}
TPAR_KERNEL(tpar_rmsnorm_bwd_bf16, RmsnormBwdArgs, TPAR_BOUNDS(512, 2)) {
    rmsnorm::backward<bf16, 8>(args);
}
TPAR_KERNEL(tpar_rmsnorm_bwd_f16, RmsnormBwdArgs, TPAR_BOUNDS(512, 2)) {
    rmsnorm::backward<f16, 8>(args);
}
TPAR_KERNEL(tpar_rmsnorm_bwd_elem_f32, RmsnormBwdArgs, TPAR_BOUNDS(512, 1)) {
    rmsnorm::backward<float, 1>(args);
}
TPAR_KERNEL(tpar_rmsnorm_bwd_elem_bf16, RmsnormBwdArgs, TPAR_BOUNDS(512, 1)) {
    rmsnorm::backward<bf16, 1>(args);
}
TPAR_KERNEL(tpar_rmsnorm_bwd_elem_f16, RmsnormBwdArgs, TPAR_BOUNDS(512, 1)) {
    rmsnorm::backward<f16, 1>(args);
}

// dw[c] = sum over blocks b of partial[b, c], in block order.
TPAR_KERNEL(tpar_rmsnorm_dw_reduce, RmsnormDwArgs, 256) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= args.dim) return;
    float s = 0.0f;
#pragma unroll 8
    for (int b = 0; b < args.nblk; ++b) s += args.partial[(i64)b * args.dim + c];
    args.dw[c] = s;
}
