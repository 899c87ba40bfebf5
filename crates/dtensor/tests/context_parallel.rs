//! Context-parallel attention: each rank's output rows and its dq/dk/dv equal the
//! unsharded causal attention's rows (f64, 1e-10) at cp 2, 3 (uneven and empty chunks)
//! and 4, for the all-gather and ring methods, with and without key-padding masks and
//! grouped-query heads; the load-balanced layout against an independent reference and its
//! balance; planted bugs (a swapped log-sum-exp merge, an unbalanced order) are caught;
//! dropout of each rank's rows equals the unsharded dropout, bit for bit.

use std::time::Duration;

use tpar_collectives::{spawn_scoped, SpawnConfig};
use tpar_dtensor::context_parallel::CpFault;
use tpar_dtensor::{context_parallel_attention, ContextParallel, CpLayout, CpMethod, DTensorError};
use tpar_tensor::{DType, Device, Rng, Tensor};

type TResult<T> = Result<T, DTensorError>;

const TOL: f64 = 1e-10;

/// One test case: sizes and switches.
#[derive(Clone, Copy, Debug)]
struct Case {
    cp: usize,
    seq: usize,
    hq: usize,
    hkv: usize,
    pad: bool,
    method: CpMethod,
    balanced: bool,
    fault: Option<CpFault>,
}

/// The full inputs, the reference output and gradients of `sum(out * w)`.
struct Reference {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor,
    mask: Option<Tensor>,
    out: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
}

