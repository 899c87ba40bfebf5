//! Attention test inputs shared by `emu_sdpa.rs`, `emu_sdpa_hopper.rs` and
//! `emu_sdpa_hopper_bwd.rs`: shapes, additive masks and the error measures
//! against the f64 reference.

use tpar_kernels::cuda::raw::sdpa::SdpaDevMask;
use tpar_kernels::sdpa::{SdpaMask, SdpaShape};

use tpar_kernels::cuda::raw::sdpa::sdpa_backward_workspace_bytes;
use tpar_kernels::cuda::DevPtr;

use super::{data, mptr, ptr};

/// An attention shape with the usual `1 / sqrt(head_dim)` scale.
#[allow(clippy::too_many_arguments)]
pub fn shape(
    batch: usize,
    q_heads: usize,
    kv_heads: usize,
    q_len: usize,
    kv_len: usize,
    head_dim: usize,
    v_dim: usize,
    causal: bool,
) -> SdpaShape {
    SdpaShape {
        batch,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        v_dim,
        scale: 1.0 / (head_dim.max(1) as f64).sqrt(),
        causal,
    }
}

/// [`shape`] with `v_dim == head_dim`.
pub fn same_dim_shape(
    batch: usize,
    q_heads: usize,
    kv_heads: usize,
    q_len: usize,
    kv_len: usize,
    head_dim: usize,
    causal: bool,
) -> SdpaShape {
    shape(batch, q_heads, kv_heads, q_len, kv_len, head_dim, head_dim, causal)
}

/// Mask layouts.
#[derive(Clone, Copy, Debug)]
pub enum MaskKind {
    None,
    /// `[batch, 1, 1, kv_len]`: a trailing run of padded keys per batch.
    KeyPadding,
    /// `[batch, q_heads, q_len, kv_len]`: random values, some `-inf`, and one
    /// fully masked query row per head.
    Full,
}

/// Where a test's masks put their `-inf` runs: with
/// [`MaskKind::KeyPadding`], batch `b` keeps `kv_len - pad_step * b -
/// pad_base` keys (at least one); with [`MaskKind::Full`], head `bh` (batch
/// times heads) masks the whole query row `(bh * row_step + 2) % q_len`.
#[derive(Clone, Copy, Debug)]
pub struct MaskPlan {
    pub pad_step: usize,
    pub pad_base: usize,
    pub row_step: usize,
}

/// Mask values and strides `(batch, head, row)` of `kind` for `s`.
pub fn make_mask(s: &SdpaShape, kind: MaskKind, plan: MaskPlan) -> Option<(Vec<f64>, [usize; 3])> {
    let ninf = f64::NEG_INFINITY;
    match kind {
        MaskKind::None => None,
        MaskKind::KeyPadding => {
            let mut m = vec![0.0; s.batch * s.kv_len];
            for b in 0..s.batch {
                let keep = s.kv_len.saturating_sub(plan.pad_step * b + plan.pad_base).max(1);
                m[b * s.kv_len + keep..(b + 1) * s.kv_len].fill(ninf);
            }
            Some((m, [s.kv_len, 0, 0]))
        }
        MaskKind::Full => {
            let row = s.kv_len;
            let head = s.q_len * row;
            let n = s.batch * s.q_heads * head;
            let mut m = data(n, 99, 1.0);
            for (i, x) in m.iter_mut().enumerate() {
                if i % 7 == 3 {
                    *x = ninf;
                }
            }
            for bh in 0..s.batch * s.q_heads {
                let r = (bh * plan.row_step + 2) % s.q_len;
                m[bh * head + r * row..bh * head + (r + 1) * row].fill(ninf);
            }
            Some((m, [s.q_heads * head, head, row]))
        }
    }
}

/// The reference op's view of mask values `m` with strides `(batch, head,
/// row)`.
pub fn ref_mask(
    m: &[f64],
    [batch_stride, head_stride, row_stride]: [usize; 3],
) -> SdpaMask<'_, f64> {
    SdpaMask { data: m, batch_stride, head_stride, row_stride }
}

/// The kernels' view of the host mask buffer `m` with strides `(batch, head,
/// row)`.
pub fn dev_mask<T>(m: &[T], [batch_stride, head_stride, row_stride]: [usize; 3]) -> SdpaDevMask {
    SdpaDevMask { data: ptr(m), len: m.len(), batch_stride, head_stride, row_stride }
}

/// Largest `|got - want|` relative to the largest `|want|`; both must be finite.
pub fn max_rel(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(got.iter().all(|x| x.is_finite()), "{what}: non-finite value");
    let scale = want.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs() / scale))
}

/// `lse` matches where finite (absolute-plus-relative), and `-inf` exactly.
pub fn check_lse(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lse length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        let ok = if w.is_infinite() { g == w } else { (g - w).abs() <= tol * (1.0 + w.abs()) };
        assert!(ok, "{what}: lse[{i}] = {g}, want {w}");
    }
}

/// A host buffer standing in for the backward's device workspace, filled
/// with 7.0 (garbage the kernels must overwrite) and used from a 16-byte
/// aligned start.
pub struct Workspace {
    buf: Vec<f32>,
    off: usize,
    /// Bytes the backward of the shape needs.
    pub bytes: usize,
}

impl Workspace {
    /// The workspace [`sdpa_backward_workspace_bytes`] asks for `s`.
    pub fn new(s: &SdpaShape) -> Self {
        let bytes = sdpa_backward_workspace_bytes(s).unwrap();
        let buf = vec![7.0f32; bytes.div_ceil(4) + 4];
        let off = (16 - (ptr(&buf) as usize % 16)) % 16 / 4;
        Workspace { buf, off, bytes }
    }

    /// The 16-byte aligned address the kernels write.
    pub fn ptr(&mut self) -> DevPtr {
        mptr(&mut self.buf[self.off..])
    }
}
