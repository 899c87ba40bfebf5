//! Attention on heads laid out `[batch, seq, heads, head_dim]`, with RoPE:
//! [`Tensor::attention_bshd`] (separate q, k, v) and [`Tensor::attention_packed`] (one
//! packed `[b, s, (hq + 2 hkv) * hd]` projection output); and without it,
//! [`Tensor::attention_packed_rotated`] (a packed output whose q and k the projection
//! rotated, [`Tensor::linear_concat_rope`]).
//!
//! The op means the composition a Llama attention block runs on its projections: split
//! (packed) and view as `[b, s, h, hd]`, rotate q and k and bring them to `[b, h, s, hd]`
//! ([`Tensor::rope_bshd_to_bhsd`]), transpose v, [`Tensor::scaled_dot_product_attention`]
//! with the default scale `1/sqrt(hd)`, and transpose the output back to `[b, s, hq, hd]`.
//! On the host (and for f64, sizes the flash kernels do not take, or an empty call) it
//! runs exactly that composition, whose autograd is its ops'.
//!
//! On a CUDA device it is one autograd node without transposes, splits or
//! concatenations: the forward rotates the q heads and the k heads into dense
//! `[b, s, h, hd]` buffers (one RoPE launch each, reading the packed input's columns in
//! place), and the flash kernels read q and k there and v straight from the input
//! through element strides ([`k_sdpa::SdpaLayout`]), writing the output as
//! `[b, s, hq, hd]`. The node keeps the output, the log-sum-exps and what the flash
//! backward reads: for separate inputs the rotated q and k and the input v, for a packed
//! input the input itself (v is read in its columns), whose q and k heads the backward
//! rotates again; either way the bytes the composition keeps (its rotated q and k and
//! transposed v). The flash backward writes dv straight into the input's gradient (for
//! a packed input, its v columns) and dq and dk into dense buffers that one
//! RoPE-backward launch each rotates back into the gradient (the packed gradient's q
//! and k columns; q and k live in buffers of their own because the kernels write dq and
//! dk, at q's and k's strides, into views that must not overlap). Every element is
//! computed as in the composition, so the bits are the same.
//!
//! A pre-rotated packed input needs none of the RoPE launches: the flash kernels read q,
//! k and v in its columns, the node keeps it, and the backward writes dq, dk and dv into
//! the packed gradient's columns ([`k_sdpa::SdpaGrads::Packed`]).

use tpar_kernels::cuda::ops::{rope as k_rope, sdpa as k_sdpa};
use tpar_kernels::cuda::{CudaDType, GpuDevice};
use tpar_kernels::rope::RopeShape;
use tpar_kernels::sdpa::SdpaShape;

use super::gpu::{cuda_dtype, device_of, with_gpu, Out};
use super::gpu_nn::{self, GradsAt, SdpaAt};
use super::nn::{default_sdpa_scale, sdpa_mask4};
use super::{common_device, common_dtype, invalid, require_float};
use crate::autograd::record;
use crate::checkpoint::{kept, SaveOp};
use crate::{Device, Result, Shape, Tensor, TensorError};

