//! HuggingFace `tokenizer.json` files through [`HfTokenizer`] (the `tokenizers` crate):
//! ids, decoding, special tokens, the file's own truncation and padding, typed errors,
//! and the specials a pretraining dataset places.

use tpar_data::{
    load_tokenizer, ByteTokenizer, DataError, HfTokenizer, PretrainingDataset, Tokenizer,
};

// The `tokenizer.json` fixtures below are complete files: Python `tokenizers` 0.23.3
// loads each and writes it back unchanged with `Tokenizer.to_str()` (but for BYTE_BPE's
// merges, kept in the older "a b" form GPT-2's file has), and every expected id list
// was checked with that package on the same file.

const WORD_LEVEL: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "[PAD]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 1, "content": "[BOT]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 2, "content": "[EOT]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 3, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": {"type": "Lowercase"},
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[PAD]": 0, "[BOT]": 1, "[EOT]": 2, "[UNK]": 3,
            "the": 4, "cat": 5, "sat": 6, ".": 7, "on": 8, "mat": 9}, "unk_token": "[UNK]"}
}"#;

#[test]
fn hf_word_level_encodes_and_decodes() {
    let t = HfTokenizer::from_json_str(WORD_LEVEL).unwrap();
    assert_eq!(t.encode("The cat sat on the mat.").unwrap(), vec![4, 5, 6, 8, 4, 9, 7]);
    assert_eq!(t.encode("The dog sat").unwrap(), vec![4, 3, 6], "unknown word -> [UNK]");
    assert_eq!(t.encode("[BOT]the cat[EOT]").unwrap(), vec![1, 4, 5, 2], "added tokens first");
    assert_eq!((t.pad_id(), t.bot_id(), t.eot_id(), t.vocab_size()), (0, 1, 2, 10));
    assert_eq!(t.decode(&[1, 4, 5, 6, 2, 0]).unwrap(), "the cat sat");
}

#[test]
fn hf_files_truncation_and_padding_are_switched_off() {
    // The dataset clips and pads itself: a file's own settings must not cut or pad text.
    let file = WORD_LEVEL
        .replace(
            r#""truncation": null"#,
            r#""truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst",
                "stride": 0}"#,
        )
        .replace(
            r#""padding": null"#,
            r#""padding": {"strategy": {"Fixed": 12}, "direction": "Right",
                "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"}"#,
        );
    let t = HfTokenizer::from_json_str(&file).unwrap();
    assert_eq!(t.encode("the cat sat on the mat").unwrap(), vec![4, 5, 6, 8, 4, 9]);
    assert!(t.inner().get_truncation().is_none());
    assert!(t.inner().get_padding().is_none());
    // The same for a tokenizer built with the `tokenizers` API.
    let raw: tpar_data::tokenizers::Tokenizer = file.parse().unwrap();
    assert_eq!(raw.get_truncation().map(|t| t.max_length), Some(2));
    let t = HfTokenizer::from_hf(raw).unwrap();
    assert_eq!(t.encode("the cat sat on the mat").unwrap(), vec![4, 5, 6, 8, 4, 9]);
}

/// A tiny GPT-2-style byte-level BPE: "Ġ" is the byte-level space; merges in GPT-2's
/// "a b" string form.
const BYTE_BPE: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 12, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": true, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
  "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                     "use_regex": true},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null,
    "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
    "byte_fallback": false, "ignore_merges": false,
    "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6, "d": 7, "he": 8,
              "ll": 9, "hell": 10, "Ġw": 11, "<|endoftext|>": 12, "!": 13, "'": 14, "s": 15},
    "merges": ["h e", "l l", "he ll", "Ġ w"]}
}"#;

#[test]
fn hf_byte_level_bpe_merges_by_rank_and_round_trips() {
    let t = HfTokenizer::from_json_str(BYTE_BPE).unwrap();
    // "hello world": "hello" -> hell + o; " world" -> Ġw o r l d.
    assert_eq!(t.encode("hello world").unwrap(), vec![10, 3, 11, 3, 6, 2, 7]);
    assert_eq!(t.decode(&t.encode("hello world!").unwrap()).unwrap(), "hello world!");
    assert_eq!(t.decode(&t.encode("he's").unwrap()).unwrap(), "he's");
    // BOT and EOT both fall back to <|endoftext|>; PAD is missing and gets a new id.
    assert_eq!((t.bot_id(), t.eot_id()), (12, 12));
    assert_eq!(t.pad_id(), 16);
    assert_eq!(t.vocab_size(), 17);
    assert_eq!(t.id_to_token(16).as_deref(), Some("[PAD]"));
    assert_eq!(t.token_to_id("[PAD]"), None, "not a token of the file");
    assert_eq!(t.token_to_id("hell"), Some(10));
    assert_eq!(t.id_to_token(10).as_deref(), Some("hell"));
}

