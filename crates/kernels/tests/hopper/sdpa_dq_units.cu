// Test kernel of the Hopper attention backward's dQ staging layout
// (tests/emu_sdpa_hopper_bwd.rs): compiled after the part of
// cuda/sdpa_hopper_bwd.cu before its kernels, so it calls the kernel's own
// sdpa_hopper_bwd::dq_frag_unit.

struct DqUnitsArgs {
    i32* out;  // [2 warpgroups][HD / 16 column groups][128 threads]
    i32 hd;    // 64 or 128
    i32 pad;
};

// One warpgroup: thread tw writes, for each consumer warpgroup cw and column
// group j, the float offset its 16-byte store of the dQ tile goes to.
TPAR_KERNEL(hopper_sdpa_dq_units, DqUnitsArgs, 128) {
    const int tw = threadIdx.x, nj = args.hd / 16;
    for (int cw = 0; cw < 2; ++cw)
        for (int j = 0; j < nj; ++j)
            args.out[(cw * nj + j) * 128 + tw] =
                args.hd == 64 ? sdpa_hopper_bwd::dq_frag_unit<64>(cw, tw, j)
                              : sdpa_hopper_bwd::dq_frag_unit<128>(cw, tw, j);
}