/// The operands: separate q, k and v `[b, s, h, hd]`, or one packed
/// `[b, s, (hq + 2 hkv) * hd]` tensor holding each row's q, k and v heads side by side.
#[derive(Clone, Copy)]
enum Qkv<'a> {
    Separate([&'a Tensor; 3]),
    Packed(&'a Tensor),
}

/// Batch, sequence length, query heads, key/value heads and head dim.
#[derive(Clone, Copy, Debug)]
struct Heads {
    b: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
}

impl Heads {
    /// Heads of q, k and v.
    fn of(&self, i: usize) -> usize {
        if i == 0 {
            self.hq
        } else {
            self.hkv
        }
    }

    /// The output's shape: `[b, s, hq, hd]`, or `[b, s, hq * hd]` for a packed input.
    fn out_shape(&self, packed: bool) -> Shape {
        if packed {
            Shape::new(&[self.b, self.s, self.hq * self.hd])
        } else {
            Shape::new(&[self.b, self.s, self.hq, self.hd])
        }
    }
}

impl<'a> Qkv<'a> {
    fn inputs(&self) -> Vec<&'a Tensor> {
        match *self {
            Qkv::Separate(t) => t.to_vec(),
            Qkv::Packed(t) => vec![t],
        }
    }

    fn packed(&self) -> bool {
        matches!(self, Qkv::Packed(_))
    }

    /// Where operand `i` (0 q, 1 k, 2 v) lies: see [`place`].
    fn place(&self, i: usize, h: &Heads) -> (usize, usize, usize) {
        place(self.packed(), i, h)
    }
}

/// Where operand `i` (0 q, 1 k, 2 v) of a packed or separate input lies: its input's
/// index in [`Qkv::inputs`], the element of it where the operand's `(0, 0, 0, 0)` is,
/// and the elements between its positions.
fn place(packed: bool, i: usize, h: &Heads) -> (usize, usize, usize) {
    if packed {
        let start = [0, h.hq, h.hq + h.hkv][i] * h.hd;
        (0, start, (h.hq + 2 * h.hkv) * h.hd)
    } else {
        (i, 0, h.of(i) * h.hd)
    }
}

impl Tensor {
    /// Attention with RoPE on `[batch, seq, heads, head_dim]` operands: q `[b, s, hq, hd]`,
    /// k and v `[b, s, hkv, hd]` (`hq` a multiple of `hkv`, `hd` even), the tables
    /// `cos` / `sin` `[n, hd]` with `n >= s` (the first `s` rows are used); output
    /// `[b, s, hq, hd]`. It is, bit for bit and with the same gradients,
    /// `q.rope_bshd_to_bhsd(cos, sin)`, the same for k, `v.transpose(1, 2)`,
    /// [`Tensor::scaled_dot_product_attention`] with `mask`, `causal` and the default
    /// scale, and the output transposed back; on a CUDA device without the transposes
    /// (see the module docs). Differentiable in q, k and v.
    pub fn attention_bshd(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        causal: bool,
    ) -> Result<Tensor> {
        const OP: &str = "attention_bshd";
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank() != 4 {
                return Err(invalid(
                    OP,
                    format!("{name} must be [batch, seq, heads, head_dim], got {}", t.shape()),
                ));
            }
        }
        let (qd, kd) = (q.dims(), k.dims());
        if v.dims() != kd || kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3] {
            return Err(TensorError::ShapeMismatch {
                op: OP,
                lhs: q.shape().clone(),
                rhs: k.shape().clone(),
                why: format!(
                    "v is {}: k and v must be [b, s, kv_heads, head_dim] with q's b, s and \
                     head_dim",
                    v.shape()
                ),
            });
        }
        let h = Heads { b: qd[0], s: qd[1], hq: qd[2], hkv: kd[2], hd: qd[3] };
        attention(OP, Qkv::Separate([q, k, v]), h, Some((cos, sin)), mask, causal)
    }

    /// [`Tensor::attention_bshd`] on a packed `[b, s, (q_heads + 2 kv_heads) * hd]` input
    /// (the output of one GEMM over the concatenated q, k and v projections: each row
    /// holds the q heads, then the k heads, then the v heads); output `[b, s, q_heads *
    /// hd]`, ready for the output projection. It is, bit for bit and with the same
    /// gradient, the input split on its last dim into q, k and v, each viewed as
    /// `[b, s, heads, hd]`, then [`Tensor::attention_bshd`] and the output viewed as
    /// `[b, s, q_heads * hd]`; on a CUDA device without the split (see the module docs).
    /// Differentiable in `qkv`.
    pub fn attention_packed(
        qkv: &Tensor,
        q_heads: usize,
        kv_heads: usize,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        causal: bool,
    ) -> Result<Tensor> {
        const OP: &str = "attention_packed";
        let h = packed_heads(OP, qkv, q_heads, kv_heads)?;
        attention(OP, Qkv::Packed(qkv), h, Some((cos, sin)), mask, causal)
    }

    /// [`Tensor::attention_packed`] on a packed `[b, s, (q_heads + 2 kv_heads) * hd]`
    /// input whose q and k heads are already rotated (as [`Tensor::linear_concat_rope`]
    /// writes them): no RoPE here. It is, bit for bit and with the same gradient, the
    /// input split into q, k and v, each viewed as `[b, s, heads, hd]` and transposed to
    /// `[b, heads, s, hd]`, [`Tensor::scaled_dot_product_attention`] with `mask`,
    /// `causal` and the default scale, and the output transposed back and viewed as
    /// `[b, s, q_heads * hd]`. On a CUDA device the flash kernels read q, k and v in the
    /// input's columns and the backward writes dq, dk and dv into the gradient's: no
    /// other kernel runs. Differentiable in `qkv`.
    pub fn attention_packed_rotated(
        qkv: &Tensor,
        q_heads: usize,
        kv_heads: usize,
        mask: Option<&Tensor>,
        causal: bool,
    ) -> Result<Tensor> {
        const OP: &str = "attention_packed_rotated";
        let h = packed_heads(OP, qkv, q_heads, kv_heads)?;
        attention(OP, Qkv::Packed(qkv), h, None, mask, causal)
    }
}

