// The Hopper GEMM's epilogue staging layout at lane level, for
// tests/emu_gemm_hopper.rs: compiled after cuda/gemm_hopper.cu (with
// TPAR_GEMM_HOPPER_NO_KERNELS, so only its device functions), this kernel
// records the staged float index each consumer thread stores every
// accumulator pair to (gemm_hopper::pair_slot) and reads every element of
// the row walk from (gemm_hopper::walk_at), the kernel's own functions.

struct StagingArgs {
    // [16 blocks bl][2 row halves e][2 stores sw][128 threads]: 2 at + far
    i32* pairs;
    // walk_at<128>(idx) for idx < 64 x 128, then walk_at<64>(idx) for idx < 64 x 64
    i32* walk;
};

TPAR_KERNEL(gemm_hopper_staging_slots, StagingArgs, 128) {
    const int tw = threadIdx.x, w = tw / 32, lane = tw % 32;
    for (int bl = 0; bl < 16; ++bl)
        for (int e = 0; e < 2; ++e)
            for (int sw = 0; sw < 2; ++sw) {
                const gemm_hopper::PairSlot p = gemm_hopper::pair_slot(w, lane, bl, e, sw);
                args.pairs[((bl * 2 + e) * 2 + sw) * 128 + tw] = 2 * p.at + (p.far ? 1 : 0);
            }
    for (int idx = tw; idx < 64 * 128; idx += 128) args.walk[idx] = gemm_hopper::walk_at<128>(idx);
    for (int idx = tw; idx < 64 * 64; idx += 128)
        args.walk[64 * 128 + idx] = gemm_hopper::walk_at<64>(idx);
}
