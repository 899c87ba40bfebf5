// Cross-entropy over class logits, in the pieces the vocab-parallel case
// needs (see src/cross_entropy/mod.rs): a rank holds columns
// [vocab_start, vocab_start + v_local) of a vocab of vocab_size.
//
// - tpar_ce_stats_*: per row, local max, sum of exp(logit - max) (one online
//   pass) and the target's logit when this shard owns it;
// - tpar_ce_merge_f32 / tpar_ce_rescale_f32 / tpar_ce_lse_f32 /
//   tpar_ce_loss_f32: the small per-row steps between the collectives;
// - tpar_ce_fwd_*: the unsharded forward (loss and lse per row) in one pass;
// - tpar_ce_bwd_*: dlogits = (softmax - onehot) * scale on a shard, given the
//   global lse (the softmax is never stored).
//
// Row kernels give each row a whole block (wide rows: threads stride over it
// with 16-byte loads) or one warp (warp_rows: narrow rows, 8 rows per block
// of 256). Math is in f32. Invalid targets (neither ignore_index nor in
// [0, vocab_size)) lower the caller's error slot to the first such row with
// atomicMin; their outputs are then meaningless.

struct CeStatsArgs {
    const void* logits;    // [rows, v_local]
    const i64* targets;    // [rows]
    float* max;            // [rows]
    float* sumexp;         // [rows], relative to max
    float* target_logit;   // [rows], 0 unless this shard owns the target
    i32* error;            // null, or atomicMin'd with rows holding invalid targets
    i64 vocab_start;
    i64 vocab_size;
    i64 ignore_index;
    i32 rows;
    i32 v_local;
    i32 warp_rows;         // 1: a warp per row; 0: a block per row
    i32 pad;
};

struct CeFwdArgs {
    const void* logits;    // [rows, vocab]
    const i64* targets;    // [rows]
    float* loss;           // [rows], 0 for ignored rows
    float* lse;            // [rows]
    i32* count;            // null, or incremented by the number of non-ignored rows
    i32* error;            // as CeStatsArgs::error
    i64 ignore_index;
    i32 rows;
    i32 vocab;
    i32 warp_rows;
    i32 pad;
};

struct CeBwdArgs {
    const void* logits;      // [rows, v_local]
    const i64* targets;      // [rows]
    const float* lse;        // [rows], global
    const float* row_scale;  // [rows] when scale_per_row, else [1]
    void* dlogits;           // [rows, v_local]; may be the logits buffer itself
    i64 vocab_start;
    i64 ignore_index;
    i32 rows;
    i32 v_local;
    i32 scale_per_row;
    i32 warp_rows;
};

struct CeMergeArgs {
    float* max;                // [n], updated
    float* sumexp;             // [n], updated
    const float* other_max;    // [n]
    const float* other_sumexp; // [n]
    i32 n;
    i32 pad;
};

struct CeRescaleArgs {
    const float* local_max;   // [n]
    float* sumexp;            // [n], rescaled in place
    const float* global_max;  // [n]
    i32 n;
    i32 pad;
};

struct CeLseArgs {
    const float* max;     // [n]
    const float* sumexp;  // [n]
    float* lse;           // [n]
    i32 n;
    i32 pad;
};

struct CeLossArgs {
    const float* lse;           // [rows]
    const float* target_logit;  // [rows]
    const i64* targets;         // [rows]
    float* loss;                // [rows]
    i32* count;                 // null, or incremented by the number of non-ignored rows
    i64 ignore_index;
    i32 rows;
    i32 pad;
};

