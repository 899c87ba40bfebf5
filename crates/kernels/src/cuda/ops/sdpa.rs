//! Flash attention (`cuda/sdpa.cu`, and `cuda/sdpa_hopper.cu` /
//! `cuda/sdpa_hopper_bwd.cu` on request) over device buffers;
//! [`crate::cuda::raw::sdpa`] documents the layouts, masking and kernel
//! families.
//!
//! Calls with [`SdpaPath::Auto`] (what the tensor layer's attention passes)
//! take their kernels from [`SDPA_BACKEND_ENV`] ([`sdpa_backend`]): unset or
//! `auto`, and `mma`, run the `mma.sync` tensor-core kernels (SIMT where they
//! do not apply); `hopper` runs the Hopper kernels where the device runs
//! `sm_90a` kernels and they take the call, and falls back to the `mma.sync`
//! kernels for every other call (forward and backward are chosen
//! separately). The Hopper kernels have not run on a GPU yet, so `auto` does
//! not pick them.

use std::sync::OnceLock;

use super::{count, Check};
use crate::cuda::raw::sdpa as raw;
pub use crate::cuda::raw::sdpa::{
    sdpa_backward_workspace_bytes, SdpaLayout, SdpaPath, SdpaStrides, MAX_HEAD_DIM,
    MAX_TENSOR_CORE_HEAD_DIM,
};
use crate::cuda::raw::{sdpa_hopper, sdpa_hopper_bwd};
use crate::cuda::{CudaDType, DeviceSlice, DeviceSliceMut, GpuDevice};
pub use crate::sdpa::SdpaShape;
use crate::Result;

/// Environment variable choosing the kernels of [`SdpaPath::Auto`] calls:
/// `auto`, `hopper` or `mma` (see [`SdpaBackend`]); read once per process.
pub const SDPA_BACKEND_ENV: &str = "TPAR_SDPA";

/// Which attention kernels [`SdpaPath::Auto`] calls of [`sdpa_forward`] and
/// [`sdpa_backward`] run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SdpaBackend {
    /// `SdpaPath::Auto`'s own choice: the `mma.sync` tensor-core kernels
    /// where they apply, else SIMT.
    Auto,
    /// The Hopper kernels ([`SdpaPath::Hopper`]) for the calls they take on
    /// a device running `sm_90a` kernels, `Auto`'s choice for the others.
    Hopper,
    /// The `mma.sync` tensor-core kernels (SIMT where they do not apply).
    Mma,
}

impl SdpaBackend {
    /// Parses `auto`, `hopper` and `mma`.
    pub fn parse(s: &str) -> Option<SdpaBackend> {
        match s {
            "auto" => Some(SdpaBackend::Auto),
            "hopper" => Some(SdpaBackend::Hopper),
            "mma" => Some(SdpaBackend::Mma),
            _ => None,
        }
    }
}

/// The backend [`SDPA_BACKEND_ENV`] names; unset, [`SdpaBackend::Auto`]. A
/// value that names no backend is reported once on stderr and the default is
/// used.
pub fn sdpa_backend() -> SdpaBackend {
    static B: OnceLock<SdpaBackend> = OnceLock::new();
    *B.get_or_init(|| {
        let Some(v) = std::env::var_os(SDPA_BACKEND_ENV) else { return SdpaBackend::Auto };
        let v = v.to_string_lossy();
        SdpaBackend::parse(v.trim()).unwrap_or_else(|| {
            eprintln!(
                "tpar: {SDPA_BACKEND_ENV}={v:?} names no attention backend (auto, hopper or \
                 mma); using auto"
            );
            SdpaBackend::Auto
        })
    })
}

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
    /// Where q, k, v and out lie in their views (dense by default; each
    /// view starts at its operand's element `(0, 0, 0, 0)`).
    pub layout: SdpaLayout,
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
    /// Where dq, dk and dv are written (overwritten; dk and dv sum the q
    /// heads of each group).
    pub grads: SdpaGrads<'a>,
    /// Scratch memory of at least [`sdpa_backward_workspace_bytes`] bytes,
    /// 16-byte aligned.
    pub workspace: DeviceSliceMut<'a>,
    /// Where q/dq, k/dk, v/dv and out/dout lie in their views (dense by
    /// default).
    pub layout: SdpaLayout,
}

