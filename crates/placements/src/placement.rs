//! [`Placement`], [`ReduceOp`], and their short text form.

use std::fmt;
use std::str::FromStr;

use crate::error::{PlacementError, Result};

/// How terms combine into one value: the operator of a collective (`all_reduce`,
/// `reduce_scatter`, as `torch.distributed.ReduceOp`) and of a [`Placement::Partial`]
/// tensor (whose value is the reduction of the ranks' terms). The one reduction
/// vocabulary of the workspace; the collectives, DTensor and facade crates re-export it.
///
/// Collectives take every operator. A `Partial` placement takes the four of
/// [`ReduceOp::PARTIAL`], as PyTorch's `Partial` does; `Partial(product)` is refused
/// by [`Placement::normalize`] with [`PlacementError::UnsupportedPartial`].
///
/// Floating-point collective reductions of bf16/f16 accumulate in f32 (f64 in f64) and
/// round once at the end; terms combine in group-rank order, so every member gets
/// bit-identical results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    /// The elementwise sum of the terms.
    Sum,
    /// The elementwise mean of the terms (float dtypes only in collectives).
    Avg,
    /// The elementwise maximum of the terms (NaN propagates).
    Max,
    /// The elementwise minimum of the terms (NaN propagates).
    Min,
    /// The elementwise product of the terms (collectives only).
    Product,
}

impl ReduceOp {
    /// The four operators a `Partial` placement supports, in declaration order.
    pub const PARTIAL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

    /// Every operator, in declaration order (what collectives accept).
    pub const ALL: [ReduceOp; 5] =
        [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product];

    /// Short lowercase name: `sum`, `avg`, `max`, `min`, `product`.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
        }
    }

    /// Whether reducing over two mesh dims with `self` and `other` gives the
    /// same value in either order: true for any pair of linear ops
    /// (`sum`, `avg`), and for `max`/`max` and `min`/`min`.
    ///
    /// A placement list whose `Partial` ops do not pairwise commute has no
    /// order-independent value; see the crate docs.
    pub fn commutes_with(self, other: ReduceOp) -> bool {
        let linear = |op| matches!(op, ReduceOp::Sum | ReduceOp::Avg);
        (linear(self) && linear(other)) || self == other
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = PlacementError;

    /// Parses `sum`, `avg` (or `mean`), `max`, `min` or `product` (or `prod`), case-insensitive.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "product" | "prod" => Ok(ReduceOp::Product),
            _ => Err(PlacementError::Parse {
                input: s.to_string(),
                reason: "expected one of sum, avg, max, min, product".to_string(),
            }),
        }
    }
}

/// How a tensor lies along one mesh dim, as in PyTorch's DTensor.
///
/// * `Shard(d)`: tensor dim `d` is split with `torch.chunk` semantics (see
///   [`chunk_range`](crate::chunk_range)); a negative `d` counts from the end
///   and is resolved by [`Placement::normalize`].
/// * `Replicate`: every rank along the mesh dim holds the same data.
/// * `Partial(op)`: every rank holds a term of the same shape; the value is
///   the `op`-reduction of the terms over the mesh dim.
///
/// Prints short: `S(0)`, `S(-1)`, `R`, `P(sum)` (both `Display` and `Debug`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split tensor dim `d` over the mesh dim.
    Shard(isize),
    /// Full copy on every rank of the mesh dim.
    Replicate,
    /// A term per rank; the value is their reduction.
    Partial(ReduceOp),
}

impl Placement {
    /// `Partial(Sum)`, the most common partial placement.
    pub const PARTIAL_SUM: Placement = Placement::Partial(ReduceOp::Sum);

    /// True for `Shard(_)`.
    pub fn is_shard(self) -> bool {
        matches!(self, Placement::Shard(_))
    }

    /// True for `Shard(dim)` (compared as given: normalise first).
    pub fn is_shard_dim(self, dim: isize) -> bool {
        self == Placement::Shard(dim)
    }

    /// The sharded tensor dim, if this is a `Shard`.
    pub fn shard_dim(self) -> Option<isize> {
        match self {
            Placement::Shard(d) => Some(d),
            _ => None,
        }
    }

    /// True for `Replicate`.
    pub fn is_replicate(self) -> bool {
        self == Placement::Replicate
    }

    /// True for `Partial(_)`.
    pub fn is_partial(self) -> bool {
        matches!(self, Placement::Partial(_))
    }

