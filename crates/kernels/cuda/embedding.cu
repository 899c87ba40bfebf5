// Embedding lookup and its gradient (see src/embedding/mod.rs), with the
// vocab-sharded mode: a rank holds rows [vocab_start, vocab_start + vocab)
// of the table; with `masked`, ids outside give zero rows / no gradient.
//
// A group of `group` threads (a power of two dividing the block) handles one
// row at a time, copying or accumulating 16 bytes per thread when the rows
// are 16-byte aligned.
//
// - tpar_embedding_fwd_*: out[p] = weight[ids[p] - vocab_start].
// - Gradient, deterministic (tpar_embedding_bwd_csr_*): the positions of
//   each table row come as a CSR (row_start [vocab + 1], positions sorted
//   within each row, built on the host by a counting sort); one group per
//   table row sums its positions' gradient rows in position order in f32 and
//   writes the row once (zeros for unused rows). Same order as the CPU
//   kernel. A row used by very many positions is summed by one group, so
//   heavily skewed ids serialize on that row.
// - Gradient, deterministic from the ids alone (tpar_embedding_sort_*,
//   tpar_embedding_csr_starts, then tpar_embedding_bwd_csr_*): the CSR is
//   built on the device. The positions are sorted by local row with an LSD
//   radix sort of 8-bit digits (a histogram per tile of 2048 positions, one
//   exclusive scan, a stable scatter that ranks equal digits within a warp by
//   ballots), so positions stay increasing within each row; ids outside the
//   slice get the key `vocab` and sort after every row. The row offsets come
//   from the sorted keys without atomics. The result is the CPU kernel's,
//   every run, with no host round trip.
// - Gradient, atomic (tpar_embedding_bwd_atomic_*): one group per position
//   adds its gradient row into an f32 accumulator with atomicAdd (zeroed
//   first by tpar_embedding_zero_f32, converted by tpar_embedding_cast_*).
//   Needs no preprocessing, but the order of additions into a repeated row
//   varies between runs on a GPU, so the result may differ in the last bits.
//
// Ids outside the slice without `masked` are errors: the kernels treat them
// like masked ids and lower the caller's i32 error slot (if any) to the
// first such position with atomicMin.

struct EmbFwdArgs {
    const void* weight;  // [vocab, dim]
    const i64* ids;      // [n]
    void* out;           // [n, dim]
    i32* error;          // null, or atomicMin'd with positions of invalid ids
    i64 vocab_start;
    i32 vocab;
    i32 dim;
    i32 n;
    i32 group;           // threads per row: a power of two dividing blockDim.x
    i32 masked;
    i32 pad;
};

struct EmbBwdAtomicArgs {
    const i64* ids;      // [n]
    const void* dout;    // [n, dim]
    float* acc;          // [vocab, dim] f32, zeroed beforehand
    i32* error;          // as EmbFwdArgs::error
    i64 vocab_start;
    i32 vocab;
    i32 dim;
    i32 n;
    i32 group;
    i32 masked;
    i32 pad;
};

struct EmbBwdCsrArgs {
    const i32* row_start;  // [vocab + 1]
    const i32* positions;  // [row_start[vocab]], increasing within each row
    const void* dout;      // [n, dim]
    void* dweight;         // [vocab, dim], overwritten
    i32 vocab;
    i32 dim;
    i32 group;
    i32 pad;
};

struct EmbZeroArgs {
    float* acc;
    i64 n;
};

// One pass of the radix sort (tpar_embedding_sort_hist / _scan / _scatter).
struct EmbSortArgs {
    const i64* ids;      // [n]: the first pass's keys (keys_in null)
    const i32* keys_in;  // [n] or null
    const i32* pos_in;   // [n] or null (the position is the index)
    i32* keys_out;       // [n] (scatter)
    i32* pos_out;        // [n] (scatter)
    u32* hist;           // [256 * tiles], digit-major: counts, offsets after the scan
    i64 vocab_start;
    i32 vocab;
    i32 n;
    i32 shift;           // the pass's digit: key bits [shift, shift + 8)
    i32 tiles;
};

// Row offsets [vocab + 1] from the sorted keys (tpar_embedding_csr_starts).
struct EmbStartsArgs {
    const i32* keys;  // [n], sorted, each in [0, vocab]
    i32* row_start;   // [vocab + 1]
    i32 n;
    i32 vocab;
};

struct EmbCheckArgs {
    const i64* ids;  // [n]
    i32* error;      // atomicMin'd with positions of ids outside [0, size)
    i64 size;
    i64 n;
};

struct EmbCastArgs {
    const float* acc;  // [n]
    void* dweight;     // [n]
    i64 n;
};

