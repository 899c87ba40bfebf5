//! The `rope` family of checks.

use tpar_kernels::cuda::raw::rope;
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::rope::reference::swap12;
use tpar_kernels::rope::RopeShape;

use CudaDType::{BF16, F16, F32};

use super::{bound, Ctx};
use crate::data::{dn, round_to};

/// HF-layout RoPE tables `[seq, head_dim]` (theta 10000), rounded to `dt`.
pub(crate) fn rope_tables(dt: CudaDType, seq: usize, hd: usize) -> (Vec<f64>, Vec<f64>) {
    let half = (hd / 2).max(1);
    let mut cos = Vec::with_capacity(seq * hd);
    let mut sin = Vec::with_capacity(seq * hd);
    for p in 0..seq {
        for j in 0..hd {
            let inv = 10000f64.powf(-2.0 * (j % half) as f64 / hd as f64);
            cos.push(round_to(dt, (p as f64 * inv).cos()));
            sin.push(round_to(dt, (p as f64 * inv).sin()));
        }
    }
    (cos, sin)
}

pub(crate) fn rope_label(s: &RopeShape) -> String {
    format!("o{} s{} i{} d{}", s.outer, s.seq, s.inner, s.head_dim)
}

pub(crate) fn check_rope(c: &mut Ctx) {
    let rs = |outer, seq, inner, head_dim| RopeShape { outer, seq, inner, head_dim };
    let cases: Vec<(CudaDType, RopeShape)> = if c.quick {
        vec![(F32, rs(3, 17, 2, 64)), (BF16, rs(3, 17, 2, 64)), (F16, rs(2, 9, 3, 6))]
    } else {
        vec![(BF16, rs(64, 2048, 1, 128)), (F32, rs(4, 1024, 8, 128)), (F16, rs(2, 1024, 32, 128))]
    };
    for (dt, s) in cases {
        rope_case(c, dt, s);
    }
    let (q, k) = if c.quick {
        (rs(2 * 4, 17, 1, 64), rs(2 * 2, 17, 1, 64))
    } else {
        (rs(2 * 32, 2048, 1, 128), rs(2 * 8, 2048, 1, 128))
    };
    rope_qk_case(c, BF16, q, k);
    // (b, s, h, d): [b, s, h, d] in, the rotated [b, h, s, d] out, and back
    let orders = if c.quick {
        vec![(BF16, rs(2, 17, 3, 64)), (F16, rs(2, 9, 3, 6))]
    } else {
        vec![(BF16, rs(2, 2048, 32, 128))]
    };
    for (dt, s) in orders {
        rope_orders_case(c, dt, s);
    }
}

/// The two-order kernel: `x` `[b, s, h, d]` (`s` is `(b, s, h, d)`) rotated into
/// `[b, h, s, d]`, and the gradient `[b, h, s, d]` back into `[b, s, h, d]`, against
/// the f64 transpose and rotation.
pub(crate) fn rope_orders_case(c: &mut Ctx, dt: CudaDType, s: RopeShape) {
    use rope::RopeOrder::{InnerSeq, SeqInner};
    let shape = rope_label(&s);
    c.guard("rope.orders", dn(dt), &shape, |c| {
        let d = c.d;
        let (b, seq, h, hd) = (s.outer, s.seq, s.inner, s.head_dim);
        let n = b * seq * h * hd;
        let flat = RopeShape { outer: b * h, seq, inner: 1, head_dim: hd };
        let x = c.rng.vals(dt, n, -2.0, 2.0);
        let dy = c.rng.vals(dt, n, -1.0, 1.0);
        let (cos, sin) = rope_tables(dt, seq, hd);
        let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
        let xt = swap12(&x, (b, seq, h, hd));
        tpar_kernels::rope::rope_forward::<f64, _>(&flat, &xt, &cos, &sin, &mut y)?;
        tpar_kernels::rope::rope_backward::<f64, _>(&flat, &dy, &cos, &sin, &mut dx)?;
        let dx = swap12(&dx, (b, h, seq, hd));
        let (bx, bdy, bc, bs) = (d.up(dt, &x)?, d.up(dt, &dy)?, d.up(dt, &cos)?, d.up(dt, &sin)?);
        let (by, bdx) = (d.junk(n * dt.size())?, d.junk(n * dt.size())?);
        let (pc, ps) = (bc.ptr(), bs.ptr());
        // SAFETY: every buffer was allocated above with the size `s` gives it; both
        // orders are dense over those `n` elements.
        unsafe {
            rope::rope_forward_orders(
                d.l(),
                dt,
                &s,
                bx.ptr(),
                SeqInner,
                pc,
                ps,
                by.ptr(),
                InnerSeq,
            )?;
            rope::rope_backward_orders(
                d.l(),
                dt,
                &s,
                bdy.ptr(),
                InnerSeq,
                pc,
                ps,
                bdx.ptr(),
                SeqInner,
            )?;
        }
        c.r.close("rope.orders.fwd", dn(dt), &shape, &d.down(dt, &by)?, &y, bound(dt));
        c.r.close("rope.orders.bwd", dn(dt), &shape, &d.down(dt, &bdx)?, &dx, bound(dt));
        Ok(())
    });
}

