//! The `reduce` family of checks.

use tpar_kernels::cuda::raw::{multi, reduce};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::elementwise::UnaryOp;
use tpar_kernels::reduce::Reduction;

use CudaDType::{F16, F32};

use super::{bound, Ctx, DTYPES};
use crate::data::dn;
use crate::Res;

pub(crate) fn check_reduce(c: &mut Ctx) {
    let shapes: &[(usize, usize, usize)] = if c.quick {
        &[(5, 300, 1), (3, 70, 40), (1, 40000, 1)]
    } else {
        &[(4096, 4096, 1), (64, 1000, 512), (1, 1 << 26, 1)]
    };
    for dt in DTYPES {
        for &(outer, len, inner) in shapes {
            reduce_case(c, dt, outer, len, inner);
        }
    }
    let (rows, len) = if c.quick { (4, 5000) } else { (64, 1 << 20) };
    for dt in DTYPES {
        sum_squares_case(c, dt, rows, len);
    }
    let lens = multi_lens(c);
    for dt in DTYPES {
        multi_case(c, dt, &lens);
    }
}

/// Tensor lengths for the multi-tensor checks: more tensors than one launch takes, sizes
/// around the 16384-element chunk.
pub(crate) fn multi_lens(c: &Ctx) -> Vec<usize> {
    let mut lens = vec![0, 1, 7, 16383, 16384, 16385, 3000, if c.quick { 40000 } else { 1 << 22 }];
    lens.extend((0..30).map(|i| 100 + 37 * i));
    lens
}

/// `multi::sum_squares_each` and `multi::scale_each` (out of place and in place) over
/// tensors of `lens`.
pub(crate) fn multi_case(c: &mut Ctx, dt: CudaDType, lens: &[usize]) {
    let shape = format!("{} tensors", lens.len());
    c.guard("multi", dn(dt), &shape, |c| {
        let d = c.d;
        let xs: Vec<Vec<f64>> = lens.iter().map(|&n| c.rng.vals(dt, n, -1.0, 1.0)).collect();
        let bxs = xs.iter().map(|x| d.up(dt, x)).collect::<Res<Vec<_>>>()?;
        let ptrs: Vec<(DevPtr, usize)> = bxs.iter().zip(lens).map(|(b, &n)| (b.ptr(), n)).collect();
        let want: Vec<f64> = xs.iter().map(|x| x.iter().map(|v| v * v).sum()).collect();
        let ws_len = multi::sum_squares_each_workspace_len(lens);
        let (bout, ws) = (d.junk(lens.len() * 4)?, d.junk(ws_len.max(1) * 4)?);
        // SAFETY: every tensor, out and the workspace were allocated above with these sizes.
        unsafe { multi::sum_squares_each(d.l(), dt, &ptrs, bout.ptr(), ws.ptr(), ws_len)? };
        let got = d.down(F32, &bout)?;
        c.r.close("multi.sum_squares_each", dn(dt), &shape, &got, &want, bound(F32));
        let coef = 0.3712f32;
        let bc = d.up_raw(&[coef])?;
        let bys = lens.iter().map(|&n| d.junk(n.max(1) * dt.size())).collect::<Res<Vec<_>>>()?;
        let pairs: Vec<(DevPtr, DevPtr, usize)> =
            bxs.iter().zip(&bys).zip(lens).map(|((x, y), &n)| (x.ptr(), y.ptr(), n)).collect();
        // SAFETY: as above; each output holds its tensor's elements.
        unsafe { multi::scale_each(d.l(), dt, &pairs, bc.ptr())? };
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for ((x, y), &n) in xs.iter().zip(&bys).zip(lens) {
            got.extend(d.down(dt, y)?.into_iter().take(n));
            want.extend(x.iter().map(|v| v * coef as f64));
        }
        c.r.close("multi.scale_each", dn(dt), &shape, &got, &want, bound(dt));
        // In place (each output its own input, as gradient clipping runs it): the same
        // bits as out of place.
        let same: Vec<(DevPtr, DevPtr, usize)> =
            bxs.iter().zip(lens).map(|(x, &n)| (x.ptr(), x.ptr(), n)).collect();
        // SAFETY: as above; each output is exactly its input.
        unsafe { multi::scale_each(d.l(), dt, &same, bc.ptr())? };
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for ((x, y), &n) in bxs.iter().zip(&bys).zip(lens) {
            got.extend(d.down(dt, x)?.into_iter().take(n).map(f64::to_bits));
            want.extend(d.down(dt, y)?.into_iter().take(n).map(f64::to_bits));
        }
        c.r.exact("multi.scale_each.in_place", dn(dt), &shape, &got, &want);
        Ok(())
    });
}