namespace embedding {

// The rows a group handles: group index in the grid and its stride.
struct Rows {
    int sub;      // thread index within the group
    i64 first;
    i64 stride;
};

TPAR_DEVICE Rows rows_of(int group) {
    const int per_block = blockDim.x / group;
    Rows r;
    r.sub = threadIdx.x % group;
    r.first = (i64)blockIdx.x * per_block + threadIdx.x / group;
    r.stride = (i64)gridDim.x * per_block;
    return r;
}

template <typename T>
TPAR_DEVICE void forward(const EmbFwdArgs& a) {
    constexpr int N = Pack16<T>::N;
    const T* weight = static_cast<const T*>(a.weight);
    T* out = static_cast<T*>(a.out);
    const bool vec = a.dim % N == 0 && aligned16(weight) && aligned16(out);
    const Rows g = rows_of(a.group);
    for (i64 p = g.first; p < a.n; p += g.stride) {
        const i64 r = a.ids[p] - a.vocab_start;
        const bool ok = r >= 0 && r < a.vocab;
        if (!ok && !a.masked && a.error && g.sub == 0) atomicMin(a.error, (i32)p);
        const T* w = weight + (ok ? r : 0) * a.dim;
        T* o = out + p * a.dim;
        if (vec) {
            const Raw16* wv = reinterpret_cast<const Raw16*>(w);
            Raw16* ov = reinterpret_cast<Raw16*>(o);
            Raw16 zero;
#pragma unroll
            for (int i = 0; i < 4; ++i) zero.w[i] = 0u;
            for (int j = g.sub; j < a.dim / N; j += a.group) ov[j] = ok ? wv[j] : zero;
        } else {
            const T zero = from_f32<T>(0.0f);
            for (int j = g.sub; j < a.dim; j += a.group) o[j] = ok ? w[j] : zero;
        }
    }
}

template <typename T>
TPAR_DEVICE void backward_atomic(const EmbBwdAtomicArgs& a) {
    constexpr int N = Pack16<T>::N;
    const T* dout = static_cast<const T*>(a.dout);
    const bool vec = a.dim % N == 0 && aligned16(dout);
    const Rows g = rows_of(a.group);
    for (i64 p = g.first; p < a.n; p += g.stride) {
        const i64 r = a.ids[p] - a.vocab_start;
        if (r < 0 || r >= a.vocab) {
            if (!a.masked && a.error && g.sub == 0) atomicMin(a.error, (i32)p);
            continue;
        }
        float* acc = a.acc + r * a.dim;
        const T* d = dout + p * a.dim;
        if (vec) {
            const Raw16* dv = reinterpret_cast<const Raw16*>(d);
            for (int j = g.sub; j < a.dim / N; j += a.group) {
                float e[N];
                Pack16<T>::unpack(dv[j], e);
#pragma unroll
                for (int k = 0; k < N; ++k) atomicAdd(acc + j * N + k, e[k]);
            }
        } else {
            for (int j = g.sub; j < a.dim; j += a.group) atomicAdd(acc + j, to_f32(d[j]));
        }
    }
}

template <typename T>
TPAR_DEVICE void backward_csr(const EmbBwdCsrArgs& a) {
    constexpr int N = Pack16<T>::N;
    const T* dout = static_cast<const T*>(a.dout);
    T* dweight = static_cast<T*>(a.dweight);
    const bool vec = a.dim % N == 0 && aligned16(dout) && aligned16(dweight);
    const Rows g = rows_of(a.group);
    for (i64 v = g.first; v < a.vocab; v += g.stride) {
        const i32 s = a.row_start[v], e = a.row_start[v + 1];
        T* dw = dweight + v * a.dim;
        if (vec) {
            Raw16* out = reinterpret_cast<Raw16*>(dw);
            for (int j = g.sub; j < a.dim / N; j += a.group) {
                float acc[N];
#pragma unroll
                for (int k = 0; k < N; ++k) acc[k] = 0.0f;
                // kLoads rows loaded before they are added (in position order),
                // so a long row has that many loads in flight.
                constexpr int kLoads = sizeof(T) == 4 ? 4 : 8;
                for (i32 q0 = s; q0 < e; q0 += kLoads) {
                    Raw16 rows[kLoads];
#pragma unroll
                    for (int u = 0; u < kLoads; ++u) {
                        if (q0 + u < e) {
                            const T* src = dout + (i64)a.positions[q0 + u] * a.dim;
                            rows[u] = reinterpret_cast<const Raw16*>(src)[j];
                        }
                    }
#pragma unroll
                    for (int u = 0; u < kLoads; ++u) {
                        if (q0 + u >= e) break;
                        float x[N];
                        Pack16<T>::unpack(rows[u], x);
                        if (q0 + u == s) {
#pragma unroll
                            for (int k = 0; k < N; ++k) acc[k] = x[k];
                        } else {
#pragma unroll
                            for (int k = 0; k < N; ++k) acc[k] += x[k];
                        }
                    }
                }
                out[j] = Pack16<T>::pack(acc);
            }
        } else {
            for (int j = g.sub; j < a.dim; j += a.group) {
                float acc = 0.0f;
                for (i32 q = s; q < e; ++q) {
                    const float x = to_f32(dout[(i64)a.positions[q] * a.dim + j]);
                    acc = q == s ? x : acc + x;
                }
                dw[j] = from_f32<T>(acc);
            }
        }
    }
}

// The radix sort's tiles: 256 threads, 8 rounds of one position each.
constexpr int kSortThreads = 256;
constexpr int kSortItems = 8;
constexpr int kSortTile = kSortThreads * kSortItems;
constexpr int kSortBins = 256;
constexpr int kScanThreads = 1024;

// Position p's sort key: its local row, or `vocab` for an id outside the slice.
TPAR_DEVICE i32 sort_key(const EmbSortArgs& a, i64 p) {
    if (a.keys_in) return a.keys_in[p];
    const i64 r = a.ids[p] - a.vocab_start;
    return r >= 0 && r < a.vocab ? (i32)r : a.vocab;
}

// hist[d * tiles + tile]: how many of the tile's positions have digit d.
TPAR_DEVICE void sort_hist(const EmbSortArgs& a) {
    __shared__ u32 h[kSortBins];
    for (int i = threadIdx.x; i < kSortBins; i += blockDim.x) h[i] = 0;
    __syncthreads();
    const i64 first = (i64)blockIdx.x * kSortTile;
    for (int k = 0; k < kSortItems; ++k) {
        const i64 p = first + (i64)k * blockDim.x + threadIdx.x;
        if (p < a.n) atomicAdd(&h[((u32)sort_key(a, p) >> a.shift) & 255u], 1u);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kSortBins; i += blockDim.x) a.hist[(i64)i * a.tiles + blockIdx.x] = h[i];
}

// The exclusive scan of hist in place (one block): each digit's tiles in tile
// order, the digits in order, so tile t's first position of digit d goes after
// every smaller digit and after digit d in the tiles before t.
TPAR_DEVICE void sort_scan(const EmbSortArgs& a) {
    __shared__ u32 sums[kScanThreads];
    const i64 total = (i64)kSortBins * a.tiles;
    const i64 per = (total + blockDim.x - 1) / blockDim.x;
    const i64 lo = per * threadIdx.x < total ? per * threadIdx.x : total;
    const i64 hi = lo + per < total ? lo + per : total;
    u32 own = 0;
    for (i64 i = lo; i < hi; ++i) own += a.hist[i];
    sums[threadIdx.x] = own;
    __syncthreads();
    for (int off = 1; off < (int)blockDim.x; off <<= 1) {
        const u32 v = (int)threadIdx.x >= off ? sums[threadIdx.x - off] : 0u;
        __syncthreads();
        sums[threadIdx.x] += v;
        __syncthreads();
    }
    u32 run = sums[threadIdx.x] - own;
    for (i64 i = lo; i < hi; ++i) {
        const u32 v = a.hist[i];
        a.hist[i] = run;
        run += v;
    }
}

// Writes each of the tile's positions (and its key) at its digit's offset plus
// its rank among the tile's earlier positions of that digit: a stable pass.
TPAR_DEVICE void sort_scatter(const EmbSortArgs& a) {
    constexpr int kWarps = kSortThreads / 32;
    __shared__ u32 base[kSortBins];
    __shared__ u32 counts[kWarps * kSortBins];
    for (int i = threadIdx.x; i < kSortBins; i += blockDim.x) base[i] = a.hist[(i64)i * a.tiles + blockIdx.x];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 below = (1u << lane) - 1u;
    const i64 first = (i64)blockIdx.x * kSortTile;
    for (int k = 0; k < kSortItems; ++k) {
        for (int i = threadIdx.x; i < kWarps * kSortBins; i += blockDim.x) counts[i] = 0;
        __syncthreads();
        const i64 p = first + (i64)k * blockDim.x + threadIdx.x;
        const bool in = p < a.n;
        const i32 key = in ? sort_key(a, p) : 0;
        const u32 d = ((u32)key >> a.shift) & 255u;
        // The lanes holding the same digit (and a position).
        u32 peers = __ballot_sync(0xffffffffu, in);
        for (int b = 0; b < 8; ++b) {
            const u32 bit = (d >> b) & 1u;
            const u32 set = __ballot_sync(0xffffffffu, bit);
            peers &= bit ? set : ~set;
        }
        const u32 rank = __popc(peers & below);
        if (in && rank == 0) counts[warp * kSortBins + d] = __popc(peers);
        __syncthreads();
        if (in) {
            u32 at = base[d] + rank;
            for (int w = 0; w < warp; ++w) at += counts[w * kSortBins + d];
            a.keys_out[at] = key;
            a.pos_out[at] = a.pos_in ? a.pos_in[p] : (i32)p;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < kSortBins; i += blockDim.x) {
            u32 s = 0;
            for (int w = 0; w < kWarps; ++w) s += counts[w * kSortBins + i];
            base[i] += s;
        }
        __syncthreads();
    }
}

// row_start[r] = the first sorted index whose key is r or more: each index i
// writes the rows after its predecessor's key up to its own (i = n: up to
// vocab), so every row is written once.
TPAR_DEVICE void csr_starts(const EmbStartsArgs& a) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i <= a.n; i += (i64)gridDim.x * blockDim.x) {
        const i32 prev = i == 0 ? -1 : a.keys[i - 1];
        const i32 cur = i == a.n ? a.vocab : a.keys[i];
        for (i32 r = prev + 1; r <= cur; ++r) a.row_start[r] = (i32)i;
    }
}

