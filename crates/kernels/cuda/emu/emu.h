// CPU emulator of the CUDA execution model, for testing tpar's kernels on
// machines without a GPU. Included before the prelude (tpar.cuh) when a
// kernel source is compiled with the host C++ compiler and -DTPAR_EMU.
//
// Model: a launch runs its blocks one after another (the blocks of a
// thread-block cluster together); the threads of a block are fibers
// (emu.cpp) that run until they reach __syncthreads() or a warp operation
// (shuffle, __syncwarp, mma, ldmatrix), which completes once every live lane
// of the warp (or thread of the block) has arrived. `__shared__` becomes
// `static`, which is shared by exactly the threads of the one block running
// at a time (by all blocks of a cluster: clustered kernels keep their shared
// memory in tpar_dyn_smem, which each block has its own of).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(TPAR_EMU_RACECHECK) && defined(__GNUC__) && !defined(__clang__)
// memcheck: keep aggregate copies whole (no scalar replacement), so that a
// 16-byte vector access (Raw16) reaches the check as one access of its type's
// alignment, as a GPU performs it, instead of four 4-byte ones.
#pragma GCC optimize("no-tree-sra")
#endif

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef int32_t i32;
typedef int64_t i64;
typedef uint64_t u64;

struct dim3 {
    unsigned x, y, z;
};
typedef dim3 uint3;

typedef void (*tpar_emu_combine_fn)(void* const* ins, void* const* outs, int kind);

