// Test kernel of the emulated setmaxnreg register pool (tests/emu_setmaxnreg.rs):
// a block of 384 threads (the Hopper kernels' producer and two consumer
// warpgroups) holds 168 registers per thread at entry (64K / 384, in units of
// 8); warpgroup 0 gives some back with setmaxnreg.dec, warpgroups 1 and 2 ask
// for more with setmaxnreg.inc, which waits until the pool has them.

struct SetmaxnregArgs {
    i32* out;  // 384 ints: each thread writes 1 + its warpgroup once past setmaxnreg
    // 0: dec 24 / inc 240 (128 x 144 released = 256 x 72 asked: fits exactly);
    // 1: dec 40 / inc 240 (16,384 released, 18,432 asked: the consumers wait forever);
    // 2: dec 40 / inc 232 (fits exactly);
    // 3: the consumers ask first: the producer decs (24 / 240) only after
    //    every consumer thread arrived on an mbarrier (they wait, then get
    //    the registers);
    // 4: inc to 160 (fewer registers than the 168 held: an error);
    // 5: the consumers ask (240) before a __syncthreads that the producer
    //    must pass before its dec: the barrier never completes (a deadlock)
    i32 mode;
    i32 pad;
};

TPAR_KERNEL(hopper_setmaxnreg, SetmaxnregArgs, 384) {
    __shared__ u64 asked;
    const int wg = threadIdx.x / 128;
    const int mode = args.mode;
    if (threadIdx.x == 0) {
        mbarrier_init(&asked, 256);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (mode == 3) {
        if (wg == 0) {
            mbarrier_wait_parity(&asked, 0);
            setmaxnreg_dec<24>();
        } else {
            mbarrier_arrive(&asked);
            setmaxnreg_inc<240>();
        }
    } else if (mode == 5) {
        if (wg == 0) {
            __syncthreads();
            setmaxnreg_dec<24>();
        } else {
            setmaxnreg_inc<240>();
            __syncthreads();
        }
    } else if (wg == 0) {
        if (mode == 0) setmaxnreg_dec<24>();
        if (mode == 1 || mode == 2) setmaxnreg_dec<40>();
    } else {
        if (mode == 0 || mode == 1) setmaxnreg_inc<240>();
        if (mode == 2) setmaxnreg_inc<232>();
        if (mode == 4) setmaxnreg_inc<160>();
    }
    args.out[threadIdx.x] = 1 + wg;
}
