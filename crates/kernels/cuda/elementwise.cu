// Elementwise kernels: unary maps and their gradients, scalar and binary ops
// (contiguous and broadcast), fused SwiGLU, fill, casts, accumulation, and
// softmax / log-softmax over the last dim.
//
// Memory-bound throughout: every flat kernel walks the data in items of 8
// elements with 16-byte vector loads and stores when all its pointers are
// 16-byte aligned, then finishes the remainder (or everything, when a pointer
// is not aligned) element by element, in grid-stride loops. Math is in f32.
//
// Op codes (mirrored by src/cuda/ops/elementwise.rs):
//   unary:  0 neg, 1 exp, 2 log, 3 sqrt, 4 rsqrt, 5 silu, 6 sigmoid, 7 square,
//           8 abs, 9 relu, 10 tanh, 11 recip
//   binary: 0 add, 1 sub, 2 mul, 3 div, 4 max, 5 min, 6 pow

#define TPAR_EW_MAX_RANK 6

struct EwUnaryArgs {  // y = op(x); y may be x
    const void* x;
    void* y;
    i64 n;
    i32 op;
    i32 pad;
};

struct EwUnaryBwdArgs {  // dx = dy * op'(x) given y = op(x)
    const void* x;
    const void* y;
    const void* dy;
    void* dx;
    i64 n;
    i32 op;
    i32 pad;
};

struct EwScalarArgs {  // y = x op s, or s op x when scalar_first
    const void* x;
    void* y;
    i64 n;
    float s;
    i32 op;
    i32 scalar_first;
    i32 pad;
};

struct EwBinaryArgs {  // out = a op b, all contiguous with n elements
    const void* a;
    const void* b;
    void* out;
    i64 n;
    i32 op;
    i32 pad;
};

// out (contiguous, `shape`) = a op b with a, b read at the given element
// strides per output dim (stride 0 broadcasts). `vec`: the last dim is a
// multiple of 8, every other stride of a and b is a multiple of 8, their
// last strides are 0 or 1 and the pointers are 16-byte aligned. `idx32`: the
// output and every offset fit in 32 bits.
struct EwBinaryBcastArgs {
    const void* a;
    const void* b;
    void* out;
    i64 n;
    i64 shape[TPAR_EW_MAX_RANK];
    i64 a_stride[TPAR_EW_MAX_RANK];
    i64 b_stride[TPAR_EW_MAX_RANK];
    i32 rank;
    i32 op;
    i32 vec;
    i32 idx32;
};

// SwiGLU over [rows, cols]: gate `a` and `up` b are read at a[r*ld + c],
// b[r*ld + c] (ld = cols when contiguous; 2*cols with a and b the two halves
// of one fused [rows, 2*cols] projection); y is contiguous [rows, cols].
struct EwSwigluFwdArgs {
    const void* a;
    const void* b;
    void* y;
    i64 rows;
    i64 cols;
    i64 ld;
};

// Gradients of SwiGLU: da, db are written with the same row stride `ld` as
// a and b; dy is contiguous [rows, cols].
struct EwSwigluBwdArgs {
    const void* a;
    const void* b;
    const void* dy;
    void* da;
    void* db;
    i64 rows;
    i64 cols;
    i64 ld;
};

struct EwFillArgs {
    void* y;
    i64 n;
    float value;
    i32 pad;
};

struct EwCastArgs {  // dst = src converted (round to nearest even)
    const void* src;
    void* dst;
    i64 n;
};

struct EwAccumulateArgs {  // dst += alpha * src
    void* dst;
    const void* src;
    i64 n;
    float alpha;
    i32 pad;
};

// Softmax (log = 0) or log-softmax (log = 1) over rows of `cols` elements.
struct EwSoftmaxFwdArgs {
    const void* x;
    void* y;
    i64 rows;
    i64 cols;
    i32 log;
    i32 pad;
};

// Backward from the forward output y: softmax dx = y * (dy - sum(dy * y)),
// log-softmax dx = dy - exp(y) * sum(dy).
struct EwSoftmaxBwdArgs {
    const void* y;
    const void* dy;
    void* dx;
    i64 rows;
    i64 cols;
    i32 log;
    i32 pad;
};

// i64 sources (casts to floating types) read through the prelude's load8:
// two values per 16-byte vector, converted to f32.
template <>
struct Pack16<i64> {
    static constexpr int N = 2;
    static TPAR_DEVICE void unpack(const Raw16& r, float* e) {
        e[0] = (float)(i64)((u64)r.w[0] | ((u64)r.w[1] << 32));
        e[1] = (float)(i64)((u64)r.w[2] | ((u64)r.w[3] << 32));
    }
};

