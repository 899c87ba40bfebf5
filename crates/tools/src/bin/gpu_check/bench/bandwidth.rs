//! The memory-bound benchmarks: a device-to-device copy, then RMSNorm, RoPE,
//! dropout, cross-entropy and the embedding gradient in GB/s.

use tpar_kernels::cuda::raw::{cross_entropy as ce, dropout, embedding, layout, rmsnorm, rope};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::dropout::{DropoutMask, ShardRuns};
use tpar_kernels::rope::RopeShape;

use CudaDType::{BF16, F32};

use super::{rate, time_per_call, Bench, IGNORE};
use crate::data::Rng;
use crate::dev::Dev;
use crate::Res;

/// Two timings measured together, or the error that stopped them for both.
fn pair(t: Res<(f64, f64)>) -> (Res<f64>, Res<f64>) {
    match t {
        Ok((a, b)) => (Ok(a), Ok(b)),
        Err(e) => (Err(e.to_string().into()), Err(e)),
    }
}

pub(crate) fn bandwidth_benches(d: &Dev, s: DevPtr, rng: &mut Rng) -> Vec<Bench> {
    let mut out = Vec::new();
    let gbs = |key: &str, bytes: f64, t: Res<f64>, note: &str| {
        let (ours, note) = match t {
            Ok(t) => (Some(rate(bytes, t, 1e9)), note.to_string()),
            Err(e) => (None, format!("{note}; {e}")),
        };
        Bench { key: key.into(), unit: "GB/s", ours, cublaslt: None, note }
    };
    let l = d.l();

    // Copy: 1 GiB device to device (bytes read + written).
    let n = 1usize << 30;
    let t = (|| -> Res<(f64, f64)> {
        let (a, b) = (d.alloc(n)?, d.alloc(n)?);
        let (pa, pb) = (a.ptr(), b.ptr());
        // SAFETY: two distinct allocations of `n` bytes.
        let t_dtod = time_per_call(d, || {
            unsafe { d.mem.dtod(pa, pb, n)? };
            Ok(())
        })?;
        // SAFETY: as above, `n / 2` two-byte elements.
        let t_kernel = time_per_call(d, || {
            unsafe { layout::copy(l, 2, pa, pb, n / 2)? };
            Ok(())
        })?;
        Ok((t_dtod, t_kernel))
    })();
    let (t_dtod, t_kernel) = pair(t);
    out.push(gbs("copy.dtod", 2.0 * n as f64, t_dtod, "1 GiB cuMemcpyDtoD"));
    out.push(gbs("copy.kernel", 2.0 * n as f64, t_kernel, "1 GiB layout::copy"));

    // RMSNorm, 16k tokens x 4096, bf16.
    let (rows, dim) = (16384usize, 4096usize);
    let nx = (rows * dim) as f64;
    let t = (|| -> Res<(f64, f64)> {
        let (y, rstd) = (d.alloc(rows * dim * 2)?, d.alloc(rows * 4)?);
        let (dx, dw) = (d.alloc(rows * dim * 2)?, d.alloc(dim * 4)?);
        let ws = d.alloc(rmsnorm::backward_workspace_bytes(rows, dim))?;
        let tf = time_per_call(d, || {
            // SAFETY: x and w lie inside the source; y and rstd were allocated here.
            unsafe {
                rmsnorm::rmsnorm_forward(l, BF16, s, s, y.ptr(), rstd.ptr(), rows, dim, 1e-5)?
            };
            Ok(())
        })?;
        let tb = time_per_call(d, || {
            // SAFETY: x, w and dy lie inside the source; the rest was allocated here.
            unsafe {
                rmsnorm::rmsnorm_backward(
                    l,
                    BF16,
                    s,
                    s,
                    rstd.ptr(),
                    s,
                    dx.ptr(),
                    dw.ptr(),
                    ws.ptr(),
                    rows,
                    dim,
                )?
            };
            Ok(())
        })?;
        Ok((tf, tb))
    })();
    let note = "16384x4096 bf16";
    match t {
        Ok((tf, tb)) => {
            out.push(gbs("rmsnorm.fwd", 2.0 * nx * 2.0, Ok(tf), note));
            out.push(gbs("rmsnorm.bwd", 3.0 * nx * 2.0, Ok(tb), note));
            out.push(gbs("rmsnorm.fwdbwd", 5.0 * nx * 2.0, Ok(tf + tb), note));
        }
        Err(e) => out.push(gbs("rmsnorm.fwd", 0.0, Err(e), note)),
    }

    // RoPE on queries [4, 32, 4096, 128] bf16.
    let rs = RopeShape { outer: 4 * 32, seq: 4096, inner: 1, head_dim: 128 };
    let nr = (rs.outer * rs.seq * rs.head_dim) as f64;
    let t = (|| -> Res<f64> {
        let y = d.alloc(nr as usize * 2)?;
        // SAFETY: x, cos and sin lie inside the source; y was allocated for x's shape.
        time_per_call(d, || {
            unsafe { rope::rope_forward(l, BF16, &rs, s, s, s, y.ptr())? };
            Ok(())
        })
    })();
    out.push(gbs("rope.fwd", 2.0 * nr * 2.0, t, "[4, 32, 4096, 128] bf16"));

    // Dropout (p 0.1) over the RMSNorm benchmark's 16k x 4096 bf16 (read + written).
    let (rows, dim) = (16384usize, 4096usize);
    let t = (|| -> Res<f64> {
        let y = d.alloc(rows * dim * 2)?;
        let mask = DropoutMask::new(0, 0, 0.1)?;
        let runs = ShardRuns::new(&[rows, dim], &[rows, dim], &[0, 0])?;
        time_per_call(d, || {
            // SAFETY: x lies inside the source; y was allocated for its elements.
            unsafe { dropout::dropout(l, BF16, &mask, &runs, s, y.ptr(), None)? };
            Ok(())
        })
    })();
    out.push(gbs("dropout", 2.0 * (rows * dim) as f64 * 2.0, t, "16384x4096 bf16, p 0.1"));

    // Cross-entropy, 8192 tokens x 128256 classes (Llama 3 vocab), bf16.
    let (rows, vocab) = (8192usize, 128256usize);
    let nl = rows * vocab;
    let note = "8192x128256 bf16";
    let t = (|| -> Res<(f64, f64)> {
        let logits = d.alloc(nl * 2)?;
        let chunk = 8192 * 14336;
        let mut at = 0;
        while at < nl {
            let len = chunk.min(nl - at);
            // SAFETY: `len` elements inside both the source and the logits.
            unsafe { d.mem.dtod(s, logits.ptr() + (at * 2) as DevPtr, len * 2)? };
            at += len;
        }
        let targets: Vec<i64> = (0..rows).map(|_| rng.below(vocab) as i64).collect();
        let bt = d.up_raw(&targets)?;
        let (loss, lse, count) = (d.alloc(rows * 4)?, d.alloc(rows * 4)?, d.zeros(4)?);
        let (scale, dl) = (d.up(F32, &[1.0 / rows as f64])?, d.alloc(nl * 2)?);
        let tf = time_per_call(d, || {
            // SAFETY: every buffer was allocated above with the size the op needs.
            unsafe {
                ce::cross_entropy_forward(
                    l,
                    BF16,
                    logits.ptr(),
                    rows,
                    vocab,
                    bt.ptr(),
                    IGNORE,
                    loss.ptr(),
                    lse.ptr(),
                    count.ptr(),
                    0,
                )?
            };
            Ok(())
        })?;
        let tb = time_per_call(d, || {
            // SAFETY: as above.
            unsafe {
                ce::cross_entropy_backward(
                    l,
                    BF16,
                    logits.ptr(),
                    rows,
                    vocab,
                    bt.ptr(),
                    0,
                    IGNORE,
                    lse.ptr(),
                    scale.ptr(),
                    1,
                    dl.ptr(),
                )?
            };
            Ok(())
        })?;
        Ok((tf, tb))
    })();
    let nl = nl as f64;
    match t {
        Ok((tf, tb)) => {
            out.push(gbs("cross_entropy.fwd", nl * 2.0, Ok(tf), note));
            out.push(gbs("cross_entropy.bwd", 2.0 * nl * 2.0, Ok(tb), note));
            out.push(gbs("cross_entropy.fwdbwd", 3.0 * nl * 2.0, Ok(tf + tb), note));
        }
        Err(e) => out.push(gbs("cross_entropy.fwd", 0.0, Err(e), note)),
    }
    // The embedding gradient of 8192 ids into bf16 rows: the training step's (259 rows of
    // 1024, a third of the ids one row, as text's spaces) and a 32000-row vocabulary of
    // 4096 (uniform ids); sorted on the device (deterministic, the default) and atomic.
    // Bytes: the output gradient read and the table gradient written.
    for (vocab, dim, skewed) in [(259usize, 1024usize, true), (32000, 4096, false)] {
        let n = 8192usize;
        let ids: Vec<i64> = (0..n)
            .map(|i| if skewed && i.is_multiple_of(3) { 32 } else { rng.below(vocab) as i64 })
            .collect();
        let bytes = 2.0 * (n * dim + vocab * dim) as f64;
        let note = format!("{n} ids, {vocab}x{dim} bf16{}", if skewed { ", skewed" } else { "" });
        let t = (|| -> Res<(f64, f64)> {
            let (bids, dw) = (d.up_raw(&ids)?, d.alloc(vocab * dim * 2)?);
            let scratch = d.alloc(embedding::sorted_scratch_bytes(n, vocab))?;
            let acc = d.alloc(vocab * dim * 4)?;
            let sorted = time_per_call(d, || {
                // SAFETY: the ids, the output gradient (inside the source), the table
                // gradient and the scratch have the sizes the call needs.
                unsafe {
                    embedding::embedding_backward_sorted(
                        l,
                        BF16,
                        bids.ptr(),
                        n,
                        0,
                        s,
                        vocab,
                        dim,
                        dw.ptr(),
                        scratch.ptr(),
                    )?
                };
                Ok(())
            })?;
            let atomic = time_per_call(d, || {
                // SAFETY: as above, with an f32 accumulator of the table's size.
                unsafe {
                    embedding::embedding_backward_atomic(
                        l,
                        BF16,
                        bids.ptr(),
                        n,
                        0,
                        true,
                        s,
                        vocab,
                        dim,
                        dw.ptr(),
                        acc.ptr(),
                        0,
                    )?
                };
                Ok(())
            })?;
            Ok((sorted, atomic))
        })();
        let (sorted, atomic) = pair(t);
        let key = format!("embedding.bwd.v{vocab}");
        out.push(gbs(&format!("{key}.sorted"), bytes, sorted, &note));
        out.push(gbs(&format!("{key}.atomic"), bytes, atomic, &note));
    }
    out
}
