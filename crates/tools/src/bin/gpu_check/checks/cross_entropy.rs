//! The `cross_entropy` family of checks.

use tpar_kernels::cuda::raw::cross_entropy as ce;
use tpar_kernels::cuda::CudaDType;

use CudaDType::{BF16, F16, F32};

use super::{bound, Ctx, IGNORE};
use crate::data::{dn, round_to};
use crate::Res;

pub(crate) fn check_cross_entropy(c: &mut Ctx) {
    let cases: &[(CudaDType, usize, usize)] = if c.quick {
        &[(F32, 37, 300), (BF16, 37, 300), (F16, 37, 300), (BF16, 9, 2000)]
    } else {
        &[(F32, 4096, 32000), (BF16, 4096, 32000), (F16, 4096, 32000), (BF16, 512, 128256)]
    };
    for &(dt, rows, vocab) in cases {
        ce_case(c, dt, rows, vocab);
    }
}

/// Random targets; every seventh row is ignored.
pub(crate) fn ce_targets(c: &mut Ctx, rows: usize, vocab: usize) -> Vec<i64> {
    (0..rows).map(|r| if r % 7 == 3 { IGNORE } else { c.rng.below(vocab) as i64 }).collect()
}

/// Columns `[start, start + width)` of a row-major `[rows, cols]` matrix.
pub(crate) fn columns(m: &[f64], cols: usize, start: usize, width: usize) -> Vec<f64> {
    m.chunks_exact(cols).flat_map(|row| row[start..start + width].iter().copied()).collect()
}

pub(crate) fn ce_case(c: &mut Ctx, dt: CudaDType, rows: usize, vocab: usize) {
    let shape = format!("{rows}x{vocab}");
    c.guard("cross_entropy", dn(dt), &shape, |c| {
        let d = c.d;
        let l = d.l();
        let b = bound(dt);
        let logits = c.rng.vals(dt, rows * vocab, -4.0, 4.0);
        let targets = ce_targets(c, rows, vocab);
        let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        let count = tpar_kernels::cross_entropy::cross_entropy_forward::<f64>(
            &logits, rows, vocab, &targets, IGNORE, &mut loss, &mut lse,
        )?;
        let scale = 1.0 / count.max(1) as f64;
        let mut dlogits = vec![0.0; logits.len()];
        tpar_kernels::cross_entropy::cross_entropy_backward::<f64, _>(
            &logits,
            rows,
            vocab,
            &targets,
            0,
            IGNORE,
            &lse,
            &[scale],
            &mut dlogits,
        )?;
        let (bl, bt) = (d.up(dt, &logits)?, d.up_raw(&targets)?);
        let (bloss, blse, bcount, berr) =
            (d.junk(rows * 4)?, d.junk(rows * 4)?, d.zeros(4)?, d.up_raw(&[ce::NO_ERROR])?);
        let (blse_ref, bscale) = (d.up(F32, &lse)?, d.up(F32, &[scale])?);
        let bdl = d.junk(logits.len() * dt.size())?;
        // SAFETY: every buffer was allocated above with the size the op needs.
        unsafe {
            ce::cross_entropy_forward(
                l,
                dt,
                bl.ptr(),
                rows,
                vocab,
                bt.ptr(),
                IGNORE,
                bloss.ptr(),
                blse.ptr(),
                bcount.ptr(),
                berr.ptr(),
            )?;
            ce::cross_entropy_backward(
                l,
                dt,
                bl.ptr(),
                rows,
                vocab,
                bt.ptr(),
                0,
                IGNORE,
                blse_ref.ptr(),
                bscale.ptr(),
                1,
                bdl.ptr(),
            )?;
        }
        c.r.close("ce.fwd.loss", dn(dt), &shape, &d.down(F32, &bloss)?, &loss, b);
        c.r.close("ce.fwd.lse", dn(dt), &shape, &d.down(F32, &blse)?, &lse, b);
        let got_count = d.down_raw::<i32>(&bcount)?[0];
        let got_err = d.down_raw::<i32>(&berr)?[0];
        c.r.exact(
            "ce.fwd.count+error",
            "i32",
            &shape,
            &[got_count as u64, got_err as u64],
            &[count as u64, ce::NO_ERROR as u64],
        );
        c.r.close("ce.bwd", dn(dt), &shape, &d.down(dt, &bdl)?, &dlogits, b);

        // Vocab-parallel pieces: two shards split at an unaligned column.
        let v0 = vocab / 3;
        let widths = [v0, vocab - v0];
        let mut stats = Vec::new();
        for (shard, &width) in widths.iter().enumerate() {
            let start = if shard == 0 { 0 } else { v0 };
            let part = columns(&logits, vocab, start, width);
            let (mut mx, mut se, mut tl) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
            tpar_kernels::cross_entropy::ce_local_stats::<f64>(
                &part,
                rows,
                width,
                &targets,
                start as i64,
                vocab,
                IGNORE,
                &mut mx,
                &mut se,
                &mut tl,
            )?;
            stats.push((mx, se, tl));
            if shard == 0 {
                continue;
            }
            let bpart = d.up(dt, &part)?;
            let (bmx, bse, btl, berr) = (
                d.junk(rows * 4)?,
                d.junk(rows * 4)?,
                d.junk(rows * 4)?,
                d.up_raw(&[ce::NO_ERROR])?,
            );
            // Per-row scales, backward of the shard with the global lse.
            let row_scale = c.rng.vals(F32, rows, 0.5, 1.5);
            let mut dpart = vec![0.0; part.len()];
            tpar_kernels::cross_entropy::cross_entropy_backward::<f64, _>(
                &part,
                rows,
                width,
                &targets,
                start as i64,
                IGNORE,
                &lse,
                &row_scale,
                &mut dpart,
            )?;
            let (brs, bdpart) = (d.up(F32, &row_scale)?, d.junk(part.len() * dt.size())?);
            // SAFETY: every buffer was allocated above with the size the op needs.
            unsafe {
                ce::ce_local_stats(
                    l,
                    dt,
                    bpart.ptr(),
                    rows,
                    width,
                    bt.ptr(),
                    start as i64,
                    vocab,
                    IGNORE,
                    bmx.ptr(),
                    bse.ptr(),
                    btl.ptr(),
                    berr.ptr(),
                )?;
                ce::cross_entropy_backward(
                    l,
                    dt,
                    bpart.ptr(),
                    rows,
                    width,
                    bt.ptr(),
                    start as i64,
                    IGNORE,
                    blse_ref.ptr(),
                    brs.ptr(),
                    rows,
                    bdpart.ptr(),
                )?;
            }
            let (mx, se, tl) = &stats[1];
            let parts = vec![
                ("max".to_string(), d.down(F32, &bmx)?, mx.clone()),
                ("sumexp".to_string(), d.down(F32, &bse)?, se.clone()),
                ("target_logit".to_string(), d.down(F32, &btl)?, tl.clone()),
            ];
            let sh = format!("{rows}x{width}@{start}");
            c.r.close_parts("ce.shard.stats", dn(dt), &sh, &parts, b);
            c.r.close("ce.shard.bwd", dn(dt), &sh, &d.down(dt, &bdpart)?, &dpart, b);
        }
        if dt == F32 {
            ce_fold(c, &shape, &stats, &targets, &loss, count)?;
        }
        Ok(())
    });
}

