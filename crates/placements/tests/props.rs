//! Property tests: shard arithmetic tiles the tensor, and every plan, run on
//! the reference simulator, turns a `src` layout into the `dst` layout.

use std::collections::HashMap;

use proptest::prelude::*;
use tpar_placements::simulate::{
    assemble, coord_of, execute, execute_step, expected_local, layout, Array, Locals,
};
use tpar_placements::{
    local_shape_and_offset, naive_plan, normalize_placements, plan, Placement, Plan, ReduceOp,
    StepKind,
};
use Placement::*;

const TOL: f64 = 1e-9;
const ELEM: usize = 4;

#[derive(Clone, Debug)]
struct Case {
    mesh: Vec<usize>,
    shape: Vec<usize>,
    src: Vec<Placement>,
    dst: Vec<Placement>,
    seed: u64,
}

fn op() -> impl Strategy<Value = ReduceOp> {
    proptest::sample::select(ReduceOp::PARTIAL.to_vec())
}

fn placement(rank: usize) -> impl Strategy<Value = Placement> {
    let r = rank as isize;
    prop_oneof![
        3 => (-r..r).prop_map(Shard),
        1 => Just(Replicate),
        1 => op().prop_map(Partial),
    ]
}

/// Makes the partial ops of a source list commute (see the crate docs): a
/// layout of non-commuting partials has no order-independent value.
fn commuting(mut list: Vec<Placement>) -> Vec<Placement> {
    let Some(first) = list.iter().find_map(|p| p.partial_op()) else {
        return list;
    };
    for p in &mut list {
        if let Partial(op) = *p {
            if !op.commutes_with(first) {
                *p = Partial(first);
            }
        }
    }
    list
}

fn case() -> impl Strategy<Value = Case> {
    (proptest::collection::vec(1usize..=4, 1..=3), proptest::collection::vec(0usize..=7, 1..=3))
        .prop_flat_map(|(mesh, shape)| {
            let (n, r) = (mesh.len(), shape.len());
            (
                Just(mesh),
                Just(shape),
                proptest::collection::vec(placement(r), n),
                proptest::collection::vec(placement(r), n),
                any::<u64>(),
            )
        })
        .prop_map(|(mesh, shape, src, dst, seed)| Case {
            mesh,
            shape,
            src: commuting(src),
            dst,
            seed,
        })
}

fn world(mesh: &[usize]) -> usize {
    mesh.iter().product()
}

/// Every rank's local shape is the one `local_shape_and_offset` gives.
fn check_shapes(
    locals: &Locals,
    shape: &[usize],
    placements: &[Placement],
    what: &str,
) -> Result<(), TestCaseError> {
    for (r, a) in locals.ranks.iter().enumerate() {
        let coord = coord_of(&locals.mesh_shape, r);
        let (want, _) =
            local_shape_and_offset(shape, &locals.mesh_shape, &coord, placements).unwrap();
        prop_assert_eq!(a.shape(), &want[..], "{}: rank {:?} under {:?}", what, coord, placements);
    }
    Ok(())
}

/// The locals hold `global` laid out as `placements`: exact slices when there
/// is no partial, otherwise the right shapes and the right reduction.
fn check_layout(
    locals: &Locals,
    global: &Array,
    placements: &[Placement],
    what: &str,
) -> Result<(), TestCaseError> {
    check_shapes(locals, global.shape(), placements, what)?;
    if placements.iter().any(|p| p.is_partial()) {
        let got = assemble(locals, placements).unwrap();
        prop_assert!(
            got.approx_eq(global, TOL),
            "{}: assembled {:?}, want {:?}",
            what,
            got,
            global
        );
    } else {
        for (r, a) in locals.ranks.iter().enumerate() {
            let coord = coord_of(&locals.mesh_shape, r);
            let want = expected_local(global, &locals.mesh_shape, &coord, placements).unwrap();
            prop_assert!(
                a.approx_eq(&want, TOL),
                "{}: rank {:?} holds {:?}, want {:?}",
                what,
                coord,
                a,
                want
            );
        }
    }
    Ok(())
}

