//! The RoPE CUDA kernel (`cuda/rope.cu`) on the CPU emulator, against the
//! CPU op: forward and backward in both layouts, in place, for q and k
//! together, the backward undoing the forward for true rotations, and the
//! element-wise path (odd half head dims, shifted addresses); and the kernel
//! reading and writing separate orders (`[b, s, h, d]` in, `[b, h, s, d]` out
//! and back) bit for bit against an explicit transpose and the one-order kernel.

use crate::common;

use common::{assert_close_t as assert_close, dtype, emu, tol, Buf, Rng};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::rope::{self as gpu, RopeOrder, RopeShape};
use tpar_kernels::cuda::{CudaDType, DevPtr, Launcher};
use tpar_kernels::rope::reference::swap12;
use tpar_kernels::{rope, Float};

fn numel(s: &RopeShape) -> usize {
    s.outer * s.seq * s.inner * s.head_dim
}

/// One `#[test]` per `name: type = seed`, each running `body::<type>(seed)`.
macro_rules! per_dtype {
    ($body:ident: $($name:ident: $t:ty = $seed:expr),+ $(,)?) => {
        $(
            #[test]
            fn $name() {
                $body::<$t>($seed);
            }
        )+
    };
}

/// Llama tables: angle `t * theta^(-2i/d)` on both halves.
fn tables<T: Float>(seq: usize, hd: usize) -> (Vec<T>, Vec<T>) {
    let half = hd / 2;
    let mut c = Vec::with_capacity(seq * hd);
    let mut s = Vec::with_capacity(seq * hd);
    for t in 0..seq {
        for j in 0..hd {
            let f = 10000f64.powf(-2.0 * (j % half) as f64 / hd as f64);
            c.push(T::from_f64((t as f64 * f).cos()));
            s.push(T::from_f64((t as f64 * f).sin()));
        }
    }
    (c, s)
}

const SHAPES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 1, 2),  // one pair
    (2, 7, 1, 8),  // half 4: element path
    (1, 5, 3, 32), // [b, s, h, d] with half 16: vector path
    (3, 5, 2, 26), // half 13
    (6, 9, 1, 16), // [b*h, s, d], half 8
    (2, 3, 4, 64),
];

