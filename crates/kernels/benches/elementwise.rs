//! CPU elementwise kernel timings on the Llama step's activation size (`[2048, 768]`
//! f32, 6 MiB per operand): binary ops on contiguous operands, with a broadcast row
//! (`x * w` for `w: [768]`), with a scalar, SiLU, and the strided copies of attention's
//! head permutes (`[8, 256, 24, 32]` to `[8, 24, 256, 32]` and back) and of a local slice
//! (half of every row), RoPE forward and backward on `[8, 24, 256, 32]`, and dropout
//! (p 0.1) of the whole tensor and of a tensor-parallel shard (the right half of every
//! row of a `[2048, 1536]` tensor), each
//! against a `memcpy` of the same output measured in the same run (`copy`: the bytes
//! one output costs at least).
//! Run: `cargo bench -p tpar-kernels --bench elementwise`.

mod common;

use common::median_secs;
use tpar_kernels::dropout::{dropout, DropoutMask, ShardRuns};
use tpar_kernels::elementwise::{binary, scalar, strided_copy, unary, BinaryOp, UnaryOp};
use tpar_kernels::rope::{rope_backward, rope_forward, RopeShape};

fn main() {
    let (rows, cols) = (2048usize, 768usize);
    let n = rows * cols;
    let a: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1013) as f32 / 512.0 - 1.0).collect();
    let b: Vec<f32> = (0..n).map(|i| ((i * 104_729) % 1019) as f32 / 512.0 - 1.0).collect();
    let w: Vec<f32> = b[..cols].to_vec();
    let mut out = vec![0f32; n];
    let shape = [rows, cols];
    let reps = 41;
    let copy = median_secs(2, reps, || out.copy_from_slice(&a));
    println!("rayon threads: {}", rayon::current_num_threads());
    println!("| kernel | ms | / copy |");
    println!("|---|---:|---:|");
    println!("| copy (memcpy) | {:.3} | 1.00 |", copy * 1e3);
    let mut row = |name: &str, f: &mut dyn FnMut(&mut [f32])| {
        let t = median_secs(2, reps, || f(&mut out));
        println!("| {name} | {:.3} | {:.2} |", t * 1e3, t / copy);
    };
    for (name, op) in [("add", BinaryOp::Add), ("mul", BinaryOp::Mul)] {
        row(&format!("{name}, contiguous"), &mut |o| {
            binary(op, &a, &[cols, 1], &b, &[cols, 1], &shape, o).unwrap()
        });
    }
    row("mul, broadcast row", &mut |o| {
        binary(BinaryOp::Mul, &a, &[cols, 1], &w, &[0, 1], &shape, o).unwrap()
    });
    row("mul, scalar", &mut |o| scalar(BinaryOp::Mul, &a, 0.5, false, o).unwrap());
    row("silu", &mut |o| unary(UnaryOp::Silu, &a, o).unwrap());
    // [b, s, h, d] = [8, 256, 24, 32]: 2048 x 768 elements.
    let (b, sq, h, d) = (8usize, 256usize, 24usize, 32usize);
    row("permute [b, s, h, d] -> [b, h, s, d]", &mut |o| {
        strided_copy(&a, 0, &[sq * h * d, d, h * d, 1], &[b, h, sq, d], o).unwrap()
    });
    row("permute [b, h, s, d] -> [b, s, h, d]", &mut |o| {
        strided_copy(&a, 0, &[h * sq * d, d, sq * d, 1], &[b, sq, h, d], o).unwrap()
    });
    let rs = RopeShape { outer: b * h, seq: sq, inner: 1, head_dim: d };
    let (cos, sin) = (&a[..sq * d], &a[sq * d..2 * sq * d]);
    row("rope forward [b, h, s, d]", &mut |o| rope_forward(&rs, &a, cos, sin, o).unwrap());
    row("rope backward [b, h, s, d]", &mut |o| rope_backward(&rs, &a, cos, sin, o).unwrap());
    let mask = DropoutMask::new(0, 0, 0.1).unwrap();
    let whole = ShardRuns::new(&shape, &shape, &[0, 0]).unwrap();
    row("dropout p 0.1", &mut |o| dropout(&mask, &whole, &a, o).unwrap());
    let shard = ShardRuns::new(&shape, &[rows, 2 * cols], &[0, cols]).unwrap();
    row("dropout p 0.1, column shard", &mut |o| dropout(&mask, &shard, &a, o).unwrap());
    let half = &mut out[..n / 2];
    let t = median_secs(2, reps, || {
        strided_copy(&a, cols / 2, &[cols, 1], &[rows, cols / 2], half).unwrap()
    });
    println!("| narrow, second half of each row | {:.3} | {:.2} |", t * 1e3, 2.0 * t / copy);
}
