// Reductions of collectives (all_reduce, reduce_scatter) over the buffers of
// several ranks, device to device: one kernel per element type, suffix
// f32 / f64 / bf16 / f16 / i64.
//
// - tpar_coll_reduce_<dtype>: out[r*cols + c] = fold over k of
//   srcs[k][r*ld + c] for a [rows, cols] block at pitch ld of every source,
//   in source order: acc = up(srcs[0]); acc = op(acc, up(srcs[k])) for
//   k = 1..n; out = down(acc) (Avg divides acc by n first). bf16 and f16
//   accumulate in f32 and round once, f32 / f64 in their own type, i64 wraps.
//   Max / Min let NaN win. The same fold as the host collectives', so the
//   results are bit-equal for the same source order.
//   `srcs` is a device array of n source addresses.

struct CollReduceArgs {
    const void* srcs;  // n device addresses (u64)
    void* out;
    i64 rows;
    i64 cols;
    i64 ld;
    i32 n;
    i32 op;  // 0 sum, 1 avg, 2 max, 3 min, 4 product
};

namespace collective {

template <typename T>
struct Fold;

template <typename F>
struct FoldFloat {
    typedef F A;
    static TPAR_DEVICE A add(A a, A b) { return a + b; }
    static TPAR_DEVICE A mul(A a, A b) { return a * b; }
    static TPAR_DEVICE A max(A a, A b) { return (b > a || b != b) ? b : a; }
    static TPAR_DEVICE A min(A a, A b) { return (b < a || b != b) ? b : a; }
    static TPAR_DEVICE A div(A a, i32 n) { return a / (A)n; }
};

template <>
struct Fold<float> : FoldFloat<float> {
    static TPAR_DEVICE float up(float x) { return x; }
    static TPAR_DEVICE float down(float a) { return a; }
};
template <>
struct Fold<double> : FoldFloat<double> {
    static TPAR_DEVICE double up(double x) { return x; }
    static TPAR_DEVICE double down(double a) { return a; }
};
template <>
struct Fold<bf16> : FoldFloat<float> {
    static TPAR_DEVICE float up(bf16 x) { return to_f32(x); }
    static TPAR_DEVICE bf16 down(float a) { return from_f32<bf16>(a); }
};
template <>
struct Fold<f16> : FoldFloat<float> {
    static TPAR_DEVICE float up(f16 x) { return to_f32(x); }
    static TPAR_DEVICE f16 down(float a) { return from_f32<f16>(a); }
};
template <>
struct Fold<i64> {
    typedef i64 A;
    static TPAR_DEVICE i64 up(i64 x) { return x; }
    static TPAR_DEVICE i64 down(i64 a) { return a; }
    static TPAR_DEVICE i64 add(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
    static TPAR_DEVICE i64 mul(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }
    static TPAR_DEVICE i64 max(i64 a, i64 b) { return b > a ? b : a; }
    static TPAR_DEVICE i64 min(i64 a, i64 b) { return b < a ? b : a; }
    static TPAR_DEVICE i64 div(i64 a, i32 n) { return a / (i64)(n > 0 ? n : 1); }
};

template <typename T>
TPAR_DEVICE void reduce(const CollReduceArgs& a) {
    typedef Fold<T> R;
    typedef typename R::A A;
    const T* const* srcs = static_cast<const T* const*>(a.srcs);
    T* out = static_cast<T*>(a.out);
    const i64 total = a.rows * a.cols;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const i64 r = i / a.cols;
        const i64 at = r * a.ld + (i - r * a.cols);
        A acc = R::up(srcs[0][at]);
        for (i32 k = 1; k < a.n; ++k) {
            const A x = R::up(srcs[k][at]);
            switch (a.op) {
                case 2: acc = R::max(acc, x); break;
                case 3: acc = R::min(acc, x); break;
                case 4: acc = R::mul(acc, x); break;
                default: acc = R::add(acc, x); break;
            }
        }
        if (a.op == 1) acc = R::div(acc, a.n);
        out[i] = R::down(acc);
    }
}

}  // namespace collective

TPAR_KERNEL(tpar_coll_reduce_f32, CollReduceArgs, 256) { collective::reduce<float>(args); }
TPAR_KERNEL(tpar_coll_reduce_f64, CollReduceArgs, 256) { collective::reduce<double>(args); }
TPAR_KERNEL(tpar_coll_reduce_bf16, CollReduceArgs, 256) { collective::reduce<bf16>(args); }
TPAR_KERNEL(tpar_coll_reduce_f16, CollReduceArgs, 256) { collective::reduce<f16>(args); }
TPAR_KERNEL(tpar_coll_reduce_i64, CollReduceArgs, 256) { collective::reduce<i64>(args); }
