//! The data pipeline: DistributedSampler (torch's semantics), tokenizers, the
//! pretraining dataset and collation, and the shipped corpus.

use std::collections::BTreeSet;

use tpar_data::{
    collate, default_corpus, default_documents, load_documents, split_documents, ByteTokenizer,
    DistributedSampler, HfTokenizer, PretrainingDataset, Tokenizer,
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
        let ids = t.encode(s);
        assert_eq!(ids.len(), s.len());
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids), s);
    }
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id(), t.vocab_size()), (256, 257, 258, 259));
    let mut ids = vec![ByteTokenizer::BOT];
    ids.extend(t.encode("hi"));
    ids.extend([ByteTokenizer::EOT, ByteTokenizer::PAD, 9999]);
    assert_eq!(t.decode(&ids), "hi", "specials and unknown ids are skipped");
}

const WORD_LEVEL: &str = r#"{
  "version": "1.0",
  "added_tokens": [
    {"id": 0, "content": "[PAD]", "special": true},
    {"id": 1, "content": "[BOT]", "special": true},
    {"id": 2, "content": "[EOT]", "special": true},
    {"id": 3, "content": "[UNK]", "special": true}
  ],
  "normalizer": {"type": "Lowercase"},
  "pre_tokenizer": {"type": "Whitespace"},
  "model": {"type": "WordLevel", "vocab": {"[PAD]": 0, "[BOT]": 1, "[EOT]": 2, "[UNK]": 3,
            "the": 4, "cat": 5, "sat": 6, ".": 7, "on": 8, "mat": 9}, "unk_token": "[UNK]"},
  "decoder": null
}"#;

#[test]
fn hf_word_level_encodes_and_decodes() {
    let t = HfTokenizer::from_json_str(WORD_LEVEL).unwrap();
    assert_eq!(t.encode("The cat sat on the mat."), vec![4, 5, 6, 8, 4, 9, 7]);
    assert_eq!(t.encode("The dog sat"), vec![4, 3, 6], "unknown word -> [UNK]");
    assert_eq!(t.encode("[BOT]the cat[EOT]"), vec![1, 4, 5, 2], "added tokens match first");
    assert_eq!((t.pad_id(), t.bot_id(), t.eot_id(), t.vocab_size()), (0, 1, 2, 10));
    assert_eq!(t.decode(&[1, 4, 5, 6, 2, 0]), "the cat sat");
}

/// A tiny GPT-2-style byte-level BPE: "Ġ" is the byte-level space.
const BYTE_BPE: &str = r#"{
  "added_tokens": [{"id": 12, "content": "<|endoftext|>", "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
  "decoder": {"type": "ByteLevel"},
  "model": {"type": "BPE", "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6,
    "d": 7, "he": 8, "ll": 9, "hell": 10, "Ġw": 11, "<|endoftext|>": 12, "!": 13, "'": 14, "s": 15},
    "merges": ["h e", "l l", "he ll", ["Ġ", "w"]]}
}"#;

#[test]
fn hf_byte_level_bpe_merges_by_rank_and_round_trips() {
    let t = HfTokenizer::from_json_str(BYTE_BPE).unwrap();
    // "hello world": "hello" -> hell + o; " world" -> Ġw o r l d.
    assert_eq!(t.encode("hello world"), vec![10, 3, 11, 3, 6, 2, 7]);
    assert_eq!(t.decode(&t.encode("hello world!")), "hello world!");
    assert_eq!(t.decode(&t.encode("he's")), "he's");
    // BOT and EOT both fall back to <|endoftext|>; PAD is missing and gets a new id.
    assert_eq!((t.bot_id(), t.eot_id()), (12, 12));
    assert_eq!(t.pad_id(), 16);
    assert_eq!(t.vocab_size(), 17);
    assert_eq!(t.id_to_token(16), Some("[PAD]"));
    assert_eq!(t.token_to_id("hell"), Some(10));
}

/// A Llama-2-style file: Prepend/Replace normalizer, byte-fallback BPE, and the
/// Replace/ByteFallback/Fuse/Strip decoder chain.
const LLAMA_LIKE: &str = r#"{
  "added_tokens": [
    {"id": 0, "content": "<unk>", "special": true},
    {"id": 1, "content": "<s>", "special": true},
    {"id": 2, "content": "</s>", "special": true}
  ],
  "normalizer": {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
  "pre_tokenizer": null,
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "byte_fallback": true, "fuse_unk": true, "unk_token": "<unk>",
    "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, "▁": 5, "h": 6, "i": 7,
              "▁h": 8, "▁hi": 9, "c": 10, "a": 11, "f": 12},
    "merges": ["▁ h", "▁h i"]}
}"#;

