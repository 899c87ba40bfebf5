// Layout copies. Tensors are contiguous row-major, so transpose, permute,
// expand, narrow and cat all write a new contiguous buffer. The kernels only
// move bits, so they are instantiated per element width, not per dtype:
// suffix _w<bytes> (w2: bf16/f16, w4: f32, w8: i64/f64; copy2d also w1, w16).
//
// - tpar_copy2d_w*: dst[r*dst_ld + c] = src[r*src_ld + c] for a [rows, cols]
//   block in units of the suffix width (the host picks the widest unit that
//   divides every address, length and pitch; w16 moves 16-byte vectors).
//   Serves plain copies, narrow (a slice along a dim) and cat (a copy into an
//   offset along a dim).
// - tpar_copy2d_batch_w*: up to 32 such blocks in one launch, block i on the
//   grid row blockIdx.y = i (a concatenation's or a split's pieces).
// - tpar_transpose_w*: y[b, c, r] = x[b, r, c], tiled 32x32 through shared
//   memory padded to 33 columns so the column reads are conflict-free.
// - tpar_strided_copy_w*: out (contiguous, up to 6 dims) [i] = src[base +
//   sum(idx[d] * stride[d])]; stride 0 broadcasts (expand). Permutes that keep
//   the last dim contiguous move 16-byte vectors.

#define TPAR_LAYOUT_MAX_RANK 6

struct LayoutCopy2dArgs {
    const void* src;
    void* dst;
    i64 rows;
    i64 cols;
    i64 src_ld;
    i64 dst_ld;
};

#define TPAR_COPY_BATCH 32

struct LayoutCopy2dBatchArgs {
    LayoutCopy2dArgs blocks[TPAR_COPY_BATCH];
    i64 n;
};

struct LayoutTransposeArgs {  // x: [batch, rows, cols] -> y: [batch, cols, rows]
    const void* x;
    void* y;
    i64 batch;
    i64 rows;
    i64 cols;
};

// `vec`: the last dim has stride 1 and a multiple of 16 / width elements,
// every other stride and `base` are multiples of it, both pointers are
// 16-byte aligned. `idx32`: the output and every source offset fit in 32 bits.
struct LayoutStridedArgs {
    const void* src;
    void* dst;
    i64 base;
    i64 n;
    i64 shape[TPAR_LAYOUT_MAX_RANK];
    i64 stride[TPAR_LAYOUT_MAX_RANK];
    i32 rank;
    i32 vec;
    i32 idx32;
    i32 pad;
};

namespace layout {

struct alignas(8) U2 {
    u32 w[2];
};

// ---------------------------------------------------------------- copy2d

template <typename U, typename I>
TPAR_DEVICE void copy2d_run(const LayoutCopy2dArgs& a) {
    const U* src = static_cast<const U*>(a.src);
    U* dst = static_cast<U*>(a.dst);
    const I cols = (I)a.cols, sld = (I)a.src_ld, dld = (I)a.dst_ld;
    const I n = (I)a.rows * cols;
    const I stride = (I)gridDim.x * blockDim.x;
    if (sld == cols && dld == cols) {
        for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
        return;
    }
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const I r = i / cols, c = i - r * cols;
        dst[r * dld + c] = src[r * sld + c];
    }
}

template <typename U>
TPAR_DEVICE void copy2d(const LayoutCopy2dArgs& a) {
    if (a.rows <= 0 || a.cols <= 0) return;
    // one past the largest offset touched, in units
    const i64 last = (a.rows - 1) * (a.src_ld > a.dst_ld ? a.src_ld : a.dst_ld) + a.cols;
    if (last < 0x7fffffffLL) copy2d_run<U, u32>(a);
    else copy2d_run<U, u64>(a);
}

template <typename U>
TPAR_DEVICE void copy2d_batch(const LayoutCopy2dBatchArgs& a) {
    if ((i64)blockIdx.y < a.n) copy2d<U>(a.blocks[blockIdx.y]);
}

// ---------------------------------------------------------------- transpose

#define TPAR_TILE 32
#define TPAR_TILE_ROWS 8  // blockDim.x == TPAR_TILE * TPAR_TILE_ROWS

