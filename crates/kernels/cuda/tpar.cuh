// tpar CUDA prelude: prepended to every kernel source, both when NVRTC compiles
// it for a GPU and when the CPU emulator (emu/emu.h, TPAR_EMU defined) compiles
// it with the host C++ compiler. Kernels use only what is declared here plus
// plain CUDA C++ (threadIdx, blockIdx, blockDim, gridDim, __shared__,
// __syncthreads, __shfl_*_sync, atomicAdd), so the same text runs in both.
//
// Conventions:
// - Every kernel takes one POD argument struct by value and is declared with
//   TPAR_KERNEL(name, ArgsType, max_threads) { ... body uses `args` ... }.
//   The Rust side mirrors the struct with #[repr(C)]; pointers are 8 bytes.
// - Element types: float, bf16, f16 (16-bit storage structs). Math is in f32:
//   to_f32(x) widens, from_f32<T>(v) rounds to nearest even.
// - Dynamic shared memory is `tpar_dyn_smem` (16-byte aligned bytes).
// - Kernel names are tpar_<op>[_<variant>]_<dtype> and unique across files;
//   helpers live in a namespace named after the file.


#ifndef TPAR_EMU
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;
#define TPAR_DEVICE __device__ __forceinline__
#define TPAR_KERNEL(name, ArgsT, max_threads)                                   \
    extern "C" __global__ void __launch_bounds__(max_threads) name(const ArgsT args)
extern __shared__ __align__(16) unsigned char tpar_dyn_smem[];
#endif

#define TPAR_WARP 32
#define TPAR_FULL_MASK 0xffffffffu

// ---------------------------------------------------------------- elements

struct bf16 {
    u16 bits;
};
struct f16 {
    u16 bits;
};

TPAR_DEVICE float tpar_inf() { return __int_as_float(0x7f800000); }

TPAR_DEVICE float to_f32(float x) { return x; }
TPAR_DEVICE float to_f32(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }

TPAR_DEVICE u16 tpar_f32_to_bf16_bits(float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
        return (u16)((u >> 16) | 0x0040u);  // quiet NaN
    }
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);
    return (u16)((u + rounding) >> 16);
}

#ifndef TPAR_EMU
TPAR_DEVICE float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
TPAR_DEVICE u16 tpar_f32_to_f16_bits(float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
#else
TPAR_DEVICE float to_f32(f16 x) { return tpar_emu_f16_to_f32(x.bits); }
TPAR_DEVICE u16 tpar_f32_to_f16_bits(float v) { return tpar_emu_f32_to_f16(v); }
#endif

template <typename T>
TPAR_DEVICE T from_f32(float v);
template <>
TPAR_DEVICE float from_f32<float>(float v) {
    return v;
}
template <>
TPAR_DEVICE bf16 from_f32<bf16>(float v) {
    bf16 r;
    r.bits = tpar_f32_to_bf16_bits(v);
    return r;
}
template <>
TPAR_DEVICE f16 from_f32<f16>(float v) {
    f16 r;
    r.bits = tpar_f32_to_f16_bits(v);
    return r;
}

// Two 16-bit values packed into one 32-bit register, `lo` in the low half
// (the layout mma.sync fragments use).
TPAR_DEVICE u32 tpar_pack2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }
template <typename T>
TPAR_DEVICE u32 pack2_f32(float lo, float hi) {
    return tpar_pack2(from_f32<T>(lo).bits, from_f32<T>(hi).bits);
}

// ---------------------------------------------------------------- 16-byte vectors
//
// Raw16 is one 16-byte access. Pack16<T> converts one to and from N = 4 f32
// or 8 bf16/f16 values widened to f32 (element i of a 32-bit word pair in
// the low half first); load8 / store8 move 8 consecutive elements at a
// 16-byte aligned address.

struct alignas(16) Raw16 {
    u32 w[4];
};

TPAR_DEVICE bool aligned16(const void* p) { return ((u64)p & 15u) == 0; }

// Elements of `elem` bytes from p up to the next 16-byte boundary, at most n.
TPAR_DEVICE i64 head16(const void* p, i64 n, int elem) {
    const i64 h = (i64)(((16u - (u32)((u64)p & 15u)) & 15u) / (u32)elem);
    return h < n ? h : n;
}

