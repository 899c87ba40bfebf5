//! The `gemm_pad` family: the LM head's three products (vocabulary 259, so
//! some operand rows are not 16-byte aligned) through `ops::gemm::gemm_with`
//! with every unaligned operand staged in padded scratch
//! (`PadPolicy::Always`) and without (`PadPolicy::Never`), on tpar's kernel
//! and, on a GPU, on cuBLASLt: `gemm_pad.<layout>` compares the padded
//! result with the f64 reference, `gemm_pad.<layout>.same` with the
//! unpadded one (which may run another kernel, so within the output type's
//! bound rather than bitwise).

use tpar_kernels::cuda::ops::gemm::{gemm_with, GemmBackend};
use tpar_kernels::cuda::ops::gemm_pad::PadPolicy;
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::CudaDType::{BF16, F16, F32};
use tpar_kernels::gemm::GemmShape;

use super::gemm::{gemm_inputs, gemm_label, layout_name, GemmData};
use super::{bound, Ctx};
use crate::Res;

/// The LM head's products for `(tokens, vocabulary, hidden)`, as (A
/// transposed, B transposed, `[m, n, k]`): forward NT `[t, v, h]`, input
/// gradient NN `[t, h, v]` and weight gradient TN `[v, h, t]`.
pub(crate) fn lm_head_products((t, v, h): (usize, usize, usize)) -> [(bool, bool, [usize; 3]); 3] {
    [(false, true, [t, v, h]), (false, false, [t, h, v]), (true, false, [v, h, t])]
}

pub(crate) fn check_gemm_pad(c: &mut Ctx) {
    let size = if c.quick { (96, 259, 64) } else { (1024, 259, 256) };
    let vendor = c.d.cuda().is_some();
    for (din, dout) in [(BF16, BF16), (F16, F32)] {
        for (ta, tb, [m, n, k]) in lm_head_products(size) {
            for beta in [0.0, 1.0] {
                let s = GemmShape { trans_a: ta, trans_b: tb, ..GemmShape::new(1, m, n, k) };
                let p = GemmProblem::new(s, din, dout).with_scale(1.0, beta);
                pad_case(c, p, GemmBackend::Ours);
                if vendor {
                    pad_case(c, p, GemmBackend::Vendor);
                }
            }
        }
    }
}

/// One product on `backend`, padded and not.
fn pad_case(c: &mut Ctx, p: GemmProblem, backend: GemmBackend) {
    let s = p.shape;
    let lib = if backend == GemmBackend::Vendor { ".cublaslt" } else { "" };
    let name = format!("gemm_pad.{}{lib}", layout_name(s.trans_a, s.trans_b));
    let (dtype, shape) = gemm_label(&p);
    c.guard(&name, &dtype, &shape, |c| {
        let d = c.d;
        let GemmData { a, b, c_old, want } = gemm_inputs(c, &p)?;
        let (da, db) = (d.up(p.dtype_in, &a)?, d.up(p.dtype_in, &b)?);
        let run = |pad| -> Res<Vec<f64>> {
            let mut dc = d.up(p.dtype_out, &c_old)?;
            gemm_with(&*d.mem, &p, da.as_slice(), db.as_slice(), dc.as_slice_mut(), backend, pad)?;
            d.down(p.dtype_out, &dc)
        };
        let (padded, plain) = (run(PadPolicy::Always)?, run(PadPolicy::Never)?);
        let bd = bound(p.dtype_out);
        c.r.close_note(&name, &dtype, &shape, &padded, &want, bd, "padded vs f64");
        let same = format!("{name}.same");
        c.r.close_note(&same, &dtype, &shape, &padded, &plain, bd, "padded vs unpadded");
        Ok(())
    });
}
