//! The Llama model: RoPE, grouped-query attention with a causal + padding mask,
//! SwiGLU MLP, RMSNorm, with the module names of the reference implementation
//! (`base_model.layers.3.self_attn.q_proj`, ...).

use std::sync::Arc;

use tpar_tensor::{checkpoint, DType, Device, RopeLayout, Tensor};

use tpar_nn::CheckpointWrapper;
use tpar_nn::{
    call, module_boilerplate, Args, AttentionHeads, Embedding, Linear, Module, ModuleCore,
    ModuleList, NnError, Result, RmsNorm, Value,
};

/// Sizes of a Llama model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence the RoPE tables cover.
    pub max_position_embeddings: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling for contexts longer than the model was trained on
    /// (Hugging Face's `rope_scaling`); `None` for plain RoPE.
    pub rope_scaling: Option<RopeScaling>,
    /// Parameter dtype.
    pub dtype: DType,
}

/// How RoPE's frequencies are scaled (Hugging Face's `rope_scaling` / `rope_parameters`
/// of `rope_type` `linear` or `llama3`). Both leave the attention scale alone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (positions interpolated), `"linear"`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3's: frequencies whose wavelength exceeds
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
    /// those shorter than `original_max_position_embeddings / high_freq_factor` are
    /// kept, and those between are blended smoothly, `"llama3"`.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was trained on.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// The scaled inverse frequency for the unscaled `inv_freq` (as transformers'
    /// `_compute_linear_scaling_rope_parameters` and `_compute_llama3_parameters`).
    pub fn apply(&self, inv_freq: f64) -> f64 {
        match *self {
            RopeScaling::Linear { factor } => inv_freq / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
                if wavelen > low_wavelen {
                    inv_freq / factor
                } else if wavelen < high_wavelen {
                    inv_freq
                } else {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
                }
            }
        }
    }

    /// `Err` naming the field that is out of range (factors finite and positive, Llama
    /// 3's high factor above its low one, a positive original context).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(NnError::Config { what: format!("rope_scaling: {what}") });
        let positive = |name: &str, v: f64| -> Result<()> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bad(format!("{name} is {v}; it must be finite and positive"))
            }
        };
        match *self {
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return bad(format!(
                        "high_freq_factor {high_freq_factor} must exceed low_freq_factor {low_freq_factor}"
                    ));
                }
                if original_max_position_embeddings == 0 {
                    return bad("original_max_position_embeddings is 0".into());
                }
                Ok(())
            }
        }
    }
}

impl Default for LlamaConfig {
    /// Hugging Face's `LlamaConfig()` defaults (the Llama-2-7B shape): vocab 32000, 2048
    /// positions, hidden 4096, MLP 11008, 32 layers, 32 heads, 32 key/value heads, RMSNorm
    /// eps 1e-6, RoPE theta 10000; f32 parameters. Override fields with
    /// `LlamaConfig { hidden_size: 256, ..Default::default() }`.
    fn default() -> Self {
        LlamaConfig {
            vocab_size: 32000,
            max_position_embeddings: 2048,
            hidden_size: 4096,
            intermediate_size: 11008,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            dtype: DType::F32,
        }
    }
}

impl LlamaConfig {
    /// Head dim (`hidden_size / num_attention_heads`).
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Parameters of one decoder layer: the q, k, v and o projections, the three MLP
    /// projections and the two RMSNorm weights (`None` when the count overflows `usize`).
    pub fn layer_parameters(&self) -> Option<usize> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads.checked_mul(self.head_dim())?;
        let kv = self.num_key_value_heads.checked_mul(self.head_dim())?;
        // q_proj + o_proj: 2 h q; k_proj + v_proj: 2 h kv; gate, up, down: 3 h i; norms: 2 h.
        let attn = h.checked_mul(q.checked_add(kv)?)?.checked_mul(2)?;
        let mlp = h.checked_mul(i)?.checked_mul(3)?;
        attn.checked_add(mlp)?.checked_add(h.checked_mul(2)?)
    }

    /// Parameters of the whole model: embedding, `num_hidden_layers` decoder layers
    /// ([`LlamaConfig::layer_parameters`]), final norm and the (untied) lm_head, the sum
    /// of every parameter's element count. An error naming the sizes when the count (or
    /// its bytes in `dtype`) overflows `usize`.
    pub fn num_parameters(&self) -> Result<usize> {
        let (v, h, l) = (self.vocab_size, self.hidden_size, self.num_hidden_layers);
        let count = self.layer_parameters().and_then(|per| {
            let layers = per.checked_mul(l)?;
            // embed_tokens + lm_head: 2 v h; final norm: h.
            let ends = v.checked_mul(h)?.checked_mul(2)?.checked_add(h)?;
            let n = layers.checked_add(ends)?;
            n.checked_mul(self.dtype.size_in_bytes()).map(|_| n)
        });
        count.ok_or_else(|| NnError::Config {
            what: format!(
                "num_hidden_layers {l} of hidden_size {h}, intermediate_size {} and \
                 vocab_size {v}: the parameter count (or its bytes in {}) overflows {} bits",
                self.intermediate_size,
                self.dtype,
                usize::BITS
            ),
        })
    }

    /// Checks the sizes fit together: every size but `num_hidden_layers` is at least 1 (a
    /// model of 0 layers, embedding + norm + head, is legal), heads divide the width, the
    /// head dim is even (RoPE), `rms_norm_eps` and `rope_theta` are finite and positive,
    /// and the parameter count and its bytes do not overflow
    /// ([`LlamaConfig::num_parameters`]). Errors name the field.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        for (field, v) in [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("max_position_embeddings", c.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(NnError::Config {
                    what: format!("{field} is 0; it must be at least 1"),
                });
            }
        }
        for (field, v) in [("rms_norm_eps", c.rms_norm_eps), ("rope_theta", c.rope_theta)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(NnError::Config {
                    what: format!("{field} is {v}; it must be finite and positive"),
                });
            }
        }
        if let Some(r) = &c.rope_scaling {
            r.validate()?;
        }
        if c.num_attention_heads == 0 || !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            return Err(NnError::Config {
                what: format!(
                    "hidden_size {} is not a multiple of num_attention_heads {}",
                    c.hidden_size, c.num_attention_heads
                ),
            });
        }
        if c.num_key_value_heads == 0
            || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        {
            return Err(NnError::Config {
                what: format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    c.num_attention_heads, c.num_key_value_heads
                ),
            });
        }
        if !c.head_dim().is_multiple_of(2) || c.head_dim() == 0 {
            return Err(NnError::Config {
                what: format!("head_dim {} must be even for RoPE", c.head_dim()),
            });
        }
        c.num_parameters()?;
        Ok(())
    }
}

