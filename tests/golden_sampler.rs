//! `DistributedSampler` against the index lists of `torch.utils.data.DistributedSampler`
//! (`tests/golden/make_sampler_golden.py`, written to `tests/golden/sampler.json`).
//!
//! Unshuffled, every rank's list must equal torch's exactly. Shuffled, tpar draws its
//! permutation from its own generator, so the lists differ from torch's; what must match
//! is the structure: the per-rank lengths, rank `r` taking positions `r, r + R, ...` of
//! one permutation shared by all ranks, the padding (the permutation's first entries,
//! wrapping around) or the dropped tail, and the permutation's dependence on the seed
//! and epoch (through `seed + epoch`, as torch's).

mod common;

use tpar_data::DistributedSampler;

/// One sampler configuration and torch's index lists for it.
#[derive(Debug)]
struct Case {
    len: usize,
    num_replicas: usize,
    shuffle: bool,
    drop_last: bool,
    seed: u64,
    epoch: u64,
    /// `ranks[r]`: the indices rank `r` gets.
    ranks: Vec<Vec<usize>>,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "len {} replicas {} shuffle {} drop_last {} seed {} epoch {}",
            self.len, self.num_replicas, self.shuffle, self.drop_last, self.seed, self.epoch
        )
    }

    /// tpar's index lists for this configuration, one per rank.
    fn tpar_ranks(&self) -> Vec<Vec<usize>> {
        self.tpar_ranks_with(self.drop_last)
    }

    fn tpar_ranks_with(&self, drop_last: bool) -> Vec<Vec<usize>> {
        (0..self.num_replicas)
            .map(|r| {
                let mut s = DistributedSampler::new(self.num_replicas, r)
                    .unwrap()
                    .with_shuffle(self.shuffle)
                    .with_seed(self.seed)
                    .with_drop_last(drop_last);
                s.set_epoch(self.epoch);
                s.indices(self.len)
            })
            .collect()
    }
}

fn cases() -> Vec<Case> {
    let path = common::golden::path("sampler.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let num = |c: &serde_json::Value, k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{k}"));
    let flag = |c: &serde_json::Value, k: &str| c[k].as_bool().unwrap_or_else(|| panic!("{k}"));
    json["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            len: num(c, "len") as usize,
            num_replicas: num(c, "num_replicas") as usize,
            shuffle: flag(c, "shuffle"),
            drop_last: flag(c, "drop_last"),
            seed: num(c, "seed"),
            epoch: num(c, "epoch"),
            ranks: c["ranks"]
                .as_array()
                .expect("ranks")
                .iter()
                .map(|r| {
                    r.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as usize).collect()
                })
                .collect(),
        })
        .collect()
}

/// The global list the ranks stride through: `global[i * R + r] = ranks[r][i]` (every
/// rank must hold the same number of indices).
fn interleave(what: &str, ranks: &[Vec<usize>]) -> Vec<usize> {
    let n = ranks[0].len();
    assert!(ranks.iter().all(|r| r.len() == n), "{what}: ranks of unequal lengths");
    (0..n).flat_map(|i| ranks.iter().map(move |r| r[i])).collect()
}

/// Checks `ranks` has the structure of torch's sampler for `c` and returns the
/// interleaved global list: without drop_last, a permutation of `0..len` followed by its
/// first entries again (wrapping around as often as needed) up to the padded length;
/// with drop_last, distinct indices below `len` (the head of a permutation).
fn check_structure(what: &str, c: &Case, ranks: &[Vec<usize>]) -> Vec<usize> {
    assert_eq!(ranks.len(), c.num_replicas, "{what}: one list per rank");
    let global = interleave(what, ranks);
    let mut seen = vec![false; c.len];
    let distinct = if c.drop_last { global.len() } else { c.len };
    assert!(global.len() >= distinct, "{what}: {} indices for {} items", global.len(), c.len);
    for &i in &global[..distinct] {
        assert!(i < c.len, "{what}: index {i} out of range");
        assert!(!seen[i], "{what}: index {i} repeated before the padding");
        seen[i] = true;
    }
    if !c.drop_last {
        let pad: Vec<usize> =
            global[..c.len].iter().copied().cycle().take(global.len() - c.len).collect();
        assert_eq!(global[c.len..], pad[..], "{what}: padding is not the permutation's head");
    }
    global
}

