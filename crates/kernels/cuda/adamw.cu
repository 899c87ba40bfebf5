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
// buffer is 16-byte aligned, element by element otherwise. tpar_multi_adamw_*
// (MultiAdamwArgs below) run the same step over up to 32 tensors a launch.
//
// Working copies: tpar_adamw_f32_copy_{bf16,f16} (and tpar_multi_adamw_f32_copy_*)
// take f32 parameters and gradients and also write each updated parameter, rounded
// to bf16 or f16, into `work` (a tensor's `work` may be null: no copy), in the same
// pass: the low-precision working copy mixed-precision training computes with, the
// bits a separate cast of the updated parameter gives (from_f32 rounds to nearest
// even, as the cast kernels do). The other kernels ignore `work`.
//
// Capturable steps: with `coef_dev` not null every kernel reads the coefficients
// from that device address instead of `coef`, so a CUDA graph that captured the
// launch stays right when the host writes the next step's coefficients there
// (one small host-to-device copy before each replay, outside the graph). The host
// folds them as for `coef`, so the steps are the same bits.

// The step's coefficients, folded on the host.
struct AdamwCoef {
    float decay;      // 1 - lr * weight_decay
    float w1;         // 1 - beta1
    float beta2;
    float w2;         // 1 - beta2
    float step_size;  // lr / (1 - beta1^step)
    float bc2_sqrt;   // sqrt(1 - beta2^step)
    float eps;
    float pad;
};

struct AdamwArgs {
    void* param;        // [n]
    const void* grad;   // [n]
    float* exp_avg;     // [n]
    float* exp_avg_sq;  // [n]
    void* work;         // [n] working copy, or null (the *_copy_* kernels only)
    i64 n;
    AdamwCoef coef;
    const AdamwCoef* coef_dev;  // the coefficients in device memory, or null: `coef`
};

// The same step over up to TPAR_MULTI_MAX tensors in one launch (PyTorch's
// foreach AdamW), all with the same hyper-parameters and step: tensor t's
// chunks of TPAR_MULTI_CHUNK elements are blocks [first[t], first[t + 1]).
// Each element gets the arithmetic of tpar_adamw_*, so the results are the
// same bits.
struct MultiAdamwArgs {
    void* param[TPAR_MULTI_MAX];
    const void* grad[TPAR_MULTI_MAX];
    float* exp_avg[TPAR_MULTI_MAX];
    float* exp_avg_sq[TPAR_MULTI_MAX];
    void* work[TPAR_MULTI_MAX];  // working copies or nulls (the *_copy_* kernels only)
    i64 n[TPAR_MULTI_MAX];
    i32 first[TPAR_MULTI_MAX];
    i32 total;  // blocks in all
    i32 count;  // tensors used (1..=32)
    AdamwCoef coef;
    const AdamwCoef* coef_dev;  // the coefficients in device memory, or null: `coef`
};