extern "C" {
const dim3* tpar_emu_thread_idx();
const dim3* tpar_emu_block_idx();
const dim3* tpar_emu_block_dim();
const dim3* tpar_emu_grid_dim();
unsigned char* tpar_emu_dyn_smem_ptr();
void tpar_emu_syncthreads();
// Every live lane of the calling warp passes its own `in`/`out`; once all
// have arrived, `combine` runs once with the 32 lanes' pointers (null for
// lanes that have exited) and every lane continues.
void tpar_emu_warp_collective(void* in, void* out, tpar_emu_combine_fn combine, int kind);
// Records a kernel error (the launch fails with this message).
void tpar_emu_fail(const char* what);
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __constant__ static

#define threadIdx (*tpar_emu_thread_idx())
#define blockIdx (*tpar_emu_block_idx())
#define blockDim (*tpar_emu_block_dim())
#define gridDim (*tpar_emu_grid_dim())
#define warpSize 32
#define tpar_dyn_smem (tpar_emu_dyn_smem_ptr())

#ifdef TPAR_EMU_RACECHECK
// The checks see a store only as an assignment: GCC's instrumentation misses an
// aggregate a call returns straight into memory (`*p = from_f32<bf16>(v)`,
// `r[k] = Pack16<T>::pack(e)`), so device functions are inlined there, as a GPU
// compiler inlines them.
#define TPAR_DEVICE inline __attribute__((always_inline))
#else
#define TPAR_DEVICE inline
#endif
// The prelude's occupancy bound: the emulator keeps the thread bound.
#define TPAR_BOUNDS(max_threads, min_blocks) max_threads
#define TPAR_KERNEL(name, ArgsT, max_threads)                                      \
    static void name##_tpar_body(const ArgsT args);                                \
    extern "C" void name(const void* p) {                                          \
        ArgsT a;                                                                   \
        std::memcpy(&a, p, sizeof(ArgsT));                                         \
        name##_tpar_body(a);                                                       \
    }                                                                              \
    extern "C" size_t name##_tpar_args_size() { return sizeof(ArgsT); }            \
    extern "C" unsigned name##_tpar_max_threads() { return (unsigned)(max_threads); } \
    static void name##_tpar_body(const ArgsT args)

inline void __syncthreads() { tpar_emu_syncthreads(); }

// ---------------------------------------------------------------- bit casts and math

inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline int __float_as_int(float f) {
    int v;
    std::memcpy(&v, &f, 4);
    return v;
}
inline unsigned __float_as_uint(float f) {
    unsigned v;
    std::memcpy(&v, &f, 4);
    return v;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
// Explicitly rounded single operations: a GPU compiler never contracts them into
// a fused multiply-add. Each result passes through an empty asm statement, so the
// host compiler cannot fuse it either, even when the emulator contracts
// expressions (TPAR_EMU_FP_CONTRACT=fast).
inline float tpar_emu_rounded(float r) {
#if defined(__x86_64__)
    __asm__ volatile("" : "+x"(r));
#elif defined(__aarch64__)
    __asm__ volatile("" : "+w"(r));
#else
    volatile float v = r;
    r = v;
#endif
    return r;
}
inline float __fadd_rn(float a, float b) { return tpar_emu_rounded(a + b); }
inline float __fsub_rn(float a, float b) { return tpar_emu_rounded(a - b); }
inline float __fmul_rn(float a, float b) { return tpar_emu_rounded(a * b); }
inline float __fdiv_rn(float a, float b) { return tpar_emu_rounded(a / b); }
inline float __fsqrt_rn(float x) { return tpar_emu_rounded(std::sqrt(x)); }
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// Fibers of one block never run concurrently, so atomics are plain updates.
// Under racecheck (TPAR_EMU_RACECHECK) they are not instrumented as ordinary
// accesses but reported as atomics, which do not race with each other.
extern "C" void tpar_emu_race_atomic(const void* p, unsigned bytes);
#ifdef TPAR_EMU_RACECHECK
#define TPAR_EMU_ATOMIC __attribute__((no_sanitize_thread))
#define TPAR_EMU_RACE_ATOMIC(p) tpar_emu_race_atomic(p, sizeof(*p))
#else
#define TPAR_EMU_ATOMIC
#define TPAR_EMU_RACE_ATOMIC(p) ((void)0)
#endif
template <typename T>
TPAR_EMU_ATOMIC inline T atomicAdd(T* p, T v) {
    TPAR_EMU_RACE_ATOMIC(p);
    T old = *p;
    *p = old + v;
    return old;
}
template <typename T>
TPAR_EMU_ATOMIC inline T atomicMax(T* p, T v) {
    TPAR_EMU_RACE_ATOMIC(p);
    T old = *p;
    *p = old > v ? old : v;
    return old;
}
template <typename T>
TPAR_EMU_ATOMIC inline T atomicMin(T* p, T v) {
    TPAR_EMU_RACE_ATOMIC(p);
    T old = *p;
    *p = old < v ? old : v;
    return old;
}
template <typename T>
TPAR_EMU_ATOMIC inline T atomicExch(T* p, T v) {
    TPAR_EMU_RACE_ATOMIC(p);
    T old = *p;
    *p = v;
    return old;
}
template <typename T>
TPAR_EMU_ATOMIC inline T atomicCAS(T* p, T cmp, T v) {
    TPAR_EMU_RACE_ATOMIC(p);
    T old = *p;
    if (old == cmp) *p = v;
    return old;
}
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---------------------------------------------------------------- f16 conversions

inline float tpar_emu_f16_to_f32(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    u32 bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            float f = std::ldexp((float)man, -24);
            return sign ? -f : f;
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

inline u16 tpar_emu_f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u16 sign = (u16)((x >> 16) & 0x8000u);
    u32 exp = (x >> 23) & 0xffu;
    u32 man = x & 0x7fffffu;
    if (exp == 0xff) return (u16)(sign | 0x7c00u | (man ? 0x200u : 0u));
    int e = (int)exp - 127 + 15;
    if (e >= 0x1f) return (u16)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return sign;
        man |= 0x800000u;
        int shift = 14 - e;
        u32 half = man >> shift;
        u32 rem = man & ((1u << shift) - 1);
        u32 mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (u16)(sign | half);
    }
    u32 half = ((u32)e << 10) | (man >> 13);
    u32 rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
    return (u16)(sign | half);
}

// ---------------------------------------------------------------- warp operations

enum { TPAR_SHFL_IDX = 0, TPAR_SHFL_XOR = 1, TPAR_SHFL_DOWN = 2, TPAR_SHFL_UP = 3 };

template <typename T>
struct tpar_emu_shfl_in {
    T v;
    int arg;
    int width;
};

template <typename T>
void tpar_emu_shfl_combine(void* const* ins, void* const* outs, int kind) {
    for (int lane = 0; lane < 32; ++lane) {
        if (!ins[lane]) continue;
        const tpar_emu_shfl_in<T>* me = static_cast<const tpar_emu_shfl_in<T>*>(ins[lane]);
        int w = me->width, base = lane - lane % w, src = lane;
        switch (kind) {
            case TPAR_SHFL_IDX: src = base + ((me->arg % w) + w) % w; break;
            case TPAR_SHFL_XOR: src = lane ^ me->arg; break;
            case TPAR_SHFL_DOWN: src = (lane % w) + me->arg < w ? lane + me->arg : lane; break;
            case TPAR_SHFL_UP: src = (lane % w) - me->arg >= 0 ? lane - me->arg : lane; break;
        }
        if (src < 0 || src >= 32 || !ins[src]) {
            tpar_emu_fail("a shuffle read a lane that has exited or does not exist");
            *static_cast<T*>(outs[lane]) = me->v;
            continue;
        }
        *static_cast<T*>(outs[lane]) = static_cast<const tpar_emu_shfl_in<T>*>(ins[src])->v;
    }
}

template <typename T>
inline T tpar_emu_shfl(T v, int arg, int width, int kind) {
    tpar_emu_shfl_in<T> in{v, arg, width};
    T out = v;
    tpar_emu_warp_collective(&in, &out, &tpar_emu_shfl_combine<T>, kind);
    return out;
}

template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    return tpar_emu_shfl(v, src, width, TPAR_SHFL_IDX);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    return tpar_emu_shfl(v, mask, width, TPAR_SHFL_XOR);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) {
    return tpar_emu_shfl(v, (int)d, width, TPAR_SHFL_DOWN);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) {
    return tpar_emu_shfl(v, (int)d, width, TPAR_SHFL_UP);
}

