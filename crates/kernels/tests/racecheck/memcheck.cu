// Test kernels of the emulator's memcheck (tests/emu_memcheck.rs): each takes
// a `mode`; mode 0 stays inside its buffers, the others make one access a GPU
// faults on (or compute-sanitizer's memcheck reports), which the check must
// name.

struct MemArgs {
    float* out;        // n floats
    const float* src;  // n floats
    i32 n;
    i32 mode;
};

// One block of `n` threads, each copying one float (and for modes 5 and 6
// going through dynamic shared memory of n floats):
// 0 out[t] = src[t] through shared memory, in bounds;
// 1 out[t] = src[t + 1]: the last thread reads one float past src's end;
// 2 out[t - 1] = src[t]: thread 0 writes one float before out's start;
// 3 a 4-byte load from src's bf16 view at an odd element (misaligned);
// 4 a 16-byte store 8 bytes into out (misaligned);
// 5 the last thread writes shared memory one float past the launch's bytes;
// 6 thread 0 reads shared memory one float before its start;
// 7 an atomicAdd at an address that is not 4-byte aligned;
// 8 out[t] += src[t]: reads out, which must have been written first.
TPAR_KERNEL(mem_copy, MemArgs, 256) {
    const int t = threadIdx.x, n = args.n, m = args.mode;
    float* sh = reinterpret_cast<float*>(tpar_dyn_smem);
    if (t >= n) return;
    if (m == 1) {
        args.out[t] = args.src[t + 1];
    } else if (m == 2) {
        args.out[t - 1] = args.src[t];
    } else if (m == 3) {
        const bf16* h = reinterpret_cast<const bf16*>(args.src);
        args.out[t] = (float)*reinterpret_cast<const u32*>(h + 2 * t + 1);
    } else if (m == 4) {
        if (t == 0) {
            Raw16 v{{1u, 2u, 3u, 4u}};
            *reinterpret_cast<Raw16*>(reinterpret_cast<unsigned char*>(args.out) + 8) = v;
        }
    } else if (m == 8) {
        args.out[t] += args.src[t];
    } else if (m == 7) {
        if (t == 0) atomicAdd(reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(args.out) + 2), 1.0f);
    } else {
        sh[m == 5 && t == n - 1 ? n : t] = args.src[t];
        __syncthreads();
        args.out[t] = sh[m == 6 && t == 0 ? -1 : t];
    }
}

// Faults the host raises where a GPU fails the launch (tests/emu/memcheck.rs):
// thread 5 of block 1 of `mem_fault`, by `mode`:
// 0 stores 1 into out[0], no fault;
// 1 loads from address 16, which nothing maps;
// 2 (x86-64) stores 16 bytes with an aligned vector store 8 bytes into out,
//   as the host compiler emits for a Raw16 store;
// 3 recurses through 4 KiB frames until its stack overflows;
// 4 divides by `zero` (0), an integer division by zero.
struct FaultArgs {
    float* out;
    i32 mode;
    i32 zero;
};

static int fault_deep(volatile unsigned char* up, int n) {
    volatile unsigned char frame[4096];
    frame[0] = up ? (unsigned char)(up[0] + 1) : 1;
    frame[4095] = frame[0];
    return n == 0 ? frame[4095] : fault_deep(frame, n - 1) + frame[0];
}

TPAR_KERNEL(mem_fault, FaultArgs, 256) {
    if (blockIdx.x != 1 || threadIdx.x != 5) return;
    if (args.mode == 0) {
        args.out[0] = 1.0f;
    } else if (args.mode == 1) {
        args.out[0] = *reinterpret_cast<volatile const float*>((u64)16);
    } else if (args.mode == 2) {
#if defined(__x86_64__)
        unsigned char* p = reinterpret_cast<unsigned char*>(args.out) + 8;
        __asm__ volatile("xorps %%xmm0, %%xmm0\n\tmovaps %%xmm0, (%0)"
                         :
                         : "r"(p)
                         : "xmm0", "memory");
#endif
    } else if (args.mode == 3) {
        args.out[0] = (float)fault_deep(nullptr, 1 << 20);
    } else if (args.mode == 4) {
        args.out[0] = (float)(blockIdx.x / *(volatile const i32*)&args.zero);
    }
}
