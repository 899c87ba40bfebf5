//! The result of each compared output ([`Check`]) and the [`Report`] that
//! prints and keeps them: relative error, exact comparisons, and the
//! `--sabotage` perturbation of the references.

/// One compared output.
pub(crate) struct Check {
    pub(crate) name: String,
    pub(crate) dtype: String,
    pub(crate) shape: String,
    pub(crate) err: f64,
    pub(crate) bound: f64,
    pub(crate) pass: bool,
    pub(crate) note: String,
}

/// The checks so far; prints each as it is recorded.
pub(crate) struct Report {
    pub(crate) checks: Vec<Check>,
    pub(crate) sabotage: bool,
}

/// Largest `|got - want|` over the largest finite `|want|`; a NaN or
/// infinity on one side only is an infinite error.
pub(crate) fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    let mut e = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g.is_finite() && w.is_finite() {
            e = e.max((g - w).abs() / scale);
        } else if !(g == w || (g.is_nan() && w.is_nan())) {
            return f64::INFINITY;
        }
    }
    e
}

/// Moves the largest finite reference value by ten bounds (`--sabotage`).
pub(crate) fn sabotage(want: &mut [f64], bound: f64) {
    let Some((i, scale)) = want
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, v)| (i, v.abs()))
        .max_by(|a, b| a.1.total_cmp(&b.1))
    else {
        if let Some(w) = want.first_mut() {
            *w = 0.0;
        }
        return;
    };
    want[i] += 10.0 * bound.max(1e-6) * scale.max(1e-30);
}

impl Report {
    pub(crate) fn record(
        &mut self,
        name: &str,
        dtype: &str,
        shape: &str,
        err: f64,
        bound: f64,
        note: &str,
    ) {
        let pass = err <= bound;
        println!(
            "{} {name:<30} {dtype:<9} {shape:<30} err {err:9.2e} bound {bound:.0e}{}{note}",
            if pass { "PASS" } else { "FAIL" },
            if note.is_empty() { "" } else { "  " },
        );
        self.checks.push(Check {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.into(),
            err,
            bound,
            pass,
            note: note.into(),
        });
    }

    pub(crate) fn err_of(&self, got: &[f64], want: &[f64], bound: f64) -> f64 {
        if self.sabotage {
            let mut w = want.to_vec();
            sabotage(&mut w, bound);
            rel_err(got, &w)
        } else {
            rel_err(got, want)
        }
    }

    /// Compares one float output.
    pub(crate) fn close(
        &mut self,
        name: &str,
        dt: &str,
        shape: &str,
        got: &[f64],
        want: &[f64],
        bound: f64,
    ) {
        self.close_note(name, dt, shape, got, want, bound, "");
    }

    pub(crate) fn close_note(
        &mut self,
        name: &str,
        dt: &str,
        shape: &str,
        got: &[f64],
        want: &[f64],
        bound: f64,
        note: &str,
    ) {
        let err = self.err_of(got, want, bound);
        self.record(name, dt, shape, err, bound, note);
    }

    /// Compares several outputs as one check; the note names the worst.
    pub(crate) fn close_parts(
        &mut self,
        name: &str,
        dt: &str,
        shape: &str,
        parts: &[(String, Vec<f64>, Vec<f64>)],
        bound: f64,
    ) {
        let (err, label) = parts
            .iter()
            .map(|(label, got, want)| (self.err_of(got, want, bound), label.as_str()))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap_or((f64::INFINITY, "nothing compared"));
        let note = format!("{} parts, worst {label}", parts.len());
        self.record(name, dt, shape, err, bound, &note);
    }

    /// Compares integer outputs exactly; `err` is the number of mismatches.
    pub(crate) fn exact(&mut self, name: &str, dt: &str, shape: &str, got: &[u64], want: &[u64]) {
        let mut want = want.to_vec();
        if self.sabotage && !want.is_empty() {
            let i = want.len() / 2;
            want[i] ^= 1;
        }
        let mism = if got.len() != want.len() {
            got.len().abs_diff(want.len()).max(1)
        } else {
            got.iter().zip(&want).filter(|(g, w)| g != w).count()
        };
        self.record(name, dt, shape, mism as f64, 0.0, "");
    }

    pub(crate) fn failure(&mut self, name: &str, dt: &str, shape: &str, e: &dyn std::fmt::Display) {
        self.record(name, dt, shape, f64::INFINITY, 0.0, &format!("error: {e}"));
    }
}
