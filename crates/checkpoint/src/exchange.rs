//! Small messages between ranks: every rank's bytes to every rank.

use tpar_collectives::ProcessGroup;
use tpar_tensor::Tensor;

use crate::{CheckpointError, Result};

/// Every member's `bytes`, in group-rank order, on every member (two all_gathers: the
/// lengths, then the bytes packed eight to an i64 and padded to the longest).
pub(crate) fn all_gather_bytes(group: &ProcessGroup, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    if group.size() == 1 {
        return Ok(vec![bytes.to_vec()]);
    }
    let len = Tensor::from_vec(vec![bytes.len() as i64], [1])?;
    let lens = group.all_gather(&len, 0)?.to_vec::<i64>()?;
    let words = lens.iter().map(|&l| (l as usize).div_ceil(8)).max().unwrap_or(0).max(1);
    let mut packed = vec![0i64; words];
    for (i, c) in bytes.chunks(8).enumerate() {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        packed[i] = i64::from_le_bytes(w);
    }
    let all = group.all_gather(&Tensor::from_vec(packed, [1, words])?, 0)?.to_vec::<i64>()?;
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &l)| {
            let mut out: Vec<u8> =
                all[r * words..(r + 1) * words].iter().flat_map(|w| w.to_le_bytes()).collect();
            out.truncate(l as usize);
            out
        })
        .collect())
}

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
    Ok(all_gather_bytes(group, &msg)?
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