#[test]
fn hf_llama_style_bpe_uses_byte_fallback() {
    let t = HfTokenizer::from_json_str(LLAMA_LIKE).unwrap();
    assert_eq!(t.encode("hi hi"), vec![9, 9]);
    // "é" is not in the vocabulary: its UTF-8 bytes C3 A9.
    assert_eq!(t.encode("café"), vec![5, 10, 11, 12, 3, 4]);
    assert_eq!(t.decode(&t.encode("hi café")), "hi café");
    assert_eq!(t.encode("x"), vec![5, 0], "no byte tokens for x: <unk>");
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id()), (1, 2, 13));
}

const WORD_PIECE: &str = r###"{
  "added_tokens": [{"id": 0, "content": "[PAD]", "special": true},
                   {"id": 1, "content": "[UNK]", "special": true},
                   {"id": 2, "content": "[CLS]", "special": true},
                   {"id": 3, "content": "[SEP]", "special": true}],
  "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                 "strip_accents": null, "lowercase": true},
  "pre_tokenizer": {"type": "BertPreTokenizer"},
  "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
  "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "play": 4, "##ing": 5,
                      "##ed": 6, "we": 7, ".": 8}}
}"###;

#[test]
fn hf_word_piece_splits_greedily() {
    let t = HfTokenizer::from_json_str(WORD_PIECE).unwrap();
    assert_eq!(t.encode("We played."), vec![7, 4, 6, 8]);
    assert_eq!(t.encode("playful"), vec![1]);
    assert_eq!(t.decode(&t.encode("We were playing.")), "we playing.", "[UNK] is special: skipped");
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id()), (2, 3, 0));
}

