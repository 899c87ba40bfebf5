//! Pipeline schedules: construction, checks, simulation, messages and charts.

use std::collections::{HashMap, VecDeque};

use tpar_pipeline::{
    classic_bubble, Action, Costs, Message, MessageKind, Phase, PipelineError, Schedule,
    ScheduleKind, Span, Timeline,
};

const EPS: f64 = 1e-12;

/// Every generated schedule the sweeps cover: each kind, pp 1..=4, m 1..=8 and 16,
/// interleaved with 2 and 3 stages per rank.
fn sweep() -> Vec<Schedule> {
    let mut out = Vec::new();
    for kind in ScheduleKind::ALL {
        let vs: &[usize] = if kind == ScheduleKind::Interleaved1F1B { &[2, 3] } else { &[1] };
        for pp in 1..=4 {
            for m in (1..=8).chain([16]) {
                for &v in vs {
                    let s = Schedule::build(kind, pp, v, m)
                        .unwrap_or_else(|e| panic!("{kind} pp {pp} v {v} m {m}: {e}"));
                    out.push(s);
                }
            }
        }
    }
    out
}

fn describe(s: &Schedule) -> String {
    format!("{} pp {} v {} m {}", s.name(), s.pp(), s.stages_per_rank(), s.n_microbatches())
}

fn build(kind: ScheduleKind, pp: usize, m: usize) -> Schedule {
    Schedule::new(kind, pp, m).unwrap()
}

#[test]
fn every_action_once_on_its_rank() {
    for s in sweep() {
        let split = s.kind().unwrap().splits_backward();
        assert_eq!(s.splits_backward(), split, "{}", describe(&s));
        let mut seen = HashMap::new();
        for rank in 0..s.pp() {
            assert_eq!(s.stages_of_rank(rank).len(), s.stages_per_rank());
            for &a in s.actions(rank) {
                assert_eq!(s.rank_of_stage(a.stage), rank, "{}: {a}", describe(&s));
                assert!(s.stages_of_rank(rank).contains(&a.stage));
                *seen.entry(a).or_insert(0) += 1;
            }
        }
        let phases: &[Phase] =
            if split { &[Phase::F, Phase::I, Phase::W] } else { &[Phase::F, Phase::B] };
        for stage in 0..s.num_stages() {
            for mb in 0..s.n_microbatches() {
                for &p in phases {
                    let a = Action::new(stage, mb, p);
                    assert_eq!(seen.get(&a), Some(&1), "{}: {a}", describe(&s));
                }
            }
        }
        let expected = s.num_stages() * s.n_microbatches() * phases.len();
        assert_eq!(seen.len(), expected, "{}", describe(&s));

        let timeline = s.simulate(&Costs::unit()).unwrap();
        assert_eq!(timeline.ranks.len(), s.pp());
        for rank in 0..s.pp() {
            let ran: Vec<Action> = timeline.ranks[rank].iter().map(|sp| sp.action).collect();
            assert_eq!(ran, s.actions(rank), "{}", describe(&s));
        }
    }
}

#[test]
fn in_flight_limits() {
    for s in sweep() {
        let (pp, m) = (s.pp(), s.n_microbatches());
        match s.kind().unwrap() {
            ScheduleKind::GPipe => {
                for r in 0..pp {
                    assert_eq!(s.max_in_flight(r), m);
                }
            }
            ScheduleKind::OneFOneB => {
                assert_eq!(s.max_in_flight(0), pp.min(m), "{}", describe(&s));
                for r in 0..pp {
                    assert!(s.max_in_flight(r) <= pp - r, "{}", describe(&s));
                }
            }
            ScheduleKind::ZeroBubble => {
                assert_eq!(s.max_in_flight(0), pp.min(m), "{}", describe(&s));
                for r in 0..pp {
                    assert!(s.max_in_flight(r) <= pp, "{}", describe(&s));
                }
            }
            ScheduleKind::Interleaved1F1B => {
                for r in 0..pp {
                    assert!(s.max_in_flight(r) <= m * s.stages_per_rank());
                }
            }
        }
    }
}