namespace cross_entropy {

// out[i] = f(i, in[i]) over [0, n) (in[i] read as 0 when !load); 16-byte
// vectors when `in` and `out` share their alignment. Each element is read
// and written by the same thread, so `out` may be `in`.
template <typename T, typename F>
TPAR_DEVICE void map_chunk(const T* in, T* out, i64 n, int t, int nt, bool load, F&& f) {
    constexpr int N = Pack16<T>::N;
    const bool same = ((((u64)in) ^ ((u64)out)) & 15u) == 0;
    const i64 head = same ? head16(out, n, sizeof(T)) : n;
    for (i64 i = t; i < head; i += nt) {
        float e = load ? to_f32(in[i]) : 0.0f;
        f(i, &e, 1);
        out[i] = from_f32<T>(e);
    }
    const i64 nv = (n - head) / N;
    const Raw16* vi = reinterpret_cast<const Raw16*>(in + head);
    Raw16* vo = reinterpret_cast<Raw16*>(out + head);
    for (i64 k = t; k < nv; k += nt) {
        float e[N];
        if (load) {
            Pack16<T>::unpack(vi[k], e);
        } else {
#pragma unroll
            for (int j = 0; j < N; ++j) e[j] = 0.0f;
        }
        f(head + k * N, e, N);
        vo[k] = Pack16<T>::pack(e);
    }
    for (i64 i = head + nv * N + t; i < n; i += nt) {
        float e = load ? to_f32(in[i]) : 0.0f;
        f(i, &e, 1);
        out[i] = from_f32<T>(e);
    }
}

// ---------------------------------------------------------------- row groups

// The threads that share a row: a warp (WARP) or the whole block.
struct Group {
    int t;       // index in the group
    int nt;      // group size
    i64 first;   // first row of this group
    i64 stride;  // rows between successive rows of this group
};

template <bool WARP>
TPAR_DEVICE Group group() {
    Group g;
    if (WARP) {
        const int per_block = blockDim.x / TPAR_WARP;
        g.t = threadIdx.x % TPAR_WARP;
        g.nt = TPAR_WARP;
        g.first = (i64)blockIdx.x * per_block + threadIdx.x / TPAR_WARP;
        g.stride = (i64)gridDim.x * per_block;
    } else {
        g.t = threadIdx.x;
        g.nt = blockDim.x;
        g.first = blockIdx.x;
        g.stride = gridDim.x;
    }
    return g;
}

template <bool WARP>
TPAR_DEVICE float group_max(float v, float* scratch) {
    return WARP ? warp_max(v) : block_max(v, scratch);
}
template <bool WARP>
TPAR_DEVICE float group_sum(float v, float* scratch) {
    return WARP ? warp_sum(v) : block_sum(v, scratch);
}

// Max and sum of exp(x - max) of row[0..n), in every thread of the group.
template <typename T, bool WARP>
TPAR_DEVICE void row_stats(const T* row, i64 n, const Group& g, float* scratch, float& M, float& S) {
    const float ninf = -tpar_inf();
    float m = ninf, s = 0.0f;
    for_each_chunk(row, n, g.t, g.nt, [&](i64, const float* e, int cnt) {
        float vm = e[0];
        for (int j = 1; j < cnt; ++j) vm = fmaxf(vm, e[j]);
        if (vm > m) {
            s *= expf(m - vm);
            m = vm;
        }
        if (m != ninf) {
            for (int j = 0; j < cnt; ++j) s += expf(e[j] - m);
        }
    });
    M = group_max<WARP>(m, scratch);
    const float scaled = m == ninf ? 0.0f : s * expf(m - M);
    S = group_sum<WARP>(scaled, scratch);
}

TPAR_DEVICE bool bad_target(i64 t, i64 ignore, i64 vocab_size) {
    return t != ignore && (t < 0 || t >= vocab_size);
}

// ---------------------------------------------------------------- kernels

template <typename T, bool WARP>
TPAR_DEVICE void stats(const CeStatsArgs& a) {
    __shared__ float scratch[33];
    const Group g = group<WARP>();
    for (i64 r = g.first; r < a.rows; r += g.stride) {
        const T* row = static_cast<const T*>(a.logits) + r * a.v_local;
        float M, S;
        row_stats<T, WARP>(row, a.v_local, g, scratch, M, S);
        if (g.t == 0) {
            const i64 t = a.targets[r];
            if (a.error && bad_target(t, a.ignore_index, a.vocab_size)) atomicMin(a.error, (i32)r);
            const i64 c = t - a.vocab_start;
            const bool own = t != a.ignore_index && c >= 0 && c < a.v_local;
            a.max[r] = M;
            a.sumexp[r] = S;
            a.target_logit[r] = own ? to_f32(row[c]) : 0.0f;
        }
    }
}

template <typename T, bool WARP>
TPAR_DEVICE void forward(const CeFwdArgs& a) {
    __shared__ float scratch[33];
    const Group g = group<WARP>();
    for (i64 r = g.first; r < a.rows; r += g.stride) {
        const T* row = static_cast<const T*>(a.logits) + r * a.vocab;
        float M, S;
        row_stats<T, WARP>(row, a.vocab, g, scratch, M, S);
        if (g.t == 0) {
            const i64 t = a.targets[r];
            const float lse = S == 0.0f ? -tpar_inf() : M + logf(S);
            a.lse[r] = lse;
            float loss = 0.0f;
            if (bad_target(t, a.ignore_index, a.vocab)) {
                if (a.error) atomicMin(a.error, (i32)r);
            } else if (t != a.ignore_index) {
                loss = lse - to_f32(row[t]);
                if (a.count) atomicAdd(a.count, 1);
            }
            a.loss[r] = loss;
        }
    }
}

template <typename T, bool WARP>
TPAR_DEVICE void backward(const CeBwdArgs& a) {
    const Group g = group<WARP>();
    const float ninf = -tpar_inf();
    for (i64 r = g.first; r < a.rows; r += g.stride) {
        const i64 off = r * a.v_local;
        const i64 t = a.targets[r];
        const bool ignored = t == a.ignore_index;
        const float scale = a.row_scale[a.scale_per_row ? r : 0];
        const float l = a.lse[r];
        i64 tcol = t - a.vocab_start;
        if (ignored || tcol < 0 || tcol >= a.v_local) tcol = -1;
        const bool no_mass = l == ninf;
        map_chunk(static_cast<const T*>(a.logits) + off, static_cast<T*>(a.dlogits) + off,
                  (i64)a.v_local, g.t, g.nt, !ignored, [&](i64 i, float* e, int cnt) {
                      if (ignored) return;  // zeros
                      for (int j = 0; j < cnt; ++j) {
                          const float p = no_mass ? 0.0f : expf(e[j] - l);
                          e[j] = (i + j == tcol ? p - 1.0f : p) * scale;
                      }
                  });
    }
}

TPAR_DEVICE float rescale(float sumexp, float from, float to) {
    return from == -tpar_inf() ? 0.0f : sumexp * expf(from - to);
}

TPAR_DEVICE void merge(const CeMergeArgs& a) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (i64)gridDim.x * blockDim.x) {
        const float m0 = a.max[i], m1 = a.other_max[i];
        const float m = fmaxf(m0, m1);
        a.sumexp[i] = rescale(a.sumexp[i], m0, m) + rescale(a.other_sumexp[i], m1, m);
        a.max[i] = m;
    }
}