/// The f32 kernels that fold shard statistics: merge, rescale, lse, loss.
pub(crate) fn ce_fold(
    c: &mut Ctx,
    shape: &str,
    stats: &[(Vec<f64>, Vec<f64>, Vec<f64>)],
    targets: &[i64],
    loss_ref: &[f64],
    count: usize,
) -> Res<()> {
    use tpar_kernels::cross_entropy as cpu;
    let d = c.d;
    let l = d.l();
    let rows = targets.len();
    let b = bound(F32);
    let ((mx0, se0, tl0), (mx1, se1, tl1)) = (&stats[0], &stats[1]);
    let round = |v: &[f64]| v.iter().map(|&x| round_to(F32, x)).collect::<Vec<_>>();
    let (mx0, se0, mx1, se1) = (round(mx0), round(se0), round(mx1), round(se1));
    // merge
    let (mut mx, mut se) = (mx0.clone(), se0.clone());
    cpu::ce_merge::<f64>(&mut mx, &mut se, &mx1, &se1)?;
    let (bmx, bse, bmx1, bse1) =
        (d.up(F32, &mx0)?, d.up(F32, &se0)?, d.up(F32, &mx1)?, d.up(F32, &se1)?);
    // SAFETY: four f32 buffers of `rows` elements.
    unsafe { ce::ce_merge(l, bmx.ptr(), bse.ptr(), bmx1.ptr(), bse1.ptr(), rows)? };
    let parts = vec![
        ("max".to_string(), d.down(F32, &bmx)?, mx.clone()),
        ("sumexp".to_string(), d.down(F32, &bse)?, se.clone()),
    ];
    c.r.close_parts("ce.merge", "f32", shape, &parts, b);
    // rescale shard 1 to the merged max
    let mx_r = round(&mx);
    let mut se1r = se1.clone();
    cpu::ce_rescale::<f64>(&mx1, &mut se1r, &mx_r)?;
    let (bse1r, bgmx) = (d.up(F32, &se1)?, d.up(F32, &mx_r)?);
    // SAFETY: three f32 buffers of `rows` elements.
    unsafe { ce::ce_rescale(l, bmx1.ptr(), bse1r.ptr(), bgmx.ptr(), rows)? };
    c.r.close("ce.rescale", "f32", shape, &d.down(F32, &bse1r)?, &se1r, b);
    // lse of the merged statistics
    let se_r = round(&se);
    let mut lse = vec![0.0; rows];
    cpu::ce_lse::<f64>(&mx_r, &se_r, &mut lse)?;
    let (bse_r, blse) = (d.up(F32, &se_r)?, d.junk(rows * 4)?);
    // SAFETY: three f32 buffers of `rows` elements.
    unsafe { ce::ce_lse(l, bgmx.ptr(), bse_r.ptr(), blse.ptr(), rows)? };
    c.r.close("ce.lse", "f32", shape, &d.down(F32, &blse)?, &lse, b);
    // loss from the lse and the summed target logits: the unsharded loss
    let tl: Vec<f64> = tl0.iter().zip(tl1).map(|(a, b)| round_to(F32, a + b)).collect();
    let (btl, bt, bloss, bcount) =
        (d.up(F32, &tl)?, d.up_raw(targets)?, d.junk(rows * 4)?, d.zeros(4)?);
    // SAFETY: f32 buffers and i64 targets of `rows` elements, one i32 counter.
    unsafe {
        ce::ce_loss(l, blse.ptr(), btl.ptr(), bt.ptr(), IGNORE, rows, bloss.ptr(), bcount.ptr())?
    };
    c.r.close("ce.loss(sharded)", "f32", shape, &d.down(F32, &bloss)?, loss_ref, b);
    let got = d.down_raw::<i32>(&bcount)?[0];
    c.r.exact("ce.loss.count", "i32", shape, &[got as u64], &[count as u64]);
    Ok(())
}
