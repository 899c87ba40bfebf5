//! Attention test inputs shared by `emu/sdpa.rs`, `emu/sdpa_strided.rs`,
//! `emu_sm90a/sdpa_hopper.rs` and `emu_sm90a/sdpa_hopper_bwd.rs`: shapes, additive masks,
//! one case's inputs and buffers, the error measures against the f64
//! reference, and the placement of strided operands in host buffers.

use tpar_kernels::cuda::raw::sdpa::{
    SdpaBwdBuffers, SdpaDevMask, SdpaFwdBuffers, SdpaLayout, SdpaStrides,
};
use tpar_kernels::sdpa::{reference, SdpaMask, SdpaShape};
use tpar_kernels::Float;

use tpar_kernels::cuda::raw::sdpa::{
    sdpa_backward, sdpa_backward_workspace_bytes, sdpa_forward, SdpaPath,
};
use tpar_kernels::cuda::{CudaDType, DevPtr};

use super::{cvt, data, f64s, mptr, ptr};

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

/// Floats of zeros after a [`Workspace`]: one 64-query tile of f32 rows at
/// head dim 128, so a kernel adding a whole tile past the dq accumulator's
/// end stays in the buffer and shows in [`Workspace::guard_intact`].
const WORKSPACE_GUARD: usize = 64 * 128;

/// A host buffer standing in for the backward's device workspace, filled
/// with 7.0 (garbage the kernels must overwrite) and used from a 16-byte
/// aligned start, followed by a guard of zeros no kernel may touch.
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
        let mut buf = vec![7.0f32; bytes.div_ceil(4) + 4 + WORKSPACE_GUARD];
        let off = (16 - (ptr(&buf) as usize % 16)) % 16 / 4;
        buf[off + bytes.div_ceil(4)..].fill(0.0);
        Workspace { buf, off, bytes }
    }

    /// Whether every float after the workspace's `bytes` is still +0.0 (a
    /// kernel wrote or added nothing past its end).
    pub fn guard_intact(&self) -> bool {
        self.buf[self.off + self.bytes.div_ceil(4)..].iter().all(|x| x.to_bits() == 0)
    }

    /// The 16-byte aligned address the kernels write.
    pub fn ptr(&mut self) -> DevPtr {
        mptr(&mut self.buf[self.off..])
    }
}

/// One case's inputs rounded to `T`: q, k and v (uniform in ±1.5, ±1.5 and
/// ±1.0), the output gradient `dout` (±1.0), and the mask of `kind` (values
/// and strides `(batch, head, row)`).
pub struct Inputs<T> {
    pub q: Vec<T>,
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub dout: Vec<T>,
    pub mask: Option<(Vec<T>, [usize; 3])>,
}

impl<T: Float> Inputs<T> {
    /// The inputs of `s` with a mask of `kind` placed by `plan`.
    pub fn new(s: &SdpaShape, kind: MaskKind, plan: MaskPlan) -> Self {
        let nq = s.batch * s.q_heads * s.q_len;
        let nk = s.batch * s.kv_heads * s.kv_len;
        Inputs {
            q: cvt(&data(nq * s.head_dim, 1, 1.5)),
            k: cvt(&data(nk * s.head_dim, 2, 1.5)),
            v: cvt(&data(nk * s.v_dim, 3, 1.0)),
            dout: cvt(&data(nq * s.v_dim, 4, 1.0)),
            mask: make_mask(s, kind, plan).map(|(m, st)| (cvt(&m), st)),
        }
    }

    /// The kernels' view of the mask.
    pub fn dev_mask(&self) -> Option<SdpaDevMask> {
        self.mask.as_ref().map(|(m, st)| dev_mask(m, *st))
    }

    /// The f64 reference forward on these (rounded) inputs: `(out, lse)`.
    pub fn reference_forward(&self, s: &SdpaShape) -> (Vec<f64>, Vec<f64>) {
        let mask = self.mask.as_ref().map(|(m, st)| (f64s(m), *st));
        let mask = mask.as_ref().map(|(m, st)| ref_mask(m, *st));
        let (q, k, v) = (f64s(&self.q), f64s(&self.k), f64s(&self.v));
        reference::sdpa_forward(s, &q, &k, &v, mask.as_ref())
    }