/// The RoPE tables for a sequence: `cos` and `sin`, `[seq, head_dim]`.
#[derive(Clone, Debug)]
pub struct RopeTables {
    /// Cosines.
    pub cos: Tensor,
    /// Sines.
    pub sin: Tensor,
}

/// Rotary position encoding: produces the tables attention applies (HF layout: the
/// frequencies repeated over both halves of the head dim).
///
/// The tables are built lazily, on the first [`tables`](Self::tables) or
/// [`tables_on`](Self::tables_on) call, and only for the positions asked for so far
/// (grown on demand up to `max_positions`): a model built on `Device::Meta`, or with a
/// large `max_position_embeddings`, allocates nothing until it runs.
pub struct RotaryPositionEncoding {
    core: ModuleCore,
    head_dim: usize,
    max_positions: usize,
    base: f64,
    scaling: Option<RopeScaling>,
    dtype: DType,
    cache: std::sync::Mutex<RopeCache>,
}

/// Host tables for the leading positions built so far, and device copies of them.
#[derive(Default)]
struct RopeCache {
    host: Option<(Tensor, Tensor)>,
    on_device: Vec<(Device, Tensor, Tensor)>,
}

impl RotaryPositionEncoding {
    /// Tables for `max_positions` positions of a `head_dim`-wide head. Nothing is
    /// allocated yet; the size of the full tables is checked (an error if it overflows).
    pub fn new(head_dim: usize, max_positions: usize, base: f64, dtype: DType) -> Result<Self> {
        tpar_tensor::storage_bytes(
            "rope tables",
            &tpar_tensor::Shape::new(&[2, max_positions, head_dim]),
            DType::F64,
        )?;
        Ok(RotaryPositionEncoding {
            core: ModuleCore::default(),
            head_dim,
            max_positions,
            base,
            scaling: None,
            dtype,
            cache: std::sync::Mutex::new(RopeCache::default()),
        })
    }

    /// The same tables with their frequencies scaled by `scaling` (`None`: plain RoPE).
    pub fn with_scaling(mut self, scaling: Option<RopeScaling>) -> Self {
        self.scaling = scaling;
        self
    }

    /// `cos` and `sin` for the first `rows` positions, allocated fallibly.
    fn build(&self, rows: usize) -> Result<(Tensor, Tensor)> {
        let (head_dim, base) = (self.head_dim, self.base);
        let half = head_dim / 2;
        let shape = tpar_tensor::Shape::new(&[rows, head_dim]);
        let mut c = tpar_tensor::try_vec("rope tables", &shape, DType::F64, 0.0)?;
        let mut s = tpar_tensor::try_vec("rope tables", &shape, DType::F64, 0.0)?;
        for p in 0..rows {
            for j in 0..head_dim {
                let inv = base.powf(-2.0 * (j % half.max(1)) as f64 / head_dim as f64);
                let inv = match &self.scaling {
                    Some(r) => r.apply(inv),
                    None => inv,
                };
                c[p * head_dim + j] = (p as f64 * inv).cos();
                s[p * head_dim + j] = (p as f64 * inv).sin();
            }
        }
        Ok((
            Tensor::from_f64(&c, shape.clone(), self.dtype)?,
            Tensor::from_f64(&s, shape, self.dtype)?,
        ))
    }

    /// The host tables, covering at least `seq` positions (grown if needed).
    fn host(&self, cache: &mut RopeCache, seq: usize) -> Result<(Tensor, Tensor)> {
        let have = cache.host.as_ref().map_or(0, |(c, _)| c.dims()[0]);
        if cache.host.is_none() || have < seq {
            let rows = seq.max(have.saturating_mul(2)).min(self.max_positions);
            cache.host = Some(self.build(rows)?);
            cache.on_device.clear();
        }
        let (c, s) = cache.host.as_ref().expect("host tables were just built");
        Ok((c.clone(), s.clone()))
    }

    /// The tables for the first `seq` positions on `device` (device copies of the
    /// tables are made once and kept).
    pub fn tables_on(&self, seq: usize, device: Device) -> Result<RopeTables> {
        if device == Device::Cpu || device == Device::Meta {
            return self.tables(seq);
        }
        self.check_len(seq)?;
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let (hc, hs) = self.host(&mut cache, seq)?;
        let (cos, sin) = match cache.on_device.iter().find(|(d, _, _)| *d == device) {
            Some((_, c, s)) => (c.clone(), s.clone()),
            None => {
                let (c, s) = (hc.to_device(device)?, hs.to_device(device)?);
                cache.on_device.push((device, c.clone(), s.clone()));
                (c, s)
            }
        };
        drop(cache);
        Ok(RopeTables { cos: cos.narrow(0, 0, seq)?, sin: sin.narrow(0, 0, seq)? })
    }

    fn check_len(&self, seq: usize) -> Result<()> {
        let max = self.max_positions;
        if seq > max {
            return Err(NnError::Config {
                what: format!("sequence length {seq} exceeds max_position_embeddings {max}"),
            });
        }
        Ok(())
    }

    /// The tables for the first `seq` positions.
    pub fn tables(&self, seq: usize) -> Result<RopeTables> {
        self.check_len(seq)?;
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let (c, s) = self.host(&mut cache, seq)?;
        drop(cache);
        Ok(RopeTables { cos: c.narrow(0, 0, seq)?, sin: s.narrow(0, 0, seq)? })
    }
}

