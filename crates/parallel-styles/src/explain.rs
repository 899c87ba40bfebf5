//! `explain`: what a plan does to a model, in words: each parallelized module's style,
//! its parameters' placements, and the collectives its hooks ran, with bytes.

use std::collections::BTreeMap;
use std::fmt::Write;

use tpar_collectives::{CollectiveKind, CommRecord};
use tpar_nn::Module;
use tpar_placements::{fmt_bytes, fmt_placements, Step};

use crate::trace::HookEvent;

/// Per collective kind: calls and bytes, forward and backward.
#[derive(Default)]
struct Tally {
    fwd_calls: usize,
    fwd_bytes: u64,
    bwd_calls: usize,
    bwd_bytes: u64,
}

fn steps_line(out: &mut String, side: &str, steps: &[Step]) {
    let comm: Vec<String> =
        steps.iter().filter(|s| s.kind.is_collective()).map(|s| s.describe()).collect();
    if comm.is_empty() {
        let _ = writeln!(out, "           {side:<8} no communication");
    }
    for c in comm {
        let _ = writeln!(out, "           {side:<8} {c}");
    }
}

/// A report of what a parallelization does, for one rank.
///
/// For every module with style hooks (or sharded parameters), parents before children:
/// its hooks (style and layouts), each parameter's global shape, placements and local
/// shape, and the redistributions its hooks ran in `events` (from [`crate::trace::capture`]
/// around one forward pass), each with the forward collectives and the adjoint
/// collectives backward runs, with bytes. Then a table per collective kind (calls and
/// bytes, forward and backward) and the totals in bytes. Bytes follow the planner's
/// rule (received by the rank holding the largest shard). Collectives outside the
/// style hooks (an op's own redistributions, `loss_parallel`'s all_reduces, reading
/// replicated parameters' gradients) are not in `events` and not counted.
///
/// The backward shown is each redistribution's adjoint in the contribution convention
/// (a `Replicate` value's gradient as `Partial(sum)`). Where the engine carries a
/// gradient held in full instead (see `tpar_tensor::autograd::ReplicatedGrad`), the
/// backward that runs differs: an `R -> S(d)` slice of a replicated value all-gathers
/// its gradient rather than zero-padding it, and an `S(d) -> R` all_gather takes a full
/// gradient back as a local slice rather than a reduce_scatter (the sequence-parallel
/// Llama plan's o_proj and q/k/v). [`explain_collectives`] counts what ran.
///
/// ```
/// use tpar_nn::{Linear, Module};
/// use tpar_tensor::{DType, Device};
/// let lin = Linear::new(4, 4, false, DType::F32, Device::Meta)?;
/// let text = tpar_parallel_styles::explain(&lin, &[]);
/// assert!(text.contains("total: forward 0 B, backward 0 B"));
/// # Ok::<(), tpar_nn::NnError>(())
/// ```
pub fn explain(model: &dyn Module, events: &[HookEvent]) -> String {
    let mut out = String::new();
    let mut modules = Vec::new();
    preorder(model, String::new(), &mut modules);
    let mut shown = vec![false; events.len()];
    for (fqn, m) in &modules {
        let hooks: Vec<_> = m.core().hooks().iter().filter(|h| h.shown()).collect();
        let params = m.params();
        let sharded = params.iter().any(|(_, p)| {
            p.dtensor().is_some_and(|d| d.placements().iter().any(|p| !p.is_replicate()))
        });
        if hooks.is_empty() && !sharded {
            continue;
        }
        let name = if fqn.is_empty() { "(root)" } else { fqn.as_str() };
        let _ = writeln!(out, "{name} ({})", m.type_name());
        // One line per style: its hooks' descriptions (`Style(..): inputs ..`) merged.
        let mut styles: Vec<(String, Vec<String>)> = Vec::new();
        for h in hooks {
            let d = h.describe();
            let (style, what) = d.split_once(": ").unwrap_or((d.as_str(), ""));
            match styles.last_mut() {
                Some((s, w)) if s == style => w.push(what.to_string()),
                _ => styles.push((style.to_string(), vec![what.to_string()])),
            }
        }
        for (style, what) in styles {
            let what: Vec<String> = what.into_iter().filter(|w| !w.is_empty()).collect();
            let _ = writeln!(out, "  style    {style}: {}", what.join("; "));
        }
        for (pname, p) in &params {
            match p.dtensor() {
                Some(d) => {
                    let _ = writeln!(
                        out,
                        "  {pname:<8} {:?} {} on {}, local {:?}",
                        d.shape(),
                        fmt_placements(d.placements()),
                        d.mesh(),
                        d.local().dims()
                    );
                }
                None => {
                    let _ =
                        writeln!(out, "  {pname:<8} {:?} plain (whole on every rank)", p.shape());
                }
            }
        }
        for (i, e) in events.iter().enumerate().filter(|(_, e)| &e.fqn == fqn) {
            shown[i] = true;
            write_event(&mut out, e, false);
        }
    }
    let others: Vec<&HookEvent> =
        events.iter().zip(&shown).filter(|(_, s)| !**s).map(|(e, _)| e).collect();
    if !others.is_empty() {
        let _ = writeln!(out, "(modules not in this model)");
        for e in others {
            let _ = writeln!(out, "{}", e.fqn);
            write_event(&mut out, e, true);
        }
    }
    let mut tally: BTreeMap<&'static str, Tally> = BTreeMap::new();
    for e in events {
        for (steps, fwd) in [(&e.forward_steps, true), (&e.backward_steps, false)] {
            for s in steps.iter().filter(|s| s.kind.is_collective()) {
                let t = tally.entry(s.kind.name()).or_default();
                if fwd {
                    t.fwd_calls += 1;
                    t.fwd_bytes += s.bytes;
                } else {
                    t.bwd_calls += 1;
                    t.bwd_bytes += s.bytes;
                }
            }
        }
    }
    let _ = writeln!(out, "collectives in style hooks, per rank (one forward + its backward):");
    for (kind, t) in &tally {
        let _ = writeln!(
            out,
            "  {kind:<15} forward {:>3} calls {:>10} B   backward {:>3} calls {:>10} B",
            t.fwd_calls, t.fwd_bytes, t.bwd_calls, t.bwd_bytes
        );
    }
    let fwd: u64 = events.iter().map(|e| e.forward_bytes).sum();
    let bwd: u64 = events.iter().map(|e| e.backward_bytes).sum();
    let _ = writeln!(
        out,
        "total: forward {fwd} B, backward {bwd} B, forward+backward {} B ({})",
        fwd + bwd,
        fmt_bytes(fwd + bwd)
    );
    out
}

