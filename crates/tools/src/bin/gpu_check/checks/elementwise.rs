//! The `elementwise` family of checks.

use half::{bf16, f16};
use tpar_kernels::cuda::raw::elementwise as ew;
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::elementwise::{BinaryOp, UnaryOp};

use CudaDType::{BF16, F16, F32};

use super::cross_entropy::columns;
use super::{bound, Ctx, DTYPES};
use crate::data::{dn, round_to};
use crate::Res;

/// A broadcast pattern of a binary op: label, strides of a, strides of b, output shape.
pub(crate) type Broadcast = (&'static str, Vec<usize>, Vec<usize>, Vec<usize>);

pub(crate) fn check_elementwise(c: &mut Ctx) {
    let n = if c.quick { 1003 } else { (1 << 22) + 5 };
    for dt in DTYPES {
        unary_case(c, dt, n);
        scalar_case(c, dt, n);
    }
    let (r, k) = if c.quick { (37, 40) } else { (4096, 4096) };
    let cs = |shape: &[usize]| tpar_kernels::elementwise::contiguous_strides(shape);
    // (label, a strides, b strides, output shape)
    let patterns: Vec<Broadcast> = vec![
        ("same", vec![1], vec![1], vec![n]),
        ("row", cs(&[r, k]), vec![0, 1], vec![r, k]),
        ("col", cs(&[r, k]), vec![1, 0], vec![r, k]),
        ("3d", vec![24, 0, 1], vec![0, 1, 0], vec![4, 5, 24]),
    ];
    for dt in DTYPES {
        for (label, sa, sb, shape) in &patterns {
            binary_case(c, dt, label, sa, sb, shape);
        }
    }
    let (rows, cols) = if c.quick { (9, 40) } else { (2048, 14336) };
    for dt in DTYPES {
        swiglu_case(c, dt, rows, cols, true);
    }
    swiglu_case(c, BF16, rows, cols, false);
    for dt in DTYPES {
        fill_cast_case(c, dt, n);
    }
    for (src, dst) in [(BF16, F32), (F32, F32), (BF16, BF16), (F16, F32)] {
        accumulate_case(c, src, dst, n);
    }
    let shapes: &[(usize, usize)] =
        if c.quick { &[(37, 100), (5, 1500)] } else { &[(8192, 1000), (1024, 32000)] };
    for dt in DTYPES {
        for &(rows, cols) in shapes {
            softmax_case(c, dt, rows, cols);
        }
    }
}

/// Inputs in the domain of `op`.
pub(crate) fn unary_input(c: &mut Ctx, dt: CudaDType, op: UnaryOp, n: usize) -> Vec<f64> {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => {
            c.rng.vals(dt, n, 0.25, 3.0)
        }
        _ => c.rng.vals(dt, n, -4.0, 4.0),
    }
}

