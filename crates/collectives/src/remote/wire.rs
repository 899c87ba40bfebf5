//! The fixed-size header every member exchanges before a collective's data (and every
//! sender puts before a point-to-point payload).
//!
//! NCCL matches calls by position and hangs, or corrupts memory, when members disagree on
//! counts or types. So each collective starts with an `all_gather` of a header of
//! [`HEADER_LEN`] `i64`s, the same count on every member whatever it called, which says
//! what the member called (collective, parameters, dtype, shape, sequence number, whether
//! its arguments were valid). Every member then checks the same headers with the local
//! backend's rules ([`validate`](crate::local::desc::validate)) and either all run the data
//! step or all fail with the same `Mismatch`/`InvalidArgument`. The headers also carry the
//! uneven sizes (`torch.chunk` shards, a broadcast's source shape, a `recv`'s payload
//! shape) that NCCL's equal-count primitives need to know up front.

use tpar_tensor::DType;

use crate::local::desc::{Call, Desc, Place};
use crate::ReduceOp;

/// Dims a header can carry (tensor rank).
pub(crate) const MAX_DIMS: usize = 21;
/// `i64`s per header.
pub(crate) const HEADER_LEN: usize = 11 + MAX_DIMS;
/// Marks a tpar header, version 1 (`"tpar"` and 1).
const MAGIC: i64 = 0x7470_6172_0001;

const KIND_ALL_REDUCE: i64 = 1;
const KIND_ALL_GATHER: i64 = 2;
const KIND_REDUCE_SCATTER: i64 = 3;
const KIND_ALL_TO_ALL: i64 = 4;
const KIND_BROADCAST: i64 = 5;
const KIND_BARRIER: i64 = 6;
const KIND_SEND: i64 = 7;

/// What a header says (decoded); `call` is `None` for a point-to-point payload header.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    /// The member's sequence number of this call on the group.
    pub seq: u64,
    /// The member's description of its call (sizes of a sized `all_to_all` left empty).
    pub desc: Desc,
    /// Whether it is a point-to-point payload header rather than a collective.
    pub p2p: bool,
    /// Whether `all_to_all` split sizes follow in a second exchange.
    pub has_sizes: bool,
    /// Whether the member found its own arguments invalid.
    pub problem: bool,
}

fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        DType::I64 => 4,
    }
}

fn dtype_of(c: i64) -> Option<DType> {
    Some(match c {
        0 => DType::F32,
        1 => DType::F64,
        2 => DType::BF16,
        3 => DType::F16,
        4 => DType::I64,
        _ => return None,
    })
}

fn op_code(op: ReduceOp) -> i64 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Avg => 2,
        ReduceOp::Max => 3,
        ReduceOp::Min => 4,
        ReduceOp::Product => 5,
    }
}

fn op_of(c: i64) -> Option<ReduceOp> {
    Some(match c {
        1 => ReduceOp::Sum,
        2 => ReduceOp::Avg,
        3 => ReduceOp::Max,
        4 => ReduceOp::Min,
        5 => ReduceOp::Product,
        _ => return None,
    })
}

fn place_code(p: Place) -> i64 {
    match p {
        Place::Cpu => 0,
        Place::Cuda => 1,
        Place::Meta => 2,
    }
}

fn place_of(c: i64) -> Option<Place> {
    Some(match c {
        0 => Place::Cpu,
        1 => Place::Cuda,
        2 => Place::Meta,
        _ => return None,
    })
}

/// Encodes a collective's header (`p2p = false`) or a payload header (`p2p = true`, the
/// call is ignored). Dims beyond [`MAX_DIMS`] make `problem` true (the caller reports why).
pub(crate) fn encode(seq: u64, desc: &Desc, p2p: bool, problem: bool) -> [i64; HEADER_LEN] {
    let mut h = [0i64; HEADER_LEN];
    h[0] = MAGIC;
    h[1] = seq as i64;
    let (kind, op, a, b, sizes) = if p2p {
        (KIND_SEND, 0, 0, 0, false)
    } else {
        match &desc.call {
            Call::AllReduce { op } => (KIND_ALL_REDUCE, op_code(*op), 0, 0, false),
            Call::AllGather { dim } => (KIND_ALL_GATHER, 0, *dim as i64, 0, false),
            Call::ReduceScatter { dim, op } => {
                (KIND_REDUCE_SCATTER, op_code(*op), *dim as i64, 0, false)
            }
            Call::AllToAll { split_dim, concat_dim, sizes } => {
                (KIND_ALL_TO_ALL, 0, *split_dim as i64, *concat_dim as i64, sizes.is_some())
            }
            Call::Broadcast { src } => (KIND_BROADCAST, 0, *src as i64, 0, false),
            Call::Barrier => (KIND_BARRIER, 0, 0, 0, false),
        }
    };
    h[2] = kind;
    h[3] = op;
    h[4] = a;
    h[5] = b;
    h[6] = i64::from(sizes);
    h[7] = dtype_code(desc.dtype);
    h[8] = place_code(desc.place);
    let too_many = desc.dims.len() > MAX_DIMS;
    h[9] = i64::from(problem || too_many);
    h[10] = desc.dims.len().min(MAX_DIMS) as i64;
    for (slot, &d) in h[11..].iter_mut().zip(&desc.dims) {
        *slot = d as i64;
    }
    h
}