template <typename U>
TPAR_DEVICE void transpose(const LayoutTransposeArgs& a) {
    __shared__ U tile[TPAR_TILE][TPAR_TILE + 1];
    const U* x = static_cast<const U*>(a.x);
    U* y = static_cast<U*>(a.y);
    const int tx = threadIdx.x % TPAR_TILE, ty = threadIdx.x / TPAR_TILE;
    const i64 R = a.rows, C = a.cols;
    const i64 tr = (R + TPAR_TILE - 1) / TPAR_TILE, tc = (C + TPAR_TILE - 1) / TPAR_TILE;
    const i64 per_batch = tr * tc, tiles = a.batch * per_batch;
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const i64 b = t / per_batch, rem = t - b * per_batch;
        const i64 r0 = (rem / tc) * TPAR_TILE, c0 = (rem % tc) * TPAR_TILE;
        const U* xb = x + b * R * C;
        U* yb = y + b * R * C;
        // coalesced reads along x's rows
#pragma unroll
        for (int k = 0; k < TPAR_TILE; k += TPAR_TILE_ROWS) {
            const i64 r = r0 + ty + k, c = c0 + tx;
            if (r < R && c < C) tile[ty + k][tx] = xb[r * C + c];
        }
        __syncthreads();
        // coalesced writes along y's rows (x's columns)
#pragma unroll
        for (int k = 0; k < TPAR_TILE; k += TPAR_TILE_ROWS) {
            const i64 c = c0 + ty + k, r = r0 + tx;
            if (r < R && c < C) yb[c * R + r] = tile[tx][ty + k];
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------- strided copy

template <typename I>
TPAR_DEVICE I src_offset(const LayoutStridedArgs& a, I i) {
    I off = (I)a.base;
    for (int d = a.rank - 1; d >= 0; --d) {
        const I size = (I)a.shape[d];
        const I q = i / size;
        off += (i - q * size) * (I)a.stride[d];
        i = q;
    }
    return off;
}

// E: the element type; V: elements per 16-byte vector.
template <typename E, typename I>
TPAR_DEVICE void strided_run(const LayoutStridedArgs& a) {
    const E* src = static_cast<const E*>(a.src);
    E* dst = static_cast<E*>(a.dst);
    const I n = (I)a.n;
    const I stride = (I)gridDim.x * blockDim.x;
    const I tid = (I)blockIdx.x * blockDim.x + threadIdx.x;
    if (a.vec) {
        const I per = 16 / sizeof(E);
        const I items = n / per;  // the last dim is a multiple of `per`
        for (I v = tid; v < items; v += stride) {
            const I o = src_offset<I>(a, v * per);
            reinterpret_cast<Raw16*>(dst)[v] = *reinterpret_cast<const Raw16*>(src + o);
        }
        return;
    }
    for (I i = tid; i < n; i += stride) dst[i] = src[src_offset<I>(a, i)];
}

template <typename E>
TPAR_DEVICE void strided(const LayoutStridedArgs& a) {
    if (a.rank < 1 || a.rank > TPAR_LAYOUT_MAX_RANK || a.n <= 0) return;
    if (a.idx32) strided_run<E, u32>(a);
    else strided_run<E, u64>(a);
}

}  // namespace layout

TPAR_KERNEL(tpar_copy2d_w1, LayoutCopy2dArgs, 1024) { layout::copy2d<u8>(args); }
TPAR_KERNEL(tpar_copy2d_w2, LayoutCopy2dArgs, 1024) { layout::copy2d<u16>(args); }
TPAR_KERNEL(tpar_copy2d_w4, LayoutCopy2dArgs, 1024) { layout::copy2d<u32>(args); }
TPAR_KERNEL(tpar_copy2d_w8, LayoutCopy2dArgs, 1024) { layout::copy2d<layout::U2>(args); }
TPAR_KERNEL(tpar_copy2d_w16, LayoutCopy2dArgs, 1024) { layout::copy2d<Raw16>(args); }
TPAR_KERNEL(tpar_copy2d_batch_w1, LayoutCopy2dBatchArgs, 1024) { layout::copy2d_batch<u8>(args); }
TPAR_KERNEL(tpar_copy2d_batch_w2, LayoutCopy2dBatchArgs, 1024) { layout::copy2d_batch<u16>(args); }
TPAR_KERNEL(tpar_copy2d_batch_w4, LayoutCopy2dBatchArgs, 1024) { layout::copy2d_batch<u32>(args); }
TPAR_KERNEL(tpar_copy2d_batch_w8, LayoutCopy2dBatchArgs, 1024) {
    layout::copy2d_batch<layout::U2>(args);
}
TPAR_KERNEL(tpar_copy2d_batch_w16, LayoutCopy2dBatchArgs, 1024) {
    layout::copy2d_batch<Raw16>(args);
}

TPAR_KERNEL(tpar_transpose_w2, LayoutTransposeArgs, 256) { layout::transpose<u16>(args); }
TPAR_KERNEL(tpar_transpose_w4, LayoutTransposeArgs, 256) { layout::transpose<u32>(args); }
TPAR_KERNEL(tpar_transpose_w8, LayoutTransposeArgs, 256) { layout::transpose<layout::U2>(args); }

TPAR_KERNEL(tpar_strided_copy_w2, LayoutStridedArgs, 1024) { layout::strided<u16>(args); }
TPAR_KERNEL(tpar_strided_copy_w4, LayoutStridedArgs, 1024) { layout::strided<u32>(args); }
TPAR_KERNEL(tpar_strided_copy_w8, LayoutStridedArgs, 1024) { layout::strided<layout::U2>(args); }
