//! Flash attention (`cuda/sdpa.cu`) over device buffers;
//! [`crate::cuda::raw::sdpa`] documents the layouts, masking and kernel
//! families.

use super::{count, Check};
use crate::cuda::raw::sdpa as raw;
pub use crate::cuda::raw::sdpa::{
    sdpa_backward_workspace_bytes, SdpaPath, MAX_HEAD_DIM, MAX_TENSOR_CORE_HEAD_DIM,
};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
pub use crate::sdpa::SdpaShape;
use crate::Result;

/// An additive attention mask in device memory (elements of the attention
/// dtype): the element for `(b, h, i, j)` is at
/// `b*batch_stride + h*head_stride + i*row_stride + j`; a stride of 0
/// broadcasts. Every read is checked to fall inside `data`.
#[derive(Clone, Copy, Debug)]
pub struct SdpaMaskView<'a> {
    /// The mask's elements.
    pub data: DeviceSlice<'a>,
    /// Elements between batches.
    pub batch_stride: usize,
    /// Elements between q heads.
    pub head_stride: usize,
    /// Elements between query rows.
    pub row_stride: usize,
}

/// The buffers of [`sdpa_forward`].
#[derive(Debug)]
pub struct SdpaFwdViews<'a> {
    /// Queries `[batch, q_heads, q_len, head_dim]`.
    pub q: DeviceSlice<'a>,
    /// Keys `[batch, kv_heads, kv_len, head_dim]`.
    pub k: DeviceSlice<'a>,
    /// Values `[batch, kv_heads, kv_len, v_dim]`.
    pub v: DeviceSlice<'a>,
    /// Optional additive mask.
    pub mask: Option<SdpaMaskView<'a>>,
    /// Output `[batch, q_heads, q_len, v_dim]` (written).
    pub out: DeviceSliceMut<'a>,
    /// Log-sum-exp, f32 `[batch, q_heads, q_len]` (written).
    pub lse: DeviceSliceMut<'a>,
}

/// The buffers of [`sdpa_backward`].
#[derive(Debug)]
pub struct SdpaBwdViews<'a> {
    /// Queries, as in the forward pass.
    pub q: DeviceSlice<'a>,
    /// Keys, as in the forward pass.
    pub k: DeviceSlice<'a>,
    /// Values, as in the forward pass.
    pub v: DeviceSlice<'a>,
    /// The forward pass's mask.
    pub mask: Option<SdpaMaskView<'a>>,
    /// Forward output.
    pub out: DeviceSlice<'a>,
    /// Forward log-sum-exp (f32).
    pub lse: DeviceSlice<'a>,
    /// Gradient of the output.
    pub dout: DeviceSlice<'a>,
    /// Gradient of q (written).
    pub dq: DeviceSliceMut<'a>,
    /// Gradient of k (written; sums the q heads of each group).
    pub dk: DeviceSliceMut<'a>,
    /// Gradient of v (written; sums the q heads of each group).
    pub dv: DeviceSliceMut<'a>,
    /// Scratch memory of at least [`sdpa_backward_workspace_bytes`] bytes,
    /// 16-byte aligned.
    pub workspace: DeviceSliceMut<'a>,
}

/// Element counts of q, k, v and out, and the query rows.
fn sizes(op: &'static str, s: &SdpaShape) -> Result<[usize; 5]> {
    Ok([
        count(op, &[s.batch, s.q_heads, s.q_len, s.head_dim])?,
        count(op, &[s.batch, s.kv_heads, s.kv_len, s.head_dim])?,
        count(op, &[s.batch, s.kv_heads, s.kv_len, s.v_dim])?,
        count(op, &[s.batch, s.q_heads, s.q_len, s.v_dim])?,
        count(op, &[s.batch, s.q_heads, s.q_len])?,
    ])
}

/// The raw mask of a view: its address, and its length in elements (the
/// launch checks every read against it).
fn mask(
    c: &Check<'_>,
    dtype: CudaDType,
    m: Option<&SdpaMaskView<'_>>,
) -> Result<Option<raw::SdpaDevMask>> {
    let Some(m) = m else { return Ok(None) };
    let len = m.data.len() / dtype.size();
    Ok(Some(raw::SdpaDevMask {
        data: c.read("mask", &m.data, len, dtype.size())?,
        len,
        batch_stride: m.batch_stride,
        head_stride: m.head_stride,
        row_stride: m.row_stride,
    }))
}

/// Attention forward: `out = softmax(scale * q kᵀ + mask) v` per (batch, q
/// head), and `lse`, the log-sum-exp of each query row's scaled, masked
/// scores.
pub fn sdpa_forward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &SdpaShape,
    b: SdpaFwdViews<'_>,
    path: SdpaPath,
) -> Result<()> {
    const OP: &str = "cuda sdpa_forward";
    let c = Check::new(OP, dev);
    let ([nq, nk, nv, no, rows], es) = (sizes(OP, s)?, dtype.size());
    let buffers = raw::SdpaFwdBuffers {
        q: c.read("q", &b.q, nq, es)?,
        k: c.read("k", &b.k, nk, es)?,
        v: c.read("v", &b.v, nv, es)?,
        mask: mask(&c, dtype, b.mask.as_ref())?,
        out: c.write("out", &b.out, no, es)?,
        lse: c.write("lse", &b.lse, rows, 4)?,
    };
    // SAFETY: every buffer is a live view in `dev`'s memory holding the
    // elements `s` gives it (checked above), and the mask's length bounds
    // every mask read (checked by the launch); the written views are
    // exclusive borrows.
    unsafe { raw::sdpa_forward(dev, dtype, s, &buffers, path) }
}

/// Attention backward from the forward's `out` and `lse`: writes `dq`, `dk`
/// and `dv` (overwritten). No gradient is produced for the mask.
pub fn sdpa_backward(
    dev: &dyn GpuDevice,
    dtype: CudaDType,
    s: &SdpaShape,
    b: SdpaBwdViews<'_>,
    path: SdpaPath,
) -> Result<()> {
    const OP: &str = "cuda sdpa_backward";
    let c = Check::new(OP, dev);
    let ([nq, nk, nv, no, rows], es) = (sizes(OP, s)?, dtype.size());
    let ws = sdpa_backward_workspace_bytes(s)?;
    let buffers = raw::SdpaBwdBuffers {
        q: c.read("q", &b.q, nq, es)?,
        k: c.read("k", &b.k, nk, es)?,
        v: c.read("v", &b.v, nv, es)?,
        mask: mask(&c, dtype, b.mask.as_ref())?,
        out: c.read("out", &b.out, no, es)?,
        lse: c.read("lse", &b.lse, rows, 4)?,
        dout: c.read("dout", &b.dout, no, es)?,
        dq: c.write("dq", &b.dq, nq, es)?,
        dk: c.write("dk", &b.dk, nk, es)?,
        dv: c.write("dv", &b.dv, nv, es)?,
        workspace: c.write_bytes("workspace", &b.workspace, ws, 16)?,
        workspace_bytes: b.workspace.len(),
    };
    // SAFETY: as in `sdpa_forward`; the workspace holds what the backward
    // pass needs for `s` (checked above) and is exclusive.
    unsafe { raw::sdpa_backward(dev, dtype, s, &buffers, path) }
}