namespace elementwise {

// ---------------------------------------------------------------- access
//
// load8 / store8 (prelude) move 8 consecutive elements at a 16-byte aligned
// address; ld1 / st1 one element, widened to / rounded from f32.

TPAR_DEVICE float ld1(const float* p) { return *p; }
TPAR_DEVICE float ld1(const bf16* p) { return to_f32(*p); }
TPAR_DEVICE float ld1(const f16* p) { return to_f32(*p); }
TPAR_DEVICE float ld1(const i64* p) { return (float)*p; }
template <typename T>
TPAR_DEVICE void st1(T* p, float v) {
    *p = from_f32<T>(v);
}

// Runs vec(i) for i = 0, 8, 16, ... (one item of 8 elements) while a whole
// item fits, if `vec`; then one(i) for every remaining element. Grid-stride.
template <typename V, typename S>
TPAR_DEVICE void grid_loop(i64 n, bool vec, V vec_body, S one_body) {
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 items = vec ? n / 8 : 0;
    for (i64 v = tid; v < items; v += stride) vec_body(v * 8);
    for (i64 i = items * 8 + tid; i < n; i += stride) one_body(i);
}

// ---------------------------------------------------------------- math

TPAR_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// x ^ y as f32 powf: exact for small integer exponents, the sign of a
// negative base kept for odd integer exponents, NaN for a negative base with
// a fractional exponent.
TPAR_DEVICE float pow_f32(float x, float y) {
    if (y == 0.0f) return 1.0f;
    if (x != x || y != y) return x + y;
    if (y == 1.0f) return x;
    if (y == 2.0f) return x * x;
    if (y == 3.0f) return x * x * x;
    if (y == -1.0f) return 1.0f / x;
    if (y == 0.5f && x >= 0.0f) return sqrtf(x);
    const float ay = fabsf(y);
    bool is_int = false, odd = false;
    if (ay < 16777216.0f) {
        const i64 k = (i64)y;
        is_int = (float)k == y;
        odd = is_int && (k & 1) != 0;
    } else {
        is_int = ay != tpar_inf();  // every float this large is an even integer
    }
    const float ax = fabsf(x);
    if (ax == 0.0f) {
        const float mag = y > 0.0f ? 0.0f : tpar_inf();
        const bool neg = odd && (__float_as_uint(x) >> 31) != 0;
        return neg ? -mag : mag;
    }
    if (x < 0.0f && !is_int) return __uint_as_float(0x7fc00000u);
    float r;
    if (ax == tpar_inf()) {
        r = y > 0.0f ? tpar_inf() : 0.0f;
    } else if (ay == tpar_inf()) {
        r = (ax == 1.0f) ? 1.0f : ((ax > 1.0f) == (y > 0.0f) ? tpar_inf() : 0.0f);
    } else {
        r = expf(y * logf(ax));
    }
    return (x < 0.0f && odd) ? -r : r;
}

template <int OP>
TPAR_DEVICE float unary_f(float x) {
    switch (OP) {
        case 0: return -x;
        case 1: return expf(x);
        case 2: return logf(x);
        case 3: return sqrtf(x);
        case 4: return rsqrtf(x);
        case 5: return x * sigmoid(x);
        case 6: return sigmoid(x);
        case 7: return x * x;
        case 8: return fabsf(x);
        case 9: return fmaxf(x, 0.0f);
        case 10: return tanhf(x);
        default: return 1.0f / x;
    }
}

// dy * f'(x) given x and y = f(x).
template <int OP>
TPAR_DEVICE float unary_grad(float x, float y, float dy) {
    switch (OP) {
        case 0: return -dy;
        case 1: return dy * y;
        case 2: return dy / x;
        case 3: return dy / (2.0f * y);
        case 4: return -dy * y * y * y / 2.0f;
        case 5: {
            const float s = sigmoid(x);
            return dy * s * (1.0f + x * (1.0f - s));
        }
        case 6: return dy * y * (1.0f - y);
        case 7: return dy * 2.0f * x;
        case 8: {
            // signum: NaN for NaN, else the sign bit (+1 for +0)
            if (x != x) return x;
            return (__float_as_uint(x) >> 31) ? -dy : dy;
        }
        case 9: return x > 0.0f ? dy : 0.0f;
        case 10: return dy * (1.0f - y * y);
        default: return -dy * y * y;
    }
}

template <int OP>
TPAR_DEVICE float binary_f(float a, float b) {
    switch (OP) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        case 3: return a / b;
        case 4: return fmaxf(a, b);
        case 5: return fminf(a, b);
        default: return pow_f32(a, b);
    }
}

#define TPAR_EW_UNARY_SWITCH(op, F) \
    switch (op) {                   \
        case 0: F(0); break;        \
        case 1: F(1); break;        \
        case 2: F(2); break;        \
        case 3: F(3); break;        \
        case 4: F(4); break;        \
        case 5: F(5); break;        \
        case 6: F(6); break;        \
        case 7: F(7); break;        \
        case 8: F(8); break;        \
        case 9: F(9); break;        \
        case 10: F(10); break;      \
        case 11: F(11); break;      \
        default: break;             \
    }

#define TPAR_EW_BINARY_SWITCH(op, F) \
    switch (op) {                    \
        case 0: F(0); break;         \
        case 1: F(1); break;         \
        case 2: F(2); break;         \
        case 3: F(3); break;         \
        case 4: F(4); break;         \
        case 5: F(5); break;         \
        case 6: F(6); break;         \
        default: break;              \
    }

// ---------------------------------------------------------------- unary

