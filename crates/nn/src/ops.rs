//! The op set layers compute with. Each op is written once on [`Value`] (and
//! [`ComputeParam`] for a parameter used as an operand) and dispatches once to the
//! [`Tensor`] op or the [`DTensor`] op of the same name, so a layer's forward reads the
//! same whether a plan left its activations and parameters plain or distributed.
//!
//! Two rules decide which form an op runs in:
//! - Activations: all plain gives a plain result, all DTensor a DTensor result. A plain
//!   tensor next to a DTensor is taken as this rank's shard of the same layout (what a
//!   style with `use_local_output` hands on), so the DTensor's local tensor is used and
//!   the result is plain.
//! - Parameters ([`Value::linear`], [`Value::embedding`], [`Value::rms_norm`],
//!   [`ComputeParam::operand_for`]): a DTensor input computes with DTensor parameters;
//!   a plain input with plain parameters or DTensors replicated on every mesh dim
//!   ([`ComputeParam::replicated_local`]). Any other mix is a [`NnError::BadInput`]
//!   naming the module, the input and the parameter.

use tpar_dtensor::DTensor;
use tpar_tensor::{DType, RopeLayout, Tensor};

use crate::{ComputeParam, NnError, Result, Value};

/// The operands of one op, all in one form.
enum Operands {
    Plain(Vec<Tensor>),
    Dist(Vec<DTensor>),
}

impl Operands {
    /// Activations by the first rule of the module docs; anything but a tensor is an error
    /// naming `op`.
    fn of(op: &str, values: &[&Value]) -> Result<Operands> {
        let dist: Option<Vec<DTensor>> = values
            .iter()
            .map(|v| match v {
                Value::DTensor(d) => Some(d.clone()),
                _ => None,
            })
            .collect();
        match dist {
            Some(d) => Ok(Operands::Dist(d)),
            None => values
                .iter()
                .map(|v| match v {
                    Value::Tensor(t) => Ok(t.clone()),
                    Value::DTensor(d) => Ok(d.to_local()),
                    other => Err(not_a_tensor(op, other)),
                })
                .collect::<Result<_>>()
                .map(Operands::Plain),
        }
    }

    /// `x` followed by `params`, by the second rule of the module docs.
    fn with_params(module: &str, x: &Value, params: &[&ComputeParam]) -> Result<Operands> {
        match x {
            Value::DTensor(xd) => {
                let mut v = vec![xd.clone()];
                for p in params {
                    match p {
                        ComputeParam::Dist(d) => v.push(d.clone()),
                        ComputeParam::Plain(_) => return Err(mixed(module, x, p)),
                    }
                }
                Ok(Operands::Dist(v))
            }
            Value::Tensor(xt) => {
                let mut v = vec![xt.clone()];
                for p in params {
                    v.push(p.replicated_local().ok_or_else(|| mixed(module, x, p))?);
                }
                Ok(Operands::Plain(v))
            }
            _ => {
                Err(params.first().map_or_else(|| not_a_tensor(module, x), |p| mixed(module, x, p)))
            }
        }
    }

    /// Runs the plain or the distributed form of an op on these operands.
    fn apply<E1, E2>(
        self,
        plain: impl FnOnce(&[Tensor]) -> std::result::Result<Tensor, E1>,
        dist: impl FnOnce(&[DTensor]) -> std::result::Result<DTensor, E2>,
    ) -> Result<Value>
    where
        NnError: From<E1> + From<E2>,
    {
        Ok(match self {
            Operands::Plain(t) => Value::Tensor(plain(&t)?),
            Operands::Dist(d) => Value::DTensor(dist(&d)?),
        })
    }
}

/// [`Operands::apply`] with one body for both forms, for ops whose `Tensor` and `DTensor`
/// methods share a name and signature: `both!(ops, |x| x[0].silu())`.
macro_rules! both {
    ($ops:expr, |$x:ident| $body:expr) => {
        $ops.apply(|$x| $body, |$x| $body)
    };
}

/// A plain shard of a known layout gives, through an elementwise op of one activation, a
/// shard of that layout ([`tpar_dtensor::local_layout::propagate`]).
fn keep_layout(out: &Value, x: &Value) {
    if let (Value::Tensor(o), Value::Tensor(a)) = (out, x) {
        tpar_dtensor::local_layout::propagate(o, &[a]);
    }
}

