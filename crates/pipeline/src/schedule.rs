//! (filled in by the schedule work)
