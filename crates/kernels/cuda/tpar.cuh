// tpar CUDA prelude: prepended to every kernel source, both when NVRTC compiles
// it for a GPU and when the CPU emulator (emu/emu.h, TPAR_EMU defined) compiles
// it with the host C++ compiler. Kernels use only what is declared here plus
// plain CUDA C++ (threadIdx, blockIdx, blockDim, gridDim, __shared__,
// __syncthreads, __shfl_*_sync, atomicAdd), so the same text runs in both.
//
// Conventions:
// - Every kernel takes one POD argument struct by value and is declared with
//   TPAR_KERNEL(name, ArgsType, max_threads) { ... body uses `args` ... }
//   (max_threads, or TPAR_BOUNDS(max_threads, min_blocks) for an occupancy bound).
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
// TPAR_KERNEL's third argument for a kernel that must also fit `min_blocks`
// blocks of `max_threads` threads on an SM (ptxas then caps its registers):
// TPAR_KERNEL(name, ArgsT, TPAR_BOUNDS(512, 2)). The emulator keeps the first.
#define TPAR_BOUNDS(max_threads, min_blocks) max_threads, min_blocks
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

// Two floats rounded to nearest even into one register of two 16-bit
// values, `lo` in the low half: one cvt.rn.{bf16,f16}x2.f32 on a GPU (the
// same bits as pack2_f32 for every finite value; a NaN becomes the
// canonical one), pack2_f32 in the emulator.
template <typename T>
TPAR_DEVICE u32 pack2_rn(float lo, float hi) {
    return pack2_f32<T>(lo, hi);
}
#ifndef TPAR_EMU
template <>
TPAR_DEVICE u32 pack2_rn<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <>
TPAR_DEVICE u32 pack2_rn<f16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