template <typename T, int OP>
TPAR_DEVICE void unary_run(const T* x, T* y, i64 n) {
    const bool vec = aligned16(x) && aligned16(y);
    grid_loop(
        n, vec,
        [&](i64 i) {
            float v[8];
            load8(x + i, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = unary_f<OP>(v[k]);
            store8(y + i, v);
        },
        [&](i64 i) { st1(y + i, unary_f<OP>(ld1(x + i))); });
}

template <typename T>
TPAR_DEVICE void unary(const EwUnaryArgs& a) {
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
#define TPAR_EW_F(K) unary_run<T, K>(x, y, a.n)
    TPAR_EW_UNARY_SWITCH(a.op, TPAR_EW_F)
#undef TPAR_EW_F
}

template <typename T, int OP>
TPAR_DEVICE void unary_bwd_run(const T* x, const T* y, const T* dy, T* dx, i64 n) {
    const bool vec = aligned16(x) && aligned16(y) && aligned16(dy) && aligned16(dx);
    grid_loop(
        n, vec,
        [&](i64 i) {
            float xv[8], yv[8], gv[8];
            load8(x + i, xv);
            load8(y + i, yv);
            load8(dy + i, gv);
#pragma unroll
            for (int k = 0; k < 8; ++k) gv[k] = unary_grad<OP>(xv[k], yv[k], gv[k]);
            store8(dx + i, gv);
        },
        [&](i64 i) { st1(dx + i, unary_grad<OP>(ld1(x + i), ld1(y + i), ld1(dy + i))); });
}

template <typename T>
TPAR_DEVICE void unary_bwd(const EwUnaryBwdArgs& a) {
    const T* x = static_cast<const T*>(a.x);
    const T* y = static_cast<const T*>(a.y);
    const T* dy = static_cast<const T*>(a.dy);
    T* dx = static_cast<T*>(a.dx);
#define TPAR_EW_F(K) unary_bwd_run<T, K>(x, y, dy, dx, a.n)
    TPAR_EW_UNARY_SWITCH(a.op, TPAR_EW_F)
#undef TPAR_EW_F
}

// ---------------------------------------------------------------- scalar

template <typename T, int OP>
TPAR_DEVICE void scalar_run(const T* x, T* y, i64 n, float s, bool first) {
    const bool vec = aligned16(x) && aligned16(y);
    grid_loop(
        n, vec,
        [&](i64 i) {
            float v[8];
            load8(x + i, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = first ? binary_f<OP>(s, v[k]) : binary_f<OP>(v[k], s);
            store8(y + i, v);
        },
        [&](i64 i) {
            const float v = ld1(x + i);
            st1(y + i, first ? binary_f<OP>(s, v) : binary_f<OP>(v, s));
        });
}

template <typename T>
TPAR_DEVICE void scalar(const EwScalarArgs& a) {
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    const bool first = a.scalar_first != 0;
#define TPAR_EW_F(K) scalar_run<T, K>(x, y, a.n, a.s, first)
    TPAR_EW_BINARY_SWITCH(a.op, TPAR_EW_F)
#undef TPAR_EW_F
}

// ---------------------------------------------------------------- binary

template <typename T, int OP>
TPAR_DEVICE void binary_run(const T* pa, const T* pb, T* out, i64 n) {
    const bool vec = aligned16(pa) && aligned16(pb) && aligned16(out);
    grid_loop(
        n, vec,
        [&](i64 i) {
            float va[8], vb[8];
            load8(pa + i, va);
            load8(pb + i, vb);
#pragma unroll
            for (int k = 0; k < 8; ++k) va[k] = binary_f<OP>(va[k], vb[k]);
            store8(out + i, va);
        },
        [&](i64 i) { st1(out + i, binary_f<OP>(ld1(pa + i), ld1(pb + i))); });
}

template <typename T>
TPAR_DEVICE void binary(const EwBinaryArgs& a) {
    const T* pa = static_cast<const T*>(a.a);
    const T* pb = static_cast<const T*>(a.b);
    T* out = static_cast<T*>(a.out);
#define TPAR_EW_F(K) binary_run<T, K>(pa, pb, out, a.n)
    TPAR_EW_BINARY_SWITCH(a.op, TPAR_EW_F)
#undef TPAR_EW_F
}

// Offsets into a and b of output element i (index type I: u32 or u64).
template <typename I>
TPAR_DEVICE void bcast_offsets(const EwBinaryBcastArgs& a, I i, I& oa, I& ob) {
    oa = 0;
    ob = 0;
    for (int d = a.rank - 1; d >= 0; --d) {
        const I size = (I)a.shape[d];
        const I q = i / size;
        const I c = i - q * size;
        oa += c * (I)a.a_stride[d];
        ob += c * (I)a.b_stride[d];
        i = q;
    }
}

template <typename T, int OP, typename I>
TPAR_DEVICE void binary_bcast_run(const EwBinaryBcastArgs& a) {
    const T* pa = static_cast<const T*>(a.a);
    const T* pb = static_cast<const T*>(a.b);
    T* out = static_cast<T*>(a.out);
    const bool a_bcast = a.a_stride[a.rank - 1] == 0, b_bcast = a.b_stride[a.rank - 1] == 0;
    grid_loop(
        a.n, a.vec != 0,
        [&](i64 i) {
            I oa, ob;
            bcast_offsets<I>(a, (I)i, oa, ob);
            float va[8], vb[8];
            if (a_bcast) {
                const float s = ld1(pa + oa);
#pragma unroll
                for (int k = 0; k < 8; ++k) va[k] = s;
            } else {
                load8(pa + oa, va);
            }
            if (b_bcast) {
                const float s = ld1(pb + ob);
#pragma unroll
                for (int k = 0; k < 8; ++k) vb[k] = s;
            } else {
                load8(pb + ob, vb);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) va[k] = binary_f<OP>(va[k], vb[k]);
            store8(out + i, va);
        },
        [&](i64 i) {
            I oa, ob;
            bcast_offsets<I>(a, (I)i, oa, ob);
            st1(out + i, binary_f<OP>(ld1(pa + oa), ld1(pb + ob)));
        });
}

template <typename T>
TPAR_DEVICE void binary_bcast(const EwBinaryBcastArgs& a) {
    if (a.rank < 1 || a.rank > TPAR_EW_MAX_RANK) return;
    if (a.idx32) {
#define TPAR_EW_F(K) binary_bcast_run<T, K, u32>(a)
        TPAR_EW_BINARY_SWITCH(a.op, TPAR_EW_F)
#undef TPAR_EW_F
    } else {
#define TPAR_EW_F(K) binary_bcast_run<T, K, u64>(a)
        TPAR_EW_BINARY_SWITCH(a.op, TPAR_EW_F)
#undef TPAR_EW_F
    }
}

// ---------------------------------------------------------------- SwiGLU

// Offset of element i of the contiguous [rows, cols] output in a and b.
TPAR_DEVICE i64 in_offset(i64 i, i64 cols, i64 ld) {
    if (ld == cols) return i;
    const i64 r = i / cols;
    return r * ld + (i - r * cols);
}

template <typename T>
TPAR_DEVICE void swiglu_fwd(const EwSwigluFwdArgs& p) {
    const T* a = static_cast<const T*>(p.a);
    const T* b = static_cast<const T*>(p.b);
    T* y = static_cast<T*>(p.y);
    const bool vec =
        aligned16(a) && aligned16(b) && aligned16(y) && (p.cols % 8 == 0) && (p.ld % 8 == 0);
    grid_loop(
        p.rows * p.cols, vec,
        [&](i64 i) {
            const i64 o = in_offset(i, p.cols, p.ld);
            float va[8], vb[8];
            load8(a + o, va);
            load8(b + o, vb);
#pragma unroll
            for (int k = 0; k < 8; ++k) va[k] = va[k] * sigmoid(va[k]) * vb[k];
            store8(y + i, va);
        },
        [&](i64 i) {
            const i64 o = in_offset(i, p.cols, p.ld);
            const float va = ld1(a + o);
            st1(y + i, va * sigmoid(va) * ld1(b + o));
        });
}

// da = dy * b * silu'(a), db = dy * silu(a), in the order of a multiply's
// gradients followed by SiLU's (the same f32 bits as the two ops unfused).
TPAR_DEVICE void swiglu_grad(float a, float b, float g, float& da, float& db) {
    const float s = sigmoid(a);
    db = g * (a * s);
    da = g * b * s * (1.0f + a * (1.0f - s));
}

template <typename T>
TPAR_DEVICE void swiglu_bwd(const EwSwigluBwdArgs& p) {
    const T* a = static_cast<const T*>(p.a);
    const T* b = static_cast<const T*>(p.b);
    const T* dy = static_cast<const T*>(p.dy);
    T* da = static_cast<T*>(p.da);
    T* db = static_cast<T*>(p.db);
    const bool vec = aligned16(a) && aligned16(b) && aligned16(dy) && aligned16(da) &&
                     aligned16(db) && (p.cols % 8 == 0) && (p.ld % 8 == 0);
    grid_loop(
        p.rows * p.cols, vec,
        [&](i64 i) {
            const i64 o = in_offset(i, p.cols, p.ld);
            float va[8], vb[8], vg[8], oa[8], ob[8];
            load8(a + o, va);
            load8(b + o, vb);
            load8(dy + i, vg);
#pragma unroll
            for (int k = 0; k < 8; ++k) swiglu_grad(va[k], vb[k], vg[k], oa[k], ob[k]);
            store8(da + o, oa);
            store8(db + o, ob);
        },
        [&](i64 i) {
            const i64 o = in_offset(i, p.cols, p.ld);
            float ga, gb;
            swiglu_grad(ld1(a + o), ld1(b + o), ld1(dy + i), ga, gb);
            st1(da + o, ga);
            st1(db + o, gb);
        });
}

// ---------------------------------------------------------------- fill, cast, accumulate

template <typename T>
TPAR_DEVICE void fill(const EwFillArgs& a) {
    T* y = static_cast<T*>(a.y);
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = a.value;
    grid_loop(
        a.n, aligned16(y), [&](i64 i) { store8(y + i, v); }, [&](i64 i) { st1(y + i, a.value); });
}

template <typename S, typename D>
TPAR_DEVICE void cast(const EwCastArgs& a) {
    const S* src = static_cast<const S*>(a.src);
    D* dst = static_cast<D*>(a.dst);
    grid_loop(
        a.n, aligned16(src) && aligned16(dst),
        [&](i64 i) {
            float v[8];
            load8(src + i, v);
            store8(dst + i, v);
        },
        [&](i64 i) { st1(dst + i, ld1(src + i)); });
}

template <typename S, typename D>
TPAR_DEVICE void accumulate(const EwAccumulateArgs& a) {
    const S* src = static_cast<const S*>(a.src);
    D* dst = static_cast<D*>(a.dst);
    const float alpha = a.alpha;
    grid_loop(
        a.n, aligned16(src) && aligned16(dst),
        [&](i64 i) {
            float vs[8], vd[8];
            load8(src + i, vs);
            load8(dst + i, vd);
#pragma unroll
            for (int k = 0; k < 8; ++k) vd[k] += alpha * vs[k];
            store8(dst + i, vd);
        },
        [&](i64 i) { st1(dst + i, ld1(dst + i) + alpha * ld1(src + i)); });
}

// ---------------------------------------------------------------- softmax
//
// Rows of up to 1024 elements: one warp per row, the row held in registers
// (V slots of 8 per lane). Longer rows: one block per row, two passes over
// global memory with an online max / sum in the first.

// Element of slot (k, j) of lane `lane`: with `vec`, 8 consecutive elements
// per slot (16-byte loads); otherwise strided by 32 so lanes stay coalesced.
TPAR_DEVICE i64 warp_slot(bool vec, int k, int j, int lane) {
    return vec ? (i64)((k * 32 + lane) * 8 + j) : (i64)(k * 256 + j * 32 + lane);
}

template <typename T, int V>
TPAR_DEVICE void warp_load(const T* row, i64 cols, bool vec, int lane, float v[V][8], float fill) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
        if (vec) {
            const i64 e = warp_slot(true, k, 0, lane);
            if (e < cols) {
                load8(row + e, v[k]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[k][j] = fill;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const i64 e = warp_slot(false, k, j, lane);
                v[k][j] = e < cols ? ld1(row + e) : fill;
            }
        }
    }
}

template <typename T, int V>
TPAR_DEVICE void warp_store(T* row, i64 cols, bool vec, int lane, const float v[V][8]) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
        if (vec) {
            const i64 e = warp_slot(true, k, 0, lane);
            if (e < cols) store8(row + e, v[k]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const i64 e = warp_slot(false, k, j, lane);
                if (e < cols) st1(row + e, v[k][j]);
            }
        }
    }
}

