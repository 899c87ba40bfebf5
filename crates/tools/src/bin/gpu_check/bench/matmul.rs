//! The GEMM benchmarks: bf16 TFLOP/s of tpar's kernel (`ops::gemm::ours`,
//! what `TPAR_GEMM=ours` runs) and cuBLASLt on the same buffers, for square
//! products, the Llama-8B projections and every product of the training step
//! of `scripts/gpu-check.sh`, which are also summed as the step spends them.
//! Every measured product goes into the tuning table of `TPAR_GEMM=auto`.
//!
//! Where the device runs the Hopper kernel, every product is timed in each
//! launch configuration of `gemm_tune::HOPPER_CONFIGS`. A product's own row
//! keeps the default configuration's rate as `ours` (so it stays comparable
//! with earlier runs); the square products also get `.c2`, `.n256` and
//! `.n256.c2` rows (2-block clusters with A multicast, 128 x 256 tiles, both)
//! beside the same cuBLASLt time; and every product gets a `.best` row: the
//! fastest configuration's rate, named in the note. The tuning table records
//! that rate as `ours` with the configuration as `hopper=`, so `TPAR_GEMM=auto`
//! both picks the backend and launches tpar's kernel in that configuration.
//! `gemm.step.sum.best` sums the step's products, each in its fastest
//! configuration (at the default's rate where the Hopper kernel refuses it). The
//! fused projections' products (q/k/v and gate/up each as one GEMM, `--fuse-proj`)
//! are timed too, outside the step's sum, so that the table covers them. With
//! `--quick` only the Llama-8B projections are left out (the square products and the
//! step's stay), and each timing trial is shorter. Not measured on a GPU yet.

use tpar_kernels::cuda::cublaslt::CublasLt;
use tpar_kernels::cuda::ops::gemm::ours_with;
use tpar_kernels::cuda::ops::gemm_tune::{
    best_config, GemmKey, GemmRates, GemmTable, HOPPER_CONFIGS,
};
use tpar_kernels::cuda::raw::gemm::GemmProblem;
use tpar_kernels::cuda::raw::gemm_hopper::{
    self, unsupported, Epilogue, HopperConfig, HopperTarget,
};
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::gemm::GemmShape;

use super::{rate, time_per_call_for, Bench};
use crate::checks::gemm::layout_name;
use crate::dev::Dev;

/// One benchmarked product: label, layout (A, B transposed), m, n, k, and how
/// many times one training step runs it (0: not a step product).
struct Product {
    label: &'static str,
    ta: bool,
    tb: bool,
    mnk: [usize; 3],
    per_step: usize,
}