    /// The f64 reference backward of `dout` on these (rounded) inputs: `(dq,
    /// dk, dv)`.
    pub fn reference_backward(&self, s: &SdpaShape) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mask = self.mask.as_ref().map(|(m, st)| (f64s(m), *st));
        let mask = mask.as_ref().map(|(m, st)| ref_mask(m, *st));
        let (q, k, v, g) = (f64s(&self.q), f64s(&self.k), f64s(&self.v), f64s(&self.dout));
        reference::sdpa_backward(s, &q, &k, &v, mask.as_ref(), &g)
    }

    /// The addresses of q, k and v, and the kernels' view of the mask.
    fn qkv_mask(&self) -> (DevPtr, DevPtr, DevPtr, Option<SdpaDevMask>) {
        (ptr(&self.q), ptr(&self.k), ptr(&self.v), self.dev_mask())
    }

    /// The forward's buffers: these inputs, and `out` and `lse` to write.
    pub fn fwd_buffers(&self, out: &mut [T], lse: &mut [f32]) -> SdpaFwdBuffers {
        let (q, k, v, mask) = self.qkv_mask();
        SdpaFwdBuffers { q, k, v, mask, out: mptr(out), lse: mptr(lse), layout: Default::default() }
    }

    /// The backward's buffers: these inputs, the forward's `out` and `lse`,
    /// the gradients `g` to write and the workspace `ws`.
    pub fn bwd_buffers(
        &self,
        out: &[T],
        lse: &[f32],
        g: &mut Grads<T>,
        ws: &mut Workspace,
    ) -> SdpaBwdBuffers {
        let (q, k, v, mask) = self.qkv_mask();
        SdpaBwdBuffers {
            q,
            k,
            v,
            mask,
            out: ptr(out),
            lse: ptr(lse),
            dout: ptr(&self.dout),
            dq: mptr(&mut g.dq),
            dk: mptr(&mut g.dk),
            dv: mptr(&mut g.dv),
            workspace: ws.ptr(),
            workspace_bytes: ws.bytes,
            layout: Default::default(),
        }
    }
}

/// The forward's outputs of `s`: `out` (attention dtype) and the f32 `lse`,
/// filled with 7.0 (garbage the kernels must overwrite).
pub fn forward_outputs<T: Float>(s: &SdpaShape) -> (Vec<T>, Vec<f32>) {
    let nq = s.batch * s.q_heads * s.q_len;
    (vec![T::from_f64(7.0); nq * s.v_dim], vec![7.0f32; nq])
}

/// Host buffers of one backward's gradients, shaped like q, k and v.
pub struct Grads<T> {
    pub dq: Vec<T>,
    pub dk: Vec<T>,
    pub dv: Vec<T>,
}

impl<T: Float> Grads<T> {
    /// Gradients for the inputs `x`, filled with 7.0 (garbage the kernels
    /// must overwrite).
    pub fn new(x: &Inputs<T>) -> Self {
        let seven = T::from_f64(7.0);
        Grads { dq: vec![seven; x.q.len()], dk: vec![seven; x.k.len()], dv: vec![seven; x.v.len()] }
    }
}

/// Backward buffers with every tensor and the workspace at `p` (for calls
/// whose checks refuse them before any launch).
pub fn bwd_buffers_at(p: DevPtr, workspace_bytes: usize) -> SdpaBwdBuffers {
    SdpaBwdBuffers {
        q: p,
        k: p,
        v: p,
        mask: None,
        out: p,
        lse: p,
        dout: p,
        dq: p,
        dk: p,
        dv: p,
        workspace: p,
        workspace_bytes,
        layout: Default::default(),
    }
}