template <typename T, int V>
TPAR_DEVICE void softmax_fwd_warp_run(const EwSoftmaxFwdArgs& a) {
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    const int lane = threadIdx.x % TPAR_WARP;
    const i64 warps = (i64)blockDim.x / TPAR_WARP;
    const i64 first = (i64)blockIdx.x * warps + threadIdx.x / TPAR_WARP;
    const i64 step = (i64)gridDim.x * warps;
    const bool vec = aligned16(x) && aligned16(y) && a.cols % 8 == 0;
    const float ninf = -tpar_inf();
    for (i64 r = first; r < a.rows; r += step) {
        float v[V][8];
        warp_load<T, V>(x + r * a.cols, a.cols, vec, lane, v, ninf);
        float m = ninf;
#pragma unroll
        for (int k = 0; k < V; ++k)
#pragma unroll
            for (int j = 0; j < 8; ++j) m = fmaxf(m, v[k][j]);
        m = warp_max(m);
        if (m == ninf) {
            // fully masked row: probability zero
            const float z = a.log ? ninf : 0.0f;
#pragma unroll
            for (int k = 0; k < V; ++k)
#pragma unroll
                for (int j = 0; j < 8; ++j) v[k][j] = z;
        } else {
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < V; ++k)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    v[k][j] -= m;
                    s += expf(v[k][j]);  // padding is -inf: exp gives 0
                }
            s = warp_sum(s);
            if (a.log) {
                const float ls = logf(s);
#pragma unroll
                for (int k = 0; k < V; ++k)
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[k][j] -= ls;
            } else {
                const float inv = 1.0f / s;
#pragma unroll
                for (int k = 0; k < V; ++k)
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[k][j] = expf(v[k][j]) * inv;
            }
        }
        warp_store<T, V>(y + r * a.cols, a.cols, vec, lane, v);
    }
}