template <typename T>
struct Pack16;
template <>
struct Pack16<float> {
    static constexpr int N = 4;
    static TPAR_DEVICE void unpack(const Raw16& r, float* e) {
#pragma unroll
        for (int i = 0; i < 4; ++i) e[i] = __uint_as_float(r.w[i]);
    }
    static TPAR_DEVICE Raw16 pack(const float* e) {
        Raw16 r;
#pragma unroll
        for (int i = 0; i < 4; ++i) r.w[i] = __float_as_uint(e[i]);
        return r;
    }
};
template <typename H>
struct Pack16Half {
    static constexpr int N = 8;
    static TPAR_DEVICE void unpack(const Raw16& r, float* e) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            H lo, hi;
            lo.bits = (u16)(r.w[i] & 0xffffu);
            hi.bits = (u16)(r.w[i] >> 16);
            e[2 * i] = to_f32(lo);
            e[2 * i + 1] = to_f32(hi);
        }
    }
    static TPAR_DEVICE Raw16 pack(const float* e) {
        Raw16 r;
#pragma unroll
        for (int i = 0; i < 4; ++i) r.w[i] = pack2_f32<H>(e[2 * i], e[2 * i + 1]);
        return r;
    }
};
template <>
struct Pack16<bf16> : Pack16Half<bf16> {};
template <>
struct Pack16<f16> : Pack16Half<f16> {};

// 8 elements at p (16-byte aligned) as f32, and back (rounded).
template <typename T>
TPAR_DEVICE void load8(const T* p, float e[8]) {
    constexpr int N = Pack16<T>::N;
    const Raw16* r = reinterpret_cast<const Raw16*>(p);
#pragma unroll
    for (int k = 0; k < 8 / N; ++k) Pack16<T>::unpack(r[k], e + k * N);
}
template <typename T>
TPAR_DEVICE void store8(T* p, const float e[8]) {
    constexpr int N = Pack16<T>::N;
    Raw16* r = reinterpret_cast<Raw16*>(p);
#pragma unroll
    for (int k = 0; k < 8 / N; ++k) r[k] = Pack16<T>::pack(e + k * N);
}

// Calls f(index, values, count) over p[0..n), thread t of nt: the unaligned
// head and tail one element at a time, the 16-byte aligned body a vector at a
// time. Indices passed to f increase within a thread.
template <typename T, typename F>
TPAR_DEVICE void for_each_chunk(const T* p, i64 n, int t, int nt, F&& f) {
    constexpr int N = Pack16<T>::N;
    const i64 head = head16(p, n, sizeof(T));
    for (i64 i = t; i < head; i += nt) {
        float e = to_f32(p[i]);
        f(i, &e, 1);
    }
    const i64 nv = (n - head) / N;
    const Raw16* v = reinterpret_cast<const Raw16*>(p + head);
    for (i64 k = t; k < nv; k += nt) {
        float e[N];
        Pack16<T>::unpack(v[k], e);
        f(head + k * N, e, N);
    }
    for (i64 i = head + nv * N + t; i < n; i += nt) {
        float e = to_f32(p[i]);
        f(i, &e, 1);
    }
}

// ---------------------------------------------------------- multi-tensor

// A multi-tensor launch (multi.cu, adamw.cu; PyTorch's foreach ops) covers up
// to TPAR_MULTI_MAX tensors: tensor t's elements are cut into chunks of
// TPAR_MULTI_CHUNK, one block each, blocks [first[t], first[t + 1]) of the
// grid (empty tensors have none).
#define TPAR_MULTI_MAX 32
#define TPAR_MULTI_CHUNK 16384

// Block b's tensor and its element range [begin, end) in it.
struct MultiChunk {
    int t;
    i64 begin, end;
};

TPAR_DEVICE MultiChunk multi_chunk(const i32* first, const i64* n, int count, int b) {
    int t = 0;
    while (t + 1 < count && first[t + 1] <= b) ++t;
    const i64 begin = (i64)(b - first[t]) * TPAR_MULTI_CHUNK;
    i64 end = begin + TPAR_MULTI_CHUNK;
    if (end > n[t]) end = n[t];
    return {t, begin, end < begin ? begin : end};
}

// ---------------------------------------------------------------- reductions

TPAR_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(TPAR_FULL_MASK, v, o);
    return v;
}