/// A Llama-2-style file: Prepend/Replace normalizer, byte-fallback BPE, and the
/// Replace/ByteFallback/Fuse/Strip decoder chain.
const LLAMA_LIKE: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
  "pre_tokenizer": null,
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
               {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
             {"Sequence": {"id": "A", "type_id": 0}},
             {"SpecialToken": {"id": "<s>", "type_id": 1}},
             {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
    "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
    "byte_fallback": true, "ignore_merges": false,
    "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, "▁": 5, "h": 6,
              "i": 7, "▁h": 8, "▁hi": 9, "c": 10, "a": 11, "f": 12},
    "merges": [["▁", "h"], ["▁h", "i"]]}
}"#;

#[test]
fn hf_llama_style_bpe_uses_byte_fallback() {
    let t = HfTokenizer::from_json_str(LLAMA_LIKE).unwrap();
    // The post-processor's <s> template is not applied: the dataset adds [BOT] itself.
    assert_eq!(t.encode("hi hi").unwrap(), vec![9, 9]);
    // "é" is not in the vocabulary: its UTF-8 bytes C3 A9.
    assert_eq!(t.encode("café").unwrap(), vec![5, 10, 11, 12, 3, 4]);
    assert_eq!(t.decode(&t.encode("hi café").unwrap()).unwrap(), "hi café");
    assert_eq!(t.encode("x").unwrap(), vec![5, 0], "no byte tokens for x: <unk>");
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id()), (1, 2, 13));
}

const WORD_PIECE: &str = r###"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "[PAD]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 1, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 2, "content": "[CLS]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 3, "content": "[SEP]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                 "strip_accents": null, "lowercase": true},
  "pre_tokenizer": {"type": "BertPreTokenizer"},
  "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]},
  "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
  "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "play": 4, "##ing": 5,
                      "##ed": 6, "we": 7, ".": 8}}
}"###;

#[test]
fn hf_word_piece_splits_greedily() {
    let t = HfTokenizer::from_json_str(WORD_PIECE).unwrap();
    assert_eq!(t.encode("We played.").unwrap(), vec![7, 4, 6, 8]);
    assert_eq!(t.encode("playful").unwrap(), vec![1]);
    let ids = t.encode("We were playing.").unwrap();
    assert_eq!(t.decode(&ids).unwrap(), "we playing.", "[UNK] is special: skipped");
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id()), (2, 3, 0));
}

/// A Llama-3-style file with a tiny vocabulary: a `Split` with Llama-3's regex
/// (`\p{L}`/`\p{N}` classes, a case-insensitive group, the `(?!\S)` lookahead) then a
/// ByteLevel pre-tokenizer without its own regex, an ignore_merges BPE over the
/// byte-level alphabet of one sentence, specials after the vocabulary and Llama-3's
/// `<|begin_of_text|>` template.
const LLAMA3_STYLE: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 43, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": false, "special": true},
    {"id": 44, "content": "<|end_of_text|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
  "post_processor": {"type": "Sequence", "processors": [
    {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
    {"type": "TemplateProcessing",
     "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}],
     "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
              {"Sequence": {"id": "A", "type_id": 0}},
              {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
              {"Sequence": {"id": "B", "type_id": 1}}],
     "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [43],
                                              "tokens": ["<|begin_of_text|>"]}}}]},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null,
    "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
    "byte_fallback": false, "ignore_merges": true,
    "vocab": {"!": 0, "'": 1, "1": 2, "2": 3, "3": 4, "4": 5, "5": 6, "H": 7, "I": 8, "S": 9,
              "T": 10, "d": 11, "e": 12, "k": 13, "l": 14, "o": 15, "r": 16, "w": 17,
              "¶": 18, "Ã": 19, "Ċ": 20, "Ġ": 21, "Ġw": 22, "Ã¶": 23, "ll": 24, "He": 25,
              "Hell": 26, "Hello": 27, "ĠwÃ¶": 28, "rl": 29, "ĠwÃ¶rl": 30, "34": 31, "12": 32,
              "123": 33, "45": 34, "ĠĠ": 35, "ĊĊ": 36, "!ĊĊ": 37, "'S": 38, "IT": 39,
              "ĠIT": 40, "ok": 41, "Ġok": 42},
    "merges": [["Ġ", "w"], ["Ã", "¶"], ["l", "l"], ["H", "e"], ["He", "ll"], ["Hell", "o"],
               ["Ġw", "Ã¶"], ["r", "l"], ["ĠwÃ¶", "rl"], ["3", "4"], ["1", "2"],
               ["12", "3"], ["4", "5"], ["Ġ", "Ġ"], ["Ċ", "Ċ"], ["!", "ĊĊ"], ["'", "S"],
               ["I", "T"], ["Ġ", "IT"], ["o", "k"], ["Ġ", "ok"]]}
}"#;

