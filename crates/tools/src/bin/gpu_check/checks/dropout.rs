//! The `dropout` family of checks: the device kernel against the CPU kernel, bit
//! for bit, for whole tensors and shards, at stream offsets inside a ChaCha block
//! and past 2^64 words.

use half::{bf16, f16};
use tpar_kernels::cuda::raw::dropout as gpu;
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::dropout::{dropout, DropoutMask, ShardRuns};
use tpar_kernels::Float;

use CudaDType::{BF16, F16, F32};

use super::Ctx;
use crate::data::dn;
use crate::Res;

/// The CPU kernel's output for `x` (values of `T`) as f64.
fn reference<T: Float>(mask: &DropoutMask, runs: &ShardRuns, x: &[f64]) -> Res<Vec<f64>> {
    let xs: Vec<T> = x.iter().map(|&v| T::from_f64(v)).collect();
    let mut y = vec![T::default(); xs.len()];
    dropout(mask, runs, &xs, &mut y)?;
    Ok(y.iter().map(|v| v.to_f64()).collect())
}

pub(crate) fn check_dropout(c: &mut Ctx) {
    // (dtype, local, global, offset)
    type Case = (CudaDType, Vec<usize>, Vec<usize>, Vec<usize>);
    let case = |dt, l: &[usize], g: &[usize], o: &[usize]| (dt, l.to_vec(), g.to_vec(), o.to_vec());
    let cases: Vec<Case> = if c.quick {
        vec![
            case(F32, &[3, 1000], &[3, 1000], &[0, 0]),
            case(BF16, &[5, 7], &[5, 33], &[0, 13]),
            case(F16, &[2, 3, 40], &[4, 9, 40], &[1, 5, 0]),
        ]
    } else {
        vec![
            case(BF16, &[8192, 2816], &[8192, 2816], &[0, 0]),
            case(BF16, &[8, 1024, 1408], &[8, 1024, 2816], &[0, 0, 1408]),
            case(F32, &[4, 512, 1024], &[8, 1024, 1024], &[4, 512, 0]),
            case(F16, &[3, 1, 5, 2], &[4, 3, 5, 6], &[1, 2, 0, 4]),
        ]
    };
    for (dt, local, global, at) in cases {
        for (offset, word) in [(21, "21"), (u64::MAX - 40, "2^64-41")] {
            let shape = format!("{local:?} of {global:?} at {at:?}, word {word}");
            c.guard("dropout", dn(dt), &shape, |c| {
                let d = c.d;
                let mask = DropoutMask::new(5, offset, 0.1)?;
                let runs = ShardRuns::new(&local, &global, &at)?;
                let n = runs.run * runs.runs;
                let x = c.rng.vals(dt, n, -2.0, 2.0);
                let want = match dt {
                    F32 => reference::<f32>(&mask, &runs, &x)?,
                    BF16 => reference::<bf16>(&mask, &runs, &x)?,
                    F16 => reference::<f16>(&mask, &runs, &x)?,
                };
                let (bx, by) = (d.up(dt, &x)?, d.junk(n * dt.size())?);
                // SAFETY: both buffers hold the shard's `n` elements of `dt`.
                unsafe { gpu::dropout(d.l(), dt, &mask, &runs, bx.ptr(), by.ptr(), None)? };
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<u64>>();
                c.r.exact("dropout", dn(dt), &shape, &bits(&d.down(dt, &by)?), &bits(&want));
                Ok(())
            });
        }
    }
}
