//! The `sdpa` family of checks.

use tpar_kernels::cuda::raw::sdpa;
use tpar_kernels::cuda::raw::sdpa::{
    SdpaBwdBuffers, SdpaDevMask, SdpaFwdBuffers, SdpaLayout, SdpaPath, SdpaStrides,
};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::sdpa::{SdpaMask, SdpaShape};

use CudaDType::{BF16, F16, F32};

use super::{bound, Ctx, DTYPES};
use crate::data::dn;
use crate::dev::Dev;
use crate::Res;

pub(crate) fn sdpa_shape(
    batch: usize,
    hq: usize,
    hkv: usize,
    q_len: usize,
    kv_len: usize,
    d: usize,
    causal: bool,
) -> SdpaShape {
    SdpaShape {
        batch,
        q_heads: hq,
        kv_heads: hkv,
        q_len,
        kv_len,
        head_dim: d,
        v_dim: d,
        scale: 1.0 / (d as f64).sqrt(),
        causal,
    }
}

pub(crate) fn check_sdpa(c: &mut Ctx) {
    use SdpaPath::*;
    if c.quick {
        for dt in DTYPES {
            sdpa_case(c, dt, sdpa_shape(1, 4, 2, 72, 72, 64, true), Auto);
        }
        sdpa_case(c, BF16, sdpa_shape(1, 4, 2, 80, 80, 128, true), Auto);
        sdpa_case(c, BF16, sdpa_shape(1, 2, 1, 136, 136, 64, true), TensorCoreWide);
        sdpa_case(c, BF16, sdpa_shape(1, 4, 2, 72, 72, 64, true), Simt);
        sdpa_case(c, F16, sdpa_shape(2, 2, 1, 40, 70, 64, false), Auto);
        // q, k and v in one packed projection output, dq, dk and dv into one gradient
        packed_case(c, BF16, sdpa_shape(2, 4, 2, 72, 72, 64, true), Auto);
        packed_case(c, F16, sdpa_shape(1, 2, 1, 80, 80, 128, true), Auto);
        packed_case(c, F32, sdpa_shape(2, 2, 2, 40, 40, 32, false), Auto);
    } else {
        for dt in [BF16, F16] {
            sdpa_case(c, dt, sdpa_shape(2, 32, 8, 1024, 1024, 128, true), Auto);
        }
        sdpa_case(c, F32, sdpa_shape(1, 8, 2, 512, 512, 128, true), Auto);
        sdpa_case(c, BF16, sdpa_shape(4, 16, 4, 1024, 1024, 64, true), Auto);
        sdpa_case(c, BF16, sdpa_shape(1, 8, 2, 512, 512, 128, true), TensorCore);
        sdpa_case(c, BF16, sdpa_shape(1, 8, 2, 512, 512, 128, true), Simt);
        sdpa_case(c, BF16, sdpa_shape(2, 8, 8, 300, 1000, 128, false), Auto);
        // the training step's attention with fused projections
        packed_case(c, BF16, sdpa_shape(8, 16, 8, 1024, 1024, 64, true), Auto);
    }
    super::sdpa_hopper::check_sdpa_hopper(c);
}

/// The shape column of an attention row: `b<batch> h<q_heads>/<kv_heads>
/// s<q_len>x<kv_len> d<head_dim>`, then ` causal` where it is.
pub(crate) fn sdpa_label(s: &SdpaShape) -> String {
    format!(
        "b{} h{}/{} s{}x{} d{}{}",
        s.batch,
        s.q_heads,
        s.kv_heads,
        s.q_len,
        s.kv_len,
        s.head_dim,
        if s.causal { " causal" } else { "" }
    )
}

pub(crate) fn sdpa_case(c: &mut Ctx, dt: CudaDType, s: SdpaShape, path: SdpaPath) {
    let base = format!("sdpa.{}", format!("{path:?}").to_lowercase());
    train_case(c, &base, &sdpa_label(&s), dt, s, path, None, false);
}

/// [`sdpa_case`] on the packed layout: rows `sdpa.<path>.packed.*`.
fn packed_case(c: &mut Ctx, dt: CudaDType, s: SdpaShape, path: SdpaPath) {
    let base = format!("sdpa.{}.packed", format!("{path:?}").to_lowercase());
    train_case(c, &base, &sdpa_label(&s), dt, s, path, None, true);
}

/// Where the operands of a packed call lie: q, k and v side by side in each
/// row of one `[batch, len, (q_heads + 2 kv_heads) * head_dim]` buffer (a
/// fused q/k/v projection's output, and its gradient likewise), out and dout
/// as `[batch, len, q_heads * head_dim]`; each operand's first element and
/// the layout.
fn packed_layout(s: &SdpaShape) -> ([usize; 3], SdpaLayout) {
    let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
    let width = (hq + 2 * hkv) * d;
    let packed = Some(SdpaStrides::bshd(s.q_len, width, d));
    let out = Some(SdpaStrides::bshd(s.q_len, hq * d, d));
    ([0, hq * d, (hq + hkv) * d], SdpaLayout { q: packed, k: packed, v: packed, out })
}

