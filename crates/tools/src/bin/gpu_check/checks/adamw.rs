//! The `adamw` family of checks.

use tpar_kernels::cuda::raw::adamw;
use tpar_kernels::cuda::{CudaDType, DeviceBuffer};

use CudaDType::{BF16, F16, F32};

use super::reduce::multi_lens;
use super::{bound, Ctx};
use crate::data::dn;
use crate::Res;

pub(crate) fn check_adamw(c: &mut Ctx) {
    let n = if c.quick { 1003 } else { (1 << 24) + 3 };
    let lens = multi_lens(c);
    for (dt, gdt) in [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)] {
        adamw_case(c, dt, gdt, n);
        adamw_each_case(c, dt, gdt, &lens);
    }
}

/// The hyper-parameters of the adamw checks: the third step.
pub(crate) fn adamw_hyper() -> tpar_kernels::adamw::AdamWParams {
    tpar_kernels::adamw::AdamWParams {
        lr: 0.05,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
    }
}

pub(crate) fn adamw_dtype(dt: CudaDType, gdt: CudaDType) -> String {
    if dt == gdt {
        dn(dt).to_string()
    } else {
        format!("{}+{}grad", dn(dt), dn(gdt))
    }
}

pub(crate) fn adamw_case(c: &mut Ctx, dt: CudaDType, gdt: CudaDType, n: usize) {
    let dtype = adamw_dtype(dt, gdt);
    let shape = format!("n{n} step 3");
    c.guard("adamw", &dtype, &shape, |c| {
        let d = c.d;
        let h = adamw_hyper();
        let p0 = c.rng.vals(dt, n, -1.0, 1.0);
        let g = c.rng.vals(gdt, n, -1.0, 1.0);
        let m0 = c.rng.vals(F32, n, -0.1, 0.1);
        let v0 = c.rng.vals(F32, n, 0.0, 0.01);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        tpar_kernels::adamw::adamw_step::<f64>(&mut p, &g, &mut m, &mut v, &h)?;
        let (bp, bg, bm, bv) = (d.up(dt, &p0)?, d.up(gdt, &g)?, d.up(F32, &m0)?, d.up(F32, &v0)?);
        // SAFETY: four buffers of `n` elements allocated above.
        unsafe {
            adamw::adamw_step(d.l(), dt, gdt, bp.ptr(), bg.ptr(), bm.ptr(), bv.ptr(), n, &h)?
        };
        c.r.close("adamw.param", &dtype, &shape, &d.down(dt, &bp)?, &p, bound(dt));
        let parts = vec![
            ("exp_avg".to_string(), d.down(F32, &bm)?, m),
            ("exp_avg_sq".to_string(), d.down(F32, &bv)?, v),
        ];
        c.r.close_parts("adamw.moments", &dtype, &shape, &parts, bound(F32));
        // Every operation of the device step is explicitly rounded, in the CPU
        // kernel's order: the same bits as the CPU kernel in the parameters' dtype.
        let cpu = match (dt, gdt) {
            (F32, F32) => Some(cpu_step::<f32>(&p0, &g, &m0, &v0, &h)?),
            (BF16, BF16) => Some(cpu_step::<half::bf16>(&p0, &g, &m0, &v0, &h)?),
            (F16, F16) => Some(cpu_step::<half::f16>(&p0, &g, &m0, &v0, &h)?),
            _ => None,
        };
        if let Some((cp, cm, cv)) = cpu {
            let dev = [d.down(dt, &bp)?, d.down(F32, &bm)?, d.down(F32, &bv)?].concat();
            let host = [cp, cm, cv].concat();
            let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<u64>>();
            c.r.exact("adamw.cpu_bits", &dtype, &shape, &bits(&dev), &bits(&host));
        }
        Ok(())
    });
}

/// The CPU kernel's step in `T` (f32 moments) on the same values, widened back to f64.
fn cpu_step<T: tpar_kernels::Float<Acc = f32>>(
    p: &[f64],
    g: &[f64],
    m: &[f64],
    v: &[f64],
    h: &tpar_kernels::adamw::AdamWParams,
) -> Res<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let mut p: Vec<T> = p.iter().map(|&x| T::from_f64(x)).collect();
    let g: Vec<T> = g.iter().map(|&x| T::from_f64(x)).collect();
    let mut m: Vec<f32> = m.iter().map(|&x| x as f32).collect();
    let mut v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    tpar_kernels::adamw::adamw_step::<T>(&mut p, &g, &mut m, &mut v, h)?;
    let wide = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<f64>>();
    Ok((p.iter().map(|x| x.to_f64()).collect(), wide(&m), wide(&v)))
}

/// `adamw::adamw_step_each` over tensors of `lens` against `adamw::adamw_step` on each
/// alone: parameters and moments, the same bits.
pub(crate) fn adamw_each_case(c: &mut Ctx, dt: CudaDType, gdt: CudaDType, lens: &[usize]) {
    let dtype = adamw_dtype(dt, gdt);
    let shape = format!("{} tensors step 3", lens.len());
    c.guard("adamw", &dtype, &shape, |c| {
        let d = c.d;
        let h = adamw_hyper();
        let (mut alone, mut each, mut grads) = (Vec::new(), Vec::new(), Vec::new());
        for &n in lens {
            let p0 = c.rng.vals(dt, n, -1.0, 1.0);
            let g = c.rng.vals(gdt, n, -1.0, 1.0);
            let m0 = c.rng.vals(F32, n, -0.1, 0.1);
            let v0 = c.rng.vals(F32, n, 0.0, 0.01);
            for set in [&mut alone, &mut each] {
                set.push((d.up(dt, &p0)?, d.up(F32, &m0)?, d.up(F32, &v0)?));
            }
            grads.push(d.up(gdt, &g)?);
        }
        for (((p, m, v), g), &n) in alone.iter().zip(&grads).zip(lens) {
            // SAFETY: four buffers of `n` elements allocated above.
            unsafe {
                adamw::adamw_step(d.l(), dt, gdt, p.ptr(), g.ptr(), m.ptr(), v.ptr(), n, &h)?
            };
        }
        let bufs: Vec<adamw::AdamwBuffers> = each
            .iter()
            .zip(&grads)
            .zip(lens)
            .map(|(((p, m, v), g), &n)| adamw::AdamwBuffers {
                param: p.ptr(),
                grad: g.ptr(),
                exp_avg: m.ptr(),
                exp_avg_sq: v.ptr(),
                n,
            })
            .collect();
        // SAFETY: every tensor's four buffers were allocated above with its elements.
        unsafe { adamw::adamw_step_each(d.l(), dt, gdt, &bufs, &h)? };
        let bits = |sets: &[(DeviceBuffer, DeviceBuffer, DeviceBuffer)]| -> Res<Vec<u64>> {
            let mut out = Vec::new();
            for (p, m, v) in sets {
                for (t, b) in [(dt, p), (F32, m), (F32, v)] {
                    out.extend(d.down(t, b)?.iter().map(|x| x.to_bits()));
                }
            }
            Ok(out)
        };
        c.r.exact("adamw.each", &dtype, &shape, &bits(&each)?, &bits(&alone)?);
        Ok(())
    });
}