template <typename T>
TPAR_DEVICE void softmax_fwd_warp(const EwSoftmaxFwdArgs& a) {
    if (a.cols <= 256) {
        softmax_fwd_warp_run<T, 1>(a);
    } else if (a.cols <= 512) {
        softmax_fwd_warp_run<T, 2>(a);
    } else if (a.cols <= 1024) {
        softmax_fwd_warp_run<T, 4>(a);
    }
}

template <typename T, int V>
TPAR_DEVICE void softmax_bwd_warp_run(const EwSoftmaxBwdArgs& a) {
    const T* y = static_cast<const T*>(a.y);
    const T* dy = static_cast<const T*>(a.dy);
    T* dx = static_cast<T*>(a.dx);
    const int lane = threadIdx.x % TPAR_WARP;
    const i64 warps = (i64)blockDim.x / TPAR_WARP;
    const i64 first = (i64)blockIdx.x * warps + threadIdx.x / TPAR_WARP;
    const i64 step = (i64)gridDim.x * warps;
    const bool vec = aligned16(y) && aligned16(dy) && aligned16(dx) && a.cols % 8 == 0;
    for (i64 r = first; r < a.rows; r += step) {
        float vy[V][8], vg[V][8];
        warp_load<T, V>(y + r * a.cols, a.cols, vec, lane, vy, 0.0f);
        warp_load<T, V>(dy + r * a.cols, a.cols, vec, lane, vg, 0.0f);
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < V; ++k)
#pragma unroll
            for (int j = 0; j < 8; ++j) s += a.log ? vg[k][j] : vg[k][j] * vy[k][j];
        s = warp_sum(s);
#pragma unroll
        for (int k = 0; k < V; ++k)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                vg[k][j] = a.log ? vg[k][j] - expf(vy[k][j]) * s : vy[k][j] * (vg[k][j] - s);
        warp_store<T, V>(dx + r * a.cols, a.cols, vec, lane, vg);
    }
}