impl Module for RotaryPositionEncoding {
    fn type_name(&self) -> &'static str {
        "RotaryPositionEncoding"
    }
    /// Input: a sequence length as a one-element i64 tensor; output: opaque [`RopeTables`].
    fn forward(&self, args: Args) -> Result<Value> {
        let seq = args.get(0).into_tensor("RotaryPositionEncoding")?.item()? as usize;
        Ok(Value::Opaque(Arc::new(self.tables(seq)?)))
    }
    module_boilerplate!();
}

/// The `[batch, seq]` padding mask checked and read as one flag per key (1 for a
/// token); `None` gives all tokens.
fn padding_flags(attention_mask: Option<&Tensor>, batch: usize, seq: usize) -> Result<Vec<bool>> {
    match attention_mask {
        Some(m) => {
            check_padding_shape(m, batch, seq)?;
            Ok(m.to_vec_f64()?.into_iter().map(|x| x != 0.0).collect())
        }
        None => Ok(vec![true; batch * seq]),
    }
}

/// A padding mask must be `[batch, seq]`.
fn check_padding_shape(m: &Tensor, batch: usize, seq: usize) -> Result<()> {
    if m.dims() != [batch, seq] {
        return Err(NnError::BadInput {
            module: "LlamaModel".into(),
            what: format!("attention_mask of shape {:?}, expected [{batch}, {seq}]", m.dims()),
        });
    }
    Ok(())
}

/// An f32 host mask in `dtype` (0 and `-inf` are exact in every float dtype).
fn mask_tensor(v: Vec<f32>, shape: tpar_tensor::Shape, dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_vec(v, shape)?;
    Ok(if dtype == DType::F32 { t } else { t.to_dtype(dtype)? })
}

