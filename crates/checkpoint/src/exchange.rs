//! Every rank's outcome of a phase, to every rank.

use tpar_collectives::ProcessGroup;

use crate::{CheckpointError, Result};

/// Every member's outcome of a local phase; the ranks that failed with their messages.
/// Called by every member after the phase, whatever its own outcome, so no rank is left
/// waiting.
pub(crate) fn agree(
    group: &ProcessGroup,
    local: &std::result::Result<(), String>,
) -> Result<Vec<(usize, String)>> {
    let msg = match local {
        Ok(()) => Vec::new(),
        Err(e) => format!("E{e}").into_bytes(),
    };
    Ok(group
        .all_gather_bytes(&msg)?
        .into_iter()
        .enumerate()
        .filter(|(_, m)| !m.is_empty())
        .map(|(r, m)| {
            (group.global_rank_of(r).unwrap_or(r), String::from_utf8_lossy(&m[1..]).into_owned())
        })
        .collect())
}

/// [`agree`] on `local`, this rank's outcome of a phase every member ran: this rank's
/// own error as it is, else [`CheckpointError::RankFailed`] naming the members that
/// failed, else the value.
pub(crate) fn agree_on<T>(group: &ProcessGroup, op: &'static str, local: Result<T>) -> Result<T> {
    let status = local.as_ref().map(|_| ()).map_err(|e| e.to_string());
    let failed = agree(group, &status)?;
    let value = local?;
    match failed.first() {
        None => Ok(value),
        Some((_, what)) => Err(CheckpointError::RankFailed {
            op,
            ranks: failed.iter().map(|f| f.0).collect(),
            what: what.clone(),
        }),
    }
}