#[test]
fn gpipe_and_1f1b_have_the_classic_bubble() {
    for pp in 1..=4 {
        for m in (1..=8).chain([16]) {
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let s = build(kind, pp, m);
                for costs in [Costs::new(1.0, 1.0, 1.0), Costs::new(1.0, 2.0, 0.5)] {
                    let b = s.simulate(&costs).unwrap().bubble_fraction();
                    assert!((b - classic_bubble(pp, m)).abs() < EPS, "{kind} pp {pp} m {m}: {b}");
                }
                assert!((s.bubble() - classic_bubble(pp, m)).abs() < EPS);
            }
        }
    }
}

#[test]
fn zero_bubble_beats_1f1b() {
    for pp in 1..=4 {
        for m in (1..=8).chain([16]) {
            let zb = build(ScheduleKind::ZeroBubble, pp, m).bubble();
            let base = build(ScheduleKind::OneFOneB, pp, m).bubble();
            if pp >= 2 && m >= 2 {
                assert!(zb < base, "pp {pp} m {m}: zb {zb} 1f1b {base}");
            } else {
                assert!(zb <= base + EPS, "pp {pp} m {m}: zb {zb} 1f1b {base}");
            }
            if m >= pp {
                // A third of 1F1B's idle time: (pp-1) units of 1 per rank instead of 3.
                let ideal = (pp - 1) as f64 / (3 * m + pp - 1) as f64;
                assert!((zb - ideal).abs() < EPS, "pp {pp} m {m}: zb {zb} ideal {ideal}");
            }
        }
    }
}

#[test]
fn interleaved_beats_1f1b() {
    for pp in 1..=4 {
        for v in 2..=3 {
            for m in (1..=8).chain([16]) {
                let s = Schedule::build(ScheduleKind::Interleaved1F1B, pp, v, m).unwrap();
                let b = s.bubble();
                let base = classic_bubble(pp, m);
                if m >= pp && pp >= 2 {
                    assert!(b < base, "pp {pp} v {v} m {m}: {b} vs {base}");
                    let ideal = (pp - 1) as f64 / (v * m + pp - 1) as f64;
                    assert!((b - ideal).abs() < EPS, "pp {pp} v {v} m {m}: {b} vs {ideal}");
                } else {
                    assert!(b <= base + EPS, "pp {pp} v {v} m {m}: {b} vs {base}");
                }
            }
        }
    }
}

#[test]
fn interleaved_runs_for_wider_sizes() {
    for pp in 1..=8 {
        for v in 1..=4 {
            for m in 1..=24 {
                let s = Schedule::build(ScheduleKind::Interleaved1F1B, pp, v, m)
                    .unwrap_or_else(|e| panic!("pp {pp} v {v} m {m}: {e}"));
                if v == 1 {
                    assert_eq!(
                        (0..pp).map(|r| s.actions(r).to_vec()).collect::<Vec<_>>(),
                        (0..pp)
                            .map(|r| build(ScheduleKind::OneFOneB, pp, m).actions(r).to_vec())
                            .collect::<Vec<_>>()
                    );
                }
            }
        }
    }
}

#[test]
fn one_rank_and_one_microbatch() {
    for kind in ScheduleKind::ALL {
        for m in 1..=5 {
            let s = build(kind, 1, m);
            assert_eq!(s.pp(), 1);
            assert!(s.bubble().abs() < EPS, "{kind} m {m}");
            assert!(s.messages(0, 0).is_empty());
        }
        for pp in 1..=4 {
            let s = build(kind, pp, 1);
            assert_eq!(s.n_microbatches(), 1);
            s.simulate(&Costs::unit()).unwrap();
        }
    }
}

/// The messages `from` sends `to`, worked out from the dependency rules alone.
fn expected_messages(s: &Schedule, from: usize, to: usize) -> Vec<Message> {
    let last = s.num_stages() - 1;
    let mut out = Vec::new();
    for &a in s.actions(from) {
        let target = match a.phase {
            Phase::F if a.stage < last => Some((MessageKind::Activation, a.stage + 1)),
            Phase::B | Phase::I if a.stage > 0 => Some((MessageKind::Gradient, a.stage - 1)),
            _ => None,
        };
        if let Some((kind, stage)) = target {
            if stage % s.pp() == to && to != from {
                out.push(Message { kind, stage, microbatch: a.microbatch });
            }
        }
    }
    out
}

