//! Elementwise ops: broadcasting binary ops, scalar ops and unary maps.
//!
//! Placements pass through: on each mesh dim the output takes one operand's placement and
//! the others are brought to match (a `Replicate` operand is sliced locally to a sharded
//! one's rows; a size-1 broadcast dim stays replicated). `Partial` passes only through
//! ops linear in it (see the module docs of [`crate::ops`]).

use tpar_placements::Placement;
use tpar_tensor::{DType, Tensor};

use super::{
    choose, finish, global_shape, is_linear_partial, meta, prepare, prepare_all, unary_rule,
    Operand, Strategy,
};
use crate::{DTensor, Result};

use Placement::{Replicate, Shard};

/// In which operands an elementwise op is linear, i.e. which may stay `Partial`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Linearity {
    /// Not linear in any operand (`exp`, `add_scalar`, ...): a `Partial` is reduced first.
    None,
    /// Linear in all operands jointly (`add`, `sub`, `neg`): `Partial`s of the same op stay
    /// `Partial` when *every* operand is that `Partial`.
    All,
    /// Linear in each operand separately (`mul`): one operand may be `Partial` while the
    /// others are `Replicate`.
    Each,
    /// Linear in the first operand only (`div`): `Partial / Replicate` stays `Partial`.
    First,
}

/// The output dim of operand dim `d` of an operand of rank `r` broadcast to rank `out`.
fn out_dim(d: usize, r: usize, out: usize) -> usize {
    d + out - r
}

/// The operand's dim aligned with output dim `o`, if it has one of the output's size
/// (a dim of size 1 against a larger output dim is a broadcast: no dim).
fn aligned(t: &DTensor, o: usize, out_shape: &[usize]) -> Option<usize> {
    let (r, ro) = (t.shape().len(), out_shape.len());
    let d = (o + r).checked_sub(ro)?;
    (t.shape()[d] == out_shape[o]).then_some(d)
}

/// Runs an elementwise op over any number of broadcasting operands.
pub(crate) fn pointwise(
    op: &'static str,
    operands: &[Operand<'_>],
    lin: Linearity,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<DTensor> {
    let metas = operands.iter().map(|(_, t)| meta(t)).collect::<Result<Vec<_>>>()?;
    let out_shape = global_shape(op, operands, || f(&metas))?;
    let ro = out_shape.len();
    let shard_strategy = |o: usize| -> Strategy {
        let inputs = operands
            .iter()
            .map(|(_, t)| match aligned(t, o, &out_shape) {
                Some(d) => Shard(d as isize),
                None => Replicate,
            })
            .collect();
        Strategy::new(inputs, Shard(o as isize))
    };
    let (targets, out) = choose(op, operands, |m| {
        let mut c = Vec::new();
        for (i, (_, t)) in operands.iter().enumerate() {
            match t.placements()[m] {
                Shard(d) => {
                    let o = out_dim(d as usize, t.shape().len(), ro);
                    if aligned(t, o, &out_shape) == Some(d as usize) {
                        c.push(shard_strategy(o));
                    }
                }
                p if is_linear_partial(p) => {
                    let keep = |j: usize| match lin {
                        Linearity::None => None,
                        Linearity::All => Some(p),
                        Linearity::Each => Some(if j == i { p } else { Replicate }),
                        Linearity::First => Some(if j == 0 { p } else { Replicate }),
                    };
                    let all_partial = operands.iter().all(|(_, u)| u.placements()[m] == p);
                    let ok = match lin {
                        Linearity::None => false,
                        Linearity::All => all_partial,
                        Linearity::Each => true,
                        Linearity::First => i == 0,
                    };
                    if ok {
                        let inputs: Option<Vec<Placement>> =
                            (0..operands.len()).map(keep).collect();
                        if let Some(inputs) = inputs {
                            c.push(Strategy::new(inputs, p));
                        }
                    }
                }
                _ => {}
            }
        }
        c.push(Strategy::new(vec![Replicate; operands.len()], Replicate));
        c
    })?;
    let ins = prepare_all(op, operands, &targets)?;
    let locals: Vec<Tensor> = ins.iter().map(|t| t.to_local()).collect();
    let local = f(&locals)?;
    finish(local, operands[0].1.mesh(), &out, &out_shape)
}

/// A one-operand elementwise op: shards and `Replicate` pass; a `Partial` passes when the
/// op is linear (`linear`), else it is reduced to `Replicate` first.
fn unary(
    t: &DTensor,
    op: &'static str,
    linear: bool,
    f: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<DTensor> {
    let out_shape = global_shape(op, &[("input", t)], || f(&meta(t)?))?;
    let (target, out) = unary_rule(t, |p| match p {
        p if p.is_partial() && !(linear && is_linear_partial(p)) => (Replicate, Replicate),
        p => (p, p),
    });
    let x = prepare(op, "input", t, &target)?;
    finish(f(x.local())?, t.mesh(), &out, &out_shape)
}

macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $lin:expr;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&self, rhs: &DTensor) -> Result<DTensor> {
                pointwise(
                    stringify!($name),
                    &[("lhs", self), ("rhs", rhs)],
                    $lin,
                    |x| Ok(x[0].$name(&x[1])?),
                )
            }
        )*
    };
}

macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident => $linear:expr;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&self) -> Result<DTensor> {
                unary(self, stringify!($name), $linear, |x| Ok(x.$name()?))
            }
        )*
    };
}