TPAR_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(TPAR_FULL_MASK, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the total. `scratch` is shared memory of at least 33 floats.
// Starts and ends with a barrier, so it can be called repeatedly.
TPAR_DEVICE float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % TPAR_WARP, warp = threadIdx.x / TPAR_WARP;
    const int nwarps = blockDim.x / TPAR_WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nwarps ? scratch[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
}

// Max over the whole block; same contract as block_sum.
TPAR_DEVICE float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % TPAR_WARP, warp = threadIdx.x / TPAR_WARP;
    const int nwarps = blockDim.x / TPAR_WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nwarps ? scratch[lane] : -tpar_inf();
        t = warp_max(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
}

// ---------------------------------------------------------------- tensor cores
//
// mma.sync m16n8k16 with f32 accumulation: d += A(16x16) * B(16x8).
// Fragment layouts (lane = 4 * group + tig):
//   a[0] = A[group][2tig..2tig+1]     a[1] = A[group+8][2tig..]
//   a[2] = A[group][2tig+8..]         a[3] = A[group+8][2tig+8..]
//   b[0] = B[2tig..2tig+1][group]     b[1] = B[2tig+8..][group]
//   d[0..1] = D[group][2tig..2tig+1]  d[2..3] = D[group+8][2tig..]
// ldmatrix: lanes 8i..8i+7 give the row addresses of 8x8 matrix i (16-byte
// rows in shared memory); register i receives the lane's fragment of matrix
// i (row lane/4, columns 2(lane%4)..+1), or of its transpose with _trans.

#ifndef TPAR_EMU
TPAR_DEVICE void mma_16816_bf16(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
TPAR_DEVICE void mma_16816_f16(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
TPAR_DEVICE u32 tpar_smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
TPAR_DEVICE void ldmatrix_x4(u32 r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tpar_smem_addr(p)));
}
TPAR_DEVICE void ldmatrix_x2(u32 r[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(tpar_smem_addr(p)));
}
TPAR_DEVICE void ldmatrix_x4_trans(u32 r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tpar_smem_addr(p)));
}
TPAR_DEVICE void ldmatrix_x2_trans(u32 r[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(tpar_smem_addr(p)));
}
// 16-byte asynchronous global -> shared copy; with pred false the 16 bytes
// are zero-filled and global memory is not read.
TPAR_DEVICE void cp_async_16(void* smem, const void* gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tpar_smem_addr(smem)),
                 "l"(gmem), "r"(pred ? 16 : 0));
}
TPAR_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
TPAR_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#else
TPAR_DEVICE void mma_16816_bf16(float d[4], const u32 a[4], const u32 b[2]) {
    tpar_emu_mma_16816(d, a, b, 0);
}
TPAR_DEVICE void mma_16816_f16(float d[4], const u32 a[4], const u32 b[2]) {
    tpar_emu_mma_16816(d, a, b, 1);
}
TPAR_DEVICE void ldmatrix_x4(u32 r[4], const void* p) { tpar_emu_ldmatrix(r, p, 4, false); }
TPAR_DEVICE void ldmatrix_x2(u32 r[2], const void* p) { tpar_emu_ldmatrix(r, p, 2, false); }
TPAR_DEVICE void ldmatrix_x4_trans(u32 r[4], const void* p) { tpar_emu_ldmatrix(r, p, 4, true); }
TPAR_DEVICE void ldmatrix_x2_trans(u32 r[2], const void* p) { tpar_emu_ldmatrix(r, p, 2, true); }
TPAR_DEVICE void cp_async_16(void* smem, const void* gmem, bool pred) {
    tpar_emu_cp_async_16(smem, gmem, pred);
}
TPAR_DEVICE void cp_async_commit() {}
template <int N>
TPAR_DEVICE void cp_async_wait() {}
#endif

template <typename T>
TPAR_DEVICE void mma_16816(float d[4], const u32 a[4], const u32 b[2]);
template <>
TPAR_DEVICE void mma_16816<bf16>(float d[4], const u32 a[4], const u32 b[2]) {
    mma_16816_bf16(d, a, b);
}
template <>
TPAR_DEVICE void mma_16816<f16>(float d[4], const u32 a[4], const u32 b[2]) {
    mma_16816_f16(d, a, b);
}