// 2^x for a softmax: on a GPU one ex2.approx.ftz (a result below 2^-126,
// a probability far under the rounding of the sums it joins, flushes to
// zero; exp2f would add a rescale around it), exp2f in the emulator.
TPAR_DEVICE float exp2_ftz(float x) {
#ifndef TPAR_EMU
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

// ---------------------------------------------------------------- attention
//
// Element strides of one operand [batch, heads, len, dim] (dim contiguous);
// mirrored by raw::sdpa::SdpaOpStrides (sdpa.cu's kernels and
// sdpa_hopper_bwd.cu's).
struct SdpaOpStrides {
    i64 batch;
    i64 head;
    i64 row;
    // The offset of element (b, h, i, 0).
    TPAR_DEVICE i64 at(i64 b, i64 h, i64 i) const { return b * batch + h * head + i * row; }
};

// The strides of q (and dq), k (dk), v (dv) and out (dout); mirrored by
// raw::sdpa::SdpaArgStrides.
struct SdpaArgStrides {
    SdpaOpStrides q;
    SdpaOpStrides k;
    SdpaOpStrides v;
    SdpaOpStrides out;
};

// The argument struct of the attention backward's kernels (mirrored by
// raw::sdpa::SdpaBwdArgs): sdpa.cu's, and sdpa_hopper_bwd.cu's main kernel,
// which takes it inside SdpaHopperBwdArgs and runs sdpa.cu's pre and dq
// kernels around it.
struct SdpaBwdArgs {
    const void* q;
    const void* k;
    const void* v;
    const void* mask;  // null: no mask
    const void* out;
    const void* dout;
    const float* lse;
    float* delta;   // [batch * q_heads * q_len] workspace
    float* dq_acc;  // [batch * q_heads * q_len, head_dim] f32 workspace
    void* dq;
    void* dk;
    void* dv;
    i64 mask_bs;
    i64 mask_hs;
    i64 mask_rs;
    i32 batch;
    i32 q_heads;
    i32 kv_heads;
    i32 q_len;
    i32 kv_len;
    i32 head_dim;
    i32 v_dim;
    i32 causal;
    float scale;
    i32 pad;
};

// The Hopper attention kernels (sdpa_hopper.cu's forward, sdpa_hopper_bwd.cu's
// backward) are declared
//   TPAR_KERNEL(name, TPAR_GRID_CONSTANT(Args), TPAR_SDPA_HOPPER_BOUNDS) {
//       TPAR_SDPA_HOPPER_RUN(ns, T, HD);
//   }
// The body runs ns::run<T, HD>(args) where the build has wgmma (sm_90a, or the
// emulator) and is empty elsewhere: the launchers pick these kernels only
// where kernels are compiled for sm_90a. The bounds are 384 threads (a
// producer and two consumer warpgroups) and at least one block per SM: with
// the minimum given, ptxas knows the registers at entry, so that setmaxnreg
// applies (it may ignore setmaxnreg otherwise, C7508); the emulator takes the
// thread count alone.
#if defined(TPAR_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TPAR_SDPA_HOPPER_RUN(ns, T, HD) ns::run<T, HD>(args)
#else
#define TPAR_SDPA_HOPPER_RUN(ns, T, HD)
#endif
#ifndef TPAR_EMU
#define TPAR_SDPA_HOPPER_BOUNDS 384, 1
#else
#define TPAR_SDPA_HOPPER_BOUNDS 384
#endif

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
TPAR_DEVICE void cp_async_commit() { tpar_emu_cp_async_commit(); }
template <int N>
TPAR_DEVICE void cp_async_wait() {
    tpar_emu_cp_async_wait(N);
}
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

// ---------------------------------------------------------------- Hopper (sm_90a)
//
// Warpgroup MMA, bulk tensor copies (TMA) and mbarriers. On a GPU these are
// inline PTX and need the `sm_90a` target (wgmma and setmaxnreg do not exist
// for plain sm_90); in the emulator they are emu.cpp's. A warpgroup is 4
// consecutive warps (threads 128g..128g+127); warpgroup calls are made by
// all its 128 threads.
//
// mbarrier (a u64 in shared memory, 8-byte aligned): mbarrier_init(bar,
// count) by one thread, then a fence (fence_mbarrier_init, or
// __syncthreads) before others use it. A phase completes when `count`
// arrivals have come and the transaction bytes announced with expect_tx have
// all been delivered (by bulk copies' complete_tx); the phases alternate
// parity 0, 1, 0, ... starting at 0, and mbarrier_wait_parity(bar, p)
// returns once the phase of parity p has completed (on a fresh barrier,
// waiting for parity 1 returns at once: it is "the phase before"). On a GPU
// a wait that outlasts TPAR_MBAR_TIMEOUT_MS stops the kernel with an error
// (the watchdog, after wgmma_rs below).
//
// Tensor maps: a TparTensorMap (CUtensorMap: 128 bytes, 64-byte aligned) is
// built on the host (src/cuda/tensor_map.rs: the driver's
// cuTensorMapEncodeTiled on a GPU, an emulated encoding in the emulator) and
// passed inside the kernel's argument struct; declare such a kernel with
// TPAR_KERNEL(name, TPAR_GRID_CONSTANT(Args), threads), so the GPU build
// marks the parameter __grid_constant__ and the copies read the map where
// the launch put it (param space), as CUTLASS does. tma_load_2d(smem, map,
// x, y, bar) copies the box whose first element is at column x, row y
// (innermost coordinate first) into shared memory (128-byte aligned; 1024
// for the 128-byte swizzle), elements out of the tensor read as zeros, and
// performs complete_tx of the box's bytes on `bar`. tma_store_2d writes a
// box back (out-of-bounds elements are not written; tma_load_3d and
// tma_store_3d the same for 3-D maps, tma_load_4d and tma_store_4d for 4-D
// maps, x innermost); fence_proxy_async()
// first makes the threads' shared-memory writes visible to it, and
// tma_store_commit / tma_store_wait<N> track completion (tma_store_wait_read<N>
// only until the groups' shared-memory sources have been read, so they may
// be overwritten while the global writes go on). bulk_reduce_add_f32(gmem,
// smem, bytes) is the 1-D bulk reduction (cp.reduce.async.bulk ... add.f32:
// gmem[i] += smem[i] for bytes / 4 floats; both addresses 16-byte aligned,
// bytes a multiple of 16), in the same bulk groups: tma_store_commit closes a
// group, tma_store_wait_read<N> lets its shared source be reused. The
// emulator makes the reduction's reads at that wait (the latest moment
// allowed), so a source reused too early shows; a thread that exits with one
// pending is an error there.
//
// wgmma: wgmma_ss<T, N, TA, TB>(d, desc_a, desc_b, accumulate) computes
// D(64xN) = A(64x16) * B(16xN) (+ D when accumulate), T bf16 or f16, f32
// accumulators `d` (N / 2 per thread, the ISA's fragment: d[i] holds row
// 16 * warp_in_group + lane / 4 + 8 * (i / 2 % 2), column 8 * (i / 4) +
// 2 * (lane % 4) + i % 2); wgmma_rs<T, N, TB> takes A from registers (4
// per thread: a[j] packs elements 2j, 2j+1 of the ISA's A fragment, as
// mma_16816's). TA / TB: 0 K-major, 1 M/N-major (transposed). The shared
// operands are described by wgmma_desc(smem, lbo, sbo, mode) (byte offsets,
// mode TPAR_WG_SWIZZLE_*), the PTX ISA's canonical layouts. The call is
// asynchronous: wgmma_fence() before the first wgmma (and after the
// registers were written otherwise), wgmma_commit() closes a group,
// wgmma_wait<N>() waits until at most N groups are pending; the
// accumulators must not be read before that wait (the emulator fills them
// with NaN until then). GPU builds provide N in 16, 32, 64, 128, 192, 256;
// the emulator any multiple of 8 up to 256.
//
// Clusters: cluster_ctarank / cluster_nctarank, cluster_sync (every thread
// of every block of the cluster), cluster_map(p, rank) (the same shared
// object in block `rank`), mbarrier_arrive_cluster(bar, rank) and
// tma_load_2d_multicast(smem, map, x, y, bar, mask) (the box into the blocks
// of `mask`, complete_tx on each one's mbarrier at the offset of `bar`;
// tma_load_3d_multicast the same for 3-D maps).

// The 64-bit wgmma matrix descriptor's swizzle modes.
#define TPAR_WG_SWIZZLE_NONE 0
#define TPAR_WG_SWIZZLE_128B 1
#define TPAR_WG_SWIZZLE_64B 2
#define TPAR_WG_SWIZZLE_32B 3

struct alignas(64) TparTensorMap {
    u64 opaque[16];
};

#ifndef TPAR_EMU
#define TPAR_GRID_CONSTANT(T) __grid_constant__ T

TPAR_DEVICE u32 tpar_shared_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

TPAR_DEVICE void mbarrier_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tpar_shared_addr(bar)),
                 "r"(count)
                 : "memory");
}
TPAR_DEVICE void mbarrier_inval(u64* bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(tpar_shared_addr(bar)) : "memory");
}
TPAR_DEVICE u64 mbarrier_arrive(u64* bar) {
    u64 state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n"
                 : "=l"(state)
                 : "r"(tpar_shared_addr(bar))
                 : "memory");
    return state;
}
TPAR_DEVICE u64 mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
    u64 state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                 : "=l"(state)
                 : "r"(tpar_shared_addr(bar)), "r"(bytes)
                 : "memory");
    return state;
}
TPAR_DEVICE void mbarrier_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(
                     tpar_shared_addr(bar)),
                 "r"(bytes)
                 : "memory");
}
// One try: whether the phase of parity `parity` has completed (the thread
// may be suspended for a while first).
TPAR_DEVICE bool mbarrier_try_wait_parity(u64* bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.b32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(tpar_shared_addr(bar)), "r"(parity)
        : "memory");
    return ok != 0;
}
TPAR_DEVICE void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
TPAR_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

