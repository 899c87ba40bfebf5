//! CPU elementwise kernel timings on the Llama step's activation size (`[2048, 768]`
//! f32, 6 MiB per operand): binary ops on contiguous operands, with a broadcast row
//! (`x * w` for `w: [768]`), with a scalar, and SiLU, each against a `memcpy` of the same
//! output measured in the same run (`copy`: the bytes one output costs at least).
//! Run: `cargo bench -p tpar-kernels --bench elementwise`.

mod common;

use common::median_secs;
use tpar_kernels::elementwise::{binary, scalar, unary, BinaryOp, UnaryOp};

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
}