TPAR_DEVICE void rescale_all(const CeRescaleArgs& a) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (i64)gridDim.x * blockDim.x) {
        a.sumexp[i] = rescale(a.sumexp[i], a.local_max[i], a.global_max[i]);
    }
}

TPAR_DEVICE void lse(const CeLseArgs& a) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (i64)gridDim.x * blockDim.x) {
        const float s = a.sumexp[i];
        a.lse[i] = s == 0.0f ? -tpar_inf() : a.max[i] + logf(s);
    }
}

TPAR_DEVICE void loss(const CeLossArgs& a) {
    __shared__ float scratch[33];
    float counted = 0.0f;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < a.rows; i += (i64)gridDim.x * blockDim.x) {
        const bool ignored = a.targets[i] == a.ignore_index;
        a.loss[i] = ignored ? 0.0f : a.lse[i] - a.target_logit[i];
        counted += ignored ? 0.0f : 1.0f;
    }
    // Exact: at most a few rows per thread, well below 2^24 per block.
    counted = block_sum(counted, scratch);
    if (a.count && threadIdx.x == 0 && counted > 0.0f) atomicAdd(a.count, (i32)counted);
}

template <typename T>
TPAR_DEVICE void stats_kernel(const CeStatsArgs& a) {
    if (a.warp_rows) {
        stats<T, true>(a);
    } else {
        stats<T, false>(a);
    }
}
template <typename T>
TPAR_DEVICE void forward_kernel(const CeFwdArgs& a) {
    if (a.warp_rows) {
        forward<T, true>(a);
    } else {
        forward<T, false>(a);
    }
}
template <typename T>
TPAR_DEVICE void backward_kernel(const CeBwdArgs& a) {
    if (a.warp_rows) {
        backward<T, true>(a);
    } else {
        backward<T, false>(a);
    }
}

}  // namespace cross_entropy

TPAR_KERNEL(tpar_ce_stats_f32, CeStatsArgs, 256) { cross_entropy::stats_kernel<float>(args); }
TPAR_KERNEL(tpar_ce_stats_bf16, CeStatsArgs, 256) { cross_entropy::stats_kernel<bf16>(args); }
TPAR_KERNEL(tpar_ce_stats_f16, CeStatsArgs, 256) { cross_entropy::stats_kernel<f16>(args); }

TPAR_KERNEL(tpar_ce_fwd_f32, CeFwdArgs, 256) { cross_entropy::forward_kernel<float>(args); }
TPAR_KERNEL(tpar_ce_fwd_bf16, CeFwdArgs, 256) { cross_entropy::forward_kernel<bf16>(args); }
TPAR_KERNEL(tpar_ce_fwd_f16, CeFwdArgs, 256) { cross_entropy::forward_kernel<f16>(args); }

TPAR_KERNEL(tpar_ce_bwd_f32, CeBwdArgs, 256) { cross_entropy::backward_kernel<float>(args); }
TPAR_KERNEL(tpar_ce_bwd_bf16, CeBwdArgs, 256) { cross_entropy::backward_kernel<bf16>(args); }
TPAR_KERNEL(tpar_ce_bwd_f16, CeBwdArgs, 256) { cross_entropy::backward_kernel<f16>(args); }

TPAR_KERNEL(tpar_ce_merge_f32, CeMergeArgs, 256) { cross_entropy::merge(args); }
TPAR_KERNEL(tpar_ce_rescale_f32, CeRescaleArgs, 256) { cross_entropy::rescale_all(args); }
TPAR_KERNEL(tpar_ce_lse_f32, CeLseArgs, 256) { cross_entropy::lse(args); }
TPAR_KERNEL(tpar_ce_loss_f32, CeLossArgs, 256) { cross_entropy::loss(args); }