/// The input an action on `rank` receives from another rank, by the dependency rules.
fn consumed_input(s: &Schedule, rank: usize, a: Action) -> Option<(usize, Message)> {
    let (kind, from_stage) = match a.phase {
        Phase::F if a.stage > 0 => (MessageKind::Activation, a.stage - 1),
        Phase::B | Phase::I if a.stage + 1 < s.num_stages() => (MessageKind::Gradient, a.stage + 1),
        _ => return None,
    };
    let from = s.rank_of_stage(from_stage);
    (from != rank).then_some((from, Message { kind, stage: a.stage, microbatch: a.microbatch }))
}

#[test]
fn messages_match_what_ranks_produce_and_consume() {
    for s in sweep() {
        for from in 0..s.pp() {
            for to in 0..s.pp() {
                let list = s.messages(from, to);
                assert_eq!(list, expected_messages(&s, from, to), "{} {from}->{to}", describe(&s));
                // Every input `to` consumes from `from` is in the list exactly once, and
                // the list holds nothing else.
                let consumed: Vec<Message> = s
                    .actions(to)
                    .iter()
                    .filter_map(|&a| consumed_input(&s, to, a))
                    .filter(|&(f, _)| f == from)
                    .map(|(_, m)| m)
                    .collect();
                assert_eq!(consumed.len(), list.len(), "{} {from}->{to}", describe(&s));
                for m in &consumed {
                    assert_eq!(list.iter().filter(|x| *x == m).count(), 1, "{}: {m}", describe(&s));
                }
            }
        }
        // send/recv agree with messages.
        for rank in 0..s.pp() {
            for &a in s.actions(rank) {
                assert_eq!(s.recv(a), consumed_input(&s, rank, a));
                if let Some((to, m)) = s.send(a) {
                    assert_ne!(to, rank);
                    assert_eq!(s.producer(m), a);
                    assert_eq!(s.recv(s.consumer(m)), Some((rank, m)), "{}: {a}", describe(&s));
                }
            }
        }
    }
}

/// Runs the lists the way an executor does: eager sends into untagged FIFO channels,
/// blocking receives that label what arrives by `Schedule::messages`.
fn run_like_an_executor(s: &Schedule) {
    let pp = s.pp();
    let mut channels: HashMap<(usize, usize), VecDeque<Message>> = HashMap::new();
    // What each receiver has taken off a channel so far (its position in `messages`).
    let mut taken: HashMap<(usize, usize), usize> = HashMap::new();
    let mut buffered: Vec<Vec<Message>> = vec![Vec::new(); pp];
    let mut next = vec![0usize; pp];
    loop {
        let mut progressed = false;
        for rank in 0..pp {
            while let Some(&a) = s.actions(rank).get(next[rank]) {
                if let Some((from, want)) = s.recv(a) {
                    let expected = s.messages(from, rank);
                    let queue = channels.entry((from, rank)).or_default();
                    let pos = taken.entry((from, rank)).or_default();
                    while !buffered[rank].contains(&want) {
                        let Some(got) = queue.pop_front() else { break };
                        assert_eq!(got, expected[*pos], "{}", describe(s));
                        *pos += 1;
                        buffered[rank].push(got);
                    }
                    let Some(i) = buffered[rank].iter().position(|m| *m == want) else { break };
                    buffered[rank].swap_remove(i);
                }
                if let Some((to, m)) = s.send(a) {
                    channels.entry((rank, to)).or_default().push_back(m);
                }
                next[rank] += 1;
                progressed = true;
            }
        }
        if (0..pp).all(|r| next[r] == s.actions(r).len()) {
            break;
        }
        assert!(progressed, "{} stalls", describe(s));
    }
    assert!(channels.values().all(VecDeque::is_empty), "{}", describe(s));
    assert!(buffered.iter().all(Vec::is_empty), "{}", describe(s));
    for ((from, to), n) in taken {
        assert_eq!(n, s.messages(from, to).len());
    }
}

