//! The `embedding` family of checks.

use tpar_kernels::cuda::raw::embedding;
use tpar_kernels::cuda::{CudaDType, DeviceBuffer};

use CudaDType::{BF16, F16, F32};

use super::{bound, Ctx};
use crate::data::dn;
use crate::Res;

pub(crate) fn check_embedding(c: &mut Ctx) {
    // (dtype, vocab, dim, ids, vocab_start, masked)
    let cases: &[(CudaDType, usize, usize, usize, i64, bool)] = if c.quick {
        &[
            (F32, 50, 72, 40, 0, false),
            (BF16, 30, 64, 40, 10, true),
            (F16, 50, 13, 33, 0, false),
            // The byte vocabulary over three sort tiles: two radix passes.
            (BF16, 259, 64, 4100, 0, false),
        ]
    } else {
        &[
            (BF16, 32000, 4096, 8192, 0, false),
            (F32, 64128, 1024, 4096, 64128, true),
            (F16, 32000, 4096, 8192, 0, false),
        ]
    };
    for &(dt, vocab, dim, n, start, masked) in cases {
        embedding_case(c, dt, vocab, dim, n, start, masked);
    }
}

pub(crate) fn embedding_case(
    c: &mut Ctx,
    dt: CudaDType,
    vocab: usize,
    dim: usize,
    n: usize,
    start: i64,
    masked: bool,
) {
    let shape = format!(
        "v{vocab} d{dim} n{n}{}",
        if masked { format!(" @{start} masked") } else { "".into() }
    );
    c.guard("embedding", dn(dt), &shape, |c| {
        use tpar_kernels::embedding as cpu;
        let d = c.d;
        let l = d.l();
        let b = bound(dt);
        let w = c.rng.vals(dt, vocab * dim, -1.0, 1.0);
        let mut ids: Vec<i64> = (0..n)
            .map(|_| {
                if masked {
                    c.rng.below(start as usize + vocab + 7) as i64
                } else {
                    start + c.rng.below(vocab) as i64
                }
            })
            .collect();
        for i in (0..n).step_by(5) {
            ids[i] = ids[0];
        }
        let dout = c.rng.vals(dt, n * dim, -1.0, 1.0);
        let mut out = vec![0.0; n * dim];
        cpu::embedding_forward::<f64, _>(&w, vocab, dim, &ids, start, masked, &mut out)?;
        let mut dw = vec![0.0; vocab * dim];
        cpu::embedding_backward::<f64>(&ids, start, masked, &dout, vocab, dim, &mut dw)?;
        let csr = embedding::EmbeddingCsr::build(&ids, start, vocab, masked)?;
        let es = dt.size();
        let (bw, bids, bdout) = (d.up(dt, &w)?, d.up_raw(&ids)?, d.up(dt, &dout)?);
        let (bout, berr) = (d.junk(out.len() * es)?, d.up_raw(&[embedding::NO_ERROR])?);
        let (brs, bpos) = (d.up_raw(&csr.row_start)?, d.up_raw(&csr.positions)?);
        let (bdw_csr, bdw_atomic) = (d.junk(dw.len() * es)?, d.junk(dw.len() * es)?);
        let bdw_sorted = d.junk(dw.len() * es)?;
        let scratch = d.junk(embedding::sorted_scratch_bytes(n, vocab))?;
        let acc = if dt == F32 { None } else { Some(d.junk(dw.len() * 4)?) };
        let acc_ptr = acc.as_ref().map_or(bdw_atomic.ptr(), DeviceBuffer::ptr);
        // SAFETY: every buffer was allocated above with the size the op needs;
        // the CSR was built for these ids and this table slice.
        unsafe {
            embedding::embedding_forward(
                l,
                dt,
                bw.ptr(),
                vocab,
                dim,
                bids.ptr(),
                n,
                start,
                masked,
                bout.ptr(),
                berr.ptr(),
            )?;
            embedding::embedding_backward_csr(
                l,
                dt,
                brs.ptr(),
                bpos.ptr(),
                csr.positions.len(),
                bdout.ptr(),
                n,
                vocab,
                dim,
                bdw_csr.ptr(),
            )?;
            embedding::embedding_backward_atomic(
                l,
                dt,
                bids.ptr(),
                n,
                start,
                masked,
                bdout.ptr(),
                vocab,
                dim,
                bdw_atomic.ptr(),
                acc_ptr,
                0,
            )?;
            embedding::embedding_backward_sorted(
                l,
                dt,
                bids.ptr(),
                n,
                start,
                bdout.ptr(),
                vocab,
                dim,
                bdw_sorted.ptr(),
                scratch.ptr(),
            )?;
        }
        c.r.close("embedding.fwd", dn(dt), &shape, &d.down(dt, &bout)?, &out, b);
        let got_err = d.down_raw::<i32>(&berr)?[0];
        c.r.exact(
            "embedding.fwd.error",
            "i32",
            &shape,
            &[got_err as u64],
            &[embedding::NO_ERROR as u64],
        );
        c.r.close("embedding.bwd_csr", dn(dt), &shape, &d.down(dt, &bdw_csr)?, &dw, b);
        c.r.close("embedding.bwd_atomic", dn(dt), &shape, &d.down(dt, &bdw_atomic)?, &dw, b);
        // The CSR built on the device gives the host-built CSR's sums: the same bits.
        let bits = |buf: &DeviceBuffer| -> Res<Vec<u64>> {
            Ok(d.down(dt, buf)?.iter().map(|x| x.to_bits()).collect())
        };
        c.r.exact("embedding.bwd_sorted", dn(dt), &shape, &bits(&bdw_sorted)?, &bits(&bdw_csr)?);
        Ok(())
    });
}
