//! Kernels whose output is `&mut [O]` with `O: Out<T>` write every output element on every path: run
//! on `MaybeUninit` outputs prefilled with a sentinel, they give bit for bit what they
//! give on a zero-filled `&mut [T]`, for two different sentinels.

use std::mem::MaybeUninit;

use half::bf16;

use crate::cross_entropy::cross_entropy_backward;
use crate::dropout::{dropout, DropoutMask, ShardRuns};
use crate::elementwise::{self as ew, BinaryOp, UnaryOp, PAR_THRESHOLD};
use crate::embedding::embedding_forward;
use crate::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use crate::rope::{rope_backward, rope_forward, RopeShape};
use crate::sdpa::{sdpa_forward_tiled, SdpaMask, SdpaShape, SdpaTiles};
use crate::testutil::Rng;
use crate::{Acc, Float};

fn bits<T: Float>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// Runs `$call` (which writes through `$o`) on a zero-filled `[$t]` and on
/// `MaybeUninit<$t>` buffers prefilled with two sentinels; all must agree.
macro_rules! check_writes {
    ($what:expr, $t:ty, $n:expr, |$o:ident| $call:expr) => {{
        let n: usize = $n;
        let mut plain = vec![<$t>::default(); n];
        {
            let $o: &mut [$t] = &mut plain;
            $call.unwrap();
        }
        for fill in [12345.0, -54321.0] {
            let mut un: Vec<MaybeUninit<$t>> =
                (0..n).map(|_| MaybeUninit::new(<$t as Float>::from_f64(fill))).collect();
            {
                let $o: &mut [MaybeUninit<$t>] = &mut un;
                $call.unwrap();
            }
            // SAFETY: every element was initialized (with the sentinel) before the call.
            let got: Vec<$t> = un.into_iter().map(|v| unsafe { v.assume_init() }).collect();
            assert_eq!(bits(&got), bits(&plain), "{}: an element was not written", $what);
        }
    }};
}

