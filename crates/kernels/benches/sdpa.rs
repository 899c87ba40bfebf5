//! CPU attention kernel timings: the tile sizes of the forward and backward passes
//! (`tiles`, the measurement behind `SdpaTiles::forward` / `backward`), the Llama
//! step's attention at the chosen tiles, many calls, fastest and median (`step`: for
//! comparing builds on a noisy machine), and the vectorized `exp` against libm on every
//! instruction set this CPU runs (`exp`).
//! Run: `cargo bench -p tpar-kernels --bench sdpa [-- tiles|step|exp]`.

mod common;

use common::{median_secs, times};
use tpar_kernels::sdpa::{sdpa_backward_tiled, sdpa_forward_tiled, SdpaMask, SdpaShape, SdpaTiles};
use tpar_kernels::vmath;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The inputs (deterministic values) and outputs of one shape's forward and backward.
struct Buffers {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

impl Buffers {
    fn new(s: &SdpaShape) -> Buffers {
        let nq = s.batch * s.q_heads * s.q_len;
        let nk = s.batch * s.kv_heads * s.kv_len;
        Buffers {
            q: values(nq * s.head_dim, 1),
            k: values(nk * s.head_dim, 2),
            v: values(nk * s.v_dim, 3),
            dout: values(nq * s.v_dim, 4),
            out: vec![0.0; nq * s.v_dim],
            lse: vec![0.0; nq],
            dq: vec![0.0; nq * s.head_dim],
            dk: vec![0.0; nk * s.head_dim],
            dv: vec![0.0; nk * s.v_dim],
        }
    }
}

/// Forward and backward times of one shape for every tile size of a grid.
fn tiles(name: &str, s: SdpaShape, padded_tail: usize, reps: usize) {
    let Buffers { q, k, v, dout, mut out, mut lse, mut dq, mut dk, mut dv } = Buffers::new(&s);
    let m: Vec<f32> = (0..s.batch * s.kv_len)
        .map(|i| if i % s.kv_len >= s.kv_len - padded_tail { f32::NEG_INFINITY } else { 0.0 })
        .collect();
    let mask = SdpaMask { data: &m[..], batch_stride: s.kv_len, head_stride: 0, row_stride: 0 };
    let mask = (padded_tail > 0).then_some(mask);
    println!("{name}: {s:?}, last {padded_tail} keys padded");
    println!("| q tile | k tile | forward ms | backward ms |");
    println!("|---:|---:|---:|---:|");
    for tq in [32, 64, 128] {
        for tk in [32, 64, 128, 256] {
            let t = SdpaTiles { q: tq, k: tk };
            let m = mask.as_ref();
            let f = median_secs(1, reps, || {
                sdpa_forward_tiled(&s, t, &q, &k, &v, m, &mut out, &mut lse).unwrap();
            });
            let b = median_secs(1, reps, || {
                sdpa_backward_tiled(
                    &s, t, &q, &k, &v, m, &out, &lse, &dout, &mut dq, &mut dk, &mut dv,
                )
                .unwrap();
            });
            println!("| {tq} | {tk} | {:.2} | {:.2} |", f * 1e3, b * 1e3);
        }
    }
}

/// Forward and backward of one shape at the chosen tiles: fastest and median of `reps`.
fn step(name: &str, s: SdpaShape, reps: usize) {
    let Buffers { q, k, v, dout, mut out, mut lse, mut dq, mut dk, mut dv } = Buffers::new(&s);
    let (tf, tb) = (SdpaTiles::forward(&s), SdpaTiles::backward(&s));
    let f = times(2, reps, || {
        sdpa_forward_tiled(&s, tf, &q, &k, &v, None, &mut out, &mut lse).unwrap();
    });
    let b = times(2, reps, || {
        sdpa_backward_tiled(&s, tb, &q, &k, &v, None, &out, &lse, &dout, &mut dq, &mut dk, &mut dv)
            .unwrap();
    });
    println!(
        "{name}: forward {:.2} ms fastest, {:.2} median; backward {:.2} fastest, {:.2} median",
        f[0] * 1e3,
        f[f.len() / 2] * 1e3,
        b[0] * 1e3,
        b[b.len() / 2] * 1e3
    );
}

/// Throughput of the vectorized exp (in place, and the softmax step) against libm.
fn exp() {
    let x: Vec<f32> = values(1 << 16, 5).iter().map(|v| v * 20.0).collect();
    let mut y = x.clone();
    let reps = 200;
    let libm = median_secs(1, reps, || {
        y.copy_from_slice(&x);
        y.iter_mut().for_each(|v| *v = v.exp());
        std::hint::black_box(&y);
    });
    let n = x.len() as f64;
    for isa in vmath::isas() {
        let vec = median_secs(1, reps, || {
            y.copy_from_slice(&x);
            vmath::exp_with(isa, &mut y);
            std::hint::black_box(&y);
        });
        println!(
            "exp on {isa:?}: libm {:.2} ns/element, vmath {:.2} ns/element ({:.1}x)",
            libm / n * 1e9,
            vec / n * 1e9,
            libm / vec
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let want = |m: &str| args.is_empty() || args.iter().any(|a| a == m);
    if want("exp") {
        exp();
    }
    let sh = |batch, q_heads, kv_heads, len, head_dim| SdpaShape {
        batch,
        q_heads,
        kv_heads,
        q_len: len,
        kv_len: len,
        head_dim,
        v_dim: head_dim,
        scale: 1.0 / (head_dim as f64).sqrt(),
        causal: true,
    };
    if want("tiles") {
        // The Llama step's attention (hidden 256, 8 / 4 heads, seq 256, batch 8).
        tiles("llama step", sh(8, 8, 4, 256, 32), 0, 9);
        // A long padded sequence (4 heads of 64, a quarter of the keys padding).
        tiles("long padded", sh(1, 4, 4, 4096, 64), 1024, 3);
    }
    if want("step") {
        step("llama step (head dim 32)", sh(8, 8, 4, 256, 32), 60);
        step("head dim 64", sh(8, 4, 2, 256, 64), 60);
    }
}
