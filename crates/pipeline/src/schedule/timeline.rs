//! When each action ran: simulated by [`Schedule::simulate`](super::Schedule::simulate)
//! or measured by an executor, and its text chart.

use std::fmt::Write;

use super::Action;

/// One action's run: from `start` to `end`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// What ran.
    pub action: Action,
    /// When it started.
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

impl Span {
    /// `end - start`.
    pub fn duration(&self) -> f64 {
        self.end - self.start
    }
}

/// Per rank, the spans of its actions in execution order. Times are seconds for a
/// measured step, cost units for a simulated one.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timeline {
    /// The spans of each rank, in the order the rank ran them.
    pub ranks: Vec<Vec<Span>>,
}

/// Charts with more ticks than this switch to [`FALLBACK_TICKS`] columns.
const MAX_TICKS: usize = 400;
/// The column count of a chart whose smallest span is too short to be the tick.
const FALLBACK_TICKS: usize = 120;

impl Timeline {
    /// The earliest start over all spans (0 when there are none).
    pub fn start(&self) -> f64 {
        let min = self.spans().map(|s| s.start).fold(f64::INFINITY, f64::min);
        if min.is_finite() {
            min
        } else {
            0.0
        }
    }

    /// The latest end minus the earliest start over all spans (0 when there are none).
    pub fn makespan(&self) -> f64 {
        let end = self.spans().map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
        if end.is_finite() {
            end - self.start()
        } else {
            0.0
        }
    }

    /// The time `rank` spent running actions.
    pub fn busy(&self, rank: usize) -> f64 {
        self.ranks[rank].iter().map(Span::duration).sum()
    }

    /// The idle share of the ranks' time over the makespan: `1 - Σ busy / (ranks ·
    /// makespan)` (0 for an empty timeline).
    pub fn bubble_fraction(&self) -> f64 {
        let makespan = self.makespan();
        if makespan <= 0.0 || self.ranks.is_empty() {
            return 0.0;
        }
        let busy: f64 = (0..self.ranks.len()).map(|r| self.busy(r)).sum();
        1.0 - busy / (self.ranks.len() as f64 * makespan)
    }

    /// A text chart, one row per rank, with the makespan and bubble fraction below.
    ///
    /// Time is cut into ticks of the shortest span's duration (a simulated schedule
    /// with whole-number costs lines up exactly: a span of 2 units fills two cells).
    /// When that would make more than 400 columns, as a measured step with uneven spans
    /// can, the chart has 120 equal columns instead. Each cell shows the action
    /// running at the middle of its tick (`0F3`), or `.` when the rank is idle then; a
    /// span shorter than a tick may not show. Spans of zero duration never show.
    pub fn render(&self) -> String {
        let makespan = self.makespan();
        let shortest =
            self.spans().map(Span::duration).filter(|&d| d > 0.0).fold(f64::INFINITY, f64::min);
        let tick = if !shortest.is_finite() {
            makespan.max(1.0)
        } else if makespan / shortest > MAX_TICKS as f64 {
            makespan / FALLBACK_TICKS as f64
        } else {
            shortest
        };
        self.render_with_tick(tick)
    }

    /// [`render`](Timeline::render) with a given tick (a positive duration).
    pub fn render_with_tick(&self, tick: f64) -> String {
        let (start, makespan) = (self.start(), self.makespan());
        let ticks = if tick > 0.0 && makespan > 0.0 {
            // Allow for rounding: 33.000000001 units of 1 are 33 ticks.
            ((makespan / tick) - 1e-9).ceil().max(1.0) as usize
        } else {
            0
        };
        let width = self.spans().map(|s| s.action.to_string().len()).max().unwrap_or(1);
        let label_width = format!("rank {}", self.ranks.len().saturating_sub(1)).len();
        let mut out = String::new();
        for (rank, spans) in self.ranks.iter().enumerate() {
            let mut row = format!("{:<label_width$} |", format!("rank {rank}"));
            let mut k = 0;
            for t in 0..ticks {
                let mid = start + (t as f64 + 0.5) * tick;
                while k < spans.len() && spans[k].end <= mid {
                    k += 1;
                }
                let cell = match spans.get(k) {
                    Some(s) if s.start <= mid => s.action.to_string(),
                    _ => ".".to_string(),
                };
                let _ = write!(row, " {cell:<width$}");
            }
            out.push_str(row.trim_end());
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "makespan {}, bubble {:.1}%",
            short_number(makespan),
            100.0 * self.bubble_fraction()
        );
        out
    }

    fn spans(&self) -> impl Iterator<Item = &Span> {
        self.ranks.iter().flatten()
    }
}

/// A whole number as such, anything else to four significant digits.
fn short_number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.0}")
    } else {
        let digits = (3 - x.abs().log10().floor() as i32).max(0) as usize;
        format!("{x:.digits$}")
    }
}