fn all_kernels<T: Float>(seed: u64) {
    let mut rng = Rng::new(seed);
    // Serial and parallel sizes.
    for n in [7, PAR_THRESHOLD + 5] {
        let x: Vec<T> = rng.vec(n, 2.0);
        let y: Vec<T> = rng.vec(n, 2.0);
        let g: Vec<T> = rng.vec(n, 1.0);
        for op in UnaryOp::ALL {
            check_writes!(format!("unary {op:?}"), T, n, |o| ew::unary(op, &x, o));
            check_writes!(format!("unary_backward {op:?}"), T, n, |o| {
                ew::unary_backward(op, &x, &y, &g, o)
            });
        }
        for op in BinaryOp::ALL {
            for first in [false, true] {
                check_writes!(format!("scalar {op:?}"), T, n, |o| {
                    ew::scalar(op, &x, 0.75, first, o)
                });
            }
        }
    }
    // Binary and strided copy on every layout path: contiguous, a row broadcast on
    // either side, a general stride (transpose).
    let (r, c) = (300, 130);
    let a: Vec<T> = rng.vec(r * c, 2.0);
    let b: Vec<T> = rng.vec(r * c, 2.0);
    let layouts: [([usize; 2], [usize; 2], [usize; 2]); 4] = [
        ([r, c], [c, 1], [c, 1]),
        ([r, c], [c, 1], [1, 0]),
        ([r, c], [0, 1], [c, 1]),
        ([c, r], [1, c], [r, 1]),
    ];
    for op in BinaryOp::ALL {
        for (shape, sa, sb) in layouts {
            check_writes!(format!("binary {op:?} {sa:?} {sb:?}"), T, r * c, |o| {
                ew::binary(op, &a, &sa, &b, &sb, &shape, o)
            });
        }
    }
    check_writes!("strided_copy", T, r * c, |o| ew::strided_copy(&a, 0, &[1, c], &[c, r], o));
    check_writes!("strided_copy", T, r * c, |o| ew::strided_copy(&a, 0, &[c, 1], &[r, c], o));

    // RMSNorm and RoPE.
    let (rows, dim) = (37, 64);
    let x: Vec<T> = rng.vec(rows * dim, 2.0);
    let w: Vec<T> = rng.vec(dim, 1.0);
    let dy: Vec<T> = rng.vec(rows * dim, 1.0);
    let mut rstd = vec![<T::Acc as Acc>::of(0.0); rows];
    rmsnorm_forward(&x, &w, rows, dim, 1e-5, &mut vec![T::default(); rows * dim], &mut rstd)
        .unwrap();
    check_writes!("rmsnorm_forward", T, rows * dim, |o| {
        rmsnorm_forward(&x, &w, rows, dim, 1e-5, o, &mut rstd.clone())
    });
    check_writes!("rmsnorm_backward", T, rows * dim, |o| {
        rmsnorm_backward(&x, &w, &rstd, &dy, rows, dim, o, &mut vec![rstd[0]; dim])
    });
    let s = RopeShape { outer: 3, seq: 5, inner: 2, head_dim: 8 };
    let n = 3 * 5 * 2 * 8;
    let (x, cos, sin): (Vec<T>, Vec<T>, Vec<T>) =
        (rng.vec(n, 1.0), rng.vec(40, 1.0), rng.vec(40, 1.0));
    check_writes!("rope_forward", T, n, |o| rope_forward(&s, &x, &cos, &sin, o));
    check_writes!("rope_backward", T, n, |o| rope_backward(&s, &x, &cos, &sin, o));

    // Dropout of a column shard whose runs cross tasks, kept and dropped elements alike.
    let runs = ShardRuns::new(&[40, 700], &[40, 1400], &[0, 700]).unwrap();
    let mask = DropoutMask::new(3, 5, 0.5).unwrap();
    let x: Vec<T> = rng.vec(40 * 700, 1.0);
    check_writes!("dropout", T, 40 * 700, |o| dropout(&mask, &runs, &x, o));

    // Cross-entropy backward: an ignored row, a row with -inf lse, a target in this
    // shard and one outside it.
    let (rows, vocab) = (4, 50);
    let logits: Vec<T> = rng.vec(rows * vocab, 3.0);
    let targets = [3i64, -100, 120, 7];
    let lse: Vec<T::Acc> =
        [2.5, 1.0, f64::NEG_INFINITY, 4.0].iter().map(|&v| <T::Acc as Acc>::of(v)).collect();
    let scale = [<T::Acc as Acc>::of(0.5)];
    check_writes!("cross_entropy_backward", T, rows * vocab, |o| {
        cross_entropy_backward(&logits, rows, vocab, &targets, 0, -100, &lse, &scale, o)
    });

    // Embedding: rows in this vocab shard and masked ones outside it.
    let (vocab, dim) = (10, 6);
    let w: Vec<T> = rng.vec(vocab * dim, 1.0);
    let ids = [3i64, 25, 12, 19, 40, 14];
    check_writes!("embedding_forward", T, ids.len() * dim, |o| {
        embedding_forward(&w, vocab, dim, &ids, 10, true, o)
    });

    // Attention, causal with a key mask that hides every key of the first tile from
    // query 0 (a fully masked row) and several tiles per row.
    let s = SdpaShape {
        batch: 2,
        q_heads: 4,
        kv_heads: 2,
        q_len: 9,
        kv_len: 9,
        head_dim: 8,
        v_dim: 8,
        scale: 0.35,
        causal: true,
    };
    let (q, k, v): (Vec<T>, Vec<T>, Vec<T>) =
        (rng.vec(2 * 4 * 9 * 8, 1.0), rng.vec(2 * 2 * 9 * 8, 1.0), rng.vec(2 * 2 * 9 * 8, 1.0));
    let keys: Vec<T> =
        (0..9).map(|j| T::from_f64(if j < 2 { f64::NEG_INFINITY } else { 0.0 })).collect();
    let mask = SdpaMask { data: &keys, batch_stride: 0, head_stride: 0, row_stride: 0 };
    let tiles = SdpaTiles { q: 4, k: 2 };
    check_writes!("sdpa_forward", T, 2 * 4 * 9 * 8, |o| {
        let mut lse = vec![<T::Acc as Acc>::of(0.0); 2 * 4 * 9];
        sdpa_forward_tiled(&s, tiles, &q, &k, &v, Some(&mask), o, &mut lse)
    });
}

#[test]
fn out_kernels_write_every_element() {
    all_kernels::<f32>(1);
    all_kernels::<f64>(2);
    all_kernels::<bf16>(3);
}