/// The sizes of a packed `[b, s, (q_heads + 2 kv_heads) * hd]` input, or the error
/// naming what does not fit.
fn packed_heads(op: &'static str, qkv: &Tensor, q_heads: usize, kv_heads: usize) -> Result<Heads> {
    if qkv.rank() != 3 {
        return Err(invalid(
            op,
            format!("qkv must be [batch, seq, (q_heads + 2 kv_heads) * hd], got {}", qkv.shape()),
        ));
    }
    let d = qkv.dims();
    let heads = kv_heads.checked_mul(2).and_then(|k| k.checked_add(q_heads));
    let Some(heads) = heads.filter(|&n| n > 0 && d[2].is_multiple_of(n)) else {
        return Err(invalid(
            op,
            format!(
                "qkv width {} is not a positive multiple of q_heads + 2 kv_heads ({q_heads} + 2 \
                 * {kv_heads})",
                d[2]
            ),
        ));
    };
    Ok(Heads { b: d[0], s: d[1], hq: q_heads, hkv: kv_heads, hd: d[2] / heads })
}

/// The checks shared by the ops, then the device node or the composition; `tables`
/// (cos, sin) rotate q and k, `None` for a pre-rotated input.
fn attention(
    op: &'static str,
    x: Qkv<'_>,
    h: Heads,
    tables: Option<(&Tensor, &Tensor)>,
    mask: Option<&Tensor>,
    causal: bool,
) -> Result<Tensor> {
    let inputs = x.inputs();
    require_float(op, inputs[0])?;
    let mut all = inputs.clone();
    all.extend(tables.iter().flat_map(|&(c, s)| [c, s]));
    let dtype = common_dtype(op, &all)?;
    if h.hkv == 0 || !h.hq.is_multiple_of(h.hkv) {
        return Err(invalid(
            op,
            format!("{} query heads are not a multiple of {} kv heads", h.hq, h.hkv),
        ));
    }
    let fits = |t: &Tensor| t.rank() == 2 && t.dims()[0] >= h.s && t.dims()[1] == h.hd;
    if tables.is_some() && !h.hd.is_multiple_of(2) {
        return Err(invalid(op, format!("head_dim {} must be even (RoPE)", h.hd)));
    }
    if let Some((cos, sin)) = tables.filter(|(c, s)| !fits(c) || !fits(s)) {
        return Err(invalid(
            op,
            format!(
                "cos and sin must be [n, {}] with n >= the sequence length {}, got {} and {}",
                h.hd,
                h.s,
                cos.shape(),
                sin.shape()
            ),
        ));
    }
    let s = SdpaShape {
        batch: h.b,
        q_heads: h.hq,
        kv_heads: h.hkv,
        q_len: h.s,
        kv_len: h.s,
        head_dim: h.hd,
        v_dim: h.hd,
        scale: default_sdpa_scale(h.hd),
        causal,
    };
    let mask4 = sdpa_mask4(op, mask, dtype, &s, inputs[0])?;
    all.extend(mask);
    match common_device(op, &all)? {
        Device::Meta => return Tensor::empty(h.out_shape(x.packed()), dtype, Device::Meta),
        Device::Cuda(_) => {
            if let Some(t) = on_device(x, h, tables, mask4.as_ref(), &s)? {
                return Ok(t);
            }
        }
        Device::Cpu => {}
    }
    composition(x, h, tables, mask, causal)
}

/// What the ops mean (see the module docs), with the autograd of the ops it runs.
fn composition(
    x: Qkv<'_>,
    h: Heads,
    tables: Option<(&Tensor, &Tensor)>,
    mask: Option<&Tensor>,
    causal: bool,
) -> Result<Tensor> {
    let [q, k, v] = match x {
        Qkv::Separate([q, k, v]) => [q.clone(), k.clone(), v.clone()],
        Qkv::Packed(qkv) => {
            let widths = [h.hq * h.hd, h.hkv * h.hd, h.hkv * h.hd];
            let parts = qkv.split_sizes(&widths, -1)?;
            let heads = |i: usize| parts[i].reshape([h.b, h.s, h.of(i), h.hd]);
            [heads(0)?, heads(1)?, heads(2)?]
        }
    };
    // [b, s, heads, hd] -> [b, heads, s, hd], q and k rotated (unless they come so)
    let (q, k) = match tables {
        Some((cos, sin)) => {
            let (cos, sin) = if cos.dims()[0] == h.s {
                (cos.clone(), sin.clone())
            } else {
                (cos.narrow(0, 0, h.s)?, sin.narrow(0, 0, h.s)?)
            };
            (q.rope_bshd_to_bhsd(&cos, &sin)?, k.rope_bshd_to_bhsd(&cos, &sin)?)
        }
        None => (q.transpose(1, 2)?, k.transpose(1, 2)?),
    };
    let v = v.transpose(1, 2)?;
    let a = Tensor::scaled_dot_product_attention(&q, &k, &v, mask, causal, None)?; // [b, hq, s, hd]
    a.transpose(1, 2)?.reshape(h.out_shape(x.packed())) // [b, s, hq, hd] or [b, s, hq * hd]
}