/// Elementwise ops of one activation, as the `Tensor` and `DTensor` methods.
macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&self) -> Result<Value> {
                let out = both!(Operands::of(stringify!($name), &[self])?, |x| x[0].$name())?;
                keep_layout(&out, self);
                Ok(out)
            }
        )*
    };
}

/// Elementwise ops of one activation and a scalar, as the `Tensor` and `DTensor` methods.
macro_rules! scalar_ops {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&self, s: f64) -> Result<Value> {
                let out = both!(Operands::of(stringify!($name), &[self])?, |x| x[0].$name(s))?;
                keep_layout(&out, self);
                Ok(out)
            }
        )*
    };
}

/// Broadcasting elementwise ops of two activations, as the `Tensor` and `DTensor` methods.
macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&self, rhs: &Value) -> Result<Value> {
                let out = both!(
                    Operands::of(stringify!($name), &[self, rhs])?,
                    |x| x[0].$name(&x[1])
                )?;
                // Plain shards of one known layout (a residual of sequence shards) give a
                // shard of that layout: a style taking it back needs no shape exchange.
                if let (Value::Tensor(o), Value::Tensor(a), Value::Tensor(b)) = (&out, self, rhs) {
                    tpar_dtensor::local_layout::propagate(o, &[a, b]);
                }
                Ok(out)
            }
        )*
    };
}

/// Layer ops. Each runs [`Tensor`]'s op on plain operands and [`DTensor`]'s (with its
/// placement rules and collectives) on distributed ones; see the module docs for mixes.
impl Value {
    /// `self W^T + b` with `W` `[out, in]`: `F.linear` ([`Tensor::linear`],
    /// [`DTensor::linear`]).
    pub fn linear(&self, weight: &ComputeParam, bias: Option<&ComputeParam>) -> Result<Value> {
        let params: Vec<&ComputeParam> = std::iter::once(weight).chain(bias).collect();
        both!(Operands::with_params("Linear", self, &params)?, |x| x[0].linear(&x[1], x.get(2)))
    }

    /// `self W^T + residual` (no bias) as one op where the operands are plain tensors
    /// ([`Tensor::linear_add`]: one GEMM reading the residual on a CUDA device, the two
    /// ops' bits on the host); for DTensor operands `residual + self.linear(W)`, as
    /// [`Value::linear`] then [`Value::add`].
    pub fn linear_add(&self, weight: &ComputeParam, residual: &Value) -> Result<Value> {
        if let (Value::Tensor(x), Value::Tensor(r)) = (self, residual) {
            if let Some(w) = weight.replicated_local() {
                return Ok(Value::Tensor(x.linear_add(&w, r)?));
            }
        }
        residual.add(&self.linear(weight, None)?)
    }

    /// Rows of `weight` `[num, dim]` picked by these i64 ids: `F.embedding`
    /// ([`Tensor::embedding`], [`DTensor::embedding`]).
    pub fn embedding(&self, weight: &ComputeParam) -> Result<Value> {
        Operands::with_params("Embedding", self, &[weight])?
            .apply(|x| Tensor::embedding(&x[0], &x[1]), |x| DTensor::embedding(&x[0], &x[1]))
    }

    /// RMSNorm over the last dim with a `[dim]` weight: `F.rms_norm` ([`Tensor::rms_norm`],
    /// [`DTensor::rms_norm`]).
    pub fn rms_norm(&self, weight: &ComputeParam, eps: f64) -> Result<Value> {
        both!(Operands::with_params("RMSNorm", self, &[weight])?, |x| x[0].rms_norm(&x[1], eps))
    }

    binary_ops! {
        /// `self + rhs` with broadcasting (residual connections).
        add;
        /// `self - rhs` with broadcasting.
        sub;
        /// `self * rhs` with broadcasting.
        mul;
        /// `silu(self) * rhs` as one op (a gated MLP's SwiGLU product; equal shapes).
        silu_mul;
    }

    unary_ops! {
        /// SiLU.
        silu;
        /// `self * self`.
        square;
        /// `1 / sqrt(self)`.
        rsqrt;
        /// Hyperbolic tangent.
        tanh;
    }

    scalar_ops! {
        /// `self + s`.
        add_scalar;
        /// `self * s`.
        mul_scalar;
        /// `self ^ s`.
        pow_scalar;
    }