/// Decodes one header; `Err` says what is malformed.
pub(crate) fn decode(h: &[i64]) -> Result<Header, String> {
    if h.len() != HEADER_LEN {
        return Err(format!("header of {} values, expected {HEADER_LEN}", h.len()));
    }
    if h[0] != MAGIC {
        return Err(format!("bad header magic {:#x}", h[0]));
    }
    let usize_at = |i: usize| -> Result<usize, String> {
        usize::try_from(h[i]).map_err(|_| format!("negative header field {i}: {}", h[i]))
    };
    let op = || op_of(h[3]).ok_or_else(|| format!("bad reduce op code {}", h[3]));
    let has_sizes = h[6] != 0;
    let (call, p2p) = match h[2] {
        KIND_ALL_REDUCE => (Call::AllReduce { op: op()? }, false),
        KIND_ALL_GATHER => (Call::AllGather { dim: usize_at(4)? }, false),
        KIND_REDUCE_SCATTER => (Call::ReduceScatter { dim: usize_at(4)?, op: op()? }, false),
        KIND_ALL_TO_ALL => (
            Call::AllToAll {
                split_dim: usize_at(4)?,
                concat_dim: usize_at(5)?,
                sizes: has_sizes.then(Vec::new),
            },
            false,
        ),
        KIND_BROADCAST => (Call::Broadcast { src: usize_at(4)? }, false),
        KIND_BARRIER => (Call::Barrier, false),
        KIND_SEND => (Call::Barrier, true),
        k => return Err(format!("bad collective code {k}")),
    };
    let dtype = dtype_of(h[7]).ok_or_else(|| format!("bad dtype code {}", h[7]))?;
    let place = place_of(h[8]).ok_or_else(|| format!("bad device code {}", h[8]))?;
    let ndims = usize_at(10)?;
    if ndims > MAX_DIMS {
        return Err(format!("{ndims} dims in a header (at most {MAX_DIMS})"));
    }
    let dims = (0..ndims).map(|i| usize_at(11 + i)).collect::<Result<Vec<_>, _>>()?;
    Ok(Header {
        seq: h[1] as u64,
        desc: Desc { call, dtype, dims, place },
        p2p,
        has_sizes,
        problem: h[9] != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let calls = [
            Call::AllReduce { op: ReduceOp::Avg },
            Call::AllGather { dim: 2 },
            Call::ReduceScatter { dim: 1, op: ReduceOp::Product },
            Call::AllToAll { split_dim: 0, concat_dim: 1, sizes: None },
            Call::AllToAll { split_dim: 1, concat_dim: 1, sizes: Some(vec![]) },
            Call::Broadcast { src: 3 },
            Call::Barrier,
        ];
        for (i, call) in calls.into_iter().enumerate() {
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64] {
                let desc =
                    Desc { call: call.clone(), dtype, dims: vec![3, 0, 7], place: Place::Cpu };
                let h = decode(&encode(i as u64 + 9, &desc, false, i == 2)).unwrap();
                assert_eq!(h.seq, i as u64 + 9);
                assert_eq!(h.desc.call, call);
                assert_eq!(h.desc.dtype, dtype);
                assert_eq!(h.desc.dims, vec![3, 0, 7]);
                assert_eq!(h.problem, i == 2);
                assert!(!h.p2p);
            }
        }
        let desc =
            Desc { call: Call::Barrier, dtype: DType::I64, dims: vec![], place: Place::Meta };
        let h = decode(&encode(0, &desc, true, false)).unwrap();
        assert!(h.p2p);
        assert_eq!(h.desc.place, Place::Meta);
    }

    #[test]
    fn too_many_dims_is_a_problem_and_garbage_is_rejected() {
        let desc = Desc {
            call: Call::AllReduce { op: ReduceOp::Sum },
            dtype: DType::F32,
            dims: vec![1; MAX_DIMS + 1],
            place: Place::Cpu,
        };
        assert!(decode(&encode(0, &desc, false, false)).unwrap().problem);
        assert!(decode(&[0; HEADER_LEN]).unwrap_err().contains("magic"));
        assert!(decode(&[MAGIC; 3]).is_err());
        let mut h = encode(0, &desc, false, false);
        h[7] = 99;
        assert!(decode(&h).unwrap_err().contains("dtype"));
    }
}
