//! The data pipeline: DistributedSampler (torch's semantics), the byte tokenizer, the
//! pretraining dataset and collation, and the shipped corpus. HuggingFace tokenizers
//! are tested in `hf.rs`.

use std::collections::BTreeSet;

use tpar_data::{
    collate, default_corpus, default_documents, load_documents, load_documents_with_column,
    split_documents, ByteTokenizer, DistributedSampler, PretrainingDataset, Tokenizer,
};

// ---------------------------------------------------------------------------------------
// DistributedSampler
// ---------------------------------------------------------------------------------------

fn all_ranks(
    len: usize,
    replicas: usize,
    shuffle: bool,
    drop_last: bool,
    epoch: u64,
) -> Vec<Vec<usize>> {
    (0..replicas)
        .map(|r| {
            let mut s = DistributedSampler::new(replicas, r)
                .unwrap()
                .with_shuffle(shuffle)
                .with_seed(42)
                .with_drop_last(drop_last);
            s.set_epoch(epoch);
            s.indices(len)
        })
        .collect()
}

#[test]
fn sampler_splits_disjoint_and_covering_when_divisible() {
    for replicas in [1, 2, 3, 4] {
        let len = 12 * replicas;
        let per = all_ranks(len, replicas, true, false, 0);
        let mut seen = BTreeSet::new();
        for idx in &per {
            assert_eq!(idx.len(), 12);
            for &i in idx {
                assert!(seen.insert(i), "index {i} given twice");
            }
        }
        assert_eq!(seen, (0..len).collect(), "covers the dataset");
    }
}

#[test]
fn sampler_pads_by_wrapping_or_drops_the_tail_like_torch() {
    // len 10 over 4 replicas, no shuffle: [0..10] + [0, 1], rank r takes r::4.
    let per = all_ranks(10, 4, false, false, 0);
    assert_eq!(per, vec![vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]);
    // drop_last: num_samples = ceil((10 - 4) / 4) = 2, the list is cut to 8.
    let per = all_ranks(10, 4, false, true, 0);
    assert_eq!(per, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
    // Padding longer than the list repeats it: len 1 over 4 -> [0, 0, 0, 0].
    assert_eq!(all_ranks(1, 4, false, false, 0), vec![vec![0]; 4]);
    assert_eq!(all_ranks(3, 4, false, false, 0), vec![vec![0], vec![1], vec![2], vec![0]]);
    // Empty dataset, and drop_last with fewer items than replicas.
    assert_eq!(all_ranks(0, 3, true, false, 0), vec![Vec::<usize>::new(); 3]);
    assert_eq!(all_ranks(2, 3, true, true, 0), vec![Vec::<usize>::new(); 3]);
    // Shuffled and padded: every index appears, the padding repeats a few.
    let per = all_ranks(10, 4, true, false, 3);
    let all: Vec<usize> = per.concat();
    assert_eq!(all.len(), 12);
    assert_eq!(all.iter().copied().collect::<BTreeSet<_>>(), (0..10).collect());
    let s = DistributedSampler::new(4, 0).unwrap();
    assert_eq!((s.num_samples(10), s.total_size(10)), (3, 12));
    let s = s.with_drop_last(true);
    assert_eq!((s.num_samples(10), s.total_size(10)), (2, 8));
}

#[test]
fn sampler_is_deterministic_per_epoch_and_differs_across_epochs() {
    let a = all_ranks(100, 2, true, false, 0);
    assert_eq!(a, all_ranks(100, 2, true, false, 0), "same seed and epoch, same order");
    let b = all_ranks(100, 2, true, false, 1);
    assert_ne!(a, b, "a new epoch reshuffles");
    assert_ne!(a[0], (0..100).step_by(2).collect::<Vec<_>>(), "shuffled");
    let mut other_seed = DistributedSampler::new(2, 0).unwrap().with_seed(43);
    other_seed.set_epoch(0);
    assert_ne!(other_seed.indices(100), a[0]);
}

#[test]
fn sampler_rejects_bad_ranks() {
    assert!(DistributedSampler::new(0, 0).is_err());
    assert!(DistributedSampler::new(2, 2).is_err());
}
// ---------------------------------------------------------------------------------------
// Tokenizers
// ---------------------------------------------------------------------------------------
#[test]
fn byte_tokenizer_round_trips_any_text() {
    let t = ByteTokenizer;
    for s in ["", "hello, world", "Grüße — naïve café 日本語 🚀", "a\nb\tc"] {
        let ids = t.encode(s).unwrap();
        assert_eq!(ids.len(), s.len());
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids).unwrap(), s);
    }
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id(), t.vocab_size()), (256, 257, 258, 259));
    let mut ids = vec![ByteTokenizer::BOT];
    ids.extend(t.encode("hi").unwrap());
    ids.extend([ByteTokenizer::EOT, ByteTokenizer::PAD, 9999]);
    assert_eq!(t.decode(&ids).unwrap(), "hi", "specials and unknown ids are skipped");
}