template <typename T>
TPAR_DEVICE void softmax_bwd_warp(const EwSoftmaxBwdArgs& a) {
    if (a.cols <= 256) {
        softmax_bwd_warp_run<T, 1>(a);
    } else if (a.cols <= 512) {
        softmax_bwd_warp_run<T, 2>(a);
    } else if (a.cols <= 1024) {
        softmax_bwd_warp_run<T, 4>(a);
    }
}

// Calls f(e, v) for every element e of a row, v its value, by the block's
// threads: 8 consecutive elements per step when `vec`, else one.
template <typename T, typename F>
TPAR_DEVICE void block_row_each(const T* row, i64 cols, bool vec, F f) {
    if (vec) {
        for (i64 c = threadIdx.x; c * 8 < cols; c += blockDim.x) {
            float v[8];
            load8(row + c * 8, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) f(c * 8 + j, v[j]);
        }
    } else {
        for (i64 e = threadIdx.x; e < cols; e += blockDim.x) f(e, ld1(row + e));
    }
}

// Online max / sum: folds x into (m, s) with s the sum of exp(x - m).
TPAR_DEVICE void online_add(float& m, float& s, float x) {
    if (x > m) {
        s = s * expf(m - x) + 1.0f;  // exp(-inf) = 0 when m was -inf
        m = x;
    } else if (x != -tpar_inf()) {
        s += expf(x - m);
    }
}

template <typename T>
TPAR_DEVICE void softmax_fwd_block(const EwSoftmaxFwdArgs& a) {
    __shared__ float scratch[33];
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    const bool vec = aligned16(x) && aligned16(y) && a.cols % 8 == 0;
    const float ninf = -tpar_inf();
    for (i64 r = blockIdx.x; r < a.rows; r += gridDim.x) {
        const T* xr = x + r * a.cols;
        T* yr = y + r * a.cols;
        float m = ninf, s = 0.0f;
        block_row_each(xr, a.cols, vec, [&](i64, float v) { online_add(m, s, v); });
        const float mall = block_max(m, scratch);
        const float sall = block_sum(m == ninf ? 0.0f : s * expf(m - mall), scratch);
        const float ls = logf(sall), inv = 1.0f / sall;
        const bool masked = mall == ninf;
        auto out = [&](float v) {
            if (masked) return a.log ? ninf : 0.0f;
            return a.log ? (v - mall) - ls : expf(v - mall) * inv;
        };
        if (vec) {
            for (i64 c = threadIdx.x; c * 8 < a.cols; c += blockDim.x) {
                float v[8];
                load8(xr + c * 8, v);
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = out(v[j]);
                store8(yr + c * 8, v);
            }
        } else {
            for (i64 e = threadIdx.x; e < a.cols; e += blockDim.x) st1(yr + e, out(ld1(xr + e)));
        }
    }
}