inline void tpar_emu_nop_combine(void* const*, void* const*, int) {}
inline void __syncwarp(unsigned = 0xffffffffu) {
    tpar_emu_warp_collective(nullptr, nullptr, &tpar_emu_nop_combine, 0);
}

// Vote functions: the predicate of every live lane.
inline void tpar_emu_ballot_combine(void* const* ins, void* const* outs, int) {
    unsigned bits = 0;
    for (int l = 0; l < 32; ++l)
        if (ins[l] && *static_cast<const int*>(ins[l])) bits |= 1u << l;
    for (int l = 0; l < 32; ++l)
        if (outs[l]) *static_cast<unsigned*>(outs[l]) = bits;
}
inline unsigned __ballot_sync(unsigned, int pred) {
    int in = pred != 0;
    unsigned out = 0;
    tpar_emu_warp_collective(&in, &out, &tpar_emu_ballot_combine, 0);
    return out;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __all_sync(unsigned m, int pred) { return __ballot_sync(m, !pred) == 0; }

// Tensor-core and async-copy emulation (emu.cpp).
extern "C" {
void tpar_emu_mma_16816(float d[4], const u32 a[4], const u32 b[2], int f16);
void tpar_emu_ldmatrix(u32* r, const void* row, int count, bool trans);
void tpar_emu_cp_async_16(void* smem, const void* gmem, bool pred);
// cp.async.commit_group and cp.async.wait_group n (the copies themselves land
// at issue; racecheck counts them done only at the wait).
void tpar_emu_cp_async_commit();
void tpar_emu_cp_async_wait(int n);
// fence.proxy.async (racecheck: makes the thread's earlier stores to shared
// memory readable by asynchronous operations ordered after it).
void tpar_emu_fence_proxy_async();
}

// Hopper (sm_90a) emulation (emu.cpp): warpgroup collectives (4 consecutive
// warps, 128 threads), mbarriers, bulk tensor copies through emulated tensor
// maps, wgmma.mma_async and setmaxnreg. The prelude (tpar.cuh) wraps these
// in the same functions the GPU build implements with inline PTX.
extern "C" {
// As tpar_emu_warp_collective, over the 128 threads of the calling warpgroup.
void tpar_emu_warpgroup_collective(void* in, void* out, tpar_emu_combine_fn combine, int kind);
// The shared-window address of `p`: its offset in dynamic shared memory
// (1024-byte aligned in the emulator), as wgmma matrix descriptors hold it.
unsigned tpar_emu_smem_offset(const void* p);
void tpar_emu_mbar_init(void* bar, unsigned count);
void tpar_emu_mbar_inval(void* bar);
// Adds `tx` expected transaction bytes, then `count` arrivals; returns the
// phase the arrivals belong to.
u64 tpar_emu_mbar_arrive(void* bar, unsigned count, unsigned tx);
void tpar_emu_mbar_expect_tx(void* bar, unsigned tx);
// Blocks the calling thread until the phase of parity `parity` has
// completed; returns 1.
int tpar_emu_mbar_try_wait(void* bar, unsigned parity);
// setmaxnreg.inc (inc = 1, waits until the block's pool has the registers
// it adds) or .dec (returns registers to the pool); a block of T threads
// holds 65536 / T registers per thread at entry (units of 8, at most 255).
void tpar_emu_setmaxnreg(unsigned regs, int inc);
// Box at `coords` (innermost first) of the tensor `map` into shared memory,
// then complete_tx of its bytes on `bar`.
void tpar_emu_tma_load(void* smem, const void* map, const int* coords, int rank, void* bar);
// Box of shared memory to the tensor `map` at `coords` (out-of-bounds
// elements not written).
void tpar_emu_tma_store(const void* map, const int* coords, int rank, const void* smem);
// wgmma.mma_async m64nNk16 with f32 accumulators `d` (N / 2 per thread); `a`
// the thread's A fragment, or null for A through `desc_a`; flags: 1 f16
// (else bf16), 2 A M-major, 4 B N-major, 8 accumulate into d.
void tpar_emu_wgmma(float* d, int n, const u32* a, u64 desc_a, u64 desc_b, int flags);
// Thread-block clusters: the block's rank in its cluster (x fastest), the
// blocks per cluster, barrier.cluster (arrive and wait), mapa (the address
// of the same dynamic shared memory byte in block `rank`), and a bulk tensor
// load multicast to the blocks of `mask` (each at the same shared offset,
// complete_tx on each one's mbarrier at the same offset).
unsigned tpar_emu_cluster_ctarank();
unsigned tpar_emu_cluster_nctarank();
void tpar_emu_cluster_sync();
void* tpar_emu_mapa(const void* p, unsigned rank);
void tpar_emu_tma_load_multicast(void* smem, const void* map, const int* coords, int rank,
                                 void* bar, unsigned mask);
void tpar_emu_wgmma_fence();
void tpar_emu_wgmma_commit();
void tpar_emu_wgmma_wait(int n);
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: gmem[i] +=
// smem[i] for `bytes` / 4 floats (both addresses 16-byte aligned, bytes a
// multiple of 16), recorded in the thread's open bulk async-group. The source
// is read (and the sums made) at the latest moment the ISA allows: when a
// cp.async.bulk.wait_group{.read} retires the group, so a kernel that reuses
// the source before that wait reduces what it wrote later.
void tpar_emu_bulk_reduce_add_f32(float* gmem, const float* smem, unsigned bytes);
// cp.async.bulk.commit_group: closes the thread's open bulk async-group.
void tpar_emu_bulk_commit();
// cp.async.bulk.wait_group{.read} n: completes all but the newest n
// committed groups of the thread.
void tpar_emu_bulk_wait(int n);
}