TPAR_DEVICE void zero(const EmbZeroArgs& a) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (i64)gridDim.x * blockDim.x) {
        a.acc[i] = 0.0f;
    }
}

// Ids outside [0, size) lower the error slot to the first such position (the
// global range check of the vocab-sharded lookup, whose kernels mask such ids).
TPAR_DEVICE void check_ids(const EmbCheckArgs& a) {
    for (i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x; p < a.n; p += (i64)gridDim.x * blockDim.x) {
        const i64 id = a.ids[p];
        if (id < 0 || id >= a.size) atomicMin(a.error, (i32)p);
    }
}

template <typename T>
TPAR_DEVICE void cast(const EmbCastArgs& a) {
    T* out = static_cast<T*>(a.dweight);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (i64)gridDim.x * blockDim.x) {
        out[i] = from_f32<T>(a.acc[i]);
    }
}

}  // namespace embedding

TPAR_KERNEL(tpar_embedding_fwd_f32, EmbFwdArgs, 256) { embedding::forward<float>(args); }
TPAR_KERNEL(tpar_embedding_fwd_bf16, EmbFwdArgs, 256) { embedding::forward<bf16>(args); }
TPAR_KERNEL(tpar_embedding_fwd_f16, EmbFwdArgs, 256) { embedding::forward<f16>(args); }

