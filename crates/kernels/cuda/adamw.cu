// Fused AdamW step over flat buffers (see src/adamw/mod.rs):
//
//   p    *= 1 - lr * weight_decay
//   m     = m + (1 - beta1) * (g - m)
//   v     = v * beta2 + (1 - beta2) * g * g
//   denom = sqrt(v) / sqrt(1 - beta2^step) + eps
//   p    -= lr / (1 - beta1^step) * m / denom
//
// The host folds the hyper-parameters into f32 coefficients exactly as the
// CPU kernel does. Parameters are f32/bf16/f16, gradients the same dtype
// (tpar_adamw_*) or f32 (tpar_adamw_f32grad_*), moments f32. A grid-stride
// loop takes 8 elements per thread per step with 16-byte accesses when every
// buffer is 16-byte aligned, element by element otherwise.

struct AdamwArgs {
    void* param;        // [n]
    const void* grad;   // [n]
    float* exp_avg;     // [n]
    float* exp_avg_sq;  // [n]
    i64 n;
    float decay;        // 1 - lr * weight_decay
    float w1;           // 1 - beta1
    float beta2;
    float w2;           // 1 - beta2
    float step_size;    // lr / (1 - beta1^step)
    float bc2_sqrt;     // sqrt(1 - beta2^step)
    float eps;
    float pad;
};

namespace adamw {

constexpr int kVec = 8;  // elements per thread per step

struct alignas(16) Raw {
    u32 w[4];
};

template <typename T>
struct Pack;
template <>
struct Pack<float> {
    static constexpr int N = 4;
    static TPAR_DEVICE void unpack(const Raw& r, float* e) {
#pragma unroll
        for (int i = 0; i < 4; ++i) e[i] = __uint_as_float(r.w[i]);
    }
    static TPAR_DEVICE Raw pack(const float* e) {
        Raw r;
#pragma unroll
        for (int i = 0; i < 4; ++i) r.w[i] = __float_as_uint(e[i]);
        return r;
    }
};
template <typename H>
struct PackHalf {
    static constexpr int N = 8;
    static TPAR_DEVICE void unpack(const Raw& r, float* e) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            H lo, hi;
            lo.bits = (u16)(r.w[i] & 0xffffu);
            hi.bits = (u16)(r.w[i] >> 16);
            e[2 * i] = to_f32(lo);
            e[2 * i + 1] = to_f32(hi);
        }
    }
    static TPAR_DEVICE Raw pack(const float* e) {
        Raw r;
#pragma unroll
        for (int i = 0; i < 4; ++i) r.w[i] = pack2_f32<H>(e[2 * i], e[2 * i + 1]);
        return r;
    }
};
template <>
struct Pack<bf16> : PackHalf<bf16> {};
template <>
struct Pack<f16> : PackHalf<f16> {};

// kVec elements at p (16-byte aligned) as f32.
template <typename T>
TPAR_DEVICE void load(const T* p, float* e) {
    constexpr int N = Pack<T>::N;
    const Raw* r = reinterpret_cast<const Raw*>(p);
#pragma unroll
    for (int k = 0; k < kVec / N; ++k) Pack<T>::unpack(r[k], e + k * N);
}

template <typename T>
TPAR_DEVICE void store(T* p, const float* e) {
    constexpr int N = Pack<T>::N;
    Raw* r = reinterpret_cast<Raw*>(p);
#pragma unroll
    for (int k = 0; k < kVec / N; ++k) r[k] = Pack<T>::pack(e + k * N);
}

struct Coef {
    float decay, w1, beta2, w2, step_size, bc2_sqrt, eps;
};

// One element: updates m, v in place and returns the new parameter.
TPAR_DEVICE float update(float p, float g, float& m, float& v, const Coef& c) {
    float x = p * c.decay;
    m += c.w1 * (g - m);
    v = v * c.beta2 + c.w2 * g * g;
    const float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
    x -= c.step_size * m / denom;
    return x;
}

TPAR_DEVICE bool aligned16(const void* p) { return ((u64)p & 15u) == 0; }

template <typename T, typename G>
TPAR_DEVICE void step(const AdamwArgs& a) {
    T* param = static_cast<T*>(a.param);
    const G* grad = static_cast<const G*>(a.grad);
    const Coef c = {a.decay, a.w1, a.beta2, a.w2, a.step_size, a.bc2_sqrt, a.eps};
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 nthreads = (i64)gridDim.x * blockDim.x;
    const bool vec = aligned16(param) && aligned16(grad) && aligned16(a.exp_avg) &&
                     aligned16(a.exp_avg_sq);
    const i64 body = vec ? a.n / kVec * kVec : 0;
    for (i64 i = tid * kVec; i < body; i += nthreads * kVec) {
        float p[kVec], g[kVec], m[kVec], v[kVec];
        load(param + i, p);
        load(grad + i, g);
        load(a.exp_avg + i, m);
        load(a.exp_avg_sq + i, v);
#pragma unroll
        for (int k = 0; k < kVec; ++k) p[k] = update(p[k], g[k], m[k], v[k], c);
        store(param + i, p);
        store(a.exp_avg + i, m);
        store(a.exp_avg_sq + i, v);
    }
    for (i64 i = body + tid; i < a.n; i += nthreads) {
        float m = a.exp_avg[i], v = a.exp_avg_sq[i];
        const float p = update(to_f32(param[i]), to_f32(grad[i]), m, v, c);
        param[i] = from_f32<T>(p);
        a.exp_avg[i] = m;
        a.exp_avg_sq[i] = v;
    }
}

}  // namespace adamw

TPAR_KERNEL(tpar_adamw_f32, AdamwArgs, 256) { adamw::step<float, float>(args); }
TPAR_KERNEL(tpar_adamw_bf16, AdamwArgs, 256) { adamw::step<bf16, bf16>(args); }
TPAR_KERNEL(tpar_adamw_f16, AdamwArgs, 256) { adamw::step<f16, f16>(args); }
TPAR_KERNEL(tpar_adamw_f32grad_bf16, AdamwArgs, 256) { adamw::step<bf16, float>(args); }
TPAR_KERNEL(tpar_adamw_f32grad_f16, AdamwArgs, 256) { adamw::step<f16, float>(args); }