#[test]
fn an_executor_with_fifo_channels_finishes() {
    for s in sweep() {
        run_like_an_executor(&s);
    }
}

fn schedule_error(r: Result<Schedule, PipelineError>) -> String {
    match r {
        Err(PipelineError::Schedule { what, .. }) => what,
        other => panic!("expected a schedule error, got {other:?}"),
    }
}

fn deadlock_error(r: Result<Schedule, PipelineError>) -> String {
    match r {
        Err(PipelineError::Deadlock { what, .. }) => what,
        other => panic!("expected a deadlock, got {other:?}"),
    }
}

fn parse(list: &str) -> Vec<Action> {
    list.split_whitespace()
        .map(|t| {
            let at = t.find(|c: char| c.is_ascii_alphabetic()).unwrap();
            let phase = match &t[at..=at] {
                "F" => Phase::F,
                "B" => Phase::B,
                "I" => Phase::I,
                "W" => Phase::W,
                p => panic!("phase {p}"),
            };
            Action::new(t[..at].parse().unwrap(), t[at + 1..].parse().unwrap(), phase)
        })
        .collect()
}

fn custom(pp: usize, m: usize, lists: &[&str]) -> Result<Schedule, PipelineError> {
    Schedule::from_actions("custom", pp, 1, m, lists.iter().map(|l| parse(l)).collect())
}

#[test]
fn from_actions_accepts_a_valid_order() {
    let s = custom(2, 2, &["0F0 0F1 0I0 0B1 0W0", "1F0 1B0 1F1 1I1 1W1"]).unwrap();
    assert_eq!(s.kind(), None);
    assert_eq!(s.name(), "custom");
    assert!(s.splits_backward());
    let one = build(ScheduleKind::OneFOneB, 3, 5);
    let copy =
        Schedule::from_actions("mine", 3, 1, 5, (0..3).map(|r| one.actions(r).to_vec()).collect())
            .unwrap();
    assert_eq!(copy.bubble(), one.bubble());
    assert_eq!(copy.to_string(), one.to_string());
}

#[test]
fn from_actions_rejects_bad_lists() {
    let what = schedule_error(custom(2, 2, &["0F0 0F1 0B0 0B1", "1F0 1B0 1F1"]));
    assert!(what.contains("1B1 (or 1I1 and 1W1) is missing"), "{what}");
    let what = schedule_error(custom(2, 1, &["0F0 0B0", "1B0"]));
    assert!(what.contains("1F0 is missing"), "{what}");
    let what = schedule_error(custom(2, 2, &["0F0 0F1 0B0 0B1 0F1", "1F0 1B0 1F1 1B1"]));
    assert!(what.contains("0F1 appears more than once"), "{what}");
    let what = schedule_error(custom(2, 1, &["0F0 0B0 1F0", "1B0"]));
    assert!(what.contains("1F0 is on rank 0, but stage 1 belongs to rank 1"), "{what}");
    let what = schedule_error(custom(2, 1, &["0F0 0B0 0I0 0W0", "1F0 1B0"]));
    assert!(what.contains("mixes a full backward 0B0 with a split one"), "{what}");
    let what = schedule_error(custom(2, 1, &["0F0 0I0", "1F0 1B0"]));
    assert!(what.contains("0W0 is missing"), "{what}");
    let what = schedule_error(custom(2, 1, &["0F0 0F1 0B0", "1F0 1B0"]));
    assert!(what.contains("micro-batch 1, but there are 1"), "{what}");
    let what = schedule_error(custom(2, 1, &["0F0 0B0 2F0", "1F0 1B0"]));
    assert!(what.contains("names stage 2, but there are 2 stages"), "{what}");
    let what = schedule_error(custom(2, 1, &["0F0 0B0"]));
    assert!(what.contains("1 action lists for 2 ranks"), "{what}");
}