TPAR_DEVICE void tma_prefetch(const TparTensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)map) : "memory");
}
TPAR_DEVICE void tma_load_2d(void* smem, const TparTensorMap* map, int x, int y, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(tpar_shared_addr(smem)),
        "l"((u64)map), "r"(x), "r"(y), "r"(tpar_shared_addr(bar))
        : "memory");
}
TPAR_DEVICE void tma_store_2d(const TparTensorMap* map, int x, int y, const void* smem) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::
                     "l"((u64)map),
                 "r"(x), "r"(y), "r"(tpar_shared_addr(smem))
                 : "memory");
}
TPAR_DEVICE void tma_load_3d(void* smem, const TparTensorMap* map, int x, int y, int z, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(tpar_shared_addr(smem)),
        "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(tpar_shared_addr(bar))
        : "memory");
}
TPAR_DEVICE void tma_store_3d(const TparTensorMap* map, int x, int y, int z, const void* smem) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
            (u64)map),
        "r"(x), "r"(y), "r"(z), "r"(tpar_shared_addr(smem))
        : "memory");
}
TPAR_DEVICE void tma_load_4d(void* smem, const TparTensorMap* map, int x, int y, int z, int w,
                             u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(tpar_shared_addr(smem)),
        "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(w), "r"(tpar_shared_addr(bar))
        : "memory");
}
TPAR_DEVICE void tma_store_4d(const TparTensorMap* map, int x, int y, int z, int w,
                              const void* smem) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::
            "l"((u64)map),
        "r"(x), "r"(y), "r"(z), "r"(w), "r"(tpar_shared_addr(smem))
        : "memory");
}
// The box into shared memory of every block of the cluster in `mask` (bit =
// rank), at the same offset as `smem`, with complete_tx on each block's
// mbarrier at the offset of `bar`.
TPAR_DEVICE void tma_load_2d_multicast(void* smem, const TparTensorMap* map, int x, int y, u64* bar,
                                       u16 mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(tpar_shared_addr(smem)),
        "l"((u64)map), "r"(x), "r"(y), "r"(tpar_shared_addr(bar)), "h"(mask)
        : "memory");
}
// tma_load_2d_multicast for a 3-D map (x innermost).
TPAR_DEVICE void tma_load_3d_multicast(void* smem, const TparTensorMap* map, int x, int y, int z,
                                       u64* bar, u16 mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(tpar_shared_addr(smem)),
        "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(tpar_shared_addr(bar)), "h"(mask)
        : "memory");
}
TPAR_DEVICE void bulk_reduce_add_f32(float* gmem, const float* smem, u32 bytes) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
        "r"(tpar_shared_addr(smem)), "r"(bytes)
        : "memory");
}
TPAR_DEVICE void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N committed bulk store groups are pending.
template <int N>
TPAR_DEVICE void tma_store_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N committed bulk store groups have not yet read their
// shared-memory source.
template <int N>
TPAR_DEVICE void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