fn check<T: Float>(seed: u64) {
    let l: &dyn Launcher = emu();
    let dt = dtype::<T>();
    let mut rng = Rng(seed);
    for (outer, seq, inner, head_dim) in SHAPES {
        let s = RopeShape { outer, seq, inner, head_dim };
        let n = numel(&s);
        let x: Vec<T> = rng.vec(n, 1.0);
        // independent halves: the backward must be the exact transpose anyway
        let cos: Vec<T> = rng.vec(seq * head_dim, 1.0);
        let sin: Vec<T> = rng.vec(seq * head_dim, 1.0);
        let mut y_want = vec![T::default(); n];
        rope::rope_forward(&s, &x, &cos, &sin, &mut y_want).unwrap();
        let mut dx_want = vec![T::default(); n];
        rope::rope_backward(&s, &x, &cos, &sin, &mut dx_want).unwrap();
        for shift in [0, 1] {
            let what = format!("rope {s:?} shift {shift}");
            let mut bx = Buf::new(&x, shift);
            let mut bc = Buf::new(&cos, shift);
            let mut bs = Buf::new(&sin, 0);
            let mut by = Buf::<T>::zeros(n, shift);
            let (px, pc, ps, py) = (bx.ptr(), bc.ptr(), bs.ptr(), by.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { gpu::rope_forward(l, dt, &s, px, pc, ps, py) }.unwrap();
            assert_close(&format!("{what} forward"), &by.get(), &y_want, tol::<T>());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { gpu::rope_backward(l, dt, &s, px, pc, ps, py) }.unwrap();
            assert_close(&format!("{what} backward"), &by.get(), &dx_want, tol::<T>());
            // in place
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on
            // this thread before returning), each holding every element the call's sizes reach.
            unsafe { gpu::rope_forward(l, dt, &s, px, pc, ps, px) }.unwrap();
            assert_close(&format!("{what} in place"), &bx.get(), &y_want, tol::<T>());
        }
    }
}

per_dtype!(check: matches_cpu_f32: f32 = 1, matches_cpu_bf16: bf16 = 2, matches_cpu_f16: f16 = 3);

/// With real rotation tables the map is orthogonal: backward undoes forward.
fn round_trip<T: Float>(seed: u64, tol: f64) {
    let l: &dyn Launcher = emu();
    let dt = dtype::<T>();
    let s = RopeShape { outer: 2, seq: 11, inner: 3, head_dim: 32 };
    let x: Vec<T> = Rng(seed).vec(numel(&s), 2.0);
    let (cos, sin) = tables::<T>(s.seq, s.head_dim);
    let mut bx = Buf::new(&x, 0);
    let mut bc = Buf::new(&cos, 0);
    let mut bs = Buf::new(&sin, 0);
    let (px, pc, ps) = (bx.ptr(), bc.ptr(), bs.ptr());
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { gpu::rope_forward(l, dt, &s, px, pc, ps, px) }.unwrap();
    let rotated = bx.get();
    assert!(rotated.iter().zip(&x).any(|(a, b)| a != b), "forward changed nothing");
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe { gpu::rope_backward(l, dt, &s, px, pc, ps, px) }.unwrap();
    assert_close("rope round trip", &bx.get(), &x, tol);
}

#[test]
fn backward_undoes_forward() {
    round_trip::<f32>(4, 1e-5);
    round_trip::<bf16>(5, 2e-2);
}

#[test]
fn rotates_q_and_k_in_place() {
    let l: &dyn Launcher = emu();
    let dt = CudaDType::BF16;
    let (b, seq, hq, hkv, d) = (2, 6, 4, 2, 16);
    let qs = RopeShape { outer: b, seq, inner: hq, head_dim: d };
    let ks = RopeShape { outer: b, seq, inner: hkv, head_dim: d };
    let mut rng = Rng(6);
    let q: Vec<bf16> = rng.vec(numel(&qs), 1.0);
    let k: Vec<bf16> = rng.vec(numel(&ks), 1.0);
    let (cos, sin) = tables::<bf16>(seq, d);
    let mut bq = Buf::new(&q, 0);
    let mut bk = Buf::new(&k, 0);
    let mut bc = Buf::new(&cos, 0);
    let mut bs = Buf::new(&sin, 0);
    let (pq, pk, pc, ps) = (bq.ptr(), bk.ptr(), bc.ptr(), bs.ptr());
    for backward in [false, true] {
        let (mut qw, mut kw) = (vec![bf16::ZERO; q.len()], vec![bf16::ZERO; k.len()]);
        let (q0, k0) = (bq.get(), bk.get());
        if backward {
            rope::rope_backward(&qs, &q0, &cos, &sin, &mut qw).unwrap();
            rope::rope_backward(&ks, &k0, &cos, &sin, &mut kw).unwrap();
        } else {
            rope::rope_forward(&qs, &q0, &cos, &sin, &mut qw).unwrap();
            rope::rope_forward(&ks, &k0, &cos, &sin, &mut kw).unwrap();
        }
        // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
        // thread before returning), each holding every element the call's sizes reach.
        unsafe { gpu::rope_qk_inplace(l, dt, &qs, pq, &ks, pk, pc, ps, backward) }.unwrap();
        assert_close(&format!("q backward={backward}"), &bq.get(), &qw, 1e-2);
        assert_close(&format!("k backward={backward}"), &bk.get(), &kw, 1e-2);
    }
}

#[test]
fn rejects_bad_arguments() {
    let l: &dyn Launcher = emu();
    let mut buf = Buf::new(&[0.0f32; 64], 0);
    let p = buf.ptr();
    let f = CudaDType::F32;
    let odd = RopeShape { outer: 1, seq: 2, inner: 1, head_dim: 3 };
    let ok = RopeShape { outer: 1, seq: 2, inner: 1, head_dim: 4 };
    let long = RopeShape { seq: 3, ..ok };
    let huge = RopeShape { outer: usize::MAX, ..ok };
    // SAFETY: every call but the last is rejected by the argument checks before anything
    // is launched (asserted per call); the last rotates 8 elements in place inside `buf`
    // (64 f32), with its 8-element tables there too.
    unsafe {
        assert!(gpu::rope_forward(l, f, &odd, p, p, p, p).is_err(), "odd head_dim");
        assert!(gpu::rope_forward(l, f, &huge, p, p, p, p).is_err(), "overflow");
        assert!(gpu::rope_backward(l, f, &ok, p, 0, p, p).is_err(), "null table");
        assert!(gpu::rope_backward(l, f, &ok, p, p + 2, p, p).is_err(), "misaligned table");
        assert!(gpu::rope_qk_inplace(l, f, &ok, p, &long, p, p, p, false).is_err(), "seq differs");
        assert!(gpu::rope_forward(l, f, &ok, p, p, p, p).is_ok());
    }
}

/// The bytes of `v`, for bit-for-bit comparisons.
fn bits<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// The two-order kernel on the emulator: `x` read in `from`, rotated (put
/// through the transposed rotation when `backward`) with the tables `(cos,
/// sin)` into `y` written in `to`.
///
/// # Safety
/// `x`, `y`, `cos` and `sin` are host buffers holding every element `s`
/// reaches (the emulator runs the kernel on this thread before returning).
unsafe fn two_orders(
    dt: CudaDType,
    s: &RopeShape,
    backward: bool,
    (x, from): (DevPtr, RopeOrder),
    (cos, sin): (DevPtr, DevPtr),
    (y, to): (DevPtr, RopeOrder),
) {
    let l: &dyn Launcher = emu();
    // SAFETY: the caller's contract.
    let r = unsafe {
        if backward {
            gpu::rope_backward_orders(l, dt, s, x, from, cos, sin, y, to)
        } else {
            gpu::rope_forward_orders(l, dt, s, x, from, cos, sin, y, to)
        }
    };
    r.unwrap();
}

/// `[b, s, h, d]` in, `[b, h, s, d]` out (and the backward the reverse, and the
/// forward the other way round) equal the transpose and the one-order kernel
/// on `[b*h, s, 1, d]`, bit for bit, on the vector path (`shift` 0, half a
/// multiple of 8) and the element path.
fn orders<T: Float + bytemuck::Pod>(seed: u64) {
    use RopeOrder::{InnerSeq, SeqInner};
    let l: &dyn Launcher = emu();
    let dt = dtype::<T>();
    let mut rng = Rng(seed);
    // (b, s, h, d): vector path, several heads and positions; odd sizes on the
    // element path; one head; one position
    for (b, seq, h, d) in [(2, 5, 3, 16), (1, 3, 2, 64), (3, 7, 5, 6), (2, 4, 1, 16), (2, 1, 3, 10)]
    {
        let s = RopeShape { outer: b, seq, inner: h, head_dim: d };
        let flat = RopeShape { outer: b * h, seq, inner: 1, head_dim: d };
        let n = numel(&s);
        let x: Vec<T> = rng.vec(n, 1.0); // [b, s, h, d]
        let g: Vec<T> = rng.vec(n, 1.0); // [b, h, s, d]
        let cos: Vec<T> = rng.vec(seq * d, 1.0);
        let sin: Vec<T> = rng.vec(seq * d, 1.0);
        for shift in [0, 1] {
            let what = format!("rope orders ({b}, {seq}, {h}, {d}) {}", T::NAME);
            let mut bc = Buf::new(&cos, shift);
            let mut bs = Buf::new(&sin, shift);
            let (pc, ps) = (bc.ptr(), bs.ptr());
            // reference forward: transpose, then the one-order kernel
            let mut bxt = Buf::new(&swap12(&x, (b, seq, h, d)), shift);
            let mut want = Buf::<T>::zeros(n, shift);
            let (pxt, pw) = (bxt.ptr(), want.ptr());
            let mut bx = Buf::new(&x, shift);
            let mut got = Buf::<T>::zeros(n, shift);
            let (px, pg) = (bx.ptr(), got.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel
            // on this thread before returning), each holding every element the call's sizes
            // reach.
            unsafe {
                gpu::rope_forward(l, dt, &flat, pxt, pc, ps, pw).unwrap();
                two_orders(dt, &s, false, (px, SeqInner), (pc, ps), (pg, InnerSeq));
            }
            assert_eq!(bits(&got.get()), bits(&want.get()), "{what} forward, shift {shift}");
            // the other way round: [b, h, s, d] in, [b, s, h, d] out
            // SAFETY: as above.
            unsafe { two_orders(dt, &s, false, (pxt, InnerSeq), (pc, ps), (pg, SeqInner)) };
            let back = swap12(&want.get(), (b, h, seq, d));
            assert_eq!(bits(&got.get()), bits(&back), "{what} forward reversed, shift {shift}");
            // backward: dy [b, h, s, d] in, dx [b, s, h, d] out, against the one-order
            // backward then the transpose
            let mut bg = Buf::new(&g, shift);
            let pgr = bg.ptr();
            // SAFETY: as above.
            unsafe {
                gpu::rope_backward(l, dt, &flat, pgr, pc, ps, pw).unwrap();
                two_orders(dt, &s, true, (pgr, InnerSeq), (pc, ps), (pg, SeqInner));
            }
            let want_dx = swap12(&want.get(), (b, h, seq, d));
            assert_eq!(bits(&got.get()), bits(&want_dx), "{what} backward, shift {shift}");
            // and one order in and out is the one-order kernel
            // SAFETY: as above.
            unsafe {
                gpu::rope_backward(l, dt, &s, px, pc, ps, pw).unwrap();
                two_orders(dt, &s, true, (px, SeqInner), (pc, ps), (pg, SeqInner));
            }
            assert_eq!(bits(&got.get()), bits(&want.get()), "{what} one order, shift {shift}");
        }
    }
}

per_dtype!(
    orders: orders_match_transpose_f32: f32 = 7,
    orders_match_transpose_bf16: bf16 = 8,
    orders_match_transpose_f16: f16 = 9,
);

#[test]
fn rejects_in_place_across_orders() {
    let l: &dyn Launcher = emu();
    let mut buf = Buf::new(&[0.0f32; 64], 0);
    let p = buf.ptr();
    // the tables apart from the data: rotating in place while other threads read the
    // tables from the same bytes would be a race (the race check reports it)
    let mut tables = Buf::new(&[0.5f32; 16], 0);
    let t = tables.ptr();
    let f = CudaDType::F32;
    let s = RopeShape { outer: 1, seq: 2, inner: 2, head_dim: 4 };
    let (si, is) = (RopeOrder::SeqInner, RopeOrder::InnerSeq);
    // SAFETY: the first two calls are rejected before anything is launched (asserted);
    // the others rotate 16 elements in place inside `buf` (64 f32) with 8-element
    // tables in `tables` (16 f32).
    unsafe {
        assert!(gpu::rope_forward_orders(l, f, &s, p, si, t, t, p, is).is_err(), "forward");
        assert!(gpu::rope_backward_orders(l, f, &s, p, is, t, t, p, si).is_err(), "backward");
        assert!(gpu::rope_forward_orders(l, f, &s, p, is, t, t, p, is).is_ok(), "one order");
        // one head: both orders are one layout
        let one = RopeShape { inner: 1, ..s };
        assert!(gpu::rope_forward_orders(l, f, &one, p, si, t, t, p, is).is_ok(), "one head");
    }
}

/// The q and k heads of a packed `[b, s, (hq + 2 hkv) * d]` buffer rotated by one
/// strided launch into a dense `[b, s, hq + hkv, d]` buffer equal, bit for bit, the
/// one-order kernel on those heads copied out; the backward launch from the dense
/// buffer writes exactly the q and k columns of a packed gradient (the v columns keep
/// their sentinel) with the one-order backward's bits. Vector path (`d` 16, shift 0)
/// and element path (`d` 6, and shift 1).
fn packed<T: Float + bytemuck::Pod>(seed: u64) {
    use gpu::RopeStrides;
    let l: &dyn Launcher = emu();
    let dt = dtype::<T>();
    let mut rng = Rng(seed);
    for (b, seq, hq, hkv, d) in [(2, 5, 4, 2, 16), (1, 3, 2, 1, 6), (2, 1, 3, 3, 16)] {
        let (heads, w) = (hq + hkv, (hq + 2 * hkv) * d);
        let s = RopeShape { outer: b, seq, inner: heads, head_dim: d };
        let packed_st = RopeStrides { outer: seq * w, seq: w, inner: d };
        let dense_st = RopeOrder::SeqInner.strides(&s);
        let qkv: Vec<T> = rng.vec(b * seq * w, 1.0);
        let cos: Vec<T> = rng.vec(seq * d, 1.0);
        let sin: Vec<T> = rng.vec(seq * d, 1.0);
        // the q and k heads of each row, dense
        let qk: Vec<T> = qkv.chunks(w).flat_map(|row| row[..heads * d].to_vec()).collect();
        for shift in [0, 1] {
            let what = format!("packed ({b}, {seq}, {hq}, {hkv}, {d}) {} shift {shift}", T::NAME);
            let (mut bc, mut bs) = (Buf::new(&cos, shift), Buf::new(&sin, shift));
            let (pc, ps) = (bc.ptr(), bs.ptr());
            let (mut bqk, mut want) = (Buf::new(&qk, shift), Buf::<T>::zeros(qk.len(), shift));
            let (mut bx, mut got) = (Buf::new(&qkv, shift), Buf::<T>::zeros(qk.len(), shift));
            let (pqk, pw, px, pg) = (bqk.ptr(), want.ptr(), bx.ptr(), got.ptr());
            // SAFETY: host buffers stand in for device memory (the emulator runs the kernel
            // on this thread before returning), each holding every element the call's
            // sizes and strides reach.
            unsafe {
                gpu::rope_forward(l, dt, &s, pqk, pc, ps, pw).unwrap();
                gpu::rope_strided(l, dt, &s, (px, packed_st), pc, ps, (pg, dense_st), false)
                    .unwrap();
            }
            assert_eq!(bits(&got.get()), bits(&want.get()), "{what} forward");
            // backward: dense gradient in, the q/k columns of a packed gradient out
            let sentinel = T::from_f64(7.0);
            let mut dx = Buf::new(&vec![sentinel; qkv.len()], shift);
            let pdx = dx.ptr();
            // SAFETY: as above.
            unsafe {
                gpu::rope_backward(l, dt, &s, pqk, pc, ps, pw).unwrap();
                gpu::rope_strided(l, dt, &s, (pqk, dense_st), pc, ps, (pdx, packed_st), true)
                    .unwrap();
            }
            let want_dx = want.get();
            for (r, row) in dx.get().chunks(w).enumerate() {
                let (qk_cols, v_cols) = row.split_at(heads * d);
                let want_row = &want_dx[r * heads * d..(r + 1) * heads * d];
                assert_eq!(bits(qk_cols), bits(want_row), "{what} backward row {r}");
                assert!(v_cols.iter().all(|&x| x == sentinel), "{what}: v columns written");
            }
        }
    }
}

per_dtype!(
    packed: packed_heads_match_dense_f32: f32 = 10,
    packed_heads_match_dense_bf16: bf16 = 11,
);

#[test]
fn rejects_overlapping_or_mismatched_strides() {
    use gpu::RopeStrides;
    let l: &dyn Launcher = emu();
    let mut buf = Buf::new(&[0.0f32; 256], 0);
    let p = buf.ptr();
    let f = CudaDType::F32;
    let s = RopeShape { outer: 2, seq: 3, inner: 2, head_dim: 4 };
    let dense = RopeOrder::SeqInner.strides(&s);
    // heads 2 elements apart: each head's 4 elements overlap the next head's
    let overlapping = RopeStrides { inner: 2, ..dense };
    let wide = RopeStrides { outer: 3 * 16, seq: 16, inner: 4 };
    let q = p + 128 * 4;
    let mut tables = Buf::new(&[0.5f32; 16], 0);
    let t = tables.ptr();
    // SAFETY: the rejected calls launch nothing (asserted); the accepted ones reach at
    // most 2*3*16 elements from `p` or from `q` (both inside `buf`, 256 f32) with
    // 12-element tables in `tables` (16 f32).
    unsafe {
        let err = gpu::rope_strided(l, f, &s, (p, dense), t, t, (q, overlapping), false)
            .expect_err("y overlaps itself");
        assert!(err.to_string().contains("y strides"), "{err}");
        // a read may overlap itself (two heads reading one row's elements)
        assert!(gpu::rope_strided(l, f, &s, (p, overlapping), t, t, (q, dense), false).is_ok());
        let err = gpu::rope_strided(l, f, &s, (p, wide), t, t, (p, dense), true)
            .expect_err("in place at other strides");
        assert!(err.to_string().contains("different strides"), "{err}");
        assert!(gpu::rope_strided(l, f, &s, (p, wide), t, t, (p, wide), true).is_ok());
        let huge = RopeStrides { outer: usize::MAX / 2, ..dense };
        assert!(gpu::rope_strided(l, f, &s, (p, huge), t, t, (q, dense), false).is_err());
    }
}