#[test]
fn from_actions_reports_deadlocks() {
    // Rank 0 waits for a gradient before sending the activation rank 1 needs first.
    let what = deadlock_error(custom(2, 2, &["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]));
    assert!(what.contains("rank 0 waits at 0B0 for the gradient from 1B0 on rank 1"), "{what}");
    assert!(what.contains("rank 1 waits at 1F1 for the activation from 0F1 on rank 0"), "{what}");
    // A backward before its own forward.
    let what = deadlock_error(custom(2, 1, &["0F0 0B0", "1B0 1F0"]));
    assert!(what.contains("rank 1 waits at 1B0 for 1F0, which comes later in its own list"));
    assert!(what.contains("rank 0 waits at 0B0 for the gradient from 1B0 on rank 1"), "{what}");
    assert!(!what.contains("rank 2"));
    // A weight gradient before its input gradient, on one rank.
    let what = deadlock_error(custom(1, 1, &["0F0 0W0 0I0"]));
    assert_eq!(what, "rank 0 waits at 0W0 for 0I0, which comes later in its own list");
    // The simulation of such lists fails the same way for any costs; checked ones run.
    let err = custom(2, 1, &["0F0 0B0", "1B0 1F0"]).unwrap_err();
    assert!(err.to_string().starts_with("pipeline schedule custom deadlocks: "), "{err}");
}

#[test]
fn sizes_are_checked() {
    for kind in ScheduleKind::ALL {
        assert!(schedule_error(Schedule::new(kind, 0, 4)).contains("pp must be at least 1, got 0"));
        assert!(schedule_error(Schedule::new(kind, 2, 0))
            .contains("n_microbatches must be at least 1, got 0"));
        assert!(schedule_error(Schedule::build(kind, 2, 0, 4))
            .contains("stages_per_rank must be at least 1, got 0"));
    }
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble] {
        let what = schedule_error(Schedule::build(kind, 2, 2, 4));
        assert!(what.contains("stages_per_rank 2"), "{what}");
    }
    assert!(schedule_error(Schedule::from_actions("x", 0, 1, 1, vec![])).contains("pp"));
    let s = Schedule::build(ScheduleKind::Interleaved1F1B, 2, 3, 5).unwrap();
    assert_eq!((s.pp(), s.stages_per_rank(), s.num_stages(), s.n_microbatches()), (2, 3, 6, 5));
    assert_eq!(s.stages_of_rank(1), [1, 3, 5]);
    assert_eq!(s.rank_of_stage(4), 0);
    assert_eq!(Schedule::new(ScheduleKind::Interleaved1F1B, 2, 4).unwrap().stages_per_rank(), 2);
}

#[test]
fn names_parse_and_print() {
    for kind in ScheduleKind::ALL {
        assert_eq!(kind.name().parse::<ScheduleKind>().unwrap(), kind);
        assert_eq!(kind.to_string(), kind.name());
        assert_eq!(build(kind, 2, 2).name(), kind.name());
        assert_eq!(build(kind, 2, 2).kind(), Some(kind));
    }
    for (s, kind) in [
        ("GPipe", ScheduleKind::GPipe),
        ("1F1B", ScheduleKind::OneFOneB),
        ("Interleaved1F1B", ScheduleKind::Interleaved1F1B),
        ("ZBH1", ScheduleKind::ZeroBubble),
        ("zero-bubble", ScheduleKind::ZeroBubble),
    ] {
        assert_eq!(s.parse::<ScheduleKind>().unwrap(), kind);
    }
    let err = "pipedream".parse::<ScheduleKind>().unwrap_err().to_string();
    for name in ["gpipe", "1f1b", "interleaved", "zb"] {
        assert!(err.contains(name), "{err}");
    }
    assert!(ScheduleKind::ZeroBubble.splits_backward());
    assert!(!ScheduleKind::OneFOneB.splits_backward());
    assert_eq!(Action::new(2, 5, Phase::F).to_string(), "2F5");
    assert_eq!(Action::new(0, 3, Phase::W).to_string(), "0W3");
    assert_eq!(
        build(ScheduleKind::OneFOneB, 2, 2).to_string(),
        "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n"
    );
    let m = Message { kind: MessageKind::Gradient, stage: 1, microbatch: 3 };
    assert_eq!(m.to_string(), "gradient for stage 1 micro-batch 3");
}

#[test]
fn render_one_row_per_rank() {
    let s = build(ScheduleKind::OneFOneB, 2, 2);
    let t = s.simulate(&Costs::unit()).unwrap();
    let chart = t.render();
    assert_eq!(
        chart,
        "rank 0 | 0F0 0F1 .   .   0B0 0B0 .   0B1 0B1\n\
         rank 1 | .   1F0 1B0 1B0 1F1 1B1 1B1 .   .\n\
         makespan 9, bubble 33.3%\n"
    );
    let rows: Vec<&str> = chart.lines().filter(|l| l.starts_with("rank ")).collect();
    assert_eq!(rows.len(), 2);
    assert!(chart.contains("0F0") && chart.contains("1B1"));

    // Wider labels widen every cell.
    let t = build(ScheduleKind::ZeroBubble, 3, 11).simulate(&Costs::unit()).unwrap();
    let chart = t.render();
    assert!(chart.contains("0F10") && chart.contains("0F0  "), "{chart}");
    assert_eq!(chart.lines().count(), 4);
}

#[test]
fn timeline_measures() {
    let a = |s| Action::new(s, 0, Phase::F);
    let t = Timeline {
        ranks: vec![
            vec![Span { action: a(0), start: 1.0, end: 2.0 }],
            vec![Span { action: a(1), start: 2.0, end: 5.0 }],
        ],
    };
    assert_eq!(t.makespan(), 4.0);
    assert_eq!(t.busy(0), 1.0);
    assert_eq!(t.busy(1), 3.0);
    assert!((t.bubble_fraction() - 0.5).abs() < EPS);
    assert_eq!(t.start(), 1.0);
    assert_eq!(
        t.render(),
        "rank 0 | 0F0 .   .   .\nrank 1 | .   1F0 1F0 1F0\nmakespan 4, bubble 50.0%\n"
    );

    let empty = Timeline::default();
    assert_eq!(empty.makespan(), 0.0);
    assert_eq!(empty.bubble_fraction(), 0.0);
    assert_eq!(empty.render(), "makespan 0, bubble 0.0%\n");

    // Uneven measured spans: a fixed number of columns.
    let t = Timeline {
        ranks: vec![vec![
            Span { action: a(0), start: 0.0, end: 1e-6 },
            Span { action: a(0), start: 0.5, end: 0.75 },
        ]],
    };
    let chart = t.render();
    let row = chart.lines().next().unwrap();
    assert_eq!(row.split_whitespace().count(), 3 + 120, "{chart}");
    assert!(chart.ends_with("makespan 0.7500, bubble 66.7%\n"), "{chart}");
}

#[test]
fn costs_must_be_finite_and_non_negative() {
    let s = build(ScheduleKind::OneFOneB, 2, 2);
    for costs in [Costs::new(-1.0, 1.0, 1.0), Costs::new(1.0, f64::NAN, 1.0)] {
        let err = s.simulate(&costs).unwrap_err();
        assert!(matches!(err, PipelineError::Schedule { .. }), "{err}");
        assert!(err.to_string().contains("finite and non-negative"), "{err}");
    }
    assert_eq!(Costs::default(), Costs::unit());
    assert_eq!(Costs::unit().of(Phase::B), 2.0);
}

#[test]
fn large_schedules_build_quickly() {
    let start = std::time::Instant::now();
    for kind in ScheduleKind::ALL {
        let s = Schedule::new(kind, 32, 256).unwrap();
        assert!(s.bubble() < 0.2, "{kind}");
    }
    let s = Schedule::build(ScheduleKind::Interleaved1F1B, 32, 4, 256).unwrap();
    assert!((s.bubble() - 31.0 / (4.0 * 256.0 + 31.0)).abs() < EPS);
    assert!(start.elapsed().as_secs_f64() < 5.0, "{:?}", start.elapsed());
}

#[test]
fn zero_cost_phases_still_simulate() {
    let s = build(ScheduleKind::ZeroBubble, 4, 8);
    let t = s.simulate(&Costs::new(1.0, 2.0, 0.0)).unwrap();
    assert!(t.makespan() > 0.0);
    let t = s.simulate(&Costs::new(2.0, 1.0, 3.0)).unwrap();
    assert!(t.bubble_fraction() >= 0.0);
}