/// An additive attention mask `[batch, 1, seq, seq]`: 0 where query `i` may attend key
/// `j` (`j <= i` and key `j` is not padding), `-inf` elsewhere. `attention_mask` is
/// `[batch, seq]` with 1 for tokens and 0 for padding.
///
/// This is the explicit form of what the model computes from a padding mask; the model
/// itself never builds it: it passes [`key_padding_mask`] and causal attention.
pub fn causal_padding_mask(
    attention_mask: Option<&Tensor>,
    batch: usize,
    seq: usize,
    dtype: DType,
) -> Result<Tensor> {
    // `[b, 1, s, s]` grows with the square of the sequence: check it can exist first.
    let shape = tpar_tensor::Shape::new(&[batch, 1, seq, seq]);
    tpar_tensor::check_alloc("causal_padding_mask", &shape, dtype)?;
    let tok = padding_flags(attention_mask, batch, seq)?;
    let mut v = tpar_tensor::try_vec("causal_padding_mask", &shape, DType::F32, 0.0f32)?;
    for b in 0..batch {
        for i in 0..seq {
            let row = &mut v[(b * seq + i) * seq..][..seq];
            for (j, x) in row.iter_mut().enumerate() {
                if j > i || !tok[b * seq + j] {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }
    mask_tensor(v, shape, dtype)
}

/// The key-padding mask attention takes from a `[batch, seq]` padding mask (1 for
/// tokens, 0 for padding): an additive `[batch, 1, 1, seq]` mask, 0 for a token and
/// `-inf` for a padded key, broadcast over heads and query rows (memory linear in the
/// sequence). With causal attention it masks exactly as [`causal_padding_mask`].
///
/// An integer (i64) mask on a CUDA device is turned into the additive mask there, with
/// device elementwise kernels and nothing read back: a nonzero integer `m` has
/// `|m| >= 1`, so `ln(min(|m|, 1))` is exactly 0 for a token and `-inf` for padding (the
/// result is on the mask's device). Other masks are read on the host.
pub fn key_padding_mask(
    attention_mask: &Tensor,
    batch: usize,
    seq: usize,
    dtype: DType,
) -> Result<Tensor> {
    if attention_mask.dtype() == DType::I64 && matches!(attention_mask.device(), Device::Cuda(_)) {
        check_padding_shape(attention_mask, batch, seq)?;
        let m = attention_mask.to_dtype(DType::F32)?.abs()?;
        let one = Tensor::ones([], DType::F32, attention_mask.device())?;
        let additive = m.minimum(&one)?.log()?.reshape([batch, 1, 1, seq])?;
        return Ok(additive.to_dtype(dtype)?);
    }
    let tok = padding_flags(Some(attention_mask), batch, seq)?;
    let v = tok.iter().map(|&t| if t { 0.0 } else { f32::NEG_INFINITY }).collect();
    mask_tensor(v, tpar_tensor::Shape::new(&[batch, 1, 1, seq]), dtype)
}

/// An additive mask must be `[b, 1, s, s]` with a float dtype.
fn check_additive_mask(m: &Tensor, batch: usize, seq: usize) -> Result<()> {
    if m.dims() != [batch, 1, seq, seq] || !m.dtype().is_float() {
        return Err(NnError::BadInput {
            module: "LlamaModel".into(),
            what: format!(
                "an additive attention mask must be a float [{batch}, 1, {seq}, {seq}] tensor, \
                 got {} {:?}",
                m.dtype(),
                m.dims()
            ),
        });
    }
    Ok(())
}

/// The additive mask attention gets from a model input: `None` (plain causal: no mask
/// tensor), a `[b, s]` padding mask (a `[b, 1, 1, s]` [`key_padding_mask`], which
/// attention combines with causal masking), or an additive `[b, 1, s, s]` float mask
/// used as given; in `dtype` on `device`.
pub(crate) fn attention_mask(
    given: Option<&Tensor>,
    b: usize,
    s: usize,
    dtype: DType,
    device: Device,
) -> Result<Option<Tensor>> {
    given
        .map(|m| -> Result<Tensor> {
            if m.rank() == 4 {
                check_additive_mask(m, b, s)?;
                return Ok(m.to_dtype(dtype)?.to_device(device)?);
            }
            Ok(key_padding_mask(m, b, s, dtype)?.to_device(device)?)
        })
        .transpose()
}

/// Optional fusions of the Llama's decoder layers, all off by default (the model then
/// computes exactly as without them). Set them with [`LlamaForPretraining::set_fusion`],
/// [`LlamaModel::set_fusion`] or [`LlamaDecoderLayer::set_fusion`]; they are not part of
/// [`LlamaConfig`], so configurations, checkpoints and FQNs are the same either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlamaFusion {
    /// q, k and v computed by one GEMM over the concatenation of `q_proj`, `k_proj` and
    /// `v_proj`'s weights on dim 0 (each weight keeps its own parameter, gradient, FQN and
    /// optimizer state): without context parallelism the output stays whole
    /// ([`Tensor::linear_concat`], whose backward is one GEMM for the input's gradient and
    /// one for the weights') and attention reads it as it is
    /// ([`Tensor::attention_packed`]); under context parallelism it is split back into q,
    /// k and v ([`Tensor::linear_many`], the backward each projection's own). Gate and up
    /// likewise with one GEMM over `gate_proj` and `up_proj`, split back.
    ///
    /// It applies where the plan allows: a plain (not DTensor) input and projections
    /// without bias and without hooks of their own (no parallel style installed on them)
    /// whose weights compute as plain tensors or as DTensors replicated on every mesh dim
    /// (FSDP's gathered parameters, data-parallel replicas), of one dtype and device.
    /// Anywhere else (a tensor-parallel plan on the projections, a DTensor input) the
    /// separate projections run, silently, with the same results as without the fusion.
    pub projections: bool,
    /// The residual adds of each decoder layer, `x + o_proj(a)` and `h + down_proj(m)`,
    /// each computed with its projection as one op ([`Value::linear_add`]): on a CUDA
    /// device one GEMM that reads the residual as its C operand, on the host the
    /// projection then the add (the same bits as without the fusion).
    ///
    /// It applies where the attention block or MLP and its output projection have no
    /// hooks (no parallel style installed on them) and the projection has no bias, and
    /// the hidden states and the weight are plain (or replicated) tensors; anywhere else
    /// the projection and the add run apart, as without the fusion.
    pub residual: bool,
}

/// Whether `lin`'s output can take a residual in its GEMM: no hooks and no bias.
fn linear_takes_residual(lin: &Linear) -> bool {
    lin.bias.is_none() && lin.core().hooks().is_empty()
}

/// Grouped-query self-attention with RoPE. The head counts are read from the
/// projections' outputs (this rank's heads when a plan hands on local shards), so a
/// head-sharded plan needs no change here.
pub struct LlamaAttention {
    core: ModuleCore,
    /// Query projection.
    pub q_proj: Linear,
    /// Key projection.
    pub k_proj: Linear,
    /// Value projection.
    pub v_proj: Linear,
    /// Output projection.
    pub o_proj: Linear,
    head_dim: usize,
    fuse_projections: bool,
}

impl LlamaAttention {
    /// The attention block of `cfg`.
    pub fn new(cfg: &LlamaConfig, device: Device) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        Ok(LlamaAttention {
            core: ModuleCore::default(),
            q_proj: Linear::new(h, cfg.num_attention_heads * hd, false, cfg.dtype, device)?,
            k_proj: Linear::new(h, cfg.num_key_value_heads * hd, false, cfg.dtype, device)?,
            v_proj: Linear::new(h, cfg.num_key_value_heads * hd, false, cfg.dtype, device)?,
            o_proj: Linear::new(cfg.num_attention_heads * hd, h, false, cfg.dtype, device)?,
            head_dim: hd,
            fuse_projections: false,
        })
    }

    /// Head dim.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Computes q, k and v with one GEMM over the concatenated weights when `on` and the
    /// plan allows it (see [`LlamaFusion::projections`]); off by default.
    pub fn set_fuse_projections(&mut self, on: bool) {
        self.fuse_projections = on;
    }

    /// Whether the forward on the hidden states `x` computes q, k and v as one GEMM: the
    /// fusion is on and the plan allows it ([`LlamaFusion::projections`]). It reads (for
    /// FSDP, gathers) the weights as the forward does.
    pub fn projections_fused_for(&self, x: &Value) -> Result<bool> {
        let projs = [&self.q_proj, &self.k_proj, &self.v_proj];
        Ok(self.fuse_projections && fusable(x, &projs)?.is_some())
    }

    /// `residual + forward(args)` with the add in `o_proj`'s GEMM ([`Value::linear_add`]),
    /// where neither this module nor `o_proj` has hooks and `o_proj` has no bias; `None`
    /// otherwise (the caller adds).
    fn forward_add(&self, args: Args, residual: &Value) -> Result<Option<Value>> {
        if !self.core().hooks().is_empty() || !linear_takes_residual(&self.o_proj) {
            return Ok(None);
        }
        let a = self.attend(args)?;
        Ok(Some(a.linear_add(&self.o_proj.weight.compute()?, residual)?))
    }

    /// Attention's output before `o_proj`, `[b, s, hq * hd]`, for [`Module::forward`]'s inputs.
    ///
    /// Plain (not DTensor) operands without context parallelism go through one attention
    /// op on `[b, s, heads, hd]` ([`Tensor::attention_bshd`], or, with fused projections,
    /// [`Tensor::attention_packed`] on the one GEMM's output [`Tensor::linear_concat`]
    /// keeps whole; on a CUDA device [`Tensor::attention_packed_rotated`] on the output of
    /// [`Tensor::linear_concat_rope`], whose GEMM rotates q and k as it writes them),
    /// which on a device reads them in place; the others through RoPE,
    /// transposes and [`Value::scaled_dot_product_attention`] (or context-parallel
    /// attention), which compute the same values.
    fn attend(&self, args: Args) -> Result<Value> {
        let who = "LlamaAttention";
        let x = args.get(0);
        // Under context parallelism the tables come at this rank's positions with the
        // attention settings (crate::context_parallel).
        let cp = args.get(1).opaque::<crate::context_parallel::CpRope>(who).ok();
        let rope = match &cp {
            Some(c) => Arc::new(c.tables.clone()),
            None => args.get(1).opaque::<RopeTables>(who)?,
        };
        let mask = args.get(2).into_optional_tensor(who)?;
        let hd = self.head_dim;
        let heads = |w: usize| -> Result<usize> {
            if hd == 0 || !w.is_multiple_of(hd) {
                return Err(NnError::Config {
                    what: format!("{who}: projection width {w} is not a multiple of head_dim {hd}"),
                });
            }
            Ok(w / hd)
        };
        // [b, s, heads * hd] -> [b, s, heads, hd]
        let split = |t: &Value| -> Result<Value> {
            let d = t.shape()?;
            t.reshape(&[d[0] as isize, d[1] as isize, heads(d[2])? as isize, hd as isize])
        };
        // The tables for `s` positions in the activations' dtype `act`: longer ones (a
        // pipeline stage passes the whole tables) are cut to the sequence, and as they are
        // built in the model's (master) dtype, under mixed precision the activations are
        // narrower (bf16), so they are cast as HF's Llama does.
        let tables = |s: usize, act: DType| -> Result<(Tensor, Tensor)> {
            if rope.cos.dims()[0] < s {
                return Err(NnError::BadInput {
                    module: who.into(),
                    what: format!(
                        "RoPE tables for {} positions, sequence has {s}",
                        rope.cos.dims()[0]
                    ),
                });
            }
            let (cos, sin) = if rope.cos.dims()[0] == s {
                (rope.cos.clone(), rope.sin.clone())
            } else {
                (rope.cos.narrow(0, 0, s)?, rope.sin.narrow(0, 0, s)?)
            };
            Ok((cos.to_dtype(act)?, sin.to_dtype(act)?))
        };
        let groups = |hq: usize, hkv: usize| -> Result<()> {
            if hkv == 0 || !hq.is_multiple_of(hkv) {
                return Err(NnError::Config {
                    what: format!("{who}: {hq} query heads are not a multiple of {hkv} kv heads"),
                });
            }
            Ok(())
        };
        // The mask, like the tables, is built in the model's dtype; a mask with one row
        // ([b, 1, 1, s]) masks keys, and causality comes from the flag.
        let masked = |act: DType| -> Result<(Option<Tensor>, bool)> {
            let mask = mask.as_ref().map(|m| m.to_dtype(act)).transpose()?;
            let causal = mask.as_ref().is_none_or(|m| m.rank() == 4 && m.dims()[2] == 1);
            Ok((mask, causal))
        };
        let projs = [&self.q_proj, &self.k_proj, &self.v_proj];
        let fused = if self.fuse_projections { fusable(&x, &projs)? } else { None };
        let qkv = match fused {
            // [b, s, hidden] x [(hq + 2 hkv) * hd, hidden]^T -> [b, s, (hq + 2 hkv) * hd];
            // on a device q and k are rotated where the GEMM writes them
            Some((xt, w)) if cp.is_none() && w[1].dims()[0] == w[2].dims()[0] => {
                let (hq, hkv) = (heads(w[0].dims()[0])?, heads(w[1].dims()[0])?);
                if matches!(xt.device(), Device::Cuda(_)) && xt.rank() == 3 {
                    groups(hq, hkv)?;
                    let (cos, sin) = tables(xt.dims()[1], xt.dtype())?;
                    let qkv = xt.linear_concat_rope(&w, 2, &cos, &sin)?;
                    let (mask, causal) = masked(qkv.dtype())?;
                    let a = Tensor::attention_packed_rotated(&qkv, hq, hkv, mask.as_ref(), causal)?;
                    return Ok(Value::Tensor(a)); // [b, s, hq * hd]
                }
                Qkv::Packed(xt.linear_concat(&w)?, hq, hkv)
            }
            // [b, s, (hq + 2 hkv) * hd] split into q, k and v.
            Some((xt, w)) => {
                let p: Vec<Value> = xt.linear_many(&w)?.into_iter().map(Value::Tensor).collect();
                Qkv::Split(split(&p[0])?, split(&p[1])?, split(&p[2])?)
            }
            None => {
                let proj = |p: &Linear| call(p, Args::one(x.clone()));
                let [q, k, v] = projs.map(proj);
                Qkv::Split(split(&q?)?, split(&k?)?, split(&v?)?)
            }
        };
        let (b, s, hq, hkv, act) = match &qkv {
            Qkv::Packed(t, hq, hkv) => (t.dims()[0], t.dims()[1], *hq, *hkv, t.dtype()),
            Qkv::Split(q, k, _) => {
                let qd = q.shape()?;
                (qd[0], qd[1], qd[2], k.shape()?[2], q.dtype()?)
            }
        };
        groups(hq, hkv)?;
        let (mask, causal) = masked(act)?;
        let (cos, sin) = tables(s, act)?;
        let (q, k, v) = match qkv {
            Qkv::Packed(t, hq, hkv) => {
                let a = Tensor::attention_packed(&t, hq, hkv, &cos, &sin, mask.as_ref(), causal)?;
                return Ok(Value::Tensor(a)); // [b, s, hq * hd]
            }
            Qkv::Split(Value::Tensor(q), Value::Tensor(k), Value::Tensor(v)) if cp.is_none() => {
                let a = Tensor::attention_bshd(&q, &k, &v, &cos, &sin, mask.as_ref(), causal)?;
                return Ok(Value::Tensor(a.reshape([b, s, hq * hd])?)); // [b, s, hq * hd]
            }
            Qkv::Split(q, k, v) => (q, k, v),
        };
        // [b, s, heads, hd] -> [b, heads, s, hd], q and k rotated: a plain tensor in one
        // pass on a device (Tensor::rope_bshd_to_bhsd, the same bits as the transpose then
        // the rotation), a distributed one as the transpose then Value::rope.
        let rotate = |t: Value| -> Result<Value> {
            match t {
                Value::Tensor(t) => Ok(Value::Tensor(t.rope_bshd_to_bhsd(&cos, &sin)?)),
                t => t.transpose(1, 2)?.rope(&cos, &sin, RopeLayout::Bhsd),
            }
        };
        let (q, k, v) = (rotate(q)?, rotate(k)?, v.transpose(1, 2)?);
        let a = match &cp {
            Some(c) => crate::context_parallel::cp_attention(c, &q, &k, &v, mask.as_ref())?,
            None => Value::scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), causal, None)?,
        }; // [b, hq, s, hd]
        let a = a.transpose(1, 2)?.reshape(&[b as isize, s as isize, (hq * hd) as isize])?; // [b, s, hq * hd]
        Ok(a)
    }
}