    /// The reduce op, if this is a `Partial`.
    pub fn partial_op(self) -> Option<ReduceOp> {
        match self {
            Placement::Partial(op) => Some(op),
            _ => None,
        }
    }

    /// Resolves a negative shard dim against the tensor rank
    /// (`S(-1)` on a rank-3 tensor becomes `S(2)`) and checks the range.
    /// `Replicate` and `Partial` are returned unchanged.
    ///
    /// # Errors
    /// [`PlacementError::DimOutOfRange`] when the dim is outside `-rank..rank`;
    /// [`PlacementError::UnsupportedPartial`] for `Partial(product)`.
    ///
    /// ```
    /// use tpar_placements::Placement;
    /// assert_eq!(Placement::Shard(-1).normalize(3).unwrap(), Placement::Shard(2));
    /// let err = Placement::Shard(3).normalize(2).unwrap_err();
    /// assert_eq!(err.to_string(), "placement S(3): tensor dim 3 out of range for a rank-2 tensor");
    /// ```
    pub fn normalize(self, rank: usize) -> Result<Placement> {
        match self {
            Placement::Shard(d) => {
                let r = rank as isize;
                let n = if d < 0 { d + r } else { d };
                if (0..r).contains(&n) {
                    Ok(Placement::Shard(n))
                } else {
                    Err(PlacementError::DimOutOfRange {
                        context: format!("placement {self}"),
                        dim: d,
                        rank,
                        shape: None,
                    })
                }
            }
            Placement::Partial(op) if !ReduceOp::PARTIAL.contains(&op) => {
                Err(PlacementError::UnsupportedPartial { context: format!("placement {self}"), op })
            }
            other => Ok(other),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "S({d})"),
            Placement::Replicate => f.write_str("R"),
            Placement::Partial(op) => write!(f, "P({op})"),
        }
    }
}

impl fmt::Debug for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Placement {
    type Err = PlacementError;

    /// Parses one placement: `S(0)`, `S(-1)`, `R`, `P(sum)`.
    fn from_str(s: &str) -> Result<Self> {
        let list = parse_placements(s)?;
        match list.as_slice() {
            [p] => Ok(*p),
            _ => Err(PlacementError::Parse {
                input: s.to_string(),
                reason: format!("expected one placement, found {}", list.len()),
            }),
        }
    }
}

/// Normalises every placement of a list against the tensor rank
/// (see [`Placement::normalize`]).
///
/// # Errors
/// [`PlacementError::DimOutOfRange`] naming the list, the dim and the rank.
pub fn normalize_placements(placements: &[Placement], rank: usize) -> Result<Vec<Placement>> {
    placements
        .iter()
        .map(|p| p.normalize(rank))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| e.with_context(&format!("placements {}", fmt_placements(placements)), None))
}

/// Formats a placement list compactly, one entry per mesh dim with no
/// separator: `S(0)R`, `RS(1)`, `P(sum)R`. An empty list prints as `()`.
///
/// ```
/// use tpar_placements::{fmt_placements, Placement::*, ReduceOp};
/// assert_eq!(fmt_placements(&[Shard(0), Replicate]), "S(0)R");
/// assert_eq!(fmt_placements(&[Partial(ReduceOp::Sum), Shard(-1)]), "P(sum)S(-1)");
/// ```
pub fn fmt_placements(placements: &[Placement]) -> String {
    if placements.is_empty() {
        return "()".to_string();
    }
    placements.iter().map(|p| p.to_string()).collect()
}