pub(crate) fn rope_case(c: &mut Ctx, dt: CudaDType, s: RopeShape) {
    let shape = rope_label(&s);
    c.guard("rope", dn(dt), &shape, |c| {
        let d = c.d;
        let n = s.outer * s.seq * s.inner * s.head_dim;
        let x = c.rng.vals(dt, n, -2.0, 2.0);
        let dy = c.rng.vals(dt, n, -1.0, 1.0);
        let (cos, sin) = rope_tables(dt, s.seq, s.head_dim);
        let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
        tpar_kernels::rope::rope_forward::<f64, _>(&s, &x, &cos, &sin, &mut y)?;
        tpar_kernels::rope::rope_backward::<f64, _>(&s, &dy, &cos, &sin, &mut dx)?;
        let (bx, bdy, bc, bs) = (d.up(dt, &x)?, d.up(dt, &dy)?, d.up(dt, &cos)?, d.up(dt, &sin)?);
        let (by, bdx) = (d.junk(n * dt.size())?, d.junk(n * dt.size())?);
        // SAFETY: every buffer was allocated above with the size `s` gives it.
        unsafe {
            rope::rope_forward(d.l(), dt, &s, bx.ptr(), bc.ptr(), bs.ptr(), by.ptr())?;
            rope::rope_backward(d.l(), dt, &s, bdy.ptr(), bc.ptr(), bs.ptr(), bdx.ptr())?;
        }
        c.r.close("rope.fwd", dn(dt), &shape, &d.down(dt, &by)?, &y, bound(dt));
        c.r.close("rope.bwd", dn(dt), &shape, &d.down(dt, &bdx)?, &dx, bound(dt));
        Ok(())
    });
}

/// Queries and keys (GQA: fewer key heads) rotated in place.
pub(crate) fn rope_qk_case(c: &mut Ctx, dt: CudaDType, qs: RopeShape, ks: RopeShape) {
    let shape = format!("q {} k o{}", rope_label(&qs), ks.outer);
    c.guard("rope.qk_inplace", dn(dt), &shape, |c| {
        let d = c.d;
        let nq = qs.outer * qs.seq * qs.inner * qs.head_dim;
        let nk = ks.outer * ks.seq * ks.inner * ks.head_dim;
        let (q, k) = (c.rng.vals(dt, nq, -2.0, 2.0), c.rng.vals(dt, nk, -2.0, 2.0));
        let (cos, sin) = rope_tables(dt, qs.seq, qs.head_dim);
        let (mut qr, mut kr) = (vec![0.0; nq], vec![0.0; nk]);
        tpar_kernels::rope::rope_forward::<f64, _>(&qs, &q, &cos, &sin, &mut qr)?;
        tpar_kernels::rope::rope_forward::<f64, _>(&ks, &k, &cos, &sin, &mut kr)?;
        let (bq, bk, bc, bs) = (d.up(dt, &q)?, d.up(dt, &k)?, d.up(dt, &cos)?, d.up(dt, &sin)?);
        // SAFETY: every buffer was allocated above with the size its shape gives it.
        unsafe {
            rope::rope_qk_inplace(
                d.l(),
                dt,
                &qs,
                bq.ptr(),
                &ks,
                bk.ptr(),
                bc.ptr(),
                bs.ptr(),
                false,
            )?
        };
        let parts =
            vec![("q".to_string(), d.down(dt, &bq)?, qr), ("k".to_string(), d.down(dt, &bk)?, kr)];
        c.r.close_parts("rope.qk_inplace", dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}