/// Steps chain `src` to `dst`, each changing only its mesh dim as its kind says.
fn check_structure(p: &Plan) -> Result<(), TestCaseError> {
    let mut cur = p.src.clone();
    for s in &p.steps {
        prop_assert_eq!(&s.before, &cur);
        prop_assert_eq!(s.after[s.mesh_dim], s.kind.result_placement());
        for m in 0..cur.len() {
            if m != s.mesh_dim {
                prop_assert_eq!(s.before[m], s.after[m]);
            }
        }
        let ok = matches!(
            (s.before[s.mesh_dim], s.kind),
            (Shard(d), StepKind::AllGather { tensor_dim }) if d as usize == tensor_dim
        ) || matches!(
            (s.before[s.mesh_dim], s.kind),
            (Shard(d), StepKind::AllToAll { from_dim, .. }) if d as usize == from_dim
        ) || matches!(
            (s.before[s.mesh_dim], s.kind),
            (Partial(a), StepKind::AllReduce { op } | StepKind::ReduceScatter { op, .. }) if a == op
        ) || matches!(
            (s.before[s.mesh_dim], s.kind),
            (Replicate, StepKind::LocalSlice { .. } | StepKind::Partialize { .. })
        ) || matches!(
            (s.before[s.mesh_dim], s.kind),
            (Shard(d), StepKind::ZeroPad { tensor_dim }) if d as usize == tensor_dim
        );
        prop_assert!(ok, "step {} does not fit its placements", s);
        if !s.kind.is_collective() {
            prop_assert_eq!(s.bytes, 0);
        }
        cur = s.after.clone();
    }
    prop_assert_eq!(&cur, &p.dst);
    Ok(())
}

/// Runs `p` step by step from `locals`, checking shapes after every step.
fn run_checked(p: &Plan, mut locals: Locals, shape: &[usize]) -> Result<Locals, TestCaseError> {
    for s in &p.steps {
        locals = execute_step(s, locals).unwrap();
        check_shapes(&locals, shape, &s.after, &format!("after {s}"))?;
    }
    Ok(locals)
}

/// 128 cases, or `PROPTEST_CASES` when set (for longer local runs).
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128);
    ProptestConfig::with_cases(cases)
}

