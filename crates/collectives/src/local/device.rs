//! The local backend's collectives on CUDA tensors, device to device.
//!
//! A member whose own tensor lives on `cuda:o` builds its output on `cuda:o`
//! straight from the peers' posted device buffers, as the host path does from
//! host slices: pitched device copies for `all_gather`, `all_to_all` and
//! `broadcast` (peer copies from other GPUs), and one reduction kernel over
//! every member's block for `all_reduce` and `reduce_scatter`, which folds the
//! terms in member order exactly as the host kernels do (bf16/f16 accumulate
//! in f32), so every member gets bit-identical results, equal to the host
//! collectives'. Nothing goes through the host: a peer's tensor that lives
//! on the host (a mixed collective) is uploaded, which is the only copy
//! that must cross.

use tpar_tensor::gpu::{self, Block, FoldOp, Piece};
use tpar_tensor::{Device, Tensor};

use super::desc::{Call, Desc};
use super::{a2a_pieces, internal};
use crate::local::desc::around;
use crate::{chunk_range, CollectiveError, ReduceOp, Result};

fn fold(op: ReduceOp) -> FoldOp {
    match op {
        ReduceOp::Sum => FoldOp::Sum,
        ReduceOp::Avg => FoldOp::Avg,
        ReduceOp::Max => FoldOp::Max,
        ReduceOp::Min => FoldOp::Min,
        ReduceOp::Product => FoldOp::Product,
    }
}

fn device_err(op: &'static str, e: tpar_tensor::TensorError) -> CollectiveError {
    CollectiveError::InvalidArgument { op, why: format!("on the device: {e}") }
}

/// Member `me`'s output of `call` on `cuda:ordinal`, from every member's
/// (non-meta) tensor in member order.
pub(super) fn compute(
    call: &Call,
    tensors: &[Tensor],
    descs: &[Desc],
    me: usize,
    ordinal: usize,
) -> Result<Option<Tensor>> {
    let op = call.name();
    let n = tensors.len();
    let here = Device::Cuda(ordinal);
    // Host tensors of peers (a mixed collective) are uploaded: the one copy
    // that must cross. CUDA tensors are read where they are.
    let srcs: Vec<Tensor> = tensors
        .iter()
        .map(|t| match t.device() {
            Device::Cuda(_) => Ok(t.clone()),
            _ => t.detach().to_device(here),
        })
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| device_err(op, e))?;
    let dims = &descs[me].dims;
    let dtype = descs[me].dtype;
    let out = match call {
        Call::Barrier => return Ok(None),
        Call::AllReduce { op: rop } => {
            let refs: Vec<&Tensor> = srcs.iter().collect();
            let numel = dims.iter().product();
            gpu::reduce(ordinal, dims, &refs, Block::flat(0, numel), fold(*rop))
        }
        Call::ReduceScatter { dim, op: rop } => {
            let refs: Vec<&Tensor> = srcs.iter().collect();
            let size = dims[*dim];
            let (start, len) = chunk_range(size, n, me);
            let (outer, inner) = around(dims, *dim);
            let block =
                Block { offset: start * inner, rows: outer, cols: len * inner, ld: size * inner };
            let mut out_dims = dims.clone();
            out_dims[*dim] = len;
            gpu::reduce(ordinal, &out_dims, &refs, block, fold(*rop))
        }
        Call::AllGather { dim } => {
            let (outer, inner) = around(dims, *dim);
            let total: usize = descs.iter().map(|d| d.dims[*dim]).sum();
            let mut out_dims = dims.clone();
            out_dims[*dim] = total;
            let mut at = 0;
            let pieces: Vec<Piece> = srcs
                .iter()
                .zip(descs)
                .map(|(t, d)| {
                    let cols = d.dims[*dim] * inner;
                    let p = Piece {
                        src: t,
                        from: Block { offset: 0, rows: outer, cols, ld: cols },
                        to_offset: at,
                        to_ld: total * inner,
                    };
                    at += cols;
                    p
                })
                .collect();
            gpu::assemble(ordinal, &out_dims, dtype, &pieces)
        }
        Call::AllToAll { split_dim, concat_dim, .. } => {
            return all_to_all(&srcs, descs, *split_dim, *concat_dim, me, ordinal);
        }
        Call::Broadcast { src } => {
            let (Some(t), Some(d)) = (srcs.get(*src), descs.get(*src)) else {
                return Err(internal(op, "broadcast source out of range"));
            };
            let numel = d.dims.iter().product();
            let piece = Piece { src: t, from: Block::flat(0, numel), to_offset: 0, to_ld: numel };
            gpu::assemble(ordinal, &d.dims, d.dtype, &[piece])
        }
    };
    out.map(Some).map_err(|e| device_err(op, e))
}

/// `all_to_all` on the device: piece `me` of every member's tensor (a chunk
/// along `split_dim`), concatenated along `concat_dim`.
fn all_to_all(
    srcs: &[Tensor],
    descs: &[Desc],
    split_dim: usize,
    concat_dim: usize,
    me: usize,
    ordinal: usize,
) -> Result<Option<Tensor>> {
    let op = "all_to_all";
    let n = srcs.len();
    let pieces = a2a_pieces(descs, split_dim, me, n)?;
    let Some(p0) = pieces.first() else { return Err(internal(op, "no members")) };
    let (outer_c, inner_c) = around(&p0.0, concat_dim);
    let total_c: usize = pieces.iter().map(|p| p.0[concat_dim]).sum();
    let mut out_dims = p0.0.clone();
    out_dims[concat_dim] = total_c;
    let dtype = descs[me].dtype;
    // Each piece as a contiguous buffer: a view of the source when the chunk
    // is contiguous in it, else a compacted device copy.
    let mut compact: Vec<Option<Tensor>> = Vec::with_capacity(n);
    let mut offsets = Vec::with_capacity(n);
    for ((pd, v), t) in pieces.iter().zip(srcs) {
        let (outer_s, _) = around(&descs[offsets.len()].dims, split_dim);
        if outer_s <= 1 || v.len == v.n {
            compact.push(None);
            offsets.push(v.start * v.inner);
        } else {
            let cols = v.len * v.inner;
            let from = Block { offset: v.start * v.inner, rows: outer_s, cols, ld: v.n * v.inner };
            let piece = Piece { src: t, from, to_offset: 0, to_ld: cols };
            let c = gpu::assemble(ordinal, pd, dtype, &[piece]).map_err(|e| device_err(op, e))?;
            compact.push(Some(c));
            offsets.push(0);
        }
    }
    let mut at = 0;
    let mut parts = Vec::with_capacity(n);
    for (((pd, _), t), (c, &offset)) in pieces.iter().zip(srcs).zip(compact.iter().zip(&offsets)) {
        let cols = pd[concat_dim] * inner_c;
        parts.push(Piece {
            src: c.as_ref().unwrap_or(t),
            from: Block { offset, rows: outer_c, cols, ld: cols },
            to_offset: at,
            to_ld: total_c * inner_c,
        });
        at += cols;
    }
    gpu::assemble(ordinal, &out_dims, dtype, &parts).map(Some).map_err(|e| device_err(op, e))
}