/// Elementwise and broadcasting ops. No op here communicates unless an operand must be
/// redistributed first (see the rules in [`crate::ops`]); none communicates in backward
/// beyond those redistributions' adjoints.
impl DTensor {
    binary_ops! {
        /// `self + rhs` with broadcasting. Placements pass through (`S(d)` with `S(d)` or
        /// `Replicate`, sliced locally); `P + P` (same op) stays `P`; `P + R`, `P + S`
        /// reduce the partial first (implicit all_reduce / reduce_scatter).
        add => Linearity::All;
        /// `self - rhs` with broadcasting; rules as [`DTensor::add`].
        sub => Linearity::All;
        /// `self * rhs` with broadcasting. Shards and `Replicate` pass as in
        /// [`DTensor::add`]; `P * R` and `R * P` stay `P` (linear in the partial factor);
        /// `P * P` reduces one factor (the rhs, all things equal) first.
        mul => Linearity::Each;
        /// `self / rhs` with broadcasting. `P / R` stays `P`; a partial divisor is reduced
        /// first.
        div => Linearity::First;
        /// `self ^ rhs` with broadcasting. Not linear: partial operands are reduced first.
        pow => Linearity::None;
        /// `silu(self) * rhs` as one op (`Tensor::silu_mul`; equal global shapes, no
        /// broadcasting). Shards and `Replicate` pass as in [`DTensor::add`]; a partial
        /// operand is reduced first.
        silu_mul => Linearity::None;
    }

    unary_ops! {
        /// `-self`. Linear: every placement passes, `Partial` included.
        neg => true;
        /// `e^self`. Shards and `Replicate` pass; a `Partial` is reduced first (implicit).
        exp => false;
        /// Natural log; rules as [`DTensor::exp`].
        log => false;
        /// Square root; rules as [`DTensor::exp`].
        sqrt => false;
        /// `1 / sqrt(self)`; rules as [`DTensor::exp`].
        rsqrt => false;
        /// SiLU; rules as [`DTensor::exp`].
        silu => false;
        /// Logistic sigmoid; rules as [`DTensor::exp`].
        sigmoid => false;
        /// `self * self`; rules as [`DTensor::exp`].
        square => false;
        /// Absolute value; rules as [`DTensor::exp`].
        abs => false;
        /// `max(self, 0)`; rules as [`DTensor::exp`].
        relu => false;
        /// Hyperbolic tangent; rules as [`DTensor::exp`].
        tanh => false;
        /// `1 / self`; rules as [`DTensor::exp`].
        recip => false;
    }

    /// `self + s`. Not linear: a `Partial` is reduced first (adding `s` to every rank's
    /// term would add it once per rank); shards and `Replicate` pass.
    pub fn add_scalar(&self, s: f64) -> Result<DTensor> {
        unary(self, "add_scalar", false, |x| Ok(x.add_scalar(s)?))
    }

    /// `self - s`; rules as [`DTensor::add_scalar`].
    pub fn sub_scalar(&self, s: f64) -> Result<DTensor> {
        unary(self, "sub_scalar", false, |x| Ok(x.add_scalar(-s)?))
    }

    /// `s - self`; rules as [`DTensor::add_scalar`].
    pub fn rsub_scalar(&self, s: f64) -> Result<DTensor> {
        unary(self, "rsub_scalar", false, |x| Ok(x.rsub_scalar(s)?))
    }

    /// `self * s`. Linear: every placement passes, `Partial(sum)` stays `Partial(sum)`.
    pub fn mul_scalar(&self, s: f64) -> Result<DTensor> {
        unary(self, "mul_scalar", true, |x| Ok(x.mul_scalar(s)?))
    }

    /// `self / s`; rules as [`DTensor::mul_scalar`].
    pub fn div_scalar(&self, s: f64) -> Result<DTensor> {
        unary(self, "div_scalar", true, |x| Ok(x.div_scalar(s)?))
    }

    /// `self ^ p`; rules as [`DTensor::add_scalar`].
    pub fn pow_scalar(&self, p: f64) -> Result<DTensor> {
        unary(self, "pow_scalar", false, |x| Ok(x.pow_scalar(p)?))
    }

    /// Converts the element type. Linear: every placement passes.
    pub fn to_dtype(&self, dtype: DType) -> Result<DTensor> {
        unary(self, "to_dtype", true, |x| Ok(x.to_dtype(dtype)?))
    }

    /// Dropout (PyTorch's `F.dropout` on a DTensor): each rank applies to its shard the
    /// part of the whole tensor's mask at the shard's positions
    /// ([`Tensor::dropout_shard`]), so the result is the dropout of the full tensor that
    /// one rank would draw from the same generator state, whatever the placements. Every
    /// placement passes, `Partial` included (each term meets the same mask, and a mask
    /// commutes with every reduction), and nothing is communicated. The ranks must call it
    /// from one generator state ([`tpar_tensor::manual_seed`] with one seed, then the same
    /// random ops), as PyTorch's DTensor random ops require; every rank's offset moves by
    /// the full tensor's count.
    ///
    /// # Errors
    /// As [`Tensor::dropout`].
    pub fn dropout(&self, p: f64, training: bool) -> Result<DTensor> {
        let (_, offset) = self.spec().local_shape_and_offset()?;
        let local = self.local().dropout_shard(p, training, self.shape(), &offset)?;
        finish(local, self.mesh(), self.placements(), self.shape())
    }
}