pub(crate) fn reduce_case(c: &mut Ctx, dt: CudaDType, outer: usize, len: usize, inner: usize) {
    let shape = format!("[{outer}, {len}, {inner}]");
    c.guard("reduce", dn(dt), &shape, |c| {
        let d = c.d;
        // A positive mean keeps long sums away from zero, where cancellation
        // would make a relative error meaningless. In f16 the values shrink so
        // that a long sum (mean 0.25 per term) stays below f16's 65504: past
        // it the device's f16 sum is rightly inf, the f64 reference is not.
        let scale = if dt == F16 { (16384.0 / (0.25 * len as f64)).min(1.0) } else { 1.0 };
        let x = c.rng.vals(dt, outer * len * inner, -0.5 * scale, scale);
        let bx = d.up(dt, &x)?;
        let ws_len = reduce::reduce_workspace_len(outer, len, inner);
        let ws = d.junk(ws_len.max(1) * 4)?;
        for (op, name) in [
            (Reduction::Sum, "reduce.sum"),
            (Reduction::Max, "reduce.max"),
            (Reduction::Min, "reduce.min"),
        ] {
            let mut want = vec![0.0; outer * inner];
            tpar_kernels::reduce::reduce::<f64>(op, &x, outer, len, inner, &mut want)?;
            let bout = d.junk(want.len() * dt.size())?;
            // SAFETY: x, out and the workspace were allocated above with these sizes.
            unsafe {
                reduce::reduce(
                    d.l(),
                    op,
                    dt,
                    bx.ptr(),
                    bout.ptr(),
                    outer,
                    len,
                    inner,
                    ws.ptr(),
                    ws_len,
                )?
            };
            c.r.close(name, dn(dt), &shape, &d.down(dt, &bout)?, &want, bound(dt));
        }
        let (mut mx, mut idx) = (vec![0.0; outer * inner], vec![0i64; outer * inner]);
        tpar_kernels::reduce::max_with_index::<f64>(&x, outer, len, inner, &mut mx, &mut idx)?;
        let (bmx, bidx) = (d.junk(mx.len() * dt.size())?, d.junk(idx.len() * 8)?);
        // SAFETY: x, out and index were allocated above with these sizes.
        unsafe {
            reduce::max_with_index(d.l(), dt, bx.ptr(), bmx.ptr(), bidx.ptr(), outer, len, inner)?
        };
        c.r.close("reduce.argmax.value", dn(dt), &shape, &d.down(dt, &bmx)?, &mx, bound(dt));
        let got: Vec<u64> = d.down_raw::<i64>(&bidx)?.iter().map(|&i| i as u64).collect();
        let want: Vec<u64> = idx.iter().map(|&i| i as u64).collect();
        c.r.exact("reduce.argmax.index", "i64", &shape, &got, &want);
        Ok(())
    });
}

pub(crate) fn sum_squares_case(c: &mut Ctx, dt: CudaDType, rows: usize, len: usize) {
    let shape = format!("{rows}x{len}");
    c.guard("reduce.sum_squares", dn(dt), &shape, |c| {
        let d = c.d;
        let x = c.rng.vals(dt, rows * len, -1.0, 1.0);
        let mut sq = vec![0.0; x.len()];
        tpar_kernels::elementwise::unary::<f64, _>(UnaryOp::Square, &x, &mut sq)?;
        let mut want = vec![0.0; rows];
        tpar_kernels::reduce::reduce::<f64>(Reduction::Sum, &sq, rows, len, 1, &mut want)?;
        let ws_len = reduce::reduce_workspace_len(rows, len, 1);
        let (bx, bout, ws) = (d.up(dt, &x)?, d.junk(rows * 4)?, d.junk(ws_len.max(1) * 4)?);
        // SAFETY: x, out and the workspace were allocated above with these sizes.
        unsafe {
            reduce::sum_squares(d.l(), dt, bx.ptr(), rows, len, bout.ptr(), ws.ptr(), ws_len)?
        };
        c.r.close("reduce.sum_squares", dn(dt), &shape, &d.down(F32, &bout)?, &want, bound(F32));
        Ok(())
    });
}