#[test]
fn hf_llama3_split_regex_pre_tokenizer_runs() {
    let t = HfTokenizer::from_json_str(LLAMA3_STYLE).unwrap();
    let text = "Hello wörld!\n\n  IT'S 12345 ok";
    // Pieces: Hello | " wörld" (ö is \p{L}) | "!\n\n" | " " (\s+(?!\S) leaves the last
    // space to " IT") | " IT" | "'S" (case-insensitive) | " " | 123 | 45 (\p{N}{1,3}) | " ok".
    // GPT-2's split would give "!", "\n\n", "'", "S", 12, 34, 5 instead.
    let ids = t.encode(text).unwrap();
    assert_eq!(ids, vec![27, 30, 11, 37, 21, 40, 38, 21, 33, 34, 42]);
    assert!(!ids.contains(&43), "the <|begin_of_text|> template is not applied");
    assert_eq!(t.decode(&ids).unwrap(), text);
    assert_eq!((t.bot_id(), t.eot_id(), t.pad_id(), t.vocab_size()), (43, 44, 45, 46));
    let mut framed = vec![t.bot_id()];
    framed.extend(&ids);
    framed.extend([t.eot_id(), t.pad_id()]);
    assert_eq!(t.decode(&framed).unwrap(), text, "the dataset's specials are skipped");
}

/// WordLevel behind a Unicode normalizer (`NORM`: `NFKC` or `NFC`).
const NORMALIZED: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": {"type": "NORM"},
  "pre_tokenizer": {"type": "WhitespaceSplit"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "café": 1, "fine": 2, "ab": 3, "1": 4},
            "unk_token": "[UNK]"}
}"#;

#[test]
fn hf_nfkc_and_nfc_normalizers_run() {
    // Decomposed "café", the "ﬁ" ligature, full-width "ａｂ", circled "①", composed "café".
    let text = "cafe\u{301} \u{fb01}ne \u{ff41}\u{ff42} \u{2460} caf\u{e9}";
    let nfkc = HfTokenizer::from_json_str(&NORMALIZED.replace("NORM", "NFKC")).unwrap();
    assert_eq!(nfkc.encode(text).unwrap(), vec![1, 2, 3, 4, 1]);
    // NFC only composes: the compatibility forms stay and are unknown.
    let nfc = HfTokenizer::from_json_str(&NORMALIZED.replace("NORM", "NFC")).unwrap();
    assert_eq!(nfc.encode(text).unwrap(), vec![1, 0, 0, 0, 1]);
}