/// The products of one training step of `scripts/gpu-check.sh`'s model (8
/// layers, hidden 1024, 16 query / 8 key-value heads of 64, intermediate
/// 2816, byte vocabulary 259, batch 8 x seq 1024 = 8192 tokens). A linear
/// layer `y = x Wᵀ` with `W` stored `[out, in]` runs forward as NT
/// (`tokens x out x in`), its input gradient as NN (`tokens x in x out`) and
/// its weight gradient as TN (`out x in x tokens`).
fn step_products() -> Vec<Product> {
    const LAYERS: usize = 8;
    // (label, out, in, linears of this shape per step)
    let linears: [(&'static str, usize, usize, usize); 5] = [
        ("q/o", 1024, 1024, 2 * LAYERS),
        ("k/v", 512, 1024, 2 * LAYERS),
        ("gate/up", 2816, 1024, 2 * LAYERS),
        ("down", 1024, 2816, LAYERS),
        ("lm head", 259, 1024, 1),
    ];
    linears
        .into_iter()
        .flat_map(|(label, o, i, count)| linear_products(label, o, i, count))
        .collect()
}

/// The three products of a linear layer `[out, in]` over the step's 8192 tokens
/// (forward NT, input gradient NN, weight gradient TN), `per_step` times a step each.
fn linear_products(label: &'static str, o: usize, i: usize, per_step: usize) -> [Product; 3] {
    const TOKENS: usize = 8 * 1024;
    let row = |ta, tb, mnk| Product { label, ta, tb, mnk, per_step };
    [
        row(false, true, [TOKENS, o, i]),
        row(false, false, [TOKENS, i, o]),
        row(true, false, [o, i, TOKENS]),
    ]
}

/// The products of the step's fused projections (`--fuse-proj`: q, k and v by one
/// GEMM of 16 + 8 + 8 heads of 64 outputs, gate and up by one of 2 x 2816), in the
/// three layouts; not in the step's sum (the unfused step is the one summed).
fn fused_products() -> Vec<Product> {
    [("fused q/k/v", 2048, 1024), ("fused gate/up", 2 * 2816, 1024)]
        .into_iter()
        .flat_map(|(label, o, i)| linear_products(label, o, i, 0))
        .collect()
}

/// The products `gpu_check --bench` times: 4096³ and 8192³ in the three layouts
/// the autograd uses, [`step_products`] and [`fused_products`]; without `quick`
/// also the Llama-8B projections at 8192 tokens (NN and NT).
fn products(quick: bool) -> Vec<Product> {
    let square = |n: usize| {
        [(false, false), (false, true), (true, false)].map(|(ta, tb)| Product {
            label: "square",
            ta,
            tb,
            mnk: [n; 3],
            per_step: 0,
        })
    };
    let mut out: Vec<Product> = square(4096).into();
    out.extend(square(8192));
    out.extend(step_products());
    out.extend(fused_products());
    if quick {
        return out;
    }
    for (label, m, n, k) in [
        ("llama8b q/o proj", 8192, 4096, 4096),
        ("llama8b k/v proj", 8192, 1024, 4096),
        ("llama8b gate/up proj", 8192, 14336, 4096),
        ("llama8b down proj", 8192, 4096, 14336),
    ] {
        for tb in [false, true] {
            out.push(Product { label, ta: false, tb, mnk: [m, n, k], per_step: 0 });
        }
    }
    out
}

/// Seconds of one timing trial of a product ([`time_per_call_for`]): shorter with
/// `quick`, where the products are many and the run is one short command.
fn trial_seconds(quick: bool) -> f64 {
    if quick {
        0.05
    } else {
        0.2
    }
}

/// Times every product of [`products`] on both backends (A and B read from
/// the bf16 buffer at `src`, which must hold the largest operand), tpar's
/// kernel in its default configuration and, where the device runs the Hopper
/// kernel, in every other one too ([`HOPPER_VARIANTS`]); records each product
/// in `table` with tpar's fastest configuration; and adds `gemm.step.sum`:
/// the step's products weighted by how often a step runs them, as total
/// FLOPs over total time, where the cuBLASLt side counts tpar's time for any
/// product cuBLASLt refuses (as the step itself would run it), and where the
/// device runs the Hopper kernel `gemm.step.sum.best`, each product in its
/// fastest configuration (those the Hopper kernel refuses, such as the LM
/// head's gradient products with A of 259-element rows, at tpar's default rate).
pub(super) fn gemm_benches(
    d: &Dev,
    lt: Option<&CublasLt>,
    quick: bool,
    src: DevPtr,
    table: &mut GemmTable,
) -> Vec<Bench> {
    let mut out = Vec::new();
    // (flops, ours seconds, cuBLASLt-or-ours seconds, complete) summed over
    // the step, and the best configurations' seconds (None: not measured)
    let mut step = (0.0f64, 0.0f64, 0.0f64, true);
    let mut step_best = Some(0.0f64);
    let hopper = HopperTarget::of(&*d.mem);
    let trial = trial_seconds(quick);
    for pr in products(quick) {
        let [m, n, k] = pr.mnk;
        let shape = GemmShape { trans_a: pr.ta, trans_b: pr.tb, ..GemmShape::new(1, m, n, k) };
        let p = GemmProblem::new(shape, CudaDType::BF16, CudaDType::BF16);
        let key = format!("gemm.bf16.{}.{m}x{n}x{k}", layout_name(pr.ta, pr.tb));
        let flops = 2.0 * (m * n * k) as f64;
        let label = match pr.per_step {
            0 => pr.label.to_string(),
            c => format!("step {}, x{c}", pr.label),
        };
        let mut b = Bench { key, unit: "TFLOP/s", ours: None, cublaslt: None, note: label };
        let (mut t_ours, mut t_lt) = (None, None);
        match d.alloc(m * n * 2) {
            Ok(cbuf) => {
                let c = cbuf.ptr();
                let run = || {
                    // SAFETY: A and B lie inside the source buffer, C was allocated for m x n.
                    unsafe { ours_with(&*d.mem, &p, HopperConfig::default(), src, src, c)? };
                    Ok(())
                };
                match time_per_call_for(d, trial, run) {
                    Ok(t) => t_ours = Some(t),
                    Err(e) => b.note = format!("{}; ours: {e}", b.note),
                }
                if let Some(lt) = lt {
                    let run = || {
                        // SAFETY: as above, on the GPU cuBLASLt was created on.
                        unsafe { lt.matmul(&p, src, src, c)? };
                        Ok(())
                    };
                    match time_per_call_for(d, trial, run) {
                        Ok(t) => t_lt = Some(t),
                        Err(e) => b.note = format!("{}; cuBLASLt: {e}", b.note),
                    }
                }
            }
            Err(e) => b.note = format!("{}; {e}", b.note),
        }
        b.ours = t_ours.map(|t| rate(flops, t, 1e12));
        b.cublaslt = t_lt.map(|t| rate(flops, t, 1e12));
        // the Hopper kernel's other configurations, where it takes the product
        let target = hopper.filter(|_| unsupported(&p, src, src).is_none());
        let variants: Vec<Bench> = match target {
            Some(t) => HOPPER_VARIANTS
                .iter()
                .map(|&variant| hopper_bench(d, t, variant, &p, src, &b, trial))
                .collect(),
            None => Vec::new(),
        };
        let best = target.and_then(|_| fastest(&b, &variants));
        let best_rate = best.map_or(b.ours, |(_, r)| Some(r));
        if let (Some(o), Some(v)) = (best_rate, b.cublaslt) {
            let hopper = best.map(|(c, _)| c);
            table.insert_rates(GemmKey::of(&p), GemmRates { ours: o, vendor: v, hopper });
        }
        if pr.per_step > 0 {
            let w = pr.per_step as f64;
            match (t_ours, t_lt.or(t_ours)) {
                (Some(o), Some(v)) => {
                    step.0 += w * flops;
                    step.1 += w * o;
                    step.2 += w * v;
                }
                _ => step.3 = false,
            }
            // products the Hopper kernel refuses count at the default's rate
            step_best = match (step_best, best_rate) {
                (Some(t), Some(r)) => Some(t + w * flops / (r * 1e12)),
                _ => None,
            };
        }
        let best_bench = best.map(|(cfg, r)| Bench {
            key: format!("{}.best", b.key),
            unit: "TFLOP/s",
            ours: Some(r),
            cublaslt: b.cublaslt,
            note: format!("hopper kernel, fastest configuration {cfg}"),
        });
        out.push(b);
        if pr.label == "square" {
            out.extend(variants);
        }
        out.extend(best_bench);
    }
    if step.0 > 0.0 {
        let note = if step.3 {
            "the step's products, each weighted by its count".to_string()
        } else {
            "INCOMPLETE: a step product failed".to_string()
        };
        let cublaslt = lt.map(|_| rate(step.0, step.2, 1e12));
        out.push(Bench {
            key: "gemm.step.sum".into(),
            unit: "TFLOP/s",
            ours: Some(rate(step.0, step.1, 1e12)),
            cublaslt,
            note,
        });
        if let Some(t) = step_best.filter(|_| hopper.is_some() && step.3) {
            out.push(Bench {
                key: "gemm.step.sum.best".into(),
                unit: "TFLOP/s",
                ours: Some(rate(step.0, t, 1e12)),
                cublaslt,
                note: "the step's products, each in its fastest hopper configuration".into(),
            });
        }
    }
    out
}

/// The fastest Hopper configuration of a product and its rate: of `base`
/// (the default configuration's row) and `variants` (the rows of
/// [`HOPPER_VARIANTS`], in order: together [`HOPPER_CONFIGS`]'s order), those
/// measured; `None` when none was.
fn fastest(base: &Bench, variants: &[Bench]) -> Option<(HopperConfig, f64)> {
    let rates = std::iter::once(base).chain(variants).map(|b| b.ours);
    let measured: Vec<(HopperConfig, f64)> =
        HOPPER_CONFIGS.into_iter().zip(rates).filter_map(|(c, r)| Some((c, r?))).collect();
    best_config(&measured)
}

/// The Hopper kernel's launch configurations benchmarked beside the default
/// (every product; rows printed for the square ones): row suffix,
/// configuration (the non-default ones of [`HOPPER_CONFIGS`], in its order),
/// note.
const HOPPER_VARIANTS: [(&str, HopperConfig, &str); 3] = [
    ("c2", HOPPER_CONFIGS[1], "hopper kernel, 2-block clusters (A multicast)"),
    ("n256", HOPPER_CONFIGS[2], "hopper kernel, 128 x 256 tiles"),
    (
        "n256.c2",
        HOPPER_CONFIGS[3],
        "hopper kernel, 128 x 256 tiles, 2-block clusters (A multicast)",
    ),
];

/// The `.<suffix>` row of `base` (a square product's row): the Hopper
/// kernel launched with `cfg` on the same operands, beside `base`'s
/// cuBLASLt rate.
fn hopper_bench(
    d: &Dev,
    t: HopperTarget,
    (suffix, cfg, note): (&str, HopperConfig, &str),
    p: &GemmProblem,
    src: DevPtr,
    base: &Bench,
    trial: f64,
) -> Bench {
    let s = p.shape;
    let flops = 2.0 * (s.m * s.n * s.k) as f64;
    let mut b = Bench {
        key: format!("{}.{suffix}", base.key),
        unit: "TFLOP/s",
        ours: None,
        cublaslt: base.cublaslt,
        note: note.to_string(),
    };
    match d.alloc(s.m * s.n * 2) {
        Ok(cbuf) => {
            let c = cbuf.ptr();
            let run = || {
                // SAFETY: A and B lie inside the source buffer, C was allocated for m x n.
                unsafe {
                    gemm_hopper::gemm_with(d.l(), t, cfg, p, &Epilogue::default(), src, src, c)?
                };
                Ok(())
            };
            match time_per_call_for(d, trial, run) {
                Ok(secs) => b.ours = Some(rate(flops, secs, 1e12)),
                Err(e) => b.note = format!("{}; {e}", b.note),
            }
        }
        Err(e) => b.note = format!("{}; {e}", b.note),
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_products_are_every_linear_in_three_layouts() {
        let s = step_products();
        assert_eq!(s.len(), 15);
        // Per step: 8 layers x 7 linears + the LM head, each forward and two backward.
        assert_eq!(s.iter().map(|p| p.per_step).sum::<usize>(), 3 * (8 * 7 + 1));
        // A linear's three products contract over in, out and tokens.
        for t in s.chunks(3) {
            let [f, dx, dw] = [&t[0], &t[1], &t[2]];
            assert_eq!(
                (f.ta, f.tb, dx.ta, dx.tb, dw.ta, dw.tb),
                (false, true, false, false, true, false)
            );
            assert_eq!(f.mnk, [dx.mnk[0], dw.mnk[0], dx.mnk[1]]);
            assert_eq!(dw.mnk, [f.mnk[1], f.mnk[2], f.mnk[0]]);
        }
        // Every product fits the 8192 x 14336 bf16 source buffer.
        for p in products(false) {
            let [m, n, k] = p.mnk;
            assert!(m * k <= 8192 * 14336 && k * n <= 8192 * 14336, "{:?}", p.mnk);
        }
        // Quick keeps the square products, the step's and the fused ones; only the
        // Llama-8B projections are left out.
        let quick = products(true);
        assert_eq!(quick.len(), 3 + 3 + 15 + 6);
        assert_eq!(quick.iter().filter(|p| p.per_step > 0).count(), 15);
        assert_eq!(products(false).len(), quick.len() + 8);
        assert!(fused_products().iter().all(|p| p.per_step == 0));
    }

    #[test]
    fn the_hopper_variants_are_valid_distinct_launches() {
        let mut seen = Vec::new();
        for (suffix, cfg, _) in HOPPER_VARIANTS {
            let checked = HopperConfig::with_cluster(cfg.cluster)
                .and_then(|c| c.with_tile_n(cfg.tile_n))
                .unwrap_or_else(|e| panic!("{suffix}: {e}"));
            assert_eq!(checked, cfg, "{suffix}");
            assert_ne!(cfg, HopperConfig::default(), "{suffix} repeats the default row");
            assert_eq!(suffix.contains("n256"), cfg.tile_n == 256, "{suffix}");
            assert_eq!(suffix.contains("c2"), cfg.cluster == 2, "{suffix}");
            assert!(!seen.contains(&cfg), "{suffix} repeats a row");
            seen.push(cfg);
        }
        // with the default: every configuration the table may record
        seen.push(HopperConfig::default());
        for cfg in HOPPER_CONFIGS {
            assert!(seen.contains(&cfg), "{cfg} is never timed");
        }
        assert_eq!(seen.len(), HOPPER_CONFIGS.len());
    }

    #[test]
    fn the_fastest_measured_configuration_is_picked() {
        let row = |ours| Bench {
            key: "k".into(),
            unit: "TFLOP/s",
            ours,
            cublaslt: None,
            note: "".into(),
        };
        let [c2, n256, n256c2] = HOPPER_VARIANTS.map(|v| v.1);
        let base = row(Some(500.0));
        let variants = [row(Some(520.0)), row(Some(610.0)), row(None)];
        assert_eq!(fastest(&base, &variants), Some((n256, 610.0)));
        let slower = [row(Some(400.0)), row(None), row(Some(499.0))];
        assert_eq!(fastest(&base, &slower), Some((HopperConfig::default(), 500.0)));
        let only_last = [row(None), row(None), row(Some(1.0))];
        assert_eq!(fastest(&row(None), &only_last), Some((n256c2, 1.0)));
        assert_eq!(fastest(&row(Some(2.0)), &[row(Some(3.0))]), Some((c2, 3.0)));
        assert_eq!(fastest(&row(None), &[]), None);
    }
}