pub(crate) fn unary_case(c: &mut Ctx, dt: CudaDType, n: usize) {
    let shape = format!("n{n}");
    c.guard("unary", dn(dt), &shape, |c| {
        use tpar_kernels::elementwise as cpu;
        let d = c.d;
        let mut parts = Vec::new();
        for op in UnaryOp::ALL {
            let x = unary_input(c, dt, op, n);
            let dy = c.rng.vals(dt, n, -1.0, 1.0);
            let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
            cpu::unary::<f64, _>(op, &x, &mut y)?;
            cpu::unary_backward::<f64, _>(op, &x, &y, &dy, &mut dx)?;
            let (bx, bdy, by) = (d.up(dt, &x)?, d.up(dt, &dy)?, d.junk(n * dt.size())?);
            let bdx = d.junk(n * dt.size())?;
            // SAFETY: four buffers of `n` elements allocated above.
            unsafe {
                ew::unary(d.l(), dt, op, bx.ptr(), by.ptr(), n)?;
                ew::unary_backward(d.l(), dt, op, bx.ptr(), by.ptr(), bdy.ptr(), bdx.ptr(), n)?;
            }
            let name = format!("{op:?}").to_lowercase();
            parts.push((name.clone(), d.down(dt, &by)?, y));
            parts.push((format!("{name}.bwd"), d.down(dt, &bdx)?, dx));
        }
        c.r.close_parts("unary(12 ops, fwd+bwd)", dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}

pub(crate) fn scalar_case(c: &mut Ctx, dt: CudaDType, n: usize) {
    let shape = format!("n{n} s=1.5");
    c.guard("scalar", dn(dt), &shape, |c| {
        let d = c.d;
        let x = c.rng.vals(dt, n, 0.25, 3.0);
        let bx = d.up(dt, &x)?;
        let mut parts = Vec::new();
        for (i, op) in BinaryOp::ALL.into_iter().enumerate() {
            let first = i % 2 == 1;
            let mut y = vec![0.0; n];
            tpar_kernels::elementwise::scalar::<f64, _>(op, &x, 1.5, first, &mut y)?;
            let by = d.junk(n * dt.size())?;
            // SAFETY: two buffers of `n` elements allocated above.
            unsafe { ew::scalar(d.l(), dt, op, bx.ptr(), 1.5, first, by.ptr(), n)? };
            let label = format!("{}{op:?}", if first { "s " } else { "" }).to_lowercase();
            parts.push((label, d.down(dt, &by)?, y));
        }
        c.r.close_parts("scalar(7 ops)", dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}

/// Elements an operand read at `strides` over `shape` must hold.
pub(crate) fn reach(strides: &[usize], shape: &[usize]) -> usize {
    1 + strides.iter().zip(shape).map(|(s, n)| s * (n - 1)).sum::<usize>()
}

pub(crate) fn binary_case(
    c: &mut Ctx,
    dt: CudaDType,
    label: &str,
    sa: &[usize],
    sb: &[usize],
    shape: &[usize],
) {
    let name = format!("binary.{label}(7 ops)");
    let sh = format!("{shape:?}");
    c.guard(&name, dn(dt), &sh, |c| {
        let d = c.d;
        let a = c.rng.vals(dt, reach(sa, shape), 0.25, 3.0);
        let b = c.rng.vals(dt, reach(sb, shape), 0.5, 2.0);
        let (ba, bb) = (d.up(dt, &a)?, d.up(dt, &b)?);
        let n: usize = shape.iter().product();
        let mut parts = Vec::new();
        for op in BinaryOp::ALL {
            let mut want = vec![0.0; n];
            tpar_kernels::elementwise::binary::<f64, _>(op, &a, sa, &b, sb, shape, &mut want)?;
            let bo = d.junk(n * dt.size())?;
            // SAFETY: the operands cover every element their strides reach, out `n`.
            unsafe { ew::binary(d.l(), dt, op, ba.ptr(), sa, bb.ptr(), sb, shape, bo.ptr())? };
            parts.push((format!("{op:?}").to_lowercase(), d.down(dt, &bo)?, want));
        }
        c.r.close_parts(&name, dn(dt), &sh, &parts, bound(dt));
        Ok(())
    });
}

pub(crate) fn swiglu_case(c: &mut Ctx, dt: CudaDType, rows: usize, cols: usize, fused: bool) {
    let name = if fused { "swiglu(fused gate|up)" } else { "swiglu" };
    let shape = format!("{rows}x{cols}");
    c.guard(name, dn(dt), &shape, |c| {
        use tpar_kernels::elementwise as cpu;
        let d = c.d;
        let n = rows * cols;
        let es = dt.size();
        let gate = c.rng.vals(dt, n, -4.0, 4.0);
        let up = c.rng.vals(dt, n, -2.0, 2.0);
        let dy = c.rng.vals(dt, n, -1.0, 1.0);
        // reference from the CPU kernels: y = silu(a) * b; db = dy * silu(a);
        // da = silu'(a) * (dy * b)
        let (mut s, mut y, mut db, mut dyb, mut da) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let st = [1usize];
        cpu::unary::<f64, _>(UnaryOp::Silu, &gate, &mut s)?;
        cpu::binary::<f64, _>(BinaryOp::Mul, &s, &st, &up, &st, &[n], &mut y)?;
        cpu::binary::<f64, _>(BinaryOp::Mul, &dy, &st, &s, &st, &[n], &mut db)?;
        cpu::binary::<f64, _>(BinaryOp::Mul, &dy, &st, &up, &st, &[n], &mut dyb)?;
        cpu::unary_backward::<f64, _>(UnaryOp::Silu, &gate, &s, &dyb, &mut da)?;
        // device layout: [rows, 2 * cols] (gate | up) when fused, else two tensors
        let (ld, ga, ub, gbuf, ubuf) = if fused {
            let mut both = Vec::with_capacity(2 * n);
            for r in 0..rows {
                both.extend_from_slice(&gate[r * cols..(r + 1) * cols]);
                both.extend_from_slice(&up[r * cols..(r + 1) * cols]);
            }
            let b = d.up(dt, &both)?;
            (2 * cols, b.ptr(), b.ptr() + (cols * es) as DevPtr, b, None)
        } else {
            let (g, u) = (d.up(dt, &gate)?, d.up(dt, &up)?);
            (cols, g.ptr(), u.ptr(), g, Some(u))
        };
        let (bdy, by) = (d.up(dt, &dy)?, d.junk(n * es)?);
        let grads = d.junk(rows * ld * es)?;
        let grads2 = if fused { None } else { Some(d.junk(n * es)?) };
        let (pda, pdb) = match &grads2 {
            None => (grads.ptr(), grads.ptr() + (cols * es) as DevPtr),
            Some(g2) => (grads.ptr(), g2.ptr()),
        };
        // SAFETY: gate and up (and their gradients) hold `rows` rows at pitch
        // `ld`; y and dy `rows * cols` elements; all allocated above.
        unsafe {
            ew::swiglu_forward(d.l(), dt, ga, ub, ld, by.ptr(), rows, cols)?;
            ew::swiglu_backward(d.l(), dt, ga, ub, ld, bdy.ptr(), pda, pdb, rows, cols)?;
        }
        let g = d.down(dt, &grads)?;
        let (got_da, got_db): (Vec<f64>, Vec<f64>) = match &grads2 {
            None => (columns(&g, 2 * cols, 0, cols), columns(&g, 2 * cols, cols, cols)),
            Some(g2) => (g, d.down(dt, g2)?),
        };
        drop((gbuf, ubuf));
        let parts = vec![
            ("y".to_string(), d.down(dt, &by)?, y),
            ("da".to_string(), got_da, da),
            ("db".to_string(), got_db, db),
        ];
        c.r.close_parts(name, dn(dt), &shape, &parts, bound(dt));
        Ok(())
    });
}

/// `x` converted to `to` by the CPU cast kernel.
pub(crate) fn cpu_cast(to: CudaDType, x: &[f64]) -> Res<Vec<f64>> {
    use tpar_kernels::elementwise::cast;
    Ok(match to {
        F32 => {
            let mut y = vec![0f32; x.len()];
            cast::<f64, f32>(x, &mut y)?;
            y.into_iter().map(f64::from).collect()
        }
        BF16 => {
            let mut y = vec![bf16::ZERO; x.len()];
            cast::<f64, bf16>(x, &mut y)?;
            y.into_iter().map(bf16::to_f64).collect()
        }
        F16 => {
            let mut y = vec![f16::ZERO; x.len()];
            cast::<f64, f16>(x, &mut y)?;
            y.into_iter().map(f16::to_f64).collect()
        }
    })
}

pub(crate) fn fill_cast_case(c: &mut Ctx, dt: CudaDType, n: usize) {
    let shape = format!("n{n}");
    c.guard("fill+cast", dn(dt), &shape, |c| {
        let d = c.d;
        let by = d.junk(n * dt.size())?;
        // SAFETY: `n` elements allocated above.
        unsafe { ew::fill(d.l(), dt, by.ptr(), n, 0.3)? };
        c.r.close("fill", dn(dt), &shape, &d.down(dt, &by)?, &vec![round_to(dt, 0.3); n], 0.0);
        let x = c.rng.vals(dt, n, -70000.0, 70000.0);
        let bx = d.up(dt, &x)?;
        let mut parts = Vec::new();
        for to in DTYPES {
            let bo = d.junk(n * to.size())?;
            // SAFETY: `n` elements of each type allocated above.
            unsafe { ew::cast(d.l(), dt, bx.ptr(), to, bo.ptr(), n)? };
            parts.push((format!(">{}", dn(to)), d.down(to, &bo)?, cpu_cast(to, &x)?));
        }
        let ids: Vec<i64> = (0..n).map(|_| c.rng.below(2001) as i64 - 1000).collect();
        let bi = d.up_raw(&ids)?;
        let bo = d.junk(n * dt.size())?;
        // SAFETY: `n` i64 and `n` elements of `dt` allocated above.
        unsafe { ew::cast_i64(d.l(), bi.ptr(), dt, bo.ptr(), n)? };
        let idf: Vec<f64> = ids.iter().map(|&i| i as f64).collect();
        parts.push(("i64>".to_string(), d.down(dt, &bo)?, cpu_cast(dt, &idf)?));
        // Casts round to nearest: exact.
        c.r.close_parts(&format!("cast({}>*)", dn(dt)), dn(dt), &shape, &parts, 0.0);
        Ok(())
    });
}

pub(crate) fn accumulate_case(c: &mut Ctx, src: CudaDType, dst: CudaDType, n: usize) {
    let dtype = format!("{}>{}", dn(src), dn(dst));
    let shape = format!("n{n} alpha 0.5");
    c.guard("accumulate", &dtype, &shape, |c| {
        let d = c.d;
        let s = c.rng.vals(src, n, -1.0, 1.0);
        let t = c.rng.vals(dst, n, -1.0, 1.0);
        let (mut half_s, mut want) = (vec![0.0; n], vec![0.0; n]);
        tpar_kernels::elementwise::scalar::<f64, _>(BinaryOp::Mul, &s, 0.5, false, &mut half_s)?;
        tpar_kernels::elementwise::binary::<f64, _>(
            BinaryOp::Add,
            &t,
            &[1],
            &half_s,
            &[1],
            &[n],
            &mut want,
        )?;
        let (bs, bt) = (d.up(src, &s)?, d.up(dst, &t)?);
        // SAFETY: `n` elements of each type allocated above.
        unsafe { ew::accumulate(d.l(), src, bs.ptr(), dst, bt.ptr(), n, 0.5)? };
        c.r.close("accumulate", &dtype, &shape, &d.down(dst, &bt)?, &want, bound(dst));
        Ok(())
    });
}

pub(crate) fn softmax_case(c: &mut Ctx, dt: CudaDType, rows: usize, cols: usize) {
    let shape = format!("{rows}x{cols}");
    c.guard("softmax", dn(dt), &shape, |c| {
        use tpar_kernels::softmax as cpu;
        let d = c.d;
        let n = rows * cols;
        let x = c.rng.vals(dt, n, -5.0, 5.0);
        let dy = c.rng.vals(dt, n, -1.0, 1.0);
        let (bx, bdy) = (d.up(dt, &x)?, d.up(dt, &dy)?);
        for log in [false, true] {
            let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
            if log {
                cpu::log_softmax_forward::<f64>(&x, rows, cols, &mut y)?;
                cpu::log_softmax_backward::<f64>(&y, &dy, rows, cols, &mut dx)?;
            } else {
                cpu::softmax_forward::<f64>(&x, rows, cols, &mut y)?;
                cpu::softmax_backward::<f64>(&y, &dy, rows, cols, &mut dx)?;
            }
            let (by, bdx) = (d.junk(n * dt.size())?, d.junk(n * dt.size())?);
            let by_ref = d.up(dt, &y)?;
            // SAFETY: every buffer holds `rows * cols` elements.
            unsafe {
                ew::softmax_forward(d.l(), dt, bx.ptr(), by.ptr(), rows, cols, log)?;
                ew::softmax_backward(
                    d.l(),
                    dt,
                    by_ref.ptr(),
                    bdy.ptr(),
                    bdx.ptr(),
                    rows,
                    cols,
                    log,
                )?;
            }
            let name = if log { "log_softmax" } else { "softmax" };
            let parts = vec![
                ("fwd".to_string(), d.down(dt, &by)?, y),
                ("bwd".to_string(), d.down(dt, &bdx)?, dx),
            ];
            c.r.close_parts(name, dn(dt), &shape, &parts, bound(dt));
        }
        Ok(())
    });
}
