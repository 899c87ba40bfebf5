// Dropout by position (src/dropout.rs): element g of the whole tensor is kept
// when word `offset + g` of a ChaCha8 stream (64-bit block counter in words 12
// and 13, stream 0 in words 14 and 15, as rand_chacha's ChaCha8Rng) is at
// least `threshold`; kept elements are multiplied by `scale` in f32 and
// rounded to nearest even, dropped ones written as zero.
//
// The shard's elements are `runs` runs of `run` elements, contiguous in the
// shard and in the whole tensor; run j starts at `base + sum(i_d * stride_d)`,
// i_d the digits of j over `extent` (the last innermost). One thread computes
// one ChaCha block (16 words) and writes the elements of one run that read
// them, so a run of w0 = offset + start(j) takes the blocks w0 / 16 ..
// (w0 + run - 1) / 16: `blocks_per_run` threads each (the first may start in
// the middle of a block), threads past a run's last block doing nothing.
//
// With `state` set (a CUDA graph's replays), the stream is read when the kernel
// runs: `state[0]` is added to `offset` and `state[1..5]` hold the key (two
// words each, the lower first), so each replay draws the words its generator
// state gives it.

#define TPAR_DROPOUT_MAX_RANK 6

struct DropoutArgs {
    const void* x;
    void* y;
    const u64* state;  // null, or the device state read at run time (above)
    u32 key[8];
    u64 offset;     // stream word of the whole tensor's element 0
    u64 threshold;  // words below it drop their element
    i64 run;        // elements per run
    i64 runs;       // runs in the shard
    i64 blocks_per_run;
    i64 base;       // whole tensor's position of the shard's first element
    i64 extent[TPAR_DROPOUT_MAX_RANK];
    i64 stride[TPAR_DROPOUT_MAX_RANK];
    i32 rank;       // dims in extent / stride
    float scale;
};

namespace dropout {

TPAR_DEVICE u32 rotl(u32 v, int c) { return (v << c) | (v >> (32 - c)); }

#define TPAR_CHACHA_QR(a, b, c, d)      \
    a += b;                             \
    d = rotl(d ^ a, 16);                \
    c += d;                             \
    b = rotl(b ^ c, 12);                \
    a += b;                             \
    d = rotl(d ^ a, 8);                 \
    c += d;                             \
    b = rotl(b ^ c, 7);

// The 16 words of ChaCha8 block `block` of the stream keyed by `key`.
TPAR_DEVICE void chacha8_block(const u32 key[8], u64 block, u32 out[16]) {
    u32 s[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                 key[0],      key[1],      key[2],      key[3],
                 key[4],      key[5],      key[6],      key[7],
                 (u32)block,  (u32)(block >> 32), 0u, 0u};
    u32 x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = s[i];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        TPAR_CHACHA_QR(x[0], x[4], x[8], x[12])
        TPAR_CHACHA_QR(x[1], x[5], x[9], x[13])
        TPAR_CHACHA_QR(x[2], x[6], x[10], x[14])
        TPAR_CHACHA_QR(x[3], x[7], x[11], x[15])
        TPAR_CHACHA_QR(x[0], x[5], x[10], x[15])
        TPAR_CHACHA_QR(x[1], x[6], x[11], x[12])
        TPAR_CHACHA_QR(x[2], x[7], x[8], x[13])
        TPAR_CHACHA_QR(x[3], x[4], x[9], x[14])
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = x[i] + s[i];
}

#undef TPAR_CHACHA_QR

template <typename T>
TPAR_DEVICE void apply(const DropoutArgs& a) {
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    u32 key[8];
    u64 offset = a.offset;
#pragma unroll
    for (int i = 0; i < 8; ++i) key[i] = a.key[i];
    if (a.state) {
        offset += a.state[0];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            key[2 * i] = (u32)a.state[1 + i];
            key[2 * i + 1] = (u32)(a.state[1 + i] >> 32);
        }
    }
    const i64 items = a.runs * a.blocks_per_run;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < items; q += step) {
        const i64 j = q / a.blocks_per_run;
        const i64 k = q - j * a.blocks_per_run;
        i64 start = a.base;
        i64 rest = j;
        for (int d = a.rank - 1; d >= 0; --d) {
            start += (rest % a.extent[d]) * a.stride[d];
            rest /= a.extent[d];
        }
        // Word w0 of the run's first element, as 68 bits: block counter and word.
        const u64 lo = offset + (u64)start;
        const u64 carry = lo < offset ? 1u : 0u;
        const u64 block = ((carry << 60) | (lo >> 4)) + (u64)k;
        // The run's element that reads word 0 of this block (may be before the run).
        const i64 first = k * 16 - (i64)(lo & 15u);
        if (first >= a.run) continue;
        u32 words[16];
        chacha8_block(key, block, words);
        const i64 at = j * a.run;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const i64 e = first + i;
            if (e >= 0 && e < a.run) {
                const float v = (u64)words[i] >= a.threshold ? to_f32(x[at + e]) * a.scale : 0.0f;
                y[at + e] = from_f32<T>(v);
            }
        }
    }
}

}  // namespace dropout

TPAR_KERNEL(tpar_dropout_f32, DropoutArgs, 256) { dropout::apply<float>(args); }
TPAR_KERNEL(tpar_dropout_bf16, DropoutArgs, 256) { dropout::apply<bf16>(args); }
TPAR_KERNEL(tpar_dropout_f16, DropoutArgs, 256) { dropout::apply<f16>(args); }