TPAR_KERNEL(tpar_embedding_bwd_atomic_f32, EmbBwdAtomicArgs, 256) { embedding::backward_atomic<float>(args); }
TPAR_KERNEL(tpar_embedding_bwd_atomic_bf16, EmbBwdAtomicArgs, 256) { embedding::backward_atomic<bf16>(args); }
TPAR_KERNEL(tpar_embedding_bwd_atomic_f16, EmbBwdAtomicArgs, 256) { embedding::backward_atomic<f16>(args); }

TPAR_KERNEL(tpar_embedding_bwd_csr_f32, EmbBwdCsrArgs, 256) { embedding::backward_csr<float>(args); }
TPAR_KERNEL(tpar_embedding_bwd_csr_bf16, EmbBwdCsrArgs, 256) { embedding::backward_csr<bf16>(args); }
TPAR_KERNEL(tpar_embedding_bwd_csr_f16, EmbBwdCsrArgs, 256) { embedding::backward_csr<f16>(args); }

TPAR_KERNEL(tpar_embedding_sort_hist, EmbSortArgs, 256) { embedding::sort_hist(args); }
TPAR_KERNEL(tpar_embedding_sort_scan, EmbSortArgs, 1024) { embedding::sort_scan(args); }
TPAR_KERNEL(tpar_embedding_sort_scatter, EmbSortArgs, 256) { embedding::sort_scatter(args); }
TPAR_KERNEL(tpar_embedding_csr_starts, EmbStartsArgs, 256) { embedding::csr_starts(args); }

TPAR_KERNEL(tpar_embedding_zero_f32, EmbZeroArgs, 256) { embedding::zero(args); }
TPAR_KERNEL(tpar_embedding_check_ids, EmbCheckArgs, 256) { embedding::check_ids(args); }
TPAR_KERNEL(tpar_embedding_cast_f32, EmbCastArgs, 256) { embedding::cast<float>(args); }
TPAR_KERNEL(tpar_embedding_cast_bf16, EmbCastArgs, 256) { embedding::cast<bf16>(args); }
TPAR_KERNEL(tpar_embedding_cast_f16, EmbCastArgs, 256) { embedding::cast<f16>(args); }