#[test]
fn hf_broken_files_are_typed_errors() {
    let load_err = |json: &str| match HfTokenizer::from_json_str(json) {
        Err(DataError::Tokenizer { op, origin, why }) => {
            assert_eq!(op, "load", "{json}");
            assert_eq!(origin, "tokenizer.json from a string");
            why
        }
        other => panic!("{json}: expected a load error, got {other:?}"),
    };
    // Malformed JSON, and JSON that is not a tokenizer.
    assert!(load_err("{").contains("EOF"));
    assert!(load_err(&WORD_LEVEL[..WORD_LEVEL.len() / 2]).contains("EOF"));
    assert!(load_err("[1, 2]").contains("invalid type"));
    assert!(load_err("{}").contains("Model missing"));
    let bad_merge = BYTE_BPE.replace(r#""Ġ w"]"#, r#""Ġ z"]"#);
    assert!(load_err(&bad_merge).contains("`z` out of vocabulary"));
    let unknown = WORD_LEVEL.replace(r#""type": "Whitespace""#, r#""type": "Whitespaces""#);
    assert!(!load_err(&unknown).is_empty());
    let bad_regex = LLAMA3_STYLE.replace(r#""Regex": "(?i:"#, r#""Regex": "(?!|(?i:"#);
    assert!(!load_err(&bad_regex).is_empty());

    let path = std::path::Path::new("/nonexistent/tokenizer.json");
    match HfTokenizer::from_file(path) {
        Err(e @ DataError::Tokenizer { op: "read", .. }) => {
            assert!(e.to_string().starts_with("tokenizer /nonexistent/tokenizer.json: read: "))
        }
        other => panic!("expected a read error, got {other:?}"),
    }
    let e = load_tokenizer(Some(path)).err().unwrap();
    assert!(matches!(e, DataError::Tokenizer { op: "read", .. }), "{e}");
}

#[test]
fn hf_tokenizer_loads_from_a_file() {
    let dir = std::env::temp_dir().join(format!("tpar-data-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, WORD_LEVEL).unwrap();
    let t = load_tokenizer(Some(&path)).unwrap();
    assert_eq!(t.encode("the cat").unwrap(), vec![4, 5]);
    std::fs::write(&path, "{\"model\": 1}").unwrap();
    match HfTokenizer::from_file(&path) {
        Err(DataError::Tokenizer { op: "load", origin, .. }) => {
            assert_eq!(origin, path.display().to_string())
        }
        other => panic!("expected a load error, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------
// Special tokens
// ---------------------------------------------------------------------------------------

/// WordLevel with the specials at scattered ids, `<s>`/`</s>` as well (which lose to
/// `[BOT]`/`[EOT]`), and one added token that is not special.
const SCATTERED_SPECIALS: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 3, "content": "[EOT]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 5, "content": "[BOT]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 7, "content": "[PAD]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 8, "content": "<sep>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": true, "special": false},
    {"id": 9, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"<s>": 0, "</s>": 1, "the": 2, "[EOT]": 3,
            "cat": 4, "[BOT]": 5, "sat": 6, "[PAD]": 7, "<sep>": 8, "[UNK]": 9},
            "unk_token": "[UNK]"}
}"#;

/// Llama-3 names for BOT and EOT next to `<s>`/`</s>`, and no padding token. As in a
/// real file, added tokens missing from the model's vocabulary take the ids right after
/// it (`tokenizers` renumbers any others that way when it loads the file).
const LLAMA3_NAMES: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 4, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": false, "special": true},
    {"id": 5, "content": "<|end_of_text|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3},
            "unk_token": "<unk>"}
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
    assert_eq!(t.bot_id(), 4, "<|begin_of_text|> comes before <s>");
    assert_eq!(t.eot_id(), 5, "<|end_of_text|> comes before </s>");
    // No padding token in the file: a new id past the vocabulary, named [PAD].
    assert_eq!((t.pad_id(), t.vocab_size()), (6, 7));
    assert_eq!(t.id_to_token(t.pad_id()).as_deref(), Some("[PAD]"));
    assert_eq!(t.decode(&[4, 3, 5, 6]).unwrap(), "hi");
}

#[test]
fn hf_added_tokens_match_inside_text_and_decode_drops_only_specials() {
    // As HF `tokenizers`: added tokens are cut out of the raw text first, even with no
    // space around them; decoding skips special tokens, not other added ones.
    let t = HfTokenizer::from_json_str(SCATTERED_SPECIALS).unwrap();
    let (bot, eot, pad) = (t.bot_id(), t.eot_id(), t.pad_id());
    let (the, cat, sat, sep) = (2, 4, 6, 8);
    assert_eq!(t.encode("[BOT]").unwrap(), vec![bot]);
    let ids = t.encode("the[PAD]cat <sep> sat[EOT]").unwrap();
    assert_eq!(ids, vec![the, pad, cat, sep, sat, eot]);
    assert_eq!(t.encode("<s>the</s>").unwrap(), vec![0, the, 1]);
    let text = t.decode(&[bot, the, cat, sep, sat, eot, pad, pad]).unwrap();
    assert_eq!(text, "the cat <sep> sat");
    assert_eq!(t.decode(&[0, the, 1, 9]).unwrap(), "the", "<s>, </s> and [UNK] are special");

    // Byte-level BPE: the file's <|endoftext|> (BOT and EOT both) is matched mid-word;
    // the [PAD] the tokenizer had to add is not in the file, so text never yields it.
    let t = HfTokenizer::from_json_str(BYTE_BPE).unwrap();
    let (eot, pad) = (t.eot_id(), t.pad_id());
    let hello = t.encode("hello").unwrap();
    let mut want = hello.clone();
    want.push(eot);
    want.extend(&hello);
    assert_eq!(t.encode("hello<|endoftext|>hello").unwrap(), want);
    assert!(!t.encode("[PAD] hello [PAD]").unwrap().contains(&pad));
    let mut ids = vec![t.bot_id()];
    ids.extend(t.encode("hello world").unwrap());
    ids.extend([eot, pad, pad, 9999]);
    assert_eq!(t.decode(&ids).unwrap(), "hello world", "unknown ids are skipped too");
}

/// Checks one sample of a document of `n` tokens: `[BOT]` first, then the tokens,
/// `[EOT]` right after them (unless clipped), `[PAD]` after that; targets are the
/// inputs shifted by one, `[PAD]` (the loss's ignore_index) where nothing follows.
fn check_sample(t: &dyn Tokenizer, ds: &PretrainingDataset, index: usize, doc: &str) {
    let s = ds.get(index).unwrap();
    let seq = ds.seq_length();
    let (bot, eot, pad) = (t.bot_id() as i64, t.eot_id() as i64, t.pad_id() as i64);
    let toks: Vec<i64> = t.encode(doc).unwrap().iter().map(|&i| i as i64).collect();
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
    let want = t.decode(&ids[1..1 + in_window]).unwrap();
    assert_eq!(t.decode(&ids).unwrap(), want, "{doc:?}: decode");
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