/// The RoPE launch of `n` heads of `h` (its `b`, `s` and `hd`) from `src` into `dst`:
/// each a buffer, the element where head `(0, 0, 0)` starts and the elements between
/// positions; the transposed rotation when `backward`.
#[allow(clippy::too_many_arguments)]
fn rope_heads(
    dev: &dyn GpuDevice,
    cd: CudaDType,
    h: &Heads,
    n: usize,
    (cos, sin): (&Tensor, &Tensor),
    (src, src_at, src_row): (&Tensor, usize, usize),
    (dst, dst_at, dst_row): (&mut Out, usize, usize),
    backward: bool,
) -> Result<()> {
    const OP: &str = "attention_bshd";
    let shape = RopeShape { outer: h.b, seq: h.s, inner: n, head_dim: h.hd };
    let strides = |row: usize| k_rope::RopeStrides { outer: h.s * row, seq: row, inner: h.hd };
    let es = cd.size();
    with_gpu(OP, &[src, cos, sin], |v| {
        let x = v[0].view();
        let x = x.slice(src_at * es..x.len())?;
        let y = gpu_nn::out_from(dst, dst_at, es)?;
        let (c, sn) = (v[1].view(), v[2].view());
        let (xs, ys) = (strides(src_row), strides(dst_row));
        Ok(k_rope::rope_strided(dev, cd, &shape, (x, xs), c, sn, (y, ys), backward)?)
    })
}

/// q and k of `x` rotated into dense `[b, s, heads, hd]` tensors.
fn rotate_qk(
    dev: &std::sync::Arc<dyn GpuDevice>,
    cd: CudaDType,
    x: Qkv<'_>,
    h: &Heads,
    tables: (&Tensor, &Tensor),
) -> Result<[Tensor; 2]> {
    let inputs = x.inputs();
    let rotate = |i: usize| -> Result<Tensor> {
        let n = h.of(i);
        let (input, at, row) = x.place(i, h);
        let mut y = Out::new(dev, [h.b, h.s, n, h.hd], inputs[0].dtype())?;
        rope_heads(
            &**dev,
            cd,
            h,
            n,
            tables,
            (inputs[input], at, row),
            (&mut y, 0, n * h.hd),
            false,
        )?;
        Ok(y.into_tensor())
    };
    Ok([rotate(0)?, rotate(1)?])
}

/// Where the flash kernels find q and k (the dense rotated buffers, or in the input when
/// it comes rotated) and v (in the input) and write the output (`[b, s, hq, hd]`).
fn layout(packed: bool, h: &Heads, rotated_in_input: bool) -> k_sdpa::SdpaLayout {
    let bshd = |row: usize| Some(k_sdpa::SdpaStrides::bshd(h.s, row, h.hd));
    let qk = |i: usize| match rotated_in_input {
        true => bshd(place(packed, i, h).2),
        false => bshd(h.of(i) * h.hd),
    };
    k_sdpa::SdpaLayout {
        q: qk(0),
        k: qk(1),
        v: bshd(place(packed, 2, h).2),
        out: bshd(h.hq * h.hd),
    }
}