template <typename T>
TPAR_DEVICE void softmax_bwd_block(const EwSoftmaxBwdArgs& a) {
    __shared__ float scratch[33];
    const T* y = static_cast<const T*>(a.y);
    const T* dy = static_cast<const T*>(a.dy);
    T* dx = static_cast<T*>(a.dx);
    const bool vec = aligned16(y) && aligned16(dy) && aligned16(dx) && a.cols % 8 == 0;
    for (i64 r = blockIdx.x; r < a.rows; r += gridDim.x) {
        const T* yr = y + r * a.cols;
        const T* gr = dy + r * a.cols;
        T* xr = dx + r * a.cols;
        float s = 0.0f;
        if (vec) {
            for (i64 c = threadIdx.x; c * 8 < a.cols; c += blockDim.x) {
                float vg[8], vy[8];
                load8(gr + c * 8, vg);
                if (!a.log) load8(yr + c * 8, vy);
#pragma unroll
                for (int j = 0; j < 8; ++j) s += a.log ? vg[j] : vg[j] * vy[j];
            }
        } else {
            for (i64 e = threadIdx.x; e < a.cols; e += blockDim.x) {
                const float g = ld1(gr + e);
                s += a.log ? g : g * ld1(yr + e);
            }
        }
        s = block_sum(s, scratch);
        if (vec) {
            for (i64 c = threadIdx.x; c * 8 < a.cols; c += blockDim.x) {
                float vg[8], vy[8];
                load8(gr + c * 8, vg);
                load8(yr + c * 8, vy);
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    vg[j] = a.log ? vg[j] - expf(vy[j]) * s : vy[j] * (vg[j] - s);
                store8(xr + c * 8, vg);
            }
        } else {
            for (i64 e = threadIdx.x; e < a.cols; e += blockDim.x) {
                const float g = ld1(gr + e), yv = ld1(yr + e);
                st1(xr + e, a.log ? g - expf(yv) * s : yv * (g - s));
            }
        }
    }
}

}  // namespace elementwise

// ---------------------------------------------------------------- kernels
// Written out one by one (no token pasting) so each name appears literally.

TPAR_KERNEL(tpar_unary_f32, EwUnaryArgs, 1024) { elementwise::unary<float>(args); }
TPAR_KERNEL(tpar_unary_bf16, EwUnaryArgs, 1024) { elementwise::unary<bf16>(args); }
TPAR_KERNEL(tpar_unary_f16, EwUnaryArgs, 1024) { elementwise::unary<f16>(args); }

TPAR_KERNEL(tpar_unary_bwd_f32, EwUnaryBwdArgs, 1024) { elementwise::unary_bwd<float>(args); }
TPAR_KERNEL(tpar_unary_bwd_bf16, EwUnaryBwdArgs, 1024) { elementwise::unary_bwd<bf16>(args); }
TPAR_KERNEL(tpar_unary_bwd_f16, EwUnaryBwdArgs, 1024) { elementwise::unary_bwd<f16>(args); }

TPAR_KERNEL(tpar_scalar_f32, EwScalarArgs, 1024) { elementwise::scalar<float>(args); }
TPAR_KERNEL(tpar_scalar_bf16, EwScalarArgs, 1024) { elementwise::scalar<bf16>(args); }
TPAR_KERNEL(tpar_scalar_f16, EwScalarArgs, 1024) { elementwise::scalar<f16>(args); }

TPAR_KERNEL(tpar_binary_f32, EwBinaryArgs, 1024) { elementwise::binary<float>(args); }
TPAR_KERNEL(tpar_binary_bf16, EwBinaryArgs, 1024) { elementwise::binary<bf16>(args); }
TPAR_KERNEL(tpar_binary_f16, EwBinaryArgs, 1024) { elementwise::binary<f16>(args); }

TPAR_KERNEL(tpar_binary_bcast_f32, EwBinaryBcastArgs, 1024) { elementwise::binary_bcast<float>(args); }
TPAR_KERNEL(tpar_binary_bcast_bf16, EwBinaryBcastArgs, 1024) { elementwise::binary_bcast<bf16>(args); }
TPAR_KERNEL(tpar_binary_bcast_f16, EwBinaryBcastArgs, 1024) { elementwise::binary_bcast<f16>(args); }

TPAR_KERNEL(tpar_swiglu_fwd_f32, EwSwigluFwdArgs, 1024) { elementwise::swiglu_fwd<float>(args); }
TPAR_KERNEL(tpar_swiglu_fwd_bf16, EwSwigluFwdArgs, 1024) { elementwise::swiglu_fwd<bf16>(args); }
TPAR_KERNEL(tpar_swiglu_fwd_f16, EwSwigluFwdArgs, 1024) { elementwise::swiglu_fwd<f16>(args); }

TPAR_KERNEL(tpar_swiglu_bwd_f32, EwSwigluBwdArgs, 1024) { elementwise::swiglu_bwd<float>(args); }
TPAR_KERNEL(tpar_swiglu_bwd_bf16, EwSwigluBwdArgs, 1024) { elementwise::swiglu_bwd<bf16>(args); }
TPAR_KERNEL(tpar_swiglu_bwd_f16, EwSwigluBwdArgs, 1024) { elementwise::swiglu_bwd<f16>(args); }

TPAR_KERNEL(tpar_fill_f32, EwFillArgs, 1024) { elementwise::fill<float>(args); }
TPAR_KERNEL(tpar_fill_bf16, EwFillArgs, 1024) { elementwise::fill<bf16>(args); }
TPAR_KERNEL(tpar_fill_f16, EwFillArgs, 1024) { elementwise::fill<f16>(args); }

TPAR_KERNEL(tpar_softmax_fwd_warp_f32, EwSoftmaxFwdArgs, 256) { elementwise::softmax_fwd_warp<float>(args); }
TPAR_KERNEL(tpar_softmax_fwd_warp_bf16, EwSoftmaxFwdArgs, 256) { elementwise::softmax_fwd_warp<bf16>(args); }
TPAR_KERNEL(tpar_softmax_fwd_warp_f16, EwSoftmaxFwdArgs, 256) { elementwise::softmax_fwd_warp<f16>(args); }