/// The index pairs (dense, row-major) of dense `[batch, heads, len, d]`
/// values and their places in a `[batch, len, width]` buffer whose heads start
/// at column `at`, one per `d`-element run.
fn bshd_runs(
    [batch, heads, len, d]: [usize; 4],
    width: usize,
    at: usize,
) -> impl Iterator<Item = (usize, usize)> {
    (0..batch * heads * len).map(move |n| {
        let (b, h, i) = (n / (heads * len), n / len % heads, n % len);
        (n * d, (b * len + i) * width + at + h * d)
    })
}

/// Writes dense values into their places in `rows` ([`bshd_runs`]).
fn to_rows(dense: &[f64], rows: &mut [f64], dims: [usize; 4], width: usize, at: usize) {
    let d = dims[3];
    for (x, y) in bshd_runs(dims, width, at) {
        rows[y..y + d].copy_from_slice(&dense[x..x + d]);
    }
}

/// Reads dense values from their places in `rows` ([`bshd_runs`]).
fn from_rows(rows: &[f64], dims: [usize; 4], width: usize, at: usize) -> Vec<f64> {
    let d = dims[3];
    let mut dense = vec![0.0; dims.iter().product()];
    for (x, y) in bshd_runs(dims, width, at) {
        dense[x..x + d].copy_from_slice(&rows[y..y + d]);
    }
    dense
}