/// The device node (see the module docs); `None` where the composition runs instead:
/// a dtype without flash kernels, sizes they do not take, or an empty call.
fn on_device(
    x: Qkv<'_>,
    h: Heads,
    tables: Option<(&Tensor, &Tensor)>,
    mask: Option<&Tensor>,
    s: &SdpaShape,
) -> Result<Option<Tensor>> {
    const OP: &str = "attention_bshd";
    let inputs = x.inputs();
    let Some(cd) = cuda_dtype(inputs[0].dtype()) else { return Ok(None) };
    if !gpu_nn::sdpa_fits(s) || inputs.iter().any(|t| t.numel() == 0) {
        return Ok(None);
    }
    let dev = device_of(inputs[0], OP)?;
    let (s, mask) = (*s, gpu_nn::device_mask(mask, s, cd)?);
    let packed = x.packed();
    let tables = match (tables, x) {
        (Some(tables), _) => tables,
        (None, Qkv::Packed(qkv)) => return Ok(Some(rotated_on_device(qkv, h, mask, s)?)),
        // (no op takes separate inputs without the tables)
        (None, Qkv::Separate(_)) => return Ok(None),
    };
    let layout = layout(packed, &h, false);
    let (v, v_at, _) = x.place(2, &h);
    // A selective activation checkpoint may keep the output and its log-sum-exps
    // (crate::checkpoint), as it keeps attention's.
    let (out, lse, rotated) = kept(SaveOp::Sdpa, &inputs, || {
        let [q, k] = rotate_qk(&dev, cd, x, &h, tables)?;
        let ops = [(&q, 0), (&k, 0), (inputs[v], v_at)];
        let (out, lse) =
            gpu_nn::sdpa_forward_at(ops, mask.as_ref(), &s, layout, h.out_shape(packed))?;
        // Separate inputs keep the rotated q and k; a packed one is kept whole (the
        // backward reads v in its columns) and its q and k are rotated again there.
        Ok((out, lse, (!packed).then_some([q, k])))
    })?;
    let v_in = inputs[v].detach(); // v, or the packed input
    let (cos, sin, o) = (tables.0.detach(), tables.1.detach(), out.detach());
    Ok(Some(record(OP, &inputs, out, move |g| {
        let dev = device_of(g, OP)?;
        let [q, k] = match &rotated {
            Some(qk) => qk.clone(),
            None => rotate_qk(&dev, cd, Qkv::Packed(&v_in), &h, (&cos, &sin))?,
        };
        // the inputs' gradients: dq, dk and dv, or the packed one
        let mut grads = match packed {
            true => vec![Out::new(&dev, v_in.shape().clone(), v_in.dtype())?],
            false => (0..3)
                .map(|i| Out::new(&dev, [h.b, h.s, h.of(i), h.hd], v_in.dtype()))
                .collect::<Result<Vec<_>>>()?,
        };
        let mut dq = Out::new(&dev, q.shape().clone(), q.dtype())?;
        let mut dk = Out::new(&dev, k.shape().clone(), k.dtype())?;
        let (v, v_at, _) = place(packed, 2, &h);
        let ops = [(&q, 0), (&k, 0), (&v_in, v_at)] as [SdpaAt<'_>; 3];
        let dests = GradsAt::Separate([(&mut dq, 0), (&mut dk, 0), (&mut grads[v], v_at)]);
        gpu_nn::sdpa_backward_at(ops, mask.as_ref(), &s, layout, [&o, &lse, g], dests)?;
        for (i, d) in [dq, dk].into_iter().enumerate() {
            let (n, d) = (h.of(i), d.into_tensor());
            let (input, at, row) = place(packed, i, &h);
            let src = (&d, 0, n * h.hd);
            rope_heads(&*dev, cd, &h, n, (&cos, &sin), src, (&mut grads[input], at, row), true)?;
        }
        Ok(grads.into_iter().map(|g| Some(g.into_tensor())).collect())
    })))
}

/// The device node of a pre-rotated packed input: the flash kernels read q, k and v in
/// its columns, the node keeps it (and the output and log-sum-exps), and the backward
/// writes dq, dk and dv into the packed gradient's columns.
fn rotated_on_device(
    input: &Tensor,
    h: Heads,
    mask: Option<Tensor>,
    s: SdpaShape,
) -> Result<Tensor> {
    const OP: &str = "attention_packed_rotated";
    let at = [0, 1, 2].map(|i| place(true, i, &h).1);
    let layout = layout(true, &h, true);
    let (out, lse) = kept(SaveOp::Sdpa, &[input], || {
        let ops = at.map(|a| (input, a));
        gpu_nn::sdpa_forward_at(ops, mask.as_ref(), &s, layout, h.out_shape(true))
    })?;
    let (qkv, o) = (input.detach(), out.detach());
    Ok(record(OP, &[input], out, move |g| {
        let dev = device_of(g, OP)?;
        let mut grad = Out::new(&dev, qkv.shape().clone(), qkv.dtype())?;
        let ops = at.map(|a| (&qkv, a));
        let dests = GradsAt::Packed(&mut grad, at);
        gpu_nn::sdpa_backward_at(ops, mask.as_ref(), &s, layout, [&o, &lse, g], dests)?;
        Ok(vec![Some(grad.into_tensor())])
    }))
}