namespace adamw {

constexpr int kVec = 8;  // elements per thread per step (load8 / store8)

// One element: updates m, v in place and returns the new parameter.
//
// Every operation is an explicitly rounded one (__fmul_rn, __fadd_rn, ...), which
// the compiler never contracts into a fused multiply-add: with plain `a * b + c`
// it may fuse either product of `v * beta2 + w2 * g * g`, and may choose
// differently in two kernels (tpar_adamw_* and tpar_multi_adamw_* then differed
// in a fraction of a percent of the moments on hardware). Written this way each
// element gets the CPU kernel's f32 arithmetic in its order, whatever kernel,
// compiler or device runs it.
TPAR_DEVICE float update(float p, float g, float& m, float& v, const AdamwCoef& c) {
    float x = __fmul_rn(p, c.decay);
    m = __fadd_rn(m, __fmul_rn(c.w1, __fsub_rn(g, m)));
    v = __fadd_rn(__fmul_rn(v, c.beta2), __fmul_rn(__fmul_rn(c.w2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
    x = __fsub_rn(x, __fdiv_rn(__fmul_rn(c.step_size, m), denom));
    return x;
}

// Elements [begin, end) of one tensor, thread t of nt: 8 at a time with
// 16-byte accesses when all buffers (the working copy too, when there is one) are
// 16-byte aligned at `begin` (`begin` is a multiple of 8), one at a time otherwise
// and for the tail. With `work` not null, each updated parameter as stored (rounded
// to T) is also rounded to W and written there.
template <typename T, typename G, typename W>
TPAR_DEVICE void update_range(T* param, const G* grad, float* exp_avg, float* exp_avg_sq,
                              W* work, i64 begin, i64 end, i64 t, i64 nt, const AdamwCoef& c) {
    const bool vec = aligned16(param + begin) && aligned16(grad + begin) &&
                     aligned16(exp_avg + begin) && aligned16(exp_avg_sq + begin) &&
                     (work == nullptr || aligned16(work + begin));
    const i64 body = vec ? begin + (end - begin) / kVec * kVec : begin;
    for (i64 i = begin + t * kVec; i < body; i += nt * kVec) {
        float p[kVec], g[kVec], m[kVec], v[kVec];
        load8(param + i, p);
        load8(grad + i, g);
        load8(exp_avg + i, m);
        load8(exp_avg_sq + i, v);
#pragma unroll
        for (int k = 0; k < kVec; ++k) p[k] = update(p[k], g[k], m[k], v[k], c);
        store8(param + i, p);
        store8(exp_avg + i, m);
        store8(exp_avg_sq + i, v);
        if (work != nullptr) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) p[k] = to_f32(from_f32<T>(p[k]));
            store8(work + i, p);
        }
    }
    for (i64 i = body + t; i < end; i += nt) {
        float m = exp_avg[i], v = exp_avg_sq[i];
        const float p = update(to_f32(param[i]), to_f32(grad[i]), m, v, c);
        const T stored = from_f32<T>(p);
        param[i] = stored;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (work != nullptr) work[i] = from_f32<W>(to_f32(stored));
    }
}

// kCopy: `work` holds a working copy of W elements (or null); otherwise it is not read.
template <typename T, typename G, typename W = T, bool kCopy = false>
TPAR_DEVICE void step(const AdamwArgs& a) {
    const AdamwCoef c = a.coef_dev != nullptr ? *a.coef_dev : a.coef;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 nthreads = (i64)gridDim.x * blockDim.x;
    W* work = kCopy ? static_cast<W*>(a.work) : nullptr;
    update_range(static_cast<T*>(a.param), static_cast<const G*>(a.grad), a.exp_avg,
                 a.exp_avg_sq, work, 0, a.n, tid, nthreads, c);
}

// One block per chunk of one of up to TPAR_MULTI_MAX tensors (tpar.cuh).
template <typename T, typename G, typename W = T, bool kCopy = false>
TPAR_DEVICE void step_each(const MultiAdamwArgs& a) {
    const AdamwCoef c = a.coef_dev != nullptr ? *a.coef_dev : a.coef;
    const MultiChunk ch = multi_chunk(a.first, a.n, a.count, blockIdx.x);
    W* work = kCopy ? static_cast<W*>(a.work[ch.t]) : nullptr;
    update_range(static_cast<T*>(a.param[ch.t]), static_cast<const G*>(a.grad[ch.t]),
                 a.exp_avg[ch.t], a.exp_avg_sq[ch.t], work, ch.begin, ch.end, threadIdx.x,
                 blockDim.x, c);
}

}  // namespace adamw

TPAR_KERNEL(tpar_adamw_f32, AdamwArgs, 256) { adamw::step<float, float>(args); }
TPAR_KERNEL(tpar_adamw_bf16, AdamwArgs, 256) { adamw::step<bf16, bf16>(args); }
TPAR_KERNEL(tpar_adamw_f16, AdamwArgs, 256) { adamw::step<f16, f16>(args); }
TPAR_KERNEL(tpar_adamw_f32grad_bf16, AdamwArgs, 256) { adamw::step<bf16, float>(args); }
TPAR_KERNEL(tpar_adamw_f32grad_f16, AdamwArgs, 256) { adamw::step<f16, float>(args); }
TPAR_KERNEL(tpar_adamw_f32_copy_bf16, AdamwArgs, 256) {
    adamw::step<float, float, bf16, true>(args);
}
TPAR_KERNEL(tpar_adamw_f32_copy_f16, AdamwArgs, 256) {
    adamw::step<float, float, f16, true>(args);
}

TPAR_KERNEL(tpar_multi_adamw_f32, MultiAdamwArgs, 256) { adamw::step_each<float, float>(args); }
TPAR_KERNEL(tpar_multi_adamw_bf16, MultiAdamwArgs, 256) { adamw::step_each<bf16, bf16>(args); }
TPAR_KERNEL(tpar_multi_adamw_f16, MultiAdamwArgs, 256) { adamw::step_each<f16, f16>(args); }
TPAR_KERNEL(tpar_multi_adamw_f32grad_bf16, MultiAdamwArgs, 256) {
    adamw::step_each<bf16, float>(args);
}
TPAR_KERNEL(tpar_multi_adamw_f32grad_f16, MultiAdamwArgs, 256) {
    adamw::step_each<f16, float>(args);
}
TPAR_KERNEL(tpar_multi_adamw_f32_copy_bf16, MultiAdamwArgs, 256) {
    adamw::step_each<float, float, bf16, true>(args);
}
TPAR_KERNEL(tpar_multi_adamw_f32_copy_f16, MultiAdamwArgs, 256) {
    adamw::step_each<float, float, f16, true>(args);
}