TPAR_DEVICE u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
TPAR_DEVICE u32 cluster_nctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return r;
}
// barrier.cluster: every thread of every block of the cluster.
TPAR_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
// The address of the same shared-memory object in block `rank` of the cluster.
template <typename T>
TPAR_DEVICE T* cluster_map(T* p, u32 rank) {
    u64 r;
    asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(r) : "l"((u64)p), "r"(rank));
    return reinterpret_cast<T*>(r);
}
// One arrival on the mbarrier at the offset of `bar` in block `rank`.
TPAR_DEVICE void mbarrier_arrive_cluster(u64* bar, u32 rank) {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(
            tpar_shared_addr(bar)),
        "r"(rank)
        : "memory");
}

template <int R>
TPAR_DEVICE void setmaxnreg_inc() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg: a multiple of 8 in 24..256");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
TPAR_DEVICE void setmaxnreg_dec() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg: a multiple of 8 in 24..256");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

TPAR_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
TPAR_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
TPAR_DEVICE void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

template <int N>
struct tpar_wgmma_n;
#define TPAR_WG_D16 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7" \
    "}"
#define TPAR_WG_OPS16(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
template <>
struct tpar_wgmma_n<16> {
    template <int TA, int TB>
    static TPAR_DEVICE void ss(bf16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 " TPAR_WG_D16
            ", %8, %9, p, 1, 1, %11, %12;\n}\n"
            : TPAR_WG_OPS16(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(bf16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 " TPAR_WG_D16
            ", {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n"
            : TPAR_WG_OPS16(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
    template <int TA, int TB>
    static TPAR_DEVICE void ss(f16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 " TPAR_WG_D16
            ", %8, %9, p, 1, 1, %11, %12;\n}\n"
            : TPAR_WG_OPS16(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(f16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 " TPAR_WG_D16
            ", {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n"
            : TPAR_WG_OPS16(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
};
#undef TPAR_WG_D16
#undef TPAR_WG_OPS16
#define TPAR_WG_D32 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "}"
#define TPAR_WG_OPS32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
template <>
struct tpar_wgmma_n<32> {
    template <int TA, int TB>
    static TPAR_DEVICE void ss(bf16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " TPAR_WG_D32
            ", %16, %17, p, 1, 1, %19, %20;\n}\n"
            : TPAR_WG_OPS32(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(bf16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " TPAR_WG_D32
            ", {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
            : TPAR_WG_OPS32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
    template <int TA, int TB>
    static TPAR_DEVICE void ss(f16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " TPAR_WG_D32
            ", %16, %17, p, 1, 1, %19, %20;\n}\n"
            : TPAR_WG_OPS32(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(f16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " TPAR_WG_D32
            ", {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
            : TPAR_WG_OPS32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
};
#undef TPAR_WG_D32
#undef TPAR_WG_OPS32
#define TPAR_WG_D64 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
    "}"
#define TPAR_WG_OPS64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
template <>
struct tpar_wgmma_n<64> {
    template <int TA, int TB>
    static TPAR_DEVICE void ss(bf16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TPAR_WG_D64
            ", %32, %33, p, 1, 1, %35, %36;\n}\n"
            : TPAR_WG_OPS64(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(bf16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TPAR_WG_D64
            ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
            : TPAR_WG_OPS64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
    template <int TA, int TB>
    static TPAR_DEVICE void ss(f16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " TPAR_WG_D64
            ", %32, %33, p, 1, 1, %35, %36;\n}\n"
            : TPAR_WG_OPS64(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(f16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " TPAR_WG_D64
            ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
            : TPAR_WG_OPS64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
};
#undef TPAR_WG_D64
#undef TPAR_WG_OPS64
#define TPAR_WG_D128 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
    "}"
#define TPAR_WG_OPS128(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
template <>
struct tpar_wgmma_n<128> {
    template <int TA, int TB>
    static TPAR_DEVICE void ss(bf16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " TPAR_WG_D128
            ", %64, %65, p, 1, 1, %67, %68;\n}\n"
            : TPAR_WG_OPS128(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(bf16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " TPAR_WG_D128
            ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
            : TPAR_WG_OPS128(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
    template <int TA, int TB>
    static TPAR_DEVICE void ss(f16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " TPAR_WG_D128
            ", %64, %65, p, 1, 1, %67, %68;\n}\n"
            : TPAR_WG_OPS128(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(f16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " TPAR_WG_D128
            ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
            : TPAR_WG_OPS128(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
};
#undef TPAR_WG_D128
#undef TPAR_WG_OPS128
#define TPAR_WG_D192 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
    "}"
#define TPAR_WG_OPS192(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
template <>
struct tpar_wgmma_n<192> {
    template <int TA, int TB>
    static TPAR_DEVICE void ss(bf16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 " TPAR_WG_D192
            ", %96, %97, p, 1, 1, %99, %100;\n}\n"
            : TPAR_WG_OPS192(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(bf16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 " TPAR_WG_D192
            ", {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n"
            : TPAR_WG_OPS192(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
    template <int TA, int TB>
    static TPAR_DEVICE void ss(f16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 " TPAR_WG_D192
            ", %96, %97, p, 1, 1, %99, %100;\n}\n"
            : TPAR_WG_OPS192(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(f16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 " TPAR_WG_D192
            ", {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n"
            : TPAR_WG_OPS192(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
};
#undef TPAR_WG_D192
#undef TPAR_WG_OPS192
#define TPAR_WG_D256 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
    "}"
#define TPAR_WG_OPS256(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
template <>
struct tpar_wgmma_n<256> {
    template <int TA, int TB>
    static TPAR_DEVICE void ss(bf16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " TPAR_WG_D256
            ", %128, %129, p, 1, 1, %131, %132;\n}\n"
            : TPAR_WG_OPS256(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(bf16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " TPAR_WG_D256
            ", {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
            : TPAR_WG_OPS256(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
    template <int TA, int TB>
    static TPAR_DEVICE void ss(f16, float* d, u64 da, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " TPAR_WG_D256
            ", %128, %129, p, 1, 1, %131, %132;\n}\n"
            : TPAR_WG_OPS256(d)
            : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)
            : "memory");
    }
    template <int TB>
    static TPAR_DEVICE void rs(f16, float* d, const u32* a, u64 db, int acc) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " TPAR_WG_D256
            ", {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
            : TPAR_WG_OPS256(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB)
            : "memory");
    }
};
#undef TPAR_WG_D256
#undef TPAR_WG_OPS256

template <typename T, int N, int TA, int TB>
TPAR_DEVICE void wgmma_ss(float* d, u64 desc_a, u64 desc_b, bool accumulate) {
    tpar_wgmma_n<N>::template ss<TA, TB>(T{}, d, desc_a, desc_b, accumulate ? 1 : 0);
}
template <typename T, int N, int TB>
TPAR_DEVICE void wgmma_rs(float* d, const u32 a[4], u64 desc_b, bool accumulate) {
    tpar_wgmma_n<N>::template rs<TB>(T{}, d, a, desc_b, accumulate ? 1 : 0);
}
#else
#define TPAR_GRID_CONSTANT(T) T

TPAR_DEVICE u32 tpar_shared_addr(const void* p) { return tpar_emu_smem_offset(p); }
TPAR_DEVICE void mbarrier_init(u64* bar, u32 count) { tpar_emu_mbar_init(bar, count); }
TPAR_DEVICE void mbarrier_inval(u64* bar) { tpar_emu_mbar_inval(bar); }
TPAR_DEVICE u64 mbarrier_arrive(u64* bar) { return tpar_emu_mbar_arrive(bar, 1, 0); }
TPAR_DEVICE u64 mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
    return tpar_emu_mbar_arrive(bar, 1, bytes);
}
TPAR_DEVICE void mbarrier_expect_tx(u64* bar, u32 bytes) { tpar_emu_mbar_expect_tx(bar, bytes); }
// The emulator blocks the thread until the phase completes (a wait that
// never can is reported as a deadlock).
TPAR_DEVICE bool mbarrier_try_wait_parity(u64* bar, u32 parity) {
    return tpar_emu_mbar_try_wait(bar, parity) != 0;
}
TPAR_DEVICE void fence_mbarrier_init() {}
TPAR_DEVICE void fence_proxy_async() { tpar_emu_fence_proxy_async(); }
TPAR_DEVICE void tma_prefetch(const TparTensorMap*) {}
TPAR_DEVICE void tma_load_2d(void* smem, const TparTensorMap* map, int x, int y, u64* bar) {
    const int c[2] = {x, y};
    tpar_emu_tma_load(smem, map, c, 2, bar);
}
TPAR_DEVICE void tma_store_2d(const TparTensorMap* map, int x, int y, const void* smem) {
    const int c[2] = {x, y};
    tpar_emu_tma_store(map, c, 2, smem);
}
TPAR_DEVICE void tma_load_3d(void* smem, const TparTensorMap* map, int x, int y, int z, u64* bar) {
    const int c[3] = {x, y, z};
    tpar_emu_tma_load(smem, map, c, 3, bar);
}
TPAR_DEVICE void tma_store_3d(const TparTensorMap* map, int x, int y, int z, const void* smem) {
    const int c[3] = {x, y, z};
    tpar_emu_tma_store(map, c, 3, smem);
}
TPAR_DEVICE void tma_load_4d(void* smem, const TparTensorMap* map, int x, int y, int z, int w,
                             u64* bar) {
    const int c[4] = {x, y, z, w};
    tpar_emu_tma_load(smem, map, c, 4, bar);
}
TPAR_DEVICE void tma_store_4d(const TparTensorMap* map, int x, int y, int z, int w,
                              const void* smem) {
    const int c[4] = {x, y, z, w};
    tpar_emu_tma_store(map, c, 4, smem);
}
TPAR_DEVICE void tma_load_2d_multicast(void* smem, const TparTensorMap* map, int x, int y, u64* bar,
                                       u16 mask) {
    const int c[2] = {x, y};
    tpar_emu_tma_load_multicast(smem, map, c, 2, bar, mask);
}
TPAR_DEVICE void tma_load_3d_multicast(void* smem, const TparTensorMap* map, int x, int y, int z,
                                       u64* bar, u16 mask) {
    const int c[3] = {x, y, z};
    tpar_emu_tma_load_multicast(smem, map, c, 3, bar, mask);
}
TPAR_DEVICE u32 cluster_ctarank() { return tpar_emu_cluster_ctarank(); }
TPAR_DEVICE u32 cluster_nctarank() { return tpar_emu_cluster_nctarank(); }
TPAR_DEVICE void cluster_sync() { tpar_emu_cluster_sync(); }
template <typename T>
TPAR_DEVICE T* cluster_map(T* p, u32 rank) {
    return static_cast<T*>(tpar_emu_mapa(p, rank));
}
TPAR_DEVICE void mbarrier_arrive_cluster(u64* bar, u32 rank) {
    tpar_emu_mbar_arrive(tpar_emu_mapa(bar, rank), 1, 0);
}
TPAR_DEVICE void bulk_reduce_add_f32(float* gmem, const float* smem, u32 bytes) {
    tpar_emu_bulk_reduce_add_f32(gmem, smem, bytes);
}
TPAR_DEVICE void tma_store_commit() { tpar_emu_bulk_commit(); }
template <int N>
TPAR_DEVICE void tma_store_wait() {
    tpar_emu_bulk_wait(N);
}
template <int N>
TPAR_DEVICE void tma_store_wait_read() {
    tpar_emu_bulk_wait(N);
}
template <int R>
TPAR_DEVICE void setmaxnreg_inc() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg: a multiple of 8 in 24..256");
    tpar_emu_setmaxnreg(R, 1);
}
template <int R>
TPAR_DEVICE void setmaxnreg_dec() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg: a multiple of 8 in 24..256");
    tpar_emu_setmaxnreg(R, 0);
}
TPAR_DEVICE void wgmma_fence() { tpar_emu_wgmma_fence(); }
TPAR_DEVICE void wgmma_commit() { tpar_emu_wgmma_commit(); }
template <int N>
TPAR_DEVICE void wgmma_wait() {
    tpar_emu_wgmma_wait(N);
}
template <typename T>
struct tpar_wgmma_f16;
template <>
struct tpar_wgmma_f16<bf16> {
    static constexpr int flag = 0;
};
template <>
struct tpar_wgmma_f16<f16> {
    static constexpr int flag = 1;
};
template <typename T, int N, int TA, int TB>
TPAR_DEVICE void wgmma_ss(float* d, u64 desc_a, u64 desc_b, bool accumulate) {
    tpar_emu_wgmma(d, N, nullptr, desc_a, desc_b,
                   tpar_wgmma_f16<T>::flag | (TA ? 2 : 0) | (TB ? 4 : 0) | (accumulate ? 8 : 0));
}
template <typename T, int N, int TB>
TPAR_DEVICE void wgmma_rs(float* d, const u32 a[4], u64 desc_b, bool accumulate) {
    tpar_emu_wgmma(d, N, a, 0, desc_b,
                   tpar_wgmma_f16<T>::flag | (TB ? 4 : 0) | (accumulate ? 8 : 0));
}
#endif

// The mbarrier watchdog: on a GPU a wait whose phase never completes (a
// wrong transaction count, a lost arrival) would spin until the process is
// killed. mbarrier_wait_parity therefore reads %globaltimer after its first
// failed try (the fast path reads no timer), and a wait longer than
// TPAR_MBAR_TIMEOUT_MS milliseconds (default 10000; `-DTPAR_MBAR_TIMEOUT_MS=...`
// through CompileOptions::define) stops the kernel with an exception: the
// launch fails with a sticky error, the CUDA context is lost
// (KernelError::ContextLost on the host, whose message names this watchdog)
// in seconds instead of a hang. Two choices keep the Hopper kernels' code as
// it was (ptxas: same registers, no stack frame, no spills):
// - the exception is `brkpt` (under cuda-gdb it stops at the stuck wait),
//   followed by a store to the null address, which faults should the
//   breakpoint not stop the thread; either way the launch fails with a
//   sticky error (not yet run on a GPU). Not `trap`: a `trap` in the
//   consumers' wait makes ptxas spill ~500 bytes of the attention forward's
//   accumulators and serialize its wgmma (C7512);
// - no device printf naming the block, thread and barrier: printf is a
//   function call, and a call in a kernel that issues wgmma makes ptxas
//   serialize the wgmma pipeline (C7510) and ignore setmaxnreg (C7507).
// Instead, the first thread of a module whose wait times out writes where it
// waited (the call's source line, the barrier, the parity, its block, thread,
// cluster rank and SM) into host memory the device can reach: page-locked,
// mapped memory whose device address the host stores in each module's
// `tpar_watchdog_report` when it loads the module (null: no report). The
// host reads it once the launch has failed (the context is lost, host memory
// is not) and adds it to the ContextLost error (src/cuda/device/watchdog.rs,
// which also fixes the record's layout: the TPAR_WATCHDOG_* word indices).
// Plain stores and one atomic on a device global: no call, no trap.
// The emulator keeps its own report: a wait that never can complete is a
// deadlock error there, naming the barrier.
#ifndef TPAR_MBAR_TIMEOUT_MS
#define TPAR_MBAR_TIMEOUT_MS 10000
#endif
#ifndef TPAR_EMU
static_assert(TPAR_MBAR_TIMEOUT_MS > 0 && TPAR_MBAR_TIMEOUT_MS <= 3600000,
              "TPAR_MBAR_TIMEOUT_MS must be in 1..=3600000 (milliseconds)");
// The timer in units of 2^20 ns (about 1.05 ms), 32 bits: one register
// across the wait loop.
TPAR_DEVICE u32 tpar_globaltimer_units() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return (u32)(t >> 20);
}
// The watchdog's record: 16 u32 words, the magic word written last.
enum {
    TPAR_WATCHDOG_MAGIC = 0,     // TPAR_WATCHDOG_WRITTEN once the rest is there
    TPAR_WATCHDOG_LINE = 1,      // the source line of the mbarrier_wait_parity call
    TPAR_WATCHDOG_BARRIER = 2,   // the barrier's shared-memory address
    TPAR_WATCHDOG_PARITY = 3,    // the parity waited for
    TPAR_WATCHDOG_BLOCK = 4,     // blockIdx x, y, z (words 4-6)
    TPAR_WATCHDOG_THREAD = 7,    // threadIdx x, y, z (words 7-9)
    TPAR_WATCHDOG_SM = 10,       // %smid
    TPAR_WATCHDOG_RANK = 11,     // %cluster_ctarank
    TPAR_WATCHDOG_STATE = 12,    // the barrier's 64-bit word, low then high (12-13)
    TPAR_WATCHDOG_TIMEOUT = 14,  // TPAR_MBAR_TIMEOUT_MS
    TPAR_WATCHDOG_WORDS = 16,
};
#define TPAR_WATCHDOG_WRITTEN 0x74706172u  // "tpar"
extern "C" {
// Set by the host to a record of mapped host memory (null: no report).
__device__ u32* tpar_watchdog_report = nullptr;
// Which thread of the module writes the record: the first to time out.
__device__ u32 tpar_watchdog_claimed = 0u;
}
// The watchdog's end (above): the record, then `brkpt`, then a store to the
// null address (it faults) should the breakpoint be resumed. The stored
// value (the barrier's shared address xor the parity) is for a debugger's
// eyes only.
TPAR_DEVICE void tpar_mbar_abort(u64* bar, u32 parity, u32 line) {
    const u32 addr = tpar_shared_addr(bar);
    u32* report = tpar_watchdog_report;
    if (report != nullptr && atomicAdd(&tpar_watchdog_claimed, 1u) == 0u) {
        volatile u32* r = report;
        u64 state;
        u32 sm, rank;
        // The barrier's word is opaque (its layout is undocumented); it is
        // read once, for the report, as the kernel stops.
        asm volatile("ld.volatile.shared.b64 %0, [%1];\n" : "=l"(state) : "r"(addr));
        asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
        asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
        r[TPAR_WATCHDOG_LINE] = line;
        r[TPAR_WATCHDOG_BARRIER] = addr;
        r[TPAR_WATCHDOG_PARITY] = parity;
        r[TPAR_WATCHDOG_BLOCK + 0] = blockIdx.x;
        r[TPAR_WATCHDOG_BLOCK + 1] = blockIdx.y;
        r[TPAR_WATCHDOG_BLOCK + 2] = blockIdx.z;
        r[TPAR_WATCHDOG_THREAD + 0] = threadIdx.x;
        r[TPAR_WATCHDOG_THREAD + 1] = threadIdx.y;
        r[TPAR_WATCHDOG_THREAD + 2] = threadIdx.z;
        r[TPAR_WATCHDOG_SM] = sm;
        r[TPAR_WATCHDOG_RANK] = rank;
        r[TPAR_WATCHDOG_STATE + 0] = (u32)state;
        r[TPAR_WATCHDOG_STATE + 1] = (u32)(state >> 32);
        r[TPAR_WATCHDOG_TIMEOUT] = (u32)TPAR_MBAR_TIMEOUT_MS;
        __threadfence_system();
        r[TPAR_WATCHDOG_MAGIC] = TPAR_WATCHDOG_WRITTEN;
        __threadfence_system();
    }
    asm volatile(
        "brkpt;\n"
        "st.volatile.global.u32 [%0], %1;\n" ::"l"(0ull),
        "r"(addr ^ parity)
        : "memory");
}

// Waits until the phase of parity `parity` of `bar` has completed; past
// TPAR_MBAR_TIMEOUT_MS, stops the kernel (the watchdog above), reporting
// `line` (by default the caller's source line).
TPAR_DEVICE void mbarrier_wait_parity(u64* bar, u32 parity, u32 line = __builtin_LINE()) {
    constexpr u32 limit = (u32)(((u64)TPAR_MBAR_TIMEOUT_MS * 1000000ull) >> 20) + 1u;
    if (mbarrier_try_wait_parity(bar, parity)) return;
    const u32 start = tpar_globaltimer_units();
    while (!mbarrier_try_wait_parity(bar, parity)) {
        if (tpar_globaltimer_units() - start > limit) tpar_mbar_abort(bar, parity, line);
    }
}
#else
// Waits until the phase of parity `parity` of `bar` has completed (the
// emulator blocks the thread, and reports a wait that never can complete as
// a deadlock; `line` is the GPU watchdog's and unused here).
TPAR_DEVICE void mbarrier_wait_parity(u64* bar, u32 parity, u32 line = __builtin_LINE()) {
    (void)line;
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}
#endif

// The wgmma matrix descriptor of a shared-memory operand starting at `smem`:
// leading and stride byte offsets (multiples of 16) and the swizzle mode.
TPAR_DEVICE u64 wgmma_desc(const void* smem, u32 lbo, u32 sbo, int swizzle) {
    return (u64)((tpar_shared_addr(smem) & 0x3ffffu) >> 4) | ((u64)((lbo & 0x3ffffu) >> 4) << 16) |
           ((u64)((sbo & 0x3ffffu) >> 4) << 32) | ((u64)(swizzle & 3) << 62);
}