/// Forward and backward of `s` on `path` against the f64 CPU kernels, with
/// an optional `[batch, 1, 1, kv_len]` key-padding mask: rows `<base>.out`,
/// `.lse`, `.dq`, `.dk` and `.dv`. With `packed` (`q_len == kv_len`,
/// `head_dim == v_dim`) the device reads q, k and v from one packed buffer and
/// writes dq, dk and dv into one ([`packed_layout`]), as a fused projection's
/// attention does.
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_case(
    c: &mut Ctx,
    base: &str,
    shape: &str,
    dt: CudaDType,
    s: SdpaShape,
    path: SdpaPath,
    mask: Option<Vec<f64>>,
    packed: bool,
) {
    c.guard(base, dn(dt), shape, |c| {
        let d = c.d;
        let nq = s.batch * s.q_heads * s.q_len;
        let nk = s.batch * s.kv_heads * s.kv_len;
        let q = c.rng.vals(dt, nq * s.head_dim, -1.5, 1.5);
        let k = c.rng.vals(dt, nk * s.head_dim, -1.5, 1.5);
        let v = c.rng.vals(dt, nk * s.v_dim, -1.0, 1.0);
        let dout = c.rng.vals(dt, nq * s.v_dim, -1.0, 1.0);
        let host_mask = mask.as_ref().map(|m| SdpaMask {
            data: &m[..],
            batch_stride: s.kv_len,
            head_stride: 0,
            row_stride: 0,
        });
        let mut out = vec![0.0; nq * s.v_dim];
        let mut lse = vec![0.0; nq];
        tpar_kernels::sdpa::sdpa_forward::<f64, _>(
            &s,
            &q,
            &k,
            &v,
            host_mask.as_ref(),
            &mut out,
            &mut lse,
        )?;
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        tpar_kernels::sdpa::sdpa_backward::<f64>(
            &s,
            &q,
            &k,
            &v,
            host_mask.as_ref(),
            &out,
            &lse,
            &dout,
            &mut dq,
            &mut dk,
            &mut dv,
        )?;
        let es = dt.size();
        let (bl, ws_bytes) = (d.junk(nq * 4)?, sdpa::sdpa_backward_workspace_bytes(&s)?);
        let ws = d.junk(ws_bytes)?;
        // [out, dq, dk, dv] as the device wrote them, read back dense
        let got = if packed {
            let ([aq, ak, av], layout) = packed_layout(&s);
            let (hq, hkv, len, hd) = (s.q_heads, s.kv_heads, s.q_len, s.head_dim);
            let width = (hq + 2 * hkv) * hd;
            let mut rows = vec![0.0; s.batch * len * width];
            let mut dout_rows = vec![0.0; s.batch * len * hq * hd];
            let (qd, kd) = ([s.batch, hq, len, hd], [s.batch, hkv, len, hd]);
            to_rows(&q, &mut rows, qd, width, aq);
            to_rows(&k, &mut rows, kd, width, ak);
            to_rows(&v, &mut rows, kd, width, av);
            to_rows(&dout, &mut dout_rows, qd, hq * hd, 0);
            let (bqkv, bdo) = (d.up(dt, &rows)?, d.up(dt, &dout_rows)?);
            let (bo, grads) = (d.junk(dout_rows.len() * es)?, d.junk(rows.len() * es)?);
            let at = |p: DevPtr, e: usize| p + (e * es) as DevPtr;
            let (x, g, out, lse) = (bqkv.ptr(), grads.ptr(), bo.ptr(), bl.ptr());
            let (q, k, v) = (at(x, aq), at(x, ak), at(x, av));
            let fb = SdpaFwdBuffers { q, k, v, mask: None, out, lse, layout };
            let bb = SdpaBwdBuffers {
                q,
                k,
                v,
                mask: None,
                out,
                lse,
                dout: bdo.ptr(),
                dq: at(g, aq),
                dk: at(g, ak),
                dv: at(g, av),
                workspace: ws.ptr(),
                workspace_bytes: ws_bytes,
                layout,
            };
            // SAFETY: the packed buffers hold `batch * len` rows of `width`
            // elements, out and dout `batch * len` rows of `q_heads * head_dim`,
            // lse and the workspace their sizes; dq, dk and dv fill disjoint
            // columns of the gradient's rows.
            unsafe { launch(d, dt, &s, path, &fb, &bb)? };
            let (got_out, got_g) = (d.down(dt, &bo)?, d.down(dt, &grads)?);
            [
                from_rows(&got_out, qd, hq * hd, 0),
                from_rows(&got_g, qd, width, aq),
                from_rows(&got_g, kd, width, ak),
                from_rows(&got_g, kd, width, av),
            ]
        } else {
            let (bq, bk, bv) = (d.up(dt, &q)?, d.up(dt, &k)?, d.up(dt, &v)?);
            let bdo = d.up(dt, &dout)?;
            let bm = match &mask {
                Some(m) => Some(d.up(dt, m)?),
                None => None,
            };
            let dev_mask = bm.as_ref().map(|b| SdpaDevMask {
                data: b.ptr(),
                len: s.batch * s.kv_len,
                batch_stride: s.kv_len,
                head_stride: 0,
                row_stride: 0,
            });
            let bo = d.junk(out.len() * es)?;
            let (bdq, bdk) = (d.junk(q.len() * es)?, d.junk(k.len() * es)?);
            let bdv = d.junk(v.len() * es)?;
            let (q, k, v, out, lse) = (bq.ptr(), bk.ptr(), bv.ptr(), bo.ptr(), bl.ptr());
            let layout = SdpaLayout::default();
            let fb = SdpaFwdBuffers { q, k, v, mask: dev_mask, out, lse, layout };
            let bb = SdpaBwdBuffers {
                q,
                k,
                v,
                mask: dev_mask,
                out,
                lse,
                dout: bdo.ptr(),
                dq: bdq.ptr(),
                dk: bdk.ptr(),
                dv: bdv.ptr(),
                workspace: ws.ptr(),
                workspace_bytes: ws_bytes,
                layout,
            };
            // SAFETY: every buffer was allocated above with the size `s` gives it
            // (the mask with `batch * kv_len` elements).
            unsafe { launch(d, dt, &s, path, &fb, &bb)? };
            [d.down(dt, &bo)?, d.down(dt, &bdq)?, d.down(dt, &bdk)?, d.down(dt, &bdv)?]
        };
        let b = bound(dt);
        let name = |what: &str| format!("{base}.{what}");
        let [got_out, got_dq, got_dk, got_dv] = got;
        c.r.close(&name("out"), dn(dt), shape, &got_out, &out, b);
        c.r.close(&name("lse"), dn(dt), shape, &d.down(F32, &bl)?, &lse, b);
        c.r.close(&name("dq"), dn(dt), shape, &got_dq, &dq, b);
        c.r.close(&name("dk"), dn(dt), shape, &got_dk, &dk, b);
        c.r.close(&name("dv"), dn(dt), shape, &got_dv, &dv, b);
        Ok(())
    });
}

/// The forward then the backward of `s` on `path`.
///
/// # Safety
/// Every address of `fb` and `bb` must hold what `s` and their layouts reach.
unsafe fn launch(
    d: &Dev,
    dt: CudaDType,
    s: &SdpaShape,
    path: SdpaPath,
    fb: &SdpaFwdBuffers,
    bb: &SdpaBwdBuffers,
) -> Res<()> {
    // SAFETY: the caller's guarantee.
    unsafe {
        sdpa::sdpa_forward(d.l(), dt, s, fb, path)?;
        sdpa::sdpa_backward(d.l(), dt, s, bb, path)?;
    }
    Ok(())
}