#[test]
fn unshuffled_indices_equal_torch_exactly() {
    let cases = cases();
    let mut checked = 0;
    for c in cases.iter().filter(|c| !c.shuffle) {
        assert_eq!(c.tpar_ranks(), c.ranks, "{}", c.name());
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} unshuffled cases");
}

#[test]
fn shuffled_per_rank_lengths_equal_torch() {
    for c in cases().iter().filter(|c| c.shuffle) {
        let got: Vec<usize> = c.tpar_ranks().iter().map(Vec::len).collect();
        let want: Vec<usize> = c.ranks.iter().map(Vec::len).collect();
        assert_eq!(got, want, "{}", c.name());
    }
}

#[test]
fn shuffled_lists_have_torch_structure() {
    for c in cases().iter().filter(|c| c.shuffle) {
        // The golden lists first, so the structure asserted is torch's.
        check_structure(&format!("torch, {}", c.name()), c, &c.ranks);
        check_structure(&format!("tpar, {}", c.name()), c, &c.tpar_ranks());
    }
}

/// With drop_last, the kept indices are the head of the same epoch's permutation (the
/// tail is dropped), for torch's lists and for tpar's.
#[test]
fn drop_last_keeps_the_head_of_the_same_permutation() {
    let cases = cases();
    for c in cases.iter().filter(|c| c.shuffle && c.drop_last) {
        let padded = cases
            .iter()
            .find(|p| {
                !p.drop_last
                    && p.shuffle
                    && (p.len, p.num_replicas, p.seed, p.epoch)
                        == (c.len, c.num_replicas, c.seed, c.epoch)
            })
            .expect("the same case without drop_last");
        let head = |ranks: &[Vec<usize>], padded: &[Vec<usize>]| {
            let kept = interleave(&c.name(), ranks);
            let all = interleave(&c.name(), padded);
            (kept.clone(), all[..kept.len()].to_vec())
        };
        let (kept, want) = head(&c.ranks, &padded.ranks);
        assert_eq!(kept, want, "torch, {}", c.name());
        let (kept, want) = head(&c.tpar_ranks(), &c.tpar_ranks_with(false));
        assert_eq!(kept, want, "tpar, {}", c.name());
    }
}

/// The permutation (recovered from the padded lists) changes with the seed and with the
/// epoch, is the same for the same (seed, epoch), and is equal for two (seed, epoch)
/// pairs exactly when torch's are (both seed their generator with `seed + epoch`).
#[test]
fn shuffle_depends_on_seed_and_epoch_as_torch() {
    let cases = cases();
    let padded: Vec<&Case> =
        cases.iter().filter(|c| c.shuffle && !c.drop_last && c.len >= 7).collect();
    let perm = |c: &Case, ranks: &[Vec<usize>]| interleave(&c.name(), ranks)[..c.len].to_vec();
    let mut pairs = 0;
    let mut equal_pairs = 0;
    for a in &padded {
        let tpar_a = perm(a, &a.tpar_ranks());
        assert_eq!(tpar_a, perm(a, &a.tpar_ranks()), "{}: not deterministic", a.name());
        let identity: Vec<usize> = (0..a.len).collect();
        assert_ne!(perm(a, &a.ranks), identity, "torch, {}", a.name());
        assert_ne!(tpar_a, identity, "tpar, {}: not shuffled", a.name());
        for b in &padded {
            if (a.len, a.num_replicas) != (b.len, b.num_replicas) || a.name() >= b.name() {
                continue;
            }
            let torch_equal = perm(a, &a.ranks) == perm(b, &b.ranks);
            let tpar_equal = tpar_a == perm(b, &b.tpar_ranks());
            assert_eq!(
                tpar_equal,
                torch_equal,
                "{} vs {}: torch's permutations are {}equal",
                a.name(),
                b.name(),
                if torch_equal { "" } else { "not " }
            );
            pairs += 1;
            equal_pairs += usize::from(torch_equal);
        }
    }
    assert!(pairs >= 50 && equal_pairs >= 6, "{pairs} pairs, {equal_pairs} equal");
}