#[test]
fn hf_unsupported_or_broken_files_are_errors() {
    let regex = BYTE_BPE.replace(
        r#""pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}"#,
        r#""pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated"}"#,
    );
    let e = HfTokenizer::from_json_str(&regex).unwrap_err().to_string();
    assert!(e.contains("regex"), "{e}");
    assert!(HfTokenizer::from_json_str("{").is_err());
    assert!(HfTokenizer::from_json_str("{}").is_err());
    let unigram = r#"{"model": {"type": "Unigram", "vocab": {}}}"#;
    assert!(HfTokenizer::from_json_str(unigram).unwrap_err().to_string().contains("Unigram"));
    let bad_merge = r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}"#;
    assert!(HfTokenizer::from_json_str(bad_merge).is_err());
    assert!(HfTokenizer::from_file(std::path::Path::new("/nonexistent/tokenizer.json")).is_err());
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
    std::fs::write(&jsonl, "{\"txt\": 1}\n").unwrap();
    assert!(load_documents(&jsonl).is_err());
    assert!(load_documents(&dir.join("missing.txt")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------
// Special tokens
// ---------------------------------------------------------------------------------------

#[test]
fn byte_tokenizer_spells_special_names_as_plain_bytes() {
    // The byte tokenizer has no added tokens: "[BOT]" in a document is five bytes, never
    // the special id, and decodes back to itself; only the dataset inserts specials.
    let t = ByteTokenizer;
    let specials = [t.bot_id(), t.eot_id(), t.pad_id()];
    assert!(specials.iter().all(|&s| s >= 256 && (s as usize) < t.vocab_size()));
    assert!(specials[0] != specials[1] && specials[1] != specials[2] && specials[0] != specials[2]);
    for s in ["[BOT]", "[EOT]", "[PAD]", "a[PAD]b[BOT][EOT]"] {
        let ids = t.encode(s);
        assert_eq!(ids, s.bytes().map(u32::from).collect::<Vec<_>>(), "{s}");
        assert!(ids.iter().all(|i| !specials.contains(i)), "{s}: {ids:?}");
        assert_eq!(t.decode(&ids), s);
    }
}

/// WordLevel with the specials at scattered ids, `<s>`/`</s>` as well (which lose to
/// `[BOT]`/`[EOT]`), and one added token that is not special.
const SCATTERED_SPECIALS: &str = r#"{
  "added_tokens": [
    {"id": 0, "content": "<s>", "special": true},
    {"id": 1, "content": "</s>", "special": true},
    {"id": 3, "content": "[EOT]", "special": true},
    {"id": 5, "content": "[BOT]", "special": true},
    {"id": 7, "content": "[PAD]", "special": true},
    {"id": 8, "content": "<sep>", "special": false},
    {"id": 9, "content": "[UNK]", "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "model": {"type": "WordLevel", "unk_token": "[UNK]", "vocab": {"<s>": 0, "</s>": 1,
            "the": 2, "[EOT]": 3, "cat": 4, "[BOT]": 5, "sat": 6, "[PAD]": 7, "<sep>": 8,
            "[UNK]": 9}},
  "decoder": null
}"#;

/// Llama-3 names for BOT and EOT next to `<s>`/`</s>`, and no padding token.
const LLAMA3_NAMES: &str = r#"{
  "added_tokens": [
    {"id": 1, "content": "<s>", "special": true},
    {"id": 2, "content": "</s>", "special": true},
    {"id": 10, "content": "<|begin_of_text|>", "special": true},
    {"id": 11, "content": "<|end_of_text|>", "special": true}
  ],
  "pre_tokenizer": {"type": "Whitespace"},
  "model": {"type": "WordLevel", "unk_token": "<unk>",
            "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}}
}"#;

#[test]
fn hf_specials_are_found_by_name_in_the_documented_order() {
    let t = HfTokenizer::from_json_str(SCATTERED_SPECIALS).unwrap();
    let ids = |name: &str| t.token_to_id(name).unwrap();
    assert_eq!(t.bot_id(), ids("[BOT]"), "[BOT] comes before <s>");
    assert_eq!(t.eot_id(), ids("[EOT]"), "[EOT] comes before </s>");
    assert_eq!(t.pad_id(), ids("[PAD]"));
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id()), (5, 3, 7));
    assert_eq!(t.vocab_size(), 10);

    let t = HfTokenizer::from_json_str(LLAMA3_NAMES).unwrap();
    assert_eq!(t.bot_id(), 10, "<|begin_of_text|> comes before <s>");
    assert_eq!(t.eot_id(), 11, "<|end_of_text|> comes before </s>");
    // No padding token in the file: a new id past the vocabulary, named [PAD].
    assert_eq!((t.pad_id(), t.vocab_size()), (12, 13));
    assert_eq!(t.id_to_token(t.pad_id()), Some("[PAD]"));
}

#[test]
fn hf_added_tokens_match_inside_text_and_decode_drops_only_specials() {
    // As HF `tokenizers`: added tokens are cut out of the raw text first, even with no
    // space around them; decoding skips special tokens, not other added ones.
    let t = HfTokenizer::from_json_str(SCATTERED_SPECIALS).unwrap();
    let (bot, eot, pad) = (t.bot_id(), t.eot_id(), t.pad_id());
    let (the, cat, sat, sep) = (2, 4, 6, 8);
    assert_eq!(t.encode("[BOT]"), vec![bot]);
    assert_eq!(t.encode("the[PAD]cat <sep> sat[EOT]"), vec![the, pad, cat, sep, sat, eot]);
    assert_eq!(t.encode("<s>the</s>"), vec![0, the, 1]);
    assert_eq!(t.decode(&[bot, the, cat, sep, sat, eot, pad, pad]), "the cat <sep> sat");
    assert_eq!(t.decode(&[0, the, 1, 9]), "the", "<s>, </s> and [UNK] are special too");

    // Byte-level BPE: the file's <|endoftext|> (BOT and EOT both) is matched mid-word;
    // the [PAD] the tokenizer had to add is not in the file, so text never yields it.
    let t = HfTokenizer::from_json_str(BYTE_BPE).unwrap();
    let (eot, pad) = (t.eot_id(), t.pad_id());
    let hello = t.encode("hello");
    let mut want = hello.clone();
    want.push(eot);
    want.extend(&hello);
    assert_eq!(t.encode("hello<|endoftext|>hello"), want);
    assert!(!t.encode("[PAD] hello [PAD]").contains(&pad));
    let mut ids = vec![t.bot_id()];
    ids.extend(t.encode("hello world"));
    ids.extend([eot, pad, pad]);
    assert_eq!(t.decode(&ids), "hello world");
}