/// The operands [`LlamaAttention`] computes attention on: the packed output of the fused
/// projections `[b, s, (hq + 2 hkv) * hd]` with its head counts `(hq, hkv)`, or q, k and
/// v `[b, s, heads, hd]`.
enum Qkv {
    Packed(Tensor, usize, usize),
    Split(Value, Value, Value),
}

impl Module for LlamaAttention {
    fn type_name(&self) -> &'static str {
        "LlamaAttention"
    }

    /// Inputs: hidden states `[b, s, hidden]` (plain or DTensor), the RoPE tables
    /// (opaque), and the additive mask: none for plain causal attention, a key-padding
    /// mask `[b, 1, 1, s]` for causal attention that also skips padded keys, or a
    /// `[b, 1, s, s]` mask used as given (not made causal).
    fn forward(&self, args: Args) -> Result<Value> {
        let a = self.attend(args)?;
        call(&self.o_proj, Args::one(a))
    }

    fn attention_heads(&self) -> Option<AttentionHeads> {
        Some(AttentionHeads {
            head_dim: self.head_dim,
            projections: vec![
                ("q_proj", self.q_proj.out_features()),
                ("k_proj", self.k_proj.out_features()),
                ("v_proj", self.v_proj.out_features()),
            ],
        })
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("q_proj".into(), &self.q_proj as &dyn Module),
            ("k_proj".into(), &self.k_proj),
            ("v_proj".into(), &self.v_proj),
            ("o_proj".into(), &self.o_proj),
        ]
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("q_proj".into(), &mut self.q_proj as &mut dyn Module),
            ("k_proj".into(), &mut self.k_proj),
            ("v_proj".into(), &mut self.v_proj),
            ("o_proj".into(), &mut self.o_proj),
        ]
    }

    module_boilerplate!();
}

