// Test kernels of the emulated 1-D bulk reduction (tests/emu_hopper.rs):
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 through the
// prelude's bulk_reduce_add_f32, with its bulk-group completion.

struct BulkReduceArgs {
    float* dst;        // global floats the reductions add into
    const float* src;  // 256 floats copied into shared memory first
    float* out;        // what lane 0 read back (mode 2)
    i32 dst_off;       // floats: where the (first) reduction adds
    i32 src_off;       // bytes: where in shared memory it reads
    i32 bytes;         // its size
    // 0: reduce, commit, wait_group.read 0, then overwrite the source;
    // 1: overwrite the source with 1000.0 between the commit and the wait
    //    (the emulator reads at the wait, so dst gets the 1000s);
    // 2: two groups, the second `bytes` after the first in both memories:
    //    out[0..n) is dst[dst_off..] and out[n..2n) the second range after
    //    wait_group.read 1, then wait_group 0;
    // 3: no commit or wait (the thread exits with the reduction pending)
    i32 mode;
};

// One warp: the 256 floats into shared memory, then lane 0 reduces.
TPAR_KERNEL(hopper_bulk_reduce, BulkReduceArgs, 32) {
    float* s = reinterpret_cast<float*>(tpar_dyn_smem);
    for (int i = threadIdx.x; i < 256; i += 32) s[i] = args.src[i];
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x != 0) return;
    const float* from = reinterpret_cast<const float*>(tpar_dyn_smem + args.src_off);
    float* to = args.dst + args.dst_off;
    const int n = args.bytes / 4;
    bulk_reduce_add_f32(to, from, (u32)args.bytes);
    if (args.mode == 3) return;
    if (args.mode == 2) {
        tma_store_commit();
        bulk_reduce_add_f32(to + n, from + n, (u32)args.bytes);
        tma_store_commit();
        tma_store_wait_read<1>();
        for (int i = 0; i < 2 * n; ++i) args.out[i] = to[i];
        tma_store_wait<0>();
        return;
    }
    tma_store_commit();
    if (args.mode == 1)
        for (int i = 0; i < n; ++i) s[args.src_off / 4 + i] = 1000.0f;
    tma_store_wait_read<0>();
    for (int i = 0; i < 256; ++i) s[i] = -1.0f;
}
