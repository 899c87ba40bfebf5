// Multi-tensor kernels: one launch over up to 32 tensors of one dtype
// (PyTorch's foreach ops), for gradient-norm clipping over every parameter.
//
// Tensor t's elements are cut into chunks of TPAR_MULTI_CHUNK elements, one
// block per chunk: blocks [first[t], first[t + 1]) of the grid (the last
// tensor's end is `total`, the grid's width; `multi_chunk` in tpar.cuh). A
// block finds its tensor by scanning `first`, so tensors of any sizes (empty
// ones included) share one launch without idle blocks.
//
// - tpar_multi_sumsq_*: each block's sum of squares (f32) of its chunk into
//   `partial[block]`; tpar_multi_sumsq_final folds tensor t's partials in
//   order into `out[t]`. A tensor's result depends only on its own length
//   and data (not on the tensors beside it): deterministic.
// - tpar_multi_scale_*: y = x * c, out of place or in place (y == x: each
//   element is read, then written, by one thread), with `c` the f32 scalar at
//   `coef` rounded to the dtype first (as a multiply by a 0-dim tensor cast
//   to the dtype), the product rounded once.
// All kernels run with 256 threads per block (the final fold with 32).

struct MultiSumSqArgs {
    const void* x[TPAR_MULTI_MAX];   // tensor t's first element
    i64 n[TPAR_MULTI_MAX];           // tensor t's elements
    i32 first[TPAR_MULTI_MAX];       // tensor t's first block
    i32 total;                       // blocks in all (the last tensor's end)
    i32 count;                       // tensors used (1..=32)
    float* partial;                  // [total] per-block sums
    float* out;                      // [count] per-tensor sums
};

struct MultiScaleArgs {
    const void* x[TPAR_MULTI_MAX];
    void* y[TPAR_MULTI_MAX];         // written, same length as x
    i64 n[TPAR_MULTI_MAX];
    i32 first[TPAR_MULTI_MAX];
    i32 total;
    i32 count;
    const float* coef;               // one f32 on the device
};

namespace multi {

// The end of tensor t's blocks.
TPAR_DEVICE int blocks_end(const i32* first, int count, int total, int t) {
    return t + 1 < count ? first[t + 1] : total;
}

template <typename T>
TPAR_DEVICE void sumsq(const MultiSumSqArgs& a) {
    __shared__ float scratch[33];
    const MultiChunk c = multi_chunk(a.first, a.n, a.count, blockIdx.x);
    float acc = 0.0f;
    for_each_chunk(static_cast<const T*>(a.x[c.t]) + c.begin, c.end - c.begin, threadIdx.x,
                   blockDim.x,
                   [&](i64, const float* e, int cnt) {
                       for (int j = 0; j < cnt; ++j) acc += e[j] * e[j];
                   });
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) a.partial[blockIdx.x] = acc;
}

TPAR_DEVICE void sumsq_final(const MultiSumSqArgs& a) {
    const int t = blockIdx.x;
    if (t >= a.count) return;
    float acc = 0.0f;
    const int end = blocks_end(a.first, a.count, a.total, t);
    for (int i = a.first[t] + threadIdx.x; i < end; i += TPAR_WARP) acc += a.partial[i];
    acc = warp_sum(acc);
    if (threadIdx.x == 0) a.out[t] = acc;
}

template <typename T>
TPAR_DEVICE void scale(const MultiScaleArgs& a) {
    const MultiChunk ch = multi_chunk(a.first, a.n, a.count, blockIdx.x);
    const float c = to_f32(from_f32<T>(*a.coef));
    const T* x = static_cast<const T*>(a.x[ch.t]);
    T* y = static_cast<T*>(a.y[ch.t]);
    for (i64 i = ch.begin + threadIdx.x; i < ch.end; i += blockDim.x)
        y[i] = from_f32<T>(to_f32(x[i]) * c);
}

}  // namespace multi

TPAR_KERNEL(tpar_multi_sumsq_f32, MultiSumSqArgs, 256) { multi::sumsq<float>(args); }
TPAR_KERNEL(tpar_multi_sumsq_bf16, MultiSumSqArgs, 256) { multi::sumsq<bf16>(args); }
TPAR_KERNEL(tpar_multi_sumsq_f16, MultiSumSqArgs, 256) { multi::sumsq<f16>(args); }
TPAR_KERNEL(tpar_multi_sumsq_final, MultiSumSqArgs, 32) { multi::sumsq_final(args); }

TPAR_KERNEL(tpar_multi_scale_f32, MultiScaleArgs, 256) { multi::scale<float>(args); }
TPAR_KERNEL(tpar_multi_scale_bf16, MultiScaleArgs, 256) { multi::scale<bf16>(args); }
TPAR_KERNEL(tpar_multi_scale_f16, MultiScaleArgs, 256) { multi::scale<f16>(args); }