/// Parses the compact form written by [`fmt_placements`] (`S(0)R`,
/// `P(sum)S(-1)`); whitespace and commas between entries are allowed, and
/// `()` is the empty list.
///
/// # Errors
/// [`PlacementError::Parse`] naming the input and what was expected.
///
/// ```
/// use tpar_placements::{parse_placements, Placement::*};
/// assert_eq!(parse_placements("S(0)R").unwrap(), vec![Shard(0), Replicate]);
/// assert_eq!(parse_placements("R, S(-1)").unwrap(), vec![Replicate, Shard(-1)]);
/// ```
pub fn parse_placements(s: &str) -> Result<Vec<Placement>> {
    let err = |reason: String| PlacementError::Parse { input: s.to_string(), reason };
    let mut out = Vec::new();
    let mut rest = s.trim();
    if rest == "()" {
        return Ok(out);
    }
    while !rest.is_empty() {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
        if rest.is_empty() {
            break;
        }
        let head = rest.chars().next().unwrap_or_default();
        match head {
            'R' | 'r' => {
                out.push(Placement::Replicate);
                rest = &rest[1..];
            }
            'S' | 's' | 'P' | 'p' => {
                let body = rest[1..]
                    .strip_prefix('(')
                    .ok_or_else(|| err(format!("expected '(' after '{head}'")))?;
                let close = body.find(')').ok_or_else(|| err("missing ')'".to_string()))?;
                let arg = &body[..close];
                out.push(if head.eq_ignore_ascii_case(&'S') {
                    let d = arg
                        .trim()
                        .parse::<isize>()
                        .map_err(|_| err(format!("bad shard dim {arg:?}")))?;
                    Placement::Shard(d)
                } else {
                    let op: ReduceOp =
                        arg.parse().map_err(|_| err(format!("bad reduce op {arg:?}")))?;
                    if !ReduceOp::PARTIAL.contains(&op) {
                        return Err(err(format!("Partial takes sum, avg, max or min, not {op}")));
                    }
                    Placement::Partial(op)
                });
                rest = &body[close + 1..];
            }
            other => return Err(err(format!("unexpected {other:?}; expected S(d), R or P(op)"))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Placement::*;

    #[test]
    fn display_and_debug_are_short() {
        assert_eq!(Shard(0).to_string(), "S(0)");
        assert_eq!(format!("{:?}", Shard(-1)), "S(-1)");
        assert_eq!(Replicate.to_string(), "R");
        assert_eq!(format!("{:?}", Partial(ReduceOp::Sum)), "P(sum)");
        assert_eq!(format!("{:?}", vec![Shard(1), Replicate]), "[S(1), R]");
        assert_eq!(fmt_placements(&[Partial(ReduceOp::Sum), Replicate]), "P(sum)R");
        assert_eq!(fmt_placements(&[Replicate, Shard(1)]), "RS(1)");
        assert_eq!(fmt_placements(&[]), "()");
    }

    #[test]
    fn normalize_resolves_negative_dims() {
        assert_eq!(Shard(-1).normalize(2).unwrap(), Shard(1));
        assert_eq!(Shard(-2).normalize(2).unwrap(), Shard(0));
        assert_eq!(Shard(1).normalize(2).unwrap(), Shard(1));
        assert_eq!(Replicate.normalize(0).unwrap(), Replicate);
        assert!(Shard(-3).normalize(2).is_err());
        assert!(Shard(2).normalize(2).is_err());
        assert!(Shard(0).normalize(0).is_err());
        let e = normalize_placements(&[Replicate, Shard(-3)], 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "placements RS(-3): tensor dim -3 out of range for a rank-2 tensor"
        );
    }

    #[test]
    fn parse_round_trips() {
        for s in ["S(0)R", "RS(1)", "P(sum)R", "S(-1)P(avg)P(max)P(min)", "()"] {
            assert_eq!(fmt_placements(&parse_placements(s).unwrap()), s);
        }
        assert_eq!("P(max)".parse::<Placement>().unwrap(), Partial(ReduceOp::Max));
        assert!(parse_placements("S(x)").is_err());
        assert!(parse_placements("Q").is_err());
        assert!(parse_placements("P(prod)").is_err());
        assert!(parse_placements("S(0").is_err());
        assert!("S(0)R".parse::<Placement>().is_err());
    }

    #[test]
    fn commuting_ops() {
        assert!(ReduceOp::Sum.commutes_with(ReduceOp::Avg));
        let err = Placement::Partial(ReduceOp::Product).normalize(2).unwrap_err();
        assert!(matches!(err, PlacementError::UnsupportedPartial { op: ReduceOp::Product, .. }));
        assert_eq!("product".parse::<ReduceOp>().unwrap(), ReduceOp::Product);
        for op in ReduceOp::PARTIAL {
            assert_eq!(Placement::Partial(op).normalize(2).unwrap(), Placement::Partial(op));
        }
        assert!(ReduceOp::Max.commutes_with(ReduceOp::Max));
        assert!(!ReduceOp::Max.commutes_with(ReduceOp::Min));
        assert!(!ReduceOp::Sum.commutes_with(ReduceOp::Max));
    }
}