/// Checks one sample of a document of `n` tokens: `[BOT]` first, then the tokens,
/// `[EOT]` right after them (unless clipped), `[PAD]` after that; targets are the
/// inputs shifted by one, `[PAD]` (the loss's ignore_index) where nothing follows.
fn check_sample(t: &dyn Tokenizer, ds: &PretrainingDataset, index: usize, doc: &str) {
    let s = ds.get(index).unwrap();
    let seq = ds.seq_length();
    let (bot, eot, pad) = (t.bot_id() as i64, t.eot_id() as i64, t.pad_id() as i64);
    let toks: Vec<i64> = t.encode(doc).iter().map(|&i| i as i64).collect();
    assert_eq!(ds.pad_id() as i64, pad);
    assert_eq!(s.input_ids[0], bot, "{doc:?}: BOT first");
    // The stream [BOT] tokens [EOT] [PAD]..., one longer than the sample.
    let stream = |p: usize| match p {
        0 => bot,
        p if p <= toks.len() => toks[p - 1],
        p if p == toks.len() + 1 => eot,
        _ => pad,
    };
    for p in 0..seq {
        assert_eq!(s.input_ids[p], stream(p), "{doc:?}: input {p}");
        assert_eq!(s.target_ids[p], stream(p + 1), "{doc:?}: target {p}");
        assert_eq!(s.attention_mask[p], i64::from(p <= toks.len() + 1), "{doc:?}: mask {p}");
    }
    // Decoding a sample drops its specials: only the document's tokens remain.
    let ids: Vec<u32> = s.input_ids.iter().map(|&i| i as u32).collect();
    let in_window = toks.len().min(seq - 1);
    assert_eq!(t.decode(&ids), t.decode(&ids[1..1 + in_window]), "{doc:?}: decode");
}

#[test]
fn dataset_places_hf_specials_and_ignores_padded_targets_in_the_loss() {
    let scattered = HfTokenizer::from_json_str(SCATTERED_SPECIALS).unwrap();
    let byte_bpe = HfTokenizer::from_json_str(BYTE_BPE).unwrap();
    let cases: [(&dyn Tokenizer, [&str; 3]); 3] = [
        (&scattered, ["the cat sat", "sat", "the cat sat the cat sat the cat"]),
        (&byte_bpe, ["hello world", "he", "hello hello hello"]),
        (&ByteTokenizer, ["hi", "", "a long document"]),
    ];
    for (t, docs) in cases {
        let seq = 7;
        let ds = PretrainingDataset::new(&docs, t, seq).unwrap();
        for (i, doc) in docs.iter().enumerate() {
            check_sample(t, &ds, i, doc);
        }
        // Padded targets hold the ignore index the trainer passes (pad_id): the mean
        // loss runs over the other positions only and they get no gradient.
        let batch = ds.batch(&[0, 1, 2]).unwrap();
        let targets = batch.target_ids.to_vec::<i64>().unwrap();
        let vocab = t.vocab_size();
        let mut rng = tpar_tensor::Rng::new(5);
        let logits = tpar_tensor::Tensor::randn([3, seq, vocab], tpar_tensor::DType::F64, &mut rng)
            .unwrap()
            .requires_grad_(true);
        let ignore = ds.pad_id() as i64;
        let loss = logits.cross_entropy(&batch.target_ids, ignore).unwrap();
        let x = logits.to_vec_f64().unwrap();
        let kept: Vec<usize> = (0..3 * seq).filter(|&r| targets[r] != ignore).collect();
        assert!(kept.len() < 3 * seq, "some targets are padding");
        let want = kept
            .iter()
            .map(|&r| {
                let row = &x[r * vocab..(r + 1) * vocab];
                let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln() - row[targets[r] as usize]
            })
            .sum::<f64>()
            / kept.len() as f64;
        let got = loss.item().unwrap();
        assert!((got - want).abs() <= 1e-12 * (1.0 + want.abs()), "loss {got} vs {want}");
        loss.backward().unwrap();
        let g = logits.grad().unwrap().to_vec_f64().unwrap();
        for r in 0..3 * seq {
            let zero = g[r * vocab..(r + 1) * vocab].iter().all(|&v| v == 0.0);
            assert_eq!(zero, targets[r] == ignore, "row {r}: gradient only where not padding");
        }
    }
}