/// The input and the weights `projs` compute with when the plan allows computing them
/// as one GEMM ([`LlamaFusion::projections`]); `None` otherwise.
fn fusable(x: &Value, projs: &[&Linear]) -> Result<Option<(Tensor, Vec<Tensor>)>> {
    let Value::Tensor(xt) = x else { return Ok(None) };
    let mut weights = Vec::with_capacity(projs.len());
    for p in projs {
        if p.bias.is_some() || !p.core().hooks().is_empty() {
            return Ok(None);
        }
        match p.weight.compute()?.replicated_local() {
            Some(w) => weights.push(w),
            None => return Ok(None),
        }
    }
    let Some(first) = weights.first() else { return Ok(None) };
    let alike = |w: &Tensor| {
        w.rank() == 2
            && w.dims()[1] == first.dims()[1]
            && w.dtype() == first.dtype()
            && w.device() == first.device()
    };
    if !weights.iter().all(alike) {
        return Ok(None);
    }
    Ok(Some((xt.clone(), weights)))
}

/// The projections of `x` by `projs` as one GEMM over their weights concatenated on dim
/// 0, the output split back on its last dim, one piece per projection; `None` where the
/// plan does not allow it ([`LlamaFusion::projections`]), so the caller runs them apart.
fn fused_linear(x: &Value, projs: &[&Linear]) -> Result<Option<Vec<Value>>> {
    let Some((xt, weights)) = fusable(x, projs)? else { return Ok(None) };
    // [..., in] x [sum(out), in]^T -> [..., sum(out)], split into [..., out_i].
    let pieces = xt.linear_many(&weights)?;
    Ok(Some(pieces.into_iter().map(Value::Tensor).collect()))
}

/// The SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
pub struct LlamaMLP {
    core: ModuleCore,
    /// Gate projection.
    pub gate_proj: Linear,
    /// Up projection.
    pub up_proj: Linear,
    /// Down projection.
    pub down_proj: Linear,
    fuse_projections: bool,
}

impl LlamaMLP {
    /// The MLP of `cfg`.
    pub fn new(cfg: &LlamaConfig, device: Device) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(LlamaMLP {
            core: ModuleCore::default(),
            gate_proj: Linear::new(h, i, false, cfg.dtype, device)?,
            up_proj: Linear::new(h, i, false, cfg.dtype, device)?,
            down_proj: Linear::new(i, h, false, cfg.dtype, device)?,
            fuse_projections: false,
        })
    }

    /// Computes gate and up with one GEMM over the concatenated weights when `on` and
    /// the plan allows it (see [`LlamaFusion::projections`]); off by default.
    pub fn set_fuse_projections(&mut self, on: bool) {
        self.fuse_projections = on;
    }

    /// Whether the forward on the input `x` computes gate and up as one GEMM: the fusion
    /// is on and the plan allows it ([`LlamaFusion::projections`]). It reads (for FSDP,
    /// gathers) the weights as the forward does.
    pub fn projections_fused_for(&self, x: &Value) -> Result<bool> {
        Ok(self.fuse_projections && fusable(x, &[&self.gate_proj, &self.up_proj])?.is_some())
    }

    /// `silu(gate(x)) * up(x)`, the input of `down_proj`, `[b, s, intermediate]`. Fused
    /// on a CUDA device, the one GEMM's output is kept whole and [`Tensor::swiglu`] reads
    /// its halves in place (its backward writes one gradient for the GEMM's backward);
    /// elsewhere the output is split into gate and up.
    fn gated(&self, args: Args) -> Result<Value> {
        let x = args.get(0);
        let projs = [&self.gate_proj, &self.up_proj];
        if self.fuse_projections {
            if let Some((xt, w)) = fusable(&x, &projs)? {
                let equal = w[0].dims()[0] == w[1].dims()[0];
                if equal && matches!(xt.device(), Device::Cuda(_)) {
                    // [b, s, hidden] x [2 i, hidden]^T -> [b, s, 2 i] -> [b, s, i]
                    return Ok(Value::Tensor(xt.linear_concat(&w)?.swiglu()?));
                }
            }
        }
        let fused = if self.fuse_projections { fused_linear(&x, &projs)? } else { None };
        let (gate, up) = match fused.as_deref() {
            // [b, s, 2 i] split into gate and up.
            Some([gate, up]) => (gate.clone(), up.clone()),
            _ => (call(&self.gate_proj, Args::one(x.clone()))?, call(&self.up_proj, Args::one(x))?),
        };
        gate.silu_mul(&up)
    }

    /// `residual + forward(args)` with the add in `down_proj`'s GEMM
    /// ([`Value::linear_add`]), where neither this module nor `down_proj` has hooks and
    /// `down_proj` has no bias; `None` otherwise (the caller adds).
    /// With `unread` (the caller's output, which this sum becomes, goes unread: see
    /// [`tpar_nn::output_unread`]) a recompute leaves the sum uncomputed.
    fn forward_add(&self, args: Args, residual: &Value, unread: bool) -> Result<Option<Value>> {
        if !self.core().hooks().is_empty() || !linear_takes_residual(&self.down_proj) {
            return Ok(None);
        }
        let m = self.gated(args)?;
        let w = self.down_proj.weight.compute()?;
        let sum = || m.linear_add(&w, residual);
        Ok(Some(if unread { checkpoint::unread_output(sum) } else { sum() }?))
    }
}