/// Modules in depth-first pre-order (PyTorch's `named_modules` order).
fn preorder<'a>(m: &'a dyn Module, fqn: String, out: &mut Vec<(String, &'a dyn Module)>) {
    let children = m.children();
    out.push((fqn.clone(), m));
    for (name, child) in children {
        let f = if fqn.is_empty() { name } else { format!("{fqn}.{name}") };
        preorder(child, f, out);
    }
}

fn write_event(out: &mut String, e: &HookEvent, with_style: bool) {
    let style = if with_style { format!(" ({})", e.style) } else { String::new() };
    let _ = writeln!(
        out,
        "  {:<8} {} -> {} {:?}{style}: forward {}, backward {}",
        e.what,
        e.from,
        e.to,
        e.shape,
        fmt_bytes(e.forward_bytes),
        fmt_bytes(e.backward_bytes)
    );
    steps_line(out, "forward", &e.forward_steps);
    steps_line(out, "backward", &e.backward_steps);
}

/// Calls and input bytes of one collective kind on one group, in one phase.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommTally {
    /// Calls.
    pub calls: usize,
    /// This rank's input bytes over those calls.
    pub bytes: usize,
}

/// Calls and bytes per (collective kind, group) in `records`: what one rank issued,
/// e.g. the records a [`CommDebug`](tpar_collectives::CommDebug) took during one phase
/// of a step.
pub fn tally_collectives(
    records: &[CommRecord],
) -> BTreeMap<(CollectiveKind, Vec<usize>), CommTally> {
    let mut out: BTreeMap<(CollectiveKind, Vec<usize>), CommTally> = BTreeMap::new();
    for r in records {
        let t = out.entry((r.kind, r.group.clone())).or_default();
        t.calls += 1;
        t.bytes += r.bytes;
    }
    out
}

/// A table of the collectives one rank issued per phase of a step (`("forward",
/// records)`, `("backward", records)`, ...), from a
/// [`CommDebug`](tpar_collectives::CommDebug): per phase, collective and group (its
/// global ranks, so a 2-D mesh's dp and tp groups show apart), the calls and this rank's
/// input bytes, then the totals per phase and for the step. Unlike [`explain`], it
/// counts everything the rank communicated: FSDP's gathers and reductions, the
/// styles' redistributions, `loss_parallel`'s reductions.
///
/// ```
/// use tpar_collectives::{spawn, CollectiveError};
/// use tpar_tensor::Tensor;
/// let tables = spawn(2, |ctx| -> Result<String, CollectiveError> {
///     let pg = ctx.world_group();
///     let dbg = pg.comm_debug();
///     dbg.enable();
///     pg.all_gather(&Tensor::from_vec(vec![1.0f32; 4], [4])?, 0)?;
///     let forward = dbg.take();
///     Ok(tpar_parallel_styles::explain_collectives(&[("forward", &forward)]))
/// })?;
/// assert!(tables[0].contains("all_gather"), "{}", tables[0]);
/// assert!(tables[0].contains("total: 1 calls, 16 B"), "{}", tables[0]);
/// # Ok::<(), CollectiveError>(())
/// ```
pub fn explain_collectives(phases: &[(&str, &[CommRecord])]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  {:<10} {:<15} {:<16} {:>6} {:>12}",
        "phase", "collective", "group", "calls", "bytes"
    );
    let (mut calls, mut bytes) = (0usize, 0usize);
    for (phase, records) in phases {
        let tally = tally_collectives(records);
        let (mut pc, mut pb) = (0usize, 0usize);
        for ((kind, group), t) in &tally {
            let _ = writeln!(
                out,
                "  {:<10} {:<15} {:<16} {:>6} {:>12}",
                phase,
                kind.name(),
                format!("{group:?}"),
                t.calls,
                fmt_bytes(t.bytes as u64)
            );
            pc += t.calls;
            pb += t.bytes;
        }
        let _ = writeln!(out, "  {phase:<10} total: {pc} calls, {}", fmt_bytes(pb as u64));
        calls += pc;
        bytes += pb;
    }
    let _ = writeln!(out, "total: {calls} calls, {}", fmt_bytes(bytes as u64));
    out
}
