//! Cutting a sequence of blocks (a model's decoder layers) into pipeline stages.

use std::ops::Range;

use crate::{PipelineError, Result};

/// The blocks each of `num_stages` stages owns, for a model of `num_blocks` blocks in
/// sequence: contiguous ranges covering `0..num_blocks` in order.
///
/// - `boundaries: None` splits evenly; when the blocks do not divide, the first
///   `num_blocks % num_stages` stages get one block more (`10` blocks over `4` stages:
///   `3, 3, 2, 2`).
/// - `boundaries: Some(b)` gives the `num_stages - 1` block indices where stages
///   `1..num_stages` start, non-decreasing and at most `num_blocks` (`[4, 6]` over 8
///   blocks: `0..4, 4..6, 6..8`). A stage may own no block (then it runs only what the
///   model puts before the first block or after the last, or passes its input through).
///
/// ```
/// use tpar_pipeline::split_blocks;
/// assert_eq!(split_blocks(10, 4, None)?, vec![0..3, 3..6, 6..8, 8..10]);
/// assert_eq!(split_blocks(8, 3, Some(&[4, 6]))?, vec![0..4, 4..6, 6..8]);
/// assert!(split_blocks(8, 3, Some(&[6, 4])).is_err());
/// # Ok::<(), tpar_pipeline::PipelineError>(())
/// ```
pub fn split_blocks(
    num_blocks: usize,
    num_stages: usize,
    boundaries: Option<&[usize]>,
) -> Result<Vec<Range<usize>>> {
    let err = |what: String| PipelineError::Split { what };
    if num_stages == 0 {
        return Err(err("a pipeline needs at least one stage, got 0".into()));
    }
    let starts: Vec<usize> = match boundaries {
        None => {
            let (base, extra) = (num_blocks / num_stages, num_blocks % num_stages);
            (0..num_stages).map(|i| i * base + i.min(extra)).collect()
        }
        Some(b) => {
            if b.len() + 1 != num_stages {
                return Err(err(format!(
                    "{} stages need {} boundaries, got {} ({b:?})",
                    num_stages,
                    num_stages - 1,
                    b.len()
                )));
            }
            let mut prev = 0;
            for &x in b {
                if x < prev || x > num_blocks {
                    return Err(err(format!(
                        "boundaries {b:?} must be non-decreasing and at most the {num_blocks} blocks"
                    )));
                }
                prev = x;
            }
            std::iter::once(0).chain(b.iter().copied()).collect()
        }
    };
    Ok((0..num_stages)
        .map(|i| starts[i]..starts.get(i + 1).copied().unwrap_or(num_blocks))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_splits_cover_every_block_once_in_order() {
        for n in 0..20 {
            for k in 1..8 {
                let r = split_blocks(n, k, None).unwrap();
                assert_eq!(r.len(), k);
                assert_eq!(r[0].start, 0);
                assert_eq!(r[k - 1].end, n);
                for w in r.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    // Sizes differ by at most one, larger first.
                    assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
                }
            }
        }
    }

    #[test]
    fn bad_boundaries_are_errors() {
        assert!(split_blocks(8, 0, None).is_err());
        assert!(split_blocks(8, 3, Some(&[4])).is_err());
        assert!(split_blocks(8, 2, Some(&[9])).is_err());
        let e = split_blocks(8, 3, Some(&[5, 2])).unwrap_err().to_string();
        assert!(e.contains("non-decreasing"), "{e}");
        assert_eq!(split_blocks(8, 3, Some(&[0, 8])).unwrap(), vec![0..0, 0..8, 8..8]);
    }
}