TPAR_KERNEL(tpar_softmax_bwd_warp_f32, EwSoftmaxBwdArgs, 256) { elementwise::softmax_bwd_warp<float>(args); }
TPAR_KERNEL(tpar_softmax_bwd_warp_bf16, EwSoftmaxBwdArgs, 256) { elementwise::softmax_bwd_warp<bf16>(args); }
TPAR_KERNEL(tpar_softmax_bwd_warp_f16, EwSoftmaxBwdArgs, 256) { elementwise::softmax_bwd_warp<f16>(args); }

TPAR_KERNEL(tpar_softmax_fwd_block_f32, EwSoftmaxFwdArgs, 1024) { elementwise::softmax_fwd_block<float>(args); }
TPAR_KERNEL(tpar_softmax_fwd_block_bf16, EwSoftmaxFwdArgs, 1024) { elementwise::softmax_fwd_block<bf16>(args); }
TPAR_KERNEL(tpar_softmax_fwd_block_f16, EwSoftmaxFwdArgs, 1024) { elementwise::softmax_fwd_block<f16>(args); }

TPAR_KERNEL(tpar_softmax_bwd_block_f32, EwSoftmaxBwdArgs, 1024) { elementwise::softmax_bwd_block<float>(args); }
TPAR_KERNEL(tpar_softmax_bwd_block_bf16, EwSoftmaxBwdArgs, 1024) { elementwise::softmax_bwd_block<bf16>(args); }
TPAR_KERNEL(tpar_softmax_bwd_block_f16, EwSoftmaxBwdArgs, 1024) { elementwise::softmax_bwd_block<f16>(args); }

// Casts tpar_cast_<src>_<dst> (round to nearest even).
TPAR_KERNEL(tpar_cast_f32_f32, EwCastArgs, 1024) { elementwise::cast<float, float>(args); }
TPAR_KERNEL(tpar_cast_bf16_f32, EwCastArgs, 1024) { elementwise::cast<bf16, float>(args); }
TPAR_KERNEL(tpar_cast_f16_f32, EwCastArgs, 1024) { elementwise::cast<f16, float>(args); }
TPAR_KERNEL(tpar_cast_i64_f32, EwCastArgs, 1024) { elementwise::cast<i64, float>(args); }
TPAR_KERNEL(tpar_cast_f32_bf16, EwCastArgs, 1024) { elementwise::cast<float, bf16>(args); }
TPAR_KERNEL(tpar_cast_bf16_bf16, EwCastArgs, 1024) { elementwise::cast<bf16, bf16>(args); }
TPAR_KERNEL(tpar_cast_f16_bf16, EwCastArgs, 1024) { elementwise::cast<f16, bf16>(args); }
TPAR_KERNEL(tpar_cast_i64_bf16, EwCastArgs, 1024) { elementwise::cast<i64, bf16>(args); }
TPAR_KERNEL(tpar_cast_f32_f16, EwCastArgs, 1024) { elementwise::cast<float, f16>(args); }
TPAR_KERNEL(tpar_cast_bf16_f16, EwCastArgs, 1024) { elementwise::cast<bf16, f16>(args); }
TPAR_KERNEL(tpar_cast_f16_f16, EwCastArgs, 1024) { elementwise::cast<f16, f16>(args); }
TPAR_KERNEL(tpar_cast_i64_f16, EwCastArgs, 1024) { elementwise::cast<i64, f16>(args); }

// Accumulation tpar_accumulate_<src>_<dst>: dst += alpha * src (e.g. bf16
// gradients into f32 ones).
TPAR_KERNEL(tpar_accumulate_f32_f32, EwAccumulateArgs, 1024) {
    elementwise::accumulate<float, float>(args);
}
TPAR_KERNEL(tpar_accumulate_bf16_f32, EwAccumulateArgs, 1024) {
    elementwise::accumulate<bf16, float>(args);
}
TPAR_KERNEL(tpar_accumulate_f16_f32, EwAccumulateArgs, 1024) {
    elementwise::accumulate<f16, float>(args);
}
TPAR_KERNEL(tpar_accumulate_f32_bf16, EwAccumulateArgs, 1024) {
    elementwise::accumulate<float, bf16>(args);
}
TPAR_KERNEL(tpar_accumulate_bf16_bf16, EwAccumulateArgs, 1024) {
    elementwise::accumulate<bf16, bf16>(args);
}
TPAR_KERNEL(tpar_accumulate_f16_bf16, EwAccumulateArgs, 1024) {
    elementwise::accumulate<f16, bf16>(args);
}
TPAR_KERNEL(tpar_accumulate_f32_f16, EwAccumulateArgs, 1024) {
    elementwise::accumulate<float, f16>(args);
}
TPAR_KERNEL(tpar_accumulate_bf16_f16, EwAccumulateArgs, 1024) {
    elementwise::accumulate<bf16, f16>(args);
}
TPAR_KERNEL(tpar_accumulate_f16_f16, EwAccumulateArgs, 1024) {
    elementwise::accumulate<f16, f16>(args);
}
