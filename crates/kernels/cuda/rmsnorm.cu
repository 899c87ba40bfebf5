// RMSNorm over the last dim: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
//
// Forward: one block per row; rstd (f32) saved per row.
// Backward: a grid of `nblk` blocks strides over the rows; each thread keeps
// the weight-gradient partials of its columns in registers and writes them
// once per block to a [nblk, dim] f32 workspace; a second kernel sums the
// workspace over blocks in a fixed order (deterministic dweight).

struct RmsnormFwdArgs {
    const void* x;
    const void* w;
    void* y;
    float* rstd;
    i32 rows;
    i32 dim;
    float eps;
    i32 pad;
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
};

struct RmsnormDwArgs {
    const float* partial;  // [nblk, dim]
    float* dw;             // [dim]
    i32 nblk;
    i32 dim;
};

namespace rmsnorm {

// Columns per thread kept in registers by the backward pass.
constexpr int kMaxPerThread = 32;

template <typename T>
TPAR_DEVICE void forward(const RmsnormFwdArgs& a) {
    __shared__ float scratch[33];
    const int row = blockIdx.x;
    if (row >= a.rows) return;
    const T* x = static_cast<const T*>(a.x) + (i64)row * a.dim;
    const T* w = static_cast<const T*>(a.w);
    T* y = static_cast<T*>(a.y) + (i64)row * a.dim;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < a.dim; c += blockDim.x) {
        float v = to_f32(x[c]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float rs = rsqrtf(ss / (float)(a.dim > 0 ? a.dim : 1) + a.eps);
    if (threadIdx.x == 0) a.rstd[row] = a.dim > 0 ? rs : rsqrtf(a.eps);
    for (int c = threadIdx.x; c < a.dim; c += blockDim.x) {
        y[c] = from_f32<T>(to_f32(x[c]) * rs * to_f32(w[c]));
    }
}

template <typename T>
TPAR_DEVICE void backward(const RmsnormBwdArgs& a) {
    __shared__ float scratch[33];
    const T* w = static_cast<const T*>(a.w);
    float dw[kMaxPerThread];
#pragma unroll
    for (int i = 0; i < kMaxPerThread; ++i) dw[i] = 0.0f;
    const float inv_dim = 1.0f / (float)a.dim;
    for (int row = blockIdx.x; row < a.rows; row += gridDim.x) {
        const T* x = static_cast<const T*>(a.x) + (i64)row * a.dim;
        const T* dy = static_cast<const T*>(a.dy) + (i64)row * a.dim;
        T* dx = static_cast<T*>(a.dx) + (i64)row * a.dim;
        const float rs = a.rstd[row];
        // dot = sum_j dy_j * w_j * x_j
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxPerThread; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < a.dim) {
                const float g = to_f32(dy[c]);
                const float xv = to_f32(x[c]);
                dot += g * to_f32(w[c]) * xv;
                dw[i] += g * xv * rs;
            }
        }
        dot = block_sum(dot, scratch);
        const float k = dot * rs * rs * rs * inv_dim;
#pragma unroll
        for (int i = 0; i < kMaxPerThread; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < a.dim) {
                dx[c] = from_f32<T>(rs * to_f32(dy[c]) * to_f32(w[c]) - k * to_f32(x[c]));
            }
        }
    }
    float* part = a.partial + (i64)blockIdx.x * a.dim;
#pragma unroll
    for (int i = 0; i < kMaxPerThread; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < a.dim) part[c] = dw[i];
    }
}

}  // namespace rmsnorm

TPAR_KERNEL(tpar_rmsnorm_fwd_f32, RmsnormFwdArgs, 1024) { rmsnorm::forward<float>(args); }
TPAR_KERNEL(tpar_rmsnorm_fwd_bf16, RmsnormFwdArgs, 1024) { rmsnorm::forward<bf16>(args); }
TPAR_KERNEL(tpar_rmsnorm_fwd_f16, RmsnormFwdArgs, 1024) { rmsnorm::forward<f16>(args); }
TPAR_KERNEL(tpar_rmsnorm_bwd_f32, RmsnormBwdArgs, 512) { rmsnorm::backward<float>(args); }
TPAR_KERNEL(tpar_rmsnorm_bwd_bf16, RmsnormBwdArgs, 512) { rmsnorm::backward<bf16>(args); }
TPAR_KERNEL(tpar_rmsnorm_bwd_f16, RmsnormBwdArgs, 512) { rmsnorm::backward<f16>(args); }

// dw[c] = sum over blocks b of partial[b, c], in block order.
TPAR_KERNEL(tpar_rmsnorm_dw_reduce, RmsnormDwArgs, 256) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= args.dim) return;
    float s = 0.0f;
    for (int b = 0; b < args.nblk; ++b) s += args.partial[(i64)b * args.dim + c];
    args.dw[c] = s;
}
