//! What each member says it is calling, and the check that all members agree.

use std::fmt;

use tpar_tensor::{DType, Device, Tensor};

use crate::{CollectiveError, CollectiveKind, ReduceOp};

/// A collective call and its parameters (dims are already normalised).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    AllReduce { op: ReduceOp },
    AllGather { dim: usize },
    ReduceScatter { dim: usize, op: ReduceOp },
    AllToAll { split_dim: usize, concat_dim: usize, sizes: Option<Vec<usize>> },
    Broadcast { src: usize },
    Barrier,
}

impl Call {
    pub fn kind(&self) -> CollectiveKind {
        match self {
            Call::AllReduce { .. } => CollectiveKind::AllReduce,
            Call::AllGather { .. } => CollectiveKind::AllGather,
            Call::ReduceScatter { .. } => CollectiveKind::ReduceScatter,
            Call::AllToAll { .. } => CollectiveKind::AllToAll,
            Call::Broadcast { .. } => CollectiveKind::Broadcast,
            Call::Barrier => CollectiveKind::Barrier,
        }
    }

    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    pub fn reduce_op(&self) -> Option<ReduceOp> {
        match self {
            Call::AllReduce { op } | Call::ReduceScatter { op, .. } => Some(*op),
            _ => None,
        }
    }

    /// Same collective with the same parameters, ignoring per-rank split sizes.
    fn same_call(&self, other: &Call) -> bool {
        match (self, other) {
            (
                Call::AllToAll { split_dim: a, concat_dim: b, sizes: sa },
                Call::AllToAll { split_dim: c, concat_dim: d, sizes: sb },
            ) => a == c && b == d && sa.is_some() == sb.is_some(),
            _ => self == other,
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Call::AllReduce { op } => write!(f, "all_reduce({op})"),
            Call::AllGather { dim } => write!(f, "all_gather(dim={dim})"),
            Call::ReduceScatter { dim, op } => write!(f, "reduce_scatter(dim={dim}, {op})"),
            Call::AllToAll { split_dim, concat_dim, sizes: None } => {
                write!(f, "all_to_all(split_dim={split_dim}, concat_dim={concat_dim})")
            }
            Call::AllToAll { split_dim, concat_dim, sizes: Some(s) } => write!(
                f,
                "all_to_all(split_dim={split_dim}, concat_dim={concat_dim}, split_sizes={s:?})"
            ),
            Call::Broadcast { src } => write!(f, "broadcast(src={src})"),
            Call::Barrier => f.write_str("barrier()"),
        }
    }
}

/// Where data lives, as far as agreement goes (CUDA ordinals differ per rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Cpu,
    Cuda,
    Meta,
}

impl Place {
    pub fn of(d: Device) -> Place {
        match d {
            Device::Cpu => Place::Cpu,
            Device::Cuda(_) => Place::Cuda,
            Device::Meta => Place::Meta,
        }
    }
}

/// One member's description of its call.
#[derive(Clone, Debug)]
pub(crate) struct Desc {
    pub call: Call,
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub place: Place,
}

impl Desc {
    pub fn new(call: Call, t: Option<&Tensor>) -> Desc {
        match t {
            Some(t) => Desc {
                call,
                dtype: t.dtype(),
                dims: t.dims().to_vec(),
                place: Place::of(t.device()),
            },
            None => Desc { call, dtype: DType::F32, dims: Vec::new(), place: Place::Cpu },
        }
    }

    /// Whether two members' calls fit together.
    fn compatible(&self, o: &Desc) -> bool {
        if !self.call.same_call(&o.call) {
            return false;
        }
        if matches!(self.call, Call::Barrier | Call::Broadcast { .. }) {
            // Only the source's tensor matters.
            return true;
        }
        // Host and CUDA members mix (each gets its result on its own device); meta
        // tensors only meet meta tensors.
        let meta = |p: Place| p == Place::Meta;
        if meta(self.place) != meta(o.place)
            || self.dtype != o.dtype
            || self.dims.len() != o.dims.len()
        {
            return false;
        }
        let all_but = |skip: usize| {
            self.dims.iter().zip(&o.dims).enumerate().all(|(i, (a, b))| i == skip || a == b)
        };
        match &self.call {
            Call::AllReduce { .. } | Call::ReduceScatter { .. } => self.dims == o.dims,
            Call::AllGather { dim } => all_but(*dim),
            Call::AllToAll { split_dim, concat_dim, sizes } => {
                let sizes_ok = split_dim == concat_dim
                    || match (sizes, &o.call) {
                        (Some(a), Call::AllToAll { sizes: Some(b), .. }) => a == b,
                        _ => true,
                    };
                all_but(*concat_dim) && sizes_ok
            }
            Call::Broadcast { .. } | Call::Barrier => true,
        }
    }
}

impl fmt::Display for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.call {
            Call::Barrier | Call::Broadcast { .. } => write!(f, "{}", self.call),
            _ => {
                let place = match self.place {
                    Place::Cpu => "cpu",
                    Place::Cuda => "cuda",
                    Place::Meta => "meta",
                };
                write!(f, "{} of {} {:?} on {place}", self.call, self.dtype, self.dims)
            }
        }
    }
}

/// `(outer, inner)` element counts around `dim` of a tensor of shape `dims`.
pub(crate) fn around(dims: &[usize], dim: usize) -> (usize, usize) {
    (dims[..dim].iter().product(), dims[dim + 1..].iter().product())
}

/// Checks that all members' calls agree. On disagreement the majority's call is taken as
/// the expected one and the first member outside it is named (as a global rank).
pub(crate) fn validate(group: &[usize], descs: &[&Desc]) -> Result<(), CollectiveError> {
    let Some(first) = descs.first() else { return Ok(()) };
    if descs.iter().all(|d| first.compatible(d)) {
        return Ok(());
    }
    // Classes of mutually compatible members; the largest (earliest on ties) is "expected".
    let mut classes: Vec<Vec<usize>> = Vec::new();
    for (i, d) in descs.iter().enumerate() {
        match classes.iter_mut().find(|c| descs[c[0]].compatible(d)) {
            Some(c) => c.push(i),
            None => classes.push(vec![i]),
        }
    }
    let best = classes
        .iter()
        .enumerate()
        .max_by_key(|(k, c)| (c.len(), std::cmp::Reverse(*k)))
        .map_or(0, |(k, _)| k);
    let expected = descs[classes[best][0]];
    let culprit = (0..descs.len()).find(|i| !classes[best].contains(i)).unwrap_or(0);
    Err(CollectiveError::Mismatch {
        op: expected.call.name(),
        group: group.to_vec(),
        rank: group.get(culprit).copied().unwrap_or(culprit),
        expected: expected.to_string(),
        got: descs[culprit].to_string(),
    })
}
