//! The `rmsnorm` family of checks.

use tpar_kernels::cuda::raw::rmsnorm;
use tpar_kernels::cuda::CudaDType;

use CudaDType::{BF16, F16, F32};

use super::{bound, Ctx};
use crate::data::{dn, round_to};

pub(crate) fn check_rmsnorm(c: &mut Ctx) {
    // Rows of 16-byte multiples take the vector kernels; the last two of each list
    // (rows of 203, 1001, 4097, 5121 elements) the element-by-element ones.
    let cases: &[(CudaDType, usize, usize)] = if c.quick {
        &[
            (F32, 33, 200),
            (BF16, 33, 200),
            (F16, 7, 1000),
            (BF16, 4, 4096),
            (F32, 5, 203),
            (BF16, 9, 1001),
        ]
    } else {
        &[
            (F32, 4096, 4096),
            (BF16, 4096, 4096),
            (F16, 4096, 4096),
            (BF16, 1000, 5120),
            (F32, 300, 4097),
            (BF16, 1000, 5121),
        ]
    };
    for &(dt, rows, dim) in cases {
        rmsnorm_case(c, dt, rows, dim);
    }
}

pub(crate) fn rmsnorm_case(c: &mut Ctx, dt: CudaDType, rows: usize, dim: usize) {
    let shape = format!("{rows}x{dim}");
    c.guard("rmsnorm", dn(dt), &shape, |c| {
        let d = c.d;
        let eps = 1e-5;
        let x = c.rng.vals(dt, rows * dim, -2.0, 2.0);
        let w: Vec<f64> = c.rng.vals(F32, dim, 0.5, 1.5).iter().map(|&v| round_to(dt, v)).collect();
        let dy = c.rng.vals(dt, rows * dim, -1.0, 1.0);
        let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
        tpar_kernels::rmsnorm::rmsnorm_forward::<f64, _>(
            &x, &w, rows, dim, eps, &mut y, &mut rstd,
        )?;
        let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; dim]);
        tpar_kernels::rmsnorm::rmsnorm_backward::<f64, _>(
            &x, &w, &rstd, &dy, rows, dim, &mut dx, &mut dw,
        )?;
        let es = dt.size();
        let (bx, bw, bdy) = (d.up(dt, &x)?, d.up(dt, &w)?, d.up(dt, &dy)?);
        let (by, brstd, bdx, bdw) =
            (d.junk(x.len() * es)?, d.junk(rows * 4)?, d.junk(x.len() * es)?, d.junk(dim * 4)?);
        let ws = d.junk(rmsnorm::backward_workspace_bytes(rows, dim))?;
        // SAFETY: every buffer was allocated above with the size the op needs.
        unsafe {
            rmsnorm::rmsnorm_forward(
                d.l(),
                dt,
                bx.ptr(),
                bw.ptr(),
                by.ptr(),
                brstd.ptr(),
                rows,
                dim,
                eps as f32,
            )?;
            rmsnorm::rmsnorm_backward(
                d.l(),
                dt,
                bx.ptr(),
                bw.ptr(),
                brstd.ptr(),
                bdy.ptr(),
                bdx.ptr(),
                bdw.ptr(),
                ws.ptr(),
                rows,
                dim,
            )?;
        }
        let b = bound(dt);
        c.r.close("rmsnorm.y", dn(dt), &shape, &d.down(dt, &by)?, &y, b);
        c.r.close("rmsnorm.rstd", dn(dt), &shape, &d.down(F32, &brstd)?, &rstd, b);
        c.r.close("rmsnorm.dx", dn(dt), &shape, &d.down(dt, &bdx)?, &dx, b);
        c.r.close("rmsnorm.dw", dn(dt), &shape, &d.down(F32, &bdw)?, &dw, b);
        Ok(())
    });
}