/// Where [`sdpa_backward`] writes the gradients of q, k and v, each at its
/// operand's strides in [`SdpaBwdViews::layout`] (q's for dq, k's for dk,
/// v's for dv).
#[derive(Debug)]
pub enum SdpaGrads<'a> {
    /// Each gradient in a view of its own, starting at its element
    /// `(0, 0, 0, 0)`.
    Separate {
        /// Gradient of q.
        dq: DeviceSliceMut<'a>,
        /// Gradient of k.
        dk: DeviceSliceMut<'a>,
        /// Gradient of v.
        dv: DeviceSliceMut<'a>,
    },
    /// The three in one buffer, as the gradient of a packed
    /// `[batch, len, (q_heads + 2 kv_heads) * head_dim]` q/k/v projection
    /// holds them: dq's element `(0, 0, 0, 0)` at element `at[0]` of `dqkv`,
    /// dk's at `at[1]`, dv's at `at[2]`. They must not share an element,
    /// which is checked in the form such a buffer has: `q_len == kv_len`,
    /// the three with one row stride (and, over more than one batch, one
    /// batch stride that is a multiple of it and spans the rows), and each
    /// gradient's heads inside a row, in column ranges that do not meet.
    Packed {
        /// The buffer.
        dqkv: DeviceSliceMut<'a>,
        /// Where dq, dk and dv start, in elements.
        at: [usize; 3],
    },
}

/// Why packed gradients at `at` could share an element under `layout`
/// (see [`SdpaGrads::Packed`]), if they could.
fn packed_overlap(s: &SdpaShape, layout: &raw::SdpaLayout, at: [usize; 3]) -> Option<String> {
    let [q, k, v, _] = layout.resolve(s);
    let all = [
        ("dq", q, s.q_heads, s.head_dim, at[0]),
        ("dk", k, s.kv_heads, s.head_dim, at[1]),
        ("dv", v, s.kv_heads, s.v_dim, at[2]),
    ];
    let live: Vec<_> = all.into_iter().filter(|&(_, _, h, d, _)| h * d > 0).collect();
    if s.batch == 0 || s.q_len == 0 || live.is_empty() {
        return None;
    }
    if s.q_len != s.kv_len {
        return Some(format!("q_len {} and kv_len {} differ", s.q_len, s.kv_len));
    }
    let first = live[0].1;
    // The elements between the rows of one sequence (or between the batches, with one
    // row each; with one row in all, no bound): every gradient's heads lie inside such a
    // row.
    let pitch = match (s.q_len, s.batch) {
        (1, 1) => usize::MAX,
        (1, _) => first.batch,
        _ => first.row,
    };
    let mut spans = Vec::with_capacity(live.len());
    for (name, st, heads, dim, start) in live {
        if s.q_len > 1 && st.row != first.row {
            return Some(format!("{name} row stride {} is not dq's {}", st.row, first.row));
        }
        let whole_rows =
            s.q_len == 1 || (st.batch.is_multiple_of(pitch) && st.batch / pitch >= s.q_len);
        if s.batch > 1 && (st.batch != first.batch || !whole_rows) {
            return Some(format!(
                "{name} batch stride {} is not one whole number of rows of {pitch} elements \
                 shared by the three",
                st.batch
            ));
        }
        if heads > 1 && st.head < dim {
            return Some(format!("{name} head stride {} is below its dim {dim}", st.head));
        }
        let end =
            (heads - 1).checked_mul(st.head).and_then(|e| e.checked_add(dim)?.checked_add(start));
        match end {
            Some(end) if end <= pitch => spans.push((name, start, end)),
            _ => {
                return Some(format!("{name} at element {start} does not fit in a row of {pitch}"))
            }
        }
    }
    for (i, &(a, a0, a1)) in spans.iter().enumerate() {
        for &(b, b0, b1) in &spans[i + 1..] {
            if a0 < b1 && b0 < a1 {
                return Some(format!(
                    "{a} (columns {a0}..{a1}) and {b} (columns {b0}..{b1}) overlap"
                ));
            }
        }
    }
    None
}

