// Rotary position embedding, rotate-half form (as the CPU op in src/rope/):
// with x = (x1, x2) the halves of each head, c = (c1, c2) and s = (s1, s2) the
// halves of the row of cos / sin for the element's position,
//   forward:   y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2
//   transpose: y1 = x1 c1 + x2 s2,  y2 = x2 c2 - x1 s1   (the backward pass)
//
// Layout: element (o, t, i, j) of x is at o*xs_outer + t*xs_seq + i*xs_inner + j,
// of y at o*ys_outer + t*ys_seq + i*ys_inner + j (row strides in elements; the
// head dim is contiguous). The host passes the strides of one of two dense
// orders of the same (outer, seq, inner, head_dim) tensor: seq before inner,
// ((o*seq + t)*inner + i)*head_dim + j ([b, h, s, d] is outer = b*h, inner = 1;
// [b, s, h, d] is outer = b, inner = h), or inner before seq,
// ((o*inner + i)*seq + t)*head_dim + j (read [b, s, h, d], write [b, h, s, d]
// in one pass: the transpose(1, 2) of the input comes out rotated).
// cos and sin are [seq, head_dim]. y may be x (in place, same strides): every
// thread reads the pair (x1[j], x2[j]) it then writes.
//
// One item is 8 pairs (16-byte loads of x1, x2, c1, c2, s1, s2, stores of y1,
// y2) when half = head_dim / 2 is a multiple of 8, the pointers are 16-byte
// aligned and every row stride is a multiple of 8 elements, else one pair.
// Grid-stride over items; index arithmetic in 32 bits when the tensor allows.

struct RopeArgs {
    const void* x;
    const void* cos;
    const void* sin;
    void* y;
    i64 outer;
    i64 seq;
    i64 inner;
    i64 head_dim;
    i64 xs_outer;
    i64 xs_seq;
    i64 xs_inner;
    i64 ys_outer;
    i64 ys_seq;
    i64 ys_inner;
    i32 transpose;
    i32 pad;
};

namespace rope {

// Rotates one pair in place: (a, b) = (x1[j], x2[j]).
TPAR_DEVICE void rotate(float& a, float& b, float c1, float c2, float s1, float s2, bool transpose) {
    const float x1 = a, x2 = b;
    if (transpose) {
        a = x1 * c1 + x2 * s2;
        b = x2 * c2 - x1 * s1;
    } else {
        a = x1 * c1 - x2 * s1;
        b = x2 * c2 + x1 * s2;
    }
}

// Items of `w` pairs each (w = 8 or 1): item q covers pairs jw..jw+w-1 of row
// q / (half / w), where a row is one (o, t, i) head: i = row % inner,
// t = row / inner % seq, o = row / (inner * seq).
template <typename T, int W, typename I>
TPAR_DEVICE void run(const RopeArgs& a) {
    const T* x = static_cast<const T*>(a.x);
    const T* cs = static_cast<const T*>(a.cos);
    const T* sn = static_cast<const T*>(a.sin);
    T* y = static_cast<T*>(a.y);
    const bool tr = a.transpose != 0;
    const I hd = (I)a.head_dim, half = hd / 2, per_row = half / W;
    const I inner = (I)a.inner, seq = (I)a.seq;
    const I xso = (I)a.xs_outer, xst = (I)a.xs_seq, xsi = (I)a.xs_inner;
    const I yso = (I)a.ys_outer, yst = (I)a.ys_seq, ysi = (I)a.ys_inner;
    const I items = (I)(a.outer * a.seq * a.inner) * per_row;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I q = (I)blockIdx.x * blockDim.x + threadIdx.x; q < items; q += stride) {
        const I row = q / per_row;
        const I j = (q - row * per_row) * W;
        const I ot = row / inner, i = row - ot * inner;
        const I o = ot / seq, t = ot - o * seq;
        const I xo = o * xso + t * xst + i * xsi + j, yo = o * yso + t * yst + i * ysi + j;
        const I to = t * hd + j;
        if (W == 8) {
            float x1[8], x2[8], c1[8], c2[8], s1[8], s2[8];
            load8(x + xo, x1);
            load8(x + xo + half, x2);
            load8(cs + to, c1);
            load8(cs + to + half, c2);
            load8(sn + to, s1);
            load8(sn + to + half, s2);
#pragma unroll
            for (int k = 0; k < 8; ++k) rotate(x1[k], x2[k], c1[k], c2[k], s1[k], s2[k], tr);
            store8(y + yo, x1);
            store8(y + yo + half, x2);
        } else {
            float x1 = to_f32(x[xo]), x2 = to_f32(x[xo + half]);
            rotate(x1, x2, to_f32(cs[to]), to_f32(cs[to + half]), to_f32(sn[to]),
                   to_f32(sn[to + half]), tr);
            y[yo] = from_f32<T>(x1);
            y[yo + half] = from_f32<T>(x2);
        }
    }
}

template <typename T>
TPAR_DEVICE void apply(const RopeArgs& a) {
    const i64 half = a.head_dim / 2;
    const bool vec = half % 8 == 0 && aligned16(a.x) && aligned16(a.y) && aligned16(a.cos) &&
                     aligned16(a.sin) && (a.xs_outer | a.xs_seq | a.xs_inner | a.ys_outer |
                                          a.ys_seq | a.ys_inner) % 8 == 0;
    // every index below (elements of x, of the tables, items) is < numel(x)
    // or < numel(table); 32-bit arithmetic when both fit
    const i64 n = a.outer * a.seq * a.inner * a.head_dim;
    const bool small = n < 0x7fffffffLL && a.seq * a.head_dim < 0x7fffffffLL;
    if (vec) {
        if (small) run<T, 8, u32>(a);
        else run<T, 8, u64>(a);
    } else {
        if (small) run<T, 1, u32>(a);
        else run<T, 1, u64>(a);
    }
}

}  // namespace rope

TPAR_KERNEL(tpar_rope_f32, RopeArgs, 1024) { rope::apply<float>(args); }
TPAR_KERNEL(tpar_rope_bf16, RopeArgs, 1024) { rope::apply<bf16>(args); }
TPAR_KERNEL(tpar_rope_f16, RopeArgs, 1024) { rope::apply<f16>(args); }
