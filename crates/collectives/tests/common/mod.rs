//! Helpers shared by the integration tests: deterministic inputs every rank can
//! regenerate for every other rank, and serial references.
#![allow(dead_code)]

use tpar_collectives::{chunk_range, ReduceOp};
use tpar_tensor::tol::Tol;
use tpar_tensor::{DType, Rng, Tensor};

/// Every dtype.
pub const DTYPES: [DType; 5] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64];

/// Every reduction.
pub const OPS: [ReduceOp; 5] =
    [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product];

/// A random tensor: normal floats, or small integers for i64.
pub fn rand_tensor(dims: &[usize], dtype: DType, rng: &mut Rng) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = match dtype {
        DType::I64 => (0..n).map(|_| rng.below(11) as f64 - 5.0).collect(),
        _ => (0..n).map(|_| rng.normal()).collect(),
    };
    Tensor::from_f64(&v, dims.to_vec(), dtype).expect("rand_tensor")
}

/// A size that is often awkward for `world` ranks: 0, 1, world*3 + {0, 1, 2}, ...
pub fn awkward_size(rng: &mut Rng, world: usize) -> usize {
    let choices = [0, 1, 2, 3, world, world * 3, world * 3 + 1, world * 3 + 2, 5, 7];
    choices[rng.below(choices.len() as u64) as usize]
}

/// Random dims of rank 1..=3.
pub fn rand_dims(rng: &mut Rng, world: usize) -> Vec<usize> {
    let rank = 1 + rng.below(3) as usize;
    (0..rank).map(|_| awkward_size(rng, world)).collect()
}

/// Serial reduction of the inputs (in rank order), in f64.
pub fn reduce_ref(inputs: &[Tensor], op: ReduceOp) -> Vec<f64> {
    let vals: Vec<Vec<f64>> = inputs.iter().map(|t| t.to_vec_f64().unwrap()).collect();
    let n = vals[0].len();
    (0..n)
        .map(|j| {
            let mut a = vals[0][j];
            for v in &vals[1..] {
                let x = v[j];
                a = match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + x,
                    ReduceOp::Max => a.max(x),
                    ReduceOp::Min => a.min(x),
                    ReduceOp::Product => a * x,
                };
            }
            if op == ReduceOp::Avg {
                a / inputs.len() as f64
            } else {
                a
            }
        })
        .collect()
}

/// Checks a result against reference values (rounded to the dtype first) and dims.
pub fn check(what: &str, got: &Tensor, want: &[f64], dims: &[usize], dtype: DType) {
    assert_eq!(got.dims(), dims, "{what}: dims");
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    let want_t = Tensor::from_f64(want, dims.to_vec(), dtype).unwrap();
    let tol = Tol::for_dtype(dtype).scaled(4.0);
    if let Err(e) = tol.check_tensors(what, got, &want_t) {
        panic!("{e}");
    }
}

/// Checks exact equality (data movement must not change a bit).
pub fn check_exact(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dims(), want.dims(), "{what}: dims");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap(), "{what}: values");
}

/// `torch.chunk` piece `i` of `t` along `dim` over `k` shards.
pub fn chunk_of(t: &Tensor, dim: usize, k: usize, i: usize) -> Tensor {
    let (s, l) = chunk_range(t.dims()[dim], k, i);
    t.narrow(dim as isize, s, l).unwrap()
}
