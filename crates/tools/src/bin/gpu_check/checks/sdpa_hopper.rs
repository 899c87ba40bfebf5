//! The Hopper attention's checks (part of the `sdpa` family), where the
//! device runs `sm_90a` kernels: a GPU whose kernels are compiled for
//! `sm_90a`, or the emulator with `TPAR_EMU_ARCH=sm_90a`. Forward
//! (`SdpaPath::Hopper`: `cuda/sdpa_hopper.cu`) and backward on the same path
//! (the Hopper backward where it takes the call) against the f64 CPU
//! kernels: bf16 and f16, head dims 64 and 128, causal or not, GQA, a
//! key-padding mask, ragged lengths; on a GPU, training-sized shapes.

use tpar_kernels::cuda::raw::sdpa::{self, SdpaBwdBuffers, SdpaDevMask, SdpaFwdBuffers, SdpaPath};
use tpar_kernels::cuda::raw::sdpa_hopper::{self, EMU_ARCH_ENV};
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::sdpa::{SdpaMask, SdpaShape};

use CudaDType::{BF16, F16, F32};

use super::sdpa::sdpa_shape;
use super::{bound, Ctx};
use crate::data::dn;

pub(crate) fn check_sdpa_hopper(c: &mut Ctx) {
    if sdpa_hopper::target_of(c.d.l()).is_none() {
        println!(
            "   sdpa_hopper: skipped (the device does not run sm_90a kernels; in the emulator \
             set {EMU_ARCH_ENV}=sm_90a)"
        );
        return;
    }
    if c.quick {
        // several q tiles and key tiles, ragged, GQA, causal
        hopper_case(c, BF16, sdpa_shape(1, 4, 2, 130, 200, 64, true), false);
        hopper_case(c, F16, sdpa_shape(1, 2, 1, 70, 150, 128, false), true);
        hopper_case(c, BF16, sdpa_shape(2, 2, 2, 100, 140, 128, true), true);
        hopper_case(c, F16, sdpa_shape(1, 2, 1, 140, 130, 64, true), false);
    } else {
        for dt in [BF16, F16] {
            hopper_case(c, dt, sdpa_shape(2, 32, 8, 1024, 1024, 128, true), false);
        }
        hopper_case(c, BF16, sdpa_shape(4, 16, 4, 1024, 1024, 64, true), false);
        hopper_case(c, BF16, sdpa_shape(2, 8, 8, 300, 1000, 128, false), true);
        hopper_case(c, F16, sdpa_shape(1, 8, 2, 2000, 2000, 128, true), true);
    }
}

/// A `[batch, 1, 1, kv_len]` key-padding mask: batch `b` keeps all but its
/// last `37 b + 5` keys (at least one).
fn key_padding(s: &SdpaShape) -> Vec<f64> {
    let mut m = vec![0.0; s.batch * s.kv_len];
    for b in 0..s.batch {
        let keep = s.kv_len.saturating_sub(37 * b + 5).max(1);
        m[b * s.kv_len + keep..(b + 1) * s.kv_len].fill(f64::NEG_INFINITY);
    }
    m
}

fn hopper_case(c: &mut Ctx, dt: CudaDType, s: SdpaShape, padded: bool) {
    let base = "sdpa_hopper";
    let shape = format!(
        "b{} h{}/{} s{}x{} d{}{}{}",
        s.batch,
        s.q_heads,
        s.kv_heads,
        s.q_len,
        s.kv_len,
        s.head_dim,
        if s.causal { " causal" } else { "" },
        if padded { " key-padding" } else { "" }
    );
    c.guard(base, dn(dt), &shape, |c| {
        let d = c.d;
        let nq = s.batch * s.q_heads * s.q_len;
        let nk = s.batch * s.kv_heads * s.kv_len;
        let q = c.rng.vals(dt, nq * s.head_dim, -1.5, 1.5);
        let k = c.rng.vals(dt, nk * s.head_dim, -1.5, 1.5);
        let v = c.rng.vals(dt, nk * s.v_dim, -1.0, 1.0);
        let dout = c.rng.vals(dt, nq * s.v_dim, -1.0, 1.0);
        let mask = padded.then(|| key_padding(&s));
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
        let (bq, bk, bv, bdo) = (d.up(dt, &q)?, d.up(dt, &k)?, d.up(dt, &v)?, d.up(dt, &dout)?);
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
        let (bo, bl) = (d.junk(out.len() * es)?, d.junk(nq * 4)?);
        let (bdq, bdk, bdv) = (d.junk(q.len() * es)?, d.junk(k.len() * es)?, d.junk(v.len() * es)?);
        let ws_bytes = sdpa::sdpa_backward_workspace_bytes(&s)?;
        let ws = d.junk(ws_bytes)?;
        let fb = SdpaFwdBuffers {
            q: bq.ptr(),
            k: bk.ptr(),
            v: bv.ptr(),
            mask: dev_mask,
            out: bo.ptr(),
            lse: bl.ptr(),
        };
        let bb = SdpaBwdBuffers {
            q: bq.ptr(),
            k: bk.ptr(),
            v: bv.ptr(),
            mask: dev_mask,
            out: bo.ptr(),
            lse: bl.ptr(),
            dout: bdo.ptr(),
            dq: bdq.ptr(),
            dk: bdk.ptr(),
            dv: bdv.ptr(),
            workspace: ws.ptr(),
            workspace_bytes: ws_bytes,
        };
        // SAFETY: every buffer was allocated above with the size `s` gives it
        // (the mask with `batch * kv_len` elements).
        unsafe {
            sdpa::sdpa_forward(d.l(), dt, &s, &fb, SdpaPath::Hopper)?;
            sdpa::sdpa_backward(d.l(), dt, &s, &bb, SdpaPath::Hopper)?;
        }
        let b = bound(dt);
        let name = |what: &str| format!("{base}.{what}");
        c.r.close(&name("out"), dn(dt), &shape, &d.down(dt, &bo)?, &out, b);
        c.r.close(&name("lse"), dn(dt), &shape, &d.down(F32, &bl)?, &lse, b);
        c.r.close(&name("dq"), dn(dt), &shape, &d.down(dt, &bdq)?, &dq, b);
        c.r.close(&name("dk"), dn(dt), &shape, &d.down(dt, &bdk)?, &dk, b);
        c.r.close(&name("dv"), dn(dt), &shape, &d.down(dt, &bdv)?, &dv, b);
        Ok(())
    });
}