    /// Dropout, `F.dropout(self, p, training)` ([`Tensor::dropout`]). A DTensor draws the
    /// full tensor's mask shard by shard ([`DTensor::dropout`]), and so does a plain
    /// tensor known as a DTensor's shard (a style's local output, or an elementwise op of
    /// such shards: [`tpar_dtensor::local_layout`]), whose output keeps that layout;
    /// any other plain tensor draws by its own positions.
    pub fn dropout(&self, p: f64, training: bool) -> Result<Value> {
        if let Value::Tensor(t) = self {
            if let Some((global, offset)) = tpar_dtensor::local_layout::known_shard(t) {
                let out = Value::Tensor(t.dropout_shard(p, training, &global, &offset)?);
                keep_layout(&out, self);
                return Ok(out);
            }
        }
        both!(Operands::of("dropout", &[self])?, |x| x[0].dropout(p, training))
    }

    /// Mean over `dim`.
    pub fn mean(&self, dim: isize, keepdim: bool) -> Result<Value> {
        both!(Operands::of("mean", &[self])?, |x| x[0].mean(dim, keepdim))
    }

    /// The same values in a new shape, for a plain tensor or a DTensor alike (one `-1`
    /// dim is inferred): `logits.reshape(&[-1, vocab])`, as [`Tensor::view`] and
    /// [`DTensor::view`] (which keeps the sharding where the new shape allows it).
    pub fn reshape(&self, dims: &[isize]) -> Result<Value> {
        both!(Operands::of("reshape", &[self])?, |x| x[0].view(dims))
    }

    /// Swaps dims `d0` and `d1`.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Value> {
        both!(Operands::of("transpose", &[self])?, |x| x[0].transpose(d0, d1))
    }

    /// Rotary position embedding of a 4-d input with the full `cos`/`sin` tables
    /// `[seq, head_dim]` ([`Tensor::rope`], [`DTensor::rope`]).
    pub fn rope(&self, cos: &Tensor, sin: &Tensor, layout: RopeLayout) -> Result<Value> {
        both!(Operands::of("rope", &[self])?, |x| x[0].rope(cos, sin, layout))
    }

    /// Scaled dot-product attention of `q [b, hq, sq, d]`, `k [b, hkv, sk, d]`,
    /// `v [b, hkv, sk, dv]` with an optional full additive `mask`, `causal` and `scale`
    /// ([`Tensor::scaled_dot_product_attention`],
    /// [`DTensor::scaled_dot_product_attention`]).
    pub fn scaled_dot_product_attention(
        q: &Value,
        k: &Value,
        v: &Value,
        mask: Option<&Tensor>,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<Value> {
        Operands::of("scaled_dot_product_attention", &[q, k, v])?.apply(
            |x| Tensor::scaled_dot_product_attention(&x[0], &x[1], &x[2], mask, causal, scale),
            |x| DTensor::scaled_dot_product_attention(&x[0], &x[1], &x[2], mask, causal, scale),
        )
    }

    /// The global shape (a DTensor's, not its shard's).
    pub fn shape(&self) -> Result<Vec<usize>> {
        match self {
            Value::Tensor(t) => Ok(t.dims().to_vec()),
            Value::DTensor(d) => Ok(d.shape().to_vec()),
            other => Err(not_a_tensor("shape", other)),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> Result<DType> {
        match self {
            Value::Tensor(t) => Ok(t.dtype()),
            Value::DTensor(d) => Ok(d.dtype()),
            other => Err(not_a_tensor("dtype", other)),
        }
    }
}

impl ComputeParam {
    /// The parameter as an operand of an elementwise op on `x` (e.g. a norm's scale and
    /// shift): itself as a DTensor for a DTensor `x`, a plain tensor for a plain `x`
    /// (rules in the module docs; `module` names the layer in the error).
    pub fn operand_for(&self, x: &Value, module: &str) -> Result<Value> {
        match Operands::with_params(module, x, &[self])? {
            Operands::Plain(mut t) => Ok(Value::Tensor(t.swap_remove(1))),
            Operands::Dist(mut d) => Ok(Value::DTensor(d.swap_remove(1))),
        }
    }
}

/// A module's input and parameter that do not mix.
fn mixed(module: &str, x: &Value, p: &ComputeParam) -> NnError {
    NnError::BadInput {
        module: module.to_string(),
        what: format!(
            "input {x:?} and parameter {p:?} do not mix: a sharded parameter needs a DTensor input (install a parallel style), a plain parameter a plain tensor"
        ),
    }
}

/// An op given something other than a tensor.
pub(crate) fn not_a_tensor(op: &str, v: &Value) -> NnError {
    NnError::BadInput { module: op.to_string(), what: format!("expected a tensor, got {v:?}") }
}