/// How the strided tests place the attention operands in host buffers.
#[derive(Clone, Copy, Debug)]
///
/// `pad` grows by operand, so that no two operands share their strides:
/// q's gaps are `pad` elements, k's `2 pad`, v's `3 pad` and out's `4 pad`.
pub enum Arrangement {
    /// q, k and v (and dq, dk, dv) in separate `[batch, len, heads * dim +
    /// gap]` regions of one buffer, batches `gap` elements apart beyond
    /// their rows; out (and dout) the same way.
    Bshd { pad: usize },
    /// q, k and v side by side in the rows of one `[batch, len, (q_heads + 2
    /// kv_heads) * dim + pad]` buffer (a fused projection's output; needs
    /// `q_len == kv_len` and `head_dim == v_dim`), dq, dk and dv likewise in
    /// another; out (and dout) as [`Arrangement::Bshd`].
    Packed { pad: usize },
    /// `[batch, heads, len, dim]` with `gap` elements after every row, head
    /// and batch.
    Padded { pad: usize },
}

/// Where one operand `[batch, heads, len, dim]` lies in its host buffer.
#[derive(Clone, Copy, Debug)]
pub struct Placed {
    /// Element offset of element `(0, 0, 0, 0)`.
    pub off: usize,
    /// Element strides.
    pub st: SdpaStrides,
    /// `[batch, heads, len, dim]`.
    pub dims: [usize; 4],
}

impl Placed {
    /// The buffer offsets of the operand's elements, in dense `[batch,
    /// heads, len, dim]` order.
    pub fn offsets(&self) -> impl Iterator<Item = usize> + '_ {
        let [nb, nh, nl, nd] = self.dims;
        (0..nb).flat_map(move |b| {
            (0..nh).flat_map(move |h| {
                (0..nl).flat_map(move |i| {
                    let row = self.off + b * self.st.batch + h * self.st.head + i * self.st.row;
                    row..row + nd
                })
            })
        })
    }

    /// One past the last element offset (`off` when the operand is empty).
    pub fn end(&self) -> usize {
        self.offsets().max().map_or(self.off, |o| o + 1)
    }

    /// The operand's elements in `buf`, in dense order.
    pub fn gather<T: Copy>(&self, buf: &[T]) -> Vec<T> {
        self.offsets().map(|o| buf[o]).collect()
    }

    /// Writes the dense `values` into the operand's elements of `buf`.
    pub fn scatter<T: Copy>(&self, values: &[T], buf: &mut [T]) {
        let mut n = 0;
        for (o, &v) in self.offsets().zip(values) {
            buf[o] = v;
            n += 1;
        }
        assert_eq!(n, values.len(), "scatter: values for {:?}", self.dims);
    }
}

/// The placements of q, k, v (one buffer, `qkv_len` elements; dq, dk, dv in
/// another like it) and out (`out_len`; dout in another like it) of an
/// [`Arrangement`].
#[derive(Clone, Copy, Debug)]
pub struct Placement {
    pub q: Placed,
    pub k: Placed,
    pub v: Placed,
    pub out: Placed,
    pub qkv_len: usize,
    pub out_len: usize,
}