impl Module for LlamaMLP {
    fn type_name(&self) -> &'static str {
        "LlamaMLP"
    }

    /// `down_proj(silu(gate_proj(x)) * up_proj(x))`. Where its own output goes unread
    /// ([`tpar_nn::output_unread`], in an activation checkpoint's recompute), so does
    /// `down_proj`'s: its backward reads only its input and weight.
    fn forward(&self, args: Args) -> Result<Value> {
        let unread = tpar_nn::output_unread();
        let h = self.gated(args)?;
        if unread {
            checkpoint::request_output_unread();
        }
        call(&self.down_proj, Args::one(h))
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("gate_proj".into(), &self.gate_proj as &dyn Module),
            ("up_proj".into(), &self.up_proj),
            ("down_proj".into(), &self.down_proj),
        ]
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("gate_proj".into(), &mut self.gate_proj as &mut dyn Module),
            ("up_proj".into(), &mut self.up_proj),
            ("down_proj".into(), &mut self.down_proj),
        ]
    }

    module_boilerplate!();
}

/// One decoder layer: pre-norm attention and pre-norm MLP, each with a residual.
pub struct LlamaDecoderLayer {
    core: ModuleCore,
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Attention.
    pub self_attn: LlamaAttention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// MLP.
    pub mlp: LlamaMLP,
    fuse_residual: bool,
}

impl LlamaDecoderLayer {
    /// A layer of `cfg`.
    pub fn new(cfg: &LlamaConfig, device: Device) -> Result<Self> {
        Ok(LlamaDecoderLayer {
            core: ModuleCore::default(),
            input_layernorm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)?,
            self_attn: LlamaAttention::new(cfg, device)?,
            post_attention_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                cfg.dtype,
                device,
            )?,
            mlp: LlamaMLP::new(cfg, device)?,
            fuse_residual: false,
        })
    }

    /// Switches this layer's optional fusions ([`LlamaFusion`]).
    pub fn set_fusion(&mut self, fusion: LlamaFusion) {
        self.self_attn.set_fuse_projections(fusion.projections);
        self.mlp.set_fuse_projections(fusion.projections);
        self.fuse_residual = fusion.residual;
    }
}

impl Module for LlamaDecoderLayer {
    fn type_name(&self) -> &'static str {
        "LlamaDecoderLayer"
    }

    /// Inputs: hidden states, RoPE tables, mask (as [`LlamaAttention`]). The output is
    /// `x + mlp(...)`: where it goes unread ([`tpar_nn::output_unread`], in an activation
    /// checkpoint's recompute of this layer) so does the MLP's, since the add's backward
    /// reads no values.
    fn forward(&self, args: Args) -> Result<Value> {
        let unread = tpar_nn::output_unread();
        let x = args.get(0);
        let h = call(&self.input_layernorm, Args::one(x.clone()))?;
        let attn_args = Args::new(vec![h, args.get(1), args.get(2)]);
        let fused = if self.fuse_residual {
            self.self_attn.forward_add(attn_args.clone(), &x)?
        } else {
            None
        };
        let x = match fused {
            Some(x) => x,
            None => x.add(&call(&self.self_attn, attn_args)?)?,
        };
        let h = call(&self.post_attention_layernorm, Args::one(x.clone()))?;
        let fused = if self.fuse_residual {
            self.mlp.forward_add(Args::one(h.clone()), &x, unread)?
        } else {
            None
        };
        match fused {
            Some(x) => Ok(x),
            None => {
                if unread {
                    checkpoint::request_output_unread();
                }
                let m = call(&self.mlp, Args::one(h))?;
                x.add(&m)
            }
        }
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("input_layernorm".into(), &self.input_layernorm as &dyn Module),
            ("self_attn".into(), &self.self_attn),
            ("post_attention_layernorm".into(), &self.post_attention_layernorm),
            ("mlp".into(), &self.mlp),
        ]
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("input_layernorm".into(), &mut self.input_layernorm as &mut dyn Module),
            ("self_attn".into(), &mut self.self_attn),
            ("post_attention_layernorm".into(), &mut self.post_attention_layernorm),
            ("mlp".into(), &mut self.mlp),
        ]
    }

    module_boilerplate!();
}

/// Embedding, decoder layers, final norm.
pub struct LlamaModel {
    core: ModuleCore,
    /// Token embedding.
    pub embed_tokens: Embedding,
    /// The decoder layers (`layers.0`, `layers.1`, ...), each checkpointable (a
    /// pass-through until `apply_activation_checkpointing` sets a policy; same FQNs).
    pub layers: ModuleList<CheckpointWrapper<LlamaDecoderLayer>>,
    /// Final norm.
    pub norm: RmsNorm,
    /// RoPE tables.
    pub rotary_emb: RotaryPositionEncoding,
    dtype: DType,
    /// Set by [`crate::context_parallel::apply_context_parallel`].
    pub(crate) context_parallel: Option<crate::context_parallel::CpConfig>,
}