proptest! {
    #![proptest_config(config())]

    /// (a) Within every group of ranks that differ only in sharded mesh dims,
    /// the local boxes are disjoint and cover the global tensor.
    #[test]
    fn local_shards_tile_the_tensor(c in case()) {
        let placements = normalize_placements(&c.dst, c.shape.len()).unwrap();
        let total: usize = c.shape.iter().product();
        let mut cover: HashMap<Vec<usize>, Vec<u32>> = HashMap::new();
        for r in 0..world(&c.mesh) {
            let coord = coord_of(&c.mesh, r);
            let (shape, offset) = local_shape_and_offset(&c.shape, &c.mesh, &coord, &c.dst).unwrap();
            for d in 0..shape.len() {
                prop_assert!(offset[d] + shape[d] <= c.shape[d]);
            }
            let key: Vec<usize> = (0..c.mesh.len())
                .map(|i| if placements[i].is_shard() { usize::MAX } else { coord[i] })
                .collect();
            let counts = cover.entry(key).or_insert_with(|| vec![0; total]);
            // Walk the box in row-major order of the global tensor.
            let n: usize = shape.iter().product();
            for flat in 0..n {
                let mut rem = flat;
                let mut idx = 0;
                for d in (0..shape.len()).rev() {
                    let i = rem % shape[d] + offset[d];
                    rem /= shape[d];
                    let stride: usize = c.shape[d + 1..].iter().product();
                    idx += i * stride;
                }
                counts[idx] += 1;
            }
        }
        for (key, counts) in cover {
            prop_assert!(counts.iter().all(|&k| k == 1), "group {:?}: coverage {:?}", key, counts);
        }
    }

    /// (b) Running the plan on the simulator yields the dst layout, with the
    /// planned shape after every step; the plan is well-formed.
    #[test]
    fn plan_redistributes(c in case()) {
        let global = Array::iota(&c.shape);
        let locals = layout(&global, &c.mesh, &c.src, c.seed).unwrap();
        check_layout(&locals, &global, &c.src, "layout")?;
        let p = plan(&c.mesh, &c.shape, ELEM, &c.src, &c.dst).unwrap();
        check_structure(&p)?;
        let out = run_checked(&p, locals.clone(), &c.shape)?;
        check_layout(&out, &global, &c.dst, &format!("plan\n{}", p.explain()))?;
        prop_assert_eq!(execute(&p, locals).unwrap(), out);
        if p.src == p.dst {
            prop_assert!(p.is_empty());
        }
    }

    /// (c) src -> dst -> src gives back the src layout (the same local data
    /// when src has no partial).
    #[test]
    fn round_trip(c in case()) {
        let global = Array::iota(&c.shape);
        let locals = layout(&global, &c.mesh, &c.src, c.seed).unwrap();
        let there = plan(&c.mesh, &c.shape, ELEM, &c.src, &c.dst).unwrap();
        let back = plan(&c.mesh, &c.shape, ELEM, &c.dst, &c.src).unwrap();
        let out = execute(&back, execute(&there, locals.clone()).unwrap()).unwrap();
        check_layout(&out, &global, &c.src, "round trip")?;
        if !c.src.iter().any(|p| p.is_partial()) {
            for (a, b) in out.ranks.iter().zip(&locals.ranks) {
                prop_assert!(a.approx_eq(b, TOL));
            }
        }
    }

    /// (d) The planner never moves more bytes than the naive plan, per mesh
    /// dim, and the naive plan is itself correct.
    #[test]
    fn planner_beats_naive(c in case()) {
        let p = plan(&c.mesh, &c.shape, ELEM, &c.src, &c.dst).unwrap();
        let naive = naive_plan(&c.mesh, &c.shape, ELEM, &c.src, &c.dst).unwrap();
        check_structure(&naive)?;
        prop_assert!(
            p.total_bytes() <= naive.total_bytes(),
            "plan\n{}\nnaive\n{}", p.explain(), naive.explain()
        );
        for (a, b) in p.bytes_per_mesh_dim().iter().zip(naive.bytes_per_mesh_dim()) {
            prop_assert!(*a <= b, "plan\n{}\nnaive\n{}", p.explain(), naive.explain());
        }
        let global = Array::iota(&c.shape);
        let locals = layout(&global, &c.mesh, &c.src, c.seed).unwrap();
        let out = run_checked(&naive, locals, &c.shape)?;
        check_layout(&out, &global, &c.dst, "naive")?;
    }
}

fn kinds(p: &Plan) -> Vec<(usize, StepKind)> {
    p.steps.iter().map(|s| (s.mesh_dim, s.kind)).collect()
}

/// Plans and simulates one case; returns the plan.
fn simulate_case(mesh: &[usize], shape: &[usize], src: &[Placement], dst: &[Placement]) -> Plan {
    let global = Array::iota(shape);
    let p = plan(mesh, shape, ELEM, src, dst).unwrap();
    let out = execute(&p, layout(&global, mesh, src, 11).unwrap()).unwrap();
    let dst = normalize_placements(dst, shape.len()).unwrap();
    if dst.iter().any(|p| p.is_partial()) {
        assert!(assemble(&out, &dst).unwrap().approx_eq(&global, TOL));
    } else {
        for (r, a) in out.ranks.iter().enumerate() {
            let want = expected_local(&global, mesh, &coord_of(mesh, r), &dst).unwrap();
            assert!(a.approx_eq(&want, TOL), "{}", p.explain());
        }
    }
    p
}

#[test]
fn partial_to_shard_on_1d_is_one_reduce_scatter() {
    for op in ReduceOp::PARTIAL {
        for (n, d) in [(7, 0), (5, 1), (2, -1)] {
            let p = simulate_case(&[3], &[n, 5], &[Partial(op)], &[Shard(d)]);
            let d = if d < 0 { 1 } else { d as usize };
            assert_eq!(
                kinds(&p),
                [(0, StepKind::ReduceScatter { op, tensor_dim: d })],
                "{}",
                p.explain()
            );
        }
    }
}