impl Placement {
    /// The placements of shape `s` under `arr`; region offsets are
    /// multiples of 8 elements (16 bytes at 16-bit dtypes).
    pub fn new(s: &SdpaShape, arr: Arrangement) -> Self {
        let q = [s.batch, s.q_heads, s.q_len, s.head_dim];
        let k = [s.batch, s.kv_heads, s.kv_len, s.head_dim];
        let v = [s.batch, s.kv_heads, s.kv_len, s.v_dim];
        let o = [s.batch, s.q_heads, s.q_len, s.v_dim];
        // `[b, l, h * d + pad]` rows, batches `pad` apart past their rows.
        let bshd = |[_, h, l, d]: [usize; 4], pad: usize| {
            let row = h * d + pad;
            SdpaStrides { batch: l * row + pad, head: d, row }
        };
        let padded = |[_, h, l, d]: [usize; 4], pad: usize| {
            let row = d + pad;
            let head = l * row + pad;
            SdpaStrides { batch: h * head + pad, head, row }
        };
        // operands one after another from `at`, each region rounded to 8 elements
        let chain = |at: usize, ops: [([usize; 4], SdpaStrides); 3]| {
            let mut at = at;
            ops.map(|(dims, st)| {
                let p = Placed { off: at, st, dims };
                at = p.end().next_multiple_of(8);
                p
            })
        };
        let (qkv, out_st) = match arr {
            Arrangement::Bshd { pad } => (
                chain(0, [(q, bshd(q, pad)), (k, bshd(k, 2 * pad)), (v, bshd(v, 3 * pad))]),
                bshd(o, 4 * pad),
            ),
            Arrangement::Padded { pad } => (
                chain(0, [(q, padded(q, pad)), (k, padded(k, 2 * pad)), (v, padded(v, 3 * pad))]),
                padded(o, 4 * pad),
            ),
            Arrangement::Packed { pad } => {
                assert!(s.q_len == s.kv_len && s.head_dim == s.v_dim, "packed: {s:?}");
                let d = s.head_dim;
                let row = (s.q_heads + 2 * s.kv_heads) * d + pad;
                let st = SdpaStrides { batch: s.q_len * row + pad, head: d, row };
                let at = |off, dims| Placed { off, st, dims };
                (
                    [at(0, q), at(s.q_heads * d, k), at((s.q_heads + s.kv_heads) * d, v)],
                    bshd(o, 4 * pad),
                )
            }
        };
        let [q, k, v] = qkv;
        let out = Placed { off: 0, st: out_st, dims: o };
        // a tail past every operand shows writes beyond the last element
        let qkv_len = q.end().max(k.end()).max(v.end()) + 64;
        Placement { q, k, v, out, qkv_len, out_len: out.end() + 64 }
    }

    /// The kernels' layout of these placements.
    pub fn layout(&self) -> SdpaLayout {
        SdpaLayout {
            q: Some(self.q.st),
            k: Some(self.k.st),
            v: Some(self.v.st),
            out: Some(self.out.st),
        }
    }
}

/// The bits of every element of `buf` whose offset no operand of `ops`
/// covers, that differ from `guard`: `(offset, value)` pairs, empty when
/// the kernels wrote nothing outside the operands.
pub fn guards_touched<T: Float>(buf: &[T], ops: &[&Placed], guard: T) -> Vec<(usize, f64)> {
    let mut covered = vec![false; buf.len()];
    for p in ops {
        for o in p.offsets() {
            covered[o] = true;
        }
    }
    let g = guard.to_f64().to_bits();
    buf.iter()
        .enumerate()
        .filter(|&(i, x)| !covered[i] && x.to_f64().to_bits() != g)
        .map(|(i, x)| (i, x.to_f64()))
        .collect()
}

/// What one forward and backward call wrote.
pub struct Ran<T> {
    pub out: Vec<T>,
    pub lse: Vec<f32>,
    pub g: Grads<T>,
    pub ws: Workspace,
}

/// Forward then backward of `x` on dense `[batch, heads, len, dim]` buffers
/// on the emulator, with kernels of `path`.
pub fn run_dense<T: Float>(
    dtype: CudaDType,
    s: &SdpaShape,
    x: &Inputs<T>,
    path: SdpaPath,
) -> tpar_kernels::Result<Ran<T>> {
    let (mut out, mut lse) = forward_outputs::<T>(s);
    let mut g = Grads::new(x);
    let mut ws = Workspace::new(s);
    let emu = super::emu();
    // SAFETY: host buffers stand in for device memory (the emulator runs the kernel on this
    // thread before returning), each holding every element the call's sizes reach.
    unsafe {
        sdpa_forward(emu, dtype, s, &x.fwd_buffers(&mut out, &mut lse), path)?;
        sdpa_backward(emu, dtype, s, &x.bwd_buffers(&out, &lse, &mut g, &mut ws), path)?;
    }
    Ok(Ran { out, lse, g, ws })
}