fn reference(c: &Case) -> Reference {
    let (b, d) = (2, 4);
    let mut rng = Rng::new(11 + c.seq as u64 * 7 + c.hkv as u64);
    let q = Tensor::randn([b, c.hq, c.seq, d], DType::F64, &mut rng).unwrap();
    let k = Tensor::randn([b, c.hkv, c.seq, d], DType::F64, &mut rng).unwrap();
    let v = Tensor::randn([b, c.hkv, c.seq, d], DType::F64, &mut rng).unwrap();
    let w = Tensor::randn([b, c.hq, c.seq, d], DType::F64, &mut rng).unwrap();
    // Batch 1 pads its first two keys (so its first rows see nothing) and a key near the
    // middle, which falls in another rank's chunk than most of its queries.
    let mask = c.pad.then(|| {
        let m: Vec<f64> = (0..b * c.seq)
            .map(|i| {
                let (bi, j) = (i / c.seq, i % c.seq);
                if bi == 1 && (j < 2 || j == c.seq / 2) {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Tensor::from_vec(m, [b, 1, 1, c.seq]).unwrap()
    });
    let (ql, kl, vl) = (
        q.detach().requires_grad_(true),
        k.detach().requires_grad_(true),
        v.detach().requires_grad_(true),
    );
    let out =
        Tensor::scaled_dot_product_attention(&ql, &kl, &vl, mask.as_ref(), true, None).unwrap();
    out.mul(&w)
        .unwrap()
        .sum(-1, false)
        .unwrap()
        .sum(-1, false)
        .unwrap()
        .sum(-1, false)
        .unwrap()
        .sum(-1, false)
        .unwrap()
        .backward()
        .unwrap();
    Reference {
        out: out.detach(),
        dq: ql.grad().unwrap(),
        dk: kl.grad().unwrap(),
        dv: vl.grad().unwrap(),
        q,
        k,
        v,
        w,
        mask,
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Runs the case on `cp` rank threads; returns each rank's largest differences from the
/// reference (out, dq, dk, dv).
fn run(c: Case) -> Vec<[f64; 4]> {
    let r = reference(&c);
    let cfg = SpawnConfig::new(c.cp).timeout(Duration::from_secs(30));
    spawn_scoped(cfg, |ctx| -> TResult<[f64; 4]> {
        let g = ctx.world_group();
        let rank = g.rank();
        let layout = if c.balanced {
            CpLayout::new(c.seq, c.cp)?
        } else {
            CpLayout::contiguous(c.seq, c.cp)?
        };
        let mut cpa = ContextParallel::new(&g, layout, c.method)?;
        if let Some(f) = c.fault {
            cpa = cpa.with_fault(f);
        }
        let sh = |t: &Tensor| layout.shard(t, 2, rank);
        let q = sh(&r.q)?.detach().requires_grad_(true);
        let k = sh(&r.k)?.detach().requires_grad_(true);
        let v = sh(&r.v)?.detach().requires_grad_(true);
        let mask = match &r.mask {
            Some(m) => Some(layout.shard(m, 3, rank)?),
            None => None,
        };
        let out = context_parallel_attention(&q, &k, &v, mask.as_ref(), &cpa)?;
        let loss = out.mul(&sh(&r.w)?)?;
        let loss = loss.sum(-1, false)?.sum(-1, false)?.sum(-1, false)?.sum(-1, false)?;
        loss.backward()?;
        // The gathered output equals the reference too (unshard puts chunks in order).
        let full = layout.unshard(&out, 2, &g)?;
        Ok([
            max_diff(&out, &sh(&r.out)?).max(max_diff(&full, &r.out)),
            max_diff(&q.grad().unwrap(), &sh(&r.dq)?),
            max_diff(&k.grad().unwrap(), &sh(&r.dk)?),
            max_diff(&v.grad().unwrap(), &sh(&r.dv)?),
        ])
    })
    .unwrap_or_else(|e| panic!("{c:?}: {e}"))
}

fn case(cp: usize, seq: usize, hq: usize, hkv: usize, pad: bool, method: CpMethod) -> Case {
    Case { cp, seq, hq, hkv, pad, method, balanced: true, fault: None }
}

fn check(c: Case) {
    for (rank, d) in run(c).iter().enumerate() {
        for (what, x) in ["out", "dq", "dk", "dv"].iter().zip(d) {
            assert!(*x <= TOL, "{c:?}: rank {rank} {what} differs by {x}");
        }
    }
}

fn all_variants(cp: usize, seq: usize) {
    for method in [CpMethod::AllGather, CpMethod::Ring] {
        for pad in [false, true] {
            check(case(cp, seq, 2, 2, pad, method));
            check(case(cp, seq, 4, 2, pad, method));
        }
    }
}

#[test]
fn cp2_equals_unsharded() {
    all_variants(2, 12);
    all_variants(2, 9);
}

#[test]
fn cp3_uneven_equals_unsharded() {
    // 13 = chunks of 3,3,3,3,1,0; 7 = 2,2,2,1,0,0 (ranks with an empty tail chunk).
    all_variants(3, 13);
    all_variants(3, 7);
}

#[test]
fn cp4_equals_unsharded() {
    all_variants(4, 19);
    // GQA with one kv head.
    check(case(4, 16, 4, 1, true, CpMethod::Ring));
}

#[test]
fn contiguous_layout_equals_unsharded() {
    for method in [CpMethod::AllGather, CpMethod::Ring] {
        let c = Case { balanced: false, ..case(3, 11, 4, 2, true, method) };
        check(c);
    }
}

#[test]
fn swapped_merge_terms_are_caught() {
    for method in [CpMethod::AllGather, CpMethod::Ring] {
        let c = Case { fault: Some(CpFault::SwapMergeTerms), ..case(2, 12, 2, 2, false, method) };
        let worst = run(c).iter().map(|d| d[0]).fold(0.0, f64::max);
        assert!(worst > 1e-3, "{c:?}: a swapped merge went unnoticed (max diff {worst})");
    }
}

/// The chunk ids and positions of the balanced layout, from an independent description:
/// chunk `c` of `2 cp` covers `[c * ceil(n / 2cp), ...)`, rank `r` holds `r` then `2cp-1-r`.
#[test]
fn balanced_layout_matches_reference() {
    for (n, cp) in [(12, 2), (13, 3), (7, 3), (19, 4), (3, 4), (0, 2)] {
        let l = CpLayout::new(n, cp).unwrap();
        let chunk = n.div_ceil(2 * cp);
        let mut seen = vec![0usize; n];
        for r in 0..cp {
            let mut want = Vec::new();
            for c in [r, 2 * cp - 1 - r] {
                let lo = (c * chunk).min(n);
                let hi = ((c + 1) * chunk).min(n);
                want.extend(lo..hi);
            }
            assert_eq!(l.chunk_ids(r), vec![r, 2 * cp - 1 - r]);
            assert_eq!(l.positions(r), want, "n {n} cp {cp} rank {r}");
            assert_eq!(l.local_len(r), want.len());
            for p in want {
                seen[p] += 1;
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "n {n} cp {cp}: positions not a partition");
    }
}

/// Causal work per rank (visible (query, key) pairs): equal under the balanced layout when
/// chunks divide evenly; an unbalanced order fails the same check.
#[test]
fn balanced_layout_balances_causal_work() {
    let work = |pos: Vec<usize>| pos.iter().map(|&p| p + 1).sum::<usize>();
    let spread = |l: CpLayout| {
        let w: Vec<usize> = (0..l.cp()).map(|r| work(l.positions(r))).collect();
        (*w.iter().max().unwrap(), *w.iter().min().unwrap())
    };
    for cp in [2, 3, 4] {
        let (hi, lo) = spread(CpLayout::new(8 * cp, cp).unwrap());
        assert_eq!(hi, lo, "cp {cp}: balanced layout's work differs between ranks");
        let (hi, lo) = spread(CpLayout::contiguous(8 * cp, cp).unwrap());
        assert!(hi > 2 * lo, "cp {cp}: the contiguous order should be visibly unbalanced");
    }
}

#[test]
fn unshard_inverts_shard() {
    let cfg = SpawnConfig::new(3).timeout(Duration::from_secs(20));
    spawn_scoped(cfg, |ctx| -> TResult<()> {
        let g = ctx.world_group();
        let full = Tensor::arange(2 * 13, DType::F64).reshape([2, 13])?;
        for l in [CpLayout::new(13, 3)?, CpLayout::contiguous(13, 3)?] {
            let local = l.shard(&full, 1, g.rank())?;
            let back = l.unshard(&local, 1, &g)?;
            assert_eq!(back.to_vec::<f64>()?, full.to_vec::<f64>()?);
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn bad_inputs_are_typed_errors() {
    let cfg = SpawnConfig::new(2).timeout(Duration::from_secs(20));
    let errs = spawn_scoped(cfg, |ctx| -> TResult<Vec<String>> {
        let g = ctx.world_group();
        let mut errs = Vec::new();
        errs.push(
            ContextParallel::new(&g, CpLayout::new(8, 3)?, CpMethod::Ring).unwrap_err().to_string(),
        );
        let cpa = ContextParallel::new(&g, CpLayout::new(8, 2)?, CpMethod::Ring)?;
        let q = Tensor::zeros([1, 2, 3, 4], DType::F64, Device::Cpu)?;
        errs.push(context_parallel_attention(&q, &q, &q, None, &cpa).unwrap_err().to_string());
        let q = Tensor::zeros([1, 2, 4, 4], DType::F64, Device::Cpu)?;
        let m = Tensor::zeros([1, 5], DType::F64, Device::Cpu)?;
        errs.push(context_parallel_attention(&q, &q, &q, Some(&m), &cpa).unwrap_err().to_string());
        errs.push(CpLayout::new(8, 0).unwrap_err().to_string());
        Ok(errs)
    })
    .unwrap();
    let e = &errs[0];
    assert!(e[0].contains("group of 2"), "{}", e[0]);
    assert!(e[1].contains("expected [batch, heads, 4"), "{}", e[1]);
    assert!(e[2].contains("key mask"), "{}", e[2]);
    assert!(e[3].contains("at least one rank"), "{}", e[3]);
}

/// The collectives each method issues, forward and backward, as documented.
#[test]
fn collectives_per_method() {
    use tpar_collectives::CollectiveKind::{AllGather, Recv, ReduceScatter, Send};
    let cp = 3;
    let cfg = SpawnConfig::new(cp).timeout(Duration::from_secs(20));
    let counts = spawn_scoped(cfg, |ctx| -> TResult<Vec<[usize; 4]>> {
        let g = ctx.world_group();
        let layout = CpLayout::new(13, cp)?;
        let mut counts = Vec::new();
        for method in [CpMethod::AllGather, CpMethod::Ring] {
            let cpa = ContextParallel::new(&g, layout, method)?;
            let mut rng = Rng::new(5);
            let n = layout.local_len(g.rank());
            let q = Tensor::randn([1, 2, n, 4], DType::F64, &mut rng)?.requires_grad_(true);
            let dbg = g.comm_debug();
            dbg.enable();
            let out = context_parallel_attention(&q, &q, &q, None, &cpa)?;
            let fwd =
                [dbg.count(AllGather), dbg.count(ReduceScatter), dbg.count(Send), dbg.count(Recv)];
            dbg.clear();
            out.sum(-1, false)?.sum(-1, false)?.sum(-1, false)?.sum(-1, false)?.backward()?;
            let bwd =
                [dbg.count(AllGather), dbg.count(ReduceScatter), dbg.count(Send), dbg.count(Recv)];
            dbg.disable();
            dbg.clear();
            counts.push(fwd);
            counts.push(bwd);
        }
        Ok(counts)
    })
    .unwrap();
    for c in counts {
        // all-gather forward, backward; ring forward, backward (per rank).
        assert_eq!(c[0], [2, 0, 0, 0]);
        assert_eq!(c[1], [2, 2, 0, 0]);
        assert_eq!(c[2], [0, 0, 2 * (cp - 1), 2 * (cp - 1)]);
        assert_eq!(c[3], [0, 0, 2 * (cp - 1) + 2 * cp, 2 * (cp - 1) + 2 * cp]);
    }
}

/// Dropout of each cp rank's rows (`ContextParallel::dropout`) equals the unsharded
/// tensor's dropout at those rows, forward and gradient, bit for bit, and leaves every
/// rank's generator where the unsharded dropout leaves it: cp 2, 3 and 4 over a sequence
/// of 13 (uneven and empty chunks), balanced and contiguous layouts. A plain dropout of
/// each rank's rows draws another mask.
#[test]
fn cp_dropout_equals_unsharded() {
    use tpar_tensor::{get_rng_state, manual_seed};
    for cp in [2, 3, 4] {
        let cfg = SpawnConfig::new(cp).timeout(Duration::from_secs(20));
        spawn_scoped(cfg, move |ctx| -> TResult<()> {
            let g = ctx.world_group();
            let me = g.rank();
            let dims = [2usize, 13, 5];
            let x = Tensor::randn(dims, DType::F64, &mut Rng::new(3))?;
            let gy = Tensor::randn(dims, DType::F64, &mut Rng::new(4))?;
            // the unsharded reference
            let xr = x.detach().requires_grad_(true);
            manual_seed(9);
            let yr = xr.dropout(0.3, true)?;
            yr.backward_with(&gy)?;
            let after = get_rng_state();
            for l in [CpLayout::new(13, cp)?, CpLayout::contiguous(13, cp)?] {
                let what = format!("cp {cp} balanced {} rank {me}", l.is_balanced());
                let cpx = ContextParallel::new(&g, l, CpMethod::Ring)?;
                let local = l.shard(&x, 1, me)?.requires_grad_(true);
                manual_seed(9);
                let y = cpx.dropout(&local, 1, 0.3, true)?;
                assert_eq!(get_rng_state(), after, "{what}: the generator");
                y.backward_with(&l.shard(&gy, 1, me)?)?;
                let bits = |t: &Tensor| -> TResult<Vec<u64>> {
                    Ok(t.to_vec::<f64>()?.iter().map(|v| v.to_bits()).collect())
                };
                assert_eq!(bits(&y)?, bits(&l.shard(&yr, 1, me)?)?, "{what}: output");
                let (gl, gr) = (local.grad().unwrap(), l.shard(&xr.grad().unwrap(), 1, me)?);
                assert_eq!(bits(&gl)?, bits(&gr)?, "{what}: gradient");
                // every rank's rows together are the unsharded output
                let whole = l.unshard(&y, 1, &g)?;
                assert_eq!(bits(&whole)?, bits(&yr)?, "{what}: gathered");
                // a plain dropout of the rank's rows draws by its own positions: another
                // mask on every rank that does not start the sequence
                manual_seed(9);
                let plain = local.dropout(0.3, true)?;
                if l.ranges(me)[0].0 != 0 {
                    assert_ne!(bits(&plain)?, bits(&y)?, "{what}: plain dropout");
                }
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn cp_dropout_refuses_rows_of_another_rank() {
    let l = CpLayout::new(13, 3).unwrap();
    let x = Tensor::zeros([2, 4, 5], DType::F64, Device::Cpu).unwrap();
    // rank 0 holds chunks 0 and 5 of 6 (3 and 0 rows); rank 3 is outside the group
    for (rank, dim) in [(0, 1), (3, 1), (1, 3)] {
        match l.dropout(&x, dim, rank, 0.5, true) {
            Err(DTensorError::InvalidArgument { what, .. }) => {
                assert!(what.contains("rank"), "{what}")
            }
            other => panic!("rank {rank} dim {dim}: {other:?}"),
        }
    }
}