#[test]
fn shard_to_shard_on_1d_is_one_all_to_all() {
    for (k, shape) in [(2, [6, 4]), (3, [7, 5]), (4, [8, 8])] {
        let p = simulate_case(&[k], &shape, &[Shard(0)], &[Shard(1)]);
        assert_eq!(
            kinds(&p),
            [(0, StepKind::AllToAll { from_dim: 0, to_dim: 1 })],
            "{}",
            p.explain()
        );
        let p = simulate_case(&[k], &shape, &[Shard(1)], &[Shard(0)]);
        assert_eq!(
            kinds(&p),
            [(0, StepKind::AllToAll { from_dim: 1, to_dim: 0 })],
            "{}",
            p.explain()
        );
    }
}

#[test]
fn nested_shards_to_inner_shard() {
    let p = simulate_case(&[2, 2], &[9, 3], &[Shard(0), Shard(0)], &[Replicate, Shard(0)]);
    assert_eq!(
        kinds(&p),
        [
            (1, StepKind::AllGather { tensor_dim: 0 }),
            (0, StepKind::AllGather { tensor_dim: 0 }),
            (1, StepKind::LocalSlice { tensor_dim: 0 }),
        ]
    );
    assert_eq!(
        p.explain(),
        "S(0)S(0) -> S(0)R (all_gather on mesh dim 1, tensor dim 0, 24 B)\n\
         S(0)R -> RR (all_gather on mesh dim 0, tensor dim 0, 48 B)\n\
         RR -> RS(0) (local_slice on mesh dim 1, tensor dim 0, no communication)"
    );
}

#[test]
fn nine_rows_on_a_two_by_two_mesh() {
    let sizes: Vec<usize> = (0..4)
        .map(|r| {
            local_shape_and_offset(&[9], &[2, 2], &coord_of(&[2, 2], r), &[Shard(0), Shard(0)])
                .unwrap()
                .0[0]
        })
        .collect();
    assert_eq!(sizes, [3, 2, 2, 2]);
    let global = Array::iota(&[9]);
    let locals = layout(&global, &[2, 2], &[Shard(0), Shard(0)], 0).unwrap();
    let lens: Vec<usize> = locals.ranks.iter().map(|a| a.numel()).collect();
    assert_eq!(lens, [3, 2, 2, 2]);
    // Gathering to [S(0), R] and re-sharding both ways.
    simulate_case(&[2, 2], &[9], &[Shard(0), Shard(0)], &[Shard(0), Replicate]);
    simulate_case(&[2, 2], &[9], &[Replicate, Replicate], &[Shard(0), Shard(0)]);
    simulate_case(&[2, 2], &[9], &[Partial(ReduceOp::Sum), Replicate], &[Shard(0), Shard(0)]);
}

#[test]
fn two_d_tensor_parallel_patterns() {
    let sum = Partial(ReduceOp::Sum);
    // Rowwise output: partial over tp, reduce to replicate.
    let p = simulate_case(&[2, 3], &[5, 7], &[Shard(0), sum], &[Shard(0), Replicate]);
    assert_eq!(kinds(&p), [(1, StepKind::AllReduce { op: ReduceOp::Sum })]);
    // Sequence parallel: partial over tp, reduce-scatter the sequence dim.
    let p = simulate_case(&[2, 3], &[5, 7, 2], &[Shard(0), sum], &[Shard(0), Shard(1)]);
    assert_eq!(kinds(&p), [(1, StepKind::ReduceScatter { op: ReduceOp::Sum, tensor_dim: 1 })]);
    // FSDP + TP all-gather of a weight.
    let p = simulate_case(&[2, 3], &[7, 5], &[Shard(0), Shard(1)], &[Replicate, Shard(1)]);
    assert_eq!(kinds(&p), [(0, StepKind::AllGather { tensor_dim: 0 })]);
    // Mixed partial ops in dst built by the planner itself.
    simulate_case(&[2, 2], &[4, 3], &[sum, sum], &[Partial(ReduceOp::Max), sum]);
    simulate_case(
        &[2, 2],
        &[4, 3],
        &[Partial(ReduceOp::Max), Partial(ReduceOp::Max)],
        &[sum, Replicate],
    );
}
