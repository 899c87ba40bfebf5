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

constexpr int kVec = 8;  // elements per thread per step (load8 / store8)

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
        load8(param + i, p);
        load8(grad + i, g);
        load8(a.exp_avg + i, m);
        load8(a.exp_avg_sq + i, v);
#pragma unroll
        for (int k = 0; k < kVec; ++k) p[k] = update(p[k], g[k], m[k], v[k], c);
        store8(param + i, p);
        store8(a.exp_avg + i, m);
        store8(a.exp_avg_sq + i, v);
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