impl LlamaModel {
    /// The model of `cfg` on `device` (`Device::Meta` for deferred initialisation).
    pub fn new(cfg: &LlamaConfig, device: Device) -> Result<Self> {
        cfg.validate()?;
        Ok(LlamaModel {
            core: ModuleCore::default(),
            embed_tokens: Embedding::new(cfg.vocab_size, cfg.hidden_size, cfg.dtype, device)?,
            layers: ModuleList::new(
                (0..cfg.num_hidden_layers)
                    .map(|_| LlamaDecoderLayer::new(cfg, device).map(CheckpointWrapper::new))
                    .collect::<Result<_>>()?,
            ),
            norm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)?,
            rotary_emb: RotaryPositionEncoding::new(
                cfg.head_dim(),
                cfg.max_position_embeddings,
                cfg.rope_theta,
                cfg.dtype,
            )?
            .with_scaling(cfg.rope_scaling),
            dtype: cfg.dtype,
            context_parallel: None,
        })
    }

    /// Switches the optional fusions ([`LlamaFusion`]) of every decoder layer.
    pub fn set_fusion(&mut self, fusion: LlamaFusion) {
        for layer in &mut self.layers.items {
            layer.inner_mut().set_fusion(fusion);
        }
    }
}

impl Module for LlamaModel {
    fn type_name(&self) -> &'static str {
        "LlamaModel"
    }

    /// Inputs: token ids `[b, s]` (i64) and optionally a mask as the second input, in
    /// either of Hugging Face's forms:
    /// - none: plain causal attention, with no mask tensor built;
    /// - `attention_mask` `[b, s]` (1 for tokens, 0 for padding): causal attention that
    ///   also skips padded keys, through a `[b, 1, 1, s]` [`key_padding_mask`] (no
    ///   `[b, 1, s, s]` mask is built);
    /// - an additive float mask `[b, 1, s, s]` (0 where query `i` may attend key `j`,
    ///   `-inf` or a large negative value elsewhere), used as given: it must carry the
    ///   causal structure itself when it should be causal.
    ///
    /// Output: hidden states.
    fn forward(&self, args: Args) -> Result<Value> {
        let ids = args.get(0).into_local("LlamaModel")?;
        if ids.rank() != 2 {
            return Err(NnError::BadInput {
                module: "LlamaModel".into(),
                what: format!("input_ids must be [batch, seq], got {:?}", ids.dims()),
            });
        }
        let (b, s) = (ids.dims()[0], ids.dims()[1]);
        let pad = args.get(1).into_optional_tensor("LlamaModel")?;
        let device = ids.device();
        let (mask, rope) = match &self.context_parallel {
            Some(cp) => crate::context_parallel::cp_inputs(
                cp,
                &self.rotary_emb,
                pad.as_ref(),
                b,
                s,
                self.dtype,
                device,
            )?,
            None => (
                attention_mask(pad.as_ref(), b, s, self.dtype, device)?,
                Value::Opaque(Arc::new(self.rotary_emb.tables_on(s, device)?)),
            ),
        };
        let x = call(&self.embed_tokens, Args::new(vec![args.get(0)]))?;
        let mask = mask.map(Value::Tensor).unwrap_or(Value::None);
        let x = call(&self.layers, Args::new(vec![x, rope, mask]))?;
        call(&self.norm, Args::new(vec![x]))
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("embed_tokens".into(), &self.embed_tokens as &dyn Module),
            ("layers".into(), &self.layers),
            ("norm".into(), &self.norm),
        ]
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("embed_tokens".into(), &mut self.embed_tokens as &mut dyn Module),
            ("layers".into(), &mut self.layers),
            ("norm".into(), &mut self.norm),
        ]
    }

    module_boilerplate!();
}

/// The model plus the language-model head.
pub struct LlamaForPretraining {
    core: ModuleCore,
    /// The transformer.
    pub base_model: LlamaModel,
    /// `[vocab, hidden]` projection to logits.
    pub lm_head: Linear,
    /// The configuration.
    pub config: LlamaConfig,
}

impl LlamaForPretraining {
    /// The model of `cfg` on `device`.
    pub fn new(cfg: &LlamaConfig, device: Device) -> Result<Self> {
        Ok(LlamaForPretraining {
            core: ModuleCore::default(),
            base_model: LlamaModel::new(cfg, device)?,
            lm_head: Linear::new(cfg.hidden_size, cfg.vocab_size, false, cfg.dtype, device)?,
            config: *cfg,
        })
    }

    /// Switches the optional fusions ([`LlamaFusion`]) of every decoder layer; the
    /// parameters, their names and the default computation are unchanged.
    pub fn set_fusion(&mut self, fusion: LlamaFusion) {
        self.base_model.set_fusion(fusion);
    }

    /// `model(input_ids, attention_mask)`: the logits `[b, s, vocab]` for token ids
    /// `[b, s]` (i64), through the module's hooks (so parallel styles apply). `mask` is
    /// `None` for plain causal attention, a `[b, s]` padding mask (1 for tokens) or an
    /// additive `[b, 1, s, s]` float mask ([`LlamaModel`]'s forward). The logits are a
    /// plain tensor, or a vocab-sharded DTensor under a plan whose lm_head keeps them
    /// distributed; [`Value::reshape`], [`Value::cross_entropy`] and [`Value::backward`]
    /// treat both alike.
    pub fn logits(&self, input_ids: &Tensor, mask: Option<&Tensor>) -> Result<Value> {
        let mut args = vec![Value::Tensor(input_ids.clone())];
        if let Some(m) = mask {
            args.push(Value::Tensor(m.clone()));
        }
        call(self, Args::new(args))
    }
}

impl Module for LlamaForPretraining {
    fn type_name(&self) -> &'static str {
        "LlamaForPretraining"
    }

    /// Inputs as [`LlamaModel`]; output: logits `[b, s, vocab]` (a DTensor sharded on
    /// the vocab when `lm_head` is `ColwiseParallel` with `use_local_output = false`).
    fn forward(&self, args: Args) -> Result<Value> {
        let h = call(&self.base_model, args)?;
        call(&self.lm_head, Args::new(vec![h]))
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("base_model".into(), &self.base_model as &dyn Module),
            ("lm_head".into(), &self.lm_head),
        ]
    }

    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("base_model".into(), &mut self.base_model as &mut dyn Module),
            ("lm_head".into(), &mut self.lm_head),
        ]
    }

    module_boilerplate!();
}