#[test]
fn byte_tokenizer_spells_special_names_as_plain_bytes() {
    // The byte tokenizer has no added tokens: "[BOT]" in a document is five bytes, never
    // the special id, and decodes back to itself; only the dataset inserts specials.
    let t = ByteTokenizer;
    let specials = [t.bot_id(), t.eot_id(), t.pad_id()];
    assert!(specials.iter().all(|&s| s >= 256 && (s as usize) < t.vocab_size()));
    assert!(specials[0] != specials[1] && specials[1] != specials[2] && specials[0] != specials[2]);
    for s in ["[BOT]", "[EOT]", "[PAD]", "a[PAD]b[BOT][EOT]"] {
        let ids = t.encode(s).unwrap();
        assert_eq!(ids, s.bytes().map(u32::from).collect::<Vec<_>>(), "{s}");
        assert!(ids.iter().all(|i| !specials.contains(i)), "{s}: {ids:?}");
        assert_eq!(t.decode(&ids).unwrap(), s);
    }
}

/// Without the `hf-tokenizers` feature the type still exists and says what is missing.
#[cfg(not(feature = "hf-tokenizers"))]
#[test]
fn hf_tokenizer_is_unavailable_without_its_feature() {
    use tpar_data::{load_tokenizer, DataError, HfTokenizer};
    let e = HfTokenizer::from_json_str("{}").unwrap_err();
    assert!(matches!(e, DataError::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains("hf-tokenizers"), "{e}");
    let e = load_tokenizer(Some(std::path::Path::new("tokenizer.json"))).err().unwrap();
    assert!(matches!(e, DataError::Unavailable { .. }), "{e}");
}

// ---------------------------------------------------------------------------------------
// Dataset, collation, corpus
// ---------------------------------------------------------------------------------------

#[test]
fn dataset_pads_clips_and_masks_like_the_reference() {
    let (b, e, p) = (256, 257, 258);
    let ds = PretrainingDataset::new(&["hi", "abcdefgh", "abcde"], &ByteTokenizer, 6).unwrap();
    assert_eq!(ds.len(), 3);
    // Short: [BOT] h i [EOT] then [PAD] to seq + 1 = 7.
    let s = ds.get(0).unwrap();
    assert_eq!(s.input_ids, vec![b, 104, 105, e, p, p]);
    assert_eq!(s.target_ids, vec![104, 105, e, p, p, p]);
    assert_eq!(s.attention_mask, vec![1, 1, 1, 1, 0, 0]);
    // Long: clipped to 7 tokens ([EOT] is lost).
    let s = ds.get(1).unwrap();
    assert_eq!(s.input_ids, vec![b, 97, 98, 99, 100, 101]);
    assert_eq!(s.target_ids, vec![97, 98, 99, 100, 101, 102]);
    assert_eq!(s.attention_mask, vec![1; 6]);
    // Exactly seq + 1 with the specials: no padding, [EOT] is the last target.
    let s = ds.get(2).unwrap();
    assert_eq!(s.input_ids, vec![b, 97, 98, 99, 100, 101]);
    assert_eq!(s.target_ids, vec![97, 98, 99, 100, 101, e]);
    assert_eq!(s.attention_mask, vec![1; 6]);
    assert!(ds.get(3).is_none());
    assert_eq!(ds.pad_id(), 258);
    assert!(PretrainingDataset::new(&["x"], &ByteTokenizer, 0).is_err());
}

#[test]
fn collate_stacks_samples_into_i64_batches() {
    let ds = PretrainingDataset::new(&["one", "two two", "three three three"], &ByteTokenizer, 8)
        .unwrap();
    let batch = ds.batch(&[2, 0]).unwrap();
    for t in [&batch.input_ids, &batch.target_ids, &batch.attention_mask] {
        assert_eq!(t.dims(), &[2, 8]);
        assert_eq!(t.dtype(), tpar_tensor::DType::I64);
    }
    let ids = batch.input_ids.to_vec::<i64>().unwrap();
    assert_eq!(&ids[..8], ds.get(2).unwrap().input_ids.as_slice());
    assert_eq!(&ids[8..], ds.get(0).unwrap().input_ids.as_slice());
    // "one": [BOT] o n e [EOT] = 5 tokens, 3 pads; "three three three" fills all 8.
    assert_eq!(batch.num_tokens().unwrap(), 8 + 5);
    assert!(collate(&[]).is_err());
    let mut odd = ds.get(0).unwrap();
    odd.target_ids.pop();
    assert!(collate(&[ds.get(1).unwrap(), odd]).is_err());
    assert!(ds.batch(&[7]).is_err());
    assert!(ds.batch(&[]).is_err());
    // `batch` builds in place what collating the samples gives.
    let c = collate(&[ds.get(1).unwrap(), ds.get(2).unwrap(), ds.get(0).unwrap()]).unwrap();
    let b = ds.batch(&[1, 2, 0]).unwrap();
    for (x, y) in [
        (&b.input_ids, &c.input_ids),
        (&b.target_ids, &c.target_ids),
        (&b.attention_mask, &c.attention_mask),
    ] {
        assert_eq!(x.to_vec::<i64>().unwrap(), y.to_vec::<i64>().unwrap());
    }
    // A sequence length no machine holds: a typed error naming the bytes, not an abort.
    let long = PretrainingDataset::new(&["one"], &ByteTokenizer, 1 << 50).unwrap();
    let m = long.batch(&[0, 0]).unwrap_err().to_string();
    assert!(m.contains("cannot allocate") && m.contains("bytes"), "{m}");
}

#[test]
fn the_shipped_corpus_is_small_and_split_into_documents() {
    let text = default_corpus();
    assert!(text.len() > 100_000 && text.len() <= 400_000, "{} bytes", text.len());
    let docs = default_documents();
    assert!(docs.len() > 500, "{} documents", docs.len());
    assert!(docs.iter().all(|d| !d.is_empty() && d.trim() == *d));
    assert!(docs.iter().all(|d| !d.contains("\n\n")));
    let ds = PretrainingDataset::new(&docs, &ByteTokenizer, 128).unwrap();
    assert_eq!(ds.len(), docs.len());
    assert_eq!(split_documents("a\n\n \n b\nc \n\n\nd"), vec!["a", "b\nc", "d"]);
    assert!(split_documents(" \n\n").is_empty());
}

#[test]
fn documents_load_from_text_and_jsonl_files() {
    let dir = std::env::temp_dir().join(format!("tpar-data-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let txt = dir.join("docs.txt");
    std::fs::write(&txt, "first doc\nline two\n\nsecond doc\n").unwrap();
    assert_eq!(load_documents(&txt).unwrap(), vec!["first doc\nline two", "second doc"]);
    let jsonl = dir.join("docs.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"a b\"}\n\n{\"text\": \"c\\nd\"}\n").unwrap();
    assert_eq!(load_documents(&jsonl).unwrap(), vec!["a b", "c\nd"]);
    // Another field by name, as parquet's --text-column; a line without it names it.
    std::fs::write(&jsonl, "{\"content\": \"e\", \"text\": \"f\"}\n{\"content\": \"g\"}\n")
        .unwrap();
    assert_eq!(load_documents_with_column(&jsonl, "content").unwrap(), vec!["e", "g"]);
    let e = load_documents(&jsonl).unwrap_err().to_string();
    assert!(e.contains("docs.jsonl:2: no string field \"text\""), "{e}");
    std::fs::write(&jsonl, "{\"txt\": 1}\n").unwrap();
    assert!(load_documents(&jsonl).is_err());
    assert!(load_documents_with_column(&jsonl, "txt").is_err(), "a number is not a document");
    assert!(load_documents(&dir.join("missing.txt")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}