/// Elements q, k, v and out span under `layout`, and the query rows.
fn sizes(op: &'static str, s: &SdpaShape, layout: &raw::SdpaLayout) -> Result<[usize; 5]> {
    let [q, k, v, out] = raw::layout_extents(op, s, layout)?;
    Ok([q, k, v, out, count(op, &[s.batch, s.q_heads, s.q_len])?])
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
    let ([nq, nk, nv, no, rows], es) = (sizes(OP, s, &b.layout)?, dtype.size());
    let buffers = raw::SdpaFwdBuffers {
        q: c.read("q", &b.q, nq, es)?,
        k: c.read("k", &b.k, nk, es)?,
        v: c.read("v", &b.v, nv, es)?,
        mask: mask(&c, dtype, b.mask.as_ref())?,
        out: c.write("out", &b.out, no, es)?,
        lse: c.write("lse", &b.lse, rows, 4)?,
        layout: b.layout,
    };
    let path = match (path, sdpa_backend()) {
        (SdpaPath::Auto, SdpaBackend::Hopper)
            if sdpa_hopper::unsupported(dev, dtype, s, &buffers).is_none() =>
        {
            SdpaPath::Hopper
        }
        _ => path,
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
    let ([nq, nk, nv, no, rows], es) = (sizes(OP, s, &b.layout)?, dtype.size());
    let ws = sdpa_backward_workspace_bytes(s)?;
    let [dq, dk, dv] = match &b.grads {
        SdpaGrads::Separate { dq, dk, dv } => {
            [c.write("dq", dq, nq, es)?, c.write("dk", dk, nk, es)?, c.write("dv", dv, nv, es)?]
        }
        SdpaGrads::Packed { dqkv, at } => {
            if let Some(why) = packed_overlap(s, &b.layout, *at) {
                return Err(crate::util::bad(OP, format!("packed gradients: {why}")));
            }
            let one = |what, i: usize, n| c.write_at(what, dqkv, at[i], n, es);
            [one("dq", 0, nq)?, one("dk", 1, nk)?, one("dv", 2, nv)?]
        }
    };
    let buffers = raw::SdpaBwdBuffers {
        q: c.read("q", &b.q, nq, es)?,
        k: c.read("k", &b.k, nk, es)?,
        v: c.read("v", &b.v, nv, es)?,
        mask: mask(&c, dtype, b.mask.as_ref())?,
        out: c.read("out", &b.out, no, es)?,
        lse: c.read("lse", &b.lse, rows, 4)?,
        dout: c.read("dout", &b.dout, no, es)?,
        dq,
        dk,
        dv,
        workspace: c.write_bytes("workspace", &b.workspace, ws, 16)?,
        workspace_bytes: b.workspace.len(),
        layout: b.layout,
    };
    let path = match (path, sdpa_backend()) {
        (SdpaPath::Auto, SdpaBackend::Hopper)
            if sdpa_hopper_bwd::unsupported(dev, dtype, s, &buffers).is_none() =>
        {
            SdpaPath::Hopper
        }
        _ => path,
    };
    // SAFETY: as in `sdpa_forward`; the workspace holds what the backward
    // pass needs for `s` (checked above) and is exclusive.
    unsafe { raw::sdpa_backward(dev, dtype, s, &buffers, path) }
}
